"""Issue #24 on a real local Ray (2 CPUs and a GPU that is only a resource label):

- warm workers: the cells of a study run one after another in the same Ray worker process
  (Tune's actor reuse), so that a GPU slot pays its CUDA context, cuDNN autotuning and compiled
  graphs once, and nothing of one cell leaks into the next: a cell trained after others in a
  warm worker gives the results of a fresh process for the same seed (real MLflow server);
- benchmarks/gpu_throughput.py with ``--device cpu``: its plumbing (a study in the official
  CIFAR-100 format through the runner, the numbers read back from MLflow, the table). The GPU
  numbers need a GPU.

Both ``@pytest.mark.slow``; they share one Ray instance.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from studies.running.runner import RunOptions, run_study

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ray_with_a_gpu_label():
    """A local Ray with 2 CPUs and one GPU resource (a label: the trials run on the CPU); this
    module's functions travel to the workers by value."""
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(
        address="local",
        num_cpus=2,
        num_gpus=1,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=100 * 1024**2,
    )
    yield ray
    ray.shutdown()


def recording_fit(config, seed, on_epoch=None, checkpoint=None, *, record: str):
    """The real fit; appends the cell's config, seed, process id and test metrics to ``record``."""
    from setvalued.training import fit

    result = fit(config, seed, on_epoch=on_epoch, checkpoint=checkpoint)
    with open(record, "a") as handle:
        handle.write(
            json.dumps(
                {
                    "config": config,
                    "seed": seed,
                    "pid": os.getpid(),
                    "test": result["test"],
                    "best_epoch": result["best_epoch"],
                }
            )
            + "\n"
        )
    return result


def study_file(folder: Path) -> Path:
    base = {
        "data": {
            "name": "synthetic",
            "num_classes": 6,
            "num_superclasses": 2,
            "train_size": 120,
            "val_size": 48,
            "test_size": 48,
            "feature_dim": 8,
        },
        "model": {"name": "mlp", "hidden_dim": 16},
        "loss": {"name": "ce"},
        "optim": {"lr": 0.1, "batch_size": 32, "milestones": []},
        "epochs": 2,
        "eval": {"ks": [1, 3], "selection": "val/top3", "batch_size": 20},
        "device": "cpu",
    }
    # two CPUs a trial on a 2-CPU Ray: the cells run one at a time, in one slot
    study = {
        "name": "warm-workers",
        "description": "cells in one worker",
        "base": base,
        "design": [{"kind": "grid", "parameters": {"optim.lr": [0.05, 0.1]}}],
        "seeds": [0, 1],
        "resources": {"cpus": 2},
        "max_failures": 0,
        "log_models": False,
    }
    path = folder / "warm-workers.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


_FRESH = """
import json, sys, torch
torch.set_num_threads(2)  # what the worker's trial got (studies.running.trial.set_torch_threads)
from setvalued.training.trial import fit
cell = json.loads(sys.argv[1])
result = fit(cell["config"], cell["seed"])
print(json.dumps({"test": result["test"], "best_epoch": result["best_epoch"]}))
"""


@pytest.mark.slow
def test_cells_share_a_warm_worker_and_match_a_fresh_process(ray_with_a_gpu_label, mlflow_server, tmp_path):
    record = tmp_path / "cells.jsonl"
    stream = io.StringIO()
    options = RunOptions(
        output=tmp_path / "out",
        tracking_uri=mlflow_server,
        report=False,
        progress_interval_s=5.0,
        stream=stream,
        fit_fn=functools.partial(recording_fit, record=str(record)),
    )
    outcome = run_study(study_file(tmp_path), options)
    assert outcome.exit_code == 0, stream.getvalue()
    cells = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(cells) == 4
    assert len({c["pid"] for c in cells}) == 1, [c["pid"] for c in cells]  # one warm worker
    assert cells[0]["pid"] != os.getpid()  # a Ray worker, not the driver

    # the last cell ran after three others in that process: a fresh process gives its results
    last = cells[-1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    fresh = subprocess.run(
        [sys.executable, "-c", _FRESH, json.dumps(last)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    fresh_result = json.loads(fresh.stdout.strip().splitlines()[-1])
    assert fresh_result["best_epoch"] == last["best_epoch"]
    assert fresh_result["test"] == pytest.approx(last["test"], rel=1e-9, abs=1e-12)


@pytest.mark.slow
def test_gpu_benchmark_runs_a_study_and_prints_its_table_on_the_cpu(ray_with_a_gpu_label, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_throughput", REPO / "benchmarks" / "gpu_throughput.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    # the default loader workers fit the 2-CPU Ray (issue 33: 4 CPUs a trial never started)
    assert (
        benchmark.main(
            [
                "--device",
                "cpu",
                "--gpus",
                "0.5",
                "--compile",
                "none",
                "--data",
                "device",
                "loader",
                "--losses",
                "ce",
                "--workdir",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "GPU throughput on CPU" in out
    rows = [line for line in out.splitlines() if re.match(r"\| 0\.5 \|", line)]
    assert len(rows) == 2, out
    loader = [c.strip() for c in rows[1].strip("|").split("|")]
    assert loader[3] == "loader" and loader[4] == "1" and float(loader[-1]) > 0
    assert benchmark.loader_workers(None, 2) == 2 and benchmark.loader_workers(None, 16) == 4
    assert benchmark.loader_workers(3, 2) is None
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    gpus, share, compile_mode, data, count, per_hour, ratio, img_s, img_s_first, overhead, wall = cells
    # two trial slots of half a GPU each share the one GPU of a 2-CPU Ray; the cell was run
    assert (share, compile_mode, data, count, ratio) == ("2", "none", "device", "1", "1.00")
    assert float(per_hour) > 0 and float(img_s) > 0 and float(img_s_first) > 0 and float(wall) > 0
    # a cell's wall time holds its epochs: what is left is start-up, not a negative number
    assert 0 <= float(overhead) < float(wall)
    # the data were written in the official format, the study tracked in its own MLflow store
    assert (tmp_path / "data" / "cifar-100-python" / "meta").is_file()
    assert (tmp_path / "out" / "throughput-g0_5-none-device" / "mlflow.db").is_file()
