"""The order in which a study's cells become Tune trials: config by config, as slots free up.

The cells are materialised by the project (`studies.cells.space.expand`: every config paired with
the same seeds), never by Ray's `tune.grid_search` over the study's parameters: Tune draws
the random dimensions of a search space again for every grid point (Ray Tune documentation
of `tune.grid_search`), so the seeds of one config would not share its values. Tune gets
one opaque `cell_id` per trial from a searcher over a `CellQueue`
(`studies.running.tune_experiment.CellQueueSearcher`). A searcher, rather than a grid over the ids,
creates each trial just when a slot is free (with `max_concurrent_trials` equal to the
trials that fit at once), so trials start exactly in config-major order: the seeds of a
config start together, and at most one config at a time is partly started. Early stopping
relies on this (the seeds of a config wait for each other at every epoch; see
`studies.scheduling`).

Plain Python: no Ray here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence


def config_major(cells: Sequence) -> list:
    """Cells grouped by config (first appearance order), seeds in order inside a config."""
    order: dict[str, int] = {}
    for cell in cells:
        order.setdefault(cell.config_id, len(order))
    return sorted(cells, key=lambda c: (order[c.config_id], c.seed))


class CellQueue:
    """The cell ids to hand out, in order, one per call of `next`."""

    def __init__(self, cell_ids: Sequence[str]):
        self.cell_ids = list(cell_ids)
        self.position = 0

    def next(self) -> str | None:
        """The next cell id; None once every cell was handed out."""
        if self.position >= len(self.cell_ids):
            return None
        cell_id = self.cell_ids[self.position]
        self.position += 1
        return cell_id

    def to_json(self) -> str:
        """The queue's state (what Tune's experiment checkpoint keeps of the searcher)."""
        return json.dumps({"cell_ids": self.cell_ids, "position": self.position})

    @classmethod
    def from_json(cls, text: str) -> CellQueue:
        state = json.loads(text)
        queue = cls(state["cell_ids"])
        queue.position = int(state["position"])
        return queue
