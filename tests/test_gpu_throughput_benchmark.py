"""benchmarks/gpu_throughput.py on the CPU (`--device cpu`): its plumbing (the study written in
the official CIFAR-100 format, run through the runner of `studies run` on a local Ray with a
GPU label, the numbers read back from MLflow, the table). The GPU numbers need a GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_benchmark_runs_a_study_and_prints_its_table_on_the_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_throughput.py"), "--device", "cpu", "--gpus", "0.5",
         "--compile", "none", "--data", "device", "--losses", "ce", "--num-cpus", "2",
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "GPU throughput on CPU" in done.stdout
    rows = [line for line in done.stdout.splitlines() if re.match(r"\| 0\.5 \|", line)]
    assert len(rows) == 1, done.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    gpus, share, compile_mode, data, count, per_hour, ratio, img_s, img_s_first, overhead, wall = cells
    # two trial slots of half a GPU each share the one GPU of a 2-CPU Ray; the cell was run
    assert (share, compile_mode, data, count, ratio) == ("2", "none", "device", "1", "1.00")
    assert float(per_hour) > 0 and float(img_s) > 0 and float(img_s_first) > 0 and float(wall) > 0
    # a cell's wall time holds its epochs: what is left is start-up, not a negative number
    assert 0 <= float(overhead) < float(wall)
    # the study was written in the official format and tracked in the study's MLflow store
    assert (tmp_path / "data" / "cifar-100-python" / "meta").is_file()
    assert (tmp_path / "out" / "throughput-g0_5-none-device" / "mlflow.db").is_file()
