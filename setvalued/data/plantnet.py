"""Pl@ntNet-300K from its official folder layout ``images/{train,val,test}/<species id>/``.

The classes are the species folders of ``train``, sorted by name as torchvision's
ImageFolder sorts them (so class indices match the authors' code); ``val`` and ``test``
may only hold species that ``train`` has (in the official data every species is in every
split, [Gar23] §3.2.2). When ``plantnet300K_species_id_2_name.json`` is present next
to ``images/`` its names are used as class names.

Transforms ([Gar23] §3.3.2; no flip and ImageNet statistics as in the authors' code;
docs/papers.md, note P-3): train Resize(256) + RandomCrop(224), no flip; val/test Resize(256) +
CenterCrop(224); ImageNet mean and std.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch

from setvalued.data.common import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DataSplits,
    IndexedDataset,
    counts_of,
    layout_error,
    list_image_files,
    load_rgb,
)

SPLITS = ("train", "val", "test")
NAMES_FILE = "plantnet300K_species_id_2_name.json"
EXPECTED_LAYOUT = (
    "ROOT/images/train/<species id>/<image>.jpg, ROOT/images/val/<species id>/... and "
    "ROOT/images/test/<species id>/... (the official Pl@ntNet-300K archive, extracted; ROOT "
    "may also be the images folder itself)"
)
RESIZE = 256
CROP = 224


def resolve_images_folder(root: str | os.PathLike[str] | None) -> str:
    """The folder holding ``train``, ``val`` and ``test`` (``ROOT/images`` or ``ROOT``)."""
    if root is None:
        raise layout_error("<data.root not set>", "data.root is required for plantnet300k", EXPECTED_LAYOUT)
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise layout_error(root, "Pl@ntNet-300K folder does not exist", EXPECTED_LAYOUT)
    for folder in (os.path.join(root, "images"), root):
        if all(os.path.isdir(os.path.join(folder, s)) for s in SPLITS):
            return folder
    missing = [s for s in SPLITS if not os.path.isdir(os.path.join(root, "images", s))]
    raise layout_error(os.path.join(root, "images"), f"missing split folder(s) {missing}", EXPECTED_LAYOUT)


def scan_split(split_dir: str) -> dict[str, list[str]]:
    """Species folder name -> sorted image file names in one split folder."""
    species = sorted(e.name for e in os.scandir(split_dir) if e.is_dir())
    if not species:
        raise layout_error(split_dir, "no species folders", EXPECTED_LAYOUT)
    return {s: list_image_files(os.path.join(split_dir, s)) for s in species}


class ImageFolderSplit(IndexedDataset):
    """One split of a folder-per-class image data set; images are read lazily."""

    def __init__(
        self,
        paths: list[str],
        targets: list[int],
        *,
        num_classes: int,
        class_counts: list[int],
        class_names: list[str],
        split: str,
        transform: Callable[[Any], torch.Tensor],
    ) -> None:
        self.paths = paths
        self.targets = torch.as_tensor(targets, dtype=torch.int64)
        self.num_classes = num_classes
        self.class_counts = list(class_counts)
        self.class_names = list(class_names)
        self.split = split
        self.transform = transform

    def load(self, index: int) -> torch.Tensor:
        return self.transform(load_rgb(self.paths[index]))


def imagenet_style_transforms(train_random_resized: bool = False) -> tuple[Any, Any]:
    """(train, eval) transforms: Resize(256) + RandomCrop(224) / CenterCrop(224), ImageNet stats.

    With ``train_random_resized`` the training transform is RandomResizedCrop(224) +
    horizontal flip instead (ImageNet-LT).
    """
    from torchvision import transforms as T

    normalize = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    if train_random_resized:
        train = T.Compose([T.RandomResizedCrop(CROP), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    else:
        train = T.Compose([T.Resize(RESIZE), T.RandomCrop(CROP), T.ToTensor(), normalize])
    evaluate = T.Compose([T.Resize(RESIZE), T.CenterCrop(CROP), T.ToTensor(), normalize])
    return train, evaluate


def build(cfg: dict[str, Any], seed: int) -> DataSplits:
    """The Pl@ntNet-300K splits of a ``data`` config. ``seed`` is unused (fixed official splits)."""
    images = resolve_images_folder(cfg.get("root"))
    scanned = {s: scan_split(os.path.join(images, s)) for s in SPLITS}
    species = list(scanned["train"])
    class_of = {s: i for i, s in enumerate(species)}
    for split in ("val", "test"):
        unknown = sorted(set(scanned[split]) - set(class_of))
        if unknown:
            raise layout_error(
                os.path.join(images, split), f"species folders not in train: {unknown[:5]}", EXPECTED_LAYOUT
            )
    empty = [s for s, files in scanned["train"].items() if not files]
    if empty:
        raise layout_error(
            os.path.join(images, "train", empty[0]),
            f"{len(empty)} training species folder(s) without images",
            EXPECTED_LAYOUT,
        )

    names = species
    names_file = os.path.join(os.path.dirname(images.rstrip(os.sep)), NAMES_FILE)
    if os.path.isfile(names_file):
        with open(names_file, encoding="utf-8") as f:
            id_to_name = json.load(f)
        names = [str(id_to_name.get(s, s)) for s in species]

    listed = {}
    for split in SPLITS:
        paths, targets = [], []
        for s, files in scanned[split].items():
            paths += [os.path.join(images, split, s, name) for name in files]
            targets += [class_of[s]] * len(files)
        if not paths:
            raise layout_error(os.path.join(images, split), "no image files", EXPECTED_LAYOUT)
        listed[split] = (paths, targets)

    num_classes = len(species)
    class_counts = counts_of(listed["train"][1], num_classes)
    train_tf, eval_tf = imagenet_style_transforms()
    common: dict[str, Any] = dict(num_classes=num_classes, class_counts=class_counts, class_names=names)
    splits = [
        ImageFolderSplit(*listed[s], split=s, transform=train_tf if s == "train" else eval_tf, **common) for s in SPLITS
    ]
    return DataSplits(
        splits[0],
        splits[1],
        splits[2],
        num_classes=num_classes,
        class_counts=class_counts,
        class_names=names,
        input_shape=(3, CROP, CROP),
        info={"folder": images, "species_ids": species},
    )
