"""SIGTERM and SIGHUP handled like Ctrl-C: how `timeout`, systemd, Slurm and Kubernetes stop a
job (SIGTERM) and a closed terminal or SSH session (SIGHUP) end a driver.

While a run is under `trapped()`, each raises `Terminated` (a `KeyboardInterrupt`) in the main
thread, so the runner's Ctrl-C path runs: the trials stop, the runs are marked, the resume
command is printed, and the exit code is 128 + the signal's number (143, 129). `ray.init`
installs its own SIGTERM handler (an exit that aborts in Ray's C++ core, exit code 134), so
`trap()` is called again once Ray has started. After the runner has stopped Ray, the cell runs
its trials left RUNNING and the parent run end KILLED in MLflow with the signal as their
reason (`studies.running.runner`), within `CLOSE_PATIENCE_S` of an unanswering server.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Terminated", "trap", "trapped", "exit_code", "TRAPPED_SIGNALS"]

TRAPPED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
#: the exit code of a run stopped by Ctrl-C (SIGINT)
INTERRUPTED_EXIT = 130
#: how long a stopped driver waits for an unanswering tracking server while it closes the
#: runs its trials left RUNNING (then it exits; those runs stay RUNNING until the resume)
CLOSE_PATIENCE_S = 20.0
#: the seconds a stopped driver gets between SIGTERM and SIGKILL from `ray job stop`
#: (`studies stop`; Ray's default is 3 s): stopping Tune and Ray, closing the runs with
#: `CLOSE_PATIENCE_S` to spare, releasing the lease. `studies submit` sets it in the job's
#: environment (RAY_JOB_STOP_WAIT_TIME_S, read by the job's supervisor)
JOB_STOP_GRACE_S = 60


class Terminated(KeyboardInterrupt):
    """A run stopped by SIGTERM or SIGHUP; `signum` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: the signal that stopped the current run (Tune may re-raise a plain KeyboardInterrupt)
_received: list[int] = []


def _raise(signum: int, frame) -> None:
    _received.append(signum)
    for trapped_signal in TRAPPED_SIGNALS:  # once: the cleanup that follows is not cut short
        signal.signal(trapped_signal, signal.SIG_IGN)
    raise Terminated(signum)


def trap() -> None:
    """Make SIGTERM and SIGHUP raise `Terminated` (main thread only; elsewhere nothing)."""
    if threading.current_thread() is threading.main_thread():
        for trapped_signal in TRAPPED_SIGNALS:
            signal.signal(trapped_signal, _raise)


@contextmanager
def trapped() -> Iterator[None]:
    """`trap()` for the duration of a run; the handlers before it are restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in TRAPPED_SIGNALS}
    _received.clear()
    trap()
    try:
        yield
    finally:
        for trapped_signal, handler in before.items():
            signal.signal(trapped_signal, handler if handler is not None else signal.SIG_DFL)


def _signum(stop: KeyboardInterrupt) -> int | None:
    return stop.signum if isinstance(stop, Terminated) else (_received[0] if _received else None)


def exit_code(stop: KeyboardInterrupt) -> int:
    """128 + the number of the signal that stopped the run, 130 for Ctrl-C."""
    signum = _signum(stop)
    return INTERRUPTED_EXIT if signum is None else 128 + signum


def describe(stop: KeyboardInterrupt) -> str:
    """'interrupted' (Ctrl-C) or 'terminated by SIGTERM'."""
    signum = _signum(stop)
    return "interrupted" if signum is None else f"terminated by {signal.Signals(signum).name}"
