"""Which failures a cell retries (real local Ray, real MLflow server): an error that will
repeat is not retried; an OSError ends the cell FAILED with its message; no run stays running."""

from __future__ import annotations

import errno
import functools
import io
import json
import os
from pathlib import Path

import pytest
from test_runner import child_runs, options, write_study

pytestmark = pytest.mark.slow


def failing_fit(config, seed, on_epoch=None, checkpoint=None, *, record: str, error: str, after_epochs: int):
    """Trains `after_epochs` epochs through the real trainer's callback, then raises `error`;
    appends one line per attempt to `record` (so the test counts the attempts)."""
    from setvalued.training import fit

    with open(record, "a") as handle:
        handle.write(json.dumps({"pid": os.getpid(), "resumed": checkpoint is not None}) + "\n")

    def on(epoch, metrics, state):
        on_epoch(epoch, metrics, state)
        if epoch + 1 >= after_epochs:
            if error == "disk":
                raise OSError(errno.ENOSPC, "No space left on device", "/shared/ckpt")
            raise RuntimeError(f"{error} (attempt by pid {os.getpid()})" if error == "flaky" else error)

    if after_epochs == 0:
        raise ValueError("data.root points at nothing useful")
    return fit(config, seed, on_epoch=on, checkpoint=checkpoint)


@pytest.mark.parametrize(
    "case, after_epochs, error, attempts, message",
    [
        ("before_the_first_epoch", 0, "-", 1, "ValueError: data.root points at nothing useful"),
        ("the_same_error_twice", 1, "CUDA error: an illegal memory access", 2, "CUDA error: an illegal memory access"),
        ("a_full_disk", 1, "disk", 1, "No space left on device"),
        ("a_new_error_each_time", 1, "flaky", 4, "flaky (attempt by pid"),
    ],
)
def test_failure_policy(local_ray, mlflow_server, tmp_path, case, after_epochs, error, attempts, message):
    name = f"fail-{case.replace('_', '-')}"
    path = write_study(tmp_path, name, lrs=[0.1], seeds=[0], epochs=10, max_failures=3)
    record = tmp_path / "attempts.jsonl"
    fit_fn = functools.partial(failing_fit, record=str(record), error=error, after_epochs=after_epochs)
    stream = io.StringIO()
    outcome = run_study_quietly(path, options(tmp_path, mlflow_server, fit_fn=fit_fn, stream=stream))
    assert outcome.exit_code == 1, stream.getvalue()
    assert len(record.read_text().splitlines()) == attempts, stream.getvalue()[-3000:]
    (run,) = child_runs(mlflow_server, name)
    assert run.data.tags["studies.status"] == "failed"
    assert run.info.status == "FAILED"
    assert message in run.data.tags["studies.error"]
    assert message in next(iter(outcome.failed.values()))


def run_study_quietly(path: Path, opts):
    from studies.running.runner import run_study

    return run_study(path, opts)
