"""Pieces shared by every data set: the (input, label, index) contract, errors, splits.

Every data set of this package is a ``torch.utils.data.Dataset`` whose items are
``(input, label, index)``: ``index`` is the position of the example in its split, which
losses with per-example state (ROLE's label estimates) need. Every split also exposes

- ``num_classes``: the number of classes L;
- ``class_counts``: the number of *training* examples per class (the same list on the
  train, val and test splits, since margins and shot groups are defined by the training
  counts: [Gar23] eq. 4.13 and the captions of Tables 4.5, 4.6, 5.2; docs/papers.md,
  note P-6);
- ``targets``: the labels of this split, as a 1-D int64 tensor of class indices, or for
  multi-label data (synthetic, ``data.max_labels > 1``) an int64 (n, L) multi-hot matrix;
- ``class_names``: one name per class.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from setvalued.config import DATA_FIELDS, held_out_problem

if TYPE_CHECKING:
    from setvalued.data.device import BatchAugmentation

#: ImageNet channel statistics, used by every model pre-trained on ImageNet
#: (Pl@ntNet-300K and ImageNet-LT transforms, docs/papers.md, note P-3).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

#: File endings read as images in folder layouts (lower case).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


class DataLayoutError(FileNotFoundError, ValueError):
    """A data folder is missing or does not have the expected layout.

    It is both a ``FileNotFoundError`` (something on disk is missing) and a ``ValueError``
    (bad input, as every other configuration error), so callers can catch either.
    """


def layout_error(path: str | os.PathLike[str], problem: str, expected: str) -> DataLayoutError:
    """An error naming the path, what is wrong and the layout that was expected."""
    return DataLayoutError(f"{problem}: {os.fspath(path)!r}. Expected layout: {expected}")


def counts_of(labels: Sequence[int] | np.ndarray | torch.Tensor, num_classes: int) -> list[int]:
    """Number of examples of each class 0..num_classes-1."""
    labels = torch.as_tensor(np.asarray(labels), dtype=torch.int64)
    return torch.bincount(labels, minlength=num_classes).tolist()


class IndexedDataset(Dataset[tuple[Any, Any, int]]):
    """Base class: a split whose items are ``(input, label, index)``.

    Subclasses set ``targets``, ``num_classes``, ``class_counts`` and ``class_names`` and
    implement ``load(index) -> input``.
    """

    targets: torch.Tensor
    num_classes: int
    class_counts: list[int]
    class_names: list[str]
    split: str

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    def load(self, index: int) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[Any, Any, int]:
        index = int(index)
        label = self.targets[index]
        return self.load(index), (int(label) if label.dim() == 0 else label), index

    @property
    def split_counts(self) -> list[int]:
        """Number of examples of each class in this split (carrying it, for multi-label data)."""
        if self.targets.dim() == 2:
            return self.targets.sum(dim=0).tolist()
        return counts_of(self.targets, self.num_classes)


class TensorSplit(IndexedDataset):
    """A split held in memory as one tensor, with an optional per-example transform.

    Without a transform it offers ``get_batch(indices)``, which the trainer uses to skip
    the per-item DataLoader path (the synthetic data trains in seconds this way).
    """

    #: where a split drawn from a larger one came from (CIFAR-100's train and val), its
    #: examples' clarity (synthetic data), its transform as a batch operation on the device
    source_indices: torch.Tensor
    clarity: torch.Tensor
    batch_augmentation: BatchAugmentation | None

    def __init__(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        num_classes: int,
        class_counts: list[int],
        class_names: list[str],
        split: str,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(f"{split}: {inputs.shape[0]} inputs but {targets.shape[0]} labels")
        self.inputs = inputs
        self.targets = targets.to(torch.int64)
        self.num_classes = num_classes
        self.class_counts = list(class_counts)
        self.class_names = list(class_names)
        self.split = split
        self.transform = transform

    def load(self, index: int) -> torch.Tensor:
        x = self.inputs[index]
        return self.transform(x) if self.transform is not None else x

    @property
    def supports_batches(self) -> bool:
        return self.transform is None

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch ``(inputs, labels, indices)`` of the given indices (no transform)."""
        if self.transform is not None:
            raise RuntimeError("get_batch is only available for splits without a transform")
        return self.inputs[indices], self.targets[indices], indices


@dataclass
class DataSplits:
    """The three splits of a data set; unpacks as ``train, val, test = splits``."""

    train: IndexedDataset
    val: IndexedDataset
    test: IndexedDataset
    num_classes: int
    class_counts: list[int]
    class_names: list[str]
    input_shape: tuple[int, ...]
    info: dict[str, Any] = field(default_factory=dict)

    def __iter__(self) -> Iterator[IndexedDataset]:
        return iter((self.train, self.val, self.test))


def mix_seed(*parts: int) -> int:
    """A 63-bit seed derived from integers (e.g. (trial seed, epoch, purpose)).

    Uses NumPy's SeedSequence so that nearby inputs give unrelated streams.
    """
    state = np.random.SeedSequence([int(p) & 0xFFFFFFFFFFFFFFFF for p in parts]).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


def list_image_files(folder: str) -> list[str]:
    """Image files directly inside ``folder``, sorted by name."""
    with os.scandir(folder) as entries:
        return sorted(e.name for e in entries if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS))


def load_rgb(path: str) -> Any:
    """Open an image file as an RGB PIL image, naming the file when it cannot be read."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (OSError, UnidentifiedImageError) as err:
        raise DataLayoutError(f"cannot read image file {path!r}: {err}") from err


def stratified_holdout(labels: np.ndarray, fractions: dict[str, float], seed: int) -> dict[str, np.ndarray]:
    """Sorted indices of ``labels`` for ``"train"`` and for each held-out split of ``fractions``
    (name -> share), drawn per class: of a class's n examples, ``floor(share * n + 1/2)`` go to
    each held-out split (fewer, from the last split named, when they would leave the class no
    training example), chosen by a permutation seeded by ``seed``, the same for every trial."""
    labels = np.asarray(labels, dtype=np.int64)
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in ("train", *fractions)}
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        n = len(members)
        quota = [int(np.floor(share * n + 0.5)) for share in fractions.values()]
        for i in reversed(range(len(quota))):  # keep at least one training example
            quota[i] -= max(0, min(quota[i], sum(quota) - (n - 1)))
        start = 0
        for name, q in zip(fractions, quota):
            parts[name].append(members[start : start + q])
            start += q
        parts["train"].append(members[start:])
    return {name: np.sort(np.concatenate(p)) if p else np.zeros(0, dtype=np.int64) for name, p in parts.items()}


def held_out_parts(
    labels: np.ndarray, present: Any, settings: dict[str, Any], stream: int, refuse: Callable[[str, float], Exception]
) -> dict[str, np.ndarray]:
    """The indices into the training labels of the splits held out of them, one for each of
    ``val`` and ``test`` absent from ``present`` (its share ``settings["<split>_fraction"]``,
    seeded by ``settings["split_seed"]`` and the data set's ``stream``), and of what stays in
    ``train``; {} when both are present. ``refuse(split, fraction)`` is the error raised when a
    held-out split would get no example."""
    missing = {s: settings[f"{s}_fraction"] for s in ("val", "test") if s not in present}
    if not missing:
        return {}
    parts = stratified_holdout(labels, missing, mix_seed(settings["split_seed"], stream))
    for split, fraction in missing.items():
        if not len(parts[split]):
            raise refuse(split, fraction)
    return parts


def channel_statistics(
    x: torch.Tensor, scale: float = 1.0, chunk: int = 1024
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation of ``x / scale`` over images (n, C, H, W) or per
    feature over vectors (n, D), in float64: uint8 images from each channel's histogram of the
    256 values (exact), other inputs summed a chunk of examples at a time (no float64 copy of
    the whole split); a constant channel gets std 1 (it is only centred)."""
    channels = x.shape[1]
    if x.dtype == torch.uint8 and x.dim() == 4:
        values = torch.arange(256, dtype=torch.float64) / scale
        hist = torch.stack([torch.bincount(x[:, c].reshape(-1), minlength=256) for c in range(channels)]).double()
        count = hist.sum(dim=1).clamp_min(1)
        mean = (hist * values).sum(dim=1) / count
        var = (hist * (values[None, :] - mean[:, None]) ** 2).sum(dim=1) / count
    else:
        axes = (0, 2, 3) if x.dim() == 4 else (0,)
        total = torch.zeros(channels, dtype=torch.float64)
        squares = torch.zeros(channels, dtype=torch.float64)
        for start in range(0, x.shape[0], chunk):
            part = x[start : start + chunk].to(torch.float64) / scale
            total += part.sum(dim=axes)
            squares += (part * part).sum(dim=axes)
        examples = max(1, x.numel() // max(1, channels))
        mean = total / examples
        var = (squares / examples - mean * mean).clamp_min(0)
    std = var.sqrt()
    std = torch.where(std > 1e-12, std, torch.ones_like(std))
    return tuple(mean.tolist()), tuple(std.tolist())


def standardized(x: torch.Tensor, mean: Sequence[float], std: Sequence[float], scale: float = 1.0) -> torch.Tensor:
    """``(x / scale - mean) / std`` per channel (n, C, H, W) or per feature (n, D), as float32."""
    shape = (1, -1, 1, 1) if x.dim() == 4 else (1, -1)
    m = torch.tensor(mean, dtype=torch.float32).view(shape)
    s = torch.tensor(std, dtype=torch.float32).view(shape)
    return (x.to(torch.float32) / scale - m) / s


def declared_settings(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields of data set `name` in a data config, each checked against its declaration
    (``setvalued.config.DATA_FIELDS``; an unset field takes its default), and the held-out
    shares checked together (``held_out_problem``): a ValueError names the field."""
    out = {}
    for key, param in DATA_FIELDS[name].items():
        value = cfg.get(key)
        if value is None and not param.nullable:
            value = param.default
        out[key] = param.check(f"data.{key}", value)
    problem = held_out_problem(out)
    if problem:
        raise ValueError(problem)
    return out
