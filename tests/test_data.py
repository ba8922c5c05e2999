"""Data sets: each loader on small files written in the official format, the CIFAR-100
split and label noise, the synthetic data's long tail and ambiguity."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
import torch

from setvalued.data import DataLayoutError, build_datasets, cifar100, synthetic

torch.set_num_threads(1)

# -------------------------------------------------------------------------------------------
# CIFAR-100: the official pickles (python dicts, 'data' N x 3072 uint8, channel-major)
# -------------------------------------------------------------------------------------------

#: A superclass assignment that is not "5 consecutive fine ids", as in the real data
#: (fine ids are alphabetical), so the two noise modes can be told apart.
COARSE_OF = np.random.default_rng(42).permutation(np.arange(100) // 5)


def write_fake_cifar(root, per_class_train: int, per_class_test: int, *, drop_key: str | None = None):
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    arrays = {}
    for name, per_class in (("train", per_class_train), ("test", per_class_test)):
        fine = rng.permutation(np.repeat(np.arange(100), per_class))
        data = rng.integers(0, 256, (len(fine), 3072), dtype=np.uint8)
        entry = {
            "filenames": [f"img_{i}.png" for i in range(len(fine))],
            "batch_label": f"{name} batch 1 of 1",
            "fine_labels": fine.tolist(),
            "coarse_labels": COARSE_OF[fine].tolist(),
            "data": data,
        }
        if drop_key and name == "train":
            del entry[drop_key]
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)
        arrays[name] = (data, fine)
    with open(folder / "meta", "wb") as f:
        pickle.dump(
            {
                "fine_label_names": [f"fine{i}" for i in range(100)],
                "coarse_label_names": [f"coarse{i}" for i in range(20)],
            },
            f,
            protocol=2,
        )
    return arrays


def cifar_cfg(root, **extra):
    return {"name": "cifar100", "root": str(root), **extra}


def normalized(row: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(row.reshape(3, 32, 32).astype(np.float32) / 255.0)
    return (x - torch.tensor(cifar100.MEAN).view(3, 1, 1)) / torch.tensor(cifar100.STD).view(3, 1, 1)


def test_cifar_loader_reads_official_pickles(tmp_path):
    arrays = write_fake_cifar(tmp_path, per_class_train=6, per_class_test=2)
    splits = build_datasets(cifar_cfg(tmp_path, val_size=100), seed=0)
    train, val, test = splits
    assert (len(train), len(val), len(test)) == (500, 100, 200)
    assert splits.num_classes == train.num_classes == 100
    assert sum(train.class_counts) == 500 and val.class_counts == train.class_counts
    assert splits.class_names[3] == "fine3"

    train_data, train_fine = arrays["train"]
    test_data, test_fine = arrays["test"]
    # val: clean labels and the test transform (normalisation only) of the held-out images
    x, y, i = val[7]
    src = int(val.source_indices[7])
    assert i == 7 and y == train_fine[src]
    torch.testing.assert_close(x, normalized(train_data[src]))
    x, y, i = test[11]
    assert y == test_fine[11] and i == 11
    torch.testing.assert_close(x, normalized(test_data[11]))

    # train: RandomCrop(32, padding=4) + horizontal flip of the normalised image
    torch.manual_seed(3)
    for item in (0, 1, 2, 3):
        x, y, i = train[item]
        src = int(train.source_indices[item])
        assert i == item and y == train_fine[src] and x.shape == (3, 32, 32)
        padded = torch.nn.functional.pad(torch.from_numpy(train_data[src].reshape(3, 32, 32)), (4, 4, 4, 4))
        matches = []
        for dy in range(9):
            for dx in range(9):
                crop = padded[:, dy : dy + 32, dx : dx + 32].numpy().reshape(-1)
                for flip in (False, True):
                    candidate = normalized(crop)
                    if flip:
                        candidate = candidate.flip(-1)
                    if torch.allclose(candidate, x, atol=1e-5):
                        matches.append((dy, dx, flip))
        assert matches, "the training image is not a padded crop (+ flip) of the original"


def test_cifar_split_is_fixed_across_trial_seeds(tmp_path):
    write_fake_cifar(tmp_path, per_class_train=6, per_class_test=1)
    val_a = build_datasets(cifar_cfg(tmp_path, val_size=200), seed=0).val.source_indices
    val_b = build_datasets(cifar_cfg(tmp_path, val_size=200, label_noise=0.3), seed=7).val.source_indices
    assert torch.equal(val_a, val_b)
    other = build_datasets(cifar_cfg(tmp_path, val_size=200, split_seed=99), seed=0).val.source_indices
    assert not torch.equal(val_a, other)
    # train and val partition the official training set
    splits = build_datasets(cifar_cfg(tmp_path, val_size=200), seed=0)
    both = torch.cat([splits.train.source_indices, splits.val.source_indices]).sort().values
    assert torch.equal(both, torch.arange(600))

    stratified = build_datasets(cifar_cfg(tmp_path, val_size=200, stratified_split=True), seed=5).val
    assert stratified.split_counts == [2] * 100
    assert torch.equal(
        stratified.source_indices,
        build_datasets(cifar_cfg(tmp_path, val_size=200, stratified_split=True), seed=6).val.source_indices,
    )


@pytest.mark.parametrize("groups", ["consecutive", "coarse"])
def test_cifar_label_noise_rate_and_groups(tmp_path, groups):
    arrays = write_fake_cifar(tmp_path, per_class_train=20, per_class_test=1)
    p = 0.5
    splits = build_datasets(cifar_cfg(tmp_path, val_size=100, label_noise=p, noise_groups=groups), seed=3)
    train = splits.train
    clean, noisy = train.clean_targets.numpy(), train.targets.numpy()
    n = len(clean)
    assert np.array_equal(clean, arrays["train"][1][train.source_indices.numpy()])
    changed = noisy != clean
    # a label is redrawn with probability p among 5 classes including itself: 0.8 p change
    rate, expected = changed.mean(), 0.8 * p
    assert abs(rate - expected) < 4 * math.sqrt(expected * (1 - expected) / n), rate
    assert abs(train.redrawn.numpy().mean() - p) < 4 * math.sqrt(p * (1 - p) / n)
    assert not changed[~train.redrawn.numpy()].any()
    if groups == "consecutive":  # label - label % 5 + U{0..4}: the authors' code
        assert (noisy[changed] // 5 == clean[changed] // 5).all()
        assert (COARSE_OF[noisy[changed]] != COARSE_OF[clean[changed]]).any()
    else:  # the true superclasses of the pickle's coarse labels
        assert (COARSE_OF[noisy[changed]] == COARSE_OF[clean[changed]]).all()
        assert (noisy[changed] // 5 != clean[changed] // 5).any()
    # the new label is uniform over the 5 members of the group, the old one included
    redrawn = train.redrawn.numpy()
    group_of = np.arange(100) // 5 if groups == "consecutive" else COARSE_OF
    position = np.array([np.flatnonzero(group_of == group_of[c]).tolist().index(c) for c in range(100)])
    n_r = int(redrawn.sum())
    assert abs((noisy[redrawn] == clean[redrawn]).mean() - 0.2) < 4 * math.sqrt(0.2 * 0.8 / n_r)
    per_position = np.bincount(position[noisy[redrawn]], minlength=5)
    assert (np.abs(per_position - n_r / 5) < 4 * math.sqrt(n_r * 0.2 * 0.8)).all(), per_position

    # validation and test stay clean; the noise follows the trial seed
    val_fine = arrays["train"][1][splits.val.source_indices.numpy()]
    assert np.array_equal(splits.val.targets.numpy(), val_fine)
    assert np.array_equal(splits.test.targets.numpy(), arrays["test"][1])
    same = build_datasets(cifar_cfg(tmp_path, val_size=100, label_noise=p, noise_groups=groups), seed=3).train
    other = build_datasets(cifar_cfg(tmp_path, val_size=100, label_noise=p, noise_groups=groups), seed=4).train
    assert torch.equal(same.targets, train.targets)
    assert not torch.equal(other.targets, train.targets)
    assert train.class_counts == np.bincount(noisy, minlength=100).tolist()
    no_noise = build_datasets(cifar_cfg(tmp_path, val_size=100), seed=3).train
    assert torch.equal(no_noise.targets, no_noise.clean_targets)


def test_cifar_missing_or_malformed_folder(tmp_path):
    with pytest.raises(DataLayoutError) as err:
        build_datasets(cifar_cfg(tmp_path / "nowhere"), seed=0)
    assert "nowhere" in str(err.value) and "cifar-100-python/train" in str(err.value)
    with pytest.raises(DataLayoutError) as err:
        build_datasets(cifar_cfg(tmp_path), seed=0)  # exists, but empty
    assert "cifar-100-python" in str(err.value)

    bad = tmp_path / "bad"
    write_fake_cifar(bad, per_class_train=2, per_class_test=1, drop_key="fine_labels")
    with pytest.raises(DataLayoutError) as err:
        build_datasets(cifar_cfg(bad, val_size=10), seed=0)
    assert "fine_labels" in str(err.value) and str(bad / "cifar-100-python" / "train") in str(err.value)
    (bad / "cifar-100-python" / "meta").write_bytes(b"not a pickle")
    with pytest.raises(DataLayoutError, match="meta"):
        build_datasets(cifar_cfg(bad, val_size=10), seed=0)


class _PlantedCode:
    """Unpickling this object calls os.system: a crafted 'train' file in a shared data folder."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [2, 4])
def test_cifar_pickle_that_would_run_code_is_refused_before_anything_runs(tmp_path, protocol):
    root = tmp_path / "shared"
    write_fake_cifar(root, per_class_train=2, per_class_test=1)
    marker = tmp_path / "code_ran"
    with open(root / "cifar-100-python" / "train", "wb") as f:
        pickle.dump(
            {
                "data": np.zeros((1, 3072), np.uint8),
                "fine_labels": [0],
                "coarse_labels": [0],
                "filenames": [_PlantedCode(marker)],
            },
            f,
            protocol=protocol,
        )
    with pytest.raises(DataLayoutError) as err:
        build_datasets(cifar_cfg(root, val_size=10), seed=0)
    assert not marker.exists(), "the planted pickle ran code"
    message = str(err.value)
    assert str(root / "cifar-100-python" / "train") in message and ".system" in message
    assert "not part of the official CIFAR-100 files" in message


# -------------------------------------------------------------------------------------------
# Pl@ntNet-300K: images/{train,val,test}/<species id>/<file>
# -------------------------------------------------------------------------------------------

SPECIES = ["1355868", "1355920", "1356022"]  # folder names sort as strings


def write_fake_plantnet(root, train_counts=(3, 1, 2)):
    from PIL import Image

    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    for split, counts in (("train", train_counts), ("val", (1, 1, 1)), ("test", (1, 1, 2))):
        for species, count, colour in zip(SPECIES, counts, colours):
            folder = root / "images" / split / species
            folder.mkdir(parents=True)
            for i in range(count):
                img = Image.new("RGB", (300, 260), colour)
                if i % 2 == 0:  # lossless, so that colours can be checked exactly
                    img.save(folder / f"{i}.png")
                else:
                    img.save(folder / f"{i}.jpg", quality=95)
            (folder / "notes.txt").write_text("not an image")
    names = {s: f"Species {s}" for s in SPECIES}
    (root / "plantnet300K_species_id_2_name.json").write_text(json.dumps(names))


def test_plantnet_loader(tmp_path):
    write_fake_plantnet(tmp_path)
    splits = build_datasets({"name": "plantnet300k", "root": str(tmp_path)}, seed=0)
    train, val, test = splits
    assert (len(train), len(val), len(test)) == (6, 3, 4)
    assert splits.num_classes == 3 and train.class_counts == [3, 1, 2] and test.class_counts == [3, 1, 2]
    assert splits.class_names == [f"Species {s}" for s in SPECIES]
    assert test.targets.tolist() == [0, 1, 2, 2]

    # evaluation: Resize(256) + CenterCrop(224) + ImageNet normalisation of a lossless solid colour
    x, y, i = val[1]
    assert x.shape == (3, 224, 224) and y == 1 and i == 1
    expected = (torch.tensor([0.0, 1.0, 0.0]) - torch.tensor([0.485, 0.456, 0.406])) / torch.tensor(
        [0.229, 0.224, 0.225]
    )
    torch.testing.assert_close(x.mean(dim=(1, 2)), expected, atol=1e-3, rtol=0)
    torch.testing.assert_close(val[1][0], x)  # deterministic
    x, y, _ = train[0]
    assert x.shape == (3, 224, 224) and y == 0

    # the same folder given as ROOT/images works too
    again = build_datasets({"name": "plantnet300k", "root": str(tmp_path / "images")}, seed=0)
    assert again.train.class_counts == [3, 1, 2]


def test_plantnet_train_crop_is_random_without_flip(tmp_path):
    from PIL import Image

    write_fake_plantnet(tmp_path)
    # a horizontal gradient: a flip would reverse it, a random crop shifts it
    ramp = np.tile(np.linspace(0, 255, 300, dtype=np.uint8), (260, 1))
    Image.fromarray(np.stack([ramp] * 3, -1)).save(tmp_path / "images" / "train" / SPECIES[1] / "0.png")
    train = build_datasets({"name": "plantnet300k", "root": str(tmp_path)}, seed=0).train
    item = train.paths.index(str(tmp_path / "images" / "train" / SPECIES[1] / "0.png"))
    crops = []
    for s in range(6):
        torch.manual_seed(s)
        crops.append(train[item][0])
    assert any(not torch.equal(crops[0], c) for c in crops[1:])
    for c in crops:  # brightness increases left to right: never flipped
        assert c[0, :, 0].mean() < c[0, :, -1].mean()


def test_plantnet_bad_layout(tmp_path):
    write_fake_plantnet(tmp_path)
    import shutil

    shutil.rmtree(tmp_path / "images" / "test")
    with pytest.raises(DataLayoutError) as err:
        build_datasets({"name": "plantnet300k", "root": str(tmp_path)}, seed=0)
    assert "test" in str(err.value) and "images/train/<species id>" in str(err.value)

    other = tmp_path / "other"
    write_fake_plantnet(other)
    (other / "images" / "val" / "999").mkdir()
    with pytest.raises(DataLayoutError, match="not in train"):
        build_datasets({"name": "plantnet300k", "root": str(other)}, seed=0)
    with pytest.raises(DataLayoutError, match="does not exist"):
        build_datasets({"name": "plantnet300k", "root": str(tmp_path / "missing")}, seed=0)


# -------------------------------------------------------------------------------------------
# ImageNet-LT: ImageNet_LT_{train,val,test}.txt, "<path> <label>" over an ImageNet folder
# -------------------------------------------------------------------------------------------


def write_fake_imagenet_lt(root):
    from PIL import Image

    wnids = ["n01440764", "n01443537", "n01484850"]
    lists = {"train": [], "val": [], "test": []}
    for label, (wnid, n_train) in enumerate(zip(wnids, (4, 2, 1))):
        for i in range(n_train + 1):
            rel = f"train/{wnid}/{wnid}_{i}.JPEG"
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (64, 48), (label * 80, 10, 10)).save(root / rel, format="JPEG")
            lists["train" if i < n_train else "val"].append(f"{rel} {label}")
        rel = f"val/{wnid}/ILSVRC2012_val_{label:08d}.JPEG"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (50, 70), (10, label * 80, 10)).save(root / rel, format="JPEG")
        lists["test"].append(f"{rel} {label}")
    (root / "ImageNet_LT").mkdir()
    for split, lines in lists.items():
        (root / "ImageNet_LT" / f"ImageNet_LT_{split}.txt").write_text("\n".join(lines) + "\n")
    return wnids


def test_imagenet_lt_loader(tmp_path):
    wnids = write_fake_imagenet_lt(tmp_path)
    splits = build_datasets({"name": "imagenet_lt", "root": str(tmp_path)}, seed=0)
    train, val, test = splits
    assert (len(train), len(val), len(test)) == (7, 3, 3)
    assert splits.num_classes == 3 and train.class_counts == [4, 2, 1]
    assert splits.class_names == wnids
    x, y, i = test[2]
    assert x.shape == (3, 224, 224) and y == 2 and i == 2
    x, y, i = train[5]
    assert x.shape == (3, 224, 224) and y == 1


def test_imagenet_lt_bad_layout(tmp_path):
    write_fake_imagenet_lt(tmp_path)
    (tmp_path / "val" / "n01443537" / "ILSVRC2012_val_00000001.JPEG").unlink()
    with pytest.raises(DataLayoutError) as err:
        build_datasets({"name": "imagenet_lt", "root": str(tmp_path)}, seed=0)
    assert "ILSVRC2012_val_00000001.JPEG" in str(err.value) and "ImageNet_LT_test.txt" in str(err.value)

    other = tmp_path / "other"
    other.mkdir()
    write_fake_imagenet_lt(other)
    (other / "ImageNet_LT" / "ImageNet_LT_val.txt").write_text("train/x.JPEG\n")
    with pytest.raises(DataLayoutError, match="line 1"):
        build_datasets({"name": "imagenet_lt", "root": str(other)}, seed=0)
    with pytest.raises(DataLayoutError, match="ImageNet_LT_train.txt"):
        build_datasets({"name": "imagenet_lt", "root": str(tmp_path / "train")}, seed=0)


# -------------------------------------------------------------------------------------------
# synthetic
# -------------------------------------------------------------------------------------------


def test_synthetic_is_deterministic_and_fixed_across_trial_seeds():
    cfg = {
        "name": "synthetic",
        "train_size": 400,
        "val_size": 100,
        "test_size": 100,
        "num_classes": 20,
        "num_superclasses": 4,
    }
    a = build_datasets(cfg, seed=0)
    b = build_datasets(cfg, seed=5)
    for sa, sb in zip(a, b):
        assert torch.equal(sa.inputs, sb.inputs) and torch.equal(sa.targets, sb.targets)
    c = build_datasets({**cfg, "split_seed": 7}, seed=0)
    assert not torch.equal(a.train.inputs, c.train.inputs)
    x, y, i = a.train[13]
    assert x.shape == (32,) and i == 13 and y == int(a.train.targets[13])
    assert a.input_shape == (32,)


def test_synthetic_long_tail():
    splits = build_datasets({"name": "synthetic"}, seed=0)  # interface defaults: 40 classes, 2,000
    counts = np.array(splits.class_counts)
    assert counts.sum() == 2000 == len(splits.train) and (counts >= 2).all()
    assert counts.max() / counts.min() > 10
    assert (counts < 20).any() and (counts > 100).any()  # few- and many-shot classes exist
    for split in (splits.val, splits.test):  # every class in every split, same long tail
        per_class = np.array(split.split_counts)
        assert (per_class >= 1).all()
        assert np.corrcoef(per_class, counts)[0, 1] > 0.95
    # the shape follows the Pareto quantiles: top-10 % of classes hold a large share
    weights = synthetic.pareto_weights(40, 1.2)
    top = np.sort(counts)[::-1][:4].sum() / counts.sum()
    assert abs(top - weights[:4].sum()) < 0.05


def test_synthetic_superclasses_overlap():
    splits = build_datasets({"name": "synthetic"}, seed=0)
    x, y = splits.train.inputs, splits.train.targets
    groups = np.array(splits.info["superclass_of"])
    assert sorted(np.bincount(groups).tolist()) == [5] * 8
    means = torch.stack([x[y == c].mean(0) for c in range(40)])
    dist = torch.cdist(means, means)
    same = torch.from_numpy(groups[:, None] == groups[None, :]) & ~torch.eye(40, dtype=torch.bool)
    other = torch.from_numpy(groups[:, None] != groups[None, :])
    assert dist[same].mean() < 0.7 * dist[other].mean()
    # the classes of a group overlap: a nearest-class-mean rule is often wrong inside the group
    nearest = torch.cdist(splits.test.inputs, means).argmin(1)
    correct = nearest == splits.test.targets
    in_group = torch.from_numpy(groups[nearest.numpy()] == groups[splits.test.targets.numpy()])
    assert correct.float().mean() < 0.75 and in_group.float().mean() > 0.8


def test_synthetic_images_and_bad_config():
    splits = build_datasets(
        {
            "name": "synthetic",
            "form": "images",
            "train_size": 100,
            "val_size": 40,
            "test_size": 40,
            "num_classes": 10,
            "num_superclasses": 2,
        },
        seed=0,
    )
    x, _, _ = splits.train[0]
    assert x.shape == (3, 32, 32) and splits.input_shape == (3, 32, 32)
    assert 0.3 < splits.train.inputs.std() < 3
    with pytest.raises(ValueError, match="data.form"):
        build_datasets({"name": "synthetic", "form": "pixels"})
    with pytest.raises(ValueError, match="data.colour"):
        build_datasets({"name": "synthetic", "colour": 3})
    with pytest.raises(ValueError, match="data.train_size"):
        build_datasets({"name": "synthetic", "train_size": 10})
    with pytest.raises(ValueError, match="data.name"):
        build_datasets({"name": "mnist"})
