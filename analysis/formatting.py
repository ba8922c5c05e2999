"""How the report writes numbers and configs as text: `94.4 ± 0.1`, `loss.epsilon=0.01`, p-values."""

from __future__ import annotations

import json
import math
from typing import Any, Sequence


def format_mean_ci(mean: float, half_width: float, digits: int) -> str:
    """`94.4 ± 0.1` (the papers' layout); just the mean when there is no interval."""
    if mean is None or not math.isfinite(mean):
        return "–"
    if half_width is None or not math.isfinite(half_width):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {half_width:.{digits}f}"


def auto_digits(values: Sequence[float]) -> int:
    """Decimals that show about three significant digits of the largest value (0 to 4)."""
    finite = [abs(v) for v in values if v is not None and math.isfinite(v) and v != 0]
    if not finite:
        return 2
    magnitude = math.floor(math.log10(max(finite)))
    return max(0, min(4, 2 - magnitude))


def value_text(value: Any) -> str:
    """A parameter value as the study file would write it (`0.0`, `1e-05`, `resnet18`)."""
    if isinstance(value, float):
        return f"{value:.1f}" if value.is_integer() and abs(value) < 1e6 else f"{value:g}"
    if isinstance(value, str):
        return value
    return json.dumps(value)


#: How a config that sweeps nothing (the study's base values) is written; the tables that
#: use it say what it means in their caption.
NO_SWEPT_TEXT = "base values"


def swept_text(swept_json: str) -> str:
    """A config by its swept values (`data.label_noise=0.1, loss.k=5`), NO_SWEPT_TEXT if
    none."""
    swept = json.loads(swept_json or "{}")
    if not swept:
        return NO_SWEPT_TEXT
    return ", ".join(f"{k}={value_text(v)}" for k, v in sorted(swept.items()))


def p_text(p: float | None) -> str:
    """A p-value with three significant digits, in scientific notation below 1e-4."""
    if p is None or not math.isfinite(p):
        return "–"
    return f"{p:.3g}" if p >= 1e-4 else f"{p:.1e}"
