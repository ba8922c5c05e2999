"""The Python API, for notebooks and scripts: what the ``studies`` command does, as functions,
and a study's results as pandas tables (docs/notebook.md walks through it).

::

    from studies import api

    api.set_output("studies_out")                          # once (or STUDIES_OUTPUT=...)
    study = api.load("studies/catalog/quickstart.yaml")   # validated; StudyError if not
    print(api.dry_run(study))                              # the cells, nothing started
    outcome = api.run("studies/catalog/quickstart.yaml", smoke=True)
    cells = api.table(outcome.study_name)                  # one row per finished cell
    curves = api.histories(outcome.study_name, ["val/top5"])  # per epoch, tidy
    api.report(outcome.study_name)                         # path of report.html
    api.compare(["imbalance_a", "imbalance_b"], reference="ce")  # studies side by side

Every function takes the same ``output`` folder and ``tracking_uri`` as the command line. The
output folder is, in this order: the ``output`` argument, the folder given to `set_output`,
the environment variable ``STUDIES_OUTPUT`` (which the command line's ``--output`` default
reads too), ``studies_out``. The tracking URI defaults to the one the study was run with, else
its local SQLite file.

Units: `table` and `histories` give accuracies (the fraction metrics: top-K, average-K,
coverage...) in percent, as the report does, and every other metric as logged; the unit of
each metric is in ``DataFrame.attrs["units"]`` (``"%"`` or ``""``), and `histories` states it
on every row (column ``unit``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

from studies.errors import caller, option

__all__ = [
    "load",
    "cells",
    "dry_run",
    "run",
    "resume",
    "locate",
    "collect",
    "report",
    "table",
    "histories",
    "compare",
    "compare_scores",
    "comparison_folder",
    "set_output",
    "output_folder",
    "DEFAULT_OUTPUT",
    "OUTPUT_ENV",
]

DEFAULT_OUTPUT = "studies_out"
#: the environment variable naming the output folder (the API's and the command line's)
OUTPUT_ENV = "STUDIES_OUTPUT"
PathLike = str | Path
_output: Path | None = None  # set_output's folder


F = TypeVar("F", bound=Callable)


def _python_arguments(function: F) -> F:
    """Its errors name this API's arguments (``output=DIR``), not the command line's flags
    (``--output DIR``); called by the command line, they keep naming the flags."""

    @functools.wraps(function)
    def named(*args, **kwargs):
        with caller("python"):
            return function(*args, **kwargs)

    return named  # type: ignore[return-value]


def set_output(path: PathLike | None) -> Path | None:
    """Make `path` the output folder of every later call that names none (None: back to
    ``STUDIES_OUTPUT``, else ``studies_out``); returns it."""
    global _output
    _output = None if path is None else Path(path)
    return _output


def default_output() -> Path:
    """The output folder when a call names none: `set_output`'s, else ``$STUDIES_OUTPUT``, else
    ``studies_out`` (relative to the working directory)."""
    return _output or Path(os.environ.get(OUTPUT_ENV) or DEFAULT_OUTPUT)


def output_folder(output: PathLike | None = None) -> Path:
    """`output` if given, else `default_output()`."""
    return Path(output) if output is not None else default_output()


@_python_arguments
def load(path: PathLike, max_cells: int | None = None, overrides: Sequence[str] = ()):
    """The validated :class:`~studies.studyfile.study.Study` of a study file (raises ``StudyError``);
    ``overrides``: ``key=value`` strings as on the command line (``["optim.lr=0.01"]``)."""
    from studies.studyfile.spec import load_study

    return load_study(path, max_cells=max_cells, overrides=overrides)


@_python_arguments
def cells(study, smoke: bool = False, smoke_epochs: int = 1) -> list:
    """The study's cells (``studies.cells.space.Cell``: config, seed, variant, swept values);
    with ``smoke``, those of its smoke run of ``smoke_epochs`` epochs."""
    from studies.cells.space import expand, smoke_cells

    expanded = expand(study)
    return smoke_cells(expanded, smoke_epochs) if smoke else expanded


@_python_arguments
def dry_run(study, smoke: bool = False, smoke_epochs: int = 1) -> str:
    """The ``--dry-run`` table of the study's cells."""
    from studies.cells.space import format_cells_table

    return format_cells_table(cells(study, smoke, smoke_epochs), study)


def _options(output: PathLike | None, tracking_uri: str | None, **given: Any) -> Any:
    from studies.running.runner import RunOptions

    return RunOptions(
        output=output_folder(output), tracking_uri=tracking_uri, **{k: v for k, v in given.items() if v is not None}
    )


@_python_arguments
def run(
    path: PathLike,
    *,
    output: PathLike | None = None,
    tracking_uri: str | None = None,
    address: str | None = None,
    smoke: bool = False,
    smoke_epochs: int = 1,
    report: bool = True,
    num_cpus: int | None = None,
    storage: str | None = None,
    stream: IO[str] | None = None,
    overrides: Sequence[str] = (),
    new_version: bool = False,
    wait: bool = False,
    keep_warm: float | None = None,
):
    """Run (or complete) a study file, as ``studies run`` (``overrides``: its ``key=value``
    words; ``smoke``, ``smoke_epochs``: ``--smoke``, ``--smoke-epochs``; ``new_version``:
    ``--new-version``; ``wait``: ``--wait``; ``keep_warm``: ``--keep-warm MINUTES``); returns the
    ``RunOutcome`` (``exit_code``, ``study_name``, ``finished``, ``failed``, ``report_path``...)."""
    from studies.running.runner import run_study

    return run_study(
        path,
        _options(
            output,
            tracking_uri,
            address=address,
            smoke=smoke,
            smoke_epochs=smoke_epochs,
            report=report,
            num_cpus=num_cpus,
            storage=storage,
            stream=stream,
            overrides=tuple(overrides),
            new_version=new_version,
            wait=wait,
            keep_warm=keep_warm,
        ),
    )


@_python_arguments
def resume(
    name: str,
    *,
    output: PathLike | None = None,
    tracking_uri: str | None = None,
    address: str | None = None,
    stream: IO[str] | None = None,
):
    """Complete an interrupted study by name, as ``studies resume``."""
    from studies.running.runner import resume_study

    return resume_study(name, _options(output, tracking_uri, address=address, stream=stream))


@_python_arguments
def locate(name: str, *, output: PathLike | None = None, tracking_uri: str | None = None) -> tuple[Path, str]:
    """(study folder, tracking URI) of a study run under ``output``. The folder is confined to
    ``output`` and a local store must be a complete SQLite file: ``ReadBackError`` (naming the
    studies that exist, or the file and what was expected) otherwise. Creates nothing."""
    from studies.readback import check_sqlite_store, study_folder, unknown_study
    from studies.running.runner import read_settings
    from studies.tracking import default_tracking_uri

    output = output_folder(output)
    study_dir = study_folder(output, name)
    uri = tracking_uri or read_settings(study_dir).get("tracking_uri")
    if uri is None:
        if not (study_dir / "mlflow.db").exists():
            raise unknown_study(
                name,
                output,
                f"no run.json, no mlflow.db in {study_dir}; or pass {option('tracking_uri')} where it is tracked",
            )
        uri = default_tracking_uri(study_dir)
    check_sqlite_store(uri)
    return study_dir, uri


@_python_arguments
def collect(name: str, *, output: PathLike | None = None, tracking_uri: str | None = None):
    """The study's runs from MLflow (``analysis.collect.Collected``: ``table`` holds one row
    per finished cell, ``failed`` the others; ``.table.to_pandas()`` for pandas)."""
    from analysis.collect import collect as collect_runs
    from studies.tracking.retry import with_retry

    _, uri = locate(name, output=output, tracking_uri=tracking_uri)
    return with_retry(lambda: collect_runs(uri, name))  # a locked store is waited for, as `run` does


@_python_arguments
def report(
    name: str, *, output: PathLike | None = None, tracking_uri: str | None = None, difference: float | None = None
) -> Path:
    """Build the study's HTML + Markdown report, as ``studies report``; the HTML's path
    (``difference``: ``--difference``, the smallest difference of interest of the power plans)."""
    from analysis.report import build_report

    study_dir, uri = locate(name, output=output, tracking_uri=tracking_uri)
    from studies.readback import check_study_copy
    from studies.tracking.retry import with_retry

    study_file = study_dir / "study.yaml"
    if os.path.lexists(study_file):
        check_study_copy(study_file)  # read with the study file's bounds, or refused by name
    return with_retry(
        lambda: build_report(
            uri,
            name,
            study_dir / "report",  # waits on a locked store
            study_file=study_file if os.path.lexists(study_file) else None,
            difference=difference,
        )
    )


@_python_arguments
def table(
    name: str,
    metrics: Sequence[str] | None = None,
    *,
    output: PathLike | None = None,
    tracking_uri: str | None = None,
):
    """One row per finished cell as a pandas DataFrame: ``cell``, ``config`` (its id),
    ``label`` (the report's name of the config), ``variant``, ``seed``, one column per swept
    parameter (``loss.epsilon``; None where a config does not sweep it), then the `metrics`
    (default: all; their last values), accuracies in percent (``attrs["units"]``)."""
    from analysis.frames import cells_frame

    return cells_frame(collect(name, output=output, tracking_uri=tracking_uri), metrics)


@_python_arguments
def histories(name: str, metrics: Sequence[str], *, output: PathLike | None = None, tracking_uri: str | None = None):
    """Per-epoch values of any logged `metrics` (``val/top5``, ``train/loss``...) of every
    finished cell, as a tidy pandas DataFrame: one row per (cell, metric, epoch) with the
    columns of `table` before ``epoch``, ``metric``, ``value`` (accuracies in percent) and
    ``unit``."""
    from analysis.frames import histories_frame
    from studies.tracking.retry import with_retry

    collected = collect(name, output=output, tracking_uri=tracking_uri)
    if isinstance(metrics, str):
        metrics = [metrics]
    return with_retry(lambda: histories_frame(collected, metrics))


def _compared(names: Sequence[str], output: PathLike | None, tracking_uri: str | None) -> tuple[list, list]:
    """The collected studies (`analysis.collect.Collected`) and their runs as the comparison
    reads them (`analysis.comparison.StudyRuns`)."""
    from analysis.comparison import study_runs_of

    if isinstance(names, str):
        names = [names]
    collected = [collect(name, output=output, tracking_uri=tracking_uri) for name in names]
    return collected, [study_runs_of(c) for c in collected]


def comparison_folder(names: Sequence[str], output: PathLike | None = None) -> Path:
    """Where `compare` writes by default: ``OUTPUT/comparisons/<a>+<b>+...`` (the names cut
    short with a digest of all of them when long)."""
    import hashlib

    joined = "+".join(names)
    if len(joined) > 100:
        digest = hashlib.sha256(joined.encode()).hexdigest()[:8]
        joined = f"{names[0][:60]}+{len(names) - 1}-more-{digest}"
    return output_folder(output) / "comparisons" / joined


@_python_arguments
def compare(
    names: Sequence[str],
    *,
    metric: str | None = None,
    reference: str | None = None,
    rename: dict[str, str] | None = None,
    level: float = 0.95,
    resamples: int | None = None,
    to: PathLike | None = None,
    output: PathLike | None = None,
    tracking_uri: str | None = None,
) -> Path:
    """Compare finished studies side by side, as ``studies compare`` (docs/comparison.md): each
    study, or each value of a parameter all its variants sweep, is a task; the HTML report's path
    (``to``, default `comparison_folder`). ``rename``: ``{"old": "new"}`` or
    ``{"study:old": "new"}`` to match variants named differently; ``CompareError`` when the
    studies cannot be compared as asked."""
    from analysis.comparison import DEFAULT_RESAMPLES, sources_of, write_comparison
    from analysis.comparison import compare as compare_studies

    collected, runs = _compared(names, output, tracking_uri)
    comparison = compare_studies(
        runs,
        metric,
        reference=reference,
        level=level,
        rename=rename,
        n_resamples=resamples or DEFAULT_RESAMPLES,
    )
    target = Path(to) if to is not None else comparison_folder([c.study_name for c in collected], output)
    return write_comparison(comparison, target, sources_of(collected))


@_python_arguments
def compare_scores(
    names: Sequence[str],
    metric: str | None = None,
    *,
    rename: dict[str, str] | None = None,
    output: PathLike | None = None,
    tracking_uri: str | None = None,
):
    """The values a comparison ranks, as a tidy pandas DataFrame: one row per (task, variant,
    seed) with ``task``, ``study``, ``variant``, ``config`` (the config that stands for the
    variant on the task), ``seed``, ``value`` (accuracies in percent) and ``metric``."""
    import pandas as pd

    from analysis.comparison import task_scores
    from analysis.intervals import is_fraction_metric

    _, runs = _compared(names, output, tracking_uri)
    scores = task_scores(runs, metric, rename=rename)
    factor = 100.0 if is_fraction_metric(scores.metric) else 1.0
    rows = [
        {
            "task": scores.tasks[t].label,
            "study": scores.tasks[t].study,
            "variant": variant,
            "config": entry.config_id,
            "seed": seed,
            "value": value * factor,
            "metric": scores.metric,
        }
        for (t, variant), entry in sorted(
            scores.entries.items(), key=lambda item: (item[0][0], scores.variants.index(item[0][1]))
        )
        for seed, value in zip(entry.seeds, entry.values)
    ]
    frame = pd.DataFrame(rows, columns=["task", "study", "variant", "config", "seed", "value", "metric"])
    frame.attrs["units"] = {scores.metric: "%" if factor == 100.0 else ""}
    return frame
