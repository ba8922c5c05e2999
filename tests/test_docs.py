"""The README and the docs it links say what the code does: every page linked exists, every
`studies ...` command in a code block names a real subcommand and real catalogue files, and
the numbers the pages state are the code's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
#: the pages the README's text moved to (issue 27), and the cluster's own
PAGES = [
    "docs/commands.md",
    "docs/study-file.md",
    "docs/scheduling.md",
    "docs/guarantees.md",
    "docs/notebook.md",
    "docs/performance.md",
    "cluster/README.md",
    "CONTRIBUTING.md",
    "CHANGELOG.md",
]
DOCS = [
    README,
    REPO / "CONTRIBUTING.md",
    REPO / "CHANGELOG.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "cluster" / "README.md",
    REPO / "studies" / "catalog" / "README.md",
]


def _links(text: str) -> list[str]:
    return [m for m in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in m]


def _code_lines(text: str) -> list[str]:
    lines, inside = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line)
    return lines


def test_the_readme_is_one_page():
    assert len(README.read_bytes()) <= 10 * 1024


def test_the_readme_keeps_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert 'pip install -e ".[test]" && studies run studies/catalog/quickstart.yaml' in text
    assert 'pip install -e ".[test]" && pytest' in text


def test_every_page_the_readme_links_exists():
    links = _links(README.read_text(encoding="utf-8"))
    for page in PAGES:
        assert page in links, f"the README does not link {page}"
    missing = [link for link in links if not (REPO / link).exists()]
    assert not missing, missing


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_the_links_of_a_page_exist(doc):
    missing = [
        link
        for link in _links(doc.read_text(encoding="utf-8"))
        if not (doc.parent / link).exists() and not (REPO / link).exists()
    ]
    assert not missing, missing


def _subcommands() -> set[str]:
    from studies.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return set(action.choices)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_the_commands_a_page_states_are_real(doc):
    commands = _subcommands()
    stated, files = [], []
    for line in _code_lines(doc.read_text(encoding="utf-8")):
        line = line.split("#", 1)[0]
        stated += re.findall(r"(?:^|[|&;]\s*|\$\s+)studies\s+([a-z][\w-]*)", line.strip())
        if re.search(r"(?:^|[|&;]\s*|\$\s+)studies\s", line.strip()):
            files += re.findall(r"studies/catalog/[\w.-]+\.yaml", line)
    unknown = sorted(set(stated) - commands)
    assert not unknown, f"not subcommands of `studies`: {unknown}"
    absent = sorted(f for f in set(files) if not (REPO / f).is_file())
    assert not absent, f"not catalogue files: {absent}"


def test_the_readme_states_commands():
    """The check above has something to check: the README's commands are found."""
    stated = re.findall(
        r"(?:^|[|&;]\s*)studies\s+([a-z][\w-]*)",
        "\n".join(line.strip() for line in _code_lines(README.read_text(encoding="utf-8"))),
        re.MULTILINE,
    )
    assert {"run", "resume", "report", "export", "plan", "submit", "jobs", "landscape"} <= set(stated)


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def test_the_study_file_bounds_are_the_codes():
    from studies.studyfile.expressions import MAX_INT_BITS
    from studies.studyfile.study import DEFAULT_MAX_CELLS, MAX_SEEDS
    from studies.studyfile.yaml_source import MAX_FILE_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES

    text = " ".join((REPO / "docs" / "study-file.md").read_text(encoding="utf-8").split())
    bounds = re.search(
        r"at most ([\d,]+) cells .* ([\d,]+) seeds, files of ([\d,]+) KB, "
        r"nesting ([\d,]+) levels deep, aliases expanding to ([\d,]+) values, "
        r"exact integers of ([\d,]+) bits",
        text,
    )
    assert bounds, "the bounds sentence of docs/study-file.md"
    cells, seeds, kb, depth, nodes, bits = map(_number, bounds.groups())
    assert cells == DEFAULT_MAX_CELLS and seeds == MAX_SEEDS
    assert kb * 1024 == MAX_FILE_BYTES and depth == MAX_YAML_DEPTH
    assert nodes == MAX_YAML_NODES and bits == MAX_INT_BITS


def test_the_guarantees_numbers_are_the_codes():
    from studies.studyfile.study import MAX_FAILURES
    from studies.tracking.retry import OUTAGE_PATIENCE_S

    text = " ".join((REPO / "docs" / "guarantees.md").read_text(encoding="utf-8").split())
    assert f"`max_failures` (at most {MAX_FAILURES})" in text
    assert f"up to {OUTAGE_PATIENCE_S / 60:.0f} minutes" in text


def test_the_experiment_size_in_the_architecture_is_the_codes():
    from studies.cells.arrays import MAX_TRIALS_PER_EXPERIMENT

    text = " ".join((REPO / "docs" / "architecture.md").read_text(encoding="utf-8").split())
    assert f"at most {MAX_TRIALS_PER_EXPERIMENT:,} trials" in text


def test_the_progress_interval_in_the_commands_page_is_the_codes():
    import inspect

    from studies.running.progress import ProgressReporter

    interval = inspect.signature(ProgressReporter.__init__).parameters["interval_s"].default
    text = " ".join((REPO / "docs" / "commands.md").read_text(encoding="utf-8").split())
    assert f"a line every {interval:.0f} s" in text


def test_the_estimates_constants_in_the_planning_page_are_the_codes():
    """docs/planning.md's table of the estimate's constants lists every one of them with the
    value `studies.planning.estimate` holds."""
    from studies.planning import estimate

    text = (REPO / "docs" / "planning.md").read_text(encoding="utf-8")
    table = dict(re.findall(r"^\| `([A-Z_]+_S)` \| ([\d.]+) s \|", text, re.M))
    constants = {name: getattr(estimate, name) for name in dir(estimate) if name.endswith("_S") and name.isupper()}
    assert set(table) == set(constants)
    for name, value in constants.items():
        assert float(table[name]) == value, name


def test_the_quickstart_has_one_time_and_a_cpu_only_first_command():
    """One measured time in the README and the quickstart file (they said "under a minute" and
    "under 5 minutes", issue 42), and the first command's alternative for a machine without a
    GPU: PyTorch's CPU build first, then the same command (pip keeps an installed torch that
    satisfies the project's range)."""
    import re

    text = README.read_text(encoding="utf-8")
    study = (REPO / "studies" / "catalog" / "quickstart.yaml").read_text(encoding="utf-8")
    said = re.findall(r"(\d+ s) on 2 cores", text)
    assert said and said == re.findall(r"(\d+ s) on 2 cores", study), (said, study[:600])
    assert not re.search(r"under (a|\d+) minutes? on 2 cores", text + study)
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    cpu = [b for b in blocks if "--index-url https://download.pytorch.org/whl/cpu" in b]
    assert cpu, "no CPU-only install in the README"
    lines = cpu[0].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("pip install torch torchvision "))
    assert lines[first + 1].startswith('pip install -e ".[test]" && studies run studies/catalog/quickstart.yaml')
