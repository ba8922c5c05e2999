"""Studies as tasks: the per-seed values of every variant on every task of a comparison.

A comparison across studies needs one number per (task, variant, seed). The rules, each said
in the report where it applies:

- **Tasks.** Each study is a task; a study that sweeps a parameter for every one of its
  variants (`data.label_noise` in thesis Table 4.4, `data.pareto_shape` in the worked example
  of docs/comparison.md) gives a task per value of it: the parameters every variant sweeps are
  the task's context, the others are a variant's own hyperparameters.
- **One config per variant and task.** A variant with several configs on a task (its own
  sweep, `loss.epsilon`) is represented by the config with the best mean validation score
  (`best_val`, the selection metric's best value, as the papers choose: never on test); a
  study without a validation score and several configs is refused, naming them.
- **Variants by name.** Variants are matched by name across studies, after `rename`
  (``{"old": "new"}`` for every study, ``{"study:old": "new"}`` for one).
- **Versions.** A study of several versions (`studies run --new-version`) is compared on its
  latest version; the older ones are left out and said, never pooled.
- **Seeds.** Every entry keeps its own seeds: a task whose variants ran different seeds is
  said, and paired tests use the seeds they share.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from analysis.distinct import VERSION_COLUMN, VERSION_PARAM, short_version, versions_of
from analysis.formatting import assignments
from analysis.intervals import lower_is_better

__all__ = ["CompareError", "StudyRuns", "Task", "Entry", "Scores", "DEFAULT_METRICS", "SELECTION", "task_scores"]

#: the metric compared when none is named: the first that every study logged
DEFAULT_METRICS = ("test/top5", "test/avg5", "test/top1")
#: the score a variant's configs are chosen on within a task (validation, never test)
SELECTION = "best_val"


class CompareError(ValueError):
    """Studies that cannot be compared as asked (names the study, variant or metric)."""


@dataclass(frozen=True)
class StudyRuns:
    """The finished cells of one study (`analysis.collect` rows) and its variants' order."""

    name: str
    rows: Sequence[Mapping[str, Any]]
    variant_order: Sequence[str] = ()


@dataclass(frozen=True)
class Task:
    """A study, or one value of the parameters every variant of the study sweeps."""

    study: str
    context: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        """`study` or `study (p=0.1)` (the papers' symbols, `analysis.formatting`)."""
        if not self.context:
            return self.study
        return f"{self.study} ({', '.join(assignments(dict(self.context)))})"


@dataclass(frozen=True)
class Entry:
    """One variant on one task: the per-seed values of the config that represents it."""

    config_id: str
    swept: str  # the config's swept values (JSON text)
    seeds: tuple[int, ...]
    values: tuple[float, ...]
    candidates: int = 1  # configs of the variant on the task it was chosen among

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return math.fsum(self.values) / len(self.values) if self.values else math.nan


@dataclass
class Scores:
    """Every entry of a comparison, the tasks and variants in the order they are shown."""

    metric: str
    tasks: list[Task]
    variants: list[str]
    entries: dict[tuple[int, str], Entry]
    notes: list[str] = field(default_factory=list)

    @property
    def lower_is_better(self) -> bool:
        return lower_is_better(self.metric)

    def entry(self, task: int, variant: str) -> Entry | None:
        return self.entries.get((task, variant))

    def complete_tasks(self, variants: Sequence[str]) -> list[int]:
        """The tasks on which every one of `variants` has an entry."""
        return [t for t in range(len(self.tasks)) if all((t, v) in self.entries for v in variants)]


def _renamer(rename: Mapping[str, str] | None, study: str):
    """variant -> its name in the comparison: `study:old` first, then `old`."""
    rename = dict(rename or {})
    return lambda variant: rename.get(f"{study}:{variant}", rename.get(variant, variant))


def _latest_version(study: StudyRuns, notes: list[str]) -> list[Mapping[str, Any]]:
    """The study's rows of its latest version (a note names the versions left out)."""
    rows = list(study.rows)
    if not rows or VERSION_COLUMN not in rows[0]:
        return rows
    import pyarrow as pa

    versions = versions_of(
        pa.Table.from_pylist([{VERSION_COLUMN: r.get(VERSION_COLUMN), "start_time": r.get("start_time")} for r in rows])
    )
    if len(versions) < 2:
        return rows
    latest = versions[-1]
    kept = [r for r in rows if (r.get(VERSION_COLUMN) or versions[0]) == latest]
    older = ", ".join(short_version(v) for v in versions[:-1])
    notes.append(
        f"{study.name}: {len(versions)} versions; compared on the latest ({short_version(latest)}, "
        f"{len(kept)} cells), the older ({older}, {len(rows) - len(kept)} cells) left out (never pooled)."
    )
    return kept


def _swept(row: Mapping[str, Any]) -> dict:
    swept = json.loads(row.get("swept") or "{}")
    swept.pop(VERSION_PARAM, None)  # one version is compared (`_latest_version`)
    return swept


def _task_paths(rows: Sequence[Mapping[str, Any]], variants: Sequence[str]) -> list[str]:
    """The swept paths that every variant of the study sweeps (in some config): the task's context."""
    by_variant: dict[str, set[str]] = {v: set() for v in variants}
    order: dict[str, None] = {}
    for row in rows:
        keys = _swept(row)
        by_variant[row["variant"]].update(keys)
        order.update(dict.fromkeys(keys))
    shared = set.intersection(*by_variant.values()) if by_variant else set()
    return [p for p in order if p in shared]


def _context_key(value: Any) -> tuple:
    return (
        (0, float(value), "")
        if isinstance(value, (int, float)) and not isinstance(value, bool)
        else (1, 0.0, str(value))
    )


def task_scores(
    studies: Sequence[StudyRuns],
    metric: str | None = None,
    *,
    rename: Mapping[str, str] | None = None,
    selection: str = SELECTION,
) -> Scores:
    """The entries of the comparison of `studies` on `metric` (default: the first of
    `DEFAULT_METRICS` every study logged); rules in the module docstring."""
    names = [s.name for s in studies]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise CompareError(f"study {repeated[0]!r} is named twice; expected each study once")
    if not studies:
        raise CompareError("no study to compare; expected one or more study names")
    empty = [s.name for s in studies if not s.rows]
    if empty:
        raise CompareError(f"study {empty[0]!r} has no finished cell; expected studies with finished cells")
    logged = [{k for r in s.rows for k, v in r.items() if v is not None} for s in studies]
    if metric is None:
        metric = next((m for m in DEFAULT_METRICS if all(m in keys for keys in logged)), None)
        if metric is None:
            raise CompareError(
                f"none of {', '.join(DEFAULT_METRICS)} is logged by every study; expected --metric M, "
                f"one of: {', '.join(sorted(set.intersection(*logged) - _NOT_METRICS))}"
            )
    for study, keys in zip(studies, logged):
        if metric not in keys:
            candidates = sorted(k for k in keys if "/" in k and not k.startswith("param:"))
            raise CompareError(
                f"study {study.name!r} logged no {metric!r}; expected a metric every study logged, such as "
                f"{', '.join(candidates[:12])}"
            )
    notes: list[str] = []
    tasks: list[Task] = []
    entries: dict[tuple[int, str], Entry] = {}
    variants: dict[str, None] = {}
    for study in studies:
        name_of = _renamer(rename, study.name)
        rows = [dict(r, variant=name_of(r["variant"])) for r in _latest_version(study, notes)]
        order = [name_of(v) for v in study.variant_order]
        present = list(dict.fromkeys(r["variant"] for r in rows))
        study_variants = [v for v in order if v in present] + [v for v in present if v not in order]
        variants.update(dict.fromkeys(study_variants))
        paths = _task_paths(rows, study_variants)
        by_task: dict[tuple, list[Mapping[str, Any]]] = {}
        for row in rows:
            swept = _swept(row)
            by_task.setdefault(tuple((p, swept.get(p)) for p in paths), []).append(row)
        for context in sorted(by_task, key=lambda c: [_context_key(v) for _, v in c]):
            index = len(tasks)
            tasks.append(Task(study.name, tuple((p, v) for p, v in context if v is not None)))
            for variant in study_variants:
                members = [r for r in by_task[context] if r["variant"] == variant]
                if members:
                    entries[(index, variant)] = _entry(members, metric, selection, tasks[index], variant)
    scores = Scores(metric, tasks, list(variants), entries, notes)
    _seed_notes(scores)
    return scores


_NOT_METRICS = {"run_id", "cell_id", "config_id", "seed", "variant", "swept", "start_time", "end_time", "duration_s"}


def _entry(rows: Sequence[Mapping[str, Any]], metric: str, selection: str, task: Task, variant: str) -> Entry:
    """The variant's config on the task: the only one, else the best mean `selection` score."""
    configs: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        configs.setdefault(row["config_id"], []).append(row)
    chosen = next(iter(configs))
    if len(configs) > 1:
        means = {}
        for config_id, members in configs.items():
            found = [
                float(r[selection]) for r in members if r.get(selection) is not None and math.isfinite(r[selection])
            ]
            means[config_id] = math.fsum(found) / len(found) if found else math.nan
        usable = {c: m for c, m in means.items() if math.isfinite(m)}
        if not usable:
            raise CompareError(
                f"task {task.label!r}: variant {variant!r} has {len(configs)} configs and none logged "
                f"{selection!r} (the validation score configs are chosen on); expected runs that log it, "
                f"or one config per variant and task"
            )
        pick = min if lower_is_better(selection) else max
        best = pick(usable.values())
        chosen = next(c for c, m in usable.items() if m == best)
    members = sorted(configs[chosen], key=lambda r: r["seed"])
    kept = [
        (int(r["seed"]), float(r[metric])) for r in members if r.get(metric) is not None and math.isfinite(r[metric])
    ]
    return Entry(
        chosen,
        members[0].get("swept") or "{}",
        tuple(s for s, _ in kept),
        tuple(v for _, v in kept),
        len(configs),
    )


def _seed_notes(scores: Scores) -> None:
    """A note per task whose variants ran different seeds, and for configs chosen on validation."""
    for t, task in enumerate(scores.tasks):
        seeds = {v: scores.entries[(t, v)].seeds for v in scores.variants if (t, v) in scores.entries}
        if len({s for s in seeds.values()}) > 1:
            shared = set.intersection(*(set(s) for s in seeds.values()))
            counts = ", ".join(f"{v} {len(s)}" for v, s in seeds.items())
            scores.notes.append(
                f"{task.label}: the variants ran different seeds ({counts}); each mean is over its own "
                f"seeds, paired tests use the {len(shared)} they share."
            )
    chosen = [(t, v, e) for (t, v), e in scores.entries.items() if e.candidates > 1]
    if chosen:
        scores.notes.append(
            f"{len(chosen)} entr{'y' if len(chosen) == 1 else 'ies'} stand for the best of several configs "
            f"by mean {SELECTION} (validation), e.g. {chosen[0][1]} on {scores.tasks[chosen[0][0]].label}: "
            f"{_swept_text(chosen[0][2].swept)} of {chosen[0][2].candidates}."
        )


def _swept_text(swept: str) -> str:
    values = json.loads(swept or "{}")
    values.pop(VERSION_PARAM, None)
    return ", ".join(assignments(values)) or "base values"
