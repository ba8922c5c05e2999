"""Which metrics are accuracies, shown in percent everywhere a person reads them (the report,
`studies.api`'s tables, the progress line of `studies run`); plain Python, so that the driver's
progress line reads the same rule without the statistics' imports."""

from __future__ import annotations

import re

_FRACTION_METRIC = re.compile(
    r"^(macro_)?(top|avg)\d+$"
    # the coverage of conformal sets (lac90, aps_class_avg5) and the multi-label precisions and
    # recalls (prec5, rec5, rprec): setvalued.metrics.names
    r"|^(macro_)?(lac|aps)(_class|_shot)?(\d+(\.\d+)?|_avg\d+)$|^(macro_)?(prec|rec)\d+$|^rprec$"
)

#: the unit of a fraction metric once scaled (`unit`)
PERCENT = "%"
#: the decimals of an accuracy in percent, as the report's tables print it
PERCENT_DIGITS = 1


def is_fraction_metric(metric: str) -> bool:
    """Accuracies in [0, 1] (`test/top5`, `val/macro_avg3`, `test/few/top1`, `test/lac90`,
    `val/rprec`): shown in percent."""
    # best_val is the selection metric's best value: always an accuracy (studies.studyfile.spec
    # accepts only top-K / average-K metrics as eval.selection)
    return metric == "best_val" or bool(_FRACTION_METRIC.match(metric.rsplit("/", 1)[-1]))


def unit(metric: str) -> str:
    """``"%"`` for a fraction metric (shown in percent), else ``""`` (as logged)."""
    return PERCENT if is_fraction_metric(metric) else ""


def shown(metric: str, value: float) -> str:
    """A value as a person reads it: an accuracy in percent (``67.3%``), else 4 significant digits."""
    if is_fraction_metric(metric):
        return f"{100.0 * value:.{PERCENT_DIGITS}f}{PERCENT}"
    return f"{value:.4g}"
