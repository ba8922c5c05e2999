"""The working directory a submitted study travels with: the project's source tree less what
`.gitignore` files and `DEFAULT_EXCLUDES` leave out, and the study file under `_submitted/`.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

#: never shipped to the cluster (gitignore-style patterns, relative to the project root)
DEFAULT_EXCLUDES: tuple[str, ...] = (
    ".git/",
    "studies_out/",
    "benchmarks/out/",
    "mlruns/",
    "mlartifacts/",
    "__pycache__/",
    ".pytest_cache/",
    "*.egg-info/",
    "*.db",
    "build/",
    "dist/",
    ".venv/",
    "venv/",
    ".env",
)
#: folder of the staged working dir that holds the submitted study file
SUBMITTED_DIR = "_submitted"


def _pattern_regex(pattern: str) -> tuple[re.Pattern, bool, bool]:
    """(regex, directories only, anchored) of one gitignore-style pattern.

    Supported: `*`, `?`, `[...]`, `**`, a trailing `/` (directories only), a leading or
    inner `/` (anchored at the root; otherwise the pattern matches a name at any depth).
    Negation (`!`) is not supported: such lines are skipped by `exclude_matcher`.
    """
    dir_only = pattern.endswith("/")
    body = pattern.strip("/") if dir_only else pattern.lstrip("/")
    anchored = "/" in pattern.rstrip("/")
    out = []
    i = 0
    while i < len(body):
        char = body[i]
        if body.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if body.startswith("/**", i) and i + 3 == len(body):
            out.append("/.*")
            i += 3
            continue
        if body.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[":
            end = body.find("]", i + 1)
            if end == -1:
                out.append(re.escape(char))
            else:
                cls = body[i + 1 : end]
                if cls.startswith("!"):
                    cls = "^" + cls[1:]
                out.append(f"[{cls}]")
                i = end
        else:
            out.append(re.escape(char))
        i += 1
    return re.compile("".join(out) + r"\Z"), dir_only, anchored


def exclude_matcher(patterns: Iterable[str]) -> Callable[[str, bool], bool]:
    """A function (relative posix path, is_dir) -> True when a pattern excludes it.

    A path is excluded when the path itself or one of its parent folders matches (a
    folder that matches takes everything below it along, as in git).
    """
    compiled = []
    for raw in patterns:
        line = raw.strip()
        if not line or line.startswith("#") or line.startswith("!"):
            continue
        compiled.append(_pattern_regex(line))

    def matches_one(rel: str, is_dir: bool) -> bool:
        name = rel.rsplit("/", 1)[-1]
        for regex, dir_only, anchored in compiled:
            if dir_only and not is_dir:
                continue
            if regex.match(rel if anchored else name):
                return True
        return False

    def excluded(rel: str, is_dir: bool) -> bool:
        parts = rel.strip("/").split("/")
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            if matches_one(prefix, is_dir or depth < len(parts)):
                return True
        return False

    return excluded


def find_project_dir() -> Path | None:
    """The source tree this `studies` package was imported from (it holds pyproject.toml
    and the packages); None for an installed copy (the cluster image must then have it)."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "studies").is_dir() and (root / "setvalued").is_dir():
        return root
    return None


def stage_working_dir(
    study_file: Path, project_dir: Path | None, staging: Path, excludes: Sequence[str] = DEFAULT_EXCLUDES
) -> str:
    """Fill `staging` with the project and `_submitted/<study file name>`; returns the
    study's path relative to `staging`.

    Left out: `excludes` (relative to the project root) and what any `.gitignore` of the
    project ignores (relative to its own folder, as git reads them), so that secrets kept
    out of git (e.g. cluster/mlflow/.env) stay off the cluster too. The `.gitignore` files
    themselves are not copied, so Ray applies no further filter of its own.
    """
    if project_dir is not None:
        # (folder prefix relative to the project root, matcher of paths below it)
        rules: list[tuple[str, Callable[[str, bool], bool]]] = [("", exclude_matcher(excludes))]

        def skip(rel: str, is_dir: bool) -> bool:
            return any(rel.startswith(base) and matcher(rel[len(base) :], is_dir) for base, matcher in rules)

        for folder, dirs, files in os.walk(project_dir):
            rel_folder = Path(folder).relative_to(project_dir).as_posix()
            rel_folder = "" if rel_folder == "." else rel_folder + "/"
            ignore_file = Path(folder) / ".gitignore"
            if ignore_file.is_file():
                patterns = ignore_file.read_text(errors="replace").splitlines()
                rules.append((rel_folder, exclude_matcher(patterns)))
            dirs[:] = sorted(
                d for d in dirs if not skip(rel_folder + d, True) and not (rel_folder == "" and d == SUBMITTED_DIR)
            )
            target = staging / rel_folder
            target.mkdir(parents=True, exist_ok=True)
            for name in files:
                rel = rel_folder + name
                source = Path(folder) / name
                if name == ".gitignore" or skip(rel, False) or (source.is_symlink() and not source.exists()):
                    continue
                shutil.copy2(source, target / name)
    submitted = staging / SUBMITTED_DIR
    submitted.mkdir(parents=True, exist_ok=True)
    shutil.copy2(study_file, submitted / study_file.name)
    return f"{SUBMITTED_DIR}/{study_file.name}"
