"""Bounds on the config values that size a trial's memory or processes, checked when a study
is loaded (so `--dry-run` refuses them before anything starts).

`setvalued.config` declares each field's type and range; a value can be in range and still
exhaust the machine the moment its trial starts (`model.hidden_dim: 1000000000`, a synthetic
`train_size` of 2e9, `data.num_workers: 10000`). The bounds here are derived from what the
trial requests (`resources`) and this machine, each refusal naming the field, the value and
the bound:

- `data.num_workers` <= WORKERS_PER_CPU x max(the trial's CPUs, this machine's CPUs);
- the synthetic data set (train + val + test examples x their float32 size) and the model's
  training state (MODEL_BYTES_PER_PARAMETER per parameter of `mlp` / `small_cnn`, sized by
  `model.hidden_dim`) each fit the memory a trial can have: max(this machine's memory,
  resources.gpus x LARGEST_GPU_BYTES).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from studies.studyfile.problems import Path_, Problem

__all__ = [
    "WORKERS_PER_CPU",
    "LARGEST_GPU_BYTES",
    "MODEL_BYTES_PER_PARAMETER",
    "bound_problems",
    "trial_memory_bytes",
    "max_num_workers",
]

#: data-loading processes a trial may start per CPU (more only wait on each other)
WORKERS_PER_CPU = 4
#: the memory of the largest GPU a trial may get (an H200: 141 GB)
LARGEST_GPU_BYTES = 141 * 10**9
#: bytes of training state per model parameter: weights, gradients, momentum, a checkpoint copy
MODEL_BYTES_PER_PARAMETER = 16
#: float32 values of one synthetic example in `images` form (3 x 32 x 32)
_IMAGE_VALUES = 3 * 32 * 32


def machine_memory_bytes() -> int:
    """This machine's physical memory (0 where the platform does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def trial_memory_bytes(gpus: float) -> int:
    """The most memory a trial asking for `gpus` can have: this machine's memory, or the
    GPUs' at the largest GPU's size, whichever is more."""
    return max(machine_memory_bytes(), math.ceil(gpus) * LARGEST_GPU_BYTES)


def max_num_workers(cpus: float) -> int:
    """The most data-loading workers of a trial asking for `cpus`."""
    return WORKERS_PER_CPU * max(math.ceil(cpus), os.cpu_count() or 1)


def _synthetic_bytes(data: Mapping[str, Any]) -> int:
    per_example = _IMAGE_VALUES if data.get("form") == "images" else int(data.get("feature_dim") or 0)
    examples = sum(int(data.get(k) or 0) for k in ("train_size", "val_size", "test_size"))
    return 4 * per_example * examples


def _model_parameters(config: Mapping[str, Any]) -> int:
    """Parameters of the models sized by model.hidden_dim (0 for the others)."""
    model, data = config.get("model") or {}, config.get("data") or {}
    hidden = int(model.get("hidden_dim") or 0)
    classes = int(data.get("num_classes") or 0)
    if model.get("name") == "mlp":
        inputs = _IMAGE_VALUES if data.get("form") == "images" else int(data.get("feature_dim") or 0)
        return inputs * hidden + hidden * hidden + hidden * classes
    if model.get("name") == "small_cnn":
        return 9 * (3 * 32 + 32 * 64 + 64 * hidden) + hidden * classes
    return 0


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def config_problems(config: Mapping[str, Any], cpus: float, gpus: float) -> list[tuple[str, str]]:
    """[(dotted field, message)] of the values of one trial config past their bound."""
    found = []
    data = config.get("data") or {}
    workers = int(data.get("num_workers") or 0)
    if workers > max_num_workers(cpus):
        found.append(
            (
                "data.num_workers",
                f"{workers:,} data-loading processes; expected at most "
                f"{max_num_workers(cpus):,} ({WORKERS_PER_CPU} per CPU of "
                f"max(resources.cpus, this machine's {os.cpu_count()} CPUs))",
            )
        )
    budget = trial_memory_bytes(gpus)
    where = (
        "this machine's memory"
        if budget == machine_memory_bytes()
        else f"resources.gpus x {LARGEST_GPU_BYTES // 10**9} GB"
    )
    if data.get("name") == "synthetic" and _synthetic_bytes(data) > budget:
        found.append(
            (
                "data.train_size",
                f"{int(data.get('train_size') or 0):,} examples: the synthetic set "
                f"would take {_gib(_synthetic_bytes(data))}; expected at most "
                f"{_gib(budget)} in all (train + val + test, {where})",
            )
        )
    parameters = _model_parameters(config)
    if parameters * MODEL_BYTES_PER_PARAMETER > budget:
        found.append(
            (
                "model.hidden_dim",
                f"{int((config.get('model') or {}).get('hidden_dim') or 0):,} "
                f"gives {parameters:,} parameters, "
                f"{_gib(parameters * MODEL_BYTES_PER_PARAMETER)} of training state "
                f"({MODEL_BYTES_PER_PARAMETER} bytes each); expected at most "
                f"{_gib(budget)} ({where})",
            )
        )
    return found


def _origin(dotted: str, variant: str, swept: Mapping[str, Any], overlays: Mapping[str, Any]) -> Path_:
    """Where the file sets `dotted` for a config: the design, the variant's overlay, or base."""
    parts = tuple(dotted.split("."))
    if dotted in swept:
        return ("design",)
    node: Any = overlays.get(variant) or {}
    for part in parts:
        node = node.get(part) if isinstance(node, dict) else None
    return ("variants", variant) + parts if node is not None else ("base",) + parts


def bound_problems(
    configs: Iterable[Any], cpus: float, gpus: float, overlays: Mapping[str, Any] | None = None
) -> list[Problem]:
    """The problems of the designed configs (`studies.studyfile.configs.DesignedConfig`): one per field
    and place it is written, however many configs share it."""
    problems: dict[Path_, Problem] = {}
    for designed in configs:
        for dotted, message in config_problems(designed.config, cpus, gpus):
            path = _origin(dotted, designed.variant, designed.swept, overlays or {})
            if path == ("design",):
                message = f"{dotted} = {message}"
            problems.setdefault(path, Problem(path, message))
    return list(problems.values())
