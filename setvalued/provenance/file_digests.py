"""The content digest of files, remembered by their path, size and times so that a rerun reads
nothing it read before.

`DigestCache.digests` answers the SHA-256 of each file. A file whose path, size, modification
time, change time and inode are those recorded when it was last read is not read again: the
digest is taken from a SQLite file in the user's cache folder (``$SETVALUED_DIGEST_CACHE``, else
``$XDG_CACHE_HOME`` or ``~/.cache``, ``setvalued-studies/file-digests.sqlite``). The change time
is set by the kernel on every write, rename or ``touch -d`` of the file, so a file replaced in
place under the same name, size and modification time is read again. The files to read are
read by a few threads (hashing releases the GIL), at the disk's speed.

``kind`` names what is digested: ``bytes`` (the file as it is) or ``python`` (a Python source by
its syntax tree without comments, docstrings or layout: a change of those alone changes no
code, `python_digest`).

A cache that cannot be opened or written (a read-only home, a broken file) costs a rerun its
speed, never its answer: the digests are then computed from the files.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CACHE_ENV",
    "DigestCache",
    "DigestProgress",
    "cache_path",
    "file_digest",
    "python_digest",
    "combined_digest",
]

#: the environment variable naming the cache file (``off``: no cache)
CACHE_ENV = "SETVALUED_DIGEST_CACHE"
#: bytes read per call while hashing a file
_CHUNK = 1 << 20
#: threads that read the files not in the cache
READERS = 8
#: files handed to the readers at a time
_BATCH = 4096
#: rows looked up per query (SQLite's bound on the parameters of one statement is 32,766)
_LOOKUP_ROWS = 900
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS digests (path TEXT NOT NULL, kind TEXT NOT NULL, size INTEGER, "
    "mtime_ns INTEGER, ctime_ns INTEGER, inode INTEGER, digest TEXT, PRIMARY KEY (path, kind))"
)


def cache_path() -> Path | None:
    """The cache file (None when ``$SETVALUED_DIGEST_CACHE`` is ``off``)."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen:
        return None if chosen.strip().lower() == "off" else Path(chosen).expanduser()
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "setvalued-studies" / "file-digests.sqlite"


def file_digest(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


_AST_LOCK = threading.Lock()


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            first = body[0] if body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    node.body = body[1:] or [ast.Pass()]
    return tree


def python_digest(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a Python source's syntax tree without its docstrings (comments and layout
    are not in it); the file's bytes when it does not parse."""
    data = Path(path).read_bytes()
    with _AST_LOCK:  # CPython 3.11's parser is not safe in two threads at once (SystemError)
        try:
            tree = ast.parse(data)
        except (SyntaxError, ValueError):
            return hashlib.sha256(data).hexdigest()
        text = ast.dump(_without_docstrings(tree))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


_DIGESTERS: dict[str, Callable[[str], str]] = {"bytes": file_digest, "python": python_digest}


def combined_digest(entries: Sequence[tuple[str, str]]) -> str:
    """One SHA-256 of ``(name, digest)`` pairs, in the order given: a folder's digest from its
    files' relative paths and digests (a renamed file changes it)."""
    digest = hashlib.sha256()
    for name, value in entries:
        digest.update(f"{name}\t{value}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


@dataclass
class DigestProgress:
    """What a `DigestCache.digests` call has done: files and bytes in all, those read so far
    (the others were in the cache), and the seconds spent."""

    files: int
    bytes: int
    to_read: int = 0
    bytes_to_read: int = 0
    read: int = 0
    bytes_read: int = 0
    seconds: float = 0.0


def _signature(info: os.stat_result) -> tuple[int, int, int, int]:
    return (int(info.st_size), int(info.st_mtime_ns), int(info.st_ctime_ns), int(info.st_ino))


class DigestCache:
    """The digests of files, each read once per version of the file (module docstring)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, use_default: bool = True):
        """``path``: the cache file; None: `cache_path()` (``use_default`` false: no cache)."""
        self.path = Path(path) if path is not None else (cache_path() if use_default else None)
        self.warning: str | None = None  # why the cache was not used, if it was not
        self.last: DigestProgress | None = None  # what the last `digests` call did

    # -- the SQLite file

    def _connect(self) -> sqlite3.Connection | None:
        if self.path is None:
            return None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            connection = sqlite3.connect(self.path, timeout=30)
            connection.execute(_SCHEMA)
            return connection
        except (OSError, sqlite3.Error) as error:
            self._set_aside(error)
        try:  # a broken file was moved aside: a new one
            connection = sqlite3.connect(self.path, timeout=30)
            connection.execute(_SCHEMA)
            return connection
        except (OSError, sqlite3.Error) as error:
            self.warning = f"the file-digest cache {self.path} cannot be used ({error}); every file is read"
            return None

    def _set_aside(self, error: BaseException) -> None:
        """A cache file that is not a SQLite database of ours is renamed ``*.broken``."""
        assert self.path is not None
        try:
            if self.path.is_file() and not isinstance(error, sqlite3.OperationalError):
                os.replace(self.path, self.path.with_name(self.path.name + ".broken"))
        except OSError:
            pass

    def _lookup(
        self, connection: sqlite3.Connection | None, paths: Sequence[str], kind: str
    ) -> dict[str, tuple[Any, ...]]:
        if connection is None:
            return {}
        found: dict[str, tuple[Any, ...]] = {}
        try:
            for start in range(0, len(paths), _LOOKUP_ROWS):
                part = paths[start : start + _LOOKUP_ROWS]
                marks = ",".join("?" * len(part))
                rows = connection.execute(
                    f"SELECT path, size, mtime_ns, ctime_ns, inode, digest FROM digests "
                    f"WHERE kind = ? AND path IN ({marks})",
                    [kind, *part],
                )
                for path, *signature, digest in rows:
                    found[path] = (tuple(signature), digest)
        except sqlite3.Error as error:
            self.warning = f"the file-digest cache {self.path} cannot be read ({error}); every file is read"
            return {}
        return found

    def _store(self, connection: sqlite3.Connection | None, rows: list[tuple[Any, ...]]) -> None:
        if connection is None or not rows:
            return
        try:
            with connection:
                connection.executemany(
                    "INSERT OR REPLACE INTO digests (path, kind, size, mtime_ns, ctime_ns, inode, digest) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    rows,
                )
        except sqlite3.Error as error:
            self.warning = f"the file-digest cache {self.path} cannot be written ({error}); the next run reads again"

    # -- the digests

    def digests(
        self,
        paths: Sequence[str | os.PathLike[str]],
        kind: str = "bytes",
        progress: Callable[[DigestProgress], None] | None = None,
        every_s: float = 2.0,
        digester: Callable[[str], str] | None = None,
    ) -> list[str]:
        """The digest of each file of ``paths`` (in order): from the cache where the file is
        unchanged, else read (``kind``: module docstring; another kind names what ``digester``,
        a function of a path, answers of a file: a fact about it remembered as a digest is).
        ``progress`` is called once the
        files to read are known, then at most every ``every_s`` seconds while they are read,
        and at the end. An OSError names a file that cannot be read."""
        digester = digester or _DIGESTERS[kind]
        names = [os.path.abspath(os.fspath(p)) for p in paths]
        started = time.monotonic()
        signatures = []
        for name in names:
            info = os.stat(name)
            if not stat.S_ISREG(info.st_mode):
                raise OSError(f"{name!r} is not a regular file")
            signatures.append(_signature(info))
        state = self.last = DigestProgress(files=len(names), bytes=sum(s[0] for s in signatures))
        connection = self._connect()
        try:
            known = self._lookup(connection, names, kind)
            result: list[str | None] = [None] * len(names)
            missing = []
            for i, (name, signature) in enumerate(zip(names, signatures)):
                cached = known.get(name)
                if cached is not None and cached[0] == signature:
                    result[i] = cached[1]
                else:
                    missing.append(i)
            state.to_read, state.bytes_to_read = len(missing), sum(signatures[i][0] for i in missing)
            if progress is not None:
                progress(state)
            rows = self._read(names, signatures, missing, digester, result, state, progress, every_s, started)
            self._store(connection, [(names[i], kind, *signatures[i], result[i]) for i in rows])
        finally:
            if connection is not None:
                connection.close()
        state.seconds = time.monotonic() - started
        if progress is not None and state.to_read:
            progress(state)
        return [r for r in result if r is not None]

    @staticmethod
    def _read(
        names: list[str],
        signatures: list[tuple[Any, ...]],
        missing: list[int],
        digester: Callable[[str], str],
        result: list[str | None],
        state: DigestProgress,
        progress: Callable[[DigestProgress], None] | None,
        every_s: float,
        started: float,
    ) -> list[int]:
        """Read the files of ``missing`` with `READERS` threads; their indices, read."""
        if not missing:
            return []
        lock, last = threading.Lock(), [time.monotonic()]

        def one(i: int) -> None:
            result[i] = digester(names[i])
            with lock:
                state.read += 1
                state.bytes_read += signatures[i][0]
                now = time.monotonic()
                if progress is not None and now - last[0] >= every_s:
                    last[0] = now
                    state.seconds = now - started
                    progress(state)

        if len(missing) == 1:
            one(missing[0])
        else:
            with ThreadPoolExecutor(max_workers=min(READERS, len(missing)), thread_name_prefix="digest") as pool:
                for start in range(0, len(missing), _BATCH):  # a bounded number of futures at a time
                    for _ in pool.map(one, missing[start : start + _BATCH]):
                        pass  # the first file that cannot be read raises here
        return missing
