"""Published numbers (the study file's `reference` block) matched to the configs of a study.

The tables print a published number beside the reproduced one when a `reference.rows` entry
describes the config: same variant (when the row names one) and the values of its `match`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from analysis.collect import PARAM_PREFIX
from analysis.formatting import decimals, format_mean_ci
from analysis.report_schema import Reference, ReferenceRow
from analysis.results import swept_of


def row_matches(ref: ReferenceRow, row: Mapping[str, Any]) -> bool:
    """Whether a `reference.rows` entry describes this config (its variant and `match`)."""
    if ref.variant is not None and ref.variant != row.get("variant"):
        return False
    for path, expected in ref.match.items():
        actual = row.get(PARAM_PREFIX + path, swept_of(row).get(path))
        if isinstance(expected, (int, float)) and not isinstance(expected, bool) \
                and isinstance(actual, (int, float)) and not isinstance(actual, bool):
            if not math.isclose(float(actual), float(expected), rel_tol=1e-9, abs_tol=1e-12):
                return False
        elif actual != expected:
            return False
    return True


def published_value(reference: Reference | None, row: Mapping[str, Any], metric: str
                    ) -> tuple[str, str] | None:
    """(text, source) of the published number for this config and metric, if any; the
    text keeps the decimals the source wrote (at least one)."""
    for ref in reference.rows if reference is not None else []:
        if not row_matches(ref, row) or metric not in ref.metrics:
            continue
        value = ref.metrics[metric]
        ci = ref.ci.get(metric)
        digits = max(1, decimals(value), decimals(ci) if ci is not None else 0)
        text = format_mean_ci(value, ci if ci is not None else math.nan, digits)
        return text, reference.source or "reference"
    return None


def unmatched_rows(reference: Reference | None, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Notes on the reference rows that no finished config matches (a typo in `match`, or
    a config that was not run): their numbers are not shown anywhere."""
    notes = []
    configs = list({r["config_id"]: r for r in rows}.values())
    for i, ref in enumerate(reference.rows if reference is not None else []):
        if not any(row_matches(ref, row) for row in configs):
            notes.append(f"Reference row {i} ({ref.variant}, match {ref.match or {}}) matches "
                         f"no finished config: its numbers are not shown.")
    return notes
