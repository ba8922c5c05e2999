"""No two configs that look the same: the collected rows' labels, completed where they collide.

A config is labelled everywhere (tables, legends, comparisons) by its variant and its
``swept`` values. Two configs can share both: the runs of two versions of a study kept on
purpose (`studies run --new-version`), or configs of one variant that differ in a parameter
no design sweeps. `tell_apart` completes the ``swept`` column of the collected table so that
no two configs share a label:

- a study of several versions: every row gets ``version`` (its version's first 7 hex
  digits; a run made before versions were recorded belongs to the first) in ``swept`` and as a
  ``param:version`` column, so that the version splits tables,
  curves and the comparisons' contexts like any parameter (a comparison, and so Holm's
  family, never spans versions: `analysis.stats`); a config id that two versions share is
  qualified with the version (``<config_id>-v<version>``) so that their seeds are never pooled;
- configs of one variant (and version) whose ``swept`` values are equal get, in ``swept``,
  every parameter in which they differ.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

__all__ = ["VERSION_COLUMN", "VERSION_PARAM", "tell_apart", "short_version", "versions_of"]

#: the collected table's column of each run's study version (tag `studies.version`)
VERSION_COLUMN = "version"
#: the label a version gets among a config's swept values and its parameters (`param:version`)
VERSION_PARAM = "version"
_PARAM = "param:"  # analysis.collect.PARAM_PREFIX (collect imports this module)


def short_version(version: Any) -> str:
    """A version as tables and legends show it: its first 7 hex digits."""
    return str(version)[:7]


def versions_of(table: pa.Table) -> list[str]:
    """The versions of the study among the rows, in the order they first ran."""
    if VERSION_COLUMN not in table.column_names or table.num_rows == 0:
        return []
    pairs = zip(
        table.column(VERSION_COLUMN).to_pylist(),
        table.column("start_time").to_pylist() if "start_time" in table.column_names else range(table.num_rows),
    )
    first: dict[str, Any] = {}
    for version, start in pairs:
        if version and (version not in first or (start or 0) < (first[version] or 0)):
            first[version] = start
    return sorted(first, key=lambda v: (first[v] or 0, v))


def tell_apart(table: pa.Table) -> pa.Table:
    """`table` (`analysis.collect`'s finished cells) with labels that set every config apart
    (module docstring); unchanged when they already do."""
    if table.num_rows == 0:
        return table
    several = len(versions_of(table)) > 1
    if not several and not _labels_collide(table):
        return table  # the common case, read from three columns only
    rows = table.to_pylist()
    if several:  # runs made before versions were recorded: the first version's
        first = versions_of(table)[0]
        for row in rows:
            row[VERSION_COLUMN] = row.get(VERSION_COLUMN) or first
    swept = [json.loads(r.get("swept") or "{}") for r in rows]
    config_ids = [r["config_id"] for r in rows]
    if several:
        versions_per_config: dict[str, set] = {}
        for row in rows:
            versions_per_config.setdefault(row["config_id"], set()).add(row.get(VERSION_COLUMN))
        for i, row in enumerate(rows):
            label = short_version(row[VERSION_COLUMN])
            swept[i][VERSION_PARAM] = label
            suffix = f"-v{label}"
            if len(versions_per_config[row["config_id"]]) > 1 and not config_ids[i].endswith(suffix):
                config_ids[i] += suffix
    # configs that still read alike: (variant, swept) shared by several config ids
    first_row: dict[str, int] = {}
    for i, config in enumerate(config_ids):
        first_row.setdefault(config, i)
    alike: dict[tuple, list[str]] = {}
    for config, i in first_row.items():
        key = (rows[i].get("variant"), json.dumps(swept[i], sort_keys=True))
        alike.setdefault(key, []).append(config)
    params = [c for c in table.column_names if c.startswith(_PARAM)]
    extra: dict[str, dict] = {}
    for configs in alike.values():
        if len(configs) < 2:
            continue
        firsts = [rows[first_row[c]] for c in configs]
        differing = [p for p in params if len({json.dumps(r.get(p), sort_keys=True) for r in firsts}) > 1]
        for config, row in zip(configs, firsts):
            extra[config] = {p[len(_PARAM) :]: row.get(p) for p in differing}
    changed = several or bool(extra)
    if not changed:
        return table
    for i, config in enumerate(config_ids):
        swept[i].update(extra.get(config, {}))
    out = table
    out = _replace(
        out,
        "swept",
        pa.array([json.dumps(s, sort_keys=True, separators=(",", ":"), default=str) for s in swept], pa.string()),
    )
    out = _replace(out, "config_id", pa.array(config_ids, pa.string()))
    if several:
        out = _replace(out, VERSION_COLUMN, pa.array([r[VERSION_COLUMN] for r in rows], pa.string()))
        out = _replace(
            out, _PARAM + VERSION_PARAM, pa.array([short_version(r[VERSION_COLUMN]) for r in rows], pa.string())
        )
    return out


def _labels_collide(table: pa.Table) -> bool:
    """Whether two configs share their variant and swept values."""
    seen: dict[tuple, str] = {}
    done: set = set()
    columns = [table.column(c).to_pylist() for c in ("config_id", "variant", "swept")]
    for config, variant, swept in zip(*columns):
        if config in done:  # a config's seeds share its labels: one look per config
            continue
        done.add(config)
        key = (variant, json.dumps(json.loads(swept or "{}"), sort_keys=True))
        if seen.setdefault(key, config) != config:
            return True
    return False


def _replace(table: pa.Table, name: str, column: pa.Array) -> pa.Table:
    if name in table.column_names:
        return table.set_column(table.column_names.index(name), name, column)
    return table.append_column(name, column)
