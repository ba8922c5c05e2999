"""The loss registry and the base class every loss derives from (docs/interfaces.md, section 2)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

#: Keys the trainer passes to every loss; a loss that does not use them ignores them.
CONTEXT_KEYS = ("class_counts", "num_classes", "num_examples")

LOSSES: dict[str, type["SetValuedLoss"]] = {}


class TwoHeadOutput(NamedTuple):
    """Output of a two-head model (average-K): the single-class (SCCP) and multi-label heads."""

    sccp: torch.Tensor
    ml: torch.Tensor


class SetValuedLoss(nn.Module):
    """Base class: ``loss(output, targets, indices=None)`` returns the batch mean.

    With ``reduction="none"`` it returns the per-sample values instead.
    """

    #: model head the loss expects: "linear", "normed" (cosine scores) or "two_head"
    head: str = "linear"
    #: whether ``forward`` needs the training-set indices of the batch
    requires_indices: bool = False

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be one of 'mean', 'sum', 'none', got {reduction!r}")
        self.reduction = reduction

    def reduce(self, per_sample: torch.Tensor) -> torch.Tensor:
        if self.reduction == "mean":
            return per_sample.mean()
        if self.reduction == "sum":
            return per_sample.sum()
        return per_sample

    def prediction_scores(self, output: Any) -> torch.Tensor:
        """The (B, L) scores that metrics rank."""
        if isinstance(output, TwoHeadOutput):
            return output.sccp
        return output


def register_loss(name: str) -> Callable[[type[SetValuedLoss]], type[SetValuedLoss]]:
    """Class decorator adding a loss to the registry under ``name``."""

    def decorate(cls: type[SetValuedLoss]) -> type[SetValuedLoss]:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} registered twice")
        LOSSES[name] = cls
        cls.registry_name = name
        return cls

    return decorate


def loss_parameters(name: str) -> list[str]:
    """The parameter names a registered loss accepts (without the context keys)."""
    cls = _lookup(name)
    sig = inspect.signature(cls.__init__)
    return [p for p in sig.parameters if p not in ("self",) + CONTEXT_KEYS
            and sig.parameters[p].kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]


def _lookup(name: str) -> type[SetValuedLoss]:
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; expected one of: {', '.join(sorted(LOSSES))}") from None


def build_loss(name: str, **params: Any) -> SetValuedLoss:
    """Build a registered loss by name.

    ``params`` are the loss's own parameters plus the context keys ``class_counts``,
    ``num_classes`` and ``num_examples``, which are dropped when the loss does not take them.
    An unknown parameter raises a ValueError naming it and the accepted ones.
    """
    cls = _lookup(name)
    sig = inspect.signature(cls.__init__)
    accepted = set(sig.parameters) - {"self"}
    kwargs = {}
    for key, value in params.items():
        if key in accepted:
            kwargs[key] = value
        elif key not in CONTEXT_KEYS:
            raise ValueError(
                f"loss {name!r} has no parameter {key!r}; accepted parameters: "
                f"{', '.join(loss_parameters(name)) or '(none)'}"
            )
    return cls(**kwargs)
