"""The driver keeps nothing of an experiment part once it has ended (issue 15: its memory is
bounded over a study of any size).

Counted, not timed or measured in bytes (robust on a loaded machine): at the start of each
part after the first, no Tune `Trial` of an earlier part is alive, Ray's post-init hooks
hold no parameter registry of an earlier part (`tune.with_parameters` leaves one per
experiment), and the driver owns no object reference more than at the start of the previous
part (each cell's payload travels in its trial's config: Ray would pin what Tune pickles out
of band).
"""

from __future__ import annotations

import gc
import io

import pytest
import yaml

from studies.running.runner import RunOptions, run_study
from studies.running.session import PART_LINE


def instant_fit(config, seed, on_epoch=None, checkpoint=None):
    """`setvalued.train.fit`'s contract (docs/interfaces.md section 4) with no work."""
    for epoch in range(int(config["epochs"])):
        if on_epoch is not None:
            on_epoch(epoch, {"epoch": epoch, "val/top1": 0.5, "epoch_time_s": 0.0}, {"epoch": epoch})
    return {
        "best_epoch": 0,
        "best_val": 0.5,
        "test": {"top1": 0.5},
        "per_class": {"class": [0, 1], "top1": [0.5, 0.5]},
        "history": [],
    }


class PartProbe(io.StringIO):
    """The runner's output; at each part's start, what the driver still holds."""

    def __init__(self):
        super().__init__()
        self.parts: list[dict[str, int]] = []

    def write(self, text: str) -> int:
        if f"[studies] {PART_LINE} " in text:  # after the time, without a terminal
            self.parts.append(driver_holdings())
        return super().write(text)


def driver_holdings() -> dict[str, int]:
    import ray
    from ray.tune.experiment import Trial

    gc.collect()
    return {
        "trials": sum(1 for o in gc.get_objects() if isinstance(o, Trial)),
        "post_init_hooks": len(ray._private.worker._post_init_hooks),
        "object_refs": len(ray._private.worker.global_worker.core_worker.get_all_reference_counts()),
    }


@pytest.mark.slow
def test_the_driver_holds_nothing_of_an_ended_part(local_ray, tmp_path, monkeypatch):
    import studies.cells.arrays as arrays

    monkeypatch.setattr(arrays, "MAX_TRIALS_PER_EXPERIMENT", 2)
    study = {
        "name": "driver-memory",
        "description": "parts of two cells",
        "base": {
            "data": {"name": "synthetic", "num_classes": 20},
            "model": {"name": "mlp", "hidden_dim": 4},
            "loss": {"name": "ce"},
            "optim": {"lr": 0.1, "milestones": []},
            "epochs": 1,
            "eval": {"ks": [1, 5]},
            "device": "cpu",
        },
        "design": [{"kind": "grid", "parameters": {"optim.lr": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]}}],
        "seeds": [0],
        "resources": {"cpus": 1},
        "max_failures": 0,
        "log_models": False,
    }
    path = tmp_path / "driver-memory.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    before = driver_holdings()
    probe = PartProbe()
    outcome = run_study(
        path,
        RunOptions(output=tmp_path / "out", report=False, fit_fn=instant_fit, stream=probe, progress_interval_s=1e9),
    )
    assert outcome.exit_code == 0 and outcome.finished == 6, probe.getvalue()
    assert len(probe.parts) == 3, probe.getvalue()  # six configs of one seed, two per part
    later = probe.parts[1:]
    assert [p["trials"] for p in later] == [0, 0]
    assert [p["post_init_hooks"] for p in later] == [before["post_init_hooks"]] * 2
    # no reference more per part: the payloads travel in the trial configs, and the tracking
    # context, the fit function and the early-stopping settings are put once for all parts
    assert later[1]["object_refs"] - later[0]["object_refs"] <= 0, probe.parts
    after = driver_holdings()
    assert after["trials"] == 0 and after["post_init_hooks"] == before["post_init_hooks"]
