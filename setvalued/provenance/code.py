"""The identity of the code a trial runs: the training core and the plugins its config names.

`setvalued_fingerprint()`: the installed ``setvalued-studies`` version and a digest of every
file of the ``setvalued`` package (the training core: losses, metrics, data, models, trainer,
fused arrays); from a git checkout, its commit and whether ``setvalued/`` has uncommitted
changes. Only ``setvalued`` is digested: ``studies`` (the runner) and ``analysis`` (the report)
call the trainer and read what it logged, and cannot change what a trial computes.

`plugin_fingerprint(distribution)`: a plugin distribution's version, and for a local folder or
editable install (``pip install [-e] ./folder``: an edit need not change the version) a digest
of the files of its packages; an install from an index is identified by its version.

A Python file is digested by its syntax tree without docstrings (`file_digests.python_digest`):
comments, docstrings and layout change no code. Each fingerprint is computed once per process
(a worker keeps the code it imported), its files through the file-digest cache.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from setvalued.provenance.file_digests import DigestCache, combined_digest

__all__ = ["CodeFingerprint", "setvalued_fingerprint", "plugin_fingerprint", "package_digest", "git_state"]

#: the distribution that holds the training core
DISTRIBUTION = "setvalued-studies"
_DIGEST_LENGTH = 32
_SKIPPED_DIRS = ("__pycache__",)
_SKIPPED_SUFFIXES = (".pyc", ".pyo")


@dataclass(frozen=True)
class CodeFingerprint:
    """A distribution's code: its version, a digest (hex) and where it comes from (``origin``:
    ``git <commit>``, ``editable <folder>``, ``local folder <folder>``, ``index``, or a URL)."""

    name: str
    version: str
    digest: str
    origin: str
    files: int = 0

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}, {self.origin}, code {self.digest[:12]}"


def _files_under(roots: list[Path]) -> list[tuple[Path, Path]]:
    """(root, file) of every regular file under the roots (a root may be a file), sorted;
    compiled caches left out."""
    found = []
    for root in roots:
        if root.is_file():
            found.append((root.parent, root))
            continue
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
            for name in sorted(names):
                path = Path(folder) / name
                if not name.endswith(_SKIPPED_SUFFIXES) and path.is_file():
                    found.append((root.parent, path))
    return found


def package_digest(roots: list[Path], cache: DigestCache | None = None) -> tuple[str, int]:
    """(digest, number of files) of the files of packages (folders) or modules (files): each
    file by its path relative to its package's parent and its digest (Python by syntax tree)."""
    cache = cache if cache is not None else DigestCache()
    files = _files_under(roots)
    python = [(base, path) for base, path in files if path.suffix == ".py"]
    other = [(base, path) for base, path in files if path.suffix != ".py"]
    entries = []
    for group, kind in ((python, "python"), (other, "bytes")):
        if group:
            digests = cache.digests([path for _, path in group], kind=kind)
            entries += [(os.path.relpath(path, base), d) for (base, path), d in zip(group, digests)]
    return combined_digest(sorted(entries))[:_DIGEST_LENGTH], len(files)


def git_state(folder: Path) -> str | None:
    """``git <commit>`` of the checkout holding ``folder``, with ``(uncommitted changes)``
    when anything under ``folder`` differs from it (untracked files too); None outside one."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "--short=12", "HEAD")
    if not commit:
        return None
    changes = git("status", "--porcelain", "--", ".")
    return f"git {commit}" + (" (uncommitted changes)" if changes else "")


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        import setvalued

        return setvalued.__version__


@functools.cache
def setvalued_fingerprint() -> CodeFingerprint:
    """The training core's code (module docstring); computed once per process."""
    import setvalued

    package = Path(setvalued.__file__).resolve().parent
    digest, count = package_digest([package])
    origin = git_state(package) or f"installed at {package}"
    return CodeFingerprint(DISTRIBUTION, _version(DISTRIBUTION), digest, origin, count)


def _module_roots(modules: tuple[str, ...]) -> list[Path]:
    """The folders (packages) or files (modules) of top-level modules, found without importing them."""
    roots = []
    for module in modules:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        if spec.submodule_search_locations:
            roots += [Path(p).resolve() for p in spec.submodule_search_locations]
        elif spec.origin and os.path.isfile(spec.origin):
            roots.append(Path(spec.origin).resolve())
    return roots


@functools.cache
def plugin_fingerprint(distribution: str) -> CodeFingerprint:
    """A plugin distribution's code (module docstring); computed once per process."""
    import hashlib

    from setvalued.registry import distribution_source

    source = distribution_source(distribution)
    if source.path is not None:
        roots = _module_roots(source.top_level)
        if roots:
            digest, count = package_digest(roots)
            origin = f"{'editable' if source.editable else 'local folder'} {source.path}"
            return CodeFingerprint(source.name, source.version, digest, origin, count)
    origin = source.url or "index"
    digest = hashlib.sha256(f"{source.name}=={source.version} {origin}".encode()).hexdigest()[:_DIGEST_LENGTH]
    return CodeFingerprint(source.name, source.version, digest, origin)
