"""The MLflow layout of a study (docs/interfaces.md, section 5), in one place.

`studies.tracking` writes runs with these tags and artifacts and `analysis.collect` reads
them back; both import the names from here so that the two sides cannot drift apart.
"""

import json
from collections.abc import Mapping, Sequence
from typing import Any

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
#: the plugin distributions whose loss, data set or model a cell run used, with the versions its
#: worker imported (``setvalued.registry``): ``name==version`` joined by ``, `` (``plugins_tag``);
#: absent on a run of built-ins only
TAG_PLUGINS = "studies.plugins"
#: what trained the cell (`studies.tracking.provenance`): canonical JSON ``{item: [digest, label]}``
#: of the training core's code (``code``), each plugin distribution its config names
#: (``plugin <distribution>``) and its data (``data``); a finished cell whose identity differs
#: from today's is not reused silently (`studies.running.identity`)
TAG_IDENTITY = "studies.identity"
#: the training core's code as a person reads it: ``setvalued-studies 0.1.0, git <commit>, code <digest>``
TAG_CODE = "studies.code"
#: a fused array's member: the trial it trained in, JSON ``{array, seeds, member}``
TAG_ARRAY = "studies.array"
#: where the cell finished: JSON of its worker's host, Python, torch, CUDA, cuDNN, GPU and driver,
#: device and determinism flags (`studies.tracking.provenance.environment_tags`)
TAG_ENVIRONMENT = "studies.environment"
#: on the parent run: finished cells kept knowingly (``--keep-finished``) although what trained
#: them differs from a later run's: JSON ``{accepted: {item: {old digest: new digest}},
#: decisions: [{when, user, host, cells, changes}]}``
TAG_KEPT = "studies.identity_kept"
#: the parent run's manifest of the driver's environment (Python, torch, CUDA, GPUs and driver,
#: Ray, MLflow, every installed distribution, determinism settings, host), as last run
ENVIRONMENT_ARTIFACT = "environment.json"
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
#: ``workflowType`` picks the model-training UI over the GenAI one. MLflow 3.17 takes that
#: choice from the URL, else from the browser's local storage (default: GenAI); it does not
#: read the experiment's ``mlflow.experimentKind`` tag, so a bare experiment URL opens the
#: GenAI UI in a fresh browser, and the experiment's description carries the link instead
UI_VIEW_TAG_PREFIX = "mlflow.sharedViewState."
UI_VIEW_KEY = "studies-cells"
#: the view's name in the runs page's "Views" menu
UI_VIEW_NAME = "Cell runs by config (studies)"
UI_WORKFLOW = "workflowType=machine_learning"
#: the runs page's chart view (its table view is the default)
UI_CHART_MODE = "compareRunsMode=CHART"
#: sorting by run name (any key but the start time) keeps the cell runs flat: on the start
#: time, the UI fetches their parent run and folds them under it
UI_ORDER_BY = "tags.`mlflow.runName`"
#: the UI's id of its run-name column, widened so that a config's name reads whole
UI_NAME_COLUMN = "attributes.`Run Name`"
#: a run's colour in the UI's charts (``#rrggbb``): a cell run has its config's colour in the
#: report (`analysis.colors.config_colors`)
UI_RUN_COLOR_TAG = "mlflow.runColor"
#: the chart section of the view's charts (the UI adds the other metrics' own sections)
UI_CHART_SECTION = "studies-compare"
#: most charts the view holds (the learning curve last), so that its tag stays well inside
#: MLflow's 20,000 characters of an experiment tag's value
MAX_UI_CHARTS = 24


def ui_column(kind: str, key: str) -> str:
    """The UI's id of the column of a run's `kind` (``params``, ``metrics``, ``tags``,
    ``attributes``) `key`."""
    return f"{kind}.`{key}`"


def _charts(swept: Sequence[str], metrics: Sequence[str], curve_metric: str | None, runs: int) -> list[dict[str, Any]]:
    """The view's charts: per metric, one against each swept parameter (every cell run a
    point), or a bar per cell run without a numeric sweep; the learning curve of
    `curve_metric` by epoch (MLflow's step)."""
    common = {
        "metricSectionId": UI_CHART_SECTION,
        "deleted": False,
        "isGenerated": False,
        "runsCountToCompare": max(runs, 10),
    }
    charts: list[dict[str, Any]] = []
    for metric in metrics:
        if swept:
            charts += [
                {
                    **common,
                    "type": "SCATTER",
                    "xaxis": {"key": path, "type": "PARAM"},
                    "yaxis": {"key": metric, "type": "METRIC"},
                }
                for path in swept
            ]
        else:
            charts.append({**common, "type": "BAR", "metricKey": metric})
    if curve_metric:
        charts.append(
            {
                **common,
                "type": "LINE",
                "metricKey": curve_metric,
                "selectedMetricKeys": [curve_metric],
                "xAxisKey": "step",
                "scaleType": "linear",
                "xAxisScaleType": "linear",
                "lineSmoothness": 0,
                "useGlobalXaxisKey": False,
                "useGlobalLineSmoothing": False,
            }
        )
    charts = charts[: MAX_UI_CHARTS - 1] + charts[-1:] if len(charts) > MAX_UI_CHARTS else charts
    return [{**chart, "uuid": f"studies-chart-{i}"} for i, chart in enumerate(charts)]


def cell_runs_view(
    swept: Sequence[str] = (), metrics: Sequence[str] = (), curve_metric: str | None = None, runs: int = 0
) -> dict[str, Any]:
    """The MLflow UI's view of the cell runs (the value of the experiment's view tag): the
    cell runs flat, by name, grouped by their config's readable name (a group row shows the
    mean of its runs); the `swept` parameters' and the `metrics`' columns; in the chart view
    a section of `_charts` first, each cell run in its own (its config's) colour. `runs`: the
    study's number of cells, how many runs a chart draws."""
    columns = [ui_column("params", p) for p in swept] + [ui_column("metrics", m) for m in metrics]
    view: dict[str, Any] = {
        "searchFilter": cell_runs_filter(),
        "orderByKey": UI_ORDER_BY,
        "orderByAsc": True,
        "groupBy": {"aggregateFunction": "average", "groupByKeys": [{"mode": "tag", "groupByData": TAG_CONFIG_NAME}]},
        "runsHiddenMode": "SHOW_ALL",
        "selectedColumns": columns + [ui_column("attributes", "Models")],
        "columnOrder": [UI_NAME_COLUMN] + columns,
        "columnWidths": {UI_NAME_COLUMN: 360},
    }
    charts = _charts(list(swept), list(metrics), curve_metric, runs)
    if charts:
        view.update(
            {
                "compareRunCharts": charts,
                "compareRunSections": [
                    {
                        "uuid": UI_CHART_SECTION,
                        "name": "study",
                        "display": True,
                        "isReordered": True,
                        "deleted": False,
                        "isGenerated": False,
                    }
                ],
                "isAccordionReordered": True,
                "hideEmptyCharts": True,
                # the runs' own colours (the config's), not one colour per group hashed from its
                # name, which can make two groups look alike
                "useGroupedValuesInCharts": False,
            }
        )
    return view


def cell_runs_view_tag(view: Mapping[str, Any] | None = None, created_ms: int | None = None) -> tuple[str, str]:
    """(key, value) of the experiment tag that holds `view` (default: `cell_runs_view()`), as
    a saved view of MLflow 3.17 (its "Views" menu on the runs page lists it by `UI_VIEW_NAME`;
    the envelope ``{name, createdAt, state}`` with the view as JSON text in ``state``, which a
    ``viewStateShareKey`` link reads too); `created_ms`: its time (default: now)."""
    import time

    state = json.dumps(cell_runs_view() if view is None else view, separators=(",", ":"))
    created = int(time.time() * 1000) if created_ms is None else int(created_ms)
    return UI_VIEW_TAG_PREFIX + UI_VIEW_KEY, json.dumps(
        {"name": UI_VIEW_NAME, "createdAt": created, "state": state}, separators=(",", ":")
    )


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


def plugins_tag(distributions: Mapping[str, str]) -> str:
    """The `TAG_PLUGINS` value of ``{distribution: version}``, sorted by name."""
    return ", ".join(f"{name}=={version}" for name, version in sorted(distributions.items()))


def read_plugins_tag(value: Any) -> list[str]:
    """The ``name==version`` items of a `TAG_PLUGINS` value (none for a missing or empty one)."""
    if not isinstance(value, str):
        return []
    return [item.strip() for item in value.split(",") if item.strip()]


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
