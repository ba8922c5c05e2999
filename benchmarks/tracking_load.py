"""Tracking load (issue 15), a benchmark, not a test: how many cells per second one MLflow
tracking store takes when W trial workers write to it at once, each doing per cell what
`studies.running.trial.run_cell` does, through the same code (`studies.tracking.CellRun`):

- open: the search for the session's run of the cell (a restarted trial reuses it), the
  run's creation with all its tags, the params in one `log_batch`;
- one `log_batch` per checkpoint (`--checkpoints`, each with `--epochs-per-checkpoint`
  epochs of ~45 metrics; a trial writes one per `checkpoint_interval_s`, 60 s by default);
- finish: the per-class Parquet artifact (and the set-size one with `--set-sizes`), one
  `log_batch` with the last epoch, the test metrics and the status tag, `set_terminated`.

The writers are processes forked from this one (MLflow imported once), released together,
each running cells back to back with no pause for `--seconds` (a closed loop: what the
store sustains, not what a study asks of it; docs/scale.md turns one into the other). Each
MLflow client call is timed in the writer; over HTTP every request is counted as well
(`log_artifact` is two: the run's artifact location, then the upload).

Stores (`--stores`):

- `sqlite`: the embedded default, every writer on one SQLite file (no server);
- `pg`: `mlflow server --workers N` on a throwaway PostgreSQL cluster
  (`tests/local_services.py`, as the cluster tests start it), no authentication;
- `pg-auth`: the deployment's script `cluster/mlflow/start-mlflow-server.sh` (basic auth,
  users in PostgreSQL), credentials checked on every request, as deployed by default;
- `pg-auth-cached`: the same with `MLFLOW_AUTH_CACHE_TTL_S=60` (a checked credential is
  cached for 60 s in each server worker).

Each (store, server workers) gets a fresh PostgreSQL cluster (fsync off unless
`--durable`). Besides throughput and latency, the CPU time that the MLflow server's
processes and PostgreSQL's processes used during a point is read from /proc (their
utime + stime, and those of reaped children), per client call: the number that tells how
many cores a server needs for a given request rate, whatever this machine's load.

    python benchmarks/tracking_load.py                              # the default grid, a few minutes
    python benchmarks/tracking_load.py --stores pg --server-workers 1 4 8 --writers 8 32 64 --seconds 30
    python benchmarks/tracking_load.py --json /tmp/load.json        # every number, per operation

On a machine with few cores the writers and the server share them: the throughput is then
a floor for the store, and the CPU per call is the number to extrapolate from.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

STORES = ("sqlite", "pg", "pg-auth", "pg-auth-cached")
#: the MlflowClient methods a cell's run uses (each call timed in the writer)
CLIENT_CALLS = (
    "search_runs",
    "create_run",
    "log_inputs",
    "log_batch",
    "log_artifact",
    "log_artifacts",
    "set_terminated",
    "update_run",
    "get_run",
    "get_metric_history",
)
AUTH_CACHE_TTL_S = 60
TEMPLATE_CELLS = 40  # distinct configs the writers cycle through


@dataclass(frozen=True)
class CellPattern:
    """What one cell writes: `checkpoints` log_batch calls of `epochs_per_checkpoint`
    epochs each, then the last epoch with the final request; the set-size artifact too
    when `set_sizes`."""

    checkpoints: int = 2
    epochs_per_checkpoint: int = 1
    set_sizes: bool = False

    @property
    def epochs(self) -> int:
        return self.checkpoints * self.epochs_per_checkpoint + 1

    def client_calls(self) -> int:
        """MLflow client calls per cell (no retries): search, create, the data set's input,
        params, checkpoints, artifacts, final log_batch, set_terminated."""
        return 4 + self.checkpoints + (2 if self.set_sizes else 1) + 2

    def http_requests(self) -> int:
        """HTTP requests per cell against a server: each client call is one; the first
        `log_artifact` of a run also asks for the run's artifact location (`get_run`), and
        `set_terminated` reads the run back (`get_run`) to print its address, unless
        MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT is true."""
        from mlflow.environment_variables import MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT

        return self.client_calls() + 1 + (0 if MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT.get() else 1)


@dataclass
class Point:
    """One measurement: a store, its server workers, W writers."""

    store: str
    server_workers: int
    writers: int
    cells: int = 0
    errors: int = 0
    wall_s: float = 0.0
    calls: int = 0
    failed_calls: int = 0
    http: int = 0
    latency_ms: dict = field(default_factory=dict)  # p50/p90 of every call, of open, finish
    per_call_ms: dict = field(default_factory=dict)  # p50 per client method
    server_cpu_s: float | None = None
    postgres_cpu_s: float | None = None
    writer_cpu_s: float = 0.0
    error_sample: str = ""

    @property
    def cells_per_s(self) -> float:
        return self.cells / self.wall_s if self.wall_s else 0.0

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.wall_s if self.wall_s else 0.0

    @property
    def http_per_s(self) -> float:
        return self.http / self.wall_s if self.wall_s else 0.0

    def cpu_ms_per_call(self, seconds: float | None) -> float | None:
        return None if seconds is None or not self.calls else 1000.0 * seconds / self.calls


# ----------------------------------------------------------------------------- CPU time


def _tick() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def process_tree_cpu_s(root_pid: int) -> float:
    """CPU seconds (user + system) of `root_pid`, its live descendants and the children
    they reaped (a PostgreSQL backend or a server worker that exited still counts)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                text = handle.read().decode(errors="replace")
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()
        stats[int(entry)] = fields
        children.setdefault(int(fields[1]), []).append(int(entry))
    total, queue = 0.0, [root_pid]
    while queue:
        pid = queue.pop()
        fields = stats.get(pid)
        if fields is None:
            continue
        # fields[11..14] = utime, stime, cutime, cstime (proc(5), counted after the name)
        total += sum(int(v) for v in fields[11:15])
        queue.extend(children.get(pid, []))
    return total / _tick()


def _postmaster_pid(postgres) -> int:
    return int((postgres.folder / "data" / "postmaster.pid").read_text().split()[0])


# ----------------------------------------------------------------------------- the cells


def template_cells(count: int = TEMPLATE_CELLS, pattern: CellPattern = CellPattern()) -> list[dict]:
    """`count` cells of the report benchmark's study (`benchmarks/report_scale.py`: real
    configs, config ids, variants and swept values from the project's own expansion), each
    with the per-epoch, test and per-class values the writers log."""
    import numpy as np
    import report_scale

    text = report_scale.study_yaml("tracking_load", max(count, 40), seeds=5, epochs=pattern.epochs)
    cells = report_scale.expand_cells(text)[:count]
    values = report_scale._Values(7)
    rng = np.random.default_rng(7)
    out = []
    for cell in cells:
        epochs, test, best_val = values.cell(cell, pattern.epochs)
        out.append(
            {
                "cell": {
                    "cell_id": cell.cell_id,
                    "config_id": cell.config_id,
                    "seed": int(cell.seed),
                    "variant": cell.variant,
                    "config": cell.config,
                    "swept": dict(cell.swept),
                    "run_name": f"{cell.variant} s{cell.seed}",
                },
                "epochs": epochs,
                "test": test,
                "best_val": best_val,
                "per_class": report_scale._per_class(rng),
                "set_sizes": report_scale._set_sizes(rng) if pattern.set_sizes else None,
            }
        )
    return out


def write_cell(
    context, template: Mapping[str, Any], cell_id: str, pattern: CellPattern, phase: Callable[[str, float], None]
) -> str:
    """One cell's requests, as `studies.running.trial.run_cell` makes them; returns its run id."""
    from studies.tracking import TAG_NODE_ID, CellRun

    cell = dict(template["cell"], cell_id=cell_id)
    started = time.perf_counter()
    run, _ = CellRun.open(context, cell, tags={TAG_NODE_ID: f"load-{os.getpid()}"})
    phase("open", time.perf_counter() - started)
    epochs = list(enumerate(template["epochs"]))
    for index in range(pattern.checkpoints):
        chunk = epochs[index * pattern.epochs_per_checkpoint : (index + 1) * pattern.epochs_per_checkpoint]
        started = time.perf_counter()
        run.log_epochs(chunk)
        phase("checkpoint", time.perf_counter() - started)
    last = epochs[-1]
    result = {
        "per_class": template["per_class"],
        "set_sizes": template["set_sizes"],
        "test": template["test"],
        "best_epoch": last[0],
        "best_val": template["best_val"],
    }
    started = time.perf_counter()
    run.finish(result, final_step=last[0], pending=[last])
    phase("finish", time.perf_counter() - started)
    return run.run_id


# ----------------------------------------------------------------------------- the writers


def _instrument(calls: list, http: list, uri: str) -> None:
    """Time every MlflowClient call of CLIENT_CALLS (into `calls` as (name, s, ok)) and every
    HTTP request sent to the tracking server `uri` (into `http` as seconds), in this
    process."""
    import requests
    from mlflow import MlflowClient

    def timed(name: str, method):
        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                out = method(*args, **kwargs)
            except BaseException:
                calls.append((name, time.perf_counter() - started, False))
                raise
            calls.append((name, time.perf_counter() - started, True))
            return out

        return call

    for name in CLIENT_CALLS:
        setattr(MlflowClient, name, timed(name, getattr(MlflowClient, name)))
    send = requests.Session.request

    def request(self, method, url, *args, **kwargs):
        if not str(url).startswith(uri):
            return send(self, method, url, *args, **kwargs)
        started = time.perf_counter()
        try:
            return send(self, method, url, *args, **kwargs)
        finally:
            http.append(time.perf_counter() - started)

    requests.Session.request = request


def _writer(
    index: int,
    writers: int,
    context,
    templates: list[dict],
    pattern: CellPattern,
    cells: int | None,
    seconds: float | None,
    barrier,
    results,
) -> None:
    """A writer process: cells back to back until `cells` are written or `seconds` pass."""
    calls: list = []
    http: list = []
    phases: dict[str, list[float]] = {}
    from mlflow import MlflowClient

    with open(os.devnull, "w") as null:  # MLflow prints each run's address as it ends
        os.dup2(null.fileno(), 1)

    # what a Tune worker does once per process (actors are reused): the store's client and
    # its connection, before the clock starts
    MlflowClient(context.tracking_uri).get_experiment(context.experiment_id)
    _instrument(
        calls,
        http,
        context.tracking_uri if "://" in context.tracking_uri and context.tracking_uri.startswith("http") else "\0",
    )
    done, errors, first_error = 0, 0, ""
    barrier.wait()
    started = time.perf_counter()
    deadline = started + seconds if seconds else None
    n = 0
    while (cells is None or n < cells) and (deadline is None or time.perf_counter() < deadline):
        template = templates[(index + n * writers) % len(templates)]
        cell_id = f"{template['cell']['cell_id']}-w{index}-n{n}"
        try:
            write_cell(context, template, cell_id, pattern, lambda name, s: phases.setdefault(name, []).append(s))
            done += 1
        except Exception as error:  # noqa: BLE001  (counted: a store that refuses is a result)
            errors += 1
            first_error = first_error or f"{type(error).__name__}: {error}"[:300]
        n += 1
    usage = os.times()
    results.put(
        {
            "index": index,
            "cells": done,
            "errors": errors,
            "error": first_error,
            "calls": calls,
            "http": http,
            "phases": phases,
            "end": time.perf_counter(),
            "start": started,
            "cpu_s": usage.user + usage.system,
        }
    )


def _data_fingerprints(templates: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The templates' data fingerprints by data key, as the driver sends them
    (`studies.running.identity`)."""
    from setvalued.provenance import data_fingerprint, data_key

    out = {}
    for template in templates:
        data = template["cell"]["config"].get("data") or {}
        if data_key(data) not in out:
            out[data_key(data)] = json.dumps(data_fingerprint(data).to_json(), sort_keys=True)
    return out


def _setup(uri: str, name: str, data: Mapping[str, str], queue) -> None:
    """Create the study's experiment and parent run, as the driver does (in a child process,
    so that the writers never inherit this process's store connections)."""
    from studies.tracking import StudyTracking, new_session_id

    try:
        tracking = StudyTracking(uri, name, data_fingerprints=data)
        queue.put(("ok", tracking.context(new_session_id())))
    except Exception as error:  # noqa: BLE001
        queue.put(("error", f"{type(error).__name__}: {error}"))


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": 1000.0 * at(0.5), "p90": 1000.0 * at(0.9)}


def run_point(
    uri: str,
    name: str,
    writers: int,
    *,
    pattern: CellPattern = CellPattern(),
    cells_per_writer: int | None = None,
    seconds: float | None = None,
    templates: list[dict] | None = None,
    store: str = "sqlite",
    server_workers: int = 0,
    cpu_pids: Mapping[str, int] | None = None,
) -> Point:
    """W writer processes against the tracking store `uri`, in a new experiment `name`:
    `cells_per_writer` cells each, or as many as fit in `seconds`. `cpu_pids`: processes
    whose tree's CPU time is measured ({"server": pid, "postgres": pid})."""
    if (cells_per_writer is None) == (seconds is None):
        raise ValueError("give exactly one of cells_per_writer and seconds")
    templates = templates or template_cells(pattern=pattern)
    fork = multiprocessing.get_context("fork")
    queue = fork.Queue()
    setup = fork.Process(target=_setup, args=(uri, name, _data_fingerprints(templates), queue))
    setup.start()
    status, context = queue.get(timeout=300)
    setup.join()
    if status != "ok":
        raise RuntimeError(f"setting up the experiment {name!r} at {uri} failed: {context}")
    barrier = fork.Barrier(writers + 1)
    results = fork.Queue()
    processes = [
        fork.Process(
            target=_writer, args=(i, writers, context, templates, pattern, cells_per_writer, seconds, barrier, results)
        )
        for i in range(writers)
    ]
    for process in processes:
        process.start()
    cpu_pids = dict(cpu_pids or {})
    before = {k: process_tree_cpu_s(pid) for k, pid in cpu_pids.items()}
    barrier.wait()
    gathered = [results.get(timeout=(seconds or 0) + 900) for _ in processes]
    after = {k: process_tree_cpu_s(pid) for k, pid in cpu_pids.items()}
    for process in processes:
        process.join(timeout=60)
    point = Point(store, server_workers, writers)
    point.wall_s = max(r["end"] for r in gathered) - min(r["start"] for r in gathered)
    point.cells = sum(r["cells"] for r in gathered)
    point.errors = sum(r["errors"] for r in gathered)
    point.error_sample = next((r["error"] for r in gathered if r["error"]), "")
    calls = [c for r in gathered for c in r["calls"]]
    point.calls = sum(1 for c in calls if c[2])
    point.failed_calls = sum(1 for c in calls if not c[2])
    point.http = sum(len(r["http"]) for r in gathered)
    point.writer_cpu_s = sum(r["cpu_s"] for r in gathered)
    point.latency_ms = {"call": _percentiles([c[1] for c in calls if c[2]])}
    for phase in ("open", "checkpoint", "finish"):
        point.latency_ms[phase] = _percentiles([s for r in gathered for s in r["phases"].get(phase, [])])
    point.per_call_ms = {
        n: _percentiles([c[1] for c in calls if c[0] == n and c[2]])["p50"]
        for n in sorted({c[0] for c in calls if c[2]})
    }
    if "server" in cpu_pids:
        point.server_cpu_s = after["server"] - before["server"]
    if "postgres" in cpu_pids:
        point.postgres_cpu_s = after["postgres"] - before["postgres"]
    return point


# ----------------------------------------------------------------------------- the stores


class _Store:
    """A tracking store for a series of points: its URI, the processes to measure, a stop."""

    def __init__(self, kind: str, server_workers: int, workdir: Path, durable: bool):
        self.kind = kind
        self.server_workers = server_workers
        self.postgres = None
        self.server = None
        self.saved_env: dict[str, str | None] = {}
        if kind == "sqlite":
            self.uri = f"sqlite:///{workdir / 'mlflow.db'}"
            return
        from tests.local_services import start_mlflow_server, start_postgres

        self.postgres = start_postgres(durable=durable)
        try:
            self.server = start_mlflow_server(
                self.postgres,
                workdir,
                workers=server_workers,
                auth=kind != "pg",
                auth_cache_ttl_s=AUTH_CACHE_TTL_S if kind == "pg-auth-cached" else 0,
            )
        except BaseException:
            self.postgres.stop()
            raise
        self.uri = self.server.uri
        if kind != "pg":  # every writer logs in as the `studies` user, as the Ray nodes do
            self._set_env(
                {"MLFLOW_TRACKING_USERNAME": self.server.user, "MLFLOW_TRACKING_PASSWORD": self.server.password}
            )

    def _set_env(self, values: Mapping[str, str]) -> None:
        for key, value in values.items():
            self.saved_env[key] = os.environ.get(key)
            os.environ[key] = value

    def cpu_pids(self) -> dict[str, int]:
        if self.server is None:
            return {}
        return {"server": self.server.process.pid, "postgres": _postmaster_pid(self.postgres)}

    def stop(self) -> None:
        from tests.local_services import _kill_tree

        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self.server is not None:
            _kill_tree(self.server.process, grace_s=20)
        if self.postgres is not None:
            self.postgres.stop()


def _fmt(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def table_row(p: Point) -> str:
    lat = p.latency_ms
    return (
        f"| {p.store} | {p.server_workers or ''} | {p.writers} | {p.cells} | "
        f"{p.cells_per_s:.2f} | {p.calls_per_s:.1f} | {_fmt(p.http_per_s) if p.http else ''} | "
        f"{_fmt(lat['call'].get('p50'))} / {_fmt(lat['call'].get('p90'))} | "
        f"{_fmt(lat['open'].get('p50'), 0)} | {_fmt(lat['finish'].get('p50'), 0)} | "
        f"{_fmt(p.cpu_ms_per_call(p.server_cpu_s))} | {_fmt(p.cpu_ms_per_call(p.postgres_cpu_s))} | "
        f"{_fmt(p.cpu_ms_per_call(p.writer_cpu_s))} | {p.errors + p.failed_calls} |"
    )


TABLE_HEAD = (
    "| store | server workers | writers | cells | cells/s | calls/s | HTTP req/s | "
    "call p50 / p90 ms | open p50 ms | finish p50 ms | server CPU ms/call | "
    "PostgreSQL CPU ms/call | writer CPU ms/call | errors + retried calls |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--stores",
        nargs="+",
        default=["sqlite", "pg", "pg-auth-cached"],
        choices=STORES,
        help="default: sqlite pg pg-auth-cached (pg-auth: give few writers, it takes ~2 calls/s per core)",
    )
    parser.add_argument("--writers", nargs="+", type=int, default=[1, 4, 16, 32])
    parser.add_argument("--server-workers", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--seconds", type=float, default=6.0, help="per point (default 6)")
    parser.add_argument("--checkpoints", type=int, default=2)
    parser.add_argument("--epochs-per-checkpoint", type=int, default=1)
    parser.add_argument("--set-sizes", action="store_true", help="log the set-size artifact too")
    parser.add_argument(
        "--durable", action="store_true", help="PostgreSQL with fsync and synchronous commit (production defaults)"
    )
    parser.add_argument("--json", type=Path, help="write every point here")
    args = parser.parse_args(argv)

    # MLflow 3 reports usage from every client process unless told not to: not part of the load
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow  # noqa: F401  (imported once, before the writers fork)

    import studies.tracking  # noqa: F401

    pattern = CellPattern(args.checkpoints, args.epochs_per_checkpoint, args.set_sizes)
    templates = template_cells(pattern=pattern)
    print(
        f"# tracking load: {os.cpu_count()} CPUs, {pattern.client_calls()} client calls "
        f"({pattern.http_requests()} HTTP requests) per cell, {args.seconds:g} s per point"
        f"{', durable PostgreSQL' if args.durable else ''}",
        flush=True,
    )
    print(TABLE_HEAD, flush=True)
    points: list[Point] = []
    for kind in args.stores:
        for workers in [0] if kind == "sqlite" else args.server_workers:
            workdir = Path(tempfile.mkdtemp(prefix=f"tracking-load-{kind}-"))
            started = time.perf_counter()
            store = _Store(kind, workers, workdir, args.durable)
            print(f"<!-- {kind} started in {time.perf_counter() - started:.1f} s -->", flush=True)
            try:
                for w in args.writers:
                    point = run_point(
                        store.uri,
                        f"load-{kind}-{workers}-{w}",
                        w,
                        pattern=pattern,
                        seconds=args.seconds,
                        templates=templates,
                        store=kind,
                        server_workers=workers,
                        cpu_pids=store.cpu_pids(),
                    )
                    points.append(point)
                    print(table_row(point), flush=True)
                    if point.error_sample:
                        print(f"<!-- first error: {point.error_sample} -->", flush=True)
            finally:
                store.stop()
                shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    {
                        **asdict(p),
                        "cells_per_s": p.cells_per_s,
                        "calls_per_s": p.calls_per_s,
                        "http_per_s": p.http_per_s,
                    }
                    for p in points
                ],
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
