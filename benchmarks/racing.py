"""Racing against a fixed 10-seed study on simulated per-seed results.

Each simulated study has configs with known true means; a cell's value is
    x_{c,s} = mu_c + u_s + e_{c,s},  u_s ~ N(0, tau^2) (the seed's effect, shared by every config:
                                    the data order and initialisation), e_{c,s} ~ N(0, sigma^2).
The fixed study runs every config on seeds 0..9 and calls a config significantly worse than the
best (best mean over 10 seeds) when the paired t-test against it, Holm-corrected over the other
configs, gives p < 0.05 (the report's comparison). The race (`studies.scheduling.racing.SeedRace`,
initial 3, max 10) runs the same values with 8 trials at a time, completing them in a random
order (asynchronous rounds). Printed per scenario, over `--studies` simulated studies (seeded):
the seeds used against the fixed study's, how often the race picks the fixed study's best
config (and the true best), and how often its set of configs stopped as worse equals the fixed
study's set of significantly worse configs (and the mean Jaccard index of the two sets).

    python benchmarks/racing.py [--studies 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scipy import stats as sps

from analysis.stats import holm
from studies.scheduling.racing import WORSE, SeedRace, run_simulated_race

MAX_SEEDS, INITIAL, WORKERS = 10, 3, 8

#: name -> (true means, sigma, tau)
SCENARIOS = {
    "one clear winner (5 configs)": ([0.80, 0.77, 0.765, 0.76, 0.75], 0.01, 0.01),
    "close configs (5, within 1 sigma)": ([0.800, 0.797, 0.795, 0.793, 0.790], 0.01, 0.01),
    "many configs (40, spread 0.70-0.80)": (list(np.linspace(0.80, 0.70, 40)), 0.01, 0.01),
    "identical configs (5)": ([0.80] * 5, 0.01, 0.01),
}


def fixed_study(x: np.ndarray) -> tuple[int, set[int]]:
    """(best config, configs significantly worse than it) over all seeds."""
    best = int(np.argmax(x.mean(axis=1)))
    others = [c for c in range(x.shape[0]) if c != best]
    p = [sps.ttest_rel(x[c], x[best]).pvalue for c in others]
    adjusted = holm(p)
    return best, {c for c, q in zip(others, adjusted) if q < 0.05 and x[c].mean() < x[best].mean()}


def race_study(x: np.ndarray, rng: np.random.Generator) -> tuple[int, set[int], int]:
    """(best config, configs stopped as worse, cells run) of a race over the same values."""
    ids = [str(c) for c in range(x.shape[0])]
    race = SeedRace(ids, list(range(MAX_SEEDS)), initial=INITIAL)
    cells = run_simulated_race(race, WORKERS, lambda config_id, seed: float(x[int(config_id), seed]), rng)
    assert race.is_over()
    standing = [c for c in range(x.shape[0]) if race.state(ids[c]) != WORSE]
    means = {c: x[c, : race.status(ids[c]).seeds].mean() for c in standing}
    best = max(means, key=means.get)
    return best, {c for c in range(x.shape[0]) if race.state(ids[c]) == WORSE}, cells


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--studies", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(
        f"{args.studies} simulated studies per scenario; race: initial {INITIAL}, max {MAX_SEEDS}, "
        f"{WORKERS} trials at a time; fixed: {MAX_SEEDS} seeds per config\n"
    )
    header = ("scenario", "seeds used", "same best", "true best (race / fixed)", "same worse set", "Jaccard")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, (means, sigma, tau) in SCENARIOS.items():
        rng = np.random.default_rng(args.seed)
        means = np.asarray(means)
        used, same_best, true_race, true_fixed, same_set, jaccard = 0, 0, 0, 0, 0, []
        for _ in range(args.studies):
            x = means[:, None] + rng.normal(0, tau, MAX_SEEDS)[None, :] + rng.normal(0, sigma, (means.size, MAX_SEEDS))
            f_best, f_worse = fixed_study(x)
            r_best, r_worse, cells = race_study(x, rng)
            used += cells
            same_best += r_best == f_best
            true_race += r_best == int(np.argmax(means))
            true_fixed += f_best == int(np.argmax(means))
            same_set += r_worse == f_worse
            union = r_worse | f_worse
            jaccard.append(len(r_worse & f_worse) / len(union) if union else 1.0)
        n = args.studies
        fixed_cells = n * means.size * MAX_SEEDS
        print(
            f"| {name} | {used / fixed_cells:.0%} ({used / n:.1f} of {means.size * MAX_SEEDS}) | "
            f"{same_best / n:.0%} | {true_race / n:.0%} / {true_fixed / n:.0%} | "
            f"{same_set / n:.0%} | {np.mean(jaccard):.2f} |"
        )


if __name__ == "__main__":
    main()
