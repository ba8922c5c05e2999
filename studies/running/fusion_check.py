"""A fused study's models checked before anything starts (``resources.seeds_per_trial`` > 1):
`check_fusion` refuses, with `StudyError` at ``resources.seeds_per_trial``, a config whose model
cannot train as a fused array, from a one-batch probe of each distinct model shape
(``setvalued.fused.probe_config``, which imports torch: 2-4 s in the driver on a 2-core machine).

A probe's pass is kept (`studies.local_state`, ``fusion-probes.json``) under what decides it:
the model, the data that shapes its input (sizes and label noise left out), mixed precision,
`compile`, the device, and the code that runs it (the torch version, the plugins' distributions
and versions, and the size and time of every module of ``setvalued``); a later study of the
same shape neither probes nor imports torch. A refusal is not kept: the next run probes again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: the file of the probes that passed, under `studies.local_state.state_root`
PROBES_FILE = "fusion-probes.json"
#: the most passes kept (the oldest go first)
MAX_KEPT = 512
#: the data fields that do not shape the model's input
_DATA_NOT_SHAPE = ("train_size", "val_size", "test_size", "label_noise", "split_seed", "num_workers", "root")


def probe_shape(config: Mapping[str, Any]) -> dict[str, Any]:
    """What of a config decides its probe: the model, the input's data, precision, compile, device."""
    data = {k: v for k, v in (config.get("data") or {}).items() if k not in _DATA_NOT_SHAPE}
    return {
        "model": config.get("model"),
        "data": data,
        "amp": config.get("amp"),
        "compile": config.get("compile"),
        "device": config.get("device"),
    }


def _code_version(configs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The code a probe ran: torch's version, the plugins the configs name, setvalued's modules."""
    from importlib.metadata import PackageNotFoundError, version

    import setvalued
    from setvalued.registry import plugin_distributions

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "?"
    modules = []
    root = Path(setvalued.__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        info = path.stat()
        modules.append([str(path.relative_to(root)), info.st_size, info.st_mtime_ns])
    return {"torch": torch_version, "plugins": plugin_distributions(list(configs)), "setvalued": modules}


def _key(config: Mapping[str, Any], code: Mapping[str, Any]) -> str:
    text = json.dumps([probe_shape(config), code], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _probes_file() -> Path:
    from studies.local_state import state_root

    return state_root() / PROBES_FILE


def _passed() -> list[str]:
    try:
        kept = json.loads(_probes_file().read_text())
        return [str(k) for k in kept] if isinstance(kept, list) else []
    except (OSError, ValueError):
        return []


def _keep(keys: Sequence[str]) -> None:
    """Add `keys` to the passes kept (best effort: a folder that cannot be written costs a probe)."""
    kept = [k for k in _passed() if k not in keys] + list(keys)
    path = _probes_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(kept[-MAX_KEPT:]))
        os.replace(partial, path)
    except OSError:
        pass


def check_fusion(study_file: str | Path, study: Any, cells: Sequence) -> None:
    """Refuse (`StudyError` at ``resources.seeds_per_trial``) a study whose configs cannot train
    as fused arrays: one probe per model shape not passed before (see the module docstring)."""
    from studies.studyfile.problems import StudyError

    shapes: dict[str, Any] = {}  # shape -> its first cell
    for cell in cells:
        shapes.setdefault(json.dumps(probe_shape(cell.config), sort_keys=True, default=str), cell)
    code = _code_version([c.config for c in shapes.values()])
    passed = set(_passed())
    new_passes = []
    for cell in shapes.values():
        key = _key(cell.config, code)
        if key in passed:
            continue
        from setvalued.fused import probe_config

        try:
            reason = probe_config(cell.config)
        except (ValueError, OSError):  # the config or its data fail; the preconditions or the trial say so
            continue
        if reason:
            where = ("resources", "seeds_per_trial")
            raise StudyError(
                str(study_file),
                [
                    (
                        ".".join(where),
                        study.line_of(where),
                        f"{reason} (variant {cell.variant!r}); expected seeds_per_trial: 1 for this model",
                    )
                ],
            )
        new_passes.append(key)
    if new_passes:
        _keep(new_passes)
