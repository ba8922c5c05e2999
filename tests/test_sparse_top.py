"""sparse-top ([Gar23] eqs. 6.13-6.21) and its loss (eqs. 6.24-6.25) against the thesis's
fixtures, independent brute-force projections, finite differences and the stated properties."""

from __future__ import annotations

import itertools

import pytest
import torch

from setvalued.losses import LOSSES, build_loss
from setvalued.losses.parameters import LOSS_PARAMETERS
from setvalued.losses.sparse_top import (
    SparseTopLoss,
    sparse_top,
    sparse_top_jacobian,
    sparse_top_loss,
    sparse_top_threshold,
    sparse_top_threshold_bisect,
    sparsemax,
)

torch.set_num_threads(1)
F64 = torch.float64


def brute_threshold(s: torch.Tensor, k: float, steps: int = 100) -> float:
    """lambda with sum_j clip(s_j - lambda, 0, 1) = k by plain bisection in float64 (no exact step)."""
    low, high = float(s.min()) - 1.0, float(s.max())
    for _ in range(steps):
        mid = 0.5 * (low + high)
        if float((s - mid).clamp(0, 1).sum()) >= k:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def reference_sparsemax(z: torch.Tensor) -> torch.Tensor:
    """Martins & Astudillo (2016), Algorithm 1: sort, find the support size, threshold."""
    out = []
    for row in z:
        desc = torch.sort(row, descending=True).values
        cums = desc.cumsum(0)
        ks = torch.arange(1, row.numel() + 1, dtype=row.dtype)
        support = int((1 + ks * desc > cums).nonzero().max()) + 1
        tau = (cums[support - 1] - 1) / support
        out.append((row - tau).clamp(min=0))
    return torch.stack(out)


def eq_6_25(s: torch.Tensor, y: torch.Tensor) -> float:
    """l_sparse-top(s, Y) written as eq. 6.25, with H, M of the projection on |Y|."""
    size = int(y.sum())
    lam = brute_threshold(s, size)
    q = (s - lam).clamp(0, 1)
    in_h = q >= 1 - 1e-12
    in_m = (q > 1e-12) & ~in_h
    return float(-(s * y).sum() + (s[in_h] - 0.5).sum() + 0.5 * (s[in_m] ** 2 - lam**2).sum() + size / 2)


# ----------------------------------------------------------------------------------------------
# fixtures of the thesis digest (computed for [Gar23] eqs. 6.14-6.15)
# ----------------------------------------------------------------------------------------------

FIXTURES = [
    ((2.4, 2.6, 2.3, 0.5), 2, 1.766667, (0.633333, 0.833333, 0.533333, 0.0)),
    ((0.9, 0.2, 0.1, -0.4, 0.05), 1, 0.066667, (0.833333, 0.133333, 0.033333, 0.0, 0.0)),
    ((0.9, 0.2, 0.1, -0.4, 0.05), 2, -0.216667, (1.0, 0.416667, 0.316667, 0.0, 0.266667)),
]


@pytest.mark.parametrize("method", ["sort", "bisect"])
@pytest.mark.parametrize("scores, k, lam, expected", FIXTURES)
def test_thesis_fixtures(scores, k, lam, expected, method):
    s = torch.tensor(scores, dtype=F64)
    threshold = sparse_top_threshold if method == "sort" else sparse_top_threshold_bisect
    assert float(threshold(s, k)) == pytest.approx(lam, abs=1e-6)
    assert sparse_top(s, k, method=method).tolist() == pytest.approx(expected, abs=1e-6)
    # float32 too, and a batch of the rows gives the same as each row
    assert sparse_top(s.float(), k, method=method).tolist() == pytest.approx(expected, abs=1e-5)


def test_batch_with_one_k_per_row_equals_row_by_row():
    rows = torch.tensor(
        [[2.4, 2.6, 2.3, 0.5, -1.0], [0.9, 0.2, 0.1, -0.4, 0.05], [0.9, 0.2, 0.1, -0.4, 0.05]], dtype=F64
    )
    ks = torch.tensor([2.0, 1.0, 2.0], dtype=F64)
    together = sparse_top(rows, ks)
    for row, k, got in zip(rows, ks, together):
        assert torch.allclose(got, sparse_top(row, float(k)), atol=1e-12)


# ----------------------------------------------------------------------------------------------
# the projection: independent references and properties
# ----------------------------------------------------------------------------------------------


def _random_cases(seed: int, n: int = 150):
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for _ in range(n):
        length = int(torch.randint(1, 25, (1,), generator=gen))
        scale = float(torch.rand(1, generator=gen)) * 4 + 0.1
        s = torch.randn(length, generator=gen, dtype=F64) * scale
        if torch.rand(1, generator=gen) < 0.3:  # ties and exact breakpoints
            s = torch.round(s * 2) / 2
        k = int(torch.randint(0, length + 1, (1,), generator=gen))
        cases.append((s, k))
    return cases


def test_sort_and_bisect_and_brute_force_agree_with_ties_and_edge_k():
    for s, k in _random_cases(0):
        q_sort = sparse_top(s, k, method="sort")
        q_bisect = sparse_top(s, k, method="bisect")
        q_brute = (s - brute_threshold(s, k)).clamp(0, 1)
        assert torch.allclose(q_sort, q_brute, atol=1e-9), (s, k)
        assert torch.allclose(q_bisect, q_sort, atol=1e-9), (s, k)
        if bool(((q_sort > 0) & (q_sort < 1)).any()):  # the threshold is unique when M is not empty
            assert float(sparse_top_threshold(s, k)) == pytest.approx(
                float(sparse_top_threshold_bisect(s, k)), abs=1e-9
            )


def test_batched_random_rows_sum_to_k_and_lie_in_the_unit_box():
    gen = torch.Generator().manual_seed(1)
    s = torch.randn(500, 40, generator=gen, dtype=F64) * 3
    k = torch.randint(0, 41, (500,), generator=gen).to(F64)
    for method in ("sort", "bisect"):
        q = sparse_top(s, k, method=method)
        assert torch.allclose(q.sum(dim=1), k, atol=1e-9)
        assert bool((q >= 0).all()) and bool((q <= 1).all())
    # float32 scores: the sum is K to float32 precision
    q32 = sparse_top(s.float(), k.float())
    assert q32.dtype == torch.float32
    assert torch.allclose(q32.sum(dim=1), k.float(), atol=1e-4)
    # half precision is computed in float32
    assert sparse_top(s[:4].half(), 2).dtype == torch.float32


def test_non_integer_k_is_a_valid_capped_simplex():
    s = torch.tensor([[0.3, -0.2, 1.5, 0.9]], dtype=F64)
    q = sparse_top(s, 1.5)
    assert float(q.sum()) == pytest.approx(1.5)
    assert torch.allclose(q, (s - brute_threshold(s[0], 1.5)).clamp(0, 1), atol=1e-10)


def test_edge_values_of_k():
    s = torch.tensor([[0.3, -0.2, 1.5, 0.9]], dtype=F64)
    assert sparse_top(s, 0).tolist() == [[0.0, 0.0, 0.0, 0.0]]
    assert sparse_top(s, 4).tolist() == [[1.0, 1.0, 1.0, 1.0]]
    assert sparse_top(torch.tensor([7.0]), 1).tolist() == [1.0]
    with pytest.raises(ValueError, match="k must lie in"):
        sparse_top(s, 5)
    with pytest.raises(ValueError, match="k must lie in"):
        sparse_top(s, -1)
    with pytest.raises(ValueError, match="one value per row"):
        sparse_top(s, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="method"):
        sparse_top(s, 1, method="heap")


def test_sparsemax_is_k_1_and_matches_martins_astudillo():
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(200, 12, generator=gen, dtype=F64) * 2
    assert torch.allclose(sparsemax(z), reference_sparsemax(z), atol=1e-12)
    assert torch.allclose(sparsemax(z), sparse_top(z, 1))


def test_idempotent_on_the_capped_simplex_and_shift_equivariant():
    gen = torch.Generator().manual_seed(3)
    s = torch.randn(100, 9, generator=gen, dtype=F64) * 2
    k = torch.randint(1, 9, (100,), generator=gen).to(F64)
    q = sparse_top(s, k)
    assert torch.allclose(sparse_top(q, k), q, atol=1e-12)
    assert torch.allclose(sparse_top(s + 3.7, k), q, atol=1e-9)


def test_it_is_the_nearest_point_of_the_capped_simplex():
    """Optimality (eq. 6.13): no random point of Delta_K, nor a feasible move along q, is closer."""
    gen = torch.Generator().manual_seed(4)
    for _ in range(50):
        s = torch.randn(6, generator=gen, dtype=F64) * 2
        k = int(torch.randint(1, 6, (1,), generator=gen))
        q = sparse_top(s, k)
        best = float(((s - q) ** 2).sum())
        others = sparse_top(torch.randn(200, 6, generator=gen, dtype=F64) * 3, k)  # points of Delta_K
        assert bool((((s - others) ** 2).sum(dim=1) >= best - 1e-12).all())
        # and the segment from q towards any of them does not get closer (first-order condition)
        assert bool((((s - q) * (others - q)).sum(dim=1) <= 1e-10).all())


# ----------------------------------------------------------------------------------------------
# derivatives ([Gar23] eqs. 6.17-6.21)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_gradcheck_against_finite_differences(k):
    gen = torch.Generator().manual_seed(10 + k)
    s = (torch.randn(4, 7, generator=gen, dtype=F64) * 1.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: sparse_top(x, k), (s,), eps=1e-6, atol=1e-6)
    assert torch.autograd.gradcheck(lambda x: sparse_top(x, k, method="bisect"), (s,), eps=1e-6, atol=1e-6)


def test_gradcheck_with_one_k_per_row():
    gen = torch.Generator().manual_seed(20)
    s = (torch.randn(5, 6, generator=gen, dtype=F64) * 2).requires_grad_()
    ks = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=F64)
    assert torch.autograd.gradcheck(lambda x: sparse_top(x, ks), (s,), eps=1e-6, atol=1e-6)


def test_closed_form_jacobian_equals_autograd_and_finite_differences():
    gen = torch.Generator().manual_seed(30)
    for _ in range(20):
        s = torch.randn(8, generator=gen, dtype=F64) * 2
        k = int(torch.randint(1, 8, (1,), generator=gen))
        closed = sparse_top_jacobian(s, k)
        auto = torch.autograd.functional.jacobian(lambda x: sparse_top(x, k), s)
        assert torch.allclose(closed, auto, atol=1e-12)
        h = 1e-6
        finite = torch.stack(
            [(sparse_top(s + h * e, k) - sparse_top(s - h * e, k)) / (2 * h) for e in torch.eye(8, dtype=F64)], dim=1
        )
        assert torch.allclose(closed, finite, atol=1e-6)
        # eq. 6.21: symmetric, idempotent (a projection matrix), zero on 1
        assert torch.allclose(closed, closed.T) and torch.allclose(closed @ closed, closed, atol=1e-12)
        assert torch.allclose(closed @ torch.ones(8, dtype=F64), torch.zeros(8, dtype=F64), atol=1e-12)


def test_jacobian_of_a_vertex_is_zero():
    s = torch.tensor([[3.0, 2.5, -1.0, -2.0]], dtype=F64, requires_grad=True)
    q = sparse_top(s, 2)  # (1, 1, 0, 0): M is empty
    assert q.tolist() == [[1.0, 1.0, 0.0, 0.0]]
    (grad,) = torch.autograd.grad((q * torch.arange(4.0, dtype=F64)).sum(), s)
    assert grad.tolist() == [[0.0, 0.0, 0.0, 0.0]]
    assert sparse_top_jacobian(s.detach(), 2).abs().sum() == 0


# ----------------------------------------------------------------------------------------------
# the loss ([Gar23] eqs. 6.12, 6.24-6.25, Proposition 6.2.1)
# ----------------------------------------------------------------------------------------------


def _random_multi_hot(gen, batch, classes, allow_empty=True):
    y = (torch.rand(batch, classes, generator=gen) < 0.3).to(F64)
    if not allow_empty:
        y[torch.arange(batch), torch.randint(0, classes, (batch,), generator=gen)] = 1
    return y


def test_loss_value_is_eq_6_25_and_sparsemax_loss_is_eq_6_12():
    gen = torch.Generator().manual_seed(40)
    s = torch.randn(60, 7, generator=gen, dtype=F64) * 2
    y = _random_multi_hot(gen, 60, 7)
    values = sparse_top_loss(s, y)
    for row, target, value in zip(s, y, values):
        assert float(value) == pytest.approx(eq_6_25(row, target), abs=1e-9)
    # class indices: |Y| = 1, eq. 6.12 with tau the sparsemax threshold and S its support
    labels = torch.randint(0, 7, (60,), generator=gen)
    values = sparse_top_loss(s, labels)
    for row, label, value in zip(s, labels, values):
        p = reference_sparsemax(row[None])[0]
        support = p > 0
        tau = float(row[support][0] - p[support][0])
        expected = -float(row[label]) + 0.5 * float((row[support] ** 2 - tau**2).sum()) + 0.5
        assert float(value) == pytest.approx(expected, abs=1e-9)


def test_fixture_loss_value():
    s = torch.tensor([[2.4, 2.6, 2.3, 0.5]], dtype=F64)
    y = torch.tensor([[1.0, 1.0, 0.0, 0.0]], dtype=F64)
    p = torch.tensor([0.6333333333333333, 0.8333333333333333, 0.5333333333333333, 0.0], dtype=F64)
    expected = float((s[0] * p).sum() - 0.5 * (p * p).sum() - (s[0] * y[0]).sum() + 1.0)
    assert float(sparse_top_loss(s, y)) == pytest.approx(expected, abs=1e-12)
    assert float(sparse_top_loss(s, y)) == pytest.approx(eq_6_25(s[0], y[0]), abs=1e-12)


def test_loss_is_non_negative_and_zero_iff_the_projection_is_the_target():
    gen = torch.Generator().manual_seed(50)
    s = torch.randn(400, 9, generator=gen, dtype=F64) * 3
    y = _random_multi_hot(gen, 400, 9)
    values = sparse_top_loss(s, y)
    p = sparse_top(s, y.sum(dim=1))
    assert bool((values >= -1e-12).all())
    differs = (p - y).abs().amax(dim=1) > 1e-9
    assert bool((values[differs] > 0).all())
    # at a target (s_j = 2 on Y, 0 elsewhere) the projection is y and the loss 0
    exact = 2.0 * y
    assert torch.allclose(sparse_top(exact, y.sum(dim=1)), y)
    assert torch.allclose(sparse_top_loss(exact, y), torch.zeros(400, dtype=F64), atol=1e-12)
    # an empty target: p = 0, loss 0
    assert float(sparse_top_loss(s[:1], torch.zeros(1, 9, dtype=F64))) == 0.0


def test_loss_gradient_is_p_minus_y_and_matches_finite_differences():
    gen = torch.Generator().manual_seed(60)
    s = (torch.randn(6, 8, generator=gen, dtype=F64) * 2).requires_grad_()
    y = _random_multi_hot(gen, 6, 8, allow_empty=False)
    (grad,) = torch.autograd.grad(sparse_top_loss(s, y).sum(), s)
    assert torch.allclose(grad, sparse_top(s.detach(), y.sum(dim=1)) - y, atol=1e-14)
    assert torch.autograd.gradcheck(lambda x: sparse_top_loss(x, y), (s,), eps=1e-6, atol=1e-6)
    labels = torch.randint(0, 8, (6,), generator=gen)
    assert torch.autograd.gradcheck(lambda x: sparse_top_loss(x, labels), (s,), eps=1e-6, atol=1e-6)


def test_loss_is_convex_along_random_segments():
    gen = torch.Generator().manual_seed(70)
    y = _random_multi_hot(gen, 200, 6, allow_empty=False)
    a = torch.randn(200, 6, generator=gen, dtype=F64) * 3
    b = torch.randn(200, 6, generator=gen, dtype=F64) * 3
    la, lb = sparse_top_loss(a, y), sparse_top_loss(b, y)
    for t in (0.1, 0.25, 0.5, 0.9):
        lt = sparse_top_loss((1 - t) * a + t * b, y)
        assert bool((lt <= (1 - t) * la + t * lb + 1e-10).all())
    # first-order condition: l(b) >= l(a) + <grad l(a), b - a>
    grad = sparse_top(a, y.sum(dim=1)) - y
    assert bool((lb >= la + (grad * (b - a)).sum(dim=1) - 1e-10).all())


# ----------------------------------------------------------------------------------------------
# the registered loss
# ----------------------------------------------------------------------------------------------


def test_registered_and_declared_without_parameters():
    assert LOSSES["sparse_top"] is SparseTopLoss
    assert LOSS_PARAMETERS["sparse_top"] == {}
    loss = build_loss("sparse_top", class_counts=[3, 4, 5], num_classes=3, num_examples=12)
    assert isinstance(loss, SparseTopLoss) and loss.head == "linear"
    with pytest.raises(ValueError, match="no parameter 'k'"):
        build_loss("sparse_top", k=2)


def test_module_reductions_and_target_forms():
    gen = torch.Generator().manual_seed(80)
    s = torch.randn(5, 6, generator=gen)
    labels = torch.tensor([0, 5, 2, 2, 1])
    one_hot = torch.nn.functional.one_hot(labels, 6)
    per_sample = build_loss("sparse_top", reduction="none")(s, labels)
    assert per_sample.shape == (5,)
    assert torch.allclose(per_sample, build_loss("sparse_top", reduction="none")(s, one_hot))
    assert torch.allclose(per_sample, build_loss("sparse_top", reduction="none")(s, one_hot.bool()))
    assert torch.allclose(build_loss("sparse_top")(s, labels), per_sample.mean())
    assert torch.allclose(build_loss("sparse_top", reduction="sum")(s, labels), per_sample.sum())
    # half precision logits are computed in float32
    assert build_loss("sparse_top")(s.half(), labels).dtype == torch.float32


def test_module_trains_an_interpolating_linear_model_to_the_targets():
    """With more features than examples the targets are reachable: the loss goes to 0 and the
    projections on |Y| become the multi-hot targets (Proposition 6.2.1)."""
    gen = torch.Generator().manual_seed(90)
    x = torch.randn(16, 32, generator=gen)
    y = _random_multi_hot(gen, 16, 4, allow_empty=False).float()
    model = torch.nn.Linear(32, 4)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    loss_fn = build_loss("sparse_top")
    for _ in range(100):  # plain gradient descent (importing torch.optim takes seconds)
        loss = loss_fn(model(x), y)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            for parameter, grad in zip(model.parameters(), grads):
                parameter -= 0.5 * grad
    assert abs(float(loss.detach())) < 1e-6
    assert torch.allclose(sparse_top(model(x).detach(), y.sum(dim=1)), y, atol=1e-4)


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.tensor([0, 7]), r"class indices must lie in \[0, 5\]"),
        (torch.tensor([0.0, 1.0]), "integer class indices"),
        (torch.zeros(2, 5), "multi-hot matrix"),
        (torch.full((2, 6), 0.5), "only 0 and 1"),
    ],
)
def test_bad_targets_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        build_loss("sparse_top")(torch.zeros(2, 6), bad)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_label_out_of_range_fails_on_the_fixed_shape_path(backend):
    """Compiled, the loss takes its path of fixed shapes (``base.fixed_shapes``, as on a GPU) and
    skips the host-read check of the labels: a label out of range, negative or too large, must
    then fail in the lookup of the labels, never give a row of zeros and a finite loss (inductor
    turned the former scatter of ones into zeros into a comparison with arange, issue #34).
    Inductor's forward and backward launch at most 10 kernels (issue #34's goal; 11 with the
    scatter and a concatenation with zeros), and a label in range gives eager's value and gradient."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from benchmarks.loss_kernels import COMPILED_GOAL, launches_in

    torch._dynamo.reset()
    loss = build_loss("sparse_top")
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(8, 40, generator=gen, dtype=F64, requires_grad=True)
    targets = torch.randint(0, 40, (8,), generator=gen)
    compiled = torch.compile(loss, backend=backend, fullgraph=True)

    def value_and_grad(fn, y):
        value = fn(scores, y)
        return value, torch.autograd.grad(value, scores)[0]

    with inductor_config.patch(fx_graph_cache=False):  # a cache hit would generate no code to count
        (value, grad), codes = run_and_get_code(lambda: value_and_grad(compiled, targets))
    want_value, want_grad = value_and_grad(loss, targets)
    torch.testing.assert_close(value, want_value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
    for bad in (-1, 40):
        wrong = targets.clone()
        wrong[5] = bad
        with pytest.raises((IndexError, RuntimeError), match="out of (range|bounds)"):
            compiled(scores, wrong)
    if backend == "inductor":
        assert len(codes) == 2 and sum(launches_in(code) for code in codes) <= COMPILED_GOAL


def test_bad_outputs_are_refused():
    from setvalued.losses import TwoHeadOutput

    with pytest.raises(ValueError, match="two-head"):
        build_loss("sparse_top")(TwoHeadOutput(torch.zeros(2, 3), torch.zeros(2, 3)), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"\(batch, classes\)"):
        build_loss("sparse_top")(torch.zeros(3), torch.tensor([0]))


def test_all_small_k_subsets_brute_force():
    """For L = 4 and integer K, check the projection against every candidate partition (H, M, L)
    solved in closed form (q = 1 on H, s - lambda on M, 0 on L, sum K): the feasible candidate
    nearest to s, vertices (M empty) included."""
    gen = torch.Generator().manual_seed(100)
    for _ in range(25):
        s = torch.randn(4, generator=gen, dtype=F64) * 2
        for k in range(1, 4):
            best, best_q = None, None
            for labels in itertools.product("HML", repeat=4):
                h = [i for i, t in enumerate(labels) if t == "H"]
                m = [i for i, t in enumerate(labels) if t == "M"]
                q = torch.zeros(4, dtype=F64)
                q[h] = 1
                if m:
                    q[m] = s[m] - (float(s[m].sum()) + len(h) - k) / len(m)
                if bool(((q < -1e-12) | (q > 1 + 1e-12)).any()) or abs(float(q.sum()) - k) > 1e-9:
                    continue
                dist = float(((s - q) ** 2).sum())
                if best is None or dist < best:
                    best, best_q = dist, q
            assert torch.allclose(sparse_top(s, k), best_q, atol=1e-10)
