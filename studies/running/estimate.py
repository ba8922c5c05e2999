"""What a study will cost, for `studies plan` and the line `studies run` prints first: seconds
per epoch (a pilot's, or a few timed steps), cells x epochs over the trial slots, ASHA's and
racing's expected share of the cells.
"""

from __future__ import annotations

import heapq
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from studies.scheduling.successive_halving import rungs


#: a new study's fixed start-up through the CLI on a fresh local Ray (driver imports, SQLite
#: store, Ray and its workers' imports, shutdown): 17.5-21.3 s measured on the 2-core
#: development machine (docs/performance.md "Performance of the runner"); their middle
START_UP_S = 19.0
#: the runner's overhead per cell (benchmarks/orchestration.py: 0.088 s on that machine)
CELL_OVERHEAD_S = 0.09
DEFAULT_PROBE_STEPS = 10


@dataclass
class VariantTime:
    """Seconds per epoch and per cell (fixed part) of one variant, and where they come from."""

    epoch_s: float
    fixed_s: float
    source: str  # "pilot", "probe" or "unknown"
    note: str = ""


@dataclass
class VariantCost:
    variant: str
    configs: int
    cells: int
    epochs: float  # per cell (expected, under ASHA)
    time: VariantTime
    seconds: float  # all its cells, one after the other


@dataclass
class ComputeEstimate:
    rows: list[VariantCost]
    slots: int
    slots_text: str
    gpus_per_trial: float
    cpus_per_trial: float
    wall_s: float  # start-up + schedule; NaN when a variant's time is unknown
    cell_seconds: float
    schedule_note: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def gpu_hours(self) -> float:
        return self.cell_seconds * self.gpus_per_trial / 3600.0

    @property
    def cpu_hours(self) -> float:
        return self.cell_seconds * self.cpus_per_trial / 3600.0


def asha_expected_epochs(epochs: int, grace_epochs: int, reduction_factor: int) -> float:
    """E = sum_i eta^-i (r_{i+1} - r_i), r_0 = 0, r_{m+1} = epochs (module docstring)."""
    points = [0] + rungs(grace_epochs, reduction_factor, epochs) + [epochs]
    return float(sum((points[i + 1] - points[i]) / reduction_factor ** i
                     for i in range(len(points) - 1)))


def trial_slots(study: Any, gpus: int | None, cpus: int | None = None) -> tuple[int, str]:
    """How many trials run at once: on `gpus` GPUs for a study that asks for GPUs, else on
    `cpus` (default: this machine's); at most `max_concurrent`."""
    per_gpu, per_cpu = float(study.resources.gpus), float(study.resources.cpus)
    if per_gpu > 0:
        total = gpus if gpus is not None else 1
        slots = math.floor(total / per_gpu + 1e-9)
        text = f"{total} GPU{'s' if total != 1 else ''} / {per_gpu:g} per trial"
        if gpus is None:
            text += " (no --gpus: 1 assumed)"
    else:
        total = cpus or os.cpu_count() or 1
        slots = math.floor(total / per_cpu + 1e-9)
        text = f"{total} CPUs / {per_cpu:g} per trial"
    if study.max_concurrent and study.max_concurrent < slots:
        slots = int(study.max_concurrent)
        text += f", max_concurrent {slots}"
    return max(slots, 1), text


def schedule_length(durations: Sequence[float], slots: int) -> float:
    """The time until the last cell ends when each cell, in order, takes the first free slot."""
    free = [0.0] * max(slots, 1)
    for seconds in durations:
        heapq.heappush(free, heapq.heappop(free) + seconds)
    return max(free)


def pilot_times(rows: Sequence[Mapping[str, Any]]) -> dict[str, VariantTime]:
    """Per variant, from a pilot's collected rows with `mean:epoch_time_s` (and
    `mean:eval_time_s`): mean seconds per epoch, and the mean rest of `duration_s`."""
    per: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        epoch = row.get("mean:epoch_time_s")
        if epoch is None or not math.isfinite(epoch):
            continue
        epoch += row.get("mean:eval_time_s") or 0.0
        done = row.get("stopped_epoch") or row.get("param:epochs") or 0
        fixed = max(float(row.get("duration_s") or 0.0) - epoch * done, 0.0)
        per.setdefault(str(row.get("variant")), []).append((epoch, fixed))
    return {v: VariantTime(sum(e for e, _ in xs) / len(xs), sum(f for _, f in xs) / len(xs),
                           "pilot", f"{len(xs)} pilot runs")
            for v, xs in per.items()}


def probe_times(cells: Sequence[Any], cpus_per_trial: float, steps: int = DEFAULT_PROBE_STEPS,
                say: Callable[[str], None] | None = None) -> dict[str, VariantTime]:
    """Per variant, a probe of its first cell (module docstring); a probe that cannot run
    (data not on this machine, no GPU) gives an unknown time with the reason."""
    import torch

    from setvalued.train import probe

    from studies.cells.space import smoke_config

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(cpus_per_trial)))
    out: dict[str, VariantTime] = {}
    setups: list[float] = []
    try:
        for cell in {c.variant: c for c in cells}.values():  # one-off imports, untimed
            try:
                probe(smoke_config(cell.config), cell.seed, 1)
            except Exception:  # noqa: BLE001  the timed probe reports what fails
                pass
        for cell in cells:
            if cell.variant in out:
                continue
            try:
                result = probe(cell.config, cell.seed, steps)
            except Exception as error:  # noqa: BLE001  the reason is shown, the plan goes on
                reason = str(error).splitlines()[0] if str(error) else type(error).__name__
                out[cell.variant] = VariantTime(math.nan, math.nan, "unknown",
                                                f"probe failed: {reason[:200]}")
                continue
            out[cell.variant] = VariantTime(result["epoch_s"], result["test_s"], "probe",
                                            f"{steps} steps")
            setups.append(result["setup_s"])
    finally:
        torch.set_num_threads(threads)
    # a set-up may still include one-off work (the first data set of its kind): the
    # smallest is the set-up a cell pays
    for time in out.values():
        if time.source == "probe":
            time.fixed_s += min(setups)
    return out


def estimate(study: Any, cells: Sequence[Any], times: Mapping[str, VariantTime], *,
             gpus: int | None = None, cpus: int | None = None) -> ComputeEstimate:
    """Cells x epochs x seconds per epoch per variant, the slots, GPU-hours, wall time."""
    slots, slots_text = trial_slots(study, gpus, cpus)
    scheduler = study.scheduler
    notes = []
    by_variant: dict[str, list[Any]] = {}
    for cell in cells:
        by_variant.setdefault(cell.variant, []).append(cell)
    durations: list[float] = []
    rows = []
    for variant, vcells in by_variant.items():
        time = times.get(variant) or VariantTime(math.nan, math.nan, "unknown",
                                                          "no pilot run of it, no probe")
        epochs_of = []
        for cell in vcells:
            epochs = int(cell.config.get("epochs", 1))
            if scheduler.kind == "asha":
                epochs = asha_expected_epochs(epochs, scheduler.grace_epochs,
                                              scheduler.reduction_factor)
            epochs_of.append(epochs)
            fixed = (time.fixed_s if math.isfinite(time.fixed_s) else 0.0) + CELL_OVERHEAD_S
            durations.append(fixed + epochs * time.epoch_s)
        seconds = sum(durations[-len(vcells):])
        rows.append(VariantCost(variant, len({c.config_id for c in vcells}), len(vcells),
                                sum(epochs_of) / len(epochs_of), time, seconds))
    cell_seconds = sum(durations)
    wall = START_UP_S + schedule_length(durations, slots) if math.isfinite(cell_seconds) \
        else math.nan
    schedule_note = ""
    if scheduler.kind == "asha":
        full = sum(int(c.config.get("epochs", 1)) for c in cells)
        expected = sum(r.epochs * r.cells for r in rows)
        schedule_note = (f"ASHA (grace {scheduler.grace_epochs}, eta "
                         f"{scheduler.reduction_factor}): {expected:.0f} of {full} epochs "
                         f"expected, {1 - expected / full:.0%} saved (synchronous halving's "
                         f"budget; a lower bound)")
    elif scheduler.kind == "early_stopping":
        schedule_note = "early stopping: every epoch counted (an upper bound)"
    if getattr(study, "racing", None) is not None:
        race = study.racing
        schedule_note = (f"racing: {race.initial}-{race.max} seeds per config, counted at "
                         f"{race.max} ({1 - race.initial / race.max:.0%} less if all are "
                         f"decided at {race.initial})")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cpus_here = os.cpu_count() or 1
    if load > cpus_here and gpus is None and float(study.resources.gpus) == 0:
        notes.append(f"this machine is busy (load average {load:.1f} on {cpus_here} CPUs): the "
                     f"estimate assumes it idle; a run now takes longer, and a probe now "
                     f"measures slower steps")
    for row in rows:
        if row.time.source == "unknown":
            notes.append(f"{row.variant}: seconds per epoch unknown ({row.time.note}); "
                         f"give --pilot NAME")
    return ComputeEstimate(rows, slots, slots_text, float(study.resources.gpus),
                           float(study.resources.cpus), wall, cell_seconds, schedule_note,
                           notes)


def racing_expected_cells(study: Any, rows: Sequence[Mapping[str, Any]], *, races: int = 200,
                          slots: int = 2, seed: int = 0) -> tuple[float, str] | None:
    """The expected number of cells a racing study runs, by simulating `races` races
    (`studies.scheduling.racing.SeedRace`, the runner's rule) on values drawn from a pilot: config c,
    seed s gives m_c + u_s + e_cs, m_c the pilot's mean of the race metric per config, u_s
    a shared seed effect and e_cs a config's own noise, normal, their sds from the pilot's
    two-way (config + seed) decomposition. None without a pilot of at least two configs on
    two common seeds."""
    import numpy as np

    from studies.scheduling.racing import SeedRace, run_simulated_race

    race = study.racing
    if race is None or not rows:
        return None
    metric = race.until.metric or (study.objective.metric if study.objective else None)
    if metric is None or not any(metric in r for r in rows):
        return None
    mode = race.until.mode or (study.objective.mode if study.objective else "max")
    values: dict[str, dict[int, float]] = {}
    for row in rows:
        value = row.get(metric)
        if value is not None and math.isfinite(value):
            values.setdefault(row["config_id"], {})[row["seed"]] = float(value)
    common = sorted(set.intersection(*(set(v) for v in values.values()))) if values else []
    if len(values) < 2 or len(common) < 2:
        return None
    x = np.array([[v[s] for s in common] for v in values.values()])
    means = x.mean(axis=1)
    seed_effect = x.mean(axis=0) - x.mean()
    residual = x - means[:, None] - seed_effect[None, :]
    df = (x.shape[0] - 1) * (x.shape[1] - 1)
    sd_e = math.sqrt(float((residual ** 2).sum()) / df) if df else 0.0
    sd_u = float(seed_effect.std(ddof=1)) if x.shape[1] > 1 else 0.0
    rng = np.random.default_rng(seed)
    ids = [str(i) for i in range(len(means))]
    seeds = race.seed_list
    total = 0
    for _ in range(races):
        draw = (means[:, None] + rng.normal(0.0, sd_u, len(seeds))[None, :]
                + rng.normal(0.0, sd_e, (len(means), len(seeds))))
        sim = SeedRace(ids, list(range(len(seeds))), race.initial, race.step, mode,
                       race.until.level)
        total += run_simulated_race(sim, slots, lambda config_id, index: float(draw[int(config_id), index]),
                                    rng)
    per_config = total / races / len(means)
    return per_config, (f"racing, simulated on the pilot's {metric} ({races} races): "
                        f"{per_config:.1f} of {race.max} seeds per config expected")
