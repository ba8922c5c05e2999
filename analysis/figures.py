"""The report's figures: which ones a study gets, drawn with `analysis.plots`.

In the order of the report: sensitivity curves (`report.curves`, default: the main test
metric against each swept number), heat maps of the main test metric over two swept
parameters (default: every variant that sweeps two numbers on a grid), learning curves,
epoch time against K, average-K set-size histograms, shot-group bars, accuracy per bin of
training images (thesis Table 3.1, `report.count_bins`) and per-class accuracy against the
class's training images (`report.per_class`, read from the runs' per-class artifact).

A study of thousands of configs gets the same figures at the same sizes as one of ten:
curves with many lines become small multiples by variant (`plots.plot_series`), and the
bars, learning curves and set-size lines show the best config of each variant, ranked by
the mean of `best_val` (the best validation value of the selection metric: configs are
chosen on validation, never on test) or, when no run logged it, of the main test metric;
each caption says what was left out. Only the runs of the configs drawn are read for the
learning curves and set sizes. Every mean over at most `formatting.SEED_VALUES_UP_TO`
seeds (the tables' rule) has its seeds' values drawn beside it, from the rows of the mean
(`plot_style.seed_strip`; the learning curves at each line's last epoch only).

A figure that cannot be drawn (nothing to draw, a metric not logged) is not an error: the
report says why it is missing ("Not drawn"). A figure that fails for any other reason
(a bug, a broken artifact, MemoryError in the renderer) costs that figure only: the report
says which and why ("Figure failed") and goes on.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from analysis import plots
from analysis.collect import MEAN_PREFIX, PARAM_PREFIX, collect_histories, collect_per_class
from analysis.formatting import param_label, symbol
from analysis.layout import PER_CLASS_ARTIFACT, SET_SIZES_ARTIFACT
from analysis.published import row_matches
from analysis.report_schema import ReportCurve, ReportSetSizes
from analysis.results import StudyResults, swept_of
from analysis.stats import epoch_curves, per_class_means, set_size_fractions

_AVGK_METRIC = re.compile(r"^test/avg(?P<k>[0-9]+(?:\.[0-9]+)?)$")
#: a test metric of a bin of classes by training images (`setvalued.metrics.names` grammar)
_COUNT_BIN_METRIC = re.compile(
    r"^test/count_(?P<low>[0-9]+)_(?P<high>[0-9]+|inf)/"
    r"(?P<base>(?:top|avg)[0-9]+)$"
)
#: Configs of a learning-curve figure: bands of more than this many lines are a tangle.
LEARNING_LINES = 6
MAX_ERROR_CHARS = 300


@dataclass
class FigureFile:
    """A drawn figure: its title, PNG and SVG files, and caption."""

    title: str
    png: Path
    svg: Path
    caption: str = ""


def error_text(exc: BaseException) -> str:
    """`MemoryError: Unable to allocate ...`: the exception's type and first line."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + "…"
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


@dataclass
class Figures:
    """The figures drawn, the ones not drawn (and why), the ones that failed (and why)."""

    drawn: list[FigureFile] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def add(self, what: str, title: str, caption: str, draw: Callable[..., Sequence[Path]]) -> None:
        """Draw one figure: `draw(notes=[...])` writes the PNG and SVG and may add sentences
        on what it left out (appended to the caption). A ValueError (nothing to draw) is
        kept in `skipped`; any other exception in `failed`."""
        notes: list[str] = []
        try:
            png, svg = draw(notes=notes)
        except ValueError as exc:
            self.skipped.append(f"{what}: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 (MemoryError included: one figure never ends the report)
            self.failed.append(f"{what}: {error_text(exc)}")
            return
        self.drawn.append(FigureFile(title, png, svg, " ".join([caption] + notes).strip()))

    def section(self, what: str, build: Callable[[], None]) -> None:
        """Run the code that prepares and draws a family of figures; an exception in the
        preparation (reading histories or artifacts) fails that family only."""
        try:
            build()
        except Exception as exc:  # noqa: BLE001 (a failing figure family is reported, the report goes on)
            self.failed.append(f"{what}: {error_text(exc)}")


def slug(text: str) -> str:
    """A file-name-safe form of a metric or path (`test/top5` -> `test_top5`)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:80] or "figure"


def build_figures(results: StudyResults, figures_dir: Path) -> Figures:
    """Draw the study's figures into `figures_dir`; return them, with the reasons for the
    ones not drawn and the errors of the ones that failed."""
    figures = Figures()
    sections = [
        ("sensitivity curves", _curves),
        ("heat maps", _heatmaps),
        ("learning curves", _learning_curves),
        ("epoch time vs K", _epoch_time),
        ("set-size histograms", _set_sizes),
        ("shot-group bars", _shot_groups),
        ("accuracy by number of training images", _count_bins),
        ("per-class accuracy", _per_class),
    ]
    for what, section in sections:
        figures.section(what, functools.partial(section, results, figures_dir, figures))
    return figures


def _colors(results: StudyResults) -> dict:
    """A variant's colour, the same in every figure of the report."""
    return plots.variant_colors(results.variants)


def _level_text(results: StudyResults) -> str:
    return f"{results.level:.0%} CI"


def _numeric_values(results: StudyResults, path: str, rows=None) -> set[str]:
    return {
        json.dumps(swept_of(r)[path])
        for r in (rows if rows is not None else results.rows)
        if path in swept_of(r)
        and isinstance(swept_of(r)[path], (int, float))
        and not isinstance(swept_of(r)[path], bool)
    }


def _numeric_swept_paths(results: StudyResults) -> list[str]:
    """Swept paths with at least two numeric values (a curve can be drawn against them)."""
    out = []
    for path in results.swept_paths:
        values = {json.dumps(swept_of(r)[path]) for r in results.rows if path in swept_of(r)}
        parsed = [json.loads(v) for v in values]
        if len(parsed) >= 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in parsed):
            out.append(path)
    return out


def _curves(results: StudyResults, figures_dir: Path, figures: Figures) -> None:
    """Sensitivity curves: a metric against a swept parameter, with its CI band."""
    specs = results.study.report.curves
    if specs is None:
        primary = results.primary_metric()
        specs = [ReportCurve(x=p, metric=primary) for p in _numeric_swept_paths(results)] if primary else []
    colors = _colors(results)
    for i, spec in enumerate(specs):
        x, metric = spec.x, spec.metric
        name = f"curve_{i + 1}_{slug(metric)}_vs_{slug(x)}"
        if metric not in results.metric_names:
            figures.skipped.append(f"curve {metric} vs {x}: {metric} was not logged by a finished cell")
            continue
        if x == "data.label_noise":
            draw = functools.partial(
                plots.metric_vs_label_noise, results.summary([metric]), metric, figures_dir / name, x=x, colors=colors
            )
        else:
            draw = functools.partial(
                plots.sensitivity_curve, results.summary([metric]), x, metric, figures_dir / name, colors=colors
            )
        figures.add(
            f"curve {metric} vs {x}",
            f"{metric} vs {param_label(x)}",
            f"Mean over seeds; band: {_level_text(results)}; dashed, labelled at the "
            f"right: a variant with a single config (not swept on {symbol(x)}).",
            draw,
        )


def heatmap_pairs(results: StudyResults) -> dict[str, tuple[str, str]]:
    """{variant: (x, y)}: for every variant whose configs sweep two numeric parameters with
    at least two values each, the two with the most values (the first swept on a tie)."""
    pairs = {}
    for variant in results.variants:
        rows = [r for r in results.rows if r["variant"] == variant]
        counts = {p: len(_numeric_values(results, p, rows)) for p in results.swept_paths}
        paths = sorted(
            (p for p, n in counts.items() if n >= 2), key=lambda p: (-counts[p], results.swept_paths.index(p))
        )
        if len(paths) >= 2:
            joint = {
                (json.dumps(swept_of(r).get(paths[0])), json.dumps(swept_of(r).get(paths[1])))
                for r in rows
                if paths[0] in swept_of(r) and paths[1] in swept_of(r)
            }
            if len(joint) >= 4:  # a grid, not two one-at-a-time sweeps
                pairs[variant] = (paths[0], paths[1])
    return pairs


def _heatmaps(results: StudyResults, figures_dir: Path, figures: Figures) -> None:
    """The main test metric over the two parameters each variant sweeps on a grid."""
    metric = results.primary_metric()
    pairs = heatmap_pairs(results)
    if not metric or not pairs:
        return
    figures.add(
        f"heat map of {metric}",
        f"{metric} over two swept parameters",
        "Mean over seeds of each config, one panel per variant on its two swept "
        "parameters with the most values (a cell with several configs, which differ "
        "in a third parameter, shows the best of them); one colour scale for all "
        "panels; outlined: the variant's best cell.",
        functools.partial(
            plots.heatmaps,
            results.summary([metric]),
            metric,
            pairs,
            figures_dir / f"heatmap_{slug(metric)}",
            level=results.level,
        ),
    )


def _learning_curves(results: StudyResults, figures_dir: Path, figures: Figures) -> None:
    """`report.learning_curves`: a per-epoch metric against the epoch, a line per config
    (the best config of each variant when there are more than `plots.MAX_LINES`)."""
    learning = results.study.report.learning_curves or []
    if not learning:
        return
    shown, which = results.showcase(LEARNING_LINES)
    run_ids = [r["run_id"] for r in results.rows if r["config_id"] in set(shown)]
    histories = collect_histories(results.collected, learning, run_ids=run_ids) if results.rows else None
    for metric in learning:
        curves = (
            epoch_curves(histories, metric, results.level, results.method, n_boot=results.n_boot)
            if histories is not None
            else []
        )
        if not curves:
            figures.skipped.append(f"learning curve of {metric}: no finished cell logged it per epoch")
            continue
        figures.add(
            f"learning curve of {metric}",
            f"{metric} over the epochs",
            f"Mean over seeds at each epoch, a line per config; band: "
            f"{_level_text(results)}.{(' ' + which) if which else ''}",
            functools.partial(
                plots.learning_curves,
                curves,
                metric,
                figures_dir / f"learning_{slug(metric)}",
                order=shown,
                level=results.level,
                colors=_colors(results),
            ),
        )


def _epoch_time(results: StudyResults, figures_dir: Path, figures: Figures) -> None:
    """Mean epoch time against K (thesis Fig. 4.3); by default when loss.k is swept."""
    spec = results.study.report.epoch_time
    if spec is None and "loss.k" in results.swept_paths:
        spec = True
    if not spec:
        return
    x = spec.get("x", "loss.k") if isinstance(spec, dict) else "loss.k"
    if "epoch_time_s" not in results.metric_names:
        figures.skipped.append("epoch time vs K: epoch_time_s was not logged")
        return
    results.add_history_means(["epoch_time_s"])
    figures.add(
        "epoch time vs K",
        "Epoch time vs K",
        f"Mean epoch wall time over the epochs of each run, then mean over seeds; band: {_level_text(results)}.",
        functools.partial(
            plots.epoch_time_vs_k, results.summary([MEAN_PREFIX + "epoch_time_s"]), figures_dir / "epoch_time_vs_k", x=x
        ),
    )


def _set_sizes(results: StudyResults, figures_dir: Path, figures: Figures) -> None:
    """Thesis Fig. 5.4 for every average-K of the study: the set sizes of each config on
    test (configs selected on that K, where some are) and of one config by shot group.
    Only the runs of the configs drawn are read."""
    spec = results.study.report.set_sizes
    logged = [m["k"] for m in map(_AVGK_METRIC.match, results.metric_names) if m]
    if spec is False or (spec is None and not logged):
        return
    spec = spec if isinstance(spec, ReportSetSizes) else ReportSetSizes()
    ks = [f"{float(k):g}" for k in (spec.ks if spec.ks is not None else logged)]
    plans = []
    for k in ks:
        rows_k = [r for r in results.rows if r.get(f"test/avg{k}") is not None]
        selected = [r for r in rows_k if str(r.get(PARAM_PREFIX + "eval.selection", "")).endswith(f"avg{k}")]
        rows_k = selected or rows_k
        configs = {r["config_id"] for r in rows_k}
        summary = [r for r in results.summary([f"test/avg{k}"]) if r["config_id"] in configs]
        if not summary:
            figures.skipped.append(f"set sizes of average-{k}: no run stored them")
            continue
        shown, which = summary, "every config"
        if len(shown) > plots.MAX_LINES:  # too many lines: each variant's best config
            best_of: dict[str, dict] = {}
            for r in summary:
                if r["variant"] not in best_of or r["mean"] > best_of[r["variant"]]["mean"]:
                    best_of[r["variant"]] = r
            shown = sorted(best_of.values(), key=lambda r: -r["mean"])[: plots.MAX_LINES]
            which = f"the best config (mean test/avg{k}) of each variant, {len(shown)} of {len(summary)} configs"
        candidates = [r for r in summary if spec.by_shot is None or r["variant"] == spec.by_shot]
        best = max(candidates, key=lambda r: r["mean"]) if candidates else None
        wanted = {r["config_id"] for r in shown} | ({best["config_id"]} if best else set())
        runs = {r["run_id"]: r["config_id"] for r in rows_k if r["config_id"] in wanted}
        plans.append((k, summary, shown, which, best, runs))
    if not plans:
        return
    needed = list(dict.fromkeys(run for *_, runs in plans for run in runs))
    try:
        sizes = collect_per_class(results.collected.tracking_uri, needed, SET_SIZES_ARTIFACT)
    except Exception as exc:  # noqa: BLE001 (runs from before the artifact existed, or a broken store)
        figures.skipped.append(f"set-size histograms: cannot read {SET_SIZES_ARTIFACT} ({error_text(exc)})")
        return
    for k, summary, shown, which, best, runs in plans:
        fractions = set_size_fractions(sizes, runs, k)
        labels = {r["config_id"]: plots.config_label(r) for r in summary}
        by_config = [
            (f"{labels[c]} (n={fractions[(c, 'all')]['n']})", fractions[(c, "all")]["fractions"])
            for c in results.config_order(shown)
            if (c, "all") in fractions
        ]
        if not by_config:
            figures.skipped.append(f"set sizes of average-{k}: no run stored them")
            continue
        if spec.by_shot is not None and best is None:
            figures.skipped.append(f"set sizes of average-{k} by shot group: no config of variant {spec.by_shot!r}")
        by_shot = [
            (f"{g} (n={fractions[(best['config_id'], g)]['n']})", fractions[(best["config_id"], g)]["fractions"])
            for g in plots.SHOT_GROUPS
            if best and (best["config_id"], g) in fractions
        ]
        chosen = "the variant asked for" if spec.by_shot else f"the best mean test/avg{k}"
        figures.add(
            f"set sizes of average-{k}",
            f"Average-{k} set sizes on test",
            f"Share of test inputs per set size, mean over seeds, for {which}; the last "
            f"bin gathers the larger sets. (b) is the config with {chosen}, split by the "
            f"shot group of the label (few < 20 ≤ medium ≤ 100 < many training images).",
            functools.partial(
                plots.set_size_histograms,
                by_config,
                by_shot,
                k,
                figures_dir / f"set_sizes_avg{slug(k)}",
                shot_config=labels[best["config_id"]] if best else "",
            ),
        )


def _shot_groups(results: StudyResults, figures_dir: Path, figures: Figures) -> None:
    """Bars of a metric per shot group (few, medium, many), a bar per config (the best
    config of each variant when there are more than `plots.MAX_BARS`)."""
    specs = results.study.report.shot_groups
    if specs is None:
        primary = results.primary_metric()
        base = primary.split("/", 1)[1] if primary and primary.startswith("test/") else None
        specs = [base] if base and f"test/few/{base}" in results.metric_names else []
    shown, which = results.showcase(plots.MAX_BARS)
    for spec in specs:
        base = cast(str, spec.get("metric") if isinstance(spec, dict) else spec)  # the schema requires it
        split = spec.get("split", "test") if isinstance(spec, dict) else "test"
        metrics = [f"{split}/{g}/{base}" for g in plots.SHOT_GROUPS]
        summary = [r for r in results.summary(metrics) if r["config_id"] in set(shown)]
        figures.add(
            f"shot-group bars of {base}",
            f"{split}/{base} per shot group",
            f"few < 20 ≤ medium ≤ 100 < many training images per class; error bars: "
            f"{_level_text(results)}, within 0–100 %.{(' ' + which) if which else ''}",
            functools.partial(
                plots.shot_group_bars,
                summary,
                base,
                figures_dir / f"shot_groups_{slug(base)}",
                split=split,
                order=shown,
                colors=_colors(results),
            ),
        )


def _logged_bins(results: StudyResults) -> dict[str, dict[tuple[int, float], str]]:
    """{base metric: {(low, high): test metric}} of the bins of training images logged."""
    out: dict[str, dict[tuple[int, float], str]] = {}
    for metric in results.metric_names:
        match = _COUNT_BIN_METRIC.match(metric)
        if match:
            high = float("inf") if match["high"] == "inf" else float(match["high"])
            out.setdefault(match["base"], {})[(int(match["low"]), high)] = metric
    return out


def _bin_label(low: int, high: float) -> str:
    """`0–10`, `10–50`, `> 2000`: the bins as thesis Table 3.1 prints them."""
    return f"> {low}" if high == float("inf") else f"{low}\u2013{high:g}"


def _reference_rows(results: StudyResults) -> list:
    """The rows of every reference source of the study, the first source's first."""
    return [row for source in results.study.reference or [] for row in source.rows]


def _published_by_config(results: StudyResults, summary: list[dict], metrics: list[str]) -> dict[str, dict[str, float]]:
    """{config_id: {metric: published percent}} from the study's `reference` rows."""
    out: dict[str, dict[str, float]] = {}
    firsts: dict[str, dict] = {}
    for r in summary:
        firsts.setdefault(r["config_id"], r)
    for config_id, row in firsts.items():
        for ref in _reference_rows(results):
            if row_matches(ref, row):
                for metric in metrics:
                    if metric in ref.metrics:
                        out.setdefault(config_id, {}).setdefault(metric, float(ref.metrics[metric]))
    return out


def _count_bins(results: StudyResults, figures_dir: Path, figures: Figures) -> None:
    """Thesis Table 3.1 as a figure: the mean per-class test accuracy of each bin of
    training images, a line per config (those with published numbers first, then the best
    of each variant), the published numbers marked."""
    logged = _logged_bins(results)
    specs = results.study.report.count_bins
    if specs is None:
        primary = results.primary_metric()
        base = primary.split("/", 1)[1] if primary and primary.count("/") == 1 else None
        specs = [base] if base in logged else sorted(logged)[:1]
    for base in specs:
        bins = logged.get(base)
        if not bins:
            figures.skipped.append(
                f"accuracy by number of training images ({base}): no finished "
                f"cell logged test/count_<low>_<high>/{base} (eval.count_bins)"
            )
            continue
        ordered = sorted(bins.items())
        metrics = [m for _, m in ordered]
        summary = results.summary(metrics)
        published = _published_by_config(results, summary, metrics)
        shown, which = results.showcase(plots.MAX_LINES)
        with_reference = [c for c in results.config_order(summary) if c in published]
        order = list(dict.fromkeys(with_reference + shown))[: plots.MAX_LINES]
        if len(order) < len({r["config_id"] for r in summary}):
            which = (
                f"Shown: {len(order)} of {len({r['config_id'] for r in summary})} configs, "
                f"those with published numbers first, then the best of each variant."
            )
        source = "; ".join(ref.source for ref in results.study.reference or [])
        figures.add(
            f"accuracy by number of training images ({base})",
            f"test/{base} by number of training images",
            f"Mean over the classes of each bin of training images (low < n ≤ high) of "
            f"the per-class test {base}, mean over seeds; error bars: "
            f"{_level_text(results)}; crosses: the published numbers.{(' ' + which) if which else ''}",
            functools.partial(
                plots.count_bin_accuracy,
                summary,
                [(_bin_label(low, high), m) for (low, high), m in ordered],
                figures_dir / f"count_bins_{slug(base)}",
                published=published,
                source=source,
                order=order,
                colors=_colors(results),
            ),
        )


def _per_class(results: StudyResults, figures_dir: Path, figures: Figures) -> None:
    """`report.per_class`: per-class test accuracy against the class's number of training
    images, a panel per config (the best of each variant, at most `plots.CLASS_PANELS`);
    only the per-class artifacts of those configs' runs are read."""
    specs = results.study.report.per_class or []
    if not specs:
        return
    shown, which = results.showcase(plots.CLASS_PANELS)
    rows = _reference_rows(results)
    matched = {r["config_id"] for r in results.rows if any(row_matches(ref, r) for ref in rows)}
    published = [c for c in results.config_order(results.rows) if c in matched]
    if published:  # the configs of published numbers (Table 3.1's ResNet-50) come first
        total = len({r["config_id"] for r in results.rows})
        shown = list(dict.fromkeys(published + shown))[: plots.CLASS_PANELS]
        which = (
            f"Shown: {len(shown)} of {total} configs, those with published numbers first, "
            f"then the best of each variant."
            if len(shown) < total
            else ""
        )
    runs = {r["run_id"]: r["config_id"] for r in results.rows if r["config_id"] in set(shown)}
    try:
        table = collect_per_class(results.collected.tracking_uri, list(runs), PER_CLASS_ARTIFACT)
    except Exception as exc:  # noqa: BLE001 (runs without the artifact, or a broken store)
        figures.skipped.append(f"per-class accuracy: cannot read {PER_CLASS_ARTIFACT} ({error_text(exc)})")
        return
    labels = {r["config_id"]: plots.config_label(r) for r in results.rows}
    logged = _logged_bins(results)
    for base in specs:
        if base not in table.column_names:
            figures.skipped.append(
                f"per-class {base}: the per-class artifacts have no {base} column (eval.ks / eval.avgk)"
            )
            continue
        means = per_class_means(table, runs, base)
        panels = [(labels[c], means[c]) for c in shown if c in means]
        edges = sorted({high for (_, high) in logged.get(base, {}) if high != float("inf")}) or None
        figures.add(
            f"per-class {base}",
            f"Per-class test {base} against training images",
            f"One dot per class: its test {base}, mean over seeds, against its number of "
            f"training images (log scale); black: the mean over the classes of each bin "
            f"({'eval.count_bins' if edges else 'powers of ten'}). A panel per config."
            f"{(' ' + which) if which else ''}",
            functools.partial(
                plots.per_class_accuracy, panels, base, figures_dir / f"per_class_{slug(base)}", edges=edges
            ),
        )
