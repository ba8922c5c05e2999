"""The study file's `reference` block with several named sources, and published numbers printed
as written (`68.20`, `65`, `0.07`): schema, study validation, and the report's Markdown, HTML
and LaTeX tables built from runs written with the real MLflow client."""

from __future__ import annotations

import pickle
import re
import textwrap

import pytest

from analysis.published_number import PublishedNumber
from analysis.report import ReportError, build_report, load_study_info
from studies.studyfile.spec import StudyError, parse_study

try:  # tests/ is on sys.path under pytest's default (prepend) import mode
    from test_collect import BASE_CONFIG, CellRun, log_study_runs, set_path, unique_name
except ImportError:  # tests imported as a package
    from tests.test_collect import BASE_CONFIG, CellRun, log_study_runs, set_path, unique_name

STUDY = """\
name: {name}
base:
  data: {{name: synthetic, num_classes: 10}}
  model: {{name: mlp, hidden_dim: 16}}
  loss: {{name: noised_topk, k: 5, epsilon: 0.2, n_samples: 5}}
  optim: {{lr: 0.1, batch_size: 64}}
  epochs: 3
variants:
  ce: {{loss: {{name: ce}}}}
  noised: {{loss: {{name: noised_topk, k: 5, epsilon: 0.2, n_samples: 5}}}}
design:
  - kind: grid
    parameters: {{optim.lr: [0.1, 0.05]}}
seeds: [0, 1]
report:
  tables:
    - {{metrics: [test/top5, test/top1]}}
    - {{metrics: [test/top5], columns: variant, title: "Top-5 by learning rate"}}
reference:
  - label: "[Gar23]"
    source: "Thesis Table 4.4, 4 seeds"
    rows:
      - {{variant: ce, match: {{optim.lr: 0.1}}, metrics: {{test/top5: 68.20, test/top1: 65}},
         ci: {{test/top5: 0.07}}}}
      - {{variant: noised, match: {{optim.lr: 0.4}}, metrics: {{test/top5: 87.8}}}}
  - label: "[GSJS22]"
    source: "ICML 2022 Table 4, 2 seeds"
    rows:
      - {{variant: ce, match: {{optim.lr: 0.1}}, metrics: {{test/top5: 94.24}}}}
      - {{variant: noised, match: {{optim.lr: 0.05}}, metrics: {{test/top5: 92.03}}}}
"""


def _write(tmp_path, text):
    path = tmp_path / "study.yaml"
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------- the numbers


def test_published_numbers_keep_their_text_and_compare_as_floats(tmp_path):
    info = load_study_info(_write(tmp_path, STUDY.format(name="x")), None)
    gar, icml = info.reference
    row = gar.rows[0]
    assert [row.metrics["test/top5"].text, row.metrics["test/top1"].text, row.ci["test/top5"].text] == [
        "68.20",
        "65",
        "0.07",
    ]
    assert row.metrics["test/top5"] == 68.2 and row.metrics["test/top1"] == 65.0
    assert row.metrics["test/top5"] + row.ci["test/top5"] == pytest.approx(68.27)
    assert icml.rows[0].metrics["test/top5"].text == "94.24"
    # study validation reads the same texts (studies.studyfile.yaml_source)
    study = parse_study(STUDY.format(name="x"))
    assert study.reference[0].rows[0].metrics["test/top5"].text == "68.20"
    # a number keeps its text through a pickle (a Study travels to Ray workers)
    number = pickle.loads(pickle.dumps(study.reference[0].rows[0].metrics["test/top5"]))
    assert isinstance(number, PublishedNumber) and number.text == "68.20" and number == 68.2


@pytest.mark.parametrize("value, text", [(68.2, "68.2"), (65, "65"), (65.0, "65.0"), (1e-4, "0.0001")])
def test_a_number_given_without_its_text_prints_as_python_writes_it(value, text):
    assert PublishedNumber(value).text == text
    assert PublishedNumber(value, "6.5e1").text == text  # not a plain decimal: its own text


def test_one_mapping_is_one_source_labelled_paper(tmp_path):
    text = STUDY.format(name="x").split("reference:")[0] + textwrap.dedent("""\
        reference:
          source: "Thesis Table 4.4"
          rows:
            - {variant: ce, match: {optim.lr: 0.1}, metrics: {test/top5: 94.20}}
        """)
    info = load_study_info(_write(tmp_path, text), None)
    assert [(s.label, s.source) for s in info.reference] == [("paper", "Thesis Table 4.4")]
    assert info.reference[0].rows[0].metrics["test/top5"].text == "94.20"
    assert parse_study(text).reference[0].label == "paper"


@pytest.mark.parametrize(
    "block, message",
    [
        (
            "[{source: a, rows: [{metrics: {m: 1}}]}, {source: b, rows: [{metrics: {m: 2}}]}]",
            "`reference`: source 0 ('a') has no `label`",
        ),
        (
            "[{label: x, source: a, rows: [{metrics: {m: 1}}]}, {label: x, source: b, rows: [{metrics: {m: 2}}]}]",
            "`reference`: the label(s) 'x' name several sources",
        ),
        (
            '[{label: x, source: a, rows: [{metrics: {m: 1}}]}, {label: y, source: b, rows: [{metrics: {m: "9"}}]}]',
            "`reference[1].rows[0].metrics.m`: expected a number as the paper prints it (such as 94.24), got '9'",
        ),
        (
            "{source: a, rows: [{metrics: {m: true}}]}",
            "`reference.rows[0].metrics.m`: expected a number as the paper prints it",
        ),
        ("{source: a, rows: [{metrics: {m: 1}, cl: {m: 1}}]}", "`reference.rows[0].cl`: unknown field"),
        ("[{label: x, source: a, rows: [{metrics: {m: 1}, cl: {m: 1}}]}]", "`reference[0].rows[0].cl`: unknown field"),
        ("[]", "`reference`: expected at least 1 item"),
    ],
)
def test_bad_reference_blocks_are_refused_where_they_are_written(tmp_path, block, message):
    path = _write(tmp_path, f"name: x\nreference: {block}\n")
    with pytest.raises(ReportError) as error:
        load_study_info(path, None)
    assert message in str(error.value), str(error.value)


def test_study_validation_checks_every_source_at_its_line():
    text = STUDY.format(name="x").replace(
        "{variant: noised, match: {optim.lr: 0.05}, metrics: {test/top5: 92.03}}",
        "{variant: noisy, match: {optim.lr: 0.05}, metrics: {test/top5: 92.03}}",
    )
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "variant: noisy" in t)
    with pytest.raises(StudyError) as error:
        parse_study(text, "s.yaml")
    assert f"reference[1].rows[1].variant (line {line}): unknown variant 'noisy'" in str(error.value)
    # the one-mapping form names its path as written
    single = STUDY.format(name="x").split("reference:")[0] + (
        "reference:\n  source: t\n  rows:\n    - {variant: noisy, metrics: {test/top5: 1}}\n"
    )
    with pytest.raises(StudyError) as error:
        parse_study(single, "s.yaml")
    line = len(single.splitlines())
    assert f"reference.rows[0].variant (line {line}): unknown variant 'noisy'" in str(error.value)
    with pytest.raises(StudyError) as error:
        parse_study(STUDY.format(name="x").replace('label: "[GSJS22]"', 'label: "[Gar23]"'), "s.yaml")
    assert "the label(s) '[Gar23]' name several sources" in str(error.value)


# ----------------------------------------------------------------------------- the report


def _top5(variant: str, lr: float, seed: int) -> float:
    return round({"ce": 0.70, "noised": 0.72}[variant] - lr + 0.003 * seed, 6)


@pytest.fixture(scope="module")
def report(mlflow_server, tmp_path_factory):
    name = unique_name("refs")
    text = STUDY.format(name=name)
    cells = []
    for variant in ("ce", "noised"):
        loss = {"name": "ce"} if variant == "ce" else BASE_CONFIG["loss"]
        for lr in (0.1, 0.05):
            config = set_path(set_path(BASE_CONFIG, "loss", loss), "optim.lr", lr)
            for seed in (0, 1):
                top5 = _top5(variant, lr, seed)
                cells.append(
                    CellRun(
                        variant,
                        config,
                        seed,
                        {"optim.lr": lr},
                        epochs=[{"val/top5": 0.5}],
                        test={"top5": top5, "top1": top5 - 0.3},
                        best_epoch=0,
                        best_val=0.5,
                    )
                )
    log_study_runs(mlflow_server, name, cells, study_yaml=text)
    study_file = tmp_path_factory.mktemp("refs") / "study.yaml"
    study_file.write_text(text)
    out = tmp_path_factory.mktemp("report") / "report"
    html = build_report(mlflow_server, name, out, study_file=study_file).read_text(encoding="utf-8")
    return {
        "md": (out / "report.md").read_text(encoding="utf-8"),
        "html": html,
        "tex": (out / "tables.tex").read_text(encoding="utf-8"),
    }


def _md_tables(md: str) -> list[tuple[list[str], list[list[str]]]]:
    """(header, rows) of each Markdown table."""
    tables, lines = [], md.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):

            def split(t):
                return [c.strip() for c in re.split(r"(?<!\\)\|", t)[1:-1]]

            rows = []
            for body in lines[i + 2 :]:
                if not body.startswith("| "):
                    break
                rows.append(split(body))
            tables.append((split(line), rows))
    return tables


@pytest.mark.slow
def test_report_prints_a_column_per_source_with_the_numbers_as_written(report):
    md = report["md"]
    (header, rows), (vheader, vrows) = _md_tables(md)[:2]
    assert header == [
        "variant",
        "optim.lr",
        "test/top5",
        "test/top5 ([Gar23])",
        "test/top5 ([GSJS22])",
        "test/top1",
        "test/top1 ([Gar23])",
        "seeds",
    ]
    by_config = {(r[0], r[1]): dict(zip(header, r)) for r in rows}
    ce0, noised1 = by_config[("ce", "0.1")], by_config[("noised", "0.05")]
    assert ce0["test/top5 ([Gar23])"] == "68.20 ± 0.07" and ce0["test/top1 ([Gar23])"] == "65"
    assert ce0["test/top5 ([GSJS22])"] == "94.24"
    assert noised1["test/top5 ([GSJS22])"] == "92.03" and noised1["test/top5 ([Gar23])"] == ""
    # the reproduced number beside them: the mean of the two seeds, in percent
    mean = (_top5("ce", 0.1, 0) + _top5("ce", 0.1, 1)) / 2 * 100
    assert ce0["test/top5"].startswith(f"{mean:.1f} ± ")
    # the variant layout: a column per variant and source
    assert vheader == ["optim.lr", "ce", "ce ([Gar23])", "ce ([GSJS22])", "noised", "noised ([GSJS22])"]
    by_lr = {r[0]: r for r in vrows}
    assert by_lr["0.1"][2:4] == ["68.20 ± 0.07", "94.24"] and by_lr["0.05"][5] == "92.03"
    # each source named in the captions, and its unmatched row noted with its label
    assert "([Gar23]): published numbers from Thesis Table 4.4, 4 seeds." in md
    assert "([GSJS22]): published numbers from ICML 2022 Table 4, 2 seeds." in md
    assert "Reference [Gar23], row 1 (noised, match {'optim.lr': 0.4}) matches no finished config" in md
    assert "Reference [GSJS22], row" not in md


@pytest.mark.slow
def test_html_and_latex_hold_the_source_columns(report):
    html, tex = report["html"], report["tex"]
    for text in ("test/top5 ([Gar23])", "test/top5 ([GSJS22])", "68.20 ± 0.07", "94.24", "92.03"):
        assert text in html, text
    assert re.search(r"<td[^>]*>\s*65\s*</td>", html)
    assert r"test/top5 ([Gar23]) & test/top5 ([GSJS22])" in tex
    assert r"68.20 $\pm$ 0.07 & 94.24" in tex
