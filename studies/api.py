"""The Python API, for notebooks and scripts: what the ``studies`` command does, as functions.

::

    from studies import api

    study = api.load("studies/catalog/quickstart.yaml")   # validated; StudyError if not
    print(api.dry_run(study))                              # the cells, nothing started
    outcome = api.run("studies/catalog/quickstart.yaml", smoke=True)
    runs = api.collect(outcome.study_name)                 # analysis.collect.Collected
    runs.table.to_pandas()                                 # one row per finished cell
    api.report(outcome.study_name)                         # path of report.html

Every function takes the same ``output`` folder and ``tracking_uri`` as the command line
(default: ``studies_out`` and the URI the study was run with, else its local SQLite file).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Optional, Sequence, Union

__all__ = ["load", "cells", "dry_run", "run", "resume", "locate", "collect", "report", "DEFAULT_OUTPUT"]

DEFAULT_OUTPUT = "studies_out"
PathLike = Union[str, Path]


def load(path: PathLike, max_cells: Optional[int] = None, overrides: Sequence[str] = ()):
    """The validated :class:`~studies.studyfile.study.Study` of a study file (raises ``StudyError``);
    ``overrides``: ``key=value`` strings as on the command line (``["optim.lr=0.01"]``)."""
    from studies.studyfile.spec import load_study

    return load_study(path, max_cells=max_cells, overrides=overrides)


def cells(study, smoke: bool = False, smoke_epochs: int = 1) -> list:
    """The study's cells (``studies.cells.space.Cell``: config, seed, variant, swept values);
    with ``smoke``, those of its smoke run of ``smoke_epochs`` epochs."""
    from studies.cells.space import expand, smoke_cells

    expanded = expand(study)
    return smoke_cells(expanded, smoke_epochs) if smoke else expanded


def dry_run(study, smoke: bool = False, smoke_epochs: int = 1) -> str:
    """The ``--dry-run`` table of the study's cells."""
    from studies.cells.space import format_cells_table

    return format_cells_table(cells(study, smoke, smoke_epochs), study)


def _options(output: PathLike, tracking_uri: Optional[str], **given):
    from studies.running.runner import RunOptions

    return RunOptions(output=Path(output), tracking_uri=tracking_uri,
                      **{k: v for k, v in given.items() if v is not None})


def run(path: PathLike, *, output: PathLike = DEFAULT_OUTPUT, tracking_uri: Optional[str] = None,
        address: Optional[str] = None, smoke: bool = False, smoke_epochs: int = 1,
        report: bool = True, num_cpus: Optional[int] = None, storage: Optional[str] = None,
        stream: Optional[IO[str]] = None, overrides: Sequence[str] = (), new_version: bool = False):
    """Run (or complete) a study file, as ``studies run`` (``overrides``: its ``key=value``
    words; ``smoke``, ``smoke_epochs``: ``--smoke``, ``--smoke-epochs``; ``new_version``:
    ``--new-version``); returns the
    ``RunOutcome`` (``exit_code``, ``study_name``, ``finished``, ``failed``, ``report_path``...)."""
    from studies.running.runner import run_study

    return run_study(path, _options(output, tracking_uri, address=address, smoke=smoke,
                                    smoke_epochs=smoke_epochs, report=report, num_cpus=num_cpus, storage=storage, stream=stream,
                                    overrides=tuple(overrides), new_version=new_version))


def resume(name: str, *, output: PathLike = DEFAULT_OUTPUT, tracking_uri: Optional[str] = None,
           address: Optional[str] = None, stream: Optional[IO[str]] = None):
    """Complete an interrupted study by name, as ``studies resume``."""
    from studies.running.runner import resume_study

    return resume_study(name, _options(output, tracking_uri, address=address, stream=stream))


def locate(name: str, *, output: PathLike = DEFAULT_OUTPUT, tracking_uri: Optional[str] = None) -> tuple[Path, str]:
    """(study folder, tracking URI) of a study run under ``output``. The folder is confined to
    ``output`` and a local store must be a complete SQLite file: ``ReadBackError`` (naming the
    studies that exist, or the file and what was expected) otherwise. Creates nothing."""
    from studies.readback import check_sqlite_store, study_folder, unknown_study
    from studies.running.runner import read_settings
    from studies.tracking import default_tracking_uri

    study_dir = study_folder(output, name)
    uri = tracking_uri or read_settings(study_dir).get("tracking_uri")
    if uri is None:
        if not (study_dir / "mlflow.db").exists():
            raise unknown_study(name, output, f"no run.json, no mlflow.db in {study_dir}; or pass "
                                              f"--tracking-uri URI where it is tracked")
        uri = default_tracking_uri(study_dir)
    check_sqlite_store(uri)
    return study_dir, uri


def collect(name: str, *, output: PathLike = DEFAULT_OUTPUT, tracking_uri: Optional[str] = None):
    """The study's runs from MLflow (``analysis.collect.Collected``: ``table`` holds one row
    per finished cell, ``failed`` the others; ``.table.to_pandas()`` for pandas)."""
    from analysis.collect import collect as collect_runs
    from studies.tracking.retry import with_retry

    _, uri = locate(name, output=output, tracking_uri=tracking_uri)
    return with_retry(lambda: collect_runs(uri, name))  # a locked store is waited for, as `run` does


def report(name: str, *, output: PathLike = DEFAULT_OUTPUT, tracking_uri: Optional[str] = None) -> Path:
    """Build the study's HTML + Markdown report, as ``studies report``; the HTML's path."""
    from analysis.report import build_report

    study_dir, uri = locate(name, output=output, tracking_uri=tracking_uri)
    from studies.readback import check_study_copy
    from studies.tracking.retry import with_retry

    study_file = study_dir / "study.yaml"
    if os.path.lexists(study_file):
        check_study_copy(study_file)  # read with the study file's bounds, or refused by name
    return with_retry(lambda: build_report(uri, name, study_dir / "report",  # waits on a locked store
                                           study_file=study_file if os.path.lexists(study_file) else None))
