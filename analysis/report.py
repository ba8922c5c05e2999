"""The report of a study: one self-contained HTML file and its Markdown twin.

`build_report(tracking_uri, study_name, out_dir, study_file=None)` reads the finished cells
from MLflow (`analysis.collect`), summarises them over seeds (`analysis.results`,
`analysis.stats`), builds the tables (`analysis.tables`) and figures (`analysis.figures`)
and writes into `out_dir` (`analysis.document`):

- `report.html`: everything inline (CSS, figures as base64 PNG), no external resource;
- `report.md`: the same content, figures as files in `figures/` (PNG and SVG);
- `tables.tex`: the result tables and the paired comparisons in LaTeX (booktabs), the
  published numbers in their own columns, ready to paste into a paper (`analysis.latex`);
- `figures/*.png`, `figures/*.svg`.

The report opens with the way to the study's runs in the MLflow UI (the `mlflow ui`
command for a local store, and the URL of the experiment filtered to its cell runs).

What is shown is chosen by the study file's `report` block; its keys, and those of the
`reference` block of published numbers, are listed in `analysis.report_schema`.
"""

from __future__ import annotations

import math
from pathlib import Path

from analysis.collect import Collected, collect, display_uri
from analysis.distinct import short_version, tell_apart, versions_of
from analysis.document import Document
from analysis.figures import build_figures
from analysis.formatting import format_mean_ci
from analysis.power_report import power_and_cost
from analysis.provenance import mlflow_ui, provenance
from analysis.pruned import leave_out_pruned
from analysis.published import unmatched_rows
from analysis.results import StudyResults
from analysis.stats import CI_METHODS
from analysis.study_file import ReportError, StudyInfo, load_study_info, version_files
from analysis.tables import (
    NO_BASELINE,
    comparison_table,
    failed_cells_table,
    metrics_table,
    race_table,
    table_specs,
    variant_table,
)

__all__ = ["build_report", "ReportError", "StudyInfo", "load_study_info", "format_mean_ci"]

MAX_FULL_ERRORS = 50


def build_report(
    tracking_uri: str,
    study_name: str,
    out_dir: str | Path,
    study_file: str | Path | None = None,
    *,
    level: float | None = None,
    ci_method: str | None = None,
    n_boot: int = 10_000,
    difference: float | None = None,
) -> Path:
    """Write `report.html`, `report.md` and `figures/` into `out_dir`; return the HTML path.

    `level`, `ci_method` and `difference` override the study's `report.level` / `report.ci` /
    `report.difference` (defaults 0.95, Student's t and 1 percentage point).
    """
    if difference is not None and not (difference > 0 and math.isfinite(difference)):
        raise ReportError(
            f"--difference: expected a number above 0 (percentage points for accuracies), got {difference!r}"
        )
    out_dir = Path(out_dir)
    figures_dir = out_dir / "figures"
    collected = collect(tracking_uri, study_name)  # first: a study that is not there makes no folder
    figures_dir.mkdir(parents=True, exist_ok=True)
    study = load_study_info(study_file, collected)
    level = float(level if level is not None else study.report.level)
    method = ci_method or study.report.ci
    if method not in CI_METHODS:
        raise ValueError(f"ci_method must be one of {CI_METHODS}, got {method!r}")
    collected, pruned_note = leave_out_pruned(collected, study.report.show_pruned)
    collected.table = tell_apart(collected.table)  # done by collect; kept for tables given by hand
    results = StudyResults(collected, study, level, method, n_boot)

    doc = Document(f"Study report: {study_name}")
    _introduction(doc, results, study_name, tracking_uri)
    doc.heading("Results")
    if pruned_note:
        doc.paragraph(pruned_note, note=True)
    if not results.rows:
        doc.paragraph("No finished cell: no table, figure or comparison.", note=True)
    else:
        table_metrics = _result_tables(doc, results)
        racing = race_table(results)
        if racing is not None:
            doc.table(racing)
        _figures(doc, results, out_dir, figures_dir)
        doc.heading("Paired comparisons")
        table, message = comparison_table(results, table_metrics)
        if table is not None:
            doc.table(table)
        else:
            doc.paragraph(message, note=message.startswith(NO_BASELINE))
        power_and_cost(doc, results, table_metrics, difference)

    results.notes += unmatched_rows(study.reference, results.rows)
    for note in results.notes:
        doc.paragraph(note, note=True)
    _failed_cells(doc, collected)

    _study_files(doc, study, collected)
    doc.heading("Provenance")
    doc.definitions(provenance(results))

    html_path = out_dir / "report.html"
    html_path.write_text(doc.render_html(), encoding="utf-8")
    (out_dir / "report.md").write_text(doc.render_md(), encoding="utf-8")
    (out_dir / "tables.tex").write_text(doc.render_latex(), encoding="utf-8")
    return html_path


def _introduction(doc: Document, results: StudyResults, study_name: str, tracking_uri: str) -> None:
    """The study's description and what was found, with a warning if the names differ."""
    study, collected = results.study, results.collected
    description = study.data.get("description")
    if description:
        doc.paragraph(str(description))
    doc.paragraph(
        f"{collected.table.num_rows} finished cells ({len(results.variants)} variant(s): "
        f"{', '.join(map(str, results.variants)) or 'none'}), "
        f"{collected.failed.num_rows} failed or unfinished cells, from MLflow experiment "
        f"{study_name!r} at {display_uri(tracking_uri)}."
    )
    if study.data.get("name") not in (None, study_name):
        doc.paragraph(
            f"Warning: the study file names the study {study.data.get('name')!r}, "
            f"but the runs are those of experiment {study_name!r}.",
            note=True,
        )
    command, url, search = mlflow_ui(collected)
    if command is not None:
        doc.paragraph("The runs in the MLflow UI: start it on this store,")
        doc.code(command, "sh")
        doc.link(
            f"then open experiment {collected.experiment_id} filtered to the study's cell "
            f"runs{_grouped(collected)} (search filter {search}):",
            url,
        )
    else:
        doc.link(
            f"The runs in the MLflow UI: experiment {collected.experiment_id}, filtered to "
            f"the study's cell runs{_grouped(collected)} (search filter {search}):",
            url,
        )
    doc.paragraph("The tables are also in tables.tex beside this report (LaTeX, booktabs).")


def _grouped(collected) -> str:
    """How the UI's view groups the cell runs, when the experiment holds it."""
    return ", grouped by config" if collected.ui_view else ""


def _result_tables(doc: Document, results: StudyResults) -> list[str]:
    """The tables of `report.tables` (or the default one); return the metrics they show."""
    table_metrics: list[str] = []
    for i, spec in enumerate(table_specs(results)):
        builder = variant_table if spec.columns == "variant" else metrics_table
        table = builder(results, spec, i)
        if table is not None:
            doc.table(table)
            table_metrics += [m for m in spec.metrics if m not in table_metrics]
    return table_metrics


def _figures(doc: Document, results: StudyResults, out_dir: Path, figures_dir: Path) -> None:
    doc.heading("Figures")
    figures = build_figures(results, figures_dir)
    for figure in figures.drawn:
        doc.figure(figure, out_dir)
    if not figures.drawn:
        doc.paragraph("No figure for this study.")
    for reason in figures.skipped:
        doc.paragraph(f"Not drawn: {reason}", note=True)
    for error in figures.failed:
        doc.paragraph(f"Figure failed: {error}", note=True)


def _study_files(doc: Document, study: StudyInfo, collected: Collected) -> None:
    """The study file; a study of several versions shows each version's (as last run)."""
    versions = versions_of(collected.table)
    doc.heading("Study file" + ("s" if len(versions) > 1 else ""))
    if len(versions) > 1:
        doc.paragraph(
            f"The study holds {len(versions)} versions (each a study file that changed "
            f"what defines its configs, kept with `studies run --new-version`); its "
            f"tables, figures and comparisons tell them apart by `version`. Each "
            f"version's file, oldest first:"
        )
        for version, text in version_files(collected, versions).items():
            doc.paragraph(f"Version {short_version(version)} ({version}):")
            if text is None:
                doc.paragraph("its file was not found in the parent run's artifacts.", note=True)
            else:
                doc.code(text, "yaml")
        return
    doc.paragraph(f"Source: {study.origin}")
    if study.text is not None:
        doc.code(study.text, "yaml")


def _failed_cells(doc: Document, collected: Collected) -> None:
    """The cells without a finished run, their full errors, and duplicated finished cells."""
    failed = collected.failed.to_pylist()
    doc.heading(f"Failed and unfinished cells ({len(failed)})")
    if not failed:
        doc.paragraph("None: every cell run found is finished.")
    else:
        doc.table(failed_cells_table(failed))
        shown = [r for r in failed if r["error"]][:MAX_FULL_ERRORS]
        for r in shown:
            doc.details(f"{r['cell_id']} ({r['status']}): full error", r["error"])
        hidden = sum(1 for r in failed if r["error"]) - len(shown)
        if hidden > 0:
            doc.paragraph(f"{hidden} more error message(s) not shown; `studies export` writes them all to Parquet.")
    if collected.duplicate_cells:
        doc.paragraph(
            f"{len(collected.duplicate_cells)} cell(s) have more than one finished "
            f"run; the latest is used: {', '.join(collected.duplicate_cells[:20])}",
            note=True,
        )
