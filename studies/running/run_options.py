"""`RunOptions`: how a study is run (the flags of `studies run`), read by the runner
(`studies.running.runner`) and its session (`studies.running.session`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO


@dataclass
class RunOptions:
    """How to run a study (the CLI flags of `studies run`)."""

    output: Path = Path("studies_out")
    tracking_uri: str | None = None  # default: sqlite:///<output>/<name>/mlflow.db
    address: str | None = None  # Ray cluster address; None: a local Ray instance
    smoke: bool = False
    smoke_epochs: int = 1  # the epochs of a smoke run's cells (`--smoke-epochs`)
    dry_run: bool = False
    report: bool = True
    num_cpus: int | None = None  # local Ray only; default: the machine's CPUs
    num_gpus: int | None = None  # local Ray only; default: detected
    object_store_mb: int | None = None  # local Ray only
    storage: str | None = None  # Tune storage (shared path or URI on a multi-node cluster)
    fit_fn: Callable | None = None  # default: setvalued.train.fit
    progress_interval_s: float = 30.0
    stream: IO[str] | None = None
    max_cells: int | None = None  # raises the study's cell limit (default: the file's, else 100,000)
    wait: bool = False  # wait for another driver of the same study to finish instead of refusing
    verbose: bool = False  # show the INFO logs of MLflow, alembic and Ray
    overrides: tuple[str, ...] = ()  # `key=value` words applied to the study file (studies.studyfile.overrides)
    dashboard: bool = False  # local Ray only: start Ray's dashboard (on 127.0.0.1) and print its address
    new_version: bool = False  # a changed study file is kept as a new version of the study (studies.running.versions)
    keep_finished: bool = False  # finished cells trained by other code or data are kept knowingly (.identity)


def smoke_epochs_of(smoke: bool, epochs: int | None) -> int:
    """The epochs of the smoke run that `--smoke` and `--smoke-epochs N` ask for (N implies
    --smoke; --smoke alone: 1), 0 for no smoke run; ValueError naming the flag below 1."""
    if epochs is not None and epochs < 1:
        raise ValueError(f"--smoke-epochs: expected a whole number of epochs of at least 1, got {epochs}")
    if epochs is None:
        return 1 if smoke else 0
    return epochs
