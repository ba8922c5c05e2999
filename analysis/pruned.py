"""Configs pruned by ASHA or an Optuna pruner, in the report.

A pruned config (its cells tagged `studies.pruned`, all at the same `studies.stopped_epoch`)
trained fewer epochs than the others: its numbers are not comparable with theirs, so the
report leaves it out of every table and figure and says so in a note, unless the study file
asks for it (`report: {show_pruned: true}`), in which case the note names it.
Early-stopped configs (`studies.stopped_epoch` without `studies.pruned`) are results of
their protocol and stay.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc

from analysis.collect import Collected


def pruned_configs(table: pa.Table) -> dict[str, tuple[str, int | None]]:
    """config_id -> (rule, stop epoch) of every pruned config of the finished cells."""
    if "pruned" not in table.column_names:
        return {}
    out: dict[str, tuple[str, int | None]] = {}
    for row in table.select(["config_id", "pruned", "stopped_epoch"]).to_pylist():
        if row["pruned"]:
            out.setdefault(row["config_id"], (row["pruned"], row["stopped_epoch"]))
    return out


def pruned_note(pruned: dict[str, tuple[str, int | None]], shown: bool) -> str:
    """'2 configs pruned (asha): 1 at epoch 1, 1 at epoch 2; not shown ...'."""
    rules = ", ".join(sorted({rule for rule, _ in pruned.values()}))
    epochs = Counter(epoch for _, epoch in pruned.values())
    at = ", ".join(
        f"{n} at epoch {epoch}" for epoch, n in sorted(epochs.items(), key=lambda item: (item[0] is None, item[0] or 0))
    )
    head = f"{len(pruned)} config{'s' if len(pruned) != 1 else ''} pruned ({rules}): {at}"
    if shown:
        return (
            f"{head}; shown (`report: {{show_pruned: true}}`), though they trained fewer "
            f"epochs: {', '.join(sorted(pruned))}."
        )
    return f"{head}; not shown (`report: {{show_pruned: true}}` shows them)."


def leave_out_pruned(collected: Collected, show: bool) -> tuple[Collected, str | None]:
    """The collected cells without the pruned configs (all of them when `show`), and the
    note that says what was left out or kept (None when nothing was pruned)."""
    pruned = pruned_configs(collected.table)
    if not pruned:
        return collected, None
    if show:
        return collected, pruned_note(pruned, shown=True)
    keep = pc.invert(
        pc.is_in(collected.table.column("config_id"), value_set=pa.array(sorted(pruned), type=pa.string()))
    )
    return dataclasses.replace(collected, table=collected.table.filter(keep)), pruned_note(pruned, shown=False)
