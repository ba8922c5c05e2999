"""The finished cells of a study as every part of the report sees them.

`StudyResults` holds the collected rows, the study file and the interval options, and gives
the per-config summaries over seeds (computed once per metric list), the order in which
configs are shown, and the notes that the tables and figures leave for the reader.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from analysis.collect import PARAM_PREFIX, Collected, add_history_means
from analysis.distinct import VERSION_PARAM, short_version, versions_of
from analysis.stats import lower_is_better, summarize
from analysis.study_file import StudyInfo


def swept_of(row: Mapping[str, Any]) -> dict:
    """The swept values of a row (`{"loss.epsilon": 0.01}`), decoded from its JSON column."""
    return json.loads(row.get("swept") or "{}")


class StudyResults:
    """Collected rows, study file and options shared by the tables and the figures."""

    def __init__(self, collected: Collected, study: StudyInfo, level: float, method: str, n_boot: int):
        self.collected = collected
        self.study = study
        self.level = level
        self.method = method
        self.n_boot = n_boot
        self.rows = collected.table.to_pylist()
        self.metric_names = collected.metric_columns
        order = study.variant_order
        seen = list(dict.fromkeys(r["variant"] for r in self.rows))
        self.variants = [v for v in order if v in seen] + sorted((v for v in seen if v not in order), key=str)
        self.swept_paths = list(dict.fromkeys(k for r in self.rows for k in swept_of(r)))
        #: the study's versions (`analysis.distinct`) by age: 0 for the oldest
        self.version_rank = {short_version(v): i for i, v in enumerate(versions_of(collected.table))}
        self._summaries: dict[tuple, list[dict]] = {}
        self.notes: list[str] = []

    def summary(self, metrics: Sequence[str]) -> list[dict]:
        """`analysis.stats.summarize` rows (one per config and metric) of the logged `metrics`."""
        metrics = [m for m in metrics if m in self.metric_names]
        key = tuple(metrics)
        if key not in self._summaries:
            self._summaries[key] = (
                summarize(self.rows, metrics, self.level, self.method, n_boot=self.n_boot).to_pylist()
                if metrics and self.rows
                else []
            )
        return self._summaries[key]

    def add_history_means(self, keys: Sequence[str]) -> None:
        """Add the per-run mean of the per-epoch `keys` as `mean:<key>` metrics."""
        add_history_means(self.collected, keys)
        self.rows = self.collected.table.to_pylist()
        self.metric_names = self.collected.metric_columns
        self._summaries.clear()

    def config_order(self, summary_rows: Sequence[Mapping]) -> list[str]:
        """The config_ids of the rows: by variant (study file order), then swept values."""

        def key(row):
            variant_rank = (
                self.variants.index(row["variant"]) if row["variant"] in self.variants else len(self.variants)
            )
            swept = swept_of(row)
            values = []
            for path in self.swept_paths:
                value = row.get(PARAM_PREFIX + path, swept.get(path))
                if path == VERSION_PARAM:  # versions oldest first, not by their digits
                    value = self.version_rank.get(value, len(self.version_rank))
                values.append(
                    (0, float(value), "")
                    if isinstance(value, (int, float)) and not isinstance(value, bool)
                    else (1, 0.0, str(value))
                )
            return (variant_rank, values)

        firsts: dict[str, Mapping] = {}
        for row in summary_rows:
            firsts.setdefault(row["config_id"], row)
        return [c for c, _ in sorted(firsts.items(), key=lambda item: key(item[1]))]

    def rank_metric(self) -> str | None:
        """The metric that ranks configs for the figures that show only the best ones:
        `best_val` (the best validation value of the selection metric, so that configs are
        chosen on validation, not on test), else the main test metric."""
        return "best_val" if "best_val" in self.metric_names else self.primary_metric()

    def showcase(self, limit: int) -> tuple[list[str], str]:
        """At most `limit` config_ids to draw, and a sentence saying which they are.

        Every config (in `config_order`) when there are at most `limit`; else the best config
        of each variant by the mean of `rank_metric` (variants ranked by their best), then
        the next best configs of any variant, best first."""
        configs = self.config_order(self.rows)
        if len(configs) <= limit:
            return configs, ""
        metric = self.rank_metric()
        means = {r["config_id"]: r["mean"] for r in self.summary([metric])} if metric else {}
        variant = {r["config_id"]: r["variant"] for r in self.rows}
        lower = lower_is_better(metric) if metric else False

        def key(config_id):
            mean = means.get(config_id)
            missing = mean is None or mean != mean  # NaN last
            return (missing, 0.0 if missing else (mean if lower else -mean))

        ranked = sorted(configs, key=key)
        chosen: list[str] = []
        seen: set = set()
        for config_id in ranked:
            if variant[config_id] not in seen and len(chosen) < limit:
                chosen.append(config_id)
                seen.add(variant[config_id])
        chosen += [c for c in ranked if c not in set(chosen)][: limit - len(chosen)]
        chosen.sort(key=ranked.index)
        how = (
            f"mean {metric} (the best validation value of the selection metric)"
            if metric == "best_val"
            else f"mean {metric}"
        )
        return chosen, (
            f"Shown: {len(chosen)} of {len(configs)} configs, the best of each variant by {how}, then the next best."
        )

    def primary_metric(self) -> str | None:
        """The test metric the default figures show: the objective's, else top-5, avg-5, top-1."""
        objective = (self.study.data.get("objective") or {}).get("metric")
        candidates = []
        if isinstance(objective, str):
            candidates += ["test/" + objective.split("/", 1)[1] if "/" in objective else objective, objective]
        candidates += ["test/top5", "test/avg5", "test/top1"]
        for candidate in candidates:
            if candidate in self.metric_names:
                return candidate
        tests = sorted(m for m in self.metric_names if m.startswith("test/"))
        return tests[0] if tests else None
