"""The comparison's tables: the paper table (tasks x variants), the average ranks, the pairwise
Wilcoxon tests, the aggregates over tasks and seeds (`analysis.tables.Table`, written by
`analysis.document` as HTML, Markdown and LaTeX)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from analysis.comparison.aggregates import Aggregate
from analysis.comparison.ranks import RankTests
from analysis.comparison.tasks import Scores
from analysis.formatting import auto_digits, format_mean_ci, p_text, seed_values_text, small_seed_note
from analysis.intervals import holm, is_fraction_metric, mean_ci, metric_bounds, paired_test
from analysis.tables import Table, TableEntry

__all__ = ["paper_table", "rank_table", "pairwise_table", "aggregate_table", "best_by_test"]


def _factor(metric: str) -> float:
    return 100.0 if is_fraction_metric(metric) else 1.0


def _digits(scores: Scores) -> int:
    if is_fraction_metric(scores.metric):
        return 1
    return auto_digits([e.mean for e in scores.entries.values()])


def best_by_test(scores: Scores, task: int, level: float) -> str | None:
    """The variant of the best mean on `task` when the paired t-test by seed says it beats each
    other variant (Holm-adjusted over those comparisons, p < 1 - level, in its favour); else None."""
    present = [v for v in scores.variants if (task, v) in scores.entries]
    if len(present) < 2:
        return None
    sign = -1.0 if scores.lower_is_better else 1.0
    best = max(present, key=lambda v: sign * scores.entries[(task, v)].mean)
    mine = dict(zip(scores.entries[(task, best)].seeds, scores.entries[(task, best)].values))
    pvalues, ahead = [], True
    for other in present:
        if other == best:
            continue
        theirs = dict(zip(scores.entries[(task, other)].seeds, scores.entries[(task, other)].values))
        common = sorted(mine.keys() & theirs.keys())
        found = paired_test([mine[s] for s in common], [theirs[s] for s in common], level)
        pvalues.append(found.p_value)
        ahead = ahead and math.isfinite(found.mean_diff) and sign * found.mean_diff > 0
    adjusted = holm(pvalues)
    return best if ahead and np.all(np.isfinite(adjusted)) and np.all(adjusted < 1 - level) else None


def paper_table(scores: Scores, ranks: RankTests, level: float) -> Table:
    """A row per task, a column per variant: mean and interval over seeds (t, clipped to the
    metric's range), the per-seed values under it (n <= 10); bold where the paired test says
    the best mean is best; the average rank in the last row."""
    factor, digits = _factor(scores.metric), _digits(scores)
    bounds = metric_bounds(scores.metric)
    rows, ns, clipped = [], [], 0
    seeds_used: set[int] = set()
    for t, task in enumerate(scores.tasks):
        best = best_by_test(scores, t, level)
        row = [TableEntry(task.label)]
        for variant in scores.variants:
            entry = scores.entry(t, variant)
            if entry is None or not entry.values:
                row.append(TableEntry("–", muted=True))
                continue
            ci = mean_ci(entry.values, level, bounds=bounds)
            seeds_used.update(entry.seeds)
            if ci.has_interval:
                ns.append(ci.n)
            clipped += ci.clipped
            if ci.clipped:
                text = f"{ci.mean * factor:.{digits}f} [{ci.low * factor:.{digits}f}, {ci.high * factor:.{digits}f}]"
            else:
                text = format_mean_ci(ci.mean * factor, ci.half_width * factor, digits)
            if entry.n != _typical(scores):
                text += f" (n={entry.n})"
            row.append(TableEntry(text, bold=variant == best, detail=seed_values_text(entry.values, factor, digits)))
        rows.append(row)
    average = ranks.average
    rows.append(
        [TableEntry(f"average rank ({len(ranks.tasks)} task{'s' if len(ranks.tasks) != 1 else ''})")]
        + [
            TableEntry(f"{average[v]:.2f}", bold=average[v] == min(average.values()))
            if v in average and ranks.tasks
            else TableEntry("–", muted=True)
            for v in scores.variants
        ]
    )
    unit = " (%)" if factor == 100.0 else ""
    caption = (
        f"{scores.metric}{unit}: mean ± half-width of the {level:.0%} Student-t interval over seeds "
        f"(n = {_typical(scores)} unless shown; the interval cut at the metric's range is shown as "
        f"[low, high]); per-seed values under each mean when n ≤ 10. Bold: the best mean of the task "
        f"where a paired t-test by seed finds it better than every other variant (Holm-corrected over "
        f"those comparisons, p < {1 - level:.2g}); no bold where the seeds cannot tell. Average rank: "
        f"1 = best, over the tasks where every ranked variant has a value (the rank table)."
    )
    return Table(
        f"{scores.metric} by task and variant",
        ["task"] + list(scores.variants),
        rows,
        caption,
        label_columns=1,
        note=small_seed_note(ns, clipped),
    )


def _typical(scores: Scores) -> int:
    ns = [e.n for e in scores.entries.values() if e.n]
    return max(set(ns), key=ns.count) if ns else 0


def rank_table(ranks: RankTests, level: float) -> Table:
    """Average rank of each variant (best first), its wins/ties/losses against the others."""
    average = ranks.average
    order = sorted(ranks.variants, key=lambda v: average[v])
    index = {v: i for i, v in enumerate(ranks.variants)}
    rows = []
    for variant in order:
        i = index[variant]
        wins = sum(ranks.record(i, j)[0] for j in range(len(ranks.variants)) if j != i)
        losses = sum(ranks.record(i, j)[2] for j in range(len(ranks.variants)) if j != i)
        column = ranks.ranks[:, i]
        rows.append(
            [
                TableEntry(variant),
                TableEntry(f"{average[variant]:.2f}"),
                TableEntry(f"{np.min(column):g}–{np.max(column):g}" if column.size else "–"),
                TableEntry(f"{wins} / {losses}"),
            ]
        )
    if math.isfinite(ranks.friedman_p):
        friedman = (
            f"Friedman's test over {len(ranks.tasks)} tasks and {len(ranks.variants)} variants: "
            f"chi² = {ranks.friedman_statistic:.3g} on {len(ranks.variants) - 1} df, p = {p_text(ranks.friedman_p)}"
            f" ({'the ranks differ' if ranks.friedman_p < 1 - level else 'no evidence that the ranks differ'} "
            f"at {1 - level:.2g})."
        )
    else:
        friedman = "No Friedman test (" + ("; ".join(ranks.notes) or "too few tasks or variants") + ")."
    caption = (
        f"Average rank over the {len(ranks.tasks)} tasks where every variant has a value (1 = best, ties "
        f"share the mean rank; Demšar 2006), the range of its ranks, and its task wins / losses against "
        f"the other variants summed. {friedman}"
    )
    return Table("Average ranks", ["variant", "average rank", "ranks", "wins / losses"], rows, caption, paper=True)


def pairwise_table(ranks: RankTests, level: float, lower_is_better: bool, factor: float) -> Table | None:
    """Every pair: wins/ties/losses over tasks, the median difference of task means, the
    Wilcoxon signed-rank p and its Holm correction (bold: significant)."""
    if ranks.p_raw is None or ranks.p_holm is None:  # set together
        return None
    k = len(ranks.variants)
    rows = []
    for i in range(k):
        for j in range(i + 1, k):
            wins, ties, losses = ranks.record(i, j)
            diff = float(np.median(ranks.means[:, i] - ranks.means[:, j])) * factor
            p_holm = ranks.p_holm[i, j]
            rows.append(
                [
                    TableEntry(ranks.variants[i]),
                    TableEntry(ranks.variants[j]),
                    TableEntry(f"{wins} / {ties} / {losses}"),
                    TableEntry(f"{diff:+.2f}"),
                    TableEntry(p_text(ranks.p_raw[i, j])),
                    TableEntry(p_text(p_holm), bold=bool(np.isfinite(p_holm) and p_holm < 1 - level)),
                ]
            )
    caption = (
        f"Each pair of variants on their per-task means over the {len(ranks.tasks)} tasks: wins / ties / "
        f"losses of the first ({'lower' if lower_is_better else 'higher'} is better), the median of the "
        f"per-task differences (first minus second{', percentage points' if factor == 100.0 else ''}), the "
        f"two-sided Wilcoxon signed-rank p and its Holm correction over the {k * (k - 1) // 2} pairs "
        f"(Benavoli et al. 2016; scikit-posthocs). Bold: Holm p < {1 - level:.2g}."
    )
    note = " ".join(n for n in ranks.notes if "Wilcoxon" in n)
    return Table(
        "Pairwise Wilcoxon signed-rank tests across tasks",
        ["variant", "against", "wins / ties / losses", "median difference", "p (Wilcoxon)", "p (Holm)"],
        rows,
        caption,
        label_columns=2,
        note=note,
    )


def aggregate_table(
    iqms: Mapping[str, Aggregate],
    improvements: Mapping[str, Aggregate],
    reference: str,
    metric: str,
    level: float,
    n_resamples: int,
    per_task: Mapping[str, Sequence[float]] | None = None,
) -> Table:
    """IQM of each variant and its probability of improving on the reference, with
    stratified-bootstrap intervals."""
    factor = _factor(metric)
    digits = 1 if factor == 100.0 else auto_digits([a.value for a in iqms.values()])
    rows = []
    for variant, found in iqms.items():
        improvement = improvements.get(variant)
        rows.append(
            [
                TableEntry(variant),
                TableEntry(
                    f"{found.value * factor:.{digits}f} "
                    f"[{found.low * factor:.{digits}f}, {found.high * factor:.{digits}f}]",
                    detail=_task_means_text((per_task or {}).get(variant), factor, digits),
                ),
                TableEntry(
                    f"{improvement.value:.2f} [{improvement.low:.2f}, {improvement.high:.2f}]"
                    if improvement is not None
                    else "(reference)",
                    bold=improvement is not None and (improvement.low > 0.5 or improvement.high < 0.5),
                    muted=improvement is None,
                ),
                TableEntry(f"{found.tasks} × {found.values / max(found.tasks, 1):.3g}"),
            ]
        )
    caption = (
        f"Interquartile mean of {metric}{' (%)' if factor == 100.0 else ''} over all (task, seed) values, and "
        f"the probability that a run of the variant beats a run of {reference!r} on the same task, averaged "
        f"over tasks (0.5: a tie); {level:.0%} percentile intervals of a stratified bootstrap ({n_resamples} "
        f"resamples of each task's seeds, tasks never resampled; scipy.stats.bootstrap), Agarwal et al. 2021. "
        f"Bold: the interval excludes 0.5."
    )
    header = ["variant", f"IQM [{level:.0%} CI]", f"P(improves on {reference}) [{level:.0%} CI]", "tasks × seeds"]
    return Table("Interquartile mean and probability of improvement", header, rows, caption)


def _task_means_text(values: Sequence[float] | None, factor: float, digits: int) -> str:
    if not values or len(values) > 10:
        return ""
    return "task means: " + ", ".join(f"{v * factor:.{digits}f}" for v in values)
