"""The report at scale (issue 15), not timed: the benchmark's synthesizer writes what the
runner writes, every figure keeps its size whatever the number of configs, and a figure that
fails costs that figure only.

Studies are written by `benchmarks/report_scale.py` into SQLite stores in a temporary
folder (the embedded default store); the runner's side is `studies.tracking` itself.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

import benchmarks.report_scale as report_scale
from analysis import plot_curves, plots
from analysis.collect import collect
from analysis.report import build_report


def _nan_safe(values):
    return ["NaN" if isinstance(v, float) and math.isnan(v) else v for v in values]


def _without_creation_time(value: str) -> str:
    """A saved view's envelope (`analysis.layout.cell_runs_view_tag`) without its `createdAt`,
    the time it was written; any other tag value as it is."""
    try:
        envelope = json.loads(value)
    except ValueError:
        return value
    if isinstance(envelope, dict) and "createdAt" in envelope:
        return json.dumps({k: v for k, v in envelope.items() if k != "createdAt"}, sort_keys=True)
    return value


def _layout(uri: str, name: str) -> dict:
    """Everything a study's runs hold, keyed by cell, without ids, times and sessions."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(name)
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    volatile = {"mlflow.parentRunId", "studies.session", "studies.node_id"}
    out = {
        "experiment_tags": {k: _without_creation_time(v) for k, v in experiment.tags.items()},
        "artifact_location": Path(experiment.artifact_location).name,
    }
    for run in runs:
        tags = run.data.tags
        key = tags.get("studies.cell_id", "parent")
        histories = {
            k: [
                (m.step, m.value)
                for m in sorted(client.get_metric_history(run.info.run_id, k), key=lambda m: (m.step, m.timestamp))
            ]
            for k in run.data.metrics
        }
        out[key] = {
            "tags": {k: v for k, v in tags.items() if k not in volatile},
            "tag_keys": sorted(tags),
            "params": dict(run.data.params),
            "histories": histories,
            "status": run.info.status,
            "artifact_uri_tail": run.info.artifact_uri.split("/")[-1],
            "artifacts": sorted(a.path for a in client.list_artifacts(run.info.run_id)),
        }
    return out


def test_synthesized_study_reads_back_like_one_written_by_the_runner(tmp_path):
    """The synthesizer's bulk rows against `studies.tracking` (StudyTracking, CellRun: the
    runner's own writes) logging the same values: same tags, params, metric histories
    (keys, steps, values), statuses, artifacts, and the same collected tables."""
    import yaml

    from analysis.layout import PER_CLASS_ARTIFACT, SET_SIZES_ARTIFACT, TAG_NODE_ID
    from studies.tracking import CellRun, StudyTracking, new_session_id, study_description

    name = "layout"
    synth_dir, runner_dir = tmp_path / "synth", tmp_path / "runner"
    synth_uri = f"sqlite:///{synth_dir / 'mlflow.db'}"
    runner_uri = f"sqlite:///{runner_dir / 'mlflow.db'}"
    info = report_scale.synthesize(synth_uri, synth_dir, name, 4, seeds=1, epochs=3, failed=1)
    assert (info["cells"], info["finished"], info["failed"]) == (4, 3, 1)

    # the runner's writes, with the values the synthesizer stored
    from mlflow import MlflowClient

    source = MlflowClient(tracking_uri=synth_uri)
    experiment = source.get_experiment_by_name(name)
    synthesized = {
        r.data.tags["studies.cell_id"]: r
        for r in source.search_runs([experiment.experiment_id], "tags.`studies.role` = 'cell'")
    }
    runner_dir.mkdir()
    (runner_dir / "study.yaml").write_text(Path(info["study_file"]).read_text())
    text = Path(info["study_file"]).read_text()
    tracking = StudyTracking(
        runner_uri,
        name,
        artifact_root=runner_dir / "mlartifacts",
        description=study_description(str(yaml.safe_load(text).get("description", "")), text),
    )
    tracking.parent_run_id(runner_dir / "study.yaml")
    context = tracking.context(new_session_id())
    for cell in report_scale.expand_cells(Path(info["study_file"]).read_text()):
        original = synthesized[cell.cell_id]
        run_id = original.info.run_id
        run, _ = CellRun.open(
            context,
            {
                "config_id": cell.config_id,
                "seed": cell.seed,
                "cell_id": cell.cell_id,
                "variant": cell.variant,
                "swept": cell.swept,
                "config": cell.config,
            },
        )
        run.set_tags({TAG_NODE_ID: "node"})
        per_epoch: dict[int, dict] = {}
        for key in original.data.metrics:
            if key.startswith("test/") or key in ("best_epoch", "best_val"):
                continue
            for m in source.get_metric_history(run_id, key):
                per_epoch.setdefault(m.step, {})[key] = m.value
        for epoch in sorted(per_epoch):
            run.log_metrics(per_epoch[epoch], step=epoch)
        if original.data.tags["studies.status"] == "failed":
            run.fail(original.data.tags["studies.error"])
            continue
        tables = {}
        for artifact in (PER_CLASS_ARTIFACT, SET_SIZES_ARTIFACT):
            local = source.download_artifacts(run_id, artifact, str(tmp_path))
            tables[artifact] = pq.read_table(local).to_pydict()
        metrics = original.data.metrics
        run.finish(
            {
                "test": {k[5:]: v for k, v in metrics.items() if k.startswith("test/")},
                "best_epoch": int(metrics["best_epoch"]),
                "best_val": metrics["best_val"],
                "per_class": tables[PER_CLASS_ARTIFACT],
                "set_sizes": tables[SET_SIZES_ARTIFACT],
            },
            final_step=max(per_epoch),
        )
    tracking.close_parent(all_done=False)

    synth, runner = _layout(synth_uri, name), _layout(runner_uri, name)
    assert synth.keys() == runner.keys() and len(synth) == 2 + 1 + 4
    for key in synth:
        if isinstance(synth[key], dict) and "histories" in synth[key]:
            a, b = synth[key], runner[key]
            assert a["tags"] == b["tags"] and a["tag_keys"] == b["tag_keys"], key
            assert a["params"] == b["params"], key
            assert {k: _nan_safe(v) for k, v in a["histories"].items()} == {
                k: _nan_safe(v) for k, v in b["histories"].items()
            }, key
            assert (a["status"], a["artifact_uri_tail"], a["artifacts"]) == (
                b["status"],
                b["artifact_uri_tail"],
                b["artifacts"],
            ), key
        else:
            assert synth[key] == runner[key], key

    # and what the report reads is the same
    mine, theirs = collect(synth_uri, name), collect(runner_uri, name)
    drop = ["run_id", "start_time", "end_time", "duration_s"]
    a, b = mine.table.drop_columns(drop), theirs.table.drop_columns(drop)
    assert a.schema == b.schema
    for column in a.column_names:
        assert _nan_safe(a.column(column).to_pylist()) == _nan_safe(b.column(column).to_pylist())
    assert mine.failed.drop_columns(["run_id", "start_time"]).equals(
        theirs.failed.drop_columns(["run_id", "start_time"])
    )
    assert mine.study_yaml == theirs.study_yaml


def _report(tmp_path: Path, name: str, cells: int, seeds: int) -> tuple[Path, dict]:
    study_dir = tmp_path / name
    uri = f"sqlite:///{study_dir / 'mlflow.db'}"
    info = report_scale.synthesize(uri, study_dir, name, cells, seeds=seeds, epochs=3)
    html = build_report(uri, name, study_dir / "report", study_file=info["study_file"])
    return html, info


@pytest.fixture(scope="module")
def small_and_large(tmp_path_factory):
    """The same design at 16 configs and at 300 configs (2 seeds each)."""
    tmp = tmp_path_factory.mktemp("scale")
    small, small_info = _report(tmp, "small", 32, 2)
    large, large_info = _report(tmp, "large", 600, 2)
    assert (small_info["configs"], large_info["configs"]) == (16, 300)
    return small, large


@pytest.mark.slow
def test_every_figure_of_a_large_study_is_drawn_at_the_size_of_a_small_one(small_and_large):
    small, large = small_and_large
    sizes = {}
    for html in (small, large):
        md = html.with_suffix(".md").read_text()
        assert "Not drawn" not in md and "Figure failed" not in md, md
        figures = sorted((html.parent / "figures").glob("*.png"))
        # curves are numbered in the order their x first appears: compare them by x
        sizes[html] = {re.sub(r"^curve_[0-9]+_", "curve_", png.name): Image.open(png).size for png in figures}
    assert sizes[small].keys() == sizes[large].keys()
    names = set(sizes[large])
    assert {
        "heatmap_test_top5.png",
        "learning_val_top5.png",
        "shot_groups_top5.png",
        "set_sizes_avg5.png",
    } <= names and sum(n.startswith("curve_") for n in names) == 5
    assert sizes[small] == sizes[large]  # pixel for pixel, whatever the number of configs
    allowed = {
        tuple(round(v * plots.DPI) for v in size) for size in (plots.FIGSIZE, plots.WIDE_FIGSIZE, plots.PANEL_FIGSIZE)
    }
    assert set(sizes[large].values()) <= allowed
    md = large.with_suffix(".md").read_text()
    # what was left out is said: small multiples with a band, the best configs of each variant
    assert "one panel per variant" in md and "of 300 configs, the best of each variant" in md
    (svg_file,) = (large.parent / "figures").glob("curve_*_test_top5_vs_optim_lr.svg")
    svg = svg_file.read_text()
    assert "range of" in svg and "best of" in svg


@pytest.mark.slow
def test_a_failing_figure_leaves_a_line_and_the_rest_of_the_report(small_and_large, tmp_path, monkeypatch):
    small, _ = small_and_large
    study_dir = small.parent.parent
    uri = f"sqlite:///{study_dir / 'mlflow.db'}"

    def out_of_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 2.1 GiB for the Agg canvas")

    def broken_store(*args, **kwargs):
        raise RuntimeError("history store unreachable")

    monkeypatch.setattr(plots, "shot_group_bars", out_of_memory)
    monkeypatch.setattr("analysis.figures.collect_histories", broken_store)
    html = build_report(uri, "small", tmp_path / "report", study_file=study_dir / "study.yaml")
    md = html.with_suffix(".md").read_text()
    assert ("Figure failed: shot-group bars of top5: MemoryError: Unable to allocate 2.1 GiB for the Agg canvas") in md
    assert "Figure failed: learning curves: RuntimeError: history store unreachable" in md
    figures = sorted(p.name for p in (tmp_path / "report" / "figures").glob("*.png"))
    assert "shot_groups_top5.png" not in figures and "learning_val_top5.png" not in figures
    assert "heatmap_test_top5.png" in figures and len(figures) == 7  # 5 curves, heat map, sets
    assert "## Paired comparisons" in md and "## Provenance" in md
    assert "Figure failed" in html.read_text()


def test_reference_line_labels_never_overlap(tmp_path):
    """Five single-config variants within a few tenths of a percent: their labels are
    pushed apart at the right of the axes (and stay inside the figure)."""
    from analysis.stats import summarize

    rows = []
    for i, variant in enumerate(["a", "b", "c", "d", "e", "swept"]):
        for seed in range(2):
            for eps in (0.1, 0.2, 0.5) if variant == "swept" else (None,):
                swept = {"loss.epsilon": eps} if eps is not None else {}
                rows.append(
                    {
                        "config_id": f"{variant}{eps}",
                        "seed": seed,
                        "variant": variant,
                        "swept": json.dumps(swept),
                        "param:loss.epsilon": eps or 0.3,
                        "test/top5": 0.90 + 0.001 * i + 0.0005 * seed + (eps or 0) / 10,
                    }
                )
    from analysis.stats import curve_series

    series = curve_series(summarize(rows, ["test/top5"]), "loss.epsilon", "test/top5")
    assert sum(s.flat for s in series) == 5  # plot_series draws MAX_REFERENCES = 4 of them
    fig_holder = {}
    original = plot_curves.save_figure

    def keep(fig, out_base):
        fig_holder["fig"] = fig
        return original(fig, out_base)

    plot_curves.save_figure, saved = keep, plot_curves.save_figure
    try:
        notes: list[str] = []
        plots.plot_series(series, "loss.epsilon", "test/top5", tmp_path / "refs", notes=notes)
    finally:
        plot_curves.save_figure = saved
    assert any("single-config variant" in n for n in notes)
    fig = fig_holder["fig"]
    renderer = fig.canvas.get_renderer()
    labels = [t for ax in fig.axes for t in ax.texts if "one config" in t.get_text()]
    assert len(labels) == 4
    boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.y0)
    for below, above in zip(boxes, boxes[1:]):
        assert above.y0 >= below.y1 - 0.5  # stacked, not overlapping
    width, height = fig.get_size_inches() * fig.dpi
    assert all(0 <= b.x0 and b.x1 <= width and 0 <= b.y0 and b.y1 <= height for b in boxes)


@pytest.mark.slow
def test_large_report_intervals_latex_and_mlflow_command(small_and_large, tmp_path):
    """Accuracies near 0 and 100 % over 2 seeds: every interval printed stays within
    [0, 100] and the caption says which were cut; tables.tex holds the 300-row table (a
    longtable) and compiles; the report says how to open the local store's MLflow UI."""
    import shutil
    import subprocess
    import urllib.parse

    _, large = small_and_large
    md = large.with_suffix(".md").read_text()
    table = md.split("### Final test metrics (default table)", 1)[1].split("\n\n*", 1)[0]
    pm = [(float(m), float(h)) for m, h in re.findall(r"(-?[0-9.]+) ± ([0-9.]+)", table)]
    bounds = [(float(a), float(b)) for a, b in re.findall(r"\[(-?[0-9.]+), (-?[0-9.]+)\]", table)]
    assert len(pm) > 1000 and bounds  # some intervals were cut at 100 %
    assert all(m - h >= -0.05 and m + h <= 100.05 for m, h in pm)
    assert all(0.0 <= a <= b <= 100.0 for a, b in bounds)
    assert f"{len(bounds)} entries cut at a bound are shown by their bounds [low, high]" in md
    assert "same coverage" in md

    tex = (large.parent / "tables.tex").read_text()
    assert r"\begin{longtable}" in tex and r"\usepackage{longtable}" in tex
    assert tex.count(r"\\") > 300 and r"\toprule" in tex and r"\bottomrule" in tex
    if shutil.which("pdflatex"):
        (tmp_path / "paper.tex").write_text(
            "\\documentclass{article}\n\\usepackage{booktabs}\n\\usepackage{longtable}\n"
            "\\usepackage[margin=1cm,landscape]{geometry}\n\\begin{document}\n"
            f"\\input{{{large.parent / 'tables.tex'}}}\n\\end{{document}}\n"
        )
        done = subprocess.run(
            ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "paper.tex"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout[-3000:]

    store = large.parent.parent / "mlflow.db"
    assert f"mlflow ui --backend-store-uri sqlite:///{store}" in md
    (link,) = re.findall(r"<(http://127\.0\.0\.1:5000/[^>]+)>", md)
    route, query = urllib.parse.urlsplit(link).fragment.split("?", 1)
    assert route == "/experiments/1/runs"
    # the experiment holds the UI's view of the cell runs (studies.tracking.experiment_tags)
    assert urllib.parse.parse_qs(query) == {
        "workflowType": ["machine_learning"],
        "viewStateShareKey": ["studies-cells"],
    }
