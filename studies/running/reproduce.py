"""`studies reproduce NAME --cell CELL`: train one finished cell again and compare every metric.

The cell's finished run gives its trial config (its params, the config as the trainer took it),
its seed, the epoch a config-level rule stopped it at (`TAG_STOPPED_EPOCH`) and, for a member of
a fused array, the array's seeds (`TAG_ARRAY`): the cell is trained again the same way, in this
process (no Ray, no MLflow write), with ``TMPDIR`` in a scratch folder; nothing of the study is
touched. Every per-epoch metric the run recorded (step = epoch) and every final one (``test/*``,
``best_epoch``, ``best_val``) is compared with the new value, times left out (`TIME_METRICS`).

The verdict, and the exit code: ``identical`` (every value equal, bit for bit: 0), ``within``
the tolerance (|new - old| <= tolerance x max(1, |old|) for every value: 3), or ``differs``
(1), naming the first epoch and metric that differ. What trains the cell today (code, plugins,
data: `studies.tracking.provenance`) is compared with what the run recorded first, and each
change is said: a difference may come from it.

What it proves: the same code, data, seed and configuration give these numbers on this machine.
Bit-identical numbers are expected on the same hardware and software for CPU trials; on a GPU,
cuDNN's benchmark mode (on for CUDA trials) picks convolution algorithms by timing and
reductions may run in another order, so small differences within the tolerance are the rule,
and across GPU models, drivers, CUDA or torch versions larger ones may come: a ``differs`` there
says the numbers moved, not which component moved them.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

from studies.errors import RunnerError

__all__ = ["Comparison", "reproduce_cell", "compare_metrics", "DEFAULT_TOLERANCE", "EXIT_CODES"]

#: the default relative tolerance (of max(1, |old|)) of ``within``
DEFAULT_TOLERANCE = 1e-6
#: the exit code of each verdict
EXIT_CODES = {"identical": 0, "within": 3, "differs": 1}
#: where final metrics are compared (they have no epoch of their own)
FINAL = "final"


@dataclass
class Comparison:
    """The metrics of the original run and of the rerun, compared."""

    compared: int = 0
    largest: float = 0.0
    largest_at: tuple[str, str] | None = None  # (epoch, metric)
    first_differing: tuple[str, str, float | None, float | None] | None = None  # epoch, metric, old, new
    missing: list[tuple[str, str]] = field(default_factory=list)  # recorded, not produced again
    unrecorded: int = 0  # values produced that the run did not record (a metric added since)
    verdict: str = "identical"


def _order(epoch: str) -> tuple[int, int]:
    return (1, 0) if epoch == FINAL else (0, int(epoch))


def compare_metrics(
    old: Mapping[tuple[str, str], float], new: Mapping[tuple[str, str], float], tolerance: float
) -> Comparison:
    """Compare the recorded values ``old`` with ``new``, keyed by (epoch or `FINAL`, metric):
    the largest difference, the first (by epoch, then metric) beyond ``tolerance`` x
    max(1, |old|) or not produced again, and the verdict. A value the run did not record (a
    metric the trainer added since) is counted, not compared."""
    found = Comparison(unrecorded=len(set(new) - set(old)))
    exact = True
    for key in sorted(old, key=lambda k: (_order(k[0]), k[1])):
        a, b = old[key], new.get(key)
        if b is None:
            found.missing.append(key)
            if found.first_differing is None:
                found.first_differing = (key[0], key[1], a, b)
            exact = False
            continue
        found.compared += 1
        if a == b or (math.isnan(a) and math.isnan(b)):
            continue
        exact = False
        gap = abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf
        if gap > found.largest or found.largest_at is None:
            found.largest, found.largest_at = gap, key
        if gap > tolerance * max(1.0, abs(a)) and found.first_differing is None:
            found.first_differing = (key[0], key[1], a, b)
    found.verdict = "identical" if exact else ("within" if found.first_differing is None else "differs")
    return found


# ----------------------------------------------------------------------------- the original run


def _find_run(client: Any, experiment_id: str, cell: str) -> Any:
    """The latest finished run of the cell (by cell id, else by run name); RunnerError listing
    near cell ids when there is none."""
    from analysis.collect import search_all_runs
    from analysis.layout import ROLE_CELL, STATUS_FINISHED, TAG_CELL_ID, TAG_ROLE, TAG_STATUS, tag_filter

    wanted = {TAG_ROLE: ROLE_CELL, TAG_STATUS: STATUS_FINISHED}
    runs = list(search_all_runs(client, experiment_id, tag_filter({**wanted, TAG_CELL_ID: cell}), 100))
    if not runs:
        runs = list(search_all_runs(client, experiment_id, tag_filter({**wanted, "mlflow.runName": cell}), 100))
    if runs:
        return max(runs, key=lambda r: (r.info.end_time or 0, r.info.start_time or 0))
    import difflib

    known = sorted(
        {r.data.tags.get(TAG_CELL_ID, "") for r in search_all_runs(client, experiment_id, tag_filter(wanted), 1000)}
    )
    near = difflib.get_close_matches(cell, known, n=5, cutoff=0.3) or known[:5]
    raise RunnerError(
        f"no finished cell {cell!r} in this study; expected a cell id or run name of a finished cell"
        + (f", e.g. {', '.join(near)}" if near else " (it has none)")
    )


def _recorded(client: Any, run: Any) -> dict[tuple[str, str], float]:
    """The run's values by (epoch or FINAL, metric), times left out: per-epoch metrics by their
    step; test metrics and the selection's result as final."""
    from setvalued.metrics import TIME_METRICS

    values: dict[tuple[str, str], float] = {}
    for key in run.data.metrics:
        if key in TIME_METRICS:
            continue
        history = client.get_metric_history(run.info.run_id, key)
        if key.startswith("test/") or key in ("best_epoch", "best_val"):
            values[(FINAL, key)] = float(history[-1].value) if history else float(run.data.metrics[key])
        else:
            for point in history:
                values[(str(int(point.step)), key)] = float(point.value)
    return values


# ----------------------------------------------------------------------------- training again


def _produced(epochs: list[tuple[int, Mapping[str, Any]]], result: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    from setvalued.metrics import TIME_METRICS
    from studies.running.trial import numeric_metrics

    values: dict[tuple[str, str], float] = {}
    for epoch, metrics in epochs:
        for key, value in numeric_metrics(metrics).items():
            if key not in TIME_METRICS and key != "epoch":
                values[(str(int(epoch)), key)] = value
    for key, value in numeric_metrics(result.get("test") or {}).items():
        values[(FINAL, f"test/{key}")] = value
    for key in ("best_epoch", "best_val"):
        if result.get(key) is not None:
            values[(FINAL, key)] = float(result[key])
    return values


class _Stop(Exception):
    pass


def _train(config: dict, seed: int, stopped: int | None, array: Mapping[str, Any] | None) -> tuple[list, dict]:
    """(per-epoch metrics, fit's result) of the cell trained as its run was: alone or in its
    fused array, stopped where a config-level rule stopped it."""
    if array is not None:
        from setvalued.fused import STOP, fit_array

        member = int(array["member"])
        epochs: list = []

        def on_member(i: int, epoch: int, metrics: Mapping[str, Any], state: Any) -> None:
            if i == member:
                epochs.append((epoch, dict(metrics)))

        def after(epoch: int) -> Any:
            return STOP if stopped is not None and epoch + 1 >= stopped else None

        results = fit_array(config, [int(s) for s in array["seeds"]], on_epoch=on_member, after_epoch=after)
        if isinstance(results[member], BaseException):
            raise results[member]
        return epochs, results[member]
    from setvalued.training import fit
    from studies.running.trial import with_epochs

    epochs, last = [], {}

    def on_epoch(epoch: int, metrics: Mapping[str, Any], state: Any) -> None:
        epochs.append((epoch, dict(metrics)))
        last["state"] = state
        if stopped is not None and epoch + 1 >= stopped:
            raise _Stop

    try:
        return epochs, fit(config, seed, on_epoch=on_epoch)
    except _Stop:
        truncated = {**config, "epochs": stopped}
        return epochs, fit(truncated, seed, checkpoint=with_epochs(last["state"], cast(int, stopped)))  # set by _Stop


def reproduce_cell(
    name: str,
    cell: str,
    *,
    output: Path | None = None,
    tracking_uri: str | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    stream: IO[str] | None = None,
) -> tuple[str, Comparison]:
    """Train the finished cell ``cell`` (a cell id or run name) of study ``name`` again and
    compare (module docstring); prints what it does and the verdict; returns (verdict,
    comparison). RunnerError / ReadBackError for an unknown study or cell."""
    import sys

    from mlflow import MlflowClient

    from analysis.layout import TAG_ARRAY, TAG_CELL_ID, TAG_SEED, TAG_STOPPED_EPOCH
    from studies.api import locate
    from studies.tracking.contract import config_of_params
    from studies.tracking.provenance import read_identity
    from studies.tracking.retry import with_retry

    stream = stream or sys.stdout
    _, uri = locate(name, output=output, tracking_uri=tracking_uri)
    client = MlflowClient(uri)
    experiment = with_retry(lambda: client.get_experiment_by_name(name))
    if experiment is None:
        raise RunnerError(f"study {name!r} has no experiment in {uri}")
    run = with_retry(lambda: _find_run(client, experiment.experiment_id, cell))
    tags = run.data.tags
    config, seed = config_of_params(run.data.params), int(tags[TAG_SEED])
    stopped = int(tags[TAG_STOPPED_EPOCH]) if tags.get(TAG_STOPPED_EPOCH) else None
    array = json.loads(tags[TAG_ARRAY]) if tags.get(TAG_ARRAY) else None
    print(
        f"cell {tags.get(TAG_CELL_ID)} ({tags.get('mlflow.runName', '')}), run {run.info.run_id}, seed {seed}"
        + (f", stopped after epoch {stopped}" if stopped else "")
        + (f", member {array['member']} of fused array {array['array']}" if array else ""),
        file=stream,
        flush=True,
    )
    recorded = read_identity(tags)
    today = _today_identity(config)
    for item in sorted(set(recorded) | set(today)):
        old, new = recorded.get(item), today.get(item)
        if old is None or new is None or old[0] != new[0]:
            print(
                f"  note: {item} differs from what trained it: {old[1] if old else '(not recorded)'} -> "
                f"{new[1] if new else '(none)'}",
                file=stream,
                flush=True,
            )
    old_values = with_retry(lambda: _recorded(client, run))
    with tempfile.TemporaryDirectory(prefix="studies-reproduce-") as scratch:
        print(f"training it again in {scratch} (nothing of the study is written)", file=stream, flush=True)
        saved = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = scratch
        tempfile.tempdir = None
        try:
            epochs, result = _train(config, seed, stopped, array)
        finally:
            if saved is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = saved
            tempfile.tempdir = None
    found = compare_metrics(old_values, _produced(epochs, result), tolerance)
    for line in describe(found, tolerance):
        print(line, file=stream, flush=True)
    return found.verdict, found


def _today_identity(config: Mapping[str, Any]) -> dict[str, list[str]]:
    """What would train the config today (its data fingerprinted through the cache)."""
    from studies.tracking.provenance import cell_identity, data_of

    return cell_identity(config, data_of(config.get("data") or {}, {}))


def describe(found: Comparison, tolerance: float) -> list[str]:
    """The comparison in a few lines: what was compared, the largest difference, the verdict."""
    lines = [
        f"compared {found.compared:,} recorded values (per-epoch and final metrics, times left out); "
        f"largest difference {found.largest:.3g}"
        + (f" ({found.largest_at[1]} at epoch {found.largest_at[0]})" if found.largest_at else "")
        + (f"; {found.unrecorded:,} values the run did not record left out" if found.unrecorded else "")
    ]
    if found.verdict == "identical":
        lines.append("verdict: identical (every value equal, bit for bit)")
    elif found.verdict == "within":
        lines.append(f"verdict: within the tolerance {tolerance:g} (|new - old| <= {tolerance:g} x max(1, |old|))")
    else:
        epoch, metric, old, new = found.first_differing or ("?", "?", None, None)
        where = "the final metrics" if epoch == FINAL else f"epoch {epoch}"
        lines.append(
            f"verdict: differs; first at {where}, {metric}: {old if old is not None else '(absent)'} -> "
            f"{new if new is not None else '(absent)'} (tolerance {tolerance:g})"
        )
    return lines
