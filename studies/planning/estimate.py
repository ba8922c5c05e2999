"""What a study will cost, for `studies plan` and the line `studies run` prints first: seconds
per epoch (a pilot's, or a few timed steps), cells x epochs over the trial slots, ASHA's and
racing's expected share of the cells.
"""

from __future__ import annotations

import heapq
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from studies.scheduling.successive_halving import rungs

#: a study's fixed start-up through the CLI on a fresh local Ray, without its report and
#: without loading its study file (measured per study: `estimate(..., load_s=)`): its wall
#: time minus the span of its cells (from the first cell's MLflow run start to the last one's
#: end) minus the load: driver imports, the SQLite store, Ray, a worker and its imports,
#: Tune's set-up and teardown. Measured with `benchmarks/plan_estimate.py` on the 2-core
#: development machine: 11.2-12.9 s, median 11.7 s, of which 0.16 s loading the file
#: (docs/planning.md, "Where the constants come from")
START_UP_S = 11.5
#: the runner's one-off work in the first cell of a fresh worker (its first MLflow run and
#: artifacts, Tune's first report), over and above the training core's own one-offs that a
#: probe measures; measured the same way as the first cells' extra rest of `duration_s`
RUNNER_FIRST_CELL_S = 0.45
#: the first MLflow model a worker logs (`log_models: true`) imports MLflow's model flavour
MODEL_LOGGING_START_S = 0.8
#: the runner's work per cell inside its MLflow run but outside `fit` (params, test metrics and
#: artifacts written, the run closed): 1-epoch cells' `duration_s` minus fit's set-up, epoch and
#: test evaluation
RUNNER_CELL_S = 0.05
#: logging a cell's selected model (`log_models: true`), measured as above
MODEL_LOG_S = 0.09
#: between two cells of a slot (Tune hands the slot to the next trial): 0.088 s measured by
#: benchmarks/orchestration.py on a warm local Ray
CELL_GAP_S = 0.09
#: the runner's work per epoch (Tune's report, MLflow's batched metrics): the growth of the
#: cells' rest of `duration_s` from 1 to 30 epochs, per epoch
RUNNER_EPOCH_S = 0.007
#: between two Tune experiments of a run (an optuna block after the grid, the parts of a long
#: grid: `studies.running.session`): the time no cell runs, from the last cell of one to the
#: first of the next; the next one's cells start in fresh workers, which warm up again
EXPERIMENT_START_S = 4.4
DEFAULT_PROBE_STEPS = 10


@dataclass
class VariantTime:
    """Seconds per epoch (training, validation and the runner's report) and per cell (the
    fixed part: set-up, test evaluation, the runner's work) of one variant, and where they
    come from."""

    epoch_s: float
    fixed_s: float
    source: str  # "pilot", "probe" or "unknown"
    note: str = ""


@dataclass
class Timings:
    """The times an estimate needs: per variant, and the warm-up of a fresh worker's first
    cell (the training modules it imports once: the data sets', models' and losses')."""

    variants: dict[str, VariantTime] = field(default_factory=dict)
    warm_up_s: float = 0.0

    def merged(self, other: Timings) -> Timings:
        """These times, with `other`'s for the variants these lack (and its warm-up when
        these have none)."""
        return Timings({**other.variants, **self.variants}, self.warm_up_s if self.variants else other.warm_up_s)


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
    start_up_s: float = START_UP_S  # in wall_s: the run's start-up
    warm_up_s: float = 0.0  # in wall_s and cell_seconds: a fresh worker's first cell's one-offs
    experiments: int = 1  # Tune experiments run one after the other (EXPERIMENT_START_S apart)
    schedule_note: str = ""
    notes: list[str] = field(default_factory=list)
    seeds_per_trial: int = 1  # cells a trial slot trains as one fused array

    @property
    def gpu_hours(self) -> float:
        return self.cell_seconds * self.gpus_per_trial / 3600.0

    @property
    def cpu_hours(self) -> float:
        return self.cell_seconds * self.cpus_per_trial / 3600.0


def asha_expected_epochs(epochs: int, grace_epochs: int, reduction_factor: int) -> float:
    """E = sum_i eta^-i (r_{i+1} - r_i), r_0 = 0, r_{m+1} = epochs (module docstring)."""
    points = [0] + rungs(grace_epochs, reduction_factor, epochs) + [epochs]
    return float(sum((points[i + 1] - points[i]) / reduction_factor**i for i in range(len(points) - 1)))


def trial_slots(study: Any, gpus: int | None, cpus: int | None = None) -> tuple[int, str]:
    """How many trials run at once: on `gpus` GPUs for a study that asks for GPUs, else on
    `cpus` (default: this machine's); at most `max_concurrent`. A fused array's trial takes
    `studies.cells.arrays.trial_resources` (the runner's rule), `cpus` being one node's."""
    from studies.cells.arrays import trial_resources

    per_trial = int(getattr(study.resources, "seeds_per_trial", 1))
    per_cpu, per_gpu = trial_resources(study.resources, per_trial, cpus or os.cpu_count() or 1)
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


def _finite(*values: Any) -> float | None:
    """The first of `values` that is a finite number, else None."""
    for value in values:
        if isinstance(value, (int, float)) and math.isfinite(value):
            return float(value)
    return None


def pilot_times(rows: Sequence[Mapping[str, Any]]) -> Timings:
    """Per variant, from a pilot's finished cells: the mean of `epoch_time_s` + `eval_time_s`
    (`collect`'s means over epochs, `mean:...`, else the last epoch's) plus the runner's
    per-epoch work; as fixed part the median rest of `duration_s` of its cells outside the
    first wave, plus the gap between cells. The first wave: the cells that started before
    any cell ended, each in a fresh worker that paid its one-off imports; the warm-up is
    their median excess over the fixed part of their variant."""
    cells = []  # (variant, epoch seconds, rest, start, end)
    for row in rows:
        epoch = _finite(row.get("mean:epoch_time_s"), row.get("epoch_time_s"))
        duration = _finite(row.get("duration_s"))
        if epoch is None or duration is None:
            continue
        epoch += _finite(row.get("mean:eval_time_s"), row.get("eval_time_s")) or 0.0
        done = _finite(row.get("stopped_epoch"), row.get("param:epochs")) or 0.0
        rest = max(duration - (epoch + RUNNER_EPOCH_S) * done, 0.0)
        start, end = _finite(row.get("start_time")), _finite(row.get("end_time"))
        cells.append((str(row.get("variant")), epoch, rest, start, end))
    first_end = min((c[4] for c in cells if c[4] is not None), default=None)
    first_wave = [first_end is not None and c[3] is not None and c[3] < first_end for c in cells]
    epochs: dict[str, list[float]] = {}  # per variant, in one pass
    steady: dict[str, list[float]] = {}  # the rests outside the first wave
    for (variant, epoch, rest, _, _), first in zip(cells, first_wave):
        epochs.setdefault(variant, []).append(epoch)
        if not first:
            steady.setdefault(variant, []).append(rest)
    every_steady = [rest for rests in steady.values() for rest in rests]
    variants = {}
    for variant, mine in epochs.items():
        # a variant only in the first wave: the others' rest; no steady cell at all: its own
        rests = steady.get(variant) or every_steady or [c[2] for c in cells if c[0] == variant]
        variants[variant] = VariantTime(
            sum(mine) / len(mine) + RUNNER_EPOCH_S,
            statistics.median(rests) + CELL_GAP_S,
            "pilot",
            f"{len(mine)} pilot runs",
        )
    excess = [c[2] + CELL_GAP_S - variants[c[0]].fixed_s for c, first in zip(cells, first_wave) if first]
    warm_up = max(statistics.median(excess), 0.0) if excess and every_steady else 0.0
    return Timings(variants, warm_up)


def probe_times(
    cells: Sequence[Any], cpus_per_trial: float, steps: int = DEFAULT_PROBE_STEPS, log_models: bool = False
) -> Timings:
    """Per variant, a probe of its first cell (module docstring); a probe that cannot run
    (data not on this machine, no GPU) gives an unknown time with the reason. The warm-up:
    the first probe in this process (one untimed step of a smoke config) over the same probe
    again, plus the runner's one-off work in a worker's first cell."""
    import torch

    from setvalued.training import probe
    from studies.cells.space import smoke_config

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(cpus_per_trial)))
    out: dict[str, VariantTime] = {}
    setups: list[float] = []
    one_off = 0.0  # the training core's one-off imports, paid by the first probe
    try:
        for index, cell in enumerate({c.variant: c for c in cells}.values()):  # untimed
            try:
                first = _timed(probe, smoke_config(cell.config), cell.seed, 1)
                if index == 0:
                    one_off = max(first - _timed(probe, smoke_config(cell.config), cell.seed, 1), 0.0)
            except Exception:  # noqa: BLE001  the timed probe reports what fails
                pass
        for cell in cells:
            if cell.variant in out:
                continue
            try:
                result = probe(cell.config, cell.seed, steps)
            except Exception as error:  # noqa: BLE001  the reason is shown, the plan goes on
                reason = str(error).splitlines()[0] if str(error) else type(error).__name__
                out[cell.variant] = VariantTime(math.nan, math.nan, "unknown", f"probe failed: {reason[:200]}")
                continue
            fixed = result["test_s"] + RUNNER_CELL_S + CELL_GAP_S + (MODEL_LOG_S if log_models else 0.0)
            out[cell.variant] = VariantTime(result["epoch_s"] + RUNNER_EPOCH_S, fixed, "probe", f"{steps} steps")
            setups.append(result["setup_s"])
    finally:
        torch.set_num_threads(threads)
    # a set-up may still include one-off work (the first data set of its kind): the
    # smallest is the set-up a cell pays
    for variant_time in out.values():
        if variant_time.source == "probe":
            variant_time.fixed_s += min(setups)
    warm_up = one_off + RUNNER_FIRST_CELL_S + (MODEL_LOGGING_START_S if log_models else 0.0)
    return Timings(out, warm_up)


def _timed(function: Callable[..., Any], *args: Any) -> float:
    """Seconds `function(*args)` took."""
    began = time.perf_counter()
    function(*args)
    return time.perf_counter() - began


def estimate(
    study: Any,
    cells: Sequence[Any],
    timings: Timings,
    *,
    gpus: int | None = None,
    cpus: int | None = None,
    load_s: float = 0.0,
    start_epochs: Mapping[str, int] | None = None,
) -> ComputeEstimate:
    """Cells x epochs x seconds per epoch per variant, the slots, GPU-hours, wall time: the
    start-up (`START_UP_S` and `load_s`, the time the driver takes to load the study file:
    a timm architecture name imports timm and torch, 2.6 s here), then the cells dealt to
    the slots in order, the first cell of each slot longer by the warm-up of a fresh
    worker. ``start_epochs`` (cell_id -> the epoch a resumed cell's checkpoint holds) cuts fused
    arrays as the runner does."""
    slots, slots_text = trial_slots(study, gpus, cpus)
    epochs = _expected_epochs(study.scheduler, cells)
    rows, plain = _variant_costs(cells, epochs, timings)
    per_trial = int(getattr(study.resources, "seeds_per_trial", 1))
    parts = experiments(cells, per_trial, _race_round_of(study, per_trial), start_epochs)
    schedules, cell_seconds = [], 0.0
    for trials in parts:  # dealt in order to the slots, the first cell of each slot in a fresh worker
        durations = [
            sum(plain[i] for i in trial) + (timings.warm_up_s if n < slots else 0.0) for n, trial in enumerate(trials)
        ]
        schedules.append(schedule_length(durations, slots))
        cell_seconds += sum(durations)
    start_up = START_UP_S + load_s
    wall = (
        start_up + EXPERIMENT_START_S * (len(parts) - 1) + sum(schedules) if math.isfinite(cell_seconds) else math.nan
    )
    return ComputeEstimate(
        rows,
        slots,
        slots_text,
        float(study.resources.gpus),
        float(study.resources.cpus),
        wall,
        cell_seconds,
        start_up,
        timings.warm_up_s,
        len(parts),
        _schedule_note(study, cells, rows),
        _estimate_notes(study, rows, per_trial, gpus),
        per_trial,
    )


def _expected_epochs(scheduler: Any, cells: Sequence[Any]) -> Sequence[float]:
    """The epochs each cell is expected to train: its `epochs`, under ASHA the expected share."""
    epochs = [int(c.config.get("epochs", 1)) for c in cells]
    if scheduler.kind == "asha":
        return [asha_expected_epochs(e, scheduler.grace_epochs, scheduler.reduction_factor) for e in epochs]
    return epochs


def _variant_costs(
    cells: Sequence[Any], epochs: Sequence[float], timings: Timings
) -> tuple[list[VariantCost], list[float]]:
    """(a row per variant: its configs, cells, mean epochs, time and seconds; each cell's
    seconds, one after the other in its slot)."""
    unknown = VariantTime(math.nan, math.nan, "unknown", "no pilot run of it, no probe")
    times = {c.variant: timings.variants.get(c.variant) or unknown for c in cells}
    plain = [times[c.variant].fixed_s + e * times[c.variant].epoch_s for c, e in zip(cells, epochs)]
    positions: dict[str, list[int]] = {}
    for i, cell in enumerate(cells):
        positions.setdefault(cell.variant, []).append(i)
    rows = [
        VariantCost(
            variant,
            len({cells[i].config_id for i in mine}),
            len(mine),
            sum(epochs[i] for i in mine) / len(mine),
            times[variant],
            sum(plain[i] for i in mine),
        )
        for variant, mine in positions.items()
    ]
    return rows, plain


def _race_round_of(study: Any, per_trial: int) -> Callable[[Any], int] | None:
    """A racing study's rounds when its seeds train as fused arrays (an array holds the seeds of one round)."""
    if per_trial > 1 and getattr(study, "racing", None) is not None:
        from studies.scheduling.racing import race_rounds

        return race_rounds(study)
    return None


def _schedule_note(study: Any, cells: Sequence[Any], rows: Sequence[VariantCost]) -> str:
    """What the config-level scheduler or the race does to the count of epochs."""
    scheduler = study.scheduler
    note = ""
    if scheduler.kind == "asha":
        full = sum(int(c.config.get("epochs", 1)) for c in cells)
        expected = sum(r.epochs * r.cells for r in rows)
        note = (
            f"ASHA (grace {scheduler.grace_epochs}, eta "
            f"{scheduler.reduction_factor}): {expected:.0f} of {full} epochs "
            f"expected, {1 - expected / full:.0%} saved (synchronous halving's "
            f"budget; a lower bound)"
        )
    elif scheduler.kind == "early_stopping":
        note = "early stopping: every epoch counted (an upper bound)"
    if getattr(study, "racing", None) is not None:
        race = study.racing
        note = (
            f"racing: {race.initial}-{race.max} seeds per config, counted at "
            f"{race.max} ({1 - race.initial / race.max:.0%} less if all are "
            f"decided at {race.initial})"
        )
    return note


def _estimate_notes(study: Any, rows: Sequence[VariantCost], per_trial: int, gpus: int | None) -> list[str]:
    """The estimate's caveats: fused arrays timed as their cells, a busy machine, variants of unknown speed."""
    notes = []
    if per_trial > 1:
        notes.append(
            f"fused arrays: each trial slot trains up to {per_trial} seeds of a config as one "
            f"model; an array is timed as its cells one after the other (an upper bound: "
            f"benchmarks/fused_seeds.py measures what fusing saves)"
        )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cpus_here = os.cpu_count() or 1
    if load > cpus_here and gpus is None and float(study.resources.gpus) == 0:
        notes.append(
            f"this machine is busy (load average {load:.1f} on {cpus_here} CPUs): the "
            f"estimate assumes it idle; a run now takes longer, and a probe now "
            f"measures slower steps"
        )
    for row in rows:
        if row.time.source == "unknown":
            notes.append(f"{row.variant}: seconds per epoch unknown ({row.time.note}); give --pilot NAME")
    return notes


def experiments(
    cells: Sequence[Any],
    per_trial: int = 1,
    round_of: Callable[[Any], int] | None = None,
    start_epochs: Mapping[str, int] | None = None,
) -> list[list[list[int]]]:
    """The positions of `cells` grouped as the runner runs them: Tune experiments one after
    the other, each a list of trials (a trial: the positions of its cells). The study's own
    cells by the runner's rule (`studies.cells.arrays.experiment_parts`: arrays of up to
    `per_trial` seeds of a config, of one starting epoch and one race round; experiments of at
    most `MAX_TRIALS_PER_EXPERIMENT` trials), then each optuna block's proposals
    (`plan.ProposedCell`s, by their `block`) as the arrays of one experiment."""
    from studies.cells.arrays import experiment_parts, fused_arrays

    blocks: dict[int, list[_Indexed]] = {}
    grid: list[_Indexed] = []
    for i, cell in enumerate(cells):
        indexed = _Indexed(i, cell.config_id, int(getattr(cell, "seed", 0)), getattr(cell, "cell_id", None))
        block = getattr(cell, "block", None)
        if block is None:
            grid.append(indexed)
        else:
            blocks.setdefault(block, []).append(indexed)

    def positions(trials: list[list[_Indexed]]) -> list[list[int]]:
        return [[c.index for c in trial] for trial in trials]

    parts = [positions(part) for part in experiment_parts(grid, per_trial, start_epochs, round_of)]
    parts += [positions(fused_arrays(block, per_trial)) for block in blocks.values()]
    return [part for part in parts if part]


@dataclass(frozen=True)
class _Indexed:
    """A cell by its position in the estimate's list, with what the runner's rule reads."""

    index: int
    config_id: str
    seed: int
    cell_id: str | None


def racing_expected_cells(
    study: Any, rows: Sequence[Mapping[str, Any]], *, races: int = 200, slots: int = 2, seed: int = 0
) -> tuple[float, str] | None:
    """The expected number of cells a racing study runs, by simulating `races` races
    (`studies.scheduling.racing.SeedRace`, the runner's rule) on values drawn from a pilot: config c,
    seed s gives m_c + u_s + e_cs, m_c the pilot's mean of the race metric per config, u_s
    a shared seed effect and e_cs the config's own noise, normal, their sds from the pilot's
    two-way (config + seed) decomposition on the seeds all configs have: u_s the median over
    configs of x_cs - m_c (one very noisy config does not make the others' noise), sd_c from
    config c's residuals (configs differ in noise: a loss that is unstable at some epsilon
    races to the end, a stable one is decided in a few seeds). None without a pilot of at
    least two configs on two common seeds."""
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
    n, m = x.shape
    means = x.mean(axis=1)
    seed_effect = np.median(x - means[:, None], axis=0)
    residual = x - means[:, None] - seed_effect[None, :]
    # E sum_s r_cs^2 = (m - 1)(n - 1) / n sd_c^2 for the mean seed effect of equal sds
    sd_e = np.sqrt((residual**2).sum(axis=1) * n / ((m - 1) * (n - 1)))
    sd_u = float(seed_effect.std(ddof=1))
    # the pilot's means hold m seeds of noise: shrunk towards their mean by the share of their
    # spread that noise explains (empirical Bayes), configs that only seem to differ race on
    noise = sd_e**2 / m
    between = max(float(means.var(ddof=1) - noise.mean()), 0.0)
    shrink = np.divide(between, between + noise, out=np.ones_like(noise), where=between + noise > 0)
    means = means.mean() + shrink * (means - means.mean())
    rng = np.random.default_rng(seed)
    ids = [str(i) for i in range(len(means))]
    seeds = race.seed_list
    total = 0
    for _ in range(races):
        draw = (
            means[:, None]
            + rng.normal(0.0, sd_u, len(seeds))[None, :]
            + rng.normal(0.0, 1.0, (len(means), len(seeds))) * sd_e[:, None]
        )
        sim = SeedRace(ids, list(range(len(seeds))), race.initial, race.step, mode, race.until.level)
        total += run_simulated_race(sim, slots, lambda config_id, index: float(draw[int(config_id), index]), rng)
    per_config = total / races / len(means)
    return per_config, (
        f"racing, simulated on the pilot's {metric} ({races} races): "
        f"{per_config:.1f} of {race.max} seeds per config expected"
    )
