"""The Tune function trainable of a fused array: the cells of one config and N of its seeds
trained as one model in one trial (``resources.seeds_per_trial``; ``setvalued.fused``).

Every member is a cell everywhere a person looks: its own MLflow cell run (opened, resumed and
finished as `studies.running.trial.run_cell` does it, with its epochs, test metrics and Logged
Model), its own Tune reports (``cell_id`` names the member: the progress line counts cells),
and its own checkpoint: after an epoch, at most every ``checkpoint_interval_s``, one Tune
checkpoint holds a folder per member (named by its cell id, the layout of
`studies.running.checkpoints`), each the state of the member's separate trial. A Tune restart
resumes every member from its folder; a new session finds a member's folder by its cell id.
Members whose starting points differ (a checkpoint that could not be read) train as separate
arrays, one after the other. A member whose loss goes non-finite fails alone (its run FAILED
with the error); any other error fails the array's cells as `run_cell` fails a cell. Under
early stopping, ASHA or an optuna block's pruner every member's value is recorded with the
config's coordinator after each epoch and the decision awaited once: a stop stops the array as
a whole (each member tagged as a stopped cell, its selected checkpoint tested). A race's
arrays and an optuna proposal's are trained the same way; their searchers tell the race or
the proposal of each member's end (`studies.running.tune_experiment`).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from studies.running.checkpoints import read_checkpoint, save_checkpoint
from studies.running.trial import (
    EpochReporter,
    already_finished,
    cell_ids,
    deterministic_errors,
    discard_run,
    flush_for_the_record,
    log_missing_epochs,
    log_model_of,
    one_paragraph,
    plugin_tags,
    read_resume_checkpoint,
    record_failure,
    set_torch_threads,
    start_report,
    will_repeat,
)
from studies.scheduling.coordinator import CoordinatorClient
from studies.tracking import TAG_NODE_ID, TAG_PRUNED, TAG_STOPPED_EPOCH, CellRun, TrackingContext
from studies.tracking.provenance import array_tag


class MemberReporter(EpochReporter):
    """A member's `on_epoch`: its history and MLflow epochs as a cell's; the Tune reports and the
    checkpoint are the array's (`ArrayEpochs`), once every member has closed the epoch."""

    #: the error an earlier session's attempt of this member's run recorded (set by `run_array`)
    earlier_error: str | None

    def __call__(self, epoch: int, metrics: Mapping[str, Any], state: Any) -> None:
        epoch = int(epoch)
        values = self.record(epoch, metrics, state)
        self.last_time = time.perf_counter()
        self.closed = (epoch, values)


class ArrayEpochs:
    """The array's Tune reports after each epoch: one per member, the last one carrying the
    checkpoint of every member when one is due; then, under a config-level rule (early
    stopping, ASHA), every member's value recorded with the coordinator and the config's
    decision awaited once: 'stop' stops the array as a whole (`setvalued.fused.STOP`)."""

    def __init__(self, reporters: Sequence[MemberReporter], interval_s: float, last_epoch: int):
        self.reporters, self.interval_s, self.last_epoch = list(reporters), interval_s, last_epoch
        self.last_checkpoint = time.perf_counter()
        self.gone: set[int] = set()  # members told gone to the coordinator
        self.stopped_at: int | None = None  # epochs done when the rule stopped the array

    def on_member(self, i: int, epoch: int, metrics: Mapping[str, Any], state: Any) -> None:
        self.reporters[i](epoch, metrics, state)

    def after_epoch(self, epoch: int) -> str | None:
        closed = [r for r in self.reporters if getattr(r, "closed", (None,))[0] == epoch]
        for i, r in enumerate(self.reporters):  # failed this epoch: its config decides without it
            if r not in closed and i not in self.gone and r.coordinator is not None:
                r.coordinator.tell_gone()
                self.gone.add(i)
        if not closed:
            return None
        self._report(epoch, closed)
        if closed[0].coordinator is None:
            return None
        coordinators = [cast(CoordinatorClient, r.coordinator) for r in closed]  # all or none have one
        statuses = [c.record(r.epochs_done, r.closed[1]) for c, r in zip(coordinators, closed)]
        status = coordinators[-1].wait(closed[-1].epochs_done, statuses[-1])
        if status == "stop":
            self.stopped_at = closed[-1].epochs_done
            return "stop"
        return None

    def _report(self, epoch: int, closed: list[MemberReporter]) -> None:
        import ray.tune

        reports = [r.tune_report(epoch, r.closed[1]) for r in closed]
        due = (
            self.interval_s <= 0
            or epoch >= self.last_epoch
            or time.perf_counter() - self.last_checkpoint >= self.interval_s
        )
        if not due:
            for report in reports:
                ray.tune.report(report)
            return
        with tempfile.TemporaryDirectory(prefix="studies-ckpt-") as folder:
            for r in closed:
                member = Path(folder) / r.cell["cell_id"]
                member.mkdir()
                save_checkpoint(member, r.state, r.checkpoint_meta(epoch))
            for report in reports[:-1]:
                ray.tune.report(report)
            ray.tune.report(reports[-1], checkpoint=ray.tune.Checkpoint.from_directory(folder))
        self.last_checkpoint = time.perf_counter()
        if epoch < self.last_epoch:  # after the last, the runs' final requests take them
            for r in closed:
                r.flush()


def run_array(
    tune_config: Mapping[str, Any],
    *,
    context: TrackingContext,
    fit_fn=None,
    early_stopping: Mapping[str, Any] | None = None,
) -> None:
    """Train the cells of ``tune_config["cell"]["members"]`` (payloads of one config) as fused
    arrays, each cell tracked as `run_cell` tracks one. ``early_stopping``: `run_cell`'s (the
    config-level rule's coordinator, which stops an array as a whole); ``fit_fn`` is not used:
    a fused array trains with ``setvalued.fused.fit_array``."""
    import ray
    import ray.tune

    cells = list(tune_config["cell"]["members"])
    set_torch_threads()
    starts = _starting_points(cells)
    node = ray.get_runtime_context().get_node_id()
    reporters: list[MemberReporter] = []
    for cell, (state, meta) in zip(cells, starts):
        if meta.get("discard_run_id"):
            discard_run(context, meta["discard_run_id"])
        run, reused = CellRun.open(
            context,
            cell,
            run_id=meta.get("run_id"),
            tags={TAG_NODE_ID: node, **plugin_tags(cell), **array_tag(cells, cell)},
        )
        if reused and already_finished(run):
            ray.tune.report({**cell_ids(cell, run), "cell_status": "finished"})
            continue
        history = meta.get("history", [])
        logged_through = log_missing_epochs(run, history, reused, resumed=state is not None)
        reporter = MemberReporter(
            run,
            cell,
            context,
            history,
            logged_through,
            CoordinatorClient.connect(early_stopping, cell),
            state,
            start_report(cell, state, meta),
        )
        reporter.earlier_error = run.recorded_error() if reused else None
        reporters.append(reporter)
    groups: dict[int, list[MemberReporter]] = {}  # members by the epoch they start after
    for r in reporters:
        groups.setdefault(-1 if r.state is None else int(r.state["epoch"]), []).append(r)
    for group in groups.values():
        _train_array(group, context)


def _train_array(reporters: list[MemberReporter], context: TrackingContext) -> None:
    """One fused array of ``reporters``' cells (the same starting epoch), trained and finished."""
    import ray.tune

    from setvalued.fused import fit_array

    config = dict(reporters[0].cell["config"])
    epochs = ArrayEpochs(reporters, reporters[0].interval_s, reporters[0].last_epoch)
    states = [r.state for r in reporters]
    seeds = [int(r.cell["seed"]) for r in reporters]
    coordinator, done = reporters[0].coordinator, reporters[0].epochs_done
    try:
        if coordinator is not None and done and coordinator.decision(done) == "stop":
            # restarted after the config was stopped: the epochs cut to those done, nothing
            # trains, every member tests the checkpoint it selected (run_cell does the same)
            epochs.stopped_at = done
            results = fit_array({**config, "epochs": done}, seeds, checkpoints=states)
        else:
            results = fit_array(
                config,
                seeds,
                on_epoch=epochs.on_member,
                checkpoints=None if states[0] is None else states,
                after_epoch=epochs.after_epoch,
            )
    except Exception as error:
        message = one_paragraph(error)
        repeat = any(
            will_repeat(error, message, r.earlier_error, r.epochs_done, r.state, deterministic_errors())
            for r in reporters
        )
        for r in reporters:
            if repeat:
                flush_for_the_record(r)
                if r.coordinator is not None:
                    r.coordinator.tell_gone()
            record_failure(r.run, message)
        if not repeat:
            raise  # Tune retries the trial from its last checkpoint
        for r in reporters:
            ray.tune.report({**cell_ids(r.cell, r.run), "cell_status": "failed", "error": message})
        return
    for r, result in zip(reporters, results):
        if isinstance(result, BaseException):  # this member alone failed (a non-finite loss)
            message = one_paragraph(result)
            if r.coordinator is not None and reporters.index(r) not in epochs.gone:
                r.coordinator.tell_gone()
            flush_for_the_record(r)
            record_failure(r.run, message)
            ray.tune.report({**cell_ids(r.cell, r.run), "cell_status": "failed", "error": message})
            continue
        if epochs.stopped_at is not None:
            tags = {TAG_STOPPED_EPOCH: str(epochs.stopped_at)}
            if r.coordinator is not None and r.coordinator.prunes:
                tags[TAG_PRUNED] = r.coordinator.prunes
            r.run.set_tags(tags)
        if r.cell.get("log_model") and result.get("model") is not None:
            log_model_of(r.run, result)
        r.run.finish(
            result, final_step=r.final_step(), pending=r.take_pending(), clear_error=r.earlier_error is not None
        )


def _starting_points(cells: Sequence[Mapping[str, Any]]) -> list[tuple[Any, dict]]:
    """Each member's (fit state, meta): its folder in the array's Tune checkpoint (a restarted
    trial), else the checkpoint an earlier session left for the cell, else (None, {})."""
    import ray.tune

    checkpoint = ray.tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            held = {
                cell["cell_id"]: read_checkpoint(Path(folder) / cell["cell_id"])
                for cell in cells
                if (Path(folder) / cell["cell_id"]).is_dir()
            }
    else:
        held = {}
    points = []
    for cell in cells:
        if cell["cell_id"] in held:
            points.append(held[cell["cell_id"]])
        elif cell.get("resume_from"):
            points.append(read_resume_checkpoint(cell["resume_from"]))
        else:
            points.append((None, {}))
    return points
