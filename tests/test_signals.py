"""A signal closes every run (issue 33): SIGTERM, SIGHUP and Ctrl-C stop the driver, and the
cell runs its trials left RUNNING and the parent run end KILLED in MLflow with the reason;
`studies resume` then continues them; the same for every member run of a fused array in
flight (issue 35, ``resources.seeds_per_trial``), and a fused race resumed mid-round ends with
the decisions and cells of the uninterrupted one. `studies stop` (`ray job stop`) gives a
submitted driver the time to do so.

The study runs as a real `python -m studies.cli` process on a local Ray, its MLflow store a
real SQLite file (one Ray run, shared with the resume).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["RAY_ADDRESS"] = ""  # a local Ray of its own
    return env


def _runs(db: Path, role: str) -> list[dict]:
    """The active runs of `role` in the store: run id, MLflow status, tags, epochs of val/top3."""
    if not db.exists():
        return []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as con:
        rows = con.execute(
            "SELECT r.run_uuid, r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
            "WHERE r.lifecycle_stage = 'active' AND t.key = 'studies.role' AND t.value = ?",
            (role,),
        ).fetchall()
        runs = []
        for run_id, status in rows:
            tags = dict(con.execute("SELECT key, value FROM tags WHERE run_uuid = ?", (run_id,)))
            epochs = con.execute(
                "SELECT COUNT(*) FROM metrics WHERE run_uuid = ? AND key = 'val/top3'", (run_id,)
            ).fetchone()[0]
            runs.append({"id": run_id, "status": status, "tags": tags, "epochs": epochs})
    return runs


def _run_and_stop(path: Path, output: Path, log: Path, which) -> str:
    """Run the study file `path` as a real `studies run` process, SIGTERM it once a cell run
    for which `which(run)` holds is mid-way (an epoch logged, and checkpointed, and still
    running), and return its output once it has exited with 143."""
    db = output / path.stem / "mlflow.db"
    with open(log, "w") as sink:
        driver = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "studies.cli",
                "run",
                str(path),
                "--output",
                str(output),
                "--num-cpus",
                "1",
                "--no-report",
            ],
            cwd=REPO,
            env=_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 240
            while not any(
                run["epochs"] >= 1 and run["tags"].get("studies.status") == "running" and which(run)
                for run in _runs(db, "cell")
            ):
                assert driver.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)
            os.kill(driver.pid, signal.SIGTERM)
            code = driver.wait(timeout=120)
        finally:
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
                driver.wait()
    text = log.read_text()
    assert code == 143, text[-3000:]
    return text


def _resume(name: str, output: Path) -> None:
    """`studies resume name`, as a real process, to its end (exit code 0)."""
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "studies.cli",
            "resume",
            name,
            "--output",
            str(output),
            "--num-cpus",
            "1",
            "--no-report",
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]


def _study(folder: Path, name: str, per_trial: int = 1) -> Path:
    """Two cells, one at a time, a few seconds each, a checkpoint every epoch; with
    ``per_trial: 2`` the two seeds of one config, trained as one fused array (issue 35)."""
    lrs, seeds = ("[0.02, 0.05]", "[0]") if per_trial == 1 else ("[0.05]", "[0, 1]")
    path = folder / f"{name}.yaml"
    path.write_text(
        textwrap.dedent(f"""\
        name: {name}
        base:
          data: {{name: synthetic, num_classes: 6, num_superclasses: 2, train_size: 2000,
                  val_size: 60, test_size: 60, form: features, feature_dim: 8}}
          model: {{name: mlp, hidden_dim: 32}}
          loss: {{name: ce}}
          optim: {{lr: 0.1, batch_size: 8, milestones: []}}
          epochs: 6
          eval: {{ks: [1, 3], selection: val/top3}}
          device: cpu
        design: {{kind: grid, parameters: {{optim.lr: {lrs}}}}}
        seeds: {seeds}
        resources: {{cpus: 1, seeds_per_trial: {per_trial}}}
        max_concurrent: 1
        checkpoint_interval_s: 0
        log_models: false
        """)
    )
    return path


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("per_trial", [1, 2], ids=["one-seed-a-trial", "fused-array"])
def test_sigterm_leaves_no_run_running_and_the_resume_finishes(tmp_path, per_trial):
    """Stopped mid-way, every cell run left RUNNING ends KILLED with the reason (every member
    of a fused array in flight: ``per_trial`` 2), and the resume continues each in its run."""
    name = f"sig-{os.getpid()}-{per_trial}"
    output = tmp_path / "out"
    db = output / name / "mlflow.db"
    # stopped while a cell is mid-way: it has logged (and checkpointed) an epoch
    text = _run_and_stop(_study(tmp_path, name, per_trial), output, tmp_path / "driver.log", lambda run: True)
    assert f"terminated by SIGTERM; `studies resume {name}`" in text
    cells, parents = _runs(db, "cell"), _runs(db, "parent")
    assert cells and parents
    assert [run for run in cells + parents if run["status"] == "RUNNING"] == []
    stopped = [run for run in cells if run["tags"].get("studies.status") != "finished"]
    assert stopped, "the cell that was mid-way"
    if per_trial == 2:  # the array in flight: both its members were mid-way
        assert len(stopped) == 2, stopped
    for run in stopped + parents:
        assert run["status"] == "KILLED"
        assert run["tags"]["studies.stop_reason"] == "terminated by SIGTERM"

    _resume(name, output)
    cells, parents = _runs(db, "cell"), _runs(db, "parent")
    assert len(cells) == 2 and all(run["status"] == "FINISHED" for run in cells + parents)
    assert all(run["tags"]["studies.status"] == "finished" and run["epochs"] == 6 for run in cells)
    # the mid-way cell continued in its own run, which no longer says it was stopped
    continued = [run for run in cells if run["id"] in {s["id"] for s in stopped}]
    assert continued and all("studies.stop_reason" not in run["tags"] for run in continued)
    assert len(continued) == len(stopped)
    assert "studies.stop_reason" not in parents[0]["tags"]


def _raced_study(folder: Path, name: str) -> Path:
    """A race of a clearly worse config (it learns next to nothing in 7 epochs) and two
    configs that train alike (they differ in the evaluation batch size alone: tied on every
    seed, both race to max) on seeds initial 3, step 2, max 5, two seeds a trial: a config's
    rounds as the arrays [0, 1] [2] and [3, 4]; 7 epochs of 300 steps leave a stop ~1 s to
    find a cell mid-way."""
    path = folder / f"{name}.yaml"
    path.write_text(
        textwrap.dedent(f"""\
        name: {name}
        base:
          data: {{name: synthetic, num_classes: 6, num_superclasses: 2, train_size: 2400,
                  val_size: 60, test_size: 60, form: features, feature_dim: 8}}
          model: {{name: mlp, hidden_dim: 32}}
          loss: {{name: ce}}
          optim: {{lr: 0.1, batch_size: 8, milestones: []}}
          epochs: 7
          eval: {{ks: [1, 3], selection: val/top1}}
          device: cpu
        design:
          - {{kind: grid, parameters: {{optim.lr: [0.0003]}}}}
          - {{kind: grid, parameters: {{eval.batch_size: [32, 64]}}}}
        seeds: {{initial: 3, max: 5, step: 2, until: {{metric: test/top1}}}}
        resources: {{cpus: 1, seeds_per_trial: 2}}
        max_concurrent: 1
        checkpoint_interval_s: 0
        log_models: false
        """)
    )
    return path


def _final_metrics(db: Path, run_id: str, prefix: str) -> dict[str, float]:
    """A run's latest values of the metrics whose key starts with `prefix`."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as con:
        return dict(
            con.execute(
                "SELECT key, value FROM latest_metrics WHERE run_uuid = ? AND key LIKE ?", (run_id, prefix + "%")
            )
        )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fused_race_stopped_mid_round_resumes_to_the_uninterrupted_decisions(tmp_path):
    """A racing study at ``seeds_per_trial: 2`` stopped (SIGTERM) while an array of a later
    round is mid-way, then resumed: no run left RUNNING, the stopped members continue in their
    own runs, one cell run per (config, seed) raced, each equal to its seed's separate trial
    (the uninterrupted array's member, issue 35), and the race's decisions those of the rule
    on the separate trials' values."""
    from setvalued.training import fit
    from studies.cells.space import expand
    from studies.scheduling.racing import SeedRace
    from studies.studyfile.spec import load_study
    from tests.test_racing import run_race

    name = f"sig-race-{os.getpid()}"
    output = tmp_path / "out"
    db = output / name / "mlflow.db"
    path = _raced_study(tmp_path, name)
    # stopped while the first array of a second round ([3, 4] of a twin) is mid-way, the worse
    # config decided: the resume rebuilds the race from the first rounds' values and the
    # recorded decision, and continues that array
    text = _run_and_stop(path, output, tmp_path / "driver.log", lambda run: int(run["tags"]["studies.seed"]) >= 3)
    assert f"terminated by SIGTERM; `studies resume {name}`" in text
    cells = _runs(db, "cell")
    assert [run for run in cells + _runs(db, "parent") if run["status"] == "RUNNING"] == []
    stopped = {
        run["tags"]["studies.cell_id"]: run["id"] for run in cells if run["tags"].get("studies.status") != "finished"
    }
    assert len(stopped) == 2 and all(run["status"] == "KILLED" for run in cells if run["id"] in stopped.values())
    decided = [run for run in cells if "studies.race" in run["tags"]]  # the worse config, before the stop
    assert [json.loads(run["tags"]["studies.race"])["state"] for run in decided] == ["worse than best"]

    _resume(name, output)
    cells, parents = _runs(db, "cell"), _runs(db, "parent")
    assert all(run["status"] == "FINISHED" for run in cells + parents), cells + parents
    ids = [run["tags"]["studies.cell_id"] for run in cells]
    assert len(ids) == len(set(ids)) == 13, sorted(ids)  # no cell run twice
    by_id = {run["tags"]["studies.cell_id"]: run for run in cells}
    assert {cell_id: by_id[cell_id]["id"] for cell_id in stopped} == stopped  # continued in their runs
    assert all(run["tags"]["studies.status"] == "finished" and run["epochs"] == 7 for run in cells)
    assert all("studies.stop_reason" not in run["tags"] for run in cells + parents)

    # the uninterrupted study: each member its seed's separate trial, the race's rule on them;
    # on one thread, as a trial of `cpus: 1` (float32 sums in another order pick other epochs)
    study = load_study(path)
    expanded = {c.cell_id: c for c in expand(study)}
    alone: dict[str, dict] = {}  # the cells the rule asks for -> their separate trial's test

    def value(config_id: str, seed: int) -> float:
        cell = expanded[f"{config_id}-s{seed}"]
        alone[cell.cell_id] = fit(cell.config, cell.seed)["test"]
        return alone[cell.cell_id]["top1"]

    configs = list(dict.fromkeys(c.config_id for c in expanded.values()))
    race = SeedRace(configs, study.seed_list, 3, 2)
    from tests.test_fused_schedulers import one_thread

    with one_thread():
        run_race(race, value)
    expected = {c: (race.status(c).state, race.status(c).seeds) for c in configs}
    assert sorted(expected.values()) == [("max seeds reached", 5)] * 2 + [("worse than best", 3)]
    decisions = {
        run["tags"]["studies.config_id"]: json.loads(run["tags"]["studies.race"])
        for run in cells
        if "studies.race" in run["tags"]
    }
    assert {c: (d["state"], d["seeds"]) for c, d in decisions.items()} == expected
    assert sorted(ids) == sorted(alone)  # the cells raced: those of the uninterrupted race
    for cell_id, run in by_id.items():
        found = _final_metrics(db, run["id"], "test/")
        for key, value in alone[cell_id].items():
            assert found[f"test/{key}"] == pytest.approx(value, abs=1e-6), (cell_id, key)


def test_close_stopped_ends_only_the_running_runs_killed_with_the_reason(tmp_path):
    """The ledger's closing of a stopped driver's runs, on a real SQLite store: a RUNNING run
    ends KILLED with the reason, a finished or already ended one is left as it was; the
    parent ends KILLED with the reason."""
    from analysis.layout import TAG_STOP_REASON
    from studies.tracking.ledger import CellState, StudyTracking

    tracking = StudyTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", "closing")
    client = tracking.client
    parent = tracking.parent_run_id()
    made = {}
    for label in ("running", "finished", "failed"):
        made[label] = client.create_run(tracking.experiment_id).info.run_id
    client.set_terminated(made["finished"], status="FINISHED")
    client.set_terminated(made["failed"], status="FAILED")
    states = [
        CellState("a", "running", made["running"], None, "RUNNING"),
        CellState("b", "finished", made["finished"], None, "FINISHED"),
        CellState("c", "failed", made["failed"], "boom", "FAILED"),
        CellState("d", "missing"),
    ]
    assert tracking.close_stopped(states, "terminated by SIGHUP", patience_s=5) == [made["running"]]
    tracking.close_parent(False, "terminated by SIGHUP", patience_s=5)
    for run_id, status in (
        (made["running"], "KILLED"),
        (made["finished"], "FINISHED"),
        (made["failed"], "FAILED"),
        (parent, "KILLED"),
    ):
        run = client.get_run(run_id)
        assert run.info.status == status
        assert (run.data.tags.get(TAG_STOP_REASON) == "terminated by SIGHUP") == (status == "KILLED")
    # the state the summary reads carries the run's MLflow status
    child = client.create_run(
        tracking.experiment_id,
        tags={"studies.role": "cell", "studies.study": "closing", "studies.cell_id": "e", "studies.status": "running"},
    ).info.run_id
    assert tracking.cell_states(["e"])["e"].mlflow_status == "RUNNING"
    assert tracking.close_stopped(tracking.cell_states(["e"]).values(), "interrupted") == [child]
    assert client.get_run(child).info.status == "KILLED"


def test_a_submitted_driver_gets_the_time_to_close_its_runs_after_studies_stop(tmp_path):
    """`ray job stop` sends SIGTERM, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S (3 s by
    default, read by the job's supervisor from the job's runtime environment)."""
    from studies.cluster.submit import JOB_STOP_WAIT_VARIABLE, job_runtime_env
    from studies.running.termination import CLOSE_PATIENCE_S

    env = job_runtime_env(tmp_path)
    assert env["working_dir"] == str(tmp_path)
    assert int(env["env_vars"][JOB_STOP_WAIT_VARIABLE]) >= 2 * CLOSE_PATIENCE_S


def test_the_report_says_why_a_stopped_cell_did_not_finish():
    """A cell run closed by a stopped driver is listed among the unfinished cells with the
    reason, not as a run KILLED 'without a studies.error tag'."""
    from analysis.collect import _failed_table
    from analysis.collect_store import RunRecord

    tags = {
        "studies.cell_id": "c-s0",
        "studies.config_id": "c",
        "studies.seed": "0",
        "studies.variant": "ce",
        "studies.status": "running",
    }
    stopped = RunRecord("r1", "KILLED", 0, 1, {**tags, "studies.stop_reason": "terminated by SIGTERM"}, {}, {})
    vanished = RunRecord("r2", "KILLED", 0, 1, dict(tags), {}, {})
    rows = _failed_table([stopped, vanished]).to_pylist()
    assert [(r["status"], r["error"]) for r in rows] == [
        ("unfinished", "terminated by SIGTERM"),
        ("unfinished", "MLflow run status KILLED without a studies.error tag"),
    ]
