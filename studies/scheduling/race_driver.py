"""A racing study's race on the driver: `studies.scheduling.racing.SeedRace` fed from MLflow.

The ledger stays MLflow's: the race is rebuilt from it at the start of every session (the
finished cells' values of the race metric, and the final decisions recorded by earlier
sessions in `TAG_RACE`), so no state file is needed and a resumed study keeps every decision
taken before it was interrupted. While Tune runs, the searcher asks `next_cell_ids` for work
(a cell, or with fused arrays up to ``resources.seeds_per_trial`` seeds of a config's round)
and reports every cell's end to `complete`, which reads the cell's value from its MLflow run
and records each new final decision on the run of the config's last finished seed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence

from analysis.collect import RunRecord
from analysis.layout import TAG_CELL_ID, TAG_RACE, TAG_STATUS, TAG_STUDY, tag_filter
from studies.scheduling.racing import BEST, FAILED, MAX, WORSE, RaceStatus, SeedRace
from studies.tracking import (
    STATUS_FINISHED,
    StudyTracking,
    cell_objective,
    finished_runs,
    with_retry,
)

#: what `next_cell_ids` returns once the race is over
RACE_OVER = "RACE_OVER"


def run_value(tracking: StudyTracking, run: RunRecord, metric: str) -> float:
    """A finished run's value of the race metric: as logged for a final metric (`test/...`,
    `best_val`), else at the selected epoch (`studies.tracking.cell_objective`)."""
    if metric.startswith("test/") or metric in ("best_val", "best_epoch"):
        return float(run.metrics.get(metric, math.nan))
    return cell_objective(tracking, run.run_id, metric)


class RaceDriver:
    """One session's race over a study's cells (see the module docstring)."""

    def __init__(self, study, cells: Sequence, tracking: StudyTracking):
        racing = study.racing
        self.metric = racing.until.metric
        self.tracking = tracking
        self.cells = {c.cell_id: c for c in cells}
        config_ids = list(dict.fromkeys(c.config_id for c in cells))
        self.race = SeedRace(
            config_ids, study.seed_list, racing.initial, racing.step, racing.until.mode, racing.until.level
        )
        self.run_ids: dict[str, str] = {}  # cell_id -> its finished run
        self.failed_cells: set[str] = set()

    def __getstate__(self) -> dict:
        """Tune pickles its callbacks and searcher with the experiment; the copy needs no
        tracking client (the race is rebuilt from MLflow by the next session anyway)."""
        return {**self.__dict__, "tracking": None}

    # ----- building it from MLflow ------------------------------------------------------------

    @classmethod
    def rebuild(cls, study, cells: Sequence, tracking: StudyTracking, resumable: Iterable[str] = ()) -> RaceDriver:
        """The race as MLflow has it: finished values replayed, recorded decisions kept, and the
        cells an earlier session left in flight (`resumable`, continued from a checkpoint)
        committed to their configs."""
        driver = cls(study, cells, tracking)
        grouped = tracking.cell_runs(metrics=(driver.metric,))
        for cell_id, cell in driver.cells.items():
            runs = finished_runs(grouped.get(cell_id, []))
            if not runs:
                continue
            run = runs[-1]
            driver.run_ids[cell_id] = run.run_id
            driver.race.record(cell.config_id, cell.seed, run_value(tracking, run, driver.metric))
            decision = run.tags.get(TAG_RACE)
            if decision:
                driver.race.restore(cell.config_id, parse_decision(decision))
        for cell_id in resumable:
            if cell_id in driver.cells:
                driver.race.commit(driver.cells[cell_id].config_id, driver.cells[cell_id].seed)
        driver.record_decisions()
        return driver

    def runnable(self, cell_ids: Iterable[str]) -> list[str]:
        """The cells of `cell_ids` whose config is still racing (the others never start)."""
        return [i for i in cell_ids if self.race.state(self.cells[i].config_id) not in _FINAL_BUT_FAILED]

    def not_needed(self, cell_ids: Iterable[str]) -> list[str]:
        """Cells of `cell_ids` that the race will never start (their config is decided)."""
        return [
            i
            for i in cell_ids
            if self.race.state(self.cells[i].config_id) in _FINAL_BUT_FAILED
            and i not in self.run_ids
            and i not in self.failed_cells
        ]

    # ----- while Tune runs --------------------------------------------------------------------

    def next_cell_ids(self, limit: int) -> list[str] | str:
        """The next cells to start, as one trial: the race's next cell and up to `limit` - 1
        more seeds of its config's round (a fused array, ``resources.seeds_per_trial``);
        [] when nothing may start now (a round is in flight); RACE_OVER."""
        taken = self.race.take_array(limit)
        if taken:
            return [f"{config_id}-s{seed}" for config_id, seed in taken]
        if self.race.is_over() or self.race.in_flight() == 0:
            return RACE_OVER
        return []

    def complete(self, cell_id: str, failed: bool, error: str = "") -> None:
        """A trial ended: its value (read from its MLflow run) or its failure goes to the race."""
        cell = self.cells.get(cell_id)
        if cell is None:
            return
        run = None if failed else self._finished_run(cell_id)
        if run is None:
            self.failed_cells.add(cell_id)
            self.race.fail(cell.config_id, cell.seed, error or "the cell did not finish")
        else:
            self.run_ids[cell_id] = run.run_id
            self.race.record(cell.config_id, cell.seed, run_value(self.tracking, run, self.metric))
        self.record_decisions()

    def _finished_run(self, cell_id: str):
        """The finished run of a cell (one indexed search) with the race metric, or None."""
        from mlflow.entities import ViewType

        wanted = {TAG_CELL_ID: cell_id, TAG_STUDY: self.tracking.study_name, TAG_STATUS: STATUS_FINISHED}
        runs = with_retry(
            lambda: self.tracking.client.search_runs(
                [self.tracking.experiment_id],
                run_view_type=ViewType.ACTIVE_ONLY,
                filter_string=tag_filter(wanted),
                max_results=5,
            )
        )
        return RunRecord.of(runs[0]) if runs else None

    def record_decisions(self) -> None:
        """Each new final decision (but a failure, which a resumed study retries) as `TAG_RACE`
        on the run of the config's last finished seed."""
        for config_id, status in self.race.pop_decisions():
            if status.state == FAILED:
                continue
            last = None
            for seed in self.race.seeds:
                run_id = self.run_ids.get(f"{config_id}-s{seed}")
                if run_id is not None:
                    last = run_id
            if last is not None:
                value = status.to_json(self.race.max_seeds)
                with_retry(lambda: self.tracking.client.set_tag(last, TAG_RACE, value))

    # ----- what the progress line and the summary say ----------------------------------------

    def upper_bound_left(self) -> int:
        return self.race.upper_bound_left()

    def summary(self) -> str:
        return self.race.summary()


_FINAL_BUT_FAILED = (WORSE, BEST, MAX)  # decided: the config runs no more seeds


def parse_decision(text: str) -> RaceStatus:
    """A `TAG_RACE` value back as a RaceStatus."""
    data: Mapping = json.loads(text)
    return RaceStatus(
        int(data["seeds"]), str(data["state"]), str(data.get("reason", "")), data.get("p_holm"), data.get("best")
    )
