"""What a researcher sees of a study in the MLflow UI (3.x), in a real headless Chromium with a
fresh profile, on a real MLflow server: the report's link opens the model-training UI with
every cell run of the quickstart listed, grouped by its config's readable name, with the swept
parameter's and the report metrics' columns (a group row shows its runs' mean); its chart view
starts with the report metrics against the swept parameter and the learning curves, each run
in its config's colour in the report; the bare experiment page links there from its note; and
the selected model is a Logged Model of its run in the experiment's Models tab.

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


def page_dom(url: str, profile: Path, height: int = 2400, budget_ms: int = 20000) -> str:
    """The DOM of the page at `url` once the app has rendered (`budget_ms` of the browser's
    virtual time), as a fresh browser (an empty profile) shows it; tall, so that the runs grid
    renders every row."""
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed")
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={profile}",
            f"--window-size=1400,{height}",
            f"--virtual-time-budget={budget_ms}",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return re.sub(r"<(script|style)\b.*?</\1>", "", done.stdout, flags=re.S)


def page_texts(url: str, profile: Path, height: int = 2400, budget_ms: int = 20000) -> list[str]:
    """The text nodes of the page at `url` (`page_dom`)."""
    dom = page_dom(url, profile, height, budget_ms)
    return [html.unescape(t).strip() for t in re.findall(r">([^<>]+)<", dom) if t.strip()]


@pytest.fixture(scope="module")
def quickstart_runs(mlflow_server):
    """The quickstart's cells as MLflow runs of a study with a unique name, the selected
    model logged on the first; (study name, run names by config name, model's run).

    The experiment holds the view the runner gives it (`study_view`) and each run the colour
    the runner's session gives it (`run_colors`). A run's stand-in ``test/top1`` is 30 plus
    its index, so that a group's mean is known."""
    import torch

    from studies.cells.run_names import RunNamer, config_name
    from studies.cells.space import expand
    from studies.running.tune_experiment import cell_payload
    from studies.studyfile.spec import load_study
    from studies.tracking.cell_run import CellRun
    from studies.tracking.ledger import StudyTracking, new_session_id
    from studies.tracking.ui_view import run_colors, study_view

    name = f"quickstart-ui-{uuid.uuid4().hex[:6]}"
    study = load_study(QUICKSTART)
    cells = expand(study)
    namer = RunNamer()
    names = namer.names(cells)
    colors = run_colors(namer.configs, list(study.variants))
    tracking = StudyTracking(
        mlflow_server, name, description="the quickstart, in the UI", ui_view=study_view(study, cells)
    )
    context = tracking.context(new_session_id())
    groups: dict[str, list[str]] = {}
    top1: dict[str, float] = {}  # run name -> its stand-in test/top1
    run_color: dict[str, str] = {}  # run name -> its config's colour
    model_run = None
    for i, cell in enumerate(cells):
        run, _ = CellRun.open(context, cell_payload(cell, run_name=names[cell.cell_id], color=colors[cell.config_id]))
        groups.setdefault(config_name(names[cell.cell_id], cell.seed), []).append(names[cell.cell_id])
        if model_run is None:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 40))
            run.log_model(model, torch.randn(2, 32), step=2)
            model_run = (run.run_id, names[cell.cell_id], model)
        run.finish(
            {"test": {"top1": 30.0 + i, "top5": 60.0 + i}, "best_epoch": 2},
            final_step=3,
            pending=[(e, {"val/top5": 50.0 + i + e, "epoch_time_s": 0.1}) for e in range(3)],
        )
        top1[names[cell.cell_id]] = 30.0 + i
        run_color[names[cell.cell_id]] = colors[cell.config_id]
    tracking.close_parent(True)
    return name, groups, model_run, {"top1": top1, "colors": run_color}


def test_the_reports_link_opens_every_cell_run_grouped_by_config_in_the_training_ui(
    quickstart_runs, mlflow_server, tmp_path
):
    from analysis.collect import collect
    from analysis.provenance import mlflow_ui

    name, groups, *_ = quickstart_runs
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


def test_without_the_view_the_link_still_lists_every_cell_run_flat(quickstart_runs, mlflow_server, tmp_path):
    """An experiment written before it held the view: the link carries the filter and a sort
    by name, so that the UI does not fetch the parent run and fold the cells under it."""
    import dataclasses

    from analysis.collect import collect
    from analysis.provenance import mlflow_ui

    name, groups, *_ = quickstart_runs
    collected = dataclasses.replace(collect(mlflow_server, name), ui_view=False)
    _, link, _ = mlflow_ui(collected)
    assert "viewStateShareKey" not in link
    texts = page_texts(link, tmp_path / "profile")
    joined = " | ".join(texts)
    assert not set(GENAI_ONLY) & set(texts), joined[:3000]
    assert re.search(r"\b15 \| matching runs", joined), joined[-3000:]
    runs = sorted(n for names in groups.values() for n in names)
    assert sorted(t for t in texts if t in runs) == runs  # not folded under the parent run


def test_the_selected_model_is_a_logged_model_of_its_run_in_the_models_tab(quickstart_runs, mlflow_server, tmp_path):
    import mlflow.pytorch
    import torch
    from mlflow import MlflowClient

    name, _, (run_id, run_name, model), _ = quickstart_runs
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name(name)
    (logged,) = client.search_logged_models([experiment.experiment_id])
    assert (logged.name, logged.source_run_id, str(logged.status)) == ("model", run_id, "READY")
    assert [o.model_id for o in client.get_run(run_id).outputs.model_outputs] == [logged.model_id]
    mlflow.set_tracking_uri(mlflow_server)
    loaded = mlflow.pytorch.load_model(f"runs:/{run_id}/model")
    x = torch.randn(4, 32)
    assert torch.allclose(loaded(x), model(x), atol=1e-6)

    texts = page_texts(
        f"{mlflow_server}/#/experiments/{experiment.experiment_id}/models?workflowType=machine_learning",
        tmp_path / "profile",
        height=900,
    )
    row = texts[texts.index("model") :]
    assert "Ready" in row and run_name in row, " | ".join(texts)[:3000]


def grid_cells(dom: str) -> dict[tuple[str, str], str]:
    """{(row id, column id): text} of the runs grid in `dom` (ag-grid: a group row's id is
    ``tag.<tag>.<value>``, a column's the UI's column id, `analysis.layout.ui_column`)."""
    cells: dict[tuple[str, str], str] = {}
    for row in re.split(r'(?=<div [^>]*role="row")', dom)[1:]:
        found = re.search(r'row-id="([^"]*)"', row.split(">", 1)[0])
        if not found:
            continue
        for part in re.split(r'(?=<div [^>]*col-id=")', row)[1:]:
            col = re.search(r'col-id="([^"]*)"', part).group(1)
            text = " ".join(html.unescape(t).strip() for t in re.findall(r">([^<>]+)<", part) if t.strip())
            if text:
                cells[html.unescape(found.group(1)), html.unescape(col)] = text
    return cells


def _between(texts: list[str], first: str, last: str | None) -> list[str]:
    """The texts from `first` up to (not including) `last` (the end when None or absent)."""
    start = texts.index(first)
    end = texts.index(last, start + 1) if last in texts[start + 1 :] else len(texts)
    return texts[start:end]


def test_the_reports_link_pins_the_sweep_and_the_report_metrics_with_group_means(
    quickstart_runs, mlflow_server, tmp_path
):
    """Columns: the swept `loss.epsilon` and the report tables' `test/top1`, `test/top5`; each
    group row holds its runs' mean of test/top1 and of the swept parameter."""
    from analysis.collect import collect
    from analysis.layout import UI_VIEW_NAME
    from analysis.provenance import mlflow_ui

    name, groups, _, logged = quickstart_runs
    _, link, _ = mlflow_ui(collect(mlflow_server, name))
    dom = page_dom(link, tmp_path / "profile")
    texts = [html.unescape(t).strip() for t in re.findall(r">([^<>]+)<", dom) if t.strip()]
    joined = " | ".join(texts)
    assert UI_VIEW_NAME in texts, joined[:3000]  # the saved view, named in the Views menu
    header = _between(texts, "Run Name", f"Group: {sorted(groups)[0]}")
    for column in ("loss.epsilon", "test/top1", "test/top5"):
        assert column in header, f"no column {column}: {joined[:3000]}"
    cells = grid_cells(dom)
    for group, runs in groups.items():
        mean = sum(logged["top1"][r] for r in runs) / len(runs)
        shown = cells.get((f"tag.studies.config_name.{group}", "metrics.`test/top1`"))
        assert shown == f"{mean:g} (average)", (group, mean, {k: v for k, v in cells.items() if k[0].endswith(group)})
    epsilons = {g: cells.get((f"tag.studies.config_name.{g}", "params.`loss.epsilon`")) for g in groups}
    for group, epsilon in epsilons.items():  # the mean of the runs' param (float sums)
        if "ε=" in group:
            assert float(epsilon) == pytest.approx(float(group.split("ε=")[1])), epsilons
        else:
            assert epsilon == "-", epsilons


def test_the_chart_view_puts_the_report_metrics_against_the_sweep_in_the_reports_colours(
    quickstart_runs, mlflow_server, tmp_path
):
    """The chart view's first section ("study") holds test/top1 and test/top5 against
    loss.epsilon and the learning curves of val/top5; every run has its config's colour in the
    report, one colour per config."""
    from mlflow import MlflowClient

    from analysis.collect import collect
    from analysis.layout import UI_CHART_MODE, UI_RUN_COLOR_TAG
    from analysis.provenance import mlflow_ui

    name, groups, _, logged = quickstart_runs
    _, link, _ = mlflow_ui(collect(mlflow_server, name))
    wanted = ("loss.epsilon vs. test/top1", "loss.epsilon vs. test/top5", "val/top5")
    for attempt, budget_ms in enumerate((20000, 60000)):  # the charts draw last: a busy machine
        texts = page_texts(f"{link}&{UI_CHART_MODE}", tmp_path / f"profile{attempt}", height=1600, budget_ms=budget_ms)
        joined = " | ".join(texts)
        assert "study" in texts, joined[:4000]
        charts = texts[texts.index("study") :]
        titles = [t for t in charts if t in wanted]
        if titles:
            break
    section = _between(texts, "study", "Add chart")
    assert section[:2] == ["study", "(3)"], section
    assert titles[:3] == list(wanted), joined[-4000:]

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name(name)
    runs = client.search_runs([experiment.experiment_id], "tags.`studies.role` = 'cell'")
    assert {r.info.run_name: r.data.tags[UI_RUN_COLOR_TAG] for r in runs} == logged["colors"]
    by_group = {g: {logged["colors"][r] for r in runs} for g, runs in groups.items()}
    assert all(len(c) == 1 for c in by_group.values())
    assert len({c for cs in by_group.values() for c in cs}) == len(groups)  # distinct
    # the runs list beside the charts shows each run with its colour
    shown = {texts[i + 1]: t for i, t in enumerate(texts[:-1]) if re.fullmatch(r"#[0-9a-f]{6}", t)}
    assert {r: c for r, c in shown.items() if r in logged["colors"]} == logged["colors"]


def test_the_bare_experiment_page_links_to_the_cell_runs_from_its_note(quickstart_runs, mlflow_server, tmp_path):
    """MLflow 3.17 opens `#/experiments/ID` in its GenAI UI in a fresh browser; the note shown
    there starts with a link to the report's view of the cell runs."""
    from analysis.collect import collect
    from analysis.provenance import mlflow_ui
    from studies.tracking.contract import RUNS_LINK_TEXT

    name, *_ = quickstart_runs
    collected = collect(mlflow_server, name)
    _, link, _ = mlflow_ui(collected)
    dom = page_dom(f"{mlflow_server}/#/experiments/{collected.experiment_id}", tmp_path / "p", height=1000)
    hrefs = {
        html.unescape(h)
        for h, text in re.findall(r'<a [^>]*href="([^"]+)"[^>]*>([^<]*)</a>', dom)
        if text == RUNS_LINK_TEXT
    }
    assert hrefs, dom[:3000]
    assert {h.split("#", 1)[1] for h in hrefs} == {link.split("#", 1)[1]}
