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
Paired differences of an accuracy are bounded by [-1, 1] in the same way. Paired comparisons pair a
variant's config with the matching reference config
seed by seed (the same seed list is used for every config), and use the paired t-test;
p-values are Holm-corrected across the variants compared with the same reference config.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from analysis.collect import PARAM_PREFIX
from analysis.distinct import VERSION_PARAM
from analysis.intervals import (
    CI_METHODS,
    DEFAULT_LEVEL,
    NOTE_SINGLE,
    check_level,
    check_method,
    difference_bounds,
    holm,
    is_fraction_metric,
    lower_is_better,
    mean_ci,
    metric_bounds,
    paired_test,
    t_quantile,
    table_rows,
)
from analysis.series import (
    CurveSeries,
    curve_series,
    epoch_curves,
    per_class_means,
    set_size_fractions,
)

__all__ = [
    "CI_METHODS",
    "DEFAULT_LEVEL",
    "NOTE_SINGLE",
    "difference_bounds",
    "holm",
    "is_fraction_metric",
    "lower_is_better",
    "mean_ci",
    "metric_bounds",
    "paired_test",
    "t_quantile",
    "CurveSeries",
    "curve_series",
    "epoch_curves",
    "per_class_means",
    "set_size_fractions",
    "group_by_config",
    "SUMMARY_FIXED",
    "summarize",
    "variant_defining_paths",
    "configs_match",
    "paired_comparisons",
]


# ----------------------------------------------------------------------------- tables


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
    "config_id",
    "variant",
    "swept",
    "metric",
    "n",
    "mean",
    "sd",
    "ci_low",
    "ci_high",
    "half_width",
    "level",
    "method",
    "no_interval",
    "clipped",
    "note",
    "seeds",
    "values",
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
    level, method = check_level(level), check_method(method)
    rows = table_rows(table)
    params = _param_columns(rows)
    missing = [m for m in metrics if rows and not any(m in r for r in rows)]
    if missing:
        available = sorted({k for r in rows for k in r if not k.startswith(PARAM_PREFIX)})
        raise ValueError(f"metric(s) {missing} not found among the collected columns {available}")
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
            ci = mean_ci([v for _, v in pairs], level, method, n_boot=n_boot, seed=seed, bounds=bounds[metric])
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


def variant_defining_paths(rows: Sequence[Mapping[str, Any]]) -> set[str]:
    """Param paths that are constant inside every variant but differ between variants.

    These are what a variant overlay sets (loss name, its parameters, ...); they are not
    part of the context on which a variant is matched with the reference.
    """
    per_variant: dict[Any, dict[str, set[Any]]] = {}
    for row in rows:
        values = per_variant.setdefault(row.get("variant"), {})
        for key, value in row.items():
            if key.startswith(PARAM_PREFIX):
                values.setdefault(key[len(PARAM_PREFIX) :], set()).add(json.dumps(value))
    if len(per_variant) < 2:
        return set()
    paths = set().union(*(v.keys() for v in per_variant.values()))
    defining = set()
    for path in paths - {VERSION_PARAM}:  # a comparison never spans versions (analysis.distinct)
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
        path = key[len(PARAM_PREFIX) :]
        if _ignored(path, ignore) or (different_loss and path.startswith("loss.")):
            continue
        if a.get(key) != b.get(key):
            return False
    return True


def _context_key(row: Mapping[str, Any], ignore: set[str]) -> tuple[tuple, Any, tuple]:
    """(the params outside `loss.*`, the loss name, the `loss.*` params), the ignored paths
    and None values left out: `configs_match(a, b)` holds exactly when the first parts are
    equal and either the loss names differ or the last parts are equal too."""
    outer: list[tuple[str, Any]] = []
    inner: list[tuple[str, Any]] = []
    for key, value in row.items():
        if not key.startswith(PARAM_PREFIX) or value is None:
            continue
        path = key[len(PARAM_PREFIX) :]
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
    level = check_level(level)
    rows = table_rows(table)
    variants = list(dict.fromkeys(r.get("variant") for r in rows))
    if reference not in variants:
        raise ValueError(f"reference variant {reference!r} not among the finished variants {variants}")
    ignore = set(variant_paths) if variant_paths is not None else set()
    ignore |= variant_defining_paths(rows)
    groups = group_by_config(rows)
    ref_configs = {c: g for c, g in groups.items() if g[0].get("variant") == reference}
    pairs = _matching_pairs(groups, ref_configs, reference, ignore)
    records = [
        _paired_record(metric, groups[config_id], ref_configs[ref_id], reference, level, bounds)
        for metric, bounds in ((m, difference_bounds(m)) for m in metrics)
        for config_id, ref_id in pairs
    ]
    _add_holm(records)
    return pa.Table.from_pylist(records, schema=_PAIRED_SCHEMA)


def _matching_pairs(
    groups: Mapping[str, list[dict]], ref_configs: Mapping[str, list[dict]], reference: str, ignore: set[str]
) -> list[tuple[str, str]]:
    """(config_id, reference config_id) of every config of another variant and every
    reference config that `configs_match` it, through an index on the context (2,000 configs
    would otherwise compare 500 x 1,500 pairs param by param)."""
    by_context: dict[tuple, list[tuple[str, Any, tuple]]] = {}
    for ref_id, ref_group in ref_configs.items():
        outer, loss_name, inner = _context_key(ref_group[0], ignore)
        by_context.setdefault(outer, []).append((ref_id, loss_name, inner))
    pairs: list[tuple[str, str]] = []
    for config_id, group in groups.items():
        if group[0].get("variant") == reference:
            continue
        outer, loss_name, inner = _context_key(group[0], ignore)
        pairs += [
            (config_id, ref_id)
            for ref_id, ref_loss, ref_inner in by_context.get(outer, [])
            if ref_loss != loss_name or ref_inner == inner
        ]
    return pairs


def _paired_record(
    metric: str,
    group: Sequence[Mapping[str, Any]],
    ref_group: Sequence[Mapping[str, Any]],
    reference: str,
    level: float,
    bounds: Any,
) -> dict[str, Any]:
    """One config against one reference config on `metric`: the paired test over the seeds
    both have a finite value for (the others counted in the note); `p_holm` comes later."""
    a: dict[Any, Any] = {r["seed"]: r.get(metric) for r in group}
    b: dict[Any, Any] = {r["seed"]: r.get(metric) for r in ref_group}
    common = sorted(
        s
        for s in a.keys() & b.keys()
        if a[s] is not None and b[s] is not None and math.isfinite(a[s]) and math.isfinite(b[s])
    )
    result = paired_test([a[s] for s in common], [b[s] for s in common], level, bounds)
    unpaired = len((a.keys() | b.keys()) - set(common))
    note = result.note
    if unpaired:
        note = "; ".join(filter(None, [note, f"{unpaired} seed(s) without a pair"]))
    return {
        "metric": metric,
        "variant": group[0].get("variant"),
        "config_id": group[0]["config_id"],
        "swept": group[0].get("swept", "{}"),
        "reference": reference,
        "reference_config_id": ref_group[0]["config_id"],
        "reference_swept": ref_group[0].get("swept", "{}"),
        "n": result.n,
        "mean_diff": result.mean_diff,
        "sd_diff": result.sd_diff,
        "ci_low": result.low,
        "ci_high": result.high,
        "t": result.t,
        "df": result.df,
        "p_value": result.p_value,
        "level": level,
        "seeds": common,
        "differences": [a[s] - b[s] for s in common],
        "note": note,
        "clipped": result.clipped,
    }


def _add_holm(records: list[dict[str, Any]]) -> None:
    """Each record's `p_holm`: Holm's correction per metric over the comparisons against
    the same reference config."""
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


#: the columns of `paired_comparisons`
_PAIRED_SCHEMA = pa.schema(
    [
        ("metric", pa.string()),
        ("variant", pa.string()),
        ("config_id", pa.string()),
        ("swept", pa.string()),
        ("reference", pa.string()),
        ("reference_config_id", pa.string()),
        ("reference_swept", pa.string()),
        ("n", pa.int64()),
        ("mean_diff", pa.float64()),
        ("sd_diff", pa.float64()),
        ("ci_low", pa.float64()),
        ("ci_high", pa.float64()),
        ("t", pa.float64()),
        ("df", pa.int64()),
        ("p_value", pa.float64()),
        ("p_holm", pa.float64()),
        ("level", pa.float64()),
        ("seeds", pa.list_(pa.int64())),
        ("differences", pa.list_(pa.float64())),  # a - b per common seed
        ("note", pa.string()),
        ("clipped", pa.bool_()),
    ]
)
