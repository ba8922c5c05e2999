"""How numbers and configs are written as text: `94.4 ± 0.1`, `ε=0.01`, p-values.

A parameter is written with the papers' symbol (`SYMBOLS`, declared here once) wherever a
person reads it: the report's tables, legends and axes, and the MLflow run names
(`studies.cells.run_names`)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

#: the last part of a dotted path -> how the papers write it
SYMBOLS = {
    "epsilon": "ε",
    "tau": "τ",
    "alpha": "α",
    "beta": "β",
    "lambda_": "λ",
    "gamma": "γ",
    "n_samples": "M",
    "k": "K",
    "max_margin": "m",
    "scale": "s",
    "batch_size": "bs",
    "label_noise": "p",
    "lr": "lr",
    "weight_decay": "wd",
    "momentum": "mom",
}


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


def symbol(path: str) -> str:
    """How the papers write the parameter at a dotted path (`loss.epsilon` -> `ε`); the
    path's last part where they have no symbol."""
    last = path.rsplit(".", 1)[-1]
    return SYMBOLS.get(last, last)


def param_label(path: str) -> str:
    """A parameter on an axis or in a column head: `ε (loss.epsilon)`; the path alone where
    the papers write it by its own name (`optim.lr`)."""
    return path if symbol(path) == path.rsplit(".", 1)[-1] else f"{symbol(path)} ({path})"


def short_value(value: Any) -> str:
    """A value in an assignment: four significant digits (`0.01`, `1`, `1e-05`)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def assignments(values: Mapping[str, Any]) -> list[str]:
    """`["p=0.1", "ε=0.2"]` for `{path: value}`, sorted by path; a symbol two paths share is
    replaced by the paths."""
    symbols = [symbol(path) for path in values]
    return [
        f"{symbol(path) if symbols.count(symbol(path)) == 1 else path}={short_value(value)}"
        for path, value in sorted(values.items())
    ]


def swept_text(swept_json: str | None) -> str:
    """A config by its swept values (`p=0.1, K=5`), NO_SWEPT_TEXT if none."""
    swept = json.loads(swept_json or "{}")
    if not swept:
        return NO_SWEPT_TEXT
    return ", ".join(assignments(swept))


def p_text(p: float | None) -> str:
    """A p-value with three significant digits, in scientific notation below 1e-4."""
    if p is None or not math.isfinite(p):
        return "–"
    return f"{p:.3g}" if p >= 1e-4 else f"{p:.1e}"


#: a mean over at most this many seeds shows its per-seed values beside its interval: with few
#: seeds the values say more than the interval (issue 40)
SEED_VALUES_UP_TO = 10
#: fewer seeds than this behind an interval earn a note under its table
FEW_SEEDS = 5


def shows_seed_values(n: int) -> bool:
    """Whether a mean over `n` seeds shows its per-seed values, in the tables and the figures
    alike: from 2 (one seed is its own mean) to `SEED_VALUES_UP_TO`."""
    return 2 <= n <= SEED_VALUES_UP_TO


def seed_values_text(values: Sequence[float], factor: float, digits: int) -> str:
    """`seeds: 41.0, 95.1, 99.2`: the per-seed values of a mean over 2 to `SEED_VALUES_UP_TO`
    seeds, in the printed unit (`factor` 100 for an accuracy); empty otherwise."""
    if not shows_seed_values(len(values)):
        return ""
    return "seeds: " + ", ".join(f"{v * factor:.{digits}f}" for v in values)


def small_seed_note(ns: Sequence[int], clipped: int) -> str:
    """The one line under a table of intervals over seeds: how many rest on fewer than
    `FEW_SEEDS` seeds, how many are clipped to the metric's range; empty when neither."""
    few = sum(1 for n in ns if 2 <= n < FEW_SEEDS)
    parts = []
    if few:
        parts.append(
            f"{few} interval{'s' if few != 1 else ''} rest{'' if few != 1 else 's'} on fewer than "
            f"{FEW_SEEDS} seeds: wide, and {'their' if few != 1 else 'its'} per-seed values are shown"
        )
    if clipped:
        parts.append(
            f"{clipped} interval{'s' if clipped != 1 else ''} clipped to the metric's range (shown as [low, high])"
        )
    return ("Note: " + "; ".join(parts) + ".") if parts else ""
