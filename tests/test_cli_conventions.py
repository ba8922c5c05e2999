"""The conventions a user brings from other tools: "did you mean" on a mistyped field,
`studies --version`, metric paths of the `report:` block checked at load, command-line
overrides (`key=value`, `--set`) and `studies show`; each through the real command on real
study files."""

from __future__ import annotations

from pathlib import Path

import pytest

from studies.cli import main

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "studies" / "catalog" / "quickstart.yaml"


def quickstart_with(tmp_path: Path, old: str, new: str) -> Path:
    """The quickstart study file with one piece of text replaced."""
    text = QUICKSTART.read_text()
    assert old in text
    path = tmp_path / "study.yaml"
    path.write_text(text.replace(old, new, 1))
    return path


def refused(capsys, *argv: str) -> str:
    """Run the command, expect exit 2 and one paragraph on stderr; return it."""
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    return captured.err


def test_a_mistyped_top_level_field_points_to_the_right_one(tmp_path, capsys):
    path = quickstart_with(tmp_path, "seeds: [0, 1, 2]", "seed: [0, 1, 2]")
    err = refused(capsys, "run", str(path), "--dry-run")
    assert str(path) in err and "unknown field 'seed' (did you mean 'seeds'?)" in err


def test_a_mistyped_config_field_and_loss_parameter_point_to_the_right_ones(tmp_path, capsys):
    path = quickstart_with(tmp_path, "    momentum: 0.9", "    momentun: 0.9")
    assert "base.optim.momentun" in (err := refused(capsys, "run", str(path), "--dry-run"))
    assert "(did you mean 'momentum'?)" in err
    path = quickstart_with(tmp_path, "k: 5, epsilon: 0.1", "k: 5, epsilom: 0.1")
    err = refused(capsys, "run", str(path), "--dry-run")
    assert "has no parameter 'epsilom' (did you mean 'epsilon'?)" in err


def test_an_unknown_field_far_from_every_name_gets_no_guess(tmp_path, capsys):
    path = quickstart_with(tmp_path, "seeds: [0, 1, 2]", "seeds: [0, 1, 2]\nzzzqqq: 1")
    err = refused(capsys, "run", str(path), "--dry-run")
    assert "unknown field 'zzzqqq'" in err and "did you mean" not in err


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("studies ") and out.split()[1][0].isdigit()


def test_a_metric_typo_in_the_report_block_is_refused_at_load(tmp_path, capsys):
    path = quickstart_with(tmp_path, "metrics: [test/top1, test/top5]", "metrics: [test/top1, tset/top5]")
    err = refused(capsys, "run", str(path), "--dry-run")
    assert "report.tables[0].metrics[1]" in err and "(line 81)" in err
    assert "'tset/top5' (did you mean 'test/top5'?)" in err and "split/[few|medium|many" in err
    path = quickstart_with(tmp_path, "{x: loss.epsilon, metric: test/top5}", "{x: loss.epsilon, metric: test/top7}")
    err = refused(capsys, "run", str(path), "--dry-run")
    assert "report.curves[0].metric" in err and "needs K=7 in eval.ks" in err


def test_the_report_blocks_extra_metrics_pass(tmp_path, capsys):
    path = quickstart_with(tmp_path, "metrics: [test/top1, test/top5]",
                           "metrics: [test/top1, test/few/top5, test/macro_top5, best_val, epoch_time_s]")
    assert main(["run", str(path), "--dry-run"]) == 0
