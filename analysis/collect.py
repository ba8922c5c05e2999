"""Read a study's runs from MLflow into one Arrow table (one row per finished cell).

The MLflow layout is the one written by `studies.tracking` (docs/interfaces.md, section 5):
one experiment per study, a parent run (tag `studies.role=parent`, artifact `study.yaml`)
and one child run per cell (tags `studies.*`, params = the flattened config plus `seed`,
metrics per epoch with `step=epoch`, `test/*`, `best_epoch`, `best_val` at the end,
artifact `per_class_test.parquet`).

Columns of `Collected.table` (one row per cell whose run has `studies.status=finished`):

- `run_id`, `cell_id`, `config_id`, `seed` (int64), `variant`,
  `swept` (the cell's swept parameters as canonical JSON text, `{}` when none),
  `stopped_epoch` (int64: the epochs done when a config-level rule stopped its config, null
  when it ran every epoch), `pruned` (the rule that pruned its config, `asha` or `optuna`;
  null when not pruned: early stopping is not pruning),
  `start_time`, `end_time` (ms since the epoch), `duration_s`;
- `param:<dotted path>`: every parameter of the flattened trial config, typed (bool, int64,
  float64 or string; lists and dicts as JSON text). MLflow stores params as strings; they are
  parsed back with JSON, then Python-literal syntax (`True`, `None`, `[150, 225]`);
- one column per MLflow metric key, named by the key itself (`test/top5`, `test/few/top5`,
  `best_epoch`, `best_val`, ...). For the per-epoch metrics (`val/top5`, `train/loss`,
  `epoch_time_s`, ...) this is the value of the last logged epoch (MLflow's latest value);
- `mean:<metric>`: the mean over epochs of a per-epoch metric, for every metric named in
  `collect(..., histories=[...])` (e.g. `mean:epoch_time_s` for the epoch-time figure).

`Collected.failed` lists the cells that have no finished run: failed cells
(`studies.status=failed`, with `studies.error`) and unfinished ones (`running`, including runs
that MLflow marks FAILED/KILLED because the worker died before it could tag them).

How the runs are read (`bulk=True`, the default; `bulk=False` keeps the reference path of one
`search_runs` page stream and one `get_metric_history` request per run and key):

- an SQL tracking store (`sqlite:///...`, `postgresql://...`, the embedded default) is read
  with one query per table (runs, tags, params, latest metrics) for the whole study, built
  from MLflow's own table definitions (`mlflow.store.tracking.dbmodels.models`), and one query
  per study and metric key for per-epoch histories; MLflow's `search_runs` builds an ORM
  object per tag, param and metric of every run (about 3 ms per run of 150 values);
- an MLflow server is searched with `search_runs` pages, and its histories are read with the
  REST endpoint `GET /api/2.0/mlflow/metrics/get-history-bulk-interval` (100 runs per
  request; a run with as many points as the page holds is read again with
  `get_metric_history`, so nothing is sampled); a server without that endpoint is read run by
  run.
Both paths return the same values (tests/test_collect.py compares them).
"""

from __future__ import annotations

import ast
import json
import tempfile
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from analysis.collect_store import (
    MAX_PAGE_SIZE,
    REST_BULK_POINTS,
    CollectError,
    RunRecord,
    collect_per_class,
    fetch_histories,
    mean_histories,
    quiet_downloads,
    read_artifact_table,
    search_all_runs,
    study_runs,
    tracking_client,
)
from analysis.distinct import VERSION_COLUMN, tell_apart
from analysis.layout import (
    ROLE_CELL,
    ROLE_PARENT,
    STATUS_FINISHED,
    STATUS_RUNNING,
    STUDY_ARTIFACT,
    TAG_CELL_ID,
    TAG_CONFIG_ID,
    TAG_ERROR,
    TAG_PLUGINS,
    TAG_PRUNED,
    TAG_RACE,
    TAG_ROLE,
    TAG_SEED,
    TAG_STATUS,
    TAG_STOP_REASON,
    TAG_STOPPED_EPOCH,
    TAG_SWEPT,
    TAG_VARIANT,
    TAG_VERSION,
    cell_runs_view_tag,
    read_plugins_tag,
)
from analysis.run_provenance import CellsProvenance

__all__ = [
    "CollectError",
    "MAX_PAGE_SIZE",
    "REST_BULK_POINTS",
    "RunRecord",
    "collect_per_class",
    "read_artifact_table",
    "search_all_runs",
    "study_runs",
    "PARAM_PREFIX",
    "MEAN_PREFIX",
    "ID_COLUMNS",
    "RACE_COLUMN",
    "SCHEDULE_COLUMNS",
    "Collected",
    "display_uri",
    "parse_param_value",
    "typed_column",
    "canonical_json",
    "collect",
    "add_history_means",
    "HISTORY_SCHEMA",
    "collect_histories",
    "export_parquet",
]

PARAM_PREFIX = "param:"
MEAN_PREFIX = "mean:"

# Columns that identify a cell; everything else in the table is a parameter or a metric.
ID_COLUMNS = ("run_id", "cell_id", "config_id", "seed", "variant", "swept")
#: column of a racing study's final decision about a config (`TAG_RACE`, JSON), on the row of
#: the config's last finished seed; present only when some run has one
RACE_COLUMN = "race"
# Columns that say how a config-level rule stopped the cell (tags studies.stopped_epoch and
# studies.pruned); not metrics either.
SCHEDULE_COLUMNS = ("stopped_epoch", "pruned")


@dataclass
class Collected:
    """What `collect` read: finished cells, failed/unfinished cells, and where they came from."""

    table: pa.Table
    failed: pa.Table
    study_name: str
    tracking_uri: str
    experiment_id: str
    parent_run_id: str | None = None
    study_yaml: str | None = None
    # cell_ids with more than one finished run (the latest finished run is kept in `table`)
    duplicate_cells: list[str] = field(default_factory=list)
    n_runs: int = 0
    #: the experiment holds the MLflow UI's view of the cell runs (`layout.cell_runs_view_tag`)
    ui_view: bool = False
    #: the plugin distributions the finished cells used, ``name==version`` (`TAG_PLUGINS`), sorted
    plugins: list[str] = field(default_factory=list)
    #: what trained the finished cells: environments, identities, cells kept knowingly
    provenance: CellsProvenance = field(default_factory=CellsProvenance)

    @property
    def metric_columns(self) -> list[str]:
        fixed = (
            set(ID_COLUMNS)
            | set(SCHEDULE_COLUMNS)
            | {"start_time", "end_time", "duration_s", RACE_COLUMN, VERSION_COLUMN}
        )
        return [c for c in self.table.column_names if c not in fixed and not c.startswith(PARAM_PREFIX)]


# ----------------------------------------------------------------------------- helpers


def display_uri(uri: str) -> str:
    """The tracking URI without a password (safe to print in a report)."""
    parts = urllib.parse.urlsplit(uri)
    if parts.password is None:
        return uri
    netloc = parts.hostname or ""
    if parts.username:
        netloc = f"{parts.username}:***@{netloc}"
    if parts.port:
        netloc = f"{netloc}:{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def parse_param_value(text: str | None) -> Any:
    """An MLflow param string back to a Python value (JSON, then Python literal, else text)."""
    if text is None:
        return None
    stripped = text.strip()
    try:
        return json.loads(stripped)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(stripped)
        if isinstance(value, (bool, int, float, str, list, tuple, dict, type(None))):
            return list(value) if isinstance(value, tuple) else value
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        pass
    lowered = stripped.lower()
    if lowered in {"inf", "+inf", "-inf", "nan"}:
        return float(lowered)
    return text


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def typed_column(values: Sequence[Any]) -> pa.Array:
    """One Arrow array with the narrowest type that holds every non-null value."""
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return pa.array(values, type=pa.bool_())
    if present and all(_is_int(v) for v in present):
        return pa.array(values, type=pa.int64())
    if present and all(_is_int(v) or isinstance(v, float) for v in present):
        return pa.array([None if v is None else float(v) for v in values], type=pa.float64())
    as_text = []
    for v in values:
        if v is None or isinstance(v, str):
            as_text.append(v)
        else:
            as_text.append(json.dumps(v, sort_keys=True))
    return pa.array(as_text, type=pa.string())


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _experiment(client, tracking_uri: str, study_name: str):
    experiment = client.get_experiment_by_name(study_name)
    if experiment is None:
        try:
            names = sorted(e.name for e in client.search_experiments(max_results=200))
        except Exception:  # noqa: BLE001 (listing is only for the message)
            names = []
        listing = ", ".join(repr(n) for n in names[:30]) or "none"
        raise CollectError(
            f"no MLflow experiment named {study_name!r} at {display_uri(tracking_uri)} "
            f"(the study's `name` names its experiment); experiments there: {listing}"
        )
    return experiment


def _seed_of(run: RunRecord) -> int | None:
    raw = run.tags.get(TAG_SEED, run.params.get("seed"))
    if raw is None:
        return None
    try:
        return int(str(raw).strip())
    except ValueError as exc:
        raise CollectError(f"run {run.run_id}: tag {TAG_SEED} must be an integer, got {raw!r}") from exc


def _swept_of(run: RunRecord) -> dict:
    raw = run.tags.get(TAG_SWEPT)
    if not raw:
        return {}
    try:
        swept = json.loads(raw)
    except ValueError as exc:
        raise CollectError(
            f"run {run.run_id}: tag {TAG_SWEPT} must be a JSON object (dotted path -> value), got {raw!r}"
        ) from exc
    if not isinstance(swept, dict):
        raise CollectError(f"run {run.run_id}: tag {TAG_SWEPT} must be a JSON object, got {raw!r}")
    return swept


def _study_yaml(client, parent_run_id: str) -> str | None:
    """The parent run's `study.yaml`; else its only top-level YAML artifact; else None."""
    try:
        names = [a.path for a in client.list_artifacts(parent_run_id) if not a.is_dir]
    except Exception:  # noqa: BLE001 (no artifact store reachable: the report says the file is missing)
        return None
    if STUDY_ARTIFACT not in names:
        yamls = [n for n in names if n.endswith((".yaml", ".yml"))]
        if len(yamls) != 1:
            return None
        names = yamls
    else:
        names = [STUDY_ARTIFACT]
    try:
        with tempfile.TemporaryDirectory() as tmp, quiet_downloads():
            local = client.download_artifacts(parent_run_id, names[0], tmp)
            return Path(local).read_text(encoding="utf-8")
    except Exception:  # noqa: BLE001 (no study file artifact: the report goes on without it)
        return None


# ----------------------------------------------------------------------------- reading runs


# ----------------------------------------------------------------------------- collect


def collect(
    tracking_uri: str,
    study_name: str,
    *,
    histories: Iterable[str] = (),
    page_size: int = MAX_PAGE_SIZE,
    bulk: bool = True,
) -> Collected:
    """Read every cell run of the study `study_name` from the tracking store.

    `histories`: per-epoch metric keys whose mean over epochs is wanted (none by default).
    `page_size`: runs per search request when the store is searched with `search_runs`
    (paged with MLflow page tokens, so a study of any size is read in one call). `bulk`:
    read an SQL store's tables and histories in bulk (module docstring); False searches
    page by page and reads one history per request (the reference path).
    """
    client = tracking_client(tracking_uri)
    experiment = _experiment(client, tracking_uri, study_name)
    experiment_id = experiment.experiment_id

    parents = study_runs(client, experiment_id, {TAG_ROLE: ROLE_PARENT}, page_size=page_size, bulk=bulk)
    parent = max(parents, key=lambda r: r.start_time or 0) if parents else None
    cells = study_runs(client, experiment_id, {TAG_ROLE: ROLE_CELL}, page_size=page_size, bulk=bulk)

    finished_by_cell: dict[str, list] = {}
    other_by_cell: dict[str, list] = {}
    for run in cells:
        tags = run.tags
        cell_id = tags.get(TAG_CELL_ID)
        if not cell_id:
            raise CollectError(
                f"run {run.run_id} in experiment {study_name!r} has "
                f"{TAG_ROLE}=cell but no {TAG_CELL_ID} tag (docs/interfaces.md section 5)"
            )
        target = finished_by_cell if tags.get(TAG_STATUS) == STATUS_FINISHED else other_by_cell
        target.setdefault(cell_id, []).append(run)

    def latest(runs):
        return max(runs, key=lambda r: (r.end_time or 0, r.start_time or 0))

    finished = [latest(runs) for runs in finished_by_cell.values()]
    finished.sort(key=lambda r: (r.tags.get(TAG_CONFIG_ID, ""), _seed_of(r) or 0))
    duplicates = sorted(c for c, runs in finished_by_cell.items() if len(runs) > 1)

    histories = list(dict.fromkeys(histories))
    means = mean_histories(client, [r.run_id for r in finished], histories, experiment_id, bulk)
    table = tell_apart(_finished_table(finished, histories, means))  # analysis.distinct

    unfinished = [latest(runs) for cell, runs in other_by_cell.items() if cell not in finished_by_cell]
    unfinished.sort(key=lambda r: (r.tags.get(TAG_CONFIG_ID, ""), _seed_of(r) or 0))
    failed = _failed_table(unfinished)

    return Collected(
        table=table,
        failed=failed,
        study_name=study_name,
        tracking_uri=tracking_uri,
        experiment_id=experiment_id,
        parent_run_id=parent.run_id if parent else None,
        study_yaml=_study_yaml(client, parent.run_id) if parent else None,
        duplicate_cells=duplicates,
        n_runs=len(cells),
        ui_view=cell_runs_view_tag()[0] in (experiment.tags or {}),
        plugins=sorted({item for run in finished for item in read_plugins_tag(run.tags.get(TAG_PLUGINS))}),
        provenance=CellsProvenance.of((run.tags for run in finished), parent.tags if parent else None),
    )


def _identity(run: RunRecord) -> dict:
    tags = run.tags
    return {
        "run_id": run.run_id,
        "cell_id": tags.get(TAG_CELL_ID),
        "config_id": tags.get(TAG_CONFIG_ID),
        "seed": _seed_of(run),
        "variant": tags.get(TAG_VARIANT),
        "swept": canonical_json(_swept_of(run)),
    }


def _finished_table(runs: Sequence[RunRecord], histories: Sequence[str], means: dict) -> pa.Table:
    param_keys: dict[str, None] = {}
    metric_keys: dict[str, None] = {}
    for run in runs:
        param_keys.update(dict.fromkeys(k for k in run.params if k != "seed"))
        metric_keys.update(dict.fromkeys(run.metrics))

    columns: dict[str, pa.Array] = {}
    identities = [_identity(run) for run in runs]
    for name in ID_COLUMNS:
        values = [ident[name] for ident in identities]
        columns[name] = pa.array(values, type=pa.int64() if name == "seed" else pa.string())
    columns["stopped_epoch"] = pa.array([_int_or_none(r.tags.get(TAG_STOPPED_EPOCH)) for r in runs], type=pa.int64())
    columns["pruned"] = pa.array([r.tags.get(TAG_PRUNED) or None for r in runs], type=pa.string())
    columns["start_time"] = pa.array([r.start_time for r in runs], type=pa.int64())
    columns["end_time"] = pa.array([r.end_time for r in runs], type=pa.int64())
    columns["duration_s"] = pa.array(
        [
            (r.end_time - r.start_time) / 1000.0 if r.start_time is not None and r.end_time is not None else None
            for r in runs
        ],
        type=pa.float64(),
    )
    if any(TAG_VERSION in r.tags for r in runs):  # the study's version that made each run
        columns[VERSION_COLUMN] = pa.array([r.tags.get(TAG_VERSION) for r in runs], pa.string())
    if any(TAG_RACE in r.tags for r in runs):
        columns[RACE_COLUMN] = pa.array([r.tags.get(TAG_RACE) for r in runs], type=pa.string())
    parsed: dict[str, Any] = {}  # params repeat across runs: parse each text once

    def parse(text: str | None) -> Any:
        if text is None:
            return None
        if text not in parsed:
            parsed[text] = parse_param_value(text)
        value = parsed[text]
        return list(value) if isinstance(value, list) else value

    for key in sorted(param_keys):
        columns[PARAM_PREFIX + key] = typed_column([parse(r.params.get(key)) for r in runs])
    for key in sorted(metric_keys):
        columns[key] = pa.array([r.metrics.get(key) for r in runs], type=pa.float64())
    for key in histories:
        columns[MEAN_PREFIX + key] = pa.array([means.get((r.run_id, key)) for r in runs], type=pa.float64())
    if not runs:
        return pa.table({name: pa.array([], type=arr.type) for name, arr in columns.items()})
    return pa.table(columns)


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text else None
    except ValueError:
        return None


def _failed_table(runs: Sequence[RunRecord]) -> pa.Table:
    records = []
    for run in runs:
        ident = _identity(run)
        tags = run.tags
        status = tags.get(TAG_STATUS) or "unknown"
        mlflow_status = run.status
        if status == STATUS_RUNNING:
            # a run still RUNNING in MLflow is in progress (or its worker vanished without
            # closing it); FAILED/KILLED means the worker died before tagging the cell.
            status = "unfinished"
        error = tags.get(TAG_ERROR) or tags.get(TAG_STOP_REASON)  # a signal stopped its driver
        if error is None and status == "unfinished" and mlflow_status in {"FAILED", "KILLED"}:
            error = f"MLflow run status {mlflow_status} without a studies.error tag"
        records.append(
            {
                **ident,
                "status": status,
                "mlflow_status": mlflow_status,
                "error": error,
                "start_time": run.start_time,
            }
        )
    schema = pa.schema(
        [
            ("run_id", pa.string()),
            ("cell_id", pa.string()),
            ("config_id", pa.string()),
            ("seed", pa.int64()),
            ("variant", pa.string()),
            ("swept", pa.string()),
            ("status", pa.string()),
            ("mlflow_status", pa.string()),
            ("error", pa.string()),
            ("start_time", pa.int64()),
        ]
    )
    return pa.Table.from_pylist(records, schema=schema)


def add_history_means(collected: Collected, keys: Iterable[str], *, bulk: bool = True) -> Collected:
    """Append `mean:<key>` columns (mean over logged epochs) to `collected.table` in place."""
    keys = [k for k in dict.fromkeys(keys) if MEAN_PREFIX + k not in collected.table.column_names]
    if not keys or collected.table.num_rows == 0:
        return collected
    run_ids = collected.table.column("run_id").to_pylist()
    means = mean_histories(tracking_client(collected.tracking_uri), run_ids, keys, collected.experiment_id, bulk)
    table = collected.table
    for key in keys:
        table = table.append_column(MEAN_PREFIX + key, pa.array([means.get((r, key)) for r in run_ids], pa.float64()))
    collected.table = table
    return collected


HISTORY_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("config_id", pa.string()),
        ("seed", pa.int64()),
        ("variant", pa.string()),
        ("swept", pa.string()),
        ("metric", pa.string()),
        ("epoch", pa.int64()),
        ("value", pa.float64()),
    ]
)


def collect_histories(
    collected: Collected, keys: Iterable[str], *, bulk: bool = True, run_ids: Iterable[str] | None = None
) -> pa.Table:
    """Per-epoch values of the metrics `keys` for every finished cell, as a long table.

    Columns: `run_id`, `config_id`, `seed`, `variant`, `swept`, `metric`, `epoch` (int64,
    the MLflow step), `value`. A run that never logged a key has no rows for it. `run_ids`:
    only these runs (default: every finished cell). `bulk`: see `collect`.
    """
    keys = list(dict.fromkeys(keys))
    table = collected.table
    if run_ids is not None and table.num_rows:
        import pyarrow.compute as pc

        table = table.filter(pc.is_in(table.column("run_id"), value_set=pa.array(list(run_ids), pa.string())))
    rows = table.select(["run_id", "config_id", "seed", "variant", "swept"]).to_pylist() if table.num_rows else []
    histories = fetch_histories(
        tracking_client(collected.tracking_uri), [r["run_id"] for r in rows], keys, collected.experiment_id, bulk
    )
    columns: dict[str, list] = {name: [] for name in HISTORY_SCHEMA.names}
    for row in rows:
        for key in keys:
            points = histories.get((row["run_id"], key), [])
            for epoch, value in points:
                for name in ("run_id", "config_id", "seed", "variant", "swept"):
                    columns[name].append(row[name])
                columns["metric"].append(key)
                columns["epoch"].append(epoch)
                columns["value"].append(value)
    return pa.table(
        {name: pa.array(values, type=HISTORY_SCHEMA.field(name).type) for name, values in columns.items()},
        schema=HISTORY_SCHEMA,
    )


# ----------------------------------------------------------------------------- export


def export_parquet(collected: Collected, path: str | Path) -> Path:
    """Write the finished cells to `path` (Parquet) and the failed ones beside it.

    The failed/unfinished cells go to `<stem>.failed.parquet` so that nothing is dropped
    silently; the study name, experiment and tracking location are stored in the file's
    key-value metadata.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        b"studies.study": collected.study_name.encode(),
        b"studies.tracking_uri": display_uri(collected.tracking_uri).encode(),
        b"studies.experiment_id": str(collected.experiment_id).encode(),
        b"studies.parent_run_id": (collected.parent_run_id or "").encode(),
    }
    table = collected.table.replace_schema_metadata({**(collected.table.schema.metadata or {}), **metadata})
    pq.write_table(table, path)
    failed_path = path.with_name(path.stem + ".failed.parquet")
    pq.write_table(collected.failed.replace_schema_metadata(metadata), failed_path)
    return path
