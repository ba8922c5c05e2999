"""The reference tables of docs/interfaces.md, generated from the declarations.

``python -m setvalued.reference_tables`` prints the trial-config table (every field of every
section with its default, what it accepts and what it means) and the loss-parameter table;
docs/interfaces.md holds them between ``<!-- generated:NAME -->`` markers and a test checks
that they equal this output, so the documentation cannot drift from the code.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

from setvalued.config import DATA_FIELDS, EVAL_FIELDS, MODEL_FIELDS, OPTIM_FIELDS, TOP_FIELDS
from setvalued.losses.parameters import LOSS_PARAMETERS
from setvalued.params import Param

__all__ = ["trial_config_table", "loss_parameter_table", "TABLES"]


def _value(value: Any) -> str:
    return "required" if repr(value) == "REQUIRED" else f"`{json.dumps(value)}`"


def _rows(prefix: str, fields: Mapping[str, Param], note: str = "") -> Iterable[str]:
    for key, param in fields.items():
        doc = param.doc + (f" ({note})" if note else "")
        yield f"| `{prefix}{key}` | {_value(param.default)} | {param.describe()} | {doc} |"


def trial_config_table() -> str:
    """Markdown table of the trial config (docs/interfaces.md section 1)."""
    lines = ["| key | default | accepts | meaning |", "|---|---|---|---|"]
    # the fields every data set has, listed once
    common = tuple(k for k in DATA_FIELDS["synthetic"] if all(k in fields for fields in DATA_FIELDS.values()))
    lines += _rows("data.", {k: p for k, p in DATA_FIELDS["synthetic"].items() if k in common})
    for name, fields in DATA_FIELDS.items():
        lines += _rows("data.", {k: p for k, p in fields.items() if k not in common}, f"{name} only")
    lines += _rows("model.", MODEL_FIELDS)
    lines.append("| `loss.name` | `\"noised_topk\"` | a name of the loss registry | the loss; its parameters "
                 "are in the table of section 2 |")
    lines += _rows("optim.", OPTIM_FIELDS)
    lines += _rows("", {"epochs": TOP_FIELDS["epochs"]})
    lines += _rows("eval.", EVAL_FIELDS)
    lines += _rows("", {k: p for k, p in TOP_FIELDS.items() if k != "epochs"})
    return "\n".join(lines)


def loss_parameter_table() -> str:
    """Markdown table of every registered loss's parameters (docs/interfaces.md section 2)."""
    lines = ["| loss | parameter | default | accepts | meaning |", "|---|---|---|---|---|"]
    for name, params in LOSS_PARAMETERS.items():
        if not params:
            lines.append(f"| `{name}` | (none) | | | |")
        for key, param in params.items():
            lines.append(f"| `{name}` | `{key}` | {_value(param.default)} | {param.describe()} | {param.doc} |")
    return "\n".join(lines)


#: marker name in docs/interfaces.md -> generator
TABLES = {"trial-config": trial_config_table, "loss-parameters": loss_parameter_table}


if __name__ == "__main__":  # pragma: no cover - a documentation helper
    for marker, make in TABLES.items():
        print(f"<!-- generated:{marker} -->\n{make()}\n<!-- end:{marker} -->\n")
