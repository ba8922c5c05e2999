"""The Tune function trainable that trains one study cell (a config and a seed).

`run_cell` is what every Tune trial runs, in a Ray worker:

1. it finds its cell (the trial's `param_space` holds only the opaque `cell_id`; the cells
   themselves travel once through the object store with `tune.with_parameters`);
2. `ray.tune.get_checkpoint()`: when Tune restarts the trial after its worker died
   (`FailureConfig(max_failures)`), training resumes after the last checkpointed epoch, in
   the same MLflow run; a cell left unfinished by a driver that was killed resumes the same
   way from the checkpoint its earlier Tune trial left (the cell's `resume_from`, found by
   `studies.runner.find_resume_checkpoints`);
3. it calls `setvalued.train.fit(config, seed, on_epoch=..., checkpoint=...)`; after every
   epoch it reports the metrics to Tune together with a checkpoint
   (`ray.tune.report(metrics, checkpoint=ray.tune.Checkpoint.from_directory(d))`), then logs
   the epoch's metrics to MLflow in one `log_batch` call (after the checkpoint, so that
   MLflow never holds an epoch that a restarted trial would train and log again);
4. at the end it logs the test metrics, the per-class Parquet artifact and
   `studies.status=finished`.

A `NonFiniteLossError` (NaN/inf loss) is deterministic: the cell is marked failed with its
error and the trial ends without a Tune retry. Any other exception marks the cell failed and
is re-raised, so that Tune retries it (up to `max_failures`) from its last checkpoint.

Early stopping (`scheduler: {kind: early_stopping}`) is decided per config over its seeds by
the `studies.runner.EarlyStoppingCoordinator` actor: after `grace_epochs`, each seed waits
at every epoch until all seeds of its config have reported that epoch, and all seeds of a
stopped config stop at the same epoch. A stopped seed is finalised by calling `fit` again
from its last checkpoint with `epochs` cut to the epochs done: no epoch is left to train,
and `fit` evaluates the checkpoint selected on validation on the test set, as for a complete
run.
"""

from __future__ import annotations

import copy
import json
import math
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from studies.tracking import (
    EPOCH_MARKER_METRIC,
    STATUS_FINISHED,
    TAG_NODE_ID,
    TAG_RESUMED_FROM,
    CellRun,
    TrackingContext,
    with_retry,
)

STATE_FILE = "state.pt"
META_FILE = "meta.json"
TAG_STOPPED_EPOCH = "studies.stopped_epoch"

FitFunction = Callable[..., Mapping[str, Any]]


class StopTraining(Exception):
    """Raised from `on_epoch` to leave `fit` when the cell's config was early-stopped."""


def default_fit() -> FitFunction:
    from setvalued.train import fit

    return fit


def _deterministic_errors() -> tuple[type[BaseException], ...]:
    try:
        from setvalued.train import NonFiniteLossError
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


def _set_torch_threads() -> None:
    """One intra-op thread per CPU that Ray gave this trial (fractions round up to 1)."""
    try:
        import ray
        import torch

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        torch.set_num_threads(max(1, int(math.ceil(cpus))))
    except Exception:  # outside Ray (plain calls in tests and the benchmark)
        pass


def _read_checkpoint_folder(folder: str | Path) -> tuple[Any, dict]:
    """(fit state, meta) of a checkpoint folder written by `_save_checkpoint`."""
    import torch

    meta = json.loads((Path(folder) / META_FILE).read_text())
    state = torch.load(Path(folder) / STATE_FILE, map_location="cpu", weights_only=False)
    return state, meta


def _load_checkpoint(checkpoint) -> tuple[Any, dict]:
    """(fit state, meta) of a Tune checkpoint written by `_save_checkpoint`."""
    with checkpoint.as_directory() as folder:
        return _read_checkpoint_folder(folder)


def _load_resume_checkpoint(folder: str) -> tuple[Any, dict]:
    """(fit state, meta) of an earlier session's checkpoint; (None, {}) when it cannot be
    read (a driver killed while Tune was writing it): the cell then starts from scratch."""
    try:
        return _read_checkpoint_folder(folder)
    except Exception as error:
        print(f"[studies] cannot read the checkpoint {folder} ({one_paragraph(error)}); "
              f"the cell starts from scratch", flush=True)
        return None, {}


def _save_checkpoint(folder: Path, state: Any, meta: dict) -> None:
    import torch

    torch.save(state, folder / STATE_FILE)
    (folder / META_FILE).write_text(json.dumps(meta))


def _early_stopping_actor(name: str | None):
    if not name:
        return None
    import ray

    return ray.get_actor(name)


def run_cell(
    tune_config: Mapping[str, Any],
    *,
    cells: Mapping[str, Mapping[str, Any]],
    context: TrackingContext,
    fit_fn: FitFunction | None = None,
    early_stopping: Mapping[str, Any] | None = None,
) -> None:
    """Train the cell `tune_config["cell_id"]` with checkpoints and MLflow logging.

    `early_stopping`: None, or {"actor": name of the coordinator actor, "metric": metric
    key}; see the module docstring.
    """
    import ray.tune

    cell = cells[tune_config["cell_id"]]
    fit = fit_fn or default_fit()
    deterministic = _deterministic_errors()
    _set_torch_threads()

    checkpoint = ray.tune.get_checkpoint()
    if checkpoint is not None:
        state, meta = _load_checkpoint(checkpoint)
    elif cell.get("resume_from"):
        state, meta = _load_resume_checkpoint(cell["resume_from"])
    else:
        state, meta = None, {}
    run, reused = CellRun.open(context, cell, run_id=meta.get("run_id"))
    # where this attempt runs: shows in MLflow which node trained (or retried) the cell
    run.set_tags({TAG_NODE_ID: ray.get_runtime_context().get_node_id()})
    base = {"cell_id": cell["cell_id"], "config_id": cell["config_id"]}

    # A trial restarted after its worker died: it may have finished everything but the
    # last Tune report; or MLflow may miss the epochs of the checkpoint (died in between).
    history: list[list] = meta.get("history", [])  # [[epoch, metrics], ...] in order
    if reused:
        current = with_retry(lambda: run.client.get_run(run.run_id)).data.tags
        if current.get("studies.status") == STATUS_FINISHED:
            return  # finished before the worker died; Tune only missed the end
        logged_through = run.last_logged_epoch()
    else:
        logged_through = None
    for epoch, metrics in history:
        if logged_through is None or epoch > logged_through:
            run.log_metrics(metrics, step=epoch)
            logged_through = epoch
    if state is not None and history:
        run.set_tags({TAG_RESUMED_FROM: str(history[-1][0])})

    coordinator = _early_stopping_actor((early_stopping or {}).get("actor"))
    stop_metric = (early_stopping or {}).get("metric")
    config = copy.deepcopy(dict(cell["config"]))
    seed = int(cell["seed"])
    last_time = time.perf_counter()
    holder: dict[str, Any] = {"state": state}

    def on_epoch(epoch: int, metrics: Mapping[str, Any], epoch_state: Any) -> None:
        nonlocal last_time, logged_through
        now = time.perf_counter()
        values = numeric_metrics(metrics)
        values.pop("epoch", None)  # the step of every metric already
        values.setdefault(EPOCH_MARKER_METRIC, now - last_time)
        history.append([int(epoch), values])
        holder["state"] = epoch_state
        with tempfile.TemporaryDirectory(prefix="studies-ckpt-") as folder:
            _save_checkpoint(Path(folder), epoch_state,
                             {"run_id": run.run_id, "cell_id": cell["cell_id"],
                              "study": context.study_name, "epoch": int(epoch),
                              "history": history})
            ray.tune.report(
                {**values, **base, "epoch": int(epoch), "epochs_done": len(history),
                 "cell_status": "running"},
                checkpoint=ray.tune.Checkpoint.from_directory(folder),
            )
        if logged_through is None or epoch > logged_through:
            run.log_metrics(values, step=int(epoch))
            logged_through = int(epoch)
        if coordinator is not None:
            value = values.get(stop_metric, math.nan)
            if _wait_for_decision(coordinator, cell, len(history), value) == "stop":
                raise StopTraining()
        last_time = time.perf_counter()

    try:
        stopped_at = None
        if coordinator is not None and history and _decision(
                coordinator, cell, len(history)) == "stop":
            stopped_at = len(history)  # restarted after the config was stopped
        else:
            try:
                result = fit(config, seed, on_epoch=on_epoch, checkpoint=state)
            except StopTraining:
                stopped_at = len(history)
        if stopped_at is not None:
            # epochs cut to those done: fit resumes after the last one, trains nothing more
            # and evaluates the checkpoint it selected on validation (see module docstring)
            run.set_tags({TAG_STOPPED_EPOCH: str(stopped_at)})
            truncated = copy.deepcopy(config)
            truncated["epochs"] = stopped_at
            result = fit(truncated, seed, on_epoch=None,
                         checkpoint=_with_epochs(holder["state"], stopped_at))
        final_step = int(history[-1][0]) if history else 0
        run.finish(result, final_step=final_step)
        # no final Tune report: the trial's end tells the driver (one round trip less)
    except deterministic as error:
        message = one_paragraph(error)
        run.fail(message)
        _tell_gone(coordinator, cell)
        ray.tune.report({**base, "cell_status": "failed", "error": message})
    except Exception as error:
        run.fail(one_paragraph(error))
        raise


def _with_epochs(state: Any, epochs: int) -> Any:
    """The fit state with its recorded config's `epochs` set to `epochs`.

    `setvalued.train.fit` refuses a checkpoint whose config differs from the run's config;
    a stopped cell resumes with `epochs` cut to the epochs done, so the state's copy of the
    config gets the same cut (nothing else changes).
    """
    if isinstance(state, dict) and isinstance(state.get("config"), dict):
        state = dict(state)
        state["config"] = dict(state["config"], epochs=int(epochs))
    return state


def _decision(coordinator, cell: Mapping[str, Any], epochs_done: int) -> str:
    import ray

    return ray.get(coordinator.status.remote(cell["config_id"], int(cell["seed"]),
                                             epochs_done))


def _wait_for_decision(coordinator, cell: Mapping[str, Any], epochs_done: int,
                       value: float, poll_s: float = 0.2) -> str:
    """Record this seed's value and block until its config's decision at this epoch."""
    import ray

    status = ray.get(coordinator.record.remote(cell["config_id"], int(cell["seed"]),
                                               epochs_done, float(value)))
    while status == "wait":
        time.sleep(poll_s)
        status = _decision(coordinator, cell, epochs_done)
    return status


def _tell_gone(coordinator, cell: Mapping[str, Any]) -> None:
    if coordinator is None:
        return
    import ray

    ray.get(coordinator.mark_gone.remote(cell["config_id"], int(cell["seed"])))
