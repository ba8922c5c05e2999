"""analysis.collect against runs written with the real MLflow client (server and SQLite).

`log_study_runs` writes a study exactly in the layout of docs/interfaces.md section 5, as
`studies.tracking` does; test_report.py reuses it.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analysis.collect import (
    CollectError,
    collect,
    collect_histories,
    collect_per_class,
    export_parquet,
    parse_param_value,
    typed_column,
)

# tests that need the real MLflow server (session fixture, ~15 s to start) are `slow`


# ----------------------------------------------------------------------------- writer


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def set_path(config: dict, dotted: str, value: Any) -> dict:
    """A deep copy of `config` with the dotted path set."""
    config = json.loads(json.dumps(config))
    node = config
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return config


def config_id_of(config: dict) -> str:
    """First 10 hex digits of sha256 of the canonical JSON (sorted keys), section 6."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]


@dataclass
class CellRun:
    """One cell run to write: config (without seed), seed, what it logged and how it ended."""

    variant: str
    config: dict
    seed: int
    swept: dict
    status: str = "finished"  # studies.status: finished | failed | running
    mlflow_status: str | None = None  # default FINISHED / FAILED / RUNNING from `status`
    error: str | None = None
    epochs: list[dict] = field(default_factory=list)  # per-epoch metrics, step = epoch
    test: dict = field(default_factory=dict)  # test metrics without the `test/` prefix
    best_epoch: int | None = None
    best_val: float | None = None
    per_class: dict | None = None  # columns of per_class_test.parquet
    set_sizes: dict | None = None  # columns of set_sizes_test.parquet

    @property
    def config_id(self) -> str:
        return config_id_of(self.config)

    @property
    def cell_id(self) -> str:
        return f"{self.config_id}-s{self.seed}"


def log_study_runs(tracking_uri: str, study_name: str, cells: list[CellRun], study_yaml: str | None = None) -> dict:
    """Write a study's parent run and cell runs with the MLflow client (section 5 layout)."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment_id = client.create_experiment(study_name)
    t0 = int(time.time() * 1000)
    parent = client.create_run(
        experiment_id, start_time=t0, run_name=study_name, tags={"studies.role": "parent", "studies.study": study_name}
    )
    parent_id = parent.info.run_id
    if study_yaml is not None:
        client.log_text(parent_id, study_yaml, "study.yaml")
    run_ids = []
    for index, cell in enumerate(cells):
        start = t0 + 1000 * (index + 1)
        tags = {
            "mlflow.parentRunId": parent_id,
            "studies.role": "cell",
            "studies.study": study_name,
            "studies.config_id": cell.config_id,
            "studies.seed": str(cell.seed),
            "studies.cell_id": cell.cell_id,
            "studies.variant": cell.variant,
            "studies.swept": json.dumps(cell.swept, sort_keys=True),
            "studies.status": "running",
        }
        run = client.create_run(experiment_id, start_time=start, tags=tags, run_name=cell.cell_id)
        run_id = run.info.run_id
        run_ids.append(run_id)
        # strings as they are, everything else as JSON (as studies.tracking.param_text does)
        params = [Param(k, v if isinstance(v, str) else json.dumps(v)) for k, v in flatten(cell.config).items()]
        params.append(Param("seed", str(cell.seed)))
        for i in range(0, len(params), 100):
            client.log_batch(run_id, params=params[i : i + 100], synchronous=True)
        metrics = [
            Metric(key, float(value), start + epoch, epoch)
            for epoch, values in enumerate(cell.epochs)
            for key, value in values.items()
        ]
        last = len(cell.epochs)
        final = {f"test/{k}": v for k, v in cell.test.items()}
        if cell.best_epoch is not None:
            final["best_epoch"] = cell.best_epoch
        if cell.best_val is not None:
            final["best_val"] = cell.best_val
        metrics += [Metric(key, float(value), start + last, last) for key, value in final.items()]
        for i in range(0, len(metrics), 1000):
            client.log_batch(run_id, metrics=metrics[i : i + 1000], synchronous=True)
        for columns, artifact in (
            (cell.per_class, "per_class_test.parquet"),
            (cell.set_sizes, "set_sizes_test.parquet"),
        ):
            if columns is not None:
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / artifact
                    pq.write_table(pa.table(columns), path)
                    client.log_artifact(run_id, str(path))
        end_tags = [RunTag("studies.status", cell.status)]
        if cell.error is not None:
            end_tags.append(RunTag("studies.error", cell.error))
        client.log_batch(run_id, tags=end_tags, synchronous=True)
        mlflow_status = (
            cell.mlflow_status or {"finished": "FINISHED", "failed": "FAILED", "running": "RUNNING"}[cell.status]
        )
        if mlflow_status != "RUNNING":
            client.set_terminated(run_id, mlflow_status, end_time=start + 500)
    client.set_terminated(parent_id, "FINISHED", end_time=t0 + 1000 * (len(cells) + 2))
    return {"experiment_id": experiment_id, "parent_run_id": parent_id, "run_ids": run_ids}


def unique_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


BASE_CONFIG = {
    "data": {"name": "synthetic", "root": None, "num_classes": 10, "label_noise": 0.0},
    "model": {"name": "mlp", "hidden_dim": 16},
    "loss": {"name": "noised_topk", "k": 5, "epsilon": 0.2, "n_samples": 5},
    "optim": {"lr": 0.1, "nesterov": True, "batch_size": 64, "milestones": [150, 225]},
    "epochs": 3,
}


def _epochs(seed: int, eps: float) -> list[dict]:
    return [
        {
            "train/loss": 2.0 - 0.3 * e,
            "val/top5": 0.5 + 0.1 * e + eps / 10,
            "lr": 0.1,
            "epoch_time_s": 1.0 + 0.1 * e + seed / 100,
        }
        for e in range(3)
    ]


def _finished(variant, config, seed, swept, top5):
    return CellRun(
        variant,
        config,
        seed,
        swept,
        epochs=_epochs(seed, 0.0),
        test={"top5": top5, "top1": top5 - 0.3, "few/top5": top5 - 0.2},
        best_epoch=2,
        best_val=top5 + 0.01,
        per_class={"class": [0, 1], "train_count": [30, 5], "top5": [1.0, 0.5]},
    )


@pytest.fixture(scope="module")
def study(mlflow_server):
    """A study with finished, failed, unfinished, killed, retried and duplicated cells."""
    name = unique_name("collect")
    ce = set_path(BASE_CONFIG, "loss", {"name": "ce"})
    eps_configs = {eps: set_path(BASE_CONFIG, "loss.epsilon", eps) for eps in (0.01, 1.0)}
    cells = []
    for seed in range(3):
        cells.append(_finished("ce", ce, seed, {}, 0.80 + seed / 100))
        for eps, config in eps_configs.items():
            if eps == 1.0 and seed == 2:
                continue
            cells.append(_finished("noised", config, seed, {"loss.epsilon": eps}, 0.82 + eps / 10 + seed / 100))
    broken = set_path(BASE_CONFIG, "loss.epsilon", 10.0)
    failed = CellRun(
        "noised",
        broken,
        0,
        {"loss.epsilon": 10.0},
        status="failed",
        error="NonFiniteLossError: loss is nan at epoch 1, step 3",
        epochs=_epochs(0, 0.0)[:1],
    )
    running = CellRun("noised", broken, 1, {"loss.epsilon": 10.0}, status="running", epochs=_epochs(1, 0.0)[:2])
    killed = CellRun("noised", broken, 2, {"loss.epsilon": 10.0}, status="running", mlflow_status="KILLED")
    # eps=1.0 seed 2: failed first, then finished on retry -> finished, not listed as failed
    retry_failed = CellRun("noised", eps_configs[1.0], 2, {"loss.epsilon": 1.0}, status="failed", error="worker died")
    retry_ok = _finished("noised", eps_configs[1.0], 2, {"loss.epsilon": 1.0}, 0.99)
    # ce seed 0 finished twice: the later run is kept
    duplicate = _finished("ce", ce, 0, {}, 0.555)
    cells += [failed, running, killed, retry_failed, retry_ok, duplicate]
    yaml_text = f"name: {name}\nseeds: [0, 1, 2]\n"
    written = log_study_runs(mlflow_server, name, cells, study_yaml=yaml_text)
    return {
        "name": name,
        "cells": cells,
        "uri": mlflow_server,
        "yaml": yaml_text,
        **written,
        "ce": ce,
        "eps": eps_configs,
        "broken": broken,
    }


@pytest.mark.slow
def test_finished_cells_one_row_each_with_typed_params_and_final_metrics(study):
    collected = collect(study["uri"], study["name"])
    table = collected.table
    assert table.num_rows == 9  # ce x 3 + eps 0.01 x 3 + eps 1.0 x 3 (seed 2 by retry)
    rows = {(r["config_id"], r["seed"]): r for r in table.to_pylist()}
    assert len(rows) == 9
    ce_id = config_id_of(study["ce"])
    assert rows[(ce_id, 0)]["test/top5"] == pytest.approx(0.555)  # the later duplicate
    assert collected.duplicate_cells == [f"{ce_id}-s0"]
    eps_id = config_id_of(study["eps"][1.0])
    assert rows[(eps_id, 2)]["test/top5"] == pytest.approx(0.99)  # the retry
    row = rows[(config_id_of(study["eps"][0.01]), 1)]
    assert row["variant"] == "noised" and row["cell_id"].endswith("-s1")
    assert json.loads(row["swept"]) == {"loss.epsilon": 0.01}
    assert row["test/top5"] == pytest.approx(0.82 + 0.001 + 0.01)
    assert row["test/few/top5"] == pytest.approx(row["test/top5"] - 0.2)
    assert row["best_epoch"] == 2 and row["best_val"] == pytest.approx(row["test/top5"] + 0.01)
    # per-epoch metrics: the last epoch's value
    assert row["val/top5"] == pytest.approx(0.5 + 0.2)
    assert row["epoch_time_s"] == pytest.approx(1.2 + 0.01)
    # params typed back from MLflow's strings
    assert table.schema.field("param:loss.epsilon").type == pa.float64()
    assert table.schema.field("param:loss.k").type == pa.int64()
    assert table.schema.field("param:optim.nesterov").type == pa.bool_()
    assert row["param:optim.milestones"] == "[150, 225]"
    assert row["param:data.root"] is None and row["param:data.name"] == "synthetic"
    assert "param:seed" not in table.column_names and table.schema.field("seed").type == pa.int64()
    assert collected.study_yaml == study["yaml"]
    assert collected.parent_run_id == study["parent_run_id"]
    assert collected.n_runs == len(study["cells"])


@pytest.mark.slow
def test_failed_and_unfinished_cells_are_listed_with_status_and_error(study):
    collected = collect(study["uri"], study["name"])
    failed = {r["seed"]: r for r in collected.failed.to_pylist()}
    broken_id = config_id_of(study["broken"])
    assert set(failed) == {0, 1, 2} and all(r["config_id"] == broken_id for r in failed.values())
    assert failed[0]["status"] == "failed" and "NonFiniteLossError" in failed[0]["error"]
    assert failed[0]["mlflow_status"] == "FAILED"
    assert failed[1]["status"] == "unfinished" and failed[1]["mlflow_status"] == "RUNNING"
    assert failed[1]["error"] is None
    assert failed[2]["status"] == "unfinished" and "KILLED" in failed[2]["error"]
    # the retried cell (failed, then finished) is not listed as failed
    assert config_id_of(study["eps"][1.0]) not in {r["config_id"] for r in failed.values()}
    finished_cells = set(collected.table.column("cell_id").to_pylist())
    assert not finished_cells & {r["cell_id"] for r in failed.values()}


@pytest.mark.slow
def test_pagination_reads_every_run(study):
    whole = collect(study["uri"], study["name"])
    paged = collect(study["uri"], study["name"], page_size=2)  # 8 pages of cells
    assert paged.n_runs == whole.n_runs == len(study["cells"])
    assert sorted(paged.table.column("run_id").to_pylist()) == sorted(whole.table.column("run_id").to_pylist())
    assert paged.failed.num_rows == whole.failed.num_rows == 3


@pytest.mark.slow
def test_history_means_and_per_class_artifacts(study):
    collected = collect(study["uri"], study["name"], histories=["epoch_time_s"])
    for row in collected.table.to_pylist():
        seed = row["seed"]
        assert row["mean:epoch_time_s"] == pytest.approx(1.1 + seed / 100)
    run_ids = collected.table.column("run_id").to_pylist()[:2]
    per_class = collect_per_class(study["uri"], run_ids)
    assert per_class.num_rows == 4
    assert sorted(set(per_class.column("run_id").to_pylist())) == sorted(run_ids)
    assert per_class.column("train_count").to_pylist()[:2] == [30, 5]


@pytest.mark.slow
def test_export_parquet_round_trip(study, tmp_path):
    collected = collect(study["uri"], study["name"])
    path = export_parquet(collected, tmp_path / "out" / "cells.parquet")
    back = pq.read_table(path)
    assert back.num_rows == collected.table.num_rows
    assert back.column("test/top5").to_pylist() == collected.table.column("test/top5").to_pylist()
    assert back.schema.metadata[b"studies.study"] == study["name"].encode()
    failed = pq.read_table(tmp_path / "out" / "cells.failed.parquet")
    assert failed.num_rows == 3 and "error" in failed.column_names


@pytest.mark.slow
def test_unknown_study_is_a_clear_error(study):
    with pytest.raises(CollectError, match="no MLflow experiment named 'no-such-study'"):
        collect(study["uri"], "no-such-study")


def test_collect_from_sqlite_store(tmp_path):
    """The embedded default store (sqlite) works the same as a server."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = set_path(BASE_CONFIG, "loss.epsilon", 0.5)
    cells = [_finished("noised", config, s, {"loss.epsilon": 0.5}, 0.9 + s / 100) for s in range(2)]
    cells[1].per_class = None
    cells.append(CellRun("noised", config, 2, {"loss.epsilon": 0.5}, status="failed", error="boom"))
    log_study_runs(uri, "sqlite-study", cells)
    collected = collect(uri, "sqlite-study")
    assert sorted(collected.table.column("seed").to_pylist()) == [0, 1]
    assert collected.failed.column("error").to_pylist() == ["boom"]
    assert collected.study_yaml is None


def test_study_runs_filters_tags_params_and_metrics_alike_on_both_paths(tmp_path):
    """`study_runs` (what the cell ledger reads): bulk SQL and `search_runs` pages return the
    same runs, in start order, for extra tag filters, without params, with chosen metrics."""
    from mlflow import MlflowClient

    from analysis.collect import study_runs
    from analysis.layout import ROLE_CELL, TAG_CONFIG_ID, TAG_ROLE

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    a, b = set_path(BASE_CONFIG, "loss.epsilon", 0.5), set_path(BASE_CONFIG, "loss.epsilon", 0.1)
    cells = [_finished("noised", a, s, {"loss.epsilon": 0.5}, 0.9 + s / 100) for s in range(3)]
    cells += [_finished("noised", b, s, {"loss.epsilon": 0.1}, 0.8) for s in range(2)]
    log_study_runs(uri, "ledger-study", cells)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("ledger-study").experiment_id
    config_a = next(
        iter(
            {
                r.data.tags[TAG_CONFIG_ID]
                for r in client.search_runs([experiment])
                if r.data.params.get("loss.epsilon") == "0.5"
            }
        )
    )
    wanted = {TAG_ROLE: ROLE_CELL, TAG_CONFIG_ID: config_a}

    def view(records):
        return [(r.run_id, r.status, r.tags, r.params, r.metrics) for r in records]

    for params, metrics in ((True, None), (False, ("test/top5", "no/such")), (False, ())):
        bulk = study_runs(client, experiment, wanted, params=params, metrics=metrics)
        paged = study_runs(client, experiment, wanted, params=params, metrics=metrics, page_size=2, bulk=False)
        assert view(bulk) == view(paged)
        assert len(bulk) == 3 and {r.tags[TAG_CONFIG_ID] for r in bulk} == {config_a}
        assert [r.start_time for r in bulk] == sorted(r.start_time for r in bulk)
        assert all(bool(r.params) == params for r in bulk)
        if metrics is not None:
            assert all(set(r.metrics) == set(metrics) & {"test/top5"} for r in bulk)
        else:
            assert all("test/top5" in r.metrics and "best_val" in r.metrics for r in bulk)
    assert len(study_runs(client, experiment, {TAG_ROLE: ROLE_CELL})) == 5


def test_param_parsing_and_typing():
    assert parse_param_value("True") is True and parse_param_value("None") is None
    assert parse_param_value("[150, 225]") == [150, 225]
    assert parse_param_value("0.001") == 0.001 and parse_param_value("5") == 5
    assert parse_param_value("noised_topk") == "noised_topk"
    assert math.isinf(parse_param_value("inf"))
    assert typed_column([1, 2.5, None]).type == pa.float64()
    assert typed_column([True, None]).type == pa.bool_()
    assert typed_column(["a", [1, 2]]).to_pylist() == ["a", "[1, 2]"]


# ----------------------------------------------------------------------------- bulk reads


def _awkward_histories(uri: str, name: str) -> list[str]:
    """A small study whose histories test the edges of the bulk paths: a step logged twice
    (the later value wins), NaN and inf values (dropped), a key one run never logged, and a
    run with more points than a REST bulk page holds (read again run by run)."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from analysis.collect import REST_BULK_POINTS

    config = set_path(BASE_CONFIG, "loss.epsilon", 0.5)
    cells = [_finished("noised", config, s, {"loss.epsilon": 0.5}, 0.9 + s / 100) for s in range(3)]
    cells.append(
        CellRun("noised", config, 3, {"loss.epsilon": 0.5}, status="failed", error="boom", epochs=_epochs(3, 0.0)[:1])
    )
    written = log_study_runs(uri, name, cells)
    client = MlflowClient(tracking_uri=uri)
    first, second, third, _ = written["run_ids"]
    t = int(time.time() * 1000)
    client.log_batch(
        first,
        metrics=[
            Metric("val/top5", 0.99, t + 10_000, 1),  # again, later
            Metric("val/top5", float("nan"), t + 20_000, 2),
            Metric("epoch_time_s", float("inf"), t + 20_000, 2),
        ],
        synchronous=True,
    )
    client.log_batch(second, metrics=[Metric("only/second", 1.5, t, 0)], synchronous=True)
    many = [Metric("val/top5", 0.5 + i / 10**5, t + i, i) for i in range(REST_BULK_POINTS + 20)]
    for i in range(0, len(many), 1000):
        client.log_batch(third, metrics=many[i : i + 1000], synchronous=True)
    return written["run_ids"]


def same_table(a: pa.Table, b: pa.Table) -> bool:
    """Equal schemas and values, NaN equal to NaN (a run's latest value may be NaN)."""

    def key(value):
        return "NaN" if isinstance(value, float) and math.isnan(value) else value

    return a.schema == b.schema and all(
        [key(v) for v in a.column(n).to_pylist()] == [key(v) for v in b.column(n).to_pylist()] for n in a.column_names
    )


@pytest.mark.slow
def test_bulk_histories_equal_the_per_run_histories_on_a_server(mlflow_server):
    """The REST bulk endpoint (100 runs per request) returns what one get_metric_history
    request per run and key returns, value for value."""
    name = unique_name("bulk")
    run_ids = _awkward_histories(mlflow_server, name)
    collected = collect(mlflow_server, name)
    keys = ["val/top5", "epoch_time_s", "only/second", "never/logged"]
    bulk = collect_histories(collected, keys)
    per_run = collect_histories(collected, keys, bulk=False)
    assert bulk.equals(per_run) and bulk.num_rows > 2500
    rows = [r for r in bulk.to_pylist() if r["run_id"] == run_ids[0] and r["metric"] == "val/top5"]
    # step 1 logged again later: the later value; the NaN logged later at step 2 is dropped
    assert [(r["epoch"], r["value"]) for r in rows] == [(0, 0.5), (1, 0.99), (2, 0.7)]
    means = collect(mlflow_server, name, histories=keys).table
    assert same_table(means, collect(mlflow_server, name, histories=keys, bulk=False).table)


def test_bulk_reads_of_an_sql_store_equal_the_search_runs_path(tmp_path):
    """The embedded SQLite store read table by table (one query per table, one per history
    key) gives the same tables as `search_runs` and per-run history requests."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_ids = _awkward_histories(uri, "bulk-sqlite")
    keys = ["val/top5", "epoch_time_s", "only/second", "never/logged"]
    bulk = collect(uri, "bulk-sqlite", histories=keys)
    reference = collect(uri, "bulk-sqlite", histories=keys, bulk=False)
    assert same_table(bulk.table, reference.table) and bulk.failed.equals(reference.failed)
    assert (bulk.parent_run_id, bulk.n_runs, bulk.duplicate_cells) == (
        reference.parent_run_id,
        reference.n_runs,
        reference.duplicate_cells,
    )
    assert bulk.table.num_rows == 3 and bulk.failed.num_rows == 1
    histories = collect_histories(bulk, keys)
    assert histories.equals(collect_histories(bulk, keys, bulk=False))
    only = collect_histories(bulk, keys, run_ids=run_ids[:1])
    assert set(only.column("run_id").to_pylist()) == {run_ids[0]}
