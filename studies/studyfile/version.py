"""A study's version: a digest of everything that defines its configs, and what changed.

One study name means one study (docs/guarantees.md, "One name, one study"). What defines the
configs of a study is

- every variant's trial config, validated with its defaults filled in (so ``base``, the
  variant overlays and the defaults of this code all count, and ``0.1`` / ``1e-1`` are one
  value);
- the ``derived`` expressions;
- every design block's fixed fields: its kind, the parameters it sets, a random or optuna
  block's distributions (their bounds), sampler, sampler seed and pruner;
- the config-level ``scheduler`` (it decides how long a config trains) and, where a scheduler
  or an optuna block reads it, the ``objective``;
- for a smoke run (``--smoke``), its epochs per cell.

What does not: the seeds (more seeds extend a study), the *set* of configs (another variant,
another design block at the end, more values in a grid, more ``n_configs``: each config already
run is defined as before), and what only says how or where a study runs or is reported
(``resources``, ``max_concurrent``, ``max_failures``, ``checkpoint_interval_s``,
``log_models``, ``max_cells``, ``report``, ``reference``, ``description``).

`definition` is that content as JSON data; `version_digest` its digest; `changes` lists the
fields whose value differs between two definitions (an extension has none). No torch, no Ray.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from studies.studyfile.config_ids import canonical

__all__ = [
    "Change",
    "definition",
    "version_digest",
    "changes",
    "format_changes",
    "ABSENT",
    "VERSION_LENGTH",
    "short_version",
]

#: hex digits of a version (12: two versions of one study never collide in practice)
VERSION_LENGTH = 12
#: how a field that one of two definitions lacks is written
ABSENT = "(absent)"
#: fields of a design block that enumerate its configs (changing them adds or drops configs)
_ENUMERATING = {
    "grid": {"parameters_values", "variants"},
    "sensitivity": {"parameters_values", "variants"},
    "random": {"n_configs", "variants"},
    "optuna": {"n_configs", "variants"},
    "single": {"variants"},
}


@dataclass(frozen=True)
class Change:
    """A field of the study whose value changed: its path as a person writes it, old and new."""

    path: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.path}: {_text(self.old)} -> {_text(self.new)}"


def _text(value: Any) -> str:
    if value is ABSENT:
        return ABSENT
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def short_version(version: str) -> str:
    """The first 7 hex digits of a version: how tables, names and messages show it."""
    return str(version)[:7]


def definition(study: Any, smoke_epochs: int | None = None) -> dict[str, Any]:
    """What defines the configs of a validated `study` (module docstring), as canonical
    JSON data; `smoke_epochs`: the epochs of a smoke run's cells (None: not a smoke run)."""
    design = []
    for block in study.design:
        dumped = block.model_dump(mode="json", by_alias=True, exclude_none=True)
        if dumped.get("kind") in ("grid", "sensitivity"):
            # the values of a grid or sensitivity block enumerate configs; their paths define them
            dumped["parameters"] = {path: "values" for path in dumped.get("parameters", {})}
        design.append(dumped)
    uses_objective = study.scheduler.kind != "none" or bool(study.optuna_blocks)
    content = {
        "variants": {name: study.variant_config(name) for name in study.variant_names},
        "derived": {target: str(expr) for target, expr in (study.derived or {}).items()},
        "design": design,
        "scheduler": study.scheduler.model_dump(mode="json", exclude_none=True),
    }
    if uses_objective and study.objective is not None:
        content["objective"] = study.objective.model_dump(mode="json")
    if smoke_epochs is not None:
        content["smoke_epochs"] = int(smoke_epochs)
    return canonical(content)


def version_digest(content: Mapping[str, Any]) -> str:
    """The first `VERSION_LENGTH` hex digits of the sha256 of the definition's canonical JSON."""
    text = json.dumps(canonical(dict(content)), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:VERSION_LENGTH]


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of nested mappings by dotted path; lists and empty mappings stay whole."""
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value} if prefix else {}


def _diff(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[Change]:
    a, b = _flat(old), _flat(new)
    out = []
    for path in list(dict.fromkeys(list(a) + list(b))):
        va, vb = a.get(path, ABSENT), b.get(path, ABSENT)
        if va != vb:
            out.append(Change(f"{prefix}{path}" if path else prefix.rstrip("."), va, vb))
    return out


def changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    """The fields of `old` whose value differs in `new`, as a person would name them.

    Not a change (an extension): variants or trailing design blocks added or removed, the
    values of a grid or sensitivity block, a block's ``n_configs`` or ``variants`` filter. A
    field that changed alike in every variant both hold is named once by its config path
    (``epochs: 15 -> 3``), else per variant (``variants.noised.loss.epsilon: 0.2 -> 0.3``).
    """
    found: list[Change] = []
    common = [v for v in old.get("variants", {}) if v in new.get("variants", {})]
    per_variant = {v: _diff(old["variants"][v], new["variants"][v]) for v in common}
    seen: dict[tuple[Any, ...], list[str]] = {}
    for variant, diffs in per_variant.items():
        for change in diffs:
            seen.setdefault((change.path, _text(change.old), _text(change.new)), []).append(variant)
    for variant, diffs in per_variant.items():
        for change in diffs:
            where = seen[(change.path, _text(change.old), _text(change.new))]
            if len(where) == len(common) and len(common) > 0:
                if variant == where[0]:
                    found.append(change)
            else:
                found.append(Change(f"variants.{variant}.{change.path}", change.old, change.new))
    found += _diff(old.get("derived", {}), new.get("derived", {}), "derived.")
    for i, (a, b) in enumerate(zip(old.get("design", []), new.get("design", []))):
        if a.get("kind") != b.get("kind"):
            found.append(Change(f"design[{i}].kind", a.get("kind"), b.get("kind")))
            continue
        skip = _ENUMERATING.get(a.get("kind"), set())
        a = {k: v for k, v in a.items() if k not in skip}
        b = {k: v for k, v in b.items() if k not in skip}
        if "parameters_values" in skip:  # the parameter paths count, their value lists do not
            a["parameters"] = sorted(a.get("parameters", {}))
            b["parameters"] = sorted(b.get("parameters", {}))
        found += _diff(a, b, f"design[{i}].")
    for key in ("scheduler", "objective", "smoke_epochs"):
        a, b = old.get(key, ABSENT), new.get(key, ABSENT)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            found += _diff(a, b, f"{key}.")
        elif a != b:
            found.append(Change(key, a, b))
    return found


def format_changes(found: list[Change], limit: int = 20) -> list[str]:
    """One line per change (at most `limit`, then how many more)."""
    lines = [f"  {change}" for change in found[:limit]]
    if len(found) > limit:
        lines.append(f"  ... and {len(found) - limit} more")
    return lines
