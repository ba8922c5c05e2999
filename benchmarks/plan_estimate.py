"""The compute estimate of `studies plan` against the measured wall time of `studies run`.

For each study file: the estimate from a probe (no pilot), the wall time of
`studies run FILE --no-report` in a fresh output folder (the process, start to end), then the
estimate with that run as the pilot. Prints one line per file; docs/planning.md quotes it.

    python benchmarks/plan_estimate.py studies/catalog/quickstart.yaml [more files]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cli(*args: str) -> tuple[str, float]:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "studies.cli", *args], cwd=REPO,
                            capture_output=True, text=True, check=True)
    return result.stdout, time.perf_counter() - started


def wall_estimate(plan_text: str) -> float:
    match = re.search(r"wall time: ([\d.]+) (s|min|h)", plan_text)
    value, unit = float(match.group(1)), match.group(2)
    return value * {"s": 1, "min": 60, "h": 3600}[unit]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    print(f"{'study':<22}{'probe est.':>11}{'run wall':>10}{'pilot est.':>11}"
          f"{'probe err':>10}{'pilot err':>10}")
    for file in args.files:
        with tempfile.TemporaryDirectory() as out:
            probe_text, _ = cli("plan", file)
            run_text, wall = cli("run", file, "--output", out, "--no-report")
            name = re.search(r"study (\S+): \d+ cells", run_text).group(1)
            pilot_text, _ = cli("plan", file, "--pilot", name, "--output", out)
        probe, pilot = wall_estimate(probe_text), wall_estimate(pilot_text)
        print(f"{Path(file).stem:<22}{probe:>10.0f}s{wall:>9.1f}s{pilot:>10.0f}s"
              f"{probe / wall - 1:>+10.0%}{pilot / wall - 1:>+10.0%}", flush=True)
        print(run_text.splitlines()[0], flush=True)


if __name__ == "__main__":
    main()
