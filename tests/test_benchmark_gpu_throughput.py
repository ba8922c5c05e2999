"""The `--seeds-per-trial` axis of benchmarks/gpu_throughput.py (issue #35) on the CPU: the row
arithmetic against hand-computed figures, the refusals of its arguments, and (slow: a real local
Ray and MLflow) one run end to end whose rows must agree: the separate, packed and fused rows of
an N train the same images, N times those of one eager trial, and the fused row's cells were one
array (its members share each epoch's time). The GPU numbers need a GPU."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("gpu_throughput", REPO / "benchmarks" / "gpu_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


benchmark = load_benchmark()


def test_summarize_counts_images_over_the_study_span_and_a_fused_trial_trains_its_members():
    # two cells of two epochs each; cell b starts 1 s after a, and ends last at 10 s
    records = [
        {"start": 0.0, "end": 6.0, "epochs": {0: 2.0, 1: 1.0}, "evals": {0: 0.5, 1: 0.5}},
        {"start": 1.0, "end": 10.0, "epochs": {0: 4.0, 1: 2.0}, "evals": {0: 1.0, 1: 1.0}},
    ]
    row = benchmark.summarize(records, train_images=100)
    assert row["cells"] == 2 and row["images"] == 2 * 2 * 100 and row["span_s"] == 10.0
    assert row["study_img_s"] == pytest.approx(400 / 10.0)
    assert row["cells_per_h"] == pytest.approx(2 / 10.0 * 3600)
    assert row["img_s"] == pytest.approx(50.0)  # the median of 100 / t: 50, 100, 25, 50
    assert row["img_s_first"] == pytest.approx((50 + 25) / 2)
    assert row["overhead_s"] == pytest.approx(((6 - 3 - 1) + (9 - 6 - 2)) / 2)
    fused = benchmark.summarize(records, train_images=100, members=4)
    # a fused trial trains its 4 members in one epoch time; the images trained stay per cell
    assert fused["img_s"] == pytest.approx(4 * row["img_s"]) and fused["images"] == row["images"]


def test_seed_rows_put_one_eager_trial_first_then_three_arms_per_n():
    rows = benchmark.seed_rows([1, 4, 4, 8])
    assert rows[0] == (1, benchmark.BASELINE, 1, 1.0)
    assert rows[1:4] == [(4, "separate", 1, 1.0), (4, "packed", 1, 0.25), (4, "fused", 4, 1.0)]
    assert rows[4:] == [(8, "separate", 1, 1.0), (8, "packed", 1, 0.125), (8, "fused", 8, 1.0)]
    study = benchmark.study("s", Path("/data"), "cpu", 1.0, "none", "device", 0, 1, 4, ["ce"], 4)
    assert study["resources"] == {"cpus": 1, "gpus": 1.0, "seeds_per_trial": 4} and study["seeds"] == [0, 1, 2, 3]
    assert (
        "seeds_per_trial"
        not in benchmark.study("s", Path("/d"), "cpu", 1.0, "none", "device", 0, 1, 4, ["ce"])["resources"]
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--gpus", "0.5"], "expected no --gpus and no --seeds"),
        (["--seeds", "2"], "expected no --gpus and no --seeds"),
        (["--compile", "model"], "trains with compile none"),
        (["--seeds-per-trial", "0"], "expected numbers >= 1"),
    ],
)
def test_seeds_per_trial_refuses_what_it_sets_itself(extra, message, capsys):
    with pytest.raises(SystemExit) as raised:
        benchmark.main(["--device", "cpu", "--seeds-per-trial", "2", *extra])
    assert raised.value.code == 2 and message in capsys.readouterr().err


@pytest.fixture(scope="module")
def ray_with_a_gpu_label():
    """A local Ray with 2 CPUs and one GPU resource (a label: the trials run on the CPU)."""
    ray = pytest.importorskip("ray")
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


@pytest.mark.slow
def test_seeds_per_trial_rows_train_the_same_images_three_ways(ray_with_a_gpu_label, tmp_path, capsys):
    from mlflow import MlflowClient

    assert (
        benchmark.main(
            [
                "--device",
                "cpu",
                "--seeds-per-trial",
                "2",
                "--data",
                "device",
                "--losses",
                "ce",
                "--workdir",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "Seeds per trial on CPU" in out
    rows = {}
    for line in out.splitlines():
        if re.match(r"\| device \|", line):
            data, n, arm, gpus, share, cells, images, img_s, x1, per_h, trial_img_s = [
                c.strip() for c in line.strip("|").split("|")
            ]
            rows[(int(n), arm)] = {
                "gpus": float(gpus),
                "share": int(share),
                "cells": int(cells),
                "images": int(images),
                "img_s": float(img_s),
                "x1": float(x1),
                "per_h": float(per_h),
                "trial_img_s": float(trial_img_s),
            }
    assert list(rows) == [(1, "one trial"), (2, "separate"), (2, "packed"), (2, "fused")]
    train_images = 100 * benchmark.PROTOCOL["cpu"]["per_class_train"] - benchmark.PROTOCOL["cpu"]["val_size"]
    one = rows[(1, "one trial")]
    assert (one["cells"], one["images"], one["x1"]) == (1, train_images, 1.0)
    for arm in ("separate", "packed", "fused"):
        row = rows[(2, arm)]
        # the same work three ways: 2 cells of one epoch, twice one eager trial's images
        assert (row["cells"], row["images"]) == (2, 2 * train_images), arm
        assert row["img_s"] > 0 and row["per_h"] > 0 and row["trial_img_s"] > 0
        assert row["x1"] == pytest.approx(row["img_s"] / one["img_s"], abs=0.01 + 0.01 * row["x1"])
    # the packed trials had half the GPU each and shared it; separate and fused had it whole
    assert (rows[(2, "packed")]["gpus"], rows[(2, "packed")]["share"]) == (0.5, 2)
    assert rows[(2, "separate")]["gpus"] == rows[(2, "fused")]["gpus"] == 1.0
    # the fused row was one array: its two members (seeds 0 and 1) have one epoch time, the array's
    store = tmp_path / "out" / "throughput-s2-fused-device" / "mlflow.db"
    records = benchmark.cell_records(MlflowClient(f"sqlite:///{store}"), "throughput-s2-fused-device")
    assert len(records) == 2 and records[0]["epochs"] == records[1]["epochs"]
    separate = tmp_path / "out" / "throughput-s2-separate-device" / "mlflow.db"
    apart = benchmark.cell_records(MlflowClient(f"sqlite:///{separate}"), "throughput-s2-separate-device")
    assert len(apart) == 2 and apart[0]["epochs"] != apart[1]["epochs"]  # two trials time their own epochs
