"""The driver side: `StudyTracking`, a study's experiment, parent run and cell ledger."""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from analysis.layout import (
    ROLE_CELL,
    ROLE_PARENT,
    STATUS_FAILED,
    STATUS_FINISHED,
    STATUS_RUNNING,
    TAG_CELL_ID,
    TAG_CONFIG_ID,
    TAG_ERROR,
    TAG_ROLE,
    TAG_STATUS,
    TAG_STOP_REASON,
    TAG_STUDY,
    TAG_VERSION,
    VERSIONS_ARTIFACT_DIR,
    tag_filter,
)
from studies.tracking.cell_run import TrackingContext
from studies.tracking.contract import SEARCH_PAGE, experiment_tags, finished_runs, search_all, tracking_client
from studies.tracking.provenance import ParentRecord, data_fingerprints, log_data_inputs
from studies.tracking.retry import with_retry
from studies.tracking.sqlite_store import seed_sqlite_store

if TYPE_CHECKING:
    from analysis.collect import RunRecord


@dataclass
class CellState:
    """What MLflow says about one cell."""

    cell_id: str
    status: str  # finished | failed | running | missing
    run_id: str | None = None
    error: str | None = None
    mlflow_status: str | None = None  # its run's MLflow status (RUNNING, KILLED, ...)


class StudyTracking:
    """Driver-side view of a study in MLflow: experiment, parent run, cell ledger."""

    def __init__(
        self,
        tracking_uri: str,
        study_name: str,
        artifact_root: str | Path | None = None,
        description: str = "",
        run_tags: Mapping[str, str] | None = None,
        ui_view: Mapping[str, Any] | None = None,
        version: str = "",
        version_definition: Path | None = None,
        data_fingerprints: Mapping[str, str] | None = None,
        parent_record: ParentRecord | None = None,
    ):
        self.tracking_uri = tracking_uri
        self.ui_view = ui_view  # the MLflow UI's view of the cell runs (studies.tracking.ui_view)
        self.study_name = study_name
        self.description = description
        self.run_tags = dict(run_tags or {})
        seed_sqlite_store(tracking_uri)  # a new local store: a copy, not 70 migrations
        self.client = tracking_client(tracking_uri)
        self.artifact_root = artifact_root
        self._experiment_id: str | None = None
        self._parent_run_id: str | None = None
        #: the version of the study this driver runs (`studies.running.versions`): tagged on
        #: the parent run and on every cell run, its study file kept under `versions/`
        self.version = version
        self.version_definition = version_definition  # its entry (studies.running.versions)
        #: the driver's data fingerprints by data key (JSON), sent to the trials; what the parent
        #: run gets of this run's provenance (studies.tracking.provenance)
        self.data_fingerprints: dict[str, str] = dict(data_fingerprints or {})
        self.parent_record = parent_record

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
                    found = with_retry(
                        lambda: self.client.create_experiment(
                            self.study_name,
                            artifact_location=location,
                            tags={TAG_STUDY: self.study_name, **self._experiment_tags(None)},
                        )
                    )
                except Exception:
                    # another driver created it in between
                    found = self.find_experiment_id()
                    if found is None:
                        raise
            self._experiment_id = found
            for key, value in self._experiment_tags(found).items():  # the description may have changed
                with_retry(lambda: self.client.set_experiment_tag(found, key, value))
        return self._experiment_id

    def _experiment_tags(self, experiment_id: str | None) -> dict[str, str]:
        return experiment_tags(self.description, self.ui_view, experiment_id)

    def parent_run_id(self, study_yaml: str | Path | None = None) -> str:
        """The study's parent run: found by its tags, else created once (with `study.yaml`).

        The artifact is re-uploaded when the file changed, so it shows the file as last run.
        """
        if self._parent_run_id is not None:
            return self._parent_run_id
        runs = search_all(
            self.client, self.experiment_id, tag_filter({TAG_ROLE: ROLE_PARENT, TAG_STUDY: self.study_name})
        )
        if runs:
            run_id = runs[0].info.run_id
            with_retry(lambda: self.client.update_run(run_id, status="RUNNING"))
            if TAG_STOP_REASON in runs[0].data.tags:  # a stopped study goes on
                with_retry(lambda: self.client.delete_tag(run_id, TAG_STOP_REASON))
        else:
            run = with_retry(
                lambda: self.client.create_run(
                    self.experiment_id,
                    run_name=self.study_name,
                    tags={**self.run_tags, TAG_ROLE: ROLE_PARENT, TAG_STUDY: self.study_name},
                )
            )
            run_id = run.info.run_id
        if study_yaml is not None:
            with_retry(lambda: self.client.log_artifact(run_id, str(study_yaml)))
        if self.version:
            with_retry(lambda: self.client.set_tag(run_id, TAG_VERSION, self.version))
            for path in (study_yaml, self.version_definition):
                if path is not None:
                    with_retry(
                        lambda: self.client.log_artifact(run_id, str(path), f"{VERSIONS_ARTIFACT_DIR}/{self.version}")
                    )
        if self.parent_record is not None:  # the environment manifest, cells kept knowingly (once)
            self.parent_record.write(self.client, run_id)
            self.parent_record = None
        # the study's data sets, before any cell logs them: a cell then links an existing row
        # instead of racing the others to insert it (`provenance.log_data_inputs`)
        log_data_inputs(self.client, run_id, list(data_fingerprints(sorted(self.data_fingerprints.items())).values()))
        self._parent_run_id = run_id
        return run_id

    def close_parent(self, all_done: bool, stopped: str | None = None, patience_s: float | None = None) -> None:
        """End the parent run: FINISHED, FAILED, or KILLED with `stopped` (the reason) when
        a signal stopped the driver."""
        if self._parent_run_id is None:
            return
        run_id = self._parent_run_id
        if stopped is not None:
            with_retry(lambda: self.client.set_tag(run_id, TAG_STOP_REASON, stopped), outage_patience_s=patience_s)
        status = "KILLED" if stopped is not None else "FINISHED" if all_done else "FAILED"
        with_retry(lambda: self.client.set_terminated(run_id, status=status), outage_patience_s=patience_s)

    def context(self, session_id: str) -> TrackingContext:
        return TrackingContext(
            tracking_uri=self.tracking_uri,
            experiment_id=self.experiment_id,
            parent_run_id=self.parent_run_id(),
            study_name=self.study_name,
            session_id=session_id,
            run_tags=tuple(sorted(self.run_tags.items())),
            version=self.version,
            data=tuple(sorted(self.data_fingerprints.items())),
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

        experiment_id = self.find_experiment_id() if self._experiment_id is None else self._experiment_id
        if experiment_id is None:
            return {}
        wanted = {TAG_ROLE: ROLE_CELL, TAG_STUDY: self.study_name, **tags}
        grouped: dict[str, list[RunRecord]] = {}
        for run in with_retry(
            lambda: study_runs(
                self.client, experiment_id, wanted, params=False, metrics=tuple(metrics), page_size=SEARCH_PAGE
            )
        ):
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

    def close_stopped(self, states: Iterable[CellState], reason: str, patience_s: float | None = None) -> list[str]:
        """End as KILLED, tagged with `reason`, the runs that a stopped driver's trials left
        RUNNING in MLflow (their workers are gone: nothing else would close them). Their
        `studies.status` stays `running`: the ledger deletes or continues them on resume.
        `patience_s` bounds the wait for an unanswering server. The ids of the runs closed."""
        closed = []
        for state in states:
            if state.run_id is None or state.mlflow_status != "RUNNING":
                continue
            run_id = state.run_id
            with_retry(lambda: self.client.set_tag(run_id, TAG_STOP_REASON, reason), outage_patience_s=patience_s)
            with_retry(lambda: self.client.set_terminated(run_id, status="KILLED"), outage_patience_s=patience_s)
            closed.append(run_id)
        return closed

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
                states[cell_id] = CellState(cell_id, status, run.run_id, run.tags.get(TAG_ERROR), run.status)
            else:
                states[cell_id] = CellState(cell_id, "missing")
        return states

    def prepare(
        self, cell_ids: Sequence[str], keep: dict[str, str] | None = None, grouped: Mapping[str, list] | None = None
    ) -> tuple[list[str], list[str]]:
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
        done: list[str] = []
        to_run: list[str] = []
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
                elif run.run_id == kept and TAG_STOP_REASON in run.tags:  # it continues now
                    with_retry(lambda: self.client.delete_tag(kept, TAG_STOP_REASON))
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
