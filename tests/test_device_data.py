"""Data on the training device (issue #24): the batched CIFAR augmentation against torchvision's
per-image transforms, the uniformity of its draws, reproducibility, evaluation without a host
read per batch, and ``compile: model`` against eager."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from scipy import stats

from setvalued.data import cifar100
from setvalued.data.device import DeviceSplit
from setvalued.training import fit
from tests.test_train import write_fake_cifar

torch.set_num_threads(1)

AUG = cifar100.AUGMENTATION


def test_batched_augmentation_equals_torchvision_per_image_for_given_offsets_and_flips():
    from torchvision.transforms import v2
    from torchvision.transforms.v2 import functional as TF

    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (40, 3, 32, 32), dtype=torch.uint8, generator=gen)
    # every corner and edge of the padded image, then random positions; both flips of each
    offsets = torch.tensor(
        [[0, 0], [0, 8], [8, 0], [8, 8], [4, 4], [0, 4], [8, 3], [2, 8]] * 2
        + torch.randint(0, 9, (24, 2), generator=gen).tolist()
    )
    flips = torch.tensor([False] * 8 + [True] * 8 + torch.randint(0, 2, (24,), generator=gen).bool().tolist())
    batched = AUG.apply(images, offsets, flips)

    to_float = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(cifar100.MEAN, cifar100.STD)])
    for i in range(len(images)):
        # torchvision's RandomCrop(32, padding=4) pads with zeros, then crops at (top, left)
        crop = TF.crop(TF.pad(images[i], [4]), int(offsets[i, 0]), int(offsets[i, 1]), 32, 32)
        if flips[i]:
            crop = TF.horizontal_flip(crop)
        torch.testing.assert_close(batched[i], to_float(crop), rtol=0, atol=1e-6)
    assert batched.dtype == torch.float32 and batched.shape == (40, 3, 32, 32)


def test_torchvision_draws_its_crop_on_the_same_81_positions():
    """The per-image transform's offsets range over the 9 x 9 positions that ``draw`` uses: the
    crop of a padded image whose pixel values encode their position reads back its offset."""
    from torchvision.transforms import v2

    torch.manual_seed(0)
    crop = v2.RandomCrop(32, padding=4)
    position = torch.stack(
        [
            torch.arange(1, 33, dtype=torch.uint8).view(32, 1).expand(32, 32),  # row + 1
            torch.arange(1, 33, dtype=torch.uint8).view(1, 32).expand(32, 32),
        ]
    )  # column + 1
    seen = set()
    for _ in range(3000):
        out = crop(position)
        # the first crop row (column) inside the image, and the image row (column) it shows
        r0 = int((out[0].amax(dim=1) > 0).nonzero()[0])
        c0 = int((out[1].amax(dim=0) > 0).nonzero()[0])
        top = int(out[0, r0].amax()) - 1 + 4 - r0
        left = int(out[1, :, c0].amax()) - 1 + 4 - c0
        seen.add((top, left))
        if len(seen) == 81:
            break
    assert seen == {(top, left) for top in range(9) for left in range(9)}


def test_augmentation_offsets_and_flips_are_uniform():
    """Chi-square goodness of fit over many draws: the 81 crop positions and the two flips."""
    n = 81 * 400
    offsets, flips = AUG.draw(n, torch.Generator().manual_seed(7))
    cells = (offsets[:, 0] * 9 + offsets[:, 1]).numpy()
    assert offsets.min() == 0 and offsets.max() == 8
    counts = np.bincount(cells, minlength=81)
    assert len(counts) == 81
    assert stats.chisquare(counts).pvalue > 1e-3
    assert stats.chisquare(np.bincount(flips.numpy().astype(int), minlength=2)).pvalue > 1e-3
    # top and left independent: the joint table is no better explained by a dependence
    table = counts.reshape(9, 9)
    assert stats.chi2_contingency(table).pvalue > 1e-3
    # and the test can fail: a biased draw (offsets 0..7 only) is rejected
    biased = np.bincount((offsets[:, 0].clamp(max=7) * 9 + offsets[:, 1]).numpy(), minlength=81)
    assert stats.chisquare(biased).pvalue < 1e-6


def test_device_split_draws_the_same_stream_for_a_seed_whatever_the_batch_size():
    images = torch.randint(0, 256, (50, 3, 32, 32), dtype=torch.uint8)
    split = DeviceSplit(images, torch.arange(50), torch.device("cpu"), AUG)
    order = torch.randperm(50)

    def epoch(batch_size, seed):
        return torch.cat([x for x, _, _ in split.batches(order, batch_size, torch.Generator().manual_seed(seed))])

    torch.testing.assert_close(epoch(7, 3), epoch(50, 3), rtol=0, atol=0)
    assert not torch.equal(epoch(7, 3), epoch(7, 4))
    plain = DeviceSplit(images.float(), torch.arange(50), torch.device("cpu"))
    assert torch.equal(torch.cat([x for x, _, _ in plain.batches(order, 8)]), images.float()[order])


# -------------------------------------------------------------------------------------------
# the trainer on device data
# -------------------------------------------------------------------------------------------


def cifar_cfg(root, **data):
    return {
        "data": {"name": "cifar100", "root": str(root), "val_size": 50, **data},
        "model": {"name": "small_cnn", "hidden_dim": 8},
        "loss": {"name": "ce"},
        "optim": {"lr": 0.05, "batch_size": 50, "milestones": []},
        "epochs": 2,
        "eval": {"ks": [1, 5]},
        "device": "cpu",
    }


def synthetic_cfg(train_size=200, batch_size=40, **extra):
    cfg = {
        "data": {
            "name": "synthetic",
            "num_classes": 10,
            "num_superclasses": 2,
            "train_size": train_size,
            "val_size": 60,
            "test_size": 60,
            "feature_dim": 16,
        },
        "model": {"name": "mlp", "hidden_dim": 16},
        "loss": {"name": "ce"},
        "optim": {"lr": 0.1, "batch_size": batch_size, "milestones": []},
        "epochs": 2,
        "eval": {"ks": [1, 3], "selection": "val/top3"},
        "device": "cpu",
    }
    cfg.update(extra)
    return cfg


def _history(result):
    return [{k: v for k, v in h.items() if not k.endswith("time_s")} for h in result["history"]]


def test_device_data_is_reproducible_per_seed_and_equals_the_loader_on_unaugmented_data(tmp_path):
    write_fake_cifar(tmp_path, per_class=3)
    device = cifar_cfg(tmp_path, placement="device")
    a, b, other = fit(device, 0), fit(device, 0), fit(device, 1)
    assert _history(a) == _history(b) and a["test"] == b["test"]
    assert _history(a) != _history(other)
    # auto with no loader workers is the device placement
    assert _history(fit(cifar_cfg(tmp_path), 0)) == _history(a)
    # the synthetic set has no augmentation: device and loader batches are the same batches
    for placement in ("device", "loader"):
        cfg = synthetic_cfg()
        cfg["data"]["placement"] = placement
        result = fit(cfg, 3)
        if placement == "device":
            first = result
    assert _history(result) == _history(first) and result["test"] == first["test"]


def test_device_placement_of_a_folder_data_set_is_refused():
    with pytest.raises(ValueError, match="data.placement: device holds in-memory data sets only"):
        fit({"data": {"name": "plantnet300k", "root": "/nowhere", "placement": "device"}, "loss": {"name": "ce"}}, 0)
    with pytest.raises(ValueError, match="data.placement"):
        fit(synthetic_cfg() | {"data": {"name": "synthetic", "placement": "gpu"}}, 0)


_HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu")


def _count_host_reads(monkeypatch, cfg) -> int:
    """Host reads (``.item()``, ``.tolist()``, ``bool()``, ``float()``, ``int()``, ``.cpu()``) of
    one ``fit`` call, counted by wrapping those tensor methods."""
    counter = {"n": 0}
    for name in _HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            counter["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    try:
        fit(cfg, 0)
    finally:
        monkeypatch.undo()
    return counter["n"]


def test_host_reads_per_epoch_do_not_grow_with_steps_or_evaluation_batches(monkeypatch):
    """Within one fold of the running metrics (``_FOLD_EVERY_STEPS`` steps: their losses are
    read back together), 2 or 40 training steps and 1 or 30 evaluation batches cost the same
    host reads: none is per batch."""
    few = synthetic_cfg(train_size=400, batch_size=200)  # 2 steps an epoch, 1 evaluation batch
    many = synthetic_cfg(train_size=400, batch_size=10)  # 40 steps an epoch
    many["eval"]["batch_size"] = 2  # 30 evaluation batches per pass
    reads_few, reads_many = _count_host_reads(monkeypatch, few), _count_host_reads(monkeypatch, many)
    assert reads_few > 0  # the counter sees the reads the trainer does make
    assert reads_many == reads_few
    # and it would see a read per step: folding the running metrics after every step does one
    monkeypatch.setattr("setvalued.training.running_metrics._FOLD_EVERY_STEPS", 1)
    assert _count_host_reads(monkeypatch, many) > reads_many + 2 * 30


@pytest.mark.slow
def test_compiled_model_trains_to_the_losses_of_eager():
    eager = synthetic_cfg(epochs=2)
    compiled = copy.deepcopy(eager) | {"compile": "model"}
    a, b = fit(eager, 5), fit(compiled, 5)
    for ha, hb in zip(a["history"], b["history"]):
        assert hb["train/loss"] == pytest.approx(ha["train/loss"], rel=1e-4)
        assert hb["val/top1"] == pytest.approx(ha["val/top1"], abs=1 / 60)
    assert b["test"]["top1"] == pytest.approx(a["test"]["top1"], abs=1 / 60)
    # the checkpoint holds the model's own parameter names, not the compiled wrapper's
    assert not any(k.startswith("_orig_mod") for k in b["model"].state_dict())


@pytest.mark.parametrize("gpus", ["1", "1/2", "1/3", "1/4", "1/8", "3/10"])
@pytest.mark.parametrize("cluster_gpus", [1, 2, 8])
def test_trials_per_gpu_is_the_most_trials_on_one_gpu_when_packed_evenly(gpus, cluster_gpus):
    """Against a brute-force packing: trials placed one by one on the least-loaded GPU that
    still has room for their fraction (exact fractions), as many as the slots."""
    from fractions import Fraction

    from studies.running.ray_session import trials_per_gpu

    share = Fraction(gpus)
    capacity = int(1 / share)  # whole trials of that fraction on one GPU
    for slots in range(1, capacity * cluster_gpus + 1):
        load = [Fraction(0)] * cluster_gpus
        count = [0] * cluster_gpus
        for _ in range(slots):
            gpu = min((g for g in range(cluster_gpus) if load[g] + share <= 1), key=lambda g: count[g])
            load[gpu] += share
            count[gpu] += 1
        assert trials_per_gpu(float(share), slots, cluster_gpus) == max(count), (gpus, cluster_gpus, slots)
    assert trials_per_gpu(0.0, 4, cluster_gpus) == 0


def test_study_validation_reads_the_new_fields_from_their_declarations():
    """``compile``, ``eval.batch_size`` and ``data.placement`` are implicit: a config holds them
    only when they differ from their defaults (existing config ids unchanged); bad values are
    refused at their path, a device placement of a folder data set at its data section."""
    from studies.studyfile.config_ids import config_id
    from studies.studyfile.trial_config import validate_config

    plain, problems = validate_config({"loss": {"name": "ce"}, "eval": {"ks": [1, 5]}})
    assert not problems
    explicit, problems = validate_config(
        {
            "loss": {"name": "ce"},
            "eval": {"ks": [1, 5], "batch_size": 128},
            "compile": "none",
            "data": {"name": "synthetic", "placement": "auto"},
        }
    )
    assert not problems and explicit == plain and config_id(explicit) == config_id(plain)
    assert "compile" not in plain and "batch_size" not in plain["eval"] and "placement" not in plain["data"]
    changed, problems = validate_config(
        {
            "loss": {"name": "ce"},
            "eval": {"ks": [1, 5], "batch_size": 64},
            "compile": "model",
            "data": {"name": "cifar100", "placement": "device"},
        }
    )
    assert not problems and changed["compile"] == "model" and changed["data"]["placement"] == "device"
    _, problems = validate_config({"loss": {"name": "ce"}, "compile": "fast"})
    assert [p.path for p in problems] == [("compile",)] and "'none'" in problems[0].message
    _, problems = validate_config({"loss": {"name": "ce"}, "eval": {"ks": [1, 5], "batch_size": 0}})
    assert [p.path for p in problems] == [("eval", "batch_size")]
    _, problems = validate_config({"loss": {"name": "ce"}, "data": {"name": "plantnet300k", "placement": "device"}})
    assert len(problems) == 1 and "in-memory data sets only" in problems[0].message


def test_fit_leaves_no_tensor_behind_in_a_warm_process(tmp_path):
    """What a warm worker keeps from one cell to the next: no tensor of a finished ``fit``
    (model, data on the device, optimizer state) stays alive, so memory stays flat over cells."""
    import gc
    import warnings

    def live_tensors() -> int:
        while gc.collect():  # until nothing more is freed: garbage an earlier test left (cycles
            pass  # whose finalizers free more) would otherwise die during the next fit
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))

    write_fake_cifar(tmp_path, per_class=1)
    cfg = cifar_cfg(tmp_path, placement="device")
    cfg["epochs"] = 1
    fit(cfg, 0)  # the first call's one-time state (lazy modules, caches) is not a leak
    before = live_tensors()
    for seed in (1, 2):
        result = fit(cfg, seed)
        assert live_tensors() > before  # the check sees the tensors a result holds ...
        del result
    assert live_tensors() == before  # ... and none once it is dropped
