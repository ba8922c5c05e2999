"""`studies reproduce` (issue 39): the comparison and its verdicts on values written out, the
config a run's params give back for every cell of the catalogue. Training a real cell again is
in tests/test_identity.py (slow)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from studies.running.reproduce import EXIT_CODES, FINAL, compare_metrics, config_of_params, describe

CATALOG = Path(__file__).resolve().parents[1] / "studies" / "catalog"


def values(**per_epoch) -> dict:
    return {(epoch, metric): value for metric, series in per_epoch.items() for epoch, value in series.items()}


def test_identical_within_and_differs_with_the_first_epoch_and_metric():
    old = values(**{"val/top1": {"0": 0.5, "1": 0.6}, "train/loss": {"0": 2.0, "1": 1.5}}) | {
        (FINAL, "test/top1"): 0.55
    }
    same = compare_metrics(old, dict(old), 1e-6)
    assert (same.verdict, same.compared, same.largest) == ("identical", 5, 0.0)
    assert EXIT_CODES[same.verdict] == 0

    close = dict(old) | {("1", "val/top1"): 0.6 + 1e-9, ("0", "train/loss"): 2.0 - 2e-7}
    within = compare_metrics(old, close, 1e-6)
    assert within.verdict == "within" and math.isclose(within.largest, 2e-7, rel_tol=1e-6)
    assert within.largest_at == ("0", "train/loss") and EXIT_CODES["within"] == 3
    assert compare_metrics(old, close, 1e-8).verdict == "differs"  # |2e-7| > 1e-8 x max(1, 2.0)

    moved = dict(old) | {("1", "train/loss"): 1.4, ("1", "val/top1"): 0.7, (FINAL, "test/top1"): 0.1}
    differs = compare_metrics(old, moved, 1e-6)
    assert differs.verdict == "differs" and differs.first_differing == ("1", "train/loss", 1.5, 1.4)
    assert math.isclose(differs.largest, 0.45) and differs.largest_at == (FINAL, "test/top1")
    assert "first at epoch 1, train/loss: 1.5 -> 1.4" in describe(differs, 1e-6)[-1]


def test_a_value_not_produced_again_differs_and_nan_equals_nan():
    old = {("0", "val/top1"): 0.5, ("1", "val/top1"): math.nan}
    found = compare_metrics(old, {("1", "val/top1"): math.nan}, 1e-6)
    assert found.verdict == "differs" and found.missing == [("0", "val/top1")]
    assert "epoch 0, val/top1: 0.5 -> (absent)" in describe(found, 1e-6)[-1]
    assert compare_metrics({("1", "x"): math.nan}, {("1", "x"): math.nan}, 0).verdict == "identical"
    assert compare_metrics({(FINAL, "x"): 1.0}, {(FINAL, "x"): math.inf}, 1.0).verdict == "differs"


@pytest.mark.parametrize("path", sorted(CATALOG.glob("*.yaml")), ids=lambda p: p.stem)
def test_a_runs_params_give_back_the_config_the_trainer_took(path):
    from setvalued.training.setup import resolve_config
    from studies.cells.space import expand, smoke_cells
    from studies.studyfile.spec import load_study
    from studies.tracking import config_params

    cells = expand(load_study(path))
    for cell in [*cells[:20], *smoke_cells(cells[:5])]:
        assert resolve_config(config_of_params(config_params(cell.config))) == resolve_config(cell.config)
