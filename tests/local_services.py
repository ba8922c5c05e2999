"""Throwaway local services for the tests and the benchmarks, without pytest: a PostgreSQL
cluster and an MLflow server on it, each on 127.0.0.1 and a free port, and the process
helpers that stop only what they started.

- `start_postgres`: a throwaway PostgreSQL cluster (initdb + pg_ctl) in a temporary folder,
  listening on 127.0.0.1 only, password authentication (scram-sha-256). initdb refuses to
  run as root, so as root the server runs as the `postgres` system user (created by the
  Debian package). Raises `ServiceUnavailable`, with the reason, when the PostgreSQL server
  binaries or psycopg2 are missing (the fixtures turn it into a skip).
- `start_mlflow_server`: `cluster/mlflow/start-mlflow-server.sh` (the script the deployment
  uses) on 127.0.0.1: PostgreSQL backend store, proxied artifact store in a folder, basic
  auth with an admin and a `studies` user; or, with ``auth=False``, a plain
  `mlflow server` on the same store (what the auth layer costs is then measurable).

Used by tests/fixtures_cluster.py and benchmarks/tracking_load.py.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from base64 import b64encode
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MLFLOW_SCRIPT = REPO_ROOT / "cluster" / "mlflow" / "start-mlflow-server.sh"
_MLFLOW_START_TIMEOUT_S = 240.0


class ServiceUnavailable(RuntimeError):
    """A service cannot be started on this machine (its binaries are missing); the message
    says what to install."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read().decode(errors="replace")
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()  # the name is in parentheses, may hold spaces


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every live descendant of `pid` as (pid, start time), read from /proc; the start
    time tells a process from a later one that reuses its pid."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            children.setdefault(int(fields[1]), []).append((int(entry), fields[19]))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child[0])
    return found


def _same_process_alive(process: tuple[int, str]) -> bool:
    fields = _stat(process[0])
    return fields is not None and fields[19] == process[1] and fields[0] != "Z"


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _kill(processes: list[tuple[int, str]], sig: int) -> None:
    for process in processes:
        if _same_process_alive(process):
            try:
                os.kill(process[0], sig)
            except (ProcessLookupError, PermissionError):
                pass


def _kill_tree(process: subprocess.Popen, grace_s: float = 30.0, hard: bool = False) -> None:
    """Stop `process` and every process it started (recorded before the first signal).

    hard=False: SIGTERM to `process` (it stops its children in order), wait up to
    `grace_s`, then SIGKILL what is left. hard=True: SIGKILL everything at once, the
    `raylet` first (a node that crashes)."""
    if process.poll() is not None:
        return
    tree = descendants(process.pid)
    if hard:
        raylets = [p for p in tree if _process_name(p[0]) == "raylet"]
        _kill(raylets, signal.SIGKILL)
        process.kill()
        _kill([p for p in tree if p not in raylets], signal.SIGKILL)
        process.wait(timeout=30)
    else:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_same_process_alive(p) for p in tree):
        time.sleep(0.2)
    _kill(tree, signal.SIGKILL)


# ----------------------------------------------------------------------------- PostgreSQL


def find_postgres_bin() -> Path | None:
    """The folder of `initdb` and `pg_ctl` (on PATH, else Debian's /usr/lib/postgresql/N/bin)."""
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(os.path.realpath(initdb)).parent
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0,
    )
    return Path(candidates[-1]).parent if candidates else None


@dataclass
class PostgresServer:
    host: str
    port: int
    superuser: str
    password: str
    folder: Path
    bin_dir: Path
    run_as: str | None

    def connect(self, database: str = "postgres"):
        import psycopg2

        connection = psycopg2.connect(
            host=self.host, port=self.port, user=self.superuser, password=self.password, dbname=database
        )
        connection.autocommit = True  # CREATE DATABASE cannot run in a transaction
        return connection

    def create_role_and_databases(self, role: str, password: str, databases: list[str]) -> None:
        from psycopg2 import sql

        connection = self.connect()  # not `with connection`: that opens a transaction
        try:
            with connection.cursor() as cursor:
                cursor.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD %s").format(sql.Identifier(role)), (password,))
                for name in databases:
                    cursor.execute(
                        sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(name), sql.Identifier(role))
                    )
        finally:
            connection.close()

    def _run(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.bin_dir / args[0]), *args[1:]],
            user=self.run_as,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.folder,
        )

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.folder / "data"), "-m", "immediate", "-w", "stop", timeout=60)
        shutil.rmtree(self.folder, ignore_errors=True)


def start_postgres(durable: bool = False) -> PostgresServer:
    """A new PostgreSQL cluster, started. ``durable=False`` (tests) turns off fsync,
    synchronous commit and full-page writes; ``durable=True`` keeps PostgreSQL's defaults,
    as a production server runs (every commit waits for its WAL flush)."""
    bin_dir = find_postgres_bin()
    if bin_dir is None:
        raise ServiceUnavailable(
            "PostgreSQL server binaries (initdb, pg_ctl) are not installed; "
            "install them with `apt-get install -y postgresql`"
        )
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        raise ServiceUnavailable(
            "psycopg2 is not installed (pip install psycopg2-binary): MLflow needs it for a PostgreSQL backend store"
        ) from None
    run_as = None
    if os.geteuid() == 0:  # initdb refuses root
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            raise ServiceUnavailable("running as root and there is no 'postgres' user to run initdb as") from None
        run_as = "postgres"
    # Not under pytest's tmp_path: it is private to root (0700) and the server runs as
    # `postgres`; a short path also keeps the Unix socket path under its length limit.
    folder = Path(tempfile.mkdtemp(prefix="studies-pg-"))
    if run_as:
        shutil.chown(folder, user=run_as)
    password = secrets.token_hex(16)
    pwfile = folder / "pwfile"
    pwfile.write_text(password + "\n")
    pwfile.chmod(0o600)
    if run_as:
        shutil.chown(pwfile, user=run_as)
    server = PostgresServer("127.0.0.1", 0, "studies_admin", password, folder, bin_dir, run_as)
    init = server._run(
        "initdb",
        "-D",
        str(folder / "data"),
        "-U",
        server.superuser,
        "--auth=scram-sha-256",
        f"--pwfile={pwfile}",
        "-E",
        "UTF8",
        "--locale=C.UTF-8",
        "--no-sync",
    )
    pwfile.unlink()
    if init.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError(f"initdb failed:\n{init.stdout}\n{init.stderr}")
    last = ""
    for _attempt in range(3):  # the free port can be taken between probe and bind
        server.port = free_port()
        options = (
            f"-c listen_addresses=127.0.0.1 -p {server.port} -c unix_socket_directories={folder} -c max_connections=200"
        )
        if not durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        started = server._run(
            "pg_ctl",
            "-D",
            str(folder / "data"),
            "-l",
            str(folder / "postgres.log"),
            "-w",
            "-t",
            "90",
            "-o",
            options,
            "start",
        )
        if started.returncode == 0:
            return server
        last = started.stdout + started.stderr
        log = folder / "postgres.log"
        if log.exists():
            last += log.read_text(errors="replace")[-2000:]
    shutil.rmtree(folder, ignore_errors=True)
    raise RuntimeError(f"PostgreSQL did not start (3 attempts):\n{last}")


# ----------------------------------------------------------------------------- MLflow


@dataclass
class MlflowServer:
    uri: str
    admin_user: str
    admin_password: str
    user: str  # the account the Ray nodes use
    password: str
    artifacts: Path
    log_path: Path
    database_password: str = field(repr=False)
    database_port: int = 0
    process: subprocess.Popen | None = field(default=None, repr=False)

    def connect_db(self):
        """A psycopg2 connection to the MLflow database, as the server's own role."""
        import psycopg2

        return psycopg2.connect(
            host="127.0.0.1", port=self.database_port, user="mlflow", password=self.database_password, dbname="mlflow"
        )

    def client(self, admin: bool = True):
        """An MlflowClient with this server's credentials (set for the calls it makes)."""
        return _AuthenticatedClient(
            self.uri, *((self.admin_user, self.admin_password) if admin else (self.user, self.password))
        )

    def request(
        self, method: str, path: str, payload: dict | None = None, auth: tuple[str, str] | None = None
    ) -> tuple[int, dict]:
        data = json.dumps(payload).encode() if payload is not None else None
        request = urllib.request.Request(f"{self.uri}{path}", data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if auth:
            request.add_header("Authorization", "Basic " + b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as error:
            return error.code, {}


class _AuthenticatedClient:
    """MlflowClient calls made with given basic-auth credentials (MLflow reads them from
    the environment at each request; they are set only for the duration of a call)."""

    def __init__(self, uri: str, user: str, password: str):
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(uri)
        self._credentials = {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}

    def __getattr__(self, name):
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            saved = {k: os.environ.get(k) for k in self._credentials}
            os.environ.update(self._credentials)
            try:
                return attribute(*args, **kwargs)
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value

        return call


def _healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=3) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def start_mlflow_server(
    postgres: PostgresServer, workdir: Path, *, workers: int = 1, auth: bool = True, auth_cache_ttl_s: int = 0
) -> MlflowServer:
    """An MLflow server on `postgres` with `workers` worker processes: the deployment's
    script (basic auth; `auth_cache_ttl_s` > 0 caches each checked credential that long), or
    with ``auth=False`` a plain `mlflow server` on the same kind of store."""
    database_password = secrets.token_hex(16)
    postgres.create_role_and_databases("mlflow", database_password, ["mlflow", "mlflow_auth"])
    admin_password = "admin-" + secrets.token_hex(12)
    artifacts = workdir / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    env.update(
        {
            "PGPASSWORD": database_password,
            "MLFLOW_DB_HOST": "127.0.0.1",
            "MLFLOW_DB_PORT": str(postgres.port),
            "MLFLOW_DB_USER": "mlflow",
            "MLFLOW_AUTH_ADMIN_PASSWORD": admin_password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
            "MLFLOW_ARTIFACTS_DESTINATION": str(artifacts),
            "MLFLOW_HOST": "127.0.0.1",
            "MLFLOW_WORKERS": str(int(workers)),
            "MLFLOW_AUTH_CACHE_TTL_S": str(int(auth_cache_ttl_s)),
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            "PYTHON": sys.executable,
            "TMPDIR": str(workdir),
        }
    )
    last = ""
    for _attempt in range(2):
        port = free_port()
        env["MLFLOW_PORT"] = str(port)
        uri = f"http://127.0.0.1:{port}"
        log_path = workdir / f"mlflow-{port}.log"
        command = (
            ["bash", str(MLFLOW_SCRIPT)] if auth else _plain_server_command(postgres.port, artifacts, port, workers)
        )
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _MLFLOW_START_TIMEOUT_S
        while time.monotonic() < deadline and process.poll() is None and not _healthy(uri):
            time.sleep(0.5)
        if process.poll() is None and _healthy(uri):
            server = MlflowServer(
                uri,
                "admin",
                admin_password,
                "studies",
                "studies-" + secrets.token_hex(12),
                artifacts,
                log_path,
                database_password,
                postgres.port,
                process,
            )
            if not auth:
                return server
            status, body = server.request(
                "POST",
                "/api/2.0/mlflow/users/create",
                {"username": server.user, "password": server.password},
                auth=(server.admin_user, server.admin_password),
            )
            if status != 200:
                _kill_tree(process)
                raise RuntimeError(f"creating the MLflow user failed: HTTP {status} {body}")
            return server
        _kill_tree(process)
        last = log_path.read_text(errors="replace")[-4000:]
    raise RuntimeError(f"the MLflow server did not become healthy:\n{last}")


def _plain_server_command(db_port: int, artifacts: Path, port: int, workers: int) -> list[str]:
    """`mlflow server` as the deployment's script runs it, without the basic-auth app (the
    database password comes from PGPASSWORD, as in the script)."""
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"postgresql+psycopg2://mlflow@127.0.0.1:{db_port}/mlflow",
        "--artifacts-destination",
        str(artifacts),
        "--serve-artifacts",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        str(int(workers)),
    ]
