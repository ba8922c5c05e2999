"""Run names a person can read in MLflow's run list: the variant, what sets the config apart,
and the seed (``noised ε=0.2 bs=64 s1``).

The values shown are those of the swept paths whose value differs between configs of the same
variant, written with the papers' symbols where they have one; the config's hash stays in the
``studies.config_id`` tag. Two configs of one variant therefore never read alike, unless they
differ only in a path no design sweeps (then the hash tells them apart: it is appended).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from analysis.formatting import SYMBOLS, assignments

__all__ = ["run_names", "config_name", "RunNamer", "SYMBOLS"]

#: longest run name MLflow shows whole in its run list
MAX_NAME = 120


class RunNamer:
    """Names for a growing set of cells (an optuna block's configs arrive one at a time):
    `add(cells)` records them, `names(cells)` names some of them against every cell recorded
    so far, at the cost of the configs of their variants, not of every cell known."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
        self.configs: dict[str, dict[str, Mapping]] = defaultdict(dict)  # variant -> config -> swept

    def add(self, cells: Iterable[Any]) -> None:
        for cell in cells:
            if cell.config_id in self.configs[cell.variant]:
                continue
            self.configs[cell.variant][cell.config_id] = cell.swept
            for path, value in cell.swept.items():
                self.values[cell.variant][path].add(json.dumps(value, sort_keys=True))

    def _labels(self, variant: str) -> dict[str, str]:
        """config_id -> the label of every recorded config of `variant` (the values of the
        paths that vary within the variant), with the hash where two still read alike."""
        varying = [p for p, seen in self.values[variant].items() if len(seen) > 1]
        labels = {}
        for config_id, swept in self.configs[variant].items():
            parts = [variant] + assignments({p: swept[p] for p in varying if p in swept})
            labels[config_id] = " ".join(parts)
        counts = Counter(labels.values())
        return {
            config_id: label if counts[label] == 1 else f"{label} [{config_id[:6]}]"
            for config_id, label in labels.items()
        }

    def names(self, cells: Iterable[Any]) -> dict[str, str]:
        """``{cell_id: name}`` of `cells` (recorded first if they were not)."""
        cells = list(cells)
        self.add(cells)
        labels = {variant: self._labels(variant) for variant in {c.variant for c in cells}}
        return {
            c.cell_id: f"{labels[c.variant][c.config_id][: MAX_NAME - 24]}{_version_suffix(c)}{_seed_suffix(c.seed)}"
            for c in cells
        }


def _version_suffix(cell: Any) -> str:
    """` version=<version>` for a cell of a study's later version (its config id carries the
    version, `studies.running.versions`), as the report labels it, so the MLflow UI never
    groups two versions' configs under one name."""
    version = str(getattr(cell, "version", "") or "")[:7]
    return f" version={version}" if version and str(cell.config_id).endswith(f"-v{version}") else ""


def _seed_suffix(seed: Any) -> str:
    return f" s{seed}"


def config_name(run_name: str, seed: Any) -> str:
    """The config's readable name in a cell's run name (the name without its seed)."""
    return run_name.removesuffix(_seed_suffix(seed))


def run_names(cells: Iterable[Any]) -> dict[str, str]:
    """``{cell_id: name}`` for cells with ``cell_id``, ``config_id``, ``variant``, ``swept``, ``seed``."""
    return RunNamer().names(cells)
