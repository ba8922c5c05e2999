"""Where evaluation is: a trial's scores on a split, its validation pass (the metrics, the
calibrated average-K thresholds), and the test pass of the selected checkpoint (the test
metrics, per-class rates, set sizes, the conformal baselines).

The protocol is described in ``setvalued.training``: validation every epoch, average-K thresholds
calibrated on it (thesis Algorithm 1), the test set evaluated once on the best checkpoint with
its thresholds (thesis Section 5.6).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch

from setvalued.data.common import DataSplits, IndexedDataset
from setvalued.data.device import DeviceSplit
from setvalued.losses import SetValuedLoss
from setvalued.metrics import (
    ConformalMethod,
    activate,
    avgk_set_size,
    avgk_set_sizes,
    avgk_sets,
    calibrate_avgk_thresholds,
    conformal_metrics,
    evaluate,
    multilabel_evaluate,
    per_class_avgk,
    per_class_recall,
    per_class_topk,
    set_metrics,
    shot_groups,
)
from setvalued.training.running_metrics import count_set_sizes, fmt_k, to_float32
from setvalued.training.setup import split_batches


class Evaluation:
    """The evaluation passes of one trial: its config, data, loss (``prediction_scores``) and
    forward pass (``run_model``, the step's, compiled or not)."""

    def __init__(
        self,
        cfg: dict[str, Any],
        data: DataSplits,
        device: torch.device,
        on_device: dict[str, DeviceSplit] | None,
        loss: SetValuedLoss,
        run_model: Callable[[torch.Tensor], Any],
        conformal_split: tuple[torch.Tensor, torch.Tensor] | None,
    ):
        self.cfg, self.data, self.device, self.on_device = cfg, data, device, on_device
        self.loss, self.run_model, self.conformal_split = loss, run_model, conformal_split
        #: multi-hot targets (multi-label synthetic data): the multi-label metrics, no top-K
        self.multi_label = data.train.targets.dim() == 2

    @torch.no_grad()
    def predict(self, model: torch.nn.Module, ds: IndexedDataset) -> torch.Tensor:
        """Float32 CPU scores (n, L) that the metrics rank, in the order of ``ds``, at the batch
        size ``eval.batch_size``; the scores stay on the device until the last batch (one copy
        back per pass, no host read per batch)."""
        model.eval()
        out = []
        for x in self.inputs(ds):
            output = self.run_model(x)
            out.append(self.loss.prediction_scores(to_float32(output)).float())
        return torch.cat(out).cpu()

    def inputs(self, ds: IndexedDataset) -> Iterator[torch.Tensor]:
        """The inputs of ``ds`` on the device, in order, in batches of ``eval.batch_size``."""
        order = torch.arange(len(ds))
        bs = int(self.cfg["eval"]["batch_size"])
        held = self.on_device[ds.split] if self.on_device is not None and ds.split in self.on_device else None
        if held is not None and held.augmentation is None:
            batches = held.batches(order, bs)
        else:
            batches = split_batches(ds, order, bs, int(self.cfg["data"]["num_workers"]), self.device, 0)
        for x, _, _ in batches:
            yield x.to(self.device, non_blocking=True)

    def metrics_of(
        self, scores: torch.Tensor, targets: torch.Tensor, thresholds: Mapping[float, float] | None
    ) -> dict[str, float]:
        """``evaluate`` of the top-K metrics on the raw scores and of the average-K metrics on the
        activated scores (the thresholds live on the softmax or sigmoid scale: the thesis
        thresholds softmax scores, Eq. 5.16, ``eval.avgk_activation`` may choose sigmoid;
        ranking raw scores avoids ties from saturated sigmoids)."""
        e = self.cfg["eval"]
        counts, shots, bins = self.data.class_counts, tuple(e["shot_thresholds"]), tuple(e["count_bins"])
        if self.multi_label:
            return multilabel_evaluate(scores, targets, e["ks"], counts, shots)
        out = evaluate(scores, targets, e["ks"], counts, None, shots, bins)
        if thresholds:
            out.update(evaluate(activate(scores, e["avgk_activation"]), targets, [], counts, thresholds, shots, bins))
        return out

    def validate(
        self, model: torch.nn.Module, scores: torch.Tensor | None = None, seconds: float = 0.0
    ) -> tuple[dict[str, float], dict[float, float]]:
        """The validation metrics (``val/...``, ``eval_time_s``) and the average-K thresholds
        calibrated on the validation set (less its conformal calibration part); ``scores``:
        ``predict``'s validation scores of ``model`` when already computed, in ``seconds``."""
        start = time.perf_counter()
        if scores is None:
            scores = self.predict(model, self.data.val)
        targets = self.data.val.targets
        if self.conformal_split is not None:  # the calibration part's labels are for conformal only
            scores, targets = scores[self.conformal_split[1]], targets[self.conformal_split[1]]
        e = self.cfg["eval"]
        thresholds = {}
        if e["avgk"]:
            thresholds = calibrate_avgk_thresholds(activate(scores, e["avgk_activation"]), list(e["avgk"]))
        metrics = {f"val/{k}": v for k, v in self.metrics_of(scores, targets, thresholds).items()}
        for k, t in thresholds.items():
            metrics[f"val/avg{fmt_k(k)}_threshold"] = float(t)
        metrics["eval_time_s"] = seconds + time.perf_counter() - start
        return metrics, thresholds

    def test(
        self,
        model: torch.nn.Module,
        best: Mapping[str, Any],
        history: list[dict[str, Any]],
        scores: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """Evaluate the selected checkpoint ``best`` (loaded into ``model``) once on the test
        set, with its thresholds: the result of ``fit``. ``scores``: ``predict``'s test scores
        of that checkpoint when already computed."""
        model.load_state_dict(best["model"])
        if scores is None:
            scores = self.predict(model, self.data.test)
        targets = self.data.test.targets
        thresholds = best["thresholds"]
        test = self.metrics_of(scores, targets, thresholds)
        if self.conformal_split is not None:
            test.update(self.conformal_test(model, scores, targets, thresholds))
        L = self.data.num_classes
        per_class: dict[str, list[Any]] = {
            "class": list(range(L)),
            "name": list(self.data.class_names),
            "train_count": [int(c) for c in self.data.class_counts],
            "test_count": (targets.sum(dim=0) if self.multi_label else torch.bincount(targets, minlength=L)).tolist(),
        }
        groups = shot_groups(self.data.class_counts, tuple(self.cfg["eval"]["shot_thresholds"]))
        per_class["shot"] = [next(g for g, mask in groups.items() if bool(mask[c])) for c in range(L)]

        def rates(hits: torch.Tensor, counts: torch.Tensor) -> list[float]:
            return [float(h) / float(c) if c > 0 else float("nan") for h, c in zip(hits.tolist(), counts.tolist())]

        for k in self.cfg["eval"]["ks"]:
            if k <= L and self.multi_label:
                per_class[f"rec{k}"] = rates(*per_class_recall(scores, targets, k))
            elif k <= L:
                per_class[f"top{k}"] = rates(*per_class_topk(scores, targets, k, L))
        set_sizes: dict[str, list[Any]] = {"avgk": [], "shot": [], "size": [], "count": []}
        if thresholds:
            probs = activate(scores, self.cfg["eval"]["avgk_activation"])
            shot_of_example = [per_class["shot"][c] for c in targets.tolist()]
            for k, t in thresholds.items():
                per_class[f"avg{fmt_k(k)}"] = rates(*per_class_avgk(probs, targets, t, L))
                count_set_sizes(set_sizes, fmt_k(k), avgk_set_sizes(probs, t).tolist(), shot_of_example)
        return {
            "best_epoch": int(best["epoch"]),
            "best_val": float(best["value"]),
            "test": test,
            "per_class": per_class,
            "history": copy.deepcopy(history),
            "thresholds": {fmt_k(k): float(t) for k, t in thresholds.items()},
            "set_sizes": set_sizes if set_sizes["count"] else None,
            "selection": self.cfg["eval"]["selection"],
            "device": str(self.device),
            # the selected checkpoint's model and two test inputs (for an MLflow model)
            "model": model,
            "input_example": torch.stack([self.data.test[i][0] for i in range(min(2, len(self.data.test)))]),
        }

    def conformal_test(
        self, model: torch.nn.Module, scores: torch.Tensor, targets: torch.Tensor, thresholds: Mapping[float, float]
    ) -> dict[str, float]:
        """The conformal baselines on the test set of the selected checkpoint ([Gar23] §2.2.2;
        ``setvalued.metrics.conformal.conformal_metrics``): calibrated on the labelled calibration part of
        the validation set, at every level of ``eval.conformal_alphas`` and, with
        ``eval.conformal_match_avgk``, at the mean set size that each average-K threshold gives on the
        rest of the validation set (the data it was calibrated on, without labels), beside the
        shot-group set sizes of the average-K sets (``few/avg5_size``). Conformal scores are on
        softmax probabilities (the thesis's ``1 - p_y``); average-K sets on ``eval.avgk_activation``."""
        e = self.cfg["eval"]
        counts, shots = self.data.class_counts, tuple(e["shot_thresholds"])
        calibration, rest = cast(tuple[torch.Tensor, torch.Tensor], self.conformal_split)  # conformal: set
        val_scores, val_targets = self.predict(model, self.data.val), self.data.val.targets
        val_probs = activate(val_scores, "softmax")
        out: dict[str, float] = {}
        matched: dict[str, float] = {}
        if e["conformal_match_avgk"]:
            avgk_val, avgk_test = (activate(s, e["avgk_activation"]) for s in (val_scores[rest], scores))
            for k, threshold in thresholds.items():
                name = f"avg{fmt_k(k)}"
                matched[name] = avgk_set_size(avgk_val, threshold)
                sizes = set_metrics(avgk_sets(avgk_test, threshold), targets, name, counts, shots)
                out.update(
                    {key: value for key, value in sizes.items() if key.count("/") == 1 and key.endswith("_size")}
                )
        methods = [
            ConformalMethod(score, mondrian) for score in e["conformal_scores"] for mondrian in e["conformal_mondrian"]
        ]
        out.update(
            conformal_metrics(
                val_probs[calibration],
                val_targets[calibration],
                activate(scores, "softmax"),
                targets,
                methods,
                e["conformal_alphas"],
                matched,
                size_probs=val_probs[rest],
                class_counts=counts,
                shot_thresholds=shots,
            )
        )
        return out
