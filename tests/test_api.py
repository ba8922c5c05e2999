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


def test_the_apis_errors_name_its_arguments_and_the_commands_its_flags(tmp_path, capsys):
    """A notebook is told to pass ``output=DIR`` / ``tracking_uri=URI``, the command line
    ``--output DIR``, also where the command goes through the API (issue 42)."""
    from studies.cli import main

    with pytest.raises(FileNotFoundError) as unknown:
        api.collect("quickstart", output=tmp_path)
    assert "output=DIR" in str(unknown.value) and "--output" not in str(unknown.value)
    assert main(["export", "quickstart", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--output DIR" in err and "output=DIR" not in err.replace("--output DIR", "")

    (tmp_path / "empty").mkdir()  # a study folder without run.json or mlflow.db
    (tmp_path / "empty" / "study.yaml").write_text("name: empty\n")
    with pytest.raises(FileNotFoundError, match=r"tracking_uri=URI") as bare:
        api.table("empty", output=tmp_path)
    assert "--tracking-uri" not in str(bare.value)

    from studies.studyfile.problems import StudyError

    with pytest.raises(StudyError) as too_big:
        api.load(QUICKSTART, max_cells=10)  # 15 cells
    assert "or max_cells=N)" in str(too_big.value) and "--max-cells" not in str(too_big.value)
    assert main(["run", str(QUICKSTART), "--dry-run", "--max-cells", "10"]) == 2
    assert "or --max-cells N)" in capsys.readouterr().err


def test_histories_of_a_metric_never_logged_is_a_key_error_as_the_tables(tmp_path):
    """`histories` and `table` refuse a metric that no cell logged alike, naming the logged
    ones (`histories` returned an empty frame, issue 42)."""
    from test_collect import BASE_CONFIG, _finished, log_study_runs

    study_dir = tmp_path / "tiny"
    study_dir.mkdir()
    uri = f"sqlite:///{study_dir / 'mlflow.db'}"
    log_study_runs(uri, "tiny", [_finished("ce", BASE_CONFIG, seed, {}, 0.5) for seed in (0, 1)])
    assert set(api.histories("tiny", ["val/top5"], output=tmp_path)["metric"]) == {"val/top5"}
    for read in (api.table, api.histories):
        with pytest.raises(KeyError, match=r"no metric val/top50 in study 'tiny'; logged: .*val/top5"):
            read("tiny", ["val/top50"], output=tmp_path)


def test_every_argument_an_api_error_may_name_is_one_of_the_apis():
    """A message raised under the API names an argument (`studies.errors.OPTION_NAMES`): each is
    a parameter of `api.run` or of the function that reads it (`load`'s ``max_cells``)."""
    import inspect

    from studies.errors import OPTION_NAMES

    parameters = set(inspect.signature(api.run).parameters) | set(inspect.signature(api.load).parameters)
    for name, (flag, argument) in OPTION_NAMES.items():
        assert argument.split("=")[0] == name and flag.startswith("--"), (name, flag, argument)
        assert name in parameters, f"an API error may say {argument!r}, which no API function takes"
