"""Study-file parsing and validation (studies.studyfile.spec, studies.studyfile.expressions).

The malformed corpus (tests/malformed_studies/*.yaml) has, on the first line of each file,
``# what is wrong | path: <YAML path> | expect: <fragment of the message>``.
"""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path

import pytest

from setvalued.paths import deep_merge
from studies.studyfile.expressions import ExpressionError, parse_expression
from studies.studyfile.spec import StudyError, load_study
from studies.studyfile.trial_config import validate_config

CORPUS = sorted((Path(__file__).parent / "malformed_studies").glob("*.yaml"))
HEADER = re.compile(r"^#\s*(?P<what>.+?)\s*\|\s*path:\s*(?P<path>.+?)\s*\|\s*expect:\s*(?P<expect>.+?)\s*$")


def write(tmp_path: Path, text: str, name: str = "study.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- corpus


def test_corpus_is_large_enough_and_annotated():
    assert len(CORPUS) >= 20
    for file in CORPUS:
        first = file.read_text(encoding="utf-8").splitlines()[0]
        assert HEADER.match(first), f"{file.name}: first line must be '# what | path: ... | expect: ...'"


@pytest.mark.parametrize("file", CORPUS, ids=[f.name for f in CORPUS])
def test_malformed_study_gives_one_paragraph_error(file: Path):
    header = HEADER.match(file.read_text(encoding="utf-8").splitlines()[0])
    with pytest.raises(StudyError) as info:
        load_study(file)
    message = str(info.value)
    assert str(file) in message, message
    assert header["path"] in message, message
    assert header["expect"] in message, message
    # one paragraph, no traceback, no chained exception shown to the user
    assert "\n" not in message
    assert "Traceback" not in message and 'File "' not in message
    assert info.value.__suppress_context__ or info.value.__cause__ is None
    assert message.startswith(f"Invalid study file '{file}'")
    assert message.endswith("No trial was started.")


def test_missing_file_names_it(tmp_path: Path):
    with pytest.raises(StudyError, match="no such file") as info:
        load_study(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(info.value)


def test_line_numbers_point_at_the_field(tmp_path: Path):
    path = write(
        tmp_path,
        """\
        name: lines
        base:
          loss: {name: ce}
          optim:
            lr: 0.1
            batch_size: -3
        seeds: [0]
        """,
    )
    with pytest.raises(StudyError) as info:
        load_study(path)
    assert "base.optim.batch_size (line 6)" in str(info.value)


def test_several_problems_in_one_paragraph(tmp_path: Path):
    path = write(
        tmp_path,
        """\
        name: many
        base: {loss: {name: ce}}
        seeds: [0]
        resources: {cpus: 0, gpus: -1}
        max_concurrent: 0
        """,
    )
    message = str(pytest.raises(StudyError, load_study, path).value)
    assert "(3 problems)" in message
    for where in ("resources.cpus (line 4)", "resources.gpus (line 4)", "max_concurrent (line 5)"):
        assert where in message
    assert "\n" not in message


# ----------------------------------------------------------------------------- valid files


QUICK = """\
    name: quick
    description: CE vs noised top-K
    base:
      data: {name: synthetic, num_classes: 20, num_superclasses: 4}
      loss: {name: noised_topk, k: 5, epsilon: 0.2, n_samples: 3}
      optim: {lr: 1e-2, batch_size: 32}
      epochs: 2
      eval: {ks: [1, 5]}
    variants:
      ce: {loss: {name: ce}}
      noised: {}
    design:
      kind: grid
      parameters: {loss.epsilon: [0.1, 1.0]}
      variants: [noised]
    seeds: [0, 1]
    """


def test_valid_study_fills_defaults_and_keeps_source(tmp_path: Path):
    path = write(tmp_path, QUICK)
    study = load_study(path)
    assert study.name == "quick"
    assert study.source_text == path.read_text(encoding="utf-8")
    assert study.path == str(path)
    assert study.variant_names == ["ce", "noised"]
    ce = study.variant_config("ce")
    # a variant that changes loss.name replaces the loss section (no noised_topk parameters)
    assert ce["loss"] == {"name": "ce"}
    noised = study.variant_config("noised")
    assert noised["loss"] == {"name": "noised_topk", "k": 5, "epsilon": 0.2, "n_samples": 3}
    # YAML 1.2 float spelling (PyYAML alone would read "1e-2" as a string)
    assert noised["optim"]["lr"] == 0.01 and isinstance(noised["optim"]["lr"], float)
    # defaults of docs/interfaces.md section 1
    assert noised["optim"]["momentum"] == 0.9 and noised["optim"]["nesterov"] is True
    assert noised["eval"]["selection"] == "val/top5" and noised["device"] == "auto"
    assert noised["data"]["train_size"] == 2000 and noised["model"]["name"] == "mlp"
    # objective defaults to the selection metric; the scheduler to none
    assert study.objective.metric == "val/top5" and study.objective.mode == "max"
    assert study.scheduler.kind == "none"
    assert study.resources.cpus == 1 and study.resources.gpus == 0


def test_loss_defaults_are_filled_from_the_registry(tmp_path: Path):
    import inspect

    from setvalued.losses import LOSSES

    study = load_study(
        write(
            tmp_path,
            """\
        name: defaults
        base: {loss: {name: noised_topk}}
        seeds: [0]
        """,
        )
    )
    params = inspect.signature(LOSSES["noised_topk"].__init__).parameters
    loss = study.variant_config("base")["loss"]
    for name in ("k", "epsilon", "n_samples"):
        assert loss[name] == params[name].default


def test_loss_parameter_types_are_coerced():
    config, problems = validate_config({"loss": {"name": "noised_topk", "k": 5.0, "epsilon": 1}})
    assert problems == []
    assert config["loss"]["k"] == 5 and isinstance(config["loss"]["k"], int)
    assert isinstance(config["loss"]["epsilon"], float)
    _, problems = validate_config({"loss": {"name": "noised_topk", "k": 2.5}})
    assert problems and problems[0].path == ("loss", "k") and "integer" in problems[0].message


def test_real_data_sets_have_their_own_fields():
    config, problems = validate_config(
        {"data": {"name": "cifar100", "label_noise": 0.2}, "model": {"name": "small_cnn"}, "loss": {"name": "ce"}}
    )
    assert problems == []
    assert config["data"]["val_size"] == 5000 and config["data"]["noise_groups"] == "consecutive"
    assert "num_classes" not in config["data"]
    _, problems = validate_config({"data": {"name": "synthetic", "label_noise": 0.2}, "loss": {"name": "ce"}})
    assert problems[0].path == ("data", "label_noise")
    assert "for data set 'synthetic'" in problems[0].message


def test_top_k_larger_than_known_classes_is_rejected():
    _, problems = validate_config(
        {
            "data": {"name": "cifar100"},
            "model": {"name": "small_cnn"},
            "loss": {"name": "ce"},
            "eval": {"ks": [1, 5, 101]},
        }
    )
    assert problems[0].path == ("eval", "ks", 2)


def test_deep_merge_merges_mappings_and_replaces_the_rest():
    base = {"optim": {"lr": 0.1, "milestones": [1, 2]}, "loss": {"name": "a", "k": 3}}
    merged = deep_merge(base, {"optim": {"milestones": [5]}, "loss": {"k": 4}})
    assert merged == {"optim": {"lr": 0.1, "milestones": [5]}, "loss": {"name": "a", "k": 4}}
    assert base["optim"]["milestones"] == [1, 2]  # not mutated
    assert deep_merge(base, {"loss": {"name": "b"}})["loss"] == {"name": "b"}


def test_single_block_design_path_has_no_index(tmp_path: Path):
    path = write(
        tmp_path,
        """\
        name: single-block
        base: {loss: {name: ce}}
        design:
          kind: grid
          parameters: {optim.lr: [0.1, -1.0]}
        seeds: [0]
        """,
    )
    message = str(pytest.raises(StudyError, load_study, path).value)
    assert "design.parameters.optim.lr[1] (line 5)" in message
    assert "greater than 0" in message


def test_report_block_accepts_the_analysis_keys(tmp_path: Path):
    study = load_study(
        write(
            tmp_path,
            textwrap.dedent(QUICK)
            + textwrap.dedent("""\
        report:
          level: 0.9
          ci: bootstrap
          tables: [{metrics: [test/top1, test/top5], columns: variant, digits: 2}]
          curves: [{x: loss.epsilon, metric: test/top5}]
          epoch_time: {x: loss.k}
          shot_groups: [top5, {metric: top1, split: test}]
          compare: {reference: ce, metrics: [test/top5]}
        reference:
          source: Thesis Table 4.4
          rows:
            - {variant: ce, match: {data.label_noise: 0.0}, metrics: {test/top5: 94.2}, ci: {test/top5: 0.1}}
        """),
        )
    )
    assert study.report.level == 0.9 and study.report.tables[0].columns == "variant"
    assert study.reference[0].rows[0].metrics == {"test/top5": 94.2}


# ----------------------------------------------------------------------------- expressions


@pytest.mark.parametrize(
    "text, values, expected",
    [
        ("0.1 * optim.batch_size / 64", {"optim.batch_size": 128}, 0.1 * 128 / 64),
        ("2 ** 10 - 1", {}, 1023),
        ("-(loss.k + 1) // 2 % 7", {"loss.k": 4}, -(4 + 1) // 2 % 7),
        ("max(1, round(log2(a.b)))", {"a.b": 64}, 6),
        ("sqrt(x) + exp(0) + abs(-2) + min(3, 4)", {"x": 9}, 3 + 1 + 2 + 3),
        ("ceil(2.1) + floor(2.9)", {}, 5),
    ],
)
def test_expressions_evaluate_like_python(text, values, expected):
    expr = parse_expression(text)
    assert expr.names == frozenset(values)
    assert math.isclose(expr.evaluate(values), expected)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("__import__('os').system('ls')", "unknown function"),
        ("optim.lr.__class__", None),  # a path, but not in the config: caught at evaluation
        ("(lambda: 1)()", "unknown function"),
        ("[x for x in range(3)]", "unsupported construct"),
        ("a if b else c", "unsupported construct"),
        ("'abc'", "only numbers"),
        ("a[0]", "unsupported construct"),
        ("a < b", "unsupported construct"),
        ("1 +", "syntax error"),
        ("", "empty"),
        ("max", "is a function"),
        ("round(x, ndigits=2)", "keyword"),
    ],
)
def test_expressions_reject_anything_but_arithmetic(text, fragment):
    if fragment is None:
        expr = parse_expression(text)
        with pytest.raises(KeyError):
            expr.evaluate({"optim.lr": 0.1})
        return
    with pytest.raises(ExpressionError, match=re.escape(fragment)):
        parse_expression(text)


def test_expression_power_is_guarded_and_errors_are_clear():
    with pytest.raises(ExpressionError, match="cannot evaluate"):
        parse_expression("10 ** 10 ** 10").evaluate({})
    with pytest.raises(ExpressionError, match="division by zero"):
        parse_expression("1 / x").evaluate({"x": 0})
    with pytest.raises(ExpressionError, match="expected a number"):
        parse_expression("x * 2").evaluate({"x": "abc"})


def test_early_stopping_is_resolved_from_the_objective(tmp_path: Path):
    study = load_study(
        write(
            tmp_path,
            """\
        name: es
        base: {loss: {name: ce}, eval: {ks: [1, 3], selection: val/top3}}
        seeds: [0, 1]
        objective: {metric: val/top1, mode: max}
        scheduler: {kind: early_stopping, patience: 2}
        """,
        )
    )
    assert study.scheduler.metric == "val/top1" and study.scheduler.mode == "max"
    assert study.scheduler.grace_epochs == 5 and study.scheduler.patience == 2


def test_a_mistake_in_base_is_reported_once_for_all_variants(tmp_path: Path):
    path = write(
        tmp_path,
        """\
        name: once
        base:
          loss: {name: noised_topk, k: 5}
          optim: {lr: -1}
        variants:
          a: {}
          b: {loss: {epsilon: 0.3}}
          c: {loss: {name: ce}}
        seeds: [0]
        """,
    )
    message = str(pytest.raises(StudyError, load_study, path).value)
    assert message.count("base.optim.lr (line 4)") == 1 and "problems" not in message


def test_multiple_yaml_documents_are_a_syntax_error(tmp_path: Path):
    path = write(tmp_path, "name: a\nseeds: [0]\n---\nname: b\n")
    with pytest.raises(StudyError, match=r"YAML syntax: .*line 3"):
        load_study(path)


def test_a_misspelt_swept_parameter_is_reported_before_the_curve_that_names_it_right(tmp_path):
    """Issue 33: `loss.epsilion` in the design and a curve on `loss.epsilon` gave only the
    curve's error; the real mistake's message comes first, the curve's after it."""
    path = write(
        tmp_path,
        """\
        name: typo
        base:
          loss: {name: noised_topk, k: 5, epsilon: 0.1}
        design:
          kind: grid
          parameters:
            loss.epsilion: [0.01, 0.1]
        seeds: [0, 1]
        report:
          curves:
            - {x: loss.epsilon, metric: test/top5}
        """,
    )
    with pytest.raises(StudyError) as info:
        load_study(path)
    message = str(info.value)
    real = "loss 'noised_topk' has no parameter 'epsilion' (did you mean 'epsilon'?)"
    assert real in message and "design.parameters.loss.epsilion (line 7)" in message
    assert message.index(real) < message.index("report.curves[0].x (line 11)")
