"""What must hold before the first trial of a study starts, each checked cheaply on the driver.

A study that cannot finish should fail in seconds, before Ray starts and before anything is
written to MLflow, with a message that names the path or value at fault: the output folder
and the trial storage writable, every real data set's folder present in its official layout,
the tracking server answering. Each check returns the problems it found (an empty list when
all is well); the runner reports them together.
"""

from __future__ import annotations

import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["writable_folder", "tracking_reachable", "data_layouts", "plugin_code", "check_all"]

#: seconds the tracking server has to answer its health check
TRACKING_TIMEOUT_S = 15.0


def writable_folder(path: Path, what: str, keep: bool = False) -> list[str]:
    """The folder (created if missing) accepts a new file; else why not. The folders made for
    the check are removed again unless ``keep``: a run refused later leaves none behind."""
    path = Path(path)
    missing = []
    for folder in (path, *path.parents):
        if os.path.lexists(folder):
            break
        missing.append(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".studies-write-check-"):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        return [f"{what} {path} is not writable ({reason}); expected a folder this user can write to"]
    finally:
        for folder in missing if not keep else ():
            try:
                folder.rmdir()
            except OSError:
                break
    return []


def _is_local_path(storage: str) -> bool:
    return "://" not in storage or storage.startswith("file://")


def tracking_reachable(uri: str, timeout_s: float = TRACKING_TIMEOUT_S) -> list[str]:
    """An http(s) tracking server answers ``/health``; a SQLite store's folder is writable."""
    if uri.startswith("sqlite:///"):
        return writable_folder(Path(uri[len("sqlite:///") :]).parent, "the MLflow database's folder")
    if not uri.startswith(("http://", "https://")):
        return []
    from analysis.collect import display_uri

    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s) as answer:
            if answer.status == 200:
                return []
            status = f"HTTP {answer.status}"
    except urllib.error.HTTPError as error:
        status = f"HTTP {error.code}"
    except (urllib.error.URLError, OSError) as error:
        status = str(getattr(error, "reason", error))
    return [
        f"the tracking server {display_uri(uri)} does not answer ({status}); expected a running MLflow "
        f"server (mlflow server ...) or pass --tracking-uri"
    ]


def data_layouts(data_configs: Iterable[Mapping]) -> list[str]:
    """Every distinct real data set of the study is where its config says, in its layout
    (the data package, which imports torch, is loaded only when there is one)."""
    problems, seen = [], set()
    for data in data_configs:
        key = (data.get("name"), data.get("root"), bool(data.get("download")))
        if data.get("name") not in ("cifar100", "plantnet300k", "imagenet_lt"):  # their check reads more fields
            key += tuple(sorted((k, repr(v)) for k, v in data.items() if k not in ("num_workers", "placement")))
        if key in seen or data.get("name") == "synthetic":
            continue
        seen.add(key)
        from setvalued import registry
        from setvalued.data import DataLayoutError, check_layout

        try:
            check_layout(dict(data))
        except registry.PluginError as error:  # a plugin's preflight code that fails to import
            problems.append(f"plugin {error}")
        except DataLayoutError as error:  # (a plugin's message names the data set and its origin)
            problems.append(
                str(error) if str(error).startswith("data set ") else f"data.root of {data.get('name')}: {error}"
            )
    return problems


def plugin_code(configs: Iterable[Mapping]) -> list[str]:
    """The code of every plugin the study's configs name imports and takes the parameters its
    declaration lists (``setvalued.registry``; a loss's class is registered as the trainer
    would). Only plugins are imported, and only when a config names one."""
    from setvalued import registry

    problems, seen = [], set()
    for config in configs:
        for item in registry.plugins_of_config(config):
            if (item.kind, item.name) in seen:
                continue
            seen.add((item.kind, item.name))
            try:
                if item.kind == "loss":
                    from setvalued.losses import loss_parameters

                    loss_parameters(item.name)
                else:
                    registry.load_factory(item.kind, item.name)
            except registry.PluginError as error:
                problems.append(f"plugin {error}")
    return problems


def check_all(
    study_dir: Path,
    tracking_uri: str,
    storage: str | None,
    data_configs: Iterable[Mapping],
    configs: Iterable[Mapping] = (),
) -> list[str]:
    """Every precondition of a run, in the order a user would fix them (``configs``: the cells'
    trial configs, whose plugins are checked)."""
    problems = writable_folder(study_dir, "the output folder")
    if storage and _is_local_path(storage):
        problems += writable_folder(Path(storage.removeprefix("file://")), "the trial storage (--storage)")
    problems += tracking_reachable(tracking_uri)
    problems += data_layouts(data_configs)
    problems += plugin_code(configs)
    return problems
