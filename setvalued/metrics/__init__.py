"""Metrics of set-valued classifiers: top-K and average-K accuracy, set sizes, class groups
(``accuracy``), multi-label ranking metrics (``multilabel``), split conformal prediction sets
(``conformal``, ``conformal_sets``) and the grammar of the metric names the trainer logs
(``names``).

The package's public names are read from it (``from setvalued.metrics import evaluate``) and
load their module on first use: ``setvalued.metrics.names`` stays importable without torch, as
the study file's validation needs (tests/test_layers.py).
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> the module of this package that defines it
_HOME = {
    **dict.fromkeys(
        [
            "DEFAULT_SHOT_THRESHOLDS",
            "SHOT_GROUPS",
            "activate",
            "label_rank",
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
        ],
        "accuracy",
    ),
    **dict.fromkeys(["label_ranks", "multilabel_evaluate", "per_class_recall"], "multilabel"),
    **dict.fromkeys(
        [
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
        ],
        "names",
    ),
    **dict.fromkeys(
        [
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
        ],
        "conformal_sets",
    ),
    **dict.fromkeys(
        ["MatchedLevel", "match_average_size", "ConformalMethod", "conformal_metrics", "set_metrics"], "conformal"
    ),
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'setvalued.metrics' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
