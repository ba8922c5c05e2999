"""The Ray jobs of submitted studies: their status, their logs followed to the end, the list
of jobs, stopping one (`studies jobs`, `studies logs`, `studies stop`).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import warnings
from typing import IO

from studies.cluster.connection import SubmitError, job_client, local_secrets, mask_secrets
from studies.running.termination import JOB_STOP_GRACE_S

TERMINAL_STATUSES = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})


def job_status(address: str | None, job_id: str, *, token_file: str | os.PathLike | None = None) -> str:
    """The job's status as a string: PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED."""
    client, _ = job_client(address, token_file)
    return _status(client, job_id)


def _status(client, job_id: str) -> str:
    try:
        status = client.get_job_status(job_id)
    except RuntimeError as error:
        raise SubmitError(f"no job {job_id!r} on this cluster ({str(error).splitlines()[0]})") from None
    except OSError as error:  # requests' ConnectionError: the head went away
        raise SubmitError(
            f"lost contact with the Ray Jobs API while asking about job {job_id!r}: {type(error).__name__}"
        ) from None
    return str(getattr(status, "value", status))


def wait_for_job(
    address: str | None,
    job_id: str,
    timeout_s: float | None = None,
    *,
    token_file: str | os.PathLike | None = None,
    poll_s: float = 1.0,
) -> str:
    """Block until the job ends (or `timeout_s` passes); returns its last status."""
    client, _ = job_client(address, token_file)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        status = _status(client, job_id)
        if status in TERMINAL_STATUSES:
            return status
        if deadline is not None and time.monotonic() > deadline:
            return status
        time.sleep(poll_s)


def follow_job(client, job_id: str, stream: IO[str], secret_values: list[str]) -> str:
    """Stream the job's log until it ends; returns the final status."""

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            stream.write(mask_secrets(chunk, secret_values))
            stream.flush()

    try:
        with warnings.catch_warnings():
            # Ray's own log socket call (ray 2.60, sdk.tail_job_logs) trips aiohttp's
            # "ssl=None is deprecated"; not ours to fix, and noise for the user
            warnings.filterwarnings("ignore", message="ssl=None is deprecated", category=DeprecationWarning)
            asyncio.run(tail())
    except RuntimeError:
        # the log socket closed early (e.g. the head restarted): fall back to polling
        pass
    while True:
        status = _status(client, job_id)
        if status in TERMINAL_STATUSES:
            return status
        time.sleep(1.0)


def job_logs(
    address: str | None,
    job_id: str,
    follow: bool = False,
    *,
    token_file: str | os.PathLike | None = None,
    stream: IO[str] | None = None,
) -> str:
    """Write the job's log to `stream` (stdout by default), masked of local secrets;
    `follow`: keep streaming until the job ends. Returns the job's status afterwards."""
    client, token = job_client(address, token_file)
    stream = stream or sys.stdout
    secret_values = local_secrets(token)
    if follow:
        return follow_job(client, job_id, stream, secret_values)
    status = _status(client, job_id)  # a clear error for an unknown job first
    stream.write(mask_secrets(client.get_job_logs(job_id), secret_values))
    stream.flush()
    return status


def list_jobs(address: str | None = None, *, token_file: str | os.PathLike | None = None) -> list:
    """The cluster's jobs (Ray `JobDetails`), oldest first."""
    client, _ = job_client(address, token_file)
    jobs = [job for job in client.list_jobs() if job.submission_id]
    return sorted(jobs, key=lambda job: job.start_time or 0)


#: how long `studies stop` waits for the job to end: the grace its driver gets to close its
#: runs between SIGTERM and SIGKILL (studies.running.termination.JOB_STOP_GRACE_S), and a margin
STOP_WAIT_S = JOB_STOP_GRACE_S + 10.0


def stop_job(
    address: str | None, job_id: str, *, token_file: str | os.PathLike | None = None, wait_s: float | None = STOP_WAIT_S
) -> bool:
    """Ask the job to stop (SIGTERM to the driver, then SIGKILL once its grace is over); with
    `wait_s`, wait that long for it to end. Returns True when the job was running."""
    client, _ = job_client(address, token_file)
    _status(client, job_id)
    stopped = bool(client.stop_job(job_id))
    if wait_s:
        deadline = time.monotonic() + wait_s
        while _status(client, job_id) not in TERMINAL_STATUSES and time.monotonic() < deadline:
            time.sleep(0.5)
    return stopped
