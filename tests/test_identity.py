"""A finished cell is reused only when it is the same experiment (issue 39).

An earlier run of a study is written by the tracking code itself (`StudyTracking`, `CellRun`:
the tags, data set input and environment a trial records), without training; then the study
is run again, from the command line, on a real SQLite store:

- data replaced in place, another training code, a run recorded before identities, an edited
  or upgraded plugin: refused (exit 2) before Ray or anything is written, each item old -> new;
- ``--keep-finished`` records the decision on the parent run (and the report shows it), and
  later runs accept those cells; ``--new-version`` makes a version whose cells run again;
- every refusal of the preflight leaves nothing behind: the corrected file is the study's
  first version, not "another version of its study file";
- (slow) the issue's own run on a real Ray: an .npz of 1,797 inputs and 1,790 labels refused,
  the corrected root trained, its MLflow records (data set input, identity, array, environment,
  the parent's manifest), the data replaced in place refused, `studies reproduce` of a fused
  array's member identical, of a cell trained on other data "differs".
"""

from __future__ import annotations

import io
import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import yaml

from analysis.layout import (
    ENVIRONMENT_ARTIFACT,
    ROLE_CELL,
    TAG_ARRAY,
    TAG_CODE,
    TAG_ENVIRONMENT,
    TAG_IDENTITY,
    TAG_KEPT,
    TAG_LEASE_PREFIX,
    TAG_ROLE,
    tag_filter,
)
from setvalued.provenance import DataFingerprint, data_fingerprint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SETVALUED_DIGEST_CACHE", str(tmp_path / "digests.sqlite"))


def write_arrays(path: Path, n: int = 40, labels: int | None = None, seed: int = 0) -> Path:
    """``n`` examples of 6 features (drawn from ``seed``) and ``labels`` labels (default n)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6))
    y = np.arange(labels if labels is not None else n) % 4
    np.savez(path, x=x, y=y)
    return path


def study_file(tmp_path: Path, name: str, data: dict, loss: dict | None = None, **extra) -> Path:
    study = {
        "name": name,
        "base": {
            "data": data,
            "model": {"name": "mlp", "hidden_dim": 8},
            "loss": loss or {"name": "ce"},
            "optim": {"lr": 0.1, "batch_size": 16, "milestones": []},
            "epochs": 2,
            "eval": {"ks": [1, 2], "selection": "val/top2"},
            "device": "cpu",
        },
        "seeds": [0, 1],
        "resources": {"cpus": 1},
        "log_models": False,
        **extra,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def finished_earlier(path: Path, out: Path) -> tuple[str, list]:
    """What an earlier `studies run` of the file leaves when every cell finished: the folder,
    its version, and a finished run per cell written by the tracking code (no training).
    Returns (tracking URI, the cells)."""
    from studies.cells.space import expand
    from studies.running.identity import IdentityCheck, fingerprint_data
    from studies.running.tune_experiment import cell_payload
    from studies.running.versions import check_version, save_versions, versioned_cells
    from studies.studyfile.spec import load_study
    from studies.tracking import CellRun, StudyTracking, default_tracking_uri

    study = load_study(path)
    folder = out / study.name
    folder.mkdir(parents=True)
    version = check_version(study, study.name, folder, False)
    cells = versioned_cells(expand(study), version)
    save_versions(folder, version)
    (folder / "study.yaml").write_text(path.read_text())
    uri = default_tracking_uri(folder)
    (folder / "run.json").write_text(json.dumps({"name": study.name, "source": str(path), "tracking_uri": uri}))
    tracking = StudyTracking(uri, study.name, artifact_root=folder / "mlartifacts")
    tracking.version = version.version
    tracking.data_fingerprints = IdentityCheck(version, cells, fingerprint_data(cells)).data_json()
    context = tracking.context("earlier-session")
    for cell in cells:
        run, _ = CellRun.open(context, cell_payload(cell))
        run.finish({"test": {"top1": 0.5}, "best_epoch": 0, "best_val": 0.5, "device": "cpu"}, final_step=0)
    return uri, cells


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*") if p.is_file()
    }


def mlflow_state(uri: str, name: str) -> tuple:
    """The study's runs (ids, tags) and experiment tags: what a refused run must not change."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(name)
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    return (
        sorted((r.info.run_id, r.info.status, tuple(sorted(r.data.tags.items()))) for r in runs),
        sorted(experiment.tags.items()),
    )


def run_cli(*args: str, capsys) -> tuple[int, str]:
    from studies.cli import main

    code = main(["run", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.fixture
def no_ray(monkeypatch):
    """Ray must not start in these runs (every cell is finished, or the run is refused)."""
    from studies.running.session import StudySession

    def start(self):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(StudySession, "start", start)


# ----------------------------------------------------------------------------- refused


def test_data_replaced_in_place_is_refused_before_anything_is_written(tmp_path, capsys, no_ray):
    data = write_arrays(tmp_path / "digits.npz")
    path = study_file(tmp_path, "replaced", {"name": "arrays", "root": str(data), "val_fraction": 0.25})
    out = tmp_path / "out"
    uri, cells = finished_earlier(path, out)
    before, runs_before = snapshot(out / "replaced"), mlflow_state(uri, "replaced")
    old = data_fingerprint({"name": "arrays", "root": str(data)})
    write_arrays(data, seed=1)  # the same path, other numbers
    new = data_fingerprint({"name": "arrays", "root": str(data)})
    code, text = run_cli(str(path), "--output", str(out), "--no-report", capsys=capsys)
    assert code == 2, text
    flat = " ".join(text.split())
    assert "2 finished cells were trained with other code or data" in flat
    assert f"the data (2 cells): {old.label} -> {new.label}" in flat and old.digest != new.digest
    assert old.label.startswith(f"arrays {data}, 1 files, ") and "--new-version" in text and "--keep-finished" in text
    assert "Nothing was started" in text
    error = text[text.index("studies: error:") :].splitlines()
    assert all(len(line) <= 80 for line in error if str(tmp_path) not in line), text
    assert snapshot(out / "replaced") == before  # study.yaml, run.json, versions.json, mlflow.db
    assert mlflow_state(uri, "replaced") == runs_before  # no lease, no parent run touched
    write_arrays(data)  # the data as it was: the same experiment again
    code, text = run_cli(str(path), "--output", str(out), "--no-report", capsys=capsys)
    assert code == 0 and "2 cells already finished (skipped)" in text, text


def test_other_code_and_runs_recorded_before_identities_are_refused(tmp_path, capsys, no_ray):
    from mlflow import MlflowClient

    path = study_file(
        tmp_path, "older", {"name": "synthetic", "num_classes": 6, "num_superclasses": 2, "train_size": 60}
    )
    out = tmp_path / "out"
    uri, cells = finished_earlier(path, out)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("older")
    first, second = client.search_runs([experiment.experiment_id], tag_filter({TAG_ROLE: ROLE_CELL}))
    identity = json.loads(first.data.tags[TAG_IDENTITY])
    identity["code"] = ["0" * 32, "setvalued-studies 0.0.9, index, code 000000000000"]
    client.set_tag(first.info.run_id, TAG_IDENTITY, json.dumps(identity))
    client.delete_tag(second.info.run_id, TAG_IDENTITY)  # a run of the code before identities
    code, text = run_cli(str(path), "--output", str(out), "--no-report", capsys=capsys)
    assert code == 2, text
    flat = " ".join(text.split())
    assert "2 finished cells were trained" in flat and "the data (1 cell): (not recorded) -> synthetic " in flat
    assert "the training code (setvalued) (1 cell): (not recorded) -> setvalued-studies " in flat, text
    old = "the training code (setvalued) (1 cell): setvalued-studies 0.0.9, index, code 000000000000"
    assert f"{old} -> setvalued-studies " in flat, text


def test_an_edited_or_upgraded_plugin_refuses_the_cells_it_trained(tmp_path, capsys, monkeypatch, no_ray):
    from setvalued.provenance import plugin_fingerprint
    from tests import plugin_dists

    site = plugin_dists.write_example(tmp_path / "site")
    plugin_dists.activate(site, monkeypatch)
    plugin_fingerprint.cache_clear()
    loss = {"name": "ls_topk_hinge", "k": 2}
    path = study_file(
        tmp_path, "plugged", {"name": "synthetic", "num_classes": 6, "num_superclasses": 2, "train_size": 60}, loss
    )
    out = tmp_path / "out"
    finished_earlier(path, out)
    code, text = run_cli(str(path), "--output", str(out), "--no-report", capsys=capsys)
    assert code == 0, text  # the same plugin: nothing to say
    module = site / "setvalued_example_plugin" / "loss.py"
    module.write_text(module.read_text() + "\n\ndef _fixed():\n    return 1\n")  # an edit, the same version
    plugin_fingerprint.cache_clear()
    code, text = run_cli(str(path), "--output", str(out), "--no-report", capsys=capsys)
    flat = " ".join(text.split())
    assert code == 2 and "plugin setvalued-example-plugin (2 cells):" in flat, text
    assert f"setvalued-example-plugin 0.1.0, editable {plugin_dists.EXAMPLE}" in flat
    plugin_fingerprint.cache_clear()


def test_keep_finished_records_the_decision_and_later_runs_accept_it(tmp_path, capsys, no_ray):
    from mlflow import MlflowClient

    from analysis.collect import collect
    from analysis.run_provenance import provenance_rows, read_manifest

    data = write_arrays(tmp_path / "digits.npz")
    path = study_file(tmp_path, "kept", {"name": "arrays", "root": str(data), "val_fraction": 0.25})
    out = tmp_path / "out"
    uri, _ = finished_earlier(path, out)
    write_arrays(data, seed=1)
    code, text = run_cli(str(path), "--output", str(out), "--no-report", "--keep-finished", capsys=capsys)
    assert code == 0 and "keeping 2 finished cells" in text and "2 cells already finished (skipped)" in text, text
    client = MlflowClient(uri)
    collected = collect(uri, "kept")
    kept = json.loads(client.get_run(collected.parent_run_id).data.tags[TAG_KEPT])
    (decision,) = kept["decisions"]
    assert decision["cells"] == 2 and decision["changes"][0].startswith("the data: arrays ")
    assert [a.path for a in client.list_artifacts(collected.parent_run_id, "identity")][0].startswith("identity/kept-")
    manifest = read_manifest(client, collected.parent_run_id)
    assert manifest["distributions"]["mlflow"] == __import__("mlflow").__version__ and manifest["python"]
    rows = dict(provenance_rows(collected.provenance, manifest))
    assert rows["finished cells kept knowingly"].startswith("2 cells on ")
    assert "environment of the driver" in rows and "cells differ in data" not in rows
    code, text = run_cli(str(path), "--output", str(out), "--no-report", capsys=capsys)
    assert code == 0 and "2 cells already finished (skipped)" in text, text  # accepted from now on
    write_arrays(data, seed=2)  # a further change is a change again
    code, text = run_cli(str(path), "--output", str(out), "--no-report", capsys=capsys)
    assert code == 2 and "the data (2 cells):" in text, text


def test_new_version_runs_the_changed_cells_again_beside_the_finished(tmp_path):
    from studies.cells.space import expand
    from studies.running.identity import check_identity
    from studies.running.run_options import RunOptions
    from studies.running.versions import check_version, read_versions
    from studies.studyfile.spec import load_study

    data = write_arrays(tmp_path / "digits.npz")
    path = study_file(tmp_path, "renewed", {"name": "arrays", "root": str(data), "val_fraction": 0.25})
    out = tmp_path / "out"
    uri, cells = finished_earlier(path, out)
    write_arrays(data, seed=1)
    study = load_study(path)
    current = check_version(study, "renewed", out / "renewed", True)  # the file is the same: its version
    unversioned = expand(study)
    said: list[str] = []
    check = check_identity(
        study, "renewed", out / "renewed", uri, current, unversioned, cells, RunOptions(new_version=True), said.append
    )
    assert check.version.version != current.version and check.version.qualified and len(check.version.record) == 2
    assert all(c.cell_id.endswith(f"-v{check.version.version[:7]}-s{c.seed}") for c in check.cells)
    assert check.version.record[-1]["reason"].startswith("what trains its cells changed: the data: arrays ")
    assert check.version.record[-1]["definition"] == check.version.record[0]["definition"]
    assert "runs them again beside version" in said[0]
    assert len(read_versions(out / "renewed")) == 1  # written only when the run goes on


# ----------------------------------------------------------------------------- refusals leave nothing


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _broken_plugin(tmp_path, monkeypatch) -> dict:
    from tests import plugin_dists

    site = plugin_dists.write_dist(
        tmp_path / "site",
        "broken-loss",
        "1.0",
        {"setvalued.losses": {"broken_loss": "brokenloss.decl:DECL"}},
        {
            "brokenloss": {
                "__init__.py": "",
                "decl.py": "from setvalued.registry import Declaration\n"
                "DECL = Declaration({}, 'brokenloss.missing:Loss')\n",
            }
        },
    )
    plugin_dists.activate(site, monkeypatch)
    return {"name": "broken_loss"}


REFUSALS = {
    # name: (data, loss, extra CLI args, words of the refusal, the correction)
    "arrays of 1,797 inputs and 1,790 labels": ("mismatch", None, (), "1797 inputs x but 1790 labels", "data"),
    "a NaN feature": ("nan", None, (), "NaN or infinite value at example 3", "data"),
    "a missing image folder": ("missing", None, (), "image folder does not exist", "data"),
    "a tracking server that does not answer": ("good", None, ("tracking",), "does not answer", "args"),
    "an unwritable trial storage": ("good", None, ("storage",), "trial storage", "args"),
    "a plugin whose code does not import": ("good", "broken", (), "failed to import", "loss"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_refused_run_leaves_nothing_that_blocks_the_corrected_file(tmp_path, capsys, monkeypatch, no_ray, case):
    from studies.running.versions import check_version
    from studies.studyfile.spec import load_study

    kind, loss, flags, words, fix = REFUSALS[case]
    good = write_arrays(tmp_path / "good.npz")
    data = {
        "mismatch": lambda: {"name": "arrays", "root": str(write_arrays(tmp_path / "bad.npz", 1797, 1790))},
        "nan": lambda: {"name": "arrays", "root": str(_with_nan(tmp_path / "bad.npz"))},
        "missing": lambda: {"name": "image_folder", "root": str(tmp_path / "no-images")},
        "good": lambda: {"name": "arrays", "root": str(good)},
    }[kind]()
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    args = {
        "tracking": ("--tracking-uri", f"http://127.0.0.1:{_free_port()}"),
        "storage": ("--storage", str(blocker / "ray")),
    }
    extra = [word for flag in flags for word in args[flag]]
    path = study_file(
        tmp_path, "refused", {**data, "val_fraction": 0.25}, _broken_plugin(tmp_path, monkeypatch) if loss else None
    )
    out = tmp_path / "out"
    code, text = run_cli(str(path), "--output", str(out), *extra, capsys=capsys)
    assert code == 2 and words in " ".join(text.split()) and "Nothing was started" in text, text
    assert not out.exists(), sorted(map(str, out.rglob("*")))  # no folder, version, store
    assert not (blocker.parent / "ray").exists()
    if fix == "data":  # the corrected file is this study's first version, not "another version"
        path = study_file(tmp_path, "refused", {"name": "arrays", "root": str(good), "val_fraction": 0.25})
    elif fix == "loss":
        path = study_file(tmp_path, "refused", {**data, "val_fraction": 0.25})
    version = check_version(load_study(path), "refused", out / "refused", new_version=False)
    assert version.new and not version.qualified and len(version.record) == 1


def _with_nan(path: Path) -> Path:
    x = np.random.default_rng(1).normal(size=(40, 6))
    x[3, 2] = np.nan
    np.savez(path, x=x, y=np.arange(40) % 4)
    return path


def test_a_refused_run_restores_nothing_it_did_not_write(tmp_path, capsys, no_ray):
    """An existing study refused by its preflight keeps its folder as it was."""
    path = study_file(tmp_path, "kept-folder", {"name": "arrays", "root": str(write_arrays(tmp_path / "a.npz"))})
    out = tmp_path / "out"
    finished_earlier(path, out)
    before = snapshot(out / "kept-folder")
    os.remove(tmp_path / "a.npz")
    code, text = run_cli(str(path), "--output", str(out), capsys=capsys)
    assert code == 2 and "arrays file does not exist" in text, text
    assert snapshot(out / "kept-folder") == before


# ----------------------------------------------------------------------------- the issue's run, on Ray


@pytest.mark.slow
def test_the_issues_run_recorded_refused_and_reproduced(local_ray, tmp_path, capsys):
    from mlflow import MlflowClient

    from analysis.collect import collect
    from studies.cli import main

    bad = write_arrays(tmp_path / "digits.npz", 1797, 1790)
    path = study_file(
        tmp_path,
        "digits",
        {"name": "arrays", "root": str(bad), "val_fraction": 0.25},
        resources={"cpus": 1, "seeds_per_trial": 2},
    )
    out = tmp_path / "out"
    common = ["--output", str(out), "--no-report", "--progress-every", "1000"]
    code, text = run_cli(str(path), *common, capsys=capsys)
    assert code == 2 and "1797 inputs x but 1790 labels" in text and not out.exists(), text
    write_arrays(bad, 200)  # corrected in place
    from studies.running.runner import RunOptions, run_study

    stream = io.StringIO()  # (Tune pickles what refers to the stream: not pytest's capture)
    outcome = run_study(path, RunOptions(output=out, report=False, stream=stream, progress_interval_s=1e9))
    assert outcome.exit_code == 0 and outcome.finished == 2, stream.getvalue()

    uri = f"sqlite:///{out / 'digits' / 'mlflow.db'}"
    collected = collect(uri, "digits")
    client = MlflowClient(uri)
    runs = [client.get_run(r) for r in collected.table.column("run_id").to_pylist()]
    for member, run in enumerate(sorted(runs, key=lambda r: int(r.data.tags["studies.seed"]))):
        tags = run.data.tags
        identity = json.loads(tags[TAG_IDENTITY])
        assert set(identity) == {"code", "data"} and tags[TAG_CODE] == identity["code"][1]
        assert json.loads(tags[TAG_ARRAY])["seeds"] == [0, 1] and json.loads(tags[TAG_ARRAY])["member"] == member
        assert json.loads(tags[TAG_ENVIRONMENT])["device"] == "cpu"
        (dataset,) = run.inputs.dataset_inputs
        assert dataset.dataset.digest == identity["data"][0] and dataset.dataset.name == "arrays:digits.npz"
        assert json.loads(dataset.dataset.source)["uri"] == str(bad)
        assert "tensor-spec" in dataset.dataset.schema
    artifacts = [a.path for a in client.list_artifacts(collected.parent_run_id)]
    assert ENVIRONMENT_ARTIFACT in artifacts
    (study_data,) = client.get_run(collected.parent_run_id).inputs.dataset_inputs  # before the cells
    assert study_data.dataset.digest == dataset.dataset.digest
    experiment = client.get_experiment_by_name("digits")
    assert not [k for k in experiment.tags if k.startswith(TAG_LEASE_PREFIX)]

    member = sorted(runs, key=lambda r: int(r.data.tags["studies.seed"]))[1].data.tags["studies.cell_id"]
    assert main(["reproduce", "digits", "--cell", member, "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "member 1 of fused array" in text and "verdict: identical" in text, text

    write_arrays(bad, 200, seed=1)  # replaced in place: another experiment
    code, text = run_cli(str(path), *common, capsys=capsys)
    assert code == 2 and "the data (2 cells):" in text, text
    stream = io.StringIO()
    from studies.running.reproduce import reproduce_cell

    verdict, found = reproduce_cell("digits", member, output=out, stream=stream)
    text = stream.getvalue()
    assert verdict == "differs" and "note: data differs from what trained it" in text, text
    assert "verdict: differs; first at epoch 0, " in text, text


def test_a_fifo_among_the_listed_images_is_refused_by_name_unread(tmp_path, capsys, no_ray):
    from tests.test_data import write_fake_imagenet_lt

    root = tmp_path / "imagenet"
    write_fake_imagenet_lt(root)
    lists = sorted(root.rglob("ImageNet_LT_test.txt"))
    image = root / lists[0].read_text().split()[0]
    image.unlink()
    os.mkfifo(image)  # opening it would block the driver
    path = study_file(tmp_path, "fifo", {"name": "imagenet_lt", "root": str(root)})
    code, text = run_cli(str(path), "--output", str(tmp_path / "out"), capsys=capsys)
    assert code == 2 and f"{image}' is not a regular file" in text and "Nothing was started" in text, text
    assert not (tmp_path / "out").exists()


def test_a_long_first_fingerprinting_says_what_it_reads_and_a_rerun_says_nothing(tmp_path, monkeypatch):
    from studies.cells.space import expand
    from studies.running import identity
    from studies.studyfile.spec import load_study
    from tests.test_data_formats import write_folder

    write_folder(tmp_path / "images", {"train": {"a": 30, "b": 30}})
    monkeypatch.setattr(identity, "ANNOUNCE_FILES", 50)
    monkeypatch.setattr(identity, "PROGRESS_EVERY_S", 0.0)
    path = study_file(tmp_path, "long", {"name": "image_folder", "root": str(tmp_path / "images")})
    cells = expand(load_study(path))
    said: list[str] = []
    first = identity.fingerprint_data(cells, said.append)
    assert said[0].startswith(f"fingerprinting data.root {tmp_path / 'images'}: reading 60 of its 60 files")
    assert "cached by path, size and time" in said[0] and said[-1].endswith("/s)") and " 60 files read in " in said[-1]
    said.clear()
    assert identity.fingerprint_data(cells, said.append) == first and said == []


def test_an_optuna_proposals_finished_cell_is_checked_from_its_run(tmp_path, capsys, no_ray):
    """An optuna block's configs are not in the study's cells until its sampler asks them: a
    proposal's finished run is checked from the config its params hold."""
    from studies.cells.space import Cell
    from studies.running.tune_experiment import cell_payload
    from studies.running.versions import check_version, save_versions
    from studies.studyfile.spec import load_study
    from studies.tracking import CellRun, StudyTracking, default_tracking_uri

    data = write_arrays(tmp_path / "digits.npz")
    path = study_file(
        tmp_path,
        "asked",
        {"name": "arrays", "root": str(data), "val_fraction": 0.25},
        design=[{"kind": "optuna", "n_configs": 2, "parameters": {"optim.lr": {"loguniform": [0.01, 0.1]}}}],
        objective={"metric": "test/top1", "mode": "max"},
    )
    study = load_study(path)
    folder = tmp_path / "out" / "asked"
    folder.mkdir(parents=True)
    version = check_version(study, "asked", folder, False)
    save_versions(folder, version)
    uri = default_tracking_uri(folder)
    (folder / "run.json").write_text(json.dumps({"name": "asked", "source": str(path), "tracking_uri": uri}))
    tracking = StudyTracking(uri, "asked", artifact_root=folder / "mlartifacts")
    tracking.version = version.version
    config = study.variant_config("base")
    config["optim"]["lr"] = 0.05
    cell = Cell("proposal-0", 0, "base", config, {"optim.lr": 0.05}, version.version)
    run, _ = CellRun.open(tracking.context("earlier"), cell_payload(cell))
    run.finish({"test": {"top1": 0.5}, "best_epoch": 0, "best_val": 0.5}, final_step=0)
    write_arrays(data, seed=1)
    code, text = run_cli(str(path), "--output", str(tmp_path / "out"), "--no-report", capsys=capsys)
    assert code == 2 and "1 finished cell was trained" in " ".join(text.split()), text
    assert "the data (1 cell):" in text, text


def test_the_report_lists_where_the_cells_differ():
    from analysis.run_provenance import CellsProvenance, provenance_rows

    def cell(torch: str, host: str, code: str) -> dict[str, str]:
        env = {"host": host, "python": "3.11.7", "torch": torch, "device": "cuda:0", "gpu": "NVIDIA H200"}
        return {TAG_ENVIRONMENT: json.dumps(env), TAG_IDENTITY: json.dumps({"code": ["d" + code, f"code {code}"]})}

    cells = [cell("2.14.1", "node-a", "1"), cell("2.14.1", "node-a", "1"), cell("2.15.0", "node-b", "1")]
    found = CellsProvenance.of(cells, {TAG_KEPT: "not json"})
    rows = dict(provenance_rows(found, None))
    assert rows["cells differ in torch"] == "2.14.1 (2 cells); 2.15.0 (1 cell)"
    assert rows["cells differ in host"] == "node-a (2 cells); node-b (1 cell)"
    assert rows["environment of the cells (3)"] == "python 3.11.7, gpu NVIDIA H200, device cuda:0"
    assert rows["code of the cells"] == "code 1" and "finished cells kept knowingly" not in rows
    assert "environment of the driver" not in rows  # no manifest: a study run before them


def _log_same_data_set(uri: str, run_id: str, digest: str, barrier, errors) -> None:
    from mlflow import MlflowClient

    from studies.tracking.provenance import log_data_input

    client = MlflowClient(uri)
    client.get_run(run_id)  # the store opened before the race
    data = DataFingerprint(name="arrays", digest=digest, source="/data/digits", files=1, bytes=10)
    barrier.wait()
    try:
        log_data_input(client, run_id, data)
    except Exception as error:  # noqa: BLE001  (reported to the parent, which fails the test)
        errors.put(f"{type(error).__name__}: {str(error)[:200]}")


@pytest.mark.slow  # ~10 s: forked writers on one SQLite store
def test_cells_starting_together_all_log_their_new_data_set(tmp_path):
    """Cells of one study open their runs at once and each logs the same, new data set: MLflow
    inserts the data set's row on the first sight of it, so all but one insert are refused
    (a unique constraint); every run must still end with the data set as its input."""
    import multiprocessing

    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("race")
    context = multiprocessing.get_context("fork")
    writers, rounds = 6, 3
    errors = context.Queue()
    for round_ in range(rounds):
        digest = f"{round_:02d}" * 16  # 32 hex characters, as recorded
        runs = [client.create_run(experiment).info.run_id for _ in range(writers)]
        barrier = context.Barrier(writers)
        processes = [
            context.Process(target=_log_same_data_set, args=(uri, run, digest, barrier, errors)) for run in runs
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=120)
        assert [p.exitcode for p in processes] == [0] * writers
        found = []
        while not errors.empty():
            found.append(errors.get())
        assert found == []
        for run in runs:
            (logged,) = client.get_run(run).inputs.dataset_inputs
            assert logged.dataset.digest == digest


def test_the_parent_run_logs_the_studys_data_sets_before_any_cell(tmp_path):
    """The driver logs each data set of the study on its parent run when it opens it, so that
    the data sets' rows exist before cells that start together log them (they would race to
    insert the same row); once however often the parent is opened."""
    from mlflow import MlflowClient

    from studies.tracking import StudyTracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    fingerprints = [
        DataFingerprint(name="arrays", digest="ab" * 16, source="/data/a.npz", files=1, bytes=10),
        DataFingerprint(name="synthetic", digest="cd" * 16, source="setvalued.data.synthetic", parameters={"n": 3}),
    ]
    data = {f"key{i}": json.dumps(f.to_json(), sort_keys=True) for i, f in enumerate(fingerprints)}
    for _ in range(2):  # a study run, then resumed
        parent = StudyTracking(uri, "study", data_fingerprints=data).parent_run_id()
    inputs = MlflowClient(uri).get_run(parent).inputs.dataset_inputs
    assert sorted((i.dataset.name, i.dataset.digest) for i in inputs) == [
        ("arrays:a.npz", "ab" * 16),
        ("synthetic", "cd" * 16),
    ]
