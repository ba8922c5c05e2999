"""Early stopping decided per config over all its seeds (`scheduler: {kind: early_stopping}`).

Three parts around one rule:

- `ConfigEarlyStopper`: the rule (plain Python; see its docstring);
- `EarlyStopping`: the driver's side for one session. It refuses a cluster where the seeds of
  a config cannot all run at once, starts the rule in a Ray actor (`EarlyStoppingCoordinator`)
  that every trial reports to, tells it every config seen with all its seeds, and replays
  into it the cells that finished in earlier runs (their curves from MLflow, and their stop
  epoch), so that a resumed study compares configs with the same bars as an uninterrupted one;
- `CoordinatorClient`: a trial's side. After every epoch the seed reports its value and
  waits for its config's decision; all seeds of a stopped config stop at the same epoch.

`ray` is imported only where an actor is started or called.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Any, Iterable, Mapping

from studies.errors import RunnerError
from studies.tracking import STATUS_FINISHED

#: Tag of a cell's run: the epochs done when its config was stopped.
TAG_STOPPED_EPOCH = "studies.stopped_epoch"


class ConfigEarlyStopper:
    """Early stopping decided per config over its seeds, never per seed alone.

    Epochs are counted as `n` = number of epochs done (1, 2, ...). The seed mean m_c(n) of
    config c is defined once every seed of c that is still alive has reported epoch n
    (seeds whose trial failed for good are left out). From n = grace_epochs on, m_c(n) is
    compared with best(n), the best seed mean at epoch n among the configs that completed
    epoch n so far (including c): c is "behind" when it is strictly worse. A config behind
    for `patience` consecutive epochs stops at that epoch; every seed of it stops there too.
    A NaN value counts as the worst possible.

    Configs are compared as their epochs complete (asynchronously, like ASHA's rungs): the
    first config to reach an epoch sets the bar there. Before a decision at epoch n exists,
    a seed at epoch n >= grace_epochs must wait (`status` -> "wait"); the runner keeps all
    seeds of a config running together (config-major order and enough concurrent trials)
    so the wait is short and cannot deadlock.
    """

    def __init__(self, seeds: Mapping[str, Iterable[int]], mode: str, grace_epochs: int,
                 patience: int):
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.seeds = {c: set(s) for c, s in seeds.items()}
        self.mode = mode
        self.grace_epochs = int(grace_epochs)
        self.patience = int(patience)
        self.values: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
        self.gone: dict[str, set] = defaultdict(set)
        self.decided: dict[str, int] = defaultdict(int)  # config -> last epoch with a mean
        self.means: dict[tuple[str, int], float] = {}
        self.behind: dict[str, int] = defaultdict(int)
        self.stopped: dict[str, int] = {}
        self.best: dict[int, float] = {}

    def _score(self, value: float) -> float:
        """Larger is better; NaN is the worst."""
        if value != value:
            return -math.inf
        return value if self.mode == "max" else -value

    def add_config(self, config_id: str, seeds: Iterable[int]) -> None:
        self.seeds.setdefault(config_id, set()).update(seeds)

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

    def _complete(self, config_id: str, epoch: int) -> bool:
        alive = self.seeds.get(config_id, set()) - self.gone[config_id]
        reported = self.values.get((config_id, epoch), {})
        return bool(alive) and alive <= set(reported)

    def _advance(self, config_id: str) -> None:
        while config_id not in self.stopped:
            epoch = self.decided[config_id] + 1
            if not self._complete(config_id, epoch):
                return
            alive = self.seeds[config_id] - self.gone[config_id]
            scores = [self._score(self.values[(config_id, epoch)][s]) for s in alive]
            mean = sum(scores) / len(scores)
            self.means[(config_id, epoch)] = mean
            self.decided[config_id] = epoch
            best = max(self.best.get(epoch, -math.inf), mean)
            self.best[epoch] = best
            if epoch < self.grace_epochs:
                continue
            self.behind[config_id] = self.behind[config_id] + 1 if mean < best else 0
            if self.behind[config_id] >= self.patience:
                self.stopped[config_id] = epoch

    def status(self, config_id: str, seed: int, epoch: int) -> str:
        """'stop' (the config stopped at or before this epoch), 'continue', or 'wait'."""
        stop = self.stopped.get(config_id)
        if stop is not None:  # decided: every seed runs to the stop epoch, then stops
            return "stop" if stop <= epoch else "continue"
        if epoch < self.grace_epochs or self.decided[config_id] >= epoch:
            return "continue"
        return "wait"


class EarlyStoppingCoordinator:
    """The body of the Ray actor that holds one session's `ConfigEarlyStopper`."""

    def __init__(self, seeds, mode, grace_epochs, patience):
        self.stopper = ConfigEarlyStopper(seeds, mode, grace_epochs, patience)

    def record(self, config_id, seed, epoch, value):
        return self.stopper.record(config_id, seed, epoch, value)

    def status(self, config_id, seed, epoch):
        return self.stopper.status(config_id, seed, epoch)

    def mark_gone(self, config_id, seed):
        self.stopper.mark_gone(config_id, seed)

    def mark_stopped(self, config_id, epoch):
        self.stopper.mark_stopped(config_id, epoch)

    def add_config(self, config_id, seeds):
        self.stopper.add_config(config_id, seeds)

    def stopped(self):
        return dict(self.stopper.stopped)


class EarlyStopping:
    """The driver's side of early stopping for one session (see the module docstring)."""

    def __init__(self, study, tracking, session_id: str):
        self.study = study
        self.tracking = tracking
        scheduler = study.scheduler
        self.enabled = getattr(scheduler, "kind", "none") == "early_stopping"
        self.metric = (scheduler.metric or study.objective.metric) if self.enabled else None
        self.actor_name = f"studies-early-stopping-{session_id}"
        self.actor = None
        self._replayed: set[str] = set()

    def check_concurrency(self, concurrency: int) -> None:
        """Early stopping needs every seed of a config running at once (see
        `ConfigEarlyStopper`); refuse before anything starts when the cluster cannot."""
        if not self.enabled:
            return
        need = self.study.seeds_at_once  # a race's later seeds run after its initial round
        if concurrency < need:
            raise RunnerError(
                f"{self.study.path}: scheduler: early stopping decides per config over its "
                f"{need} seeds, which must run at the same time, but only "
                f"{concurrency} trial(s) fit at once (resources cpus "
                f"{self.study.resources.cpus:g}, gpus {self.study.resources.gpus:g}, "
                f"max_concurrent {self.study.max_concurrent}); allow at least {need}"
            )

    def prepare(self, known_cells: Iterable, concurrency: int) -> dict | None:
        """What the trials need to reach the coordinator (its actor's name and the metric);
        None when early stopping is off. Starts the actor once per session, then tells it
        every config of `known_cells` with all its seeds and replays the finished ones."""
        if not self.enabled:
            return None
        import ray

        self.check_concurrency(concurrency)
        if self.actor is None:
            scheduler = self.study.scheduler
            mode = scheduler.mode or self.study.objective.mode
            self.actor = ray.remote(num_cpus=0)(EarlyStoppingCoordinator).options(
                name=self.actor_name).remote(
                {}, mode, scheduler.grace_epochs, scheduler.patience)
        known = list(known_cells)
        # a race's later seeds start after its initial round: only those run (and wait) together
        together = set(self.study.seed_list[:self.study.seeds_at_once])
        seeds = defaultdict(set)
        for cell in known:
            if int(cell.seed) in together:
                seeds[cell.config_id].add(int(cell.seed))
        ray.get([self.actor.add_config.remote(config_id, sorted(config_seeds))
                 for config_id, config_seeds in seeds.items()])
        self._replay_finished([c for c in known if c.cell_id not in self._replayed])
        return {"actor": self.actor_name, "metric": self.metric}

    def _replay_finished(self, cells: list) -> None:
        """Record the curves (and stop epochs) of the cells finished in earlier runs."""
        import ray

        states = self.tracking.cell_states([c.cell_id for c in cells])
        for cell in cells:
            self._replayed.add(cell.cell_id)
            state = states.get(cell.cell_id)
            if state is None or state.status != STATUS_FINISHED:
                continue
            history = self.tracking.metric_history(state.run_id, self.metric)
            ray.get([self.actor.record.remote(cell.config_id, int(cell.seed), n, value)
                     for n, (_step, value) in enumerate(history, start=1)])
            stopped = self.tracking.client.get_run(state.run_id).data.tags.get(
                TAG_STOPPED_EPOCH)
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

    def __init__(self, actor, metric: str, cell: Mapping[str, Any]):
        self.actor = actor
        self.metric = metric
        self.config_id = cell["config_id"]
        self.seed = int(cell["seed"])

    @classmethod
    def connect(cls, spec: Mapping[str, Any] | None,
                cell: Mapping[str, Any]) -> "CoordinatorClient | None":
        """The client for `spec` ({"actor": name, "metric": key}, from `EarlyStopping.prepare`);
        None when early stopping is off."""
        if not spec or not spec.get("actor"):
            return None
        import ray

        return cls(ray.get_actor(spec["actor"]), spec.get("metric"), cell)

    def decision(self, epochs_done: int) -> str:
        """The config's status at `epochs_done`: 'stop', 'continue' or 'wait'."""
        import ray

        return ray.get(self.actor.status.remote(self.config_id, self.seed, epochs_done))

    def report_and_wait(self, epochs_done: int, metrics: Mapping[str, float],
                        poll_s: float = 0.2) -> str:
        """Record this seed's value of the metric (NaN when absent) and block until its
        config's decision at this epoch: 'stop' or 'continue'."""
        import ray

        value = float(metrics.get(self.metric, math.nan))
        status = ray.get(self.actor.record.remote(self.config_id, self.seed, epochs_done,
                                                  value))
        while status == "wait":
            time.sleep(poll_s)
            status = self.decision(epochs_done)
        return status

    def tell_gone(self) -> None:
        """This seed failed for good: its config decides on the other seeds."""
        import ray

        ray.get(self.actor.mark_gone.remote(self.config_id, self.seed))
