"""CIFAR-100 from the official ``cifar-100-python`` folder, with the papers' split and label noise.

Protocol ([Gar23] §4.4.4, [BZK18] §5.1 and the authors' code; docs/papers.md, notes P-3
to P-5):

- 50,000 training images; ``val_size`` (default 5,000) of them are held out as a
  validation set with a permutation drawn from ``split_seed`` (default 1234), which does
  not depend on the trial seed, so every trial of a study sees the same split
  (docs/papers.md, erratum T-E17; ``stratified_split: true`` gives the balanced split of
  [Gar23] §5.6.2, erratum A-E8).
- Label noise on the remaining training images only: with probability p a label is
  redrawn uniformly among the 5 classes of its group, *the original one included*, so the
  expected fraction of changed labels is 0.8 p (docs/papers.md, erratum T-E6).
  ``noise_groups: consecutive`` uses ``label - label % 5 + U{0..4}`` on the fine labels, as
  the authors' code does (erratum T-E5); ``noise_groups: coarse`` uses the true superclasses
  read from the ``coarse_labels`` of the pickle, as the papers' text says. The noise is
  drawn from the trial seed. Validation and test labels stay clean.
- Train transform: RandomCrop(32, padding=4), RandomHorizontalFlip, Normalize with mean
  (125.3, 123.0, 113.9)/255 and std (63.0, 62.1, 66.7)/255; val/test: Normalize only. The
  training split carries it twice: per image (``transform``, for DataLoader workers) and per
  batch (``batch_augmentation``, for the split held on the training device; same distribution).

The pickles are read directly (same format as torchvision reads): torchvision's own class
verifies MD5 sums of the full files, so it would refuse the small files that the tests
write. torchvision is used for the download, and only when ``download: true``.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np
import torch

from setvalued.config import DATA_FIELDS
from setvalued.data.common import (
    DataLayoutError,
    DataSplits,
    TensorSplit,
    counts_of,
    layout_error,
    mix_seed,
)
from setvalued.data.device import BatchAugmentation

FOLDER = "cifar-100-python"
MEAN = tuple(v / 255.0 for v in (125.3, 123.0, 113.9))
STD = tuple(v / 255.0 for v in (63.0, 62.1, 66.7))
EXPECTED_LAYOUT = (
    f"ROOT/{FOLDER}/train, ROOT/{FOLDER}/test and ROOT/{FOLDER}/meta: the pickled dicts of the "
    "official 'CIFAR-100 python version' archive (train/test with 'data' (N x 3072 uint8), "
    "'fine_labels', 'coarse_labels'; meta with 'fine_label_names', 'coarse_label_names'). "
    "Set data.download: true to fetch it with torchvision"
)
GROUP_SIZE = 5
NOISE_GROUPS = ("consecutive", "coarse")
_NOISE_STREAM = 0x4E4F495345  # "NOISE": separates the label-noise stream from other uses of the seed


def resolve_folder(root: str | os.PathLike[str] | None, download: bool = False) -> str:
    """The ``cifar-100-python`` folder under ``root`` (or ``root`` itself if it is that folder)."""
    if root is None:
        raise DataLayoutError(f"data.root is required for cifar100. Expected layout: {EXPECTED_LAYOUT}")
    root = os.fspath(root)
    candidates = [os.path.join(root, FOLDER), root]
    for folder in candidates:
        if all(os.path.isfile(os.path.join(folder, name)) for name in ("train", "test", "meta")):
            return folder
    if download:
        from torchvision.datasets import CIFAR100

        os.makedirs(root, exist_ok=True)
        CIFAR100(root, train=True, download=True)
        CIFAR100(root, train=False, download=True)
        return os.path.join(root, FOLDER)
    if not os.path.isdir(root):
        raise layout_error(root, "CIFAR-100 folder does not exist", EXPECTED_LAYOUT)
    raise layout_error(candidates[0], "no CIFAR-100 train/test/meta files found", EXPECTED_LAYOUT)


#: the only globals the official CIFAR-100 pickles name: numpy's array reconstruction (numpy 1
#: and 2 module paths) and the bytes encoder of protocol-2 pickles
_CIFAR_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


class _CifarUnpickler(pickle.Unpickler):
    """Reads the official structure (dicts, lists, strings, bytes, numbers, numpy arrays) and
    nothing else: a pickle that names any other class or function is refused before anything
    of it runs, so a crafted file in a shared data folder cannot execute code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CIFAR_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"it names {module}.{name}, which is not part of the official "
            "CIFAR-100 files (refused: unpickling it could run code)"
        )


def _read_pickle(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            entry = _CifarUnpickler(f, encoding="latin1").load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, AttributeError, TypeError) as err:
        raise layout_error(path, f"cannot read the CIFAR-100 pickle ({err})", EXPECTED_LAYOUT) from err
    if not isinstance(entry, dict):
        raise layout_error(path, "the CIFAR-100 pickle does not hold a dict", EXPECTED_LAYOUT)
    # Python 2 pickles read with encoding="latin1" have str keys; tolerate bytes keys too.
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in entry.items()}


def _require(entry: dict[str, Any], key: str, path: str) -> Any:
    if key not in entry:
        raise layout_error(path, f"CIFAR-100 pickle has no key {key!r} (keys: {sorted(entry)})", EXPECTED_LAYOUT)
    return entry[key]


def read_split(folder: str, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Images (N, 3, 32, 32) uint8, fine labels and coarse labels of the ``train`` or ``test`` pickle."""
    path = os.path.join(folder, name)
    entry = _read_pickle(path)
    data = np.asarray(_require(entry, "data", path))
    fine = np.asarray(_require(entry, "fine_labels", path), dtype=np.int64)
    coarse = np.asarray(_require(entry, "coarse_labels", path), dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise layout_error(
            path, f"'data' has dtype {data.dtype} and shape {data.shape}, not uint8 (N, 3072)", EXPECTED_LAYOUT
        )
    if not (len(fine) == len(coarse) == len(data)):
        raise layout_error(
            path, f"{len(data)} images but {len(fine)} fine and {len(coarse)} coarse labels", EXPECTED_LAYOUT
        )
    return data.reshape(-1, 3, 32, 32), fine, coarse


def read_meta(folder: str) -> tuple[list[str], list[str]]:
    path = os.path.join(folder, "meta")
    entry = _read_pickle(path)
    return list(_require(entry, "fine_label_names", path)), list(_require(entry, "coarse_label_names", path))


def validation_split(
    labels: np.ndarray, val_size: int, split_seed: int, stratified: bool, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, val indices) of the official training set, fixed by ``split_seed``.

    Non-stratified: the first ``val_size`` positions of a random permutation (the authors'
    code, docs/papers.md, erratum T-E17). Stratified: ``val_size // L`` images of every
    class, plus one more for ``val_size % L`` classes drawn at random (erratum A-E8: 50 per
    class for 5,000 of 100 classes).
    """
    n = len(labels)
    if not 0 < val_size < n:
        raise ValueError(f"data.val_size must be in [1, {n - 1}] for this training set, got {val_size}")
    rng = np.random.default_rng(split_seed)
    if not stratified:
        perm = rng.permutation(n)
        val = np.sort(perm[:val_size])
    else:
        base, extra = divmod(val_size, num_classes)
        quota = np.full(num_classes, base)
        quota[rng.permutation(num_classes)[:extra]] += 1
        val_parts = []
        for c in range(num_classes):
            members = np.flatnonzero(labels == c)
            if len(members) <= quota[c]:
                raise ValueError(
                    f"data.stratified_split: class {c} has {len(members)} training "
                    f"images, cannot hold out {quota[c]} for validation"
                )
            val_parts.append(rng.permutation(members)[: quota[c]])
        val = np.sort(np.concatenate(val_parts))
    mask = np.ones(n, dtype=bool)
    mask[val] = False
    return np.flatnonzero(mask), val


def noise_groups(kind: str, num_classes: int, fine_to_coarse: np.ndarray | None) -> np.ndarray:
    """Group id of every fine class: ``label // 5`` (consecutive) or its superclass (coarse)."""
    if kind == "consecutive":
        if num_classes % GROUP_SIZE:
            raise ValueError(
                f"data.noise_groups: consecutive needs a multiple of {GROUP_SIZE} classes, got {num_classes}"
            )
        return np.arange(num_classes) // GROUP_SIZE
    if kind == "coarse":
        if fine_to_coarse is None:
            raise ValueError("data.noise_groups: coarse needs the coarse labels of the data set")
        return np.asarray(fine_to_coarse)
    raise ValueError(f"data.noise_groups must be one of {NOISE_GROUPS}, got {kind!r}")


def add_group_label_noise(
    labels: np.ndarray, p: float, groups: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Redraw each label with probability ``p`` uniformly among the classes of its group.

    The draw includes the original class, as the authors' code does (docs/papers.md,
    erratum T-E6), so with groups of 5 the expected fraction of changed labels is 0.8 p.
    Returns (new labels, mask of the redrawn examples).
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"data.label_noise must be a probability in [0, 1], got {p}")
    labels = np.asarray(labels, dtype=np.int64)
    redraw = rng.random(len(labels)) < p
    members = {g: np.flatnonzero(groups == g) for g in np.unique(groups)}
    noisy = labels.copy()
    picks = rng.random(len(labels))  # one uniform per example keeps the stream independent of p
    for i in np.flatnonzero(redraw):
        group = members[groups[labels[i]]]
        noisy[i] = group[min(int(picks[i] * len(group)), len(group) - 1)]
    return noisy, redraw


#: the papers' training augmentation as whole-batch operations (setvalued.data.device)
AUGMENTATION = BatchAugmentation(size=32, padding=4, flip=True, mean=MEAN, std=STD)


class Cifar100Train(TensorSplit):
    """Training split with augmentation; ``clean_targets`` and ``redrawn`` describe the noise."""

    #: the per-image ``transform`` as a batch operation, for the split held on the device
    batch_augmentation = AUGMENTATION
    #: the labels before the noise, and which of them the noise redrew (set by `build`)
    clean_targets: torch.Tensor
    redrawn: torch.Tensor


def build(cfg: dict[str, Any], seed: int) -> DataSplits:
    """The CIFAR-100 splits of a ``data`` config (docs/interfaces.md section 1)."""
    from torchvision.transforms import v2

    folder = resolve_folder(cfg.get("root"), bool(cfg.get("download", False)))
    train_x, train_fine, train_coarse = read_split(folder, "train")
    test_x, test_fine, _ = read_split(folder, "test")
    fine_names, coarse_names = read_meta(folder)
    num_classes = len(fine_names)
    for name, labels in (("train", train_fine), ("test", test_fine)):
        if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise layout_error(
                os.path.join(folder, name),
                f"fine labels outside 0..{num_classes - 1} (meta lists {num_classes} classes)",
                EXPECTED_LAYOUT,
            )

    fine_to_coarse = np.full(num_classes, -1, dtype=np.int64)
    for f, c in zip(train_fine, train_coarse):
        if fine_to_coarse[f] not in (-1, c):
            raise layout_error(
                os.path.join(folder, "train"),
                f"fine class {f} appears with two coarse labels ({fine_to_coarse[f]} and {c})",
                EXPECTED_LAYOUT,
            )
        fine_to_coarse[f] = c

    val_size = cfg.get("val_size")
    val_size = DATA_FIELDS["cifar100"]["val_size"].default if val_size is None else int(val_size)
    train_idx, val_idx = validation_split(
        train_fine, val_size, int(cfg.get("split_seed", 1234)), bool(cfg.get("stratified_split", False)), num_classes
    )

    p = float(cfg.get("label_noise", 0.0))
    kind = cfg.get("noise_groups", "consecutive")
    groups = noise_groups(kind, num_classes, fine_to_coarse if (fine_to_coarse >= 0).all() else None)
    clean = train_fine[train_idx]
    noisy, redrawn = add_group_label_noise(clean, p, groups, np.random.default_rng(mix_seed(seed, _NOISE_STREAM)))
    class_counts = counts_of(noisy, num_classes)

    normalize = v2.Normalize(MEAN, STD)
    train_transform = v2.Compose(
        [
            v2.RandomCrop(AUGMENTATION.size, padding=AUGMENTATION.padding),
            v2.RandomHorizontalFlip(),
            v2.ToDtype(torch.float32, scale=True),
            normalize,
        ]
    )

    def normalized(images: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(np.ascontiguousarray(images)).to(torch.float32).div_(255.0)
        mean = torch.tensor(MEAN).view(1, 3, 1, 1)
        std = torch.tensor(STD).view(1, 3, 1, 1)
        return (x - mean) / std

    common: dict[str, Any] = dict(num_classes=num_classes, class_counts=class_counts, class_names=fine_names)
    train = Cifar100Train(
        torch.from_numpy(np.ascontiguousarray(train_x[train_idx])),
        torch.from_numpy(noisy),
        split="train",
        transform=train_transform,
        **common,
    )
    train.clean_targets = torch.from_numpy(clean)
    train.redrawn = torch.from_numpy(redrawn)
    train.source_indices = torch.from_numpy(train_idx)
    val = TensorSplit(normalized(train_x[val_idx]), torch.from_numpy(train_fine[val_idx]), split="val", **common)
    val.source_indices = torch.from_numpy(val_idx)
    test = TensorSplit(normalized(test_x), torch.from_numpy(test_fine), split="test", **common)
    info = {
        "folder": folder,
        "label_noise": p,
        "noise_groups": kind,
        "changed_label_fraction": float((noisy != clean).mean()) if len(clean) else 0.0,
        "fine_to_coarse": fine_to_coarse.tolist(),
        "coarse_names": coarse_names,
    }
    return DataSplits(train, val, test, num_classes, class_counts, fine_names, (3, 32, 32), info)
