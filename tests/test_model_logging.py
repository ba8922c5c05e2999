"""The selected checkpoint of a cell is an MLflow model a user can load from the run (real
local Ray, real MLflow server), and a study can turn this off."""

from __future__ import annotations

import io

import pytest
from test_runner import child_runs, options, write_study

pytestmark = pytest.mark.slow


def test_the_selected_model_loads_from_mlflow_and_predicts_as_the_trainer(local_ray, mlflow_server, tmp_path):
    import mlflow.pytorch
    import torch

    from setvalued.training import fit
    from studies.cells.space import expand
    from studies.running.runner import run_study
    from studies.studyfile.spec import load_study

    path = write_study(tmp_path, "models-on", lrs=[0.1], seeds=[0], epochs=2, log_models=True)
    stream = io.StringIO()
    outcome = run_study(path, options(tmp_path, mlflow_server, stream=stream))
    assert outcome.exit_code == 0, stream.getvalue()[-3000:]
    (run,) = child_runs(mlflow_server, "models-on")
    from mlflow import MlflowClient

    # an MLflow 3 Logged Model made by the cell's run (the experiment's Models tab)
    client = MlflowClient(mlflow_server)
    (logged,) = client.search_logged_models([run.info.experiment_id])
    assert (logged.name, logged.source_run_id) == ("model", run.info.run_id)
    assert [o.model_id for o in client.get_run(run.info.run_id).outputs.model_outputs] == [logged.model_id]
    # the UI groups the cell runs by their config's readable name: the run name less its seed
    assert run.data.tags["studies.config_name"] == run.info.run_name.removesuffix(" s0")
    mlflow.set_tracking_uri(mlflow_server)
    loaded = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    torch.set_num_threads(1)
    (cell,) = expand(load_study(path))
    reference = fit(cell.config, cell.seed)  # the same selected checkpoint, trained here
    x = reference["input_example"]
    expected = reference["model"](x)
    assert torch.allclose(loaded(x), expected, atol=1e-5), "the logged model is not the selected one"

    off = write_study(tmp_path, "models-off", lrs=[0.1], seeds=[0], epochs=1)  # log_models: false
    assert run_study(off, options(tmp_path, mlflow_server)).exit_code == 0
    (run_off,) = child_runs(mlflow_server, "models-off")
    assert [a.path for a in MlflowClient(mlflow_server).list_artifacts(run_off.info.run_id)] == [
        "per_class_test.parquet"
    ]
