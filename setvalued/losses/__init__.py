"""Set-valued classification losses, built by name: ``build_loss(name, **params)``.

``setvalued.losses.parameters`` (what each loss accepts) is pure Python. The losses themselves
need PyTorch, so the names below are loaded on first use (PEP 562): reading the declarations
to validate a study file does not import torch. Loading them registers every loss of the
submodules.
"""

from __future__ import annotations

import importlib
from typing import Any

from setvalued.losses.parameters import CONTEXT_KEYS, LOSS_PARAMETERS

#: public name -> module that defines it
_LAZY = {
    "LOSSES": "setvalued.losses.base",
    "SetValuedLoss": "setvalued.losses.base",
    "TwoHeadOutput": "setvalued.losses.base",
    "build_loss": "setvalued.losses.base",
    "loss_parameters": "setvalued.losses.base",
    "register_loss": "setvalued.losses.base",
    "NormedLinear": "setvalued.losses.normed",
}
#: the modules whose import registers the losses
_LOSS_MODULES = (
    "setvalued.losses.topk",
    "setvalued.losses.smooth_svm",
    "setvalued.losses.avgk",
    "setvalued.losses.sparse_top",
    "setvalued.losses.bce",
)

__all__ = ["CONTEXT_KEYS", "LOSS_PARAMETERS", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'setvalued.losses' has no attribute {name!r}")
    for module in _LOSS_MODULES:
        importlib.import_module(module)
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
