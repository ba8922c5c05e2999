"""A study's cells: every config of its design paired with the same seeds.

Ray Tune's ``grid_search`` re-samples random dimensions per grid cell, so a seed axis inside
Tune would give every seed a different config. Here every config of the design is built
first (``studies.studyfile.configs``, when the study is loaded), then paired with *the same* list of
seeds, so that comparisons between configs are paired by seed.

A study's cells are the union of its blocks, deduplicated by ``config_id``. The variant is
*not* part of the config: two variants with identical configs are one config, labelled with
the first variant that produced it; ``Cell.variant`` is a label for tables and plots only.
This module also holds smoke mode (any study in seconds on CPU), the proposals of optuna
blocks, and the ``--dry-run`` table.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from setvalued.label_kinds import max_labels
from setvalued.paths import copy_config, get_path, set_path
from studies.cells.run_names import run_names
from studies.studyfile.config_ids import canonical_json, config_id
from studies.studyfile.configs import build_config, format_value
from studies.studyfile.design import OptunaBlock
from studies.studyfile.problems import Path_
from studies.studyfile.study import Study
from studies.studyfile.trial_config import validate_config

__all__ = [
    "Cell",
    "expand",
    "config_id",
    "canonical_json",
    "smoke_config",
    "smoke_cells",
    "smoke_study",
    "format_cells_table",
    "optuna_block_suggest",
    "optuna_sampler",
]


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
    #: the version of the study that runs it (`studies.running.versions`; "" outside a run)
    version: str = ""

    @property
    def cell_id(self) -> str:
        return f"{self.config_id}-s{self.seed}"

    def __hash__(self) -> int:  # the dicts are not hashable; the ids identify a cell
        return hash((self.config_id, self.seed, self.variant))


def expand(study: Study) -> list[Cell]:
    """All cells of the study: every config of the design x every seed (paired).

    A racing study (``seeds: {initial, max}``) gives every seed of its sequence up to ``max``:
    the cells its race may run (`studies.scheduling.racing`); most are never started.

    Config-major order: the seeds of the first config, then of the second, and so on.
    Optuna blocks give no cells (see :func:`optuna_block_suggest`). The cells of one config
    share one copy of its config and swept values (read-only: a trial copies what it changes).
    """
    cells = []
    for draft in study.designed_configs:
        cid = draft.config_id or config_id(draft.config)
        config, swept = copy_config(draft.config), dict(draft.swept)
        for seed in study.seed_list:
            cells.append(Cell(cid, seed, draft.variant, config, swept))
    return cells


# --------------------------------------------------------------------------------------
# Optuna
# --------------------------------------------------------------------------------------


def _block_index(study: Study, block: int | OptunaBlock) -> tuple[int, OptunaBlock]:
    if isinstance(block, int):
        found = study.design[block]
        if not isinstance(found, OptunaBlock):
            raise ValueError(f"design[{block}] is a {found.kind} block, not an optuna block")
        return block, found
    for i, candidate in enumerate(study.design):
        if candidate is block:
            return i, block
    raise ValueError("the block is not one of this study's design blocks")


def optuna_block_suggest(
    study: Study, block: int | OptunaBlock, optuna_trial: Any
) -> tuple[str, dict[str, Any], dict[str, Any]]:
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
    origins: dict[str, Path_] = {p: ("design", index, "parameters", p) for p in values}
    config, problems = build_config(study, variant, values, origins)
    if problems:
        raise study.error(problems)
    return variant, cast(dict[str, Any], config), values  # no problem: a config


def optuna_sampler(block: OptunaBlock):
    """The Optuna sampler a block names (tpe, random, cmaes, gp, qmc), seeded by sampler_seed."""
    import optuna  # (only the runner needs Optuna)

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
_SMOKE_FIXED = (
    "data.name",
    "data.root",
    "data.download",
    "data.form",
    "data.num_workers",
    "model.name",
    "model.pretrained",
    "model.hidden_dim",
    "epochs",
    "device",
)
_SMOKE_BATCH = 16


def smoke_config(config: dict, keep: Iterable[str] = (), epochs: int = 1) -> dict:
    """The config on a tiny synthetic set, MLP, ``epochs`` epochs (one by default), CPU: a run
    of seconds.

    The loss, the metrics (eval), the optimiser settings and the kind of labels (multi-label data
    stay multi-label) stay; the synthetic set has
    enough classes for the largest K of ``loss.k``, ``eval.ks`` and ``eval.avgk`` plus 2.
    ``keep``: dotted paths to keep from ``config`` (the swept values, so that the design's
    configs stay distinct) when they make sense on the synthetic data; the others are
    replaced. Raises ValueError when the result is not a valid config.
    """
    ks = [
        math.ceil(k)
        for k in [config.get("loss", {}).get("k")]
        if isinstance(k, (int, float)) and not isinstance(k, bool)
    ]
    ks += list(config.get("eval", {}).get("ks", [])) + list(config.get("eval", {}).get("avgk", []))
    num_classes = max(max(ks, default=1) + 2, 4)
    smoke = copy.deepcopy(config)
    smoke["data"] = {
        "name": "synthetic",
        "num_classes": num_classes,
        "num_superclasses": 2,
        "train_size": 24 * num_classes,
        "val_size": 8 * num_classes,
        "test_size": 8 * num_classes,
        "form": "features",
        "feature_dim": 8,
        "num_workers": 0,
    }
    labels = max_labels(config.get("data") or {})
    if labels > 1:  # multi-label data stay multi-label (setvalued.label_kinds)
        smoke["data"]["max_labels"] = min(labels, num_classes)
    head = config.get("model", {}).get("head", "auto")
    smoke["model"] = {"name": "mlp", "pretrained": False, "head": head, "hidden_dim": 16}
    smoke.setdefault("optim", {})["batch_size"] = _SMOKE_BATCH
    smoke["epochs"] = int(epochs)
    smoke["device"] = "cpu"
    result, problems = validate_config(smoke)
    if problems:
        raise ValueError(
            "smoke config is invalid: " + "; ".join(f"{'.'.join(map(str, p.path))}: {p.message}" for p in problems)
        )
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
    return cast(dict[str, Any], result)  # validated without a problem


def smoke_cells(cells: list[Cell], epochs: int = 1) -> list[Cell]:
    """:func:`smoke_config` of ``epochs`` epochs on every cell, keeping its swept values; ids
    recomputed.

    Cells whose smoke configs coincide (e.g. a sweep over ``model.name``) collapse into one
    (first wins), so a smoke run may have fewer cells than the real study.
    """
    out: dict[tuple[str, int], Cell] = {}
    for cell in cells:
        config = smoke_config(cell.config, keep=cell.swept, epochs=epochs)
        cid = config_id(config)
        out.setdefault((cid, cell.seed), Cell(cid, cell.seed, cell.variant, config, dict(cell.swept)))
    return list(out.values())


def smoke_study(study: Study) -> Study:
    """The study as a smoke run executes it: one CPU per trial, no GPU, no early stopping or
    pruning (fused arrays kept: ``resources.seeds_per_trial``).

    The smoke cells are tiny CPU jobs of a few epochs (:func:`smoke_config`), so the file's GPU
    resources and its scheduler or pruners (which need every seed of a config at once, and
    decide nothing at a config's last epoch) do not apply, and their models are not worth
    logging.
    """
    from studies.studyfile.study import NoScheduler, Resources

    design = [
        block.model_copy(update={"pruner": None}) if getattr(block, "pruner", None) else block for block in study.design
    ]
    resources = Resources(cpus=1, gpus=0, seeds_per_trial=study.resources.seeds_per_trial)
    return study.model_copy(
        update={"resources": resources, "design": design, "scheduler": NoScheduler(kind="none"), "log_models": False}
    )


# --------------------------------------------------------------------------------------
# Dry-run table
# --------------------------------------------------------------------------------------


def format_cells_table(cells: list[Cell], study: Study | None = None) -> str:
    """The ``--dry-run`` table: the run name (variant, what sets its config apart, seed), one
    column per swept path, the config_id; a count line.

    With ``study``, optuna blocks (whose configs are proposed while the study runs) are
    listed under the table.
    """
    paths: list[str] = []
    for cell in cells:
        for path in cell.swept:
            if path not in paths:
                paths.append(path)
    names = run_names(cells)  # what MLflow's run list will show
    header = ["run name"] + paths + ["config_id"]
    rows = [
        [names[c.cell_id]] + [format_value(c.swept[p]) if p in c.swept else "-" for p in paths] + [c.config_id]
        for c in cells
    ]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    n_configs = len({c.config_id for c in cells})
    n_seeds = len({c.seed for c in cells})

    def counted(n: int, noun: str) -> str:
        return f"{n} {noun}" + ("" if n == 1 else "s")

    lines.append(f"{counted(len(cells), 'cell')} = {counted(n_configs, 'config')} x {counted(n_seeds, 'seed')}")
    if study is not None and study.racing is not None:
        race = study.racing
        lines.append(
            f"racing on {race.until.metric} ({race.until.mode}): each config starts with "
            f"{race.initial} seeds and gets {race.step} more per round while undecided "
            f"against the best, up to {race.max}: between {n_configs * race.initial} and "
            f"{len(cells)} cells"
        )
    if study is not None:
        for index, block in study.optuna_blocks:
            n = block.n_configs * len(study.seed_list)
            lines.append(
                f"+ design[{index}] (optuna, {block.sampler}): {block.n_configs} proposals x "
                f"{len(study.seed_list)} seeds = {n} cells, proposed while the study runs"
            )
    return "\n".join(lines)
