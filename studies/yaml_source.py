"""Reading a study file's YAML with the line of every key, and refusing duplicate keys.

``read_yaml(text)`` returns the data and a map from every YAML path to its line, so that each
problem can name the line to fix. Only PyYAML's safe loader is used: a study file is data,
never code.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from studies.problems import Path_, Problem, Problems

__all__ = ["read_yaml"]


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` and ``1e3`` as floats (YAML 1.2; PyYAML's 1.1
    resolver needs a dot and a signed exponent and would give the string "1e-3")."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _index_nodes(node: yaml.Node, path: Path_, lines: dict[Path_, int], problems: list[Problem]) -> None:
    """Map every YAML path to the line where its key (or list item) starts; find duplicate keys."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            key = key_node.value
            line = key_node.start_mark.line + 1
            if key == "<<":  # merge key: its entries are not keys of this mapping in the file
                continue
            if key in seen:
                problems.append(Problem(path + (key,), f"duplicate key '{key}' (first written on line "
                                                       f"{seen[key]}); each key may appear once"))
            seen.setdefault(key, line)
            lines.setdefault(path + (key,), line)
            _index_nodes(value_node, path + (key,), lines, problems)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines.setdefault(path + (i,), item.start_mark.line + 1)
            _index_nodes(item, path + (i,), lines, problems)


def read_yaml(text: str) -> tuple[Any, dict[Path_, int]]:
    """Parse the text; return (data, {yaml path: line}). Raises Problems on syntax errors."""
    try:
        root = yaml.compose(text, Loader=_Loader)
        data = yaml.load(text, Loader=_Loader)  # noqa: S506  (_Loader is a SafeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        what = " ".join(str(x) for x in (err.context, err.problem) if x)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise Problems([Problem(("YAML syntax",), f"{what} at {where}; expected valid YAML "
                                                  "(check the indentation and the quoting)")]) from None
    except yaml.YAMLError as err:
        raise Problems([Problem(("YAML syntax",), f"{err}")]) from None
    lines: dict[Path_, int] = {}
    problems: list[Problem] = []
    if root is not None:
        lines[()] = root.start_mark.line + 1
        _index_nodes(root, (), lines, problems)
    if problems:
        raise Problems(problems)
    return data, lines
