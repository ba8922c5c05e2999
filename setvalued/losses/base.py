"""The loss registry and the base class every loss derives from (docs/interfaces.md, section 2)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch
from torch import nn

from setvalued.losses.parameters import CONTEXT_KEYS, LOSS_PARAMETERS
from setvalued.params import REQUIRED, Param, check_parameters

LOSSES: dict[str, type[SetValuedLoss]] = {}


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
    #: the declared parameters (set by ``register_loss`` from ``setvalued.losses.parameters``)
    parameter_constraints: dict[str, Param] = {}
    #: the name it is registered under (set by ``register_loss``)
    registry_name: str

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

    #: whether the loss is the batch mean of per-example terms, each a function of its own
    #: example's row alone, with no random draw, no indices and no parameters of its own: then
    #: ``member_losses`` computes the N members of a fused array in one call on N x B rows
    samplewise: bool = False

    #: whether the loss's random draws (if any) come from torch's generators alone, not from
    #: Python's ``random`` or NumPy's: a fused array then swaps in only its members' torch states
    draws_torch_only: bool = False

    def member_losses(
        self,
        output: Any,
        targets: torch.Tensor,
        indices: torch.Tensor | None,
        draws: Sequence[AbstractContextManager[Any] | None],
    ) -> torch.Tensor:
        """The losses (N,) of the N members of a fused array (``setvalued.fused.step``) from
        their stacked outputs (N, B, ...), targets (N, B, ...) and indices (N, B): entry i is
        what ``self(output[i], targets[i], indices[i])`` gives under ``draws[i]`` (the context
        of member i's random state, its separate trial's).

        By default one call per member (``loop_member_losses``). A ``samplewise`` loss with
        ``reduction="mean"`` makes one call on the N x B examples with ``reduction="none"`` and
        averages each member's B values (the same terms; the mean rounds alike up to the last
        bit). A loss overrides this where its draws can be made per member and the rest fused
        (the noised top-K losses)."""
        if not (fusion_declared(type(self), "samplewise") and self.reduction == "mean"):
            return loop_member_losses([self] * len(draws), output, targets, indices, draws)
        members, batch = targets.shape[:2]
        flat = (
            TwoHeadOutput(*(t.flatten(0, 1) for t in output))
            if isinstance(output, TwoHeadOutput)
            else output.flatten(0, 1)
        )
        self.reduction = "none"
        try:
            values = self(flat, targets.flatten(0, 1), None if indices is None else indices.flatten(0, 1))
        finally:
            self.reduction = "mean"
        return values.view(members, batch).mean(dim=1)

    def prediction_scores(self, output: Any) -> torch.Tensor:
        """The (B, L) scores that metrics rank."""
        if isinstance(output, TwoHeadOutput):
            return output.sccp
        return output


def fusion_declared(cls: type, name: str) -> bool:
    """Whether ``cls``'s fusion attribute ``name`` (``samplewise``, ``draws_torch_only``,
    ``member_losses``) holds for its loss: true where it is declared by the class that defines
    the loss's ``forward`` (and ``per_sample``) or by a subclass of it, so that a subclass that
    overrides the loss's computation (a plugin deriving from ``ce``) is not fused on its
    parent's word."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return bool(vars(klass)[name])
        if "forward" in vars(klass) or "per_sample" in vars(klass):
            return False
    return False


def member_slices(output: Any) -> list[Any]:
    """Every member's slice of a stacked output (N, B, ...), cut in one operation per tensor
    (``unbind``: its backward is one ``stack``, where N slices would add N gradients)."""
    if isinstance(output, TwoHeadOutput):
        return [TwoHeadOutput(*parts) for parts in zip(*(t.unbind(0) for t in output))]
    return list(output.unbind(0))


def loop_member_losses(
    losses: Sequence[SetValuedLoss],
    output: Any,
    targets: torch.Tensor,
    indices: torch.Tensor | None,
    draws: Sequence[AbstractContextManager[Any] | None],
) -> torch.Tensor:
    """``SetValuedLoss.member_losses`` one member at a time: member i's loss ``losses[i]`` on
    its slice, under ``draws[i]``; a member whose draw context is None (a member that has
    failed) is not computed (its entry is 0, without gradient)."""
    values = []
    for i, (loss, mine) in enumerate(zip(losses, member_slices(output))):
        draw = draws[i]
        if draw is None:
            values.append(torch.zeros((), device=targets.device))
            continue
        with draw:
            values.append(loss(mine, targets[i], None if indices is None else indices[i]))
    dtype = functools.reduce(torch.promote_types, (v.dtype for v in values))
    return torch.stack([v.to(dtype) for v in values])


def fixed_shapes(values: torch.Tensor) -> bool:
    """Whether a loss takes its path of fixed shapes for ``values``: off the CPU and under
    ``torch.compile``.

    The CPU-tuned shortcuts (padding to a heap selection, repeated ``max``, pruning the classes
    that cannot reach the top k, the group bound of the average-K candidates) and the checks of
    target values read a value back on the host to choose their next step: on a GPU each such
    read waits for the device (``torch.cuda.set_sync_debug_mode`` reports it) and a compiled
    graph cannot guard on it ("data-dependent expression"). There the losses take one path of
    fixed shapes instead (e.g. all B x M x L normals and one ``topk``), with the same value and
    gradient, in expectation for the noised ones, and skip the value checks of their targets
    (an index out of range still fails in the gather that reads it). docs/interfaces.md,
    section 2.
    """
    return values.device.type != "cpu" or torch.compiler.is_compiling()


def one_hot(targets: torch.Tensor, num_classes: int, dtype: torch.dtype) -> torch.Tensor:
    """The (B, L) one-hot rows of class indices ``targets``, with a label out of range failing
    on every path, eager and compiled, negative ones included.

    A comparison with the class numbers (no CPU value copied to the device, issue #34) of the
    labels looked up in the table of class numbers: inductor checks a lookup's bounds, while it
    turns a scatter of ones into zeros into a bare comparison that gives a silent zero row for
    a label out of range. O(L) memory, no L x L identity.
    """
    classes = torch.arange(num_classes, device=targets.device)
    looked_up = torch.nn.functional.embedding(targets.long(), classes[:, None])[:, 0]
    return (classes == looked_up[:, None]).to(dtype)


def register_loss(
    name: str, parameters: Mapping[str, Param] | None = None
) -> Callable[[type[SetValuedLoss]], type[SetValuedLoss]]:
    """Class decorator adding a loss to the registry under ``name``.

    The library's losses are declared in ``setvalued.losses.parameters.LOSS_PARAMETERS[name]``;
    a loss defined elsewhere passes its own ``parameters`` (or none: then its constructor's
    parameters are taken as they are, unchecked). Registering checks that the constructor
    takes exactly the declared parameters (plus context keys and ``reduction``), so that the
    declaration and the code cannot drift apart.
    """

    def decorate(cls: type[SetValuedLoss]) -> type[SetValuedLoss]:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} registered twice")
        signature = inspect.signature(cls.__init__).parameters
        taken = [
            p
            for p in signature
            if p not in ("self", "reduction") + CONTEXT_KEYS
            and signature[p].kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        ]
        declared = parameters if parameters is not None else LOSS_PARAMETERS.get(name)
        if declared is None:
            declared = {
                p: Param(
                    "any",
                    REQUIRED if signature[p].default is inspect.Parameter.empty else signature[p].default,
                    nullable=True,
                )
                for p in taken
            }
        if taken != list(declared):
            raise ValueError(f"loss {name!r}: the constructor takes {taken}, the declaration lists {list(declared)}")
        LOSSES[name] = cls
        cls.registry_name = name
        cls.parameter_constraints = dict(declared)
        return cls

    return decorate


def loss_parameters(name: str) -> list[str]:
    """The parameter names a registered loss accepts (without the context keys)."""
    return list(_lookup(name).parameter_constraints) + ["reduction"]


def _lookup(name: str) -> type[SetValuedLoss]:
    if name in LOSSES:
        return LOSSES[name]
    from setvalued import registry

    item = registry.entry("loss", name)
    if item is None or item.builtin:
        known = sorted(set(LOSSES) | set(registry.entries("loss")))
        raise ValueError(f"unknown loss {name!r}; expected one of: {', '.join(known)}") from None
    cls = registry.load_factory("loss", name)
    if not (isinstance(cls, type) and issubclass(cls, SetValuedLoss)):
        raise registry.PluginError(
            f"loss {name!r} ({item.origin}): {item.factory} is not a subclass of setvalued.losses.SetValuedLoss"
        )
    try:
        return register_loss(name, item.parameters)(cls)
    except ValueError as err:
        raise registry.PluginError(f"loss {name!r} ({item.origin}): {err}") from None


def build_loss(name: str, **params: Any) -> SetValuedLoss:
    """Build a registered loss by name.

    ``params`` are the loss's own parameters plus the context keys ``class_counts``,
    ``num_classes`` and ``num_examples``, which are dropped when the loss does not take them.
    The loss's parameters are checked against their declaration first: an unknown name or a
    value out of range raises a ValueError (a :class:`~setvalued.params.ParameterError` for a
    value) naming the parameter and what it accepts.
    """
    cls = _lookup(name)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    declared = cls.parameter_constraints
    unknown = [key for key in params if key not in declared and key not in CONTEXT_KEYS and key != "reduction"]
    if unknown:
        raise ValueError(
            f"loss {name!r} has no parameter {unknown[0]!r}; accepted parameters: "
            f"{', '.join(loss_parameters(name)) or '(none)'}"
        )
    own = check_parameters(declared, {k: v for k, v in params.items() if k in declared}, owner=name)
    context = {k: v for k, v in params.items() if k in accepted and k not in declared}
    return cls(**own, **context)
