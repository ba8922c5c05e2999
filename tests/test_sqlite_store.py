"""A new study's embedded MLflow store is a copy of an empty store made once per MLflow
version (studies.tracking.sqlite_store): MLflow opens it as its own, and nothing existing is replaced."""

from __future__ import annotations

import os

import mlflow
from mlflow import MlflowClient

from studies.tracking.sqlite_store import cache_folder, seed_sqlite_store


def test_a_new_store_is_a_working_copy_of_the_template_made_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first, second = tmp_path / "a" / "mlflow.db", tmp_path / "b" / "mlflow.db"
    first.parent.mkdir()
    second.parent.mkdir()
    assert seed_sqlite_store(f"sqlite:///{first}")
    template = cache_folder() / f"mlflow-{mlflow.__version__}-empty.db"
    made = template.stat().st_mtime_ns
    assert seed_sqlite_store(f"sqlite:///{second}")
    assert template.stat().st_mtime_ns == made  # made once, copied twice
    for path in (first, second):
        client = MlflowClient(f"sqlite:///{path}")  # MLflow checks the schema version here
        experiment = client.create_experiment("s", artifact_location=(tmp_path / "art").as_uri())
        run = client.create_run(experiment)
        client.log_metric(run.info.run_id, "x", 1.0)
        assert client.get_run(run.info.run_id).data.metrics == {"x": 1.0}
    assert [e.name for e in MlflowClient(f"sqlite:///{second}").search_experiments()] == [
        "s",
        "Default",
    ]  # the copies share nothing


def test_an_existing_store_or_another_uri_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    existing = tmp_path / "mlflow.db"
    existing.write_bytes(b"not to be replaced")
    assert not seed_sqlite_store(f"sqlite:///{existing}")
    assert existing.read_bytes() == b"not to be replaced"
    assert not seed_sqlite_store("http://127.0.0.1:5000")
    assert not seed_sqlite_store(f"sqlite:///{tmp_path / 'missing-folder' / 'mlflow.db'}")
    assert not (tmp_path / "cache").exists()  # nothing made for nothing


def test_an_unwritable_cache_leaves_the_store_to_mlflow(tmp_path, monkeypatch):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    target = tmp_path / "mlflow.db"
    assert not seed_sqlite_store(f"sqlite:///{target}")
    assert not target.exists() and not any(p.name.startswith(".mlflow-") for p in tmp_path.iterdir())
    MlflowClient(f"sqlite:///{target}").search_experiments()  # MLflow makes it itself
    assert target.exists() and os.path.getsize(target) > 0
