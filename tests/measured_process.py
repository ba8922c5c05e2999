"""A command run as a child process with its own exit code, output, wall time and peak memory.

On Linux a process inherits its parent's memory high-water mark through fork and exec, so a
child of a large pytest process (1.5 GB after the slow tests) reports pytest's peak as its own
`ru_maxrss`; and `RUSAGE_CHILDREN` in pytest also counts any earlier child that is reaped late.
Forked from a small wrapper process, the command's peak is its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Measured:
    code: int
    out: str
    err: str
    seconds: float
    peak_mb: float


#: Runs argv[3:] as its child and writes that child's wait status and peak RSS (KiB) to argv[1].
#: On Linux a process inherits its parent's memory high-water mark through fork and exec, so
#: the child of a large pytest process would report pytest's peak as its own; forked from this
#: small wrapper, the command's `ru_maxrss` is its own.
_MEASURING_WRAPPER = """
import json, os, subprocess, sys, threading
child = subprocess.Popen(sys.argv[3:], stdin=subprocess.DEVNULL)
timer = threading.Timer(float(sys.argv[2]), child.kill)
timer.start()
_, status, usage = os.wait4(child.pid, 0)
timer.cancel()
with open(sys.argv[1], "w") as f:
    json.dump({"status": status, "maxrss_kib": usage.ru_maxrss}, f)
"""


def run_measured(*args: str, timeout: float = 120, code: str | None = None) -> Measured:
    """`python -m studies.cli ARGS` (or `python -c CODE`) as a child process: its exit code,
    output, wall time and peak resident memory (its own `ru_maxrss`, read by a small wrapper
    process that forks it: see _MEASURING_WRAPPER)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    command = [sys.executable, "-c", code] if code is not None else [sys.executable, "-m", "studies.cli", *args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "measured.json"
        started = time.monotonic()
        subprocess.run(
            [sys.executable, "-c", _MEASURING_WRAPPER, str(report), str(timeout), *command],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            timeout=timeout + 60,
            check=True,
        )
        seconds = time.monotonic() - started
        measured = json.loads(report.read_text())
        out.seek(0)
        err.seek(0)
        return Measured(
            os.waitstatus_to_exitcode(measured["status"]),
            out.read().decode(),
            err.read().decode(),
            seconds,
            measured["maxrss_kib"] / 1024,
        )
