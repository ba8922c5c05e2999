"""The MLflow layout of a study (docs/interfaces.md, section 5), in one place.

`studies.tracking` writes runs with these tags and artifacts and `analysis.collect` reads
them back; both import the names from here so that the two sides cannot drift apart.
"""

from typing import Any, Mapping

TAG_ROLE = "studies.role"
TAG_STUDY = "studies.study"
TAG_CONFIG_ID = "studies.config_id"
TAG_SEED = "studies.seed"
TAG_CELL_ID = "studies.cell_id"
TAG_VARIANT = "studies.variant"
TAG_SWEPT = "studies.swept"
TAG_STATUS = "studies.status"
TAG_ERROR = "studies.error"
TAG_SESSION = "studies.session"
TAG_RESUMED_FROM = "studies.resumed_from_epoch"
TAG_NODE_ID = "studies.node_id"  # the Ray node of the trial's latest attempt
#: a racing study's final decision about a config (JSON: state, seeds, max, reason, p_holm,
#: best), on the run of the config's last finished seed (studies.race_driver)
TAG_RACE = "studies.race"
#: the epochs done when the cell's config was stopped by a config-level rule (all its seeds)
TAG_STOPPED_EPOCH = "studies.stopped_epoch"
#: the rule that pruned the cell's config (`asha`, `optuna`); absent for early stopping. The
#: report leaves pruned configs out of its tables unless `report: {show_pruned: true}`
TAG_PRUNED = "studies.pruned"
PARENT_RUN_TAG = "mlflow.parentRunId"

ROLE_PARENT = "parent"
ROLE_CELL = "cell"
#: experiment tags ``studies.lease.<token>``: which driver runs the study (studies.lease)
TAG_LEASE_PREFIX = "studies.lease."

STATUS_RUNNING = "running"
STATUS_FINISHED = "finished"
STATUS_FAILED = "failed"

STUDY_ARTIFACT = "study.yaml"
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
