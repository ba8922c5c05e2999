"""Asynchronous successive halving (ASHA) of configs over their seeds
(`scheduler: {kind: asha}`)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping

from studies.scheduling.base import CONTINUE, STOP, ConfigScheduler


def rungs(grace_epochs: int, reduction_factor: int, epochs: int) -> list[int]:
    """The rungs below `epochs`: grace, grace * eta, grace * eta^2, ... (epochs done)."""
    out, rung = [], int(grace_epochs)
    while rung < epochs:
        out.append(rung)
        rung *= int(reduction_factor)
    return out


class ConfigSuccessiveHalving(ConfigScheduler):
    """ASHA (Li et al., "A System for Massively Parallel Hyperparameter Tuning", MLSys 2020)
    with a config, all its seeds together, as the unit.

    Rungs: r_i = grace_epochs * reduction_factor^i (epochs done). At rung r the seed mean
    m_c(r) of config c (see `ConfigScheduler`) is ranked among the means at r of the n
    configs that reached r so far (c included): c continues when fewer than
    ceil(n / reduction_factor) of them are strictly better, i.e. when it is in the top
    1/eta (ties go on); otherwise every seed of c stops at r. Asynchronous as in ASHA: the
    first configs to reach a rung are judged against the few seen so far (the first one
    always continues), so no config waits for a rung to fill.
    """

    prunes = "asha"

    def __init__(self, seeds: Mapping[str, Iterable[int]], mode: str, grace_epochs: int, reduction_factor: int):
        if grace_epochs < 1:
            raise ValueError(f"grace_epochs must be >= 1, got {grace_epochs}")
        if reduction_factor < 2:
            raise ValueError(f"reduction_factor must be >= 2, got {reduction_factor}")
        self.grace_epochs = int(grace_epochs)
        self.reduction_factor = int(reduction_factor)
        self.rung_means: dict[int, list[float]] = defaultdict(list)
        super().__init__(mode, seeds)

    def decides_at(self, config_id: str, epoch: int) -> bool:
        ratio = epoch / self.grace_epochs
        if epoch % self.grace_epochs or ratio < 1:
            return False
        power = round(math.log(ratio, self.reduction_factor))
        return self.grace_epochs * self.reduction_factor**power == epoch

    def judge(self, config_id: str, epoch: int, mean: float) -> str:
        means = self.rung_means[epoch]
        means.append(mean)
        better = sum(1 for m in means if m > mean)
        keep = math.ceil(len(means) / self.reduction_factor)
        return CONTINUE if better < keep else STOP
