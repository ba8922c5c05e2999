"""Command-line overrides of a study file, in Hydra's `key=value` convention.

`studies run FILE optim.lr=0.01 seeds=[0,1]` (or `--set optim.lr=0.01`) sets values of the
file before it is validated, so the same schema checks them with the same messages, each
naming the override it came from instead of a line. KEY is a dotted path: from the top of the
file when its first part is a top-level field (`seeds`, `variants.ce.loss.k`, `design.0.trials`),
else inside `base` (`optim.lr` is `base.optim.lr`). The keys of `derived` and of a design
block's `parameters` are dotted paths themselves: what follows them is one key
(`design.1.parameters.loss.epsilon=[0.1,1.0]`). VALUE is read as YAML by the safe loader
(`0.01`, `[0, 1]`, `{name: ce}`, `null`). Later overrides win.

`resolved_text` writes the file with its overrides applied, which the run keeps as its
`study.yaml` (so `studies resume` and `studies report` read what ran).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from analysis.published_number import PublishedNumber
from studies.studyfile.problems import Lines, Path_, Problem, Problems, format_yaml_path
from studies.studyfile.yaml_source import read_yaml

__all__ = [
    "Override",
    "parse_overrides",
    "apply_overrides",
    "resolved_text",
    "OVERRIDE_FORMAT",
    "looks_like_override",
    "dump_yaml",
]

OVERRIDE_FORMAT = (
    "KEY=VALUE, KEY a dotted path (optim.lr, seeds, variants.ce.loss.k, "
    "design.0.parameters.loss.epsilon) and VALUE a YAML value (0.01, [0, 1], {name: ce})"
)

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$")
#: keys whose entries are dotted paths: what follows them in an override's key is one key
_DOTTED_ENTRIES = ("derived", "parameters")


@dataclass(frozen=True)
class Override:
    """One `key=value` as typed, the YAML path it sets in the file and its value."""

    text: str
    path: Path_
    value: Any

    @property
    def source(self) -> str:
        """How an error names it (in place of a line)."""
        return f"override {self.text}"


def looks_like_override(text: str) -> bool:
    """Whether a command-line word is a `key=value` (not a file, a variant or a flag)."""
    return "=" in text and not text.startswith("-")


def _path(key: str, top_fields: Iterable[str]) -> Path_:
    parts = key.split(".")
    path: list[Any] = [] if parts[0] in set(top_fields) else ["base"]
    while parts:
        part = parts.pop(0)
        path.append(int(part) if part.isdigit() else part)
        if part in _DOTTED_ENTRIES and parts and (part == "derived" or path[0] == "design"):
            path.append(".".join(parts))
            break
    return tuple(path)


def parse_overrides(texts: Sequence[str], top_fields: Iterable[str]) -> list[Override]:
    """The overrides as typed; Problems (one per bad word) when one is not KEY=VALUE."""
    out, problems = [], []
    fields = list(top_fields)
    for text in texts:
        key, sep, raw = text.partition("=")
        key = key.strip()
        where = (f"override {text!r}",)
        if not sep or not _KEY.match(key):
            problems.append(Problem(where, f"expected {OVERRIDE_FORMAT}"))
            continue
        try:
            value, _ = read_yaml(raw) if raw.strip() else (None, {})
        except Problems as bad:
            problems.append(
                Problem(where, f"the value is not YAML ({bad.problems[0].message}); expected {OVERRIDE_FORMAT}")
            )
            continue
        out.append(Override(text, _path(key, fields), value))
    if problems:
        raise Problems(problems)
    return out


def apply_overrides(data: dict[str, Any], overrides: Sequence[Override], lines: Lines) -> dict[str, Any]:
    """A copy of the file's data with the overrides set; in `lines` each overridden path (and
    what was under it) names its override instead of a line."""
    data = copy.deepcopy(data)
    problems = []
    for override in overrides:
        node: Any = data
        for i, part in enumerate(override.path[:-1]):
            here = format_yaml_path(override.path[: i + 1])
            if isinstance(node, dict):
                if not isinstance(node.get(part), (dict, list)):
                    node[part] = {}
                node = node[part]
            elif isinstance(node, list) and isinstance(part, int) and part < len(node):
                node = node[part]
            else:
                size = f"a list of {len(node)}" if isinstance(node, list) else type(node).__name__
                problems.append(
                    Problem(
                        (override.source,),
                        f"{here} is not in the file ({format_yaml_path(override.path[:i]) or 'the file'} "
                        f"is {size}); expected {OVERRIDE_FORMAT}",
                    )
                )
                break
        else:
            last = override.path[-1]
            if isinstance(node, list) and not (isinstance(last, int) and last < len(node)):
                problems.append(
                    Problem(
                        (override.source,),
                        f"{format_yaml_path(override.path)} is not in the "
                        f"file (a list of {len(node)}); expected {OVERRIDE_FORMAT}",
                    )
                )
                continue
            node[last] = override.value
            for path in [p for p in lines if p[: len(override.path)] == override.path]:
                del lines[path]
            lines[override.path] = override.source
    if problems:
        raise Problems(problems)
    return data


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML has no types
    """Writes a published reference number as the file wrote it (`68.20`), and a list of
    scalars on one line (`ks: [1, 5]`)."""

    def represent_list(self, data: list[Any]) -> Any:
        flat = all(not isinstance(item, (dict, list)) for item in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_Dumper.add_representer(list, _Dumper.represent_list)
_Dumper.add_representer(
    PublishedNumber, lambda dumper, number: dumper.represent_scalar("tag:yaml.org,2002:float", number.text)
)


def dump_yaml(data: Any) -> str:
    """YAML as a person writes a study file: block mappings, short lists on one line."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True)


def resolved_text(data: dict[str, Any], overrides: Sequence[Override], file: str) -> str:
    """The study file with its overrides applied, headed by where it came from."""
    header = [f"# {file} with the command-line overrides below applied (studies run ... KEY=VALUE):"]
    header += [f"#   {override.text}" for override in overrides]
    return "\n".join(header) + "\n" + dump_yaml(data)
