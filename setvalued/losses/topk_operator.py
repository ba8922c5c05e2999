"""The top-K operator under the losses of `setvalued.losses.topk`: parameter checks, the
exact k-th largest value (selection), and the Monte-Carlo perturbed k-th largest value with
its candidate pruning (thesis section 4.3; docs/papers.md, note T-N1), `smooth_kth_largest`.
"""

from __future__ import annotations

import functools
import math
import operator
import statistics
from typing import Any

import torch
import torch.nn.functional as F

from setvalued.losses.base import TwoHeadOutput, fixed_shapes

# --------------------------------------------------------------------------------------
# Parameter checks: every bad value raises a ValueError that names the parameter and the
# allowed range (docs/interfaces.md, section 2).
# --------------------------------------------------------------------------------------


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None, why: str = "") -> int:
    """``value`` as an int in [minimum, maximum]; ValueError naming ``name`` otherwise.

    Integral floats (5.0, as a YAML or sampler may give) are accepted; 5.5 and booleans are not.
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        as_int = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if as_int < minimum or (maximum is not None and as_int > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        reason = f" ({why})" if why else ""
        raise ValueError(f"{name} must be an integer {allowed}{reason}, got {as_int}")
    return as_int


def check_float(name: str, value: Any, minimum: float | None = None, *, strict: bool = False) -> float:
    """``value`` as a finite float, >= minimum (> minimum when ``strict``)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {value!r}") from None
    if not math.isfinite(as_float):
        raise ValueError(f"{name} must be finite, got {as_float}")
    if minimum is not None:
        if strict and not as_float > minimum:
            raise ValueError(f"{name} must be > {minimum}, got {as_float}")
        if not strict and not as_float >= minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {as_float}")
    return as_float


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def check_k_for_classes(k: int, num_classes: int, loss_name: str, reason: str) -> None:
    """The top-K losses need 1 <= k <= L - 1; ``reason`` says why for this loss."""
    if k > num_classes - 1:
        raise ValueError(
            f"{loss_name}: k must be in [1, {num_classes - 1}] for {num_classes} classes ({reason}), got k={k}"
        )


def score_tensor(output: Any, loss_name: str) -> torch.Tensor:
    """The (B, L) score tensor of a single-head model output."""
    if isinstance(output, TwoHeadOutput):
        raise ValueError(f"{loss_name} expects a (batch, classes) score tensor, got a two-head output")
    if not isinstance(output, torch.Tensor) or output.dim() != 2:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ValueError(f"{loss_name} expects scores of shape (batch, classes), got {shape}")
    return output


def check_targets(targets: torch.Tensor, scores: torch.Tensor, loss_name: str) -> torch.Tensor:
    if targets.dim() != 1 or targets.shape[0] != scores.shape[0]:
        raise ValueError(
            f"{loss_name}: targets must have shape ({scores.shape[0]},) to match the scores, got {tuple(targets.shape)}"
        )
    return targets.long()


def working_dtype(scores: torch.Tensor) -> torch.Tensor:
    """Half-precision scores are upcast: eps-sized noise and margins need float32.

    docs/papers.md, note T-N3.
    """
    if scores.dtype in (torch.float16, torch.bfloat16):
        return scores.float()
    return scores


# --------------------------------------------------------------------------------------
# The perturbed k-th largest value (thesis section 4.3; docs/papers.md, note T-N1)
# --------------------------------------------------------------------------------------


def _heap_selection_pays(k: int, length: int) -> bool:
    """Whether padding rows of ``length`` entries with -inf to 64k makes the k-th largest cheaper.

    ``torch.topk`` on CPU keeps a heap of k entries when 64k <= the row length (about 2.5 + 0.1k
    ns per entry, measured with torch 2.14 on perturbed scores) and runs an ``nth_element``
    over (value, index) pairs otherwise (about 9.5 ns per entry, whatever k): below 64k entries,
    a row padded to 64k is cheaper when ``64k (2.5 + 0.1k) < 9.5 length`` (e.g. k = 2 from
    37 entries on, k = 21 from 650 on; never for k >= 40 at L <= 1000).
    """
    padded = 64 * k
    return length < padded and padded * (25 + k) < 95 * length


#: :func:`select_kth_largest` with ``overwrite``: on rows shorter than 64k (where ``torch.topk``
#: on CPU runs an ``nth_element``), k passes of ``max`` (each setting the maximum found to -inf)
#: beat ``topk`` for k up to 4, and for k up to 6 on rows of at least 10k entries (torch 2.14,
#: 384 rows: k = 2 of 42 entries 67 against 175 us, k = 4 of 200 375 against 745 us, k = 6 of
#: 90 319 against 388 us, but k = 6 of 30 166 against 152 us; k = 8 no longer wins).
_REPEATED_MAX_K = 6


def _repeated_max_pays(k: int, length: int) -> bool:
    """Whether k passes of ``max`` select the k-th largest of rows of ``length`` faster than
    ``torch.topk`` on CPU (``_REPEATED_MAX_K``)."""
    return 64 * k > length and (k <= 4 or (k <= _REPEATED_MAX_K and length >= 10 * k))


def select_kth_largest(values: torch.Tensor, k: int, overwrite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Value and index of the k-th largest entry along the last axis (no gradient).

    ``topk(sorted=False)`` followed by a min over the k survivors. On CPU (torch 2.14,
    perturbed scores, L in {100, 1000}) this measured as fast as ``kthvalue`` or faster, and
    3-10x faster when 64k <= the row length, where PyTorch keeps a heap of k entries instead
    of an ``nth_element`` over the row; rows a little shorter than that are padded with -inf
    to 64k (:func:`_heap_selection_pays`). On GPU both are one radix-select pass (no padding).
    (A tournament over chunks of 64 entries, each a cheap selection, measured slower.)
    With ``overwrite`` (``values`` is the caller's scratch tensor), small k on rows shorter
    than 64k (:func:`_repeated_max_pays`) takes k passes of ``max`` instead, setting each
    maximum found to -inf: among tied entries each pass removes one, so the k-th pass returns
    the k-th largest value.
    NaN: ``topk`` ranks a NaN above every number, so a row holding one gets the value NaN
    (rows where the repeated ``max`` passes met a NaN, an inf or fewer than k entries above
    -inf are handed to ``topk``). :func:`~setvalued.losses.base.fixed_shapes` tensors take the
    plain ``topk`` (no value read back on the host).
    """
    length = values.shape[-1]
    if fixed_shapes(values):
        overwrite = False
    elif overwrite and _repeated_max_pays(k, length):
        removed = []
        for _ in range(k - 1):
            largest, where = values.max(dim=-1, keepdim=True)
            removed.append((where, largest))
            values.scatter_(-1, where, -math.inf)
        kth_values, kth_positions = values.max(dim=-1)
        # the sum of the k-th and first maxima is finite unless a k-th is -inf (fewer than k
        # entries above -inf), an entry is +inf, or a first maximum is a NaN (which torch.max
        # returns, and the k-th pass would not see again): then topk handles them (also if the
        # sum overflows). One sum read back, as many operations as a test for -inf.
        check = kth_values if k == 1 else kth_values + removed[0][1].squeeze(-1)
        if math.isfinite(float(check.sum())):
            return kth_values, kth_positions
        for where, largest in reversed(removed):  # put them back and let topk select
            values.scatter_(-1, where, largest)
    if not fixed_shapes(values) and values.is_floating_point() and _heap_selection_pays(k, length):
        padded = F.pad(values, (0, 64 * k - length), value=-math.inf)
        top_values, top_positions = torch.topk(padded, k, dim=-1, sorted=False)
        kth_values, where = top_values.min(dim=-1, keepdim=True)
        kth_positions = top_positions.gather(-1, where)
        if not bool((kth_positions >= length).any()):  # a padding entry only where the k-th is -inf
            return kth_values.squeeze(-1), kth_positions.squeeze(-1)
    top_values, top_positions = torch.topk(values, k, dim=-1, sorted=False)
    kth_values, where = top_values.min(dim=-1, keepdim=True)
    return kth_values.squeeze(-1), top_positions.gather(-1, where).squeeze(-1)


#: Largest probability, per example, that the pruned path of the noised losses gives a
#: different value or gradient than drawing noise for every class (see :func:`_pruning_window`).
PRUNING_FAILURE_PROBABILITY = 1e-9

#: The pruned path falls back to the exact one when its candidates would cover more than this
#: fraction of the classes of some row (the bookkeeping would then cost more than it saves).
_PRUNING_MAX_FRACTION = 0.5

#: ... and when M L is below this (the exact draw then costs less than the bookkeeping; the
#: ratios of benchmarks/losses.py at L = 100 and 1000).
_PRUNING_MIN_DRAWS = 500


@functools.lru_cache(maxsize=256)
def _pruning_window(k: int, num_classes: int, n_samples: int, failure: float = PRUNING_FAILURE_PROBABILITY) -> float:
    """Width ``a + b`` (in units of epsilon) of the band kept below a lower bound of ``s_[k]``.

    Let ``t <= s_[k]`` with k classes (the set A) scoring at least t, ``u = t - a eps`` and
    ``C = {j : s_j > u - b eps}``. For one draw Z, if every i in A has ``s_i + eps Z_i > u``
    and every j outside C has ``s_j + eps Z_j < u``, the k largest entries of ``s + eps Z``
    all lie in C, so the k-th largest of the candidates' perturbed scores is the k-th largest
    of the whole vector, with the same index. By the union bound over the k anchors, the
    (at most L) classes outside C and the M draws of an example, the probability that this
    fails is at most ``M (k Q(a) + L Q(b))``, Q the standard normal tail. ``a`` and ``b``
    minimise ``a + b`` under ``M (k Q(a) + L Q(b)) <= failure`` (a grid over how the failure
    budget is split between the two terms).
    """
    normal = statistics.NormalDist()
    best = math.inf
    for step in range(1, 200):
        share = step / 200
        a = -normal.inv_cdf(share * failure / (n_samples * k))
        b = -normal.inv_cdf((1 - share) * failure / (n_samples * num_classes))
        best = min(best, a + b)
    return best


def _group_members(num_classes: int, k: int) -> int:
    """P, the classes per group for the lower bound of ``s_[k]`` (the rows are read as a
    P x L/P grid without a copy): the largest divisor of L in [2, 16] that leaves at least 64k
    groups, where one exists (then the k-th largest of the group maxima is a heap selection,
    whose cost hardly grows with k: ``torch.topk`` on CPU takes it when 64k <= the row
    length), otherwise the largest that leaves at least 2k groups, or 1 (no grouping)."""
    divisors = [p for p in range(2, 17) if num_classes % p == 0]
    heap = [p for p in divisors if num_classes // p >= 64 * k]
    return max(heap or [p for p in divisors if num_classes // p >= 2 * k], default=1)


#: Below this share of groups reaching the cut, the classes are compacted group by group
#: (only the groups that reach it are read class by class), above it over all classes.
_GROUP_COMPACTION_SHARE = 0.3


def _compact(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column positions (B, W) of the True entries of each row of ``keep`` (B, N), in order,
    padded with N to the longest row W, and the padding mask (B, W).

    A running count gives each kept entry its column (1-based; the others are sent to column
    0, which is dropped) and one scatter writes the positions: ``nonzero`` and indexed writes
    cost several times more on CPU. The count runs in int32 (half the memory traffic of the
    default int64 over B x N).
    """
    batch, columns = keep.shape
    slot = keep.cumsum(dim=1, dtype=torch.int32)
    width = int(slot[:, -1].max()) if columns else 0
    slot.mul_(keep)
    every_column = torch.arange(columns, device=keep.device).expand(batch, -1)
    positions = torch.full((batch, width + 1), columns, dtype=torch.long, device=keep.device)
    positions = positions.scatter_(1, slot.long(), every_column)[:, 1:]
    return positions, positions == columns


def _gather_kept(
    values: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor, padding_label: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries of ``values`` and ``labels`` (B, N) where ``keep`` holds, compacted to (B, W)
    in order, padded with score -inf and label ``padding_label``: the running count of
    :func:`_compact` sends each kept entry to its column and both are scattered there directly
    (for small N: fewer operations than listing positions and gathering)."""
    batch = keep.shape[0]
    slot = keep.cumsum(dim=1, dtype=torch.int32)
    width = int(slot[:, -1].max()) if keep.shape[1] else 0
    slot = slot.mul_(keep).long()
    kept_values = torch.full((batch, width + 1), -math.inf, dtype=values.dtype, device=values.device)
    kept_labels = torch.full((batch, width + 1), padding_label, dtype=labels.dtype, device=labels.device)
    return kept_values.scatter_(1, slot, values)[:, 1:], kept_labels.scatter_(1, slot, labels)[:, 1:]


def _may_prune(k: int, num_classes: int, n_samples: int) -> bool:
    """Whether :func:`_pruned_candidates` may prune at all: not when k > L / 8 (the candidates
    would be a large share of few classes) nor when M L < 500 (the draw is cheap)."""
    return 8 * k <= num_classes and n_samples * num_classes >= _PRUNING_MIN_DRAWS


def draws_every_class(scores: torch.Tensor, k: int, epsilon: float, n_samples: int, exact: bool) -> bool:
    """Whether :func:`perturbed_kth_largest` on ``scores`` (B, L) draws its noise as one
    ``randn(B, M, L)`` (or none, at epsilon 0), a shape that does not depend on the scores'
    values: with ``exact``, off the CPU or under ``torch.compile``
    (:func:`~setvalued.losses.base.fixed_shapes`), or where pruning cannot apply. A fused array
    then draws each member's noise under its own random state and computes the rest at once."""
    return epsilon == 0.0 or exact or fixed_shapes(scores) or not _may_prune(k, scores.shape[-1], n_samples)


def _pruned_candidates(
    flat: torch.Tensor, k: int, epsilon: float, n_samples: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Scores (B, R) and class indices (B, R) of the classes that can reach the top k.

    A class is kept when its score is at least ``t - eps w``, with ``t`` the k-th largest of the
    group maxima (a lower bound of ``s_[k]``: the k best groups each hold a class scoring at
    least t) and ``w`` from :func:`_pruning_window`, so the k-th largest of ``s + eps Z``
    over the kept classes equals the one over all classes except with probability at most
    ``PRUNING_FAILURE_PROBABILITY`` per example. Rows are padded to the longest one with
    score -inf and class index L. Returns None (use the exact path) when pruning would keep
    more than half of the classes of some row, when most rows have no class below the cut,
    when a score is NaN or infinite, when k > L / 8, or when M L < 500.

    Work: one max over groups of P classes (a strided view, no copy) and a selection of the
    k-th largest of the L/P group maxima; then, when few groups reach the cut, those groups
    are compacted (:func:`_compact` over the B x L/P group maxima) and only their P members
    are compared with the cut and compacted again; otherwise all classes are compared with
    the cut and compacted at once (no ``nonzero`` and no indexed writes over B x L).
    """
    batch, num_classes = flat.shape
    if not _may_prune(k, num_classes, n_samples):
        return None
    reach = epsilon * _pruning_window(k, num_classes, n_samples)
    low = flat.amin(dim=1)  # (torch.aminmax is ten times slower than amin and amax on CPU)
    spread = flat.amax(dim=1).sub_(low)  # NaN on a row holding a NaN (amax and amin propagate it)
    # per row 1 where the cut (at most the row's max minus the reach) is below every class, else
    # 0, and NaN where a score is NaN (or inf): one read back for both tests
    narrow = float(torch.where(spread <= reach, 1.0, spread * 0.0).sum())
    if not narrow * 2 <= batch:
        return None  # nothing to prune on most rows (scores that spread little compared to
        # eps); or a NaN or inf score: left to the exact path, whose topk ranks a NaN first
    members = _group_members(num_classes, k)
    groups = num_classes // members
    grid = flat.reshape(batch, members, groups)  # class = member * groups + group
    group_max = grid.amax(dim=1) if members > 1 else flat
    if k == 1:
        cut = group_max.amax(dim=1, keepdim=True)
    else:
        cut = torch.topk(group_max, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    # Non-strict comparisons: where eps * w is below half an ulp of t, ``t - eps w`` rounds
    # back onto t, and ``> cut`` would drop the classes scoring exactly t (then fewer than k
    # candidates: "selected index k out of range").
    cut.sub_(reach)
    reaching = group_max >= cut
    if members > 1 and int(reaching.sum()) < _GROUP_COMPACTION_SHARE * reaching.numel():
        # few groups reach the cut (so every row has classes below it): list those groups,
        # then the members of each that score above the cut
        group_index, padding = _compact(reaching)  # (B, Wg), padded with `groups`
        group_index.masked_fill_(padding, 0)
        member_offset = torch.arange(0, num_classes, groups, device=flat.device)
        classes = (group_index.unsqueeze(1) + member_offset.view(1, -1, 1)).view(batch, -1)
        scores = flat.gather(1, classes)
        keep = (scores >= cut).view(batch, members, -1).logical_and_(~padding.unsqueeze(1))
        scores, classes = _gather_kept(scores, classes, keep.view(batch, -1), num_classes)
        if scores.shape[1] > _PRUNING_MAX_FRACTION * num_classes:
            return None
        return scores, classes
    if int((cut.squeeze(1) <= low).sum()) * 2 > batch:
        return None  # most rows have no class below the cut: nothing to prune there
    positions, padding = _compact(flat >= cut)  # most groups reach it: all classes at once
    if positions.shape[1] > _PRUNING_MAX_FRACTION * num_classes:
        return None
    positions.masked_fill_(padding, 0)
    return (flat.gather(1, positions).masked_fill_(padding, -math.inf), positions.masked_fill_(padding, num_classes))


def perturbed_kth_largest(
    flat: torch.Tensor, k: int, epsilon: float, n_samples: int, noise: torch.Tensor | None, exact: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Monte-Carlo value (B,) and selected class indices (B, M) of the k-th largest of s + eps Z.

    ``flat``: (B, L) scores; ``noise``: None (fresh ``torch.randn`` draw) or (B, M, L).
    ``exact=False`` draws noise only for the classes that can reach the top k
    (:func:`_pruned_candidates`); with a given ``noise`` it uses those classes' entries of
    it, so both paths agree draw by draw except with probability at most
    ``PRUNING_FAILURE_PROBABILITY`` per example. On a GPU and under ``torch.compile``
    (:func:`~setvalued.losses.base.fixed_shapes`) it draws noise for every class, as
    ``exact=True`` does: no host synchronisation and no shape that depends on the scores. No
    gradient: the callers' backward scatters to the returned indices.
    """
    with torch.no_grad():
        flat = flat.detach()
        if epsilon == 0.0:
            # No perturbation: every copy is s itself; one copy gives the same value and
            # gradient (the exact s_[k] and its one-hot), without drawing noise.
            values, indices = select_kth_largest(flat.unsqueeze(1), k)
            return values.mean(dim=-1), indices
        fixed = exact or fixed_shapes(flat)  # every class drawn: no shape depends on the data
        pruned = None if fixed else _pruned_candidates(flat, k, epsilon, n_samples)
        if pruned is None:
            shifted, classes = flat, None
        else:
            shifted, classes = pruned
        # (s + eps Z)_[k] = eps * (s / eps + Z)_[k] for eps > 0: one pass over the
        # (B, M, R) tensor instead of two (the scale goes on the (B,) result).
        shifted = (shifted / epsilon if epsilon != 1.0 else shifted).unsqueeze(1)
        if noise is None:
            perturbed = torch.randn(flat.shape[0], n_samples, shifted.shape[-1], dtype=flat.dtype, device=flat.device)
        elif classes is None:
            perturbed = noise.clone()
        else:  # the padding (class index L, score -inf) reads any entry of the noise
            where = classes.clamp(max=flat.shape[1] - 1).unsqueeze(1).expand(-1, n_samples, -1)
            perturbed = noise.gather(2, where)
        perturbed.add_(shifted)
        values, indices = select_kth_largest(perturbed, k, overwrite=True)
        if classes is not None:
            indices = classes.gather(1, indices)
        smoothed = values.mean(dim=-1)
        if epsilon != 1.0:
            smoothed.mul_(epsilon)
    return smoothed, indices


def _scatter_mean_one_hot(weights: torch.Tensor, indices: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``weights[b] * (1/M) sum_m onehot(indices[b, m])`` as a (B, L) tensor (thesis eq. 4.12)."""
    grad = weights.new_zeros(indices.shape[0], num_classes)
    share = (weights / indices.shape[-1]).unsqueeze(-1).expand(indices.shape)
    return grad.scatter_add_(-1, indices, share)


class _PerturbedKthLargest(torch.autograd.Function):
    """Mean over M noisy copies of the k-th largest entry, with the pathwise gradient.

    The forward keeps only the (B, M) indices of the selected entries, not the (B, M, L)
    perturbed tensor, and the backward scatters ``grad / M`` to them (thesis eq. 4.12).
    """

    @staticmethod
    def forward(ctx: Any, flat: Any, k: Any, epsilon: Any, n_samples: Any, noise: Any, exact: Any) -> torch.Tensor:
        smoothed, indices = perturbed_kth_largest(flat, k, epsilon, n_samples, noise, exact)
        ctx.save_for_backward(indices)
        ctx.num_classes = flat.shape[-1]
        return smoothed

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (indices,) = ctx.saved_tensors
        return _scatter_mean_one_hot(grad_output, indices, ctx.num_classes), None, None, None, None, None


def check_noise(noise: torch.Tensor, lead_shape: tuple[int, ...], n_samples: int, like: torch.Tensor) -> torch.Tensor:
    num_classes = like.shape[-1]
    expected = tuple(lead_shape) + (n_samples, num_classes)
    if tuple(noise.shape) != expected:
        raise ValueError(f"noise must have shape {expected} (batch dims, n_samples, classes), got {tuple(noise.shape)}")
    return noise.to(device=like.device, dtype=like.dtype).reshape(-1, n_samples, num_classes)


def smooth_kth_largest(
    scores: torch.Tensor, k: int, epsilon: float, n_samples: int, noise: torch.Tensor | None = None, exact: bool = False
) -> torch.Tensor:
    """Smoothed k-th largest value of each row: ``(1/M) sum_m (s + eps Z_m)_[k]``.

    Thesis Def. 4.3.4 and eq. 4.11: with one draw ``Z_1..Z_M ~ N(0, I_L)`` shared by the two
    top-sum terms, ``topSum_{k} - topSum_{k-1}`` is the mean of the k-th largest entries of
    the noisy copies (docs/papers.md, note T-N1). Its gradient is the mean of the one-hot
    vectors at the selected entries (thesis eq. 4.12), computed from the same draw as the value.

    Args:
        scores: (..., L) scores; the operator acts on the last axis.
        k: which largest entry, 1 <= k <= L.
        epsilon: standard deviation of the Gaussian perturbation, >= 0 (0 gives s_[k]).
        n_samples: M, the number of noise draws, >= 1.
        noise: optional fixed standard-normal draws of shape ``(..., M, L)`` (row m is
            Z_m); ``None`` draws fresh ones with ``torch.randn`` at every call.
        exact: draw noise for every class. By default (False) noise is drawn only for the
            classes whose score is close enough to ``s_[k]`` to reach the top k: the result
            differs from the exact path's (on the same draw) with probability at most
            ``PRUNING_FAILURE_PROBABILITY`` = 1e-9 per row (Gaussian tail and union bound,
            :func:`_pruning_window`), so value and gradient are the same in expectation up to
            that probability. The pruned path draws fewer normals, so a fixed seed gives a
            different draw than the exact path unless nothing can be pruned. On a GPU and
            under ``torch.compile`` every class is drawn whatever ``exact`` says
            (:func:`~setvalued.losses.base.fixed_shapes`).

    Returns:
        (...,) tensor of smoothed values.
    """
    if not isinstance(scores, torch.Tensor) or scores.dim() < 1:
        raise ValueError("scores must be a tensor with the classes on its last axis")
    num_classes = scores.shape[-1]
    k = check_int("k", k, 1, num_classes, why=f"the k-th largest of {num_classes} scores")
    epsilon = check_float("epsilon", epsilon, 0.0)
    n_samples = check_int("n_samples", n_samples, 1)
    work = working_dtype(scores)
    lead_shape = work.shape[:-1]
    flat = work.reshape(-1, num_classes)
    if noise is not None:
        noise = check_noise(noise, lead_shape, n_samples, flat)
    exact = check_bool("exact", exact)
    return _PerturbedKthLargest.apply(flat, k, epsilon, n_samples, noise, exact).reshape(lead_shape)
