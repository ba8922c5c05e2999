"""The schema of a study file's `report:` and `reference:` blocks, in one place.

Study validation (`studies.studyfile.spec`) and the report (`analysis.study_file`) parse the two blocks
with these pydantic models, so a block that passes one passes the other. Every key is
optional; the report's defaults are given beside each key:

```yaml
report:
  level: 0.95                  # confidence level of every interval
  ci: t                        # t (Student, n-1 df) | bootstrap (percentile, seeded)
  tables:                      # default: one table of the top-level test metrics
    - metrics: [test/top1, test/top5]
      title: "Top-K accuracy"  # optional
      columns: metrics         # metrics (one row per config) | variant (rows = context,
                               #   a column per variant and metric, as thesis Table 4.4)
      digits: 1                # decimals; default 1 for accuracies (in percent)
      swept: [data.label_noise]  # only configs that sweep nothing else (and base ones)
  curves:                      # default: the main test metric against each swept number
    - {x: loss.epsilon, metric: test/top5}
  epoch_time: {x: loss.k}      # or true; default when loss.k is swept
  shot_groups: [top5]          # bars of test/{few,medium,many}/top5; default when logged
  compare: {reference: ce, metrics: [test/top5]}   # default: the first variant
  difference: 1.0              # the smallest difference of interest the seeds are planned for,
                               #   in the printed unit (percentage points for accuracies);
                               #   `studies report/plan/compare --difference` overrides it
  learning_curves: [val/top5, train/top5]  # a per-epoch metric against the epoch, a line
                               #   per config (one request per run and metric; none by default)
  set_sizes: {ks: [5], by_shot: avg}  # or true / false; average-K set-size histograms
                               #   (thesis Fig. 5.4); default: every K of test/avg<K>
  count_bins: [top1]           # mean accuracy per bin of eval.count_bins (thesis Table 3.1),
                               #   published numbers marked; default: the main metric's, when logged
  per_class: [top1]            # per-class test accuracy against the class's training images,
                               #   a panel per config (the best of each variant); none by default
  show_pruned: false           # configs pruned by ASHA or an Optuna pruner (tag studies.pruned)
                               #   trained fewer epochs: left out of every table and figure,
                               #   with a note, unless true
reference:                     # published numbers (percent), shown beside the reproduced
  source: "Thesis Table 4.4"   #   ones in a column headed "<metric> (paper)"
  rows:
    - {variant: ce, match: {data.label_noise: 0.0}, metrics: {test/top5: 94.2},
       ci: {test/top5: 0.1}}
```

When two papers report the same experiment with different numbers, `reference` is a list of
sources, each with a short distinct `label` that heads its own column ("test/top5 ([Gar23])",
"test/top5 ([GSJS22])"); the single mapping above is the one-source form (label "paper"):

```yaml
reference:
  - label: "[Gar23]"
    source: "Thesis Table 4.4, 4 seeds, 95% CI"
    rows: [{variant: ce, match: {data.label_noise: 0.0}, metrics: {test/top5: 94.2}, ci: {test/top5: 0.1}}]
  - label: "[GSJS22]"
    source: "ICML 2022 paper Table 4, 2 seeds, no CI"
    rows: [{variant: ce, match: {data.label_noise: 0.0}, metrics: {test/top5: 94.24}}]
```

Published numbers print as written in the file (`68.20`, `65`, `94.2 ± 0.1`): their text is
kept (`analysis.published_number`), so write them with the paper's precision.

What needs the study's trial configs (a variant name exists, a curve's `x` is swept, an
average-K is computed, a learning curve's metric is logged per epoch) is checked by
`studies.studyfile.spec`, which has them; these models check each block on its own.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from analysis.published_number import PublishedNumber

__all__ = [
    "Report",
    "ReportTable",
    "ReportCurve",
    "ReportCompare",
    "ReportSetSizes",
    "Reference",
    "ReferenceRow",
    "References",
    "SINGLE_SOURCE_LABEL",
    "DEFAULT_DIFFERENCE",
]


#: the smallest difference of interest when none is stated: 1 percentage point of an accuracy
#: (`report.difference`; the power plans of `analysis.power`)
DEFAULT_DIFFERENCE = 1.0


class _Strict(BaseModel):
    """Unknown keys are errors (a typo does not silently fall back to a default)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_default=True)


class ReportTable(_Strict):
    """A table of the report: one row per config, or one column per variant."""

    metrics: list[str] = Field(min_length=1)
    title: str | None = None
    columns: Literal["metrics", "variant"] = "metrics"
    digits: int | None = Field(None, ge=0, le=6)
    swept: list[str] | None = None  # only configs that sweep nothing but these paths

    @field_validator("swept", mode="before")
    @classmethod
    def _one_path(cls, value: Any) -> Any:
        """`swept: data.label_noise` is short for `swept: [data.label_noise]`."""
        return [value] if isinstance(value, str) else value


class ReportCurve(_Strict):
    """A sensitivity curve: ``metric`` against the swept parameter ``x``, CI band."""

    x: str
    metric: str


class ReportCompare(_Strict):
    """Paired comparison of every variant with ``reference`` (default: the first variant)."""

    reference: str | None = None
    metrics: list[str] | None = None


class ReportSetSizes(_Strict):
    """Which average-K set-size histograms the report draws (thesis Figure 5.4)."""

    # strict: `true` is not K = 1
    ks: list[Annotated[float, Field(gt=0, strict=True)]] | None = None
    by_shot: str | None = None  # the variant split by shot group (default: best test/avg<K>)


class Report(_Strict):
    """What ``studies report`` draws (all keys optional; defaults in the module docstring)."""

    level: float = Field(0.95, gt=0, lt=1)
    ci: Literal["t", "bootstrap"] = "t"
    tables: list[ReportTable] | None = None
    curves: list[ReportCurve] | None = None
    learning_curves: list[str] | None = None  # per-epoch metrics drawn against the epoch
    set_sizes: bool | ReportSetSizes | None = None  # average-K set-size histograms (Fig. 5.4)
    epoch_time: Any = None  # true, or {x: dotted path}; default when loss.k is swept
    shot_groups: list[Any] | None = None  # [top5, ...] or [{metric: top5, split: test}]
    compare: ReportCompare | None = None
    difference: float = Field(DEFAULT_DIFFERENCE, gt=0)  # smallest difference of interest (printed unit)
    count_bins: list[str] | None = None  # base metrics (top1, avg5) per bin of training images
    per_class: list[str] | None = None  # base metrics per class against its training images
    show_pruned: bool = False  # pruned configs (studies.pruned) in the tables and figures

    @field_validator("count_bins", "per_class")
    @classmethod
    def _base_metrics(cls, value: list[str] | None) -> list[str] | None:
        for item in value or []:
            if not isinstance(item, str) or not re.fullmatch(r"(top|avg)[0-9]+", item):
                raise ValueError(f"expected metrics such as top1 or avg5 (no split, no group), got {item!r}")
        return value

    @field_validator("epoch_time")
    @classmethod
    def _epoch_time(cls, value: Any) -> Any:
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, dict) and set(value) <= {"x"} and isinstance(value.get("x", ""), str):
            return value
        raise ValueError(f"expected true, false or {{x: <dotted path>}}, got {value!r}")

    @field_validator("shot_groups")
    @classmethod
    def _shot_groups(cls, value: list[Any] | None) -> list[Any] | None:
        for item in value or []:
            ok = isinstance(item, str) or (
                isinstance(item, dict)
                and isinstance(item.get("metric"), str)
                and set(item) <= {"metric", "split"}
                and item.get("split", "test") in ("val", "test")
            )
            if not ok:
                raise ValueError(f"expected a metric such as top5 or {{metric: top5, split: test}}, got {item!r}")
        return value


class ReferenceRow(_Strict):
    """Published numbers (percent) for the cells of ``variant`` whose config matches ``match``;
    each number keeps the text it was written with."""

    variant: str | None = None
    match: dict[str, Any] = {}
    metrics: dict[str, PublishedNumber] = Field(min_length=1)
    ci: dict[str, PublishedNumber] = {}


#: the column label of the one-source form (`reference: {source: ..., rows: ...}`)
SINGLE_SOURCE_LABEL = "paper"


class Reference(_Strict):
    """One source of published numbers: where they come from, its column label, its rows, and
    what its intervals (`ci`) are: over how many seeds (`seeds`) at which confidence level
    (`level`), as the source states them. `studies plan` turns a published half-width into an
    sd with these, not with the planned study's; a source with intervals that does not
    declare them is not planned from (the report prints its numbers all the same)."""

    source: str
    label: str | None = Field(None, min_length=1, max_length=40)  # heads the source's column
    seeds: int | None = Field(None, ge=1, le=1000)  # the runs behind each published number
    level: float | None = Field(None, gt=0.0, lt=1.0)  # of its intervals: 0.95 for a 95% CI
    rows: list[ReferenceRow] = Field(min_length=1)


def _one_or_many(value: Any) -> Any:
    """`reference: {source, rows}` is one source: the list of it."""
    return [value] if isinstance(value, dict) else value


def _labelled(sources: list[Reference]) -> list[Reference]:
    """A lone source is labelled "paper" by default; several need distinct labels (each
    labels a column of the report)."""
    if len(sources) == 1 and sources[0].label is None:
        sources[0].label = SINGLE_SOURCE_LABEL
    for i, source in enumerate(sources):
        if source.label is None:
            raise ValueError(
                f"source {i} ({source.source!r}) has no `label`; expected a short name "
                f"for its column, distinct from the other sources' (such as [GSJS22])"
            )
    labels = [s.label for s in sources if s.label is not None]  # every one has a label (above)
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(
            f"the label(s) {', '.join(map(repr, repeated))} name several sources; expected a distinct label per source"
        )
    return sources


#: the `reference` block: one source (a mapping) or several (a list of mappings)
References = Annotated[list[Reference], BeforeValidator(_one_or_many), Field(min_length=1), AfterValidator(_labelled)]
