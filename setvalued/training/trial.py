"""The training core: one call of ``fit`` is one trial (one config, one seed).

``fit(config, seed, on_epoch=None, checkpoint=None) -> dict`` (docs/interfaces.md section 4)
follows the protocol of the papers' experiments (Garcin, Servajean, Joly, Salmon, ICML 2022,
Section 4, and their code github.com/garcinc/noised-topk; Garcin et al., "A two-head loss
function for deep average-K classification", arXiv:2303.18118; C. Garcin's thesis, 2023,
Sections 4.4 and 5.6):

- SGD with Nesterov momentum and weight decay on the model's and the loss's parameters
  (a loss's own parameters, ROLE's label estimates, get ``lr * loss.lr_multiplier`` and no
  weight decay); the learning rate is multiplied by ``gamma`` at the start of every
  0-indexed epoch listed in ``optim.milestones`` (the authors' code decays at the start
  of the 0-indexed epochs it is given, ``--lr_decay 151 226`` where the text says 150 and
  225: ``milestones: [151, 226]`` here).
- Every epoch: train, then score the validation set, calibrate the average-K thresholds
  on it (thesis Algorithm 1) and compute ``setvalued.metrics.evaluate``; the checkpoint
  with the best ``eval.selection`` metric is kept (the papers' "early stopping" is this
  checkpoint selection) with its thresholds, and the test set is evaluated once, on it,
  with those thresholds (thesis Section 5.6 and Algorithm 1).
- ``train/top{k}`` for every k of ``eval.ks``: the running top-k accuracy on the training
  batches as they are trained on (augmented, train mode, the weights of each step), the
  "training accuracy" of [BZK18] Table 6 and Figure 2a at no extra forward pass.
- ``grad_nonzero``: the mean number of non-zero coordinates of dLoss/dscores per training
  example (the gradient-sparsity figure: Garcin et al. 2022, Figure 2; thesis Figure 4.2),
  read from the gradient of the score tensor that the metrics rank; ``grad_nonzero_active``
  is the mean over the examples whose gradient is not zero (the papers do not say whether
  those examples count in their average, so both are logged).
- Mixed precision on CUDA only (bfloat16 where supported, else float16 with a gradient
  scaler), with the loss computed in float32; ``amp: false`` turns it off.
- Determinism and resume: the model is initialised from the trial seed, and every epoch
  re-seeds Python, NumPy and torch (CPU and CUDA) from (seed, epoch) and draws its batch
  order from a generator seeded by (seed, epoch). An epoch therefore depends only on the
  state at its start, so ``fit(config, seed, checkpoint=state)`` with the ``state`` handed
  to ``on_epoch`` after epoch e continues exactly as the uninterrupted run (bit for bit on
  CPU; on CUDA up to the non-determinism of cuDNN kernels).
- Data on the device (``data.placement``; issue #24, docs/throughput.md): the in-memory sets
  are held on the training device and CIFAR's augmentation is applied to whole batches there
  (``setvalued.data.device``), its draws from a generator seeded by (seed, epoch), so resume
  stays exact; validation and test run at ``eval.batch_size`` and copy their scores back once
  per pass. ``compile: model`` compiles the training step's model forward, float32 cast and
  loss as one function and the evaluation's forward (``setvalued.training.compiled_step``; CUDA graphs
  on CUDA), released when the trial ends; checkpoints hold the uncompiled model.
- A non-finite loss raises ``NonFiniteLossError`` with the epoch and the step.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import numpy as np
import torch

from setvalued.config import DATASET_NAMES, DEVICE_DATASETS, conformal_enabled
from setvalued.data import build_datasets
from setvalued.data.common import DataSplits, TensorSplit, mix_seed
from setvalued.data.device import DeviceSplit
from setvalued.losses import build_loss
from setvalued.metrics import split_calibration
from setvalued.models import build_model
from setvalued.training.checkpoint import CHECKPOINT_FORMAT, check_resumable, keep_if_best, load_checkpoint, trial_state
from setvalued.training.evaluation import Evaluation
from setvalued.training.running_metrics import EpochSummary, NonFiniteLossError, RunningTrainMetrics
from setvalued.training.setup import (
    DEFAULT_CONFIG,
    reseed_epoch,
    resolve_config,
    resolve_device,
    resolve_head,
    seed_everything,
    split_batches,
)
from setvalued.training.step import Batch, TrainingStep

__all__ = ["fit", "probe", "resolve_config", "NonFiniteLossError", "DEFAULT_CONFIG", "CHECKPOINT_FORMAT"]


# Stream tags, so that (seed, epoch) draws for different purposes are independent.
MODEL_STREAM, EPOCH_STREAM, ORDER_STREAM, WORKER_STREAM, CONFORMAL_STREAM, AUGMENT_STREAM = 11, 12, 13, 14, 15, 16


# ---------------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------------


class Trial:
    """One trial (one config, one seed): its data, loss and model, and the epoch loop over its
    parts: the step (``train_step``), the evaluation (``train_evaluation``) and the checkpoint
    state (``train_checkpoint``). A fused array (``setvalued.fused``) runs N of these with one
    step for all."""

    def __init__(self, cfg: dict[str, Any], seed: int, data_of: Trial | None = None):
        """``data_of``: a trial of the same config whose splits (and their device copies) this
        one shares, for data that does not depend on the seed (``data.seed_free``; the members
        of a fused array)."""
        self.cfg, self.seed = cfg, seed
        self.device = resolve_device(str(cfg["device"]))
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        seed_everything(seed)
        self.data: DataSplits = data_of.data if data_of is not None else build_datasets(cfg["data"], seed)
        params = {k: v for k, v in cfg["loss"].items() if k != "name"}
        self.loss = build_loss(
            cfg["loss"]["name"],
            **params,
            class_counts=list(self.data.class_counts),
            num_classes=self.data.num_classes,
            num_examples=len(self.data.train),
        )
        head = resolve_head(cfg["model"].get("head", "auto"), self.loss)
        seed_everything(mix_seed(seed, MODEL_STREAM))
        self.model = build_model(cfg["model"], self.data.num_classes, self.data.input_shape, head)
        self.model.to(self.device)
        self.loss.to(self.device)
        #: the splits held on the training device (``data.placement``), or None: DataLoader batches
        self.on_device: dict[str, DeviceSplit] | None = (
            data_of.on_device if data_of is not None else self._device_splits()
        )
        self.step = TrainingStep(cfg, self.device, self.model, self.loss, self.data.num_classes)
        #: (calibration, validation) indices of the validation set when conformal sets are asked for
        self.conformal_split = self._conformal_split() if conformal_enabled(cfg["eval"]) else None
        self.evaluation = Evaluation(
            cfg, self.data, self.device, self.on_device, self.loss, self.step.run_model, self.conformal_split
        )
        self.multi_label = self.evaluation.multi_label

        self.history: list[dict[str, float]] = []
        self.best: dict[str, Any] | None = None
        self.start_epoch = 0

    def _device_splits(self) -> dict[str, DeviceSplit] | None:
        """The train, val and test splits on the training device when ``data.placement`` says so
        (auto: for the in-memory sets when there are no loader workers); the training split of an
        augmented set is held as uint8 and augmented a batch at a time (``BatchAugmentation``)."""
        d = self.cfg["data"]
        placement = d["placement"]
        if placement == "auto":  # a plugin's data set: device when its splits are in memory
            in_memory = (
                d["name"] in DEVICE_DATASETS
                if d["name"] in DATASET_NAMES
                else all(getattr(ds, "supports_batches", False) for ds in self.data)
            )
            placement = "device" if in_memory and int(d["num_workers"]) == 0 else "loader"
        if placement == "loader":
            return None
        splits = {}
        for ds in self.data:
            augmentation = getattr(ds, "batch_augmentation", None)
            if not (getattr(ds, "supports_batches", False) or augmentation is not None):
                raise ValueError(
                    f"data.placement: device needs in-memory splits; the {ds.split} split of "
                    f"{d['name']!r} has a per-image transform without a batched form"
                )
            splits[ds.split] = DeviceSplit(cast(TensorSplit, ds).inputs, ds.targets, self.device, augmentation)
        return splits

    def _conformal_split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The labelled calibration part of the validation set (its labels serve the conformal
        calibration only) and the rest (checkpoint selection, average-K thresholds), drawn from
        the trial seed."""
        fraction = self.cfg["eval"]["conformal_calibration_fraction"]
        try:
            return split_calibration(len(self.data.val), fraction, mix_seed(self.seed, CONFORMAL_STREAM))
        except ValueError as err:
            raise ValueError(
                f"config eval.conformal_calibration_fraction={fraction!r}: {err} "
                f"({len(self.data.val)} validation examples)"
            ) from None

    # -- one epoch -------------------------------------------------------------------------------
    def train_epoch(self, epoch: int) -> dict[str, float]:
        """Train one epoch: its running training metrics, learning rate and time."""
        lr = self.step.set_learning_rate(epoch)
        batches = self.epoch_batches(epoch)
        running = self.start_training(epoch)
        start = time.perf_counter()
        self.step.train_on(batches, running)
        return self.training_metrics(running, lr, time.perf_counter() - start)

    def start_training(self, epoch: int) -> RunningTrainMetrics:
        """Model and loss in training mode; the epoch's running metrics."""
        self.step.start_training()
        ks = [] if self.multi_label else [k for k in self.cfg["eval"]["ks"] if k <= self.data.num_classes]
        return RunningTrainMetrics(epoch, ks, self.device)

    def training_metrics(self, running: EpochSummary, lr: float, seconds: float) -> dict[str, float]:
        """The epoch's training metrics, its base learning rate and time."""
        metrics = running.summary(len(self.data.train))
        metrics.update({"lr": lr, "epoch_time_s": seconds})
        return metrics

    def epoch_batches(self, epoch: int) -> Iterator[Batch]:
        """Re-seed every generator from (seed, epoch) and return the epoch's training batches,
        in an order drawn from (seed, epoch): an epoch depends only on the state at its start."""
        order = self.epoch_order(epoch)
        if self.on_device is not None:
            augment_gen = torch.Generator(device=self.device)
            augment_gen.manual_seed(mix_seed(self.seed, epoch, AUGMENT_STREAM))
            return self.on_device["train"].batches(order, self.cfg["optim"]["batch_size"], augment_gen)
        return split_batches(
            self.data.train,
            order,
            self.cfg["optim"]["batch_size"],
            int(self.cfg["data"]["num_workers"]),
            self.device,
            mix_seed(self.seed, epoch, WORKER_STREAM),
        )

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """Re-seed every generator from (seed, epoch) and draw the epoch's order of the training
        examples from (seed, epoch) (``epoch_batches`` cuts it into batches)."""
        reseed_epoch(mix_seed(self.seed, epoch, EPOCH_STREAM))
        order_gen = torch.Generator()
        order_gen.manual_seed(mix_seed(self.seed, epoch, ORDER_STREAM))
        return torch.randperm(len(self.data.train), generator=order_gen)

    def close_epoch(
        self,
        epoch: int,
        metrics: dict[str, float],
        on_epoch: Callable[[int, dict[str, Any], dict[str, Any]], Any] | None,
        optimizer_state: Mapping[str, Any] | None = None,
        val_scores: torch.Tensor | None = None,
        val_seconds: float = 0.0,
    ) -> dict[str, float]:
        """Validate after an epoch's training (``metrics``), keep the best checkpoint, record the
        epoch and hand it with the state to ``on_epoch``; returns the epoch's metrics.
        ``val_scores``: the model's validation scores when already computed (a fused array's
        members, scored together, in ``val_seconds`` each)."""
        e = self.cfg["eval"]
        selection, maximize = e["selection"], e["selection_mode"] == "max"
        val_metrics, thresholds = self.evaluation.validate(self.model, val_scores, val_seconds)
        metrics.update(val_metrics)
        if selection not in metrics:
            available = sorted(k for k in metrics if k.startswith("val/"))
            raise ValueError(
                f"eval.selection {selection!r} is not a validation metric of this run; "
                f"available: {', '.join(available)}"
            )
        self.best = keep_if_best(self.best, epoch, metrics[selection], thresholds, self.model, maximize)
        self.history.append(metrics)
        if on_epoch is not None:
            on_epoch(epoch, dict(metrics), self.state(epoch, optimizer_state))
        return metrics

    # -- checkpoints -----------------------------------------------------------------------------
    def state(self, epoch: int, optimizer_state: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Everything needed to continue after ``epoch`` (``train_checkpoint.trial_state``);
        ``optimizer_state`` in place of the step's optimizer's (a member of a fused array)."""
        if optimizer_state is None:
            optimizer_state = self.step.optimizer.state_dict()
        return trial_state(
            self.cfg,
            self.seed,
            epoch,
            self.model,
            self.loss,
            optimizer_state,
            self.step.scaler,
            self.best,
            self.history,
        )

    def restore(self, state: dict[str, Any]) -> None:
        """Continue after the epoch of ``state``."""
        self.restore_all_but_optimizer(state)
        self.step.optimizer.load_state_dict(state["optimizer"])
        if self.step.scaler is not None and state.get("scaler"):
            self.step.scaler.load_state_dict(state["scaler"])

    def restore_all_but_optimizer(self, state: dict[str, Any]) -> None:
        """``restore`` less the optimizer and scaler (a fused array restores those itself)."""
        check_resumable(self.cfg, self.seed, state)
        self.model.load_state_dict(state["model"])
        self.loss.load_state_dict(state["loss"])
        self.best = copy.deepcopy(state["best"])
        self.history = copy.deepcopy(state["history"])
        self.start_epoch = int(state["epoch"]) + 1

    # -- the whole run ---------------------------------------------------------------------------
    def run(self, on_epoch: Callable[[int, dict[str, Any], dict[str, Any]], Any] | None) -> dict[str, Any]:
        for epoch in range(self.start_epoch, self.cfg["epochs"]):
            metrics: dict[str, float] = {"epoch": epoch}
            metrics.update(self.train_epoch(epoch))
            self.close_epoch(epoch, metrics, on_epoch)
        return self.test()

    def test(self, scores: torch.Tensor | None = None) -> dict[str, Any]:
        """Evaluate the selected checkpoint once on the test set, with its thresholds
        (``scores``: its test scores when already computed)."""
        return self.evaluation.test(self.model, cast(dict[str, Any], self.best), self.history, scores)


def fit(
    config: Mapping[str, Any],
    seed: int,
    on_epoch: Callable[[int, dict[str, Any], dict[str, Any]], Any] | None = None,
    checkpoint: Mapping[str, Any] | str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Train one trial and evaluate its selected checkpoint on the test set.

    ``on_epoch(epoch, metrics, state)`` is called after every epoch; ``state`` is a
    ``torch.save``-able dict, and ``fit(config, seed, checkpoint=state)`` (or the path of a
    saved state) resumes after that epoch. Returns ``{"best_epoch", "best_val", "test",
    "per_class", "history", "thresholds", "selection", "device"}`` (docs/interfaces.md
    section 4; the last three are extras). Raises ``NonFiniteLossError`` when the training
    loss becomes NaN or infinite, ``ValueError`` for a bad config.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    cfg = resolve_config(config)
    trial = Trial(cfg, int(seed))
    try:
        if checkpoint is not None:
            trial.restore(load_checkpoint(checkpoint))
        return trial.run(on_epoch)
    finally:  # a warm worker keeps no compiled graph of this trial (setvalued.training.compiled_step)
        trial.step.release()


def probe(config: Mapping[str, Any], seed: int = 0, steps: int = 5) -> dict[str, float]:
    """Time a few training steps of one trial, for a cost estimate without training it.

    Builds the trial (data, model, loss: ``setup_s``), runs one untimed warm-up step and then
    ``steps`` timed ones through the epoch's own loop (``step_s``: their mean, with the batches'
    loading and the running metrics; a loss whose cost varies from batch to batch, such as
    the smooth top-k SVM's switch between its smooth and hard paths, is averaged), and times
    the evaluation on a prefix of the validation set (about ``steps`` evaluation batches),
    scaled to the whole validation (``val_s``) and test set (``test_s``). ``epoch_s`` = steps
    per epoch x ``step_s`` + ``val_s``: what ``fit`` logs as ``epoch_time_s`` plus its
    validation (``eval_time_s``).
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    start = time.perf_counter()
    trial = Trial(resolve_config(config), int(seed))
    setup_s = time.perf_counter() - start

    def sync() -> None:
        if trial.device.type == "cuda":
            torch.cuda.synchronize(trial.device)

    running = trial.start_training(0)
    batches = iter(trial.epoch_batches(0))
    began = time.perf_counter()
    trial.step.train_on(itertools.islice(batches, 1), running)  # warm-up, untimed
    sync()
    warm_up_s = time.perf_counter() - began
    began = time.perf_counter()
    timed = trial.step.train_on(itertools.islice(batches, steps), running)
    sync()
    step_s = (time.perf_counter() - began) / timed if timed else warm_up_s
    batch_size = int(trial.cfg["optim"]["batch_size"])
    steps_per_epoch = math.ceil(len(trial.data.train) / batch_size)

    eval_batch = int(trial.cfg["eval"]["batch_size"])
    n_val = len(trial.data.val)
    prefix = min(n_val, steps * eval_batch)
    trial.model.eval()
    began = time.perf_counter()
    with torch.no_grad():
        for x, _, _ in split_batches(
            trial.data.val, torch.arange(prefix), eval_batch, int(trial.cfg["data"]["num_workers"]), trial.device, 0
        ):
            trial.step.run_model(x.to(trial.device, non_blocking=True))
    sync()
    per_example = (time.perf_counter() - began) / max(prefix, 1)
    val_s = per_example * n_val
    trial.step.release()
    return {
        "setup_s": setup_s,
        "step_s": step_s,
        "steps_per_epoch": float(steps_per_epoch),
        "val_s": val_s,
        "test_s": per_example * len(trial.data.test),
        "epoch_s": steps_per_epoch * step_s + val_s,
    }
