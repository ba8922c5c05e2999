"""ImageNet-LT (Liu et al. 2019) from its official text lists over an ImageNet folder.

Layout: ``ROOT`` is an ImageNet folder, and the lists ``ImageNet_LT_train.txt``,
``ImageNet_LT_val.txt`` and ``ImageNet_LT_test.txt`` lie in ``ROOT`` or in
``ROOT/ImageNet_LT``. Each line is ``<path relative to ROOT> <label>``, e.g.
``train/n01440764/n01440764_190.JPEG 0``. The 20,000-image validation list is the one the
hyperparameters were tuned on ([Gar23] §4.4.5.2); the test list is the balanced
50,000-image set.

Transforms [inferred: the papers do not state them; these are the usual ImageNet-LT ones]:
train RandomResizedCrop(224) + horizontal flip; val/test Resize(256) + CenterCrop(224);
ImageNet mean and std.
"""

from __future__ import annotations

import os
from typing import Any

from setvalued.data.common import DataSplits, counts_of, layout_error
from setvalued.data.plantnet import CROP, ImageFolderSplit, imagenet_style_transforms

LIST_FILES = {"train": "ImageNet_LT_train.txt", "val": "ImageNet_LT_val.txt", "test": "ImageNet_LT_test.txt"}
EXPECTED_LAYOUT = (
    "ROOT/<path> for every line '<path> <label>' of ImageNet_LT_train.txt, ImageNet_LT_val.txt and "
    "ImageNet_LT_test.txt, which lie in ROOT or ROOT/ImageNet_LT (paths such as "
    "train/n01440764/n01440764_190.JPEG, labels 0..999)"
)
#: Number of listed files whose existence is checked when the data set is built, spread
#: evenly over each list (checking all 186k would be slow on network file systems).
EXISTENCE_SAMPLE = 200


def find_lists(root: str) -> dict[str, str]:
    for folder in (root, os.path.join(root, "ImageNet_LT")):
        paths = {s: os.path.join(folder, name) for s, name in LIST_FILES.items()}
        if all(os.path.isfile(p) for p in paths.values()):
            return paths
    raise layout_error(
        root,
        f"ImageNet-LT lists {sorted(LIST_FILES.values())} not found in the folder or its ImageNet_LT subfolder",
        EXPECTED_LAYOUT,
    )


def read_list(path: str) -> tuple[list[str], list[int]]:
    """Relative paths and labels of an ImageNet-LT list file."""
    files, labels = [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            parts = line.rsplit(None, 1)
            if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
                raise layout_error(path, f"line {number} is {line!r}, not '<path> <label>'", EXPECTED_LAYOUT)
            files.append(parts[0])
            labels.append(int(parts[1]))
    if not files:
        raise layout_error(path, "empty list file", EXPECTED_LAYOUT)
    return files, labels


def build(cfg: dict[str, Any], seed: int) -> DataSplits:
    """The ImageNet-LT splits of a ``data`` config. ``seed`` is unused (fixed official lists)."""
    root = cfg.get("root")
    if root is None:
        raise layout_error("<data.root not set>", "data.root is required for imagenet_lt", EXPECTED_LAYOUT)
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise layout_error(root, "ImageNet folder does not exist", EXPECTED_LAYOUT)
    lists = {s: read_list(p) for s, p in find_lists(root).items()}

    num_classes = max(max(labels) for _, labels in lists.values()) + 1
    for split, (files, labels) in lists.items():
        if min(labels) < 0:
            raise layout_error(find_lists(root)[split], "negative label", EXPECTED_LAYOUT)
        step = max(1, len(files) // EXISTENCE_SAMPLE)
        for rel in files[::step] + files[-1:]:
            if not os.path.isfile(os.path.join(root, rel)):
                raise layout_error(
                    os.path.join(root, rel), f"image listed in {LIST_FILES[split]} is missing", EXPECTED_LAYOUT
                )

    # Class names: the WordNet id folder of the training images of each label.
    names = [str(c) for c in range(num_classes)]
    for rel, label in zip(*lists["train"]):
        parent = os.path.basename(os.path.dirname(rel))
        if parent:
            names[label] = parent
    class_counts = counts_of(lists["train"][1], num_classes)
    train_tf, eval_tf = imagenet_style_transforms(train_random_resized=True)
    common: dict[str, Any] = dict(num_classes=num_classes, class_counts=class_counts, class_names=names)
    splits = [
        ImageFolderSplit(
            [os.path.join(root, rel) for rel in lists[s][0]],
            lists[s][1],
            split=s,
            transform=train_tf if s == "train" else eval_tf,
            **common,
        )
        for s in ("train", "val", "test")
    ]
    return DataSplits(
        splits[0],
        splits[1],
        splits[2],
        num_classes=num_classes,
        class_counts=class_counts,
        class_names=names,
        input_shape=(3, CROP, CROP),
        info={"folder": root},
    )
