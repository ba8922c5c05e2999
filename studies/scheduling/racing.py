"""Racing: seeds where they decide the comparison (a study's ``seeds: {initial, max, until}``).

`SeedRace` is the rule, plain Python (no Ray, no MLflow). Every config starts with the first
``initial`` seeds of one shared sequence, so that all comparisons stay paired by seed; a
config whose seeds are all finished ("at its round boundary") is decided against the current
best config:

- the *contenders* are the configs still racing or stopped at ``max`` seeds that have
  finished their initial round; the *best* is the contender with the best mean of the race
  metric over its own finished seeds (ties: the first in study order);
- for every other config c still racing, the paired differences d_i = x_{c,i} - x_{best,i}
  over the seeds both have finished (a prefix of the sequence) give a paired t-test
  (`analysis.stats.paired_test`'s statistic, computed for all configs at once: t = mean(d) /
  (sd(d) / sqrt(n)), n - 1 degrees of freedom, two-sided p); a config with fewer than two common
  seeds, or whose differences are all equal (sd 0: the report's degenerate test), has no test:
  it counts with p = 1 and stays outside Holm's family, as in the report;
- Holm's step-down correction (`analysis.stats.holm`) is applied over those tests, one per
  config still racing (the family: the configs still in the race);
- c *stops, worse than best* when its Holm-adjusted p < 1 - level and its mean difference
  is worse: the (1 - alpha) interval of the paired difference excludes 0 on the wrong side;
- otherwise c gets the next ``step`` seeds, or stops at ``max`` seeds ("max seeds reached":
  still undecided against the best);
- the best *stops as clearly the best* once no other config is left racing or undecided at
  ``max``: every other config was stopped as significantly worse than the best of its time;
- a config with a failed seed stops ("failed"): its seeds would no longer be paired.

There is no barrier between configs: a config's next seed is decided when its own round
has finished and a slot asks for work (`next_cells`), on the data of that moment. Cells are
offered round by round (the initial rounds of all configs first, config by config, so that
early stopping finds a config's initial seeds running together), then the next round;
`take_array` hands out up to N seeds of a config's round at once (a fused array,
``resources.seeds_per_trial``).
Decisions to stop are final (sticky); the driver records them in MLflow (`TAG_RACE` on the
config's last finished run) so that a resumed study keeps them (`studies.scheduling.race_driver`).

The statistics are those of the report (`analysis.stats`), so a race stops a config exactly
when the report's paired comparison with the best, on the same seeds and Holm family, would
call it significantly worse.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.stats import t as _t_dist

from analysis.stats import holm

RACING = "racing"
WORSE = "worse than best"
BEST = "best"
MAX = "max seeds reached"
FAILED = "failed"
#: every state a config can be in; all but RACING are final
STATES = (RACING, WORSE, BEST, MAX, FAILED)


@dataclass(frozen=True)
class RaceStatus:
    """Where a config stands: finished seeds, state, a sentence saying why, the Holm p."""

    seeds: int
    state: str
    reason: str = ""
    p_holm: float | None = None
    best: str | None = None  # the config it was compared with

    def to_json(self, max_seeds: int) -> str:
        """The MLflow tag value (`TAG_RACE`) of a final decision."""
        return json.dumps(
            {
                "state": self.state,
                "seeds": self.seeds,
                "max": max_seeds,
                "reason": self.reason,
                "p_holm": self.p_holm,
                "best": self.best,
            },
            sort_keys=True,
        )


class SeedRace:
    """The racing rule over `config_ids` (study order) and the shared `seeds` sequence.

    `initial`: seeds every config starts with (>= 2: a paired test needs two); `len(seeds)`
    is the most a config gets; `step`: seeds added per round; `mode`: 'max' or 'min' (which
    mean is better); `level`: the confidence level of the intervals (0.95: alpha = 0.05).
    """

    def __init__(
        self,
        config_ids: Sequence[str],
        seeds: Sequence[int],
        initial: int,
        step: int = 1,
        mode: str = "max",
        level: float = 0.95,
    ):
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        if not 2 <= initial <= len(seeds):
            raise ValueError(f"initial must be between 2 and {len(seeds)} (the seeds), got {initial}")
        if step < 1:
            raise ValueError(f"step must be >= 1, got {step}")
        if not 0 < level < 1:
            raise ValueError(f"level must be in (0, 1), got {level}")
        self.config_ids = list(dict.fromkeys(config_ids))
        self.order = {c: i for i, c in enumerate(self.config_ids)}
        self.seeds = [int(s) for s in seeds]
        self.index = {s: i for i, s in enumerate(self.seeds)}
        self.initial, self.step, self.mode, self.level = int(initial), int(step), mode, float(level)
        n, m = len(self.config_ids), len(self.seeds)
        self.values = np.full((n, m), np.nan)  # finished values, by (config, seed index)
        self.finished = np.zeros((n, m), dtype=bool)
        self.started = np.zeros((n, m), dtype=bool)
        self.failed = np.zeros((n, m), dtype=bool)
        self.allowed = np.full(n, self.initial)  # seeds committed to each config
        self.states: dict[str, RaceStatus] = {}  # final decisions only
        self.new_decisions: list[str] = []  # configs decided since `pop_decisions`
        self._dirty = True
        self._offer: list[tuple[str, int]] = []

    # ----- what the driver tells the race -------------------------------------------------------

    @property
    def max_seeds(self) -> int:
        return len(self.seeds)

    def _at(self, config_id: str, seed: int) -> tuple[int, int]:
        if config_id not in self.order:
            raise KeyError(f"unknown config {config_id!r}")
        if int(seed) not in self.index:
            raise KeyError(f"seed {seed} is not in the race's sequence {self.seeds}")
        return self.order[config_id], self.index[int(seed)]

    def mark_started(self, config_id: str, seed: int) -> None:
        """The cell was handed to a trial (or is in flight from an earlier session)."""
        c, i = self._at(config_id, seed)
        self.started[c, i] = True
        self.allowed[c] = max(self.allowed[c], i + 1)
        self._dirty = True

    def commit(self, config_id: str, seed: int) -> None:
        """The config runs this seed (and those before it): an earlier session started it."""
        c, i = self._at(config_id, seed)
        self.allowed[c] = max(self.allowed[c], i + 1)
        self._dirty = True

    def record(self, config_id: str, seed: int, value: float) -> None:
        """A finished cell's value of the race metric; NaN counts as a failed seed."""
        c, i = self._at(config_id, seed)
        if not math.isfinite(value):
            self.fail(config_id, seed, "no finite value of the race metric")
            return
        self.values[c, i] = float(value)
        self.finished[c, i] = self.started[c, i] = True
        self.allowed[c] = max(self.allowed[c], i + 1)
        self._dirty = True

    def fail(self, config_id: str, seed: int, error: str = "") -> None:
        """A seed whose cell failed: its config stops (its seeds would no longer pair)."""
        c, i = self._at(config_id, seed)
        self.started[c, i] = self.failed[c, i] = True
        if self.states.get(config_id, RaceStatus(0, RACING)).state == RACING:
            self._decide(
                config_id, RaceStatus(self._done(c), FAILED, f"seed {seed} failed" + (f": {error}" if error else ""))
            )
        self._dirty = True

    def restore(self, config_id: str, status: RaceStatus) -> None:
        """A final decision read back from MLflow (a resumed study keeps it)."""
        if status.state not in STATES or status.state == RACING:
            raise ValueError(f"not a final race state: {status.state!r}")
        self._at(config_id, self.seeds[0])
        self.states[config_id] = status
        self._dirty = True

    # ----- what the race says -------------------------------------------------------------------

    def _done(self, c: int) -> int:
        """Seeds of config index c finished without a gap from the start of the sequence."""
        row = self.finished[c]
        return int(row.argmin()) if not row.all() else len(row)

    def state(self, config_id: str) -> str:
        return self.status(config_id).state

    def status(self, config_id: str) -> RaceStatus:
        """(seeds finished, state, reason, Holm p, best) of a config."""
        self._evaluate()
        c = self.order[config_id]
        if config_id in self.states:
            return self.states[config_id]
        return RaceStatus(self._done(c), RACING, "still undecided against the best")

    def is_over(self) -> bool:
        """Every config has a final state."""
        self._evaluate()
        return len(self.states) == len(self.config_ids)

    def next_cells(self) -> list[tuple[str, int]]:
        """The (config_id, seed) cells that may start now, in the order to start them."""
        self._evaluate()
        return list(self._offer)

    def take(self) -> tuple[str, int] | None:
        """The first cell of `next_cells`, marked started; None when none may start now."""
        offer = self.next_cells()
        if not offer:
            return None
        self._take(*offer[0])
        return offer[0]

    def take_array(self, limit: int) -> list[tuple[str, int]]:
        """The first cell of `next_cells` and, after it, up to `limit` - 1 more cells of its
        config that the race asks for now (the rest of its round), each marked started: the
        members of one fused array (``resources.seeds_per_trial``); [] when none may start."""
        first = self.take()
        if first is None:
            return []
        taken = [first]
        while len(taken) < limit:
            more = next((cell for cell in self.next_cells() if cell[0] == first[0]), None)
            if more is None:
                break
            self._take(*more)
            taken.append(more)
        return taken

    def _take(self, config_id: str, seed: int) -> None:
        """Mark an offered cell started; the first of a new round commits the round's seeds."""
        c, i = self._at(config_id, seed)
        if i >= self.allowed[c]:  # a new round: commit its `step` seeds
            self.allowed[c] = min(self._done(c) + self.step, self.max_seeds)
        self.mark_started(config_id, seed)

    def in_flight(self) -> int:
        """Cells started and neither finished nor failed yet."""
        return int((self.started & ~self.finished & ~self.failed).sum())

    def upper_bound_left(self) -> int:
        """The most cells that may still start: every seed up to `max` of the racing configs."""
        self._evaluate()
        racing = [self.order[c] for c in self.config_ids if c not in self.states]
        return int((~self.started[racing]).sum()) if racing else 0

    def pop_decisions(self) -> list[tuple[str, RaceStatus]]:
        """The final decisions taken since the last call (for the driver to record)."""
        self._evaluate()
        out = [(c, self.states[c]) for c in self.new_decisions]
        self.new_decisions = []
        return out

    def summary(self) -> str:
        """'R racing, W worse, B best, M at max, F failed' (the progress line)."""
        self._evaluate()
        counts = {state: 0 for state in STATES}
        for config_id in self.config_ids:
            counts[self.states[config_id].state if config_id in self.states else RACING] += 1
        names = {RACING: "racing", WORSE: "worse", BEST: "best", MAX: "at max", FAILED: "failed"}
        return ", ".join(f"{counts[s]} {names[s]}" for s in STATES if counts[s])

    # ----- the rule ------------------------------------------------------------------------------

    def _decide(self, config_id: str, status: RaceStatus) -> None:
        self.states[config_id] = status
        self.new_decisions.append(config_id)

    def _score(self) -> np.ndarray:
        """Values with larger = better."""
        return self.values if self.mode == "max" else -self.values

    def _evaluate(self) -> None:
        """Decide the configs at their round boundary and list the cells to offer (see the
        module docstring); only when something changed since the last evaluation. Vectorised
        over configs: a study of 10,000 configs evaluates in milliseconds."""
        if not self._dirty:
            return
        self._dirty = False
        m = self.values.shape[1]
        done = np.where(self.finished.all(axis=1), m, self.finished.argmin(axis=1))
        idle = ~(self.started & ~self.finished & ~self.failed).any(axis=1)
        state = [self.states[c].state if c in self.states else RACING for c in self.config_ids]
        racing = np.array([s == RACING for s in state], dtype=bool)
        boundary = racing & idle & (done >= self.allowed)
        standing = racing | np.array([s in (MAX, BEST) for s in state], dtype=bool)
        score = self._score()
        best = self._leader(standing, done, score)
        self._decide_against_best(racing, boundary, best, done, score)
        if best is not None and racing[best] and boundary[best]:
            self._decide_best(racing, best, done)
        self._offer = self._cells_to_offer(racing, boundary, done)

    def _leader(self, standing: np.ndarray, done: np.ndarray, score: np.ndarray) -> int | None:
        """The standing config with at least `initial` seeds done whose mean score over them is
        the best (the first of ties); None when there is none."""
        contenders = np.flatnonzero(standing & (done >= self.initial))
        if not contenders.size:
            return None
        m = self.values.shape[1]
        sums = np.where(np.arange(m)[None, :] < done[contenders, None], score[contenders], 0.0)
        means = sums.sum(axis=1) / done[contenders]
        return int(contenders[int(np.argmax(means))])  # argmax: the first of ties

    def _decide_against_best(
        self, racing: np.ndarray, boundary: np.ndarray, best: int | None, done: np.ndarray, score: np.ndarray
    ) -> None:
        """Every other racing config at its round boundary: WORSE when significantly worse than
        the best (Holm over them all), MAX at the most seeds; `racing` updated."""
        others = np.flatnonzero(racing)
        others = others[others != best] if best is not None else others
        p_raw, diffs, common = self._paired_against(others, best, done, score)
        # a config with no test (NaN: fewer than two common seeds, or all differences equal)
        # is outside Holm's family, as in the report, and counts as no evidence (p = 1)
        p_adj = np.nan_to_num(holm(p_raw), nan=1.0) if others.size else np.array([])
        best_id = self.config_ids[best] if best is not None else None
        alpha = 1.0 - self.level
        for c, p, diff, k in zip(others, p_adj, diffs, common):
            if not boundary[c]:
                continue
            config_id, p = self.config_ids[c], float(p)
            if p < alpha and diff < 0:
                self._decide(
                    config_id,
                    RaceStatus(
                        int(done[c]),
                        WORSE,
                        f"worse than best on {int(k)} paired seeds "
                        f"(mean difference {self._signed(diff):.4g}, Holm p={p:.3g})",
                        p,
                        best_id,
                    ),
                )
                racing[c] = False
            elif done[c] >= self.max_seeds:
                self._decide(
                    config_id,
                    RaceStatus(
                        int(done[c]),
                        MAX,
                        f"undecided against the best after {int(done[c])} seeds (Holm p={p:.3g})"
                        if best_id
                        else "no config to compare with",
                        p,
                        best_id,
                    ),
                )
                racing[c] = False

    def _decide_best(self, racing: np.ndarray, best: int, done: np.ndarray) -> None:
        """The best config at its round boundary: BEST when every other config stopped as
        worse, MAX at the most seeds; `racing` updated."""
        best_id = self.config_ids[best]
        left = [
            c
            for c in range(len(self.config_ids))
            if c != best and (self.config_ids[c] not in self.states or self.states[self.config_ids[c]].state == MAX)
        ]
        if not left:
            self._decide(
                best_id,
                RaceStatus(
                    int(done[best]),
                    BEST,
                    "clearly the best: every other config stopped as significantly worse than the best of its time",
                    None,
                    best_id,
                ),
            )
            racing[best] = False
        elif done[best] >= self.max_seeds:
            self._decide(
                best_id,
                RaceStatus(
                    int(done[best]),
                    MAX,
                    f"the best after {int(done[best])} seeds, not significantly better than every other config",
                    None,
                    best_id,
                ),
            )
            racing[best] = False

    def _cells_to_offer(self, racing: np.ndarray, boundary: np.ndarray, done: np.ndarray) -> list[tuple[str, int]]:
        """The cells to offer, by round, config and seed: those committed and not started,
        then a new round of each racing config at its boundary."""
        m = self.values.shape[1]
        index = np.arange(m)[None, :]
        committed = racing[:, None] & (index < self.allowed[:, None]) & ~self.started
        fresh = (
            (racing & boundary & (done < self.max_seeds) & ~committed.any(axis=1))[:, None]
            & (index >= done[:, None])
            & (index < np.minimum(done + self.step, m)[:, None])
        )
        configs, seeds = np.nonzero(committed | fresh)
        rounds = np.where(seeds < self.initial, 0, 1 + (seeds - self.initial) // self.step)
        order = np.lexsort((seeds, configs, rounds))
        return [(self.config_ids[configs[j]], self.seeds[seeds[j]]) for j in order]

    def _paired_against(
        self, others: np.ndarray, best: int | None, done: np.ndarray, score: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(two-sided p, mean difference, common seeds) of the paired t-test of each config of
        `others` against `best` over the seeds both finished: `analysis.stats.paired_test`'s
        statistic for every config at once. No test (p NaN) with fewer than two common seeds or
        with all differences equal (sd 0, the report's degenerate test: t = mean / 0 is no
        evidence, never p = 0)."""
        if best is None or not others.size:
            n = others.size
            return np.full(n, np.nan), np.full(n, np.nan), np.zeros(n, dtype=int)
        k = np.minimum(done[others], done[best])
        mask = np.arange(score.shape[1])[None, :] < k[:, None]
        with np.errstate(invalid="ignore", divide="ignore"):
            d = np.where(mask, score[others] - score[best][None, :], 0.0)
            mean = d.sum(axis=1) / k
            var = (np.where(mask, d - mean[:, None], 0.0) ** 2).sum(axis=1) / (k - 1)
            t = mean / np.sqrt(var / k)
            p = 2.0 * _t_dist.sf(np.abs(t), np.maximum(k - 1, 1))
            degenerate = np.sqrt(var) <= 1e-12 * np.maximum(1.0, np.abs(mean))  # as analysis.intervals
        p = np.where((k >= 2) & np.isfinite(p) & ~degenerate, p, np.nan)
        return p, np.where(k >= 1, mean, np.nan), k

    def _signed(self, diff: float) -> float:
        """A difference of scores back in the metric's direction."""
        return diff if self.mode == "max" else -diff


def seed_round(index: int, initial: int, step: int) -> int:
    """The round of the seed at `index` of a race's sequence: 0 for the `initial` seeds, then
    one round per `step` seeds (the seeds a config is given at once)."""
    return 0 if index < initial else 1 + (index - initial) // step


def race_rounds(study: Any) -> Callable[[Any], int] | None:
    """A racing study's round of a cell (by its seed's place in the seed list), for cutting
    fused arrays inside rounds (`studies.cells.arrays.fused_arrays`); None without racing."""
    racing = getattr(study, "racing", None)
    if racing is None:
        return None
    order = {int(seed): i for i, seed in enumerate(study.seed_list)}
    return lambda cell: seed_round(order[int(cell.seed)], int(racing.initial), int(racing.step))


def run_simulated_race(race: SeedRace, slots: int, value: Callable[[str, int], float], rng: np.random.Generator) -> int:
    """Run `race` to its end as the runner would with `slots` trial slots: each free slot takes
    the race's next cell, and the running cells end in random order, `value(config_id, seed)`
    being a cell's result. Returns the number of cells run (`studies plan`'s expected seeds,
    benchmarks/racing.py)."""
    running: list[tuple[str, int]] = []
    cells = 0
    while True:
        while len(running) < slots:
            taken = race.take()
            if taken is None:
                break
            running.append(taken)
        if not running:
            return cells
        config_id, seed = running.pop(int(rng.integers(len(running))))
        race.record(config_id, seed, value(config_id, seed))
        cells += 1
