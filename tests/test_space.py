"""Expansion of studies into cells (studies.cells.space): counts, pairing, derived values, ids."""

from __future__ import annotations

import collections
import hashlib
import json
import math
import textwrap
from pathlib import Path

import pytest

from setvalued.paths import get_path
from studies.cells.space import (
    Cell,
    canonical_json,
    config_id,
    expand,
    format_cells_table,
    optuna_block_suggest,
    smoke_cells,
    smoke_config,
)
from studies.studyfile.spec import StudyError, load_study

BASE = """\
    base:
      data: {name: synthetic, num_classes: 30, num_superclasses: 5}
      loss: {name: noised_topk, k: 5, epsilon: 0.2, n_samples: 3}
      optim: {lr: 0.1, batch_size: 64}
      epochs: 2
      eval: {ks: [1, 5]}
"""


def study_from(tmp_path: Path, body: str, name: str = "s", file: str = "study.yaml"):
    text = f"name: {name}\n" + textwrap.dedent(BASE) + textwrap.dedent(body)
    path = tmp_path / file
    path.write_text(text, encoding="utf-8")
    return load_study(path)


def configs(cells: list[Cell]) -> dict[str, Cell]:
    """First cell of each config_id."""
    out: dict[str, Cell] = {}
    for cell in cells:
        out.setdefault(cell.config_id, cell)
    return out


def assert_paired(cells: list[Cell], seeds: list[int]) -> None:
    by_config = collections.defaultdict(list)
    for cell in cells:
        by_config[cell.config_id].append(cell.seed)
    for seeds_of_config in by_config.values():
        assert seeds_of_config == seeds  # every config gets exactly the same seeds, in order
    assert len({c.cell_id for c in cells}) == len(cells)


# ----------------------------------------------------------------------------- counts


def test_grid_is_the_cartesian_product(tmp_path: Path):
    study = study_from(
        tmp_path,
        """\
        design:
          - kind: grid
            parameters:
              loss.epsilon: [0.01, 0.1, 1.0]
              optim.batch_size: [32, 64]
        seeds: [0, 1, 2, 3]
        """,
    )
    cells = expand(study)
    assert len(cells) == 3 * 2 * 4
    assert_paired(cells, [0, 1, 2, 3])
    got = {(c.config["loss"]["epsilon"], c.config["optim"]["batch_size"]) for c in cells}
    assert got == {(e, b) for e in (0.01, 0.1, 1.0) for b in (32, 64)}
    for cell in cells:  # swept values are the config's values
        assert cell.swept == {
            "loss.epsilon": cell.config["loss"]["epsilon"],
            "optim.batch_size": cell.config["optim"]["batch_size"],
        }
        assert cell.variant == "base"


def test_sensitivity_varies_one_parameter_and_includes_the_base_once(tmp_path: Path):
    study = study_from(
        tmp_path,
        """\
        design:
          - kind: sensitivity
            parameters:
              loss.epsilon: [0.05, 0.2, 1.0]     # 0.2 is the base value
              loss.n_samples: [1, 10]
        seeds: [7, 8]
        """,
    )
    cells = expand(study)
    per_config = configs(cells)
    assert len(per_config) == 1 + 2 + 2  # base + other epsilons + n_samples values
    assert len(cells) == 5 * 2
    assert_paired(cells, [7, 8])
    base = [c for c in per_config.values() if c.config["loss"]["epsilon"] == 0.2 and c.config["loss"]["n_samples"] == 3]
    assert len(base) == 1
    assert base[0].swept == {"loss.epsilon": 0.2, "loss.n_samples": 3}
    for cell in per_config.values():  # one parameter at a time: the other stays at its base
        if cell.config["loss"]["epsilon"] != 0.2:
            assert cell.config["loss"]["n_samples"] == 3 and cell.swept == {
                "loss.epsilon": cell.config["loss"]["epsilon"]
            }
        if cell.config["loss"]["n_samples"] != 3:
            assert cell.config["loss"]["epsilon"] == 0.2


def test_variants_times_grid(tmp_path: Path):
    study = study_from(
        tmp_path,
        """\
        variants:
          noised: {}
          noised_big_m: {loss: {n_samples: 20}}
          svm: {loss: {name: smooth_topk_svm, k: 5, tau: 1.0}}
          ce: {loss: {name: ce}}
        design:
          - kind: grid
            variants: [noised, noised_big_m]
            parameters: {loss.epsilon: [0.1, 1.0, 10.0]}
          - kind: grid
            variants: [svm]
            parameters: {loss.tau: [0.1, 1.0]}
          - kind: single
            variants: [ce]
        seeds: [0, 1, 2]
        """,
    )
    cells = expand(study)
    per_config = configs(cells)
    counts = collections.Counter(c.variant for c in per_config.values())
    assert counts == {"noised": 3, "noised_big_m": 3, "svm": 2, "ce": 1}
    assert len(cells) == 9 * 3
    assert_paired(cells, [0, 1, 2])
    big_m = [c for c in per_config.values() if c.variant == "noised_big_m"]
    assert all(c.config["loss"]["n_samples"] == 20 for c in big_m)
    ce = [c for c in per_config.values() if c.variant == "ce"][0]
    assert ce.config["loss"] == {"name": "ce"} and ce.swept == {}


def test_random_design_is_deterministic_and_within_bounds(tmp_path: Path):
    body = """\
        variants:
          a: {}
          b: {loss: {k: 3}}
        design:
          - kind: random
            n_configs: 6
            sampler_seed: 3
            parameters:
              optim.lr: {loguniform: [1.0e-3, 1.0]}
              loss.epsilon: {uniform: [0, 2]}
              loss.n_samples: {int: [1, 4]}
              optim.nesterov: {choice: [true, false]}
        seeds: [0, 1]
        """
    cells = expand(study_from(tmp_path, body))
    per_config = configs(cells)
    assert len(per_config) == 6 * 2 and len(cells) == 6 * 2 * 2
    assert_paired(cells, [0, 1])
    for cell in per_config.values():
        loss, optim = cell.config["loss"], cell.config["optim"]
        assert 1e-3 <= optim["lr"] <= 1.0 and 0 <= loss["epsilon"] <= 2
        assert loss["n_samples"] in (1, 2, 3, 4) and optim["nesterov"] in (True, False)
        assert set(cell.swept) == {"optim.lr", "loss.epsilon", "loss.n_samples", "optim.nesterov"}
    # the same parameter sets for both variants (paired across variants too)
    sets = collections.defaultdict(list)
    for cell in per_config.values():
        sets[cell.variant].append(json.dumps(cell.swept, sort_keys=True))
    assert sets["a"] == sets["b"]
    # the same file gives the same configs; another sampler seed, other configs;
    # the order of the keys in the file does not matter
    again = expand(study_from(tmp_path, body, file="again.yaml"))
    assert [c.config_id for c in again] == [c.config_id for c in cells]
    other = expand(study_from(tmp_path, body.replace("sampler_seed: 3", "sampler_seed: 4"), file="o.yaml"))
    assert {c.config_id for c in other}.isdisjoint({c.config_id for c in cells})
    lines = textwrap.dedent(body).splitlines()
    i = lines.index("      optim.lr: {loguniform: [1.0e-3, 1.0]}")
    lines[i], lines[i + 3] = lines[i + 3], lines[i]
    swapped = expand(study_from(tmp_path, "\n".join(lines) + "\n", file="swapped.yaml"))
    assert [c.config_id for c in swapped] == [c.config_id for c in cells]


def test_random_int_and_loguniform_cover_their_range(tmp_path: Path):
    cells = expand(
        study_from(
            tmp_path,
            """\
        design:
          - kind: random
            n_configs: 200
            parameters:
              loss.n_samples: {int: [1, 4]}
              optim.lr: {loguniform: [1.0e-4, 1.0]}
        seeds: [0]
        """,
        )
    )
    samples = [c.config["loss"]["n_samples"] for c in cells]
    assert set(samples) == {1, 2, 3, 4}  # both bounds included
    logs = [math.log10(c.config["optim"]["lr"]) for c in cells]
    # log-uniform on [-4, 0]: about a quarter of the values in each decade
    for decade in range(-4, 0):
        share = sum(decade <= v < decade + 1 for v in logs) / len(logs)
        assert 0.13 < share < 0.37


def test_derived_values_follow_the_design(tmp_path: Path):
    study = study_from(
        tmp_path,
        """\
        design:
          - kind: grid
            parameters: {optim.batch_size: [32, 64, 256]}
        derived:
          optim.lr: "0.1 * optim.batch_size / 64"
          optim.weight_decay: "optim.lr / 1000"     # reads another derived value
          loss.n_samples: "max(1, loss.k * 2)"
        seeds: [0, 1]
        """,
    )
    cells = expand(study)
    assert len(cells) == 3 * 2
    for cell in cells:
        bs = cell.config["optim"]["batch_size"]
        assert math.isclose(cell.config["optim"]["lr"], 0.1 * bs / 64)
        assert math.isclose(cell.config["optim"]["weight_decay"], 0.1 * bs / 64 / 1000)
        assert cell.config["loss"]["n_samples"] == 10 and isinstance(cell.config["loss"]["n_samples"], int)
        assert cell.swept == {"optim.batch_size": bs}  # derived values are not swept values
    assert sorted(c.config["optim"]["lr"] for c in configs(cells).values()) == [0.05, 0.1, 0.4]


def test_derived_int_field_rejects_fractions(tmp_path: Path):
    with pytest.raises(StudyError, match=r"derived\.optim\.batch_size .*integer"):
        study_from(
            tmp_path,
            """\
            derived:
              optim.batch_size: "optim.lr * 5"
            seeds: [0]
            """,
        )


def test_union_of_blocks_is_deduplicated_by_config_id(tmp_path: Path):
    study = study_from(
        tmp_path,
        """\
        design:
          - kind: grid
            parameters: {loss.epsilon: [0.1, 0.2, 0.5]}
          - kind: sensitivity
            parameters: {loss.epsilon: [0.2, 0.5, 1.0]}
          - kind: single
        seeds: [0, 1, 2]
        """,
    )
    cells = expand(study)
    epsilons = sorted(c.config["loss"]["epsilon"] for c in configs(cells).values())
    assert epsilons == [0.1, 0.2, 0.5, 1.0]  # base (0.2) and 0.5 appear once
    assert len(cells) == 4 * 3
    assert_paired(cells, [0, 1, 2])


def test_identical_variants_are_one_config_labelled_with_the_first(tmp_path: Path):
    cells = expand(
        study_from(
            tmp_path,
            """\
        variants:
          first: {}
          same: {loss: {epsilon: 0.2}}
        seeds: [0]
        """,
        )
    )
    assert len(cells) == 1 and cells[0].variant == "first"


def test_optuna_blocks_give_no_cells_and_suggest_valid_configs(tmp_path: Path):
    import optuna

    from studies.cells.space import optuna_sampler

    study = study_from(
        tmp_path,
        """\
        variants:
          a: {}
          b: {loss: {n_samples: 5}}
        design:
          - kind: single
          - kind: optuna
            n_configs: 4
            sampler: random
            sampler_seed: 1
            parameters:
              optim.lr: {loguniform: [1.0e-3, 1.0]}
              loss.k: {int: [1, 10]}
              optim.milestones: {choice: [[1], [1, 2]]}
        seeds: [0, 1]
        """,
    )
    cells = expand(study)
    assert len(cells) == 2 * 2  # the single block only
    ((index, block),) = study.optuna_blocks
    assert index == 1
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    opt = optuna.create_study(direction="maximize", sampler=optuna_sampler(block))
    seen_variants = set()
    for _ in range(30):
        trial = opt.ask()
        variant, config, swept = optuna_block_suggest(study, block, trial)
        seen_variants.add(variant)
        assert trial.params["variant"] == variant
        assert 1e-3 <= config["optim"]["lr"] <= 1.0 and 1 <= config["loss"]["k"] <= 10
        assert config["optim"]["milestones"] in ([1], [1, 2])
        assert swept == {
            "optim.lr": config["optim"]["lr"],
            "loss.k": config["loss"]["k"],
            "optim.milestones": config["optim"]["milestones"],
        }
        assert config["loss"]["n_samples"] == (5 if variant == "b" else 3)
        opt.tell(trial, 0.5)
    assert seen_variants == {"a", "b"}
    # the same block by index
    variant, config, _ = optuna_block_suggest(study, 1, opt.ask())
    assert config_id(config)


def test_optuna_bounds_are_checked_at_load_time(tmp_path: Path):
    with pytest.raises(StudyError, match=r"design\[0\]\.parameters\.loss\.k .*smaller than the number of classes"):
        study_from(
            tmp_path,
            """\
            design:
              - kind: optuna
                n_configs: 4
                parameters: {loss.k: {int: [1, 40]}}
            seeds: [0]
            """,
        )


# ----------------------------------------------------------------------------- ids


def test_cell_ids():
    cell = Cell("0123456789", 3, "base", {}, {})
    assert cell.cell_id == "0123456789-s3"
    # hashable although it holds dicts (frozen dataclass, hash of the ids)
    assert hash(cell) == hash(Cell("0123456789", 3, "base", {"x": 1}, {}))
    assert cell in {cell} and cell == Cell("0123456789", 3, "base", {}, {})


def test_config_id_is_sha256_of_sorted_compact_json():
    config = {"optim": {"lr": 0.5, "batch_size": 64}, "loss": {"name": "ce"}, "epochs": 3}
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    assert canonical_json(config) == text
    assert config_id(config) == hashlib.sha256(text.encode()).hexdigest()[:10]
    assert len(config_id(config)) == 10 and int(config_id(config), 16) >= 0


def test_config_id_ignores_key_order_float_spelling_and_seed():
    a = {"loss": {"name": "noised_topk", "epsilon": 0.1, "k": 5}, "optim": {"lr": 0.3}}
    b = {"optim": {"lr": 0.1 * 3}, "loss": {"k": 5.0, "epsilon": 1e-1, "name": "noised_topk"}}
    assert config_id(a) == config_id(b)
    assert config_id({**a, "seed": 4}) == config_id(a)
    c = {"loss": {"name": "noised_topk", "epsilon": 0.11, "k": 5}, "optim": {"lr": 0.3}}
    d = {"loss": {"name": "noised_topk", "epsilon": 0.1, "k": 6}, "optim": {"lr": 0.3}}
    assert len({config_id(a), config_id(c), config_id(d)}) == 3
    with pytest.raises(ValueError):
        config_id({"x": float("nan")})


def test_float_spelling_in_the_file_gives_the_same_id(tmp_path: Path):
    spelled = {}
    for name, value in (("dot", "0.1"), ("exp", "1e-1"), ("exp2", "1.0e-1")):
        cells = expand(
            study_from(
                tmp_path,
                f"""\
            design:
              - kind: grid
                parameters: {{loss.epsilon: [{value}]}}
            seeds: [0]
            """,
                file=f"{name}.yaml",
            )
        )
        spelled[name] = cells[0].config_id
    assert len(set(spelled.values())) == 1


def test_writing_a_default_does_not_change_the_id(tmp_path: Path):
    plain = expand(study_from(tmp_path, "seeds: [0]\n", file="a.yaml"))[0]
    explicit = expand(
        study_from(tmp_path, "variants:\n  v: {optim: {momentum: 0.9, nesterov: true}}\nseeds: [0]\n", file="b.yaml")
    )[0]
    assert plain.config_id == explicit.config_id


# ----------------------------------------------------------------------------- smoke and table


def test_smoke_config_is_tiny_and_keeps_loss_metrics_and_swept_values(tmp_path: Path):
    study = study_from(
        tmp_path,
        """\
        design:
          - kind: grid
            parameters:
              optim.batch_size: [32, 128]
              loss.k: [3, 7]
        seeds: [0, 1]
        """,
    )
    cells = expand(study)
    smoke = smoke_config(cells[0].config)
    assert smoke["data"]["name"] == "synthetic" and smoke["data"]["form"] == "features"
    assert smoke["data"]["num_classes"] == max(cells[0].config["loss"]["k"], 5) + 2
    assert smoke["model"]["name"] == "mlp" and smoke["model"]["pretrained"] is False
    assert smoke["epochs"] == 1 and smoke["device"] == "cpu" and smoke["data"]["num_workers"] == 0
    assert smoke["loss"] == cells[0].config["loss"] and smoke["eval"] == cells[0].config["eval"]
    assert smoke["optim"]["batch_size"] == 16  # small batch unless the batch size is swept
    smoked = smoke_cells(cells)
    assert len(smoked) == len(cells) == 8  # swept values kept: configs stay distinct
    assert_paired(smoked, [0, 1])
    for before, after in zip(cells, smoked):
        assert after.config["optim"]["batch_size"] == before.config["optim"]["batch_size"]
        assert after.config["loss"]["k"] == before.config["loss"]["k"]
        assert after.config_id == config_id(after.config) != before.config_id
        assert after.config["loss"]["k"] < after.config["data"]["num_classes"]


def test_smoke_of_a_real_data_set_with_large_k():
    from studies.studyfile.trial_config import validate_config

    config, problems = validate_config(
        {
            "data": {"name": "plantnet300k", "root": "/data/plantnet"},
            "model": {"name": "resnet18", "pretrained": "/w.pth"},
            "loss": {"name": "noised_topk", "k": 30},
            "eval": {"ks": [1, 5, 30], "avgk": [3], "selection": "val/top30"},
        }
    )
    assert problems == []
    smoke = smoke_config(config, keep=["model.name", "data.root"])
    assert smoke["data"]["num_classes"] == 32 and smoke["model"] == {
        "name": "mlp",
        "pretrained": False,
        "head": "auto",
        "hidden_dim": 16,
        "depth": 40,
        "growth_rate": 40,
    }
    assert smoke["eval"]["selection"] == "val/top30"


def test_cells_table_lists_every_cell_and_the_count(tmp_path: Path):
    study = study_from(
        tmp_path,
        """\
        design:
          - kind: grid
            parameters: {loss.epsilon: [0.1, 1.0]}
          - kind: optuna
            n_configs: 5
            parameters: {optim.lr: {loguniform: [1.0e-3, 1.0]}}
        seeds: [0, 1, 2]
        """,
    )
    cells = expand(study)
    table = format_cells_table(cells, study)
    lines = table.splitlines()
    assert lines[0].split() == ["run", "name", "loss.epsilon", "config_id"]
    for cell, line in zip(cells, lines[1:]):  # the run name MLflow shows, then the hash
        epsilon = f"{cell.swept['loss.epsilon']:g}"
        assert line.split() == ["base", f"ε={epsilon}", f"s{cell.seed}", epsilon, cell.config_id]
    assert "6 cells = 2 configs x 3 seeds" in lines
    assert lines[-1].startswith("+ design[1] (optuna, tpe): 5 proposals x 3 seeds = 15 cells")


def test_expand_copies_configs_once_per_config(tmp_path: Path):
    """The seeds of a config share one copy of it (read-only: 10,000 cells, 2,000 copies);
    no cell shares anything with the study, so a later expansion is intact."""
    study = study_from(tmp_path, "seeds: [0, 1]\n")
    cells = expand(study)
    assert cells[0].config_id == cells[1].config_id and cells[0].config is cells[1].config
    cells[0].config["optim"]["lr"] = 99.0
    assert get_path(expand(study)[0].config, "optim.lr") == 0.1


def test_copy_config_equals_deepcopy_and_shares_nothing_mutable():
    import copy

    from setvalued.paths import copy_config

    config = {
        "loss": {"name": "noised_topk", "epsilon": 0.1, "k": 5, "hard": True, "x": None},
        "optim": {"milestones": [150, 225], "nested": [{"a": [1, 2]}]},
        "tuple": (1, [2]),
    }
    copied = copy_config(config)
    assert copied == copy.deepcopy(config)

    def containers(value):
        if isinstance(value, dict):
            yield value
            for item in value.values():
                yield from containers(item)
        elif isinstance(value, (list, tuple)):
            yield value
            for item in value:
                yield from containers(item)

    original = {id(c) for c in containers(config) if not isinstance(c, tuple)}
    assert original.isdisjoint(id(c) for c in containers(copied) if not isinstance(c, tuple))
    assert copied["tuple"][1] is not config["tuple"][1]  # any other object: deep-copied
