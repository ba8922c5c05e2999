"""Orchestration benchmark (not a test): runner overhead per cell, and the cost of tracking.

1. Per-cell overhead of `studies run` against a plain Python loop over the same cells.
   Every cell runs `sleep_fit`, a function with the contract of `setvalued.train.fit`
   (docs/interfaces.md section 4) that sleeps `--seconds` split over `--epochs` epochs, so
   the work is known exactly. The runner does everything it does for a real study: one Tune
   trial per cell (actor reuse), a checkpoint and a Tune report every epoch, one MLflow
   `log_batch` per epoch, the final metrics, the per-class Parquet artifact, the ledger.
   Trials run one at a time (`max_concurrent: 1`) so that the overhead is not hidden by
   parallelism. The fixed start-up (MLflow experiment, Tune set-up) is removed by running a
   1-cell study and an N-cell study on the same Ray instance, after a warm-up study:

       overhead per cell = (T_runner(N) - T_runner(1) - (N - 1) * seconds) / (N - 1)

   and the plain loop gives T_loop(N) / N - seconds (about 0). On a loaded machine the
   1-cell study's noise (seconds) divided by N - 1 swamps 0.1 s, so the overhead is also
   taken from the N-cell study alone: the span of its cell runs in MLflow (first start to
   last end) minus N * seconds, over N - 1 (`runner_overhead_per_cell_in_span_s`; an upper
   bound by one run's own overhead over N - 1). Targets: at most 0.10 s per cell and 6 s of
   fixed start-up (issue 34). The same for an `optuna` design of N configs (asked as
   slots free up): its per-cell overhead within 2x the grid's.

2. Cost of tracking one epoch: one `MlflowClient.log_batch` with the metrics of a realistic
   epoch (about 40 keys: the loss, top-K and macro/few/medium/many for 4 K, average-K, lr,
   times, gradient sparsity), median of `--repeats` calls, against the embedded SQLite store
   and (with `--start-server` or `--tracking-uri`) an MLflow server over HTTP; compared with
   a 30-second epoch (target: under 2%) and with one `log_metric` call per key (what
   `MLflowLoggerCallback` does).

3. At scale (`--scale 1000 10000`): for each size N, a study of N trivial cells (N configs,
   one seed, one epoch of no work): `studies run --dry-run` in a fresh process (wall time and
   peak memory: no torch, no Ray), and the runner over all N cells on the local Ray (wall
   time per cell, and the driver's memory sampled every 0.5 s: at the start, its peak, at the
   end, at the start of each experiment part, and when every cell has ended, before the
   summary reads the ledger). The driver's memory must not grow with N beyond a small record per cell: Tune keeps
   every trial of an experiment, so the runner runs parts of at most
   `studies.running.session.MAX_TRIALS_PER_EXPERIMENT` trials.

    python benchmarks/orchestration.py                      # issue's size: 100 cells of 1 s
    python benchmarks/orchestration.py --cells 20 --seconds 0.5 --start-server
    python benchmarks/orchestration.py --scale 1000 10000   # dry run and driver memory
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def sleep_fit(config, seed, on_epoch=None, checkpoint=None, *, seconds: float):
    """`fit` contract with known work: sleep `seconds` split evenly over the config's
    epochs, report realistic metrics; resumable from its own state."""
    epochs = int(config["epochs"])
    start = 0 if checkpoint is None else int(checkpoint["epoch"]) + 1
    for epoch in range(start, epochs):
        time.sleep(seconds / epochs)
        if on_epoch is not None:
            on_epoch(epoch, epoch_metrics(epoch), {"epoch": epoch})
    return {
        "best_epoch": epochs - 1,
        "best_val": 0.5,
        "test": {k.split("/", 1)[1]: v for k, v in epoch_metrics(0).items() if k.startswith("val/")},
        "per_class": {"class": list(range(10)), "top5": [0.5] * 10},
        "history": [],
    }


def epoch_metrics(epoch: int) -> dict[str, float]:
    """A realistic epoch's metrics (keys as setvalued.training reports them)."""
    metrics = {
        "train/loss": 1.0 / (epoch + 1),
        "lr": 0.1,
        "epoch_time_s": 30.0,
        "eval_time_s": 2.0,
        "grad_nonzero": 5.0,
        "grad_nonzero_active": 5.5,
    }
    for k in (1, 3, 5, 10):
        for prefix in ("", "macro_", "few/", "medium/", "many/"):
            metrics[f"val/{prefix}top{k}"] = 0.5 + 0.01 * k
    for prefix in ("", "macro_", "few/", "medium/", "many/"):
        metrics[f"val/{prefix}avg5"] = 0.6
    metrics["val/avg5_size"] = 5.0
    metrics["val/avg5_threshold"] = 0.1
    return metrics


def study_text(name: str, cells: int, seconds: float, epochs: int, design: str = "grid") -> str:
    """`cells` configs x 1 seed; each config differs by its lr (the swept value): a grid of
    lr values, or (`design="optuna"`) `cells` configs proposed by Optuna's TPE sampler."""
    study = {
        "name": name,
        "description": "orchestration benchmark",
        "base": {
            "data": {"name": "synthetic", "num_classes": 20},
            "model": {"name": "mlp", "hidden_dim": 8},
            "loss": {"name": "ce"},
            "optim": {"lr": 0.1, "milestones": []},
            "epochs": int(epochs),
            "eval": {"ks": [1, 5]},
            "device": "cpu",
        },
        "design": [{"kind": "grid", "parameters": {"optim.lr": [round(0.001 * (i + 1), 6) for i in range(cells)]}}],
        "seeds": [0],
        "resources": {"cpus": 1},
        "max_concurrent": 1,
        "max_failures": 0,
    }
    if design == "optuna":
        study["design"] = [
            {
                "kind": "optuna",
                "n_configs": int(cells),
                "sampler_seed": 0,
                "parameters": {"optim.lr": {"loguniform": [1.0e-4, 1.0]}},
            }
        ]
        study["objective"] = {"metric": "val/top1", "mode": "max"}
    return yaml.safe_dump(study, sort_keys=False)


def time_runner(
    folder: Path, name: str, cells: int, seconds: float, epochs: int, tracking_uri: str | None, design: str = "grid"
) -> float:
    from studies.running.runner import RunOptions, run_study

    path = folder / f"{name}.yaml"
    path.write_text(study_text(name, cells, seconds, epochs, design))
    options = RunOptions(
        output=folder / "out",
        tracking_uri=tracking_uri,
        report=False,
        fit_fn=functools.partial(sleep_fit, seconds=seconds),
        stream=io.StringIO(),
        progress_interval_s=1e9,
    )
    start = time.perf_counter()
    outcome = run_study(path, options)
    elapsed = time.perf_counter() - start
    if outcome.exit_code != 0 or outcome.finished != cells:
        raise RuntimeError(f"benchmark study {name} did not finish: {outcome}")
    return elapsed


def runs_span(folder: Path, name: str, tracking_uri: str | None) -> tuple[float, int]:
    """(seconds from the first cell run's start to the last one's end, cell runs) of the study
    `name`: its cells back to back, without the study's fixed start-up (the runs' own times,
    in milliseconds, as MLflow recorded them)."""
    from mlflow import MlflowClient

    uri = tracking_uri or f"sqlite:///{(folder / 'out' / name / 'mlflow.db').resolve()}"
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(name)
    runs = client.search_runs([experiment.experiment_id], "tags.`studies.role` = 'cell'", max_results=10_000)
    span_ms = max(r.info.end_time for r in runs) - min(r.info.start_time for r in runs)
    return span_ms / 1000.0, len(runs)


def rss_mb() -> float:
    """This process's resident memory (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def time_dry_run(folder: Path, cells: int) -> dict[str, float]:
    """`studies run --dry-run` of an N-cell study in a fresh process: wall time, peak MB."""
    path = folder / f"dry-{cells}.yaml"
    path.write_text(
        study_text(f"dry-{cells}", cells, 0.0, 1).replace(
            "max_failures: 0", f"max_failures: 0\nmax_cells: {max(cells, 1)}"
        )
    )
    code = (
        "import resource, sys, time; t = time.perf_counter(); "
        "from studies.cli import main; sys.argv = ['studies', 'run', sys.argv[1], '--dry-run']; "
        "code = main(); print('RESULT', time.perf_counter() - t, "
        "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024); sys.exit(code)"
    )
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    wall = time.perf_counter() - start
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"dry run of {cells} cells failed: {done.stderr[-2000:]}")
    _, inside, peak = line.split()
    return {"process_wall_s": wall, "in_process_s": float(inside), "peak_mb": float(peak)}


def time_runner_at_scale(folder: Path, cells: int, concurrency: int) -> dict[str, float]:
    """The runner over `cells` trivial cells (one epoch of no work), `concurrency` at a time:
    wall time per cell and the driver's memory (sampled every 0.5 s)."""
    import threading

    from studies.running.runner import RunOptions, run_study

    name = f"scale-{cells}"
    path = folder / f"{name}.yaml"
    path.write_text(
        study_text(name, cells, 0.0, 1)
        .replace("max_concurrent: 1", f"max_concurrent: {concurrency}")
        .replace("max_failures: 0", f"max_failures: 0\nmax_cells: {max(cells, 1)}\nlog_models: false")
    )
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            samples.append(rss_mb())

    stream = PartMemoryStream(samples)
    options = RunOptions(
        output=folder / "out",
        report=False,
        stream=stream,
        fit_fn=functools.partial(sleep_fit, seconds=0.0),
        progress_interval_s=1e9,
    )
    start_mb = rss_mb()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    outcome = run_study(path, options)
    elapsed = time.perf_counter() - start
    stop.set()
    sampler.join()
    if outcome.exit_code != 0 or outcome.finished != cells:
        raise RuntimeError(f"scale study of {cells} cells did not finish: {outcome}")
    return {
        "wall_s": elapsed,
        "per_cell_s": elapsed / cells,
        "concurrency": concurrency,
        "driver_start_mb": start_mb,
        "driver_peak_mb": max(samples or [start_mb]),
        "driver_end_mb": rss_mb(),
        "driver_mb_at_part_starts": stream.part_mb,
        "driver_mb_after_cells": stream.cells_done_mb,
        "driver_peak_mb_while_cells_ran": max(samples[: stream.cells_done_samples] or [start_mb]),
    }


class PartMemoryStream(io.StringIO):
    """The runner's output, with the driver's memory when each experiment part starts (after
    the previous part's garbage is collected) and at the last experiment's final counts
    (every cell ended, the summary's ledger read not started), and how many of `samples`
    (the sampler's list) were taken by then."""

    def __init__(self, samples: list[float]):
        super().__init__()
        self.samples = samples
        self.part_mb: list[float] = []
        self.cells_done_mb: float | None = None
        self.cells_done_samples = 0

    def write(self, text: str) -> int:
        from studies.running.session import PART_LINE

        if text.startswith(f"[studies] {PART_LINE} "):
            self.part_mb.append(round(rss_mb(), 1))
        elif text.startswith("[studies] done "):  # an experiment's final counts (interval 1e9 s)
            self.cells_done_mb = round(rss_mb(), 1)
            self.cells_done_samples = len(self.samples)
        return super().write(text)


def time_loop(cells: int, seconds: float, epochs: int) -> float:
    config = {"epochs": epochs}
    start = time.perf_counter()
    for _ in range(cells):
        sleep_fit(config, 0, seconds=seconds)
    return time.perf_counter() - start


def time_log_batch(tracking_uri: str, repeats: int) -> dict[str, float]:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient(tracking_uri)
    name = f"bench-tracking-{os.getpid()}-{int(time.time())}"
    experiment_id = client.create_experiment(name)
    run_id = client.create_run(experiment_id).info.run_id
    batch, single = [], []
    for epoch in range(repeats):
        metrics = epoch_metrics(epoch)
        stamp = int(time.time() * 1000)
        start = time.perf_counter()
        client.log_batch(run_id, metrics=[Metric(k, v, stamp, epoch) for k, v in metrics.items()], synchronous=True)
        batch.append(time.perf_counter() - start)
    for epoch in range(min(repeats, 5)):
        start = time.perf_counter()
        for key, value in epoch_metrics(epoch).items():
            client.log_metric(run_id, key, value, step=1000 + epoch)
        single.append(time.perf_counter() - start)
    return {
        "keys": len(epoch_metrics(0)),
        "log_batch_median_s": statistics.median(batch),
        "log_batch_p90_s": sorted(batch)[int(0.9 * (len(batch) - 1))],
        "log_metric_per_key_median_s": statistics.median(single),
    }


def start_server(folder: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    process = subprocess.Popen(
        [
            shutil.which("mlflow") or "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{folder / 'server.db'}",
            "--artifacts-destination",
            str(folder / "server-artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                return process, uri
        except OSError:
            time.sleep(0.5)
    os.killpg(process.pid, signal.SIGTERM)
    raise RuntimeError("mlflow server did not start")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=int, default=100, help="cells (default 100)")
    parser.add_argument("--seconds", type=float, default=1.0, help="work per cell in seconds (default 1.0)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per cell (default 3)")
    parser.add_argument("--repeats", type=int, default=50, help="log_batch calls timed (default 50)")
    parser.add_argument(
        "--tracking-uri", default=None, help="MLflow server to use (default: the embedded SQLite store)"
    )
    parser.add_argument(
        "--start-server",
        action="store_true",
        help="also start a local `mlflow server` and time log_batch over "
        "HTTP against it (the runner itself uses --tracking-uri or the "
        "embedded SQLite store)",
    )
    parser.add_argument("--num-cpus", type=int, default=2, help="local Ray CPUs (default 2)")
    parser.add_argument(
        "--no-optuna",
        dest="optuna",
        action="store_false",
        help="skip the optuna design's studies (a quicker side-by-side run)",
    )
    parser.add_argument("--json", default=None, help="write the numbers to this file")
    parser.add_argument(
        "--scale",
        type=int,
        nargs="+",
        default=None,
        help="instead: dry run and the runner over N trivial cells, for each N",
    )
    args = parser.parse_args(argv)
    if args.scale:
        return scale_main(args)

    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    results: dict = {"cells": args.cells, "seconds": args.seconds, "epochs": args.epochs}
    server = None
    with tempfile.TemporaryDirectory(prefix="studies-bench-") as tmp:
        folder = Path(tmp)
        try:
            uri = args.tracking_uri  # the runner tracks to this, else the embedded SQLite
            server_uri = args.tracking_uri
            if args.start_server:
                server, started_uri = start_server(folder)
                server_uri = server_uri or started_uri
            results["runner_tracking"] = uri or "sqlite (embedded)"
            ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
            loop = time_loop(args.cells, args.seconds, args.epochs)
            # warm-up (Ray worker start, first imports in the workers): not measured
            time_runner(folder, "bench-warmup", 2, args.seconds, args.epochs, uri)
            one = time_runner(folder, "bench-one", 1, args.seconds, args.epochs, uri)
            many = time_runner(folder, "bench-many", args.cells, args.seconds, args.epochs, uri)
            optuna_one = optuna_many = float("nan")
            if args.optuna:
                optuna_one = time_runner(folder, "bench-optuna-one", 1, args.seconds, args.epochs, uri, design="optuna")
                optuna_many = time_runner(
                    folder, "bench-optuna-many", args.cells, args.seconds, args.epochs, uri, design="optuna"
                )
            ray.shutdown()
            results["loop_s"] = loop
            results["loop_overhead_per_cell_s"] = loop / args.cells - args.seconds
            results["runner_1_cell_s"] = one
            results["runner_n_cells_s"] = many
            denominator = max(1, args.cells - 1)
            results["runner_overhead_per_cell_s"] = (many - one - (args.cells - 1) * args.seconds) / denominator
            # the same from the N-cell study alone (no 1-cell study's start-up subtracted: on
            # a loaded machine its noise, divided by N - 1, swamps a 0.1 s overhead)
            span, runs = runs_span(folder, "bench-many", uri)
            results["runner_cells_span_s"] = span
            results["runner_overhead_per_cell_in_span_s"] = (span - runs * args.seconds) / max(1, runs - 1)
            results["runner_fixed_startup_s"] = one - args.seconds
            results["optuna_overhead_per_cell_s"] = (
                optuna_many - optuna_one - (args.cells - 1) * args.seconds
            ) / denominator
            stores = {"sqlite": f"sqlite:///{folder / 'bench-tracking.db'}"}
            if server_uri:
                stores["server"] = server_uri
            for label, store in stores.items():
                numbers = time_log_batch(store, args.repeats)
                numbers["share_of_30s_epoch"] = numbers["log_batch_median_s"] / 30.0
                results[f"tracking_{label}"] = numbers
        finally:
            if ray.is_initialized():
                ray.shutdown()
            if server is not None:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(timeout=30)

    print(json.dumps(results, indent=2))
    print(
        f"\nrunner overhead per cell: {results['runner_overhead_per_cell_s']:.3f} s, "
        f"{results['runner_overhead_per_cell_in_span_s']:.3f} s within the cells' span "
        f"(target <= 0.10 s; plain loop {results['loop_overhead_per_cell_s']:.4f} s); "
        f"fixed start-up {results['runner_fixed_startup_s']:.1f} s (target <= 6 s)"
    )
    print(
        f"optuna design overhead per cell: {results['optuna_overhead_per_cell_s']:.3f} s "
        f"(target: within 2x the grid's, here x"
        f"{results['optuna_overhead_per_cell_s'] / max(1e-9, results['runner_overhead_per_cell_s']):.2f})"
    )
    for label in ("sqlite", "server"):
        numbers = results.get(f"tracking_{label}")
        if numbers:
            print(
                f"tracking one epoch ({label}, {numbers['keys']} metrics, one log_batch): "
                f"{1000 * numbers['log_batch_median_s']:.1f} ms = "
                f"{100 * numbers['share_of_30s_epoch']:.3f}% of a 30 s epoch (target < 2%); "
                f"one log_metric per key: "
                f"{1000 * numbers['log_metric_per_key_median_s']:.0f} ms"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def scale_main(args) -> int:
    """Part 3 of the module docstring: the goals of the scale issue at each size."""
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="studies-scale-") as tmp:
        folder = Path(tmp)
        for cells in args.scale:
            results[cells] = {"dry_run": time_dry_run(folder, cells)}
        ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
        try:
            time_runner(folder, "scale-warmup", 2, 0.0, 1, None)
            for cells in args.scale:
                results[cells]["runner"] = time_runner_at_scale(folder, cells, args.num_cpus)
                print(json.dumps({cells: results[cells]}), flush=True)
        finally:
            ray.shutdown()
    print("\n| cells | dry run (goal < 3 s, 400 MB) | runner per cell (concurrency) | driver MB start / peak / end |")
    print("|---|---|---|---|")
    for cells, r in results.items():
        d, run = r["dry_run"], r.get("runner", {})
        print(
            f"| {cells:,} | {d['process_wall_s']:.2f} s, {d['peak_mb']:.0f} MB | "
            f"{run.get('per_cell_s', float('nan')):.3f} s ({run.get('concurrency')}) | "
            f"{run.get('driver_start_mb', 0):.0f} / {run.get('driver_peak_mb', 0):.0f} / "
            f"{run.get('driver_end_mb', 0):.0f} |"
        )
    for cells, r in results.items():
        run = r.get("runner", {})
        print(
            f"{cells:,} cells: driver MB at each part's start {run.get('driver_mb_at_part_starts')}, "
            f"when every cell had ended {run.get('driver_mb_after_cells')} (peak until then "
            f"{run.get('driver_peak_mb_while_cells_ran', 0):.0f})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
