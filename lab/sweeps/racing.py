"""Races over repeats: run arms in rounds of one paired repeat each, and drop an arm as soon
as a test says it cannot be the best (F-race, irace).

Round r runs repeat r (seed = experiment seed + r) of every surviving arm, so the arms'
values in a round form one block, paired by seed. Once every survivor has `min_repeats`
values, each round ends with a test of every survivor against the best:

- ``"friedman"``: the Friedman test (ties averaged) over the survivors and the blocks so far;
  if its p < alpha, Conover's post-hoc comparison of each arm with the best by rank sum,
  Holm-corrected over the k - 1 comparisons. With two survivors the Friedman test is itself
  the one comparison (its chi-square on 1 df is the sign test's): no post-hoc.
- ``"t"``: the paired t test of each arm against the best by mean, Holm-corrected.

An arm whose corrected p < alpha is dropped. The race ends when one arm survives, after round
max_repeats - 1, or when the next round would spend more than `budget` runs in all (a round is
never cut short: its comparisons would lose their pairs).

A failed or pruned run (value None, or a value that is not finite) counts as the worst
result of its round: it ranks below every value of its block (failed runs tie with each
other), and the t test and the means take the worst value the survivors reached in that
block. A block where every survivor failed says nothing and is left out. So an arm that keeps
failing is dropped like one that keeps losing, and no other arm loses a block for it.

`RaceState` is the whole race logic, and no I/O: the engine feeds it the values its runs end
with, and `bench/race.py` the values of a simulation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lab._stats import conover_against_best, friedman, holm, paired_t
from lab.errors import ConfigError

Mode = Literal["min", "max"]
Test = Literal["friedman", "t"]
TESTS = ("friedman", "t")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Race:
    """How to race arms over repeats: the metric that decides, the test and its level, and
    how many repeats an arm gets at least and at most."""

    metric: str
    mode: Mode = "min"
    alpha: float = 0.05
    min_repeats: int = 2  # no test before every survivor has this many
    max_repeats: int = 10  # the last round is max_repeats - 1
    test: Test = "friedman"  # bench/race.py: fewer runs than "t" at the same accuracy
    budget: int | None = None  # at most this many runs in all (None: no cap)

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(
                f"Race(metric={self.metric!r}): name the metric the arms are compared on, "
                "e.g. Race('val/loss')"
            )
        if self.mode not in ("min", "max"):
            raise ConfigError(
                f"Race(mode={self.mode!r}): use 'min' (lower is better, e.g. a loss) or "
                "'max' (higher is better, e.g. an accuracy)"
            )
        alpha = self.alpha
        if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not 0 < alpha < 1:
            raise ConfigError(
                f"Race(alpha={alpha!r}): use a level strictly between 0 and 1, e.g. 0.05"
            )
        if not _count(self.min_repeats) or self.min_repeats < 2:
            raise ConfigError(
                f"Race(min_repeats={self.min_repeats!r}): use an int >= 2 (a paired test "
                "needs two repeats of each arm)"
            )
        if not _count(self.max_repeats) or self.max_repeats < self.min_repeats:
            raise ConfigError(
                f"Race(max_repeats={self.max_repeats!r}): use an int >= min_repeats "
                f"({self.min_repeats})"
            )
        if self.test not in TESTS:
            raise ConfigError(
                f"Race(test={self.test!r}): use 'friedman' (ranks, as F-race) or 't' "
                "(the paired t test)"
            )
        if self.budget is not None and (not _count(self.budget) or self.budget < 1):
            raise ConfigError(
                f"Race(budget={self.budget!r}): use an int >= 1 (runs in all), or None for no cap"
            )


@dataclass(frozen=True)
class Elimination:
    """One arm dropped from a race, with the evidence."""

    arm: str
    round: int  # 0-based round after which it was dropped
    test: str  # "friedman" | "t"
    statistic: float  # of this arm against the best (Conover's t, the t, or for two
    # Friedman survivors the chi-square); positive: worse than the best
    p_value: float  # Holm-corrected: the figure compared with alpha
    best: str  # the arm it was compared with


def _oriented(value: float | None, mode: Mode) -> float | None:
    """A run's value with lower better, or None for a failed run (or a value not finite)."""
    if value is None or not math.isfinite(value):
        return None
    return value if mode == "min" else -value


def _filled(rows: list[list[float | None]]) -> list[list[float]]:
    """Each block with its failed runs given the worst value in it."""
    return [[max(v for v in row if v is not None) if v is None else v for v in row] for row in rows]


class RaceState:
    """Which arms still race, in which round, and what each one's runs ended with.

    The engine asks `next_round` for the runs to start, `record`s each value as its run ends
    and calls `close_round` when the round is whole; `replay` rebuilds the same state from
    the recorded values after a kill.
    """

    def __init__(self, race: Race, arms: Sequence[str]) -> None:
        if not arms or len(set(arms)) != len(arms):
            raise ConfigError(f"a race needs distinct arms, got {list(arms)!r}")
        if race.budget is not None and race.budget < len(arms) * race.min_repeats:
            raise ConfigError(
                f"Race(budget={race.budget}) cannot run {len(arms)} arms min_repeats="
                f"{race.min_repeats} times ({len(arms) * race.min_repeats} runs): raise the "
                "budget or lower min_repeats"
            )
        self.race = race
        self.arms = list(arms)
        self.survivors: list[str] = list(arms)
        self.round = 0
        self.values: dict[str, list[float | None]] = {arm: [] for arm in arms}
        self.eliminations: list[Elimination] = []

    @property
    def spent(self) -> int:
        """Runs recorded so far, every arm's."""
        return sum(len(v) for v in self.values.values())

    def over(self) -> bool:
        """Whether the race has ended: one survivor, the last round done, or no room in the
        budget for another whole round."""
        if len(self.survivors) <= 1 or self.round >= self.race.max_repeats:
            return True
        closed = sum(min(len(v), self.round) for v in self.values.values())
        return self.race.budget is not None and closed + len(self.survivors) > self.race.budget

    def next_round(self) -> list[str]:
        """The arms whose repeat `round` is still to run ([] when the race is over): every
        survivor at the start of a round, those not yet recorded after a replay."""
        if self.over():
            return []
        return [arm for arm in self.survivors if len(self.values[arm]) <= self.round]

    def record(self, arm: str, repeat: int, value: float | None) -> None:
        """What the run of `arm`'s repeat `repeat` ended with; None: it failed or was pruned.
        Recording a run again replaces its value (a rerun supersedes it)."""
        if self.over():
            raise ValueError(f"the race is over after round {self.round - 1}")
        if arm not in self.survivors:
            raise ValueError(f"arm {arm!r} is not racing (survivors: {self.survivors})")
        if repeat != self.round:
            raise ValueError(f"repeat {repeat} of arm {arm!r} is not round {self.round}'s")
        values = self.values[arm]
        value = None if value is None else float(value)
        if len(values) > repeat:
            values[repeat] = value
        else:
            values.append(value)

    def close_round(self) -> list[Elimination]:
        """Test the survivors once the round is whole, drop the beaten arms and move to the
        next round; the arms dropped, in the survivors' order."""
        if self.over():
            raise ValueError(f"the race is over after round {self.round - 1}")
        missing = [arm for arm in self.survivors if len(self.values[arm]) <= self.round]
        if missing:
            raise ValueError(f"round {self.round} is not whole: no value yet for {missing}")
        dropped: list[Elimination] = []
        if self.round + 1 >= self.race.min_repeats and len(self.survivors) >= 2:
            dropped = self._test()
        gone = {e.arm for e in dropped}
        self.survivors = [arm for arm in self.survivors if arm not in gone]
        self.eliminations.extend(dropped)
        self.round += 1
        return dropped

    def _rows(self) -> list[list[float | None]]:
        """The survivors' blocks over the rounds every survivor has a value of, lower
        better; a block where every run failed is left out."""
        rows = [
            [_oriented(self.values[arm][r], self.race.mode) for arm in self.survivors]
            for r in range(min(len(self.values[arm]) for arm in self.survivors))
        ]
        return [row for row in rows if any(v is not None for v in row)]

    def _test(self) -> list[Elimination]:
        race, arms, rows = self.race, self.survivors, self._rows()
        if len(rows) < 2:
            return []
        if race.test == "friedman":
            overall = friedman(rows)
            if overall.p_value >= race.alpha:
                return []
            if len(arms) == 2:
                best = min((0, 1), key=lambda j: overall.rank_sums[j])
                found = {1 - best: (overall.statistic, overall.p_value)}
            else:
                best, pairs = conover_against_best(overall)
                found = {j: pairs[j] for j in range(len(arms)) if j != best}
        else:
            filled = _filled(rows)
            means = [math.fsum(row[j] for row in filled) for j in range(len(arms))]
            best = min(range(len(arms)), key=lambda j: means[j])
            column = [row[best] for row in filled]
            found = {
                j: paired_t([row[j] for row in filled], column)
                for j in range(len(arms))
                if j != best
            }
        corrected = dict(zip(found, holm([p for _, p in found.values()]), strict=True))
        return [
            Elimination(arms[j], self.round, race.test, found[j][0], corrected[j], arms[best])
            for j in sorted(found)
            if corrected[j] < race.alpha
        ]

    def winner(self) -> str | None:
        """The survivor with the best mean over the rounds all survivors ran (failed runs
        counted as their round's worst; the first in arm order on a tie); None before any
        value."""
        rows = _filled(self._rows())
        if not rows:
            return self.survivors[0] if len(self.survivors) == 1 else None
        means = [math.fsum(row[j] for row in rows) for j in range(len(self.survivors))]
        return self.survivors[min(range(len(means)), key=lambda j: means[j])]

    @classmethod
    def replay(
        cls, race: Race, arms: Sequence[str], values: Mapping[str, Sequence[float | None]]
    ) -> RaceState:
        """The state a race reached, rebuilt from its recorded runs (`values`: per arm, its
        repeats' values in repeat order, None for a failed or pruned run; a repeat not run
        is absent): the same eliminations, the same next round. Values of an arm after the
        round that dropped it are ignored."""
        state = cls(race, arms)
        while not state.over():
            for arm in state.next_round():
                recorded = values.get(arm, ())
                if len(recorded) > state.round:
                    state.record(arm, state.round, recorded[state.round])
            if state.next_round():
                break  # this round is still running
            state.close_round()
        return state
