"""Read a study's runs from MLflow into one Arrow table (one row per finished cell).

The MLflow layout is the one written by `studies.tracking` (docs/interfaces.md, section 5):
one experiment per study, a parent run (tag `studies.role=parent`, artifact `study.yaml`)
and one child run per cell (tags `studies.*`, params = the flattened config plus `seed`,
metrics per epoch with `step=epoch`, `test/*`, `best_epoch`, `best_val` at the end,
artifact `per_class_test.parquet`).

Columns of `Collected.table` (one row per cell whose run has `studies.status=finished`):

- `run_id`, `cell_id`, `config_id`, `seed` (int64), `variant`,
  `swept` (the cell's swept parameters as canonical JSON text, `{}` when none),
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
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
import os
import tempfile
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

# MLflow's largest page for search_runs (mlflow.store.tracking.SEARCH_MAX_RESULTS_THRESHOLD).
MAX_PAGE_SIZE = 50_000

from analysis.layout import (  # noqa: E402  the MLflow layout written by studies.tracking
    PARENT_RUN_TAG,
    PER_CLASS_ARTIFACT,
    ROLE_CELL,
    ROLE_PARENT,
    STATUS_FINISHED,
    STATUS_RUNNING,
    STUDY_ARTIFACT,
    TAG_CELL_ID,
    TAG_CONFIG_ID,
    TAG_ERROR,
    TAG_ROLE,
    TAG_SEED,
    TAG_STATUS,
    TAG_STUDY,
    TAG_SWEPT,
    TAG_VARIANT,
)

PARAM_PREFIX = "param:"
MEAN_PREFIX = "mean:"

# Columns that identify a cell; everything else in the table is a parameter or a metric.
ID_COLUMNS = ("run_id", "cell_id", "config_id", "seed", "variant", "swept")


class CollectError(ValueError):
    """The tracking store does not hold the study asked for, or holds it in a broken layout."""


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

    @property
    def metric_columns(self) -> list[str]:
        fixed = set(ID_COLUMNS) | {"start_time", "end_time", "duration_s"}
        return [
            c for c in self.table.column_names
            if c not in fixed and not c.startswith(PARAM_PREFIX)
        ]


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


@contextlib.contextmanager
def _quiet_downloads() -> Iterator[None]:
    """No MLflow download progress bar (one per run would flood the terminal of a report)."""
    from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR

    name = MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.name
    previous = os.environ.get(name)
    os.environ[name] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _client(tracking_uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def search_all_runs(
    client, experiment_id: str, filter_string: str, page_size: int = MAX_PAGE_SIZE
) -> Iterator[Any]:
    """Every active run of the experiment that matches, page after page (page tokens)."""
    from mlflow.entities import ViewType

    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise ValueError(f"page_size must be in [1, {MAX_PAGE_SIZE}], got {page_size}")
    token = None
    while True:
        page = client.search_runs(
            [experiment_id], filter_string=filter_string, run_view_type=ViewType.ACTIVE_ONLY,
            max_results=page_size, order_by=["attributes.start_time ASC"], page_token=token,
        )
        yield from page
        token = page.token
        if not token:
            return


def _filter_for(tag: str, value: str) -> str:
    # dotted tag keys must be quoted with backticks in MLflow's filter syntax
    escaped = value.replace("'", "\\'")
    return f"tags.`{tag}` = '{escaped}'"


def _experiment(client, tracking_uri: str, study_name: str):
    experiment = client.get_experiment_by_name(study_name)
    if experiment is None:
        try:
            names = sorted(e.name for e in client.search_experiments(max_results=200))
        except Exception:  # listing is only for the message
            names = []
        listing = ", ".join(repr(n) for n in names[:30]) or "none"
        raise CollectError(
            f"no MLflow experiment named {study_name!r} at {display_uri(tracking_uri)} "
            f"(the study's `name` names its experiment); experiments there: {listing}"
        )
    return experiment


def _seed_of(run) -> int | None:
    raw = run.data.tags.get(TAG_SEED, run.data.params.get("seed"))
    if raw is None:
        return None
    try:
        return int(str(raw).strip())
    except ValueError as exc:
        raise CollectError(
            f"run {run.info.run_id}: tag {TAG_SEED} must be an integer, got {raw!r}"
        ) from exc


def _swept_of(run) -> dict:
    raw = run.data.tags.get(TAG_SWEPT)
    if not raw:
        return {}
    try:
        swept = json.loads(raw)
    except ValueError as exc:
        raise CollectError(
            f"run {run.info.run_id}: tag {TAG_SWEPT} must be a JSON object "
            f"(dotted path -> value), got {raw!r}"
        ) from exc
    if not isinstance(swept, dict):
        raise CollectError(
            f"run {run.info.run_id}: tag {TAG_SWEPT} must be a JSON object, got {raw!r}"
        )
    return swept


def _study_yaml(client, parent_run_id: str) -> str | None:
    """The parent run's `study.yaml`; else its only top-level YAML artifact; else None."""
    try:
        names = [a.path for a in client.list_artifacts(parent_run_id) if not a.is_dir]
    except Exception:  # no artifact store reachable: the report says the file is missing
        return None
    if STUDY_ARTIFACT not in names:
        yamls = [n for n in names if n.endswith((".yaml", ".yml"))]
        if len(yamls) != 1:
            return None
        names = yamls
    else:
        names = [STUDY_ARTIFACT]
    try:
        with tempfile.TemporaryDirectory() as tmp, _quiet_downloads():
            local = client.download_artifacts(parent_run_id, names[0], tmp)
            return Path(local).read_text(encoding="utf-8")
    except Exception:
        return None


def _fetch_histories(client, run_ids: Sequence[str], keys: Sequence[str]) -> dict:
    """{(run_id, key): [(epoch, value), ...] sorted by epoch} with a few parallel requests.

    Non-finite values are dropped; a step logged twice keeps its last value."""

    def one(job):
        run_id, key = job
        by_step: dict[int, float] = {}
        for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
            if m.value is not None and math.isfinite(m.value):
                by_step[int(m.step)] = float(m.value)
        return job, sorted(by_step.items())

    jobs = [(r, k) for r in run_ids for k in keys]
    if not jobs:
        return {}
    with ThreadPoolExecutor(max_workers=8) as pool:
        return dict(pool.map(one, jobs))


def _mean_histories(client, run_ids: Sequence[str], keys: Sequence[str]) -> dict:
    """{(run_id, key): mean over logged epochs (None when none)}."""
    return {job: (sum(v for _, v in points) / len(points) if points else None)
            for job, points in _fetch_histories(client, run_ids, keys).items()}


# ----------------------------------------------------------------------------- collect


def collect(
    tracking_uri: str,
    study_name: str,
    *,
    histories: Iterable[str] = (),
    page_size: int = MAX_PAGE_SIZE,
) -> Collected:
    """Read every cell run of the study `study_name` from the tracking store.

    `histories`: per-epoch metric keys whose mean over epochs is wanted (one extra request
    per run and key, so none by default). `page_size`: runs per search request (paged with
    MLflow page tokens, so a study of any size is read in one call).
    """
    client = _client(tracking_uri)
    experiment = _experiment(client, tracking_uri, study_name)
    experiment_id = experiment.experiment_id

    parents = list(search_all_runs(client, experiment_id, _filter_for(TAG_ROLE, ROLE_PARENT),
                                   page_size))
    parent = max(parents, key=lambda r: r.info.start_time or 0) if parents else None
    cells = list(search_all_runs(client, experiment_id, _filter_for(TAG_ROLE, ROLE_CELL),
                                 page_size))

    finished_by_cell: dict[str, list] = {}
    other_by_cell: dict[str, list] = {}
    for run in cells:
        tags = run.data.tags
        cell_id = tags.get(TAG_CELL_ID)
        if not cell_id:
            raise CollectError(
                f"run {run.info.run_id} in experiment {study_name!r} has "
                f"{TAG_ROLE}=cell but no {TAG_CELL_ID} tag (docs/interfaces.md section 5)"
            )
        target = finished_by_cell if tags.get(TAG_STATUS) == STATUS_FINISHED else other_by_cell
        target.setdefault(cell_id, []).append(run)

    def latest(runs):
        return max(runs, key=lambda r: (r.info.end_time or 0, r.info.start_time or 0))

    finished = [latest(runs) for runs in finished_by_cell.values()]
    finished.sort(key=lambda r: (r.data.tags.get(TAG_CONFIG_ID, ""), _seed_of(r) or 0))
    duplicates = sorted(c for c, runs in finished_by_cell.items() if len(runs) > 1)

    histories = list(dict.fromkeys(histories))
    means = _mean_histories(client, [r.info.run_id for r in finished], histories)
    table = _finished_table(finished, histories, means)

    unfinished = [latest(runs) for cell, runs in other_by_cell.items()
                  if cell not in finished_by_cell]
    unfinished.sort(key=lambda r: (r.data.tags.get(TAG_CONFIG_ID, ""), _seed_of(r) or 0))
    failed = _failed_table(unfinished)

    return Collected(
        table=table,
        failed=failed,
        study_name=study_name,
        tracking_uri=tracking_uri,
        experiment_id=experiment_id,
        parent_run_id=parent.info.run_id if parent else None,
        study_yaml=_study_yaml(client, parent.info.run_id) if parent else None,
        duplicate_cells=duplicates,
        n_runs=len(cells),
    )


def _identity(run) -> dict:
    tags = run.data.tags
    return {
        "run_id": run.info.run_id,
        "cell_id": tags.get(TAG_CELL_ID),
        "config_id": tags.get(TAG_CONFIG_ID),
        "seed": _seed_of(run),
        "variant": tags.get(TAG_VARIANT),
        "swept": canonical_json(_swept_of(run)),
    }


def _finished_table(runs: Sequence, histories: Sequence[str], means: dict) -> pa.Table:
    rows = []
    param_keys: dict[str, None] = {}
    metric_keys: dict[str, None] = {}
    for run in runs:
        params = {k: v for k, v in run.data.params.items() if k != "seed"}
        param_keys.update(dict.fromkeys(sorted(params)))
        metric_keys.update(dict.fromkeys(sorted(run.data.metrics)))
        start, end = run.info.start_time, run.info.end_time
        rows.append((run, params, start, end))

    columns: dict[str, pa.Array] = {}
    identities = [_identity(run) for run, *_ in rows]
    for name in ID_COLUMNS:
        values = [ident[name] for ident in identities]
        columns[name] = pa.array(values, type=pa.int64() if name == "seed" else pa.string())
    columns["start_time"] = pa.array([r[2] for r in rows], type=pa.int64())
    columns["end_time"] = pa.array([r[3] for r in rows], type=pa.int64())
    columns["duration_s"] = pa.array(
        [(e - s) / 1000.0 if s is not None and e is not None else None for _, _, s, e in rows],
        type=pa.float64(),
    )
    for key in sorted(param_keys):
        columns[PARAM_PREFIX + key] = typed_column(
            [parse_param_value(params.get(key)) for _, params, _, _ in rows]
        )
    for key in sorted(metric_keys):
        columns[key] = pa.array(
            [run.data.metrics.get(key) for run, *_ in rows], type=pa.float64()
        )
    for key in histories:
        columns[MEAN_PREFIX + key] = pa.array(
            [means.get((run.info.run_id, key)) for run, *_ in rows], type=pa.float64()
        )
    if not rows:
        return pa.table({name: pa.array([], type=arr.type) for name, arr in columns.items()})
    return pa.table(columns)


def _failed_table(runs: Sequence) -> pa.Table:
    records = []
    for run in runs:
        ident = _identity(run)
        tags = run.data.tags
        status = tags.get(TAG_STATUS) or "unknown"
        mlflow_status = run.info.status
        if status == STATUS_RUNNING:
            # a run still RUNNING in MLflow is in progress (or its worker vanished without
            # closing it); FAILED/KILLED means the worker died before tagging the cell.
            status = "unfinished"
        error = tags.get(TAG_ERROR)
        if error is None and status == "unfinished" and mlflow_status in {"FAILED", "KILLED"}:
            error = f"MLflow run status {mlflow_status} without a studies.error tag"
        records.append({
            **ident,
            "status": status,
            "mlflow_status": mlflow_status,
            "error": error,
            "start_time": run.info.start_time,
        })
    schema = pa.schema([
        ("run_id", pa.string()), ("cell_id", pa.string()), ("config_id", pa.string()),
        ("seed", pa.int64()), ("variant", pa.string()), ("swept", pa.string()),
        ("status", pa.string()), ("mlflow_status", pa.string()), ("error", pa.string()),
        ("start_time", pa.int64()),
    ])
    return pa.Table.from_pylist(records, schema=schema)


def add_history_means(collected: Collected, keys: Iterable[str]) -> Collected:
    """Append `mean:<key>` columns (mean over logged epochs) to `collected.table` in place."""
    keys = [k for k in dict.fromkeys(keys)
            if MEAN_PREFIX + k not in collected.table.column_names]
    if not keys or collected.table.num_rows == 0:
        return collected
    run_ids = collected.table.column("run_id").to_pylist()
    means = _mean_histories(_client(collected.tracking_uri), run_ids, keys)
    table = collected.table
    for key in keys:
        table = table.append_column(
            MEAN_PREFIX + key, pa.array([means.get((r, key)) for r in run_ids], pa.float64())
        )
    collected.table = table
    return collected


def collect_histories(collected: Collected, keys: Iterable[str]) -> pa.Table:
    """Per-epoch values of the metrics `keys` for every finished cell, as a long table.

    Columns: `run_id`, `config_id`, `seed`, `variant`, `swept`, `metric`, `epoch` (int64,
    the MLflow step), `value`. One request per run and key (the learning curves of the
    report); a run that never logged a key has no rows for it.
    """
    keys = list(dict.fromkeys(keys))
    rows = collected.table.select(["run_id", "config_id", "seed", "variant", "swept"]).to_pylist() \
        if collected.table.num_rows else []
    histories = _fetch_histories(_client(collected.tracking_uri), [r["run_id"] for r in rows], keys)
    records = [{**row, "metric": key, "epoch": epoch, "value": value}
               for row in rows for key in keys
               for epoch, value in histories.get((row["run_id"], key), [])]
    schema = pa.schema([("run_id", pa.string()), ("config_id", pa.string()), ("seed", pa.int64()),
                        ("variant", pa.string()), ("swept", pa.string()), ("metric", pa.string()),
                        ("epoch", pa.int64()), ("value", pa.float64())])
    return pa.Table.from_pylist(records, schema=schema)


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
    table = collected.table.replace_schema_metadata(
        {**(collected.table.schema.metadata or {}), **metadata}
    )
    pq.write_table(table, path)
    failed_path = path.with_name(path.stem + ".failed.parquet")
    pq.write_table(collected.failed.replace_schema_metadata(metadata), failed_path)
    return path


def collect_per_class(
    tracking_uri: str, run_ids: Iterable[str], artifact: str = PER_CLASS_ARTIFACT
) -> pa.Table:
    """The per-class test results of the given runs (or another Parquet artifact of theirs,
    such as `set_sizes_test.parquet`), concatenated, with a `run_id` column."""
    client = _client(tracking_uri)
    with tempfile.TemporaryDirectory() as tmp, _quiet_downloads():

        def one(job: tuple[int, str]) -> pa.Table:
            index, run_id = job
            local = client.download_artifacts(run_id, artifact, str(Path(tmp) / str(index)))
            table = pq.read_table(local)
            return table.append_column(
                "run_id", pa.array([run_id] * table.num_rows, type=pa.string())
            )

        with ThreadPoolExecutor(max_workers=8) as pool:  # one request per run: overlap them
            tables = list(pool.map(one, enumerate(run_ids)))
    if not tables:
        return pa.table({"run_id": pa.array([], type=pa.string())})
    return pa.concat_tables(tables, promote_options="permissive")
