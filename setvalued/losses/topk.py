"""Top-K losses of Garcin et al. (ICML 2022, thesis ch. 4) and their baselines.

Registered names: ``ce``, ``focal``, ``ldam``, ``hinge_topk``, ``cvx_hinge_topk``,
``calibrated_hinge_topk``, ``noised_topk``, ``noised_topk_imbalanced``.
Formulas: [GSJS22] / [Gar23] ch. 4 (thesis numbering); errata and notes: docs/papers.md.

Notation: ``s`` the (B, L) scores, ``y`` the targets, ``s_[k]`` the k-th largest entry of a
row (thesis eq. 4.1), ``(x)_+ = max(x, 0)``.

Public helpers:

- :func:`smooth_kth_largest` -- the Monte-Carlo perturbed k-th largest value
  ``tau_hat_{k,eps,M}(s) = (1/M) sum_m (s + eps Z_m)_[k]`` (thesis eq. 4.11 with one shared
  draw, docs/papers.md, note T-N1), differentiable with the pathwise gradient
  ``(1/M) sum_m onehot(argk(s + eps Z_m))`` (thesis eq. 4.12).
- :func:`ldam_margins` -- per-class margins ``m_y = max_margin * (n_min / n_y)^(1/4)``
  ([Cao+19]; [Gar23] §4.3.3; docs/papers.md, note T-N4).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F

from setvalued.losses.base import SetValuedLoss, fusion_declared, loop_member_losses, register_loss
from setvalued.losses.topk_operator import (
    PRUNING_FAILURE_PROBABILITY,
    check_bool,
    check_float,
    check_int,
    check_k_for_classes,
    check_noise,
    check_targets,
    draws_every_class,
    perturbed_kth_largest,
    score_tensor,
    select_kth_largest,
    smooth_kth_largest,
    working_dtype,
)

__all__ = [
    "PRUNING_FAILURE_PROBABILITY",
    "smooth_kth_largest",
    "ldam_margins",
    "CrossEntropy",
    "Focal",
    "LDAM",
    "HingeTopK",
    "ConvexHingeTopK",
    "CalibratedHingeTopK",
    "NoisedTopK",
    "NoisedTopKImbalanced",
]


# --------------------------------------------------------------------------------------
# The perturbed k-th largest value (thesis section 4.3; docs/papers.md, note T-N1)
# --------------------------------------------------------------------------------------


class _NoisedHinge(torch.autograd.Function):
    """Per-sample ``scale * (margin + tau_hat_{k,eps,M}(s) - s_y)_+`` in one autograd node.

    Thesis eq. 4.10 / 4.13 with the estimated gradient of eq. 4.12:
    ``1{hinge > 0} * scale * ((1/M) sum_m onehot(argk(s + eps Z_m)) - onehot(y))``, from the
    same draw as the value and the hinge test (docs/papers.md, note T-N1). One node instead of
    a chain of gather/sub/relu nodes: the same result, less per-call overhead on small batches.
    """

    @staticmethod
    def forward(
        ctx: Any,
        scores: Any,
        targets: Any,
        margin: Any,
        k: Any,
        epsilon: Any,
        n_samples: Any,
        scale: Any,
        noise: Any,
        exact: Any,
    ) -> torch.Tensor:
        smoothed, indices = perturbed_kth_largest(scores, k, epsilon, n_samples, noise, exact)
        target_scores = scores.detach().gather(1, targets.unsqueeze(1)).squeeze(1)
        hinge = smoothed.add_(margin).sub_(target_scores)
        if scale != 1.0:
            hinge.mul_(scale)
        # the gradient in one scatter: weight scale/M at each selected class, -scale at y,
        # on the rows whose hinge is active
        picks = torch.cat([indices, targets.unsqueeze(1)], dim=1)  # (B, M + 1)
        shares = torch.full((1, picks.shape[1]), scale / indices.shape[1], dtype=hinge.dtype, device=hinge.device)
        # fill_ of a slice: a 0-d setitem with a Python number copies a CPU scalar to the
        # device, a blocking copy on CUDA (issue #34)
        shares[:, -1:].fill_(-scale)
        active = (hinge > 0).to(hinge.dtype).unsqueeze(1)
        ctx.save_for_backward(picks, active * shares)
        ctx.num_classes = scores.shape[1]
        return hinge.clamp_(min=0.0)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        picks, weights = ctx.saved_tensors
        grad = weights.new_zeros(picks.shape[0], ctx.num_classes)
        grad.scatter_add_(1, picks, weights * grad_output.unsqueeze(1).to(weights.dtype))
        return grad, None, None, None, None, None, None, None, None


# --------------------------------------------------------------------------------------
# Margins of LDAM and of the imbalanced noised loss ([Cao+19]; docs/papers.md, note T-N4)
# --------------------------------------------------------------------------------------


def _class_counts_tensor(class_counts: Any, num_classes: int | None = None) -> torch.Tensor:
    """Validate per-class training counts: 1-D, positive, finite, length ``num_classes``."""
    if class_counts is None:
        raise ValueError(
            "class_counts is required: the training count of every class (a list of positive numbers, one per class)"
        )
    try:
        counts = torch.as_tensor(class_counts, dtype=torch.float64).detach().cpu()
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"class_counts must be a list of positive numbers, got {class_counts!r}") from None
    if counts.dim() != 1 or counts.numel() == 0:
        raise ValueError(f"class_counts must be a non-empty 1-D list, got shape {tuple(counts.shape)}")
    if num_classes is not None and counts.numel() != num_classes:
        raise ValueError(
            f"class_counts must have one entry per class (length {num_classes}), got length {counts.numel()}"
        )
    if not torch.isfinite(counts).all() or (counts <= 0).any():
        bad = [c for c in counts.tolist() if not (math.isfinite(c) and c > 0)]
        raise ValueError(f"class_counts must be finite and > 0 for every class, got {bad[:5]}")
    return counts


def ldam_margins(
    class_counts: Sequence[float] | torch.Tensor, max_margin: float, num_classes: int | None = None
) -> torch.Tensor:
    """LDAM margins ``m_y = max_margin * (n_min / n_y)^(1/4)`` as a float32 tensor.

    [Cao+19], [Gar23] eq. 4.13: ``m_y = C / n_y^(1/4)``, with C set so that the rarest class
    gets ``max_margin`` ([Gar23] §4.4.5.1; docs/papers.md, note T-N4). Example: counts
    [17, 23, 55], max 0.3 give [0.3, 0.27816, 0.22369].
    """
    max_margin = check_float("max_margin", max_margin, 0.0)
    counts = _class_counts_tensor(class_counts, num_classes)
    inverse_root = counts.pow(-0.25)
    margins = inverse_root * (max_margin / inverse_root.max())
    return margins.to(torch.float32)


class _MarginLoss(SetValuedLoss):
    """Shared part of the losses that hold per-class margins as a buffer."""

    margins: torch.Tensor

    def _init_margins(self, class_counts: Any, max_margin: float, num_classes: int | None) -> None:
        if num_classes is not None:
            num_classes = check_int("num_classes", num_classes, 2)
        self.max_margin = check_float("max_margin", max_margin, 0.0)
        self.register_buffer("margins", ldam_margins(class_counts, self.max_margin, num_classes))

    def _target_margins(self, scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if scores.shape[1] != self.margins.numel():
            raise ValueError(
                f"{self.registry_name}: class_counts has {self.margins.numel()} entries but the "
                f"scores have {scores.shape[1]} classes; class_counts must have one entry per class"
            )
        return self.margins.to(device=scores.device, dtype=scores.dtype)[targets]


# --------------------------------------------------------------------------------------
# Baselines: CE, focal, LDAM ([Gar23] Table 4.1)
# --------------------------------------------------------------------------------------


@register_loss("ce")
class CrossEntropy(SetValuedLoss):
    """Cross-entropy ``-log softmax(s)_y`` ([Gar23] Table 4.1)."""

    samplewise = True

    def __init__(self, reduction: str = "mean"):
        super().__init__(reduction)

    def forward(self, output: Any, targets: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        scores = score_tensor(output, "ce")
        targets = check_targets(targets, scores, "ce")
        return self.reduce(F.cross_entropy(working_dtype(scores), targets, reduction="none"))


@register_loss("focal")
class Focal(SetValuedLoss):
    """Focal loss ``(1 - p_y)^gamma * CE`` with ``p_y = exp(-CE)`` ([Lin+17]).

    docs/papers.md, erratum T-E2: [Gar23] Table 4.1 ([GSJS22] Table 1) prints
    ``(1 - log[CE])^gamma``; the standard form is implemented, without alpha-balancing.
    """

    samplewise = True

    def __init__(self, gamma: float = 2.0, reduction: str = "mean"):
        super().__init__(reduction)
        self.gamma = check_float("gamma", gamma, 0.0)

    def forward(self, output: Any, targets: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        scores = score_tensor(output, "focal")
        targets = check_targets(targets, scores, "focal")
        ce = F.cross_entropy(working_dtype(scores), targets, reduction="none")
        # 1 - p_y = -expm1(-CE), accurate when p_y -> 1; the floor keeps the gradient of
        # (1 - p_y)^gamma finite (no 0 * inf) when CE underflows to 0 and gamma < 1.
        one_minus_p = (-torch.expm1(-ce)).clamp_min(torch.finfo(ce.dtype).tiny)
        return self.reduce(one_minus_p.pow(self.gamma) * ce)


@register_loss("ldam")
class LDAM(_MarginLoss):
    """LDAM: CE on ``scale * (cos - m_y * onehot(y))``.

    [Cao+19]; [Gar23] Table 4.1, which swaps its citation (docs/papers.md, erratum T-E3).

    The margin is subtracted from the true-class cosine before scaling, so it is in cosine
    units and ``scale`` acts as an inverse temperature. Plain LDAM: no class weights and no
    DRW re-weighting (docs/papers.md, erratum T-E16). Expects cosine scores (``NormedLinear``;
    docs/papers.md, note T-N4).
    """

    samplewise = True

    head = "normed"

    def __init__(
        self,
        max_margin: float = 0.5,
        scale: float = 30.0,
        class_counts: Any = None,
        num_classes: int | None = None,
        reduction: str = "mean",
    ):
        super().__init__(reduction)
        self.scale = check_float("scale", scale, 0.0, strict=True)
        self._init_margins(class_counts, max_margin, num_classes)

    def forward(self, output: Any, targets: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        scores = working_dtype(score_tensor(output, "ldam"))
        targets = check_targets(targets, scores, "ldam")
        margin = self._target_margins(scores, targets)
        shifted = scores - F.one_hot(targets, scores.shape[1]).to(scores.dtype) * margin.unsqueeze(1)
        return self.reduce(F.cross_entropy(self.scale * shifted, targets, reduction="none"))


# --------------------------------------------------------------------------------------
# Hinge-type top-K losses ([Gar23] Table 4.1, eqs. 4.4, 4.5)
# --------------------------------------------------------------------------------------


def kth_largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """Exact k-th largest entry of each row of a (B, L) tensor (gradient: one-hot at its index)."""
    _, index = select_kth_largest(values.detach(), k)
    return values.gather(-1, index.unsqueeze(-1)).squeeze(-1)


def scores_of_targets(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return scores.gather(1, targets.unsqueeze(1)).squeeze(1)


class _TopKLoss(SetValuedLoss):
    """Shared constructor of the losses parameterised by k (1 <= k <= L - 1)."""

    #: why k must be below the number of classes, for the error message
    k_reason = "the (k+1)-th largest score must exist"

    def _init_k(self, k: int, num_classes: int | None) -> None:
        self.k = check_int("k", k, 1)
        if num_classes is not None:
            num_classes = check_int("num_classes", num_classes, 2)
            check_k_for_classes(self.k, num_classes, self.registry_name, self.k_reason)

    def _scores_and_targets(self, output: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = working_dtype(score_tensor(output, self.registry_name))
        targets = check_targets(targets, scores, self.registry_name)
        check_k_for_classes(self.k, scores.shape[1], self.registry_name, self.k_reason)
        return scores, targets


@register_loss("hinge_topk")
class HingeTopK(_TopKLoss):
    """Top-K hinge ``(1 + (s without y)_[k] - s_y)_+`` ([LHS15]; [Gar23] eq. 4.4)."""

    samplewise = True

    k_reason = "the k-th largest of the L - 1 non-target scores must exist"

    def __init__(self, k: int = 5, num_classes: int | None = None, reduction: str = "mean"):
        super().__init__(reduction)
        self._init_k(k, num_classes)

    def forward(self, output: Any, targets: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        scores, targets = self._scores_and_targets(output, targets)
        is_target = F.one_hot(targets, scores.shape[1]).bool()
        others = scores.masked_fill(is_target, float("-inf"))
        return self.reduce(F.relu(1.0 + kth_largest(others, self.k) - scores_of_targets(scores, targets)))


@register_loss("cvx_hinge_topk")
class ConvexHingeTopK(_TopKLoss):
    """Convex top-K hinge ``((1/k) sum_{j<=k} (1 - onehot(y) + s)_[j] - s_y)_+``.

    [Gar23] Table 4.1 (the "top-K SVM^alpha" of [LHS15] with margin 1).
    """

    samplewise = True

    k_reason = "top-K with K = L is trivially correct"

    def __init__(self, k: int = 5, num_classes: int | None = None, reduction: str = "mean"):
        super().__init__(reduction)
        self._init_k(k, num_classes)

    def forward(self, output: Any, targets: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        scores, targets = self._scores_and_targets(output, targets)
        shifted = scores + 1.0 - F.one_hot(targets, scores.shape[1]).to(scores.dtype)
        top_mean = torch.topk(shifted, self.k, dim=1).values.mean(dim=1)
        return self.reduce(F.relu(top_mean - scores_of_targets(scores, targets)))


@register_loss("calibrated_hinge_topk")
class CalibratedHingeTopK(_TopKLoss):
    """Top-K calibrated hinge ``(1 + s_[k+1] - s_y)_+`` ([YK20]; thesis eq. 4.5).

    The (k+1)-th largest is taken over the full score vector, s_y included (docs/papers.md,
    note T-N2).
    """

    samplewise = True

    def __init__(self, k: int = 5, num_classes: int | None = None, reduction: str = "mean"):
        super().__init__(reduction)
        self._init_k(k, num_classes)

    def forward(self, output: Any, targets: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        scores, targets = self._scores_and_targets(output, targets)
        return self.reduce(F.relu(1.0 + kth_largest(scores, self.k + 1) - scores_of_targets(scores, targets)))


# --------------------------------------------------------------------------------------
# The noised top-K losses (thesis eq. 4.10 and 4.13)
# --------------------------------------------------------------------------------------


def _noised_member_losses(
    loss: NoisedTopK | NoisedTopKImbalanced,
    output: Any,
    targets: torch.Tensor,
    indices: torch.Tensor | None,
    draws: Sequence[Any],
    margin_of: Callable[[torch.Tensor, torch.Tensor], Any],
) -> torch.Tensor:
    """``member_losses`` of the noised top-K losses: where the draw is one ``randn(B, M, L)``
    per call whatever the scores (:func:`draws_every_class`), each member draws it under its own
    random state, exactly as its separate trial's call would, and one ``_NoisedHinge`` serves
    the N x B examples; elsewhere (the pruned CPU path, whose draw's shape depends on the scores
    of the batch) one call per member."""
    if (
        loss.reduction != "mean"
        or not fusion_declared(type(loss), "member_losses")
        or not isinstance(output, torch.Tensor)
        or output.dim() != 3
        or not draws_every_class(output, loss.k + 1, loss.epsilon, loss.n_samples, loss.exact)
    ):
        return loop_member_losses([loss] * len(draws), output, targets, indices, draws)
    members, batch, num_classes = output.shape
    scores, flat_targets = loss._scores_and_targets(output.flatten(0, 1), targets.flatten(0, 1))
    noise = None
    if loss.epsilon != 0.0:
        shape = (batch, loss.n_samples, num_classes)
        parts = []
        for draw in draws:  # a failed member (None) draws nothing: its rows get zeros
            if draw is None:
                parts.append(scores.new_zeros(shape))
                continue
            with draw:
                parts.append(torch.randn(shape, dtype=scores.dtype, device=scores.device))
        noise = torch.stack(parts).view(members * batch, loss.n_samples, num_classes)
    margin, scale = margin_of(scores, flat_targets)
    values = _NoisedHinge.apply(
        scores, flat_targets, margin, loss.k + 1, loss.epsilon, loss.n_samples, scale, noise, True
    )
    return values.view(members, batch).mean(dim=1)


@register_loss("noised_topk")
class NoisedTopK(_TopKLoss):
    """Balanced noised top-K hinge ``(1 + tau_hat_{k+1,eps,M}(s) - s_y)_+`` (thesis eq. 4.10).

    The (k+1)-th largest of the full score vector (s_y included; docs/papers.md, note T-N2) is
    smoothed by :func:`smooth_kth_largest`; s_y in the hinge is not perturbed. One fresh draw
    of M noise vectors per example and per call serves the value, the hinge test and the
    gradient (docs/papers.md, note T-N1). ``epsilon = 0`` gives ``calibrated_hinge_topk``. Raw
    logits. Defaults: ``n_samples=5`` as pytopk's ``n_sample``; ``epsilon=1.0`` as pytopk's
    standalone smoothed top-K module and its command line (its loss classes have no epsilon
    default; docs/papers.md, note T-N5).

    ``exact`` (default False): with False, noise is drawn only for the classes whose score is
    within ``eps * w`` of a lower bound of ``s_[k+1]`` (w about 14 for L = 1000; the classes
    further below reach the top k+1 with probability at most 1e-9 per example, by the
    Gaussian tail and a union bound over classes and draws: :func:`_pruning_window`), so the
    loss and its gradient equal the exact ones in expectation up to that probability, at a
    cost that depends on how many classes are within reach rather than on L. True draws
    noise for every class, as the authors' code does; so does every call on a GPU or under
    ``torch.compile`` (:func:`~setvalued.losses.base.fixed_shapes`), without host sync.
    NaN in, NaN out: a NaN score makes its example's loss NaN (``topk`` ranks it first).
    """

    def __init__(
        self,
        k: int = 5,
        epsilon: float = 1.0,
        n_samples: int = 5,
        num_classes: int | None = None,
        reduction: str = "mean",
        exact: bool = False,
    ):
        super().__init__(reduction)
        self._init_k(k, num_classes)
        self.epsilon = check_float("epsilon", epsilon, 0.0)
        self.n_samples = check_int("n_samples", n_samples, 1)
        self.exact = check_bool("exact", exact)

    def per_sample(
        self, scores: torch.Tensor, targets: torch.Tensor, noise: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-example losses; ``noise`` (B, M, L) fixes the draw (for tests)."""
        scores, targets = self._scores_and_targets(scores, targets)
        if noise is not None:
            noise = check_noise(noise, scores.shape[:1], self.n_samples, scores)
        return _NoisedHinge.apply(
            scores, targets, 1.0, self.k + 1, self.epsilon, self.n_samples, 1.0, noise, self.exact
        )

    def forward(self, output: Any, targets: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        return self.reduce(self.per_sample(output, targets))

    draws_torch_only = True

    def member_losses(
        self,
        output: Any,
        targets: torch.Tensor,
        indices: torch.Tensor | None,
        draws: Sequence[AbstractContextManager[Any] | None],
    ) -> torch.Tensor:
        return _noised_member_losses(self, output, targets, indices, draws, lambda scores, targets: (1.0, 1.0))


@register_loss("noised_topk_imbalanced")
class NoisedTopKImbalanced(_TopKLoss, _MarginLoss):
    """Imbalanced noised top-K hinge ``scale * (m_y + tau_hat_{k+1,eps,M}(s) - s_y)_+``.

    Thesis eq. 4.13 with LDAM margins (:func:`ldam_margins`). Scores are cosines
    (``NormedLinear``); margins and epsilon are in cosine units and ``scale`` multiplies the
    whole hinge, as in the authors' code (docs/papers.md, erratum T-E9), so it is a pure loss
    multiplier. Defaults: pytopk's ``scale=50``, ``n_sample=5`` (docs/papers.md, erratum T-E10,
    note T-N5).
    ``exact``: as for :class:`NoisedTopK`.
    """

    head = "normed"

    def __init__(
        self,
        k: int = 5,
        epsilon: float = 0.01,
        n_samples: int = 5,
        max_margin: float = 0.2,
        scale: float = 50.0,
        class_counts: Any = None,
        num_classes: int | None = None,
        reduction: str = "mean",
        exact: bool = False,
    ):
        SetValuedLoss.__init__(self, reduction)
        self._init_k(k, num_classes)
        self.epsilon = check_float("epsilon", epsilon, 0.0)
        self.n_samples = check_int("n_samples", n_samples, 1)
        self.exact = check_bool("exact", exact)
        self.scale = check_float("scale", scale, 0.0, strict=True)
        self._init_margins(class_counts, max_margin, num_classes)

    def per_sample(
        self, scores: torch.Tensor, targets: torch.Tensor, noise: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-example losses; ``noise`` (B, M, L) fixes the draw (for tests)."""
        scores, targets = self._scores_and_targets(scores, targets)
        margin = self._target_margins(scores, targets)
        if noise is not None:
            noise = check_noise(noise, scores.shape[:1], self.n_samples, scores)
        return _NoisedHinge.apply(
            scores, targets, margin, self.k + 1, self.epsilon, self.n_samples, self.scale, noise, self.exact
        )

    def forward(self, output: Any, targets: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        return self.reduce(self.per_sample(output, targets))

    draws_torch_only = True

    def member_losses(
        self,
        output: Any,
        targets: torch.Tensor,
        indices: torch.Tensor | None,
        draws: Sequence[AbstractContextManager[Any] | None],
    ) -> torch.Tensor:
        return _noised_member_losses(
            self,
            output,
            targets,
            indices,
            draws,
            lambda scores, targets: (self._target_margins(scores, targets), self.scale),
        )
