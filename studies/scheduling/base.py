"""The base of a config-level scheduling rule: seed means per config and epoch, one
decision per config (all its seeds continue or stop together).

Ray Tune, Optuna and W&B Sweeps prune trials one at a time; a study compares configs over
paired seeds, so its rules see the seed mean of a config, never one seed alone. The base
class keeps the bookkeeping (which seeds of a config have reported an epoch, which failed
for good, the seed means, the stops); a rule (`ConfigEarlyStopper`,
`ConfigSuccessiveHalving`, `ConfigOptunaPruning`) says at which epochs it decides and what.
Its shape follows Optuna's pruners: a small base class and one file per rule.

Plain Python: it runs inside the coordinator actor (`studies.scheduling.coordinator`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping

#: a seed's status at an epoch
STOP, CONTINUE, WAIT = "stop", "continue", "wait"


class ConfigScheduler:
    """Seed means of configs, epoch by epoch, and the stops a rule decides on them.

    Epochs are counted as `n` = number of epochs done (1, 2, ...). The seed mean m_c(n) of
    config c is defined once every seed of c that is still alive has reported epoch n
    (seeds whose trial failed for good are left out). Means are scores, larger is better
    (`mode` "min" negates the values); a NaN value counts as the worst possible.

    A rule overrides `decides_at(config, n)` (the epochs where a seed must wait for its
    config's decision) and `judge(config, n, mean)` (called at those epochs, once the mean
    is complete: STOP, CONTINUE, or None when the decision is made outside, see `resolve`);
    `observe(config, n, mean)` sees the means of the other epochs. No decision is made at or
    after a config's last epoch (its `epochs`, when known): stopping there saves nothing.
    """

    #: the rule's name in the `studies.pruned` tag of a stopped cell; None: a stop is not a
    #: pruning (early stopping keeps the config in the report)
    prunes: str | None = None

    def __init__(self, mode: str, seeds: Mapping[str, Iterable[int]] | None = None):
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        self.mode = mode
        self.seeds: dict[str, set] = {}
        self.epochs: dict[str, int] = {}  # config -> its number of epochs, when known
        self.values: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
        self.gone: dict[str, set] = defaultdict(set)
        self.decided: dict[str, int] = defaultdict(int)  # config -> last epoch judged
        self.means: dict[tuple[str, int], float] = {}
        self.pending: dict[tuple[str, int], float] = {}  # waiting for `resolve`
        self.stopped: dict[str, int] = {}
        for config_id, config_seeds in (seeds or {}).items():
            self.add_config(config_id, config_seeds)

    # ----- what a rule defines ---------------------------------------------------------

    def decides_at(self, config_id: str, epoch: int) -> bool:
        raise NotImplementedError

    def judge(self, config_id: str, epoch: int, mean: float) -> str | None:
        raise NotImplementedError

    def observe(self, config_id: str, epoch: int, mean: float) -> None:
        """The mean of an epoch where the rule does not decide (kept by some rules)."""

    # ----- the bookkeeping -------------------------------------------------------------

    def score(self, value: float) -> float:
        """Larger is better; NaN is the worst."""
        if value != value:
            return -math.inf
        return value if self.mode == "max" else -value

    def add_config(self, config_id: str, seeds: Iterable[int], epochs: int | None = None) -> None:
        self.seeds.setdefault(config_id, set()).update(int(s) for s in seeds)
        if epochs is not None:
            self.epochs[config_id] = int(epochs)
        self._advance(config_id)

    def record(self, config_id: str, seed: int, epoch: int, value: float) -> str:
        """Seed `seed` of `config_id` reports `value` after `epoch` epochs; its status."""
        self.values[(config_id, int(epoch))][int(seed)] = float(value)
        self._advance(config_id)
        return self.status(config_id, seed, epoch)

    def mark_gone(self, config_id: str, seed: int) -> None:
        """A seed whose trial failed for good: the config's means use the other seeds."""
        self.gone[config_id].add(int(seed))
        self._advance(config_id)

    def mark_stopped(self, config_id: str, epoch: int) -> None:
        """A stop decided in an earlier run of the study (read back from MLflow)."""
        self.stopped[config_id] = int(epoch)

    def raw_mean(self, config_id: str, epoch: int) -> float:
        """The mean of the metric itself (not the score) over the alive seeds at `epoch`;
        NaN when a seed's value is NaN."""
        alive = self.seeds[config_id] - self.gone[config_id]
        values = [self.values[(config_id, epoch)][s] for s in alive]
        return sum(values) / len(values)

    def resolve(self, config_id: str, epoch: int, stop: bool) -> None:
        """The outside decision on a pending mean (`judge` returned None). A config
        stopped meanwhile (a stop replayed from an earlier run) keeps its stop."""
        if self.pending.pop((config_id, int(epoch)), None) is None or config_id in self.stopped:
            return
        self.decided[config_id] = int(epoch)
        if stop:
            self.stopped[config_id] = int(epoch)
        self._advance(config_id)

    def _deciding(self, config_id: str, epoch: int) -> bool:
        last = self.epochs.get(config_id)
        return (last is None or epoch < last) and self.decides_at(config_id, epoch)

    def _complete(self, config_id: str, epoch: int) -> bool:
        alive = self.seeds.get(config_id, set()) - self.gone[config_id]
        reported = self.values.get((config_id, epoch), {})
        return bool(alive) and alive <= set(reported)

    def _advance(self, config_id: str) -> None:
        while config_id not in self.stopped:
            epoch = self.decided[config_id] + 1
            if (config_id, epoch) in self.pending or not self._complete(config_id, epoch):
                return
            alive = self.seeds[config_id] - self.gone[config_id]
            scores = [self.score(self.values[(config_id, epoch)][s]) for s in alive]
            mean = sum(scores) / len(scores)
            self.means[(config_id, epoch)] = mean
            if not self._deciding(config_id, epoch):
                self.observe(config_id, epoch, mean)
                self.decided[config_id] = epoch
                continue
            verdict = self.judge(config_id, epoch, mean)
            if verdict is None:
                self.pending[(config_id, epoch)] = mean
                return
            self.decided[config_id] = epoch
            if verdict == STOP:
                self.stopped[config_id] = epoch

    def status(self, config_id: str, seed: int, epoch: int) -> str:
        """STOP (the config stopped at or before this epoch), CONTINUE, or WAIT."""
        stop = self.stopped.get(config_id)
        if stop is not None:  # decided: every seed runs to the stop epoch, then stops
            return STOP if stop <= epoch else CONTINUE
        if not self._deciding(config_id, epoch) or self.decided[config_id] >= epoch:
            return CONTINUE
        return WAIT
