"""Study files: parse, validate, and report every mistake before any trial starts.

``load_study(path)`` reads a YAML study file (format in docs/interfaces.md, section 6) and
returns a :class:`Study`. Every problem is raised as one :class:`StudyError` whose message is
a single paragraph naming the file, the YAML path of the field (``design[0].parameters.
loss.epsilon``), its line, and what was expected. Validation happens in stages, each stopping
on its first failing stage so that one mistake does not cascade into many messages:

1. YAML syntax and duplicate keys (the composed node tree gives the lines);
2. the study's own schema (pydantic models, unknown fields forbidden);
3. the trial config of every variant (``base`` deep-merged with the variant's overlay),
   checked against the trial-config schema (docs/interfaces.md, section 1) and the loss
   registry (``setvalued.losses``); the names used by the design, ``derived`` and the
   report are cross-checked;
4. every config the design produces (after the design values and ``derived``), so that a
   bad dotted path or a value out of range is reported with the design entry it came from.

Configs are normalised: the defaults of section 1 and the loss's own parameter defaults are
filled in, so that a config written with or without a default value is the same config
(same ``config_id``) and MLflow shows every parameter that was used.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Optional, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from studies.expressions import Expression, ExpressionError, parse_expression
from analysis.layout import flatten_config  # noqa: F401  (re-exported: studies.space uses it)

__all__ = [
    "StudyError",
    "Problem",
    "Study",
    "load_study",
    "parse_study",
    "validate_config",
    "deep_merge",
    "get_path",
    "set_path",
    "flatten_config",
    "DesignBlock",
    "GridBlock",
    "SensitivityBlock",
    "RandomBlock",
    "OptunaBlock",
    "SingleBlock",
    "Distribution",
    "DEFAULT_VARIANT",
]

#: variant name of the cells of a study without a ``variants`` block
DEFAULT_VARIANT = "base"
#: at most this many problems are spelled out in one StudyError
MAX_PROBLEMS_SHOWN = 8

NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"

# Number of classes of the real data sets (training split), used to check K < L.
KNOWN_NUM_CLASSES = {"cifar100": 100, "plantnet300k": 1081, "imagenet_lt": 1000}
BUILTIN_MODELS = ("mlp", "small_cnn", "densenet_bc_cifar")

Path_ = tuple[Union[str, int], ...]


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One mistake: where (YAML path as a tuple of keys and indices) and what was expected."""

    path: Path_
    message: str


def format_yaml_path(path: Iterable[Union[str, int]]) -> str:
    """``("design", 0, "parameters", "loss.epsilon")`` -> ``design[0].parameters.loss.epsilon``."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + str(part)
    return text or "(top level)"


class StudyError(ValueError):
    """A study file that cannot be run. ``str(err)`` is one paragraph for the user.

    Attributes: ``file`` (the path as given), ``problems`` (list of
    ``(yaml_path, line or None, message)``).
    """

    def __init__(self, file: str, problems: list[tuple[str, Optional[int], str]]):
        self.file = file
        self.problems = problems
        super().__init__(self._paragraph())

    def _paragraph(self) -> str:
        parts = []
        for path, line, message in self.problems[:MAX_PROBLEMS_SHOWN]:
            where = path if line is None else f"{path} (line {line})"
            parts.append(f"{where}: {message}")
        if len(self.problems) == 1:
            body = parts[0]
        else:
            body = "; ".join(f"({i}) {p}" for i, p in enumerate(parts, 1))
            if len(self.problems) > MAX_PROBLEMS_SHOWN:
                body += f"; and {len(self.problems) - MAX_PROBLEMS_SHOWN} more"
        count = "" if len(self.problems) == 1 else f" ({len(self.problems)} problems)"
        body = body.rstrip(" .")
        text = f"Invalid study file '{self.file}'{count}: {body}. No trial was started."
        return re.sub(r"\s*\n\s*", " ", text)


class _Problems(Exception):
    """Internal: a batch of problems with YAML paths, turned into a StudyError by load_study."""

    def __init__(self, problems: list[Problem]):
        super().__init__(problems)
        self.problems = problems


# --------------------------------------------------------------------------------------
# YAML with line numbers
# --------------------------------------------------------------------------------------


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


def _read_yaml(text: str) -> tuple[Any, dict[Path_, int]]:
    """Parse the text; return (data, {yaml path: line}). Raises _Problems on syntax errors."""
    try:
        root = yaml.compose(text, Loader=_Loader)
        data = yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        what = " ".join(str(x) for x in (err.context, err.problem) if x)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise _Problems([Problem(("YAML syntax",), f"{what} at {where}; expected valid YAML "
                                                   "(check the indentation and the quoting)")]) from None
    except yaml.YAMLError as err:
        raise _Problems([Problem(("YAML syntax",), f"{err}")]) from None
    lines: dict[Path_, int] = {}
    problems: list[Problem] = []
    if root is not None:
        lines[()] = root.start_mark.line + 1
        _index_nodes(root, (), lines, problems)
    if problems:
        raise _Problems(problems)
    return data, lines


# --------------------------------------------------------------------------------------
# Config helpers (dotted paths, deep merge, canonical form)
# --------------------------------------------------------------------------------------

#: sections whose content is replaced, not merged, when an overlay changes their ``name``
#: (the parameters of one loss or one data set do not apply to another)
_REPLACE_ON_NAME_CHANGE = ("loss", "data")


def deep_merge(base: dict, overlay: dict) -> dict:
    """Copy of ``base`` with ``overlay`` merged in: mappings recursively, anything else replaced.

    At the top level, a ``loss`` or ``data`` overlay that changes ``name`` replaces the whole
    section (a ``ce`` variant of a ``noised_topk`` base keeps none of its parameters).
    """
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        old = merged.get(key)
        if (key in _REPLACE_ON_NAME_CHANGE and isinstance(old, dict) and isinstance(value, dict)
                and "name" in value and value.get("name") != old.get("name")):
            merged[key] = copy.deepcopy(value)
        else:
            merged[key] = _merge_values(old, value)
    return merged


def _merge_values(old: Any, new: Any) -> Any:
    if isinstance(old, dict) and isinstance(new, dict):
        out = copy.deepcopy(old)
        for key, value in new.items():
            out[key] = _merge_values(out.get(key), value)
        return out
    return copy.deepcopy(new)


def split_path(dotted: str) -> tuple[str, ...]:
    return tuple(dotted.split("."))


_MISSING = object()


def get_path(config: dict, dotted: str, default: Any = _MISSING) -> Any:
    """Value at a dotted path; KeyError (or ``default``) when a part is missing."""
    node: Any = config
    for part in split_path(dotted):
        if not isinstance(node, dict) or part not in node:
            if default is _MISSING:
                raise KeyError(dotted)
            return default
        node = node[part]
    return node


def set_path(config: dict, dotted: str, value: Any) -> None:
    """Set a dotted path in place, creating the missing mappings on the way.

    ValueError when a part on the way holds a value that is not a mapping.
    """
    parts = split_path(dotted)
    node = config
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            prefix = ".".join(parts[: i + 1])
            raise ValueError(f"'{prefix}' holds {child!r}, not a mapping, so '{dotted}' cannot be set")
        node = child
    node[parts[-1]] = copy.deepcopy(value)


def round_float(x: float) -> float:
    """12 significant digits: 0.1 * 3 (0.30000000000000004) and 0.3 are the same value."""
    return float(f"{x:.12g}") if math.isfinite(x) else x


# --------------------------------------------------------------------------------------
# Trial config schema (docs/interfaces.md, section 1)
# --------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_default=True)


class _DataCommon(_Strict):
    name: str
    root: Optional[str] = None  # folder of a real data set (official layout)
    num_workers: int = Field(0, ge=0)


class SyntheticData(_DataCommon):
    num_classes: int = Field(40, ge=2)
    num_superclasses: int = Field(8, ge=1)
    train_size: int = Field(2000, ge=1)
    val_size: int = Field(500, ge=1)
    test_size: int = Field(1000, ge=1)
    pareto_shape: float = Field(1.2, gt=0)
    form: Literal["features", "images"] = "features"
    feature_dim: int = Field(32, ge=1)
    split_seed: int = Field(1234, ge=0)  # seeds the generated data, independent of the trial seed

    @model_validator(mode="after")
    def _superclasses(self) -> "SyntheticData":
        if self.num_superclasses > self.num_classes:
            raise ValueError(f"num_superclasses ({self.num_superclasses}) must not exceed "
                             f"num_classes ({self.num_classes})")
        return self


class Cifar100Data(_DataCommon):
    download: bool = False
    val_size: int = Field(5000, ge=1, le=49999)
    label_noise: float = Field(0.0, ge=0.0, le=1.0)
    noise_groups: Literal["consecutive", "coarse"] = "consecutive"
    split_seed: int = Field(1234, ge=0)
    stratified_split: bool = False


class PlantNetData(_DataCommon):
    pass


class ImageNetLTData(_DataCommon):
    pass


DATA_SCHEMAS: dict[str, type[_DataCommon]] = {
    "synthetic": SyntheticData,
    "cifar100": Cifar100Data,
    "plantnet300k": PlantNetData,
    "imagenet_lt": ImageNetLTData,
}


class ModelSection(_Strict):
    name: str = "mlp"
    pretrained: Any = False  # false | path to a local weights file
    head: Literal["auto", "linear", "normed", "two_head"] = "auto"
    hidden_dim: int = Field(128, ge=1)
    depth: int = Field(40, ge=4)  # densenet_bc_cifar only (6n + 4)
    growth_rate: int = Field(40, ge=1)  # densenet_bc_cifar only

    @field_validator("pretrained")
    @classmethod
    def _pretrained(cls, value: Any) -> Any:
        if value is None or value is False:
            return False
        if isinstance(value, str) and value.strip():
            return value
        raise ValueError(f"expected false or the path of a local weights file, got {value!r}")

    @model_validator(mode="after")
    def _densenet_shape(self) -> "ModelSection":
        if self.name == "densenet_bc_cifar":
            if (self.depth - 4) % 6:
                raise ValueError(f"model.depth of densenet_bc_cifar must be 6n + 4 (40, 100, ...), "
                                 f"got {self.depth}")
        elif (self.depth, self.growth_rate) != (40, 40):
            raise ValueError(f"model.depth and model.growth_rate apply to densenet_bc_cifar only, "
                             f"not {self.name!r}")
        return self


class OptimSection(_Strict):
    lr: float = Field(0.1, gt=0)
    momentum: float = Field(0.9, ge=0)
    nesterov: bool = True
    weight_decay: float = Field(1e-4, ge=0)
    batch_size: int = Field(64, ge=1)
    milestones: list[Annotated[int, Field(ge=0)]] = [150, 225]
    gamma: float = Field(0.1, gt=0)


class EvalSection(_Strict):
    ks: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 3, 5, 10], min_length=1)
    avgk: list[Annotated[int, Field(ge=1)]] = []
    avgk_activation: Literal["softmax", "sigmoid"] = "softmax"
    shot_thresholds: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [20, 100],
                                                              min_length=2, max_length=2)
    selection: str = "val/top5"
    selection_mode: Literal["max", "min"] = "max"

    @field_validator("shot_thresholds")
    @classmethod
    def _increasing(cls, value: list[int]) -> list[int]:
        if value[0] > value[1]:
            raise ValueError(f"expected [few_limit, many_limit] with few_limit <= many_limit, got {value}")
        return value


class _TrialTop(_Strict):
    data: dict[str, Any] = Field(default_factory=lambda: {"name": "synthetic"})
    model: ModelSection = Field(default_factory=ModelSection)
    loss: dict[str, Any]
    optim: OptimSection = Field(default_factory=OptimSection)
    epochs: int = Field(300, ge=1)
    eval: EvalSection = Field(default_factory=EvalSection)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    amp: bool = True  # mixed precision on CUDA (the loss stays in float32)


_METRIC_RE = re.compile(r"^(?P<split>val|test|train)/(?:(?P<group>few|medium|many)/)?"
                        r"(?P<macro>macro_)?(?P<kind>top|avg)(?P<k>[0-9]+)$")
METRIC_FORMAT = ("a metric path such as val/top5, val/macro_top5, val/few/top5 or val/avg5 "
                 "(split/[few|medium|many/][macro_]top<K>|avg<K>)")


#: Per-epoch metrics of the trainer besides the val/ and train/ accuracies (docs/interfaces.md
#: section 4).
PER_EPOCH_EXTRA_METRICS = ("train/loss", "lr", "epoch_time_s", "eval_time_s", "grad_nonzero",
                           "grad_nonzero_active")


def check_metric(metric: str, eval_section: dict, splits: tuple[str, ...] = ("val",)) -> Optional[str]:
    """None when ``metric`` is a metric the trainer reports for this eval section, else why not."""
    if not isinstance(metric, str):
        return f"expected {METRIC_FORMAT}, got {metric!r}"
    if splits == ("val", "test", "train") and metric == "train/loss":
        return None
    match = _METRIC_RE.match(metric)
    if not match:
        return f"expected {METRIC_FORMAT}, got {metric!r}"
    if match["split"] not in splits:
        return f"expected a {' or '.join(s + '/' for s in splits)} metric, got {metric!r}"
    if match["split"] == "train" and (match["group"] or match["macro"] or match["kind"] != "top"):
        return f"training metrics are the running top-K accuracy only (train/top<K>), got {metric!r}"
    if match["group"] and match["macro"]:
        return f"shot-group metrics are already macro averages: write {match['split']}/{match['group']}/" \
               f"{match['kind']}{match['k']}, not {metric!r}"
    k = int(match["k"])
    if match["kind"] == "top" and k not in eval_section.get("ks", []):
        return f"{metric!r} needs K={k} in eval.ks (now {eval_section.get('ks')})"
    if match["kind"] == "avg" and k not in eval_section.get("avgk", []):
        return f"{metric!r} needs K={k} in eval.avgk (now {eval_section.get('avgk')})"
    return None


def _pydantic_problems(err: ValidationError, prefix: Path_ = ()) -> list[Problem]:
    out = []
    for e in err.errors():
        out.append(Problem(prefix + tuple(e["loc"]), _pydantic_message(e)))
    return out


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _pydantic_message(e: dict) -> str:
    kind = e["type"]
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "missing required field"
    if kind == "too_short" and "ctx" in e:
        n = e["ctx"].get("min_length", 1)
        return f"expected at least {n} item{'s' if n != 1 else ''}, got {_short_repr(e.get('input'))}"
    if kind == "string_pattern_mismatch":
        return (f"expected letters, digits, '_', '.' or '-' only (starting with a letter or digit), "
                f"got {_short_repr(e.get('input'))}")
    msg = e["msg"]
    if msg.startswith("Value error, "):
        return msg[len("Value error, "):]
    if msg.startswith("Assertion failed, "):
        return msg[len("Assertion failed, "):]
    if msg.startswith("Input should be "):
        msg = "expected " + msg[len("Input should be "):]
    if "input" in e and kind not in ("union_tag_not_found", "union_tag_invalid"):
        msg += f", got {_short_repr(e['input'])}"
    return msg


# ----- losses ------------------------------------------------------------------------------


def _loss_registry():
    """The loss registry (imported lazily: it imports torch)."""
    import setvalued.losses as losses  # noqa: WPS433  (registers every loss)

    return losses


@functools.lru_cache(maxsize=None)
def _accepted_parameters(name: str) -> tuple[str, ...]:
    """The parameters a study file may set for a registered loss (no context keys, no reduction)."""
    return tuple(p for p in _loss_registry().loss_parameters(name) if p != "reduction")


@functools.lru_cache(maxsize=None)
def _type_of_param(cls: type, name: str) -> tuple[Optional[type], bool, Any]:
    """(expected scalar type or None if unknown, None allowed, default or inspect.Parameter.empty)."""
    param = inspect.signature(cls.__init__).parameters[name]
    default = param.default
    expected: Optional[type] = None
    optional = default is None
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # unresolvable annotations: fall back on the default's type
        hints = {}
    hint = hints.get(name)
    if hint is not None:
        args = typing.get_args(hint)
        origin = typing.get_origin(hint)
        if origin is Union or str(origin) == "types.UnionType":
            optional = optional or type(None) in args
            scalars = [a for a in args if a in (int, float, bool, str)]
            if len(scalars) == 1:
                expected = scalars[0]
            elif set(scalars) == {int, float}:
                expected = float
        elif hint in (int, float, bool, str):
            expected = hint
    if expected is None and default is not inspect.Parameter.empty and default is not None:
        if type(default) in (int, float, bool, str):
            expected = type(default)
    return expected, optional, default


def _coerce(value: Any, expected: Optional[type], optional: bool) -> tuple[Any, Optional[str]]:
    """Coerce a YAML value to the parameter's type: (value, None) or (value, reason)."""
    if value is None:
        return (None, None) if optional or expected is None else (value, f"expected {expected.__name__}, got null")
    if expected is None:
        return value, None
    if expected is bool:
        return (value, None) if isinstance(value, bool) else (value, f"expected true or false, got {value!r}")
    if expected is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value, f"expected an integer, got {value!r}"
        if isinstance(value, float):
            if not value.is_integer():
                return value, f"expected an integer, got {value!r}"
            value = int(value)
        return value, None
    if expected is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value, f"expected a number, got {value!r}"
        value = float(value)
        if not math.isfinite(value):
            return value, f"expected a finite number, got {value!r}"
        return value, None
    if expected is str:
        return (value, None) if isinstance(value, str) else (value, f"expected a string, got {value!r}")
    return value, None


def _jsonable_default(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_jsonable_default(v) for v in value)
    return False


_LOSS_BUILD_CACHE: dict[str, Optional[str]] = {}


def _try_build_loss(name: str, params: dict, num_classes: Optional[int]) -> Optional[str]:
    """Build the loss once with a small stand-in context, to catch out-of-range values early.

    The registry's contract (docs/interfaces.md section 2) is that an out-of-range value
    raises ValueError naming the parameter. The context is a stand-in (uniform class counts,
    a few examples): only ValueError is taken as a verdict on the parameters.
    """
    import json

    key = json.dumps([name, params, num_classes], sort_keys=True, default=str)
    if key in _LOSS_BUILD_CACHE:
        return _LOSS_BUILD_CACHE[key]
    losses = _loss_registry()
    classes = num_classes or 10
    reason: Optional[str] = None
    try:
        own = {k: v for k, v in params.items() if k != "name"}
        losses.build_loss(name, **own, class_counts=[10] * classes, num_classes=classes,
                          num_examples=10 * classes)
    except ValueError as err:
        reason = str(err).replace("\n", " ")
    _LOSS_BUILD_CACHE[key] = reason
    return reason


def _validate_loss(raw: Any, num_classes: Optional[int], problems: list[Problem]) -> Optional[dict]:
    if not isinstance(raw, dict):
        problems.append(Problem(("loss",), f"expected a mapping with the loss name and its parameters, got {_short_repr(raw)}"))
        return None
    losses = _loss_registry()
    name = raw.get("name")
    if name is None:
        problems.append(Problem(("loss", "name"), "missing required field: the loss name; expected one of: "
                                + (", ".join(sorted(losses.LOSSES)) or "(the registry is empty)")))
        return None
    if not isinstance(name, str) or name not in losses.LOSSES:
        problems.append(Problem(("loss", "name"), f"unknown loss {name!r}; expected one of: "
                                + (", ".join(sorted(losses.LOSSES)) or "(the registry is empty)")))
        return None
    cls = losses.LOSSES[name]
    accepted = list(_accepted_parameters(name))
    out: dict[str, Any] = {"name": name}
    bad = False
    for key, value in raw.items():
        if key == "name":
            continue
        if key in losses.base.CONTEXT_KEYS or key == "reduction":
            problems.append(Problem(("loss", key), f"'{key}' is set by the trainer, not by the study file"))
            bad = True
            continue
        if key not in accepted:
            problems.append(Problem(("loss", key), f"loss '{name}' has no parameter '{key}'; accepted "
                                    f"parameters: {', '.join(accepted) or '(none)'}"))
            bad = True
            continue
        expected, optional, _ = _type_of_param(cls, key)
        value, reason = _coerce(value, expected, optional)
        if reason:
            problems.append(Problem(("loss", key), reason))
            bad = True
        out[key] = value
    for key in accepted:
        if key in out:
            continue
        _, _, default = _type_of_param(cls, key)
        if default is inspect.Parameter.empty:
            problems.append(Problem(("loss", key), f"missing required parameter '{key}' of loss '{name}'"))
            bad = True
        elif _jsonable_default(default):
            out[key] = list(default) if isinstance(default, tuple) else copy.deepcopy(default)
    if bad:
        return None
    k = out.get("k")
    if num_classes is not None and isinstance(k, (int, float)) and not isinstance(k, bool) and k >= num_classes:
        problems.append(Problem(("loss", "k"), f"k={k} must be smaller than the number of classes "
                                f"({num_classes})"))
        return None
    reason = _try_build_loss(name, out, num_classes)
    if reason:
        named = [p for p in accepted if re.search(rf"\b{re.escape(p)}\b", reason)]
        problems.append(Problem(("loss", named[0]) if named else ("loss",), reason))
        return None
    return out


def _model_exists(name: str) -> bool:
    if name in BUILTIN_MODELS:
        return True
    try:
        import timm  # noqa: WPS433  (slow import; only for non-builtin names)
    except ImportError:  # pragma: no cover - timm is a dependency
        return True
    return bool(timm.is_model(name))


def validate_config(raw: Any) -> tuple[Optional[dict], list[Problem]]:
    """Check one trial config (docs/interfaces.md section 1) and fill in its defaults.

    Returns ``(config, [])`` or ``(None, problems)``; problem paths are relative to the config.
    """
    problems: list[Problem] = []
    if not isinstance(raw, dict):
        return None, [Problem((), f"expected a mapping (the trial config), got {_short_repr(raw)}")]
    if "seed" in raw:
        return None, [Problem(("seed",), "the seed is not part of a config; list the seeds in the "
                                         "study's top-level 'seeds'")]
    try:
        top = _TrialTop.model_validate(raw)
    except ValidationError as err:
        return None, [_extra_hint(p, _TrialTop) for p in _pydantic_problems(err)]
    config = top.model_dump()

    data_raw = top.data
    data_name = data_raw.get("name", "synthetic")
    if data_name not in DATA_SCHEMAS:
        problems.append(Problem(("data", "name"), f"unknown data set {data_name!r}; expected one of: "
                                + ", ".join(DATA_SCHEMAS)))
        return None, problems
    schema = DATA_SCHEMAS[data_name]
    try:
        data = schema.model_validate({"name": data_name, **data_raw}).model_dump()
    except ValidationError as err:
        return None, [_extra_hint(p, schema, f"for data set '{data_name}'")
                      for p in _pydantic_problems(err, ("data",))]
    config["data"] = data
    num_classes = data.get("num_classes", KNOWN_NUM_CLASSES.get(data_name))

    model = config["model"]
    if not _model_exists(model["name"]):
        problems.append(Problem(("model", "name"), f"unknown model {model['name']!r}; expected one of "
                                f"{', '.join(BUILTIN_MODELS)} or a timm architecture name"))
    elif data_name == "synthetic" and data["form"] == "features" and model["name"] != "mlp":
        problems.append(Problem(("model", "name"), f"data.form is 'features' (vectors): only the 'mlp' "
                                f"model takes them; use data.form: images for {model['name']!r}"))

    loss = _validate_loss(top.loss, num_classes, problems)
    if loss is not None:
        config["loss"] = loss

    ev = config["eval"]
    if num_classes is not None:
        for field in ("ks", "avgk"):
            for i, k in enumerate(ev[field]):
                if k > num_classes:
                    problems.append(Problem(("eval", field, i), f"K={k} in eval.{field} exceeds the number "
                                            f"of classes ({num_classes}); list only K <= {num_classes}"))
    reason = check_metric(ev["selection"], ev)
    if reason:
        problems.append(Problem(("eval", "selection"), reason))
    if problems:
        return None, problems
    return config, []


def _fields_of(model: type[BaseModel]) -> str:
    return ", ".join(info.alias or name for name, info in model.model_fields.items())


def _extra_hint(problem: Problem, model: type[BaseModel], context: str = "") -> Problem:
    """Add the accepted field names to an 'unknown field' problem of a trial-config section."""
    if problem.message != "unknown field":
        return problem
    path = [p for p in problem.path if isinstance(p, str)]
    target: Any = model
    section = path[:-1]
    if model is _TrialTop and section:
        target = {"model": ModelSection, "optim": OptimSection, "eval": EvalSection}.get(section[0])
    elif model is not _TrialTop and len(section) > 1:
        target = None
    if target is None or not isinstance(target, type):
        return Problem(problem.path, f"unknown field '{path[-1]}'")
    ctx = f" {context}" if context else ""
    return Problem(problem.path, f"unknown field '{path[-1]}'{ctx}; expected one of: {_fields_of(target)}")


# --------------------------------------------------------------------------------------
# The study file schema
# --------------------------------------------------------------------------------------


class Distribution(_Strict):
    """One sampled parameter of a random/optuna block: exactly one of the four keys.

    ``uniform: [low, high]``, ``loguniform: [low, high]`` (low > 0), ``int: [low, high]``
    (both included), ``choice: [v1, v2, ...]``.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    uniform: Optional[list[float]] = None
    loguniform: Optional[list[float]] = None
    integer: Optional[list[Annotated[int, Field(strict=True)]]] = Field(None, alias="int")
    choice: Optional[list[Any]] = None

    @model_validator(mode="after")
    def _one_kind(self) -> "Distribution":
        given = [k for k in ("uniform", "loguniform", "int", "choice") if self._get(k) is not None]
        if len(given) != 1:
            raise ValueError("expected exactly one of uniform: [low, high], loguniform: [low, high], "
                             f"int: [low, high], choice: [values...]; got {given or 'none'}")
        kind = given[0]
        values = self._get(kind)
        if kind == "choice":
            if not values:
                raise ValueError("choice needs at least one value")
            return self
        if len(values) != 2:
            raise ValueError(f"{kind} needs [low, high], got {values}")
        low, high = values
        if not low < high:
            raise ValueError(f"{kind} needs low < high, got [{low}, {high}]")
        if kind == "loguniform" and low <= 0:
            raise ValueError(f"loguniform needs 0 < low < high, got [{low}, {high}]")
        return self

    def _get(self, kind: str) -> Any:
        return self.integer if kind == "int" else getattr(self, kind)

    @property
    def kind(self) -> str:
        """uniform, loguniform, int or choice."""
        return next(k for k in ("uniform", "loguniform", "int", "choice") if self._get(k) is not None)

    @property
    def bounds(self) -> list[Any]:
        """[low, high] or the list of choices."""
        return self._get(self.kind)

    def corner_values(self) -> list[Any]:
        """Values checked at load time: both bounds, or every choice."""
        return list(self.bounds)


class _Block(_Strict):
    variants: Optional[list[str]] = Field(None, min_length=1)

    @field_validator("parameters", check_fields=False)
    @classmethod
    def _dotted_paths(cls, parameters: dict) -> dict:
        return _check_paths(parameters)

    @property
    def parameter_paths(self) -> list[str]:
        return list(getattr(self, "parameters", {}) or {})


def _check_paths(parameters: dict) -> dict:
    for path in parameters:
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$", path):
            raise ValueError(f"{path!r} is not a dotted config path such as loss.epsilon")
    return parameters


class GridBlock(_Block):
    """Cartesian product of the listed values, for every variant of the block."""

    kind: Literal["grid"]
    parameters: dict[str, Annotated[list[Any], Field(min_length=1)]] = Field(min_length=1)


class SensitivityBlock(_Block):
    """One parameter at a time around each variant's own value; the base config is one cell."""

    kind: Literal["sensitivity"]
    parameters: dict[str, Annotated[list[Any], Field(min_length=1)]] = Field(min_length=1)


class RandomBlock(_Block):
    """``n_configs`` configs sampled from the distributions, deterministic in ``sampler_seed``."""

    kind: Literal["random"]
    n_configs: int = Field(ge=1)
    parameters: dict[str, Distribution] = Field(min_length=1)
    sampler_seed: int = 0


class OptunaBlock(_Block):
    """``n_configs`` proposals from an Optuna sampler; each runs on every seed (seed mean told)."""

    kind: Literal["optuna"]
    n_configs: int = Field(ge=1)
    parameters: dict[str, Distribution] = Field(min_length=1)
    sampler: Literal["tpe", "random", "cmaes", "gp", "qmc"] = "tpe"
    sampler_seed: Optional[int] = 0


class SingleBlock(_Block):
    """The variants as they are."""

    kind: Literal["single"]


DesignBlock = Annotated[
    Union[GridBlock, SensitivityBlock, RandomBlock, OptunaBlock, SingleBlock], Field(discriminator="kind")
]
_BLOCK_CLASSES = {"grid": GridBlock, "sensitivity": SensitivityBlock, "random": RandomBlock,
                  "optuna": OptunaBlock, "single": SingleBlock}


class Resources(_Strict):
    """Per-trial resources for ``tune.with_resources``; fractions share a device."""

    cpus: float = Field(1.0, gt=0)
    gpus: float = Field(0.0, ge=0)

    @field_validator("gpus")
    @classmethod
    def _whole_above_one(cls, value: float) -> float:
        if value > 1 and not float(value).is_integer():
            raise ValueError(f"expected a fraction of one GPU (0 < gpus <= 1) or a whole number, got {value}")
        return value


class Objective(_Strict):
    metric: str
    mode: Literal["max", "min"] = "max"


class NoScheduler(_Strict):
    kind: Literal["none"]


class EarlyStopping(_Strict):
    """Stop a config (all its seeds together) whose seed-mean metric stopped improving."""

    kind: Literal["early_stopping"]
    metric: Optional[str] = None  # default: the objective's metric
    mode: Optional[Literal["max", "min"]] = None
    grace_epochs: int = Field(5, ge=0)
    patience: int = Field(3, ge=1)


Scheduler = Annotated[Union[NoScheduler, EarlyStopping], Field(discriminator="kind")]


class ReportTable(_Strict):
    """A table of the report (analysis.report): one row per config, or one column per variant."""

    metrics: list[str] = Field(min_length=1)
    title: Optional[str] = None
    columns: Literal["metrics", "variant"] = "metrics"
    digits: Optional[int] = Field(None, ge=0, le=6)
    swept: Optional[list[str]] = None  # only configs that sweep nothing but these paths


class ReportCurve(_Strict):
    """A sensitivity curve: ``metric`` against the swept parameter ``x``, CI band."""

    x: str
    metric: str


class ReportCompare(_Strict):
    """Paired comparison of every variant with ``reference`` (default: the first variant)."""

    reference: Optional[str] = None
    metrics: Optional[list[str]] = None


class ReportSetSizes(_Strict):
    """Which average-K set-size histograms the report draws (thesis Figure 5.4)."""

    ks: Optional[list[Annotated[float, Field(gt=0)]]] = None
    by_shot: Optional[str] = None  # the variant split by shot group (default: best test/avg<K>)


class Report(_Strict):
    """What ``studies report`` draws (keys read by analysis.report; all optional)."""

    level: float = Field(0.95, gt=0, lt=1)
    ci: Literal["t", "bootstrap"] = "t"
    tables: Optional[list[ReportTable]] = None
    curves: Optional[list[ReportCurve]] = None
    learning_curves: Optional[list[str]] = None  # per-epoch metrics drawn against the epoch
    set_sizes: Union[bool, ReportSetSizes, None] = None  # average-K set-size histograms (Fig. 5.4)
    epoch_time: Any = None  # true, or {x: dotted path}; default when loss.k is swept
    shot_groups: Optional[list[Any]] = None  # [top5, ...] or [{metric: top5, split: test}]
    compare: Optional[ReportCompare] = None

    @field_validator("epoch_time")
    @classmethod
    def _epoch_time(cls, value: Any) -> Any:
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, dict) and set(value) <= {"x"} and isinstance(value.get("x", ""), str):
            return value
        raise ValueError(f"expected true, false or {{x: <dotted path>}}, got {value!r}")

    @field_validator("shot_groups")
    @classmethod
    def _shot_groups(cls, value: Optional[list[Any]]) -> Optional[list[Any]]:
        for item in value or []:
            ok = isinstance(item, str) or (
                isinstance(item, dict) and isinstance(item.get("metric"), str)
                and set(item) <= {"metric", "split"} and item.get("split", "test") in ("val", "test"))
            if not ok:
                raise ValueError(f"expected a metric such as top5 or {{metric: top5, split: test}}, got {item!r}")
        return value


class ReferenceRow(_Strict):
    """Published numbers (percent) for the cells of ``variant`` whose config matches ``match``."""

    variant: Optional[str] = None
    match: dict[str, Any] = {}
    metrics: dict[str, float] = Field(min_length=1)
    ci: dict[str, float] = {}


class Reference(_Strict):
    source: str
    rows: list[ReferenceRow] = Field(min_length=1)


def _seed_list(value: Any) -> Any:
    if isinstance(value, list):
        for i, seed in enumerate(value):
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise ValueError(f"seeds must be integers, got {seed!r} at position {i}")
    return value


class Study(_Strict):
    """A validated study file. Built by :func:`load_study`; see docs/interfaces.md section 6.

    Besides the fields of the file it keeps ``path``, ``source_text`` (the YAML as written,
    stored by the runner as an artifact) and the validated config of every variant.
    """

    # names the output folder too: must start with a letter or digit (no "." or "..")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=100)
    description: str = ""
    base: dict[str, Any]
    variants: dict[Annotated[str, Field(pattern=NAME_PATTERN)], Optional[dict[str, Any]]] = {}
    design: list[DesignBlock] = Field(default_factory=lambda: [SingleBlock(kind="single")], min_length=1)
    derived: dict[str, Any] = {}
    seeds: list[Annotated[int, Field(ge=0, lt=2**32)]] = Field(min_length=1)
    resources: Resources = Field(default_factory=Resources)
    max_concurrent: Optional[int] = Field(None, ge=1)
    max_failures: int = Field(1, ge=0)
    objective: Optional[Objective] = None
    scheduler: Scheduler = Field(default_factory=lambda: NoScheduler(kind="none"))
    report: Report = Field(default_factory=Report)
    reference: Optional[Reference] = None

    _path: str = PrivateAttr("<string>")
    _source_text: str = PrivateAttr("")
    _variant_configs: dict[str, dict] = PrivateAttr(default_factory=dict)
    _variant_raw: dict[str, dict] = PrivateAttr(default_factory=dict)
    _derived_order: list[tuple[str, Expression]] = PrivateAttr(default_factory=list)
    _design_is_list: bool = PrivateAttr(True)
    _lines: dict = PrivateAttr(default_factory=dict)
    _drafts: Optional[list] = PrivateAttr(None)  # configs of the design, set by space.validate_design

    @field_validator("seeds", mode="before")
    @classmethod
    def _seeds_are_ints(cls, value: Any) -> Any:
        return _seed_list(value)

    @field_validator("seeds")
    @classmethod
    def _unique_seeds(cls, seeds: list[int]) -> list[int]:
        dupes = sorted({s for s in seeds if seeds.count(s) > 1})
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

    # ----- accessors used by studies.space and the runner --------------------------------

    @property
    def path(self) -> str:
        """The study file as given to load_study."""
        return self._path

    @property
    def source_text(self) -> str:
        """The raw YAML text of the study file."""
        return self._source_text

    @property
    def variant_names(self) -> list[str]:
        """The variants in file order; ``["base"]`` when the file has no variants."""
        return list(self._variant_configs)

    def variant_config(self, name: str) -> dict:
        """The validated, default-filled config of a variant (a copy)."""
        return copy.deepcopy(self._variant_configs[name])

    def variant_raw_config(self, name: str) -> dict:
        """``base`` deep-merged with the variant's overlay, as written (no defaults filled in)."""
        return copy.deepcopy(self._variant_raw[name])

    def block_variants(self, block: _Block) -> list[str]:
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

    @property
    def objective_metric(self) -> str:
        assert self.objective is not None
        return self.objective.metric

    def yaml_path(self, path: Path_) -> str:
        """Render an internal path (design always a list) as the file's YAML path."""
        return format_yaml_path(self._file_path(path))

    def _file_path(self, path: Path_) -> Path_:
        if not self._design_is_list and len(path) >= 2 and path[0] == "design" and path[1] == 0:
            return ("design",) + tuple(path[2:])
        return tuple(path)

    def line_of(self, path: Path_) -> Optional[int]:
        return _line_of(self._lines, self._file_path(path))

    def error(self, problems: list[Problem]) -> StudyError:
        """A StudyError for problems found after loading (e.g. by optuna_block_suggest)."""
        return StudyError(self._path, [(self.yaml_path(p.path), self.line_of(p.path), p.message)
                                       for p in _dedupe(problems)])


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def _line_of(lines: dict, path: Path_) -> Optional[int]:
    """Line of the longest prefix of ``path`` that is in the file (keys compared as text)."""
    path = tuple(path)
    for n in range(len(path), 0, -1):
        prefix = tuple(p if isinstance(p, int) else str(p) for p in path[:n])
        if prefix in lines:
            return lines[prefix]
    return None


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen, out = set(), []
    for p in problems:
        key = (tuple(p.path), p.message)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


_MODEL_AT = {
    (): Study, ("resources",): Resources, ("objective",): Objective, ("report",): Report,
    ("report", "tables", 0): ReportTable, ("report", "curves", 0): ReportCurve,
    ("report", "compare"): ReportCompare,
    ("reference",): Reference, ("reference", "rows", 0): ReferenceRow,
}


def _strip_union_tags(loc: Path_, raw: Any) -> Path_:
    """Drop the union tags pydantic inserts in error locations (``design.0.grid.parameters``)
    and the ``[key]`` marker of dictionary-key errors."""
    out: list = []
    node = raw
    for part in loc:
        if part == "[key]":
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


def _schema_problem(e: dict, raw: dict) -> Problem:
    loc = _strip_union_tags(tuple(e["loc"]), raw)
    message = _pydantic_message(e)
    kind = e["type"]
    if kind == "union_tag_not_found":
        return Problem(loc + ("kind",), "missing field 'kind'; expected one of: "
                       + ", ".join(_BLOCK_CLASSES if loc[:1] == ("design",) else ("none", "early_stopping")))
    if kind == "union_tag_invalid":
        expected = e["ctx"]["expected_tags"].replace("'", "")
        return Problem(loc + ("kind",), f"unknown kind {e['ctx']['tag']!r}; expected one of: {expected}")
    if kind == "extra_forbidden":
        parent = loc[:-1]
        model = None
        if parent[:1] == ("design",) and len(parent) == 2:
            block = raw.get("design", [])[parent[1]] if isinstance(raw.get("design"), list) else None
            model = _BLOCK_CLASSES.get(block.get("kind")) if isinstance(block, dict) else None
        elif parent[:1] == ("design",) and len(parent) == 4 and parent[2] == "parameters":
            model = Distribution
        elif parent == ("scheduler",):
            sched = raw.get("scheduler")
            model = EarlyStopping if isinstance(sched, dict) and sched.get("kind") == "early_stopping" else NoScheduler
        else:
            normal = tuple(0 if isinstance(p, int) else p for p in parent)
            model = _MODEL_AT.get(normal)
        fields = _fields_of(model) if model else None
        message = f"unknown field '{loc[-1]}'" + (f"; expected one of: {fields}" if fields else "")
    elif kind == "missing":
        message = f"missing required field '{loc[-1]}'"
    return Problem(loc, message)


def load_study(path: Union[str, Path]) -> Study:
    """Read and validate a study file; raise :class:`StudyError` (one paragraph) when it is wrong."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise StudyError(file, [("(file)", None, "no such file; expected the path of a YAML study file")]) from None
    except IsADirectoryError:
        raise StudyError(file, [("(file)", None, "is a folder; expected the path of a YAML study file")]) from None
    except UnicodeDecodeError as err:
        raise StudyError(file, [("(file)", None, f"is not UTF-8 text ({err.reason} at byte {err.start})")]) from None
    return parse_study(text, file)


def parse_study(text: str, file: str = "<string>") -> Study:
    """Validate study-file text; ``file`` names it in the error messages."""
    lines: dict = {}
    design_is_list = True
    try:
        data, lines = _read_yaml(text)
        if data is None:
            raise _Problems([Problem((), "the file is empty; expected a mapping with at least name, "
                                         "base and seeds")])
        if not isinstance(data, dict):
            raise _Problems([Problem((), f"expected a mapping with at least name, base and seeds, "
                                         f"got {type(data).__name__}")])
        raw = dict(data)
        design = raw.get("design")
        if isinstance(design, dict):
            design_is_list = False
            raw["design"] = [design]
        elif design is None and "design" in raw:
            del raw["design"]
        try:
            study = Study.model_validate(raw)
        except ValidationError as err:
            raise _Problems([_schema_problem(e, raw) for e in err.errors()]) from None
        study._path = file
        study._source_text = text
        study._lines = lines
        study._design_is_list = design_is_list
        _check_study(study)
        from studies.space import validate_design  # noqa: WPS433  (space imports this module)

        validate_design(study)
    except _Problems as problems:
        def file_path(p: Path_) -> Path_:
            if not design_is_list and len(p) >= 2 and p[0] == "design" and p[1] == 0:
                return ("design",) + tuple(p[2:])
            return tuple(p)

        raise StudyError(file, [(format_yaml_path(file_path(p.path)), _line_of(lines, file_path(p.path)),
                                 p.message) for p in _dedupe(problems.problems)]) from None
    return study


def _check_study(study: Study) -> None:
    """Stage 3: variant configs, names used by the design/derived/report, derived expressions."""
    problems: list[Problem] = []
    base = study.base
    overlays = {name: (overlay or {}) for name, overlay in study.variants.items()} or {DEFAULT_VARIANT: {}}
    for name, overlay in overlays.items():
        raw = deep_merge(base, overlay)
        config, found = validate_config(raw)
        for p in found:
            where = _origin_in_variant(study, name, p.path)
            # a mistake in base is reported once, not once per variant
            suffix = f" (variant '{name}')" if study.variants and where[0] == "base" and len(overlays) > 1 \
                and _overlay_touches(overlays[name], p.path) else ""
            problems.append(Problem(where, p.message + suffix))
        study._variant_raw[name] = raw
        if config is not None:
            study._variant_configs[name] = config
    if problems:
        raise _Problems(problems)

    names = list(study._variant_configs)
    for i, block in enumerate(study.design):
        for j, variant in enumerate(block.variants or []):
            if variant not in study._variant_configs:
                problems.append(Problem(("design", i, "variants", j), f"unknown variant {variant!r}; "
                                        f"expected one of: {', '.join(names)}"))

    # derived: parse, forbid sweeping a derived target, order by dependencies
    exprs: dict[str, Expression] = {}
    for target, text in study.derived.items():
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$", target):
            problems.append(Problem(("derived", target), f"{target!r} is not a dotted config path such as optim.lr"))
            continue
        try:
            exprs[target] = parse_expression(text)
        except ExpressionError as err:
            problems.append(Problem(("derived", target), str(err)))
    for i, block in enumerate(study.design):
        for path in block.parameter_paths:
            if path in study.derived:
                problems.append(Problem(("design", i, "parameters", path), f"'{path}' is also computed in "
                                        "'derived'; a parameter is either swept or derived"))
    order = _topological(exprs, problems)
    study._derived_order = [(t, exprs[t]) for t in order]

    # objective (default: the selection metric of the first variant) and scheduler metric
    first = study._variant_configs[names[0]]
    if study.objective is None:
        study.objective = Objective(metric=first["eval"]["selection"], mode=first["eval"]["selection_mode"])
    else:
        for name, config in study._variant_configs.items():
            reason = check_metric(study.objective.metric, config["eval"], ("val", "test", "train"))
            if reason:
                problems.append(Problem(("objective", "metric"), reason + (f" (variant '{name}')" if study.variants else "")))
                break
    if isinstance(study.scheduler, EarlyStopping):
        metric = study.scheduler.metric or study.objective.metric
        if study.scheduler.mode is None:
            study.scheduler.mode = study.objective.mode if study.scheduler.metric in (None, study.objective.metric) \
                else ("min" if metric == "train/loss" else "max")
        for name, config in study._variant_configs.items():
            reason = check_metric(metric, config["eval"], ("val",))
            if reason:
                where = ("scheduler", "metric") if study.scheduler.metric else ("objective", "metric")
                problems.append(Problem(where, "early stopping needs a validation metric: " + reason))
                break
        study.scheduler.metric = metric  # resolved: the runner reads metric and mode directly

    # report and reference: variant names exist; curve x is a swept path
    swept = {p for b in study.design for p in b.parameter_paths}
    compare = study.report.compare
    if compare is not None and compare.reference is not None and compare.reference not in study._variant_configs:
        problems.append(Problem(("report", "compare", "reference"), f"unknown variant {compare.reference!r}; "
                                f"expected one of: {', '.join(names)}"))
    for i, curve in enumerate(study.report.curves or []):
        if curve.x not in swept:
            problems.append(Problem(("report", "curves", i, "x"), f"'{curve.x}' is not swept by any design "
                                    f"block; expected one of: {', '.join(sorted(swept)) or '(none)'}"))
    set_sizes = study.report.set_sizes
    if isinstance(set_sizes, ReportSetSizes):
        if set_sizes.by_shot is not None and set_sizes.by_shot not in study._variant_configs:
            problems.append(Problem(("report", "set_sizes", "by_shot"), f"unknown variant {set_sizes.by_shot!r}; "
                                    f"expected one of: {', '.join(names)}"))
        computed = {float(k) for c in study._variant_configs.values() for k in c["eval"]["avgk"]}
        for i, k in enumerate(set_sizes.ks or []):
            if float(k) not in computed:
                problems.append(Problem(("report", "set_sizes", "ks", i), f"average-{k:g} sets are not computed: "
                                        f"expected a K of eval.avgk ({sorted(computed) or 'empty'})"))
    for i, metric in enumerate(study.report.learning_curves or []):
        if metric in PER_EPOCH_EXTRA_METRICS:
            continue
        for name, config in study._variant_configs.items():
            reason = check_metric(metric, config["eval"], ("val", "train"))
            if reason:
                problems.append(Problem(("report", "learning_curves", i), "a learning curve needs a per-epoch "
                                        f"metric ({', '.join(PER_EPOCH_EXTRA_METRICS)} or a val/ or train/ "
                                        f"accuracy): {reason}" + (f" (variant '{name}')" if study.variants else "")))
                break
    if study.reference is not None:
        for i, row in enumerate(study.reference.rows):
            if row.variant is not None and row.variant not in study._variant_configs:
                problems.append(Problem(("reference", "rows", i, "variant"), f"unknown variant {row.variant!r}; "
                                        f"expected one of: {', '.join(names)}"))
    if problems:
        raise _Problems(problems)


def _overlay_touches(overlay: dict, config_path: Path_) -> bool:
    """Whether the overlay sets anything in the config section of ``config_path`` (so that a
    problem found in base may come from the combination with this variant)."""
    return bool(config_path) and config_path[0] in overlay


def _topological(exprs: dict[str, Expression], problems: list[Problem]) -> list[str]:
    """Derived targets ordered so that a target read by another is computed first."""
    order: list[str] = []
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(target: str, chain: list[str]) -> None:
        if state.get(target) == 2:
            return
        if state.get(target) == 1:
            cycle = " -> ".join(chain[chain.index(target):] + [target])
            problems.append(Problem(("derived", target), f"derived parameters depend on each other in a "
                                    f"cycle ({cycle})"))
            return
        state[target] = 1
        for name in sorted(exprs[target].names):
            if name in exprs:
                visit(name, chain + [target])
        state[target] = 2
        order.append(target)

    for target in exprs:
        visit(target, [])
    return order


def _origin_in_variant(study: Study, variant: str, config_path: Path_) -> Path_:
    """YAML path of a config value: inside the variant's overlay if written there, else in base."""
    overlay = study.variants.get(variant) or {}
    node: Any = overlay
    depth = 0
    for part in config_path:
        if isinstance(node, dict) and part in node:
            node = node[part]
            depth += 1
        else:
            break
    if depth > 0:
        return ("variants", variant) + tuple(config_path)
    return ("base",) + tuple(config_path)
