"""Expansion of a study into cells: (config, seed) pairs, materialised by the project.

Ray Tune's ``grid_search`` re-samples random dimensions per grid cell, so a seed axis inside
Tune would give every seed a different config (orchestration-anchors.md, finding 2). Here
every config of the design is built first, then paired with *the same* list of seeds.

Design blocks (docs/interfaces.md, section 6):

- ``grid``: the cartesian product of the listed values, for every variant of the block;
- ``sensitivity``: one parameter at a time around each variant's own value; the variant's
  config itself is one cell (once, however many parameters are varied);
- ``random``: ``n_configs`` parameter sets sampled from the distributions with
  ``random.Random(sampler_seed)`` (only ``random()`` is used, whose Mersenne-Twister
  stream is stable across Python versions), the same sets for every variant;
- ``optuna``: no cells here; the runner asks :func:`optuna_block_suggest` for each proposal;
- ``single``: the variants as they are.

A study's cells are the union of its blocks, deduplicated by ``config_id``. ``derived``
parameters are computed after the design values. The variant is *not* part of the config:
two variants with identical configs are one config, labelled with the first variant that
produced it; ``Cell.variant`` is a label for tables and plots only.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

from studies.spec import (
    OptunaBlock,
    Problem,
    RandomBlock,
    SensitivityBlock,
    SingleBlock,
    GridBlock,
    Study,
    _origin_in_variant,
    _Problems,
    flatten_config,
    get_path,
    round_float,
    set_path,
    split_path,
    validate_config,
)
from studies.expressions import ExpressionError

__all__ = [
    "Cell",
    "expand",
    "config_id",
    "canonical_json",
    "smoke_config",
    "smoke_cells",
    "format_cells_table",
    "optuna_block_suggest",
    "optuna_sampler",
    "build_config",
    "validate_design",
]

#: stop collecting problems after this many (a grid of 10,000 bad cells says it soon enough)
_MAX_PROBLEMS = 40


# --------------------------------------------------------------------------------------
# Cells and config ids
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One trial of a study: a config (without seed), a seed, and labels.

    ``swept`` maps the dotted paths the design set for this config to their values (JSON
    object in the MLflow tag ``studies.swept``); ``variant`` names the variant it came from.
    """

    config_id: str
    seed: int
    variant: str
    config: dict = field(repr=False)
    swept: dict = field(default_factory=dict)

    @property
    def cell_id(self) -> str:
        return f"{self.config_id}-s{self.seed}"

    def __hash__(self) -> int:  # the dicts are not hashable; the ids identify a cell
        return hash((self.config_id, self.seed, self.variant))


def _canonical(value: Any) -> Any:
    """Normalised copy: sorted mappings, lists for tuples, floats to 12 significant digits
    and integral floats as ints (so 0.1 == 1e-1 and 64 == 64.0 give one id)."""
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"a config cannot hold the non-finite number {value}")
        value = round_float(value)
        if value.is_integer() and abs(value) < 2**53:
            return int(value)
        return value
    raise TypeError(f"a config holds only YAML values (mappings, lists, numbers, strings), "
                    f"got {type(value).__name__}")


def canonical_json(config: dict) -> str:
    """The canonical JSON text of a config without its seed (sorted keys, no spaces)."""
    body = {k: v for k, v in config.items() if k != "seed"}
    return json.dumps(_canonical(body), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def config_id(config: dict) -> str:
    """First 10 hex digits of the sha256 of :func:`canonical_json` (docs/interfaces.md §6)."""
    return hashlib.sha256(canonical_json(config).encode("utf-8")).hexdigest()[:10]


# --------------------------------------------------------------------------------------
# Building one config of the design
# --------------------------------------------------------------------------------------


@dataclass
class _Draft:
    """A config of the design, before pairing with the seeds."""

    variant: str
    config: dict
    swept: dict


def _context(variant: str, values: dict, study: Study) -> str:
    parts = []
    if study.variants:
        parts.append(f"variant '{variant}'")
    if values:
        parts.append("with " + ", ".join(f"{k}={_fmt(v)}" for k, v in values.items()))
    return f" ({'; '.join(parts)})" if parts else ""


def _map_problem(study: Study, variant: str, problem: Problem, origins: dict[str, tuple]) -> tuple:
    """YAML path of a config problem: the design entry, the derived entry, the variant or base."""
    path = tuple(problem.path)
    for swept, origin in origins.items():
        sp = split_path(swept)
        if path[: len(sp)] == sp:
            return tuple(origin) + path[len(sp):]
    for swept, origin in origins.items():
        sp = split_path(swept)
        if path and sp[: len(path)] == path:
            return tuple(origin)
    for target in study.derived:
        tp = split_path(target)
        if path[: len(tp)] == tp:
            return ("derived", target) + path[len(tp):]
    return _origin_in_variant(study, variant, path)


def _is_path_problem(message: str) -> bool:
    """Whether a config problem is about a path that does not exist (not about a value)."""
    return message.startswith("unknown field") or " has no parameter " in message


def build_config(study: Study, variant: str, values: dict[str, Any],
                 origins: Optional[dict[str, tuple]] = None) -> tuple[Optional[dict], list[Problem]]:
    """The validated config of ``variant`` with the design ``values`` set, then ``derived``.

    ``origins`` gives the YAML path of each value (for the error messages). Returns
    ``(config, [])`` or ``(None, problems)`` with YAML paths of the study file.
    """
    origins = origins or {p: ("design",) for p in values}
    raw = study.variant_raw_config(variant)
    ctx = _context(variant, values, study)
    problems: list[Problem] = []
    filled = study._variant_configs[variant]
    for path in values:
        parts = split_path(path)
        for n in range(1, len(parts)):
            node = get_path(filled, ".".join(parts[:n]), None)
            if node is not None and not isinstance(node, dict):
                prefix = ".".join(parts[:n])
                problems.append(Problem(origins[path], f"'{prefix}' holds {node!r}, not a mapping, so "
                                        f"'{path}' is not a config path{ctx}"))
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
        lookup = flatten_config(filled)
        for target, expr in study.derived_expressions:
            missing = sorted(n for n in expr.names if n not in lookup)
            if missing:
                return None, [Problem(("derived", target), f"'{missing[0]}' is not a value of the config"
                                      f"{ctx}; expected a dotted path to a number such as optim.batch_size")]
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


def _sample(dist, rng: random.Random) -> Any:
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


def _block_drafts(study: Study, index: int, block, problems: list[Problem], seen: set) -> list[_Draft]:
    """The configs of one design block (none for optuna: its corners are only checked)."""
    drafts: list[_Draft] = []

    def add(variant: str, values: dict, origins: dict, swept: Optional[dict] = None) -> Optional[dict]:
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
            drafts.append(_Draft(variant, config, dict(values if swept is None else swept)))
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
            origins = {p: where + (p, j) for p, (j, _) in zip(paths, combo)}
            for variant in variants:
                add(variant, values, origins)
    elif isinstance(block, SensitivityBlock):
        for variant in variants:
            base = add(variant, {}, {})
            if base is None:
                continue
            # the base cell is on every curve: its swept holds each parameter's base value
            drafts[-1].swept = {p: get_path(base, p) for p in block.parameters if get_path(base, p, None) is not None}
            for path, values in block.parameters.items():
                for j, value in enumerate(values):
                    add(variant, {path: value}, {path: where + (path, j)})
    elif isinstance(block, RandomBlock):
        rng = random.Random(block.sampler_seed)
        paths = sorted(block.parameters)  # independent of the key order in the file
        for _ in range(block.n_configs):
            values = {p: _sample(block.parameters[p], rng) for p in paths}
            origins = {p: where + (p,) for p in paths}
            for variant in variants:
                add(variant, values, origins)
    elif isinstance(block, OptunaBlock):
        # Checked here on the corners (each bound, each choice, one parameter at a time).
        for variant in variants:
            for path, dist in block.parameters.items():
                for value in dist.corner_values():
                    add(variant, {path: value}, {path: where + (path,)})
        return []
    return drafts


def _design_drafts(study: Study) -> tuple[list[_Draft], list[Problem]]:
    """Every config of the design (union of the blocks, deduplicated by config_id)."""
    problems: list[Problem] = []
    seen: set = set()
    unique: dict[str, _Draft] = {}
    for index, block in enumerate(study.design):
        for draft in _block_drafts(study, index, block, problems, seen):
            cid = config_id(draft.config)
            if cid in unique:
                # same config from another block or value: one cell, swept values merged
                for key, value in draft.swept.items():
                    unique[cid].swept.setdefault(key, value)
            else:
                unique[cid] = draft
    return list(unique.values()), problems


def validate_design(study: Study) -> None:
    """Build every config of the design once (called by load_study); raise on problems."""
    drafts, problems = _design_drafts(study)
    if problems:
        raise _Problems(problems)
    study._drafts = drafts


def expand(study: Study) -> list[Cell]:
    """All cells of the study: every config of the design x every seed (paired).

    Config-major order: the seeds of the first config, then of the second, and so on.
    Optuna blocks give no cells (see :func:`optuna_block_suggest`).
    """
    drafts = study._drafts
    if drafts is None:
        drafts, problems = _design_drafts(study)
        if problems:
            raise study.error(problems)
    cells = []
    for draft in drafts:
        cid = config_id(draft.config)
        for seed in study.seeds:
            cells.append(Cell(cid, seed, draft.variant, copy.deepcopy(draft.config), dict(draft.swept)))
    return cells


# --------------------------------------------------------------------------------------
# Optuna
# --------------------------------------------------------------------------------------


def _block_index(study: Study, block: Union[int, OptunaBlock]) -> tuple[int, OptunaBlock]:
    if isinstance(block, int):
        found = study.design[block]
        if not isinstance(found, OptunaBlock):
            raise ValueError(f"design[{block}] is a {found.kind} block, not an optuna block")
        return block, found
    for i, candidate in enumerate(study.design):
        if candidate is block:
            return i, block
    raise ValueError("the block is not one of this study's design blocks")


def optuna_block_suggest(study: Study, block: Union[int, OptunaBlock], optuna_trial) -> tuple[str, dict, dict]:
    """Ask an Optuna trial for one config of an optuna block: ``(variant, config, swept)``.

    Each distribution becomes ``suggest_float`` (``log=True`` for loguniform),
    ``suggest_int`` or ``suggest_categorical`` under its dotted path; with several
    variants the variant itself is a categorical parameter named ``variant`` (give each
    variant its own block to tune them separately). The runner runs the config on every
    seed and tells Optuna the seed mean. Raises StudyError when the proposal is not a valid
    config (e.g. a combination of values out of range).
    """
    index, block = _block_index(study, block)
    variants = study.block_variants(block)
    variant = variants[0] if len(variants) == 1 else optuna_trial.suggest_categorical("variant", variants)
    values: dict[str, Any] = {}
    for path in sorted(block.parameters):
        dist = block.parameters[path]
        low_high = dist.bounds
        if dist.kind == "uniform":
            values[path] = optuna_trial.suggest_float(path, low_high[0], low_high[1])
        elif dist.kind == "loguniform":
            values[path] = optuna_trial.suggest_float(path, low_high[0], low_high[1], log=True)
        elif dist.kind == "int":
            values[path] = optuna_trial.suggest_int(path, low_high[0], low_high[1])
        else:
            choices = dist.bounds
            if all(c is None or isinstance(c, (bool, int, float, str)) for c in choices):
                values[path] = optuna_trial.suggest_categorical(path, choices)
            else:  # Optuna's categorical values must be scalars: choose by JSON text
                texts = [json.dumps(c, sort_keys=True) for c in choices]
                values[path] = copy.deepcopy(choices[texts.index(optuna_trial.suggest_categorical(path, texts))])
    origins = {p: ("design", index, "parameters", p) for p in values}
    config, problems = build_config(study, variant, values, origins)
    if problems:
        raise study.error(problems)
    return variant, config, values


def optuna_sampler(block: OptunaBlock):
    """The Optuna sampler a block names (tpe, random, cmaes, gp, qmc), seeded by sampler_seed."""
    import optuna  # noqa: WPS433  (only the runner needs Optuna)

    samplers = {
        "tpe": optuna.samplers.TPESampler,
        "random": optuna.samplers.RandomSampler,
        "cmaes": optuna.samplers.CmaEsSampler,
        "gp": optuna.samplers.GPSampler,
        "qmc": optuna.samplers.QMCSampler,
    }
    return samplers[block.sampler](seed=block.sampler_seed)


# --------------------------------------------------------------------------------------
# Smoke mode
# --------------------------------------------------------------------------------------

#: paths that smoke mode always sets itself (a swept value there is not kept)
_SMOKE_FIXED = ("data.name", "data.root", "data.download", "data.form", "data.num_workers",
                "model.name", "model.pretrained", "model.hidden_dim", "epochs", "device")
_SMOKE_BATCH = 16


def smoke_config(config: dict, keep: Iterable[str] = ()) -> dict:
    """The config on a tiny synthetic set, MLP, one epoch, CPU: a run of seconds.

    The loss, the metrics (eval) and the optimiser settings stay; the synthetic set has
    enough classes for the largest K of ``loss.k``, ``eval.ks`` and ``eval.avgk`` plus 2.
    ``keep``: dotted paths to keep from ``config`` (the swept values, so that the design's
    configs stay distinct) when they make sense on the synthetic data; the others are
    replaced. Raises ValueError when the result is not a valid config.
    """
    ks = [math.ceil(k) for k in [config.get("loss", {}).get("k")]
          if isinstance(k, (int, float)) and not isinstance(k, bool)]
    ks += list(config.get("eval", {}).get("ks", [])) + list(config.get("eval", {}).get("avgk", []))
    num_classes = max(max(ks, default=1) + 2, 4)
    smoke = copy.deepcopy(config)
    smoke["data"] = {"name": "synthetic", "num_classes": num_classes, "num_superclasses": 2,
                     "train_size": 24 * num_classes, "val_size": 8 * num_classes,
                     "test_size": 8 * num_classes, "form": "features", "feature_dim": 8,
                     "num_workers": 0}
    head = config.get("model", {}).get("head", "auto")
    smoke["model"] = {"name": "mlp", "pretrained": False, "head": head, "hidden_dim": 16}
    smoke.setdefault("optim", {})["batch_size"] = _SMOKE_BATCH
    smoke["epochs"] = 1
    smoke["device"] = "cpu"
    result, problems = validate_config(smoke)
    if problems:
        raise ValueError("smoke config is invalid: " + "; ".join(
            f"{'.'.join(map(str, p.path))}: {p.message}" for p in problems))
    for path in keep:
        if any(path == f or path.startswith(f + ".") for f in _SMOKE_FIXED):
            continue
        value = get_path(config, path, None)
        if value is None:
            continue
        trial = copy.deepcopy(smoke)
        try:
            set_path(trial, path, value)
        except ValueError:
            continue
        if path.startswith("data."):  # sizes follow a kept number of classes
            c = trial["data"].get("num_classes", num_classes)
            for size, factor in (("train_size", 24), ("val_size", 8), ("test_size", 8)):
                if size not in keep:
                    trial["data"][size] = factor * c
        checked, problems = validate_config(trial)
        if not problems:
            smoke, result = trial, checked
    return result


def smoke_cells(cells: list[Cell]) -> list[Cell]:
    """:func:`smoke_config` on every cell, keeping its swept values; ids recomputed.

    Cells whose smoke configs coincide (e.g. a sweep over ``model.name``) collapse into one
    (first wins), so a smoke run may have fewer cells than the real study.
    """
    out: dict[tuple[str, int], Cell] = {}
    for cell in cells:
        config = smoke_config(cell.config, keep=cell.swept)
        cid = config_id(config)
        out.setdefault((cid, cell.seed), Cell(cid, cell.seed, cell.variant, config, dict(cell.swept)))
    return list(out.values())


# --------------------------------------------------------------------------------------
# Dry-run table
# --------------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def format_cells_table(cells: list[Cell], study: Optional[Study] = None) -> str:
    """The ``--dry-run`` table: config_id, seed, variant, one column per swept path; a count line.

    With ``study``, optuna blocks (whose configs are proposed while the study runs) are
    listed under the table.
    """
    paths: list[str] = []
    for cell in cells:
        for path in cell.swept:
            if path not in paths:
                paths.append(path)
    header = ["config_id", "seed", "variant"] + paths
    rows = [[c.config_id, str(c.seed), c.variant] + [_fmt(c.swept[p]) if p in c.swept else "-" for p in paths]
            for c in cells]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    n_configs = len({c.config_id for c in cells})
    n_seeds = len({c.seed for c in cells})
    def counted(n: int, noun: str) -> str:
        return f"{n} {noun}" + ("" if n == 1 else "s")

    lines.append(f"{counted(len(cells), 'cell')} = {counted(n_configs, 'config')} x "
                 f"{counted(n_seeds, 'seed')}")
    if study is not None:
        for index, block in study.optuna_blocks:
            n = block.n_configs * len(study.seeds)
            lines.append(f"+ design[{index}] (optuna, {block.sampler}): {block.n_configs} proposals x "
                         f"{len(study.seeds)} seeds = {n} cells, proposed while the study runs")
    return "\n".join(lines)
