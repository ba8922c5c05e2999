"""Train-step time of each loss beside cross-entropy, the authors' code and the 2018 reference.

The comparison of [Gar23] Fig. 4.3 (issue 23) without data loading: DenseNet-BC 40-40 on
CIFAR-sized inputs (3 x 32 x 32, 100 classes), batch 64, SGD with momentum, bf16 autocast on
CUDA (float32 on CPU); one step is zero_grad, forward, loss, backward, step. Two modes:

- ``eager``: model and loss eager;
- ``graphs``: the model under ``torch.compile(model, mode="reduce-overhead")`` (CUDA graphs on
  a GPU), the loss eager beside it, as a trainer would run it: a loss that waits for the GPU
  (a value read back on the host) stalls the queue the graphs keep full.

Every loss has its own model (the same initial weights) and optimizer; configurations run in
interleaved rounds (each round in its own shuffled order) of ``--steps`` steps, and the best
round is reported with its ratio to CE in the same mode. Rows: ``ce``, ``noised_topk`` (pruned
default and ``exact=True``), ``noised_topk_imbalanced``, ``smooth_topk_svm`` (K = 5, 10),
``avgk_two_head``, and where installed pytopk's ``BalNoisedTopK`` / ``ImbalNoisedTopK`` and the
2018 reference's ``SmoothTopkSVM`` (``SMOOTH_TOPK_REF``; benchmarks/losses.py finds both).

    python benchmarks/train_step.py --device cuda                  # the issue's protocol
    python benchmarks/train_step.py --device cpu --depth 10 --growth-rate 4 --steps 2 --rounds 1 \\
        --compile-backend eager                                     # plumbing only (the test)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.losses import (
    device_name,
    load_pytopk,
    load_smooth_topk_reference,
    on_device,
)
from setvalued.losses import build_loss
from setvalued.models import build_model

MODES = ("eager", "graphs")
#: the noised losses' settings: K = 5, M = 3 (the issue's rows), epsilon of the CIFAR-100
#: regime of benchmarks/losses.py (``spread``), the imbalanced one's of Pl@ntNet
NOISED = dict(k=5, n_samples=3, epsilon=0.2)
IMBALANCED = dict(k=5, n_samples=3, epsilon=0.01, max_margin=0.2, scale=50.0)


@dataclass
class Row:
    label: str
    head: str  # the model head the loss needs
    make: Callable[[list[int], int], torch.nn.Module]  # (class_counts, num_classes) -> loss


def rows(pytopk=None, reference_svm=None, only: list[str] | None = None) -> list[Row]:
    """The configurations timed: ours, and the references that are installed."""
    table = [
        Row("ce", "linear", lambda counts, n: build_loss("ce")),
        Row("noised_topk K=5 M=3", "linear", lambda counts, n: build_loss("noised_topk", **NOISED)),
        Row(
            "noised_topk K=5 M=3 exact=True",
            "linear",
            lambda counts, n: build_loss("noised_topk", exact=True, **NOISED),
        ),
        Row(
            "noised_topk_imbalanced K=5 M=3",
            "normed",
            lambda counts, n: build_loss("noised_topk_imbalanced", class_counts=counts, **IMBALANCED),
        ),
        Row("avgk_two_head K=5", "two_head", lambda counts, n: build_loss("avgk_two_head", k=5)),
    ]
    if pytopk is not None:
        table += [
            Row(
                "pytopk BalNoisedTopK K=5 M=3",
                "linear",
                lambda counts, n: pytopk.BalNoisedTopK(
                    k=NOISED["k"], epsilon=NOISED["epsilon"], n_sample=NOISED["n_samples"]
                ),
            ),
            Row(
                "pytopk ImbalNoisedTopK K=5 M=3",
                "normed",
                lambda counts, n: pytopk.ImbalNoisedTopK(
                    k=IMBALANCED["k"],
                    epsilon=IMBALANCED["epsilon"],
                    max_m=IMBALANCED["max_margin"],
                    cls_num_list=counts,
                    scale=IMBALANCED["scale"],
                    n_sample=IMBALANCED["n_samples"],
                ),
            ),
        ]
    for k in (5, 10):
        table.append(
            Row(f"smooth_topk_svm K={k}", "linear", lambda counts, n, k=k: build_loss("smooth_topk_svm", k=k, tau=1.0))
        )
        if reference_svm is not None:

            def reference(counts, n, k=k):
                with contextlib.redirect_stdout(io.StringIO()):  # it prints its tau
                    return reference_svm(n, k=k, tau=1.0)

            table.append(Row(f"2018 reference SVM K={k}", "linear", reference))
    if only:
        table = [row for row in table if row.label == "ce" or any(text in row.label for text in only)]
    return table


def make_step(row: Row, mode: str, args, device: torch.device, seed: int) -> Callable[[], None]:
    """One training step of ``row``'s loss on its own model: zero_grad, forward, loss, backward,
    SGD step, on one fixed batch (no data loading)."""
    torch.manual_seed(seed)  # the same initial weights and batch for every row
    num_classes = args.classes
    model = build_model(
        {"name": "densenet_bc_cifar", "depth": args.depth, "growth_rate": args.growth_rate},
        num_classes,
        (3, args.image_size, args.image_size),
        head=row.head,
    ).to(device)
    images = torch.randn(args.batch, 3, args.image_size, args.image_size, device=device)
    targets = torch.randint(num_classes, (args.batch,), device=device)
    counts = torch.randint(1, 500, (num_classes,)).tolist()
    loss = on_device(row.make(counts, num_classes), device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    forward = model
    if mode == "graphs":
        forward = (
            torch.compile(model, mode="reduce-overhead")
            if args.compile_backend == "inductor"
            else torch.compile(model, backend=args.compile_backend)
        )  # a mode is inductor's
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    mark_step = torch.compiler.cudagraph_mark_step_begin if mode == "graphs" else (lambda: None)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        mark_step()
        with autocast:
            output = forward(images)
            value = loss(output, targets)
        value.backward()
        optimizer.step()

    return step


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    steps: dict[tuple[str, str], Callable[[], None]], rounds: int, per_round: int, warmup: int, device: torch.device
) -> dict[tuple[str, str], list[float]]:
    """Seconds per step of each configuration, one value per round; rounds interleave them."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    _synchronize(device)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in steps}
    order = list(steps)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for key in order:
            start = time.perf_counter()
            for _ in range(per_round):
                steps[key]()
            _synchronize(device)
            times[key].append((time.perf_counter() - start) / per_round)
    return times


def table(times: dict[tuple[str, str], list[float]], labels: list[str], modes: list[str]) -> str:
    """Markdown: best ms per step of each loss and mode, and its ratio to CE in that mode."""
    best = {key: min(values) * 1e3 for key, values in times.items()}
    header = "| loss | " + " | ".join(f"{mode} ms (x CE)" for mode in modes) + " |"
    lines = [header, "|---|" + "---|" * len(modes)]
    for label in labels:
        cells = [f"{best[label, mode]:.2f} ({best[label, mode] / best['ce', mode]:.3f})" for mode in modes]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--depth", type=int, default=40, help="DenseNet-BC depth (6n + 4)")
    parser.add_argument("--growth-rate", type=int, default=40)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100, help="steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per configuration")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of the graphs mode (eager: dynamo only, for a quick check)",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=None,
        metavar="TEXT",
        help="time only the rows whose label contains TEXT (repeatable; ce always)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    pytopk, reference_svm = load_pytopk(), load_smooth_topk_reference()
    table_rows = rows(pytopk, reference_svm, args.only)
    # one model per row: past dynamo's recompile limit a compiled model would silently run eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(table_rows))
    steps = {(row.label, mode): make_step(row, mode, args, device, seed=0) for row in table_rows for mode in args.modes}
    started = time.perf_counter()
    times = time_steps(steps, args.rounds, args.steps, args.warmup, device)
    graphs = (
        "torch.compile(model, mode='reduce-overhead')"
        if args.compile_backend == "inductor"
        else f"torch.compile(model, backend={args.compile_backend!r})"
    )
    text = (
        f"Train step: DenseNet-BC {args.depth}-{args.growth_rate}, batch {args.batch}, "
        f"{args.classes} classes, {args.image_size}x{args.image_size} inputs, SGD, "
        f"{'bf16 autocast' if device.type == 'cuda' else 'float32'}, device {device} "
        f"({device_name(device)}), torch {torch.__version__}; best of {args.rounds} interleaved "
        f"rounds x {args.steps} steps ({time.perf_counter() - started:.0f} s); graphs = the model "
        f"under {graphs}.\n"
        f"pytopk: {'measured' if pytopk is not None else 'not installed, skipped'}; 2018 reference: "
        f"{'measured' if reference_svm is not None else 'SMOOTH_TOPK_REF not set, skipped'}.\n\n"
        + table(times, [row.label for row in table_rows], args.modes)
    )
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
