"""`studies compare` at scale (issue 40), a benchmark, not a test: 50 studies x 10 variants x
10 seeds (5,000 finished cells) compared and written (HTML, Markdown, LaTeX, three figures),
the time of each step and the whole against the issue's budget of 30 s.

The studies are rows in the layout `analysis.collect` gives (one per finished cell: ids, swept
values, `test/top5`, `best_val`); each variant of each study also sweeps a hyperparameter of its
own on two values, so that every entry is chosen on validation among two configs (10,000 cells
read in all). Reading 50 studies from MLflow is `collect` per study, measured by
benchmarks/report_scale.py (per cell, the same store reads).

    python benchmarks/compare_scale.py                    # 50 x 10 x 10
    python benchmarks/compare_scale.py --studies 10 --resamples 2000

The machine's load counts: on a shared machine, run it twice and read both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BUDGET_S = 30.0


def synthetic_studies(n_studies: int, n_variants: int, n_seeds: int, seed: int = 0) -> list:
    """StudyRuns of `n_studies` studies: variant j is 0.5 j points better on average, each
    study shifts every variant alike, seeds add noise of sd 1 point."""
    from analysis.comparison import StudyRuns

    rng = np.random.default_rng(seed)
    variants = [f"loss_{j}" for j in range(n_variants)]
    studies = []
    for s in range(n_studies):
        level = rng.uniform(0.5, 0.9)
        rows = []
        for j, variant in enumerate(variants):
            for h, value in enumerate((0.1, 1.0)):
                config = f"s{s}-{variant}-{h}"
                swept = json.dumps({f"loss.h{j}": value})  # its own hyperparameter: not a task
                for seed_ in range(n_seeds):
                    rows.append(
                        {
                            "config_id": config,
                            "variant": variant,
                            "seed": seed_,
                            "swept": swept,
                            "test/top5": float(np.clip(level + 0.005 * j + rng.normal(0, 0.01), 0, 1)),
                            "best_val": float(level + 0.001 * h),
                        }
                    )
        studies.append(StudyRuns(f"study_{s:03d}", rows, variants))
    return studies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--studies", type=int, default=50)
    parser.add_argument("--variants", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--resamples", type=int, default=10_000)
    args = parser.parse_args()

    from analysis.comparison import compare, task_scores, write_comparison

    studies = synthetic_studies(args.studies, args.variants, args.seeds)
    cells = sum(len(s.rows) for s in studies)
    times = {}
    start = time.perf_counter()
    task_scores(studies)
    times["tasks (entries, configs chosen on best_val)"] = time.perf_counter() - start
    start = time.perf_counter()
    comparison = compare(studies, reference="loss_0", n_resamples=args.resamples)
    times["compare (tasks, ranks, Wilcoxon-Holm, bootstrap)"] = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path = write_comparison(comparison, Path(tmp) / "cmp")
        times["write (tables, 3 figures, HTML, Markdown, LaTeX)"] = time.perf_counter() - start
        size = path.stat().st_size
    total = (
        times["compare (tasks, ranks, Wilcoxon-Holm, bootstrap)"]
        + times["write (tables, 3 figures, HTML, Markdown, LaTeX)"]
    )
    print(
        f"{args.studies} studies x {args.variants} variants x {args.seeds} seeds ({cells} cells read, "
        f"{len(comparison.scores.tasks)} tasks), {args.resamples} bootstrap resamples; "
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )
    for step, seconds in times.items():
        print(f"  {step:<52} {seconds:7.2f} s")
    print(f"  {'compare + write':<52} {total:7.2f} s = {total / BUDGET_S:.2f} x the {BUDGET_S:.0f} s budget")
    print(f"  report.html: {size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
