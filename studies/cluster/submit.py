"""Send a study to a Ray cluster as a Ray job, and follow, list and stop such jobs.

`studies submit FILE --address http://HEAD:8265 --tracking-uri http://mlflow:5000
--storage /shared/studies` uses the Ray Jobs API (`ray.job_submission.JobSubmissionClient`,
which talks to the dashboard's HTTP port, 8265 by default):

- the driver runs on the cluster: the job's entrypoint is
  `python -m studies.cli run _submitted/FILE --address auto --tracking-uri URI
  --storage STORAGE --no-report [...]`;
- the runtime environment ships the project and the study file: a staging folder holding a
  copy of the project (without `.git`, `studies_out`, `benchmarks/out` and the other
  `DEFAULT_EXCLUDES`, nor what a `.gitignore` ignores) and `_submitted/FILE` is the job's
  `working_dir`, uploaded by Ray at submission (`excludes` is passed too);
- the study file is validated here first (`studies.studyfile.spec.load_study`), so a bad file fails
  before anything reaches the cluster;
- workers on other nodes log to one MLflow server, so the tracking URI must be http(s)
  (no SQLite file, no path) and must carry no credentials: the nodes read them from their
  own environment (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD) or from
  ~/.mlflow/credentials (cluster/README.md);
- Ray Tune on several nodes needs storage that every node reaches (ray:doc/source/tune/
  tutorials/tune-storage.rst): `--storage` must be a cloud URI (s3://, gs://, ...) or an
  absolute path on a shared file system.

Token authentication (Ray >= 2.59 turns it on by default:
https://docs.ray.io/en/latest/ray-security/token-auth.html): the token is read, in this
order, from `--token-file`, the environment variable RAY_AUTH_TOKEN, the file named by
RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token (the places Ray itself reads) and sent only as
the HTTP `Authorization: Bearer` header of the client. It never goes into the entrypoint,
the runtime environment, the job metadata or anything printed: the driver on the cluster
gets the token from its own node, like every Ray process there. `submit_study` refuses to
send a job whose entrypoint, runtime environment or metadata contains the token, and every
log line printed here has it masked.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import secrets
import shlex
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, cast
from urllib.parse import urlparse

from studies.cluster.connection import (
    DEFAULT_DASHBOARD_ADDRESS,
    DEFAULT_TOKEN_FILE,
    TOKEN_ENV,
    TOKEN_PATH_ENV,
    RayToken,
    SubmitError,
    job_client,
    local_secrets,
    mask_secrets,
    normalize_address,
    resolve_ray_token,
)
from studies.cluster.jobs import (
    TERMINAL_STATUSES,
    follow_job,
    job_logs,
    job_status,
    list_jobs,
    stop_job,
    wait_for_job,
)
from studies.cluster.packaging import (
    DEFAULT_EXCLUDES,
    exclude_matcher,
    find_project_dir,
    stage_working_dir,
)

__all__ = [
    "DEFAULT_DASHBOARD_ADDRESS",
    "DEFAULT_TOKEN_FILE",
    "RayToken",
    "SubmitError",
    "TOKEN_ENV",
    "TOKEN_PATH_ENV",
    "job_client",
    "mask_secrets",
    "normalize_address",
    "resolve_ray_token",
    "DEFAULT_EXCLUDES",
    "exclude_matcher",
    "find_project_dir",
    "stage_working_dir",
    "TERMINAL_STATUSES",
    "job_logs",
    "job_status",
    "list_jobs",
    "stop_job",
    "wait_for_job",
    "STORAGE_SCHEMES",
    "check_tracking_uri",
    "check_storage",
    "build_entrypoint",
    "submit_study",
    "add_subcommands",
]


#: cloud storage schemes Ray Tune's storage_path accepts (pyarrow file systems)
STORAGE_SCHEMES = ("s3", "gs", "gcs", "hdfs", "abfs", "abfss", "az", "file")


# ----------------------------------------------------------------------------- checks


def check_tracking_uri(uri: str | None) -> str:
    """The MLflow URI the workers log to: http(s), and with no credentials in it (the
    nodes read them from their environment or credentials file). Whether every node
    reaches the host cannot be checked from here (a loopback URI is right for a cluster
    whose nodes all run on this machine, as in the tests)."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise SubmitError(
            "--tracking-uri is required to submit: the MLflow server every worker logs to, "
            "e.g. http://mlflow:5000 (cluster/README.md, section MLflow); it may also come "
            "from MLFLOW_TRACKING_URI"
        )
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        raise SubmitError(
            f"--tracking-uri {uri!r}: workers on several nodes need an MLflow server, "
            f"http(s)://HOST:PORT; a {parsed.scheme or 'path'} store lives on one machine "
            f"(and SQLite must not be shared across nodes)"
        )
    if parsed.username or parsed.password:
        raise SubmitError(
            f"--tracking-uri {parsed.scheme}://{parsed.hostname}...: has credentials in it, "
            f"which would end in the job's entrypoint for anyone to read; give the URI "
            f"without them and set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD on "
            f"the cluster's nodes (cluster/README.md)"
        )
    return uri


def check_storage(storage: str | None) -> str:
    """Ray Tune's storage: a cloud URI or an absolute path shared by every node."""
    if not storage:
        raise SubmitError(
            "--storage is required to submit: Ray Tune on several nodes needs storage "
            "that every node reaches, e.g. s3://bucket/studies or /mnt/shared/studies "
            "(an NFS mount on every node)"
        )
    if "://" in storage:
        scheme = storage.split("://", 1)[0]
        if scheme not in STORAGE_SCHEMES:
            raise SubmitError(
                f"--storage {storage!r}: unknown scheme {scheme!r}; expected "
                f"one of {', '.join(STORAGE_SCHEMES)} or an absolute path"
            )
        return storage
    if not storage.startswith("/"):
        raise SubmitError(
            f"--storage {storage!r}: must be absolute (a relative path would land in the "
            f"job's temporary working folder on the head node and be lost)"
        )
    return storage


def _study_name(study_file: Path, validate: bool) -> tuple[str, list[str]]:
    """The study's name and the plugin distributions its cells use (none when not validated)."""
    if validate:
        from studies.cells.space import expand
        from studies.cluster.plugin_shipping import study_plugin_distributions
        from studies.studyfile.spec import load_study  # StudyError names file, field and line

        study = load_study(study_file)
        return study.name, study_plugin_distributions(cell.config for cell in expand(study))
    import yaml

    data = yaml.safe_load(study_file.read_text())
    name = data.get("name") if isinstance(data, dict) else None
    if not isinstance(name, str) or not name:
        raise SubmitError(f"{study_file}: no 'name' at the top of the study file")
    return name, []


def build_entrypoint(
    study_path: str,
    tracking_uri: str,
    storage: str | None,
    output: str | None = None,
    extra_args: Sequence[str] = (),
    python: str = "python",
) -> str:
    """The shell command the job runs on the head node (every part shell-quoted)."""
    parts = [python, "-m", "studies.cli", "run", study_path, "--address", "auto", "--tracking-uri", tracking_uri]
    if storage is not None:
        parts += ["--storage", storage]
    if output is not None:
        parts += ["--output", output]
    parts += ["--no-report", *extra_args]
    return " ".join(shlex.quote(str(part)) for part in parts)


#: the variable Ray's job supervisor reads: seconds between `ray job stop`'s SIGTERM and SIGKILL
JOB_STOP_WAIT_VARIABLE = "RAY_JOB_STOP_WAIT_TIME_S"


def job_runtime_env(working_dir: Path) -> dict[str, Any]:
    """The job's runtime environment: the staged working folder, and the time its driver
    gets to close the study's runs after `studies stop` (`JOB_STOP_GRACE_S`; Ray's default
    of 3 s would SIGKILL it while it stops Tune, leaving runs RUNNING)."""
    from studies.running.termination import JOB_STOP_GRACE_S

    return {
        "working_dir": str(working_dir),
        "excludes": list(DEFAULT_EXCLUDES),
        "env_vars": {JOB_STOP_WAIT_VARIABLE: str(JOB_STOP_GRACE_S)},
    }


def _submission_id(name: str) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = re.sub(r"[^A-Za-z0-9_.-]", "-", name)[:60]
    return f"studies-{safe}-{stamp}-{secrets.token_hex(2)}"


def _refuse_secrets(token: RayToken | None, **parts: Any) -> None:
    secrets_here = local_secrets(token)
    for label, value in parts.items():
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        for secret in secrets_here:
            if secret in text:
                raise SubmitError(
                    f"refusing to submit: the job's {label} would contain a secret (the Ray "
                    f"token or an MLflow password from this environment); pass secrets "
                    f"through the nodes' environment, never as job arguments"
                )


# ----------------------------------------------------------------------------- the API


def submit_study(
    study_file: str | os.PathLike,
    address: str | None = None,
    tracking_uri: str | None = None,
    storage: str | None = None,
    follow: bool = False,
    extra_args: Sequence[str] = (),
    *,
    output: str | None = None,
    token_file: str | os.PathLike | None = None,
    project_dir: str | os.PathLike | None | bool = True,
    submission_id: str | None = None,
    entrypoint_num_cpus: float | None = None,
    entrypoint_resources: dict[str, float] | None = None,
    validate: bool = True,
    python: str = "python",
    stream: IO[str] | None = None,
) -> str:
    """Submit `study_file` as a Ray job to the cluster at `address`; return its job id.

    `follow`: also stream the job's log to `stream` until it ends (the job's final status
    is then `job_status(address, job_id)`). `extra_args` are appended to `studies run`
    (e.g. ["--smoke"]). `output`: the `--output` folder of `studies run` on the head node
    (absolute; default: `storage` when it is a path, else the runner's default).
    `project_dir`: True ships the source tree this package comes from (none when the
    package is installed), a path ships that tree, False/None ships only the study file
    (the cluster image must then have the project installed).
    """
    study_path = Path(study_file)
    if not study_path.is_file():
        raise SubmitError(f"study file {study_path} does not exist (or is not a file)")
    tracking_uri = check_tracking_uri(tracking_uri)
    storage = check_storage(storage)
    if output is None and "://" not in storage:
        output = storage  # study.yaml, run.json, optuna.db beside Tune's folders
    if output is not None and not str(output).startswith("/"):
        raise SubmitError(f"--output {output!r}: must be an absolute folder on the head node")
    name, plugins = _study_name(study_path, validate)
    project = _project_to_ship(project_dir)
    client, token = job_client(address, token_file)
    if validate:
        _check_submission(study_path, tracking_uri, extra_args)
    with tempfile.TemporaryDirectory(prefix="studies-submit-") as tmp:
        staging = Path(tmp) / "working_dir"
        staging.mkdir()
        relative_study = stage_working_dir(study_path.resolve(), project, staging)
        entrypoint = build_entrypoint(
            relative_study, tracking_uri, storage, output, [str(a) for a in extra_args], python=python
        )
        from studies.cluster.plugin_shipping import ship_plugins

        runtime_env = {**job_runtime_env(staging), **ship_plugins(plugins, staging)}
        metadata = {
            "studies.study": name,
            "studies.file": study_path.name,
            "studies.submitted_from": socket.gethostname(),
        }
        job_id = submission_id or _submission_id(name)
        _refuse_secrets(token, entrypoint=entrypoint, runtime_env=runtime_env, metadata=metadata, submission_id=job_id)
        job_id = _submit_job(
            client,
            token,
            entrypoint=entrypoint,
            runtime_env=runtime_env,
            metadata=metadata,
            submission_id=job_id,
            entrypoint_num_cpus=entrypoint_num_cpus,
            entrypoint_resources=entrypoint_resources,
        )
    if follow:
        follow_job(client, job_id, stream or sys.stdout, local_secrets(token))
    return job_id


def _project_to_ship(project_dir: str | os.PathLike | None | bool) -> Path | None:
    """The source tree the job travels with: True this package's (none when installed), a
    path that tree, False or None none."""
    if project_dir is True:
        return find_project_dir()
    if project_dir in (False, None):
        return None
    project = Path(cast("str | os.PathLike[str]", project_dir)).resolve()
    if not project.is_dir():
        raise SubmitError(f"project folder {project} does not exist")
    return project


def _check_submission(study_path: Path, tracking_uri: str, extra_args: Sequence[str]) -> None:
    """A changed study refused before the job, from the server's versions."""
    from studies.errors import RunnerError
    from studies.running.versions import check_submission
    from studies.studyfile.spec import load_study

    try:
        check_submission(load_study(study_path), tracking_uri, extra_args)
    except RunnerError as error:
        raise SubmitError(str(error)) from None


def _submit_job(
    client: Any,
    token: Any,
    *,
    entrypoint_num_cpus: float | None,
    entrypoint_resources: dict[str, float] | None,
    **job: Any,
) -> str:
    """The job submitted through the Jobs client; its id. A refusal is a `SubmitError` with
    the secrets masked."""
    kwargs: dict[str, Any] = {}
    if entrypoint_num_cpus is not None:
        kwargs["entrypoint_num_cpus"] = entrypoint_num_cpus
    if entrypoint_resources:
        kwargs["entrypoint_resources"] = dict(entrypoint_resources)
    try:
        return client.submit_job(**job, **kwargs)
    except RuntimeError as error:
        detail = mask_secrets(str(error), local_secrets(token))
        raise SubmitError(f"the Ray cluster refused the job: {detail}") from None


# ----------------------------------------------------------------------------- the CLI


def _fail(message: str) -> int:
    print(f"studies: error: {message}", file=sys.stderr, flush=True)
    return 2


def _exit_code(status: str) -> int:
    return 0 if status == "SUCCEEDED" else 1


def _add_connection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=None,
        metavar="URL",
        help="the Ray dashboard of the cluster's head node, which serves the Jobs API, "
        "e.g. http://HEAD:8265 (default: $RAY_API_SERVER_ADDRESS, $RAY_ADDRESS, "
        f"else {DEFAULT_DASHBOARD_ADDRESS})",
    )
    parser.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help=f"file holding the cluster's Ray auth token (default: ${TOKEN_ENV}, "
        f"${TOKEN_PATH_ENV}, else {DEFAULT_TOKEN_FILE} when it exists)",
    )


def _guard(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def guarded(args: argparse.Namespace) -> int:
        from studies.studyfile.spec import StudyError

        try:
            return run(args)
        except (SubmitError, StudyError) as error:
            return _fail(str(error))
        except KeyboardInterrupt:
            job = getattr(args, "job_id", None)  # `studies logs JOB`, or the job `submit --follow` follows
            if job:
                print(
                    f"\n[studies] stopped following; job {job} keeps running on the "
                    f"cluster (`studies stop {job}` ends it)",
                    file=sys.stderr,
                )
            return 130

    return guarded


def _submit(args: argparse.Namespace) -> int:
    try:
        extra = shlex.split(args.run_args or "")
    except ValueError as error:
        raise SubmitError(f"--run-args {args.run_args!r}: {error}") from None
    from studies.running.run_options import smoke_epochs_of

    try:
        smoke = smoke_epochs_of(args.smoke, args.smoke_epochs) > 0
    except ValueError as error:
        raise SubmitError(str(error)) from None
    if args.new_version:
        extra[:0] = ["--new-version"]
    if smoke:
        extra[:0] = ["--smoke"] + ([] if args.smoke_epochs is None else ["--smoke-epochs", str(args.smoke_epochs)])
    resources = None
    if args.entrypoint_resources:
        try:
            resources = json.loads(args.entrypoint_resources)
        except json.JSONDecodeError as error:
            raise SubmitError(
                f"--entrypoint-resources {args.entrypoint_resources!r}: not "
                f"JSON ({error.msg}); expected e.g. '{{\"head\": 1}}'"
            ) from None
    job_id = submit_study(
        args.file,
        args.address,
        args.tracking_uri,
        args.storage,
        follow=False,
        extra_args=extra,
        output=args.output,
        token_file=args.token_file,
        project_dir=False if args.no_project else True,
        submission_id=args.submission_id,
        entrypoint_num_cpus=args.entrypoint_num_cpus,
        entrypoint_resources=resources,
    )
    print(job_id, flush=True)
    if not args.follow:
        print(
            f"[studies] follow it with `studies logs {job_id} --follow`; stop it with `studies stop {job_id}`",
            file=sys.stderr,
            flush=True,
        )
        return 0
    args.job_id = job_id  # named by `_guard` when Ctrl-C stops the following
    status = job_logs(args.address, job_id, follow=True, token_file=args.token_file)
    print(f"[studies] job {job_id}: {status}", file=sys.stderr, flush=True)
    return _exit_code(status)


def _add_submit(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="the study file (YAML)")
    parser.add_argument(
        "--run-args",
        default="",
        metavar="'ARGS'",
        help="more arguments for `studies run` on the cluster, one string "
        "(write it with =, e.g. --run-args='--progress-every 60')",
    )
    _add_connection(parser)
    parser.add_argument(
        "--tracking-uri",
        default=None,
        metavar="URI",
        help="the MLflow server every worker logs to, http(s)://HOST:PORT, without "
        "credentials (default: $MLFLOW_TRACKING_URI)",
    )
    parser.add_argument(
        "--storage",
        default=None,
        metavar="URI",
        help="Ray Tune storage that every node reaches: s3://bucket/path, gs://..., or an "
        "absolute path on a shared file system",
    )
    parser.add_argument(
        "--output",
        default=None,
        metavar="DIR",
        help="absolute folder on the head node for the study's files (study.yaml, "
        "run.json, optuna.db); default: --storage when it is a path",
    )
    parser.add_argument(
        "--follow", action="store_true", help="stream the job's log until it ends; exit 0 only if it succeeded"
    )
    parser.add_argument("--smoke", action="store_true", help="pass --smoke to `studies run` (tiny synthetic run)")
    parser.add_argument(
        "--smoke-epochs", type=int, default=None, metavar="N", help="pass --smoke --smoke-epochs N to `studies run`"
    )
    parser.add_argument(
        "--new-version",
        action="store_true",
        help="pass --new-version to `studies run`: a changed file is kept as a "
        "new version of the study (default: the job refuses it, exit 2)",
    )
    parser.add_argument(
        "--submission-id", default=None, metavar="ID", help="the job id to use (default: studies-NAME-DATE-TIME-XXXX)"
    )
    parser.add_argument(
        "--entrypoint-num-cpus",
        type=float,
        default=None,
        metavar="N",
        help="CPUs reserved for the driver (default 0: it runs on the head)",
    )
    parser.add_argument(
        "--entrypoint-resources",
        default=None,
        metavar="JSON",
        help="custom resources reserved for the driver, e.g. '{\"head\": 1}'",
    )
    parser.add_argument(
        "--no-project", action="store_true", help="ship only the study file; the cluster image has the project"
    )


def _jobs(args: argparse.Namespace) -> int:
    jobs = list_jobs(args.address, token_file=args.token_file)
    if not jobs:
        print("(no jobs)")
        return 0
    rows = [("JOB", "STATUS", "STUDY", "STARTED", "ENDED")]
    for job in jobs:

        def when(ms):
            return _dt.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M:%S") if ms else "-"

        rows.append(
            (
                job.submission_id,
                str(getattr(job.status, "value", job.status)),
                (job.metadata or {}).get("studies.study", "-"),
                when(job.start_time),
                when(job.end_time),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _logs(args: argparse.Namespace) -> int:
    status = job_logs(args.address, args.job_id, follow=args.follow, token_file=args.token_file)
    if args.follow:
        print(f"[studies] job {args.job_id}: {status}", file=sys.stderr, flush=True)
        return _exit_code(status)
    return 0


def _stop(args: argparse.Namespace) -> int:
    if args.local:
        from studies.running.warm_ray import stop_all

        lines = stop_all()
        print("\n".join(lines) if lines else "no warm local Ray (started by `studies run --keep-warm`) is running")
        return 0
    if args.job_id is None:
        return _fail("stop: expected a JOB id, or --local for the local Ray that --keep-warm keeps")
    was_running = stop_job(args.address, args.job_id, token_file=args.token_file)
    status = job_status(args.address, args.job_id, token_file=args.token_file)
    print(f"job {args.job_id}: {status}" + ("" if was_running else " (was not running)"))
    return 0


def add_subcommands(subparsers) -> None:
    """Register `submit`, `jobs`, `logs` and `stop` on an argparse subparsers object (each
    sets `handler`, a function (args) -> exit code)."""
    parser = subparsers.add_parser(
        "submit",
        help="send a study file to a Ray cluster as a Ray job",
        description="Validate the study file, then submit it as a Ray job: the project and "
        "the file travel in the job's runtime environment and `studies run` "
        "runs on the cluster, logging to the MLflow server at --tracking-uri. "
        "Prints the job id.",
    )
    _add_submit(parser)
    parser.set_defaults(handler=_guard(_submit))

    parser = subparsers.add_parser(
        "jobs", help="list the Ray jobs of a cluster", description="The cluster's jobs, oldest first."
    )
    _add_connection(parser)
    parser.set_defaults(handler=_guard(_jobs))

    parser = subparsers.add_parser(
        "logs", help="print (or follow) a job's log", description="The log of a submitted job (the driver's output)."
    )
    parser.add_argument("job_id", metavar="JOB")
    parser.add_argument("--follow", "-f", action="store_true", help="keep streaming until the job ends")
    _add_connection(parser)
    parser.set_defaults(handler=_guard(_logs))

    parser = subparsers.add_parser(
        "stop",
        help="stop a running job, or the local Ray that --keep-warm keeps",
        description="Stop the job's driver (its trials end with "
        "it); finished cells stay in MLflow and a "
        "later submission skips them. With --local: stop the local Ray that "
        "`studies run --keep-warm` keeps warm.",
    )
    parser.add_argument("job_id", metavar="JOB", nargs="?", default=None)
    parser.add_argument(
        "--local", action="store_true", help="stop the warm local Ray of `studies run --keep-warm` (no JOB)"
    )
    _add_connection(parser)
    parser.set_defaults(handler=_guard(_stop))
