"""How many seeds a paired comparison needs, and what a study cost (`studies plan`, the
report's "Power and cost" section).

Seeds for power. The report compares each variant's config with its baseline by the paired
t-test over seeds (`analysis.stats.paired_test`). With n seeds whose paired differences have
mean delta and standard deviation sigma, the statistic T = mean(d) / (sd(d) / sqrt(n)) follows
the non-central t distribution with df = n - 1 and ncp = delta * sqrt(n) / sigma; at level
`level` the two-sided test rejects when |T| > c = t_{(1+level)/2, n-1}, so its power is

    power(n) = P(T' > c) + P(T' < -c),   T' ~ nct(df = n - 1, ncp = delta * sqrt(n) / sigma)

(Cohen, Statistical Power Analysis, 1988, ch. 2; no normal approximation: with 3 to 10 seeds
the t quantile and the non-centrality both matter). The seeds needed are the smallest
n >= 2 with power(n) >= the target.

Seeds for a half-width. The interval the report prints is mean(d) ± t_{(1+level)/2, n-1} ·
sd / sqrt(n); the seeds needed for a target half-width w are the smallest n with
t_{(1+level)/2, n-1} · sigma / sqrt(n) <= w, sigma the pilot's sd (a planning value: the
half-width a study will get varies with its own sd).

The difference planned for is a stated smallest difference of interest: `--difference`, else
the study file's `report.difference`, else `DEFAULT_DIFFERENCE` (1 percentage point for an
accuracy), never the pilot's observed difference (planning for it is planning to detect
whatever the pilot happened to see), and no "observed power" is printed: the power at the
observed difference is a function of the p-value and says nothing more (Hoenig and Heisey,
The American Statistician 55, 2001).

The pilot's sd is itself uncertain: with n seeds, (n - 1) s² / sigma² follows chi-square on
n - 1 df, so the one-sided upper `SD_CONFIDENCE` (80 %) confidence limit of sigma is
s · sqrt((n - 1) / chi2_{1-0.8, n-1}) (Browne, Statistics in Medicine 14, 1995: planning with
the 80 % upper limit reaches the intended power in at least 80 % of pilots). The seeds needed
are quoted as a range: for sigma = s, and for sigma at its upper limit.

The pilot gives sigma: the sd of the per-seed paired differences of a finished or partial
study (`paired_comparisons`), or, from the published intervals of a study file's
`reference:` block, sigma_a and sigma_b of the two configs (sd = half-width · sqrt(n) /
t_{(1+level)/2, n-1}, n and level the source's own) combined as sqrt(sigma_a² + sigma_b²): the published numbers are not
paired, so this assumes independent seeds (pairing helps when the seed effects of the two
configs are positively correlated; then the real need is smaller). Fewer than
`MIN_PILOT_SEEDS` paired seeds give an sd too unreliable to plan with: "pilot too small".

Cost. A study's GPU-hours are the sum over its runs of the run's duration times the GPUs the
study file requests per trial (`resources.gpus`); CPU-hours likewise with `resources.cpus`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats as _sps

from analysis.report_schema import DEFAULT_DIFFERENCE
from analysis.stats import DEFAULT_LEVEL, is_fraction_metric, t_quantile

#: fewer paired seeds than this give no plan ("pilot too small")
MIN_PILOT_SEEDS = 3
DEFAULT_POWER = 0.8
#: the largest number of seeds searched; a need above it is reported as "more than"
MAX_PLAN_SEEDS = 1000
NOTE_TOO_SMALL = f"pilot too small: fewer than {MIN_PILOT_SEEDS} paired seeds"
#: the one-sided confidence of the pilot sd's upper limit the plan also uses (Browne 1995)
SD_CONFIDENCE = 0.8
__all__ = [
    "DEFAULT_DIFFERENCE",
    "DEFAULT_POWER",
    "MAX_PLAN_SEEDS",
    "MIN_PILOT_SEEDS",
    "NOTE_TOO_SMALL",
    "SD_CONFIDENCE",
    "Cost",
    "SeedsNeeded",
    "paired_power",
    "plan_comparison",
    "published_half_width",
    "published_seeds_needed",
    "run_costs",
    "sd_of_interval",
    "sd_upper_limit",
    "seeds_for_half_width",
    "seeds_for_power",
    "seeds_needed",
    "unit_scale",
]


def sd_upper_limit(sd: float, n: int, confidence: float = SD_CONFIDENCE) -> float:
    """The one-sided upper `confidence` limit of a standard deviation `sd` estimated from n
    values: sd · sqrt((n - 1) / chi2_{1-confidence, n-1}) (module docstring)."""
    if n < 2 or not math.isfinite(sd):
        return math.nan
    return float(sd) * math.sqrt((n - 1) / _sps.chi2.ppf(1.0 - confidence, n - 1))


def _check(level: float, power: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), e.g. 0.95; got {level!r}")
    if not 0.0 < power < 1.0:
        raise ValueError(f"power must be in (0, 1), e.g. 0.8; got {power!r}")


def paired_power(n: int | np.ndarray, difference: float, sd: float, level: float = DEFAULT_LEVEL) -> float | np.ndarray:
    """Power of the two-sided paired t-test on n seeds (module docstring): df = n - 1,
    ncp = difference * sqrt(n) / sd."""
    n_arr = np.asarray(n, dtype=float)
    df = n_arr - 1.0
    crit = _sps.t.ppf((1.0 + level) / 2.0, df)
    ncp = abs(difference) * np.sqrt(n_arr) / sd
    upper = _sps.nct.sf(crit, df, ncp)
    # scipy's nct returns NaN for a far tail (ncp above ~15): that tail is below the other
    # term's rounding, so it counts as 0
    lower = np.nan_to_num(_sps.nct.cdf(-crit, df, ncp), nan=0.0)
    upper = np.where(np.isnan(upper), 1.0 - _sps.nct.cdf(crit, df, ncp), upper)
    power = upper + lower
    return float(power) if np.ndim(power) == 0 else power


def seeds_for_power(
    difference: float,
    sd: float,
    power: float = DEFAULT_POWER,
    level: float = DEFAULT_LEVEL,
    max_seeds: int = MAX_PLAN_SEEDS,
) -> int | None:
    """The smallest n >= 2 whose paired t-test has `power` to detect `difference` given the
    sd of the paired differences; None when more than `max_seeds` would be needed (or the
    difference is 0)."""
    _check(level, power)
    if not math.isfinite(difference) or difference == 0 or not math.isfinite(sd):
        return None
    if sd <= 0:
        return 2  # every paired difference equal: two seeds show it
    n = np.arange(2, max_seeds + 1)
    reached = np.flatnonzero(paired_power(n, difference, sd, level) >= power)
    return int(n[reached[0]]) if reached.size else None


def seeds_for_half_width(
    sd: float, half_width: float, level: float = DEFAULT_LEVEL, max_seeds: int = MAX_PLAN_SEEDS
) -> int | None:
    """The smallest n >= 2 with t_{(1+level)/2, n-1} · sd / sqrt(n) <= half_width; None
    when more than `max_seeds` would be needed."""
    _check(level, DEFAULT_POWER)
    if not (math.isfinite(sd) and math.isfinite(half_width)) or half_width <= 0:
        return None
    if sd <= 0:
        return 2
    n = np.arange(2, max_seeds + 1)
    widths = _sps.t.ppf((1.0 + level) / 2.0, n - 1) * sd / np.sqrt(n)
    reached = np.flatnonzero(widths <= half_width)
    return int(n[reached[0]]) if reached.size else None


def sd_of_interval(half_width: float, n: int, level: float = DEFAULT_LEVEL) -> float:
    """The sd behind a Student-t interval of n seeds: half-width · sqrt(n) / t_{(1+level)/2, n-1}."""
    if n < 2:
        return math.nan
    return float(half_width) * math.sqrt(n) / t_quantile(float(level), int(n) - 1)


def unit_scale(metric: str) -> float:
    """The factor from a metric's stored unit to the one the report prints: 100 for an
    accuracy (percentage points), 1 otherwise. Stated differences and half-widths are in
    the printed unit."""
    return 100.0 if is_fraction_metric(metric) else 1.0


@dataclass(frozen=True)
class SeedsNeeded:
    """The plan of one comparison (a variant's config against its baseline), in the printed
    unit (percentage points for accuracies)."""

    metric: str
    variant: str
    swept: str
    reference_swept: str
    n_pilot: int
    observed: float  # the pilot's mean difference
    sd: float  # of the paired differences
    difference: float  # the smallest difference of interest planned for (stated, else DEFAULT_DIFFERENCE)
    half_width: float  # the target half-width
    seeds_power: int | None  # for the power, with the pilot's sd
    seeds_half_width: int | None
    sd_upper: float = math.nan  # the sd's upper SD_CONFIDENCE limit (`sd_upper_limit`)
    seeds_power_upper: int | None = None  # for the power, with `sd_upper`
    note: str = ""
    source: str = "pilot"

    def seeds_text(self) -> str:
        """`6`, or `6–14`: with the pilot's sd, and with its upper limit; `–` without a plan."""
        if not math.isfinite(self.sd_upper):
            return "–" if self.seeds_power is None else str(self.seeds_power)
        low, high = (
            str(n) if n is not None else f">{MAX_PLAN_SEEDS}" for n in (self.seeds_power, self.seeds_power_upper)
        )
        return low if low == high else f"{low}–{high}"


def plan_comparison(
    metric: str,
    variant: str,
    observed: float,
    sd: float,
    n: int,
    *,
    difference: float | None = None,
    half_width: float | None = None,
    power: float = DEFAULT_POWER,
    level: float = DEFAULT_LEVEL,
    swept: str = "{}",
    reference_swept: str = "{}",
    note: str = "",
    source: str = "pilot",
    min_seeds: int = MIN_PILOT_SEEDS,
) -> SeedsNeeded:
    """Seeds for `power` and for the half-width of one comparison. `observed`, `sd` are in
    the metric's stored unit; `difference` and `half_width` in the printed one (default:
    `DEFAULT_DIFFERENCE`, and half of the difference)."""
    _check(level, power)
    scale = unit_scale(metric)
    obs, sd_p = observed * scale, sd * scale
    planned = abs(difference) if difference is not None else DEFAULT_DIFFERENCE
    width = half_width if half_width is not None else planned / 2.0
    notes = [note] if note else []
    if n < min_seeds or not math.isfinite(sd_p):
        notes.append(NOTE_TOO_SMALL if source == "pilot" else "fewer than 2 seeds behind the published interval")
        return SeedsNeeded(
            metric,
            variant,
            swept,
            reference_swept,
            n,
            obs,
            sd_p,
            planned,
            width,
            None,
            None,
            note="; ".join(notes),
            source=source,
        )
    if not planned:
        raise ValueError(f"the difference to detect must be above 0, got {difference!r}")
    seeds = seeds_for_power(planned, sd_p, power, level)
    upper = sd_upper_limit(sd_p, n)
    seeds_upper = seeds_for_power(planned, upper, power, level)
    if seeds is None:
        notes.append(f"more than {MAX_PLAN_SEEDS} seeds")
    return SeedsNeeded(
        metric,
        variant,
        swept,
        reference_swept,
        n,
        obs,
        sd_p,
        planned,
        width,
        seeds,
        seeds_for_half_width(sd_p, width, level) if width else None,
        upper,
        seeds_upper,
        "; ".join(notes),
        source,
    )


def seeds_needed(
    comparisons: Iterable[Mapping[str, Any]],
    *,
    difference: float | None = None,
    half_width: float | None = None,
    power: float = DEFAULT_POWER,
    level: float = DEFAULT_LEVEL,
) -> list[SeedsNeeded]:
    """A plan per row of `analysis.stats.paired_comparisons` (its n, mean_diff, sd_diff)."""
    return [
        plan_comparison(
            r["metric"],
            r["variant"],
            r["mean_diff"],
            r["sd_diff"],
            int(r["n"]),
            difference=difference,
            half_width=half_width,
            power=power,
            level=level,
            swept=r.get("swept") or "{}",
            reference_swept=r.get("reference_swept") or "{}",
        )
        for r in comparisons
    ]


def published_half_width(ci: Any) -> tuple[float, bool]:
    """(half-width, is a bound) of a published interval as printed. A half-width printed as
    zero (`0.0`) is a rounded one: the true half-width is below half a unit of its last printed
    digit (0.05 for `0.0`, 0.5 for `0`), and that bound is used (an upper bound: the plan it
    gives may ask for more seeds than needed), never zero spread."""
    value = abs(float(ci))
    if value > 0:
        return value, False
    text = _printed(ci)
    decimals = len(text.split(".", 1)[1]) if "." in text else 0
    return 0.5 * 10.0**-decimals, True


def _printed(number: Any) -> str:
    """A published number's text as written (`0.0`), else its float's."""
    return getattr(number, "text", None) or repr(float(number))


def published_seeds_needed(
    sources: Sequence[Any],
    baseline: str | None,
    *,
    difference: float | None = None,
    half_width: float | None = None,
    power: float = DEFAULT_POWER,
    level: float = DEFAULT_LEVEL,
) -> list[SeedsNeeded]:
    """Plans from the published intervals of a `reference:` block (`report_schema.Reference`
    sources): each row of another variant with a `ci` against the `baseline` row of the same
    source and `match`, the intervals read as Student-t intervals of the SOURCE's seeds at the
    SOURCE's level (`seeds`, `level`: what the paper states, not the planned study's), a
    half-width printed as zero as its rounding bound (`published_half_width`), the two sds
    combined as independent (module docstring); the test planned is at `level`. A source that
    does not declare its seeds and level gives no plan. Published numbers are in percent:
    they are turned back into fractions for accuracies."""
    plans = []
    for source in sources:
        n_source, level_source = getattr(source, "seeds", None), getattr(source, "level", None)
        if n_source is None or level_source is None:
            continue
        rows = list(source.rows)
        for row in rows:
            if row.variant in (None, baseline):
                continue
            base = next((b for b in rows if b.variant == baseline and b.match == row.match), None)
            if base is None:
                continue
            for metric, value in row.metrics.items():
                if metric not in base.metrics or metric not in row.ci or metric not in base.ci:
                    continue
                scale = unit_scale(metric)
                (width_a, bound_a), (width_b, bound_b) = (
                    published_half_width(row.ci[metric]),
                    published_half_width(base.ci[metric]),
                )
                sd_a = sd_of_interval(width_a / scale, n_source, level_source)
                sd_b = sd_of_interval(width_b / scale, n_source, level_source)
                observed = (float(value) - float(base.metrics[metric])) / scale
                swept = _match_text(row.match)
                note = "; ".join(
                    f"ci {_printed(ci)} read as < {width:g}"
                    for ci, (width, bound) in (
                        (row.ci[metric], (width_a, bound_a)),
                        (base.ci[metric], (width_b, bound_b)),
                    )
                    if bound
                )
                plans.append(
                    plan_comparison(
                        metric,
                        str(row.variant),
                        observed,
                        math.hypot(sd_a, sd_b),
                        n_source,
                        difference=difference,
                        half_width=half_width,
                        power=power,
                        level=level,
                        swept=swept,
                        reference_swept=swept,
                        min_seeds=2,
                        note=note,
                        source=f"{source.label}: published {level_source:.0%} intervals, {n_source} seeds, unpaired",
                    )
                )
    return plans


def _match_text(match: Mapping[str, Any]) -> str:
    import json

    return json.dumps(dict(match), sort_keys=True, separators=(",", ":"))


# ----------------------------------------------------------------------------- cost


@dataclass(frozen=True)
class Cost:
    """Device time of a group of runs (one variant, or the whole study)."""

    label: str
    runs: int
    hours: float  # wall-clock hours of the runs, summed
    gpu_hours: float
    cpu_hours: float


def run_costs(rows: Iterable[Mapping[str, Any]], gpus: float, cpus: float, group: str = "variant") -> list[Cost]:
    """GPU- and CPU-hours per `group` value and in total (last): sum over runs of
    duration_s / 3600 times the GPUs (CPUs) requested per trial."""
    totals: dict[str, list[float]] = {}
    for row in rows:
        seconds = row.get("duration_s")
        if seconds is None or not math.isfinite(float(seconds)):
            continue
        entry = totals.setdefault(str(row.get(group)), [0, 0.0])
        entry[0] += 1
        entry[1] += float(seconds) / 3600.0
    out = [Cost(label, int(n), hours, hours * gpus, hours * cpus) for label, (n, hours) in totals.items()]
    n_all, h_all = sum(c.runs for c in out), sum(c.hours for c in out)
    out.append(Cost("total", n_all, h_all, h_all * gpus, h_all * cpus))
    return out
