"""Report at scale (issue 15), a benchmark, not a test: collect, export and build_report of a
study of N finished cells, with the time and the peak memory of each.

1. A synthesizer writes a study of N cells into an MLflow SQLite store in the layout the
   runner writes (docs/interfaces.md section 5). The study file is expanded by the project
   itself (`studies.studyfile.spec.parse_study`, `studies.cells.space.expand`), so the configs, config ids,
   cell ids, variants and swept values are those a real run of the file would have; the tags
   and params of each child run are `studies.tracking.cell_tags` and `config_params`; the
   experiment (artifact root `<study>/mlartifacts`, tag `studies.study`) and the parent run
   (`study.yaml` artifact) are created with the MLflow client as `StudyTracking` does. The
   child runs -- rows of MLflow's own SQL tables (`runs`, `tags`, `params`, `metrics`,
   `latest_metrics`) -- are inserted in bulk with the SQLAlchemy tables of
   `mlflow.store.tracking.dbmodels.models` instead of one `log_batch` per epoch (10,000 cells
   would take an hour through the client); `tests/test_report_scale.py` checks that a cell
   written this way reads back exactly like one written by `studies.tracking.CellRun`.
   Each finished cell has: ~45 per-epoch metrics at `step = epoch` (the trainer's keys:
   train/loss, train/top<K>, lr, times, gradient sparsity, every val/ accuracy, shot group
   and average-K metric), the test metrics, `best_epoch` and `best_val` at the last epoch's
   step, `per_class_test.parquet` and `set_sizes_test.parquet`.

   The design: 4 variants (ce, noised_topk, smooth_topk_svm, avgk_two_head), each a grid of
   optim.lr x one parameter of its own, N / seeds configs in all, 5 seeds by default
   (10,000 cells = 2,000 configs x 5 seeds). Metrics are smooth functions of the parameters
   plus seed noise; the few-shot and many-shot accuracies sit near 0 and 100 % so that their
   t intervals pass the bounds.

2. Each step runs in a fresh Python process (`--code DIR` chooses which checkout's
   `analysis` it imports, e.g. an older commit for a before/after comparison), timed with
   `time.perf_counter`; its peak memory is the process's peak resident set size
   (`resource.getrusage(RUSAGE_SELF).ru_maxrss`, so the interpreter and imports count too):

   - collect:  `analysis.collect.collect` (search of the runs, the finished-cell table);
   - histories: `collect_histories` of two per-epoch keys for every finished cell (timed
     after a collect in the same process; the collect is not counted);
   - export:   `collect` + `export_parquet` (what `studies export` does);
   - report:   `build_report` with the study's file (tables, figures, documents).

    python benchmarks/report_scale.py --cells 1000 10000
    python benchmarks/report_scale.py --cells 1000 --code /tmp/old   # another checkout
    python benchmarks/report_scale.py --cells 200 --keep /tmp/scale  # keep the store

The machine's load counts: on a shared machine, run it twice and read both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

SEEDS = 5
EPOCHS = 10
KS = (1, 3, 5, 10)
AVGK = 5
GROUPS = ("few", "medium", "many")
NUM_CLASSES = 100
STEPS = ("collect", "histories", "export", "report")

# each variant: its loss, and the parameter it sweeps beside optim.lr (values: geometric)
VARIANTS = {
    "ce": ({"name": "ce"}, "optim.weight_decay", (1e-6, 1e-2)),
    "noised_topk": ({"name": "noised_topk", "k": 5, "epsilon": 0.1, "n_samples": 5}, "loss.epsilon", (1e-3, 1.0)),
    "smooth_topk_svm": ({"name": "smooth_topk_svm", "k": 5, "tau": 1.0, "alpha": 1.0}, "loss.tau", (0.01, 10.0)),
    "avgk_two_head": (
        {"name": "avgk_two_head", "k": 5, "alpha": 0.3, "prediction_head": "ml"},
        "loss.alpha",
        (1e-3, 100.0),
    ),
}


# ----------------------------------------------------------------------------- the study


def _grid_shape(configs_per_variant: int) -> tuple[int, int]:
    """(values of optim.lr, values of the variant's own parameter): a near-square grid with
    exactly `configs_per_variant` configs (the largest divisor at most its square root)."""
    rows = max(d for d in range(1, int(math.isqrt(configs_per_variant)) + 1) if configs_per_variant % d == 0)
    return rows, configs_per_variant // rows


def _geometric(low: float, high: float, n: int) -> list[float]:
    if n == 1:
        return [float(f"{math.sqrt(low * high):.4g}")]
    return [float(f"{low * (high / low) ** (i / (n - 1)):.4g}") for i in range(n)]


def study_yaml(name: str, n_cells: int, seeds: int = SEEDS, epochs: int = EPOCHS) -> str:
    """The study file of about `n_cells` cells (rounded to a multiple of 4 x seeds)."""
    per_variant = max(1, round(n_cells / seeds / len(VARIANTS)))
    n_lr, n_own = _grid_shape(per_variant)
    lrs = _geometric(1e-3, 1.0, n_lr)
    variants = "\n".join(f"  {v}:\n    loss: {json.dumps(loss)}" for v, (loss, _, _) in VARIANTS.items())
    design = "\n".join(
        f"  - kind: grid\n    variants: [{v}]\n    parameters:\n"
        f"      optim.lr: {json.dumps(lrs)}\n      {own}: {json.dumps(_geometric(*span, n_own))}"
        for v, (_, own, span) in VARIANTS.items()
    )
    return f"""\
# written by benchmarks/report_scale.py: {len(VARIANTS)} variants x {n_lr} x {n_own} configs
# x {seeds} seeds
name: {name}
description: >-
  Synthetic study for the report-scale benchmark (issue 15): every variant a grid of
  optim.lr and one parameter of its own.
base:
  data:
    name: synthetic
    root: null
    num_classes: {NUM_CLASSES}
    num_superclasses: 10
    train_size: 5000
    val_size: 1000
    test_size: 2000
    pareto_shape: 1.2
    form: features
    feature_dim: 32
    num_workers: 0
  model: {{name: mlp, pretrained: false, head: auto, hidden_dim: 128}}
  loss: {{name: ce}}
  optim:
    lr: 0.1
    momentum: 0.9
    nesterov: true
    weight_decay: 1.0e-4
    batch_size: 64
    milestones: [{max(1, epochs // 2)}]
    gamma: 0.1
  epochs: {epochs}
  eval:
    ks: {list(KS)}
    avgk: [{AVGK}]
    avgk_activation: softmax
    shot_thresholds: [20, 100]
    selection: val/top5
    selection_mode: max
  device: cpu
variants:
{variants}
design:
{design}
seeds: {list(range(seeds))}
resources: {{cpus: 1, gpus: 0}}
max_failures: 1
max_cells: 200000
objective: {{metric: val/top5, mode: max}}
scheduler: {{kind: none}}
report:
  learning_curves: [val/top5]
"""


def expand_cells(text: str) -> list:
    """The study's cells as the runner has them (`studies.cells.space.expand`)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from studies.cells.space import expand
    from studies.studyfile.spec import parse_study

    return expand(parse_study(text, "<report_scale>", max_cells=10**6))


# ----------------------------------------------------------------------------- values


class _Values:
    """Deterministic metric values of a cell: smooth in its parameters, noisy over seeds."""

    def __init__(self, seed: int):
        import numpy as np

        self.np = np
        self.rng = np.random.default_rng(seed)

    def cell(self, cell, epochs: int) -> tuple[list[dict[str, float]], dict[str, float], float]:
        """(per-epoch metrics, test metrics without `test/`, best_val) of a cell."""
        rng = self.rng
        config = cell.config
        lr = float(config["optim"]["lr"])
        quality = {"ce": 0.0, "noised_topk": 0.01, "smooth_topk_svm": -0.01, "avgk_two_head": 0.005}.get(
            cell.variant, 0.0
        )
        for path in cell.swept:
            if path != "optim.lr":
                own = float(cell.swept[path])
                quality -= 0.02 * (math.log10(own) + 2.0) ** 2 / 9.0
        quality -= 0.08 * (math.log10(lr) + 1.0) ** 2  # best lr near 0.1
        final = 0.9 + quality + rng.normal(0, 0.004)
        out_epochs = []
        for e in range(epochs):
            progress = 1.0 - math.exp(-3.0 * (e + 1) / epochs)
            level = final * progress
            metrics = {
                "train/loss": 4.6 * (1 - progress) + 0.3 + rng.normal(0, 0.01),
                "lr": lr * (0.1 if e >= max(1, epochs // 2) else 1.0),
                "epoch_time_s": 30.0 + rng.normal(0, 0.5),
                "eval_time_s": 2.0 + rng.normal(0, 0.05),
                "grad_nonzero": 100.0 * (1 - progress) + 5.0,
                "grad_nonzero_active": 100.0 * (1 - progress) + 5.5,
            }
            for k in KS:
                metrics[f"train/top{k}"] = _acc(level * _k_gain(k) + 0.02, rng)
            metrics.update({f"val/{k}": v for k, v in _accuracies(level, rng).items()})
            metrics[f"val/avg{AVGK}_threshold"] = 0.1 + rng.normal(0, 0.005)
            out_epochs.append(metrics)
        test = _accuracies(final, rng)
        best_val = max(m["val/top5"] for m in out_epochs)
        return out_epochs, test, best_val


def _k_gain(k: int) -> float:
    return {1: 0.62, 3: 0.9, 5: 1.0, 10: 1.06}[k]


def _acc(value: float, rng, sd: float = 0.004) -> float:
    return min(1.0, max(0.0, value + rng.normal(0, sd)))


def _accuracies(level: float, rng) -> dict[str, float]:
    """top-K, macro, shot groups (few near 0, many near 1: intervals that pass the bounds)
    and average-K metrics of a model of overall top-5 accuracy `level`."""
    out: dict[str, float] = {}
    for k in KS:
        base = level * _k_gain(k)
        out[f"top{k}"] = _acc(base, rng)
        out[f"macro_top{k}"] = _acc(base - 0.05, rng)
        out[f"few/top{k}"] = _acc(0.02 + 0.1 * (base - 0.8), rng, 0.02)
        out[f"medium/top{k}"] = _acc(base - 0.1, rng)
        out[f"many/top{k}"] = _acc(min(0.999, base + 0.12), rng, 0.004)
    avg = level * 1.02
    out[f"avg{AVGK}"] = _acc(avg, rng)
    out[f"macro_avg{AVGK}"] = _acc(avg - 0.05, rng)
    for group, shift in zip(GROUPS, (-0.6, -0.1, 0.1)):
        out[f"{group}/avg{AVGK}"] = _acc(avg + shift, rng)
    out[f"avg{AVGK}_size"] = 5.0 + rng.normal(0, 0.05)
    return out


def _per_class(rng) -> dict[str, list]:
    counts = [int(500 / (c + 1) ** 1.1) + 1 for c in range(NUM_CLASSES)]
    shots = ["few" if n < 20 else "medium" if n <= 100 else "many" for n in counts]
    columns: dict[str, list] = {
        "class": list(range(NUM_CLASSES)),
        "name": [f"class_{c}" for c in range(NUM_CLASSES)],
        "train_count": counts,
        "test_count": [20] * NUM_CLASSES,
        "shot": shots,
    }
    for k in KS:
        columns[f"top{k}"] = [float(v) for v in rng.uniform(0.3, 1.0, NUM_CLASSES)]
    columns[f"avg{AVGK}"] = [float(v) for v in rng.uniform(0.3, 1.0, NUM_CLASSES)]
    return columns


def _set_sizes(rng) -> dict[str, list]:
    columns: dict[str, list] = {"avgk": [], "shot": [], "size": [], "count": []}
    for shot, center in zip(GROUPS, (9, 6, 4)):
        for size in range(0, 16):
            count = int(200 * math.exp(-(((size - center) / 3.0) ** 2)) * rng.uniform(0.8, 1.2))
            if count:
                columns["avgk"].append(str(AVGK))
                columns["shot"].append(shot)
                columns["size"].append(size)
                columns["count"].append(count)
    return columns


# ----------------------------------------------------------------------------- the writer


def synthesize(
    tracking_uri: str,
    study_dir: Path,
    name: str,
    n_cells: int,
    *,
    seeds: int = SEEDS,
    epochs: int = EPOCHS,
    failed: int = 0,
    text: str | None = None,
    chunk: int = 250,
) -> dict[str, Any]:
    """Write the study `name` of about `n_cells` cells into the SQLite store `tracking_uri`
    (artifacts under `study_dir/mlartifacts`), in the runner's layout. The last `failed`
    cells end failed (half their epochs, `studies.error`, MLflow status FAILED).

    Returns {"cells", "finished", "failed", "configs", "study_file", "seconds"}.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sqlalchemy
    import yaml
    from mlflow import MlflowClient
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric, SqlParam, SqlRun, SqlTag

    from analysis.layout import (
        PER_CLASS_ARTIFACT,
        ROLE_PARENT,
        SET_SIZES_ARTIFACT,
        STATUS_FAILED,
        STATUS_FINISHED,
        TAG_ERROR,
        TAG_NODE_ID,
        TAG_ROLE,
        TAG_STATUS,
        TAG_STUDY,
    )
    from studies.tracking import cell_tags, config_params, experiment_tags, new_session_id, study_description
    from studies.tracking.provenance import CellProvenance, environment_tags

    started = time.perf_counter()
    if not tracking_uri.startswith("sqlite:"):
        raise ValueError(f"the synthesizer writes SQLite stores only, got {tracking_uri}")
    study_dir.mkdir(parents=True, exist_ok=True)
    text = text or study_yaml(name, n_cells, seeds, epochs)
    study_file = study_dir / "study.yaml"  # the runner's copy of the study file
    study_file.write_text(text, encoding="utf-8")
    cells = expand_cells(text)
    failed_ids = {c.cell_id for c in cells[len(cells) - failed :]} if failed else set()

    # experiment and parent run: as StudyTracking creates them (the client, one request each)
    client = MlflowClient(tracking_uri=tracking_uri)
    artifact_root = (study_dir / "mlartifacts").resolve()
    described = study_description(str((yaml.safe_load(text) or {}).get("description") or ""), text)
    experiment_id = client.create_experiment(
        name, artifact_location=artifact_root.as_uri(), tags={TAG_STUDY: name, **experiment_tags(described)}
    )
    for key, value in experiment_tags(described, None, experiment_id).items():  # the note's link
        client.set_experiment_tag(experiment_id, key, value)
    t0 = int(time.time() * 1000)
    parent = client.create_run(
        experiment_id, run_name=name, start_time=t0, tags={TAG_ROLE: ROLE_PARENT, TAG_STUDY: name}
    )
    parent_id = parent.info.run_id
    client.log_artifact(parent_id, str(study_file))  # StudyTracking.parent_run_id
    experiment = client.get_experiment(experiment_id)

    session = new_session_id()
    values = _Values(1234)
    engine = sqlalchemy.create_engine(tracking_uri)
    tables = {m: m.__table__ for m in (SqlRun, SqlTag, SqlParam, SqlMetric, SqlLatestMetric)}
    epoch_ms, cell_ms = 30_000, 30_000 * epochs + 10_000
    node = uuid.uuid4().hex * 2
    artifact_jobs: list[tuple[Path, dict]] = []

    def flush(rows: dict) -> None:
        with engine.begin() as conn:
            for model, items in rows.items():
                if items:
                    conn.execute(tables[model].insert(), items)
        for path, columns in artifact_jobs:
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.table(columns), path)
        artifact_jobs.clear()

    rows: dict = {m: [] for m in tables}
    for index, cell in enumerate(cells):
        run_id = uuid.uuid4().hex
        is_failed = cell.cell_id in failed_ids
        start = t0 + 1000 + index * cell_ms
        run_name = f"{cell.variant or 'cell'}-{cell.cell_id}"
        per_epoch, test, best_val = values.cell(cell, epochs)
        if is_failed:
            per_epoch = per_epoch[: max(1, epochs // 2)]
        end = start + epoch_ms * len(per_epoch) + 5_000
        rows[SqlRun].append(
            {
                "run_uuid": run_id,
                "name": run_name,
                "source_type": "UNKNOWN",
                "source_name": "",
                "entry_point_name": "",
                "user_id": "unknown",
                "status": "FAILED" if is_failed else "FINISHED",
                "start_time": start,
                "end_time": end,
                "deleted_time": None,
                "source_version": "",
                "lifecycle_stage": "active",
                "experiment_id": int(experiment_id),
                "artifact_uri": f"{experiment.artifact_location}/{run_id}/artifacts",
            }
        )
        cell_dict = {
            "config_id": cell.config_id,
            "seed": cell.seed,
            "cell_id": cell.cell_id,
            "variant": cell.variant,
            "swept": cell.swept,
        }
        tags = cell_tags(cell_dict, name, parent_id, session)
        tags.update(CellProvenance.of({"config": cell.config}, ()).tags)  # what its worker would record
        tags["mlflow.runName"] = run_name
        tags[TAG_NODE_ID] = node
        tags[TAG_STATUS] = STATUS_FAILED if is_failed else STATUS_FINISHED
        if not is_failed:
            tags.update(environment_tags())  # where a finished cell trained (this host)
        if is_failed:
            tags[TAG_ERROR] = (
                f"NonFiniteLossError: loss is nan at epoch {len(per_epoch)}, "
                f"step 17 (synthetic failure of cell {cell.cell_id})"
            )
        rows[SqlTag] += [{"key": k, "value": v, "run_uuid": run_id} for k, v in tags.items()]
        params = config_params(cell.config)
        params["seed"] = str(cell.seed)
        rows[SqlParam] += [{"key": k, "value": v, "run_uuid": run_id} for k, v in sorted(params.items())]
        latest: dict[str, dict] = {}

        def metric(key, value, timestamp, step):
            row = {
                "key": key,
                "value": float(value),
                "timestamp": timestamp,
                "step": step,
                "is_nan": False,
                "run_uuid": run_id,
            }
            rows[SqlMetric].append(row)
            previous = latest.get(key)
            if previous is None or (step, timestamp, row["value"]) > (
                previous["step"],
                previous["timestamp"],
                previous["value"],
            ):
                latest[key] = row

        for epoch, metrics in enumerate(per_epoch):
            for key, value in metrics.items():
                metric(key, value, start + epoch_ms * (epoch + 1), epoch)
        if not is_failed:
            last = len(per_epoch) - 1
            final = {f"test/{k}": v for k, v in test.items()}
            best_epoch = max(range(len(per_epoch)), key=lambda e: per_epoch[e]["val/top5"])
            final["best_epoch"] = best_epoch
            final["best_val"] = best_val
            for key, value in final.items():
                metric(key, value, end - 1000, last)
            base = artifact_root / run_id / "artifacts"  # the run's artifact_uri
            artifact_jobs.append((base / PER_CLASS_ARTIFACT, _per_class(values.rng)))
            artifact_jobs.append((base / SET_SIZES_ARTIFACT, _set_sizes(values.rng)))
        rows[SqlLatestMetric] += [dict(r) for r in latest.values()]
        if (index + 1) % chunk == 0:
            flush(rows)
            rows = {m: [] for m in tables}
    flush(rows)
    engine.dispose()
    client.set_terminated(parent_id, "FINISHED" if not failed else "FAILED", end_time=t0 + 1000 + len(cells) * cell_ms)
    return {
        "cells": len(cells),
        "finished": len(cells) - len(failed_ids),
        "failed": len(failed_ids),
        "configs": len({c.config_id for c in cells}),
        "study_file": str(study_file),
        "experiment_id": experiment_id,
        "parent_run_id": parent_id,
        "seconds": time.perf_counter() - started,
    }


# ----------------------------------------------------------------------------- measuring


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 1024.0 if sys.platform != "darwin" else peak / 2**20


def run_step(step: str, uri: str, name: str, study_file: str, out_dir: str) -> dict:
    """One step in this process (called in a fresh subprocess): its seconds and peak MB."""
    import warnings

    warnings.simplefilter("ignore")
    from analysis.collect import collect, collect_histories, export_parquet

    result: dict[str, Any] = {"step": step}
    start = time.perf_counter()
    if step == "collect":
        collected = collect(uri, name)
        result["rows"] = collected.table.num_rows
    elif step == "histories":
        collected = collect(uri, name)
        start = time.perf_counter()
        history = collect_histories(collected, ["val/top5", "epoch_time_s"])
        result["rows"] = history.num_rows
    elif step == "export":
        export_parquet(collect(uri, name), Path(out_dir) / "cells.parquet")
    elif step == "report":
        from analysis.report import build_report

        html = build_report(uri, name, Path(out_dir) / "report", study_file=study_file)
        result["html_mb"] = html.stat().st_size / 2**20
        md = html.with_suffix(".md").read_text(encoding="utf-8")
        result["figures"] = md.count("![")
        result["not_drawn"] = [line for line in md.splitlines() if line.startswith(("Not drawn", "Figure failed"))]
    else:
        raise ValueError(f"unknown step {step!r}")
    result["seconds"] = time.perf_counter() - start
    result["peak_mb"] = _peak_rss_mb()
    return result


def measure(step: str, uri: str, name: str, study_file: str, out_dir: Path, code: Path, timeout: float) -> dict:
    """Run one step in a fresh interpreter importing `analysis` from `code`."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(code), str(REPO)]), MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false"
    )
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--step",
        step,
        "--uri",
        uri,
        "--name",
        name,
        "--study-file",
        study_file,
        "--out",
        str(out_dir),
    ]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"step": step, "error": f"not finished after {timeout:.0f} s", "seconds": time.perf_counter() - started}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"step": step, "error": " | ".join(tail)[-400:], "seconds": time.perf_counter() - started}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _row(cells: int, r: dict) -> str:
    if "error" in r:
        return f"{cells:>7} {r['step']:<10} {'-':>9} {'-':>9}  FAILED: {r['error']}"
    extra = ""
    if r["step"] == "report":
        extra = f"  {r['figures']} figures, html {r['html_mb']:.1f} MB"
        if r.get("not_drawn"):
            extra += "; " + " / ".join(x[:100] for x in r["not_drawn"])
    elif "rows" in r:
        extra = f"  {r['rows']} rows"
    return f"{cells:>7} {r['step']:<10} {r['seconds']:>8.1f}s {r['peak_mb']:>7.0f}MB{extra}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--seeds", type=int, default=SEEDS)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--failed", type=int, default=0, help="cells that end failed")
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    parser.add_argument(
        "--code", type=Path, default=REPO, help="checkout whose `analysis` the steps import (default: this one)"
    )
    parser.add_argument(
        "--keep", type=Path, default=None, help="write the stores here and keep them (default: a temporary folder)"
    )
    parser.add_argument(
        "--reuse", action="store_true", help="with --keep: measure the stores already there (same sizes)"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per step")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    # one step in this process (used by `measure`)
    parser.add_argument("--step", choices=STEPS)
    parser.add_argument("--uri")
    parser.add_argument("--name")
    parser.add_argument("--study-file")
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    if args.step:
        print(json.dumps(run_step(args.step, args.uri, args.name, args.study_file, args.out)))
        return 0

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    root = args.keep or Path(tempfile.mkdtemp(prefix="report-scale-"))
    results = []
    print(f"analysis from {args.code.resolve()}; stores under {root}", flush=True)
    print(f"{'cells':>7} {'step':<10} {'time':>9} {'peak':>9}", flush=True)
    try:
        for n in args.cells:
            name = f"scale_{n}"
            study_dir = root / name
            uri = f"sqlite:///{(study_dir / 'mlflow.db').resolve()}"
            saved = study_dir / "synthesized.json"
            if args.reuse and args.keep is not None and saved.exists():
                info = json.loads(saved.read_text())
                print(f"{info['cells']:>7} {'(reused)':<10}", flush=True)
            else:
                if study_dir.exists():
                    shutil.rmtree(study_dir)
                info = synthesize(uri, study_dir, name, n, seeds=args.seeds, epochs=args.epochs, failed=args.failed)
                saved.write_text(json.dumps(info))
                print(
                    f"{info['cells']:>7} {'synthesize':<10} {info['seconds']:>8.1f}s"
                    f"  {info['configs']} configs, {info['finished']} finished, "
                    f"{info['failed']} failed",
                    flush=True,
                )
            for step in args.steps:
                out = study_dir / f"out_{step}"
                r = measure(step, uri, name, info["study_file"], out, args.code, args.timeout)
                r["cells"] = info["cells"]
                results.append(r)
                print(_row(info["cells"], r), flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
