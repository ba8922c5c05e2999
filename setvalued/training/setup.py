"""What a trial of `setvalued.training` is set up from: the config with its defaults, the seeds,
the device and head, the learning rate of an epoch, the batches of a split.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import DataLoader

from setvalued import registry
from setvalued.config import (
    DATA_FIELDS,
    EVAL_FIELDS,
    HEADS,
    OPTIM_FIELDS,
    SECTION_RULES,
    TOP_FIELDS,
    default_config,
    placement_problem,
    reject_unknown_keys,
)
from setvalued.data.common import IndexedDataset, TensorSplit
from setvalued.label_kinds import label_kind_problems
from setvalued.losses import SetValuedLoss
from setvalued.metrics import parse_metric
from setvalued.params import ParameterError

#: The trial config of docs/interfaces.md section 1 with its defaults (declared in
#: ``setvalued.config``). ``loss`` is used as a whole only when the config has no ``loss``
#: section (its keys are the loss's parameters).
DEFAULT_CONFIG: dict[str, Any] = default_config()


def resolve_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config with defaults filled in and the training keys checked.

    Errors are ``ValueError``s naming the dotted key and the expected value. Data and model
    keys are checked by their builders, the loss parameters by ``build_loss``.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a mapping, got {type(config).__name__}")
    reject_unknown_keys("", config, DEFAULT_CONFIG)
    cfg = copy.deepcopy(DEFAULT_CONFIG)
    for section in ("data", "model", "optim", "eval"):
        given = config.get(section) or {}
        if not isinstance(given, Mapping):
            raise ValueError(f"config {section} must be a mapping, got {given!r}")
        if section in ("optim", "eval"):
            reject_unknown_keys(section, given, cfg[section])
        if section in ("data", "model"):  # a plugin's section: its own fields' defaults
            plugin = registry.entry("dataset" if section == "data" else "model", given.get("name"))
            if plugin is not None and not plugin.builtin:
                fields = registry.section_fields(plugin.kind, plugin.name) or {}
                cfg[section] = {key: copy.deepcopy(p.default) for key, p in fields.items() if not p.required}
        cfg[section].update(copy.deepcopy(dict(given)))
    if config.get("loss") is not None:
        if not isinstance(config["loss"], Mapping) or "name" not in config["loss"]:
            raise ValueError(f"config loss must be a mapping with a 'name', got {config['loss']!r}")
        cfg["loss"] = copy.deepcopy(dict(config["loss"]))
    for key in TOP_FIELDS:
        if key in config:
            cfg[key] = config[key]

    # data and model keys are checked by their builders, the loss parameters by build_loss
    for section, fields in (("optim", OPTIM_FIELDS), ("eval", EVAL_FIELDS), ("", TOP_FIELDS)):
        values = cfg[section] if section else cfg
        for key, param in fields.items():
            try:
                values[key] = param.check(f"{section}.{key}" if section else key, values[key])
            except ParameterError as err:
                raise ValueError(f"config {err.text}") from None
        for rule in SECTION_RULES.get(section, ()):
            reason = rule(values)
            if reason:
                raise ValueError(
                    f"config {section}: {reason}" if not reason.startswith(section) else f"config {reason}"
                )

    e = cfg["eval"]
    if not isinstance(e["selection"], str) or not e["selection"].startswith("val/"):
        raise ValueError(
            f"config eval.selection must be a validation metric path such as val/top5, got {e['selection']!r}"
        )
    parts = parse_metric(e["selection"])
    if parts:  # a K the trainer will not compute; other names fail at the first evaluation
        k = int(parts["k"])
        key = "eval.ks" if parts["kind"] == "top" else "eval.avgk"
        if k not in e["ks" if parts["kind"] == "top" else "avgk"]:
            raise ValueError(
                f"config eval.selection is {e['selection']!r} but {key} ({list(e[key[5:]])}) does not "
                f"contain {parts['k']}"
            )
    for path, reason in label_kind_problems(cfg):
        raise ValueError(f"config {'.'.join(path)}: {reason}")
    try:
        cfg["data"]["placement"] = DATA_FIELDS["synthetic"]["placement"].check(
            "data.placement", cfg["data"].get("placement", "auto")
        )
    except ParameterError as err:
        raise ValueError(f"config {err.text}") from None
    reason = placement_problem(cfg["data"])
    if reason:
        raise ValueError(f"config {reason}")
    head = cfg["model"].get("head", "auto")
    if head != "auto" and head not in HEADS:
        raise ValueError(f"config model.head must be one of auto, {', '.join(HEADS)}, got {head!r}")
    return cfg


def flat_config(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"optim.lr": 0.1, ...}``."""
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) from one integer."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def reseed_epoch(seed: int) -> None:
    """``seed_everything`` for the devices a trainer has in use: Python, NumPy, torch's CPU
    generator and, once CUDA is initialised, every CUDA generator.

    ``torch.manual_seed`` also queues the seed for every backend that is not initialised
    (CUDA, XPU, MTIA), recording a stack trace for each: hundreds of microseconds, a few
    percent of a small model's epoch. By the first epoch the trainer's device is set up,
    so the skipped backends are ones it does not use.
    """
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def resolve_device(name: str) -> torch.device:
    """The device of config ``device`` (``auto``: CUDA when available)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"config device is {name!r} but CUDA is not available on this machine")
    return torch.device(name)


def resolve_head(requested: str, loss: SetValuedLoss) -> str:
    """The model head of config ``model.head`` for ``loss`` (``auto``: the one it needs)."""
    needed = getattr(loss, "head", "linear")
    if requested == "auto":
        return needed
    if (needed == "two_head") != (requested == "two_head"):
        raise ValueError(
            f"model.head is {requested!r} but loss {getattr(loss, 'registry_name', '?')!r} needs "
            f"{needed!r} (set model.head: auto)"
        )
    return requested


def lr_at(base_lr: float, gamma: float, milestones: Iterable[int], epoch: int) -> float:
    """Learning rate of a 0-indexed epoch: ``base * gamma ** #{m in milestones : m <= epoch}``."""
    return base_lr * gamma ** sum(1 for m in milestones if m <= epoch)


def _seed_worker(worker_id: int) -> None:
    worker_seed = torch.initial_seed() % (2**32)
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def split_batches(
    ds: IndexedDataset, order: torch.Tensor, batch_size: int, num_workers: int, device: torch.device, loader_seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Batches ``(inputs, labels, indices)`` of ``ds`` in the given order.

    In-memory splits without transforms are sliced directly; the others go through a
    DataLoader whose worker seeds come from ``loader_seed``.
    """
    if getattr(ds, "supports_batches", False) and num_workers == 0:
        for start in range(0, len(order), batch_size):
            yield cast(TensorSplit, ds).get_batch(order[start : start + batch_size])
        return
    generator = torch.Generator()
    generator.manual_seed(loader_seed)
    loader = DataLoader(
        ds,
        batch_size=batch_size,
        sampler=order.tolist(),
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        drop_last=False,
        generator=generator,
        worker_init_fn=_seed_worker if num_workers > 0 else None,
    )
    yield from loader
