"""Cosine classifier layer for the losses that expect cosine scores (``head = "normed"``).

Used by ``ldam`` and ``noised_topk_imbalanced`` ([Wan+18]; [Cao+19]; [Gar23] §4.4.5.1;
docs/papers.md, note T-N4): features and class weights are both L2-normalised, so every
score is a cosine in [-1, 1]; the losses apply their own ``scale``. The cosines are computed
in float32 under mixed precision (autocast): the margins they are compared with are 0.01-0.2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NormedLinear"]


class NormedLinear(nn.Module):
    """``scores[b, c] = cos(x_b, w_c)``: a bias-free linear layer on unit vectors.

    The weight has shape (in_features, out_features), one column per class (the layout of
    the reference code), initialised uniform in [-1, 1] and rescaled to unit columns.
    """

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features < 1:
            raise ValueError(f"in_features must be an integer >= 1, got {in_features!r}")
        if isinstance(out_features, bool) or not isinstance(out_features, int) or out_features < 1:
            raise ValueError(f"out_features must be an integer >= 1, got {out_features!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.uniform_(-1.0, 1.0)
            self.weight.div_(self.weight.norm(dim=0, keepdim=True).clamp_min(1e-12))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if features.dim() != 2 or features.shape[1] != self.in_features:
            raise ValueError(
                f"NormedLinear expects features of shape (batch, {self.in_features}), got {tuple(features.shape)}"
            )
        device = features.device.type
        if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
            # float32 under autocast (issue #34): in bfloat16 a cosine in [0.5, 1) has a spacing
            # of 0.004, against the losses' margins of 0.01-0.2 and epsilon 0.01
            with torch.autocast(device, enabled=False):
                return self._cosines(features.float())
        return self._cosines(features)

    def _cosines(self, features: torch.Tensor) -> torch.Tensor:
        return F.normalize(features, dim=1) @ F.normalize(self.weight.to(features.dtype), dim=0)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
