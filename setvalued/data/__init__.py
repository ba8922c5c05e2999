"""Data sets of the studies: ``build_datasets(data_config, seed) -> DataSplits``.

Every split yields ``(input, label, index)`` and exposes ``num_classes`` and the training
``class_counts`` (see ``setvalued.data.common``). ``DataSplits`` unpacks as
``train, val, test``. The config keys are those of docs/interfaces.md section 1 (``data:``).
"""

from __future__ import annotations

from typing import Any, Callable

from setvalued.config import DATA_DEFAULTS, DATASET_NAMES, reject_unknown_keys
from setvalued.data.common import (  # noqa: F401
    DataLayoutError,
    DataSplits,
    IndexedDataset,
    TensorSplit,
    counts_of,
)


def _builders() -> dict[str, Callable[[dict[str, Any], int], DataSplits]]:
    from setvalued.data import cifar100, imagenet_lt, plantnet, synthetic

    return {
        "synthetic": synthetic.build,
        "cifar100": cifar100.build,
        "plantnet300k": plantnet.build,
        "imagenet_lt": imagenet_lt.build,
    }


__all__ = ["DATA_DEFAULTS", "DATASET_NAMES", "DataLayoutError", "DataSplits", "IndexedDataset", "TensorSplit",
           "build_datasets", "counts_of"]


def build_datasets(data_config: dict[str, Any], seed: int = 0) -> DataSplits:
    """Build the train/val/test splits named by ``data_config["name"]``.

    ``seed`` is the trial seed; only the CIFAR-100 label noise depends on it (validation
    splits and the synthetic data are fixed by ``split_seed``).
    """
    reject_unknown_keys("data", data_config, DATA_DEFAULTS)
    cfg = {**DATA_DEFAULTS, **data_config}
    name = cfg["name"]
    builders = _builders()
    if name not in builders:
        raise ValueError(f"data.name must be one of {', '.join(DATASET_NAMES)}, got {name!r}")
    return builders[name](cfg, int(seed))
