"""What a person sees in the terminal: one line updated in place on a TTY, a few plain lines
without one, and no third-party log noise."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from studies.running.progress import ProgressReporter, StudyProgress

REPO = Path(__file__).resolve().parents[1]


def check_progress_counts(text: str) -> list[tuple[int, ...]]:
    """The progress lines of a run's output (without a terminal) as (done, total, running,
    failed, left): their counts add up to the total, done never falls back, and the last line
    agrees with the summary."""
    lines = [
        tuple(int(n) for n in m.groups())
        for m in re.finditer(
            r"\[studies\] done (\d+)/(\d+)(?: \(\d+ before this run\))? \| running (\d+) \| "
            r"failed (\d+) \| left (\d+)",
            text,
        )
    ]
    assert lines, text
    for done, total, running, failed, left in lines:
        assert done + running + failed + left == total, (lines, text)
    assert [line[0] for line in lines] == sorted(line[0] for line in lines), lines
    finished, cells = (int(n) for n in re.search(r"summary: (\d+)/(\d+) cells finished", text).groups())
    assert lines[-1][:2] == (finished, cells) and lines[-1][2] == 0, (lines[-1], text)
    return lines


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _drive(stream) -> ProgressReporter:
    progress = StudyProgress(total=3, to_run=3, epochs={"a-s0": 2, "a-s1": 2, "b-s0": 2})
    reporter = ProgressReporter(
        progress,
        interval_s=3600.0,
        stream=stream,
        metric="val/top5",
        refresh_s=0.0,
        labels={"a-s0": "noised ε=0.1", "a-s1": "noised ε=0.1", "b-s0": "ce"},
    )
    trials = {c: SimpleNamespace(config={"cell_id": c}, last_result={}, error_file=None) for c in progress.epochs}
    for _cell, trial in trials.items():
        reporter.on_trial_start(0, [], trial)
    reporter.on_trial_result(0, [], trials["a-s0"], {"epochs_done": 1, "val/top5": 0.8})
    reporter.on_trial_result(0, [], trials["a-s1"], {"epochs_done": 1, "val/top5": 0.6})
    reporter.on_trial_result(0, [], trials["b-s0"], {"epochs_done": 1, "val/top5": 0.75})
    reporter.on_trial_complete(0, [], trials["a-s0"])
    reporter.on_trial_error(0, [], trials["b-s0"])
    reporter.on_trial_complete(0, [], trials["a-s1"])
    reporter.on_experiment_end([])
    return reporter


def test_on_a_terminal_the_progress_is_one_line_rewritten_in_place():
    stream = _Terminal()
    reporter = _drive(stream)
    text = stream.getvalue()
    assert text.count("\r\x1b[K") >= 6  # every event rewrites the line
    lines = text.split("\n")
    assert any("cell ce s0 FAILED" in line for line in lines)  # a failure gets its own line, by name
    assert lines[-2].endswith(reporter.status()) or "done 2/3" in lines[-2]
    # the best config is the seed mean of the seeds' best values: ce 0.75 beats noised (0.8 + 0.6) / 2
    assert reporter.best() == ("ce", pytest.approx(0.75))
    assert reporter.status().endswith("best ce val/top5=75.0%")  # in percent, as the report (issue 42)


def test_without_a_terminal_a_few_plain_lines_and_no_escape_sequences():
    stream = io.StringIO()
    _drive(stream)
    text = stream.getvalue()
    assert "\x1b" not in text and "\r" not in text
    lines = text.strip().splitlines()
    assert len(lines) == 3, lines  # the first progress line, the failure, the final counts
    # each line starts with the time; a progress line carries the elapsed time
    assert all(re.match(r"^\d\d:\d\d:\d\d \[studies\] ", line) for line in lines), lines
    assert lines[-1][9:].startswith("[studies] done 2/3") and "failed 1" in lines[-1]
    assert re.search(r"\| elapsed \d+:\d\d:\d\d \|", lines[-1]), lines[-1]


@pytest.mark.slow
def test_the_quickstart_prints_under_20_lines_without_a_terminal(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "studies.cli",
            "run",
            "studies/catalog/quickstart.yaml",
            "--smoke",
            "--output",
            str(tmp_path / "out"),
            "--num-cpus",
            "2",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) < 20, lines
    text = "\n".join(lines)
    for noise in ("INFO", "Token authentication", "WARNING", "\x1b", "\r"):
        assert noise not in text, noise
    assert "[studies] summary: 15/15 cells finished" in text and "[studies] report:" in text


@pytest.mark.slow
def test_a_local_run_can_show_rays_dashboard_on_loopback(tmp_path):
    import yaml
    from test_runner import tiny_base

    study = tmp_path / "dash.yaml"
    study.write_text(yaml.safe_dump({"name": "dash", "base": tiny_base(1), "seeds": [0], "log_models": False}))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "studies.cli",
            "run",
            str(study),
            "--ray-dashboard",
            "--no-report",
            "--output",
            str(tmp_path / "out"),
            "--num-cpus",
            "1",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[studies] Ray dashboard: http://127.0.0.1:" in done.stdout, done.stdout


def test_the_best_config_so_far_never_goes_backwards():
    """A seed's value falling back (a worse epoch) does not lower the best: each seed counts its
    best epoch, as the checkpoint selection does; a config counts once all its seeds reported."""
    cells = ("a-s0", "a-s1", "b-s0", "b-s1")
    progress = StudyProgress(total=4, to_run=4, epochs={c: 3 for c in cells})
    reporter = ProgressReporter(progress, stream=io.StringIO(), metric="val/top5", labels={c: c[0] for c in cells})
    trial = {c: SimpleNamespace(config={"cell_id": c}, last_result={}, error_file=None) for c in cells}
    reporter.on_trial_result(0, [], trial["a-s0"], {"epochs_done": 1, "val/top5": 0.947})
    assert reporter.best() is None  # one seed of two: a mean would fall when the other comes
    reporter.on_trial_result(0, [], trial["a-s1"], {"epochs_done": 1, "val/top5": 0.749})
    assert reporter.best() == ("a", pytest.approx(0.848))
    seen = [reporter.best()[1]]
    for cell, value in (("b-s0", 0.5), ("a-s0", 0.1), ("b-s1", 0.8), ("a-s1", 0.2), ("b-s0", 0.99)):
        reporter.on_trial_result(0, [], trial[cell], {"epochs_done": 2, "val/top5": value})
        seen.append(reporter.best()[1])
    assert seen == sorted(seen) and reporter.best() == ("b", pytest.approx(0.895))
    low = ProgressReporter(
        StudyProgress(total=1, to_run=1, epochs={"c-s0": 3}),
        stream=io.StringIO(),
        metric="train/loss",
        mode="min",
        labels={"c-s0": "c"},
    )
    for value in (2.0, 1.0, 1.5):  # a min objective: never goes up
        low.on_trial_result(0, [], SimpleNamespace(config={"cell_id": "c-s0"}), {"val/top5": 0, "train/loss": value})
    assert low.best() == ("c", 1.0)


def test_a_long_step_shows_its_elapsed_seconds_in_place_on_a_terminal_and_timed_lines_without():
    import time as clock

    from studies.running.progress import activity

    plain = io.StringIO()
    with activity(plain, "reading the runs"):
        pass
    first, last = plain.getvalue().splitlines()
    assert re.match(r"^\d\d:\d\d:\d\d \[studies\] reading the runs \.\.\.$", first), first
    assert re.match(r"^\d\d:\d\d:\d\d \[studies\] reading the runs: done in 0:00:00$", last), last
    terminal = _Terminal()
    with activity(terminal, "reading the runs", every_s=0.05):
        clock.sleep(0.3)
    text = terminal.getvalue()
    assert text.count("\r\x1b[K[studies] reading the runs ... ") >= 2 and text.endswith("\r\x1b[K")
    assert "\n" not in text  # erased when done: the next line takes its place


def test_lines_on_a_terminal_fit_its_width(monkeypatch):
    from studies.running import progress

    monkeypatch.setattr(progress, "terminal_width", lambda stream: 40)
    stream = _Terminal()
    progress.say(stream, "study quickstart: 15 cells; tracking sqlite:////a/long/path/mlflow.db (experiment 1)")
    rows = stream.getvalue().splitlines()
    assert len(rows) > 1 and all(len(row) < 40 for row in rows), rows
    assert " ".join(row.strip() for row in rows).startswith("[studies] study quickstart: 15 cells;")
    reporter = _drive(_Terminal())
    assert len(reporter.status()) < 40 and reporter.status().endswith("…")
