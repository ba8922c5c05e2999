"""The ``toy_rings`` data set: points on concentric rings cut into sectors.

Class c lies on ring c // 4 (radius 1, 2, 3, ...) in sector c % 4 of the plane; the point is
embedded in 8 dimensions by a fixed random rotation, with Gaussian noise. Neighbouring sectors
and rings overlap, so a top-K prediction helps. Fixed by ``split_seed``, like the synthetic set.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from setvalued.data import DataSplits, TensorSplit, counts_of

DIM = 8
SECTORS = 4


def _points(rng: np.random.Generator, labels: np.ndarray, rotation: np.ndarray, noise: float) -> torch.Tensor:
    radius = 1.0 + labels // SECTORS
    angle = (labels % SECTORS + rng.random(len(labels))) * (2 * math.pi / SECTORS)
    plane = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    x = np.concatenate([plane, np.zeros((len(labels), DIM - 2))], axis=1) @ rotation
    return torch.from_numpy(x + rng.normal(0.0, noise, x.shape)).float()


def build(
    *, seed: int, num_classes: int, train_size: int, val_size: int, test_size: int, noise: float, split_seed: int
) -> DataSplits:
    """The three splits; ``seed`` (the trial seed) is not used: the data are fixed by ``split_seed``."""
    rng = np.random.default_rng(split_seed)
    rotation, _ = np.linalg.qr(rng.normal(size=(DIM, DIM)))
    sizes = {"train": train_size, "val": val_size, "test": test_size}
    labels = {split: rng.permutation(np.arange(n) % num_classes) for split, n in sizes.items()}
    counts = counts_of(labels["train"], num_classes)
    names = [f"ring{c // SECTORS}_sector{c % SECTORS}" for c in range(num_classes)]
    splits = [
        TensorSplit(
            _points(rng, labels[split], rotation, noise),
            torch.from_numpy(labels[split]),
            num_classes=num_classes,
            class_counts=counts,
            class_names=names,
            split=split,
        )
        for split in sizes
    ]
    return DataSplits(*splits, num_classes=num_classes, class_counts=counts, class_names=names, input_shape=(DIM,))
