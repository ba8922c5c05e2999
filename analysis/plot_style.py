"""What every figure of `analysis.plots` shares: sizes and limits, colours, scales and
axis labels, CI bands, the strips of per-seed values beside a mean, reference-line labels,
saving a figure as PNG and SVG.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import ScaledTranslation, Transform

from analysis.colors import (
    PALETTE,
    shade,
    variant_colors,  # noqa: F401 (the figures' colours, shared)
)
from analysis.formatting import SEED_VALUES_UP_TO, assignments, shows_seed_values
from analysis.stats import CurveSeries, is_fraction_metric

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
REFERENCE_PALETTE = ["#444444", "#8c564b", "#bcbd22", "#17becf"]
#: Most lines one axes draws; more would be an unreadable tangle (and the palette repeats).
MAX_LINES = len(PALETTE)


def series_colors(variants: Sequence[Any], colors: Mapping[Any, str] | None) -> list[str]:
    """The colour of each of a figure's lines or bars, given their variants in drawing order:
    the variant's colour (`colors`), shaded apart for its second, third... config; the
    palette in order when there is no map."""
    if colors is None:
        return [PALETTE[i % len(PALETTE)] for i in range(len(variants))]
    seen: dict[Any, int] = {}
    out = []
    for i, variant in enumerate(variants):
        base = colors.get(variant) or PALETTE[i % len(PALETTE)]
        out.append(shade(base, seen.get(variant, 0)))
        seen[variant] = seen.get(variant, 0) + 1
    return out


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def choose_xscale(values: Sequence[Any]) -> tuple[str, dict]:
    """('linear'|'log'|'symlog', kwargs for Axes.set_xscale) for the x values of a curve.

    Log when the values are positive and span >= LOG_SPAN; symlog (linear around 0 up to the
    smallest non-zero |x|) when they include 0 or negatives and the non-zero ones span
    >= LOG_SPAN, so that 0 (e.g. epsilon = 0 in thesis Table 4.2) stays on the axis.
    """
    numbers = [float(v) for v in values if is_number(v)]
    nonzero = [abs(v) for v in numbers if v != 0.0]
    if len(nonzero) < 2:
        return "linear", {}
    span = max(nonzero) / min(nonzero)
    if span < LOG_SPAN:
        return "linear", {}
    if all(v > 0 for v in numbers):
        return "log", {}
    return "symlog", {"linthresh": min(nonzero), "linscale": 0.5}


def seeds_label(series: CurveSeries) -> str:
    low, high = series.n_range
    if low == high:
        return f"n={low} seed" + ("" if low == 1 else "s")
    return f"n={low}\u2013{high} seeds"


def display_factor(metric: str, percent: bool | None) -> float:
    if percent is None:
        percent = is_fraction_metric(metric)
    return 100.0 if percent else 1.0


def axis_label(metric: str, factor: float) -> str:
    return f"{metric} (%)" if factor == 100.0 else metric


def ci_band(points: Sequence[Mapping[str, Any]], metric: str, factor: float) -> tuple[list[float], list[float]]:
    """Lower and upper CI bounds to shade (NaN where there is no interval). An accuracy's
    t-interval over a few seeds can pass 0 or 100%; the band stops at the possible range."""
    lo, hi = (0.0, factor) if is_fraction_metric(metric) else (-math.inf, math.inf)

    def bound(p, key):
        value = p.get(key)
        return math.nan if value is None else min(max(value * factor, lo), hi)

    return [bound(p, "ci_low") for p in points], [bound(p, "ci_high") for p in points]


#: the gid of every strip of per-seed values (`seed_strip`): the SVG's group of its points
SEED_STRIP = "seed-values"
#: a per-seed point: its area (points², about 3 pt across) and opacity, small and light
#: beside the mean and its band, so that thousands of configs' figures stay readable
SEED_POINT_SIZE = 9.0
SEED_POINT_ALPHA = 0.55
#: how far a series' strip stands to the right of its means (points), and how much further
#: the next series' stands, so that the strips of lines at one x sit side by side
STRIP_GAP_PT = 3.5
STRIP_STEP_PT = 2.0
#: the sentence a figure that drew strips adds to its caption
STRIP_NOTE = f"Points: each seed's value, beside its mean where that mean is over at most {SEED_VALUES_UP_TO} seeds."


def strip_values(row: Mapping[str, Any]) -> list[float]:
    """The per-seed values (`values`, from the same collected rows as the mean) of a summary
    or per-epoch row whose figure shows them (`formatting.shows_seed_values`), else none."""
    values = row.get("values") or []
    return [float(v) for v in values] if shows_seed_values(len(values)) else []


def strip_offset(index: int) -> float:
    """How far (points) the strip of a figure's `index`-th series stands right of its means."""
    return STRIP_GAP_PT + STRIP_STEP_PT * index


def seed_strip(
    ax,
    xs: Sequence[float],
    rows: Sequence[Mapping[str, Any]],
    factor: float,
    color: str,
    *,
    beside_pt: float = STRIP_GAP_PT,
    spread: float = 0.0,
    transform: Transform | None = None,
) -> list[float]:
    """Each seed's value of every row of one series as a small light point of its colour, at
    the row's x (`xs`, data units unless `transform` says otherwise), `beside_pt` points to
    its right on any scale (linear, log, categorical), or spread evenly in seed order over
    `spread` x units centred on it (a bar); only rows over 2 to `SEED_VALUES_UP_TO` seeds.
    Returns the values drawn (in the axis' unit, for the y axis); the points join the data
    limits unless they are placed by another `transform`."""
    offsets = [
        (x + spread * (i / max(len(values) - 1, 1) - 0.5), v * factor)
        for x, row in zip(xs, rows)
        for values in [strip_values(row)]
        for i, v in enumerate(values)
    ]
    if not offsets:
        return []
    shift = ScaledTranslation(beside_pt / 72.0, 0.0, ax.figure.dpi_scale_trans)
    ax.scatter(
        [x for x, _ in offsets],
        [y for _, y in offsets],
        s=SEED_POINT_SIZE,
        color=color,
        alpha=SEED_POINT_ALPHA,
        linewidths=0,
        zorder=2.5,
        transform=(transform if transform is not None else ax.transData) + shift,
        gid=SEED_STRIP,
    )
    if transform is None:
        ax.update_datalim(offsets)
        ax.autoscale_view()
    return [y for _, y in offsets]


def save_figure(fig: Figure, out_base: str | Path) -> list[Path]:
    """Write `<out_base>.png` (DPI) and `<out_base>.svg` at the figure's own size (the
    constrained layout fits titles, labels and legends inside it); return both paths."""
    out_base = Path(out_base)
    out_base.parent.mkdir(parents=True, exist_ok=True)
    png, svg = out_base.with_suffix(".png"), out_base.with_suffix(".svg")
    fig.savefig(png, dpi=DPI, metadata={"Software": None})
    fig.savefig(svg, metadata={"Date": None})
    return [png, svg]


def new_figure(size: tuple[float, float] = FIGSIZE) -> Figure:
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas renders the PNG; SVG uses matplotlib's SVG writer
    return fig


def panel_grid(fig: Figure, panels: int, max_columns: int, sharey: bool = False) -> list:
    """The axes of `panels` small multiples, at most `max_columns` a row; the cells of the
    last row left over are hidden."""
    ncols = min(max_columns, panels)
    nrows = math.ceil(panels / ncols)
    axes = fig.subplots(nrows, ncols, sharey=sharey, squeeze=False).ravel()
    for extra in axes[panels:]:
        extra.set_axis_off()
    return list(axes)


def new_axes(size: tuple[float, float] = FIGSIZE):
    fig = new_figure(size)
    ax = fig.add_subplot()
    ax.grid(True, which="major", alpha=0.3)
    return fig, ax


def short(label: str, limit: int = MAX_LABEL) -> str:
    """A legend label cut to `limit` characters (an ellipsis marks the cut)."""
    return label if len(label) <= limit else label[: limit - 1] + "\u2026"


def add_note(notes: list[str] | None, text: str) -> None:
    if notes is not None and text not in notes:
        notes.append(text)


def label_reference_lines(
    fig: Figure, labels: Mapping[Any, Sequence[tuple[float, str, str]]], *, fontsize: float = 7.0
) -> list:
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
    renderer = cast(FigureCanvasAgg, fig.canvas).get_renderer()  # new_figure's canvas
    texts = []
    for ax, entries in items.items():
        placed = [
            ax.text(
                0.99,
                y,
                short(text, 44),
                transform=ax.get_yaxis_transform(),
                ha="right",
                va="bottom",
                fontsize=fontsize,
                color=color,
                bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.85},
            )
            for y, text, color in entries
        ]
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
    means = [p["mean"] for p in series.points if is_number(p.get("mean"))]
    if not means:
        return math.nan
    return min(means) if lower else max(means)


def best_first(series: Sequence[CurveSeries], lower: bool) -> list[CurveSeries]:
    """Best line first (NaN last), ties kept in their order."""

    def key(s):
        score = _line_score(s, lower)
        return (math.isnan(score), score if lower else -score if not math.isnan(score) else 0.0)

    return sorted(series, key=key)


#: how far beyond the means the y axis goes for an interval, in spreads of the means
Y_REACH = 1.5


def fit_y_axis(ax, means: Sequence[float], bands: Sequence[float], seeds: Sequence[float] = ()) -> bool:
    """Y limits that show every mean, every per-seed value drawn (`seeds`: observed values,
    never out of range as a two-seed interval can be) and as much of every interval as is
    within `Y_REACH` spreads of the means (at least 0.5 % of their level, so equal means keep
    a range): one huge interval does not squash the lines. Returns whether an interval was cut."""
    if not means:
        return False
    low, high = min(means), max(means)
    spread = max(high - low, 0.005 * max(abs(low), abs(high)), 1e-9)
    floor, ceiling = low - Y_REACH * spread, high + Y_REACH * spread
    bottom = min([max(min([low, *bands]), floor), *seeds])
    top = max([min(max([high, *bands]), ceiling), *seeds])
    pad = 0.05 * (top - bottom)
    ax.set_ylim(bottom - pad, top + pad)
    return any(b < bottom or b > top for b in bands)


def thinned(values: Sequence[Any], most: int = 10) -> list[Any]:
    """At most `most` evenly spaced items of `values` (tick labels), first and last kept."""
    if len(values) <= most:
        return list(values)
    step = (len(values) - 1) / (most - 1)
    return [values[round(i * step)] for i in range(most)]


def config_label(row: Mapping[str, Any]) -> str:
    """A config's legend label: its variant and swept values, each parameter by its symbol
    (`noised_topk (ε=0.01, lr=0.1)`, `analysis.formatting.assignments`)."""
    swept = json.loads(row.get("swept") or "{}")
    label = str(row.get("variant"))
    if swept:
        label += " (" + ", ".join(assignments(swept)) + ")"
    return label


def sort_value(value: Any) -> tuple:
    return (0, float(value), "") if is_number(value) else (1, 0.0, json.dumps(value))


def tick_label(value: Any) -> str:
    return f"{value:.3g}" if is_number(value) else short(str(value), 10)
