"""Aggregates over tasks and seeds with stratified-bootstrap intervals (Agarwal, Schwarzer,
Castro, Courville and Bellemare, NeurIPS 2021, "Deep reinforcement learning at the edge of
the statistical precipice", section 4 and appendix A.1; the definitions of their library
rliable):

- **IQM**, the interquartile mean of all (task, seed) values of a variant pooled: the mean of
  the middle 50 %, `scipy.stats.trim_mean(values, 0.25)` (rliable's
  `aggregate_iqm`); robust to a few failed seeds, less noisy than the median;
- **probability of improvement** of X over Y: the average over tasks m of
  P(X_m > Y_m) = (#{x > y} + #{x = y} / 2) / (n_X n_Y) over all pairs of their seeds, the
  Mann-Whitney U statistic over n_X n_Y (rliable's `probability_of_improvement`); 0.5 is a
  tie, and for a metric where lower is better "improvement" is the lower value;
- **stratified bootstrap**: each task's seeds are resampled with replacement on their own
  (tasks are strata: never a task drawn twice), by `scipy.stats.bootstrap`, which resamples each
  sample it is given independently: the samples are the tasks' seed values (and, for the
  probability of improvement, both variants' on each task, as rliable resamples them);
  percentile interval at the report's level, seeded.

A task where a variant has a single seed has nothing to resample: it is left out of the
aggregates of that comparison (the report says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

__all__ = [
    "DEFAULT_RESAMPLES",
    "Aggregate",
    "iqm",
    "probability_of_improvement",
    "stratified_iqm",
    "stratified_improvement",
]

#: bootstrap resamples of an aggregate's interval (rliable's examples use 2,000 to 50,000)
DEFAULT_RESAMPLES = 10_000


@dataclass(frozen=True)
class Aggregate:
    """A point estimate and its stratified-bootstrap percentile interval."""

    value: float
    low: float
    high: float
    tasks: int
    values: int  # (task, seed) values behind it


def iqm(tasks: Sequence[np.ndarray], axis: int = -1) -> np.ndarray | float:
    """Interquartile mean of the values of all `tasks` pooled (along `axis`)."""
    return sps.trim_mean(np.concatenate([np.asarray(t, dtype=float) for t in tasks], axis=axis), 0.25, axis=axis)


def _task_improvement(x: np.ndarray, y: np.ndarray) -> np.ndarray | float:
    """P(X > Y) + P(X = Y) / 2 over all pairs of the last axes' values (batched)."""
    x, y = np.asarray(x, dtype=float)[..., :, None], np.asarray(y, dtype=float)[..., None, :]
    return np.mean(x > y, axis=(-2, -1)) + 0.5 * np.mean(x == y, axis=(-2, -1))


def probability_of_improvement(
    x_tasks: Sequence[np.ndarray], y_tasks: Sequence[np.ndarray], lower_is_better: bool = False
) -> np.ndarray | float:
    """The average over tasks of P(X_m > Y_m) (module docstring); X_m, Y_m one task's seeds."""
    if len(x_tasks) != len(y_tasks) or not x_tasks:
        raise ValueError(f"expected the same tasks for both variants, got {len(x_tasks)} and {len(y_tasks)}")
    sign = -1.0 if lower_is_better else 1.0
    found = [_task_improvement(sign * np.asarray(x), sign * np.asarray(y)) for x, y in zip(x_tasks, y_tasks)]
    return np.mean(np.stack(found, axis=0), axis=0)


def _bootstrap(samples: Sequence[np.ndarray], statistic, level: float, n_resamples: int, seed: int):
    return sps.bootstrap(
        [np.asarray(s, dtype=float) for s in samples],
        statistic,
        n_resamples=n_resamples,
        confidence_level=level,
        method="percentile",
        vectorized=True,
        rng=np.random.default_rng(seed),
    ).confidence_interval


def stratified_iqm(
    tasks: Sequence[np.ndarray], level: float = 0.95, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0
) -> Aggregate:
    """The IQM of one variant's (task, seed) values and its stratified-bootstrap interval."""
    tasks = [np.asarray(t, dtype=float) for t in tasks]

    def statistic(*samples, axis=-1):
        return iqm(samples, axis=axis)

    interval = _bootstrap(tasks, statistic, level, n_resamples, seed)
    return Aggregate(
        float(iqm(tasks)), float(interval.low), float(interval.high), len(tasks), sum(t.size for t in tasks)
    )


def stratified_improvement(
    x_tasks: Sequence[np.ndarray],
    y_tasks: Sequence[np.ndarray],
    lower_is_better: bool = False,
    level: float = 0.95,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Aggregate:
    """P(X > Y) over tasks and its stratified-bootstrap interval (X's and Y's seeds of each
    task resampled independently)."""
    x_tasks = [np.asarray(t, dtype=float) for t in x_tasks]
    y_tasks = [np.asarray(t, dtype=float) for t in y_tasks]
    m = len(x_tasks)

    def statistic(*samples, axis=-1):
        return probability_of_improvement(samples[:m], samples[m:], lower_is_better)

    interval = _bootstrap(x_tasks + y_tasks, statistic, level, n_resamples, seed)
    point = probability_of_improvement(x_tasks, y_tasks, lower_is_better)
    return Aggregate(float(point), float(interval.low), float(interval.high), m, sum(t.size for t in x_tasks + y_tasks))
