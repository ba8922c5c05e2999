"""Two drivers of one study at once (real processes, a real MLflow server): the second one
refuses, naming the first, or with --wait runs after it; every cell ends with exactly one run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest
from test_cli import REPO, cell_runs, run_cli, study_file

pytestmark = pytest.mark.slow


def _lease_runs(server: str, name: str) -> list:
    """The study's live leases (experiment tags studies.lease.<token>)."""
    from mlflow import MlflowClient

    experiment = MlflowClient(server).get_experiment_by_name(name)
    if experiment is None:
        return []
    return [k for k in experiment.tags if k.startswith("studies.lease.")]


def test_a_second_driver_refuses_or_waits_and_no_cell_runs_twice(mlflow_server, tmp_path):
    name = f"two-drivers-{uuid.uuid4().hex[:6]}"
    path = study_file(tmp_path, name)
    output = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    args = [
        "run",
        str(path),
        "--tracking-uri",
        mlflow_server,
        "--output",
        str(output),
        "--no-report",
        "--num-cpus",
        "1",
    ]
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(
            [sys.executable, "-m", "studies.cli", *args], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 300
            while not _lease_runs(mlflow_server, name):
                assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the first driver never took the lease"
                time.sleep(0.3)
            refused = run_cli(*args, timeout=300)
            assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
            assert "is being run by another driver" in refused.stderr
            assert f"pid {first.pid}" in refused.stderr
            waited = run_cli(*args, "--wait", timeout=900)
            assert first.wait(timeout=900) == 0, (tmp_path / "first.log").read_text()[-3000:]
        finally:
            if first.poll() is None:
                first.kill()
    assert waited.returncode == 0, waited.stdout[-3000:] + waited.stderr[-3000:]
    assert "6 cells already finished" in waited.stdout
    by_cell: dict[str, int] = {}
    for run in cell_runs(mlflow_server, name):
        by_cell[run.data.tags["studies.cell_id"]] = by_cell.get(run.data.tags["studies.cell_id"], 0) + 1
    assert len(by_cell) == 6 and set(by_cell.values()) == {1}, by_cell
    assert _lease_runs(mlflow_server, name) == []  # both released their lease
