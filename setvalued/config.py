"""The trial config: every section's fields, declared once with their defaults and ranges.

A trial config is a nested dict (docs/interfaces.md section 1, whose table is generated from
these declarations and checked by a test). The trainer (``setvalued.training.resolve_config``),
the data and model builders and the study-file validation (``studies.studyfile.trial_config``) all read
the declarations below; none keeps a copy of a default. Pure Python: no torch.

The ``data`` fields depend on the data set (``DATA_FIELDS[name]``); a section may also have
rules over several fields (``SECTION_RULES``), each a function returning why the section is
wrong, or None.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from setvalued.params import Param

__all__ = [
    "DATASET_NAMES",
    "DATA_FIELDS",
    "DATA_DEFAULTS",
    "MODEL_FIELDS",
    "MODEL_DEFAULTS",
    "BUILTIN_MODELS",
    "HEADS",
    "OPTIM_FIELDS",
    "EVAL_FIELDS",
    "TOP_FIELDS",
    "DEFAULT_LOSS",
    "SECTION_RULES",
    "KNOWN_NUM_CLASSES",
    "FIELD_APPLIES",
    "CONFORMAL_SCORES",
    "CONFORMAL_MONDRIAN",
    "conformal_enabled",
    "default_config",
    "effective_config",
    "reject_unknown_keys",
    "PLACEMENTS",
    "DEVICE_DATASETS",
    "DATA_COMMON",
    "COMPILE_MODES",
    "placement_problem",
    "held_out_problem",
]

DATASET_NAMES = ("synthetic", "cifar100", "plantnet300k", "imagenet_lt", "image_folder", "arrays")
#: number of classes of the real data sets (training split), to check K < L before training
KNOWN_NUM_CLASSES = {"cifar100": 100, "plantnet300k": 1081, "imagenet_lt": 1000}
BUILTIN_MODELS = ("mlp", "small_cnn", "densenet_bc_cifar", "densenet_cifar")
HEADS = ("linear", "normed", "two_head")


def _pretrained(value: Any) -> Any:
    """``false`` (or null) or the path of a local weights file."""
    if value is None or value is False:
        return False
    if isinstance(value, str) and value.strip():
        return value
    raise ValueError("false or the path of a local weights file")


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------

#: where the training batches are made (``data.placement``)
PLACEMENTS = ("auto", "device", "loader")

_DATA_COMMON = {
    "name": Param("str", "synthetic", "the data set (or a plugin's: docs/plugins.md)", options=DATASET_NAMES),
    "root": Param(
        "str",
        None,
        "folder of a real data set (official layout; arrays: a .npz file or a folder of them)",
        nullable=True,
    ),
    "num_workers": Param("int", 0, "data-loading worker processes", low=0),
    "placement": Param(
        "str",
        "auto",
        "device: the in-memory sets (cifar100, synthetic, image_folder, "
        "arrays) held on the training device and augmented there a batch at a time, no "
        "loader workers; loader: a DataLoader with per-image transforms in num_workers "
        "processes; auto: device when num_workers is 0, else loader",
        options=PLACEMENTS,
        implicit=True,
    ),
}
#: the fields every data set has (a plugin data set gets num_workers and placement)
DATA_COMMON = _DATA_COMMON
#: the data sets that ``data.placement: device`` can hold on the training device (in memory)
DEVICE_DATASETS = ("synthetic", "cifar100", "image_folder", "arrays")
_SPLIT_SEED = Param("int", 1234, "seeds the validation split (synthetic: the data), not the trial seed", low=0)
#: the shares of the training files held out when a data set has no val / test of its own
_HELD_OUT = {
    "val_fraction": Param(
        "float",
        0.1,
        "share of each training class held out for validation when there "
        "is no val split (seeded by split_seed, stratified)",
        low=0.0,
        high=1.0,
        low_open=True,
        high_open=True,
    ),
    "test_fraction": Param(
        "float",
        0.1,
        "share of each training class held out for testing when there is "
        "no test split (seeded by split_seed, stratified)",
        low=0.0,
        high=1.0,
        low_open=True,
        high_open=True,
    ),
    "split_seed": _SPLIT_SEED,
}
#: a folder of class subfolders (setvalued.data.image_folder; docs/study-file.md)
IMAGE_FOLDER_FIELDS = {
    **_DATA_COMMON,
    "image_size": Param(
        "int",
        None,
        "side of the square images trained on (resized, then centre-cropped); "
        "null: the images' own size (all of one size)",
        low=1,
        nullable=True,
    ),
    "augmentation": Param(
        "str",
        "none",
        "training augmentation: none, crop_flip (the CIFAR protocol: "
        "random crop after zero-padding by size/8, horizontal flip) or crop (no flip, as "
        "Pl@ntNet-300K)",
        options=("none", "crop_flip", "crop"),
    ),
    **_HELD_OUT,
}
#: NumPy arrays x, y in .npz files (setvalued.data.arrays; docs/study-file.md)
ARRAYS_FIELDS = {
    **_DATA_COMMON,
    "layout": Param(
        "str", "auto", "axes of 4-d x: nchw, nhwc, or auto (the axis of size 1 or 3)", options=("auto", "nchw", "nhwc")
    ),
    "num_classes": Param(
        "int",
        None,
        "number of classes L (labels 0..L-1); null: the largest training label + 1",
        low=2,
        high=1_000_000,
        nullable=True,
    ),
    "normalize": Param(
        "bool",
        True,
        "standardise x per channel (images) or per feature (vectors) with the training split's mean and std",
    ),
    **_HELD_OUT,
}

DATA_FIELDS: dict[str, dict[str, Param]] = {
    "synthetic": {
        **_DATA_COMMON,
        "num_classes": Param("int", 40, "number of classes", low=2),
        "num_superclasses": Param("int", 8, "groups of similar classes (the ambiguity)", low=1),
        "train_size": Param("int", 2000, "training examples, Pareto-distributed over the classes", low=1),
        "val_size": Param("int", 500, "validation examples", low=1),
        "test_size": Param("int", 1000, "test examples", low=1),
        "pareto_shape": Param("float", 1.2, "shape of the long tail (smaller: longer tail)", low=0.0, low_open=True),
        "form": Param("str", "features", "features (vectors) or images (3x32x32)", options=("features", "images")),
        "feature_dim": Param("int", 32, "length of a feature vector", low=1),
        "split_seed": _SPLIT_SEED,
        "max_labels": Param(
            "int",
            1,
            "1: one class per example; > 1: multi-label, each example has 1 to "
            "max_labels classes (multi-hot targets, for the multi-label losses)",
            low=1,
            implicit=True,
        ),
    },
    "cifar100": {
        **_DATA_COMMON,
        "download": Param("bool", False, "download when the folder is missing (only when asked)"),
        "val_size": Param("int", 5000, "training images held out for validation", low=1, high=49999),
        "label_noise": Param(
            "float", 0.0, "probability of resampling a training label in its group of 5", low=0.0, high=1.0
        ),
        "noise_groups": Param(
            "str",
            "consecutive",
            "consecutive (the authors' code) or coarse (true superclasses)",
            options=("consecutive", "coarse"),
        ),
        "split_seed": _SPLIT_SEED,
        "stratified_split": Param("bool", False, "hold out the same number of images of every class"),
    },
    "plantnet300k": dict(_DATA_COMMON),
    "imagenet_lt": dict(_DATA_COMMON),
    "image_folder": IMAGE_FOLDER_FIELDS,
    "arrays": ARRAYS_FIELDS,
}


def _union_defaults(schemas: Iterable[Mapping[str, Param]]) -> dict[str, Any]:
    """Every field of any data set with its default; None where the data sets disagree
    (the builder then takes the data set's own default)."""
    out: dict[str, Any] = {}
    for fields in schemas:
        for key, param in fields.items():
            if key in out and out[key] != param.default:
                out[key] = None
            else:
                out.setdefault(key, param.default)
    return out


#: every key a ``data`` section may hold, with its default (None: the data set's own)
DATA_DEFAULTS: dict[str, Any] = _union_defaults(DATA_FIELDS.values())


# --------------------------------------------------------------------------------------------
# model, optim, eval, top level
# --------------------------------------------------------------------------------------------

MODEL_FIELDS: dict[str, Param] = {
    "name": Param(
        "str", "mlp", f"{', '.join(BUILTIN_MODELS)}, a plugin's model (docs/plugins.md) or a timm architecture name"
    ),
    "pretrained": Param("any", False, "false or the path of a local weights file", rule=_pretrained),
    "head": Param("str", "auto", "auto (what the loss needs), linear, normed or two_head", options=("auto",) + HEADS),
    "hidden_dim": Param("int", 128, "mlp / small_cnn width", low=1),
    "depth": Param("int", 40, "densenet_bc_cifar: 6n + 4; densenet_cifar: 3n + 4", low=4),
    "growth_rate": Param("int", 40, "densenet_bc_cifar and densenet_cifar (12 for a DenseNet 40-12)", low=1),
}
MODEL_DEFAULTS: dict[str, Any] = {key: p.default for key, p in MODEL_FIELDS.items()}

OPTIM_FIELDS: dict[str, Param] = {
    "lr": Param("float", 0.1, "learning rate", low=0.0, low_open=True),
    "momentum": Param("float", 0.9, "SGD momentum", low=0.0, high=1.0, high_open=True),
    "nesterov": Param("bool", True, "Nesterov momentum"),
    "weight_decay": Param("float", 0.0001, "L2 weight decay (not on the loss's own parameters)", low=0.0),
    "batch_size": Param("int", 64, "training batch size", low=1),
    "milestones": Param("list", [150, 225], "0-indexed epochs at whose start lr *= gamma", item=Param("int", low=0)),
    "gamma": Param("float", 0.1, "learning-rate decay factor", low=0.0, low_open=True),
}

EVAL_FIELDS: dict[str, Param] = {
    "ks": Param(
        "list", [1, 3, 5, 10], "top-K metrics computed every epoch", item=Param("int", low=1), length=(1, None)
    ),
    "avgk": Param(
        "list", [], "K values of the average-K metrics (threshold calibrated on val)", item=Param("int", low=1)
    ),
    "avgk_activation": Param(
        "str", "softmax", "what the average-K threshold is applied to", options=("softmax", "sigmoid")
    ),
    "shot_thresholds": Param(
        "list",
        [20, 100],
        "few < first <= medium <= second < many (training images)",
        item=Param("int", low=0),
        length=(2, 2),
    ),
    "count_bins": Param(
        "list",
        [],
        "increasing edges of bins of classes by training images: mean per-class "
        "accuracy per bin, count_<low>_<high> metrics (low < n <= high; [Gar23] Table 3.1: "
        "[10, 50, 500, 2000])",
        item=Param("int", low=1),
        implicit=True,
    ),
    "selection": Param("str", "val/top5", "validation metric that picks the checkpoint"),
    "selection_mode": Param("str", "max", "max or min", options=("max", "min")),
    "batch_size": Param(
        "int",
        128,
        "batch size of the validation and test passes (the scores do not depend "
        "on it; 128: what was used before, fastest on the CPU; docs/interfaces.md)",
        low=1,
        implicit=True,
    ),
}


# the split-conformal baselines ([Gar23] §2.2.2; setvalued.metrics.conformal), evaluated on the test set
# of the selected checkpoint; declared apart from the fields above, all implicit (a config holds
# them only when they differ from their defaults, so adding them changed no config_id)

#: conformal non-conformity scores, and the calibration groups (marginal, Mondrian per class or
#: per shot group)
CONFORMAL_SCORES = ("lac", "aps")
CONFORMAL_MONDRIAN = ("marginal", "class", "shot")

EVAL_FIELDS.update(
    {
        "conformal_alphas": Param(
            "list",
            [],
            "miscoverage levels alpha of the conformal sets evaluated on test ([] none)",
            item=Param("float", low=0.0, high=1.0, low_open=True, high_open=True),
            implicit=True,
        ),
        "conformal_match_avgk": Param(
            "bool",
            False,
            "also calibrate every conformal method to the mean set size of each eval.avgk K (compared at equal size)",
            implicit=True,
        ),
        "conformal_scores": Param(
            "list",
            list(CONFORMAL_SCORES),
            "the non-conformity scores of the conformal methods",
            item=Param("str", options=CONFORMAL_SCORES),
            length=(1, None),
            implicit=True,
        ),
        "conformal_mondrian": Param(
            "list",
            ["marginal", "class"],
            "calibration groups of the conformal methods (class and shot: Mondrian)",
            item=Param("str", options=CONFORMAL_MONDRIAN),
            length=(1, None),
            implicit=True,
        ),
        "conformal_calibration_fraction": Param(
            "float",
            0.5,
            "share of the validation set held out (labelled) "
            "to calibrate conformal sets; the rest selects and calibrates "
            "average-K",
            low=0.0,
            high=1.0,
            low_open=True,
            high_open=True,
            implicit=True,
        ),
    }
)


def conformal_enabled(ev: Mapping[str, Any]) -> bool:
    """Whether an eval section asks for conformal sets (at a level, or matched to average-K)."""
    return bool(ev.get("conformal_alphas")) or bool(ev.get("conformal_match_avgk"))


def _device(value: Any) -> Any:
    if value in ("auto", "cpu", "cuda") or (
        isinstance(value, str) and value.startswith("cuda:") and value[5:].isdigit()
    ):
        return value
    raise ValueError("auto, cpu, cuda or cuda:<index>")


#: ``compile``: eager, or the model and the loss under ``torch.compile`` (setvalued.training.compiled_step)
COMPILE_MODES = ("none", "model")

TOP_FIELDS: dict[str, Param] = {
    "epochs": Param("int", 300, "training epochs", low=1),
    "device": Param("str", "auto", "auto, cpu, cuda or cuda:<index>", rule=_device),
    "amp": Param("bool", True, "mixed precision on CUDA (the loss stays in float32)"),
    "compile": Param(
        "str",
        "none",
        "none (eager) or model: the model's forward and the loss under "
        "torch.compile as one training function, on CUDA with CUDA graphs (mode reduce-overhead); "
        "the default and why: docs/interfaces.md",
        options=COMPILE_MODES,
        implicit=True,
    ),
}

#: the loss of a config without a ``loss`` section (its keys are the loss's parameters)
DEFAULT_LOSS: dict[str, Any] = {"name": "noised_topk", "k": 5, "epsilon": 0.2, "n_samples": 10}


# --------------------------------------------------------------------------------------------
# rules over several fields of a section
# --------------------------------------------------------------------------------------------


def _synthetic_superclasses(data: Mapping[str, Any]) -> str | None:
    if data.get("name") == "synthetic" and data["num_superclasses"] > data["num_classes"]:
        return f"num_superclasses ({data['num_superclasses']}) must not exceed num_classes ({data['num_classes']})"
    return None


#: the CIFAR DenseNets and the n of their depth = layers_per_block * n + 4 (BC: two convolutions a layer)
_DENSENET_DEPTH_STEP = {"densenet_bc_cifar": 6, "densenet_cifar": 3}


def _densenet_shape(model: Mapping[str, Any]) -> str | None:
    step = _DENSENET_DEPTH_STEP.get(model["name"])
    if step is not None:
        if (model["depth"] - 4) % step:
            return f"model.depth of {model['name']} must be {step}n + 4 (40, 100, ...), got {model['depth']}"
    elif (model["depth"], model["growth_rate"]) != (MODEL_FIELDS["depth"].default, MODEL_FIELDS["growth_rate"].default):
        return (
            f"model.depth and model.growth_rate apply to {' and '.join(_DENSENET_DEPTH_STEP)} only, "
            f"not {model['name']!r}"
        )
    return None


def held_out_problem(data: Mapping[str, Any]) -> str | None:
    """Why the held-out shares of image_folder / arrays leave no training split, or None."""
    if data.get("name") in ("image_folder", "arrays") and data["val_fraction"] + data["test_fraction"] >= 1:
        return (
            f"data.val_fraction ({data['val_fraction']}) + data.test_fraction ({data['test_fraction']}) "
            "must be < 1: the rest is the training split"
        )
    return None


def placement_problem(data: Mapping[str, Any]) -> str | None:
    """Why a data section cannot have its ``placement`` (device: in-memory data sets only). A
    plugin's data set is held on the device when its splits are in memory (``TensorSplit``s
    without a per-example transform), which only its built splits tell: the trainer checks it."""
    if (
        data.get("placement") == "device"
        and data.get("name") in DATASET_NAMES
        and data.get("name") not in DEVICE_DATASETS
    ):
        return (
            f"data.placement: device holds in-memory data sets only ({', '.join(DEVICE_DATASETS)}), "
            f"not {data.get('name')!r}; use auto or loader"
        )
    return None


def _nesterov_needs_momentum(optim: Mapping[str, Any]) -> str | None:
    if optim["nesterov"] and optim["momentum"] == 0:
        return "optim.momentum must be > 0 when optim.nesterov is true"
    return None


def _increasing_shot_thresholds(ev: Mapping[str, Any]) -> str | None:
    first, second = ev["shot_thresholds"]
    if first > second:
        return f"expected [few_limit, many_limit] with few_limit <= many_limit, got {ev['shot_thresholds']}"
    return None


def _conformal_settings(ev: Mapping[str, Any]) -> str | None:
    if ev["conformal_match_avgk"] and not ev["avgk"]:
        return "eval.conformal_match_avgk needs the K values of eval.avgk (now empty) to match their set sizes"
    for field in ("conformal_alphas", "conformal_scores", "conformal_mondrian"):
        if len(set(ev[field])) != len(ev[field]):
            return f"eval.{field} lists a value twice: {ev[field]}"
    return None


def _increasing_count_bins(ev: Mapping[str, Any]) -> str | None:
    edges = ev["count_bins"]
    if any(a >= b for a, b in zip(edges, edges[1:])):
        return f"eval.count_bins must be strictly increasing edges such as [10, 50, 500, 2000], got {edges}"
    return None


#: section -> rules over its checked fields (each returns why the section is wrong, or None)
SECTION_RULES: dict[str, tuple[Callable[[Mapping[str, Any]], str | None], ...]] = {
    "data": (_synthetic_superclasses, placement_problem, held_out_problem),
    "model": (_densenet_shape,),
    "optim": (_nesterov_needs_momentum,),
    "eval": (_increasing_shot_thresholds, _increasing_count_bins),
}


SECTION_RULES["eval"] += (_conformal_settings,)


#: (section, field) -> whether the field has an effect on a config, given its section (the
#: whole config for a top-level field, section ""). `effective_config` leaves a field out where
#: it has none: the DenseNet shape of another model, the width of a model that has none, the
#: learning-rate decay without milestones, the average-K activation without average-K, the
#: conformal settings without conformal sets, mixed precision on the CPU
FIELD_APPLIES: dict[tuple[str, str], Callable[[Mapping[str, Any]], bool]] = {
    ("model", "depth"): lambda model: model.get("name") in _DENSENET_DEPTH_STEP,
    ("model", "growth_rate"): lambda model: model.get("name") in _DENSENET_DEPTH_STEP,
    ("model", "hidden_dim"): lambda model: model.get("name") in ("mlp", "small_cnn"),
    ("optim", "gamma"): lambda optim: bool(optim.get("milestones", True)),
    ("eval", "avgk_activation"): lambda ev: bool(ev.get("avgk")),
    **{
        ("eval", field): conformal_enabled
        for field in ("conformal_scores", "conformal_mondrian", "conformal_calibration_fraction")
    },
    ("", "amp"): lambda config: config.get("device") != "cpu",
}


def effective_config(config: Mapping[str, Any], plugin_sections: Iterable[str] = ()) -> dict[str, Any]:
    """A validated config without the fields that have no effect on it (`FIELD_APPLIES`). What
    a run is described by (its MLflow params); the config itself, and its id, keep every
    field. ``plugin_sections``: the sections that name a plugin (``registry.plugin_sections``),
    whose fields are the plugin's own declaration and all apply (a plugin model may declare a
    ``hidden_dim`` or a ``depth`` of its own)."""
    out = {key: dict(value) if isinstance(value, Mapping) else value for key, value in config.items()}
    skip = set(plugin_sections)
    for (section, field), applies in FIELD_APPLIES.items():
        if section in skip:
            continue
        holder = out if section == "" else out.get(section)
        if isinstance(holder, dict) and field in holder and not applies(holder):
            holder.pop(field)
    return out


def default_config() -> dict[str, Any]:
    """A new trial config holding every default (data: the flat union over the data sets)."""
    import copy

    return {
        "data": dict(DATA_DEFAULTS),
        "model": dict(MODEL_DEFAULTS),
        "loss": dict(DEFAULT_LOSS),
        "optim": {key: copy.deepcopy(p.default) for key, p in OPTIM_FIELDS.items()},
        **{key: p.default for key, p in TOP_FIELDS.items() if key == "epochs"},
        "eval": {key: copy.deepcopy(p.default) for key, p in EVAL_FIELDS.items()},
        **{key: p.default for key, p in TOP_FIELDS.items() if key != "epochs"},
    }


def reject_unknown_keys(section: str, given: Mapping[str, Any], known: Iterable[str]) -> None:
    """Raise a ValueError naming every key of ``given`` not in ``known`` by its dotted path.

    ``section`` is the path prefix (``"data"``, ``"model"``...); an empty one names top-level keys.
    """
    known = list(known)
    unknown = sorted(set(given) - set(known))
    if unknown:
        where = f"{section} config" if section else "top-level config"
        paths = ", ".join(f"{section}.{key}" if section else key for key in unknown)
        raise ValueError(f"unknown key(s) in {where}: {paths}; known keys: {', '.join(known)}")
