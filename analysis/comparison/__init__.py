"""Several studies side by side (`studies compare`, issue 40): each study, or each value of a
parameter all its variants sweep, is a task; the package compares variants across tasks.

- `tasks`: the studies' finished cells as per-seed values of each (task, variant);
- `ranks`: average ranks, Friedman's test, pairwise Wilcoxon signed-rank tests with Holm;
- `aggregates`: interquartile mean and probability of improvement, stratified bootstrap;
- `tables`, `figures`: what the report shows; `report`: `compare`, `write_comparison`,
  `build_comparison`.

The rest of the project imports the names below, not the modules.
"""

from analysis.comparison.aggregates import (
    DEFAULT_RESAMPLES,
    Aggregate,
    iqm,
    probability_of_improvement,
    stratified_improvement,
    stratified_iqm,
)
from analysis.comparison.ranks import RankTests, average_ranks, rank_tests, smallest_wilcoxon_p
from analysis.comparison.report import (
    Comparison,
    build_comparison,
    compare,
    sources_of,
    study_runs_of,
    write_comparison,
)
from analysis.comparison.tasks import DEFAULT_METRICS, CompareError, Entry, Scores, StudyRuns, Task, task_scores

__all__ = [
    "DEFAULT_RESAMPLES",
    "DEFAULT_METRICS",
    "Aggregate",
    "Comparison",
    "CompareError",
    "Entry",
    "RankTests",
    "Scores",
    "StudyRuns",
    "Task",
    "average_ranks",
    "build_comparison",
    "compare",
    "iqm",
    "probability_of_improvement",
    "rank_tests",
    "smallest_wilcoxon_p",
    "sources_of",
    "stratified_improvement",
    "stratified_iqm",
    "study_runs_of",
    "task_scores",
    "write_comparison",
]
