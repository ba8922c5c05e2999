"""The reference tables of docs/interfaces.md, generated from the declarations.

``python -m setvalued.reference_tables`` prints the trial-config table (every field of every
section with its default, what it accepts and what it means) and the loss-parameter table;
docs/interfaces.md holds them between ``<!-- generated:NAME -->`` markers and a test checks
that they equal this output, so the documentation cannot drift from the code. Both read the
registries (``setvalued.registry``): the built-ins, and with ``--plugins`` (``plugins=True``)
the installed plugins too, each row of a plugin marked with its distribution.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from setvalued import registry
from setvalued.config import EVAL_FIELDS, MODEL_FIELDS, OPTIM_FIELDS, TOP_FIELDS
from setvalued.params import Param

__all__ = ["trial_config_table", "loss_parameter_table", "TABLES"]


def _value(value: Any) -> str:
    return "required" if repr(value) == "REQUIRED" else f"`{json.dumps(value)}`"


def _rows(prefix: str, fields: Mapping[str, Param], note: str = "") -> Iterable[str]:
    for key, param in fields.items():
        doc = param.doc + (f" ({note})" if note else "")
        yield f"| `{prefix}{key}` | {_value(param.default)} | {param.describe()} | {doc} |"


def _registered(kind: str, plugins: bool) -> dict[str, registry.Entry]:
    return {name: item for name, item in registry.entries(kind).items() if plugins or item.builtin}


def _owner(item: registry.Entry) -> str:
    return f"{item.name} only" if item.builtin else f"{item.name} only; plugin {item.distribution}"


def trial_config_table(plugins: bool = False) -> str:
    """Markdown table of the trial config (docs/interfaces.md section 1); ``plugins``: with the
    installed plugins' data sets and models."""
    lines = ["| key | default | accepts | meaning |", "|---|---|---|---|"]
    datasets = _registered("dataset", plugins)
    builtin = {name: item.parameters for name, item in datasets.items() if item.builtin}
    # the fields every built-in data set has, listed once
    common = tuple(k for k in builtin["synthetic"] if all(k in fields for fields in builtin.values()))
    lines += _rows("data.", {k: p for k, p in builtin["synthetic"].items() if k in common})
    for _name, item in datasets.items():
        lines += _rows("data.", {k: p for k, p in item.parameters.items() if k not in common}, _owner(item))
    lines += _rows("model.", MODEL_FIELDS)
    for _name, item in _registered("model", plugins).items():
        if not item.builtin:
            lines += _rows("model.", item.parameters, _owner(item))
    lines.append(
        '| `loss.name` | `"noised_topk"` | a name of the loss registry | the loss; its parameters '
        "are in the table of section 2 |"
    )
    lines += _rows("optim.", OPTIM_FIELDS)
    lines += _rows("", {"epochs": TOP_FIELDS["epochs"]})
    lines += _rows("eval.", EVAL_FIELDS)
    lines += _rows("", {k: p for k, p in TOP_FIELDS.items() if k != "epochs"})
    return "\n".join(lines)


def loss_parameter_table(plugins: bool = False) -> str:
    """Markdown table of every registered loss's parameters (docs/interfaces.md section 2);
    ``plugins``: with the installed plugins' losses."""
    lines = ["| loss | parameter | default | accepts | meaning |", "|---|---|---|---|---|"]
    for name, item in _registered("loss", plugins).items():
        label = f"`{name}`" if item.builtin else f"`{name}` (plugin {item.distribution})"
        if not item.parameters:
            lines.append(f"| {label} | (none) | | | |")
        for key, param in item.parameters.items():
            lines.append(f"| {label} | `{key}` | {_value(param.default)} | {param.describe()} | {param.doc} |")
    return "\n".join(lines)


#: marker name in docs/interfaces.md -> generator
TABLES = {"trial-config": trial_config_table, "loss-parameters": loss_parameter_table}


if __name__ == "__main__":  # pragma: no cover - a documentation helper
    import sys

    for marker, make in TABLES.items():
        print(f"<!-- generated:{marker} -->\n{make('--plugins' in sys.argv)}\n<!-- end:{marker} -->\n")
