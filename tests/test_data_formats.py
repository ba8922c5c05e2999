"""The researcher's own data: ``image_folder`` (PNG class folders written with PIL) and
``arrays`` (.npz files written with NumPy), their splits, normalisation and shot groups checked
against brute force, and their hostile variants refused by name before the first trial."""

from __future__ import annotations

import os
import struct
import zipfile
import zlib

import numpy as np
import pytest
import torch
import yaml

from setvalued.data import DataLayoutError, build_datasets, check_layout
from setvalued.data import arrays as arrays_module
from setvalued.metrics import shot_groups
from setvalued.training import fit

torch.set_num_threads(1)


# -------------------------------------------------------------------------------------------
# image_folder
# -------------------------------------------------------------------------------------------


def _pixels(index: int, size=(8, 8)) -> np.ndarray:
    """An RGB image whose pixels encode ``index`` (so a split's images can be told apart)."""
    rng = np.random.default_rng(index)
    img = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    img[0, 0] = (index % 256, index // 256, 7)
    return img


def write_folder(root, counts: dict[str, dict[str, int]], size=(8, 8)) -> dict[str, np.ndarray]:
    """PNG files ``root/<split>/<class>/<i>.png``; returns the (n, 3, H, W) uint8 images per split
    in the order the loader lists them (classes sorted, files sorted by name)."""
    from PIL import Image

    index, written = 0, {}
    for split, per_class in counts.items():
        images = []
        for name in sorted(per_class):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class[name]):  # listed by name: in this order
                img = _pixels(index, size)
                Image.fromarray(img).save(folder / f"{i:04d}.png")
                images.append(img.transpose(2, 0, 1))
                index += 1
        written[split] = np.stack(images)
    return written


def test_image_folder_keeps_the_images_size_and_normalises_with_the_training_statistics(tmp_path):
    counts = {"train": {"b_dog": 6, "a_cat": 4}, "val": {"a_cat": 2, "b_dog": 1}, "test": {"b_dog": 3}}
    written = write_folder(tmp_path, counts, size=(32, 32))
    (tmp_path / "train" / "a_cat" / "._0000.png").write_bytes(b"\0\5\x16\7")  # macOS resource fork: left out
    data = build_datasets({"name": "image_folder", "root": str(tmp_path)})
    assert data.input_shape == (3, 32, 32)  # the images' own size: no resize to 224
    assert data.class_names == ["a_cat", "b_dog"] and data.num_classes == 2
    assert data.class_counts == [4, 6] and data.train.targets.tolist() == [0] * 4 + [1] * 6
    assert data.val.targets.tolist() == [0, 0, 1] and data.test.targets.tolist() == [1, 1, 1]
    # brute force: per-channel mean and std of the training pixels in [0, 1]
    train = written["train"].astype(np.float64) / 255
    mean, std = train.mean(axis=(0, 2, 3)), train.std(axis=(0, 2, 3))
    np.testing.assert_allclose(data.info["mean"], mean, rtol=1e-9)
    np.testing.assert_allclose(data.info["std"], std, rtol=1e-9)
    for split in ("train", "val", "test"):
        expected = (written[split] / 255 - mean[None, :, None, None]) / std[None, :, None, None]
        np.testing.assert_allclose(getattr(data, split).inputs.numpy(), expected, atol=1e-5)
    # shot groups from the training counts (as every data set: common.py)
    groups = shot_groups(data.class_counts, (5, 5))
    assert groups["few"].tolist() == [True, False] and groups["many"].tolist() == [False, True]


def test_image_folder_holds_out_a_seeded_stratified_split_of_train(tmp_path):
    per_class = {"c0": 40, "c1": 20, "c2": 7, "c3": 1}
    write_folder(tmp_path, {"train": per_class})
    cfg = {"name": "image_folder", "root": str(tmp_path), "val_fraction": 0.2, "test_fraction": 0.1}
    data = build_datasets(cfg, seed=0)

    def ids(split):  # the first pixel's red and green values encode the image's index
        raw = (
            split.inputs[:, :2, 0, 0].double() * torch.tensor(data.info["std"][:2]).double()
            + torch.tensor(data.info["mean"][:2]).double()
        )
        return sorted(int(round(r * 255)) + 256 * int(round(g * 255)) for r, g in raw.tolist())

    sizes = {s: counts_of_split(getattr(data, s), 4) for s in ("train", "val", "test")}
    # floor(share * n + 1/2) per class; a class of one image stays in train
    assert sizes["val"] == [8, 4, 1, 0] and sizes["test"] == [4, 2, 1, 0]
    assert sizes["train"] == [28, 14, 5, 1] == data.class_counts
    every = ids(data.train) + ids(data.val) + ids(data.test)
    assert sorted(every) == list(range(68))  # disjoint, and together the whole train folder
    again = build_datasets(cfg, seed=5)  # the trial seed does not move the split
    assert ids(again.val) == ids(data.val) and ids(again.test) == ids(data.test)
    other = build_datasets({**cfg, "split_seed": 7}, seed=0)
    assert ids(other.val) != ids(data.val)
    assert counts_of_split(other.val, 4) == sizes["val"]


def counts_of_split(split, num_classes):
    return torch.bincount(split.targets, minlength=num_classes).tolist()


def test_image_folder_resizes_to_image_size_and_augments_like_cifar(tmp_path):
    write_folder(tmp_path, {"train": {"a": 3, "b": 3}, "val": {"a": 1}, "test": {"b": 1}}, size=(20, 12))
    data = build_datasets(
        {"name": "image_folder", "root": str(tmp_path), "image_size": 16, "augmentation": "crop_flip"}
    )
    assert data.input_shape == (3, 16, 16) and data.val.inputs.shape == (1, 3, 16, 16)
    aug = data.train.batch_augmentation
    assert data.train.inputs.dtype == torch.uint8 and (aug.size, aug.padding, aug.flip) == (16, 2, True)
    assert tuple(aug.mean) == tuple(data.info["mean"])
    assert data.train[0][0].shape == (3, 16, 16)  # the per-image form, for loader workers
    crop = build_datasets({"name": "image_folder", "root": str(tmp_path), "image_size": 16, "augmentation": "crop"})
    assert crop.train.batch_augmentation.flip is False


def _truncated_png(path):
    from PIL import Image

    Image.fromarray(_pixels(1)).save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _png_declaring(path, width, height):
    """A PNG whose header declares ``width`` x ``height`` pixels (and holds almost none)."""

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


HOSTILE_FOLDERS = {
    "truncated": (lambda root: _truncated_png(root / "train" / "a" / "bad.png"), "train/a/bad.png", "cannot read"),
    "empty file": (lambda root: (root / "train" / "a" / "bad.png").write_bytes(b""), "train/a/bad.png", "0 bytes"),
    "not an image": (
        lambda root: (root / "train" / "b" / "bad.png").write_text("import os"),
        "train/b/bad.png",
        "cannot read",
    ),
    "decompression bomb": (
        lambda root: _png_declaring(root / "train" / "a" / "bad.png", 5000, 5000),
        "train/a/bad.png",
        "5000 x 5000 pixels",
    ),
    "empty class": (lambda root: (root / "train" / "c").mkdir(), "train/c", "empty class"),
    "class only in val": (lambda root: write_folder(root, {"val": {"z": 1}}), "val/z", "not in train"),
    "mixed sizes": (
        lambda root: write_folder(root, {"test": {"a": 1}}, size=(9, 8)),
        "test/a/0000.png",
        "data.image_size",
    ),
    "a FIFO": (lambda root: os.mkfifo(root / "train" / "a" / "bad.png"), "train/a/bad.png", "not a regular file"),
    "no train folder": (lambda root: (root / "train").rename(root / "training"), "train", "no train folder"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_FOLDERS))
def test_a_hostile_image_folder_is_refused_naming_the_file(tmp_path, kind):
    write_folder(tmp_path, {"train": {"a": 4, "b": 4}})
    spoil, named, problem = HOSTILE_FOLDERS[kind]
    spoil(tmp_path)
    cfg = {"name": "image_folder", "root": str(tmp_path), "val_fraction": 0.25, "test_fraction": 0.25}
    for check in (check_layout, build_datasets):  # the preflight, and each trial's build
        with pytest.raises(DataLayoutError) as err:
            check(cfg)
        assert str(tmp_path / named) in str(err.value) and problem in str(err.value), str(err.value)


def test_too_small_a_share_of_train_is_refused_before_the_first_trial(tmp_path):
    write_folder(tmp_path, {"train": {"a": 3, "b": 3}})
    with pytest.raises(DataLayoutError, match="val_fraction=0.1 holds out no image"):
        check_layout({"name": "image_folder", "root": str(tmp_path)})


def assert_device_as_loader(cfg):
    """``fit`` with the data held on the device and through a DataLoader: the same history (but
    its timings) and the same test metrics."""
    results = []
    for placement in ("device", "loader"):
        cfg["data"]["placement"] = placement
        results.append(fit(cfg, 0))
    strip = [[{k: v for k, v in h.items() if not k.endswith("time_s")} for h in r["history"]] for r in results]
    assert strip[0] == strip[1] and results[0]["test"] == results[1]["test"]


def test_image_folder_trains_a_cnn_on_the_device_as_through_the_loader(tmp_path):
    write_folder(tmp_path, {"train": {"a": 8, "b": 8}, "val": {"a": 2, "b": 2}, "test": {"a": 2, "b": 2}})
    cfg = {
        "data": {"name": "image_folder", "root": str(tmp_path)},
        "model": {"name": "small_cnn", "hidden_dim": 4},
        "loss": {"name": "ce"},
        "optim": {"lr": 0.1, "batch_size": 8, "milestones": []},
        "epochs": 2,
        "eval": {"ks": [1], "selection": "val/top1"},
        "device": "cpu",
    }
    assert_device_as_loader(cfg)


# -------------------------------------------------------------------------------------------
# arrays
# -------------------------------------------------------------------------------------------


def test_arrays_of_vectors_hold_out_a_split_and_normalise_per_feature(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, (90, 5)).astype(np.float64)
    y = np.repeat([0, 1, 2], [50, 30, 10])
    np.savez(tmp_path / "set.npz", x=x, y=y)
    cfg = {"name": "arrays", "root": str(tmp_path / "set.npz"), "val_fraction": 0.2, "test_fraction": 0.2}
    check_layout(cfg)
    data = build_datasets(cfg)
    assert data.input_shape == (5,) and data.num_classes == 3
    assert counts_of_split(data.val, 3) == [10, 6, 2] == counts_of_split(data.test, 3)
    assert data.class_counts == [30, 18, 6] == counts_of_split(data.train, 3)
    # brute force: the training rows, found by value, give the statistics
    train_rows = np.isin(np.arange(90), _rows_of(x, data.train.inputs, data.info))
    mean, std = x[train_rows].mean(axis=0), x[train_rows].std(axis=0)
    np.testing.assert_allclose(data.info["mean"], mean, rtol=1e-6)  # of x as float32
    np.testing.assert_allclose(data.info["std"], std, rtol=1e-6)
    np.testing.assert_allclose(data.train.inputs.mean(0).numpy(), 0, atol=1e-5)
    raw = build_datasets({**cfg, "normalize": False})
    np.testing.assert_allclose(raw.val.inputs.numpy(), x[_rows_of(x, data.val.inputs, data.info)], rtol=1e-6)


def _rows_of(x, normalised, info):
    """Positions in ``x`` of the rows of a normalised split (matched by value)."""
    restored = normalised.double().numpy() * np.asarray(info["std"]) + np.asarray(info["mean"])
    return [int(np.argmin(np.abs(x - row).sum(axis=1))) for row in restored]


def test_arrays_of_images_in_either_layout_are_the_same_nchw_pixels(tmp_path):
    rng = np.random.default_rng(1)
    nchw = {s: rng.integers(0, 256, (n, 3, 6, 6), dtype=np.uint8) for s, n in (("train", 12), ("val", 4), ("test", 4))}
    labels = {s: np.arange(len(v)) % 3 for s, v in nchw.items()}
    for layout, folder in (("nchw", tmp_path / "first"), ("nhwc", tmp_path / "last")):
        folder.mkdir()
        for s in nchw:
            x = nchw[s] if layout == "nchw" else nchw[s].transpose(0, 2, 3, 1)
            np.savez_compressed(folder / f"{s}.npz", x=x, y=labels[s])
    first = build_datasets({"name": "arrays", "root": str(tmp_path / "first")})
    last = build_datasets({"name": "arrays", "root": str(tmp_path / "last")})
    assert first.input_shape == last.input_shape == (3, 6, 6)
    train = nchw["train"] / 255.0
    mean, std = train.mean(axis=(0, 2, 3)), train.std(axis=(0, 2, 3))
    for s in nchw:
        expected = (nchw[s] / 255.0 - mean[None, :, None, None]) / std[None, :, None, None]
        np.testing.assert_allclose(getattr(first, s).inputs.numpy(), expected, atol=1e-5)
        assert torch.equal(getattr(first, s).inputs, getattr(last, s).inputs)
        assert getattr(first, s).supports_batches  # the device placement holds them as CIFAR's


def test_arrays_train_an_mlp_on_the_device_as_through_the_loader(tmp_path):
    rng = np.random.default_rng(2)
    np.savez(tmp_path / "v.npz", x=rng.normal(size=(80, 6)).astype(np.float32), y=np.arange(80) % 4)
    cfg = {
        "data": {"name": "arrays", "root": str(tmp_path / "v.npz")},
        "model": {"name": "mlp", "hidden_dim": 8},
        "loss": {"name": "ce"},
        "optim": {"lr": 0.1, "batch_size": 16, "milestones": []},
        "epochs": 2,
        "eval": {"ks": [1, 3], "selection": "val/top3"},
        "device": "cpu",
    }
    assert_device_as_loader(cfg)


def _write(path, **arrays):
    np.savez(path, **arrays)


def _pickled(path):
    """An .npz whose x is a pickle (allow_pickle=True would run it)."""
    with zipfile.ZipFile(path, "w") as z:
        with z.open("x.npy", "w") as f:
            np.lib.format.write_array(f, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
        with z.open("y.npy", "w") as f:
            np.lib.format.write_array(f, np.array([0, 1]))


def _declares_more_than_it_holds(path):
    """x.npy whose header declares 10**12 floats over a few bytes."""
    header = {"descr": "<f8", "fortran_order": False, "shape": (10**12,)}
    with zipfile.ZipFile(path, "w") as z:
        with z.open("x.npy", "w") as f:
            np.lib.format.write_array_header_1_0(f, header)
            f.write(b"\0" * 64)
        with z.open("y.npy", "w") as f:
            np.lib.format.write_array(f, np.zeros(1, dtype=np.int64))


def _zip64_claiming_many_members(path):
    """A valid .npz whose added zip64 end record (which zipfile reads first) claims 10**7 members."""
    np.savez(path, x=np.zeros((4, 2)), y=np.array([0, 1, 0, 1]))
    data = path.read_bytes()
    end = data.rfind(b"PK\x05\x06")
    record = b"PK\x06\x06" + struct.pack("<QHHIIQQQQ", 44, 45, 45, 0, 0, 10**7, 10**7, 2**20, 0)
    locator = b"PK\x06\x07" + struct.pack("<IQI", 0, end, 1)
    path.write_bytes(data[:end] + record + locator + data[end:])


def _many_members(path):
    with zipfile.ZipFile(path, "w") as z:
        for i in range(arrays_module.MAX_MEMBERS + 1):
            z.writestr(f"m{i}.npy", b"")


HOSTILE_ARRAYS = {
    "object array": (_pickled, "object array"),
    "labels out of range": (
        lambda p: _write(p, x=np.zeros((4, 2)), y=np.array([0, 1, -1, 1])),
        "label -1 at example 2, outside 0..1",
    ),
    "length mismatch": (lambda p: _write(p, x=np.zeros((4, 2)), y=np.array([0, 1, 1])), "4 inputs x but 3 labels"),
    "strings": (lambda p: _write(p, x=np.array([["a", "b"]] * 4), y=np.array([0, 1, 0, 1])), "dtype <U1"),
    "complex": (lambda p: _write(p, x=np.zeros((4, 2), complex), y=np.array([0, 1, 0, 1])), "dtype complex128"),
    "float labels": (
        lambda p: _write(p, x=np.zeros((4, 2)), y=np.array([0.0, 1.0, 0.0, 1.0])),
        "expected integer labels",
    ),
    "no y": (lambda p: _write(p, x=np.zeros((4, 2))), "no array 'y'"),
    "a NaN feature": (
        lambda p: _write(p, x=np.array([[0, 1], [2, 3], [4, np.nan], [5, 6]]), y=np.array([0, 1, 0, 1])),
        "'x' of {path!r} has a NaN or infinite value at example 2",
    ),
    "an infinite feature": (
        lambda p: _write(p, x=np.array([[0, 1], [np.inf, 3], [4, 5], [5, -np.inf]], "f4"), y=np.array([0, 1, 0, 1])),
        "'x' of {path!r} has a NaN or infinite value at example 1",
    ),
    "a NaN label": (
        lambda p: _write(p, x=np.zeros((4, 2)), y=np.array([0.0, np.nan, 0.0, 1.0])),
        "'y' of {path!r} has dtype float64 and a NaN or infinite label at example 1",
    ),
    "huge declared shape": (_declares_more_than_it_holds, "declares shape (1000000000000,)"),
    "too many members": (_many_members, "lists 65 members"),
    "zip64 record with many members": (_zip64_claiming_many_members, "lists 10000000 members"),
    "a huge label": (
        lambda p: _write(p, x=np.zeros((2, 2)), y=np.array([0, 2**40], dtype=np.uint64)),
        "implies 1,099,511,627,777 classes",
    ),
    "not a zip": (lambda p: p.write_bytes(b"\x80\x04\x95" + b"pickle" * 10), "not a .npz (zip) file"),
    "empty file": (lambda p: p.write_bytes(b""), "0 bytes"),
    "ambiguous layout": (lambda p: _write(p, x=np.zeros((4, 3, 5, 3)), y=np.array([0, 1, 0, 1])), "set data.layout"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_ARRAYS))
def test_hostile_arrays_are_refused_naming_the_file(tmp_path, kind):
    make, problem = HOSTILE_ARRAYS[kind]
    path = tmp_path / "set.npz"
    make(path)
    for check in (check_layout, build_datasets):
        with pytest.raises(DataLayoutError) as err:
            check({"name": "arrays", "root": str(path)})
        assert str(path) in str(err.value) and problem.format(path=str(path)) in str(err.value), str(err.value)


def test_a_compressed_array_past_the_size_bound_is_refused_before_it_is_inflated(tmp_path, monkeypatch):
    np.savez_compressed(tmp_path / "bomb.npz", x=np.zeros((2**18, 4)), y=np.zeros(2**18, dtype=np.int64))
    assert (tmp_path / "bomb.npz").stat().st_size < 2**16  # 8 MiB of x in a few KiB
    monkeypatch.setattr(arrays_module, "MAX_ARRAY_BYTES", 2**20)
    inflated = []
    monkeypatch.setattr(np.lib.format, "read_array", lambda *a, **k: inflated.append(1))
    with pytest.raises(DataLayoutError, match=r"array 'x' of .*bomb.npz' declares 8,388,736 bytes"):
        check_layout({"name": "arrays", "root": str(tmp_path / "bomb.npz")})
    assert inflated == []


def test_labels_past_num_classes_or_the_training_labels_are_refused(tmp_path):
    _write(tmp_path / "train.npz", x=np.zeros((4, 2)), y=np.array([0, 1, 2, 1]))
    _write(tmp_path / "val.npz", x=np.zeros((2, 2)), y=np.array([0, 3]))
    with pytest.raises(
        DataLayoutError,
        match=r"val.npz' has label 3 at example 1, outside 0..2 \(L = 3: the "
        r"largest training label \+ 1\)",
    ):
        check_layout({"name": "arrays", "root": str(tmp_path)})
    check_layout({"name": "arrays", "root": str(tmp_path), "num_classes": 4, "test_fraction": 0.3})
    with pytest.raises(DataLayoutError, match="outside 0..1"):
        check_layout({"name": "arrays", "root": str(tmp_path), "num_classes": 2})


# -------------------------------------------------------------------------------------------
# the command line: one clear line, exit 2, before anything starts
# -------------------------------------------------------------------------------------------


def test_bad_data_files_exit_2_with_one_line_naming_the_file_before_the_first_trial(tmp_path, capsys):
    from studies.cli import main

    write_folder(tmp_path / "images", {"train": {"a": 2, "b": 2}, "val": {"a": 1, "b": 1}, "test": {"a": 1}})
    (tmp_path / "images" / "train" / "b" / "0001.png").write_bytes(b"")
    _pickled(tmp_path / "set.npz")
    for data, named in (
        ({"name": "image_folder", "root": str(tmp_path / "images")}, "train/b/0001.png"),
        ({"name": "arrays", "root": str(tmp_path / "set.npz")}, "set.npz"),
    ):
        study = {
            "name": f"bad-{data['name'].replace('_', '-')}",
            "seeds": [0],
            "resources": {"cpus": 1},
            "base": {
                "data": data,
                "model": {"name": "mlp", "hidden_dim": 4},
                "loss": {"name": "ce"},
                "epochs": 1,
                "eval": {"ks": [1], "selection": "val/top1"},
                "device": "cpu",
            },
        }
        path = tmp_path / f"{study['name']}.yaml"
        path.write_text(yaml.safe_dump(study))
        code = main(
            [
                "run",
                str(path),
                "--tracking-uri",
                f"sqlite:///{tmp_path}/mlflow.db",
                "--output",
                str(tmp_path / "out"),
                "--no-report",
            ]
        )
        err = capsys.readouterr().err
        assert code == 2, err
        assert named in err and "Nothing was started" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "mlflow.db").exists()


def test_the_study_file_refuses_shares_that_leave_no_training_split(tmp_path, capsys):
    from studies.cli import main

    study = {
        "name": "shares",
        "seeds": [0],
        "base": {
            "data": {"name": "image_folder", "root": str(tmp_path), "val_fraction": 0.5, "test_fraction": 0.5},
            "loss": {"name": "ce"},
        },
    }
    path = tmp_path / "shares.yaml"
    path.write_text(yaml.safe_dump(study))
    assert main(["run", str(path), "--dry-run"]) == 2
    assert "data.val_fraction (0.5) + data.test_fraction (0.5) must be < 1" in capsys.readouterr().err


def test_the_preflight_checks_each_image_folder_config_that_reads_the_files_differently(tmp_path):
    from studies.running.preconditions import data_layouts

    write_folder(tmp_path, {"train": {"a": 4}, "val": {"a": 1}, "test": {"a": 1}})
    write_folder(tmp_path / "more", {"train": {"b": 1}}, size=(9, 8))
    (tmp_path / "more" / "train" / "b").rename(tmp_path / "train" / "b")
    sized = {"name": "image_folder", "root": str(tmp_path), "image_size": 8}
    problems = data_layouts([sized, dict(sized, num_workers=2), dict(sized, image_size=None)])
    assert len(problems) == 1 and "train/b/0000.png' is 9 x 8 pixels" in problems[0]
