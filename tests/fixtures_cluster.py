"""Real services for the cluster tests: PostgreSQL, an MLflow server on it, a Ray cluster.

- `postgres_server`: a throwaway PostgreSQL cluster (`tests/local_services.start_postgres`),
  skipped, with the reason, only when the PostgreSQL server binaries are not installed
  (`apt-get install -y postgresql`) or psycopg2 is missing.
- `mlflow_pg_server`: `cluster/mlflow/start-mlflow-server.sh` (the script the deployment
  uses) on 127.0.0.1 (`tests/local_services.start_mlflow_server`): PostgreSQL backend
  store, proxied artifact store in a folder, basic auth with an admin and a `studies` user
  for the Ray nodes.
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

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

try:  # tests/ is a namespace package when the repository root is on sys.path
    from tests.local_services import (
        REPO_ROOT,
        MlflowServer,
        PostgresServer,
        ServiceUnavailable,
        _kill_tree,
        descendants,
        free_port,
        start_mlflow_server,
        start_postgres,
    )
except ImportError:  # pytest put tests/ itself on sys.path
    from local_services import (  # noqa: F401
        REPO_ROOT,
        MlflowServer,
        PostgresServer,
        ServiceUnavailable,
        _kill_tree,
        descendants,
        free_port,
        start_mlflow_server,
        start_postgres,
    )

_RAY_START_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def postgres_server():
    try:
        server = start_postgres()
    except ServiceUnavailable as missing:
        pytest.skip(str(missing))
    try:
        yield server
    finally:
        server.stop()


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
        self.env = {
            k: v
            for k, v in os.environ.items()
            if k
            not in (
                "RAY_ADDRESS",
                "RAY_API_SERVER_ADDRESS",
                "RAY_AUTH_TOKEN",
                "RAY_AUTH_TOKEN_PATH",
                "RAY_AUTH_MODE",
                "MLFLOW_TRACKING_URI",
            )
        }
        self.env.update(node_env)
        self.env.update(
            {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_file), "RAY_USAGE_STATS_ENABLED": "0"}
        )
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
            if resource in node.get("resources_total", {}) and (node["state"] == "ALIVE" or not alive_only):
                return node["node_id"]
        return None

    # -- starting and stopping nodes

    def _start(self, node: RayNode, args: list[str]) -> None:
        command = [
            shutil.which("ray") or "ray",
            "start",
            "--block",
            "--node-ip-address",
            "127.0.0.1",
            "--num-cpus",
            str(self.cpus),
            "--num-gpus",
            "0",
            "--resources",
            json.dumps(node.resources),
            "--object-store-memory",
            str(150 * 1024**2),
            "--temp-dir",
            str(node.temp_dir),
            "--dashboard-agent-listen-port",
            str(free_port()),
            "--dashboard-agent-grpc-port",
            str(free_port()),
            "--runtime-env-agent-port",
            str(free_port()),
            "--metrics-export-port",
            str(free_port()),
            "--disable-usage-stats",
            *args,
        ]
        with open(node.log_path, "ab") as log:
            node.process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.root)

    def start_head(self) -> None:
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        # short paths: Ray's Unix socket paths live under the temp dir (108-byte limit)
        self.head = RayNode("head", {"node_a": 1}, Path(tempfile.mkdtemp(prefix="rh-")), self.root / "ray-head.log")
        self._start(
            self.head,
            [
                "--head",
                "--port",
                str(self.gcs_port),
                "--include-dashboard",
                "true",
                "--dashboard-host",
                "127.0.0.1",
                "--dashboard-port",
                str(self.dashboard_port),
                "--ray-client-server-port",
                str(free_port()),
            ],
        )
        deadline = time.monotonic() + _RAY_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.head.alive:
                break
            status, _ = self.get("/api/version")
            if status == 200 and self.node_id_with("node_a"):
                return
            time.sleep(0.5)
        raise RuntimeError("the Ray head did not start:\n" + self.head.log_path.read_text(errors="replace")[-4000:])

    def start_worker(self) -> None:
        self._workers_started += 1
        self.worker = RayNode(
            f"worker{self._workers_started}",
            {"node_b": 1},
            Path(tempfile.mkdtemp(prefix="rw-")),
            self.root / f"ray-worker{self._workers_started}.log",
        )
        self._start(self.worker, ["--address", self.gcs_address])
        deadline = time.monotonic() + _RAY_START_TIMEOUT_S
        while time.monotonic() < deadline and self.worker.alive:
            if self.node_id_with("node_b"):
                return
            time.sleep(0.5)
        raise RuntimeError(
            "the Ray worker node did not join:\n" + self.worker.log_path.read_text(errors="replace")[-4000:]
        )

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
        import aiohttp_cors  # noqa: F401
        import ray.dashboard.modules.job  # noqa: F401
    except ImportError:
        pytest.skip("the Ray dashboard (Jobs API) needs `pip install 'ray[default]'`")
    root = tmp_path_factory.mktemp("ray_cluster")
    cluster = LoopbackRayCluster(
        root,
        {"MLFLOW_TRACKING_USERNAME": mlflow_pg_server.user, "MLFLOW_TRACKING_PASSWORD": mlflow_pg_server.password},
        token=secrets.token_hex(24),
    )
    try:
        cluster.start_head()
        cluster.start_worker()
        yield cluster
    finally:
        cluster.shutdown()
