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
  per pass. ``compile: model`` runs the forward passes through ``torch.compile`` (CUDA graphs
  on CUDA); checkpoints hold the uncompiled model.
- A non-finite loss raises ``NonFiniteLossError`` with the epoch and the step.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import os
import time
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch

from setvalued.config import DEVICE_DATASETS, conformal_enabled
from setvalued.compiled_step import CompiledStep
from setvalued.conformal import ConformalMethod, conformal_metrics, set_metrics, split_calibration
from setvalued.data import build_datasets
from setvalued.data.common import DataSplits, IndexedDataset, mix_seed
from setvalued.data.device import DeviceSplit
from setvalued.losses import TwoHeadOutput, build_loss
from setvalued.metrics import (activate, avgk_set_size, avgk_set_sizes, avgk_sets, calibrate_avgk_thresholds, evaluate,
                               per_class_avgk, per_class_topk, shot_groups)
from setvalued.multilabel_metrics import multilabel_evaluate, per_class_recall
from setvalued.models import build_model
from setvalued.train_setup import (  # noqa: F401 (re-exported)
    CHECKPOINT_FORMAT, DEFAULT_CONFIG, RESUME_FREE_KEYS, _batches, _flat, _load_checkpoint, _lr_at,
    _reseed_epoch, _resolve_device, _resolve_head, resolve_config, seed_everything,
)
from setvalued.train_metrics import (  # noqa: F401 (re-exported)
    NonFiniteLossError, _RunningTrainMetrics, _count_set_sizes, _cpu_copy, _fmt_k, _improves,
    _to_float32, _watched_scores,
)

__all__ = ["fit", "resolve_config", "NonFiniteLossError", "DEFAULT_CONFIG", "CHECKPOINT_FORMAT"]


# Stream tags, so that (seed, epoch) draws for different purposes are independent.
_MODEL_STREAM, _EPOCH_STREAM, _ORDER_STREAM, _WORKER_STREAM, _CONFORMAL_STREAM, _AUGMENT_STREAM = 11, 12, 13, 14, 15, 16


# ---------------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------------

class _Trial:
    """State of one ``fit`` call; methods are the steps of the protocol."""

    def __init__(self, cfg: dict[str, Any], seed: int):
        self.cfg, self.seed = cfg, seed
        self.device = _resolve_device(str(cfg["device"]))
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        seed_everything(seed)
        self.data: DataSplits = build_datasets(cfg["data"], seed)
        params = {k: v for k, v in cfg["loss"].items() if k != "name"}
        self.loss = build_loss(cfg["loss"]["name"], **params, class_counts=list(self.data.class_counts),
                               num_classes=self.data.num_classes, num_examples=len(self.data.train))
        head = _resolve_head(cfg["model"].get("head", "auto"), self.loss)
        seed_everything(mix_seed(seed, _MODEL_STREAM))
        self.model = build_model(cfg["model"], self.data.num_classes, self.data.input_shape, head)
        self.model.to(self.device)
        self.loss.to(self.device)
        #: the splits held on the training device (``data.placement``), or None: DataLoader batches
        self.on_device = self._device_splits()
        #: the module that runs the forward passes: the model, or the model under torch.compile
        #: (``compile: model``); its parameters are the model's, so checkpoints hold the model
        self.forward, self.cudagraphs = self._compiled_forward()
        #: multi-hot targets (multi-label synthetic data): the multi-label metrics, no top-K
        self.multi_label = self.data.train.targets.dim() == 2
        #: (calibration, validation) indices of the validation set when conformal sets are asked for
        self.conformal_split = self._conformal_split() if conformal_enabled(cfg["eval"]) else None

        o = cfg["optim"]
        groups = [{"params": [p for p in self.model.parameters() if p.requires_grad],
                   "weight_decay": o["weight_decay"], "lr_multiplier": 1.0}]
        loss_params = [p for p in self.loss.parameters() if p.requires_grad]
        if loss_params:
            groups.append({"params": loss_params, "weight_decay": 0.0,
                           "lr_multiplier": float(getattr(self.loss, "lr_multiplier", 1.0))})
        self.optimizer = torch.optim.SGD(groups, lr=o["lr"], momentum=o["momentum"], nesterov=o["nesterov"])

        self.amp_dtype = None
        if self.device.type == "cuda" and cfg["amp"]:
            self.amp_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        self.scaler = torch.amp.GradScaler("cuda") if self.amp_dtype == torch.float16 else None

        self.history: list[dict[str, float]] = []
        self.best: dict[str, Any] | None = None
        self.start_epoch = 0

    def _device_splits(self) -> dict[str, DeviceSplit] | None:
        """The train, val and test splits on the training device when ``data.placement`` says so
        (auto: for the in-memory sets when there are no loader workers); the training split of an
        augmented set is held as uint8 and augmented a batch at a time (``BatchAugmentation``)."""
        d = self.cfg["data"]
        placement = d["placement"]
        if placement == "auto":
            placement = "device" if d["name"] in DEVICE_DATASETS and int(d["num_workers"]) == 0 else "loader"
        if placement == "loader":
            return None
        splits = {}
        for ds in self.data:
            augmentation = getattr(ds, "batch_augmentation", None)
            if not (getattr(ds, "supports_batches", False) or augmentation is not None):
                raise ValueError(f"data.placement: device needs in-memory splits; the {ds.split} split of "
                                 f"{d['name']!r} has a per-image transform without a batched form")
            splits[ds.split] = DeviceSplit(ds.inputs, ds.targets, self.device, augmentation)
        return splits

    def _compiled_forward(self) -> tuple[torch.nn.Module, bool]:
        """The forward module of ``compile`` and whether it runs under CUDA graphs (whose
        outputs are reused buffers: the trainer copies what it keeps)."""
        #: the compiled passes (``setvalued.compiled_step``): training runs model and loss as one function
        self.compiled: CompiledStep | None = None
        if self.cfg["compile"] == "none":
            return self.model, False
        cudagraphs = self.device.type == "cuda"
        self.compiled = CompiledStep(self.model, self.loss, self.data.num_classes, self._autocast, cudagraphs)
        return self.compiled.forward, cudagraphs

    def _run_model(self, x: torch.Tensor) -> Any:
        """One forward pass of the (compiled) model, its output owned by the caller."""
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with self._autocast():
            output = self.forward(x)
        if self.cudagraphs:  # the graph's output buffers are overwritten by its next replay
            output = TwoHeadOutput(*(t.clone() for t in output)) if isinstance(output, TwoHeadOutput) else output.clone()
        return output

    def _conformal_split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The labelled calibration part of the validation set (its labels serve the conformal
        calibration only) and the rest (checkpoint selection, average-K thresholds), drawn from
        the trial seed."""
        fraction = self.cfg["eval"]["conformal_calibration_fraction"]
        try:
            return split_calibration(len(self.data.val), fraction, mix_seed(self.seed, _CONFORMAL_STREAM))
        except ValueError as err:
            raise ValueError(f"config eval.conformal_calibration_fraction={fraction!r}: {err} "
                             f"({len(self.data.val)} validation examples)") from None

    # -- forward passes ------------------------------------------------------------------------
    def _autocast(self):
        """Mixed precision on CUDA; with it off, no autocast region at all (entering even a
        disabled one costs microseconds, a few percent of a small model's training step)."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=self.amp_dtype)

    @torch.no_grad()
    def predict(self, ds: IndexedDataset) -> torch.Tensor:
        """Float32 CPU scores (n, L) that the metrics rank, in the order of ``ds``, at the batch
        size ``eval.batch_size``; the scores stay on the device until the last batch (one copy
        back per pass, no host read per batch)."""
        self.model.eval()
        order = torch.arange(len(ds))
        bs = int(self.cfg["eval"]["batch_size"])
        held = self.on_device[ds.split] if self.on_device is not None and ds.split in self.on_device else None
        if held is not None and held.augmentation is None:
            batches = held.batches(order, bs)
        else:
            batches = _batches(ds, order, bs, int(self.cfg["data"]["num_workers"]), self.device, 0)
        out = []
        for x, _, _ in batches:
            output = self._run_model(x.to(self.device, non_blocking=True))
            out.append(self.loss.prediction_scores(_to_float32(output)).float())
        return torch.cat(out).cpu()

    def metrics_of(self, scores: torch.Tensor, targets: torch.Tensor,
                   thresholds: Mapping[float, float] | None) -> dict[str, float]:
        """``evaluate`` of the top-K metrics on the raw scores and of the average-K metrics on the
        activated scores (the thresholds live on the softmax or sigmoid scale: the thesis
        thresholds softmax scores, Eq. 5.16, ``eval.avgk_activation`` may choose sigmoid;
        ranking raw scores avoids ties from saturated sigmoids)."""
        e = self.cfg["eval"]
        counts, shots, bins = self.data.class_counts, tuple(e["shot_thresholds"]), tuple(e["count_bins"])
        if self.multi_label:
            return multilabel_evaluate(scores, targets, e["ks"], counts, shots)
        out = evaluate(scores, targets, e["ks"], counts, None, shots, bins)
        if thresholds:
            out.update(evaluate(activate(scores, e["avgk_activation"]), targets, [], counts, thresholds, shots,
                                bins))
        return out

    # -- one epoch -------------------------------------------------------------------------------
    def train_epoch(self, epoch: int) -> dict[str, float]:
        """Train one epoch: its running training metrics, learning rate and time."""
        lr = self._set_learning_rate(epoch)
        batches = self._epoch_batches(epoch)
        running = self._start_training(epoch)
        start = time.perf_counter()
        self._train_on(batches, running)
        metrics = running.summary(len(self.data.train))
        metrics.update({"lr": lr, "epoch_time_s": time.perf_counter() - start})
        return metrics

    def _start_training(self, epoch: int) -> _RunningTrainMetrics:
        """Model and loss in training mode; the epoch's running metrics."""
        self.model.train()
        self.loss.train()
        ks = [] if self.multi_label else [k for k in self.cfg["eval"]["ks"] if k <= self.data.num_classes]
        return _RunningTrainMetrics(epoch, ks, self.device)

    def _train_on(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                  running: _RunningTrainMetrics) -> int:
        """Train on ``batches`` as an epoch does (fetch, copy to the device, step, running
        metrics); returns the number of steps. ``probe`` times the same loop."""
        steps = 0
        for batch in batches:
            x, y, idx = (t.to(self.device, non_blocking=True) for t in batch)
            loss, scores = self._train_step(x, y, idx)
            running.add(loss, scores, y)
            steps += 1
        return steps

    def _set_learning_rate(self, epoch: int) -> float:
        """Set the epoch's step-decayed rate on every parameter group (times the group's
        ``lr_multiplier``); returns the base rate."""
        o = self.cfg["optim"]
        lr = _lr_at(o["lr"], o["gamma"], o["milestones"], epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_multiplier", 1.0)
        return lr

    def _epoch_batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Re-seed every generator from (seed, epoch) and return the epoch's training batches,
        in an order drawn from (seed, epoch): an epoch depends only on the state at its start."""
        _reseed_epoch(mix_seed(self.seed, epoch, _EPOCH_STREAM))
        order_gen = torch.Generator()
        order_gen.manual_seed(mix_seed(self.seed, epoch, _ORDER_STREAM))
        order = torch.randperm(len(self.data.train), generator=order_gen)
        if self.on_device is not None:
            augment_gen = torch.Generator(device=self.device)
            augment_gen.manual_seed(mix_seed(self.seed, epoch, _AUGMENT_STREAM))
            return self.on_device["train"].batches(order, self.cfg["optim"]["batch_size"], augment_gen)
        return _batches(self.data.train, order, self.cfg["optim"]["batch_size"],
                        int(self.cfg["data"]["num_workers"]), self.device,
                        mix_seed(self.seed, epoch, _WORKER_STREAM))

    def _train_step(self, x: torch.Tensor, y: torch.Tensor,
                    idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward, loss, backward and optimizer step on one batch. Returns the loss and the
        scores that the metrics rank, their ``.grad`` kept (None when the output has none)."""
        if self.compiled is not None:  # model, float32 cast and loss: one compiled function
            scores, loss = self.compiled.forward_and_loss(x, y, idx)
        else:
            output = _to_float32(self._run_model(x))  # the loss is computed in float32
            scores = _watched_scores(output, self.loss)
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

    def validate(self) -> tuple[dict[str, float], dict[float, float]]:
        start = time.perf_counter()
        scores, targets = self.predict(self.data.val), self.data.val.targets
        if self.conformal_split is not None:  # the calibration part's labels are for conformal only
            scores, targets = scores[self.conformal_split[1]], targets[self.conformal_split[1]]
        e = self.cfg["eval"]
        thresholds = {}
        if e["avgk"]:
            thresholds = calibrate_avgk_thresholds(activate(scores, e["avgk_activation"]), list(e["avgk"]))
        metrics = {f"val/{k}": v for k, v in self.metrics_of(scores, targets, thresholds).items()}
        for k, t in thresholds.items():
            metrics[f"val/avg{_fmt_k(k)}_threshold"] = float(t)
        metrics["eval_time_s"] = time.perf_counter() - start
        return metrics, thresholds

    # -- checkpoints -----------------------------------------------------------------------------
    def state(self, epoch: int) -> dict[str, Any]:
        """Everything needed to continue after ``epoch`` (CPU tensors, ``torch.save``-able)."""
        return {
            "format": CHECKPOINT_FORMAT,
            "epoch": epoch,
            "seed": self.seed,
            "config": copy.deepcopy(self.cfg),
            "model": _cpu_copy(self.model.state_dict()),
            "loss": _cpu_copy(self.loss.state_dict()),
            "optimizer": _cpu_copy(self.optimizer.state_dict()),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "best": _cpu_copy(self.best),
            "history": copy.deepcopy(self.history),
        }

    def restore(self, state: dict[str, Any]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"checkpoint was taken with seed {state['seed']}, not {self.seed}")
        mine, theirs = _flat(self.cfg), _flat(state["config"])
        differing = sorted(k for k in set(mine) | set(theirs)
                           if k not in RESUME_FREE_KEYS and mine.get(k, "<missing>") != theirs.get(k, "<missing>"))
        if differing:
            raise ValueError("checkpoint config differs from this config at: " + ", ".join(
                f"{k} ({theirs.get(k, '<missing>')!r} vs {mine.get(k, '<missing>')!r})" for k in differing))
        self.model.load_state_dict(state["model"])
        self.loss.load_state_dict(state["loss"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.best = copy.deepcopy(state["best"])
        self.history = copy.deepcopy(state["history"])
        self.start_epoch = int(state["epoch"]) + 1

    # -- the whole run ---------------------------------------------------------------------------
    def run(self, on_epoch: Callable[[int, dict, dict], Any] | None) -> dict[str, Any]:
        e = self.cfg["eval"]
        selection, maximize = e["selection"], e["selection_mode"] == "max"
        for epoch in range(self.start_epoch, self.cfg["epochs"]):
            metrics = {"epoch": epoch}
            metrics.update(self.train_epoch(epoch))
            val_metrics, thresholds = self.validate()
            metrics.update(val_metrics)
            if selection not in metrics:
                available = sorted(k for k in metrics if k.startswith("val/"))
                raise ValueError(f"eval.selection {selection!r} is not a validation metric of this run; "
                                 f"available: {', '.join(available)}")
            value = metrics[selection]
            if _improves(value, None if self.best is None else self.best["value"], maximize):
                self.best = {"epoch": epoch, "value": float(value), "thresholds": dict(thresholds),
                             "model": _cpu_copy(self.model.state_dict())}
            self.history.append(metrics)
            if on_epoch is not None:
                on_epoch(epoch, dict(metrics), self.state(epoch))
        return self.test()

    def test(self) -> dict[str, Any]:
        """Evaluate the selected checkpoint once on the test set, with its thresholds."""
        self.model.load_state_dict(self.best["model"])
        scores = self.predict(self.data.test)
        targets = self.data.test.targets
        thresholds = self.best["thresholds"]
        test = self.metrics_of(scores, targets, thresholds)
        if self.conformal_split is not None:
            test.update(self.conformal_test(scores, targets, thresholds))
        L = self.data.num_classes
        per_class: dict[str, list] = {
            "class": list(range(L)),
            "name": list(self.data.class_names),
            "train_count": [int(c) for c in self.data.class_counts],
            "test_count": (targets.sum(dim=0) if self.multi_label else torch.bincount(targets, minlength=L)).tolist(),
        }
        groups = shot_groups(self.data.class_counts, tuple(self.cfg["eval"]["shot_thresholds"]))
        per_class["shot"] = [next(g for g, mask in groups.items() if bool(mask[c])) for c in range(L)]

        def rates(hits: torch.Tensor, counts: torch.Tensor) -> list[float]:
            return [float(h) / float(c) if c > 0 else float("nan") for h, c in zip(hits.tolist(), counts.tolist())]

        for k in self.cfg["eval"]["ks"]:
            if k <= L and self.multi_label:
                per_class[f"rec{k}"] = rates(*per_class_recall(scores, targets, k))
            elif k <= L:
                per_class[f"top{k}"] = rates(*per_class_topk(scores, targets, k, L))
        set_sizes: dict[str, list] = {"avgk": [], "shot": [], "size": [], "count": []}
        if thresholds:
            probs = activate(scores, self.cfg["eval"]["avgk_activation"])
            shot_of_example = [per_class["shot"][c] for c in targets.tolist()]
            for k, t in thresholds.items():
                per_class[f"avg{_fmt_k(k)}"] = rates(*per_class_avgk(probs, targets, t, L))
                _count_set_sizes(set_sizes, _fmt_k(k), avgk_set_sizes(probs, t).tolist(), shot_of_example)
        return {
            "best_epoch": int(self.best["epoch"]),
            "best_val": float(self.best["value"]),
            "test": test,
            "per_class": per_class,
            "history": copy.deepcopy(self.history),
            "thresholds": {_fmt_k(k): float(t) for k, t in thresholds.items()},
            "set_sizes": set_sizes if set_sizes["count"] else None,
            "selection": self.cfg["eval"]["selection"],
            "device": str(self.device),
            # the selected checkpoint's model and two test inputs (for an MLflow model)
            "model": self.model,
            "input_example": torch.stack([self.data.test[i][0] for i in range(min(2, len(self.data.test)))]),
        }

    def conformal_test(self, scores: torch.Tensor, targets: torch.Tensor,
                       thresholds: Mapping[float, float]) -> dict[str, float]:
        """The conformal baselines on the test set of the selected checkpoint ([Gar23] §2.2.2;
        ``setvalued.conformal.conformal_metrics``): calibrated on the labelled calibration part of
        the validation set, at every level of ``eval.conformal_alphas`` and, with
        ``eval.conformal_match_avgk``, at the mean set size that each average-K threshold gives on the
        rest of the validation set (the data it was calibrated on, without labels), beside the
        shot-group set sizes of the average-K sets (``few/avg5_size``). Conformal scores are on
        softmax probabilities (the thesis's ``1 - p_y``); average-K sets on ``eval.avgk_activation``."""
        e = self.cfg["eval"]
        counts, shots = self.data.class_counts, tuple(e["shot_thresholds"])
        calibration, rest = self.conformal_split
        val_scores, val_targets = self.predict(self.data.val), self.data.val.targets
        val_probs = activate(val_scores, "softmax")
        out: dict[str, float] = {}
        matched: dict[str, float] = {}
        if e["conformal_match_avgk"]:
            avgk_val, avgk_test = (activate(s, e["avgk_activation"]) for s in (val_scores[rest], scores))
            for k, threshold in thresholds.items():
                name = f"avg{_fmt_k(k)}"
                matched[name] = avgk_set_size(avgk_val, threshold)
                sizes = set_metrics(avgk_sets(avgk_test, threshold), targets, name, counts, shots)
                out.update({key: value for key, value in sizes.items() if key.count("/") == 1 and key.endswith("_size")})
        methods = [ConformalMethod(score, mondrian) for score in e["conformal_scores"] for mondrian in e["conformal_mondrian"]]
        out.update(conformal_metrics(val_probs[calibration], val_targets[calibration], activate(scores, "softmax"), targets,
                                     methods, e["conformal_alphas"], matched, size_probs=val_probs[rest],
                                     class_counts=counts, shot_thresholds=shots))
        return out


def fit(config: Mapping[str, Any], seed: int, on_epoch: Callable[[int, dict, dict], Any] | None = None,
        checkpoint: Mapping[str, Any] | str | os.PathLike | None = None) -> dict[str, Any]:
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
    trial = _Trial(cfg, int(seed))
    try:
        if checkpoint is not None:
            trial.restore(_load_checkpoint(checkpoint))
        return trial.run(on_epoch)
    finally:  # a warm worker keeps no compiled graph of this trial (setvalued.compiled_step)
        if trial.compiled is not None:
            trial.compiled.release()


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
    trial = _Trial(resolve_config(config), int(seed))
    setup_s = time.perf_counter() - start

    def sync() -> None:
        if trial.device.type == "cuda":
            torch.cuda.synchronize(trial.device)

    running = trial._start_training(0)
    batches = iter(trial._epoch_batches(0))
    began = time.perf_counter()
    trial._train_on(itertools.islice(batches, 1), running)  # warm-up, untimed
    sync()
    warm_up_s = time.perf_counter() - began
    began = time.perf_counter()
    timed = trial._train_on(itertools.islice(batches, steps), running)
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
        for x, _, _ in _batches(trial.data.val, torch.arange(prefix), eval_batch,
                                int(trial.cfg["data"]["num_workers"]), trial.device, 0):
            trial._run_model(x.to(trial.device, non_blocking=True))
    sync()
    per_example = (time.perf_counter() - began) / max(prefix, 1)
    val_s = per_example * n_val
    if trial.compiled is not None:
        trial.compiled.release()
    return {"setup_s": setup_s, "step_s": step_s, "steps_per_epoch": float(steps_per_epoch),
            "val_s": val_s, "test_s": per_example * len(trial.data.test),
            "epoch_s": steps_per_epoch * step_s + val_s}
