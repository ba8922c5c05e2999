"""Pruning configs, not trials (`studies.config_schedulers`): ASHA and Optuna's pruners on
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

from studies.config_schedulers import ConfigOptunaPruning, ConfigSuccessiveHalving, rungs
from studies.problems import StudyError
from studies.runner import RunOptions, run_study
from studies.spec import parse_study

# ----------------------------------------------------------------------------- brute force


def brute_force_asha(events: list[tuple[str, int]], curves: dict, mode: str, grace: int,
                     eta: int, epochs: int | None = None) -> dict:
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
        mean = sum(sign * (s[n - 1] if s[n - 1] == s[n - 1] else -math.inf * sign)
                   for s in seeds.values()) / len(seeds)
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
        curves = {f"c{i}": {s: [rng.random() for _ in range(epochs)] for s in range(3)}
                  for i in range(n_configs)}
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
    rule = ConfigSuccessiveHalving({"leader": [0, 1], "mixed": [0, 1], "third": [0, 1]},
                                   "max", grace_epochs=2, reduction_factor=2)
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
    study = parse_study(STUDY + OPTUNA + "  pruner: {kind: median, n_warmup_steps: 2}\n",
                        "s.yaml")
    (_, block), = study.optuna_blocks
    assert (block.pruner.kind, block.pruner.n_warmup_steps, block.pruner.n_startup_trials) == \
        ("median", 2, 5)
    text = problems_of(OPTUNA + "  pruner: {kind: patient}\n")
    assert "design.pruner.kind" in text and "median, successive_halving, hyperband" in text
    text = problems_of(OPTUNA + "  pruner: {kind: hyperband, eta: 3}\n")
    assert "unknown field 'eta'" in text and "reduction_factor" in text
    text = problems_of(OPTUNA + "  pruner: {kind: median}\nscheduler: {kind: asha}\n")
    assert "design.pruner" in text and "expected one of them" in text
    text = problems_of(OPTUNA + "  pruner: {kind: successive_halving}\n"
                       "objective: {metric: test/top1}\n")
    assert "objective.metric" in text and "validation metric" in text


def test_optuna_pruner_builds_the_named_optuna_pruner():
    import optuna

    from studies.config_schedulers.optuna_pruning import optuna_pruner

    study = parse_study(STUDY + OPTUNA + "  pruner: {kind: hyperband, min_resource: 2, "
                        "reduction_factor: 2}\n", "s.yaml")
    pruner = optuna_pruner(study.optuna_blocks[0][1].pruner)
    assert isinstance(pruner, optuna.pruners.HyperbandPruner)
    assert (pruner._min_resource, pruner._reduction_factor) == (2, 2)
