"""The series the figures draw, from the collected rows (`analysis.stats` re-exports them): a
metric over a swept parameter, per-epoch curves with CIs, set-size fractions, per-class means.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from analysis.collect import PARAM_PREFIX
from analysis.intervals import DEFAULT_LEVEL, mean_ci, metric_bounds, table_rows


def _swept(row: Mapping[str, Any]) -> dict:
    try:
        return json.loads(row.get("swept") or "{}")
    except ValueError:
        return {}


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
    `x`) is kept as a flat reference line (a baseline such as CE); with several such configs
    (one per value of a param that varies among the configs on `x`, such as the study's
    version) each is drawn, labelled by what sets it apart. Params that no design sweeps but
    that differ between configs at one value of `x` split the lines too.
    """
    rows = [r for r in table_rows(summary) if r["metric"] == metric]
    if not rows:
        return []
    by_variant: dict[Any, list[dict]] = {}
    for row in rows:
        key = row.get(series_by) if series_by in row else row.get(PARAM_PREFIX + series_by)
        by_variant.setdefault(key, []).append(row)
    context, varying = _curve_context(rows, x)
    out: list[CurveSeries] = []
    for variant, vrows in by_variant.items():
        if any(x in _swept(r) for r in vrows):
            out += _variant_lines(variant, vrows, x)
        else:
            out += _baseline_lines(variant, vrows, context, varying)
    return out


def _curve_context(rows: Sequence[Mapping[str, Any]], x: str) -> tuple[dict[str, str], set[str]]:
    """({param: its JSON value} that every config on `x` shares (the curve's context), the
    other params that vary among the configs on `x`: a baseline may sit at any of their values)."""
    all_on_x = [r for r in rows if x in _swept(r)]
    context: dict[str, str] = {}
    if all_on_x:
        for key in {k for r in rows for k in _swept(r)} - {x}:
            values = {json.dumps(r.get(PARAM_PREFIX + key)) for r in all_on_x}
            if len(values) == 1:
                context[key] = values.pop()
    varying = {k for r in all_on_x for k in _swept(r)} - {x} - set(context)
    return context, varying


def _baseline_lines(
    variant: Any, vrows: Sequence[dict[str, Any]], context: Mapping[str, str], varying: set[str]
) -> list[CurveSeries]:
    """A variant with no config on x (a baseline): each config in the curve's context becomes
    a flat line, labelled by what sets it apart from the others when there are several."""
    candidates = [
        r
        for r in vrows
        if all(k in varying or (k in context and json.dumps(r.get(PARAM_PREFIX + k)) == context[k]) for k in _swept(r))
    ]
    labels = _distinct_labels(candidates, str(variant))
    return [CurveSeries(label, variant, [r], flat=True) for r, label in zip(candidates, labels)]


def _variant_lines(variant: Any, vrows: Sequence[dict[str, Any]], x: str) -> list[CurveSeries]:
    """A variant's lines on x: its configs on x split by their other params (swept, or hidden
    ones that differ), each joined by the variant's config that sits at the line's other
    values without sweeping x (a sensitivity design's base cell); points sorted by x."""
    xcol = PARAM_PREFIX + x
    on_x = [r for r in vrows if x in _swept(r)]
    others = sorted({k for r in on_x for k in _swept(r)} - {x})
    others += _hidden_splits(on_x, xcol, others)

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
            and json.dumps(row.get(PARAM_PREFIX + k)) == json.dumps(line[0].get(PARAM_PREFIX + k))
            for k in _swept(row)
            if k != x
        )
        xs = {json.dumps(r.get(xcol)) for r in line}
        if fits and row.get(xcol) is not None and json.dumps(row.get(xcol)) not in xs:
            line.append(row)
            used.add(row["config_id"])
    out = []
    for key, line in lines.items():
        label = str(variant)
        if others:
            label += ", " + ", ".join(f"{k}={_fmt_value(json.loads(v))}" for k, v in zip(others, key))
        line.sort(key=lambda r: _sort_key(r.get(xcol)))
        out.append(CurveSeries(label, variant, line))
    return out


def _differing(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> list[str]:
    """The param paths among `keys` whose value is not the same in every row."""
    return [k for k in keys if len({json.dumps(r.get(PARAM_PREFIX + k), sort_keys=True) for r in rows}) > 1]


def _hidden_splits(on_x: Sequence[Mapping[str, Any]], xcol: str, others: Sequence[str]) -> list[str]:
    """Params that no design sweeps but that differ between configs at one value of x on one
    line (two versions of a study, a changed base value): they split the line too, so that no
    line joins configs that differ in anything but x."""
    params = sorted(
        {k[len(PARAM_PREFIX) :] for r in on_x for k in r if k.startswith(PARAM_PREFIX) and k != xcol} - set(others)
    )
    points: dict[tuple, list] = {}
    for r in on_x:
        key = (json.dumps(r.get(xcol)),) + tuple(json.dumps(r.get(PARAM_PREFIX + k)) for k in others)
        points.setdefault(key, []).append(r)
    return [p for p in params if any(_differing(group, [p]) for group in points.values())]


def _distinct_labels(rows: Sequence[Mapping[str, Any]], name: str) -> list[str]:
    """A label per row: `name`, followed by the swept values (else the params) in which the
    rows differ when there are several."""
    if len(rows) < 2:
        return [name] * len(rows)
    swept_keys = sorted({k for r in rows for k in _swept(r)})
    keys = _differing(rows, swept_keys) or _differing(
        rows, sorted({k[len(PARAM_PREFIX) :] for r in rows for k in r if k.startswith(PARAM_PREFIX)})
    )
    return [
        name + (", " + ", ".join(f"{k}={_fmt_value(r.get(PARAM_PREFIX + k))}" for k in keys) if keys else "")
        for r in rows
    ]


def _sort_key(value: Any) -> tuple:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, str(value))


def _seed_values(group: Sequence[Mapping[str, Any]]) -> list[float]:
    """The finite `value`s of one (config, epoch)'s history rows, in seed order."""
    ordered = sorted(group, key=lambda r: r.get("seed") or 0)
    return [float(r["value"]) for r in ordered if r["value"] is not None and math.isfinite(r["value"])]


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
    (NaN bounds when n < 2, cut at the metric's bounds: `clipped`) and `values` (the finite
    per-seed values behind the mean, in seed order: the figures' strips), sorted by config
    then epoch. A config's seeds are replicates epoch by epoch, so n may drop at the last
    epochs of a config whose seeds stopped early.
    """
    rows = [r for r in table_rows(history) if r["metric"] == metric]
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["config_id"], int(row["epoch"])), []).append(row)
    out = []
    bounds = metric_bounds(metric)
    for (config_id, epoch), group in sorted(groups.items()):
        interval = mean_ci([r["value"] for r in group], level, method, n_boot=n_boot, seed=seed, bounds=bounds)
        out.append(
            {
                "config_id": config_id,
                "variant": group[0]["variant"],
                "swept": group[0]["swept"],
                "epoch": epoch,
                "n": interval.n,
                "mean": interval.mean,
                "ci_low": interval.low,
                "ci_high": interval.high,
                "clipped": interval.clipped,
                "values": _seed_values(group),
            }
        )
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
    for row in table_rows(sizes):
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
    rows = table_rows(per_class)
    sums: dict[str, dict[int, list]] = {}
    runs_of: dict[str, set] = {}
    for row in rows:
        run_id: Any = row.get("run_id")
        if run_id not in config_of_run or row.get(metric) is None:
            continue
        config_id = config_of_run[run_id]
        runs_of.setdefault(config_id, set()).add(run_id)
        entry = sums.setdefault(config_id, {}).setdefault(int(row["class"]), [int(row["train_count"]), 0.0, 0])
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
