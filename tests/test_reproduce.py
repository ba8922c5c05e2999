"""`studies reproduce` (issue 39): the comparison and its verdicts on values written out, the
config a run's params give back for every cell of the catalogue. Training a real cell again is
in tests/test_identity.py (slow)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest

from studies.running.reproduce import EXIT_CODES, FINAL, compare_metrics, describe
from studies.tracking.contract import config_of_params

CATALOG = Path(__file__).resolve().parents[1] / "studies" / "catalog"


def values(**per_epoch) -> dict:
    return {(epoch, metric): value for metric, series in per_epoch.items() for epoch, value in series.items()}


def test_identical_within_and_differs_with_the_first_epoch_and_metric():
    old = values(**{"val/top1": {"0": 0.5, "1": 0.6}, "train/loss": {"0": 2.0, "1": 1.5}}) | {
        (FINAL, "test/top1"): 0.55
    }
    same = compare_metrics(old, dict(old), 1e-6)
    assert (same.verdict, same.compared, same.largest) == ("identical", 5, 0.0)
    assert EXIT_CODES[same.verdict] == 0

    close = dict(old) | {("1", "val/top1"): 0.6 + 1e-9, ("0", "train/loss"): 2.0 - 2e-7}
    within = compare_metrics(old, close, 1e-6)
    assert within.verdict == "within" and math.isclose(within.largest, 2e-7, rel_tol=1e-6)
    assert within.largest_at == ("0", "train/loss") and EXIT_CODES["within"] == 3
    assert compare_metrics(old, close, 1e-8).verdict == "differs"  # |2e-7| > 1e-8 x max(1, 2.0)

    moved = dict(old) | {("1", "train/loss"): 1.4, ("1", "val/top1"): 0.7, (FINAL, "test/top1"): 0.1}
    differs = compare_metrics(old, moved, 1e-6)
    assert differs.verdict == "differs" and differs.first_differing == ("1", "train/loss", 1.5, 1.4)
    assert math.isclose(differs.largest, 0.45) and differs.largest_at == (FINAL, "test/top1")
    assert "first at epoch 1, train/loss: 1.5 -> 1.4" in describe(differs, 1e-6)[-1]


def test_a_value_not_produced_again_differs_and_nan_equals_nan():
    old = {("0", "val/top1"): 0.5, ("1", "val/top1"): math.nan}
    found = compare_metrics(old, {("1", "val/top1"): math.nan, ("1", "grad_nonzero"): 3.0}, 1e-6)
    assert found.verdict == "differs" and found.missing == [("0", "val/top1")] and found.unrecorded == 1
    assert "epoch 0, val/top1: 0.5 -> (absent)" in describe(found, 1e-6)[-1]
    assert compare_metrics({("1", "x"): math.nan}, {("1", "x"): math.nan}, 0).verdict == "identical"
    assert compare_metrics({(FINAL, "x"): 1.0}, {(FINAL, "x"): math.inf}, 1.0).verdict == "differs"


@pytest.mark.parametrize("path", sorted(CATALOG.glob("*.yaml")), ids=lambda p: p.stem)
def test_a_runs_params_give_back_the_config_the_trainer_took(path):
    from setvalued.training.setup import resolve_config
    from studies.cells.space import expand, smoke_cells
    from studies.studyfile.spec import load_study
    from studies.tracking import config_params

    cells = expand(load_study(path))
    for cell in [*cells[:20], *smoke_cells(cells[:5])]:
        assert resolve_config(config_of_params(config_params(cell.config))) == resolve_config(cell.config)


# ----------------------------------------------------------------------------- a real cell, no Ray

SMALL = {
    "name": "again",
    "base": {
        "data": {"name": "synthetic", "num_classes": 6, "num_superclasses": 2, "train_size": 120, "val_size": 40},
        "model": {"name": "mlp", "hidden_dim": 8},
        "loss": {"name": "ce"},
        "optim": {"lr": 0.1, "batch_size": 16, "milestones": []},
        "epochs": 3,
        "eval": {"ks": [1, 2], "selection": "val/top2"},
        "device": "cpu",
    },
    "seeds": [0],
    "log_models": False,
}


def recorded_study(tmp_path, monkeypatch, stopped: int | None = None) -> tuple[str, str]:
    """A study folder whose one cell's run was written as a trial writes it (`CellRun`), from
    `fit`'s own epochs and result (cut at ``stopped`` epochs as a config-level stop does:
    fit with the full epochs up to there, then `epochs` cut and the selected checkpoint tested).
    Returns (output folder, cell id)."""
    import json

    import yaml

    from analysis.layout import TAG_STOPPED_EPOCH
    from setvalued.training import fit
    from studies.cells.space import expand
    from studies.running.trial import numeric_metrics, with_epochs
    from studies.running.tune_experiment import cell_payload
    from studies.studyfile.spec import load_study
    from studies.tracking import CellRun, StudyTracking, default_tracking_uri

    monkeypatch.setenv("SETVALUED_DIGEST_CACHE", str(tmp_path / "digests.sqlite"))
    path = tmp_path / "again.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    (cell,) = expand(load_study(path))
    folder = tmp_path / "out" / "again"
    folder.mkdir(parents=True)
    uri = default_tracking_uri(folder)
    (folder / "run.json").write_text(json.dumps({"name": "again", "source": str(path), "tracking_uri": uri}))
    tracking = StudyTracking(uri, "again", artifact_root=folder / "mlartifacts")
    run, _ = CellRun.open(tracking.context("earlier"), cell_payload(cell))
    epochs, states = [], []

    class Stop(Exception):
        pass

    def on_epoch(epoch, metrics, state):
        epochs.append((epoch, {k: v for k, v in numeric_metrics(metrics).items() if k != "epoch"}))  # as logged
        states.append(state)
        if stopped is not None and epoch + 1 >= stopped:
            raise Stop

    try:
        result = fit(cell.config, 0, on_epoch=on_epoch)
    except Stop:
        result = fit({**cell.config, "epochs": stopped}, 0, checkpoint=with_epochs(states[-1], stopped))
        run.set_tags({TAG_STOPPED_EPOCH: str(stopped)})
    run.log_epochs(epochs)
    run.finish(result, final_step=epochs[-1][0])
    return str(tmp_path / "out"), cell.cell_id


@pytest.mark.parametrize("stopped", [None, 2])
def test_a_cell_trained_again_is_identical_and_a_changed_record_differs(tmp_path, monkeypatch, capsys, stopped):
    from mlflow import MlflowClient

    from studies.cli import main
    from studies.running.reproduce import reproduce_cell

    out, cell_id = recorded_study(tmp_path, monkeypatch, stopped)
    assert main(["reproduce", "again", "--cell", cell_id, "--output", out]) == 0
    text = capsys.readouterr().out
    assert "verdict: identical" in text and "note:" not in text, text
    assert (", stopped after epoch 2" in text) == (stopped == 2)
    epochs = 2 if stopped else 3
    compared = int(text.split("compared ")[1].split(" ")[0])
    assert compared > 10 * epochs  # every per-epoch metric of each epoch, and the final ones

    client = MlflowClient(f"sqlite:///{out}/again/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("again").experiment_id])[0]
    client.log_metric(run.info.run_id, "test/top1", run.data.metrics["test/top1"] + 0.25, step=epochs - 1)
    stream = io.StringIO()
    verdict, found = reproduce_cell("again", cell_id, output=out, stream=stream)
    assert verdict == "differs" and found.first_differing[:2] == (FINAL, "test/top1"), stream.getvalue()
    assert "first at the final metrics, test/top1" in stream.getvalue()
    assert sorted(p.name for p in (tmp_path / "out" / "again").iterdir()) == ["mlartifacts", "mlflow.db", "run.json"]


def test_an_unknown_cell_exits_2_naming_the_cells_there(tmp_path, monkeypatch, capsys):
    from studies.cli import main

    out, cell_id = recorded_study(tmp_path, monkeypatch)
    assert main(["reproduce", "again", "--cell", cell_id[:-1] + "9", "--output", out]) == 2
    assert f"no finished cell '{cell_id[:-1]}9'" in capsys.readouterr().err
