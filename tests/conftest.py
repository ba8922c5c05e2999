"""Shared pytest fixtures.

`mlflow_server`: a real MLflow tracking server process on 127.0.0.1 for the whole test
session (SQLite backend and proxied artifact store in a temporary folder). Tests that
talk to it should create their own experiment (a unique name) so they do not see each
other's runs.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

# Inductor keys the C++ it compiles by the generated code, not by ATen's CPU kernels: code built
# under AVX-512 and reused in a run with ATEN_CPU_CAPABILITY=default fails to compile (its vector
# headers are absent there). A run with a chosen capability gets a cache of its own (Ray's
# workers inherit it).
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{os.getuid()}_{os.environ['ATEN_CPU_CAPABILITY']}"
    )

# A warm local Ray (`studies run --keep-warm`, studies.running.warm_ray) is never joined from a
# user's state folder, and none is kept unless a test asks: the suite has a state folder of its
# own, whose warm Rays `_no_warm_ray_left` stops at the end.
os.environ["STUDIES_STATE_DIR"] = tempfile.mkdtemp(prefix="studies-state-")
os.environ.pop("STUDIES_KEEP_WARM", None)


@pytest.fixture(scope="session", autouse=True)
def _no_warm_ray_left():
    yield
    from studies.running.warm_ray import stop_all

    stop_all()
    shutil.rmtree(os.environ["STUDIES_STATE_DIR"], ignore_errors=True)


_SERVER_START_TIMEOUT_S = 180.0  # a cold start on a loaded 2-core machine takes ~15-40 s


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _mlflow_executable() -> list[str]:
    exe = shutil.which("mlflow")
    if exe is not None:
        return [exe]
    return [sys.executable, "-m", "mlflow"]


def _stop(process: subprocess.Popen) -> None:
    """Terminate the server and the workers it spawned (its own process group)."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)  # the group we created with start_new_session
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=15)


def _start_server(workdir: Path, port: int | None = None) -> tuple[subprocess.Popen, str, Path]:
    port = port or _free_port()
    uri = f"http://127.0.0.1:{port}"
    log_path = workdir / f"mlflow-server-{port}.log"
    env = dict(os.environ)
    # The server's background job runner (huey consumers) is not needed for tracking and
    # costs ~8 processes; keep the test server light.
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    env.pop("MLFLOW_TRACKING_URI", None)
    command = _mlflow_executable() + [
        "server",
        "--backend-store-uri",
        f"sqlite:///{workdir / 'mlflow.db'}",
        "--artifacts-destination",
        str(workdir / "artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return process, uri, log_path


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> str:
    """URI (http://127.0.0.1:PORT) of a real `mlflow server` running for the session."""
    if shutil.which("mlflow") is None and importlib.util.find_spec("mlflow") is None:
        pytest.skip("mlflow is not installed: the mlflow_server fixture needs it")
    workdir = tmp_path_factory.mktemp("mlflow_server")
    last_error = ""
    for _attempt in range(3):  # the free port can be taken between probe and bind
        process, uri, log_path = _start_server(workdir)
        deadline = time.monotonic() + _SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                break
            if _healthy(uri):
                break
            time.sleep(0.5)
        if process.poll() is None and _healthy(uri):
            try:
                yield uri
            finally:
                _stop(process)
            return
        _stop(process)
        last_error = log_path.read_text(errors="replace")[-4000:]
    raise RuntimeError(
        f"mlflow server did not become healthy within {_SERVER_START_TIMEOUT_S:.0f} s "
        f"(3 attempts). Last server log:\n{last_error}"
    )


@pytest.fixture(scope="module")
def local_ray(request):
    """One local Ray instance (2 CPUs) for the requesting test module; the runner reuses it.

    The module is registered for pickling by value: the fit functions it defines travel to
    the workers, which cannot import a test module by name."""
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[request.module.__name__])
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 1024**2
    )
    yield ray
    ray.shutdown()
