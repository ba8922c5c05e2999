"""GPU check of seeds fused into one model (issue #35): cells per GPU-hour of the paper protocol
for one eager trial, fused arrays of N seeds and N trial processes side by side, in one run.

The issue's GPU goal: the paper protocol (DenseNet-BC 40-40, batch 64, CIFAR-100-shaped data)
fused at >= 10x the cells per GPU-hour of one eager trial per GPU, and ahead of the best process
packing measured the same day. Each arrangement runs in fresh processes of this script
(``--worker``: its own CUDA context and memory), on CIFAR-100-shaped data in the official format
(``gpu_throughput.write_cifar``) held on the device (``data.placement: device``), compile none:

- ``trial``: one eager trial (``setvalued.training.Trial`` and its own step), the baseline;
- ``fused N``: one array of the seeds 0..N-1 (``setvalued.fused.Array.train_steps``);
- ``packed P``: P trial processes at once, whose timed windows start together.

Per process, after ``--warmup`` steps and one validation pass: ``--seconds`` of training on full
batches (one device synchronisation at the end), then ``--val-passes`` validation passes of each
of its models (an array's members validate one after another, as ``Array`` does). Summed over
the processes of an arrangement: training and validation images per second, and from them

    cells per GPU-hour = 3600 / (EPOCHS x (TRAIN / train img/s + VAL / val img/s))

with the paper protocol's EPOCHS = 300 epochs of TRAIN = 45,000 training and VAL = 5,000
validation images a cell (the test pass, once a cell, left out), and its ratio to one eager
trial's. On the CPU, ``--tiny`` (a small CNN, tiny data, short windows) tests the plumbing only.

    python benchmarks/gpu_check_fused.py --out f_fused.json --md summary.md      # a GPU, ~5 min
    python benchmarks/gpu_check_fused.py --device cpu --tiny --fused 2 --packed 2   # plumbing

docs/throughput.md says how a GPU session runs it beside ``../shared/gpu/check/``.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the paper protocol of a cell: epochs, training and validation images an epoch
EPOCHS, TRAIN_IMAGES, VAL_IMAGES = 300, 45_000, 5_000
GOAL = 10.0  # x one eager trial's cells per GPU-hour (issue #35)


def cells_per_gpu_hour(train_img_s: float, val_img_s: float) -> float:
    """Cells of the paper protocol per GPU-hour at these total rates (every model's images)."""
    return 3600.0 / (EPOCHS * (TRAIN_IMAGES / train_img_s + VAL_IMAGES / val_img_s))


def config(args, root: str) -> dict:
    model = (
        {"name": "small_cnn", "hidden_dim": 8}
        if args.tiny
        else {"name": "densenet_bc_cifar", "depth": 40, "growth_rate": 40}
    )
    return {
        "data": {"name": "cifar100", "root": root, "val_size": args.val_size, "placement": "device"},
        "model": model,
        "loss": {"name": "ce"},
        "optim": {"lr": 0.1, "batch_size": args.batch_size, "milestones": [150, 225]},
        "epochs": EPOCHS,
        "eval": {"ks": [1, 5], "selection": "val/top5"},
        "device": args.device,
        "compile": "none",
    }


# -- a worker: one trial or one array, timed ---------------------------------------------------
def worker(args) -> dict:
    import torch

    sys.path.insert(0, str(REPO))
    from setvalued.fused import Array
    from setvalued.training import Trial, resolve_config

    torch.set_num_threads(args.threads)
    cfg = resolve_config(json.loads(args.config))
    cuda = cfg["device"].startswith("cuda")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    if args.members == 0:  # one trial, its own step
        trial = Trial(cfg, args.seed)
        models = [trial]

        def train(steps: int) -> None:
            trial.step.set_learning_rate(0)
            running = trial.start_training(0)
            trial.step.train_on(itertools.islice(trial.epoch_batches(0), steps), running)
    else:
        array = Array(cfg, list(range(args.members)))
        models = array.members

        def train(steps: int) -> None:
            array.train_steps(0, steps)

    batch = int(cfg["optim"]["batch_size"])
    chunk = len(models[0].data.train) // batch  # an epoch's full batches
    if chunk < 1:
        raise SystemExit(f"the training split ({len(models[0].data.train)}) is smaller than a batch ({batch})")

    def validate() -> None:
        for m in models:
            m.evaluation.validate(m.model)

    train(min(chunk, args.warmup))
    validate()
    sync()
    Path(args.ready).write_text("ready")
    deadline = time.time() + args.timeout
    while not Path(args.go).exists():  # the arrangement's processes start their windows together
        if time.time() > deadline:
            raise SystemExit("no go signal")
        time.sleep(0.005)
    steps, start = 0, time.perf_counter()
    while steps == 0 or time.perf_counter() - start < args.seconds:
        train(chunk)
        steps += chunk
    sync()
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.val_passes):
        validate()
    sync()
    val_s = time.perf_counter() - start
    out = {
        "models": len(models),
        "steps": steps,
        "train_s": train_s,
        "train_images": steps * batch * len(models),
        "val_s": val_s,
        "val_images": args.val_passes * len(models) * len(models[0].data.val),
    }
    if cuda:
        out["peak_reserved_mb"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
    return out


# -- the parent: arrangements, one after another -----------------------------------------------
def run_arrangement(args, cfg: dict, folder: Path, label: str, members: int, processes: int) -> dict:
    """``processes`` workers of ``members`` models each (0: a trial), windows started together."""
    folder.mkdir(parents=True, exist_ok=True)
    go = folder / f"{label}.go"
    go.unlink(missing_ok=True)
    procs, files = [], []
    began = time.time()
    for i in range(processes):
        result, ready = folder / f"{label}.{i}.json", folder / f"{label}.{i}.ready"
        result.unlink(missing_ok=True)
        ready.unlink(missing_ok=True)
        files.append((result, ready))
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--config",
            json.dumps(cfg),
            "--members",
            str(members),
            "--seed",
            str(i),
            "--result",
            str(result),
            "--ready",
            str(ready),
            "--go",
            str(go),
            "--seconds",
            str(args.seconds),
            "--val-passes",
            str(args.val_passes),
            "--warmup",
            str(args.warmup),
            "--threads",
            str(args.threads),
            "--timeout",
            str(args.timeout),
        ]
        procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    deadline = began + args.timeout
    while (
        not all(ready.exists() for _, ready in files)
        and time.time() < deadline
        and all(p.poll() is None for p in procs)
    ):
        time.sleep(0.02)
    go.write_text("go")
    errors = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.time()))
            if proc.returncode:
                errors.append(err.strip().splitlines()[-1][:300] if err.strip() else f"exit {proc.returncode}")
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            errors.append("timed out")
    runs = [json.loads(result.read_text()) for result, _ in files if result.exists()]
    row = {
        "arrangement": label,
        "models_at_once": processes * max(members, 1),
        "processes": processes,
        "finished": len(runs),
        "errors": errors,
        "wall_s": round(time.time() - began, 1),
    }
    if len(runs) == processes:
        row["train_images"] = sum(r["train_images"] for r in runs)
        row["train_img_s"] = sum(r["train_images"] / r["train_s"] for r in runs)
        row["val_img_s"] = sum(r["val_images"] / r["val_s"] for r in runs)
        row["cells_per_gpu_h"] = cells_per_gpu_hour(row["train_img_s"], row["val_img_s"])
        row["peak_reserved_mb"] = [r.get("peak_reserved_mb") for r in runs]
    return row


def verdict(rows: list[dict]) -> dict:
    """The issue's goal from the rows: the best fused array of 2 or more seeds at >= 10x one eager
    trial's cells per GPU-hour, and ahead of the best packing."""
    rate = {r["arrangement"]: r.get("cells_per_gpu_h") for r in rows}
    base = rate.get("trial")
    fused = [v for k, v in rate.items() if k.startswith("fused") and int(k.split()[1]) > 1 and v]
    packed = [v for k, v in rate.items() if k.startswith("packed") and v]
    out = {"trial": base, "best_fused": max(fused, default=None), "best_packed": max(packed, default=None)}
    if base and out["best_fused"]:
        out["fused_x_trial"] = out["best_fused"] / base
        out["met_10x"] = out["fused_x_trial"] >= GOAL
    if out["best_fused"] and out["best_packed"]:
        out["ahead_of_packing"] = out["best_fused"] > out["best_packed"]
    return out


def markdown(rows: list[dict], goal: dict, device: str, args) -> str:
    base = goal.get("trial")
    model = "small CNN (tiny)" if args.tiny else "DenseNet-BC 40-40"
    lines = [
        f"### Fused seeds (issue #35) on {device}",
        "",
        f"{model}, batch {args.batch_size}, data on the device, compile none; {args.seconds:g} s of",
        f"training an arrangement, then {args.val_passes} validation pass(es) a model. cells/GPU-h: of",
        f"the paper protocol ({EPOCHS} epochs of {TRAIN_IMAGES:,} training and {VAL_IMAGES:,} validation",
        "images a cell), from the rates measured.",
        "",
        "| arrangement | models at once | processes | train img/s | val img/s | cells/GPU-h | "
        "x one trial | peak reserved MB, a process | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rate = r.get("cells_per_gpu_h")
        ratio = f"{rate / base:.2f}" if rate and base else ""
        peaks = [m for m in r.get("peak_reserved_mb") or [] if m is not None]
        memory = f"{max(peaks):.0f}" if peaks else ""
        lines.append(
            f"| {r['arrangement']} | {r['models_at_once']} | {r['processes']} | "
            f"{r.get('train_img_s', 0):.0f} | {r.get('val_img_s', 0):.0f} | "
            f"{rate or 0:.2f} | {ratio} | {memory} | {'; '.join(r['errors'])[:160]} |"
        )
    if "fused_x_trial" in goal:
        lines += [
            "",
            f"Goal (>= {GOAL:g}x one eager trial, ahead of the best packing): best fused",
            f"x{goal['fused_x_trial']:.2f} ({'met' if goal['met_10x'] else 'not met'})"
            + (
                f"; {'ahead of' if goal['ahead_of_packing'] else 'behind'} the best packing "
                f"(x{goal['best_packed'] / base:.2f})"
                if "ahead_of_packing" in goal
                else ""
            ),
        ]
    return "\n".join(lines) + "\n"


def load_throughput():
    spec = importlib.util.spec_from_file_location("gpu_throughput", REPO / "benchmarks" / "gpu_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a small CNN on tiny data (the CPU plumbing)")
    parser.add_argument(
        "--fused",
        type=int,
        nargs="*",
        default=[1, 4, 8, 16],
        metavar="N",
        help="members of the fused arrays (default: 1 4 8 16)",
    )
    parser.add_argument(
        "--packed", type=int, nargs="*", default=[4, 8], metavar="P", help="trial processes side by side (default: 4 8)"
    )
    parser.add_argument("--seconds", type=float, default=None, help="training window (default: 8; tiny: 0.3)")
    parser.add_argument("--val-passes", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 10; tiny: 1)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--per-class-train", type=int, default=None, help="default: 60; tiny: 6")
    parser.add_argument("--val-size", type=int, default=None, help="default: 1000; tiny: 100")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads a process (default: 2; tiny: 1)")
    parser.add_argument("--timeout", type=float, default=200.0, help="seconds for one arrangement")
    parser.add_argument("--workdir", default=None, help="data and worker files (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="JSON file of the rows")
    parser.add_argument("--md", default=None, help="append the Markdown section to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--config", "--result", "--ready", "--go"):
        parser.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--members", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    tiny = args.tiny
    args.seconds = args.seconds if args.seconds is not None else (0.3 if tiny else 8.0)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 10)
    args.threads = args.threads if args.threads is not None else (1 if tiny else 2)
    if args.worker:
        result = worker(args)
        Path(args.result).write_text(json.dumps(result))
        return 0
    if any(n < 1 for n in args.fused + args.packed):
        parser.error("--fused and --packed take numbers >= 1")
    per_class = args.per_class_train or (6 if tiny else 60)
    args.val_size = args.val_size or (100 if tiny else 1000)
    if 100 * per_class - args.val_size < args.batch_size:
        parser.error(f"--per-class-train {per_class}: the training split holds less than a batch")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device here; use --device cpu --tiny for the plumbing")
        device_name = torch.cuda.get_device_name(0)
    else:
        device_name = "CPU (plumbing only)"
    with tempfile.TemporaryDirectory(prefix="gpu-check-fused-") as tmp:
        work = Path(args.workdir or tmp)
        root = work / f"cifar{per_class}"
        if not (root / "cifar-100-python" / "meta").is_file():
            load_throughput().write_cifar(root, per_class, 2 if tiny else 10)
        cfg = config(args, str(root))
        plan = (
            [("trial", 0, 1)]
            + [(f"fused {n}", n, 1) for n in args.fused]
            + [(f"packed {p}", 0, p) for p in args.packed]
        )
        rows = []
        for label, members, processes in plan:
            row = run_arrangement(args, cfg, work / "workers", label.replace(" ", "_"), members, processes)
            row["arrangement"] = label
            rows.append(row)
            print(json.dumps(row), flush=True)
    goal = verdict(rows)
    if args.out:
        Path(args.out).write_text(
            json.dumps({"device": device_name, "config": cfg, "rows": rows, "goal": goal}, indent=1)
        )
    text = markdown(rows, goal, device_name, args)
    print(text)
    if args.md:
        with open(args.md, "a") as handle:
            handle.write(text + "\n")
    return 0 if all(r["finished"] == r["processes"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
