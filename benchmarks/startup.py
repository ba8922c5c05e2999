"""Start-up of `studies run` against plain Ray Tune (issue 42), in fresh processes, side by side.

Each round runs, in alternating order, the commands a person types, each in a fresh process
(its interpreter, its imports and its Ray included):

- ``tune``: plain Ray Tune's one trivial trial (``ray.init()``, a ``Tuner`` with Tune's
  defaults over a function that reports once, ``ray.shutdown()``): the yardstick;
- ``study``: ``studies run`` of a one-cell study (the quickstart's MLP, one epoch, synthetic
  data, its report included) on a local Ray that it starts and stops;
- ``second`` (``--warm``): the same study under another name, run within a minute of a first
  ``studies run --keep-warm`` that left its local Ray warm (`studies.running.warm_ray`),
  then plain Ray Tune's trivial trial joining that same warm Ray (its yardstick);
  ``studies stop --local`` ends that Ray after the round.

The second study's floor: a Tune trial runs in a new worker process whatever Ray is warm, and
a cell's worker, beyond what Tune's trivial trial pays, imports torch and MLflow (its SQL store)
and pays torch's compiler stack once (``torch.optim``'s step imports ``torch._dynamo``; the
Logged Model's ``torch.export``). Those are measured in a fresh process each round
(``NEW_WORKER_SCRIPT``) and added to plain Tune's trial on the warm Ray: what a second study is
made of before any work of its own (its driver's, its cell's training).

and, once, a ``--cells``-cell study of the same cell one at a time (``max_concurrent: 1``):
**cell to cell** is the median gap between one cell run's end and the next one's start (as
MLflow recorded them), what a cell costs beyond its own run.

Where the one-cell study's seconds go: every line of the runner is stamped as it is written
(the child's stdout is wrapped), and the cell run's start and end are read from MLflow, so
each phase (interpreter and imports, validation, checks and tracking, Ray, the ledger, Tune
and the worker up to the cell's run, the cell, the summary, Ray's shutdown, the report) gets
its seconds. Ratios are taken round by round (the machine's load moves both sides alike);
the load average is printed with them.

    python benchmarks/startup.py                       # 3 rounds, 40 cells, a warm second study
    python benchmarks/startup.py --rounds 1 --cells 0  # one round, no cell-to-cell study
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

QUICKSTART = REPO / "studies" / "catalog" / "quickstart.yaml"
_QUICKSTART_BASE = yaml.safe_load(QUICKSTART.read_text())["base"]

#: the quickstart's MLP on its synthetic data, one epoch, one seed, CE
ONE_CELL = {
    "name": "startup",
    "base": {
        "data": _QUICKSTART_BASE["data"],
        "model": _QUICKSTART_BASE["model"],
        "loss": {"name": "ce"},
        "optim": {"lr": 0.1, "batch_size": 64, "milestones": [10]},
        "epochs": 1,
        "eval": {"ks": [1, 5], "selection": "val/top5"},
        "device": "cpu",
    },
    "variants": {"ce": {"loss": {"name": "ce"}}},
    "seeds": [0],
    "resources": {"cpus": 1, "gpus": 0},
}

#: plain Ray Tune's one trivial trial, as its documentation writes it
TUNE_SCRIPT = """
import sys
import ray
from ray import tune

def trainable(config):
    tune.report({"score": 1.0})

ray.init()
tune.Tuner(trainable, run_config=tune.RunConfig(storage_path=sys.argv[1])).fit()
ray.shutdown()
"""

#: plain Ray Tune's trivial trial joining a running Ray (argv: storage, address)
TUNE_WARM_SCRIPT = TUNE_SCRIPT.replace("ray.init()", "ray.init(address=sys.argv[2])")

#: what a cell's new worker pays that Tune's trivial trial does not, each first use timed in
#: one fresh process: torch, MLflow with its SQL store, the first optimizer step (torch's
#: step imports torch._dynamo) and the first torch.export (the Logged Model's format)
NEW_WORKER_SCRIPT = """
import json, time
marks = [time.perf_counter()]
import torch
marks.append(time.perf_counter())
import mlflow, mlflow.store.tracking.sqlalchemy_store
marks.append(time.perf_counter())
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 40))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.randn(8, 64)).sum().backward()
optimizer.step()
marks.append(time.perf_counter())
torch.export.export(model.eval(), (torch.randn(2, 64),))
marks.append(time.perf_counter())
names = ["torch", "MLflow and its SQL store", "first optimizer step (torch._dynamo)", "first torch.export"]
print(json.dumps(dict(zip(names, [b - a for a, b in zip(marks, marks[1:])]))))
"""

#: `studies` as a console script, each line it writes stamped with the wall clock as written
STAMPED_CLI = """
import json, sys, time
STARTED = time.time()

class Stamped:
    def __init__(self, stream, log):
        self.stream, self.log, self.pending = stream, log, ""
    def write(self, text):
        self.pending += text
        while "\\n" in self.pending:
            line, self.pending = self.pending.split("\\n", 1)
            self.log.write(json.dumps([time.time(), line]) + "\\n")
            self.log.flush()
        return self.stream.write(text)
    def flush(self):
        self.stream.flush()
    def isatty(self):
        return False
    def __getattr__(self, name):
        return getattr(self.stream, name)
    def __reduce__(self):  # Tune pickles the progress callback, which holds the stream
        return (getattr, (sys, "__stdout__"))

log = open(sys.argv[1], "w")
log.write(json.dumps([STARTED, "@main"]) + "\\n")
sys.stdout = Stamped(sys.stdout, log)
from studies.cli import console as main
sys.argv = ["studies"] + sys.argv[2:]
code = main()
log.write(json.dumps([time.time(), "@exit"]) + "\\n")
sys.exit(code)
"""


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


#: the warm Rays of this benchmark's commands: a state folder of its own (set by `main`), so that
#: `studies stop --local` ends only those
STATE_DIR: Path | None = None


def env() -> dict[str, str]:
    """The children's environment: this checkout first on the path, warm Rays of their own."""
    out = dict(os.environ)
    if STATE_DIR is not None:
        out["STUDIES_STATE_DIR"] = str(STATE_DIR)
    out["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p])
    out.pop("STUDIES_KEEP_WARM", None)
    return out


def run_tune(folder: Path, warm: bool = False) -> float:
    """Wall seconds of plain Ray Tune's one trivial trial in a fresh process: on a Ray of its
    own, or (`warm`) joining the warm Ray of this benchmark's state folder, with its address
    and authentication as a `studies` driver joins it."""
    script, args, child_env = TUNE_SCRIPT, [], env()
    if warm:
        from studies.running import warm_ray

        os.environ["STUDIES_STATE_DIR"] = str(STATE_DIR)
        running = next(iter(warm_ray.running()), None)
        if running is None:
            raise RuntimeError("no warm Ray to join: the first study's --keep-warm left none")
        script, args = TUNE_WARM_SCRIPT, [running.address]
        if running.auth_mode:
            child_env["RAY_AUTH_MODE"] = running.auth_mode
    storage = folder / f"tune-{time.monotonic_ns()}"
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", script, str(storage), *args], capture_output=True, text=True, env=child_env, timeout=600
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"plain Ray Tune{' on the warm Ray' if warm else ''} failed: {done.stderr[-2000:]}")
    shutil.rmtree(storage, ignore_errors=True)
    return wall


def new_worker_costs() -> dict[str, float]:
    """Seconds of each first use a cell's new worker pays beyond Tune's (NEW_WORKER_SCRIPT)."""
    done = subprocess.run(
        [sys.executable, "-c", NEW_WORKER_SCRIPT], capture_output=True, text=True, env=env(), timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"the new worker's imports failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_study(folder: Path, name: str, cells: int = 1) -> Path:
    study = json.loads(json.dumps(ONE_CELL))
    study["name"] = name
    if cells > 1:  # the same cell, `cells` configs of one seed, one at a time
        rates = [round(0.1 + 0.001 * i, 4) for i in range(cells)]
        study["design"] = [{"kind": "grid", "parameters": {"optim.lr": rates}}]
        study["max_concurrent"] = 1
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def run_study(folder: Path, name: str, *flags: str, cells: int = 1) -> dict:
    """`studies run` of the study `name` in a fresh process: wall seconds, its stamped lines and
    its cell runs' (start, end) in seconds since the epoch."""
    path = write_study(folder, name, cells)
    log = folder / f"{name}.lines"
    output = folder / "out"
    start_wall = time.time()
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", STAMPED_CLI, str(log), "run", str(path), "--output", str(output), *flags],
        capture_output=True,
        text=True,
        env=env(),
        cwd=folder,
        timeout=900,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"studies run {name} failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    return {"wall": wall, "start": start_wall, "lines": lines, "runs": cell_runs(output / name / "mlflow.db", name)}


def cell_runs(db: Path, name: str) -> list[tuple[float, float]]:
    """(start, end) of every cell run of the study, in seconds since the epoch, by start."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    experiment = client.get_experiment_by_name(name)
    runs = client.search_runs([experiment.experiment_id], "tags.`studies.role` = 'cell'", max_results=10_000)
    return sorted((r.info.start_time / 1000.0, r.info.end_time / 1000.0) for r in runs)


#: the runner's lines that open a phase (the first line that starts with the text), in order;
#: None: the end of the activity that the previous mark opened
MARKS = [
    ("interpreter, imports, validation", "@main"),
    ("checks, study folder, tracking store (Ray starting alongside)", "[studies] study "),
    ("the rest of Ray's start", "[studies] starting"),
    ("lease, ledger, parent run", None),
    ("Tune, the trial's worker and its imports", "[studies] running "),
    ("the cell's run (data, model, epoch, test, logging)", "@run-start"),
    ("Tune's end, Ray's shutdown, the ledger's summary", "@run-end"),
    ("report", "[studies] summary:"),
    ("the exit", "[studies] MLflow UI:"),
]


def phases(result: dict) -> list[tuple[str, float]]:
    """(phase, seconds) of a one-cell study from its stamped lines and its cell run."""
    # without a terminal every line starts with the wall-clock time (HH:MM:SS): left out
    events: list[tuple[float, str]] = [(t, text[9:] if text[2:3] == ":" else text) for t, text in result["lines"]]
    if result["runs"]:
        events += [(result["runs"][0][0], "@run-start"), (result["runs"][0][1], "@run-end")]
    events.sort()
    stamps: list[float | None] = []
    for _, prefix in MARKS:
        if prefix is None:  # the end of the activity opened by the previous mark
            opened = stamps[-1]
            found = next((t for t, text in events if opened is not None and t >= opened and ": done in " in text), None)
        else:
            found = next((t for t, text in events if text.startswith(prefix)), None)
        stamps.append(found)
    stamps.append(result["start"] + result["wall"])
    stamps[0] = result["start"]
    out = []
    for i, (label, _) in enumerate(MARKS):
        begin = stamps[i]
        end = next((s for s in stamps[i + 1 :] if s is not None), None)
        if begin is not None and end is not None:
            out.append((label, max(0.0, end - begin)))
    return out


def cell_to_cell(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """(mean, median) seconds between a cell run's end and the next one's start (one at a
    time): the mean is what a cell costs beyond its run, the median its usual gap."""
    gaps = [b[0] - a[1] for a, b in zip(runs, runs[1:])]
    if not gaps:
        return float("nan"), float("nan")
    return statistics.fmean(gaps), statistics.median(gaps)


def stop_local() -> None:
    subprocess.run(
        [sys.executable, "-c", "import sys; from studies.cli import main; sys.exit(main(['stop', '--local']))"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=120,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cells", type=int, default=40, help="cells of the cell-to-cell study (0: skip)")
    parser.add_argument("--no-warm", dest="warm", action="store_false", help="skip the second study on a warm Ray")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)

    global STATE_DIR
    folder = Path(args.workdir or tempfile.mkdtemp(prefix="studies-startup-"))
    folder.mkdir(parents=True, exist_ok=True)
    STATE_DIR = folder / "warm-ray"
    print(f"load average at the start: {load_average()}; {os.cpu_count()} CPUs; {folder}", flush=True)
    tune_s, study_s, second_s, tune_warm_s, worker_costs, breakdowns = [], [], [], [], [], []
    for r in range(args.rounds):
        steps = ["tune", "study"] if r % 2 == 0 else ["study", "tune"]
        for step in steps:
            if step == "tune":
                tune_s.append(run_tune(folder))
            else:
                result = run_study(folder, f"one-{r}")
                study_s.append(result["wall"])
                breakdowns.append(phases(result))
        if args.warm:
            run_study(folder, f"first-{r}", "--keep-warm", "5")
            second = run_study(folder, f"second-{r}")
            second_s.append(second["wall"])
            tune_warm_s.append(run_tune(folder, warm=True))
            stop_local()
            worker_costs.append(new_worker_costs())
        print(
            f"round {r + 1}: plain Ray Tune {tune_s[-1]:.2f} s, one-cell study {study_s[-1]:.2f} s "
            f"({study_s[-1] / tune_s[-1]:.2f}x)"
            + (
                f", second study on a warm Ray {second_s[-1]:.2f} s (plain Ray Tune there {tune_warm_s[-1]:.2f} s)"
                if second_s
                else ""
            )
            + f"; load {load_average()}",
            flush=True,
        )
    ratios = [s / t for s, t in zip(study_s, tune_s)]
    for label, values in (("plain Ray Tune, one trivial trial:", tune_s), ("one-cell study:", study_s)):
        print(f"{label:35s} median {statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})")
    print(f"study / plain Tune, round by round: median {statistics.median(ratios):.2f}x (goal <= 1.5x)")
    if second_s:
        print(f"second study on a warm Ray:        median {statistics.median(second_s):.2f} s (goal <= 5 s)")
        tune_warm = statistics.median(tune_warm_s)
        print(f"plain Ray Tune on that warm Ray:   median {tune_warm:.2f} s")
        costs = {k: statistics.median(c[k] for c in worker_costs) for k in worker_costs[0]}
        print("what a cell's new worker pays beyond Tune's trivial trial (first uses, fresh process, median):")
        for name, seconds in costs.items():
            print(f"  {name:52s} {seconds:6.2f} s")
        floor = tune_warm + sum(costs.values())
        print(
            f"plain Tune on the warm Ray + the worker's first uses: {floor:.2f} s (second study / that: "
            f"{statistics.median(second_s) / floor:.2f}x); plain Tune there + the imports of torch and MLflow "
            f"alone: {tune_warm + costs['torch'] + costs['MLflow and its SQL store']:.2f} s"
        )
    print("\nwhere the one-cell study's seconds go (median over rounds):")
    labels = [label for label, _ in breakdowns[0]]
    for label in labels:
        values = [dict(b).get(label) for b in breakdowns]
        values = [v for v in values if v is not None]
        print(f"  {label:52s} {statistics.median(values):6.2f} s")
    if args.cells > 1:
        many = run_study(folder, "cells", cells=args.cells)
        runs = many["runs"]
        span = runs[-1][1] - runs[0][0]
        mean_gap, median_gap = cell_to_cell(runs)
        print(
            f"\n{args.cells}-cell study, one at a time: cell to cell {mean_gap:.3f} s (mean gap between runs; "
            f"goal <= 0.10 s; median {median_gap:.3f} s), {span / len(runs):.3f} s a cell over the runs' span, "
            f"{statistics.median(b - a for a, b in runs):.3f} s a cell run; wall {many['wall']:.1f} s"
        )
    print(f"load average at the end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
