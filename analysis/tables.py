"""The report's tables: per-config metrics, variants side by side, paired comparisons, and
the cells without a finished run.

Each builder returns a `Table` (header, rows of `TableEntry`, caption) that
`analysis.document` writes as HTML and Markdown. Accuracies are shown in percent as
`mean ± half-width` of the confidence interval over seeds, the papers' layout.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from analysis.collect import PARAM_PREFIX
from analysis.distinct import VERSION_PARAM
from analysis.formatting import (
    NO_SWEPT_TEXT,
    auto_digits,
    format_mean_ci,
    p_text,
    param_label,
    seed_values_text,
    small_seed_note,
    swept_text,
    value_text,
)
from analysis.published import column_header, published_value, sources_caption
from analysis.report_schema import ReportTable
from analysis.results import StudyResults, swept_of
from analysis.stats import is_fraction_metric, lower_is_better, metric_bounds, paired_comparisons

MAX_ERROR_CHARS = 300  # of the first line of an error, in the failed-cells table


@dataclass
class TableEntry:
    """The text of one entry of a table, bold (best of its column or row) or muted; `detail`:
    what stands behind it, shown under it in HTML, after it in Markdown and in small type in LaTeX
    (the per-seed values of a mean over at most `SEED_VALUES_UP_TO` seeds)."""

    text: str
    bold: bool = False
    muted: bool = False
    detail: str = ""


@dataclass
class Table:
    """A table ready to write: title, header, rows of entries, caption. The first
    `label_columns` columns name the row (left-aligned); the others hold values."""

    title: str
    header: list[str]
    rows: list[list[TableEntry]]
    caption: str = ""
    label_columns: int = 1
    paper: bool = True  # written to tables.tex too (the failed cells are not)
    note: str = ""  # one line set apart under the caption: few seeds, clipped intervals


# ----------------------------------------------------------------------------- helpers


def without_idle_columns(table: Table, droppable: Sequence[str]) -> tuple[Table, list[str]]:
    """`table` without those of the `droppable` columns that say nothing row by row: empty
    in every row, or the same text in every row of a table of several rows. Returns the
    table and, for each column dropped for its one value, ``"header: value"`` (for the
    caption or title)."""
    drop, facts = set(), []
    for index, head in enumerate(table.header):
        if head not in droppable:
            continue
        texts = {row[index].text for row in table.rows}
        if texts <= {""}:
            drop.add(index)
        elif len(texts) == 1 and len(table.rows) > 1:
            drop.add(index)
            facts.append(f"{head}: {texts.pop()}")
    keep = [i for i in range(len(table.header)) if i not in drop]
    labels = sum(1 for i in keep if i < table.label_columns)
    return Table(
        table.title,
        [table.header[i] for i in keep],
        [[row[i] for i in keep] for row in table.rows],
        table.caption,
        label_columns=max(1, labels),
        paper=table.paper,
        note=table.note,
    ), facts


def table_specs(results: StudyResults) -> list[ReportTable]:
    """The study's `report.tables`, or one table of the top-level test metrics."""
    specs = results.study.report.tables
    if specs:
        return list(specs)
    tests = sorted(m for m in results.metric_names if m.startswith("test/") and m.count("/") == 1)
    extra = [m for m in ("best_val",) if m in results.metric_names]
    if not tests + extra:
        return []
    return [ReportTable(metrics=tests + extra, title="Final test metrics (default table)")]


def _digits_for(metric: str, spec: ReportTable, values: Sequence[float]) -> int:
    if spec.digits is not None:
        return spec.digits
    return 1 if is_fraction_metric(metric) else auto_digits(values)


def _bold_flags(means: Sequence[float], metric: str, digits: int, ns: Sequence[int] | None = None) -> list[bool]:
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


def _seed_caption(results: StudyResults, summary_rows: Sequence[Mapping]) -> tuple[str, int | None]:
    """The caption saying what the numbers are (interval, n, seeds) and the typical n."""
    ns = [r["n"] for r in summary_rows if r["n"] > 0]
    seeds = sorted({s for r in summary_rows for s in (r["seeds"] or [])})
    if not ns:
        return "no finished seed", None
    typical = max(set(ns), key=ns.count)
    method = (
        "Student's t on n−1 degrees of freedom"
        if results.method == "t"
        else f"percentile bootstrap, {results.n_boot} resamples"
    )
    if min(ns) == max(ns):
        n_text = f"n = {typical} seed{'s' if typical != 1 else ''} per cell"
    else:
        n_text = f"n = {min(ns)} to {max(ns)} seeds per cell (cells with n ≠ {typical} show their n)"
    shown = "Mean ± half-width of the" if results.method == "t" else "Mean [bounds] of the"
    text = (
        f"{shown} {results.level:.0%} confidence interval over seeds "
        f"({method}); {n_text}; seeds {', '.join(map(str, seeds))}. Accuracies in percent. "
        f"n = 1 gives no interval (mean only). Bold: best mean of the column"
        f"{' (among cells with n ≥ 2)' if min(ns) < 2 <= max(ns) else ''}."
    )
    bounded = [r for r in summary_rows if metric_bounds(r["metric"]) is not None]
    if bounded and results.method == "t":
        cut = sum(1 for r in bounded if r.get("clipped"))
        text += (
            " Intervals of bounded metrics (accuracies: 0 to 100 %) are the t interval "
            "intersected with the metric's range, which contains the mean exactly when "
            "the t interval does (same coverage); "
            + (
                f"{cut} entr{'y' if cut == 1 else 'ies'} cut at a bound "
                f"{'is' if cut == 1 else 'are'} shown by {'its' if cut == 1 else 'their'} "
                f"bounds [low, high]."
                if cut
                else "none is cut here."
            )
        )
    return text, typical


def _scaled(row: Mapping, metric: str) -> tuple[float, float]:
    """Mean and half-width of a summary row, in percent for an accuracy."""
    factor = 100.0 if is_fraction_metric(metric) else 1.0
    mean = row["mean"] * factor if row["mean"] is not None else math.nan
    half = row["half_width"] * factor if row["half_width"] is not None else math.nan
    return mean, half


def _value_entry(row: Mapping | None, metric: str, digits: int, typical_n: int | None, bold: bool) -> TableEntry:
    """A summary row as `mean ± half-width` (bootstrap: `mean [low, high]`), with its n when
    it differs from the table's typical n."""
    if row is None or row["n"] == 0:
        return TableEntry("–", muted=True)
    mean, half = _scaled(row, metric)
    if not row["no_interval"] and (row.get("method") == "bootstrap" or row.get("clipped")):
        # a percentile-bootstrap interval, or one cut at a bound of the metric (an accuracy
        # cannot pass 100 %), is not symmetric: show its bounds
        factor = 100.0 if is_fraction_metric(metric) else 1.0
        text = f"{mean:.{digits}f} [{row['ci_low'] * factor:.{digits}f}, {row['ci_high'] * factor:.{digits}f}]"
    else:
        text = format_mean_ci(mean, half, digits)
    if typical_n is not None and row["n"] != typical_n:
        text += f" (n={row['n']})"
    factor = 100.0 if is_fraction_metric(metric) else 1.0
    return TableEntry(text, bold=bold, detail=seed_values_text(row.get("values") or [], factor, digits))


def _seed_note(summary_rows: Sequence[Mapping]) -> str:
    """The one-line note under a result table (`small_seed_note`) of its summary rows."""
    return small_seed_note(
        [r["n"] for r in summary_rows if not r["no_interval"]],
        sum(1 for r in summary_rows if r.get("clipped")),
    )


def _only_swept(summary: list[dict], spec: ReportTable) -> list[dict]:
    """The rows of configs whose swept params are all in `spec.swept` (when given)."""
    if spec.swept is None:
        return summary
    allowed = set(spec.swept)
    return [r for r in summary if set(swept_of(r)) <= allowed]


def _shown(sources: Sequence[Any], published: Mapping[Any, list[Any]]) -> list[Any]:
    """The sources that have a column in the table, in the file's order (for the caption)."""
    return [s for s in sources if any(s is u for used in published.values() for u in used)]


def _n_range_text(ns: set[int]) -> str:
    if not ns:
        return "0"
    low, high = min(ns), max(ns)
    return str(low) if low == high else f"{low}–{high}"


def _table_summary(results: StudyResults, spec: ReportTable, title: str) -> tuple[list[str], list] | None:
    """The logged metrics of a table spec and their per-config summary (restricted to the
    spec's `swept` paths); None, with a note saying why, when the table would be empty."""
    wanted = list(spec.metrics)
    metrics = [m for m in wanted if m in results.metric_names]
    if not metrics:
        results.notes.append(f"{title}: none of the metrics {wanted} was logged by a finished cell")
        return None
    summary = _only_swept(results.summary(metrics), spec)
    if not summary:
        results.notes.append(f"{title}: no finished config sweeps only {spec.swept}")
        return None
    return metrics, summary


# ----------------------------------------------------------------------------- result tables


def metrics_table(results: StudyResults, spec: ReportTable, index: int) -> Table | None:
    """One row per config, one column per metric (plus the paper's number beside it)."""
    wanted = list(spec.metrics)
    missing = [m for m in wanted if m not in results.metric_names]
    title = spec.title or f"Table {index + 1}: " + ", ".join(wanted)
    found = _table_summary(results, spec, title)
    if found is None:
        return None
    metrics, summary = found
    sources = results.study.reference
    by_key = {(r["config_id"], r["metric"]): r for r in summary}
    configs = results.config_order(summary)
    first = {c: by_key[(c, metrics[0])] for c in configs}
    swept_cols = [p for p in results.swept_paths if any(p in swept_of(first[c]) for c in configs)]
    sweeping = {(first[c]["variant"], p) for c in configs for p in swept_of(first[c])}
    caption, typical = _seed_caption(results, summary)

    # per metric, the sources with a number for some config: one column each, after the metric's
    published = {m: [s for s in sources if any(published_value(s, first[c], m) for c in configs)] for m in metrics}
    header = ["variant"] + [param_label(c) for c in swept_cols]
    for m in metrics:
        header.append(m)
        header += [column_header(m, s) for s in published[m]]
    header.append("seeds")

    digits = {m: _digits_for(m, spec, [_scaled(by_key[(c, m)], m)[0] for c in configs]) for m in metrics}
    # the best of each version of the study (analysis.distinct): versions are not compared
    groups: dict = {}
    for i, c in enumerate(configs):
        groups.setdefault(swept_of(first[c]).get(VERSION_PARAM), []).append(i)
    bold = {m: [False] * len(configs) for m in metrics}
    for m in metrics:
        for members in groups.values():
            flags = _bold_flags(
                [_scaled(by_key[(configs[i], m)], m)[0] for i in members],
                m,
                digits[m],
                [by_key[(configs[i], m)]["n"] for i in members],
            )
            for i, flag in zip(members, flags):
                bold[m][i] = flag
    rows = []
    for i, config_id in enumerate(configs):
        row0 = first[config_id]
        entries = [TableEntry(str(row0["variant"]))]
        for path in swept_cols:
            if path in swept_of(row0) or (row0["variant"], path) in sweeping:
                entries.append(TableEntry(value_text(row0.get(PARAM_PREFIX + path, swept_of(row0).get(path)))))
            else:
                entries.append(TableEntry("–", muted=True))
        ns = set()
        for m in metrics:
            r = by_key.get((config_id, m))
            entries.append(_value_entry(r, m, digits[m], typical, bold[m][i]))
            if r is not None and r["n"]:
                ns.add(r["n"])
            for source in published[m]:
                entries.append(TableEntry(published_value(source, row0, m) or "", muted=True))
        entries.append(TableEntry(_n_range_text(ns)))
        rows.append(entries)
    if len(groups) > 1:
        caption += " Bold is the best of each version of the study (versions are not compared)."
    caption += sources_caption(_shown(sources, published))
    if missing:
        caption += f" Not logged by any finished cell: {', '.join(missing)}."
    return Table(title, header, rows, caption, label_columns=1 + len(swept_cols), note=_seed_note(summary))


def variant_table(results: StudyResults, spec: ReportTable, index: int) -> Table | None:
    """Rows = context (the swept values), a column per variant (and metric), thesis Table 4.4.

    Bold marks the best variant of each row for each metric.
    """
    wanted = list(spec.metrics)
    title = spec.title or f"Table {index + 1}: " + ", ".join(wanted) + " by variant"
    found = _table_summary(results, spec, title)
    if found is None:
        return None
    metrics, summary = found
    sources = results.study.reference
    variants = [v for v in results.variants if any(r["variant"] == v for r in summary)]
    caption, typical = _seed_caption(results, summary)
    caption = caption.replace("best mean of the column", "best variant of the row")
    contexts: dict[str, dict[tuple[str, str], Mapping]] = {}
    of_config: dict[str, list[Mapping]] = {}
    for r in summary:
        of_config.setdefault(r["config_id"], []).append(r)
    for config_id in results.config_order(summary):
        for r in of_config[config_id]:
            contexts.setdefault(r["swept"], {})[(r["variant"], r["metric"])] = r
    context_paths = list(dict.fromkeys(k for s in contexts for k in json.loads(s)))

    def context_sort(item):
        swept = json.loads(item[0])
        return [
            (0, float(swept[p]), "") if isinstance(swept.get(p), (int, float)) else (1, 0.0, str(swept.get(p)))
            for p in context_paths
        ]

    ordered = sorted(contexts.items(), key=context_sort)
    columns = [(v, m) for m in metrics for v in variants]
    # per (variant, metric) column, the sources with a number in some row: a column each
    published = {
        (v, m): [
            s
            for s in sources
            if any((v, m) in by_column and published_value(s, by_column[(v, m)], m) for _, by_column in ordered)
        ]
        for v, m in columns
    }
    header = [param_label(p) for p in context_paths] or ["config"]
    for v, m in columns:
        name = v if len(metrics) == 1 else f"{v}: {m}"
        header.append(name)
        header += [column_header(name, s) for s in published[(v, m)]]
    rows = []
    for swept_json, by_column in ordered:
        swept = json.loads(swept_json)
        row = [TableEntry(value_text(swept[p]) if p in swept else "–") for p in context_paths] or [
            TableEntry("(no swept parameter)")
        ]
        digits = {
            m: _digits_for(m, spec, [_scaled(r, m)[0] for (v, mm), r in by_column.items() if mm == m]) for m in metrics
        }
        bold = {}
        for m in metrics:
            means = [_scaled(by_column[(v, m)], m)[0] if (v, m) in by_column else math.nan for v in variants]
            ns = [by_column[(v, m)]["n"] if (v, m) in by_column else 0 for v in variants]
            bold.update({(v, m): flag for v, flag in zip(variants, _bold_flags(means, m, digits[m], ns))})
        for v, m in columns:
            r = by_column.get((v, m))
            row.append(_value_entry(r, m, digits[m], typical, bold[(v, m)]))
            for source in published[(v, m)]:
                text = published_value(source, r, m) if r is not None else None
                row.append(TableEntry(text or "", muted=True))
        rows.append(row)
    caption += sources_caption(_shown(sources, published))
    return Table(title, header, rows, caption, label_columns=max(1, len(context_paths)), note=_seed_note(summary))


# ----------------------------------------------------------------------------- comparisons


#: how the reason for no comparison begins when the baseline has no finished cell (a warning)
NO_BASELINE = "No paired comparison: the baseline variant"


def baseline_variant(results: StudyResults) -> str:
    """The variant every other one is compared with: `report.compare.reference`, else the study
    file's first variant (else the first finished one), whether or not it finished."""
    compare = results.study.report.compare
    named = compare.reference if compare else None
    return named or next(iter(results.study.variant_order), None) or results.variants[0]


def compared_metrics(results: StudyResults, table_metrics: Sequence[str]) -> list[str]:
    """The metrics of the paired comparisons: `report.compare.metrics`, else the tables' own,
    those the runs hold."""
    compare = results.study.report.compare
    asked = (compare.metrics if compare else None) or table_metrics
    return [m for m in asked if m in results.metric_names]


def comparison_table(results: StudyResults, table_metrics: Sequence[str]) -> tuple[Table | None, str]:
    """Each variant against the baseline variant, paired by seed (`report.compare`); or None
    and the reason there is nothing to compare.

    The baseline is `report.compare.reference`, else the study file's first variant (else the
    first finished one); a baseline without a finished cell is never swapped for another
    variant: the reason says so (the report shows it as a note)."""
    reference = baseline_variant(results)
    reason = _nothing_to_compare(results, reference)
    if reason:
        return None, reason
    metrics = compared_metrics(results, table_metrics)
    if not metrics:
        return None, "No metric to compare."
    compared = paired_comparisons(
        results.rows, metrics, reference, results.level, variant_paths=results.study.variant_paths()
    ).to_pylist()
    order = {c: i for i, c in enumerate(results.config_order(results.rows))}
    compared.sort(
        key=lambda r: (metrics.index(r["metric"]), order.get(r["config_id"], 0), order.get(r["reference_config_id"], 0))
    )
    if not compared:
        return None, (
            f"No config of another variant shares its context with a config of {reference!r}: nothing to pair."
        )
    header = [
        "metric",
        "variant",
        "config",
        "baseline config",
        "pairs (seeds)",
        f"mean difference [{results.level:.0%} CI]",
        "p (paired t)",
        "p (Holm)",
        "note",
    ]
    rows = [_comparison_row(r, results.level) for r in compared]
    baseline = "baseline config"
    table, facts = without_idle_columns(
        Table(
            f"Each variant against the baseline {reference!r}",
            header,
            rows,
            _comparison_caption(results, reference),
            label_columns=4,
            note=small_seed_note([r["n"] for r in compared], sum(1 for r in compared if r["clipped"])),
        ),
        droppable=("metric", "variant", baseline, "note"),
    )
    if facts:  # one metric, variant or baseline config throughout: said once, in the title
        table.title += " (" + "; ".join(facts) + ")"
    return table, ""


def _nothing_to_compare(results: StudyResults, reference: str) -> str:
    """Why no variant can be compared with `reference` (a baseline without a finished cell,
    fewer than two variants finished); empty when they can."""
    if reference not in results.variants:
        compare = results.study.report.compare
        named = compare.reference if compare else None
        failed = results.collected.failed.column("variant").to_pylist().count(reference)
        how = "`report.compare.reference`" if named else "the study file's first variant"
        return (
            f"{NO_BASELINE} {reference!r} ({how}) has "
            f"no finished cell ({failed} failed or unfinished); the other variants "
            f"are not compared with one another in its place. Finished variants: "
            f"{', '.join(map(str, results.variants))}."
        )
    if len(results.variants) < 2:
        return "Fewer than two variants finished: no paired comparison."
    return ""


def _comparison_row(r: Mapping, level: float) -> list[TableEntry]:
    """One paired comparison: the configs, the seeds paired, the mean difference with its
    interval (percentage points for an accuracy; bold when Holm's p is significant; the
    per-seed differences as its detail), the p-values."""
    factor = 100.0 if is_fraction_metric(r["metric"]) else 1.0
    digits = 2 if factor == 100.0 else auto_digits([r["mean_diff"]]) + 1
    if math.isfinite(r["mean_diff"]):
        diff = f"{r['mean_diff'] * factor:+.{digits}f}"
        if r["ci_low"] is not None and math.isfinite(r["ci_low"]):
            diff += f" [{r['ci_low'] * factor:+.{digits}f}, {r['ci_high'] * factor:+.{digits}f}]"
    else:
        diff = "–"
    return [
        TableEntry(r["metric"]),
        TableEntry(r["variant"]),
        TableEntry(swept_text(r["swept"])),
        TableEntry(swept_text(r["reference_swept"])),
        TableEntry(f"{r['n']} ({', '.join(map(str, r['seeds']))})"),
        TableEntry(
            diff,
            bold=_significant(r["p_holm"], level),
            detail=seed_values_text(r["differences"] or [], factor, digits),
        ),
        TableEntry(p_text(r["p_value"])),
        TableEntry(p_text(r["p_holm"])),
        TableEntry(r["note"] or ""),
    ]


def _comparison_caption(results: StudyResults, reference: str) -> str:
    return (
        f"Each variant's config (by its swept values) minus its baseline: the config of the reference "
        f"variant {reference!r} with the same context (every parameter equal except "
        f"those that define a variant; "
        f"{NO_SWEPT_TEXT}: the study's base values, nothing swept), paired by seed; "
        f"differences of accuracies in percentage points, their interval cut at ±100. "
        f"Paired t-test on n−1 df, two-sided; Holm's correction over the variants "
        f"compared with the same reference config, per metric. Bold: Holm-adjusted "
        f"p < {1 - results.level:.2g}."
        + (
            " The study holds several versions (`version`): a config is paired only with "
            "a baseline of its own version, so no family spans versions."
            if VERSION_PARAM in results.swept_paths
            else ""
        )
    )


def _significant(p: float, level: float) -> bool:
    return p is not None and math.isfinite(p) and p < 1 - level


# ----------------------------------------------------------------------------- racing


def race_table(results: StudyResults) -> Table | None:
    """A racing study's seeds per config and why its race stopped (None for a seed list).

    Every config's decision is the `race` column (the MLflow tag `studies.race`) of its last
    finished seed; a config without one was still racing when the study stopped."""
    rows = [r for r in results.rows if r.get("race")]
    if not rows:
        return None
    decision = {r["config_id"]: json.loads(r["race"]) for r in rows}
    max_seeds = max(int(d.get("max", 0)) for d in decision.values())
    seeds: dict[str, int] = {}
    first: dict[str, Mapping] = {}
    for r in results.rows:
        seeds[r["config_id"]] = seeds.get(r["config_id"], 0) + 1
        first.setdefault(r["config_id"], r)
    body = []
    counts: dict[str, int] = {}
    for config_id in results.config_order(results.rows):
        row = first[config_id]
        found = decision.get(config_id)
        state = found["state"] if found else "racing"
        counts[state] = counts.get(state, 0) + 1
        reason = found.get("reason", "") if found else "undecided when the study stopped"
        body.append(
            [
                TableEntry(str(row["variant"])),
                TableEntry(swept_text(row.get("swept"))),
                TableEntry(f"{seeds[config_id]} of {max_seeds}"),
                TableEntry(state, bold=state == "best"),
                TableEntry(reason),
            ]
        )
    used = sum(seeds.values())
    caption = (
        f"{used} cells of at most {len(body) * max_seeds} ({len(body)} configs x "
        f"{max_seeds} seeds): "
        + ", ".join(f"{n} {state}" for state, n in counts.items())
        + ". Each config started with the first seeds of one shared sequence (paired) and "
        "got the next seed while its paired difference with the best config was not "
        "significant (paired t-test, Holm-corrected over the configs still racing); the "
        "tables above use the seeds each config has."
    )
    return Table(
        "Racing: seeds per config and why each stopped",
        ["variant", "config", "seeds", "decision", "reason"],
        body,
        caption,
        label_columns=2,
        paper=False,
    )


# ----------------------------------------------------------------------------- failures


def failed_cells_table(failed: Sequence[Mapping]) -> Table:
    """The cells without a finished run, with the first line of their error."""
    rows = []
    for r in failed:
        error = (r["error"] or "").strip()
        first_line = error.splitlines()[0] if error else ""
        shown = first_line[:MAX_ERROR_CHARS] + ("…" if len(first_line) > MAX_ERROR_CHARS else "")
        rows.append(
            [
                TableEntry(r["cell_id"] or ""),
                TableEntry(r["variant"] or ""),
                TableEntry(swept_text(r["swept"])),
                TableEntry(str(r["seed"])),
                TableEntry(r["status"]),
                TableEntry(r["mlflow_status"] or ""),
                TableEntry(shown),
            ]
        )
    return Table(
        "Cells without a finished run",
        ["cell", "variant", "config", "seed", "status", "MLflow status", "error (first line)"],
        rows,
        f"These cells are not in the tables above. `unfinished`: the run is "
        f"still marked running (in progress, or its worker died). Config "
        f"{NO_SWEPT_TEXT}: the study's base values (nothing swept).",
        label_columns=7,
        paper=False,
    )
