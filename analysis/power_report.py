"""The report's "Power and cost" section: the seeds a reader would need to detect the
smallest difference of interest in each paired comparison at the report's level with 80 %
power (`analysis.power`, from the study's own per-seed paired differences, as a range over the
uncertainty of their sd), and the GPU-hours the study's runs took (their
durations times the GPUs the study file requests per trial), per variant and in total."""

from __future__ import annotations

import math
from collections.abc import Sequence

from analysis.document import Document
from analysis.formatting import swept_text
from analysis.power import DEFAULT_DIFFERENCE, DEFAULT_POWER, SD_CONFIDENCE, run_costs, seeds_needed
from analysis.results import StudyResults
from analysis.stats import paired_comparisons
from analysis.tables import Table, TableEntry, baseline_variant, compared_metrics


def _resources(results: StudyResults) -> tuple[float, float]:
    """(GPUs, CPUs) per trial from the study file's `resources` (defaults 0 and 1)."""
    resources = results.study.data.get("resources") or {}
    try:
        return float(resources.get("gpus", 0.0) or 0.0), float(resources.get("cpus", 1.0) or 1.0)
    except (TypeError, ValueError, AttributeError):
        return 0.0, 1.0


def power_table(results: StudyResults, metrics: Sequence[str], reference: str, difference: float) -> Table | None:
    """Seeds for DEFAULT_POWER to detect the smallest difference of interest `difference`
    (printed unit), from the pilot's sd and from its upper confidence limit."""
    if not metrics:
        return None
    compared = paired_comparisons(
        results.rows, metrics, reference, results.level, variant_paths=results.study.variant_paths()
    ).to_pylist()
    plans = seeds_needed(compared, difference=difference, power=DEFAULT_POWER, level=results.level)
    if not plans:
        return None
    rows = []
    for plan in plans:
        rows.append(
            [
                TableEntry(plan.metric),
                TableEntry(plan.variant),
                TableEntry(swept_text(plan.swept)),
                TableEntry(str(plan.n_pilot)),
                TableEntry(f"{plan.observed:+.2f}" if math.isfinite(plan.observed) else "–"),
                TableEntry(f"{plan.sd:.2f}" if math.isfinite(plan.sd) else "–"),
                TableEntry(f"{plan.sd_upper:.2f}" if math.isfinite(plan.sd_upper) else "–"),
                TableEntry(plan.seeds_text()),
                TableEntry(plan.note),
            ]
        )
    header = [
        "metric",
        "variant",
        "config (swept values)",
        "seeds (pairs)",
        "difference",
        "sd of differences",
        f"sd, upper {SD_CONFIDENCE:.0%} limit",
        f"seeds for {DEFAULT_POWER:.0%} power to detect ±{difference:g}",
        "note",
    ]
    caption = (
        f"Seeds a paired t-test (two-sided at {1 - results.level:.2g}) needs for "
        f"{DEFAULT_POWER:.0%} power to detect a difference of {difference:g} (the smallest "
        f"difference of interest: `report.difference` or --difference, default "
        f"{DEFAULT_DIFFERENCE:g}; not the observed one): power(n) from the non-central t with "
        f"df = n−1 and ncp = d·√n / sd. The sd of a few paired seeds is uncertain: the range "
        f"runs from the seeds for the observed sd to those for its one-sided upper "
        f"{SD_CONFIDENCE:.0%} confidence limit (chi-square on n−1 df; Browne 1995). No power at "
        f"the observed difference is shown: it only restates the p-value (Hoenig and Heisey "
        f"2001). Differences and sds of accuracies in percentage points."
    )
    return Table(
        f"Seeds to detect a difference of {difference:g} against {reference!r}",
        header,
        rows,
        caption,
        label_columns=3,
        paper=False,
    )


def cost_table(results: StudyResults) -> Table:
    """GPU- and CPU-hours per variant and in total."""
    gpus, cpus = _resources(results)
    costs = run_costs(results.rows, gpus, cpus)
    rows = [
        [
            TableEntry(c.label),
            TableEntry(str(c.runs)),
            TableEntry(f"{c.hours:.4f}"),
            TableEntry(f"{c.gpu_hours:.4f}"),
            TableEntry(f"{c.cpu_hours:.4f}"),
        ]
        for c in costs
    ]
    caption = (
        f"Sum over the finished runs of their duration times the resources the study "
        f"file requests per trial ({gpus:g} GPU, {cpus:g} CPU)."
    )
    return Table("Compute used", ["variant", "runs", "hours", "GPU-hours", "CPU-hours"], rows, caption, paper=False)


def power_and_cost(
    doc: Document, results: StudyResults, metrics: Sequence[str], difference: float | None = None
) -> None:
    """Add the section to `doc` (after the paired comparisons); `difference` overrides the
    study file's `report.difference`."""
    doc.heading("Power and cost")
    reference = baseline_variant(results)
    metrics = compared_metrics(results, metrics)
    difference = difference if difference is not None else results.study.report.difference
    table = (
        power_table(results, metrics, reference, difference)
        if len(results.variants) >= 2 and reference in results.variants
        else None
    )
    if table is not None:
        doc.table(table)
    else:
        doc.paragraph("No paired comparison: no seeds to plan.", note=True)
    doc.table(cost_table(results))
