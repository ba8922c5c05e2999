"""Plugins made visible to ``importlib.metadata`` without pip: a ``*.dist-info`` folder (METADATA,
entry_points.txt, and direct_url.json for a local-folder install) beside the package, in a folder
put on ``sys.path`` of the driver and on ``PYTHONPATH`` of the Ray workers. Nothing is installed
into the shared environment."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "plugin"


def write_dist(
    site: Path,
    name: str,
    version: str,
    entry_points: dict[str, dict[str, str]],
    packages: dict[str, Path | dict[str, str]],
    source: Path | None = None,
    editable: bool = True,
) -> Path:
    """A distribution ``name`` in ``site``: ``packages`` maps a package name to a folder to copy or
    to ``{file name: text}``; ``source``: the local folder it was installed from (direct_url.json,
    PEP 610), None for an index install."""
    site.mkdir(parents=True, exist_ok=True)
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = []
    for group, points in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{key} = {value}" for key, value in points.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    if source is not None:
        (info / "direct_url.json").write_text(
            json.dumps({"url": source.resolve().as_uri(), "dir_info": {"editable": editable}})
        )
    for package, content in packages.items():
        target = site / package
        if isinstance(content, Path):
            shutil.copytree(content, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.mkdir()
            for file, text in content.items():
                (target / file).write_text(text)
    return site


def example_entry_points() -> dict[str, dict[str, str]]:
    """The example plugin's entry points, read from its pyproject.toml."""
    with open(EXAMPLE / "pyproject.toml", "rb") as handle:
        project = tomllib.load(handle)["project"]
    return project["entry-points"]


def write_example(site: Path) -> Path:
    """The example plugin of examples/plugin, as an editable install of that folder."""
    with open(EXAMPLE / "pyproject.toml", "rb") as handle:
        project = tomllib.load(handle)["project"]
    return write_dist(
        site,
        project["name"],
        project["version"],
        example_entry_points(),
        {"setvalued_example_plugin": EXAMPLE / "setvalued_example_plugin"},
        source=EXAMPLE,
    )


def activate(site: Path, monkeypatch) -> None:
    """``site`` on this process's sys.path and on PYTHONPATH (for the Ray workers and
    subprocesses), the registry's cache cleared before and after."""
    from setvalued import registry

    monkeypatch.syspath_prepend(str(site))
    paths = [str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    registry.clear_cache()
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
