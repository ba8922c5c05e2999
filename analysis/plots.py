"""Figures of a study: sensitivity curves with CI bands, epoch time against K, metric
against label noise, per-shot-group bars, learning curves (a metric against the epoch),
average-K set-size histograms, heat maps of a metric over two swept parameters, accuracy
by number of training images (per bin, and per class). Each
function writes `<out_base>.png` and `<out_base>.svg` and returns both paths.

No figure grows with the number of configs: every figure has a fixed size in inches (saved
without a tight bounding box, so the PNG is exactly `FIGSIZE x DPI` pixels), draws at most
`MAX_LINES` lines or `MAX_BARS` bar groups, and summarises the rest: a curve with more lines
than that becomes small multiples by variant (at most `MAX_PANELS` panels, the
`PANEL_LINES` best lines of each, the others as a grey band spanning their range), the bars
and learning curves show the configs chosen by the caller (the best of each variant), and
legend labels are cut at `MAX_LABEL` characters. What was left out is said in the figure
and appended to the caller's `notes` list (the report puts it in the caption). Reference
lines (a variant with a single config) are labelled at the right edge of the axes, the
labels pushed apart so that they never overlap.

Only matplotlib's object API is used: every `Figure` is attached to an Agg canvas
(`FigureCanvasAgg`), so no GUI backend is needed and neither pyplot's global state nor the
caller's chosen backend is touched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from analysis.colors import PALETTE
from analysis.intervals import table_rows
from analysis.plot_curves import (
    epoch_time_vs_k,
    heatmaps,
    learning_curves,
    metric_vs_label_noise,
    plot_series,
    sensitivity_curve,
)
from analysis.plot_style import (
    DPI,
    FIGSIZE,
    MAX_BARS,
    MAX_LINES,
    PANEL_FIGSIZE,
    SHOT_GROUPS,
    STRIP_NOTE,
    WIDE_FIGSIZE,
    add_note,
    axis_label,
    choose_xscale,
    ci_band,
    config_label,
    display_factor,
    new_axes,
    new_figure,
    panel_grid,
    save_figure,
    seed_strip,
    series_colors,
    short,
    variant_colors,
)
from analysis.stats import is_fraction_metric

__all__ = [
    "DPI",
    "FIGSIZE",
    "MAX_BARS",
    "MAX_LINES",
    "PANEL_FIGSIZE",
    "SHOT_GROUPS",
    "WIDE_FIGSIZE",
    "choose_xscale",
    "config_label",
    "save_figure",
    "short",
    "variant_colors",
    "epoch_time_vs_k",
    "heatmaps",
    "learning_curves",
    "metric_vs_label_noise",
    "plot_series",
    "sensitivity_curve",
    "SET_SIZE_COVERAGE",
    "set_size_histograms",
    "shot_group_bars",
    "CLASS_PANELS",
    "MAX_CLASS_POINTS",
    "count_bin_accuracy",
    "per_class_accuracy",
]


#: the per-seed points on a bar: dark, for the bar is the series' colour
BAR_SEED_COLOR = "#1a1a1a"

#: The set-size axis stops at the size below which this share of every series lies; the
#: rest is drawn as one last bin "≥ size" (a few huge sets would squash the histogram).
SET_SIZE_COVERAGE = 0.99


def _set_size_axis_end(series: Sequence[Mapping[int, float]]) -> int:
    end = 1
    for fractions in series:
        cumulative = 0.0
        for size, fraction in sorted(fractions.items()):
            cumulative += fraction
            if cumulative >= SET_SIZE_COVERAGE - 1e-12:
                end = max(end, size)
                break
    return end


def _draw_set_sizes(ax, lines: Sequence[tuple[str, Mapping[int, float]]], end: int) -> None:
    for index, (label, fractions) in enumerate(lines):
        ys = [100.0 * fractions.get(size, 0.0) for size in range(end)]
        ys.append(100.0 * sum(f for size, f in fractions.items() if size >= end))
        ax.step(range(end + 1), ys, where="mid", color=PALETTE[index % len(PALETTE)], linewidth=1.5, label=short(label))
    ticks = sorted({int(t) for t in ax.get_xticks() if 0 <= t < end} | {end})
    ax.set_xticks(ticks, [str(t) for t in ticks[:-1]] + [f"\u2265{end}"])
    ax.set_xlim(-0.6, end + 0.6)
    ax.set_xlabel("set size")
    ax.set_ylabel("test inputs (%)")
    ax.legend(fontsize=7, loc="best")


def set_size_histograms(
    by_config: Sequence[tuple[str, Mapping[int, float]]],
    by_shot: Sequence[tuple[str, Mapping[int, float]]],
    k: str,
    out_base: str | Path,
    *,
    shot_config: str = "",
    notes: list[str] | None = None,
) -> list[Path]:
    """Average-K set sizes on test (thesis Fig. 5.4): (a) one line per config, (b) the
    sets of one config split by the shot group of the label. Each series maps set size to
    the fraction of test inputs (mean over seeds, `stats.set_size_fractions`). The first
    MAX_LINES configs are drawn."""
    if not by_config:
        raise ValueError(f"no run stored its average-{k} set sizes")
    if len(by_config) > MAX_LINES:
        add_note(notes, f"{len(by_config) - MAX_LINES} config(s) not drawn in (a) (at most {MAX_LINES} lines).")
        by_config = list(by_config)[:MAX_LINES]
    end = _set_size_axis_end([f for _, f in by_config] + [f for _, f in by_shot])
    fig = new_figure(WIDE_FIGSIZE)
    left, right = fig.subplots(1, 2)
    for ax in (left, right):
        ax.grid(True, which="major", alpha=0.3)
    _draw_set_sizes(left, by_config, end)
    left.set_title(f"(a) average-{k} set sizes per config", fontsize=10)
    if by_shot:
        _draw_set_sizes(right, by_shot, end)
        right.set_title(short(f"(b) {shot_config}: by shot group of the label", 70), fontsize=9)
    else:
        right.set_axis_off()
    return save_figure(fig, out_base)


def _bar_configs(
    rows: Sequence[Mapping[str, Any]], present: Sequence[str], order: Sequence[str] | None, notes: list[str] | None
) -> tuple[dict[str, Mapping[str, Any]], list[str]]:
    """({config: its first row of a `present` metric}, the configs drawn as bars): the first
    MAX_BARS of `order` (else by variant and swept values), the rest said in `notes`."""
    firsts: dict[str, Mapping[str, Any]] = {}
    for r in rows:
        if r["metric"] in present:
            firsts.setdefault(r["config_id"], r)
    if order is None:
        configs = sorted(firsts, key=lambda c: (str(firsts[c].get("variant")), firsts[c].get("swept") or ""))
    else:
        configs = [c for c in order if c in firsts] + [c for c in firsts if c not in order]
    if len(configs) > MAX_BARS:
        add_note(notes, f"{len(configs) - MAX_BARS} config(s) not drawn (at most {MAX_BARS} bars per group).")
        configs = configs[:MAX_BARS]
    return firsts, configs


def shot_group_bars(
    summary: pa.Table | Sequence[Mapping[str, Any]],
    base_metric: str,
    out_base: str | Path,
    *,
    split: str = "test",
    groups: Sequence[str] = SHOT_GROUPS,
    percent: bool | None = None,
    order: Sequence[str] | None = None,
    notes: list[str] | None = None,
    colors: Mapping[Any, str] | None = None,
) -> list[Path]:
    """Bars of `<split>/<group>/<base_metric>` for the few/medium/many-shot groups, one bar
    per config, error bars = CI (thesis Tables 4.5, 4.6 and 5.2, numbers in parentheses),
    each seed's value a dark point on its bar (the bar's own colour would hide it) where the
    mean is over at most `SEED_VALUES_UP_TO` seeds.

    At most MAX_BARS configs, the first of `order` (the report passes the best config of
    each variant first); the figure's size does not depend on how many."""
    rows = table_rows(summary)
    metrics = [f"{split}/{g}/{base_metric}" for g in groups]
    present = [m for m in metrics if any(r["metric"] == m for r in rows)]
    if not present:
        raise ValueError(f"no shot-group metric among {metrics} in the summary")
    firsts, configs = _bar_configs(rows, present, order, notes)
    by_key = {(r["config_id"], r["metric"]): r for r in rows}
    factor = display_factor(present[0], percent)
    width = 0.8 / max(1, len(configs))
    fig, ax = new_axes(FIGSIZE)
    bar_colors = series_colors([firsts[c].get("variant") for c in configs], colors)
    strips = False
    for ci, config_id in enumerate(configs):
        heights, err_low, err_high, label, n_values = [], [], [], None, set()
        for metric in present:
            row = by_key.get((config_id, metric))
            if row is None or row["n"] == 0:
                heights.append(math.nan)
                err_low.append(math.nan)
                err_high.append(math.nan)
                continue
            label = label or config_label(row)
            n_values.add(row["n"])
            mean = row["mean"] * factor
            heights.append(mean)
            (low,), (high,) = ci_band([row], metric, factor)  # within the metric's range
            err_low.append(mean - low)
            err_high.append(high - mean)
        positions = [g + (ci - (len(configs) - 1) / 2) * width for g in range(len(present))]
        n_text = "/".join(str(n) for n in sorted(n_values))
        seeds = "seed" if n_values == {1} else "seeds"
        ax.bar(
            positions,
            heights,
            width=width * 0.95,
            color=bar_colors[ci],
            edgecolor="white",
            yerr=[err_low, err_high],
            capsize=3,
            label=short(f"{label} (n={n_text} {seeds})"),
        )
        rows_drawn = [by_key.get((config_id, metric)) or {} for metric in present]
        strips |= bool(seed_strip(ax, positions, rows_drawn, factor, BAR_SEED_COLOR, beside_pt=0.0, spread=width * 0.5))
    if strips:
        add_note(notes, STRIP_NOTE)
    ax.set_xticks(range(len(present)), [m.split("/")[1] + "-shot" for m in present])
    ax.set_ylabel(axis_label(f"{split}/{base_metric}", factor))
    if is_fraction_metric(present[0]) and factor == 100.0:
        ax.set_ylim(0.0, 100.0)
    ax.set_title(f"{split}/{base_metric} per shot group (error bars: CI)", fontsize=10)
    fig.legend(fontsize=7, loc="outside lower center", ncols=2)
    return save_figure(fig, out_base)


# ----------------------------------------------------------------------------- class sizes

#: Panels of the per-class figure (one per config) and points drawn per panel at most.
CLASS_PANELS = 4
MAX_CLASS_POINTS = 5000


def count_bin_accuracy(
    summary: pa.Table | Sequence[Mapping[str, Any]],
    metrics: Sequence[tuple[str, str]],
    out_base: str | Path,
    *,
    published: Mapping[str, Mapping[str, float]] | None = None,
    source: str = "",
    order: Sequence[str] | None = None,
    notes: list[str] | None = None,
    colors: Mapping[Any, str] | None = None,
) -> list[Path]:
    """Mean per-class accuracy per bin of training images (thesis Table 3.1): a line per
    config with CI error bars (each seed's value beside them where the mean is over at most
    `SEED_VALUES_UP_TO` seeds), and the published numbers (`published`: config_id -> metric
    -> percent) as black crosses joined by a dashed line.

    `metrics` are (bin label, metric path) in the bins' order. At most MAX_LINES configs,
    the first of `order` (the report passes the best config of each variant first)."""
    rows = table_rows(summary)
    present = [(label, m) for label, m in metrics if any(r["metric"] == m for r in rows)]
    if not present:
        raise ValueError(f"no bin metric among {[m for _, m in metrics]} in the summary")
    firsts: dict[str, Mapping] = {}
    for r in rows:
        if r["metric"] in {m for _, m in present}:
            firsts.setdefault(r["config_id"], r)
    configs = [c for c in (order or []) if c in firsts] + [c for c in firsts if c not in (order or [])]
    if len(configs) > MAX_LINES:
        add_note(notes, f"{len(configs) - MAX_LINES} config(s) not drawn (at most {MAX_LINES} lines).")
        configs = configs[:MAX_LINES]
    by_key = {(r["config_id"], r["metric"]): r for r in rows}
    factor = display_factor(present[0][1], None)
    xs = list(range(len(present)))
    fig, ax = new_axes(FIGSIZE)
    drawn_published = strips = False
    line_colors = series_colors([firsts[c].get("variant") for c in configs], colors)
    for ci, config_id in enumerate(configs):
        means, err_low, err_high, n_values = _bin_means(by_key, config_id, present, factor)
        n_text = "/".join(str(n) for n in sorted(n_values))
        label = f"{config_label(firsts[config_id])} (n={n_text} seed{'' if n_values == {1} else 's'})"
        offset = (ci - (len(configs) - 1) / 2) * 0.06
        ax.errorbar(
            [x + offset for x in xs],
            means,
            yerr=[err_low, err_high],
            color=line_colors[ci],
            marker="o",
            markersize=4,
            capsize=3,
            linewidth=1.4,
            label=short(label),
        )
        rows_drawn = [by_key.get((config_id, metric)) or {} for _, metric in present]
        strips |= bool(seed_strip(ax, [x + offset for x in xs], rows_drawn, factor, line_colors[ci]))
        reference = (published or {}).get(config_id) or {}
        ref_values = [reference.get(metric, math.nan) for _, metric in present]
        if any(math.isfinite(v) for v in ref_values):
            ax.plot(
                xs,
                ref_values,
                color="black",
                linestyle="--",
                marker="x",
                markersize=7,
                linewidth=1.0,
                label=None if drawn_published else short(f"published{': ' + source if source else ''}", 70),
            )
            drawn_published = True
    if strips:
        add_note(notes, STRIP_NOTE)
    _label_bin_axes(ax, present, factor)
    fig.legend(fontsize=7, loc="outside lower center", ncols=2)
    return save_figure(fig, out_base)


def _bin_means(
    by_key: Mapping[tuple[str, str], Mapping], config_id: str, present: Sequence[tuple[str, str]], factor: float
) -> tuple[list[float], list[float], list[float], set[int]]:
    """(means, error bars below, error bars above, seed counts) of a config over the bins
    (NaN where it has no value, no bar where its interval is unknown)."""
    means, err_low, err_high, n_values = [], [], [], set()
    for _, metric in present:
        row = by_key.get((config_id, metric))
        if row is None or row["n"] == 0 or row["mean"] is None:
            means.append(math.nan)
            err_low.append(math.nan)
            err_high.append(math.nan)
            continue
        n_values.add(row["n"])
        mean = row["mean"] * factor
        (low,), (high,) = ci_band([row], metric, factor)
        means.append(mean)
        err_low.append(mean - low if math.isfinite(low) else 0.0)
        err_high.append(high - mean if math.isfinite(high) else 0.0)
    return means, err_low, err_high, n_values


def _label_bin_axes(ax, present: Sequence[tuple[str, str]], factor: float) -> None:
    """The bins as x ticks, the metric's name and unit, the title."""
    ax.set_xticks(list(range(len(present))), [label for label, _ in present])
    ax.set_xlabel("training images of the class")
    base = present[0][1].rsplit("/", 1)[-1]
    ax.set_ylabel(f"mean per-class {base} (%)" if factor == 100.0 else f"mean per-class {base}")
    if factor == 100.0:
        ax.set_ylim(0.0, 100.0)
    ax.set_title(f"{present[0][1].split('/', 1)[0]}/{base} by number of training images (error bars: CI)", fontsize=10)


def _thin_points(counts: Sequence[float], values: Sequence[float], most: int) -> tuple[list[float], list[float]]:
    """At most `most` points, spread over the classes sorted by training images (every
    class kept when there are fewer)."""
    order = sorted(range(len(counts)), key=lambda i: counts[i])
    if len(order) > most:
        step = len(order) / most
        order = [order[int(i * step)] for i in range(most)]
    return [counts[i] for i in order], [values[i] for i in order]


def per_class_accuracy(
    panels: Sequence[tuple[str, Mapping[str, Any]]],
    base_metric: str,
    out_base: str | Path,
    *,
    edges: Sequence[float] | None = None,
    notes: list[str] | None = None,
) -> list[Path]:
    """Per-class test accuracy against the class's number of training images (the class
    sizes of thesis Table 3.1, one dot per class), a panel per config, with the mean
    per-class accuracy of each bin of training images drawn over the dots.

    `panels`: (label, {"train_count": [...], "mean": [...] (per class, mean over seeds,
    NaN where the class has no test image), "n": seeds}). The bins are `edges` (the study's
    `eval.count_bins`) or, without them, powers of ten. At most CLASS_PANELS panels and
    MAX_CLASS_POINTS dots per panel: the figure's size does not grow with the classes or
    the configs."""
    panels = [(label, data) for label, data in panels if any(math.isfinite(v) for v in data["mean"])]
    if not panels:
        raise ValueError("no run stored a per-class accuracy for a class with test images")
    if len(panels) > CLASS_PANELS:
        add_note(notes, f"{len(panels) - CLASS_PANELS} config(s) not drawn (at most {CLASS_PANELS} panels).")
        panels = list(panels)[:CLASS_PANELS]
    factor = display_factor(base_metric, None)
    fig = new_figure(PANEL_FIGSIZE)
    axes = panel_grid(fig, len(panels), 2, sharey=True)
    for index, (ax, (label, data)) in enumerate(zip(axes, panels)):
        pairs = [
            (float(c), float(v) * factor)
            for c, v in zip(data["train_count"], data["mean"])
            if v is not None and math.isfinite(v)
        ]
        counts, values = [c for c, _ in pairs], [v for _, v in pairs]
        shown_counts, shown_values = _thin_points(counts, values, MAX_CLASS_POINTS)
        if len(shown_counts) < len(counts):
            add_note(
                notes,
                f"At most {MAX_CLASS_POINTS} classes drawn per panel, spread over the "
                f"class sizes; the bin means use every class.",
            )
        # a class with 0 training images sits at 0.5 on the log axis
        ax.scatter(
            [max(c, 0.5) for c in shown_counts],
            shown_values,
            s=6,
            alpha=0.35,
            color=PALETTE[index % len(PALETTE)],
            linewidths=0,
        )
        bounds = _bin_bounds(counts, edges)
        centres, means = [], []
        for low, high in bounds:
            inside = [v for c, v in zip(counts, values) if (c > low or (low == 0 and c >= 0)) and c <= high]
            if inside:
                top = high if math.isfinite(high) else max(counts)
                centres.append(math.sqrt(max(low, 0.5) * max(top, 0.5)))
                means.append(sum(inside) / len(inside))
        ax.plot(centres, means, color="black", marker="s", markersize=4, linewidth=1.4, label="mean per bin")
        ax.set_xscale("log")
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title(
            short(f"{label} (n={data['n']} seed{'' if data['n'] == 1 else 's'}, {len(counts)} classes)", 70), fontsize=8
        )
        ax.set_xlabel("training images of the class", fontsize=8)
        if factor == 100.0:
            ax.set_ylim(-2.0, 102.0)
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel(f"test {base_metric} of the class" + (" (%)" if factor == 100.0 else ""), fontsize=8)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Per-class test {base_metric} against the number of training images (mean over seeds)", fontsize=10)
    return save_figure(fig, out_base)


def _bin_bounds(counts: Sequence[float], edges: Sequence[float] | None) -> list[tuple[float, float]]:
    """(low, high] bins of training images: the given edges, else the powers of ten that
    cover the counts."""
    if not edges:
        top = max(counts) if counts else 1.0
        edges, e = [], 10.0
        while e < top:
            edges.append(e)
            e *= 10.0
    bounds = [0.0] + [float(e) for e in edges]
    return list(zip(bounds, bounds[1:])) + [(bounds[-1], math.inf)]
