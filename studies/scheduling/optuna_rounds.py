"""The optuna blocks of a study's design: configs asked as slots free up, told as they end.

An Optuna study per block (the block's sampler, TPE by default; storage
`<output>/<name>/optuna.db`, so that a resumed study continues it) proposes configs one at a
time (`OptunaProposals`). The runner runs a block as one Tune experiment whose searcher
(`studies.running.tune_experiment.ProposalSearcher`) asks for the next config whenever a trial slot
is free and no seed of an earlier config is left to start: each config runs on every seed of
the study as Tune trials (with ``resources.seeds_per_trial: N``, fused arrays of up to N of its
seeds, the rest a smaller array), and when the last of its seeds ends, the seed mean of the objective
is told back (ask/tell), so the sampler learns from every config as soon as it is known and
no slot waits for a round to end. A config with a failed cell is told FAIL and not retried
(its cells stay failed in MLflow). With a `pruner` on the block, the config's seed mean
after every epoch is reported to its trial as the intermediate value at step = epochs done
(`report_epoch`, called by `studies.scheduling.optuna_pruning.PrunerBridge`); a config
the pruner stops ends with every seed at that epoch and is told PRUNED. Trials left RUNNING by a
killed driver are replayed first:
`optuna.trial.FixedTrial` of their params gives the same config, hence the same cells, which
finish (or are already finished) and are told.

`optuna` is imported only when a block runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from studies.tracking import STATUS_FINISHED, TAG_PRUNED, TAG_STATUS, StudyTracking, cell_objective


@dataclass
class Proposal:
    """One config asked from Optuna (its trial `number`) and the cells of its seeds."""

    number: int
    cells: list
    runs: dict = field(default_factory=dict)  # cell_id -> run id (None: no run) once ended
    trial: Any = None  # its optuna.trial.Trial (intermediate values are reported to it)
    reported: set = field(default_factory=set)  # the steps its trial holds

    @property
    def ended(self) -> bool:
        return len(self.runs) == len(self.cells)


class OptunaProposals:
    """The configs of one optuna block, asked one at a time and told back as they end.

    `propose()` returns the cells of the next config (a replayed trial of a killed driver
    first, then new asks while the block has room), or None once the block's `n_configs`
    trials exist; `cell_ended(cell_id, run_id)` records a cell's end, and tells Optuna when it
    was its config's last. Plain Python: it runs in the driver, called by Tune's searcher.
    """

    def __init__(
        self, study, index: int, block, *, study_name: str, study_dir: Path, smoke_epochs: int, tracking: StudyTracking
    ):
        import optuna
        from optuna.trial import TrialState

        from studies.cells.space import optuna_sampler
        from studies.scheduling.optuna_pruning import optuna_pruner

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        # Tune's searcher (ask, tell) and the pruner's thread (report) share the study
        self.lock = threading.RLock()
        self.study, self.index, self.block = study, index, block
        self.smoke_epochs, self.tracking = smoke_epochs, tracking  # 0: not a smoke run
        self.metric = study.objective.metric
        self.seeds = study.seed_list  # racing is refused with optuna blocks: the list
        self.ostudy = optuna.create_study(
            study_name=f"{study_name}/design[{index}]",
            storage=f"sqlite:///{study_dir / 'optuna.db'}",
            sampler=optuna_sampler(block),
            pruner=optuna_pruner(block.pruner),
            load_if_exists=True,
            direction="maximize" if study.objective.mode == "max" else "minimize",
        )
        trials = self.ostudy.get_trials(deepcopy=False)
        self.replays = [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
        self.trials_made = len(trials)  # every trial of the block, whatever its state
        self.open: dict[str, list[Proposal]] = {}  # cell_id -> the proposals waiting for it
        self.by_config: dict[str, list[Proposal]] = {}  # config_id -> its open proposals
        self.cells_used: list = []

    def __getstate__(self) -> dict:
        """Tune pickles its searcher with the experiment's state: without the lock."""
        state = dict(self.__dict__)
        state.pop("lock", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()

    @property
    def max_cells(self) -> int:
        """Most cells the block can still start (its room times the seeds)."""
        room = len(self.replays) + max(0, self.block.n_configs - self.trials_made)
        return room * len(self.seeds)

    def _cells_of(self, trial_like) -> list:
        from studies.cells.space import Cell, config_id, optuna_block_suggest, smoke_cells

        variant, config, swept = optuna_block_suggest(self.study, self.index, trial_like)
        cells = [Cell(config_id(config), seed, variant, config, dict(swept)) for seed in self.seeds]
        return smoke_cells(cells, self.smoke_epochs) if self.smoke_epochs else cells

    def propose(self) -> list | None:
        """The cells of the next config (every seed) that are not already under way for an
        earlier proposal of the same config; None when the block is complete."""
        with self.lock:
            return self._propose()

    def _propose(self) -> list | None:
        from optuna.trial import FixedTrial, Trial

        if self.replays:
            frozen = self.replays.pop(0)
            cells = self._cells_of(FixedTrial(frozen.params, frozen.number))
            trial = Trial(self.ostudy, frozen._trial_id)  # reports go to the stored trial
            reported = set(frozen.intermediate_values)
        elif self.trials_made < self.block.n_configs:
            trial = self.ostudy.ask()
            self.trials_made += 1
            cells = self._cells_of(trial)
            trial.set_user_attr("config_id", cells[0].config_id)
            reported = set()
        else:
            return None
        proposal = Proposal(trial.number, cells, trial=trial, reported=reported)
        self.by_config.setdefault(cells[0].config_id, []).append(proposal)
        fresh = []
        for cell in cells:
            if cell.cell_id not in self.open:  # a config asked twice waits for the first
                fresh.append(cell)
            self.open.setdefault(cell.cell_id, []).append(proposal)
        self.cells_used.extend(fresh)
        return fresh

    def cell_ended(self, cell_id: str, run_id: str | None) -> None:
        """A cell of an open proposal ended (finished, failed, or found finished in MLflow
        without running); the last one of its config tells Optuna the seed mean."""
        with self.lock:
            for proposal in self.open.pop(cell_id, []):
                proposal.runs[cell_id] = run_id
                if proposal.ended:
                    self._tell(proposal)
                    config_id = proposal.cells[0].config_id
                    self.by_config[config_id] = [p for p in self.by_config.get(config_id, []) if p is not proposal]

    def report_epoch(self, config_id: str, epoch: int, mean: float) -> bool:
        """The config's seed mean of the objective after `epoch` epochs, reported to its
        open trial(s) at step `epoch`; whether the block's pruner stops the config. A step
        already reported (a trial replayed after a driver was killed) is not reported again."""
        with self.lock:
            prune = False
            for proposal in self.by_config.get(config_id, []):
                if epoch not in proposal.reported:
                    proposal.trial.report(float(mean), step=int(epoch))
                    proposal.reported.add(epoch)
                prune = proposal.trial.should_prune() or prune
            return prune

    def _tell(self, proposal: Proposal) -> None:
        """The seed mean of the objective; PRUNED when the block's pruner stopped the config
        (its cells are tagged `studies.pruned`); FAIL when a cell did not finish."""
        from optuna.trial import TrialState

        values = []
        pruned = False
        for cell in proposal.cells:
            run_id = proposal.runs.get(cell.cell_id)
            tags = self.tracking.tags_of_run(run_id) if run_id is not None else {}
            if tags.get(TAG_STATUS) != STATUS_FINISHED:
                break
            pruned = pruned or bool(tags.get(TAG_PRUNED))
            value = cell_objective(self.tracking, cast(str, run_id), self.metric)  # finished: it has a run
            if value != value:  # NaN: the metric is missing
                break
            values.append(value)
        if len(values) == len(proposal.cells) and pruned:
            self.ostudy.tell(proposal.number, state=TrialState.PRUNED)  # value: its last report
        elif len(values) == len(proposal.cells):
            self.ostudy.tell(proposal.number, sum(values) / len(values))
        else:
            self.ostudy.tell(proposal.number, state=TrialState.FAIL)

    def trial_counts(self) -> dict[str, int]:
        """How many of the block's configs Optuna holds in each state (complete, pruned, ...)."""
        counts: dict[str, int] = {}
        for trial in self.ostudy.get_trials(deepcopy=False):
            state = trial.state.name.lower()
            counts[state] = counts.get(state, 0) + 1
        return counts

    def best(self) -> tuple[str, float] | None:
        """(config_id, seed mean of the objective) of the block's best complete config."""
        try:
            trial = self.ostudy.best_trial
        except ValueError:  # no complete trial
            return None
        return trial.user_attrs.get("config_id", f"trial {trial.number}"), float(cast(float, trial.value))


def run_optuna_block(
    study,
    index: int,
    block,
    *,
    study_name: str,
    study_dir: Path,
    smoke_epochs: int,
    tracking: StudyTracking,
    run_proposals: Callable[[OptunaProposals], None],
) -> list:
    """Ask, run and tell the configs of the optuna block `index` of `study`;
    `run_proposals(proposals)` runs them (one Tune experiment). Returns every cell used."""
    proposals = OptunaProposals(
        study, index, block, study_name=study_name, study_dir=study_dir, smoke_epochs=smoke_epochs, tracking=tracking
    )
    run_proposals(proposals)
    return proposals.cells_used
