"""Smooth top-k SVM loss of Berrada, Zisserman & Kumar (ICLR 2018), registered as ``smooth_topk_svm``.

Formulas: ``spec/smooth-topk-svm.md`` (cited as "digest"), sections 1-3 and 8.

The loss ([BZK18] eq. 9) is a temperature-smoothed max over k-subsets of labels. With
``x = s / (k tau)`` and ``e = exp(x without y)`` it reads ([BZK18] eq. 10)

    L = tau * log[exp(x_y) sigma_{k-1}(e) + exp(alpha/tau) sigma_k(e)] - tau * log[exp(x_y) sigma_{k-1}(e)]
      = tau * softplus(alpha/tau + log sigma_k(e) - log sigma_{k-1}(e) - x_y),

where ``sigma_j`` is the j-th elementary symmetric polynomial. ``log sigma_0..k`` are computed
in log space by divide and conquer on the polynomial ``prod_i (1 + e_i X)`` truncated at
degree k ([BZK18] Algorithm 1 written directly, without the ``1/e_i`` inversion; digest
2.2 and 8): O(k n) work, ceil(log2 n) levels. Every operation is a sum or a log-sum-exp,
so plain autograd is numerically stable (its local derivatives are softmax weights; nothing
is subtracted), and the custom backward of [BZK18] Algorithm 2, with its instability
(Observation 1), is not needed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from setvalued.losses.base import SetValuedLoss, register_loss
from setvalued.losses.topk import (
    _check_float,
    _check_int,
    _check_k_for_classes,
    _check_targets,
    _kth_largest,
    _score_tensor,
    _target_scores,
)

__all__ = ["SmoothTopKSVM", "log_elementary_symmetric", "hard_topk_svm", "LOG_ZERO"]

#: Finite stand-in for log(0). With -inf, a log-sum-exp whose inputs are all -inf has a NaN
#: gradient (digest section 8); -1e30 is far below any log-space value the loss can reach
#: (|x| <= 1e3 / 1e-3 = 1e6 per class) and several of them still sum without overflow in float32.
LOG_ZERO = -1e30

#: Gap ``s_[k] - s_[k+1] >= k tau log(HARD_SWITCH_RATIO)`` sends a sample to the hard loss
#: when the optional switch of the reference code is on (digest section 3).
HARD_SWITCH_RATIO = 1e3

_K_REASON = "the k-subsets without the target need k <= L - 1"


def _log_poly_product(left: torch.Tensor, right: torch.Tensor, degree: int) -> torch.Tensor:
    """Coefficients 0..degree of the product of two polynomials, all in log space.

    ``left``, ``right``: (..., R) log-coefficients. Entry c of the result is
    ``logsumexp_{i + j = c} left_i + right_j``. The (R, R) table of sums is skewed (each
    row padded by R log-zeros and re-read with row length 2R - 1) so that column c of the
    skewed view holds the anti-diagonal i + j = c; a log-sum-exp down the columns then
    gives the convolution without any gather/scatter.
    """
    size = left.shape[-1]
    table = left.unsqueeze(-1) + right.unsqueeze(-2)  # [..., i, j] -> degree i + j
    padded = F.pad(table, (0, size), value=LOG_ZERO)  # (..., R, 2R)
    flat = padded.flatten(-2)[..., : size * (2 * size - 1)]
    skewed = flat.unflatten(-1, (size, 2 * size - 1))  # [..., i, c] = table[..., i, c - i]
    return torch.logsumexp(skewed[..., : degree + 1], dim=-2)


def log_elementary_symmetric(x: torch.Tensor, k: int) -> torch.Tensor:
    """``log sigma_j(exp(x))`` for j = 0..k along the last axis, shape (..., k + 1).

    Divide and conquer over ``prod_i (1 + exp(x_i) X)`` ([BZK18] Algorithm 1, digest 2.2):
    the leaves are ``[log 1, x_i]``; each level multiplies neighbours pairwise (in parallel),
    keeping degrees <= k. A level whose polynomials have degree d costs (d+1)^2 per
    product, so the total is O(k n) (Prop. 5 of [BZK18]). Entries equal to ``LOG_ZERO``
    act as exp(x_i) = 0. Requires k <= n.
    """
    n = x.shape[-1]
    k = _check_int("k", k, 0, n, why=f"sigma_k of {n} values")
    lead = x.shape[:-1]
    if k == 0:
        return torch.zeros(lead + (1,), dtype=x.dtype, device=x.device)
    polys = torch.stack([torch.zeros_like(x), x], dim=-1)  # (..., n, 2): leaves 1 + e_i X
    degree = 1  # the tracked degree reaches min(k, n) = k once everything is merged
    while polys.shape[-2] > 1:
        if polys.shape[-2] % 2:
            one = torch.full(lead + (1, degree + 1), LOG_ZERO, dtype=x.dtype, device=x.device)
            one[..., 0] = 0.0  # the polynomial 1
            polys = torch.cat([polys, one], dim=-2)
        new_degree = min(k, 2 * degree)
        polys = _log_poly_product(polys[..., 0::2, :], polys[..., 1::2, :], new_degree)
        degree = new_degree
    return polys[..., 0, :]


def hard_topk_svm(scores: torch.Tensor, targets: torch.Tensor, k: int, alpha: float) -> torch.Tensor:
    """Non-smooth top-k SVM of [BZK18] eq. 8 (the tau -> 0 limit), per sample.

    ``max(alpha + ((s without y)_[k] - s_y) / k, 0)``: the max over k-subsets of
    ``alpha 1(y not in A) + mean_A s`` minus the max over the subsets containing y (digest 1.2).
    """
    is_target = F.one_hot(targets, scores.shape[1]).bool()
    kth_other = _kth_largest(scores.masked_fill(is_target, float("-inf")), k)
    return F.relu(alpha + (kth_other - _target_scores(scores, targets)) / k)


@register_loss("smooth_topk_svm")
class SmoothTopKSVM(SetValuedLoss):
    """Smooth top-k SVM ``L_{k,tau}`` with margin alpha ([BZK18] eq. 9/10, digest 1.3).

    Args:
        k: the top-k being optimised, 1 <= k <= L - 1.
        tau: temperature >= 0 (1.0 on CIFAR-100, 0.1 on ImageNet/Pl@ntNet in the papers);
            0 is the non-smooth loss ``l_k`` of eq. 8 (:func:`hard_topk_svm`), the first row of
            [BZK18] Table 6.
        alpha: margin >= 0 (1 in the papers; k=1, tau=1, alpha=0 is cross-entropy).
        hard_switch: per sample, use the hard loss (:func:`hard_topk_svm`) when
            ``s_[k] - s_[k+1] >= k tau log(1000)``, as the reference code does (digest 3).
            Off by default: the log-space computation here is stable without it, and the
            switch makes the loss discontinuous.

    Computed in float32 at least (float64 stays float64), also under AMP (digest 8).
    """

    def __init__(self, k: int = 5, tau: float = 1.0, alpha: float = 1.0, hard_switch: bool = False,
                 num_classes: int | None = None, reduction: str = "mean"):
        super().__init__(reduction)
        self.k = _check_int("k", k, 1)
        self.tau = _check_float("tau", tau, 0.0)
        self.alpha = _check_float("alpha", alpha, 0.0)
        if not isinstance(hard_switch, bool):
            raise ValueError(f"hard_switch must be true or false, got {hard_switch!r}")
        self.hard_switch = hard_switch
        if num_classes is not None:
            num_classes = _check_int("num_classes", num_classes, 2)
            _check_k_for_classes(self.k, num_classes, "smooth_topk_svm", _K_REASON)

    def per_sample(self, scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        scores = _score_tensor(scores, "smooth_topk_svm")
        targets = _check_targets(targets, scores, "smooth_topk_svm")
        _check_k_for_classes(self.k, scores.shape[1], "smooth_topk_svm", _K_REASON)
        if scores.dtype != torch.float64:
            scores = scores.float()
        k, tau = self.k, self.tau
        if tau == 0.0:
            return hard_topk_svm(scores, targets, k, self.alpha)
        is_target = F.one_hot(targets, scores.shape[1]).bool()
        if k == 1:
            # Closed form of L_{1,tau} = tau logsumexp_j((u_j - s_y) / tau), u = s + alpha 1[j != y]
            # (digest 1.3), written as (u_max - s_y) + tau logsumexp((u - u_max) / tau) with
            # u - u_max formed from exact score differences: the weights that matter are then
            # not rounded at the magnitude of |s| / tau.
            bump = self.alpha * (~is_target).to(scores.dtype)
            top = (scores + bump).detach().argmax(dim=1, keepdim=True)
            top_score, top_bump = scores.gather(1, top), bump.gather(1, top)
            relative = ((scores - top_score) + (bump - top_bump)) / tau
            smooth = (top_score + top_bump).squeeze(1) - _target_scores(scores, targets) \
                + tau * torch.logsumexp(relative, dim=1)
        else:
            # The loss is invariant to adding a constant to every score (log sigma_j moves by
            # j c, x_y by c); centring on the row max keeps the coefficients that matter near 0,
            # where float32 is precise, instead of near k |s| / (k tau) (up to 1e6 here).
            x = (scores - scores.detach().amax(dim=1, keepdim=True)) / (k * tau)
            x_target = _target_scores(x, targets)
            log_sigma = log_elementary_symmetric(x.masked_fill(is_target, LOG_ZERO), k)
            smooth = tau * F.softplus(self.alpha / tau + log_sigma[:, k] - log_sigma[:, k - 1] - x_target)
        if not self.hard_switch:
            return smooth
        top = torch.topk(scores.detach(), k + 1, dim=1).values
        use_hard = (top[:, k - 1] - top[:, k]) >= k * tau * math.log(HARD_SWITCH_RATIO)
        return torch.where(use_hard, hard_topk_svm(scores, targets, k, self.alpha), smooth)

    def forward(self, output, targets, indices=None):
        return self.reduce(self.per_sample(output, targets))
