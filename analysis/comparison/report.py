"""`studies compare`: several finished studies side by side, as one HTML/Markdown/LaTeX report.

`compare` computes (`analysis.comparison.tasks` -> `ranks`, `aggregates`), `write_comparison`
writes what a reader sees (`tables`, `figures`, `analysis.document`), `build_comparison` does
both from collected studies. Which variants enter the rank tests and the aggregates: those
with a value on at least half the tasks (the reference always), on the tasks where every one of
them has a value; the aggregates also leave out a task where one of them has a single seed.
Each of these choices is said in the report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from analysis.collect import Collected, display_uri
from analysis.colors import variant_colors
from analysis.comparison.aggregates import DEFAULT_RESAMPLES, Aggregate, stratified_improvement, stratified_iqm
from analysis.comparison.figures import aggregates_figure, cd_diagram, task_differences
from analysis.comparison.ranks import RankTests, rank_tests
from analysis.comparison.tables import aggregate_table, pairwise_table, paper_table, rank_table
from analysis.comparison.tasks import CompareError, Scores, StudyRuns, task_scores
from analysis.document import Document
from analysis.figures import error_text
from analysis.intervals import DEFAULT_LEVEL, check_level, is_fraction_metric
from analysis.study_file import load_study_info

__all__ = ["Comparison", "compare", "write_comparison", "build_comparison", "study_runs_of"]


@dataclass
class Comparison:
    """What a comparison computed: the entries, the rank tests, the aggregates, the notes."""

    scores: Scores
    reference: str
    level: float
    ranked: list[str]
    ranks: RankTests
    iqms: dict[str, Aggregate] = field(default_factory=dict)
    improvements: dict[str, Aggregate] = field(default_factory=dict)
    aggregate_tasks: list[int] = field(default_factory=list)
    n_resamples: int = DEFAULT_RESAMPLES
    notes: list[str] = field(default_factory=list)


def compare(
    studies: Sequence[StudyRuns],
    metric: str | None = None,
    *,
    reference: str | None = None,
    level: float = DEFAULT_LEVEL,
    rename: Mapping[str, str] | None = None,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Comparison:
    """The comparison of `studies` on `metric` against `reference` (default: the first study's
    first variant); `rename`: `analysis.comparison.tasks`."""
    level = check_level(level)
    scores = task_scores(studies, metric, rename=rename)
    reference = reference or scores.variants[0]
    if reference not in scores.variants:
        raise CompareError(
            f"--reference {reference!r} is not a variant of the studies; expected one of: {', '.join(scores.variants)}"
        )
    notes: list[str] = []
    n_tasks = len(scores.tasks)
    coverage = {v: sum((t, v) in scores.entries for t in range(n_tasks)) for v in scores.variants}
    ranked = [v for v in scores.variants if v == reference or 2 * coverage[v] >= n_tasks]
    for variant in scores.variants:
        if variant not in ranked:
            notes.append(
                f"{variant} has a value on {coverage[variant]} of {n_tasks} tasks: shown in the table by task, "
                f"left out of the ranks and aggregates (they need the same tasks for every variant)."
            )
    complete = scores.complete_tasks(ranked)
    for t in range(n_tasks):
        if t not in complete:
            missing = [v for v in ranked if (t, v) not in scores.entries]
            notes.append(
                f"{scores.tasks[t].label}: no value of {', '.join(missing)}; left out of the ranks and aggregates."
            )
    ranks = rank_tests(scores, ranked, level)
    found = Comparison(scores, reference, level, ranked, ranks, n_resamples=n_resamples, notes=notes)
    _aggregates(found, complete, seed)
    return found


def _aggregates(comparison: Comparison, complete: Sequence[int], seed: int) -> None:
    """IQM of each ranked variant and its probability of improving on the reference."""
    scores, ranked = comparison.scores, comparison.ranked
    tasks = [t for t in complete if all(scores.entries[(t, v)].n >= 2 for v in ranked)]
    single = [scores.tasks[t].label for t in complete if t not in tasks]
    if single:
        comparison.notes.append(
            "Left out of the aggregates (a variant with a single seed there: nothing to resample): "
            + ", ".join(single)
            + "."
        )
    comparison.aggregate_tasks = tasks
    if not tasks:
        comparison.notes.append("No task with two or more seeds of every variant: no aggregate.")
        return

    def values(variant: str) -> list[np.ndarray]:
        return [np.asarray(scores.entries[(t, variant)].values) for t in tasks]

    level, n = comparison.level, comparison.n_resamples
    for variant in ranked:
        comparison.iqms[variant] = stratified_iqm(values(variant), level, n, seed)
        if variant != comparison.reference:
            comparison.improvements[variant] = stratified_improvement(
                values(variant), values(comparison.reference), scores.lower_is_better, level, n, seed
            )


def study_runs_of(collected: Collected) -> StudyRuns:
    """A collected study as the comparison reads it: its finished cells and its variants' order
    (from the study file the study ran with)."""
    info = load_study_info(None, collected)
    return StudyRuns(collected.study_name, collected.table.to_pylist(), info.variant_order)


def write_comparison(comparison: Comparison, out_dir: str | Path, sources: Sequence[str] = ()) -> Path:
    """Write `report.html`, `report.md`, `tables.tex` and `figures/` into `out_dir`."""
    out_dir = Path(out_dir)
    figures_dir = out_dir / "figures"
    figures_dir.mkdir(parents=True, exist_ok=True)
    studies = list(dict.fromkeys(t.study for t in comparison.scores.tasks))
    doc = Document(f"Comparison: {', '.join(studies)}")
    _introduction(doc, comparison, studies)
    figures = _Figures(doc, out_dir)
    colors = variant_colors(comparison.scores.variants)
    _results_by_task(doc, comparison, figures, colors, figures_dir)
    _ranks_across_tasks(doc, comparison, figures, colors, figures_dir)
    _aggregates_over_tasks(doc, comparison, figures, colors, figures_dir)
    for error in figures.failed:
        doc.paragraph(f"Figure failed: {error}", note=True)
    doc.heading("Provenance")
    doc.definitions([("study", source) for source in sources] or [("studies", ", ".join(studies))])
    html_path = out_dir / "report.html"
    html_path.write_text(doc.render_html(), encoding="utf-8")
    (out_dir / "report.md").write_text(doc.render_md(), encoding="utf-8")
    (out_dir / "tables.tex").write_text(doc.render_latex(), encoding="utf-8")
    return html_path


class _Figures:
    """The report's figures: each drawn into the document, or its failure kept for the end."""

    def __init__(self, doc: Document, out_dir: Path):
        self.doc, self.out_dir = doc, out_dir
        self.failed: list[str] = []

    def add(self, draw: Any, *args: Any) -> None:
        try:
            drawn = draw(*args)
        except Exception as exc:  # noqa: BLE001 (a figure that fails is reported, the report goes on)
            self.failed.append(f"{draw.__name__}: {error_text(exc)}")
            return
        if drawn is not None:
            self.doc.figure(drawn, self.out_dir)


def _introduction(doc: Document, comparison: Comparison, studies: Sequence[str]) -> None:
    """What is compared, on which metric, against which reference; the notes of the comparison."""
    scores = comparison.scores
    doc.paragraph(
        f"{len(studies)} stud{'y' if len(studies) == 1 else 'ies'}, {len(scores.tasks)} tasks, "
        f"{len(scores.variants)} variants ({', '.join(scores.variants)}), on {scores.metric} "
        f"({'lower' if scores.lower_is_better else 'higher'} is better); reference {comparison.reference!r}. "
        f"A task is a study, or one value of a parameter every variant of the study sweeps; a variant with "
        f"several configs on a task is represented by its best by mean validation score (best_val)."
    )
    doc.paragraph("The tables are also in tables.tex beside this report (LaTeX, booktabs).")
    for note in scores.notes + comparison.notes:
        doc.paragraph(note, note=True)


def _results_by_task(
    doc: Document, comparison: Comparison, figures: _Figures, colors: Mapping[str, str], figures_dir: Path
) -> None:
    scores, level = comparison.scores, comparison.level
    doc.heading("Results by task")
    doc.table(paper_table(scores, comparison.ranks, level))
    figures.add(task_differences, scores, comparison.reference, level, colors, figures_dir / "differences_by_task")


def _ranks_across_tasks(
    doc: Document, comparison: Comparison, figures: _Figures, colors: Mapping[str, str], figures_dir: Path
) -> None:
    """The rank table, the pairwise tests and their critical-difference diagram, the notes."""
    scores, level, ranks = comparison.scores, comparison.level, comparison.ranks
    doc.heading("Ranks across tasks")
    pairwise_shown = False
    if ranks.tasks:
        doc.table(rank_table(ranks, level))
        factor = 100.0 if is_fraction_metric(scores.metric) else 1.0
        pairwise = pairwise_table(ranks, level, scores.lower_is_better, factor)
        if pairwise is not None:
            pairwise_shown = True
            doc.table(pairwise)
            figures.add(cd_diagram, ranks, level, colors, figures_dir / "critical_difference")
    for note in ranks.notes:
        if not (pairwise_shown and "Wilcoxon" in note):  # the pairwise table's note says it already
            doc.paragraph(note, note=True)


def _aggregates_over_tasks(
    doc: Document, comparison: Comparison, figures: _Figures, colors: Mapping[str, str], figures_dir: Path
) -> None:
    """The IQM and improvement over the reference across tasks and seeds, table and figure."""
    scores, level = comparison.scores, comparison.level
    doc.heading("Aggregates over tasks and seeds")
    if not comparison.iqms:
        doc.paragraph("No aggregate (see the notes above).", note=True)
        return
    pooled = {
        v: [x for t in comparison.aggregate_tasks for x in scores.entries[(t, v)].values] for v in comparison.iqms
    }
    per_task = {v: [scores.entries[(t, v)].mean for t in comparison.aggregate_tasks] for v in comparison.iqms}
    doc.table(
        aggregate_table(
            comparison.iqms,
            comparison.improvements,
            comparison.reference,
            scores.metric,
            level,
            comparison.n_resamples,
            per_task,
        )
    )
    figures.add(
        aggregates_figure,
        comparison.iqms,
        comparison.improvements,
        pooled,
        comparison.reference,
        scores.metric,
        level,
        colors,
        figures_dir / "aggregates",
    )


def build_comparison(
    collected: Sequence[Collected],
    out_dir: str | Path,
    metric: str | None = None,
    **options,
) -> Path:
    """`compare` the collected studies (options: `compare`'s) and `write_comparison`; the
    HTML's path."""
    comparison = compare([study_runs_of(c) for c in collected], metric, **options)
    return write_comparison(comparison, out_dir, sources_of(collected))


def sources_of(collected: Sequence[Collected]) -> list[str]:
    """Where each compared study's runs come from, for the report's provenance."""
    return [
        f"{c.study_name}: experiment {c.experiment_id} at {display_uri(c.tracking_uri)}, "
        f"{c.table.num_rows} finished cells"
        for c in collected
    ]
