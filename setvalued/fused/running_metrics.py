"""The running training metrics of a fused array's N members in one (``FusedRunningMetrics``):
each member's ``train/loss``, ``train/top{k}`` and ``grad_nonzero(_active)`` exactly as its
separate trial's ``RunningTrainMetrics`` counts them, folded for all members at once.

A step keeps references to the members' losses (N,), their stacked scores (N, B, L) with the
gradient of those scores and the labels (N, B); every ``_FOLD_EVERY_STEPS`` steps (sooner for
large batches) the losses are read back in one copy and the rest is counted in a few
operations over all members (``label_rank`` on the N x B rows, then a sum per member). A
member whose loss is NaN or infinite gets the ``NonFiniteLossError`` its trial would raise (the
same epoch and step) in ``errors``; the others go on.
"""

from __future__ import annotations

import math

import torch

from setvalued.metrics import label_rank
from setvalued.training import NonFiniteLossError, RunningTrainMetrics


class FusedRunningMetrics(RunningTrainMetrics):
    """``RunningTrainMetrics`` of ``members`` members that train together: what a step adds
    is stacked along a leading members axis (``add``: losses (N,), scores (N, B, L), labels
    (N, B)), and every counter holds one entry per member."""

    batch_dim = 1

    def __init__(self, epoch: int, ks: list[int], device: torch.device, members: int):
        super().__init__(epoch, ks, device)
        self.members = members
        self.loss_values: list[list[float]] = [[] for _ in range(members)]  # type: ignore[assignment]
        self.hits = torch.zeros(members, len(ks), dtype=torch.int64, device=device)
        self.nonzero = torch.zeros(members, dtype=torch.int64, device=device)
        self.active = torch.zeros(members, dtype=torch.int64, device=device)
        #: per member, the error that stopped it (its loss went non-finite), else None
        self.errors: list[NonFiniteLossError | None] = [None] * members

    def fold(self) -> None:
        """Check the pending losses of every member, then count the pending batches' hits and
        non-zero gradient coordinates of every member into the counters."""
        self._read_losses()
        if self.scores:
            scores, targets = torch.cat(self.scores, dim=1), torch.cat(self.targets, dim=1)
            ranks = label_rank(scores.flatten(0, 1), targets.flatten(0, 1)).view(self.members, -1)
            self.hits += (ranks.unsqueeze(-1) < self.ks_tensor).sum(dim=1)
        if self.gradients:
            per_example = torch.cat(self.gradients, dim=1).bool().sum(dim=2)  # (N, examples)
            self.nonzero += per_example.sum(dim=1)
            self.active += (per_example > 0).sum(dim=1)
        self.scores, self.targets, self.gradients = [], [], []
        self.pending_elements = 0

    def _read_losses(self) -> None:
        """Read the pending losses back (one device sync) and record, per member, the first
        NaN/inf one as its error."""
        if not self.losses:
            return
        steps = torch.stack(self.losses).tolist()  # (steps, N)
        self.losses = []
        for i in range(self.members):
            if self.errors[i] is not None:
                continue
            values = [row[i] for row in steps]
            bad = next((offset for offset, value in enumerate(values) if not math.isfinite(value)), None)
            if bad is not None:
                self.errors[i] = NonFiniteLossError(self.epoch, len(self.loss_values[i]) + bad, values[bad])
            else:
                self.loss_values[i].extend(values)

    def summary(self, num_examples: int) -> dict[str, float]:
        raise TypeError("a fused array's running metrics are per member: use .of(member).summary(n)")

    def member_summary(self, member: int, num_examples: int) -> dict[str, float]:
        """Member ``member``'s epoch metrics, per training example, as ``RunningTrainMetrics``
        gives them; raises its ``NonFiniteLossError`` if its loss went non-finite."""
        self.fold()
        error = self.errors[member]
        if error is not None:
            raise error
        loss_sum = 0.0  # batch by batch, in float64: the rounding of a running sum
        for loss, size in zip(self.loss_values[member], self.batch_sizes):
            loss_sum += loss * size
        hits = self.hits[member].tolist()
        nonzero, active = (float(v) for v in torch.stack([self.nonzero[member], self.active[member]]).tolist())
        nan = float("nan")
        return {
            "train/loss": loss_sum / num_examples,
            **{f"train/top{k}": h / num_examples for k, h in zip(self.ks, hits)},
            "grad_nonzero": nonzero / self.grad_examples if self.grad_examples else nan,
            "grad_nonzero_active": nonzero / active if active else nan,
        }

    def of(self, member: int) -> MemberMetrics:
        """Member ``member``'s view, with the ``summary(num_examples)`` of ``RunningTrainMetrics``."""
        return MemberMetrics(self, member)


class MemberMetrics:
    """One member's running metrics in a ``FusedRunningMetrics``."""

    def __init__(self, fused: FusedRunningMetrics, member: int):
        self.fused, self.member = fused, member

    def summary(self, num_examples: int) -> dict[str, float]:
        return self.fused.member_summary(self.member, num_examples)
