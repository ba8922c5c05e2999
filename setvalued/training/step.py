"""Where a training step is: the model, loss and optimizer of one trial and what one step
does with them (forward, loss, backward, optimizer step), the learning rate of an epoch and
the loop over an epoch's batches.

The protocol (SGD with Nesterov momentum and weight decay, step decay of the learning rate,
mixed precision on CUDA, ``compile: model``) is described in ``setvalued.training``; under
``compile: model`` the step's model forward, float32 cast and loss are one compiled function
(``setvalued.training.compiled_step``), which ``release`` drops when the trial ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from setvalued.losses import SetValuedLoss, TwoHeadOutput
from setvalued.training.compiled_step import CompiledStep
from setvalued.training.running_metrics import RunningTrainMetrics, to_float32, watched_scores
from setvalued.training.setup import lr_at

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def build_optimizer(model_params: list[torch.Tensor], loss: SetValuedLoss, optim: Mapping[str, Any]) -> torch.optim.SGD:
    """SGD with the model's parameters (weight decay ``optim.weight_decay``) and the loss's own
    parameters (ROLE's label estimates: ``lr * loss.lr_multiplier``, no weight decay)."""
    groups = [{"params": model_params, "weight_decay": optim["weight_decay"], "lr_multiplier": 1.0}]
    loss_params = [p for p in loss.parameters() if p.requires_grad]
    if loss_params:
        groups.append(
            {"params": loss_params, "weight_decay": 0.0, "lr_multiplier": float(getattr(loss, "lr_multiplier", 1.0))}
        )
    return torch.optim.SGD(groups, lr=optim["lr"], momentum=optim["momentum"], nesterov=optim["nesterov"])


def set_learning_rate(optimizer: torch.optim.Optimizer, optim: Mapping[str, Any], epoch: int) -> float:
    """Set the epoch's step-decayed rate on every parameter group (times the group's
    ``lr_multiplier``); returns the base rate."""
    lr = lr_at(optim["lr"], optim["gamma"], optim["milestones"], epoch)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_multiplier", 1.0)
    return lr


def model_inputs(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floating-point inputs in the model's dtype (a model built in float64 takes the data sets'
    float32 inputs; images stay uint8 until their augmentation)."""
    return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x


class TrainingStep:
    """The model, loss and optimizer of one trial, and one step on a batch."""

    def __init__(
        self, cfg: dict[str, Any], device: torch.device, model: torch.nn.Module, loss: SetValuedLoss, num_classes: int
    ):
        self.cfg, self.device, self.model, self.loss = cfg, device, model, loss
        #: the dtype of the model's floating-point parameters, that of its inputs
        self.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        self.amp_dtype = None
        if device.type == "cuda" and cfg["amp"]:
            self.amp_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        self.scaler = torch.amp.GradScaler("cuda") if self.amp_dtype == torch.float16 else None
        #: the compiled passes under ``compile: model`` (training: model and loss as one function)
        self.compiled: CompiledStep | None = None
        #: the module that runs the forward passes: the model, or the model under torch.compile
        #: (``compile: model``); its parameters are the model's, so checkpoints hold the model
        self.forward, self.cudagraphs = self._compiled_forward(num_classes)
        self.optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], loss, cfg["optim"])

    def _compiled_forward(self, num_classes: int) -> tuple[Any, bool]:
        """The forward of ``compile`` and whether it runs under CUDA graphs (whose outputs are
        reused buffers: the trainer copies what it keeps)."""
        if self.cfg["compile"] == "none":
            return self.model, False
        cudagraphs = self.device.type == "cuda"
        scores_dtype = torch.promote_types(self.dtype, torch.float32)  # that of to_float32's output
        self.compiled = CompiledStep(self.model, self.loss, num_classes, self.autocast, cudagraphs, scores_dtype)
        return self.compiled.forward, cudagraphs

    def release(self) -> None:
        """End of the trial: a warm worker keeps no compiled graph of it (``compile: model``)."""
        if self.compiled is not None:
            self.compiled.release()
            self.compiled = None
            self.forward = self.model

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Mixed precision on CUDA; with it off, no autocast region at all (entering even a
        disabled one costs microseconds, a few percent of a small model's training step)."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=self.amp_dtype)

    def run_model(self, x: torch.Tensor) -> Any:
        """One forward pass of the (compiled) model, its output owned by the caller."""
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with self.autocast():
            output = self.forward(model_inputs(x, self.dtype))
        if self.cudagraphs:  # the graph's output buffers are overwritten by its next replay
            output = (
                TwoHeadOutput(*(t.clone() for t in output)) if isinstance(output, TwoHeadOutput) else output.clone()
            )
        return output

    def set_learning_rate(self, epoch: int) -> float:
        return set_learning_rate(self.optimizer, self.cfg["optim"], epoch)

    def start_training(self) -> None:
        """Model and loss in training mode."""
        self.model.train()
        self.loss.train()

    def __call__(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward, loss, backward and optimizer step on one batch. Returns the loss and the
        scores that the metrics rank, their ``.grad`` kept (None when the output has none)."""
        scores: torch.Tensor | None
        if self.compiled is not None:  # model, float32 cast and loss: one compiled function
            scores, loss = self.compiled.forward_and_loss(model_inputs(x, self.dtype), y, idx)
        else:
            output = to_float32(self.run_model(x))  # the loss is computed in float32 (or wider)
            scores = watched_scores(output, self.loss)
            if scores is not None and scores.requires_grad:
                scores.retain_grad()
            loss = self.loss(output, y, idx)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        return loss, scores

    def train_on(self, batches: Iterable[Batch], running: RunningTrainMetrics) -> int:
        """Train on ``batches`` as an epoch does (fetch, copy to the device, step, running
        metrics); returns the number of steps. ``probe`` times the same loop."""
        steps = 0
        for batch in batches:
            x, y, idx = (t.to(self.device, non_blocking=True) for t in batch)
            loss, scores = self(x, y, idx)
            running.add(loss, scores, y)
            steps += 1
        return steps
