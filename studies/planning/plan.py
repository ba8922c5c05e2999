"""Plan before spending GPUs: what a study will cost and how many seeds its comparisons need
(`studies plan`, and the estimate that `studies run` prints first). docs/planning.md.

Compute. A cell costs  fixed + epochs x seconds per epoch:

- seconds per epoch (training, validation and the runner's report) of each variant, read
  from a pilot's runs (the mean of `epoch_time_s` + `eval_time_s` over the epochs of the
  pilot's cells of that variant; the median rest of their `duration_s` is the fixed part),
  else measured by a probe: a few training steps of the variant's first cell in this process
  (`setvalued.training.probe`, with the study's data, model, loss, batch size and device and as
  many torch threads as `resources.cpus`; no Ray) and the runner's measured work per cell
  and per epoch (`studies.planning.estimate`);
- epochs: the config's `epochs`, or under ASHA its expected epochs: rungs r_1 < ... < r_m
  (`successive_halving.rungs`), a share eta^-i of the configs reaching rung i, so
  E = sum_i eta^-i (r_{i+1} - r_i) with r_0 = 0 and r_{m+1} = epochs (synchronous successive
  halving's budget; the asynchronous rule promotes a little more, so this is a lower bound);
- racing runs `initial` to `max` seeds per config: counted at `max`, or with a pilot at the
  expected seeds of races simulated on the pilot's values (`racing_expected_cells`).

The cells are dealt in the runner's order to the trial slots (the first free slot takes the
next cell, as Ray Tune does), the first cell of each slot longer by a fresh worker's warm-up
(its one-off imports); the wall time is that schedule's length plus the start-up
(`START_UP_S`, measured: docs/planning.md). Slots: `--gpus N` / the GPUs per trial
(`resources.gpus`), else this machine's CPUs / `resources.cpus`, at most `max_concurrent`.
GPU-hours = sum over cells of its time x `resources.gpus`. A smoke run (`--smoke`) is planned
as `studies run --smoke` runs it: its tiny cells on the CPU.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from setvalued.metrics import TIME_METRICS
from studies.planning.estimate import (
    DEFAULT_PROBE_STEPS,
    EXPERIMENT_START_S,
    START_UP_S,
    ComputeEstimate,
    Timings,
    asha_expected_epochs,
    estimate,
    pilot_times,
    probe_times,
    racing_expected_cells,
    schedule_length,
    trial_slots,
)

__all__ = [
    "ComputeEstimate",
    "DEFAULT_PROBE_STEPS",
    "EXPERIMENT_START_S",
    "START_UP_S",
    "Timings",
    "asha_expected_epochs",
    "estimate",
    "pilot_times",
    "probe_times",
    "racing_expected_cells",
    "schedule_length",
    "trial_slots",
    "duration_text",
    "compute_table",
    "seeds_table",
    "plan_seeds",
    "load_pilot",
    "ProposedCell",
    "planned_cells",
    "proposed_cells",
    "PlanError",
    "check_flags",
    "make_plan",
    "plan_command",
    "run_estimate",
    "run_estimate_line",
    "TIME_METRICS",
    "ledger_rows",
    "remaining_estimate_line",
]


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
    return text if len(text) <= width else text[: width - 1] + "~"


def compute_table(est: ComputeEstimate) -> str:
    """The compute estimate as text, at most 80 columns."""
    lines = [f"{'variant':<22}{'configs':>8}{'cells':>7}{'epochs':>8}{'s/epoch':>10}{'s/cell':>9}  source"]
    for r in est.rows:
        per_cell = r.seconds / r.cells if r.cells else math.nan
        lines.append(
            f"{_cut(r.variant, 21):<22}{r.configs:>8}{r.cells:>7}{r.epochs:>8.1f}"
            f"{_number(r.time.epoch_s, 3):>10}{_number(per_cell, 1):>9}  "
            f"{r.time.source}"
        )
    lines.append(f"{'total':<22}{sum(r.configs for r in est.rows):>8}{sum(r.cells for r in est.rows):>7}")
    lines.append(
        f"trial slots: {est.slots} ({est.slots_text})"
        + (f", {est.seeds_per_trial} cells a trial" if est.seeds_per_trial > 1 else "")
    )
    lines.append(f"GPU-hours: {_number(est.gpu_hours)}   CPU-hours: {_number(est.cpu_hours)}")
    lines.append(
        f"wall time: {duration_text(est.wall_s)} (start-up {est.start_up_s:.0f} s, "
        f"warm-up {est.warm_up_s:.1f} s per new worker)"
    )
    lines = [_cut(line, 80) for line in lines]
    notes = [est.schedule_note] if est.schedule_note else []
    if est.experiments > 1:
        notes.append(
            f"{est.experiments} Tune experiments, one after the other (the design's "
            f"cells, then each optuna block): {EXPERIMENT_START_S:.1f} s between two, "
            f"each in new workers"
        )
    for note in notes + est.notes:
        lines += textwrap.wrap(note, 80, subsequent_indent="  ")
    return "\n".join(lines)


def seeds_table(plans: Sequence[Any], power: float, level: float) -> str:
    """The seeds needed per comparison (`analysis.power.SeedsNeeded`), at most 80 columns: for
    the power with the pilot's sd, then with its upper confidence limit (a range)."""
    from analysis.formatting import value_text
    from analysis.power import SD_CONFIDENCE

    lines = [
        f"{'comparison':<29}{'metric':<10}{'n':>3}{'diff':>7}{'sd':>6}{'plan d':>7}{'seeds':>12}{'+-w':>5}",
        f"{'':<29}{'':<10}{'':>3}{'':>7}{'':>6}{'':>7}{f'{power:.0%} power':>12}{'':>5}",
    ]
    notes = []
    for p in plans:
        swept = json.loads(p.swept or "{}")
        label = " ".join([p.variant] + [f"{k.rsplit('.', 1)[-1]}={value_text(v)}" for k, v in sorted(swept.items())])
        width = "?" if p.seeds_half_width is None else str(p.seeds_half_width)
        lines.append(
            f"{_cut(label, 28):<29}{_cut(p.metric, 9):<10}{p.n_pilot:>3}"
            f"{_number(p.observed):>7}{_number(p.sd):>6}{_number(p.difference):>7}"
            f"{_cut(p.seeds_text(), 11):>12}{width:>5}"
        )
        if p.note:
            notes.append(f"{label}: {p.note}")
    lines.append(f"Paired t-test, two-sided at {1 - level:.2g} (non-central t, df = n-1, ncp = d*sqrt(n)/sd);")
    lines.append("plan d: the smallest difference of interest (--difference, else report.difference,")
    lines.append("else 1); diff, sd, plan d in percentage points for accuracies. seeds: with the")
    lines.append(f"pilot's sd - with its upper {SD_CONFIDENCE:.0%} confidence limit (chi-square, n-1 df);")
    lines.append("+-w: for an interval half-width of w (default: plan d / 2).")
    sources = sorted({p.source for p in plans})
    lines += [f"source: {s}" for s in sources]
    lines = [_cut(line, 80) for line in lines]
    for note in notes:
        lines += textwrap.wrap(note, 80, initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the plan


def plan_seeds(
    study: Any,
    rows: Sequence[Mapping[str, Any]] | None,
    *,
    difference: float | None,
    half_width: float | None,
    power: float,
    level: float,
) -> tuple[list[Any], str]:
    """The seeds needed per comparison: from a pilot's rows when given, else from the
    study file's published intervals; ([], reason) when there is neither."""
    from analysis.power import published_seeds_needed, seeds_needed
    from analysis.stats import paired_comparisons

    compare = study.report.compare
    variants = list(study.variants) or []
    difference = difference if difference is not None else study.report.difference
    if rows:
        found = list(dict.fromkeys(r["variant"] for r in rows))
        reference = (compare.reference if compare else None) or next((v for v in variants if v in found), found[0])
        if reference not in found:
            return [], f"the pilot has no finished cell of the baseline {reference!r}"
        metrics = _compared_metrics(study, rows)
        if not metrics:
            return [], "the pilot logged none of the compared metrics"
        paths = set()
        from analysis.layout import flatten_config

        for overlay in (study.variants or {}).values():
            paths |= set(flatten_config(overlay or {}))
        compared = paired_comparisons(rows, metrics, reference, level, variant_paths=paths).to_pylist()
        if not compared:
            return [], "no config of the pilot shares its context with a baseline config"
        return seeds_needed(compared, difference=difference, half_width=half_width, power=power, level=level), ""
    if study.reference:
        reference = (compare.reference if compare else None) or (variants[0] if variants else None)
        plans = published_seeds_needed(
            study.reference, reference, difference=difference, half_width=half_width, power=power, level=level
        )
        if plans:
            return plans, ""
        undeclared = {
            s.label: [f for f in ("seeds", "level") if getattr(s, f) is None]
            for s in study.reference
            if any(r.ci for r in s.rows)
        }
        undeclared = {label: fields for label, fields in undeclared.items() if fields}
        if undeclared:
            return [], "; ".join(
                f"the published intervals of source {label!r} give no plan: its reference "
                f"block does not declare the {' and '.join(f'`{f}`' for f in fields)} behind "
                f"them (as the source states them)"
                for label, fields in undeclared.items()
            )
        return [], (
            f"the reference block has no published interval (ci) of another variant "
            f"beside one of the baseline {reference!r}"
        )
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

    return collect(uri, name, histories=list(TIME_METRICS)).table.to_pylist()


@dataclass(frozen=True)
class ProposedCell:
    """A cell an optuna block will propose (its config is not known before it runs): timed
    as its variant's config."""

    config_id: str
    seed: int
    variant: str
    config: dict
    block: int  # the index of its optuna block in the design: one Tune experiment each


def planned_cells(study: Any, smoke_epochs: int = 0) -> list[Any]:
    """The study's cells (`studies.cells.space.expand`) and its optuna proposals; those of
    its smoke run of `smoke_epochs` epochs when not 0."""
    from studies.cells.space import expand, smoke_cells

    cells = expand(study)
    if smoke_epochs:
        cells = smoke_cells(cells, smoke_epochs)
    return list(cells) + proposed_cells(study, smoke_epochs)


def proposed_cells(study: Any, smoke_epochs: int = 0) -> list[ProposedCell]:
    """For each optuna block, its `n_configs` proposals on every seed (as the runner counts
    them), dealt to the block's variants in turn; smoke configs of `smoke_epochs` epochs
    when not 0."""
    from studies.cells.space import smoke_config

    cells: list[ProposedCell] = []
    for index, block in study.optuna_blocks:
        variants = study.block_variants(block)
        for k in range(block.n_configs):
            variant = variants[k % len(variants)]
            config = study.variant_config(variant)
            if smoke_epochs:
                config = smoke_config(config, epochs=smoke_epochs)
            cells += [ProposedCell(f"optuna{index}-{k}", seed, variant, config, index) for seed in study.seed_list]
    return cells


class PlanError(ValueError):
    """A flag or pilot that cannot give a plan (the CLI's exit code 2)."""


def check_flags(
    *,
    difference: float | None,
    half_width: float | None,
    power: float,
    gpus: int | None,
    probe_steps: int,
    smoke_epochs: int = 0,
) -> None:
    """Refuse values that give no plan, naming the flag and what it expects."""
    if difference is not None and not (math.isfinite(difference) and difference > 0):
        raise PlanError(
            f"--difference: expected a positive number (percentage points for accuracies, e.g. 0.5), got {difference:g}"
        )
    if half_width is not None and not (math.isfinite(half_width) and half_width > 0):
        raise PlanError(f"--half-width: expected a positive number, got {half_width:g}")
    if not 0.0 < power < 1.0:
        raise PlanError(f"--power: expected a number between 0 and 1 (e.g. 0.8), got {power:g}")
    if gpus is not None and gpus < 1:
        raise PlanError(f"--gpus: expected a whole number of GPUs of at least 1, got {gpus}")
    if probe_steps < 1:
        raise PlanError(f"--probe-steps: expected at least 1, got {probe_steps}")
    if smoke_epochs < 0:
        raise PlanError(f"--smoke-epochs: expected a whole number of at least 1, got {smoke_epochs}")


def make_plan(
    study_file: str,
    *,
    pilot: str | None = None,
    pilot_uri: str | None = None,
    difference: float | None = None,
    half_width: float | None = None,
    power: float = 0.8,
    gpus: int | None = None,
    probe_steps: int = DEFAULT_PROBE_STEPS,
    probe: bool = True,
    overrides: Sequence[str] = (),
    smoke_epochs: int = 0,
) -> str:
    """The text of `studies plan`: the compute table, then the seeds table. `pilot`: the
    name of a study tracked at `pilot_uri` (the CLI finds it under --output); `overrides`:
    `key=value` words as on `studies run`; `smoke_epochs`: plan the study's smoke run of that
    many epochs (`studies run --smoke --smoke-epochs N`) instead of the study."""
    from analysis.collect import CollectError
    from studies.cells.space import smoke_study
    from studies.studyfile.spec import load_study

    check_flags(
        difference=difference,
        half_width=half_width,
        power=power,
        gpus=gpus,
        probe_steps=probe_steps,
        smoke_epochs=smoke_epochs,
    )
    began = time.perf_counter()  # what the run's driver pays too, before its start-up
    study = load_study(study_file, overrides=overrides)
    cells = planned_cells(study, smoke_epochs)
    load_s = time.perf_counter() - began
    if smoke_epochs:
        study = smoke_study(study)
    rows: list[dict] = []
    pilot_text = ""
    if pilot is not None:
        try:
            rows = load_pilot(cast(str, pilot_uri), pilot)  # the CLI finds it under --output
        except CollectError as error:
            raise PlanError(f"--pilot {pilot}: {error}") from None
        pilot_text = f"pilot: study {pilot!r}, {len(rows)} finished cells"
    timings = pilot_times(rows)
    missing = [c for c in cells if c.variant not in timings.variants]
    if missing and probe:
        timings = timings.merged(probe_times(missing, float(study.resources.cpus), probe_steps, bool(study.log_models)))
    est = estimate(study, cells, timings, gpus=gpus, load_s=load_s)
    raced = racing_expected_cells(study, rows, slots=est.slots)
    if raced is not None:  # the cells of the expected seeds, the first of each config's
        per_config, note = raced
        keep = max(int(cast(Any, study.racing).initial), round(per_config))  # raced: a race is set
        order = {seed: i for i, seed in enumerate(study.seed_list)}
        est = estimate(study, [c for c in cells if order[c.seed] < keep], timings, gpus=gpus, load_s=load_s)
        est.schedule_note = note
    level = float(study.report.level)
    plans: list[Any]
    if smoke_epochs and not rows:
        plans, reason = (
            [],
            (
                "not planned for a smoke run without a pilot: its data are "
                "synthetic, the study file's published intervals are not its"
            ),
        )
    else:
        plans, reason = plan_seeds(study, rows, difference=difference, half_width=half_width, power=power, level=level)
    parts = textwrap.wrap(f"Plan of study {study.name} ({os.path.basename(str(study_file))})", 80)
    if smoke_epochs:
        parts.append(
            f"its smoke run: {smoke_epochs} epoch{'s' if smoke_epochs != 1 else ''} "
            f"per cell, synthetic data, tiny MLP, CPU"
        )
    if pilot_text:
        parts += textwrap.wrap(pilot_text, 80)
    parts += ["", "Compute", compute_table(est), "", "Seeds needed"]
    parts += [seeds_table(plans, power, level)] if plans else textwrap.wrap(f"none: {reason}", 80)
    return "\n".join(parts)


def plan_command(study: Any, options: Any) -> str:
    """The `studies plan` command that estimates the time of this run (its file, overrides
    and smoke flags), quoted for a POSIX shell."""
    words = ["studies", "plan", str(study.path)]
    if options.smoke:
        words += ["--smoke"] + (["--smoke-epochs", str(options.smoke_epochs)] if options.smoke_epochs != 1 else [])
    words += list(options.overrides)
    return " ".join(shlex.quote(word) for word in words)


def run_estimate(
    study: Any, cells: Sequence[Any], cpus: int | None = None, cluster: bool = False, plan: str = ""
) -> str:
    """The first line of `studies run`: cells, epochs, slots, and the command that estimates
    the time (`plan`). No store is read and no probe is made: a probe would import torch in
    the driver (`studies plan FILE` probes)."""
    epochs = sum(int(c.config.get("epochs", 1)) for c in cells)
    slots, slots_text = trial_slots(study, None, cpus)
    where = "per GPU" if study.resources.gpus > 0 else f"({slots_text})"
    if study.scheduler.kind == "asha":
        s = study.scheduler
        expected = sum(
            asha_expected_epochs(int(c.config.get("epochs", 1)), s.grace_epochs, s.reduction_factor) for c in cells
        )
        epochs_text = f"{epochs} epochs ({expected:.0f} expected under ASHA)"
    else:
        epochs_text = f"{epochs} epochs"
    text = f"estimate: {len(cells)} cells, {epochs_text}, {slots} trial slots {where}"
    if cluster:
        text = f"estimate: {len(cells)} cells, {epochs} (slots: the cluster's)"
    return text + (f"; time: `{plan}`" if plan else "")


def run_estimate_line(study: Any, cells: Sequence[Any], options: Any) -> str:
    """`run_estimate` of the run's cells and optuna proposals with the run's options
    (`--num-cpus`, `--address`, `--smoke`, overrides)."""
    cells = list(cells) + proposed_cells(study, options.smoke_epochs if options.smoke else 0)
    return run_estimate(study, cells, options.num_cpus, bool(options.address), plan_command(study, options))


def ledger_rows(finished: Sequence[Any], epochs_of: Mapping[str, int]) -> list[dict]:
    """The finished runs of the ledger (`analysis.collect.RunRecord`s read with the latest
    `TIME_METRICS`) as the rows `pilot_times` reads: variant, duration, the last epoch's
    times, the epochs done (`epochs_of`: cell id -> the config's epochs)."""
    from analysis.layout import TAG_CELL_ID, TAG_STOPPED_EPOCH, TAG_VARIANT

    rows = []
    for run in finished:
        if run.start_time is None or run.end_time is None:
            continue
        stopped = run.tags.get(TAG_STOPPED_EPOCH)
        epochs = int(stopped) if stopped and stopped.isdigit() else epochs_of.get(run.tags.get(TAG_CELL_ID, ""))
        if epochs is None:
            continue
        rows.append(
            {
                "variant": run.tags.get(TAG_VARIANT),
                "start_time": run.start_time,
                "end_time": run.end_time,
                "duration_s": (run.end_time - run.start_time) / 1000.0,
                "param:epochs": epochs,
                **{k: run.metrics.get(k) for k in TIME_METRICS},
            }
        )
    return rows


def remaining_estimate_line(
    study: Any,
    pending: Sequence[Any],
    finished: Sequence[Any],
    epochs_of: Mapping[str, int],
    options: Any,
    start_epochs: Mapping[str, int] | None = None,
) -> str | None:
    """On a re-run or a resume: the time of the cells left, from the study's own finished
    runs as read by the ledger (`ledger_rows`: no history request); None when some variant
    left has no finished run to time it by, or on a cluster (its slots are not known)."""
    timings = pilot_times(ledger_rows(finished, epochs_of))
    if not pending or options.address or any(c.variant not in timings.variants for c in pending):
        return None
    est = estimate(study, pending, timings, cpus=options.num_cpus, start_epochs=start_epochs)
    return (
        f"{len(pending)} cells left: ~{duration_text(est.wall_s)} wall, "
        f"{_number(est.gpu_hours)} GPU-hours, on {est.slots} trial slots (from the epoch "
        f"times of this study's {len(finished)} finished runs)"
    )
