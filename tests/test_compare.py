"""`studies compare` (issue 40): the statistics against outside implementations on fixed data
(scipy, scikit-posthocs' own building blocks, rliable's published definitions written out by
hand, a hand-run stratified bootstrap with the same seed), the rules that turn studies into
tasks, and the command on studies written with the real MLflow client."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from scipy import stats as sps

from analysis.comparison import (
    CompareError,
    StudyRuns,
    average_ranks,
    compare,
    iqm,
    probability_of_improvement,
    rank_tests,
    smallest_wilcoxon_p,
    stratified_improvement,
    stratified_iqm,
    task_scores,
    write_comparison,
)
from analysis.comparison.tables import best_by_test, paper_table
from analysis.intervals import holm

TOL = 1e-9

# ----------------------------------------------------------------------------- fixed data

#: per-task means of 4 variants on 7 tasks, with ties inside tasks
MEANS = np.array(
    [
        [0.71, 0.74, 0.74, 0.69],
        [0.80, 0.83, 0.81, 0.80],
        [0.55, 0.61, 0.58, 0.52],
        [0.90, 0.90, 0.92, 0.88],
        [0.62, 0.66, 0.60, 0.61],
        [0.77, 0.79, 0.78, 0.70],
        [0.68, 0.73, 0.69, 0.67],
    ]
)


def _rows(values: dict, swept=None, best_val=None) -> list[dict]:
    """Collected-like rows: {(variant, config): [per-seed values]}."""
    rows = []
    for (variant, config), seeds in values.items():
        for seed, value in enumerate(seeds):
            row = {
                "config_id": f"{variant}-{config}",
                "variant": variant,
                "seed": seed,
                "swept": json.dumps((swept or {}).get((variant, config), {})),
                "test/top5": value,
            }
            if best_val is not None:
                row["best_val"] = best_val[(variant, config)]
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- ranks


def test_average_ranks_equal_a_hand_count_with_ties_shared():
    ranks = average_ranks(MEANS)
    for t, row in enumerate(MEANS):
        for j, value in enumerate(row):
            better = np.sum(row > value)
            tied = np.sum(row == value)
            assert ranks[t, j] == pytest.approx(better + (tied + 1) / 2, abs=1e-12)
    lower = average_ranks(MEANS, lower_is_better=True)
    assert np.allclose(lower, len(MEANS[0]) + 1 - ranks)


def _scores_of(means: np.ndarray, seeds: int = 3, spread: float = 0.01):
    """Scores whose per-task means are exactly `means` (values mean ± spread, symmetric)."""
    rows = []
    offsets = np.linspace(-spread, spread, seeds)
    for t, row in enumerate(means):
        for j, mean in enumerate(row):
            for s, off in enumerate(offsets):
                rows.append(
                    {
                        "config_id": f"c{t}{j}",
                        "variant": f"v{j}",
                        "seed": s,
                        "swept": json.dumps({"data.pareto_shape": t}),
                        "test/top5": float(mean + off * (1 + 0.1 * j)),
                    }
                )
    return task_scores([StudyRuns("s", rows, [f"v{j}" for j in range(means.shape[1])])], "test/top5")


def test_friedman_and_pairwise_wilcoxon_holm_equal_scipy_and_holm_by_hand():
    scores = _scores_of(MEANS)
    found = rank_tests(scores, scores.variants, 0.95)
    means = np.array([[scores.entries[(t, v)].mean for v in scores.variants] for t in range(len(MEANS))])
    assert np.allclose(means, MEANS, atol=1e-12)
    expected = sps.friedmanchisquare(*MEANS.T)
    assert abs(found.friedman_statistic - expected.statistic) < TOL and abs(found.friedman_p - expected.pvalue) < TOL
    # Friedman's statistic from the average ranks (Demšar 2006 eq. 1), corrected for ties as scipy does
    n, k = MEANS.shape
    r = average_ranks(MEANS).mean(axis=0)
    chi2 = 12 * n / (k * (k + 1)) * (np.sum(r**2) - k * (k + 1) ** 2 / 4)
    ties = sum(np.sum(c**3 - c) for c in (np.unique(row, return_counts=True)[1] for row in MEANS))
    assert found.friedman_statistic == pytest.approx(chi2 / (1 - ties / (n * k * (k**2 - 1))), abs=TOL)
    pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
    raw = [sps.wilcoxon(means[:, i], means[:, j]).pvalue for i, j in pairs]
    adjusted = holm(raw)
    for (i, j), p, q in zip(pairs, raw, adjusted):
        assert abs(found.p_raw[i, j] - p) < TOL and abs(found.p_raw[j, i] - p) < TOL
        assert abs(found.p_holm[i, j] - q) < TOL
    assert found.average == pytest.approx(dict(zip(scores.variants, r)), abs=1e-12)


def test_with_few_tasks_the_report_says_no_pair_can_be_significant():
    assert smallest_wilcoxon_p(3) == 0.25 and smallest_wilcoxon_p(6) == pytest.approx(1 / 32)
    # the exact test on n pairs all of one sign reaches exactly that p
    assert sps.wilcoxon(np.arange(1.0, 5.0), np.zeros(4)).pvalue == pytest.approx(smallest_wilcoxon_p(4))
    found = rank_tests(_scores_of(MEANS[:3]), ["v0", "v1", "v2", "v3"], 0.95)
    assert any("smallest possible two-sided Wilcoxon p is 2/2^3 = 0.25" in n and "6 tasks" in n for n in found.notes)


# ----------------------------------------------------------------------------- aggregates

X_TASKS = [np.array([0.61, 0.64, 0.70, 0.58]), np.array([0.81, 0.79, 0.80]), np.array([0.44, 0.52, 0.47, 0.49, 0.50])]
Y_TASKS = [np.array([0.60, 0.61, 0.66, 0.61]), np.array([0.80, 0.80, 0.77]), np.array([0.45, 0.46, 0.47, 0.43, 0.48])]


def test_iqm_is_the_mean_of_the_middle_half_of_all_values():
    pooled = np.sort(np.concatenate(X_TASKS))  # 12 values: drop 3 at each end
    assert iqm(X_TASKS) == pytest.approx(pooled[3:9].mean(), abs=1e-12)


def test_probability_of_improvement_is_the_mann_whitney_u_over_pairs_averaged_over_tasks():
    expected = np.mean(
        [sps.mannwhitneyu(x, y).statistic / (x.size * y.size) for x, y in zip(X_TASKS, Y_TASKS)]
    )  # U of x counts x > y, and ties as a half
    assert probability_of_improvement(X_TASKS, Y_TASKS) == pytest.approx(expected, abs=1e-12)
    # lower is better: improvement is the lower value
    lower = np.mean([sps.mannwhitneyu(y, x).statistic / (x.size * y.size) for x, y in zip(X_TASKS, Y_TASKS)])
    assert probability_of_improvement(X_TASKS, Y_TASKS, lower_is_better=True) == pytest.approx(lower, abs=1e-12)


def _hand_bootstrap(samples, statistic, level, n_resamples, seed):
    """A stratified bootstrap by hand: each sample (a task's seeds) resampled with
    replacement on its own, in order, from one generator; the percentile interval."""
    rng = np.random.default_rng(seed)
    resampled = [np.asarray(s)[rng.integers(0, len(s), (n_resamples, len(s)))] for s in samples]
    theta = np.array([statistic([r[b] for r in resampled]) for b in range(n_resamples)])
    alpha = (1 - level) / 2
    return np.quantile(theta, [alpha, 1 - alpha])


def test_the_stratified_bootstrap_equals_a_hand_run_with_the_same_seed():
    found = stratified_iqm(X_TASKS, 0.95, 2000, seed=11)
    pooled_iqm = lambda tasks: sps.trim_mean(np.concatenate(tasks), 0.25)  # noqa: E731
    low, high = _hand_bootstrap(X_TASKS, pooled_iqm, 0.95, 2000, 11)
    assert abs(found.low - low) < TOL and abs(found.high - high) < TOL
    assert found.value == pytest.approx(iqm(X_TASKS), abs=1e-12) and found.tasks == 3 and found.values == 12

    found = stratified_improvement(X_TASKS, Y_TASKS, level=0.9, n_resamples=1500, seed=5)
    m = len(X_TASKS)

    def poi(samples):
        return np.mean([sps.mannwhitneyu(x, y).statistic / (x.size * y.size) for x, y in zip(samples[:m], samples[m:])])

    low, high = _hand_bootstrap(X_TASKS + Y_TASKS, poi, 0.9, 1500, 5)
    assert abs(found.low - low) < TOL and abs(found.high - high) < TOL


def test_a_task_is_never_resampled_as_a_whole():
    """Stratified: every resample keeps each task's own values; a task of constant values
    contributes the same values to every resample (here: the interval collapses to the point)."""
    constant = [np.array([0.5, 0.5, 0.5]), np.array([0.9, 0.9])]
    found = stratified_iqm(constant, n_resamples=500)
    assert found.low == found.high == pytest.approx(iqm(constant))


# ----------------------------------------------------------------------------- studies as tasks


def test_tasks_are_the_values_every_variant_sweeps_and_configs_are_chosen_on_validation():
    swept = {
        ("ce", "a"): {"data.pareto_shape": 1.0},
        ("ce", "b"): {"data.pareto_shape": 2.0},
        ("noised", "a1"): {"data.pareto_shape": 1.0, "loss.epsilon": 0.1},
        ("noised", "a2"): {"data.pareto_shape": 1.0, "loss.epsilon": 1.0},
        ("noised", "b1"): {"data.pareto_shape": 2.0, "loss.epsilon": 0.1},
    }
    values = {
        ("ce", "a"): [0.70, 0.71, 0.72],
        ("ce", "b"): [0.80, 0.81, 0.82],
        ("noised", "a1"): [0.60, 0.61, 0.62],  # worse on test, better on validation: chosen
        ("noised", "a2"): [0.90, 0.91, 0.92],
        ("noised", "b1"): [0.85, 0.86, 0.87],
    }
    best_val = {
        ("ce", "a"): 0.7,
        ("ce", "b"): 0.8,
        ("noised", "a1"): 0.75,
        ("noised", "a2"): 0.6,
        ("noised", "b1"): 0.9,
    }
    scores = task_scores([StudyRuns("imb", _rows(values, swept, best_val), ["ce", "noised"])])
    assert [t.label for t in scores.tasks] == ["imb (pareto_shape=1)", "imb (pareto_shape=2)"]
    assert scores.metric == "test/top5"
    chosen = scores.entry(0, "noised")
    assert chosen.config_id == "noised-a1" and chosen.values == (0.60, 0.61, 0.62) and chosen.candidates == 2
    assert any("best of several configs by mean best_val" in n for n in scores.notes)
    # without a validation score, several configs cannot be chosen among
    with pytest.raises(CompareError, match=r"'noised' has 2 configs and none logged 'best_val'"):
        task_scores([StudyRuns("imb", _rows(values, swept), ["ce", "noised"])])


def test_variants_are_matched_by_name_or_mapping_and_missing_ones_are_said():
    a = StudyRuns("a", _rows({("ce", "x"): [0.7, 0.72, 0.71], ("topk", "x"): [0.75, 0.74, 0.76]}), ["ce", "topk"])
    b = StudyRuns("b", _rows({("ce", "x"): [0.6, 0.62], ("noised", "x"): [0.65, 0.66]}), ["ce", "noised"])
    c = StudyRuns("c", _rows({("ce", "x"): [0.5, 0.52, 0.5], ("svm", "x"): [0.55, 0.5, 0.53]}), ["ce", "svm"])
    scores = task_scores([a, b, c], rename={"b:noised": "topk"})
    assert scores.variants == ["ce", "topk", "svm"]
    assert scores.entry(1, "topk").values == (0.65, 0.66)
    found = compare([a, b, c], rename={"b:noised": "topk"}, n_resamples=200)
    assert found.ranked == ["ce", "topk"]  # svm is on 1 of 3 tasks
    assert any(n.startswith("svm has a value on 1 of 3 tasks") for n in found.notes)
    assert any("the variants ran different seeds" in n for n in scores.notes) is False  # same seeds inside each task
    with pytest.raises(CompareError, match="--reference 'sgd' is not a variant"):
        compare([a, b], reference="sgd")
    with pytest.raises(CompareError, match="study 'a' logged no 'test/top1'"):
        task_scores([a, b], "test/top1")
    with pytest.raises(CompareError, match="named twice"):
        task_scores([a, a])


def test_a_study_of_several_versions_is_compared_on_its_latest():
    rows = _rows({("ce", "x"): [0.7, 0.71], ("topk", "x"): [0.75, 0.74]})
    old = [
        dict(r, version="aaaaaaa1", start_time=1, config_id=r["config_id"] + "-old", **{"test/top5": 0.1}) for r in rows
    ]
    new = [dict(r, version="bbbbbbb2", start_time=2) for r in rows]
    scores = task_scores([StudyRuns("v", old + new, ["ce", "topk"])])
    assert scores.entry(0, "ce").values == (0.7, 0.71)
    assert any("2 versions; compared on the latest (bbbbbbb" in n and "never pooled" in n for n in scores.notes)


def test_different_seed_counts_are_said_and_paired_tests_use_the_shared_seeds():
    study = StudyRuns("s", _rows({("ce", "x"): [0.7, 0.71, 0.72, 0.73], ("topk", "x"): [0.8, 0.81]}), ["ce", "topk"])
    scores = task_scores([study])
    assert any("different seeds (ce 4, topk 2)" in n and "the 2 they share" in n for n in scores.notes)


# ----------------------------------------------------------------------------- the paper table


def test_bold_only_where_the_paired_test_says_the_best_is_best():
    clear = _rows({("ce", "x"): [0.70, 0.72, 0.71, 0.73, 0.69], ("topk", "x"): [0.75, 0.771, 0.759, 0.781, 0.742]})
    noisy = _rows({("ce", "x"): [0.70, 0.60, 0.80], ("topk", "x"): [0.72, 0.55, 0.85]})
    scores = task_scores([StudyRuns("clear", clear, ["ce", "topk"]), StudyRuns("noisy", noisy, ["ce", "topk"])])
    t = sps.ttest_rel([0.75, 0.771, 0.759, 0.781, 0.742], [0.70, 0.72, 0.71, 0.73, 0.69])
    assert t.pvalue < 0.05 and best_by_test(scores, 0, 0.95) == "topk"
    assert sps.ttest_rel([0.72, 0.55, 0.85], [0.70, 0.60, 0.80]).pvalue > 0.05 and best_by_test(scores, 1, 0.95) is None
    found = compare(
        [StudyRuns("clear", clear, ["ce", "topk"]), StudyRuns("noisy", noisy, ["ce", "topk"])], n_resamples=200
    )
    table = paper_table(scores, found.ranks, 0.95)
    assert [e.bold for e in table.rows[0][1:]] == [False, True]
    assert [e.bold for e in table.rows[1][1:]] == [False, False]


def test_small_seed_honesty_per_seed_values_and_a_note_for_clipped_or_few_seeds():
    few = _rows({("ce", "x"): [0.99, 1.0, 0.97], ("topk", "x"): [0.41, 0.994, 0.95]})
    many = _rows({("ce", "x"): list(np.linspace(0.5, 0.6, 11)), ("topk", "x"): list(np.linspace(0.52, 0.61, 11))})
    studies = [StudyRuns("few", few, ["ce", "topk"]), StudyRuns("many", many, ["ce", "topk"])]
    scores = task_scores(studies)
    table = paper_table(scores, compare(studies, n_resamples=200).ranks, 0.95)
    assert table.rows[0][2].detail == "seeds: 41.0, 99.4, 95.0"
    mean = np.mean([0.41, 0.994, 0.95]) * 100
    assert re.match(rf"{mean:.1f} \[0\.0, 100\.0\]", table.rows[0][2].text)  # clipped: shown by its bounds
    assert table.rows[1][1].detail == ""  # 11 seeds: the interval says enough
    assert table.note.startswith("Note: 2 intervals rest on fewer than 5 seeds") and "2 intervals clipped" in table.note


def test_the_report_is_written_in_html_markdown_and_latex(tmp_path):
    rng = np.random.default_rng(3)
    studies = []
    for s in range(3):
        values = {(v, "x"): list(0.6 + 0.03 * j + 0.05 * s + rng.normal(0, 0.01, 4)) for j, v in enumerate("abc")}
        studies.append(StudyRuns(f"st{s}", _rows(values), ["a", "b", "c"]))
    path = write_comparison(compare(studies, reference="a", n_resamples=500), tmp_path / "cmp")
    html, md, tex = (
        path.read_text(),
        (tmp_path / "cmp" / "report.md").read_text(),
        (tmp_path / "cmp" / "tables.tex").read_text(),
    )
    for heading in ("Results by task", "Ranks across tasks", "Aggregates over tasks and seeds"):
        assert heading in html and heading in md
    assert "Critical-difference diagram" in html and "seeds: " in html and "Friedman" in md
    assert "Figure failed" not in md
    for name in ("critical_difference", "differences_by_task", "aggregates"):
        assert (tmp_path / "cmp" / "figures" / f"{name}.png").stat().st_size > 5000
    assert r"\begin{tabular}" in tex and "average rank" in tex and r"{\scriptsize seeds: " in tex
    assert "2/2^3 = 0.25" in md  # three tasks: no pair can be significant, and the report says so


# ----------------------------------------------------------------------------- the command


def _log_two_studies(uri: str) -> dict:
    """Two studies on the tracking server in the runner's layout: `a` sweeps data.label_noise
    for both its variants (two tasks), `b` names the noised loss `topk` (one task)."""
    try:
        from test_collect import BASE_CONFIG, CellRun, log_study_runs, set_path, unique_name
    except ImportError:
        from tests.test_collect import BASE_CONFIG, CellRun, log_study_runs, set_path, unique_name

    names = {"a": unique_name("cmpa"), "b": unique_name("cmpb")}
    ce = set_path(BASE_CONFIG, "loss", {"name": "ce"})
    values = {}
    cells = []
    for p in (0.0, 0.2):
        for variant, config in (("ce", ce), ("noised", BASE_CONFIG)):
            config = set_path(config, "data.label_noise", p)
            for seed in range(3):
                value = round(0.8 - p + (0.02 if variant == "noised" else 0.0) + 0.003 * seed * (1 + p), 6)
                values.setdefault((names["a"], p, variant), []).append(value)
                cells.append(
                    CellRun(variant, config, seed, {"data.label_noise": p}, test={"top5": value}, best_val=0.5)
                )
    study_a = f"name: {names['a']}\nvariants: {{ce: {{}}, noised: {{}}}}\n"
    log_study_runs(uri, names["a"], cells, study_yaml=study_a)
    cells = []
    for variant, config in (("ce", ce), ("topk", BASE_CONFIG)):
        for seed in range(3):
            value = round(0.6 + (0.01 if variant == "topk" else 0.0) - 0.004 * seed, 6)
            values.setdefault((names["b"], None, "noised" if variant == "topk" else variant), []).append(value)
            cells.append(CellRun(variant, config, seed, {}, test={"top5": value}, best_val=0.5))
    log_study_runs(uri, names["b"], cells, study_yaml=f"name: {names['b']}\nvariants: {{ce: {{}}, topk: {{}}}}\n")
    return {"names": names, "values": values}


def _cli(*argv: str) -> int:
    from studies.cli import main

    return main(list(argv))


@pytest.mark.slow
def test_studies_compare_reads_a_tracking_server_and_writes_the_report(mlflow_server, tmp_path, capsys):
    logged = _log_two_studies(mlflow_server)
    a, b = logged["names"]["a"], logged["names"]["b"]
    capsys.readouterr()  # MLflow's lines while logging
    out = tmp_path / "cmp"
    code = _cli(
        "compare",
        a,
        b,
        "--tracking-uri",
        mlflow_server,
        "--map",
        f"{b}:topk=noised",
        "--to",
        str(out),
        "--resamples",
        "500",
        "--output",
        str(tmp_path / "studies"),
    )
    assert code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip() == str(out / "report.html")
    md = (out / "report.md").read_text()
    # the paper table holds the t intervals computed here from the logged values, with the seeds
    for (study, p, variant), values in logged["values"].items():
        x = np.asarray(values) * 100
        half = sps.t.ppf(0.975, 2) * x.std(ddof=1) / math.sqrt(3)
        assert f"{x.mean():.1f} ± {half:.1f} (seeds: {', '.join(f'{v:.1f}' for v in x)})" in md, (study, p, variant)
    assert f"| {a} (p=0) |" in md and f"| {a} (p=0.2) |" in md and f"| {b} |" in md
    assert "P(improves on ce)" in md and (out / "figures" / "critical_difference.png").exists()
    # bad input: exit 2, one line naming what was expected, nothing written
    assert _cli("compare", a, "--tracking-uri", mlflow_server, "--reference", "sgd", "--to", str(tmp_path / "x")) == 2
    err = capsys.readouterr().err
    assert "--reference 'sgd' is not a variant" in err and "ce, noised" in err and not (tmp_path / "x").exists()
    assert _cli("compare", a, "--tracking-uri", mlflow_server, "--metric", "test/top9") == 2
    assert f"study {a!r} logged no 'test/top9'" in capsys.readouterr().err
    assert _cli("compare", a, "--map", "nonsense", "--tracking-uri", mlflow_server) == 2


@pytest.mark.slow
def test_the_notebook_api_gives_the_same_values(mlflow_server, tmp_path):
    from studies import api

    logged = _log_two_studies(mlflow_server)
    a, b = logged["names"]["a"], logged["names"]["b"]
    frame = api.compare_scores([a, b], tracking_uri=mlflow_server, rename={"topk": "noised"})
    assert list(frame.columns) == ["task", "study", "variant", "config", "seed", "value", "metric"]
    assert frame.attrs["units"] == {"test/top5": "%"}
    got = frame[frame.study == b].groupby("variant")["value"].apply(list).to_dict()
    assert got["noised"] == pytest.approx([v * 100 for v in logged["values"][(b, None, "noised")]])
    path = api.compare([a, b], tracking_uri=mlflow_server, rename={"topk": "noised"}, to=tmp_path / "c", resamples=200)
    assert path == tmp_path / "c" / "report.html" and "Aggregates over tasks and seeds" in path.read_text()


@pytest.mark.slow
def test_the_worked_example_of_docs_comparison_runs_as_written(tmp_path):
    """docs/comparison.md's two commands, as written there, on the catalogue's three imbalance
    ratios: the study runs, and the comparison reads three tasks of three variants over three seeds."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    page = (repo / "docs" / "comparison.md").read_text(encoding="utf-8")
    example = page[page.index("## A worked example") :]
    block = example[example.index("```bash") + len("```bash") : example.index("```", example.index("```bash") + 7)]
    commands = [line.split("#")[0].split() for line in block.splitlines() if line.startswith("studies ")]
    assert [c[:2] for c in commands] == [["studies", "run"], ["studies", "compare"]]
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = "import sys; from studies.cli import main; sys.exit(main())"
    outputs = []
    for command in commands:
        result = subprocess.run(
            [sys.executable, "-c", code, *command[1:], "--output", str(tmp_path)],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        outputs.append(result.stdout)
    report = Path(outputs[-1].strip().splitlines()[-1])
    assert report == tmp_path / "comparisons" / "compare_imbalance" / "report.html"
    md = report.with_name("report.md").read_text()
    for shape in ("0.8", "1.5", "3"):
        assert f"| compare_imbalance (pareto_shape={shape}) |" in md
    assert "| task | ce | noised_topk | smooth_topk_svm |" in md and "average rank (3 tasks)" in md
    assert len(re.findall(r"\(seeds: [0-9.]+, [0-9.]+, [0-9.]+\)", md)) == 9
    assert "2/2^3 = 0.25" in md and "P(improves on ce)" in md
    for name in ("critical_difference", "differences_by_task", "aggregates"):
        assert (report.parent / "figures" / f"{name}.png").is_file()
