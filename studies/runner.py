"""Run a study: every (config, seed) cell as one Ray Tune trial, tracked in MLflow, resumable.

How a study file becomes trials (`run_study`):

1. validation first: `load_study` raises `StudyError` before anything starts (no Ray, no
   MLflow experiment, no output folder);
2. cells are materialised by the project (`studies.space.expand`: every config paired with
   the same seeds), never by Ray's `grid_search` over the study's parameters, which would
   re-sample random dimensions per seed (orchestration-anchors.md, finding 2). Tune gets one
   opaque `cell_id` per trial from `CellQueueSearcher` (in config-major order, each trial
   created when a slot frees up), and the cells themselves once through the object store
   (`tune.with_parameters`);
3. MLflow is the ledger (`studies.tracking.StudyTracking.prepare`): cells whose run is tagged
   `finished` are skipped, leftovers of an interrupted earlier run are deleted, so re-running
   the file, or `studies resume NAME`, runs only what is missing and no cell ends with two
   runs. The Tune experiment folder is a cache, not the ledger: a cell that a killed driver
   left unfinished continues from the last checkpoint its trial left there, in its MLflow
   run (`find_resume_checkpoints`); the folder is removed once every cell has finished;
4. `tune.Tuner(tune.with_resources(trainable, {"cpu", "gpu"}), ...)` with
   `reuse_actors=True`, `max_concurrent_trials`, `FailureConfig(max_failures)` and a checkpoint
   every epoch (`studies.trial.run_cell`), so a trial whose worker dies restarts from its last
   epoch;
5. optuna blocks: an Optuna study (sampler of the block, TPE by default; storage
   `<output>/<name>/optuna.db`) proposes configs in rounds of
   max(1, concurrent trials // seeds) proposals; each proposal runs on every seed as Tune
   trials and the seed mean of the objective is told back. Trials left RUNNING by a killed
   driver are replayed (`optuna.trial.FixedTrial` of their params gives the same config,
   hence the same cells) and told when their cells finish;
6. early stopping (`scheduler: {kind: early_stopping}`): decided per config over all its
   seeds by `ConfigEarlyStopper` (see its docstring), held by a Ray actor that every trial
   reports to; all seeds of a stopped config stop at the same epoch;
7. a summary, a report (`analysis.report.build_report`) unless disabled, and how to open the
   MLflow UI. The exit code is 0 when every cell finished, 1 otherwise.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Mapping, Sequence

from studies.progress import ProgressCallback, StudyProgress, format_duration
from studies.trial import TAG_STOPPED_EPOCH
from studies.tracking import (
    STATUS_FINISHED,
    StudyTracking,
    cell_objective,
    default_tracking_uri,
    new_session_id,
    ui_command,
)

SETTINGS_FILE = "run.json"
STUDY_FILE = "study.yaml"
SMOKE_SUFFIX = "-smoke"


class RunnerError(RuntimeError):
    """A study that cannot run as asked (not a study-file error); one-paragraph message."""


@dataclass
class RunOptions:
    """How to run a study (the CLI flags of `studies run`)."""

    output: Path = Path("studies_out")
    tracking_uri: str | None = None  # default: sqlite:///<output>/<name>/mlflow.db
    address: str | None = None  # Ray cluster address; None: a local Ray instance
    smoke: bool = False
    dry_run: bool = False
    report: bool = True
    num_cpus: int | None = None  # local Ray only; default: the machine's CPUs
    num_gpus: int | None = None  # local Ray only; default: detected
    object_store_mb: int | None = None  # local Ray only
    storage: str | None = None  # Tune storage (shared path or URI on a multi-node cluster)
    fit_fn: Callable | None = None  # default: setvalued.train.fit
    progress_interval_s: float = 30.0
    stream: IO[str] | None = None


@dataclass
class RunOutcome:
    exit_code: int
    study_name: str
    study_dir: Path | None = None
    tracking_uri: str | None = None
    cells: int = 0
    finished: int = 0
    skipped: int = 0
    failed: dict = field(default_factory=dict)  # cell_id -> error or status
    report_path: Path | None = None


# ----------------------------------------------------------------------------- early stopping


class ConfigEarlyStopper:
    """Early stopping decided per config over its seeds, never per seed alone.

    Epochs are counted as `n` = number of epochs done (1, 2, ...). The seed mean m_c(n) of
    config c is defined once every seed of c that is still alive has reported epoch n
    (seeds whose trial failed for good are left out). From n = grace_epochs on, m_c(n) is
    compared with best(n), the best seed mean at epoch n among the configs that completed
    epoch n so far (including c): c is "behind" when it is strictly worse. A config behind
    for `patience` consecutive epochs stops at that epoch; every seed of it stops there too.
    A NaN value counts as the worst possible.

    Configs are compared as their epochs complete (asynchronously, like ASHA's rungs): the
    first config to reach an epoch sets the bar there. Before a decision at epoch n exists,
    a seed at epoch n >= grace_epochs must wait (`status` -> "wait"); the runner keeps all
    seeds of a config running together (config-major order and enough concurrent trials)
    so the wait is short and cannot deadlock.
    """

    def __init__(self, seeds: Mapping[str, Iterable[int]], mode: str, grace_epochs: int,
                 patience: int):
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.seeds = {c: set(s) for c, s in seeds.items()}
        self.mode = mode
        self.grace_epochs = int(grace_epochs)
        self.patience = int(patience)
        self.values: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
        self.gone: dict[str, set] = defaultdict(set)
        self.decided: dict[str, int] = defaultdict(int)  # config -> last epoch with a mean
        self.means: dict[tuple[str, int], float] = {}
        self.behind: dict[str, int] = defaultdict(int)
        self.stopped: dict[str, int] = {}
        self.best: dict[int, float] = {}

    def _score(self, value: float) -> float:
        """Larger is better; NaN is the worst."""
        if value != value:
            return -math.inf
        return value if self.mode == "max" else -value

    def add_config(self, config_id: str, seeds: Iterable[int]) -> None:
        self.seeds.setdefault(config_id, set()).update(seeds)

    def record(self, config_id: str, seed: int, epoch: int, value: float) -> str:
        """Seed `seed` of `config_id` reports `value` after `epoch` epochs; its status."""
        self.values[(config_id, int(epoch))][int(seed)] = float(value)
        self._advance(config_id)
        return self.status(config_id, seed, epoch)

    def mark_gone(self, config_id: str, seed: int) -> None:
        """A seed whose trial failed for good: the config's means use the other seeds."""
        self.gone[config_id].add(int(seed))
        self._advance(config_id)

    def mark_stopped(self, config_id: str, epoch: int) -> None:
        """A stop decided in an earlier run of the study (read back from MLflow)."""
        self.stopped[config_id] = int(epoch)

    def _complete(self, config_id: str, epoch: int) -> bool:
        alive = self.seeds.get(config_id, set()) - self.gone[config_id]
        reported = self.values.get((config_id, epoch), {})
        return bool(alive) and alive <= set(reported)

    def _advance(self, config_id: str) -> None:
        while config_id not in self.stopped:
            epoch = self.decided[config_id] + 1
            if not self._complete(config_id, epoch):
                return
            alive = self.seeds[config_id] - self.gone[config_id]
            scores = [self._score(self.values[(config_id, epoch)][s]) for s in alive]
            mean = sum(scores) / len(scores)
            self.means[(config_id, epoch)] = mean
            self.decided[config_id] = epoch
            best = max(self.best.get(epoch, -math.inf), mean)
            self.best[epoch] = best
            if epoch < self.grace_epochs:
                continue
            self.behind[config_id] = self.behind[config_id] + 1 if mean < best else 0
            if self.behind[config_id] >= self.patience:
                self.stopped[config_id] = epoch

    def status(self, config_id: str, seed: int, epoch: int) -> str:
        """'stop' (the config stopped at or before this epoch), 'continue', or 'wait'."""
        stop = self.stopped.get(config_id)
        if stop is not None:  # decided: every seed runs to the stop epoch, then stops
            return "stop" if stop <= epoch else "continue"
        if epoch < self.grace_epochs or self.decided[config_id] >= epoch:
            return "continue"
        return "wait"


class _EarlyStoppingCoordinator:
    """Ray actor around `ConfigEarlyStopper`, shared by the trials of one session."""

    def __init__(self, seeds, mode, grace_epochs, patience):
        self.stopper = ConfigEarlyStopper(seeds, mode, grace_epochs, patience)

    def record(self, config_id, seed, epoch, value):
        return self.stopper.record(config_id, seed, epoch, value)

    def status(self, config_id, seed, epoch):
        return self.stopper.status(config_id, seed, epoch)

    def mark_gone(self, config_id, seed):
        self.stopper.mark_gone(config_id, seed)

    def mark_stopped(self, config_id, epoch):
        self.stopper.mark_stopped(config_id, epoch)

    def add_config(self, config_id, seeds):
        self.stopper.add_config(config_id, seeds)

    def stopped(self):
        return dict(self.stopper.stopped)


# ----------------------------------------------------------------------------- cell queue


def _searcher_base():
    from ray.tune.search import Searcher

    return Searcher


class CellQueueSearcher(_searcher_base()):
    """Hands Tune the study's cells one by one, in order, as trial slots free up.

    The cells are materialised by the project; Tune only receives an opaque `cell_id` per
    trial. A searcher (rather than `tune.grid_search` over the ids) creates each trial just
    when a slot is free (with `max_concurrent_trials` equal to the trials that fit at once),
    so trials start exactly in config-major order: the seeds of a config start together,
    and at most one config at a time is partly started. Early stopping relies on this (its
    seeds wait for each other at every epoch; see `ConfigEarlyStopper`).
    """

    def __init__(self, cell_ids: Sequence[str]):
        super().__init__(metric=None, mode=None)
        self.cell_ids = list(cell_ids)
        self.position = 0

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True  # no search space: the cells are the space

    def suggest(self, trial_id: str):
        if self.position >= len(self.cell_ids):
            return self.FINISHED
        cell_id = self.cell_ids[self.position]
        self.position += 1
        return {"cell_id": cell_id}

    def on_trial_complete(self, trial_id: str, result=None, error: bool = False) -> None:
        pass  # MLflow is the ledger

    def save(self, checkpoint_path: str) -> None:
        Path(checkpoint_path).write_text(json.dumps(
            {"cell_ids": self.cell_ids, "position": self.position}))

    def restore(self, checkpoint_path: str) -> None:
        state = json.loads(Path(checkpoint_path).read_text())
        self.cell_ids, self.position = state["cell_ids"], state["position"]


# ----------------------------------------------------------------------------- helpers


def find_resume_checkpoints(storage: Path | None, study_name: str,
                            cell_ids: Iterable[str]) -> dict[str, tuple[Path, dict]]:
    """{cell_id: (checkpoint folder, its meta)}: the latest checkpoint (most epochs) that an
    earlier session's Tune trial of each cell left under `storage` (the Tune storage path,
    None for a URI). Only checkpoints of `study_name` count: a shared storage path holds the
    trials of every study, and a cell id names a config and seed, not a study."""
    if storage is None or not storage.is_dir():
        return {}
    wanted = set(cell_ids)
    found: dict[str, tuple[Path, dict]] = {}
    for meta_file in storage.glob("tune-*/*/checkpoint_*/meta.json"):
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError):
            continue
        cell_id = meta.get("cell_id")
        if meta.get("study") != study_name or cell_id not in wanted or "run_id" not in meta:
            continue
        best = found.get(cell_id)
        if best is None or int(meta.get("epoch", -1)) > int(best[1].get("epoch", -1)):
            found[cell_id] = (meta_file.parent, meta)
    return found


def cell_payload(cell) -> dict:
    """A cell as a plain dict (what travels to the workers)."""
    return {
        "cell_id": cell.cell_id, "config_id": cell.config_id, "seed": int(cell.seed),
        "variant": cell.variant, "config": cell.config, "swept": dict(cell.swept),
    }


def config_major(cells: Sequence) -> list:
    """Cells grouped by config (first appearance order), seeds in order inside a config."""
    order: dict[str, int] = {}
    for cell in cells:
        order.setdefault(cell.config_id, len(order))
    return sorted(cells, key=lambda c: (order[c.config_id], c.seed))


def study_dir_of(output: Path, name: str) -> Path:
    return Path(output).expanduser().resolve() / name


def _print(stream: IO[str], text: str) -> None:
    print(text, file=stream, flush=True)


class _Session:
    """One invocation of the runner on one study: Ray, tracking, progress."""

    def __init__(self, study, name: str, study_dir: Path, tracking: StudyTracking,
                 options: RunOptions, stream: IO[str]):
        self.study = study
        self.name = name
        self.study_dir = study_dir
        self.tracking = tracking
        self.options = options
        self.stream = stream
        self.session_id = new_session_id()
        self.started_ray = False
        self.context = None
        self.coordinator = None
        self.concurrency = 1
        self.tune_dirs: list[Path] = []
        self.known_cells: dict[str, Any] = {}  # every cell of the study seen so far
        self.resume_from: dict[str, str] = {}  # cell_id -> checkpoint of an earlier session

    def storage_root(self) -> Path | None:
        """The local (or shared) Tune storage folder; None for a URI storage."""
        storage = self.options.storage or str(self.study_dir / "ray")
        return None if "://" in storage else Path(storage).expanduser().resolve()

    def know(self, cells: Iterable) -> None:
        for cell in cells:
            self.known_cells.setdefault(cell.cell_id, cell)

    # -- Ray

    def start_ray(self) -> None:
        import ray

        os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"  # relative data paths stay valid
        # Ctrl-C raises KeyboardInterrupt here (Tune's own handler would end the run
        # quietly and advise Tuner.restore; the study is resumed with `studies resume`)
        os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
        os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")  # MLflow is the log
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # with verbose=0: no Tune tables
        # Tune snapshots its experiment state whenever a trial's checkpoint replaces the
        # previous one (num_to_keep=1); that is expected here, not worth a warning each time
        os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
        # the Tune result loggers are off (MLflow is the log), so ResultGrid finds no
        # result.json; its warning about that is noise
        logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                      "logging_level": logging.WARNING}
            if self.options.address:
                ray.init(address=self.options.address, **kwargs)
            else:
                ray.init(
                    address="local",
                    num_cpus=self.options.num_cpus or os.cpu_count() or 1,
                    num_gpus=self.options.num_gpus,
                    object_store_memory=(self.options.object_store_mb * 1024 ** 2
                                         if self.options.object_store_mb else None),
                    **kwargs,
                )
            self.started_ray = True
        self.concurrency = self._concurrency()

    def _concurrency(self) -> int:
        """How many trials can run at once on this cluster (resources, max_concurrent)."""
        import ray

        resources = ray.cluster_resources()
        cpus = float(self.study.resources.cpus)
        gpus = float(self.study.resources.gpus)
        slots = math.floor(resources.get("CPU", 0.0) / cpus + 1e-9)
        if gpus > 0:
            slots = min(slots, math.floor(resources.get("GPU", 0.0) / gpus + 1e-9))
        if self.study.max_concurrent:
            slots = min(slots, int(self.study.max_concurrent))
        if slots < 1:
            message = (
                f"{self.study.path}: resources per trial (cpus: {cpus:g}, gpus: {gpus:g}) "
                f"do not fit on the Ray cluster (CPU: {resources.get('CPU', 0):g}, "
                f"GPU: {resources.get('GPU', 0):g}); lower 'resources' or add nodes"
            )
            if not self.options.address:  # a cluster may still scale up; a laptop will not
                raise RunnerError(message)
            _print(self.stream, f"[studies] warning: {message}")
            slots = 1
        return slots

    def stop_ray(self) -> None:
        if self.started_ray:
            import ray

            ray.shutdown()

    # -- early stopping

    def check_early_stopping(self, cells: Sequence) -> None:
        """Early stopping needs every seed of a config running at once (see
        `ConfigEarlyStopper`); refuse before anything starts when the cluster cannot."""
        if getattr(self.study.scheduler, "kind", "none") != "early_stopping":
            return
        need = len(self.study.seeds)
        if self.concurrency < need:
            raise RunnerError(
                f"{self.study.path}: scheduler: early stopping decides per config over its "
                f"{need} seeds, which must run at the same time, but only "
                f"{self.concurrency} trial(s) fit at once (resources cpus "
                f"{self.study.resources.cpus:g}, gpus {self.study.resources.gpus:g}, "
                f"max_concurrent {self.study.max_concurrent}); allow at least {need}"
            )

    def early_stopping(self, pending: Sequence) -> dict | None:
        """The coordinator actor's handle for the trials (started once per session); None
        when early stopping is off.

        The actor knows every config of the study seen so far with all its seeds; the
        cells that finished in earlier runs are replayed into it (their curves, and their
        stop epoch when they were stopped), so that a resumed study compares configs with
        the same bars as an uninterrupted one.
        """
        scheduler = self.study.scheduler
        if getattr(scheduler, "kind", "none") != "early_stopping":
            return None
        import ray

        self.check_early_stopping(pending)
        metric = scheduler.metric or self.study.objective.metric
        if self.coordinator is None:
            self._coordinator_name = f"studies-early-stopping-{self.session_id}"
            mode = scheduler.mode or self.study.objective.mode
            self.coordinator = ray.remote(num_cpus=0)(_EarlyStoppingCoordinator).options(
                name=self._coordinator_name).remote(
                {}, mode, scheduler.grace_epochs, scheduler.patience)
            self._replayed: set[str] = set()
        seeds = defaultdict(set)
        for cell in self.known_cells.values():
            seeds[cell.config_id].add(int(cell.seed))
        ray.get([self.coordinator.add_config.remote(config_id, sorted(config_seeds))
                 for config_id, config_seeds in seeds.items()])
        new = [c for c in self.known_cells.values() if c.cell_id not in self._replayed]
        states = self.tracking.cell_states([c.cell_id for c in new])
        for cell in new:
            self._replayed.add(cell.cell_id)
            state = states.get(cell.cell_id)
            if state is None or state.status != STATUS_FINISHED:
                continue
            history = self.tracking.metric_history(state.run_id, metric)
            ray.get([self.coordinator.record.remote(cell.config_id, int(cell.seed), n, value)
                     for n, (_step, value) in enumerate(history, start=1)])
            stopped = self.tracking.client.get_run(state.run_id).data.tags.get(
                TAG_STOPPED_EPOCH)
            if stopped:
                ray.get(self.coordinator.mark_stopped.remote(cell.config_id, int(stopped)))
        return {"actor": self._coordinator_name, "metric": metric}

    # -- running cells

    def run_cells(self, cells: Sequence, total: int, done_before: int) -> None:
        """One Tune experiment over `cells` (all not finished yet)."""
        from ray import tune

        from studies.trial import run_cell

        if not cells:
            return
        cells = config_major(cells)
        early = self.early_stopping(cells)
        payload = {c.cell_id: {**cell_payload(c), "resume_from": self.resume_from.get(c.cell_id)}
                   for c in cells}
        by_cell = {c.cell_id: c for c in cells}
        trainable = tune.with_parameters(
            run_cell, cells=payload, context=self.context, fit_fn=self.options.fit_fn,
            early_stopping=early)
        resources = {"cpu": float(self.study.resources.cpus),
                     "gpu": float(self.study.resources.gpus)}
        trainable = tune.with_resources(trainable, resources)

        progress = StudyProgress(
            total=total, to_run=len(cells), done_before=done_before,
            epochs={c.cell_id: int(c.config.get("epochs", 1)) for c in cells})

        coordinator = self.coordinator

        def on_error(cell_id: str) -> None:
            if coordinator is not None and cell_id in by_cell:
                import ray

                cell = by_cell[cell_id]
                ray.get(coordinator.mark_gone.remote(cell.config_id, int(cell.seed)))

        callback = ProgressCallback(progress, interval_s=self.options.progress_interval_s,
                                    stream=self.stream, on_error=on_error)
        run_name = f"tune-{self.session_id}-{len(self.tune_dirs)}"
        root = self.storage_root()
        storage = str(root) if root is not None else str(self.options.storage)
        tuner = tune.Tuner(
            trainable,
            tune_config=tune.TuneConfig(
                search_alg=CellQueueSearcher([c.cell_id for c in cells]),
                num_samples=len(cells),
                max_concurrent_trials=self.concurrency,
                reuse_actors=True,
                trial_name_creator=lambda trial: str(trial.config["cell_id"]),
                trial_dirname_creator=lambda trial: str(trial.config["cell_id"]),
            ),
            run_config=tune.RunConfig(
                name=run_name,
                storage_path=storage,
                failure_config=tune.FailureConfig(max_failures=int(self.study.max_failures)),
                checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
                verbose=0,
                callbacks=[callback],
                log_to_file=False,
            ),
        )
        if root is not None:
            self.tune_dirs.append(root / run_name)
        _print(self.stream, f"[studies] running {len(cells)} cells ({self.concurrency} at "
                            f"a time, {resources['cpu']:g} CPU / {resources['gpu']:g} GPU "
                            f"each)")
        tuner.fit()

    # -- optuna

    def run_optuna_block(self, index: int, block, total_hint: int, done_before: int) -> list:
        """Propose, run and tell configs of one optuna block; returns every cell it used."""
        import optuna
        from optuna.trial import FixedTrial, TrialState

        from studies.space import Cell, config_id, optuna_block_suggest, smoke_cells

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = f"sqlite:///{self.study_dir / 'optuna.db'}"
        from studies.space import optuna_sampler

        direction = "maximize" if self.study.objective.mode == "max" else "minimize"
        ostudy = optuna.create_study(
            study_name=f"{self.name}/design[{index}]", storage=storage,
            sampler=optuna_sampler(block), direction=direction, load_if_exists=True)
        metric = self.study.objective.metric
        seeds = list(self.study.seeds)
        batch_size = max(1, self.concurrency // max(1, len(seeds)))
        all_cells: list = []

        def cells_of(trial_like) -> list:
            variant, config, swept = optuna_block_suggest(self.study, index, trial_like)
            cells = [Cell(config_id(config), seed, variant, config, dict(swept))
                     for seed in seeds]
            return smoke_cells(cells) if self.options.smoke else cells

        while True:
            trials = ostudy.get_trials(deepcopy=False)
            ended = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL,
                                                        TrialState.PRUNED)]
            pending = [t for t in trials if t.state in (TrialState.RUNNING,
                                                        TrialState.WAITING)]
            batch: list[tuple[int, list]] = []
            for t in pending[:batch_size]:
                batch.append((t.number, cells_of(FixedTrial(t.params, t.number))))
            room = min(batch_size - len(batch),
                       block.n_configs - len(ended) - len(pending))
            for _ in range(max(0, room)):
                trial = ostudy.ask()
                cells = cells_of(trial)
                trial.set_user_attr("config_id", cells[0].config_id)
                batch.append((trial.number, cells))
            if not batch:
                break
            batch_cells = [c for _, cells in batch for c in cells]
            all_cells.extend(batch_cells)
            self.know(batch_cells)
            done, to_run = self.tracking.prepare([c.cell_id for c in batch_cells])
            wanted = set(to_run)
            self.run_cells([c for c in batch_cells if c.cell_id in wanted],
                           total=total_hint, done_before=done_before + len(done))
            states = self.tracking.cell_states([c.cell_id for c in batch_cells])
            for number, cells in batch:
                values = []
                for cell in cells:
                    state = states[cell.cell_id]
                    if state.status == STATUS_FINISHED:
                        values.append(cell_objective(self.tracking, state.run_id, metric))
                finite = [v for v in values if v == v]
                if len(finite) == len(cells):
                    ostudy.tell(number, sum(finite) / len(finite))
                else:
                    ostudy.tell(number, state=TrialState.FAIL)
                    # a failed proposal is not retried; its cells stay failed in MLflow
        return all_cells


# ----------------------------------------------------------------------------- entry points


def _settings_path(study_dir: Path) -> Path:
    return study_dir / SETTINGS_FILE


def read_settings(study_dir: Path) -> dict:
    path = _settings_path(study_dir)
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def smoke_study(study):
    """The study as a smoke run executes it: one CPU per trial, no GPU, no early stopping.

    The smoke cells are tiny CPU jobs (studies.space.smoke_config), so the file's GPU
    resources and its scheduler (which needs every seed of a config at once) do not apply.
    """
    from studies.study import NoScheduler, Resources

    return study.model_copy(update={"resources": Resources(cpus=1, gpus=0),
                                    "scheduler": NoScheduler(kind="none")})


def run_study(study_file: str | Path, options: RunOptions | None = None) -> RunOutcome:
    """Run (or complete) the study in `study_file`; see the module docstring.

    Raises `studies.spec.StudyError` for a bad study file (before anything starts) and
    `RunnerError` for a study that cannot run on this cluster.
    """
    from studies.spec import load_study
    from studies.space import expand, format_cells_table, smoke_cells

    options = options or RunOptions()
    stream = options.stream or sys.stdout
    study = load_study(study_file)
    cells = expand(study)
    if options.smoke:
        cells = smoke_cells(cells)
        study = smoke_study(study)
    name = study.name + (SMOKE_SUFFIX if options.smoke else "")
    if options.dry_run:
        _print(stream, format_cells_table(cells, study))
        return RunOutcome(0, name, cells=len(cells))

    study_dir = study_dir_of(options.output, name)
    study_dir.mkdir(parents=True, exist_ok=True)
    study_copy = study_dir / STUDY_FILE
    source = Path(study_file).resolve()
    if source != study_copy.resolve():
        shutil.copyfile(source, study_copy)
    saved = read_settings(study_dir)
    tracking_uri = options.tracking_uri or saved.get("tracking_uri") \
        or default_tracking_uri(study_dir)
    settings = {"name": name, "source": str(saved.get("source") or source),
                "tracking_uri": tracking_uri, "smoke": bool(options.smoke),
                "address": options.address}
    _settings_path(study_dir).write_text(json.dumps(settings, indent=2) + "\n")

    tracking = StudyTracking(
        tracking_uri, name,
        artifact_root=(study_dir / "mlartifacts") if tracking_uri.startswith("sqlite:") else None)
    session = _Session(study, name, study_dir, tracking, options, stream)
    session.know(cells)
    if options.address and tracking_uri.startswith("sqlite:"):
        _print(stream, f"[studies] warning: tracking to a SQLite file ({tracking_uri}) with "
                       f"--address: workers on other nodes cannot reach it; pass "
                       f"--tracking-uri http://<mlflow server>")

    started = time.monotonic()
    all_cells = list(cells)
    interrupted = False
    try:
        # the ledger first (reads, and deletes leftovers of an interrupted run), then Ray and
        # its checks, and only then the experiment and parent run: a study that cannot run
        # here creates nothing in MLflow
        resumable = find_resume_checkpoints(session.storage_root(), name, [c.cell_id for c in cells])
        keep = {cell_id: meta["run_id"] for cell_id, (_, meta) in resumable.items()}
        done, to_run = tracking.prepare([c.cell_id for c in cells], keep=keep)
        session.resume_from = {cell_id: str(resumable[cell_id][0]) for cell_id in keep}
        session.tune_dirs.extend(dict.fromkeys(resumable[c][0].parent.parent for c in keep))
        if keep:
            epochs = sorted(int(resumable[c][1].get("epoch", 0)) + 1 for c in keep)
            _print(stream, f"[studies] {len(keep)} unfinished cells continue from the checkpoint "
                           f"an earlier run left (after {epochs[0]}"
                           + (f"-{epochs[-1]}" if epochs[-1] != epochs[0] else "") + " epochs)")
        wanted = set(to_run)
        pending = [c for c in cells if c.cell_id in wanted]
        if pending or study.optuna_blocks:
            session.start_ray()
            session.check_early_stopping(pending)
        parent_run = tracking.parent_run_id(study_copy)
        session.context = tracking.context(session.session_id)
        _print(stream, f"[studies] study {name}: {len(cells)} cells"
                       + (f" + {sum(b.n_configs for _, b in study.optuna_blocks)} optuna "
                          f"proposals x {len(study.seeds)} seeds" if study.optuna_blocks
                          else "")
                       + f"; tracking {tracking_uri} (experiment {tracking.experiment_id}, "
                         f"parent run {parent_run})")
        if done:
            _print(stream, f"[studies] {len(done)} cells already finished (skipped)")
        if pending or study.optuna_blocks:
            total_hint = len(cells) + sum(b.n_configs for _, b in study.optuna_blocks) \
                * len(study.seeds)
            session.run_cells(pending, total=total_hint, done_before=len(done))
            for index, block in study.optuna_blocks:
                all_cells.extend(session.run_optuna_block(
                    index, block, total_hint, len(done)))
    except KeyboardInterrupt:
        interrupted = True
        _print(stream, f"[studies] interrupted; `studies resume {name}` (or the same "
                       f"`studies run`) completes what is missing")
    finally:
        session.stop_ray()

    outcome = _summarise(session, all_cells, started, stream)
    if interrupted:
        outcome.exit_code = 130
    if not outcome.failed:
        for folder in session.tune_dirs:  # Tune's folder is a per-session cache
            shutil.rmtree(folder, ignore_errors=True)
    if options.report and not interrupted:
        outcome.report_path = _build_report(tracking_uri, name, study_dir, study_copy, stream)
    _print(stream, f"[studies] MLflow UI: {ui_command(tracking_uri)}")
    return outcome


def resume_study(name: str, options: RunOptions | None = None) -> RunOutcome:
    """Complete the study `<output>/<name>/` from its saved `study.yaml` and settings."""
    options = options or RunOptions()
    study_dir = study_dir_of(options.output, name)
    study_copy = study_dir / STUDY_FILE
    if not study_copy.exists():
        known = sorted(p.name for p in study_dir.parent.glob("*") if (p / STUDY_FILE).exists()) \
            if study_dir.parent.exists() else []
        raise RunnerError(
            f"no study named {name!r} under {study_dir.parent} (expected {study_copy}); "
            f"known studies: {', '.join(known) or '(none)'}; start one with `studies run FILE`"
        )
    saved = read_settings(study_dir)
    options.smoke = bool(saved.get("smoke", False))
    options.tracking_uri = options.tracking_uri or saved.get("tracking_uri")
    options.address = options.address or saved.get("address")
    return run_study(study_copy, options)


def _summarise(session: _Session, cells: Sequence, started: float,
               stream: IO[str]) -> RunOutcome:
    ids = list(dict.fromkeys(c.cell_id for c in cells))
    states = session.tracking.cell_states(ids)
    finished = [i for i in ids if states[i].status == STATUS_FINISHED]
    failed = {i: (states[i].error or states[i].status) for i in ids
              if states[i].status != STATUS_FINISHED}
    all_done = not failed
    session.tracking.close_parent(all_done)
    _print(stream, f"[studies] summary: {len(finished)}/{len(ids)} cells finished, "
                   f"{len(failed)} not finished, {format_duration(time.monotonic() - started)}"
                   f" wall time")
    for cell_id, error in list(failed.items())[:20]:
        _print(stream, f"[studies]   {cell_id}: {error}")
    if len(failed) > 20:
        _print(stream, f"[studies]   ... and {len(failed) - 20} more")
    return RunOutcome(
        exit_code=0 if all_done else 1, study_name=session.name, study_dir=session.study_dir,
        tracking_uri=session.tracking.tracking_uri, cells=len(ids), finished=len(finished),
        failed=failed)


def _build_report(tracking_uri: str, name: str, study_dir: Path, study_file: Path,
                  stream: IO[str]) -> Path | None:
    try:
        from analysis.report import build_report
    except ImportError as error:
        _print(stream, f"[studies] report skipped: analysis.report is not available ({error})")
        return None
    try:
        path = build_report(tracking_uri, name, study_dir / "report", study_file=study_file)
    except Exception as error:  # the study's results stay in MLflow; say why, do not crash
        _print(stream, f"[studies] report failed: {type(error).__name__}: {error}")
        return None
    _print(stream, f"[studies] report: {path}")
    return Path(path) if path is not None else None
