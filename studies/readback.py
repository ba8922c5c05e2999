"""What the tool reads back (the output folder, `run.json`, a study's `study.yaml` copy,
checkpoint metadata, SQLite stores) is checked like a study file before it is used.

- A study NAME given to `resume`, `report` or `export` is a study name (the study file's
  pattern), and its folder resolves inside `--output` (`study_folder`): nothing is read from
  or written outside it. An unknown NAME is one error that lists the studies that exist
  there, nearest first (`unknown_study`).
- A file is read only when it is a regular file (not a FIFO, a device, a folder) of bounded
  size, then parsed and its shape checked (`read_bounded`, `read_json`): a FIFO cannot hang
  the driver, a link to /dev/zero cannot fill its memory.
- A local SQLite store is read only when it is a complete SQLite file (`check_sqlite_store`),
  from its header, in constant time: a 0-byte or truncated store is refused by name and never
  turned into a new one, and a mistyped path creates nothing.

Each refusal is a `ReadBackError` (a `RunnerError`: exit code 2, one paragraph, no traceback).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from studies.errors import RunnerError, option

__all__ = [
    "ReadBackError",
    "UnknownStudy",
    "study_folder",
    "known_studies",
    "unknown_study",
    "read_bounded",
    "read_json",
    "check_regular",
    "check_sqlite_store",
    "check_study_copy",
    "sqlite_path",
    "STUDY_NAME_PATTERN",
    "MAX_SETTINGS_BYTES",
    "MAX_META_BYTES",
]

#: a study name: it names the output folder and the MLflow experiment (the study file's rule)
STUDY_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
STUDY_NAME_MAX = 100
#: largest run.json read (it holds five short settings)
MAX_SETTINGS_BYTES = 64 * 1024
#: largest checkpoint meta.json read (a cell's per-epoch history: 1,000 epochs of 100 metrics
#: is about 3 MB)
MAX_META_BYTES = 16 * 1024 * 1024
#: most entries of the output folder looked at to list the studies that exist
MAX_LISTED_ENTRIES = 10_000

_SQLITE_HEADER = b"SQLite format 3\x00"
_SQLITE_PREFIX = "sqlite:///"


class ReadBackError(RunnerError):
    """A file, folder or store the tool reads back that is not what it wrote; one paragraph."""


class UnknownStudy(ReadBackError, FileNotFoundError):
    """No study of that name under the output folder (a FileNotFoundError too, as before)."""


# ----------------------------------------------------------------------------- names


def study_folder(output: str | Path, name: str) -> Path:
    """The folder of study `name` under `output`, refused unless `name` is a study name and
    the folder (links resolved) is a child of `output`."""
    root = Path(output).expanduser().resolve()
    if (
        not isinstance(name, str)
        or len(name) > STUDY_NAME_MAX
        or not re.fullmatch(STUDY_NAME_PATTERN, name)
        or name in (".", "..")
    ):
        raise ReadBackError(
            f"{name!r} is not a study name; expected the name of a study under {root} (letters, "
            f"digits, '_', '.', '-', starting with a letter or digit, at most {STUDY_NAME_MAX} "
            f"characters), not a path"
        )
    folder = root / name
    if folder.resolve().parent != root:
        raise ReadBackError(
            f"the study folder {folder} leads outside the output folder {root} "
            f"(a link to {folder.resolve()}); expected a folder inside {root}"
        )
    return folder


def _is_study(entry: os.DirEntry) -> bool:
    try:
        if not entry.is_dir(follow_symlinks=False):
            return False
        return any(os.path.lexists(os.path.join(entry.path, f)) for f in ("study.yaml", "run.json"))
    except OSError:
        return False


def known_studies(output: str | Path) -> list[str]:
    """The studies under `output` (folders holding study.yaml or run.json), sorted; at most
    MAX_LISTED_ENTRIES entries are looked at."""
    root = Path(output).expanduser()
    names = []
    try:
        with os.scandir(root) as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_LISTED_ENTRIES:
                    break
                if _is_study(entry):
                    names.append(entry.name)
    except OSError:
        return []
    return sorted(names)


def unknown_study(name: str, output: str | Path, expected: str) -> UnknownStudy:
    """The error for a study that is not under `output`: the studies that are, nearest first."""
    root = Path(output).expanduser().resolve()
    known = known_studies(root)
    near = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(n) for n in near)}? " if near else ""
    listed = ", ".join(known[:20]) + (f" and {len(known) - 20} more" if len(known) > 20 else "")
    return UnknownStudy(
        f"no study named {name!r} under {root} ({expected}); {hint}studies there: "
        f"{listed or '(none)'}; pass {option('output')} where it ran, or start it with `studies run FILE`"
    )


# ----------------------------------------------------------------------------- files


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "folder"),
        (stat.S_ISFIFO, "FIFO (named pipe)"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return kind
    return "special file"


def check_regular(path: str | Path, what: str) -> os.stat_result:
    """The stat of `path` (links followed) when it is a regular file; ReadBackError naming it
    and its kind otherwise (FileNotFoundError when it is missing)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise
    except OSError as error:
        raise ReadBackError(f"{path}: cannot be read ({error.strerror or error}); expected {what}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ReadBackError(f"{path}: is a {_kind(info.st_mode)}; expected {what} (a regular file)")
    return info


def read_bounded(path: str | Path, max_bytes: int, what: str) -> bytes:
    """The bytes of `path` when it is a regular file (links followed) of at most `max_bytes`;
    ReadBackError naming it otherwise. Opened without blocking, so a FIFO cannot hang here
    even if it replaces the file between the check and the open."""
    path = Path(path)
    info = check_regular(path, what)
    if info.st_size > max_bytes:
        raise ReadBackError(f"{path}: is {info.st_size:,} bytes; expected {what} of at most {max_bytes:,} bytes")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as error:
        raise ReadBackError(f"{path}: cannot be read ({error.strerror or error}); expected {what}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since the check
            raise ReadBackError(f"{path}: is not a regular file; expected {what}")
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise ReadBackError(f"{path}: grew past {max_bytes:,} bytes while read; expected {what}")
    return data


def read_json(
    path: str | Path, max_bytes: int, what: str, fields: Mapping[str, type | tuple[type, ...]] | None = None
) -> dict:
    """A JSON object read with `read_bounded`; each field of `fields` present in it has the
    given type (ReadBackError naming the file and the field otherwise)."""
    data = read_bounded(path, max_bytes, what)
    try:
        value: Any = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as error:
        first = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        raise ReadBackError(f"{path}: is not valid JSON ({first}); expected {what}") from None
    if not isinstance(value, dict):
        raise ReadBackError(f"{path}: holds a JSON {type(value).__name__}; expected {what} (a JSON object)")
    for key, expected in (fields or {}).items():
        types = expected if isinstance(expected, tuple) else (expected,)
        found = value.get(key)
        # None: the field is absent; a bool is not an int here (JSON true is no epoch)
        if found is not None and (not isinstance(found, types) or (isinstance(found, bool) and bool not in types)):
            names = " or ".join(t.__name__ for t in types)
            raise ReadBackError(f"{path}: field {key!r} is {found!r:.60}; expected {names} ({what})")
    return value


# ----------------------------------------------------------------------------- stores


def sqlite_path(tracking_uri: str) -> Path | None:
    """The file of a local SQLite tracking URI (`sqlite:///path`); None for other URIs."""
    if not tracking_uri.startswith(_SQLITE_PREFIX):
        return None
    return Path(tracking_uri[len(_SQLITE_PREFIX) :].split("?", 1)[0])


def check_sqlite_store(tracking_uri: str, what: str = "the study's MLflow store") -> None:
    """Refuse a local SQLite store that is missing, not a regular file, empty, not SQLite, or
    shorter than its header says (truncated); other URIs pass. Reads 100 bytes."""
    path = sqlite_path(tracking_uri)
    if path is None:
        return
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ReadBackError(
            f"{path}: no such file; expected {what} (an existing SQLite file): "
            f"check --tracking-uri (this command never creates a store)"
        ) from None
    except OSError as error:
        raise ReadBackError(f"{path}: cannot be read ({error.strerror or error}); expected {what}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ReadBackError(f"{path}: is a {_kind(info.st_mode)}; expected {what} (an SQLite file)")
    if info.st_size == 0:
        raise ReadBackError(
            f"{path}: is empty (0 bytes); expected {what} (an SQLite file with the "
            f"study's runs); restore it from a backup, or move it away"
        )
    header = _head(path, 100)
    if len(header) < 100 or not header.startswith(_SQLITE_HEADER):
        raise ReadBackError(
            f"{path}: is not an SQLite database (its first bytes are not 'SQLite format 3'); expected {what}"
        )
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    # the page count in the header is valid when its version number matches the change counter
    valid = header[92:96] == header[24:28] and pages > 0
    if valid and pages * page_size > info.st_size:
        raise ReadBackError(
            f"{path}: is truncated ({info.st_size:,} bytes where its header says "
            f"{pages * page_size:,}); expected {what}; restore it from a backup"
        )


def _head(path: Path, n: int) -> bytes:
    """The first `n` bytes of a file checked to be regular (opened without blocking)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        return os.read(fd, n)
    finally:
        os.close(fd)


def check_study_copy(path: str | Path) -> None:
    """Refuse a study file copy (`DIR/NAME/study.yaml`) that a report would read unbounded: not
    a regular file, larger than a study file may be, not UTF-8, or YAML that is invalid, an
    alias bomb or nested too deep (`studies.studyfile.yaml_source.read_yaml`, the study file's bounds)."""
    from studies.studyfile.problems import Problems
    from studies.studyfile.yaml_source import MAX_FILE_BYTES, read_yaml

    what = "the copy of the study file that `studies run` wrote"
    data = read_bounded(path, MAX_FILE_BYTES, what)
    try:
        read_yaml(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ReadBackError(
            f"{path}: is not UTF-8 text ({error.reason} at byte {error.start}); expected {what}"
        ) from None
    except Problems as problems:
        first = problems.problems[0]
        where = ".".join(str(p) for p in first.path)
        raise ReadBackError(f"{path}: {where}: {first.message}; expected {what}") from None
