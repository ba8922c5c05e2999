"""analysis.stats against scipy.stats on fixed data (no MLflow needed)."""

from __future__ import annotations

import itertools
import json
import math
import warnings

import numpy as np
import pyarrow as pa
import pytest
from scipy import stats as sps

from analysis.plots import choose_xscale
from analysis.stats import (
    NOTE_SINGLE,
    curve_series,
    holm,
    is_fraction_metric,
    lower_is_better,
    mean_ci,
    metric_bounds,
    paired_comparisons,
    paired_test,
    summarize,
    variant_defining_paths,
)

SAMPLES = {
    2: [0.9412, 0.9388],
    3: [0.9441, 0.9436, 0.9452],
    4: [0.902, 0.905, 0.899, 0.904],
    10: [0.1, 0.5, 0.3, 0.9, 0.7, 0.2, 0.4, 0.6, 0.8, 0.35],
}


@pytest.mark.parametrize("n", sorted(SAMPLES))
@pytest.mark.parametrize("level", [0.9, 0.95, 0.99])
def test_t_interval_matches_scipy(n, level):
    x = np.array(SAMPLES[n])
    ci = mean_ci(x, level=level)
    low, high = sps.t.interval(level, n - 1, loc=x.mean(), scale=sps.sem(x))
    assert ci.n == n
    assert ci.mean == pytest.approx(x.mean(), rel=1e-12)
    assert ci.sd == pytest.approx(x.std(ddof=1), rel=1e-12)
    assert ci.low == pytest.approx(low, rel=1e-10)
    assert ci.high == pytest.approx(high, rel=1e-10)
    one_sample = sps.ttest_1samp(x, 0.0).confidence_interval(level)
    assert (ci.low, ci.high) == pytest.approx((one_sample.low, one_sample.high), rel=1e-10)
    assert ci.has_interval and ci.note == ""


def test_n2_uses_one_degree_of_freedom():
    x = [0.90, 0.94]
    ci = mean_ci(x)
    # t_{0.975, 1} = 12.706: a very wide interval, as it must be with two seeds
    expected_half = 12.706204736174707 * np.std(x, ddof=1) / math.sqrt(2)
    assert ci.half_width == pytest.approx(expected_half, rel=1e-9)
    assert ci.half_width > 0.25


def test_n1_gives_no_interval_and_says_so():
    ci = mean_ci([0.93])
    assert ci.n == 1 and ci.mean == 0.93
    assert math.isnan(ci.sd) and math.isnan(ci.low) and math.isnan(ci.high)
    assert not ci.has_interval
    assert ci.note == NOTE_SINGLE and "n=1" in ci.note
    boot = mean_ci([0.93], method="bootstrap")
    assert not boot.has_interval and "n=1" in boot.note


def test_missing_and_non_finite_values_are_ignored_and_reported():
    ci = mean_ci([0.5, None, float("nan"), 0.7])
    assert ci.n == 2 and ci.mean == pytest.approx(0.6)
    assert "1 non-finite" in ci.note
    empty = mean_ci([None])
    assert empty.n == 0 and math.isnan(empty.mean) and "no value" in empty.note


def test_bad_level_and_method_are_rejected_with_names():
    with pytest.raises(ValueError, match="confidence level"):
        mean_ci([1, 2], level=95)
    with pytest.raises(ValueError, match="CI method"):
        mean_ci([1, 2], method="normal")


def _exact_percentile_bootstrap(x, level):
    """All n^n equally likely resamples: the exact percentile-bootstrap interval."""
    x = np.asarray(x)
    means = np.array([x[list(idx)].mean() for idx in itertools.product(range(x.size), repeat=x.size)])
    alpha = (1 - level) / 2
    return np.quantile(means, [alpha, 1 - alpha])


def test_bootstrap_is_seeded_and_close_to_exact_and_scipy():
    x = np.array(SAMPLES[4])
    a = mean_ci(x, method="bootstrap", n_boot=40_000, seed=7)
    b = mean_ci(x, method="bootstrap", n_boot=40_000, seed=7)
    assert (a.low, a.high) == (b.low, b.high)
    # with n = 4 the quantiles sit on atoms of the resampling distribution; with n = 10 and
    # few resamples another seed moves them
    wide = np.array(SAMPLES[10])
    c = mean_ci(wide, method="bootstrap", n_boot=500, seed=7)
    d = mean_ci(wide, method="bootstrap", n_boot=500, seed=8)
    assert (c.low, c.high) != (d.low, d.high)
    exact_low, exact_high = _exact_percentile_bootstrap(x, 0.95)
    spread = x.max() - x.min()
    assert a.low == pytest.approx(exact_low, abs=0.03 * spread)
    assert a.high == pytest.approx(exact_high, abs=0.03 * spread)
    ref = sps.bootstrap(
        (x,), np.mean, confidence_level=0.95, n_resamples=40_000, method="percentile", rng=np.random.default_rng(0)
    )
    assert a.low == pytest.approx(ref.confidence_interval.low, abs=0.03 * spread)
    assert a.high == pytest.approx(ref.confidence_interval.high, abs=0.03 * spread)
    assert x.min() <= a.low < a.mean < a.high <= x.max()


@pytest.mark.parametrize("n", [2, 3, 4, 10])
def test_paired_test_matches_scipy_ttest_rel(n):
    rng = np.random.default_rng(n)
    a = rng.normal(0.9, 0.01, n)
    b = a - rng.normal(0.004, 0.003, n)
    result = paired_test(a, b, level=0.95)
    ref = sps.ttest_rel(a, b)
    ref_ci = ref.confidence_interval(0.95)
    assert result.n == n and result.df == n - 1
    assert result.mean_diff == pytest.approx(np.mean(a - b), rel=1e-12)
    assert result.t == pytest.approx(ref.statistic, rel=1e-10)
    assert result.p_value == pytest.approx(ref.pvalue, rel=1e-9)
    assert (result.low, result.high) == pytest.approx((ref_ci.low, ref_ci.high), rel=1e-9)


def test_paired_test_edge_cases():
    one = paired_test([0.9], [0.8])
    assert one.n == 1 and one.mean_diff == pytest.approx(0.1)
    assert math.isnan(one.p_value) and math.isnan(one.low) and "n=1" in one.note
    constant = paired_test([1.0, 2.0, 3.0], [0.5, 1.5, 2.5])  # differences exactly 0.5
    with warnings.catch_warnings():  # scipy warns about the zero variance
        warnings.simplefilter("ignore")
        ref = sps.ttest_rel([1.0, 2.0, 3.0], [0.5, 1.5, 2.5])
    # scipy's t = inf, p = 0 is a degenerate test, not evidence (issue 33): no t, no p
    assert ref.statistic == np.inf and ref.pvalue == 0.0
    assert math.isnan(constant.t) and math.isnan(constant.p_value)
    assert constant.note == "degenerate: all differences equal (no test)"
    assert constant.mean_diff == pytest.approx(0.5)
    zero = paired_test([1.0, 2.0], [1.0, 2.0])
    assert zero.mean_diff == 0.0 and math.isnan(zero.t) and math.isnan(zero.p_value)
    with pytest.raises(ValueError, match="equal length"):
        paired_test([1, 2], [1])


def _holm_brute_force_rejects(p, alpha):
    """Holm's step-down procedure as written: reject while p_(j) <= alpha / (m - j + 1)."""
    order = np.argsort(p, kind="stable")
    m = len(p)
    reject = np.zeros(m, dtype=bool)
    for j, i in enumerate(order):
        if p[i] <= alpha / (m - j):
            reject[i] = True
        else:
            break
    return reject


def test_holm_hand_example_and_nan():
    adjusted = holm([0.01, 0.04, 0.03, 0.005, float("nan")])
    assert adjusted[:4] == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert math.isnan(adjusted[4])
    assert holm([0.5, 0.9])[1] == 1.0 or holm([0.5, 0.9])[1] == pytest.approx(1.0)


def test_holm_agrees_with_step_down_procedure():
    rng = np.random.default_rng(3)
    for _ in range(200):
        m = int(rng.integers(1, 8))
        p = rng.uniform(0, 0.2, m) ** rng.uniform(1, 3)
        adjusted = holm(p)
        assert np.all(adjusted >= p - 1e-15) and np.all(adjusted <= 1)
        for alpha in (0.01, 0.05, 0.1):
            assert np.array_equal(adjusted <= alpha, _holm_brute_force_rejects(p, alpha))


# ----------------------------------------------------------------------------- tables


def _row(variant, config_id, seed, swept, params, **metrics):
    row = {
        "run_id": f"{config_id}-{seed}",
        "cell_id": f"{config_id}-s{seed}",
        "config_id": config_id,
        "seed": seed,
        "variant": variant,
        "swept": json.dumps(swept, sort_keys=True),
    }
    row.update({f"param:{k}": v for k, v in params.items()})
    row.update(metrics)
    return row


def _noise_rows():
    """ce / hinge / noised at label noise 0.0 and 0.1, seeds 0-2 (hinge misses seed 2 at 0.1)."""
    values = {
        ("ce", 0.0): [0.941, 0.943, 0.942],
        ("ce", 0.1): [0.902, 0.905, 0.903],
        ("hinge", 0.0): [0.933, 0.932, 0.934],
        ("hinge", 0.1): [0.921, 0.925],
        ("noised", 0.0): [0.944, 0.946, 0.943],
        ("noised", 0.1): [0.919, 0.918, 0.920],
    }
    loss = {
        "ce": {"loss.name": "ce", "loss.k": 5, "loss.epsilon": 0.2},
        "hinge": {"loss.name": "smooth_svm", "loss.k": 5, "loss.tau": 1.0},
        "noised": {"loss.name": "noised_topk", "loss.k": 5, "loss.epsilon": 0.2},
    }
    rows = []
    for (variant, p), vals in values.items():
        config_id = f"{variant}-{p}"
        params = {"data.label_noise": p, "optim.lr": 0.1, **loss[variant]}
        for seed, v in enumerate(vals):
            rows.append(
                _row(
                    variant, config_id, seed, {"data.label_noise": p}, params, **{"test/top5": v, "test/top1": v - 0.2}
                )
            )
    return rows, values


def test_summarize_groups_by_config_and_matches_scipy():
    rows, values = _noise_rows()
    rows.append(_row("single", "single-0", 0, {}, {"data.label_noise": 0.0}, **{"test/top5": 0.5}))
    summary = summarize(pa.Table.from_pylist(rows), ["test/top5", "test/top1"]).to_pylist()
    by_key = {(r["config_id"], r["metric"]): r for r in summary}
    for (variant, p), vals in values.items():
        r = by_key[(f"{variant}-{p}", "test/top5")]
        low, high = sps.t.interval(0.95, len(vals) - 1, loc=np.mean(vals), scale=sps.sem(vals))
        assert r["n"] == len(vals) and r["seeds"] == list(range(len(vals)))
        assert r["values"] == pytest.approx(vals)
        assert (r["ci_low"], r["ci_high"]) == pytest.approx((low, high), rel=1e-10)
        assert r["param:data.label_noise"] == p and r["variant"] == variant
    single = by_key[("single-0", "test/top5")]
    assert single["n"] == 1 and single["no_interval"] and "n=1" in single["note"]
    assert math.isnan(single["ci_low"])
    with pytest.raises(ValueError, match="test/top9"):
        summarize(rows, ["test/top9"])


def test_paired_comparisons_pair_by_seed_within_context_and_apply_holm():
    rows, values = _noise_rows()
    result = paired_comparisons(rows, ["test/top5"], "ce").to_pylist()
    pairs = {(r["variant"], r["config_id"], r["reference_config_id"]) for r in result}
    # each variant is compared with ce at the same label noise only
    assert pairs == {
        ("hinge", "hinge-0.0", "ce-0.0"),
        ("hinge", "hinge-0.1", "ce-0.1"),
        ("noised", "noised-0.0", "ce-0.0"),
        ("noised", "noised-0.1", "ce-0.1"),
    }
    by_pair = {(r["config_id"], r["reference_config_id"]): r for r in result}
    for variant, p in [("hinge", 0.0), ("hinge", 0.1), ("noised", 0.0), ("noised", 0.1)]:
        a, b = values[(variant, p)], values[("ce", p)]
        n = min(len(a), len(b))  # hinge at 0.1 lacks seed 2: 2 pairs
        ref = sps.ttest_rel(a[:n], b[:n])
        r = by_pair[(f"{variant}-{p}", f"ce-{p}")]
        assert r["n"] == n and r["seeds"] == list(range(n))
        assert r["p_value"] == pytest.approx(ref.pvalue, rel=1e-9)
        assert r["mean_diff"] == pytest.approx(np.mean(np.subtract(a[:n], b[:n])))
        if n < len(b):
            assert "without a pair" in r["note"]
    for p in (0.0, 0.1):
        family = [by_pair[(f"{v}-{p}", f"ce-{p}")] for v in ("hinge", "noised")]
        expected = holm([f["p_value"] for f in family])
        assert [f["p_holm"] for f in family] == pytest.approx(list(expected))
    with pytest.raises(ValueError, match="reference variant 'focal'"):
        paired_comparisons(rows, ["test/top5"], "focal")


def test_variant_defining_paths_and_baseline_pairing():
    """A noised epsilon sweep against a single CE config: every epsilon pairs with CE."""
    rows = []
    for seed in range(3):
        rows.append(
            _row("ce", "ce", seed, {}, {"loss.name": "ce", "loss.epsilon": 0.2, "optim.lr": 0.1}, **{"test/top5": 0.9})
        )
        for eps in (0.01, 0.2, 1.0):
            rows.append(
                _row(
                    "noised",
                    f"n{eps}",
                    seed,
                    {"loss.epsilon": eps},
                    {"loss.name": "noised_topk", "loss.epsilon": eps, "optim.lr": 0.1},
                    **{"test/top5": 0.9 + eps / 100 + seed / 1000},
                )
            )
    assert variant_defining_paths(rows) == {"loss.name"}
    result = paired_comparisons(rows, ["test/top5"], "ce").to_pylist()
    assert sorted(r["config_id"] for r in result) == ["n0.01", "n0.2", "n1.0"]
    # a config with another learning rate is a different context: not paired
    for seed in range(3):
        rows.append(
            _row(
                "noised",
                "lr",
                seed,
                {"optim.lr": 0.5},
                {"loss.name": "noised_topk", "loss.epsilon": 0.2, "optim.lr": 0.5},
                **{"test/top5": 0.8},
            )
        )
    result = paired_comparisons(rows, ["test/top5"], "ce").to_pylist()
    assert "lr" not in {r["config_id"] for r in result}


def test_curve_series_sensitivity_grid_and_baseline():
    rows = []

    def add(variant, config_id, swept, eps, m, p=0.0, value=0.9):
        for seed in range(3):
            rows.append(
                _row(
                    variant,
                    config_id,
                    seed,
                    swept,
                    {"loss.epsilon": eps, "loss.n_samples": m, "data.label_noise": p},
                    **{"test/top5": value},
                )
            )

    # one-at-a-time sensitivity around (eps=0.2, M=10); the base cell is recorded with {}
    add("noised", "base", {}, 0.2, 10)
    for eps in (0.0, 0.01, 1.0):
        add("noised", f"e{eps}", {"loss.epsilon": eps}, eps, 10)
    for m in (3, 50):
        add("noised", f"m{m}", {"loss.n_samples": m}, 0.2, m)
    add("ce", "ce", {}, 0.2, 10)
    summary = summarize(rows, ["test/top5"])
    series = curve_series(summary, "loss.epsilon", "test/top5")
    lines = {s.label: s for s in series}
    assert set(lines) == {"noised", "ce"}
    assert [p["param:loss.epsilon"] for p in lines["noised"].points] == [0.0, 0.01, 0.2, 1.0]
    assert lines["ce"].flat and lines["ce"].points[0]["config_id"] == "ce"
    assert lines["noised"].n_range == (3, 3)
    m_lines = {s.label: s for s in curve_series(summary, "loss.n_samples", "test/top5")}
    assert [p["param:loss.n_samples"] for p in m_lines["noised"].points] == [3, 10, 50]

    # a grid over (eps, p): one line per label-noise value
    rows.clear()
    for eps in (0.01, 0.1, 1.0):
        for p in (0.0, 0.2):
            add("noised", f"g{eps}-{p}", {"loss.epsilon": eps, "data.label_noise": p}, eps, 10, p)
    series = curve_series(summarize(rows, ["test/top5"]), "loss.epsilon", "test/top5")
    assert sorted(s.label for s in series) == ["noised, data.label_noise=0", "noised, data.label_noise=0.2"]
    assert all(len(s.points) == 3 for s in series)


def test_metric_kinds_and_axis_scales():
    assert is_fraction_metric("test/top5") and is_fraction_metric("test/few/macro_top1")
    assert is_fraction_metric("val/avg3") and not is_fraction_metric("test/avg5_size")
    assert not is_fraction_metric("epoch_time_s") and not is_fraction_metric("best_epoch")
    assert is_fraction_metric("best_val")  # the selection metric is always an accuracy
    assert lower_is_better("train/loss") and lower_is_better("mean:epoch_time_s")
    assert not lower_is_better("test/top5")
    # thesis Table 4.2: epsilon from 0 to 100 -> symlog, linear up to the smallest non-zero
    scale, kwargs = choose_xscale([0.0, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0])
    assert scale == "symlog" and kwargs["linthresh"] == 1e-4
    assert choose_xscale([1, 2, 3, 5, 10, 50, 100]) == ("log", {})  # thesis Table 4.3, M
    assert choose_xscale([0.0, 0.1, 0.2, 0.3, 0.4]) == ("linear", {})  # label noise p
    assert choose_xscale([1, 3, 5, 10]) == ("linear", {})


# ----------------------------------------------------------------------------- bounded metrics


NEAR_ONE = [0.999, 0.97, 0.995]  # an accuracy near 100 %: its t interval passes 1
NEAR_ZERO = [0.0, 0.04]  # a few-shot accuracy near 0 with two seeds


@pytest.mark.parametrize("values", [NEAR_ONE, NEAR_ZERO, SAMPLES[3]])
@pytest.mark.parametrize("level", [0.9, 0.95])
def test_bounded_interval_is_the_t_interval_cut_at_the_range(values, level):
    """scipy's t interval intersected with [0, 1]: the cut interval holds the mean, stays
    in the range, and is the t interval wherever that one is inside."""
    x = np.asarray(values)
    low, high = sps.t.interval(level, x.size - 1, loc=x.mean(), scale=sps.sem(x))
    ci = mean_ci(x, level=level, bounds=metric_bounds("test/top5"))
    assert (ci.low, ci.high) == pytest.approx((max(low, 0.0), min(high, 1.0)), rel=1e-10)
    assert ci.clipped == (low < 0.0 or high > 1.0)
    assert 0.0 <= ci.low <= ci.mean <= ci.high <= 1.0
    unbounded = mean_ci(x, level=level)
    assert (unbounded.low, unbounded.high) == pytest.approx((low, high), rel=1e-10)


def test_cutting_keeps_the_coverage_of_the_t_interval():
    """Simulated accuracies with a true mean of 0.995: the cut interval covers the mean
    exactly as often as the t interval (it only drops values above 1)."""
    rng = np.random.default_rng(0)
    samples = np.clip(rng.normal(0.995, 0.01, size=(4000, 3)), 0, 1)
    mu = samples.mean()  # the population mean of the clipped normal, estimated
    covered_t = covered_cut = 0
    for x in samples:
        t = mean_ci(x)
        cut = mean_ci(x, bounds=(0.0, 1.0))
        covered_t += t.low <= mu <= t.high
        covered_cut += cut.low <= mu <= cut.high
        assert cut.high <= 1.0
    assert covered_t == covered_cut


def test_metric_bounds():
    assert metric_bounds("test/few/top5") == (0.0, 1.0) == metric_bounds("best_val")
    assert metric_bounds("mean:epoch_time_s") == (0.0, math.inf)
    assert metric_bounds("test/avg5_size") == (0.0, math.inf)
    assert metric_bounds("train/loss") is None and metric_bounds("lr") is None
    assert metric_bounds("val/avg5_threshold") is None


def test_summaries_and_paired_differences_stay_within_the_bounds():
    rows = [
        {
            "config_id": c,
            "seed": s,
            "variant": c,
            "swept": "{}",
            "param:loss.name": c,
            "test/many/top5": v,
            "train/loss": v,
        }
        for c, values in (("a", NEAR_ONE), ("b", [0.2, 0.99, 0.5]))
        for s, v in enumerate(values)
    ]
    summary = {(r["config_id"], r["metric"]): r for r in summarize(rows, ["test/many/top5", "train/loss"]).to_pylist()}
    bounded, free = summary[("a", "test/many/top5")], summary[("a", "train/loss")]
    assert bounded["clipped"] and bounded["ci_high"] == 1.0 and not free["clipped"]
    assert free["ci_high"] > 1.0  # a loss is not bounded: its t interval as it is
    pairs = paired_comparisons(rows, ["test/many/top5"], "b").to_pylist()
    d = np.subtract(NEAR_ONE, [0.2, 0.99, 0.5])
    low, high = sps.ttest_rel(NEAR_ONE, [0.2, 0.99, 0.5]).confidence_interval(0.95)
    assert (pairs[0]["ci_low"], pairs[0]["ci_high"]) == pytest.approx((max(low, -1.0), min(high, 1.0)))
    assert pairs[0]["clipped"] == (low < -1 or high > 1) and abs(d.mean()) < 1


def test_epoch_curves_are_cut_too():
    from analysis.stats import epoch_curves

    history = [
        {"config_id": "a", "variant": "a", "swept": "{}", "metric": "val/top5", "epoch": 0, "value": v}
        for v in NEAR_ONE
    ]
    (row,) = epoch_curves(history, "val/top5")
    assert row["ci_high"] == 1.0 and row["clipped"]


def test_two_seeds_with_identical_differences_are_a_degenerate_test_never_significant():
    """Issue 33: differences equal up to float noise (0.9 - 0.8 and 0.7 - 0.6) gave p = 0.0e+00
    in bold. The comparison table says the test is degenerate, prints no p, bolds nothing,
    and Holm's family leaves it out."""
    from analysis.formatting import p_text

    rows = [
        {"config_id": c, "variant": v, "swept": "{}", "seed": s, "test/top5": x}
        for c, v, values in (("a", "ce", (0.8, 0.6)), ("b", "noised", (0.9, 0.7)), ("c", "other", (0.95, 0.6)))
        for s, x in zip((0, 1), values)
    ]
    found = {r["variant"]: r for r in paired_comparisons(rows, ["test/top5"], "ce").to_pylist()}
    degenerate = found["noised"]
    assert degenerate["note"].startswith("degenerate: all differences equal")
    assert math.isnan(degenerate["p_value"]) and math.isnan(degenerate["p_holm"])
    assert p_text(degenerate["p_holm"]) == "–"
    # the other comparison is Holm-adjusted in a family of one (m counts real tests only)
    assert found["other"]["p_holm"] == pytest.approx(found["other"]["p_value"])


def test_values_outside_the_metric_bounds_are_refused_not_turned_into_an_inverted_interval():
    """Issue 33: percent values against a fraction's bounds gave (93.95, 1.0)."""
    from analysis.intervals import clip_interval

    with pytest.raises(ValueError, match=r"94.1 to 94.3 lie outside the metric's range \[0, 1\]"):
        mean_ci([94.1, 94.3, 94.2], bounds=metric_bounds("test/top5"))
    with pytest.raises(ValueError, match="outside the metric's range"):
        paired_test([1.5, 0.5], [0.2, 0.1], bounds=(-1.0, 1.0))
    with pytest.raises(ValueError, match=r"interval \[93.95, 94.45\] lies outside"):
        clip_interval(93.95, 94.45, (0.0, 1.0))
    inside = mean_ci([0.941, 0.943, 1.0], bounds=metric_bounds("test/top5"))
    assert inside.clipped and inside.high == 1.0 and inside.low < inside.mean < inside.high
    assert clip_interval(-0.1, 0.5, (0.0, 1.0)) == (0.0, 0.5, True)
