"""Run a study: every (config, seed) cell as one Ray Tune trial, tracked in MLflow, resumable.

How a study file becomes trials (`run_study`), and which module does each step:

1. validation first: `load_study` raises `StudyError` before anything starts (no Ray, no
   MLflow experiment, no output folder);
2. the cells, every config paired with the same seeds (`studies.space.expand`), are handed
   to Tune config by config (`studies.cell_queue`);
3. MLflow is the ledger (`studies.tracking.StudyTracking.prepare`): cells whose run is tagged
   `finished` are skipped, leftovers of an interrupted earlier run are deleted, so re-running
   the file, or `studies resume NAME`, runs only what is missing and no cell ends with two
   runs. A cell that a killed driver left unfinished continues from the last checkpoint its
   trial left, in its MLflow run (`studies.checkpoints`); Tune's folder is removed once every
   cell has finished;
4. Ray is connected or started (`studies.ray_session`), and the cells to run are Tune
   experiments of at most `MAX_TRIALS_PER_EXPERIMENT` trials (`studies.tune_experiment`) whose
   trials run `studies.trial.run_cell`, checkpointed at most every `checkpoint_interval_s`
   and after the last epoch, so a trial whose worker dies restarts from its last checkpoint;
5. optuna blocks: configs asked as trial slots free up, each run on every seed, the seed mean
   told back when its last seed ends (`studies.optuna_rounds`);
6. early stopping and ASHA (`scheduler: {kind: early_stopping | asha}`) and an optuna
   block's `pruner` are decided per config over all its seeds, by a Ray actor that every
   trial reports to (`studies.config_schedulers`);
7. progress while the trials run (`studies.progress`), then a summary, a report
   (`analysis.report.build_report`) unless disabled, and how to open the MLflow UI. The exit
   code is 0 when every cell finished, 1 otherwise, 130 when interrupted.

Ray, Tune and Optuna are imported only once cells are about to run: a dry run loads none.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Mapping, Sequence

from studies.cell_queue import config_major
from studies.checkpoints import ResumePoints
from studies.config_schedulers import session_scheduling
from studies.errors import RunnerError
from studies.progress import StudyProgress, format_duration
from studies.ray_session import RaySession
from studies.run_names import RunNamer
from studies.tracking import (
    STATUS_FINISHED,
    StudyTracking,
    default_tracking_uri,
    new_session_id,
    source_tags,
    study_description,
    ui_command,
)

__all__ = ["RunOptions", "RunOutcome", "RunnerError", "run_study", "resume_study",
           "read_settings", "study_dir_of", "smoke_study"]

SETTINGS_FILE = "run.json"
STUDY_FILE = "study.yaml"
SMOKE_SUFFIX = "-smoke"


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
    max_cells: int | None = None  # raises the study's cell limit (default: the file's, else 100,000)
    wait: bool = False  # wait for another driver of the same study to finish instead of refusing
    verbose: bool = False  # show the INFO logs of MLflow, alembic and Ray
    dashboard: bool = False  # local Ray only: start Ray's dashboard (on 127.0.0.1) and print its address


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


def study_dir_of(output: Path, name: str) -> Path:
    return Path(output).expanduser().resolve() / name


def _print(stream: IO[str], text: str) -> None:
    print(text, file=stream, flush=True)


class _Session:
    """One invocation of the runner on one study: what its collaborators share (the Ray
    session, the config-level schedulers, the cells seen, the checkpoints to resume, Tune's
    folders)."""

    def __init__(self, study, name: str, study_dir: Path, tracking: StudyTracking,
                 options: RunOptions, stream: IO[str]):
        self.study = study
        self.name = name
        self.study_dir = study_dir
        self.tracking = tracking
        self.options = options
        self.stream = stream
        self.session_id = new_session_id()
        self.ray = RaySession(options.address, options.num_cpus, options.num_gpus,
                              options.object_store_mb, dashboard=options.dashboard)
        self.scheduling = session_scheduling(study, tracking, self.session_id)
        self.block_scheduling = {}  # optuna block index -> its pruner's scheduling
        for index, block in study.optuna_blocks:
            if block.pruner is not None:
                from studies.config_schedulers.optuna_pruning import block_scheduling

                self.block_scheduling[index] = block_scheduling(study, tracking, self.session_id,
                                                                index)
        self.concurrency = 1
        self.context = None
        self.tune_dirs: list[Path] = []
        self.known_cells: dict[str, Any] = {}  # every cell of the study seen so far
        self.namer = RunNamer()  # their run names
        self.resume = ResumePoints()  # cells that continue from an earlier session
        self.race = None  # a racing study's race (studies.race_driver), rebuilt by `plan`
        self.parameters = None  # what its Tune experiments pass to their trials, put once

    def say(self, text: str) -> None:
        _print(self.stream, f"[studies] {text}")

    def storage_root(self) -> Path | None:
        """The local (or shared) Tune storage folder; None for a URI storage."""
        storage = self.options.storage or str(self.study_dir / "ray")
        return None if "://" in storage else Path(storage).expanduser().resolve()

    def know(self, cells: Iterable) -> None:
        cells = list(cells)
        for cell in cells:
            self.known_cells.setdefault(cell.cell_id, cell)
        self.namer.add(cells)

    def plan(self, cells: Sequence) -> tuple[list[str], list]:
        """(ids of the cells done, cells to run) by the ledger; the unfinished cells whose
        earlier trial left a checkpoint continue from it (in the run the ledger keeps)."""
        ids = [c.cell_id for c in cells]
        found = ResumePoints.search(self.storage_root(), self.name, ids)
        keep = found.run_ids()
        done, to_run = self.tracking.prepare(ids, keep=keep)  # drops what it did not keep
        self.resume = found.only(keep)
        self.tune_dirs.extend(self.resume.experiment_dirs())
        message = self.resume.describe()
        if message:
            self.say(message)
        wanted = set(to_run)
        if self.study.racing is not None:  # only the cells of configs still racing may run
            from studies.race_driver import RaceDriver

            self.race = RaceDriver.rebuild(self.study, cells, self.tracking,
                                           resumable=self.resume.folders())
            wanted = set(self.race.runnable(to_run))
        return done, [c for c in cells if c.cell_id in wanted]

    def start(self) -> None:
        """Start Ray, count the trial slots, refuse a config-level scheduler that cannot work
        here."""
        self.ray.start()
        if self.ray.dashboard_url:
            self.say(f"Ray dashboard: {self.ray.dashboard_url}")
        self.concurrency = self.ray.trial_slots(self.study, self.stream)
        for scheduling in (self.scheduling, *self.block_scheduling.values()):
            scheduling.check_concurrency(self.concurrency)

    def run_cells(self, cells: Sequence, total: int, done_before: int) -> None:
        """One Tune experiment over `cells` (all not finished yet)."""
        if not cells:
            return
        from studies.tune_experiment import CellQueueSearcher, RaceSearcher

        cells = config_major(cells)
        names = self.namer.names(cells)
        resume_from = self.resume.folders()
        payloads = {c.cell_id: self.payload(c, names, resume_from.get(c.cell_id)) for c in cells}
        self.say(f"running {len(cells)} cells ({self.concurrency} at a time, "
                 f"{self.study.resources.cpus:g} CPU / {self.study.resources.gpus:g} GPU each)")
        if self.race is not None:  # the race decides which cells start: one experiment
            self.experiment(payloads, RaceSearcher(self.race, payloads), cells, max_trials=len(cells),
                            total=total, done_before=done_before, names=names)
            return
        callback = None
        parts = experiment_parts(cells, MAX_TRIALS_PER_EXPERIMENT)
        for number, part in enumerate(parts, start=1):
            if len(parts) > 1:
                self.say(f"{PART_LINE} {number}/{len(parts)}: {len(part)} cells")
            callback = self.experiment({c.cell_id: payloads[c.cell_id] for c in part},
                                       CellQueueSearcher({c.cell_id: payloads[c.cell_id] for c in part}), cells,
                                       max_trials=len(part), total=total,
                                       done_before=done_before, callback=callback, names=names)

    def run_proposals(self, proposals, total: int, done_before: int) -> None:
        """One Tune experiment over the configs of an optuna block, asked as slots free up
        (`studies.optuna_rounds.OptunaProposals`): each proposal's cells that the ledger has
        finished are told at once, the others run."""
        from studies.tune_experiment import ProposalSearcher

        scheduling = self.block_scheduling.get(proposals.index, self.scheduling)
        epochs: dict[str, int] = {}
        # one scan of the storage for the checkpoints of every cell of the study; a
        # proposal (a replayed config) takes those of its cells
        self.checkpoints_left = ResumePoints.search(self.storage_root(), self.name, None)

        def admit(cells: list) -> list[dict]:
            self.know(cells)
            if scheduling.enabled:
                scheduling.prepare(cells, self.concurrency)
            done, pending = self.plan_proposal(cells)
            for cell_id, run_id in done.items():
                proposals.cell_ended(cell_id, run_id)
            names = self.namer.names(pending)
            resume_from = self.resume.folders()
            for cell in pending:
                epochs[cell.cell_id] = int(cell.config.get("epochs", 1))
            return [self.payload(c, names, resume_from.get(c.cell_id)) for c in pending]

        self.say(f"optuna: up to {proposals.max_cells} cells, configs asked as slots free up "
                 f"({self.concurrency} at a time)")
        if proposals.index not in self.block_scheduling:
            self.experiment({}, ProposalSearcher(proposals, admit), [], epochs=epochs,
                            max_trials=proposals.max_cells, total=total, done_before=done_before)
            return
        from studies.config_schedulers.optuna_pruning import PrunerBridge

        scheduling.prepare([], self.concurrency)  # the actor, for the bridge
        with PrunerBridge(scheduling.actor, proposals.report_epoch):
            self.experiment({}, ProposalSearcher(proposals, admit), [], epochs=epochs,
                            max_trials=proposals.max_cells, total=total, done_before=done_before,
                            scheduling=scheduling)

    def plan_proposal(self, cells: Sequence) -> tuple[dict[str, str], list]:
        """({cell_id: run_id} of the proposal's cells already finished, cells to run), from
        the runs of its config alone (one query, whatever the size of the study); an
        unfinished cell continues from the checkpoint an earlier session left, if any."""
        ids = [c.cell_id for c in cells]
        found = self.checkpoints_left.only(ids)
        keep = found.run_ids()
        grouped = self.tracking.config_runs(cells[0].config_id)
        done, to_run = self.tracking.prepare(ids, keep=keep, grouped=grouped)
        self.resume = self.resume.merged(found.only(keep))
        finished = {cell_id: self.tracking.finished_run(grouped.get(cell_id, []))
                    for cell_id in done}
        wanted = set(to_run)
        return finished, [c for c in cells if c.cell_id in wanted]

    def payload(self, cell, names: Mapping[str, str], resume_from: str | None) -> dict:
        """What travels to the worker that trains `cell`."""
        from studies.tune_experiment import cell_payload

        metric, _ = self.progress_metric
        return cell_payload(cell, resume_from, names.get(cell.cell_id),
                            log_model=self.study.log_models,
                            checkpoint_interval_s=self.study.checkpoint_interval_s,
                            tune_metrics=[metric] if metric else [])

    def experiment(self, payloads: Mapping[str, dict], searcher, cells: Sequence, *,
                   max_trials: int, total: int, done_before: int,
                   epochs: dict[str, int] | None = None, callback=None, scheduling=None,
                   names: Mapping[str, str] | None = None):
        """One Tune experiment: the trials `searcher` hands out (at most `max_trials`), with
        the progress line (`callback`: the one of an earlier part of the same cells, whose
        counts go on; else a new one over `cells`), the config-level scheduler (`scheduling`,
        default the study's) and the study's resources; `names`: the run names of the known
        cells when the caller has them. Returns the progress callback."""
        from studies.tune_experiment import ProgressCallback, run_experiment

        scheduling = scheduling or self.scheduling
        # a block's pruner knows the block's configs alone (told as they are proposed)
        early = scheduling.prepare(self.known_cells.values() if scheduling is self.scheduling
                                   else [], self.concurrency)

        def on_error(cell_id: str) -> None:  # failed for good: its config decides without it
            cell = self.known_cells.get(cell_id)
            if cell is not None:
                scheduling.mark_gone(cell)

        if callback is None:
            if epochs is None:
                epochs = {c.cell_id: int(c.config.get("epochs", 1)) for c in cells}
            progress = StudyProgress(total=total, to_run=len(cells) or max_trials,
                                     done_before=done_before, epochs=epochs, race=self.race)
            if names is None:
                names = self.namer.names(self.known_cells.values())
            metric, mode = self.progress_metric
            callback = ProgressCallback(
                progress, interval_s=self.options.progress_interval_s, stream=self.stream,
                on_error=on_error, metric=metric, mode=mode,
                labels={cell_id: name.rsplit(" s", 1)[0] for cell_id, name in names.items()})
        run_name = f"tune-{self.session_id}-{len(self.tune_dirs)}"
        root = self.storage_root()
        if root is not None:
            self.tune_dirs.append(root / run_name)
        if self.parameters is None:
            from studies.tune_experiment import ExperimentParameters

            self.parameters = ExperimentParameters()
        run_experiment(
            payloads, searcher=searcher, max_trials=max_trials, parameters=self.parameters,
            name=run_name, storage=str(root) if root is not None else str(self.options.storage),
            context=self.context, fit_fn=self.options.fit_fn, early_stopping=early,
            resources={"cpu": float(self.study.resources.cpus),
                       "gpu": float(self.study.resources.gpus)},
            concurrency=self.concurrency,
            max_failures=int(self.study.max_failures), callbacks=[callback])
        # Tune's trials of this experiment hold reference cycles: free them before the next
        # part starts, not whenever the collector next runs (a full collection of the
        # driver's heap takes about 0.3 s: not worth it after a few trials)
        if max_trials >= COLLECT_AFTER_TRIALS:
            gc.collect()
        return callback

    @functools.cached_property
    def progress_metric(self) -> tuple[str | None, str]:
        """The per-epoch metric that ranks configs in the progress line: the objective when it
        is logged every epoch, else the first variant's checkpoint-selection metric."""
        objective = self.study.objective
        if objective is not None and objective.metric.startswith(("val/", "train/")):
            return objective.metric, objective.mode
        first = self.study.variant_names[0]
        return (self.study.variant_value(first, "eval.selection"),
                self.study.variant_value(first, "eval.selection_mode", "max"))

    def run_optuna_blocks(self, total: int, done_before: int) -> None:
        """Every optuna block of the design, in order (their cells become known cells)."""
        if not self.study.optuna_blocks:
            return
        from studies.optuna_rounds import run_optuna_block

        for index, block in self.study.optuna_blocks:
            run_optuna_block(
                self.study, index, block, study_name=self.name, study_dir=self.study_dir,
                smoke=self.options.smoke, tracking=self.tracking,
                run_proposals=lambda proposals: self.run_proposals(proposals, total, done_before))


#: most trials in one Tune experiment. Tune keeps every trial of an experiment in the driver's
#: memory (about 0.15 MB each, measured) and rewrites its experiment state as trials end, so
#: a longer list of cells runs as consecutive experiments of whole configs: the driver's
#: memory stays bounded over a study of any size, for a few seconds of start per part.
MAX_TRIALS_PER_EXPERIMENT = 1000
#: an experiment of at least this many trials ends with a full garbage collection
COLLECT_AFTER_TRIALS = 100
#: how the line that starts each of several parts begins (after "[studies] ")
PART_LINE = "experiment part"


def experiment_parts(cells: Sequence, limit: int) -> list[list]:
    """`cells` (config-major) cut into parts of at most `limit` cells, never inside a config
    (its seeds run together: early stopping compares them epoch by epoch); a config of more
    than `limit` seeds is a part of its own."""
    configs: list[list] = []
    for cell in cells:
        if not configs or configs[-1][0].config_id != cell.config_id:
            configs.append([])
        configs[-1].append(cell)
    parts: list[list] = []
    for config in configs:
        if not parts or len(parts[-1]) + len(config) > limit:
            parts.append([])
        parts[-1].extend(config)
    return parts


# ----------------------------------------------------------------------------- entry points


def _settings_path(study_dir: Path) -> Path:
    return study_dir / SETTINGS_FILE


def read_settings(study_dir: Path) -> dict:
    path = _settings_path(study_dir)
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def smoke_study(study):
    """The study as a smoke run executes it: one CPU per trial, no GPU, no early stopping or
    pruning.

    The smoke cells are tiny CPU jobs of one epoch (studies.space.smoke_config), so the
    file's GPU resources and its scheduler or pruners (which need every seed of a config at
    once, and decide nothing at a config's last epoch) do not apply, and their models are
    not worth logging.
    """
    from studies.study import NoScheduler, Resources

    design = [block.model_copy(update={"pruner": None}) if getattr(block, "pruner", None)
              else block for block in study.design]
    return study.model_copy(update={"resources": Resources(cpus=1, gpus=0), "design": design,
                                    "scheduler": NoScheduler(kind="none"), "log_models": False})


def _load(study_file: str | Path, options: RunOptions) -> tuple[Any, list, str]:
    """(study, cells, run name), validated; a smoke run's tiny version when asked."""
    from studies.space import expand, smoke_cells
    from studies.spec import load_study

    study = load_study(study_file, max_cells=options.max_cells)
    cells = expand(study)
    if options.smoke:
        cells = smoke_cells(cells)
        study = smoke_study(study)
    return study, cells, study.name + (SMOKE_SUFFIX if options.smoke else "")


def _prepare_study_dir(study_file: str | Path, name: str,
                       options: RunOptions) -> tuple[Path, Path, str]:
    """(study folder, its copy of the study file, tracking URI): the folder made, the file
    copied and the run's settings saved (for `studies resume`)."""
    from studies.preconditions import writable_folder

    study_dir = study_dir_of(options.output, name)
    problems = writable_folder(study_dir, "the output folder")
    if problems:
        raise RunnerError(problems[0] + "; pass --output DIR")
    try:
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
    except OSError as error:  # a full disk, a folder that changed under us
        raise RunnerError(f"cannot write the study folder {study_dir} ({error.strerror or error}); "
                          f"free space or pass --output DIR") from None
    return study_dir, study_copy, tracking_uri


def _set_log_levels(verbose: bool) -> None:
    """No third-party INFO lines (MLflow's and alembic's database set-up, Ray's notices)
    unless --verbose: the study's own lines are what a user reads."""
    import logging

    level = logging.INFO if verbose else logging.WARNING
    # MLflow sets its logger's level from this variable when it is imported (later, lazily)
    os.environ["MLFLOW_LOGGING_LEVEL"] = logging.getLevelName(level)
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(level)
    os.environ["STUDIES_RAY_LOG_LEVEL"] = str(logging.INFO if verbose else logging.ERROR)


def _check_preconditions(study_dir: Path, tracking_uri: str, options: RunOptions, cells: Sequence) -> None:
    """Every precondition of the run (studies.preconditions), before Ray or MLflow is touched."""
    from studies.preconditions import check_all

    data_configs = {json.dumps(c.config.get("data", {}), sort_keys=True): c.config.get("data", {})
                    for c in cells}
    problems = check_all(study_dir, tracking_uri, options.storage, data_configs.values())
    if problems:
        raise RunnerError("; ".join(problems) + ". Nothing was started.")


def _take_lease(tracking: StudyTracking, name: str, options: RunOptions, say: Callable[[str], None]):
    """The study's lease (studies.lease): one driver per study, or RunnerError naming the holder."""
    from studies.lease import LeaseHeld, StudyLease

    lease = StudyLease(tracking.client, tracking.experiment_id, name, warn=lambda text: say(f"warning: {text}"))
    try:
        if options.wait:
            say("waiting for the other driver of this study to finish (--wait)")
        lease.acquire(wait=options.wait)
    except LeaseHeld as held:
        raise RunnerError(str(held)) from None
    return lease


def _run(session: _Session, cells: Sequence, study_copy: Path, leases: list) -> None:
    """Run the cells that the ledger says are missing, then the optuna blocks.

    A new study (no experiment yet) starts Ray and checks that it can run here first, so a
    study that cannot run creates nothing in MLflow. Then the study's lease (one driver per
    study; it is an experiment tag, so the experiment exists from here on), and only under
    the lease the ledger, which deletes the leftovers of an interrupted run, and the trials.
    The lease is appended to `leases` for the caller to release.
    """
    study, tracking = session.study, session.tracking
    fresh = tracking.find_experiment_id() is None
    if fresh:
        session.start()
    # kept out of the session: Tune pickles the callbacks that refer to it, not a thread
    leases.append(_take_lease(tracking, session.name, session.options, session.say))
    done, pending = session.plan(cells)
    if (pending or study.optuna_blocks) and not fresh:
        session.start()
    parent_run = tracking.parent_run_id(study_copy)
    session.context = tracking.context(session.session_id)
    proposals = sum(b.n_configs for _, b in study.optuna_blocks)
    session.say(f"study {session.name}: {len(cells)} cells"
                + (f" (racing: at most; {session.race.summary()})" if session.race else "")
                + (f" + {proposals} optuna proposals x {len(study.seed_list)} seeds"
                   if study.optuna_blocks else "")
                + f"; tracking {tracking.tracking_uri} (experiment {tracking.experiment_id}, "
                  f"parent run {parent_run})")
    if done:
        session.say(f"{len(done)} cells already finished (skipped)")
    if not (pending or study.optuna_blocks):
        return
    total_hint = len(cells) + proposals * len(study.seed_list)
    session.run_cells(pending, total=total_hint, done_before=len(done))
    session.run_optuna_blocks(total_hint, len(done))


def run_study(study_file: str | Path, options: RunOptions | None = None) -> RunOutcome:
    """Run (or complete) the study in `study_file`; see the module docstring.

    Raises `studies.spec.StudyError` for a bad study file (before anything starts) and
    `RunnerError` for a study that cannot run on this cluster.
    """
    options = options or RunOptions()
    stream = options.stream or sys.stdout
    # MLflow's client retries a failed request silently for minutes; a few quick retries, then
    # the runner's own backoff (studies.tracking.with_retry) that says so (workers inherit this)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    # no "View run ... at ..." line per ended run: with a server it costs a request per cell
    # and two console lines per cell from every worker (docs/scale.md)
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    _set_log_levels(options.verbose)
    study, cells, name = _load(study_file, options)
    if options.dry_run:
        from studies.space import format_cells_table

        _print(stream, format_cells_table(cells, study))
        return RunOutcome(0, name, cells=len(cells))

    study_dir, study_copy, tracking_uri = _prepare_study_dir(study_file, name, options)
    _check_preconditions(study_dir, tracking_uri, options, cells)
    tracking = StudyTracking(
        tracking_uri, name,
        artifact_root=(study_dir / "mlartifacts") if tracking_uri.startswith("sqlite:") else None,
        description=study_description(study.description, study.source_text),
        run_tags=source_tags(read_settings(study_dir).get("source") or study_file))
    session = _Session(study, name, study_dir, tracking, options, stream)
    session.know(cells)
    if options.address and tracking_uri.startswith("sqlite:"):
        session.say(f"warning: tracking to a SQLite file ({tracking_uri}) with --address: "
                    f"workers on other nodes cannot reach it; pass "
                    f"--tracking-uri http://<mlflow server>")

    started = time.monotonic()
    interrupted = False
    leases: list = []
    try:
        _run(session, cells, study_copy, leases)
    except KeyboardInterrupt:
        interrupted = True
        session.say(f"interrupted; `studies resume {name}` (or the same `studies run`) "
                    f"completes what is missing")
    finally:
        session.ray.stop()
        for lease in leases:
            lease.release()

    outcome = _summarise(session, started, stream, interrupted)
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


def _summarise(session: _Session, started: float, stream: IO[str], interrupted: bool = False) -> RunOutcome:
    """Every cell seen (the file's and the optuna blocks'): finished or not; closes the
    parent run. After a complete (not interrupted) run, a cell whose run is still `running`
    ended without its trial recording why: it is marked failed, so no run stays running."""
    ids = list(session.known_cells)
    states = session.tracking.cell_states(ids)
    not_needed: list[str] = []
    if session.race is not None:  # cells of configs the race decided: never started, not failures
        not_needed = session.race.not_needed(i for i in ids if states[i].status == "missing")
        skip = set(not_needed)
        ids = [i for i in ids if i not in skip]
    if not interrupted:
        for cell_id, state in states.items():
            if state.status == "running":
                states[cell_id] = session.tracking.fail_unfinished(
                    state, "the trial ended without finishing or recording an error (see the driver's log)")
    finished = [i for i in ids if states[i].status == STATUS_FINISHED]
    failed = {i: (states[i].error or states[i].status) for i in ids
              if states[i].status != STATUS_FINISHED}
    all_done = not failed
    session.tracking.close_parent(all_done)
    _print(stream, f"[studies] summary: {len(finished)}/{len(ids)} cells finished, "
                   f"{len(failed)} not finished, {format_duration(time.monotonic() - started)}"
                   f" wall time")
    if session.race is not None:
        _print(stream, f"[studies] race: {session.race.summary()}; {len(not_needed)} cells not "
                       f"needed (their configs were decided before their seeds)")
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
