"""A long-tailed, ambiguous classification data set generated in code.

It stands in for Pl@ntNet-300K in the quickstart and the tests, and has the two
properties the papers study ([Gar23] §2.2.5: average-K gains most under heterogeneous
ambiguity; §3.2: Pl@ntNet-300K's long tail and ambiguity within a genus):

- **Long tail**: class frequencies follow the quantiles of a Pareto distribution of
  shape ``pareto_shape`` (ImageNet-LT was subsampled the same way, [Gar23] §4.4.5.2,
  [Liu+19]); the most frequent class has ~``L**(1/shape)`` times more examples than the rarest.
  Validation and test follow the same frequencies, with at least one example of every
  class (as Pl@ntNet-300K's per-class 10 % splits).
- **Heterogeneous ambiguity**: the classes are grouped into ``num_superclasses`` groups
  (like species in a genus). An example of class c in group g is
  ``x = mu_g + t * delta_c + sigma * noise`` with a per-example clarity ``t ~ U(0, 1)``:
  with t near 0 it lies at the group centre and its class is a guess among the group's
  members, with t near 1 it is clear. So top-1 stays well below top-K for K at least the
  group size, and average-K (adaptive set sizes) has something to gain over top-K.

**Multi-label** (``max_labels > 1``): every example has a primary class (drawn with the
long-tailed frequencies above, so every class is some example's primary class in every split)
and ``m - 1`` more, ``m ~ U{1, ..., max_labels}``, drawn without replacement with the same
frequencies; its input is the sum of its classes' points, ``x = sum_{c in Y} (mu_g(c) + t_c
delta_c) + sigma * noise`` with one clarity ``t_c ~ U(0, 1)`` per label, and its target the
multi-hot vector of Y. ``class_counts`` are then the training examples carrying each class. The
thesis proposes sparse-top for such sparse multi-label targets ([Gar23] §6.2.1) without a data
set; this one keeps the long tail and the within-group ambiguity of the single-label data.

``form: features`` yields vectors of ``feature_dim`` values; ``form: images`` maps the same
vectors linearly to smooth 3x32x32 patterns (fixed random low-frequency bases) plus
pixel noise, for the CNNs.

The data set is a function of its config only, generated from ``split_seed`` (default
1234) and not from the trial seed, so every trial of a study sees the same data (as the
fixed CIFAR-100 split) and differences between seeds come from training alone.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F

from setvalued.config import DATA_FIELDS
from setvalued.data.common import DataSplits, TensorSplit, mix_seed

FORMS = ("features", "images")
_STREAM = 0x53594E5448  # "SYNTH"

#: Geometry: standard deviations of the group centres, of the class offsets inside a
#: group and of the isotropic noise. Tuned so that an MLP reaches
#: roughly 50-60 % top-1, 80 % top-3 and 90 % top-5 on the default config (40 classes,
#: 8 groups, 2,000 training examples), with the majority class at 25 %.
SUPERCLASS_SPREAD = 0.3
CLASS_SPREAD = 0.25
NOISE = 0.5
PIXEL_NOISE = 0.1


def pareto_weights(num_classes: int, shape: float) -> np.ndarray:
    """Class frequencies from the Pareto(shape) quantiles at (r + 0.5) / L, largest first."""
    if shape <= 0:
        raise ValueError(f"data.pareto_shape must be > 0, got {shape}")
    u = (np.arange(num_classes) + 0.5) / num_classes
    quantiles = u ** (-1.0 / shape)  # Pareto(x_m=1) quantile at 1 - u
    return quantiles / quantiles.sum()


def allocate(total: int, weights: np.ndarray, minimum: int, what: str) -> np.ndarray:
    """Integer counts summing to ``total``, each >= ``minimum``, proportional to ``weights``
    for the remainder (largest-remainder rounding)."""
    n = len(weights)
    if total < n * minimum:
        raise ValueError(
            f"data.{what} must be at least {n * minimum} ({minimum} per class for {n} classes), got {total}"
        )
    share = (total - n * minimum) * weights
    counts = np.floor(share).astype(np.int64)
    rest = total - n * minimum - counts.sum()
    order = np.argsort(-(share - counts), kind="stable")
    counts[order[:rest]] += 1
    return counts + minimum


def _check(cfg: dict[str, Any]) -> dict[str, Any]:
    values = {
        # None: the key's union default, where another data set (arrays) declares another default
        "num_classes": int(
            cfg["num_classes"]
            if cfg.get("num_classes") is not None
            else DATA_FIELDS["synthetic"]["num_classes"].default
        ),
        "num_superclasses": int(cfg.get("num_superclasses", 8)),
        "train_size": int(cfg.get("train_size", 2000)),
        "val_size": int(
            cfg["val_size"] if cfg.get("val_size") is not None else DATA_FIELDS["synthetic"]["val_size"].default
        ),
        "test_size": int(cfg.get("test_size", 1000)),
        "pareto_shape": float(cfg.get("pareto_shape", 1.2)),
        "form": cfg.get("form", "features"),
        "feature_dim": int(cfg.get("feature_dim", 32)),
        "split_seed": int(cfg.get("split_seed", 1234)),
        "max_labels": int(cfg.get("max_labels") or 1),
    }
    if values["num_classes"] < 2:
        raise ValueError(f"data.num_classes must be >= 2, got {values['num_classes']}")
    if not 1 <= values["num_superclasses"] <= values["num_classes"]:
        raise ValueError(
            f"data.num_superclasses must be in [1, data.num_classes="
            f"{values['num_classes']}], got {values['num_superclasses']}"
        )
    if values["form"] not in FORMS:
        raise ValueError(f"data.form must be one of {FORMS}, got {values['form']!r}")
    if not 1 <= values["max_labels"] <= values["num_classes"]:
        raise ValueError(
            f"data.max_labels must be in [1, data.num_classes={values['num_classes']}], got {values['max_labels']}"
        )
    if values["feature_dim"] < 1:
        raise ValueError(f"data.feature_dim must be >= 1, got {values['feature_dim']}")
    return values


class SyntheticGenerator:
    """The fixed geometry of one synthetic data set (centres, offsets, image bases)."""

    def __init__(self, num_classes: int, num_superclasses: int, feature_dim: int, form: str, seed: int):
        rng = np.random.default_rng(seed)
        self.num_classes = num_classes
        self.feature_dim = feature_dim
        self.form = form
        # Balanced group sizes, classes assigned at random.
        self.superclass_of = rng.permutation(np.arange(num_classes) % num_superclasses)
        self.centres = rng.normal(0.0, SUPERCLASS_SPREAD, (num_superclasses, feature_dim))
        self.offsets = rng.normal(0.0, CLASS_SPREAD, (num_classes, feature_dim))
        self.bases: torch.Tensor | None = None
        if form == "images":
            coarse = torch.from_numpy(rng.normal(0.0, 1.0, (feature_dim, 3, 4, 4))).float()
            bases = F.interpolate(coarse, size=(32, 32), mode="bicubic", align_corners=False)
            # Scale so that the images of an example have about unit pixel variance.
            bases = bases / bases.flatten(1).norm(dim=1).view(-1, 1, 1, 1) * np.sqrt(3 * 32 * 32 / feature_dim)
            self.bases = bases.flatten(1)  # (d, 3072)

    def sample(self, counts: np.ndarray, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """(inputs, labels, clarity t) with ``counts[c]`` examples of class c, in random order."""
        labels = rng.permutation(np.repeat(np.arange(self.num_classes), counts))
        clarity = rng.random(len(labels))
        noise = rng.normal(0.0, NOISE, (len(labels), self.feature_dim))
        x = self.centres[self.superclass_of[labels]] + clarity[:, None] * self.offsets[labels] + noise
        x = torch.from_numpy(x).float()
        if self.form == "images":
            pixels = torch.from_numpy(rng.normal(0.0, PIXEL_NOISE, (len(labels), 3 * 32 * 32))).float()
            x = (x @ cast(torch.Tensor, self.bases) + pixels).view(-1, 3, 32, 32)
        return x, torch.from_numpy(labels), clarity

    def sample_multilabel(
        self, counts: np.ndarray, max_labels: int, weights: np.ndarray, rng: np.random.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, int64 multi-hot targets (n, L)): ``counts[c]`` examples whose primary class is
        c, each with 1 to ``max_labels`` classes (module docstring)."""
        primary = rng.permutation(np.repeat(np.arange(self.num_classes), counts))
        n = len(primary)
        sizes = rng.integers(1, max_labels + 1, n)
        # the other labels without replacement, proportional to the weights: the first m - 1 of
        # the Gumbel-perturbed log-weights in decreasing order (successive sampling)
        keys = np.log(weights)[None, :] + rng.gumbel(size=(n, self.num_classes))
        keys[np.arange(n), primary] = -np.inf
        ranked = np.argsort(-keys, axis=1, kind="stable")[:, : max_labels - 1]
        targets = np.zeros((n, self.num_classes), dtype=np.int64)
        targets[np.arange(n), primary] = 1
        for extra in range(max_labels - 1):
            chosen = sizes > extra + 1
            targets[np.nonzero(chosen)[0], ranked[chosen, extra]] = 1
        clarity = rng.random((n, self.num_classes)) * targets
        points = targets @ self.centres[self.superclass_of] + clarity @ self.offsets
        x = torch.from_numpy(points + rng.normal(0.0, NOISE, (n, self.feature_dim))).float()
        if self.form == "images":
            pixels = torch.from_numpy(rng.normal(0.0, PIXEL_NOISE, (n, 3 * 32 * 32))).float()
            x = (x @ cast(torch.Tensor, self.bases) + pixels).view(-1, 3, 32, 32)
        return x, torch.from_numpy(targets)


def build(cfg: dict[str, Any], seed: int = 0) -> DataSplits:
    """The synthetic splits of a ``data`` config; ``seed`` (the trial seed) is not used."""
    v = _check(cfg)
    L = v["num_classes"]
    base_seed = mix_seed(v["split_seed"], _STREAM, L, v["num_superclasses"], v["feature_dim"])
    gen = SyntheticGenerator(L, v["num_superclasses"], v["feature_dim"], v["form"], base_seed)
    rng = np.random.default_rng(mix_seed(base_seed, 1))
    weights = pareto_weights(L, v["pareto_shape"])[rng.permutation(L)]

    counts = {
        "train": allocate(v["train_size"], weights, 2, "train_size"),
        "val": allocate(v["val_size"], weights, 1, "val_size"),
        "test": allocate(v["test_size"], weights, 1, "test_size"),
    }
    names = [f"class{c:03d}_group{gen.superclass_of[c]:02d}" for c in range(L)]
    drawn: list[tuple[torch.Tensor, torch.Tensor, np.ndarray | None]] = []
    for i, split in enumerate(("train", "val", "test")):
        rng_split = np.random.default_rng(mix_seed(base_seed, 2 + i))
        if v["max_labels"] > 1:
            drawn.append(gen.sample_multilabel(counts[split], v["max_labels"], weights, rng_split) + (None,))
        else:
            drawn.append(gen.sample(counts[split], rng_split))
    # training examples per class (carrying it, for multi-label data)
    class_counts = drawn[0][1].sum(dim=0).tolist() if v["max_labels"] > 1 else counts["train"].tolist()
    splits = []
    for split, (x, y, clarity) in zip(("train", "val", "test"), drawn):
        ds = TensorSplit(x, y, num_classes=L, class_counts=class_counts, class_names=names, split=split)
        if clarity is not None:
            ds.clarity = torch.from_numpy(clarity).float()
        splits.append(ds)
    shape = (v["feature_dim"],) if v["form"] == "features" else (3, 32, 32)
    info = {"superclass_of": gen.superclass_of.tolist(), "generation_seed": v["split_seed"]}
    return DataSplits(
        splits[0],
        splits[1],
        splits[2],
        num_classes=L,
        class_counts=class_counts,
        class_names=names,
        input_shape=shape,
        info=info,
    )
