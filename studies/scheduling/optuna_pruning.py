"""An optuna block's `pruner`: Optuna's pruners judge configs on their seed means.

Where the Optuna calls happen, and why: the Optuna trials of a block (ask/tell) live in the
driver (`studies.scheduling.optuna_rounds.OptunaProposals`), the seed means in the coordinator actor.
The driver makes every Optuna call (`trial.report(mean, step=epochs done)`, then
`trial.should_prune()`): a `PrunerBridge` thread polls the actor for the means that are
complete and waiting for a decision, asks Optuna, and sends the decisions back. So the
block's SQLite storage (`<output>/<name>/optuna.db`) keeps a single writer process, on the
machine that holds it: an actor may be placed on any node of a cluster, where that file is
not, and two processes writing one SQLite file lock each other out. The cost is the poll
interval (0.2 s) once per epoch of a config, against epochs of seconds to hours.

`optuna` is imported only when a pruner is built.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from studies.scheduling.base import ConfigScheduler


class ConfigOptunaPruning(ConfigScheduler):
    """The actor's side: every epoch before a config's last is a decision point, and every
    decision is made outside (by the driver, see the module docstring): the complete seed
    mean waits in `pending` until `resolve`."""

    prunes = "optuna"

    def __init__(self, seeds, mode: str):
        super().__init__(mode, seeds)

    def decides_at(self, config_id: str, epoch: int) -> bool:
        return True

    def judge(self, config_id: str, epoch: int, mean: float) -> None:
        return None


def optuna_pruner(spec):
    """The Optuna pruner of an optuna block's `pruner` field (`studies.studyfile.design`)."""
    import optuna

    if spec is None:
        return optuna.pruners.NopPruner()
    fields = spec.model_dump(exclude={"kind"})
    classes = {
        "median": optuna.pruners.MedianPruner,
        "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
        "hyperband": optuna.pruners.HyperbandPruner,
    }
    return classes[spec.kind](**fields)


class PrunerBridge:
    """The driver's thread that carries the complete seed means of the actor to Optuna and
    the decisions back (see the module docstring).

    `judge(config_id, epoch, mean)` reports the mean to the config's Optuna trial and says
    whether to prune it (`OptunaProposals.report_epoch`).
    """

    def __init__(self, actor, judge: Callable[[str, int, float], bool], poll_s: float = 0.2):
        self.actor = actor
        self.judge = judge
        self.poll_s = poll_s
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="studies-pruner", daemon=True)

    def __enter__(self) -> PrunerBridge:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def step(self) -> int:
        """One poll: decide every pending mean; how many were decided."""
        import ray

        pending = ray.get(self.actor.pending.remote())
        decisions = [(config_id, epoch, self._prune(config_id, epoch, mean)) for config_id, epoch, mean in pending]
        if decisions:
            ray.get(self.actor.resolve.remote(decisions))
        return len(decisions)

    def _prune(self, config_id: str, epoch: int, mean: float) -> bool:
        """Optuna's decision; a config whose decision cannot be had goes on (said once)."""
        try:
            return bool(self.judge(config_id, epoch, mean))
        except Exception as error:  # noqa: BLE001  (never stop a config on a failed call)
            self._say(error)
            return False

    def _say(self, error: BaseException) -> None:
        if self.error is None:
            print(f"[studies] optuna pruner: {type(error).__name__}: {error}", flush=True)
        self.error = error

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.step()
            except Exception as error:  # noqa: BLE001  (the actor unreachable: try again)
                self._say(error)


def block_scheduling(study, tracking, session_id: str, index: int):
    """The driver's side of the pruner of the optuna block `index` (its own actor)."""
    from studies.scheduling.coordinator import ConfigScheduling

    return ConfigScheduling(
        study,
        tracking,
        f"studies-pruner-{session_id}-{index}",
        ConfigOptunaPruning,
        rule_kwargs={"seeds": {}, "mode": study.objective.mode},
        metric=study.objective.metric,
        label=f"design[{index}].pruner",
        prunes=ConfigOptunaPruning.prunes,
    )
