"""Where a checkpoint is made: the state of a trial after an epoch (what ``on_epoch`` is handed
and ``fit(..., checkpoint=)`` resumes from), its check against the resuming config, the best
checkpoint on validation kept for the test pass, and a saved state read back safely.
"""

from __future__ import annotations

import copy
import math
import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch

from setvalued.config import DATA_FIELDS, default_config
from setvalued.training.setup import flat_config

CHECKPOINT_FORMAT = 1

#: Config keys that may differ between a checkpoint and the run resuming from it.
RESUME_FREE_KEYS = ("data.num_workers", "device", "epochs", "compile", "eval.batch_size")


def cpu_copy(obj: Any) -> Any:
    """A deep copy with every tensor detached, cloned and moved to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def improves(value: float, best: float | None, maximize: bool) -> bool:
    """Whether ``value`` replaces the best so far (strictly better; the first epoch always
    counts, and a finite value beats a NaN)."""
    if best is None:
        return True
    if not math.isfinite(value):
        return False
    if not math.isfinite(best):
        return True
    return value > best if maximize else value < best


def keep_if_best(
    best: dict[str, Any] | None,
    epoch: int,
    value: float,
    thresholds: Mapping[float, float],
    model: torch.nn.Module,
    maximize: bool,
) -> dict[str, Any] | None:
    """The best checkpoint after ``epoch``: this epoch's model, value and average-K thresholds
    when ``value`` improves on ``best`` (the papers' "early stopping"), else ``best``."""
    if improves(value, None if best is None else best["value"], maximize):
        return {
            "epoch": epoch,
            "value": float(value),
            "thresholds": dict(thresholds),
            "model": cpu_copy(model.state_dict()),
        }
    return best


def trial_state(
    cfg: Mapping[str, Any],
    seed: int,
    epoch: int,
    model: torch.nn.Module,
    loss: torch.nn.Module,
    optimizer_state: Mapping[str, Any],
    scaler: Any,
    best: Any,
    history: list[dict[str, Any]],
) -> dict[str, Any]:
    """Everything needed to continue after ``epoch`` (CPU tensors, ``torch.save``-able)."""
    return {
        "format": CHECKPOINT_FORMAT,
        "epoch": epoch,
        "seed": seed,
        "config": copy.deepcopy(cfg),
        "model": cpu_copy(model.state_dict()),
        "loss": cpu_copy(loss.state_dict()),
        "optimizer": cpu_copy(optimizer_state),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "best": cpu_copy(best),
        "history": copy.deepcopy(history),
    }


def check_resumable(cfg: Mapping[str, Any], seed: int, state: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` unless ``state`` was taken with ``seed`` and the same config (up to
    ``RESUME_FREE_KEYS``), compared as ``training_fields`` reads them: a checkpoint of an
    earlier release, before a field was added, resumes when the field holds its default."""
    if int(state["seed"]) != seed:
        raise ValueError(f"checkpoint was taken with seed {state['seed']}, not {seed}")
    mine, theirs = training_fields(cfg), training_fields(state["config"])
    differing = sorted(
        k
        for k in set(mine) | set(theirs)
        if k not in RESUME_FREE_KEYS and mine.get(k, "<missing>") != theirs.get(k, "<missing>")
    )
    if differing:
        raise ValueError(
            "checkpoint config differs from this config at: "
            + ", ".join(f"{k} ({theirs.get(k, '<missing>')!r} vs {mine.get(k, '<missing>')!r})" for k in differing)
        )


def training_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The flat fields of a resolved config that decide its training: a built-in data set's
    own fields only (the ``data`` section holds the union over the data sets, and a field of
    another data set has no effect), a ``None`` there read as the data set's default, and a
    field the config lacks (added to the library after it was saved) at its default."""
    flat = flat_config(cfg)
    data = cfg.get("data") or {}
    fields = DATA_FIELDS.get(str(data.get("name")))  # None: a plugin's section, all its own
    defaults = flat_config(default_config())
    if fields is not None:
        flat = {k: v for k, v in flat.items() if not k.startswith("data.") or k[5:] in fields}
        for name, param in fields.items():
            if flat.get(f"data.{name}") is None:
                flat[f"data.{name}"] = param.default
        defaults = {k: v for k, v in defaults.items() if not k.startswith("data.")}
    for key, value in defaults.items():
        flat.setdefault(key, value)
    return flat


def load_checkpoint(checkpoint: Any) -> dict[str, Any]:
    """A state handed to ``on_epoch``, or read from a file with ``weights_only=True``: tensors,
    numbers, strings and containers only, so a crafted file cannot run code when loaded."""
    if isinstance(checkpoint, (str, os.PathLike)):
        path = os.fspath(checkpoint)
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            raise ValueError(
                f"checkpoint {path} holds objects other than tensors, numbers, strings and "
                f"containers; refused (loading it could run code): {str(error).splitlines()[0]}"
            ) from None
    if not isinstance(checkpoint, Mapping) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"checkpoint is not a setvalued.training state (format {CHECKPOINT_FORMAT}); got "
            f"{type(checkpoint).__name__} with format {getattr(checkpoint, 'get', lambda _: None)('format')!r}"
        )
    return dict(checkpoint)
