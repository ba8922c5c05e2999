"""The training loop: learning on the synthetic data, gradient sparsity, the two-head loss,
model selection, resume equivalence, NaN detection, config errors."""

from __future__ import annotations

import copy
import io
import pickle
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from setvalued.config import DATA_FIELDS
from setvalued.data import build_datasets
from setvalued.losses import LOSSES, SetValuedLoss, register_loss
from setvalued.metrics import evaluate
from setvalued.models import build_model
from setvalued.training import NonFiniteLossError, fit, resolve_config
from setvalued.training.checkpoint import training_fields

torch.set_num_threads(1)

L = 20


def small_cfg(loss: dict, epochs: int = 3, **sections) -> dict:
    cfg = {
        "data": {
            "name": "synthetic",
            "num_classes": L,
            "num_superclasses": 4,
            "train_size": 600,
            "val_size": 200,
            "test_size": 300,
        },
        "model": {"name": "mlp", "hidden_dim": 64},
        "loss": loss,
        "optim": {"lr": 0.1, "batch_size": 32, "milestones": [epochs - 1]},
        "epochs": epochs,
        "eval": {"ks": [1, 3, 5], "selection": "val/top5"},
        "device": "cpu",
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            cfg.setdefault(key, {}).update(value)
        else:
            cfg[key] = value
    return cfg


def frequency_baseline(k: int) -> float:
    """Top-k accuracy on the test split of always predicting the k most frequent classes."""
    test = build_datasets(small_cfg({"name": "ce"})["data"]).test
    counts = np.sort(np.bincount(test.targets.numpy(), minlength=L))[::-1]
    return counts[:k].sum() / counts.sum()


def test_ce_beats_chance_by_a_wide_margin():
    result = fit(small_cfg({"name": "ce"}), seed=0)
    test = result["test"]
    assert test["top1"] > frequency_baseline(1) + 0.15  # chance 1/20, majority class ~0.30
    assert test["top5"] > frequency_baseline(5) + 0.2
    assert test["top1"] < test["top5"] - 0.2  # ambiguous data: top-1 well below top-5
    history = result["history"]
    assert len(history) == 3 and history[-1]["train/loss"] < history[0]["train/loss"]
    # CE has a dense gradient: every one of the L coordinates is non-zero for every example
    assert all(h["grad_nonzero"] == L and h["grad_nonzero_active"] == L for h in history)


def test_noised_topk_trains_with_a_sparse_gradient():
    loss = {"name": "noised_topk", "k": 5, "epsilon": 0.2, "n_samples": 3}
    result = fit(small_cfg(loss, epochs=4), seed=1)
    assert result["test"]["top5"] > frequency_baseline(5) + 0.1
    for h in result["history"]:
        # at most M + 1 = 4 non-zero coordinates per example ([Gar23] eq. 4.12; docs/papers.md,
        # note T-N1)
        assert 1 <= h["grad_nonzero_active"] <= 4
        assert h["grad_nonzero"] <= h["grad_nonzero_active"]
    assert result["history"][-1]["grad_nonzero"] < result["history"][-1]["grad_nonzero_active"]


def test_avgk_two_head_trains_and_calibrates_on_validation():
    cfg = small_cfg(
        {"name": "avgk_two_head", "k": 5, "alpha": 1.0}, epochs=3, eval={"avgk": [5], "selection": "val/avg5"}
    )
    result = fit(cfg, seed=0)
    test = result["test"]
    assert test["avg5"] > frequency_baseline(5) + 0.15
    for h in result["history"]:  # the threshold is calibrated on val: mean set size exactly 5
        assert abs(h["val/avg5_size"] - 5.0) <= 1 / 200
        assert 0 < h["val/avg5_threshold"] < 1
    assert abs(test["avg5_size"] - 5.0) < 1.5  # not exact on test
    assert set(result["per_class"]) >= {"avg5", "top5", "train_count", "test_count", "shot"}
    assert result["thresholds"]["5"] == result["history"][result["best_epoch"]]["val/avg5_threshold"]

    # the set-size histogram (thesis Fig. 5.4): counts per (shot group of the label, size)
    sizes = result["set_sizes"]
    assert set(sizes["avgk"]) == {"5"} and set(sizes["shot"]) <= {"few", "medium", "many"}
    assert sum(sizes["count"]) == sum(result["per_class"]["test_count"])
    total = sum(size * count for size, count in zip(sizes["size"], sizes["count"]))
    assert total / sum(sizes["count"]) == pytest.approx(test["avg5_size"], abs=1e-12)
    per_shot = {}
    for shot, count in zip(result["per_class"]["shot"], result["per_class"]["test_count"]):
        per_shot[shot] = per_shot.get(shot, 0) + count
    assert {g: sum(c for s, c in zip(sizes["shot"], sizes["count"]) if s == g) for g in per_shot} == per_shot
    assert len(set(sizes["size"])) > 2  # sets of varying size, the point of average-K
    assert fit(small_cfg({"name": "ce"}, epochs=1), seed=0)["set_sizes"] is None  # no eval.avgk


def test_losses_choose_their_head_and_train_their_own_parameters():
    states = {}
    cfg = small_cfg({"name": "ldam", "max_margin": 0.5, "scale": 30.0}, epochs=2)
    result = fit(cfg, seed=0, on_epoch=lambda e, m, s: states.update({e: s}))
    assert states[1]["model"]["head.weight"].shape == (64, L)  # NormedLinear (head: auto), not nn.Linear
    assert result["test"]["top5"] > frequency_baseline(5) + 0.1

    states.clear()
    cfg = small_cfg(
        {"name": "role", "k": 5, "lambda_": 0.0},
        epochs=2,
        eval={"avgk": [5], "avgk_activation": "sigmoid", "selection": "val/avg5"},
    )
    fit(cfg, seed=0, on_epoch=lambda e, m, s: states.update({e: s}))
    theta0, theta1 = states[0]["loss"]["label_logits"], states[1]["loss"]["label_logits"]
    assert theta0.shape == (600, L) and not torch.equal(theta0, theta1)  # optimised with the model
    groups = states[1]["optimizer"]["param_groups"]
    assert len(groups) == 2 and groups[1]["weight_decay"] == 0.0 and groups[0]["weight_decay"] == 1e-4


def test_selection_and_test_on_the_selected_checkpoint():
    captured = {}

    def on_epoch(epoch, metrics, state):
        captured[epoch] = (metrics, state)

    cfg = small_cfg({"name": "ce"}, epochs=4, optim={"lr": 0.5, "milestones": [1, 3], "gamma": 0.2})
    result = fit(cfg, seed=2, on_epoch=on_epoch)
    history = result["history"]
    assert [h["lr"] for h in history] == pytest.approx([0.5, 0.1, 0.1, 0.02])
    values = [h["val/top5"] for h in history]
    assert result["best_epoch"] == int(np.argmax(values)) and result["best_val"] == max(values)
    assert [captured[e][0]["val/top5"] for e in range(4)] == values
    assert {
        "train/loss",
        "lr",
        "epoch_time_s",
        "grad_nonzero",
        "grad_nonzero_active",
        "val/top1",
        "val/macro_top5",
        "val/few/top5",
    } <= set(history[0])

    # the test metrics are those of the selected checkpoint, recomputed here independently
    state = captured[3][1]
    assert state["best"]["epoch"] == result["best_epoch"]
    splits = build_datasets(cfg["data"])
    model = build_model(cfg["model"], L, splits.input_shape, "linear")
    model.load_state_dict(state["best"]["model"])
    model.eval()
    with torch.no_grad():
        scores = model(splits.test.inputs)
    expected = evaluate(scores, splits.test.targets, [1, 3, 5], splits.class_counts)
    assert result["test"] == pytest.approx(expected, abs=1e-12)

    per_class = result["per_class"]
    assert per_class["train_count"] == splits.class_counts
    assert sum(per_class["test_count"]) == len(splits.test)
    present = [v for v, n in zip(per_class["top5"], per_class["test_count"]) if n > 0]
    assert np.mean(present) == pytest.approx(result["test"]["macro_top5"])


def _run_with_interruption(cfg, seed, stop_after):
    """Run until ``stop_after``, save the state through torch.save, resume from it."""
    saved = {}

    class Stop(Exception):
        pass

    def interrupt(epoch, metrics, state):
        if epoch == stop_after:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            saved["bytes"] = buffer.getvalue()
            raise Stop

    with pytest.raises(Stop):
        fit(cfg, seed, on_epoch=interrupt)
    last = {}
    state = torch.load(io.BytesIO(saved["bytes"]), weights_only=False)
    result = fit(cfg, seed, on_epoch=lambda e, m, s: last.update(state=s), checkpoint=state)
    return result, last["state"]


def _assert_same_run(result_a, state_a, result_b, state_b):
    for key in state_a["model"]:
        assert torch.equal(state_a["model"][key], state_b["model"][key]), key
    for key in state_a["best"]["model"]:
        assert torch.equal(state_a["best"]["model"][key], state_b["best"]["model"][key]), key
    strip = lambda h: [{k: v for k, v in e.items() if not k.endswith("time_s")} for e in h]  # noqa: E731
    assert strip(result_a["history"]) == strip(result_b["history"])
    assert result_a["test"] == result_b["test"]
    assert result_a["best_epoch"] == result_b["best_epoch"]


def test_resume_gives_the_same_final_weights(tmp_path):
    # noised top-K draws noise at every step: the RNG streams must be restored too
    cfg = small_cfg(
        {"name": "noised_topk", "k": 3, "epsilon": 0.5, "n_samples": 2}, epochs=3, optim={"milestones": [1]}
    )
    final = {}
    result_a = fit(cfg, 5, on_epoch=lambda e, m, s: final.update(state=s))
    result_b, state_b = _run_with_interruption(cfg, 5, stop_after=0)
    _assert_same_run(result_a, final["state"], result_b, state_b)
    # resuming from a saved file works the same way
    mid = {}
    fit(cfg, 5, on_epoch=lambda e, m, s: mid.setdefault(e, s))
    torch.save(mid[1], tmp_path / "state.pt")
    last = {}
    result_c = fit(cfg, 5, on_epoch=lambda e, m, s: last.update(state=s), checkpoint=tmp_path / "state.pt")
    _assert_same_run(result_a, final["state"], result_c, last["state"])
    # a different seed gives a different run (the comparison above can fail)
    other = {}
    fit(cfg, 6, on_epoch=lambda e, m, s: other.update(state=s))
    assert not torch.equal(other["state"]["model"]["head.weight"], final["state"]["model"]["head.weight"])

    # a checkpoint of another config is refused, naming the differing key
    changed = copy.deepcopy(cfg)
    changed["optim"]["lr"] = 0.05
    with pytest.raises(ValueError, match="optim.lr"):
        fit(changed, 5, checkpoint=final["state"])
    with pytest.raises(ValueError, match="seed"):
        fit(cfg, 4, checkpoint=final["state"])

    # a checkpoint of an earlier release: its config lacks the fields added since (the data
    # formats' image_size, layout, ...); it resumes to the same run
    earlier = copy.deepcopy(mid[1])
    for field in ("augmentation", "image_size", "layout", "normalize", "val_fraction", "test_fraction"):
        earlier["config"]["data"].pop(field, None)
    last = {}
    result_d = fit(cfg, 5, on_epoch=lambda e, m, s: last.update(state=s), checkpoint=earlier)
    _assert_same_run(result_a, final["state"], result_d, last["state"])
    earlier["config"]["data"]["num_classes"] = 12  # a field of its data set that changed: refused
    with pytest.raises(ValueError, match="data.num_classes"):
        fit(cfg, 5, checkpoint=earlier)
    # the union over the data sets holds None where the data sets' defaults differ; the
    # earlier release held the synthetic set's own default there: the same training
    fresh = resolve_config({"data": {"name": "synthetic"}})
    assert fresh["data"]["num_classes"] is None
    before = copy.deepcopy(fresh)
    before["data"]["num_classes"] = DATA_FIELDS["synthetic"]["num_classes"].default
    for field in ("layout", "normalize"):
        before["data"].pop(field)
    assert training_fields(before) == training_fields(fresh)
    before["optim"]["lr"] *= 2
    assert training_fields(before) != training_fields(fresh)


def write_fake_cifar(root, per_class):
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in (("train", per_class), ("test", 1)):
        fine = rng.permutation(np.repeat(np.arange(100), n))
        # class-dependent mean colour, so the model has something to learn
        data = np.clip(rng.normal(fine[:, None] * 2.5, 30, (len(fine), 3072)), 0, 255).astype(np.uint8)
        with open(folder / name, "wb") as f:
            pickle.dump(
                {
                    "data": data,
                    "fine_labels": fine.tolist(),
                    "coarse_labels": (fine // 5).tolist(),
                    "filenames": [""] * len(fine),
                    "batch_label": name,
                },
                f,
                protocol=2,
            )
    with open(folder / "meta", "wb") as f:
        pickle.dump(
            {"fine_label_names": [str(i) for i in range(100)], "coarse_label_names": [str(i) for i in range(20)]},
            f,
            protocol=2,
        )


@pytest.mark.parametrize("num_workers", [0, 1])  # 0: data on the device (data.placement: auto); 1: a DataLoader
def test_resume_with_augmentation_and_data_loader(tmp_path, num_workers):
    write_fake_cifar(tmp_path, per_class=3)
    cfg = {
        "data": {
            "name": "cifar100",
            "root": str(tmp_path),
            "val_size": 50,
            "label_noise": 0.2,
            "num_workers": num_workers,
        },
        "model": {"name": "small_cnn", "hidden_dim": 8},
        "loss": {"name": "ce"},
        "optim": {"lr": 0.05, "batch_size": 50, "milestones": []},
        "epochs": 3,
        "eval": {"ks": [1, 5]},
        "device": "cpu",
    }
    final = {}
    result_a = fit(cfg, 0, on_epoch=lambda e, m, s: final.update(state=s))
    result_b, state_b = _run_with_interruption(cfg, 0, stop_after=1)
    _assert_same_run(result_a, final["state"], result_b, state_b)


@pytest.fixture
def nan_loss():
    """A CE loss that returns NaN at its ``bad_call``-th call (registered for this test only)."""

    class NaNAfter(SetValuedLoss):
        def __init__(self, bad_call: int = 1, reduction: str = "mean"):
            super().__init__(reduction)
            self.bad_call, self.calls = bad_call, 0

        def forward(self, output, targets, indices=None):
            self.calls += 1
            loss = F.cross_entropy(output, targets)
            return loss * float("nan") if self.calls == self.bad_call else loss

    register_loss("test_nan_after")(NaNAfter)
    try:
        yield "test_nan_after"
    finally:
        LOSSES.pop("test_nan_after", None)


def test_non_finite_loss_stops_with_epoch_and_step(nan_loss):
    cfg = small_cfg({"name": nan_loss, "bad_call": 19 + 3 + 1}, epochs=3)  # 19 steps an epoch (600 / 32)
    with pytest.raises(NonFiniteLossError) as err:
        fit(cfg, seed=0)
    assert (err.value.epoch, err.value.step) == (1, 3)
    assert "epoch 1, step 3" in str(err.value)
    # a divergent learning rate is caught too
    with pytest.raises(NonFiniteLossError, match="epoch 0"):
        fit(small_cfg({"name": "ce"}, epochs=1, optim={"lr": 1e30, "momentum": 0.9}), seed=0)


def test_bad_configs_name_the_key():
    base = small_cfg({"name": "ce"}, epochs=1)
    cases = [
        ({"optim": {"lr": -1}}, "optim.lr"),
        ({"optim": {"batch_szie": 3}}, "optim.batch_szie"),
        ({"optim": {"momentum": 0.0}}, "optim.momentum"),
        ({"epochs": 0}, "epochs"),
        ({"eval": {"selection": "top5"}}, "eval.selection"),
        ({"eval": {"selection": "val/top7"}}, "eval.ks"),
        ({"eval": {"selection": "val/avg5"}}, "eval.avgk"),
        ({"eval": {"selection": "val/top_five"}}, "available: "),
        ({"model": {"head": "two_head"}}, "model.head"),
        ({"loss": {"name": "ce", "k": 5}}, "'k'"),
        ({"loss": {"name": "no_such_loss"}}, "no_such_loss"),
    ]
    for change, fragment in cases:
        cfg = copy.deepcopy(base)
        for key, value in change.items():
            if isinstance(value, dict) and key != "loss":
                cfg[key].update(value)
            else:
                cfg[key] = value
        with pytest.raises(ValueError) as err:
            fit(cfg, seed=0)
        assert fragment in str(err.value), (change, str(err.value))
    with pytest.raises(ValueError, match="model.head"):
        fit({**base, "loss": {"name": "avgk_two_head", "k": 3}, "model": {"name": "mlp", "head": "linear"}}, seed=0)


@pytest.mark.parametrize(
    "config, path",
    [
        ({"loss": {"name": "ce"}, "optimizer": {}}, "optimizer"),
        ({"loss": {"name": "ce"}, "optim": {"learning_rate": 0.1}}, "optim.learning_rate"),
        ({"loss": {"name": "ce"}, "eval": {"k": [5]}}, "eval.k"),
    ],
)
def test_unknown_config_keys_are_named_by_their_dotted_path(config, path):
    from setvalued.training import resolve_config

    with pytest.raises(ValueError, match=rf"unknown key\(s\) in .*: {re.escape(path)};"):
        resolve_config(config)


@pytest.mark.parametrize("builder, section", [("data", "data"), ("model", "model")])
def test_data_and_model_builders_name_unknown_keys(builder, section):
    with pytest.raises(ValueError, match=rf"unknown key\(s\) in {section} config: {section}\.colour;"):
        if builder == "data":
            build_datasets({"name": "synthetic", "colour": 1}, 0)
        else:
            build_model({"name": "mlp", "colour": 1}, input_shape=(8,), num_classes=4, head="linear")


@pytest.fixture
def frozen_loss():
    """A loss with a zero gradient: with no weight decay the weights never move, so the
    running training accuracy of an epoch is the accuracy of the initial model."""

    class ZeroGradient(SetValuedLoss):
        def forward(self, output, targets, indices=None):
            return (output * 0.0).sum()

    register_loss("test_zero_gradient")(ZeroGradient)
    try:
        yield "test_zero_gradient"
    finally:
        LOSSES.pop("test_zero_gradient", None)


def test_training_topk_is_the_running_accuracy_on_the_training_batches(frozen_loss):
    states = {}
    cfg = small_cfg({"name": frozen_loss}, epochs=1, optim={"weight_decay": 0.0})
    history = fit(cfg, seed=3, on_epoch=lambda e, m, s: states.update({e: (m, s)}))["history"]
    metrics, state = states[0]
    splits = build_datasets(cfg["data"])
    model = build_model(cfg["model"], L, splits.input_shape, "linear")
    model.load_state_dict(state["model"])
    with torch.no_grad():
        scores = model(splits.train.inputs)
    expected = evaluate(scores, splits.train.targets, [1, 3, 5], splits.class_counts)
    for k in (1, 3, 5):
        assert metrics[f"train/top{k}"] == pytest.approx(expected[f"top{k}"], abs=1e-12)
        assert history[0][f"train/top{k}"] == metrics[f"train/top{k}"]
    assert 0 < metrics["train/top1"] < metrics["train/top3"] < metrics["train/top5"] < 1
    # training with CE raises it over the epochs
    trained = fit(small_cfg({"name": "ce"}, epochs=3), seed=3)["history"]
    assert trained[-1]["train/top1"] > trained[0]["train/top1"]


class _PlantedCode:
    """Unpickling this object calls os.system: a crafted checkpoint in a shared storage folder."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_file_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "code_ran"
    path = tmp_path / "state.pt"
    torch.save({"format": 1, "epoch": 0, "payload": _PlantedCode(marker)}, path)
    with pytest.raises(ValueError, match="refused") as err:
        fit(small_cfg({"name": "ce"}, epochs=1), seed=0, checkpoint=path)
    assert str(path) in str(err.value)
    assert not marker.exists(), "loading the checkpoint ran code"


def test_probe_times_the_epoch_loop_with_its_data_loading(monkeypatch):
    """`probe` times the steps as an epoch runs them: fetching each batch included (a loader
    that sleeps 20 ms per batch makes every timed step at least that long) and the running
    metrics fed (one `add` per step, the untimed warm-up step included)."""
    import time

    from setvalued.training import trial as train

    batches_of = train.Trial.epoch_batches

    def slow_batches(self, epoch):
        for batch in batches_of(self, epoch):
            time.sleep(0.02)
            yield batch

    adds = []
    add = train.RunningTrainMetrics.add
    monkeypatch.setattr(train.Trial, "epoch_batches", slow_batches)
    monkeypatch.setattr(train.RunningTrainMetrics, "add", lambda self, *args: adds.append(1) or add(self, *args))
    result = train.probe(small_cfg({"name": "ce"}), seed=0, steps=4)
    assert result["step_s"] >= 0.02
    assert len(adds) == 1 + 4
    assert result["steps_per_epoch"] == 19  # ceil(600 / 32)
    assert result["epoch_s"] == pytest.approx(19 * result["step_s"] + result["val_s"])
