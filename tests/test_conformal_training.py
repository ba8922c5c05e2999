"""The conformal baselines in the trainer ([Gar23] §2.2.2; eval.conformal_*): the metrics of
``conformal_metrics`` against direct loops, the coverage guarantee of eq. 2.5 through the
named metrics, a small ``fit`` that logs them from its calibration split (and keeps those labels
out of the checkpoint selection), and the validation of the settings."""

from __future__ import annotations

import math

import pytest
import torch

from setvalued.metrics import (
    ConformalMethod,
    activate,
    calibrate_avgk_threshold,
    check_metric,
    conformal_metrics,
    shot_groups,
    split_calibration,
)

torch.set_num_threads(1)
F64 = torch.float64


def _draw(gen: torch.Generator, n: int, num_classes: int):
    """Exchangeable examples: a miscalibrated model's probabilities, labels from flatter truths."""
    logits = torch.randn(n, num_classes, generator=gen, dtype=F64) * 2.0
    labels = torch.multinomial(torch.softmax(0.5 * logits, dim=1), 1, generator=gen)[:, 0]
    return torch.softmax(logits, dim=1), labels


# --------------------------------------------------------------------------------------------
# brute force: the recipe of [Gar23] §2.2.2 written with loops
# --------------------------------------------------------------------------------------------


def _score(probs, i, j, score):
    row = probs[i].tolist()
    if score == "lac":
        return 1.0 - row[j]
    order = sorted(range(len(row)), key=lambda c: (-row[c], c))  # decreasing, ties by index
    return sum(row[c] for c in order[: order.index(j) + 1])


def _quantile(values, alpha):
    n = len(values)
    k = math.ceil(round((n + 1) * (1 - alpha), 9))
    return math.inf if k > n else sorted(values)[k - 1]


def _brute_sets(probs_cal, labels_cal, probs, alpha, score, by_class):
    n_cal, num_classes = probs_cal.shape
    cal = [(_score(probs_cal, i, int(labels_cal[i]), score), int(labels_cal[i])) for i in range(n_cal)]
    if by_class:
        q = [_quantile([s for s, y in cal if y == c], alpha) for c in range(num_classes)]
    else:
        q = [_quantile([s for s, _ in cal], alpha)] * num_classes
    return [[j for j in range(num_classes) if _score(probs, i, j, score) <= q[j]] for i in range(probs.shape[0])]


def _brute_stats(sets, labels, class_counts):
    labels = [int(y) for y in labels]
    covered = [y in s for s, y in zip(sets, labels)]
    groups = {g: m.tolist() for g, m in shot_groups(class_counts, (20, 100)).items()}
    per_class = {}
    for ok, y in zip(covered, labels):
        per_class.setdefault(y, []).append(ok)
    out = {
        "coverage": sum(covered) / len(labels),
        "size": sum(map(len, sets)) / len(sets),
        "macro": sum(sum(v) / len(v) for v in per_class.values()) / len(per_class),
    }
    for g, mask in groups.items():
        classes = [c for c in per_class if mask[c]]
        if classes:
            out[f"{g}/coverage"] = sum(sum(per_class[c]) / len(per_class[c]) for c in classes) / len(classes)
            in_group = [len(s) for s, y in zip(sets, labels) if mask[y]]
            out[f"{g}/size"] = sum(in_group) / len(in_group)
    return out


@pytest.mark.parametrize(
    "score, mondrian", [("lac", "marginal"), ("aps", "marginal"), ("lac", "class"), ("aps", "class")]
)
def test_conformal_metrics_equal_the_recipe_written_with_loops(score, mondrian):
    gen = torch.Generator().manual_seed(3)
    num_classes = 6
    probs_cal, labels_cal = _draw(gen, 60, num_classes)
    probs_test, labels_test = _draw(gen, 40, num_classes)
    class_counts = [5, 30, 200, 10, 150, 50]  # few, medium, many, few, many, medium
    alpha = 0.2
    out = conformal_metrics(
        probs_cal,
        labels_cal,
        probs_test,
        labels_test,
        [ConformalMethod(score, mondrian)],
        [alpha],
        class_counts=class_counts,
    )
    name = score if mondrian == "marginal" else f"{score}_class"
    sets = _brute_sets(probs_cal, labels_cal, probs_test, alpha, score, mondrian == "class")
    expected = _brute_stats(sets, labels_test, class_counts)
    assert out[f"{name}80"] == pytest.approx(expected["coverage"], abs=1e-12)
    assert out[f"{name}80_size"] == pytest.approx(expected["size"], abs=1e-12)
    assert out[f"macro_{name}80"] == pytest.approx(expected["macro"], abs=1e-12)
    for group in ("few", "medium", "many"):
        assert out[f"{group}/{name}80"] == pytest.approx(expected[f"{group}/coverage"], abs=1e-12)
        assert out[f"{group}/{name}80_size"] == pytest.approx(expected[f"{group}/size"], abs=1e-12)


def test_size_matched_sets_have_the_nearest_attainable_mean_size():
    """Marginal LAC matched to a target size: among the n + 1 attainable thresholds (one per
    calibration score, and +inf), the one whose mean size on the unlabelled data is nearest."""
    gen = torch.Generator().manual_seed(5)
    probs_cal, labels_cal = _draw(gen, 50, 8)
    probs_size, _ = _draw(gen, 70, 8)
    probs_test, labels_test = _draw(gen, 30, 8)
    target = 2.3
    out = conformal_metrics(
        probs_cal,
        labels_cal,
        probs_test,
        labels_test,
        [ConformalMethod("lac", "marginal")],
        [],
        {"avg2": target},
        size_probs=probs_size,
    )
    cal_scores = [1.0 - float(probs_cal[i, labels_cal[i]]) for i in range(50)] + [math.inf]
    size_of = {q: sum(1 for row in (1.0 - probs_size).tolist() for s in row if s <= q) / 70 for q in cal_scores}
    best = min(sorted(cal_scores), key=lambda q: abs(size_of[q] - target))
    test_sets = [[j for j in range(8) if 1.0 - float(probs_test[i, j]) <= best] for i in range(30)]
    assert out["lac_avg2_size"] == pytest.approx(sum(map(len, test_sets)) / 30, abs=1e-12)
    assert out["lac_avg2"] == pytest.approx(sum(int(labels_test[i]) in s for i, s in enumerate(test_sets)) / 30)
    k = sorted(cal_scores).index(best) + 1  # the level whose guarantee is k / (n + 1)
    assert out["lac_avg2_alpha"] == pytest.approx(1 - k / 51)


@pytest.mark.parametrize("score", ["lac", "aps"])
def test_named_coverage_meets_the_guarantee_on_exchangeable_data(score):
    """[Gar23] eq. 2.5: 1 - alpha <= P(Y in C(X)) <= 1 - alpha + 1/(n + 1), for the marginal and,
    per class, for the Mondrian sets; the mean over 300 calibration draws of 150 test points is
    within 4 binomial standard errors of that interval (Beta-distributed coverage per draw)."""
    gen = torch.Generator().manual_seed(11)
    reps, n, m, alpha, num_classes = 300, 99, 150, 0.1, 4
    methods = [ConformalMethod(score, "marginal"), ConformalMethod(score, "class")]
    total = {"marginal": 0.0, "class": 0.0}
    for _ in range(reps):
        probs_cal, labels_cal = _draw(gen, n, num_classes)
        probs_test, labels_test = _draw(gen, m, num_classes)
        out = conformal_metrics(probs_cal, labels_cal, probs_test, labels_test, methods, [alpha])
        total["marginal"] += out[f"{score}90"]
        total["class"] += out[f"{score}_class90"]
    # per draw, coverage ~ Beta with variance <= alpha (1 - alpha) / (n + 2), plus the test sampling
    se = math.sqrt(alpha * (1 - alpha) / (n + 2) / reps + alpha * (1 - alpha) / (m * reps))
    low, high = 1 - alpha - 4 * se, 1 - alpha + 1 / (n + 1) + 4 * se
    assert low <= total["marginal"] / reps <= high
    # Mondrian: each class has ~n/4 calibration points; its guarantee holds per class, so the
    # marginal coverage is at least 1 - alpha too (its upper bound is looser: not checked)
    assert total["class"] / reps >= 1 - alpha - 4 * se


# --------------------------------------------------------------------------------------------
# in the trainer
# --------------------------------------------------------------------------------------------

CONFIG = {
    "data": {
        "name": "synthetic",
        "num_classes": 12,
        "num_superclasses": 3,
        "train_size": 500,
        "val_size": 600,
        "test_size": 1200,
    },
    "model": {"name": "mlp", "hidden_dim": 32},
    "loss": {"name": "ce"},
    "optim": {"lr": 0.1, "milestones": []},
    "epochs": 2,
    "device": "cpu",
    "eval": {
        "ks": [1, 3],
        "avgk": [2],
        "selection": "val/avg2",
        "conformal_alphas": [0.1],
        "conformal_match_avgk": True,
        "conformal_mondrian": ["marginal", "class", "shot"],
        "conformal_calibration_fraction": 0.5,
    },
}


@pytest.fixture(scope="module")
def fitted():
    from setvalued.training import fit

    return fit(CONFIG, 0)


def _scores(model, split):
    with torch.no_grad():
        model.eval()
        return model(split.inputs).float()


def test_fit_logs_every_conformal_metric_it_declares(fitted):
    ev = {**CONFIG["eval"], "conformal_scores": ["lac", "aps"]}
    names = [
        k
        for k in fitted["test"]
        if any(k.split("/")[-1].startswith(p) for p in ("lac", "aps", "macro_lac", "macro_aps"))
    ]
    # 6 methods x (level 90 + matched avg2) x (coverage, macro, size, 3 groups x 2) + 6 matched alphas
    assert len(names) == 6 * 2 * 9 + 6
    for name in names:
        assert check_metric(f"test/{name}", ev, ("test",)) is None, name
        assert math.isfinite(fitted["test"][name])
    for group in ("few", "medium", "many"):
        assert f"{group}/avg2_size" in fitted["test"]


def test_fit_calibrates_on_its_split_of_validation_and_selects_on_the_rest(fitted):
    """Recomputed from the selected model: the calibration part (drawn from the trial seed) gives
    the logged conformal metrics; the rest alone gives the selection metric (best_val), so the
    calibration labels play no part in choosing the checkpoint."""
    from setvalued.data import build_datasets
    from setvalued.data.common import mix_seed
    from setvalued.training import CONFORMAL_STREAM

    data = build_datasets(CONFIG["data"], 0)
    calibration, rest = split_calibration(len(data.val), 0.5, mix_seed(0, CONFORMAL_STREAM))
    val, test = _scores(fitted["model"], data.val), _scores(fitted["model"], data.test)
    val_probs = activate(val, "softmax")
    threshold = calibrate_avgk_threshold(val_probs[rest], 2)
    hits = val_probs[rest].gather(1, data.val.targets[rest][:, None])[:, 0] >= threshold
    assert fitted["best_val"] == pytest.approx(float(hits.double().mean()), abs=1e-12)
    expected = conformal_metrics(
        val_probs[calibration],
        data.val.targets[calibration],
        activate(test, "softmax"),
        data.test.targets,
        [ConformalMethod("aps", "shot")],
        [0.1],
        class_counts=data.class_counts,
    )
    for key, value in expected.items():
        assert fitted["test"][key] == pytest.approx(value, abs=1e-9), key


def test_fit_coverage_is_at_least_the_level_within_a_binomial_tolerance(fitted):
    """The synthetic validation and test sets are drawn alike, so the marginal sets cover at least
    1 - alpha of the test labels, up to the calibration and test sampling (3 standard errors with
    300 calibration and 1,200 test points)."""
    se = math.sqrt(0.1 * 0.9 / 300 + 0.1 * 0.9 / 1200)
    for name in ("lac90", "aps90"):
        assert fitted["test"][name] >= 0.9 - 3 * se, (name, fitted["test"][name])
    # the size-matched sets have about the average-K sets' size (the nearest attainable level)
    assert fitted["test"]["lac_avg2_size"] == pytest.approx(fitted["test"]["avg2_size"], abs=0.3)


def test_conformal_settings_are_refused_with_the_field_named():
    from setvalued.training import resolve_config
    from studies.studyfile.trial_config import validate_config

    base = {"loss": {"name": "ce"}, "model": {"name": "mlp"}}
    bad = [
        ({"conformal_alphas": [1.0]}, "eval.conformal_alphas"),
        ({"conformal_scores": ["raps"]}, "eval.conformal_scores"),
        ({"conformal_mondrian": [True]}, "eval.conformal_mondrian"),
        ({"conformal_calibration_fraction": 0.0}, "eval.conformal_calibration_fraction"),
        ({"conformal_match_avgk": True}, "eval.conformal_match_avgk needs the K values of eval.avgk"),
    ]
    for ev, named in bad:
        with pytest.raises(ValueError, match=named.replace(".", r"\.")):
            resolve_config({**base, "eval": ev})
        _, problems = validate_config({**base, "eval": ev})
        assert problems and all(p.path[0] == "eval" for p in problems), (ev, problems)


def test_a_config_without_conformal_settings_keeps_its_id():
    """The conformal fields are implicit: writing their defaults changes no config_id."""
    from studies.studyfile.config_ids import config_id
    from studies.studyfile.trial_config import validate_config

    plain, _ = validate_config({"loss": {"name": "ce"}})
    explicit, _ = validate_config(
        {"loss": {"name": "ce"}, "eval": {"conformal_alphas": [], "conformal_calibration_fraction": 0.5}}
    )
    asked, _ = validate_config({"loss": {"name": "ce"}, "eval": {"conformal_alphas": [0.1]}})
    assert "conformal_alphas" not in plain["eval"]
    assert config_id(plain) == config_id(explicit) != config_id(asked)
