"""The declarations of setvalued.config and setvalued.losses.parameters are the one source of
the defaults and ranges: the trainer, build_loss, the study validation and the docs agree."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from setvalued.config import DATA_FIELDS, EVAL_FIELDS, MODEL_FIELDS, OPTIM_FIELDS, TOP_FIELDS
from setvalued.losses.parameters import LOSS_PARAMETERS
from setvalued.params import Param, ParameterError
from setvalued.reference_tables import TABLES

DOCS = Path(__file__).resolve().parents[1] / "docs" / "interfaces.md"


@pytest.mark.parametrize("marker", sorted(TABLES))
def test_docs_tables_equal_the_declarations(marker):
    text = DOCS.read_text(encoding="utf-8")
    found = re.search(rf"<!-- generated:{marker} -->\n(.*?)\n<!-- end:{marker} -->", text, re.S)
    assert found, f"docs/interfaces.md has no generated {marker} table"
    assert found.group(1) == TABLES[marker](), "run python -m setvalued.reference_tables and paste its output"


def test_trainer_defaults_are_the_declared_ones():
    from setvalued.training import DEFAULT_CONFIG, resolve_config

    resolved = resolve_config({"loss": {"name": "ce"}})
    for section, fields in (("optim", OPTIM_FIELDS), ("eval", EVAL_FIELDS), ("model", MODEL_FIELDS)):
        for key, param in fields.items():
            assert resolved[section][key] == param.default, f"{section}.{key}"
    for key, param in TOP_FIELDS.items():
        assert DEFAULT_CONFIG[key] == param.default


def test_study_validation_fills_the_declared_defaults():
    from studies.studyfile.trial_config import validate_config

    for data_name, fields in DATA_FIELDS.items():
        config, problems = validate_config(
            {"data": {"name": data_name}, "loss": {"name": "ce"}, "model": {"name": "mlp"}, "eval": {"ks": [1, 5]}}
        )
        assert not problems, problems
        assert config["data"] == {
            key: p.default if key != "name" else data_name for key, p in fields.items() if not p.implicit
        }
    for name, params in LOSS_PARAMETERS.items():
        config, problems = validate_config({"loss": {"name": name}, "eval": {"ks": [1, 5]}})
        assert not problems, (name, problems)
        assert config["loss"] == {"name": name, **{k: p.default for k, p in params.items() if not p.implicit}}


@pytest.mark.parametrize("name", sorted(LOSS_PARAMETERS))
def test_every_declared_range_is_enforced_by_build_loss_and_the_study(name):
    """For every declared bound, a value just outside it is refused by both, naming the parameter."""
    from setvalued.losses import build_loss
    from studies.studyfile.trial_config import validate_config

    context = {"class_counts": [5] * 8, "num_classes": 8, "num_examples": 40}
    for key, param in LOSS_PARAMETERS[name].items():
        outside = []
        if param.low is not None:
            outside.append(param.low if param.low_open else param.low - 1)
        if param.high is not None:
            outside.append(param.high if param.high_open else param.high + 1)
        if param.options is not None:
            outside.append("no-such-option")
        for value in outside:
            with pytest.raises(ParameterError) as err:
                build_loss(name, **{key: value}, **context)
            assert err.value.parameter == key and name in str(err.value)
            _, problems = validate_config({"loss": {"name": name, key: value}})
            assert [p.path for p in problems] == [("loss", key)], problems


def test_an_implicit_parameter_is_in_a_config_only_when_it_differs_from_its_default():
    from studies.studyfile.config_ids import config_id
    from studies.studyfile.trial_config import validate_config

    ids = []
    for loss in (
        {"name": "noised_topk"},
        {"name": "noised_topk", "exact": False},
        {"name": "noised_topk", "exact": True},
    ):
        config, problems = validate_config({"loss": loss})
        assert not problems
        ids.append(config_id(config))
    assert ids[0] == ids[1] != ids[2]


def test_a_loss_constructor_that_drifts_from_its_declaration_is_refused_at_registration():
    from setvalued.losses import SetValuedLoss, register_loss

    class Drifted(SetValuedLoss):
        def __init__(self, k: int = 5, extra: float = 1.0, reduction: str = "mean"):
            super().__init__(reduction)

    with pytest.raises(ValueError, match=r"constructor takes \['k', 'extra'\], the declaration lists \['k'\]"):
        register_loss("drifted", parameters={"k": Param("int", 5, low=1)})(Drifted)


def test_param_check_coerces_and_names_the_parameter():
    assert Param("int", 1, low=1).check("k", 5.0) == 5
    assert Param("float", 1.0, low=0.0).check("eps", 1) == 1.0
    with pytest.raises(ParameterError, match=r"k must be an integer, got 2.5"):
        Param("int", 1, low=1).check("k", 2.5)
    with pytest.raises(ParameterError, match=r"m must be in \[0.0, 1.0\), got 1.0"):
        Param("float", 0.5, low=0.0, high=1.0, high_open=True).check("m", 1.0)
    with pytest.raises(ParameterError, match=r"x must be a list of integers >= 0"):
        Param("list", [], item=Param("int", low=0)).check("x", [1, -1])


def test_validating_a_study_imports_neither_torch_nor_ray():
    code = (
        "import sys; from studies.studyfile.spec import load_study; "
        "from studies.cells.space import expand, format_cells_table; "
        "s = load_study('studies/catalog/quickstart.yaml'); format_cells_table(expand(s), s); "
        "print(sorted(m for m in ('torch', 'ray', 'mlflow', 'optuna') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
