"""Confidence intervals over seeds and paired comparisons between variants.

A *config* is everything but the seed (`config_id`, docs/interfaces.md section 6); its seeds
are replicates. The papers report the mean and a 95% confidence interval over 3 or 4 seeds
without naming the method (thesis Tables 4.4 to 4.6, 5.1 and 5.2); here the method
is explicit:

- `t` (default): Student's t interval on n - 1 degrees of freedom,
  mean ± t_{(1+level)/2, n-1} · sd / sqrt(n), sd with the n - 1 denominator. With n = 3 the
  t quantile is 4.303, about 2.2 times the normal 1.96, which matters for few seeds.
- `bootstrap`: percentile bootstrap of the mean (seeded, `n_boot` resamples).

With n = 1 there is no interval: the bounds are NaN, `no_interval` is true and the note
says why.

Bounded metrics (`metric_bounds`: accuracies in [0, 1]; times, set sizes and epochs at
least 0): the t interval is intersected with the metric's range, and `clipped` says when
that cut it. The mean lies in the range, so the cut interval contains it exactly when the t
interval does: the coverage is the t interval's, the interval only loses values that cannot
be the mean (an accuracy over 100 %). The alternatives were worse here: a logit-transformed
t interval stays inside by construction but is an interval for another quantity (the
back-transformed mean logit, not the mean accuracy), needs an ad hoc correction for values
of exactly 0 or 1 (a shot group with no hit, a top-10 accuracy of 100 %) and has no
guaranteed coverage for the mean; the percentile bootstrap of the mean is within the
range of the values already (it is intersected too, which never cuts it). A cut interval is
not symmetric: the tables print its bounds instead of `± half-width` and say so.
Paired differences of an accuracy are bounded by [-1, 1] in the same way. Paired comparisons pair a variant's config with the matching reference config
seed by seed (the same seed list is used for every config), and use the paired t-test;
p-values are Holm-corrected across the variants compared with the same reference config.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
from scipy import stats as _sps

from analysis.collect import PARAM_PREFIX

CI_METHODS = ("t", "bootstrap")
DEFAULT_LEVEL = 0.95
NOTE_SINGLE = "n=1: no interval (a single seed)"
NOTE_EMPTY = "no value: no finished seed reported this metric"

_FRACTION_METRIC = re.compile(
    r"^(macro_)?(top|avg)\d+$"
    # the coverage of conformal sets (lac90, aps_class_avg5) and the multi-label precisions and
    # recalls (prec5, rec5, rprec): setvalued.metric_names
    r"|^(macro_)?(lac|aps)(_class|_shot)?(\d+(\.\d+)?|_avg\d+)$|^(macro_)?(prec|rec)\d+$|^rprec$")


def is_fraction_metric(metric: str) -> bool:
    """Accuracies in [0, 1] (`test/top5`, `val/macro_avg3`, `test/few/top1`, `test/lac90`,
    `val/rprec`): shown in percent."""
    # best_val is the selection metric's best value: always an accuracy (studies.studyfile.spec
    # accepts only top-K / average-K metrics as eval.selection)
    return metric == "best_val" or bool(_FRACTION_METRIC.match(metric.rsplit("/", 1)[-1]))


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


def _check_level(level: float) -> float:
    level = float(level)
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence level must be in (0, 1), e.g. 0.95; got {level!r}")
    return level


def _check_method(method: str) -> str:
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


def clip_interval(low: float, high: float, bounds: tuple[float, float] | None
                  ) -> tuple[float, float, bool]:
    """(low, high) intersected with `bounds`, and whether that cut it."""
    if bounds is None or not (math.isfinite(low) and math.isfinite(high)):
        return low, high, False
    lo, hi = bounds
    clipped = low < lo or high > hi
    return max(low, lo), min(high, hi), clipped


def bootstrap_interval(
    x: np.ndarray, level: float, n_boot: int, seed: int
) -> tuple[float, float]:
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
    level, method = _check_level(level), _check_method(method)
    x, dropped = _finite(values)
    dropped_note = f"{dropped} non-finite value(s) ignored" if dropped else ""
    n = int(x.size)
    if n == 0:
        return Interval(0, math.nan, math.nan, math.nan, math.nan, level, method,
                        "; ".join(filter(None, [NOTE_EMPTY, dropped_note])))
    mean = float(x.mean())
    if n == 1:
        return Interval(1, mean, math.nan, math.nan, math.nan, level, method,
                        "; ".join(filter(None, [NOTE_SINGLE, dropped_note])))
    sd = float(x.std(ddof=1))
    if method == "t":
        half = t_half_width(sd, n, level)
        low, high = mean - half, mean + half
    else:
        low, high = bootstrap_interval(x, level, n_boot, seed)
    low, high, clipped = clip_interval(low, high, bounds)
    return Interval(n, mean, sd, low, high, level, method, dropped_note, clipped)


def holm(pvalues: Sequence[float]) -> np.ndarray:
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


def paired_test(a: Sequence[float], b: Sequence[float], level: float = DEFAULT_LEVEL,
                bounds: tuple[float, float] | None = None) -> PairedResult:
    """Paired t-test of a against b (same order = same seed): scipy.stats.ttest_rel's statistic.

    d_i = a_i - b_i, t = mean(d) / (sd(d) / sqrt(n)) on n - 1 df, two-sided p; CI of mean(d)
    with the Student-t quantile. n = 1 gives no interval and no test (NaN, note says so).
    """
    level = _check_level(level)
    a_arr, b_arr = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a_arr.shape != b_arr.shape or a_arr.ndim != 1:
        raise ValueError(f"paired samples must be 1-D of equal length, got {a_arr.shape} "
                         f"and {b_arr.shape}")
    d = a_arr - b_arr
    n = int(d.size)
    if n == 0:
        return PairedResult(0, math.nan, math.nan, math.nan, math.nan, math.nan, 0, math.nan,
                            level, "no common seed")
    mean = float(d.mean())
    if n == 1:
        return PairedResult(1, mean, math.nan, math.nan, math.nan, math.nan, 0, math.nan,
                            level, "n=1: one common seed, no interval and no test")
    sd = float(d.std(ddof=1))
    se = sd / math.sqrt(n)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = float(np.divide(mean, se))
    p = float(2.0 * _sps.t.sf(abs(t), n - 1)) if not math.isnan(t) else math.nan
    half = t_half_width(sd, n, level)
    note = "all paired differences are equal" if sd <= 1e-12 * max(1.0, abs(mean)) else ""
    low, high, clipped = clip_interval(mean - half, mean + half, bounds)
    return PairedResult(n, mean, sd, low, high, t, n - 1, p, level, note, clipped)


# ----------------------------------------------------------------------------- tables


def _rows(table: pa.Table | Sequence[Mapping[str, Any]]) -> list[dict]:
    if isinstance(table, pa.Table):
        return table.to_pylist()
    return [dict(r) for r in table]


def _param_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for row in rows:
        for key in row:
            if key.startswith(PARAM_PREFIX):
                seen[key] = None
    return list(seen)


def group_by_config(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[dict]]:
    """{config_id: rows of its seeds}, in the order configs first appear."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["config_id"], []).append(dict(row))
    return groups


SUMMARY_FIXED = (
    "config_id", "variant", "swept", "metric", "n", "mean", "sd", "ci_low", "ci_high",
    "half_width", "level", "method", "no_interval", "clipped", "note", "seeds", "values",
)


def summarize(
    table: pa.Table | Sequence[Mapping[str, Any]],
    metrics: Sequence[str],
    level: float = DEFAULT_LEVEL,
    method: str = "t",
    *,
    n_boot: int = 10_000,
    seed: int = 0,
    bounded: bool = True,
) -> pa.Table:
    """One row per (config, metric): n, mean, sd, CI bounds and the raw per-seed values.

    `table` is `Collected.table` (or its rows). The config's `param:*` columns are copied so
    that curves and tables can use the parameter values. `bounded`: intervals of a bounded
    metric are cut at its bounds (`metric_bounds`; `clipped` says where that cut one).
    """
    level, method = _check_level(level), _check_method(method)
    rows = _rows(table)
    params = _param_columns(rows)
    missing = [m for m in metrics if rows and not any(m in r for r in rows)]
    if missing:
        available = sorted({k for r in rows for k in r
                            if not k.startswith(PARAM_PREFIX)})
        raise ValueError(f"metric(s) {missing} not found among the collected columns "
                         f"{available}")
    bounds = {m: metric_bounds(m) if bounded else None for m in metrics}
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["config_id"], []).append(row)
    records = []
    for config_id, group in groups.items():
        group = sorted(group, key=lambda r: r["seed"])
        first = group[0]
        for metric in metrics:
            pairs = [(r["seed"], r.get(metric)) for r in group]
            ci = mean_ci([v for _, v in pairs], level, method, n_boot=n_boot, seed=seed,
                         bounds=bounds[metric])
            kept = [(s, float(v)) for s, v in pairs if v is not None and math.isfinite(v)]
            record = {
                "config_id": config_id,
                "variant": first.get("variant"),
                "swept": first.get("swept", "{}"),
                "metric": metric,
                "n": ci.n,
                "mean": ci.mean,
                "sd": ci.sd,
                "ci_low": ci.low,
                "ci_high": ci.high,
                "half_width": ci.half_width,
                "level": level,
                "method": method,
                "no_interval": not ci.has_interval,
                "clipped": ci.clipped,
                "note": ci.note,
                "seeds": [s for s, _ in kept],
                "values": [v for _, v in kept],
            }
            for p in params:
                record[p] = first.get(p)
            records.append(record)
    return _summary_table(records, params, rows)


def _summary_table(records: list[dict], params: list[str], rows: list[dict]) -> pa.Table:
    from analysis.collect import typed_column

    columns: dict[str, pa.Array] = {
        "config_id": pa.array([r["config_id"] for r in records], pa.string()),
        "variant": pa.array([r["variant"] for r in records], pa.string()),
        "swept": pa.array([r["swept"] for r in records], pa.string()),
        "metric": pa.array([r["metric"] for r in records], pa.string()),
        "n": pa.array([r["n"] for r in records], pa.int64()),
    }
    for name in ("mean", "sd", "ci_low", "ci_high", "half_width", "level"):
        columns[name] = pa.array([r[name] for r in records], pa.float64())
    columns["method"] = pa.array([r["method"] for r in records], pa.string())
    columns["no_interval"] = pa.array([r["no_interval"] for r in records], pa.bool_())
    columns["clipped"] = pa.array([r["clipped"] for r in records], pa.bool_())
    columns["note"] = pa.array([r["note"] for r in records], pa.string())
    columns["seeds"] = pa.array([r["seeds"] for r in records], pa.list_(pa.int64()))
    columns["values"] = pa.array([r["values"] for r in records], pa.list_(pa.float64()))
    for p in params:
        columns[p] = typed_column([r.get(p) for r in records])
    return pa.table(columns)


# ----------------------------------------------------------------------------- pairing


def _swept(row: Mapping[str, Any]) -> dict:
    try:
        return json.loads(row.get("swept") or "{}")
    except ValueError:
        return {}


def variant_defining_paths(rows: Sequence[Mapping[str, Any]]) -> set[str]:
    """Param paths that are constant inside every variant but differ between variants.

    These are what a variant overlay sets (loss name, its parameters, ...); they are not
    part of the context on which a variant is matched with the reference.
    """
    per_variant: dict[str, dict[str, set]] = {}
    for row in rows:
        values = per_variant.setdefault(row.get("variant"), {})
        for key, value in row.items():
            if key.startswith(PARAM_PREFIX):
                values.setdefault(key[len(PARAM_PREFIX):], set()).add(json.dumps(value))
    if len(per_variant) < 2:
        return set()
    paths = set().union(*(v.keys() for v in per_variant.values()))
    defining = set()
    for path in paths:
        sets = [v.get(path, {json.dumps(None)}) for v in per_variant.values()]
        if all(len(s) == 1 for s in sets) and len(set().union(*sets)) > 1:
            defining.add(path)
    return defining


def _ignored(path: str, ignore: set[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in ignore)


def configs_match(a: Mapping[str, Any], b: Mapping[str, Any], ignore: set[str]) -> bool:
    """Whether two configs share their context: every param equal except the ignored paths.

    When the two configs use different losses (`loss.name`), the loss's own parameters
    (`loss.*`) are not comparable and are ignored too.
    """
    keys = {k for k in list(a) + list(b) if k.startswith(PARAM_PREFIX)}
    different_loss = a.get(PARAM_PREFIX + "loss.name") != b.get(PARAM_PREFIX + "loss.name")
    for key in keys:
        path = key[len(PARAM_PREFIX):]
        if _ignored(path, ignore) or (different_loss and path.startswith("loss.")):
            continue
        if a.get(key) != b.get(key):
            return False
    return True


def _context_key(row: Mapping[str, Any], ignore: set[str]) -> tuple[tuple, Any, tuple]:
    """(the params outside `loss.*`, the loss name, the `loss.*` params), the ignored paths
    and None values left out: `configs_match(a, b)` holds exactly when the first parts are
    equal and either the loss names differ or the last parts are equal too."""
    outer, inner = [], []
    for key, value in row.items():
        if not key.startswith(PARAM_PREFIX) or value is None:
            continue
        path = key[len(PARAM_PREFIX):]
        if _ignored(path, ignore):
            continue
        (inner if path.startswith("loss.") else outer).append((key, value))
    return tuple(sorted(outer)), row.get(PARAM_PREFIX + "loss.name"), tuple(sorted(inner))


def paired_comparisons(
    table: pa.Table | Sequence[Mapping[str, Any]],
    metrics: Sequence[str],
    reference: str,
    level: float = DEFAULT_LEVEL,
    *,
    variant_paths: Iterable[str] | None = None,
) -> pa.Table:
    """Each variant's configs against the matching config(s) of `reference`, paired by seed.

    A config of another variant is compared with every reference config that has the same
    context: all params equal except the paths that define a variant (`variant_paths`, e.g.
    the keys of the study's variant overlays; default: `variant_defining_paths`) and, when
    the losses differ, the `loss.*` parameters. Holm's correction is applied per metric over
    all comparisons against the same reference config.
    """
    level = _check_level(level)
    rows = _rows(table)
    variants = list(dict.fromkeys(r.get("variant") for r in rows))
    if reference not in variants:
        raise ValueError(f"reference variant {reference!r} not among the finished variants "
                         f"{variants}")
    ignore = set(variant_paths) if variant_paths is not None else set()
    ignore |= variant_defining_paths(rows)
    groups = group_by_config(rows)
    ref_configs = {c: g for c, g in groups.items() if g[0].get("variant") == reference}
    # configs_match for every pair, through an index on the context (2,000 configs would
    # otherwise compare 500 x 1,500 pairs param by param)
    by_context: dict[tuple, list[tuple[str, Any, tuple]]] = {}
    for ref_id, ref_group in ref_configs.items():
        outer, loss_name, inner = _context_key(ref_group[0], ignore)
        by_context.setdefault(outer, []).append((ref_id, loss_name, inner))
    pairs: list[tuple[str, str]] = []
    for config_id, group in groups.items():
        if group[0].get("variant") == reference:
            continue
        outer, loss_name, inner = _context_key(group[0], ignore)
        pairs += [(config_id, ref_id) for ref_id, ref_loss, ref_inner in by_context.get(outer, [])
                  if ref_loss != loss_name or ref_inner == inner]
    records = []
    for metric in metrics:
        bounds = difference_bounds(metric)
        for config_id, ref_id in pairs:
            group, ref_group = groups[config_id], ref_configs[ref_id]
            variant = group[0].get("variant")
            a = {r["seed"]: r.get(metric) for r in group}
            b = {r["seed"]: r.get(metric) for r in ref_group}
            common = sorted(s for s in a.keys() & b.keys()
                            if a[s] is not None and b[s] is not None
                            and math.isfinite(a[s]) and math.isfinite(b[s]))
            result = paired_test([a[s] for s in common], [b[s] for s in common], level,
                                 bounds)
            unpaired = len((a.keys() | b.keys()) - set(common))
            note = result.note
            if unpaired:
                note = "; ".join(filter(None, [note, f"{unpaired} seed(s) without a pair"]))
            records.append({
                "metric": metric, "variant": variant, "config_id": config_id,
                "swept": group[0].get("swept", "{}"), "reference": reference,
                "reference_config_id": ref_id,
                "reference_swept": ref_group[0].get("swept", "{}"),
                "n": result.n, "mean_diff": result.mean_diff, "sd_diff": result.sd_diff,
                "ci_low": result.low, "ci_high": result.high, "t": result.t,
                "df": result.df, "p_value": result.p_value, "level": level,
                "seeds": common, "note": note, "clipped": result.clipped,
            })
    families: dict[tuple, list[int]] = {}
    for index, record in enumerate(records):
        families.setdefault((record["metric"], record["reference_config_id"]), []).append(index)
    p_holm = [math.nan] * len(records)
    for indices in families.values():
        adjusted = holm([records[i]["p_value"] for i in indices])
        for i, value in zip(indices, adjusted):
            p_holm[i] = float(value)
    for record, value in zip(records, p_holm):
        record["p_holm"] = value
    schema = pa.schema([
        ("metric", pa.string()), ("variant", pa.string()), ("config_id", pa.string()),
        ("swept", pa.string()), ("reference", pa.string()),
        ("reference_config_id", pa.string()), ("reference_swept", pa.string()),
        ("n", pa.int64()), ("mean_diff", pa.float64()), ("sd_diff", pa.float64()),
        ("ci_low", pa.float64()), ("ci_high", pa.float64()), ("t", pa.float64()),
        ("df", pa.int64()), ("p_value", pa.float64()), ("p_holm", pa.float64()),
        ("level", pa.float64()), ("seeds", pa.list_(pa.int64())), ("note", pa.string()),
        ("clipped", pa.bool_()),
    ])
    return pa.Table.from_pylist(records, schema=schema)


# ----------------------------------------------------------------------------- curves


@dataclass
class CurveSeries:
    """One line of a curve: summary rows sorted by x; `flat` when it has a single config
    that does not vary x (drawn as a horizontal reference)."""

    label: str
    variant: str | None
    points: list[dict] = field(default_factory=list)
    flat: bool = False

    @property
    def n_range(self) -> tuple[int, int]:
        ns = [p["n"] for p in self.points]
        return (min(ns), max(ns)) if ns else (0, 0)


def _fmt_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def curve_series(
    summary: pa.Table | Sequence[Mapping[str, Any]],
    x: str,
    metric: str,
    *,
    series_by: str = "variant",
) -> list[CurveSeries]:
    """The lines of a curve of `metric` against the dotted param `x`, one per variant.

    A config is a point of a variant's line when it sweeps `x` (its `swept` has `x`); the
    other swept parameters of those configs split the line (a grid gives one line per value
    of the others). A config of the variant that does not sweep `x` but has the other
    swept values of a line (the base cell of a one-at-a-time sensitivity design) joins that
    line at its own value of `x`. A variant with no config on `x` but exactly one config in
    the curve's context (the other swept params at the values shared by every config on
    `x`) is kept as a flat reference line (a baseline such as CE).
    """
    xcol = PARAM_PREFIX + x
    rows = [r for r in _rows(summary) if r["metric"] == metric]
    if not rows:
        return []
    by_variant: dict[Any, list[dict]] = {}
    for row in rows:
        key = row.get(series_by) if series_by in row else row.get(PARAM_PREFIX + series_by)
        by_variant.setdefault(key, []).append(row)

    # values of the other params that every config on x shares (the curve's context)
    all_on_x = [r for r in rows if x in _swept(r)]
    context: dict[str, str] = {}
    if all_on_x:
        for key in {k for r in rows for k in _swept(r)} - {x}:
            values = {json.dumps(r.get(PARAM_PREFIX + key)) for r in all_on_x}
            if len(values) == 1:
                context[key] = values.pop()

    out: list[CurveSeries] = []
    for variant, vrows in by_variant.items():
        on_x = [r for r in vrows if x in _swept(r)]
        if not on_x:
            # a baseline: its one config in the curve's context becomes a flat line
            candidates = [
                r for r in vrows
                if all(k in context and json.dumps(r.get(PARAM_PREFIX + k)) == context[k]
                       for k in _swept(r))
            ]
            if len(candidates) == 1:
                out.append(CurveSeries(str(variant), variant, candidates, flat=True))
            continue
        others = sorted({k for r in on_x for k in _swept(r)} - {x})

        def other_key(row):
            return tuple(json.dumps(row.get(PARAM_PREFIX + k)) for k in others)

        lines: dict[tuple, list[dict]] = {}
        for row in on_x:
            lines.setdefault(other_key(row), []).append(row)
        used = {r["config_id"] for r in on_x}
        for row in vrows:
            if row["config_id"] in used:
                continue
            key = other_key(row)
            if key not in lines:
                continue
            line = lines[key]
            # every other param it sweeps must sit at the line's (constant) value
            fits = all(
                len({json.dumps(r.get(PARAM_PREFIX + k)) for r in line}) == 1
                and json.dumps(row.get(PARAM_PREFIX + k)) == json.dumps(line[0].get(
                    PARAM_PREFIX + k))
                for k in _swept(row) if k != x
            )
            xs = {json.dumps(r.get(xcol)) for r in line}
            if fits and row.get(xcol) is not None and json.dumps(row.get(xcol)) not in xs:
                line.append(row)
                used.add(row["config_id"])
        for key, line in lines.items():
            label = str(variant)
            if others:
                label += ", " + ", ".join(
                    f"{k}={_fmt_value(json.loads(v))}" for k, v in zip(others, key))
            line.sort(key=lambda r: _sort_key(r.get(xcol)))
            out.append(CurveSeries(label, variant, line))
    return out


def _sort_key(value: Any) -> tuple:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, str(value))


def epoch_curves(
    history: pa.Table | Sequence[Mapping[str, Any]],
    metric: str,
    level: float = DEFAULT_LEVEL,
    method: str = "t",
    *,
    n_boot: int = 10_000,
    seed: int = 0,
) -> list[dict]:
    """Mean and CI over seeds of a per-epoch `metric`, for every config and epoch.

    `history` is `analysis.collect.collect_histories(...)`. Returns one record per (config,
    epoch): `config_id`, `variant`, `swept`, `epoch`, `n`, `mean`, `ci_low`, `ci_high`
    (NaN bounds when n < 2, cut at the metric's bounds: `clipped`), sorted by config then
    epoch. A config's seeds are replicates
    epoch by epoch, so n may drop at the last epochs of a config whose seeds stopped early.
    """
    rows = [r for r in _rows(history) if r["metric"] == metric]
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["config_id"], int(row["epoch"])), []).append(row)
    out = []
    bounds = metric_bounds(metric)
    for (config_id, epoch), group in sorted(groups.items()):
        interval = mean_ci([r["value"] for r in group], level, method, n_boot=n_boot, seed=seed,
                           bounds=bounds)
        out.append({"config_id": config_id, "variant": group[0]["variant"],
                    "swept": group[0]["swept"], "epoch": epoch, "n": interval.n,
                    "mean": interval.mean, "ci_low": interval.low, "ci_high": interval.high,
                    "clipped": interval.clipped})
    return out


def set_size_fractions(
    sizes: pa.Table | Sequence[Mapping[str, Any]],
    config_of_run: Mapping[str, str],
    k: str,
) -> dict[tuple[str, str], dict]:
    """Distribution of the average-`k` set sizes on test, per config, averaged over seeds.

    `sizes` holds the `set_sizes_test.parquet` rows of the runs (`run_id`, `avgk`, `shot`,
    `size`, `count`); `config_of_run` maps the runs to their config. Returns
    `{(config_id, group): {"n": seeds, "fractions": {size: mean fraction}}}` for the groups
    `all` and every shot group (`few`, `medium`, `many`): each run's counts are normalised
    within the group, then averaged over the config's runs (a size a run never produced
    counts as 0 for it), as in thesis Figure 5.4.
    """
    per_run: dict[tuple[str, str], dict[int, float]] = {}
    for row in _rows(sizes):
        if str(row["avgk"]) != str(k) or row["run_id"] not in config_of_run:
            continue
        for group in ("all", row["shot"]):
            counts = per_run.setdefault((row["run_id"], group), {})
            counts[int(row["size"])] = counts.get(int(row["size"]), 0.0) + float(row["count"])
    runs_of: dict[tuple[str, str], list[dict[int, float]]] = {}
    for (run_id, group), counts in per_run.items():
        runs_of.setdefault((config_of_run[run_id], group), []).append(counts)
    out = {}
    for key, runs in sorted(runs_of.items()):
        fractions: dict[int, float] = {}
        for counts in runs:
            total = sum(counts.values())
            for size, count in counts.items():
                fractions[size] = fractions.get(size, 0.0) + count / total / len(runs)
        out[key] = {"n": len(runs), "fractions": dict(sorted(fractions.items()))}
    return out


def per_class_means(
    per_class: pa.Table | Sequence[Mapping[str, Any]],
    config_of_run: Mapping[str, str],
    metric: str,
) -> dict[str, dict]:
    """Per-class test accuracy of each config, averaged over its seeds.

    `per_class` holds the `per_class_test.parquet` rows of the runs (`run_id`, `class`,
    `train_count` and a column per metric, such as `top1`; NaN where the class has no test
    image); `config_of_run` maps the runs to their config. Returns `{config_id:
    {"train_count": [...], "mean": [...], "n": seeds}}`, classes in increasing order, each
    mean over the runs that have a finite value for the class (NaN when none has). Runs
    without the metric's column are left out.
    """
    rows = _rows(per_class)
    sums: dict[str, dict[int, list]] = {}
    runs_of: dict[str, set] = {}
    for row in rows:
        run_id = row.get("run_id")
        if run_id not in config_of_run or row.get(metric) is None:
            continue
        config_id = config_of_run[run_id]
        runs_of.setdefault(config_id, set()).add(run_id)
        entry = sums.setdefault(config_id, {}).setdefault(int(row["class"]),
                                                          [int(row["train_count"]), 0.0, 0])
        value = float(row[metric])
        if math.isfinite(value):
            entry[1] += value
            entry[2] += 1
    out = {}
    for config_id, classes in sorted(sums.items()):
        ordered = sorted(classes.items())
        out[config_id] = {
            "train_count": [count for _, (count, _, _) in ordered],
            "mean": [total / n if n else math.nan for _, (_, total, n) in ordered],
            "n": len(runs_of[config_id]),
        }
    return out
