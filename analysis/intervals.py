"""Intervals and tests over seeds for `analysis.stats`: a metric's bounds and direction, the
mean's CI (t or bootstrap), the paired t-test by seed, Holm's correction.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from scipy import stats as _sps

from analysis.units import is_fraction_metric

CI_METHODS = ("t", "bootstrap")
DEFAULT_LEVEL = 0.95
NOTE_SINGLE = "n=1: no interval (a single seed)"
NOTE_EMPTY = "no value: no finished seed reported this metric"
NOTE_DEGENERATE = "degenerate: all differences equal (no test)"

_NON_NEGATIVE = ("time", "duration", "size", "epoch", "count", "grad_nonzero")


def metric_bounds(metric: str) -> tuple[float, float] | None:
    """The range of a metric's values: (0, 1) for an accuracy, (0, inf) for times, set
    sizes, epochs and counts, None when unbounded (losses, learning rates, ...)."""
    if is_fraction_metric(metric):
        return (0.0, 1.0)
    last = metric.rsplit("/", 1)[-1].rsplit(":", 1)[-1].lower()
    if any(word in last for word in _NON_NEGATIVE) and "threshold" not in last:
        return (0.0, math.inf)
    return None


def difference_bounds(metric: str) -> tuple[float, float] | None:
    """The range of a difference of two values of `metric` (paired comparisons)."""
    bounds = metric_bounds(metric)
    if bounds is None:
        return None
    low, high = bounds
    return (low - high, high - low)


def lower_is_better(metric: str) -> bool:
    """Losses, times and set sizes are minimised; accuracies are maximised."""
    last = metric.rsplit("/", 1)[-1].lower()
    return any(word in last for word in ("loss", "time", "size", "error", "duration"))


def check_level(level: float) -> float:
    level = float(level)
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence level must be in (0, 1), e.g. 0.95; got {level!r}")
    return level


def check_method(method: str) -> str:
    if method not in CI_METHODS:
        raise ValueError(f"CI method must be one of {CI_METHODS}, got {method!r}")
    return method


def _finite(values: Iterable[Any]) -> tuple[np.ndarray, int]:
    kept, dropped = [], 0
    for v in values:
        if v is None:
            continue
        v = float(v)
        if math.isfinite(v):
            kept.append(v)
        else:
            dropped += 1
    return np.asarray(kept, dtype=float), dropped


@dataclass(frozen=True)
class Interval:
    """Mean of n replicate values with a confidence interval (NaN bounds when n < 2)."""

    n: int
    mean: float
    sd: float
    low: float
    high: float
    level: float
    method: str
    note: str = ""
    clipped: bool = False  # cut at a bound of the metric's range (module docstring)

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2.0

    @property
    def has_interval(self) -> bool:
        return math.isfinite(self.low) and math.isfinite(self.high)


@functools.lru_cache(maxsize=1024)
def t_quantile(level: float, df: int) -> float:
    """t_{(1+level)/2, df} (cached: a report asks for the same few thousands of times)."""
    return float(_sps.t.ppf((1.0 + level) / 2.0, df))


def t_half_width(sd: float, n: int, level: float = DEFAULT_LEVEL) -> float:
    """t_{(1+level)/2, n-1} · sd / sqrt(n): half-width of the Student-t interval of a mean."""
    if n < 2:
        return math.nan
    return t_quantile(float(level), int(n) - 1) * sd / math.sqrt(n)


def clip_interval(
    low: float, high: float, bounds: tuple[float, float] | None, values: np.ndarray | Sequence[float] | None = None
) -> tuple[float, float, bool]:
    """(low, high) intersected with `bounds`, and whether that cut it.

    Values outside the bounds (`values`, those the interval is of), or an interval that does
    not meet them, are refused with a ValueError: percent values against the bounds of a
    fraction (94.2 against [0, 1]) would otherwise give an inverted interval (93.95, 1.0)."""
    if bounds is None:
        return low, high, False
    lo, hi = bounds
    slack = 1e-9 * max(1.0, abs(lo) if math.isfinite(lo) else 1.0, abs(hi) if math.isfinite(hi) else 1.0)
    if values is not None and len(values):
        found = np.asarray(values, dtype=float)
        smallest, largest = float(np.min(found)), float(np.max(found))
        if smallest < lo - slack or largest > hi + slack:
            raise ValueError(
                f"values from {smallest:g} to {largest:g} lie outside the metric's "
                f"range [{lo:g}, {hi:g}]; expected values in that range (an accuracy "
                f"as a fraction, not in percent)"
            )
    if not (math.isfinite(low) and math.isfinite(high)):
        return low, high, False
    if low > hi + slack or high < lo - slack:
        raise ValueError(
            f"the interval [{low:g}, {high:g}] lies outside the metric's range "
            f"[{lo:g}, {hi:g}]; expected values in that range (an accuracy as a "
            f"fraction, not in percent)"
        )
    clipped = low < lo or high > hi
    return max(low, lo), min(high, hi), clipped


def bootstrap_interval(x: np.ndarray, level: float, n_boot: int, seed: int) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean (resampling with replacement, seeded)."""
    if n_boot < 100:
        raise ValueError(f"n_boot must be at least 100, got {n_boot}")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(low), float(high)


def mean_ci(
    values: Iterable[Any],
    level: float = DEFAULT_LEVEL,
    method: str = "t",
    *,
    n_boot: int = 10_000,
    seed: int = 0,
    bounds: tuple[float, float] | None = None,
) -> Interval:
    """Mean, sd and a `level` confidence interval of the mean of `values` (None/NaN ignored).

    `bounds`: the range of the values (e.g. `metric_bounds(metric)`); the interval is
    intersected with it (module docstring)."""
    level, method = check_level(level), check_method(method)
    x, dropped = _finite(values)
    dropped_note = f"{dropped} non-finite value(s) ignored" if dropped else ""
    n = int(x.size)
    if n == 0:
        return Interval(
            0,
            math.nan,
            math.nan,
            math.nan,
            math.nan,
            level,
            method,
            "; ".join(filter(None, [NOTE_EMPTY, dropped_note])),
        )
    clip_interval(math.nan, math.nan, bounds, x)  # values outside the bounds: refused
    mean = float(x.mean())
    if n == 1:
        return Interval(
            1, mean, math.nan, math.nan, math.nan, level, method, "; ".join(filter(None, [NOTE_SINGLE, dropped_note]))
        )
    sd = float(x.std(ddof=1))
    if method == "t":
        half = t_half_width(sd, n, level)
        low, high = mean - half, mean + half
    else:
        low, high = bootstrap_interval(x, level, n_boot, seed)
    low, high, clipped = clip_interval(low, high, bounds)
    return Interval(n, mean, sd, low, high, level, method, dropped_note, clipped)


def holm(pvalues: Sequence[float] | np.ndarray) -> np.ndarray:
    """Holm's step-down adjusted p-values; NaN entries stay NaN and do not count in m.

    Sorted p_(1) <= ... <= p_(m): adj_(i) = max_{j<=i} min(1, (m - j + 1) p_(j)).
    """
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    finite = np.flatnonzero(np.isfinite(p))
    m = finite.size
    if m == 0:
        return out
    order = finite[np.argsort(p[finite], kind="stable")]
    scaled = (m - np.arange(m)) * p[order]
    out[order] = np.minimum(1.0, np.maximum.accumulate(scaled))
    return out


@dataclass(frozen=True)
class PairedResult:
    """Mean of the paired differences a - b over seeds, its CI and the paired t-test."""

    n: int
    mean_diff: float
    sd_diff: float
    low: float
    high: float
    t: float
    df: int
    p_value: float
    level: float
    note: str = ""
    clipped: bool = False


def paired_test(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    level: float = DEFAULT_LEVEL,
    bounds: tuple[float, float] | None = None,
) -> PairedResult:
    """Paired t-test of a against b (same order = same seed): scipy.stats.ttest_rel's statistic.

    d_i = a_i - b_i, t = mean(d) / (sd(d) / sqrt(n)) on n - 1 df, two-sided p; CI of mean(d)
    with the Student-t quantile. n = 1 gives no interval and no test (NaN, note says so); so
    does a degenerate test, all differences equal (sd 0: `NOTE_DEGENERATE`, t and p NaN, so
    never significant and outside Holm's family).
    """
    level = check_level(level)
    a_arr, b_arr = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a_arr.shape != b_arr.shape or a_arr.ndim != 1:
        raise ValueError(f"paired samples must be 1-D of equal length, got {a_arr.shape} and {b_arr.shape}")
    d = a_arr - b_arr
    n = int(d.size)
    if n == 0:
        return PairedResult(0, math.nan, math.nan, math.nan, math.nan, math.nan, 0, math.nan, level, "no common seed")
    clip_interval(math.nan, math.nan, bounds, d)  # differences outside the bounds: refused
    mean = float(d.mean())
    if n == 1:
        return PairedResult(
            1,
            mean,
            math.nan,
            math.nan,
            math.nan,
            math.nan,
            0,
            math.nan,
            level,
            "n=1: one common seed, no interval and no test",
        )
    sd = float(d.std(ddof=1))
    half = t_half_width(sd, n, level)
    low, high, clipped = clip_interval(mean - half, mean + half, bounds)
    if sd <= 1e-12 * max(1.0, abs(mean)):  # (float noise of equal differences included)
        # t = mean / 0 has no distribution to read a p-value from: no test, said as such
        # (never p = 0 and significant)
        return PairedResult(n, mean, sd, low, high, math.nan, n - 1, math.nan, level, NOTE_DEGENERATE, clipped)
    t = mean / (sd / math.sqrt(n))
    p = float(2.0 * _sps.t.sf(abs(t), n - 1))
    return PairedResult(n, mean, sd, low, high, t, n - 1, p, level, "", clipped)


def table_rows(table: pa.Table | Sequence[Mapping[str, Any]]) -> list[dict]:
    if isinstance(table, pa.Table):
        return table.to_pylist()
    return [dict(r) for r in table]
