"""The plugins a submitted study uses, made available on the cluster (docs/plugins.md).

A plugin installed from a local folder (``pip install -e DIR`` or ``pip install DIR``: its
``direct_url.json``, PEP 610, names a ``file://`` folder) travels with the job: its top-level
packages and a copy of its ``dist-info`` (METADATA and entry_points.txt, so that the cluster's
``importlib.metadata`` registers it) are staged at the top of the job's ``working_dir``, which
Ray puts on the path of the job's driver and of every worker. A plugin installed from an index
is required at its exact version (``runtime_env`` ``pip: ["name==version"]``). Anything else (a
VCS or archive URL, code that cannot be found, a name the project already uses) is refused
before submission.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from studies.cluster.connection import SubmitError

__all__ = ["study_plugin_distributions", "ship_plugins"]


def study_plugin_distributions(configs: Iterable[Mapping[str, Any]]) -> list[str]:
    """The names of the plugin distributions the configs use, sorted."""
    from setvalued.registry import plugin_distributions

    return list(plugin_distributions(configs))


def _package_path(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise SubmitError(f"its module {module!r} cannot be found")
    if spec.submodule_search_locations:
        locations = list(spec.submodule_search_locations)
        if len(locations) != 1:
            raise SubmitError(f"its package {module!r} spans {len(locations)} folders (a namespace package)")
        return Path(locations[0])
    if spec.origin and spec.origin.endswith(".py"):
        return Path(spec.origin)
    raise SubmitError(f"its module {module!r} is not a folder or a .py file ({spec.origin})")


def _stage_local(source, staging: Path) -> None:
    import importlib.metadata

    dist = importlib.metadata.distribution(source.name)
    for module in source.top_level:
        path = _package_path(module)
        target = staging / path.name
        if target.exists():
            raise SubmitError(f"its package {path.name!r} has the name of a file or folder of the shipped project")
        if path.is_dir():
            shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, target)
    info = staging / f"{source.name.replace('-', '_')}-{source.version}.dist-info"
    info.mkdir()
    for name in ("METADATA", "entry_points.txt"):
        text = dist.read_text(name)
        if text is None:
            raise SubmitError(f"its dist-info lacks {name}")
        (info / name).write_text(text)


def ship_plugins(distributions: Iterable[str], staging: Path) -> dict[str, Any]:
    """Stage the local plugins in ``staging`` (the job's working_dir); the ``runtime_env``
    entries for the others (``{"pip": [...]}``, or ``{}``). :class:`SubmitError` naming the
    distribution when one cannot be made available on the cluster."""
    from setvalued.registry import distribution_source

    pip = []
    for name in distributions:
        try:
            source = distribution_source(name)
            if source.path is not None:
                _stage_local(source, staging)
            elif source.url is not None:
                raise SubmitError(
                    f"it was installed from {source.url}, neither a local folder nor a "
                    "package index; install it from its folder (pip install -e DIR) or an index"
                )
            else:
                pip.append(f"{source.name}=={source.version}")
        except SubmitError as error:
            raise SubmitError(
                f"refusing to submit: plugin distribution {name} cannot be made available on the cluster: {error}"
            ) from None
    return {"pip": pip} if pip else {}
