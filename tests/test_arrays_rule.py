"""One rule for fused arrays and Tune experiments (issue 41): `studies plan` deals to its slots
exactly the trials and experiments the runner starts, for resumed cells (arrays of one starting
epoch), raced cells (arrays of one round), cells in any order, and studies larger than one
experiment (the size counted in trials, not cells)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

import studies.cells.arrays as arrays
from studies.cells.arrays import experiment_parts, fused_arrays
from studies.planning.estimate import experiments


def cell(config: int, seed: int) -> SimpleNamespace:
    return SimpleNamespace(config_id=f"c{config}", seed=seed, cell_id=f"c{config}-s{seed}")


class RecordingSession:
    """`StudySession.run_cells` with Ray left out: what it hands each Tune experiment."""

    def __init__(self, per_trial: int, start_epochs: dict[str, int]):
        from studies.running.checkpoints import ResumePoints

        self.study = SimpleNamespace(resources=SimpleNamespace(cpus=1, gpus=0, seeds_per_trial=per_trial))
        self.race, self.concurrency, self.started = None, 2, []
        self.resume = ResumePoints({c: ("folder", {"epoch": e, "run_id": "r"}) for c, e in start_epochs.items()})
        self.namer = SimpleNamespace(names=lambda cells: {c.cell_id: c.cell_id for c in cells})
        self.ray = SimpleNamespace(gpu_sharing=lambda gpus, slots: 0)
        self.say = lambda text: None
        self.running_line = lambda cells, per_trial: ""

    def payload(self, cell, names, resume_from):
        return {"cell_id": cell.cell_id}

    def experiment(self, searcher, cells, **kwargs):
        self.started.append(searcher.payloads)


def runner_trials(cells, per_trial, start_epochs):
    """The trials (sorted cell ids each) of every experiment the runner's session starts."""
    from studies.running.session import StudySession

    session = RecordingSession(per_trial, start_epochs)
    session.array_payloads = StudySession.array_payloads
    StudySession.run_cells(session, cells, total=len(cells), done_before=0)
    out = []
    for payloads in session.started:
        part = []
        for trial, payload in payloads.items():
            members = payload.get("members") if isinstance(payload, dict) else None
            part.append(sorted(m["cell_id"] for m in members) if members else [trial])
        out.append(part)
    return out


def plan_trials(cells, per_trial, start_epochs):
    return [
        [sorted(cells[i].cell_id for i in trial) for trial in part]
        for part in experiments(cells, per_trial, None, start_epochs)
    ]


@pytest.mark.parametrize("trial", range(40))
def test_the_plan_deals_the_runners_trials_and_experiments(trial, monkeypatch):
    rng = random.Random(trial)
    monkeypatch.setattr(arrays, "MAX_TRIALS_PER_EXPERIMENT", rng.choice([2, 3, 5, 1000]))
    cells = [cell(c, s) for c in range(rng.randint(1, 5)) for s in range(rng.randint(1, 6))]
    rng.shuffle(cells)  # not in config order
    per_trial = rng.choice([1, 2, 3, 4])
    starts = {c.cell_id: rng.choice([2, 5]) for c in cells if rng.random() < 0.3}  # resumed cells
    assert plan_trials(cells, per_trial, starts) == runner_trials(cells, per_trial, starts)


def test_resumed_cells_share_arrays_only_with_cells_of_their_starting_epoch():
    cells = [cell(0, s) for s in range(5)]
    parts = plan_trials(cells, 4, {"c0-s1": 3, "c0-s3": 3})
    assert parts == [[["c0-s0", "c0-s2", "c0-s4"], ["c0-s1", "c0-s3"]]]


def test_a_races_arrays_hold_one_round_each():
    cells = [cell(0, s) for s in range(6)]
    rounds = {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 2}
    trials = [[c.seed for c in a] for a in fused_arrays(cells, 2, round_of=lambda c: rounds[c.seed])]
    assert trials == [[0, 1], [2], [3, 4], [5]]
    positions = experiments(cells, 2, lambda c: rounds[c.seed])
    assert positions == [[[0, 1], [2], [3, 4], [5]]]


def test_an_experiments_size_is_counted_in_trials():
    """4,000 cells at 4 seeds a trial are 1,000 trials: one experiment for the runner and the
    plan alike (the plan used to count cells and cut 4)."""
    cells = [cell(c, s) for c in range(1000) for s in range(4)]
    parts = experiment_parts(cells, 4)
    assert len(parts) == 1 and len(parts[0]) == 1000
    assert len(experiments(cells, 4)) == 1
    assert len(experiments(cells + [cell(1000, 0)], 4)) == 2


def test_an_array_takes_the_resources_of_the_trials_it_replaces():
    """Issue 42: an array of N asked for one trial's CPUs and GPU share; it takes its members'
    CPUs (up to the largest node's) and GPU shares (up to one GPU), or `per_array`'s."""
    from studies.cells.arrays import trial_resources
    from studies.studyfile.study import Resources

    assert trial_resources(Resources(cpus=2, gpus=0.25)) == (2, 0.25)  # a cell's trial
    eight = Resources(cpus=1, gpus=0.25, seeds_per_trial=8)
    assert trial_resources(eight, 8, node_cpus=16) == (8, 1.0)
    assert trial_resources(eight, 8, node_cpus=2) == (2, 1.0)  # up to what a node has
    assert trial_resources(eight, 3, node_cpus=16) == (3, 0.75)  # the rest array: its own members
    assert trial_resources(Resources(cpus=4, gpus=1, seeds_per_trial=4), 4, node_cpus=2) == (4, 1)  # never below one
    assert trial_resources(Resources(cpus=1, gpus=2, seeds_per_trial=4), 4) == (4, 2)  # whole GPUs: a member's
    own = Resources(cpus=1, gpus=0.25, seeds_per_trial=8, per_array={"cpus": 3})
    assert trial_resources(own, 8, node_cpus=16) == (3, 1.0)
    assert trial_resources(Resources(seeds_per_trial=2, per_array={"cpus": 1, "gpus": 0.5}), 2) == (1, 0.5)


def test_the_plan_counts_the_slots_of_arrays_by_their_resources():
    """`studies plan` deals arrays to as many slots as the runner: arrays of their members' CPUs."""
    from studies.planning.estimate import trial_slots
    from studies.studyfile.study import Resources

    study = SimpleNamespace(resources=Resources(cpus=1, seeds_per_trial=4), max_concurrent=None)
    assert trial_slots(study, None, cpus=8)[0] == 2
    study = SimpleNamespace(resources=Resources(cpus=1, seeds_per_trial=4, per_array={"cpus": 1}), max_concurrent=None)
    assert trial_slots(study, None, cpus=8)[0] == 8
