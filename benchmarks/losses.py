"""Forward+backward time of every top-K loss per batch, as a ratio to ``ce`` in the same run.

Grid of issue 2: K in {1, 2, 5, 10, 20, 50}, L in {100, 1000}, batch 128, M in {3, 10}.
The noised loss is also compared with its floor: drawing the B x M x L normals plus the
one selection pass it makes (the same selection routine), without anything else.

Writes ``benchmarks/out/losses.csv``, ``losses.png`` (time vs K, one line per loss) and
``losses.md`` (the tables and the three targets of the issue), and prints the tables.

    python benchmarks/losses.py            # full grid, about 1-3 minutes on 2 CPU cores
    python benchmarks/losses.py --quick    # K in {1, 10, 50}, fewer repeats

Configurations are timed in interleaved rounds (every configuration once per round), so
that load changes on a shared machine hit all of them alike, and summarised by the best
round (other processes can only add time; the median is in the CSV too).
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from setvalued.losses import build_loss  # noqa: E402
from setvalued.losses.topk import _select_kth_largest  # noqa: E402

FULL_KS = (1, 2, 5, 10, 20, 50)
QUICK_KS = (1, 10, 50)
CLASS_COUNTS = (100, 1000)
SAMPLE_COUNTS = (3, 10)
TARGETS = {
    "noised K=50 / K=1 (<= 1.3)": 1.3,
    "smooth SVM / noised at K=10 (>= 2)": 2.0,
    "noised / floor (<= 1.5)": 1.5,
}


@dataclass
class Config:
    loss: str          # label in the tables and the plot
    num_classes: int
    k: int | None      # None for losses that do not depend on K
    n_samples: int | None
    run: Callable[[], None]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loss_step(loss, scores: torch.Tensor, targets: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        scores.grad = None
        loss(scores, targets).backward()
    return run


def _floor_step(batch: int, num_classes: int, k: int, n_samples: int, device) -> Callable[[], None]:
    """Draw the B x M x L normals and select the (k+1)-th largest once: nothing else."""
    def run() -> None:
        noise = torch.randn(batch, n_samples, num_classes, device=device)
        _select_kth_largest(noise, k + 1)
    return run


def build_configs(ks, batch: int, device: torch.device, seed: int = 0) -> list[Config]:
    generator = torch.Generator().manual_seed(seed)
    configs: list[Config] = []
    for num_classes in CLASS_COUNTS:
        logits = (torch.randn(batch, num_classes, generator=generator) * 2).to(device).requires_grad_(True)
        cosines = torch.tanh(torch.randn(batch, num_classes, generator=generator)).to(device).requires_grad_(True)
        targets = torch.randint(num_classes, (batch,), generator=generator).to(device)
        counts = torch.randint(1, 500, (num_classes,), generator=generator).tolist()

        def add(label, loss, scores, k=None, n_samples=None):
            configs.append(Config(label, num_classes, k, n_samples, _loss_step(loss, scores, targets)))

        add("ce", build_loss("ce"), logits)
        add("focal", build_loss("focal", gamma=2.0), logits)
        add("ldam", build_loss("ldam", max_margin=0.5, scale=30.0, class_counts=counts), cosines)
        for k in ks:
            add("hinge_topk", build_loss("hinge_topk", k=k), logits, k)
            add("cvx_hinge_topk", build_loss("cvx_hinge_topk", k=k), logits, k)
            add("calibrated_hinge_topk", build_loss("calibrated_hinge_topk", k=k), logits, k)
            add("smooth_topk_svm", build_loss("smooth_topk_svm", k=k, tau=1.0), logits, k)
            for m in SAMPLE_COUNTS:
                add(f"noised_topk M={m}", build_loss("noised_topk", k=k, epsilon=1.0, n_samples=m),
                    logits, k, m)
                add(f"noised_topk_imbalanced M={m}",
                    build_loss("noised_topk_imbalanced", k=k, epsilon=0.01, n_samples=m,
                               max_margin=0.2, scale=50.0, class_counts=counts), cosines, k, m)
                configs.append(Config(f"floor M={m}", num_classes, k, m,
                                      _floor_step(batch, num_classes, k, m, device)))
    return configs


def time_configs(configs: list[Config], repeats: int, warmup: int, device) -> dict[int, list[float]]:
    for config in configs:
        for _ in range(warmup):
            config.run()
    _synchronize(device)
    times: dict[int, list[float]] = {i: [] for i in range(len(configs))}
    for _ in range(repeats):
        for i, config in enumerate(configs):
            start = time.perf_counter()
            config.run()
            _synchronize(device)
            times[i].append(time.perf_counter() - start)
    return times


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summarise(configs, times, batch, device, threads) -> list[dict]:
    rows = []
    for i, config in enumerate(configs):
        rows.append({
            "loss": config.loss, "L": config.num_classes, "K": config.k if config.k else "",
            "M": config.n_samples or "", "batch": batch,
            "best_ms": min(times[i]) * 1e3,
            "median_ms": statistics.median(times[i]) * 1e3,
            "p25_ms": _quantile(times[i], 0.25) * 1e3, "p75_ms": _quantile(times[i], 0.75) * 1e3,
            "repeats": len(times[i]), "device": str(device), "threads": threads,
            "torch": torch.__version__,
        })
    ce = {row["L"]: row["best_ms"] for row in rows if row["loss"] == "ce"}
    floors = {(row["L"], row["K"], row["M"]): row["best_ms"] for row in rows if row["loss"].startswith("floor")}
    for row in rows:
        row["ratio_to_ce"] = row["best_ms"] / ce[row["L"]]
        if row["loss"].startswith("noised_topk M="):
            row["ratio_to_floor"] = row["best_ms"] / floors[(row["L"], row["K"], row["M"])]
        else:
            row["ratio_to_floor"] = ""
    return rows


def target_checks(rows, ks) -> list[tuple[str, str, float, bool]]:
    """The three targets of issue 2, per (L, M) (and per K for the floor)."""
    def median(loss, num_classes, k):
        return next(r["best_ms"] for r in rows if r["loss"] == loss and r["L"] == num_classes and r["K"] == k)

    checks = []
    for num_classes in CLASS_COUNTS:
        for m in SAMPLE_COUNTS:
            noised = f"noised_topk M={m}"
            if 1 in ks and 50 in ks:
                ratio = median(noised, num_classes, 50) / median(noised, num_classes, 1)
                checks.append(("noised K=50 / K=1 (<= 1.3)", f"L={num_classes} M={m}", ratio, ratio <= 1.3))
            if 10 in ks:
                ratio = median("smooth_topk_svm", num_classes, 10) / median(noised, num_classes, 10)
                checks.append(("smooth SVM / noised at K=10 (>= 2)", f"L={num_classes} M={m}", ratio, ratio >= 2.0))
            for k in ks:
                ratio = next(r["ratio_to_floor"] for r in rows
                             if r["loss"] == noised and r["L"] == num_classes and r["K"] == k)
                checks.append(("noised / floor (<= 1.5)", f"L={num_classes} M={m} K={k}", ratio, ratio <= 1.5))
    return checks


def markdown(rows, ks, checks, header: str) -> str:
    lines = [header, ""]
    for num_classes in CLASS_COUNTS:
        lines += [f"### L = {num_classes}: ms per forward+backward, best round (ratio to ce)", "",
                  "| loss | " + " | ".join(f"K={k}" for k in ks) + " |",
                  "|---|" + "---|" * len(ks)]
        labels = []
        for row in rows:
            if row["L"] == num_classes and row["loss"] not in labels:
                labels.append(row["loss"])
        for label in labels:
            cells = []
            for k in ks:
                match = [r for r in rows if r["loss"] == label and r["L"] == num_classes and r["K"] in (k, "")]
                cells.append(f"{match[0]['best_ms']:.3g} ({match[0]['ratio_to_ce']:.3g}x)" if match else "")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["### Targets of issue 2", "", "| target | case | measured | met |", "|---|---|---|---|"]
    for name, case, ratio, met in checks:
        lines.append(f"| {name} | {case} | {ratio:.2f} | {'yes' if met else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(rows, ks, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(CLASS_COUNTS), figsize=(13, 5.5), sharey=False)
    all_labels = list(dict.fromkeys(row["loss"] for row in rows))
    palette = plt.get_cmap("tab20")
    colors = {label: palette(i % 20) for i, label in enumerate(all_labels)}
    for axis, num_classes in zip(axes, CLASS_COUNTS):
        labels = [label for label in all_labels if any(r["L"] == num_classes and r["loss"] == label for r in rows)]
        for label in labels:
            points = [r for r in rows if r["loss"] == label and r["L"] == num_classes]
            style = "--" if label.startswith("floor") else ("-" if points[0]["K"] != "" else ":")
            if points[0]["K"] == "":
                ys = [points[0]["best_ms"]] * len(ks)
                xs = list(ks)
            else:
                xs = [r["K"] for r in points]
                ys = [r["best_ms"] for r in points]
            axis.plot(xs, ys, style, color=colors[label], marker="o" if points[0]["K"] != "" else None,
                      label=label)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xticks(list(ks))
        axis.set_xticklabels([str(k) for k in ks])
        axis.set_xlabel("K")
        axis.set_ylabel("forward+backward time per batch, best round (ms)")
        axis.set_title(f"L = {num_classes}, batch {rows[0]['batch']}")
        axis.grid(True, which="both", alpha=0.3)
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="K in {1, 10, 50} and 7 rounds")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 20, quick 7)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    ks = QUICK_KS if args.quick else FULL_KS
    repeats = args.repeats or (7 if args.quick else 20)
    configs = build_configs(ks, args.batch, device)
    started = time.perf_counter()
    times = time_configs(configs, repeats, args.warmup, device)
    elapsed = time.perf_counter() - started
    rows = summarise(configs, times, args.batch, device, args.threads)
    checks = target_checks(rows, ks)

    args.out.mkdir(parents=True, exist_ok=True)
    fields = ["loss", "L", "K", "M", "batch", "best_ms", "median_ms", "p25_ms", "p75_ms", "ratio_to_ce",
              "ratio_to_floor", "repeats", "device", "threads", "torch"]
    with open(args.out / "losses.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: (f"{row[key]:.6g}" if isinstance(row[key], float) else row[key])
                             for key in fields})
    header = (f"Loss benchmark: batch {args.batch}, device {device} ({platform.processor() or platform.machine()}), "
              f"{args.threads} thread(s), torch {torch.__version__}, best of {repeats} interleaved "
              f"rounds; {elapsed:.0f} s of timing.")
    text = markdown(rows, ks, checks, header)
    (args.out / "losses.md").write_text(text)
    plot(rows, ks, args.out / "losses.png")
    print(text)
    print(f"wrote {args.out / 'losses.csv'}, {args.out / 'losses.md'}, {args.out / 'losses.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
