"""Metrics of multi-label classification: precision and recall of the K highest scores.

The thesis has no multi-label experiment; for the sparse-top loss it says that at test time
the number of labels |Y| is unknown, so either the raw scores are ranked for "the usual
multi-label metrics", or, with |Y| known, ``sparse-top(|Y|, s)`` is the sparse prediction
([Gar23] §6.2.7). Both are ranking metrics here, so that losses whose outputs live on different
scales (sparse-top's unbounded scores, BCE's logits) are compared on the same footing:

- ``prec<K>`` / ``rec<K>``: ``|T_K(s) ∩ Y| / K`` and ``|T_K(s) ∩ Y| / |Y|`` averaged over the
  examples, for every K of ``eval.ks`` (the top-K of [Gar23] eq. 2.14 with a set of labels);
- ``rprec``: ``|T_|Y|(s) ∩ Y| / |Y|``, the precision at the example's own number of labels.
  ``sparse-top(|Y|, s)`` is non-decreasing in each ``s_j`` ([Gar23] eq. 6.14), so its |Y|
  largest coordinates are the |Y| largest scores: this is the thesis's option with |Y| known;
- ``macro_rec<K>`` and ``few/rec<K>`` (medium, many): the recall at K of each class (the share
  of the examples carrying the class that have it among their K highest scores), averaged over
  the classes present, or over those of a shot group (as ``setvalued.metrics``).

Ties are counted against the label, as in ``setvalued.metrics``: label j is among the K highest
scores iff fewer than K other classes score at least ``s_j`` (so at most K labels are hits).
Targets are a multi-hot (n, L) tensor; an example without labels counts in ``prec<K>`` (no hit)
and is left out of the recalls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from setvalued.metrics.accuracy import DEFAULT_SHOT_THRESHOLDS, group_macro_accuracy, shot_groups

__all__ = ["label_ranks", "multilabel_evaluate", "per_class_recall"]


def _check(scores: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or scores.shape[0] == 0:
        raise ValueError(
            f"scores must be a non-empty (examples, classes) tensor, got {tuple(getattr(scores, 'shape', ()))}"
        )
    if not isinstance(targets, torch.Tensor) or targets.shape != scores.shape:
        raise ValueError(
            f"targets must be a multi-hot matrix of the scores' shape {tuple(scores.shape)}, got "
            f"{tuple(getattr(targets, 'shape', ()))}"
        )
    labels = targets.to(scores.device)
    if bool(((labels != 0) & (labels != 1)).any()):
        raise ValueError("targets must hold only 0 and 1 (a multi-hot matrix)")
    scores = scores.float() if not scores.is_floating_point() else scores
    if bool(torch.isnan(scores).any()):
        raise ValueError("scores contain NaN")
    return scores, labels.bool()


def label_ranks(scores: torch.Tensor) -> torch.Tensor:
    """Int64 (n, L): for every class j, the number of other classes scoring at least ``s_j``
    (j is among the K highest iff its rank is < K, ties against it). O(n L log L)."""
    ascending = torch.sort(scores, dim=1).values
    # classes scoring >= s_j: L - (number of values < s_j); minus j itself
    below = torch.searchsorted(ascending, scores.contiguous(), right=False)
    return scores.shape[1] - below - 1


def per_class_recall(scores: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hits, counts), int64 (L,): per class, the examples carrying it that have it among their
    K highest scores, and the examples carrying it."""
    scores, labels = _check(scores, targets)
    hits = (label_ranks(scores) < k) & labels
    return hits.sum(dim=0), labels.sum(dim=0)


def multilabel_evaluate(
    scores: torch.Tensor,
    targets: torch.Tensor,
    ks: Sequence[int],
    class_counts: Sequence[int] | torch.Tensor | None = None,
    shot_thresholds: Sequence[int] = DEFAULT_SHOT_THRESHOLDS,
) -> dict[str, float]:
    """The flat dict of multi-label metrics (module docstring; no split prefix): ``prec<K>``,
    ``rec<K>``, ``macro_rec<K>``, ``<group>/rec<K>`` for every K of ``ks`` (K > L skipped), and
    ``rprec``. ``class_counts``: training examples per class, for the shot groups."""
    scores, labels = _check(scores, targets)
    n, num_classes = scores.shape
    ranks = label_ranks(scores)
    sizes = labels.sum(dim=1)
    has_labels = sizes > 0
    groups = shot_groups(class_counts, shot_thresholds) if class_counts is not None else {}
    out: dict[str, float] = {}
    for k in ks:
        k = int(k)
        if k > num_classes:
            continue
        hit = (ranks < k) & labels
        per_example = hit.sum(dim=1).double()
        out[f"prec{k}"] = float((per_example / k).mean())
        if bool(has_labels.any()):
            out[f"rec{k}"] = float((per_example[has_labels] / sizes[has_labels].double()).mean())
        class_hits, class_counts_test = hit.sum(dim=0), labels.sum(dim=0)
        present = class_counts_test > 0
        if bool(present.any()):
            out[f"macro_rec{k}"] = float((class_hits[present].double() / class_counts_test[present].double()).mean())
        for group, value in group_macro_accuracy(class_hits, class_counts_test, groups).items():
            out[f"{group}/rec{k}"] = value
    if bool(has_labels.any()):
        own = ((ranks < sizes[:, None]) & labels).sum(dim=1).double()
        out["rprec"] = float((own[has_labels] / sizes[has_labels].double()).mean())
    return out
