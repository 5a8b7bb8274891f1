"""Sweeps and races on real training: the quickstart's model, three ways to pick an arm.

The model is `lab.demo`'s (`lab quickstart`: a two-layer MLP on a noisy linear target, its
`train` and `DemoConfig` imported as they are), ranked by its final ``val/loss`` (lower
better). A run's seed draws its training and validation sample and its initial weights, so
seed noise is real, and runs of one seed are paired across arms. The space
(`SPACE`: learning rate, width, batch size) holds arms that diverge, arms that barely move
in 300 steps, and a handful near the best that a few seeds cannot tell apart. For each
independent sweep seed s (`--sweeps`), into one SQLite store (or `--store`):

- (a) ``race``: ``Sweep(SPACE, sampler, arms=16, seed=s)`` raced,
  ``Race("val/loss", max_repeats=10)`` (the defaults: Friedman, alpha 0.05, min_repeats 2);
  it names the race's winner;
- (b) ``tpe``: ``Sweep(SPACE, sampler="tpe", arms=N, seed=s)`` with ``repeats=1``, N = the
  runs the race spent in that sweep (the same budget); it names the trial with the best value
  (every trial runs the experiment's seed, as a one-seed sweep does);
- (c) ``grid``: the same 16 sampled arms as (a) (the same sampler and seed), each run
  ``max_repeats`` times on the race's seeds, no race; it names the best mean among the arms
  whose runs all ended finite (an arm that diverged on a seed is not named best).

Each design's finalist then runs `--extra` (20) more repeats on fresh seeds that no
design selected on, all finalists on the same seeds (paired): the mean of those is the
finalist's *true* mean. Runs go to ``executor="processes"`` with `--workers` (2).

Prints one JSON line per design per sweep to stderr as it goes, and ends with one JSON line
on stdout holding per design the true means of its finalists and the runs it spent, over
the sweeps, the race's runs as a fraction of the grid's, and every design's line (`rows`).

    python bench/sweep_real.py                # 3 sweeps x (race, tpe, grid, finalists)
    python bench/sweep_real.py --quick        # 1 sweep of 4 arms x 3 repeats, 60 steps
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import log, machine

from lab import Arm, Experiment, Race, Sweep
from lab.demo import DemoConfig, train
from lab.records import ExperimentResult, RunResult
from lab.sweeps import Choice, Float, Int

METRIC = "val/loss"
SPACE = {
    "lr": Float(1e-3, 0.5, log=True),
    "hidden": Int(4, 128, log=True),
    "batch_size": Choice([8, 16, 32, 64, 128]),
}


def values(result: ExperimentResult) -> dict[str, list[float]]:
    """Each arm's final `METRIC` per run, in repeat order (NaN for a run without one)."""
    return {
        arm.name: [r.metrics.get(METRIC, math.nan) for r in sorted(arm.runs, key=by_repeat)]
        for arm in result.arms
    }


def by_repeat(run: RunResult) -> int:
    return run.repeat


def finite_mean(xs: list[float]) -> float:
    """The mean of `xs`, or inf when any is not finite (a diverged run rules its arm out)."""
    return statistics.fmean(xs) if xs and all(math.isfinite(x) for x in xs) else math.inf


def mean_se(xs: list[float]) -> tuple[float | None, float | None]:
    """The mean of the finite values of `xs` and its standard error, rounded."""
    finite = [x for x in xs if math.isfinite(x)]
    if len(finite) < 2:
        return (round(finite[0], 5) if finite else None), None
    return round(statistics.fmean(finite), 5), round(
        statistics.stdev(finite) / math.sqrt(len(finite)), 5
    )


@dataclass
class Measured:
    """An experiment's result and how long it ran."""

    result: ExperimentResult
    seconds: float


def run(name: str, args: argparse.Namespace, store: str, out: Path, **kw: Any) -> Measured:
    """Run one of the benchmark's experiments, on the quickstart's model and config; its
    result and wall seconds (progress to stderr)."""
    exp = Experiment(name, train, base_config=DemoConfig(steps=args.steps), store=store,
                     output_dir=out / name, executor="processes", workers=args.workers,
                     metric=METRIC, mode="min", fresh=True, **kw)  # fmt: skip
    started = time.perf_counter()
    result = exp.run()
    seconds = round(time.perf_counter() - started, 1)
    log(f"{name}: {len(result.runs)} runs in {seconds} s")
    return Measured(result, seconds)


@dataclass
class Pick:
    """A design's finalist: its arm, parameters, the value it was selected on, its runs."""

    design: str
    arm: str
    params: dict[str, Any]
    selected_on: float
    spent: Measured

    @property
    def key(self) -> str:
        """Its arm's name among the finalists (TPE's arms are another sweep's ``s000``...)."""
        return f"tpe-{self.arm}" if self.design == "tpe" else self.arm


def pick_best(design: str, spent: Measured, means: dict[str, float]) -> Pick:
    """The arm of `spent` with the lowest of `means`."""
    arm = min(means, key=means.__getitem__)
    params = next(a.overrides for a in spent.result.arms if a.name == arm)
    return Pick(design, arm, params, means[arm], spent)


def one_sweep(s: int, args: argparse.Namespace, store: str, out: Path) -> list[dict[str, Any]]:
    """The three designs over sweep seed `s`, and their finalists' true means."""
    seed = 1000 * s  # the designs' runs: seeds seed .. seed + max_repeats - 1
    sampled = Sweep(SPACE, sampler=args.sampler, arms=args.arms, seed=s)
    race = Race(METRIC, mode="min", max_repeats=args.max_repeats)
    raced = run(f"real{s}-race", args, store, out, seed=seed, sweep=sampled, race=race)
    winner = raced.result.race.winner if raced.result.race else None
    assert winner is not None, "the race named no winner"
    budget = len(raced.result.runs)  # (b) spends what (a) spent
    tpe_sweep = Sweep(SPACE, sampler="tpe", arms=budget, seed=s)
    tpe = run(f"real{s}-tpe", args, store, out, seed=seed, repeats=1, sweep=tpe_sweep)
    grid = run(f"real{s}-grid", args, store, out, seed=seed, repeats=args.max_repeats,
               sweep=sampled)  # fmt: skip
    params = {a.name: a.overrides for a in raced.result.arms}
    assert params == {a.name: a.overrides for a in grid.result.arms}, "(a), (c): other arms"
    grid_means = {arm: finite_mean(xs) for arm, xs in values(grid.result).items()}
    race_means = {arm: mean_se(xs)[0] for arm, xs in values(raced.result).items()}
    picks = [
        Pick("race", winner, params[winner], race_means[winner] or math.nan, raced),
        pick_best("tpe", tpe, {a: finite_mean(xs) for a, xs in values(tpe.result).items()}),
        pick_best("grid", grid, grid_means),
    ]
    # each finalist once (race and grid often agree), all on the same fresh seeds
    finalists = {p.key: p.params for p in picks}
    true = run(f"real{s}-true", args, store, out, seed=seed + 500, repeats=args.extra,
               arms=[Arm(key, **p) for key, p in finalists.items()])  # fmt: skip
    true_values = values(true.result)
    rank = sorted(grid_means, key=grid_means.__getitem__)
    rows = []
    for p in picks:
        xs = true_values[p.key]
        diffs = [x - r for x, r in zip(xs, true_values[picks[0].key], strict=True)]
        mean, se = mean_se(xs)
        diff, diff_se = mean_se(diffs)
        row = {
            "sweep": s,
            "design": p.design,
            "arm": p.arm,
            "params": {k: round(v, 5) if isinstance(v, float) else v for k, v in p.params.items()},
            "selected_on": round(p.selected_on, 5),
            "true_mean": mean,
            "true_se": se,
            "true_finite": sum(math.isfinite(x) for x in xs),
            "minus_race": diff,
            "minus_race_se": diff_se,
            "grid_rank": rank.index(p.arm) + 1 if p.design != "tpe" else None,
            "grid_best_mean": round(grid_means[rank[0]], 5),
            "runs": len(p.spent.result.runs),
            "s": p.spent.seconds,
            "true_runs": len(true.result.runs),
            "true_s": true.seconds,
        }
        log(json.dumps(row))
        rows.append(row)
    return rows


def spread(xs: list[float]) -> dict[str, float | None]:
    """Mean, standard deviation, min and max over the sweeps."""
    return {
        "mean": round(statistics.fmean(xs), 5),
        "sd": round(statistics.stdev(xs), 5) if len(xs) > 1 else None,
        "min": round(min(xs), 5),
        "max": round(max(xs), 5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweeps", type=int, default=3, help="independent sweep seeds")
    parser.add_argument("--arms", type=int, default=16)
    parser.add_argument("--max-repeats", type=int, default=10)
    parser.add_argument("--extra", type=int, default=20, help="fresh repeats per finalist")
    parser.add_argument("--steps", type=int, default=300, help="the quickstart's 300")
    parser.add_argument("--sampler", default="random", choices=["random", "sobol"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--store", default=None, help="a store URL (default: a SQLite file)")
    parser.add_argument("--quick", action="store_true", help="1 sweep, 4 arms x 3, 60 steps")
    args = parser.parse_args()
    if args.quick:
        args.sweeps, args.arms, args.max_repeats, args.extra, args.steps = 1, 4, 3, 3, 60
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store or f"sqlite:///{Path(tmp) / 'lab.db'}"
        rows = [row for s in range(args.sweeps) for row in one_sweep(s, args, store, Path(tmp))]
    designs = ("race", "tpe", "grid")
    by = {d: [r for r in rows if r["design"] == d] for d in designs}
    pairs = list(zip(by["race"], by["grid"], strict=True))
    fraction = [r["runs"] / g["runs"] for r, g in pairs]
    print(json.dumps({
        "sweeps": args.sweeps,
        "arms": args.arms,
        "max_repeats": args.max_repeats,
        "extra": args.extra,
        "steps": args.steps,
        "sampler": args.sampler,
        "true_mean": {d: [r["true_mean"] for r in by[d]] for d in designs},
        "true_mean_spread": {d: spread([r["true_mean"] for r in by[d]]) for d in designs},
        "true_finite": {d: [r["true_finite"] for r in by[d]] for d in designs},
        "minus_race": {d: [r["minus_race"] for r in by[d]] for d in ("tpe", "grid")},
        "runs": {d: [r["runs"] for r in by[d]] for d in designs},
        "race_runs_fraction": [round(f, 4) for f in fraction],
        "race_runs_fraction_mean": round(statistics.fmean(fraction), 4),
        "same_arm_race_grid": sum(r["arm"] == g["arm"] for r, g in pairs),
        "rows": rows,
        "machine": machine(workers=args.workers),
        "s": round(time.perf_counter() - started, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
