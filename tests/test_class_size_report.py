"""Accuracy by number of training images in the report ([Gar23] Table 3.1): the per-class
means over seeds (checked by hand), the bin and per-class figures (fixed size whatever the
number of configs), and a report from runs written with the real MLflow client, whose bin
table and figure show the published numbers.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from PIL import Image

from analysis import plot_style, plots
from analysis.stats import per_class_means, summarize

try:  # tests/ is on sys.path under pytest's default (prepend) import mode
    from test_collect import BASE_CONFIG, CellRun, log_study_runs, set_path, unique_name
except ImportError:  # tests imported as a package
    from tests.test_collect import BASE_CONFIG, CellRun, log_study_runs, set_path, unique_name

BINS = ["count_0_10", "count_10_50", "count_50_inf"]


def test_per_class_means_average_each_class_over_the_seeds_that_saw_it():
    rows = [
        # run a (config c1): class 0 has no test image (NaN)
        {"run_id": "a", "class": 1, "train_count": 40, "top1": 0.5},
        {"run_id": "a", "class": 0, "train_count": 3, "top1": math.nan},
        # run b (config c1)
        {"run_id": "b", "class": 0, "train_count": 3, "top1": 1.0},
        {"run_id": "b", "class": 1, "train_count": 40, "top1": 0.25},
        # run c (config c2), and a run of no config drawn
        {"run_id": "c", "class": 0, "train_count": 3, "top1": 0.0},
        {"run_id": "c", "class": 1, "train_count": 40, "top1": math.nan},
        {"run_id": "z", "class": 0, "train_count": 3, "top1": 0.9},
    ]
    means = per_class_means(rows, {"a": "c1", "b": "c1", "c": "c2"}, "top1")
    assert set(means) == {"c1", "c2"}
    assert means["c1"]["train_count"] == [3, 40] and means["c1"]["n"] == 2
    assert means["c1"]["mean"] == pytest.approx([1.0, 0.375])
    assert means["c2"]["mean"][0] == 0.0 and math.isnan(means["c2"]["mean"][1])
    assert per_class_means(rows, {"a": "c1"}, "top5") == {}


def _bin_summary(n_configs: int) -> list[dict]:
    rows = []
    for c in range(n_configs):
        for seed in range(3):
            row = {
                "run_id": f"r{c}-{seed}",
                "config_id": f"c{c}",
                "variant": "ce",
                "seed": seed,
                "swept": f'{{"model.name": "m{c}"}}',
                "param:model.name": f"m{c}",
            }
            for i, name in enumerate(BINS):
                row[f"test/{name}/top1"] = 0.1 + 0.3 * i + 0.002 * c + 0.002 * seed  # accuracies in [0, 1]
            rows.append(row)
    return rows


def test_bin_figure_has_a_fixed_size_and_marks_the_published_numbers(tmp_path):
    metrics = [f"test/{b}/top1" for b in BINS]
    labels = [("0\u201310", metrics[0]), ("10\u201350", metrics[1]), ("> 50", metrics[2])]
    sizes = []
    for n_configs in (2, 40):
        summary = summarize(_bin_summary(n_configs), metrics)
        notes: list[str] = []
        png, svg = plots.count_bin_accuracy(
            summary,
            labels,
            tmp_path / f"bins{n_configs}",
            published={"c1": {metrics[0]: 9.0, metrics[2]: 93.0}},
            source="Table 3.1",
            order=[f"c{c}" for c in range(n_configs)],
            notes=notes,
        )
        sizes.append(Image.open(png).size)
        text = svg.read_text()
        assert "published: Table 3.1" in text and "&gt; 50" in text and "n=3 seeds" in text
        assert any("not drawn" in n for n in notes) == (n_configs > plots.MAX_LINES), notes
        assert plot_style.STRIP_NOTE in notes  # 3 seeds a mean: their values beside it
    assert sizes[0] == sizes[1]
    with pytest.raises(ValueError, match="no bin metric"):
        plots.count_bin_accuracy(summarize(_bin_summary(1), metrics), [("x", "test/count_0_5/top1")], tmp_path / "none")


def test_per_class_figure_bounds_panels_and_points(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "MAX_CLASS_POINTS", 300)  # 2,000 classes per config: thinned
    rng = np.random.default_rng(0)
    counts = [int(c) for c in rng.pareto(1.0, 2000) * 3 + 1]
    panels = [
        (f"config {i}", {"train_count": counts, "n": 3, "mean": [min(1.0, math.log10(c + 1) / 3) for c in counts]})
        for i in range(6)
    ]
    notes: list[str] = []
    png, svg = plots.per_class_accuracy(panels, "top1", tmp_path / "per_class", edges=[10, 50, 500, 2000], notes=notes)
    small, _ = plots.per_class_accuracy(panels[:1], "top1", tmp_path / "one")
    assert Image.open(png).size == Image.open(small).size
    assert any("not drawn" in n for n in notes) and any(str(plots.MAX_CLASS_POINTS) in n for n in notes)
    # at most MAX_CLASS_POINTS dots in each of the CLASS_PANELS panels (plus the markers of
    # the bin means and the ticks), far fewer than the 4 x 2,000 classes of the panels drawn
    assert svg.read_text().count("<use ") <= plots.CLASS_PANELS * plots.MAX_CLASS_POINTS + 1000
    empty = [("x", {"train_count": [1, 2], "mean": [math.nan, math.nan], "n": 1})]
    with pytest.raises(ValueError, match="no run stored"):
        plots.per_class_accuracy(empty, "top1", tmp_path / "none")


STUDY = """\
name: {name}
base:
  data: {{name: synthetic, num_classes: 4}}
  model: {{name: mlp, hidden_dim: 16}}
  loss: {{name: ce}}
  eval: {{ks: [1], count_bins: [10, 50], selection: val/top1}}
  epochs: 1
variants: {{ce: {{}}}}
design:
  - kind: grid
    parameters: {{model.hidden_dim: [16, 32]}}
seeds: [0, 1]
report:
  tables:
    - metrics: [test/count_0_10/top1, test/count_10_50/top1, test/count_50_inf/top1]
      title: "Accuracy by number of training images"
  count_bins: [top1]
  per_class: [top1, top5]
reference:
  source: "Thesis Table 3.1"
  rows:
    - {{variant: ce, match: {{model.hidden_dim: 16}},
       metrics: {{test/count_0_10/top1: 9, test/count_10_50/top1: 35, test/count_50_inf/top1: 93}}}}
"""

# per class: training images, test hits of each seed (2 test images per class)
CLASSES = {0: (4, [1, 0]), 1: (30, [1, 2]), 2: (49, [2, 2]), 3: (400, [2, 1])}


@pytest.mark.slow
def test_report_shows_the_bins_with_the_published_numbers_and_the_per_class_figure(mlflow_server, tmp_path):
    from analysis.report import build_report

    name = unique_name("classsize")
    text = STUDY.format(name=name)
    cells = []
    for width in (16, 32):
        config = set_path(set_path(BASE_CONFIG, "loss", {"name": "ce"}), "model.hidden_dim", width)
        for seed in (0, 1):
            rates = {c: hits[seed] / 2 for c, (_, hits) in CLASSES.items()}
            # the bin metrics as setvalued.metrics computes them: mean per-class accuracy
            test = {
                "top1": sum(rates.values()) / 4,
                "count_0_10/top1": rates[0],
                "count_10_50/top1": (rates[1] + rates[2]) / 2,
                "count_50_inf/top1": rates[3],
            }
            per_class = {
                "class": list(CLASSES),
                "train_count": [n for n, _ in CLASSES.values()],
                "test_count": [2] * 4,
                "top1": [rates[c] for c in CLASSES],
            }
            cells.append(
                CellRun(
                    "ce",
                    config,
                    seed,
                    {"model.hidden_dim": width},
                    test=test,
                    best_epoch=0,
                    best_val=0.5 + 0.01 * width,
                    per_class=per_class,
                )
            )
    log_study_runs(mlflow_server, name, cells, study_yaml=text)
    study_file = tmp_path / f"{name}.yaml"
    study_file.write_text(text)
    out = tmp_path / "report"
    html = build_report(mlflow_server, name, out, study_file=study_file)
    md = html.with_suffix(".md").read_text()
    # the table: the reproduced mean over the two seeds beside the published number
    header = next(line for line in md.splitlines() if "count_0_10/top1 (paper)" in line)
    row = next(line for line in md.splitlines() if line.startswith("| ce") and "| 16 " in line)
    cells_of = [c.strip() for c in row.strip("|").split("|")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert cells_of[columns.index("test/count_10_50/top1 (paper)")] == "35"  # as written
    assert cells_of[columns.index("test/count_50_inf/top1 (paper)")] == "93"
    # count_10_50 of seed 0: (0.5 + 1.0) / 2, seed 1: (1.0 + 1.0) / 2 -> mean 87.5 %
    # (two seeds 75 % and 100 %: the t interval is cut at 0 and 100 %)
    assert cells_of[columns.index("test/count_10_50/top1")].strip("*").startswith("87.5 ")
    figures = out / "figures"
    svg = (figures / "count_bins_top1.svg").read_text()
    assert "published: Thesis Table 3.1" in svg and "10\u201350" in svg and "&gt; 50" in svg
    assert (figures / "per_class_top1.png").is_file()
    assert "Per-class test top1 against training images" in md
    # a metric the artifacts do not hold leaves a line in the report, not a failure
    assert re.search(r"Not drawn: per-class top5: .*no top5 column", md)
    assert "Figure failed" not in md
