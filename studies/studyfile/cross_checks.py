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
    """Stage 3 of load_study: variant configs, names used by the design/derived/report, derived expressions."""
    problems: list[Problem] = []
    raws: dict[str, dict] = {}
    configs: dict[str, dict] = {}
    base = study.base
    overlays = {name: (overlay or {}) for name, overlay in study.variants.items()} or {DEFAULT_VARIANT: {}}
    for name, overlay in overlays.items():
        raw = deep_merge(base, overlay)
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
    study.set_variants(raws, configs)

    names = list(configs)
    for i, block in enumerate(study.design):
        for j, variant in enumerate(block.variants or []):
            if variant not in configs:
                problems.append(
                    Problem(
                        ("design", i, "variants", j),
                        f"unknown variant {variant!r}; expected one of: {', '.join(names)}",
                    )
                )

    # derived: parse, forbid sweeping a derived target, order by dependencies
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

    # objective (default: the selection metric of the first variant) and scheduler metric
    first = configs[names[0]]
    if study.objective is None:
        study.objective = Objective(metric=first["eval"]["selection"], mode=first["eval"]["selection_mode"])
    else:
        for name, config in configs.items():
            reason = check_metric(study.objective.metric, config["eval"], ("val", "test", "train"))
            if reason:
                problems.append(
                    Problem(("objective", "metric"), reason + (f" (variant '{name}')" if study.variants else ""))
                )
                break
    if isinstance(study.scheduler, (EarlyStopping, Asha)):
        rule = "early stopping" if isinstance(study.scheduler, EarlyStopping) else "asha"
        metric = study.scheduler.metric or study.objective.metric
        if study.scheduler.mode is None:
            study.scheduler.mode = (
                study.objective.mode
                if study.scheduler.metric in (None, study.objective.metric)
                else ("min" if metric == "train/loss" else "max")
            )
        for config in configs.values():
            reason = check_metric(metric, config["eval"], ("val",))
            if reason:
                where = ("scheduler", "metric") if study.scheduler.metric else ("objective", "metric")
                problems.append(Problem(where, f"{rule} needs a validation metric: " + reason))
                break
        study.scheduler.metric = metric  # resolved: the runner reads metric and mode directly
    if isinstance(study.scheduler, Asha):
        grace = study.scheduler.grace_epochs
        for name, config in configs.items():
            if grace >= config["epochs"]:
                problems.append(
                    Problem(
                        ("scheduler", "grace_epochs"),
                        (
                            f"asha's first rung ({grace} epochs) must come before the last epoch; "
                            f"{'variant ' + repr(name) + ' trains' if study.variants else 'the study trains'} "
                            f"{config['epochs']} epochs: expected grace_epochs < {config['epochs']}"
                        ),
                    )
                )
                break
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
            reason = check_metric(study.objective.metric, config["eval"], ("val",))
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

    # racing: the metric that decides it (default: the objective's) is logged by every variant
    racing = study.racing
    if racing is not None:
        until = racing.until
        metric = until.metric or study.objective.metric
        if until.mode is None:
            from analysis.stats import lower_is_better  # (scipy: only for a race)

            until.mode = (
                study.objective.mode
                if metric == study.objective.metric
                else ("min" if lower_is_better(metric) else "max")
            )
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

    # report and reference: variant names exist; curve x is a swept path
    swept = {p for b in study.design for p in b.parameter_paths}
    compare = study.report.compare
    if compare is not None and compare.reference is not None and compare.reference not in configs:
        problems.append(
            Problem(
                ("report", "compare", "reference"),
                f"unknown variant {compare.reference!r}; expected one of: {', '.join(names)}",
            )
        )
    for i, curve in enumerate(study.report.curves or []):
        if curve.x not in swept:
            problems.append(
                Problem(
                    ("report", "curves", i, "x"),
                    f"'{curve.x}' is not swept by any design "
                    f"block; expected one of: {', '.join(sorted(swept)) or '(none)'}",
                )
            )
    set_sizes = study.report.set_sizes
    if isinstance(set_sizes, ReportSetSizes):
        if set_sizes.by_shot is not None and set_sizes.by_shot not in configs:
            problems.append(
                Problem(
                    ("report", "set_sizes", "by_shot"),
                    f"unknown variant {set_sizes.by_shot!r}; expected one of: {', '.join(names)}",
                )
            )
        computed = {float(k) for c in configs.values() for k in c["eval"]["avgk"]}
        for i, k in enumerate(set_sizes.ks or []):
            if float(k) not in computed:
                problems.append(
                    Problem(
                        ("report", "set_sizes", "ks", i),
                        f"average-{k:g} sets are not computed: "
                        f"expected a K of eval.avgk ({sorted(computed) or 'empty'})",
                    )
                )
    for key in ("count_bins", "per_class"):
        for i, base in enumerate(getattr(study.report, key) or []):
            # computed by some variant: the test metric itself, and for count_bins one of its bins
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
    problems += _report_metric_problems(study, configs)
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
    for s, source in enumerate(study.reference or []):
        for i, row in enumerate(source.rows):
            if row.variant is not None and row.variant not in configs:
                problems.append(
                    Problem(
                        ("reference", s, "rows", i, "variant"),
                        f"unknown variant {row.variant!r}; expected one of: {', '.join(names)}",
                    )
                )
    if problems:
        raise Problems(problems)


def _report_metric_problems(study: Study, configs: dict[str, dict]) -> list[Problem]:
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


def _overlay_touches(overlay: dict, config_path: Path_) -> bool:
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
