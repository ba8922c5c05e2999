"""``compile: model``: the forward passes of one trial under ``torch.compile``, the training
step's model forward and loss compiled as one function (issue #34).

- **The loss inside the compiled step.** Training calls :meth:`CompiledStep.forward_and_loss`:
  the model's forward (in its autocast region), the float32 cast and the loss are one compiled
  function, so a loss of many small operators (the smooth top-k SVM's 166-331 launches per
  forward+backward in eager) runs as a few fused kernels, under CUDA graphs on CUDA (every loss
  traces whole: tests/test_losses_compile.py). The gradient of the ranked scores, which the
  trainer's ``grad_nonzero`` reads, is taken through a zero tensor added to those scores inside
  the function (d loss / d probe = d loss / d scores), since an intermediate of a compiled graph
  cannot ``retain_grad``. Evaluation calls :meth:`CompiledStep.forward` (the model alone).
- **Warm workers.** Every model is a ``Classifier`` and so shares ``Classifier.forward``'s code
  object, on which dynamo keeps its compiled variants: a worker that trains cell after cell
  (Ray reuses its actors, running each trial in a new thread) would pile up the variants of
  every earlier model, hit ``recompile_limit`` and silently run eagerly from then on. A
  ``CompiledStep`` therefore starts from an empty cache (:func:`release_compiled`) and
  :meth:`CompiledStep.release` (called when the trial ends) empties it again, with the CUDA-graph
  trees: a cell compiles once per input shape and mode (training, the ragged last batch,
  evaluation) of its own (architecture, head), and after it the worker holds no tensor, module or
  graph of it. Recompiling the same architecture in the next cell reads inductor's FX-graph cache.
- ``backend``: None for torch's default (inductor); tests set ``"eager"`` or ``"aot_eager"``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from setvalued.losses import SetValuedLoss, TwoHeadOutput
from setvalued.training.running_metrics import to_float32

__all__ = ["CompiledStep", "release_compiled", "backend"]

#: the ``torch.compile`` backend; None: torch's default (inductor)
backend: str | None = None


def release_compiled() -> None:
    """Drop every compiled variant of dynamo's cache (and the guards, graphs and module
    references they hold) and the CUDA-graph trees of this thread."""
    torch._dynamo.reset()
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):  # private API: present on the releases we test
            from torch._inductor import cudagraph_trees

            cudagraph_trees.reset_cudagraph_trees()


class CompiledStep:
    """The compiled passes of one trial: ``forward(x)`` (the model) and ``forward_and_loss(x,
    targets, indices)`` (model, float32 cast and loss as one function).

    ``num_classes``: the width of the ranked scores, ``scores_dtype`` their dtype (float32, or
    float64 for a float64 model). ``autocast()`` gives the trainer's mixed-precision region
    (entered inside the training function); ``cudagraphs``: compiled with
    ``mode="reduce-overhead"`` (CUDA graphs), whose outputs are buffers overwritten by the next
    replay, so what the trainer keeps is cloned.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss: SetValuedLoss,
        num_classes: int,
        autocast: Callable[[], AbstractContextManager[Any]],
        cudagraphs: bool,
        scores_dtype: torch.dtype = torch.float32,
    ):
        release_compiled()  # nothing of an earlier cell in this worker
        self.model, self.loss, self.num_classes = model, loss, int(num_classes)
        self.autocast, self.cudagraphs, self.scores_dtype = autocast, cudagraphs, scores_dtype
        options: dict[str, Any] = {"mode": "reduce-overhead" if cudagraphs else None}
        if backend is not None:
            options = {"backend": backend}
        self.forward = torch.compile(self._model_forward, **options)
        self._train = torch.compile(self._train_forward, **options)

    def _model_forward(self, x: torch.Tensor) -> Any:
        return self.model(x)

    def _train_forward(
        self, x: torch.Tensor, targets: torch.Tensor, indices: torch.Tensor, probe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with self.autocast():
            output = self.model(x)
        output = to_float32(output)  # the loss is computed in float32 (a float64 model's in float64)
        scores = self.loss.prediction_scores(output)
        watched = scores + probe
        if isinstance(output, TwoHeadOutput):
            output = TwoHeadOutput(*(watched if t is scores else t for t in output))
        else:
            output = watched
        return scores, self.loss(output, targets, indices)

    def forward_and_loss(
        self, x: torch.Tensor, targets: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One training forward: (the ranked scores, detached, whose ``.grad`` the backward pass
        of the loss fills; the loss)."""
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        probe = torch.zeros(x.shape[0], self.num_classes, dtype=self.scores_dtype, device=x.device, requires_grad=True)
        scores, loss = self._train(x, targets, indices, probe)
        scores = scores.detach()
        if self.cudagraphs:  # the graph's outputs are overwritten by its next replay
            scores, loss = scores.clone(), loss.clone()
        probe.register_post_accumulate_grad_hook(
            lambda leaf: setattr(scores, "grad", leaf.grad.clone() if self.cudagraphs else leaf.grad)
        )
        return scores, loss

    def release(self) -> None:
        """End of the trial: drop the compiled functions and everything they hold."""
        self.forward = self._train = None  # type: ignore[assignment]
        self.model = self.loss = None  # type: ignore[assignment]
        release_compiled()
