"""What the MLflow UI shows of a study, from its study file and cells: the view its experiment
holds (`analysis.layout.cell_runs_view`: the swept parameters' and the report's metrics'
columns, their charts, the learning curve of the selection metric) and the colour of each
config's runs (the report's, `analysis.colors`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from analysis.colors import config_colors
from analysis.layout import TAG_CONFIG_ID, TAG_VARIANT, TAG_VERSION, cell_runs_view


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def numeric_swept_paths(cells: Iterable[Any]) -> list[str]:
    """The swept paths, in the study's order, that take at least two numeric values (a chart
    can put them on its x axis)."""
    values: dict[str, set[str]] = {}
    for cell in cells:
        for path, value in cell.swept.items():
            seen = values.setdefault(path, set())
            if _is_number(value):
                seen.add(json.dumps(value))
    return [path for path, seen in values.items() if len(seen) > 1]


def report_metrics(study: Any, selection: str | None) -> list[str]:
    """The metrics of the study's report tables (``report.tables``), else `selection`."""
    tables = study.report.tables or []
    metrics = list(dict.fromkeys(m for table in tables for m in table.metrics))
    return metrics or ([selection] if selection else [])


def selection_metric(study: Any, cells: Sequence[Any]) -> str | None:
    """The validation metric that picks a cell's checkpoint (``eval.selection``), else the
    objective's."""
    for cell in cells:
        metric = (cell.config.get("eval") or {}).get("selection")
        if metric:
            return metric
    return study.objective.metric if study.objective else None


def study_view(study: Any, cells: Sequence[Any]) -> dict[str, Any]:
    """The view of the study's cell runs that its experiment holds."""
    selection = selection_metric(study, cells)
    return cell_runs_view(
        swept=numeric_swept_paths(cells),
        metrics=report_metrics(study, selection),
        curve_metric=selection,
        runs=len(cells),
    )


def run_colors(
    configs_by_variant: Mapping[str, Iterable[str]],
    variant_order: Sequence[str],
    earlier: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, str]:
    """``{config_id: colour}`` of the configs known so far (`configs_by_variant`: variant ->
    its config ids, in the order they came): the report's colours. `earlier`: the configs of
    the study's other versions kept in its experiment (`other_version_configs`), which take
    the first shades, so that no config of this version has the colour of one of theirs."""
    merged = {v: list(ids) for v, ids in (earlier or {}).items()}
    for variant, ids in configs_by_variant.items():
        merged.setdefault(variant, []).extend(i for i in ids if i not in merged[variant])
    return config_colors(merged, variant_order)


def other_version_configs(runs: Iterable[Any], version: str) -> dict[str, list[str]]:
    """variant -> the config ids of the cell `runs` (records with ``tags`` and ``start_time``)
    of the study's versions that ran before `version` did, in the order they first ran (so a
    version's colours never change once its first cell ran); none when `version` is empty (a
    run outside a versioned study). A run without a version tag is of `version`."""
    if not version:
        return {}
    first: dict[tuple[str, str], int] = {}
    start = None  # when this version's first cell ran
    for run in runs:
        tags, when = run.tags, run.start_time or 0
        if not tags.get(TAG_CONFIG_ID):
            continue
        if tags.get(TAG_VERSION, version) == version:
            start = when if start is None else min(start, when)
            continue
        key = (tags.get(TAG_VARIANT, ""), tags[TAG_CONFIG_ID])
        first[key] = min(first.get(key, when), when)
    out: dict[str, list[str]] = {}
    for variant, config_id in sorted(first, key=first.__getitem__):
        if start is None or first[(variant, config_id)] < start:
            out.setdefault(variant, []).append(config_id)
    return out
