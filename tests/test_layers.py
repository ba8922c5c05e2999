"""The layering of docs/architecture.md, checked on the source: every import of every module,
including imports inside functions, read with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("setvalued", "analysis", "studies")

#: what each library must never import (a prefix matches the package and its modules)
FORBIDDEN = {
    "setvalued": ("ray", "mlflow", "optuna", "pydantic", "studies", "analysis"),
    "analysis": ("torch", "torchvision", "timm", "ray", "setvalued", "studies"),
}
#: modules of the libraries that must stay importable without torch (validation, --dry-run)
TORCH_FREE = (
    "setvalued.params",
    "setvalued.config",
    "setvalued.paths",
    "setvalued.metrics.names",
    "setvalued.losses.parameters",
    "setvalued.reference_tables",
    "setvalued.label_kinds",
    "setvalued.registry",
    "setvalued.provenance.file_digests",
    "setvalued.provenance.code",
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module named by an import statement anywhere in the file (absolute names)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module_name(path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path) if m in modules and m != name}
    return graph


def _matches(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("library", sorted(FORBIDDEN))
def test_libraries_import_nothing_above_them(library):
    bad = []
    for path in (ROOT / library).rglob("*.py"):
        for module in _imports(path):
            if _matches(module, FORBIDDEN[library]):
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, "\n".join(bad)


def test_torch_free_modules_import_no_torch():
    graph = _graph()
    for name in TORCH_FREE:
        path = ROOT / (name.replace(".", "/") + ".py")
        direct = {m for m in _imports(path) if _matches(m, ("torch", "torchvision", "timm"))}
        assert not direct, f"{name} imports {direct}"
        for dep in graph[name]:
            if dep.startswith("setvalued"):
                # setvalued.metrics loads its modules on first use of a name (its __init__)
                assert dep in TORCH_FREE or dep in ("setvalued", "setvalued.losses", "setvalued.metrics"), (
                    f"{name} imports {dep}"
                )


@pytest.mark.parametrize("name", TORCH_FREE + ("setvalued.metrics", "studies.studyfile", "studies.cli"))
def test_torch_free_modules_leave_torch_unimported_when_run(name):
    """The same, by running the import: a fresh interpreter imports the module and torch is not
    among its modules (a package's lazy names, such as setvalued.metrics's, included)."""
    import subprocess
    import sys

    code = f"import sys, {name}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", name


#: the packages of setvalued whose modules are read through the package's public names
#: (its __init__) from everywhere outside it
PUBLIC_THROUGH_PACKAGE = ("setvalued.training", "setvalued.fused", "setvalued.metrics")


def test_setvalueds_packages_are_imported_through_their_public_names():
    """Outside setvalued.training, .fused and .metrics, the project imports what their
    __init__ exports, not their modules (the modules are the packages' own business)."""
    bad = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            module = _module_name(path)
            for imported in _imports(path):
                for package in PUBLIC_THROUGH_PACKAGE:
                    inner = imported.startswith(package + ".") and imported.count(".") == package.count(".") + 1
                    if (
                        inner
                        and not _matches(module, (package,))
                        and imported.rsplit(".", 1)[1] not in _exported(package)
                    ):
                        bad.append(f"{module} imports {imported}")
    assert not bad, "\n".join(sorted(bad))


def _exported(package: str) -> set[str]:
    """The names of a package's ``__all__`` (read from its source) and its modules' names."""
    init = ROOT / package.replace(".", "/") / "__init__.py"
    tree = ast.parse(init.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            try:
                names |= set(ast.literal_eval(node.value))
            except ValueError:  # __all__ computed (setvalued.metrics: sorted of its table)
                pass
        if isinstance(node, ast.Dict) or isinstance(node, ast.Call):
            for const in ast.walk(node):
                if isinstance(const, ast.Constant) and isinstance(const.value, str):
                    names.add(const.value)
    return names


def test_no_module_imports_one_that_imports_it_back():
    """No cycle in the import graph of the three packages (Tarjan's strongly connected components)."""
    graph = _graph()
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_the_graph_sees_imports_inside_functions():
    """The checker reads function-level imports: studies.studyfile.trial_config imports timm inside one."""
    assert "timm" in _imports(ROOT / "studies" / "studyfile" / "trial_config.py")


#: the stage packages of `studies` (docs/architecture.md); the modules on top (cli, api,
#: errors, readback, landscape) are not a package
STAGES = (
    "studies.studyfile",
    "studies.cells",
    "studies.scheduling",
    "studies.planning",
    "studies.running",
    "studies.tracking",
    "studies.cluster",
)


def _stage(module: str) -> str | None:
    return next((s for s in STAGES if _matches(module, (s,))), None)


def test_the_stage_packages_import_each_other_without_a_circle():
    """Between the stage packages the imports run one way: no package imports one that
    imports it back, directly or through others."""
    edges: dict[str, set[str]] = {s: set() for s in STAGES}
    for name, deps in _graph().items():
        here = _stage(name)
        for dep in deps:
            there = _stage(dep)
            if here and there and here != there:
                edges[here].add(there)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})) for nxt in edges[start])

    circles = sorted(s for s in STAGES if reaches(s, s, {s}))
    assert not circles, f"stage packages in a circle: {circles}; edges: {edges}"


def test_the_study_file_package_imports_neither_torch_nor_ray():
    """Validation (`studies run --dry-run`) stays lean: no module of studies.studyfile, nor
    any project module it imports at any depth, imports torch or Ray at module level or
    inside a function, except `trial_config`'s one timm look-up of a model name."""
    graph = _graph()
    heavy = ("torch", "torchvision", "ray")
    todo = [m for m in graph if _matches(m, ("studies.studyfile",))]
    assert "studies.studyfile.spec" in todo
    seen: set[str] = set()
    bad = []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = ROOT / (name.replace(".", "/") + ".py")
        if not path.is_file():
            path = ROOT / name.replace(".", "/") / "__init__.py"
        bad += [f"{name} imports {m}" for m in _imports(path) if _matches(m, heavy)]
        todo += [d for d in graph[name] if d not in seen]
    assert not bad, "\n".join(bad)


#: project modules that these setvalued modules may import (docs/architecture.md): the compiled
#: step sits below ``training.step`` (it shares the trainer's float32 cast,
#: ``training.running_metrics.to_float32``)
NARROW = {
    "setvalued.training.compiled_step": (
        "setvalued.losses",
        "setvalued.losses.base",
        "setvalued.training.running_metrics",
    ),
}


@pytest.mark.parametrize("name", sorted(NARROW))
def test_narrow_setvalued_modules_import_only_what_they_declare(name):
    deps = {d for d in _graph()[name] if d.startswith(("setvalued", "studies", "analysis"))}
    assert deps <= set(NARROW[name]), f"{name} imports {sorted(deps - set(NARROW[name]))}"


def test_the_metrics_packages_table_names_what_its_modules_define():
    """`setvalued.metrics` lists its public names without importing its modules (torch-free
    names): each listed name is defined by the module it points to, and a module's `__all__`
    is in the table (a public name added to a module and not to the table fails)."""
    import importlib
    from collections import defaultdict

    import setvalued.metrics as metrics

    by_module: dict[str, set[str]] = defaultdict(set)
    for name, module in metrics._HOME.items():
        by_module[module].add(name)
        assert hasattr(importlib.import_module(f"setvalued.metrics.{module}"), name), (module, name)
    for module, names in by_module.items():
        declared = getattr(importlib.import_module(f"setvalued.metrics.{module}"), "__all__", None)
        if declared is not None:
            assert names <= set(declared), module
            assert set(declared) <= set(metrics._HOME), module
