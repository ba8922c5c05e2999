"""Validation of one trial config of a study, against the declarations of ``setvalued.config``.

The trial config's fields, defaults and ranges are declared once in ``setvalued.config`` (and a
loss's parameters in ``setvalued.losses.parameters``); this module builds the pydantic schema of
a study file's configs from those declarations, so that a study file gets the same checks as
the trainer, with the YAML path and the study-file wording of every mistake. It imports
neither torch nor the losses themselves (a timm architecture name is the one exception: it is
looked up in timm, which imports torch).

``validate_config(raw)`` returns the config with every default filled in (the data set's own
fields, the loss's own parameters), so that a config written with or without a default value
is the same config (same ``config_id``) and MLflow shows every parameter that was used.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal, Optional, cast

from pydantic import BaseModel, Field, ValidationError, create_model, field_validator, model_validator

from setvalued import registry
from setvalued.config import EVAL_FIELDS, MODEL_FIELDS, OPTIM_FIELDS, SECTION_RULES, TOP_FIELDS
from setvalued.label_kinds import label_kind_problems
from setvalued.losses.parameters import CONTEXT_KEYS
from setvalued.metrics import check_metric
from setvalued.params import REQUIRED, Param, ParameterError
from studies.studyfile.problems import Problem, did_you_mean
from studies.studyfile.schema import StrictModel, fields_of, pydantic_problems, short_repr

#: a rule over a whole config section (``setvalued.config.SECTION_RULES``): why not, or None
SectionRule = Callable[[Mapping[str, Any]], str | None]

__all__ = ["validate_config", "declared_param", "data_schema", "TrialConfigSchema"]


# --------------------------------------------------------------------------------------------
# pydantic models generated from the declarations
# --------------------------------------------------------------------------------------------


def _annotation(param: Param) -> Any:
    """The pydantic type of a declared parameter (without its default)."""
    bounds: dict[str, Any] = {}
    if param.low is not None:
        bounds["gt" if param.low_open else "ge"] = param.low
    if param.high is not None:
        bounds["lt" if param.high_open else "le"] = param.high
    if param.options is not None:
        kind: Any = Literal[param.options]
    elif param.type == "list":
        item = _annotation(param.item) if param.item else Any
        kind = list[item]  # type: ignore[valid-type]  # a type built at run time, for pydantic
    else:
        kind = {"int": int, "float": float, "bool": bool, "str": str, "any": Any}[param.type]
    if bounds:
        kind = Annotated[kind, Field(**bounds)]
    return Optional[kind] if param.nullable else kind  # noqa: UP045 (a runtime type built for pydantic)


def _field(param: Param) -> tuple[Any, Any]:
    """``(annotation, FieldInfo)`` of a declared parameter for ``create_model``."""
    length: dict[str, Any] = {}
    if param.length is not None:
        length["min_length"] = param.length[0]
        if param.length[1] is not None:
            length["max_length"] = param.length[1]
    if param.required:
        return _annotation(param), Field(**length)
    default = param.default
    return _annotation(param), Field(default_factory=lambda: copy.deepcopy(default), **length)


def _rule_validator(param: Param) -> Any:
    rule = cast(Callable[[Any], Any], param.rule)  # a parameter with a rule

    def check(cls: Any, value: Any) -> Any:
        try:
            return rule(value)
        except ValueError as err:
            raise ValueError(f"expected {err}, got {value!r}") from None

    return classmethod(check)


def _section_validator(rules: Sequence[SectionRule]) -> Callable[[Any], Any]:
    def check(self: Any) -> Any:
        for rule in rules:
            reason = rule(self.model_dump())
            if reason:
                raise ValueError(reason)
        return self

    return check


def section_model(name: str, fields: Mapping[str, Param], rules: Sequence[SectionRule] = ()) -> type[BaseModel]:
    """A strict pydantic model of one config section from its declarations."""
    validators: dict[str, Any] = {
        f"_rule_{key}": field_validator(key)(_rule_validator(p)) for key, p in fields.items() if p.rule is not None
    }
    if rules:
        validators["_section_rules"] = model_validator(mode="after")(_section_validator(rules))
    declared: dict[str, Any] = {key: _field(p) for key, p in fields.items()}
    return create_model(name, __base__=StrictModel, __validators__=validators, **declared)


@functools.cache
def data_schema(name: str) -> type[BaseModel]:
    """The ``data`` section of a registered data set (built-in or plugin)."""
    fields = cast(dict[str, Param], registry.section_fields("dataset", name))  # a registered name
    return section_model(f"{name}_data", fields, SECTION_RULES["data"])


@functools.cache
def _plugin_model_schema(name: str) -> type[BaseModel]:
    """The ``model`` section of a plugin model: name, head and its declared parameters."""
    return section_model(f"{name}_model", cast(dict[str, Param], registry.section_fields("model", name)))


def _plugin_model(name: Any) -> bool:
    item = registry.entry("model", name)
    return item is not None and not item.builtin


ModelSection = section_model("model", MODEL_FIELDS, SECTION_RULES["model"])
OptimSection = section_model("optim", OPTIM_FIELDS, SECTION_RULES["optim"])
EvalSection = section_model("eval", EVAL_FIELDS, SECTION_RULES["eval"])
_SECTIONS = {"model": ModelSection, "optim": OptimSection, "eval": EvalSection}


class TrialConfigSchema(StrictModel):
    """The top level of a trial config; ``data`` and ``loss`` are checked by their own schemas."""

    data: dict[str, Any] = Field(default_factory=lambda: {"name": "synthetic"})
    # the section models are built at import from the declarations: mypy sees variables
    model: ModelSection = Field(default_factory=ModelSection)  # type: ignore[valid-type]
    loss: dict[str, Any]
    optim: OptimSection = Field(default_factory=OptimSection)  # type: ignore[valid-type]
    epochs: _annotation(TOP_FIELDS["epochs"]) = TOP_FIELDS["epochs"].default  # type: ignore[valid-type]
    eval: EvalSection = Field(default_factory=EvalSection)  # type: ignore[valid-type]
    device: _annotation(TOP_FIELDS["device"]) = TOP_FIELDS["device"].default  # type: ignore[valid-type]
    amp: _annotation(TOP_FIELDS["amp"]) = TOP_FIELDS["amp"].default  # type: ignore[valid-type]
    compile: _annotation(TOP_FIELDS["compile"]) = TOP_FIELDS["compile"].default  # type: ignore[valid-type]

    _device = field_validator("device")(_rule_validator(TOP_FIELDS["device"]))


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def _validate_loss(raw: Any, num_classes: int | None, problems: list[Problem]) -> dict[str, Any] | None:
    """The loss section checked against its declaration, defaults filled in; None on problems."""
    if not isinstance(raw, dict):
        problems.append(
            Problem(("loss",), f"expected a mapping with the loss name and its parameters, got {short_repr(raw)}")
        )
        return None
    losses = registry.entries("loss")
    known = ", ".join(sorted(losses))
    name = raw.get("name")
    if name is None:
        problems.append(Problem(("loss", "name"), f"missing required field: the loss name; expected one of: {known}"))
        return None
    if not isinstance(name, str) or name not in losses:
        problems.append(
            Problem(
                ("loss", "name"),
                f"unknown loss {name!r}{did_you_mean(name, losses)}"
                f"{registry.refusal_note('loss', name)}; expected one of: {known}",
            )
        )
        return None
    declared = losses[name].parameters
    out: dict[str, Any] = {"name": name}
    bad = False
    for key, value in raw.items():
        if key == "name":
            continue
        if key in CONTEXT_KEYS or key == "reduction":
            problems.append(Problem(("loss", key), f"'{key}' is set by the trainer, not by the study file"))
            bad = True
        elif key not in declared:
            problems.append(
                Problem(
                    ("loss", key),
                    f"loss '{name}' has no parameter '{key}'"
                    f"{did_you_mean(key, declared)}; accepted "
                    f"parameters: {', '.join(declared) or '(none)'}",
                )
            )
            bad = True
        else:
            try:
                out[key] = declared[key].check(key, value)
            except ParameterError as err:
                problems.append(
                    Problem(
                        ("loss", key),
                        f"expected {err.requirement}, got {short_repr(value)}" if err.wrong_type else err.text,
                    )
                )
                bad = True
    for key, param in declared.items():
        if param.implicit and out.get(key, param.default) == param.default:
            out.pop(key, None)  # written only when it differs from the default (Param.implicit)
            continue
        if key in out:
            continue
        if param.default is REQUIRED:
            problems.append(Problem(("loss", key), f"missing required parameter '{key}' of loss '{name}'"))
            bad = True
        else:
            out[key] = copy.deepcopy(param.default)
    if bad:
        return None
    k = out.get("k")
    if num_classes is not None and isinstance(k, (int, float)) and not isinstance(k, bool) and k >= num_classes:
        problems.append(Problem(("loss", "k"), f"k={k} must be smaller than the number of classes ({num_classes})"))
        return None
    return out


def declared_param(config: Mapping[str, Any], dotted: str) -> Param | None:
    """The declaration of the field at ``dotted`` in a validated config (the data set's fields,
    the loss's parameters), or None when the path is not a declared field."""
    section, _, key = dotted.partition(".")
    if not key:
        return TOP_FIELDS.get(section)
    if "." in key:
        return None
    kind = {"loss": "loss", "data": "dataset", "model": "model"}.get(section)
    if kind is not None and (section != "model" or _plugin_model(config.get("model", {}).get("name"))):
        return (registry.section_fields(kind, config.get(section, {}).get("name")) or {}).get(key)
    return {"model": MODEL_FIELDS, "optim": OPTIM_FIELDS, "eval": EVAL_FIELDS}.get(section, {}).get(key)


def _model_exists(name: str) -> bool:
    return registry.entry("model", name) is not None or _timm_model(name)


@functools.cache
def _timm_model(name: str) -> bool:
    try:
        import timm  # (slow import, torch included; only for non-builtin names)
    except ImportError:  # pragma: no cover - timm is a dependency
        return True
    return bool(timm.is_model(name))


def validate_config(raw: Any) -> tuple[dict[str, Any] | None, list[Problem]]:
    """Check one trial config (docs/interfaces.md section 1) and fill in its defaults.

    Returns ``(config, [])`` or ``(None, problems)``; problem paths are relative to the config.
    """
    if not isinstance(raw, dict):
        return None, [Problem((), f"expected a mapping (the trial config), got {short_repr(raw)}")]
    if "seed" in raw:
        return None, [
            Problem(("seed",), "the seed is not part of a config; list the seeds in the study's top-level 'seeds'")
        ]
    plugin_model = bool(isinstance(raw.get("model"), dict) and _plugin_model(raw["model"].get("name")))
    top, config, problems = _sections(raw, plugin_model)
    if problems:
        return None, problems
    data, num_classes, problems = _data_section(top.data)
    if problems:
        return None, problems
    config["data"] = data
    problems = _model_problems(config["model"], data, plugin_model)
    loss = _validate_loss(top.loss, num_classes, problems)
    if loss is not None:
        config["loss"] = loss
    problems += _eval_problems(config["eval"], num_classes)
    if not problems:
        problems.extend(Problem(path, message) for path, message in label_kind_problems(config))
    if problems:
        return None, problems
    return _without_implicit_defaults(config), []


def _sections(raw: dict[str, Any], plugin_model: bool) -> tuple[Any, dict[str, Any], list[Problem]]:
    """(the validated top level, its config with defaults, problems): a plugin model's
    section validated by its own schema (name, head and the plugin's parameters)."""
    try:
        top = TrialConfigSchema.model_validate({k: v for k, v in raw.items() if not (plugin_model and k == "model")})
    except ValidationError as err:
        return None, {}, [_unknown_field_hint(p, TrialConfigSchema) for p in pydantic_problems(err)]
    config = top.model_dump()
    if plugin_model:
        name = raw["model"]["name"]
        try:
            config["model"] = _plugin_model_schema(name).model_validate(raw["model"]).model_dump()
        except ValidationError as err:
            return (
                top,
                config,
                [
                    _unknown_field_hint(p, _plugin_model_schema(name), f"for model '{name}'")
                    for p in pydantic_problems(err, ("model",))
                ],
            )
    return top, config, []


def _data_section(data_raw: dict[str, Any]) -> tuple[dict[str, Any], int | None, list[Problem]]:
    """(the data section with its data set's defaults, its number of classes, problems): the
    data set registered, its parameters its own."""
    data_name = data_raw.get("name", "synthetic")
    datasets = registry.entries("dataset")
    if not isinstance(data_name, str) or data_name not in datasets:
        return (
            {},
            None,
            [
                Problem(
                    ("data", "name"),
                    f"unknown data set {data_name!r}"
                    f"{did_you_mean(str(data_name), datasets)}{registry.refusal_note('dataset', data_name)}; "
                    "expected one of: " + ", ".join(datasets),
                )
            ],
        )
    schema = data_schema(data_name)
    try:
        data = schema.model_validate({"name": data_name, **data_raw}).model_dump()
    except ValidationError as err:
        return (
            {},
            None,
            [_unknown_field_hint(p, schema, f"for data set '{data_name}'") for p in pydantic_problems(err, ("data",))],
        )
    return data, data.get("num_classes", datasets[data_name].num_classes), []


def _model_problems(model: dict[str, Any], data: dict[str, Any], plugin_model: bool) -> list[Problem]:
    """The model registered (or a timm architecture), and able to read the data's form."""
    if not _model_exists(model["name"]):
        return [
            Problem(
                ("model", "name"),
                f"unknown model {model['name']!r}"
                f"{registry.refusal_note('model', model['name'])}; expected one of "
                f"{', '.join(registry.entries('model'))} or a timm architecture name",
            )
        ]
    if data["name"] == "synthetic" and data["form"] == "features" and model["name"] != "mlp" and not plugin_model:
        return [
            Problem(
                ("model", "name"),
                f"data.form is 'features' (vectors): only the 'mlp' "
                f"model takes them; use data.form: images for {model['name']!r}",
            )
        ]
    return []


def _eval_problems(ev: dict[str, Any], num_classes: int | None) -> list[Problem]:
    """Every K of ``eval.ks`` and ``eval.avgk`` at most the number of classes; the selection
    metric one the trial logs."""
    problems = []
    if num_classes is not None:
        for field in ("ks", "avgk"):
            for i, k in enumerate(ev[field]):
                if k > num_classes:
                    problems.append(
                        Problem(
                            ("eval", field, i),
                            f"K={k} in eval.{field} exceeds the number "
                            f"of classes ({num_classes}); list only K <= {num_classes}",
                        )
                    )
    reason = check_metric(ev["selection"], ev)
    if reason:
        problems.append(Problem(("eval", "selection"), reason))
    return problems


def _without_implicit_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """The config without the section fields declared ``implicit`` that hold their default
    (``Param.implicit``: a config holds them only when they differ, so adding such a field
    changed no config_id); the trainer fills them in again."""
    model = config["model"].get("name")
    sections = {
        "model": (registry.section_fields("model", model) or {}) if _plugin_model(model) else MODEL_FIELDS,
        "optim": OPTIM_FIELDS,
        "eval": EVAL_FIELDS,
        "data": registry.section_fields("dataset", config["data"].get("name")) or {},
    }
    for section, fields in sections.items():
        for key, param in fields.items():
            if param.implicit and key in config[section] and config[section][key] == param.default:
                del config[section][key]
    for key, param in TOP_FIELDS.items():
        if param.implicit and key in config and config[key] == param.default:
            del config[key]
    return config


def _unknown_field_hint(problem: Problem, model: type[BaseModel], context: str = "") -> Problem:
    """Add the accepted field names to an 'unknown field' problem of a trial-config section."""
    if problem.message != "unknown field":
        return problem
    path: list[str] = [p for p in problem.path if isinstance(p, str)]
    target: Any = model
    section = path[:-1]
    if model is TrialConfigSchema and section:
        target = _SECTIONS.get(section[0])
    elif model is not TrialConfigSchema and len(section) > 1:
        target = None
    if target is None or not isinstance(target, type):
        return Problem(problem.path, f"unknown field '{path[-1]}'")
    ctx = f" {context}" if context else ""
    fields = fields_of(target)
    hint = did_you_mean(path[-1], fields.split(", "))
    return Problem(problem.path, f"unknown field '{path[-1]}'{ctx}{hint}; expected one of: {fields}")
