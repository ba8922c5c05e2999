"""The label-smoothed top-K hinge loss.

The top-K hinge of class c, for scores s (Lapin, Hein and Schiele, "Top-k multiclass SVM",
NeurIPS 2015, the loss whose top-K error bound is eq. 2 there):

    h_c(s) = max(0, margin + s_[K]^(without c) - s_c),

with s_[K]^(without c) the K-th largest score of the classes other than c. Label smoothing
(Szegedy et al., "Rethinking the Inception architecture", CVPR 2016, section 7) replaces the
one-hot target by q = (1 - eps) e_y + eps / L; the loss is the hinge's expectation under q:

    loss(s, y) = (1 - eps) h_y(s) + eps / L * sum_c h_c(s).
"""

from __future__ import annotations

import torch

from setvalued.losses import SetValuedLoss


class LabelSmoothedTopKHinge(SetValuedLoss):
    """``loss(scores, targets)``: the hinge above, averaged over the batch."""

    def __init__(
        self,
        k: int = 5,
        smoothing: float = 0.1,
        margin: float = 1.0,
        num_classes: int | None = None,
        reduction: str = "mean",
    ):
        super().__init__(reduction)
        if num_classes is not None and k >= num_classes:
            raise ValueError(
                f"ls_topk_hinge parameter k must be smaller than the number of classes ({num_classes}), got {k}"
            )
        self.k, self.smoothing, self.margin = int(k), float(smoothing), float(margin)

    def hinges(self, scores: torch.Tensor) -> torch.Tensor:
        """(B, L): h_c(s) for every class c. The K-th largest score without c is the (K+1)-th
        largest when c is among the K largest (s_c >= the K-th), else the K-th."""
        top = scores.topk(self.k + 1, dim=1).values
        kth, next_ = top[:, self.k - 1 : self.k], top[:, self.k : self.k + 1]
        without = torch.where(scores >= kth, next_, kth)
        return (self.margin + without - scores).clamp_min(0)

    def forward(self, output, targets: torch.Tensor, indices=None) -> torch.Tensor:
        scores = self.prediction_scores(output).float()
        h = self.hinges(scores)
        own = h.gather(1, targets.view(-1, 1)).squeeze(1)
        return self.reduce((1 - self.smoothing) * own + self.smoothing * h.mean(dim=1))
