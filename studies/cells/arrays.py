"""Cells grouped into fused arrays (``resources.seeds_per_trial``): the seeds of one config,
``per_trial`` at a time, each array one Tune trial (`studies.running.array_trial`).

A config's seeds are cut in order into arrays of ``per_trial``; a seed count that is not a
multiple runs the rest as a smaller array. Under racing, each round of seeds (those the race
asks for at once) is cut on its own. Cells that continue from an earlier session's checkpoints
join the arrays of their starting epoch (a fused array starts all its members after the same
epoch). Plain Python: no Ray here.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from studies.cells.cell_queue import config_major


def fused_arrays(cells: Sequence, per_trial: int, start_epochs: Mapping[str, int] | None = None,
                 round_of: Callable[[Any], int] | None = None) -> list[list]:
    """The arrays of ``cells`` in config-major order, at most ``per_trial`` cells each, every
    array of one config and one starting epoch (``start_epochs``: cell_id -> the epoch its
    checkpoint holds; absent: a fresh start) and, under racing, one round of seeds
    (``round_of``: a cell's round, `studies.scheduling.racing.race_rounds`)."""
    if per_trial < 1:
        raise ValueError(f"seeds_per_trial must be at least 1, got {per_trial}")
    start_epochs = start_epochs or {}
    groups: dict[tuple[str, int, int], list] = {}
    for cell in config_major(cells):
        key = (cell.config_id, int(start_epochs.get(cell.cell_id, -1)), round_of(cell) if round_of else 0)
        groups.setdefault(key, []).append(cell)
    return [group[i:i + per_trial] for group in groups.values() for i in range(0, len(group), per_trial)]


def array_id(members: Sequence) -> str:
    """The trial name of an array: its first cell's id and how many cells it holds."""
    return f"{members[0].cell_id}-x{len(members)}" if len(members) > 1 else members[0].cell_id
