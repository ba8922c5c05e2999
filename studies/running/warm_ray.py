"""A local Ray kept warm between `studies` commands, only when asked (issue 42).

``studies run FILE --keep-warm [MINUTES]`` (or ``STUDIES_KEEP_WARM=MINUTES``) leaves the local
Ray it used running after the study, for MINUTES (default 5) after the last study that used
it; a later ``studies run``/``resume`` in the same environment joins it instead of starting
one (seconds instead of a Ray start and a shutdown), and ``studies stop --local`` ends it.

How it is kept, and why nothing outlives its stated time:

- a small supervisor process (``python -m studies.running.warm_ray serve``, in a session of
  its own so that the terminal's Ctrl-C does not reach it) starts Ray with ``ray.init`` and
  holds it: Ray's processes die with it. It writes a state file (`studies.local_state`, default
  ``~/.cache/setvalued-studies/warm-ray/``: its process id, Ray's address, the environment
  it serves, its idle time) and removes it when it ends;
- a driver that uses it leaves a lease file (its process id and start time) for as long as
  it runs; the supervisor counts a lease as long as that process lives, and shuts Ray down
  and exits ``idle`` seconds after the last lease ended (or after its start, if none came);
- the workers of a Ray started by another process run with that process's environment and
  working directory, so a driver joins only a warm Ray of the same environment: the Python
  executable, the working directory, the location of this package, the environment
  variables that reach a trial (``KEY_PREFIXES``) and the local Ray's size; any other
  starts its own, as without `--keep-warm`.

Tests keep their own state folder (``STUDIES_STATE_DIR``, tests/conftest.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

#: minutes a local Ray stays warm when `--keep-warm` is not given (unset: not kept)
KEEP_WARM_ENV = "STUDIES_KEEP_WARM"
#: `--keep-warm` without a value
DEFAULT_MINUTES = 5.0
#: the environment variables that reach a trial's worker and so decide which warm Ray a
#: driver may join (by prefix; `KEEP_WARM_ENV` itself excluded)
KEY_PREFIXES = (
    "PYTHON",
    "VIRTUAL_ENV",
    "CONDA",
    "PATH",
    "LD_",
    "HOME",
    "XDG_CACHE_HOME",
    "CUDA",
    "NVIDIA",
    "HIP",
    "ROCR",
    "OMP_",
    "MKL_",
    "TORCH",
    "TIMM",
    "HF_",
    "MLFLOW_",
    "RAY_",
    "TUNE_",
    "STUDIES_",
    "AWS_",
    "GOOGLE_",
    "AZURE_",
)
#: the system config of a local Ray (this module's and `studies.running.ray_session`'s): Ray
#: prestarts a worker process per CPU for the first driver, each importing Ray at once with the
#: driver's own start; Tune's trials never use them (each trial actor gets a new worker,
#: checked with Ray 2.60), so they only cost CPU and memory
LOCAL_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}
#: how often the supervisor looks at its leases
POLL_S = 1.0
#: how long a driver waits for a supervisor it launched to have Ray up
LAUNCH_TIMEOUT_S = 300.0


def state_dir() -> Path:
    """Where the warm Rays' state and lease files are (`studies.local_state`)."""
    from studies.local_state import state_root

    return state_root() / "warm-ray"


def keep_warm_minutes(asked: float | None) -> float | None:
    """The minutes to keep the local Ray warm: `asked` (`--keep-warm`), else
    ``STUDIES_KEEP_WARM``, else None (not kept); ValueError naming the value otherwise."""
    if asked is None:
        text = os.environ.get(KEEP_WARM_ENV, "").strip()
        if not text:
            return None
        try:
            asked = float(text)
        except ValueError:
            raise ValueError(f"{KEEP_WARM_ENV}={text!r}: expected minutes, a number > 0") from None
    if not asked > 0:
        raise ValueError(f"--keep-warm {asked:g}: expected minutes, a number > 0")
    return float(asked)


def environment_key(num_cpus: int | None, num_gpus: int | None, object_store_mb: int | None) -> str:
    """What a warm Ray's workers inherit from the process that started it, as a digest (the
    module docstring): a driver joins only a warm Ray of its own key."""
    import studies

    environment = {k: v for k, v in os.environ.items() if k.startswith(KEY_PREFIXES) and k != KEEP_WARM_ENV}
    what = {
        "python": sys.executable,
        "cwd": os.getcwd(),
        "package": str(Path(studies.__file__).resolve().parent),
        "environment": sorted(environment.items()),
        "ray": [num_cpus or os.cpu_count() or 1, num_gpus, object_store_mb],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` (Linux: /proc), None when it does not run (a zombie,
    ended but not reaped by its parent, does not); it tells a process from a later one given
    the same id."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return None
        return "?"


def _alive(pid: int, start: str | None) -> bool:
    found = _process_start(pid)
    return found is not None and (start is None or found == start or "?" in (found, start))


def _write_json(path: Path, data: dict) -> None:
    """`data` as `path`, replaced at once (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(data))
    os.replace(partial, path)


@dataclass
class WarmRay:
    """A running supervisor's state (its state file)."""

    path: Path
    pid: int
    pid_start: str | None
    address: str
    key: str
    idle_s: float
    auth_mode: str | None

    @property
    def leases(self) -> Path:
        return self.path.with_suffix(".drivers")

    def alive(self) -> bool:
        return _alive(self.pid, self.pid_start)

    def join(self, idle_s: float | None = None) -> DriverLease | None:
        """Lease it for this process (until `DriverLease.release`); None when its supervisor
        is stopping (its state file is gone once the lease is written). `idle_s`: the idle
        time asked by this run's `--keep-warm` (the supervisor keeps the longest asked)."""
        lease = self.leases / str(os.getpid())
        _write_json(lease, {"pid": os.getpid(), "start": _process_start(os.getpid()), "idle_s": idle_s})
        again = _read(self.path)
        if again is None or again.pid != self.pid:
            lease.unlink(missing_ok=True)
            return None
        if self.auth_mode:  # how Ray reads it: from the environment, when Ray is imported
            os.environ.setdefault("RAY_AUTH_MODE", self.auth_mode)
            if "ray" in sys.modules:  # Ray 2.60 caches its config at import: read it again
                from ray._raylet import Config  # type: ignore[attr-defined]  # Ray's compiled module

                Config.initialize("")
        return DriverLease(lease, self)

    def describe(self) -> str:
        return f"the warm local Ray (pid {self.pid}, {self.address})"


@dataclass
class DriverLease:
    path: Path
    warm: WarmRay

    def release(self) -> None:
        self.path.unlink(missing_ok=True)

    def until(self) -> float:
        """When the warm Ray stops if no other driver comes (seconds since the epoch)."""
        asked = self.warm.idle_s
        try:
            asked = max(asked, float(json.loads(self.path.read_text()).get("idle_s") or 0))
        except (OSError, ValueError):
            pass
        return time.time() + asked


def _read(path: Path) -> WarmRay | None:
    try:
        data = json.loads(path.read_text())
        return WarmRay(
            path=path,
            pid=int(data["pid"]),
            pid_start=data.get("pid_start"),
            address=str(data.get("address") or ""),
            key=str(data["key"]),
            idle_s=float(data["idle_s"]),
            auth_mode=data.get("auth_mode"),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def running() -> list[WarmRay]:
    """The warm Rays of this state folder whose supervisor runs (state files of ended ones
    are removed)."""
    found = []
    for path in sorted(state_dir().glob("*.json")):
        warm = _read(path)
        if warm is None:
            continue
        if warm.alive():
            found.append(warm)
        else:  # its supervisor was killed: what it left is removed
            path.unlink(missing_ok=True)
            _remove_leases(warm.leases)
    return found


def find(key: str) -> WarmRay | None:
    """The warm Ray of `key` whose Ray is up, if any."""
    return next((w for w in running() if w.key == key and w.address), None)


def launch(key: str, idle_s: float, num_cpus: int | None, num_gpus: int | None, object_store_mb: int | None) -> WarmRay:
    """Start a supervisor for `key` and wait until its Ray is up (RuntimeError with its log
    when it does not come up)."""
    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.json"
    log = folder / f"{key}.log"
    import studies

    environment = dict(os.environ)
    package_root = str(Path(studies.__file__).resolve().parents[1])  # this checkout, on the workers too
    environment["PYTHONPATH"] = os.pathsep.join(
        [package_root] + [p for p in environment.get("PYTHONPATH", "").split(os.pathsep) if p and p != package_root]
    )
    command = [sys.executable, "-m", "studies.running.warm_ray", "serve", "--state", str(path), "--idle-s", str(idle_s)]
    for flag, value in (("--num-cpus", num_cpus), ("--num-gpus", num_gpus), ("--object-store-mb", object_store_mb)):
        if value is not None:
            command += [flag, str(value)]
    with open(log, "w") as output:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=True,  # not ended by the terminal's Ctrl-C
        )
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while time.monotonic() < deadline:
        warm = _read(path)
        if warm is not None and warm.pid == process.pid and warm.address:
            return warm
        if process.poll() is not None:
            break
        time.sleep(0.1)
    if process.poll() is None:
        _terminate(process.pid, None)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise RuntimeError(f"the warm local Ray did not start (its log {log}): {tail.strip()}")


def _terminate(pid: int, start: str | None, patience_s: float = 60.0) -> bool:
    """SIGTERM, then SIGKILL once `patience_s` are over; whether it ended."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        if not _alive(pid, start):
            return True
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return not _alive(pid, start)


def stop_all() -> list[str]:
    """End every warm Ray of this state folder (`studies stop --local`); a line per one."""
    lines = []
    for warm in running():
        ended = _terminate(warm.pid, warm.pid_start)
        if ended:  # the supervisor removes its files; a killed one's are removed here
            warm.path.unlink(missing_ok=True)
            _remove_leases(warm.leases)
        lines.append(f"{warm.describe()}: {'stopped' if ended else 'could not be stopped'}")
    return lines


def _remove_leases(folder: Path) -> None:
    for lease in folder.glob("*") if folder.is_dir() else ():
        lease.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass


# ----------------------------------------------------------------------------- the supervisor


def _busy(leases: Path) -> tuple[bool, float]:
    """(whether a driver holds a lease, the longest idle time the leases ask); leases of ended
    drivers are removed."""
    busy, asked = False, 0.0
    for lease in leases.glob("*") if leases.is_dir() else ():
        try:
            data = json.loads(lease.read_text())
        except (OSError, ValueError):
            continue  # being written
        if _alive(int(data.get("pid", -1)), data.get("start")):
            busy = True
            asked = max(asked, float(data.get("idle_s") or 0.0))
        else:
            lease.unlink(missing_ok=True)
    return busy, asked


def serve(argv: list[str] | None = None) -> int:
    """The supervisor: start Ray, write the state file, hold Ray until it has been idle for
    its idle time or SIGTERM comes, then shut Ray down and remove its files."""
    parser = argparse.ArgumentParser(prog="python -m studies.running.warm_ray serve")
    parser.add_argument("--state", required=True)
    parser.add_argument("--idle-s", type=float, required=True)
    parser.add_argument("--num-cpus", type=int, default=None)
    parser.add_argument("--num-gpus", type=int, default=None)
    parser.add_argument("--object-store-mb", type=int, default=None)
    args = parser.parse_args(argv)
    path = Path(args.state)
    leases = path.with_suffix(".drivers")
    stop = {"asked": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("asked", True))
    signal.signal(signal.SIGINT, lambda *_: stop.__setitem__("asked", True))
    import ray

    key = path.stem
    ray.init(
        address="local",
        num_cpus=args.num_cpus or os.cpu_count() or 1,
        num_gpus=args.num_gpus,
        object_store_memory=args.object_store_mb * 1024**2 if args.object_store_mb else None,
        include_dashboard=False,
        log_to_driver=False,
        _system_config=LOCAL_SYSTEM_CONFIG,
    )
    state = {
        "pid": os.getpid(),
        "pid_start": _process_start(os.getpid()),
        "address": ray.get_runtime_context().gcs_address,
        "key": key,
        "idle_s": float(args.idle_s),
        "auth_mode": os.environ.get("RAY_AUTH_MODE"),
        "cwd": os.getcwd(),
        "started": time.time(),
    }
    try:
        _write_json(path, state)
        print(f"warm local Ray up at {state['address']}; idle time {state['idle_s']:g} s", flush=True)
        last_busy = time.monotonic()
        while not stop["asked"]:
            busy, asked = _busy(leases)
            state["idle_s"] = max(state["idle_s"], asked)
            if busy:
                last_busy = time.monotonic()
            elif time.monotonic() - last_busy >= state["idle_s"]:
                # the state file goes first; a driver that leased it meanwhile keeps it up (a
                # driver checks the state file after writing its lease: `WarmRay.join`)
                path.unlink(missing_ok=True)
                if not _busy(leases)[0]:
                    print(f"idle for {state['idle_s']:g} s: stopping", flush=True)
                    break
                _write_json(path, state)
            time.sleep(POLL_S)
    finally:
        path.unlink(missing_ok=True)  # no driver joins from now on
        ray.shutdown()
        _remove_leases(leases)
        path.with_suffix(".log").unlink(missing_ok=True)  # kept only when it did not end this way
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"]:
        sys.exit("usage: python -m studies.running.warm_ray serve --state FILE --idle-s SECONDS")
    sys.exit(serve(sys.argv[2:]))
