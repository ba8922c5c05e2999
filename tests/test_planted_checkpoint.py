"""A pickle planted in a shared storage folder, where a resumed study looks for checkpoints:
it must not run, the cell starts from scratch in a new run, and the study finishes."""

from __future__ import annotations

import io
import json
import pickle
import uuid

import pytest
from test_runner import child_runs, options, write_study

pytestmark = pytest.mark.slow


class _PlantedCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def plant_unfinished_cell(tmp_path, mlflow_server, prefix, seed, write_state, history):
    """A one-cell study whose cell a killed driver left mid-way: its running MLflow run and the
    Tune checkpoint folder where a resumed study looks, with `write_state(path)` as its state
    file. Returns (study file, study name, cell, earlier run, MlflowClient)."""
    from mlflow import MlflowClient

    from studies.cells.space import expand
    from studies.running.checkpoints import META_FILE, STATE_FILE
    from studies.studyfile.spec import load_study

    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    path = write_study(tmp_path, name, lrs=[0.1], seeds=[seed], epochs=2)
    (cell,) = expand(load_study(path))
    client = MlflowClient(mlflow_server)
    experiment = client.create_experiment(name)
    earlier = client.create_run(
        experiment,
        tags={
            "studies.role": "cell",
            "studies.study": name,
            "studies.cell_id": cell.cell_id,
            "studies.status": "running",
        },
    )
    folder = tmp_path / "out" / name / "ray" / "tune-old" / cell.cell_id / "checkpoint_000000"
    folder.mkdir(parents=True)
    write_state(folder / STATE_FILE)
    (folder / META_FILE).write_text(
        json.dumps(
            {"study": name, "cell_id": cell.cell_id, "run_id": earlier.info.run_id, "epoch": 0, "history": history}
        )
    )
    return path, name, cell, earlier, client


def test_a_planted_checkpoint_does_not_run_and_the_cell_restarts(local_ray, mlflow_server, tmp_path):
    from studies.running.runner import run_study

    marker = tmp_path / "code_ran"

    def planted(state_file):  # what a killed driver's Tune trial leaves, with a planted state file
        with open(state_file, "wb") as handle:
            pickle.dump({"format": 1, "payload": _PlantedCode(marker)}, handle)

    path, name, _, earlier, client = plant_unfinished_cell(tmp_path, mlflow_server, "planted", 0, planted, [])
    stream = io.StringIO()
    outcome = run_study(path, options(tmp_path, mlflow_server, stream=stream))
    assert not marker.exists(), "the planted checkpoint ran code"
    assert outcome.exit_code == 0, stream.getvalue()[-3000:]
    (run,) = child_runs(mlflow_server, name)  # one active run per cell: the earlier one is deleted
    assert run.info.run_id != earlier.info.run_id and run.data.tags["studies.status"] == "finished"
    assert client.get_run(earlier.info.run_id).info.lifecycle_stage == "deleted"
    history = client.get_metric_history(run.info.run_id, "val/top3")
    assert sorted(m.step for m in history) == [0, 1]  # trained from scratch, each epoch once
    assert "its checkpoint could not be loaded (UnpicklingError" in stream.getvalue()  # the console knows


def test_a_checkpoint_torch_cannot_load_is_told_on_the_console_by_the_cell_s_name(local_ray, mlflow_server, tmp_path):
    """The session announces that the unfinished cell continues from its checkpoint; the trial
    finds state.pt truncated (torch refuses it) and restarts from epoch 0: the driver's console
    says so, on one line naming the cell as its run is named, and the cell still finishes."""
    import torch

    from studies.cells.run_names import run_names
    from studies.running.runner import run_study

    def truncated(state_file):  # a write cut short by a kill
        torch.save({"model": {"w": torch.zeros(4096)}, "epoch": 0}, state_file)
        data = state_file.read_bytes()
        state_file.write_bytes(data[: len(data) // 2])

    path, name, cell, earlier, client = plant_unfinished_cell(
        tmp_path, mlflow_server, "truncated", 1, truncated, [[0, {"val/top3": 0.5}]]
    )
    stream = io.StringIO()
    outcome = run_study(path, options(tmp_path, mlflow_server, stream=stream))
    console = stream.getvalue()
    assert outcome.exit_code == 0, console[-3000:]
    assert "1 unfinished cells continue from the checkpoint" in console  # what was announced
    lines = [line for line in console.splitlines() if "could not be loaded" in line]
    assert len(lines) == 1, console[-3000:]
    readable = run_names([cell])[cell.cell_id]
    assert f"cell {readable}: its checkpoint could not be loaded (" in lines[0], lines[0]
    reason = lines[0].split("could not be loaded (", 1)[1].rsplit("); restarted from epoch 0", 1)
    assert reason[0] and reason[1] == "", lines[0]  # torch's words, then the end of the line
    (run,) = child_runs(mlflow_server, name)
    assert run.info.run_id != earlier.info.run_id and run.data.tags["studies.status"] == "finished"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val/top3")) == [0, 1]
