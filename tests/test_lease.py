"""One driver per study: the lease in the tracking store, with real processes and a real
MLflow server (tests/conftest.py)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import uuid

import pytest

pytestmark = pytest.mark.slow


def _experiment(uri: str) -> str:
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri).create_experiment(f"lease-{uuid.uuid4().hex[:8]}")


def _lease_tags(client, experiment_id: str) -> set[str]:
    return {k for k in client.get_experiment(experiment_id).tags if k.startswith("studies.lease.")}


def _contend(uri: str, experiment_id: str, start_at: float, hold_s: float, results) -> None:
    """One driver: wait for the common start, try to take the lease, hold it a while."""
    from mlflow.tracking import MlflowClient

    from studies.running.lease import LeaseHeld, StudyLease

    lease = StudyLease(MlflowClient(uri), experiment_id, "race", heartbeat_s=0.5, stale_s=30)
    time.sleep(max(0.0, start_at - time.time()))
    try:
        lease.acquire()
    except LeaseHeld as held:
        results.put(("refused", os.getpid(), str(held)))
        return
    results.put(("holds", os.getpid(), lease.token))
    time.sleep(hold_s)
    lease.release()


def test_of_drivers_started_together_exactly_one_holds_the_lease(mlflow_server):
    experiment_id = _experiment(mlflow_server)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    start_at = time.time() + 8  # every process imported and connected by then
    procs = [
        ctx.Process(target=_contend, args=(mlflow_server, experiment_id, start_at, 6.0, results)) for _ in range(3)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    holders = [o for o in outcomes if o[0] == "holds"]
    refused = [o for o in outcomes if o[0] == "refused"]
    assert len(holders) == 1, outcomes
    assert len(refused) == 2 and all("is being run by another driver (host" in o[2] for o in refused)
    assert all(f"pid {holders[0][1]}" in o[2] for o in refused), outcomes


def _hold_forever(uri: str, experiment_id: str, ready) -> None:
    from mlflow.tracking import MlflowClient

    from studies.running.lease import StudyLease

    lease = StudyLease(MlflowClient(uri), experiment_id, "killed", heartbeat_s=0.5, stale_s=4)
    lease.acquire()
    ready.put(lease.token)
    time.sleep(600)


def test_a_killed_drivers_lease_is_taken_over_and_a_live_one_refuses(mlflow_server):
    from mlflow.tracking import MlflowClient

    from studies.running.lease import LeaseHeld, StudyLease

    experiment_id = _experiment(mlflow_server)
    client = MlflowClient(mlflow_server)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    holder = ctx.Process(target=_hold_forever, args=(mlflow_server, experiment_id, ready))
    holder.start()
    held = ready.get(timeout=120)
    second = StudyLease(client, experiment_id, "killed", heartbeat_s=0.5, stale_s=4)
    with pytest.raises(LeaseHeld, match=f"pid {holder.pid}"):
        second.acquire()
    os.kill(holder.pid, signal.SIGKILL)  # the driver dies holding the lease
    holder.join()
    # on this host a dead holder's lease is stale at once (its pid is gone)
    second.acquire()
    assert second.token != held
    assert _lease_tags(client, experiment_id) == {f"studies.lease.{second.token}"}  # the dead one is gone
    second.release()
    assert _lease_tags(client, experiment_id) == set()


def test_waiting_driver_starts_when_the_holder_releases(mlflow_server):
    from mlflow.tracking import MlflowClient

    from studies.running.lease import StudyLease

    experiment_id = _experiment(mlflow_server)
    client = MlflowClient(mlflow_server)
    first = StudyLease(client, experiment_id, "wait", heartbeat_s=0.5, stale_s=30)
    first.acquire()
    second = StudyLease(client, experiment_id, "wait", heartbeat_s=0.5, stale_s=30)
    releaser = __import__("threading").Timer(2.0, first.release)
    releaser.start()
    started = time.time()
    second.acquire(wait=True, timeout_s=60, poll_s=0.5)
    assert time.time() - started >= 1.5  # it did wait for the release
    second.release()


def test_a_lease_whose_heartbeat_stopped_is_stale_even_on_another_host(mlflow_server):
    """A lease written by a driver on another host (pid unknown here) goes stale by time."""
    import json

    from mlflow.tracking import MlflowClient

    from studies.running.lease import LeaseHeld, StudyLease

    experiment_id = _experiment(mlflow_server)
    client = MlflowClient(mlflow_server)
    now = [1000.0]
    other = StudyLease(client, experiment_id, "s", heartbeat_s=1000, stale_s=2000, clock=lambda: now[0])
    other.acquire()
    other._stop.set()  # its heartbeat stops, as a dead host's would
    key = f"studies.lease.{other.token}"
    value = json.loads(client.get_experiment(experiment_id).tags[key])
    client.set_experiment_tag(experiment_id, key, json.dumps({**value, "host": "elsewhere"}))  # no pid check
    me = StudyLease(client, experiment_id, "s", heartbeat_s=1000, stale_s=2000, clock=lambda: now[0])
    with pytest.raises(LeaseHeld, match="host elsewhere"):
        me.acquire()
    now[0] += 2001
    me.acquire()
    me.release()
