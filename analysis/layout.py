"""The MLflow layout of a study (docs/interfaces.md, section 5), in one place.

`studies.tracking` writes runs with these tags and artifacts and `analysis.collect` reads
them back; both import the names from here so that the two sides cannot drift apart.
"""

import json
from typing import Any, Mapping

TAG_ROLE = "studies.role"
TAG_STUDY = "studies.study"
TAG_CONFIG_ID = "studies.config_id"
TAG_SEED = "studies.seed"
TAG_CELL_ID = "studies.cell_id"
TAG_VARIANT = "studies.variant"
#: the config's readable name (`studies.cells.run_names`: its run name without the seed); the MLflow
#: UI groups a study's cell runs by it
TAG_CONFIG_NAME = "studies.config_name"
TAG_SWEPT = "studies.swept"
#: the version of the study that made the run (`studies.studyfile.version`: a digest of what
#: defines its configs), on the parent run (the version run last) and on every cell run
TAG_VERSION = "studies.version"
TAG_STATUS = "studies.status"
TAG_ERROR = "studies.error"
TAG_SESSION = "studies.session"
TAG_RESUMED_FROM = "studies.resumed_from_epoch"
TAG_NODE_ID = "studies.node_id"  # the Ray node of the trial's latest attempt
#: a racing study's final decision about a config (JSON: state, seeds, max, reason, p_holm,
#: best), on the run of the config's last finished seed (studies.scheduling.race_driver)
TAG_RACE = "studies.race"
#: the epochs done when the cell's config was stopped by a config-level rule (all its seeds)
TAG_STOPPED_EPOCH = "studies.stopped_epoch"
#: the rule that pruned the cell's config (`asha`, `optuna`); absent for early stopping. The
#: report leaves pruned configs out of its tables unless `report: {show_pruned: true}`
TAG_PRUNED = "studies.pruned"
#: why the driver closed a run that was still running when a signal stopped it
#: ("terminated by SIGTERM", "interrupted"): its MLflow status is then KILLED
#: (studies.running.runner); a resumed cell's run loses it when it continues
TAG_STOP_REASON = "studies.stop_reason"
PARENT_RUN_TAG = "mlflow.parentRunId"

ROLE_PARENT = "parent"
ROLE_CELL = "cell"
#: experiment tags ``studies.lease.<token>``: which driver runs the study (studies.running.lease)
TAG_LEASE_PREFIX = "studies.lease."

STATUS_RUNNING = "running"
STATUS_FINISHED = "finished"
STATUS_FAILED = "failed"

#: the MLflow UI (3.x) of a study's cell runs: a view the experiment holds in the tag
#: ``mlflow.sharedViewState.<key>`` and the runs page loads from ``viewStateShareKey=<key>``
#: (the page ignores it when the URL holds a search facet such as ``searchFilter``);
#: ``workflowType`` picks the model-training UI over the GenAI one, which a fresh browser
#: shows otherwise (its choice lives in the browser's local storage, not in the experiment)
UI_VIEW_TAG_PREFIX = "mlflow.sharedViewState."
UI_VIEW_KEY = "studies-cells"
UI_WORKFLOW = "workflowType=machine_learning"
#: sorting by run name (any key but the start time) keeps the cell runs flat: on the start
#: time, the UI fetches their parent run and folds them under it
UI_ORDER_BY = "tags.`mlflow.runName`"
#: the UI's id of its run-name column, widened so that a config's name reads whole
UI_NAME_COLUMN = "attributes.`Run Name`"

STUDY_ARTIFACT = "study.yaml"
#: the parent run's folder of every version's study file: ``versions/<version>/study.yaml``
VERSIONS_ARTIFACT_DIR = "versions"
PER_CLASS_ARTIFACT = "per_class_test.parquet"
SET_SIZES_ARTIFACT = "set_sizes_test.parquet"


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 0.1}}`` -> ``{"optim.lr": 0.1}``: a run's params are its config,
    flattened to dotted paths. Lists and empty mappings stay whole values."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, path + "."))
        else:
            flat[path] = value
    return flat


def tag_filter(tags: Mapping[str, Any]) -> str:
    """MLflow's `search_runs` filter for runs with these tag values (dotted keys quoted with
    backticks, quotes in values escaped)."""
    clauses = []
    for tag, value in tags.items():
        escaped = str(value).replace("'", "\\'")
        clauses.append(f"tags.`{tag}` = '{escaped}'")
    return " and ".join(clauses)


def cell_runs_filter() -> str:
    """The search filter that keeps a study's cell runs (its experiment holds the study)."""
    return tag_filter({TAG_ROLE: ROLE_CELL})


def cell_runs_view() -> dict[str, Any]:
    """The MLflow UI's view of the cell runs (the value of the experiment's view tag): the
    cell runs flat, by name, grouped by their config's readable name, every run in the
    charts."""
    return {
        "searchFilter": cell_runs_filter(), "orderByKey": UI_ORDER_BY, "orderByAsc": True,
        "groupBy": {"aggregateFunction": "average",
                    "groupByKeys": [{"mode": "tag", "groupByData": TAG_CONFIG_NAME}]},
        "runsHiddenMode": "SHOW_ALL",
        "columnOrder": [UI_NAME_COLUMN], "columnWidths": {UI_NAME_COLUMN: 360},
    }


def cell_runs_view_tag() -> tuple[str, str]:
    """(key, value) of the experiment tag that holds `cell_runs_view`."""
    return UI_VIEW_TAG_PREFIX + UI_VIEW_KEY, json.dumps(cell_runs_view(), separators=(",", ":"))
