"""Published numbers (the study file's `reference` block) matched to the configs of a study.

The tables print a published number beside the reproduced one when a `rows` entry of a source
describes the config: same variant (when the row names one) and the values of its `match`.
Each source has its own column, headed by its label ("test/top5 (paper)" for the one-source
form, "test/top5 ([GSJS22])" for a source labelled [GSJS22]), and its numbers print as the
file writes them (`68.20 ± 0.07`, `65`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from analysis.collect import PARAM_PREFIX
from analysis.published_number import PublishedNumber
from analysis.report_schema import Reference, ReferenceRow
from analysis.results import swept_of


def row_matches(ref: ReferenceRow, row: Mapping[str, Any]) -> bool:
    """Whether a `reference` rows entry describes this config (its variant and `match`)."""
    if ref.variant is not None and ref.variant != row.get("variant"):
        return False
    for path, expected in ref.match.items():
        actual = row.get(PARAM_PREFIX + path, swept_of(row).get(path))
        if (
            isinstance(expected, (int, float))
            and not isinstance(expected, bool)
            and isinstance(actual, (int, float))
            and not isinstance(actual, bool)
        ):
            if not math.isclose(float(actual), float(expected), rel_tol=1e-9, abs_tol=1e-12):
                return False
        elif actual != expected:
            return False
    return True


def published_text(value: PublishedNumber, ci: PublishedNumber | None) -> str:
    """`94.24`, or `94.2 ± 0.1` with its interval: each number as the source wrote it."""
    return value.text if ci is None else f"{value.text} ± {ci.text}"


def published_value(source: Reference, row: Mapping[str, Any], metric: str) -> str | None:
    """The text of the source's published number for this config and metric, if any."""
    for ref in source.rows:
        if row_matches(ref, row) and metric in ref.metrics:
            return published_text(ref.metrics[metric], ref.ci.get(metric))
    return None


def column_header(name: str, source: Reference) -> str:
    """The header of a source's column beside the column `name`: "test/top5 (paper)"."""
    return f"{name} ({source.label})"


def sources_caption(sources: Sequence[Reference]) -> str:
    """The caption sentence saying where each published column comes from."""
    return "".join(f" ({s.label}): published numbers from {s.source}." for s in sources)


def unmatched_rows(sources: Sequence[Reference], rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Notes on the reference rows, of every source, that no finished config matches (a typo
    in `match`, or a config that was not run): their numbers are not shown anywhere."""
    notes = []
    configs = list({r["config_id"]: r for r in rows}.values())
    for source in sources:
        named = "Reference row" if len(sources) == 1 else f"Reference {source.label}, row"
        for i, ref in enumerate(source.rows):
            if not any(row_matches(ref, row) for row in configs):
                notes.append(
                    f"{named} {i} ({ref.variant}, match {ref.match or {}}) matches "
                    f"no finished config: its numbers are not shown."
                )
    return notes
