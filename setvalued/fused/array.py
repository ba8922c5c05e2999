"""A fused array: N seeds of one config trained as one model (``fit_array``), each member the
trial of its seed.

Each member is a ``setvalued.training.Trial`` (its data, loss, model, evaluation and checkpoint
state, built from its seed exactly as its separate trial; splits that do not depend on the
seed, ``data.seed_free``, are built and held on the device once for all) and the array
replaces the step and the forward passes: one ``FusedStep`` (``setvalued.fused.step``)
forwards, computes the losses, backpropagates and updates all members at once. Per epoch, every
member sets its learning rate and draws its order (and, without shared splits, its batches
and augmentation, from (seed, epoch)) under its own random state; where the members share a
split held without a random transform, a step's batches are one gather of the members'
orders. The members' running metrics are folded together (``setvalued.fused.running_metrics``). Then
the members' validation scores come from one forward pass of all of them per batch (each
member's slice is its own model's), and every member computes its metrics and thresholds,
keeps its best checkpoint and is handed to ``on_epoch`` with its own state, in the format of
its separate trial's (a member's state resumes its separate trial and the other way round).
The test pass loads each member's selected checkpoint into its slice and scores all members
at once; each then tests with its own thresholds. A member whose loss goes non-finite fails
alone: its result is the ``NonFiniteLossError`` its trial would raise, and the others go on.

``compile: model`` compiles the stacked model's forward passes (``FusedStep``; the losses stay
eager). Not fused: float16 mixed precision (its gradient scaler would skip the step of every
member when one overflows); ``fusion_problem`` names what stops a config.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch

from setvalued.data import seed_free
from setvalued.data.common import TensorSplit
from setvalued.fused.running_metrics import FusedRunningMetrics
from setvalued.fused.step import FusedStep, RandomState, member_output, own_storage
from setvalued.losses.base import member_slices
from setvalued.training import (
    NonFiniteLossError,
    Trial,
    build_optimizer,
    load_checkpoint,
    model_inputs,
    resolve_config,
    split_batches,
    to_float32,
)

#: ``after_epoch``'s answer that stops the array after that epoch
STOP = "stop"

#: ``on_epoch(member, epoch, metrics, state)``: member is the index of the seed in ``seeds``
ArrayCallback = Callable[[int, int, dict[str, Any], dict[str, Any]], Any]


class FusionError(ValueError):
    """A config that cannot run as a fused array; the message names the model and the reason."""


class Array:
    """N members of one config, one fused step."""

    def __init__(self, cfg: dict[str, Any], seeds: Sequence[int]):
        if len(seeds) < 1 or len(set(seeds)) != len(seeds):
            raise ValueError(f"a fused array needs distinct seeds, got {list(seeds)}")
        self.cfg = cfg
        first = Trial(cfg, int(seeds[0]))
        shared = first if seed_free(cfg["data"]) else None  # one copy of the splits for all members
        self.members = [first] + [Trial(cfg, int(seed), data_of=shared) for seed in seeds[1:]]
        #: the members read one copy of the splits: a step's batches are one gather, and the
        #: evaluation passes score all members on each batch at once
        self.shared_data = shared is not None
        sizes = {len(m.data.train) for m in self.members}
        if len(sizes) > 1:
            raise FusionError(
                f"the seeds' training sets differ in size ({sorted(sizes)}); a fused array "
                f"steps on batches of the same size"
            )
        if first.step.scaler is not None:
            raise FusionError(
                f"model {cfg['model']['name']!r} cannot be fused: float16 mixed precision (no "
                f"bfloat16 on this GPU) skips every member's step when one overflows (set amp: false)"
            )
        problem = fusion_problem([m.model for m in self.members[:2]], first)  # two members show it
        if problem:
            raise FusionError(
                f"model {cfg['model']['name']!r} cannot be fused: {problem} (run it with seeds_per_trial: 1)"
            )
        self.device = first.device
        for m in self.members:  # compile: model compiles the array's stacked model, not each member's
            m.step.release()
        self.step = FusedStep(
            cfg, self.device, [m.model for m in self.members], [m.loss for m in self.members], first.step.amp_dtype
        )
        for m in self.members:  # each member's optimizer over its views: its state's format
            m.step.optimizer = build_optimizer(
                [p for p in m.model.parameters() if p.requires_grad], m.loss, cfg["optim"]
            )
        self.random_states = [RandomState(self.device) for _ in self.members]
        #: the shared training split read by one gather per step, or None (per-member batches)
        self.gather = self._shared_train_split()
        #: None while a member trains, else its result: the test pass, or the error that stopped it
        self.results: list[Any] = [None] * len(self.members)
        self.failed: list[BaseException | None] = [None] * len(self.members)

    @property
    def live(self) -> list[bool]:
        return [error is None for error in self.failed]

    def restore(self, states: Sequence[Mapping[str, Any] | None]) -> None:
        """Continue every member after the epoch of its state (all at the same epoch)."""
        epochs = {int(s["epoch"]) for s in states if s is not None}
        if len(epochs) > 1 or (epochs and any(s is None for s in states)):
            raise ValueError(
                f"the members' checkpoints are of different epochs "
                f"({[None if s is None else int(s['epoch']) for s in states]})"
            )
        if not epochs:
            return
        found = cast(Sequence[Mapping[str, Any]], states)  # none is None (checked above)
        for m, state in zip(self.members, found):
            m.restore_all_but_optimizer(dict(state))
        self.step.load_member_optimizer_states([s["optimizer"] for s in found])

    def run(self, on_epoch: ArrayCallback | None = None, after_epoch: Callable[[int], Any] | None = None) -> list[Any]:
        """Train every member to the last epoch; returns, per member, its ``fit`` result or the
        error that stopped it. ``after_epoch(epoch)`` follows the epoch's last ``on_epoch``; its
        answer ``STOP`` ends the training there (early stopping of the array's config)."""
        try:
            for epoch in range(self.members[0].start_epoch, self.cfg["epochs"]):
                if not any(self.live):
                    break
                self.train_epoch(epoch, on_epoch)
                if after_epoch is not None and after_epoch(epoch) == STOP:
                    break  # stopped as a whole: every member tests the checkpoint it selected so far
            test_scores = None
            if any(self.live) and all(m.best is not None for m, alive in zip(self.members, self.live) if alive):
                for m, alive in zip(self.members, self.live):
                    if alive:  # each member's selected checkpoint into its slice: the test pass of all at once
                        m.model.load_state_dict(cast(dict[str, Any], m.best)["model"])
                test_scores = self.predict("test")
            for i, m in enumerate(self.members):
                if self.failed[i] is None:
                    own_storage(m.model)  # the model handed back (and logged) holds this member alone
                self.results[i] = (
                    self.failed[i]
                    if self.failed[i] is not None
                    else m.test(None if test_scores is None else test_scores[i])
                )
        finally:
            self.step.release()  # compile: model leaves no graph in a warm worker
        return self.results

    def train_epoch(self, epoch: int, on_epoch: ArrayCallback | None) -> None:
        """One epoch of every live member: trained together, then validated."""
        lr, running, seconds = self.train_steps(epoch)
        self.close_epoch(epoch, lr, running, seconds, on_epoch)

    def train_steps(self, epoch: int, steps: int | None = None) -> tuple[float, FusedRunningMetrics, float]:
        """Train the epoch's batches (the first ``steps`` of them when given) of every member at
        once; returns the base learning rate, the members' running metrics and the seconds."""
        lr = self.step.set_learning_rate(epoch)
        orders, batches = [], []
        for m, rng in zip(self.members, self.random_states):
            with rng.active():
                m.step.set_learning_rate(epoch)
                if self.gather is not None:
                    orders.append(m.epoch_order(epoch))
                else:
                    batches.append(iter(m.epoch_batches(epoch)))
            m.start_training(epoch)
        first = self.members[0]
        running = FusedRunningMetrics(
            epoch,
            [] if first.multi_label else [k for k in self.cfg["eval"]["ks"] if k <= first.data.num_classes],
            self.device,
            len(self.members),
        )
        self.step.start_training()
        drawn = self._gathered(torch.stack(orders)) if self.gather is not None else self._drawn(batches)
        start = time.perf_counter()
        done = 0
        while steps is None or done < steps:
            batch = next(drawn, None)
            if batch is None:
                break
            x, y, idx = (t.to(self.device, non_blocking=True) for t in batch)
            losses, scores = self.step(x, y, idx, self.live, self.random_states)
            running.add(losses, scores, y)
            self._fail(running)
            done += 1
        return lr, running, time.perf_counter() - start

    def _gathered(self, orders: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
        """The members' batches of one epoch, each step's read in one gather from the shared
        split (``orders``: (N, n), each member's order)."""
        size = self.cfg["optim"]["batch_size"]
        inputs, targets = cast(tuple[torch.Tensor, torch.Tensor], self.gather)  # shared: set
        orders = orders.to(inputs.device)
        for start in range(0, orders.shape[1], size):
            idx = orders[:, start : start + size]
            yield inputs[idx], targets[idx], idx

    def _drawn(self, batches: list[Iterator[Any]]) -> Iterator[tuple[torch.Tensor, ...]]:
        """The members' batches of one epoch, each drawn under its member's random state
        (its loader's order and augmentation), stacked."""
        while True:
            drawn: list[Any] = []
            for it, rng in zip(batches, self.random_states):
                with rng.active():
                    drawn.append(next(it, None))
            if drawn[0] is None:
                return
            yield tuple(torch.stack([b[part] for b in drawn]) for part in range(3))

    def _shared_train_split(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (inputs, targets) tensors of the training split that every member reads without
        a random draw (shared data, held on the device without augmentation, or in memory
        without transform or workers), from which a step's batches are one gather; else None."""
        if not self.shared_data:
            return None
        first = self.members[0]
        if first.on_device is not None:
            held = first.on_device["train"]
            return None if held.augmentation is not None else (held.inputs, held.targets)
        ds = first.data.train
        if (
            getattr(ds, "supports_batches", False)
            and int(self.cfg["data"]["num_workers"]) == 0
            and getattr(ds, "transform", None) is None
        ):
            return cast(TensorSplit, ds).inputs, ds.targets
        return None

    def close_epoch(
        self, epoch: int, lr: float, running: FusedRunningMetrics, seconds: float, on_epoch: ArrayCallback | None
    ) -> None:
        """Every live member's training metrics, validation (one forward pass of the members
        together), best checkpoint and ``on_epoch``."""
        running.fold()
        self._fail(running)
        start = time.perf_counter()
        val_scores = self.predict("val")
        shared_seconds = (time.perf_counter() - start) / max(1, sum(self.live)) if val_scores is not None else 0.0
        for i, m in enumerate(self.members):
            if self.failed[i] is not None:
                continue
            metrics = self._guard(i, lambda: m.training_metrics(running.of(i), lr, seconds))
            if metrics is None:
                continue
            callback = None if on_epoch is None else (lambda e, mt, st, i=i: on_epoch(i, e, mt, st))
            # each member's eval_time_s: its share of the fused pass, and its own metrics
            m.close_epoch(
                epoch,
                {"epoch": epoch, **metrics},
                callback,
                optimizer_state=self.step.member_optimizer_state(i, m.step.optimizer),
                val_scores=None if val_scores is None else val_scores[i],
                val_seconds=shared_seconds,
            )

    @torch.no_grad()
    def predict(self, split: str) -> list[torch.Tensor] | None:
        """Every member's ``Evaluation.predict`` scores on ``split`` ("val" or "test") from one
        forward pass of the members together per batch (the split is shared, and each member's
        model is its slice of the stacked one: its scores are its own model's); None where the
        members do not share their data (each then scores on its own)."""
        if not self.shared_data:
            return None
        first = self.members[0]
        self.step.start_evaluation()
        out: list[list[torch.Tensor]] = [[] for _ in self.members]
        for x in first.evaluation.inputs(getattr(first.data, split)):
            output = to_float32(self.step.run_model(x, shared=True))
            for i, (m, part) in enumerate(zip(self.members, member_slices(output))):
                out[i].append(m.loss.prediction_scores(part).float())
        return [torch.cat(parts).cpu() for parts in out]

    def _fail(self, running: FusedRunningMetrics) -> None:
        """Members whose loss went non-finite (found at the last fold) fail alone."""
        for i, error in enumerate(running.errors):
            if error is not None and self.failed[i] is None:
                self.failed[i] = error

    def _guard(self, i: int, action: Callable[[], Any]) -> Any:
        """``action`` for member ``i``; a non-finite loss fails that member alone."""
        try:
            return action()
        except NonFiniteLossError as error:
            self.failed[i] = error
            return None


def fusion_problem(models: Sequence[torch.nn.Module], trial: Trial) -> str | None:
    """Why ``models`` cannot train as one fused model, from a one-batch probe on copies (None:
    they can, or the model fails on its own, which its trial reports): one training-mode
    forward and backward of each copy on a batch of ``trial``'s validation set, then of the
    stacked copies, whose outputs and gradients must match (relative to their norm: 1e-3).
    The probe runs in full float32 (no TensorFloat-32): on a GPU the stacked model's convolutions
    are grouped ones that cuDNN rounds to TF32 differently from the separate model's, and over a
    DenseNet's 40 layers TF32's 10-bit mantissa alone exceeds the tolerance (measured on an
    H200: every DenseNet-BC array was refused)."""
    with full_float32():
        return _probe(models, trial)


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """float32 matrix products and convolutions without TensorFloat-32 while the block runs
    (the settings in force before are restored)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _probe(models: Sequence[torch.nn.Module], trial: Trial) -> str | None:
    separate = [copy.deepcopy(m) for m in models]
    n = min(4, len(trial.data.val))
    x = next(iter(split_batches(trial.data.val, torch.arange(n), n, 0, trial.device, 0)))[0].to(trial.device)
    own = []
    try:
        for model in separate:
            model.train()
            out = model(model_inputs(x, trial.step.dtype))
            _total(out).backward()
            own.append(out)
    except Exception:  # noqa: BLE001  (not a fusion problem: the separate trial fails the same way)
        return None
    try:
        step = FusedStep(
            trial.cfg,
            trial.device,
            [copy.deepcopy(m) for m in models],
            [trial.loss] * len(models),
            None,
            compiled=False,
        )
        step.start_training()
        fused = step.run_model(torch.stack([x] * len(models)))
        cast(torch.Tensor, sum(_total(member_output(fused, i)) for i in range(len(models)))).backward()
    except Exception as error:  # noqa: BLE001  (any failure of the fused form is the reason)
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")
    for i, model in enumerate(separate):
        if not _close(own[i], member_output(fused, i)):
            return "its fused output differs from the separate model's"
        # the gradient as one vector: a coordinate that is zero in exact arithmetic (the bias
        # before a BatchNorm) is rounding noise in both forms
        pairs = [
            (name, step.params[name].grad[i], p.grad) for name, p in model.named_parameters() if p.grad is not None
        ]
        if pairs and not _near(
            torch.cat([g.flatten() for _, g, _ in pairs]), torch.cat([r.flatten() for _, _, r in pairs])
        ):
            worst = max(pairs, key=lambda t: float((t[1].double() - t[2].double()).norm()))[0]
            return f"its fused gradient differs from the separate model's (most at {worst})"
    return None


def probe_config(config: Mapping[str, Any]) -> str | None:
    """Why the trials of ``config`` cannot be fused, naming the model (None: they can): the
    one-batch probe (``fusion_problem``) on two copies of its model, built from seed 0 with its
    data. (Every config can be fused as far as the config alone tells; float16 mixed precision
    depends on the GPU and is refused by ``Array``.)"""
    cfg = resolve_config(config)
    trial = Trial(cfg, 0)
    reason = fusion_problem([trial.model, copy.deepcopy(trial.model)], trial)
    return None if reason is None else f"model {cfg['model']['name']!r} cannot be fused: {reason}"


def _total(output: Any) -> torch.Tensor:
    parts = output if isinstance(output, tuple) else (output,)
    return sum(t.float().square().mean() for t in parts)


def _close(a: Any, b: Any) -> bool:
    pairs = zip(a, b) if isinstance(a, tuple) else [(a, b)]
    return all(_near(v, u) for u, v in pairs)


def _near(value: torch.Tensor, reference: torch.Tensor) -> bool:
    """``value`` within 1e-3 of ``reference`` relative to its norm (float32 kernels of the fused
    and separate forms round apart; a gradient's small coordinates carry no signal alone)."""
    value, reference = value.double(), reference.double()
    return bool(torch.linalg.vector_norm(value - reference) <= 1e-3 * torch.linalg.vector_norm(reference) + 1e-8)


def fit_array(
    config: Mapping[str, Any],
    seeds: Sequence[int],
    on_epoch: ArrayCallback | None = None,
    checkpoints: Sequence[Mapping[str, Any] | str | None] | None = None,
    after_epoch: Callable[[int], Any] | None = None,
) -> list[Any]:
    """Train the trials of ``seeds`` (one config) as one fused array.

    ``on_epoch(member, epoch, metrics, state)`` is called after every epoch of every live
    member (``member``: the index of its seed); ``state`` is the state its separate trial
    would hand over (``fit(config, seed, checkpoint=state)`` resumes it), and
    ``checkpoints`` (one per seed, all of the same epoch) resume the array; ``after_epoch(epoch)``
    is called once every member has closed the epoch, and ``STOP`` from it ends the training
    there (each member then tests its selected checkpoint, as ``fit`` with ``epochs`` cut to
    the epochs done). Returns per seed
    the result of ``fit`` or the ``NonFiniteLossError`` that stopped that member. Raises
    ``FusionError`` when the config cannot be fused, ``ValueError`` for a bad config.
    """
    cfg = resolve_config(config)
    array = Array(cfg, [int(s) for s in seeds])
    if checkpoints is not None:
        if len(checkpoints) != len(seeds):
            raise ValueError(f"{len(checkpoints)} checkpoints for {len(seeds)} seeds")
        array.restore([None if c is None else load_checkpoint(c) for c in checkpoints])
    return array.run(on_epoch, after_epoch)
