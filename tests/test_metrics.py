"""setvalued.metrics against brute-force loops over examples (random data with ties and classes
absent from the split), the calibration rule against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from setvalued.metrics import accuracy as M

torch.set_num_threads(1)


# ----------------------------------------------------------------------------------------------
# brute force: plain Python over examples, the documented tie rule written out naively
# ----------------------------------------------------------------------------------------------


def bf_topk_hit(row: list[float], y: int, k: int) -> bool:
    """Ties count against the label: hit iff fewer than k OTHER classes score >= s_y."""
    better_or_equal = sum(1 for j, s in enumerate(row) if j != y and s >= row[y])
    return better_or_equal < k


def bf_threshold(rows: list[list[float]], k: float) -> float:
    flat = sorted((s for row in rows for s in row), reverse=True)
    m = math.floor(round(k * len(rows), 9))
    return 0.5 * (flat[m - 1] + flat[m])  # 1-indexed P_[m] and P_[m+1]


def bf_per_class(hit_list: list[bool], ys: list[int], num_classes: int):
    hits = [0] * num_classes
    counts = [0] * num_classes
    for h, y in zip(hit_list, ys):
        counts[y] += 1
        hits[y] += int(h)
    return hits, counts


def bf_macro(hits, counts, classes=None):
    classes = range(len(counts)) if classes is None else classes
    accs = [hits[c] / counts[c] for c in classes if counts[c] > 0]
    return sum(accs) / len(accs) if accs else None


def bf_groups(class_counts, low=20, high=100):
    return {
        "few": [c for c, n in enumerate(class_counts) if n < low],
        "medium": [c for c, n in enumerate(class_counts) if low <= n <= high],
        "many": [c for c, n in enumerate(class_counts) if n > high],
    }


def bf_evaluate(rows, ys, ks, class_counts, thresholds, shot=(20, 100)):
    num_classes = len(rows[0])
    groups = bf_groups(class_counts, *shot)
    out = {}
    for k in ks:
        hit_list = [bf_topk_hit(r, y, k) for r, y in zip(rows, ys)]
        hits, counts = bf_per_class(hit_list, ys, num_classes)
        out[f"top{k}"] = sum(hit_list) / len(ys)
        out[f"macro_top{k}"] = bf_macro(hits, counts)
        for g, cls in groups.items():
            v = bf_macro(hits, counts, cls)
            if v is not None:
                out[f"{g}/top{k}"] = v
    for k, t in thresholds.items():
        hit_list = [r[y] >= t for r, y in zip(rows, ys)]
        hits, counts = bf_per_class(hit_list, ys, num_classes)
        out[f"avg{k}"] = sum(hit_list) / len(ys)
        out[f"macro_avg{k}"] = bf_macro(hits, counts)
        out[f"avg{k}_size"] = sum(sum(1 for s in r if s >= t) for r in rows) / len(rows)
        for g, cls in groups.items():
            v = bf_macro(hits, counts, cls)
            if v is not None:
                out[f"{g}/avg{k}"] = v
    return out


def random_split(seed: int, n: int = 60, num_classes: int = 12, tied: bool = True):
    """Scores with many ties (few distinct values) or continuous; labels from a subset of the
    classes, so that classes 0 and 5 never occur in the split."""
    g = torch.Generator().manual_seed(seed)
    if tied:
        scores = torch.randint(0, 5, (n, num_classes), generator=g).to(torch.float32) / 4
    else:
        scores = torch.rand(n, num_classes, generator=g)
    present = torch.tensor([c for c in range(num_classes) if c not in (0, 5)])
    targets = present[torch.randint(0, len(present), (n,), generator=g)]
    return scores, targets


# class 3 and 10 have "few", 4 and 5 "medium", rest "many"; class 0 (few) is absent from the split
CLASS_COUNTS = [3, 150, 200, 7, 20, 100, 101, 400, 120, 999, 19, 300]


# ----------------------------------------------------------------------------------------------
# top-K
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_topk_metrics_match_brute_force(seed, tied):
    scores, targets = random_split(seed, tied=tied)
    rows, ys = scores.tolist(), targets.tolist()
    for k in (1, 2, 3, 5, 12):
        hit_list = [bf_topk_hit(r, y, k) for r, y in zip(rows, ys)]
        assert M.topk_hits(scores, targets, k).tolist() == hit_list
        assert M.topk_accuracy(scores, targets, k) == pytest.approx(sum(hit_list) / len(ys))
        bf_hits, bf_counts = bf_per_class(hit_list, ys, 12)
        hits, counts = M.per_class_topk(scores, targets, k, 12)
        assert hits.tolist() == bf_hits and counts.tolist() == bf_counts
        assert M.macro_topk_accuracy(scores, targets, k, 12) == pytest.approx(bf_macro(bf_hits, bf_counts))
    assert M.topk_accuracy(scores, targets, 12) == 1.0


def test_topk_ties_count_against_the_label():
    scores = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 0.0, 0.0]])
    targets = torch.tensor([0, 2, 1])
    # row 0: two others tie with the label; row 1: one other ties; row 2: one other ties
    assert M.topk_hits(scores, targets, 1).tolist() == [False, False, False]
    assert M.topk_hits(scores, targets, 2).tolist() == [False, True, True]
    assert M.topk_hits(scores, targets, 3).tolist() == [True, True, True]
    # constant scores buy nothing
    assert M.topk_accuracy(torch.zeros(5, 10), torch.arange(5), 5) == 0.0


def test_topk_without_ties_equals_torch_topk_membership():
    scores, targets = random_split(7, n=200, num_classes=30, tied=False)
    for k in (1, 5, 10):
        expected = (torch.topk(scores, k, dim=1).indices == targets[:, None]).any(dim=1)
        assert torch.equal(M.topk_hits(scores, targets, k), expected)


def test_macro_ignores_classes_absent_from_the_split():
    # class 2 never appears; per-class accuracies 1 (class 0) and 0 (class 1) -> 0.5, not 1/3
    scores = torch.tensor([[3.0, 1.0, 0.0], [2.0, 1.0, 0.0], [3.0, 1.0, 0.0]])
    targets = torch.tensor([0, 1, 0])
    assert M.macro_topk_accuracy(scores, targets, 1, 3) == pytest.approx(0.5)
    assert M.topk_accuracy(scores, targets, 1) == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------------------------
# shot groups
# ----------------------------------------------------------------------------------------------


def test_shot_groups_boundaries_and_custom_thresholds():
    groups = M.shot_groups([19, 20, 100, 101, 0])
    assert groups["few"].tolist() == [True, False, False, False, True]
    assert groups["medium"].tolist() == [False, True, True, False, False]
    assert groups["many"].tolist() == [False, False, False, True, False]
    groups = M.shot_groups([4, 5, 10, 11], thresholds=(5, 10))
    assert groups["few"].tolist() == [True, False, False, False]
    assert groups["medium"].tolist() == [False, True, True, False]
    assert groups["many"].tolist() == [False, False, False, True]
    with pytest.raises(ValueError, match="shot_thresholds"):
        M.shot_groups([1, 2], thresholds=(100, 20))


# ----------------------------------------------------------------------------------------------
# average-K
# ----------------------------------------------------------------------------------------------


def test_calibrated_threshold_on_a_hand_made_matrix():
    val = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1]], dtype=torch.float64)
    # sorted: 0.6 0.5 0.4 0.3 0.1 0.1 ; n = 2
    assert M.calibrate_avgk_threshold(val, 1) == pytest.approx(0.45)  # (P_[2] + P_[3]) / 2
    assert M.calibrate_avgk_threshold(val, 2) == pytest.approx(0.2)  # (P_[4] + P_[5]) / 2
    assert M.calibrate_avgk_threshold(val, 1.5) == pytest.approx(0.35)  # m = 3: (0.4 + 0.3) / 2
    assert M.avgk_set_sizes(val, 0.45).tolist() == [1, 1]
    assert M.avgk_set_sizes(val, 0.2).tolist() == [2, 2]
    # labels 1 and 0: 0.3 < 0.45 <= 0.5
    assert M.avgk_hits(val, torch.tensor([1, 0]), 0.45).tolist() == [False, True]


@pytest.mark.parametrize("seed", [0, 1])
def test_calibrated_mean_set_size_is_k_on_validation(seed):
    val, _ = random_split(seed, n=97, num_classes=13, tied=False)
    n = val.shape[0]
    for k in (1, 2, 3, 5, 10, 2.5, 0.7):
        t = M.calibrate_avgk_threshold(val, k)
        assert t == pytest.approx(bf_threshold(val.tolist(), k), abs=1e-12)
        size = M.avgk_set_size(val, t)
        assert abs(size - k) < 1 / n
        if float(k).is_integer():
            assert M.avgk_set_sizes(val, t).sum().item() == k * n  # exact without ties


def test_threshold_is_exact_between_adjacent_float32_scores():
    # sigmoid outputs near 1 saturate in float32: make P_[m] and P_[m+1] adjacent floats
    hi = torch.tensor(0.99999994, dtype=torch.float32)  # largest float32 below 1
    lo = torch.nextafter(hi, torch.tensor(0.0))
    val = torch.tensor([[1.0, hi.item(), 0.1], [lo.item(), 0.2, 0.0]], dtype=torch.float32)
    t = M.calibrate_avgk_threshold(val, 1)  # m = 2 -> midpoint of hi and lo, not a float32
    assert lo.item() < t < hi.item()
    assert float(torch.tensor(t, dtype=torch.float32)) in (
        lo.item(),
        hi.item(),
    )  # a float32 comparison would land on a score
    assert M.avgk_set_sizes(val, t).tolist() == [2, 0]
    assert M.avgk_set_size(val, t) == 1.0


def test_ties_at_the_threshold_are_all_included():
    val = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.1, 0.0]])
    t = M.calibrate_avgk_threshold(val, 1)  # P_[2] = P_[3] = 0.5
    assert t == 0.5
    assert M.avgk_set_size(val, t) == 1.5  # three tied entries kept


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("seed", [3, 4])
def test_avgk_metrics_match_brute_force(seed, tied):
    val, _ = random_split(seed + 100, tied=tied)
    scores, targets = random_split(seed, tied=tied)
    rows, ys = scores.tolist(), targets.tolist()
    for k in (1, 2, 3, 5):
        t = M.calibrate_avgk_threshold(val, k)
        assert t == pytest.approx(bf_threshold(val.tolist(), k))
        hit_list = [r[y] >= t for r, y in zip(rows, ys)]
        sizes = [sum(1 for s in r if s >= t) for r in rows]
        assert M.avgk_hits(scores, targets, t).tolist() == hit_list
        assert M.avgk_set_sizes(scores, t).tolist() == sizes
        assert M.avgk_accuracy(scores, targets, t) == pytest.approx(sum(hit_list) / len(ys))
        assert M.avgk_set_size(scores, t) == pytest.approx(sum(sizes) / len(sizes))
        bf_hits, bf_counts = bf_per_class(hit_list, ys, 12)
        hits, counts = M.per_class_avgk(scores, targets, t, 12)
        assert hits.tolist() == bf_hits and counts.tolist() == bf_counts
        assert M.macro_avgk_accuracy(scores, targets, t, 12) == pytest.approx(bf_macro(bf_hits, bf_counts))


# ----------------------------------------------------------------------------------------------
# evaluate
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_evaluate_matches_brute_force(tied):
    val, _ = random_split(11, tied=tied)
    scores, targets = random_split(12, tied=tied)
    thresholds = M.calibrate_avgk_thresholds(val, [1, 3, 5])
    got = M.evaluate(scores, targets, [1, 3, 5], CLASS_COUNTS, avgk_threshold=thresholds)
    expected = bf_evaluate(scores.tolist(), targets.tolist(), [1, 3, 5], CLASS_COUNTS, thresholds)
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key
    for key in (
        "top5",
        "macro_top5",
        "few/top5",
        "medium/top5",
        "many/top5",
        "avg5",
        "macro_avg5",
        "avg5_size",
        "few/avg5",
        "medium/avg5",
        "many/avg5",
    ):
        assert key in got
    assert all(isinstance(v, float) for v in got.values())


def test_evaluate_omits_groups_without_present_classes_and_uses_custom_thresholds():
    scores, targets = random_split(5, tied=False)
    # every present class is "many" with (20, 100); with (1000, 2000) every class is "few"
    got = M.evaluate(scores, targets, [1], [500] * 12)
    assert set(got) == {"top1", "macro_top1", "many/top1"}
    got = M.evaluate(scores, targets, [1], [500] * 12, shot_thresholds=(1000, 2000))
    assert set(got) == {"top1", "macro_top1", "few/top1"}
    assert got["few/top1"] == pytest.approx(got["macro_top1"])
    # the only "few" class (0) is absent from the split: no few/ key
    counts = [5] + [500] * 11
    assert "few/top1" not in M.evaluate(scores, targets, [1], counts)
    assert set(M.evaluate(scores, targets, [1, 40], None)) == {"top1", "macro_top1"}


def test_activation_options():
    logits = torch.randn(4, 6)
    assert torch.allclose(M.activate(logits, "softmax").sum(1), torch.ones(4, dtype=torch.float64))
    assert torch.allclose(M.activate(logits, "sigmoid"), torch.sigmoid(logits.double()))
    assert M.activate(logits, None) is logits
    with pytest.raises(ValueError, match="activation"):
        M.activate(logits, "tanh")


def test_bad_inputs_name_the_argument():
    scores = torch.rand(4, 5)
    with pytest.raises(ValueError, match="targets"):
        M.topk_accuracy(scores, torch.tensor([0, 1, 2, 5]), 1)
    with pytest.raises(ValueError, match="targets"):
        M.topk_accuracy(scores, torch.tensor([0, 1]), 1)
    with pytest.raises(ValueError, match="k must"):
        M.topk_accuracy(scores, torch.tensor([0, 1, 2, 3]), 0)
    with pytest.raises(ValueError, match="k must"):
        M.calibrate_avgk_threshold(scores, 5)  # no (n*L + 1)-th value
    with pytest.raises(ValueError, match="k must"):
        M.calibrate_avgk_threshold(scores, 0.1)  # floor(0.4) = 0 entries
    with pytest.raises(ValueError, match="scores contain NaN"):
        M.topk_accuracy(torch.full((2, 3), float("nan")), torch.tensor([0, 1]), 1)
    with pytest.raises(ValueError, match="class_counts"):
        M.evaluate(scores, torch.tensor([0, 1, 2, 3]), [1], [1, 2, 3])
    with pytest.raises(ValueError, match="num_classes"):
        M.per_class_topk(scores, torch.tensor([0, 1, 2, 3]), 1, num_classes=7)


# ----------------------------------------------------------------------------------------------
# bins of classes by training images ([Gar23] Table 3.1)
# ----------------------------------------------------------------------------------------------


def bf_bin_accuracy(rows, ys, class_counts, low, high, hit):
    """Mean over the classes with low < n <= high training images (n = 0 in a bin from 0) that
    occur in the split of their examples' hit rate, written as plain loops."""
    rates = []
    for c, n in enumerate(class_counts):
        inside = (n >= 0 if low == 0 else n > low) and (high is None or n <= high)
        examples = [i for i, y in enumerate(ys) if y == c]
        if inside and examples:
            rates.append(sum(hit(rows[i], ys[i]) for i in examples) / len(examples))
    return sum(rates) / len(rates) if rates else None


@pytest.mark.parametrize("tied", [True, False])
def test_count_bin_metrics_match_brute_force(tied):
    val, _ = random_split(21, tied=tied)
    scores, targets = random_split(22, tied=tied)
    rows, ys = scores.tolist(), targets.tolist()
    thresholds = M.calibrate_avgk_thresholds(val, [3])
    # edges on the counts themselves (20, 100, 120) test that a bin includes its upper edge
    edges = [10, 20, 100, 120, 400]
    got = M.evaluate(scores, targets, [1, 3], CLASS_COUNTS, avgk_threshold=thresholds, count_bins=edges)
    bins = [
        ("count_0_10", 0, 10),
        ("count_10_20", 10, 20),
        ("count_20_100", 20, 100),
        ("count_100_120", 100, 120),
        ("count_120_400", 120, 400),
        ("count_400_inf", 400, None),
    ]
    checked = 0
    for name, low, high in bins:
        for k in (1, 3):
            expected = bf_bin_accuracy(rows, ys, CLASS_COUNTS, low, high, lambda r, y: bf_topk_hit(r, y, k))
            assert got.get(f"{name}/top{k}") == (pytest.approx(expected) if expected is not None else None), (name, k)
            checked += expected is not None
        expected = bf_bin_accuracy(rows, ys, CLASS_COUNTS, low, high, lambda r, y: r[y] >= thresholds[3])
        assert got.get(f"{name}/avg3") == (pytest.approx(expected) if expected is not None else None)
    # every bin but count_20_100 holds a class present in the split; its only class (5, with
    # 100 images) never occurs, so the bin has no key
    assert checked == 2 * (len(bins) - 1)
    assert not any(key.startswith("count_20_100/") for key in got)
    # the shot groups and the micro/macro metrics are unchanged by the bins
    plain = M.evaluate(scores, targets, [1, 3], CLASS_COUNTS, avgk_threshold=thresholds)
    assert {k: v for k, v in got.items() if not k.startswith("count_")} == plain


def test_count_bins_partition_the_classes_and_name_the_table_3_1_bins():
    from setvalued.metrics import count_bins

    counts = [3, 10, 11, 50, 51, 500, 501, 2000, 2001, 40000]
    groups = M.count_bin_groups(counts, [10, 50, 500, 2000])
    assert list(groups) == ["count_0_10", "count_10_50", "count_50_500", "count_500_2000", "count_2000_inf"]
    members = {name: [n for n, inside in zip(counts, mask.tolist()) if inside] for name, mask in groups.items()}
    assert members == {
        "count_0_10": [3, 10],
        "count_10_50": [11, 50],
        "count_50_500": [51, 500],
        "count_500_2000": [501, 2000],
        "count_2000_inf": [2001, 40000],
    }
    assert M.count_bin_groups(counts, []) == {} and count_bins([]) == []
    assert M.count_bin_groups([0, 1, 2], [1])["count_0_1"].tolist() == [True, True, False]
    for bad in ([50, 10], [10, 10], [0, 5]):
        with pytest.raises(ValueError, match="count_bins"):
            M.count_bin_groups(counts, bad)


def test_count_bin_metric_names_are_checked_against_the_eval_section():
    from setvalued.metrics import check_metric

    ev = {"ks": [1, 5], "avgk": [5], "count_bins": [10, 50, 500, 2000]}
    for name in ("test/count_0_10/top1", "test/count_2000_inf/top5", "val/count_10_50/avg5"):
        assert check_metric(name, ev, ("val", "test")) is None, name
    reason = check_metric("test/count_10_40/top1", ev, ("test",))
    assert "count_10_40" in reason and "count_10_50" in reason
    assert "eval.count_bins" in check_metric("test/count_0_10/top1", {"ks": [1]}, ("test",))
    assert "already macro" in check_metric("test/count_0_10/macro_top1", ev, ("test",))
