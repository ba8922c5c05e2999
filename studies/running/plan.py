"""Plan before spending GPUs: what a study will cost and how many seeds its comparisons need
(`studies plan`, and the estimate that `studies run` prints first). docs/planning.md.

Compute. A cell costs  fixed + epochs x seconds per epoch:

- seconds per epoch (training and validation) of each variant, read from a pilot's runs
  (the mean of `epoch_time_s` + `eval_time_s` over the epochs of the pilot's cells of that
  variant; the per-cell rest of their `duration_s` is the fixed part), else measured by a
  probe: a few training steps of the variant's first cell in this process
  (`setvalued.train.probe`, with the study's data, model, loss, batch size and device and as
  many torch threads as `resources.cpus`; no Ray);
- epochs: the config's `epochs`, or under ASHA its expected epochs: rungs r_1 < ... < r_m
  (`successive_halving.rungs`), a share eta^-i of the configs reaching rung i, so
  E = sum_i eta^-i (r_{i+1} - r_i) with r_0 = 0 and r_{m+1} = epochs (synchronous successive
  halving's budget; the asynchronous rule promotes a little more, so this is a lower bound);
- racing runs `initial` to `max` seeds per config: counted at `max`, or with a pilot at the
  expected seeds of races simulated on the pilot's values (`racing_expected_cells`).

The cells are dealt config by config to the trial slots (the first free slot takes the next
cell, as Ray Tune does); the wall time is that schedule's length plus the start-up
(`START_UP_S`, measured: docs/performance.md "Performance of the runner"). Slots: `--gpus N` / the GPUs
per trial (`resources.gpus`), else this machine's CPUs / `resources.cpus`, at most
`max_concurrent`. GPU-hours = sum over cells of its time x `resources.gpus`.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import textwrap
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


# ----------------------------------------------------------------------------- text


def duration_text(seconds: float) -> str:
    """`42 s`, `12.5 min`, `3.2 h`, `4.1 d`; `?` when unknown."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _number(value: float, digits: int = 2) -> str:
    if value is None or not math.isfinite(value):
        return "?"
    return f"{value:.{digits}f}" if abs(value) < 100 else f"{value:.0f}"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "~"


def compute_table(est: ComputeEstimate) -> str:
    """The compute estimate as text, at most 80 columns."""
    lines = [f"{'variant':<22}{'configs':>8}{'cells':>7}{'epochs':>8}{'s/epoch':>10}"
             f"{'s/cell':>9}  source"]
    for r in est.rows:
        per_cell = r.seconds / r.cells if r.cells else math.nan
        lines.append(f"{_cut(r.variant, 21):<22}{r.configs:>8}{r.cells:>7}{r.epochs:>8.1f}"
                     f"{_number(r.time.epoch_s, 3):>10}{_number(per_cell, 1):>9}  "
                     f"{r.time.source}")
    lines.append(f"{'total':<22}{sum(r.configs for r in est.rows):>8}"
                 f"{sum(r.cells for r in est.rows):>7}")
    lines.append(f"trial slots: {est.slots} ({est.slots_text})")
    lines.append(f"GPU-hours: {_number(est.gpu_hours)}   CPU-hours: {_number(est.cpu_hours)}   "
                 f"wall time: {duration_text(est.wall_s)} (start-up {START_UP_S:.0f} s "
                 f"included)")
    lines = [_cut(line, 80) for line in lines]
    for note in ([est.schedule_note] if est.schedule_note else []) + est.notes:
        lines += textwrap.wrap(note, 80, subsequent_indent="  ")
    return "\n".join(lines)


def seeds_table(plans: Sequence[Any], power: float, level: float) -> str:
    """The seeds needed per comparison (`analysis.power.SeedsNeeded`), at most 80 columns."""
    from analysis.formatting import value_text

    lines = [f"{'comparison':<31}{'metric':<10}{'n':>3}{'diff':>7}{'sd':>6}{'plan d':>7}"
             f"{'power':>6}{'seeds':>6}{'+-w':>4}",
             f"{'':<31}{'':<10}{'':>3}{'':>7}{'':>6}{'':>7}{'now':>6}"
             f"{f'{power:.0%}':>6}{'':>4}"]
    notes = []
    for p in plans:
        swept = json.loads(p.swept or "{}")
        label = " ".join([p.variant] + [f"{k.rsplit('.', 1)[-1]}={value_text(v)}"
                                        for k, v in sorted(swept.items())])
        seeds = "?" if p.seeds_power is None else str(p.seeds_power)
        width = "?" if p.seeds_half_width is None else str(p.seeds_half_width)
        now = "?" if not math.isfinite(p.power_now) else f"{p.power_now:.2f}"
        lines.append(f"{_cut(label, 30):<31}{_cut(p.metric, 9):<10}{p.n_pilot:>3}"
                     f"{_number(p.observed):>7}{_number(p.sd):>6}{_number(p.difference):>7}"
                     f"{now:>6}{seeds:>6}{width:>4}")
        if p.note:
            notes.append(f"{label}: {p.note}")
    lines.append(f"Paired t-test, two-sided at {1 - level:.2g} (non-central t, df = n-1, ncp "
                 f"= d*sqrt(n)/sd);")
    lines.append("diff, sd, plan d in percentage points for accuracies; seeds: for the power; "
                 "+-w:")
    lines.append("for an interval half-width of w (default: plan d / 2).")
    sources = sorted({p.source for p in plans})
    lines += [f"source: {s}" for s in sources]
    lines = [_cut(line, 80) for line in lines]
    for note in notes:
        lines += textwrap.wrap(note, 80, initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the plan


def plan_seeds(study: Any, rows: Sequence[Mapping[str, Any]] | None, *,
               difference: float | None, half_width: float | None, power: float,
               level: float) -> tuple[list[Any], str]:
    """The seeds needed per comparison: from a pilot's rows when given, else from the
    study file's published intervals; ([], reason) when there is neither."""
    from analysis.power import published_seeds_needed, seeds_needed
    from analysis.stats import paired_comparisons

    compare = study.report.compare
    variants = list(study.variants) or []
    if rows:
        found = list(dict.fromkeys(r["variant"] for r in rows))
        reference = (compare.reference if compare else None) or next(
            (v for v in variants if v in found), found[0])
        if reference not in found:
            return [], f"the pilot has no finished cell of the baseline {reference!r}"
        metrics = _compared_metrics(study, rows)
        if not metrics:
            return [], "the pilot logged none of the compared metrics"
        paths = set()
        from analysis.layout import flatten_config

        for overlay in (study.variants or {}).values():
            paths |= set(flatten_config(overlay or {}))
        compared = paired_comparisons(rows, metrics, reference, level,
                                      variant_paths=paths).to_pylist()
        if not compared:
            return [], "no config of the pilot shares its context with a baseline config"
        return seeds_needed(compared, difference=difference, half_width=half_width,
                            power=power, level=level), ""
    if study.reference:
        reference = (compare.reference if compare else None) or (variants[0] if variants
                                                                 else None)
        plans = published_seeds_needed(study.reference, reference, study.seeds_at_once,
                                       difference=difference, half_width=half_width,
                                       power=power, level=level)
        if plans:
            return plans, ""
        return [], (f"the reference block has no published interval (ci) of another variant "
                    f"beside one of the baseline {reference!r}")
    return [], "no pilot (--pilot NAME) and no reference block with intervals"


def _compared_metrics(study: Any, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The report's compared metrics: `report.compare.metrics`, else its tables' metrics,
    else the objective's metric on test; those the pilot logged."""
    logged = {k for r in rows for k in r}
    compare = study.report.compare
    asked = list(compare.metrics or []) if compare else []
    if not asked:
        asked = [m for t in (study.report.tables or []) for m in t.metrics]
    if not asked and study.objective is not None:
        metric = study.objective.metric
        asked = ["test/" + metric.split("/", 1)[1] if "/" in metric else metric]
    return [m for m in dict.fromkeys(asked) if m in logged]


def load_pilot(uri: str, name: str) -> list[dict]:
    """The finished cells of a pilot study, with the mean epoch and evaluation times."""
    from analysis.collect import collect

    return collect(uri, name, histories=["epoch_time_s", "eval_time_s"]).table.to_pylist()


@dataclass(frozen=True)
class ProposedCell:
    """A cell an optuna block will propose (its config is not known before it runs): timed
    as its variant's config."""

    config_id: str
    seed: int
    variant: str
    config: dict


def planned_cells(study: Any) -> list[Any]:
    """The study's cells (`studies.cells.space.expand`) and its optuna proposals."""
    from studies.cells.space import expand

    return list(expand(study)) + proposed_cells(study)


def proposed_cells(study: Any) -> list[ProposedCell]:
    """For each optuna block, its `n_configs` proposals on every seed (as the runner counts
    them), dealt to the block's variants in turn."""
    cells: list[ProposedCell] = []
    for index, block in study.optuna_blocks:
        variants = study.block_variants(block)
        for k in range(block.n_configs):
            variant = variants[k % len(variants)]
            config = study.variant_config(variant)
            cells += [ProposedCell(f"optuna{index}-{k}", seed, variant, config)
                      for seed in study.seed_list]
    return cells


class PlanError(ValueError):
    """A flag or pilot that cannot give a plan (the CLI's exit code 2)."""


def check_flags(*, difference: float | None, half_width: float | None, power: float,
                gpus: int | None, probe_steps: int) -> None:
    """Refuse values that give no plan, naming the flag and what it expects."""
    if difference is not None and not (math.isfinite(difference) and difference > 0):
        raise PlanError(f"--difference: expected a positive number (percentage points for "
                        f"accuracies, e.g. 0.5), got {difference:g}")
    if half_width is not None and not (math.isfinite(half_width) and half_width > 0):
        raise PlanError(f"--half-width: expected a positive number, got {half_width:g}")
    if not 0.0 < power < 1.0:
        raise PlanError(f"--power: expected a number between 0 and 1 (e.g. 0.8), got {power:g}")
    if gpus is not None and gpus < 1:
        raise PlanError(f"--gpus: expected a whole number of GPUs of at least 1, got {gpus}")
    if probe_steps < 1:
        raise PlanError(f"--probe-steps: expected at least 1, got {probe_steps}")


def make_plan(study_file: str, *, pilot: str | None = None, pilot_uri: str | None = None,
              difference: float | None = None,
              half_width: float | None = None, power: float = 0.8, gpus: int | None = None,
              probe_steps: int = DEFAULT_PROBE_STEPS, probe: bool = True) -> str:
    """The text of `studies plan`: the compute table, then the seeds table. `pilot`: the
    name of a study tracked at `pilot_uri` (the CLI finds it under --output)."""
    from analysis.collect import CollectError
    from studies.studyfile.spec import load_study

    check_flags(difference=difference, half_width=half_width, power=power, gpus=gpus,
                probe_steps=probe_steps)
    study = load_study(study_file)
    cells = planned_cells(study)
    rows: list[dict] = []
    pilot_text = ""
    if pilot is not None:
        try:
            rows = load_pilot(pilot_uri, pilot)
        except CollectError as error:
            raise PlanError(f"--pilot {pilot}: {error}") from None
        pilot_text = f"pilot: study {pilot!r}, {len(rows)} finished cells"
    times = pilot_times(rows)
    missing = [c for c in cells if c.variant not in times]
    if missing and probe:
        times.update(probe_times(missing, float(study.resources.cpus), probe_steps))
    est = estimate(study, cells, times, gpus=gpus)
    raced = racing_expected_cells(study, rows, slots=est.slots)
    if raced is not None:  # the cells of the expected seeds, the first of each config's
        per_config, note = raced
        keep = max(study.racing.initial, round(per_config))
        order = {seed: i for i, seed in enumerate(study.seed_list)}
        est = estimate(study, [c for c in cells if order[c.seed] < keep], times, gpus=gpus)
        est.schedule_note = note
    level = float(study.report.level)
    plans, reason = plan_seeds(study, rows, difference=difference, half_width=half_width,
                               power=power, level=level)
    parts = [f"Plan of study {study.name} ({os.path.basename(str(study_file))})"]
    if pilot_text:
        parts.append(pilot_text)
    parts += ["", "Compute", compute_table(est), "", "Seeds needed"]
    parts += [seeds_table(plans, power, level)] if plans else textwrap.wrap(f"none: {reason}", 80)
    return "\n".join(parts)


def run_estimate(study: Any, cells: Sequence[Any], pilot_rows: Sequence[Mapping] = (),
                 cpus: int | None = None, cluster: bool = False) -> str:
    """The first line of `studies run`: cells, epochs, slots, and the time when a pilot
    (an earlier session of the same study) logged its epoch times. No probe: it would
    import torch in the driver (`studies plan FILE` probes)."""
    epochs = sum(int(c.config.get("epochs", 1)) for c in cells)
    times = pilot_times(pilot_rows)
    slots, slots_text = trial_slots(study, None, cpus)
    where = "per GPU" if study.resources.gpus > 0 else f"({slots_text})"
    if study.scheduler.kind == "asha":
        s = study.scheduler
        expected = sum(asha_expected_epochs(int(c.config.get("epochs", 1)), s.grace_epochs,
                                            s.reduction_factor) for c in cells)
        epochs = f"{epochs} epochs ({expected:.0f} expected under ASHA)"
    else:
        epochs = f"{epochs} epochs"
    text = f"estimate: {len(cells)} cells, {epochs}, {slots} trial slots {where}"
    if cluster:
        text = f"estimate: {len(cells)} cells, {epochs} (slots: the cluster's)"
    if times and all(c.variant in times for c in cells) and not cluster:
        est = estimate(study, cells, times, cpus=cpus)
        text += (f"; ~{duration_text(est.wall_s)} wall, {_number(est.gpu_hours)} GPU-hours "
                 f"(from this study's earlier runs)")
    else:
        text += f"; time: `studies plan {study.path}`"
    return text


def run_estimate_line(study: Any, cells: Sequence[Any], tracking_uri: str, name: str,
                      options: Any) -> str:
    """`run_estimate` of the run's cells (and optuna proposals, but in a smoke run) with the
    run's options (`--num-cpus`, `--address`), this study's earlier runs as the pilot when
    its SQLite store exists already (a re-run or a resume); a server or a new store is not
    read."""
    cpus, cluster = options.num_cpus, bool(options.address)
    if not options.smoke:
        cells = list(cells) + proposed_cells(study)
    rows: list[dict] = []
    if tracking_uri.startswith("sqlite:///"):
        path = tracking_uri[len("sqlite:///"):]
        if os.path.exists(path):
            try:
                rows = load_pilot(tracking_uri, name)
            except Exception:  # noqa: BLE001  no estimate is no reason to stop a run
                rows = []
    return run_estimate(study, cells, rows, cpus, cluster)


def racing_expected_cells(study: Any, rows: Sequence[Mapping[str, Any]], *, races: int = 200,
                          slots: int = 2, seed: int = 0) -> tuple[float, str] | None:
    """The expected number of cells a racing study runs, by simulating `races` races
    (`studies.scheduling.racing.SeedRace`, the runner's rule) on values drawn from a pilot: config c,
    seed s gives m_c + u_s + e_cs, m_c the pilot's mean of the race metric per config, u_s
    a shared seed effect and e_cs a config's own noise, normal, their sds from the pilot's
    two-way (config + seed) decomposition. None without a pilot of at least two configs on
    two common seeds."""
    import numpy as np

    from studies.scheduling.racing import SeedRace

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
        running: list[tuple[str, int]] = []
        while True:
            while len(running) < slots:
                taken = sim.take()
                if taken is None:
                    break
                running.append(taken)
            if not running:
                break
            config_id, index = running.pop(int(rng.integers(len(running))))
            sim.record(config_id, index, float(draw[int(config_id), index]))
            total += 1
    per_config = total / races / len(means)
    return per_config, (f"racing, simulated on the pilot's {metric} ({races} races): "
                        f"{per_config:.1f} of {race.max} seeds per config expected")
