"""The habits of CONTRIBUTING.md, checked on the source with ``ast`` (as tests/test_layers.py
checks the layering): functions short enough to read as their phases, no private name shared
between modules, no module writing another's private attribute, the runner's session state set
in one place."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("setvalued", "analysis", "studies")

#: the most lines a function of the three packages may span (its decorators excluded,
#: its docstring included): longer, it reads as its named steps
MAX_FUNCTION_LINES = 80
#: functions allowed to be longer, each with why (the shorter this list, the better)
LONG_FUNCTIONS: dict[str, str] = {
    "studies.studyfile.cross_checks.check_study": "being split",
    "analysis.plot_curves.plot_series": "being split",
    "analysis.stats.paired_comparisons": "being split",
    "studies.planning.estimate.estimate": "being split",
    "studies.scheduling.racing.SeedRace._evaluate": "being split",
    "studies.studyfile.trial_config.validate_config": "being split",
    "analysis.tables.comparison_table": "being split",
    "analysis.series.curve_series": "being split",
    "studies.cluster.submit.submit_study": "being split",
    "analysis.plots.count_bin_accuracy": "being split",
    "analysis.plot_curves.heatmaps": "being split",
    "setvalued.metrics.conformal.match_average_size": "being split",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> list[tuple[str, Path, ast.Module]]:
    """(module name, path, syntax tree) of every module of the three packages."""
    return [
        (_module_name(path), path, ast.parse(path.read_text(encoding="utf-8")))
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    ]


def _functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name within the module, node) of every function, methods and nested ones included."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def _long_functions() -> dict[str, int]:
    """{module.function: lines} of the functions longer than `MAX_FUNCTION_LINES`."""
    return {
        f"{module}.{name}": node.end_lineno - node.lineno + 1
        for module, _, tree in _sources()
        for name, node in _functions(tree)
        if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    }


def test_functions_fit_the_limit():
    """No function of setvalued/, studies/ or analysis/ spans more than `MAX_FUNCTION_LINES`
    lines unless `LONG_FUNCTIONS` says why."""
    long = {name: lines for name, lines in _long_functions().items() if name not in LONG_FUNCTIONS}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {long}"


def test_the_allow_list_of_long_functions_holds_only_long_functions():
    """An entry of `LONG_FUNCTIONS` that is short now (or gone) leaves the list."""
    stale = sorted(set(LONG_FUNCTIONS) - set(_long_functions()))
    assert not stale, f"no longer over {MAX_FUNCTION_LINES} lines: {stale}"


def test_the_length_check_counts_a_long_function():
    """The checker sees a function of 81 lines, nested in a class."""
    body = "\n".join(f"        x{i} = {i}" for i in range(80))
    tree = ast.parse(f"class A:\n    def f(self):\n{body}\n")
    ((name, node),) = _functions(tree)
    assert name == "A.f" and node.end_lineno - node.lineno + 1 == 81
