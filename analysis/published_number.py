"""A published number as the paper printed it: a float that keeps its text (`68.20`, `65`).

Papers print their numbers with a chosen precision (`94.24`, `68.20`, `65`); read from YAML as
floats they would print as `94.24`, `68.2` and `65.0`. The study file's reference numbers
(`reference` rows' `metrics` and `ci`) are read as `PublishedNumber`s instead: they compare
and compute as floats, and `text` is the scalar as written in the file, which the report
prints verbatim.

`keep_reference_texts(root, data)` puts the texts into data constructed by any YAML loader,
from the node tree it was constructed from (the node of a scalar holds its text), so both
study validation (`studies.studyfile.yaml_source`) and the report (`analysis.study_file`) read the
same numbers the same way.
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml
from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

__all__ = ["PublishedNumber", "keep_reference_texts"]

#: a number as papers print it: optional sign, digits, optional decimals (no exponent, no `_`)
_PLAIN_DECIMAL = re.compile(r"^[-+]?[0-9]+(\.[0-9]*)?$")


class PublishedNumber(float):
    """A float that remembers how it was written (`text`), for printing it verbatim."""

    text: str

    def __new__(cls, value: float, text: str | None = None) -> PublishedNumber:
        number = super().__new__(cls, value)
        number.text = text if text is not None and _PLAIN_DECIMAL.match(text) else _default_text(value)
        return number

    def __repr__(self) -> str:
        return self.text

    def __reduce__(self):  # pickled with its text (float's own reduce would drop it)
        return (PublishedNumber, (float(self), self.text))

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            _validate, serialization=core_schema.plain_serializer_function_ser_schema(float)
        )


def _default_text(value: Any) -> str:
    """The text of a number read without its source: `94.2`, `65` for the int 65."""
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


def _validate(value: Any) -> PublishedNumber:
    """A finite int or float (a `PublishedNumber` keeps its text); not a bool, not a string."""
    if isinstance(value, PublishedNumber):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number as the paper prints it (such as 94.24), got {value!r}")
    if not math.isfinite(float(value)):
        raise ValueError(f"expected a finite number, got {value!r}")
    return PublishedNumber(value, _default_text(value))


def _child(node: yaml.Node | None, key: str) -> yaml.Node | None:
    """The value node of `key` in a mapping node (None when absent or not a mapping)."""
    if not isinstance(node, yaml.MappingNode):
        return None
    for key_node, value_node in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.value == key:
            return value_node
    return None


def _keep_scalar_texts(node: yaml.Node | None, mapping: Any) -> None:
    """Replace the int and float values of `mapping` by PublishedNumbers holding their text."""
    if not isinstance(node, yaml.MappingNode) or not isinstance(mapping, dict):
        return
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or not isinstance(value_node, yaml.ScalarNode):
            continue
        value = mapping.get(key_node.value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            mapping[key_node.value] = PublishedNumber(value, value_node.value)


def keep_reference_texts(root: yaml.Node | None, data: Any) -> None:
    """Give the `metrics` and `ci` numbers of the `reference` block of `data` (constructed from
    `root`) their text as written, in place. The block is one source (a mapping) or a list of
    sources; anything else is left for validation to refuse."""
    if not isinstance(data, dict) or not isinstance(data.get("reference"), (dict, list)):
        return
    block_node, block = _child(root, "reference"), data["reference"]
    if isinstance(block, dict):
        pairs = [(block_node, block)]
    elif isinstance(block_node, yaml.SequenceNode) and len(block_node.value) == len(block):
        pairs = list(zip(block_node.value, block))
    else:
        return
    for source_node, source in pairs:
        rows_node, rows = _child(source_node, "rows"), source.get("rows") if isinstance(source, dict) else None
        if (
            not isinstance(rows_node, yaml.SequenceNode)
            or not isinstance(rows, list)
            or len(rows_node.value) != len(rows)
        ):
            continue
        for row_node, row in zip(rows_node.value, rows):
            if isinstance(row, dict):
                for key in ("metrics", "ci"):
                    _keep_scalar_texts(_child(row_node, key), row.get(key))
