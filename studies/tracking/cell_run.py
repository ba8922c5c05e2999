"""The worker side: `CellRun`, the child run of one cell, written from its Tune trial."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis.layout import (
    PER_CLASS_ARTIFACT,
    SET_SIZES_ARTIFACT,
    STATUS_FAILED,
    STATUS_FINISHED,
    STATUS_RUNNING,
    TAG_CELL_ID,
    TAG_ERROR,
    TAG_SESSION,
    TAG_STATUS,
    tag_filter,
)
from studies.tracking.contract import (
    EPOCH_MARKER_METRIC,
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_LENGTH,
    MODEL_ARTIFACT,
    as_float,
    cell_tags,
    config_params,
    in_chunks,
    search_all,
    tracking_client,
)
from studies.tracking.provenance import CellProvenance, environment_tags
from studies.tracking.retry import with_retry


@dataclass(frozen=True)
class TrackingContext:
    """What a worker needs to log a cell (small and picklable; sent with every trial)."""

    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    study_name: str
    session_id: str
    #: MLflow's system tags of every run (user, source, git), set by the driver
    run_tags: tuple[tuple[str, str], ...] = ()
    #: the version of the study this session runs (`studies.running.versions`)
    version: str = ""
    #: the driver's data fingerprints, (data key, JSON) pairs (`studies.tracking.provenance`)
    data: tuple[tuple[str, str], ...] = ()


class CellRun:
    """The child run of one cell, written from the Tune worker."""

    def __init__(self, context: TrackingContext, run_id: str, client=None):
        self.context = context
        self.run_id = run_id
        self.client = client or tracking_client(context.tracking_uri)

    @classmethod
    def open(
        cls,
        context: TrackingContext,
        cell: Mapping[str, Any],
        run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> tuple[CellRun, bool]:
        """The cell's run: `run_id` if given, else the run this driver session already made
        for the cell (a trial restarted after its worker died), else a new one; `tags` are
        set on it in the same request.

        Returns (run, reused). A new run gets the contract tags with its creation and the
        params in one batched call.
        """
        client = tracking_client(context.tracking_uri)
        if run_id is None:
            existing = search_all(
                client,
                context.experiment_id,
                tag_filter({TAG_CELL_ID: cell["cell_id"], TAG_SESSION: context.session_id}),
            )
            if existing:
                run_id = existing[-1].info.run_id
        if run_id is not None:
            run = cls(context, run_id, client)
            with_retry(lambda: client.update_run(run_id, status="RUNNING"))
            run.set_tags({TAG_STATUS: STATUS_RUNNING, **dict(tags or {})})
            return run, True
        provenance = CellProvenance.of(cell, context.data)  # what trains it: code, plugins, data
        all_tags = {
            **dict(context.run_tags),
            **cell_tags(cell, context.study_name, context.parent_run_id, context.session_id, context.version),
            **provenance.tags,
            **dict(tags or {}),
        }
        created = with_retry(
            lambda: client.create_run(
                context.experiment_id,
                tags=all_tags,
                run_name=cell.get("run_name") or f"{cell.get('variant') or 'cell'}-{cell['cell_id']}",
            )
        )
        run = cls(context, created.info.run_id, client)
        params = config_params(cell["config"])
        params["seed"] = str(cell["seed"])
        run.log_params(params)
        provenance.log_data_input(client, run.run_id)
        return run, False

    # -- writes (every one retried while SQLite is locked)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)[:MAX_TAG_LENGTH]) for k, v in tags.items()]
        for chunk in in_chunks(items, MAX_PARAMS_TAGS_PER_BATCH):
            with_retry(lambda: self.client.log_batch(self.run_id, tags=list(chunk), synchronous=True))

    def log_params(self, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in sorted(params.items())]
        for chunk in in_chunks(items, MAX_PARAMS_TAGS_PER_BATCH):
            with_retry(lambda: self.client.log_batch(self.run_id, params=list(chunk), synchronous=True))

    def log_metrics(self, metrics: Mapping[str, Any], step: int, tags: Mapping[str, str] | None = None) -> None:
        """All `metrics` at `step` (and optional tags) in one `log_batch` request."""
        self.log_epochs([(step, metrics)], tags=tags)

    def log_epochs(
        self, epochs: Sequence[tuple[int, Mapping[str, Any]]], tags: Mapping[str, str] | None = None
    ) -> None:
        """The metrics of several steps, each at its step, and optional tags, in as few
        `log_batch` requests as MLflow's limits allow (one for up to 1,000 values); the tags
        go with the last request, so a status tag is never written before the metrics.

        Values that are not numbers are skipped; NaN/inf are logged as they are (MLflow keeps
        them), so that a diverging run is visible.
        """
        from mlflow.entities import Metric, RunTag

        timestamp = int(time.time() * 1000)
        items = []
        for step, metrics in epochs:
            for key, value in metrics.items():
                number = as_float(value)
                if number is None or isinstance(value, bool):
                    continue
                items.append(Metric(key, number, timestamp, int(step)))
        tag_items = [RunTag(k, str(v)[:MAX_TAG_LENGTH]) for k, v in (tags or {}).items()]
        chunks = list(in_chunks(items, MAX_METRICS_PER_BATCH)) or [[]]
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            with_tags = tag_items if last and len(tag_items) <= MAX_PARAMS_TAGS_PER_BATCH else []
            if chunk or with_tags:
                with_retry(
                    lambda: self.client.log_batch(self.run_id, metrics=list(chunk), tags=with_tags, synchronous=True)
                )
        if tag_items and len(tag_items) > MAX_PARAMS_TAGS_PER_BATCH:
            self.set_tags(dict(tags or {}))

    def last_logged_epoch(self) -> int | None:
        """The largest step of the epoch marker metric already in the run (None if none)."""
        history = with_retry(lambda: self.client.get_metric_history(self.run_id, EPOCH_MARKER_METRIC))
        return max((m.step for m in history), default=None)

    def finish(
        self,
        result: Mapping[str, Any],
        final_step: int,
        pending: Sequence[tuple[int, Mapping[str, Any]]] = (),
        clear_error: bool = False,
    ) -> None:
        """Log the outcome of `fit`: the per-class Parquet artifact, then the epochs not yet
        logged (`pending`), the test metrics, best epoch/value and `studies.status=finished`
        in one request (the status last, so a crash never marks it done). `clear_error`: an
        earlier attempt recorded a (transient) error; a finished run no longer carries it."""
        if clear_error:
            with_retry(lambda: self.client.delete_tag(self.run_id, TAG_ERROR))
        per_class = result.get("per_class")
        if per_class:
            self.log_table_artifact(per_class, PER_CLASS_ARTIFACT)
        if result.get("set_sizes"):
            self.log_table_artifact(result["set_sizes"], SET_SIZES_ARTIFACT)
        final: dict[str, Any] = {f"test/{k}": v for k, v in (result.get("test") or {}).items()}
        if result.get("best_epoch") is not None:
            final["best_epoch"] = result["best_epoch"]
        if result.get("best_val") is not None:
            final["best_val"] = result["best_val"]
        # the final metrics and the status in one request: a cell is never marked finished
        # without its test metrics
        tags = {**environment_tags(result.get("device")), TAG_STATUS: STATUS_FINISHED}  # where it trained
        self.log_epochs([*pending, (final_step, final)], tags=tags)
        with_retry(lambda: self.client.set_terminated(self.run_id, status="FINISHED"))

    def log_model(self, model: Any, input_example: Any, step: int = 0) -> str:
        """The selected checkpoint as an MLflow 3 Logged Model named ``model``, made by this
        run (its source run, and an output of the run at `step`): listed in the experiment's
        Models tab and on the run's page, and loadable with
        ``mlflow.pytorch.load_model("runs:/<run_id>/model")`` (MLflow resolves the name to
        the run's logged model) or ``models:/<model_id>``. MLflow's pytorch flavour with its
        input example and signature, in PyTorch's exported-program format (no pickle of the
        module). Returns the model's id."""
        import mlflow.pytorch
        import torch
        from mlflow.entities import LoggedModelOutput, LoggedModelStatus

        model = model.cpu().eval()
        version = torch.__version__.split("+")[0]
        client = self.client
        logged = with_retry(
            lambda: client.create_logged_model(
                self.context.experiment_id, name=MODEL_ARTIFACT, source_run_id=self.run_id, model_type="pytorch"
            )
        )
        model_id = logged.model_id
        try:
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / MODEL_ARTIFACT
                mlflow.pytorch.save_model(
                    model, str(path), input_example=input_example.cpu().numpy(), pip_requirements=[f"torch=={version}"]
                )
                with_retry(lambda: client.log_model_artifacts(model_id, str(path)))
        except BaseException:
            with_retry(lambda: client.finalize_logged_model(model_id, LoggedModelStatus.FAILED))
            raise
        with_retry(lambda: client.finalize_logged_model(model_id, LoggedModelStatus.READY))
        with_retry(lambda: client.log_outputs(self.run_id, [LoggedModelOutput(model_id, step)]))
        return model_id

    def recorded_error(self) -> str | None:
        """The error an earlier attempt of this run recorded (``studies.error``), if any."""
        return with_retry(lambda: self.client.get_run(self.run_id)).data.tags.get(TAG_ERROR)

    def fail(self, error: str) -> None:
        """Mark the cell failed with its error (one paragraph); the run ends FAILED."""
        self.set_tags({TAG_STATUS: STATUS_FAILED, TAG_ERROR: error})
        with_retry(lambda: self.client.set_terminated(self.run_id, status="FAILED"))

    def log_table_artifact(self, columns: Mapping[str, Sequence[Any]], name: str) -> None:
        """Write the columns as the Parquet artifact `name` of the run."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({key: list(values) for key, values in columns.items()})
        with tempfile.TemporaryDirectory(prefix="studies-artifact-") as folder:
            path = Path(folder) / name
            pq.write_table(table, path)
            with_retry(lambda: self.client.log_artifact(self.run_id, str(path)))
