"""Forward+backward time of the losses per batch, as a ratio to ``ce`` measured in the same run.

Grid: K in {1, 2, 5, 10, 20, 50}, L in {100, 1000}, batch 128, one CPU thread, float32.
Side by side, in interleaved rounds (each round in its own shuffled order: what runs just before
a config changes its time by 10-15 % on a CPU):

- this checkout's losses;
- the authors' code where it is installed, measured, never copied: ``pytopk`` (PyPI, the noised
  losses of Garcin et al. 2022) and the 2018 reference of the smooth top-k SVM
  (oval-group/smooth-topk, read from the folder named by ``SMOOTH_TOPK_REF``); each is skipped
  with a note when absent;
- with ``--baseline PATH``, the same losses from another checkout of this project (e.g. the
  main branch: the "before" of a change), imported under their own module objects.

Score regimes of the noised losses (the pruned path of ``noised_topk`` draws noise only for the
classes within about 14 epsilon of the (K+1)-th score, so its cost depends on how the scores
spread compared to epsilon):

- ``dense``: logits N(0, 2^2), epsilon 1 (the Pl@ntNet setting of the paper): every class is
  within reach, nothing can be pruned; the ``floor`` rows (drawing the B x M x L normals, nothing
  else) bound any exact method from below;
- ``spread``: logits N(0, 4^2), epsilon 0.2 (the CIFAR-100 setting): std / epsilon = 20;
- imbalanced: cosines tanh(N(0, 1)), epsilon 0.01, as in the Pl@ntNet runs.

Writes ``benchmarks/out/losses.csv`` and ``losses.md`` (the tables and the goals of issue 14)
and prints the tables.

    python benchmarks/losses.py                       # full grid, a few minutes on 2 cores
    python benchmarks/losses.py --quick               # K in {1, 10, 50}, fewer rounds
    python benchmarks/losses.py --only avgk --only floor   # a subset of the rows (ce always)
    SMOOTH_TOPK_REF=/path/to/smooth-topk python benchmarks/losses.py --baseline /work/main
    python benchmarks/losses.py --kernels             # kernel launches per fwd+bwd, eager and
                                                      # compiled, beside pytopk's (loss_kernels.py)

Each configuration is timed once per round, rounds interleave all of them so that load changes
on a shared machine hit them alike, and the best round is reported (other processes can only
add time; the median is in the CSV too). On one CPU thread the clock is by default the thread's
CPU time (``--clock thread``), which leaves out the time spent waiting for a core on a shared
machine; ``--clock wall`` measures wall time (the default on GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import io
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from setvalued.losses import TwoHeadOutput, build_loss

FULL_KS = (1, 2, 5, 10, 20, 50)
QUICK_KS = (1, 10, 50)
CLASS_COUNTS = (100, 1000)
SAMPLE_COUNTS = (3, 10)
REGIMES = {  # name: (logit std, epsilon)
    "dense": (2.0, 1.0),
    "spread": (4.0, 0.2),
}
IMBALANCED_EPSILON = 0.01
SVM_TAU = 1.0


@dataclass
class Config:
    label: str  # row of the tables
    num_classes: int
    k: int | None  # None for losses that do not depend on K
    run: Callable[[], None]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(loss, output, targets, *leaves) -> Callable[[], None]:
    def run() -> None:
        for leaf in leaves:
            leaf.grad = None
        loss(output, targets).backward()

    return run


def _floor_step(batch: int, num_classes: int, n_samples: int, device) -> Callable[[], None]:
    """Draw the B x M x L normals of an exact noised loss: nothing else."""

    def run() -> None:
        torch.randn(batch, n_samples, num_classes, device=device)

    return run


def _reach_floor_step(scores: torch.Tensor, k: int, epsilon: float, n_samples: int) -> Callable[[], None] | None:
    """Draw M normals for each class within reach of the top k and select the k-th largest of
    the perturbed candidates: the least that any exact noised loss drawing noise only for the
    classes that can reach the top k does, at torch's kernel costs (the candidates of the pruned
    path are found once, outside the timing; no hinge, no backward). None when nothing can be
    pruned (the dense regime: the B x M x L floor applies), and off the CPU, where the losses
    draw every class (setvalued.losses.base.fixed_shapes)."""
    from setvalued.losses.topk_operator import _pruned_candidates, select_kth_largest

    if scores.device.type != "cpu":
        return None
    pruned = _pruned_candidates(scores.detach(), k, epsilon, n_samples)
    if pruned is None:
        return None
    candidates = (pruned[0] / epsilon).unsqueeze(1)

    def run() -> None:
        perturbed = torch.randn(candidates.shape[0], n_samples, candidates.shape[2], device=candidates.device).add_(
            candidates
        )
        select_kth_largest(perturbed, k, overwrite=True)

    return run


# ----------------------------------------------------------------------------------------
# other implementations: the authors' code, another checkout of this project
# ----------------------------------------------------------------------------------------


def on_device(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A reference loss module on ``device``: ``.to`` moves its parameters and buffers (pytopk's
    margins); the 2018 reference's losses hold its ``labels`` buffer as it was when they were
    built, and only its own ``.cuda()`` rebuilds them (``get_losses``), so it is called after
    the move on any device."""
    module = module.to(device)
    rebuild = getattr(module, "get_losses", None)
    if callable(rebuild):
        rebuild()
    return module


def device_name(device: torch.device) -> str:
    """The GPU's name, or the processor's, for the tables' headers."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def load_pytopk():
    try:
        return importlib.import_module("pytopk")
    except ImportError:
        return None


def load_smooth_topk_reference():
    """The 2018 reference's ``SmoothTopkSVM`` from the folder in SMOOTH_TOPK_REF, or None."""
    folder = os.environ.get("SMOOTH_TOPK_REF")
    if not folder:
        return None
    sys.path.insert(0, folder)
    try:
        return importlib.import_module("topk.svm").SmoothTopkSVM
    except ImportError as error:
        print(f"SMOOTH_TOPK_REF={folder}: cannot import topk.svm ({error}); skipped")
        return None
    finally:
        sys.path.remove(folder)


def load_baseline(path: str):
    """``build_loss`` of the ``setvalued`` package in another checkout (e.g. /work/main).

    Its modules are imported under their usual names, kept alive by the returned function,
    then taken out of ``sys.modules`` again so that this checkout's modules stay in place.
    """

    def ours(name: str) -> bool:
        return name == "setvalued" or name.startswith("setvalued.")

    current = {name: module for name, module in sys.modules.items() if ours(name)}
    for name in current:
        del sys.modules[name]
    sys.path.insert(0, str(Path(path).resolve()))
    try:
        other = importlib.import_module("setvalued.losses")
        origin = Path(other.__file__).resolve()
        if Path(path).resolve() not in origin.parents:
            raise RuntimeError(f"--baseline {path}: imported setvalued from {origin} instead")
        return other.build_loss, other.TwoHeadOutput
    finally:
        sys.path.pop(0)
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(current)


# ----------------------------------------------------------------------------------------
# the grid
# ----------------------------------------------------------------------------------------


def build_configs(
    ks, batch: int, device: torch.device, pytopk=None, reference_svm=None, baseline=None, seed: int = 0
) -> list[Config]:
    generator = torch.Generator().manual_seed(seed)
    configs: list[Config] = []

    for num_classes in CLASS_COUNTS:

        def tensor(values):
            return values.to(device).requires_grad_(True)

        base = torch.randn(batch, num_classes, generator=generator)
        logits = {name: tensor(base * std) for name, (std, _) in REGIMES.items()}
        cosines = tensor(torch.tanh(torch.randn(batch, num_classes, generator=generator)))
        second_head = tensor(torch.randn(batch, num_classes, generator=generator) * 2)
        targets = torch.randint(num_classes, (batch,), generator=generator).to(device)
        counts = torch.randint(1, 500, (num_classes,), generator=generator).tolist()
        dense = logits["dense"]

        def add(label, loss, output, *leaves, k=None):
            configs.append(Config(label, num_classes, k, _step(loss, output, targets, *(leaves or (output,)))))

        add("ce", build_loss("ce"), dense)
        add("focal", build_loss("focal", gamma=2.0), dense)
        add("ldam", build_loss("ldam", max_margin=0.5, scale=30.0, class_counts=counts).to(device), cosines)
        for m in SAMPLE_COUNTS:
            configs.append(
                Config(
                    f"floor M={m} (B x M x L normals)", num_classes, None, _floor_step(batch, num_classes, m, device)
                )
            )
        for k in ks:
            if k > num_classes - 1:
                continue
            add("hinge_topk", build_loss("hinge_topk", k=k), dense, k=k)
            add("calibrated_hinge_topk", build_loss("calibrated_hinge_topk", k=k), dense, k=k)
            for m in SAMPLE_COUNTS:
                for regime, (_, eps) in REGIMES.items():
                    scores = logits[regime]
                    name = f"noised_topk M={m} {regime}"
                    add(name, build_loss("noised_topk", k=k, epsilon=eps, n_samples=m), scores, k=k)
                    floor = _reach_floor_step(scores, k + 1, eps, m)
                    if floor is not None:
                        configs.append(Config(f"reach floor M={m} {regime}", num_classes, k, floor))
                    if regime == "dense":
                        add(
                            f"{name} exact=True",
                            build_loss("noised_topk", k=k, epsilon=eps, n_samples=m, exact=True),
                            scores,
                            k=k,
                        )
                    if pytopk is not None:
                        add(
                            f"pytopk: {name}",
                            on_device(pytopk.BalNoisedTopK(k=k, epsilon=eps, n_sample=m), device),
                            scores,
                            k=k,
                        )
                    if baseline is not None:
                        add(f"main: {name}", baseline[0]("noised_topk", k=k, epsilon=eps, n_samples=m), scores, k=k)
                name = f"noised_topk_imbalanced M={m}"
                params = dict(
                    k=k, epsilon=IMBALANCED_EPSILON, n_samples=m, max_margin=0.2, scale=50.0, class_counts=counts
                )
                add(name, build_loss("noised_topk_imbalanced", **params).to(device), cosines, k=k)
                floor = _reach_floor_step(cosines, k + 1, IMBALANCED_EPSILON, m)
                if floor is not None:
                    configs.append(Config(f"reach floor M={m} imbalanced", num_classes, k, floor))
                if pytopk is not None:
                    add(
                        f"pytopk: {name}",
                        on_device(
                            pytopk.ImbalNoisedTopK(
                                k=k, epsilon=IMBALANCED_EPSILON, max_m=0.2, cls_num_list=counts, scale=50.0, n_sample=m
                            ),
                            device,
                        ),
                        cosines,
                        k=k,
                    )
                if baseline is not None:
                    add(f"main: {name}", baseline[0]("noised_topk_imbalanced", **params).to(device), cosines, k=k)
            add("smooth_topk_svm", build_loss("smooth_topk_svm", k=k, tau=SVM_TAU), dense, k=k)
            if reference_svm is not None:
                with contextlib.redirect_stdout(io.StringIO()):  # it prints its tau
                    reference = on_device(reference_svm(num_classes, k=k, tau=SVM_TAU), device)
                add("2018 reference: smooth_topk_svm", reference, dense, k=k)
            if baseline is not None:
                add("main: smooth_topk_svm", baseline[0]("smooth_topk_svm", k=k, tau=SVM_TAU), dense, k=k)
            if k >= 2:
                add(
                    "avgk_two_head",
                    build_loss("avgk_two_head", k=k),
                    TwoHeadOutput(dense, second_head),
                    dense,
                    second_head,
                    k=k,
                )
                if baseline is not None:
                    add(
                        "main: avgk_two_head",
                        baseline[0]("avgk_two_head", k=k),
                        baseline[1](dense, second_head),
                        dense,
                        second_head,
                        k=k,
                    )
    return configs


#: Clocks of ``--clock``: wall time, or the CPU time of this thread (on a CPU shared with other
#: processes it leaves out the time this one waits for a core; no use on GPU).
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def time_configs(
    configs: list[Config], repeats: int, warmup: int, device, clock: Callable[[], float] = time.perf_counter
) -> dict[int, list[float]]:
    for config in configs:
        for _ in range(warmup):
            config.run()
    _synchronize(device)
    times: dict[int, list[float]] = {i: [] for i in range(len(configs))}
    # each round in its own order: what runs just before a config (a reference package's
    # allocations, a loss that fills the cache) changes its time by 10-15 % on a CPU, and a
    # fixed order would give that to the same configs in every round
    order = list(range(len(configs)))
    shuffle = random.Random(0).shuffle
    for _ in range(repeats):
        shuffle(order)
        for i in order:
            start = clock()
            configs[i].run()
            _synchronize(device)
            times[i].append(clock() - start)
    return times


def summarise(configs, times, batch, device, threads) -> list[dict]:
    rows = []
    for i, config in enumerate(configs):
        rows.append(
            {
                "loss": config.label,
                "L": config.num_classes,
                "K": config.k if config.k else "",
                "batch": batch,
                "best_ms": min(times[i]) * 1e3,
                "median_ms": statistics.median(times[i]) * 1e3,
                "repeats": len(times[i]),
                "device": str(device),
                "threads": threads,
                "torch": torch.__version__,
            }
        )
    ce = {row["L"]: row["best_ms"] for row in rows if row["loss"] == "ce"}
    for row in rows:
        row["ratio_to_ce"] = row["best_ms"] / ce[row["L"]]
    return rows


# ----------------------------------------------------------------------------------------
# goals of issue 14 and the report
# ----------------------------------------------------------------------------------------


def goal_checks(rows, ks) -> list[tuple[str, str, float, bool, float | None]]:
    """(goal, case, measured, met, floor) at L = 1000; floor: the ratio of the "reach floor"
    row of the case (drawing and selecting over the classes within reach, nothing else), where
    there is one."""

    def ratio(label, k, num_classes=1000):
        match = [r for r in rows if r["loss"] == label and r["L"] == num_classes and r["K"] == k]
        return match[0]["ratio_to_ce"] if match else None

    def floor(m, regime, k):
        """Every class is within reach in the dense regime: its floor is drawing B x M x L."""
        if regime == "dense":
            return ratio(f"floor M={m} (B x M x L normals)", "")
        return ratio(f"reach floor M={m} {regime}", k)

    checks = []  # rows that were not timed (--only, or a reference not installed) are skipped
    for regime in REGIMES:
        for m, limit in ((3, 3.0), (10, 6.0)):
            label = f"noised_topk M={m} {regime}"
            for k in ks:
                value = ratio(label, k)
                if value is not None:
                    checks.append(
                        (
                            f"noised M={m} <= x{limit:g} CE",
                            f"{regime} K={k}",
                            value,
                            value <= limit,
                            floor(m, regime, k),
                        )
                    )
            if 1 in ks and 50 in ks and m == 3 and None not in (ratio(label, 50), ratio(label, 1)):
                flat = ratio(label, 50) / ratio(label, 1)
                floors = floor(3, regime, 50), floor(3, regime, 1)
                checks.append(
                    (
                        "noised M=3: K=50 / K=1 <= 1.3",
                        regime,
                        flat,
                        flat <= 1.3,
                        None if None in floors else floors[0] / floors[1],
                    )
                )
    for m in SAMPLE_COUNTS:
        for k in ks:
            value = ratio(f"noised_topk_imbalanced M={m}", k)
            if value is not None:
                checks.append(
                    (
                        "imbalanced <= x3.5 CE",
                        f"M={m} K={k}",
                        value,
                        value <= 3.5,
                        ratio(f"reach floor M={m} imbalanced", k),
                    )
                )
    for k in ks:
        ours, reference = ratio("smooth_topk_svm", k), ratio("2018 reference: smooth_topk_svm", k)
        if reference is not None and ours is not None:
            need = 3.0 if k >= 5 else 1.0
            checks.append(
                (
                    f"smooth SVM: 2018 reference / ours >= {need:g}",
                    f"K={k}",
                    reference / ours,
                    reference / ours >= need,
                    None,
                )
            )
    for k in ks:
        value = ratio("avgk_two_head", k)
        if value is not None:
            checks.append(("avgk_two_head <= x2 CE", f"K={k}", value, value <= 2.0, None))
    return checks


def markdown(rows, ks, checks, header: str, notes: list[str]) -> str:
    lines = [header, ""] + [f"- {note}" for note in notes] + [""]
    for num_classes in CLASS_COUNTS:
        lines += [
            f"### L = {num_classes}: forward+backward time as a multiple of ce (best round; ms in the CSV)",
            "",
            "| loss | " + " | ".join(f"K={k}" for k in ks) + " |",
            "|---|" + "---|" * len(ks),
        ]
        labels = list(dict.fromkeys(row["loss"] for row in rows if row["L"] == num_classes))
        for label in labels:
            cells = []
            for k in ks:
                match = [r for r in rows if r["loss"] == label and r["L"] == num_classes and r["K"] in (k, "")]
                cells.append(f"x{match[0]['ratio_to_ce']:.3g}" if match else "")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        ce_ms = next(r["best_ms"] for r in rows if r["loss"] == "ce" and r["L"] == num_classes)
        lines += ["", f"(ce: {ce_ms:.3f} ms)", ""]
    lines += [
        "### Goals of issue 14 (L = 1000)",
        "",
        "floor: what any exact method must do at least, with torch's kernels: in the spread and "
        "imbalanced regimes, drawing M normals for each class within reach of the top K+1 and "
        "selecting the (K+1)-th largest (the reach floor rows; the candidates found outside the "
        "timing); in the dense regime, where every class is within reach, drawing the B x M x L "
        "normals",
        "",
        "| goal | case | measured | met | floor |",
        "|---|---|---|---|---|",
    ]
    for name, case, value, met, floor in checks:
        lines.append(
            f"| {name} | {case} | {value:.2f} | {'yes' if met else 'NO'} | {'' if floor is None else f'{floor:.2f}'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="K in {1, 10, 50} and 5 rounds")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 9, quick 5)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--only",
        action="append",
        default=None,
        metavar="TEXT",
        help="time only the rows whose label contains TEXT (repeatable; ce is always timed)",
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default=None,
        help="wall time or this thread's CPU time (default: thread on CPU, wall on GPU)",
    )
    parser.add_argument(
        "--baseline", default=None, help="another checkout of this project (e.g. /work/main): its losses side by side"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument(
        "--kernels",
        nargs=argparse.REMAINDER,
        default=None,
        help="print the kernel launches per forward+backward instead (eager and compiled, "
        "beside pytopk's; options of benchmarks/loss_kernels.py follow)",
    )
    args = parser.parse_args(argv)
    if args.kernels is not None:
        from benchmarks.loss_kernels import main as kernels_main

        return kernels_main(args.kernels)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    clock_name = args.clock or ("thread" if device.type == "cpu" and args.threads == 1 else "wall")
    if clock_name == "thread" and (device.type != "cpu" or args.threads != 1):
        parser.error("--clock thread times one CPU thread: use it with --device cpu --threads 1")
    ks = QUICK_KS if args.quick else FULL_KS
    repeats = args.repeats or (5 if args.quick else 9)
    notes = []
    pytopk = load_pytopk()
    notes.append(
        f"pytopk {getattr(pytopk, '__version__', '')} (PyPI): measured"
        if pytopk is not None
        else "pytopk not installed (`pip install pytopk`): its rows are skipped"
    )
    reference_svm = load_smooth_topk_reference()
    notes.append(
        f"2018 smooth top-k SVM reference from SMOOTH_TOPK_REF={os.environ['SMOOTH_TOPK_REF']}"
        if reference_svm is not None
        else "SMOOTH_TOPK_REF not set (a checkout of oval-group/smooth-topk): the 2018 reference is skipped"
    )
    baseline = load_baseline(args.baseline) if args.baseline else None
    if baseline is not None:
        notes.append(f"'main:' rows: the losses of the checkout at {args.baseline}, in the same run")
    notes.append(
        "score regimes of the noised losses: "
        + ", ".join(f"{name} = logits N(0, {std:g}^2) with epsilon {eps:g}" for name, (std, eps) in REGIMES.items())
        + f"; imbalanced: cosines tanh(N(0, 1)) with epsilon {IMBALANCED_EPSILON:g}"
    )

    configs = build_configs(ks, args.batch, device, pytopk, reference_svm, baseline)
    if args.only:
        configs = [c for c in configs if c.label == "ce" or any(text in c.label for text in args.only)]
    started = time.perf_counter()
    times = time_configs(configs, repeats, args.warmup, device, CLOCKS[clock_name])
    elapsed = time.perf_counter() - started
    rows = summarise(configs, times, args.batch, device, args.threads)
    checks = goal_checks(rows, ks)

    args.out.mkdir(parents=True, exist_ok=True)
    fields = ["loss", "L", "K", "batch", "best_ms", "median_ms", "ratio_to_ce", "repeats", "device", "threads", "torch"]
    with open(args.out / "losses.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: (f"{row[key]:.6g}" if isinstance(row[key], float) else row[key]) for key in fields})
    header = (
        f"Loss benchmark: batch {args.batch}, float32, device {device} "
        f"({device_name(device)}), {args.threads} thread(s), torch "
        f"{torch.__version__}, best of {repeats} interleaved rounds ({clock_name} clock); "
        f"{elapsed:.0f} s of timing."
    )
    text = markdown(rows, ks, checks, header, notes)
    (args.out / "losses.md").write_text(text)
    print(text)
    print(f"wrote {args.out / 'losses.csv'}, {args.out / 'losses.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
