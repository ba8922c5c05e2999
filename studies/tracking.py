"""MLflow tracking of a study: one experiment, one parent run, one child run per cell.

The layout is the contract of docs/interfaces.md section 5 (read back by `analysis.collect`):

- experiment = the study's `name`;
- parent run: tags `studies.role=parent`, `studies.study=<name>`, artifact `study.yaml`;
  created once per study and found again by its tags when the study is run again;
- child run per cell: tags `mlflow.parentRunId`, `studies.role=cell`, `studies.study`,
  `studies.config_id`, `studies.seed`, `studies.cell_id`, `studies.variant`, `studies.swept`
  (JSON), `studies.status` (running | finished | failed), `studies.error` when failed;
  params = the flattened config (dotted keys) and `seed`; metrics per epoch (`step=epoch`),
  then `test/...`, `best_epoch`, `best_val`; artifact `per_class_test.parquet` (and
  `set_sizes_test.parquet` with average-K metrics).

Two sides:

- `StudyTracking` runs on the driver. It creates the experiment and the parent run before
  any trial starts (so that workers never race on creating them, nor on the schema migration
  of a fresh SQLite file), and keeps the study idempotent: a cell whose run is tagged
  `finished` is done; the other runs of a cell that is about to run (left `running` or
  `failed` by an earlier driver) are deleted (MLflow soft delete: they leave the default,
  active-only view that `analysis.collect` and the UI use) so that a cell ends with exactly
  one active run. A half-written run is not reused across driver sessions because MLflow
  cannot drop the metrics it already holds, and a fresh trial re-logs every epoch.
- `CellRun` runs in the Tune worker. It creates the cell's child run, or reuses the one of
  the same driver session (tag `studies.session`) when Tune restarts the trial from its
  checkpoint after the worker died, and logs every epoch's metrics in ONE
  `MlflowClient.log_batch` call (not `MLflowLoggerCallback`, which sends one HTTP request per
  metric key from the driver: ray/air/_internal/mlflow.py; 1000 `log_metric` calls took 90 s
  against 4 s batched in mlflow#5269). Each epoch is logged
  exactly once: a restarted trial logs only the epochs after the last step already in MLflow.

Two extra tags beyond the contract, for diagnosis: `studies.session` (the driver session
that ran the cell) and `studies.resumed_from_epoch` (set when a trial restarted from a
checkpoint).

SQLite with parallel writers can answer "database is locked"; every write here is retried
with a backoff (`with_retry`).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, TypeVar

if TYPE_CHECKING:
    from analysis.collect import RunRecord

from analysis.layout import (  # noqa: E402  the MLflow layout, shared with analysis.collect
    flatten_config,
    PARENT_RUN_TAG,
    PER_CLASS_ARTIFACT,
    SET_SIZES_ARTIFACT,
    ROLE_CELL,
    ROLE_PARENT,
    STATUS_FAILED,
    STATUS_FINISHED,
    STATUS_RUNNING,
    STUDY_ARTIFACT,
    TAG_CELL_ID,
    TAG_CONFIG_ID,
    TAG_ERROR,
    TAG_NODE_ID,
    TAG_PRUNED,
    TAG_RESUMED_FROM,
    TAG_ROLE,
    TAG_SEED,
    TAG_SESSION,
    TAG_STATUS,
    TAG_STOPPED_EPOCH,
    TAG_STUDY,
    TAG_SWEPT,
    TAG_VARIANT,
)
from setvalued.config import effective_config
from studies.sqlite_store import seed_sqlite_store

# Key whose history tells which epochs a run already holds (fit always reports it; the
# trial adds it when a fit function does not).
EPOCH_MARKER_METRIC = "epoch_time_s"

_SEARCH_PAGE = 1_000  # runs per search_runs page: what one page holds in memory is bounded
_MAX_PARAMS_TAGS_PER_BATCH = 100  # mlflow.utils.validation.MAX_PARAMS_TAGS_PER_BATCH
_MAX_METRICS_PER_BATCH = 1000  # mlflow.utils.validation.MAX_METRICS_PER_BATCH
_MAX_PARAM_LENGTH = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
_MAX_TAG_LENGTH = 8000

T = TypeVar("T")


# ----------------------------------------------------------------------------- helpers


#: the artifact folder of a cell's selected model (MLflow's pytorch flavour)
MODEL_ARTIFACT = "model"
#: MLflow 3 opens an experiment in its GenAI view unless this tag says otherwise
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
#: the experiment's (and a run's) description in the MLflow UI
NOTE_TAG = "mlflow.note.content"


def source_tags(study_file: str | Path) -> dict[str, str]:
    """The system tags MLflow's own clients set on a run: who ran it, from which file, and the
    git commit, branch and remote of the checkout holding the study file, if it is in one."""
    import getpass
    import subprocess

    path = Path(study_file).resolve()
    tags = {"mlflow.source.name": str(path), "mlflow.source.type": "LOCAL"}
    try:
        tags["mlflow.user"] = getpass.getuser()
    except (KeyError, OSError):  # no user name in this container
        pass

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=path.parent, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None

    commit = git("rev-parse", "HEAD")
    if commit:
        tags["mlflow.source.git.commit"] = commit
        for key, args in (("mlflow.source.git.branch", ("rev-parse", "--abbrev-ref", "HEAD")),
                          ("mlflow.source.git.repoURL", ("config", "--get", "remote.origin.url"))):
            value = git(*args)
            if value:
                tags[key] = value
    return tags


def experiment_tags(description: str) -> dict[str, str]:
    """A study's experiment opens in MLflow 3's model-training view, with the study's
    description (``study_description``) as its note."""
    tags = {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
    if description:
        tags[NOTE_TAG] = description
    return tags


def study_description(description: str, source_text: str) -> str:
    """The study's ``description:``, else the comment lines that open its file."""
    if description.strip():
        return description.strip()
    lines = []
    for line in source_text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return "\n".join(lines).strip()


def default_tracking_uri(study_dir: str | Path) -> str:
    """The embedded tracking store of a study: `sqlite:///<output>/<name>/mlflow.db`."""
    return f"sqlite:///{Path(study_dir).resolve() / 'mlflow.db'}"


def ui_command(tracking_uri: str) -> str:
    """The shell command that opens the MLflow UI on this tracking store."""
    if tracking_uri.startswith(("http://", "https://")):
        return f"open {tracking_uri} in a browser (MLflow server)"
    return f"mlflow ui --backend-store-uri {tracking_uri}"


def _is_locked_error(error: BaseException) -> bool:
    text = str(error).lower()
    return "database is locked" in text or "database table is locked" in text


#: what a tracking server that is down or restarting answers, through requests and MLflow
_OUTAGE_SIGNS = ("connection refused", "max retries exceeded", "failed to establish a new connection",
                 "connection aborted", "remote end closed connection", "bad gateway", "service unavailable",
                 "gateway timeout", "read timed out", "connection reset",
                 # a server whose database connection pool is used up by concurrent writers
                 "queuepool limit")
#: how long an unanswering tracking server is waited for before the error is raised
OUTAGE_PATIENCE_S = 15 * 60.0
_outage_warned = False


def _is_outage(error: BaseException) -> bool:
    text = f"{type(error).__name__}: {error}".lower()
    return isinstance(error, ConnectionError) or any(sign in text for sign in _OUTAGE_SIGNS)


def _warn_outage(error: BaseException) -> None:
    global _outage_warned
    if not _outage_warned:
        _outage_warned = True
        first = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
        print(f"[studies] warning: the tracking server does not answer ({first}); retrying with backoff "
              f"for up to {OUTAGE_PATIENCE_S / 60:.0f} minutes, nothing is lost meanwhile", file=sys.stderr,
              flush=True)


def with_retry(
    action: Callable[[], T], *, attempts: int = 12, first_delay_s: float = 0.05,
    max_delay_s: float = 5.0, outage_patience_s: float | None = None,
) -> T:
    """Run `action`, retrying with jittered exponential backoff while SQLite is locked or the
    tracking server does not answer.

    Parallel trial workers write to one SQLite file in the embedded default; SQLite lets one
    writer in at a time and answers "database is locked" to the others when its busy
    timeout runs out (mlflow#6490): up to `attempts` tries. A tracking server that is down
    (connection refused, 502/503/504) is waited for up to `outage_patience_s` (default
    OUTAGE_PATIENCE_S), with one warning per process, so that a study outlives a server
    restart. Other errors are raised at once.
    """
    patience = OUTAGE_PATIENCE_S if outage_patience_s is None else outage_patience_s
    delay = first_delay_s
    deadline = None
    attempt = 0
    while True:
        try:
            return action()
        except Exception as error:  # MlflowException, sqlalchemy OperationalError, requests errors
            attempt += 1
            if _is_outage(error):
                deadline = deadline or time.monotonic() + patience
                if time.monotonic() >= deadline:
                    raise
                _warn_outage(error)
                time.sleep(min(delay * 4, 30.0) * (0.5 + random.random()))
                delay = min(delay * 2.0, 30.0)
                continue
            if not _is_locked_error(error) or attempt >= attempts:
                raise
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2.0, max_delay_s)


def param_text(value: Any) -> str:
    """An MLflow param string: strings as they are, everything else as JSON."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    if len(text) > _MAX_PARAM_LENGTH:
        text = text[: _MAX_PARAM_LENGTH - 3] + "..."
    return text


def config_params(config: Mapping[str, Any]) -> dict[str, str]:
    """The nested trial config as MLflow params with dotted keys (`loss.epsilon` -> '0.1').

    Lists stay whole (JSON text); an empty mapping is kept as '{}' so that it is not lost.
    """
    return {path: param_text(dict(value) if isinstance(value, Mapping) else value)
            for path, value in flatten_config(effective_config(config)).items()}


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _filter(**tags: str) -> str:
    """An MLflow filter string matching every given tag (dotted keys in backticks)."""
    clauses = []
    for key, value in tags.items():
        tag = key.replace("__", ".")
        escaped = str(value).replace("'", "\\'")
        clauses.append(f"tags.`{tag}` = '{escaped}'")
    return " and ".join(clauses)


def _chunks(items: Sequence[T], size: int) -> Iterable[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _as_float(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number


def _client(tracking_uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def _search_all(client, experiment_id: str, filter_string: str) -> list:
    """Every active run of the experiment matching the filter (all pages), oldest first."""
    from mlflow.entities import ViewType

    runs: list = []
    token = None
    while True:
        page = with_retry(lambda: client.search_runs(
            [experiment_id], filter_string=filter_string, run_view_type=ViewType.ACTIVE_ONLY,
            max_results=_SEARCH_PAGE, order_by=["attributes.start_time ASC"],
            page_token=token,
        ))
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def finished_runs(runs: Iterable) -> list:
    """The runs tagged `studies.status=finished` among `runs` (`RunRecord`s), in their order
    (oldest first as the ledger groups them): a cell is done when it has one."""
    return [r for r in runs if r.tags.get(TAG_STATUS) == STATUS_FINISHED]


def cell_tags(cell: Mapping[str, Any], study_name: str, parent_run_id: str,
              session_id: str) -> dict[str, str]:
    """The contract tags of a cell's child run (docs/interfaces.md section 5)."""
    return {
        PARENT_RUN_TAG: parent_run_id,
        TAG_ROLE: ROLE_CELL,
        TAG_STUDY: study_name,
        TAG_CONFIG_ID: str(cell["config_id"]),
        TAG_SEED: str(cell["seed"]),
        TAG_CELL_ID: str(cell["cell_id"]),
        TAG_VARIANT: str(cell.get("variant") or ""),
        TAG_SWEPT: canonical_json(cell.get("swept") or {}),
        TAG_STATUS: STATUS_RUNNING,
        TAG_SESSION: session_id,
    }


# ----------------------------------------------------------------------------- worker side


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


class CellRun:
    """The child run of one cell, written from the Tune worker."""

    def __init__(self, context: TrackingContext, run_id: str, client=None):
        self.context = context
        self.run_id = run_id
        self.client = client or _client(context.tracking_uri)

    @classmethod
    def open(cls, context: TrackingContext, cell: Mapping[str, Any],
             run_id: str | None = None, tags: Mapping[str, str] | None = None
             ) -> tuple["CellRun", bool]:
        """The cell's run: `run_id` if given, else the run this driver session already made
        for the cell (a trial restarted after its worker died), else a new one; `tags` are
        set on it in the same request.

        Returns (run, reused). A new run gets the contract tags with its creation and the
        params in one batched call.
        """
        client = _client(context.tracking_uri)
        if run_id is None:
            existing = _search_all(client, context.experiment_id, _filter(
                studies__cell_id=str(cell["cell_id"]), studies__session=context.session_id,
            ))
            if existing:
                run_id = existing[-1].info.run_id
        if run_id is not None:
            run = cls(context, run_id, client)
            with_retry(lambda: client.update_run(run_id, status="RUNNING"))
            run.set_tags({TAG_STATUS: STATUS_RUNNING, **dict(tags or {})})
            return run, True
        all_tags = {**dict(context.run_tags),
                    **cell_tags(cell, context.study_name, context.parent_run_id, context.session_id),
                    **dict(tags or {})}
        created = with_retry(lambda: client.create_run(
            context.experiment_id, tags=all_tags,
            run_name=cell.get("run_name") or f"{cell.get('variant') or 'cell'}-{cell['cell_id']}",
        ))
        run = cls(context, created.info.run_id, client)
        params = config_params(cell["config"])
        params["seed"] = str(cell["seed"])
        run.log_params(params)
        return run, False

    # -- writes (every one retried while SQLite is locked)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)[:_MAX_TAG_LENGTH]) for k, v in tags.items()]
        for chunk in _chunks(items, _MAX_PARAMS_TAGS_PER_BATCH):
            with_retry(lambda: self.client.log_batch(self.run_id, tags=list(chunk),
                                                     synchronous=True))

    def log_params(self, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in sorted(params.items())]
        for chunk in _chunks(items, _MAX_PARAMS_TAGS_PER_BATCH):
            with_retry(lambda: self.client.log_batch(self.run_id, params=list(chunk),
                                                     synchronous=True))

    def log_metrics(self, metrics: Mapping[str, Any], step: int,
                    tags: Mapping[str, str] | None = None) -> None:
        """All `metrics` at `step` (and optional tags) in one `log_batch` request."""
        self.log_epochs([(step, metrics)], tags=tags)

    def log_epochs(self, epochs: Sequence[tuple[int, Mapping[str, Any]]],
                   tags: Mapping[str, str] | None = None) -> None:
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
                number = _as_float(value)
                if number is None or isinstance(value, bool):
                    continue
                items.append(Metric(key, number, timestamp, int(step)))
        tag_items = [RunTag(k, str(v)[:_MAX_TAG_LENGTH]) for k, v in (tags or {}).items()]
        chunks = list(_chunks(items, _MAX_METRICS_PER_BATCH)) or [[]]
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            with_tags = tag_items if last and len(tag_items) <= _MAX_PARAMS_TAGS_PER_BATCH else []
            if chunk or with_tags:
                with_retry(lambda: self.client.log_batch(self.run_id, metrics=list(chunk),
                                                         tags=with_tags, synchronous=True))
        if tag_items and len(tag_items) > _MAX_PARAMS_TAGS_PER_BATCH:
            self.set_tags(dict(tags or {}))

    def last_logged_epoch(self) -> int | None:
        """The largest step of the epoch marker metric already in the run (None if none)."""
        history = with_retry(lambda: self.client.get_metric_history(self.run_id,
                                                                    EPOCH_MARKER_METRIC))
        return max((m.step for m in history), default=None)

    def finish(self, result: Mapping[str, Any], final_step: int,
               pending: Sequence[tuple[int, Mapping[str, Any]]] = ()) -> None:
        """Log the outcome of `fit`: the per-class Parquet artifact, then the epochs not yet
        logged (`pending`), the test metrics, best epoch/value and `studies.status=finished`
        in one request (the status last, so a crash never marks it done)."""
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
        self.log_epochs([*pending, (final_step, final)], tags={TAG_STATUS: STATUS_FINISHED})
        with_retry(lambda: self.client.set_terminated(self.run_id, status="FINISHED"))

    def log_model(self, model: Any, input_example: Any) -> None:
        """The selected checkpoint as an MLflow PyTorch model (artifact ``model``): loadable
        with ``mlflow.pytorch.load_model("runs:/<run_id>/model")``, with its input example and
        signature. Saved in PyTorch's exported-program format (no pickle of the module)."""
        import mlflow.pytorch
        import torch

        model = model.cpu().eval()
        version = torch.__version__.split("+")[0]
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / MODEL_ARTIFACT
            mlflow.pytorch.save_model(model, str(path), input_example=input_example.cpu().numpy(),
                                      pip_requirements=[f"torch=={version}"])
            with_retry(lambda: self.client.log_artifacts(self.run_id, str(path), MODEL_ARTIFACT))

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


# ----------------------------------------------------------------------------- driver side


@dataclass
class CellState:
    """What MLflow says about one cell."""

    cell_id: str
    status: str  # finished | failed | running | missing
    run_id: str | None = None
    error: str | None = None


class StudyTracking:
    """Driver-side view of a study in MLflow: experiment, parent run, cell ledger."""

    def __init__(self, tracking_uri: str, study_name: str,
                 artifact_root: str | Path | None = None, description: str = "",
                 run_tags: Mapping[str, str] | None = None):
        self.tracking_uri = tracking_uri
        self.study_name = study_name
        self.description = description
        self.run_tags = dict(run_tags or {})
        seed_sqlite_store(tracking_uri)  # a new local store: a copy, not 70 migrations
        self.client = _client(tracking_uri)
        self.artifact_root = artifact_root
        self._experiment_id: str | None = None
        self._parent_run_id: str | None = None

    # -- experiment and parent run

    def find_experiment_id(self) -> str | None:
        experiment = with_retry(lambda: self.client.get_experiment_by_name(self.study_name))
        if experiment is None:
            return None
        if experiment.lifecycle_stage != "active":
            raise RuntimeError(
                f"MLflow experiment {self.study_name!r} at {self.tracking_uri} is deleted; "
                f"restore it (mlflow experiments restore --experiment-id "
                f"{experiment.experiment_id}) or rename the study"
            )
        return experiment.experiment_id

    @property
    def experiment_id(self) -> str:
        """The study's experiment, created if missing (artifacts under `artifact_root`)."""
        if self._experiment_id is None:
            found = self.find_experiment_id()
            if found is None:
                location = None
                if self.artifact_root is not None:
                    location = Path(self.artifact_root).resolve().as_uri()
                try:
                    found = with_retry(lambda: self.client.create_experiment(
                        self.study_name, artifact_location=location,
                        tags={TAG_STUDY: self.study_name, **self._experiment_tags()},
                    ))
                except Exception:
                    # another driver created it in between
                    found = self.find_experiment_id()
                    if found is None:
                        raise
            self._experiment_id = found
            for key, value in self._experiment_tags().items():  # the description may have changed
                with_retry(lambda: self.client.set_experiment_tag(found, key, value))
        return self._experiment_id

    def _experiment_tags(self) -> dict[str, str]:
        return experiment_tags(self.description)

    def parent_run_id(self, study_yaml: str | Path | None = None) -> str:
        """The study's parent run: found by its tags, else created once (with `study.yaml`).

        The artifact is re-uploaded when the file changed, so it shows the file as last run.
        """
        if self._parent_run_id is not None:
            return self._parent_run_id
        runs = _search_all(self.client, self.experiment_id, _filter(
            studies__role=ROLE_PARENT, studies__study=self.study_name))
        if runs:
            run_id = runs[0].info.run_id
            with_retry(lambda: self.client.update_run(run_id, status="RUNNING"))
        else:
            run = with_retry(lambda: self.client.create_run(
                self.experiment_id, run_name=self.study_name,
                tags={**self.run_tags, TAG_ROLE: ROLE_PARENT, TAG_STUDY: self.study_name},
            ))
            run_id = run.info.run_id
        if study_yaml is not None:
            with_retry(lambda: self.client.log_artifact(run_id, str(study_yaml)))
        self._parent_run_id = run_id
        return run_id

    def close_parent(self, all_done: bool) -> None:
        if self._parent_run_id is None:
            return
        status = "FINISHED" if all_done else "FAILED"
        with_retry(lambda: self.client.set_terminated(self._parent_run_id, status=status))

    def context(self, session_id: str) -> TrackingContext:
        return TrackingContext(
            tracking_uri=self.tracking_uri, experiment_id=self.experiment_id,
            parent_run_id=self.parent_run_id(), study_name=self.study_name,
            session_id=session_id, run_tags=tuple(sorted(self.run_tags.items())),
        )

    # -- the cell ledger

    def cell_runs(self, metrics: Sequence[str] = ()) -> dict[str, list[RunRecord]]:
        """Active child runs of the study grouped by cell id (oldest first): their ids and
        tags, and of their latest metrics only `metrics` (`analysis.collect.study_runs`: bulk
        SQL on an SQL store, so that resuming a study of 10,000 cells reads its ledger in
        seconds and holds no MLflow `Run` objects)."""
        return self._grouped_runs(metrics)

    def config_runs(self, config_id: str) -> dict[str, list[RunRecord]]:
        """Active child runs of one config of the study grouped by cell id (oldest first):
        one query, whatever the size of the study."""
        return self._grouped_runs((), **{TAG_CONFIG_ID: str(config_id)})

    def _grouped_runs(self, metrics: Sequence[str], **tags: str) -> dict[str, list[RunRecord]]:
        from analysis.collect import study_runs

        experiment_id = self.find_experiment_id() if self._experiment_id is None \
            else self._experiment_id
        if experiment_id is None:
            return {}
        wanted = {TAG_ROLE: ROLE_CELL, TAG_STUDY: self.study_name, **tags}
        grouped: dict[str, list[RunRecord]] = {}
        for run in with_retry(lambda: study_runs(self.client, experiment_id, wanted, params=False,
                                                 metrics=tuple(metrics),
                                                 page_size=_SEARCH_PAGE)):
            cell_id = run.tags.get(TAG_CELL_ID)
            if cell_id:
                grouped.setdefault(cell_id, []).append(run)
        return grouped

    @staticmethod
    def finished_run(runs: Sequence[RunRecord]) -> str | None:
        """The id of the (latest) run tagged finished among `runs`, if any."""
        finished = finished_runs(runs)
        return finished[-1].run_id if finished else None

    def tags_of_run(self, run_id: str) -> dict[str, str]:
        """The tags of a run."""
        return dict(with_retry(lambda: self.client.get_run(run_id)).data.tags)

    def fail_unfinished(self, state: CellState, message: str) -> CellState:
        """End a run that a trial left `running` (its worker could not write its failure, for
        instance to a full disk) as FAILED with `message`; the cell's new state."""
        if state.run_id is not None:
            with_retry(lambda: self.client.set_tag(state.run_id, TAG_STATUS, STATUS_FAILED))
            with_retry(lambda: self.client.set_tag(state.run_id, TAG_ERROR, message))
            with_retry(lambda: self.client.set_terminated(state.run_id, status="FAILED"))
        return CellState(state.cell_id, STATUS_FAILED, state.run_id, message)

    def cell_states(self, cell_ids: Iterable[str] | None = None) -> dict[str, CellState]:
        """Per cell: finished (a run tagged finished), else failed/running, else missing."""
        grouped = self.cell_runs()
        ids = list(cell_ids) if cell_ids is not None else list(grouped)
        states = {}
        for cell_id in ids:
            runs = grouped.get(cell_id, [])
            finished = finished_runs(runs)
            if finished:
                states[cell_id] = CellState(cell_id, STATUS_FINISHED, finished[-1].run_id)
            elif runs:
                run = runs[-1]
                status = run.tags.get(TAG_STATUS) or STATUS_RUNNING
                states[cell_id] = CellState(cell_id, status, run.run_id, run.tags.get(TAG_ERROR))
            else:
                states[cell_id] = CellState(cell_id, "missing")
        return states

    def prepare(self, cell_ids: Sequence[str], keep: Mapping[str, str] | None = None,
                grouped: Mapping[str, list] | None = None) -> tuple[list[str], list[str]]:
        """Split the cells into (done, to_run) and clear what an earlier driver left.

        A cell is done when one of its runs is tagged `finished`. Every other active run of a
        cell (left `running` by a killed driver, or `failed`) is deleted: a cell to run starts
        with no run, a done cell keeps only its finished run(s). `keep` maps a cell to run
        to the run an earlier checkpoint of it continues: that run is kept, and the entries
        whose run is not an active run of the cell are removed from `keep` (in place).
        `grouped`: the cells' runs when the caller has them (`config_runs`), else all the
        study's are read. Returns cell ids in order.
        """
        grouped = self.cell_runs() if grouped is None else grouped
        keep = keep if keep is not None else {}
        done, to_run = [], []
        for cell_id in cell_ids:
            runs = grouped.get(cell_id, [])
            finished = finished_runs(runs)
            kept = keep.get(cell_id) if not finished else None
            if kept not in {r.run_id for r in runs}:
                keep.pop(cell_id, None)
                kept = None
            for run in runs:
                if run.tags.get(TAG_STATUS) != STATUS_FINISHED and run.run_id != kept:
                    with_retry(lambda: self.client.delete_run(run.run_id))
            (done if finished else to_run).append(cell_id)
        return done, to_run

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        history = with_retry(lambda: self.client.get_metric_history(run_id, key))
        return sorted((m.step, m.value) for m in history)

    def run_metrics(self, run_id: str) -> dict[str, float]:
        run = with_retry(lambda: self.client.get_run(run_id))
        return dict(run.data.metrics)


def cell_objective(tracking: StudyTracking, run_id: str, metric: str) -> float:
    """The objective value of a finished cell.

    `test/...` and final metrics (`best_val`, ...) are read as logged; a per-epoch metric
    (`val/top5`) is read at the selected epoch (`best_epoch`), the checkpoint that `fit`
    evaluated on the test set. NaN when the metric is absent.
    """
    metrics = tracking.run_metrics(run_id)
    if metric.startswith("test/") or metric in ("best_val", "best_epoch"):
        return float(metrics.get(metric, math.nan))
    history = dict(tracking.metric_history(run_id, metric))
    if not history:
        return math.nan
    best_epoch = metrics.get("best_epoch")
    if best_epoch is not None and int(best_epoch) in history:
        return float(history[int(best_epoch)])
    return float(history[max(history)])


def new_session_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{random.randrange(16**6):06x}"
