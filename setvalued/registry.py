"""One registry per kind (losses, data sets, models): the built-ins and the installed plugins.

Validation (``studies.studyfile``), the trainer (``build_loss``, ``build_datasets``,
``build_model``), the generated documentation tables and ``studies plugins`` all read
:func:`entries`; there is no second list. Built-ins are declared where they always were
(``setvalued.losses.parameters.LOSS_PARAMETERS``, ``setvalued.config.DATA_FIELDS`` with one
builder path in ``BUILTIN_DATASET_BUILDERS``, ``setvalued.config.MODEL_FIELDS``).

A plugin is an installed distribution declaring entry points in the groups ``setvalued.losses``,
``setvalued.datasets`` or ``setvalued.models``. Each entry point's name is the registered name
and its value names a :class:`Declaration`: the parameters (the same :class:`~setvalued.params.Param`
declarations as the built-ins) and the dotted path of the code (``"pkg.module:Name"``), which
only the trainer imports. Reading the declarations therefore imports no torch, so a study file
is validated without PyTorch; and a study file names registered names only, never a module or a
path. Only distributions that declare these groups are ever imported. Pure Python: no torch.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from setvalued.params import Param

__all__ = [
    "Declaration",
    "Entry",
    "Refusal",
    "PluginError",
    "KINDS",
    "GROUPS",
    "entries",
    "entry",
    "refusals",
    "refusal_note",
    "section_fields",
    "plugin_parameters",
    "load_factory",
    "run_check",
    "plugins_of_config",
    "plugin_sections",
    "plugin_distributions",
    "distribution_source",
    "clear_cache",
]

#: kind -> entry-point group
GROUPS = {"loss": "setvalued.losses", "dataset": "setvalued.datasets", "model": "setvalued.models"}
KINDS = tuple(GROUPS)
#: the config section that names an entry of each kind
SECTIONS = {"loss": "loss", "dataset": "data", "model": "model"}

#: the built-in data sets' builders, ``build(config, seed) -> DataSplits``: one line per data set
#: (its fields are ``setvalued.config.DATA_FIELDS[name]``)
BUILTIN_DATASET_BUILDERS = {
    "synthetic": "setvalued.data.synthetic:build",
    "cifar100": "setvalued.data.cifar100:build",
    "plantnet300k": "setvalued.data.plantnet:build",
    "imagenet_lt": "setvalued.data.imagenet_lt:build",
    "image_folder": "setvalued.data.image_folder:build",
    "arrays": "setvalued.data.arrays:build",
}

#: what the trainer passes a plugin's code besides its declared parameters (so a plugin may not
#: declare them): a loss's context, a data set's seed and common fields, a model's input
RESERVED = {
    "loss": ("class_counts", "num_classes", "num_examples", "reduction", "name"),
    "dataset": ("seed", "name", "num_workers", "placement"),
    "model": ("input_shape", "name", "head", "pretrained"),
}


class PluginError(ValueError):
    """A plugin that cannot be used, naming its distribution and entry point."""


@dataclass(frozen=True)
class Declaration:
    """What a plugin's entry point names: its parameters and where its code is.

    ``factory`` is ``"module:attribute"``, imported only when the thing is built:
    a loss: a ``SetValuedLoss`` subclass whose constructor takes the declared parameters
    (plus, optionally, ``class_counts``, ``num_classes``, ``num_examples`` and ``reduction``);
    a data set: ``build(*, seed, **parameters) -> DataSplits``;
    a model: ``build(*, input_shape, **parameters) -> nn.Module`` (the backbone: it maps a batch
    to (B, D) features and has ``out_features = D``; the head the loss needs is added on top).
    ``num_classes``: a data set's number of classes when it is fixed (for the K < L checks).
    ``check`` (data sets only, optional): ``"module:attribute"`` of ``check(**parameters)``, the
    driver's preflight before the first trial starts (as the built-ins' data folders are
    checked): it raises ``ValueError`` or ``OSError`` saying what is missing or wrong, cheaply
    (it should not load the data).
    """

    parameters: Mapping[str, Param]
    factory: str
    doc: str = ""
    num_classes: int | None = None
    check: str | None = None


@dataclass(frozen=True)
class Entry:
    """One registered loss, data set or model; ``distribution`` is None for a built-in."""

    name: str
    kind: str
    parameters: Mapping[str, Param]
    factory: str | None
    doc: str = ""
    num_classes: int | None = None
    distribution: str | None = None
    version: str | None = None
    entry_point: str = ""
    check: str | None = None

    @property
    def builtin(self) -> bool:
        return self.distribution is None

    @property
    def origin(self) -> str:
        """``built-in`` or ``<distribution> <version>, entry point <group>:<name>``."""
        if self.builtin:
            return "built-in"
        return f"{self.distribution} {self.version}, entry point {self.entry_point}"


@dataclass(frozen=True)
class Refusal:
    """A plugin entry point that is not registered, and why."""

    kind: str
    name: str
    distribution: str
    version: str
    entry_point: str
    reason: str

    def message(self) -> str:
        return (
            f"plugin {self.kind} {self.name!r} of distribution {self.distribution} {self.version} "
            f"(entry point {self.entry_point}) refused: {self.reason}"
        )


# ---------------------------------------------------------------------------------------------
# the built-ins
# ---------------------------------------------------------------------------------------------


def _builtins(kind: str) -> dict[str, Entry]:
    if kind == "loss":
        from setvalued.losses.parameters import LOSS_PARAMETERS

        return {name: Entry(name, "loss", params, None) for name, params in LOSS_PARAMETERS.items()}
    from setvalued.config import BUILTIN_MODELS, DATA_FIELDS, KNOWN_NUM_CLASSES, MODEL_FIELDS

    if kind == "dataset":
        return {
            name: Entry(
                name, "dataset", fields, BUILTIN_DATASET_BUILDERS.get(name), num_classes=KNOWN_NUM_CLASSES.get(name)
            )
            for name, fields in DATA_FIELDS.items()
        }
    return {name: Entry(name, "model", MODEL_FIELDS, "setvalued.models:build_model") for name in BUILTIN_MODELS}


# ---------------------------------------------------------------------------------------------
# discovery (once per process)
# ---------------------------------------------------------------------------------------------


def _check_declaration(kind: str, name: str, declared: Any, builtin: Mapping[str, Entry]) -> str | None:
    """Why a loaded entry point cannot be registered, or None."""
    if not isinstance(declared, Declaration):
        return (
            f"its entry point names a {type(declared).__name__}, expected a setvalued.registry.Declaration "
            "(parameters and the 'module:attribute' path of the code)"
        )
    if name in builtin:
        return f"the name {name!r} is a built-in {kind}'s; choose another"
    if not name.isidentifier():
        return f"the name {name!r} is not an identifier (letters, digits, _)"
    if not isinstance(declared.factory, str) or ":" not in declared.factory:
        return f"factory must be 'module:attribute', got {declared.factory!r}"
    if declared.check is not None and (
        kind != "dataset" or not isinstance(declared.check, str) or ":" not in declared.check
    ):
        return (
            f"check must be None or a data set's 'module:attribute', got {declared.check!r}"
            if kind == "dataset"
            else f"check is a data set's preflight; a {kind} plugin may not declare one"
        )
    for key, param in declared.parameters.items():
        if not isinstance(param, Param):
            return f"parameter {key!r} is declared by a {type(param).__name__}, expected a setvalued.params.Param"
        if key in RESERVED[kind]:
            return f"parameter {key!r} is set by the trainer; a {kind} plugin may not declare it"
    return None


@functools.cache
def _discover() -> tuple[dict[str, dict[str, Entry]], tuple[Refusal, ...]]:
    """Every kind's entries and the refused plugins; entry points are read (and their
    declaration modules imported) once per process."""
    found: dict[str, dict[str, Entry]] = {}
    refused: list[Refusal] = []
    for kind, group in GROUPS.items():
        builtin = _builtins(kind)
        registered = dict(builtin)
        points = sorted(importlib.metadata.entry_points(group=group), key=lambda p: (p.name, p.value))
        owners: dict[str, list[str]] = {}  # a name two distributions register is refused in both
        for point in points:
            dist = getattr(point, "dist", None)
            owners.setdefault(point.name, []).append(dist.metadata["Name"] if dist is not None else "?")
        for point in points:
            dist = getattr(point, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else "(unknown distribution)"
            version = dist.version if dist is not None else "?"
            where = f"{group}:{point.name}"
            reason: str | None
            try:
                declared = point.load()
            except Exception as err:  # noqa: BLE001 - any failure of a plugin's import is its refusal
                reason = f"its declaration {point.value!r} failed to import: {type(err).__name__}: {err}"
            else:
                reason = _check_declaration(kind, point.name, declared, builtin)
            others = sorted(set(owners[point.name]) - {dist_name}) or (
                [dist_name] if len(owners[point.name]) > 1 else []
            )
            if reason is None and others:
                reason = f"the name {point.name!r} is also registered by {', '.join(others)}; uninstall one"
            if reason is not None:
                refused.append(Refusal(kind, point.name, dist_name, version, where, reason))
                continue
            registered[point.name] = Entry(
                point.name,
                kind,
                dict(declared.parameters),
                declared.factory,
                declared.doc,
                declared.num_classes,
                dist_name,
                version,
                where,
                declared.check,
            )
        found[kind] = registered
    return found, tuple(refused)


def clear_cache() -> None:
    """Forget what was discovered (a test that installs a plugin after the first look-up)."""
    _discover.cache_clear()
    _load.cache_clear()


def entries(kind: str) -> dict[str, Entry]:
    """The registered entries of ``kind`` (``loss``, ``dataset``, ``model``): built-ins first."""
    return _discover()[0][kind]


def entry(kind: str, name: Any) -> Entry | None:
    """The entry registered as ``name``, or None."""
    return entries(kind).get(name) if isinstance(name, str) else None


def refusals() -> tuple[Refusal, ...]:
    """The plugin entry points that were refused, with why."""
    return _discover()[1]


def refusal_note(kind: str, name: Any) -> str:
    """``" (plugin ... refused: why)"`` when ``name`` is a refused plugin's name, else ``""``:
    the end of an "unknown ..." message, so a study naming it says why it is not there."""
    found = [r.message() for r in refusals() if r.kind == kind and r.name == name]
    return f" ({'; '.join(found)})" if found else ""


def section_fields(kind: str, name: Any) -> dict[str, Param] | None:
    """Every field of the config section that names ``name`` (the loss: its parameters; a data
    set or model: ``name`` and the fields common to all, then its own), or None when unknown.
    A built-in's are its declaration as it is; a plugin's add the common fields the trainer
    reads (``data.num_workers``, ``data.placement``, ``model.head``)."""
    item = entry(kind, name)
    if item is None:
        return None
    if item.builtin or kind == "loss":
        return dict(item.parameters)
    from setvalued.config import DATA_COMMON, MODEL_FIELDS

    label = {"dataset": "the data set", "model": "the model"}[kind]
    common = (
        {k: DATA_COMMON[k] for k in ("num_workers", "placement")}
        if kind == "dataset"
        else {"head": MODEL_FIELDS["head"]}
    )
    return {"name": Param("str", name, label, options=(name,)), **common, **item.parameters}


# ---------------------------------------------------------------------------------------------
# the code of a plugin (imported by the trainer only)
# ---------------------------------------------------------------------------------------------


def _taken(obj: Callable[..., Any]) -> tuple[set[str], bool]:
    """The keyword parameters a callable (a class: its constructor) takes, and whether it takes **kwargs."""
    target = obj.__init__ if inspect.isclass(obj) else obj
    params = inspect.signature(target).parameters
    names = {
        p
        for p, v in params.items()
        if v.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    } - {"self"}
    return names, any(v.kind is inspect.Parameter.VAR_KEYWORD for v in params.values())


def _import(item: Entry, path: str) -> Any:
    """The object at ``"module:attribute"`` ``path`` of ``item``'s code."""
    module, _, attribute = path.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except Exception as err:
        raise PluginError(
            f"{item.kind} {item.name!r} ({item.origin}): its code {path!r} failed to import: "
            f"{type(err).__name__}: {err}"
        ) from err
    return obj


@functools.cache
def _load(kind: str, name: str) -> Callable[..., Any]:
    item = entry(kind, name)
    if item is None or item.factory is None:
        raise ValueError(
            f"{kind} {name!r} has no code to build it (a built-in data set's builder is a line "
            "of setvalued.registry.BUILTIN_DATASET_BUILDERS)"
        )
    obj = _import(item, item.factory)
    if item.builtin:
        return obj
    try:
        taken, var_keyword = _taken(obj)
    except (TypeError, ValueError) as err:
        raise PluginError(f"{kind} {name!r} ({item.origin}): {item.factory!r} is not callable: {err}") from None
    needed = {"dataset": ("seed",), "model": ("input_shape",)}.get(kind, ())
    missing = [p for p in (*item.parameters, *needed) if p not in taken and not var_keyword]
    if missing:
        raise PluginError(
            f"{kind} {name!r} ({item.origin}): declares parameter(s) {', '.join(missing)} that "
            f"{item.factory} does not take (it takes {', '.join(sorted(taken)) or 'none'})"
        )
    return obj


def plugin_parameters(item: Entry, section: Mapping[str, Any], builtin_defaults: Mapping[str, Any]) -> dict[str, Any]:
    """A plugin data set's or model's declared parameters from its config ``section``, checked
    against its declaration; any other key is refused by its dotted path, except a built-in
    field at its default (what a default config holds), which is not passed."""
    from setvalued.config import reject_unknown_keys
    from setvalued.params import ParameterError, check_parameters

    name = SECTIONS[item.kind]
    fields = section_fields(item.kind, item.name) or {}
    extra = {k: v for k, v in section.items() if k not in fields}
    reject_unknown_keys(
        name, {k: v for k, v in extra.items() if k not in builtin_defaults or v != builtin_defaults[k]}, fields
    )
    label = {"dataset": "data set", "model": "model"}[item.kind]
    try:
        return check_parameters(
            item.parameters, {k: v for k, v in section.items() if k in item.parameters}, owner=f"{label} {item.name!r}"
        )
    except ParameterError as err:
        raise ValueError(str(err)) from None


def load_factory(kind: str, name: str) -> Callable[..., Any]:
    """The code of a registered entry, imported on first use and checked against its declared
    parameters (:class:`PluginError` naming the distribution and entry point otherwise)."""
    return _load(kind, name)


def run_check(item: Entry, parameters: Mapping[str, Any]) -> str | None:
    """What a plugin data set's preflight (``Declaration.check``) finds wrong with its data for
    ``parameters``, or None (also when it declares none); its code failing to import is a
    :class:`PluginError`."""
    if item.check is None:
        return None
    check = _import(item, item.check)
    try:
        check(**parameters)
    except (ValueError, OSError) as err:
        return str(err) or type(err).__name__
    return None


# ---------------------------------------------------------------------------------------------
# provenance: which plugins a config uses, and where they come from
# ---------------------------------------------------------------------------------------------


def plugins_of_config(config: Mapping[str, Any]) -> list[Entry]:
    """The plugin entries a (validated) trial config names, in kind order."""
    used = []
    for kind, section in SECTIONS.items():
        part = config.get(section)
        item = entry(kind, part.get("name")) if isinstance(part, Mapping) else None
        if item is not None and not item.builtin:
            used.append(item)
    return used


def plugin_sections(config: Mapping[str, Any]) -> list[str]:
    """The sections of a (validated) trial config that name a plugin (``data``, ``model``, ``loss``)."""
    return [SECTIONS[item.kind] for item in plugins_of_config(config)]


def plugin_distributions(configs: Any) -> dict[str, str]:
    """``{distribution: version}`` of the plugins the configs use, sorted by name."""
    found: dict[str, str] = {}
    for config in configs:
        for item in plugins_of_config(config):
            found[str(item.distribution)] = str(item.version)
    return dict(sorted(found.items()))


@dataclass(frozen=True)
class Source:
    """Where an installed distribution comes from: a local folder (``path``; ``editable`` for
    ``pip install -e``) or an index (``path`` None)."""

    name: str
    version: str
    path: str | None = None
    editable: bool = False
    top_level: tuple[str, ...] = field(default=())
    #: the URL it was installed from when that is neither a local folder nor an index (VCS, archive)
    url: str | None = None


def distribution_source(name: str) -> Source:
    """The origin of an installed distribution, from its ``direct_url.json`` (PEP 610): a
    ``file://`` URL is a local folder; no such file is an installation from an index."""
    dist = importlib.metadata.distribution(name)
    path, editable, other = None, False, None
    text = dist.read_text("direct_url.json")
    if text:
        try:
            info = json.loads(text)
        except ValueError:
            info = {}
        url = info.get("url", "") if isinstance(info, dict) else ""
        if url.startswith("file://") and isinstance(info.get("dir_info"), dict):
            from urllib.parse import unquote, urlsplit

            path = unquote(urlsplit(url).path)
            editable = bool(info["dir_info"].get("editable"))
        elif url:
            other = url
    modules = set()
    for point in dist.entry_points:
        if point.group in GROUPS.values():
            modules.add(point.value.split(":")[0].split(".")[0])
    return Source(dist.metadata["Name"], dist.version, path, editable, tuple(sorted(modules)), other)
