"""Run a study: every (config, seed) cell as one Ray Tune trial, tracked in MLflow, resumable.

How a study file becomes trials (`run_study`), and which module does each step:

1. validation first: `load_study` raises `StudyError` before anything starts (no Ray, no
   MLflow experiment, no output folder);
2. the cells, every config paired with the same seeds (`studies.cells.space.expand`), are handed
   to Tune config by config (`studies.cells.cell_queue`);
3. MLflow is the ledger (`studies.tracking.StudyTracking.prepare`): cells whose run is tagged
   `finished` are skipped, leftovers of an interrupted earlier run are deleted, so re-running
   the file, or `studies resume NAME`, runs only what is missing and no cell ends with two
   runs. A cell that a killed driver left unfinished continues from the last checkpoint its
   trial left, in its MLflow run (`studies.running.checkpoints`); Tune's folder is removed once every
   cell has finished;
4. Ray is connected or started (`studies.running.ray_session`), and the cells to run are Tune
   experiments of at most `MAX_TRIALS_PER_EXPERIMENT` trials (`studies.cells.arrays`, `studies.running.session`,
   `studies.running.tune_experiment`) whose trials run `studies.running.trial.run_cell`, checkpointed at
   most every `checkpoint_interval_s` and after the last epoch, so a trial whose worker dies
   restarts from its last checkpoint;
5. optuna blocks: configs asked as trial slots free up, each run on every seed, the seed mean
   told back when its last seed ends (`studies.scheduling.optuna_rounds`);
6. early stopping and ASHA (`scheduler: {kind: early_stopping | asha}`) and an optuna
   block's `pruner` are decided per config over all its seeds, by a Ray actor that every
   trial reports to (`studies.scheduling`);
7. progress while the trials run (`studies.running.progress`), then a summary, a report
   (`analysis.report.build_report`) unless disabled, and how to open the MLflow UI. The exit
   code is 0 when every cell finished, 1 otherwise, 130 when interrupted (Ctrl-C), 143 / 129
   when stopped by SIGTERM / SIGHUP (`studies.running.termination`).

Ray, Tune and Optuna are imported only once cells are about to run: a dry run loads none.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from studies.errors import RunnerError, option
from studies.running import termination
from studies.running.progress import activity, format_duration, plain_line, say
from studies.running.ray_session import RaySession
from studies.running.run_options import RunOptions
from studies.running.session import StudySession
from studies.tracking import (
    STATUS_FINISHED,
    StudyTracking,
    default_tracking_uri,
    source_tags,
    study_description,
    ui_command,
)
from studies.tracking.ui_view import study_view

__all__ = ["RunOptions", "RunOutcome", "RunnerError", "run_study", "resume_study", "read_settings", "study_dir_of"]

SETTINGS_FILE = "run.json"
STUDY_FILE = "study.yaml"
SMOKE_SUFFIX = "-smoke"


@dataclass
class RunOutcome:
    exit_code: int
    study_name: str
    study_dir: Path | None = None
    tracking_uri: str | None = None
    cells: int = 0
    finished: int = 0
    skipped: int = 0
    failed: dict = field(default_factory=dict)  # cell_id -> error or status
    report_path: Path | None = None


def study_dir_of(output: Path, name: str) -> Path:
    return Path(output).expanduser().resolve() / name


def _print(stream: IO[str], text: str) -> None:
    """A line of the runner: fitted to a terminal's width, or headed by the time."""
    print(plain_line(text, stream), file=stream, flush=True)


# ----------------------------------------------------------------------------- entry points


def _settings_path(study_dir: Path) -> Path:
    return study_dir / SETTINGS_FILE


#: run.json's fields and their types (checked when read back: ReadBackError naming the file)
SETTINGS_FIELDS = {
    "name": str,
    "source": str,
    "tracking_uri": str,
    "smoke": bool,
    "smoke_epochs": int,
    "address": str,
    "version": str,
}


def read_settings(study_dir: Path) -> dict:
    """The settings a study was run with (run.json), {} when there are none; a run.json that
    is not a small regular file holding a JSON object of those fields is refused by name."""
    from studies.readback import MAX_SETTINGS_BYTES, read_json

    path = _settings_path(study_dir)
    if not os.path.lexists(path):
        return {}
    return read_json(
        path,
        MAX_SETTINGS_BYTES,
        "the study's run settings written by `studies run` "
        "(a JSON object: name, source, tracking_uri, smoke, smoke_epochs, address)",
        SETTINGS_FIELDS,
    )


def _load(study_file: str | Path, options: RunOptions) -> tuple[Any, list, str]:
    """(study, cells, run name), validated; a smoke run's tiny version when asked."""
    from studies.cells.space import expand, smoke_cells, smoke_study
    from studies.studyfile.spec import load_study

    study = load_study(study_file, max_cells=options.max_cells, overrides=options.overrides)
    if study.name.endswith(SMOKE_SUFFIX):  # NAME-smoke is the smoke run's folder and experiment
        from studies.studyfile.problems import StudyError

        raise StudyError(
            str(study_file),
            [
                (
                    "name",
                    study.line_of(("name",)),
                    f"{study.name!r} ends with {SMOKE_SUFFIX!r}, which names the smoke "
                    f"runs of study {study.name[: -len(SMOKE_SUFFIX)]!r} (`--smoke`); "
                    f"expected a name without that ending",
                )
            ],
        )
    cells = expand(study)
    if options.smoke:
        cells = smoke_cells(cells, options.smoke_epochs)
        study = smoke_study(study)
    return study, cells, study.name + (SMOKE_SUFFIX if options.smoke else "")


def _prepare_study_dir(
    study_file: str | Path, name: str, options: RunOptions, resolved: str = "", version: str = ""
) -> tuple[Path, Path, str]:
    """(study folder, its copy of the study file, tracking URI): the folder made, the file
    copied (with command-line overrides: `resolved`, the file with them applied) and the
    run's settings saved (for `studies resume`), the overrides among them."""
    from studies.running.preconditions import writable_folder

    study_dir = study_dir_of(options.output, name)
    problems = writable_folder(study_dir, "the output folder", keep=True)
    if problems:
        raise RunnerError(problems[0] + f"; pass {option('output')}")
    try:
        study_copy = study_dir / STUDY_FILE
        source = Path(study_file).resolve()
        if options.overrides:
            study_copy.write_text(resolved, encoding="utf-8")
        elif source != study_copy.resolve():
            shutil.copyfile(source, study_copy)
        saved = read_settings(study_dir)
        tracking_uri = _tracking_uri(study_dir, options)
        settings = {
            "name": name,
            "source": str(saved.get("source") or source),
            "tracking_uri": tracking_uri,
            "smoke": bool(options.smoke),
            "address": options.address,
        }
        if options.smoke:
            settings["smoke_epochs"] = int(options.smoke_epochs)
        if version:  # the study's version run last (every version: versions.json)
            settings["version"] = version
        if options.overrides:
            settings["overrides"] = list(options.overrides)
        elif source == study_copy.resolve() and saved.get("overrides"):  # a resume: the copy has them
            settings["overrides"] = saved["overrides"]
        _settings_path(study_dir).write_text(json.dumps(settings, indent=2) + "\n")
    except OSError as error:  # a full disk, a folder that changed under us
        raise RunnerError(
            f"cannot write the study folder {study_dir} ({error.strerror or error}); free space or pass "
            f"{option('output')}"
        ) from None
    return study_dir, study_copy, tracking_uri


def _tracking_uri(study_dir: Path, options: RunOptions) -> str:
    """The run's tracking store: --tracking-uri, else the one the study ran with, else its folder's."""
    return options.tracking_uri or read_settings(study_dir).get("tracking_uri") or default_tracking_uri(study_dir)


def _set_log_levels(verbose: bool) -> None:
    """No third-party INFO lines (MLflow's and alembic's database set-up, Ray's notices)
    unless --verbose: the study's own lines are what a user reads. MLflow's traceback of each
    request to a locked store too: `with_retry` waits for the store and says so on one line."""
    import logging

    from studies.tracking.retry import quiet_locked_store_logs

    quiet_locked_store_logs(not verbose)

    level = logging.INFO if verbose else logging.WARNING
    # MLflow sets its logger's level from this variable when it is imported (later, lazily)
    os.environ["MLFLOW_LOGGING_LEVEL"] = logging.getLevelName(level)
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(level)
    os.environ["STUDIES_RAY_LOG_LEVEL"] = str(logging.INFO if verbose else logging.ERROR)


def _check_preconditions(study_dir: Path, tracking_uri: str, options: RunOptions, cells: Sequence) -> None:
    """Every precondition of the run (studies.running.preconditions), before Ray or MLflow is touched."""
    from studies.running.preconditions import check_all

    data_configs = {json.dumps(c.config.get("data", {}), sort_keys=True): c.config.get("data", {}) for c in cells}
    problems = check_all(
        study_dir, tracking_uri, options.storage, data_configs.values(), configs=[c.config for c in cells]
    )
    if problems:
        raise RunnerError("; ".join(problems) + ". Nothing was started.")


def _check_before_writing(study, name: str, version, unversioned: Sequence, cells: Sequence, options, stream):
    """Every refusal of the preflight, before the study folder, its versions or MLflow is
    written (a refused run leaves nothing that blocks the corrected file): the preconditions,
    then what trains the finished cells (`studies.running.identity`; its `IdentityCheck` is how
    the run goes on: a new version with --new-version)."""
    from studies.running.identity import check_identity

    study_dir = study_dir_of(options.output, name)
    tracking_uri = _tracking_uri(study_dir, options)
    _check_preconditions(study_dir, tracking_uri, options, cells)
    return check_identity(
        study, name, study_dir, tracking_uri, version, unversioned, cells, options, lambda text: say(stream, text)
    )


def _take_lease(tracking: StudyTracking, name: str, options: RunOptions, say: Callable[[str], None]):
    """The study's lease (studies.running.lease): one driver per study, or RunnerError naming the holder."""
    from studies.running.lease import LeaseHeld, StudyLease

    lease = StudyLease(tracking.client, tracking.experiment_id, name, warn=lambda text: say(f"warning: {text}"))
    try:
        if options.wait:
            say("waiting for the other driver of this study to finish (--wait)")
        lease.acquire(wait=options.wait)
    except LeaseHeld as held:
        raise RunnerError(str(held)) from None
    return lease


def _run(session: StudySession, cells: Sequence, study_copy: Path, leases: list) -> None:
    """Run the cells that the ledger says are missing, then the optuna blocks.

    A new study (no experiment yet) starts Ray and checks that it can run here first, so a
    study that cannot run creates nothing in MLflow. Then the study's lease (one driver per
    study; it is an experiment tag, so the experiment exists from here on), and only under
    the lease the ledger, which deletes the leftovers of an interrupted run, and the trials.
    The lease is appended to `leases` for the caller to release.
    """
    study, tracking = session.study, session.tracking
    fresh = tracking.find_experiment_id() is None
    if fresh:
        session.start()
    # kept out of the session: Tune pickles the callbacks that refer to it, not a thread
    leases.append(_take_lease(tracking, session.name, session.options, session.say))
    done, pending = session.plan(cells)
    if (pending or study.optuna_blocks) and not fresh:
        session.start()
    parent_run = session.open_parent_run(study_copy)
    proposals = sum(b.n_configs for _, b in study.optuna_blocks)
    session.say(
        f"study {session.name}: {len(cells)} cells"
        + (f" (racing: at most; {session.race.summary()})" if session.race else "")
        + (f" + {proposals} optuna proposals x {len(study.seed_list)} seeds" if study.optuna_blocks else "")
        + f"; tracking {tracking.tracking_uri} (experiment {tracking.experiment_id}, "
        f"parent run {parent_run})"
    )
    if done:
        session.say(f"{len(done)} cells already finished (skipped)")
    if done and pending:
        from studies.planning.plan import remaining_estimate_line

        epochs_of = {c.cell_id: int(c.config.get("epochs", 1)) for c in cells}
        left = remaining_estimate_line(
            study, pending, session.finished_runs, epochs_of, session.options, session.resume.start_epochs()
        )
        if left:
            session.say("estimate: " + left)
    if not (pending or study.optuna_blocks):
        return
    total_hint = len(cells) + proposals * len(study.seed_list)
    if session.options.report:  # the report's modules load while the cells run, not after them
        _import_in_background("analysis.report")
    session.run_cells(pending, total=total_hint, done_before=len(done))
    session.run_optuna_blocks(total_hint, len(done))


def _import_in_background(module: str) -> None:
    """Import `module` in a daemon thread (Tune's modules first: the driver waits on its
    trials from then on); an error is left to the import that needs the module."""
    import importlib
    import threading

    import studies.running.tune_experiment  # noqa: F401 (Tune's modules, in this thread first)

    def load() -> None:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 (the report says why when it runs)
            pass

    threading.Thread(target=load, name=f"studies-import-{module}", daemon=True).start()


def run_study(study_file: str | Path, options: RunOptions | None = None) -> RunOutcome:
    """Run (or complete) the study in `study_file`; see the module docstring.

    Raises `studies.studyfile.spec.StudyError` for a bad study file (before anything starts) and
    `RunnerError` for a study that cannot run on this cluster.
    """
    options = options or RunOptions()
    stream = options.stream or sys.stdout
    _quiet_mlflow_client()
    _set_log_levels(options.verbose)
    study, cells, name = _load(study_file, options)
    if int(study.resources.seeds_per_trial) > 1:
        from studies.running.fusion_check import check_fusion

        with activity(stream, "probing the fused form of every model (resources.seeds_per_trial)"):
            check_fusion(study_file, study, cells)
    if options.dry_run:
        _print_dry_run(study, cells, stream)
        return RunOutcome(0, name, cells=len(cells))
    unversioned = cells
    version, cells = _versioned(study, cells, name, options)
    session, study_copy, to_run = _open_session(study_file, study, unversioned, cells, name, version, options, stream)
    outcome, interrupted = _run_trapped(session, to_run, study_copy, stream)
    if not outcome.failed:
        for folder in session.tune_dirs:  # Tune's folder is a per-session cache
            shutil.rmtree(folder, ignore_errors=True)
    if options.report and not interrupted:
        outcome.report_path = _build_report(session.tracking.tracking_uri, name, session.study_dir, study_copy, stream)
    _print(stream, f"[studies] MLflow UI: {ui_command(session.tracking.tracking_uri)}")
    if session.ray.warm_note():  # --keep-warm: how long the local Ray stays, and how to end it
        _print(stream, f"[studies] {session.ray.warm_note()}")
    return outcome


def _quiet_mlflow_client() -> None:
    """MLflow's client without its silent retries and its per-run console lines (workers inherit this)."""
    # MLflow's client retries a failed request silently for minutes; a few quick retries, then
    # the runner's own backoff (studies.tracking.with_retry) that says so
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    # no "View run ... at ..." line per ended run: with a server it costs a request per cell
    # and two console lines per cell from every worker (docs/scale.md)
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def _print_dry_run(study: Any, cells: list[Any], stream: IO[str]) -> None:
    """`--dry-run`: the table of cells, and the fused arrays they would train as."""
    from studies.cells.space import format_cells_table

    print(format_cells_table(cells, study), file=stream, flush=True)
    if int(study.resources.seeds_per_trial) > 1 and cells:
        from studies.cells.arrays import fused_arrays
        from studies.scheduling.racing import race_rounds

        arrays = fused_arrays(cells, int(study.resources.seeds_per_trial), round_of=race_rounds(study))
        print(
            f"as {len(arrays)} fused arrays of up to {study.resources.seeds_per_trial} seeds (one trial each)",
            file=stream,
            flush=True,
        )


def _versioned(study: Any, cells: Sequence, name: str, options: RunOptions) -> tuple[Any, list]:
    """(the study's version, the cells tagged with it) (`studies.running.versions`): a changed
    file under this name is refused here, before Ray or any file is touched, and before MLflow
    unless the folder is new and a tracking store is given (it may hold versions)."""
    from studies.running.versions import check_version, versioned_cells, versions_in_mlflow

    given = options.tracking_uri
    version = check_version(
        study,
        name,
        study_dir_of(options.output, name),
        options.new_version,
        options.smoke_epochs if options.smoke else None,
        elsewhere=(lambda: versions_in_mlflow(given, name)) if given else None,
    )
    return version, versioned_cells(cells, version)


def _open_session(
    study_file: str | Path,
    study: Any,
    unversioned: Sequence,
    cells: Sequence,
    name: str,
    version: Any,
    options: RunOptions,
    stream: IO[str],
) -> tuple[StudySession, Path, Sequence]:
    """(the session, the study folder's copy of the study file, the cells to run): what trains
    the finished cells checked (issue 39), the study folder written and checked, the tracking
    store opened, the estimate and version lines printed."""
    from studies.running.versions import save_versions

    ray = RaySession.of(options)
    new_study = not os.path.lexists(_settings_path(study_dir_of(options.output, name)))
    with activity(
        stream, f"study {name}: {len(cells)} cells; checking the study folder, the tracking server and the data"
    ):
        identity = _check_before_writing(study, name, version, unversioned, cells, options, stream)  # issue 39
        version, cells = identity.version, identity.cells
        study_dir, study_copy, tracking_uri = _prepare_study_dir(
            study_file, name, options, study.source_text, version.version
        )
        definition_file = save_versions(study_dir, version)
        if new_study:
            ray.begin()  # a new study runs cells: Ray starts while its tracking store is set up
        try:
            tracking = StudyTracking(
                tracking_uri,
                name,
                artifact_root=(study_dir / "mlartifacts") if tracking_uri.startswith("sqlite:") else None,
                description=study_description(study.description, study.source_text),
                run_tags=source_tags(read_settings(study_dir).get("source") or study_file),
                ui_view=study_view(study, cells),
                version=version.version,
                version_definition=definition_file,
                data_fingerprints=identity.data_json(),
                parent_record=identity.parent,
            )
        except BaseException:
            ray.stop()
            raise
    from studies.planning.plan import run_estimate_line  # the compute estimate, first (docs/planning.md)

    _print(stream, "[studies] " + run_estimate_line(study, cells, options))
    if version.several:
        index = [v["version"] for v in version.record].index(version.version) + 1
        _print(
            stream,
            f"[studies] version {version.version[:7]}, {index} of "
            f"{len(version.record)} kept in this study" + (" (new: --new-version)" if version.new else ""),
        )
    session = StudySession(study, name, study_dir, tracking, options, stream, ray=ray)
    identity.parent.session_id = session.session_id
    identity.parent.start()  # the environment manifest, gathered while Ray starts
    session.know(cells)
    if options.address and tracking_uri.startswith("sqlite:"):
        session.say(
            f"warning: tracking to a SQLite file ({tracking_uri}) with --address: "
            f"workers on other nodes cannot reach it; pass "
            f"--tracking-uri http://<mlflow server>"
        )
    return session, study_copy, cells


def _run_trapped(session: StudySession, cells: Sequence, study_copy: Path, stream: IO[str]) -> tuple[RunOutcome, bool]:
    """(the summary's outcome, whether a signal stopped the run): the cells run with SIGTERM
    and SIGHUP raised as Ctrl-C; Ray stopped and the leases released whatever happens; the
    exit code of a stopped run its signal's."""
    started = time.monotonic()
    stop: KeyboardInterrupt | None = None
    leases: list = []
    with termination.trapped():  # SIGTERM, SIGHUP: as Ctrl-C
        try:
            _run(session, cells, study_copy, leases)
        except KeyboardInterrupt as error:
            stop = error
            session.say(
                f"{termination.describe(error)}; `studies resume {session.name}` (or the same "
                f"`studies run`) completes what is missing"
            )
        finally:
            session.ray.stop()
            for lease in leases:
                lease.release()
        interrupted = stop is not None
        outcome = _summarise(session, started, stream, termination.describe(stop) if stop is not None else None)
    if stop is not None:
        outcome.exit_code = termination.exit_code(stop)
    return outcome, interrupted


def resume_study(name: str, options: RunOptions | None = None) -> RunOutcome:
    """Complete the study `<output>/<name>/` from its saved `study.yaml` and settings."""
    from studies.readback import check_sqlite_store, study_folder, unknown_study

    options = options or RunOptions()
    study_dir = study_folder(options.output, name)  # inside --output, or ReadBackError
    study_copy = study_dir / STUDY_FILE
    if not os.path.lexists(study_copy):
        raise unknown_study(name, options.output, f"expected {study_copy}")
    saved = read_settings(study_dir)
    if options.tracking_uri:  # a mistyped path must not become a new, empty store
        check_sqlite_store(options.tracking_uri)
    options.smoke = bool(saved.get("smoke", False))
    options.smoke_epochs = int(saved.get("smoke_epochs") or 1)
    options.tracking_uri = options.tracking_uri or saved.get("tracking_uri")
    options.address = options.address or saved.get("address")
    return run_study(study_copy, options)


def _summarise(session: StudySession, started: float, stream: IO[str], stopped: str | None = None) -> RunOutcome:
    """Every cell seen (the file's and the optuna blocks'): finished or not; closes the
    parent run. After a complete run, a cell whose run is still `running` ended without its
    trial recording why: it is marked failed. After a run stopped by a signal (`stopped`: the
    reason), the runs its trials left RUNNING (Ray is stopped: their workers are gone) and the
    parent end KILLED with the reason; the resume continues them. No run stays RUNNING."""
    interrupted = stopped is not None
    ids = list(session.known_cells)
    states = session.tracking.cell_states(ids)
    if stopped is not None:
        _close_stopped(session, states, stopped, stream)
    not_needed: list[str] = []
    if session.race is not None:  # cells of configs the race decided: never started, not failures
        not_needed = session.race.not_needed(i for i in ids if states[i].status == "missing")
        skip = set(not_needed)
        ids = [i for i in ids if i not in skip]
    if not interrupted:
        for cell_id, state in states.items():
            if state.status == "running":
                states[cell_id] = session.tracking.fail_unfinished(
                    state, "the trial ended without finishing or recording an error (see the driver's log)"
                )
    finished = [i for i in ids if states[i].status == STATUS_FINISHED]
    failed = {i: (states[i].error or states[i].status) for i in ids if states[i].status != STATUS_FINISHED}
    all_done = not failed
    if not interrupted:
        session.tracking.close_parent(all_done)
    _print(
        stream,
        f"[studies] summary: {len(finished)}/{len(ids)} cells finished, "
        f"{len(failed)} not finished, {format_duration(time.monotonic() - started)}"
        f" wall time",
    )
    if session.race is not None:
        _print(
            stream,
            f"[studies] race: {session.race.summary()}; {len(not_needed)} cells not "
            f"needed (their configs were decided before their seeds)",
        )
    for line in _optuna_summary(session):
        _print(stream, f"[studies] {line}")
    names = session.namer.names(session.known_cells[i] for i in list(failed)[:20])
    for cell_id, error in list(failed.items())[:20]:
        _print(stream, f"[studies]   {names.get(cell_id, cell_id)} ({cell_id}): {error}")
    if len(failed) > 20:
        _print(stream, f"[studies]   ... and {len(failed) - 20} more")
    return RunOutcome(
        exit_code=0 if all_done else 1,
        study_name=session.name,
        study_dir=session.study_dir,
        tracking_uri=session.tracking.tracking_uri,
        cells=len(ids),
        finished=len(finished),
        failed=failed,
    )


def _close_stopped(session: StudySession, states: dict, reason: str, stream: IO[str]) -> None:
    """A stopped run's cell runs left RUNNING and its parent end KILLED with `reason`, within
    `termination.CLOSE_PATIENCE_S` of an unanswering server; if the server does not answer
    they stay RUNNING (one warning line), and the resume deals with them as before."""
    patience = termination.CLOSE_PATIENCE_S
    try:
        session.tracking.close_stopped(states.values(), reason, patience_s=patience)
        session.tracking.close_parent(False, reason, patience_s=patience)
    except Exception as error:  # noqa: BLE001 (the driver still exits with its code and resume command)
        first = (str(error).splitlines() or [type(error).__name__])[0][:200]
        _print(
            stream,
            f"[studies] warning: could not mark the runs left running as KILLED "
            f"({first}); `studies resume {session.name}` deals with them",
        )


def _optuna_summary(session: StudySession) -> list[str]:
    """A line per optuna block run: its configs by the state Optuna holds (pruned ones are
    left out of the report unless `report.show_pruned`) and its best config by name."""
    lines = []
    for proposals in session.proposals:
        counts = proposals.trial_counts()
        text = f"optuna design[{proposals.index}]: {sum(counts.values())} configs asked: " + ", ".join(
            f"{n} {state}" for state, n in counts.items()
        )
        if counts.get("pruned"):
            text += " (pruned configs trained fewer epochs: left out of the report unless report.show_pruned)"
        best = proposals.best()
        if best is not None:
            config_id, value = best
            cells = [c for c in session.known_cells.values() if c.config_id == config_id]
            label = (
                session.namer.names(cells[:1]).get(cells[0].cell_id, config_id).rsplit(" s", 1)[0]
                if cells
                else config_id
            )
            from analysis.units import shown

            text += f"; best {label}: {proposals.metric}={shown(proposals.metric, value)} (seed mean)"
        lines.append(text)
    return lines


def _build_report(tracking_uri: str, name: str, study_dir: Path, study_file: Path, stream: IO[str]) -> Path | None:
    try:
        from analysis.report import build_report
    except ImportError as error:
        _print(stream, f"[studies] report skipped: analysis.report is not available ({error})")
        return None
    try:
        with activity(stream, "report: reading MLflow, drawing tables and figures"):
            path = build_report(tracking_uri, name, study_dir / "report", study_file=study_file)
    except Exception as error:  # noqa: BLE001 (the study's results stay in MLflow; say why, do not crash)
        _print(stream, f"[studies] report failed: {type(error).__name__}: {error}")
        return None
    _print(stream, f"[studies] report: {path}")
    return Path(path) if path is not None else None
