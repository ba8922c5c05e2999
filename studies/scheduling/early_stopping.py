"""Early stopping decided per config over its seeds (`scheduler: {kind: early_stopping}`)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping

from studies.scheduling.base import CONTINUE, STOP, ConfigScheduler


class ConfigEarlyStopper(ConfigScheduler):
    """Early stopping decided per config over its seeds, never per seed alone.

    From n = grace_epochs on, m_c(n) (see `ConfigScheduler`) is compared with best(n), the
    best seed mean at epoch n among the configs that completed epoch n so far (including
    c): c is "behind" when it is strictly worse. A config behind for `patience` consecutive
    epochs stops at that epoch; every seed of it stops there too.

    Configs are compared as their epochs complete (asynchronously, like ASHA's rungs): the
    first config to reach an epoch sets the bar there. Before a decision at epoch n exists,
    a seed at epoch n >= grace_epochs must wait; the runner keeps all seeds of a config
    running together (config-major order and enough concurrent trials) so the wait is short
    and cannot deadlock.
    """

    def __init__(self, seeds: Mapping[str, Iterable[int]], mode: str, grace_epochs: int, patience: int):
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.grace_epochs = int(grace_epochs)
        self.patience = int(patience)
        self.behind: dict[str, int] = defaultdict(int)
        self.best: dict[int, float] = {}
        super().__init__(mode, seeds)

    def decides_at(self, config_id: str, epoch: int) -> bool:
        return epoch >= self.grace_epochs

    def observe(self, config_id: str, epoch: int, mean: float) -> None:
        self.best[epoch] = max(self.best.get(epoch, -math.inf), mean)

    def judge(self, config_id: str, epoch: int, mean: float) -> str:
        self.observe(config_id, epoch, mean)
        self.behind[config_id] = self.behind[config_id] + 1 if mean < self.best[epoch] else 0
        return STOP if self.behind[config_id] >= self.patience else CONTINUE
