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
from typing import Mapping, Optional, Sequence

__all__ = ["METRIC_FORMAT", "PER_EPOCH_EXTRA_METRICS", "check_metric", "parse_metric", "count_bins"]

_METRIC_RE = re.compile(r"^(?P<split>val|test|train)/(?:(?P<group>few|medium|many|count_[0-9]+_(?:[0-9]+|inf))/)?"
                        r"(?P<macro>macro_)?(?P<kind>top|avg)(?P<k>[0-9]+)$")

METRIC_FORMAT = ("a metric path such as val/top5, val/macro_top5, val/few/top5, test/count_10_50/top1 or "
                 "val/avg5 (split/[few|medium|many|count_<low>_<high>/][macro_]top<K>|avg<K>)")


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

#: Per-epoch metrics of the trainer besides the val/ and train/ accuracies (docs/interfaces.md
#: section 4).
PER_EPOCH_EXTRA_METRICS = ("train/loss", "lr", "epoch_time_s", "eval_time_s", "grad_nonzero",
                           "grad_nonzero_active")


def parse_metric(metric: str) -> Optional[Mapping[str, Optional[str]]]:
    """The parts of an accuracy metric path (split, group, macro, kind, k), or None."""
    match = _METRIC_RE.match(metric) if isinstance(metric, str) else None
    return match.groupdict() if match else None


def check_metric(metric: str, eval_section: Mapping, splits: tuple[str, ...] = ("val",)) -> Optional[str]:
    """None when ``metric`` is a metric the trainer reports for this eval section, else why not."""
    if not isinstance(metric, str):
        return f"expected {METRIC_FORMAT}, got {metric!r}"
    if splits == ("val", "test", "train") and metric == "train/loss":
        return None
    match = parse_metric(metric)
    if not match:
        return f"expected {METRIC_FORMAT}, got {metric!r}"
    if match["split"] not in splits:
        return f"expected a {' or '.join(s + '/' for s in splits)} metric, got {metric!r}"
    if match["split"] == "train" and (match["group"] or match["macro"] or match["kind"] != "top"):
        return f"training metrics are the running top-K accuracy only (train/top<K>), got {metric!r}"
    if match["group"] and match["macro"]:
        return f"group metrics are already macro averages: write {match['split']}/{match['group']}/" \
               f"{match['kind']}{match['k']}, not {metric!r}"
    group = match["group"]
    if group and group.startswith("count_"):
        names = [name for name, _, _ in count_bins(eval_section.get("count_bins") or [])]
        if group not in names:
            return (f"{metric!r} needs the bin {group} in eval.count_bins (now "
                    f"{eval_section.get('count_bins') or []}, bins: {', '.join(names) or 'none'})")
    k = int(match["k"])
    if match["kind"] == "top" and k not in eval_section.get("ks", []):
        return f"{metric!r} needs K={k} in eval.ks (now {eval_section.get('ks')})"
    if match["kind"] == "avg" and k not in eval_section.get("avgk", []):
        return f"{metric!r} needs K={k} in eval.avgk (now {eval_section.get('avgk')})"
    return None
