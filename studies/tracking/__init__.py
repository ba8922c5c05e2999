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

Modules: `contract` (the tags and params written, the search helpers), `retry`, `cell_run`
(worker side), `ledger` (driver side), `provenance` (what trained a cell: its identity, data
set input and environment; the parent run's environment manifest and cells kept knowingly).
"""

from __future__ import annotations

from analysis.layout import (  # the layout's names that the runner and the trials use
    PARENT_RUN_TAG,
    STATUS_FAILED,
    STATUS_FINISHED,
    TAG_NODE_ID,
    TAG_PRUNED,
    TAG_RESUMED_FROM,
    TAG_STATUS,
    TAG_STOPPED_EPOCH,
)
from studies.tracking.cell_run import CellRun, TrackingContext
from studies.tracking.contract import (
    EPOCH_MARKER_METRIC,
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    MODEL_ARTIFACT,
    NOTE_TAG,
    canonical_json,
    cell_tags,
    config_params,
    default_tracking_uri,
    experiment_tags,
    finished_runs,
    param_text,
    source_tags,
    study_description,
    ui_command,
)
from studies.tracking.ledger import CellState, StudyTracking, cell_objective, new_session_id
from studies.tracking.retry import OUTAGE_PATIENCE_S, with_retry

__all__ = [
    "PARENT_RUN_TAG",
    "STATUS_FAILED",
    "STATUS_FINISHED",
    "TAG_NODE_ID",
    "TAG_PRUNED",
    "TAG_RESUMED_FROM",
    "TAG_STATUS",
    "TAG_STOPPED_EPOCH",
    "CellRun",
    "TrackingContext",
    "EPOCH_MARKER_METRIC",
    "EXPERIMENT_KIND",
    "EXPERIMENT_KIND_TAG",
    "MODEL_ARTIFACT",
    "NOTE_TAG",
    "canonical_json",
    "cell_tags",
    "config_params",
    "default_tracking_uri",
    "experiment_tags",
    "finished_runs",
    "param_text",
    "source_tags",
    "study_description",
    "ui_command",
    "CellState",
    "StudyTracking",
    "cell_objective",
    "new_session_id",
    "OUTAGE_PATIENCE_S",
    "with_retry",
]
