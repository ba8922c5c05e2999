"""The local Ray of a run (`studies.running.ray_session`, issue 42): a new study begins it in a
background thread while its tracking store is set up, and shuts it down, the driver waiting,
before the summary and the report. Its own module: no other module's Ray may be up here."""

from __future__ import annotations

import io

import pytest

from studies.running.run_options import RunOptions
from tests.test_runner import write_study


@pytest.mark.slow
def test_a_new_studys_ray_starts_with_its_checks_and_is_down_before_the_summary(tmp_path, monkeypatch):
    """Issue 42: a new study begins its local Ray in a background thread while its tracking
    store is set up, and shuts it down, the driver waiting, before the summary and the report:
    nothing of the driver runs while Ray shuts down (a report drawn meanwhile ended a quickstart
    with exit code 1: Ray ends the driver when another thread drops a reference then)."""
    import threading

    import ray

    import studies.running.runner as runner
    from studies.running.runner import run_study

    assert not ray.is_initialized()
    seen = {}
    begin = runner.RaySession.begin

    def watched_begin(self):
        seen["begun_in"] = threading.current_thread().name
        begin(self)
        seen["tracking_made_while_starting"] = self._holder is not None

    def watched_report(*args, **kwargs):
        seen["ray_up_at_the_report"] = ray.is_initialized()
        seen["ray_threads_at_the_report"] = [t.name for t in threading.enumerate() if t.name.startswith("studies-ray")]
        return None

    monkeypatch.setattr(runner.RaySession, "begin", watched_begin)
    monkeypatch.setattr(runner, "_build_report", watched_report)
    path = write_study(tmp_path, "ray-overlap", lrs=[0.1], seeds=(0,), epochs=1)
    outcome = run_study(path, RunOptions(output=tmp_path / "out", num_cpus=2, stream=io.StringIO()))
    assert outcome.exit_code == 0 and outcome.finished == 1
    assert seen == {
        "begun_in": "MainThread",
        "tracking_made_while_starting": True,
        "ray_up_at_the_report": False,
        "ray_threads_at_the_report": [],  # the shutdown is over, not under way in another thread
    }
    assert not ray.is_initialized()
