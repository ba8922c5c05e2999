"""What recording and checking cells' identities costs the common path (not a test; issue 39).

The one-cell quickstart (the quickstart's ``ce`` config, seed 0, 15 epochs, a local Ray, a
SQLite store) run with ``studies run`` in a fresh process from two checkouts side by side:
``--baseline`` (the code before, e.g. ``git worktree add /tmp/base <commit>``) and this one,
alternating ``--rounds`` times so that the load of a shared machine falls on both:

- a first run (a new output folder: Ray started, the cell trained and tracked, no report);
- a rerun of the same folder (the cell finished: what "redoes nothing" costs, the identity
  read from MLflow and compared included).

The digest cache is the benchmark's own, warm after a first untimed run of each checkout
(as on a machine that ran a study before). Prints each median and the ratio this / baseline.

    git worktree add /tmp/base main && python benchmarks/identity_overhead.py --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "studies" / "catalog" / "quickstart.yaml"
ONE_CELL = ("design=[{kind: single, variants: [ce]}]", "seeds=[0]", "report={tables: [{metrics: [test/top1]}]}")
CLI = 'import sys; from studies.cli import main; sys.argv[0] = "studies"; sys.exit(main())'


def run(code: Path, output: Path, cache: Path) -> float:
    """Seconds of one `studies run` of the one-cell quickstart with the code of ``code``."""
    env = {**os.environ, "PYTHONPATH": str(code), "SETVALUED_DIGEST_CACHE": str(cache)}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CLI, "run", str(QUICKSTART), *ONE_CELL, "--output", str(output), "--no-report"],
        env=env,
        cwd=code,
        capture_output=True,
        text=True,
        timeout=900,
    )
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{code}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of the code to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    checkouts = {"baseline": args.baseline.resolve(), "this": REPO}
    base = Path(tempfile.mkdtemp(prefix="identity-overhead-"))
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for name, code in checkouts.items():  # warm: bytecode, the digest cache, Ray's files
            run(code, base / f"warm-{name}", base / "cache.sqlite")
        for round_ in range(args.rounds):
            for name, code in checkouts.items():
                output = base / f"{name}-{round_}"
                times.setdefault((name, "first run"), []).append(run(code, output, base / "cache.sqlite"))
                times.setdefault((name, "rerun"), []).append(run(code, output, base / "cache.sqlite"))
            print(f"round {round_ + 1}: " + ", ".join(f"{k[0]} {k[1]} {v[-1]:.1f} s" for k, v in times.items()))
        load = os.getloadavg()
        print(f"\nmedians of {args.rounds} rounds (load average {load[0]:.1f}, {os.cpu_count()} CPUs):")
        for kind in ("first run", "rerun"):
            old, new = (statistics.median(times[(name, kind)]) for name in checkouts)
            print(f"  {kind}: baseline {old:.2f} s, this {new:.2f} s, ratio {new / old:.3f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
