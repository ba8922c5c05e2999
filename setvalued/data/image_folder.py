"""A researcher's own images in class subfolders: ``ROOT/train/<class>/<image>``, optional
``ROOT/val/<class>/...`` and ``ROOT/test/<class>/...`` (torchvision's ImageFolder layout).

- Classes: the subfolders of ``train``, sorted by name (as ImageFolder sorts them); ``val`` and
  ``test`` may hold only classes of ``train``. Every class folder holds at least one image.
- Splits: a missing ``val`` or ``test`` is held out of ``train``, ``val_fraction`` /
  ``test_fraction`` of every class, by a permutation seeded by ``split_seed`` (not the trial
  seed: every trial sees the same split; ``common.held_out_parts``).
- Size: ``image_size: S`` resizes every image's shorter side to S and crops its centre to S x S
  (torchvision's Resize(S) + CenterCrop(S)); ``image_size: null`` keeps the images' own size,
  which must then be one size for all (32 x 32 PNGs train at 32 x 32, not at ImageNet's 224).
- Normalisation: the per-channel mean and std of the *training* split's pixels.
- Augmentation of the training split: ``none``; ``crop_flip``, the CIFAR protocol of the papers
  ([Gar23] §4.4.4, [BZK18] §5.1: random crop after zero-padding by S/8, horizontal flip);
  ``crop``, the same without flip (no flip, as the Pl@ntNet-300K protocol, [Gar23] §3.3.2).
- The images are decoded once into memory as uint8, so the splits are CIFAR-like tensors that
  ``data.placement: device`` holds on the training device (``setvalued.data.device``).

Every file is read within the bounds of docs/read-back.md before it is decoded: a regular file
of 1 byte to ``MAX_FILE_BYTES``, a header naming at most ``MAX_PIXELS`` pixels, one of the
formats of ``FORMATS``, at most ``MAX_FILES`` images and ``MAX_DECODED_BYTES`` in memory.
``check_layout`` (the driver's preflight, before the first trial) decodes every image, so a
truncated, empty or unreadable file is named before anything starts.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from setvalued.data.common import (
    IMAGE_EXTENSIONS,
    DataLayoutError,
    DataSplits,
    TensorSplit,
    channel_statistics,
    counts_of,
    declared_settings,
    held_out_parts,
    layout_error,
    standardized,
)
from setvalued.data.device import BatchAugmentation

SPLITS = ("train", "val", "test")
EXPECTED_LAYOUT = (
    "ROOT/train/<class>/<image>, and optionally ROOT/val/<class>/... and "
    "ROOT/test/<class>/... (PNG, JPEG, BMP, WebP, TIFF or PPM files; every class "
    "folder with at least one image; val and test only with classes of train)"
)
#: the PIL decoders an image may use (the formats of ``common.IMAGE_EXTENSIONS``)
FORMATS = ("PNG", "JPEG", "BMP", "WEBP", "TIFF", "PPM")
#: bounds on what is read (docs/read-back.md)
MAX_FILE_BYTES = 64 * 2**20
MAX_PIXELS = 4096 * 4096
MAX_FILES = 1_000_000
MAX_DECODED_BYTES = 16 * 2**30
_SPLIT_STREAM = 0x494D47  # "IMG": the held-out splits' permutation stream


@dataclass
class Listing:
    """The image files of an image folder: per split, its paths and class indices."""

    root: str
    classes: list[str]
    files: dict[str, tuple[list[str], list[int]]]  # split -> (paths, labels), present splits only


def settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The image_folder fields of a data config, checked against their declarations."""
    return declared_settings("image_folder", cfg)


def list_folder(root: Any) -> Listing:
    """The classes and image files of ``root`` (names only: nothing is opened)."""
    if root is None:
        raise layout_error("<data.root not set>", "data.root is required for image_folder", EXPECTED_LAYOUT)
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise layout_error(root, "image folder does not exist", EXPECTED_LAYOUT)
    if not os.path.isdir(os.path.join(root, "train")):
        raise layout_error(os.path.join(root, "train"), "no train folder", EXPECTED_LAYOUT)
    scanned: dict[str, dict[str, list[str]]] = {}
    total = 0
    for split in SPLITS:
        folder = os.path.join(root, split)
        if not os.path.isdir(folder):
            continue
        with os.scandir(folder) as entries:
            classes = sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))
        if not classes:
            raise layout_error(folder, "no class folders", EXPECTED_LAYOUT)
        scanned[split] = {}
        for name in classes:
            files = _image_files(os.path.join(folder, name), MAX_FILES - total)
            if not files:
                raise layout_error(
                    os.path.join(folder, name), "class folder without images (an empty class)", EXPECTED_LAYOUT
                )
            total += len(files)
            if total > MAX_FILES:
                raise layout_error(
                    root, f"more than {MAX_FILES:,} images (the bound of docs/read-back.md)", EXPECTED_LAYOUT
                )
            scanned[split][name] = files
    classes = list(scanned["train"])
    index = {name: i for i, name in enumerate(classes)}
    found: dict[str, tuple[list[str], list[int]]] = {}
    for split, by_class in scanned.items():
        unknown = [name for name in by_class if name not in index]
        if unknown:
            raise layout_error(
                os.path.join(root, split, unknown[0]), f"class folder(s) not in train: {unknown[:5]}", EXPECTED_LAYOUT
            )
        paths, labels = [], []
        for name, names in by_class.items():
            paths += [os.path.join(root, split, name, f) for f in names]
            labels += [index[name]] * len(names)
        found[split] = (paths, labels)
    return Listing(root, classes, found)


def _image_files(folder: str, limit: int) -> list[str]:
    """The names of the image files in ``folder``, sorted: every entry with an image ending that
    is not a folder (a FIFO or device named *.png is listed, and refused when opened), hidden
    files (``._x.png``, macOS's resource forks) left out; the listing stops past ``limit``."""
    names = []
    with os.scandir(folder) as entries:
        for e in entries:
            if e.name.lower().endswith(IMAGE_EXTENSIONS) and not e.name.startswith(".") and not e.is_dir():
                names.append(e.name)
                if len(names) > limit:
                    break
    return sorted(names)


def _open(path: str) -> Any:
    """The PIL image of ``path`` after the file checks (kind, size) and the header checks
    (format, pixel count), not yet decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        info = os.stat(path)
    except OSError as err:
        raise DataLayoutError(f"cannot read image file {path!r}: {err.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise DataLayoutError(f"image file {path!r} is not a regular file")
    if info.st_size == 0:
        raise DataLayoutError(f"image file {path!r} is empty (0 bytes)")
    if info.st_size > MAX_FILE_BYTES:
        raise DataLayoutError(
            f"image file {path!r} has {info.st_size:,} bytes, more than the {MAX_FILE_BYTES:,} of docs/read-back.md"
        )
    try:
        img = Image.open(path, formats=FORMATS)
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as err:
        raise DataLayoutError(f"cannot read image file {path!r}: {err}") from None
    width, height = img.size
    if width * height > MAX_PIXELS:
        img.close()
        raise DataLayoutError(
            f"image file {path!r} declares {width} x {height} pixels, more than the {MAX_PIXELS:,} of docs/read-back.md"
        )
    return img


def image_size_of(path: str) -> tuple[int, int]:
    """(width, height) from the header of an image file (checked, not decoded)."""
    img = _open(path)
    size = img.size
    img.close()
    return size


def decode(path: str, image_size: int | None, shape: tuple[int, int, int] | None = None) -> np.ndarray:
    """The image as uint8 (3, H, W) RGB, resized and centre-cropped to ``image_size`` when set;
    without it, an image whose size is not ``shape``'s (the first image's) is refused by name."""
    from PIL import Image

    img = _open(path)
    if image_size is None and shape is not None and img.size != (shape[2], shape[1]):
        img.close()
        raise DataLayoutError(
            f"image file {path!r} is {img.size[0]} x {img.size[1]} pixels, but the first "
            f"image is {shape[2]} x {shape[1]}: images of several sizes need "
            "data.image_size"
        )
    try:
        with img:
            img.load()
            rgb = img.convert("RGB")
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as err:
        raise DataLayoutError(f"cannot read image file {path!r}: {err}") from None
    if image_size is not None and rgb.size != (image_size, image_size):
        width, height = rgb.size
        scale = image_size / min(width, height)
        size = (max(image_size, round(width * scale)), max(image_size, round(height * scale)))
        rgb = rgb.resize(size, Image.Resampling.BILINEAR, reducing_gap=None)
        left, top = (size[0] - image_size) // 2, (size[1] - image_size) // 2
        rgb = rgb.crop((left, top, left + image_size, top + image_size))
    return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)


def image_shape(listing: Listing, image_size: int | None, augmentation: str) -> tuple[int, int, int]:
    """(3, H, W) of the decoded images: ``image_size``, or the first image's own size from its
    header (``decode`` then names any image of another size). Raises when the images would not
    fit the memory bound, before any is decoded."""
    paths = [p for split in listing.files.values() for p in split[0]]
    if image_size is not None:
        shape = (3, image_size, image_size)
    else:
        width, height = image_size_of(paths[0])
        shape = (3, height, width)
    if augmentation != "none" and shape[1] != shape[2]:
        raise DataLayoutError(
            f"data.augmentation: {augmentation} crops square images, but the images of "
            f"{listing.root!r} are {shape[2]} x {shape[1]}; set data.image_size"
        )
    decoded = len(paths) * int(np.prod(shape)) * 4  # float32 in memory
    if decoded > MAX_DECODED_BYTES:
        raise DataLayoutError(
            f"the {len(paths):,} images of {listing.root!r} at {shape[2]} x {shape[1]} "
            f"take {decoded / 2**30:.1f} GiB in memory, more than the "
            f"{MAX_DECODED_BYTES / 2**30:.0f} GiB of docs/read-back.md; set a smaller "
            "data.image_size"
        )
    return shape


def held_out_splits(listing: Listing, v: dict[str, Any]) -> dict[str, np.ndarray]:
    """The indices into the train folder's images of the splits held out of it (``val``, ``test``
    when their folder is absent) and of what stays in ``train``; {} when both folders exist."""
    return held_out_parts(
        np.asarray(listing.files["train"][1]),
        listing.files,
        v,
        _SPLIT_STREAM,
        lambda split, fraction: layout_error(
            os.path.join(listing.root, "train"),
            f"data.{split}_fraction={fraction} holds "
            f"out no image (too few per class); add a {split} folder or raise the fraction",
            EXPECTED_LAYOUT,
        ),
    )


def check_layout(cfg: dict[str, Any]) -> None:
    """The preflight: the layout, every file's bounds and a full decode of every image, so
    that a bad file is named before the first trial (each trial decodes again in ``build``)."""
    v = settings(cfg)
    listing = list_folder(v["root"])
    shape = image_shape(listing, v["image_size"], v["augmentation"])
    held_out_splits(listing, v)
    for paths, _ in listing.files.values():
        for path in paths:
            decode(path, v["image_size"], shape)


def _decode_all(paths: list[str], shape: tuple[int, int, int], image_size: int | None) -> torch.Tensor:
    out = np.empty((len(paths), *shape), dtype=np.uint8)
    for i, path in enumerate(paths):
        out[i] = decode(path, image_size, shape)
    return torch.from_numpy(out)


def augmentation_of(kind: str, size: int, mean: tuple[float, ...], std: tuple[float, ...]) -> BatchAugmentation | None:
    """The training augmentation ``kind`` as a whole-batch operation (None for ``none``)."""
    if kind == "none":
        return None
    return BatchAugmentation(size=size, padding=size // 8, flip=kind == "crop_flip", mean=mean, std=std)


def per_image_transform(augmentation: BatchAugmentation) -> Any:
    """The same augmentation per image (torchvision), for DataLoader workers."""
    from torchvision.transforms import v2

    steps = [v2.RandomCrop(augmentation.size, padding=augmentation.padding)]
    if augmentation.flip:
        steps.append(v2.RandomHorizontalFlip())
    return v2.Compose(
        steps + [v2.ToDtype(torch.float32, scale=True), v2.Normalize(augmentation.mean, augmentation.std)]
    )


def build(cfg: dict[str, Any], seed: int) -> DataSplits:
    """The image_folder splits of a ``data`` config; ``seed`` (the trial seed) is not used."""
    v = settings(cfg)
    listing = list_folder(v["root"])
    shape = image_shape(listing, v["image_size"], v["augmentation"])
    images = {split: _decode_all(paths, shape, v["image_size"]) for split, (paths, _) in listing.files.items()}
    labels = {split: np.asarray(lab, dtype=np.int64) for split, (_, lab) in listing.files.items()}
    parts = held_out_splits(listing, v)
    for split, idx in list(parts.items())[::-1]:  # train last
        images[split], labels[split] = images["train"][idx], labels["train"][idx]
    held_out = {split: len(idx) for split, idx in parts.items() if split != "train"}

    num_classes = len(listing.classes)
    class_counts = counts_of(labels["train"], num_classes)
    mean, std = channel_statistics(images["train"], scale=255.0)
    augmentation = augmentation_of(v["augmentation"], shape[1], mean, std)
    common: dict[str, Any] = dict(num_classes=num_classes, class_counts=class_counts, class_names=listing.classes)
    splits = {}
    for split in SPLITS:
        y = torch.from_numpy(labels[split])
        if split == "train" and augmentation is not None:
            ds = TensorSplit(images[split], y, split=split, transform=per_image_transform(augmentation), **common)
            ds.batch_augmentation = augmentation  # the same, a batch at a time on the device
        else:
            ds = TensorSplit(standardized(images[split], mean, std, scale=255.0), y, split=split, **common)
        splits[split] = ds
    info = {"folder": listing.root, "mean": list(mean), "std": list(std), "held_out_of_train": held_out}
    return DataSplits(
        splits["train"],
        splits["val"],
        splits["test"],
        num_classes=num_classes,
        class_counts=class_counts,
        class_names=listing.classes,
        input_shape=shape,
        info=info,
    )
