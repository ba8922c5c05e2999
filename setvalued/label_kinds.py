"""Single-label and multi-label trial configs: which losses and metrics go with which data.

Synthetic data with ``data.max_labels > 1`` give every example a set of labels (multi-hot
targets, ``setvalued.data.synthetic``); every other data set has one class per example. A
multi-label config needs a loss that takes multi-hot targets (``MULTI_LABEL_LOSSES``: the
sparse-top loss, [Gar23] eq. 6.25, and binary cross-entropy, eq. 6.3) and the multi-label
metrics (``setvalued.metrics.names``: ``prec<K>``, ``rec<K>``, ``rprec``); the top-K, average-K
and conformal metrics are defined for one label per example only, so a single-label config
selects on them and a multi-label one cannot. The multi-label losses also take class indices
(|Y| = 1: the sparsemax loss, eq. 6.12, and one-vs-all BCE), so they are not refused on
single-label data. The trainer (``setvalued.training.resolve_config``) and the study validation
(``studies.studyfile.trial_config``) read the same rule. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from setvalued.config import conformal_enabled
from setvalued.losses.parameters import MULTI_LABEL_LOSSES
from setvalued.metrics import is_multilabel_metric

__all__ = ["max_labels", "is_multi_label", "label_kind_problems"]


def max_labels(data: Mapping[str, Any]) -> int:
    """The most labels an example of this data section has (1 but for multi-label synthetic data)."""
    if data.get("name", "synthetic") != "synthetic":
        return 1
    value = data.get("max_labels")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 1


def is_multi_label(data: Mapping[str, Any]) -> bool:
    return max_labels(data) > 1


def label_kind_problems(config: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]:
    """``(dotted path as a tuple, what is wrong and what was expected)`` for every part of a
    (defaults-filled) config that does not fit its data's kind of labels; empty when it fits."""
    data, ev = config.get("data") or {}, config.get("eval") or {}
    loss = (config.get("loss") or {}).get("name")
    selection = ev.get("selection", "")
    problems: list[tuple[tuple[str, ...], str]] = []
    if is_multi_label(data):
        kind = f"data.max_labels is {max_labels(data)} (multi-label data, multi-hot targets)"
        if loss not in MULTI_LABEL_LOSSES:
            problems.append(
                (
                    ("loss", "name"),
                    f"{kind}, but loss {loss!r} takes one label per example; "
                    f"expected a multi-label loss: {', '.join(MULTI_LABEL_LOSSES)}",
                )
            )
        if ev.get("avgk"):
            problems.append(
                (
                    ("eval", "avgk"),
                    f"{kind}: average-K accuracy needs one label per example; expected [] (no average-K metrics)",
                )
            )
        if conformal_enabled(ev):
            problems.append(
                (
                    ("eval", "conformal_alphas"),
                    f"{kind}: conformal sets need one label per example; expected [] and conformal_match_avgk: false",
                )
            )
        if not is_multilabel_metric(selection):
            problems.append(
                (
                    ("eval", "selection"),
                    f"{kind}: expected a multi-label validation metric such as "
                    f"val/prec5, val/rec5 or val/rprec, got {selection!r}",
                )
            )
    elif is_multilabel_metric(selection):
        problems.append(
            (
                ("eval", "selection"),
                f"{selection!r} is a multi-label metric but the data have one "
                f"label per example (data.max_labels > 1 makes synthetic data "
                f"multi-label); expected a metric such as val/top5 or val/avg5",
            )
        )
    return problems
