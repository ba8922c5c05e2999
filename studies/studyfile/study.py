"""The study file's schema: the :class:`Study` and its top-level blocks.

A :class:`Study` holds the fields of the file (validated by pydantic, unknown fields refused)
and, once ``studies.studyfile.spec.load_study`` has checked it, the validated config of every variant,
the ``derived`` expressions in evaluation order and the configs of its design (see
docs/interfaces.md section 6 for the format).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Discriminator, Field, PrivateAttr, Tag, field_validator, model_validator

from analysis.report_schema import (
    Reference,
    ReferenceRow,
    References,
    Report,
    ReportCompare,
    ReportCurve,
    ReportSetSizes,
    ReportTable,
)
from setvalued.paths import copy_config
from studies.readback import STUDY_NAME_MAX, STUDY_NAME_PATTERN
from studies.studyfile.design import (
    BLOCK_CLASSES,
    PRUNER_CLASSES,
    BlockBase,
    DesignBlock,
    Distribution,
    OptunaBlock,
    SingleBlock,
)
from studies.studyfile.expressions import Expression
from studies.studyfile.problems import (
    Lines,
    Path_,
    Problem,
    StudyError,
    dedupe,
    did_you_mean,
    format_yaml_path,
    line_of,
)
from studies.studyfile.schema import StrictModel, fields_of, pydantic_message

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

__all__ = [
    "DEFAULT_MAX_CELLS",
    "MAX_SEEDS",
    "SeedRacing",
    "RaceUntil",
    "MAX_FAILURES",
    "DEFAULT_CHECKPOINT_INTERVAL_S",
    "Study",
    "Resources",
    "Objective",
    "NoScheduler",
    "EarlyStopping",
    "Asha",
    "Scheduler",
    "Report",
    "ReportTable",
    "ReportCurve",
    "ReportCompare",
    "ReportSetSizes",
    "Reference",
    "ReferenceRow",
    "DEFAULT_VARIANT",
    "NAME_PATTERN",
    "schema_problem",
]

#: variant name of the cells of a study without a ``variants`` block
DEFAULT_VARIANT = "base"
#: a variant name
NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"
#: most cells a study may have unless its file (``max_cells``) or the command (``--max-cells``)
#: allows more: the design is counted before anything is built
DEFAULT_MAX_CELLS = 100_000
#: most seeds a study may list
MAX_SEEDS = 10_000
#: the smallest amount of a resource Ray schedules
RESOURCE_STEP = 0.0001
#: most failed attempts of a cell retried (``max_failures``)
MAX_FAILURES = 10
#: default ``checkpoint_interval_s``: a worker that dies loses at most about a minute of work,
#: and a cell of short epochs is not slowed by a checkpoint and a tracking request per epoch
DEFAULT_CHECKPOINT_INTERVAL_S = 60.0


def _ray_granularity(value: float | None) -> float | None:
    """Ray counts resources in steps of 1/10,000: a smaller positive amount is an error deep
    inside Ray, so it is refused here."""
    if value is not None and 0 < value < RESOURCE_STEP:
        raise ValueError(f"expected 0 or at least {RESOURCE_STEP} (Ray's smallest fraction of a resource), got {value}")
    return value


def _whole_above_one(value: float | None) -> float | None:
    if value is not None and value > 1 and not float(value).is_integer():
        raise ValueError(f"expected a fraction of one GPU (0 < gpus <= 1) or a whole number, got {value}")
    return value


class ArrayResources(StrictModel):
    """What one fused array takes (``resources.per_array``), instead of the trials it replaces."""

    cpus: float | None = Field(None, gt=0)
    gpus: float | None = Field(None, ge=0)

    _granularity = field_validator("cpus", "gpus")(_ray_granularity)
    _whole = field_validator("gpus")(_whole_above_one)


class Resources(StrictModel):
    """Per-trial resources for ``tune.with_resources``; fractions share a device. A fused array
    (``seeds_per_trial`` > 1) takes those of the trials it replaces, up to what a node has, or
    ``per_array`` (`studies.cells.arrays.trial_resources`)."""

    cpus: float = Field(1.0, gt=0)
    gpus: float = Field(0.0, ge=0)
    #: seeds of one config trained as one fused array in one trial (``setvalued.fused``;
    #: docs/throughput.md)
    seeds_per_trial: int = Field(1, ge=1, le=64)
    #: what one fused array takes (default: its members' cpus and gpus, up to a node's CPUs and one GPU)
    per_array: ArrayResources | None = None

    _granularity = field_validator("cpus", "gpus")(_ray_granularity)
    _whole = field_validator("gpus")(_whole_above_one)

    @model_validator(mode="after")
    def _per_array_needs_arrays(self) -> Resources:
        if self.per_array is not None and self.seeds_per_trial < 2:
            raise ValueError(
                "per_array applies to fused arrays only; expected seeds_per_trial of 2 or more, or no per_array"
            )
        return self


class Objective(StrictModel):
    metric: str
    mode: Literal["max", "min"] = "max"


class NoScheduler(StrictModel):
    kind: Literal["none"]


class EarlyStopping(StrictModel):
    """Stop a config (all its seeds together) whose seed-mean metric stopped improving."""

    kind: Literal["early_stopping"]
    metric: str | None = None  # default: the objective's metric
    mode: Literal["max", "min"] | None = None
    grace_epochs: int = Field(5, ge=0)
    patience: int = Field(3, ge=1)


class Asha(StrictModel):
    """Asynchronous successive halving of configs (all seeds of a config advance or stop
    together, on their mean): rungs at grace_epochs * reduction_factor^i epochs; at a rung a
    config goes on when its seed mean is in the top 1/reduction_factor of the configs that
    reached it so far (`studies.scheduling.successive_halving`)."""

    kind: Literal["asha"]
    metric: str | None = None  # default: the objective's metric
    mode: Literal["max", "min"] | None = None
    grace_epochs: int = Field(1, ge=1)
    reduction_factor: int = Field(3, ge=2)


Scheduler = Annotated[NoScheduler | EarlyStopping | Asha, Field(discriminator="kind")]
#: the model of each scheduler kind (for the list of accepted fields in errors)
SCHEDULER_CLASSES = {"none": NoScheduler, "early_stopping": EarlyStopping, "asha": Asha}


class RaceUntil(StrictModel):
    """What decides a race: the metric (default: the objective's), which way is better, and
    the confidence level of the paired intervals (0.95: Holm-adjusted p < 0.05 stops)."""

    metric: str | None = None
    mode: Literal["max", "min"] | None = None
    level: float = Field(0.95, gt=0.5, lt=1.0)


class SeedRacing(StrictModel):
    """``seeds: {initial, max, until}``: adaptive seed allocation (studies.scheduling.racing.SeedRace).

    Every config starts with the first ``initial`` seeds of ``sequence`` (default 0, 1, ...,
    max - 1; the same for every config, so comparisons stay paired) and gets ``step`` more
    seeds per round while it is undecided against the best, up to ``max``."""

    initial: int = Field(3, ge=2)
    max: int = Field(ge=2, le=MAX_SEEDS)
    step: int = Field(1, ge=1)
    sequence: list[Annotated[int, Field(ge=0, lt=2**32)]] | None = None
    until: RaceUntil = Field(default_factory=RaceUntil)

    @field_validator("sequence", mode="before")
    @classmethod
    def _ints(cls, value: Any) -> Any:
        return _seed_list(value)

    @model_validator(mode="after")
    def _consistent(self) -> SeedRacing:
        if self.initial > self.max:
            raise ValueError(f"initial ({self.initial}) must be at most max ({self.max})")
        if self.sequence is not None:
            if len(self.sequence) != self.max:
                raise ValueError(f"sequence has {len(self.sequence)} seeds; expected max = {self.max}")
            dupes = sorted(seed for seed, n in Counter(self.sequence).items() if n > 1)
            if dupes:
                raise ValueError(f"each seed may appear once in sequence; repeated: {dupes}")
        return self

    @property
    def seed_list(self) -> list[int]:
        return list(self.sequence) if self.sequence is not None else list(range(self.max))


SEED_LIST_TAG, SEED_RACING_TAG = "seed list", "racing"


def _seeds_kind(value: Any) -> str:
    """Which form of ``seeds`` a value is: a mapping races, anything else is a list."""
    return SEED_RACING_TAG if isinstance(value, (dict, SeedRacing)) else SEED_LIST_TAG


def _seed_list(value: Any) -> Any:
    if isinstance(value, list):
        for i, seed in enumerate(value):
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise ValueError(f"seeds must be integers, got {seed!r} at position {i}")
    return value


def _one_single_block() -> list[DesignBlock]:
    """The default design: the variants as they are."""
    return [SingleBlock(kind="single")]


class Study(StrictModel):
    """A validated study file. Built by :func:`load_study`; see docs/interfaces.md section 6.

    Besides the fields of the file it keeps ``path``, ``source_text`` (the YAML as written,
    stored by the runner as an artifact) and the validated config of every variant.
    """

    # names the output folder too: must start with a letter or digit (no "." or "..")
    name: str = Field(pattern=STUDY_NAME_PATTERN, max_length=STUDY_NAME_MAX)
    description: str = ""
    base: dict[str, Any]
    variants: dict[Annotated[str, Field(pattern=NAME_PATTERN)], dict[str, Any] | None] = {}
    design: list[DesignBlock] = Field(default_factory=lambda: _one_single_block(), min_length=1)
    derived: dict[str, Any] = {}
    # a list: every config runs on every seed; a mapping: racing (SeedRacing)
    seeds: Annotated[
        Annotated[list[Annotated[int, Field(ge=0, lt=2**32)]], Tag(SEED_LIST_TAG)]
        | Annotated[SeedRacing, Tag(SEED_RACING_TAG)],
        Discriminator(_seeds_kind),
    ]
    resources: Resources = Field(default_factory=Resources)
    max_concurrent: int | None = Field(None, ge=1)
    max_failures: int = Field(1, ge=0, le=MAX_FAILURES)
    max_cells: int | None = Field(None, ge=1)  # raises DEFAULT_MAX_CELLS for this study
    log_models: bool = True  # each cell's selected model as an MLflow model (off for huge studies)
    # at most one checkpoint (and one MLflow write of the epochs since the last) per this many
    # seconds of a cell's training, always after its last epoch; 0: after every epoch
    checkpoint_interval_s: float = Field(DEFAULT_CHECKPOINT_INTERVAL_S, ge=0, le=86_400)
    objective: Objective | None = None
    scheduler: Scheduler = Field(default_factory=lambda: NoScheduler(kind="none"))
    report: Report = Field(default_factory=Report)
    reference: References | None = None  # its sources (one mapping in the file is one source)

    _path: str = PrivateAttr("<string>")
    _source_text: str = PrivateAttr("")
    _variant_configs: dict[str, dict[str, Any]] = PrivateAttr(default_factory=dict)
    _variant_raw: dict[str, dict[str, Any]] = PrivateAttr(default_factory=dict)
    _derived_order: list[tuple[str, Expression]] = PrivateAttr(default_factory=list)
    _design_is_list: bool = PrivateAttr(True)
    _lines: Lines = PrivateAttr(default_factory=dict)
    _designed: list[Any] | None = PrivateAttr(None)  # configs of the design, set by load_study

    @field_validator("seeds", mode="before")
    @classmethod
    def _seeds_are_ints(cls, value: Any) -> Any:
        return _seed_list(value)

    @field_validator("seeds")
    @classmethod
    def _unique_seeds(cls, seeds: Any) -> Any:
        if isinstance(seeds, SeedRacing):
            return seeds
        if not seeds:
            raise ValueError("expected at least 1 item (a seed), got none")
        if len(seeds) > MAX_SEEDS:
            raise ValueError(f"expected at most {MAX_SEEDS} items (seeds), got {len(seeds)}")
        dupes = sorted(seed for seed, n in Counter(seeds).items() if n > 1)
        if dupes:
            raise ValueError(f"each seed may appear once; repeated: {dupes}")
        return seeds

    @field_validator("variants", mode="before")
    @classmethod
    def _no_null_variants(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("derived", mode="before")
    @classmethod
    def _no_null_derived(cls, value: Any) -> Any:
        return {} if value is None else value

    # ----- accessors used by studies.cells.space and the runner --------------------------------

    @property
    def seed_list(self) -> list[int]:
        """Every seed a config may run on: the list, or the racing sequence up to ``max``."""
        return self.seeds.seed_list if isinstance(self.seeds, SeedRacing) else list(self.seeds)

    @property
    def racing(self) -> SeedRacing | None:
        """The racing block (``seeds: {initial, max, until}``), None for a seed list."""
        return self.seeds if isinstance(self.seeds, SeedRacing) else None

    @property
    def seeds_at_once(self) -> int:
        """Seeds of a config that run together: all of a list, the initial round of a race."""
        return self.seeds.initial if isinstance(self.seeds, SeedRacing) else len(self.seeds)

    @property
    def path(self) -> str:
        """The study file as given to load_study."""
        return self._path

    @property
    def source_text(self) -> str:
        """The raw YAML text of the study file."""
        return self._source_text

    def has_variant(self, name: str) -> bool:
        """Whether ``name`` is a variant of the study (``base`` when it has none)."""
        return name in self._variant_configs

    def variant_value(self, name: str, dotted: str, default: Any = None) -> Any:
        """A value of a variant's validated config by dotted path (no copy of the config)."""
        node: Any = self._variant_configs[name]
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    @property
    def variant_names(self) -> list[str]:
        """The variants in file order; ``["base"]`` when the file has no variants."""
        return list(self._variant_configs)

    def variant_config(self, name: str) -> dict[str, Any]:
        """The validated, default-filled config of a variant (a copy)."""
        return copy_config(self._variant_configs[name])

    def variant_raw_config(self, name: str) -> dict[str, Any]:
        """``base`` deep-merged with the variant's overlay, as written (no defaults filled in)."""
        return copy_config(self._variant_raw[name])

    def block_variants(self, block: BlockBase) -> list[str]:
        """The variants a design block applies to (its filter, or every variant)."""
        return list(block.variants) if block.variants else self.variant_names

    @property
    def derived_expressions(self) -> list[tuple[str, Expression]]:
        """(target path, parsed expression) in evaluation order (dependencies first)."""
        return list(self._derived_order)

    @property
    def optuna_blocks(self) -> list[tuple[int, OptunaBlock]]:
        """(index in design, block) of every optuna block; ``expand`` gives no cells for them."""
        return [(i, b) for i, b in enumerate(self.design) if isinstance(b, OptunaBlock)]

    def yaml_path(self, path: Path_) -> str:
        """Render an internal path (design always a list) as the file's YAML path."""
        return format_yaml_path(self._file_path(path))

    def _file_path(self, path: Path_) -> Path_:
        if not self._design_is_list and len(path) >= 2 and path[0] == "design" and path[1] == 0:
            return ("design",) + tuple(path[2:])
        return tuple(path)

    def line_of(self, path: Path_) -> int | str | None:
        """The line of the file where ``path`` (or its longest prefix in the file) is written, or
        the command-line override that set it."""
        return line_of(self._lines, self._file_path(path))

    def error(self, problems: list[Problem]) -> StudyError:
        """A StudyError for problems found after loading (e.g. by optuna_block_suggest)."""
        return StudyError(
            self._path, [(self.yaml_path(p.path), self.line_of(p.path), p.message) for p in dedupe(problems)]
        )

    def planned_cells(self) -> tuple[int, int]:
        """(configs, cells) of the design as written, counted from the sizes of its blocks
        without building anything: an upper bound (identical configs are merged later).
        Optuna blocks count their ``n_configs`` proposals."""
        n_variants = max(1, len(self.variants))
        configs = sum(
            block.configs_per_variant() * (len(block.variants) if block.variants else n_variants)
            for block in self.design
        )
        return configs, configs * len(self.seed_list)

    @property
    def designed_configs(self) -> list[Any]:
        """The configs of the design (``studies.studyfile.configs.DesignedConfig``), built once by load_study."""
        return list(self._designed or ())

    @property
    def validated(self) -> bool:
        """Whether every check of load_study has passed (variants, design, derived)."""
        return self._designed is not None

    # ----- set by the checks of studies.studyfile.spec.load_study ------------------------------------

    def set_source(self, file: str, text: str, lines: Lines, design_is_list: bool) -> None:
        """The file it was read from, its text, the line of every YAML path, and whether
        ``design`` was written as one block instead of a list."""
        self._path, self._source_text, self._lines, self._design_is_list = file, text, lines, design_is_list

    def set_variants(self, raw: dict[str, dict[str, Any]], validated: dict[str, dict[str, Any]]) -> None:
        """The variants' configs: as written (base + overlay) and validated with defaults."""
        self._variant_raw, self._variant_configs = raw, validated

    def set_derived_order(self, order: list[tuple[str, Expression]]) -> None:
        """The derived expressions, dependencies first."""
        self._derived_order = order

    def set_designed_configs(self, configs: list[Any]) -> None:
        """The configs of the design, built and checked."""
        self._designed = configs


#: the model validated at each path of the file (for the list of accepted fields)
_MODEL_AT = {
    (): Study,
    ("resources",): Resources,
    ("objective",): Objective,
    ("report",): Report,
    ("report", "tables", 0): ReportTable,
    ("report", "curves", 0): ReportCurve,
    ("report", "compare"): ReportCompare,
    ("reference", 0): Reference,
    ("reference", 0, "rows", 0): ReferenceRow,
}


def _strip_union_tags(loc: Path_, raw: Any) -> Path_:
    """Drop the union tags pydantic inserts in error locations (``design.0.grid.parameters``)
    and the ``[key]`` marker of dictionary-key errors."""
    out: list[Any] = []
    node = raw
    for part in loc:
        if part == "[key]" or (loc[:1] == ("seeds",) and part in (SEED_LIST_TAG, SEED_RACING_TAG)):
            continue
        if isinstance(node, dict) and part not in node and node.get("kind") == part:
            continue  # discriminated-union tag
        out.append(part)
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            node = None
    return tuple(out)


def _union_kinds(loc: Path_) -> list[str]:
    """The kinds accepted by the tagged union at `loc` (a design block, an optuna block's
    pruner, the scheduler)."""
    if loc[:1] == ("design",):
        return list(PRUNER_CLASSES if loc[-1:] == ("pruner",) else BLOCK_CLASSES)
    return list(SCHEDULER_CLASSES)


def schema_problem(e: ErrorDetails, raw: dict[str, Any]) -> Problem:
    """A pydantic error of the Study schema as a Problem at the YAML path of the file."""
    loc = _strip_union_tags(tuple(e["loc"]), raw)
    message = pydantic_message(e)
    kind = e["type"]
    if kind == "union_tag_not_found":
        return Problem(loc + ("kind",), "missing field 'kind'; expected one of: " + ", ".join(_union_kinds(loc)))
    if kind == "union_tag_invalid":
        expected = e["ctx"]["expected_tags"].replace("'", "")
        return Problem(loc + ("kind",), f"unknown kind {e['ctx']['tag']!r}; expected one of: {expected}")
    if kind == "extra_forbidden":
        parent = loc[:-1]
        model: Any = None
        if parent[:1] == ("design",) and len(parent) == 2:
            block = raw.get("design", [])[parent[1]] if isinstance(raw.get("design"), list) else None
            model = BLOCK_CLASSES.get(str(block.get("kind"))) if isinstance(block, dict) else None
        elif parent[:1] == ("design",) and len(parent) == 4 and parent[2] == "parameters":
            model = Distribution
        elif parent == ("scheduler",):
            sched = raw.get("scheduler")
            model = SCHEDULER_CLASSES.get(str(sched.get("kind")) if isinstance(sched, dict) else "", NoScheduler)
        elif parent[:1] == ("design",) and len(parent) == 3 and parent[2] == "pruner":
            block = raw.get("design", [])[parent[1]] if isinstance(raw.get("design"), list) else None
            pruner = block.get("pruner") if isinstance(block, dict) else None
            model = PRUNER_CLASSES.get(str(pruner.get("kind"))) if isinstance(pruner, dict) else None
        else:
            normal = tuple(0 if isinstance(p, int) else p for p in parent)
            model = _MODEL_AT.get(normal)
        fields = fields_of(model) if model else None
        hint = did_you_mean(str(loc[-1]), fields.split(", ")) if fields else ""
        message = f"unknown field '{loc[-1]}'" + hint + (f"; expected one of: {fields}" if fields else "")
    elif kind == "missing":
        message = f"missing required field '{loc[-1]}'"
    return Problem(loc, message)
