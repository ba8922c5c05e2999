"""A cell's checkpoints: the folder its trial writes after every epoch, and, in the next
session, finding the ones that a killed driver's trials left.

A checkpoint folder holds `state.pt` (the `setvalued.train.fit` state, `torch.save`d) and
`meta.json`: the cell's MLflow `run_id`, `cell_id`, `study`, `epoch` (0-indexed) and the
`history` of the epochs' metrics. Tune keeps the latest one of each trial under
`<storage>/tune-<session>-<n>/<cell_id>/checkpoint_*/`. Tune restarts a trial whose worker
died from it (`ray.tune.get_checkpoint`); a cell that a killed driver left unfinished
continues from it in the next session (`find_resume_checkpoints`, `ResumePoints`), in the
same MLflow run. The Tune folder is a cache, not the ledger (MLflow is): the runner removes
it once every cell has finished.

torch is imported only to read or write a state.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STATE_FILE = "state.pt"
META_FILE = "meta.json"


def save_checkpoint(folder: Path, state: Any, meta: dict) -> None:
    """Write a checkpoint folder: the fit state and its meta."""
    import torch

    torch.save(state, folder / STATE_FILE)
    (folder / META_FILE).write_text(json.dumps(meta))


def read_checkpoint(folder: str | Path) -> tuple[Any, dict]:
    """(fit state, meta) of a checkpoint folder written by `save_checkpoint`.

    The state is read with ``weights_only=True`` (tensors, numbers, strings, containers) and
    the meta is JSON: a checkpoint planted in a shared storage folder cannot run code when a
    study resumes; it fails to load (the cell then starts from epoch 0, with a message).
    """
    import torch

    from studies.readback import check_regular

    meta = read_meta(folder)
    state_file = Path(folder) / STATE_FILE
    check_regular(state_file, "a checkpoint's state written by torch.save")  # a FIFO would hang
    state = torch.load(state_file, map_location="cpu", weights_only=True)
    return state, meta


def read_meta(folder: str | Path) -> dict:
    """The checked meta.json of a checkpoint folder (studies.readback.ReadBackError when it is
    not a small regular file holding a JSON object of META_FIELDS)."""
    from studies.readback import MAX_META_BYTES, read_json

    return read_json(Path(folder) / META_FILE, MAX_META_BYTES, META_WHAT, META_FIELDS)


def read_tune_checkpoint(checkpoint) -> tuple[Any, dict]:
    """(fit state, meta) of a `ray.tune.Checkpoint` of a folder written by `save_checkpoint`."""
    with checkpoint.as_directory() as folder:
        return read_checkpoint(folder)


#: meta.json's fields and their types, checked before a checkpoint is trusted
META_FIELDS = {"run_id": str, "cell_id": str, "study": str, "epoch": int, "history": list}
META_WHAT = "a checkpoint's metadata written by a trial (a JSON object: run_id, cell_id, study, epoch, history)"


def find_resume_checkpoints(
    storage: Path | None, study_name: str, cell_ids: Iterable[str] | None, refused: list[str] | None = None
) -> dict[str, tuple[Path, dict]]:
    """{cell_id: (checkpoint folder, its meta)}: the latest checkpoint (most epochs) that an
    earlier session's Tune trial of each cell left under `storage` (the Tune storage path,
    None for a URI). Only checkpoints of `study_name` count: a shared storage path holds the
    trials of every study, and a cell id names a config and seed, not a study. `cell_ids`
    None: every cell of the study.

    A trial's folder is named by its cell id, so only the metas of the cells asked for are
    read, each only when it is a small regular file holding a JSON object of META_FIELDS
    (`studies.readback`): a FIFO, a link to a device, a huge or misshapen file is skipped
    (the cell starts from epoch 0) and described in `refused`, never a hang or a crash."""
    from studies.readback import ReadBackError, check_regular

    if storage is None or not storage.is_dir():
        return {}
    wanted = None if cell_ids is None else set(cell_ids)
    if wanted is not None and not wanted:
        return {}
    found: dict[str, tuple[Path, dict]] = {}
    # a cell's own trial: <trial named by the cell>/checkpoint_*/; a fused array's member:
    # <trial of the array>/checkpoint_*/<folder named by the cell>/ (studies.running.array_trial)
    for meta_file in [
        *storage.glob(f"tune-*/*/checkpoint_*/{META_FILE}"),
        *storage.glob(f"tune-*/*/checkpoint_*/*/{META_FILE}"),
    ]:
        folder = meta_file.parent
        named = folder.parent.name if folder.name.startswith("checkpoint_") else folder.name
        if wanted is not None and named not in wanted:
            continue
        try:
            meta = read_meta(meta_file.parent)
            # the driver says the cell continues from here: its state must be there to load
            check_regular(meta_file.parent / STATE_FILE, "a checkpoint's state written by torch.save")
        except FileNotFoundError as missing:
            if refused is not None and missing.filename and missing.filename.endswith(STATE_FILE):
                refused.append(
                    f"{missing.filename}: no such file; expected a checkpoint's state beside its {META_FILE}"
                )
            continue
        except ReadBackError as error:
            if refused is not None:
                refused.append(str(error))
            continue
        cell_id: Any = meta.get("cell_id")
        if meta.get("study") != study_name or "run_id" not in meta or (wanted is not None and cell_id not in wanted):
            continue
        best = found.get(cell_id)
        if best is None or _epoch(meta) > _epoch(best[1]):
            found[cell_id] = (meta_file.parent, meta)
    return found


def _experiment_dir(folder: Path) -> Path:
    """The Tune experiment folder (``tune-*``) above a checkpoint folder (a member's is one
    level deeper than a cell's)."""
    return folder.parent.parent.parent if not folder.name.startswith("checkpoint_") else folder.parent.parent


def _epoch(meta: dict) -> int:
    """The 0-indexed epoch of a checked meta (-1 when it has none)."""
    epoch = meta.get("epoch")
    return epoch if isinstance(epoch, int) else -1


@dataclass
class ResumePoints:
    """The checkpoints that unfinished cells continue from: cell_id -> (folder, meta)."""

    found: dict[str, tuple[Path, dict]] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)  # the metas skipped, each described

    @classmethod
    def search(cls, storage: Path | None, study_name: str, cell_ids: Iterable[str] | None) -> ResumePoints:
        refused: list[str] = []
        return cls(find_resume_checkpoints(storage, study_name, cell_ids, refused), refused)

    def run_ids(self) -> dict[str, str]:
        """cell_id -> the MLflow run each checkpoint continues (the ledger keeps those)."""
        return {cell_id: meta["run_id"] for cell_id, (_, meta) in self.found.items()}

    def only(self, cell_ids: Iterable[str]) -> ResumePoints:
        """The resume points of `cell_ids` (those whose run the ledger kept)."""
        return ResumePoints({cell_id: self.found[cell_id] for cell_id in cell_ids if cell_id in self.found})

    def merged(self, other: ResumePoints) -> ResumePoints:
        """These resume points and `other`'s (other's win for a cell in both)."""
        return ResumePoints({**self.found, **other.found})

    def start_epochs(self) -> dict[str, int]:
        """cell_id -> the epoch its checkpoint holds (a fused array starts its members together)."""
        return {cell_id: int(meta.get("epoch", -1)) for cell_id, (_, meta) in self.found.items()}

    def folders(self) -> dict[str, str]:
        """cell_id -> checkpoint folder (the `resume_from` of the cell's trial)."""
        return {cell_id: str(folder) for cell_id, (folder, _) in self.found.items()}

    def experiment_dirs(self) -> list[Path]:
        """The Tune experiment folders that hold these checkpoints (removed at the end)."""
        return list(dict.fromkeys(_experiment_dir(folder) for folder, _ in self.found.values()))

    def describe(self) -> str | None:
        """One line for the user; None when no cell continues from a checkpoint."""
        if not self.found:
            return None
        epochs = sorted(max(_epoch(meta), 0) + 1 for _, meta in self.found.values())
        span = f"{epochs[0]}" + (f"-{epochs[-1]}" if epochs[-1] != epochs[0] else "")
        return (
            f"{len(self.found)} unfinished cells continue from the checkpoint an earlier run left (after {span} epochs)"
        )
