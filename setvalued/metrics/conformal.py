"""Split conformal prediction: a set-valued baseline to compare with average-K ([Gar23] §2.2.2).

No training: the inputs are probabilities (e.g. ``setvalued.metrics.activate(logits,
"softmax")``) of a trained model on a labelled calibration split, carved from the validation
data by :func:`split_calibration`, and on the evaluated split.

Recipe ([Gar23] §2.2.2, eq. 2.5; docs/papers.md, notes C-N1 to C-N4):

1. a non-conformity score ``S(x, j)`` for every class: LAC ``1 - p_j(x)`` (the thesis's score;
   the "least ambiguous set-valued classifier" of [SLW19]) or APS, the probability mass of the
   classes ranked up to and including j ("adaptive prediction sets", [RSC20]), optionally
   randomised (the mass before j plus ``(1 - U) p_j(x)``, one ``U ~ U[0, 1]`` per example);
2. ``q_hat`` = the ``k``-th smallest of the calibration scores ``c_i = S(X_i, Y_i)``,
   ``k = ceil((n + 1)(1 - alpha))`` (the thesis prints the ceiling as brackets, note C-N1);
   ``q_hat = +inf`` when ``k > n``;
3. the set ``C(x) = {j : S(x, j) <= q_hat}``; for LAC that is ``{j : p_j(x) >= 1 - q_hat}``, the
   thesis's set. Membership is decided on the same score matrix as the calibration scores, so
   ``y in C(x)`` iff ``S(x, y) <= q_hat`` exactly, and for exchangeable calibration and test
   points ``1 - alpha <= P(Y in C(X)) <= 1 - alpha + 1/(n + 1)`` (eq. 2.5; the upper bound needs
   scores without ties). The guarantee is marginal; sets may be empty and have no size bound.

Mondrian (class-conditional) calibration ([VGS05]) computes one ``q_hat`` per class from that
class's calibration examples (``mondrian="class"``), or per shot group of the training counts
(``mondrian="shot"``: few/medium/many as in ``setvalued.metrics.shot_groups``); the guarantee
then holds given the class (resp. group). A class or group with ``n_c < 1/alpha - 1``
calibration examples (so that ``k > n_c``) gets ``q_hat = +inf``: the class is put in every
set, which keeps its guarantee (note C-N3).

To compare with average-K at equal set size, :func:`match_average_size` finds the level alpha
whose sets have a given mean size on the calibration data (or on other unlabelled data), note
C-N4.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from setvalued.metrics.accuracy import DEFAULT_SHOT_THRESHOLDS, SHOT_GROUPS
from setvalued.metrics.conformal_sets import (
    MONDRIAN,
    SCORES,
    GroupedScores,
    aps_scores,
    calibrate,
    check_labels,
    check_probs,
    check_score,
    class_groups,
    conformal_quantile,
    coverage_and_size,
    lac_scores,
    nonconformity,
    prediction_sets,
    split_calibration,
)
from setvalued.metrics.names import conformal_level_name, conformal_method_name

__all__ = [
    "SCORES",
    "MONDRIAN",
    "nonconformity",
    "lac_scores",
    "aps_scores",
    "conformal_quantile",
    "calibrate",
    "prediction_sets",
    "coverage_and_size",
    "split_calibration",
    "MatchedLevel",
    "match_average_size",
    "ConformalMethod",
    "conformal_metrics",
    "set_metrics",
]


# --------------------------------------------------------------------------------------------
# the level with a given average set size
# --------------------------------------------------------------------------------------------


class MatchedLevel(NamedTuple):
    """The output of :func:`match_average_size`."""

    #: the conformal level: ``calibrate(..., alpha)`` gives ``thresholds``
    alpha: float
    #: what :func:`calibrate` returns at that level (a float, or an (L,) tensor for Mondrian)
    thresholds: float | torch.Tensor
    #: the mean set size it gives on the data the size was measured on
    size: float


def _sorted_columns(scores: torch.Tensor) -> torch.Tensor:
    return torch.sort(scores.T.contiguous(), dim=1).values  # (L, n)


def _mean_size(columns: torch.Tensor, row: torch.Tensor, n: int) -> float:
    """Mean set size ``(1/n) sum_j #{i : S_ij <= q_j}`` from the sorted columns (L, n)."""
    counts = torch.searchsorted(columns, row.reshape(-1, 1).contiguous(), right=True)
    return float(counts.sum()) / n


def match_average_size(
    probs_cal: Any,
    labels_cal: Any,
    target_size: float,
    score: str = "lac",
    mondrian: Any = False,
    class_counts: Any = None,
    shot_thresholds: Sequence[int] = DEFAULT_SHOT_THRESHOLDS,
    size_probs: Any = None,
    randomized: bool = False,
    generator: torch.Generator | None = None,
    steps: int = 60,
) -> MatchedLevel:
    """The conformal level alpha whose sets have mean size ``target_size``, so that conformal
    sets and average-K sets (``setvalued.metrics``, mean size K on the validation data) can be
    compared at the same mean set size.

    The mean size is measured on ``size_probs`` (unlabelled; default: the calibration
    probabilities); it is a non-increasing step function of alpha, so the target is met up to one
    step. Marginal: every attainable threshold (one per rank k of the n calibration scores, and
    ``+inf``) is tried at once and the one whose size is nearest the target is kept (the smaller
    on a tie); ``alpha = 1 - k/(n + 1)``, the level whose guarantee is exactly ``k/(n + 1)``
    (``1/(2(n + 1))`` for ``+inf``). Mondrian: bisection on alpha (``steps`` halvings), keeping
    the end of the final bracket nearest the target.
    """
    probs = check_probs(probs_cal, "probs_cal")
    labels = check_labels(labels_cal, probs, "labels_cal")
    if (
        isinstance(target_size, bool)
        or not isinstance(target_size, (int, float))
        or not math.isfinite(target_size)
        or target_size < 0
    ):
        raise ValueError(f"target_size must be a number >= 0, got {target_size!r}")
    sized = probs if size_probs is None else check_probs(size_probs, "size_probs")
    if sized.shape[1] != probs.shape[1]:
        raise ValueError(f"size_probs has {sized.shape[1]} classes, probs_cal has {probs.shape[1]}")
    calibration_scores = nonconformity(probs, score, randomized, generator)
    label_scores = calibration_scores.gather(1, labels[:, None])[:, 0]
    grouping = class_groups(mondrian, probs.shape[1], class_counts, shot_thresholds)
    # sizes on the calibration data use the same draw of U as the calibration scores
    size_scores = calibration_scores if size_probs is None else nonconformity(sized, score, randomized, generator)
    if grouping is None:
        return _matched_marginal(label_scores, size_scores, target_size)
    class_group, num_groups = grouping
    class_group = class_group.to(probs.device)
    grouped = GroupedScores(label_scores, class_group[labels], num_groups)
    return _matched_by_bisection(grouped, class_group, size_scores, target_size, int(steps))


def _matched_marginal(label_scores: torch.Tensor, size_scores: torch.Tensor, target_size: float) -> MatchedLevel:
    """Marginal sets: every attainable threshold tried at once, the nearest the target kept
    (the smaller on a tie); see `match_average_size`."""
    n_cal, n_size = label_scores.shape[0], size_scores.shape[0]
    flat = torch.sort(size_scores.reshape(-1)).values
    candidates = torch.cat(
        [torch.sort(label_scores).values, torch.tensor([math.inf], dtype=torch.float64, device=label_scores.device)]
    )
    sizes = torch.searchsorted(flat, candidates, right=True).to(torch.float64) / n_size
    best = int(torch.argmin((sizes - target_size).abs()))  # the first, i.e. the smaller, on a tie
    k = best + 1
    alpha = 1.0 - k / (n_cal + 1) if k <= n_cal else 0.5 / (n_cal + 1)
    thresholds = conformal_quantile(label_scores, alpha)
    return MatchedLevel(alpha, thresholds, float(sizes[best]))


def _matched_by_bisection(
    grouped: GroupedScores, class_group: torch.Tensor, size_scores: torch.Tensor, target_size: float, steps: int
) -> MatchedLevel:
    """Mondrian sets: bisection on alpha (`steps` halvings), the end of the final bracket
    nearest the target kept."""
    n_size = size_scores.shape[0]
    columns = _sorted_columns(size_scores)

    def size_at(alpha: float) -> tuple[float, torch.Tensor]:
        row = grouped.thresholds(alpha)[class_group]
        return _mean_size(columns, row, n_size), row

    low, high = 1e-12, 1.0 - 1e-12  # size(low) >= size(high)
    size_low, _ = size_at(low)
    size_high, _ = size_at(high)
    if target_size >= size_low:
        high = low
    elif target_size <= size_high:
        low = high
    else:
        for _ in range(steps):
            middle = 0.5 * (low + high)
            size_middle, _ = size_at(middle)
            if size_middle >= target_size:
                low = middle
            else:
                high = middle
    (size_low, row_low), (size_high, row_high) = size_at(low), size_at(high)
    if abs(size_high - target_size) < abs(size_low - target_size):
        return MatchedLevel(high, row_high, size_high)
    return MatchedLevel(low, row_low, size_low)


# --------------------------------------------------------------------------------------------
# the metrics the trainer logs (setvalued.metrics.names, "the conformal baselines")
# --------------------------------------------------------------------------------------------

#: the ``mondrian`` argument of :func:`calibrate` for each calibration-group name of the config
_MONDRIAN_OF = {"marginal": False, "class": "class", "shot": "shot"}


class ConformalMethod(NamedTuple):
    """A non-conformity score (``lac``, ``aps``) and its calibration groups (``marginal``,
    ``class``, ``shot``): ``eval.conformal_scores`` x ``eval.conformal_mondrian``."""

    score: str
    mondrian: str

    @property
    def name(self) -> str:
        return conformal_method_name(self.score, self.mondrian)


def _named(prefix: str, stats: dict[str, float]) -> dict[str, float]:
    """The output of :func:`coverage_and_size` under the metric names of a set family
    (``lac90``: ``lac90``, ``macro_lac90``, ``lac90_size``, ``few/lac90``, ``few/lac90_size``)."""
    out = {prefix: stats["coverage"], f"macro_{prefix}": stats["macro_coverage"], f"{prefix}_size": stats["size"]}
    for group in SHOT_GROUPS:
        if f"{group}/coverage" in stats:
            out[f"{group}/{prefix}"] = stats[f"{group}/coverage"]
            out[f"{group}/{prefix}_size"] = stats[f"{group}/size"]
    return out


def conformal_metrics(
    probs_cal: Any,
    labels_cal: Any,
    probs_test: Any,
    labels_test: Any,
    methods: Sequence[ConformalMethod],
    alphas: Sequence[float] = (),
    matched_sizes: dict[str, float] | None = None,
    size_probs: Any = None,
    class_counts: Any = None,
    shot_thresholds: Sequence[int] = DEFAULT_SHOT_THRESHOLDS,
) -> dict[str, float]:
    """Coverage and set size on the test data of every conformal method, calibrated on the
    labelled calibration split: at every level ``alpha`` (metric names ``<method><1-alpha in
    %>``: ``lac90``), and, for every entry ``name -> target`` of ``matched_sizes`` (``"avg5" ->
    5.0``), at the level whose sets have that mean size on the unlabelled ``size_probs``
    (:func:`match_average_size`; names ``<method>_<name>``, e.g. ``aps_class_avg5``, and
    ``<method>_<name>_alpha`` the level found), so that conformal and average-K sets are
    compared at the same mean size ([Gar23] §2.2.2; docs/papers.md, note C-N4).

    Every family gets its coverage, ``macro_`` coverage, ``_size``, and with ``class_counts``
    the shot-group coverage and size (:func:`coverage_and_size`). Probabilities as in
    :func:`calibrate`; no randomisation (APS is the deterministic variant, note C-N2).
    """
    probs_cal = check_probs(probs_cal, "probs_cal")
    probs_test = check_probs(probs_test, "probs_test")
    if probs_test.shape[1] != probs_cal.shape[1]:
        raise ValueError(f"probs_test has {probs_test.shape[1]} classes, probs_cal has {probs_cal.shape[1]}")
    out: dict[str, float] = {}

    def evaluate_sets(prefix: str, thresholds: Any, score: str) -> None:
        sets = prediction_sets(probs_test, thresholds, score)
        out.update(_named(prefix, coverage_and_size(sets, labels_test, class_counts, shot_thresholds)))

    for method in methods:
        check_score(method.score)
        if method.mondrian not in _MONDRIAN_OF:
            raise ValueError(f"mondrian must be one of {', '.join(_MONDRIAN_OF)}, got {method.mondrian!r}")
        mondrian = _MONDRIAN_OF[method.mondrian]
        for alpha in alphas:
            thresholds = calibrate(probs_cal, labels_cal, alpha, method.score, mondrian, class_counts, shot_thresholds)
            evaluate_sets(f"{method.name}{conformal_level_name(alpha)}", thresholds, method.score)
        for name, target in (matched_sizes or {}).items():
            level = match_average_size(
                probs_cal,
                labels_cal,
                target,
                method.score,
                mondrian,
                class_counts,
                shot_thresholds,
                size_probs=size_probs,
            )
            evaluate_sets(f"{method.name}_{name}", level.thresholds, method.score)
            out[f"{method.name}_{name}_alpha"] = level.alpha
    return out


def set_metrics(
    sets: torch.Tensor,
    labels: Any,
    prefix: str,
    class_counts: Any = None,
    shot_thresholds: Sequence[int] = DEFAULT_SHOT_THRESHOLDS,
) -> dict[str, float]:
    """The metrics of :func:`conformal_metrics` for any family of sets (bool (n, L)), named by
    ``prefix``: how the trainer names the average-K sets' shot-group sizes (``few/avg5_size``)."""
    return _named(prefix, coverage_and_size(sets, labels, class_counts, shot_thresholds))
