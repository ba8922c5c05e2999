"""Seeds fused into one model (issue 35): each member of a fused array equals the separate trial
of its seed (float64, CPU: per-epoch losses and metrics, the selected checkpoint, the test pass),
for CE, the noised top-K, the smooth top-K SVM and the two-head loss, on the MLP and a DenseNet-BC
with BatchNorm; a killed array resumes to the uninterrupted one; a member whose loss goes
non-finite fails alone; a model that cannot be fused is refused, naming the model and reason."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from setvalued.fused import FusionError, fit_array, fusion_problem
from setvalued.training import NonFiniteLossError, Trial, fit, resolve_config

LOSSES = {
    "ce": {"name": "ce"},
    "noised_topk": {"name": "noised_topk", "k": 3, "epsilon": 0.2, "n_samples": 3},
    "smooth_topk_svm": {"name": "smooth_topk_svm", "k": 3, "tau": 1.0, "alpha": 1.0},
    "avgk_two_head": {"name": "avgk_two_head", "k": 3},
}
MODELS = {
    "mlp": ({"name": "mlp", "hidden_dim": 16}, {"form": "features"}),
    "densenet_bc": ({"name": "densenet_bc_cifar", "depth": 10, "growth_rate": 4}, {"form": "images"}),
}


@pytest.fixture(autouse=True)
def float64():
    """Every model and loss in float64, so that 1e-9 measures the fusion, not float32 rounding."""
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    yield
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)


def tiny_cfg(loss: str = "ce", model: str = "mlp", epochs: int = 2) -> dict:
    model_cfg, data = MODELS[model]
    images = data["form"] == "images"
    return {
        "data": {
            "name": "synthetic",
            "num_classes": 8,
            "num_superclasses": 2,
            "train_size": 48 if images else 96,
            "val_size": 24,
            "test_size": 24,
            **data,
        },
        "model": dict(model_cfg),
        "loss": dict(LOSSES[loss]),
        "optim": {"lr": 0.05, "batch_size": 16, "milestones": [1], "weight_decay": 5e-4},
        "epochs": epochs,
        "eval": {"ks": [1, 3], "selection": "val/top3", "avgk": [2], "batch_size": 16},
        "device": "cpu",
    }


#: the separate trials, fitted once for the module: (loss, model, epochs, seed) -> fit's result
_SEPARATE: dict[tuple[str, str, int, int], dict] = {}


def separate_trial(loss: str, model: str, seed: int, epochs: int = 2) -> dict:
    """``fit`` of ``tiny_cfg(loss, model, epochs)`` for ``seed``, shared by the tests that
    compare with it (a result is only read)."""
    key = (loss, model, epochs, seed)
    if key not in _SEPARATE:
        _SEPARATE[key] = fit(tiny_cfg(loss, model, epochs), seed)
    return _SEPARATE[key]


def differences(separate: dict, member: dict) -> float:
    """The largest difference between two results: every per-epoch number (times aside), the
    best epoch and value, the thresholds, every test metric and per-class rate."""
    assert len(separate["history"]) == len(member["history"])
    worst = 0.0

    def compare(a, b):
        nonlocal worst
        if isinstance(a, float) and math.isnan(a):
            assert math.isnan(b)
            return
        worst = max(worst, abs(a - b))

    for ours, theirs in zip(separate["history"], member["history"]):
        assert ours.keys() == theirs.keys()
        for key in ours:
            if not key.endswith("_time_s"):
                compare(ours[key], theirs[key])
    assert separate["best_epoch"] == member["best_epoch"]
    compare(separate["best_val"], member["best_val"])
    assert separate["test"].keys() == member["test"].keys()
    for key in separate["test"]:
        compare(separate["test"][key], member["test"][key])
    for key, value in separate["thresholds"].items():
        compare(value, member["thresholds"][key])
    for key, column in separate["per_class"].items():
        if key.startswith(("top", "avg")):
            for a, b in zip(column, member["per_class"][key]):
                compare(a, b)
    return worst


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("loss", list(LOSSES))
def test_each_member_equals_the_separate_trial_of_its_seed(loss, model):
    cfg = tiny_cfg(loss, model)
    seeds = [0, 1]
    separate = [separate_trial(loss, model, seed) for seed in seeds]
    fused = fit_array(cfg, seeds)
    for ours, member in zip(separate, fused):
        assert differences(ours, member) <= 1e-9
    # the comparison has teeth: the seeds' trials differ from each other
    assert abs(separate[0]["history"][0]["train/loss"] - separate[1]["history"][0]["train/loss"]) > 1e-3


def test_a_killed_array_resumes_to_the_uninterrupted_one_and_a_member_state_resumes_its_trial():
    cfg = tiny_cfg("noised_topk", "densenet_bc")
    seeds = [0, 1, 2]
    states: dict[tuple[int, int], dict] = {}
    whole = fit_array(cfg, seeds, on_epoch=lambda i, epoch, metrics, state: states.__setitem__((i, epoch), state))
    assert sorted(states) == [(i, e) for i in range(3) for e in range(2)]
    resumed = fit_array(cfg, seeds, checkpoints=[copy.deepcopy(states[(i, 0)]) for i in range(3)])
    for a, b in zip(whole, resumed):
        assert differences(a, b) == 0.0
    # a member's state is its separate trial's: the trial resumes from it to the same end
    alone = fit(cfg, seeds[1], checkpoint=copy.deepcopy(states[(1, 0)]))
    assert differences(alone, whole[1]) <= 1e-9


def test_a_member_whose_loss_goes_non_finite_fails_alone(monkeypatch):
    cfg = tiny_cfg("ce", "mlp")
    seeds = [0, 1, 2]
    separate = {seed: separate_trial("ce", "mlp", seed) for seed in (0, 2)}
    from setvalued.losses import LOSSES as REGISTRY

    ce = REGISTRY["ce"]
    original = ce.forward

    def poisoned(self, scores, targets, indices=None):  # the loss of member 1 (its 3rd step) is NaN
        value = original(self, scores, targets, indices)
        self.calls = getattr(self, "calls", 0) + 1
        return value * float("nan") if getattr(self, "poisoned", False) and self.calls == 3 else value

    monkeypatch.setattr(ce, "forward", poisoned)
    build = Trial.__init__

    def mark(self, cfg, seed, **shared):
        build(self, cfg, seed, **shared)
        self.loss.poisoned = seed == 1

    monkeypatch.setattr(Trial, "__init__", mark)
    seen = []
    results = fit_array(cfg, seeds, on_epoch=lambda i, epoch, metrics, state: seen.append((i, epoch)))
    assert isinstance(results[1], NonFiniteLossError)
    assert (results[1].epoch, results[1].step) == (0, 2)
    assert (1, 0) not in seen and (0, 1) in seen and (2, 1) in seen
    for i, seed in ((0, 0), (2, 2)):
        assert differences(separate[seed], results[i]) <= 1e-9


def test_a_model_that_cannot_be_fused_is_refused_naming_model_and_reason(monkeypatch):
    import setvalued.fused.array as fused_module

    monkeypatch.setattr(fused_module, "fusion_problem", lambda models, trial: "its reason")
    with pytest.raises(
        FusionError, match=r"model 'mlp' cannot be fused: its reason \(run it with seeds_per_trial: 1\)"
    ):
        fit_array(tiny_cfg(), [0, 1])
    monkeypatch.undo()
    # a forward pass that draws random numbers (dropout) has no fused form that keeps each
    # member's draws: the one-batch probe names it
    trial = Trial(resolve_config(tiny_cfg()), 0)
    with_dropout = [torch.nn.Sequential(copy.deepcopy(trial.model), torch.nn.Dropout(0.5)) for _ in range(2)]
    reason = fusion_problem(with_dropout, trial)
    assert reason is not None and "random" in reason
    assert fusion_problem([trial.model, copy.deepcopy(trial.model)], trial) is None


def test_fused_arrays_refuse_bad_seed_lists():
    with pytest.raises(ValueError, match="distinct seeds"):
        fit_array(tiny_cfg(), [1, 1])


def test_members_share_one_copy_of_seed_free_splits():
    """A data set that is the same for every seed is built, and held on the device, once per
    array (an image folder is decoded once, not per member); CIFAR-100 with label noise and a
    plugin's data (their builders take the seed) are not shared."""
    from setvalued.data import seed_free
    from setvalued.fused import Array
    from setvalued.training import resolve_config

    cfg = resolve_config({**tiny_cfg(), "data": {**tiny_cfg()["data"], "placement": "device"}})
    array = Array(cfg, [0, 1, 2])
    first = array.members[0]
    assert all(m.data is first.data and m.on_device is first.on_device for m in array.members[1:])
    assert first.on_device is not None
    assert seed_free({"name": "cifar100", "label_noise": 0.0}) and seed_free({"name": "arrays"})
    assert not seed_free({"name": "cifar100", "label_noise": 0.2}) and not seed_free({"name": "no_such_set"})


def test_a_members_model_is_its_own_after_training(tmp_path):
    """The model a member hands back (the one MLflow logs) holds that member alone: saved, it
    is the size of one model, not of the array."""
    cfg = tiny_cfg(epochs=1)
    results = fit_array(cfg, [0, 1, 2])
    single = fit(cfg, 0)["model"]
    sizes = []
    for name, model in (("fused", results[0]["model"]), ("single", single)):
        torch.save(model.state_dict(), tmp_path / name)
        sizes.append((tmp_path / name).stat().st_size)
    assert sizes[0] <= sizes[1] * 1.05
    x = torch.randn(4, 32)
    assert torch.allclose(results[0]["model"].eval()(x), single.eval()(x), atol=1e-9)


def test_an_array_stopped_after_an_epoch_is_its_seeds_trials_with_the_epochs_cut():
    """Early stopping stops an array as a whole (``after_epoch`` answers STOP): every member then
    tests the checkpoint it selected so far, as ``fit`` with ``epochs`` cut to the epochs done."""
    from setvalued.fused import STOP

    cfg = tiny_cfg("noised_topk", epochs=4)
    asked = []
    stopped = fit_array(cfg, [0, 1], after_epoch=lambda epoch: asked.append(epoch) or (STOP if epoch == 1 else None))
    assert asked == [0, 1]
    for seed, member in zip((0, 1), stopped):
        assert len(member["history"]) == 2
        assert differences(separate_trial("noised_topk", "mlp", seed), member) <= 1e-9


def test_members_that_select_different_epochs_test_their_own_checkpoints():
    """The test pass scores every member at once, each with the checkpoint it selected: here
    the members selected different epochs, and each still equals its separate trial."""
    cfg = tiny_cfg("noised_topk", epochs=3)
    seeds = [0, 1, 2]
    fused = fit_array(cfg, seeds)
    assert len({member["best_epoch"] for member in fused}) > 1
    for seed, member in zip(seeds, fused):
        assert differences(separate_trial("noised_topk", "mlp", seed, epochs=3), member) <= 1e-9


def test_members_with_their_own_data_draw_and_evaluate_one_by_one(monkeypatch):
    """Members that do not share their splits (data that depends on the seed) draw their
    batches under their own random states and are evaluated one by one: still their trials."""
    import setvalued.fused.array as fused_module

    monkeypatch.setattr(fused_module, "seed_free", lambda data: False)
    cfg = tiny_cfg("noised_topk", "densenet_bc")
    array = fused_module.Array(resolve_config(cfg), [0, 1])
    assert array.gather is None and array.predict("val") is None
    for seed, member in zip((0, 1), fit_array(cfg, [0, 1])):
        assert differences(separate_trial("noised_topk", "densenet_bc", seed), member) <= 1e-9


@pytest.mark.parametrize("model", list(MODELS))
def test_compile_model_on_an_array_equals_its_seeds_eager_trials(model, monkeypatch):
    """``compile: model`` on an array compiles the stacked model's forward passes (here with
    dynamo's aot_eager backend on the CPU: capture, functionalisation of BatchNorm's in-place
    statistics and the autograd graphs, without inductor's code generation): each member still
    equals its separate eager trial, and the array leaves no compiled graph behind."""
    from torch._dynamo.backends.registry import lookup_backend

    from setvalued.fused import Array
    from setvalued.training import compiled_step

    graphs = []

    def counting(graph, example_inputs):
        graphs.append(graph)
        return lookup_backend("aot_eager")(graph, example_inputs)

    monkeypatch.setattr(compiled_step, "backend", counting)
    cfg = {**tiny_cfg("noised_topk", model), "compile": "model"}
    array = Array(resolve_config(cfg), [0, 1])
    assert array.step.compiled
    results = array.run()
    assert graphs and not array.step.compiled  # compiled while it ran, released at its end
    for seed, member in zip((0, 1), results):
        assert differences(separate_trial("noised_topk", model, seed), member) <= 1e-9


def test_members_sharing_an_in_memory_split_read_a_steps_batches_in_one_gather():
    """Data held in memory (``placement: loader``, no workers, no transform): the members' batches
    of a step are one gather of their orders, and each member is still its trial."""
    from setvalued.fused import Array

    cfg = tiny_cfg("noised_topk")
    cfg["data"]["placement"] = "loader"
    array = Array(resolve_config(cfg), [0, 1])
    assert array.members[0].on_device is None and array.gather is not None
    for seed, member in zip((0, 1), array.run()):
        assert differences(fit(cfg, seed), member) <= 1e-9


def _cuda_accepts_batch_norm(args) -> bool:
    """The CUDA kernel's rule for ``native_batch_norm``/``cudnn_batch_norm`` (input, weight,
    bias, running mean, running var): every tensor of the input's dtype, or a bfloat16/float16
    input with every other tensor in float32 (the mixed form cuDNN and the native kernel take)."""
    inputs, *others = args[:5]
    others = [t for t in others if isinstance(t, torch.Tensor)]
    if all(t.dtype == inputs.dtype for t in others):
        return True
    return inputs.dtype in (torch.bfloat16, torch.float16) and all(t.dtype == torch.float32 for t in others)


def test_a_fused_densenet_under_cuda_autocast_hands_batch_norm_dtypes_the_cuda_kernel_takes():
    """Measured on an H200: under bfloat16 autocast the stacked DenseNet's BatchNorm reached the
    kernel with bfloat16 weights and float32 statistics ("Expected running_mean to have type
    BFloat16 but got Float"), and every array of the GPU check failed. On fake CUDA tensors the
    real step's every batch_norm call is seen and checked against the kernel's dtype rule."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from setvalued.fused import FusedStep
    from setvalued.losses.topk import CrossEntropy
    from setvalued.models import build_model
    from tests.gpu_audit import fake_cuda, fake_cuda_autocast

    torch.set_default_dtype(torch.float32)  # the GPU's training dtype
    calls = []

    class BatchNormCalls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "batch_norm" in func.__name__ and "backward" not in func.__name__:
                calls.append((func.__name__, args))
            return func(*args, **(kwargs or {}))

    cfg = resolve_config(tiny_cfg(model="densenet_bc"))
    models = [build_model(cfg["model"], 8, (3, 32, 32)) for _ in range(2)]
    step = FusedStep(cfg, torch.device("cpu"), models, [CrossEntropy(), CrossEntropy()], torch.bfloat16, compiled=False)
    step.start_training()
    with fake_cuda():
        params = {k: v.detach().to("cuda").requires_grad_() for k, v in step.params.items()}
        buffers = {k: v.to("cuda") for k, v in step.buffers.items()}
        x = torch.randn(2, 4, 3, 32, 32, device="cuda")
        with fake_cuda_autocast(), BatchNormCalls():
            output = step.forward(params, buffers, x)
    assert output.shape == (2, 4, 8)
    assert len(calls) >= 5  # every BatchNorm of the DenseNet
    refused = [
        (name, [t.dtype for t in args[:5] if isinstance(t, torch.Tensor)])
        for name, args in calls
        if not _cuda_accepts_batch_norm(args)
    ]
    assert refused == []


def test_the_fusion_probe_runs_in_full_float32_and_restores_tensor_float_32():
    """Measured on an H200: the probe refused every DenseNet-BC array ("its fused gradient
    differs ... backbone.conv1.weight"): TensorFloat-32, on by default for cuDNN's
    convolutions, rounds the stacked (grouped) convolutions apart from the separate ones by more
    than the probe's 1e-3. The probe now runs without TF32 and leaves the settings as they were."""
    seen = []

    class Recording(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            seen.append((torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32))
            return self.inner(x)

    trial = Trial(resolve_config(tiny_cfg()), 0)
    # set and restored by hand: `matmul.allow_tf32` is answered by its module's __getattr__,
    # which pytest >= 9.2's monkeypatch undoes with a delattr that the module refuses
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    try:
        models = [Recording(copy.deepcopy(trial.model)) for _ in range(2)]
        assert fusion_problem(models, trial) is None
        assert seen and set(seen) == {(False, False)}
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before
