"""Figures of a metric over a swept parameter or the epochs: sensitivity curves with CI
bands (small multiples by variant past `MAX_LINES`), metric against label noise, epoch
time against K, learning curves, heat maps over two swept parameters.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator
from matplotlib.transforms import blended_transform_factory

from analysis.collect import PARAM_PREFIX
from analysis.formatting import SEED_VALUES_UP_TO, param_label
from analysis.intervals import table_rows
from analysis.plot_style import (
    FIGSIZE,
    MAX_LINES,
    MAX_PANELS,
    MAX_REFERENCES,
    PANEL_FIGSIZE,
    PANEL_LINES,
    REFERENCE_PALETTE,
    STRIP_NOTE,
    add_note,
    axis_label,
    best_first,
    choose_xscale,
    ci_band,
    config_label,
    display_factor,
    fit_y_axis,
    is_number,
    label_reference_lines,
    new_axes,
    new_figure,
    panel_grid,
    save_figure,
    seed_strip,
    seeds_label,
    series_colors,
    short,
    sort_value,
    strip_offset,
    thinned,
    tick_label,
)
from analysis.stats import CurveSeries, curve_series, lower_is_better


def plot_series(
    series: Sequence[CurveSeries],
    x: str,
    metric: str,
    out_base: str | Path,
    *,
    title: str | None = None,
    xlabel: str | None = None,
    ylabel: str | None = None,
    percent: bool | None = None,
    level: float | None = None,
    notes: list[str] | None = None,
    colors: Mapping[Any, str] | None = None,
) -> list[Path]:
    """Draw curve lines (mean, CI band) and flat reference lines; save PNG and SVG.

    Up to MAX_LINES lines share one axes; more become small multiples by variant (module
    docstring). A line has its variant's colour (`colors`, `variant_colors`); beside each
    mean over at most `SEED_VALUES_UP_TO` seeds, a strip of its seeds' values in that colour
    (a reference line's at the left edge). The legend sits inside the axes; the y axis spans
    the means, the seeds' values and the intervals, but an interval far
    wider than the spread of the means (a t interval over two seeds) is cut by the axes and
    said so in `notes`. What is left out is appended to `notes`."""
    if not series:
        raise ValueError(f"nothing to plot for {metric} against {x}: no config has both")
    factor = display_factor(metric, percent)
    lower = lower_is_better(metric)
    lines = best_first([s for s in series if not s.flat], lower)
    flats = _reference_series(best_first([s for s in series if s.flat], lower), notes)
    axis = _SweptAxis.of(lines, PARAM_PREFIX + x)
    fig, panels = _curve_panels(lines, metric, notes)
    references: dict[Any, list[tuple[float, str, str]]] = {}
    shown: tuple[list[float], list[float], list[float]] = ([], [], [])  # means, band bounds, seeds' values
    flat_colors = (
        series_colors([f.variant for f in flats], colors)
        if colors is not None
        else [REFERENCE_PALETTE[i % len(REFERENCE_PALETTE)] for i in range(len(flats))]
    )
    for ax, variant, drawn, rest in panels:
        ax.grid(True, which="major", alpha=0.3)
        means, bands, seeds = _draw_lines(ax, variant, drawn, axis, metric, factor, colors)
        if rest:
            _draw_envelope(ax, rest, axis, factor)
        for index, s in enumerate(flats):
            line = _draw_reference(ax, s, (index, flat_colors[index]), metric, factor, (means, bands, seeds))
            references.setdefault(ax, []).append(line)
        axis.set_ticks(ax)
        for every, drawn_here in zip(shown, (means, bands, seeds)):
            every += drawn_here
        ax.set_xlabel(xlabel or param_label(x), fontsize=9)
        if variant is not None:
            total = len(drawn) + len(rest)
            ax.set_title(f"{variant}" + (f": {len(drawn)} best of {total} lines" if rest else ""), fontsize=9)
            ax.legend(fontsize=6.5, loc="best")
    if fit_y_axis(panels[0][0], *shown):  # one fit for all: the small multiples share their y axis
        add_note(
            notes,
            "Intervals far wider than the spread of the means (few seeds) are cut "
            "by the axes; the tables give them whole.",
        )
    if shown[2]:
        add_note(notes, STRIP_NOTE)
    band = f"band: {level:.0%} CI" if level else "band: CI"
    _label_curve_figure(
        fig, panels, title or f"{metric} vs {param_label(x)} ({band})", ylabel or axis_label(metric, factor)
    )
    label_reference_lines(fig, references)
    return save_figure(fig, out_base)


#: one axes of a curve figure: (axes, its variant or None for a single panel, the lines drawn,
#: the lines summed up by a grey band)
_CurvePanel = tuple[Any, Any, list[CurveSeries], list[CurveSeries]]


@dataclass
class _SweptAxis:
    """The x axis of a curve figure: the swept values of its lines (numbers, or categories
    placed at 0, 1, ... in their JSON order)."""

    column: str
    values: list[Any]
    categories: list[str]

    @classmethod
    def of(cls, lines: Sequence[CurveSeries], column: str) -> _SweptAxis:
        values = [p.get(column) for s in lines for p in s.points]
        categorical = any(not is_number(v) for v in values if v is not None)
        categories = sorted({json.dumps(v) for v in values if v is not None}) if categorical else []
        return cls(column, values, categories)

    def position(self, value: Any) -> float:
        return self.categories.index(json.dumps(value)) if self.categories else float(value)

    def set_ticks(self, ax) -> None:
        """Categories by name (thinned); numbers on a linear, log or symlog scale, ticked at
        the swept values when there are few."""
        if self.categories:
            shown = thinned(self.categories)
            ax.set_xticks([self.categories.index(c) for c in shown], [short(str(json.loads(c)), 12) for c in shown])
            return
        scale, kwargs = choose_xscale(self.values)
        ax.set_xscale(scale, **kwargs)
        values = sorted({float(v) for v in self.values if is_number(v)})
        if scale != "linear" and len(values) <= 12:  # the swept values, not 10^k ticks
            ax.set_xticks(values, [tick_label(v) for v in values])
            ax.minorticks_off()
        if scale == "symlog" and values[0] >= 0:  # no empty negative half
            ax.set_xlim(-0.5 * kwargs["linthresh"], values[-1] * 1.6)


def _reference_series(flats: list[CurveSeries], notes: list[str] | None) -> list[CurveSeries]:
    """The flat reference lines drawn: the `MAX_REFERENCES` best, the rest said in `notes`."""
    if len(flats) > MAX_REFERENCES:
        add_note(
            notes,
            f"{len(flats) - MAX_REFERENCES} single-config variant(s) not drawn as "
            f"reference lines (the {MAX_REFERENCES} with the best mean are).",
        )
        flats = flats[:MAX_REFERENCES]
    return flats


def _curve_panels(lines: list[CurveSeries], metric: str, notes: list[str] | None) -> tuple[Any, list[_CurvePanel]]:
    """(figure, its panels): one axes for up to MAX_LINES lines; else a panel per variant
    (at most MAX_PANELS) with its PANEL_LINES best lines, the others as a grey band."""
    if len(lines) <= MAX_LINES:
        fig, ax = new_axes(PANEL_FIGSIZE)
        return fig, [(ax, None, lines, [])]
    by_variant: dict[Any, list[CurveSeries]] = {}
    for s in lines:  # best first within each variant, variants by their best line
        by_variant.setdefault(s.variant, []).append(s)
    groups = list(by_variant.items())
    if len(groups) > MAX_PANELS:
        add_note(
            notes,
            f"{len(groups) - MAX_PANELS} variant(s) not drawn (the {MAX_PANELS} with the best mean {metric} are).",
        )
        groups = groups[:MAX_PANELS]
    add_note(
        notes,
        f"More than {MAX_LINES} lines: one panel per variant with its "
        f"{PANEL_LINES} lines of best mean {metric}; the grey band spans the "
        f"means of its other lines.",
    )
    fig = new_figure(PANEL_FIGSIZE)
    grid = panel_grid(fig, len(groups), 3, sharey=True)
    return fig, [(ax, variant, group[:PANEL_LINES], group[PANEL_LINES:]) for ax, (variant, group) in zip(grid, groups)]


def _draw_lines(
    ax,
    variant: Any,
    drawn: Sequence[CurveSeries],
    axis: _SweptAxis,
    metric: str,
    factor: float,
    colors: Mapping[Any, str] | None,
) -> tuple[list[float], list[float], list[float]]:
    """Each line's means with its CI band (points without an interval hollow) and the strips
    of its seeds' values; returns the (means, band bounds, seeds' values) drawn, for the y axis."""
    means_drawn: list[float] = []
    bands_drawn: list[float] = []
    seeds_drawn: list[float] = []
    line_colors = series_colors([d.variant for d in drawn], colors)
    for index, s in enumerate(drawn):
        color = line_colors[index]
        label = s.label
        if variant is not None and label.startswith(f"{variant}, "):
            label = label[len(f"{variant}, ") :]
        points = [p for p in s.points if p.get(axis.column) is not None]
        xv = [axis.position(p[axis.column]) for p in points]
        mean = [p["mean"] * factor for p in points]
        low, high = ci_band(points, metric, factor)
        means_drawn += [m for m in mean if math.isfinite(m)]
        bands_drawn += [b for b in low + high if math.isfinite(b)]
        ax.plot(
            xv,
            mean,
            marker="o",
            markersize=3.5,
            color=color,
            linewidth=1.5,
            label=short(f"{label} ({seeds_label(s)})"),
        )
        ax.fill_between(xv, low, high, color=color, alpha=0.16, linewidth=0)
        seeds_drawn += seed_strip(ax, xv, points, factor, color, beside_pt=strip_offset(index))
        single = [(xi, yi) for xi, yi, p in zip(xv, mean, points) if p["n"] < 2]
        if single:  # points without an interval: hollow markers
            ax.plot(
                [a for a, _ in single],
                [b for _, b in single],
                linestyle="none",
                marker="o",
                markersize=6,
                markerfacecolor="white",
                color=color,
            )
    return means_drawn, bands_drawn, seeds_drawn


def _draw_envelope(ax, rest: Sequence[CurveSeries], axis: _SweptAxis, factor: float) -> None:
    """The grey band spanning the means of a panel's lines not drawn."""
    envelope: dict[float, list[float]] = {}
    for s in rest:
        for p in s.points:
            if p.get(axis.column) is not None and is_number(p.get("mean")):
                envelope.setdefault(axis.position(p[axis.column]), []).append(p["mean"] * factor)
    xe = sorted(envelope)
    ax.fill_between(
        xe,
        [min(envelope[v]) for v in xe],
        [max(envelope[v]) for v in xe],
        color="#999999",
        alpha=0.22,
        linewidth=0,
        zorder=0.5,
        label=f"range of {len(rest)} other line(s)",
    )


def _draw_reference(
    ax,
    s: CurveSeries,
    place: tuple[int, str],
    metric: str,
    factor: float,
    drawn: tuple[list[float], list[float], list[float]],
) -> tuple[float, str, str]:
    """The `place` = (index, colour)-th flat reference line (dashed, its interval shaded, the
    strip of its seeds' values at the left edge); its mean, bounds and seeds' values appended
    to the lists `drawn`. Returns its (height, label, colour) for `label_reference_lines`."""
    index, color = place
    means, bands, seeds = drawn
    p = s.points[0]
    ax.axhline(p["mean"] * factor, color=color, linestyle="--", linewidth=1.2)
    means.append(p["mean"] * factor)
    if p["ci_low"] is not None and math.isfinite(p["ci_low"]):
        low, high = ci_band([p], metric, factor)
        ax.axhspan(low[0], high[0], color=color, alpha=0.10, linewidth=0)
        bands += [b for b in (low[0], high[0]) if math.isfinite(b)]
    edge = blended_transform_factory(ax.transAxes, ax.transData)
    seeds += seed_strip(ax, [0.0], [p], factor, color, beside_pt=strip_offset(index), transform=edge)
    return (p["mean"] * factor, f"{s.label} (one config, n={p['n']})", color)


def _label_curve_figure(fig, panels: Sequence[_CurvePanel], heading: str, ylabel: str) -> None:
    """The heading and the y label: on the single axes (with its legend), else the figure's
    title and the y label of each row's first panel."""
    ax, variant, lines, _ = panels[0]
    if variant is None:
        ax.set_title(heading, fontsize=10)
        ax.set_ylabel(ylabel)
        if lines:
            ax.legend(fontsize=7, loc="best", framealpha=0.9)
        return
    fig.suptitle(heading, fontsize=10)
    for ax, *_ in panels:
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel(ylabel)


def sensitivity_curve(
    summary: pa.Table | Sequence[Mapping[str, Any]],
    x: str,
    metric: str,
    out_base: str | Path,
    *,
    series_by: str = "variant",
    title: str | None = None,
    percent: bool | None = None,
    notes: list[str] | None = None,
    colors: Mapping[Any, str] | None = None,
) -> list[Path]:
    """`metric` (mean over seeds, CI band) against the swept param `x`, a line per variant.

    `summary` is `analysis.stats.summarize(...)`; lines are chosen by `stats.curve_series`
    (more than MAX_LINES: small multiples, see `plot_series`).
    """
    rows = table_rows(summary)
    series = curve_series(rows, x, metric, series_by=series_by)
    if not any(not s.flat for s in series):
        raise ValueError(f"no config sweeps {x!r} for metric {metric!r}: nothing to draw")
    level = next((r["level"] for r in rows if r.get("level")), None)
    return plot_series(
        series, x, metric, out_base, title=title, percent=percent, level=level, notes=notes, colors=colors
    )


def metric_vs_label_noise(
    summary: pa.Table | Sequence[Mapping[str, Any]],
    metric: str,
    out_base: str | Path,
    *,
    x: str = "data.label_noise",
    notes: list[str] | None = None,
    colors: Mapping[Any, str] | None = None,
) -> list[Path]:
    """`metric` against the label-noise probability p (thesis Table 4.4 as a figure)."""
    return sensitivity_curve(
        summary,
        x,
        metric,
        out_base,
        title=f"{metric} vs the label-noise probability {param_label(x)}",
        notes=notes,
        colors=colors,
    )


def epoch_time_vs_k(
    summary: pa.Table | Sequence[Mapping[str, Any]],
    out_base: str | Path,
    *,
    metric: str = "mean:epoch_time_s",
    x: str = "loss.k",
    series_by: str = "loss.name",
    notes: list[str] | None = None,
) -> list[Path]:
    """Mean epoch time against K, one line per loss (thesis Fig. 4.3).

    Lines come from the configs that sweep K; when no config sweeps K (K set by the
    variants), every config of a loss is a point at its own K.
    """
    rows = [r for r in table_rows(summary) if r["metric"] == metric]
    series = curve_series(rows, x, metric, series_by=series_by)
    if not any(not s.flat for s in series):
        by_loss: dict[Any, list[dict]] = {}
        for row in rows:
            if row.get(PARAM_PREFIX + x) is not None:
                by_loss.setdefault(row.get(PARAM_PREFIX + series_by), []).append(row)
        series = []
        for loss, points in by_loss.items():
            points.sort(key=lambda r: float(r[PARAM_PREFIX + x]))
            series.append(
                CurveSeries(
                    str(loss), None, points, flat=len({r[PARAM_PREFIX + x] for r in points}) == 1 and len(by_loss) > 1
                )
            )
    level = next((r["level"] for r in rows if r.get("level")), None)
    return plot_series(
        series,
        x,
        metric,
        out_base,
        xlabel=param_label(x),
        ylabel="epoch time (s)",
        percent=False,
        level=level,
        title=f"Epoch time vs K per loss ({metric})",
        notes=notes,
    )


#: the sentence a learning-curve figure that drew strips adds to its caption
LAST_EPOCH_STRIP_NOTE = (
    f"Points right of a line's last epoch: each seed's value there, where that mean is over at most "
    f"{SEED_VALUES_UP_TO} seeds (not at every epoch, where they would bury the bands)."
)


def learning_curves(
    curves: Sequence[Mapping[str, Any]],
    metric: str,
    out_base: str | Path,
    *,
    order: Sequence[str] | None = None,
    level: float | None = None,
    notes: list[str] | None = None,
    colors: Mapping[Any, str] | None = None,
) -> list[Path]:
    """`metric` against the epoch, one line per config (mean over seeds, CI band).

    `curves` is `analysis.stats.epoch_curves(...)`; `order` lists config_ids in the order
    of the legend (default: as they come). The first MAX_LINES configs are drawn (the caller
    chooses them: the report passes the best config of each variant first). Each seed's value
    is drawn at a line's last epoch only, a strip beside its end where that mean is over at
    most `SEED_VALUES_UP_TO` seeds: points at every epoch (hundreds of epochs, up to ten
    seeds, several lines) would bury the bands that show the spread along the way."""
    by_config: dict[str, list[Mapping[str, Any]]] = {}
    for row in curves:
        by_config.setdefault(row["config_id"], []).append(row)
    if not by_config:
        raise ValueError(f"no config logged {metric} at any epoch")
    ids = [c for c in (order or []) if c in by_config] + [c for c in by_config if c not in (order or [])]
    if len(ids) > MAX_LINES:
        add_note(notes, f"{len(ids) - MAX_LINES} config(s) not drawn (at most {MAX_LINES} lines).")
        ids = ids[:MAX_LINES]
    factor = display_factor(metric, None)
    fig, ax = new_axes(FIGSIZE)
    line_colors = series_colors([by_config[c][0].get("variant") for c in ids], colors)
    strips = False
    for index, config_id in enumerate(ids):
        points = sorted(by_config[config_id], key=lambda r: r["epoch"])
        color = line_colors[index]
        ns = sorted({p["n"] for p in points})
        n_text = f"n={ns[0]}" if len(ns) == 1 else f"n={ns[0]}\u2013{ns[-1]}"
        epochs = [p["epoch"] for p in points]
        ax.plot(
            epochs,
            [p["mean"] * factor for p in points],
            color=color,
            linewidth=1.4,
            marker="o" if len(points) < 15 else None,
            markersize=3,
            label=short(f"{config_label(points[0])} ({n_text})"),
        )
        low, high = ci_band(points, metric, factor)
        ax.fill_between(epochs, low, high, color=color, alpha=0.15, linewidth=0)
        strips |= bool(seed_strip(ax, epochs[-1:], points[-1:], factor, color, beside_pt=strip_offset(index)))
    if strips:
        add_note(notes, LAST_EPOCH_STRIP_NOTE)
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    first, last = ax.dataLim.intervalx
    if first == last:  # one epoch: a point at it, not a stretch of fractions around it
        ax.set_xlim(first - 1, last + 1)
    ax.set_ylabel(axis_label(metric, factor))
    band = f"band: {level:.0%} CI" if level else "band: CI"
    ax.set_title(f"{metric} over the epochs ({band})", fontsize=10)
    fig.legend(fontsize=7, loc="outside lower center", ncols=2)
    return save_figure(fig, out_base)


def heatmaps(
    summary: pa.Table | Sequence[Mapping[str, Any]],
    metric: str,
    pairs: Mapping[str, tuple[str, str]],
    out_base: str | Path,
    *,
    percent: bool | None = None,
    level: float | None = None,
    notes: list[str] | None = None,
) -> list[Path]:
    """The mean of `metric` over two swept parameters, one heat map per variant.

    `pairs` maps a variant to its (x, y) dotted paths. A cell is a pair of values; when a
    variant sweeps more parameters, the cell shows the best mean over the others. The
    variants share one colour scale; the best cell of each is outlined. At most MAX_PANELS
    variants (in the order of `pairs`); the figure's size is fixed, so a grid of many
    values has small cells and thinned tick labels (values written in the cells up to 8 x 8)."""
    rows = [r for r in table_rows(summary) if r["metric"] == metric and is_number(r.get("mean"))]
    factor = display_factor(metric, percent)
    lower = lower_is_better(metric)
    grids = [
        grid for grid in (_heat_grid(rows, variant, x, y, factor, lower) for variant, (x, y) in pairs.items()) if grid
    ]
    if not grids:
        raise ValueError(f"no variant has {metric} on a grid of two swept parameters")
    if len(grids) > MAX_PANELS:
        add_note(notes, f"{len(grids) - MAX_PANELS} variant(s) not drawn (at most {MAX_PANELS} panels).")
        grids = grids[:MAX_PANELS]
    every = [v for grid in grids for v in grid.cells.values()]
    vmin, vmax = min(every), max(every)
    if vmin == vmax:
        vmin, vmax = vmin - 0.5, vmax + 0.5
    fig = new_figure(PANEL_FIGSIZE)
    axes = panel_grid(fig, len(grids), 3)
    image: Any = None
    for ax, grid in zip(axes, grids):
        image = _draw_heat_map(ax, grid, vmin, vmax, factor, lower)
    fig.colorbar(
        image, ax=list(axes[: len(grids)]), shrink=0.9, label=axis_label(metric, factor) + " (mean over seeds)"
    )
    fig.suptitle(f"Mean {metric} over two swept parameters (outlined: best)", fontsize=10)
    return save_figure(fig, out_base)


@dataclass
class _HeatGrid:
    """A variant's heat map: the best mean of each (x, y) pair of values, keyed by their JSON
    texts, and the values behind those texts."""

    variant: str
    x: str
    y: str
    cells: dict[tuple[str, str], float]
    values_x: dict[str, Any]
    values_y: dict[str, Any]


def _heat_grid(
    rows: Sequence[Mapping[str, Any]], variant: str, x: str, y: str, factor: float, lower: bool
) -> _HeatGrid | None:
    """The variant's grid over (x, y), the best mean over its other parameters in each cell;
    None unless it has at least two values of each."""
    cells: dict[tuple[str, str], float] = {}
    values_x, values_y = {}, {}
    for r in rows:
        vx, vy = r.get(PARAM_PREFIX + x), r.get(PARAM_PREFIX + y)
        if r.get("variant") != variant or vx is None or vy is None:
            continue
        kx, ky = json.dumps(vx), json.dumps(vy)
        values_x[kx], values_y[ky] = vx, vy
        mean = r["mean"] * factor
        old = cells.get((kx, ky))
        if old is None or (mean < old if lower else mean > old):
            cells[(kx, ky)] = mean
    if len(values_x) >= 2 and len(values_y) >= 2:
        return _HeatGrid(variant, x, y, cells, values_x, values_y)
    return None


def _draw_heat_map(ax, grid: _HeatGrid, vmin: float, vmax: float, factor: float, lower: bool):
    """One panel: the grid on the shared colour scale, thinned ticks, the best cell outlined,
    the values written in the cells up to 8 x 8. Returns its image (for the colour bar)."""
    kxs = sorted(grid.values_x, key=lambda k: sort_value(grid.values_x[k]))
    kys = sorted(grid.values_y, key=lambda k: sort_value(grid.values_y[k]))
    cells = grid.cells
    data = [[cells.get((kx, ky), math.nan) for kx in kxs] for ky in kys]
    cmap = "viridis_r" if lower else "viridis"
    image = ax.imshow(data, origin="lower", aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    shown_x, shown_y = thinned(range(len(kxs)), 8), thinned(range(len(kys)), 8)
    ax.set_xticks(
        shown_x,
        [tick_label(grid.values_x[kxs[i]]) for i in shown_x],
        fontsize=7,
        rotation=45 if len(shown_x) > 5 else 0,
    )
    ax.set_yticks(shown_y, [tick_label(grid.values_y[kys[i]]) for i in shown_y], fontsize=7)
    ax.set_xlabel(grid.x, fontsize=8)
    ax.set_ylabel(grid.y, fontsize=8)
    ax.set_title(f"{grid.variant} ({len(cells)} configs)", fontsize=9)
    best = (min if lower else max)(cells, key=lambda cell: cells[cell])
    bx, by = kxs.index(best[0]), kys.index(best[1])
    ax.add_patch(Rectangle((bx - 0.5, by - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.6))
    if len(kxs) <= 8 and len(kys) <= 8:
        for j, ky in enumerate(kys):
            for i, kx in enumerate(kxs):
                if (kx, ky) in cells:
                    value = cells[(kx, ky)]
                    light = (value - vmin) / (vmax - vmin) < 0.5
                    ax.text(
                        i,
                        j,
                        f"{value:.1f}" if factor == 100.0 else f"{value:.3g}",
                        ha="center",
                        va="center",
                        fontsize=6.5,
                        color="white" if light != lower else "black",
                    )
    return image
