"""GPU throughput benchmark (not a test; issue #24): cells per GPU-hour of a paper-protocol study.

A study of the papers' CIFAR-100 protocol (DenseNet-BC 40-40, batch 64; CE, noised top-K and
smooth top-K SVM x seeds, `--epochs` epochs a cell) on CIFAR-100-shaped data written in the
official format (random class-coloured images: the throughput does not depend on the pixels) is
run through the runner of `studies run` (`studies.running.runner.run_study`, on one local Ray instance
started once, so that Ray's start-up is not counted) for every combination of

- `resources.gpus`: 1, 0.5, 0.25, 0.125 (how many trials share the GPU),
- `compile`: none, model (the trial config field),
- the data: `device` (`data.placement: device`, one CPU a trial) or `loader`
  (`data.placement: loader`, `--loader-workers` DataLoader workers and as many CPUs a trial:
  4, or the Ray's CPUs when it has fewer, so the defaults run on a 2-CPU machine),

and prints one table with the device's name. Per row, from the study's MLflow runs:

- cells/h: cells / (last cell's end - first cell's start) x 3600, the study's rate once Ray is up;
- img/s: one trial's training images per second (training images / `epoch_time_s`, the median
  over cells and epochs), and the same of the first epoch alone (a fresh worker's warm-up);
- overhead/cell: the mean over cells of (run wall time - its epochs' `epoch_time_s` and
  `eval_time_s`): start-up, model building, compilation, logging;
- share: the trials that shared each GPU, as the runner printed it.

On a GPU (the issue's goals, H200: cells per GPU-hour 4x `gpus: 1 / compile none / loader`,
one trial's img/s 2.5x, overhead per cell <= 3 s):

    python benchmarks/gpu_throughput.py                            # the full grid, ~1 h on an H200
    python benchmarks/gpu_throughput.py --gpus 1 0.25 --compile none model --data device

`--seeds-per-trial N ...` (issue #35) replaces the grid by, for each N, the N seeds of each loss
trained three ways, compile none, each a study of its own: `separate` (one trial after another,
`gpus: 1`), `packed` (N trials side by side, `gpus: 1/N`, the process packing above) and
`fused` (one trial of `resources.seeds_per_trial: N`, an array of N models trained as one,
`gpus: 1`); first the baseline, one eager trial (one seed, `gpus: 1`). Per row: the images
trained (cells x epochs x training images: the same in the three rows of an N), the study's
images/s from its first cell's start to its last cell's end (validation, start-up and logging
included), that rate as a multiple of one eager trial's, cells per hour, and the training
images/s of one trial (a fused trial trains N members).

    python benchmarks/gpu_throughput.py --seeds-per-trial 1 4 8 --data device --losses ce

On the CPU (`--device cpu`: tiny settings, a Ray GPU that is only a resource label, trials on
the CPU), which exercises the plumbing only:

    python benchmarks/gpu_throughput.py --device cpu --gpus 0.5 --compile none --data device
    python benchmarks/gpu_throughput.py --device cpu --seeds-per-trial 2 --data device --losses ce

docs/throughput.md says how to run it on a lent GPU machine.
"""

from __future__ import annotations

import argparse
import io
import itertools
import os
import pickle
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: the protocol of the issue's measurements, and the tiny one of `--device cpu`
PROTOCOL = {
    "cuda": {
        "model": {"name": "densenet_bc_cifar", "depth": 40, "growth_rate": 40},
        "per_class_train": 500,
        "per_class_test": 100,
        "val_size": 5000,
        "batch_size": 64,
        "epochs": 2,
        "seeds": 2,
    },
    "cpu": {
        "model": {"name": "small_cnn", "hidden_dim": 8},
        "per_class_train": 4,
        "per_class_test": 1,
        "val_size": 100,
        "batch_size": 32,
        "epochs": 1,
        "seeds": 1,
    },
}
LOSSES = {
    "ce": {"name": "ce"},
    "noised_topk": {"name": "noised_topk", "k": 5, "epsilon": 0.2, "n_samples": 10},
    "smooth_svm": {"name": "smooth_topk_svm", "k": 5, "tau": 1.0, "alpha": 1.0},
}


#: DataLoader workers (and CPUs) of a `loader` trial, on a machine with that many CPUs
DEFAULT_LOADER_WORKERS = 4


def loader_workers(asked: int | None, cpus: int) -> int | None:
    """The DataLoader workers of a loader trial on a Ray of `cpus` CPUs: `asked`, else
    `DEFAULT_LOADER_WORKERS` cut to the CPUs (a trial asks for as many CPUs as workers, and a
    trial that asks for more than the cluster has never starts); None when `asked` is more."""
    if asked is None:
        return max(1, min(DEFAULT_LOADER_WORKERS, int(cpus)))
    return int(asked) if 0 <= int(asked) <= int(cpus) else None


def write_cifar(root: Path, per_class_train: int, per_class_test: int) -> Path:
    """CIFAR-100 in the official `cifar-100-python` layout: pickled dicts with 'data'
    (N x 3072 uint8, channel-major), 'fine_labels', 'coarse_labels'; 'meta' with the names."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, per_class in (("train", per_class_train), ("test", per_class_test)):
        fine = rng.permutation(np.repeat(np.arange(100), per_class))
        colour = rng.integers(0, 256, (100, 3), dtype=np.uint8)[fine]  # one colour per class
        data = np.repeat(colour, 1024, axis=1).astype(np.int16) + rng.integers(-40, 41, (len(fine), 3072))
        with open(folder / name, "wb") as f:
            pickle.dump(
                {
                    "data": np.clip(data, 0, 255).astype(np.uint8),
                    "fine_labels": fine.tolist(),
                    "coarse_labels": (fine // 5).tolist(),
                    "filenames": [""] * len(fine),
                    "batch_label": name,
                },
                f,
                protocol=2,
            )
    with open(folder / "meta", "wb") as f:
        pickle.dump(
            {"fine_label_names": [f"c{i}" for i in range(100)], "coarse_label_names": [f"g{i}" for i in range(20)]},
            f,
            protocol=2,
        )
    return root


def study(
    name: str,
    root: Path,
    device: str,
    gpus: float,
    compile_mode: str,
    data: str,
    loader_workers: int,
    epochs: int,
    seeds: int,
    losses: list[str],
    seeds_per_trial: int = 1,
) -> dict:
    """The paper-protocol study of one row of the table."""
    p = PROTOCOL[device]
    workers = loader_workers if data == "loader" else 0
    resources = {"cpus": max(1, workers), "gpus": gpus}
    if seeds_per_trial > 1:
        resources["seeds_per_trial"] = seeds_per_trial
    return {
        "name": name,
        "description": "GPU throughput benchmark (issue #24)",
        "base": {
            "data": {
                "name": "cifar100",
                "root": str(root),
                "val_size": p["val_size"],
                "num_workers": workers,
                "placement": data,
            },
            "model": dict(p["model"]),
            "loss": {"name": "ce"},
            "optim": {"lr": 0.1, "batch_size": p["batch_size"], "milestones": [150, 225]},
            "epochs": epochs,
            "eval": {"ks": [1, 5], "selection": "val/top5"},
            "device": device,
            "compile": compile_mode,
        },
        "variants": {key: {"loss": LOSSES[key]} for key in losses},
        "seeds": list(range(seeds)),
        "resources": resources,
        "max_failures": 0,
        "log_models": False,
    }


def cell_records(client, name: str) -> list[dict]:
    """Per cell run of the study ``name`` in MLflow: its start and end (s) and its epochs'
    ``epoch_time_s`` and ``eval_time_s`` by epoch."""
    experiment = client.get_experiment_by_name(name)
    runs = [
        r
        for r in client.search_runs([experiment.experiment_id], max_results=10000)
        if r.data.tags.get("studies.role") == "cell"
    ]
    return [
        {
            "start": run.info.start_time / 1000.0,
            "end": run.info.end_time / 1000.0,
            "epochs": {m.step: m.value for m in client.get_metric_history(run.info.run_id, "epoch_time_s")},
            "evals": {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval_time_s")},
        }
        for run in runs
    ]


def summarize(records: list[dict], train_images: int, members: int = 1) -> dict:
    """A row's figures from its cells' records (``cell_records``): cells/h; one trial's training
    img/s (all epochs; the first epoch), where a trial trains ``members`` cells at once (a
    fused array: each member's ``epoch_time_s`` is the array's epoch); the overhead per cell;
    the images trained (cells x epochs x training images) and the study's img/s, those images
    over the span from the first cell's start to the last cell's end."""
    rates, first, overheads = [], [], []
    for r in records:
        epochs, evals = r["epochs"], r["evals"]
        rates += [members * train_images / t for t in epochs.values() if t > 0]
        if 0 in epochs:
            first.append(members * train_images / epochs[0])
        overheads.append(r["end"] - r["start"] - sum(epochs.values()) - sum(evals.values()))
    span = max(r["end"] for r in records) - min(r["start"] for r in records)
    images = sum(len(r["epochs"]) for r in records) * train_images
    return {
        "cells": len(records),
        "cells_per_h": len(records) / span * 3600.0,
        "img_s": statistics.median(rates),
        "img_s_first": statistics.median(first),
        "overhead_s": statistics.mean(overheads),
        "images": images,
        "span_s": span,
        "study_img_s": images / span,
    }


def measure(client, name: str, train_images: int, members: int = 1) -> dict:
    """cells/h, one trial's img/s (all epochs; the first epoch), overhead per cell, from MLflow."""
    return summarize(cell_records(client, name), train_images, members)


#: the arms of the ``--seeds-per-trial`` axis: (arm, seeds_per_trial of N, gpus of N)
SEED_ARMS = (
    ("separate", lambda n: 1, lambda n: 1.0),
    ("packed", lambda n: 1, lambda n: 1.0 / n),
    ("fused", lambda n: n, lambda n: 1.0),
)
BASELINE = "one trial"


def seed_rows(counts: list[int]) -> list[tuple[int, str, int, float]]:
    """The studies of the ``--seeds-per-trial`` axis, (N, arm, seeds_per_trial, gpus) each: the
    baseline (one eager trial: one seed, a whole GPU) first, then the three arms of every N > 1."""
    rows = [(1, BASELINE, 1, 1.0)]
    for n in dict.fromkeys(counts):
        if n > 1:
            rows += [(n, arm, per_trial(n), gpus(n)) for arm, per_trial, gpus in SEED_ARMS]
    return rows


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores; plumbing only)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--gpus", type=float, nargs="+", default=None, help="GPU share of a trial (default: 1 0.5 0.25 0.125)"
    )
    parser.add_argument(
        "--compile",
        nargs="+",
        choices=("none", "model"),
        default=None,
        help="the trials' compile (default: none model; with --seeds-per-trial: none)",
    )
    parser.add_argument("--data", nargs="+", choices=("device", "loader"), default=["device", "loader"])
    parser.add_argument(
        "--loader-workers",
        type=int,
        default=None,
        help="DataLoader workers (and CPUs) "
        f"of a loader trial (default: {DEFAULT_LOADER_WORKERS}, at most the Ray's CPUs)",
    )
    parser.add_argument("--epochs", type=int, default=None, help="epochs a cell (default: 2; cpu: 1)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds of each loss (default: 2; cpu: 1)")
    parser.add_argument(
        "--seeds-per-trial",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="instead of the grid: N seeds of each loss separate, packed and fused, beside one eager trial (issue #35)",
    )
    parser.add_argument(
        "--losses",
        nargs="+",
        choices=sorted(LOSSES),
        default=list(LOSSES),
        help="the losses of the study, one variant each (default: all three)",
    )
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    parser.add_argument(
        "--workdir", default=None, help="where the data and the studies go (default: a temporary folder, removed)"
    )
    args = parser.parse_args(argv)
    fused_axis = args.seeds_per_trial is not None
    if fused_axis:
        if args.gpus is not None or args.seeds is not None:
            parser.error(
                "--seeds-per-trial sets the GPU share and the seeds of each row; "
                "expected no --gpus and no --seeds with it"
            )
        if args.compile not in (None, ["none"]):
            parser.error(
                "--seeds-per-trial: a fused array trains with compile none; expected --compile none or no --compile"
            )
        if min(args.seeds_per_trial) < 1:
            parser.error(f"--seeds-per-trial {min(args.seeds_per_trial)}: expected numbers >= 1")

    import ray
    from mlflow import MlflowClient

    from studies.running.runner import RunOptions, run_study

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device here; use --device cpu for the plumbing")
    p = PROTOCOL[args.device]
    epochs, seeds = args.epochs or p["epochs"], args.seeds or p["seeds"]
    train_images = 100 * p["per_class_train"] - p["val_size"]
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-") as tmp:
        work = Path(args.workdir or tmp)
        root = write_cifar(work / "data", p["per_class_train"], p["per_class_test"])
        # one local Ray for every row (or the caller's); on the CPU one GPU that is only a resource label
        started = not ray.is_initialized()
        if started:
            ray.init(
                address="local",
                num_cpus=args.num_cpus or os.cpu_count(),
                num_gpus=1,
                include_dashboard=False,
                log_to_driver=False,
            )
        rows = []
        try:
            cpus = int(ray.cluster_resources().get("CPU", 1))
            workers = loader_workers(args.loader_workers, cpus)
            if workers is None:
                parser.error(
                    f"--loader-workers {args.loader_workers}: a loader trial asks for as many CPUs, "
                    f"and the Ray has {cpus}; expected at most {cpus}"
                )

            def run_row(
                name: str, gpus: float, compile_mode: str, data: str, row_seeds: int, per_trial: int = 1
            ) -> dict:
                """One row: its study written, run through the runner and read back from MLflow."""
                path = work / f"{name}.yaml"
                path.write_text(
                    yaml.safe_dump(
                        study(
                            name,
                            root,
                            args.device,
                            gpus,
                            compile_mode,
                            data,
                            workers,
                            epochs,
                            row_seeds,
                            args.losses,
                            per_trial,
                        ),
                        sort_keys=False,
                    )
                )
                stream = io.StringIO()
                start = time.perf_counter()
                outcome = run_study(
                    path, RunOptions(output=work / "out", report=False, stream=stream, progress_interval_s=1e9)
                )
                wall = time.perf_counter() - start
                if outcome.exit_code != 0:
                    print(stream.getvalue(), file=sys.stderr)
                    raise SystemExit(f"{name}: studies run ended with exit code {outcome.exit_code}")
                shared = re.search(r"(\d+) trials? (?:share each|per) GPU", stream.getvalue())
                row = measure(MlflowClient(outcome.tracking_uri), name, train_images, per_trial)
                row.update(
                    gpus=gpus, compile=compile_mode, data=data, wall_s=wall, share=int(shared.group(1)) if shared else 0
                )
                print(f"  {name}: {row['cells']} cells in {wall:.0f} s", file=sys.stderr, flush=True)
                return row

            if fused_axis:
                for data in args.data:
                    for n, arm, per_trial, gpus in seed_rows(args.seeds_per_trial):
                        name = f"throughput-s{n}-{arm.replace(' ', '_')}-{data}"
                        rows.append({**run_row(name, gpus, "none", data, n, per_trial), "n": n, "arm": arm})
            else:
                for gpus, compile_mode, data in itertools.product(
                    args.gpus or [1.0, 0.5, 0.25, 0.125], args.compile or ["none", "model"], args.data
                ):
                    name = f"throughput-g{gpus:g}-{compile_mode}-{data}".replace(".", "_")
                    rows.append(run_row(name, gpus, compile_mode, data, seeds))
        finally:
            if started:
                ray.shutdown()
    if fused_axis:
        print(seeds_table(rows, device_name(args.device), epochs, train_images))
    else:
        print(table(rows, device_name(args.device), epochs, train_images))
    return 0


def table(rows: list[dict], device: str, epochs: int, train_images: int) -> str:
    """The Markdown table of the rows, with the ratio of cells/h to the first row's."""
    base = rows[0]["cells_per_h"] if rows else 1.0
    lines = [
        f"GPU throughput on {device}: {epochs}-epoch cells, {train_images} training images",
        "",
        "| gpus | share | compile | data | cells | cells/h | x first row | img/s (one trial) | "
        "img/s, first epoch | overhead/cell (s) | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['gpus']:g} | {r['share']} | {r['compile']} | {r['data']} | {r['cells']} | "
            f"{r['cells_per_h']:.0f} | {r['cells_per_h'] / base:.2f} | {r['img_s']:.0f} | "
            f"{r['img_s_first']:.0f} | {r['overhead_s']:.1f} | {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def seeds_table(rows: list[dict], device: str, epochs: int, train_images: int) -> str:
    """The Markdown table of the ``--seeds-per-trial`` rows: per placement of the data, each row's
    study img/s as a multiple of that placement's one eager trial (its first row)."""
    lines = [
        f"Seeds per trial on {device}: {epochs}-epoch cells, {train_images} training images,",
        "compile none; img/s: images trained / study span; x1: of one eager trial",
        "",
        "| data | N | arm | gpus | share | cells | images | img/s | x1 | cells/h | trial img/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base: dict[str, float] = {}
    for r in rows:
        base.setdefault(r["data"], r["study_img_s"])
        lines.append(
            f"| {r['data']} | {r['n']} | {r['arm']} | {r['gpus']:.3g} | {r['share']} | {r['cells']} | "
            f"{r['images']} | {r['study_img_s']:.0f} | {r['study_img_s'] / base[r['data']]:.2f} | "
            f"{r['cells_per_h']:.0f} | {r['img_s']:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
