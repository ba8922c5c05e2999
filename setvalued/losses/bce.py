"""Binary cross-entropy, the multi-label baseline of the sparse-top loss ([Gar23] eq. 6.3).

Registered name: ``bce``.

``l_BCE(s, Y) = sum_j -y_j log sigma(s_j) - (1 - y_j) log(1 - sigma(s_j))`` with ``y = 1_Y``
(the thesis prints a scalar y, meaning y_j), summed over the L classes and averaged over the
batch; the logs are the stable ``logsigmoid`` forms. Its gradient is ``sigma(s) - y``: it is
consistent, but its predictions have full support, which is what sparse-top addresses
([Gar23] §6.2.1). Targets: a multi-hot (B, L) matrix, or class indices (B,) (one-vs-all BCE).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from setvalued.losses.base import SetValuedLoss, TwoHeadOutput, fixed_shapes, register_loss

__all__ = ["BCELoss", "bce_loss"]


def _multi_hot(targets: Any, scores: torch.Tensor) -> torch.Tensor:
    """Targets as a 0/1 matrix of the scores' dtype: class indices (B,) -> one-hot, a multi-hot
    (B, L) tensor as it is."""
    batch, num_classes = scores.shape
    targets = torch.as_tensor(targets).to(scores.device)
    if targets.dim() == 1 and targets.shape[0] == batch:
        if targets.is_floating_point() or targets.dtype == torch.bool:
            raise ValueError(f"bce: 1-D targets must be integer class indices, got dtype {targets.dtype}")
        # value checks read back on the host: eager CPU only (base.fixed_shapes)
        if batch and not fixed_shapes(targets) and (int(targets.min()) < 0 or int(targets.max()) >= num_classes):
            raise ValueError(f"bce: class indices must lie in [0, {num_classes - 1}]")
        return F.one_hot(targets.long(), num_classes).to(scores.dtype)
    if targets.shape != scores.shape:
        raise ValueError(
            f"bce: targets must be class indices ({batch},) or a multi-hot matrix "
            f"{tuple(scores.shape)}, got {tuple(targets.shape)}"
        )
    labels = targets.to(scores.dtype)
    if not fixed_shapes(labels) and bool(((labels != 0) & (labels != 1)).any()):
        raise ValueError("bce: a multi-hot target matrix must hold only 0 and 1")
    return labels


def bce_loss(scores: torch.Tensor, targets: Any) -> torch.Tensor:
    """Per-example BCE summed over the classes ([Gar23] eq. 6.3), (B,)."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2:
        raise ValueError(f"bce expects scores of shape (batch, classes), got {tuple(getattr(scores, 'shape', ()))}")
    labels = _multi_hot(targets, scores)
    return -(labels * F.logsigmoid(scores) + (1 - labels) * F.logsigmoid(-scores)).sum(dim=1)


@register_loss("bce")
class BCELoss(SetValuedLoss):
    """Binary cross-entropy over the classes, [Gar23] eq. 6.3 (module docstring)."""

    samplewise = True

    def __init__(self, reduction: str = "mean"):
        super().__init__(reduction)

    def forward(self, output: Any, targets: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(output, TwoHeadOutput):
            raise ValueError("bce expects a (batch, classes) score tensor, got a two-head output")
        if isinstance(output, torch.Tensor) and output.dtype not in (torch.float32, torch.float64):
            output = output.float()  # at least float32 (half precision under autocast)
        return self.reduce(bce_loss(output, targets))
