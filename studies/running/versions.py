"""One study name, one study: the versions a study's output folder has run, and the check
that refuses a changed study file under an existing name (docs/guarantees.md).

The folder's ``versions.json`` holds every version of the study that ran there, oldest first:
its version (`studies.studyfile.version.version_digest` of its definition when it first ran),
its definition as last run and that study file's text. A file whose definition has no
change against a version's (`studies.studyfile.version.changes`: same configs, perhaps more
seeds or more configs) is that version, extended; its definition and text are updated. Any
other file is refused with exit code 2 before Ray or MLflow is touched, naming each changed
field with its old and new value, unless `--new-version` keeps it beside the others as a new
version. The runs of every version after the first carry it in their config ids
(``<config_id>-v<version>``), so a config that two versions share is run and reported once
per version, and its seeds are never pooled across versions.

A folder run before versions were recorded has no ``versions.json``: its ``study.yaml`` (what
ran last) is read as the first version.
"""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from studies.errors import RunnerError, option
from studies.studyfile.version import changes, definition, format_changes, short_version, version_digest

__all__ = [
    "VERSIONS_FILE",
    "DEFINITION_FILE",
    "MAX_VERSIONS_BYTES",
    "StudyVersion",
    "check_version",
    "save_versions",
    "versioned_cells",
    "read_versions",
    "versions_in_mlflow",
    "check_submission",
]

VERSIONS_FILE = "versions.json"
#: the current version's entry (version, index, definition), kept beside versions.json and
#: logged on the parent run as ``versions/<version>/definition.json``
DEFINITION_FILE = "definition.json"
#: largest versions.json read back (definitions and study files of many versions)
MAX_VERSIONS_BYTES = 32 * 1024 * 1024


@dataclass
class StudyVersion:
    """The version a run of the study belongs to, and the folder's record with it."""

    version: str
    #: the cells' config ids carry the version (a version after the study's first)
    qualified: bool
    #: every version of the folder, oldest first (written by `save_versions`)
    record: list[dict]
    new: bool = False  # a version added by this run (--new-version or a first run)

    @property
    def several(self) -> bool:
        return len(self.record) > 1


def read_versions(study_dir: Path) -> list[dict]:
    """The versions recorded in the study folder, oldest first ([] when none)."""
    from studies.readback import read_json

    path = Path(study_dir) / VERSIONS_FILE
    if not os.path.lexists(path):
        return []
    data = read_json(
        path,
        MAX_VERSIONS_BYTES,
        "the versions of the study written by `studies run` "
        "(a JSON object: versions, a list of {version, definition, study_yaml})",
        {"versions": list},
    )
    versions = data.get("versions") or []
    for entry in versions:
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("version"), str)
            and isinstance(entry.get("definition"), dict)
        ):
            from studies.readback import ReadBackError

            raise ReadBackError(
                f"{path}: an entry of 'versions' is not {{version, definition, "
                f"study_yaml}}; expected what `studies run` writes"
            )
    return versions


def _legacy_versions(study_dir: Path, smoke_epochs: int | None) -> list[dict]:
    """A folder run before versions were recorded: its study.yaml as the first version."""
    from studies.studyfile.problems import StudyError
    from studies.studyfile.spec import load_study

    copy = Path(study_dir) / "study.yaml"
    if not (copy.is_file() and (Path(study_dir) / "run.json").is_file()):
        return []
    try:
        old = load_study(copy)
    except (StudyError, OSError):  # unreadable with this code: nothing to compare with
        return []
    content = definition(old, smoke_epochs)
    return [{"version": version_digest(content), "definition": content, "study_yaml": old.source_text}]


def check_version(
    study: Any,
    name: str,
    study_dir: Path | None,
    new_version: bool,
    smoke_epochs: int | None = None,
    elsewhere: Callable[[], list[dict]] | None = None,
) -> StudyVersion:
    """The version of this run of `study` in `study_dir`; RunnerError (exit code 2) naming
    each changed field and the ways forward when the file changed and `new_version` is off.
    `elsewhere`: where to read the versions when the folder has none (the tracking server's,
    `versions_in_mlflow`)."""
    content = definition(study, smoke_epochs)
    record = (
        read_versions(study_dir) or _legacy_versions(study_dir, smoke_epochs) if study_dir is not None else []
    ) or (elsewhere() if elsewhere is not None else [])
    record = [dict(entry) for entry in record]
    for index in range(len(record) - 1, -1, -1):  # the latest version that it extends
        entry = record[index]
        if not changes(entry["definition"], content):
            entry.update(definition=content, study_yaml=study.source_text)
            return StudyVersion(entry["version"], qualified=index > 0, record=record)
    digest = version_digest(content)
    if record and not new_version:
        latest = record[-1]
        found = changes(latest["definition"], content)
        where = study_dir if study_dir is not None else "its tracking server"
        head = (
            f"study {name!r} ({where}) was run from another version of its study "
            f"file (version {short_version(latest['version'])}); these fields define its "
            f"configs and changed (old -> new):"
        )
        # the first line follows the CLI's "studies: error: " (80 columns in all)
        lines = textwrap.wrap(head, 78, initial_indent=" " * 16)
        lines = (
            [lines[0].lstrip()]
            + lines[1:]
            + format_changes(found)
            + [
                "Nothing was started. Ways forward:",
                "  - a new name for the changed study: `name:` in the file, or the override",
                f"    name={name.removesuffix('-smoke') if smoke_epochs is not None else name}_2",
                "  - both versions in this study, told apart by their version in its report",
                f"    and in MLflow: the same command with {option('new_version')}",
                "More seeds, variants, design blocks or grid values extend a study: no change.",
            ]
        )
        raise RunnerError("\n".join(lines))
    if record and study.optuna_blocks:
        raise RunnerError(
            f"study {name!r}: {option('new_version')} does not apply to a study with an optuna "
            f"block (its sampler's history, optuna.db, belongs to the version that "
            f"ran it); give the changed study a new name (the override "
            f"name={name.removesuffix('-smoke') if smoke_epochs is not None else name}_2). "
            f"Nothing was started."
        )
    record.append({"version": digest, "definition": content, "study_yaml": study.source_text})
    return StudyVersion(digest, qualified=len(record) > 1, record=record, new=True)


def save_versions(study_dir: Path, version: StudyVersion) -> Path:
    """Write the folder's record (after the study folder is prepared) and the current
    version's entry (`DEFINITION_FILE`, for the parent run); return the entry's path."""
    index = next(i for i, e in enumerate(version.record) if e["version"] == version.version)
    entry = {"version": version.version, "index": index, "definition": version.record[index]["definition"]}
    for name, data in (
        (VERSIONS_FILE, {"current": version.version, "versions": version.record}),
        (DEFINITION_FILE, entry),
    ):
        path = Path(study_dir) / name
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    return Path(study_dir) / DEFINITION_FILE


def versions_in_mlflow(tracking_uri: str, name: str) -> list[dict]:
    """The versions the study's parent run holds (``versions/<version>/definition.json``),
    oldest first; [] when there is none or the store cannot be read (its preconditions then
    say why). For a run whose output folder is new and for `studies submit`: one search and
    a download per version, no Ray."""
    import tempfile

    from mlflow import MlflowClient

    from analysis.layout import ROLE_PARENT, TAG_ROLE, VERSIONS_ARTIFACT_DIR, tag_filter
    from studies.readback import ReadBackError, read_json, sqlite_path

    local = sqlite_path(tracking_uri)
    if local is not None and not local.is_file():
        return []  # a new local store: no version yet (and none is created by looking)
    entries = []
    quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
    saved = {key: os.environ.get(key) for key in quick}
    os.environ.update(quick)  # one try: a server that does not answer is said so later
    try:
        client = MlflowClient(tracking_uri)
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            return []
        runs = client.search_runs([experiment.experiment_id], tag_filter({TAG_ROLE: ROLE_PARENT}), max_results=1)
        if not runs:
            return []
        run_id = runs[0].info.run_id
        with tempfile.TemporaryDirectory() as tmp:
            for item in client.list_artifacts(run_id, VERSIONS_ARTIFACT_DIR):
                if item.is_dir:
                    path = client.download_artifacts(run_id, f"{item.path}/{DEFINITION_FILE}", tmp)
                    entries.append(
                        read_json(
                            path,
                            MAX_VERSIONS_BYTES,
                            "a study version's entry",
                            {"version": str, "index": int, "definition": dict},
                        )
                    )
    except ReadBackError:
        raise
    except Exception:  # noqa: BLE001 (a server that does not answer: the run's preconditions say so)
        return []
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return sorted(entries, key=lambda e: e.get("index", 0))


def check_submission(study: Any, tracking_uri: str, extra_args: Sequence[str]) -> None:
    """`studies submit`: the changed study refused before the job is submitted, against the
    versions its tracking server holds (the job's output folder is on the cluster); the job's
    `studies run` checks its folder again."""
    args = list(extra_args)
    smoke = "--smoke" in args or "--smoke-epochs" in args
    epochs = int(args[args.index("--smoke-epochs") + 1]) if "--smoke-epochs" in args[:-1] else 1
    name = study.name + ("-smoke" if smoke else "")
    check_version(
        study,
        name,
        None,
        "--new-version" in args,
        epochs if smoke else None,
        elsewhere=lambda: versions_in_mlflow(tracking_uri, name),
    )


def versioned_cells(cells: Sequence[Any], version: StudyVersion) -> list:
    """The cells with their version; a later version's config ids carry it."""
    suffix = f"-v{short_version(version.version)}" if version.qualified else ""
    return [dataclasses.replace(cell, config_id=cell.config_id + suffix, version=version.version) for cell in cells]
