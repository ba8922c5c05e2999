"""The train-step benchmark's plumbing (benchmarks/train_step.py), on CPU with a tiny DenseNet-BC:
every row builds its model, loss and optimizer, steps in both modes, and the table reports each
loss's ratio to CE with the device named. Not timed: the numbers mean nothing at this size."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import benchmarks.train_step as train_step

TINY = [
    "--device",
    "cpu",
    "--depth",
    "10",
    "--growth-rate",
    "4",
    "--image-size",
    "8",
    "--batch",
    "8",
    "--steps",
    "1",
    "--rounds",
    "1",
    "--warmup",
    "1",
]


def test_train_step_benchmark_runs_every_row_on_cpu(tmp_path, capsys):
    out = tmp_path / "steps.md"
    # every row, eager; then the compiled mode (dynamo only: inductor's CPU code generation of a
    # DenseNet takes minutes) on CE and the noised loss
    assert train_step.main(TINY + ["--modes", "eager"]) == 0
    eager = capsys.readouterr().out
    assert (
        train_step.main(
            TINY
            + [
                "--modes",
                "eager",
                "graphs",
                "--compile-backend",
                "eager",
                "--only",
                "noised_topk K=5 M=3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    compiled = out.read_text()
    assert compiled in capsys.readouterr().out
    labels = [row.label for row in train_step.rows(None, None)]
    assert {
        "ce",
        "noised_topk K=5 M=3",
        "noised_topk_imbalanced K=5 M=3",
        "avgk_two_head K=5",
        "smooth_topk_svm K=10",
    } <= set(labels)
    for text, expected, columns in (
        (eager, labels, 1),
        (compiled, ["ce", "noised_topk K=5 M=3", "noised_topk K=5 M=3 exact=True"], 2),
    ):
        table = {
            line.split(" | ")[0].strip("| "): line
            for line in text.splitlines()
            if line.startswith("| ") and "x CE" not in line
        }
        assert list(table) == expected
        for label, line in table.items():
            cells = re.findall(r"([0-9.]+) \(([0-9.]+)\)", line)
            assert len(cells) == columns and all(float(ms) > 0 for ms, _ in cells)
            if label == "ce":
                assert all(ratio == "1.000" for _, ratio in cells)
    assert "device cpu" in compiled and "torch.compile(model, backend='eager')" in compiled
    assert "pytopk:" in compiled and "2018 reference:" in compiled
