"""The compute estimate of `studies plan` against the measured wall time of `studies run`,
and the measurements behind the estimate's constants (`studies.planning.estimate`).

For each study file: the estimate from a probe (no pilot), the wall time of
`studies run FILE --no-report` in a fresh output folder (the process, start to end), then the
estimate with that run as the pilot. With `--smoke-epochs N` the study's smoke run of N epochs
is planned and run instead (`studies plan/run FILE --smoke --smoke-epochs N`). One line per
run; docs/planning.md quotes them.

The run is then taken apart from its MLflow runs (the cells' `duration_s`, `epoch_time_s`,
`eval_time_s` and start and end times):

- start-up: the process's wall time minus the span of its cells (first cell's run start to
  the last one's end), what `START_UP_S` stands for;
- warm-up: the earliest cell's rest (`duration_s` minus its epochs' times) over the median
  rest, what a fresh worker's first cell pays once;
- rest: the median rest of a cell, the fixed part of a cell inside its run.

    python benchmarks/plan_estimate.py studies/catalog/quickstart.yaml [more files]
    python benchmarks/plan_estimate.py --smoke-epochs 2 studies/catalog/topk_cifar100_label_noise.yaml
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cli(*args: str) -> tuple[str, float]:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "studies.cli", *args], cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"studies {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
    return result.stdout, time.perf_counter() - started


def wall_estimate(plan_text: str) -> float:
    match = re.search(r"wall time: ([\d.]+) (s|min|h)", plan_text)
    value, unit = float(match.group(1)), match.group(2)
    return value * {"s": 1, "min": 60, "h": 3600}[unit]


def decompose(uri: str, name: str, wall: float) -> dict[str, float]:
    """Start-up, span of the cells, warm-up and median rest of a finished run (module
    docstring)."""
    from analysis.collect import collect

    rows = collect(uri, name, histories=["epoch_time_s", "eval_time_s"]).table.to_pylist()
    rows.sort(key=lambda r: r["start_time"])
    rests = [
        r["duration_s"]
        - (r.get("stopped_epoch") or r["param:epochs"]) * (r["mean:epoch_time_s"] + (r["mean:eval_time_s"] or 0.0))
        for r in rows
    ]
    span = (max(r["end_time"] for r in rows) - rows[0]["start_time"]) / 1000.0
    median = statistics.median(rests)
    return {"start_up": wall - span, "span": span, "warm_up": rests[0] - median, "rest": median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument(
        "--smoke-epochs",
        type=int,
        default=None,
        metavar="N",
        help="plan and run each file's smoke run of N epochs instead",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs of each file")
    args = parser.parse_args()
    smoke = ["--smoke", "--smoke-epochs", str(args.smoke_epochs)] if args.smoke_epochs else []
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(
        f"{'study':<30}{'probe est.':>11}{'run wall':>10}{'pilot est.':>11}"
        f"{'probe err':>10}{'pilot err':>10}{'start-up':>9}{'span':>7}{'warm-up':>8}"
        f"{'rest':>6}"
    )
    for file in args.files:
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as out:
                probe_text, _ = cli("plan", file, *smoke)
                run_text, wall = cli("run", file, *smoke, "--output", out, "--no-report")
                name = re.search(r"study (\S+): \d+ cells", run_text).group(1)
                pilot_text, _ = cli("plan", file, *smoke, "--pilot", name, "--output", out)
                parts = decompose(f"sqlite:///{out}/{name}/mlflow.db", name, wall)
            probe, pilot = wall_estimate(probe_text), wall_estimate(pilot_text)
            label = Path(file).stem + (f" smoke {args.smoke_epochs} ep" if smoke else "")
            print(
                f"{label:<30}{probe:>10.0f}s{wall:>9.1f}s{pilot:>10.0f}s"
                f"{probe / wall - 1:>+10.0%}{pilot / wall - 1:>+10.0%}"
                f"{parts['start_up']:>8.1f}s{parts['span']:>6.1f}s{parts['warm_up']:>7.2f}s"
                f"{parts['rest']:>5.2f}s",
                flush=True,
            )


if __name__ == "__main__":
    main()
