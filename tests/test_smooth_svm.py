"""Tests of the smooth top-k SVM of Berrada et al. (setvalued/losses/smooth_svm.py).

References: brute-force enumeration of [BZK18] eq. 9 over all k-subsets, the closed form of
cross-entropy, a sequential log-space summation of the elementary symmetric polynomials in
float64, finite differences (gradcheck) and the hard loss of [BZK18] eq. 8.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from setvalued.losses import build_loss
from setvalued.losses.smooth_svm import hard_topk_svm, log_elementary_symmetric

torch.set_num_threads(1)


def _brute_force_svm(scores: torch.Tensor, targets: torch.Tensor, k: int, tau: float, alpha: float) -> torch.Tensor:
    """[BZK18] eq. 9, enumerating every k-subset (differentiable, for n <= 8)."""
    n = scores.shape[1]
    values = []
    for row, y in zip(scores, targets.tolist()):
        all_terms, with_target = [], []
        for subset in itertools.combinations(range(n), k):
            mean_score = row[list(subset)].sum() / k
            all_terms.append((alpha * (y not in subset) + mean_score) / tau)
            if y in subset:
                with_target.append(mean_score / tau)
        values.append(
            tau * torch.logsumexp(torch.stack(all_terms), 0) - tau * torch.logsumexp(torch.stack(with_target), 0)
        )
    return torch.stack(values)


def _brute_force_svm_vectorized(
    scores: torch.Tensor, targets: torch.Tensor, k: int, tau: float, alpha: float
) -> torch.Tensor:
    """[BZK18] eq. 9 over every k-subset at once: a (subsets, n) indicator matrix."""
    n = scores.shape[1]
    subsets = torch.tensor(
        [[j in c for j in range(n)] for c in itertools.combinations(range(n), k)], dtype=scores.dtype
    )
    means = scores @ subsets.T / k  # (B, subsets)
    holds_target = subsets[:, targets].T.bool()  # (B, subsets)
    all_terms = (alpha * (~holds_target).to(scores.dtype) + means) / tau
    with_target = (means / tau).masked_fill(~holds_target, -math.inf)
    return tau * torch.logsumexp(all_terms, dim=1) - tau * torch.logsumexp(with_target, dim=1)


CASES = [
    (n, k, tau, alpha)
    for n in (5, 8)
    for k in (1, 2, 3, 5)
    for tau in (0.05, 0.5, 2.0)
    for alpha in (0.0, 1.0)
    if k <= n - 1
]


@pytest.mark.parametrize("n, k, tau, alpha", CASES)
def test_value_and_gradient_equal_brute_force_enumeration(n, k, tau, alpha):
    generator = torch.Generator().manual_seed(n * 100 + k * 10 + int(tau * 10))
    scores = (torch.randn(4, n, generator=generator, dtype=torch.float64) * 1.5).requires_grad_(True)
    targets = torch.randint(n, (4,), generator=generator)
    loss = build_loss("smooth_topk_svm", k=k, tau=tau, alpha=alpha, reduction="none")
    value = loss(scores, targets)
    (grad,) = torch.autograd.grad(value.sum(), scores)
    reference = _brute_force_svm(scores, targets, k, tau, alpha)
    (reference_grad,) = torch.autograd.grad(reference.sum(), scores)
    assert torch.allclose(
        _brute_force_svm_vectorized(scores, targets, k, tau, alpha), reference, rtol=1e-12, atol=1e-12
    )
    assert torch.allclose(value, reference, rtol=1e-10, atol=1e-12)
    assert torch.allclose(grad, reference_grad, rtol=1e-8, atol=1e-10)


BODY_CASES = [
    (12, 2, 1.0, 1.0),
    (12, 3, 0.1, 1.0),
    (14, 4, 0.5, 0.0),
    (13, 5, 2.0, 1.0),
    (12, 2, 1e-3, 1.0),
    (13, 4, 1e-3, 1.0),
]


@pytest.mark.parametrize("n, k, tau, alpha", BODY_CASES)
@pytest.mark.parametrize("logit_scale", [1.0, 1e3])
def test_value_and_gradient_equal_brute_force_with_a_body(n, k, tau, alpha, logit_scale):
    """n > k + 2: most classes go through the linear-space "body" path, the k + 1 largest
    through the log-space "top"; the brute force enumerates every subset ([BZK18] eq. 9).
    Logits of 1e3 at tau = 1e-3 make gaps of 1e6 / k in x = s / (k tau)."""
    generator = torch.Generator().manual_seed(n * 100 + k)
    scores = torch.randn(6, n, generator=generator, dtype=torch.float64) * logit_scale
    scores[0, :] = scores[0, 0]  # all tied
    scores[1, 3:] = scores[1, 2]  # a tie at the top/body border
    scores[2, 1:] -= 50 * logit_scale  # one class far above the rest
    scores.requires_grad_(True)
    targets = torch.randint(n, (6,), generator=generator)
    loss = build_loss("smooth_topk_svm", k=k, tau=tau, alpha=alpha, reduction="none")
    value = loss(scores, targets)
    (grad,) = torch.autograd.grad(value.sum(), scores)
    reference = _brute_force_svm_vectorized(scores, targets, k, tau, alpha)
    (reference_grad,) = torch.autograd.grad(reference.sum(), scores)
    assert torch.allclose(value, reference, rtol=1e-6, atol=1e-9 * max(1.0, logit_scale))
    scale = reference_grad.abs().max()
    assert torch.allclose(grad, reference_grad, rtol=1e-6, atol=1e-6 * scale)
    # float32 inputs: the same loss (computed in float64 inside), rounded once
    value32 = loss(scores.detach().float(), targets)
    assert torch.allclose(
        value32.double(),
        build_loss("smooth_topk_svm", k=k, tau=tau, alpha=alpha, reduction="none")(
            scores.detach().float().double(), targets
        ),
        rtol=1e-6,
        atol=1e-6,
    )


def _log_space_reference(scores, targets, k, tau, alpha):
    """The loss through the log-space divide and conquer over all classes, with autograd."""
    x = (scores - scores.detach().amax(dim=1, keepdim=True)) / (k * tau)
    is_target = F.one_hot(targets, scores.shape[1]).bool()
    log_sigma = log_elementary_symmetric(x.masked_fill(is_target, -1e30), k)
    x_target = x.gather(1, targets[:, None]).squeeze(1)
    return tau * F.softplus(alpha / tau + log_sigma[:, k] - log_sigma[:, k - 1] - x_target)


@pytest.mark.parametrize("k", [2, 5, 10, 20, 40])
@pytest.mark.parametrize("tau, logit_scale", [(1.0, 2.0), (0.1, 5.0), (1e-3, 1e3)])
def test_large_n_matches_the_log_space_recursion(k, tau, logit_scale):
    """L = 300: value and gradient against autograd through the plain log-space product."""
    generator = torch.Generator().manual_seed(k)
    scores = (torch.randn(8, 300, generator=generator, dtype=torch.float64) * logit_scale).requires_grad_(True)
    targets = torch.randint(300, (8,), generator=generator)
    value = build_loss("smooth_topk_svm", k=k, tau=tau, reduction="none")(scores, targets)
    (grad,) = torch.autograd.grad(value.sum(), scores)
    reference = _log_space_reference(scores, targets, k, tau, 1.0)
    (reference_grad,) = torch.autograd.grad(reference.sum(), scores)
    assert torch.allclose(value, reference, rtol=1e-9, atol=1e-9)
    assert torch.allclose(grad, reference_grad, rtol=1e-7, atol=1e-9 * reference_grad.abs().max())


def test_body_elementary_symmetric_values_in_unit_interval():
    from setvalued.losses.smooth_svm import elementary_symmetric_unit

    generator = torch.Generator().manual_seed(0)
    y = torch.rand(3, 700, generator=generator, dtype=torch.float64)
    y[1, 100:] = 0.0
    y[2] = 1.0  # sigma_j = C(700, j)
    for k in (1, 4, 9, 30):
        sigma = elementary_symmetric_unit(y, k)
        for row in range(3):
            with np.errstate(divide="ignore"):
                expected = np.exp(_log_esp_sequential(np.log(y[row].numpy()), k))
            assert np.allclose(sigma[row].numpy(), expected, rtol=1e-11, atol=0)
        assert sigma[2, k].item() == pytest.approx(math.comb(700, k), rel=1e-11)


def test_k1_tau1_alpha0_equals_cross_entropy():
    generator = torch.Generator().manual_seed(0)
    scores = (torch.randn(16, 11, generator=generator, dtype=torch.float64) * 3).requires_grad_(True)
    targets = torch.randint(11, (16,), generator=generator)
    svm = build_loss("smooth_topk_svm", k=1, tau=1.0, alpha=0.0)
    value = svm(scores, targets)
    (grad,) = torch.autograd.grad(value, scores)
    ce = F.cross_entropy(scores, targets)
    (ce_grad,) = torch.autograd.grad(ce, scores)
    assert value.item() == pytest.approx(ce.item(), abs=1e-13)
    assert torch.allclose(grad, ce_grad, atol=1e-14)
    # with a margin it is no longer CE (the check can fail)
    assert build_loss("smooth_topk_svm", k=1, tau=1.0, alpha=1.0)(scores, targets).item() > ce.item() + 0.1


def _log_esp_sequential(x: np.ndarray, k: int) -> np.ndarray:
    """log sigma_0..k(exp(x)) of one row by the summation recursion ([BZK18] Alg. 3) in log space."""
    log_sigma = np.full(k + 1, -np.inf)
    log_sigma[0] = 0.0
    for value in x:
        log_sigma[1:] = np.logaddexp(log_sigma[1:], log_sigma[:-1] + value)
    return log_sigma


@pytest.mark.parametrize("n", [1, 2, 3, 7, 9, 16, 33])
def test_log_elementary_symmetric_matches_enumeration(n):
    generator = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=generator, dtype=torch.float64)
    for k in range(0, min(n, 5) + 1):
        result = log_elementary_symmetric(x, k)
        assert result.shape == (3, k + 1)
        for row in range(3):
            e = x[row].exp().numpy()
            if n <= 9:
                expected = [
                    math.log(sum(np.prod(e[list(c)]) for c in itertools.combinations(range(n), j)))
                    for j in range(k + 1)
                ]
            else:
                expected = _log_esp_sequential(x[row].numpy(), k)
            assert np.allclose(result[row].numpy(), expected, rtol=1e-12, atol=1e-12), (n, k)


def test_log_elementary_symmetric_large_n_float32_against_float64_recursion():
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 1000, generator=generator, dtype=torch.float64) * 20  # tau = 0.05-like spread
    result = log_elementary_symmetric(x.float(), 10)
    for row in range(2):
        expected = _log_esp_sequential(x[row].numpy(), 10)
        assert np.allclose(result[row].double().numpy(), expected, rtol=1e-6, atol=1e-3)
    with pytest.raises(ValueError, match=r"k must be an integer in \[0, 1000\]"):
        log_elementary_symmetric(x, 1001)


@pytest.mark.parametrize("k, tau, alpha", [(2, 1.0, 1.0), (3, 0.1, 1.0), (5, 0.5, 0.5), (1, 0.3, 1.0)])
def test_gradcheck_float64(k, tau, alpha):
    generator = torch.Generator().manual_seed(k)
    scores = torch.randn(3, 9, generator=generator, dtype=torch.float64).requires_grad_(True)
    targets = torch.randint(9, (3,), generator=generator)
    loss = build_loss("smooth_topk_svm", k=k, tau=tau, alpha=alpha)
    assert torch.autograd.gradcheck(lambda s: loss(s, targets), (scores,))
    assert torch.autograd.gradgradcheck(lambda s: loss(s, targets), (scores,))


@pytest.mark.parametrize("tau", [1e-3, 1e-2, 1e-1, 1.0])
@pytest.mark.parametrize("logit_scale", [1.0, 30.0, 1e3])
def test_float32_stability_sweep(tau, logit_scale):
    """No NaN/inf in value or gradient for tau down to 1e-3 and logits up to 1e3, and float32
    close to float64 on the same (float32-representable) scores ([BZK18] App. B.3.3, Table 5;
    docs/papers.md, note S-N1)."""
    generator = torch.Generator().manual_seed(int(1e4 * tau) + int(logit_scale))
    scores = torch.randn(24, 300, generator=generator, dtype=torch.float64) * logit_scale
    scores[:4] = scores[:4].sign() * logit_scale  # about 150 ties at +-scale per row
    scores[4, :] = logit_scale  # a row of identical logits
    scores[5, :150] = -logit_scale  # half the row at the bottom
    scores64 = scores.float().double()
    targets = torch.randint(300, (24,), generator=generator)
    for k in (1, 5, 10):
        loss = build_loss("smooth_topk_svm", k=k, tau=tau, reduction="none")
        s32 = scores64.float().requires_grad_(True)
        value32 = loss(s32, targets)
        (grad32,) = torch.autograd.grad(value32.sum(), s32)
        s64 = scores64.clone().requires_grad_(True)
        value64 = loss(s64, targets).detach()
        (grad64,) = torch.autograd.grad(loss(s64, targets).sum(), s64)
        assert value32.dtype == torch.float32
        assert torch.isfinite(value32).all() and torch.isfinite(grad32).all()
        assert (value32 >= 0).all()
        error = (value32.detach().double() - value64).abs()
        assert (error <= 1e-5 * value64.abs().clamp_min(1.0)).all(), error.max()
        assert (grad32.double() - grad64).abs().max() < 1e-3
        # each row of the gradient sums to 0 (adding a constant to all scores changes nothing)
        assert grad32.sum(dim=1).abs().max() < 1e-3


def test_half_precision_input_is_computed_in_float32():
    scores = (torch.randn(8, 50) * 10).half().requires_grad_(True)
    targets = torch.randint(50, (8,))
    value = build_loss("smooth_topk_svm", k=5, tau=1e-2)(scores, targets)
    value.backward()
    assert value.dtype == torch.float32
    assert torch.isfinite(value) and torch.isfinite(scores.grad.float()).all()


def test_low_temperature_tends_to_the_hard_loss():
    """[BZK18] Prop. 2: L_{k,tau} -> l_k as tau -> 0 when the k-th and (k+1)-th scores differ."""
    generator = torch.Generator().manual_seed(12)
    scores = torch.randn(32, 10, generator=generator, dtype=torch.float64)
    targets = torch.randint(10, (32,), generator=generator)
    for k in (1, 3):
        hard = hard_topk_svm(scores, targets, k, 1.0)
        # the hard loss by its definition (numpy): max(alpha + ((s without y)_[k] - s_y) / k, 0)
        s = scores.numpy()
        for i in range(32):
            others = np.sort(np.delete(s[i], targets[i]))[::-1]
            assert hard[i].item() == pytest.approx(max(0.0, 1 + (others[k - 1] - s[i, targets[i]]) / k))
        gaps = [
            (build_loss("smooth_topk_svm", k=k, tau=tau, reduction="none")(scores, targets) - hard).abs().max().item()
            for tau in (1.0, 1e-1, 1e-2, 1e-3)
        ]
        assert gaps[0] > 0.05 and gaps[-1] < 5e-3
        assert all(later < earlier for earlier, later in zip(gaps, gaps[1:]))


@pytest.mark.parametrize("k, alpha", [(1, 1.0), (2, 1.0), (3, 0.5), (5, 1.0)])
def test_zero_temperature_is_the_hard_loss_by_subset_enumeration(k, alpha):
    """tau = 0 (the first row of [BZK18] Table 6) is l_k of eq. 8: the max over k-subsets A of
    alpha 1(y not in A) + mean_A s, minus the max over the k-subsets that contain y."""
    generator = torch.Generator().manual_seed(40 + k)
    scores = torch.randn(12, 7, generator=generator, dtype=torch.float64)
    targets = torch.randint(7, (12,), generator=generator)
    scores[torch.arange(4), targets[:4]] += 10.0  # four samples well inside the margin: loss 0
    scores.requires_grad_()
    value = build_loss("smooth_topk_svm", k=k, tau=0.0, alpha=alpha, reduction="none")(scores, targets)
    expected = []
    for row, y in zip(scores.detach().numpy(), targets.tolist()):
        subsets = [list(c) for c in itertools.combinations(range(7), k)]
        best = max(alpha * (y not in a) + row[a].mean() for a in subsets)
        expected.append(best - max(row[a].mean() for a in subsets if y in a))
    assert value.tolist() == pytest.approx(expected, abs=1e-12)
    assert 0 < sum(v > 0 for v in expected) < 12  # both branches of the hinge occur
    value.sum().backward()  # a subgradient: only the scores of the two argmax subsets move
    assert torch.isfinite(scores.grad).all() and (scores.grad != 0).sum(dim=1).max() <= 2


def test_hard_switch_follows_the_reference_rule():
    k, tau = 2, 0.5
    threshold = k * tau * math.log(1e3)  # 6.91 (docs/papers.md, erratum S-E9c)
    scores = torch.tensor(
        [
            [10.0, 9.0, 1.0, 0.0, -1.0],  # s_[2] - s_[3] = 8 >= threshold: hard
            [1.0, 0.9, 0.8, 0.0, -1.0],
        ],  # gap 0.1: smooth
        dtype=torch.float64,
    )
    targets = torch.tensor([2, 3])
    smooth = build_loss("smooth_topk_svm", k=k, tau=tau, reduction="none")
    switched = build_loss("smooth_topk_svm", k=k, tau=tau, hard_switch=True, reduction="none")
    hard = hard_topk_svm(scores, targets, k, 1.0)
    smooth_values = smooth(scores, targets)
    out = switched(scores, targets)
    assert 8.0 >= threshold > 0.1
    assert hard.tolist() == pytest.approx([1 + (9.0 - 1.0) / 2, 1 + (0.9 - 0.0) / 2])
    # the two losses differ on both rows, so the switch is visible
    assert (smooth_values - hard).abs().min() > 0.05
    assert out[0].item() == pytest.approx(hard[0].item(), abs=1e-15)
    assert out[1].item() == pytest.approx(smooth_values[1].item(), abs=1e-15)
    assert smooth.hard_switch is False  # off by default


def test_top_k_error_bound_of_proposition_4():
    """[BZK18] Prop. 4: L_{k,tau} >= (1 - tau log k) * 1{s_[k] > s_y}."""
    generator = torch.Generator().manual_seed(2)
    scores = torch.randn(200, 12, generator=generator, dtype=torch.float64) * 2
    targets = torch.randint(12, (200,), generator=generator)
    k, tau = 3, 0.2
    value = build_loss("smooth_topk_svm", k=k, tau=tau, reduction="none")(scores, targets)
    kth = scores.topk(k, dim=1).values[:, -1]
    error = (kth > scores.gather(1, targets[:, None]).squeeze(1)).double()
    assert error.sum() > 10
    assert (value >= (1 - tau * math.log(k)) * error - 1e-12).all()


@pytest.mark.parametrize(
    "params, message",
    [
        ({"tau": -1.0}, r"tau must be >= 0"),
        ({"tau": float("nan")}, r"tau must be"),
        ({"k": 0}, r"k must be an integer >= 1"),
        ({"alpha": -0.5}, r"alpha must be >= 0"),
        ({"hard_switch": "yes"}, r"hard_switch must be true or false"),
        ({"k": 10, "num_classes": 10}, r"smooth_topk_svm: k must be in \[1, 9\] for 10 classes"),
    ],
)
def test_bad_parameters(params, message):
    with pytest.raises(ValueError, match=message):
        build_loss("smooth_topk_svm", **params)


def test_k_too_large_at_call_time():
    with pytest.raises(ValueError, match=r"k must be in \[1, 3\] for 4 classes"):
        build_loss("smooth_topk_svm", k=4)(torch.randn(2, 4), torch.tensor([0, 1]))


def test_registered_with_linear_head_and_ignores_context_keys():
    loss = build_loss("smooth_topk_svm", k=2, tau=1.0, class_counts=[1, 2, 3], num_classes=3, num_examples=6)
    assert loss.head == "linear" and loss.requires_indices is False
    assert torch.isfinite(loss(torch.randn(4, 3), torch.tensor([0, 1, 2, 0])))


def test_float64_keeps_the_softplus_tail_above_the_default_threshold():
    """Issue 23: F.softplus's default threshold (20) returned z and dropped log1p(exp(-z)) ~ 1.5e-9.
    s = (0, 0, -420), y = 2, k = 2, tau = 10, alpha = 0: the subsets {0,1} (mean 0) and {0,2},
    {1,2} (mean -210) of [BZK18] eq. 9 give tau (log(1 + 2 e^-21) + 21 - log 2) in closed form."""
    closed_form = 10.0 * (math.log1p(2.0 * math.exp(-21.0)) + 21.0 - math.log(2.0))
    scores = torch.tensor([[0.0, 0.0, -420.0]], dtype=torch.float64)
    targets = torch.tensor([2])
    value = build_loss("smooth_topk_svm", k=2, tau=10.0, alpha=0.0)(scores, targets).item()
    assert value == pytest.approx(closed_form, rel=4 * torch.finfo(torch.float64).eps)
    assert _brute_force_svm(scores, targets, 2, 10.0, 0.0).item() == pytest.approx(closed_form, rel=1e-15)
