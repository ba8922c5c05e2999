"""Average-K losses against direct loop-based computations of their formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import setvalued.losses.avgk as avgk
from setvalued.losses import LOSSES, TwoHeadOutput, build_loss
from setvalued.losses.avgk import (
    ROLE_INIT_POSITIVE,
    ROLE_INIT_UNOBSERVED,
    AvgKTwoHeadLoss,
    TwoHeadClassifier,
    _largest_entries,
    candidate_indices,
    candidate_masks,
)

torch.set_num_threads(1)


def top_entries(values: torch.Tensor, count: int) -> torch.Tensor:
    """Bool mask (shape of ``values``) of the ``count`` largest entries of ``values``, ties at
    the threshold by flat position (lower first): ``_largest_entries`` as a mask."""
    chosen = torch.zeros(values.numel(), dtype=torch.bool, device=values.device)
    chosen.index_fill_(0, _largest_entries(values.reshape(values.shape[0] if values.dim() > 1 else 1, -1), count), True)
    return chosen.view(values.shape)


def log_sigmoid(z):
    return -torch.log1p(torch.exp(-z))


# ----------------------------------------------------------------------------------------------
# two-head loss: a direct loop over (i, j) of thesis eqs. 5.10-5.15 (errata A-E1, A-E2)
# ----------------------------------------------------------------------------------------------


def loop_candidates(sccp, targets, k):
    """(k-1)|B| largest softmax entries over the whole batch, labels excluded; ties by flat
    position (example index, then class index)."""
    batch, num_classes = sccp.shape
    entries = []
    for i in range(batch):
        row = sccp[i].tolist()
        top = max(row)
        denom = sum(math.exp(v - top) for v in row)
        for j in range(num_classes):
            if j != int(targets[i]):
                entries.append((-math.exp(row[j] - top) / denom, i * num_classes + j, i, j))
    entries.sort()
    return {(i, j) for _, _, i, j in entries[: (k - 1) * batch]}


def ranked_candidates(values, targets, k):
    """(k-1)|B| largest of the given ``values`` (B, L) by a Python sort, labels excluded, ties by
    flat position: the selection rule alone, on values computed once."""
    batch, num_classes = values.shape
    rows = values.tolist()
    entries = sorted(
        (-rows[i][j], i * num_classes + j, i, j)
        for i in range(batch)
        for j in range(num_classes)
        if j != int(targets[i])
    )
    return {(i, j) for _, _, i, j in entries[: (k - 1) * batch]}


def loop_two_head(sccp, ml, targets, k, alpha):
    """Returns (CE term, BCE term) as scalars built from per-entry operations."""
    batch, num_classes = ml.shape
    cand = loop_candidates(sccp.detach(), targets, k)
    ce = 0.0
    for i in range(batch):
        y = int(targets[i])
        ce = ce - (sccp[i, y] - torch.logsumexp(sccp[i], dim=0)) / batch
    pos_sum, cand_sum, neg_sum = 0.0, 0.0, 0.0
    n_cand = n_neg = 0
    for i in range(batch):
        y = int(targets[i])
        for j in range(num_classes):
            z = ml[i, j]
            if j == y:
                pos_sum = pos_sum + log_sigmoid(z)
            elif (i, j) in cand:
                cand_sum = cand_sum + log_sigmoid(z)
                n_cand += 1
            else:
                neg_sum = neg_sum + log_sigmoid(-z)
                n_neg += 1
    assert n_cand == (k - 1) * batch and n_neg == (num_classes - k) * batch
    bce = -pos_sum / batch - alpha / ((k - 1) * batch) * cand_sum - alpha / ((num_classes - k) * batch) * neg_sum
    return ce, bce


def random_two_head(seed, batch=5, num_classes=7, tied=False):
    g = torch.Generator().manual_seed(seed)
    if tied:  # few distinct logits: many equal softmax entries across and within rows
        sccp = torch.randint(0, 2, (batch, num_classes), generator=g).double()
    else:
        sccp = torch.randn(batch, num_classes, generator=g, dtype=torch.float64) * 2
    ml = torch.randn(batch, num_classes, generator=g, dtype=torch.float64) * 2
    targets = torch.randint(0, num_classes, (batch,), generator=g)
    return sccp.requires_grad_(), ml.requires_grad_(), targets


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("k,alpha", [(2, 0.3), (3, 5.0), (5, 1.0)])
def test_two_head_value_and_gradients_match_loop(k, alpha, tied):
    sccp, ml, targets = random_two_head(10 + k, tied=tied)
    loss_fn = build_loss("avgk_two_head", k=k, alpha=alpha)
    loss = loss_fn(TwoHeadOutput(sccp=sccp, ml=ml), targets)
    ce, bce = loop_two_head(sccp, ml, targets, k, alpha)
    assert loss.item() == pytest.approx((ce + bce).item(), rel=1e-10)

    g_sccp, g_ml = torch.autograd.grad(loss, (sccp, ml))
    ce_sccp, ce_ml = torch.autograd.grad(ce, (sccp, ml), allow_unused=True, retain_graph=True)
    bce_sccp, bce_ml = torch.autograd.grad(bce, (sccp, ml), allow_unused=True)
    assert ce_ml is None and bce_sccp is None  # the loop's CE uses only Z', its BCE only Z
    # SCCP head: exactly the CE gradient (nothing from the BCE); ML head: exactly the BCE one
    assert torch.allclose(g_sccp, ce_sccp, atol=1e-12)
    assert torch.allclose(g_ml, bce_ml, atol=1e-12)
    assert torch.allclose(g_sccp, torch.autograd.grad(F.cross_entropy(sccp, targets), sccp)[0], atol=1e-12)


def test_two_head_reduction_none_averages_to_the_loss():
    sccp, ml, targets = random_two_head(3)
    out = TwoHeadOutput(sccp=sccp, ml=ml)
    per_example = build_loss("avgk_two_head", k=3, alpha=0.7, reduction="none")(out, targets)
    assert per_example.shape == (5,)
    assert per_example.mean().item() == pytest.approx(build_loss("avgk_two_head", k=3, alpha=0.7)(out, targets).item())


def test_two_head_module_head_gradients_are_separated():
    torch.manual_seed(0)
    backbone = torch.nn.Linear(6, 8).double()
    heads = TwoHeadClassifier(8, 10).double()
    x, targets = torch.randn(12, 6, dtype=torch.float64), torch.randint(0, 10, (12,))
    out = heads(torch.relu(backbone(x)))
    assert isinstance(out, TwoHeadOutput) and out.sccp.shape == out.ml.shape == (12, 10)
    loss = build_loss("avgk_two_head", k=4, alpha=2.0)(out, targets)
    ce, bce = loop_two_head(out.sccp, out.ml, targets, 4, 2.0)
    params = (heads.sccp.weight, heads.sccp.bias, heads.ml.weight, heads.ml.bias, backbone.weight)
    total = torch.autograd.grad(loss, params, retain_graph=True)
    from_ce = torch.autograd.grad(ce, params, retain_graph=True, allow_unused=True)
    from_bce = torch.autograd.grad(bce, params, retain_graph=True, allow_unused=True)
    # W' (SCCP) gets exactly the CE gradient, W (ML) exactly the BCE gradient
    assert from_ce[2] is None and from_bce[0] is None
    assert torch.allclose(total[0], from_ce[0]) and torch.allclose(total[1], from_ce[1])
    assert torch.allclose(total[2], from_bce[2]) and torch.allclose(total[3], from_bce[3])
    # the shared backbone gets the sum of both, and both are non-trivial
    assert torch.allclose(total[4], from_ce[4] + from_bce[4])
    assert torch.count_nonzero(from_ce[4]) > 0 and torch.count_nonzero(from_bce[4]) > 0
    assert not torch.allclose(total[4], from_ce[4]) and not torch.allclose(total[4], from_bce[4])


@pytest.mark.parametrize("seed,batch,num_classes,k", [(0, 1, 5, 2), (1, 6, 10, 3), (2, 7, 4, 3), (3, 16, 30, 10)])
@pytest.mark.parametrize("tied", [False, True])
def test_candidate_and_negative_counts_are_exact(seed, batch, num_classes, k, tied):
    """The partition's sizes, and the candidates are the (k-1)|B| largest entries with ties by
    flat position. With tied logits, rows equal up to the order of their entries have softmax
    values equal in exact arithmetic but not in floating point (a sum's rounding depends on the
    order of its terms, and on the CPU's kernels: on an AVX2 machine the Python reference and
    torch broke such "ties" apart differently). So the reference ranks the very values the loss
    ranks (its log-softmax, handed in), and the independent Python softmax is the reference
    only where the values are distinct by far more than a rounding (untied logits)."""
    sccp, _, targets = random_two_head(seed, batch, num_classes, tied=tied)
    log_probs = torch.log_softmax(sccp.detach(), dim=1)
    positive, candidate, negative = candidate_masks(sccp, targets, k, log_probs=log_probs if tied else None)
    assert int(positive.sum()) == batch
    assert int(candidate.sum()) == (k - 1) * batch
    assert int(negative.sum()) == (num_classes - k) * batch
    assert not bool((positive & candidate).any() | (positive & negative).any() | (candidate & negative).any())
    assert bool((positive | candidate | negative).all())
    expected = ranked_candidates(log_probs, targets, k) if tied else loop_candidates(sccp.detach(), targets, k)
    assert {(i, j) for i, j in candidate.nonzero().tolist()} == expected
    # mean |S(x_i)| over the batch is k (eq. 5.13)
    assert (positive | candidate).sum(1).double().mean().item() == pytest.approx(k)


@pytest.mark.parametrize("seed", range(4))
def test_top_entries_equal_a_stable_descending_sort(seed):
    """The selection (no sort) picks what a full stable sort would: ties by flat position."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 6, (9, 40), generator=g).double()  # many ties everywhere
    values[0, 5] = math.inf
    values[1, :] = -math.inf
    for count in (0, 1, 7, 50, 123, 300, 351):
        chosen = top_entries(values, count)
        order = torch.sort(values.reshape(-1), descending=True, stable=True).indices
        expected = torch.zeros(values.numel(), dtype=torch.bool)
        expected[order[:count]] = True
        assert torch.equal(chosen.reshape(-1), expected), count


# ----------------------------------------------------------------------------------------------
# the fast path against the previous implementation, kept here as the reference: a selection
# over all B L entries (topk) with ties broken by flat position, and the BCE of eq. 5.14 entry
# by entry in the stable log-sigmoid form
# ----------------------------------------------------------------------------------------------


def reference_candidates(sccp, targets, k):
    """Bool mask of the (k-1)|B| largest masked log-softmax entries over the whole batch,
    ties at the threshold by flat position (the implementation before the group bound)."""
    batch, num_classes = sccp.shape
    log_probs = torch.log_softmax(
        sccp.detach().float() if sccp.dtype in (torch.float16, torch.bfloat16) else sccp.detach(), dim=1
    )
    masked = log_probs.clone()
    masked[torch.arange(batch), targets] = -math.inf
    flat, count = masked.reshape(-1), (k - 1) * batch
    threshold = torch.topk(flat, count, sorted=False).values.min()
    chosen = flat >= threshold
    surplus = int(chosen.sum()) - count
    if surplus > 0:
        tied = flat == threshold
        chosen &= ~tied | (tied.cumsum(0) <= int(tied.sum()) - surplus)
    return chosen.view(batch, num_classes)


def reference_two_head(sccp, ml, targets, k, alpha):
    """Per-example loss of eq. 5.15 with one weight per entry and logsigmoid per entry."""
    batch, num_classes = ml.shape
    candidate = reference_candidates(sccp, targets, k)
    positive = torch.zeros_like(candidate)
    positive[torch.arange(batch), targets] = True
    ce = -torch.log_softmax(sccp, dim=1).gather(1, targets.unsqueeze(1)).squeeze(1)
    weights = torch.full_like(ml, alpha / (num_classes - k))
    weights = weights.masked_fill(candidate, alpha / (k - 1)).masked_fill(positive, 1.0)
    per_entry = torch.where(positive | candidate, -F.logsigmoid(ml), -F.logsigmoid(-ml))
    return ce + (weights * per_entry).sum(dim=1), candidate


def tied_logits(batch, num_classes, seed, levels=4):
    """Rows that are permutations of one vector of few distinct values: every row has the
    same log-softmax values (same multiset, same normaliser), so equal entries tie exactly
    within and across rows, and the threshold of eq. 5.12 falls inside a tie."""
    g = torch.Generator().manual_seed(seed)
    row = torch.randint(0, levels, (num_classes,), generator=g).float()
    order = torch.argsort(torch.rand(batch, num_classes, generator=g), dim=1)
    return row[order]


@pytest.mark.parametrize("num_classes,k", [(1000, 2), (1000, 5), (1000, 10), (1000, 50), (100, 20), (37, 3)])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("fixed", [False, True], ids=["cpu-path", "fixed-path"])
def test_fast_two_head_equals_the_reference_implementation(num_classes, k, tied, fixed, monkeypatch):
    """Same candidate set, same loss and gradients as the previous implementation, at the
    benchmark's sizes (B = 128, float32), with ties at the threshold or without; on the CPU
    path (group bound) and on the path of fixed shapes of GPUs and torch.compile (one stable
    sort; setvalued.losses.base.fixed_shapes), forced here."""
    if fixed:
        monkeypatch.setattr(avgk, "fixed_shapes", lambda values: True)
    batch = 128
    g = torch.Generator().manual_seed(num_classes + k)
    sccp = tied_logits(batch, num_classes, k) if tied else torch.randn(batch, num_classes, generator=g) * 2
    ml = torch.randn(batch, num_classes, generator=g) * 3
    targets = torch.randint(0, num_classes, (batch,), generator=g)
    sccp.requires_grad_(True)
    ml.requires_grad_(True)
    expected, reference_mask = reference_two_head(sccp, ml, targets, k, alpha=0.7)
    _, candidate, _ = candidate_masks(sccp, targets, k)
    assert torch.equal(candidate, reference_mask)
    if tied:  # the threshold splits a tie: the rule decides, not the values
        threshold = torch.log_softmax(sccp.detach(), 1)[candidate].min()
        at_threshold = torch.log_softmax(sccp.detach(), 1) == threshold
        at_threshold[torch.arange(batch), targets] = False
        assert int((at_threshold & ~candidate).sum()) > 0 and int((at_threshold & candidate).sum()) > 0
    per_example = build_loss("avgk_two_head", k=k, alpha=0.7, reduction="none")(TwoHeadOutput(sccp, ml), targets)
    assert torch.allclose(per_example, expected, rtol=2e-6, atol=1e-6)
    weights = torch.rand(batch, generator=g)  # a non-uniform upstream gradient
    got = torch.autograd.grad((per_example * weights).sum(), (sccp, ml))
    want = torch.autograd.grad((expected * weights).sum(), (sccp, ml))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("num_classes", [100, 1000])  # entry by entry / dense sum + corrections
def test_fast_two_head_is_exact_in_float64(num_classes):
    """In float64 the chunked logs and the corrections on the positives leave only rounding."""
    batch, k = 64, 5
    g = torch.Generator().manual_seed(9)
    sccp = (torch.randn(batch, num_classes, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    ml = (torch.randn(batch, num_classes, generator=g, dtype=torch.float64) * 8).requires_grad_(True)
    targets = torch.randint(0, num_classes, (batch,), generator=g)
    expected, _ = reference_two_head(sccp, ml, targets, k, alpha=2.0)
    got = build_loss("avgk_two_head", k=k, alpha=2.0, reduction="none")(TwoHeadOutput(sccp, ml), targets)
    assert torch.allclose(got, expected, rtol=1e-12, atol=0)
    for a, b in zip(torch.autograd.grad(got.sum(), (sccp, ml)), torch.autograd.grad(expected.sum(), (sccp, ml))):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shape", [(1, 5), (3, 37), (16, 100), (64, 1000)])
def test_largest_entries_are_a_stable_descending_sort_prefix(seed, shape):
    """Every count, including ties across rows and counts where the group bound is loose."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 8, shape, generator=g).float() + 0.5 * torch.randint(0, 2, shape, generator=g)
    order = torch.sort(values.reshape(-1), descending=True, stable=True).indices
    total = values.numel()
    for count in sorted({1, 2, shape[0], total // 7, total // 3, total - 1, total}):
        chosen = _largest_entries(values, count)
        assert chosen.numel() == count and chosen.unique().numel() == count
        assert torch.equal(torch.sort(chosen).values, torch.sort(order[:count]).values), count


def test_two_head_accepts_non_contiguous_heads():
    g = torch.Generator().manual_seed(4)
    sccp = torch.randn(30, 8, generator=g).t().requires_grad_(True)  # (8, 30), column-major
    ml = torch.randn(30, 8, generator=g).t().requires_grad_(True)
    targets = torch.randint(0, 30, (8,), generator=g)
    loss = build_loss("avgk_two_head", k=3, alpha=0.5, reduction="none")(TwoHeadOutput(sccp, ml), targets)
    expected, _ = reference_two_head(
        sccp.detach().contiguous().requires_grad_(True), ml.detach().contiguous().requires_grad_(True), targets, 3, 0.5
    )
    assert torch.allclose(loss, expected, rtol=1e-6)
    assert torch.autograd.grad(loss.sum(), ml)[0].shape == (8, 30)


def test_candidate_indices_match_the_masks():
    sccp, _, targets = random_two_head(5, batch=9, num_classes=12)
    _, candidate, _ = candidate_masks(sccp, targets, 4)
    flat = candidate_indices(sccp, targets, 4)
    assert torch.equal(torch.sort(flat).values, candidate.reshape(-1).nonzero().squeeze(1))


def test_candidates_from_float32_logits_rank_log_probabilities_without_underflow():
    # probabilities of 1e-60 and 1e-70 underflow to 0 in a float32 softmax, not in log space
    # (a float32 softmax would tie them at 0 and pick class 1 by position)
    sccp = torch.tensor([[0.0, -300.0, -160.0, -140.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.softmax(sccp, dim=1)[0, 1:].eq(0).all()
    _, candidate, _ = candidate_masks(sccp, torch.tensor([0, 0]), 2)
    assert candidate.tolist() == [[False, False, False, False], [False, True, True, False]]
    _, candidate, _ = candidate_masks(sccp, torch.tensor([0, 0]), 3)
    assert candidate.tolist() == [[False, False, False, True], [False, True, True, True]]


def test_candidates_are_chosen_over_the_whole_batch_not_per_row():
    # row 0 is confident, row 1 is uniform: with K=3, |B|=2 the 4 candidates all go to row 1
    sccp = torch.tensor([[10.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    targets = torch.tensor([0, 0])
    _, candidate, _ = candidate_masks(sccp, targets, 3)
    assert candidate.sum(1).tolist() == [0, 4]
    assert candidate[1].tolist() == [False, True, True, True, True, False]  # ties by class index


def test_candidates_ignore_the_ml_head_and_the_label():
    # the label has the largest probability; it must never be a candidate
    sccp = torch.tensor([[5.0, 4.0, 0.0, 0.0], [5.0, 4.0, 0.0, 0.0]])
    _, candidate, _ = candidate_masks(sccp, torch.tensor([0, 0]), 2)
    assert candidate.tolist() == [[False, True, False, False], [False, True, False, False]]


def test_prediction_head_parameter():
    out = TwoHeadOutput(sccp=torch.zeros(2, 3), ml=torch.ones(2, 3))
    assert build_loss("avgk_two_head", k=2).prediction_scores(out) is out.ml
    assert build_loss("avgk_two_head", k=2, prediction_head="sccp").prediction_scores(out) is out.sccp
    assert LOSSES["avgk_two_head"].head == "two_head"


def test_two_head_learns_a_separable_toy_problem():
    torch.manual_seed(0)
    centers = torch.randn(5, 4) * 3
    targets = torch.randint(0, 5, (64,))
    x = centers[targets] + 0.3 * torch.randn(64, 4)
    model = TwoHeadClassifier(4, 5)
    loss_fn = AvgKTwoHeadLoss(k=2, alpha=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    first = None
    for _ in range(200):
        loss = loss_fn(model(x), targets)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first
    out = model(x)
    assert (out.ml.argmax(1) == targets).double().mean() > 0.9
    assert (out.sccp.argmax(1) == targets).double().mean() > 0.9


# ----------------------------------------------------------------------------------------------
# AN, EPR, ROLE
# ----------------------------------------------------------------------------------------------


def test_assume_negative_matches_eq_5_5_loop():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(4, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 6, (4,), generator=g)
    expected = 0.0
    for i in range(4):
        for j in range(6):
            if j == int(y[i]):
                expected -= math.log(1 / (1 + math.exp(-z[i, j].item())))
            else:
                expected -= math.log(1 - 1 / (1 + math.exp(-z[i, j].item()))) / 5
    assert build_loss("assume_negative")(z, y).item() == pytest.approx(expected / 4, rel=1e-10)


def test_assume_negative_compiled_fails_on_a_label_out_of_range():
    """Compiled (the path of fixed shapes, as on a GPU) the labels' host-read checks are
    skipped: a label out of range must fail in the lookup of the one-hot rows
    (``base.one_hot``), not become a row of zeros, which inductor made of the former scatter
    of ones into zeros (a finite loss, no error). A label in range gives eager's value."""
    torch._dynamo.reset()
    loss = build_loss("assume_negative")
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(6, 20, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 20, (6,), generator=gen)
    compiled = torch.compile(loss, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(z, y), loss(z, y), rtol=1e-12, atol=1e-12)
    for bad in (-1, 20):
        wrong = y.clone()
        wrong[2] = bad
        with pytest.raises((IndexError, RuntimeError), match="out of (range|bounds)"):
            compiled(z, wrong)


def test_assume_negative_with_every_label_observed_is_plain_bce():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    truth = (torch.rand(5, 7, generator=g) < 0.3).double()
    observed = truth * 2 - 1  # 1 = observed positive, -1 = observed negative, no unknowns
    bce = F.binary_cross_entropy_with_logits(z, truth, reduction="none").sum(1).mean()
    an = build_loss("assume_negative", num_classes=7)(z, observed)
    assert an.item() == pytest.approx(bce.item(), rel=1e-12)
    assert torch.allclose(torch.autograd.grad(an, z)[0], torch.autograd.grad(bce, z)[0])
    # single positive, the rest of the labels observed negative: BCE on the one-hot targets
    y = torch.randint(0, 7, (5,), generator=g)
    one_hot = F.one_hot(y, 7).double()
    full = build_loss("assume_negative", negative_weight=1.0)(z, y)
    assert full.item() == pytest.approx(
        F.binary_cross_entropy_with_logits(z, one_hot, reduction="none").sum(1).mean().item()
    )


def test_epr_matches_eq_5_8_and_penalty_vanishes_at_k():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(4, 10, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (4,), generator=g)
    k_hat = sum(1 / (1 + math.exp(-v)) for row in z.tolist() for v in row) / 4
    main = -sum(math.log(1 / (1 + math.exp(-z[i, int(y[i])].item()))) for i in range(4)) / 4
    loss = build_loss("epr", k=3, beta=0.2)
    assert loss(z, y).item() == pytest.approx(main + 0.2 * (k_hat - 3) ** 2, rel=1e-10)

    # zero logits: every sigmoid is 1/2, so the expected set size is L/2 = 5 = k
    z0 = torch.zeros(4, 10, dtype=torch.float64, requires_grad=True)
    epr = build_loss("epr", k=5, beta=10.0)
    assert epr.expected_set_size(z0).item() == 5.0
    assert epr.penalty(z0).item() == 0.0
    value = epr(z0, y)
    assert value.item() == pytest.approx(math.log(2))
    grad = torch.autograd.grad(value, z0)[0]
    expected_grad = -0.5 * F.one_hot(y, 10).double() / 4  # the main term only
    assert torch.allclose(grad, expected_grad)
    assert build_loss("epr", k=4, beta=10.0).penalty(z0).item() == pytest.approx(10.0)


def loop_role(logits, theta_rows, targets, k, lam):
    batch, num_classes = logits.shape
    total = 0.0
    for i in range(batch):
        for j in range(num_classes):
            f, g_ = torch.sigmoid(logits[i, j]), torch.sigmoid(theta_rows[i, j])
            fd, gd = f.detach(), g_.detach()
            if j == int(targets[i]):
                total = total + 0.5 * (-torch.log(f) - torch.log(g_))
            total = total + 0.5 * (
                -(gd * torch.log(f) + (1 - gd) * torch.log(1 - f)) - (fd * torch.log(g_) + (1 - fd) * torch.log(1 - g_))
            )
    total = total / (batch * num_classes)
    reg_f = (torch.sigmoid(logits).sum() / batch - k) ** 2 / num_classes**2
    reg_g = (torch.sigmoid(theta_rows).sum() / batch - k) ** 2 / num_classes**2
    return total + lam * 0.5 * (reg_f + reg_g)


def test_role_matches_loop_and_label_estimates_receive_gradients():
    torch.manual_seed(4)
    role = build_loss("role", k=2, lambda_=0.7, num_examples=9, num_classes=5, class_counts=[1] * 5)
    role = role.double()
    assert role.requires_indices and list(role.parameters())[0] is role.label_logits
    initial = role.label_logits.detach().clone()
    assert bool((initial.abs() <= ROLE_INIT_UNOBSERVED).all())
    z = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([1, 4, 0])
    idx = torch.tensor([6, 2, 8])
    loss = role(z, y, idx)
    # first visit: the observed label of each example starts at logit(0.995)
    assert role.label_logits[idx, y].tolist() == pytest.approx([ROLE_INIT_POSITIVE] * 3)
    assert math.isclose(1 / (1 + math.exp(-ROLE_INIT_POSITIVE)), 0.995)
    expected = loop_role(z, role.label_logits[idx], y, 2, 0.7)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10)
    loss.backward()
    grad = role.label_logits.grad
    assert grad is not None
    assert torch.count_nonzero(grad[idx]) == 15  # every entry of the batch rows moves
    untouched = torch.tensor([i for i in range(9) if i not in idx.tolist()])
    assert torch.count_nonzero(grad[untouched]) == 0
    theta = role.label_logits.detach()[idx].clone().requires_grad_()
    z2 = z.detach().clone().requires_grad_()
    ref = loop_role(z2, theta, y, 2, 0.7)
    ref_z, ref_theta = torch.autograd.grad(ref, (z2, theta))
    assert torch.allclose(z.grad, ref_z) and torch.allclose(grad[idx], ref_theta)
    # a second visit does not reset the estimates
    with torch.no_grad():
        role.label_logits[6, 1] = -3.0
    role(z, y, idx)
    assert role.label_logits[6, 1].item() == -3.0
    assert role.prediction_scores(z) is z


def test_role_needs_indices_and_context():
    with pytest.raises(ValueError, match="num_examples"):
        build_loss("role", k=2, lambda_=1.0, num_classes=5)
    role = build_loss("role", k=2, lambda_=1.0, num_examples=4, num_classes=5)
    with pytest.raises(ValueError, match="indices"):
        role(torch.zeros(2, 5), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="indices"):
        role(torch.zeros(2, 5), torch.tensor([0, 1]), torch.tensor([0, 4]))


# ----------------------------------------------------------------------------------------------
# bad parameters
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,params,pattern",
    [
        ("avgk_two_head", {"k": 1}, r"parameter k must be an integer >= 2"),
        ("avgk_two_head", {"k": 2.5}, r"parameter k must be an integer"),
        ("avgk_two_head", {"k": 3, "alpha": -0.1}, r"parameter alpha must be .*>= 0"),
        ("avgk_two_head", {"k": 3, "alpha": float("nan")}, r"parameter alpha"),
        ("avgk_two_head", {"k": 3, "prediction_head": "bce"}, r"prediction_head"),
        ("avgk_two_head", {"k": 5, "num_classes": 5}, r"parameter k=5 needs"),
        ("avgk_two_head", {"k": 2, "epsilon": 0.1}, r"no parameter 'epsilon'"),
        ("epr", {"k": 5, "beta": -1.0}, r"parameter beta must be .*>= 0"),
        ("epr", {"k": 0, "beta": 1.0}, r"parameter k must be .*> 0"),
        ("role", {"k": 2, "lambda_": -1.0, "num_examples": 3, "num_classes": 4}, r"parameter lambda_"),
        ("assume_negative", {"negative_weight": -1.0}, r"parameter negative_weight"),
    ],
)
def test_bad_parameters_raise_naming_the_parameter(name, params, pattern):
    with pytest.raises(ValueError, match=pattern):
        build_loss(name, **params)


def test_batch_too_small_for_the_candidates_raises():
    loss = build_loss("avgk_two_head", k=4, alpha=1.0)
    out = TwoHeadOutput(sccp=torch.zeros(3, 4), ml=torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"parameter k=4 needs \(k-1\)\|B\| = 9 candidates"):
        loss(out, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="batch is empty"):
        loss(TwoHeadOutput(sccp=torch.zeros(0, 6), ml=torch.zeros(0, 6)), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="TwoHeadOutput"):
        loss(torch.zeros(3, 6), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="single-head"):
        build_loss("epr", k=2)(out, torch.tensor([0, 1, 2]))


def test_two_head_second_backward_pass_recomputes_the_buffers():
    """The backward pass writes the gradients over the forward buffers; with retain_graph a
    second pass must still give the same gradients (it recomputes them)."""
    g = torch.Generator().manual_seed(12)
    sccp = (torch.randn(64, 1000, generator=g) * 2).requires_grad_(True)
    ml = (torch.randn(64, 1000, generator=g) * 3).requires_grad_(True)
    targets = torch.randint(0, 1000, (64,), generator=g)
    loss = build_loss("avgk_two_head", k=5, alpha=0.7)(TwoHeadOutput(sccp, ml), targets)
    first = torch.autograd.grad(loss, (sccp, ml), retain_graph=True)
    second = torch.autograd.grad(loss, (sccp, ml))
    expected, _ = reference_two_head(sccp, ml, targets, 5, 0.7)
    want = torch.autograd.grad(expected.mean(), (sccp, ml))
    for a, b, c in zip(first, second, want):
        assert torch.equal(a, b)
        assert torch.allclose(a, c, rtol=1e-5, atol=1e-8)
