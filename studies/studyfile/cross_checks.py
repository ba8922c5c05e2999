"""Stage 3 of loading a study: the parts of the file checked against each other.

Each variant's config (``base`` deep-merged with its overlay) is validated; the names used by
the design, ``derived``, the objective, the scheduler, the report and the reference are
checked to exist; ``derived`` expressions are parsed and ordered by their dependencies.
Every problem is reported at the YAML path where it was written (a variant's overlay or base).
"""

from __future__ import annotations

import re
from typing import Any

from setvalued.metrics import (
    FINAL_EXTRA_METRICS,
    METRIC_FORMAT,
    PER_EPOCH_EXTRA_METRICS,
    check_metric,
    common_metrics,
    count_bins,
)
from setvalued.paths import deep_merge
from studies.studyfile.expressions import Expression, ExpressionError, parse_expression
from studies.studyfile.problems import Path_, Problem, Problems, did_you_mean
from studies.studyfile.study import DEFAULT_VARIANT, Asha, EarlyStopping, Objective, ReportSetSizes, Study
from studies.studyfile.trial_config import validate_config

__all__ = ["check_study", "origin_in_variant"]

#: a derived target: a dotted path of at least two parts, such as optim.lr
DERIVED_TARGET = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$"


def check_study(study: Study) -> None:
    """Stage 3 of load_study: variant configs, names used by the design/derived/report, derived expressions.

    Every variant's config first (a mistake there stops here); then the problems of every
    other part, all reported together. The objective's, the scheduler's and the race's
    metric and mode are resolved on `study` on the way (the runner reads them directly)."""
    raws, configs = _variant_configs(study)
    study.set_variants(raws, configs)
    problems = [
        *_design_variant_problems(study, configs),
        *_derived_problems(study),
        *_objective_problems(study, configs),
        *_scheduler_problems(study, configs),
        *_asha_problems(study, configs),
        *_pruner_problems(study, configs),
        *_racing_problems(study, configs),
        *_report_problems(study, configs),
        *_reference_problems(study, configs),
    ]
    if problems:
        raise Problems(problems)


def _variant_configs(study: Study) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """({variant: base deep-merged with its overlay}, {variant: its validated config}); every
    problem at the YAML path where it was written, raised together."""
    problems: list[Problem] = []
    raws: dict[str, dict[str, Any]] = {}
    configs: dict[str, dict[str, Any]] = {}
    overlays = {name: (overlay or {}) for name, overlay in study.variants.items()} or {DEFAULT_VARIANT: {}}
    for name, overlay in overlays.items():
        raw = deep_merge(study.base, overlay)
        config, found = validate_config(raw)
        for p in found:
            where = origin_in_variant(study, name, p.path)
            # a mistake in base is reported once, not once per variant
            suffix = (
                f" (variant '{name}')"
                if study.variants
                and where[0] == "base"
                and len(overlays) > 1
                and _overlay_touches(overlays[name], p.path)
                else ""
            )
            problems.append(Problem(where, p.message + suffix))
        raws[name] = raw
        if config is not None:
            configs[name] = config
    if problems:
        raise Problems(problems)
    return raws, configs


def _unknown_variant(variant: str, configs: dict[str, dict[str, Any]]) -> str:
    return f"unknown variant {variant!r}; expected one of: {', '.join(configs)}"


def _design_variant_problems(study: Study, configs: dict[str, dict[str, Any]]) -> list[Problem]:
    """The variants each design block names exist."""
    return [
        Problem(("design", i, "variants", j), _unknown_variant(variant, configs))
        for i, block in enumerate(study.design)
        for j, variant in enumerate(block.variants or [])
        if variant not in configs
    ]


def _derived_problems(study: Study) -> list[Problem]:
    """``derived``: each target a dotted path, each expression parsed, no target also swept,
    no cycle; the expressions set on `study` in the order they are computed."""
    problems: list[Problem] = []
    exprs: dict[str, Expression] = {}
    for target, text in study.derived.items():
        if not re.match(DERIVED_TARGET, target):
            problems.append(Problem(("derived", target), f"{target!r} is not a dotted config path such as optim.lr"))
            continue
        try:
            exprs[target] = parse_expression(text)
        except ExpressionError as err:
            problems.append(Problem(("derived", target), str(err)))
    for i, block in enumerate(study.design):
        for path in block.parameter_paths:
            if path in study.derived:
                problems.append(
                    Problem(
                        ("design", i, "parameters", path),
                        f"'{path}' is also computed in 'derived'; a parameter is either swept or derived",
                    )
                )
    order = _topological(exprs, problems)
    study.set_derived_order([(t, exprs[t]) for t in order])
    return problems


def _objective_problems(study: Study, configs: dict[str, dict[str, Any]]) -> list[Problem]:
    """The objective: by default the first variant's selection metric (set on `study`), else a
    metric every variant logs."""
    if study.objective is None:
        first = next(iter(configs.values()))
        study.objective = Objective(metric=first["eval"]["selection"], mode=first["eval"]["selection_mode"])
        return []
    for name, config in configs.items():
        reason = check_metric(study.objective.metric, config["eval"], ("val", "test", "train"))
        if reason:
            return [Problem(("objective", "metric"), reason + (f" (variant '{name}')" if study.variants else ""))]
    return []


def _scheduler_problems(study: Study, configs: dict[str, dict[str, Any]]) -> list[Problem]:
    """Early stopping and ASHA: their metric (default: the objective's) a validation metric of
    every variant; metric and mode resolved on `study.scheduler`."""
    objective = _objective(study)
    scheduler = study.scheduler
    if not isinstance(scheduler, (EarlyStopping, Asha)):
        return []
    problems = []
    rule = "early stopping" if isinstance(scheduler, EarlyStopping) else "asha"
    metric = scheduler.metric or objective.metric
    if scheduler.mode is None:
        scheduler.mode = (
            objective.mode
            if scheduler.metric in (None, objective.metric)
            else ("min" if metric == "train/loss" else "max")
        )
    for config in configs.values():
        reason = check_metric(metric, config["eval"], ("val",))
        if reason:
            where = ("scheduler", "metric") if scheduler.metric else ("objective", "metric")
            problems.append(Problem(where, f"{rule} needs a validation metric: " + reason))
            break
    scheduler.metric = metric  # resolved: the runner reads metric and mode directly
    return problems


def _objective(study: Study) -> Objective:
    """The study's objective, resolved by `_objective_problems` before the checks that read it."""
    if study.objective is None:
        raise RuntimeError("the objective is resolved before the checks that read it")
    return study.objective


def _asha_problems(study: Study, configs: dict[str, dict[str, Any]]) -> list[Problem]:
    """ASHA's first rung comes before every variant's last epoch."""
    if not isinstance(study.scheduler, Asha):
        return []
    grace = study.scheduler.grace_epochs
    for name, config in configs.items():
        if grace >= config["epochs"]:
            return [
                Problem(
                    ("scheduler", "grace_epochs"),
                    (
                        f"asha's first rung ({grace} epochs) must come before the last epoch; "
                        f"{'variant ' + repr(name) + ' trains' if study.variants else 'the study trains'} "
                        f"{config['epochs']} epochs: expected grace_epochs < {config['epochs']}"
                    ),
                )
            ]
    return []


def _pruner_problems(study: Study, configs: dict[str, dict[str, Any]]) -> list[Problem]:
    """An optuna block's pruner: alone to stop its configs, on a validation objective."""
    objective = _objective(study)
    problems = []
    for index, block in study.optuna_blocks:
        if block.pruner is None:
            continue
        if study.scheduler.kind != "none":
            problems.append(
                Problem(
                    ("design", index, "pruner"),
                    (
                        f"an optuna block's pruner and the study's scheduler ({study.scheduler.kind}) "
                        f"would both stop its configs; expected one of them (scheduler: {{kind: none}})"
                    ),
                )
            )
        for config in configs.values():
            reason = check_metric(objective.metric, config["eval"], ("val",))
            if reason:
                problems.append(
                    Problem(
                        ("objective", "metric"),
                        (
                            "an optuna pruner reads the objective after every epoch, so it must be a "
                            f"validation metric: {reason}"
                        ),
                    )
                )
                break
    return problems


def _racing_problems(study: Study, configs: dict[str, dict[str, Any]]) -> list[Problem]:
    """Racing: the metric that decides it (default: the objective's) logged by every variant,
    metric and mode resolved on `study.racing.until`; no optuna block beside it."""
    objective = _objective(study)
    racing = study.racing
    if racing is None:
        return []
    problems = []
    until = racing.until
    metric = until.metric or objective.metric
    if until.mode is None:
        from analysis.stats import lower_is_better  # (scipy: only for a race)

        until.mode = objective.mode if metric == objective.metric else ("min" if lower_is_better(metric) else "max")
    for config in configs.values():
        reason = check_metric(metric, config["eval"], ("val", "test", "train"))
        if reason:
            where = ("seeds", "until", "metric") if until.metric else ("objective", "metric")
            problems.append(Problem(where, "racing needs a metric every config logs: " + reason))
            break
    until.metric = metric  # resolved: the runner reads metric and mode directly
    for i, _block in study.optuna_blocks:
        problems.append(
            Problem(
                ("design", i, "kind"),
                "an optuna block runs each proposal on "
                "every seed; racing (seeds: {initial, max}) needs a fixed set of "
                "configs: expected a seed list, or no optuna block",
            )
        )
    return problems


def _report_problems(study: Study, configs: dict[str, dict[str, Any]]) -> list[Problem]:
    """The report block: the variants it names exist, a curve's x is swept, every metric it
    reads is logged by some variant."""
    return [
        *_compare_problems(study, configs),
        *_curve_x_problems(study),
        *_set_size_problems(study, configs),
        *_per_group_problems(study, configs),
        *_report_metric_problems(study, configs),
        *_learning_curve_problems(study, configs),
    ]


def _compare_problems(study: Study, configs: dict[str, dict[str, Any]]) -> list[Problem]:
    compare = study.report.compare
    if compare is not None and compare.reference is not None and compare.reference not in configs:
        return [Problem(("report", "compare", "reference"), _unknown_variant(compare.reference, configs))]
    return []


def _curve_x_problems(study: Study) -> list[Problem]:
    swept = {p for b in study.design for p in b.parameter_paths}
    return [
        Problem(
            ("report", "curves", i, "x"),
            f"'{curve.x}' is not swept by any design block; expected one of: {', '.join(sorted(swept)) or '(none)'}",
        )
        for i, curve in enumerate(study.report.curves or [])
        if curve.x not in swept
    ]


def _set_size_problems(study: Study, configs: dict[str, dict[str, Any]]) -> list[Problem]:
    """``report.set_sizes``: its shot-group variant exists, its Ks are computed (``eval.avgk``)."""
    set_sizes = study.report.set_sizes
    if not isinstance(set_sizes, ReportSetSizes):
        return []
    problems = []
    if set_sizes.by_shot is not None and set_sizes.by_shot not in configs:
        problems.append(Problem(("report", "set_sizes", "by_shot"), _unknown_variant(set_sizes.by_shot, configs)))
    computed = {float(k) for c in configs.values() for k in c["eval"]["avgk"]}
    for i, k in enumerate(set_sizes.ks or []):
        if float(k) not in computed:
            problems.append(
                Problem(
                    ("report", "set_sizes", "ks", i),
                    f"average-{k:g} sets are not computed: expected a K of eval.avgk ({sorted(computed) or 'empty'})",
                )
            )
    return problems


def _per_group_problems(study: Study, configs: dict[str, dict[str, Any]]) -> list[Problem]:
    """``report.count_bins`` and ``report.per_class``: some variant computes each metric (for
    count_bins, on one of its bins of training images)."""
    problems = []
    for key in ("count_bins", "per_class"):
        for i, base in enumerate(getattr(study.report, key) or []):
            reasons = []
            for config in configs.values():
                bins = [name for name, _, _ in count_bins(config["eval"].get("count_bins", []))]
                metric = f"test/{bins[0]}/{base}" if key == "count_bins" and bins else f"test/{base}"
                reason = check_metric(metric, config["eval"], ("test",))
                if key == "count_bins" and not bins:
                    reason = "eval.count_bins is empty"
                if reason is None:
                    break
                reasons.append(reason)
            else:
                problems.append(
                    Problem(
                        ("report", key, i),
                        f"no variant computes {base} "
                        f"{'per bin of training images' if key == 'count_bins' else 'per class'}: "
                        f"{reasons[0]}",
                    )
                )
    return problems


def _learning_curve_problems(study: Study, configs: dict[str, dict[str, Any]]) -> list[Problem]:
    """``report.learning_curves``: per-epoch metrics that every variant logs."""
    problems = []
    for i, metric in enumerate(study.report.learning_curves or []):
        if metric in PER_EPOCH_EXTRA_METRICS:
            continue
        for name, config in configs.items():
            reason = check_metric(metric, config["eval"], ("val", "train"))
            if reason:
                problems.append(
                    Problem(
                        ("report", "learning_curves", i),
                        "a learning curve needs a per-epoch "
                        f"metric ({', '.join(PER_EPOCH_EXTRA_METRICS)} or a val/ or train/ "
                        f"accuracy): {reason}" + (f" (variant '{name}')" if study.variants else ""),
                    )
                )
                break
    return problems


def _reference_problems(study: Study, configs: dict[str, dict[str, Any]]) -> list[Problem]:
    """The variants the reference numbers' rows name exist."""
    return [
        Problem(("reference", s, "rows", i, "variant"), _unknown_variant(row.variant, configs))
        for s, source in enumerate(study.reference or [])
        for i, row in enumerate(source.rows)
        if row.variant is not None and row.variant not in configs
    ]


def _report_metric_problems(study: Study, configs: dict[str, dict[str, Any]]) -> list[Problem]:
    """The metric paths of the report's tables, curves and comparison: each one some variant
    logs (a typo such as ``tset/top5`` would leave its column out of the report)."""
    report = study.report
    used: list[tuple[Path_, Any]] = []
    for i, table in enumerate(report.tables or []):
        used += [(("report", "tables", i, "metrics", j), m) for j, m in enumerate(table.metrics)]
    used += [(("report", "curves", i, "metric"), c.metric) for i, c in enumerate(report.curves or [])]
    if report.compare is not None:
        used += [(("report", "compare", "metrics", j), m) for j, m in enumerate(report.compare.metrics or [])]
    problems = []
    for path, metric in used:
        if metric in FINAL_EXTRA_METRICS or metric in PER_EPOCH_EXTRA_METRICS:
            continue
        reasons = []
        for config in configs.values():
            splits = ("val", "test", "train")
            reason = check_metric(metric, config["eval"], splits)
            if reason and isinstance(metric, str) and metric.endswith("_size"):  # an average-K set's size
                reason = reason if check_metric(metric[: -len("_size")], config["eval"], splits) else None
            if reason is None:
                break
            reasons.append(reason)
        else:
            known = sorted({m for config in configs.values() for m in common_metrics(config["eval"])})
            reason = reasons[0] if reasons else f"expected {METRIC_FORMAT}"
            if "expected a metric path" not in reason:
                reason += f"; expected {METRIC_FORMAT} that some variant logs"
            problems.append(Problem(path, f"no variant logs {metric!r}{did_you_mean(metric, known)}: {reason}"))
    return problems


def _overlay_touches(overlay: dict[str, Any], config_path: Path_) -> bool:
    """Whether the overlay sets anything in the config section of ``config_path`` (so that a
    problem found in base may come from the combination with this variant)."""
    return bool(config_path) and config_path[0] in overlay


def _topological(exprs: dict[str, Expression], problems: list[Problem]) -> list[str]:
    """Derived targets ordered so that a target read by another is computed first."""
    order: list[str] = []
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(target: str, chain: list[str]) -> None:
        if state.get(target) == 2:
            return
        if state.get(target) == 1:
            cycle = " -> ".join(chain[chain.index(target) :] + [target])
            problems.append(
                Problem(("derived", target), f"derived parameters depend on each other in a cycle ({cycle})")
            )
            return
        state[target] = 1
        for name in sorted(exprs[target].names):
            if name in exprs:
                visit(name, chain + [target])
        state[target] = 2
        order.append(target)

    for target in exprs:
        visit(target, [])
    return order


def origin_in_variant(study: Study, variant: str, config_path: Path_) -> Path_:
    """YAML path of a config value: inside the variant's overlay if written there, else in base."""
    overlay = study.variants.get(variant) or {}
    node: Any = overlay
    depth = 0
    for part in config_path:
        if isinstance(node, dict) and part in node:
            node = node[part]
            depth += 1
        else:
            break
    if depth > 0:
        return ("variants", variant) + tuple(config_path)
    return ("base",) + tuple(config_path)
