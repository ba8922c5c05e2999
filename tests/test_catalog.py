"""The study catalogue (studies/catalog/*.yaml): every file validates, expands to the cells its
experiment needs, carries the papers' protocol and reference numbers, and runs in smoke mode.

The expected cell counts are written here from the experiments' definitions (the papers'
tables and protocols, docs/papers.md), independently of the files, so that a file that drops
a loss, a K or a seed fails.
"""

from __future__ import annotations

import math
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from analysis.published import published_text
from setvalued.metrics import check_metric
from setvalued.paths import get_path
from studies.cells.space import expand, smoke_cells
from studies.studyfile.spec import load_study

REPO = Path(__file__).resolve().parents[1]
CATALOG = REPO / "studies" / "catalog"

# --------------------------------------------------------------------------------------------
# Expected number of cells of each experiment (configs x seeds), from the papers' protocols.
# --------------------------------------------------------------------------------------------

EXPECTED_CELLS = {
    # quickstart: CE + smooth SVM + noised top-K at 3 epsilon values, 3 seeds
    "quickstart": (2 + 3) * 3,
    # the quickstart racing on 3 to 10 seeds: every seed up to max is a cell the race may run
    "racing_quickstart": (2 + 3) * 10,
    # ASHA quickstart: noised top-K on 3 learning rates x 3 epsilon values, 2 seeds
    "asha_quickstart": 3 * 3 * 2,
    # the worked example of `studies compare`: 3 losses x 3 imbalance ratios, 3 seeds
    "compare_imbalance": 3 * 3 * 3,
    # thesis Table 4.2: 8 epsilon values x 4 seeds
    "topk_epsilon": 8 * 4,
    # thesis Table 4.3: 7 values of M x 4 seeds
    "topk_n_samples": 7 * 4,
    # thesis Figure 4.2: 8 epsilon values (M=3) + CE + smoothed hinge, 4 seeds
    "topk_gradient_sparsity": (8 + 2) * 4,
    # thesis Figure 4.3: CE + smoothed hinge x 6 K + noised x 6 K x 3 M, 3 seeds
    "topk_epoch_time": (1 + 6 + 6 * 3) * 3,
    # thesis Tables 4.4/4.7: 3 losses x 5 noise levels x 4 seeds
    "topk_cifar100_label_noise": 3 * 5 * 4,
    # thesis Tables 4.5/4.8: 6 losses x K in {1,3,5,10} x 3 seeds
    "topk_plantnet300k": 6 * 4 * 3,
    # thesis Table 4.6: 5 losses x K in {1,3,5} x 4 seeds
    "topk_imagenet_lt": 5 * 3 * 4,
    # thesis Section 4.6.5 on Pl@ntNet: per K, focal 4 + LDAM 4x3 + tau 2 + imbal 3x4x2; 4 K; 1 seed
    "topk_hparam_search_plantnet300k": (4 + 4 * 3 + 2 + 3 * 4 * 2) * 4 * 1,
    # thesis Section 4.6.5 on ImageNet-LT: the same grids, K in {1,3,5}, 1 seed
    "topk_hparam_search_imagenet_lt": (4 + 4 * 3 + 2 + 3 * 4 * 2) * 3 * 1,
    # thesis Table 4.9: 3 losses x K in {1,5} x 3 seeds
    "topk_imagenet": 3 * 2 * 3,
    # [BZK18] Table 1: 2 losses x 6 noise levels x 3 seeds
    "smooth_svm_cifar100_label_noise": 2 * 6 * 3,
    # [BZK18] Table 2: 2 losses x 5 training-set sizes x 1 run
    "smooth_svm_imagenet_subsets": 2 * 5 * 1,
    # [BZK18] Table 6 / Figure 2: 7 temperatures (0 = the hard loss) x 3 seeds
    "smooth_svm_temperature": 7 * 3,
    # [BZK18] Tables 7 and 8: (k, tau) in {(1, 1), (5, 0.1)} x margin in {0, 1}, 1 run
    "smooth_svm_imagenet_margin": 2 * 2 * 1,
    # thesis Table 5.1 + S2 Tables 1, 3: 6 losses + the SCCP head, 4 seeds
    "avgk_cifar100": (6 + 1) * 4,
    # thesis Table 5.2 + S2 Tables 2, 4: (5 losses + SCCP head) x K in {2,3,5,10} x 3 seeds
    "avgk_plantnet300k": (5 + 1) * 4 * 3,
    # thesis Figure 5.5: 10 alpha values x 3 seeds
    "avgk_alpha_sensitivity": 10 * 3,
    # thesis Figure 5.6: 2 losses x 8 batch sizes x 3 seeds
    "avgk_batch_size": 2 * 8 * 3,
    # thesis Table 5.3 search: alpha 10 + beta 5 + eps 6 + ROLE lambda 4 x lr multiplier 3; 1 seed
    "avgk_hparam_search_cifar100": (10 + 5 + 6 + 4 * 3) * 1,
    # thesis Table 5.4 search: (alpha 10 + beta 5 + eps 6) x K in {2,3,5,10}; 1 seed
    "avgk_hparam_search_plantnet300k": (10 + 5 + 6) * 4 * 1,
    # S2 Table 7: 3 architectures x 5 losses x 3 seeds
    "avgk_plantnet300k_architectures": 3 * 5 * 3,
    # thesis ch. 3, Figs. 3.5, 3.6, 3.8 and Table 3.1: CE on the 24 timm networks of Table 3.3
    # (27 less alexnet, squeezenet, shufflenet), 3 seeds
    "plantnet300k_baselines": 24 * 3,
    # thesis Fig. 3.9: CE and the smooth top-5 hinge x 5 networks, 3 seeds
    "plantnet300k_smooth_svm": 2 * 5 * 3,
    # variants of the published protocols that show the other design kinds (not paper tables):
    # Section 4.6.5 as a random search: 6 sampled configs + the selected one, 1 seed
    "topk_random_search_plantnet300k": (6 + 1) * 1,
    # Table 5.3's alpha search as an optuna block (proposed while running, no cells known
    # before) + the selected config as a single block, 1 seed
    "avgk_optuna_search_cifar100": 1 * 1,
    # Tables 4.2/4.3 one at a time: centre + epsilon 2 + M 2 + batch size 2, 1 seed
    "topk_sensitivity_cifar100": (1 + 2 + 2 + 2) * 1,
    # the thesis's arguments without a published table ([Gar23] §2.2.2, §6.2.7):
    # conformal vs average-K on synthetic data: CE + the two-head loss, 3 seeds
    "conformal_vs_avgk": 2 * 3,
    # the same on Pl@ntNet-300K with the Table 5.2 recipe: CE + the two-head loss, 3 seeds
    "conformal_vs_avgk_plantnet300k": 2 * 3,
    # sparse-top vs BCE on multi-label synthetic data, 3 seeds
    "sparse_top_multilabel": 2 * 3,
}

# Files on synthetic data, run on a CPU (no data folder, no GPU), and files without published
# numbers (the thesis states their argument without an experiment).
SYNTHETIC = {
    "quickstart",
    "racing_quickstart",
    "asha_quickstart",
    "compare_imbalance",
    "conformal_vs_avgk",
    "sparse_top_multilabel",
}
NO_PUBLISHED_NUMBERS = {
    "quickstart",
    "compare_imbalance",
    "racing_quickstart",
    "asha_quickstart",
    "conformal_vs_avgk",
    "sparse_top_multilabel",
}
# the conformal methods and levels each conformal study evaluates (eval.conformal_*)
CONFORMAL_STUDIES = {"conformal_vs_avgk": {"ks": [2, 5]}, "conformal_vs_avgk_plantnet300k": {"ks": [2, 3, 5, 10]}}

# The design kind(s) and early stopping each variant file must show (the catalogue shows every
# design kind on a real experiment).
EXPECTED_KINDS = {
    "topk_random_search_plantnet300k": {"random", "single"},
    "avgk_optuna_search_cifar100": {"optuna", "single"},
    "topk_sensitivity_cifar100": {"sensitivity"},
}

# The values each experiment sweeps, as the papers give them: (variant, dotted path) -> values.
EXPECTED_SWEEPS = {
    "topk_epsilon": {("noised_bal", "loss.epsilon"): {0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0}},
    "topk_n_samples": {("noised_bal", "loss.n_samples"): {1, 2, 3, 5, 10, 50, 100}},
    "topk_epoch_time": {
        ("noised_bal", "loss.k"): {1, 2, 3, 5, 10, 20},
        ("noised_bal", "loss.n_samples"): {1, 3, 10},
        ("smooth_hinge", "loss.k"): {1, 2, 3, 5, 10, 20},
    },
    "topk_cifar100_label_noise": {
        (v, "data.label_noise"): {0.0, 0.1, 0.2, 0.3, 0.4} for v in ("ce", "smooth_hinge", "noised_bal")
    },
    "topk_plantnet300k": {(v, "loss.k"): {1, 3, 5, 10} for v in ("smooth_hinge", "noised_bal", "noised_imbal")},
    "topk_imagenet_lt": {(v, "loss.k"): {1, 3, 5} for v in ("smooth_hinge", "noised_imbal")},
    "smooth_svm_cifar100_label_noise": {
        (v, "data.label_noise"): {0.0, 0.2, 0.4, 0.6, 0.8, 1.0} for v in ("ce", "smooth_svm")
    },
    "smooth_svm_temperature": {("smooth_svm", "loss.tau"): {0.0, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0}},
    "avgk_plantnet300k": {(v, "loss.k"): {2, 3, 5, 10} for v in ("topk", "avg", "avg_sccp", "epr")},
    "avgk_alpha_sensitivity": {("avg", "loss.alpha"): {1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0}},
    "avgk_batch_size": {(v, "optim.batch_size"): {8, 16, 32, 64, 128, 256, 512, 1024} for v in ("ce", "avg")},
}

# The training recipe of each data set / paper: dotted path -> value, checked on every cell.
CIFAR_CH4 = {
    "data.name": "cifar100",
    "model.name": "densenet_bc_cifar",
    "model.pretrained": False,
    "optim.batch_size": 64,
    "optim.weight_decay": 1e-4,
    "optim.momentum": 0.9,
    "optim.nesterov": True,
    "data.val_size": 5000,
    "data.split_seed": 1234,
    "data.noise_groups": "consecutive",
}
PLANTNET_CH4 = {
    "data.name": "plantnet300k",
    "model.name": "resnet50",
    "epochs": 30,
    "optim.lr": 0.002,
    "optim.milestones": [20, 25],
    "optim.batch_size": 32,
    "optim.weight_decay": 1e-4,
}
IMAGENET_LT_CH4 = {
    "data.name": "imagenet_lt",
    "model.name": "resnet34",
    "epochs": 100,
    "optim.lr": 0.01,
    "optim.milestones": [60, 80],
    "optim.batch_size": 128,
    "optim.weight_decay": 2e-3,
}
CIFAR_CH5 = {
    **CIFAR_CH4,
    "data.stratified_split": True,
    "epochs": 300,
    "eval.avgk": [5],
    "eval.avgk_activation": "softmax",
}
PLANTNET_CH5 = {
    "data.name": "plantnet300k",
    "epochs": 30,
    "optim.lr": 0.002,
    "optim.milestones": [25],
    "optim.batch_size": 32,
    "optim.weight_decay": 1e-4,
    "eval.avgk_activation": "softmax",
}
PLANTNET_CH3 = {
    "data.name": "plantnet300k",
    "optim.batch_size": 32,
    "optim.weight_decay": 1e-4,
    "optim.momentum": 0.9,
    "optim.nesterov": True,
    "optim.gamma": 0.1,
    "eval.selection": "val/top1",
}
EXPECTED_RECIPE = {
    "topk_epsilon": {
        **CIFAR_CH4,
        "epochs": 300,
        "optim.lr": 0.1,
        "eval.selection": "val/top5",
        "loss.k": 5,
        "loss.n_samples": 10,
    },
    "topk_n_samples": {
        **CIFAR_CH4,
        "epochs": 300,
        "optim.lr": 0.1,
        "eval.selection": "val/top5",
        "loss.k": 5,
        "loss.epsilon": 0.2,
    },
    "topk_gradient_sparsity": {**CIFAR_CH4, "epochs": 1},
    "topk_epoch_time": {**CIFAR_CH4},
    "topk_cifar100_label_noise": {**CIFAR_CH4, "epochs": 300, "optim.lr": 0.1, "eval.selection": "val/top5"},
    "topk_plantnet300k": PLANTNET_CH4,
    "topk_hparam_search_plantnet300k": PLANTNET_CH4,
    "topk_imagenet_lt": IMAGENET_LT_CH4,
    "topk_hparam_search_imagenet_lt": IMAGENET_LT_CH4,
    "topk_imagenet": {
        "model.name": "resnet18",
        "epochs": 120,
        "optim.batch_size": 256,
        "optim.milestones": [30, 60, 90],
    },
    "smooth_svm_cifar100_label_noise": {**CIFAR_CH4, "epochs": 300, "optim.lr": 0.1, "eval.selection": "val/top5"},
    "smooth_svm_imagenet_subsets": {
        "model.name": "resnet18",
        "epochs": 120,
        "optim.batch_size": 256,
        "optim.milestones": [30, 60, 90],
        "eval.selection": "val/top5",
    },
    "smooth_svm_temperature": {
        **CIFAR_CH4,
        "model.depth": 40,
        "model.growth_rate": 12,
        "epochs": 300,
        "optim.lr": 0.1,
        "eval.selection": "val/top5",
        "loss.name": "smooth_topk_svm",
        "loss.k": 5,
        "loss.alpha": 1.0,
    },
    "smooth_svm_imagenet_margin": {
        "model.name": "resnet18",
        "epochs": 120,
        "optim.batch_size": 256,
        "optim.milestones": [30, 60, 90],
        "data.root": "data/imagenet_subsets/full",
        "loss.name": "smooth_topk_svm",
    },
    "avgk_cifar100": {**CIFAR_CH5, "optim.lr": 0.1, "eval.selection": "val/avg5"},
    "avgk_alpha_sensitivity": {**CIFAR_CH5, "optim.lr": 0.1, "eval.selection": "val/avg5"},
    "avgk_batch_size": {**CIFAR_CH5, "eval.selection": "val/avg5"},
    "avgk_hparam_search_cifar100": {**CIFAR_CH5, "optim.lr": 0.1, "eval.selection": "val/avg5"},
    "avgk_plantnet300k": {**PLANTNET_CH5, "model.name": "resnet18"},
    "avgk_hparam_search_plantnet300k": {**PLANTNET_CH5, "model.name": "resnet18"},
    "avgk_plantnet300k_architectures": {**PLANTNET_CH5, "eval.selection": "val/avg5"},
    "plantnet300k_baselines": {
        **PLANTNET_CH3,
        "loss.name": "ce",
        "eval.count_bins": [10, 50, 500, 2000],
        "eval.avgk": [5],
    },
    "plantnet300k_smooth_svm": {**PLANTNET_CH3, "loss.k": 5, "loss.tau": 1.0},
    "topk_random_search_plantnet300k": {
        **PLANTNET_CH4,
        "loss.k": 5,
        "loss.n_samples": 5,
        "loss.scale": 60.0,
        "eval.selection": "val/macro_top5",
    },
    "avgk_optuna_search_cifar100": {**CIFAR_CH5, "optim.lr": 0.1, "eval.selection": "val/avg5"},
    "topk_sensitivity_cifar100": {**CIFAR_CH4, "epochs": 300, "eval.selection": "val/top5", "loss.k": 5},
    "conformal_vs_avgk_plantnet300k": {**PLANTNET_CH5, "model.name": "resnet18", "eval.selection": "val/avg5"},
}

# The CIFAR-100 300-epoch schedule of each paper's authors: 0-indexed epochs at whose start the
# lr is divided by 10 (docs/papers.md, erratum T-E8). [GSJS22]'s code passes `--lr_decay 151
# 226` to a 0-indexed loop; [BZK18]'s code decays at its epochs 151 and 226 counted from 1;
# the code of [GSJS23] is not published, so its files keep the text's epochs 150 and 225.
CIFAR100_300_EPOCH_MILESTONES = {"[GSJS22]": [151, 226], "[BZK18]": [150, 225], "[GSJS23]": [150, 225]}
# the paper each catalogue file reproduces, by file-name prefix
PAPER_OF_PREFIX = {"topk_": "[GSJS22]", "smooth_svm_": "[BZK18]", "avgk_": "[GSJS23]"}

# Metrics that are not accuracies but are logged by every trial (docs/interfaces.md, section 5).
OTHER_METRICS = {"best_val", "best_epoch", "epoch_time_s", "grad_nonzero", "grad_nonzero_active"}
PAPER_KEYS = ("[Gar23]", "[GSJS22]", "[GSJS23]", "[BZK18]", "[Gar+21]")
# where in a paper: a section, table, figure, equation, appendix or supplement part
LOCATOR = r"(§\s*\d|Tables?\s+\d|Fig(ure|\.)\s*\d|Section\s+\d|eq\.\s*\d|App(endix|\.)\s*[A-Z]|supp\.\s*[A-Z])"


#: the catalogue's laptop studies (synthetic data, CPU), not paper experiments


def catalog_files() -> list[Path]:
    return sorted(CATALOG.glob("*.yaml"))


def _id(path: Path) -> str:
    return path.stem


_LOADED: dict[Path, tuple] = {}


def loaded(path: Path):
    """(study, cells) of a catalogue file, parsed once per test session."""
    if path not in _LOADED:
        study = load_study(path)
        _LOADED[path] = (study, expand(study))
    return _LOADED[path]


def _same(actual, expected) -> bool:
    if isinstance(expected, bool) or isinstance(actual, bool):
        return actual is expected
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)):
        return math.isclose(float(actual), float(expected), rel_tol=1e-9, abs_tol=1e-12)
    return actual == expected


# --------------------------------------------------------------------------------------------
# Fast checks
# --------------------------------------------------------------------------------------------


def test_every_catalogue_file_has_an_expected_count():
    names = {p.stem for p in catalog_files()}
    assert names == set(EXPECTED_CELLS), (
        f"files without an expected count: {sorted(names - set(EXPECTED_CELLS))}; "
        f"expected files missing: {sorted(set(EXPECTED_CELLS) - names)}"
    )


@pytest.mark.parametrize("path", catalog_files(), ids=_id)
def test_file_validates_and_expands_to_the_experiment(path):
    study, cells = loaded(path)
    assert study.name == path.stem, "the study name names the output folder: keep it equal to the file name"
    assert len(cells) == EXPECTED_CELLS[path.stem]
    # cells are distinct and every config runs on every seed of the study (paired by seed)
    assert len({c.cell_id for c in cells}) == len(cells)
    seeds_of: dict[str, set] = {}
    for cell in cells:
        seeds_of.setdefault(cell.config_id, set()).add(cell.seed)
    assert all(s == set(study.seed_list) for s in seeds_of.values())
    assert len(seeds_of) * len(study.seed_list) == len(cells)


@pytest.mark.parametrize("name", sorted(EXPECTED_SWEEPS))
def test_swept_values_are_the_papers(name):
    _, cells = loaded(CATALOG / f"{name}.yaml")
    for (variant, path), values in EXPECTED_SWEEPS[name].items():
        found = {get_path(c.config, path) for c in cells if c.variant == variant}
        assert len(found) == len(values), (variant, path, sorted(found))
        for value in values:
            assert any(_same(f, value) for f in found), f"{variant}: {path}={value} is not run"


@pytest.mark.parametrize("name", sorted(EXPECTED_RECIPE))
def test_training_recipe_is_the_papers(name):
    _, cells = loaded(CATALOG / f"{name}.yaml")
    for cell in cells:
        for path, value in EXPECTED_RECIPE[name].items():
            if path in cell.swept or (path.startswith("loss.") and path.split(".", 1)[1] not in cell.config["loss"]):
                continue
            actual = get_path(cell.config, path)
            assert _same(actual, value), f"{cell.variant} {cell.swept}: {path} = {actual!r}, expected {value!r}"


@pytest.mark.parametrize("name, n_sizes", [("avgk_batch_size", 8), ("topk_sensitivity_cifar100", 3)])
def test_batch_size_study_keeps_lr_proportional_to_batch_size(name, n_sizes):
    """Thesis Figure 5.6: "we maintain the ratio of learning rate to batch size constant",
    with lr 0.1 at the recipe's batch size 64."""
    _, cells = loaded(CATALOG / f"{name}.yaml")
    sizes = set()
    for cell in cells:
        batch = cell.config["optim"]["batch_size"]
        sizes.add(batch)
        assert math.isclose(cell.config["optim"]["lr"], 0.1 * batch / 64, rel_tol=1e-9)
    assert len(sizes) == n_sizes


@pytest.mark.parametrize("name", sorted(EXPECTED_KINDS))
def test_variant_files_show_the_other_design_kinds(name):
    study, _ = loaded(CATALOG / f"{name}.yaml")
    assert {b.kind for b in study.design} == EXPECTED_KINDS[name]
    header = CATALOG.joinpath(f"{name}.yaml").read_text(encoding="utf-8").split("\n", 1)[0]
    assert "variant of the published protocol" in header.lower(), "say it is not a published table"


def test_catalogue_shows_every_design_kind_derived_and_early_stopping():
    kinds, derived, stopping, asha = set(), set(), set(), set()
    for path in catalog_files():
        study, _ = loaded(path)
        kinds |= {b.kind for b in study.design}
        if study.derived:
            derived.add(path.stem)
        if study.scheduler.kind == "early_stopping":
            stopping.add(path.stem)
        if study.scheduler.kind == "asha":
            asha.add(path.stem)
    assert kinds == {"grid", "sensitivity", "random", "optuna", "single"}
    assert derived and stopping and asha


def test_asha_quickstart_has_rungs_before_its_last_epoch():
    """Pruning configs, not trials: its ASHA rungs come before the last epoch, and its seeds
    (which wait for each other at a rung) fit on a 2-core laptop at once."""
    from studies.scheduling import rungs

    study, cells = loaded(CATALOG / "asha_quickstart.yaml")
    epochs = {c.config["epochs"] for c in cells}
    assert len(epochs) == 1
    schedule = rungs(study.scheduler.grace_epochs, study.scheduler.reduction_factor, epochs.pop())
    assert len(schedule) >= 2, schedule
    assert len(study.seeds) <= 2 and study.resources.cpus == 1 and study.resources.gpus == 0


@pytest.mark.parametrize("path", catalog_files(), ids=_id)
def test_topk_losses_are_selected_on_their_own_k(path):
    """Where a top-K / average-K loss is trained for K, the checkpoint is chosen on a
    validation metric of the same K (thesis Sections 4.4.5, 5.6.3)."""
    if path.stem == "topk_epoch_time":
        pytest.skip("a timing study: its selection metric does not matter")
    _, cells = loaded(path)
    checked = 0
    for cell in cells:
        k = cell.config["loss"].get("k")
        if k is None or "loss.k" not in cell.swept:
            continue
        k = int(k)  # EPR's K (an average set size) is a float
        selection = cell.config["eval"]["selection"]
        assert re.search(rf"(top|avg){k}$", selection), (cell.variant, cell.swept, selection)
        checked += 1
    if any("loss.k" in c.swept for c in cells):
        assert checked > 0


@pytest.mark.parametrize("path", catalog_files(), ids=_id)
def test_header_cites_the_table_and_the_protocol(path):
    header = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    text = " ".join(header)
    assert len(header) >= 5, "each file starts with a comment naming its experiment and protocol"
    assert re.search(r"\b(Tables?|Figures?|Section)\b", text), "the header names the table or figure"
    keys = "|".join(re.escape(k) for k in PAPER_KEYS)
    assert re.search(rf"({keys}),?\s*{LOCATOR}", text), (
        "the header cites the paper that gives the protocol by key and by its own numbering, "
        "e.g. '[Gar23] §4.4.4' or '[BZK18] Table 6'"
    )


@pytest.mark.parametrize("path", sorted(CATALOG.glob("*.yaml")) + sorted(CATALOG.glob("*.md")), ids=_id)
def test_catalogue_cites_no_document_outside_the_repository(path):
    """Citations name the papers ([Gar23] §4.4.4, [BZK18] Table 6), docs/papers.md (errata and
    notes), other files of this repository or the authors' repositories (owner/name:path),
    never a document that is not in this repository."""
    text = path.read_text(encoding="utf-8")
    assert not re.search(r"(?<![\w.:])/(work|home|tmp|mnt)/", text), f"{path.name}: an absolute path"
    for name in set(re.findall(r"[\w./-]+\.md\b", text)):
        if re.match(r"[\w-]+/[\w.-]+:", name):
            continue  # a file of an authors' repository, owner/name:path
        here = [p for p in REPO.rglob(Path(name).name) if ".git" not in p.parts]
        assert any(str(p).endswith(name.lstrip("./")) for p in here), (
            f"{path.name} cites {name!r}, which is not a file of this repository"
        )
    # errata are cited with their docs/papers.md prefix (T-E8, A-E6, S-E9c), not as bare E8
    bare = re.findall(r"(?<![-\w])E\d+\b", text)
    assert not bare, f"{path.name}: bare erratum ids {bare}; write T-E<n>, A-E<n> or S-E<n>"


def test_cifar100_300_epoch_files_use_their_papers_schedule():
    """docs/papers.md, erratum T-E8: each CIFAR-100 300-epoch study decays the lr at the epochs
    its paper's authors used, written once above per paper."""
    checked = set()
    for path in catalog_files():
        paper = next((p for prefix, p in PAPER_OF_PREFIX.items() if path.stem.startswith(prefix)), None)
        _, cells = loaded(path)
        for cell in cells:
            config = cell.config
            if config["data"]["name"] != "cifar100" or config["epochs"] != 300:
                continue
            assert paper is not None, f"{path.name}: no paper for this file name"
            assert config["optim"]["milestones"] == CIFAR100_300_EPOCH_MILESTONES[paper], (
                f"{path.name} ({cell.variant} {cell.swept}): milestones {config['optim']['milestones']}, "
                f"{paper}'s authors used {CIFAR100_300_EPOCH_MILESTONES[paper]}"
            )
            checked.add(path.stem)
    assert checked == {
        "topk_epsilon",
        "topk_n_samples",
        "topk_cifar100_label_noise",
        "smooth_svm_cifar100_label_noise",
        "smooth_svm_temperature",
        "avgk_cifar100",
        "avgk_alpha_sensitivity",
        "avgk_batch_size",
        "avgk_hparam_search_cifar100",
        "avgk_optuna_search_cifar100",
        "topk_sensitivity_cifar100",
    }


@pytest.mark.parametrize("path", [p for p in catalog_files() if p.stem not in SYNTHETIC], ids=_id)
def test_smooth_svm_runs_with_the_official_hard_switch(path):
    """docs/papers.md, erratum S-E9c: the published numbers of [BZK18] and [GSJS22] come from
    the official smooth top-k SVM, which switches a sample to the hard loss when
    s_[k] - s_[k+1] >= k tau ln(1000) (at k = 1 too). Every smooth top-k SVM of the catalogue
    has the switch on, except (k, tau, alpha) = (1, 1, 0), which [BZK18] App. D.2.2 calls
    exactly CE and which is CE only without the switch."""
    _, cells = loaded(path)
    for cell in cells:
        loss = cell.config["loss"]
        if loss["name"] != "smooth_topk_svm":
            continue
        is_ce = (int(loss["k"]), float(loss["tau"]), float(loss["alpha"])) == (1, 1.0, 0.0)
        assert loss.get("hard_switch", False) is (not is_ce), (cell.variant, cell.swept, loss)


@pytest.mark.parametrize("path", [p for p in catalog_files() if p.stem not in SYNTHETIC], ids=_id)
def test_real_data_paths_are_relative_placeholders(path):
    _, cells = loaded(path)
    for cell in cells:
        root = cell.config["data"].get("root")
        assert isinstance(root, str) and root.startswith("data/"), root
        weights = cell.config["model"]["pretrained"]
        assert weights is False or (isinstance(weights, str) and weights.startswith("weights/")), weights
        assert cell.config["device"] == "cuda"


@pytest.mark.parametrize("path", [p for p in catalog_files() if p.stem not in SYNTHETIC], ids=_id)
def test_resources_ask_for_a_gpu(path):
    study, _ = loaded(path)
    assert 0 < study.resources.gpus <= 1


# Experiments whose paper prints no number (figures only): no reference block, and the header
# says so.
FIGURE_ONLY = {"plantnet300k_smooth_svm"}


@pytest.mark.parametrize("name", sorted(FIGURE_ONLY))
def test_figure_only_files_say_so_and_have_no_reference(name):
    study, _ = loaded(CATALOG / f"{name}.yaml")
    assert study.reference is None
    header = CATALOG.joinpath(f"{name}.yaml").read_text(encoding="utf-8").split("\nname:", 1)[0]
    assert "Figure only" in header and "no number" in header


@pytest.mark.parametrize(
    "path", [p for p in catalog_files() if p.stem not in NO_PUBLISHED_NUMBERS and p.stem not in FIGURE_ONLY], ids=_id
)
def test_reference_rows_match_one_config_and_a_logged_metric(path):
    study, cells = loaded(path)
    assert study.reference, "every paper experiment has reference numbers"
    for source in study.reference:
        assert source.rows and source.label
        for i, row in enumerate(source.rows):
            where = f"reference {source.label} row {i} ({row.variant}, {row.match})"
            matched = [
                c
                for c in cells
                if (row.variant is None or c.variant == row.variant)
                and all(_same(get_path(c.config, p, None), v) for p, v in row.match.items())
            ]
            configs = {c.config_id for c in matched}
            assert len(configs) == 1, f"{where} matches {len(configs)} configs"
            config = matched[0].config
            for metric, value in row.metrics.items():
                if metric not in OTHER_METRICS:
                    # test/avg5_size (the realised average set size) is logged beside test/avg5
                    reason = check_metric(re.sub(r"_size$", "", metric), config["eval"], ("test", "train"))
                    assert reason is None, f"{where}: {reason}"
                if metric not in OTHER_METRICS or metric == "best_val":
                    assert 0.0 <= value <= 100.0 or metric.endswith("_size"), (where, metric, value)
            assert set(row.ci) <= set(row.metrics), f"{where}: a CI without its value"
            assert all(ci >= 0 for ci in row.ci.values())
        # intervals come with the level the source states (issue 33), and with its seed count
        # whenever the source text says "N seeds" (the plan reads the interval with them)
        if any(row.ci for row in source.rows):
            assert source.level == 0.95 and "95% CI" in source.source, source.source
        stated = re.search(r"(\d+) seeds", source.source)
        if stated:
            assert source.seeds == int(stated.group(1)), (source.label, source.source)
        # the numbers are percentages: most accuracies of a paper table are above 1 (not fractions)
        accuracies = [
            v
            for r in source.rows
            for m, v in r.metrics.items()
            if re.search(r"/(macro_)?(top|avg)\d+$", m) or m == "best_val"
        ]
        if accuracies:
            assert sum(v > 1.0 for v in accuracies) > len(accuracies) / 2


def _published(name, variant, match, metric, label=None) -> tuple[str, str | None]:
    """(value, CI) of a file's reference number as written, from the source labelled `label`
    (default: the first source)."""
    study, _ = loaded(CATALOG / f"{name}.yaml")
    sources = [s for s in study.reference if label is None or s.label == label][:1]
    for row in sources[0].rows if sources else []:
        if (
            row.variant == variant
            and all(_same(row.match.get(p), v) for p, v in match.items())
            and metric in row.metrics
        ):
            ci = row.ci.get(metric)
            return row.metrics[metric].text, ci.text if ci is not None else None
    raise AssertionError(f"no reference for {name} {label} {variant} {match} {metric}")


def test_reference_numbers_spot_checks():
    """A few published numbers, copied here from the papers' tables, against the files."""

    def ref(name, variant, match, metric):
        value, ci = _published(name, variant, match, metric)
        return float(value), float(ci) if ci is not None else None

    assert ref("topk_epsilon", "noised_bal", {"loss.epsilon": 0.1}, "best_val") == (94.46, None)
    assert ref("topk_n_samples", "noised_bal", {"loss.n_samples": 50}, "best_val") == (94.64, None)
    assert ref("topk_cifar100_label_noise", "noised_bal", {"data.label_noise": 0.2}, "test/top5") == (90.7, 0.5)
    assert ref("topk_cifar100_label_noise", "smooth_hinge", {"data.label_noise": 0.4}, "test/top1") == (70.6, 0.2)
    assert ref("topk_plantnet300k", "noised_imbal", {"loss.k": 1}, "test/macro_top1") == (42.4, 0.3)
    assert ref("topk_plantnet300k", "focal", {"eval.selection": "val/macro_top10"}, "test/top10") == (97.7, 0.0)
    assert ref("topk_imagenet_lt", "ldam", {"eval.selection": "val/top1"}, "test/few/top1") == (10.5, None)
    assert ref("topk_imagenet", "noised_bal", {"loss.k": 5}, "test/top5") == (90.52, 0.07)
    assert ref("smooth_svm_cifar100_label_noise", "smooth_svm", {"data.label_noise": 0.8}, "test/top1") == (55.85, None)
    assert ref("avgk_cifar100", "avg_sccp", {}, "test/avg5") == (96.93, 0.06)
    assert ref("avgk_plantnet300k", "avg", {"loss.k": 10}, "test/few/avg10") == (75.75, None)
    assert ref("avgk_plantnet300k", "ce", {"eval.selection": "val/avg5"}, "test/avg5_size") == (5.04, 0.03)
    assert ref("avgk_plantnet300k_architectures", "avg", {"model.name": "densenet169"}, "test/avg5") == (97.49, None)
    # thesis Table 3.1 (fractions in the thesis: 0.09 ... 0.93)
    assert [
        ref("plantnet300k_baselines", "resnet50", {}, f"test/count_{b}/top1")[0]
        for b in ("0_10", "10_50", "50_500", "500_2000", "2000_inf")
    ] == [9, 35, 59, 79, 93]


# [GSJS22] (the ICML paper), as printed: Table 4 (CIFAR-100 test top-5) and Table 6 (top-1) by
# label noise p, columns CE, smoothed hinge, noised bal.; Table 5 (Pl@ntNet-300K test macro-average
# top-K) and Table 7 (top-K) by K, columns CE, smoothed hinge, noised bal., focal, LDAM, noised
# imbal. ("NA": not reported).
GSJS22_TABLE_4 = """
0.0 94.24 94.34 94.35
0.1 90.39 92.08 92.03
0.2 87.67 90.22 90.68
0.3 85.93 88.82 89.58
0.4 83.74 87.40 87.48"""
GSJS22_TABLE_6 = """
0.0 76.56 69.23 68.74
0.1 71.01 71.52 68.43
0.2 68.19 71.59 69.34
0.3 65.61 70.44 69.11
0.4 61.9 70.42 69.44"""
GSJS22_TABLE_5 = """
1 35.91 NA 35.44 37.87 40.54 42.36
3 58.91 50.41 59.06 59.96 63.50 64.77
5 69.05 50.71 66.97 69.91 72.23 72.95
10 78.08 46.23 76.08 78.88 80.69 80.85"""
GSJS22_TABLE_7 = """
1 79.93 NA 81.00 79.71 79.49 80.90
3 93.19 93.20 93.56 93.56 92.40 93.45
5 95.75 94.91 95.84 96.10 95.22 95.80
10 97.42 95.46 97.52 97.72 97.21 97.52"""


def _table(text: str) -> list[list[str]]:
    return [line.split() for line in text.strip().splitlines()]


def test_icml_paper_numbers_are_a_second_source_copied_as_printed():
    """Every number of [GSJS22] Tables 4-7 is in its file, as the paper prints it (`87.40`,
    `61.9`), under the source labelled [GSJS22]; the thesis stays the first source."""
    cifar, plantnet = "topk_cifar100_label_noise", "topk_plantnet300k"
    for name in (cifar, plantnet):
        study, _ = loaded(CATALOG / f"{name}.yaml")
        assert [s.label for s in study.reference] == ["[Gar23]", "[GSJS22]"]
        assert study.reference[0].source.startswith("Thesis")
        assert all(not row.ci for row in study.reference[1].rows), "the ICML tables have no CI"
    losses = ("ce", "smooth_hinge", "noised_bal")
    for table, metric in ((GSJS22_TABLE_4, "test/top5"), (GSJS22_TABLE_6, "test/top1")):
        for p, *values in _table(table):
            for variant, value in zip(losses, values):
                assert _published(cifar, variant, {"data.label_noise": float(p)}, metric, "[GSJS22]") == (
                    value,
                    None,
                ), (variant, p, metric)
    losses += ("focal", "ldam", "noised_imbal")
    n_rows = 0
    for table, metric in ((GSJS22_TABLE_5, "test/macro_top{}"), (GSJS22_TABLE_7, "test/top{}")):
        for k, *values in _table(table):
            for variant, value in zip(losses, values):
                match = {"eval.selection": f"val/macro_top{k}"}
                if value == "NA":
                    with pytest.raises(AssertionError, match="no reference"):
                        _published(plantnet, variant, match, metric.format(k), "[GSJS22]")
                    continue
                assert _published(plantnet, variant, match, metric.format(k), "[GSJS22]") == (value, None)
                n_rows += metric.startswith("test/macro")
    study, _ = loaded(CATALOG / f"{plantnet}.yaml")
    assert len(study.reference[1].rows) == n_rows == 23  # 4 K x 6 losses, less the hinge at K = 1
    # the thesis numbers of the same experiments differ, and keep their own precision
    assert _published(cifar, "ce", {"data.label_noise": 0.0}, "test/top5") == ("94.2", "0.1")
    assert _published(cifar, "smooth_hinge", {"data.label_noise": 0.0}, "test/top5") == ("93.3", "0.0")
    assert _published(plantnet, "ce", {"eval.selection": "val/macro_top1"}, "test/macro_top1") == ("36.3", "0.3")
    assert _published(plantnet, "focal", {"eval.selection": "val/macro_top10"}, "test/top10") == ("97.7", "0.0")


def test_quickstart_is_a_small_cpu_study():
    study, cells = loaded(CATALOG / "quickstart.yaml")
    assert len(study.seeds) == 3
    losses = {c.config["loss"]["name"] for c in cells}
    assert losses == {"ce", "noised_topk", "smooth_topk_svm"}
    eps = {c.config["loss"]["epsilon"] for c in cells if c.config["loss"]["name"] == "noised_topk"}
    assert len(eps) == 3
    for cell in cells:
        config = cell.config
        assert config["device"] == "cpu" and config["model"]["name"] == "mlp"
        assert config["data"]["name"] == "synthetic" and config["data"]["form"] == "features"
        assert 20 <= config["data"]["num_classes"] <= 60
        assert config["data"]["train_size"] + config["data"]["val_size"] + config["data"]["test_size"] <= 5000
        assert config["epochs"] <= 20
    assert study.resources.gpus == 0
    tables = [t.metrics for t in study.report.tables]
    assert any({"test/top1", "test/top5"} <= set(t) for t in tables)
    assert any(c.x == "loss.epsilon" and c.metric == "test/top5" for c in study.report.curves)


@pytest.mark.parametrize("path", catalog_files(), ids=_id)
def test_every_variant_trains_in_smoke_mode(path):
    """In-process check, without Ray: the smoke config (synthetic data, tiny MLP, one epoch)
    of one cell per variant, K and batch size of the design trains and selects a checkpoint
    on the study's validation metric. The full smoke runs through the CLI are the slow test
    below."""
    import torch

    from setvalued.training import fit

    torch.set_num_threads(1)
    study, cells = loaded(path)
    picked: dict[tuple, object] = {}
    for cell in smoke_cells(cells):
        if cell.seed == study.seed_list[0]:
            key = (cell.variant, cell.config["loss"].get("k"), cell.config["optim"]["batch_size"])
            picked.setdefault(key, cell)
    assert picked
    for cell in picked.values():
        result = fit(cell.config, cell.seed)
        selection = cell.config["eval"]["selection"].split("/", 1)[1]
        assert math.isfinite(result["best_val"]) and 0.0 <= result["best_val"] <= 1.0
        assert selection in result["test"], (cell.variant, sorted(result["test"]))


# --------------------------------------------------------------------------------------------
# Running (slow): the CLI of docs/interfaces.md section 7
# --------------------------------------------------------------------------------------------


def run_cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """``studies ARGS`` in a fresh interpreter, from the repository root."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    code = "import sys; from studies.cli import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def finished_cells(db: Path, study_name: str) -> dict[str, dict]:
    """cell_id -> tags of the finished child runs in the study's MLflow SQLite store."""
    with sqlite3.connect(db) as con:
        rows = con.execute(
            "SELECT r.run_uuid, t.key, t.value FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
            "JOIN experiments e ON e.experiment_id = r.experiment_id WHERE e.name = ?",
            (study_name,),
        ).fetchall()
    tags: dict[str, dict] = {}
    for run, key, value in rows:
        tags.setdefault(run, {})[key] = value
    return {
        t["studies.cell_id"]: t
        for t in tags.values()
        if t.get("studies.role") == "cell" and t.get("studies.status") == "finished"
    }


SMOKE_TIMES: dict[str, float] = {}


@pytest.mark.slow
@pytest.mark.parametrize("path", catalog_files(), ids=_id)
def test_smoke_run(path, tmp_path):
    """``studies run FILE --smoke`` trains every cell of the design (on synthetic data, a tiny
    MLP, one epoch) and records each one as a finished MLflow run."""
    study, cells = loaded(path)
    expected = {c.cell_id for c in smoke_cells(cells)}
    start = time.monotonic()
    result = run_cli("run", str(path), "--smoke", "--output", str(tmp_path), timeout=1800)
    SMOKE_TIMES[path.stem] = time.monotonic() - start
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    name = study.name + "-smoke"  # a smoke run is its own study, NAME-smoke (`studies run --help`)
    out = tmp_path / name
    assert (out / "study.yaml").is_file()
    done = finished_cells(out / "mlflow.db", name)
    # optuna blocks give no cells before the run: each proposal runs on every seed
    proposals = sum(b.n_configs for _, b in study.optuna_blocks) * len(study.seed_list)
    if study.racing is not None:
        # a race runs every config's initial seeds and at most every seed up to max; the
        # seeds each config got are the first ones of the shared sequence (paired)
        assert set(done) <= expected, sorted(set(done) - expected)[:5]
        got: dict[str, list] = {}
        for tags in done.values():
            got.setdefault(tags["studies.config_id"], []).append(int(tags["studies.seed"]))
        sequence = study.seed_list
        assert len(got) == len({c.config_id for c in smoke_cells(cells)})
        for seeds in got.values():
            assert sorted(seeds, key=sequence.index) == sequence[: len(seeds)]
            assert len(seeds) >= study.racing.initial
        assert "Racing: seeds per config" in (out / "report" / "report.md").read_text()
    else:
        assert expected <= set(done) and len(set(done) - expected) == proposals, (
            f"missing: {sorted(expected - set(done))[:5]}, unexpected: {sorted(set(done) - expected)[:5]}"
        )
    # the report drew the figures the file asks for: learning curves, and the set-size
    # histograms wherever average-K sets are evaluated
    figures = {p.name for p in (out / "report" / "figures").glob("*.png")}
    for metric in study.report.learning_curves or []:
        assert "learning_" + re.sub(r"[^A-Za-z0-9]+", "_", metric) + ".png" in figures, figures
    if any(c.config["eval"]["avgk"] for c in cells):
        assert any(f.startswith("set_sizes_avg") for f in figures), figures
    if path.stem.startswith("plantnet300k_"):
        # the chapter 3 files: a report (a failing report is not an error of `studies run`),
        # with the reference columns where there are published numbers, and the figures asked
        report_md = (out / "report" / "report.md").read_text(encoding="utf-8")
        assert "Figure failed" not in report_md
        assert ("(paper)" in report_md) == bool(study.reference)
        for base in study.report.count_bins or []:
            assert f"count_bins_{base}.png" in figures, figures
        for base in study.report.per_class or []:
            assert f"per_class_{base}.png" in figures, figures
    # a file with several reference sources shows a published column per source, filled with
    # that source's numbers as the file writes them (for the configs the smoke run keeps)
    if len(study.reference or []) > 1:
        report = (out / "report" / "report.md").read_text(encoding="utf-8")
        headers = [line for line in report.splitlines() if line.startswith("| variant |")]
        entries = {c.strip() for line in report.splitlines() if line.startswith("| ") for c in line.split("|")}
        for source in study.reference:
            assert any(f" ({source.label}) |" in h for h in headers), (source.label, headers)
            assert f"({source.label}): published numbers from {source.source}." in report
            texts = {
                published_text(value, row.ci.get(metric))
                for row in source.rows
                for metric, value in row.metrics.items()
            }
            assert texts & entries, (source.label, sorted(texts)[:5])
    print(f"smoke {path.stem}: {len(expected)} cells in {SMOKE_TIMES[path.stem]:.1f} s")


@pytest.mark.slow
def test_quickstart_runs_and_reports_every_config_on_three_seeds(tmp_path):
    path = CATALOG / "quickstart.yaml"
    study, cells = loaded(path)
    start = time.monotonic()
    result = run_cli("run", str(path), "--output", str(tmp_path), timeout=900)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(f"quickstart: {len(cells)} cells in {elapsed:.1f} s")
    out = tmp_path / study.name
    done = finished_cells(out / "mlflow.db", study.name)
    assert set(done) == {c.cell_id for c in cells}

    # the report: one row per config, each over the 3 seeds
    from analysis.collect import collect
    from analysis.stats import summarize

    collected = collect(f"sqlite:///{out / 'mlflow.db'}", study.name)
    summary = summarize(collected.table, ["test/top1", "test/top5"]).to_pylist()
    configs = {c.config_id for c in cells}
    by_config: dict[str, list] = {}
    for row in summary:
        by_config.setdefault(row["config_id"], []).append(row)
    assert set(by_config) == configs
    for rows in by_config.values():
        assert all(r["n"] == 3 for r in rows), rows
        assert all(r["half_width"] is not None and r["half_width"] >= 0 for r in rows)
    report_md = out / "report" / "report.md"
    assert report_md.is_file()
    text = report_md.read_text(encoding="utf-8")
    assert "n = 3 seeds per cell" in text
    # the sensitivity curve of the report block was drawn
    assert list((out / "report" / "figures").glob("*epsilon*.png"))
    assert (out / "report" / "figures" / "learning_val_top5.png").exists()
    # and the run ends with the command that opens the MLflow UI
    assert "mlflow ui" in (result.stdout + result.stderr)


@pytest.mark.parametrize("name", sorted(CONFORMAL_STUDIES))
def test_conformal_studies_compare_every_method_at_the_average_k_sizes(name):
    """[Gar23] §2.2.2: LAC and APS, marginal and Mondrian (per class and per shot group),
    calibrated to each average-K set size and at two levels, on every config; the report
    tables show overall and few-shot coverage of average-K beside the size-matched sets, and
    every metric they name is one the trainer logs."""
    from setvalued.config import EVAL_FIELDS
    from setvalued.metrics import check_conformal_metric

    study, cells = loaded(CATALOG / f"{name}.yaml")
    for cell in cells:
        # a config leaves out the implicit fields that hold their defaults
        ev = {**{key: p.default for key, p in EVAL_FIELDS.items()}, **cell.config["eval"]}
        assert ev["avgk"] == CONFORMAL_STUDIES[name]["ks"] and ev["conformal_match_avgk"] is True
        assert ev["conformal_scores"] == ["lac", "aps"]
        assert ev["conformal_mondrian"] == ["marginal", "class", "shot"]
        assert len(ev["conformal_alphas"]) >= 1
    metrics = [m for t in study.report.tables for m in t.metrics]
    for metric in metrics:
        base = re.sub(r"_size$", "", metric)
        if re.match(r"test/(few/|medium/|many/)?(macro_)?avg\d+$", base):
            continue  # average-K (and its group sizes, logged beside the conformal sets)
        assert check_conformal_metric(metric, cells[0].config["eval"], ("test",)) is None, metric
    for prefix in ("test/", "test/few/"):
        assert f"{prefix}avg5" in metrics and f"{prefix}lac_avg5" in metrics and f"{prefix}aps_avg5" in metrics
        assert f"{prefix}lac_class_avg5" in metrics


def test_multilabel_study_compares_sparse_top_with_bce_on_multi_label_data():
    """[Gar23] §6.2: the sparse-top loss against BCE (eq. 6.3) on multi-hot targets, the same
    data and recipe for both, selected on a multi-label metric."""
    from setvalued.label_kinds import is_multi_label

    study, cells = loaded(CATALOG / "sparse_top_multilabel.yaml")
    assert {c.config["loss"]["name"] for c in cells} == {"sparse_top", "bce"}
    assert all(is_multi_label(c.config["data"]) for c in cells)
    rest = [{**c.config, "loss": None} for c in cells]
    assert all(r == rest[0] for r in rest)
    assert cells[0].config["eval"]["selection"] == "val/rprec"
    metrics = [m for t in study.report.tables for m in t.metrics]
    assert {"test/prec1", "test/rprec", "test/few/rec5"} <= set(metrics)


def test_margin_ablation_pairs_differ_only_in_the_margin():
    """[BZK18] Tables 7 and 8: each pair of rows shares (k, tau) and its recipe, margin 0 vs 1,
    and each is selected on the accuracy its table reports. The k = 1, margin 0 row is CE
    ([BZK18] App. D.2.2), so it alone runs without the official hard switch (erratum S-E9c)."""
    _, cells = loaded(CATALOG / "smooth_svm_imagenet_margin.yaml")
    by_variant = {c.variant: c.config for c in cells}
    for k, tau, selection, switches in ((1, 1.0, "val/top1", [False, True]), (5, 0.1, "val/top5", [True, True])):
        pair = [by_variant[f"k{k}_margin{m}"] for m in (0, 1)]
        assert [c["loss"]["alpha"] for c in pair] == [0.0, 1.0]
        assert [c["loss"]["hard_switch"] for c in pair] == switches
        for config in pair:
            assert (config["loss"]["k"], config["loss"]["tau"]) == (k, tau)
            assert config["eval"]["selection"] == selection
        without_margin = [{**c, "loss": {**c["loss"], "alpha": None, "hard_switch": None}} for c in pair]
        assert without_margin[0] == without_margin[1]


# [Gar23] Table 3.3 (the Pl@ntNet-300K baselines of ch. 3), copied here: (lr, epochs, decay
# epochs) of each row and its networks, by the timm names of the paper's torchvision and timm
# networks; alexnet, squeezenet and shufflenet have no timm architecture and are not run.
TABLE_3_3 = [
    (
        (0.01, 30, [20, 25]),
        [
            "mobilenetv2_100",
            "mobilenetv3_large_100",
            "resnet18",
            "resnet34",
            "resnet50",
            "resnet101",
            "resnet152",
            "densenet121",
            "densenet161",
            "densenet169",
            "densenet201",
            "inception_v3",
            "inception_v4",
            "inception_resnet_v2",
            "wide_resnet50_2",
            "wide_resnet101_2",
        ],
    ),
    ((0.001, 30, [20, 25]), ["vgg11", "mobilenetv3_small_100"]),
    (
        (0.01, 20, [10, 15]),
        ["efficientnet_b0", "efficientnet_b1", "efficientnet_b2", "efficientnet_b3", "efficientnet_b4"],
    ),
    ((5e-4, 20, [15]), ["vit_base_patch16_224"]),
]
RECIPE_OF_NETWORK = {name: recipe for recipe, names in TABLE_3_3 for name in names}


@pytest.mark.parametrize(
    "name, networks",
    [
        ("plantnet300k_baselines", set(RECIPE_OF_NETWORK)),
        ("plantnet300k_smooth_svm", {"resnet18", "resnet50", "densenet121", "mobilenetv2_100", "efficientnet_b0"}),
    ],
)
def test_plantnet300k_chapter_3_networks_train_with_their_table_3_3_recipe(name, networks):
    """Every network of the ch. 3 studies runs with its row of [Gar23] Table 3.3 and its own
    weights file; the baselines run every timm network of the table, each once per seed."""
    _, cells = loaded(CATALOG / f"{name}.yaml")
    seen = set()
    for cell in cells:
        config = cell.config
        model = config["model"]["name"]
        seen.add(model)
        lr, epochs, milestones = RECIPE_OF_NETWORK[model]
        assert math.isclose(config["optim"]["lr"], lr, rel_tol=1e-12), (cell.variant, model)
        assert config["epochs"] == epochs and config["optim"]["milestones"] == milestones, (cell.variant, model)
        assert config["model"]["pretrained"] == f"weights/{model}.pth"
    assert seen == networks
    import timm

    assert all(timm.is_model(n) for n in seen)


def test_plantnet300k_smooth_svm_pairs_each_network_with_cross_entropy():
    """Fig. 3.9: per network, the smooth top-5 hinge (tau = 1) and CE differ only in the loss."""
    _, cells = loaded(CATALOG / "plantnet300k_smooth_svm.yaml")
    by_network: dict[str, dict[str, dict]] = {}
    for cell in cells:
        by_network.setdefault(cell.config["model"]["name"], {})[cell.config["loss"]["name"]] = cell.config
    for network, pair in by_network.items():
        assert set(pair) == {"ce", "smooth_topk_svm"}, network
        assert (pair["smooth_topk_svm"]["loss"]["k"], pair["smooth_topk_svm"]["loss"]["tau"]) == (5, 1.0)
        assert {**pair["ce"], "loss": None} == {**pair["smooth_topk_svm"], "loss": None}


def test_readme_maps_every_catalogue_file_and_the_chapter_3_figures():
    """studies/catalog/README.md lists every file, and its map of the seeds' tables and figures
    names the file of each chapter 3 result (or why there is none)."""
    text = (CATALOG / "README.md").read_text(encoding="utf-8")
    for path in catalog_files():
        assert f"`{path.name}`" in text, f"{path.name} is not in the catalogue README"
    rows = {
        line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ") and line.count("|") >= 4
    }
    for figure in ("Table 3.1", "Fig. 3.5", "Fig. 3.6", "Fig. 3.8 (a), (b)"):
        assert "plantnet300k_baselines.yaml" in rows[figure], figure
    assert "plantnet300k_smooth_svm.yaml" in rows["Fig. 3.9"]
    assert "none:" in rows["Fig. 3.7"]
