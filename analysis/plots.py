"""Figures of a study: sensitivity curves with CI bands, epoch time against K, metric
against label noise, per-shot-group bars, learning curves (a metric against the epoch),
average-K set-size histograms. Each function writes `<out_base>.png` and
`<out_base>.svg` and returns both paths.

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
from matplotlib.figure import Figure

from analysis.collect import PARAM_PREFIX
from analysis.stats import CurveSeries, curve_series, is_fraction_metric

# A log axis is used when the positive values span at least this ratio (about 1.7 decades).
LOG_SPAN = 50.0
SHOT_GROUPS = ("few", "medium", "many")
_PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf"]


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
    """Write `<out_base>.png` (150 dpi) and `<out_base>.svg`; return both paths."""
    out_base = Path(out_base)
    out_base.parent.mkdir(parents=True, exist_ok=True)
    png, svg = out_base.with_suffix(".png"), out_base.with_suffix(".svg")
    fig.savefig(png, dpi=150, bbox_inches="tight", metadata={"Software": None})
    fig.savefig(svg, bbox_inches="tight", metadata={"Date": None})
    return [png, svg]


def _new_axes(width: float = 6.4, height: float = 4.2):
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas renders the PNG; SVG uses matplotlib's SVG writer
    ax = fig.add_subplot()
    ax.grid(True, which="major", alpha=0.3)
    return fig, ax


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
) -> list[Path]:
    """Draw curve lines (mean, CI band) and flat reference lines; save PNG and SVG."""
    if not series:
        raise ValueError(f"nothing to plot for {metric} against {x}: no config has both")
    factor = _scale(metric, percent)
    xcol = PARAM_PREFIX + x
    xs_all = [p.get(xcol) for s in series if not s.flat for p in s.points]
    categorical = any(not _is_number(v) for v in xs_all if v is not None)
    categories = sorted({json.dumps(v) for v in xs_all}) if categorical else []

    def xpos(value):
        return categories.index(json.dumps(value)) if categorical else float(value)

    fig, ax = _new_axes()
    for index, s in enumerate(series):
        color = _PALETTE[index % len(_PALETTE)]
        label = f"{s.label} ({_n_label(s)})"
        if s.flat:
            p = s.points[0]
            ax.axhline(p["mean"] * factor, color=color, linestyle="--", linewidth=1.3,
                       label=label + ", one config")
            if p["ci_low"] is not None and math.isfinite(p["ci_low"]):
                ax.axhspan(p["ci_low"] * factor, p["ci_high"] * factor, color=color,
                           alpha=0.12, linewidth=0)
            continue
        points = [p for p in s.points if p.get(xcol) is not None]
        xv = [xpos(p[xcol]) for p in points]
        mean = [p["mean"] * factor for p in points]
        low, high = _band(points, metric, factor)
        ax.plot(xv, mean, marker="o", markersize=4, color=color, linewidth=1.6, label=label)
        ax.fill_between(xv, low, high, color=color, alpha=0.18, linewidth=0)
        single = [(xi, yi) for xi, yi, p in zip(xv, mean, points) if p["n"] < 2]
        if single:  # points without an interval: hollow markers
            ax.plot([a for a, _ in single], [b for _, b in single], linestyle="none",
                    marker="o", markersize=7, markerfacecolor="white", color=color)
    if categorical:
        ax.set_xticks(range(len(categories)), [str(json.loads(c)) for c in categories])
    else:
        scale, kwargs = choose_xscale(xs_all)
        ax.set_xscale(scale, **kwargs)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or _axis_label(metric, factor))
    band = f"band: {level:.0%} CI" if level else "band: CI"
    ax.set_title(title or f"{metric} vs {x} ({band})", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    return save_figure(fig, out_base)


def sensitivity_curve(
    summary: pa.Table | Sequence[Mapping[str, Any]],
    x: str,
    metric: str,
    out_base: str | Path,
    *,
    series_by: str = "variant",
    title: str | None = None,
    percent: bool | None = None,
) -> list[Path]:
    """`metric` (mean over seeds, CI band) against the swept param `x`, a line per variant.

    `summary` is `analysis.stats.summarize(...)`; lines are chosen by `stats.curve_series`.
    """
    rows = _rows(summary)
    series = curve_series(rows, x, metric, series_by=series_by)
    if not any(not s.flat for s in series):
        raise ValueError(f"no config sweeps {x!r} for metric {metric!r}: nothing to draw")
    level = next((r["level"] for r in rows if r.get("level")), None)
    return plot_series(series, x, metric, out_base, title=title, percent=percent, level=level)


def metric_vs_label_noise(
    summary: pa.Table | Sequence[Mapping[str, Any]],
    metric: str,
    out_base: str | Path,
    *,
    x: str = "data.label_noise",
) -> list[Path]:
    """`metric` against the label-noise probability p (thesis Table 4.4 as a figure)."""
    return sensitivity_curve(
        summary, x, metric, out_base,
        title=f"{metric} vs label-noise probability p ({x})",
    )


def epoch_time_vs_k(
    summary: pa.Table | Sequence[Mapping[str, Any]],
    out_base: str | Path,
    *,
    metric: str = "mean:epoch_time_s",
    x: str = "loss.k",
    series_by: str = "loss.name",
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
    return plot_series(series, x, metric, out_base, xlabel=f"K ({x})",
                       ylabel="epoch time (s)", percent=False, level=level,
                       title=f"Epoch time vs K per loss ({metric})")


def config_label(row: Mapping[str, Any]) -> str:
    """A config's legend label: its variant and swept values, `ce (loss.k=5)`."""
    swept = json.loads(row.get("swept") or "{}")
    label = str(row.get("variant"))
    if swept:
        label += " (" + ", ".join(f"{k}={v}" for k, v in sorted(swept.items())) + ")"
    return label


#: Most lines (configs) a learning-curve or set-size figure draws; more would be an
#: unreadable tangle (and the palette repeats).
MAX_LINES = len(_PALETTE)


def learning_curves(
    curves: Sequence[Mapping[str, Any]],
    metric: str,
    out_base: str | Path,
    *,
    order: Sequence[str] | None = None,
    level: float | None = None,
) -> list[Path]:
    """`metric` against the epoch, one line per config (mean over seeds, CI band).

    `curves` is `analysis.stats.epoch_curves(...)`; `order` lists config_ids in the order
    of the legend (default: as they come). At most MAX_LINES configs are drawn.
    """
    by_config: dict[str, list[Mapping[str, Any]]] = {}
    for row in curves:
        by_config.setdefault(row["config_id"], []).append(row)
    if not by_config:
        raise ValueError(f"no config logged {metric} at any epoch")
    if len(by_config) > MAX_LINES:
        raise ValueError(f"{len(by_config)} configs logged {metric}: more than the "
                         f"{MAX_LINES} lines one figure can show")
    ids = [c for c in (order or []) if c in by_config] + \
        [c for c in by_config if c not in (order or [])]
    factor = _scale(metric, None)
    fig, ax = _new_axes(width=7.2)
    for index, config_id in enumerate(ids):
        points = sorted(by_config[config_id], key=lambda r: r["epoch"])
        color = _PALETTE[index % len(_PALETTE)]
        ns = sorted({p["n"] for p in points})
        n_text = f"n={ns[0]}" if len(ns) == 1 else f"n={ns[0]}\u2013{ns[-1]}"
        epochs = [p["epoch"] for p in points]
        ax.plot(epochs, [p["mean"] * factor for p in points], color=color, linewidth=1.4,
                marker="o" if len(points) < 15 else None, markersize=3,
                label=f"{config_label(points[0])} ({n_text})")
        low, high = _band(points, metric, factor)
        ax.fill_between(epochs, low, high, color=color, alpha=0.15, linewidth=0)
    ax.set_xlabel("epoch")
    ax.set_ylabel(_axis_label(metric, factor))
    band = f"band: {level:.0%} CI" if level else "band: CI"
    ax.set_title(f"{metric} over the epochs ({band})", fontsize=10)
    ax.legend(fontsize=7, loc="best")
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
                linewidth=1.5, label=label)
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
) -> list[Path]:
    """Average-K set sizes on test (thesis Fig. 5.4): (a) one line per config, (b) the
    sets of one config split by the shot group of the label. Each series maps set size to
    the fraction of test inputs (mean over seeds, `stats.set_size_fractions`)."""
    if not by_config:
        raise ValueError(f"no run stored its average-{k} set sizes")
    if len(by_config) > MAX_LINES:
        raise ValueError(f"{len(by_config)} configs have average-{k} sets: more than the "
                         f"{MAX_LINES} lines one figure can show")
    end = _set_size_axis_end([f for _, f in by_config] + [f for _, f in by_shot])
    fig = Figure(figsize=(11.0, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    for ax in (left, right):
        ax.grid(True, which="major", alpha=0.3)
    _draw_set_sizes(left, by_config, end)
    left.set_title(f"(a) average-{k} set sizes per config", fontsize=10)
    if by_shot:
        _draw_set_sizes(right, by_shot, end)
        right.set_title(f"(b) {shot_config}: by shot group of the label", fontsize=9)
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
) -> list[Path]:
    """Bars of `<split>/<group>/<base_metric>` for the few/medium/many-shot groups, one bar
    per config, error bars = CI (thesis Tables 4.5, 4.6 and 5.2, numbers in parentheses)."""
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
    by_key = {(r["config_id"], r["metric"]): r for r in rows}
    factor = _scale(present[0], percent)
    width = 0.8 / max(1, len(configs))
    fig, ax = _new_axes(width=max(8.0, 3.5 + 0.35 * len(configs) * len(present)))
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
            low = row["ci_low"] if row["ci_low"] is not None else math.nan
            high = row["ci_high"] if row["ci_high"] is not None else math.nan
            err_low.append(mean - low * factor)
            err_high.append(high * factor - mean)
        positions = [g + (ci - (len(configs) - 1) / 2) * width for g in range(len(present))]
        n_text = "/".join(str(n) for n in sorted(n_values))
        seeds = "seed" if n_values == {1} else "seeds"
        ax.bar(positions, heights, width=width * 0.95, color=_PALETTE[ci % len(_PALETTE)],
               yerr=[err_low, err_high], capsize=3, label=f"{label} (n={n_text} {seeds})")
    ax.set_xticks(range(len(present)), [m.split("/")[1] + "-shot" for m in present])
    ax.set_ylabel(_axis_label(f"{split}/{base_metric}", factor))
    ax.set_title(f"{split}/{base_metric} per shot group (error bars: CI)", fontsize=10)
    fig.legend(fontsize=8, loc="outside right upper")
    return save_figure(fig, out_base)
