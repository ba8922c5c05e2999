"""Fused arrays under racing and optuna blocks (issue 35, ``resources.seeds_per_trial``).

Fast: a race hands out each round of a config's seeds as arrays (the rest of a round a smaller
array), the dry run and `studies plan` cut the same arrays; the race's and the optuna block's
Tune searchers hand out arrays and tell each member's end. Slow (one real local Ray and MLflow
server): a racing study and an optuna study with a median pruner at ``seeds_per_trial: 2``, on
seed counts that are not multiples of 2, run end to end with one cell run per member equal to
its seed's separate trial, and the decisions of the unfused study (the race's rule on the
separate trials' values; the median rule written out on the seed means Optuna was told).
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import yaml

from studies.cells.arrays import fused_arrays
from studies.planning.estimate import experiments
from studies.studyfile.spec import load_study
from tests.test_fused_runner import OPTUNA_BLOCK, cell
from tests.test_runner import child_runs, options, write_study


def one_cpu_arrays(per_trial: int) -> dict:
    """Arrays of `per_trial` seeds on one CPU each (`per_array`; an array takes its members' CPUs
    by default, issue 42): a config's arrays run at once on the 2-CPU test Ray, as its schedulers need."""
    return {"cpus": 1, "seeds_per_trial": per_trial, **({"per_array": {"cpus": 1}} if per_trial > 1 else {})}


@contextlib.contextmanager
def one_thread():
    """torch on one thread, as a trial of ``cpus: 1`` runs: a reference ``fit`` on more threads
    sums in another order, and over a few epochs may select another epoch."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def raced_study(tmp_path, name: str, lrs, per_trial: int, initial=3, max_seeds=6, step=2, epochs=2, **extra):
    """A racing study of the tiny MLP (test/top1 decides), seeds_per_trial `per_trial`."""
    path = write_study(tmp_path, name, lrs=lrs, epochs=epochs, resources=one_cpu_arrays(per_trial), **extra)
    study = yaml.safe_load(path.read_text())
    study["seeds"] = {"initial": initial, "max": max_seeds, "step": step, "until": {"metric": "test/top1"}}
    study["base"]["eval"] = {"ks": [1, 3], "selection": "val/top1"}
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def test_a_race_hands_out_each_round_of_a_config_as_arrays_the_rest_smaller(tmp_path):
    """initial 3, step 2, max 6 at seeds_per_trial 2: a config's rounds {0,1,2}, {3,4}, {5} run
    as arrays [0,1] [2], [3,4], [5]; the race's own order (round by round, config by config);
    the dry run and `studies plan` cut the same arrays (`race_rounds`)."""
    from studies.cells.space import expand
    from studies.scheduling.racing import SeedRace, race_rounds

    race = SeedRace(["a", "b"], list(range(6)), initial=3, step=2)
    first = [race.take_array(2) for _ in range(4)]
    assert first == [[("a", 0), ("a", 1)], [("a", 2)], [("b", 0), ("b", 1)], [("b", 2)]]
    assert race.take_array(2) == [] and race.in_flight() == 6
    for array in first:
        for config_id, seed in array:  # identical configs: both race on, round by round
            race.record(config_id, seed, 0.5 + 0.01 * seed)
    rounds = [race.take_array(2) for _ in range(2)]
    assert rounds == [[("a", 3), ("a", 4)], [("b", 3), ("b", 4)]]
    race.record("a", 3, 0.53)
    assert race.take_array(2) == []  # a's round is in flight until both its seeds end
    race.record("a", 4, 0.54)
    assert race.take_array(2) == [("a", 5)]  # the last round: one seed, a smaller array
    assert race.take_array(3) == []  # b's round still in flight; a's seeds all taken

    study = load_study(raced_study(tmp_path, "race-arrays", [0.1, 0.2], per_trial=2))
    cells = expand(study)
    arrays = fused_arrays(cells, 2, round_of=race_rounds(study))
    assert [[c.seed for c in a] for a in arrays] == [[0, 1], [2], [3, 4], [5]] * 2
    assert race_rounds(load_study(write_study(tmp_path, "no-race", lrs=[0.1]))) is None
    assert experiments(cells, 2, race_rounds(study)) == [[[0, 1], [2], [3, 4], [5], [6, 7], [8], [9, 10], [11]]]
    # three seeds a round at two a trial: each round's rest is a smaller array of its own
    wide = load_study(raced_study(tmp_path, "race-wide", [0.1], per_trial=2, initial=3, max_seeds=9, step=3))
    assert [len(a) for a in fused_arrays(expand(wide), 2, round_of=race_rounds(wide))] == [2, 1, 2, 1, 2, 1]


class FakeRace:
    """The race driver's side a `RaceSearcher` uses: arrays to hand out, the cells told."""

    def __init__(self, arrays):
        self.arrays, self.told = list(arrays), []
        self.cells = {
            cell_id: cell(cell_id.rsplit("-s", 1)[0], int(cell_id.rsplit("-s", 1)[1]))
            for array in arrays
            for cell_id in array
        }

    def next_cell_ids(self, limit):
        from studies.scheduling.race_driver import RACE_OVER

        return self.arrays.pop(0)[:limit] if self.arrays else RACE_OVER

    def complete(self, cell_id, failed, error=""):
        self.told.append((cell_id, failed, error))


def test_the_race_searcher_hands_out_arrays_and_tells_the_race_each_member():
    from studies.running.tune_experiment import RaceSearcher

    race = FakeRace([["a-s0", "a-s1"], ["a-s2"]])
    payloads = {cell_id: {"cell_id": cell_id, "seed": int(cell_id[-1])} for cell_id in race.cells}
    searcher = RaceSearcher(race, payloads, per_trial=2)
    first, second = searcher.suggest("t1"), searcher.suggest("t2")
    assert first == {
        "cell_id": "a-s0-x2",
        "cell": {"cell_id": "a-s0-x2", "members": [payloads["a-s0"], payloads["a-s1"]]},
    }
    assert second["cell_id"] == "a-s2" and second["cell"]["members"] == [payloads["a-s2"]]
    assert searcher.suggest("t3") is searcher.FINISHED
    # member a-s1 failed alone (its report says so); a-s0 finished; the other array's trial errored
    searcher.on_trial_result("t1", {"cell_id": "a-s1", "cell_status": "failed", "error": "loss is nan"})
    searcher.on_trial_complete("t1", {"cell_id": "a-s0", "cell_status": "running"})
    searcher.on_trial_complete("t2", None, error=True)
    assert race.told == [("a-s0", False, ""), ("a-s1", True, "loss is nan"), ("a-s2", True, "")]
    # one cell a trial (seeds_per_trial 1): the payload of the cell itself
    race = FakeRace([["b-s0"]])
    assert RaceSearcher(race, {"b-s0": {"cell_id": "b-s0"}}).suggest("t") == {
        "cell_id": "b-s0",
        "cell": {"cell_id": "b-s0"},
    }


def test_the_proposal_searcher_ends_each_member_of_an_array_with_its_own_run():
    from studies.running.tune_experiment import ProposalSearcher, array_payload

    class Proposals:
        def __init__(self):
            self.configs, self.ended = [["c-s0", "c-s1", "c-s2"]], []

        def propose(self):
            return self.configs.pop(0) if self.configs else None

        def cell_ended(self, cell_id, run_id):
            self.ended.append((cell_id, run_id))

    def admit(cell_ids):  # a config's three seeds as arrays of two, the rest smaller
        members = [{"cell_id": i} for i in cell_ids]
        return [array_payload("c-s0-x2", members[:2]), array_payload("c-s2", members[2:])]

    proposals = Proposals()
    searcher = ProposalSearcher(proposals, admit)
    assert searcher.suggest("t1")["cell_id"] == "c-s0-x2" and searcher.suggest("t2")["cell_id"] == "c-s2"
    assert searcher.suggest("t3") is searcher.FINISHED
    for member, run in (("c-s0", "r0"), ("c-s1", "r1"), ("c-s0", "r0")):
        searcher.on_trial_result("t1", {"cell_id": member, "run_id": run})
    searcher.on_trial_complete("t1", {"cell_id": "c-s0", "run_id": "r0"})
    searcher.on_trial_complete("t2", None, error=True)  # no report reached the driver
    assert proposals.ended == [("c-s0", "r0"), ("c-s1", "r1"), ("c-s2", None)]


def test_the_plan_counts_a_race_round_or_an_optuna_configs_seeds_as_arrays(tmp_path):
    """`studies plan`: an array is one trial slot training its cells (timed one after the other),
    a race's arrays cut by round, an optuna proposal's seeds (3: the rest smaller) as arrays."""
    from studies.planning.estimate import Timings, VariantTime, estimate
    from studies.planning.plan import planned_cells
    from studies.scheduling.racing import race_rounds

    def planned(path, cpus):
        study = load_study(path)
        cells = planned_cells(study)
        # 1 s an epoch, a fresh worker's first trial 0.5 s longer: the trials on the slots show
        timings = Timings({c.variant: VariantTime(1.0, 0.0, "probe") for c in cells}, 0.5)
        return study, cells, estimate(study, cells, timings, cpus=cpus)

    # a race of initial 3, step 1, max 4 at two seeds a trial: arrays [0, 1] [2] [3] (three
    # trials, three warm-ups on three slots), not [0, 1] [2, 3]
    study, cells, est = planned(raced_study(tmp_path, "plan-race", [0.1], per_trial=2, max_seeds=4, step=1), 3)
    assert len(cells) == 4 and est.seeds_per_trial == 2 and est.slots == 3
    assert est.cell_seconds == pytest.approx(4 * 2 * 1.0 + 3 * 0.5)
    assert experiments(cells, 2, race_rounds(study)) == [[[0, 1], [2], [3]]]
    # an optuna block of 3 configs on 3 seeds: each config's seeds as [0, 1] [2]
    tuned = write_study(
        tmp_path,
        "plan-optuna",
        lrs=[0.1],
        seeds=(0, 1, 2),
        epochs=2,
        resources=one_cpu_arrays(2),
        objective={"metric": "val/top3"},
        design=[OPTUNA_BLOCK],
    )
    _, cells, est = planned(tuned, 1)
    assert len(cells) == 9 and est.experiments == 1 and est.slots == 1
    assert est.cell_seconds == pytest.approx(9 * 2 * 1.0 + 0.5)
    assert [len(t) for part in experiments(cells, 2) for t in part] == [2, 1] * 3
    assert est.wall_s - est.start_up_s == pytest.approx(18.5)


def handed_out(monkeypatch, searcher: type) -> list[str]:
    """The trials a Tune searcher class hands out in this process (the driver's), by name."""
    names: list[str] = []
    original = searcher.suggest

    def suggest(self, trial_id):
        suggestion = original(self, trial_id)
        if isinstance(suggestion, dict):
            names.append(suggestion["cell_id"])
        return suggestion

    monkeypatch.setattr(searcher, "suggest", suggest)
    return names


@pytest.mark.slow
def test_a_fused_race_runs_its_rounds_as_arrays_to_the_unfused_decisions(
    local_ray, mlflow_server, tmp_path, monkeypatch
):
    """A race of a clearly worse config and two configs that train alike (they differ in the
    evaluation batch size alone: tied on every seed, they race to max) at seeds_per_trial 2,
    initial 3, step 2, max 6 (no round a multiple of 2 but one): every round runs as arrays, the
    rest a smaller one; one cell run per member, equal to its seed's separate trial; the
    decisions and seeds those of the unfused race (the rule on the separate trials' values)."""
    from mlflow import MlflowClient

    from setvalued.training import fit
    from studies.cells.space import expand
    from studies.running.runner import run_study
    from studies.scheduling.racing import SeedRace
    from tests.test_racing import run_race

    twin = {"kind": "grid", "parameters": {"optim.lr": [0.1], "eval.batch_size": [64]}}
    path = raced_study(
        tmp_path,
        "fused-race",
        [0.001, 0.1],
        per_trial=2,
        initial=3,
        max_seeds=6,
        step=2,
        design=[{"kind": "grid", "parameters": {"optim.lr": [0.001, 0.1]}}, twin],
    )
    study = load_study(path)
    cells = {c.cell_id: c for c in expand(study)}
    with one_thread():
        alone = {cell_id: fit(c.config, c.seed)["test"] for cell_id, c in cells.items()}
    # the unfused race: the rule on the separate trials' values
    configs = list(dict.fromkeys(c.config_id for c in cells.values()))
    race = SeedRace(configs, study.seed_list, 3, 2)
    run_race(race, lambda config_id, seed: alone[f"{config_id}-s{seed}"]["top1"])
    expected = {config_id: (race.status(config_id).state, race.status(config_id).seeds) for config_id in configs}
    assert sorted(expected.values()) == [("max seeds reached", 6)] * 2 + [("worse than best", 3)]

    from studies.running.tune_experiment import RaceSearcher

    trials = handed_out(monkeypatch, RaceSearcher)
    stream = io.StringIO()
    outcome = run_study(path, options(tmp_path, mlflow_server, stream=stream))
    text = stream.getvalue()
    assert outcome.exit_code == 0 and outcome.failed == {}, text
    assert "racing: each round of a config's seeds as fused arrays of up to 2 seeds" in text
    assert "3 cells not needed" in text
    runs = child_runs(mlflow_server, "fused-race")
    found = {}
    for run in runs:
        found.setdefault(run.data.tags["studies.config_id"], []).append(run)
    assert {
        config_id: (d["state"], d["seeds"])
        for config_id, d in ((run.data.tags["studies.config_id"], json_tag(run)) for run in runs if json_tag(run))
    } == expected
    for config_id, (_, n) in expected.items():
        assert sorted(int(r.data.tags["studies.seed"]) for r in found[config_id]) == list(range(n)), config_id
    client = MlflowClient(mlflow_server)
    for run in runs:  # one run per member, its test metrics those of the separate trial
        cell_id = run.data.tags["studies.cell_id"]
        assert run.data.tags["studies.status"] == "finished"
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val/top1")) == [0, 1]
        for key, value in alone[cell_id].items():
            assert run.data.metrics[f"test/{key}"] == pytest.approx(value, abs=1e-6), (cell_id, key)
    # the Tune trials: the worse config's round [0, 1] [2]; each tied config's [0, 1] [2] [3, 4] [5]
    worse = next(c for c, (state, _) in expected.items() if state == "worse than best")
    want = [f"{worse}-s0-x2", f"{worse}-s2"] + [
        name for c in configs if c != worse for name in (f"{c}-s0-x2", f"{c}-s2", f"{c}-s3-x2", f"{c}-s5")
    ]
    assert sorted(trials) == sorted(want)
    assert len(runs) == 15


def json_tag(run) -> dict | None:
    """A run's race decision (`studies.race`), if it holds one."""
    import json

    text = run.data.tags.get("studies.race")
    return json.loads(text) if text else None


@pytest.mark.slow
def test_a_fused_optuna_block_prunes_an_array_as_a_whole_on_its_seed_mean(
    local_ray, mlflow_server, tmp_path, monkeypatch
):
    """An optuna block of 3 configs on 3 seeds at seeds_per_trial 2 (arrays [0, 1] and [2] a
    config) with a median pruner: every config asked once, each member a cell run equal to its
    seed's separate trial (cut where its config stopped); the values reported to Optuna are the
    seed means of the members' curves; the median rule, written out on them, prunes exactly the
    configs that stopped, all their cells at one epoch (the unfused study's decisions)."""
    import optuna
    from mlflow import MlflowClient

    from setvalued.training import fit
    from studies.running.runner import run_study

    epochs = 3
    block = {**OPTUNA_BLOCK, "sampler_seed": 6, "parameters": {"optim.lr": {"loguniform": [0.0005, 0.5]}}}
    path = write_study(
        tmp_path,
        "fused-optuna",
        lrs=[0.1],
        seeds=(0, 1, 2),
        epochs=epochs,
        resources=one_cpu_arrays(2),
        design=[block],
        objective={"metric": "val/top1", "mode": "max"},
    )
    study = yaml.safe_load(path.read_text())
    study["base"]["eval"] = {"ks": [1, 3], "selection": "val/top1"}
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    from studies.running.tune_experiment import ProposalSearcher

    handed = handed_out(monkeypatch, ProposalSearcher)
    stream = io.StringIO()
    outcome = run_study(path, options(tmp_path, mlflow_server, stream=stream))
    text = stream.getvalue()
    assert outcome.exit_code == 0 and outcome.failed == {}, text
    assert "configs asked as slots free up (2 fused arrays of up to 2 seeds at a time, up to 4 cells)" in text

    storage = f"sqlite:///{tmp_path / 'out' / 'fused-optuna' / 'optuna.db'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    trials = sorted(optuna.load_study(study_name=summary.study_name, storage=storage).trials, key=lambda t: t.number)
    assert len(trials) == 3
    client = MlflowClient(mlflow_server)
    by_config: dict[str, list] = {}
    for run in child_runs(mlflow_server, "fused-optuna"):
        by_config.setdefault(run.data.tags["studies.config_id"], []).append(run)
    completed: list[dict] = []  # the intermediate values of the configs told COMPLETE so far
    for trial in trials:
        config_id = trial.user_attrs["config_id"]
        runs = by_config[config_id]
        assert sorted(int(r.data.tags["studies.seed"]) for r in runs) == [0, 1, 2]
        curves = {
            int(r.data.tags["studies.seed"]): [
                m.value for m in sorted(client.get_metric_history(r.info.run_id, "val/top1"), key=lambda m: m.step)
            ]
            for r in runs
        }
        # Optuna saw the seed means of the members' curves (no report at the last epoch)
        for step, value in trial.intermediate_values.items():
            assert value == pytest.approx(sum(c[step - 1] for c in curves.values()) / 3, abs=1e-9)
        # the median pruner written out: from step 1 (warm-up) on, pruned at the first step
        # where its best mean so far is below the median of the completed configs' means there
        expected_stop = None
        means = {n: sum(c[n - 1] for c in curves.values()) / 3 for n in trial.intermediate_values}
        for n in sorted(means) if completed else ():
            median = float(np.median([v[n] for v in completed]))
            if max(means[m] for m in means if m <= n) < median:
                expected_stop = n
                break
        stops = {r.data.tags.get("studies.stopped_epoch") for r in runs}
        pruned = {r.data.tags.get("studies.pruned") for r in runs}
        if expected_stop is None:
            assert trial.state == optuna.trial.TrialState.COMPLETE and stops == {None} and pruned == {None}
            assert max(trial.intermediate_values) == epochs - 1
            completed.append(means)
        else:  # the whole config stopped there: both of its arrays
            assert trial.state == optuna.trial.TrialState.PRUNED
            assert stops == {str(expected_stop)} and pruned == {"optuna"}
            assert max(trial.intermediate_values) == expected_stop
        done = int(expected_stop or epochs)
        config = yaml.safe_load(path.read_text())["base"]
        config["optim"]["lr"] = trial.params["optim.lr"]
        for seed, run in ((int(r.data.tags["studies.seed"]), r) for r in runs):
            # each member equals its seed's separate trial, cut where its config stopped
            assert len(curves[seed]) == done
            with one_thread():
                separate = fit({**config, "epochs": done}, seed)
            for key, value in separate["test"].items():
                assert run.data.metrics[f"test/{key}"] == pytest.approx(value, abs=1e-6), (trial.number, seed, key)
    assert [t.state for t in trials].count(optuna.trial.TrialState.PRUNED) >= 1, [t.params for t in trials]
    assert "optuna design[0]: 3 configs asked: " in text
    # each config's seeds ran as two trials, the arrays [0, 1] and [2]
    assert sorted(handed) == sorted(name for c in by_config for name in (f"{c}-s0-x2", f"{c}-s2"))
