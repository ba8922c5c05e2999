"""The report's colours, in plain Python: one colour per variant, shaded apart for each further
config of the variant. The figures (`analysis.plot_style`) and the MLflow UI's run colours
(`studies.tracking.ui_view`) both take them from here, so that a config has one colour in the
report and in MLflow; no matplotlib, so that a trial can colour its run without loading it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
#: how far the configs of one variant are shaded away from its colour (towards white, then
#: black, in turn): the first config keeps the colour itself
SHADES = (0.0, 0.45, -0.35, 0.65, -0.55, 0.25, -0.2, 0.8)


def variant_colors(variants: Sequence[Any]) -> dict[Any, str]:
    """One colour per variant, in the study's order: a report passes the same map to every
    figure, so that a variant has one colour throughout."""
    return {v: PALETTE[i % len(PALETTE)] for i, v in enumerate(variants)}


def shade(color: str, index: int) -> str:
    """The `index`-th shade of the ``#rrggbb`` `color` (`SHADES`): each channel moved that
    share of the way to white (positive) or black (negative), rounded as matplotlib's
    ``to_hex`` rounds."""
    amount = SHADES[index % len(SHADES)]
    target = 1.0 if amount > 0 else 0.0
    channels = [int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    return "#" + "".join(f"{round((c + abs(amount) * (target - c)) * 255):02x}" for c in channels)


def config_colors(configs_by_variant: Mapping[Any, Sequence[Any]], variant_order: Sequence[Any]) -> dict[Any, str]:
    """``{config: colour}``: a config's variant colour (variants in `variant_order`, then any
    other in the order given), shaded by the config's place among its variant's configs."""
    order = list(variant_order) + [v for v in configs_by_variant if v not in variant_order]
    base = variant_colors(order)
    return {
        config: shade(base[variant], index)
        for variant, configs in configs_by_variant.items()
        for index, config in enumerate(configs)
    }
