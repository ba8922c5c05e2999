"""A finished cell is reused only when it is the same experiment (docs/guarantees.md).

Before Ray starts and before anything is written (the study folder, its versions, MLflow),
`check_identity` fingerprints what the study's cells would train with today
(`studies.tracking.provenance.cell_identity`: the training core's code, the plugins each config
names, the data each reads) and compares it with what every finished cell of this version of
the study recorded (`TAG_IDENTITY`). A finished cell whose identity differs is never reused
silently: the run is refused (exit code 2) naming each changed item old -> new with its number
of cells, and the ways forward, unless

- ``--new-version``: the study gets a new version (its cells carry it in their config ids, as
  a changed file's do, `studies.running.versions`), so every cell runs again beside the old
  ones, each version told apart in the report;
- ``--keep-finished``: the finished cells are kept knowingly; the decision (what changed, how
  many cells, who, when) goes on the study's parent run (`TAG_KEPT` and an artifact under
  ``identity/``, one request whatever the number of cells) and into the report, and later runs
  accept those cells' recorded digests as today's.

A change of the runner or the report (``studies``, ``analysis``) changes no cell's identity:
they call the trainer and read what it logged. A run recorded before identities were has none:
it reads as ``(not recorded)`` and is refused the same way (once: ``--keep-finished`` accepts it).
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from studies.errors import RunnerError
from studies.running.versions import StudyVersion, versioned_cells
from studies.studyfile.version import short_version, version_digest
from studies.tracking.provenance import (
    CODE_ITEM,
    DATA_ITEM,
    NOT_RECORDED,
    PLUGIN_ITEM,
    KeptCells,
    ParentRecord,
    cell_identity,
    read_identity,
)

__all__ = ["IdentityCheck", "Difference", "check_identity", "fingerprint_data", "describe_item"]

#: files (or bytes) to read past which the fingerprinting of a data set says what it does
ANNOUNCE_FILES, ANNOUNCE_BYTES = 1_000, 200 * 10**6
#: seconds between two progress lines of a long fingerprinting
PROGRESS_EVERY_S = 10.0
#: the differences listed in a refusal (then how many more)
MAX_LISTED = 12


@dataclass(frozen=True)
class Difference:
    """An item of a finished cell's identity that differs from today's."""

    cell_id: str
    item: str
    old_digest: str | None  # None: not recorded
    old_label: str
    new_digest: str
    new_label: str


@dataclass
class IdentityCheck:
    """What the run goes on with: its version and cells (a new version with ``--new-version``),
    the data fingerprints the trials record, and what the parent run gets."""

    version: StudyVersion
    cells: list
    data: dict[str, Any] = field(default_factory=dict)  # data key -> DataFingerprint
    parent: ParentRecord = field(default_factory=ParentRecord)
    differences: list[Difference] = field(default_factory=list)

    def data_json(self) -> dict[str, str]:
        """The data fingerprints as the trials receive them (`TrackingContext.data`)."""
        return {key: json.dumps(found.to_json(), sort_keys=True) for key, found in self.data.items()}


def describe_item(item: str) -> str:
    if item == CODE_ITEM:
        return "the training code (setvalued)"
    if item == DATA_ITEM:
        return "the data"
    if item.startswith(PLUGIN_ITEM):
        return f"plugin {item[len(PLUGIN_ITEM) :]}"
    return item


# ----------------------------------------------------------------------------- today's identity


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _progress_lines(label: str, say: Callable[[str], None]) -> Callable:
    """A `DigestProgress` callback that says what a long fingerprinting does: once the files to
    read are known, every `PROGRESS_EVERY_S`, and at the end."""
    from studies.running.progress import format_duration

    state = {"announced": False, "last": time.monotonic()}

    def tell(progress) -> None:
        if not progress.to_read:
            return
        if not state["announced"]:
            if progress.to_read < ANNOUNCE_FILES and progress.bytes_to_read < ANNOUNCE_BYTES:
                return
            state["announced"] = True
            cached = progress.files - progress.to_read
            say(
                f"fingerprinting {label}: reading {progress.to_read:,} of its {progress.files:,} files "
                f"({_mb(progress.bytes_to_read)})"
                + (f"; {cached:,} unchanged since they were read" if cached else "")
                + " (once: the digests are cached by path, size and time for the next runs)"
            )
            return
        now = time.monotonic()
        speed = progress.bytes_read / progress.seconds if progress.seconds else 0.0
        if progress.read >= progress.to_read:
            say(
                f"fingerprinting {label}: {progress.read:,} files read in {format_duration(progress.seconds)}"
                f" ({_mb(speed)}/s)"
            )
        elif now - state["last"] >= PROGRESS_EVERY_S:
            left = (progress.bytes_to_read - progress.bytes_read) / speed if speed else None
            say(
                f"fingerprinting {label}: {progress.read:,}/{progress.to_read:,} files, {_mb(speed)}/s, "
                f"about {format_duration(left)} left"
            )
        state["last"] = now

    return tell


def fingerprint_data(cells: Sequence, say: Callable[[str], None] = lambda text: None) -> dict[str, Any]:
    """The fingerprint of each distinct data set of the cells, by data key; a data set read
    from many files says what it reads and how far it is (first run, or changed files)."""
    from setvalued.provenance import DigestCache, data_fingerprint, data_key

    cache, found = DigestCache(), {}
    for cell in cells:
        data = cell.config.get("data") or {}
        key = data_key(data)
        if key in found:
            continue
        label = f"data.root {data.get('root')}" if data.get("root") else f"the {data.get('name')} data"
        try:
            found[key] = data_fingerprint(data, cache, progress=_progress_lines(label, say))
        except (OSError, ValueError) as error:  # a file that vanished, a FIFO among the images
            raise RunnerError(f"{label}: cannot fingerprint its files ({error}). Nothing was started.") from None
    if cache.warning:
        say(f"warning: {cache.warning}")
    return found


@dataclass(frozen=True)
class _Proposal:
    """A finished cell known only from its run (an optuna proposal): its id and config."""

    cell_id: str
    config: dict

    @property
    def config_id(self) -> str:
        return self.cell_id


def today_identities(cells: Sequence, data: Mapping[str, Any]) -> dict[str, dict[str, list[str]]]:
    """Each cell's identity today, by cell id (computed once per config)."""
    from setvalued.provenance import data_key

    by_config: dict[str, dict[str, list[str]]] = {}
    out = {}
    for cell in cells:
        if cell.config_id not in by_config:
            config = cell.config
            by_config[cell.config_id] = cell_identity(config, data.get(data_key(config.get("data") or {})))
        out[cell.cell_id] = by_config[cell.config_id]
    return out


# ----------------------------------------------------------------------------- what MLflow holds


@dataclass
class Recorded:
    """What the store says of the finished cells: each one's recorded identity, the configs of
    those of this version that are not among the run's cells (an optuna block's proposals,
    from their params), and the cells kept knowingly before."""

    identities: dict[str, dict] = field(default_factory=dict)
    configs: dict[str, dict] = field(default_factory=dict)
    kept: KeptCells = field(default_factory=KeptCells)


def recorded_identities(
    tracking_uri: str, name: str, cell_ids: set[str], version: StudyVersion | None = None
) -> Recorded:
    """The latest finished run of each of ``cell_ids`` and, with ``version`` (a study with
    optuna blocks, whose proposals are not in ``cell_ids``), of every other cell of that
    version, from the store, read only: a local store that does not exist yet is not created
    (nothing finished there). One bulk read of the cell runs' tags (and params with
    ``version``), one of the parent run's."""
    from analysis.collect import study_runs
    from analysis.layout import ROLE_CELL, ROLE_PARENT, STATUS_FINISHED, TAG_CELL_ID, TAG_ROLE, TAG_STATUS, TAG_VERSION
    from studies.readback import sqlite_path
    from studies.tracking.contract import config_of_params
    from studies.tracking.retry import with_retry

    local = sqlite_path(tracking_uri)
    if local is not None and not local.is_file():
        return Recorded()
    from mlflow import MlflowClient

    client = with_retry(lambda: MlflowClient(tracking_uri))
    experiment = with_retry(lambda: client.get_experiment_by_name(name))
    if experiment is None:
        return Recorded()
    wanted = {TAG_ROLE: ROLE_CELL, TAG_STATUS: STATUS_FINISHED}
    runs = with_retry(
        lambda: study_runs(client, experiment.experiment_id, wanted, params=version is not None, metrics=())
    )

    def this_version(tags: Mapping[str, str]) -> bool:  # a run without a version is of the first
        return version is not None and tags.get(TAG_VERSION, "" if version.qualified else version.version) == (
            version.version
        )

    latest: dict[str, Any] = {}
    for run in runs:  # oldest first: the latest finished run of a cell is the one reused
        cell_id = run.tags.get(TAG_CELL_ID)
        if cell_id in cell_ids or (cell_id and this_version(run.tags)):
            latest[cell_id] = run
    parents = with_retry(lambda: study_runs(client, experiment.experiment_id, {TAG_ROLE: ROLE_PARENT}, params=False))
    return Recorded(
        {cell_id: read_identity(run.tags) for cell_id, run in latest.items()},
        {cell_id: config_of_params(run.params) for cell_id, run in latest.items() if cell_id not in cell_ids},
        KeptCells.read(parents[-1].tags) if parents else KeptCells(),
    )


def differences(
    today: Mapping[str, Mapping[str, Sequence[str]]],
    recorded: Mapping[str, Mapping[str, Sequence[str]]],
    kept: KeptCells,
) -> list[Difference]:
    """Every item of every finished cell whose recorded digest is not today's (nor accepted
    as today's by a decision to keep it)."""
    found = []
    for cell_id, old in recorded.items():
        new = today.get(cell_id)
        if new is None:
            continue
        for item in sorted(set(new) | set(old)):
            old_digest, old_label = old[item] if item in old else (None, NOT_RECORDED)
            new_digest, new_label = new[item] if item in new else ("", "(none)")
            if not kept.accepts(item, old_digest, new_digest):
                found.append(Difference(cell_id, item, old_digest, old_label, new_digest, new_label))
    return found


# ----------------------------------------------------------------------------- what to do about it


def _grouped(found: Sequence[Difference]) -> list[tuple[tuple[str, str, str], int]]:
    """(item, old label, new label) with how many cells, most cells first."""
    counts = Counter((d.item, d.old_label, d.new_label) for d in found)
    return sorted(counts.items(), key=lambda pair: (-pair[1], pair[0]))


_WHOLE_WORDS: dict[str, Any] = {"break_long_words": False, "break_on_hyphens": False}


def change_lines(found: Sequence[Difference]) -> list[str]:
    """Each changed item, old -> new, with its number of cells (80 columns)."""
    lines = []
    groups = _grouped(found)
    for (item, old, new), count in groups[:MAX_LISTED]:
        lines.append(f"  {describe_item(item)} ({count:,} cell{'s' if count != 1 else ''}):")
        for text, indent in ((old, "    "), (new, "    -> ")):  # a path is not cut
            lines += textwrap.wrap(text, 78, initial_indent=indent, subsequent_indent="      ", **_WHOLE_WORDS)
    if len(groups) > MAX_LISTED:
        lines.append(f"  ... and {len(groups) - MAX_LISTED} more")
    return lines


def refusal(name: str, where: str, found: Sequence[Difference]) -> RunnerError:
    cells = len({d.cell_id for d in found})
    head = (
        f"study {name!r} ({where}): {cells:,} finished cell{'s were' if cells != 1 else ' was'} trained with "
        f"other code or data than this run would train {'them' if cells != 1 else 'it'} with (old -> new):"
    )
    lines = textwrap.wrap(head, 78, initial_indent=" " * 16, **_WHOLE_WORDS)  # after "studies: error: "
    lines = [lines[0].lstrip(), *lines[1:], *change_lines(found)]
    lines += [
        "Nothing was started. Ways forward:",
        "  - run them again as a new version of the study, kept beside the finished",
        "    ones and told apart from them in its report and in MLflow: the same",
        "    command with --new-version",
        "  - keep the finished cells as they are, knowingly (the decision is recorded",
        "    on the study's parent run and shown in its report): the same command",
        "    with --keep-finished",
        "A change of the runner or the report (studies/, analysis/) changes no cell.",
    ]
    return RunnerError("\n".join(lines))


def identity_version(version: StudyVersion, found: Sequence[Difference], text: str) -> StudyVersion:
    """A new version of the study with the same definition as ``version`` (its cells run again
    because what trains them changed; the entry says so)."""
    record = [dict(entry) for entry in version.record]
    current = next(e for e in record if e["version"] == version.version)
    changes = sorted({f"{describe_item(d.item)}: {d.old_label} -> {d.new_label}" for d in found})
    digest = version_digest({**current["definition"], "__identity__": changes})
    record.append(
        {
            "version": digest,
            "definition": current["definition"],
            "study_yaml": text,
            "reason": "what trains its cells changed: " + "; ".join(changes),
        }
    )
    return StudyVersion(digest, qualified=True, record=record, new=True)


def check_identity(
    study: Any,
    name: str,
    where: Path | str,
    tracking_uri: str,
    version: StudyVersion,
    unversioned: Sequence,
    cells: Sequence,
    options: Any,
    say: Callable[[str], None],
) -> IdentityCheck:
    """Fingerprint the cells' code, plugins and data, compare with what the finished cells of
    this version recorded, and refuse (RunnerError) or go on as the module docstring says."""
    data = fingerprint_data(cells, say)
    today = today_identities(cells, data)
    recorded = recorded_identities(tracking_uri, name, set(today), version if study.optuna_blocks else None)
    if recorded.configs:  # an optuna block's proposals: today's identity of their configs
        proposals = [_Proposal(cell_id, config) for cell_id, config in recorded.configs.items()]
        data.update(fingerprint_data(proposals, say))
        today.update(today_identities(proposals, data))
    found = differences(today, recorded.identities, recorded.kept)
    check = IdentityCheck(version, list(cells), data, ParentRecord(), found)
    if not found:
        return check
    if getattr(options, "keep_finished", False):
        check.parent = _keep(recorded.kept, found, say)
        return check
    if getattr(options, "new_version", False):
        return _renew(check, study, name, unversioned, say)
    raise refusal(name, str(where), found)


def _keep(kept: KeptCells, found: Sequence[Difference], say: Callable[[str], None]) -> ParentRecord:
    """``--keep-finished``: the decision (for the parent run), said on the console."""
    cells = len({d.cell_id for d in found})
    changes = sorted({(d.item, d.old_digest, d.new_digest) for d in found}, key=str)
    described = [f"{describe_item(i)}: {o} -> {n} ({c} cells)" for (i, o, n), c in _grouped(found)]
    record = ParentRecord(kept=kept, decision=kept.keep(changes, described, cells))
    say(
        f"keeping {cells:,} finished cells although what trains them changed "
        "(--keep-finished; recorded on the parent run and in the report):"
    )
    for line in change_lines(found):
        say(line)
    return record


def _renew(
    check: IdentityCheck, study: Any, name: str, unversioned: Sequence, say: Callable[[str], None]
) -> IdentityCheck:
    """``--new-version``: a version whose cells run again beside the finished ones."""
    if study.optuna_blocks:
        raise RunnerError(
            f"study {name!r}: --new-version does not apply to a study with an optuna block "
            f"(its sampler's history belongs to the version that ran it); give it a new name, "
            f"or keep the finished cells with --keep-finished. Nothing was started."
        )
    new = identity_version(check.version, check.differences, study.source_text)
    say(
        f"what trains {len({d.cell_id for d in check.differences}):,} finished cells changed: version "
        f"{short_version(new.version)} runs them again beside version {short_version(check.version.version)} "
        f"(--new-version)"
    )
    return dataclasses.replace(check, version=new, cells=versioned_cells(unversioned, new))
