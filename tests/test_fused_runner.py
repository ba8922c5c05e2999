"""Fused arrays in the runner (issue 35, ``resources.seeds_per_trial``).

Fast: a config's seeds grouped into arrays (the rest as a smaller array, resumed cells by their
starting epoch), the plan dealing arrays to the slots, the study field's default and its
refusals, the dry run's probe, a member's checkpoint folder found on resume, an array under a
config-level rule recording every member and stopping as a whole, a later study version's
arrays (version-qualified config ids, issue 33). Slow (one real local Ray and MLflow server):
a study of 2 configs x 3 seeds at ``seeds_per_trial: 2`` under early stopping runs as 4
trials, every member a cell run of its
own (epochs, test metrics equal to the separate trial of its seed cut where its config
stopped, a Logged Model), a config's arrays stopping together, the progress counting cells.
"""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import yaml

from studies.cells.arrays import array_id, fused_arrays
from studies.studyfile.problems import StudyError
from studies.studyfile.spec import load_study
from tests.test_runner import child_runs, options, write_study


def cell(config_id: str, seed: int) -> SimpleNamespace:
    return SimpleNamespace(config_id=config_id, seed=seed, cell_id=f"{config_id}-s{seed}")


def test_a_configs_seeds_are_cut_into_arrays_the_rest_a_smaller_one():
    cells = [cell("b", s) for s in (2, 0, 1)] + [cell("a", s) for s in range(5)]
    arrays = fused_arrays(cells, 2)
    assert [[c.cell_id for c in a] for a in arrays] == [
        ["b-s0", "b-s1"],
        ["b-s2"],
        ["a-s0", "a-s1"],
        ["a-s2", "a-s3"],
        ["a-s4"],
    ]
    assert [array_id(a) for a in arrays[:2]] == ["b-s0-x2", "b-s2"]
    # cells resumed after different epochs never share an array
    resumed = fused_arrays(cells[3:], 4, {"a-s1": 3, "a-s3": 3})
    assert [[c.seed for c in a] for a in resumed] == [[0, 2, 4], [1, 3]]
    assert [[c.seed for c in a] for a in fused_arrays(cells, 1)] == [[0], [1], [2], [0], [1], [2], [3], [4]]


def test_a_later_versions_arrays_hold_its_version_qualified_cells(tmp_path):
    """Study versions (issue 33) with arrays: a later version's cells carry the version in their
    config ids, so its arrays never pool seeds with the first version's, and each payload of an
    array's members names the version its cell run is tagged with."""
    from studies.cells.space import expand
    from studies.running.tune_experiment import array_payload, cell_payload
    from studies.running.versions import StudyVersion, versioned_cells

    cells = expand(
        load_study(
            write_study(
                tmp_path, "versioned", lrs=[0.1, 0.2], seeds=(0, 1, 2), resources={"cpus": 1, "seeds_per_trial": 2}
            )
        )
    )
    first = versioned_cells(cells, StudyVersion("0123456789", qualified=False, record=[]))
    later = versioned_cells(cells, StudyVersion("abcdef0123", qualified=True, record=[]))
    arrays = fused_arrays(first + later, 2)
    assert sorted(len(a) for a in arrays) == [1, 1, 1, 1, 2, 2, 2, 2]
    for a in arrays:
        assert len({c.config_id for c in a}) == 1 and len({c.version for c in a}) == 1
    qualified = [a for a in arrays if a[0].config_id.endswith("-vabcdef0")]
    assert len(qualified) == 4 and all(array_id(a).startswith(a[0].config_id) for a in qualified)
    payload = array_payload(array_id(qualified[0]), [cell_payload(c) for c in qualified[0]])
    assert [m["version"] for m in payload["members"]] == ["abcdef0123"] * len(qualified[0])


def test_seeds_per_trial_defaults_to_one_and_is_refused_where_not_supported(tmp_path):
    assert load_study(write_study(tmp_path, "plain", lrs=[0.1])).resources.seeds_per_trial == 1
    # early stopping, ASHA and Optuna's pruners stop an array as a whole; racing runs its rounds
    # as arrays: all accepted
    assert (
        load_study(
            write_study(
                tmp_path,
                "sched",
                lrs=[0.1],
                resources={"cpus": 1, "seeds_per_trial": 2},
                scheduler={"kind": "early_stopping", "patience": 1},
                objective={"metric": "val/top3"},
            )
        ).resources.seeds_per_trial
        == 2
    )
    raced = write_study(
        tmp_path, "raced", lrs=[0.1], resources={"cpus": 1, "seeds_per_trial": 2}, objective={"metric": "val/top3"}
    )
    text = yaml.safe_load(raced.read_text())
    text["seeds"] = {"initial": 2, "max": 4, "until": {"metric": "test/top3", "level": 0.95}}
    raced.write_text(yaml.safe_dump(text, sort_keys=False))
    assert load_study(raced).resources.seeds_per_trial == 2
    tuned = write_study(
        tmp_path,
        "tuned",
        lrs=[0.1],
        resources={"cpus": 1, "seeds_per_trial": 2},
        objective={"metric": "val/top3"},
        design=[OPTUNA_BLOCK],
    )
    assert load_study(tuned).optuna_blocks and load_study(tuned).resources.seeds_per_trial == 2
    # compile: model compiles an array's stacked model (tests/test_fused.py), with or without a
    # scheduler: accepted
    for path in (
        write_study(tmp_path, "compiled", lrs=[0.1], resources={"cpus": 1, "seeds_per_trial": 2}),
        raced,
        tuned,
    ):
        assert load_study(path, overrides=("base.compile=model",)).resources.seeds_per_trial == 2
    with pytest.raises(StudyError, match=r"seeds_per_trial"):
        load_study(write_study(tmp_path, "zero", lrs=[0.1], resources={"cpus": 1, "seeds_per_trial": 0}))


#: an optuna block with a median pruner over the learning rate (random sampler: the same configs
#: in every run)
OPTUNA_BLOCK = {
    "kind": "optuna",
    "n_configs": 3,
    "sampler": "random",
    "sampler_seed": 3,
    "parameters": {"optim.lr": {"loguniform": [0.001, 0.5]}},
    "pruner": {"kind": "median", "n_startup_trials": 1, "n_warmup_steps": 1},
}


@pytest.mark.parametrize("values", [["none", "model"], {"choice": ["none", "model"]}])
def test_a_design_block_sweeping_compile_is_accepted_at_seeds_per_trial(tmp_path, values):
    """compile set per config by a grid or a random block's choice, not only by a variant: an
    array compiles its stacked model, so nothing is refused."""
    kind = "grid" if isinstance(values, list) else "random"
    block = {"kind": kind, "parameters": {"compile": values}, **({"n_configs": 2} if kind == "random" else {})}
    path = write_study(tmp_path, "swept", lrs=[0.1], resources={"cpus": 1, "seeds_per_trial": 2}, design=[block])
    assert load_study(path).resources.seeds_per_trial == 2


@pytest.mark.slow
def test_a_fused_study_runs_every_member_as_a_cell(local_ray, mlflow_server, tmp_path):
    from mlflow import MlflowClient

    from setvalued.training import fit
    from studies.cells.space import expand
    from studies.running.runner import run_study

    # early stopping on the seed mean: a config's seeds 0 and 1 (one array) and seed 2 (another)
    # wait for each other at every epoch, and a stop stops both arrays
    path = write_study(
        tmp_path,
        "fused-grid",
        lrs=[0.05, 0.1],
        seeds=(0, 1, 2),
        epochs=3,
        resources={"cpus": 1, "seeds_per_trial": 2, "per_array": {"cpus": 1}},  # 2 arrays at once on 2 CPUs
        log_models=True,
        objective={"metric": "val/top3"},
        scheduler={"kind": "early_stopping", "grace_epochs": 0, "patience": 1},
    )
    cells = {c.cell_id: c for c in expand(load_study(path))}
    stream = io.StringIO()
    outcome = run_study(path, options(tmp_path, mlflow_server, stream=stream))
    text = stream.getvalue()
    assert outcome.exit_code == 0, text
    assert (outcome.cells, outcome.finished) == (6, 6)
    assert "done 6/6" in text
    # arrays and cells counted alike, and how the machine is used (issue 42)
    assert (
        "running 6 cells as 4 fused arrays of up to 2 seeds (2 arrays at a time, up to 4 cells; "
        "1 CPU / 0 GPU an array; 2 of 2 CPUs)" in text
    ), text

    client = MlflowClient(mlflow_server)
    runs = child_runs(mlflow_server, "fused-grid")
    assert sorted(r.data.tags["studies.cell_id"] for r in runs) == sorted(cells)
    stopped_at = {}
    for run in runs:
        c = cells[run.data.tags["studies.cell_id"]]
        assert run.data.tags["studies.status"] == "finished" and run.info.status == "FINISHED"
        assert run.data.tags["studies.seed"] == str(c.seed)
        epochs = int(run.data.tags.get("studies.stopped_epoch", 3))
        stopped_at.setdefault(c.config_id, set()).add(epochs)
        for key in ("train/loss", "val/top3", "lr", "epoch_time_s"):
            assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == list(range(epochs)), key
        # the member is the separate trial of its seed (float32: the fused kernels round apart),
        # with the epochs cut where its config stopped
        alone = fit({**c.config, "epochs": epochs}, c.seed)
        for key, value in alone["test"].items():
            assert run.data.metrics[f"test/{key}"] == pytest.approx(value, abs=1e-4), key
        assert [o.model_id for o in client.get_run(run.info.run_id).outputs.model_outputs], "no Logged Model"
    assert all(len(epochs) == 1 for epochs in stopped_at.values()), stopped_at  # a config stops whole
    logged = client.search_logged_models([runs[0].info.experiment_id])
    assert sorted(m.source_run_id for m in logged) == sorted(r.info.run_id for r in runs)


def test_the_dry_run_probes_the_fused_form_and_refuses_naming_model_and_reason(tmp_path, monkeypatch):
    import setvalued.fused.array
    from studies.running.runner import RunOptions, run_study

    path = write_study(tmp_path, "probed", lrs=[0.1], seeds=(0, 1, 2), resources={"cpus": 1, "seeds_per_trial": 2})
    stream = io.StringIO()
    outcome = run_study(path, RunOptions(output=tmp_path / "out", dry_run=True, stream=stream))
    assert outcome.exit_code == 0 and outcome.cells == 3 and "3 cells" in stream.getvalue()
    assert "as 2 fused arrays of up to 2 seeds (one trial each)" in stream.getvalue()
    # a model whose fused form fails the one-batch probe (as a forward pass with dropout does:
    # tests/test_fused.py) is refused before anything runs, at the field, with the reason
    monkeypatch.setattr(
        setvalued.fused.array, "fusion_problem", lambda models, trial: "RuntimeError: vmap: called random operation"
    )
    monkeypatch.setenv("STUDIES_STATE_DIR", str(tmp_path / "state"))  # the pass above is not kept here
    with pytest.raises(StudyError) as refused:
        run_study(path, RunOptions(output=tmp_path / "out", dry_run=True, stream=io.StringIO()))
    text = str(refused.value)
    assert str(path) in text and "resources.seeds_per_trial (line" in text
    assert "model 'mlp' cannot be fused: RuntimeError: vmap: called random operation" in text
    assert "expected seeds_per_trial: 1" in text


def test_a_members_folder_in_an_arrays_checkpoint_is_found_by_its_cell_id(tmp_path):
    """A fused array's Tune checkpoint holds a folder per member named by its cell id
    (studies.running.array_trial); the next session continues each member from it."""
    import json

    from studies.running.checkpoints import META_FILE, STATE_FILE, ResumePoints

    storage = tmp_path / "ray"
    folders = {}
    for cell_id in ("a-s0", "a-s1"):
        folder = storage / "tune-3-0" / "a-s0-x2" / "checkpoint_000002" / cell_id
        folder.mkdir(parents=True)
        (folder / META_FILE).write_text(
            json.dumps({"cell_id": cell_id, "study": "s", "epoch": 2, "run_id": f"run-{cell_id}", "history": []})
        )
        (folder / STATE_FILE).write_bytes(b"")
        folders[cell_id] = str(folder)
    points = ResumePoints.search(storage, "s", ["a-s0", "a-s1", "a-s2"])
    assert points.folders() == folders
    assert points.run_ids() == {"a-s0": "run-a-s0", "a-s1": "run-a-s1"}
    assert points.experiment_dirs() == [storage / "tune-3-0"]


class FakeCoordinator:
    """A coordinator client that records what the array tells it; the config's decision is
    'wait' until its last seed records, then `decision`."""

    def __init__(self, log: list, seed: int, seeds: int, decision: str, prunes: str | None = None):
        self.log, self.seed, self.seeds, self.decision_value, self.prunes = log, seed, seeds, decision, prunes

    def record(self, epochs_done, metrics):
        self.log.append(("record", self.seed, epochs_done, metrics["val/top3"]))
        return (
            self.decision_value
            if sum(e[0] == "record" and e[2] == epochs_done for e in self.log) == self.seeds
            else "wait"
        )

    def wait(self, epochs_done, status):
        self.log.append(("wait", self.seed, epochs_done, status))
        return status if status != "wait" else self.decision_value

    def tell_gone(self):
        self.log.append(("gone", self.seed))


def test_an_array_records_every_member_then_waits_once_and_stops_as_a_whole(monkeypatch):
    import ray.tune

    from studies.running.array_trial import ArrayEpochs, MemberReporter

    reports = []
    monkeypatch.setattr(ray.tune, "report", lambda report, checkpoint=None: reports.append(report))
    log: list = []
    reporters = []
    for seed in (0, 1, 2):
        c = {
            "cell_id": f"a-s{seed}",
            "config_id": "a",
            "seed": seed,
            "config": {"epochs": 5},
            "tune_metrics": ["val/top3"],
            "checkpoint_interval_s": 3600,
        }
        run = SimpleNamespace(run_id=f"run-{seed}")
        reporters.append(MemberReporter(run, c, None, [], None, FakeCoordinator(log, seed, 3, "stop", "asha"), None))
    epochs = ArrayEpochs(reporters, 3600, 4)
    for i in (0, 2):  # member 1 failed in this epoch: it does not close it
        epochs.on_member(i, 0, {"val/top3": 0.5 + i, "epoch": 0}, state={"epoch": 0})
    assert epochs.after_epoch(0) == "stop" and epochs.stopped_at == 1
    assert [r["cell_id"] for r in reports] == ["a-s0", "a-s2"]
    assert all(r["epochs_done"] == 1 and r["cell_status"] == "running" for r in reports)
    assert log == [("gone", 1), ("record", 0, 1, 0.5), ("record", 2, 1, 2.5), ("wait", 2, 1, "wait")]


def test_an_arrays_checkpoint_holds_each_member_and_a_restarted_trial_reads_it_back(monkeypatch, tmp_path):
    """When a checkpoint is due, the last member's Tune report carries one folder per member
    (its state and meta); a restarted trial starts every member from its folder, and a
    member missing there (it had failed) from its own resume folder or from scratch."""
    import shutil

    import ray.tune

    from studies.running.array_trial import ArrayEpochs, MemberReporter, _starting_points

    kept = tmp_path / "kept"
    reports = []

    def report(values, checkpoint=None):
        reports.append(values)
        if checkpoint is not None:
            shutil.copytree(checkpoint.path, kept)

    monkeypatch.setattr(ray.tune, "report", report)
    cells, reporters = [], []
    for seed in (0, 1, 2):
        c = {
            "cell_id": f"a-s{seed}",
            "config_id": "a",
            "seed": seed,
            "config": {"epochs": 3},
            "tune_metrics": [],
            "checkpoint_interval_s": 0,
        }
        run = SimpleNamespace(run_id=f"run-{seed}", log_epochs=lambda epochs: None)
        cells.append(c)
        reporters.append(MemberReporter(run, c, SimpleNamespace(study_name="s"), [], None, None, None))
    epochs = ArrayEpochs(reporters, 0, 2)
    for i in (0, 2):  # member 1 failed
        epochs.on_member(i, 0, {"val/top3": 0.5, "epoch": 0}, state={"epoch": 0, "seed": i})
    assert epochs.after_epoch(0) is None
    assert sorted(p.name for p in kept.iterdir()) == ["a-s0", "a-s2"]
    assert len(reports) == 2

    monkeypatch.setattr(ray.tune, "get_checkpoint", lambda: ray.tune.Checkpoint.from_directory(str(kept)))
    points = _starting_points(cells)
    assert [state for state, _ in points] == [{"epoch": 0, "seed": 0}, None, {"epoch": 0, "seed": 2}]
    assert [meta.get("run_id") for _, meta in points] == ["run-0", None, "run-2"]
    assert points[0][1]["cell_id"] == "a-s0" and points[0][1]["epoch"] == 0


def test_a_model_shape_is_probed_once_and_later_runs_do_not_import_torch(tmp_path):
    """The fused form's probe (torch imported in the driver before the checks: 4 s of a fused
    study's start, issue 42) runs once per model shape: a second dry run of the study, or of
    another loss or data size on the same model and input, reads the pass kept; another input
    shape probes again."""
    import os
    import subprocess
    import sys

    from tests.test_runner import tiny_base

    def dry_run(name: str, **base) -> bool:
        """Whether `studies run --dry-run` of that study imported torch (in a fresh process)."""
        path = write_study(
            tmp_path, name, lrs=[0.1], seeds=(0, 1), resources={"cpus": 1, "seeds_per_trial": 2}, base=base
        )
        code = (
            "import sys; from studies.cli import main; "
            "code = main(['run', sys.argv[1], '--dry-run', '--output', sys.argv[2]]); "
            "print('torch' in sys.modules); sys.exit(code)"
        )
        env = dict(os.environ, STUDIES_STATE_DIR=str(tmp_path / "state"))
        done = subprocess.run(
            [sys.executable, "-c", code, str(path), str(tmp_path / "out")], capture_output=True, text=True, env=env
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()[-1] == "True"

    base = tiny_base(2)
    assert dry_run("first", **base)
    assert not dry_run("again", **base)
    other_loss = {**base, "loss": {"name": "noised_topk", "k": 2, "epsilon": 0.1}}
    assert not dry_run("other-loss-and-size", **{**other_loss, "data": {**base["data"], "train_size": 200}})
    assert dry_run("wider-input", **{**base, "data": {**base["data"], "feature_dim": 12}})
