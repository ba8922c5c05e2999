"""Pruning configs, not trials (`studies.scheduling`): ASHA and Optuna's pruners on
the seed means of configs, all seeds of a config stopping together.

Fast tests: the ASHA rule against a brute-force simulation of config curves (configs in
order and interleaved), the rungs, the last epoch, the outside decisions of the Optuna
rule, and the study file's validation of `scheduler: {kind: asha}` and an optuna block's
`pruner`.

Slow tests (a local Ray with 2 CPUs, a real MLflow server):
- a grid study with ASHA stops the scripted bad configs at the rungs the brute force gives,
  every seed at the same epoch, tagged `studies.pruned=asha`; the report leaves them out
  with a note, and shows them with `report: {show_pruned: true}`;
- an optuna study with a median pruner ends with PRUNED trials whose intermediate values
  are the seed means of the scripted curves.
"""

from __future__ import annotations

import io
import math
import random
from pathlib import Path

import pytest
import yaml

from studies.running.runner import RunOptions, run_study
from studies.scheduling import ConfigOptunaPruning, ConfigSuccessiveHalving, rungs
from studies.studyfile.problems import StudyError
from studies.studyfile.spec import parse_study

# ----------------------------------------------------------------------------- brute force


def brute_force_asha(
    events: list[tuple[str, int]], curves: dict, mode: str, grace: int, eta: int, epochs: int | None = None
) -> dict:
    """ASHA written out directly: `events` are (config, epoch) completions in time order;
    at a rung r, a config goes on when its seed mean is at least the ceil(n/eta)-th best mean
    of the n configs that reached r so far (itself included), else it stops at r."""
    sign = 1.0 if mode == "max" else -1.0
    last = epochs if epochs is not None else 10**9
    rung_set = set()
    r = grace
    while r < last and r < 10**6:
        rung_set.add(r)
        r *= eta
    at_rung: dict[int, list[float]] = {}
    stops: dict[str, int] = {}
    for config, n in events:
        if config in stops or n not in rung_set:
            continue
        seeds = curves[config]
        mean = sum(sign * (s[n - 1] if s[n - 1] == s[n - 1] else -math.inf * sign) for s in seeds.values()) / len(seeds)
        at_rung.setdefault(n, []).append(mean)
        ranked = sorted(at_rung[n], reverse=True)
        bar = ranked[math.ceil(len(ranked) / eta) - 1]
        if mean < bar:
            stops[config] = n
    return stops


def feed(rule, events, curves) -> None:
    """Every seed of each event's config reports the event's epoch, unless stopped."""
    for config, n in events:
        if config in rule.stopped:
            continue
        for seed, curve in curves[config].items():
            rule.record(config, seed, n, curve[n - 1])


def interleaved(configs: list[str], epochs: int, rng: random.Random) -> list[tuple[str, int]]:
    """A random interleaving of the configs' epoch completions (each config in epoch order)."""
    next_epoch = {c: 1 for c in configs}
    events = []
    while next_epoch:
        config = rng.choice(sorted(next_epoch))
        events.append((config, next_epoch[config]))
        next_epoch[config] += 1
        if next_epoch[config] > epochs:
            del next_epoch[config]
    return events


# ----------------------------------------------------------------------------- fast tests


@pytest.mark.parametrize("mode", ["max", "min"])
@pytest.mark.parametrize("order", ["config_major", "interleaved"])
def test_asha_matches_the_brute_force(mode, order):
    rng = random.Random(7)
    for trial in range(40):
        n_configs, epochs = rng.randint(2, 9), rng.randint(3, 12)
        curves = {f"c{i}": {s: [rng.random() for _ in range(epochs)] for s in range(3)} for i in range(n_configs)}
        grace, eta = rng.randint(1, 3), rng.randint(2, 4)
        if order == "config_major":
            events = [(c, n) for c in curves for n in range(1, epochs + 1)]
        else:
            events = interleaved(list(curves), epochs, rng)
        rule = ConfigSuccessiveHalving({c: range(3) for c in curves}, mode, grace, eta)
        for config in curves:
            rule.add_config(config, range(3), epochs)
        feed(rule, events, curves)
        expected = brute_force_asha(events, curves, mode, grace, eta, epochs)
        assert rule.stopped == expected, (trial, grace, eta)
        # a stop is at a rung, and the share of configs past a rung is about 1/eta
        assert all(n in rungs(grace, eta, epochs) for n in rule.stopped.values())


def test_asha_prunes_the_config_on_its_seed_mean_not_one_seed():
    rule = ConfigSuccessiveHalving(
        {"leader": [0, 1], "mixed": [0, 1], "third": [0, 1]}, "max", grace_epochs=2, reduction_factor=2
    )
    assert rule.record("leader", 0, 1, 0.5) == "continue"  # epoch 1 is no rung: no waiting
    rule.record("leader", 1, 1, 0.5)
    assert rule.record("leader", 0, 2, 0.5) == "wait"  # rung 2: seed 1 has not reported
    assert rule.record("leader", 1, 2, 0.5) == "continue"  # the first at a rung goes on
    for n in (1, 2):
        rule.record("mixed", 0, n, 0.9)  # one seed beats the leader alone
    assert rule.status("mixed", 0, 2) == "wait"
    rule.record("mixed", 1, 1, 0.0)
    assert rule.record("mixed", 1, 2, 0.0) == "stop"  # mean 0.45 < 0.5: not in the top 1/2
    assert rule.status("mixed", 0, 2) == "stop"  # every seed of the config stops at rung 2
    for seed in (0, 1):  # 3 configs at rung 2 keep ceil(3/2) = 2: the second best goes on
        rule.record("third", seed, 1, 0.4)
    rule.record("third", 0, 2, 0.47)
    assert rule.record("third", 1, 2, 0.47) == "continue"
    assert rule.stopped == {"mixed": 2}


def test_asha_rungs_and_no_decision_at_the_last_epoch():
    assert rungs(1, 3, 30) == [1, 3, 9, 27]
    assert rungs(2, 2, 16) == [2, 4, 8]  # 16 is the last epoch: no rung there
    rule = ConfigSuccessiveHalving({}, "max", grace_epochs=2, reduction_factor=2)
    assert [n for n in range(1, 40) if rule.decides_at("c", n)] == [2, 4, 8, 16, 32]
    rule.add_config("a", [0], epochs=4)
    rule.add_config("b", [0], epochs=4)
    for n in (1, 2, 3):
        rule.record("a", 0, n, 0.9)
    rule.record("b", 0, 1, 0.1)
    assert rule.record("b", 0, 2, 0.1) == "stop"  # rung 2 < 4 epochs
    rule.add_config("c", [0], epochs=4)
    for n in (1, 2, 3):
        rule.record("c", 0, n, 0.95)
    rule.record("a", 0, 4, 0.9)
    assert rule.record("c", 0, 4, 0.0) == "continue"  # 4 is c's last epoch: nothing to save
    assert "c" not in rule.stopped
    with pytest.raises(ValueError):
        ConfigSuccessiveHalving({}, "max", 1, 1)


def test_optuna_rule_waits_for_the_outside_decision_on_the_raw_seed_mean():
    rule = ConfigOptunaPruning({"a": [0, 1]}, "min")
    rule.add_config("a", [0, 1], epochs=5)
    assert rule.record("a", 0, 1, 0.2) == "wait"
    assert rule.record("a", 1, 1, 0.4) == "wait"
    assert list(rule.pending) == [("a", 1)]
    assert rule.raw_mean("a", 1) == pytest.approx(0.3)  # the metric, not the score (-0.3)
    rule.record("a", 0, 2, 0.1)  # seed 0 ran ahead: epoch 2 waits behind epoch 1's decision
    rule.record("a", 1, 2, 0.1)
    assert list(rule.pending) == [("a", 1)]
    rule.resolve("a", 1, stop=False)
    assert rule.status("a", 0, 1) == "continue" and list(rule.pending) == [("a", 2)]
    rule.resolve("a", 2, stop=True)
    assert rule.status("a", 1, 2) == "stop" and rule.stopped == {"a": 2}


def test_the_coordinator_answers_a_waiting_seed_when_its_config_is_decided(local_ray):
    """A seed that must wait makes one call, which returns once the decision exists: when the
    config's other seed reports, when it is gone for good, when the driver resolves an outside
    (Optuna) decision; with nothing new it returns 'wait' at its timeout."""
    import threading
    import time

    from studies.scheduling.coordinator import CoordinatorClient, SchedulerActor
    from studies.scheduling.early_stopping import ConfigEarlyStopper

    ray = local_ray
    actor = ray.remote(num_cpus=0)(SchedulerActor).remote(
        ConfigEarlyStopper, {"seeds": {"a": [0, 1], "b": [0, 1]}, "mode": "max", "grace_epochs": 1, "patience": 1}
    )
    assert ray.get(actor.record.remote("a", 0, 1, 0.5)) == "wait"
    waiting = actor.wait_decision.remote("a", 0, 1, 600.0)
    assert ray.wait([waiting], timeout=1.0)[0] == []  # nothing decided: the call waits
    assert ray.get(actor.record.remote("a", 1, 1, 0.7)) == "continue"
    assert ray.get(waiting, timeout=120) == "continue"

    assert ray.get(actor.record.remote("b", 0, 1, 0.1)) == "wait"
    assert ray.get(actor.wait_decision.remote("b", 0, 1, 0.2)) == "wait"  # its timeout
    waiting = actor.wait_decision.remote("b", 0, 1, 600.0)
    assert ray.wait([waiting], timeout=1.0)[0] == []
    ray.get(actor.mark_gone.remote("b", 1))  # b's mean is seed 0's alone, behind a's 0.6
    assert ray.get(waiting, timeout=120) == "stop"

    # a trial's side: seed 0 blocks in report_and_wait until seed 1 reports
    actor = ray.remote(num_cpus=0)(SchedulerActor).remote(ConfigOptunaPruning, {"seeds": {"c": [0, 1]}, "mode": "min"})
    clients = [CoordinatorClient(actor, "val/loss", {"config_id": "c", "seed": s}) for s in (0, 1)]
    answers = {}
    first = threading.Thread(target=lambda: answers.update({0: clients[0].report_and_wait(1, {"val/loss": 0.2})}))
    first.start()
    first.join(timeout=1.0)
    assert first.is_alive()  # waiting for seed 1
    second = threading.Thread(target=lambda: answers.update({1: clients[1].report_and_wait(1, {"val/loss": 0.4})}))
    second.start()
    pending, deadline = [], time.monotonic() + 120
    while not pending and time.monotonic() < deadline:  # the driver's side of an Optuna
        pending = ray.get(actor.pending.remote())  # pruner: resolve the pending mean
        time.sleep(0.05)
    assert pending == [("c", 1, pytest.approx(0.3))]
    ray.get(actor.resolve.remote([("c", 1, True)]))
    first.join(timeout=120)
    second.join(timeout=120)
    assert answers == {0: "stop", 1: "stop"}


STUDY = """
name: s
base:
  data: {name: synthetic, num_classes: 6, num_superclasses: 2, train_size: 60, val_size: 24,
         test_size: 24, form: features, feature_dim: 4}
  model: {name: mlp, hidden_dim: 8}
  loss: {name: ce}
  epochs: 6
  eval: {ks: [1, 3], selection: val/top3}
seeds: [0, 1]
"""


def problems_of(extra: str) -> str:
    with pytest.raises(StudyError) as info:
        parse_study(STUDY + extra, "s.yaml")
    return str(info.value)


def test_asha_scheduler_is_validated_with_clear_errors():
    study = parse_study(STUDY + "scheduler: {kind: asha, reduction_factor: 2}\n", "s.yaml")
    assert (study.scheduler.metric, study.scheduler.mode) == ("val/top3", "max")
    assert study.scheduler.grace_epochs == 1
    text = problems_of("scheduler: {kind: asha, grace_epochs: 6}\n")
    assert "scheduler.grace_epochs" in text and "expected grace_epochs < 6" in text
    text = problems_of("scheduler: {kind: asha, reduction_factor: 1}\n")
    assert "scheduler.reduction_factor" in text
    text = problems_of("scheduler: {kind: asha, patience: 2}\n")
    assert "unknown field 'patience'" in text and "reduction_factor" in text
    text = problems_of("scheduler: {kind: asha, metric: test/top1}\n")
    assert "asha needs a validation metric" in text
    text = problems_of("scheduler: {kind: hyperband}\n")
    assert "expected one of: none, early_stopping, asha" in text


OPTUNA = """
design:
  kind: optuna
  n_configs: 4
  parameters: {optim.lr: {loguniform: [0.01, 1.0]}}
"""


def test_optuna_pruner_is_validated_with_clear_errors():
    study = parse_study(STUDY + OPTUNA + "  pruner: {kind: median, n_warmup_steps: 2}\n", "s.yaml")
    ((_, block),) = study.optuna_blocks
    assert (block.pruner.kind, block.pruner.n_warmup_steps, block.pruner.n_startup_trials) == ("median", 2, 5)
    text = problems_of(OPTUNA + "  pruner: {kind: patient}\n")
    assert "design.pruner.kind" in text and "median, successive_halving, hyperband" in text
    text = problems_of(OPTUNA + "  pruner: {kind: hyperband, eta: 3}\n")
    assert "unknown field 'eta'" in text and "reduction_factor" in text
    text = problems_of(OPTUNA + "  pruner: {kind: median}\nscheduler: {kind: asha}\n")
    assert "design.pruner" in text and "expected one of them" in text
    text = problems_of(OPTUNA + "  pruner: {kind: successive_halving}\nobjective: {metric: test/top1}\n")
    assert "objective.metric" in text and "validation metric" in text


def test_optuna_pruner_builds_the_named_optuna_pruner():
    import optuna

    from studies.scheduling.optuna_pruning import optuna_pruner

    study = parse_study(
        STUDY + OPTUNA + "  pruner: {kind: hyperband, min_resource: 2, reduction_factor: 2}\n", "s.yaml"
    )
    pruner = optuna_pruner(study.optuna_blocks[0][1].pruner)
    assert isinstance(pruner, optuna.pruners.HyperbandPruner)
    assert (pruner._min_resource, pruner._reduction_factor) == (2, 2)


# ----------------------------------------------------------------------------- slow tests

#: scripted validation curves per lr: value(seed, n) for n = epochs done (1, 2, ...)
CURVES = {
    0.5: lambda seed, n: 0.5 + 0.01 * n,  # the leader
    0.4: lambda seed, n: 0.6 if n == 1 else 0.2,  # good at rung 1, then falls behind
    0.3: lambda seed, n: (0.9 if seed == 0 else 0.0) + 0.01 * n,  # one seed alone leads
    0.2: lambda seed, n: 0.55 + 0.01 * n,  # second best throughout
}
EPOCHS = 6


def curve_fit(config, seed, on_epoch=None, checkpoint=None):
    """A small function with the contract of setvalued.train.fit (docs/interfaces.md §4):
    validation curves fixed by CURVES, resumable from its own state."""
    import time

    lr = config["optim"]["lr"]
    start = 0 if checkpoint is None else checkpoint["epoch"] + 1
    best = None if checkpoint is None else tuple(checkpoint["best"])
    for epoch in range(start, config["epochs"]):
        value = CURVES[lr](seed, epoch + 1)
        if best is None or value > best[1]:
            best = (epoch, value)
        time.sleep(0.05)
        if on_epoch is not None:
            on_epoch(
                epoch,
                {"epoch": epoch, "train/loss": 1.0 - value, "val/top1": value, "lr": lr, "epoch_time_s": 0.05},
                {"epoch": epoch, "best": best, "config": dict(config)},
            )
    return {
        "best_epoch": best[0],
        "best_val": best[1],
        "test": {"top1": best[1]},
        "per_class": {"class": [0, 1], "top1": [best[1], best[1]]},
        "history": [],
    }


def curve_study(folder: Path, name: str, lrs, **extra) -> Path:
    study = yaml.safe_load(STUDY)
    study["name"] = name
    study["base"]["epochs"] = EPOCHS
    study["base"]["eval"] = {"ks": [1], "selection": "val/top1"}
    study.update(
        {
            "design": [{"kind": "grid", "parameters": {"optim.lr": list(lrs)}}],
            "resources": {"cpus": 1},
            "log_models": False,
            "objective": {"metric": "val/top1", "mode": "max"},
        }
    )
    study.update(extra)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def cell_runs(server: str, name: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(server)
    experiment = client.get_experiment_by_name(name)
    return [
        r
        for r in client.search_runs([experiment.experiment_id], max_results=1000)
        if r.data.tags.get("studies.role") == "cell"
    ]


@pytest.mark.slow
def test_asha_stops_the_bad_configs_at_their_rungs_with_all_seeds(local_ray, mlflow_server, tmp_path):
    from mlflow import MlflowClient

    from analysis.report import build_report

    lrs = [0.5, 0.4, 0.3, 0.2]  # design order = the order configs reach each rung
    path = curve_study(tmp_path, "asha-grid", lrs, scheduler={"kind": "asha", "grace_epochs": 1, "reduction_factor": 2})
    stream = io.StringIO()
    outcome = run_study(
        path,
        RunOptions(output=tmp_path / "out", tracking_uri=mlflow_server, report=False, stream=stream, fit_fn=curve_fit),
    )
    assert outcome.exit_code == 0, stream.getvalue()
    # one config at a time (2 slots, 2 seeds): configs complete their epochs in design order
    curves = {lr: {s: [CURVES[lr](s, n) for n in range(1, EPOCHS + 1)] for s in (0, 1)} for lr in lrs}
    expected = brute_force_asha(
        [(lr, n) for lr in lrs for n in range(1, EPOCHS + 1)], curves, "max", grace=1, eta=2, epochs=EPOCHS
    )
    assert expected == {0.4: 2, 0.3: 1}  # the scripted bad configs (0.3's seed 0 leads alone)
    client = MlflowClient(mlflow_server)
    seen = {}
    for run in cell_runs(mlflow_server, "asha-grid"):
        lr, seed = float(run.data.params["optim.lr"]), int(run.data.params["seed"])
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "val/top1"))
        tags = run.data.tags
        seen[(lr, seed)] = (
            len(steps),
            tags.get("studies.stopped_epoch"),
            tags.get("studies.pruned"),
            tags["studies.status"],
        )
    for lr in lrs:
        for seed in (0, 1):
            if lr in expected:
                assert seen[(lr, seed)] == (expected[lr], str(expected[lr]), "asha", "finished")
            else:
                assert seen[(lr, seed)] == (EPOCHS, None, None, "finished")

    # the report leaves the pruned configs out of its tables, with a note, unless asked
    report_dir = tmp_path / "report"
    study = yaml.safe_load(path.read_text())
    study["report"] = {"tables": [{"metrics": ["test/top1"]}]}
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    text = (
        Path(build_report(mlflow_server, "asha-grid", report_dir, study_file=path))
        .with_suffix(".md")
        .read_text(encoding="utf-8")
    )
    assert "2 configs pruned (asha): 1 at epoch 1, 1 at epoch 2; not shown" in text
    table_rows = [line for line in text.splitlines() if line.startswith("| ") and "0.4" in line]
    assert not table_rows, table_rows
    study["report"]["show_pruned"] = True
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    text = (
        Path(build_report(mlflow_server, "asha-grid", tmp_path / "report2", study_file=path))
        .with_suffix(".md")
        .read_text(encoding="utf-8")
    )
    assert "not shown" not in text
    assert [line for line in text.splitlines() if line.startswith("| ") and "0.4" in line]


def median_fit(config, seed, on_epoch=None, checkpoint=None):
    """Curves linear in lr: value = lr + 0.1 * seed + 0.01 * n (seed means lr + 0.05 + 0.01 n)."""
    import time

    lr = config["optim"]["lr"]
    start = 0 if checkpoint is None else checkpoint["epoch"] + 1
    best = None if checkpoint is None else tuple(checkpoint["best"])
    for epoch in range(start, config["epochs"]):
        value = lr + 0.1 * seed + 0.01 * (epoch + 1)
        if best is None or value > best[1]:
            best = (epoch, value)
        time.sleep(0.05)
        if on_epoch is not None:
            on_epoch(
                epoch,
                {"epoch": epoch, "val/top1": value, "epoch_time_s": 0.05},
                {"epoch": epoch, "best": best, "config": dict(config)},
            )
    return {
        "best_epoch": best[0],
        "best_val": best[1],
        "test": {"top1": best[1]},
        "per_class": {"class": [0, 1], "top1": [best[1], best[1]]},
        "history": [],
    }


@pytest.mark.slow
def test_optuna_median_pruner_prunes_configs_on_their_seed_means(local_ray, mlflow_server, tmp_path):
    import optuna

    path = curve_study(
        tmp_path,
        "optuna-median",
        [0.3],
        design=[
            {
                "kind": "optuna",
                "n_configs": 5,
                "sampler": "random",
                "sampler_seed": 0,
                "parameters": {"optim.lr": {"uniform": [0.01, 0.5]}},
                "pruner": {"kind": "median", "n_startup_trials": 1, "n_warmup_steps": 2},
            }
        ],
    )
    stream = io.StringIO()
    outcome = run_study(
        path,
        RunOptions(output=tmp_path / "out", tracking_uri=mlflow_server, report=False, stream=stream, fit_fn=median_fit),
    )
    assert outcome.exit_code == 0, stream.getvalue()
    storage = f"sqlite:///{tmp_path / 'out' / 'optuna-median' / 'optuna.db'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    trials = optuna.load_study(study_name=summary.study_name, storage=storage).trials
    assert len(trials) == 5
    runs: dict[str, list] = {}
    for run in cell_runs(mlflow_server, "optuna-median"):
        runs.setdefault(run.data.tags["studies.config_id"], []).append(run)
    states = []
    completed: list[dict] = []  # intermediate values of the configs told COMPLETE so far
    for trial in sorted(trials, key=lambda t: t.number):
        lr = trial.params["optim.lr"]
        cells = runs[trial.user_attrs["config_id"]]
        assert len(cells) == 2  # every config on both seeds
        # the intermediate values are the seed means after each epoch done (step = n)
        for step, value in trial.intermediate_values.items():
            assert value == pytest.approx(lr + 0.05 + 0.01 * step)
        # the median rule, written out: from step 2 (warm-up) on, once a config is complete, a
        # config is pruned at the first step where its best mean so far (the curves rise: its
        # mean there) is below the median of the completed configs' means at that step
        expected_stop = None
        if completed:
            for n in range(2, EPOCHS):
                median = float(
                    sorted(v[n] for v in completed)[(len(completed) - 1) // 2]
                    if len(completed) % 2
                    else sum(sorted(v[n] for v in completed)[len(completed) // 2 - 1 : len(completed) // 2 + 1]) / 2
                )
                if lr + 0.05 + 0.01 * n < median:
                    expected_stop = n
                    break
        stops = {run.data.tags.get("studies.stopped_epoch") for run in cells}
        pruned = {run.data.tags.get("studies.pruned") for run in cells}
        if expected_stop is None:
            assert trial.state == optuna.trial.TrialState.COMPLETE, lr
            assert stops == {None} and pruned == {None}
            assert max(trial.intermediate_values) == EPOCHS - 1  # no report at the last epoch
            completed.append({n: lr + 0.05 + 0.01 * n for n in range(1, EPOCHS)})
        else:
            assert trial.state == optuna.trial.TrialState.PRUNED, lr
            assert stops == {str(expected_stop)} and pruned == {"optuna"}
            assert max(trial.intermediate_values) == expected_stop
            assert trial.value == pytest.approx(lr + 0.05 + 0.01 * expected_stop)
        states.append(trial.state)
    assert optuna.trial.TrialState.PRUNED in states, [t.params for t in trials]
    # the summary says how many configs were pruned; the progress agrees with it
    from tests.test_console import check_progress_counts

    pruned = states.count(optuna.trial.TrialState.PRUNED)
    text = stream.getvalue()
    assert "optuna design[0]: 5 configs asked: " in text and f"{pruned} pruned" in text, text
    assert "left out of the report unless report.show_pruned" in text
    assert check_progress_counts(text)[-1][:2] == (10, 10)
