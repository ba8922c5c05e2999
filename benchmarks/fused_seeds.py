"""Seeds fused into one model (issue 35), on the CPU: what one member-step costs fused.

For the quickstart's MLP and a small DenseNet-BC (depth 10, growth 12, on 3 x 32 x 32 synthetic
images), for N = 1, 2, 4, 8 seeds of one config: N separate trials (``setvalued.training.Trial``,
each its own step) against one fused array of N members (``setvalued.fused.Array``), on the same
batches. Per member-step (one member's forward, loss, backward and optimizer step, with its
batch fetched and its running metrics):

- wall time, the best of ``--rounds`` interleaved rounds of ``--steps`` steps;
- aten operators dispatched per step (counted with a ``TorchDispatchMode``; on a GPU each is
  about one kernel launch): forward, loss, backward, optimizer step and running metrics, the
  epoch's set-up left out (3 steps' count less 1 step's, halved).

Then the 8-seed MLP study: ``fit`` of 8 seeds one after the other against ``fit_array`` of the
8 (``--epochs`` epochs, validation and test included). Every figure is printed beside its
ratio to the separate trials, measured in the same run (the machine's load cancels out).

``--end-to-end ROUNDS`` (issue 42) runs that study as a person does, ``studies run`` in a fresh
process (Ray, MLflow, the report and the interpreter included), in three forms taken in turn
each round: **separate** trials (``cpus: 1`` a trial, as many at once as CPUs), **packed**
trials (``cpus: 0.25``: four on a CPU), one **fused** array (``seeds_per_trial: 8``: the array
takes the eight trials' CPUs, up to the machine's) and **fused-1cpu** (the same array on one
CPU, ``per_array: {cpus: 1}``; ``--forms`` picks some); the ratios to the separate form are
taken round by round, and each run's seconds are split into the cells (first cell run's start
to the last one's end, in MLflow) and the rest; the separate form's rest over its whole bounds
what fusing can save end to end (an array of no time at all would still take that much). The
fused form's probe is kept between runs as it is between a person's studies (the first round's
probe is in its figure).

    python benchmarks/fused_seeds.py                  # a few minutes on 2 cores
    python benchmarks/fused_seeds.py --steps 3 --rounds 1 --members 1 2 --study-epochs 1   # plumbing
    python benchmarks/fused_seeds.py --models --study-epochs 0 --end-to-end 3   # whole studies
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from setvalued.fused import Array, fit_array
from setvalued.training import Trial, fit, resolve_config

QUICKSTART = REPO / "studies" / "catalog" / "quickstart.yaml"
_QUICKSTART_BASE = yaml.safe_load(QUICKSTART.read_text())["base"]

#: the quickstart's MLP study (its data and model) with the noised top-K loss
MLP = {
    "data": _QUICKSTART_BASE["data"],
    "model": _QUICKSTART_BASE["model"],
    "loss": {"name": "noised_topk", "k": 5, "epsilon": 0.1, "n_samples": 5},
    "optim": {"lr": 0.1, "batch_size": 64, "milestones": [10], "weight_decay": 1e-4},
    "eval": {"ks": [1, 3, 5, 10], "selection": "val/top5"},
    "device": "cpu",
}
DENSENET = {
    **MLP,
    "data": {
        "name": "synthetic",
        "num_classes": 40,
        "num_superclasses": 8,
        "train_size": 1024,
        "val_size": 128,
        "test_size": 128,
        "form": "images",
    },
    "model": {"name": "densenet_bc_cifar", "depth": 10, "growth_rate": 12},
}
MODELS = {"mlp": MLP, "densenet_bc": DENSENET}


class OperatorCount(TorchDispatchMode):
    """Counts the aten operators dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def separate_steps(trials: list[Trial], steps: int) -> float:
    """Seconds of ``steps`` steps of every trial, one trial after the other."""
    start = time.perf_counter()
    for trial in trials:
        trial.step.set_learning_rate(0)
        running = trial.start_training(0)
        trial.step.train_on(_first(trial.epoch_batches(0), steps), running)
        running.fold()
    return time.perf_counter() - start


def fused_steps(array: Array, steps: int) -> float:
    start = time.perf_counter()
    _, running, _ = array.train_steps(0, steps)
    running.fold()
    return time.perf_counter() - start


def _first(iterable, n):
    for i, item in enumerate(iterable):
        if i >= n:
            return
        yield item


def operators(run) -> int:
    with OperatorCount() as counter:
        run()
    return counter.count


def measure(name: str, members: int, steps: int, rounds: int) -> dict:
    cfg = resolve_config({**MODELS[name], "epochs": 1})
    seeds = list(range(members))
    trials = [Trial(cfg, seed) for seed in seeds]
    array = Array(cfg, seeds)
    separate_steps(trials, 1), fused_steps(array, 1)  # warm-up
    separate, fused = [], []
    for r in range(rounds):
        order = [(separate, lambda: separate_steps(trials, steps)), (fused, lambda: fused_steps(array, steps))]
        for times, run in order if r % 2 == 0 else order[::-1]:
            times.append(run())
    per = members * steps
    # a step's own operators: those of 3 steps less those of 1 (the epoch's set-up, its batch
    # order and running metrics, counted once), per step and member
    ops_separate = (operators(lambda: separate_steps(trials, 3)) - operators(lambda: separate_steps(trials, 1))) / (
        2 * members
    )
    ops_fused = (operators(lambda: fused_steps(array, 3)) - operators(lambda: fused_steps(array, 1))) / (2 * members)
    return {
        "model": name,
        "N": members,
        "separate_ms": 1e3 * min(separate) / per,
        "fused_ms": 1e3 * min(fused) / per,
        "separate_ops": ops_separate,
        "fused_ops": ops_fused,
    }


def study(epochs: int, members: int = 8) -> tuple[float, float]:
    """Seconds of an ``members``-seed MLP study, separate trials against one fused array."""
    cfg = {**MLP, "epochs": epochs, "optim": {**MLP["optim"], "milestones": [epochs]}}
    start = time.perf_counter()
    for seed in range(members):
        fit(cfg, seed)
    separate = time.perf_counter() - start
    start = time.perf_counter()
    fit_array(cfg, list(range(members)))
    return separate, time.perf_counter() - start


#: the three forms of the 8-seed study end to end: their `resources`
FORMS = {
    "separate": {"cpus": 1},
    "packed": {"cpus": 0.25},
    "fused": {"cpus": 1, "seeds_per_trial": 8},
    "fused-1cpu": {"cpus": 1, "seeds_per_trial": 8, "per_array": {"cpus": 1}},
}


def study_file(folder: Path, form: str, epochs: int, members: int = 8) -> Path:
    """The 8-seed MLP study (the quickstart's data and MLP, noised top-K) in one `FORMS`' form."""
    import yaml

    config = {**MLP, "epochs": epochs, "optim": {**MLP["optim"], "milestones": [epochs]}}
    study = {
        "name": f"fused-{form}-{time.monotonic_ns()}",
        "base": config,
        "variants": {"noised": {}},
        "seeds": list(range(members)),
        "resources": FORMS[form],
    }
    path = folder / f"{study['name']}.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def run_form(folder: Path, form: str, epochs: int) -> dict:
    """`studies run` of the study in `form`, in a fresh process: wall seconds, the cells' span."""
    import json
    import os
    import subprocess

    path = study_file(folder, form, epochs)
    name = path.stem
    env = dict(os.environ, STUDIES_STATE_DIR=str(folder / "state"))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("STUDIES_KEEP_WARM", None)
    code = "import sys; from studies.cli import console; sys.argv[0] = 'studies'; sys.exit(console())"
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, "run", str(path), "--output", str(folder / "out")],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
        timeout=1800,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{form}: studies run failed: {done.stdout[-1500:]}{done.stderr[-1500:]}")
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{folder / 'out' / name / 'mlflow.db'}")
    runs = client.search_runs(
        [client.get_experiment_by_name(name).experiment_id], "tags.`studies.role` = 'cell'", max_results=100
    )
    span = (max(r.info.end_time for r in runs) - min(r.info.start_time for r in runs)) / 1000.0
    line = next((x for x in done.stdout.splitlines() if "[studies] running " in x), "")
    return {"wall": wall, "cells": span, "line": json.dumps(line.split("[studies] ", 1)[-1])}


def end_to_end(rounds: int, epochs: int, forms: list[str] | None = None) -> None:
    """The 8-seed study through `studies run` in its forms (`FORMS`), interleaved (module docstring)."""
    import statistics
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="fused-end-to-end-"))
    print(f"\n8-seed MLP study end to end ({epochs} epochs; `studies run` in fresh processes; {folder})")
    print(f"load average at the start: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    forms = list(forms or FORMS)
    if "separate" not in forms:
        forms.insert(0, "separate")  # the ratios' yardstick
    results: dict[str, list[dict]] = {form: [] for form in forms}
    for r in range(rounds):
        order = forms[r % len(forms) :] + forms[: r % len(forms)]
        for form in order:
            results[form].append(run_form(folder, form, epochs))
        print(
            f"round {r + 1}: "
            + ", ".join(
                f"{form} {results[form][-1]['wall']:.1f} s (cells {results[form][-1]['cells']:.1f} s)" for form in forms
            )
            + f"; load {' '.join(Path('/proc/loadavg').read_text().split()[:3])}",
            flush=True,
        )
    for form in forms:
        walls = [x["wall"] for x in results[form]]
        ratios = [x["wall"] / y["wall"] for x, y in zip(results[form], results["separate"])]
        print(
            f"  {form:<9} median {statistics.median(walls):5.1f} s ({min(walls):.1f}-{max(walls):.1f}), "
            f"cells {statistics.median(x['cells'] for x in results[form]):4.1f} s, "
            f"{statistics.median(ratios):.2f}x the separate trials; {results[form][-1]['line']}"
        )
    outside = [(x["wall"] - x["cells"]) / x["wall"] for x in results["separate"]]
    print(
        f"  bound: the separate form's time outside its cells is {statistics.median(outside):.2f}x its whole "
        f"({min(outside):.2f}-{max(outside):.2f}): what any form pays alike (Ray, Tune, the imports, the "
        "report), the least a fused study could take were its array free"
    )
    print(f"load average at the end: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--members", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=10, help="steps a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--study-epochs", type=int, default=3, help="epochs of the 8-seed MLP study (0: skip)")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (a Ray trial's CPU)")
    parser.add_argument(
        "--end-to-end", type=int, default=0, metavar="ROUNDS", help="the 8-seed study through `studies run` (0: skip)"
    )
    parser.add_argument("--end-to-end-epochs", type=int, default=3)
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS), help="the forms end to end")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"fused seeds on the CPU ({args.threads} thread(s)); per member-step, fused / separate")
    print(
        f"{'model':<12} {'N':>2} {'sep ms':>8} {'fused ms':>9} {'time':>6} {'sep ops':>8} {'fused ops':>9} {'ops':>6}"
    )
    for name in args.models:
        for n in args.members:
            row = measure(name, n, args.steps, args.rounds)
            print(
                f"{name:<12} {n:>2} {row['separate_ms']:>8.2f} {row['fused_ms']:>9.2f} "
                f"{row['fused_ms'] / row['separate_ms']:>5.2f}x {row['separate_ops']:>8.0f} "
                f"{row['fused_ops']:>9.0f} {row['fused_ops'] / row['separate_ops']:>5.2f}x",
                flush=True,
            )
    if args.study_epochs > 0:
        separate, fused = study(args.study_epochs)
        print(
            f"8-seed MLP study, {args.study_epochs} epochs: separate {separate:.1f} s, fused {fused:.1f} s "
            f"({fused / separate:.2f}x)"
        )
    if args.end_to_end > 0:
        end_to_end(args.end_to_end, args.end_to_end_epochs, args.forms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
