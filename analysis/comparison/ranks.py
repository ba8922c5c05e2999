"""Ranks across tasks: average ranks, Friedman's test, pairwise Wilcoxon signed-rank tests with
Holm's correction, and what the critical-difference diagram draws.

Demšar (JMLR 2006, section 3.2.2) ranks the variants on each task (1 = best, ties share the
mean of their ranks) and averages the ranks over the N tasks; Friedman's test asks whether
the k average ranks differ more than chance (scipy.stats.friedmanchisquare, tie-corrected
chi-square on k - 1 df). The pairwise follow-up is the one Benavoli, Corani and Mangili
(JMLR 2016, "Should we really use post-hoc tests based on mean-ranks?") recommend over
Nemenyi's mean-ranks test: a Wilcoxon signed-rank test of each pair on its N per-task means,
Holm-corrected over the k(k-1)/2 pairs (scikit-posthocs' `posthoc_wilcoxon`, scipy's
Wilcoxon and statsmodels' Holm; docs/comparison.md says why scikit-posthocs). The
critical-difference diagram joins the variants that no corrected test tells apart.

Each task's value of a variant is its mean over seeds: ranks compare variants across tasks,
the seeds are the per-task tables' business. With N tasks the exact two-sided Wilcoxon p is at
least 2 / 2^N (all N differences of one sign): below 6 tasks no pair can reach p < 0.05, which
the report says rather than let "not significant" read as "no difference".
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import stats as sps

from analysis.comparison.tasks import Scores

__all__ = ["RankTests", "rank_tests", "average_ranks", "smallest_wilcoxon_p"]


def average_ranks(means: np.ndarray, lower_is_better: bool = False) -> np.ndarray:
    """Per task (row) the rank of each variant (column), 1 = best, ties averaged."""
    signed = means if lower_is_better else -means
    return sps.rankdata(signed, method="average", axis=1)


def smallest_wilcoxon_p(n: int) -> float:
    """The smallest two-sided p-value of the exact Wilcoxon signed-rank test on n pairs: 2 / 2^n."""
    return min(1.0, 2.0 / 2.0**n) if n > 0 else 1.0


@dataclass
class RankTests:
    """The rank statistics of a comparison on its complete tasks."""

    variants: list[str]
    tasks: list[int]  # indices into Scores.tasks
    means: np.ndarray  # tasks x variants
    ranks: np.ndarray  # tasks x variants, 1 = best
    friedman_statistic: float = math.nan
    friedman_p: float = math.nan
    p_raw: np.ndarray | None = None  # variants x variants, Wilcoxon
    p_holm: np.ndarray | None = None  # the same, Holm-corrected over the pairs
    notes: list[str] = field(default_factory=list)

    @property
    def average(self) -> dict[str, float]:
        return dict(zip(self.variants, self.ranks.mean(axis=0).tolist()))

    def record(self, i: int, j: int) -> tuple[int, int, int]:
        """(wins, ties, losses) of variant i against j over the tasks, on the task means."""
        a, b = self.ranks[:, i], self.ranks[:, j]
        return int(np.sum(a < b)), int(np.sum(a == b)), int(np.sum(a > b))


def rank_tests(scores: Scores, variants: Sequence[str], level: float) -> RankTests:
    """Average ranks, Friedman and pairwise Wilcoxon-Holm of `variants` on the tasks where
    each has a value (module docstring)."""
    variants = list(variants)
    tasks = scores.complete_tasks(variants)
    means = np.array([[scores.entries[(t, v)].mean for v in variants] for t in tasks], dtype=float).reshape(
        len(tasks), len(variants)
    )
    ranks = average_ranks(means, scores.lower_is_better) if tasks else np.zeros((0, len(variants)))
    result = RankTests(variants, tasks, means, ranks)
    n, k = len(tasks), len(variants)
    if k >= 3 and n >= 2:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all ranks equal: NaN, said below
            found = sps.friedmanchisquare(*means.T)
        result.friedman_statistic, result.friedman_p = float(found.statistic), float(found.pvalue)
    elif k < 3:
        result.notes.append("Friedman's test needs three or more variants: the pairwise test says it all.")
    if k >= 2 and n >= 2:
        result.p_raw, result.p_holm = _pairwise_wilcoxon(means, variants)
        smallest = smallest_wilcoxon_p(n)
        if smallest >= 1 - level:
            result.notes.append(
                f"With {n} tasks the smallest possible two-sided Wilcoxon p is 2/2^{n} = {smallest:.3g}: "
                f"no pair can be significant at {1 - level:.2g} (at least "
                f"{_tasks_needed(1 - level)} tasks are needed), whatever the differences."
            )
    else:
        result.notes.append(f"{n} complete task(s): no rank test (two or more are needed).")
    return result


def _tasks_needed(alpha: float) -> int:
    n = 1
    while smallest_wilcoxon_p(n) >= alpha:
        n += 1
    return n


def _pairwise_wilcoxon(means: np.ndarray, variants: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(raw, Holm) p-value matrices of the Wilcoxon signed-rank test of every pair on the
    task means, by scikit-posthocs (pairs aligned by task: its rows are in task order)."""
    import pandas as pd
    import scikit_posthocs as sp

    n, k = means.shape
    names = [f"v{i}" for i in range(k)]  # variant names may repeat a pandas label's meaning
    long = pd.DataFrame({"value": means.T.reshape(-1), "variant": np.repeat(names, n)})
    out = []
    for adjust in (None, "holm"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all differences zero: p = 1
            warnings.simplefilter("ignore", UserWarning)  # scipy: exact p with ties -> normal approximation
            frame = sp.posthoc_wilcoxon(long, val_col="value", group_col="variant", p_adjust=adjust)
        out.append(frame.loc[names, names].to_numpy(dtype=float))
    return out[0], out[1]
