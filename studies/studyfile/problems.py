"""Problems of a study file and the one error that reports them.

Every check of a study file adds :class:`Problem` objects (a YAML path and a message) and
raises them together as :class:`Problems`; ``studies.studyfile.spec`` turns them into one
:class:`StudyError`, a single paragraph naming the file, the path of each field, its line and
what was expected.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "Path_",
    "Problem",
    "Problems",
    "StudyError",
    "format_yaml_path",
    "line_of",
    "dedupe",
    "MAX_PROBLEMS_SHOWN",
    "did_you_mean",
]

#: at most this many problems are spelled out in one StudyError
MAX_PROBLEMS_SHOWN = 8

#: a YAML path as a tuple of keys and list indices: ("design", 0, "parameters", "loss.k")
Path_ = tuple[str | int, ...]
#: the line of each YAML path of a study file, or the command-line override that set it
Lines = dict[Path_, int | str]


@dataclass(frozen=True)
class Problem:
    """One mistake: where (YAML path as a tuple of keys and indices) and what was expected."""

    path: Path_
    message: str


class Problems(Exception):
    """A batch of problems with YAML paths, raised by a check and turned into a StudyError."""

    def __init__(self, problems: list[Problem]):
        super().__init__(problems)
        self.problems = problems


def format_yaml_path(path: Iterable[str | int]) -> str:
    """``("design", 0, "parameters", "loss.epsilon")`` -> ``design[0].parameters.loss.epsilon``."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + str(part)
    return text or "(top level)"


class StudyError(ValueError):
    """A study file that cannot be run. ``str(err)`` is one paragraph for the user.

    Attributes: ``file`` (the path as given), ``problems`` (list of
    ``(yaml_path, line or None, message)``; in place of a line, the text of where else the
    value came from, such as ``override optim.lr=-1``).
    """

    def __init__(self, file: str, problems: list[tuple[str, int | str | None, str]]):
        self.file = file
        self.problems = problems
        super().__init__(self._paragraph())

    def _paragraph(self) -> str:
        parts = []
        for path, line, message in self.problems[:MAX_PROBLEMS_SHOWN]:
            # a line of the file, or where else the value came from (a command-line override)
            where = path if line is None else f"{path} (line {line})" if isinstance(line, int) else f"{path} ({line})"
            parts.append(f"{where}: {message}")
        if len(self.problems) == 1:
            body = parts[0]
        else:
            body = "; ".join(f"({i}) {p}" for i, p in enumerate(parts, 1))
            if len(self.problems) > MAX_PROBLEMS_SHOWN:
                body += f"; and {len(self.problems) - MAX_PROBLEMS_SHOWN} more"
        count = "" if len(self.problems) == 1 else f" ({len(self.problems)} problems)"
        body = body.rstrip(" .")
        text = f"Invalid study file '{self.file}'{count}: {body}. No trial was started."
        return re.sub(r"\s*\n\s*", " ", text)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'seeds'?)"`` when a choice is close to ``word`` (difflib), else ``""``."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def line_of(lines: Lines, path: Path_) -> int | str | None:
    """Line of the longest prefix of ``path`` that is in the file (keys compared as text), or
    the override that set it (``"override optim.lr=-1"``)."""
    path = tuple(path)
    for n in range(len(path), 0, -1):
        prefix = tuple(p if isinstance(p, int) else str(p) for p in path[:n])
        if prefix in lines:
            return lines[prefix]
    return None


def dedupe(problems: list[Problem]) -> list[Problem]:
    """The problems in order, each (path, message) once."""
    seen, out = set(), []
    for p in problems:
        key = (tuple(p.path), p.message)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out
