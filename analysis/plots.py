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

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex, to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from analysis.collect import PARAM_PREFIX
from analysis.formatting import assignments, param_label
from analysis.stats import CurveSeries, curve_series, is_fraction_metric, lower_is_better

# A log axis is used when the positive values span at least this ratio (about 1.7 decades).
LOG_SPAN = 50.0
DPI = 150
FIGSIZE = (7.5, 4.5)  # one axes (inches): bars, learning curves
WIDE_FIGSIZE = (12.0, 4.5)  # two axes side by side: set sizes
PANEL_FIGSIZE = (10.0, 6.0)  # curves (one axes or small multiples alike) and heat maps
MAX_PANELS = 6
PANEL_LINES = 4
MAX_BARS = 8
MAX_REFERENCES = 4
MAX_LABEL = 52
SHOT_GROUPS = ("few", "medium", "many")
_PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf"]
_REFERENCE_PALETTE = ["#444444", "#8c564b", "#bcbd22", "#17becf"]
#: Most lines one axes draws; more would be an unreadable tangle (and the palette repeats).
MAX_LINES = len(_PALETTE)
#: how far the configs of one variant are shaded away from its colour (towards white, then
#: black, in turn): the first config keeps the colour itself
_SHADES = (0.0, 0.45, -0.35, 0.65, -0.55, 0.25, -0.2, 0.8)


def variant_colors(variants: Sequence[Any]) -> dict[Any, str]:
    """One colour per variant, in the study's order: a report passes the same map to every
    figure, so that a variant has one colour throughout."""
    return {v: _PALETTE[i % len(_PALETTE)] for i, v in enumerate(variants)}


def _shade(color: str, index: int) -> str:
    """The `index`-th shade of `color` (`_SHADES`)."""
    amount = _SHADES[index % len(_SHADES)]
    rgb = to_rgb(color)
    target = 1.0 if amount > 0 else 0.0
    return to_hex(tuple(c + abs(amount) * (target - c) for c in rgb))


def _config_colors(variants: Sequence[Any], colors: Mapping[Any, str] | None) -> list[str]:
    """The colour of each of a figure's lines or bars, given their variants in drawing order:
    the variant's colour (`colors`), shaded apart for its second, third... config; the
    palette in order when there is no map."""
    if colors is None:
        return [_PALETTE[i % len(_PALETTE)] for i in range(len(variants))]
    seen: dict[Any, int] = {}
    out = []
    for i, variant in enumerate(variants):
        base = colors.get(variant) or _PALETTE[i % len(_PALETTE)]
        out.append(_shade(base, seen.get(variant, 0)))
        seen[variant] = seen.get(variant, 0) + 1
    return out


def _rows(summary: pa.Table | Sequence[Mapping[str, Any]]) -> list[dict]:
    return summary.to_pylist() if isinstance(summary, pa.Table) else [dict(r) for r in summary]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(
        value)


def choose_xscale(values: Sequence[Any]) -> tuple[str, dict]:
    """('linear'|'log'|'symlog', kwargs for Axes.set_xscale) for the x values of a curve.

    Log when the values are positive and span >= LOG_SPAN; symlog (linear around 0 up to the
    smallest non-zero |x|) when they include 0 or negatives and the non-zero ones span
    >= LOG_SPAN, so that 0 (e.g. epsilon = 0 in thesis Table 4.2) stays on the axis.
    """
    numbers = [float(v) for v in values if _is_number(v)]
    nonzero = [abs(v) for v in numbers if v != 0.0]
    if len(nonzero) < 2:
        return "linear", {}
    span = max(nonzero) / min(nonzero)
    if span < LOG_SPAN:
        return "linear", {}
    if all(v > 0 for v in numbers):
        return "log", {}
    return "symlog", {"linthresh": min(nonzero), "linscale": 0.5}


def _n_label(series: CurveSeries) -> str:
    low, high = series.n_range
    if low == high:
        return f"n={low} seed" + ("" if low == 1 else "s")
    return f"n={low}\u2013{high} seeds"


def _scale(metric: str, percent: bool | None) -> float:
    if percent is None:
        percent = is_fraction_metric(metric)
    return 100.0 if percent else 1.0


def _axis_label(metric: str, factor: float) -> str:
    return f"{metric} (%)" if factor == 100.0 else metric


def _band(points: Sequence[Mapping[str, Any]], metric: str, factor: float
          ) -> tuple[list[float], list[float]]:
    """Lower and upper CI bounds to shade (NaN where there is no interval). An accuracy's
    t-interval over a few seeds can pass 0 or 100%; the band stops at the possible range."""
    lo, hi = (0.0, factor) if is_fraction_metric(metric) else (-math.inf, math.inf)

    def bound(p, key):
        value = p.get(key)
        return math.nan if value is None else min(max(value * factor, lo), hi)

    return [bound(p, "ci_low") for p in points], [bound(p, "ci_high") for p in points]


def save_figure(fig: Figure, out_base: str | Path) -> list[Path]:
    """Write `<out_base>.png` (DPI) and `<out_base>.svg` at the figure's own size (the
    constrained layout fits titles, labels and legends inside it); return both paths."""
    out_base = Path(out_base)
    out_base.parent.mkdir(parents=True, exist_ok=True)
    png, svg = out_base.with_suffix(".png"), out_base.with_suffix(".svg")
    fig.savefig(png, dpi=DPI, metadata={"Software": None})
    fig.savefig(svg, metadata={"Date": None})
    return [png, svg]


def _new_figure(size: tuple[float, float] = FIGSIZE) -> Figure:
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas renders the PNG; SVG uses matplotlib's SVG writer
    return fig


def _panel_grid(fig: Figure, panels: int, max_columns: int, sharey: bool = False) -> list:
    """The axes of `panels` small multiples, at most `max_columns` a row; the cells of the
    last row left over are hidden."""
    ncols = min(max_columns, panels)
    nrows = math.ceil(panels / ncols)
    axes = fig.subplots(nrows, ncols, sharey=sharey, squeeze=False).ravel()
    for extra in axes[panels:]:
        extra.set_axis_off()
    return list(axes)


def _new_axes(size: tuple[float, float] = FIGSIZE):
    fig = _new_figure(size)
    ax = fig.add_subplot()
    ax.grid(True, which="major", alpha=0.3)
    return fig, ax


def short(label: str, limit: int = MAX_LABEL) -> str:
    """A legend label cut to `limit` characters (an ellipsis marks the cut)."""
    return label if len(label) <= limit else label[: limit - 1] + "\u2026"


def _note(notes: list[str] | None, text: str) -> None:
    if notes is not None and text not in notes:
        notes.append(text)


def label_reference_lines(fig: Figure, labels: Mapping[Any, Sequence[tuple[float, str, str]]],
                          *, fontsize: float = 7.0) -> list:
    """Label horizontal reference lines at the right end of their axes, without overlaps.

    `labels` maps an axes to (y in data units, text, colour) items. The figure is laid out
    first (its constrained layout then frozen, so the labels cannot move the axes); each
    label sits just above its line, right-aligned inside the axes on a white ground, and a
    label that would overlap the one below is pushed up (the stack moved down if it passes
    the top of the axes). Returns the Text artists."""
    items = {ax: sorted(entries, key=lambda e: e[0]) for ax, entries in labels.items() if entries}
    if not items:
        return []
    fig.canvas.draw()  # final axes positions and limits
    fig.set_layout_engine("none")
    renderer = fig.canvas.get_renderer()
    texts = []
    for ax, entries in items.items():
        placed = [ax.text(0.99, y, short(text, 44), transform=ax.get_yaxis_transform(),
                          ha="right", va="bottom", fontsize=fontsize, color=color,
                          bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none",
                                "alpha": 0.85})
                  for y, text, color in entries]
        boxes = [t.get_window_extent(renderer) for t in placed]
        bottoms = [b.y0 for b in boxes]
        heights = [b.height + 2.0 for b in boxes]  # 2 px apart (the white ground's pad)
        for i in range(1, len(bottoms)):
            bottoms[i] = max(bottoms[i], bottoms[i - 1] + heights[i - 1])
        overflow = bottoms[-1] + heights[-1] - ax.bbox.y1
        if overflow > 0:
            bottoms[-1] -= overflow
            for i in range(len(bottoms) - 2, -1, -1):
                bottoms[i] = min(bottoms[i], bottoms[i + 1] - heights[i])
        to_data = ax.transData.inverted()
        for text, box, bottom in zip(placed, boxes, bottoms):
            if bottom != box.y0:
                # va="bottom" anchors the text's baseline box: move it by the pixel shift
                anchor = ax.transData.transform((0.0, text.get_position()[1]))
                text.set_y(to_data.transform((anchor[0], anchor[1] + bottom - box.y0))[1])
        texts += placed
    return texts


def _line_score(series: CurveSeries, lower: bool) -> float:
    """The best mean of a line (its highest, or lowest for a metric to minimise)."""
    means = [p["mean"] for p in series.points if _is_number(p.get("mean"))]
    if not means:
        return math.nan
    return min(means) if lower else max(means)


def _ranked(series: Sequence[CurveSeries], lower: bool) -> list[CurveSeries]:
    """Best line first (NaN last), ties kept in their order."""
    def key(s):
        score = _line_score(s, lower)
        return (math.isnan(score), score if lower else -score if not math.isnan(score) else 0.0)

    return sorted(series, key=key)


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
    docstring). A line has its variant's colour (`colors`, `variant_colors`). The legend sits
    inside the axes; the y axis spans the means and the intervals, but an interval far
    wider than the spread of the means (a t interval over two seeds) is cut by the axes and
    said so in `notes`. What is left out is appended to `notes`."""
    if not series:
        raise ValueError(f"nothing to plot for {metric} against {x}: no config has both")
    factor = _scale(metric, percent)
    lower = lower_is_better(metric)
    xcol = PARAM_PREFIX + x
    lines = _ranked([s for s in series if not s.flat], lower)
    flats = _ranked([s for s in series if s.flat], lower)
    if len(flats) > MAX_REFERENCES:
        _note(notes, f"{len(flats) - MAX_REFERENCES} single-config variant(s) not drawn as "
                     f"reference lines (the {MAX_REFERENCES} with the best mean are).")
        flats = flats[:MAX_REFERENCES]
    xs_all = [p.get(xcol) for s in lines for p in s.points]
    categorical = any(not _is_number(v) for v in xs_all if v is not None)
    categories = sorted({json.dumps(v) for v in xs_all if v is not None}) if categorical else []

    def xpos(value):
        return categories.index(json.dumps(value)) if categorical else float(value)

    if len(lines) <= MAX_LINES:
        fig, ax = _new_axes(PANEL_FIGSIZE)
        panels = [(ax, None, lines, [])]
    else:
        by_variant: dict[Any, list[CurveSeries]] = {}
        for s in lines:  # best first within each variant, variants by their best line
            by_variant.setdefault(s.variant, []).append(s)
        groups = list(by_variant.items())
        if len(groups) > MAX_PANELS:
            _note(notes, f"{len(groups) - MAX_PANELS} variant(s) not drawn (the "
                         f"{MAX_PANELS} with the best mean {metric} are).")
            groups = groups[:MAX_PANELS]
        _note(notes, f"More than {MAX_LINES} lines: one panel per variant with its "
                     f"{PANEL_LINES} lines of best mean {metric}; the grey band spans the "
                     f"means of its other lines.")
        fig = _new_figure(PANEL_FIGSIZE)
        grid = _panel_grid(fig, len(groups), 3, sharey=True)
        panels = [(ax, variant, group[:PANEL_LINES], group[PANEL_LINES:])
                  for ax, (variant, group) in zip(grid, groups)]

    references: dict[Any, list[tuple[float, str, str]]] = {}
    cut_bands = False
    flat_colors = _config_colors([f.variant for f in flats], colors) if colors is not None \
        else [_REFERENCE_PALETTE[i % len(_REFERENCE_PALETTE)] for i in range(len(flats))]
    for ax, variant, drawn, rest in panels:
        ax.grid(True, which="major", alpha=0.3)
        means_drawn: list[float] = []
        bands_drawn: list[float] = []
        line_colors = _config_colors([d.variant for d in drawn], colors)
        for index, s in enumerate(drawn):
            color = line_colors[index]
            label = s.label
            if variant is not None and label.startswith(f"{variant}, "):
                label = label[len(f"{variant}, "):]
            points = [p for p in s.points if p.get(xcol) is not None]
            xv = [xpos(p[xcol]) for p in points]
            mean = [p["mean"] * factor for p in points]
            low, high = _band(points, metric, factor)
            means_drawn += [m for m in mean if math.isfinite(m)]
            bands_drawn += [b for b in low + high if math.isfinite(b)]
            ax.plot(xv, mean, marker="o", markersize=3.5, color=color, linewidth=1.5,
                    label=short(f"{label} ({_n_label(s)})"))
            ax.fill_between(xv, low, high, color=color, alpha=0.16, linewidth=0)
            single = [(xi, yi) for xi, yi, p in zip(xv, mean, points) if p["n"] < 2]
            if single:  # points without an interval: hollow markers
                ax.plot([a for a, _ in single], [b for _, b in single], linestyle="none",
                        marker="o", markersize=6, markerfacecolor="white", color=color)
        if rest:
            envelope: dict[float, list[float]] = {}
            for s in rest:
                for p in s.points:
                    if p.get(xcol) is not None and _is_number(p.get("mean")):
                        envelope.setdefault(xpos(p[xcol]), []).append(p["mean"] * factor)
            xe = sorted(envelope)
            ax.fill_between(xe, [min(envelope[v]) for v in xe], [max(envelope[v]) for v in xe],
                            color="#999999", alpha=0.22, linewidth=0, zorder=0.5,
                            label=f"range of {len(rest)} other line(s)")
        for index, s in enumerate(flats):
            color = flat_colors[index]
            p = s.points[0]
            ax.axhline(p["mean"] * factor, color=color, linestyle="--", linewidth=1.2)
            means_drawn.append(p["mean"] * factor)
            if p["ci_low"] is not None and math.isfinite(p["ci_low"]):
                low, high = _band([p], metric, factor)
                ax.axhspan(low[0], high[0], color=color, alpha=0.10, linewidth=0)
                bands_drawn += [b for b in (low[0], high[0]) if math.isfinite(b)]
            references.setdefault(ax, []).append(
                (p["mean"] * factor, f"{s.label} (one config, n={p['n']})", color))
        if categorical:
            shown = _thin(categories)
            ax.set_xticks([categories.index(c) for c in shown],
                          [short(str(json.loads(c)), 12) for c in shown])
        else:
            scale, kwargs = choose_xscale(xs_all)
            ax.set_xscale(scale, **kwargs)
            values = sorted({float(v) for v in xs_all if _is_number(v)})
            if scale != "linear" and len(values) <= 12:  # the swept values, not 10^k ticks
                ax.set_xticks(values, [_tick(v) for v in values])
                ax.minorticks_off()
            if scale == "symlog" and values[0] >= 0:  # no empty negative half
                ax.set_xlim(-0.5 * kwargs["linthresh"], values[-1] * 1.6)
        cut_bands |= _fit_y(ax, means_drawn, bands_drawn)
        ax.set_xlabel(xlabel or param_label(x), fontsize=9)
        if variant is not None:
            total = len(drawn) + len(rest)
            ax.set_title(f"{variant}" + (f": {len(drawn)} best of {total} lines" if rest else ""),
                         fontsize=9)
            ax.legend(fontsize=6.5, loc="best")
    band = f"band: {level:.0%} CI" if level else "band: CI"
    heading = title or f"{metric} vs {param_label(x)} ({band})"
    if cut_bands:
        _note(notes, "Intervals far wider than the spread of the means (few seeds) are cut "
                     "by the axes; the tables give them whole.")
    if panels[0][1] is None:
        panels[0][0].set_title(heading, fontsize=10)
        panels[0][0].set_ylabel(ylabel or _axis_label(metric, factor))
        if lines:
            panels[0][0].legend(fontsize=7, loc="best", framealpha=0.9)
    else:
        fig.suptitle(heading, fontsize=10)
        for ax, *_ in panels:
            if ax.get_subplotspec().is_first_col():
                ax.set_ylabel(ylabel or _axis_label(metric, factor))
    label_reference_lines(fig, references)
    return save_figure(fig, out_base)


#: how far beyond the means the y axis goes for an interval, in spreads of the means
Y_REACH = 1.5


def _fit_y(ax, means: Sequence[float], bands: Sequence[float]) -> bool:
    """Y limits that show every mean and as much of every interval as is within `Y_REACH`
    spreads of the means (at least 0.5 % of their level, so equal means keep a range): one
    huge interval does not squash the lines. Returns whether an interval was cut."""
    if not means:
        return False
    low, high = min(means), max(means)
    spread = max(high - low, 0.005 * max(abs(low), abs(high)), 1e-9)
    floor, ceiling = low - Y_REACH * spread, high + Y_REACH * spread
    bottom = max(min([low, *bands]), floor)
    top = min(max([high, *bands]), ceiling)
    pad = 0.05 * (top - bottom)
    ax.set_ylim(bottom - pad, top + pad)
    return any(b < floor or b > ceiling for b in bands)


def _thin(values: Sequence[Any], most: int = 10) -> list[Any]:
    """At most `most` evenly spaced items of `values` (tick labels), first and last kept."""
    if len(values) <= most:
        return list(values)
    step = (len(values) - 1) / (most - 1)
    return [values[round(i * step)] for i in range(most)]


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
    rows = _rows(summary)
    series = curve_series(rows, x, metric, series_by=series_by)
    if not any(not s.flat for s in series):
        raise ValueError(f"no config sweeps {x!r} for metric {metric!r}: nothing to draw")
    level = next((r["level"] for r in rows if r.get("level")), None)
    return plot_series(series, x, metric, out_base, title=title, percent=percent, level=level,
                       notes=notes, colors=colors)


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
        summary, x, metric, out_base,
        title=f"{metric} vs the label-noise probability {param_label(x)}", notes=notes,
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
    rows = [r for r in _rows(summary) if r["metric"] == metric]
    series = curve_series(rows, x, metric, series_by=series_by)
    if not any(not s.flat for s in series):
        by_loss: dict[Any, list[dict]] = {}
        for row in rows:
            if row.get(PARAM_PREFIX + x) is not None:
                by_loss.setdefault(row.get(PARAM_PREFIX + series_by), []).append(row)
        series = []
        for loss, points in by_loss.items():
            points.sort(key=lambda r: float(r[PARAM_PREFIX + x]))
            series.append(CurveSeries(str(loss), None, points, flat=len(
                {r[PARAM_PREFIX + x] for r in points}) == 1 and len(by_loss) > 1))
    level = next((r["level"] for r in rows if r.get("level")), None)
    return plot_series(series, x, metric, out_base, xlabel=param_label(x),
                       ylabel="epoch time (s)", percent=False, level=level,
                       title=f"Epoch time vs K per loss ({metric})", notes=notes)


def config_label(row: Mapping[str, Any]) -> str:
    """A config's legend label: its variant and swept values, each parameter by its symbol
    (`noised_topk (ε=0.01, lr=0.1)`, `analysis.formatting.assignments`)."""
    swept = json.loads(row.get("swept") or "{}")
    label = str(row.get("variant"))
    if swept:
        label += " (" + ", ".join(assignments(swept)) + ")"
    return label


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
    chooses them: the report passes the best config of each variant first)."""
    by_config: dict[str, list[Mapping[str, Any]]] = {}
    for row in curves:
        by_config.setdefault(row["config_id"], []).append(row)
    if not by_config:
        raise ValueError(f"no config logged {metric} at any epoch")
    ids = [c for c in (order or []) if c in by_config] + \
        [c for c in by_config if c not in (order or [])]
    if len(ids) > MAX_LINES:
        _note(notes, f"{len(ids) - MAX_LINES} config(s) not drawn (at most {MAX_LINES} lines).")
        ids = ids[:MAX_LINES]
    factor = _scale(metric, None)
    fig, ax = _new_axes(FIGSIZE)
    line_colors = _config_colors([by_config[c][0].get("variant") for c in ids], colors)
    for index, config_id in enumerate(ids):
        points = sorted(by_config[config_id], key=lambda r: r["epoch"])
        color = line_colors[index]
        ns = sorted({p["n"] for p in points})
        n_text = f"n={ns[0]}" if len(ns) == 1 else f"n={ns[0]}\u2013{ns[-1]}"
        epochs = [p["epoch"] for p in points]
        ax.plot(epochs, [p["mean"] * factor for p in points], color=color, linewidth=1.4,
                marker="o" if len(points) < 15 else None, markersize=3,
                label=short(f"{config_label(points[0])} ({n_text})"))
        low, high = _band(points, metric, factor)
        ax.fill_between(epochs, low, high, color=color, alpha=0.15, linewidth=0)
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    first, last = ax.dataLim.intervalx
    if first == last:  # one epoch: a point at it, not a stretch of fractions around it
        ax.set_xlim(first - 1, last + 1)
    ax.set_ylabel(_axis_label(metric, factor))
    band = f"band: {level:.0%} CI" if level else "band: CI"
    ax.set_title(f"{metric} over the epochs ({band})", fontsize=10)
    fig.legend(fontsize=7, loc="outside lower center", ncols=2)
    return save_figure(fig, out_base)


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
        ax.step(range(end + 1), ys, where="mid", color=_PALETTE[index % len(_PALETTE)],
                linewidth=1.5, label=short(label))
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
        _note(notes, f"{len(by_config) - MAX_LINES} config(s) not drawn in (a) (at most "
                     f"{MAX_LINES} lines).")
        by_config = list(by_config)[:MAX_LINES]
    end = _set_size_axis_end([f for _, f in by_config] + [f for _, f in by_shot])
    fig = _new_figure(WIDE_FIGSIZE)
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
    per config, error bars = CI (thesis Tables 4.5, 4.6 and 5.2, numbers in parentheses).

    At most MAX_BARS configs, the first of `order` (the report passes the best config of
    each variant first); the figure's size does not depend on how many."""
    rows = _rows(summary)
    metrics = [f"{split}/{g}/{base_metric}" for g in groups]
    present = [m for m in metrics if any(r["metric"] == m for r in rows)]
    if not present:
        raise ValueError(f"no shot-group metric among {metrics} in the summary")
    firsts = {}
    for r in rows:
        if r["metric"] in present:
            firsts.setdefault(r["config_id"], r)
    if order is None:
        configs = sorted(firsts, key=lambda c: (str(firsts[c].get("variant")),
                                                firsts[c].get("swept") or ""))
    else:
        configs = [c for c in order if c in firsts] + [c for c in firsts if c not in order]
    if len(configs) > MAX_BARS:
        _note(notes, f"{len(configs) - MAX_BARS} config(s) not drawn (at most {MAX_BARS} "
                     f"bars per group).")
        configs = configs[:MAX_BARS]
    by_key = {(r["config_id"], r["metric"]): r for r in rows}
    factor = _scale(present[0], percent)
    width = 0.8 / max(1, len(configs))
    fig, ax = _new_axes(FIGSIZE)
    bar_colors = _config_colors([firsts[c].get("variant") for c in configs], colors)
    for ci, config_id in enumerate(configs):
        heights, err_low, err_high, label, n_values = [], [], [], None, set()
        for metric in present:
            row = by_key.get((config_id, metric))
            if row is None or row["n"] == 0:
                heights.append(math.nan), err_low.append(math.nan), err_high.append(math.nan)
                continue
            label = label or config_label(row)
            n_values.add(row["n"])
            mean = row["mean"] * factor
            heights.append(mean)
            (low,), (high,) = _band([row], metric, factor)  # within the metric's range
            err_low.append(mean - low)
            err_high.append(high - mean)
        positions = [g + (ci - (len(configs) - 1) / 2) * width for g in range(len(present))]
        n_text = "/".join(str(n) for n in sorted(n_values))
        seeds = "seed" if n_values == {1} else "seeds"
        ax.bar(positions, heights, width=width * 0.95, color=bar_colors[ci], edgecolor="white",
               yerr=[err_low, err_high], capsize=3,
               label=short(f"{label} (n={n_text} {seeds})"))
    ax.set_xticks(range(len(present)), [m.split("/")[1] + "-shot" for m in present])
    ax.set_ylabel(_axis_label(f"{split}/{base_metric}", factor))
    if is_fraction_metric(present[0]) and factor == 100.0:
        ax.set_ylim(0.0, 100.0)
    ax.set_title(f"{split}/{base_metric} per shot group (error bars: CI)", fontsize=10)
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
    rows = [r for r in _rows(summary) if r["metric"] == metric and _is_number(r.get("mean"))]
    factor = _scale(metric, percent)
    lower = lower_is_better(metric)
    grids = []
    for variant, (x, y) in pairs.items():
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
            grids.append((variant, x, y, cells, values_x, values_y))
    if not grids:
        raise ValueError(f"no variant has {metric} on a grid of two swept parameters")
    if len(grids) > MAX_PANELS:
        _note(notes, f"{len(grids) - MAX_PANELS} variant(s) not drawn (at most {MAX_PANELS} "
                     f"panels).")
        grids = grids[:MAX_PANELS]
    every = [v for *_, cells, _, _ in grids for v in cells.values()]
    vmin, vmax = min(every), max(every)
    if vmin == vmax:
        vmin, vmax = vmin - 0.5, vmax + 0.5
    fig = _new_figure(PANEL_FIGSIZE)
    axes = _panel_grid(fig, len(grids), 3)
    image = None
    cmap = "viridis_r" if lower else "viridis"
    for ax, (variant, x, y, cells, values_x, values_y) in zip(axes, grids):
        kxs = sorted(values_x, key=lambda k: _sort_value(values_x[k]))
        kys = sorted(values_y, key=lambda k: _sort_value(values_y[k]))
        data = [[cells.get((kx, ky), math.nan) for kx in kxs] for ky in kys]
        image = ax.imshow(data, origin="lower", aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax,
                          interpolation="nearest")
        shown_x, shown_y = _thin(range(len(kxs)), 8), _thin(range(len(kys)), 8)
        ax.set_xticks(shown_x, [_tick(values_x[kxs[i]]) for i in shown_x], fontsize=7,
                      rotation=45 if len(shown_x) > 5 else 0)
        ax.set_yticks(shown_y, [_tick(values_y[kys[i]]) for i in shown_y], fontsize=7)
        ax.set_xlabel(x, fontsize=8)
        ax.set_ylabel(y, fontsize=8)
        ax.set_title(f"{variant} ({len(cells)} configs)", fontsize=9)
        best = (min if lower else max)(cells, key=cells.get)
        bx, by = kxs.index(best[0]), kys.index(best[1])
        ax.add_patch(Rectangle((bx - 0.5, by - 0.5), 1, 1, fill=False, edgecolor="red",
                               linewidth=1.6))
        if len(kxs) <= 8 and len(kys) <= 8:
            for j, ky in enumerate(kys):
                for i, kx in enumerate(kxs):
                    if (kx, ky) in cells:
                        value = cells[(kx, ky)]
                        light = (value - vmin) / (vmax - vmin) < 0.5
                        ax.text(i, j, f"{value:.1f}" if factor == 100.0 else f"{value:.3g}",
                                ha="center", va="center", fontsize=6.5,
                                color="white" if light != lower else "black")
    fig.colorbar(image, ax=list(axes[:len(grids)]), shrink=0.9,
                 label=_axis_label(metric, factor) + " (mean over seeds)")
    fig.suptitle(f"Mean {metric} over two swept parameters (outlined: best)", fontsize=10)
    return save_figure(fig, out_base)


def _sort_value(value: Any) -> tuple:
    return (0, float(value), "") if _is_number(value) else (1, 0.0, json.dumps(value))


def _tick(value: Any) -> str:
    return f"{value:.3g}" if _is_number(value) else short(str(value), 10)


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
    config with CI error bars, and the published numbers (`published`: config_id -> metric
    -> percent) as black crosses joined by a dashed line.

    `metrics` are (bin label, metric path) in the bins' order. At most MAX_LINES configs,
    the first of `order` (the report passes the best config of each variant first)."""
    rows = _rows(summary)
    present = [(label, m) for label, m in metrics if any(r["metric"] == m for r in rows)]
    if not present:
        raise ValueError(f"no bin metric among {[m for _, m in metrics]} in the summary")
    firsts: dict[str, Mapping] = {}
    for r in rows:
        if r["metric"] in {m for _, m in present}:
            firsts.setdefault(r["config_id"], r)
    configs = [c for c in (order or []) if c in firsts] + [c for c in firsts if c not in (order or [])]
    if len(configs) > MAX_LINES:
        _note(notes, f"{len(configs) - MAX_LINES} config(s) not drawn (at most {MAX_LINES} lines).")
        configs = configs[:MAX_LINES]
    by_key = {(r["config_id"], r["metric"]): r for r in rows}
    factor = _scale(present[0][1], None)
    xs = list(range(len(present)))
    fig, ax = _new_axes(FIGSIZE)
    drawn_published = False
    line_colors = _config_colors([firsts[c].get("variant") for c in configs], colors)
    for ci, config_id in enumerate(configs):
        means, err_low, err_high, n_values = [], [], [], set()
        for _, metric in present:
            row = by_key.get((config_id, metric))
            if row is None or row["n"] == 0 or row["mean"] is None:
                means.append(math.nan), err_low.append(math.nan), err_high.append(math.nan)
                continue
            n_values.add(row["n"])
            mean = row["mean"] * factor
            (low,), (high,) = _band([row], metric, factor)
            means.append(mean)
            err_low.append(mean - low if math.isfinite(low) else 0.0)
            err_high.append(high - mean if math.isfinite(high) else 0.0)
        color = line_colors[ci]
        n_text = "/".join(str(n) for n in sorted(n_values))
        label = f"{config_label(firsts[config_id])} (n={n_text} seed{'' if n_values == {1} else 's'})"
        offset = (ci - (len(configs) - 1) / 2) * 0.06
        ax.errorbar([x + offset for x in xs], means, yerr=[err_low, err_high], color=color,
                    marker="o", markersize=4, capsize=3, linewidth=1.4, label=short(label))
        reference = (published or {}).get(config_id) or {}
        ref_values = [reference.get(metric, math.nan) for _, metric in present]
        if any(math.isfinite(v) for v in ref_values):
            ax.plot(xs, ref_values, color="black", linestyle="--", marker="x", markersize=7,
                    linewidth=1.0, label=None if drawn_published else short(
                        f"published{': ' + source if source else ''}", 70))
            drawn_published = True
    ax.set_xticks(xs, [label for label, _ in present])
    ax.set_xlabel("training images of the class")
    base = present[0][1].rsplit("/", 1)[-1]
    ax.set_ylabel(f"mean per-class {base} (%)" if factor == 100.0 else f"mean per-class {base}")
    if factor == 100.0:
        ax.set_ylim(0.0, 100.0)
    ax.set_title(f"{present[0][1].split('/', 1)[0]}/{base} by number of training images "
                 f"(error bars: CI)", fontsize=10)
    fig.legend(fontsize=7, loc="outside lower center", ncols=2)
    return save_figure(fig, out_base)


def _thin_points(counts: Sequence[float], values: Sequence[float], most: int
                 ) -> tuple[list[float], list[float]]:
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
    panels = [(label, data) for label, data in panels
              if any(math.isfinite(v) for v in data["mean"])]
    if not panels:
        raise ValueError("no run stored a per-class accuracy for a class with test images")
    if len(panels) > CLASS_PANELS:
        _note(notes, f"{len(panels) - CLASS_PANELS} config(s) not drawn (at most "
                     f"{CLASS_PANELS} panels).")
        panels = list(panels)[:CLASS_PANELS]
    factor = _scale(base_metric, None)
    fig = _new_figure(PANEL_FIGSIZE)
    axes = _panel_grid(fig, len(panels), 2, sharey=True)
    for index, (ax, (label, data)) in enumerate(zip(axes, panels)):
        pairs = [(float(c), float(v) * factor) for c, v in zip(data["train_count"], data["mean"])
                 if v is not None and math.isfinite(v)]
        counts, values = [c for c, _ in pairs], [v for _, v in pairs]
        shown_counts, shown_values = _thin_points(counts, values, MAX_CLASS_POINTS)
        if len(shown_counts) < len(counts):
            _note(notes, f"At most {MAX_CLASS_POINTS} classes drawn per panel, spread over the "
                         f"class sizes; the bin means use every class.")
        # a class with 0 training images sits at 0.5 on the log axis
        ax.scatter([max(c, 0.5) for c in shown_counts], shown_values, s=6, alpha=0.35,
                   color=_PALETTE[index % len(_PALETTE)], linewidths=0)
        bounds = _bin_bounds(counts, edges)
        centres, means = [], []
        for low, high in bounds:
            inside = [v for c, v in zip(counts, values)
                      if (c > low or (low == 0 and c >= 0)) and c <= high]
            if inside:
                top = high if math.isfinite(high) else max(counts)
                centres.append(math.sqrt(max(low, 0.5) * max(top, 0.5)))
                means.append(sum(inside) / len(inside))
        ax.plot(centres, means, color="black", marker="s", markersize=4, linewidth=1.4,
                label="mean per bin")
        ax.set_xscale("log")
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title(short(f"{label} (n={data['n']} seed{'' if data['n'] == 1 else 's'}, "
                           f"{len(counts)} classes)", 70), fontsize=8)
        ax.set_xlabel("training images of the class", fontsize=8)
        if factor == 100.0:
            ax.set_ylim(-2.0, 102.0)
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel(f"test {base_metric} of the class" + (" (%)" if factor == 100.0 else ""),
                          fontsize=8)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Per-class test {base_metric} against the number of training images "
                 f"(mean over seeds)", fontsize=10)
    return save_figure(fig, out_base)


def _bin_bounds(counts: Sequence[float], edges: Sequence[float] | None
                ) -> list[tuple[float, float]]:
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
