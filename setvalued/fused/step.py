"""Where a fused step is: the models of N members of one config (N seeds) held as one stacked
model, and one forward, one backward and one optimizer step for all of them.

Horizontal fusion (HFTA, Wang et al., MLSys 2021) with ``torch.func``: the members' parameters
and buffers are stacked along a new leading axis (``stack_module_state``) and the forward pass is
``vmap`` over ``functional_call`` of one template module, so one kernel does the work of N
models. Every member's own module keeps working (evaluation, checkpoints): its parameters and
buffers are views of its slice of the stacked tensors. What makes a member its seed stays its own:

- BatchNorm's running statistics are stacked buffers handed to ``vmap`` with the parameters
  (``in_dims=0``), so each member's in-place update lands in its own slice;
- the members' losses come from one call on the stacked output
  (``SetValuedLoss.member_losses``): a loss that is the mean of per-example terms is computed
  once on the N x B examples, the noised top-K losses draw each member's noise under its own
  random state (``RandomState``: the draws of its separate trial) and compute the rest at once,
  and other losses run once per member; a loss whose state differs between the members (its
  own parameters, such as ROLE's label estimates, or buffers from seed-dependent class counts)
  runs once per member with its own object;
- SGD with momentum, Nesterov and weight decay is elementwise, so one optimizer over the
  stacked parameters (its ``foreach`` form: a handful of operators for all parameters) gives
  every member the update of its own optimizer; a loss's own parameters (ROLE) stay per member.

A member's gradient is its own: the losses are summed, and the sum's gradient reaches each
member's slice through its own loss only (a member's NaN stays in its slice).
"""

from __future__ import annotations

import contextlib
import copy
import random
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.func import functional_call, stack_module_state, vmap

from setvalued.losses import SetValuedLoss, TwoHeadOutput
from setvalued.losses.base import fusion_declared, loop_member_losses
from setvalued.training import model_inputs, set_learning_rate, to_float32, watched_scores


class RandomState:
    """One member's global random state (Python, NumPy, torch on the CPU and, on CUDA, the
    device's generator), swapped in while the member draws: its batches and its loss."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.saved: tuple[Any, ...] | None = None

    @contextlib.contextmanager
    def active(self, torch_only: bool = False) -> Iterator[None]:
        """The member's state in force while the block runs; ``torch_only``: its torch
        generators only, for a block that draws from no other (a loss whose
        ``draws_torch_only`` says so), leaving Python's and NumPy's states as they are."""
        held = self.saved
        if held is not None:
            python, numpy_state, cpu, cuda = held
            if not torch_only:
                random.setstate(python)
                np.random.set_state(numpy_state)
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda)
        try:
            yield
        finally:
            cuda_now = torch.cuda.get_rng_state() if self.cuda and torch.cuda.is_initialized() else None
            if torch_only and held is not None:
                self.saved = (held[0], held[1], torch.get_rng_state(), cuda_now)
            else:
                self.saved = (random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda_now)


def member_output(output: Any, i: int) -> Any:
    """Member ``i``'s slice of the stacked output."""
    if isinstance(output, TwoHeadOutput):
        return TwoHeadOutput(*(t[i] for t in output))
    return output[i]


class FusedStep:
    """The stacked model of N members and one training step for all of them."""

    def __init__(
        self,
        cfg: Mapping[str, Any],
        device: torch.device,
        models: Sequence[torch.nn.Module],
        losses: Sequence[SetValuedLoss],
        amp_dtype: torch.dtype | None,
        compiled: bool | None = None,
    ):
        """``compiled``: the stacked forward passes under ``torch.compile`` (default: the
        config's ``compile: model``)."""
        self.cfg, self.device, self.losses, self.amp_dtype = cfg, device, list(losses), amp_dtype
        self.template = copy.deepcopy(models[0]).to("meta")
        _norms_in_their_statistics_dtype(self.template)
        params, buffers = stack_module_state(list(models))
        #: stacked parameters and buffers, (N, ...) each, in the order of ``named_parameters``
        self.params = {
            name: p.detach().requires_grad_(models[0].get_parameter(name).requires_grad) for name, p in params.items()
        }
        self.buffers = buffers
        for i, model in enumerate(models):
            _view_into(model, self.params, self.buffers, i)
        self.dtype = next((p.dtype for p in self.params.values() if p.is_floating_point()), torch.float32)
        o = cfg["optim"]
        groups = [
            {
                "params": [p for p in self.params.values() if p.requires_grad],
                "weight_decay": o["weight_decay"],
                "lr_multiplier": 1.0,
            }
        ]
        for loss in losses:
            loss_params = [p for p in loss.parameters() if p.requires_grad]
            if loss_params:
                groups.append(
                    {
                        "params": loss_params,
                        "weight_decay": 0.0,
                        "lr_multiplier": float(getattr(loss, "lr_multiplier", 1.0)),
                    }
                )
        self.optimizer = torch.optim.SGD(
            groups, lr=o["lr"], momentum=o["momentum"], nesterov=o["nesterov"], foreach=True
        )
        #: one loss object may compute every member's loss (``interchangeable``)
        self.shared_loss = interchangeable(self.losses)
        #: the losses draw from torch's generators alone: a member's draws swap in its torch states only
        self.torch_only_draws = fusion_declared(type(self.losses[0]), "draws_torch_only")
        self.forward = vmap(self._forward_one, in_dims=(0, 0, 0))
        #: the members on one input batch (B, ...) that they share (evaluation)
        self.forward_shared = vmap(self._forward_one, in_dims=(0, 0, None))
        self.eager = (self.forward, self.forward_shared)
        self.compiled = (cfg["compile"] != "none") if compiled is None else compiled
        if self.compiled:
            self._compile()

    def _compile(self) -> None:
        """``compile: model`` on an array: the stacked model's forward passes (training and
        evaluation) under ``torch.compile``, from an empty cache (``compiled_step``'s warm-worker
        rule); the losses stay eager (their per-member draws swap random states on the host),
        and no CUDA graphs (not measured on a GPU for arrays)."""
        from setvalued.training import compiled_step

        compiled_step.release_compiled()
        options: dict[str, Any] = {} if compiled_step.backend is None else {"backend": compiled_step.backend}
        self.forward = torch.compile(self.eager[0], **options)
        self.forward_shared = torch.compile(self.eager[1], **options)

    def release(self) -> None:
        """End of the array: a warm worker keeps no compiled graph of it."""
        if self.compiled:
            from setvalued.training import compiled_step

            compiled_step.release_compiled()
            self.forward, self.forward_shared = self.eager
            self.compiled = False

    def _forward_one(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
        return functional_call(self.template, (params, buffers), (x,))

    def set_learning_rate(self, epoch: int) -> float:
        return set_learning_rate(self.optimizer, self.cfg["optim"], epoch)

    def start_training(self) -> None:
        self.template.train()

    def start_evaluation(self) -> None:
        self.template.eval()

    def run_model(self, x: torch.Tensor, shared: bool = False) -> Any:
        """The stacked output (N, B, ...) of the members on their stacked inputs (N, B, ...),
        or with ``shared`` on one batch (B, ...) that every member takes."""
        x = model_inputs(x, self.dtype)
        forward = self.forward_shared if shared else self.forward
        if self.amp_dtype is None:
            return forward(self.params, self.buffers, x)
        with torch.autocast(self.device.type, dtype=self.amp_dtype):
            return forward(self.params, self.buffers, x)

    def __call__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        idx: torch.Tensor,
        live: Sequence[bool],
        random_states: Sequence[RandomState],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward, loss, backward and optimizer step of every member on its batch (slice
        ``i`` of ``x``, ``y``, ``idx``). Returns the members' losses (N,) and the stacked scores
        that the metrics rank (N, B, L), their ``.grad`` kept (None when the output has none).
        A failed member's entry is not read: its draws are not made, and where its loss is
        computed on its own it is not computed."""
        output = to_float32(self.run_model(x))  # the losses are computed in float32 (or wider)
        scores = watched_scores(output, self.losses[0])
        if scores is not None and scores.requires_grad:
            scores.retain_grad()
        draws = [rng.active(self.torch_only_draws) if alive else None for rng, alive in zip(random_states, live)]
        if self.shared_loss:
            losses = self.losses[0].member_losses(output, y, idx, draws)
        else:
            losses = loop_member_losses(self.losses, output, y, idx, draws)
        self.optimizer.zero_grad(set_to_none=True)
        if any(live):
            losses.sum().backward()
            self.optimizer.step()
        return losses, scores

    # -- one member's optimizer state, in the format of its separate trial's ---------------------
    def member_optimizer_state(self, i: int, own: torch.optim.Optimizer) -> dict[str, Any]:
        """Member ``i``'s SGD state as its separate trial's optimizer ``own`` would hold it: the
        momentum of its slice of every stacked parameter, then its loss's parameters."""
        form = own.state_dict()
        state: dict[int, dict[str, Any]] = {}
        for j, p in enumerate(self._member_params(i)):
            slot = self.optimizer.state.get(p[0], {})
            buffer = slot.get("momentum_buffer")
            if buffer is not None:
                state[j] = {"momentum_buffer": buffer[i] if p[1] else buffer}
        return {"state": state, "param_groups": form["param_groups"]}

    def load_member_optimizer_states(self, states: Sequence[Mapping[str, Any]]) -> None:
        """The optimizer state of every member (``member_optimizer_state``'s format) put back."""
        for i, member_state in enumerate(states):
            for j, (p, stacked) in enumerate(self._member_params(i)):
                saved = member_state["state"].get(j, member_state["state"].get(str(j), {})).get("momentum_buffer")
                if saved is None:
                    continue
                slot = self.optimizer.state[p]
                if stacked:
                    if slot.get("momentum_buffer") is None:
                        slot["momentum_buffer"] = torch.zeros_like(p)
                    slot["momentum_buffer"][i].copy_(saved)
                else:
                    slot["momentum_buffer"] = saved.to(p.device, p.dtype).clone()

    def _member_params(self, i: int) -> list[tuple[torch.Tensor, bool]]:
        """(the optimizer's parameter, whether it is stacked) in the order of member ``i``'s own
        optimizer: the model's trainable parameters, then its loss's."""
        stacked = [(p, True) for p in self.params.values() if p.requires_grad]
        return stacked + [(p, False) for p in self.losses[i].parameters() if p.requires_grad]


def _norms_in_their_statistics_dtype(template: torch.nn.Module) -> None:
    """Make every BatchNorm of the stacked model's ``template`` normalise its input in the
    dtype of its running statistics (float32), the result cast back to the input's dtype.

    Under CUDA autocast a BatchNorm is not cast: a separate model hands cuDNN a bfloat16 input
    with float32 weight and statistics, which it accepts. Under ``vmap`` with stacked weights,
    the batching rule calls ``native_batch_norm`` with the weight in the input's dtype and the
    statistics in float32, a mix the CUDA kernel refuses ("Expected running_mean to have type
    BFloat16 but got Float", measured on an H200). Normalising in float32 is what the kernels
    compute inside anyway; the output keeps the separate model's dtype."""
    for module in template.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.forward = types.MethodType(_norm_in_statistics_dtype, module)  # type: ignore[method-assign]


def _norm_in_statistics_dtype(self: torch.nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    reference = self.running_mean if self.running_mean is not None else self.weight
    if reference is None or x.dtype == reference.dtype:
        return type(self).forward(self, x)
    return type(self).forward(self, x.to(reference.dtype)).to(x.dtype)


def interchangeable(losses: Sequence[SetValuedLoss]) -> bool:
    """Whether the first of ``losses`` (one per member) computes every member's loss as its own
    would: the same class, no trainable parameters (ROLE's are each member's), equal buffers
    (margins from the class counts, which may depend on the seed) and equal public attributes."""
    first = losses[0]

    def state(loss: SetValuedLoss) -> dict[str, Any]:
        return {k: v for k, v in vars(loss).items() if not k.startswith("_") and k != "training"}

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.shape == b.shape
                and bool(torch.equal(a, b))
            )
        try:
            return bool(a == b)
        except Exception:  # noqa: BLE001  (values that do not compare: not known to be equal)
            return False

    if any(p.requires_grad for p in first.parameters()):
        return False
    buffers = dict(first.named_buffers())
    for loss in losses[1:]:
        other = dict(loss.named_buffers())
        mine, theirs = state(loss), state(first)
        if type(loss) is not type(first) or mine.keys() != theirs.keys() or other.keys() != buffers.keys():
            return False
        if not all(same(mine[k], theirs[k]) for k in mine):
            return False
        if any(not torch.equal(other[name], value) for name, value in buffers.items()):
            return False
    return True


def _view_into(
    model: torch.nn.Module, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor], i: int
) -> None:
    """Make ``model``'s parameters and buffers views of slice ``i`` of the stacked tensors, so
    that its state_dict, load_state_dict and forward pass see and write the stacked values."""
    for name, stacked in params.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        module._parameters[attr] = torch.nn.Parameter(stacked.detach()[i], requires_grad=stacked.requires_grad)
    for name, stacked in buffers.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        module._buffers[attr] = stacked[i]


def own_storage(model: torch.nn.Module) -> None:
    """Give ``model``'s parameters and buffers storage of their own (no longer views of the
    array's): what is saved of it then holds this member alone."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = b.clone()
