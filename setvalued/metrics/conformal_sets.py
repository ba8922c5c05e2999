"""Split conformal prediction for `setvalued.metrics.conformal`: the non-conformity scores (LAC, APS),
the calibrated quantile (marginal or Mondrian), prediction sets, their coverage and size,
the calibration split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from setvalued.metrics.accuracy import DEFAULT_SHOT_THRESHOLDS, SHOT_GROUPS, group_macro_accuracy, shot_groups

#: the non-conformity scores
SCORES = ("lac", "aps")
#: the values of ``mondrian``: marginal (False / "none"), per class (True / "class"), per shot group
MONDRIAN = (False, True, "none", "class", "shot")


# --------------------------------------------------------------------------------------------
# input checks
# --------------------------------------------------------------------------------------------


def check_probs(probs: Any, name: str = "probs") -> torch.Tensor:
    """(n, L) probabilities as float64 (the APS cumulative sums and 1 - p need it near 1)."""
    if not isinstance(probs, torch.Tensor):
        probs = torch.as_tensor(probs)
    if probs.dim() != 2 or probs.shape[0] == 0 or probs.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty (examples, classes) tensor, got shape {tuple(probs.shape)}")
    probs = probs.detach().to(torch.float64)
    if bool(torch.isnan(probs).any()):
        raise ValueError(f"{name} contain NaN")
    return probs


def check_labels(labels: Any, probs: torch.Tensor, name: str = "labels") -> torch.Tensor:
    if not isinstance(labels, torch.Tensor):
        labels = torch.as_tensor(labels)
    if labels.dim() != 1 or labels.shape[0] != probs.shape[0]:
        raise ValueError(
            f"{name} must be one class index per row of the probabilities ({probs.shape[0]}), "
            f"got shape {tuple(labels.shape)}"
        )
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer class indices, got dtype {labels.dtype}")
    labels = labels.to(device=probs.device, dtype=torch.long)
    if int(labels.min()) < 0 or int(labels.max()) >= probs.shape[1]:
        raise ValueError(
            f"{name} must lie in [0, {probs.shape[1] - 1}], got values in [{int(labels.min())}, {int(labels.max())}]"
        )
    return labels


def _check_alpha(alpha: Any) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < float(alpha) < 1:
        raise ValueError(f"alpha must be a number in (0, 1) (the miscoverage level), got {alpha!r}")
    return float(alpha)


def check_score(score: str) -> str:
    if score not in SCORES:
        raise ValueError(f"score must be one of {', '.join(repr(s) for s in SCORES)}, got {score!r}")
    return score


def _quantile_rank(n: Any, alpha: float) -> Any:
    """``k = ceil((n + 1)(1 - alpha))`` (elementwise for a tensor n), rounded first so that a
    product such as 100 * 0.9 = 90.00000000000001 is not pushed to 91; at least 1 (alpha < 1)."""
    if isinstance(n, torch.Tensor):
        return torch.ceil(torch.round((n.to(torch.float64) + 1) * (1 - alpha) * 1e9) / 1e9).long().clamp(min=1)
    return max(math.ceil(round((n + 1) * (1 - alpha), 9)), 1)


# --------------------------------------------------------------------------------------------
# scores
# --------------------------------------------------------------------------------------------


def _uniforms(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    gen_device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(n, 1, generator=generator, dtype=torch.float64, device=gen_device).to(device)


def nonconformity(
    probs: Any, score: str = "lac", randomized: bool = False, generator: torch.Generator | None = None
) -> torch.Tensor:
    """(n, L) float64: the non-conformity ``S(x_i, j)`` of every class of every example.

    ``"lac"``: ``1 - p_j``. ``"aps"``: with the classes of a row in decreasing probability
    (ties by class index: a stable sort), the mass of the classes before j plus ``p_j``; with
    ``randomized`` plus ``(1 - U_i) p_j`` instead of ``p_j``, one ``U_i ~ U[0, 1]`` per row drawn
    from ``generator`` ([RSC20]). Along the probability order the APS score
    increases, so APS sets are prefixes of that order. ``randomized`` applies to APS only.
    """
    probs = check_probs(probs)
    score = check_score(score)
    if score == "lac":
        if randomized:
            raise ValueError("randomized applies to the 'aps' score only")
        return 1.0 - probs
    order = torch.sort(probs, dim=1, descending=True, stable=True).indices
    ranked = probs.gather(1, order)
    through = ranked.cumsum(dim=1)
    if randomized:
        through = through - _uniforms(probs.shape[0], generator, probs.device) * ranked
    return torch.empty_like(probs).scatter_(1, order, through)


def lac_scores(probs: Any, labels: Any) -> torch.Tensor:
    """(n,) LAC calibration scores ``1 - p_y`` ([Gar23] §2.2.2)."""
    probs = check_probs(probs)
    labels = check_labels(labels, probs)
    return nonconformity(probs, "lac").gather(1, labels[:, None])[:, 0]


def aps_scores(
    probs: Any, labels: Any, randomized: bool = False, generator: torch.Generator | None = None
) -> torch.Tensor:
    """(n,) APS calibration scores: the sorted probability mass up to and including the label
    (randomised: the mass before it plus ``(1 - U) p_y``); see :func:`nonconformity`."""
    probs = check_probs(probs)
    labels = check_labels(labels, probs)
    return nonconformity(probs, "aps", randomized, generator).gather(1, labels[:, None])[:, 0]


def conformal_quantile(scores: Any, alpha: float) -> float:
    """``q_hat``: the ``ceil((n + 1)(1 - alpha))``-th smallest of the n calibration scores
    ([Gar23] §2.2.2, the ``ceil((n+1)(1-alpha))/n`` empirical quantile; docs/papers.md, note C-N1), ``+inf``
    when that rank exceeds n (then every class is in every set)."""
    alpha = _check_alpha(alpha)
    scores = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
    n = scores.numel()
    if n == 0:
        return math.inf
    k = _quantile_rank(n, alpha)
    if k > n:
        return math.inf
    return float(torch.kthvalue(scores, k).values)


# --------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------


def class_groups(
    mondrian: Any, num_classes: int, class_counts: Any, shot_thresholds: Sequence[int]
) -> tuple[torch.Tensor, int] | None:
    """The group id of every class (L,) and the number of groups; None for marginal."""
    if mondrian is False or mondrian == "none" or mondrian is None:
        return None
    if mondrian is True or mondrian == "class":
        return torch.arange(num_classes), num_classes
    if mondrian == "shot":
        if class_counts is None:
            raise ValueError("mondrian='shot' needs class_counts (the training images per class)")
        groups = shot_groups(class_counts, shot_thresholds)
        if groups["few"].numel() != num_classes:
            raise ValueError(
                f"class_counts has {groups['few'].numel()} entries, the probabilities have {num_classes} classes"
            )
        ids = torch.zeros(num_classes, dtype=torch.long)
        for index, name in enumerate(SHOT_GROUPS):
            ids[groups[name]] = index
        return ids, len(SHOT_GROUPS)
    raise ValueError(f"mondrian must be one of False, True, 'none', 'class', 'shot', got {mondrian!r}")


class GroupedScores:
    """Calibration scores sorted within each group, for group thresholds at any alpha."""

    def __init__(self, label_scores: torch.Tensor, label_groups: torch.Tensor, num_groups: int):
        order = torch.argsort(label_scores, stable=True)
        regroup = torch.argsort(label_groups[order], stable=True)
        self.sorted = label_scores[order][regroup]
        self.counts = torch.bincount(label_groups, minlength=num_groups)
        self.starts = self.counts.cumsum(0) - self.counts

    def thresholds(self, alpha: float) -> torch.Tensor:
        """(groups,) float64: each group's q_hat, +inf where k > n_g (n_g = 0 included)."""
        k = _quantile_rank(self.counts, alpha)
        valid = k <= self.counts
        position = (self.starts + k - 1).clamp(0, max(self.sorted.numel() - 1, 0))
        picked = self.sorted[position] if self.sorted.numel() else torch.zeros_like(position, dtype=torch.float64)
        return torch.where(valid, picked, torch.full_like(picked, math.inf, dtype=torch.float64))


def calibrate(
    probs_cal: Any,
    labels_cal: Any,
    alpha: float,
    score: str = "lac",
    mondrian: Any = False,
    class_counts: Any = None,
    shot_thresholds: Sequence[int] = DEFAULT_SHOT_THRESHOLDS,
    randomized: bool = False,
    generator: torch.Generator | None = None,
) -> float | torch.Tensor:
    """The conformal threshold(s) from a labelled calibration split.

    ``probs_cal`` (n, L) probabilities, ``labels_cal`` (n,) class indices, ``alpha`` in (0, 1)
    the target miscoverage, ``score`` "lac" or "aps" (``randomized`` APS draws its U from
    ``generator``). ``mondrian``: False (marginal, [Gar23] eq. 2.5) returns one float ``q_hat``;
    True / "class" returns a float64 (L,) tensor, one ``q_hat`` per class from its own
    calibration examples; "shot" one per shot group of ``class_counts`` (training images per
    class, groups of ``setvalued.metrics.shot_groups``), expanded to (L,). A class (group) with
    fewer than ``1/alpha - 1`` calibration examples gets ``+inf``: it is in every set.
    """
    probs = check_probs(probs_cal, "probs_cal")
    labels = check_labels(labels_cal, probs, "labels_cal")
    alpha = _check_alpha(alpha)
    label_scores = nonconformity(probs, score, randomized, generator).gather(1, labels[:, None])[:, 0]
    grouping = class_groups(mondrian, probs.shape[1], class_counts, shot_thresholds)
    if grouping is None:
        return conformal_quantile(label_scores, alpha)
    class_group, num_groups = grouping
    class_group = class_group.to(probs.device)
    per_group = GroupedScores(label_scores, class_group[labels], num_groups).thresholds(alpha)
    return per_group[class_group]


def _threshold_row(thresholds: Any, num_classes: int, device: torch.device) -> torch.Tensor:
    """Thresholds as a (1, L) float64 tensor (a number is the same for every class)."""
    row = torch.as_tensor(thresholds, dtype=torch.float64, device=device)
    if row.dim() == 0:
        row = row.expand(num_classes)
    if row.shape != (num_classes,):
        raise ValueError(f"thresholds must be a number or one per class ({num_classes},), got shape {tuple(row.shape)}")
    if bool(torch.isnan(row).any()):
        raise ValueError("thresholds contain NaN")
    return row[None, :]


def prediction_sets(
    probs: Any, thresholds: Any, score: str = "lac", randomized: bool = False, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Bool (n, L): ``C(x_i) = {j : S(x_i, j) <= q_hat_j}`` with the score used to calibrate
    (for LAC ``p_j >= 1 - q_hat``, [Gar23] §2.2.2). ``thresholds``: the output of
    :func:`calibrate` (a float, or one per class)."""
    probs = check_probs(probs)
    scores = nonconformity(probs, score, randomized, generator)
    return scores <= _threshold_row(thresholds, probs.shape[1], probs.device)


# --------------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------------


def coverage_and_size(
    sets: torch.Tensor, labels: Any, class_counts: Any = None, shot_thresholds: Sequence[int] = DEFAULT_SHOT_THRESHOLDS
) -> dict[str, float]:
    """Coverage and set size of prediction sets, overall and per shot group.

    ``sets`` bool (n, L), ``labels`` (n,). Returns floats: ``coverage`` (the fraction of
    examples whose label is in its set, 1 - the average error), ``macro_coverage`` (per-class
    coverage averaged over the classes present, the class-conditional view), ``size`` (mean set
    size), ``empty`` (fraction of empty sets), and with ``class_counts`` (training images per
    class) for every shot group with a class present: ``<group>/coverage`` (mean per-class
    coverage over the group's classes, as the shot-group accuracies of
    ``setvalued.metrics.evaluate``) and ``<group>/size`` (mean set size over the examples whose
    label is in the group).
    """
    if not isinstance(sets, torch.Tensor) or sets.dim() != 2 or sets.shape[0] == 0:
        raise ValueError(
            f"sets must be a non-empty bool (examples, classes) tensor, got "
            f"{tuple(sets.shape) if isinstance(sets, torch.Tensor) else type(sets).__name__}"
        )
    sets = sets.bool()
    num_classes = sets.shape[1]
    labels = check_labels(labels, sets)
    hits = sets.gather(1, labels[:, None])[:, 0]
    sizes = sets.sum(dim=1).to(torch.float64)
    counts = torch.bincount(labels, minlength=num_classes)
    per_class_hits = torch.zeros(num_classes, dtype=torch.long, device=sets.device).index_add_(0, labels, hits.long())
    present = counts > 0
    out = {
        "coverage": float(hits.double().mean()),
        "macro_coverage": float((per_class_hits[present].double() / counts[present].double()).mean()),
        "size": float(sizes.mean()),
        "empty": float((sizes == 0).double().mean()),
    }
    if class_counts is not None:
        groups = shot_groups(class_counts, shot_thresholds)
        if groups["few"].numel() != num_classes:
            raise ValueError(f"class_counts has {groups['few'].numel()} entries, the sets have {num_classes} classes")
        groups = {name: mask.to(sets.device) for name, mask in groups.items()}
        for name, value in group_macro_accuracy(per_class_hits, counts, groups).items():
            out[f"{name}/coverage"] = value
            in_group = groups[name][labels]
            out[f"{name}/size"] = float(sizes[in_group].mean())
    return out


# --------------------------------------------------------------------------------------------
# the calibration split
# --------------------------------------------------------------------------------------------


def split_calibration(n: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(calibration indices, remaining validation indices) of a validation set of ``n`` examples:
    ``round(fraction * n)`` indices drawn without replacement by a ``torch.Generator`` seeded
    with ``seed`` (the same split for the same arguments, on any machine), both sorted, int64.
    Both parts must be non-empty."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n must be an integer >= 2 (the validation examples), got {n!r}")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ValueError(f"fraction must be a number in (0, 1), got {fraction!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    size = int(round(fraction * n))
    if not 1 <= size <= n - 1:
        raise ValueError(f"fraction={fraction!r} of n={n} leaves an empty calibration or validation part")
    permutation = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return torch.sort(permutation[:size]).values, torch.sort(permutation[size:]).values
