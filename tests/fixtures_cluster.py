"""Real services for the cluster tests: PostgreSQL, an MLflow server on it, a Ray cluster.

- `postgres_server`: a throwaway PostgreSQL cluster (initdb + pg_ctl) in a temporary folder,
  listening on 127.0.0.1 only, on a free port, password authentication (scram-sha-256).
  initdb refuses to run as root, so as root the server runs as the `postgres` system user
  (created by the Debian package). Skipped, with the reason, only when the PostgreSQL
  server binaries are not installed (`apt-get install -y postgresql`) or psycopg2 is
  missing.
- `mlflow_pg_server`: `cluster/mlflow/start-mlflow-server.sh` (the script the deployment
  uses) on 127.0.0.1: PostgreSQL backend store, proxied artifact store in a folder, basic
  auth with an admin and a `studies` user for the Ray nodes.
- `ray_cluster`: a two-node Ray cluster on this machine, started with `ray start --block`:
  a head (`--num-cpus 2`, resource `node_a`) and a worker (`--num-cpus 2`, resource
  `node_b`), each with its own `--temp-dir`, token authentication on
  (RAY_AUTH_MODE=token, the token in a file named by RAY_AUTH_TOKEN_PATH), the dashboard
  (Jobs API) on 127.0.0.1. The nodes get the MLflow `studies` user's credentials in
  their environment, as cluster/README.md tells a real cluster to do.

Only processes these fixtures start are ever stopped, by their pid: the `ray start --block`
process of a node is sent SIGTERM (it stops its node's Ray processes, like `ray stop` for
that node alone), and what is left of the descendants recorded beforehand gets SIGKILL.
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

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
MLFLOW_SCRIPT = REPO_ROOT / "cluster" / "mlflow" / "start-mlflow-server.sh"
_MLFLOW_START_TIMEOUT_S = 240.0
_RAY_START_TIMEOUT_S = 120.0


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
    return stat[stat.rfind(")") + 2:].split()  # the name is in parentheses, may hold spaces


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
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                        key=lambda p: int(Path(p).parent.parent.name)
                        if Path(p).parent.parent.name.isdigit() else 0)
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

        connection = psycopg2.connect(host=self.host, port=self.port, user=self.superuser,
                                      password=self.password, dbname=database)
        connection.autocommit = True  # CREATE DATABASE cannot run in a transaction
        return connection

    def create_role_and_databases(self, role: str, password: str,
                                  databases: list[str]) -> None:
        from psycopg2 import sql

        connection = self.connect()  # not `with connection`: that opens a transaction
        try:
            with connection.cursor() as cursor:
                cursor.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD %s").format(
                    sql.Identifier(role)), (password,))
                for name in databases:
                    cursor.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
                        sql.Identifier(name), sql.Identifier(role)))
        finally:
            connection.close()

    def _run(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin_dir / args[0]), *args[1:]], user=self.run_as,
                              capture_output=True, text=True, timeout=timeout,
                              cwd=self.folder)

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.folder / "data"), "-m", "immediate", "-w",
                  "stop", timeout=60)
        shutil.rmtree(self.folder, ignore_errors=True)


def start_postgres() -> PostgresServer:
    bin_dir = find_postgres_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed; "
                    "install them with `apt-get install -y postgresql`")
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        pytest.skip("psycopg2 is not installed (pip install psycopg2-binary): MLflow needs "
                    "it for a PostgreSQL backend store")
    run_as = None
    if os.geteuid() == 0:  # initdb refuses root
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run initdb as")
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
    init = server._run("initdb", "-D", str(folder / "data"), "-U", server.superuser,
                       "--auth=scram-sha-256", f"--pwfile={pwfile}", "-E", "UTF8",
                       "--locale=C.UTF-8", "--no-sync")
    pwfile.unlink()
    if init.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError(f"initdb failed:\n{init.stdout}\n{init.stderr}")
    last = ""
    for _attempt in range(3):  # the free port can be taken between probe and bind
        server.port = free_port()
        options = (f"-c listen_addresses=127.0.0.1 -p {server.port} "
                   f"-c unix_socket_directories={folder} -c fsync=off "
                   f"-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        started = server._run("pg_ctl", "-D", str(folder / "data"), "-l",
                              str(folder / "postgres.log"), "-w", "-t", "90", "-o", options,
                              "start")
        if started.returncode == 0:
            return server
        last = started.stdout + started.stderr
        log = folder / "postgres.log"
        if log.exists():
            last += log.read_text(errors="replace")[-2000:]
    shutil.rmtree(folder, ignore_errors=True)
    raise RuntimeError(f"PostgreSQL did not start (3 attempts):\n{last}")


@pytest.fixture(scope="module")
def postgres_server():
    server = start_postgres()
    try:
        yield server
    finally:
        server.stop()


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

        return psycopg2.connect(host="127.0.0.1", port=self.database_port, user="mlflow",
                                password=self.database_password, dbname="mlflow")

    def client(self, admin: bool = True):
        """An MlflowClient with this server's credentials (set for the calls it makes)."""
        return _AuthenticatedClient(self.uri, *(
            (self.admin_user, self.admin_password) if admin else (self.user, self.password)))

    def request(self, method: str, path: str, payload: dict | None = None,
                auth: tuple[str, str] | None = None) -> tuple[int, dict]:
        data = json.dumps(payload).encode() if payload is not None else None
        request = urllib.request.Request(f"{self.uri}{path}", data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if auth:
            request.add_header("Authorization",
                               "Basic " + b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
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
        self._credentials = {"MLFLOW_TRACKING_USERNAME": user,
                             "MLFLOW_TRACKING_PASSWORD": password}

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


def start_mlflow_server(postgres: PostgresServer, workdir: Path) -> MlflowServer:
    database_password = secrets.token_hex(16)
    postgres.create_role_and_databases("mlflow", database_password, ["mlflow", "mlflow_auth"])
    admin_password = "admin-" + secrets.token_hex(12)
    artifacts = workdir / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    env.update({
        "PGPASSWORD": database_password,
        "MLFLOW_DB_HOST": "127.0.0.1",
        "MLFLOW_DB_PORT": str(postgres.port),
        "MLFLOW_DB_USER": "mlflow",
        "MLFLOW_AUTH_ADMIN_PASSWORD": admin_password,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
        "MLFLOW_ARTIFACTS_DESTINATION": str(artifacts),
        "MLFLOW_HOST": "127.0.0.1",
        "MLFLOW_WORKERS": "1",
        "PYTHON": sys.executable,
        "TMPDIR": str(workdir),
    })
    last = ""
    for _attempt in range(2):
        port = free_port()
        env["MLFLOW_PORT"] = str(port)
        uri = f"http://127.0.0.1:{port}"
        log_path = workdir / f"mlflow-{port}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(["bash", str(MLFLOW_SCRIPT)], env=env, cwd=workdir,
                                       stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _MLFLOW_START_TIMEOUT_S
        while time.monotonic() < deadline and process.poll() is None and not _healthy(uri):
            time.sleep(0.5)
        if process.poll() is None and _healthy(uri):
            server = MlflowServer(uri, "admin", admin_password, "studies",
                                  "studies-" + secrets.token_hex(12), artifacts, log_path,
                                  database_password, postgres.port, process)
            status, body = server.request(
                "POST", "/api/2.0/mlflow/users/create",
                {"username": server.user, "password": server.password},
                auth=(server.admin_user, server.admin_password))
            if status != 200:
                _kill_tree(process)
                raise RuntimeError(f"creating the MLflow user failed: HTTP {status} {body}")
            return server
        _kill_tree(process)
        last = log_path.read_text(errors="replace")[-4000:]
    raise RuntimeError(f"the MLflow server did not become healthy:\n{last}")


@pytest.fixture(scope="module")
def mlflow_pg_server(postgres_server, tmp_path_factory):
    server = start_mlflow_server(postgres_server, tmp_path_factory.mktemp("mlflow_pg"))
    try:
        yield server
    finally:
        _kill_tree(server.process, grace_s=20)


# ----------------------------------------------------------------------------- Ray


@dataclass
class RayNode:
    name: str
    resources: dict
    temp_dir: Path
    log_path: Path
    process: subprocess.Popen | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class LoopbackRayCluster:
    """A head and a worker node started with `ray start --block` on this machine."""

    def __init__(self, root: Path, node_env: dict[str, str], token: str, cpus: int = 2):
        self.root = root
        self.token = token
        self.cpus = cpus
        self.token_file = root / "ray_auth_token"
        self.token_file.write_text(token + "\n")
        self.token_file.chmod(0o600)
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN",
                                 "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE",
                                 "MLFLOW_TRACKING_URI")}
        self.env.update(node_env)
        self.env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_file),
                         "RAY_USAGE_STATS_ENABLED": "0"})
        self.gcs_port = 0
        self.dashboard_port = 0
        self.head: RayNode | None = None
        self.worker: RayNode | None = None
        self._workers_started = 0

    # -- addresses

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def get(self, path: str, token: str | None = "default", timeout: float = 10.0):
        """(HTTP status, JSON body or None) of a GET on the dashboard."""
        request = urllib.request.Request(f"{self.dashboard_url}{path}")
        token = self.token if token == "default" else token
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                body = response.read()
                try:
                    return response.status, json.loads(body)
                except json.JSONDecodeError:
                    return response.status, None
        except urllib.error.HTTPError as error:
            return error.code, None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return None, None

    def nodes(self) -> list[dict]:
        status, body = self.get("/api/v0/nodes?limit=1000&detail=1")
        if status != 200 or not body:
            return []
        return body["data"]["result"]["result"]

    def actors(self) -> list[dict]:
        status, body = self.get("/api/v0/actors?limit=10000&detail=1", timeout=30)
        if status != 200 or not body:
            return []
        return body["data"]["result"]["result"]

    def node_id_with(self, resource: str, alive_only: bool = True) -> str | None:
        for node in self.nodes():
            if resource in node.get("resources_total", {}) and \
                    (node["state"] == "ALIVE" or not alive_only):
                return node["node_id"]
        return None

    # -- starting and stopping nodes

    def _start(self, node: RayNode, args: list[str]) -> None:
        command = [shutil.which("ray") or "ray", "start", "--block",
                   "--node-ip-address", "127.0.0.1",
                   "--num-cpus", str(self.cpus), "--num-gpus", "0",
                   "--resources", json.dumps(node.resources),
                   "--object-store-memory", str(150 * 1024 ** 2),
                   "--temp-dir", str(node.temp_dir),
                   "--dashboard-agent-listen-port", str(free_port()),
                   "--dashboard-agent-grpc-port", str(free_port()),
                   "--runtime-env-agent-port", str(free_port()),
                   "--metrics-export-port", str(free_port()),
                   "--disable-usage-stats", *args]
        with open(node.log_path, "ab") as log:
            node.process = subprocess.Popen(command, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, cwd=self.root)

    def start_head(self) -> None:
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        # short paths: Ray's Unix socket paths live under the temp dir (108-byte limit)
        self.head = RayNode("head", {"node_a": 1}, Path(tempfile.mkdtemp(prefix="rh-")),
                            self.root / "ray-head.log")
        self._start(self.head, ["--head", "--port", str(self.gcs_port),
                                "--include-dashboard", "true",
                                "--dashboard-host", "127.0.0.1",
                                "--dashboard-port", str(self.dashboard_port),
                                "--ray-client-server-port", str(free_port())])
        deadline = time.monotonic() + _RAY_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.head.alive:
                break
            status, _ = self.get("/api/version")
            if status == 200 and self.node_id_with("node_a"):
                return
            time.sleep(0.5)
        raise RuntimeError("the Ray head did not start:\n"
                           + self.head.log_path.read_text(errors="replace")[-4000:])

    def start_worker(self) -> None:
        self._workers_started += 1
        self.worker = RayNode(f"worker{self._workers_started}", {"node_b": 1},
                              Path(tempfile.mkdtemp(prefix="rw-")),
                              self.root / f"ray-worker{self._workers_started}.log")
        self._start(self.worker, ["--address", self.gcs_address])
        deadline = time.monotonic() + _RAY_START_TIMEOUT_S
        while time.monotonic() < deadline and self.worker.alive:
            if self.node_id_with("node_b"):
                return
            time.sleep(0.5)
        raise RuntimeError("the Ray worker node did not join:\n"
                           + self.worker.log_path.read_text(errors="replace")[-4000:])

    def ensure_worker(self) -> None:
        if self.worker is None or not self.worker.alive or not self.node_id_with("node_b"):
            if self.worker is not None:
                self.stop_node(self.worker)
            self.start_worker()

    def stop_node(self, node: RayNode, grace_s: float = 30.0, crash: bool = False) -> None:
        """Stop one node: its `ray start --block` gets SIGTERM (like `ray stop` there,
        which drains the node first), or with `crash` every process of the node gets
        SIGKILL, the raylet first (a machine that dies)."""
        if node.process is not None:
            _kill_tree(node.process, grace_s=grace_s, hard=crash)
        shutil.rmtree(node.temp_dir, ignore_errors=True)

    def shutdown(self) -> None:
        for node in (self.worker, self.head):
            if node is not None:
                self.stop_node(node)


@pytest.fixture(scope="module")
def ray_cluster(mlflow_pg_server, tmp_path_factory):
    """The two-node cluster; its nodes can reach `mlflow_pg_server` as user `studies`."""
    if shutil.which("ray") is None:
        pytest.skip("the `ray` command is not installed")
    try:
        import ray.dashboard.modules.job  # noqa: F401
        import aiohttp_cors  # noqa: F401
    except ImportError:
        pytest.skip("the Ray dashboard (Jobs API) needs `pip install 'ray[default]'`")
    root = tmp_path_factory.mktemp("ray_cluster")
    cluster = LoopbackRayCluster(
        root, {"MLFLOW_TRACKING_USERNAME": mlflow_pg_server.user,
               "MLFLOW_TRACKING_PASSWORD": mlflow_pg_server.password},
        token=secrets.token_hex(24))
    try:
        cluster.start_head()
        cluster.start_worker()
        yield cluster
    finally:
        cluster.shutdown()
