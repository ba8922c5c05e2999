"""Optuna designs ask for a config when a trial slot frees up and tell its seed mean when its
last seed ends (studies.scheduling.optuna_rounds.OptunaProposals), without Ray: the proposal source is
driven as Tune's searcher drives it."""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pytest

from studies.scheduling.optuna_rounds import OptunaProposals
from studies.tracking import STATUS_FINISHED
from tests.test_space import study_from


class LedgerOfValues:
    """The two reads the proposals make of MLflow, over a dict: run id -> (status, value)."""

    def __init__(self):
        self.runs: dict[str, tuple[str, float]] = {}

    def tags_of_run(self, run_id):
        return {"studies.status": self.runs[run_id][0]}

    def run_metrics(self, run_id):
        return {"test/top1": self.runs[run_id][1]}


def proposals_for(
    tmp_path: Path, n_configs: int, space: str = "{loguniform: [1.0e-4, 1.0]}"
) -> tuple[OptunaProposals, LedgerOfValues]:
    study = study_from(
        tmp_path,
        f"""\
        design:
          - kind: optuna
            n_configs: {n_configs}
            sampler: random
            sampler_seed: 3
            parameters:
              optim.lr: {space}
        seeds: [0, 1]
        objective: {{metric: test/top1, mode: max}}
        """,
    )
    ((index, block),) = study.optuna_blocks
    ledger = LedgerOfValues()
    return OptunaProposals(
        study, index, block, study_name="s", study_dir=tmp_path, smoke_epochs=0, tracking=ledger
    ), ledger


def finish(proposals, ledger, cell, value, status=STATUS_FINISHED):
    run_id = f"run-{cell.cell_id}"
    ledger.runs[run_id] = (status, value)
    proposals.cell_ended(cell.cell_id, run_id)


def test_a_config_is_told_its_seed_mean_when_its_last_seed_ends(tmp_path):
    proposals, ledger = proposals_for(tmp_path, n_configs=3)
    first = proposals.propose()
    assert [c.seed for c in first] == [0, 1] and len({c.config_id for c in first}) == 1
    second = proposals.propose()  # a slot freed before the first config ended: ask again
    finish(proposals, ledger, first[0], 0.5)
    trials = proposals.ostudy.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [optuna.trial.TrialState.RUNNING] * 2  # one seed left
    finish(proposals, ledger, first[1], 0.7)
    assert proposals.ostudy.trials[0].value == pytest.approx(0.6)  # told at once
    assert proposals.ostudy.trials[1].state == optuna.trial.TrialState.RUNNING
    finish(proposals, ledger, second[0], 0.1)
    finish(proposals, ledger, second[1], math.nan)  # a missing metric: the config FAILs
    assert proposals.ostudy.trials[1].state == optuna.trial.TrialState.FAIL
    third = proposals.propose()
    assert third is not None and proposals.propose() is None  # n_configs asked
    assert proposals.max_cells == 0


def test_a_config_asked_twice_waits_for_the_cells_already_under_way(tmp_path):
    proposals, ledger = proposals_for(tmp_path, 4, "{choice: [0.1]}")  # always the same
    first = proposals.propose()
    again = proposals.propose()
    assert len(first) == 2 and again == []  # nothing new to start: the cells are running
    finish(proposals, ledger, first[0], 0.4)
    finish(proposals, ledger, first[1], 0.6)
    values = [t.value for t in proposals.ostudy.trials]
    assert values == [pytest.approx(0.5), pytest.approx(0.5)]  # both told by the same cells


def test_trials_left_running_by_a_killed_driver_are_replayed_first(tmp_path):
    proposals, ledger = proposals_for(tmp_path, n_configs=3)
    lost = proposals.propose()  # the driver dies with this config running
    resumed, ledger = proposals_for(tmp_path, n_configs=3)
    replay = resumed.propose()
    assert [c.cell_id for c in replay] == [c.cell_id for c in lost]
    finish(resumed, ledger, replay[0], 0.2)
    finish(resumed, ledger, replay[1], 0.4)
    assert resumed.ostudy.trials[0].value == pytest.approx(0.3)
    assert resumed.propose() is not None and resumed.propose() is not None
    assert resumed.propose() is None and len(resumed.ostudy.trials) == 3
