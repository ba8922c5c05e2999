"""The GPU path without a GPU (issue #34; tests.gpu_audit): host synchronisations, each with
the project line that issued it, and kernel launches, counted on tensors that claim a device.

- every registered loss: forward on FakeTensors on "cuda" (the CUDA branches of setitem and
  indexing, which move a Python or CPU value by a blocking copy) and forward + backward on
  "meta" tensors (the autograd engine refuses fake CUDA tensors on a machine without a CUDA
  driver; the losses have no branch on the device type beyond ``fixed_shapes``, which both
  take): no host synchronisation;
- the public average-K helpers, the same;
- one training epoch of ``fit``'s loop on the device (device data and CIFAR's batch augmentation,
  forward, loss, backward, optimizer step, running metrics) and one evaluation pass: no
  synchronisation per step or per batch; the per-epoch reads of the running metrics and the
  per-pass copy of the scores counted and bounded;
- the trainer's forward passes on fake CUDA tensors (the batches with their augmentation, the
  training forward and loss under bf16 autocast, an evaluation pass): the same;
- tests/test_losses_compile.py's CUDA test, run on fake CUDA tensors: its checked region
  holds the loss alone (defect 1 of #34: it copied its inputs to the GPU inside);
- the normed head's cosines are float32 under CUDA autocast (fake CUDA tensors);
- the kernel launches per forward+backward of the noised losses are at most pytopk's (#34).

The audit's own teeth: ``test_the_audit_sees_each_kind_of_synchronisation``.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import setvalued.training.trial as train
from setvalued.losses import TwoHeadOutput, build_loss
from setvalued.losses.parameters import LOSS_PARAMETERS
from setvalued.training import to_float32
from tests import gpu_audit
from tests.gpu_audit import KernelCount, SyncAudit, claim_cuda, fake_cuda, fake_cuda_autocast
from tests.test_train import write_fake_cifar

NAMES = sorted(LOSS_PARAMETERS)
BATCH, CLASSES = 128, 100
HERE = os.path.dirname(os.path.abspath(__file__))


def _loss(name: str, **params):
    extra = {"k": 5, "n_samples": 3} if name.startswith("noised_topk") else {}
    return build_loss(
        name,
        class_counts=[5 + j for j in range(CLASSES)],
        num_classes=CLASSES,
        num_examples=8 * BATCH,
        **extra,
        **params,
    )


def _run_loss(loss, device: str, mode, backward: bool) -> None:
    leaves = [
        torch.randn(BATCH, CLASSES, device=device).requires_grad_(backward)
        for _ in range(2 if loss.head == "two_head" else 1)
    ]
    output = TwoHeadOutput(*leaves) if loss.head == "two_head" else leaves[0]
    targets = torch.randint(0, CLASSES, (BATCH,), device=device)
    extra = {"indices": torch.randint(0, 8 * BATCH, (BATCH,), device=device)} if loss.requires_indices else {}
    with mode:
        value = loss(output, targets, **extra)
        if backward:
            value.backward()


def loss_syncs(name: str) -> list[str]:
    """The host synchronisations of one forward (fake cuda) and forward+backward (meta)."""
    loss = _loss(name)
    on_meta = copy.deepcopy(loss).to("meta")
    audit = SyncAudit()
    with fake_cuda() as mode:
        claim_cuda(loss, mode)
        _run_loss(loss, "cuda", audit, backward=False)
    _run_loss(on_meta, "meta", audit, backward=True)
    return [str(s) for s in audit.syncs]


def loss_kernels(name: str, **params) -> int:
    """Kernel launches of one forward+backward at B = 128, L = 100 (K = 5, M = 3)."""
    loss = _loss(name, **params).to("meta")
    counter = KernelCount()
    _run_loss(loss, "meta", counter, backward=True)
    return counter.total


@pytest.mark.parametrize("name", NAMES)
def test_every_loss_forward_and_backward_has_no_host_synchronisation(name):
    assert loss_syncs(name) == []


def test_average_k_helpers_have_no_host_synchronisation():
    from setvalued.losses import avgk

    audit = SyncAudit()
    with fake_cuda():
        logits = torch.randn(BATCH, CLASSES, device="cuda")
        targets = torch.randint(0, CLASSES, (BATCH,), device="cuda")
        with audit:
            avgk.candidate_masks(logits, targets, 5)
            avgk.candidate_indices(logits, targets, 5)
            avgk._largest_entries(logits, 40)
    assert [str(s) for s in audit.syncs] == []


def _synchronising(x: torch.Tensor, cpu_scores: torch.Tensor) -> None:
    """One of each kind, on its own line (the audit names these lines)."""
    x.sum().item()  # value read
    x[0, 1] = 2.0  # blocking host-to-device
    x[torch.arange(2, device=x.device), torch.zeros(2, dtype=torch.long, device=x.device)] = 1  # index_put
    (x > 0).nonzero()  # data-dependent shape
    x[x > 0]  # boolean indexing
    x.cpu()  # device-to-host
    cpu_scores.to(x.device)  # blocking host-to-device
    x.add_(cpu_scores.sum())  # a CPU scalar in an elementwise kernel: passed by value, no sync


def test_the_audit_sees_each_kind_of_synchronisation():
    audit = SyncAudit(root=HERE)
    with fake_cuda():
        x = torch.randn(4, 5, device="cuda")
        with audit:
            _synchronising(x, torch.ones(4, 5))
    first = _synchronising.__code__.co_firstlineno
    got = [(s.kind, int(s.where.rsplit(":", 1)[1]) - first) for s in audit.syncs]
    assert got == [
        ("value read", 2),
        ("blocking host-to-device copy", 3),
        ("index_put with a CPU value (blocking copy)", 4),
        ("data-dependent shape", 5),
        ("data-dependent shape", 6),
        ("device-to-host copy", 7),
        ("blocking host-to-device copy", 8),
    ], got
    assert all(s.where.startswith("tests/test_gpu_path_syncs.py:") for s in audit.syncs)


# ---------------------------------------------------------------------------------------------
# the trainer on the device
# ---------------------------------------------------------------------------------------------


def _cifar_cfg(root, batch_size: int, loss: str = "ce", model: str = "small_cnn") -> dict:
    return {
        "data": {"name": "cifar100", "root": str(root), "val_size": 40, "placement": "device"},
        "model": {"name": model, "hidden_dim": 8},
        "loss": {"name": loss},
        "optim": {"lr": 0.05, "batch_size": batch_size, "milestones": []},
        "epochs": 1,
        "eval": {"ks": [1, 5], "batch_size": 10},
        "device": "cpu",
        "amp": True,
    }


def _device_trial(monkeypatch, cfg) -> train.Trial:
    """A trial whose device is "meta" (tensors with shapes and no data: every non-CPU branch of
    the trainer and the losses, and autograd works), its generator claiming that device."""
    monkeypatch.setattr(train, "resolve_device", lambda name: torch.device("meta"))
    monkeypatch.setattr(torch, "Generator", gpu_audit.CudaClaimGenerator)
    return train.Trial(train.resolve_config(cfg), 0)


def epoch_syncs(monkeypatch, cfg) -> tuple[list, list, list]:
    """Host synchronisations of (the training steps, the epoch's summary, one evaluation pass)."""
    trial = _device_trial(monkeypatch, cfg)
    steps, summary, evaluation = SyncAudit(), SyncAudit(), SyncAudit()
    batches = trial.epoch_batches(0)  # the epoch's draws and its order moved to the device
    running = trial.start_training(0)
    with steps:
        count = trial.step.train_on(batches, running)
    with summary:
        running.summary(len(trial.data.train))
    with evaluation:
        trial.evaluation.predict(trial.model, trial.data.val)
    assert count == -(-len(trial.data.train) // cfg["optim"]["batch_size"])
    return steps.syncs, summary.syncs, evaluation.syncs


@pytest.mark.parametrize("loss", ["ce", "noised_topk", "avgk_two_head"])
def test_training_steps_and_evaluation_batches_do_not_synchronise(tmp_path, monkeypatch, loss):
    """2 or 10 steps and 4 evaluation batches: no synchronisation in a step or a batch (the
    batch's augmentation, forward, loss, backward, optimizer step, running metrics); the
    epoch's summary reads its counters in a bounded number of copies, the evaluation pass
    copies its scores back once (and its order of the examples to the device)."""
    write_fake_cifar(tmp_path, per_class=1)
    few = epoch_syncs(monkeypatch, _cifar_cfg(tmp_path, batch_size=30, loss=loss))
    many = epoch_syncs(monkeypatch, _cifar_cfg(tmp_path, batch_size=6, loss=loss))
    for steps, summary, evaluation in (few, many):
        # the epoch's order, moved to the device when its first batch is drawn: once per epoch
        assert [(s.kind, s.where.split(":")[0]) for s in steps] == [
            ("blocking host-to-device copy", "setvalued/data/device.py")
        ]
        assert 1 <= len(summary) <= 3, [str(s) for s in summary]  # losses, hits, gradient counts
        # per pass: the order of the examples to the device, the scores back
        assert [(s.kind, s.where.split(":")[0]) for s in evaluation] == [
            ("blocking host-to-device copy", "setvalued/data/device.py"),
            ("device-to-host copy", "setvalued/training/evaluation.py"),
        ], [str(s) for s in evaluation]
    assert few == many  # 2 or 10 steps, the same synchronisations: none per step


def test_epoch_preparation_copies_a_bounded_amount_once_per_epoch(tmp_path, monkeypatch):
    """What an epoch copies to the device before its first step (the order of the examples,
    the running metrics' ks) does not grow with the number of steps."""
    write_fake_cifar(tmp_path, per_class=1)
    counts = []
    for batch_size in (30, 6):
        trial = _device_trial(monkeypatch, _cifar_cfg(tmp_path, batch_size))
        audit = SyncAudit()
        with audit:
            batches = iter(trial.epoch_batches(0))
            next(batches)
            trial.start_training(0)
        counts.append(len(audit.syncs))
    assert counts[0] == counts[1] <= 3


def test_the_trainer_audit_sees_a_read_per_step(tmp_path, monkeypatch):
    """The same audit with the running metrics folded every step: a read per step."""
    write_fake_cifar(tmp_path, per_class=1)
    monkeypatch.setattr("setvalued.training.running_metrics._FOLD_EVERY_STEPS", 1)
    steps, _, _ = epoch_syncs(monkeypatch, _cifar_cfg(tmp_path, batch_size=6))
    reads = [s for s in steps if s.where.startswith("setvalued/training/running_metrics.py:")]
    assert len(reads) >= 10, [str(s) for s in steps]


# ---------------------------------------------------------------------------------------------
# mixed precision and kernel counts
# ---------------------------------------------------------------------------------------------


def test_normed_head_cosines_are_float32_under_cuda_autocast():
    from setvalued.models import build_model

    model = build_model({"name": "mlp", "hidden_dim": 16}, 10, (8,), "normed")
    seen = []
    model.head.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    with fake_cuda() as mode:
        claim_cuda(model, mode)
        with fake_cuda_autocast(torch.bfloat16):
            features = model.features(torch.randn(4, 8, device="cuda"))
            model(torch.randn(4, 8, device="cuda"))
    assert features.dtype == torch.bfloat16  # the autocast region is on: the backbone is in bf16
    assert seen == [torch.float32]


#: pytopk's kernel launches per forward+backward (B = 128, L = 100, K = 5, M = 3; issue #34)
PYTOPK_KERNELS = {"noised_topk": 24, "noised_topk_imbalanced": 26}


@pytest.mark.parametrize("name", sorted(PYTOPK_KERNELS))
def test_noised_losses_launch_no_more_kernels_than_pytopk(name):
    assert loss_kernels(name) <= PYTOPK_KERNELS[name]


def test_kernel_count_of_cross_entropy():
    """Cross-entropy's forward+backward: log_softmax, nll_loss, mean's backward ... (the counter
    counts launches, not views: 7 as in issue #34)."""
    assert loss_kernels("ce") == 7


class _RegionDone(Exception):
    """Raised when the checked region ends: the rest of the test needs a GPU."""


def cuda_test_region_syncs(monkeypatch, name: str) -> list:
    """tests/test_losses_compile.py's CUDA test, run on fake CUDA tensors up to the end of its
    ``set_sync_debug_mode("error")`` region: the synchronisations inside that region, with the
    line of the test or of the project that issued them (the backward pass is left out: the
    autograd engine refuses fake CUDA tensors here; the losses' backward is audited above)."""
    import tests.test_losses_compile as suite

    audit = SyncAudit(root=os.path.dirname(HERE))

    def debug_mode(setting):
        if setting == "error":
            audit.__enter__()
        else:
            audit.__exit__(None, None, None)
            raise _RegionDone

    with fake_cuda() as mode:
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
        monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", debug_mode)
        monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *args: claim_cuda(self, mode))
        monkeypatch.setattr(torch.Tensor, "backward", lambda self, *args, **kwargs: None)
        with pytest.raises(_RegionDone):
            suite.test_every_loss_runs_on_cuda_without_host_synchronisation(name)
    return [str(s) for s in audit.syncs]


def test_the_cuda_sync_test_checks_the_loss_alone(monkeypatch):
    """Defect 1 of issue #34: the test moved its inputs to the GPU inside its checked region (a
    blocking copy, so it could never pass on a GPU); now the region holds the loss alone."""
    assert cuda_test_region_syncs(monkeypatch, "noised_topk") == []


def test_the_trainer_on_fake_cuda_forward_passes_do_not_synchronise(tmp_path, monkeypatch):
    """The same trainer on FakeTensors on "cuda" (the CUDA branches of indexing, and the bf16
    autocast region of the trainer), forward passes only: the batches with their augmentation
    and the training forward with its loss (no synchronisation), and an evaluation pass (its
    order to the device, its scores back once)."""
    write_fake_cifar(tmp_path, per_class=1)
    trial = train.Trial(train.resolve_config(_cifar_cfg(tmp_path, batch_size=6, loss="noised_topk")), 0)
    monkeypatch.setattr(torch, "Generator", gpu_audit.CudaClaimGenerator)
    steps, evaluation = SyncAudit(), SyncAudit()
    with fake_cuda() as mode:
        claim_cuda(trial.model, mode)
        claim_cuda(trial.loss, mode)
        trial.device = trial.step.device = trial.evaluation.device = torch.device("cuda")
        trial.step.amp_dtype = torch.bfloat16
        trial.on_device = {ds.split: _device_split(ds, trial.device) for ds in trial.data}
        trial.evaluation.on_device = trial.on_device
        monkeypatch.setattr(trial.step, "autocast", lambda: fake_cuda_autocast(torch.bfloat16))
        batches = iter(trial.epoch_batches(0))
        next(batches)  # the epoch's order moved to the device once
        with steps:
            for x, y, idx in batches:
                output = to_float32(trial.step.run_model(x))
                trial.loss(output, y, idx)
        with evaluation:
            trial.evaluation.predict(trial.model, trial.data.val)
    assert [str(s) for s in steps.syncs] == []
    assert [s.kind for s in evaluation.syncs] == ["blocking host-to-device copy", "device-to-host copy"]


def _device_split(ds, device):
    from setvalued.data.device import DeviceSplit

    return DeviceSplit(ds.inputs, ds.targets, device, getattr(ds, "batch_augmentation", None))
