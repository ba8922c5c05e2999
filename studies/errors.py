"""The runner's error: a study that cannot run as asked (a study-file error is `StudyError`),
and how a message names the option to pass: the command line's flag (``--output DIR``) or,
called from the Python API, its argument (``output=DIR``).

Its own module so that the runner's collaborators (the Ray session, early stopping) raise
it without importing the runner, which imports them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar


class RunnerError(RuntimeError):
    """A study that cannot run as asked (not a study-file error); one-paragraph message."""


# ----------------------------------------------------------------------------- option names

#: each option a message may tell the caller to pass: (the command line's flag, the Python
#: API's argument, `studies.api`)
OPTION_NAMES = {
    "output": ("--output DIR", "output=DIR"),
    "tracking_uri": ("--tracking-uri URI", "tracking_uri=URI"),
    "new_version": ("--new-version", "new_version=True"),
    "max_cells": ("--max-cells N", "max_cells=N"),
    "storage": ("--storage PATH", "storage=PATH"),
    "wait": ("--wait", "wait=True"),
}

_CALLER: ContextVar[str | None] = ContextVar("studies_caller", default=None)


def option(name: str) -> str:
    """The option `name` (a key of OPTION_NAMES) as the caller passes it: the command line's
    flag, or under `caller("python")` the Python API's argument."""
    flag, argument = OPTION_NAMES[name]
    return argument if _CALLER.get() == "python" else flag


@contextmanager
def caller(kind: str) -> Iterator[None]:
    """Messages raised inside name the options of `kind`, "cli" (flags) or "python" (the
    API's arguments); the outermost caller decides (the command line's calls of the API
    keep naming flags)."""
    token = _CALLER.set(_CALLER.get() or kind)
    try:
        yield
    finally:
        _CALLER.reset(token)
