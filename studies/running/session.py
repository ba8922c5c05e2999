"""One invocation of the runner on one study (`StudySession`): what the runner's steps share
(the Ray session, the config-level schedulers, the cells seen and their run names, the
checkpoints to resume, Tune's folders), and how it runs cells as Tune experiments: the grid's
cells in parts of at most `studies.cells.arrays.MAX_TRIALS_PER_EXPERIMENT` trials, a race's cells as the race
decides, an optuna block's proposals as trial slots free up; with ``resources.seeds_per_trial``
> 1 each trial a fused array of a config's seeds (a race's: of one round).

`studies.running.runner` drives it (validation, the study folder, the ledger, the summary).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

from studies.cells.arrays import array_id, experiment_parts, fused_arrays
from studies.cells.cell_queue import config_major
from studies.cells.run_names import RunNamer
from studies.running import termination
from studies.running.checkpoints import ResumePoints
from studies.running.progress import StudyProgress, activity, say
from studies.running.ray_session import RaySession
from studies.running.run_options import RunOptions
from studies.scheduling import session_scheduling
from studies.tracking import StudyTracking, TrackingContext, finished_runs, new_session_id

if TYPE_CHECKING:
    from studies.running.tune_experiment import ExperimentParameters
    from studies.scheduling.race_driver import RaceDriver


class StudySession:
    """One invocation of the runner on one study: what its collaborators share (the Ray
    session, the config-level schedulers, the cells seen, the checkpoints to resume, Tune's
    folders)."""

    def __init__(
        self,
        study,
        name: str,
        study_dir: Path,
        tracking: StudyTracking,
        options: RunOptions,
        stream: IO[str],
        ray: RaySession | None = None,
    ):
        self.study = study
        self.name = name
        self.study_dir = study_dir
        self.tracking = tracking
        self.options = options
        self.stream = stream
        self.session_id = new_session_id()
        self.ray = ray or RaySession.of(options)  # the runner's, when it began starting Ray before the session
        self.scheduling = session_scheduling(study, tracking, self.session_id)
        self.block_scheduling = {}  # optuna block index -> its pruner's scheduling
        for index, block in study.optuna_blocks:
            if block.pruner is not None:
                from studies.scheduling.optuna_pruning import block_scheduling

                self.block_scheduling[index] = block_scheduling(study, tracking, self.session_id, index)
        self.concurrency = 1
        self.context: TrackingContext | None = None  # what the trials write under, by `open_parent_run`
        self.tune_dirs: list[Path] = []
        self.known_cells: dict[str, Any] = {}  # every cell of the study seen so far
        self.namer = RunNamer()  # their run names
        self._colors: tuple[int, dict[str, str]] = (0, {})  # (configs named, their colours)
        self.other_versions: dict[str, list[str]] = {}  # variant -> configs of the study's other versions
        self.resume = ResumePoints()  # cells that continue from an earlier session
        self.checkpoints_left = ResumePoints()  # every cell's, for an optuna block's proposals
        self.race: RaceDriver | None = None  # a racing study's race (studies.scheduling.race_driver), rebuilt by `plan`
        self.parameters: ExperimentParameters | None = None  # what its Tune experiments pass to their trials, put once
        self.callback = None  # the progress line's callback: its counts go on from one experiment to the next
        self.proposals: list = []  # the optuna blocks run (studies.scheduling.optuna_rounds.OptunaProposals)
        self.finished_runs: list = []  # the finished run of each done cell, by `plan` (with its times)
        self.finished_values: dict[str, float] = {}  # done cell -> its best progress metric, by `plan`

    def say(self, text: str) -> None:
        say(self.stream, text)

    def open_parent_run(self, study_copy: Path) -> str:
        """The study's parent run (found, else created; `study_copy` logged to it), and the
        tracking context its trials write their runs under."""
        parent_run = self.tracking.parent_run_id(study_copy)
        self.context = self.tracking.context(self.session_id)
        return parent_run

    def warn_refused(self, found: ResumePoints) -> None:
        """One warning line per checkpoint skipped as unreadable (at most 5, then a count):
        its cell starts from epoch 0."""
        for text in found.refused[:5]:
            self.say(f"warning: checkpoint skipped, its cell starts from epoch 0: {text}")
        if len(found.refused) > 5:
            self.say(f"warning: {len(found.refused) - 5} more checkpoints skipped the same way")

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
        from setvalued.metrics import TIME_METRICS

        ids = [c.cell_id for c in cells]
        metric, _ = self.progress_metric  # and the progress line's best so far
        extra = (metric, BEST_VALUE_METRIC) if metric else ()
        grouped = self.tracking.cell_runs(metrics=(*TIME_METRICS, *extra))  # the times: the time left
        if cells:  # their run colours come after those of the study's other versions
            from studies.tracking.ui_view import other_version_configs

            self.other_versions = other_version_configs(
                (r for runs in grouped.values() for r in runs), cells[0].version
            )
            self._colors = (-1, {})
        self.finished_runs = [found[-1] for found in (finished_runs(grouped.get(i, [])) for i in ids) if found]
        self.finished_values = self.best_values(self.finished_runs)
        # only the checkpoints of unfinished cells are read: a finished study reads none
        unfinished = [i for i in ids if self.tracking.finished_run(grouped.get(i, [])) is None]
        found = ResumePoints.search(self.storage_root(), self.name, unfinished)
        self.warn_refused(found)
        keep = found.run_ids()
        done, to_run = self.tracking.prepare(ids, keep=keep, grouped=grouped)  # drops what it did not keep
        self.resume = found.only(keep)
        self.tune_dirs.extend(self.resume.experiment_dirs())
        message = self.resume.describe()
        if message:
            self.say(message)
        wanted = set(to_run)
        if self.study.racing is not None:  # only the cells of configs still racing may run
            from studies.scheduling.race_driver import RaceDriver

            race = RaceDriver.rebuild(self.study, cells, self.tracking, resumable=self.resume.folders())
            self.race = race
            wanted = set(race.runnable(to_run))
        return done, [c for c in cells if c.cell_id in wanted]

    def best_values(self, runs: Sequence) -> dict[str, float]:
        """cell_id -> the progress metric's best value of each finished run: `best_val` when the
        metric is its cell's checkpoint-selection metric (the best over its epochs), else the
        metric's last value."""
        from analysis.layout import TAG_CELL_ID

        metric, _ = self.progress_metric
        values = {}
        for run in runs if metric else ():
            cell = self.known_cells.get(run.tags.get(TAG_CELL_ID))
            if cell is None:
                continue
            selection = (cell.config.get("eval") or {}).get("selection")
            value = run.metrics.get(BEST_VALUE_METRIC if selection == metric else metric)
            if value is not None:
                values[cell.cell_id] = float(value)
        return values

    def start(self) -> None:
        """Start Ray, count the trial slots, refuse a config-level scheduler that cannot work
        here."""
        where = f"Ray at {self.options.address}" if self.options.address else "a local Ray"
        with activity(self.stream, f"starting {where}"):
            self.ray.start()
        termination.trap()  # ray.init replaced the SIGTERM handler with one that aborts
        if self.ray.warm_lease is not None:
            self.say(f"joined {self.ray.warm_lease.warm.describe()} (kept by --keep-warm)")
        if self.ray.dashboard_url:
            self.say(f"Ray dashboard: {self.ray.dashboard_url}")
        self.concurrency = self.ray.trial_slots(self.study, self.stream)
        for scheduling in (self.scheduling, *self.block_scheduling.values()):
            scheduling.check_concurrency(self.concurrency)

    def run_cells(self, cells: Sequence, total: int, done_before: int) -> None:
        """One Tune experiment over `cells` (all not finished yet)."""
        if not cells:
            return
        from studies.running.tune_experiment import CellQueueSearcher, RaceSearcher

        cells = config_major(cells)
        names = self.namer.names(cells)
        resume_from = self.resume.folders()
        payloads = {c.cell_id: self.payload(c, names, resume_from.get(c.cell_id)) for c in cells}
        per_trial = int(self.study.resources.seeds_per_trial)
        self.say(self.running_line(cells, per_trial))
        if self.race is not None:  # the race decides which cells start: one experiment
            if per_trial > 1:
                self.say(
                    f"racing: each round of a config's seeds as fused arrays of up to "
                    f"{per_trial} seeds (one trial each)"
                )
            self.experiment(
                RaceSearcher(self.race, payloads, per_trial),
                cells,
                max_trials=len(cells),
                total=total,
                done_before=done_before,
                names=names,
                arrays=per_trial > 1,
            )
            return
        callback = None
        parts = experiment_parts(cells, per_trial, self.resume.start_epochs())  # studies.cells.arrays
        for number, part in enumerate(parts, start=1):
            part_cells = [c for trial in part for c in trial]
            if len(parts) > 1:
                self.say(f"{PART_LINE} {number}/{len(parts)}: {len(part_cells)} cells")
            if per_trial > 1:
                trials = self.array_payloads(part, payloads)
                if len(parts) > 1:
                    self.say(f"{len(part_cells)} cells as {len(trials)} fused arrays of up to {per_trial} seeds")
            else:
                trials = {c.cell_id: payloads[c.cell_id] for c in part_cells}
            callback = self.experiment(
                CellQueueSearcher(trials),
                cells,
                max_trials=len(trials),
                total=total,
                done_before=done_before,
                callback=callback,
                names=names,
                arrays=per_trial > 1,
            )
        self.callback = callback

    def running_line(self, cells: Sequence, per_trial: int) -> str:
        """What runs and how the machine is used: the cells (as fused arrays: how many, of how
        many seeds), how many trials at once and so how many cells, each trial's CPUs and GPUs
        (an array's: `studies.cells.arrays.trial_resources`), the cluster's CPUs and GPUs in use."""
        from studies.cells.arrays import trial_resources

        cpus, gpus = trial_resources(self.study.resources, per_trial, self.ray.node_cpus or None)
        sharing = self.ray.gpu_sharing(gpus, self.concurrency)
        use = f"{cpus:g} CPU / {gpus:g} GPU each"
        if self.ray.cluster_cpus:
            use += f"; {min(self.concurrency * cpus, self.ray.cluster_cpus):g} of {self.ray.cluster_cpus:g} CPUs"
            if self.ray.cluster_gpus:
                use += f", {min(self.concurrency * gpus, self.ray.cluster_gpus):g} of {self.ray.cluster_gpus:g} GPUs"
        if sharing:
            use += f"; {sharing} trials share each GPU" if sharing > 1 else "; 1 trial per GPU"
        if per_trial <= 1:
            return f"running {len(cells)} cells ({self.concurrency} at a time, {use})"
        round_of = None
        if self.race is not None:  # a race's arrays are cut by round
            from studies.scheduling.racing import race_rounds

            round_of = race_rounds(self.study)
        arrays = len(fused_arrays(cells, per_trial, self.resume.start_epochs(), round_of))
        at_once = min(self.concurrency, arrays)
        return (
            f"running {len(cells)} cells as {arrays} fused array{'s' if arrays != 1 else ''} of up to {per_trial} "
            f"seeds ({at_once} array{'s' if at_once != 1 else ''} at a time, up to "
            f"{min(self.concurrency * per_trial, len(cells))} cells; {use.replace(' each', ' an array')})"
        )

    def trial_resources(self, arrays: bool):
        """What each trial of an experiment asks Ray for: a dict (cells), or a function of a
        trial's config (fused arrays: by their members, `studies.cells.arrays.trial_resources`)."""
        from studies.cells.arrays import trial_resources

        if not arrays:
            cpus, gpus = trial_resources(self.study.resources)
            return {"cpu": cpus, "gpu": gpus}
        return ArrayResources(self.study.resources, self.ray.node_cpus or None)

    @staticmethod
    def array_payloads(arrays: Sequence[Sequence], payloads: Mapping[str, dict]) -> dict[str, dict]:
        """The payloads of fused ``arrays`` (`studies.cells.arrays`), keyed by the arrays' trial names."""
        from studies.running.tune_experiment import array_payload

        return {array_id(a): array_payload(array_id(a), [payloads[c.cell_id] for c in a]) for a in arrays}

    def run_proposals(self, proposals, total: int, done_before: int) -> None:
        """One Tune experiment over the configs of an optuna block, asked as slots free up
        (`studies.scheduling.optuna_rounds.OptunaProposals`): each proposal's cells that the ledger has
        finished are told at once, the others run."""
        from studies.running.tune_experiment import ProposalSearcher

        scheduling = self.block_scheduling.get(proposals.index, self.scheduling)
        self.proposals.append(proposals)
        # the progress goes on from the cells before (done never falls back); the block's
        # cells are counted as their configs are asked, those of configs not asked yet as
        # the most they may add
        callback = self.callback or self.progress_callback(
            [], total=total, done_before=done_before, epochs={}, to_run=0
        )
        callback.progress.may_add = lambda: proposals.max_cells
        epochs = callback.progress.epochs
        # one scan of the storage for the checkpoints of every cell of the study; a
        # proposal (a replayed config) takes those of its cells
        self.checkpoints_left = ResumePoints.search(self.storage_root(), self.name, None)
        self.warn_refused(self.checkpoints_left)

        def admit(cells: list) -> list[dict]:
            self.know(cells)
            if scheduling.enabled:
                scheduling.prepare(cells, self.concurrency)
            done, pending = self.plan_proposal(cells)
            callback.progress.admit([c.cell_id for c in pending], done=list(done))
            for cell_id, run_id in done.items():
                proposals.cell_ended(cell_id, run_id)
            # the block's configs named against each other (a name may grow as configs come)
            names = self.namer.names(proposals.cells_used)
            callback.add_labels({cell_id: name.rsplit(" s", 1)[0] for cell_id, name in names.items()})
            resume_from = self.resume.folders()
            for cell in pending:
                epochs[cell.cell_id] = int(cell.config.get("epochs", 1))
            payloads = {c.cell_id: self.payload(c, names, resume_from.get(c.cell_id)) for c in pending}
            if per_trial > 1:  # the config's seeds as fused arrays, each one trial
                arrays = fused_arrays(pending, per_trial, self.resume.start_epochs())
                payloads = self.array_payloads(arrays, payloads)
            return list(payloads.values())

        per_trial = int(self.study.resources.seeds_per_trial)
        self.say(
            f"optuna: up to {proposals.max_cells} cells, configs asked as slots free up "
            + (
                f"({self.concurrency} fused arrays of up to {per_trial} seeds at a time, up to "
                f"{self.concurrency * per_trial} cells)"
                if per_trial > 1
                else f"({self.concurrency} at a time)"
            )
        )
        if proposals.index not in self.block_scheduling:
            self.callback = self.experiment(
                ProposalSearcher(proposals, admit),
                [],
                epochs=epochs,
                max_trials=proposals.max_cells,
                total=total,
                done_before=done_before,
                callback=callback,
                arrays=per_trial > 1,
            )
            return
        from studies.scheduling.optuna_pruning import PrunerBridge

        scheduling.prepare([], self.concurrency)  # the actor, for the bridge
        with PrunerBridge(scheduling.actor, proposals.report_epoch):
            self.callback = self.experiment(
                ProposalSearcher(proposals, admit),
                [],
                epochs=epochs,
                max_trials=proposals.max_cells,
                total=total,
                done_before=done_before,
                scheduling=scheduling,
                callback=callback,
                arrays=per_trial > 1,
            )

    def plan_proposal(self, cells: Sequence) -> tuple[dict[str, str | None], list]:
        """({cell_id: run_id} of the proposal's cells already finished, cells to run), from
        the runs of its config alone (one query, whatever the size of the study); an
        unfinished cell continues from the checkpoint an earlier session left, if any."""
        ids = [c.cell_id for c in cells]
        found = self.checkpoints_left.only(ids)
        keep = found.run_ids()
        grouped = self.tracking.config_runs(cells[0].config_id)
        done, to_run = self.tracking.prepare(ids, keep=keep, grouped=grouped)
        self.resume = self.resume.merged(found.only(keep))
        finished = {cell_id: self.tracking.finished_run(grouped.get(cell_id, [])) for cell_id in done}
        wanted = set(to_run)
        return finished, [c for c in cells if c.cell_id in wanted]

    def payload(self, cell, names: Mapping[str, str], resume_from: str | None) -> dict:
        """What travels to the worker that trains `cell`."""
        from studies.running.tune_experiment import cell_payload
        from studies.tracking.ui_view import run_colors

        metric, _ = self.progress_metric
        known = sum(map(len, self.namer.configs.values()))
        if self._colors[0] != known:  # the report's colours of the configs named so far
            self._colors = (known, run_colors(self.namer.configs, list(self.study.variants), self.other_versions))
        return cell_payload(
            cell,
            resume_from,
            names.get(cell.cell_id),
            color=self._colors[1].get(cell.config_id),
            log_model=self.study.log_models,
            checkpoint_interval_s=self.study.checkpoint_interval_s,
            tune_metrics=[metric] if metric else [],
        )

    def experiment(
        self,
        searcher,
        cells: Sequence,
        *,
        max_trials: int,
        total: int,
        done_before: int,
        epochs: dict[str, int] | None = None,
        callback=None,
        scheduling=None,
        names: Mapping[str, str] | None = None,
        arrays: bool = False,
    ):
        """One Tune experiment: the trials `searcher` hands out (at most `max_trials`), with
        the progress line (`callback`: the one of an earlier part of the same cells, whose
        counts go on; else a new one over `cells`), the config-level scheduler (`scheduling`,
        default the study's) and the study's resources; `names`: the run names of the known
        cells when the caller has them. Returns the progress callback."""
        from studies.running.tune_experiment import run_experiment

        scheduling = scheduling or self.scheduling
        # a block's pruner knows the block's configs alone (told as they are proposed)
        early = scheduling.prepare(self.known_cells.values() if scheduling is self.scheduling else [], self.concurrency)

        def on_error(cell_id: str) -> None:  # failed for good: its config decides without it
            cell = self.known_cells.get(cell_id)
            if cell is not None:
                scheduling.mark_gone(cell)

        if callback is None:
            callback = self.progress_callback(cells, total=total, done_before=done_before, epochs=epochs, names=names)
        callback.on_error = on_error  # this experiment's scheduler learns of a failed cell
        run_name = f"tune-{self.session_id}-{len(self.tune_dirs)}"
        root = self.storage_root()
        if root is not None:
            self.tune_dirs.append(root / run_name)
        if self.parameters is None:
            from studies.running.tune_experiment import ExperimentParameters

            self.parameters = ExperimentParameters()
        run_experiment(
            searcher,
            max_trials=max_trials,
            parameters=self.parameters,
            name=run_name,
            storage=str(root) if root is not None else str(self.options.storage),
            context=cast(TrackingContext, self.context),  # set by open_parent_run
            fit_fn=self.options.fit_fn,
            early_stopping=early,
            resources=self.trial_resources(arrays),
            concurrency=self.concurrency,
            max_failures=int(self.study.max_failures),
            callbacks=[callback],
            arrays=arrays,
        )
        # Tune's trials of this experiment hold reference cycles: free them before the next
        # part starts, not whenever the collector next runs (a full collection of the
        # driver's heap takes about 0.3 s: not worth it after a few trials)
        if max_trials >= COLLECT_AFTER_TRIALS:
            gc.collect()
        return callback

    def progress_callback(
        self,
        cells: Sequence,
        *,
        total: int,
        done_before: int,
        epochs: dict[str, int] | None = None,
        names: Mapping[str, str] | None = None,
        to_run: int | None = None,
    ):
        """A new progress line (`studies.running.tune_experiment.ProgressCallback`) over `cells`, its
        configs named by their run names."""
        from studies.running.tune_experiment import ProgressCallback

        if epochs is None:
            epochs = {c.cell_id: int(c.config.get("epochs", 1)) for c in cells}
        progress = StudyProgress(
            total=total,
            to_run=len(cells) if to_run is None else to_run,
            done_before=done_before,
            epochs=epochs,
            race=self.race,
        )
        if names is None:
            names = self.namer.names(self.known_cells.values())
        metric, mode = self.progress_metric
        callback = ProgressCallback(
            progress,
            interval_s=self.options.progress_interval_s,
            stream=self.stream,
            metric=metric,
            mode=mode,
            labels={cell_id: name.rsplit(" s", 1)[0] for cell_id, name in names.items()},
        )
        if self.finished_values:  # the cells finished before this invocation count too
            done = [self.known_cells[i] for i in self.finished_values]
            callback.add_finished(
                self.finished_values,
                {cell_id: name.rsplit(" s", 1)[0] for cell_id, name in self.namer.names(done).items()},
            )
        return callback

    @functools.cached_property
    def progress_metric(self) -> tuple[str | None, str]:
        """The per-epoch metric that ranks configs in the progress line: the objective when it
        is logged every epoch, else the first variant's checkpoint-selection metric."""
        objective = self.study.objective
        if objective is not None and objective.metric.startswith(("val/", "train/")):
            return objective.metric, objective.mode
        first = self.study.variant_names[0]
        return (
            self.study.variant_value(first, "eval.selection"),
            self.study.variant_value(first, "eval.selection_mode", "max"),
        )

    def run_optuna_blocks(self, total: int, done_before: int) -> None:
        """Every optuna block of the design, in order (their cells become known cells)."""
        if not self.study.optuna_blocks:
            return
        from studies.scheduling.optuna_rounds import run_optuna_block

        for index, block in self.study.optuna_blocks:
            run_optuna_block(
                self.study,
                index,
                block,
                study_name=self.name,
                study_dir=self.study_dir,
                smoke_epochs=self.options.smoke_epochs if self.options.smoke else 0,
                tracking=self.tracking,
                run_proposals=lambda proposals: self.run_proposals(proposals, total, done_before),
            )


class ArrayResources:
    """A fused array's resources from its trial's config (Tune calls it per trial, and pickles
    it with the experiment): `studies.cells.arrays.trial_resources` of its members."""

    def __init__(self, resources, node_cpus: float | None):
        self.resources, self.node_cpus = resources, node_cpus

    def __call__(self, config: Mapping[str, Any]):
        from ray.tune import PlacementGroupFactory

        from studies.cells.arrays import trial_resources
        from studies.running.tune_experiment import payload_cell_ids

        members = len(payload_cell_ids(config["cell"]))
        cpus, gpus = trial_resources(self.resources, members, self.node_cpus)
        return PlacementGroupFactory([{"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}])


#: the metric a finished run holds its selection metric's best value in (setvalued.train.fit)
BEST_VALUE_METRIC = "best_val"
#: an experiment of at least this many trials ends with a full garbage collection
COLLECT_AFTER_TRIALS = 100
#: how the line that starts each of several parts begins (after "[studies] ")
PART_LINE = "experiment part"
