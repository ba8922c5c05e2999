"""The names of the metrics the trainer reports, and a check that a name is one of them.

Metric names are paths: ``split/[few|medium|many/][macro_]top<K>|avg<K>`` (``val/top5``,
``test/macro_top5``, ``val/few/top5``, ``val/avg5``), the running training accuracy
``train/top<K>``, and the per-epoch extras below. Pure Python.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

__all__ = ["METRIC_FORMAT", "PER_EPOCH_EXTRA_METRICS", "check_metric", "parse_metric"]

_METRIC_RE = re.compile(r"^(?P<split>val|test|train)/(?:(?P<group>few|medium|many)/)?"
                        r"(?P<macro>macro_)?(?P<kind>top|avg)(?P<k>[0-9]+)$")

METRIC_FORMAT = ("a metric path such as val/top5, val/macro_top5, val/few/top5 or val/avg5 "
                 "(split/[few|medium|many/][macro_]top<K>|avg<K>)")

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
        return f"shot-group metrics are already macro averages: write {match['split']}/{match['group']}/" \
               f"{match['kind']}{match['k']}, not {metric!r}"
    k = int(match["k"])
    if match["kind"] == "top" and k not in eval_section.get("ks", []):
        return f"{metric!r} needs K={k} in eval.ks (now {eval_section.get('ks')})"
    if match["kind"] == "avg" and k not in eval_section.get("avgk", []):
        return f"{metric!r} needs K={k} in eval.avgk (now {eval_section.get('avgk')})"
    return None
