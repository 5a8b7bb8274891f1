"""A race against the full design, on simulated sweeps whose truth is known.

Each sweep has 16 arms: the best with true mean 0, the 15 others worse by gaps spread evenly
from 0.5 to 2 noise standard deviations (`--gap-low`, `--gap-high`), lower better. A "run"
of arm a, repeat r in sweep s ends with value = mean(a) + noise, the noise a standard normal
drawn from ``random.Random(f"{s}:{a}:{r}")``: the race and the full design see the same
runs. The full design runs every arm `max_repeats` times and names the best sample mean;
the race is `lab.sweeps.RaceState` itself, fed round by round. Over `--sweeps` sweeps:

- ``race_best_rate``, ``full_best_rate``: how often each names the truly best arm;
- ``race_runs_fraction``: the race's runs over the full design's (16 x max_repeats);
- ``true_best_eliminated_rate``: how often the race dropped the truly best arm;
- ``oracle_runs_fraction``: a floor for the runs fraction, the runs of a race that knows the
  noise's std and which arm is best and tests each arm at alpha with no correction.

Each figure comes with its spread: a rate's binomial standard error, and the runs'
10th/50th/90th percentiles over the sweeps. Both tests are run (``per_test``), and a grid of
settings (`settings`: alpha, min_repeats) shows what each trades. The figures are exact
functions of the arguments (no clock): any machine prints the same.

Prints JSON: one line per setting to stderr as it goes, and ends with one JSON line on
stdout whose top level is the default Race's figures.

    python bench/race.py            # 200 sweeps, both tests, the settings grid (~30 s)
    python bench/race.py --quick    # 40 sweeps, both tests, no grid (a few seconds)
    python bench/race.py --max-repeats 50   # a full design of 50 repeats an arm
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import time
from typing import Any

from _common import log

from lab.sweeps import Race, RaceState

ARMS = 16


def true_means(gap_low: float, gap_high: float) -> dict[str, float]:
    """The arms' true means: a00 the best at 0, the others gap_low..gap_high worse."""
    step = (gap_high - gap_low) / (ARMS - 2)
    return {f"a{i:02d}": 0.0 if i == 0 else gap_low + (i - 1) * step for i in range(ARMS)}


def run_value(means: dict[str, float], sweep: int, arm: str, repeat: int) -> float:
    """One simulated run: the arm's true mean plus seeded standard normal noise."""
    return means[arm] + random.Random(f"{sweep}:{arm}:{repeat}").gauss(0.0, 1.0)


def full_design(means: dict[str, float], sweep: int, repeats: int) -> str:
    """Every arm `repeats` times; the best sample mean (the first on a tie)."""
    return min(
        means, key=lambda a: math.fsum(run_value(means, sweep, a, r) for r in range(repeats))
    )


def race_once(race: Race, means: dict[str, float], sweep: int) -> tuple[str | None, int, bool]:
    """The race over one sweep: (its winner, runs spent, whether it dropped the true best)."""
    state = RaceState(race, list(means))
    while not state.over():
        for arm in state.next_round():
            state.record(arm, state.round, run_value(means, sweep, arm, state.round))
        state.close_round()
    best = min(means, key=lambda a: means[a])
    return state.winner(), state.spent, any(e.arm == best for e in state.eliminations)


def oracle_runs(
    means: dict[str, float], sweep: int, alpha: float, min_repeats: int, max_repeats: int
) -> int:
    """The runs of a race that knows what no test knows, the noise's std (1) and which arm
    is truly best: each other arm runs until its mean exceeds the best's by more than the
    one-sided z quantile of `alpha` (no correction for the 15 arms nor for the rounds), the
    best until the last other stops. No valid test at that level can expect to spend much
    less: it is a floor for `race_runs_fraction`."""
    z = statistics.NormalDist().inv_cdf(1.0 - alpha)
    best = min(means, key=lambda a: means[a])
    first = [run_value(means, sweep, best, r) for r in range(max_repeats)]
    total, longest = 0, min_repeats
    for arm in means:
        if arm == best:
            continue
        gap = 0.0
        for n in range(1, max_repeats + 1):
            gap += run_value(means, sweep, arm, n - 1) - first[n - 1]
            if n >= min_repeats and gap / n * math.sqrt(n / 2.0) > z:
                break
        total, longest = total + n, max(longest, n)
    return total + longest


def _rate(hits: int, n: int) -> dict[str, float]:
    p = hits / n
    return {"rate": round(p, 4), "se": round(math.sqrt(p * (1 - p) / n), 4)}


def measure(race: Race, means: dict[str, float], sweeps: int, full: list[str]) -> dict[str, Any]:
    """The race's figures over `sweeps` sweeps, against the full design's winners `full`."""
    best = min(means, key=lambda a: means[a])
    wins = spent = dropped = 0
    runs = []
    for sweep in range(sweeps):
        winner, used, lost = race_once(race, means, sweep)
        wins += winner == best
        dropped += lost
        runs.append(used)
    spent = sum(runs)
    total = ARMS * race.max_repeats
    oracle = sum(
        oracle_runs(means, s, race.alpha, race.min_repeats, race.max_repeats) for s in range(sweeps)
    )
    deciles = statistics.quantiles(runs, n=10, method="inclusive")
    return {
        "test": race.test,
        "alpha": race.alpha,
        "min_repeats": race.min_repeats,
        "max_repeats": race.max_repeats,
        "race_best_rate": round(wins / sweeps, 4),
        "full_best_rate": round(sum(w == best for w in full) / sweeps, 4),
        "race_runs_fraction": round(spent / (sweeps * total), 4),
        "true_best_eliminated_rate": round(dropped / sweeps, 4),
        "oracle_runs_fraction": round(oracle / (sweeps * total), 4),
        "spread": {
            "race_best": _rate(wins, sweeps),
            "full_best": _rate(sum(w == best for w in full), sweeps),
            "true_best_eliminated": _rate(dropped, sweeps),
            "runs_p10_p50_p90": [deciles[0], statistics.median(runs), deciles[-1]],
            "full_runs": total,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweeps", type=int, default=200)
    parser.add_argument("--gap-low", type=float, default=0.5, help="in noise std")
    parser.add_argument("--gap-high", type=float, default=2.0, help="in noise std")
    parser.add_argument("--quick", action="store_true", help="40 sweeps, no settings grid")
    parser.add_argument(
        "--max-repeats", type=int, default=Race("value").max_repeats,
        help="the full design's repeats, and the race's last round (default: Race's)",
    )  # fmt: skip
    args = parser.parse_args()
    sweeps = 40 if args.quick else args.sweeps
    means = true_means(args.gap_low, args.gap_high)
    started = time.perf_counter()
    default = Race("value", max_repeats=args.max_repeats)
    full = [full_design(means, s, default.max_repeats) for s in range(sweeps)]
    per_test = {}
    for test in ("friedman", "t"):
        race = Race("value", test=test, max_repeats=args.max_repeats)
        per_test[test] = measure(race, means, sweeps, full)
        log(json.dumps(per_test[test]))
    settings = []
    if not args.quick:
        for test in ("friedman", "t"):
            for alpha in (0.01, 0.05, 0.1, 0.2):
                for min_repeats in (2, 3, 5):
                    race = Race("value", test=test, alpha=alpha, min_repeats=min_repeats,
                                max_repeats=args.max_repeats)  # fmt: skip
                    row = measure(race, means, sweeps, full)
                    del row["spread"]
                    settings.append(row)
                    log(json.dumps(row))
    top = {k: v for k, v in per_test[default.test].items() if k != "spread"}
    print(json.dumps({
        **top,
        "sweeps": sweeps,
        "arms": ARMS,
        "gaps": [args.gap_low, args.gap_high],
        "spread": per_test[default.test]["spread"],
        "per_test": per_test,
        "settings": settings,
        "python": platform.python_version(),
        "s": round(time.perf_counter() - started, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
