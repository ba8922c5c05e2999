"""Evaluation metrics of the papers: top-K and average-K accuracy, micro, macro and per shot group.

All functions take a score tensor ``scores`` of shape (n, L) and integer ``targets`` of shape (n,)
and are vectorized; they run on whatever device the tensors live on.

Top-K (thesis eq. 2.14): ``1[y_i in T_K(s(x_i))]``, the label is among the K largest scores.

Tie rule (deterministic, independent of the class order): the sources break ties "arbitrarily"
([Gar23] §4.3.1, footnote 1; [GSJS22] footnote 1). Here a tie is resolved **against** the true
class: ``y`` is in the top K iff fewer than K *other* classes have a score ``>= s_y``.  So a
constant score vector scores no hit for K < L (it cannot buy accuracy with ties), and the rule
gives the same answer as ``torch.topk`` whenever the scores have no ties.

Average-K (thesis eqs. 2.29-2.32, Algorithm 1, eqs. 5.16-5.17, S2 eq. 1): one global
threshold ``lambda`` calibrated on validation scores by the midpoint rule of the papers
(docs/papers.md, note A-N5), the set of an input is ``{j : s_j >= lambda}`` (ties at ``lambda``
are all included, as in the reference code; the set may be empty), accuracy is
``1[s_y >= lambda]`` and K_test is the mean set size.  The scores may be softmax or sigmoid
outputs of either head (docs/papers.md, erratum A-E4): use :func:`activate` and calibrate and
evaluate on the same scale.

Macro metrics average the per-class accuracy over the classes present in the evaluated split
(thesis section 3.3.1; docs/papers.md, note P-7); for average-K the threshold stays global.
Shot groups (Table 5.2 caption): few < 20 <= medium <= 100 < many training images per class.
Bins of classes by training images ([Gar23] Table 3.1, ``eval.count_bins``): ``low < n <= high``,
named as in ``setvalued.metrics.names.count_bins``; a bin's number is, like a shot group's, the
mean per-class accuracy over its classes present in the split.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from setvalued.metrics.names import count_bins as count_bin_bounds

#: Default shot-group limits: few < 20 <= medium <= 100 < many training images.
DEFAULT_SHOT_THRESHOLDS = (20, 100)
SHOT_GROUPS = ("few", "medium", "many")

__all__ = [
    "label_rank",
    "DEFAULT_SHOT_THRESHOLDS",
    "SHOT_GROUPS",
    "activate",
    "topk_hits",
    "topk_accuracy",
    "per_class_topk",
    "macro_topk_accuracy",
    "shot_groups",
    "group_macro_accuracy",
    "count_bin_groups",
    "calibrate_avgk_threshold",
    "calibrate_avgk_thresholds",
    "avgk_hits",
    "avgk_set_sizes",
    "avgk_sets",
    "avgk_accuracy",
    "avgk_set_size",
    "per_class_avgk",
    "macro_avgk_accuracy",
    "evaluate",
]


# --------------------------------------------------------------------------------------------
# input checks
# --------------------------------------------------------------------------------------------


def _check_scores(scores: torch.Tensor, name: str = "scores") -> torch.Tensor:
    if not isinstance(scores, torch.Tensor):
        scores = torch.as_tensor(scores)
    if scores.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor (examples, classes), got shape {tuple(scores.shape)}")
    if scores.shape[0] == 0 or scores.shape[1] == 0:
        raise ValueError(f"{name} must have at least one example and one class, got shape {tuple(scores.shape)}")
    if not scores.is_floating_point():
        scores = scores.to(torch.float32)
    if torch.isnan(scores).any():
        raise ValueError(f"{name} contain NaN")
    return scores


def _check_targets(targets: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    if not isinstance(targets, torch.Tensor):
        targets = torch.as_tensor(targets)
    if targets.dim() != 1 or targets.shape[0] != scores.shape[0]:
        raise ValueError(
            f"targets must be a 1-D tensor with one label per row of scores ({scores.shape[0]}), "
            f"got shape {tuple(targets.shape)}"
        )
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise ValueError(f"targets must hold integer class indices, got dtype {targets.dtype}")
    targets = targets.to(device=scores.device, dtype=torch.long)
    num_classes = scores.shape[1]
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= num_classes):
        raise ValueError(
            f"targets must lie in [0, {num_classes - 1}], got values in [{int(targets.min())}, {int(targets.max())}]"
        )
    return targets


def _check_k(k: int, num_classes: int) -> int:
    if isinstance(k, bool) or int(k) != k or not 1 <= int(k) <= num_classes:
        raise ValueError(f"k must be an integer in [1, {num_classes}] (number of classes), got {k!r}")
    return int(k)


def _check_num_classes(num_classes: int | None, scores: torch.Tensor) -> int:
    if num_classes is None:
        return scores.shape[1]
    if int(num_classes) != scores.shape[1]:
        raise ValueError(f"num_classes must equal the number of score columns ({scores.shape[1]}), got {num_classes}")
    return int(num_classes)


def _fmt_k(k: float) -> str:
    """Name of K in a metric path: 5 -> '5', 2.5 -> '2.5'."""
    return str(int(k)) if float(k).is_integer() else repr(float(k))


# --------------------------------------------------------------------------------------------
# scores
# --------------------------------------------------------------------------------------------


def activate(logits: torch.Tensor, activation: str | None) -> torch.Tensor:
    """Scores on which an average-K threshold is applied: softmax (thesis eqs. 5.16/5.17, the
    primary choice), sigmoid (for BCE-trained heads) or the raw scores (``None``/"none");
    docs/papers.md, erratum A-E4.  Softmax is taken in float64 so that small probabilities of
    a long tail do not collapse into ties."""
    if activation is None or activation == "none":
        return logits
    if activation == "softmax":
        return torch.softmax(logits.to(torch.float64), dim=1)
    if activation == "sigmoid":
        return torch.sigmoid(logits.to(torch.float64))
    raise ValueError(f"activation must be one of 'softmax', 'sigmoid', 'none', got {activation!r}")


# --------------------------------------------------------------------------------------------
# top-K
# --------------------------------------------------------------------------------------------


def label_rank(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Int64 (n,): 0-based rank of the label's score, ties counted against the label (the
    number of other classes scoring at least as high); the label is in the top K iff rank < K.

    No input checks (they cost a device sync): for the training loop; ``topk_hits`` checks.
    """
    true_score = scores.gather(1, targets[:, None])
    # classes (the label itself included) scoring at least as high as the label
    return (scores >= true_score).sum(dim=1) - 1


def topk_hits(scores: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """Bool (n,): is the label among the K largest scores (ties against the label, see module doc)."""
    scores = _check_scores(scores)
    targets = _check_targets(targets, scores)
    k = _check_k(k, scores.shape[1])
    return label_rank(scores, targets) < k


def topk_accuracy(scores: torch.Tensor, targets: torch.Tensor, k: int) -> float:
    """Micro top-K accuracy (thesis eq. 2.14)."""
    return float(topk_hits(scores, targets, k).double().mean())


def _per_class(hits: torch.Tensor, targets: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.bincount(targets, minlength=num_classes)
    per_hits = torch.zeros(num_classes, dtype=torch.long, device=targets.device)
    per_hits.index_add_(0, targets, hits.to(torch.long))
    return per_hits, counts


def per_class_topk(
    scores: torch.Tensor, targets: torch.Tensor, k: int, num_classes: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hits, counts) per class, both int64 of shape (L,): top-K hits and examples of each class."""
    scores = _check_scores(scores)
    targets = _check_targets(targets, scores)
    num_classes = _check_num_classes(num_classes, scores)
    return _per_class(topk_hits(scores, targets, k), targets, num_classes)


def _macro(hits: torch.Tensor, counts: torch.Tensor, mask: torch.Tensor | None = None) -> float | None:
    """Mean of hits/counts over the classes with counts > 0 (and in ``mask``); None if none."""
    present = counts > 0
    if mask is not None:
        present = present & mask.to(present.device)
    if not bool(present.any()):
        return None
    return float((hits[present].double() / counts[present].double()).mean())


def macro_topk_accuracy(
    scores: torch.Tensor, targets: torch.Tensor, k: int, num_classes: int | None = None
) -> float | None:
    """Per-class top-K recall averaged over the classes present in the split (thesis 3.3.1)."""
    hits, counts = per_class_topk(scores, targets, k, num_classes)
    return _macro(hits, counts)


# --------------------------------------------------------------------------------------------
# shot groups
# --------------------------------------------------------------------------------------------


def shot_groups(
    class_counts: Sequence[int] | torch.Tensor, thresholds: Sequence[int] = DEFAULT_SHOT_THRESHOLDS
) -> dict[str, torch.Tensor]:
    """Bool masks over classes: few ``< t0``, medium ``t0 <= n <= t1``, many ``> t1`` training
    images (captions of thesis Tables 4.5, 4.6, 5.2)."""
    counts = torch.as_tensor(class_counts)
    if counts.dim() != 1:
        raise ValueError(f"class_counts must be one training count per class, got shape {tuple(counts.shape)}")
    if counts.numel() and bool((counts < 0).any()):
        raise ValueError("class_counts must be non-negative training counts")
    thresholds = tuple(thresholds)
    if len(thresholds) != 2 or not thresholds[0] <= thresholds[1]:
        raise ValueError(
            f"shot_thresholds must be two numbers (few_below, many_above) with "
            f"few_below <= many_above, got {thresholds!r}"
        )
    low, high = thresholds
    return {"few": counts < low, "medium": (counts >= low) & (counts <= high), "many": counts > high}


def count_bin_groups(class_counts: Sequence[int] | torch.Tensor, edges: Sequence[int]) -> dict[str, torch.Tensor]:
    """Bool masks over classes, one per bin of ``edges`` (``count_0_10``: n <= 10,
    ``count_10_50``: 10 < n <= 50, ..., ``count_2000_inf``: n > 2000; [Gar23] Table 3.1)."""
    counts = torch.as_tensor(class_counts)
    if counts.dim() != 1:
        raise ValueError(f"class_counts must be one training count per class, got shape {tuple(counts.shape)}")
    edges = list(edges)
    if any(isinstance(e, bool) or int(e) != e or e < 1 for e in edges) or any(a >= b for a, b in zip(edges, edges[1:])):
        raise ValueError(f"count_bins must be strictly increasing positive integers, got {edges!r}")
    groups = {}
    for name, low, high in count_bin_bounds(edges):
        above = counts > low if low > 0 else counts >= 0
        groups[name] = above & (counts <= high) if math.isfinite(high) else above
    return groups


def group_macro_accuracy(
    hits: torch.Tensor, counts: torch.Tensor, groups: Mapping[str, torch.Tensor]
) -> dict[str, float]:
    """Mean per-class accuracy inside each group, over the classes present in the split.
    Groups without a present class are left out."""
    out = {}
    for name, mask in groups.items():
        if mask.shape != counts.shape:
            raise ValueError(f"class_counts has {mask.numel()} classes, the scores have {counts.numel()}")
        value = _macro(hits, counts, mask)
        if value is not None:
            out[name] = value
    return out


# --------------------------------------------------------------------------------------------
# average-K
# --------------------------------------------------------------------------------------------


def calibrate_avgk_threshold(val_scores: torch.Tensor, k: float) -> float:
    """Global average-K threshold: midpoint of the m-th and (m+1)-th largest of the n x L
    validation scores, m = floor(k n) (thesis Algorithm 1; docs/papers.md, note A-N5;
    ``0.5*(sorted[n*k-1] + sorted[n*k])`` in 0-indexed code).

    Without ties exactly m (image, class) pairs reach the threshold, so the validation mean set
    size is m/n, i.e. k for integer k and within 1/n of k otherwise.  Ties at the m-th value make
    the sets larger (every tied entry is kept).  The rule needs no labels.  The midpoint is taken
    in float64 (float32 saturates near 1, note A-N5) and returned as a Python float;
    the set functions below compare exactly against it whatever the score dtype.
    """
    val_scores = _check_scores(val_scores, "val_scores")
    n, num_classes = val_scores.shape
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k):
        raise ValueError(f"k must be a number in (0, {num_classes}), got {k!r}")
    m = math.floor(round(k * n, 9))
    if not 1 <= m <= n * num_classes - 1:
        raise ValueError(
            f"k must satisfy 1 <= floor(k * n_val) <= n_val * L - 1 so that a midpoint exists "
            f"(n_val={n}, L={num_classes}), got k={k!r}"
        )
    top = torch.topk(val_scores.reshape(-1), m + 1, sorted=True).values
    return float(0.5 * (top[m - 1].double() + top[m].double()))


def calibrate_avgk_thresholds(val_scores: torch.Tensor, ks: Sequence[float]) -> dict[float, float]:
    """:func:`calibrate_avgk_threshold` for every K, as the dict ``evaluate`` takes."""
    return {k: calibrate_avgk_threshold(val_scores, k) for k in ks}


def _at_least(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """``scores >= threshold`` decided exactly, with the threshold as a float64 number.

    Comparing a float32 tensor with a Python float would first round the threshold to float32
    (possibly onto a score just below it).  For scores of dtype D, ``s >= t`` is equivalent to
    ``s >= t_up`` where ``t_up`` is the smallest D value ``>= t``; that keeps memory at one bool
    per score instead of a float64 copy."""
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.to(torch.float32)
    exact = torch.tensor(float(threshold), dtype=torch.float64)
    rounded = exact.to(scores.dtype)
    if bool(rounded.to(torch.float64) < exact):
        rounded = torch.nextafter(rounded, torch.tensor(math.inf, dtype=scores.dtype))
    return scores >= rounded.to(scores.device)


def _check_threshold(threshold: float) -> float:
    if isinstance(threshold, torch.Tensor):
        threshold = float(threshold)
    if not isinstance(threshold, (int, float)) or math.isnan(threshold):
        raise ValueError(f"avgk threshold must be a number, got {threshold!r}")
    return float(threshold)


def avgk_hits(scores: torch.Tensor, targets: torch.Tensor, threshold: float) -> torch.Tensor:
    """Bool (n,): ``s_y >= lambda`` (thesis eq. 2.32 / 5.17)."""
    scores = _check_scores(scores)
    targets = _check_targets(targets, scores)
    return _at_least(scores.gather(1, targets[:, None]), _check_threshold(threshold))[:, 0]


def avgk_set_sizes(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """Int64 (n,): per-input set sizes ``|{j : s_j >= lambda}|`` (for the Fig. 5.4 histograms)."""
    scores = _check_scores(scores)
    return _at_least(scores, _check_threshold(threshold)).sum(dim=1)


def avgk_sets(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """Bool (n, L): the average-K sets ``{j : s_j >= lambda}`` themselves (for comparisons with
    other set-valued predictors, ``setvalued.metrics.conformal``)."""
    scores = _check_scores(scores)
    return _at_least(scores, _check_threshold(threshold))


def avgk_accuracy(scores: torch.Tensor, targets: torch.Tensor, threshold: float) -> float:
    """Micro average-K accuracy (thesis eqs. 5.16/5.17)."""
    return float(avgk_hits(scores, targets, threshold).double().mean())


def avgk_set_size(scores: torch.Tensor, threshold: float) -> float:
    """Mean set size, K_test of S2 eq. (1)."""
    return float(avgk_set_sizes(scores, threshold).double().mean())


def per_class_avgk(
    scores: torch.Tensor, targets: torch.Tensor, threshold: float, num_classes: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hits, counts) per class for average-K with the global threshold."""
    scores = _check_scores(scores)
    targets = _check_targets(targets, scores)
    num_classes = _check_num_classes(num_classes, scores)
    return _per_class(avgk_hits(scores, targets, threshold), targets, num_classes)


def macro_avgk_accuracy(
    scores: torch.Tensor, targets: torch.Tensor, threshold: float, num_classes: int | None = None
) -> float | None:
    """Per-class average-K accuracy (one global threshold) averaged over present classes."""
    hits, counts = per_class_avgk(scores, targets, threshold, num_classes)
    return _macro(hits, counts)


# --------------------------------------------------------------------------------------------
# everything at once
# --------------------------------------------------------------------------------------------


def evaluate(
    scores: torch.Tensor,
    targets: torch.Tensor,
    ks: Sequence[int],
    class_counts: Sequence[int] | torch.Tensor | None,
    avgk_threshold: Mapping[float, float] | None = None,
    shot_thresholds: Sequence[int] = DEFAULT_SHOT_THRESHOLDS,
    count_bins: Sequence[int] = (),
) -> dict[str, float | None]:
    """The flat metric dict of docs/interfaces.md section 3 (no split prefix).

    For every K in ``ks``: ``topK``, ``macro_topK``, ``few/topK``, ``medium/topK``,
    ``many/topK`` and, for every bin of the ``count_bins`` edges, ``count_<low>_<high>/topK``.
    For every K of ``avgk_threshold`` (K -> calibrated threshold, on the same score scale as
    ``scores``): ``avgK``, ``macro_avgK``, ``avgK_size``, ``few/avgK``, ``count_.../avgK``...
    Groups without a class present in the split are left out; ``class_counts=None`` leaves out
    every group.  K larger than the number of classes is skipped for top-K.
    """
    scores = _check_scores(scores)
    targets = _check_targets(targets, scores)
    num_classes = scores.shape[1]
    groups: dict[str, torch.Tensor] = {}
    if class_counts is not None:
        groups = shot_groups(class_counts, shot_thresholds)
        groups.update(count_bin_groups(class_counts, count_bins))
        if groups["few"].numel() != num_classes:
            raise ValueError(f"class_counts has {groups['few'].numel()} entries, the scores have {num_classes} classes")
    out: dict[str, float | None] = {}  # a macro mean over no class present: None
    for given in ks:
        if isinstance(given, bool) or int(given) != given or int(given) < 1:
            raise ValueError(f"ks must hold positive integers, got {given!r}")
        k = int(given)
        if k > num_classes:
            continue
        hits, counts = _per_class(topk_hits(scores, targets, k), targets, num_classes)
        name = f"top{k}"
        out[name] = float(hits.sum()) / targets.numel()
        out[f"macro_{name}"] = _macro(hits, counts)
        for group, value in group_macro_accuracy(hits, counts, groups).items():
            out[f"{group}/{name}"] = value
    for size, threshold in (avgk_threshold or {}).items():
        name = f"avg{_fmt_k(size)}"
        hits, counts = _per_class(avgk_hits(scores, targets, threshold), targets, num_classes)
        out[name] = float(hits.sum()) / targets.numel()
        out[f"macro_{name}"] = _macro(hits, counts)
        out[f"{name}_size"] = avgk_set_size(scores, threshold)
        for group, value in group_macro_accuracy(hits, counts, groups).items():
            out[f"{group}/{name}"] = value
    return out
