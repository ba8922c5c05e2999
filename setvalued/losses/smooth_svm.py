"""Smooth top-k SVM loss of Berrada, Zisserman & Kumar (ICLR 2018), registered as ``smooth_topk_svm``.

Formulas: [BZK18] §3-4 and App. A-B; choices and errata: docs/papers.md (S-E*, note S-N1).

The loss ([BZK18] eq. 9) is a temperature-smoothed max over k-subsets of labels. With
``x = s / (k tau)`` and ``e = exp(x without y)`` it reads ([BZK18] eq. 10)

    L = tau * log[exp(x_y) sigma_{k-1}(e) + exp(alpha/tau) sigma_k(e)] - tau * log[exp(x_y) sigma_{k-1}(e)]
      = tau * softplus(alpha/tau + log sigma_k(e) - log sigma_{k-1}(e) - x_y),

where ``sigma_j`` is the j-th elementary symmetric polynomial.

How ``log sigma_{k-1}`` and ``log sigma_k`` of the L - 1 non-target classes are computed
(:func:`_log_sigma_top_and_body`), in float64 whatever the input dtype:

- the k + 1 largest ``x`` ("top") are kept in log space, where their gaps may be huge
  (``x = s / (k tau)`` reaches 1e6 for logits of 1e3 at tau = 1e-3): ``log sigma_0..k`` of
  the top by the log-space divide and conquer of [BZK18] Algorithm 1 (:func:`log_elementary_symmetric`);
- every other class ("body") is at most ``m = min(top)``, so ``y = exp(x - m)`` lies in
  [0, 1] and ``sigma_0..k(y)`` is computed in linear space with positive terms only: one
  summation recursion ([BZK18] Algorithm 3) over the classes, run on many chunks of classes
  at once, then the chunks' polynomials multiplied pairwise (Algorithm 1 in linear space).
  A body coefficient too small for float64 is one whose every term is below 1e-300 of a term
  built from top classes, so its loss is harmless;
- ``sigma_j(all) = sum_i sigma_i(top) sigma_{j-i}(body)``, one log-sum-exp per j.

The backward of the body is closed form: ``d log sigma_j / d x_i = y_i sigma_{j-1}(y without
i) / sigma_j(y)`` ([BZK18] eq. 15-16), with ``sigma_{j-1}(y without i)`` from the recursion
of [BZK18] eq. 17-18, ``D_j = sigma_j - y_i D_{j-1}``. That recursion is unstable when y_i
dominates (their Observation 1), but not here: y_i <= 1 does not amplify rounding errors, and
each error is weighed by a term of ``sigma(all)`` that a top class bounds, so the absolute
error of a gradient entry stays within about k^3 float64 epsilons.
The top part and the final combination use autograd; the backward is written with
differentiable operations, so second derivatives work too.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from setvalued.losses.base import SetValuedLoss, register_loss
from setvalued.losses.topk import kth_largest, scores_of_targets
from setvalued.losses.topk_operator import check_float, check_int, check_k_for_classes, check_targets, score_tensor

__all__ = ["SmoothTopKSVM", "log_elementary_symmetric", "hard_topk_svm", "LOG_ZERO"]

#: Finite stand-in for log(0). With -inf, a log-sum-exp whose inputs are all -inf has a NaN
#: gradient (docs/papers.md, note S-N1); -1e30 is far below any log-space value the loss can
#: reach (|x| <= 1e3 / 1e-3 = 1e6 per class) and several of them still sum without overflow in
#: float32.
LOG_ZERO = -1e30

#: Gap ``s_[k] - s_[k+1] >= k tau log(HARD_SWITCH_RATIO)`` sends a sample to the hard loss
#: when the optional switch of the reference code is on (docs/papers.md, erratum S-E9c).
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

    Divide and conquer over ``prod_i (1 + exp(x_i) X)`` ([BZK18] §4.2, Algorithm 1, written
    without its 1/e_i inversion; docs/papers.md, note S-N1): the leaves are ``[log 1, x_i]``;
    each level multiplies neighbours pairwise (in parallel), keeping degrees <= k. A level
    whose polynomials have degree d costs (d+1)^2 per product, so the total is O(k n) (Prop. 5
    of [BZK18], App. B.1). Entries equal to ``LOG_ZERO`` act as exp(x_i) = 0. Requires k <= n.
    """
    n = x.shape[-1]
    k = check_int("k", k, 0, n, why=f"sigma_k of {n} values")
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


#: Body coefficients below this are treated as 0 (float64 underflow, see the module doc).
_TINY = 1e-300


def _chunks_for(k: int) -> int:
    """How many chunks of classes the body recursion runs side by side.

    More chunks: fewer sequential steps (L / chunks) but more products of degree-k
    polynomials to merge them (chunks k^2 work). Tuned on CPU, L in {100, 1000}, batch 128.
    """
    if k <= 12:
        return 32
    if k <= 28:
        return 16
    return 8


def _poly_product(left: torch.Tensor, right: torch.Tensor, degree: int) -> torch.Tensor:
    """Coefficients 0..degree of the products of polynomials (..., R) x (..., R), linear space."""
    size = left.shape[-1]
    out_len = min(2 * size - 1, degree + 1)
    if size <= 8:  # one skewed table (see _log_poly_product), summed down its columns
        table = left.unsqueeze(-1) * right.unsqueeze(-2)
        flat = F.pad(table, (0, size)).flatten(-2)[..., : size * (2 * size - 1)]
        return flat.unflatten(-1, (size, 2 * size - 1))[..., :out_len].sum(dim=-2)
    out = left.new_zeros(left.shape[:-1] + (out_len,))
    for a in range(min(size, out_len)):
        width = min(size, out_len - a)
        out[..., a : a + width].addcmul_(left[..., a : a + 1], right[..., :width])
    return out


def elementary_symmetric_unit(y: torch.Tensor, k: int) -> torch.Tensor:
    """``sigma_0..k(y)`` along the last axis of a (B, n) tensor of values in [0, 1], linear space.

    The summation recursion ``sigma_j <- sigma_j + y_i sigma_{j-1}`` ([BZK18] Algorithm 3)
    runs over ceil(n / C) classes on C chunks at once, then the C chunk polynomials are
    multiplied pairwise. Every term is a product of values in [0, 1], so nothing overflows
    (sigma_j <= C(n, j)) or cancels. No gradient.
    """
    batch, n = y.shape
    chunks = max(1, min(_chunks_for(k), n))
    steps = -(-n // chunks)
    columns = F.pad(y, (0, steps * chunks - n)).view(batch, steps, chunks).transpose(1, 2).contiguous()
    sigma = y.new_zeros(batch, chunks, k + 1)
    sigma[..., 0] = 1.0
    for step in range(steps):
        top = min(step + 1, k)
        sigma[..., 1 : top + 1] += columns[:, :, step : step + 1] * sigma[..., :top]
    while sigma.shape[1] > 1:
        if sigma.shape[1] % 2:
            one = sigma.new_zeros(batch, 1, k + 1)
            one[..., 0] = 1.0
            sigma = torch.cat([sigma, one], dim=1)
        sigma = _poly_product(sigma[:, 0::2], sigma[:, 1::2], k)
    return sigma[:, 0]


class _BodyLogSigma(torch.autograd.Function):
    """``log sigma_j`` (j = 0..k) of the classes with ``x_i <= m``, with a closed-form backward.

    Input: x (B, n) float64 (excluded classes at LOG_ZERO), m (B, 1) with every kept
    ``x_i <= m``. Output (B, k + 1): ``log sigma_j(exp(x)) = log sigma_j(y) + j m``, y = exp(x - m).
    """

    @staticmethod
    def forward(ctx: Any, x: Any, shift: Any, k: Any) -> torch.Tensor:
        with torch.no_grad():
            sigma = elementary_symmetric_unit(torch.exp(x - shift), k)
            degrees = torch.arange(k + 1, dtype=x.dtype, device=x.device)
            kept = sigma > _TINY
            out = torch.log(sigma.clamp_min(_TINY)) + degrees * shift
        ctx.save_for_backward(x, shift, out, kept)
        ctx.k = k
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, shift, out, kept = ctx.saved_tensors
        k = ctx.k
        degrees = torch.arange(k + 1, dtype=x.dtype, device=x.device)
        y = torch.exp(x - shift)
        sigma = torch.exp(out - degrees * shift)
        # d out_j / d x_i = y_i D_{j-1}(i) / sigma_j, D_j(i) = sigma_j(y without i); where
        # sigma_j underflowed (clamped: a constant output), y_i D_{j-1}(i) <= sigma_j vanishes too.
        weight = torch.where(kept, grad_out / sigma, torch.zeros_like(grad_out))
        leave_one_out = torch.ones_like(y)  # D_0
        total = weight[:, 1:2].expand_as(y)
        for j in range(1, k):
            leave_one_out = sigma[:, j : j + 1] - y * leave_one_out  # D_j ([BZK18] eq. 17-18)
            total = total + weight[:, j + 1 : j + 2] * leave_one_out
        return y * total, None, None


def _log_sigma_top_and_body(x: torch.Tensor, k: int) -> torch.Tensor:
    """``log sigma_{k-1}`` and ``log sigma_k`` of exp(x) along the rows, shape (B, 2).

    ``x``: (B, L) float64, excluded entries at LOG_ZERO, at least k of them kept. The k + 1
    largest in log space, the rest in linear space (module doc).
    """
    num_top = min(k + 1, x.shape[1] - 1)
    top, where = torch.topk(x, num_top, dim=1)
    log_top = log_elementary_symmetric(top, k)  # (B, k + 1)
    if num_top < k + 1:  # nothing left for the body (k = L - 1)
        return log_top[:, k - 1 :]
    body = _BodyLogSigma.apply(x.scatter(1, where, LOG_ZERO), top[:, -1:].detach(), k)
    log_k = torch.logsumexp(log_top + body.flip(-1), dim=1)
    log_k_minus_1 = torch.logsumexp(log_top[:, :k] + body[:, :k].flip(-1), dim=1)
    return torch.stack([log_k_minus_1, log_k], dim=1)


def hard_topk_svm(scores: torch.Tensor, targets: torch.Tensor, k: int, alpha: float) -> torch.Tensor:
    """Non-smooth top-k SVM of [BZK18] eq. 8 (the tau -> 0 limit), per sample.

    ``max(alpha + ((s without y)_[k] - s_y) / k, 0)``: the max over k-subsets of
    ``alpha 1(y not in A) + mean_A s`` minus the max over the subsets containing y ([BZK18]
    eqs. 7-8, App. A.1).
    """
    is_target = F.one_hot(targets, scores.shape[1]).bool()
    kth_other = kth_largest(scores.masked_fill(is_target, float("-inf")), k)
    return F.relu(alpha + (kth_other - scores_of_targets(scores, targets)) / k)


#: ``F.softplus(z)`` returns z itself above its threshold: above 40, ``log1p(exp(-z))`` is below
#: the float64 rounding of z, so nothing is lost (the default 20 drops up to 2e-9).
_FLOAT64_SOFTPLUS_THRESHOLD = 40.0


@register_loss("smooth_topk_svm")
class SmoothTopKSVM(SetValuedLoss):
    """Smooth top-k SVM ``L_{k,tau}`` with margin alpha ([BZK18] eq. 9/10, §3.3).

    Args:
        k: the top-k being optimised, 1 <= k <= L - 1.
        tau: temperature >= 0 (1.0 on CIFAR-100, 0.1 on ImageNet/Pl@ntNet in the papers);
            0 is the non-smooth loss ``l_k`` of eq. 8 (:func:`hard_topk_svm`), the first row of
            [BZK18] Table 6.
        alpha: margin >= 0 (1 in the papers; k=1, tau=1, alpha=0 is cross-entropy).
        hard_switch: per sample, use the hard loss (:func:`hard_topk_svm`) when
            ``s_[k] - s_[k+1] >= k tau log(1000)``, as the reference code does
            (docs/papers.md, erratum S-E9c).
            Off by default: the log-space computation here is stable without it, and the
            switch makes the loss discontinuous.

    Computed in float32 at least (float64 stays float64), also under AMP (docs/papers.md,
    note S-N1).
    """

    samplewise = True

    def __init__(
        self,
        k: int = 5,
        tau: float = 1.0,
        alpha: float = 1.0,
        hard_switch: bool = False,
        num_classes: int | None = None,
        reduction: str = "mean",
    ):
        super().__init__(reduction)
        self.k = check_int("k", k, 1)
        self.tau = check_float("tau", tau, 0.0)
        self.alpha = check_float("alpha", alpha, 0.0)
        if not isinstance(hard_switch, bool):
            raise ValueError(f"hard_switch must be true or false, got {hard_switch!r}")
        self.hard_switch = hard_switch
        if num_classes is not None:
            num_classes = check_int("num_classes", num_classes, 2)
            check_k_for_classes(self.k, num_classes, "smooth_topk_svm", _K_REASON)

    def per_sample(self, scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        scores = score_tensor(scores, "smooth_topk_svm")
        targets = check_targets(targets, scores, "smooth_topk_svm")
        check_k_for_classes(self.k, scores.shape[1], "smooth_topk_svm", _K_REASON)
        if scores.dtype != torch.float64:
            scores = scores.float()
        k, tau = self.k, self.tau
        if tau == 0.0:
            return hard_topk_svm(scores, targets, k, self.alpha)
        if k == 1:
            is_target = F.one_hot(targets, scores.shape[1]).bool()
            # Closed form of L_{1,tau} = tau logsumexp_j((u_j - s_y) / tau), u = s + alpha 1[j != y]
            # ([BZK18] eq. 9 with k = 1; docs/papers.md, note S-N1), written as
            # (u_max - s_y) + tau logsumexp((u - u_max) / tau) with u - u_max formed from exact
            # score differences: the weights that matter are then not rounded at the magnitude
            # of |s| / tau.
            bump = self.alpha * (~is_target).to(scores.dtype)
            top = (scores + bump).detach().argmax(dim=1, keepdim=True)
            top_score, top_bump = scores.gather(1, top), bump.gather(1, top)
            relative = ((scores - top_score) + (bump - top_bump)) / tau
            smooth = (
                (top_score + top_bump).squeeze(1)
                - scores_of_targets(scores, targets)
                + tau * torch.logsumexp(relative, dim=1)
            )
        else:
            # The loss is invariant to adding a constant to every score (log sigma_j moves by
            # j c, x_y by c); centring on the row max keeps x <= 0.
            wide = scores.double()
            x = (wide - wide.detach().amax(dim=1, keepdim=True)) / (k * tau)
            x_target = scores_of_targets(x, targets)
            log_sigma = _log_sigma_top_and_body(x.scatter(1, targets.unsqueeze(1), LOG_ZERO), k)
            # softplus's default threshold (20) returns z above it and drops log1p(exp(-z)) ~ 2e-9:
            # float64 needs 40 (exp(-40) / 40 is below its epsilon)
            smooth = (
                tau
                * F.softplus(
                    self.alpha / tau + log_sigma[:, 1] - log_sigma[:, 0] - x_target,
                    threshold=_FLOAT64_SOFTPLUS_THRESHOLD,
                )
            ).to(scores.dtype)
        if not self.hard_switch:
            return smooth
        top = torch.topk(scores.detach(), k + 1, dim=1).values
        use_hard = (top[:, k - 1] - top[:, k]) >= k * tau * math.log(HARD_SWITCH_RATIO)
        return torch.where(use_hard, hard_topk_svm(scores, targets, k, self.alpha), smooth)

    def forward(self, output: Any, targets: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        return self.reduce(self.per_sample(output, targets))
