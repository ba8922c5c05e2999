"""The machinery around a config-level rule (`studies.scheduling.base`): a Ray actor
that every trial reports to, the driver's side, and a trial's side.

- `SchedulerActor`: the body of the actor that holds one session's rule;
- `ConfigScheduling`: the driver's side for one session and one rule. It refuses a cluster
  where the seeds of a config cannot all run at once, starts the actor, tells it every config
  seen with all its seeds and its epochs, and replays into it the cells that finished in
  earlier runs (their curves from MLflow, and their stop epoch), so that a resumed study
  compares configs with the same bars as an uninterrupted one;
- `CoordinatorClient`: a trial's side. After every epoch the seed reports its value and
  waits for its config's decision; all seeds of a stopped config stop at the same epoch.

The actor is an asyncio actor: a seed that must wait makes one call that returns when its
config's decision exists (every change to the rule wakes the waiting calls), not a call every
fraction of a second, so the calls grow with the epochs trained, not with the time spent
waiting (docs/scale.md, "Early stopping").

`ray` is imported only where an actor is started or called.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from analysis.layout import TAG_STOPPED_EPOCH
from studies.errors import RunnerError
from studies.scheduling.base import WAIT, ConfigScheduler
from studies.tracking import STATUS_FINISHED


class SchedulerActor:
    """The body of the Ray actor that holds one session's rule (a `ConfigScheduler`).

    Every method is a coroutine, so Ray runs the actor on one event loop: the rule is only
    touched between awaits (no lock needed), and `wait_decision` calls wait side by side
    (up to Ray's 1,000 concurrent calls of an asyncio actor) while the others go on."""

    def __init__(self, rule_class: type, kwargs: Mapping[str, Any]):
        self.rule: ConfigScheduler = rule_class(**kwargs)
        self._change: asyncio.Event | None = None  # set (and replaced) at every change

    def _changed(self) -> None:
        """Wake every `wait_decision` call: the rule may have decided."""
        if self._change is not None:
            self._change.set()
            self._change = None

    async def record(self, config_id, seed, epoch, value):
        status = self.rule.record(config_id, seed, epoch, value)
        self._changed()
        return status

    async def status(self, config_id, seed, epoch):
        return self.rule.status(config_id, seed, epoch)

    async def wait_decision(self, config_id, seed, epoch, timeout_s: float):
        """The seed's status at `epoch` once it is not WAIT, or WAIT after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (status := self.rule.status(config_id, seed, epoch)) == WAIT:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            if self._change is None:
                self._change = asyncio.Event()
            try:
                await asyncio.wait_for(self._change.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        return status

    async def mark_gone(self, config_id, seed):
        self.rule.mark_gone(config_id, seed)
        self._changed()

    async def mark_stopped(self, config_id, epoch):
        self.rule.mark_stopped(config_id, epoch)
        self._changed()

    async def add_configs(self, configs):
        for config_id, seeds, epochs in configs:
            self.rule.add_config(config_id, seeds, epochs)
        self._changed()

    async def stopped(self):
        return dict(self.rule.stopped)

    async def pending(self):
        """[(config_id, epoch, raw seed mean)] waiting for an outside decision."""
        return [(c, n, self.rule.raw_mean(c, n)) for (c, n) in self.rule.pending]

    async def resolve(self, decisions):
        for config_id, epoch, stop in decisions:
            self.rule.resolve(config_id, epoch, stop)
        self._changed()


class ConfigScheduling:
    """The driver's side of one rule for one session (see the module docstring).

    `rule_class(**rule_kwargs)` builds the rule in the actor; `metric` is the per-epoch
    metric the trials report to it; `label` names the rule in errors; `prunes` is the value
    of a stopped cell's `studies.pruned` tag (None for early stopping).
    """

    def __init__(
        self,
        study,
        tracking,
        actor_name: str,
        rule_class: type | None,
        rule_kwargs: Mapping[str, Any] | None = None,
        metric: str | None = None,
        label: str = "",
        prunes: str | None = None,
    ):
        self.study = study
        self.tracking = tracking
        self.enabled = rule_class is not None
        self.rule_class = rule_class
        self.rule_kwargs = dict(rule_kwargs or {})
        self.metric = metric
        self.label = label
        self.prunes = prunes
        self.actor_name = actor_name
        self.actor: Any = None  # its Ray actor, started by `prepare`
        self._told: set[str] = set()  # configs the actor knows
        self._replayed: set[str] = set()

    def check_concurrency(self, concurrency: int) -> None:
        """A config-level rule needs every seed of a config running at once (the seeds wait
        for each other at its decisions); refuse before anything starts when the cluster
        cannot."""
        if not self.enabled:
            return
        need = self.study.seeds_at_once  # a race's later seeds run after its initial round
        per_trial = int(self.study.resources.seeds_per_trial)
        need = -(-need // per_trial)  # fused arrays: a trial runs up to per_trial of them
        if concurrency < need:
            raise RunnerError(
                f"{self.study.path}: {self.label} decides per config over its "
                f"{need} seeds, which must run at the same time, but only "
                f"{concurrency} trial(s) fit at once (resources cpus "
                f"{self.study.resources.cpus:g}, gpus {self.study.resources.gpus:g}, "
                f"max_concurrent {self.study.max_concurrent}); allow at least {need}"
            )

    def prepare(self, known_cells: Iterable, concurrency: int) -> dict | None:
        """What the trials need to reach the coordinator (its actor's name, the metric and
        the `prunes` tag); None when the rule is off. Starts the actor once per session, then
        tells it every new config of `known_cells` with all its seeds and replays the
        finished ones."""
        if not self.enabled:
            return None
        import ray

        self.check_concurrency(concurrency)
        if self.actor is None:
            self.actor = (
                ray.remote(num_cpus=0)(SchedulerActor)
                .options(name=self.actor_name)
                .remote(self.rule_class, self.rule_kwargs)
            )
        known = list(known_cells)
        seeds: dict[str, set] = defaultdict(set)
        epochs: dict[str, int] = {}
        # a race's later seeds start after its initial round: only those run (and wait) together
        together = set(self.study.seed_list[: self.study.seeds_at_once])
        for cell in known:
            if int(cell.seed) in together:
                seeds[cell.config_id].add(int(cell.seed))
            epochs[cell.config_id] = int(cell.config.get("epochs", 1))
        new = [(c, sorted(s), epochs[c]) for c, s in seeds.items() if c not in self._told]
        if new:
            ray.get(self.actor.add_configs.remote(new))
            self._told.update(c for c, _, _ in new)
        self._replay_finished([c for c in known if c.cell_id not in self._replayed])
        return {"actor": self.actor_name, "metric": self.metric, "prunes": self.prunes}

    def _replay_finished(self, cells: list) -> None:
        """Record the curves (and stop epochs) of the cells finished in earlier runs."""
        import ray

        if not cells:
            return
        states = self.tracking.cell_states([c.cell_id for c in cells])
        for cell in cells:
            self._replayed.add(cell.cell_id)
            state = states.get(cell.cell_id)
            if state is None or state.status != STATUS_FINISHED:
                continue
            history = self.tracking.metric_history(state.run_id, self.metric)
            ray.get(
                [
                    self.actor.record.remote(cell.config_id, int(cell.seed), n, value)
                    for n, (_step, value) in enumerate(history, start=1)
                ]
            )
            stopped = self.tracking.client.get_run(state.run_id).data.tags.get(TAG_STOPPED_EPOCH)
            if stopped:
                ray.get(self.actor.mark_stopped.remote(cell.config_id, int(stopped)))

    def mark_gone(self, cell) -> None:
        """A cell whose trial errored for good in Tune: its config decides without it."""
        if self.actor is None:
            return
        import ray

        ray.get(self.actor.mark_gone.remote(cell.config_id, int(cell.seed)))


class CoordinatorClient:
    """One trial's link to the coordinator actor of its session."""

    def __init__(self, actor, metric: str, cell: Mapping[str, Any], prunes: str | None = None):
        self.actor = actor
        self.metric = metric
        self.prunes = prunes
        self.config_id = cell["config_id"]
        self.seed = int(cell["seed"])

    @classmethod
    def connect(cls, spec: Mapping[str, Any] | None, cell: Mapping[str, Any]) -> CoordinatorClient | None:
        """The client for `spec` ({"actor": name, "metric": key, "prunes": tag value}, from
        `ConfigScheduling.prepare`); None when no rule is on."""
        if not spec or not spec.get("actor"):
            return None
        import ray

        return cls(ray.get_actor(spec["actor"]), spec["metric"], cell, spec.get("prunes"))

    def decision(self, epochs_done: int) -> str:
        """The config's status at `epochs_done`: 'stop', 'continue' or 'wait'."""
        import ray

        return ray.get(self.actor.status.remote(self.config_id, self.seed, epochs_done))

    def report_and_wait(self, epochs_done: int, metrics: Mapping[str, float], wait_s: float = 60.0) -> str:
        """Record this seed's value of the metric (NaN when absent) and block until its
        config's decision at this epoch: 'stop' or 'continue' (one call per `wait_s` of
        waiting: the actor answers as soon as the decision exists)."""
        return self.wait(epochs_done, self.record(epochs_done, metrics), wait_s)

    def record(self, epochs_done: int, metrics: Mapping[str, float]) -> str:
        """Record this seed's value of the metric (NaN when absent) without waiting: 'stop',
        'continue' or 'wait' (the members of a fused array record all, then wait once)."""
        import ray

        value = float(metrics.get(self.metric, math.nan))
        return ray.get(self.actor.record.remote(self.config_id, self.seed, epochs_done, value))

    def wait(self, epochs_done: int, status: str, wait_s: float = 60.0) -> str:
        """Block while `status` is 'wait' until the config's decision at this epoch."""
        import ray

        while status == WAIT:
            status = ray.get(self.actor.wait_decision.remote(self.config_id, self.seed, epochs_done, wait_s))
        return status

    def tell_gone(self) -> None:
        """This seed failed for good: its config decides on the other seeds."""
        import ray

        ray.get(self.actor.mark_gone.remote(self.config_id, self.seed))
