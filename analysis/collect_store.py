"""Reading a study out of MLflow for `analysis.collect`: its runs and per-epoch histories from
an SQL tracking store with one query per table, or from a server by `search_runs` pages and
the bulk history endpoint (the two paths return the same values); artifact tables, bounded.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from analysis.layout import (
    PER_CLASS_ARTIFACT,
    tag_filter,
)

# MLflow's largest page for search_runs (mlflow.store.tracking.SEARCH_MAX_RESULTS_THRESHOLD).
MAX_PAGE_SIZE = 50_000
#: bounds on one run's Parquet artifact (a row per class, or per K, shot and set size: 1,000,000
#: classes fit), checked from the file's size and its Parquet footer before any row is read
MAX_ARTIFACT_ROWS = 1_000_000
MAX_ARTIFACT_BYTES = 64 * 1024 * 1024


class CollectError(ValueError):
    """The tracking store does not hold the study asked for, or holds it in a broken layout."""


@contextlib.contextmanager
def quiet_downloads() -> Iterator[None]:
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


def tracking_client(tracking_uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def search_all_runs(
    client,
    experiment_id: str,
    filter_string: str,
    page_size: int = MAX_PAGE_SIZE,
    call: Callable[[Callable[[], Any]], Any] | None = None,
) -> Iterator[Any]:
    """Every active run of the experiment that matches, oldest first, page after page (page
    tokens). `call(request)` makes each page's request (e.g. a retry wrapper); default: once."""
    from mlflow.entities import ViewType

    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise ValueError(f"page_size must be in [1, {MAX_PAGE_SIZE}], got {page_size}")
    token = None
    while True:

        def request(token=token):
            return client.search_runs(
                [experiment_id],
                filter_string=filter_string,
                run_view_type=ViewType.ACTIVE_ONLY,
                max_results=page_size,
                order_by=["attributes.start_time ASC"],
                page_token=token,
            )

        page = call(request) if call is not None else request()
        yield from page
        token = page.token
        if not token:
            return


@dataclass
class RunRecord:
    """One run as `collect` needs it, whichever way it was read."""

    run_id: str
    status: str | None
    start_time: int | None
    end_time: int | None
    tags: dict[str, str]
    params: dict[str, str]
    metrics: dict[str, float]

    @classmethod
    def of(cls, run) -> RunRecord:
        """From an `mlflow.entities.Run` (what `search_runs` returns)."""
        return cls(
            run.info.run_id,
            run.info.status,
            run.info.start_time,
            run.info.end_time,
            dict(run.data.tags),
            dict(run.data.params),
            dict(run.data.metrics),
        )


def _sql_store(client):
    """The client's SQL tracking store (SqlAlchemyStore), or None for any other store.

    `MlflowClient` keeps its store in `_tracking_client.store`; the bulk reads below use the
    store's own engine (its connection pool and, for SQLite, its settings)."""
    try:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        store = client._tracking_client.store
    except Exception:  # noqa: BLE001 (another MLflow layout, or a store that cannot be built)
        return None
    return store if isinstance(store, SqlAlchemyStore) and hasattr(store, "engine") else None


def _tables():
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric, SqlParam, SqlRun, SqlTag

    return (SqlRun.__table__, SqlTag.__table__, SqlParam.__table__, SqlLatestMetric.__table__, SqlMetric.__table__)


def _sql_study_runs(
    store, experiment_id: str, tags: Mapping[str, str], *, params: bool = True, metrics: Sequence[str] | None = None
) -> list[RunRecord]:
    """The active runs of the experiment with these tag values: one query per table (runs,
    then their tags, params and latest metrics), what `search_runs` returns for the same
    filter; `params=False` skips the params, `metrics` keeps only those latest metrics."""
    from sqlalchemy import and_, select

    runs, tag_table, param_table, latest, _ = _tables()
    wanted = and_(runs.c.experiment_id == int(experiment_id), runs.c.lifecycle_stage == "active")
    for key, value in tags.items():
        wanted = and_(
            wanted,
            runs.c.run_uuid.in_(
                select(tag_table.c.run_uuid).where(and_(tag_table.c.key == key, tag_table.c.value == str(value)))
            ),
        )
    ids = select(runs.c.run_uuid).where(wanted).scalar_subquery()
    intern = sys.intern  # one str object per distinct key: 10,000 runs share them

    def rows(conn, statement):
        return _raw_rows(conn, statement)

    with store.engine.connect() as conn:
        records = {
            run_id: RunRecord(run_id, status, start, end, {}, {}, {})
            for run_id, status, start, end in rows(
                conn,
                select(runs.c.run_uuid, runs.c.status, runs.c.start_time, runs.c.end_time)
                .where(wanted)
                .order_by(runs.c.start_time, runs.c.run_uuid),
            )
        }
        for run_id, key, value in rows(
            conn, select(tag_table.c.run_uuid, tag_table.c.key, tag_table.c.value).where(tag_table.c.run_uuid.in_(ids))
        ):
            records[run_id].tags[intern(key)] = value
        if params:
            for run_id, key, value in rows(
                conn,
                select(param_table.c.run_uuid, param_table.c.key, param_table.c.value).where(
                    param_table.c.run_uuid.in_(ids)
                ),
            ):
                records[run_id].params[intern(key)] = value
        if metrics is None or metrics:
            which = latest.c.run_uuid.in_(ids)
            if metrics is not None:
                which = and_(which, latest.c.key.in_(list(metrics)))
            for run_id, key, value, is_nan in rows(
                conn, select(latest.c.run_uuid, latest.c.key, latest.c.value, latest.c.is_nan).where(which)
            ):
                records[run_id].metrics[intern(key)] = math.nan if is_nan else float(value)
    return list(records.values())


def _raw_rows(conn, statement, block: int = 50_000) -> Iterator[tuple]:
    """The rows of a SQLAlchemy `select` as plain tuples, fetched with the DBAPI cursor in
    blocks of `block` rows.

    The statement is compiled for the store's dialect with its values inlined (they are an
    experiment id, a tag name and value, a metric key: quoted by SQLAlchemy's compiler). A
    study of 10,000 runs has about a million tag, param and metric rows: SQLAlchemy's `Row`
    objects and per-row result processing would cost four times the query itself."""
    sql = str(statement.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True}))
    cursor = conn.connection.dbapi_connection.cursor()
    try:
        cursor.execute(sql)
        while True:
            rows = cursor.fetchmany(block)
            if not rows:
                return
            yield from rows
    finally:
        cursor.close()


def study_runs(
    client,
    experiment_id: str,
    tags: Mapping[str, str],
    *,
    params: bool = True,
    metrics: Sequence[str] | None = None,
    page_size: int = MAX_PAGE_SIZE,
    bulk: bool = True,
) -> list[RunRecord]:
    """The active runs of the experiment with these tag values, oldest first, as `RunRecord`s;
    `params=False` leaves their params out and `metrics` keeps only those latest metrics (the
    cell ledger of `studies.tracking` needs tags alone: at 10,000 runs MLflow `Run` objects
    would hold every metric and param). Bulk SQL on an SQL store (see the module docstring),
    else `search_runs` pages of `page_size` runs."""
    store = _sql_store(client) if bulk else None
    if store is not None:
        return _sql_study_runs(store, experiment_id, tags, params=params, metrics=metrics)
    records = []
    for run in search_all_runs(client, experiment_id, tag_filter(tags), page_size):
        record = RunRecord.of(run)
        if not params:
            record.params = {}
        if metrics is not None:
            record.metrics = {k: record.metrics[k] for k in metrics if k in record.metrics}
        records.append(record)
    return records


def _history_points(points: Iterable[tuple[int, int, float | None]]) -> list[tuple[int, float]]:
    """(step, timestamp, value) points of one run and key -> [(epoch, value)] by epoch.

    Points are taken in the order MLflow returns a history (timestamp, step, value); a step
    logged twice keeps its last value; non-finite values are dropped."""
    by_step: dict[int, float] = {}
    for step, _, value in sorted(points, key=lambda p: (p[1], p[0], _value_key(p[2]))):
        if value is not None and math.isfinite(value):
            by_step[int(step)] = float(value)
    return sorted(by_step.items())


def _value_key(value: float | None) -> float:
    return -math.inf if value is None or math.isnan(value) else value


def _histories_per_run(client, run_ids: Sequence[str], keys: Sequence[str]) -> dict:
    """The reference path: one `get_metric_history` request per run and key (8 at a time)."""

    def one(job):
        run_id, key = job
        return job, _history_points((m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, key))

    jobs = [(r, k) for r in run_ids for k in keys]
    if not jobs:
        return {}
    with ThreadPoolExecutor(max_workers=8) as pool:
        return dict(pool.map(one, jobs))


def _histories_sql(store, experiment_id: str, run_ids: Sequence[str], keys: Sequence[str]) -> dict:
    """One query per key for the whole study (the experiment's active runs)."""
    from sqlalchemy import and_, select

    runs, _, _, _, metrics = _tables()
    wanted = set(run_ids)
    ids = (
        select(runs.c.run_uuid)
        .where(and_(runs.c.experiment_id == int(experiment_id), runs.c.lifecycle_stage == "active"))
        .scalar_subquery()
    )
    out: dict = {}
    with store.engine.connect() as conn:
        for key in keys:
            points: dict[str, list] = {r: [] for r in run_ids}
            for run_id, step, timestamp, value, is_nan in _raw_rows(
                conn,
                select(
                    metrics.c.run_uuid, metrics.c.step, metrics.c.timestamp, metrics.c.value, metrics.c.is_nan
                ).where(and_(metrics.c.key == key, metrics.c.run_uuid.in_(ids))),
            ):
                if run_id in wanted:
                    points[run_id].append((step, timestamp, math.nan if is_nan else float(value)))
            for run_id, run_points in points.items():
                out[(run_id, key)] = _history_points(run_points)
    return out


#: The REST bulk endpoint's limits (mlflow.server.handlers: MAX_RUNS_GET_METRIC_HISTORY_BULK,
#: MAX_RESULTS_PER_RUN); a run with that many points may have been sampled.
REST_BULK_RUNS = 100
REST_BULK_POINTS = 2500
REST_BULK_ENDPOINT = "/api/2.0/mlflow/metrics/get-history-bulk-interval"


def _histories_rest(client, store, run_ids: Sequence[str], keys: Sequence[str]) -> dict:
    """`GET get-history-bulk-interval`: the histories of 100 runs per request."""
    from mlflow.utils.rest_utils import http_request, verify_rest_response

    def one(job):
        chunk, key = job
        response = http_request(
            store.get_host_creds(),
            REST_BULK_ENDPOINT,
            "GET",
            params={"run_ids": list(chunk), "metric_key": key, "max_results": REST_BULK_POINTS},
        )
        verify_rest_response(response, REST_BULK_ENDPOINT)
        points: dict[str, list] = {r: [] for r in chunk}
        for m in response.json().get("metrics", []):
            value = m.get("value", 0.0)
            points.setdefault(m["run_id"], []).append(
                (int(m.get("step", 0)), int(m.get("timestamp", 0)), float(value) if value is not None else None)
            )
        return key, points

    jobs = [(run_ids[i : i + REST_BULK_RUNS], k) for k in keys for i in range(0, len(run_ids), REST_BULK_RUNS)]
    out: dict = {}
    again = []
    with ThreadPoolExecutor(max_workers=4) as pool:
        for key, points in pool.map(one, jobs):
            for run_id, run_points in points.items():
                if len(run_points) >= REST_BULK_POINTS:
                    again.append(run_id)  # may be sampled: read it whole
                    continue
                out[(run_id, key)] = _history_points(run_points)
    if again:
        out.update(_histories_per_run(client, sorted(set(again)), keys))
    return out


def fetch_histories(
    client, run_ids: Sequence[str], keys: Sequence[str], experiment_id: str | None = None, bulk: bool = True
) -> dict:
    """{(run_id, key): [(epoch, value), ...] sorted by epoch} for every run and key.

    Non-finite values are dropped; a step logged twice keeps its last value. `bulk`: one
    query per key (SQL store), 100 runs per request (server); else one request per run and
    key."""
    run_ids, keys = list(run_ids), list(keys)
    if not run_ids or not keys:
        return {}
    if bulk:
        store = _sql_store(client)
        if store is not None and experiment_id is not None:
            return _histories_sql(store, experiment_id, run_ids, keys)
        from mlflow.store.tracking.rest_store import RestStore

        rest = getattr(getattr(client, "_tracking_client", None), "store", None)
        if isinstance(rest, RestStore):
            try:
                return _histories_rest(client, rest, run_ids, keys)
            except Exception:  # noqa: BLE001 (an older server without the endpoint: run by run)
                pass
    return _histories_per_run(client, run_ids, keys)


def mean_histories(
    client, run_ids: Sequence[str], keys: Sequence[str], experiment_id: str | None = None, bulk: bool = True
) -> dict:
    """{(run_id, key): mean over logged epochs (None when none)}."""
    histories = fetch_histories(client, run_ids, keys, experiment_id, bulk)
    return {job: (sum(v for _, v in points) / len(points) if points else None) for job, points in histories.items()}


def read_artifact_table(local: str | Path, what: str) -> pa.Table:
    """A run's Parquet artifact, read only when it is a regular file within
    MAX_ARTIFACT_BYTES whose footer says at most MAX_ARTIFACT_ROWS rows (CollectError naming
    it otherwise): a folder in its place would be read as a data set of some seeds' files, a
    small file of millions of rows would take minutes and gigabytes."""
    path = Path(local)
    if not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file"
        raise CollectError(f"{what} is {kind}; expected one Parquet file written by the trial")
    size = path.stat().st_size
    if size > MAX_ARTIFACT_BYTES:
        raise CollectError(f"{what} is {size:,} bytes; expected a Parquet file of at most {MAX_ARTIFACT_BYTES:,} bytes")
    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError) as error:
        raise CollectError(
            f"{what} is not a readable Parquet file ({error}); expected the table the trial wrote"
        ) from None
    if rows > MAX_ARTIFACT_ROWS:
        raise CollectError(f"{what} has {rows:,} rows; expected at most {MAX_ARTIFACT_ROWS:,} (one per class)")
    return pq.read_table(path)


def collect_per_class(tracking_uri: str, run_ids: Iterable[str], artifact: str = PER_CLASS_ARTIFACT) -> pa.Table:
    """The per-class test results of the given runs (or another Parquet artifact of theirs,
    such as `set_sizes_test.parquet`), concatenated, with a `run_id` column."""
    client = tracking_client(tracking_uri)
    with tempfile.TemporaryDirectory() as tmp, quiet_downloads():

        def one(job: tuple[int, str]) -> pa.Table:
            index, run_id = job
            local = client.download_artifacts(run_id, artifact, str(Path(tmp) / str(index)))
            table = read_artifact_table(local, f"artifact {artifact} of run {run_id}")
            return table.append_column("run_id", pa.array([run_id] * table.num_rows, type=pa.string()))

        with ThreadPoolExecutor(max_workers=8) as pool:  # one request per run: overlap them
            tables = list(pool.map(one, enumerate(run_ids)))
    if not tables:
        return pa.table({"run_id": pa.array([], type=pa.string())})
    return pa.concat_tables(tables, promote_options="permissive")
