"""What the tool reads back is guarded like the study file (issue 25, studies.readback).

Each refusal runs as a real `python -m studies.cli` process on real files and real SQLite
stores; its exit code (2), its one-line message naming the file or name and what was
expected, its wall time and its peak memory (the child's own `ru_maxrss`, read by a wrapper)
are asserted, and so is what it left on disk:

- a NAME outside `--output` (`../../x`, an absolute path) is refused by resume, report and
  export even when the store has an experiment of that name, and nothing is written outside;
- an unknown NAME lists the studies there, nearest first;
- a 0-byte, a truncated or a mistyped store is refused by name and left as it was (no store
  created, none modified); a broken run.json (wrong shape, a FIFO) too;
- checkpoint metas of the wrong shape, a FIFO and a link to /dev/zero are skipped, each
  described, and only the unfinished cells' folders are read at all;
- a flow-style nesting 20,000 levels deep is refused in linear time, before the YAML parser;
- a study named NAME-smoke (the smoke runs' folder and experiment) is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.measured_process import Measured, run_measured

REPO = Path(__file__).resolve().parents[1]
#: every refusal below must stay under this peak memory (issue 25) and time
PEAK_MB = 500
REFUSAL_S = 60


def assert_refused(result: Measured, *fragments: str) -> None:
    """Exit 2, one error line on stderr holding every fragment, no traceback, bounded time and
    memory."""
    assert result.code == 2, (result.code, result.err[-2000:])
    assert "Traceback" not in result.err, result.err
    # the one line of the refusal; a command's activity line ("[studies] report of NAME:
    # reading MLflow ...") may come before it
    errors = [line for line in result.err.strip().splitlines() if "[studies]" not in line]
    assert len(errors) == 1, result.err
    for fragment in fragments:
        assert fragment in result.err, (fragment, result.err)
    assert result.seconds < REFUSAL_S, result.seconds
    assert result.peak_mb < PEAK_MB, result.peak_mb


def tree(root: Path) -> dict[str, int]:
    """Every path under `root` with its size (folders: -1)."""
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1) for p in sorted(root.rglob("*"))}


def sqlite_store(path: Path, *experiments: str) -> str:
    """A real MLflow SQLite store at `path` holding `experiments`; its URI."""
    from mlflow import MlflowClient

    from studies.tracking.sqlite_store import seed_sqlite_store

    path.parent.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{path}"
    seed_sqlite_store(uri)
    client = MlflowClient(uri)
    for name in experiments:
        client.create_experiment(name, artifact_location=str(path.parent / "artifacts"))
    return uri


# ----------------------------------------------------------------------------- names


def test_a_name_outside_the_output_folder_is_refused_and_nothing_is_written_outside(tmp_path):
    output = tmp_path / "deep" / "er" / "out"
    output.mkdir(parents=True)
    # the store holds an experiment of each hostile name (on a shared server, names are anyone's)
    uri = sqlite_store(tmp_path / "store" / "mlflow.db", "../../x", str(tmp_path / "abs"))
    (tmp_path / "deep" / "x").mkdir()
    (tmp_path / "deep" / "x" / "study.yaml").write_text("name: x\nbase: {loss: {name: ce}}\nseeds: [0]\n")
    before = tree(tmp_path)
    for command, name in (("report", "../../x"), ("export", str(tmp_path / "abs")), ("resume", "../../x")):
        result = run_measured(command, name, "--output", str(output), "--tracking-uri", uri)
        assert_refused(result, "is not a study name", repr(name))
    after = tree(tmp_path)
    assert after == before, set(after.items()) ^ set(before.items())


def test_a_study_folder_that_links_outside_the_output_folder_is_refused(tmp_path):
    from studies.readback import ReadBackError, study_folder

    output = tmp_path / "out"
    output.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (output / "linked").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ReadBackError, match="leads outside the output folder"):
        study_folder(output, "linked")
    assert study_folder(output, "fine.name-1") == output.resolve() / "fine.name-1"


def test_an_unknown_study_name_lists_the_studies_there_nearest_first(tmp_path):
    output = tmp_path / "out"
    for name in ("alpha_study", "beta", "gamma"):
        (output / name).mkdir(parents=True)
        (output / name / "run.json").write_text("{}")
    (output / "not_a_study").mkdir()
    result = run_measured("report", "alpha_stduy", "--output", str(output))
    assert_refused(result, "no study named 'alpha_stduy'", "did you mean 'alpha_study'?", "alpha_study, beta, gamma")
    assert "not_a_study" not in result.err
    assert not (output / "alpha_stduy").exists()


# ----------------------------------------------------------------------------- stores


def test_a_broken_or_mistyped_store_is_refused_by_name_and_left_as_it_was(tmp_path):
    output = tmp_path / "out"
    empty, cut = output / "empty", output / "cut"
    empty.mkdir(parents=True)
    (empty / "mlflow.db").write_bytes(b"")
    sqlite_store(cut / "mlflow.db", "cut")
    with open(cut / "mlflow.db", "r+b") as handle:  # half of the file lost (a disk full mid-copy)
        handle.truncate((cut / "mlflow.db").stat().st_size // 2)
    before = tree(tmp_path)

    assert_refused(
        run_measured("report", "empty", "--output", str(output)), str(empty / "mlflow.db"), "is empty (0 bytes)"
    )
    assert_refused(run_measured("export", "cut", "--output", str(output)), str(cut / "mlflow.db"), "is truncated")
    typo = tmp_path / "typo" / "mlflow.db"
    assert_refused(
        run_measured("report", "cut", "--output", str(output), "--tracking-uri", f"sqlite:///{typo}"),
        str(typo),
        "no such file",
        "--tracking-uri",
    )
    assert tree(tmp_path) == before  # no store created, none modified, no report folder


def test_a_broken_run_json_is_refused_by_name(tmp_path):
    output = tmp_path / "out"
    (output / "listed").mkdir(parents=True)
    (output / "listed" / "run.json").write_text("[1, 2]")
    assert_refused(
        run_measured("report", "listed", "--output", str(output)),
        str(output / "listed" / "run.json"),
        "JSON list",
        "expected",
    )
    (output / "piped").mkdir()
    os.mkfifo(output / "piped" / "run.json")  # reading it would block forever
    assert_refused(
        run_measured("export", "piped", "--output", str(output), timeout=REFUSAL_S),
        str(output / "piped" / "run.json"),
        "FIFO",
    )
    (output / "typed").mkdir()
    (output / "typed" / "run.json").write_text('{"tracking_uri": 5}')
    from studies.readback import ReadBackError
    from studies.running.runner import read_settings

    with pytest.raises(ReadBackError, match="field 'tracking_uri' is 5; expected str"):
        read_settings(output / "typed")


# ----------------------------------------------------------------------------- trial storage

_CHECKPOINT_SCAN = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from studies.running.checkpoints import ResumePoints

    storage = Path(sys.argv[1])
    good = {"run_id": "r1", "cell_id": "good", "study": "s", "epoch": 3, "history": []}

    def checkpoint(cell, state=True):
        folder = storage / "tune-a-0" / cell / "checkpoint_000001"
        folder.mkdir(parents=True)
        if state:
            (folder / "state.pt").write_bytes(b"")
        return folder / "meta.json"

    checkpoint("good").write_text(json.dumps(good))
    checkpoint("stateless", state=False).write_text(json.dumps({**good, "cell_id": "stateless"}))
    checkpoint("listed").write_text("[1, 2]")
    checkpoint("bad_epoch").write_text(json.dumps({**good, "cell_id": "bad_epoch", "epoch": "abc"}))
    os.mkfifo(checkpoint("piped"))
    checkpoint("zeros").symlink_to("/dev/zero")
    os.mkfifo(checkpoint("other_cell"))  # a cell not asked for: never opened

    started = time.monotonic()
    found = ResumePoints.search(storage, "s", ["good", "listed", "bad_epoch", "piped", "zeros", "stateless"])
    none = ResumePoints.search(storage, "s", [])  # a finished study: no cell to resume
    print(json.dumps({"found": sorted(found.found), "epoch": found.found["good"][1]["epoch"],
                      "refused": found.refused, "none": [sorted(none.found), none.refused],
                      "seconds": time.monotonic() - started,
                      "describe": found.describe()}))
""")


def test_checkpoint_metas_are_read_with_bounds_and_only_for_unfinished_cells(tmp_path):
    env_code = _CHECKPOINT_SCAN.replace("sys.argv[1]", repr(str(tmp_path / "storage")))
    result = run_measured(code=env_code, timeout=REFUSAL_S)
    assert result.code == 0, result.err[-3000:]
    report = json.loads(result.out.strip().splitlines()[-1])
    assert report["found"] == ["good"] and report["epoch"] == 3
    refused = "\n".join(report["refused"])
    assert len(report["refused"]) == 5, refused
    assert "stateless/checkpoint_000001/state.pt: no such file" in refused
    assert "listed/checkpoint_000001/meta.json: holds a JSON list" in refused
    assert "bad_epoch/checkpoint_000001/meta.json: field 'epoch' is 'abc'; expected int" in refused
    assert "piped/checkpoint_000001/meta.json: is a FIFO" in refused
    assert "zeros/checkpoint_000001/meta.json: is a character device" in refused
    assert "other_cell" not in refused
    assert report["none"] == [[], []]
    assert report["describe"].startswith("1 unfinished cells continue")
    assert report["seconds"] < 5
    assert result.peak_mb < PEAK_MB, result.peak_mb


# ----------------------------------------------------------------------------- study files


def test_a_deep_flow_nesting_is_refused_in_linear_time(tmp_path):
    deep = tmp_path / "deep.yaml"
    levels = 20_000  # 40 KB; PyYAML's scanner alone took more than 60 s on it
    deep.write_text("name: deep\nbase: " + "[" * levels + "]" * levels + "\nseeds: [0]\n")
    result = run_measured("run", str(deep), "--dry-run", "--output", str(tmp_path / "out"))
    assert_refused(result, str(deep), "nested more than 32 levels deep (line 2)")
    assert result.seconds < 20, result.seconds
    assert not (tmp_path / "out").exists()


def test_brackets_in_quotes_comments_and_plain_words_do_not_count_as_nesting():
    from studies.studyfile.spec import StudyError, parse_study

    text = (
        "name: fine\nbase: {loss: {name: ce}}\nseeds: [0]\n"
        "description: '" + "[{" * 100 + "'' and \"[[\"'  # " + "[" * 100 + "\n"
    )
    assert parse_study(text).name == "fine"
    assert parse_study(text.replace("description: '", "description: a'").replace("# ", "# x")).name == "fine"
    started = time.monotonic()
    with pytest.raises(StudyError, match="nested more than 32 levels deep"):
        parse_study("name: x\nbase: {a: " + "{b: " * 5000 + "}" * 5001 + "\nseeds: [0]\n")
    assert time.monotonic() - started < 2


def test_a_study_named_like_a_smoke_run_is_refused(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("name: a-smoke\nbase: {loss: {name: ce}}\nseeds: [0]\n")
    result = run_measured("run", str(path), "--dry-run", "--output", str(tmp_path / "out"))
    assert_refused(result, "name (line 1)", "'a-smoke' ends with '-smoke'", "smoke runs of study 'a'")


@pytest.mark.parametrize(
    "field, value, expect",
    [
        ("data", "{name: synthetic, num_workers: 10000}", "base.data.num_workers"),
        ("model", "{name: mlp, hidden_dim: 1000000000}", "base.model.hidden_dim"),
    ],
)
def test_values_that_would_exhaust_the_machine_are_refused_by_the_dry_run(tmp_path, field, value, expect):
    path = tmp_path / "big.yaml"
    other = "model: {name: mlp}" if field == "data" else "data: {name: synthetic}"
    path.write_text(f"name: big\nbase:\n  {field}: {value}\n  {other}\n  loss: {{name: ce}}\nseeds: [0]\n")
    result = run_measured("run", str(path), "--dry-run", "--output", str(tmp_path / "out"))
    assert_refused(result, expect, "expected at most")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- signals


def _long_study(folder: Path, name: str) -> Path:
    """A study whose cells take long enough to be stopped mid-way (one CPU, one at a time)."""
    path = folder / f"{name}.yaml"
    path.write_text(
        textwrap.dedent(f"""\
        name: {name}
        base:
          data: {{name: synthetic, num_classes: 6, num_superclasses: 2, train_size: 4000,
                  val_size: 60, test_size: 60, form: features, feature_dim: 8}}
          model: {{name: mlp, hidden_dim: 32}}
          loss: {{name: ce}}
          optim: {{lr: 0.1, batch_size: 8, milestones: []}}
          epochs: 50
          eval: {{ks: [1, 3], selection: val/top3}}
          device: cpu
        design: {{kind: grid, parameters: {{optim.lr: [0.02, 0.05]}}}}
        seeds: [0, 1]
        resources: {{cpus: 1}}
        max_concurrent: 1
        log_models: false
        """)
    )
    return path


@pytest.mark.slow
@pytest.mark.parametrize("signame, code", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_sigterm_and_sighup_stop_the_driver_like_ctrl_c(tmp_path, signame, code):
    import signal as signals

    from mlflow import MlflowClient

    name = f"term-{os.getpid()}"
    output = tmp_path / "out"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["RAY_ADDRESS"] = ""  # a local Ray of its own
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "studies.cli",
            "run",
            str(_long_study(tmp_path, name)),
            "--output",
            str(output),
            "--num-cpus",
            "1",
            "--no-report",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    errors: list[str] = []
    threading.Thread(target=lambda: errors.extend(process.stderr), daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        while not any("running 4 cells" in line for line in lines):
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines + errors)[-3000:]
            time.sleep(0.2)
        time.sleep(3)  # a trial is training
        assert process.poll() is None, "".join(lines + errors)[-3000:]
        # the driver's own high-water mark so far (VmHWM: of its address space since exec; its
        # ru_maxrss would include this pytest process's, inherited through fork)
        status_text = Path(f"/proc/{process.pid}/status").read_text()
        driver_peak_mb = (
            int(next(line.split()[1] for line in status_text.splitlines() if line.startswith("VmHWM:"))) / 1024
        )
        os.kill(process.pid, getattr(signals, signame))
        stopped = time.monotonic()
        _, status, _usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        took = time.monotonic() - stopped
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signals.SIGKILL)
            process.wait()
    reader.join(10)
    out, err = "".join(lines), "".join(errors)
    assert process.returncode == code, (process.returncode, out[-2000:], err[-3000:])
    assert f"terminated by {signame}; `studies resume {name}`" in out, out[-2000:]
    assert "Traceback" not in err and "core dumped" not in err.lower(), err[-3000:]
    assert took < 60, took
    assert driver_peak_mb < 1500  # the driver alone (torch and Ray loaded); its trials are not children
    client = MlflowClient(f"sqlite:///{output / name / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(name)
    parents = client.search_runs([experiment.experiment_id], "tags.`studies.role` = 'parent'")
    assert parents and all(run.info.status != "RUNNING" for run in parents), [r.info.status for r in parents]
    # the cells in flight (if one had made its run yet) end KILLED with the signal as their
    # reason, none stays RUNNING (issue 33; tests/test_signals.py stops a cell mid-way)
    cells = client.search_runs([experiment.experiment_id], "tags.`studies.role` = 'cell'")
    assert all(run.info.status != "RUNNING" for run in cells), [r.info.status for r in cells]
    for run in cells + parents:
        if run.info.status == "KILLED":
            assert run.data.tags["studies.stop_reason"] == f"terminated by {signame}"


# ----------------------------------------------------------------------------- artifacts

_ARTIFACT_READ = textwrap.dedent("""
    import json, sys, time
    from analysis.collect import CollectError, collect_per_class

    uri, runs = URI, RUNS
    found = {"normal": collect_per_class(uri, [runs["normal"]]).num_rows}
    for kind in ("many_rows", "folder"):
        started = time.monotonic()
        try:
            collect_per_class(uri, [runs[kind]])
            found[kind] = "read"
        except CollectError as error:
            found[kind] = [str(error), time.monotonic() - started, runs[kind]]
    print(json.dumps(found))
""")


def test_a_run_artifact_is_read_with_bounds(tmp_path):
    """A 15-million-row Parquet (a few hundred KB) and a folder in place of a run's per-class
    artifact are refused by name from the file's kind and footer; the child that reads them
    stays small."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from mlflow import MlflowClient

    uri = sqlite_store(tmp_path / "mlflow.db", "art")
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("art").experiment_id
    runs = {}
    for kind in ("normal", "many_rows", "folder"):
        runs[kind] = client.create_run(experiment).info.run_id
        local = tmp_path / kind
        local.mkdir()
        rows = 15_000_000 if kind == "many_rows" else 3
        table = pa.table({"class": pa.repeat(pa.scalar(0, pa.int32()), rows), "top1": pa.repeat(pa.scalar(1.0), rows)})
        target = local / "per_class_test.parquet"
        if kind == "folder":  # a folder in the artifact's place, holding one seed's file
            target.mkdir()
            target = target / "part-0.parquet"
        pq.write_table(table, target)
        client.log_artifacts(runs[kind], str(local))

    code = _ARTIFACT_READ.replace("URI", repr(uri)).replace("RUNS", repr(runs))
    result = run_measured(code=code, timeout=120)
    assert result.code == 0, result.err[-3000:]
    found = json.loads(result.out.strip().splitlines()[-1])
    assert found["normal"] == 3
    message, seconds, run = found["many_rows"]
    assert message.startswith(f"artifact per_class_test.parquet of run {run} has 15,000,000 rows; expected at most ")
    assert seconds < 10
    message, seconds, run = found["folder"]
    assert message.startswith(f"artifact per_class_test.parquet of run {run} is a folder; expected one Parquet")
    assert result.peak_mb < PEAK_MB, result.peak_mb


# ----------------------------------------------------------------------------- a locked store

_HOLD_LOCK = textwrap.dedent("""
    import sqlite3, sys, time
    connection = sqlite3.connect(sys.argv[1], isolation_level=None)
    connection.execute("BEGIN EXCLUSIVE")
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
    connection.execute("COMMIT")
""")


@pytest.mark.slow
def test_export_waits_for_a_locked_store_with_one_warning_line(tmp_path):
    """MLflow's SQLite busy timeout is 20 s; a lock held longer is waited for like `run` does."""
    output = tmp_path / "out"
    store = output / "held" / "mlflow.db"
    uri = sqlite_store(store, "held")
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    run = client.create_run(
        client.get_experiment_by_name("held").experiment_id,
        tags={
            "studies.role": "cell",
            "studies.study": "held",
            "studies.cell_id": "c0",
            "studies.config_id": "c",
            "studies.seed": "0",
            "studies.status": "finished",
        },
    )
    client.log_metric(run.info.run_id, "test/top1", 0.5)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(store), "22"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = run_measured("export", "held", "--output", str(output), timeout=120)
    finally:
        holder.wait(30)
    assert result.code == 0, result.err[-3000:]
    assert "Traceback" not in result.err
    warnings = [line for line in result.err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "locked by another process" in warnings[0], (result.err, result.out, result.seconds)
    assert Path(result.out.strip().splitlines()[-1]) == output.resolve() / "held" / "cells.parquet"
    assert result.seconds > 20  # it waited for the holder
    assert result.peak_mb < PEAK_MB, result.peak_mb


def _hold_when_trials_run(study_dir: Path, seconds: float, holder: list) -> None:
    """Once the run's first trial has started (its Tune folder exists), lock the study's store
    for `seconds` from another process: a lock taken mid-run."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not any(p.is_dir() for p in study_dir.glob("ray/tune-*/*")):
        time.sleep(0.1)
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(study_dir / "mlflow.db"), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    holder.append((process, process.stdout.readline().strip()))
    process.wait(seconds + 30)


@pytest.mark.slow
@pytest.mark.parametrize("verbose", [False, True])
def test_a_store_locked_mid_run_is_one_warning_line_and_no_cell_fails(tmp_path, verbose):
    """Another process holds the study's SQLite store for 35 s (past MLflow's 20 s busy timeout
    and the driver's 10 s lease heartbeat: the driver meets the lock too)
    while trials run: trials that start meanwhile wait for it (they failed, with Tune's
    100-line dump of the worker's traceback), the driver's lease heartbeat waits without
    MLflow's 60-line traceback of each locked request; one warning line says so. With
    --verbose, MLflow's traceback is shown."""
    from test_runner import write_study

    path = write_study(tmp_path, "held-run", lrs=[0.05, 0.1, 0.2], seeds=[0, 1], epochs=3)
    output = tmp_path / "out"
    holder: list = []
    thread = threading.Thread(target=_hold_when_trials_run, args=(output / "held-run", 35.0, holder))
    thread.start()
    try:
        result = run_measured(
            "run",
            str(path),
            "--output",
            str(output),
            "--no-report",
            "--num-cpus",
            "2",
            *(["--verbose"] if verbose else []),
            timeout=400,
        )
    finally:
        thread.join(240)
    assert holder and holder[0][1] == "locked", holder
    console = result.out + result.err
    assert result.code == 0, console[-4000:]
    assert "6/6 cells finished" in console, console[-4000:]
    warnings = [line for line in console.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "locked by another process" in warnings[0], console[-4000:]
    assert "--verbose" in warnings[0]
    assert "Trial task failed" not in console and " ERROR " not in console.replace("ERROR mlflow", ""), console[-4000:]
    if verbose:  # the details: MLflow's own record of a locked request, traceback included
        assert "ERROR mlflow.store.db.utils" in console and "database is locked" in console, console[-4000:]
    else:
        assert "Traceback" not in console and "database is locked" not in console, console[-4000:]


def test_a_broken_study_yaml_copy_is_refused_by_name(tmp_path):
    output = tmp_path / "out"
    sqlite_store(output / "bomb" / "mlflow.db", "bomb")
    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
        for i in range(9)
    )
    (output / "bomb" / "study.yaml").write_text(laughs)  # 9**10 values once expanded
    before = tree(tmp_path)
    assert_refused(
        run_measured("report", "bomb", "--output", str(output)),
        str(output / "bomb" / "study.yaml"),
        "expands to more than",
        "copy of the study file",
    )
    assert tree(tmp_path) == before  # no report folder
    (output / "piped").mkdir()
    os.mkfifo(output / "piped" / "study.yaml")
    assert_refused(
        run_measured("resume", "piped", "--output", str(output), timeout=REFUSAL_S),
        str(output / "piped" / "study.yaml"),
        "not a regular file",
    )


# ----------------------------------------------------------------------------- a resumed cell


def test_a_cell_that_finishes_after_a_transient_error_no_longer_carries_it(tmp_path):
    from mlflow import MlflowClient

    from analysis.layout import TAG_ERROR, TAG_STATUS
    from studies.tracking.cell_run import CellRun, TrackingContext

    uri = sqlite_store(tmp_path / "mlflow.db", "resumed")
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("resumed").experiment_id
    parent = client.create_run(experiment).info.run_id
    run_id = client.create_run(experiment, tags={TAG_ERROR: "ConnectionError: the store went away"}).info.run_id
    context = TrackingContext(uri, experiment, parent, "resumed", "s1")
    run = CellRun(context, run_id, client)
    assert run.recorded_error() == "ConnectionError: the store went away"
    run.finish({"test": {"top1": 0.5}}, final_step=1, clear_error=True)
    tags = client.get_run(run_id).data.tags
    assert TAG_ERROR not in tags and tags[TAG_STATUS] == "finished"


# ----------------------------------------------------------------------------- a full disk


@pytest.fixture
def full_disk_folder(tmp_path):
    """A real 1 MiB tmpfs (mounted for the test; skipped where mounting is not permitted)."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True, text=True, timeout=30
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()[:200]})")
    try:
        yield folder
    finally:  # lazily: a file torch.save left open is closed when its error is collected
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)


def test_a_full_disk_fails_the_cell_at_once_naming_the_folder(full_disk_folder, tmp_path):
    import torch

    from studies.running.checkpoints import save_checkpoint
    from studies.running.trial import full_disk, full_disk_message

    with pytest.raises(Exception) as info:  # what torch.save really raises on a full disk
        save_checkpoint(full_disk_folder, {"w": torch.zeros(1_000_000)}, {"epoch": 3})
    error = info.value  # a RuntimeError that does not say "disk" ("unexpected pos ...")
    assert full_disk(error, [tmp_path, full_disk_folder])  # so the cell fails at once
    assert not full_disk(RuntimeError("a transient error"), [tmp_path])
    message = full_disk_message(error, [full_disk_folder, tmp_path])
    assert message.startswith("the disk is full: ")
    assert f"{full_disk_folder} (0.0 MiB free of 0.0 GiB)" in message, message
    assert str(tmp_path) in message
