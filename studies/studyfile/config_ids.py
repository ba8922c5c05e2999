"""The identity of a config: its canonical JSON text and ``config_id``, a short hash of it.

Two configs that differ only in how a number is written (``0.1`` and ``1e-1``, ``64`` and
``64.0``) or in the order of their keys are the same config with the same id
(docs/interfaces.md section 6); ``cell_id`` is ``config_id`` plus the seed.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

__all__ = ["round_float", "canonical_json", "config_id"]


def round_float(x: float) -> float:
    """12 significant digits: 0.1 * 3 (0.30000000000000004) and 0.3 are the same value."""
    return float(f"{x:.12g}") if math.isfinite(x) else x


def canonical(value: Any) -> Any:
    """Normalised copy: sorted mappings, lists for tuples, floats to 12 significant digits
    and integral floats as ints (so 0.1 == 1e-1 and 64 == 64.0 give one id)."""
    if isinstance(value, dict):
        return {str(k): canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"a config cannot hold the non-finite number {value}")
        value = round_float(value)
        if value.is_integer() and abs(value) < 2**53:
            return int(value)
        return value
    raise TypeError(f"a config holds only YAML values (mappings, lists, numbers, strings), got {type(value).__name__}")


def canonical_json(config: dict[str, Any]) -> str:
    """The canonical JSON text of a config without its seed (sorted keys, no spaces)."""
    body = {k: v for k, v in config.items() if k != "seed"}
    return json.dumps(canonical(body), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def config_id(config: dict[str, Any]) -> str:
    """First 10 hex digits of the sha256 of :func:`canonical_json` (docs/interfaces.md §6)."""
    return hashlib.sha256(canonical_json(config).encode("utf-8")).hexdigest()[:10]
