"""An experiment's race (``Experiment(race=Race(...))``), round by round.

Round r runs repeat r (seeded with the experiment's seed + r) of every arm still in the race,
so every comparison is paired by seed. When the round's last run has ended, or was found
finished by an earlier attempt, `lab.sweeps.racing.RaceState.close_round` decides which arms
are dropped, and the survivors' next round is due. A dropped arm never runs its later
repeats: they are no longer planned, so the runs an experiment plans shrink as arms drop
(`planned`). Running an interrupted race again walks the same rounds over the recorded runs,
which decide what they decided before, and trains only the runs that never finished.

The experiment (`lab.experiment.Experiment`) turns the due rounds into the scheduler's chains
and records each elimination in the store; the decisions are `RaceState`'s alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lab._ranking import COUNTED_STATUSES
from lab.errors import ConfigError
from lab.records import RaceResult, RunResult

if TYPE_CHECKING:
    from lab.sweeps.racing import Race, RaceState


def race_args(
    race: Any, arms: Sequence[Any] | None, repeats: Any, metric: Any, mode: Any
) -> tuple[Any, Any, Any]:
    """An experiment's `repeats` (default 1), `metric` and `mode`, and with a race: the
    race's `max_repeats` (an explicit `repeats` that differs is refused, in one line), and
    its metric and mode when the experiment names no metric of its own."""
    if race is None:
        return 1 if repeats is None else repeats, metric, mode
    from lab.sweeps.racing import Race

    if not isinstance(race, Race):
        raise ConfigError(f"race={race!r}: use race=Race('val/loss', mode='min', ...)")
    staged = [arm.name for arm in arms or () if arm.stages is not None]
    if staged:
        raise ConfigError(
            f"race: arm {staged[0]!r} has stages; a race compares single runs, so race arms "
            "without stages"
        )
    if repeats is not None and repeats != race.max_repeats:
        raise ConfigError(
            f"repeats={repeats} conflicts with race=Race(max_repeats={race.max_repeats}): a "
            "race runs up to max_repeats repeats of each arm; drop repeats, or set max_repeats"
        )
    if metric is None:
        metric, mode = race.metric, mode if mode is not None else race.mode
    return race.max_repeats, metric, mode


class RaceRounds:
    """The race over `arms`: the round due now (`round`, `arms`), each run's value as it
    ends, and the arms each closed round drops (`result`)."""

    def __init__(self, race: Race, arms: Sequence[str]) -> None:
        from lab.sweeps.racing import RaceState

        self.race = race
        self.state: RaceState = RaceState(race, arms)
        self.result = RaceResult(race.metric, race.mode, survivors=list(arms))
        self.ran: dict[str, int] = dict.fromkeys(arms, 0)  # runs each arm has had
        self.round = 0
        self.arms: list[str] = self.state.next_round()  # those of the round due now
        self._waiting = set(self.arms)  # whose run of the round has not ended yet

    def ended(self, run: RunResult) -> list[Any] | None:
        """Record the run of the round that ended (a failed or unfinished one has no value);
        once it was the round's last, close the round: its eliminations (possibly none), and
        the next round (`arms`, `round`) is due. None while the round is still running."""
        if run.repeat != self.round or run.arm not in self._waiting:
            return None  # not a run of the round (a race never plans one)
        self._waiting.discard(run.arm)
        self.ran[run.arm] += 1
        value = run.metrics.get(self.race.metric) if run.status in COUNTED_STATUSES else None
        finite = value is not None and math.isfinite(value)
        self.state.record(run.arm, run.repeat, float(value) if finite else None)  # type: ignore[arg-type]
        if self._waiting:
            return None
        dropped = self.state.close_round()
        result = self.result
        result.rounds = self.round + 1
        result.eliminations += dropped
        result.survivors = list(self.state.survivors)
        self.round += 1
        self.arms = self.state.next_round()
        self._waiting = set(self.arms)
        if not self.arms:
            result.over, result.winner = True, self.state.winner()
        return list(dropped)

    def planned(self, arm: str) -> int:
        """The runs `arm` will have had when the race ends, as far as it is known now: those
        it had, once it is dropped or the race is over; else every repeat."""
        if self.result.over or arm in self.result.eliminated():
            return self.ran[arm]
        return self.race.max_repeats

    def total(self, arms: Sequence[str]) -> int:
        """The runs the race plans in all: each arm's `planned`, within its `budget`, and
        never fewer than it ran."""
        total = sum(self.planned(arm) for arm in arms)
        if self.race.budget is not None:
            total = max(min(total, self.race.budget), sum(self.ran.values()))
        return total
