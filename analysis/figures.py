"""The report's figures: which ones a study gets, drawn with `analysis.plots`.

In the order of the report: sensitivity curves (`report.curves`, default: the main test
metric against each swept number), learning curves, epoch time against K, average-K
set-size histograms, shot-group bars. A figure that cannot be drawn (nothing to draw, a
metric not logged) is not an error: the report says why it is missing.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from analysis import plots
from analysis.collect import MEAN_PREFIX, PARAM_PREFIX, collect_histories, collect_per_class
from analysis.layout import SET_SIZES_ARTIFACT
from analysis.report_schema import ReportCurve, ReportSetSizes
from analysis.results import StudyResults, swept_of
from analysis.stats import epoch_curves, set_size_fractions

_AVGK_METRIC = re.compile(r"^test/avg(?P<k>[0-9]+(?:\.[0-9]+)?)$")


@dataclass
class FigureFile:
    """A drawn figure: its title, PNG and SVG files, and caption."""

    title: str
    png: Path
    svg: Path
    caption: str = ""


@dataclass
class _Figures:
    """The figures drawn so far, and why each one asked for is missing."""

    drawn: list[FigureFile] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def add(self, what: str, title: str, caption: str,
            draw: Callable[[], Sequence[Path]]) -> None:
        """Draw one figure (PNG, SVG); a ValueError of the drawing (nothing to draw) is
        kept in `skipped` with `what` instead, so the report says why it is missing."""
        try:
            png, svg = draw()
        except ValueError as exc:
            self.skipped.append(f"{what}: {exc}")
            return
        self.drawn.append(FigureFile(title, png, svg, caption))


def slug(text: str) -> str:
    """A file-name-safe form of a metric or path (`test/top5` -> `test_top5`)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:80] or "figure"


def build_figures(results: StudyResults, figures_dir: Path) -> tuple[list[FigureFile], list[str]]:
    """Draw the study's figures into `figures_dir`; return them and the reasons for the
    ones not drawn."""
    figures = _Figures()
    _curves(results, figures_dir, figures)
    _learning_curves(results, figures_dir, figures)
    _epoch_time(results, figures_dir, figures)
    _set_sizes(results, figures_dir, figures)
    _shot_groups(results, figures_dir, figures)
    return figures.drawn, figures.skipped


def _level_text(results: StudyResults) -> str:
    return f"{results.level:.0%} CI"


def _numeric_swept_paths(results: StudyResults) -> list[str]:
    """Swept paths with at least two numeric values (a curve can be drawn against them)."""
    out = []
    for path in results.swept_paths:
        values = {json.dumps(swept_of(r)[path]) for r in results.rows if path in swept_of(r)}
        parsed = [json.loads(v) for v in values]
        if len(parsed) >= 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                    for v in parsed):
            out.append(path)
    return out


def _curves(results: StudyResults, figures_dir: Path, figures: _Figures) -> None:
    """Sensitivity curves: a metric against a swept parameter, with its CI band."""
    specs = results.study.report.curves
    if specs is None:
        primary = results.primary_metric()
        specs = [ReportCurve(x=p, metric=primary) for p in _numeric_swept_paths(results)] \
            if primary else []
    for i, spec in enumerate(specs):
        x, metric = spec.x, spec.metric
        name = f"curve_{i + 1}_{slug(metric)}_vs_{slug(x)}"
        if metric not in results.metric_names:
            figures.skipped.append(f"curve {metric} vs {x}: {metric} was not logged by a finished cell")
            continue
        if x == "data.label_noise":
            draw = functools.partial(plots.metric_vs_label_noise, results.summary([metric]),
                                     metric, figures_dir / name, x=x)
        else:
            draw = functools.partial(plots.sensitivity_curve, results.summary([metric]), x,
                                     metric, figures_dir / name)
        figures.add(f"curve {metric} vs {x}", f"{metric} vs {x}",
                    f"Mean over seeds; band: {_level_text(results)}; dashed: a variant with a "
                    f"single config (not swept on {x}).", draw)


def _learning_curves(results: StudyResults, figures_dir: Path, figures: _Figures) -> None:
    """`report.learning_curves`: a per-epoch metric against the epoch, a line per config."""
    learning = results.study.report.learning_curves or []
    histories = collect_histories(results.collected, learning) \
        if learning and results.rows else None
    for metric in learning:
        curves = epoch_curves(histories, metric, results.level, results.method,
                              n_boot=results.n_boot) if histories is not None else []
        if not curves:
            figures.skipped.append(f"learning curve of {metric}: no finished cell logged it per epoch")
            continue
        figures.add(f"learning curve of {metric}", f"{metric} over the epochs",
                    f"Mean over seeds at each epoch, a line per config; band: "
                    f"{_level_text(results)}.",
                    functools.partial(plots.learning_curves, curves, metric,
                                      figures_dir / f"learning_{slug(metric)}",
                                      order=results.config_order(curves), level=results.level))


def _epoch_time(results: StudyResults, figures_dir: Path, figures: _Figures) -> None:
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
    figures.add("epoch time vs K", "Epoch time vs K",
                f"Mean epoch wall time over the epochs of each run, then mean over seeds; "
                f"band: {_level_text(results)}.",
                functools.partial(plots.epoch_time_vs_k,
                                  results.summary([MEAN_PREFIX + "epoch_time_s"]),
                                  figures_dir / "epoch_time_vs_k", x=x))


def _set_sizes(results: StudyResults, figures_dir: Path, figures: _Figures) -> None:
    """Thesis Fig. 5.4 for every average-K of the study: the set sizes of each config on
    test (configs selected on that K, where some are) and of one config by shot group."""
    spec = results.study.report.set_sizes
    logged = [m["k"] for m in map(_AVGK_METRIC.match, results.metric_names) if m]
    if spec is False or (spec is None and not logged):
        return
    spec = spec if isinstance(spec, ReportSetSizes) else ReportSetSizes()
    ks = [f"{float(k):g}" for k in (spec.ks if spec.ks is not None else logged)]
    rows = [r for r in results.rows if any(r.get(f"test/avg{k}") is not None for k in ks)]
    try:
        sizes = collect_per_class(results.collected.tracking_uri, [r["run_id"] for r in rows],
                                  SET_SIZES_ARTIFACT)
    except Exception as exc:  # runs from before the artifact existed, or a broken store
        figures.skipped.append(f"set-size histograms: cannot read {SET_SIZES_ARTIFACT} ({exc})")
        return
    for k in ks:
        rows_k = [r for r in rows if r.get(f"test/avg{k}") is not None]
        selected = [r for r in rows_k
                    if str(r.get(PARAM_PREFIX + "eval.selection", "")).endswith(f"avg{k}")]
        rows_k = selected or rows_k
        fractions = set_size_fractions(sizes, {r["run_id"]: r["config_id"] for r in rows_k}, k)
        summary = [r for r in results.summary([f"test/avg{k}"])
                   if (r["config_id"], "all") in fractions]
        if not summary:
            figures.skipped.append(f"set sizes of average-{k}: no run stored them")
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
        by_config = [(f"{labels[c]} (n={fractions[(c, 'all')]['n']})",
                      fractions[(c, "all")]["fractions"])
                     for c in results.config_order(shown)]
        wanted = spec.by_shot
        candidates = [r for r in summary if wanted is None or r["variant"] == wanted]
        if not candidates:
            figures.skipped.append(f"set sizes of average-{k} by shot group: no config of "
                                   f"variant {wanted!r}")
        best = max(candidates, key=lambda r: r["mean"]) if candidates else None
        by_shot = [(f"{g} (n={fractions[(best['config_id'], g)]['n']})",
                    fractions[(best["config_id"], g)]["fractions"])
                   for g in plots.SHOT_GROUPS if best and (best["config_id"], g) in fractions]
        chosen = "the variant asked for" if wanted else f"the best mean test/avg{k}"
        figures.add(f"set sizes of average-{k}", f"Average-{k} set sizes on test",
                    f"Share of test inputs per set size, mean over seeds, for {which}; the last "
                    f"bin gathers the larger sets. (b) is the config with {chosen}, split by the "
                    f"shot group of the label (few < 20 ≤ medium ≤ 100 < many training images).",
                    functools.partial(plots.set_size_histograms, by_config, by_shot, k,
                                      figures_dir / f"set_sizes_avg{slug(k)}",
                                      shot_config=labels[best["config_id"]] if best else ""))


def _shot_groups(results: StudyResults, figures_dir: Path, figures: _Figures) -> None:
    """Bars of a metric per shot group (few, medium, many), a bar per config."""
    specs = results.study.report.shot_groups
    if specs is None:
        primary = results.primary_metric()
        base = primary.split("/", 1)[1] if primary and primary.startswith("test/") else None
        specs = [base] if base and f"test/few/{base}" in results.metric_names else []
    for spec in specs:
        base = spec.get("metric") if isinstance(spec, dict) else spec
        split = spec.get("split", "test") if isinstance(spec, dict) else "test"
        metrics = [f"{split}/{g}/{base}" for g in plots.SHOT_GROUPS]
        summary = results.summary(metrics)
        figures.add(f"shot-group bars of {base}", f"{split}/{base} per shot group",
                    f"few < 20 ≤ medium ≤ 100 < many training images per class; error bars: "
                    f"{_level_text(results)}.",
                    functools.partial(plots.shot_group_bars, summary, base,
                                      figures_dir / f"shot_groups_{slug(base)}",
                                      split=split, order=results.config_order(summary)))
