"""What a researcher sees of a study in the MLflow UI (3.x), in a real headless Chromium with a
fresh profile, on a real MLflow server: the report's link opens the model-training UI with
every cell run of the quickstart listed, grouped by its config's readable name, and the
selected model is a Logged Model of its run in the experiment's Models tab.

The quickstart's 15 cells are written by the tracking code the trials use (`StudyTracking`,
`CellRun`) with their real run names, with stand-in metrics instead of training (training
them takes minutes); the logged model is a real torch module.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
QUICKSTART = Path(__file__).resolve().parents[1] / "studies" / "catalog" / "quickstart.yaml"
#: what the GenAI UI's sidebar holds and the model-training one does not
GENAI_ONLY = ("Training runs", "Overview", "Judges", "Prompts")


def page_texts(url: str, profile: Path, height: int = 2400) -> list[str]:
    """The text nodes of the page at `url` once the app has rendered, as a fresh browser
    (an empty profile) shows it; tall, so that the runs grid renders every row."""
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed")
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
         f"--window-size=1400,{height}", "--virtual-time-budget=20000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    dom = re.sub(r"<(script|style)\b.*?</\1>", "", done.stdout, flags=re.S)
    return [html.unescape(t).strip() for t in re.findall(r">([^<>]+)<", dom) if t.strip()]


@pytest.fixture(scope="module")
def quickstart_runs(mlflow_server):
    """The quickstart's cells as MLflow runs of a study with a unique name, the selected
    model logged on the first; (study name, run names by config name, model's run)."""
    import torch

    from studies.cells.run_names import config_name, run_names
    from studies.cells.space import expand
    from studies.studyfile.spec import load_study
    from studies.tracking.cell_run import CellRun
    from studies.tracking.ledger import StudyTracking, new_session_id
    from studies.running.tune_experiment import cell_payload

    name = f"quickstart-ui-{uuid.uuid4().hex[:6]}"
    cells = expand(load_study(QUICKSTART))
    names = run_names(cells)
    tracking = StudyTracking(mlflow_server, name, description="the quickstart, in the UI")
    context = tracking.context(new_session_id())
    groups: dict[str, list[str]] = {}
    model_run = None
    for i, cell in enumerate(cells):
        run, _ = CellRun.open(context, cell_payload(cell, run_name=names[cell.cell_id]))
        groups.setdefault(config_name(names[cell.cell_id], cell.seed), []).append(names[cell.cell_id])
        if model_run is None:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 40))
            run.log_model(model, torch.randn(2, 32), step=2)
            model_run = (run.run_id, names[cell.cell_id], model)
        run.finish({"test": {"top1": 30.0 + i, "top5": 60.0 + i}, "best_epoch": 2}, final_step=3,
                   pending=[(e, {"val/top5": 50.0 + i + e, "epoch_time_s": 0.1}) for e in range(3)])
    tracking.close_parent(True)
    return name, groups, model_run


def test_the_reports_link_opens_every_cell_run_grouped_by_config_in_the_training_ui(
        quickstart_runs, mlflow_server, tmp_path):
    from analysis.collect import collect
    from analysis.provenance import mlflow_ui

    name, groups, _ = quickstart_runs
    assert len(groups) == 5 and sum(map(len, groups.values())) == 15
    _, link, _ = mlflow_ui(collect(mlflow_server, name))
    texts = page_texts(link, tmp_path / "profile")
    joined = " | ".join(texts)

    assert "Model training" in texts and "Runs" in texts and "Models" in texts, joined[:3000]
    assert not set(GENAI_ONLY) & set(texts), f"the GenAI UI opened: {joined[:3000]}"
    assert re.search(r"\b15 \| matching runs", joined), joined[-3000:]
    # one group per config, labelled with its readable name, every run of it listed
    assert sorted(t.removeprefix("Group: ") for t in texts if t.startswith("Group: ")) == sorted(groups)
    listed = [t for t in texts if any(t in runs for runs in groups.values())]
    assert sorted(listed) == sorted(n for runs in groups.values() for n in runs)
    assert "Group by: studies.config_name" in texts, joined[:3000]


def test_without_the_view_the_link_still_lists_every_cell_run_flat(quickstart_runs, mlflow_server,
                                                                  tmp_path):
    """An experiment written before it held the view: the link carries the filter and a sort
    by name, so that the UI does not fetch the parent run and fold the cells under it."""
    import dataclasses

    from analysis.collect import collect
    from analysis.provenance import mlflow_ui

    name, groups, _ = quickstart_runs
    collected = dataclasses.replace(collect(mlflow_server, name), ui_view=False)
    _, link, _ = mlflow_ui(collected)
    assert "viewStateShareKey" not in link
    texts = page_texts(link, tmp_path / "profile")
    joined = " | ".join(texts)
    assert not set(GENAI_ONLY) & set(texts), joined[:3000]
    assert re.search(r"\b15 \| matching runs", joined), joined[-3000:]
    runs = sorted(n for names in groups.values() for n in names)
    assert sorted(t for t in texts if t in runs) == runs  # not folded under the parent run


def test_the_selected_model_is_a_logged_model_of_its_run_in_the_models_tab(
        quickstart_runs, mlflow_server, tmp_path):
    import mlflow.pytorch
    import torch
    from mlflow import MlflowClient

    name, _, (run_id, run_name, model) = quickstart_runs
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name(name)
    (logged,) = client.search_logged_models([experiment.experiment_id])
    assert (logged.name, logged.source_run_id, str(logged.status)) == ("model", run_id, "READY")
    assert [o.model_id for o in client.get_run(run_id).outputs.model_outputs] == [logged.model_id]
    mlflow.set_tracking_uri(mlflow_server)
    loaded = mlflow.pytorch.load_model(f"runs:/{run_id}/model")
    x = torch.randn(4, 32)
    assert torch.allclose(loaded(x), model(x), atol=1e-6)

    texts = page_texts(f"{mlflow_server}/#/experiments/{experiment.experiment_id}/models?"
                       "workflowType=machine_learning", tmp_path / "profile", height=900)
    row = texts[texts.index("model"):]
    assert "Ready" in row and run_name in row, " | ".join(texts)[:3000]
