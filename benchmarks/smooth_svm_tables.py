"""[BZK18] Tables 3-5 (App. B.3): the elementary symmetric polynomials of the smooth top-k SVM.

The paper measures the computation of ``(log sigma_{k-1}, log sigma_k)`` of ``e = exp(x)``, not
training. This script prints the same rows beside the published ones:

- **Table 3, forward**: the summation algorithm (SA, [BZK18] Algorithm 3, App. B.3.1: a
  sequential loop over the n values, the k coefficients updated in parallel, linear space)
  against the log-space divide and conquer (DC, [BZK18] Algorithm 1,
  ``setvalued.losses.smooth_svm.log_elementary_symmetric``). Extra row: the path the loss
  itself runs (``ours``: the k + 1 largest in log space, the rest by a chunked linear recursion
  in float64; module doc of ``setvalued/losses/smooth_svm.py``).
- **Table 4, backward**: autograd through the DC recursion (AD) against a custom backward
  (CB). This project's custom backward is the closed form of [BZK18] eqs. 15-18 on the
  linear-space part of ``ours`` (``_BodyLogSigma``), so the CB row times the backward of
  ``ours`` (float64 inside, as the loss computes it).
- **Table 5, stability**: SA and DC-log in float32 (S) and float64 (D) over tau in {10, 1, 0.1,
  0.01, 1e-3, 1e-4}; a setting is stable (yes) when every output is finite, unstable (no) on
  overflow or NaN. The paper's inputs are the scores of 128 ImageNet images under a pretrained
  ResNet-18, not available offline; the substitute is logits N(0, 4^2) with n = 1000 (the
  ResNet-18 logits' spread), which reproduces the published pattern.

Setup as in the paper and its perf script: scores ``randn(B, n)``, ``x = s / (k tau)`` with
tau = 0.1, k = 5, batch 256, float32. Times are best of interleaved rounds on one CPU thread by
default (``--device cuda`` for a GPU; the paper used a Titan Xp and the average of 50 runs), so
only the ratios SA/DC and AD/CB compare with the paper's; the published ratios are computed
from its seconds.

    python benchmarks/smooth_svm_tables.py                 # n in {100, 1000, 10000}
    python benchmarks/smooth_svm_tables.py --big           # also n = 100000 (SA: seconds per run)
    python benchmarks/smooth_svm_tables.py --batch 64 --repeats 3   # quicker

Writes ``benchmarks/out/smooth_svm_tables.csv`` and ``.md`` and prints the tables.
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from setvalued.losses.smooth_svm import _log_sigma_top_and_body, log_elementary_symmetric

K = 5
TIMING_TAU = 0.1
SIZES = (100, 1000, 10000)
BIG_SIZE = 100000
STABILITY_TAUS = (10.0, 1.0, 0.1, 0.01, 1e-3, 1e-4)
STABILITY_LOGIT_STD = 4.0
STABILITY_BATCH = 128
STABILITY_CLASSES = 1000

#: [BZK18] Table 3, forward time (s), Titan Xp, k = 5, batch 256, mean of 50 runs
PUBLISHED_FORWARD_S = {
    "SA": {100: 0.006, 1000: 0.062, 10000: 0.627, 100000: 6.258},
    "DC": {100: 0.011, 1000: 0.018, 10000: 0.024, 100000: 0.146},
}
#: [BZK18] Table 4, backward time (s), same setup
PUBLISHED_BACKWARD_S = {
    "AD": {100: 0.093, 1000: 0.139, 10000: 0.194, 100000: 0.287},
    "CB": {100: 0.007, 1000: 0.006, 10000: 0.020, 100000: 0.171},
}
#: [BZK18] Table 5, forward stability (True = no overflow), per tau of STABILITY_TAUS
PUBLISHED_STABLE = {
    ("SA", "float32"): (True, True, False, False, False, False),
    ("SA", "float64"): (True, True, True, False, False, False),
    ("DC log", "float32"): (True,) * 6,
    ("DC log", "float64"): (True,) * 6,
}


# ----------------------------------------------------------------------------------------
# the two baselines of the paper: SA, and autograd through DC
# ----------------------------------------------------------------------------------------


def summation_algorithm(e: torch.Tensor, k: int) -> torch.Tensor:
    """``sigma_0..k(e)`` along the last axis of (B, n) values, linear space: [BZK18] Algorithm 3.

    ``sigma_{j,i} = sigma_{j,i-1} + e_i sigma_{j-1,i-1}``: the loop over the n values is
    sequential, the update of the (at most k) coefficients is one parallel step, into a
    pre-allocated buffer (as in the paper's speed comparison, App. B.3.1). No rescaling: it
    overflows where the products of k values do, which is what Table 5 shows.
    """
    batch, n = e.shape
    sigma = e.new_zeros(batch, k + 1)
    sigma[:, 0] = 1.0
    for i in range(n):
        top = min(i + 1, k)
        # the right side is formed from the old coefficients before the in-place add
        sigma[:, 1 : top + 1] += e[:, i : i + 1] * sigma[:, :top]
    return sigma


def sa_log_sigma(x: torch.Tensor, k: int) -> torch.Tensor:
    """``(log sigma_{k-1}, log sigma_k)`` of exp(x) by the summation algorithm, (B, 2)."""
    return torch.log(summation_algorithm(torch.exp(x), k)[:, k - 1 :])


def dc_log_sigma(x: torch.Tensor, k: int) -> torch.Tensor:
    """``(log sigma_{k-1}, log sigma_k)`` of exp(x) by the log-space divide and conquer, (B, 2).

    Differentiable by autograd through every level of the recursion: Table 4's AD row.
    """
    return log_elementary_symmetric(x, k)[:, k - 1 :]


def ours_log_sigma(x: torch.Tensor, k: int) -> torch.Tensor:
    """``(log sigma_{k-1}, log sigma_k)`` as the loss computes them (float64, custom backward)."""
    return _log_sigma_top_and_body(x.double(), k)


# ----------------------------------------------------------------------------------------
# Table 5: stability
# ----------------------------------------------------------------------------------------


def stability_logits(
    batch: int = STABILITY_BATCH, num_classes: int = STABILITY_CLASSES, std: float = STABILITY_LOGIT_STD, seed: int = 0
) -> torch.Tensor:
    """The substitute for the ResNet-18 ImageNet scores of Table 5: N(0, std^2), float64."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, num_classes, generator=generator, dtype=torch.float64) * std


def is_stable(method: str, logits: torch.Tensor, tau: float, dtype: torch.dtype, k: int = K) -> bool:
    """Whether ``method`` ("SA" or "DC log") gives finite ``log sigma_{k-1}, log sigma_k`` at tau."""
    x = (logits / (k * tau)).to(dtype)
    with torch.no_grad():
        out = sa_log_sigma(x, k) if method == "SA" else dc_log_sigma(x, k)
    return bool(torch.isfinite(out).all())


def stability_table(logits: torch.Tensor, taus=STABILITY_TAUS, k: int = K) -> dict[tuple[str, str], tuple]:
    """Table 5 computed: {(method, dtype name): (stable at each tau)}."""
    table = {}
    for method in ("SA", "DC log"):
        for dtype in (torch.float32, torch.float64):
            name = str(dtype).removeprefix("torch.")
            table[(method, name)] = tuple(is_stable(method, logits, tau, dtype, k) for tau in taus)
    return table


def dc_float32_error(logits: torch.Tensor, taus=STABILITY_TAUS, k: int = K) -> dict[float, float]:
    """Largest relative error of DC-log in float32 against DC-log in float64, per tau."""
    errors = {}
    for tau in taus:
        x = logits / (k * tau)
        with torch.no_grad():
            wide = dc_log_sigma(x, k)
            narrow = dc_log_sigma(x.float(), k).double()
        errors[tau] = float(((narrow - wide).abs() / wide.abs().clamp_min(1.0)).max())
    return errors


# ----------------------------------------------------------------------------------------
# Tables 3 and 4: timing
# ----------------------------------------------------------------------------------------


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timing_inputs(
    batch: int, n: int, device: torch.device, seed: int = 1234, tau: float = TIMING_TAU, k: int = K
) -> torch.Tensor:
    """``x = s / (k tau)`` for scores ``randn(batch, n)``, float32, as the paper's perf script."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, n, generator=generator) / (k * tau)).to(device)


def forward_step(method: Callable, x: torch.Tensor, k: int) -> Callable[[], Callable[[], None]]:
    """A forward run: nothing to prepare, the whole call is timed."""

    def prepare() -> Callable[[], None]:
        def timed() -> None:
            with torch.no_grad():
                method(x, k)

        return timed

    return prepare


def backward_step(method: Callable, x: torch.Tensor, k: int) -> Callable[[], Callable[[], None]]:
    """A backward run: the forward is prepared untimed, ``(log sigma_{k-1} + log sigma_k).sum()``
    is differentiated in the timed part (as the paper's perf script)."""

    def prepare() -> Callable[[], None]:
        leaf = x.detach().requires_grad_(True)
        total = method(leaf, k).sum()

        def timed() -> None:
            total.backward()

        return timed

    return prepare


def time_rounds(steps: dict[str, Callable], repeats: int, warmup: int, device) -> dict[str, list[float]]:
    """Seconds per run of each step, over interleaved rounds (load changes hit them alike)."""
    for prepare in steps.values():
        for _ in range(warmup):
            prepare()()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, prepare in steps.items():
            timed = prepare()
            _synchronize(device)
            start = time.perf_counter()
            timed()
            _synchronize(device)
            times[name].append(time.perf_counter() - start)
    return times


def measure(sizes, batch: int, repeats: int, warmup: int, device, k: int = K) -> list[dict]:
    """One row per (n, method) with best and median seconds."""
    rows = []
    for n in sizes:
        x = timing_inputs(batch, n, device, k=k)
        steps = {
            "forward SA": forward_step(sa_log_sigma, x, k),
            "forward DC": forward_step(dc_log_sigma, x, k),
            "forward ours": forward_step(ours_log_sigma, x, k),
            "backward AD": backward_step(dc_log_sigma, x, k),
            "backward CB": backward_step(ours_log_sigma, x, k),
        }
        times = time_rounds(steps, repeats, warmup, device)
        for name, values in times.items():
            rows.append(
                {
                    "n": n,
                    "step": name,
                    "best_s": min(values),
                    "median_s": statistics.median(values),
                    "repeats": len(values),
                }
            )
    return rows


# ----------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------


def _best(rows, n, step) -> float:
    return next(r["best_s"] for r in rows if r["n"] == n and r["step"] == step)


def _tick(stable: bool) -> str:
    return "✓" if stable else "✗"


def markdown(rows, sizes, stability, errors, header: str) -> str:
    columns = "| n | " + " | ".join(f"{n:,}" for n in sizes) + " |"
    rule = "|---|" + "---|" * len(sizes)
    lines = [header, "", "### Table 3: forward, SA / DC (ratio of times)", "", columns, rule]
    lines.append(
        "| [BZK18] (Titan Xp) | "
        + " | ".join(f"{PUBLISHED_FORWARD_S['SA'][n] / PUBLISHED_FORWARD_S['DC'][n]:.3g}" for n in sizes)
        + " |"
    )
    lines.append(
        "| this machine | "
        + " | ".join(f"{_best(rows, n, 'forward SA') / _best(rows, n, 'forward DC'):.3g}" for n in sizes)
        + " |"
    )
    lines.append(
        "| this machine, SA / ours | "
        + " | ".join(f"{_best(rows, n, 'forward SA') / _best(rows, n, 'forward ours'):.3g}" for n in sizes)
        + " |"
    )
    lines += ["", "Seconds on this machine (best round):", "", columns, rule]
    for step in ("forward SA", "forward DC", "forward ours"):
        lines.append(f"| {step} | " + " | ".join(f"{_best(rows, n, step):.3g}" for n in sizes) + " |")

    lines += ["", "### Table 4: backward, AD / CB (ratio of times)", "", columns, rule]
    lines.append(
        "| [BZK18] (Titan Xp) | "
        + " | ".join(f"{PUBLISHED_BACKWARD_S['AD'][n] / PUBLISHED_BACKWARD_S['CB'][n]:.3g}" for n in sizes)
        + " |"
    )
    lines.append(
        "| this machine | "
        + " | ".join(f"{_best(rows, n, 'backward AD') / _best(rows, n, 'backward CB'):.3g}" for n in sizes)
        + " |"
    )
    lines.append(
        "| [BZK18] AD / DC forward | "
        + " | ".join(f"{PUBLISHED_BACKWARD_S['AD'][n] / PUBLISHED_FORWARD_S['DC'][n]:.3g}" for n in sizes)
        + " |"
    )
    lines.append(
        "| this machine, AD / DC forward | "
        + " | ".join(f"{_best(rows, n, 'backward AD') / _best(rows, n, 'forward DC'):.3g}" for n in sizes)
        + " |"
    )
    lines.append(
        "| [BZK18] CB / DC forward | "
        + " | ".join(f"{PUBLISHED_BACKWARD_S['CB'][n] / PUBLISHED_FORWARD_S['DC'][n]:.3g}" for n in sizes)
        + " |"
    )
    lines.append(
        "| this machine, CB / ours forward | "
        + " | ".join(f"{_best(rows, n, 'backward CB') / _best(rows, n, 'forward ours'):.3g}" for n in sizes)
        + " |"
    )
    lines += ["", "Seconds on this machine (best round):", "", columns, rule]
    for step in ("backward AD", "backward CB"):
        lines.append(f"| {step} | " + " | ".join(f"{_best(rows, n, step):.3g}" for n in sizes) + " |")

    taus = " | ".join(f"{tau:g}" for tau in STABILITY_TAUS)
    lines += [
        "",
        "### Table 5: forward stability (✓ finite, ✗ overflow or NaN)",
        "",
        f"Logits N(0, {STABILITY_LOGIT_STD:g}^2), batch {STABILITY_BATCH}, n = {STABILITY_CLASSES}, "
        f"k = {K} (substitute for the paper's ResNet-18 ImageNet scores). Each cell: this machine / "
        "[BZK18].",
        "",
        f"| tau | {taus} |",
        "|---|" + "---|" * len(STABILITY_TAUS),
    ]
    for (method, dtype), stable in stability.items():
        published = PUBLISHED_STABLE[(method, dtype)]
        short = "S" if dtype == "float32" else "D"
        lines.append(
            f"| {method} ({short}) | "
            + " | ".join(f"{_tick(ours)} / {_tick(theirs)}" for ours, theirs in zip(stable, published))
            + " |"
        )
    same = all(stability[key] == PUBLISHED_STABLE[key] for key in PUBLISHED_STABLE)
    lines += [
        "",
        f"Same pattern as published: {'yes' if same else 'NO'}.",
        "Largest relative error of DC log (S) against DC log (D): "
        + ", ".join(f"tau={tau:g}: {error:.1e}" for tau, error in errors.items())
        + ".",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", action="store_true", help=f"also n = {BIG_SIZE:,} (SA takes seconds per run)")
    parser.add_argument("--batch", type=int, default=256, help="rows per batch (default 256, as the paper)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (default 7; best is reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = parser.parse_args(argv)
    for name in ("batch", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sizes = SIZES + ((BIG_SIZE,) if args.big else ())
    logits = stability_logits()
    stability = stability_table(logits)
    errors = dc_float32_error(logits)

    started = time.perf_counter()
    rows = measure(sizes, args.batch, args.repeats, args.warmup, device)
    elapsed = time.perf_counter() - started

    args.out.mkdir(parents=True, exist_ok=True)
    fields = ["n", "step", "best_s", "median_s", "repeats", "batch", "k", "device", "threads", "torch"]
    with open(args.out / "smooth_svm_tables.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {
                    **{key: (f"{value:.6g}" if isinstance(value, float) else value) for key, value in row.items()},
                    "batch": args.batch,
                    "k": K,
                    "device": str(device),
                    "threads": args.threads,
                    "torch": torch.__version__,
                }
            )
    header = (
        f"[BZK18] Tables 3-5 on this machine: k = {K}, tau = {TIMING_TAU:g}, batch {args.batch}, float32 "
        f"inputs, device {device} ({platform.processor() or platform.machine()}), {args.threads} "
        f"thread(s), torch {torch.__version__}, best of {args.repeats} interleaved rounds; "
        f"{elapsed:.0f} s of timing. 'ours' is the loss's own path (float64 inside)."
    )
    text = markdown(rows, sizes, stability, errors, header)
    (args.out / "smooth_svm_tables.md").write_text(text)
    print(text)
    print(f"wrote {args.out / 'smooth_svm_tables.csv'}, {args.out / 'smooth_svm_tables.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
