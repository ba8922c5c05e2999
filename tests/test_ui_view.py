"""The MLflow UI's view of a study (`studies.tracking.ui_view`, `analysis.layout.cell_runs_view`),
the run colours (`analysis.colors`), the experiment's note and the params a run logs: unit
tests without a server (tests/test_mlflow_ui.py opens the view in a real browser)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from analysis.layout import (
    MAX_UI_CHARTS,
    UI_CHART_SECTION,
    UI_VIEW_KEY,
    UI_WORKFLOW,
    cell_runs_view,
    cell_runs_view_tag,
)
from studies.cells.space import expand
from studies.studyfile.spec import load_study
from studies.tracking.ui_view import numeric_swept_paths, study_view

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "studies" / "catalog" / "quickstart.yaml"


def _two_parameter_sweep(tmp_path: Path, report: str = "") -> Path:
    text = QUICKSTART.read_text(encoding="utf-8")
    text = text.replace(
        "      loss.epsilon: [0.01, 0.1, 1.0]", "      loss.epsilon: [0.01, 0.1]\n      optim.lr: [0.05, 0.1]"
    )
    if report:
        text = text[: text.index("report:")] + report
    path = tmp_path / "two.yaml"
    path.write_text(text.replace("name: quickstart", "name: two"), encoding="utf-8")
    return path


def test_the_quickstarts_view_pins_its_sweep_and_report_metrics():
    study = load_study(QUICKSTART)
    cells = expand(study)
    view = study_view(study, cells)
    assert view["selectedColumns"][:3] == ["params.`loss.epsilon`", "metrics.`test/top1`", "metrics.`test/top5`"]
    assert view["groupBy"]["aggregateFunction"] == "average"
    charts = view["compareRunCharts"]
    assert [
        (c["type"], c.get("xaxis", {}).get("key"), c.get("yaxis", {}).get("key") or c.get("metricKey")) for c in charts
    ] == [
        ("SCATTER", "loss.epsilon", "test/top1"),
        ("SCATTER", "loss.epsilon", "test/top5"),
        ("LINE", None, "val/top5"),
    ]
    assert all(c["metricSectionId"] == UI_CHART_SECTION and c["runsCountToCompare"] >= len(cells) for c in charts)
    assert view["useGroupedValuesInCharts"] is False  # the runs' own (the report's) colours
    assert len({c["uuid"] for c in charts}) == len(charts)


def test_a_two_parameter_sweep_gets_a_chart_per_metric_and_parameter(tmp_path):
    study = load_study(_two_parameter_sweep(tmp_path))
    cells = expand(study)
    assert numeric_swept_paths(cells) == ["loss.epsilon", "optim.lr"]
    view = study_view(study, cells)
    axes = [(c["xaxis"]["key"], c["yaxis"]["key"]) for c in view["compareRunCharts"] if c["type"] == "SCATTER"]
    assert axes == [
        ("loss.epsilon", "test/top1"),
        ("optim.lr", "test/top1"),
        ("loss.epsilon", "test/top5"),
        ("optim.lr", "test/top5"),
    ]
    assert view["selectedColumns"][:2] == ["params.`loss.epsilon`", "params.`optim.lr`"]


def test_without_report_tables_the_selection_metric_and_without_a_sweep_bars(tmp_path):
    path = _two_parameter_sweep(tmp_path, report="report:\n  learning_curves: [val/top5]\n")
    text = path.read_text(encoding="utf-8")
    start = text.index("  - kind: grid")
    path.write_text(
        text[:start]
        + text[text.index("seeds:") :].replace("seeds:", "  - kind: single\n    variants: [noised_topk]\n\nseeds:", 1),
        encoding="utf-8",
    )
    study = load_study(path)
    cells = expand(study)
    assert numeric_swept_paths(cells) == []
    view = study_view(study, cells)
    assert view["selectedColumns"][0] == "metrics.`val/top5`"
    assert [(c["type"], c["metricKey"]) for c in view["compareRunCharts"]] == [
        ("BAR", "val/top5"),
        ("LINE", "val/top5"),
    ]


def test_the_view_tag_stays_inside_mlflows_limit():
    swept = [f"loss.p{i}" for i in range(12)]
    metrics = [f"test/metric_{i}" for i in range(20)]
    view = cell_runs_view(swept, metrics, "val/top5", runs=100_000)
    assert len(view["compareRunCharts"]) == MAX_UI_CHARTS
    assert view["compareRunCharts"][-1]["type"] == "LINE"
    _, value = cell_runs_view_tag(view)
    assert len(value) < 20_000 and json.loads(json.loads(value)["state"]) == view


def test_the_view_is_a_saved_view_of_the_runs_pages_views_menu():
    """MLflow 3.17's saved-view envelope: a name and a time as plain JSON, the state as text."""
    from analysis.layout import UI_VIEW_NAME

    key, value = cell_runs_view_tag(cell_runs_view(["loss.epsilon"], ["test/top1"]), created_ms=5)
    envelope = json.loads(value)
    assert key == f"mlflow.sharedViewState.{UI_VIEW_KEY}"
    assert (envelope["name"], envelope["createdAt"]) == (UI_VIEW_NAME, 5)
    assert json.loads(envelope["state"]) == cell_runs_view(["loss.epsilon"], ["test/top1"])


def test_run_colours_are_the_reports_one_per_config():
    """A config's colour is its variant's, shaded for its variant's 2nd, 3rd... config, as
    matplotlib shades it in the report's figures; the quickstart's 5 configs all differ."""
    from matplotlib.colors import to_hex, to_rgb

    from analysis.colors import PALETTE, SHADES, shade
    from studies.cells.run_names import RunNamer
    from studies.tracking.ui_view import run_colors

    for color in PALETTE:
        for index, amount in enumerate(SHADES):
            target = 1.0 if amount > 0 else 0.0
            expected = to_hex(tuple(c + abs(amount) * (target - c) for c in to_rgb(color)))
            assert shade(color, index) == expected
    study = load_study(QUICKSTART)
    namer = RunNamer()
    namer.add(expand(study))
    colors = run_colors(namer.configs, list(study.variants))
    assert len(colors) == 5 and len(set(colors.values())) == 5
    by_variant = {v: [colors[c] for c in ids] for v, ids in namer.configs.items()}
    assert by_variant["ce"] == [PALETTE[0]]
    assert by_variant["noised_topk"] == [PALETTE[1], shade(PALETTE[1], 1), shade(PALETTE[1], 2)]
    assert by_variant["smooth_topk_svm"] == [PALETTE[2]]


def test_a_later_versions_configs_get_colours_apart_from_the_earlier_versions():
    """Two versions kept in one study (--new-version): the later version's configs (ids
    qualified with -v<version>) take the shades after the earlier's, so no two groups of the
    MLflow view share a colour; the earlier version's colours stay as they were."""
    from types import SimpleNamespace

    from analysis.layout import TAG_CONFIG_ID, TAG_VARIANT, TAG_VERSION
    from studies.cells.run_names import RunNamer
    from studies.tracking.ui_view import other_version_configs, run_colors

    study = load_study(QUICKSTART)
    cells = expand(study)
    old, new = "a" * 12, "b" * 12
    namer_old, namer_new = RunNamer(), RunNamer()
    namer_old.add(cells)
    namer_new.add([dataclasses.replace(c, config_id=f"{c.config_id}-vbbbbbbb") for c in cells])
    variants = list(study.variants)
    before = run_colors(namer_old.configs, variants)

    def runs(configs, version, start):
        return [
            SimpleNamespace(tags={TAG_CONFIG_ID: c, TAG_VARIANT: v, TAG_VERSION: version}, start_time=start + i)
            for i, (v, c) in enumerate((v, c) for v, ids in configs.items() for c in ids)
        ]

    recorded = runs(namer_old.configs, old, 0) + runs(namer_new.configs, new, 100)
    later = run_colors(namer_new.configs, variants, other_version_configs(recorded, new))
    mine = [later[c] for ids in namer_new.configs.values() for c in ids]
    assert len(set(mine)) == 5 and not set(mine) & set(before.values())
    assert run_colors(namer_old.configs, variants, other_version_configs(recorded, old)) == before
    assert other_version_configs(recorded, "") == {}


def test_the_experiments_note_starts_with_the_link_to_the_cell_runs():
    from studies.tracking.contract import NOTE_TAG, RUNS_LINK_TEXT, experiment_tags

    tags = experiment_tags("my study", None, "7")
    first, rest = tags[NOTE_TAG].split("\n\n", 1)
    assert first == (f"[{RUNS_LINK_TEXT}](#/experiments/7/runs?{UI_WORKFLOW}&viewStateShareKey={UI_VIEW_KEY})")
    assert rest == "my study"
    assert experiment_tags("my study")[NOTE_TAG] == "my study"  # no id yet: no link


@pytest.mark.parametrize("eval_section, logged", [({"avgk": []}, False), ({"avgk": [5]}, True)])
def test_a_run_logs_only_the_params_that_apply(eval_section, logged):
    """The quickstart's runs logged eval.avgk_activation with eval.avgk empty."""
    from studies.tracking.contract import config_params

    study = load_study(QUICKSTART)
    config = json.loads(json.dumps(expand(study)[0].config))
    config["eval"].update(eval_section)
    params = config_params(config)
    assert ("eval.avgk_activation" in params) is logged
    assert "amp" not in params and "model.depth" not in params  # an MLP on the CPU
    assert "optim.gamma" in params  # milestones [10]: the decay applies
    config["optim"]["milestones"] = []
    assert "optim.gamma" not in config_params(config)
