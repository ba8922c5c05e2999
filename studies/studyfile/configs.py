"""The configs of a study's design: each design entry applied to its variants, validated.

A design block gives values for dotted paths; each set of values is written into the variant's
config, the ``derived`` parameters are computed, and the result is validated as a trial config
(``studies.studyfile.trial_config``). A problem is reported at the YAML path of the design entry (or the
derived entry, the variant, base) that caused it. The configs of all blocks form the study's
design, deduplicated by ``config_id``; ``studies.cells.space`` pairs them with the seeds.

Random blocks are sampled with ``random.Random(sampler_seed)`` using ``random()`` only, whose
Mersenne-Twister stream is stable across Python versions; optuna blocks give no configs here
(their proposals come while the study runs) but their corner values are checked.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import random
from dataclasses import dataclass
from typing import Any, cast

from analysis.layout import flatten_config
from setvalued.paths import get_path, set_path, split_path
from studies.studyfile.config_ids import config_id, round_float
from studies.studyfile.cross_checks import origin_in_variant
from studies.studyfile.design import (
    DesignBlock,
    Distribution,
    GridBlock,
    OptunaBlock,
    RandomBlock,
    SensitivityBlock,
    SingleBlock,
)
from studies.studyfile.expressions import ExpressionError
from studies.studyfile.problems import Path_, Problem
from studies.studyfile.study import Study
from studies.studyfile.trial_config import declared_param, validate_config

__all__ = ["DesignedConfig", "build_config", "design_configs", "format_value"]

#: stop collecting problems after this many (a grid of 10,000 bad cells says it soon enough)
_MAX_PROBLEMS = 40


@dataclass
class DesignedConfig:
    """A config of the design, before pairing with the seeds: its variant, the validated
    config and the values the design set (``swept``: dotted path -> value); its
    ``config_id`` once `design_configs` has computed it."""

    variant: str
    config: dict[str, Any]
    swept: dict[str, Any]
    config_id: str | None = None


def _context(variant: str, values: dict[str, Any], study: Study) -> str:
    parts = []
    if study.variants:
        parts.append(f"variant '{variant}'")
    if values:
        parts.append("with " + ", ".join(f"{k}={format_value(v)}" for k, v in values.items()))
    return f" ({'; '.join(parts)})" if parts else ""


def _map_problem(study: Study, variant: str, problem: Problem, origins: dict[str, Path_]) -> Path_:
    """YAML path of a config problem: the design entry, the derived entry, the variant or base."""
    path = tuple(problem.path)
    for swept, origin in origins.items():
        sp = split_path(swept)
        if path[: len(sp)] == sp:
            return tuple(origin) + path[len(sp) :]
    for swept, origin in origins.items():
        sp = split_path(swept)
        if path and sp[: len(path)] == path:
            return tuple(origin)
    for target in study.derived:
        tp = split_path(target)
        if path[: len(tp)] == tp:
            return ("derived", target) + path[len(tp) :]
    return origin_in_variant(study, variant, path)


def _is_path_problem(message: str) -> bool:
    """Whether a config problem is about a path that does not exist (not about a value)."""
    return message.startswith("unknown field") or " has no parameter " in message


def build_config(
    study: Study, variant: str, values: dict[str, Any], origins: dict[str, Path_] | None = None
) -> tuple[dict[str, Any] | None, list[Problem]]:
    """The validated config of ``variant`` with the design ``values`` set, then ``derived``.

    ``origins`` gives the YAML path of each value (for the error messages). Returns
    ``(config, [])`` or ``(None, problems)`` with YAML paths of the study file.
    """
    origins = origins or {p: ("design",) for p in values}
    raw = study.variant_raw_config(variant)
    ctx = _context(variant, values, study)
    problems: list[Problem] = []
    for path in values:
        parts = split_path(path)
        for n in range(1, len(parts)):
            node = study.variant_value(variant, ".".join(parts[:n]))
            if node is not None and not isinstance(node, dict):
                prefix = ".".join(parts[:n])
                problems.append(
                    Problem(
                        origins[path],
                        f"'{prefix}' holds {node!r}, not a mapping, so '{path}' is not a config path{ctx}",
                    )
                )
                break
    if problems:
        return None, problems
    for path, value in values.items():
        try:
            set_path(raw, path, value)
        except ValueError as err:
            problems.append(Problem(origins[path], f"{err}{ctx}"))
    if problems:
        return None, problems

    def fail(found: list[Problem]) -> tuple[None, list[Problem]]:
        out = []
        for p in found:
            where = _map_problem(study, variant, p, origins)
            message = p.message + ctx
            if _is_path_problem(p.message) and where[:1] == ("design",):
                # about the path, not one value: point at the entry, not at its first value
                where = where[:-1] if isinstance(where[-1], int) else where
                if study.variants:
                    message += "; restrict the block to the variants that have it with variants: [...]"
            out.append(Problem(where, message))
        return None, out

    if study.derived_expressions:
        filled, found = validate_config(raw)
        if found:
            return fail(found)
        lookup = flatten_config(cast(dict[str, Any], filled))  # no problem found: a config
        for target, expr in study.derived_expressions:
            missing = sorted(n for n in expr.names if n not in lookup)
            if missing:
                return None, [
                    Problem(
                        ("derived", target),
                        f"'{missing[0]}' is not a value of the config"
                        f"{ctx}; expected a dotted path to a number such as optim.batch_size",
                    )
                ]
            try:
                result = expr.evaluate(lookup)
            except ExpressionError as err:
                return None, [Problem(("derived", target), f"{err}{ctx}")]
            if isinstance(result, float):
                result = round_float(result)
            try:
                set_path(raw, target, result)
            except ValueError as err:
                return None, [Problem(("derived", target), f"{err}{ctx}")]
            lookup[target] = result
    config, found = validate_config(raw)
    if found:
        return fail(found)
    return config, []


def _sample(dist: Distribution, rng: random.Random) -> Any:
    """One value of a distribution from ``rng.random()`` only (stable across Python versions)."""
    kind, bounds = dist.kind, dist.bounds
    u = rng.random()
    if kind == "uniform":
        return round_float(bounds[0] + (bounds[1] - bounds[0]) * u)
    if kind == "loguniform":
        lo, hi = math.log(bounds[0]), math.log(bounds[1])
        return round_float(math.exp(lo + (hi - lo) * u))
    if kind == "int":
        lo, hi = bounds
        return min(hi, lo + int(u * (hi - lo + 1)))
    return copy.deepcopy(bounds[min(len(bounds) - 1, int(u * len(bounds)))])


def _block_configs(
    study: Study, index: int, block: DesignBlock, problems: list[Problem], seen: set[tuple[Path_, str]]
) -> list[DesignedConfig]:
    """The configs of one design block (none for optuna: its corners are only checked)."""
    drafts: list[DesignedConfig] = []

    def add(
        variant: str, values: dict[str, Any], origins: dict[str, Any], swept: dict[str, Any] | None = None
    ) -> dict[str, Any] | None:
        if len(problems) >= _MAX_PROBLEMS:
            return None
        config, found = build_config(study, variant, values, origins)
        for p in found:
            # one message per design entry, not one per value of the entry
            where = p.path[:-1] if p.path and isinstance(p.path[-1], int) else p.path
            key = (where, p.message.split(" (variant ")[0].split(" (with ")[0])
            if key not in seen:
                seen.add(key)
                problems.append(p)
        if config is not None:
            drafts.append(DesignedConfig(variant, config, dict(values if swept is None else swept)))
        return config

    where = ("design", index, "parameters")
    variants = study.block_variants(block)
    if isinstance(block, SingleBlock):
        for variant in variants:
            add(variant, {}, {})
    elif isinstance(block, GridBlock):
        paths = list(block.parameters)
        indexed = [list(enumerate(block.parameters[p])) for p in paths]
        for combo in itertools.product(*indexed):
            values = {p: v for p, (_, v) in zip(paths, combo)}
            origins: dict[str, Path_] = {p: where + (p, j) for p, (j, _) in zip(paths, combo)}
            for variant in variants:
                add(variant, values, origins)
    elif isinstance(block, SensitivityBlock):
        for variant in variants:
            base = add(variant, {}, {})
            if base is None:
                continue
            # the base cell is on every curve: its swept holds each parameter's base value
            drafts[-1].swept = {p: get_path(base, p) for p in block.parameters if get_path(base, p, None) is not None}
            for path, listed in block.parameters.items():
                for j, value in enumerate(listed):
                    add(variant, {path: value}, {path: where + (path, j)})
    elif isinstance(block, RandomBlock):
        if _distribution_problems(study, index, block, variants, problems):
            return []
        rng = random.Random(block.sampler_seed)
        paths = sorted(block.parameters)  # independent of the key order in the file
        for _ in range(block.n_configs):
            values = {p: _sample(block.parameters[p], rng) for p in paths}
            origins = {p: where + (p,) for p in paths}
            for variant in variants:
                add(variant, values, origins)
    elif isinstance(block, OptunaBlock):
        if _distribution_problems(study, index, block, variants, problems):
            return []
        # Checked here on the corners (each bound, each choice, one parameter at a time).
        for variant in variants:
            for path, dist in block.parameters.items():
                for value in dist.corner_values():
                    add(variant, {path: value}, {path: where + (path,)})
        return []
    return drafts


def _distribution_problems(
    study: Study, index: int, block: RandomBlock | OptunaBlock, variants: list[str], problems: list[Problem]
) -> bool:
    """Whether a distribution of a random or optuna block cannot give values of its field's
    declared type (a uniform on an integer field would give 3.7 epochs, or leave an Optuna
    trial with a float where an integer is needed); adds one problem per such parameter."""
    found = False
    for path, dist in block.parameters.items():
        for variant in variants:
            param = declared_param(study.variant_config(variant), path)
            if param is None or dist.kind == "choice":
                continue
            if param.type == "int" and dist.kind != "int":
                reason = f"'{path}' is an integer: sample it with int: [low, high] or choice: [...], not {dist.kind}"
            elif param.type not in ("int", "float"):
                reason = f"'{path}' is {param.describe()}: sample it with choice: [...], not {dist.kind}"
            else:
                continue
            problems.append(Problem(("design", index, "parameters", path), reason))
            found = True
            break
    return found


def design_configs(study: Study) -> tuple[list[DesignedConfig], list[Problem]]:
    """Every config of the design (union of the blocks, deduplicated by config_id) and the
    problems found while building them."""
    problems: list[Problem] = []
    seen: set[tuple[Path_, str]] = set()
    unique: dict[str, DesignedConfig] = {}
    for index, block in enumerate(study.design):
        for draft in _block_configs(study, index, block, problems, seen):
            cid = draft.config_id = config_id(draft.config)
            if cid in unique:
                # same config from another block or value: one cell, swept values merged
                for key, value in draft.swept.items():
                    unique[cid].swept.setdefault(key, value)
            else:
                unique[cid] = draft
    return list(unique.values()), problems


def format_value(value: Any) -> str:
    """A swept value as the dry-run table and the messages print it."""
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
