"""The trainer: one trial of a (config, seed) cell, from its data to its test pass.

- ``trial``: ``Trial`` (data, model, loss, evaluation and checkpoints of one seed), ``fit``
  (train it, resumable) and ``probe`` (time a few steps);
- ``step``: the training step (forward, loss, backward, SGD), ``compiled_step`` the same under
  ``torch.compile``;
- ``evaluation``: validation and test passes; ``checkpoint``: the resumable state;
  ``setup``: the resolved config, devices, seeding, batches; ``running_metrics``: the
  training metrics accumulated on the device.

``setvalued.train`` is the stable path of ``fit`` that scripts and plugins name.
"""

from setvalued.training import compiled_step  # its ``backend`` is a setting (tests: aot_eager)
from setvalued.training.checkpoint import CHECKPOINT_FORMAT, load_checkpoint
from setvalued.training.evaluation import Evaluation
from setvalued.training.running_metrics import NonFiniteLossError, RunningTrainMetrics, to_float32, watched_scores
from setvalued.training.setup import DEFAULT_CONFIG, flat_config, lr_at, resolve_config, split_batches
from setvalued.training.step import Batch, TrainingStep, build_optimizer, model_inputs, set_learning_rate
from setvalued.training.trial import CONFORMAL_STREAM, Trial, fit, probe

__all__ = [
    "Batch",
    "CHECKPOINT_FORMAT",
    "CONFORMAL_STREAM",
    "DEFAULT_CONFIG",
    "Evaluation",
    "NonFiniteLossError",
    "RunningTrainMetrics",
    "Trial",
    "TrainingStep",
    "build_optimizer",
    "compiled_step",
    "fit",
    "flat_config",
    "load_checkpoint",
    "lr_at",
    "model_inputs",
    "probe",
    "resolve_config",
    "set_learning_rate",
    "split_batches",
    "to_float32",
    "watched_scores",
]
