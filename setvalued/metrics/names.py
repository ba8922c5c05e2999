"""The names of the metrics the trainer reports, and a check that a name is one of them.

Metric names are paths: ``split/[group/][macro_]top<K>|avg<K>`` (``val/top5``,
``test/macro_top5``, ``val/few/top5``, ``val/avg5``), the running training accuracy
``train/top<K>``, and the per-epoch extras below. Pure Python.

A group is a set of classes chosen by their number of training images, and its metric is the
mean per-class accuracy over its classes: the shot groups ``few``, ``medium``, ``many``
(``eval.shot_thresholds``) or a bin of ``eval.count_bins``, named ``count_<low>_<high>``
(``test/count_10_50/top1``: the classes with 10 < n <= 50 training images; the first bin
starts at 0 and includes it, the last is ``count_<edge>_inf``: n > edge), the bins of
[Gar23] Table 3.1.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, cast

__all__ = [
    "METRIC_FORMAT",
    "TIME_METRICS",
    "PER_EPOCH_EXTRA_METRICS",
    "FINAL_EXTRA_METRICS",
    "common_metrics",
    "check_metric",
    "parse_metric",
    "count_bins",
    "conformal_method_name",
    "conformal_level_name",
    "parse_conformal_metric",
    "check_conformal_metric",
    "parse_multilabel_metric",
    "is_multilabel_metric",
    "check_multilabel_metric",
]

_METRIC_RE = re.compile(
    r"^(?P<split>val|test|train)/(?:(?P<group>few|medium|many|count_[0-9]+_(?:[0-9]+|inf))/)?"
    r"(?P<macro>macro_)?(?P<kind>top|avg)(?P<k>[0-9]+)$"
)

METRIC_FORMAT = (
    "a metric path such as val/top5, val/macro_top5, val/few/top5, test/count_10_50/top1 or "
    "val/avg5 (split/[few|medium|many|count_<low>_<high>/][macro_]top<K>|avg<K>)"
)


def count_bins(edges: Sequence[int]) -> list[tuple[str, int, float]]:
    """``(name, low, high)`` of the bins of classes by training images that ``eval.count_bins``
    edges define: ``[10, 50]`` -> ``count_0_10`` (0 <= n <= 10), ``count_10_50`` (10 < n <= 50),
    ``count_50_inf`` (n > 50). A class with n training images is in the bin with
    ``low < n <= high`` (n = 0 in the first): [Gar23] Table 3.1 prints its last bin "> 2000".
    No edges, no bins."""
    edges = [int(e) for e in edges]
    if not edges:
        return []
    bounds = [0] + edges
    out = [(f"count_{lo}_{hi}", lo, float(hi)) for lo, hi in zip(bounds, bounds[1:])]
    out.append((f"count_{edges[-1]}_inf", edges[-1], math.inf))
    return out


#: The seconds of an epoch's training and of its validation, logged every epoch: what a study's
#: time is estimated from (`studies plan`).
TIME_METRICS = ("epoch_time_s", "eval_time_s")

#: Per-epoch metrics of the trainer besides the val/ and train/ accuracies (docs/interfaces.md
#: section 4).
PER_EPOCH_EXTRA_METRICS = ("train/loss", "lr", *TIME_METRICS, "grad_nonzero", "grad_nonzero_active")

#: What a finished cell logs besides its test metrics: the selected epoch and its validation value.
FINAL_EXTRA_METRICS = ("best_val", "best_epoch")


def common_metrics(eval_section: Mapping[str, Any]) -> list[str]:
    """The usual metric paths of an eval section (not every one: no conformal or multi-label
    names), for a "did you mean" beside a mistyped path."""
    tops = [f"top{k}" for k in eval_section.get("ks", [])]
    avgs = [f"avg{k}" for k in eval_section.get("avgk", [])]
    names = list(FINAL_EXTRA_METRICS) + list(PER_EPOCH_EXTRA_METRICS) + [f"train/{t}" for t in tops]
    for split in ("val", "test"):
        names += [f"{split}/{m}" for m in tops + [f"macro_{t}" for t in tops] + avgs + [f"{a}_size" for a in avgs]]
        names += [f"{split}/{g}/{m}" for g in ("few", "medium", "many") for m in tops + avgs]
    return names


def parse_metric(metric: str) -> Mapping[str, str | None] | None:
    """The parts of an accuracy metric path (split, group, macro, kind, k), or None."""
    match = _METRIC_RE.match(metric) if isinstance(metric, str) else None
    return match.groupdict() if match else None


def check_metric(metric: str, eval_section: Mapping[str, Any], splits: tuple[str, ...] = ("val",)) -> str | None:
    """None when ``metric`` is a metric the trainer reports for this eval section, else why not."""
    if not isinstance(metric, str):
        return f"expected {METRIC_FORMAT}, got {metric!r}"
    if splits == ("val", "test", "train") and metric == "train/loss":
        return None
    match = parse_metric(metric)
    if not match:
        if parse_conformal_metric(metric):
            return check_conformal_metric(metric, eval_section, splits)
        if parse_multilabel_metric(metric):
            return check_multilabel_metric(metric, eval_section, splits)
        return f"expected {METRIC_FORMAT}, got {metric!r}"
    if match["split"] not in splits:
        return f"expected a {' or '.join(s + '/' for s in splits)} metric, got {metric!r}"
    if match["split"] == "train" and (match["group"] or match["macro"] or match["kind"] != "top"):
        return f"training metrics are the running top-K accuracy only (train/top<K>), got {metric!r}"
    if match["group"] and match["macro"]:
        return (
            f"group metrics are already macro averages: write {match['split']}/{match['group']}/"
            f"{match['kind']}{match['k']}, not {metric!r}"
        )
    group = match["group"]
    if group and group.startswith("count_"):
        names = [name for name, _, _ in count_bins(eval_section.get("count_bins") or [])]
        if group not in names:
            return (
                f"{metric!r} needs the bin {group} in eval.count_bins (now "
                f"{eval_section.get('count_bins') or []}, bins: {', '.join(names) or 'none'})"
            )
    k = int(cast(str, match["k"]))  # the pattern requires K
    if match["kind"] == "top" and k not in eval_section.get("ks", []):
        return f"{metric!r} needs K={k} in eval.ks (now {eval_section.get('ks')})"
    if match["kind"] == "avg" and k not in eval_section.get("avgk", []):
        return f"{metric!r} needs K={k} in eval.avgk (now {eval_section.get('avgk')})"
    return None


# --------------------------------------------------------------------------------------------
# the conformal baselines (setvalued.metrics.conformal; eval.conformal_*)
# --------------------------------------------------------------------------------------------
#
# A conformal method is a score and its calibration groups: ``lac``, ``aps`` (marginal),
# ``lac_class``, ``aps_class`` (Mondrian per class), ``lac_shot``, ``aps_shot`` (per shot group).
# Its sets are named by the method and the target coverage 1 - alpha in percent (``lac90``:
# alpha = 0.1), or by the average-K set size they are matched to (``lac_avg5``: calibrated so
# that the mean set size is that of average-5). Like the average-K sets (``avg5``, ``avg5_size``):
# ``test/lac90`` is the coverage (the fraction of test labels in their set), ``test/macro_lac90``
# the per-class coverage averaged over the classes, ``test/lac90_size`` the mean set size,
# ``test/few/lac90`` the mean per-class coverage of the few-shot classes and ``test/few/lac90_size``
# the mean set size of the examples whose label is few-shot; ``test/lac_avg5_alpha`` is the level
# that the size-matched sets guarantee. The average-K sets get ``test/few/avg5_size`` beside them.
# Test split only: the calibration split is part of the validation set.

_CONFORMAL_RE = re.compile(
    r"^(?P<split>val|test|train)/(?:(?P<group>few|medium|many)/)?(?P<macro>macro_)?"
    r"(?P<score>lac|aps)(?:_(?P<mondrian>class|shot))?"
    r"(?:(?P<level>[0-9]+(?:\.[0-9]+)?)|_avg(?P<k>[0-9]+))(?P<suffix>_size|_alpha)?$"
)

CONFORMAL_FORMAT = (
    "a conformal metric such as test/lac90, test/few/aps_class90_size or test/lac_avg5 "
    "(test/[few|medium|many/][macro_]<lac|aps>[_class|_shot]<coverage %>|_avg<K>[_size])"
)


def conformal_method_name(score: str, mondrian: str) -> str:
    """``lac``, ``aps_class``, ``lac_shot``: a score and its calibration groups ("marginal",
    "class" or "shot")."""
    return score if mondrian == "marginal" else f"{score}_{mondrian}"


def conformal_level_name(alpha: float) -> str:
    """The target coverage 1 - alpha in percent, as metric names write it: 0.1 -> ``90``,
    0.025 -> ``97.5`` (rounded at 1e-6 so that 100 * 0.9 is 90)."""
    return f"{round(100.0 * (1.0 - float(alpha)), 6):g}"


def parse_conformal_metric(metric: str) -> Mapping[str, str | None] | None:
    """The parts of a conformal metric path, or None."""
    match = _CONFORMAL_RE.match(metric) if isinstance(metric, str) else None
    return match.groupdict() if match else None


def check_conformal_metric(
    metric: str, eval_section: Mapping[str, Any], splits: tuple[str, ...] = ("test",)
) -> str | None:
    """None when the trainer logs the conformal metric ``metric`` for this eval section, else why not."""
    match = parse_conformal_metric(metric)
    if not match:
        return f"expected {CONFORMAL_FORMAT}, got {metric!r}"
    if match["split"] != "test" or "test" not in splits:
        return f"conformal sets are evaluated on the test split only (test/...), got {metric!r}"
    if match["macro"] and (match["group"] or match["suffix"]):
        return f"macro_ applies to the overall coverage only (test/macro_lac90), got {metric!r}"
    if match["suffix"] == "_alpha" and (match["k"] is None or match["group"]):
        return f"_alpha is the level of the size-matched sets only (test/lac_avg5_alpha), got {metric!r}"
    from setvalued.config import EVAL_FIELDS  # the defaults of the fields a config may leave out

    def field(key: str) -> Any:
        return eval_section.get(key, EVAL_FIELDS[key].default)

    scores, mondrians = field("conformal_scores"), field("conformal_mondrian")
    if match["score"] not in scores:
        return f"{metric!r} needs {match['score']!r} in eval.conformal_scores (now {scores})"
    mondrian = match["mondrian"] or "marginal"
    if mondrian not in mondrians:
        return f"{metric!r} needs {mondrian!r} in eval.conformal_mondrian (now {mondrians})"
    if match["k"] is not None:
        if not field("conformal_match_avgk") or int(match["k"]) not in field("avgk"):
            return (
                f"{metric!r} needs eval.conformal_match_avgk: true and K={match['k']} in eval.avgk (now "
                f"{field('conformal_match_avgk')}, {field('avgk')})"
            )
        return None
    levels = [conformal_level_name(a) for a in field("conformal_alphas")]
    if match["level"] not in levels:
        return (
            f"{metric!r} needs the coverage level {match['level']}% in eval.conformal_alphas (now "
            f"{field('conformal_alphas')}, levels {levels})"
        )
    return None


# --------------------------------------------------------------------------------------------
# multi-label data (data.max_labels > 1; setvalued.metrics.multilabel)
# --------------------------------------------------------------------------------------------
#
# ``prec<K>`` and ``rec<K>``: precision and recall of the K highest scores (for every K of
# eval.ks); ``macro_rec<K>``: the per-class recall at K averaged over the classes, and
# ``few/rec<K>`` (medium, many) inside a shot group; ``rprec``: the precision of the |Y| highest
# scores (R-precision, the cardinality known as in [Gar23] §6.2.7).

_MULTILABEL_RE = re.compile(
    r"^(?P<split>val|test)/(?:(?:(?P<group>few|medium|many)/)?(?P<macro>macro_)?"
    r"(?P<kind>prec|rec)(?P<k>[0-9]+)|(?P<rprec>rprec))$"
)

MULTILABEL_FORMAT = "a multi-label metric such as val/prec5, val/rec5, val/macro_rec5, test/few/rec5 or val/rprec"


def parse_multilabel_metric(metric: str) -> Mapping[str, str | None] | None:
    """The parts of a multi-label metric path, or None."""
    match = _MULTILABEL_RE.match(metric) if isinstance(metric, str) else None
    return match.groupdict() if match else None


def is_multilabel_metric(metric: str) -> bool:
    return parse_multilabel_metric(metric) is not None


def check_multilabel_metric(
    metric: str, eval_section: Mapping[str, Any], splits: tuple[str, ...] = ("val",)
) -> str | None:
    """None when ``metric`` is a multi-label metric the trainer reports for this eval section
    (whether the data are multi-label is checked with the whole config), else why not."""
    match = parse_multilabel_metric(metric)
    if not match:
        return f"expected {MULTILABEL_FORMAT}, got {metric!r}"
    if match["split"] not in splits:
        return f"expected a {' or '.join(s + '/' for s in splits)} metric, got {metric!r}"
    if match["rprec"]:
        return None
    if match["kind"] == "prec" and (match["group"] or match["macro"]):
        return f"precision at K is not split by class; write {match['split']}/prec{match['k']}, not {metric!r}"
    if match["group"] and match["macro"]:
        return f"shot-group recalls are already macro averages: write {match['split']}/{match['group']}/rec{match['k']}"
    if int(cast(str, match["k"])) not in eval_section.get("ks", []):
        return f"{metric!r} needs K={match['k']} in eval.ks (now {eval_section.get('ks')})"
    return None
