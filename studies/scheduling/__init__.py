"""Config-level scheduling: rules that stop a config, all its seeds together, on its seed
mean (early stopping, ASHA, Optuna's pruners, racing), optuna rounds, and their Ray actor.

`session_scheduling(study, tracking, session_id)` is the driver's side of the study's
`scheduler` block (`none`, `early_stopping`, `asha`); an optuna block's `pruner` has its own
(`studies.scheduling.optuna_pruning`).
"""

from __future__ import annotations

from studies.scheduling.base import CONTINUE, STOP, WAIT, ConfigScheduler
from studies.scheduling.coordinator import ConfigScheduling, CoordinatorClient
from studies.scheduling.early_stopping import ConfigEarlyStopper
from studies.scheduling.optuna_pruning import ConfigOptunaPruning
from studies.scheduling.successive_halving import ConfigSuccessiveHalving, rungs

__all__ = [
    "CONTINUE",
    "STOP",
    "WAIT",
    "ConfigScheduler",
    "ConfigEarlyStopper",
    "ConfigSuccessiveHalving",
    "ConfigOptunaPruning",
    "ConfigScheduling",
    "CoordinatorClient",
    "rungs",
    "session_scheduling",
]


def session_scheduling(study, tracking, session_id: str) -> ConfigScheduling:
    """The driver's side of `study.scheduler` for one session (disabled for `none`)."""
    scheduler = study.scheduler
    kind = getattr(scheduler, "kind", "none")
    name = f"studies-scheduler-{session_id}"
    if kind == "none":
        return ConfigScheduling(study, tracking, name, None)
    metric = scheduler.metric or study.objective.metric
    mode = scheduler.mode or study.objective.mode
    if kind == "early_stopping":
        return ConfigScheduling(
            study,
            tracking,
            name,
            ConfigEarlyStopper,
            metric=metric,
            label="scheduler: early stopping",
            rule_kwargs={
                "seeds": {},
                "mode": mode,
                "grace_epochs": scheduler.grace_epochs,
                "patience": scheduler.patience,
            },
        )
    if kind == "asha":
        return ConfigScheduling(
            study,
            tracking,
            name,
            ConfigSuccessiveHalving,
            metric=metric,
            label="scheduler: asha",
            prunes=ConfigSuccessiveHalving.prunes,
            rule_kwargs={
                "seeds": {},
                "mode": mode,
                "grace_epochs": scheduler.grace_epochs,
                "reduction_factor": scheduler.reduction_factor,
            },
        )
    raise ValueError(f"unknown scheduler kind {kind!r}")
