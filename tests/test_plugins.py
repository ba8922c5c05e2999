"""Plugins (issue #32): losses, data sets and models from installed distributions' entry points.

The example plugin of examples/plugin is made visible as an installed distribution by a
dist-info folder on a temporary path (tests/plugin_dists.py), on the driver's sys.path and the
Ray workers' PYTHONPATH; nothing is installed into the environment. The slow test runs the
example study on a real local Ray to its report.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

try:
    from tests import plugin_dists
except ImportError:  # pytest run from tests/ with rootdir-relative imports
    import plugin_dists

from setvalued import registry

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_STUDY = ROOT / "examples" / "plugin" / "study.yaml"
VERSION = "0.1.0"


@pytest.fixture()
def example(tmp_path, monkeypatch) -> Path:
    """The example plugin registered in this process (and its subprocesses)."""
    site = plugin_dists.write_example(tmp_path / "site")
    plugin_dists.activate(site, monkeypatch)
    yield site
    registry.clear_cache()


BROKEN_DECLARATIONS = """
from setvalued.params import Param
from setvalued.registry import Declaration

GOOD = Declaration({"alpha": Param("float", 1.0, low=0.0)}, "broken_plugin.code:AlphaLoss")
WRONG = Declaration({"alpha": Param("float", 1.0, low=0.0)}, "broken_plugin.code:BetaLoss")
NOT_A_DECLARATION = {"alpha": 1.0}
RESERVED = Declaration({"reduction": Param("str", "mean")}, "broken_plugin.code:AlphaLoss")
"""
BROKEN_CODE = """
from setvalued.losses import SetValuedLoss


class AlphaLoss(SetValuedLoss):
    def __init__(self, alpha=1.0, reduction="mean"):
        super().__init__(reduction)
        self.alpha = alpha

    def forward(self, output, targets, indices=None):
        return self.reduce(self.alpha * output.logsumexp(1) - output.gather(1, targets[:, None])[:, 0])


class BetaLoss(AlphaLoss):
    def __init__(self, beta=1.0, reduction="mean"):
        super().__init__(beta, reduction)
"""


@pytest.fixture()
def broken(tmp_path, monkeypatch) -> Path:
    """The example plugin and a distribution whose entry points are each broken in one way;
    its console script's module raises when imported (it must never be)."""
    site = plugin_dists.write_example(tmp_path / "site")
    plugin_dists.write_dist(
        site,
        "broken-plugin",
        "2.0",
        {
            "setvalued.losses": {
                "ce": "broken_plugin.declarations:GOOD",  # a built-in's name
                "alpha_loss": "broken_plugin.declarations:GOOD",  # fine
                "fails_import": "broken_plugin.missing_module:GOOD",  # import failure
                "wrong_params": "broken_plugin.declarations:WRONG",  # constructor takes beta
                "not_declared": "broken_plugin.declarations:NOT_A_DECLARATION",
                "reserved": "broken_plugin.declarations:RESERVED",
            },
            "setvalued.models": {"residual_mlp": "broken_plugin.declarations:GOOD"},  # the example's name
            "console_scripts": {"boom": "broken_plugin.boom:main"},
        },
        {
            "broken_plugin": {
                "__init__.py": "",
                "declarations.py": BROKEN_DECLARATIONS,
                "code.py": BROKEN_CODE,
                "boom.py": "raise SystemExit('imported a module of another group')\n",
            }
        },
    )
    plugin_dists.activate(site, monkeypatch)
    yield site
    registry.clear_cache()


FILE_DECLARATIONS = """
from setvalued.params import Param
from setvalued.registry import Declaration

POINTS = Declaration({"path": Param("str", "points.csv", "a CSV file of x0,x1,label rows")},
                     "file_plugin.code:build", check="file_plugin.code:check")
BAD_CHECK = Declaration({}, "file_plugin.code:build", check="file_plugin.missing:check")
LOSS_WITH_CHECK = Declaration({}, "file_plugin.code:build", check="file_plugin.code:check")
"""

FILE_CODE = """
import os

import torch

from setvalued.data import DataSplits, TensorSplit, counts_of

CHECKED = []


def check(path):
    CHECKED.append(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no file {path!r}; expected a CSV of x0,x1,label rows")


def build(*, seed, path="points.csv"):
    rows = [line.split(",") for line in open(path).read().split()]
    x = torch.tensor([[float(a), float(b)] for a, b, _ in rows])
    y = torch.tensor([int(c) for _, _, c in rows])
    counts = counts_of(y, 3)
    splits = [TensorSplit(x, y, num_classes=3, class_counts=counts, class_names=["a", "b", "c"], split=s)
              for s in ("train", "val", "test")]
    return DataSplits(*splits, num_classes=3, class_counts=counts, class_names=["a", "b", "c"], input_shape=(2,))
"""


@pytest.fixture()
def file_plugin(tmp_path, monkeypatch) -> Path:
    """A data set plugin that reads a file and declares a preflight of it."""
    site = tmp_path / "site"
    plugin_dists.write_dist(
        site,
        "file-plugin",
        "0.3",
        {
            "setvalued.datasets": {
                "points": "file_plugin.declarations:POINTS",
                "bad_check": "file_plugin.declarations:BAD_CHECK",
            },
            "setvalued.losses": {"loss_with_check": "file_plugin.declarations:LOSS_WITH_CHECK"},
        },
        {"file_plugin": {"__init__.py": "", "declarations.py": FILE_DECLARATIONS, "code.py": FILE_CODE}},
    )
    plugin_dists.activate(site, monkeypatch)
    yield site
    registry.clear_cache()


def test_a_plugin_data_sets_preflight_runs_before_the_first_trial(file_plugin, tmp_path):
    """``Declaration.check`` is the driver's preflight of a plugin's data, as the built-ins'
    folders are checked: a missing file is refused before Ray or MLflow starts (exit 2, one
    line naming the data set, its distribution and the plugin's own message); a check that
    does not import is refused by name; only data sets may declare one."""
    from studies.running.preconditions import data_layouts

    refused = {r.name: r.reason for r in registry.refusals()}
    assert "data set's preflight" in refused["loss_with_check"]
    missing = tmp_path / "nowhere.csv"
    problems = data_layouts(
        [
            {"name": "points", "path": str(missing), "num_workers": 0, "placement": "auto"},
            {"name": "bad_check", "num_workers": 0, "placement": "auto"},
        ]
    )
    assert problems[0] == (
        f"data set 'points' (file-plugin 0.3, entry point setvalued.datasets:points): no file "
        f"{str(missing)!r}; expected a CSV of x0,x1,label rows"
    )
    assert problems[1].startswith("plugin dataset 'bad_check' (file-plugin 0.3") and "failed to import" in problems[1]
    points = tmp_path / "points.csv"
    points.write_text("\n".join(f"{i % 3},{i % 5},{i % 3}" for i in range(30)))
    assert data_layouts([{"name": "points", "path": str(points), "num_workers": 0, "placement": "auto"}]) == []

    study = tmp_path / "study.yaml"
    study.write_text(
        f"name: pts\nbase: {{data: {{name: points, path: {missing}}}, model: {{name: mlp, hidden_dim: 4}}, "
        f"loss: {{name: ce}}, epochs: 1, device: cpu, eval: {{ks: [1, 2], selection: val/top2}}}}\n"
        f"seeds: [0]\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "studies.cli", "run", str(study), "--output", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "data set 'points' (file-plugin 0.3" in proc.stderr and "no file" in proc.stderr
    assert "starting a local Ray" not in proc.stderr + proc.stdout
    # with the file there the study trains
    study.write_text(study.read_text().replace(str(missing), str(points)))
    from setvalued.training import fit
    from studies.studyfile.configs import design_configs
    from studies.studyfile.spec import load_study

    (config,), _ = design_configs(load_study(study))
    assert 0.0 <= fit(config.config, seed=0)["test"]["top1"] <= 1.0


def _refusal(name: str) -> registry.Refusal:
    return next(r for r in registry.refusals() if r.name == name)


# ============================================================================ the registry


def test_the_example_registers_one_entry_of_each_kind_beside_the_builtins(example):
    expected = {"loss": "ls_topk_hinge", "dataset": "toy_rings", "model": "residual_mlp"}
    for kind, name in expected.items():
        item = registry.entry(kind, name)
        assert item is not None and not item.builtin
        assert (item.distribution, item.version) == ("setvalued-example-plugin", VERSION)
        assert item.entry_point == f"{registry.GROUPS[kind]}:{name}"
        plugins = [n for n, e in registry.entries(kind).items() if not e.builtin]
        assert plugins == [name]
    assert "ce" in registry.entries("loss") and registry.entry("loss", "ce").builtin
    assert registry.refusals() == ()
    source = registry.distribution_source("setvalued-example-plugin")
    assert source.editable and Path(source.path) == plugin_dists.EXAMPLE.resolve()
    assert source.top_level == ("setvalued_example_plugin",)


def test_validating_the_example_study_imports_no_torch(example):
    """The declarations are read without the plugin's torch code: a study is validated lean."""
    code = (
        "import sys; from studies import api; s = api.load(sys.argv[1]); print(len(api.cells(s))); "
        "print(sorted(m for m in sys.modules if m.startswith(('torch', 'setvalued_example_plugin.'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(EXAMPLE_STUDY)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["9", "['setvalued_example_plugin.declarations']"]


def _message(tmp_path: Path, text: str) -> str:
    from studies.studyfile.problems import StudyError
    from studies.studyfile.spec import load_study

    path = tmp_path / "study.yaml"
    path.write_text(text)
    with pytest.raises(StudyError) as caught:
        load_study(path)
    return str(caught.value)


STUDY = """\
name: s
base:
  data: {{name: synthetic, num_classes: 20}}
  model: {{name: mlp}}
  loss: {{name: ce}}
variants:
  v:
    {section}: {{name: {name}, {key}: {value}}}
seeds: [0]
"""


@pytest.mark.parametrize(
    "section, builtin, plugin",
    [
        ("loss", ("hinge_topk", "k", 0), ("ls_topk_hinge", "k", 0)),
        ("loss", ("hinge_topk", "kk", 3), ("ls_topk_hinge", "kk", 3)),
        ("data", ("synthetic", "val_size", 0), ("toy_rings", "val_size", 0)),
        ("data", ("synthetic", "num_classes", 1.5), ("toy_rings", "num_classes", 1.5)),
        ("model", ("mlp", "hidden_dim", 0), ("residual_mlp", "width", 0)),
        ("model", ("mlp", "hidden_dim", "wide"), ("residual_mlp", "width", "wide")),
    ],
)
def test_a_plugins_wrong_parameter_gets_a_builtins_message_and_line(example, tmp_path, section, builtin, plugin):
    """The same mistake on a built-in and on a plugin: the same words, path and line."""

    def message(name, key, value):
        text = _message(tmp_path, STUDY.format(section=section, name=name, key=key, value=value))
        return text.replace(name, "NAME").replace(key, "KEY")

    got, expected = message(*plugin), message(*builtin)
    assert f"variants.v.{section}.KEY (line 8)" in got
    if builtin[1] == "kk":  # the accepted parameters differ; the message's form does not
        assert (
            "loss 'NAME' has no parameter 'KEY' (did you mean 'k'?); accepted parameters: k, smoothing, margin" in got
        )
        assert "loss 'NAME' has no parameter 'KEY' (did you mean 'k'?); accepted parameters: k." in expected
    else:
        assert got == expected


def test_plugin_names_get_did_you_mean_and_sweeps_check_their_parameters(example, tmp_path):
    text = _message(tmp_path, STUDY.format(section="loss", name="ls_topk_hinj", key="k", value=3))
    assert "unknown loss 'ls_topk_hinj' (did you mean 'ls_topk_hinge'?)" in text and "(line 8)" in text
    text = _message(tmp_path, STUDY.format(section="data", name="toy_ring", key="noise", value=0.1))
    assert "unknown data set 'toy_ring' (did you mean 'toy_rings'?)" in text
    text = _message(
        tmp_path,
        STUDY.format(section="loss", name="ls_topk_hinge", key="k", value=3)
        + "design:\n  - kind: grid\n    variants: [v]\n    parameters: {loss.smoothing: [0.0, 1.5]}\n",
    )
    assert "design[0].parameters.loss.smoothing[1] (line 13): smoothing must be in [0.0, 1.0), got 1.5" in text


def test_a_derived_plugin_parameter_is_checked_against_its_declaration(example, tmp_path):
    text = _message(
        tmp_path,
        """\
name: d
base:
  data: {name: toy_rings}
  model: {name: residual_mlp}
  loss: {name: ls_topk_hinge, k: 3}
design:
  - kind: grid
    parameters: {loss.smoothing: [0.1, 0.2]}
derived:
  loss.margin: "-10 * loss.smoothing"
seeds: [0]
""",
    )
    assert "derived.loss.margin (line 10): margin must be >= 0.0, got -1.0 (with loss.smoothing=0.1)" in text


def test_studies_show_fills_a_plugins_defaults_like_a_builtins(example, capsys):
    from studies.cli import main

    assert main(["show", str(EXAMPLE_STUDY), "ls_topk_hinge"]) == 0
    out = capsys.readouterr().out
    assert "name: ls_topk_hinge" in out and "smoothing: 0.1" in out and "margin: 1.0" in out
    assert "name: toy_rings" in out and "split_seed: 7" in out and "blocks: 2" in out


def test_reference_tables_list_plugins_only_when_asked(example):
    from setvalued.reference_tables import loss_parameter_table, trial_config_table

    assert "ls_topk_hinge" not in loss_parameter_table() and "toy_rings" not in trial_config_table()
    assert "| `ls_topk_hinge` (plugin setvalued-example-plugin) | `smoothing` | `0.1` |" in loss_parameter_table(
        plugins=True
    )
    table = trial_config_table(plugins=True)
    assert "| `data.noise` | `0.15` |" in table and "toy_rings only; plugin setvalued-example-plugin" in table
    assert "| `model.width` | `64` |" in table


def test_broken_plugins_are_refused_by_distribution_and_entry_point(broken, tmp_path):
    assert "broken_plugin.boom" not in sys.modules  # another group's module is never imported
    assert registry.entry("loss", "alpha_loss").distribution == "broken-plugin"
    assert registry.entry("loss", "ce").builtin
    assert registry.entry("model", "residual_mlp") is None  # two distributions claim it: neither wins
    clash = _refusal("ce")
    assert (clash.distribution, clash.version, clash.entry_point) == ("broken-plugin", "2.0", "setvalued.losses:ce")
    assert "is a built-in loss's" in clash.message() and "broken-plugin 2.0" in clash.message()
    assert "failed to import: ModuleNotFoundError" in _refusal("fails_import").reason
    assert "expected a setvalued.registry.Declaration" in _refusal("not_declared").reason
    assert "parameter 'reduction' is set by the trainer" in _refusal("reserved").reason
    assert {(r.distribution, r.reason) for r in registry.refusals() if r.name == "residual_mlp"} == {
        ("broken-plugin", "the name 'residual_mlp' is also registered by setvalued-example-plugin; uninstall one"),
        ("setvalued-example-plugin", "the name 'residual_mlp' is also registered by broken-plugin; uninstall one"),
    }
    assert registry.entry("loss", "wrong_params") is not None  # declarations are fine; its code is not
    with pytest.raises(
        registry.PluginError,
        match=r"loss 'wrong_params' \(broken-plugin 2.0, entry point "
        r"setvalued.losses:wrong_params\): declares parameter\(s\) alpha that "
        r"broken_plugin.code:BetaLoss does not take \(it takes beta, reduction\)",
    ):
        registry.load_factory("loss", "wrong_params")
    message = _message(tmp_path, STUDY.format(section="loss", name="fails_import", key="alpha", value=1))
    assert (
        "unknown loss 'fails_import' (plugin loss 'fails_import' of distribution broken-plugin 2.0 (entry "
        "point setvalued.losses:fails_import) refused: its declaration"
    ) in message
    from studies.running.preconditions import plugin_code

    problems = plugin_code([{"loss": {"name": "wrong_params"}}, {"loss": {"name": "alpha_loss"}}])
    assert len(problems) == 1 and "broken-plugin 2.0, entry point setvalued.losses:wrong_params" in problems[0]


def test_studies_plugins_lists_entries_and_refusals_in_80_columns(broken, capsys):
    from studies.cli import main

    assert main(["plugins"]) == 1  # something is refused
    out = capsys.readouterr().out
    assert all(len(line) <= 80 for line in out.splitlines()), max(out.splitlines(), key=len)
    flat = " ".join(out.split())
    assert "losses (loss.name): 15 built-in, 3 plugin(s), 4 refused" in flat
    assert "ls_topk_hinge [setvalued-example-plugin 0.1.0, entry point setvalued.losses:ls_topk_hinge]" in flat
    assert "loss.smoothing: a number in [0.0, 1.0); default 0.1; label smoothing" in flat
    assert "data.noise: a number >= 0.0; default 0.15" in flat
    assert "REFUSED: loss 'wrong_params' (broken-plugin 2.0, entry point setvalued.losses:wrong_params)" in flat
    assert "REFUSED ce [broken-plugin 2.0, entry point setvalued.losses:ce]: the name 'ce' is a built-in" in flat
    assert "REFUSED fails_import" in flat and "REFUSED residual_mlp" in flat


def test_every_builtin_data_set_has_its_builder():
    """A built-in data set is its fields (setvalued.config.DATA_FIELDS) and one builder line."""
    from setvalued.config import DATA_FIELDS

    assert list(registry.BUILTIN_DATASET_BUILDERS) == list(DATA_FIELDS)
    for name in DATA_FIELDS:
        assert callable(registry.load_factory("dataset", name))


def test_discovery_is_cached_per_process(example, monkeypatch):
    registry.entries("loss")
    calls = []
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: calls.append(kw) or real(**kw))
    for kind in registry.KINDS:
        registry.entries(kind)
        registry.entry(kind, "x")
    assert calls == []


# ============================================================================ the trainer


def test_the_label_smoothed_hinge_matches_its_definition_by_brute_force(example):
    import torch

    loss_cls = registry.load_factory("loss", "ls_topk_hinge")
    torch.manual_seed(0)
    scores = torch.randn(6, 7).round(decimals=1)  # ties included
    targets = torch.randint(0, 7, (6,))
    loss = loss_cls(k=2, smoothing=0.3, margin=0.5, reduction="none")
    expected = []
    for s, y in zip(scores.tolist(), targets.tolist()):

        def hinge(c):
            others = sorted((v for j, v in enumerate(s) if j != c), reverse=True)
            return max(0.0, 0.5 + others[1] - s[c])

        expected.append(0.7 * hinge(y) + 0.3 * sum(hinge(c) for c in range(7)) / 7)
    assert torch.allclose(loss(scores, targets), torch.tensor(expected), atol=1e-6)


def test_fit_trains_with_a_plugin_loss_data_set_and_model(example):
    from setvalued.training import fit
    from studies.studyfile.trial_config import validate_config

    config, problems = validate_config(
        {
            "data": {"name": "toy_rings", "train_size": 120, "val_size": 24, "test_size": 24},
            "model": {"name": "residual_mlp", "width": 8, "blocks": 1},
            "loss": {"name": "ls_topk_hinge", "k": 3},
            "epochs": 1,
            "device": "cpu",
            "eval": {"ks": [1, 3], "selection": "val/top3"},
        }
    )
    assert problems == []
    result = fit(config, seed=0)
    assert 0.0 <= result["test"]["top3"] <= 1.0 and result["per_class"]["name"][5] == "ring1_sector1"
    from setvalued.training import resolve_config

    resolved = resolve_config(
        {"data": {"name": "toy_rings"}, "model": {"name": "residual_mlp"}, "loss": {"name": "ce"}}
    )  # a plugin's own defaults, not the built-ins'
    assert resolved["data"] == {
        "name": "toy_rings",
        "num_workers": 0,
        "placement": "auto",
        "num_classes": 12,
        "train_size": 1200,
        "val_size": 300,
        "test_size": 600,
        "noise": 0.15,
        "split_seed": 7,
    }
    assert resolved["model"] == {"name": "residual_mlp", "head": "auto", "width": 64, "blocks": 2}
    with pytest.raises(ValueError, match="unknown key.*data.noize"):
        fit({**config, "data": {**config["data"], "noize": 0.1}}, seed=0)


def test_an_in_memory_plugin_data_set_is_held_on_the_device(example):
    """toy_rings' splits are TensorSplits without a transform: auto (no loader workers) and
    device hold them on the training device, like the built-in in-memory sets; loader, or a
    split with a per-example transform, uses a DataLoader (device then refused, naming it)."""
    from setvalued.data import TensorSplit
    from setvalued.training import Trial, resolve_config

    def trial(**data):
        return Trial(
            resolve_config(
                {
                    "data": {"name": "toy_rings", "train_size": 60, "val_size": 12, "test_size": 12, **data},
                    "loss": {"name": "ce"},
                    "device": "cpu",
                }
            ),
            0,
        )

    held = trial().on_device
    assert held is not None and set(held) == {"train", "val", "test"}
    assert trial(placement="device").on_device is not None
    assert trial(placement="loader").on_device is None and trial(num_workers=1).on_device is None
    transformed = trial(placement="loader")
    for ds in transformed.data:
        assert isinstance(ds, TensorSplit)
        ds.transform = lambda x: x
    transformed.cfg = {**transformed.cfg, "data": {**transformed.cfg["data"], "placement": "device"}}
    with pytest.raises(ValueError, match="data.placement: device needs in-memory splits.*toy_rings"):
        transformed._device_splits()


def test_a_run_logs_every_field_a_plugin_model_declares(example, tmp_path, monkeypatch):
    """A plugin model's own ``hidden_dim`` and ``depth`` are its parameters: its run logs them
    (the built-in fields of those names apply to some built-in models only)."""
    from studies.studyfile.trial_config import validate_config
    from studies.tracking.contract import config_params

    site = plugin_dists.write_dist(
        tmp_path / "deep",
        "deep-plugin",
        "1.0",
        {"setvalued.models": {"deep_mlp": "deep_plugin.declarations:DEEP"}},
        {
            "deep_plugin": {
                "__init__.py": "",
                "declarations.py": (
                    "from setvalued.params import Param\nfrom setvalued.registry import Declaration\n"
                    "DEEP = Declaration({'hidden_dim': Param('int', 16, low=1), 'depth': Param('int', 2, low=1)},"
                    " 'deep_plugin.code:build')\n"
                ),
            }
        },
    )
    plugin_dists.activate(site, monkeypatch)
    base = {"data": {"name": "toy_rings"}, "loss": {"name": "ce"}, "device": "cpu"}
    config, problems = validate_config({**base, "model": {"name": "deep_mlp", "hidden_dim": 32, "depth": 3}})
    assert problems == []
    params = config_params(config)
    assert (params["model.hidden_dim"], params["model.depth"]) == ("32", "3")
    builtin, problems = validate_config({**base, "model": {"name": "mlp"}})
    assert problems == [] and "model.depth" not in config_params(builtin)
    assert config_params(builtin)["model.hidden_dim"] == "128"


# ============================================================================ submission


def test_submit_ships_a_local_plugin_and_pins_an_index_one(example, tmp_path):
    from studies.cluster.connection import SubmitError
    from studies.cluster.plugin_shipping import ship_plugins

    plugin_dists.write_dist(example, "indexed-plugin", "1.2.3", {"setvalued.losses": {}}, {})
    plugin_dists.write_dist(example, "vcs-plugin", "0.9", {"setvalued.losses": {}}, {})
    (next(example.glob("vcs_plugin-*.dist-info")) / "direct_url.json").write_text(
        json.dumps({"url": "https://example.org/p.git", "vcs_info": {"vcs": "git", "commit_id": "abc"}})
    )
    staging = tmp_path / "working_dir"
    staging.mkdir()
    env = ship_plugins(["setvalued-example-plugin", "indexed-plugin"], staging)
    assert env == {"pip": ["indexed-plugin==1.2.3"]}
    assert (staging / "setvalued_example_plugin" / "declarations.py").is_file()
    shipped = list(importlib.metadata.distributions(path=[str(staging)]))
    assert [(d.metadata["Name"], d.version) for d in shipped] == [("setvalued-example-plugin", VERSION)]
    assert {p.name for p in shipped[0].entry_points} == {"ls_topk_hinge", "toy_rings", "residual_mlp"}
    with pytest.raises(
        SubmitError,
        match="plugin distribution vcs-plugin cannot be made available on the "
        "cluster: it was installed from https://example.org/p.git",
    ):
        ship_plugins(["vcs-plugin"], tmp_path)
    with pytest.raises(SubmitError, match="its package 'setvalued_example_plugin' has the name of a file"):
        ship_plugins(["setvalued-example-plugin"], staging)  # already there


# ============================================================================ a real local Ray


@pytest.mark.slow
def test_the_example_study_runs_on_local_ray_and_records_the_plugin(example, tmp_path):
    """The workers register the plugin (they share the driver's environment); every cell run
    carries the plugin's version, and so does the report's provenance."""
    from mlflow import MlflowClient

    from studies import api

    out = tmp_path / "out"
    outcome = api.run(
        EXAMPLE_STUDY,
        output=out,
        num_cpus=2,
        stream=io.StringIO(),
        overrides=["epochs=1", "seeds=[0]", "data.train_size=240"],
    )
    assert outcome.exit_code == 0 and outcome.failed == {}
    client = MlflowClient(f"sqlite:///{out / 'plugin_example' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("plugin_example")
    runs = client.search_runs([experiment.experiment_id], "tags.`studies.role` = 'cell'")
    assert len(runs) == 3 and {r.data.tags["studies.status"] for r in runs} == {"finished"}
    assert {r.data.tags["studies.plugins"] for r in runs} == {f"setvalued-example-plugin=={VERSION}"}
    assert {r.data.params["loss.name"] for r in runs} == {"ce", "noised_topk", "ls_topk_hinge"}
    report = outcome.report_path.with_suffix(".md").read_text()
    assert f"- **plugins (losses, data sets, models)**: setvalued-example-plugin=={VERSION}" in report


def test_studies_plugins_shows_the_parameters_of_every_builtin(capsys):
    """The built-ins with their parameters, as the plugins (issue 42): each loss's, each data
    set's, and each model's that apply to it (no DenseNet depth for the MLP)."""
    from studies.cli import main

    assert main(["plugins", "--no-import"]) == 0
    out = capsys.readouterr().out
    assert all(len(line) <= 80 for line in out.splitlines()), max(out.splitlines(), key=len)
    blocks: dict[str, list[str]] = {}  # entry -> the lines under it
    entry = None
    for line in out.splitlines():
        if line.startswith("  ") and not line.startswith("   ") and line.rstrip().endswith("]"):
            entry = line.split()[0]
            blocks[entry] = []
        elif line.startswith("    ") and entry is not None:
            blocks[entry].append(line)
        else:
            entry = None
    blocks = {name: " ".join(" ".join(lines).split()) for name, lines in blocks.items()}
    assert "loss.k: an integer >= 1; default 5; the K of top-K" in blocks["noised_topk"]
    assert "loss.epsilon: a number >= 0.0; default 1.0" in blocks["noised_topk"]
    assert blocks["ce"] == "(no parameters)"
    assert "data.num_classes: " in blocks["synthetic"] and "data.label_noise: " in blocks["cifar100"]
    assert "model.hidden_dim: " in blocks["mlp"] and "model.depth" not in blocks["mlp"]
    assert "model.depth: " in blocks["densenet_bc_cifar"] and "model.growth_rate: " in blocks["densenet_bc_cifar"]
