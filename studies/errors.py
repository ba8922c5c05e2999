"""The runner's error: a study that cannot run as asked (a study-file error is `StudyError`).

Its own module so that the runner's collaborators (the Ray session, early stopping) raise
it without importing the runner, which imports them.
"""

from __future__ import annotations


class RunnerError(RuntimeError):
    """A study that cannot run as asked (not a study-file error); one-paragraph message."""
