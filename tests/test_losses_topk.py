"""Tests of the top-K losses (setvalued/losses/topk.py) and NormedLinear.

Each check compares with an independent computation: the numbers printed in the thesis,
numpy formulas, finite differences, scipy quadrature, or an exact identity.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import integrate, optimize, stats

from setvalued.losses import LOSSES, NormedLinear, build_loss
from setvalued.losses.topk import (
    PRUNING_FAILURE_PROBABILITY,
    ldam_margins,
    select_kth_largest,
    smooth_kth_largest,
)
from setvalued.losses.topk_operator import (
    _compact,
    _group_members,
    _heap_selection_pays,
    _pruned_candidates,
    _pruning_window,
    _repeated_max_pays,
)

torch.set_num_threads(1)

TOPK_NAMES = [
    "ce",
    "focal",
    "ldam",
    "hinge_topk",
    "cvx_hinge_topk",
    "calibrated_hinge_topk",
    "noised_topk",
    "noised_topk_imbalanced",
]


def _scores(batch: int, classes: int, seed: int = 0, dtype=torch.float64, scale: float = 1.0):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, classes, generator=generator, dtype=dtype) * scale
    targets = torch.randint(classes, (batch,), generator=generator)
    return scores.requires_grad_(True), targets


def _mixed_scores(batch: int, classes: int, seed: int = 0, dtype=torch.float64, scale: float = 1.0):
    """Random scores whose even rows have the target well ahead: active and inactive hinges."""
    scores, targets = _scores(batch, classes, seed, dtype, scale)
    with torch.no_grad():
        scores[0::2].scatter_add_(1, targets[0::2, None], torch.full((len(targets[0::2]), 1), 4.0, dtype=dtype))
    return scores, targets


def _kth_largest_np(row: np.ndarray, k: int) -> float:
    return float(np.sort(row)[::-1][k - 1])


# ------------------------------------------------------------------------------------
# The worked example of [Gar23] §4.3.2 ([GSJS22] §3.2)
# ------------------------------------------------------------------------------------

PAPER_SCORES = [2.4, 2.6, 2.3, 0.5]
PAPER_NOISE = [[0.2, -0.1, 0.1, 0.3], [0.1, 0.1, -0.1, 0.1], [-0.1, -0.1, 0.1, -0.1]]


def test_worked_example_of_the_thesis_epsilon_1():
    scores = torch.tensor(PAPER_SCORES, dtype=torch.float64, requires_grad=True)
    noise = torch.tensor(PAPER_NOISE, dtype=torch.float64)
    value = smooth_kth_largest(scores, k=2, epsilon=1.0, n_samples=3, noise=noise)
    value.backward()
    assert value.item() == pytest.approx(2.4666666666666667, abs=1e-12)  # (2.5 + 2.5 + 2.4) / 3
    assert torch.allclose(scores.grad, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0], dtype=torch.float64))


def test_worked_example_of_the_thesis_epsilon_0_1():
    scores = torch.tensor(PAPER_SCORES, dtype=torch.float64, requires_grad=True)
    noise = torch.tensor(PAPER_NOISE, dtype=torch.float64)
    value = smooth_kth_largest(scores, k=2, epsilon=0.1, n_samples=3, noise=noise)
    value.backward()
    assert value.item() == pytest.approx((2.42 + 2.41 + 2.39) / 3, abs=1e-12)
    assert torch.equal(scores.grad, torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64))


def test_smooth_kth_largest_batched_matches_numpy_loop():
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 3, 7, generator=generator, dtype=torch.float64)
    noise = torch.randn(2, 3, 4, 7, generator=generator, dtype=torch.float64)
    value = smooth_kth_largest(scores, k=3, epsilon=0.7, n_samples=4, noise=noise)
    assert value.shape == (2, 3)
    s, z = scores.numpy(), noise.numpy()
    for a in range(2):
        for b in range(3):
            expected = np.mean([_kth_largest_np(s[a, b] + 0.7 * z[a, b, m], 3) for m in range(4)])
            assert value[a, b].item() == pytest.approx(expected, abs=1e-12)


def test_smooth_kth_largest_epsilon_zero_is_exact_kth_largest():
    scores, _ = _scores(5, 9, seed=1)
    for k in (1, 4, 9):
        value = smooth_kth_largest(scores, k, 0.0, 7)
        expected = [_kth_largest_np(row, k) for row in scores.detach().numpy()]
        assert np.allclose(value.detach().numpy(), expected, atol=0, rtol=0)


def test_smooth_kth_largest_rejects_bad_arguments():
    scores = torch.randn(2, 5)
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 5\]"):
        smooth_kth_largest(scores, 6, 1.0, 3)
    with pytest.raises(ValueError, match=r"epsilon must be >= 0"):
        smooth_kth_largest(scores, 2, -0.1, 3)
    with pytest.raises(ValueError, match=r"n_samples must be an integer >= 1"):
        smooth_kth_largest(scores, 2, 1.0, 0)
    with pytest.raises(ValueError, match=r"noise must have shape \(2, 3, 5\)"):
        smooth_kth_largest(scores, 2, 1.0, 3, noise=torch.randn(2, 5, 3))


# ------------------------------------------------------------------------------------
# noised_topk: relation to the calibrated hinge, gradients, Monte-Carlo convergence
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 5])
def test_noised_topk_with_epsilon_zero_equals_calibrated_hinge(k):
    scores, targets = _mixed_scores(32, 10, seed=k, scale=0.7)
    noised = build_loss("noised_topk", k=k, epsilon=0.0, n_samples=4, reduction="none")
    calibrated = build_loss("calibrated_hinge_topk", k=k, reduction="none")
    value_noised = noised(scores, targets)
    (grad_noised,) = torch.autograd.grad(value_noised.sum(), scores)
    value_calibrated = calibrated(scores, targets)
    (grad_calibrated,) = torch.autograd.grad(value_calibrated.sum(), scores)
    assert torch.equal(value_noised, value_calibrated)
    assert torch.equal(grad_noised, grad_calibrated)
    # and both equal the numpy formula (1 + s_[k+1] - s_y)_+ of thesis eq. 4.5
    s = scores.detach().numpy()
    expected = [max(0.0, 1 + _kth_largest_np(s[i], k + 1) - s[i, targets[i]]) for i in range(32)]
    assert np.allclose(value_calibrated.detach().numpy(), expected, atol=1e-12)
    assert (value_calibrated > 0).any() and (value_calibrated == 0).any()


def test_noised_topk_value_and_gradient_with_fixed_noise_match_the_formula():
    """Thesis eq. 4.10 and 4.12: loss and gradient computed by hand from the same draw."""
    batch, classes, samples, k, eps = 12, 8, 5, 2, 0.6
    scores, targets = _mixed_scores(batch, classes, seed=11, scale=0.5)
    noise = torch.randn(batch, samples, classes, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    loss = build_loss("noised_topk", k=k, epsilon=eps, n_samples=samples, reduction="none")
    values = loss.per_sample(scores, targets, noise=noise)
    (grad,) = torch.autograd.grad(values.sum(), scores)
    s, z = scores.detach().numpy(), noise.numpy()
    for i in range(batch):
        perturbed = s[i] + eps * z[i]  # (M, L)
        picks = [int(np.argsort(-row, kind="stable")[k]) for row in perturbed]
        smoothed = np.mean([perturbed[m, picks[m]] for m in range(samples)])
        hinge = 1 + smoothed - s[i, targets[i]]
        assert values[i].item() == pytest.approx(max(hinge, 0.0), abs=1e-12)
        expected_grad = np.zeros(classes)
        if hinge > 0:
            for pick in picks:
                expected_grad[pick] += 1 / samples
            expected_grad[targets[i]] -= 1
        assert np.allclose(grad[i].numpy(), expected_grad, atol=1e-12)


def test_noised_topk_gradient_matches_finite_differences():
    batch, classes, samples = 6, 7, 4
    scores, targets = _scores(batch, classes, seed=21, scale=0.4)
    noise = torch.randn(batch, samples, classes, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    loss = build_loss("noised_topk", k=2, epsilon=0.5, n_samples=samples)

    def value(s):
        return loss.reduce(loss.per_sample(s, targets, noise=noise))

    (grad,) = torch.autograd.grad(value(scores), scores)
    step = 1e-6
    numeric = torch.zeros_like(grad)
    base = scores.detach()
    for i in range(batch):
        for j in range(classes):
            plus, minus = base.clone(), base.clone()
            plus[i, j] += step
            minus[i, j] -= step
            numeric[i, j] = (value(plus) - value(minus)) / (2 * step)
    assert grad.abs().sum() > 0
    assert torch.allclose(grad, numeric, atol=1e-7)


def test_noised_losses_pass_gradcheck_with_fixed_noise():
    batch, classes, samples = 4, 6, 3
    scores, targets = _scores(batch, classes, seed=4, scale=0.3)
    noise = torch.randn(batch, samples, classes, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    balanced = build_loss("noised_topk", k=2, epsilon=0.3, n_samples=samples)
    imbalanced = build_loss(
        "noised_topk_imbalanced",
        k=2,
        epsilon=0.3,
        n_samples=samples,
        max_margin=0.4,
        scale=5.0,
        class_counts=[5, 9, 30, 2, 7, 11],
    )
    for loss in (balanced, imbalanced):
        assert torch.autograd.gradcheck(lambda s, loss=loss: loss.per_sample(s, targets, noise=noise).sum(), (scores,))


def _expected_kth_largest_of_gaussians(means: np.ndarray, sigma: float, k: int) -> float:
    """E[k-th largest of independent N(mean_i, sigma^2)] by quadrature.

    For any c, E[X] = c + int_c^inf P(X > t) dt - int_-inf^c P(X <= t) dt; with c far below
    every mean the last term vanishes. P(X_[k] > t) = P(at least k of the L variables exceed
    t), a Poisson-binomial tail computed by dynamic programming.
    """

    def prob_at_least_k_above(t: float) -> float:
        above = stats.norm.sf((t - means) / sigma)
        counts = np.zeros(len(means) + 1)
        counts[0] = 1.0
        for p in above:
            counts[1:] = counts[1:] * (1 - p) + counts[:-1] * p
            counts[0] *= 1 - p
        return float(counts[k:].sum())

    low, high = means.min() - 12 * sigma, means.max() + 12 * sigma
    tail, _ = integrate.quad(prob_at_least_k_above, low, high, epsabs=1e-12, epsrel=1e-12, limit=200)
    return low + tail


def test_quadrature_reference_matches_clark_formula_for_a_max_of_two():
    """The reference integral itself, checked on E[max(X1, X2)] (Clark 1961)."""
    mu1, mu2, sigma = 0.3, -0.5, 0.8
    theta = sigma * math.sqrt(2)
    a = (mu1 - mu2) / theta
    clark = mu1 * stats.norm.cdf(a) + mu2 * stats.norm.cdf(-a) + theta * stats.norm.pdf(a)
    assert _expected_kth_largest_of_gaussians(np.array([mu1, mu2]), sigma, 1) == pytest.approx(clark, abs=1e-9)


def test_monte_carlo_value_converges_to_the_integral_as_n_samples_grows():
    torch.manual_seed(1234)
    means = np.array([1.2, 0.9, 0.85, 0.1, -0.4])
    eps, k = 0.5, 2  # the loss with K=1 smooths the 2nd largest score
    exact = _expected_kth_largest_of_gaussians(means, eps, k)
    scores = torch.tensor(means, dtype=torch.float64)
    repeats = 400
    rows = scores.expand(repeats, -1)
    rmse = {}
    for samples in (4, 64, 1024):
        estimates = smooth_kth_largest(rows, k, eps, samples).numpy()
        rmse[samples] = float(np.sqrt(np.mean((estimates - exact) ** 2)))
    # the error falls like 1 / sqrt(M): a factor 4 per 16x more samples (allow 2.5 to 6.5)
    assert 2.5 < rmse[4] / rmse[64] < 6.5
    assert 2.5 < rmse[64] / rmse[1024] < 6.5
    # a very large sample is within 4 standard errors of the integral
    big = smooth_kth_largest(scores, k, eps, 400_000).item()
    standard_error = rmse[1024] * math.sqrt(1024 / 400_000)
    assert abs(big - exact) < 4 * standard_error
    # the smoothing bias is real here (not the hard 2nd largest) and within thesis Prop. 4.3.5
    hard = float(np.sort(means)[::-1][k - 1])
    assert abs(exact - hard) > 10 * standard_error
    assert -eps * (k - 1) * math.sqrt(2 * math.log(5)) <= exact - hard <= eps * k * math.sqrt(2 * math.log(5))
    # and the loss of thesis eq. 4.10 (hinge active) converges to 1 + E - s_y
    loss = build_loss("noised_topk", k=1, epsilon=eps, n_samples=400_000, reduction="none")
    value = loss(scores.unsqueeze(0), torch.tensor([4])).item()
    assert abs(value - (1 + exact - means[4])) < 4 * standard_error


def test_noised_topk_draws_fresh_noise_and_uses_one_draw_for_value_and_gradient():
    batch, classes, samples, k, eps = 16, 12, 3, 2, 0.8
    scores, targets = _scores(batch, classes, seed=9, scale=0.5)
    loss = build_loss("noised_topk", k=k, epsilon=eps, n_samples=samples)
    torch.manual_seed(77)
    value = loss(scores, targets)
    (grad,) = torch.autograd.grad(value, scores)
    # the same global-RNG draw, reconstructed: (B, M, L) standard normals
    torch.manual_seed(77)
    noise = torch.randn(batch, samples, classes, dtype=torch.float64)
    replay = loss.reduce(loss.per_sample(scores, targets, noise=noise))
    (replay_grad,) = torch.autograd.grad(replay, scores)
    assert value.item() == pytest.approx(replay.item(), abs=1e-12)
    assert torch.allclose(grad, replay_grad, atol=1e-12)
    # two calls draw different noise
    again = loss(scores, targets)
    assert again.item() != pytest.approx(value.item(), abs=1e-9)


def test_noised_topk_gradient_support_is_at_most_n_samples_plus_one():
    torch.manual_seed(5)
    samples = 3
    scores, targets = _scores(256, 100, seed=6, dtype=torch.float32)
    loss = build_loss("noised_topk", k=5, epsilon=10.0, n_samples=samples)
    (grad,) = torch.autograd.grad(loss(scores, targets), scores)
    nonzero = (grad != 0).sum(dim=1)
    assert nonzero.max().item() <= samples + 1
    assert nonzero.max().item() == samples + 1  # large epsilon reaches the bound (thesis Fig. 4.2)
    # every active row sums to zero: (1/M) sum of M one-hots minus delta_y
    active = nonzero > 0
    assert torch.allclose(grad[active].sum(dim=1), torch.zeros(int(active.sum())), atol=1e-6)


def test_noised_topk_loss_is_nonnegative_and_raw_scores_unchanged():
    scores, targets = _scores(64, 20, seed=2, dtype=torch.float32, scale=3.0)
    before = scores.detach().clone()
    values = build_loss("noised_topk", k=3, epsilon=0.5, n_samples=4, reduction="none")(scores, targets)
    assert (values >= 0).all()
    assert torch.equal(scores.detach(), before)


# ------------------------------------------------------------------------------------
# The pruned path (noise only for the classes that can reach the top k+1)
# ------------------------------------------------------------------------------------


def _spread_scores(batch: int, classes: int, seed: int, spread: float, dtype=torch.float64):
    """Scores where most classes are far below the top (std ``spread``, in units of epsilon)."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, classes, generator=generator, dtype=dtype) * spread
    targets = torch.randint(classes, (batch,), generator=generator)
    return scores.requires_grad_(True), targets


@pytest.mark.parametrize("k, samples, classes", [(2, 3, 16), (11, 10, 1000), (51, 3, 1000)])
def test_pruning_window_meets_the_failure_budget_with_little_slack(k, samples, classes):
    """M (k Q(a) + L Q(b)) <= 1e-9 for the best split of w = a + b, and no smaller w does."""
    width = _pruning_window(k, classes, samples)

    def least_failure(w):  # the best split of a total width w
        def bound(a):
            return samples * (k * stats.norm.sf(a) + classes * stats.norm.sf(w - a))

        return optimize.minimize_scalar(bound, bounds=(0.0, w), method="bounded", options={"xatol": 1e-10}).fun

    assert least_failure(width) <= PRUNING_FAILURE_PROBABILITY * (1 + 1e-6)
    assert least_failure(width - 0.02) > PRUNING_FAILURE_PROBABILITY
    assert 12.0 < width < 16.0


@pytest.mark.parametrize("k", [2, 6, 21])
def test_pruned_candidates_hold_every_class_within_the_window(k):
    scores, _ = _spread_scores(64, 500, seed=k, spread=40.0, dtype=torch.float32)
    scores = scores.detach()
    eps, samples = 1.0, 5
    values, classes = _pruned_candidates(scores, k, eps, samples)
    width = _pruning_window(k, 500, samples)
    kth = torch.topk(scores, k, dim=1).values[:, -1:]
    kept = torch.zeros_like(scores, dtype=torch.bool)
    real = classes < 500
    kept[real.nonzero(as_tuple=True)[0], classes[real]] = True
    # every class within eps * w of s_[k] is kept, each kept class at most once, with its score
    assert (kept | (scores <= kth - eps * width)).all()
    assert int(kept.sum()) == int(real.sum())
    assert torch.equal(values[real], scores[real.nonzero(as_tuple=True)[0], classes[real]])
    assert (values[~real] == -math.inf).all()
    # and pruning did prune: far fewer than L columns
    assert values.shape[1] < 500 / 4


@pytest.mark.parametrize("k, length", [(2, 42), (2, 119), (3, 60), (6, 180), (21, 1000)])
def test_selection_padded_for_a_heap_equals_the_numpy_kth_largest(k, length):
    """Rows a little shorter than 64k are padded with -inf for torch.topk's heap: value and
    index of the k-th largest are those of a numpy sort, row by row, including rows whose
    k-th largest is -inf (fewer than k finite entries: the padding must never be returned)."""
    assert _heap_selection_pays(k, length)  # this case takes the padded path
    generator = torch.Generator().manual_seed(length)
    values = torch.randn(40, 3, length, generator=generator, dtype=torch.float32) * 5
    values[0, 0, :] = -math.inf
    values[1, 2, k - 1 :] = -math.inf  # k - 1 finite entries: the k-th largest is -inf
    values[2, 1, :k] = 7.0  # the k largest tie
    kth, index = select_kth_largest(values, k)
    assert kth.shape == index.shape == (40, 3)
    assert int(index.max()) < length
    rows = values.numpy().reshape(-1, length)
    for row, got_value, got_index in zip(rows, kth.reshape(-1).tolist(), index.reshape(-1).tolist()):
        assert got_value == _kth_largest_np(row, k)
        assert row[got_index] == got_value
    # k passes of max on a scratch copy (small k x length) give the same values and indices
    for scratch in (values.clone(), values[3:].clone()):  # with and without a -inf k-th largest
        original = scratch.clone()
        repeated, where = select_kth_largest(scratch, k, overwrite=True)
        topk_values, topk_index = select_kth_largest(original, k)
        assert torch.equal(repeated, topk_values)
        assert (original.gather(-1, where.unsqueeze(-1)).squeeze(-1) == repeated).all()
        tie_free = torch.ones_like(repeated, dtype=torch.bool)
        if scratch.shape[0] == 40:
            tie_free[:3] = False
        assert torch.equal(where[tie_free], topk_index[tie_free])
    # the padded path and the plain one agree exactly on tie-free rows
    plain_values, plain_index = torch.topk(values[3:], k, dim=-1, sorted=False)
    smallest, where = plain_values.min(dim=-1, keepdim=True)
    assert torch.equal(kth[3:], smallest.squeeze(-1))
    assert torch.equal(index[3:], plain_index.gather(-1, where).squeeze(-1))


def test_selection_rules_only_act_on_rows_shorter_than_64k():
    for k in range(1, 80):
        for length in range(k, 1200, 7):
            pays = _heap_selection_pays(k, length)
            assert not (pays and length >= 64 * k)  # topk already keeps a heap there
            if k >= 40 and length <= 1000:
                assert not pays  # 64k (2.5 + 0.1k) ns is more than 9.5 ns per entry of the row
    assert _heap_selection_pays(2, 42) and not _heap_selection_pays(2, 30)
    assert _heap_selection_pays(21, 1000) and not _heap_selection_pays(11, 250)
    for k in range(1, 80):  # max passes only where topk would run an nth_element, and k <= 6
        for length in range(k, 1200, 7):
            assert not (_repeated_max_pays(k, length) and (length >= 64 * k or k > 6))
    assert _repeated_max_pays(2, 42) and _repeated_max_pays(6, 90) and not _repeated_max_pays(6, 30)


@pytest.mark.parametrize(
    "classes, k, members", [(1000, 2, 5), (1000, 6, 2), (1000, 11, 10), (1000, 51, 8), (100, 1, 10), (601, 3, 1)]
)
def test_group_members_leave_a_heap_selection_or_at_least_2k_groups(classes, k, members):
    """P divides L; L/P >= 64k (heap selection of the k-th group maximum) when some P in
    [2, 16] allows it, else the largest P with L/P >= 2k; 1 when no P in [2, 16] divides L."""
    assert _group_members(classes, k) == members
    if members > 1:
        assert classes % members == 0 and classes // members >= 2 * k
        heap = [p for p in range(2, 17) if classes % p == 0 and classes // p >= 64 * k]
        assert (classes // members >= 64 * k) == bool(heap)


def test_compact_lists_the_kept_columns_of_every_row_in_order():
    g = torch.Generator().manual_seed(0)
    keep = torch.rand(9, 40, generator=g) < torch.rand(9, 1, generator=g)
    keep[3] = False  # an empty row
    keep[4] = True  # a full row: the width
    positions, padding = _compact(keep)
    assert positions.shape == (9, 40) and torch.equal(padding, positions == 40)
    for row in range(9):
        expected = keep[row].nonzero().squeeze(1).tolist()
        assert positions[row][~padding[row]].tolist() == expected
        assert int((~padding[row]).sum()) == len(expected)


@pytest.mark.parametrize("scale", [40.0, 6.0])  # few groups reach the cut / most of them do
def test_group_and_class_compaction_keep_the_same_classes(monkeypatch, scale):
    """The two ways of compacting (group by group, or over all classes) keep the same set."""
    scores, _ = _spread_scores(64, 1000, seed=3, spread=scale, dtype=torch.float32)
    scores = scores.detach()
    kept = []
    for share in (0.0, 1.1):  # never / always group by group
        monkeypatch.setattr("setvalued.losses.topk_operator._GROUP_COMPACTION_SHARE", share)
        values, classes = _pruned_candidates(scores, 4, 0.2, 3)
        real = classes < 1000
        rows = real.nonzero(as_tuple=True)[0]
        assert torch.equal(values[real], scores[rows, classes[real]])
        assert (values[~real] == -math.inf).all()
        kept.append(sorted(zip(rows.tolist(), classes[real].tolist())))
    assert kept[0] == kept[1] and len(kept[0]) > 64 * 4


def test_pruned_path_with_a_prime_number_of_classes():
    """L = 601 has no divisor to group by: the bound is the k-th largest score itself."""
    scores, _ = _spread_scores(300, 601, seed=5, spread=30.0)
    assert _pruned_candidates(scores.detach(), 3, 1.0, 4)[0].shape[1] < 601 / 4
    noise = torch.randn(300, 4, 601, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    values = [smooth_kth_largest(scores, 3, 1.0, 4, noise=noise, exact=exact) for exact in (False, True)]
    grads = [torch.autograd.grad(v.sum(), scores)[0] for v in values]
    assert torch.equal(values[0], values[1]) and torch.equal(grads[0], grads[1])


def test_pruning_falls_back_to_the_exact_path_where_it_cannot_pay():
    dense, _ = _spread_scores(64, 1000, seed=0, spread=2.0, dtype=torch.float32)  # std 2 / eps 1
    spread, _ = _spread_scores(64, 1000, seed=0, spread=40.0, dtype=torch.float32)
    assert _pruned_candidates(dense.detach(), 2, 1.0, 3) is None  # every class within reach
    assert _pruned_candidates(spread.detach(), 2, 1.0, 3) is not None
    assert _pruned_candidates(spread.detach()[:, :100], 2, 1.0, 3) is None  # M L < 500: cheap draw
    assert _pruned_candidates(spread.detach(), 126, 1.0, 3) is None  # k > L / 8


@pytest.mark.parametrize("k, eps, samples", [(1, 1.0, 3), (5, 0.2, 10), (20, 0.5, 4)])
def test_pruned_path_equals_the_exact_path_draw_by_draw(k, eps, samples):
    """Same noise, same result: value and gradient identical on thousands of draws."""
    batch, classes = 400, 300
    scores, targets = _spread_scores(batch, classes, seed=k, spread=30 * eps)
    noise = torch.randn(batch, samples, classes, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
    assert _pruned_candidates(scores.detach(), k + 1, eps, samples)[0].shape[1] < 0.4 * classes
    results = []
    for exact in (False, True):
        loss = build_loss("noised_topk", k=k, epsilon=eps, n_samples=samples, reduction="none", exact=exact)
        values = loss.per_sample(scores, targets, noise=noise)
        (grad,) = torch.autograd.grad(values.sum(), scores)
        results.append((values, grad))
        smoothed = smooth_kth_largest(scores, k + 1, eps, samples, noise=noise, exact=exact)
        results.append((smoothed, torch.autograd.grad(smoothed.sum(), scores)[0]))
    assert torch.equal(results[0][0], results[2][0]) and torch.equal(results[0][1], results[2][1])
    assert torch.equal(results[1][0], results[3][0]) and torch.equal(results[1][1], results[3][1])
    assert (results[0][0] > 0).any() and (results[0][0] == 0).any()
    counts = [50 + 7 * j for j in range(classes)]
    cosines = torch.tanh(scores.detach() / (30 * eps)).requires_grad_(True)
    imbalanced = [
        build_loss(
            "noised_topk_imbalanced",
            k=k,
            epsilon=0.02,
            n_samples=samples,
            max_margin=0.2,
            scale=30.0,
            class_counts=counts,
            reduction="none",
            exact=exact,
        )
        for exact in (False, True)
    ]
    pruned, exact = (loss.per_sample(cosines, targets, noise=noise) for loss in imbalanced)
    assert torch.equal(pruned, exact)
    assert torch.equal(torch.autograd.grad(pruned.sum(), cosines)[0], torch.autograd.grad(exact.sum(), cosines)[0])


@pytest.mark.parametrize("k", [1, 2, 10, 50])
def test_pruned_path_equals_the_exact_path_in_the_benchmark_regime(k):
    """Logits of std 4, epsilon 0.2, L = 1000, float32 (benchmarks/losses.py, `spread`): every
    listing (group by group at small K, over all classes above) and both selections (max passes,
    topk) gives the exact path's value and gradient on the same noise."""
    batch, classes, samples, eps = 64, 1000, 3, 0.2
    scores, targets = _spread_scores(batch, classes, seed=k, spread=4.0, dtype=torch.float32)
    noise = torch.randn(batch, samples, classes, generator=torch.Generator().manual_seed(k))
    assert _pruned_candidates(scores.detach(), k + 1, eps, samples)[0].shape[1] < classes / 3
    results = []
    for exact in (False, True):
        loss = build_loss("noised_topk", k=k, epsilon=eps, n_samples=samples, reduction="none", exact=exact)
        values = loss.per_sample(scores, targets, noise=noise)
        results.append((values, torch.autograd.grad(values.sum(), scores)[0]))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert (results[0][0] > 0).any()


def test_pruned_path_at_the_edge_of_the_window():
    """Classes just inside the cut are kept, just outside dropped, and nothing changes."""
    samples, k, eps, classes = 4, 3, 1.0, 200
    width = _pruning_window(k, classes, samples)
    row = torch.full((classes,), -1000.0, dtype=torch.float64)
    row[[5, 77, 150]] = 10.0  # the k anchors, in different groups
    row[[6, 7, 8]] = 10.0 - eps * width + 1e-6  # inside the band
    row[[9, 10, 11]] = 10.0 - eps * width - 1e-6  # outside
    row[[12, 13]] = 10.0 - 2.0  # within reach: often the k-th of a noisy copy
    scores = row.expand(2000, -1).clone().requires_grad_(True)
    _, candidates = _pruned_candidates(scores.detach(), k, eps, samples)
    kept = set(candidates[0][candidates[0] < classes].tolist())
    assert kept == {5, 77, 150, 6, 7, 8, 12, 13}
    noise = torch.randn(2000, samples, classes, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    values = [smooth_kth_largest(scores, k, eps, samples, noise=noise, exact=exact) for exact in (False, True)]
    grads = [torch.autograd.grad(v.sum(), scores)[0] for v in values]
    assert torch.equal(values[0], values[1]) and torch.equal(grads[0], grads[1])
    assert grads[0][:, [12, 13]].sum() > 0


def _brute_force_noised_hinge(
    row: np.ndarray, target: int, k: int, eps: float, samples: int, replicates: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per-replicate loss (R,) and gradient (R, L) of thesis eqs. 4.10 and 4.12, in float64,
    drawing noise for every class (numpy's generator, independent of torch's)."""
    rng = np.random.default_rng(seed)
    classes = row.shape[0]
    losses, grads = np.empty(replicates), np.zeros((replicates, classes))
    chunk = 2000
    for start in range(0, replicates, chunk):
        n = min(chunk, replicates - start)
        perturbed = row + eps * rng.standard_normal((n, samples, classes))
        picks = np.argpartition(-perturbed, k, axis=-1)[..., k]  # index of the (k+1)-th largest
        kth = np.take_along_axis(perturbed, picks[..., None], -1)[..., 0].mean(-1)
        hinge = 1 + kth - row[target]
        losses[start : start + n] = np.maximum(hinge, 0)
        active = hinge > 0
        block = np.zeros((n, classes))
        np.add.at(block, (np.repeat(np.arange(n), samples), picks.reshape(-1)), 1 / samples)
        block[:, target] -= 1
        grads[start : start + n] = block * active[:, None]
    return losses, grads


def test_pruned_loss_and_gradient_match_a_float64_brute_force_monte_carlo():
    """Most classes far below the (K+1)-th (the regime pruning exploits), a few within reach."""
    k, eps, samples, classes, replicates = 2, 0.5, 4, 400, 20000
    rng = np.random.default_rng(7)
    row = rng.normal(-12.0, 2.0, classes)  # far below: about 20 eps under the top
    row[:6] = [1.0, 0.9, 0.6, 0.4, -0.3, -1.2]  # the top k + 1 and the ones within reach
    target = 2
    loss = build_loss("noised_topk", k=k, epsilon=eps, n_samples=samples, reduction="none")
    scores = torch.tensor(row).expand(replicates, -1).clone().requires_grad_(True)
    assert _pruned_candidates(scores.detach(), k + 1, eps, samples)[0].shape[1] < 20
    torch.manual_seed(3)
    values = loss(scores, torch.full((replicates,), target))
    (grad,) = torch.autograd.grad(values.sum(), scores)
    ref_values, ref_grads = _brute_force_noised_hinge(row, target, k, eps, samples, replicates, 11)

    def close(a, b, axis=0):
        error = np.sqrt(a.var(axis) / len(a) + b.var(axis) / len(b))
        return np.abs(a.mean(axis) - b.mean(axis)) <= 5 * error + 1e-12

    assert close(values.detach().numpy(), ref_values)
    assert close(grad.numpy(), ref_grads).all()
    # the comparison has teeth: classes 3-5 are sometimes the (K+1)-th, and the hinge is active
    for mean_grad in (ref_grads.mean(0), grad.numpy().mean(0)):
        assert (mean_grad[3:5] > 0.02).all() and mean_grad[5] > 3e-4
    assert 0.1 < ref_values.mean() < 2.0


@pytest.mark.parametrize("epsilon, offset", [(1e-8, 0.0), (1e-4, 6e4)])
def test_pruned_path_keeps_the_classes_at_the_cut_when_the_window_rounds_away(epsilon, offset):
    """Issue 23: where eps * w is below half an ulp of the bound t, ``t - eps w`` rounds back onto
    t; the cut must still keep the classes scoring t (it raised "selected index k out of range").
    K = 1: 1 + s_[2] - s_y = 1 + 14 - 0, the noise below the float32 rounding of the scores
    (about 0.01 at 6e4: (s / eps + Z) eps rounds at 6e8)."""
    scores = (torch.arange(16.0) + offset)[None]
    assert _pruned_candidates(scores, 2, epsilon, 40) is not None  # the pruned path runs
    values = [
        build_loss("noised_topk", k=1, epsilon=epsilon, n_samples=40, exact=exact)(scores, torch.tensor([0])).item()
        for exact in (False, True)
    ]
    assert values[0] == pytest.approx(15.0, abs=0.02) and values[0] == pytest.approx(values[1], abs=0.02)


@pytest.mark.parametrize("k", [1, 5, 50])
def test_fixed_shape_path_equals_the_exact_path_draw_by_draw(k, monkeypatch):
    """The path of fixed shapes (GPU, torch.compile: setvalued.losses.base.fixed_shapes), forced
    here on CPU: on the same noise, the exact path's value and gradient, for both noised losses
    and the smoothed k-th largest."""
    import setvalued.losses.topk_operator as topk_operator

    batch, classes, samples, eps = 64, 1000, 3, 0.2
    scores, targets = _spread_scores(batch, classes, seed=k, spread=4.0, dtype=torch.float32)
    noise = torch.randn(batch, samples, classes, generator=torch.Generator().manual_seed(k))
    counts = [50 + 7 * j for j in range(classes)]
    cosines = torch.tanh(scores.detach() / 4.0).requires_grad_(True)

    def run(exact):
        out = []
        for name, inputs, params in (
            ("noised_topk", scores, dict(epsilon=eps)),
            ("noised_topk_imbalanced", cosines, dict(epsilon=0.02, class_counts=counts, scale=30.0)),
        ):
            loss = build_loss(name, k=k, n_samples=samples, reduction="none", exact=exact, **params)
            values = loss.per_sample(inputs, targets, noise=noise)
            out += [values, torch.autograd.grad(values.sum(), inputs)[0]]
        smoothed = smooth_kth_largest(scores, k + 1, eps, samples, noise=noise)
        return out + [smoothed, torch.autograd.grad(smoothed.sum(), scores)[0]]

    exact = run(True)
    monkeypatch.setattr(topk_operator, "fixed_shapes", lambda values: True)
    fixed = run(False)
    for a, b in zip(fixed, exact):
        assert torch.equal(a, b)
    assert (exact[0] > 0).any() and (exact[2] > 0).any()


def test_exact_path_draws_noise_for_every_class():
    batch, classes, samples, k, eps = 8, 200, 3, 1, 0.1
    scores, targets = _spread_scores(batch, classes, seed=1, spread=5.0)
    loss = build_loss("noised_topk", k=k, epsilon=eps, n_samples=samples, exact=True)
    torch.manual_seed(12)
    value = loss(scores, targets)
    torch.manual_seed(12)
    noise = torch.randn(batch, samples, classes, dtype=torch.float64)
    assert value.item() == pytest.approx(loss.reduce(loss.per_sample(scores, targets, noise=noise)).item(), abs=1e-12)
    assert _pruned_candidates(scores.detach(), k + 1, eps, samples)[0].shape[1] < classes / 4


# ------------------------------------------------------------------------------------
# Imbalanced noised loss, LDAM margins, LDAM, focal, CE
# ------------------------------------------------------------------------------------


def test_ldam_margins_small_example():
    margins = ldam_margins([17, 23, 55], 0.3)
    assert margins.dtype == torch.float32
    assert np.allclose(margins.numpy(), [0.3, 0.27816, 0.22369], atol=5e-6)
    # the formula max_margin * (n_min / n)^(1/4): rarest class gets the max, monotone decreasing
    counts = np.array([400, 3, 50, 3, 1000])
    margins = ldam_margins(counts.tolist(), 0.5).numpy()
    assert np.allclose(margins, 0.5 * (3 / counts) ** 0.25, atol=1e-7)
    assert margins.max() == pytest.approx(0.5)
    order = np.argsort(counts)
    assert np.all(np.diff(margins[order]) <= 0)


def test_noised_topk_imbalanced_matches_formula_and_scale_is_a_multiplier():
    batch, classes, samples, k, eps = 10, 6, 4, 2, 0.05
    counts = [50, 7, 3, 20, 9, 100]
    cosines = torch.tanh(
        torch.randn(batch, classes, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ).requires_grad_(True)
    targets = torch.randint(classes, (batch,), generator=torch.Generator().manual_seed(4))
    noise = torch.randn(batch, samples, classes, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    loss = build_loss(
        "noised_topk_imbalanced",
        k=k,
        epsilon=eps,
        n_samples=samples,
        max_margin=0.3,
        scale=40.0,
        class_counts=counts,
        reduction="none",
    )
    assert loss.head == "normed"
    values = loss.per_sample(cosines, targets, noise=noise)
    margins = 0.3 * (min(counts) / np.array(counts)) ** 0.25
    c, z = cosines.detach().numpy(), noise.numpy()
    for i in range(batch):
        smoothed = np.mean([_kth_largest_np(c[i] + eps * z[i, m], k + 1) for m in range(samples)])
        # erratum T-E9: scale multiplies the whole hinge; margins and eps are in cosine units
        expected = max(0.0, 40.0 * (margins[targets[i]] + smoothed - c[i, targets[i]]))
        assert values[i].item() == pytest.approx(expected, rel=1e-6, abs=1e-6)
    other = build_loss(
        "noised_topk_imbalanced",
        k=k,
        epsilon=eps,
        n_samples=samples,
        max_margin=0.3,
        scale=4.0,
        class_counts=counts,
        reduction="none",
    )
    assert torch.allclose(other.per_sample(cosines, targets, noise=noise) * 10, values, atol=1e-12)
    assert (values > 0).any() and (values == 0).any()


def test_ldam_matches_margin_shifted_cross_entropy_and_reduces_to_ce():
    counts = [30, 4, 12, 90]
    cosines = torch.tanh(
        torch.randn(8, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ).requires_grad_(True)
    targets = torch.tensor([0, 1, 2, 3, 1, 1, 0, 2])
    ldam = build_loss("ldam", max_margin=0.4, scale=30.0, class_counts=counts, reduction="none")
    assert ldam.head == "normed"
    values = ldam(cosines, targets).detach().numpy()
    margins = 0.4 * (min(counts) / np.array(counts)) ** 0.25
    c = cosines.detach().numpy()
    for i in range(8):
        logits = 30.0 * c[i]
        y = targets[i].item()
        logits[y] = 30.0 * (c[i, y] - margins[y])
        expected = -logits[y] + np.log(np.exp(logits).sum())
        assert values[i] == pytest.approx(expected, abs=1e-5)  # margins are a float32 buffer
    plain = build_loss("ldam", max_margin=0.0, scale=1.0, class_counts=counts)
    assert torch.allclose(plain(cosines, targets), F.cross_entropy(cosines, targets), atol=1e-14)


def test_focal_with_gamma_zero_equals_ce_and_matches_formula():
    scores, targets = _scores(16, 7, seed=3, scale=2.0)
    ce = build_loss("ce")
    focal0 = build_loss("focal", gamma=0.0)
    assert torch.allclose(focal0(scores, targets), ce(scores, targets), atol=1e-14)
    (g0,) = torch.autograd.grad(focal0(scores, targets), scores)
    (gce,) = torch.autograd.grad(ce(scores, targets), scores)
    assert torch.allclose(g0, gce, atol=1e-14)
    assert torch.allclose(ce(scores, targets), F.cross_entropy(scores, targets), atol=1e-14)
    # erratum T-E2: (1 - p_y)^gamma * CE with p_y = softmax(s)_y
    focal2 = build_loss("focal", gamma=2.0, reduction="none")
    p = torch.softmax(scores.detach(), dim=1).numpy()[np.arange(16), targets.numpy()]
    expected = (1 - p) ** 2 * -np.log(p)
    assert np.allclose(focal2(scores, targets).detach().numpy(), expected, atol=1e-12)


def test_focal_gradient_is_finite_when_the_target_is_certain():
    scores = torch.tensor([[200.0, 0.0, -3.0], [0.0, 1.0, 2.0]], requires_grad=True)
    targets = torch.tensor([0, 2])
    loss = build_loss("focal", gamma=0.5)(scores, targets)
    (grad,) = torch.autograd.grad(loss, scores)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_smooth_losses_pass_gradcheck_float64():
    scores, targets = _scores(5, 6, seed=8, scale=0.8)
    counts = [10, 3, 8, 40, 2, 5]
    losses = [
        build_loss("ce"),
        build_loss("focal", gamma=2.0),
        build_loss("focal", gamma=0.5),
        build_loss("ldam", max_margin=0.3, scale=5.0, class_counts=counts),
    ]
    for loss in losses:
        assert torch.autograd.gradcheck(lambda s, loss=loss: loss(s, targets), (scores,))


# ------------------------------------------------------------------------------------
# [LHS15] hinges and calibrated hinge against numpy
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4])
def test_hinge_losses_match_numpy_formulas(k):
    scores, targets = _mixed_scores(40, 6, seed=10 + k, scale=0.6)
    s, t = scores.detach().numpy(), targets.numpy()
    lapin = build_loss("hinge_topk", k=k, reduction="none")(scores, targets).detach().numpy()
    convex = build_loss("cvx_hinge_topk", k=k, reduction="none")(scores, targets).detach().numpy()
    calibrated = build_loss("calibrated_hinge_topk", k=k, reduction="none")(scores, targets).detach().numpy()
    for i in range(40):
        others = np.delete(s[i], t[i])
        assert lapin[i] == pytest.approx(max(0, 1 + _kth_largest_np(others, k) - s[i, t[i]]), abs=1e-12)
        shifted = s[i] + 1 - np.eye(6)[t[i]]
        assert convex[i] == pytest.approx(max(0, np.sort(shifted)[::-1][:k].mean() - s[i, t[i]]), abs=1e-12)
        assert calibrated[i] == pytest.approx(max(0, 1 + _kth_largest_np(s[i], k + 1) - s[i, t[i]]), abs=1e-12)
    assert (lapin > 0).any() and (lapin == 0).any()
    for name in ("hinge_topk", "cvx_hinge_topk", "calibrated_hinge_topk"):
        loss = build_loss(name, k=k)
        assert torch.autograd.gradcheck(lambda x, loss=loss: loss(x, targets), (scores,))


def test_calibrated_hinge_uses_the_k_plus_1_th_score_including_the_target():
    """Digest 1.4 "K+1 index": (1 + s_[k+1] - s_y)_+ over the full vector, s_y included."""
    scores = torch.tensor([[3.0, 2.0, 0.0, -1.0]], dtype=torch.float64)
    loss = build_loss("calibrated_hinge_topk", k=1)
    # y ranked 1st: 1 + s_[2] - s_y = 1 + 2 - 3 = 0; with tau_k = s_[1] it would be 1
    assert loss(scores, torch.tensor([0])).item() == pytest.approx(0.0)
    # y ranked 2nd: s_[2] is s_y itself, so the loss is exactly 1; excluding y would give 1 + 0 - 2 < 0
    assert loss(scores, torch.tensor([1])).item() == pytest.approx(1.0)
    noised = build_loss("noised_topk", k=1, epsilon=0.0, n_samples=1)
    assert noised(scores, torch.tensor([1])).item() == pytest.approx(1.0)


# ------------------------------------------------------------------------------------
# Registry, reductions, parameter errors
# ------------------------------------------------------------------------------------


def test_registry_holds_every_top_k_loss_with_its_head_and_context_keys():
    counts = [5, 6, 7, 8, 9, 3, 4, 2]
    for name in TOPK_NAMES:
        assert name in LOSSES
        loss = build_loss(name, class_counts=counts, num_classes=8, num_examples=44)
        expected_head = "normed" if name in ("ldam", "noised_topk_imbalanced") else "linear"
        assert loss.head == expected_head, name
        assert loss.requires_indices is False
        scores, targets = _scores(4, 8, seed=1, dtype=torch.float32)
        value = loss(scores, targets)
        assert value.shape == () and torch.isfinite(value)


def test_reductions():
    scores, targets = _scores(6, 5, seed=2)
    for name, params in (
        ("calibrated_hinge_topk", {"k": 2}),
        ("ce", {}),
        ("focal", {"gamma": 1.0}),
        ("noised_topk", {"k": 2, "epsilon": 0.0}),
    ):
        per_sample = build_loss(name, reduction="none", **params)(scores, targets)
        assert per_sample.shape == (6,)
        assert build_loss(name, **params)(scores, targets).item() == pytest.approx(per_sample.mean().item())
        assert build_loss(name, reduction="sum", **params)(scores, targets).item() == pytest.approx(
            per_sample.sum().item()
        )
    with pytest.raises(ValueError, match="reduction must be one of"):
        build_loss("ce", reduction="max")


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("noised_topk", {"k": 0}, r"k must be an integer >= 1"),
        ("noised_topk", {"k": 2.5}, r"k must be an integer"),
        ("noised_topk", {"k": 5, "num_classes": 5}, r"k must be in \[1, 4\] for 5 classes"),
        ("noised_topk", {"epsilon": -0.1}, r"epsilon must be >= 0"),
        ("noised_topk", {"epsilon": float("nan")}, r"epsilon must be finite"),
        ("noised_topk", {"n_samples": 0}, r"n_samples must be an integer >= 1"),
        ("noised_topk_imbalanced", {"class_counts": [1, 2, 0]}, r"class_counts must be finite and > 0"),
        ("noised_topk_imbalanced", {"class_counts": None}, r"class_counts is required"),
        (
            "noised_topk_imbalanced",
            {"k": 2, "class_counts": [1, 2, 3], "num_classes": 4},
            r"class_counts must have one entry per class \(length 4\), got length 3",
        ),
        ("noised_topk_imbalanced", {"class_counts": [1, 2, 3], "scale": 0}, r"scale must be > 0"),
        ("noised_topk_imbalanced", {"class_counts": [1, 2, 3], "max_margin": -1}, r"max_margin must be >= 0"),
        ("ldam", {"class_counts": [4, -1]}, r"class_counts must be finite and > 0"),
        ("ldam", {"class_counts": [[1, 2]]}, r"class_counts must be a non-empty 1-D list"),
        ("focal", {"gamma": -1}, r"gamma must be >= 0"),
        ("hinge_topk", {"k": True}, r"k must be an integer"),
        ("ce", {"epsilon": 0.1}, r"loss 'ce' has no parameter 'epsilon'"),
        ("noised_topk", {"exact": "yes"}, r"exact must be true or false"),
        ("noised_topk_imbalanced", {"class_counts": [1, 2, 3], "exact": 1}, r"exact must be true or false"),
    ],
)
def test_bad_parameters_raise_value_error_naming_the_parameter(name, params, message):
    with pytest.raises(ValueError, match=message):
        build_loss(name, **params)


def test_k_too_large_for_the_scores_is_reported_at_call_time():
    scores, targets = _scores(3, 4, seed=0)
    for name in ("noised_topk", "calibrated_hinge_topk", "hinge_topk", "cvx_hinge_topk"):
        with pytest.raises(ValueError, match=rf"{name}: k must be in \[1, 3\] for 4 classes"):
            build_loss(name, k=4)(scores, targets)
    loss = build_loss("ldam", class_counts=[1, 2, 3])
    with pytest.raises(ValueError, match=r"class_counts has 3 entries but the scores have 4 classes"):
        loss(scores, targets)


# ------------------------------------------------------------------------------------
# NormedLinear
# ------------------------------------------------------------------------------------


def test_normed_linear_outputs_cosines():
    torch.manual_seed(0)
    layer = NormedLinear(6, 4)
    assert layer.weight.shape == (6, 4)
    assert torch.allclose(layer.weight.norm(dim=0), torch.ones(4), atol=1e-6)
    features = torch.randn(5, 6) * 7.0
    out = layer(features)
    w = layer.weight.detach()
    expected = torch.stack([torch.stack([F.cosine_similarity(f, w[:, c], dim=0) for c in range(4)]) for f in features])
    assert torch.allclose(out, expected, atol=1e-6)
    assert (out.abs() <= 1 + 1e-6).all()
    assert torch.allclose(layer(features * 3.0), out, atol=1e-6)  # scale-invariant
    out.sum().backward()
    assert torch.isfinite(layer.weight.grad).all() and layer.weight.grad.abs().sum() > 0
    with torch.no_grad():
        layer.weight.mul_(5.0)
    assert torch.allclose(layer(features), out.detach(), atol=1e-6)
    with pytest.raises(ValueError, match=r"features of shape \(batch, 6\)"):
        layer(torch.randn(5, 3))
