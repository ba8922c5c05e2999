"""studies.tracking against real MLflow stores (a SQLite file, and the `mlflow_server` fixture).

What is checked: the flattened params, the contract tags of a child run, one `log_batch` per
epoch (steps = epochs), the idempotent ledger (`prepare` keeps finished runs, deletes
unfinished ones, so a cell ends with one active run), the parent run found again by its
tags, run reuse within a driver session, and the retry on a really locked SQLite database.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
import uuid

import pyarrow.parquet as pq
import pytest

from studies.tracking import (
    PARENT_RUN_TAG,
    STATUS_FAILED,
    STATUS_FINISHED,
    CellRun,
    StudyTracking,
    cell_objective,
    config_params,
    ui_command,
    with_retry,
)


def make_cell(config_id: str, seed: int, lr: float = 0.1) -> dict:
    config = {
        "data": {"name": "synthetic", "root": None},
        "optim": {"lr": lr, "milestones": [150, 225]},
        "loss": {"name": "ce"},
        "eval": {"ks": [1, 5]},
        "epochs": 3,
    }
    return {
        "cell_id": f"{config_id}-s{seed}",
        "config_id": config_id,
        "seed": seed,
        "variant": "ce",
        "config": config,
        "swept": {"optim.lr": lr},
    }


def test_config_params_dotted_keys_and_json_values():
    flat = config_params({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": None, "f": "x", "g": True, "h": {}})
    assert flat == {"a.b": "1", "a.c.d": "[1, 2]", "e": "null", "f": "x", "g": "true", "h": "{}"}


def test_ui_command_names_the_store():
    assert ui_command("sqlite:////tmp/x/mlflow.db") == "mlflow ui --backend-store-uri sqlite:////tmp/x/mlflow.db"
    assert "http://127.0.0.1:5000" in ui_command("http://127.0.0.1:5000")


def test_with_retry_waits_out_a_locked_sqlite_database(tmp_path):
    """A real exclusive SQLite lock held by another connection: a write with a short busy
    timeout fails with 'database is locked' while the lock is held, and goes through
    `with_retry` once the lock is released. (MLflow's own busy timeout is 20 s; the retry
    covers waits longer than that under many parallel writers.)"""
    path = tmp_path / "locked.db"
    setup = sqlite3.connect(path)
    setup.execute("CREATE TABLE t (x INTEGER)")
    setup.commit()
    setup.close()
    locker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    locker.execute("BEGIN EXCLUSIVE")
    writer = sqlite3.connect(path, timeout=0.05, isolation_level=None)

    def write():
        writer.execute("INSERT INTO t VALUES (1)")

    with pytest.raises(sqlite3.OperationalError, match="locked"):
        write()
    timer = threading.Timer(1.0, lambda: locker.execute("COMMIT"))
    start = time.monotonic()
    timer.start()
    with_retry(write, attempts=40, first_delay_s=0.05, max_delay_s=0.2)
    waited = time.monotonic() - start
    timer.join()
    assert waited >= 0.9  # it did wait for the lock to go
    assert writer.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 1
    writer.close()
    locker.close()


def test_with_retry_does_not_hide_other_errors():
    calls = []

    def boom():
        calls.append(1)
        raise ValueError("not a lock problem")

    with pytest.raises(ValueError):
        with_retry(boom)
    assert len(calls) == 1


@pytest.mark.slow
def test_cell_run_layout_and_idempotent_ledger(mlflow_server, tmp_path):
    name = f"tracking-{uuid.uuid4().hex[:8]}"
    study_file = tmp_path / "study.yaml"
    study_file.write_text("name: x\n")
    tracking = StudyTracking(mlflow_server, name)
    parent = tracking.parent_run_id(study_file)
    # found again by its tags, not created twice
    assert StudyTracking(mlflow_server, name).parent_run_id() == parent
    context = tracking.context("session-a")

    cell = make_cell("abcdef0123", 7, lr=0.05)
    run, reused = CellRun.open(context, cell)
    assert not reused
    for epoch in range(3):
        run.log_metrics(
            {
                "train/loss": 1.0 / (epoch + 1),
                "val/top5": 0.5 + epoch / 10,
                "epoch_time_s": 0.1,
                "lr": 0.05,
                "not_a_number": "x",
            },
            step=epoch,
        )
    assert run.last_logged_epoch() == 2
    per_class = {"class": [0, 1, 2], "top5": [1.0, 0.5, math.nan]}
    run.finish(
        {"test": {"top5": 0.8, "few/top5": 0.6}, "best_epoch": 2, "best_val": 0.7, "per_class": per_class}, final_step=2
    )

    client = tracking.client
    stored = client.get_run(run.run_id)
    tags = stored.data.tags
    assert tags[PARENT_RUN_TAG] == parent
    assert tags["studies.role"] == "cell" and tags["studies.study"] == name
    assert tags["studies.config_id"] == "abcdef0123" and tags["studies.seed"] == "7"
    assert tags["studies.cell_id"] == "abcdef0123-s7" and tags["studies.variant"] == "ce"
    assert json.loads(tags["studies.swept"]) == {"optim.lr": 0.05}
    assert tags["studies.status"] == STATUS_FINISHED
    params = stored.data.params
    assert params["optim.lr"] == "0.05" and params["seed"] == "7"
    assert params["optim.milestones"] == "[150, 225]" and params["data.root"] == "null"
    history = client.get_metric_history(run.run_id, "val/top5")
    assert sorted((m.step, round(m.value, 6)) for m in history) == [(0, 0.5), (1, 0.6), (2, 0.7)]
    assert "not_a_number" not in stored.data.metrics
    assert stored.data.metrics["test/top5"] == 0.8
    assert stored.data.metrics["test/few/top5"] == 0.6
    assert stored.data.metrics["best_epoch"] == 2
    # the objective of a cell: a per-epoch metric at the selected epoch
    assert cell_objective(tracking, run.run_id, "val/top5") == pytest.approx(0.7)
    assert cell_objective(tracking, run.run_id, "test/top5") == pytest.approx(0.8)
    local = client.download_artifacts(run.run_id, "per_class_test.parquet", str(tmp_path))
    table = pq.read_table(local)
    assert table.column("class").to_pylist() == [0, 1, 2]
    assert table.column("top5").to_pylist()[:2] == [1.0, 0.5]

    # the same session re-opens the same run (a trial restarted after its worker died)
    other = make_cell("0000000000", 1)
    first, _ = CellRun.open(context, other)
    first.log_metrics({"epoch_time_s": 1.0}, step=0)
    again, reused = CellRun.open(context, other)
    assert reused and again.run_id == first.run_id and again.last_logged_epoch() == 0
    # a failed cell carries its error
    failed_cell = make_cell("1111111111", 1)
    failed, _ = CellRun.open(context, failed_cell)
    failed.fail("NonFiniteLossError: non-finite training loss (nan) at epoch 0, step 3")

    states = tracking.cell_states([cell["cell_id"], other["cell_id"], failed_cell["cell_id"], "missing-s0"])
    assert states[cell["cell_id"]].status == STATUS_FINISHED
    assert states[other["cell_id"]].status == "running"
    assert states[failed_cell["cell_id"]].status == STATUS_FAILED
    assert "NonFiniteLossError" in states[failed_cell["cell_id"]].error
    assert states["missing-s0"].status == "missing"

    # a new driver session: finished cells are done; unfinished runs are deleted
    done, to_run = StudyTracking(mlflow_server, name).prepare(
        [cell["cell_id"], other["cell_id"], failed_cell["cell_id"]]
    )
    assert done == [cell["cell_id"]]
    assert to_run == [other["cell_id"], failed_cell["cell_id"]]
    assert client.get_run(first.run_id).info.lifecycle_stage == "deleted"
    assert client.get_run(failed.run_id).info.lifecycle_stage == "deleted"
    assert client.get_run(run.run_id).info.lifecycle_stage == "active"
    # and a new session does not reuse a run of an older one
    fresh, reused = CellRun.open(tracking.context("session-b"), other)
    assert not reused and fresh.run_id != first.run_id
    active = tracking.cell_runs()
    assert {k: len(v) for k, v in active.items()} == {cell["cell_id"]: 1, other["cell_id"]: 1}
    # the ledger keeps of each run its id, its tags and only the metrics asked for
    kept = tracking.cell_runs(metrics=("test/top5", "no/such/metric"))[cell["cell_id"]][0]
    assert kept.run_id == run.run_id and kept.tags["studies.status"] == STATUS_FINISHED
    assert kept.metrics == {"test/top5": 0.8}
    assert active[cell["cell_id"]][0].metrics == {}
