"""The comparison's figures: the critical-difference diagram (scikit-posthocs), each task's
paired differences against the reference seed by seed (a strip of points beside each interval),
and the aggregates with their intervals over the pooled values they summarise."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from analysis.comparison.aggregates import Aggregate
from analysis.comparison.ranks import RankTests
from analysis.comparison.tasks import Scores
from analysis.figures import FigureFile
from analysis.formatting import SEED_VALUES_UP_TO
from analysis.intervals import difference_bounds, is_fraction_metric, paired_test
from analysis.plot_style import save_figure

__all__ = ["cd_diagram", "task_differences", "aggregates_figure", "MAX_TASK_ROWS"]

#: tasks drawn in the figure of per-task differences (the paper table holds them all)
MAX_TASK_ROWS = 40


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _file(fig: Figure, out_base: Path, title: str, caption: str) -> FigureFile:
    png, svg = save_figure(fig, out_base)
    return FigureFile(title, png, svg, caption)


def cd_diagram(ranks: RankTests, level: float, colors: Mapping[str, str], out_base: Path) -> FigureFile:
    """Average ranks on an axis, variants that no Holm-corrected Wilcoxon test tells apart
    joined by a bar (scikit-posthocs' `critical_difference_diagram`, Demšar 2006 Fig. 1)."""
    import pandas as pd
    import scikit_posthocs as sp

    variants = ranks.variants
    fig = _figure(7.5, 1.2 + 0.32 * len(variants))
    ax = fig.add_subplot()
    matrix = pd.DataFrame(ranks.p_holm, index=variants, columns=variants)
    sp.critical_difference_diagram(
        ranks.average,
        matrix,
        alpha=1 - level,
        ax=ax,
        color_palette={v: colors[v] for v in variants},
        label_fmt_left="{label} ({rank:.2f})",
        label_fmt_right="({rank:.2f}) {label}",
    )
    ax.set_title(f"Average rank over {len(ranks.tasks)} tasks (1 = best)", fontsize=10)
    caption = (
        f"Average ranks (1 = best) over {len(ranks.tasks)} tasks; a bar joins variants whose pairwise "
        f"Wilcoxon signed-rank test, Holm-corrected, is not significant at {1 - level:.2g} (Benavoli et al. "
        f"2016), not Nemenyi's critical difference."
    )
    return _file(fig, out_base, "Critical-difference diagram", caption)


def task_differences(
    scores: Scores, reference: str, level: float, colors: Mapping[str, str], out_base: Path
) -> FigureFile | None:
    """Per task (a row), each variant minus the reference seed by seed: the paired differences
    as points (n <= 10), their mean and t interval as a bar."""
    others = [v for v in scores.variants if v != reference]
    tasks = [t for t in range(len(scores.tasks)) if (t, reference) in scores.entries]
    shown = tasks[:MAX_TASK_ROWS]
    if not others or not shown:
        return None
    factor = 100.0 if is_fraction_metric(scores.metric) else 1.0
    bounds = difference_bounds(scores.metric)
    fig = _figure(7.5, 1.4 + 0.28 * len(shown) * max(1, min(len(others), 4)) ** 0.5)
    ax = fig.add_subplot()
    step = 0.8 / max(len(others), 1)
    rng = np.random.default_rng(0)  # jitter of the points only
    for row, t in enumerate(shown):
        ref = dict(zip(scores.entries[(t, reference)].seeds, scores.entries[(t, reference)].values))
        for k, variant in enumerate(others):
            entry = scores.entry(t, variant)
            if entry is None:
                continue
            mine = dict(zip(entry.seeds, entry.values))
            common = sorted(mine.keys() & ref.keys())
            if not common:
                continue
            d = np.array([mine[s] - ref[s] for s in common]) * factor
            y = row - 0.4 + step * (k + 0.5)
            found = paired_test(d / factor, np.zeros(len(d)), level, bounds)
            label = variant if row == 0 else None
            if math.isfinite(found.low):
                ax.plot([found.low * factor, found.high * factor], [y, y], color=colors[variant], lw=2.2, label=label)
                label = None
            ax.plot([found.mean_diff * factor], [y], "|", color=colors[variant], ms=9, mew=2, label=label)
            if len(d) <= SEED_VALUES_UP_TO:
                jitter = rng.uniform(-0.25, 0.25, len(d)) * step
                ax.scatter(d, y + jitter, s=12, color=colors[variant], alpha=0.55, edgecolors="none", zorder=3)
    ax.axvline(0.0, color="#444", lw=0.8)
    ax.set_yticks(range(len(shown)), [scores.tasks[t].label for t in shown], fontsize=8)
    ax.set_ylim(len(shown) - 0.5, -0.5)
    unit = " (percentage points)" if factor == 100.0 else ""
    ax.set_xlabel(f"{scores.metric}: variant − {reference}{unit}")
    ax.legend(fontsize=8, loc="best")
    ax.grid(axis="x", alpha=0.3)
    more = f" The first {len(shown)} of {len(tasks)} tasks are drawn." if len(shown) < len(tasks) else ""
    caption = (
        f"Each task's paired differences against {reference!r}, seed by seed (points, when n ≤ "
        f"{SEED_VALUES_UP_TO}), their mean (tick) and {level:.0%} t interval (bar, cut at the difference's "
        f"range).{more}"
    )
    return _file(fig, out_base, f"Differences against {reference} by task", caption)


def aggregates_figure(
    iqms: Mapping[str, Aggregate],
    improvements: Mapping[str, Aggregate],
    pooled: Mapping[str, Sequence[float]],
    reference: str,
    metric: str,
    level: float,
    colors: Mapping[str, str],
    out_base: Path,
) -> FigureFile:
    """Left: each variant's IQM and interval over the strip of its pooled (task, seed) values;
    right: its probability of improving on the reference and interval, 0.5 marked."""
    factor = 100.0 if is_fraction_metric(metric) else 1.0
    variants = list(iqms)
    fig = _figure(10.0, 1.2 + 0.45 * len(variants))
    left, right = fig.subplots(1, 2, sharey=True)
    rng = np.random.default_rng(0)
    for i, variant in enumerate(variants):
        values = np.asarray(pooled.get(variant, ()), dtype=float) * factor
        left.scatter(values, i + rng.uniform(-0.18, 0.18, values.size), s=8, color=colors[variant], alpha=0.35, lw=0)
        found = iqms[variant]
        left.plot([found.low * factor, found.high * factor], [i, i], color=colors[variant], lw=4, solid_capstyle="butt")
        left.plot([found.value * factor], [i], "o", color="white", mec=colors[variant], mew=2, ms=6)
        if variant in improvements:
            poi = improvements[variant]
            right.plot([poi.low, poi.high], [i, i], color=colors[variant], lw=4, solid_capstyle="butt")
            right.plot([poi.value], [i], "o", color="white", mec=colors[variant], mew=2, ms=6)
    right.axvline(0.5, color="#444", lw=0.8, ls="--")
    right.set_xlim(-0.03, 1.03)
    left.set_yticks(range(len(variants)), variants)
    left.set_ylim(len(variants) - 0.5, -0.5)
    left.set_xlabel(f"IQM of {metric}" + (" (%)" if factor == 100.0 else "") + " · points: every (task, seed)")
    right.set_xlabel(f"P(variant beats {reference}) on a task")
    for ax in (left, right):
        ax.grid(axis="x", alpha=0.3)
    caption = (
        f"Left: interquartile mean over all (task, seed) values (circle) and its {level:.0%} stratified-bootstrap "
        f"interval (bar), over the values themselves (points). Right: the probability that a run of the variant "
        f"beats a run of {reference!r} on the same task, averaged over tasks, and its interval; 0.5 is a tie."
    )
    return _file(fig, out_base, "Aggregates over tasks and seeds", caption)
