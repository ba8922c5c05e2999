"""One Ray Tune experiment over a batch of a study's cells: one trial per cell.

`run_experiment` builds `tune.Tuner(tune.with_resources(trainable, {"cpu", "gpu"}), ...)`.
The trainable is `studies.running.trial.run_cell`; what every trial shares (the tracking context, the
fit function, the early-stopping settings) travels once through the object store
(`tune.with_parameters`), and each cell's payload in its own trial's config
(``{"cell_id", "cell"}``: a trial reads its cell alone, not the part's thousand), handed out
by `CellQueueSearcher` in the order given (see `studies.cells.cell_queue`), by `RaceSearcher` as a
race needs them (`studies.scheduling.racing`), or by `ProposalSearcher` as an optuna block proposes
configs (`studies.scheduling.optuna_rounds`). With ``resources.seeds_per_trial`` > 1 each trial is
a fused array of a config's seeds (`array_payload`, trained by
`studies.running.array_trial.run_array`): the grid's cut in order, a race's round by round, an
optuna proposal's as its config is asked; every searcher tells its source of each member's end.
`reuse_actors=True`, `max_concurrent_trials` = the trials that fit at once,
`FailureConfig(max_failures)` and one kept checkpoint per trial (written by `run_cell` at
most every `checkpoint_interval_s` and after the last epoch), so a trial whose worker dies
restarts from its last checkpoint.

This module imports `ray.tune` when it is imported: the runner imports it only once Ray has
started, so that a dry run or `studies --help` never loads Ray.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune.search import Searcher

from studies.cells.cell_queue import CellQueue
from studies.running.array_trial import run_array
from studies.running.progress import ProgressReporter
from studies.running.trial import run_cell
from studies.tracking import TrackingContext


class CellQueueSearcher(Searcher):
    """Tune's searcher over a `CellQueue`: each suggestion is the next cell, its payload in
    the trial's config (``{"cell_id", "cell"}``)."""

    def __init__(self, payloads: Mapping[str, Mapping[str, Any]]):
        super().__init__(metric=None, mode=None)
        self.payloads = dict(payloads)
        self.queue = CellQueue(list(self.payloads))

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True  # no search space: the cells are the space

    def suggest(self, trial_id: str):
        cell_id = self.queue.next()
        if cell_id is None:
            return self.FINISHED
        return {"cell_id": cell_id, "cell": self.payloads.pop(cell_id)}

    def on_trial_complete(self, trial_id: str, result=None, error: bool = False) -> None:
        pass  # MLflow is the ledger

    def save(self, checkpoint_path: str) -> None:
        Path(checkpoint_path).write_text(json.dumps({"queue": self.queue.to_json(), "payloads": self.payloads}))

    def restore(self, checkpoint_path: str) -> None:
        state = json.loads(Path(checkpoint_path).read_text())
        self.queue = CellQueue.from_json(state["queue"])
        self.payloads = state["payloads"]


class RaceSearcher(Searcher):
    """Tune's searcher over a race (`studies.scheduling.race_driver.RaceDriver`): each suggestion is the
    cell the race starts next, or with ``per_trial`` > 1 a fused array of up to that many seeds
    of a config's round (`array_payload`); None ("ask again") while every racing config waits
    for its round; FINISHED once the race is over. Every cell's end is told to the race."""

    def __init__(self, race, payloads: Mapping[str, Mapping[str, Any]], per_trial: int = 1):
        super().__init__(metric=None, mode=None)
        self.race = race
        self.payloads = payloads  # every cell the race may start
        self.per_trial = int(per_trial)
        self.cells_of: dict[str, list[str]] = {}  # trial_id -> its cell ids
        self.failed: dict[str, dict[str, str]] = {}  # trial_id -> {cell_id: error} reported failed

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True

    def suggest(self, trial_id: str):
        from studies.cells.arrays import array_id
        from studies.scheduling.race_driver import RACE_OVER

        cell_ids = self.race.next_cell_ids(self.per_trial)
        if cell_ids == RACE_OVER:
            return self.FINISHED
        if not cell_ids:
            return None
        self.cells_of[trial_id] = list(cell_ids)
        if self.per_trial == 1:
            return {"cell_id": cell_ids[0], "cell": self.payloads[cell_ids[0]]}
        members = [self.payloads[cell_id] for cell_id in cell_ids]
        name = array_id([self.race.cells[cell_id] for cell_id in cell_ids])
        return {"cell_id": name, "cell": array_payload(name, members)}

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if result.get("cell_status") == "failed" and result.get("cell_id"):
            self.failed.setdefault(trial_id, {})[str(result["cell_id"])] = str(result.get("error", ""))

    def on_trial_complete(self, trial_id: str, result=None, error: bool = False) -> None:
        failed = self.failed.pop(trial_id, {})
        if (result or {}).get("cell_status") == "failed" and (result or {}).get("cell_id"):
            failed[str(result["cell_id"])] = str(result.get("error", ""))
        for cell_id in self.cells_of.pop(trial_id, []):
            if error or cell_id in failed:
                self.race.complete(cell_id, True, failed.get(cell_id, ""))
            else:  # read back from its MLflow run (a member without a finished run failed)
                self.race.complete(cell_id, False)

    def save(self, checkpoint_path: str) -> None:
        """Nothing to keep: the race is rebuilt from MLflow by the next session."""
        Path(checkpoint_path).write_text("{}")

    def restore(self, checkpoint_path: str) -> None:
        pass


class ProposalSearcher(Searcher):
    """Tune's searcher over configs proposed one at a time (an optuna block's
    `studies.scheduling.optuna_rounds.OptunaProposals`): when a slot is free it starts the next seed of
    the latest config (or the next fused array of its seeds), or asks for a new config; when a
    trial ends, the source learns of each of its cells.

    `admit(cells)` turns a proposal's cells into the payloads of the trials to run (a cell's,
    or a fused array's, `array_payload`; the cells the ledger has finished are reported ended
    by `admit` itself). A payload travels in its trial's config (``{"cell_id", "cell"}``): the
    cells are not known when Tune starts.
    """

    def __init__(self, proposals, admit: Callable[[list], list[dict]]):
        super().__init__(metric=None, mode=None)
        self.proposals = proposals
        self.admit = admit
        self.queue: list[dict] = []
        self.cells: dict[str, list[str]] = {}  # trial_id -> its cell ids
        self.runs: dict[str, dict[str, str]] = {}  # trial_id -> {cell_id: the MLflow run its reports named}

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True

    def suggest(self, trial_id: str):
        while not self.queue:
            cells = self.proposals.propose()
            if cells is None:
                return self.FINISHED
            self.queue.extend(self.admit(cells))
        payload = self.queue.pop(0)
        self.cells[trial_id] = payload_cell_ids(payload)
        return {"cell_id": payload["cell_id"], "cell": payload}

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if result.get("run_id") and result.get("cell_id"):
            self.runs.setdefault(trial_id, {})[str(result["cell_id"])] = str(result["run_id"])

    def on_trial_complete(self, trial_id: str, result=None, error: bool = False) -> None:
        runs = self.runs.pop(trial_id, {})
        if (result or {}).get("run_id") and (result or {}).get("cell_id"):
            runs[str(result["cell_id"])] = str(result["run_id"])
        for cell_id in self.cells.pop(trial_id, []):
            self.proposals.cell_ended(cell_id, runs.get(cell_id))

    def save(self, checkpoint_path: str) -> None:
        # `studies resume` restarts from MLflow and the Optuna storage, not from Tune's state
        Path(checkpoint_path).write_text(json.dumps({"queue": self.queue, "cells": self.cells}))

    def restore(self, checkpoint_path: str) -> None:
        state = json.loads(Path(checkpoint_path).read_text())
        self.queue, self.cells = state["queue"], state["cells"]


def payload_cell_ids(payload: Mapping[str, Any]) -> list[str]:
    """The cells a trial's payload trains: its cell, or a fused array's members."""
    members = payload.get("members")
    return [str(m["cell_id"]) for m in members] if members else [str(payload["cell_id"])]


class ProgressCallback(ProgressReporter, tune.Callback):
    """Tune's driver callback that keeps a `StudyProgress` and prints it (the hooks are
    `ProgressReporter`'s)."""


class ExperimentParameters:
    """The parameters of a session's experiments (`run_cell`'s keyword arguments) in Ray's
    object store, each value put once however many experiments use it.

    `tune.with_parameters` keeps a reference per value, and Tune pickles its trainable with
    Ray's out-of-band serializer, which pins those references for the driver's lifetime
    (Ray 2.x, `SerializationContext.add_contained_object_ref`): values put anew for every
    experiment part would pile up in the object store and in the driver. A value equal to
    the one put before reuses its reference, so that nothing of a part stays pinned."""

    def __init__(self):
        self._held: dict[str, tuple[Any, Any]] = {}  # name -> (value, its object reference)

    def references(self, **values: Any) -> dict[str, Any]:
        """{name: object reference of `values[name]`}, put only when the value changed."""
        refs = {}
        for name, value in values.items():
            held = self._held.get(name)
            if held is None or not (held[0] is value or held[0] == value):
                held = (value, ray.put(value))
                self._held[name] = held
            refs[name] = held[1]
        return refs


@contextmanager
def released_parameters() -> Iterator[None]:
    """Drop, when the block ends, what `tune.with_parameters` calls in it left in the driver.

    Each call appends its parameter registry to Ray's list of hooks run when Ray starts
    (`ray._private.worker._post_init_hooks`; Ray 2.x) and never removes it: the registry keeps
    the object references of its parameters, so every experiment's cells would stay pinned in
    the object store, and their references in the driver, until the driver exits. The hooks
    added inside the block are removed and their registries' references cleared; nothing is
    done where that list does not exist (another Ray version)."""
    hooks = getattr(getattr(ray, "_private", None), "worker", None)
    hooks = getattr(hooks, "_post_init_hooks", None)
    if not isinstance(hooks, list):
        yield
        return
    before = list(hooks)
    try:
        yield
    finally:
        for hook in [h for h in hooks if not any(h is b for b in before)]:
            hooks.remove(hook)
            registry = getattr(hook, "__self__", None)
            for table in ("references", "to_flush"):
                if isinstance(getattr(registry, table, None), dict):
                    getattr(registry, table).clear()


def cell_payload(
    cell,
    resume_from: str | None = None,
    run_name: str | None = None,
    log_model: bool = False,
    color: str | None = None,
    checkpoint_interval_s: float = 0.0,
    tune_metrics: Sequence[str] | None = None,
) -> dict:
    """A cell as a plain dict (what travels to the workers), with the checkpoint folder an
    earlier session left for it, if any, and the name and colour of its MLflow run.
    `tune_metrics`: the epoch metrics its Tune reports carry (the driver's progress line reads
    one; Tune keeps statistics of every key reported, ~4 KB per key and trial); None: all."""
    return {
        "cell_id": cell.cell_id,
        "config_id": cell.config_id,
        "seed": int(cell.seed),
        "variant": cell.variant,
        "config": cell.config,
        "swept": dict(cell.swept),
        "version": getattr(cell, "version", ""),
        "resume_from": resume_from,
        "run_name": run_name,
        "color": color,
        "log_model": log_model,
        "checkpoint_interval_s": float(checkpoint_interval_s),
        "tune_metrics": None if tune_metrics is None else list(tune_metrics),
    }


def array_payload(array_id: str, members: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A fused array's payload (``resources.seeds_per_trial``): its members' cell payloads,
    trained by `studies.running.array_trial.run_array` in one trial named ``array_id``."""
    return {"cell_id": array_id, "members": list(members)}


def run_experiment(
    searcher: Searcher,
    *,
    max_trials: int,
    name: str,
    storage: str,
    context: TrackingContext,
    fit_fn: Callable | None,
    early_stopping: Mapping[str, Any] | None,
    resources: Mapping[str, float] | Callable[[Mapping[str, Any]], Any],
    concurrency: int,
    max_failures: int,
    callbacks: Sequence,
    parameters: ExperimentParameters | None = None,
    arrays: bool = False,
) -> None:
    """Run one trial per cell that `searcher` hands out, each payload in its trial's config,
    in the Tune experiment `name` under `storage`, at most `concurrency` at a time and at most
    `max_trials` in all, each asking for `resources` (a dict, or a function of its config: a
    fused array's, by its members) (a `CellQueueSearcher` hands out its cells in order, a race's
    `RaceSearcher` only the cells the race needs, an optuna block's `ProposalSearcher` the
    cells of the configs it proposes). `parameters`: the session's, so that consecutive
    experiments share what they pass to their trials. `arrays`: each payload is a fused array
    (`array_payload`), trained by `run_array`."""
    parameters = parameters or ExperimentParameters()
    with released_parameters():
        trainable = tune.with_parameters(
            run_array if arrays else run_cell,
            **parameters.references(context=context, fit_fn=fit_fn, early_stopping=early_stopping),
        )
        tuner = tune.Tuner(
            tune.with_resources(trainable, resources if callable(resources) else dict(resources)),
            tune_config=tune.TuneConfig(
                search_alg=searcher,
                num_samples=max(1, int(max_trials)),
                max_concurrent_trials=concurrency,
                reuse_actors=True,
                trial_name_creator=lambda trial: str(trial.config["cell_id"]),
                trial_dirname_creator=lambda trial: str(trial.config["cell_id"]),
            ),
            run_config=tune.RunConfig(
                name=name,
                storage_path=storage,
                failure_config=tune.FailureConfig(max_failures=max_failures),
                checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
                verbose=0,
                callbacks=list(callbacks),
                log_to_file=False,
            ),
        )
        tuner.fit()
