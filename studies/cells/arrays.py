"""How a study's cells become Tune trials and experiments: the one rule that the runner
(`studies.running.session`) and the plan (`studies.planning.estimate`) both follow.

- **Arrays** (``resources.seeds_per_trial``): a config's seeds are cut in order into arrays of
  ``per_trial``; a seed count that is not a multiple runs the rest as a smaller array. Under
  racing, each round of seeds (those the race asks for at once) is cut on its own. Cells that
  continue from an earlier session's checkpoints join the arrays of their starting epoch (a
  fused array starts all its members after the same epoch). With ``per_trial`` 1 every cell is
  a trial of its own.
- **Experiments**: the trials run as Tune experiments of at most `MAX_TRIALS_PER_EXPERIMENT`
  trials each, never cutting a config (its seeds run together: early stopping compares them
  epoch by epoch); a config of more trials than that is an experiment of its own.

- **Resources**: a cell's trial asks for ``resources.cpus`` and ``resources.gpus``; a fused
  array takes what the trials it replaces take (`trial_resources`): its members' CPUs summed
  (their threads), up to what one node has, and their GPU shares summed, up to one GPU (an
  array trains on one device); ``resources.per_array`` sets either instead.

Cells are taken in config-major order (`studies.cells.cell_queue.config_major`), whatever order
they come in. Plain Python: no Ray here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from studies.cells.cell_queue import config_major

#: most trials in one Tune experiment. Tune keeps every trial of an experiment in the driver's
#: memory (about 0.15 MB each, measured) and rewrites its experiment state as trials end, so
#: a longer list of cells runs as consecutive experiments of whole configs: the driver's
#: memory stays bounded over a study of any size, for a few seconds of start per part.
MAX_TRIALS_PER_EXPERIMENT = 1000


def fused_arrays(
    cells: Sequence,
    per_trial: int,
    start_epochs: Mapping[str, int] | None = None,
    round_of: Callable[[Any], int] | None = None,
) -> list[list]:
    """The trials of ``cells`` in config-major order: arrays of at most ``per_trial`` cells, each
    of one config and one starting epoch (``start_epochs``: cell_id -> the epoch its checkpoint
    holds; absent: a fresh start) and, under racing, one round of seeds (``round_of``: a cell's
    round, `studies.scheduling.racing.race_rounds`)."""
    if per_trial < 1:
        raise ValueError(f"seeds_per_trial must be at least 1, got {per_trial}")
    start_epochs = start_epochs or {}
    groups: dict[tuple[str, int, int], list] = {}
    for cell in config_major(cells):
        start = int(start_epochs.get(getattr(cell, "cell_id", ""), -1))
        key = (cell.config_id, start, round_of(cell) if round_of else 0)
        groups.setdefault(key, []).append(cell)
    return [group[i : i + per_trial] for group in groups.values() for i in range(0, len(group), per_trial)]


def experiment_parts(
    cells: Sequence,
    per_trial: int = 1,
    start_epochs: Mapping[str, int] | None = None,
    round_of: Callable[[Any], int] | None = None,
    max_trials: int | None = None,
) -> list[list[list]]:
    """The Tune experiments of ``cells``, one after the other, each a list of its trials (the
    `fused_arrays` of ``per_trial``): at most ``max_trials`` trials a part (default
    `MAX_TRIALS_PER_EXPERIMENT`, read when called), never inside a config."""
    limit = MAX_TRIALS_PER_EXPERIMENT if max_trials is None else max_trials
    configs: list[list[list]] = []
    for trial in fused_arrays(cells, per_trial, start_epochs, round_of):
        if not configs or configs[-1][0][0].config_id != trial[0].config_id:
            configs.append([])
        configs[-1].append(trial)
    parts: list[list[list]] = []
    for config in configs:
        if not parts or len(parts[-1]) + len(config) > limit:
            parts.append([])
        parts[-1].extend(config)
    return parts


def array_id(members: Sequence) -> str:
    """The trial name of an array: its first cell's id and how many cells it holds."""
    return f"{members[0].cell_id}-x{len(members)}" if len(members) > 1 else members[0].cell_id


def trial_resources(resources: Any, members: int = 1, node_cpus: float | None = None) -> tuple[float, float]:
    """(CPUs, GPUs) that a trial of ``members`` cells asks Ray for (``resources``: the study's
    `Resources`): a cell's are ``cpus`` and ``gpus``; a fused array's (``members`` > 1) are
    ``per_array``'s where it sets them, else its members' CPUs summed up to ``node_cpus`` (the
    largest node's, when known; never below one member's) and their GPU shares summed up to one
    GPU (whole GPUs per member stay a member's)."""
    cpus, gpus = float(resources.cpus), float(resources.gpus)
    if members <= 1:
        return cpus, gpus
    per_array = getattr(resources, "per_array", None)
    array_cpus = members * cpus
    if node_cpus:
        array_cpus = max(cpus, min(array_cpus, float(node_cpus)))
    array_gpus = gpus if gpus >= 1 else min(members * gpus, 1.0)
    if per_array is not None:
        array_cpus = per_array.cpus if per_array.cpus is not None else array_cpus
        array_gpus = per_array.gpus if per_array.gpus is not None else array_gpus
    return array_cpus, array_gpus
