"""Split conformal prediction ([Gar23] §2.2.2): the coverage guarantee of eq. 2.5 by simulation,
the score definitions against direct loops, Mondrian coverage per class, the calibration split
and the level matching a mean set size."""

from __future__ import annotations

import math

import pytest
import torch

from setvalued.metrics import (
    MatchedLevel,
    aps_scores,
    calibrate,
    conformal_quantile,
    coverage_and_size,
    lac_scores,
    match_average_size,
    nonconformity,
    prediction_sets,
    split_calibration,
)

torch.set_num_threads(1)
F64 = torch.float64


def synthetic(gen: torch.Generator, shape: tuple[int, ...], num_classes: int = 5, scale: float = 2.0):
    """Exchangeable (i.i.d.) examples: the model's probabilities and labels drawn from another,
    flatter distribution, so the model is miscalibrated (the guarantee must not care)."""
    logits = torch.randn(*shape, num_classes, generator=gen, dtype=F64) * scale
    probs = torch.softmax(logits, dim=-1)
    truth = torch.softmax(0.5 * logits, dim=-1)
    labels = torch.multinomial(truth.reshape(-1, num_classes), 1, generator=gen).reshape(shape)
    return probs, labels


def simulate_coverage(
    n: int, alpha: float, score: str, reps: int = 600, m: int = 100, seed: int = 0, randomized: bool = False
) -> tuple[float, float]:
    """Mean over repetitions of the test coverage of sets calibrated on n fresh examples, and its
    Monte-Carlo standard error."""
    gen = torch.Generator().manual_seed(seed)
    probs, labels = synthetic(gen, (reps, n + m))
    coverages = []
    for r in range(reps):
        q = calibrate(probs[r, :n], labels[r, :n], alpha, score, randomized=randomized, generator=gen)
        sets = prediction_sets(probs[r, n:], q, score, randomized=randomized, generator=gen)
        coverages.append(coverage_and_size(sets, labels[r, n:])["coverage"])
    values = torch.tensor(coverages, dtype=F64)
    return float(values.mean()), float(values.std() / math.sqrt(reps))


# ----------------------------------------------------------------------------------------------
# the quantile and the guarantee (eq. 2.5)
# ----------------------------------------------------------------------------------------------


def test_quantile_is_the_ceil_rank_order_statistic():
    scores = torch.arange(10, dtype=F64) / 10  # 0.0 .. 0.9
    assert conformal_quantile(scores, 0.1) == pytest.approx(0.9)  # ceil(11 * 0.9) = 10
    assert conformal_quantile(scores, 0.2) == pytest.approx(0.8)  # ceil(8.8) = 9
    assert conformal_quantile(scores, 0.05) == math.inf  # ceil(10.45) = 11 > n
    assert conformal_quantile(scores, 0.95) == pytest.approx(0.0)  # ceil(0.55) = 1
    # (n + 1)(1 - alpha) = 100 * 0.9 is 90 (not 91 by rounding)
    assert conformal_quantile(torch.arange(99, dtype=F64), 0.1) == 89.0
    assert conformal_quantile(torch.tensor([0.3, 0.1, 0.2]), 0.25) == pytest.approx(0.3)
    for bad in (0, 1, -0.1, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match="alpha must be a number in"):
            conformal_quantile(scores, bad)


@pytest.mark.parametrize("n, alpha", [(19, 0.1), (48, 0.1), (30, 0.2)])
def test_marginal_coverage_guarantee_by_simulation(n, alpha):
    """1 - alpha <= P(Y in C(X)) <= 1 - alpha + 1/(n+1); with continuous scores it is exactly
    k/(n+1), k = ceil((n+1)(1-alpha)): n = 19 hits the lower bound, n = 48 is near the upper."""
    mean, se = simulate_coverage(n, alpha, "lac", seed=n)
    k = math.ceil(round((n + 1) * (1 - alpha), 9))
    assert abs(mean - k / (n + 1)) < 4 * se, (mean, k / (n + 1), se)
    assert 1 - alpha - 3 * se <= mean <= 1 - alpha + 1 / (n + 1) + 3 * se


@pytest.mark.parametrize("randomized", [False, True])
def test_aps_coverage_guarantee_by_simulation(randomized):
    n, alpha = 40, 0.1
    mean, se = simulate_coverage(n, alpha, "aps", seed=7, randomized=randomized)
    k = math.ceil(round((n + 1) * (1 - alpha), 9))
    if randomized:  # continuous scores: exactly k/(n+1); without U the score 1 of a last-ranked
        # label is an atom (ties), which only the bounds tolerate
        assert abs(mean - k / (n + 1)) < 4 * se, (mean, k / (n + 1), se)
    assert 1 - alpha - 3 * se <= mean <= 1 - alpha + 1 / (n + 1) + 3 * se


# ----------------------------------------------------------------------------------------------
# the scores and the sets
# ----------------------------------------------------------------------------------------------


def test_lac_scores_and_sets_are_thresholded_probabilities():
    gen = torch.Generator().manual_seed(1)
    probs, labels = synthetic(gen, (300,), num_classes=8)
    assert torch.equal(lac_scores(probs, labels), 1 - probs[torch.arange(300), labels])
    q = calibrate(probs[:200], labels[:200], 0.1, "lac")
    assert q == conformal_quantile(1 - probs[torch.arange(200), labels[:200]], 0.1)
    sets = prediction_sets(probs[200:], q, "lac")
    assert torch.equal(sets, probs[200:] >= 1 - q)
    # y is in its set exactly when its score is at most q_hat
    assert torch.equal(sets[torch.arange(100), labels[200:]], lac_scores(probs[200:], labels[200:]) <= q)


def test_aps_scores_against_a_loop():
    gen = torch.Generator().manual_seed(2)
    probs, labels = synthetic(gen, (50,), num_classes=6)
    probs[0] = torch.tensor([0.3, 0.2, 0.3, 0.1, 0.1, 0.0], dtype=F64)  # ties: by class index
    expected = []
    for row, label in zip(probs, labels):
        order = sorted(range(6), key=lambda j: (-float(row[j]), j))
        expected.append(sum(float(row[j]) for j in order[: order.index(int(label)) + 1]))
    assert aps_scores(probs, labels).tolist() == pytest.approx(expected, abs=1e-12)
    assert nonconformity(probs[:1], "aps")[0].tolist() == pytest.approx([0.3, 0.8, 0.6, 0.9, 1.0, 1.0])
    # randomised: the mass before the label plus (1 - U) p_y, U from the generator
    u = torch.rand(50, 1, generator=torch.Generator().manual_seed(5), dtype=F64)[:, 0]
    randomized = aps_scores(probs, labels, randomized=True, generator=torch.Generator().manual_seed(5))
    p_y = probs[torch.arange(50), labels]
    assert randomized.tolist() == pytest.approx((torch.tensor(expected, dtype=F64) - u * p_y).tolist(), abs=1e-12)


@pytest.mark.parametrize("randomized", [False, True])
def test_aps_sets_grow_in_probability_order(randomized):
    gen = torch.Generator().manual_seed(3)
    probs, labels = synthetic(gen, (400,), num_classes=7)
    for alpha in (0.05, 0.2, 0.5):
        q = calibrate(probs[:200], labels[:200], alpha, "aps", randomized=randomized, generator=gen)
        sets = prediction_sets(probs[200:], q, "aps", randomized=randomized, generator=gen)
        order = torch.sort(probs[200:], dim=1, descending=True, stable=True).indices
        ranked = sets.gather(1, order).long()
        # a prefix of the decreasing order: 1..1 0..0 (the top class first, then the next, ...)
        assert bool((ranked[:, 1:] <= ranked[:, :-1]).all())
        if not randomized:  # the prefix whose cumulative mass stays within q_hat
            mass = probs[200:].gather(1, order).cumsum(dim=1)
            assert torch.equal(ranked.bool(), mass <= q)
    # larger alpha, smaller sets (nested)
    small = prediction_sets(probs, calibrate(probs, labels, 0.4, "aps"), "aps")
    large = prediction_sets(probs, calibrate(probs, labels, 0.1, "aps"), "aps")
    assert bool((small <= large).all())


def test_bad_arguments_are_refused():
    probs = torch.full((4, 3), 1 / 3, dtype=F64)
    labels = torch.tensor([0, 1, 2, 0])
    with pytest.raises(ValueError, match="score must be one of"):
        calibrate(probs, labels, 0.1, "raps")
    with pytest.raises(ValueError, match="randomized applies to the 'aps' score only"):
        calibrate(probs, labels, 0.1, "lac", randomized=True)
    with pytest.raises(ValueError, match="needs class_counts"):
        calibrate(probs, labels, 0.1, mondrian="shot")
    with pytest.raises(ValueError, match="mondrian must be one of"):
        calibrate(probs, labels, 0.1, mondrian="label")
    with pytest.raises(ValueError, match=r"labels_cal must lie in \[0, 2\]"):
        calibrate(probs, torch.tensor([0, 1, 3, 0]), 0.1)
    with pytest.raises(ValueError, match="one class index per row"):
        calibrate(probs, torch.tensor([0, 1]), 0.1)
    with pytest.raises(ValueError, match="thresholds must be a number or one per class"):
        prediction_sets(probs, torch.zeros(2))
    with pytest.raises(ValueError, match="class_counts has 2 entries"):
        calibrate(probs, labels, 0.1, mondrian="shot", class_counts=[5, 500])


# ----------------------------------------------------------------------------------------------
# Mondrian (class-conditional) calibration
# ----------------------------------------------------------------------------------------------


def test_mondrian_coverage_holds_per_class_where_the_marginal_one_does_not():
    """Class 2 is under-estimated by the model: marginal sets miss it often; Mondrian sets cover
    every class at 1 - alpha (in expectation over calibration draws)."""
    gen = torch.Generator().manual_seed(4)
    reps, n, m, alpha = 300, 150, 150, 0.1
    logits = torch.randn(reps, n + m, 3, generator=gen, dtype=F64)
    labels = torch.multinomial(torch.softmax(logits, -1).reshape(-1, 3), 1, generator=gen).reshape(reps, n + m)
    logits[..., 2] -= 2.0  # the model's probabilities of class 2 are far too small
    probs = torch.softmax(logits, dim=-1)
    per_class = {"mondrian": [], "marginal": []}
    for r in range(reps):
        for kind, mondrian in (("mondrian", True), ("marginal", False)):
            q = calibrate(probs[r, :n], labels[r, :n], alpha, mondrian=mondrian)
            hits = prediction_sets(probs[r, n:], q).gather(1, labels[r, n:, None])[:, 0]
            per_class[kind].append([float(hits[labels[r, n:] == c].double().mean()) for c in range(3)])
    mondrian = torch.tensor(per_class["mondrian"], dtype=F64)
    marginal = torch.tensor(per_class["marginal"], dtype=F64)
    se = mondrian.std(dim=0) / math.sqrt(reps)
    assert bool((mondrian.mean(dim=0) >= 1 - alpha - 3 * se).all()), mondrian.mean(dim=0)
    assert float(marginal.mean(dim=0)[2]) < 1 - alpha - 0.1  # the marginal guarantee is not per class
    assert abs(float(marginal.mean()) - (1 - alpha)) < 0.1


def test_mondrian_thresholds_are_each_class_quantile_and_rare_classes_are_always_in():
    gen = torch.Generator().manual_seed(5)
    probs, labels = synthetic(gen, (200,), num_classes=4)
    labels[labels == 3] = 0
    labels[:5] = 3  # class 3 has 5 calibration examples < 1/0.1 - 1 = 9
    q = calibrate(probs, labels, 0.1, mondrian="class")
    assert q.shape == (4,) and q.dtype == F64
    scores = lac_scores(probs, labels)
    for c in range(3):
        assert float(q[c]) == conformal_quantile(scores[labels == c], 0.1)
    assert float(q[3]) == math.inf
    sets = prediction_sets(probs, q)
    assert bool(sets[:, 3].all())
    # 9 = 1/alpha - 1 examples are enough: k = ceil(10 * 0.9) = 9 <= 9
    labels[:9] = 3
    assert math.isfinite(float(calibrate(probs, labels, 0.1, mondrian=True)[3]))
    # a class without calibration examples is in every set as well
    assert float(calibrate(probs, torch.zeros(200, dtype=torch.long), 0.1, mondrian=True)[1]) == math.inf


def test_mondrian_by_shot_group():
    gen = torch.Generator().manual_seed(6)
    probs, labels = synthetic(gen, (300,), num_classes=6)
    counts = [5, 10, 50, 60, 200, 300]  # few, few, medium, medium, many, many
    q = calibrate(probs, labels, 0.2, "aps", mondrian="shot", class_counts=counts)
    scores = aps_scores(probs, labels)
    for group in ((0, 1), (2, 3), (4, 5)):
        in_group = (labels == group[0]) | (labels == group[1])
        expected = conformal_quantile(scores[in_group], 0.2)
        assert float(q[group[0]]) == float(q[group[1]]) == expected


# ----------------------------------------------------------------------------------------------
# coverage and size, per shot group
# ----------------------------------------------------------------------------------------------


def test_coverage_and_size_by_hand():
    sets = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    labels = torch.tensor([0, 1, 0, 2])
    out = coverage_and_size(sets, labels, class_counts=[10, 50, 500])
    assert out["coverage"] == pytest.approx(2 / 4)
    assert out["macro_coverage"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert out["size"] == pytest.approx((2 + 0 + 2 + 3) / 4)
    assert out["empty"] == pytest.approx(1 / 4)
    assert out["few/coverage"] == pytest.approx(0.5) and out["few/size"] == pytest.approx(2.0)
    assert out["medium/coverage"] == 0.0 and out["medium/size"] == 0.0
    assert out["many/coverage"] == 1.0 and out["many/size"] == 3.0
    # groups without a class present in the split are left out; no counts, no groups
    out = coverage_and_size(sets[:2], labels[:2], class_counts=[10, 50, 500])
    assert "many/coverage" not in out and "few/size" in out
    assert set(coverage_and_size(sets, labels)) == {"coverage", "macro_coverage", "size", "empty"}


# ----------------------------------------------------------------------------------------------
# the calibration split
# ----------------------------------------------------------------------------------------------


def test_split_calibration_is_a_deterministic_partition():
    cal, rest = split_calibration(1000, 0.3, seed=1234)
    assert cal.numel() == 300 and rest.numel() == 700
    assert torch.equal(torch.sort(torch.cat([cal, rest])).values, torch.arange(1000))
    assert bool((cal[1:] > cal[:-1]).all()) and bool((rest[1:] > rest[:-1]).all())
    again, _ = split_calibration(1000, 0.3, seed=1234)
    assert torch.equal(cal, again)
    other, _ = split_calibration(1000, 0.3, seed=1235)
    assert not torch.equal(cal, other)
    for bad in [
        dict(n=1, fraction=0.5, seed=0),
        dict(n=10, fraction=1.0, seed=0),
        dict(n=10, fraction=0.01, seed=0),
        dict(n=10, fraction=0.5, seed=1.5),
    ]:
        with pytest.raises(ValueError):
            split_calibration(**bad)


# ----------------------------------------------------------------------------------------------
# the level with a given mean set size
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("score", ["lac", "aps"])
def test_match_average_size_marginal_is_the_nearest_attainable_size(score):
    gen = torch.Generator().manual_seed(8)
    probs, labels = synthetic(gen, (500,), num_classes=10)
    for target in (1.0, 2.5, 4.0):
        matched = match_average_size(probs, labels, target, score)
        assert isinstance(matched, MatchedLevel)
        assert 0 < matched.alpha < 1
        assert matched.thresholds == calibrate(probs, labels, matched.alpha, score)
        sets = prediction_sets(probs, matched.thresholds, score)
        assert coverage_and_size(sets, labels)["size"] == pytest.approx(matched.size)
        assert abs(matched.size - target) < 0.05
        # no level does better: every rank k of the 500 calibration scores
        ks = range(1, 501)
        sizes = [
            float(prediction_sets(probs, calibrate(probs, labels, 1 - k / 501, score), score).sum()) / 500
            for k in ks[::25]
        ]
        assert all(abs(matched.size - target) <= abs(s - target) + 1e-12 for s in sizes)


def test_match_average_size_mondrian_and_other_size_data():
    gen = torch.Generator().manual_seed(9)
    probs, labels = synthetic(gen, (1500,), num_classes=10)
    counts = [5, 10, 30, 50, 80, 150, 300, 500, 800, 1000]
    for mondrian in (True, "shot"):
        matched = match_average_size(probs[:1000], labels[:1000], 3.0, mondrian=mondrian, class_counts=counts)
        assert abs(matched.size - 3.0) < 0.05
        assert torch.equal(
            matched.thresholds,
            calibrate(probs[:1000], labels[:1000], matched.alpha, mondrian=mondrian, class_counts=counts),
        )
    # the size measured on other (unlabelled) data
    matched = match_average_size(probs[:1000], labels[:1000], 2.0, size_probs=probs[1000:])
    sets = prediction_sets(probs[1000:], matched.thresholds)
    assert float(sets.sum()) / 500 == pytest.approx(matched.size)
    assert abs(matched.size - 2.0) < 0.05
    # a randomised APS level is measured with the same draw as its calibration scores
    matched = match_average_size(
        probs[:1000], labels[:1000], 2.0, "aps", randomized=True, generator=torch.Generator().manual_seed(0)
    )
    assert abs(matched.size - 2.0) < 0.05


def test_match_average_size_out_of_reach_targets_give_the_extremes():
    gen = torch.Generator().manual_seed(10)
    probs, labels = synthetic(gen, (100,), num_classes=4)
    everything = match_average_size(probs, labels, 4.0)
    assert everything.thresholds == math.inf and everything.size == 4.0
    assert calibrate(probs, labels, everything.alpha) == math.inf
    smallest = match_average_size(probs, labels, 0.0)
    assert smallest.alpha == pytest.approx(1 - 1 / 101)
    assert smallest.thresholds == float(lac_scores(probs, labels).min())
    with pytest.raises(ValueError, match="target_size"):
        match_average_size(probs, labels, -1.0)
