"""The optuna blocks of a study's design: configs proposed in rounds, each run on every seed.

An Optuna study per block (the block's sampler, TPE by default; storage
`<output>/<name>/optuna.db`, so that a resumed study continues it) proposes configs in
rounds of max(1, concurrent trials // seeds) proposals. Each proposal runs on every seed of
the study as Tune trials, and the seed mean of the objective is told back; a proposal with a
failed cell is told FAIL and not retried (its cells stay failed in MLflow). Trials left
RUNNING by a killed driver are replayed first: `optuna.trial.FixedTrial` of their params
gives the same config, hence the same cells, which finish and are told.

`optuna` is imported only when a block runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from studies.tracking import STATUS_FINISHED, StudyTracking, cell_objective


def run_optuna_block(study, index: int, block, *, study_name: str, study_dir: Path,
                     smoke: bool, concurrency: int, tracking: StudyTracking,
                     run_round: Callable[[list], None]) -> list:
    """Propose, run and tell the configs of the optuna block `index` of `study`.

    `run_round(cells)` runs the cells of one round that are not finished yet. Returns every
    cell the block used.
    """
    import optuna
    from optuna.trial import FixedTrial, TrialState

    from studies.space import Cell, config_id, optuna_block_suggest, optuna_sampler, smoke_cells

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    direction = "maximize" if study.objective.mode == "max" else "minimize"
    ostudy = optuna.create_study(
        study_name=f"{study_name}/design[{index}]",
        storage=f"sqlite:///{study_dir / 'optuna.db'}",
        sampler=optuna_sampler(block), direction=direction, load_if_exists=True)
    seeds = list(study.seeds)
    round_size = max(1, concurrency // max(1, len(seeds)))
    all_cells: list = []

    def cells_of(trial_like) -> list:
        variant, config, swept = optuna_block_suggest(study, index, trial_like)
        cells = [Cell(config_id(config), seed, variant, config, dict(swept)) for seed in seeds]
        return smoke_cells(cells) if smoke else cells

    while True:
        trials = ostudy.get_trials(deepcopy=False)
        ended = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL,
                                                    TrialState.PRUNED)]
        pending = [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
        proposals: list[tuple[int, list]] = [
            (t.number, cells_of(FixedTrial(t.params, t.number))) for t in pending[:round_size]]
        room = min(round_size - len(proposals), block.n_configs - len(ended) - len(pending))
        for _ in range(max(0, room)):
            trial = ostudy.ask()
            cells = cells_of(trial)
            trial.set_user_attr("config_id", cells[0].config_id)
            proposals.append((trial.number, cells))
        if not proposals:
            return all_cells
        round_cells = [c for _, cells in proposals for c in cells]
        all_cells.extend(round_cells)
        run_round(round_cells)
        _tell(ostudy, proposals, tracking, study.objective.metric)


def _tell(ostudy, proposals: list[tuple[int, list]], tracking: StudyTracking,
          metric: str) -> None:
    """Tell Optuna each proposal's seed mean of `metric`, or FAIL when a cell did not finish."""
    from optuna.trial import TrialState

    states = tracking.cell_states([c.cell_id for _, cells in proposals for c in cells])
    for number, cells in proposals:
        values = [cell_objective(tracking, states[c.cell_id].run_id, metric)
                  for c in cells if states[c.cell_id].status == STATUS_FINISHED]
        finite = [v for v in values if v == v]
        if len(finite) == len(cells):
            ostudy.tell(number, sum(finite) / len(finite))
        else:
            ostudy.tell(number, state=TrialState.FAIL)
