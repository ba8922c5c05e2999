"""The runner's collaborators alone, without Ray: the cell queue, the search for an earlier
session's checkpoints, and the progress reporter fed by Tune-shaped hooks."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from studies.cells.cell_queue import CellQueue
from studies.running.checkpoints import META_FILE, STATE_FILE, ResumePoints, find_resume_checkpoints
from studies.running.progress import ProgressReporter, StudyProgress


def test_cell_queue_hands_out_in_order_and_resumes_from_its_saved_state():
    queue = CellQueue(["a-s0", "a-s1", "b-s0"])
    assert queue.next() == "a-s0"
    restored = CellQueue.from_json(queue.to_json())
    assert [restored.next(), restored.next(), restored.next()] == ["a-s1", "b-s0", None]


def write_checkpoint(
    storage: Path, experiment: str, cell_id: str, epoch: int, study: str = "s", run_id: str | None = "run"
) -> Path:
    folder = storage / experiment / cell_id / f"checkpoint_{epoch:06d}"
    folder.mkdir(parents=True)
    meta = {"cell_id": cell_id, "study": study, "epoch": epoch}
    if run_id is not None:
        meta["run_id"] = run_id
    (folder / META_FILE).write_text(json.dumps(meta))
    (folder / STATE_FILE).write_bytes(b"")  # a checkpoint is announced only with its state beside
    return folder


def test_resume_checkpoints_are_the_latest_of_the_study_for_the_wanted_cells(tmp_path):
    storage = tmp_path / "ray"
    write_checkpoint(storage, "tune-1-0", "a-s0", 1)
    latest = write_checkpoint(storage, "tune-2-0", "a-s0", 3)
    write_checkpoint(storage, "tune-2-0", "b-s0", 5, study="other")  # another study
    write_checkpoint(storage, "tune-2-0", "c-s0", 2, run_id=None)  # no run to continue
    write_checkpoint(storage, "tune-2-0", "d-s0", 2)  # not a wanted cell
    broken = storage / "tune-2-0" / "e-s0" / "checkpoint_000001"
    broken.mkdir(parents=True)
    (broken / META_FILE).write_text("{not json")
    wanted = ["a-s0", "b-s0", "c-s0", "e-s0"]
    found = find_resume_checkpoints(storage, "s", wanted)
    assert {cell: folder for cell, (folder, _) in found.items()} == {"a-s0": latest}
    assert find_resume_checkpoints(None, "s", wanted) == {}
    assert find_resume_checkpoints(tmp_path / "missing", "s", wanted) == {}

    points = ResumePoints.search(storage, "s", wanted)
    assert points.run_ids() == {"a-s0": "run"}
    assert points.folders() == {"a-s0": str(latest)}
    assert points.experiment_dirs() == [storage / "tune-2-0"]
    assert points.describe() == ("1 unfinished cells continue from the checkpoint an earlier run left (after 4 epochs)")
    assert points.only([]).describe() is None


def test_progress_reporter_follows_tune_hooks():
    progress = StudyProgress(total=2, to_run=2, epochs={"a": 2, "b": 2})
    stream, errors = io.StringIO(), []
    reporter = ProgressReporter(progress, interval_s=3600.0, stream=stream, on_error=errors.append)
    trial_a = SimpleNamespace(config={"cell_id": "a"}, last_result={}, error_file=None)
    trial_b = SimpleNamespace(config={"cell_id": "b"}, last_result={}, error_file=None)
    reporter.on_trial_start(0, [], trial_a)
    reporter.on_trial_start(0, [], trial_b)
    reporter.on_trial_result(0, [], trial_a, {"epochs_done": 1, "cell_status": "running"})
    assert progress.running == {"a": 1, "b": 0}
    reporter.on_trial_complete(0, [], trial_a)
    reporter.on_trial_error(0, [], trial_b)
    assert progress.finished == {"a"} and "b" in progress.failed and errors == ["b"]
    assert "cell b FAILED" in stream.getvalue()


def test_long_cell_lists_run_as_experiments_of_whole_configs():
    from studies.cells.arrays import experiment_parts

    cells = [
        SimpleNamespace(config_id=f"c{c}", seed=s) for c, seeds in enumerate([3, 3, 2, 5, 1]) for s in range(seeds)
    ]
    parts = [[c for trial in part for c in trial] for part in experiment_parts(cells, max_trials=6)]
    assert [[(c.config_id, c.seed) for c in part] for part in parts] == [
        [("c0", 0), ("c0", 1), ("c0", 2), ("c1", 0), ("c1", 1), ("c1", 2)],
        [("c2", 0), ("c2", 1)],
        [("c3", s) for s in range(5)] + [("c4", 0)],
    ]
    assert [c for part in parts for c in part] == cells  # nothing lost, order kept
    (alone,) = experiment_parts(cells[:3], max_trials=2)  # a config larger than the limit
    assert len(alone) == 3
    assert experiment_parts([], max_trials=5) == []


def test_a_rerun_progress_line_counts_the_cells_finished_before_it(tmp_path):
    """Issue 33: the progress line's best config is over every finished cell of the study,
    read from the ledger once at the start (an earlier invocation's `best_val`), not only over
    this invocation's cells."""
    from studies.cells.space import expand
    from studies.running.run_options import RunOptions
    from studies.running.session import StudySession
    from studies.studyfile.spec import parse_study
    from studies.tracking import StudyTracking

    study = parse_study(
        "name: best\nbase:\n  data: {name: synthetic}\n  model: {name: mlp}\n  loss: {name: ce}\n"
        "  epochs: 3\n  eval: {ks: [1, 5], selection: val/top5}\n"
        "variants: {ce: {}, noised: {loss: {name: noised_topk, k: 5, epsilon: 0.1}}}\n"
        "seeds: [0, 1]\n"
    )
    cells = expand(study)
    tracking = StudyTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", "best")
    finished = [c for c in cells if c.variant == "ce"]
    for cell, (best, last) in zip(finished, ((0.86, 0.80), (0.84, 0.83))):
        run = tracking.client.create_run(
            tracking.experiment_id,
            tags={
                "studies.role": "cell",
                "studies.study": "best",
                "studies.cell_id": cell.cell_id,
                "studies.config_id": cell.config_id,
                "studies.status": "finished",
            },
        ).info.run_id
        tracking.client.log_metric(run, "best_val", best)
        tracking.client.log_metric(run, "val/top5", last, step=2)
    session = StudySession(study, "best", tmp_path, tracking, RunOptions(), io.StringIO())
    session.know(cells)
    done, pending = session.plan(cells)
    assert sorted(done) == sorted(c.cell_id for c in finished) and len(pending) == 2
    callback = session.progress_callback(pending, total=len(cells), done_before=len(done))
    label, value = callback.best()
    assert label.startswith("ce") and value == pytest.approx(0.85)  # the mean of best_val
    for cell in pending:  # this invocation's cells do worse: the best stays the earlier one
        callback._record(cell.cell_id, 0.53)
    assert callback.best() == (label, pytest.approx(0.85))
    assert "best ce" in callback.status() and "val/top5=85.0%" in callback.status()  # percent, as the report
