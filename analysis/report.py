"""The report of a study: one self-contained HTML file and its Markdown twin.

`build_report(tracking_uri, study_name, out_dir, study_file=None)` reads the finished cells
from MLflow (`analysis.collect`), summarises them over seeds (`analysis.stats`), draws the
figures (`analysis.plots`) and writes into `out_dir`:

- `report.html`: everything inline (CSS, figures as base64 PNG), no external resource;
- `report.md`: the same content, figures as files in `figures/` (PNG and SVG);
- `figures/*.png`, `figures/*.svg`.

What is shown is chosen by the study file's `report` block (docs/interfaces.md section 6);
the study file is read with plain YAML. Keys understood (all optional):

```yaml
report:
  level: 0.95                  # confidence level of every interval
  ci: t                        # t (Student, n-1 df) | bootstrap (percentile, seeded)
  tables:                      # default: one table of the top-level test metrics
    - metrics: [test/top1, test/top5]
      title: "Top-K accuracy"  # optional
      columns: metrics         # metrics (one row per config) | variant (rows = context,
                               #   a column per variant and metric, as thesis Table 4.4)
      digits: 1                # decimals; default 1 for accuracies (in percent)
      swept: [data.label_noise]  # only configs that sweep nothing else (and base ones)
  curves:                      # default: the main test metric against each swept number
    - {x: loss.epsilon, metric: test/top5}
  epoch_time: {x: loss.k}      # or true; default when loss.k is swept
  shot_groups: [top5]          # bars of test/{few,medium,many}/top5; default when logged
  compare: {reference: ce, metrics: [test/top5]}   # default: the first variant
  learning_curves: [val/top5, train/top5]  # a per-epoch metric against the epoch, a line
                               #   per config (one request per run and metric; none by default)
  set_sizes: {ks: [5], by_shot: avg}  # or true / false; average-K set-size histograms
                               #   (thesis Fig. 5.4); default: every K of test/avg<K>
reference:                     # published numbers (percent), shown beside the reproduced
  source: "Thesis Table 4.4"
  rows:
    - {variant: ce, match: {data.label_noise: 0.0}, metrics: {test/top5: 94.2},
       ci: {test/top5: 0.1}}
```
"""

from __future__ import annotations

import base64
import datetime as _dt
import functools
import html
import importlib.metadata
import json
import math
import platform
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml

from analysis import plots
from analysis.layout import SET_SIZES_ARTIFACT, flatten_config
from analysis.collect import (
    MEAN_PREFIX,
    PARAM_PREFIX,
    Collected,
    add_history_means,
    collect,
    collect_histories,
    collect_per_class,
    display_uri,
)
from analysis.stats import (
    CI_METHODS,
    DEFAULT_LEVEL,
    epoch_curves,
    is_fraction_metric,
    set_size_fractions,
    lower_is_better,
    paired_comparisons,
    summarize,
)

PROVENANCE_PACKAGES = (
    "setvalued-studies", "mlflow", "numpy", "scipy", "pyarrow", "matplotlib", "pyyaml",
    "torch", "ray", "optuna",
)
MAX_FULL_ERRORS = 50


class ReportError(ValueError):
    """The study file or its `report`/`reference` block cannot be used (names file and path)."""


# ----------------------------------------------------------------------------- study file


@dataclass
class StudyInfo:
    """What the report needs from the study file (plain YAML, no validation beyond that)."""

    text: str | None
    origin: str
    data: dict = field(default_factory=dict)

    @property
    def report(self) -> dict:
        return self.data.get("report") or {}

    @property
    def reference(self) -> dict:
        return self.data.get("reference") or {}

    @property
    def variant_order(self) -> list[str]:
        variants = self.data.get("variants")
        return list(variants) if isinstance(variants, dict) else []

    def variant_paths(self) -> set[str]:
        """Dotted paths set by any variant overlay (they define a variant, not a context)."""
        paths: set[str] = set()
        variants = self.data.get("variants")
        if isinstance(variants, dict):
            for overlay in variants.values():
                if isinstance(overlay, dict):
                    paths |= set(flatten_config(overlay))
        return paths


def load_study_info(study_file: str | Path | None, collected: Collected) -> StudyInfo:
    """The study file given, else the `study.yaml` artifact of the study's parent run."""
    if study_file is not None:
        path = Path(study_file)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ReportError(f"study file {path}: cannot be read ({exc})") from exc
        origin = str(path)
    elif collected.study_yaml is not None:
        text, origin = collected.study_yaml, f"artifact study.yaml of run {collected.parent_run_id}"
    else:
        return StudyInfo(None, "none (no study file given and no study.yaml artifact)")
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ReportError(f"study file {origin}: not valid YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise ReportError(f"study file {origin}: the top level must be a mapping, "
                          f"got {type(data).__name__}")
    info = StudyInfo(text, origin, data)
    _validate_blocks(info)
    return info


def _expect(condition: bool, origin: str, path: str, expected: str, got: Any) -> None:
    if not condition:
        raise ReportError(f"study file {origin}: `{path}` must be {expected}, got {got!r}")


def _validate_blocks(info: StudyInfo) -> None:
    origin, report = info.origin, info.data.get("report")
    if report is not None:
        _expect(isinstance(report, dict), origin, "report", "a mapping", report)
        if "level" in report:
            level = report["level"]
            _expect(isinstance(level, (int, float)) and 0 < level < 1, origin,
                    "report.level", "a number in (0, 1) such as 0.95", level)
        if "ci" in report:
            _expect(report["ci"] in CI_METHODS, origin, "report.ci",
                    f"one of {list(CI_METHODS)}", report["ci"])
        for i, table in enumerate(report.get("tables") or []):
            where = f"report.tables[{i}]"
            _expect(isinstance(table, dict), origin, where, "a mapping with `metrics`", table)
            metrics = table.get("metrics")
            _expect(isinstance(metrics, list) and metrics and all(
                isinstance(m, str) for m in metrics), origin, f"{where}.metrics",
                "a non-empty list of metric names such as [test/top5]", metrics)
            _expect(table.get("columns", "metrics") in ("metrics", "variant"), origin,
                    f"{where}.columns", "`metrics` or `variant`", table.get("columns"))
            if "swept" in table:
                swept = table["swept"]
                _expect(isinstance(swept, str) or (isinstance(swept, list) and all(
                    isinstance(p, str) for p in swept)), origin, f"{where}.swept",
                    "a dotted parameter path or a list of them", swept)
            if "digits" in table:
                _expect(isinstance(table["digits"], int) and 0 <= table["digits"] <= 6,
                        origin, f"{where}.digits", "an integer in [0, 6]", table["digits"])
        for i, curve in enumerate(report.get("curves") or []):
            where = f"report.curves[{i}]"
            _expect(isinstance(curve, dict) and isinstance(curve.get("x"), str)
                    and isinstance(curve.get("metric"), str), origin, where,
                    "a mapping {x: <dotted param>, metric: <metric>}", curve)
        if "learning_curves" in report:
            learning = report["learning_curves"]
            _expect(isinstance(learning, list) and all(isinstance(m, str) for m in learning),
                    origin, "report.learning_curves",
                    "a list of per-epoch metric names such as [val/top5, train/loss]", learning)
        if report.get("set_sizes") is not None:
            spec = report["set_sizes"]
            _expect(isinstance(spec, bool) or (isinstance(spec, dict) and set(spec) <= {"ks", "by_shot"}),
                    origin, "report.set_sizes", "true, false or a mapping {ks: [5], by_shot: <variant>}",
                    spec)
            ks = spec.get("ks", [1]) if isinstance(spec, dict) else [1]
            _expect(isinstance(ks, list) and all(isinstance(k, (int, float)) and not isinstance(k, bool)
                                                 and k > 0 for k in ks), origin, "report.set_sizes.ks",
                    "a list of average-K values such as [5]", ks)
        compare = report.get("compare")
        if compare is not None:
            _expect(isinstance(compare, dict), origin, "report.compare",
                    "a mapping {reference: <variant>, metrics: [...]}", compare)
    reference = info.data.get("reference")
    if reference is not None:
        _expect(isinstance(reference, dict), origin, "reference",
                "a mapping {source, rows}", reference)
        for i, row in enumerate(reference.get("rows") or []):
            where = f"reference.rows[{i}]"
            _expect(isinstance(row, dict), origin, where,
                    "a mapping {variant, match, metrics, ci}", row)
            _expect(isinstance(row.get("metrics"), dict) and all(
                isinstance(v, (int, float)) for v in row["metrics"].values()), origin,
                f"{where}.metrics", "a mapping metric -> number (percent)", row.get("metrics"))
            for key in ("match", "ci"):
                _expect(row.get(key) is None or isinstance(row.get(key), dict), origin,
                        f"{where}.{key}", "a mapping", row.get(key))


# ----------------------------------------------------------------------------- formatting


def _auto_digits(values: Sequence[float]) -> int:
    finite = [abs(v) for v in values if v is not None and math.isfinite(v) and v != 0]
    if not finite:
        return 2
    magnitude = math.floor(math.log10(max(finite)))
    return max(0, min(4, 2 - magnitude))


def format_mean_ci(mean: float, half_width: float, digits: int) -> str:
    """`94.4 ± 0.1` (the papers' layout); just the mean when there is no interval."""
    if mean is None or not math.isfinite(mean):
        return "–"
    if half_width is None or not math.isfinite(half_width):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {half_width:.{digits}f}"


def _value_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.1f}" if value.is_integer() and abs(value) < 1e6 else f"{value:g}"
    if isinstance(value, str):
        return value
    return json.dumps(value)


@dataclass
class Cell:
    text: str
    bold: bool = False
    muted: bool = False


@dataclass
class Grid:
    """A rendered table: header, rows of cells, a caption."""

    title: str
    header: list[str]
    rows: list[list[Cell]]
    caption: str = ""
    label_columns: int = 1


def _swept(row: Mapping[str, Any]) -> dict:
    return json.loads(row.get("swept") or "{}")


class _Context:
    """Everything the sections share: collected rows, summary, study, options."""

    def __init__(self, collected: Collected, study: StudyInfo, level: float, method: str,
                 n_boot: int):
        self.collected = collected
        self.study = study
        self.level = level
        self.method = method
        self.n_boot = n_boot
        self.rows = collected.table.to_pylist()
        self.metric_names = collected.metric_columns
        order = study.variant_order
        seen = list(dict.fromkeys(r["variant"] for r in self.rows))
        self.variants = [v for v in order if v in seen] + sorted(
            (v for v in seen if v not in order), key=str)
        self.swept_paths = list(dict.fromkeys(k for r in self.rows for k in _swept(r)))
        self._summaries: dict[tuple, list[dict]] = {}
        self.notes: list[str] = []

    def summary(self, metrics: Sequence[str]) -> list[dict]:
        metrics = [m for m in metrics if m in self.metric_names]
        key = tuple(metrics)
        if key not in self._summaries:
            self._summaries[key] = summarize(
                self.rows, metrics, self.level, self.method, n_boot=self.n_boot
            ).to_pylist() if metrics and self.rows else []
        return self._summaries[key]

    def config_order(self, summary_rows: Sequence[Mapping]) -> list[str]:
        def key(row):
            variant_rank = self.variants.index(row["variant"]) if row["variant"] in \
                self.variants else len(self.variants)
            swept = _swept(row)
            values = []
            for path in self.swept_paths:
                value = row.get(PARAM_PREFIX + path, swept.get(path))
                values.append((0, float(value), "") if isinstance(value, (int, float))
                              and not isinstance(value, bool) else (1, 0.0, str(value)))
            return (variant_rank, values)

        firsts: dict[str, Mapping] = {}
        for row in summary_rows:
            firsts.setdefault(row["config_id"], row)
        return [c for c, _ in sorted(firsts.items(), key=lambda item: key(item[1]))]

    def primary_metric(self) -> str | None:
        objective = (self.study.data.get("objective") or {}).get("metric")
        candidates = []
        if isinstance(objective, str):
            candidates += ["test/" + objective.split("/", 1)[1] if "/" in objective
                           else objective, objective]
        candidates += ["test/top5", "test/avg5", "test/top1"]
        for candidate in candidates:
            if candidate in self.metric_names:
                return candidate
        tests = sorted(m for m in self.metric_names if m.startswith("test/"))
        return tests[0] if tests else None


# ----------------------------------------------------------------------------- reference


def _reference_row_matches(ref: Mapping, row: Mapping[str, Any]) -> bool:
    """Whether a `reference.rows` entry describes this config (its variant and `match`)."""
    if ref.get("variant") is not None and ref["variant"] != row.get("variant"):
        return False
    for path, expected in (ref.get("match") or {}).items():
        actual = row.get(PARAM_PREFIX + path, _swept(row).get(path))
        if isinstance(expected, (int, float)) and not isinstance(expected, bool) \
                and isinstance(actual, (int, float)) and not isinstance(actual, bool):
            if not math.isclose(float(actual), float(expected), rel_tol=1e-9, abs_tol=1e-12):
                return False
        elif actual != expected:
            return False
    return True


def _reference_value(study: StudyInfo, row: Mapping[str, Any], metric: str
                     ) -> tuple[str, str] | None:
    """(text, source) of the published number for this config and metric, if any."""
    reference = study.reference
    for ref in reference.get("rows") or []:
        if not _reference_row_matches(ref, row) or metric not in (ref.get("metrics") or {}):
            continue
        value = float(ref["metrics"][metric])
        ci = (ref.get("ci") or {}).get(metric)
        digits = max(1, _decimals(ref["metrics"][metric]), _decimals(ci) if ci is not None
                     else 0)
        text = format_mean_ci(value, float(ci) if ci is not None else math.nan, digits)
        return text, str(reference.get("source") or "reference")
    return None


def _decimals(number: Any) -> int:
    text = repr(float(number)) if not isinstance(number, str) else number
    if "e" in text or "." not in text:
        return 0
    return len(text.split(".")[1].rstrip("0"))


def _unmatched_reference_rows(ctx: _Context) -> list[str]:
    """Reference rows that no finished config matches (a typo in `match`, or not run)."""
    notes = []
    configs = list({r["config_id"]: r for r in ctx.rows}.values())
    for i, ref in enumerate(ctx.study.reference.get("rows") or []):
        if not any(_reference_row_matches(ref, row) for row in configs):
            notes.append(f"Reference row {i} ({ref.get('variant')}, match "
                         f"{ref.get('match') or {}}) matches no finished config: its numbers "
                         f"are not shown.")
    return notes


# ----------------------------------------------------------------------------- tables


def _table_specs(ctx: _Context) -> list[dict]:
    specs = ctx.study.report.get("tables")
    if specs:
        return [dict(s) for s in specs]
    tests = sorted(m for m in ctx.metric_names if m.startswith("test/") and m.count("/") == 1)
    extra = [m for m in ("best_val",) if m in ctx.metric_names]
    if not tests + extra:
        return []
    return [{"metrics": tests + extra, "title": "Final test metrics (default table)"}]


def _digits_for(metric: str, spec: Mapping, values: Sequence[float]) -> int:
    if "digits" in spec:
        return int(spec["digits"])
    return 1 if is_fraction_metric(metric) else _auto_digits(values)


def _bold_flags(means: Sequence[float], metric: str, digits: int,
                ns: Sequence[int] | None = None) -> list[bool]:
    """Best mean (at the shown precision) per column. Cells with a single seed compete only
    when no cell has two or more seeds: a one-seed mean is not called the best."""
    finite = [(i, m) for i, m in enumerate(means) if m is not None and math.isfinite(m)]
    if ns is not None and any(ns[i] >= 2 for i, _ in finite):
        finite = [(i, m) for i, m in finite if ns[i] >= 2]
    if len(finite) < 2:
        return [False] * len(means)
    pick = min if lower_is_better(metric) else max
    best = round(pick(m for _, m in finite), digits)
    keep = {i for i, _ in finite}
    return [i in keep and round(m, digits) == best for i, m in enumerate(means)]


def _seed_caption(ctx: _Context, summary_rows: Sequence[Mapping]) -> tuple[str, int | None]:
    ns = [r["n"] for r in summary_rows if r["n"] > 0]
    seeds = sorted({s for r in summary_rows for s in (r["seeds"] or [])})
    if not ns:
        return "no finished seed", None
    typical = max(set(ns), key=ns.count)
    method = ("Student's t on n−1 degrees of freedom" if ctx.method == "t"
              else f"percentile bootstrap, {ctx.n_boot} resamples")
    if min(ns) == max(ns):
        n_text = f"n = {typical} seed{'s' if typical != 1 else ''} per cell"
    else:
        n_text = (f"n = {min(ns)} to {max(ns)} seeds per cell (cells with n ≠ {typical} "
                  f"show their n)")
    shown = ("Mean ± half-width of the" if ctx.method == "t"
             else "Mean [bounds] of the")
    text = (f"{shown} {ctx.level:.0%} confidence interval over seeds "
            f"({method}); {n_text}; seeds {', '.join(map(str, seeds))}. Accuracies in percent. "
            f"n = 1 gives no interval (mean only). Bold: best mean of the column"
            f"{' (among cells with n ≥ 2)' if min(ns) < 2 <= max(ns) else ''}.")
    return text, typical


def _scaled(row: Mapping, metric: str) -> tuple[float, float]:
    factor = 100.0 if is_fraction_metric(metric) else 1.0
    mean = row["mean"] * factor if row["mean"] is not None else math.nan
    half = row["half_width"] * factor if row["half_width"] is not None else math.nan
    return mean, half


def _value_cell(row: Mapping | None, metric: str, digits: int, typical_n: int | None,
                bold: bool) -> Cell:
    if row is None or row["n"] == 0:
        return Cell("–", muted=True)
    mean, half = _scaled(row, metric)
    if row.get("method") == "bootstrap" and not row["no_interval"]:
        # a percentile-bootstrap interval is not symmetric: show its bounds
        factor = 100.0 if is_fraction_metric(metric) else 1.0
        text = (f"{mean:.{digits}f} [{row['ci_low'] * factor:.{digits}f}, "
                f"{row['ci_high'] * factor:.{digits}f}]")
    else:
        text = format_mean_ci(mean, half, digits)
    if typical_n is not None and row["n"] != typical_n:
        text += f" (n={row['n']})"
    return Cell(text, bold=bold)


def _only_swept(summary: list[dict], spec: Mapping) -> list[dict]:
    """The rows of configs whose swept params are all in `spec["swept"]` (when given)."""
    allowed = spec.get("swept")
    if allowed is None:
        return summary
    allowed = {allowed} if isinstance(allowed, str) else set(allowed)
    return [r for r in summary if set(_swept(r)) <= allowed]


def _n_range_text(ns: set[int]) -> str:
    if not ns:
        return "0"
    low, high = min(ns), max(ns)
    return str(low) if low == high else f"{low}–{high}"


def _table_summary(ctx: _Context, spec: Mapping, title: str) -> tuple[list[str], list] | None:
    """The logged metrics of a table spec and their per-config summary (restricted to the
    spec's `swept` paths); None, with a note saying why, when the table would be empty."""
    wanted = list(spec["metrics"])
    metrics = [m for m in wanted if m in ctx.metric_names]
    if not metrics:
        ctx.notes.append(f"{title}: none of the metrics {wanted} was logged by a finished cell")
        return None
    summary = _only_swept(ctx.summary(metrics), spec)
    if not summary:
        ctx.notes.append(f"{title}: no finished config sweeps only {spec.get('swept')}")
        return None
    return metrics, summary


def metrics_table(ctx: _Context, spec: Mapping, index: int) -> Grid | None:
    """One row per config, one column per metric (plus the paper's number beside it)."""
    wanted = list(spec["metrics"])
    missing = [m for m in wanted if m not in ctx.metric_names]
    title = spec.get("title") or f"Table {index + 1}: " + ", ".join(wanted)
    found = _table_summary(ctx, spec, title)
    if found is None:
        return None
    metrics, summary = found
    by_key = {(r["config_id"], r["metric"]): r for r in summary}
    configs = ctx.config_order(summary)
    first = {c: by_key[(c, metrics[0])] for c in configs}
    swept_cols = [p for p in ctx.swept_paths
                  if any(p in _swept(first[c]) for c in configs)]
    sweeping = {(first[c]["variant"], p) for c in configs for p in _swept(first[c])}
    caption, typical = _seed_caption(ctx, summary)

    ref_metrics = [m for m in metrics if any(
        _reference_value(ctx.study, first[c], m) for c in configs)]
    header = ["variant"] + swept_cols
    for m in metrics:
        header.append(m)
        if m in ref_metrics:
            header.append(f"{m} (paper)")
    header.append("seeds")

    digits = {m: _digits_for(m, spec, [_scaled(by_key[(c, m)], m)[0] for c in configs])
              for m in metrics}
    bold = {m: _bold_flags([_scaled(by_key[(c, m)], m)[0] for c in configs], m, digits[m],
                           [by_key[(c, m)]["n"] for c in configs])
            for m in metrics}
    rows = []
    sources = set()
    for i, config_id in enumerate(configs):
        row0 = first[config_id]
        cells = [Cell(str(row0["variant"]))]
        for path in swept_cols:
            if path in _swept(row0) or (row0["variant"], path) in sweeping:
                cells.append(Cell(_value_text(row0.get(PARAM_PREFIX + path,
                                                        _swept(row0).get(path)))))
            else:
                cells.append(Cell("–", muted=True))
        ns = set()
        for m in metrics:
            r = by_key.get((config_id, m))
            cells.append(_value_cell(r, m, digits[m], typical, bold[m][i]))
            if r is not None and r["n"]:
                ns.add(r["n"])
            if m in ref_metrics:
                ref = _reference_value(ctx.study, row0, m)
                cells.append(Cell(ref[0] if ref else "", muted=True))
                if ref:
                    sources.add(ref[1])
        cells.append(Cell(_n_range_text(ns)))
        rows.append(cells)
    if sources:
        caption += " (paper): published numbers from " + "; ".join(sorted(sources)) + "."
    if missing:
        caption += f" Not logged by any finished cell: {', '.join(missing)}."
    return Grid(title, header, rows, caption, label_columns=1 + len(swept_cols))


def variant_table(ctx: _Context, spec: Mapping, index: int) -> Grid | None:
    """Rows = context (the swept values), a column per variant (and metric), thesis Table 4.4.

    Bold marks the best variant of each row for each metric.
    """
    wanted = list(spec["metrics"])
    title = spec.get("title") or f"Table {index + 1}: " + ", ".join(wanted) + " by variant"
    found = _table_summary(ctx, spec, title)
    if found is None:
        return None
    metrics, summary = found
    variants = [v for v in ctx.variants if any(r["variant"] == v for r in summary)]
    caption, typical = _seed_caption(ctx, summary)
    caption = caption.replace("best mean of the column", "best variant of the row")
    contexts: dict[str, dict[tuple[str, str], Mapping]] = {}
    for config_id in ctx.config_order(summary):
        for r in summary:
            if r["config_id"] != config_id:
                continue
            contexts.setdefault(r["swept"], {})[(r["variant"], r["metric"])] = r
    context_paths = list(dict.fromkeys(k for s in contexts for k in json.loads(s)))

    def context_sort(item):
        swept = json.loads(item[0])
        return [(0, float(swept[p]), "") if isinstance(swept.get(p), (int, float))
                else (1, 0.0, str(swept.get(p))) for p in context_paths]

    ordered = sorted(contexts.items(), key=context_sort)
    columns = [(v, m) for m in metrics for v in variants]
    with_ref = {(v, m) for (v, m) in columns for _, cells in ordered
                if (v, m) in cells and _reference_value(ctx.study, cells[(v, m)], m)}
    header = list(context_paths) or ["config"]
    for v, m in columns:
        header.append(v if len(metrics) == 1 else f"{v}: {m}")
        if (v, m) in with_ref:
            header.append(f"{v} (paper)" if len(metrics) == 1 else f"{v}: {m} (paper)")
    rows, sources = [], set()
    for swept_text, cells_by in ordered:
        swept = json.loads(swept_text)
        row = [Cell(_value_text(swept[p]) if p in swept else "–") for p in context_paths] \
            or [Cell("(no swept parameter)")]
        digits = {m: _digits_for(m, spec, [_scaled(r, m)[0] for (v, mm), r in cells_by.items()
                                           if mm == m]) for m in metrics}
        bold = {}
        for m in metrics:
            means = [_scaled(cells_by[(v, m)], m)[0] if (v, m) in cells_by else math.nan
                     for v in variants]
            ns = [cells_by[(v, m)]["n"] if (v, m) in cells_by else 0 for v in variants]
            bold.update({(v, m): flag for v, flag in zip(variants, _bold_flags(
                means, m, digits[m], ns))})
        for v, m in columns:
            r = cells_by.get((v, m))
            row.append(_value_cell(r, m, digits[m], typical, bold[(v, m)]))
            if (v, m) in with_ref:
                ref = _reference_value(ctx.study, r, m) if r is not None else None
                row.append(Cell(ref[0] if ref else "", muted=True))
                if ref:
                    sources.add(ref[1])
        rows.append(row)
    if sources:
        caption += " (paper): published numbers from " + "; ".join(sorted(sources)) + "."
    return Grid(title, header, rows, caption, label_columns=max(1, len(context_paths)))


# ----------------------------------------------------------------------------- comparisons


def comparison_table(ctx: _Context, table_metrics: Sequence[str]) -> tuple[Grid | None, str]:
    compare = ctx.study.report.get("compare") or {}
    if len(ctx.variants) < 2:
        return None, "Fewer than two variants finished: no paired comparison."
    reference = compare.get("reference") or ctx.variants[0]
    if reference not in ctx.variants:
        raise ReportError(f"study file {ctx.study.origin}: `report.compare.reference` names "
                          f"variant {reference!r}, which has no finished cell; finished "
                          f"variants: {ctx.variants}")
    metrics = [m for m in (compare.get("metrics") or table_metrics) if m in ctx.metric_names]
    if not metrics:
        return None, "No metric to compare."
    result = paired_comparisons(ctx.rows, metrics, reference, ctx.level,
                                variant_paths=ctx.study.variant_paths()).to_pylist()
    order = {c: i for i, c in enumerate(ctx.config_order(ctx.rows))}
    result.sort(key=lambda r: (metrics.index(r["metric"]), order.get(r["config_id"], 0),
                               order.get(r["reference_config_id"], 0)))
    if not result:
        return None, (f"No config of another variant shares its context with a config of "
                      f"{reference!r}: nothing to pair.")
    header = ["metric", "variant", "config", f"vs {reference}", "pairs (seeds)",
              f"mean difference [{ctx.level:.0%} CI]", "p (paired t)", "p (Holm)", "note"]
    rows = []
    for r in result:
        factor = 100.0 if is_fraction_metric(r["metric"]) else 1.0
        digits = 2 if factor == 100.0 else _auto_digits([r["mean_diff"]]) + 1
        if math.isfinite(r["mean_diff"]):
            diff = f"{r['mean_diff'] * factor:+.{digits}f}"
            if r["ci_low"] is not None and math.isfinite(r["ci_low"]):
                diff += (f" [{r['ci_low'] * factor:+.{digits}f}, "
                         f"{r['ci_high'] * factor:+.{digits}f}]")
        else:
            diff = "–"
        rows.append([
            Cell(r["metric"]), Cell(r["variant"]), Cell(_swept_text(r["swept"])),
            Cell(_swept_text(r["reference_swept"])),
            Cell(f"{r['n']} ({', '.join(map(str, r['seeds']))})"),
            Cell(diff, bold=_significant(r["p_holm"], ctx.level)),
            Cell(_p_text(r["p_value"])), Cell(_p_text(r["p_holm"])),
            Cell(r["note"] or ""),
        ])
    caption = (f"Each variant's config minus the matching config of the reference variant "
               f"{reference!r} (same context: every parameter equal except those that define "
               f"a variant), paired by seed; differences of accuracies in percentage points. "
               f"Paired t-test on n−1 df, two-sided; Holm's correction over the variants "
               f"compared with the same reference config, per metric. Bold: Holm-adjusted "
               f"p < {1 - ctx.level:.2g}.")
    return Grid(f"Each variant against {reference!r}", header, rows, caption,
                label_columns=4), ""


def _significant(p: float, level: float) -> bool:
    return p is not None and math.isfinite(p) and p < 1 - level


def _p_text(p: float | None) -> str:
    if p is None or not math.isfinite(p):
        return "–"
    return f"{p:.3g}" if p >= 1e-4 else f"{p:.1e}"


def _swept_text(swept_json: str) -> str:
    swept = json.loads(swept_json or "{}")
    if not swept:
        return "(base)"
    return ", ".join(f"{k}={_value_text(v)}" for k, v in sorted(swept.items()))


# ----------------------------------------------------------------------------- figures


@dataclass
class FigureFile:
    title: str
    png: Path
    svg: Path
    caption: str = ""


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:80] or "figure"


def _numeric_swept_paths(ctx: _Context) -> list[str]:
    out = []
    for path in ctx.swept_paths:
        values = {json.dumps(_swept(r)[path]) for r in ctx.rows if path in _swept(r)}
        parsed = [json.loads(v) for v in values]
        if len(parsed) >= 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                    for v in parsed):
            out.append(path)
    return out


def _add_figure(figures: list[FigureFile], skipped: list[str], what: str, title: str,
                caption: str, draw: Callable[[], Sequence[Path]]) -> None:
    """Draw one figure (PNG, SVG) into `figures`; a ValueError of the drawing (nothing to
    draw) goes to `skipped` with `what` instead, so the report says why it is missing."""
    try:
        png, svg = draw()
    except ValueError as exc:
        skipped.append(f"{what}: {exc}")
        return
    figures.append(FigureFile(title, png, svg, caption))


def build_figures(ctx: _Context, figures_dir: Path) -> tuple[list[FigureFile], list[str]]:
    report = ctx.study.report
    figures: list[FigureFile] = []
    skipped: list[str] = []
    level_text = f"{ctx.level:.0%} CI"

    curve_specs = report.get("curves")
    if curve_specs is None:
        primary = ctx.primary_metric()
        curve_specs = [{"x": p, "metric": primary} for p in _numeric_swept_paths(ctx)] \
            if primary else []
    for i, spec in enumerate(curve_specs):
        x, metric = spec["x"], spec["metric"]
        name = f"curve_{i + 1}_{_slug(metric)}_vs_{_slug(x)}"
        if metric not in ctx.metric_names:
            skipped.append(f"curve {metric} vs {x}: {metric} was not logged by a finished cell")
            continue
        if x == "data.label_noise":
            draw = functools.partial(plots.metric_vs_label_noise, ctx.summary([metric]), metric,
                                     figures_dir / name, x=x)
        else:
            draw = functools.partial(plots.sensitivity_curve, ctx.summary([metric]), x, metric,
                                     figures_dir / name)
        _add_figure(figures, skipped, f"curve {metric} vs {x}", f"{metric} vs {x}",
                    f"Mean over seeds; band: {level_text}; dashed: a variant with a single "
                    f"config (not swept on {x}).", draw)

    learning = report.get("learning_curves") or []
    histories = collect_histories(ctx.collected, learning) if learning and ctx.rows else None
    for metric in learning:
        curves = epoch_curves(histories, metric, ctx.level, ctx.method, n_boot=ctx.n_boot) \
            if histories is not None else []
        if not curves:
            skipped.append(f"learning curve of {metric}: no finished cell logged it per epoch")
            continue
        _add_figure(figures, skipped, f"learning curve of {metric}", f"{metric} over the epochs",
                    f"Mean over seeds at each epoch, a line per config; band: {level_text}.",
                    functools.partial(plots.learning_curves, curves, metric,
                                      figures_dir / f"learning_{_slug(metric)}",
                                      order=ctx.config_order(curves), level=ctx.level))

    epoch_spec = report.get("epoch_time")
    if epoch_spec is None and "loss.k" in ctx.swept_paths:
        epoch_spec = True
    if epoch_spec:
        x = epoch_spec.get("x", "loss.k") if isinstance(epoch_spec, dict) else "loss.k"
        if "epoch_time_s" not in ctx.metric_names:
            skipped.append("epoch time vs K: epoch_time_s was not logged")
        else:
            add_history_means(ctx.collected, ["epoch_time_s"])
            ctx.rows = ctx.collected.table.to_pylist()
            ctx.metric_names = ctx.collected.metric_columns
            ctx._summaries.clear()
            _add_figure(figures, skipped, "epoch time vs K", "Epoch time vs K",
                        f"Mean epoch wall time over the epochs of each run, then mean over "
                        f"seeds; band: {level_text}.",
                        functools.partial(plots.epoch_time_vs_k,
                                          ctx.summary([MEAN_PREFIX + "epoch_time_s"]),
                                          figures_dir / "epoch_time_vs_k", x=x))

    figures += _set_size_figures(ctx, figures_dir, skipped)

    shot_specs = report.get("shot_groups")
    if shot_specs is None:
        primary = ctx.primary_metric()
        base = primary.split("/", 1)[1] if primary and primary.startswith("test/") else None
        shot_specs = [base] if base and f"test/few/{base}" in ctx.metric_names else []
    for spec in shot_specs:
        base = spec.get("metric") if isinstance(spec, dict) else spec
        split = spec.get("split", "test") if isinstance(spec, dict) else "test"
        metrics = [f"{split}/{g}/{base}" for g in plots.SHOT_GROUPS]
        summary = ctx.summary(metrics)
        _add_figure(figures, skipped, f"shot-group bars of {base}", f"{split}/{base} per shot group",
                    f"few < 20 ≤ medium ≤ 100 < many training images per class; error bars: "
                    f"{level_text}.",
                    functools.partial(plots.shot_group_bars, summary, base,
                                      figures_dir / f"shot_groups_{_slug(base)}",
                                      split=split, order=ctx.config_order(summary)))
    return figures, skipped


_AVGK_METRIC = re.compile(r"^test/avg(?P<k>[0-9]+(?:\.[0-9]+)?)$")


def _set_size_figures(ctx: _Context, figures_dir: Path, skipped: list[str]) -> list[FigureFile]:
    """Thesis Fig. 5.4 for every average-K of the study: the set sizes of each config on
    test (configs selected on that K, where some are) and of one config by shot group."""
    spec = ctx.study.report.get("set_sizes")
    logged = [m["k"] for m in map(_AVGK_METRIC.match, ctx.metric_names) if m]
    if spec is False or (spec is None and not logged):
        return []
    spec = spec if isinstance(spec, dict) else {}
    ks = [f"{float(k):g}" for k in spec.get("ks", logged)]
    rows = [r for r in ctx.rows if any(r.get(f"test/avg{k}") is not None for k in ks)]
    try:
        sizes = collect_per_class(ctx.collected.tracking_uri, [r["run_id"] for r in rows],
                                  SET_SIZES_ARTIFACT)
    except Exception as exc:  # runs from before the artifact existed, or a broken store
        skipped.append(f"set-size histograms: cannot read {SET_SIZES_ARTIFACT} ({exc})")
        return []
    figures = []
    for k in ks:
        rows_k = [r for r in rows if r.get(f"test/avg{k}") is not None]
        selected = [r for r in rows_k if str(r.get(PARAM_PREFIX + "eval.selection", "")).endswith(f"avg{k}")]
        rows_k = selected or rows_k
        fractions = set_size_fractions(sizes, {r["run_id"]: r["config_id"] for r in rows_k}, k)
        summary = [r for r in ctx.summary([f"test/avg{k}"]) if (r["config_id"], "all") in fractions]
        if not summary:
            skipped.append(f"set sizes of average-{k}: no run stored them")
            continue
        labels = {r["config_id"]: plots.config_label(r) for r in summary}
        shown, which = summary, "every config"
        if len(shown) > plots.MAX_LINES:  # too many lines: each variant's best config
            best_of: dict[str, dict] = {}
            for r in summary:
                if r["variant"] not in best_of or r["mean"] > best_of[r["variant"]]["mean"]:
                    best_of[r["variant"]] = r
            shown = sorted(best_of.values(), key=lambda r: -r["mean"])[:plots.MAX_LINES]
            which = f"the best config (mean test/avg{k}) of each variant"
        by_config = [(f"{labels[c]} (n={fractions[(c, 'all')]['n']})", fractions[(c, "all")]["fractions"])
                     for c in ctx.config_order(shown)]
        wanted = spec.get("by_shot")
        candidates = [r for r in summary if wanted is None or r["variant"] == wanted]
        if not candidates:
            skipped.append(f"set sizes of average-{k} by shot group: no config of variant {wanted!r}")
        best = max(candidates, key=lambda r: r["mean"]) if candidates else None
        by_shot = [(f"{g} (n={fractions[(best['config_id'], g)]['n']})",
                    fractions[(best["config_id"], g)]["fractions"])
                   for g in plots.SHOT_GROUPS if best and (best["config_id"], g) in fractions]
        chosen = "the variant asked for" if wanted else f"the best mean test/avg{k}"
        _add_figure(figures, skipped, f"set sizes of average-{k}", f"Average-{k} set sizes on test",
                    f"Share of test inputs per set size, mean over seeds, for {which}; the last "
                    f"bin gathers the larger sets. (b) is the config with {chosen}, split by the "
                    f"shot group of the label (few < 20 ≤ medium ≤ 100 < many training images).",
                    functools.partial(plots.set_size_histograms, by_config, by_shot, k,
                                      figures_dir / f"set_sizes_avg{_slug(k)}",
                                      shot_config=labels[best["config_id"]] if best else ""))
    return figures


# ----------------------------------------------------------------------------- provenance


def _git_commit(root: Path) -> str:
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                                capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return "not available (not a git checkout)"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        suffix = " (with uncommitted changes)" if dirty.stdout.strip() else ""
        return commit.stdout.strip() + suffix
    except (OSError, subprocess.SubprocessError):
        return "not available (git not found)"


def provenance(ctx: _Context) -> list[tuple[str, str]]:
    versions = []
    for package in PROVENANCE_PACKAGES:
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    collected = ctx.collected
    return [
        ("date (UTC)", _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")),
        ("MLflow tracking URI", display_uri(collected.tracking_uri)),
        ("MLflow experiment", f"{collected.study_name} (id {collected.experiment_id})"),
        ("parent run", collected.parent_run_id or "none found"),
        ("cell runs", f"{collected.n_runs} runs; {collected.table.num_rows} finished cells; "
                      f"{collected.failed.num_rows} failed or unfinished cells"),
        ("study file", ctx.study.origin),
        ("project git commit", _git_commit(Path(__file__).resolve().parent.parent)),
        ("python", platform.python_version()),
        ("packages", ", ".join(versions)),
        ("intervals", f"{ctx.level:.0%}, " + ("Student's t on n−1 df" if ctx.method == "t"
                                               else f"percentile bootstrap ({ctx.n_boot})")),
    ]


# ----------------------------------------------------------------------------- rendering


_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:2em auto;max-width:1100px;
padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em}h2{font-size:1.25em;border-bottom:1px solid #ddd;padding-bottom:.2em;
margin-top:1.8em}table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th{background:#f3f3f3}td.label,th.label{text-align:left}td.muted{color:#888}
caption{caption-side:bottom;text-align:left;font-size:.85em;color:#555;padding:.4em 0}
pre{background:#f7f7f7;border:1px solid #e3e3e3;padding:.6em;overflow-x:auto;font-size:.85em}
figure{margin:1em 0}figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:.85em;color:#555}dl{display:grid;grid-template-columns:max-content auto;
gap:.2em 1em}dt{font-weight:600}dd{margin:0}.note{color:#8a5300}
"""


def _html_table(grid: Grid) -> str:
    label_columns = grid.label_columns
    out = ["<table>", f"<caption>{html.escape(grid.caption)}</caption>", "<thead><tr>"]
    for i, head in enumerate(grid.header):
        cls = ' class="label"' if i < label_columns else ""
        out.append(f"<th{cls}>{html.escape(head)}</th>")
    out.append("</tr></thead><tbody>")
    for row in grid.rows:
        out.append("<tr>")
        for i, cell in enumerate(row):
            classes = (["label"] if i < label_columns else []) + (["muted"] if cell.muted
                                                                  else [])
            cls = f' class="{" ".join(classes)}"' if classes else ""
            text = html.escape(cell.text)
            out.append(f"<td{cls}>{'<strong>' + text + '</strong>' if cell.bold else text}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _md_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _md_table(grid: Grid) -> str:
    lines = ["| " + " | ".join(_md_escape(h) for h in grid.header) + " |",
             "|" + "|".join("---" for _ in grid.header) + "|"]
    for row in grid.rows:
        cells = [f"**{_md_escape(c.text)}**" if c.bold and c.text else _md_escape(c.text)
                 for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    if grid.caption:
        lines += ["", f"*{_md_escape(grid.caption)}*"]
    return "\n".join(lines)


def _fence(text: str, language: str = "") -> str:
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}{language}\n{text.rstrip()}\n{fence}"


class _Document:
    """Builds the HTML and Markdown versions side by side."""

    def __init__(self, title: str):
        self.title = title
        self.html: list[str] = []
        self.md: list[str] = [f"# {title}", ""]

    def heading(self, text: str) -> None:
        self.html.append(f"<h2>{html.escape(text)}</h2>")
        self.md += [f"## {text}", ""]

    def paragraph(self, text: str, note: bool = False) -> None:
        cls = ' class="note"' if note else ""
        self.html.append(f"<p{cls}>{html.escape(text)}</p>")
        self.md += [text, ""]

    def table(self, grid: Grid) -> None:
        self.html.append(f"<h3>{html.escape(grid.title)}</h3>")
        self.html.append(_html_table(grid))
        self.md += [f"### {grid.title}", "", _md_table(grid), ""]

    def figure(self, fig: FigureFile, md_dir: Path) -> None:
        data = base64.b64encode(fig.png.read_bytes()).decode("ascii")
        self.html.append(
            f'<figure><img alt="{html.escape(fig.title, quote=True)}" '
            f'src="data:image/png;base64,{data}"><figcaption>{html.escape(fig.title)}: '
            f"{html.escape(fig.caption)}</figcaption></figure>"
        )
        png = fig.png.relative_to(md_dir).as_posix()
        svg = fig.svg.relative_to(md_dir).as_posix()
        self.md += [f"![{fig.title}]({png})", "", f"*{fig.title}: {fig.caption}* "
                    f"([SVG]({svg}))", ""]

    def pre(self, text: str, language: str = "") -> None:
        self.html.append(f"<pre>{html.escape(text)}</pre>")
        self.md += [_fence(text, language), ""]

    def details(self, summary: str, text: str) -> None:
        self.html.append(f"<details><summary>{html.escape(summary)}</summary>"
                         f"<pre>{html.escape(text)}</pre></details>")
        self.md += [f"**{summary}**", "", _fence(text), ""]

    def definitions(self, items: Sequence[tuple[str, str]]) -> None:
        self.html.append("<dl>" + "".join(
            f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in items) + "</dl>")
        self.md += [f"- **{k}**: {_md_escape(v)}" for k, v in items] + [""]

    def render_html(self) -> str:
        return (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{html.escape(self.title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{html.escape(self.title)}</h1>" + "\n".join(self.html) + "</body></html>\n"
        )

    def render_md(self) -> str:
        return "\n".join(self.md).rstrip() + "\n"


def _failed_section(doc: _Document, collected: Collected) -> None:
    failed = collected.failed.to_pylist()
    doc.heading(f"Failed and unfinished cells ({len(failed)})")
    if not failed:
        doc.paragraph("None: every cell run found is finished.")
    else:
        rows = []
        for r in failed:
            error = (r["error"] or "").strip()
            first_line = error.splitlines()[0] if error else ""
            rows.append([Cell(r["cell_id"] or ""), Cell(r["variant"] or ""),
                         Cell(_swept_text(r["swept"])), Cell(str(r["seed"])),
                         Cell(r["status"]), Cell(r["mlflow_status"] or ""),
                         Cell(first_line[:300] + ("…" if len(first_line) > 300 else ""))])
        doc.table(Grid("Cells without a finished run",
                       ["cell", "variant", "config", "seed", "status", "MLflow status",
                        "error (first line)"], rows,
                       "These cells are not in the tables above. `unfinished`: the run is "
                       "still marked running (in progress, or its worker died).",
                       label_columns=7))
        shown = [r for r in failed if r["error"]][:MAX_FULL_ERRORS]
        for r in shown:
            doc.details(f"{r['cell_id']} ({r['status']}): full error", r["error"])
        hidden = sum(1 for r in failed if r["error"]) - len(shown)
        if hidden > 0:
            doc.paragraph(f"{hidden} more error message(s) not shown; `studies export` "
                          f"writes them all to Parquet.")
    if collected.duplicate_cells:
        doc.paragraph(f"{len(collected.duplicate_cells)} cell(s) have more than one finished "
                      f"run; the latest is used: {', '.join(collected.duplicate_cells[:20])}",
                      note=True)


# ----------------------------------------------------------------------------- entry point


def build_report(
    tracking_uri: str,
    study_name: str,
    out_dir: str | Path,
    study_file: str | Path | None = None,
    *,
    level: float | None = None,
    ci_method: str | None = None,
    n_boot: int = 10_000,
) -> Path:
    """Write `report.html`, `report.md` and `figures/` into `out_dir`; return the HTML path.

    `level` and `ci_method` override the study's `report.level` / `report.ci`
    (defaults 0.95 and Student's t).
    """
    out_dir = Path(out_dir)
    figures_dir = out_dir / "figures"
    figures_dir.mkdir(parents=True, exist_ok=True)
    collected = collect(tracking_uri, study_name)
    study = load_study_info(study_file, collected)
    level = float(level if level is not None else study.report.get("level", DEFAULT_LEVEL))
    method = ci_method or study.report.get("ci", "t")
    if method not in CI_METHODS:
        raise ValueError(f"ci_method must be one of {CI_METHODS}, got {method!r}")
    ctx = _Context(collected, study, level, method, n_boot)

    doc = _Document(f"Study report: {study_name}")
    description = study.data.get("description")
    if description:
        doc.paragraph(str(description))
    doc.paragraph(
        f"{collected.table.num_rows} finished cells ({len(ctx.variants)} variant(s): "
        f"{', '.join(map(str, ctx.variants)) or 'none'}), "
        f"{collected.failed.num_rows} failed or unfinished cells, from MLflow experiment "
        f"{study_name!r} at {display_uri(tracking_uri)}."
    )
    if study.data.get("name") not in (None, study_name):
        doc.paragraph(f"Warning: the study file names the study {study.data.get('name')!r}, "
                      f"but the runs are those of experiment {study_name!r}.", note=True)

    doc.heading("Results")
    table_metrics: list[str] = []
    if not ctx.rows:
        doc.paragraph("No finished cell: no table, figure or comparison.", note=True)
    else:
        for i, spec in enumerate(_table_specs(ctx)):
            builder = variant_table if spec.get("columns") == "variant" else metrics_table
            grid = builder(ctx, spec, i)
            if grid is not None:
                doc.table(grid)
                table_metrics += [m for m in spec["metrics"] if m not in table_metrics]

        doc.heading("Figures")
        figures, skipped = build_figures(ctx, figures_dir)
        for fig in figures:
            doc.figure(fig, out_dir)
        if not figures:
            doc.paragraph("No figure for this study.")
        for reason in skipped:
            doc.paragraph(f"Not drawn: {reason}", note=True)

        doc.heading("Paired comparisons")
        grid, message = comparison_table(ctx, table_metrics)
        if grid is not None:
            doc.table(grid)
        else:
            doc.paragraph(message)

    ctx.notes += _unmatched_reference_rows(ctx)
    for note in ctx.notes:
        doc.paragraph(note, note=True)
    _failed_section(doc, collected)

    doc.heading("Study file")
    doc.paragraph(f"Source: {study.origin}")
    if study.text is not None:
        doc.pre(study.text, "yaml")
    doc.heading("Provenance")
    doc.definitions(provenance(ctx))

    html_path = out_dir / "report.html"
    html_path.write_text(doc.render_html(), encoding="utf-8")
    (out_dir / "report.md").write_text(doc.render_md(), encoding="utf-8")
    return html_path
