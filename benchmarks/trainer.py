"""The trainer's per-batch bookkeeping: one epoch of ``fit`` against a bare training loop.

Issue 14: on the quickstart model (studies/catalog/quickstart.yaml: a small MLP on the
synthetic features), an epoch of ``setvalued.training`` may cost at most 10% more than a bare
loop of forward, loss, backward and step over the same batches. The difference is what the
trainer adds per batch: the running ``train/loss`` and ``train/top<k>``, ``grad_nonzero``
(the score tensor's gradient kept and counted), the non-finite-loss check, autocast.

Both loops run on the same model, loss, optimizer and batches, in interleaved rounds (one
bare epoch, one trainer epoch per round, the order alternating), so that load changes on a
shared machine hit both alike. Per loss variant it prints the ratio trainer / bare of the
best rounds (other processes can only add time) and the median of the rounds' own ratios
(each round's two epochs ran back to back, under the same load).

    python benchmarks/trainer.py                       # the quickstart's three losses, CPU
    python benchmarks/trainer.py --rounds 40 --variants ce --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from setvalued.data.common import mix_seed
from setvalued.training import (
    Trial,
    resolve_config,
    split_batches,
)

QUICKSTART = REPO / "studies" / "catalog" / "quickstart.yaml"
TARGET = 1.10  # issue 14: at most 10% over the bare loop


def quickstart_config(variant: str, device: str) -> dict:
    """The quickstart's base config with the loss of `variant` and the given device."""
    study = yaml.safe_load(QUICKSTART.read_text())
    config = dict(study["base"])
    config["loss"] = dict(study["variants"][variant]["loss"])
    config["device"] = device
    return config


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_epoch(trial: Trial, epoch: int) -> float:
    """Seconds of one epoch of shuffling, then forward, loss, backward and step per batch:
    nothing else."""
    device = trial.device
    trial.model.train()
    trial.loss.train()
    _synchronize(device)
    start = time.perf_counter()
    order = torch.randperm(len(trial.data.train))
    batches = split_batches(
        trial.data.train,
        order,
        trial.cfg["optim"]["batch_size"],
        int(trial.cfg["data"]["num_workers"]),
        device,
        mix_seed(trial.seed, epoch),
    )
    for x, y, idx in batches:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        idx = idx.to(device, non_blocking=True)
        loss = trial.loss(trial.model(x), y, idx)
        trial.step.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        trial.step.optimizer.step()
    _synchronize(device)
    return time.perf_counter() - start


def trainer_epoch(trial: Trial, epoch: int) -> float:
    """Seconds of one call of the trainer's epoch (training only, no validation)."""
    _synchronize(trial.device)
    start = time.perf_counter()
    trial.train_epoch(epoch)
    _synchronize(trial.device)
    return time.perf_counter() - start


def measure(variant: str, device: str, rounds: int, warmup: int) -> dict:
    trial = Trial(resolve_config(quickstart_config(variant, device)), seed=0)
    bare, trainer = [], []
    for epoch in range(warmup + rounds):
        first, second = (bare_epoch, trainer_epoch) if epoch % 2 == 0 else (trainer_epoch, bare_epoch)
        times = {first: first(trial, epoch), second: second(trial, epoch)}
        if epoch >= warmup:
            bare.append(times[bare_epoch])
            trainer.append(times[trainer_epoch])
    batches = -(-len(trial.data.train) // trial.cfg["optim"]["batch_size"])
    return {
        "variant": variant,
        "batches": batches,
        "bare_best_ms": 1e3 * min(bare),
        "trainer_best_ms": 1e3 * min(trainer),
        "ratio_best": min(trainer) / min(bare),
        "ratio_paired": statistics.median(t / b for t, b in zip(trainer, bare)),
        "extra_us_per_batch": 1e6 * (min(trainer) - min(bare)) / batches,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["ce", "noised_topk", "smooth_topk_svm"],
        help="loss variants of the quickstart study",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a 1-CPU Ray trial uses 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"quickstart model, device {args.device}, {args.threads} thread(s), "
        f"{args.rounds} rounds; target: trainer / bare <= {TARGET:.2f}"
    )
    print(
        f"{'variant':<16} {'batches':>7} {'bare ms':>8} {'trainer ms':>10} "
        f"{'ratio best':>10} {'ratio paired':>12} {'extra us/batch':>14}"
    )
    for variant in args.variants:
        row = measure(variant, args.device, args.rounds, args.warmup)
        print(
            f"{row['variant']:<16} {row['batches']:>7} {row['bare_best_ms']:>8.2f} "
            f"{row['trainer_best_ms']:>10.2f} {row['ratio_best']:>10.3f} "
            f"{row['ratio_paired']:>12.3f} {row['extra_us_per_batch']:>14.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
