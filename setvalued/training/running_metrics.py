"""The training metrics of `setvalued.training`: the loss and scores of an epoch accumulated on
the device (folded every few steps), set sizes, a non-finite loss stopping the trial.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from setvalued.losses import SetValuedLoss, TwoHeadOutput
from setvalued.metrics import label_rank


class EpochSummary(Protocol):
    """What a trial reads of an epoch's running metrics (`RunningTrainMetrics`, or a fused
    array member's share of `setvalued.fused`'s)."""

    def summary(self, num_examples: int) -> dict[str, float]: ...


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite; ``epoch`` and ``step`` are 0-indexed."""

    def __init__(self, epoch: int, step: int, value: float):
        self.epoch, self.step, self.value = epoch, step, value
        super().__init__(
            f"non-finite training loss ({value}) at epoch {epoch}, step {step} (0-indexed); "
            "the trial is stopped (lower optim.lr or check the loss parameters)"
        )


def to_float32(output: Any) -> Any:
    """The model's output with half-precision scores (mixed precision) widened to float32, the
    precision the losses are computed in; float32 and float64 outputs are kept as they are."""
    if isinstance(output, TwoHeadOutput):
        return TwoHeadOutput(*(_widened(t) for t in output))
    return _widened(output)


def _widened(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def count_set_sizes(out: dict[str, list[Any]], k: str, sizes: list[int], shots: list[str]) -> None:
    """Append to the columns of ``out`` the number of test inputs of each (shot group of the
    label, set size) for the average-``k`` sets: the thesis Figure 5.4 histograms."""
    counts: dict[tuple[str, int], int] = {}
    for size, shot in zip(sizes, shots):
        counts[(shot, size)] = counts.get((shot, size), 0) + 1
    for (shot, size), count in sorted(counts.items()):
        out["avgk"].append(k)
        out["shot"].append(shot)
        out["size"].append(size)
        out["count"].append(count)


#: The running training metrics are folded (and the losses checked for NaN/inf) every this
#: many steps, or sooner once the pending scores and gradients hold this many numbers.
_FOLD_EVERY_STEPS = 50
_FOLD_EVERY_ELEMENTS = 1 << 22


class RunningTrainMetrics:
    """``train/loss``, ``train/top{k}`` and ``grad_nonzero(_active)`` of one epoch, with no
    device sync and no tensor operation per batch.

    A step only keeps references to what it produced anyway: its loss, the scores that the
    metrics rank (with their labels) and the gradient of those scores. Every
    ``_FOLD_EVERY_STEPS`` steps (sooner for large batches, to bound the memory held) the
    losses are read back and checked for NaN/inf, and the rest is folded into on-device
    counters in a few vectorised operations. Ranks follow ``metrics.label_rank`` (ties
    against the label), as ``metrics.topk_hits`` does.
    """

    #: the axis of the examples in what a step adds (0; a fused array's stacked members: 1)
    batch_dim = 0

    def __init__(self, epoch: int, ks: list[int], device: torch.device):
        self.epoch, self.ks = epoch, ks
        self.loss_values: list[float] = []  # the losses read back, checked finite
        self.batch_sizes: list[int] = []
        self.losses: list[torch.Tensor] = []  # the steps not folded yet
        self.scores: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []
        self.gradients: list[torch.Tensor] = []
        self.pending_elements = 0
        self.ks_tensor = torch.tensor(ks, dtype=torch.int64, device=device)
        self.hits = torch.zeros(len(ks), dtype=torch.int64, device=device)
        self.nonzero = torch.zeros((), dtype=torch.int64, device=device)
        self.active = torch.zeros((), dtype=torch.int64, device=device)
        self.grad_examples = 0

    def add(self, loss: torch.Tensor, scores: torch.Tensor | None, targets: torch.Tensor) -> None:
        """One training step: its loss, the watched scores (None when there are none) with
        their ``.grad`` filled by the backward pass, and the labels."""
        self.losses.append(loss.detach())
        self.batch_sizes.append(targets.shape[self.batch_dim])
        if scores is not None and self.ks:
            self.scores.append(scores.detach())
            self.targets.append(targets)
            self.pending_elements += scores.numel()
        if scores is not None and scores.grad is not None:
            self.gradients.append(scores.grad)
            self.grad_examples += scores.grad.shape[self.batch_dim]
            self.pending_elements += scores.grad.numel()
        if len(self.losses) >= _FOLD_EVERY_STEPS or self.pending_elements >= _FOLD_EVERY_ELEMENTS:
            self.fold()

    def fold(self) -> None:
        """Check the pending losses, then count the pending batches' hits and non-zero
        gradient coordinates into the counters."""
        self._read_losses()
        if self.scores:
            ranks = label_rank(torch.cat(self.scores), torch.cat(self.targets))
            self.hits += (ranks[:, None] < self.ks_tensor).sum(dim=0)
        if self.gradients:
            # non-zero coordinates per example (``bool()`` is ``!= 0``, NaN included, and faster)
            per_example = torch.cat(self.gradients).bool().sum(dim=1)
            self.nonzero += per_example.sum()
            self.active += (per_example > 0).sum()
        self.scores, self.targets, self.gradients = [], [], []
        self.pending_elements = 0

    def _read_losses(self) -> None:
        """Read the pending losses back (one device sync) and raise ``NonFiniteLossError`` at
        the first NaN/inf one."""
        if not self.losses:
            return
        values = torch.stack(self.losses).tolist()
        for offset, value in enumerate(values):
            if not math.isfinite(value):
                raise NonFiniteLossError(self.epoch, len(self.loss_values) + offset, value)
        self.loss_values.extend(values)
        self.losses = []

    def summary(self, num_examples: int) -> dict[str, float]:
        """The epoch's metrics, per training example."""
        self.fold()
        loss_sum = 0.0  # batch by batch, in float64: the rounding of a running sum
        for loss, size in zip(self.loss_values, self.batch_sizes):
            loss_sum += loss * size
        hits = self.hits.tolist()
        nonzero, active = (float(v) for v in torch.stack([self.nonzero, self.active]).tolist())
        nan = float("nan")
        return {
            "train/loss": loss_sum / num_examples,
            **{f"train/top{k}": h / num_examples for k, h in zip(self.ks, hits)},
            "grad_nonzero": nonzero / self.grad_examples if self.grad_examples else nan,
            "grad_nonzero_active": nonzero / active if active else nan,
        }


def watched_scores(output: Any, loss: SetValuedLoss) -> torch.Tensor | None:
    """The score tensor whose gradient ``grad_nonzero`` counts: the one the metrics rank."""
    if isinstance(output, TwoHeadOutput):
        chosen = loss.prediction_scores(output)
        return next((t for t in output if t is chosen), None)
    return output


def fmt_k(k: float) -> str:
    """A K as metric names write it: 5, 1.5."""
    return str(int(k)) if float(k).is_integer() else repr(float(k))
