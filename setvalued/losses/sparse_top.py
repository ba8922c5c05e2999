"""sparse-top, the Euclidean projection onto the top-K simplex, and its multi-label loss
([Gar23] section 6.2).

Registered name: ``sparse_top``.

Notation: ``s`` the (B, L) scores, ``K`` the target sum of a row, the top-K (capped) simplex
``Delta_K = {q in [0, 1]^L : sum_j q_j = K}`` ([Gar23] ch. 1 notation; Delta_1 is the simplex).

- :func:`sparse_top` -- ``sparse-top(K, s) = argmin_{q in Delta_K} ||s - q||^2`` ([Gar23]
  eq. 6.13), which is ``q_j = max(0, min(1, s_j - lambda_K(s)))`` (eq. 6.14) with the threshold
  ``lambda_K(s)`` fixed by ``sum_j q_j = K`` (eq. 6.15). K = 1 is sparsemax ([Gar23] eqs.
  6.6-6.8). The thesis writes ``lambda_K : R^L -> [0, 1]``; the threshold is any real number
  (e.g. -0.216667 for s = (0.9, 0.2, 0.1, -0.4, 0.05), K = 2), so no range is assumed here.
  Its backward is the Jacobian of eq. 6.21, ``J = Diag(m) - m m^T / |M|`` with ``m`` the
  indicator of ``M_K(s) = {j : 0 < q_j < 1}`` (eq. 6.18): ``J g = m * (g - mean_M(g))``, O(L).
- :func:`sparse_top_threshold` -- ``lambda_K(s)``, exactly, by sorting the 2L breakpoints of the
  piecewise-linear ``f(lambda) = sum_j clip(s_j - lambda, 0, 1)`` (O(L log L)); the thesis only
  names the breakpoint-search family (section 6.2.3). :func:`sparse_top_threshold_bisect` finds
  the same value by bisection (vectorised, fixed iteration count) followed by the same exact
  last step; the tests check that both agree.
- :class:`SparseTopLoss` -- ``l(s, Y)`` of eq. 6.25 with gradient ``sparse-top(|Y|, s) - 1_Y``
  (eq. 6.24), computed in the equivalent closed form ``<s, p> - 1/2 ||p||^2 - <s, y> + |Y|/2``
  with ``p = sparse-top(|Y|, s)`` and ``y = 1_Y`` (the Fenchel-Young loss of
  ``1/2 ||q||^2`` restricted to Delta_|Y|; docs/papers.md, note SP-N1). Single-label targets
  (class indices) are |Y| = 1: the sparsemax loss of eq. 6.12.

The thesis has no experiments with sparse-top (section 6.2.7); at test time the metrics rank
the raw scores, as for every other loss (``prediction_scores``).
"""

from __future__ import annotations

from typing import Any

import torch

from setvalued.losses.base import SetValuedLoss, TwoHeadOutput, fixed_shapes, one_hot, register_loss

__all__ = [
    "sparse_top",
    "sparse_top_threshold",
    "sparse_top_threshold_bisect",
    "sparse_top_jacobian",
    "sparsemax",
    "sparse_top_loss",
    "SparseTopLoss",
]

#: bisection steps of :func:`sparse_top_threshold_bisect`: the bracket [min s - 1, max s] shrinks
#: by 2^-64, below float64 resolution for any bracket of a realistic width
BISECTION_STEPS = 64


# --------------------------------------------------------------------------------------
# input handling
# --------------------------------------------------------------------------------------


def _as_scores(scores: torch.Tensor, name: str = "sparse_top") -> tuple[torch.Tensor, torch.Size]:
    """``scores`` as a floating (B, L) tensor (a 1-D vector is one row), and the original shape.

    Half precision is upcast to float32: the threshold is a difference of sums of scores."""
    if not isinstance(scores, torch.Tensor):
        scores = torch.as_tensor(scores)
    shape = scores.shape
    if scores.dim() == 1:
        scores = scores[None, :]
    if scores.dim() != 2 or scores.shape[-1] == 0:
        raise ValueError(f"{name}: scores must have shape (classes,) or (batch, classes), got {tuple(shape)}")
    if not scores.is_floating_point():
        scores = scores.to(torch.get_default_dtype())
    elif scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    return scores, shape


def _as_k(k: Any, scores: torch.Tensor, name: str = "sparse_top") -> torch.Tensor:
    """K as a (B,) tensor of the scores' dtype, checked to lie in [0, L]."""
    batch, num_classes = scores.shape
    k_tensor = torch.as_tensor(k, dtype=scores.dtype, device=scores.device)
    if k_tensor.dim() == 0:
        k_tensor = k_tensor.expand(batch)
    if k_tensor.shape != (batch,):
        raise ValueError(
            f"{name}: k must be a number or one value per row ({batch},), got shape {tuple(k_tensor.shape)}"
        )
    if not fixed_shapes(k_tensor) and bool(((k_tensor < 0) | (k_tensor > num_classes) | torch.isnan(k_tensor)).any()):
        raise ValueError(f"{name}: k must lie in [0, {num_classes}] (the number of classes), got {k!r}")
    return k_tensor


# --------------------------------------------------------------------------------------
# the threshold lambda_K(s) of [Gar23] eq. 6.15
# --------------------------------------------------------------------------------------


def _refine(scores: torch.Tensor, k: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Exact threshold from a bracket [low, high] (B,) holding it with no breakpoint inside.

    On such an interval ``f`` is linear: ``f(lambda) = |H| + sum_M (s_j - lambda)`` with
    ``H = {s_j - 1 >= high}`` (q_j = 1) and ``M`` the entries strictly between (0 < q_j < 1), so
    ``lambda = (sum_M s_j + |H| - K) / |M|``. With ``|M| = 0`` f is flat, every point of the
    bracket is a threshold and the projection is the same 0/1 vector: the midpoint is returned.
    """
    upper = scores - 1
    in_h = upper >= high[:, None]
    in_l = scores <= low[:, None]
    in_m = ~(in_h | in_l)
    size_m = in_m.sum(dim=1)
    total_m = torch.where(in_m, scores, torch.zeros((), dtype=scores.dtype, device=scores.device)).sum(dim=1)
    exact = (total_m + in_h.sum(dim=1).to(scores.dtype) - k) / size_m.clamp(min=1).to(scores.dtype)
    return torch.where(size_m > 0, exact, 0.5 * (low + high))


def sparse_top_threshold(scores: torch.Tensor, k: Any) -> torch.Tensor:
    """The threshold ``lambda_K(s)`` of [Gar23] eqs. 6.14-6.15, per row, exactly (sort based).

    ``f(lambda) = sum_j clip(s_j - lambda, 0, 1)`` is continuous, non-increasing and linear
    between its 2L breakpoints ``{s_j} u {s_j - 1}``, with ``f(min s - 1) = L`` and
    ``f(max s) = 0``. The breakpoints are sorted, f is evaluated at each of them with prefix sums
    of the sorted scores (no O(L^2) pass), the last breakpoint with ``f >= K`` and the next one
    bracket the threshold, and :func:`_refine` solves the linear piece between them.

    ``scores``: (B, L) or (L,); ``k``: a number or (B,) values in [0, L] (real K allowed).
    Returns (B,) (or a 0-d tensor for a 1-D input), without gradient.
    """
    flat, shape = _as_scores(scores)
    with torch.no_grad():
        flat = flat.detach()
        k_rows = _as_k(k, flat)
        num_classes = flat.shape[1]
        ascending = torch.sort(flat, dim=1).values
        upper_ascending = ascending - 1  # the same values as s_j - 1, in the same order
        breakpoints = torch.sort(torch.cat([flat, flat - 1], dim=1), dim=1).values  # (B, 2L)
        # prefix sums of the scores in decreasing order: top[c] = sum of the c largest (the
        # leading 0 a pad, which a compiled graph reads in place, where a concatenation with a
        # column of zeros costs a kernel of its own)
        top = torch.nn.functional.pad(torch.flip(ascending, dims=[1]).cumsum(dim=1), (1, 0))
        # at lambda = b: c = #{s_j > b} entries are positive, a = #{s_j - 1 >= b} of them are 1
        c = num_classes - torch.searchsorted(ascending, breakpoints, right=True)
        a = num_classes - torch.searchsorted(upper_ascending, breakpoints, right=False)
        a = torch.minimum(a, c)
        middle = top.gather(1, c) - top.gather(1, a)
        f = a.to(flat.dtype) + middle - (c - a).to(flat.dtype) * breakpoints
        # f is non-increasing: the entries >= K form a prefix (up to rounding, hence the count)
        last = ((f >= k_rows[:, None]).sum(dim=1) - 1).clamp(0, 2 * num_classes - 2)
        low = breakpoints.gather(1, last[:, None])[:, 0]
        high = breakpoints.gather(1, last[:, None] + 1)[:, 0]
        threshold = _refine(flat, k_rows, low, high)
    return threshold.reshape(shape[:-1])


def sparse_top_threshold_bisect(scores: torch.Tensor, k: Any, steps: int = BISECTION_STEPS) -> torch.Tensor:
    """The same threshold as :func:`sparse_top_threshold`, by bisection on
    ``lambda in [min s - 1, max s]`` (``steps`` halvings, vectorised over rows, no sort) and the
    same exact last step on the final bracket. Linear time per step; for the GPU, and as an
    independent check of the sort-based search."""
    flat, shape = _as_scores(scores)
    with torch.no_grad():
        flat = flat.detach()
        k_rows = _as_k(k, flat)
        low = flat.min(dim=1).values - 1
        high = flat.max(dim=1).values
        for _ in range(int(steps)):
            middle = 0.5 * (low + high)
            enough = (flat - middle[:, None]).clamp(0, 1).sum(dim=1) >= k_rows
            low = torch.where(enough, middle, low)
            high = torch.where(enough, high, middle)
        # the bracket may still hold a breakpoint (when lambda sits on one, up to rounding):
        # refine from the midpoint's pieces, which is exact up to rounding in either case
        middle = 0.5 * (low + high)
        threshold = _refine(flat, k_rows, middle, middle)
    return threshold.reshape(shape[:-1])


# --------------------------------------------------------------------------------------
# the projection and its Jacobian-vector product ([Gar23] eqs. 6.13-6.21)
# --------------------------------------------------------------------------------------


def _project(scores: torch.Tensor, k: torch.Tensor, method: str) -> torch.Tensor:
    if method == "sort":
        threshold = sparse_top_threshold(scores, k)
    elif method == "bisect":
        threshold = sparse_top_threshold_bisect(scores, k)
    else:
        raise ValueError(f"sparse_top: method must be 'sort' or 'bisect', got {method!r}")
    return (scores - threshold[:, None]).clamp(0, 1)


class _SparseTop(torch.autograd.Function):
    """q = sparse-top(K, s); backward ``J g = m * (g - mean_M(g))`` ([Gar23] eqs. 6.18, 6.21)."""

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, k: torch.Tensor, method: str) -> torch.Tensor:
        projection = _project(scores, k, method)
        ctx.save_for_backward(projection)
        return projection

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (projection,) = ctx.saved_tensors
        return _jvp(projection, grad_output), None, None


def _jvp(projection: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    """``J v`` with J of eq. 6.21 at the point whose projection is ``projection``; J is
    symmetric, so this is also the vector-Jacobian product. Rows with M empty get 0."""
    mask = ((projection > 0) & (projection < 1)).to(vector.dtype)
    size = mask.sum(dim=1, keepdim=True)
    mean = (mask * vector).sum(dim=1, keepdim=True) / size.clamp(min=1)
    return mask * (vector - mean)


def sparse_top(scores: torch.Tensor, k: Any, method: str = "sort") -> torch.Tensor:
    """``sparse-top(K, s)``, the Euclidean projection of each row onto the top-K simplex
    ([Gar23] eqs. 6.13-6.15), differentiable (backward of eq. 6.21).

    ``scores``: (B, L) or (L,); ``k``: a number or (B,) values in [0, L] (an integer in the
    thesis; any real K is a valid capped simplex); ``method``: "sort" (exact breakpoint search)
    or "bisect" (bisection plus the same exact step). Returns a tensor of the scores' shape
    (float32 for half-precision input). No gradient flows to ``k``.
    """
    flat, shape = _as_scores(scores)
    k_rows = _as_k(k, flat)
    return _SparseTop.apply(flat, k_rows, method).reshape(shape)


def sparsemax(scores: torch.Tensor) -> torch.Tensor:
    """sparsemax ([Gar23] eqs. 6.6-6.8; [MA16]): sparse-top with K = 1."""
    return sparse_top(scores, 1)


def sparse_top_jacobian(scores: torch.Tensor, k: Any) -> torch.Tensor:
    """The closed-form Jacobian ``Diag(m) - m m^T / |M|`` of [Gar23] eq. 6.21, (B, L, L) (zero
    for a row with M empty). For tests and analysis; training uses the O(L) product."""
    flat, shape = _as_scores(scores)
    projection = _project(flat.detach(), _as_k(k, flat), "sort")
    mask = ((projection > 0) & (projection < 1)).to(flat.dtype)
    size = mask.sum(dim=1).clamp(min=1)[:, None, None]
    jacobian = torch.diag_embed(mask) - mask[:, :, None] * mask[:, None, :] / size
    return jacobian.reshape(*shape[:-1], shape[-1], shape[-1])


# --------------------------------------------------------------------------------------
# the loss ([Gar23] eqs. 6.24-6.25)
# --------------------------------------------------------------------------------------


def _label_matrix(targets: torch.Tensor, scores: torch.Tensor, name: str) -> torch.Tensor:
    """Targets as a 0/1 matrix of the scores' dtype: class indices (B,) -> one-hot (|Y| = 1),
    a multi-hot (B, L) tensor (bool or 0/1 numbers) as it is."""
    batch, num_classes = scores.shape
    if not isinstance(targets, torch.Tensor):
        targets = torch.as_tensor(targets)
    targets = targets.to(scores.device)
    if targets.dim() == 1:
        if targets.shape[0] != batch:
            raise ValueError(
                f"{name}: targets must be class indices ({batch},) or a multi-hot matrix "
                f"{tuple(scores.shape)}, got {tuple(targets.shape)}"
            )
        if targets.is_floating_point() or targets.dtype == torch.bool:
            raise ValueError(f"{name}: 1-D targets must be integer class indices, got dtype {targets.dtype}")
        # value checks read back on the host: eager CPU only (base.fixed_shapes)
        if batch and not fixed_shapes(targets) and (int(targets.min()) < 0 or int(targets.max()) >= num_classes):
            raise ValueError(f"{name}: class indices must lie in [0, {num_classes - 1}]")
        return one_hot(targets, num_classes, scores.dtype)  # a label out of range fails, compiled too
    if targets.shape != scores.shape:
        raise ValueError(
            f"{name}: targets must be class indices ({batch},) or a multi-hot matrix "
            f"{tuple(scores.shape)}, got {tuple(targets.shape)}"
        )
    labels = targets.to(scores.dtype)
    if not fixed_shapes(labels) and bool(((labels != 0) & (labels != 1)).any()):
        raise ValueError(f"{name}: a multi-hot target matrix must hold only 0 and 1")
    return labels


def sparse_top_loss(scores: torch.Tensor, targets: torch.Tensor, method: str = "sort") -> torch.Tensor:
    """Per-example ``l_sparse-top(s, Y)`` ([Gar23] eq. 6.25), (B,).

    Computed as ``<s, p> - 1/2 ||p||^2 - <s, y> + |Y|/2`` with ``p = sparse-top(|Y|, s)`` taken
    without gradient: the value equals eq. 6.25 and, p being the maximiser of
    ``<s, q> - 1/2 ||q||^2`` over Delta_|Y| (Danskin), the gradient is exactly ``p - y``
    (eq. 6.24); docs/papers.md, note SP-N1. The loss is convex, >= 0, and 0 iff p = y
    (Proposition 6.2.1). Second-order autograd through it sees p as a constant (the Hessian of
    eq. 6.26 is not produced).

    ``targets``: class indices (B,) (then |Y| = 1 and this is the sparsemax loss, eq. 6.12) or a
    multi-hot (B, L) matrix; a row with no label has p = 0 and loss 0.
    """
    flat, _ = _as_scores(scores, "sparse_top loss")
    if flat.dim() != 2 or scores.dim() != 2:
        raise ValueError(f"sparse_top loss expects scores of shape (batch, classes), got {tuple(scores.shape)}")
    labels = _label_matrix(targets, flat, "sparse_top loss")
    sizes = labels.sum(dim=1)
    with torch.no_grad():
        projection = _project(flat.detach(), sizes, method)
    return (flat * (projection - labels)).sum(dim=1) - 0.5 * (projection * projection).sum(dim=1) + 0.5 * sizes


@register_loss("sparse_top")
class SparseTopLoss(SetValuedLoss):
    """The multi-label sparse-top loss of [Gar23] eqs. 6.24-6.25 (section 6.2.5); with
    single-label targets (class indices) it is the sparsemax loss (eq. 6.12, |Y| = 1).

    ``loss(scores, targets)``: scores (B, L) logits; targets class indices (B,) or a multi-hot
    (B, L) matrix (the projection of each row uses its own K = |Y|). Computed in float32 at least.
    """

    def __init__(self, reduction: str = "mean"):
        super().__init__(reduction)

    def forward(self, output: Any, targets: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(output, TwoHeadOutput):
            raise ValueError("sparse_top expects a (batch, classes) score tensor, got a two-head output")
        if not isinstance(output, torch.Tensor) or output.dim() != 2:
            shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
            raise ValueError(f"sparse_top expects scores of shape (batch, classes), got {shape}")
        return self.reduce(sparse_top_loss(output, targets))
