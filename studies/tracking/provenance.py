"""What trained a cell, in MLflow: its identity, its data set, its environment; the study's
environment manifest and the finished cells kept knowingly (issue 39; docs/guarantees.md).

A cell's identity (`cell_identity`) is ``{item: [digest, label]}`` over three kinds of item,
each from `setvalued.provenance`:

- ``code``: the training core (the ``setvalued`` package: version, git commit, a digest of its
  files); a change of the runner or the report (``studies``, ``analysis``) is no change;
- ``plugin <distribution>``: each plugin distribution its config names (version; a digest of its
  files for a local or editable install);
- ``data``: the data it read (a digest of the files under ``data.root``, or a generated set's
  parameters), computed by the driver before the first trial (`TrackingContext.data`).

Worker side: `CellRun.open` tags a new run with `provenance_tags` (`TAG_IDENTITY`, `TAG_CODE`)
in its creation request and logs its data set as an MLflow dataset input (name, digest, source,
schema: `log_data_input`); `CellRun.finish` adds `environment_tags` (the worker's host, torch,
CUDA, GPU...) to its final request. Driver side: `environment_manifest` and `KeptCells` go to
the parent run (`ParentRecord`).
"""

from __future__ import annotations

import functools
import getpass
import json
import os
import platform
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analysis.layout import ENVIRONMENT_ARTIFACT, TAG_ARRAY, TAG_CODE, TAG_ENVIRONMENT, TAG_IDENTITY, TAG_KEPT
from studies.tracking.retry import with_retry

#: an identity's item names
CODE_ITEM = "code"
DATA_ITEM = "data"
PLUGIN_ITEM = "plugin "
#: what an item of a run recorded before identities were (or a missing item) reads as
NOT_RECORDED = "(not recorded)"
#: the environment variables that change what a trial computes or how reproducibly
DETERMINISM_VARIABLES = (
    "CUBLAS_WORKSPACE_CONFIG",
    "CUDA_LAUNCH_BLOCKING",
    "PYTHONHASHSEED",
    "ATEN_CPU_CAPABILITY",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_CUDNN_V8_API_DISABLED",
)
#: how setvalued trains, as far as reproducibility goes (setvalued.training)
TRAINER_DETERMINISM = {
    "seeds": "python, numpy and torch seeded from the trial seed; data splits and synthetic data from "
    "data.split_seed; shuffling and augmentation from the trial seed and the epoch",
    "cudnn.benchmark": "on for CUDA trials: convolution algorithms chosen by timing (not bitwise reproducible)",
    "deterministic algorithms": "torch's default (off)",
}
#: the largest manifest read back (bytes)
MAX_MANIFEST_BYTES = 4 * 2**20


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


# ----------------------------------------------------------------------------- a cell's identity


def data_fingerprints(context_data: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """The driver's data fingerprints by data key (`TrackingContext.data`)."""
    from setvalued.provenance import DataFingerprint

    return {key: DataFingerprint.from_json(json.loads(text)) for key, text in context_data}


def data_of(data_config: Mapping[str, Any], known: Mapping[str, Any]):
    """The fingerprint of a cell's data: the driver's, else computed here (a config asked by
    an optuna sampler); None when its files cannot be read (the trial will say why)."""
    from setvalued.provenance import data_fingerprint, data_key

    found = known.get(data_key(data_config))
    if found is not None:
        return found
    try:
        return data_fingerprint(data_config)
    except (OSError, ValueError):
        return None


def cell_identity(config: Mapping[str, Any], data: Any = None) -> dict[str, list[str]]:
    """``{item: [digest, label]}`` of a trial config (module docstring); ``data``: its data's
    fingerprint (`setvalued.provenance.DataFingerprint`), None when it is not known."""
    from setvalued import registry
    from setvalued.provenance import plugin_fingerprint, setvalued_fingerprint

    code = setvalued_fingerprint()
    items = {CODE_ITEM: [code.digest, code.label]}
    for distribution in registry.plugin_distributions([config]):
        plugin = plugin_fingerprint(distribution)
        items[PLUGIN_ITEM + distribution] = [plugin.digest, plugin.label]
    if data is not None:
        items[DATA_ITEM] = [data.digest, data.label]
    return items


def read_identity(tags: Mapping[str, str]) -> dict[str, list[str]]:
    """A run's recorded identity ({} when it has none, or not one this code wrote)."""
    try:
        found = json.loads(tags.get(TAG_IDENTITY) or "{}")
    except ValueError:
        return {}
    if not isinstance(found, dict):
        return {}
    return {
        str(k): [str(v[0]), str(v[1])]
        for k, v in found.items()
        if isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v)
    }


def identity_tags(identity: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """The tags of an identity: the whole (`TAG_IDENTITY`) and its code's label (`TAG_CODE`)."""
    tags = {TAG_IDENTITY: _canonical({k: list(v) for k, v in identity.items()})}
    if CODE_ITEM in identity:
        tags[TAG_CODE] = identity[CODE_ITEM][1]
    return tags


@dataclass
class CellProvenance:
    """What a worker records of its cell when it opens the cell's run."""

    identity: dict[str, list[str]]
    data: Any = None  # its DataFingerprint, None when unknown

    @classmethod
    def of(cls, cell: Mapping[str, Any], context_data: Sequence[tuple[str, str]]) -> CellProvenance:
        config = cell["config"]
        data = data_of(config.get("data") or {}, data_fingerprints(context_data))
        return cls(cell_identity(config, data), data)

    @property
    def tags(self) -> dict[str, str]:
        return identity_tags(self.identity)

    def log_data_input(self, client: Any, run_id: str) -> None:
        """The data set as the run's MLflow dataset input (one request; MLflow keeps one copy
        of a data set per experiment, however many runs name it)."""
        if self.data is not None:
            log_data_input(client, run_id, self.data)


def dataset_input(data: Any):
    """An MLflow `DatasetInput` of a data fingerprint: a `MetaDataset` (no data copied) with its
    name, digest, source (the root folder, or the generating code and its parameters) and
    schema (tensor specs of x and y)."""
    import numpy as np
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource  # type: ignore[attr-defined]  # made at import
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.types import Schema, TensorSpec
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    if data.files:
        source = LocalArtifactDatasetSource(data.source)
        name = f"{data.name}:{os.path.basename(data.source.rstrip(os.sep)) or data.source}"
    else:
        source = CodeDatasetSource({"generator": data.source, "parameters": _canonical(data.parameters)})
        name = data.name
    specs: list[Any] = [
        TensorSpec(np.dtype(spec["dtype"]), tuple(spec["shape"]), key) for key, spec in data.schema.items()
    ]
    schema = Schema(specs) if specs else None
    # MLflow's own class, built as its docs build it (its stubs mark `profile` abstract)
    dataset = MetaDataset(source, name=name, digest=data.digest, schema=schema)  # type: ignore[abstract]
    return DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, "train, val, test")])


#: what a SQL store answers when two runs log the same new data set at once (SQLite, PostgreSQL)
_DUPLICATE_SIGNS = ("unique constraint", "duplicate key")


def log_data_input(client: Any, run_id: str, data: Any) -> None:
    """Log `data` as the run's dataset input (`log_data_inputs`)."""
    log_data_inputs(client, run_id, [data])


def log_data_inputs(client: Any, run_id: str, fingerprints: Sequence[Any]) -> None:
    """Log data fingerprints as the run's dataset inputs, in one request.

    MLflow keeps one row per (experiment, name, digest) and inserts it when it finds none:
    runs logging the same new data set at once race to insert it, and the losers' inserts are
    refused with a unique-constraint error (their transaction rolled back). The driver logs a
    study's data sets on its parent run before any cell starts (`StudyTracking`), so cells
    find the rows; a cell that still loses such a race (a data set the driver did not know: an
    optuna proposal's) tries again, which links the row that now exists."""
    entities = [dataset_input(data) for data in fingerprints]
    if not entities:
        return
    for attempt in range(3):
        try:
            with_retry(lambda: client.log_inputs(run_id, datasets=entities))
            return
        except Exception as error:  # MlflowException of the store's IntegrityError
            if attempt == 2 or not any(sign in str(error).lower() for sign in _DUPLICATE_SIGNS):
                raise


def array_tag(members: Sequence[Mapping[str, Any]], cell: Mapping[str, Any]) -> dict[str, str]:
    """`TAG_ARRAY` of a fused array's member: the array's trial (its first cell and size, as
    `studies.cells.arrays.array_id` names it), its members' seeds and this cell's place."""
    ids = [m["cell_id"] for m in members]
    array = f"{ids[0]}-x{len(ids)}" if len(ids) > 1 else ids[0]
    seeds = [int(m["seed"]) for m in members]
    return {TAG_ARRAY: _canonical({"array": array, "seeds": seeds, "member": ids.index(cell["cell_id"])})}


# ----------------------------------------------------------------------------- environments


def _nvidia_driver() -> str | None:
    """The NVIDIA kernel driver's version (from /proc: no CUDA context made)."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text(errors="replace")
    except OSError:
        return None
    for word in text.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return None


def _nvidia_gpus() -> list[str]:
    """The models of this host's NVIDIA GPUs (from /proc)."""
    models = []
    root = Path("/proc/driver/nvidia/gpus")
    try:
        folders = sorted(root.iterdir())
    except OSError:
        return []
    for folder in folders:
        try:
            for line in (folder / "information").read_text(errors="replace").splitlines():
                if line.startswith("Model:"):
                    models.append(line.split(":", 1)[1].strip())
        except OSError:
            continue
    return models


def environment_tags(device: str | None = None) -> dict[str, str]:
    """`TAG_ENVIRONMENT` of a cell that just finished in this process: host, Python, and of torch
    (when loaded) its version, CUDA, cuDNN, the GPU of ``device`` and the driver, and the flags
    that decide reproducibility."""
    env: dict[str, Any] = {"host": socket.gethostname(), "python": platform.python_version()}
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = str(torch.__version__)
        env["cuda"] = getattr(torch.version, "cuda", None)
        try:
            env["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
            env["cudnn_benchmark"] = bool(torch.backends.cudnn.benchmark)
            env["deterministic_algorithms"] = bool(torch.are_deterministic_algorithms_enabled())
            env["tf32"] = {
                "matmul": bool(torch.backends.cuda.matmul.allow_tf32),
                "cudnn": bool(torch.backends.cudnn.allow_tf32),
            }
            if device and str(device).startswith("cuda") and torch.cuda.is_available():
                env["gpu"] = torch.cuda.get_device_name(torch.device(device))
        except Exception:  # noqa: BLE001 (a backend that cannot answer: recorded without it)
            pass
    if device:
        env["device"] = str(device)
    driver = _nvidia_driver()
    if driver:
        env["driver"] = driver
    return {TAG_ENVIRONMENT: _canonical({k: v for k, v in env.items() if v is not None})}


def _torch_build() -> dict[str, Any]:
    """torch's version and CUDA from its installed files (its version.py read as text, not
    imported: the driver does not load torch)."""
    import ast
    import importlib.util

    found: dict[str, Any] = {}
    try:
        found["version"] = __import__("importlib.metadata").metadata.version("torch")
        spec = importlib.util.find_spec("torch")
    except Exception:  # noqa: BLE001 (torch not installed)
        return found
    if spec is None or not spec.submodule_search_locations:
        return found
    try:
        tree = ast.parse(Path(list(spec.submodule_search_locations)[0], "version.py").read_text())
    except (OSError, SyntaxError):
        return found
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id in ("cuda", "git_version", "hip") and value is not None:
            try:
                found[target.id] = ast.literal_eval(value)
            except ValueError:
                continue
    return found


@functools.cache
def _distributions() -> dict[str, str]:
    """Every installed distribution and its version, by the names of the ``*.dist-info`` folders
    on ``sys.path`` (PEP 427's ``name-version``, name normalised; the first on the path wins,
    as for imports): a listing per folder, where reading every METADATA takes 0.1-0.2 s."""
    found: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.endswith(".dist-info"):
                project, _, version = name[: -len(".dist-info")].partition("-")
                found.setdefault(project.lower().replace("-", "_").replace(".", "_"), version)
    return dict(sorted(found.items()))


def environment_manifest(session_id: str = "") -> dict[str, Any]:
    """The driver's environment (the parent run's `ENVIRONMENT_ARTIFACT`): host, platform,
    Python, torch and its CUDA, cuDNN, GPUs and driver, Ray, MLflow, the training core's code,
    every installed distribution with its version, and the settings that decide reproducibility
    (environment variables, the trainer's seeding and cuDNN policy). No torch is imported."""
    from setvalued.provenance import setvalued_fingerprint

    distributions = _distributions()
    cudnn = {name: v for name, v in distributions.items() if name.startswith("nvidia_cudnn")}
    return {
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "session": session_id,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _torch_build(),
        "cudnn": cudnn,
        "gpus": _nvidia_gpus(),
        "driver": _nvidia_driver(),
        "ray": distributions.get("ray"),
        "mlflow": distributions.get("mlflow"),
        "setvalued": setvalued_fingerprint().label,
        "determinism": {
            "trainer": TRAINER_DETERMINISM,
            "environment": {key: os.environ[key] for key in DETERMINISM_VARIABLES if key in os.environ},
        },
        "distributions": distributions,
    }


# ----------------------------------------------------------------------------- finished cells kept


@dataclass
class KeptCells:
    """Finished cells kept knowingly although what trains them changed (``--keep-finished``):
    for each item, the recorded digests accepted as today's, and the decisions taken (the
    parent run's `TAG_KEPT`)."""

    accepted: dict[str, dict[str, str]] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)

    #: decisions kept in the tag (all of them go to the parent run's artifacts)
    MAX_DECISIONS = 10

    @classmethod
    def read(cls, tags: Mapping[str, str]) -> KeptCells:
        try:
            data = json.loads(tags.get(TAG_KEPT) or "{}")
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}
        accepted = data["accepted"] if isinstance(data.get("accepted"), dict) else {}
        decisions = data["decisions"] if isinstance(data.get("decisions"), list) else []
        return cls(
            {str(k): {str(a): str(b) for a, b in v.items()} for k, v in accepted.items() if isinstance(v, dict)},
            [d for d in decisions if isinstance(d, dict)],
        )

    def accepts(self, item: str, recorded: str | None, today: str) -> bool:
        """Whether a cell recorded with ``recorded`` (None: not recorded) counts as ``today``."""
        return recorded == today or self.accepted.get(item, {}).get(recorded or NOT_RECORDED) == today

    def keep(self, changes: Sequence[tuple[str, str | None, str]], described: Sequence[str], cells: int) -> dict:
        """Accept ``changes`` (item, recorded digest, today's) for ``cells`` cells; the decision."""
        for item, recorded, today in changes:
            self.accepted.setdefault(item, {})[recorded or NOT_RECORDED] = today
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = "?"
        decision = {
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "user": user,
            "host": socket.gethostname(),
            "cells": cells,
            "changes": list(described),
        }
        self.decisions = [*self.decisions, decision]
        return decision

    def tag(self) -> str:
        return _canonical({"accepted": self.accepted, "decisions": self.decisions[-self.MAX_DECISIONS :]})


@dataclass
class ParentRecord:
    """What the driver adds to the study's parent run when it runs (`StudyTracking.parent_run_id`):
    its environment manifest, and the finished cells it keeps knowingly."""

    session_id: str = ""
    kept: KeptCells | None = None
    decision: dict | None = None  # this run's decision to keep cells, if any
    _manifest: dict = field(default_factory=dict)
    _thread: threading.Thread | None = None

    def start(self) -> ParentRecord:
        """Gather the manifest in the background (0.1-0.2 s of reading installed metadata) while
        Ray starts; `write` waits for it."""

        def gather() -> None:
            self._manifest.update(environment_manifest(self.session_id))

        self._thread = threading.Thread(target=gather, name="studies-manifest", daemon=True)
        self._thread.start()
        return self

    def __getstate__(self) -> dict:  # what refers to the tracking travels to Tune without the thread
        return {**self.__dict__, "_thread": None}

    def manifest(self) -> dict:
        if self._thread is None:
            self.start()
        assert self._thread is not None
        self._thread.join()
        return self._manifest

    def write(self, client: Any, run_id: str) -> None:
        with tempfile.TemporaryDirectory(prefix="studies-provenance-") as folder:
            manifest = Path(folder) / ENVIRONMENT_ARTIFACT
            manifest.write_text(json.dumps(self.manifest(), indent=1, default=str))
            with_retry(lambda: client.log_artifact(run_id, str(manifest)))
            kept = self.kept
            if kept is not None and self.decision is not None:
                with_retry(lambda: client.set_tag(run_id, TAG_KEPT, kept.tag()))
                record = Path(folder) / f"kept-{time.strftime('%Y%m%d-%H%M%S')}.json"
                record.write_text(json.dumps(self.decision, indent=1))
                with_retry(lambda: client.log_artifact(run_id, str(record), "identity"))
