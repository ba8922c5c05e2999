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
    path = quickstart_with(
        tmp_path,
        "metrics: [test/top1, test/top5]",
        "metrics: [test/top1, test/few/top5, test/macro_top5, best_val, epoch_time_s]",
    )
    assert main(["run", str(path), "--dry-run"]) == 0


def test_overrides_change_the_study_and_are_checked_by_the_same_schema(tmp_path, capsys):
    args = ["run", str(QUICKSTART), "--dry-run"]
    assert main(args + ["seeds=[0]", "--set", "design.1.parameters.loss.epsilon=[0.5, 2.0]"]) == 0
    table = capsys.readouterr().out
    assert "4 cells = 4 configs x 1 seed" in table
    assert sorted(line.split()[-2] for line in table.splitlines() if "noised_topk" in line) == ["0.5", "2"]
    err = refused(capsys, *args, "optim.lr=-1")  # inside base; the same message as in the file
    assert "base.optim.lr (override optim.lr=-1): expected greater than 0, got -1" in err
    err = refused(capsys, *args, "--set", "optim.lrr=0.1")
    assert "base.optim.lrr (override optim.lrr=0.1): unknown field 'lrr' (did you mean 'lr'?)" in err
    err = refused(capsys, *args, "design.5.kind=grid")
    assert "override design.5.kind=grid: design[5] is not in the file (design is a list of 2)" in err
    err = refused(capsys, *args, "--set", "seeds")
    assert "override 'seeds': expected KEY=VALUE" in err


def test_an_override_is_validated_where_the_file_wrote_the_value(tmp_path, capsys):
    from studies.studyfile.spec import load_study

    study = load_study(QUICKSTART, overrides=["variants.noised_topk.loss.epsilon=0.5", "optim.lr=0.05"])
    assert study.variant_value("noised_topk", "loss.epsilon") == 0.5
    assert {study.variant_value(v, "optim.lr") for v in study.variant_names} == {0.05}
    assert "#   optim.lr=0.05" in study.source_text  # the resolved file says where it came from
    again = load_study(_write(tmp_path / "resolved.yaml", study.source_text))
    assert [c.config_id for c in again.designed_configs] == [c.config_id for c in study.designed_configs]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_show_prints_the_resolved_config_of_a_variant(capsys):
    import yaml

    assert main(["show", str(QUICKSTART), "noised_topk", "optim.lr=0.05"]) == 0
    out = capsys.readouterr().out
    config = yaml.safe_load(out)
    assert config["optim"]["lr"] == 0.05 and config["loss"]["name"] == "noised_topk"
    assert config["optim"]["batch_size"] == 64 and "selection" in config["eval"]  # defaults filled in
    assert out.count("# variant ") == 1
    assert main(["show", str(QUICKSTART)]) == 0
    assert capsys.readouterr().out.count("# variant ") == 3
    err = refused(capsys, "show", str(QUICKSTART), "noised")
    assert "unknown variant 'noised' (did you mean 'noised_topk'?)" in err


def test_the_console_script_leaves_its_heap_to_the_exit(tmp_path):
    """The `studies` script (pyproject's entry point) freezes the heap once its command is done,
    so that the interpreter's last collections do not add a second to every command (issue 42,
    benchmarks/startup.py); `main` itself, which tests and notebooks call, does not."""
    import subprocess
    import sys

    import tomllib

    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["studies"]
    module, function = target.split(":")
    code = (
        f"import gc, sys; from {module} import {function} as entry; from studies.cli import main; "
        "sys.argv = ['studies', 'run', sys.argv[1], '--dry-run']; code = main(sys.argv[1:]); "
        "frozen_by_main = gc.get_freeze_count(); code = entry(); print(frozen_by_main, gc.get_freeze_count(), code)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(QUICKSTART)], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    by_main, by_script, exit_code = (int(x) for x in done.stdout.split()[-3:])
    assert exit_code == 0 and by_main == 0 and by_script > 0, done.stderr[-2000:]


@pytest.mark.parametrize("path", sorted((REPO / "studies" / "catalog").glob("*.yaml")), ids=lambda p: p.stem)
def test_show_prints_only_the_fields_that_apply_and_keeps_every_config_id(path, capsys):
    """`studies show` of an MLP printed the DenseNet's depth and growth rate (issue 42): each
    variant now shows the fields that apply to it (its MLflow params, `effective_config`), and on
    every catalogue file that is the whole config: filled in again, it has the variant's config
    id, so the catalogue's ids stay as they were."""
    import yaml

    from setvalued.config import FIELD_APPLIES
    from studies.studyfile.config_ids import config_id
    from studies.studyfile.spec import load_study
    from studies.studyfile.trial_config import validate_config

    study = load_study(path)
    assert main(["show", str(path)]) == 0
    shown = [yaml.safe_load(part.split("\n", 1)[1]) for part in capsys.readouterr().out.split("# variant ")[1:]]
    assert len(shown) == len(study.variant_names)
    for name, config in zip(study.variant_names, shown):
        for (section, field), applies in FIELD_APPLIES.items():
            holder = config if section == "" else config.get(section, {})
            assert field not in holder or applies(holder), (name, section, field)
        if config["model"]["name"] in ("mlp", "small_cnn") or config["model"]["name"].startswith("resnet"):
            assert "depth" not in config["model"] and "growth_rate" not in config["model"]
        filled, problems = validate_config(config)
        assert problems == [] and config_id(filled) == config_id(study.variant_config(name)), name
