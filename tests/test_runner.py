"""studies.running.runner and studies.running.trial on a real local Ray and a real MLflow server.

Fast tests: the per-config early-stopping rule (`ConfigEarlyStopper`) against a direct
computation, the progress/ETA bookkeeping, and the finalisation of a stopped cell with the
real `setvalued.train.fit`.

Slow tests (`@pytest.mark.slow`, a local Ray with 2 CPUs, the `mlflow_server` fixture):
- 2 configs x 2 seeds with the real `fit` on synthetic data: 4 child runs under one parent,
  params, tags, per-epoch and test metrics, per-class artifact; running again adds nothing;
- a trial whose worker process is SIGKILLed after epoch 1 on its first attempt restarts
  from the epoch-1 checkpoint, logs each epoch once and ends exactly as an uninterrupted run;
- early stopping stops a config (all its seeds, at the same epoch) on its seed mean, even
  when one of its seeds alone beats the leader;
- a cell with a NaN loss fails with its error, the others finish, the exit code is 1;
- an optuna block: each proposal runs on every seed and Optuna is told the seed mean.
The driver-kill/resume check is in tests/test_cli.py (it runs the CLI in a subprocess).
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
import signal
from pathlib import Path

import pytest
import yaml

from studies.cells.cell_queue import config_major
from studies.running.progress import StudyProgress, format_duration
from studies.running.runner import RunOptions, run_study
from studies.scheduling import ConfigEarlyStopper

# ----------------------------------------------------------------------------- study files


def tiny_base(epochs: int = 2) -> dict:
    return {
        "data": {
            "name": "synthetic",
            "num_classes": 6,
            "num_superclasses": 2,
            "train_size": 120,
            "val_size": 48,
            "test_size": 48,
            "form": "features",
            "feature_dim": 8,
        },
        "model": {"name": "mlp", "hidden_dim": 16},
        "loss": {"name": "ce"},
        "optim": {"lr": 0.1, "batch_size": 32, "milestones": []},
        "epochs": epochs,
        "eval": {"ks": [1, 3], "selection": "val/top3"},
        "device": "cpu",
    }


def write_study(folder: Path, name: str, lrs, seeds=(0, 1), epochs: int = 2, **extra) -> Path:
    study = {
        "name": name,
        "description": "test study",
        "base": tiny_base(epochs),
        "design": [{"kind": "grid", "parameters": {"optim.lr": list(lrs)}}],
        "seeds": list(seeds),
        "resources": {"cpus": 1},
        "max_failures": 1,
        "log_models": False,
    }  # tests/test_model_logging.py covers the models
    study.update(extra)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


# ----------------------------------------------------------------------------- fast tests


def brute_force_stops(curves: dict, mode: str, grace: int, patience: int) -> dict:
    """The early-stopping rule written out directly, configs completing epochs in order."""
    sign = 1.0 if mode == "max" else -1.0
    best: dict[int, float] = {}
    stops = {}
    for config, seeds in curves.items():  # configs complete their epochs in this order
        behind = 0
        for n in range(1, len(next(iter(seeds.values()))) + 1):
            mean = sum(sign * s[n - 1] for s in seeds.values()) / len(seeds)
            best[n] = max(best.get(n, -math.inf), mean)
            if n < grace:
                continue
            behind = behind + 1 if mean < best[n] else 0
            if behind >= patience:
                stops[config] = n
                break
    return stops


@pytest.mark.parametrize("mode", ["max", "min"])
def test_early_stopper_matches_the_rule(mode):
    import random

    rng = random.Random(3)
    for trial in range(30):
        curves = {f"c{i}": {s: [rng.random() for _ in range(8)] for s in range(3)} for i in range(4)}
        grace, patience = rng.randint(0, 3), rng.randint(1, 3)
        stopper = ConfigEarlyStopper({c: range(3) for c in curves}, mode, grace, patience)
        for config, seeds in curves.items():
            for n in range(1, 9):
                for seed, curve in seeds.items():
                    stopper.record(config, seed, n, curve[n - 1])
                if config in stopper.stopped:
                    break
        assert stopper.stopped == brute_force_stops(curves, mode, grace, patience), trial


def test_early_stopper_decides_on_the_seed_mean_not_one_seed():
    stopper = ConfigEarlyStopper({"leader": [0, 1], "mixed": [0, 1]}, "max", grace_epochs=1, patience=1)
    assert stopper.record("leader", 0, 1, 0.5) == "wait"  # seed 1 has not reported epoch 1
    assert stopper.status("leader", 0, 1) == "wait"
    assert stopper.record("leader", 1, 1, 0.5) == "continue"
    assert stopper.record("mixed", 0, 1, 0.9) == "wait"  # one good seed decides nothing
    assert stopper.record("mixed", 1, 1, 0.0) == "stop"  # mean 0.45 < 0.5
    assert stopper.status("mixed", 0, 1) == "stop"  # every seed of the config stops
    assert stopper.stopped == {"mixed": 1}


def test_early_stopper_waits_before_grace_never_and_drops_failed_seeds():
    stopper = ConfigEarlyStopper({"a": [0, 1], "b": [0, 1]}, "max", grace_epochs=3, patience=1)
    assert stopper.record("a", 0, 1, 0.1) == "continue"  # before grace: no waiting
    assert stopper.record("a", 0, 2, 0.1) == "continue"
    for n in (1, 2, 3):
        stopper.record("a", 1, n, 0.8)
    assert stopper.record("a", 0, 3, 0.8) == "continue"
    assert stopper.record("b", 0, 3, float("nan")) == "wait"
    stopper.mark_gone("b", 1)  # seed 1 failed for good: b's mean is its seed 0 alone
    stopper.record("b", 0, 1, 0.9)
    stopper.record("b", 0, 2, 0.9)
    assert stopper.status("b", 0, 3) == "stop"  # NaN is the worst value
    with pytest.raises(ValueError):
        ConfigEarlyStopper({}, "best", 1, 1)


def test_early_stopper_replays_a_stop_decided_in_an_earlier_run():
    """Seed 0 finished (stopped at epoch 3) in an earlier run; the re-run seed 1 runs to
    epoch 3 without waiting and stops there."""
    stopper = ConfigEarlyStopper({"a": [0, 1]}, "max", grace_epochs=1, patience=1)
    for n in (1, 2, 3):
        stopper.record("a", 0, n, 0.1)
    stopper.mark_stopped("a", 3)
    assert [stopper.record("a", 1, n, 0.9) for n in (1, 2, 3)] == ["continue", "continue", "stop"]


def test_progress_counts_and_eta():
    progress = StudyProgress(
        total=6, to_run=4, done_before=2, epochs={"a": 4, "b": 4, "c": 4, "d": 4}, started_at=100.0
    )
    assert progress.eta_s(now=110.0) is None  # nothing done yet
    progress.start("a")
    progress.start("b")
    progress.epoch("a", 1, now=110.0)  # the first progress: the pace is measured from here
    progress.epoch("b", 1, now=110.0)
    assert progress.eta_s(now=110.0) is None and "ETA" not in progress.line(now=110.0)
    progress.epoch("a", 2, now=115.0)
    progress.epoch("b", 2, now=115.0)
    # from 1/16 (a's first epoch) to 4/16 of the work in 5 s -> 12/16 left in 20 s
    assert progress.eta_s(now=115.0) == pytest.approx(20.0)
    progress.finish("a", now=120.0)
    progress.fail("b", "NonFiniteLossError: nan", now=120.0)
    assert (len(progress.finished), len(progress.failed), len(progress.running), progress.left) == (1, 1, 0, 2)
    line = progress.line(now=120.0)
    assert "done 3/6" in line and "failed 1" in line and "left 2" in line
    assert "ETA 0:00:11" in line  # 7/16 of the work in 10 s since the first progress, 8/16 left
    assert format_duration(3725) == "1:02:05"


def test_the_eta_leaves_the_start_up_out():
    """The quickstart's first ETA said 1:02:51 for a study of about five minutes (issue 42): 15
    cells of 15 epochs, two at a time, the first epoch 17 s after the start (Ray, workers,
    imports). The ETA now waits for a pace and measures it from the first epoch: about the
    time the epochs left take at the pace the epochs came (one second each, two at a time)."""
    progress = StudyProgress(total=15, to_run=15, epochs={f"c{i}-s0": 15 for i in range(15)}, started_at=0.0)
    progress.start("c0-s0")
    progress.start("c1-s0")
    progress.epoch("c0-s0", 1, now=17.0)
    assert progress.eta_s(now=17.0) is None  # one point: no pace yet
    progress.epoch("c1-s0", 1, now=17.5)
    for second in range(1, 5):
        progress.epoch("c0-s0", 1 + second, now=17.0 + second)
        progress.epoch("c1-s0", 1 + second, now=17.5 + second)
    eta = progress.eta_s(now=21.5)
    left = (15 * 15 - 10) / 2.0  # epochs left, two a second
    assert 0.8 * left <= eta <= 1.25 * left, eta
    started_then = 21.5 * (1 - progress.fraction_done()) / progress.fraction_done()  # the old estimate
    assert started_then > 4 * left


def test_config_major_order_keeps_seeds_together():
    from studies.cells.space import Cell

    cells = [Cell("b", 1, "v", {}), Cell("a", 0, "v", {}), Cell("b", 0, "v", {}), Cell("a", 1, "v", {})]
    assert [c.cell_id for c in config_major(cells)] == ["b-s0", "b-s1", "a-s0", "a-s1"]


def test_stopped_cell_finalises_with_the_real_fit():
    """The finalisation of an early-stopped cell: fit from the state after the last epoch
    done, with `epochs` cut to it, trains nothing more and tests the checkpoint selected
    over those epochs: the same result as a run of that many epochs."""
    import torch

    from setvalued.training import fit
    from studies.running.trial import with_epochs

    torch.set_num_threads(1)
    config = tiny_base(epochs=3)
    states = {}
    fit(config, 0, on_epoch=lambda e, m, s: states.__setitem__(e, s))
    short = dict(config, epochs=2)
    calls = []
    stopped = fit(short, 0, on_epoch=lambda *a: calls.append(a), checkpoint=with_epochs(states[1], 2))
    assert calls == []  # nothing trained
    reference = fit(short, 0)
    assert stopped["best_epoch"] == reference["best_epoch"]
    assert stopped["test"] == pytest.approx(reference["test"])


# ----------------------------------------------------------------------------- slow tests


def options(tmp_path: Path, server: str, **kw) -> RunOptions:
    return RunOptions(
        output=tmp_path / "out",
        tracking_uri=server,
        report=False,
        progress_interval_s=5.0,
        stream=kw.pop("stream", io.StringIO()),
        **kw,
    )


def child_runs(server: str, name: str, deleted: bool = False) -> list:
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    client = MlflowClient(server)
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return []
    view = ViewType.DELETED_ONLY if deleted else ViewType.ACTIVE_ONLY
    return [
        r
        for r in client.search_runs([experiment.experiment_id], run_view_type=view, max_results=1000)
        if r.data.tags.get("studies.role") == "cell"
    ]


@pytest.mark.slow
def test_two_configs_two_seeds_complete_and_rerun_adds_nothing(local_ray, mlflow_server, tmp_path):
    from mlflow import MlflowClient

    from studies.cells.space import expand
    from studies.studyfile.spec import load_study

    path = write_study(tmp_path, "runner-grid", lrs=[0.05, 0.1], epochs=2)
    cells = {c.cell_id: c for c in expand(load_study(path))}
    stream = io.StringIO()
    outcome = run_study(path, options(tmp_path, mlflow_server, stream=stream))
    assert outcome.exit_code == 0, stream.getvalue()
    assert (outcome.cells, outcome.finished) == (4, 4)

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("runner-grid")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("studies.role") == "parent"]
    children = [r for r in runs if r.data.tags.get("studies.role") == "cell"]
    assert len(parents) == 1 and len(children) == 4
    parent = parents[0]
    artifacts = [a.path for a in client.list_artifacts(parent.info.run_id)]
    assert artifacts == ["environment.json", "study.yaml", "versions"]  # the driver's manifest (#39)
    version = parent.data.tags["studies.version"]  # the study's version, on every run (#33)
    assert [a.path for a in client.list_artifacts(parent.info.run_id, f"versions/{version}")] == [
        f"versions/{version}/definition.json",
        f"versions/{version}/study.yaml",
    ]
    assert {r.data.tags["studies.version"] for r in children} == {version}
    assert {r.data.tags["studies.cell_id"] for r in children} == set(cells)
    for run in children:
        tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
        cell = cells[tags["studies.cell_id"]]
        assert tags["mlflow.parentRunId"] == parents[0].info.run_id
        assert tags["studies.study"] == "runner-grid"
        assert tags["studies.config_id"] == cell.config_id
        assert tags["studies.seed"] == str(cell.seed) == params["seed"]
        assert tags["studies.variant"] == cell.variant
        assert json.loads(tags["studies.swept"]) == cell.swept
        assert tags["studies.status"] == "finished"
        assert float(params["optim.lr"]) == cell.config["optim"]["lr"]
        assert params["epochs"] == "2" and params["model.hidden_dim"] == "16"
        for key in ("train/loss", "val/top3", "lr", "epoch_time_s", "grad_nonzero"):
            steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
            assert steps == [0, 1], key
        for key in ("test/top1", "test/top3", "best_epoch", "best_val"):
            assert key in metrics
        assert 0.0 <= metrics["test/top3"] <= 1.0
        assert metrics["lr"] == pytest.approx(cell.config["optim"]["lr"])
        assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["per_class_test.parquet"]
    text = stream.getvalue()
    assert "done 4/4" in text and "MLflow UI" in text

    # running the same file again creates nothing new and starts no trial
    before = {r.info.run_id for r in children}
    stream = io.StringIO()
    again = run_study(path, options(tmp_path, mlflow_server, stream=stream))
    assert again.exit_code == 0
    after = child_runs(mlflow_server, "runner-grid")
    assert {r.info.run_id for r in after} == before
    assert child_runs(mlflow_server, "runner-grid", deleted=True) == []
    assert "4 cells already finished" in stream.getvalue()
    assert "running 4 cells" not in stream.getvalue()


def killing_fit(config, seed, on_epoch=None, checkpoint=None, *, marker: str, record: str, kill_after_epoch: int):
    """The real fit; on its first attempt the worker process kills itself (SIGKILL) right
    after epoch `kill_after_epoch` was reported. Every attempt appends what it saw."""
    from setvalued.training import fit

    seen = {
        "checkpoint_epoch": None if checkpoint is None else int(checkpoint["epoch"]),
        "epochs": [],
        "pid": os.getpid(),
    }

    def wrapped(epoch, metrics, state):
        on_epoch(epoch, metrics, state)
        seen["epochs"].append(epoch)
        with open(record, "a") as handle:
            handle.write(json.dumps(seen) + "\n")
        if epoch == kill_after_epoch and not os.path.exists(marker):
            Path(marker).write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)

    return fit(config, seed, on_epoch=wrapped, checkpoint=checkpoint)


@pytest.mark.slow
@pytest.mark.parametrize("interval_s", [0, 3600])
def test_trial_whose_worker_dies_resumes_from_its_checkpoint(local_ray, mlflow_server, tmp_path, interval_s):
    """With a checkpoint every epoch (interval 0) the retry resumes after epoch 1; with one
    checkpoint an hour, the cell had none yet, and neither had MLflow any epoch: the retry
    trains from scratch and every epoch is logged exactly once either way."""
    import torch
    from mlflow import MlflowClient

    from setvalued.training import fit
    from studies.cells.space import expand
    from studies.studyfile.spec import load_study

    name = f"runner-kill-{interval_s}"  # one study per case on the module's MLflow server
    path = write_study(tmp_path, name, lrs=[0.1], seeds=[3], epochs=4, checkpoint_interval_s=interval_s)
    marker, record = tmp_path / "killed", tmp_path / "attempts.jsonl"
    fit_fn = functools.partial(killing_fit, marker=str(marker), record=str(record), kill_after_epoch=1)
    stream = io.StringIO()
    outcome = run_study(path, options(tmp_path, mlflow_server, fit_fn=fit_fn, stream=stream))
    assert outcome.exit_code == 0, stream.getvalue()
    assert marker.exists()

    attempts = {}  # pid -> the last line of its attempt, in the order the attempts ran
    for line in record.read_text().splitlines():
        seen = json.loads(line)
        attempts[seen["pid"]] = seen
    first, second = attempts.values()
    assert first == {**first, "checkpoint_epoch": None, "epochs": [0, 1]}
    if interval_s == 0:
        assert second["checkpoint_epoch"] == 1 and second["epochs"] == [2, 3]
    else:
        assert second["checkpoint_epoch"] is None and second["epochs"] == [0, 1, 2, 3]
    assert "restarting from its last checkpoint" in stream.getvalue()

    (run,) = child_runs(mlflow_server, name)
    client = MlflowClient(mlflow_server)
    assert run.data.tags["studies.status"] == "finished"
    assert run.data.tags.get("studies.resumed_from_epoch") == ("1" if interval_s == 0 else None)
    history = client.get_metric_history(run.info.run_id, "val/top3")
    assert sorted(m.step for m in history) == [0, 1, 2, 3]  # each epoch exactly once

    # bit for bit on CPU: the resumed run ends as the uninterrupted one
    torch.set_num_threads(1)
    (cell,) = expand(load_study(path))
    reference = fit(cell.config, cell.seed)
    expected = {h["epoch"]: h["val/top3"] for h in reference["history"]}
    assert {m.step: m.value for m in history} == pytest.approx(expected)
    for key, value in reference["test"].items():
        assert run.data.metrics[f"test/{key}"] == pytest.approx(value), key


#: scripted validation curves: value = SCRIPT[lr][seed] + 0.01 * epoch
SCRIPT = {0.3: (0.5, 0.5), 0.2: (0.1, 0.6), 0.1: (0.05, 0.05), 0.4: (0.5, 0.5)}


def scripted_fit(config, seed, on_epoch=None, checkpoint=None):
    """A small function with the contract of setvalued.train.fit (docs/interfaces.md §4):
    validation curves fixed by SCRIPT, resumable from its own state, NaN for lr 0.4 seed 1
    (raises the real NonFiniteLossError)."""
    import time

    from setvalued.training import NonFiniteLossError

    lr = config["optim"]["lr"]
    start = 0 if checkpoint is None else checkpoint["epoch"] + 1
    best = None if checkpoint is None else tuple(checkpoint["best"])
    for epoch in range(start, config["epochs"]):
        if lr == 0.4 and seed == 1 and epoch == 1:
            raise NonFiniteLossError(epoch, 0, float("nan"))
        value = SCRIPT[lr][seed] + 0.01 * epoch
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
        "test": {"top1": best[1] - 0.01},
        "per_class": {"class": [0, 1], "top1": [best[1], best[1]]},
        "history": [],
    }


def scripted_study(tmp_path: Path, name: str, lrs, **extra) -> Path:
    path = write_study(tmp_path, name, lrs=lrs, epochs=6, **extra)
    study = yaml.safe_load(path.read_text())
    study["base"]["eval"] = {"ks": [1], "selection": "val/top1"}
    study["objective"] = {"metric": "val/top1", "mode": "max"}
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


@pytest.mark.slow
def test_early_stopping_stops_all_seeds_of_a_config_on_its_mean(local_ray, mlflow_server, tmp_path):
    from mlflow import MlflowClient

    path = scripted_study(
        tmp_path,
        "runner-early",
        lrs=[0.3, 0.2, 0.1],
        scheduler={"kind": "early_stopping", "grace_epochs": 2, "patience": 2},
    )
    stream = io.StringIO()
    outcome = run_study(path, options(tmp_path, mlflow_server, fit_fn=scripted_fit, stream=stream))
    assert outcome.exit_code == 0, stream.getvalue()
    client = MlflowClient(mlflow_server)
    epochs = {}
    for run in child_runs(mlflow_server, "runner-early"):
        lr = float(run.data.params["optim.lr"])
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "val/top1"))
        epochs[(lr, int(run.data.params["seed"]))] = (
            steps,
            run.data.tags.get("studies.stopped_epoch"),
            run.data.tags["studies.status"],
            run.data.metrics.get("test/top1"),
        )
    # the leader runs its 6 epochs; the others are behind at epochs 2 and 3 (patience 2)
    # and stop after 3 epochs with both seeds, though seed 1 of lr 0.2 alone beats the leader
    assert epochs[(0.3, 0)][:2] == ([0, 1, 2, 3, 4, 5], None)
    assert epochs[(0.3, 1)][:2] == ([0, 1, 2, 3, 4, 5], None)
    for key in [(0.2, 0), (0.2, 1), (0.1, 0), (0.1, 1)]:
        assert epochs[key][:3] == ([0, 1, 2], "3", "finished"), key
    # test metrics of the checkpoint selected over the epochs it ran
    assert epochs[(0.2, 1)][3] == pytest.approx(0.6 + 0.02 - 0.01)

    # resume after losing one seed of the stopped config: the earlier runs are replayed
    # into the new session, and the re-run seed stops at its config's epoch too
    (lost,) = [
        r
        for r in child_runs(mlflow_server, "runner-early")
        if r.data.params["optim.lr"] == "0.2" and r.data.params["seed"] == "1"
    ]
    client.delete_run(lost.info.run_id)
    again = run_study(path, options(tmp_path, mlflow_server, fit_fn=scripted_fit))
    assert again.exit_code == 0
    (rerun,) = [
        r
        for r in child_runs(mlflow_server, "runner-early")
        if r.data.params["optim.lr"] == "0.2" and r.data.params["seed"] == "1"
    ]
    assert rerun.info.run_id != lost.info.run_id
    steps = sorted(m.step for m in client.get_metric_history(rerun.info.run_id, "val/top1"))
    assert steps == [0, 1, 2] and rerun.data.tags["studies.stopped_epoch"] == "3"
    assert len(child_runs(mlflow_server, "runner-early")) == 6


@pytest.mark.slow
def test_failed_cell_is_reported_and_does_not_stop_the_others(local_ray, mlflow_server, tmp_path):
    path = scripted_study(tmp_path, "runner-nan", lrs=[0.4, 0.3])
    stream = io.StringIO()
    outcome = run_study(path, options(tmp_path, mlflow_server, fit_fn=scripted_fit, stream=stream))
    assert outcome.exit_code == 1
    assert outcome.finished == 3 and len(outcome.failed) == 1
    ((failed_cell, error),) = outcome.failed.items()
    assert failed_cell.endswith("-s1") and "NonFiniteLossError" in error
    text = stream.getvalue()
    assert "cell base lr=0.4 s1 FAILED: NonFiniteLossError" in text  # its run name, not its hash
    assert f"base lr=0.4 s1 ({failed_cell}): " in text  # the summary names it too
    runs = {r.data.tags["studies.cell_id"]: r for r in child_runs(mlflow_server, "runner-nan")}
    assert runs[failed_cell].data.tags["studies.status"] == "failed"
    assert "epoch 1" in runs[failed_cell].data.tags["studies.error"]
    assert runs[failed_cell].info.status == "FAILED"
    # a deterministic failure is not retried: one attempt only (no worker restart message)
    assert "restarting" not in text


@pytest.mark.slow
def test_optuna_block_runs_every_seed_and_tells_the_seed_mean(local_ray, mlflow_server, tmp_path):
    import optuna

    path = scripted_study(tmp_path, "runner-optuna", lrs=[0.3])
    study = yaml.safe_load(path.read_text())
    study["design"] = [
        {"kind": "optuna", "n_configs": 3, "sampler_seed": 0, "parameters": {"optim.lr": {"choice": [0.1, 0.2, 0.3]}}}
    ]
    study["base"]["epochs"] = 2
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    stream = io.StringIO()
    outcome = run_study(path, options(tmp_path, mlflow_server, fit_fn=scripted_fit, stream=stream))
    assert outcome.exit_code == 0, stream.getvalue()
    # the progress counts the proposals not asked yet and agrees with the summary
    from tests.test_console import check_progress_counts

    lines = check_progress_counts(stream.getvalue())
    assert lines[0][4] > 0, lines  # left: the cells of the proposals not asked yet
    assert "optuna design[0]: 3 configs asked: 3 complete; best base lr=" in stream.getvalue()
    storage = f"sqlite:///{tmp_path / 'out' / 'runner-optuna' / 'optuna.db'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    trials = optuna.load_study(study_name=summary.study_name, storage=storage).trials
    assert len(trials) == 3
    runs = child_runs(mlflow_server, "runner-optuna")
    by_config: dict[str, list] = {}
    for run in runs:
        by_config.setdefault(run.data.tags["studies.config_id"], []).append(run)
    assert all(len(v) == 2 for v in by_config.values())  # every proposal on both seeds
    # a config asked twice runs once: the last progress line counts the cells that ran
    assert lines[-1][:2] == (len(runs), len(runs)), lines
    for trial in trials:
        assert trial.state == optuna.trial.TrialState.COMPLETE
        lr = trial.params["optim.lr"]
        # objective val/top1 at the best epoch = the last (curves increase): mean of seeds
        expected = (SCRIPT[lr][0] + SCRIPT[lr][1]) / 2 + 0.01
        assert trial.value == pytest.approx(expected)
        assert len(by_config[trial.user_attrs["config_id"]]) == 2
    # resuming adds nothing: the three proposals are done
    before = {r.info.run_id for r in runs}
    again = run_study(path, options(tmp_path, mlflow_server, fit_fn=scripted_fit))
    assert again.exit_code == 0
    assert {r.info.run_id for r in child_runs(mlflow_server, "runner-optuna")} == before
    assert len(optuna.load_study(study_name=summary.study_name, storage=storage).trials) == 3


@pytest.mark.slow
def test_a_long_list_of_cells_runs_as_consecutive_experiments(local_ray, mlflow_server, tmp_path, monkeypatch):
    """Past MAX_TRIALS_PER_EXPERIMENT cells the runner starts one Tune experiment per part
    (whole configs), the progress counts going on across them."""
    import studies.cells.arrays as arrays
    import studies.running.tune_experiment as tune_experiment

    monkeypatch.setattr(arrays, "MAX_TRIALS_PER_EXPERIMENT", 2)
    started = []
    real = tune_experiment.run_experiment

    def counted(searcher, **kwargs):
        started.append(sorted(searcher.payloads))  # the part's cells, before any is handed out
        return real(searcher, **kwargs)

    monkeypatch.setattr(tune_experiment, "run_experiment", counted)
    path = scripted_study(tmp_path, "runner-parts", lrs=[0.1, 0.2, 0.3])
    study = yaml.safe_load(path.read_text())
    study["base"]["epochs"] = 1
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    stream = io.StringIO()
    outcome = run_study(path, options(tmp_path, mlflow_server, fit_fn=scripted_fit, stream=stream))
    assert outcome.exit_code == 0 and outcome.finished == 6, stream.getvalue()
    # three configs of two seeds: an experiment per config, its two seeds together
    assert [{cell.rsplit("-s", 1)[1] for cell in part} for part in started] == [{"0", "1"}] * 3
    assert len({cell.rsplit("-s", 1)[0] for part in started for cell in part}) == 3
    # without a terminal each line starts with the time (HH:MM:SS)
    finals = [line[9:] for line in stream.getvalue().splitlines() if line[9:].startswith("[studies] done")]
    assert finals[-1].startswith("[studies] done 6/6"), finals
    assert len({r.data.tags["studies.cell_id"] for r in child_runs(mlflow_server, "runner-parts")}) == 6
