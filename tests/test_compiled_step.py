"""``compile: model`` in a warm worker and with the loss inside the compiled step (issue #34;
setvalued.training.compiled_step), on the CPU with dynamo's ``eager`` backend (dynamo's capture, guards and
cache as on a GPU, without inductor's slow CPU code generation):

- 12 cells of three heads (linear, normed, two-head) and four losses, one after another in one
  process, each in a new thread (as Ray runs the trials of a reused actor): every cell compiles
  its own graphs (training and evaluation), none falls back to eager after dynamo's
  ``recompile_limit``, and after each cell nothing of it is held (its model is collected, the
  compiled code of ``Classifier.forward`` is gone);
- the compiled step (model, float32 cast and loss in one function) trains to exactly the
  metrics of the eager step, ``grad_nonzero`` included (read through the probe of the scores).
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from torch._dynamo.utils import counters

import setvalued.training.compiled_step as compiled_step
from setvalued.models import Classifier
from setvalued.training import fit

torch.set_num_threads(1)

BASE = {
    "data": {
        "name": "synthetic",
        "num_classes": 6,
        "num_superclasses": 2,
        "train_size": 48,
        "val_size": 20,
        "test_size": 20,
        "feature_dim": 8,
    },
    "model": {"name": "mlp", "hidden_dim": 16},
    "optim": {"lr": 0.05, "batch_size": 16, "milestones": []},
    "epochs": 1,
    "eval": {"ks": [1, 3], "selection": "val/top3", "batch_size": 10},
    "device": "cpu",
    "compile": "model",
}
#: three heads (linear, normed, two_head), four losses
LOSSES = [{"name": "ce"}, {"name": "ldam"}, {"name": "avgk_two_head", "k": 2}, {"name": "noised_topk", "k": 2}]


@pytest.fixture
def eager_backend(monkeypatch):
    monkeypatch.setattr(compiled_step, "backend", "eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _cache_entries() -> int:
    """Dynamo's compiled variants of ``Classifier.forward`` (shared by every model)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(Classifier.forward.__code__))


def _fit_in_a_new_thread(cfg, seed) -> dict:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(result=fit(cfg, seed)))
    thread.start()
    thread.join()
    return out["result"]


def test_twelve_cells_in_one_worker_stay_compiled_and_leave_nothing_behind(eager_backend):
    models = []
    graphs_per_cell = []
    for cell in range(12):
        before = counters["stats"]["unique_graphs"]
        result = _fit_in_a_new_thread(dict(BASE, loss=LOSSES[cell % 4]), cell)
        graphs_per_cell.append(counters["stats"]["unique_graphs"] - before)
        assert result["history"] and result["test"]
        models.append(weakref.ref(result["model"]))
        del result
        gc.collect()
        # nothing of the cell is held: its model (returned to the caller, then dropped) is
        # collected, and no compiled variant of the shared forward is left
        assert [ref() is None for ref in models] == [True] * len(models), cell
        assert _cache_entries() == 0
    # every cell compiled its training step and its evaluation forward: the same two graphs
    # per cell (whole batches: no ragged last batch here), never a fallback to eager
    assert graphs_per_cell == [2] * 12, graphs_per_cell


@pytest.mark.parametrize("loss", [{"name": "noised_topk", "k": 2}, {"name": "avgk_two_head", "k": 2}])
def test_compiled_step_trains_to_the_metrics_of_the_eager_step(eager_backend, loss):
    """Model and loss compiled as one function: the same losses, accuracies and gradient
    counts as the eager step (the noised loss on the same draws), ragged batches included."""
    cfg = dict(BASE, loss=loss, epochs=2, data=dict(BASE["data"], train_size=50))
    compiled, eager = fit(cfg, 3), fit(dict(cfg, compile="none"), 3)
    strip = [{k: v for k, v in h.items() if not k.endswith("time_s")} for h in compiled["history"]]
    assert strip == [{k: v for k, v in h.items() if not k.endswith("time_s")} for h in eager["history"]]
    assert all(h["grad_nonzero"] > 0 for h in compiled["history"])
    assert compiled["test"] == eager["test"]
