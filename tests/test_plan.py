"""`studies plan` (studies.running.plan) and the report's "Power and cost" section.

Fast: the plan's pieces (ASHA's expected budget against a simulation of successive halving,
the slots, the schedule) and the CLI on a catalogue file and on bad flags. Slow: a real
smoke run of the quickstart (Ray, SQLite MLflow) is the pilot of `studies plan --pilot` and
the store of a report whose GPU-hours are checked against the runs' durations.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis.power import seeds_for_power
from studies.running.plan import asha_expected_epochs, schedule_length, trial_slots
from studies.studyfile.spec import load_study

REPO = Path(__file__).resolve().parents[1]
CATALOG = REPO / "studies" / "catalog"


def studies_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "studies.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("epochs,grace,eta", [(18, 2, 2), (27, 1, 3), (100, 5, 3)])
def test_asha_expected_epochs_equal_synchronous_successive_halving(epochs, grace, eta):
    """eta^m configs with random quality, halved at every rung by their rank: the mean
    epochs per config equal the formula."""
    rng = np.random.default_rng(0)
    rung_list = [r for r in (grace * eta ** i for i in range(20)) if r < epochs]
    alive = rng.normal(size=eta ** len(rung_list))
    total, done = 0.0, 0
    n = alive.size
    for rung in rung_list + [epochs]:
        total += alive.size * (rung - done)
        done = rung
        alive = np.sort(alive)[::-1][:max(1, alive.size // eta)]
    assert asha_expected_epochs(epochs, grace, eta) == pytest.approx(total / n)


def test_slots_and_schedule():
    study = load_study(CATALOG / "topk_cifar100_label_noise.yaml")  # 4 CPUs, 0.25 GPU each
    assert study.resources.gpus == 0.25
    assert trial_slots(study, 8)[0] == 32
    quick = load_study(CATALOG / "quickstart.yaml")  # 1 CPU, no GPU
    assert trial_slots(quick, None, cpus=6)[0] == 6
    assert schedule_length([3, 1, 1, 2], 2) == 4  # 3 | 1+1, then 2 on the second slot (free at 2)


def test_plan_of_a_catalogue_file_prints_both_tables_in_80_columns():
    result = studies_cli("plan", str(CATALOG / "topk_cifar100_label_noise.yaml"), "--gpus", "8",
                         "--no-probe", "--difference", "0.5")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Compute" in out and "Seeds needed" in out and "trial slots: 32" in out
    assert all(len(line) <= 80 for line in out.splitlines())
    # the published intervals (4 seeds, 95 % t) of ce and smooth_hinge at label noise 0.0,
    # combined as independent: top-5 94.2 +- 0.1 and 93.3 +- 0.0
    sd = math.hypot(*(w * 2 / 3.182446305284263 for w in (0.1, 0.0)))
    row = next(line for line in out.splitlines()
               if line.startswith("smooth_hinge label_noise=0.0") and "test/top5" in line)
    assert row.split()[-2] == str(seeds_for_power(0.5, sd))


@pytest.mark.parametrize("flags,named", [
    (["--power", "1.5"], "--power"), (["--gpus", "0"], "--gpus"),
    (["--difference", "-1"], "--difference"), (["--pilot", "no_such_study"], "--pilot"),
    (["--difference", "half"], "--difference"),
])
def test_bad_flags_exit_2_with_a_clear_error(flags, named, tmp_path):
    result = studies_cli("plan", str(CATALOG / "quickstart.yaml"), "--no-probe",
                         "--output", str(tmp_path), *flags)
    assert result.returncode == 2
    assert named in result.stderr and "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def smoke_pilot(tmp_path_factory):
    """A real smoke run of the quickstart (3 seeds, 5 configs, 1 epoch): the pilot."""
    out = tmp_path_factory.mktemp("plan")
    result = studies_cli("run", str(CATALOG / "quickstart.yaml"), "--smoke", "--output",
                         str(out), "--num-cpus", "2", timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    return out, result.stdout


@pytest.mark.slow
def test_run_prints_the_estimate_first(smoke_pilot):
    _, stdout = smoke_pilot
    lines = stdout.splitlines()
    # after the checks of the study folder and before Ray starts (lines without a TTY are
    # headed by the time)
    estimate = next(i for i, line in enumerate(lines) if "[studies] estimate:" in line)
    assert "[studies] estimate: 15 cells, 15 epochs" in lines[estimate], stdout
    assert all("checking the study folder" in line for line in lines[:estimate]), stdout


@pytest.mark.slow
def test_plan_with_a_pilot_uses_its_paired_differences(smoke_pilot):
    out, _ = smoke_pilot
    from analysis.collect import collect

    from studies.running.plan import make_plan

    uri = f"sqlite:///{out}/quickstart-smoke/mlflow.db"
    # in this process (the CLI's exit codes are checked above): its imports are paid once
    text = make_plan(str(CATALOG / "quickstart.yaml"), pilot="quickstart-smoke", pilot_uri=uri,
                     difference=1.0)
    assert "source: pilot" in text and "pilot: study 'quickstart-smoke'" in text
    # the smooth top-k SVM against CE on test/top5, recomputed from the runs
    rows = collect(uri, "quickstart-smoke").table.to_pylist()
    value = {(r["variant"], r["seed"]): r["test/top5"] for r in rows if r["variant"] != "noised_topk"}
    diffs = [100 * (value["smooth_topk_svm", s] - value["ce", s]) for s in (0, 1, 2)]
    sd = float(np.std(diffs, ddof=1))
    line = next(line for line in text.splitlines()
                if line.startswith("smooth_topk_svm ") and "test/top5" in line)
    expected = seeds_for_power(1.0, sd) if sd > 0 else 2
    assert line.split()[-2] == (str(expected) if expected else "?")
    # seconds per epoch from the pilot's epoch_time_s
    assert re.search(r"^ce\s+1\s+3\s+15\.0\s+[\d.]+\s+[\d.]+\s+pilot", text, re.M)


@pytest.mark.slow
def test_report_gpu_hours_equal_durations_times_requested_gpus(smoke_pilot, tmp_path):
    out, _ = smoke_pilot
    from analysis.collect import collect
    from analysis.report import build_report

    uri = f"sqlite:///{out}/quickstart-smoke/mlflow.db"
    # the same study, read as if each trial had asked for half a GPU and 3 CPUs
    text = (CATALOG / "quickstart.yaml").read_text().replace(
        "resources: {cpus: 1, gpus: 0}", "resources: {cpus: 3, gpus: 0.5}")
    study_file = tmp_path / "quickstart.yaml"
    study_file.write_text(text)
    build_report(uri, "quickstart-smoke", tmp_path / "report", study_file=study_file)
    md = (tmp_path / "report" / "report.md").read_text()
    section = md.split("Power and cost", 1)[1]
    rows = collect(uri, "quickstart-smoke").table.to_pylist()
    hours = sum(r["duration_s"] for r in rows) / 3600

    def cells(label):
        line = next(line for line in section.splitlines() if line.startswith(f"| {label} |"))
        return [c.strip() for c in line.strip("|").split("|")]

    total = cells("total")
    assert total[1] == str(len(rows))
    assert float(total[3]) == pytest.approx(hours * 0.5, abs=1e-4)
    assert float(total[4]) == pytest.approx(hours * 3, abs=1e-4)
    ce = sum(r["duration_s"] for r in rows if r["variant"] == "ce") / 3600
    assert float(cells("ce")[3]) == pytest.approx(ce * 0.5, abs=1e-4)
    assert "Seeds to confirm each comparison" in section


def test_racing_expected_seeds_from_a_pilot():
    """Configs far apart are decided after few seeds (a little over the initial 3: a config
    that finishes first is compared with the best *so far*, as the runner's race does);
    identical configs (noise only) mostly race to max (10)."""
    from studies.running.plan import racing_expected_cells

    study = load_study(CATALOG / "racing_quickstart.yaml")
    metric = study.racing.until.metric or study.objective.metric
    rng = np.random.default_rng(1)
    found = {}
    for gap in (50.0, 0.0):
        rows = [{"config_id": f"c{c}", "seed": s,
                 metric: 0.5 + gap * c / 100 + rng.normal(0, 0.01)}
                for c in range(5) for s in range(3)]
        found[gap], note = racing_expected_cells(study, rows, races=40)
        assert "racing, simulated" in note
    assert 3.0 <= found[50.0] < 4.5 and found[0.0] > 7.5
