"""The habits of CONTRIBUTING.md, checked on the source with ``ast`` (as tests/test_layers.py
checks the layering): functions short enough to read as their phases, no private name shared
between modules, no module writing another's private attribute, the runner's session state set
in one place, no private function that nothing calls."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("setvalued", "analysis", "studies")

#: the most lines a function of the three packages may span (its decorators excluded,
#: its docstring included): longer, it reads as its named steps
MAX_FUNCTION_LINES = 80
#: functions allowed to be longer, each with why (none today: keep it so)
LONG_FUNCTIONS: dict[str, str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@functools.cache
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


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _attribute_writes(tree: ast.AST) -> list[ast.Attribute]:
    """Every attribute assigned (``x.a = ...``, ``x.a += ...``, ``del x.a``) in `tree`."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load)]


def _owner(node: ast.Attribute) -> str | None:
    return node.value.id if isinstance(node.value, ast.Name) else None


def test_no_module_writes_another_objects_private_attribute():
    """A private attribute (``obj._name``) is assigned by its own object's methods (``self``,
    ``cls``) only: a collaborator that needs to set it gets a public name or a method."""
    bad = [
        f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}"
        for _, path, tree in _sources()
        for node in _attribute_writes(tree)
        if _private(node.attr) and _owner(node) not in ("self", "cls")
    ]
    assert not bad, "\n".join(bad)


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name)


def _self_writes(function: ast.AST) -> set[str]:
    return {node.attr for node in _attribute_writes(function) if _owner(node) == "self"}


def _session_names(function: ast.AST) -> set[str]:
    """The names a function binds to a `StudySession`: built there, or a parameter annotated so."""
    names = {
        arg.arg
        for arg in (*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs)
        if arg.annotation is not None and "StudySession" in ast.unparse(arg.annotation)
    }
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and "StudySession(" in ast.unparse(node.value):
            for target in node.targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def test_the_sessions_state_is_set_in_one_place():
    """`StudySession` declares its whole state in ``__init__`` (its other methods assign only
    what is declared there), and no other module of the runner assigns a session's attribute."""
    path = ROOT / "studies" / "running" / "session.py"
    session = _class(ast.parse(path.read_text(encoding="utf-8")), "StudySession")
    methods = [node for node in session.body if isinstance(node, ast.FunctionDef)]
    declared = _self_writes(next(m for m in methods if m.name == "__init__"))
    undeclared = {f"{m.name}: self.{a}" for m in methods if m.name != "__init__" for a in _self_writes(m) - declared}
    assert not undeclared, f"StudySession's state outside __init__: {sorted(undeclared)}"
    outside = [
        f"{module}.{name}:{node.lineno} {ast.unparse(node)}"
        for module, file, tree in _sources()
        if file != path
        for name, function in _functions(tree)
        for node in _attribute_writes(function)
        if _owner(node) in _session_names(function)
    ]
    assert not outside, "a session's attributes set outside it:\n" + "\n".join(outside)


def test_the_session_checker_sees_a_write_from_outside():
    tree = ast.parse("def run(session: StudySession):\n    session.context = 1\n    other.context = 2\n")
    ((_, function),) = _functions(tree)
    writes = [ast.unparse(n) for n in _attribute_writes(function) if _owner(n) in _session_names(function)]
    assert writes == ["session.context"]


def _private_imports(module: str, tree: ast.Module, is_package: bool = False) -> list[str]:
    """``from M import _name`` of a project module M other than `module` itself (`is_package`:
    `module` is a package's ``__init__``, the base of its relative imports)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        source = node.module or ""
        if node.level:  # relative: resolved against the importing package
            parts = package.split(".")
            source = ".".join(parts[: len(parts) - node.level + 1] + ([source] if source else []))
        if source.split(".")[0] in PACKAGES and source != module:
            found += [f"{source}.{alias.name}" for alias in node.names if _private(alias.name)]
    return found


def test_no_module_imports_another_modules_private_name():
    """A name another module of the project needs is public (no leading underscore), or it
    moves to the module that needs it: ``from M import _name`` is refused everywhere in the
    three packages (tests may still reach a module's internals)."""
    bad = [
        f"{module} imports {name}"
        for module, path, tree in _sources()
        for name in _private_imports(module, tree, path.name == "__init__.py")
    ]
    assert not bad, "\n".join(bad)


def test_the_private_import_checker_sees_relative_and_absolute_imports():
    tree = ast.parse("from analysis.plot_style import _band, short\nfrom .stats import _rows\n")
    assert _private_imports("analysis.plots", tree) == ["analysis.plot_style._band", "analysis.stats._rows"]


def _unused_private_functions(trees: list[ast.Module]) -> list[str]:
    """Private functions and methods (undecorated: a decorator may register them) whose name
    no code of `trees` reads."""
    read = {
        node.id if isinstance(node, ast.Name) else node.attr
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load)
    }
    return [
        name
        for tree in trees
        for name, node in _functions(tree)
        if _private(node.name) and not node.decorator_list and node.name not in read
    ]


def test_no_private_function_is_dead():
    """A private function or method that nothing in the three packages calls is dead code
    (a helper only the tests use belongs to the tests)."""
    dead = _unused_private_functions([tree for _, _, tree in _sources()])
    assert not dead, f"private functions nothing calls: {dead}"


def test_the_dead_code_checker_sees_an_uncalled_method():
    tree = ast.parse("class A:\n    def _used(self): ...\n    def _unused(self): ...\n    def f(self): self._used()\n")
    assert _unused_private_functions([tree]) == ["A._unused"]
