"""A study's results as pandas DataFrames for a notebook (`studies.api.table`,
`studies.api.histories`): the swept parameters as columns, accuracies in percent as the report
shows them, each metric's unit stated.

Units, one choice: a fraction metric (`analysis.units.is_fraction_metric`: top-K, average-K,
coverage...) is multiplied by 100 and its unit is ``"%"``; any other metric (a loss, a set
size, a time) is as logged, unit ``""``. ``DataFrame.attrs["units"]`` maps every metric to its
unit; the long table of histories also has a ``unit`` column.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from analysis.collect import Collected, collect_histories
from analysis.plot_style import config_label
from analysis.units import PERCENT, unit


def _scale(metric: str) -> float:
    return 100.0 if unit(metric) == PERCENT else 1.0


def _swept_columns(rows: Sequence[dict]) -> list[str]:
    """The swept paths of any row, in order of first appearance."""
    return list(dict.fromkeys(path for row in rows for path in json.loads(row["swept"] or "{}")))


def _ids(row: dict, swept_paths: Sequence[str]) -> dict[str, Any]:
    """The columns that say which cell a row is: its cell and config ids, the config's label
    (the report's), variant, seed and swept values (None where the config sweeps no such
    path)."""
    swept = json.loads(row["swept"] or "{}")
    return {
        "cell": row["cell_id"] if "cell_id" in row else f"{row['config_id']}-{row['seed']}",
        "config": row["config_id"],
        "label": config_label(row),
        "variant": row["variant"],
        "seed": row["seed"],
        **{path: swept.get(path) for path in swept_paths},
    }


def _check_logged(collected: Collected, metrics: Iterable[str]) -> None:
    """KeyError naming the `metrics` that no finished cell of the study logged, and those logged."""
    missing = [m for m in metrics if m not in collected.metric_columns]
    if missing:
        raise KeyError(
            f"no metric {', '.join(missing)} in study {collected.study_name!r}; "
            f"logged: {', '.join(collected.metric_columns)}"
        )


def cells_frame(collected: Collected, metrics: Iterable[str] | None = None):
    """One row per finished cell: `_ids` and the `metrics` (default: every logged metric's
    last value), fractions in percent; ``attrs["units"]``."""
    import pandas as pd

    rows = collected.table.to_pylist()
    metrics = list(metrics) if metrics is not None else collected.metric_columns
    _check_logged(collected, metrics)
    swept_paths = _swept_columns(rows)
    records = [
        {**_ids(row, swept_paths), **{m: None if row.get(m) is None else row[m] * _scale(m) for m in metrics}}
        for row in rows
    ]
    frame = pd.DataFrame.from_records(
        records, columns=["cell", "config", "label", "variant", "seed", *swept_paths, *metrics]
    )
    frame.attrs["units"] = {m: unit(m) for m in metrics}
    return frame


def histories_frame(collected: Collected, metrics: Iterable[str]):
    """Per-epoch values of `metrics` for every finished cell, one row per (cell, metric,
    epoch): `_ids`, ``epoch`` (MLflow's step), ``metric``, ``value`` (fractions in percent),
    ``unit``; ``attrs["units"]``."""
    import pandas as pd

    metrics = list(dict.fromkeys(metrics))
    _check_logged(collected, metrics)
    long = collect_histories(collected, metrics).to_pylist()
    swept_paths = _swept_columns(long)
    cell_ids = {(r["config_id"], r["seed"]): r["cell_id"] for r in collected.table.to_pylist()}
    records = [
        {
            **_ids(
                {**r, "cell_id": cell_ids.get((r["config_id"], r["seed"]), f"{r['config_id']}-{r['seed']}")},
                swept_paths,
            ),
            "epoch": r["epoch"],
            "metric": r["metric"],
            "value": r["value"] * _scale(r["metric"]),
            "unit": unit(r["metric"]),
        }
        for r in long
    ]
    frame = pd.DataFrame.from_records(
        records,
        columns=["cell", "config", "label", "variant", "seed", *swept_paths, "epoch", "metric", "value", "unit"],
    )
    frame.attrs["units"] = {m: unit(m) for m in metrics}
    return frame
