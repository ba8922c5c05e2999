"""The fused part of the GPU check (benchmarks/gpu_check_fused.py, issue #35) on the CPU: the
cells-per-GPU-hour formula against a hand computation, the goal's verdict, and (slow: it starts
worker processes) its tiny plumbing end to end, whose rows must agree with each other. The GPU
figures need a GPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check_fused", REPO / "benchmarks" / "gpu_check_fused.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)


def test_cells_per_gpu_hour_is_the_paper_protocol_at_the_measured_rates():
    # 300 epochs x (45,000 / 4,500 s + 5,000 / 10,000 s) = 300 x 10.5 s = 3,150 s a cell
    assert check.cells_per_gpu_hour(4500.0, 10000.0) == pytest.approx(3600 / 3150)
    # twice both rates: twice the cells
    assert check.cells_per_gpu_hour(9000.0, 20000.0) == pytest.approx(2 * 3600 / 3150)


def test_verdict_compares_the_best_array_of_several_seeds_with_one_trial_and_packing():
    rows = [
        {"arrangement": "trial", "cells_per_gpu_h": 1.0},
        {"arrangement": "fused 1", "cells_per_gpu_h": 50.0},  # one member: not a fused array of seeds
        {"arrangement": "fused 4", "cells_per_gpu_h": 6.0},
        {"arrangement": "fused 8", "cells_per_gpu_h": 11.0},
        {"arrangement": "packed 4", "cells_per_gpu_h": 3.0},
        {"arrangement": "packed 8", "cells_per_gpu_h": None},
    ]  # failed
    goal = check.verdict(rows)
    assert (goal["best_fused"], goal["best_packed"], goal["fused_x_trial"]) == (11.0, 3.0, 11.0)
    assert goal["met_10x"] and goal["ahead_of_packing"]
    goal = check.verdict(rows[:3] + [{"arrangement": "packed 4", "cells_per_gpu_h": 7.0}])
    assert not goal["met_10x"] and not goal["ahead_of_packing"] and goal["fused_x_trial"] == 6.0


@pytest.mark.slow
def test_tiny_plumbing_rows_agree(tmp_path, capsys):
    summary = tmp_path / "summary.md"
    summary.write_text("# earlier parts\n")
    out = tmp_path / "f_fused.json"
    assert (
        check.main(
            [
                "--device",
                "cpu",
                "--tiny",
                "--fused",
                "2",
                "--packed",
                "2",
                "--workdir",
                str(tmp_path),
                "--out",
                str(out),
                "--md",
                str(summary),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    rows = {r["arrangement"]: r for r in result["rows"]}
    assert list(rows) == ["trial", "fused 2", "packed 2"]
    batch, full_batches = 64, (100 * 6 - 100) // 64  # tiny: 600 images, 100 for validation
    for label, models, processes in (("trial", 1, 1), ("fused 2", 2, 1), ("packed 2", 2, 2)):
        row = rows[label]
        assert (row["models_at_once"], row["processes"], row["finished"], row["errors"]) == (
            models,
            processes,
            processes,
            [],
        ), row
        # whole epochs' full batches of every model of a process (a fused array trains its
        # members' batches together); the processes of a packing may run different numbers of
        # epochs in the same window
        per_process = (models // processes) * batch * full_batches
        assert row["train_images"] > 0 and row["train_images"] % per_process == 0
        assert row["train_img_s"] > 0 and row["val_img_s"] > 0
        assert row["cells_per_gpu_h"] == pytest.approx(check.cells_per_gpu_hour(row["train_img_s"], row["val_img_s"]))
    assert result["config"]["model"]["name"] == "small_cnn" and result["config"]["compile"] == "none"
    text = summary.read_text()
    assert text.startswith("# earlier parts\n") and "### Fused seeds (issue #35) on CPU" in text
    table = [line for line in text.splitlines() if line.startswith("| fused 2 |")]
    assert (
        len(table) == 1
        and table[0].split("|")[7].strip()
        == f"{rows['fused 2']['cells_per_gpu_h'] / rows['trial']['cells_per_gpu_h']:.2f}"
    )
    assert "Goal (>= 10x one eager trial" in text
    assert all(len(line) <= 80 for line in text.splitlines() if not line.startswith("|"))
    capsys.readouterr()
