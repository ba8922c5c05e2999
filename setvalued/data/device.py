"""Data on the training device: in-memory splits held there, augmented a whole batch at a time.

The CIFAR-scale sets (CIFAR-100, the synthetic set) fit in a GPU's memory many times over
(CIFAR-100's 45,000 training images are 138 MB as uint8). Holding them on the device and
augmenting a batch with a few tensor operations removes the loader workers, their CPU
competition when trials share a node, and the host-to-device copy of every batch (issue #24).

``BatchAugmentation`` is the papers' CIFAR transform (random crop of ``size`` after
``padding`` pixels of zero padding, horizontal flip with probability 1/2, normalisation),
the same distribution as torchvision's per-image ``RandomCrop(32, padding=4)``,
``RandomHorizontalFlip()``, ``ToDtype(float32, scale=True)``, ``Normalize(mean, std)``:
crop offsets uniform over the ``(2 * padding + 1) ** 2`` positions, flips fair coins. Its
random draws come from a ``torch.Generator`` that the caller seeds (the trainer: from
(trial seed, epoch)), so an epoch's augmentation is reproducible and a resumed trial draws
the same stream. The draws of a CPU and of a CUDA generator differ (different algorithms).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["BatchAugmentation", "DeviceSplit"]


@dataclass(frozen=True)
class BatchAugmentation:
    """Random crop of ``size`` from the image zero-padded by ``padding``, horizontal flip
    (``flip``), then ``(x / 255 - mean) / std`` per channel, on uint8 (n, C, H, W) batches."""

    size: int
    padding: int
    flip: bool
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def draw(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` examples' crop offsets (n, 2) as (top, left) in the padded image, and flips
        (n,) bool, on the generator's device."""
        positions = 2 * self.padding + 1
        offsets = torch.randint(0, positions, (n, 2), generator=generator, device=generator.device)
        flips = torch.randint(0, 2, (n,), generator=generator, device=generator.device).bool()
        if not self.flip:
            flips = torch.zeros_like(flips)
        return offsets, flips

    def apply(
        self,
        images: torch.Tensor,
        offsets: torch.Tensor,
        flips: torch.Tensor,
        stats: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The augmented float32 batch of uint8 ``images`` (n, C, H, W) for the given offsets
        and flips: one gather from the padded batch, no per-image loop, no host read.
        ``stats``: ``self.statistics(device)``, kept by a caller that applies it per batch."""
        n, channels = images.shape[:2]
        padded = torch.nn.functional.pad(images, (self.padding,) * 4)  # zeros, as torchvision's fill=0
        steps = torch.arange(self.size, device=images.device)
        rows = offsets[:, 0:1] + steps  # (n, size)
        # a flipped crop reads its columns right to left
        cols = offsets[:, 1:2] + torch.where(flips[:, None], self.size - 1 - steps, steps)
        batch = torch.arange(n, device=images.device).view(n, 1, 1, 1)
        channel = torch.arange(channels, device=images.device).view(1, channels, 1, 1)
        out = padded[batch, channel, rows.view(n, 1, self.size, 1), cols.view(n, 1, 1, self.size)]
        mean, std = stats if stats is not None else self.statistics(images.device)
        return (out.to(torch.float32) / 255.0 - mean) / std  # as ToDtype(scale=True), then Normalize

    def statistics(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) as (1, C, 1, 1) float32 tensors on ``device`` (made once: a tensor built
        from Python numbers is a host-to-device copy, which would wait on the device per batch)."""
        mean = torch.tensor(self.mean, dtype=torch.float32).view(1, -1, 1, 1).to(device)
        std = torch.tensor(self.std, dtype=torch.float32).view(1, -1, 1, 1).to(device)
        return mean, std


class DeviceSplit:
    """A split's inputs and labels on the training device, served as whole batches.

    ``augmentation`` (training split of an augmented set) is applied to every batch from the
    epoch's draws; without it the inputs are served as they are.
    """

    def __init__(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        device: torch.device,
        augmentation: BatchAugmentation | None = None,
    ):
        self.inputs = inputs.to(device)
        self.targets = targets.to(device)
        self.device = device
        self.augmentation = augmentation
        self.stats = augmentation.statistics(device) if augmentation is not None else None

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    def batches(
        self, order: torch.Tensor, batch_size: int, generator: torch.Generator | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Batches ``(inputs, labels, indices)`` in ``order``. With an augmentation, the
        epoch's offsets and flips are drawn at once from ``generator`` (one per position of
        ``order``, so the stream does not depend on the batch size)."""
        order = order.to(self.device)
        draws = None
        if self.augmentation is not None:
            if generator is None:
                raise ValueError("an augmented DeviceSplit needs the epoch's generator")
            draws = self.augmentation.draw(len(order), generator)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            x = self.inputs[idx]
            if draws is not None and self.augmentation is not None:
                x = self.augmentation.apply(
                    x, draws[0][start : start + batch_size], draws[1][start : start + batch_size], self.stats
                )
            yield x, self.targets[idx], idx
