"""Racing (`seeds: {initial, max, until}`): the rule (`studies.scheduling.racing.SeedRace`) on simulated
results against a direct computation, the study schema, and (slow) a racing study on a real
local Ray and MLflow server: fewer cells than configs x max, seeds paired, decisions recorded,
and a resumed interrupted race ending in the same decisions.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import yaml
from scipy import stats as sps

from analysis.intervals import NOTE_DEGENERATE, paired_test
from studies.scheduling.racing import BEST, FAILED, MAX, RACING, WORSE, RaceStatus, SeedRace


def run_race(race: SeedRace, value) -> None:
    """Run a race to its end one cell at a time; `value(config_id, seed)` is a cell's result."""
    for _ in range(10_000):
        taken = race.take()
        if taken is None:
            assert race.is_over() and race.in_flight() == 0
            return
        race.record(*taken, value(*taken))
    raise AssertionError("the race did not end")


def holm_direct(p):
    """Holm's adjusted p-values by the textbook definition (for comparison)."""
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted


# ----------------------------------------------------------------------------- the rule


def test_a_config_ten_sigma_worse_stops_after_its_initial_seeds():
    rng = np.random.default_rng(1)
    noise = {(c, s): rng.normal(0, 0.01) for c in "ab" for s in range(10)}
    race = SeedRace(["a", "b"], list(range(10)), initial=3)
    run_race(race, lambda c, s: (0.8 if c == "a" else 0.7) + noise[(c, s)])
    worse = race.status("b")
    assert worse.state == WORSE and worse.seeds == 3 and worse.best == "a"
    # direct computation: the paired t-test on the 3 seeds, one comparison (Holm = raw p)
    p = sps.ttest_rel([0.7 + noise[("b", s)] for s in range(3)], [0.8 + noise[("a", s)] for s in range(3)]).pvalue
    assert worse.p_holm == pytest.approx(p) and p < 0.05
    # the winner is alone: clearly the best, with no seed more than it needed
    assert race.status("a").state == BEST and race.status("a").seeds == 3


def test_identical_configs_race_to_max():
    rng = np.random.default_rng(2)
    seed_effect = rng.normal(0, 0.02, size=10)
    noise = {(c, s): rng.normal(0, 0.01) for c in "abc" for s in range(10)}
    race = SeedRace(list("abc"), list(range(10)), initial=3)
    run_race(race, lambda c, s: 0.75 + seed_effect[s] + noise[(c, s)])
    assert {race.status(c).state for c in "abc"} == {MAX}
    assert all(race.status(c).seeds == 10 for c in "abc")


def test_equal_differences_are_no_evidence_as_in_the_report():
    """Two seeds whose differences from the best are equal (a discrete metric: both seeds one
    validation example apart) have sd 0: t = mean / 0. The report calls this a degenerate
    test, never significant (analysis.intervals.paired_test); the race does not stop the
    config on it, and keeps it out of Holm's family (the other config's p is its raw p)."""
    values = {("a", 0): 0.80, ("a", 1): 0.82, ("b", 0): 0.79, ("b", 1): 0.81, ("c", 0): 0.60, ("c", 1): 0.64}
    values.update({(c, s): values[(c, s % 2)] + 0.001 * s * (c != "a") for c in "abc" for s in range(2, 6)})
    race = SeedRace(list("abc"), list(range(6)), initial=2)
    for config_id, seed in [race.take() for _ in range(6)]:
        race.record(config_id, seed, values[(config_id, seed)])
    report = paired_test([values[("b", s)] for s in range(2)], [values[("a", s)] for s in range(2)])
    assert math.isnan(report.p_value) and report.note == NOTE_DEGENERATE
    assert race.status("b").state == RACING  # on the old rule: p = 0, stopped as worse
    assert ("b", 2) in race.next_cells()  # it gets more seeds
    # c's test is the only one in the family: its Holm p is its raw p (0.033; with b's p = 1
    # in the family it would be doubled to 0.067 and c would race on)
    raw = sps.ttest_rel([values[("c", s)] for s in range(2)], [values[("a", s)] for s in range(2)]).pvalue
    assert race.status("c").state == WORSE and race.status("c").p_holm == pytest.approx(raw) and raw < 0.05


def test_decisions_match_a_direct_paired_t_and_holm_computation():
    """Four configs, one round at a time (synchronous order): after the initial round every
    decision equals the paired t-test against the best and Holm over the configs racing."""
    rng = np.random.default_rng(3)
    means = {"a": 0.80, "b": 0.78, "c": 0.70, "d": 0.795}
    values = {(c, s): means[c] + rng.normal(0, 0.01) for c in means for s in range(6)}
    race = SeedRace(list(means), list(range(6)), initial=3)
    initial = [race.take() for _ in range(12)]
    assert initial == [(c, s) for c in means for s in range(3)]  # config by config
    for config_id, seed in initial:
        race.record(config_id, seed, values[(config_id, seed)])
    mean3 = {c: np.mean([values[(c, s)] for s in range(3)]) for c in means}
    best = max(mean3, key=mean3.get)
    others = [c for c in means if c != best]
    raw = [
        sps.ttest_rel([values[(c, s)] for s in range(3)], [values[(best, s)] for s in range(3)]).pvalue for c in others
    ]
    adjusted = dict(zip(others, holm_direct(raw)))
    for c in others:
        status = race.status(c)
        if adjusted[c] < 0.05:
            assert status.state == WORSE and status.p_holm == pytest.approx(adjusted[c])
        else:
            assert status.state == RACING
    assert race.status(best).state in (RACING, BEST)
    assert race.status("c").state == WORSE  # 10 sigma below: decided on 3 seeds


def test_cells_are_offered_round_by_round_config_by_config_and_stay_paired():
    race = SeedRace(["a", "b", "c"], [7, 3, 11, 5, 9], initial=2, step=2)
    first = race.next_cells()
    assert first == [("a", 7), ("a", 3), ("b", 7), ("b", 3), ("c", 7), ("c", 3)]
    for cell in first:
        race.take()
        race.record(*cell, {"a": 0.5, "b": 0.5, "c": 0.5}[cell[0]] + 0.01 * (cell[1] % 3))
    # identical configs: every one gets the next `step` = 2 seeds of the same sequence
    nxt = race.next_cells()
    assert nxt == [("a", 11), ("a", 5), ("b", 11), ("b", 5), ("c", 11), ("c", 5)]
    # a config whose round is in flight waits: nothing more is offered for it
    race.take()
    race.take()
    assert all(c != "a" for c, _ in race.next_cells())
    assert race.in_flight() == 2


def test_min_mode_step_failure_and_restored_decisions():
    race = SeedRace(["a", "b", "c"], list(range(4)), initial=2, mode="min")
    race.restore("c", RaceStatus(2, WORSE, "decided earlier", 0.01, "a"))
    for _c in ("a", "b"):
        race.take()
        race.take()
    race.record("a", 0, 1.0)
    race.record("a", 1, 1.1)
    race.record("b", 0, 2.0)
    race.fail("b", 1, "NaN loss")
    assert race.status("b").state == FAILED and "NaN loss" in race.status("b").reason
    assert race.status("c").reason == "decided earlier"  # a restored decision is kept
    # with min mode, a is the best (lower): alone, it stops as clearly the best
    assert race.status("a").state == BEST
    assert race.is_over() and race.next_cells() == []
    decided = dict(race.pop_decisions())
    assert set(decided) == {"a", "b"}  # c was restored, not decided in this session


def test_bad_race_parameters_are_refused():
    with pytest.raises(ValueError, match="initial"):
        SeedRace(["a"], [0, 1], initial=1)
    with pytest.raises(ValueError, match="mode"):
        SeedRace(["a"], [0, 1], initial=2, mode="up")
    race = SeedRace(["a"], [0, 1], initial=2)
    with pytest.raises(KeyError, match="seed 5"):
        race.record("a", 5, 1.0)


# ----------------------------------------------------------------------------- the schema


def _quickstart_with(tmp_path, seeds: str):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "studies" / "catalog" / "quickstart.yaml").read_text()
    path = tmp_path / "s.yaml"
    path.write_text(text.replace("seeds: [0, 1, 2]", "seeds: " + seeds))
    return path


@pytest.mark.parametrize(
    "seeds, message",
    [
        ("{initial: 3}", "seeds.max (line 72): missing required field 'max'"),
        ("{initial: 1, max: 4}", "seeds.initial (line 72): expected greater than or equal to 2"),
        ("{initial: 4, max: 3}", "initial (4) must be at most max (3)"),
        ("{initial: 3, max: 4, sequence: [1, 2, 3]}", "sequence has 3 seeds; expected max = 4"),
        ("{initial: 3, max: 10, until: {level: 2}}", "seeds.until.level (line 72): expected less than 1"),
        ("{initial: 3, max: 10, until: {metric: test/top77}}", "seeds.until.metric (line 72): racing needs"),
    ],
)
def test_racing_block_errors_name_the_field(tmp_path, seeds, message):
    from studies.studyfile.problems import StudyError
    from studies.studyfile.spec import load_study

    with pytest.raises(StudyError) as error:
        load_study(_quickstart_with(tmp_path, seeds))
    assert message in str(error.value)


def test_racing_block_expands_to_every_seed_up_to_max(tmp_path):
    from studies.cells.space import expand, format_cells_table
    from studies.studyfile.spec import load_study

    study = load_study(_quickstart_with(tmp_path, "{initial: 3, max: 6, sequence: [5, 4, 3, 2, 1, 0]}"))
    assert study.seed_list == [5, 4, 3, 2, 1, 0] and study.seeds_at_once == 3
    # the objective (val/top5, max) decides the race unless `until` says otherwise
    assert (study.racing.until.metric, study.racing.until.mode) == ("val/top5", "max")
    cells = expand(study)
    assert len(cells) == 5 * 6 and study.planned_cells() == (5, 30)
    assert "between 15 and 30 cells" in format_cells_table(cells, study)


def test_progress_line_with_a_race_shows_an_upper_bound():
    from studies.running.progress import StudyProgress

    race = SeedRace(["a", "b"], list(range(5)), initial=2)

    class Driver:
        def upper_bound_left(self):
            return race.upper_bound_left()

        def summary(self):
            return race.summary()

    progress = StudyProgress(total=10, to_run=10, epochs={}, race=Driver())
    assert "left at most 10" in progress.line() and "race: 2 racing" in progress.line()
    for cell in [race.take() for _ in range(4)]:
        progress.start(f"{cell[0]}-s{cell[1]}")
        race.record(*cell, 0.9 if cell[0] == "a" else 0.1 + 0.01 * cell[1])
        progress.finish(f"{cell[0]}-s{cell[1]}")
    # b is far worse (stopped); a alone is the best: nothing is left
    assert race.is_over()
    assert "left at most 0" in progress.line() and "1 worse, 1 best" in progress.line()


# ----------------------------------------------------------------------------- slow: a real race

#: test/top1 per learning rate: two clearly worse configs, two equal ones
RACE_MEANS = {0.01: 0.40, 0.02: 0.50, 0.03: 0.80, 0.04: 0.80}


def race_fit(config, seed, on_epoch=None, checkpoint=None):
    """The contract of setvalued.train.fit with a known test value per (lr, seed): the lr's
    mean, a seed effect shared by every config (paired) and a small per-config noise."""
    lr = config["optim"]["lr"]
    value = RACE_MEANS[lr] + 0.02 * ((seed * 7) % 5 - 2) + 0.01 * (((seed + int(lr * 100)) * 3) % 4 - 1.5)
    start = 0 if checkpoint is None else checkpoint["epoch"] + 1
    for epoch in range(start, config["epochs"]):
        if on_epoch is not None:
            on_epoch(
                epoch,
                {"epoch": epoch, "train/loss": 1.0, "val/top1": value, "epoch_time_s": 0.01},
                {"epoch": epoch, "config": dict(config)},
            )
    return {
        "best_epoch": config["epochs"] - 1,
        "best_val": value,
        "test": {"top1": value},
        "per_class": {"class": [0], "top1": [value]},
        "history": [],
    }


def racing_study(tmp_path, name: str):
    from tests.test_runner import write_study

    path = write_study(tmp_path, name, lrs=list(RACE_MEANS), epochs=1)
    study = yaml.safe_load(path.read_text())
    study["seeds"] = {"initial": 3, "max": 6, "until": {"metric": "test/top1"}}
    study["base"]["eval"] = {"ks": [1], "selection": "val/top1"}
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def decisions(server: str, name: str) -> tuple[dict, dict]:
    """(config lr -> race decision, config lr -> sorted seeds finished) from MLflow."""
    from tests.test_runner import child_runs

    decided, seeds = {}, {}
    for run in child_runs(server, name):
        lr = float(run.data.params["optim.lr"])
        seeds.setdefault(lr, []).append(int(run.data.params["seed"]))
        if run.data.tags.get("studies.race"):
            assert lr not in decided, "one decision per config"
            decided[lr] = json.loads(run.data.tags["studies.race"])
    return decided, {lr: sorted(s) for lr, s in seeds.items()}


@pytest.mark.slow
def test_racing_study_runs_fewer_cells_paired_and_resumes_to_the_same_decisions(local_ray, mlflow_server, tmp_path):
    from mlflow import MlflowClient

    from studies.running.runner import RunOptions, run_study
    from tests.test_runner import child_runs

    def options(**kw):
        return RunOptions(
            output=tmp_path / "out",
            tracking_uri=mlflow_server,
            report=False,
            progress_interval_s=5.0,
            fit_fn=race_fit,
            **kw,
        )

    path = racing_study(tmp_path, "racing-full")
    stream = io.StringIO()
    outcome = run_study(path, options(stream=stream))
    assert outcome.exit_code == 0, stream.getvalue()
    decided, seeds = decisions(mlflow_server, "racing-full")
    # the two clearly worse configs stop after their 3 initial seeds, the equal ones race to max
    assert {lr: d["state"] for lr, d in decided.items()} == {0.01: WORSE, 0.02: WORSE, 0.03: MAX, 0.04: MAX}
    assert seeds == {0.01: [0, 1, 2], 0.02: [0, 1, 2], 0.03: list(range(6)), 0.04: list(range(6))}
    assert sum(map(len, seeds.values())) == 18 < 4 * 6
    assert "6 cells not needed" in stream.getvalue() and outcome.failed == {}
    assert "left at most" in stream.getvalue()

    # an interrupted race: the same study up to its first 10 finished cells (the MLflow state a
    # killed driver leaves: later runs absent, no decision recorded yet), then resumed
    path2 = racing_study(tmp_path, "racing-cut")
    assert run_study(path2, options(stream=io.StringIO())).exit_code == 0
    client = MlflowClient(mlflow_server)
    runs = sorted(child_runs(mlflow_server, "racing-cut"), key=lambda r: r.info.end_time)
    for run in runs[10:]:
        client.delete_run(run.info.run_id)
    for run in runs[:10]:
        if run.data.tags.get("studies.race"):
            client.delete_tag(run.info.run_id, "studies.race")
    again = run_study(path2, options(stream=io.StringIO()))
    assert again.exit_code == 0

    def outcome_of(found):  # the decision and seeds (the p-values depend on what was known when)
        return {lr: (d["state"], d["seeds"]) for lr, d in found[0].items()}, found[1]

    resumed = decisions(mlflow_server, "racing-cut")
    assert outcome_of(resumed) == outcome_of((decided, seeds))
    # a third run has nothing left to do and keeps every recorded decision as it was
    stream = io.StringIO()
    assert run_study(path2, options(stream=stream)).exit_code == 0
    assert decisions(mlflow_server, "racing-cut") == resumed
    assert "running" not in stream.getvalue().split("summary")[0].split("cells already")[1]


@pytest.mark.slow
def test_racing_and_asha_compose(local_ray, mlflow_server, tmp_path):
    """ASHA prunes a config on the mean of its initial (racing) seeds, all of them at the same
    rung; the race then decides on the seeds each config has; later seeds of a config follow
    the epoch its initial seeds stopped at, and every config's seeds stay a paired prefix."""
    from studies.running.runner import RunOptions, run_study
    from tests.test_runner import child_runs, write_study

    # 0.03 (good) reaches the first rung first and sets its bar: 0.01 (worse) is pruned there
    lrs = [0.03, 0.01, 0.02, 0.04]
    path = write_study(tmp_path, "racing-asha", lrs=lrs, epochs=4)
    study = yaml.safe_load(path.read_text())
    study["seeds"] = {"initial": 2, "max": 4, "until": {"metric": "test/top1"}}
    study["base"]["eval"] = {"ks": [1], "selection": "val/top1"}
    study["objective"] = {"metric": "val/top1", "mode": "max"}
    study["scheduler"] = {"kind": "asha", "grace_epochs": 1, "reduction_factor": 2}
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    stream = io.StringIO()
    outcome = run_study(
        path,
        RunOptions(
            output=tmp_path / "out",
            tracking_uri=mlflow_server,
            report=False,
            progress_interval_s=5.0,
            fit_fn=race_fit,
            stream=stream,
        ),
    )
    assert outcome.exit_code == 0, stream.getvalue()
    by_config: dict[float, list] = {}
    for run in child_runs(mlflow_server, "racing-asha"):
        by_config.setdefault(float(run.data.params["optim.lr"]), []).append(run)
    for lr, runs in by_config.items():
        seeds = sorted(int(r.data.params["seed"]) for r in runs)
        assert seeds == list(range(len(seeds))) and len(seeds) >= 2  # a paired prefix
        stops = {r.data.tags.get("studies.stopped_epoch") for r in runs}
        pruned = {r.data.tags.get("studies.pruned") for r in runs}
        assert len(stops) == 1 and len(pruned) == 1, (lr, stops, pruned)  # all seeds together
    assert {r.data.tags.get("studies.pruned") for r in by_config[0.01]} == {"asha"}
    assert {r.data.tags.get("studies.stopped_epoch") for r in by_config[0.01]} == {"1"}
    assert {r.data.tags.get("studies.pruned") for r in by_config[0.03]} == {None}
    decided, _ = decisions(mlflow_server, "racing-asha")
    assert set(decided) == set(lrs)  # the race decided every config, the pruned one included
    assert sum(map(len, by_config.values())) < 4 * 4
