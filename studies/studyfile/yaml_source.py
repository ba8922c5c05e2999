"""Reading a study file's YAML with the line of every key, and refusing duplicate keys.

``read_yaml(text)`` returns the data and a map from every YAML path to its line, so that each
problem can name the line to fix. Only PyYAML's safe loader is used: a study file is data,
never code. The numbers of the `reference` block keep their written text
(`analysis.published_number`).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from analysis.published_number import keep_reference_texts
from studies.studyfile.problems import Lines, Path_, Problem, Problems

__all__ = ["read_yaml", "MAX_YAML_NODES", "MAX_YAML_DEPTH", "MAX_FILE_BYTES"]

#: largest study file read (the catalogue's largest is about 6 KB)
MAX_FILE_BYTES = 512 * 1024

#: most values a study file may hold once its aliases are expanded (a long seed list and a large
#: grid fit easily; a "billion laughs" alias bomb of a few hundred bytes does not)
MAX_YAML_NODES = 200_000
#: deepest nesting of mappings and lists (a study file needs about 8)
MAX_YAML_DEPTH = 32


#: PyYAML's safe loader, in C (libyaml) where installed: about 8 times faster on a large file
_SafeBase = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_SafeBase):  # type: ignore[misc,valid-type]  # PyYAML has no types
    """SafeLoader that also reads ``1e-3`` and ``1e3`` as floats (YAML 1.2; PyYAML's 1.1
    resolver needs a dot and a signed exponent and would give the string "1e-3")."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _index_nodes(node: yaml.Node, path: Path_, lines: Lines, problems: list[Problem]) -> None:
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
                problems.append(
                    Problem(
                        path + (key,),
                        f"duplicate key '{key}' (first written on line {seen[key]}); each key may appear once",
                    )
                )
            seen.setdefault(key, line)
            lines.setdefault(path + (key,), line)
            _index_nodes(value_node, path + (key,), lines, problems)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines.setdefault(path + (i,), item.start_mark.line + 1)
            _index_nodes(item, path + (i,), lines, problems)


def _expanded_size(root: yaml.Node) -> tuple[int, int]:
    """(values, depth) of the node tree with every alias expanded, without expanding it: each
    node is visited once (an alias is the same node object), its size computed from its
    children's. Iterative, so that a deep file cannot exhaust Python's stack here."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in size:
            continue
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            children = []
        if children_done or not children:
            size[id(node)] = min(1 + sum(size[id(c)] for c in children), MAX_YAML_NODES + 1)
            depth[id(node)] = 1 + max((depth[id(c)] for c in children), default=0)
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)
    return size[id(root)], depth[id(root)]


def _bounded(root: yaml.Node | None) -> None:
    """Refuse a file whose expanded content is too large or too deep to validate quickly."""
    if root is None:
        return
    values, depth = _expanded_size(root)
    if values > MAX_YAML_NODES:
        raise Problems(
            [
                Problem(
                    ("YAML",),
                    f"the file expands to more than {MAX_YAML_NODES:,} values "
                    "(aliases included); expected a study file of at most that many",
                )
            ]
        )
    if depth > MAX_YAML_DEPTH:
        raise Problems(
            [Problem(("YAML",), f"mappings and lists nested {depth} levels deep; expected at most {MAX_YAML_DEPTH}")]
        )


_OPENING = (
    yaml.BlockSequenceStartToken,
    yaml.BlockMappingStartToken,
    yaml.FlowSequenceStartToken,
    yaml.FlowMappingStartToken,
)
_CLOSING = (yaml.BlockEndToken, yaml.FlowSequenceEndToken, yaml.FlowMappingEndToken)


def _check_nesting(text: str) -> None:
    """Refuse nesting past MAX_YAML_DEPTH from the token stream, before building any tree (the
    scanner is not recursive; the composer is, and a deep file would exhaust its stack)."""
    depth = 0
    for token in yaml.scan(text, Loader=_Loader):
        if isinstance(token, _OPENING):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise Problems(
                    [
                        Problem(
                            ("YAML",),
                            f"mappings and lists nested more than {MAX_YAML_DEPTH} "
                            f"levels deep (line {token.start_mark.line + 1}); expected at "
                            f"most {MAX_YAML_DEPTH}",
                        )
                    ]
                )
        elif isinstance(token, _CLOSING):
            depth -= 1


def _flow_depth_exceeded(text: str) -> int | None:
    """The line where flow collections (``[...]``, ``{...}``) nest past MAX_YAML_DEPTH, found
    in one pass over the characters, before any YAML scanner sees the text, so the bound
    holds whatever the scanner's cost per flow level (issue 25 saw 6 s for 2,000 levels;
    `_check_nesting`'s token scan stops at level 33 here). Brackets inside quotes and comments
    do not count, nor a bracket inside a plain word (``a[b``); None when within."""
    depth = 0
    line = 1
    quote = ""
    previous = "\n"  # the last character outside a quoted scalar
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        if char == "\n":
            line += 1
        if quote:
            if char == "\\" and quote == '"':
                i += 2
                continue
            if char == quote:
                if quote == "'" and i + 1 < n and text[i + 1] == "'":  # '' inside '...'
                    i += 2
                    continue
                quote = ""
            i += 1
            continue
        if char == "#" and previous in " \t\n\r":
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        starts_token = depth > 0 or previous in " \t\n\r:-?,[{"
        if char in "'\"" and (previous in " \t\n\r:-?,[{"):
            quote = char
        elif char in "[{":
            if not starts_token:  # part of a plain word: what follows is too
                char = "a"
            else:
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    return line
        elif char in "]}" and depth > 0:
            depth -= 1
        previous = char
        i += 1
    return None


class _PyLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML has no types
    """The pure-Python parser, used only to word a syntax error (its messages say what it expected)."""


def _python_parser_error(text: str) -> yaml.MarkedYAMLError | None:
    """The syntax error as PyYAML's Python parser words it (the file is known to be bad, and
    its nesting was checked, so this is quick and cannot recurse deeply)."""
    try:
        for _ in yaml.parse(text, Loader=_PyLoader):
            pass
    except yaml.MarkedYAMLError as err:
        return err
    except yaml.YAMLError:
        return None
    return None


def read_yaml(text: str) -> tuple[Any, Lines]:
    """Parse the text; return (data, {yaml path: line}). Raises Problems on syntax errors and
    on files too large or too deep once their aliases are expanded."""
    if len(text) > MAX_FILE_BYTES:
        raise Problems(
            [
                Problem(
                    ("(file)",),
                    f"the file is larger than {MAX_FILE_BYTES:,} characters; expected a study file of ordinary size",
                )
            ]
        )
    deep = _flow_depth_exceeded(text)
    if deep is not None:
        raise Problems(
            [
                Problem(
                    ("YAML",),
                    f"mappings and lists nested more than {MAX_YAML_DEPTH} levels "
                    f"deep (line {deep}); expected at most {MAX_YAML_DEPTH}",
                )
            ]
        )
    try:
        _check_nesting(text)
        loader = _Loader(text)
        try:
            root = loader.get_single_node()
            _bounded(root)
            data = loader.construct_document(root) if root is not None else None
            keep_reference_texts(root, data)  # published numbers print as the file writes them
        finally:
            loader.dispose()
    except RecursionError:
        raise Problems(
            [
                Problem(
                    ("YAML",), f"mappings and lists nested too deep to read; expected at most {MAX_YAML_DEPTH} levels"
                )
            ]
        ) from None
    except ValueError as err:  # an integer of more digits than Python converts (4,300)
        raise Problems(
            [Problem(("YAML",), f"unreadable value ({str(err).split(';')[0]}); expected numbers of ordinary size")]
        ) from None
    except yaml.MarkedYAMLError as err:
        err = _python_parser_error(text) or err  # PyYAML's own words, whichever parser found it
        mark = err.problem_mark or err.context_mark
        what = " ".join(str(x) for x in (err.context, err.problem) if x)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise Problems(
            [
                Problem(
                    ("YAML syntax",), f"{what} at {where}; expected valid YAML (check the indentation and the quoting)"
                )
            ]
        ) from None
    except yaml.YAMLError as err:
        raise Problems([Problem(("YAML syntax",), f"{err}")]) from None
    lines: Lines = {}
    problems: list[Problem] = []
    if root is not None:
        lines[()] = root.start_mark.line + 1
        _index_nodes(root, (), lines, problems)
    if problems:
        raise Problems(problems)
    return data, lines
