"""The Tune function trainable that trains one study cell (a config and a seed).

`run_cell` is what every Tune trial runs, in a Ray worker:

1. it reads its cell from its trial's config (``{"cell_id", "cell"}``: the payload the
   searcher handed out; what all trials share comes with `tune.with_parameters`);
2. its starting point (`studies.running.checkpoints`): when Tune restarts the trial after its worker
   died (`FailureConfig(max_failures)`), `ray.tune.get_checkpoint()`, and training resumes
   after the last checkpointed epoch, in the same MLflow run; a cell left unfinished by a
   driver that was killed resumes the same way from the checkpoint its earlier Tune trial
   left (the cell's `resume_from`, found by `studies.running.checkpoints.find_resume_checkpoints`);
3. it calls `setvalued.train.fit(config, seed, on_epoch=..., checkpoint=...)`; after every
   epoch it reports the metrics to Tune; at most every `checkpoint_interval_s` seconds (a
   study field) and after the last epoch, the report carries a checkpoint
   (`ray.tune.report(metrics, checkpoint=ray.tune.Checkpoint.from_directory(d))`) and the
   epochs since the last one are logged to MLflow in one `log_batch` call (after the
   checkpoint, so that MLflow never holds an epoch that a restarted trial would train and
   log again);
4. at the end it logs the per-class Parquet artifact, then the epochs not logged yet, the
   test metrics and `studies.status=finished` in one request.

A `NonFiniteLossError` (NaN/inf loss) is deterministic: the cell is marked failed with its
error and the trial ends without a Tune retry. Any other exception marks the cell failed and
is re-raised, so that Tune retries it (up to `max_failures`) from its last checkpoint.

Early stopping and pruning (`scheduler: {kind: early_stopping | asha}`, an optuna block's
`pruner`) are decided per config over its seeds by the coordinator actor
(`studies.scheduling`): at the rule's decision epochs, each seed waits until all
seeds of its config have reported that epoch, and all seeds of a stopped config stop at the
same epoch (tagged `studies.stopped_epoch`, and `studies.pruned` when the rule prunes). A stopped
seed is finalised by calling `fit`
again from its last checkpoint with `epochs` cut to the epochs done: no epoch is left to
train, and `fit` evaluates the checkpoint selected on validation on the test set, as for a
complete run.
"""

from __future__ import annotations

import copy
import errno
import math
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from analysis.layout import TAG_PLUGINS, plugins_tag
from studies.errors import RunnerError
from studies.running.checkpoints import read_checkpoint, read_meta, read_tune_checkpoint, save_checkpoint
from studies.scheduling.coordinator import CoordinatorClient
from studies.tracking import (
    EPOCH_MARKER_METRIC,
    STATUS_FINISHED,
    TAG_NODE_ID,
    TAG_PRUNED,
    TAG_RESUMED_FROM,
    TAG_STATUS,
    TAG_STOPPED_EPOCH,
    CellRun,
    TrackingContext,
    with_retry,
)

FitFunction = Callable[..., Mapping[str, Any]]


class StopTraining(Exception):
    """Raised from `on_epoch` to leave `fit` when the cell's config was early-stopped."""


def default_fit() -> FitFunction:
    from setvalued.training import fit

    return fit


def deterministic_errors() -> tuple[type[BaseException], ...]:
    try:
        from setvalued.training import NonFiniteLossError
    except ImportError:  # the training core is optional for custom fit functions
        return ()
    return (NonFiniteLossError,)


def one_paragraph(error: BaseException, limit: int = 2000) -> str:
    """`Type: message` on one line (whitespace collapsed), cut to `limit` characters."""
    text = f"{type(error).__name__}: {error}"
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics that are numbers (bools and non-numbers dropped), as floats."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool):
            continue
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError):
            continue
    return out


def set_torch_threads() -> None:
    """One intra-op thread per CPU that Ray gave this trial (fractions round up to 1)."""
    try:
        import ray
        import torch

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        torch.set_num_threads(max(1, int(math.ceil(cpus))))
    except Exception:  # noqa: BLE001 (outside Ray (plain calls in tests and the benchmark))
        pass


def cell_ids(cell: Mapping[str, Any], run: CellRun) -> dict[str, Any]:
    """What every Tune report of the cell carries to the driver."""
    return {"cell_id": cell["cell_id"], "config_id": cell["config_id"], "run_id": run.run_id}


def plugin_tags(cell: Mapping[str, Any]) -> dict[str, str]:
    """The `studies.plugins` tag of a cell whose config names a plugin: the distributions and
    versions this worker registered (what trains the cell), none for built-ins only."""
    from setvalued.registry import plugin_distributions

    used = plugin_distributions([cell["config"]])
    return {TAG_PLUGINS: plugins_tag(used)} if used else {}


def run_cell(
    tune_config: Mapping[str, Any],
    *,
    context: TrackingContext,
    fit_fn: FitFunction | None = None,
    early_stopping: Mapping[str, Any] | None = None,
) -> None:
    """Train the cell `tune_config["cell"]` (its payload, `cell_payload`) with checkpoints and
    MLflow logging.

    `early_stopping`: None, or {"actor": name of the coordinator actor, "metric": metric
    key, "prunes": the `studies.pruned` tag of a stopped cell or None}; see the module
    docstring.
    """
    import ray
    import ray.tune

    cell = tune_config["cell"]
    fit = fit_fn or default_fit()
    deterministic = deterministic_errors()
    set_torch_threads()

    state, meta = _starting_point(cell)
    start = start_report(cell, state, meta)
    if meta.get("discard_run_id"):  # its checkpoint was unreadable: a new run replaces it
        discard_run(context, meta["discard_run_id"])
    # the node tag shows in MLflow where this attempt runs (which node trained or retried it)
    run, reused = CellRun.open(
        context,
        cell,
        run_id=meta.get("run_id"),
        tags={TAG_NODE_ID: ray.get_runtime_context().get_node_id(), **plugin_tags(cell)},
    )
    if reused and already_finished(run):
        return  # finished before the worker died; Tune only missed the end
    history: list[list] = meta.get("history", [])  # [[epoch, metrics], ...] in order
    logged_through = log_missing_epochs(run, history, reused, resumed=state is not None)
    coordinator = CoordinatorClient.connect(early_stopping, cell)
    reporter = EpochReporter(run, cell, context, history, logged_through, coordinator, state, start)
    earlier_error = run.recorded_error() if reused else None
    try:
        result = _train(fit, cell, reporter)
        if cell.get("log_model") and result.get("model") is not None:
            log_model_of(run, result)
        run.finish(
            result,
            final_step=reporter.final_step(),
            pending=reporter.take_pending(),
            clear_error=earlier_error is not None,
        )
        # no final Tune report: the trial's end tells the driver (one round trip less)
    except Exception as error:
        message = one_paragraph(error)
        folders = written_folders(context)
        disk_full = full_disk(error, folders)
        if disk_full:  # the message says which disk: the folders written and their free space
            message = full_disk_message(error, folders)
        if not (disk_full or will_repeat(error, message, earlier_error, reporter.epochs_done, state, deterministic)):
            # the epochs after the last checkpoint are trained and logged again by the retry
            record_failure(run, message)
            raise  # Tune retries the trial from its last checkpoint (FailureConfig)
        flush_for_the_record(reporter)
        record_failure(run, message)
        if coordinator is not None:
            coordinator.tell_gone()
        ray.tune.report({**cell_ids(cell, run), "cell_status": "failed", "error": message})


def log_model_of(run: CellRun, result: Mapping[str, Any]) -> None:
    """The selected model in MLflow; a model that cannot be saved costs the cell nothing else."""
    try:
        run.log_model(result["model"], result["input_example"], step=int(result.get("best_epoch") or 0))
    except Exception as error:  # noqa: BLE001  (the metrics matter more than the model file)
        print(f"[studies] the model of run {run.run_id} was not logged ({one_paragraph(error)})", flush=True)


def will_repeat(
    error: Exception, message: str, earlier_error: str | None, epochs_done: int, state: Any, deterministic: tuple
) -> bool:
    """Whether a retry would fail the same way, so the cell fails now instead: a known
    deterministic error (a non-finite loss), an OSError (a full disk, a missing file), an
    error raised before the first epoch of a fresh start (a bad config or data), or the same
    error as the attempt before."""
    return (
        isinstance(error, deterministic)
        or isinstance(error, OSError)
        or (epochs_done == 0 and state is None)
        or message == earlier_error
    )


#: how a full disk reads through the libraries that write here: errno 28, torch.save's
#: writer (a RuntimeError), SQLite, a quota
_FULL_DISK_SIGNS = ("no space left on device", "file write failed", "database or disk is full", "disk quota exceeded")


#: a folder with less free space than this is full (torch.save on a full disk says only
#: "enforce fail at inline_container.cc ... unexpected pos", so the words are not enough)
FULL_DISK_FREE_BYTES = 1 << 20


def full_disk(error: BaseException, folders: Iterable[str | Path] = ()) -> bool:
    """Whether `error` is a full disk (or quota): it says so, or one of the `folders` the
    trial writes to has less than FULL_DISK_FREE_BYTES free. It will repeat: the cell fails."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error).lower()
    if any(sign in text for sign in _FULL_DISK_SIGNS):
        return True
    for folder in folders:
        try:
            if shutil.disk_usage(folder).free < FULL_DISK_FREE_BYTES:
                return True
        except OSError:
            continue
    return False


def full_disk_message(error: BaseException, folders: Iterable[str | Path]) -> str:
    """The cell's error for a full disk: the library's words, and each folder the trial
    writes to with its free space (the full one reads about 0 MiB)."""
    places = []
    for folder in dict.fromkeys(str(f) for f in folders):
        try:
            usage = shutil.disk_usage(folder)
        except OSError:
            continue
        places.append(f"{folder} ({usage.free / 2**20:,.1f} MiB free of {usage.total / 2**30:,.1f} GiB)")
    return (
        f"the disk is full: {one_paragraph(error, 500)}; this trial writes to "
        f"{'; '.join(places) or 'no folder it can see'}; free space there (or pass --storage)"
    )


def written_folders(context: TrackingContext) -> list[str]:
    """Where a trial writes: checkpoints staged in the temporary folder, then Tune's trial
    folder; a local SQLite store's folder."""
    folders = [tempfile.gettempdir()]
    try:
        import ray.tune

        folders.append(ray.tune.get_context().get_trial_dir())
    except Exception:  # noqa: BLE001  (outside a trial, or an older Ray)
        pass
    if context.tracking_uri.startswith("sqlite:///"):
        folders.append(str(Path(context.tracking_uri[len("sqlite:///") :]).parent))
    return [f for f in folders if f]


def flush_for_the_record(reporter: EpochReporter) -> None:
    """The epochs of a cell that fails for good that are not logged yet: its curves up to the
    failure stay visible in MLflow (best effort: the failure itself matters more)."""
    try:
        reporter.flush()
    except Exception as error:  # noqa: BLE001
        print(
            f"[studies] could not log the last epochs of run {reporter.run.run_id} ({one_paragraph(error)})", flush=True
        )


def record_failure(run: CellRun, message: str) -> None:
    """The run ends FAILED with its error; if even that cannot be written (the store is full),
    the driver marks it when the study ends (StudyTracking.fail_unfinished)."""
    try:
        run.fail(message)
    except Exception as error:  # noqa: BLE001  (the cell's own error is what matters)
        print(f"[studies] could not record the failure of run {run.run_id} ({one_paragraph(error)})", flush=True)


def _starting_point(cell: Mapping[str, Any]) -> tuple[Any, dict]:
    """(fit state, checkpoint meta) to start from: Tune's checkpoint of this trial (restarted
    after its worker died), else the one an earlier session left for the cell, else
    (None, {}): from scratch."""
    import ray.tune

    checkpoint = ray.tune.get_checkpoint()
    if checkpoint is not None:
        return read_tune_checkpoint(checkpoint)
    if cell.get("resume_from"):
        return read_resume_checkpoint(cell["resume_from"])
    return None, {}


def read_resume_checkpoint(folder: str) -> tuple[Any, dict]:
    """(fit state, meta) of an earlier session's checkpoint. When it cannot be read (a driver
    killed while Tune was writing it, or a file that holds more than tensors and numbers and
    is refused unread), the cell starts from scratch in a new run: the meta then only names
    the earlier run to discard (``discard_run_id``), whose epochs a fresh start cannot reuse."""
    try:
        return read_checkpoint(folder)
    except Exception as error:  # noqa: BLE001 (any unreadable checkpoint: the cell starts from scratch)
        reason = one_paragraph(error, 300)
        print(
            f"[studies] cannot read the checkpoint {folder} safely ({reason}); the cell starts from scratch", flush=True
        )
        try:
            earlier = read_meta(folder).get("run_id")
        except (OSError, ValueError, RunnerError):
            earlier = None
        return None, {"discard_run_id": earlier, "unloadable": reason} if earlier else {"unloadable": reason}


#: the keys of a trial's first Tune report that say where it started (strings: Tune keeps
#: statistics of every numeric key of every trial; the driver reads these once)
RESUMED_FROM_KEY = "resumed_from"
RESTARTED_KEY = "restarted"


def start_report(cell: Mapping[str, Any], state: Any, meta: Mapping[str, Any]) -> dict[str, str]:
    """What the trial's first Tune report adds about its start, so that the driver's console
    says what happened: {RESUMED_FROM_KEY: the epoch (0-indexed) training resumes at} after a
    checkpoint loaded, {RESTARTED_KEY: why} when the checkpoint an earlier session left could
    not be loaded (training restarts at epoch 0), {} for a fresh start."""
    if state is not None:
        epoch = meta.get("epoch")
        return {RESUMED_FROM_KEY: str(epoch + 1 if isinstance(epoch, int) else len(meta.get("history") or []))}
    if cell.get("resume_from"):
        return {RESTARTED_KEY: str(meta.get("unloadable") or "its checkpoint could not be read")}
    return {}


def discard_run(context: TrackingContext, run_id: str) -> None:
    """Delete (MLflow's soft delete) an earlier session's run of the cell."""
    from mlflow.tracking import MlflowClient

    try:
        with_retry(lambda: MlflowClient(context.tracking_uri).delete_run(run_id))
    except Exception as error:  # noqa: BLE001 (already gone)
        print(f"[studies] could not delete the earlier run {run_id} ({one_paragraph(error)})", flush=True)


def already_finished(run: CellRun) -> bool:
    """Whether the cell's run is tagged finished (a trial restarted after its worker died
    may have finished everything but the last Tune report)."""
    tags = with_retry(lambda: run.client.get_run(run.run_id)).data.tags
    return tags.get(TAG_STATUS) == STATUS_FINISHED


def log_missing_epochs(run: CellRun, history: list[list], reused: bool, resumed: bool) -> int | None:
    """Log the checkpoint's epochs that the run misses (a worker that died between its
    checkpoint and its MLflow log); returns the last epoch the run holds, if any."""
    logged_through = run.last_logged_epoch() if reused else None
    missing = [(epoch, metrics) for epoch, metrics in history if logged_through is None or epoch > logged_through]
    if missing:  # in one request (a minute of short epochs may be missing)
        run.log_epochs(missing)
        logged_through = missing[-1][0]
    if resumed and history:
        run.set_tags({TAG_RESUMED_FROM: str(history[-1][0])})
    return logged_through


class EpochReporter:
    """`fit`'s `on_epoch` for one cell.

    After every epoch: a Tune report (progress and the driver's view), then early
    stopping's decision. At most every `checkpoint_interval_s` seconds, and always after the
    config's last epoch, the report carries a checkpoint, and the epochs not yet in MLflow
    follow in one request: after the checkpoint, so that MLflow never holds an epoch that a
    restarted trial would train and log again. A cell of many short epochs thus costs one
    checkpoint and one tracking request a minute, not one per epoch; a worker that dies
    loses at most that much training. The epochs after the last checkpoint of the last epoch
    go with the run's final request (a worker that dies in between leaves them in that
    checkpoint's history, which its restart logs first).
    """

    def __init__(
        self,
        run: CellRun,
        cell: Mapping[str, Any],
        context: TrackingContext,
        history: list[list],
        logged_through: int | None,
        coordinator: CoordinatorClient | None,
        state: Any,
        start: Mapping[str, str] | None = None,
    ):
        self.run = run
        self.start = dict(start or {})  # added to the first Tune report only (start_report)
        self.cell = cell
        self.context = context
        self.history = history  # [[epoch, metrics], ...], the checkpoint's then this run's
        self.logged_through = logged_through
        self.coordinator = coordinator
        self.state = state  # the latest fit state: the starting point's, then each epoch's
        self.interval_s = float(cell.get("checkpoint_interval_s") or 0.0)
        self.last_epoch = int(cell["config"].get("epochs", 1)) - 1
        self.pending: list[tuple[int, dict[str, float]]] = []  # epochs not yet in MLflow
        self.last_time = time.perf_counter()
        self.last_checkpoint = self.last_time

    @property
    def epochs_done(self) -> int:
        return len(self.history)

    def final_step(self) -> int:
        return int(self.history[-1][0]) if self.history else 0

    def record(self, epoch: int, metrics: Mapping[str, Any], state: Any) -> dict[str, float]:
        """The epoch in the history, its state kept, its metrics pending for MLflow unless an
        earlier attempt logged them; its values returned."""
        values = self._epoch_values(metrics)
        self.history.append([epoch, values])
        self.state = state
        if self.logged_through is None or epoch > self.logged_through:
            self.pending.append((epoch, values))
        return values

    def __call__(self, epoch: int, metrics: Mapping[str, Any], state: Any) -> None:
        epoch = int(epoch)
        values = self.record(epoch, metrics, state)
        if self._checkpoint_due(epoch):
            self._report(epoch, values, state)
            if epoch < self.last_epoch:  # after the last, the run's final request takes them
                self.flush()
        else:
            self._report(epoch, values, None)
        if self.coordinator is not None and self.coordinator.report_and_wait(self.epochs_done, values) == "stop":
            raise StopTraining()
        self.last_time = time.perf_counter()

    def _checkpoint_due(self, epoch: int) -> bool:
        return (
            self.interval_s <= 0
            or epoch >= self.last_epoch
            or time.perf_counter() - self.last_checkpoint >= self.interval_s
        )

    def flush(self) -> None:
        """Log the pending epochs in one request (they are all checkpointed or final)."""
        if self.pending:
            self.run.log_epochs(self.pending)
            self.logged_through = self.pending[-1][0]
            self.pending = []

    def take_pending(self) -> list[tuple[int, dict[str, float]]]:
        """The pending epochs, handed to the run's final request (and no longer pending)."""
        pending, self.pending = self.pending, []
        return pending

    def _epoch_values(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        """The epoch's numeric metrics, with the epoch marker (its wall time) when missing."""
        now = time.perf_counter()
        values = numeric_metrics(metrics)
        values.pop("epoch", None)  # the step of every metric already
        values.setdefault(EPOCH_MARKER_METRIC, now - self.last_time)
        return values

    def _report(self, epoch: int, values: dict[str, float], state: Any) -> None:
        """The epoch's Tune report; with a checkpoint of `state` unless it is None."""
        import ray.tune

        report = self.tune_report(epoch, values)
        if state is None:
            ray.tune.report(report)
            return
        with tempfile.TemporaryDirectory(prefix="studies-ckpt-") as folder:
            save_checkpoint(Path(folder), state, self.checkpoint_meta(epoch))
            ray.tune.report(report, checkpoint=ray.tune.Checkpoint.from_directory(folder))
        self.last_checkpoint = time.perf_counter()

    def tune_report(self, epoch: int, values: dict[str, float]) -> dict[str, Any]:
        """What the epoch's Tune report carries (the start's keys on the first one only)."""
        keys = self.cell.get("tune_metrics")  # MLflow has every metric; Tune, what the driver reads
        shown = values if keys is None else {k: values[k] for k in keys if k in values}
        report = {
            **shown,
            **cell_ids(self.cell, self.run),
            "epoch": epoch,
            "epochs_done": self.epochs_done,
            "cell_status": "running",
        }
        if self.start:
            report.update(self.start)
            self.start = {}
        return report

    def checkpoint_meta(self, epoch: int) -> dict[str, Any]:
        """The meta.json of the cell's checkpoint after `epoch` (`studies.running.checkpoints`)."""
        return {
            "run_id": self.run.run_id,
            "cell_id": self.cell["cell_id"],
            "study": self.context.study_name,
            "epoch": epoch,
            "history": self.history,
        }


def _train(fit: FitFunction, cell: Mapping[str, Any], reporter: EpochReporter) -> Mapping:
    """`fit`'s result: trained to the end, or, when the config was early-stopped, finalised
    at the epoch of the stop (see the module docstring)."""
    config = copy.deepcopy(dict(cell["config"]))
    seed = int(cell["seed"])
    coordinator = reporter.coordinator
    if coordinator is not None and reporter.epochs_done and coordinator.decision(reporter.epochs_done) == "stop":
        stopped_at = reporter.epochs_done  # restarted after the config was stopped
    else:
        try:
            return fit(config, seed, on_epoch=reporter, checkpoint=reporter.state)
        except StopTraining:
            stopped_at = reporter.epochs_done
    tags = {TAG_STOPPED_EPOCH: str(stopped_at)}
    if coordinator is not None and coordinator.prunes:  # a stop comes from a coordinator
        tags[TAG_PRUNED] = coordinator.prunes
    reporter.run.set_tags(tags)
    # epochs cut to those done: fit resumes after the last one, trains nothing more and
    # evaluates the checkpoint it selected on validation
    truncated = copy.deepcopy(config)
    truncated["epochs"] = stopped_at
    return fit(truncated, seed, on_epoch=None, checkpoint=with_epochs(reporter.state, stopped_at))


def with_epochs(state: Any, epochs: int) -> Any:
    """The fit state with its recorded config's `epochs` set to `epochs`.

    `setvalued.train.fit` refuses a checkpoint whose config differs from the run's config;
    a stopped cell resumes with `epochs` cut to the epochs done, so the state's copy of the
    config gets the same cut (nothing else changes).
    """
    if isinstance(state, dict) and isinstance(state.get("config"), dict):
        state = dict(state)
        state["config"] = dict(state["config"], epochs=int(epochs))
    return state
