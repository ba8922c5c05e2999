"""Multi-label classification: the synthetic data's multi-label option (data.max_labels), binary
cross-entropy ([Gar23] eq. 6.3), the multi-label metrics against direct loops, training the
sparse-top loss and BCE on multi-hot targets, and the rule that keeps single-label losses and
metrics off multi-label data (and multi-label metrics off single-label data)."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from setvalued.data.synthetic import build
from setvalued.losses import build_loss
from setvalued.metrics import label_ranks, multilabel_evaluate

torch.set_num_threads(1)

DATA = {
    "name": "synthetic",
    "num_classes": 16,
    "num_superclasses": 4,
    "train_size": 800,
    "val_size": 300,
    "test_size": 400,
    "max_labels": 3,
}


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


def test_multilabel_synthetic_data_have_sets_of_one_to_max_labels_classes():
    data = build(DATA)
    for split in data:
        targets = split.targets
        assert targets.shape == (len(split), 16) and set(targets.unique().tolist()) <= {0, 1}
        sizes = targets.sum(dim=1)
        assert set(sizes.tolist()) == {1, 2, 3}  # every size drawn
        assert bool((targets.sum(dim=0) >= 1).all())  # every class is some example's label
        x, y, i = split[5]
        assert torch.equal(y, targets[5]) and i == 5
    # class counts: the training examples carrying each class
    assert data.class_counts == data.train.targets.sum(dim=0).tolist()
    assert build(DATA).train.targets.equal(data.train.targets)  # a function of the config


def test_multilabel_inputs_are_the_sum_of_their_classes_points():
    """x = sum over Y of (mu_g + t delta_c) + noise: regressing x on the multi-hot targets
    recovers per-class means whose pairwise structure is the superclasses' (classes of one group
    are nearer each other than classes of different groups), so the labels are learnable."""
    data = build({**DATA, "train_size": 6000})
    x, y = data.train.inputs.double(), data.train.targets.double()
    coef = torch.linalg.lstsq(y, x).solution  # (L, d): each class's mean contribution
    groups = torch.tensor(data.info["superclass_of"])
    dist = torch.cdist(coef, coef)
    same = groups[:, None] == groups[None, :]
    off = ~torch.eye(16, dtype=torch.bool)
    assert dist[same & off].mean() < dist[~same].mean()
    residual = x - y @ coef
    assert residual.std() == pytest.approx(0.5, rel=0.15)  # the declared noise (plus the clarity)


def test_single_label_data_are_unchanged_by_the_option():
    plain, one = build({"name": "synthetic"}), build({"name": "synthetic", "max_labels": 1})
    assert plain.train.targets.dim() == 1
    assert torch.equal(plain.train.inputs, one.train.inputs) and torch.equal(plain.test.targets, one.test.targets)
    with pytest.raises(ValueError, match=r"data\.max_labels must be in \[1, data\.num_classes=16\]"):
        build({**DATA, "max_labels": 17})


# --------------------------------------------------------------------------------------------
# binary cross-entropy
# --------------------------------------------------------------------------------------------


def test_bce_is_eq_6_3_summed_over_classes_with_gradient_sigma_minus_y():
    gen = torch.Generator().manual_seed(0)
    scores = (torch.randn(4, 5, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    targets = torch.tensor([[1, 0, 1, 0, 0], [0, 0, 0, 0, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    loss = build_loss("bce", num_classes=5)
    value = loss(scores, targets)
    expected = 0.0
    for i in range(4):
        for j in range(5):
            p = 1 / (1 + math.exp(-float(scores[i, j].detach())))
            expected -= math.log(p) if targets[i, j] else math.log(1 - p)
    assert float(value.detach()) == pytest.approx(expected / 4, rel=1e-12)
    value.backward()
    assert torch.allclose(scores.grad, (torch.sigmoid(scores.detach()) - targets) / 4, atol=1e-12)
    # class indices are one-hot targets
    indices = torch.tensor([2, 4, 0, 1])
    assert float(loss(scores, indices)) == pytest.approx(float(loss(scores, torch.eye(5)[indices])))
    with pytest.raises(ValueError, match="only 0 and 1"):
        loss(scores, targets * 2)


# --------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------


def _in_top(row: list[float], j: int, k: int) -> bool:
    return sum(1 for c, s in enumerate(row) if c != j and s >= row[j]) < k


def test_multilabel_metrics_equal_direct_loops_with_ties():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 4, (30, 7), generator=gen).float()  # many ties
    targets = (torch.rand(30, 7, generator=gen) < 0.3).long()
    targets[0] = 0  # an example without labels
    class_counts = [3, 50, 500, 10, 80, 300, 1]
    out = multilabel_evaluate(scores, targets, [1, 3], class_counts)
    rows, labels = scores.tolist(), targets.tolist()
    groups = {"few": [0, 3, 6], "medium": [1, 4], "many": [2, 5]}
    for k in (1, 3):
        hits = [[j for j in range(7) if labels[i][j] and _in_top(rows[i], j, k)] for i in range(30)]
        assert all(len(h) <= k for h in hits)
        assert out[f"prec{k}"] == pytest.approx(sum(len(h) / k for h in hits) / 30)
        labelled = [i for i in range(30) if sum(labels[i])]
        assert out[f"rec{k}"] == pytest.approx(sum(len(hits[i]) / sum(labels[i]) for i in labelled) / len(labelled))
        recall = {
            c: sum(c in hits[i] for i in range(30)) / sum(labels[i][c] for i in range(30))
            for c in range(7)
            if sum(labels[i][c] for i in range(30))
        }
        assert out[f"macro_rec{k}"] == pytest.approx(sum(recall.values()) / len(recall))
        for group, classes in groups.items():
            present = [c for c in classes if c in recall]
            assert out[f"{group}/rec{k}"] == pytest.approx(sum(recall[c] for c in present) / len(present))
    labelled = [i for i in range(30) if sum(labels[i])]
    rprec = [
        sum(1 for j in range(7) if labels[i][j] and _in_top(rows[i], j, sum(labels[i]))) / sum(labels[i])
        for i in labelled
    ]
    assert out["rprec"] == pytest.approx(sum(rprec) / len(rprec))
    assert label_ranks(torch.tensor([[2.0, 2.0, 1.0]])).tolist() == [[1, 1, 2]]


# --------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", ["sparse_top", "bce"])
def test_multilabel_losses_train_on_multi_hot_targets(loss):
    """Both losses learn the labels: precision at 1 well above a random ranking's (the mean
    number of labels over L, about 2/16), and R-precision likewise."""
    from setvalued.training import fit

    config = {
        "data": DATA,
        "model": {"name": "mlp", "hidden_dim": 64},
        "loss": {"name": loss},
        "optim": {"lr": 0.1, "milestones": []},
        "epochs": 8,
        "device": "cpu",
        "eval": {"ks": [1, 3], "selection": "val/rprec"},
    }
    result = fit(config, 0)
    test = result["test"]
    chance = float(build(DATA).test.targets.sum(dim=1).double().mean()) / 16
    assert test["prec1"] > 3 * chance and test["rprec"] > 2 * chance, test
    assert set(result["per_class"]) >= {"rec1", "rec3", "test_count"}
    assert "train/top1" not in result["history"][0]  # no single-label running accuracy
    assert result["best_val"] == max(h["val/rprec"] for h in result["history"])


# --------------------------------------------------------------------------------------------
# the label-kind rule
# --------------------------------------------------------------------------------------------

MULTI = {
    "data": {"name": "synthetic", "max_labels": 3},
    "model": {"name": "mlp"},
    "eval": {"ks": [1, 5], "selection": "val/prec5"},
}


@pytest.mark.parametrize(
    "config, path, words",
    [
        ({**MULTI, "loss": {"name": "ce"}}, ("loss", "name"), "expected a multi-label loss: sparse_top, bce"),
        (
            {**MULTI, "loss": {"name": "bce"}, "eval": {**MULTI["eval"], "avgk": [5]}},
            ("eval", "avgk"),
            "average-K accuracy needs one label per example",
        ),
        (
            {**MULTI, "loss": {"name": "bce"}, "eval": {**MULTI["eval"], "conformal_alphas": [0.1]}},
            ("eval", "conformal_alphas"),
            "conformal sets need one label per example",
        ),
        (
            {**MULTI, "loss": {"name": "sparse_top"}, "eval": {"ks": [1, 5], "selection": "val/top5"}},
            ("eval", "selection"),
            "expected a multi-label validation metric",
        ),
        (
            {"loss": {"name": "sparse_top"}, "eval": {"ks": [1, 5], "selection": "val/prec5"}},
            ("eval", "selection"),
            "is a multi-label metric but the data have one label per example",
        ),
    ],
)
def test_label_kinds_are_checked_by_the_trainer_and_the_study(config, path, words):
    from setvalued.training import resolve_config
    from studies.studyfile.trial_config import validate_config

    with pytest.raises(ValueError, match=rf"config {'.'.join(path)}: .*{words}"):
        resolve_config(config)
    _, problems = validate_config(config)
    assert [p.path for p in problems] == [path] and words in problems[0].message


def test_a_study_file_mixing_label_kinds_names_file_field_and_expectation(tmp_path):
    from studies.studyfile.spec import StudyError, load_study

    path = tmp_path / "mixed.yaml"
    path.write_text(
        textwrap.dedent("""\
        name: mixed
        base:
          data: {name: synthetic, max_labels: 3}
          model: {name: mlp}
          eval: {ks: [1, 5], selection: val/prec5}
        variants:
          sparse_top: {loss: {name: sparse_top}}
          ce: {loss: {name: ce}}
        seeds: [0]
        """),
        encoding="utf-8",
    )
    with pytest.raises(StudyError) as info:
        load_study(path)
    message = str(info.value)
    assert "mixed.yaml" in message and "variants.ce.loss.name" in message
    assert "expected a multi-label loss" in message and "sparse_top" not in message.split("variants.ce")[0][-40:]
