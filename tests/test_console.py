"""What a person sees in the terminal: one line updated in place on a TTY, a few plain lines
without one, and no third-party log noise."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from studies.progress import ProgressReporter, StudyProgress

REPO = Path(__file__).resolve().parents[1]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _drive(stream) -> ProgressReporter:
    progress = StudyProgress(total=3, to_run=3, epochs={"a-s0": 2, "a-s1": 2, "b-s0": 2})
    reporter = ProgressReporter(progress, interval_s=3600.0, stream=stream, metric="val/top5", refresh_s=0.0,
                                labels={"a-s0": "noised ε=0.1", "a-s1": "noised ε=0.1", "b-s0": "ce"})
    trials = {c: SimpleNamespace(config={"cell_id": c}, last_result={}, error_file=None) for c in progress.epochs}
    for cell, trial in trials.items():
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
    assert any("cell b-s0 FAILED" in line for line in lines)  # a failure gets its own line
    assert lines[-2].endswith(reporter.status()) or "done 2/3" in lines[-2]
    # the best config is the seed mean of the latest values: ce 0.75 beats noised (0.8 + 0.6) / 2
    assert reporter.best() == ("ce", pytest.approx(0.75))


def test_without_a_terminal_a_few_plain_lines_and_no_escape_sequences():
    stream = io.StringIO()
    _drive(stream)
    text = stream.getvalue()
    assert "\x1b" not in text and "\r" not in text
    lines = text.strip().splitlines()
    assert len(lines) == 3, lines  # the first progress line, the failure, the final counts
    assert lines[-1].startswith("[studies] done 2/3") and "failed 1" in lines[-1]


@pytest.mark.slow
def test_the_quickstart_prints_under_20_lines_without_a_terminal(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "studies.cli", "run", "studies/catalog/quickstart.yaml",
                           "--smoke", "--output", str(tmp_path / "out"), "--num-cpus", "2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
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
    done = subprocess.run([sys.executable, "-m", "studies.cli", "run", str(study), "--ray-dashboard", "--no-report",
                           "--output", str(tmp_path / "out"), "--num-cpus", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[studies] Ray dashboard: http://127.0.0.1:" in done.stdout, done.stdout


def test_the_best_config_follows_each_seeds_latest_value():
    progress = StudyProgress(total=2, to_run=2, epochs={"a-s0": 3, "b-s0": 3})
    reporter = ProgressReporter(progress, stream=io.StringIO(), metric="val/top5", labels={"a-s0": "a", "b-s0": "b"})
    trial = {c: SimpleNamespace(config={"cell_id": c}, last_result={}, error_file=None) for c in ("a-s0", "b-s0")}
    reporter.on_trial_result(0, [], trial["a-s0"], {"epochs_done": 1, "val/top5": 0.9})
    reporter.on_trial_result(0, [], trial["b-s0"], {"epochs_done": 1, "val/top5": 0.5})
    assert reporter.best() == ("a", pytest.approx(0.9))
    reporter.on_trial_result(0, [], trial["a-s0"], {"epochs_done": 2, "val/top5": 0.1})  # a fell back
    assert reporter.best() == ("b", pytest.approx(0.5))
