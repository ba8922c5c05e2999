"""The tracking-load benchmark (issue 15), not timed: its writers make the runner's requests
against a real tracking store, and its counting is right (W writers x C cells => W*C
finished runs, each with the cell's metrics and artifact, and the expected number of client
calls and HTTP requests).

Against the embedded SQLite store, and the deployment's MLflow server on PostgreSQL
(`tests/local_services.py`), where every HTTP request is counted as well (both slow: forked
writer processes and real stores).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_benchmark():
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("tracking_load", REPO / "benchmarks" / "tracking_load.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["tracking_load"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


tracking_load = _load_benchmark()


def _check_runs(uri: str, name: str, templates: list[dict], pattern, expected_runs: int) -> None:
    """The experiment holds exactly `expected_runs` finished cell runs, each with every
    epoch's metrics at its step, the test metrics and the per-class artifact."""
    from mlflow import MlflowClient

    from analysis.layout import PER_CLASS_ARTIFACT, ROLE_CELL, STATUS_FINISHED, TAG_ROLE, TAG_STATUS

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(name)
    runs = [
        r
        for r in client.search_runs([experiment.experiment_id], max_results=1000)
        if r.data.tags.get(TAG_ROLE) == ROLE_CELL
    ]
    assert len(runs) == expected_runs
    assert len({r.data.tags["studies.cell_id"] for r in runs}) == expected_runs  # one run per cell
    epoch_keys = set(templates[0]["epochs"][0])
    test_keys = {f"test/{k}" for k in templates[0]["test"]}
    for run in runs:
        assert run.info.status == "FINISHED"
        assert run.data.tags[TAG_STATUS] == STATUS_FINISHED
        assert set(run.data.metrics) == epoch_keys | test_keys | {"best_epoch", "best_val"}
        history = client.get_metric_history(run.info.run_id, "train/loss")
        assert sorted(m.step for m in history) == list(range(pattern.epochs))
        assert run.data.metrics["best_epoch"] == pattern.epochs - 1
        assert [a.path for a in client.list_artifacts(run.info.run_id)] == [PER_CLASS_ARTIFACT]
        assert run.data.params["seed"] == run.data.tags["studies.seed"]


@pytest.mark.slow  # ~10-20 s: forked writers, each opening the store
def test_writers_times_cells_finished_runs_on_sqlite(tmp_path):
    pattern = tracking_load.CellPattern(checkpoints=2, epochs_per_checkpoint=2)
    templates = tracking_load.template_cells(count=4, pattern=pattern)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    point = tracking_load.run_point(uri, "load", writers=2, cells_per_writer=3, pattern=pattern, templates=templates)
    assert (point.cells, point.errors) == (6, 0)
    # every call either succeeded once or was retried (a locked SQLite file): the successful
    # ones are exactly the per-cell pattern
    assert point.calls == 6 * pattern.client_calls() == 6 * 9
    assert point.http == 0  # no server
    assert set(point.latency_ms) == {"call", "open", "checkpoint", "finish"}
    assert point.cells_per_s == pytest.approx(6 / point.wall_s)
    _check_runs(uri, "load", templates, pattern, expected_runs=6)


def test_process_tree_cpu_counts_reaped_children():
    """A child that burns CPU and exits still counts in its parent's tree."""
    import subprocess

    before = tracking_load.process_tree_cpu_s(os.getpid())
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    after = tracking_load.process_tree_cpu_s(os.getpid())
    child = after - before
    assert child >= 0.05  # the child's own work (~0.2 s), reaped into cutime


@pytest.mark.slow
def test_writers_against_the_deployed_server(tmp_path, monkeypatch):
    """The deployment's server on PostgreSQL: W*C finished runs, and every HTTP request
    counted (two get_run per cell besides the client calls)."""
    from tests.local_services import ServiceUnavailable, _kill_tree, start_mlflow_server, start_postgres

    try:
        postgres = start_postgres()
    except ServiceUnavailable as missing:
        pytest.skip(str(missing))
    try:
        server = start_mlflow_server(postgres, tmp_path, auth_cache_ttl_s=60)
        try:
            monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", server.user)
            monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.password)
            monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
            pattern = tracking_load.CellPattern(checkpoints=1)
            templates = tracking_load.template_cells(count=3, pattern=pattern)
            point = tracking_load.run_point(
                server.uri,
                "load",
                writers=2,
                cells_per_writer=2,
                pattern=pattern,
                templates=templates,
                store="pg-auth-cached",
                server_workers=1,
                cpu_pids={"server": server.process.pid},
            )
            assert (point.cells, point.errors, point.failed_calls) == (4, 0, 0)
            assert point.calls == 4 * pattern.client_calls()
            assert point.http == 4 * pattern.http_requests() == 4 * (pattern.client_calls() + 2)
            assert point.server_cpu_s > 0
            _check_runs(server.uri, "load", templates, pattern, expected_runs=4)
        finally:
            _kill_tree(server.process, grace_s=20)
    finally:
        postgres.stop()
