"""Every MLflow call of a study is retried while SQLite is locked or the tracking server does
not answer (`with_retry`): parallel workers share one SQLite file in the embedded default, and
a study must outlive a tracking server's restart."""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _is_locked_error(error: BaseException) -> bool:
    text = str(error).lower()
    return "database is locked" in text or "database table is locked" in text


#: what a tracking server that is down or restarting answers, through requests and MLflow
_OUTAGE_SIGNS = (
    "connection refused",
    "max retries exceeded",
    "failed to establish a new connection",
    "connection aborted",
    "remote end closed connection",
    "bad gateway",
    "service unavailable",
    "gateway timeout",
    "read timed out",
    "connection reset",
    # a server whose database connection pool is used up by concurrent writers
    "queuepool limit",
)
#: how long an unanswering tracking server is waited for before the error is raised
OUTAGE_PATIENCE_S = 15 * 60.0
_outage_warned = False


def _is_outage(error: BaseException) -> bool:
    text = f"{type(error).__name__}: {error}".lower()
    return isinstance(error, ConnectionError) or any(sign in text for sign in _OUTAGE_SIGNS)


def _warn_outage(error: BaseException) -> None:
    global _outage_warned
    if not _outage_warned:
        _outage_warned = True
        first = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
        print(
            f"[studies] warning: the tracking server does not answer ({first}); retrying with backoff "
            f"for up to {OUTAGE_PATIENCE_S / 60:.0f} minutes, nothing is lost meanwhile",
            file=sys.stderr,
            flush=True,
        )


_locked_warned = False


def _warn_locked(error: BaseException) -> None:
    """One line per process, the first time the store is found locked (MLflow's traceback of
    each locked request: --verbose, `quiet_locked_store_logs`)."""
    global _locked_warned
    if not _locked_warned:
        _locked_warned = True
        print(
            "[studies] warning: the tracking store is locked by another process; waiting for it "
            "(nothing is lost meanwhile; MLflow's details with --verbose)",
            file=sys.stderr,
            flush=True,
        )


#: the logger MLflow's SQL store logs each failed request on, with its traceback, before the
#: error reaches `with_retry`
MLFLOW_DB_LOGGER = "mlflow.store.db.utils"


class _LockedStoreRecords:
    """A logging filter that drops the records of a locked SQLite store (`with_retry` waits for
    it and says so on one line)."""

    def filter(self, record) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not _is_locked_error(error if error is not None else record.getMessage())


_QUIET = _LockedStoreRecords()


def quiet_locked_store_logs(quiet: bool = True) -> None:
    """Drop (quiet) or keep MLflow's log records of a locked store: without --verbose a lock
    held by another process is one warning line, not a 60-line traceback per request."""
    import logging

    logger = logging.getLogger(MLFLOW_DB_LOGGER)
    logger.removeFilter(_QUIET)
    if quiet:
        logger.addFilter(_QUIET)


def with_retry(
    action: Callable[[], T],
    *,
    attempts: int = 12,
    first_delay_s: float = 0.05,
    max_delay_s: float = 5.0,
    outage_patience_s: float | None = None,
) -> T:
    """Run `action`, retrying with jittered exponential backoff while SQLite is locked or the
    tracking server does not answer.

    Parallel trial workers write to one SQLite file in the embedded default; SQLite lets one
    writer in at a time and answers "database is locked" to the others when its busy
    timeout runs out (mlflow#6490): up to `attempts` tries. A tracking server that is down
    (connection refused, 502/503/504) is waited for up to `outage_patience_s` (default
    OUTAGE_PATIENCE_S), with one warning per process, so that a study outlives a server
    restart. Other errors are raised at once.
    """
    patience = OUTAGE_PATIENCE_S if outage_patience_s is None else outage_patience_s
    delay = first_delay_s
    deadline = None
    attempt = 0
    while True:
        try:
            return action()
        except Exception as error:  # MlflowException, sqlalchemy OperationalError, requests errors
            attempt += 1
            if _is_outage(error):
                deadline = deadline or time.monotonic() + patience
                if time.monotonic() >= deadline:
                    raise
                _warn_outage(error)
                time.sleep(min(delay * 4, 30.0) * (0.5 + random.random()))
                delay = min(delay * 2.0, 30.0)
                continue
            if not _is_locked_error(error) or attempt >= attempts:
                raise
            _warn_locked(error)
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2.0, max_delay_s)
