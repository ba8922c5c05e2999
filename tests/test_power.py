"""analysis.power: seeds for the paired t-test's power (against scipy's non-central t and a
simulation of synthetic paired studies), seeds for a half-width, and the cost sums."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from analysis.power import (
    NOTE_TOO_SMALL,
    paired_power,
    plan_comparison,
    run_costs,
    sd_of_interval,
    seeds_for_half_width,
    seeds_for_power,
)
from analysis.stats import mean_ci

CASES = [
    (0.5, 0.6, 0.8, 0.95),
    (0.2, 0.5, 0.8, 0.95),
    (1.0, 0.7, 0.9, 0.95),
    (0.3, 0.3, 0.8, 0.99),
    (0.1, 0.4, 0.8, 0.90),
]


def reference_seeds(d, sd, power, level):
    """First n >= 2 whose two-sided paired t-test reaches `power`, by scipy.stats.nct."""
    for n in range(2, 2000):
        c = sps.t.ppf(1 - (1 - level) / 2, n - 1)
        delta = d * math.sqrt(n) / sd
        if sps.nct.sf(c, n - 1, delta) + sps.nct.cdf(-c, n - 1, delta) >= power:
            return n
    return None


@pytest.mark.parametrize("d,sd,power,level", CASES)
def test_seeds_for_power_equal_the_scipy_nct_reference(d, sd, power, level):
    n = seeds_for_power(d, sd, power, level)
    assert n == reference_seeds(d, sd, power, level)
    assert seeds_for_power(-d, sd, power, level) == n  # two-sided
    assert paired_power(n, d, sd, level) >= power > paired_power(n - 1, d, sd, level)


def test_a_large_effect_needs_two_or_three_seeds_not_nan():
    # ncp above ~15 makes scipy's nct.cdf of the far tail NaN; the power is then ~1
    assert paired_power(4, 1.9, 0.05) == pytest.approx(1.0)
    assert seeds_for_power(1.9, 0.05) in (2, 3)


@pytest.mark.parametrize("d,sd", [(0.5, 0.6), (0.3, 0.5)])
def test_simulated_paired_studies_detect_the_difference_at_the_planned_rate(d, sd):
    """Synthetic studies: per seed a shared seed effect plus each config's own noise, so
    that the paired differences have sd `sd`; the paired t-test at 0.05 on the planned n
    rejects at the planned power, within 4 Monte-Carlo standard errors."""
    rng = np.random.default_rng(12345)
    sims = 6000
    n = seeds_for_power(d, sd, 0.8, 0.95)
    for seeds in (n - 1, n):
        seed_effect = rng.normal(0.0, 2.0, size=(sims, seeds))
        noise = sd / math.sqrt(2)
        a = 70.0 + d + seed_effect + rng.normal(0.0, noise, size=(sims, seeds))
        b = 70.0 + seed_effect + rng.normal(0.0, noise, size=(sims, seeds))
        rate = float(np.mean(sps.ttest_rel(a, b, axis=1).pvalue < 0.05))
        expected = paired_power(seeds, d, sd, 0.95)
        mc_error = math.sqrt(expected * (1 - expected) / sims)
        assert abs(rate - expected) < 4 * mc_error, (seeds, rate, expected)
    assert rate > 0.8 - 4 * mc_error


@pytest.mark.parametrize("sd,w,level", [(0.6, 0.3, 0.95), (1.0, 0.2, 0.95), (0.4, 0.5, 0.99)])
def test_seeds_for_half_width_is_the_first_t_interval_that_narrow(sd, w, level):
    n = seeds_for_half_width(sd, w, level)
    half = lambda k: sps.t.ppf((1 + level) / 2, k - 1) * sd / math.sqrt(k)  # noqa: E731
    assert half(n) <= w
    assert n == 2 or half(n - 1) > w


def test_sd_of_a_published_interval_is_the_sd_behind_it():
    values = np.random.default_rng(3).normal(0.9, 0.01, size=4)
    interval = mean_ci(values)
    assert sd_of_interval(interval.half_width, 4) == pytest.approx(values.std(ddof=1))


def test_a_pilot_of_two_paired_seeds_is_too_small():
    plan = plan_comparison("test/top5", "noised", 0.01, 0.004, 2)
    assert plan.seeds_power is None and NOTE_TOO_SMALL in plan.note
    plan = plan_comparison("test/top5", "noised", 0.01, 0.004, 3)
    # in percentage points: 1.0 with sd 0.4
    assert plan.difference == pytest.approx(1.0) and plan.sd == pytest.approx(0.4)
    assert plan.seeds_power == seeds_for_power(1.0, 0.4) and plan.note == ""


def test_the_plan_is_for_the_stated_difference_not_the_observed_one():
    """Issue 40: a pilot that happened to see a large difference plans for the smallest
    difference of interest (default 1 percentage point), and no observed power is kept."""
    from analysis.power import DEFAULT_DIFFERENCE, SeedsNeeded

    plan = plan_comparison("test/top5", "noised", 0.10, 0.004, 3)  # observed 10 pp
    assert plan.observed == pytest.approx(10.0) and plan.difference == DEFAULT_DIFFERENCE == 1.0
    assert plan.seeds_power == seeds_for_power(1.0, 0.4)
    assert plan_comparison("test/top5", "noised", 0.10, 0.004, 3, difference=0.5).seeds_power == seeds_for_power(
        0.5, 0.4
    )
    assert "power_now" not in SeedsNeeded.__dataclass_fields__


@pytest.mark.parametrize("n", [3, 4, 10])
def test_the_sd_upper_limit_covers_the_true_sd_at_its_confidence(n):
    """The one-sided 80 % upper limit s * sqrt((n-1) / chi2_{0.2, n-1}) lies above the true sd
    in 80 % of simulated pilots (within 4 Monte-Carlo standard errors), and equals its closed
    form from scipy's chi-square."""
    from analysis.power import SD_CONFIDENCE, sd_upper_limit

    assert sd_upper_limit(0.4, n) == pytest.approx(0.4 * math.sqrt((n - 1) / sps.chi2.ppf(0.2, n - 1)), rel=1e-12)
    rng = np.random.default_rng(7)
    sims = 20000
    sds = rng.normal(0.0, 0.5, size=(sims, n)).std(axis=1, ddof=1)
    covered = np.mean([sd_upper_limit(s, n) >= 0.5 for s in sds])
    assert abs(covered - SD_CONFIDENCE) < 4 * math.sqrt(0.8 * 0.2 / sims)


def test_the_seeds_needed_are_a_range_from_the_sd_to_its_upper_limit():
    from analysis.power import sd_upper_limit

    plan = plan_comparison("test/top5", "noised", 0.0, 0.004, 3, difference=1.0)
    assert plan.sd_upper == pytest.approx(sd_upper_limit(0.4, 3))
    assert plan.seeds_power_upper == seeds_for_power(1.0, sd_upper_limit(0.4, 3))
    assert plan.seeds_power < plan.seeds_power_upper
    assert plan.seeds_text() == f"{plan.seeds_power}–{plan.seeds_power_upper}"
    # 10 paired seeds: the sd is better known, the range narrower
    wide = plan.seeds_power_upper / plan.seeds_power
    ten = plan_comparison("test/top5", "noised", 0.0, 0.004, 10, difference=1.0)
    assert ten.seeds_power == plan.seeds_power and ten.seeds_power_upper / ten.seeds_power < wide
    assert plan_comparison("test/top5", "noised", 0.0, 0.004, 2).seeds_text() == "–"


def test_run_costs_sum_duration_times_requested_resources():
    rows = [
        {"variant": "ce", "duration_s": 3600.0},
        {"variant": "ce", "duration_s": 1800.0},
        {"variant": "svm", "duration_s": 900.0},
        {"variant": "svm", "duration_s": None},
    ]
    costs = {c.label: c for c in run_costs(rows, gpus=0.5, cpus=4)}
    assert costs["ce"].gpu_hours == pytest.approx(0.75)
    assert costs["svm"].cpu_hours == pytest.approx(1.0)
    assert costs["total"].runs == 3 and costs["total"].gpu_hours == pytest.approx(0.875)


# ----------------------------------------------------------------------------- published intervals


def _published_study(seeds: int, level: float, ci_a: str = "0.1", ci_b: str = "0.3"):
    """A study file whose one source prints ce 94.2 +- ci_a and noised 94.0 +- ci_b over 4 seeds
    at 95 %, planned with `seeds` seeds at `level`."""
    from studies.studyfile.spec import parse_study

    text = (
        f"name: pub\nbase: {{loss: {{name: ce}}, epochs: 2}}\n"
        f"variants: {{ce: {{}}, noised: {{loss: {{name: noised_topk, k: 5, epsilon: 0.1}}}}}}\n"
        f"seeds: {list(range(seeds))}\nreport: {{level: {level}}}\n"
        f"reference:\n  source: paper, 4 seeds, 95% CI\n  seeds: 4\n  level: 0.95\n  rows:\n"
        f"    - {{variant: ce, metrics: {{test/top5: 94.2}}, ci: {{test/top5: {ci_a}}}}}\n"
        f"    - {{variant: noised, metrics: {{test/top5: 94.0}}, ci: {{test/top5: {ci_b}}}}}\n"
    )
    return parse_study(text)


def test_the_plan_from_a_published_source_reads_its_intervals_with_the_sources_n_and_level():
    """Issue 33: the half-widths are the source's (4 seeds, 95 %), whatever the planned study's
    seed count and level; only the planned test's level changes the seeds for power."""
    from analysis.power import published_seeds_needed

    def plan(seeds, level):
        study = _published_study(seeds, level)
        plans = published_seeds_needed(study.reference, "ce", difference=0.2, level=float(study.report.level))
        assert len(plans) == 1
        return plans[0]

    t = sps.t.ppf(0.975, 3)
    sd = math.hypot(0.1 * 2 / t, 0.3 * 2 / t)  # percentage points, closed form
    for seeds in (2, 4, 8):
        found = plan(seeds, 0.95)
        assert found.sd == pytest.approx(sd)
        assert found.n_pilot == 4
        assert found.seeds_power == reference_seeds(0.2, sd, 0.8, 0.95)
    at_90 = plan(4, 0.9)
    assert at_90.sd == pytest.approx(sd)  # the source's intervals did not change
    assert at_90.seeds_power == reference_seeds(0.2, sd, 0.8, 0.9)  # the planned test did
    assert "4 seeds" in at_90.source and "95%" in at_90.source


@pytest.mark.parametrize("printed, bound", [("0.0", 0.05), ("0", 0.5), ("0.00", 0.005)])
def test_a_published_half_width_printed_as_zero_is_read_as_its_rounding_bound(printed, bound):
    from analysis.power import published_half_width, published_seeds_needed

    study = _published_study(4, 0.95, ci_a=printed)
    assert published_half_width(study.reference[0].rows[0].ci["test/top5"]) == (bound, True)
    assert published_half_width(study.reference[0].rows[1].ci["test/top5"]) == (0.3, False)
    found = published_seeds_needed(study.reference, "ce")[0]
    t = sps.t.ppf(0.975, 3)
    assert found.sd == pytest.approx(math.hypot(bound * 2 / t, 0.3 * 2 / t))
    assert f"ci {printed} read as < {bound:g}" in found.note


def test_a_source_with_intervals_but_no_seeds_or_level_is_not_planned_from():
    from analysis.power import published_seeds_needed
    from studies.studyfile.spec import parse_study

    study = _published_study(4, 0.95)
    text = study.source_text.replace("  seeds: 4\n", "")
    assert published_seeds_needed(parse_study(text).reference, "ce") == []


def test_the_plan_of_a_source_without_its_seed_count_says_what_is_missing():
    """The thesis's Ch. 5 tables print 95 % intervals over "several runs": no plan from them,
    and `studies plan` says which declaration is missing."""
    from studies.planning.plan import plan_seeds
    from studies.studyfile.spec import parse_study

    text = _published_study(4, 0.95).source_text.replace("  seeds: 4\n", "")
    plans, reason = plan_seeds(parse_study(text), None, difference=None, half_width=None, power=0.8, level=0.95)
    assert plans == [] and "source 'paper'" in reason and "does not declare the `seeds`" in reason
