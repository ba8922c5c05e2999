"""A tracking server that goes away and comes back: the writes wait for it (one warning),
and nothing is lost. A real MLflow server process, stopped and restarted on the same port."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import _healthy, _start_server, _stop

pytestmark = pytest.mark.slow


def _wait_healthy(uri: str, process, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not _healthy(uri):
        assert process.poll() is None and time.monotonic() < deadline, "the MLflow server did not start"
        time.sleep(0.5)


def test_writes_wait_for_a_restarted_server_with_one_warning(tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    import studies.tracking.retry as tracking

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # our backoff, not MLflow's silent one
    monkeypatch.setattr(tracking, "_outage_warned", False)
    process, uri, _ = _start_server(tmp_path)
    port = int(uri.rsplit(":", 1)[1])
    try:
        _wait_healthy(uri, process)
        client = MlflowClient(uri)
        experiment = client.create_experiment("outage")
        _stop(process)  # the server goes down
        results = {}

        def write():
            runs = [tracking.with_retry(lambda: client.create_run(experiment), outage_patience_s=300) for _ in range(2)]
            results["runs"] = [r.info.run_id for r in runs]

        writer = threading.Thread(target=write)
        writer.start()
        time.sleep(4)
        assert writer.is_alive(), "the write did not wait for the server"
        process, _, _ = _start_server(tmp_path, port)  # back, same store, same port
        _wait_healthy(uri, process)
        writer.join(timeout=300)
        assert not writer.is_alive()
        assert len(results["runs"]) == 2
        stored = {r.info.run_id for r in client.search_runs([experiment])}
        assert stored == set(results["runs"])  # nothing lost, nothing doubled
        err = capsys.readouterr().err
        assert err.count("the tracking server does not answer") == 1, err
    finally:
        _stop(process)


def test_an_error_that_is_not_an_outage_is_raised_at_once():
    import studies.tracking.retry as tracking

    calls = []

    def bad():
        calls.append(1)
        raise ValueError("INVALID_PARAMETER_VALUE: bad run id")

    with pytest.raises(ValueError):
        tracking.with_retry(bad)
    assert len(calls) == 1


def test_a_server_out_of_database_connections_is_waited_for(monkeypatch):
    """MLflow answers 400 with SQLAlchemy's pool error when concurrent writers use up its
    connection pool (docs/scale.md): a passing overload, waited for like an outage."""
    import studies.tracking.retry as tracking

    monkeypatch.setattr(tracking.time, "sleep", lambda s: None)
    calls = []

    def overloaded():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError(
                "API request failed with code 400: QueuePool limit of size 5 "
                "overflow 10 reached, connection timed out, timeout 30.00"
            )
        return "logged"

    assert tracking.with_retry(overloaded) == "logged" and len(calls) == 3
