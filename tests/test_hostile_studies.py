"""Hostile study files: each is refused with a clear message naming the file and the field,
exit code 2 and no traceback, without hanging or eating memory (issue: a small file must not
make validation run for hours or take gigabytes).

The files are written by the test (some are large or generated); each case gives the text, the
YAML path expected in the message and a fragment of the message. ``studies run FILE --dry-run``
runs in a subprocess under a wall-clock guard (60 s, far above the ~1 s they take: a guard
against hangs, not a timing test) and its own peak memory is read from the kernel's accounting
(tests/measured_process.py: forked from a small wrapper, not from pytest, whose high-water mark
a child would otherwise inherit).
"""

from __future__ import annotations

import pytest

from tests.measured_process import run_measured

PEAK_MEMORY_LIMIT_MB = 500


def _alias_bomb() -> str:
    lines = [
        "name: alias_bomb",
        "base: {loss: {name: ce}}",
        "seeds: [0]",
        'a0: &a0 ["x","x","x","x","x","x","x","x","x"]',
    ]
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    return "\n".join(lines) + "\n"


_GRID = "\n".join(
    f"    {p}: [{', '.join(str(v) for v in range(1, 11))}]"
    for p in (
        "optim.batch_size",
        "epochs",
        "model.hidden_dim",
        "data.train_size",
        "data.test_size",
        "data.feature_dim",
        "data.num_classes",
        "loss.k",
        "optim.milestones",
    )
)

CASES = {
    "grid_of_a_billion_cells": (
        f"name: g\nbase: {{loss: {{name: noised_topk}}}}\ndesign:\n  kind: grid\n  parameters:\n{_GRID}\nseeds: [0]\n",
        "design (line 3)",
        "the design has 1,000,000,000 cells",
    ),
    "random_design_of_a_billion_configs": (
        "name: r\nbase: {loss: {name: noised_topk}}\n"
        "design: {kind: random, n_configs: 1000000000, parameters: {loss.epsilon: {uniform: [0.0, 1.0]}}}\n"
        "seeds: [0, 1]\n",
        "design",
        "more than the limit of 100,000",
    ),
    "yaml_alias_bomb": (_alias_bomb(), "YAML", "expands to more than 200,000 values"),
    "deeply_nested_yaml": (
        "name: d\nbase: {loss: {name: ce}}\nseeds: [0]\nx: " + "[" * 20000 + "]" * 20000 + "\n",
        "YAML",
        "nested more than 32 levels deep",
    ),
    "huge_file_of_seeds": (
        "name: s\nbase: {loss: {name: ce}}\nseeds: [" + ",".join(map(str, range(100000))) + "]\n",
        "(file)",
        "larger than 524,288 characters",
    ),
    "too_many_seeds": (
        "name: s\nbase: {loss: {name: ce}}\nseeds: [" + ",".join(map(str, range(20000))) + "]\n",
        "seeds",
        "at most 10000 items",
    ),
    "integer_of_5000_digits": (
        "name: b\nbase: {loss: {name: ce}, epochs: " + "9" * 5000 + "}\nseeds: [0]\n",
        "YAML",
        "unreadable value",
    ),
    "tower_of_powers": (
        'name: p\nbase: {loss: {name: ce}}\nderived: {optim.lr: "9 ** 9 ** 9 ** 9 ** 9"}\nseeds: [0]\n',
        "derived.optim.lr",
        "overflows",
    ),
    "exact_integer_power_that_takes_minutes": (
        'name: p\nbase: {loss: {name: ce}}\nderived: {optim.lr: "((((99999 ** 64) ** 64) ** 64) ** 64)"}\nseeds: [0]\n',
        "derived.optim.lr",
        "overflows",
    ),
    "loguniform_on_an_integer_field": (
        "name: o\nbase: {loss: {name: noised_topk}}\n"
        "design: {kind: optuna, n_configs: 4, parameters: {loss.n_samples: {loguniform: [1, 10]}}}\nseeds: [0]\n",
        "design.parameters.loss.n_samples",
        "is an integer: sample it with int",
    ),
    "uniform_on_a_boolean_field": (
        "name: o\nbase: {loss: {name: smooth_topk_svm}}\n"
        "design: {kind: random, n_configs: 4, parameters: {loss.hard_switch: {uniform: [0, 1]}}}\nseeds: [0]\n",
        "design.parameters.loss.hard_switch",
        "sample it with choice",
    ),
    "a_billionth_of_a_cpu": (
        "name: c\nbase: {loss: {name: ce}}\nseeds: [0]\nresources: {cpus: 1.0e-9}\n",
        "resources.cpus",
        "at least 0.0001",
    ),
    "unbounded_retries": (
        "name: m\nbase: {loss: {name: ce}}\nseeds: [0]\nmax_failures: 1000000\n",
        "max_failures",
        "less than or equal to 10",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_study_is_refused_quickly_and_cleanly(case, tmp_path):
    text, path, fragment = CASES[case]
    file = tmp_path / f"{case}.yaml"
    file.write_text(text, encoding="utf-8")
    result = run_measured("run", str(file), "--dry-run", "--output", str(tmp_path / "out"), timeout=60)
    assert result.code == 2, result.out + result.err
    message = result.err.strip()
    assert "Traceback" not in result.err and message.count("\n") == 0, result.err
    assert str(file) in message and path in message and fragment in message, message
    assert result.peak_mb < PEAK_MEMORY_LIMIT_MB, f"{case}: {result.peak_mb:.0f} MB"


def test_the_cell_limit_can_be_raised_by_the_file(tmp_path):
    from studies.studyfile.spec import StudyError, load_study

    text = (
        "name: big\nbase: {loss: {name: noised_topk}}\n"
        "design: {kind: random, n_configs: 60000, parameters: {loss.epsilon: {uniform: [0.0, 1.0]}}}\n"
        "seeds: [0, 1]\n"
    )
    file = tmp_path / "big.yaml"
    file.write_text(text + "max_cells: 10\n", encoding="utf-8")
    with pytest.raises(StudyError, match="120,000 cells .* more than the limit of 10;"):
        load_study(file)
    with pytest.raises(StudyError, match="more than the limit of 100;"):
        load_study(file, max_cells=100)
