"""A local Ray kept warm between commands (`studies run --keep-warm`, issue 42): the next study
of the same environment joins it, `studies stop --local` ends it, it ends by itself after its
idle time, and nothing of it is left behind. Real processes: the command line in subprocesses,
a real supervisor and Ray (the suite's own state folder, tests/conftest.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml
from test_cli import run_cli
from test_runner import tiny_base

from studies.running import warm_ray


def write_study(folder: Path, name: str) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {"name": name, "base": tiny_base(1), "variants": {"ce": {}}, "seeds": [0], "resources": {"cpus": 1}}
        )
    )
    return path


def descendants(pid: int) -> set[int]:
    """The processes under `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def running_now(pid: int) -> bool:
    """Whether `pid` runs (a zombie that this process has not reaped yet does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def gone(pids: set[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(running_now(pid) for pid in pids):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_the_next_study_joins_the_warm_ray_and_stop_local_ends_it(tmp_path):
    first = run_cli("run", str(write_study(tmp_path, "warm-a")), "--output", str(tmp_path / "out"), "--keep-warm", "5")
    assert first.returncode == 0, first.stdout + first.stderr
    [warm] = warm_ray.running()
    assert f"the warm local Ray (pid {warm.pid}" in first.stdout and "`studies stop --local` ends it" in first.stdout
    processes = {warm.pid} | descendants(warm.pid)
    assert len(processes) > 3  # the supervisor and its Ray (GCS, raylet, ...)

    second = run_cli("run", str(write_study(tmp_path, "warm-b")), "--output", str(tmp_path / "out"))
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"joined the warm local Ray (pid {warm.pid}" in second.stdout
    assert "1/1 cells finished" in second.stdout
    assert [w.pid for w in warm_ray.running()] == [warm.pid]  # still warm: its idle time runs
    assert not list(warm.leases.glob("*"))  # the second driver's lease is released

    stopped = run_cli("stop", "--local")
    assert stopped.returncode == 0 and f"(pid {warm.pid}, {warm.address}): stopped" in stopped.stdout
    assert gone(processes, 60), "the warm Ray's processes outlived `studies stop --local`"
    assert warm_ray.running() == [] and not list(warm_ray.state_dir().glob("*.json"))
    again = run_cli("stop", "--local")
    assert again.returncode == 0 and "no warm local Ray" in again.stdout


@pytest.mark.slow
def test_a_warm_ray_ends_by_itself_after_its_idle_time(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    key = warm_ray.environment_key(1, 0, None)
    warm = warm_ray.launch(key, 2.0, 1, 0, None)
    processes = {warm.pid} | descendants(warm.pid)
    lease = warm.join(None)
    assert lease is not None
    time.sleep(4)  # a driver holds it: it stays past its idle time
    assert warm.alive()
    lease.release()
    assert gone(processes, 60), "the warm Ray outlived its idle time"
    assert not warm.path.exists() and not warm.leases.exists() and not warm.path.with_suffix(".log").exists()


def test_only_a_run_of_the_same_environment_joins(tmp_path, monkeypatch):
    """The key follows what the workers inherit: working directory, the variables that reach a
    trial, the Ray's size; not `STUDIES_KEEP_WARM` nor unrelated variables."""
    monkeypatch.chdir(tmp_path)
    key = warm_ray.environment_key(2, None, None)
    monkeypatch.setenv("STUDIES_KEEP_WARM", "3")
    monkeypatch.setenv("UNRELATED_TERMINAL_THING", "x")
    assert warm_ray.environment_key(2, None, None) == key
    assert warm_ray.environment_key(1, None, None) != key
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "another")
    assert warm_ray.environment_key(2, None, None) != key
    monkeypatch.delenv("MLFLOW_TRACKING_TOKEN")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert warm_ray.environment_key(2, None, None) != key


def test_the_state_of_a_killed_supervisor_is_removed_not_joined(tmp_path):
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    state = warm_ray.state_dir()
    state.mkdir(parents=True, exist_ok=True)
    (state / "deadbeef.json").write_text(
        json.dumps({"pid": dead, "address": "127.0.0.1:1", "key": "deadbeef", "idle_s": 60})
    )
    (state / "deadbeef.drivers").mkdir()
    (state / "deadbeef.drivers" / "1").write_text("{}")
    assert warm_ray.find("deadbeef") is None
    assert not (state / "deadbeef.json").exists() and not (state / "deadbeef.drivers").exists()


def test_a_keep_warm_time_that_is_not_minutes_is_refused(tmp_path, monkeypatch, capsys):
    from studies.cli import main
    from studies.errors import RunnerError
    from studies.running.ray_session import RaySession
    from studies.running.run_options import RunOptions

    with pytest.raises(SystemExit):
        main(["run", str(write_study(tmp_path, "w")), "--keep-warm", "0"])
    assert "--keep-warm: expected minutes, a number > 0, got '0'" in capsys.readouterr().err
    monkeypatch.setenv("STUDIES_KEEP_WARM", "soon")
    with pytest.raises(RunnerError, match=r"STUDIES_KEEP_WARM='soon': expected minutes"):
        RaySession.of(RunOptions())
    assert RaySession.of(RunOptions(address="ray://elsewhere:10001")).keep_warm_minutes is None
    monkeypatch.setenv("STUDIES_KEEP_WARM", "2")
    assert RaySession.of(RunOptions()).keep_warm_minutes == 2.0
    assert RaySession.of(RunOptions(keep_warm=7)).keep_warm_minutes == 7.0
