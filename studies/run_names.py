"""Run names a person can read in MLflow's run list: the variant, what sets the config apart,
and the seed (``noised ε=0.2 bs=64 s1``).

The values shown are those of the swept paths whose value differs between configs of the same
variant, written with the papers' symbols where they have one; the config's hash stays in the
``studies.config_id`` tag. Two configs of one variant therefore never read alike, unless they
differ only in a path no design sweeps (then the hash tells them apart: it is appended).
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Iterable, Mapping

__all__ = ["run_names", "SYMBOLS"]

#: the last part of a dotted path -> how the papers write it
SYMBOLS = {
    "epsilon": "ε", "tau": "τ", "alpha": "α", "beta": "β", "lambda_": "λ", "gamma": "γ", "n_samples": "M",
    "k": "K", "max_margin": "m", "scale": "s", "batch_size": "bs", "label_noise": "p", "lr": "lr",
    "weight_decay": "wd", "momentum": "mom",
}
#: longest run name MLflow shows whole in its run list
MAX_NAME = 120


def _symbol(path: str) -> str:
    last = path.rsplit(".", 1)[-1]
    return SYMBOLS.get(last, last)


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def run_names(cells: Iterable[Any]) -> dict[str, str]:
    """``{cell_id: name}`` for cells with ``cell_id``, ``config_id``, ``variant``, ``swept``, ``seed``."""
    cells = list(cells)
    values: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    configs: dict[str, set] = defaultdict(set)
    for cell in cells:
        configs[cell.variant].add(cell.config_id)
        for path, value in cell.swept.items():
            values[cell.variant][path].add(json.dumps(value, sort_keys=True))
    names: dict[str, str] = {}
    labels: dict[tuple[str, str], str] = {}
    for cell in cells:
        key = (cell.variant, cell.config_id)
        if key not in labels:
            varying = [p for p, seen in values[cell.variant].items() if len(seen) > 1 and p in cell.swept]
            parts = [cell.variant] + [f"{_symbol(p)}={_value(cell.swept[p])}" for p in varying]
            labels[key] = " ".join(parts)
        names[cell.cell_id] = labels[key]
    # configs of a variant that still read alike get their hash
    by_label: Mapping[str, set] = defaultdict(set)
    for (variant, config_id), label in labels.items():
        by_label[label].add(config_id)
    for cell in cells:
        label = names[cell.cell_id]
        if len(by_label[label]) > 1:
            label = f"{label} [{cell.config_id[:6]}]"
        names[cell.cell_id] = f"{label[:MAX_NAME - 8]} s{cell.seed}"
    return names
