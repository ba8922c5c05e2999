"""docs/notebook.md's walk-through runs as written, against a real local study: the
quickstart's smoke run (2 epochs, local Ray, the local SQLite store), made once for the
module through `studies.api`. Two lines of the page are swapped for the test's: the output
folder (a temporary one) and the run (the module's smoke run, instead of the full quickstart);
every other line runs verbatim, and what the page says about the DataFrames is checked."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from studies import api

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "notebook.md"
QUICKSTART = REPO / "studies" / "catalog" / "quickstart.yaml"
SET_OUTPUT = 'api.set_output("studies_out")'
RUN = 'outcome = api.run("studies/catalog/quickstart.yaml")'


def walk_through() -> list[str]:
    """The Python blocks of the page's notebook section, in order."""
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("## In a notebook") : text.index("## The report")]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.fixture(scope="module")
def smoke_study(tmp_path_factory):
    output = tmp_path_factory.mktemp("notebook") / "studies_out"
    outcome = api.run(
        QUICKSTART, smoke=True, smoke_epochs=2, output=output, report=False, num_cpus=2, stream=io.StringIO()
    )
    assert outcome.exit_code == 0 and not outcome.failed
    return output, outcome


def test_the_walk_through_swaps_only_its_output_folder_and_run():
    blocks = walk_through()
    assert len(blocks) >= 4
    code = "\n".join(blocks)
    assert code.count(SET_OUTPUT) == 1 and code.count(RUN) == 1


@pytest.mark.slow
def test_the_notebook_walk_through_runs_against_a_real_study(smoke_study, monkeypatch):
    output, outcome = smoke_study
    monkeypatch.chdir(REPO)  # the page's paths are relative to a checkout
    monkeypatch.setattr(api, "_output", None)
    namespace: dict = {"__name__": "notebook"}
    printed = io.StringIO()
    monkeypatch.setattr("sys.stdout", printed)
    for block in walk_through():
        code = block.replace(SET_OUTPUT, f"api.set_output({str(output)!r})")
        code = code.replace(RUN, "outcome = __smoke_outcome__")
        namespace["__smoke_outcome__"] = outcome
        exec(compile(code, str(PAGE), "exec"), namespace)
    monkeypatch.undo()

    # what the page says of the DataFrames
    cells, curves = namespace["cells"], namespace["curves"]
    expected = api.cells(api.load(QUICKSTART), smoke=True, smoke_epochs=2)
    assert sorted(cells["cell"]) == sorted(c.cell_id for c in expected)
    assert cells.attrs["units"] == {"test/top1": "%", "test/top5": "%"}
    raw = {r["cell_id"]: r["test/top5"] for r in api.collect(outcome.study_name, output=output).table.to_pylist()}
    for cell, value in zip(cells["cell"], cells["test/top5"]):
        assert value == pytest.approx(100 * raw[cell])  # percent, as the report shows it
    swept = {c.cell_id: c.swept.get("loss.epsilon") for c in expected}
    for cell, epsilon in zip(cells["cell"], cells["loss.epsilon"]):
        assert (epsilon != epsilon and swept[cell] is None) or epsilon == swept[cell]
    assert list(curves.columns) == [
        "cell",
        "config",
        "label",
        "variant",
        "seed",
        "loss.epsilon",
        "epoch",
        "metric",
        "value",
        "unit",
    ]
    assert set(curves["metric"]) == {"val/top5", "train/loss"}
    assert sorted(set(curves["epoch"])) == [0, 1]
    assert len(curves) == 2 * 2 * len(expected)
    assert (curves.loc[curves["metric"] == "train/loss", "unit"] == "").all()
    assert (curves.loc[curves["metric"] == "val/top5", "unit"] == "%").all()
    figure = namespace["figure_path"]
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.is_relative_to(output)
    assert "report.html" in printed.getvalue()


def test_the_output_folder_is_set_once(monkeypatch, tmp_path):
    """The argument, else `set_output`'s folder, else $STUDIES_OUTPUT, else ./studies_out;
    the command line's --output default reads the same variable."""
    from studies.cli import build_parser

    monkeypatch.setattr(api, "_output", None)
    monkeypatch.delenv(api.OUTPUT_ENV, raising=False)
    assert api.output_folder() == Path("studies_out")
    monkeypatch.setenv(api.OUTPUT_ENV, str(tmp_path / "env"))
    assert api.output_folder() == tmp_path / "env"
    assert build_parser().parse_args(["report", "x"]).output == str(tmp_path / "env")
    api.set_output(tmp_path / "set")
    assert api.output_folder() == tmp_path / "set"
    assert api.output_folder(tmp_path / "arg") == tmp_path / "arg"
    with pytest.raises(FileNotFoundError, match="no study named 'nothing'"):
        api.collect("nothing")  # looked for under the folder set
    assert not (tmp_path / "set").exists()  # and nothing created


def test_help_of_the_package_names_the_api():
    import pydoc

    import studies

    text = pydoc.render_doc(studies, renderer=pydoc.plaintext)
    for word in ("studies.api", "table", "histories", "set_output", "STUDIES_OUTPUT", "docs/notebook.md"):
        assert word in text
