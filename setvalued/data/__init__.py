"""Data sets of the studies: ``build_datasets(data_config, seed) -> DataSplits``.

Every split yields ``(input, label, index)`` and exposes ``num_classes`` and the training
``class_counts`` (see ``setvalued.data.common``). ``DataSplits`` unpacks as
``train, val, test``. The config keys are those of docs/interfaces.md section 1 (``data:``).
"""

from __future__ import annotations

from typing import Any

from setvalued import registry
from setvalued.config import DATA_DEFAULTS, DATASET_NAMES, reject_unknown_keys
from setvalued.data.common import (
    DataLayoutError,
    DataSplits,
    IndexedDataset,
    TensorSplit,
    counts_of,
)

__all__ = [
    "check_layout",
    "DATA_DEFAULTS",
    "DATASET_NAMES",
    "DataLayoutError",
    "DataSplits",
    "IndexedDataset",
    "TensorSplit",
    "build_datasets",
    "counts_of",
    "seed_free",
]


def build_datasets(data_config: dict[str, Any], seed: int = 0) -> DataSplits:
    """Build the train/val/test splits named by ``data_config["name"]``.

    ``seed`` is the trial seed; only the CIFAR-100 label noise depends on it (validation
    splits and the synthetic data are fixed by ``split_seed``).
    """
    name = data_config.get("name", DATA_DEFAULTS["name"])
    item = registry.entry("dataset", name)
    if item is None:
        raise ValueError(f"data.name must be one of {', '.join(registry.entries('dataset'))}, got {name!r}")
    if not item.builtin:
        return _build_plugin(item, data_config, int(seed))
    reject_unknown_keys("data", data_config, DATA_DEFAULTS)
    cfg = {**DATA_DEFAULTS, **data_config}
    return registry.load_factory("dataset", name)(cfg, int(seed))


def seed_free(data_config: dict[str, Any]) -> bool:
    """Whether the splits of ``data_config`` are the same for every trial seed (what
    ``build_datasets`` documents), so that the members of a fused array may share one copy:
    every built-in but CIFAR-100 with label noise; not a plugin (its builder takes the seed)."""
    item = registry.entry("dataset", data_config.get("name", DATA_DEFAULTS["name"]))
    if item is None or not item.builtin:
        return False
    return not (item.name == "cifar100" and float(data_config.get("label_noise") or 0.0) > 0.0)


def _build_plugin(item: registry.Entry, data_config: dict[str, Any], seed: int) -> DataSplits:
    """A plugin data set: its declared parameters checked, its builder called with them and the seed.
    The built-ins' fields that a default config holds (at their defaults) are not passed."""
    params = registry.plugin_parameters(item, data_config, DATA_DEFAULTS)
    splits = registry.load_factory("dataset", item.name)(seed=seed, **params)
    if not isinstance(splits, DataSplits):
        raise registry.PluginError(
            f"dataset {item.name!r} ({item.origin}): {item.factory} returned a "
            f"{type(splits).__name__}, expected setvalued.data.DataSplits"
        )
    return splits


def check_layout(data_config: dict[str, Any]) -> None:
    """Raise DataLayoutError (naming the path and the expected layout) when a real data set's
    folder is missing or lacks its files, so that the driver checks every data root before the
    first trial starts; cheap for the official sets (no image or pickle is read); image_folder
    decodes every image and arrays reads the labels (their own files, bounded: docs/read-back.md).
    Synthetic data: nothing.
    A data set that will be downloaded (``download: true``) is not checked. A plugin's data set
    runs the preflight its declaration names (``Declaration.check``), if any."""
    item = registry.entry("dataset", data_config.get("name"))
    if item is not None and not item.builtin:
        problem = registry.run_check(item, registry.plugin_parameters(item, data_config, DATA_DEFAULTS))
        if problem is not None:
            raise DataLayoutError(f"data set {item.name!r} ({item.origin}): {problem}")
        return
    cfg = {**DATA_DEFAULTS, **data_config}
    name, root = cfg["name"], cfg.get("root")
    if name in ("image_folder", "arrays"):  # their files are read (bounded), then decoded or checked
        import importlib

        importlib.import_module(f"setvalued.data.{name}").check_layout(cfg)
    elif name == "cifar100":
        from setvalued.data import cifar100

        if not cfg.get("download"):
            cifar100.resolve_folder(root, download=False)
    elif name == "plantnet300k":
        from setvalued.data import plantnet

        plantnet.resolve_images_folder(root)
    elif name == "imagenet_lt":
        import os

        from setvalued.data import imagenet_lt
        from setvalued.data.common import layout_error

        if root is None or not os.path.isdir(root):
            raise layout_error(
                root or "<data.root not set>", "ImageNet folder does not exist", imagenet_lt.EXPECTED_LAYOUT
            )
        imagenet_lt.find_lists(os.fspath(root))
