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
import asyncio
import datetime as _dt
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Sequence
from urllib.parse import urlparse

#: never shipped to the cluster (gitignore-style patterns, relative to the project root)
DEFAULT_EXCLUDES: tuple[str, ...] = (
    ".git/",
    "studies_out/",
    "benchmarks/out/",
    "mlruns/",
    "mlartifacts/",
    "__pycache__/",
    ".pytest_cache/",
    "*.egg-info/",
    "*.db",
    "build/",
    "dist/",
    ".venv/",
    "venv/",
    ".env",
)
#: folder of the staged working dir that holds the submitted study file
SUBMITTED_DIR = "_submitted"
#: where the Ray Jobs API listens when nothing else is said
DEFAULT_DASHBOARD_ADDRESS = "http://127.0.0.1:8265"

TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_FILE = Path("~/.ray/auth_token")
_ADDRESS_ENVS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
TERMINAL_STATUSES = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
#: cloud storage schemes Ray Tune's storage_path accepts (pyarrow file systems)
STORAGE_SCHEMES = ("s3", "gs", "gcs", "hdfs", "abfs", "abfss", "az", "file")
_MASK = "***"


class SubmitError(RuntimeError):
    """A submission that cannot be made as asked; one-paragraph message, no secret in it."""


# ----------------------------------------------------------------------------- the token


class RayToken:
    """A Ray authentication token and where it was read from; `repr`/`str` hide the value."""

    __slots__ = ("_value", "source")

    def __init__(self, value: str, source: str):
        self._value = value
        self.source = source

    @property
    def value(self) -> str:
        return self._value

    def header(self) -> dict[str, str]:
        """The HTTP header the dashboard's token middleware checks."""
        return {"Authorization": f"Bearer {self._value}"}

    def __repr__(self) -> str:
        return f"RayToken(source={self.source!r})"

    __str__ = __repr__


def _read_token_file(path: Path, what: str) -> str:
    try:
        value = path.expanduser().read_text().strip()
    except OSError as error:
        raise SubmitError(f"cannot read the Ray token file {path} ({what}): "
                          f"{error.strerror or error}") from None
    if not value:
        raise SubmitError(f"the Ray token file {path} ({what}) is empty")
    return value


def resolve_ray_token(token_file: str | os.PathLike | None = None) -> RayToken | None:
    """The Ray token from `token_file`, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
    ~/.ray/auth_token (first found); None when there is none (a cluster without auth)."""
    if token_file is not None:
        path = Path(token_file)
        return RayToken(_read_token_file(path, "--token-file"), f"file {path}")
    value = os.environ.get(TOKEN_ENV, "").strip()
    if value:
        return RayToken(value, f"environment variable {TOKEN_ENV}")
    named = os.environ.get(TOKEN_PATH_ENV, "").strip()
    if named:
        path = Path(named)
        return RayToken(_read_token_file(path, TOKEN_PATH_ENV), f"file {path} ({TOKEN_PATH_ENV})")
    default = DEFAULT_TOKEN_FILE.expanduser()
    if default.is_file():
        return RayToken(_read_token_file(default, "default token file"), f"file {default}")
    return None


def mask_secrets(text: str, secret_values: Iterable[str | None]) -> str:
    """`text` with every occurrence of each (non-trivial) secret replaced by ***."""
    for value in secret_values:
        if value and len(value) >= 4:
            text = text.replace(value, _MASK)
    return text


def _local_secrets(token: RayToken | None) -> list[str]:
    values = [token.value if token else None, os.environ.get("MLFLOW_TRACKING_PASSWORD"),
              os.environ.get("MLFLOW_TRACKING_TOKEN")]
    return [v for v in values if v]


# ----------------------------------------------------------------------------- the client


def normalize_address(address: str | None) -> str:
    """The dashboard URL of `address` (http://HOST:PORT; HOST:PORT gets http://).

    None: RAY_API_SERVER_ADDRESS, else RAY_ADDRESS, else http://127.0.0.1:8265.
    """
    if address is None:
        for name in _ADDRESS_ENVS:
            if os.environ.get(name):
                address = os.environ[name]
                break
        else:
            address = DEFAULT_DASHBOARD_ADDRESS
    address = address.strip()
    if not address:
        raise SubmitError("--address is empty; expected the Ray dashboard URL, "
                          "e.g. http://HEAD:8265")
    if address == "auto":
        raise SubmitError("--address auto names a cluster from inside it; from outside give "
                          "the dashboard URL of the head node, e.g. http://HEAD:8265")
    if "://" not in address:
        address = f"http://{address}"
    scheme = address.split("://", 1)[0]
    if scheme not in ("http", "https", "ray"):
        raise SubmitError(f"--address {address!r}: expected http(s)://HEAD:8265 (the Ray "
                          f"dashboard, which serves the Jobs API) or ray://HEAD:10001")
    return address.rstrip("/")


@contextmanager
def _explicit_address() -> Iterator[None]:
    """Ray's client lets RAY_API_SERVER_ADDRESS / RAY_ADDRESS override the address it is
    given; an address named on the command line must win, so hide them meanwhile."""
    saved = {name: os.environ.pop(name) for name in _ADDRESS_ENVS if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def job_client(address: str | None, token_file: str | os.PathLike | None = None):
    """(JobSubmissionClient, RayToken | None) for the dashboard at `address`."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    url = normalize_address(address)
    token = resolve_ray_token(token_file)
    headers = token.header() if token else None
    try:
        with _explicit_address():
            client = JobSubmissionClient(url, headers=headers)
    except AuthenticationError as error:
        status = "rejected the token from " + token.source if token else \
            ("requires a token and none was found (looked at --token-file, "
             f"{TOKEN_ENV}, {TOKEN_PATH_ENV}, {DEFAULT_TOKEN_FILE})")
        detail = mask_secrets(str(error).split("\n")[0], _local_secrets(token))
        raise SubmitError(f"the Ray cluster at {url} {status}: {detail}") from None
    except ConnectionError as error:
        detail = mask_secrets(str(error).split("\n")[0], _local_secrets(token))
        raise SubmitError(f"cannot reach the Ray Jobs API at {url} ({detail}); is the head "
                          f"node's dashboard running and reachable from here?") from None
    return client, token


# ----------------------------------------------------------------------------- what is shipped


def _pattern_regex(pattern: str) -> tuple[re.Pattern, bool, bool]:
    """(regex, directories only, anchored) of one gitignore-style pattern.

    Supported: `*`, `?`, `[...]`, `**`, a trailing `/` (directories only), a leading or
    inner `/` (anchored at the root; otherwise the pattern matches a name at any depth).
    Negation (`!`) is not supported: such lines are skipped by `exclude_matcher`.
    """
    dir_only = pattern.endswith("/")
    body = pattern.strip("/") if dir_only else pattern.lstrip("/")
    anchored = "/" in pattern.rstrip("/")
    out = []
    i = 0
    while i < len(body):
        char = body[i]
        if body.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if body.startswith("/**", i) and i + 3 == len(body):
            out.append("/.*")
            i += 3
            continue
        if body.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[":
            end = body.find("]", i + 1)
            if end == -1:
                out.append(re.escape(char))
            else:
                cls = body[i + 1:end]
                if cls.startswith("!"):
                    cls = "^" + cls[1:]
                out.append(f"[{cls}]")
                i = end
        else:
            out.append(re.escape(char))
        i += 1
    return re.compile("".join(out) + r"\Z"), dir_only, anchored


def exclude_matcher(patterns: Iterable[str]) -> Callable[[str, bool], bool]:
    """A function (relative posix path, is_dir) -> True when a pattern excludes it.

    A path is excluded when the path itself or one of its parent folders matches (a
    folder that matches takes everything below it along, as in git).
    """
    compiled = []
    for raw in patterns:
        line = raw.strip()
        if not line or line.startswith("#") or line.startswith("!"):
            continue
        compiled.append(_pattern_regex(line))

    def matches_one(rel: str, is_dir: bool) -> bool:
        name = rel.rsplit("/", 1)[-1]
        for regex, dir_only, anchored in compiled:
            if dir_only and not is_dir:
                continue
            if regex.match(rel if anchored else name):
                return True
        return False

    def excluded(rel: str, is_dir: bool) -> bool:
        parts = rel.strip("/").split("/")
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            if matches_one(prefix, is_dir or depth < len(parts)):
                return True
        return False

    return excluded


def find_project_dir() -> Path | None:
    """The source tree this `studies` package was imported from (it holds pyproject.toml
    and the packages); None for an installed copy (the cluster image must then have it)."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "studies").is_dir() \
            and (root / "setvalued").is_dir():
        return root
    return None


def stage_working_dir(study_file: Path, project_dir: Path | None, staging: Path,
                      excludes: Sequence[str] = DEFAULT_EXCLUDES) -> str:
    """Fill `staging` with the project and `_submitted/<study file name>`; returns the
    study's path relative to `staging`.

    Left out: `excludes` (relative to the project root) and what any `.gitignore` of the
    project ignores (relative to its own folder, as git reads them), so that secrets kept
    out of git (e.g. cluster/mlflow/.env) stay off the cluster too. The `.gitignore` files
    themselves are not copied, so Ray applies no further filter of its own.
    """
    if project_dir is not None:
        # (folder prefix relative to the project root, matcher of paths below it)
        rules: list[tuple[str, Callable[[str, bool], bool]]] = [("", exclude_matcher(excludes))]

        def skip(rel: str, is_dir: bool) -> bool:
            return any(rel.startswith(base) and matcher(rel[len(base):], is_dir)
                       for base, matcher in rules)

        for folder, dirs, files in os.walk(project_dir):
            rel_folder = Path(folder).relative_to(project_dir).as_posix()
            rel_folder = "" if rel_folder == "." else rel_folder + "/"
            ignore_file = Path(folder) / ".gitignore"
            if ignore_file.is_file():
                patterns = ignore_file.read_text(errors="replace").splitlines()
                rules.append((rel_folder, exclude_matcher(patterns)))
            dirs[:] = sorted(d for d in dirs if not skip(rel_folder + d, True)
                             and not (rel_folder == "" and d == SUBMITTED_DIR))
            target = staging / rel_folder
            target.mkdir(parents=True, exist_ok=True)
            for name in files:
                rel = rel_folder + name
                source = Path(folder) / name
                if name == ".gitignore" or skip(rel, False) or \
                        (source.is_symlink() and not source.exists()):
                    continue
                shutil.copy2(source, target / name)
    submitted = staging / SUBMITTED_DIR
    submitted.mkdir(parents=True, exist_ok=True)
    shutil.copy2(study_file, submitted / study_file.name)
    return f"{SUBMITTED_DIR}/{study_file.name}"


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
            "from MLFLOW_TRACKING_URI")
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        raise SubmitError(
            f"--tracking-uri {uri!r}: workers on several nodes need an MLflow server, "
            f"http(s)://HOST:PORT; a {parsed.scheme or 'path'} store lives on one machine "
            f"(and SQLite must not be shared across nodes)")
    if parsed.username or parsed.password:
        raise SubmitError(
            f"--tracking-uri {parsed.scheme}://{parsed.hostname}...: has credentials in it, "
            f"which would end in the job's entrypoint for anyone to read; give the URI "
            f"without them and set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD on "
            f"the cluster's nodes (cluster/README.md)")
    return uri


def check_storage(storage: str | None) -> str:
    """Ray Tune's storage: a cloud URI or an absolute path shared by every node."""
    if not storage:
        raise SubmitError(
            "--storage is required to submit: Ray Tune on several nodes needs storage "
            "that every node reaches, e.g. s3://bucket/studies or /mnt/shared/studies "
            "(an NFS mount on every node)")
    if "://" in storage:
        scheme = storage.split("://", 1)[0]
        if scheme not in STORAGE_SCHEMES:
            raise SubmitError(f"--storage {storage!r}: unknown scheme {scheme!r}; expected "
                              f"one of {', '.join(STORAGE_SCHEMES)} or an absolute path")
        return storage
    if not storage.startswith("/"):
        raise SubmitError(
            f"--storage {storage!r}: must be absolute (a relative path would land in the "
            f"job's temporary working folder on the head node and be lost)")
    return storage


def _study_name(study_file: Path, validate: bool) -> str:
    if validate:
        from studies.studyfile.spec import load_study  # StudyError names file, field and line

        return load_study(study_file).name
    import yaml

    data = yaml.safe_load(study_file.read_text())
    name = data.get("name") if isinstance(data, dict) else None
    if not isinstance(name, str) or not name:
        raise SubmitError(f"{study_file}: no 'name' at the top of the study file")
    return name


def build_entrypoint(study_path: str, tracking_uri: str, storage: str | None,
                     output: str | None = None, extra_args: Sequence[str] = (),
                     python: str = "python") -> str:
    """The shell command the job runs on the head node (every part shell-quoted)."""
    parts = [python, "-m", "studies.cli", "run", study_path, "--address", "auto",
             "--tracking-uri", tracking_uri]
    if storage is not None:
        parts += ["--storage", storage]
    if output is not None:
        parts += ["--output", output]
    parts += ["--no-report", *extra_args]
    return " ".join(shlex.quote(str(part)) for part in parts)


def _submission_id(name: str) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = re.sub(r"[^A-Za-z0-9_.-]", "-", name)[:60]
    return f"studies-{safe}-{stamp}-{secrets.token_hex(2)}"


def _refuse_secrets(token: RayToken | None, **parts: Any) -> None:
    secrets_here = _local_secrets(token)
    for label, value in parts.items():
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        for secret in secrets_here:
            if secret in text:
                raise SubmitError(
                    f"refusing to submit: the job's {label} would contain a secret (the Ray "
                    f"token or an MLflow password from this environment); pass secrets "
                    f"through the nodes' environment, never as job arguments")


# ----------------------------------------------------------------------------- the API


def submit_study(study_file: str | os.PathLike, address: str | None = None,
                 tracking_uri: str | None = None, storage: str | None = None,
                 follow: bool = False, extra_args: Sequence[str] = (), *,
                 output: str | None = None, token_file: str | os.PathLike | None = None,
                 project_dir: str | os.PathLike | None | bool = True,
                 submission_id: str | None = None,
                 entrypoint_num_cpus: float | None = None,
                 entrypoint_resources: dict[str, float] | None = None,
                 validate: bool = True, python: str = "python",
                 stream: IO[str] | None = None) -> str:
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
    name = _study_name(study_path, validate)
    if project_dir is True:
        project = find_project_dir()
    elif project_dir in (False, None):
        project = None
    else:
        project = Path(project_dir).resolve()
        if not project.is_dir():
            raise SubmitError(f"project folder {project} does not exist")

    client, token = job_client(address, token_file)
    with tempfile.TemporaryDirectory(prefix="studies-submit-") as tmp:
        staging = Path(tmp) / "working_dir"
        staging.mkdir()
        relative_study = stage_working_dir(study_path.resolve(), project, staging)
        entrypoint = build_entrypoint(relative_study, tracking_uri, storage, output,
                                      [str(a) for a in extra_args], python=python)
        runtime_env = {"working_dir": str(staging), "excludes": list(DEFAULT_EXCLUDES)}
        metadata = {"studies.study": name, "studies.file": study_path.name,
                    "studies.submitted_from": socket.gethostname()}
        job_id = submission_id or _submission_id(name)
        _refuse_secrets(token, entrypoint=entrypoint, runtime_env=runtime_env,
                        metadata=metadata, submission_id=job_id)
        kwargs: dict[str, Any] = {}
        if entrypoint_num_cpus is not None:
            kwargs["entrypoint_num_cpus"] = entrypoint_num_cpus
        if entrypoint_resources:
            kwargs["entrypoint_resources"] = dict(entrypoint_resources)
        try:
            job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                                       metadata=metadata, submission_id=job_id, **kwargs)
        except RuntimeError as error:
            detail = mask_secrets(str(error), _local_secrets(token))
            raise SubmitError(f"the Ray cluster refused the job: {detail}") from None
    if follow:
        _follow(client, job_id, stream or sys.stdout, _local_secrets(token))
    return job_id


def job_status(address: str | None, job_id: str, *,
               token_file: str | os.PathLike | None = None) -> str:
    """The job's status as a string: PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED."""
    client, _ = job_client(address, token_file)
    return _status(client, job_id)


def _status(client, job_id: str) -> str:
    try:
        status = client.get_job_status(job_id)
    except RuntimeError as error:
        raise SubmitError(f"no job {job_id!r} on this cluster ({str(error).splitlines()[0]})"
                          ) from None
    except OSError as error:  # requests' ConnectionError: the head went away
        raise SubmitError(f"lost contact with the Ray Jobs API while asking about job "
                          f"{job_id!r}: {type(error).__name__}") from None
    return str(getattr(status, "value", status))


def wait_for_job(address: str | None, job_id: str, timeout_s: float | None = None, *,
                 token_file: str | os.PathLike | None = None, poll_s: float = 1.0) -> str:
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


def _follow(client, job_id: str, stream: IO[str], secret_values: list[str]) -> str:
    """Stream the job's log until it ends; returns the final status."""

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            stream.write(mask_secrets(chunk, secret_values))
            stream.flush()

    try:
        with warnings.catch_warnings():
            # Ray's own log socket call (ray 2.60, sdk.tail_job_logs) trips aiohttp's
            # "ssl=None is deprecated"; not ours to fix, and noise for the user
            warnings.filterwarnings("ignore", message="ssl=None is deprecated",
                                    category=DeprecationWarning)
            asyncio.run(tail())
    except RuntimeError:
        # the log socket closed early (e.g. the head restarted): fall back to polling
        pass
    while True:
        status = _status(client, job_id)
        if status in TERMINAL_STATUSES:
            return status
        time.sleep(1.0)


def job_logs(address: str | None, job_id: str, follow: bool = False, *,
             token_file: str | os.PathLike | None = None,
             stream: IO[str] | None = None) -> str:
    """Write the job's log to `stream` (stdout by default), masked of local secrets;
    `follow`: keep streaming until the job ends. Returns the job's status afterwards."""
    client, token = job_client(address, token_file)
    stream = stream or sys.stdout
    secret_values = _local_secrets(token)
    if follow:
        return _follow(client, job_id, stream, secret_values)
    status = _status(client, job_id)  # a clear error for an unknown job first
    stream.write(mask_secrets(client.get_job_logs(job_id), secret_values))
    stream.flush()
    return status


def list_jobs(address: str | None = None, *,
              token_file: str | os.PathLike | None = None) -> list:
    """The cluster's jobs (Ray `JobDetails`), oldest first."""
    client, _ = job_client(address, token_file)
    jobs = [job for job in client.list_jobs() if job.submission_id]
    return sorted(jobs, key=lambda job: job.start_time or 0)


def stop_job(address: str | None, job_id: str, *,
             token_file: str | os.PathLike | None = None,
             wait_s: float | None = 30.0) -> bool:
    """Ask the job to stop (SIGTERM to the driver, then SIGKILL); with `wait_s`, wait that
    long for it to end. Returns True when the job was running."""
    client, _ = job_client(address, token_file)
    _status(client, job_id)
    stopped = bool(client.stop_job(job_id))
    if wait_s:
        deadline = time.monotonic() + wait_s
        while _status(client, job_id) not in TERMINAL_STATUSES and \
                time.monotonic() < deadline:
            time.sleep(0.5)
    return stopped


# ----------------------------------------------------------------------------- the CLI


def _fail(message: str) -> int:
    print(f"studies: error: {message}", file=sys.stderr, flush=True)
    return 2


def _exit_code(status: str) -> int:
    return 0 if status == "SUCCEEDED" else 1


def _add_connection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", default=None, metavar="URL",
        help="the Ray dashboard of the cluster's head node, which serves the Jobs API, "
             "e.g. http://HEAD:8265 (default: $RAY_API_SERVER_ADDRESS, $RAY_ADDRESS, "
             f"else {DEFAULT_DASHBOARD_ADDRESS})")
    parser.add_argument(
        "--token-file", default=None, metavar="PATH",
        help=f"file holding the cluster's Ray auth token (default: ${TOKEN_ENV}, "
             f"${TOKEN_PATH_ENV}, else {DEFAULT_TOKEN_FILE} when it exists)")


def _guard(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def guarded(args: argparse.Namespace) -> int:
        from studies.studyfile.spec import StudyError

        try:
            return run(args)
        except (SubmitError, StudyError) as error:
            return _fail(str(error))
        except KeyboardInterrupt:
            job = getattr(args, "job_id", None) or getattr(args, "_submitted", None)
            if job:
                print(f"\n[studies] stopped following; job {job} keeps running on the "
                      f"cluster (`studies stop {job}` ends it)", file=sys.stderr)
            return 130
    return guarded


def _submit(args: argparse.Namespace) -> int:
    try:
        extra = shlex.split(args.run_args or "")
    except ValueError as error:
        raise SubmitError(f"--run-args {args.run_args!r}: {error}") from None
    if args.smoke:
        extra.insert(0, "--smoke")
    resources = None
    if args.entrypoint_resources:
        try:
            resources = json.loads(args.entrypoint_resources)
        except json.JSONDecodeError as error:
            raise SubmitError(f"--entrypoint-resources {args.entrypoint_resources!r}: not "
                              f"JSON ({error.msg}); expected e.g. '{{\"head\": 1}}'") from None
    job_id = submit_study(
        args.file, args.address, args.tracking_uri, args.storage, follow=False,
        extra_args=extra, output=args.output, token_file=args.token_file,
        project_dir=False if args.no_project else True,
        submission_id=args.submission_id, entrypoint_num_cpus=args.entrypoint_num_cpus,
        entrypoint_resources=resources)
    print(job_id, flush=True)
    if not args.follow:
        print(f"[studies] follow it with `studies logs {job_id} --follow`; "
              f"stop it with `studies stop {job_id}`", file=sys.stderr, flush=True)
        return 0
    args._submitted = job_id
    status = job_logs(args.address, job_id, follow=True, token_file=args.token_file)
    print(f"[studies] job {job_id}: {status}", file=sys.stderr, flush=True)
    return _exit_code(status)


def _add_submit(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="the study file (YAML)")
    parser.add_argument("--run-args", default="", metavar="'ARGS'",
                        help="more arguments for `studies run` on the cluster, one string "
                             "(write it with =, e.g. --run-args='--progress-every 60')")
    _add_connection(parser)
    parser.add_argument(
        "--tracking-uri", default=None, metavar="URI",
        help="the MLflow server every worker logs to, http(s)://HOST:PORT, without "
             "credentials (default: $MLFLOW_TRACKING_URI)")
    parser.add_argument(
        "--storage", default=None, metavar="URI",
        help="Ray Tune storage that every node reaches: s3://bucket/path, gs://..., or an "
             "absolute path on a shared file system")
    parser.add_argument(
        "--output", default=None, metavar="DIR",
        help="absolute folder on the head node for the study's files (study.yaml, "
             "run.json, optuna.db); default: --storage when it is a path")
    parser.add_argument("--follow", action="store_true",
                        help="stream the job's log until it ends; exit 0 only if it succeeded")
    parser.add_argument("--smoke", action="store_true",
                        help="pass --smoke to `studies run` (tiny synthetic run)")
    parser.add_argument("--submission-id", default=None, metavar="ID",
                        help="the job id to use (default: studies-NAME-DATE-TIME-XXXX)")
    parser.add_argument("--entrypoint-num-cpus", type=float, default=None, metavar="N",
                        help="CPUs reserved for the driver (default 0: it runs on the head)")
    parser.add_argument("--entrypoint-resources", default=None, metavar="JSON",
                        help="custom resources reserved for the driver, e.g. '{\"head\": 1}'")
    parser.add_argument("--no-project", action="store_true",
                        help="ship only the study file; the cluster image has the project")


def _jobs(args: argparse.Namespace) -> int:
    jobs = list_jobs(args.address, token_file=args.token_file)
    if not jobs:
        print("(no jobs)")
        return 0
    rows = [("JOB", "STATUS", "STUDY", "STARTED", "ENDED")]
    for job in jobs:
        def when(ms):
            return _dt.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M:%S") \
                if ms else "-"
        rows.append((job.submission_id, str(getattr(job.status, "value", job.status)),
                     (job.metadata or {}).get("studies.study", "-"),
                     when(job.start_time), when(job.end_time)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _logs(args: argparse.Namespace) -> int:
    status = job_logs(args.address, args.job_id, follow=args.follow,
                      token_file=args.token_file)
    if args.follow:
        print(f"[studies] job {args.job_id}: {status}", file=sys.stderr, flush=True)
        return _exit_code(status)
    return 0


def _stop(args: argparse.Namespace) -> int:
    was_running = stop_job(args.address, args.job_id, token_file=args.token_file)
    status = job_status(args.address, args.job_id, token_file=args.token_file)
    print(f"job {args.job_id}: {status}" + ("" if was_running else " (was not running)"))
    return 0


def add_subcommands(subparsers) -> None:
    """Register `submit`, `jobs`, `logs` and `stop` on an argparse subparsers object (each
    sets `handler`, a function (args) -> exit code)."""
    parser = subparsers.add_parser(
        "submit", help="send a study file to a Ray cluster as a Ray job",
        description="Validate the study file, then submit it as a Ray job: the project and "
                    "the file travel in the job's runtime environment and `studies run` "
                    "runs on the cluster, logging to the MLflow server at --tracking-uri. "
                    "Prints the job id.")
    _add_submit(parser)
    parser.set_defaults(handler=_guard(_submit))

    parser = subparsers.add_parser("jobs", help="list the Ray jobs of a cluster",
                                   description="The cluster's jobs, oldest first.")
    _add_connection(parser)
    parser.set_defaults(handler=_guard(_jobs))

    parser = subparsers.add_parser("logs", help="print (or follow) a job's log",
                                   description="The log of a submitted job (the driver's "
                                               "output).")
    parser.add_argument("job_id", metavar="JOB")
    parser.add_argument("--follow", "-f", action="store_true",
                        help="keep streaming until the job ends")
    _add_connection(parser)
    parser.set_defaults(handler=_guard(_logs))

    parser = subparsers.add_parser("stop", help="stop a running job",
                                   description="Stop the job's driver (its trials end with "
                                               "it); finished cells stay in MLflow and a "
                                               "later submission skips them.")
    parser.add_argument("job_id", metavar="JOB")
    _add_connection(parser)
    parser.set_defaults(handler=_guard(_stop))
