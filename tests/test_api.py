"""The Python API used as a notebook would: load, look at the cells, run, collect, report."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from studies import api

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "studies" / "catalog" / "quickstart.yaml"


def test_load_and_dry_run_without_starting_anything(tmp_path):
    study = api.load(QUICKSTART)
    cells = api.cells(study)
    assert len(cells) == len({c.config_id for c in cells}) * len(study.seeds)
    table = api.dry_run(study)
    assert table.splitlines()[-1].startswith(f"{len(cells)} cells = ")
    assert not (tmp_path / "studies_out").exists()
    with pytest.raises(FileNotFoundError, match="no study named 'quickstart'"):
        api.collect("quickstart", output=tmp_path / "studies_out")


@pytest.mark.slow
def test_run_collect_and_report_like_a_notebook(tmp_path, mlflow_server):
    out = tmp_path / "studies_out"
    commit = (
        __import__("subprocess")
        .run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        .stdout.strip()
    )  # the checkout's, when the study ran
    outcome = api.run(
        QUICKSTART, smoke=True, output=out, tracking_uri=mlflow_server, report=False, num_cpus=2, stream=io.StringIO()
    )
    assert outcome.exit_code == 0 and outcome.failed == {}
    runs = api.collect(outcome.study_name, output=out)  # the tracking URI comes from run.json
    frame = runs.table.to_pandas()
    expected = api.cells(api.load(QUICKSTART), smoke=True)
    assert sorted(frame["cell_id"]) == sorted(c.cell_id for c in expected)
    assert frame["test/top5"].between(0, 1).all()
    html = api.report(outcome.study_name, output=out)
    assert html.exists() and html.with_suffix(".md").exists()
    _check_what_the_mlflow_ui_shows(mlflow_server, outcome.study_name, expected, commit)


def _check_what_the_mlflow_ui_shows(server: str, name: str, cells, commit: str) -> None:
    """The experiment opens in the model-training view with the study's description; runs carry
    MLflow's system tags, a readable name per config, and only the params that apply."""
    from mlflow import MlflowClient

    client = MlflowClient(server)
    experiment = client.get_experiment_by_name(name)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    link, description = experiment.tags["mlflow.note.content"].split("\n\n", 1)
    assert description == api.load(QUICKSTART).description.strip()
    assert link.endswith(
        f"(#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning&viewStateShareKey=studies-cells)"
    )
    runs = client.search_runs([experiment.experiment_id], "tags.`studies.role` = 'cell'")
    assert len(runs) == len(cells)
    names = {}
    for run in runs:
        tags = run.data.tags
        assert tags["mlflow.source.name"] == str(QUICKSTART) and tags["mlflow.source.type"] == "LOCAL"
        assert "mlflow.user" in tags
        if commit:
            assert tags["mlflow.source.git.commit"] == commit
        names.setdefault(run.info.run_name.rsplit(" s", 1)[0], set()).add(tags["studies.config_id"])
        assert "model.depth" not in run.data.params and "amp" not in run.data.params  # an MLP on the CPU
        assert "eval.avgk_activation" not in run.data.params  # no average-K
    assert all(len(ids) == 1 for ids in names.values()), names  # one name, one config
    assert len(names) == len({c.config_id for c in cells})
