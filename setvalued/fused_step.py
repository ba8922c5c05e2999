"""Where a fused step is: the models of N members of one config (N seeds) held as one stacked
model, and one forward, one backward and one optimizer step for all of them.

Horizontal fusion (HFTA, Wang et al., MLSys 2021) with ``torch.func``: the members' parameters
and buffers are stacked along a new leading axis (``stack_module_state``) and the forward pass is
``vmap`` over ``functional_call`` of one template module, so one kernel does the work of N
models. Every member's own module keeps working (evaluation, checkpoints): its parameters and
buffers are views of its slice of the stacked tensors. What makes a member its seed stays its own:

- BatchNorm's running statistics are stacked buffers handed to ``vmap`` with the parameters
  (``in_dims=0``), so each member's in-place update lands in its own slice;
- each member's loss is computed on its slice of the output, under its own random state
  (``RandomState``: the noised losses' draws as in its separate trial);
- SGD with momentum, Nesterov and weight decay is elementwise, so one optimizer over the
  stacked parameters gives every member the update of its own optimizer; a loss's own
  parameters (ROLE) stay per member.

A member's gradient is its own: the losses are summed, and the sum's gradient reaches each
member's slice through its own loss only.
"""

from __future__ import annotations

import contextlib
import copy
import random
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.func import functional_call, stack_module_state, vmap

from setvalued.losses import SetValuedLoss, TwoHeadOutput
from setvalued.train_metrics import to_float32, watched_scores
from setvalued.train_step import model_inputs, set_learning_rate


class RandomState:
    """One member's global random state (Python, NumPy, torch on the CPU and, on CUDA, the
    device's generator), swapped in while the member draws: its batches and its loss."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.saved: tuple | None = None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.saved is not None:
            python, numpy_state, cpu, cuda = self.saved
            random.setstate(python)
            np.random.set_state(numpy_state)
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda)
        try:
            yield
        finally:
            self.saved = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                          torch.cuda.get_rng_state() if self.cuda and torch.cuda.is_initialized() else None)


def member_output(output: Any, i: int) -> Any:
    """Member ``i``'s slice of the stacked output."""
    if isinstance(output, TwoHeadOutput):
        return TwoHeadOutput(*(t[i] for t in output))
    return output[i]


def member_outputs(output: Any) -> list[Any]:
    """Every member's slice of the stacked output, cut in one operation (``unbind``: its
    backward is one ``stack``, where N slices would add N gradients into the stacked one)."""
    if isinstance(output, TwoHeadOutput):
        return [TwoHeadOutput(*parts) for parts in zip(*(t.unbind(0) for t in output))]
    return list(output.unbind(0))


class FusedStep:
    """The stacked model of N members and one training step for all of them."""

    def __init__(self, cfg: Mapping[str, Any], device: torch.device, models: Sequence[torch.nn.Module],
                 losses: Sequence[SetValuedLoss], amp_dtype: torch.dtype | None):
        self.cfg, self.device, self.losses, self.amp_dtype = cfg, device, list(losses), amp_dtype
        self.template = copy.deepcopy(models[0]).to("meta")
        params, buffers = stack_module_state(list(models))
        #: stacked parameters and buffers, (N, ...) each, in the order of ``named_parameters``
        self.params = {name: p.detach().requires_grad_(models[0].get_parameter(name).requires_grad)
                       for name, p in params.items()}
        self.buffers = buffers
        for i, model in enumerate(models):
            _view_into(model, self.params, self.buffers, i)
        self.dtype = next((p.dtype for p in self.params.values() if p.is_floating_point()), torch.float32)
        o = cfg["optim"]
        groups = [{"params": [p for p in self.params.values() if p.requires_grad],
                   "weight_decay": o["weight_decay"], "lr_multiplier": 1.0}]
        for loss in losses:
            loss_params = [p for p in loss.parameters() if p.requires_grad]
            if loss_params:
                groups.append({"params": loss_params, "weight_decay": 0.0,
                               "lr_multiplier": float(getattr(loss, "lr_multiplier", 1.0))})
        self.optimizer = torch.optim.SGD(groups, lr=o["lr"], momentum=o["momentum"], nesterov=o["nesterov"])
        self.forward = vmap(self._forward_one, in_dims=(0, 0, 0))

    def _forward_one(self, params: dict, buffers: dict, x: torch.Tensor) -> Any:
        return functional_call(self.template, (params, buffers), (x,))

    def set_learning_rate(self, epoch: int) -> float:
        return set_learning_rate(self.optimizer, self.cfg["optim"], epoch)

    def start_training(self) -> None:
        self.template.train()

    def run_model(self, x: torch.Tensor) -> Any:
        """The stacked output (N, B, ...) of the members on their stacked inputs (N, B, ...)."""
        x = model_inputs(x, self.dtype)
        if self.amp_dtype is None:
            return self.forward(self.params, self.buffers, x)
        with torch.autocast(self.device.type, dtype=self.amp_dtype):
            return self.forward(self.params, self.buffers, x)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, live: Sequence[bool],
                 random_states: Sequence[RandomState]) -> list[tuple[torch.Tensor, torch.Tensor | None] | None]:
        """One forward, loss, backward and optimizer step of every member on its batch (slice
        ``i`` of ``x``, ``y``, ``idx``). Returns each live member's loss and watched scores
        (their ``.grad`` kept), None for a member that has failed (its loss is not computed)."""
        outputs = member_outputs(self.run_model(x))
        results: list[tuple[torch.Tensor, torch.Tensor | None] | None] = []
        total = None
        for i, loss_fn in enumerate(self.losses):
            if not live[i]:
                results.append(None)
                continue
            mine = to_float32(outputs[i])
            scores = watched_scores(mine, loss_fn)
            if scores is not None and scores.requires_grad:
                scores.retain_grad()
            with random_states[i].active():
                loss = loss_fn(mine, y[i], idx[i])
            total = loss if total is None else total + loss
            results.append((loss, scores))
        self.optimizer.zero_grad(set_to_none=True)
        if total is not None:
            total.backward()
            self.optimizer.step()
        return results

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


def _view_into(model: torch.nn.Module, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
               i: int) -> None:
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
