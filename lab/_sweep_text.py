"""What ``lab sweep`` prints beside the runs' lines: a line as each round of a race closes,
and at the end the race table and the best sampled arms, read back from the store as
``lab show`` prints them (`lab._show`, `lab.sweeps.report`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lab._table import fmt, plural
from lab.hooks import FINISHED_BEFORE, RUNS, Callback, Phase


class RoundsShown(Callback):
    """Prints a line as each sampled arm of `exp`'s sweep starts: its parameters, the arms
    asked so far of those the sweep asks, and the runs done of those planned; and a line as
    each round of its race closes: the round, the arms left and those it dropped, with test
    and p-value (the runs' lines come from the `ConsoleLogger`). A round closes once its
    last run has ended, so its line comes with the next run's end, or the experiment's."""

    phase = Phase.REPORT
    run_end_in_parent = True  # the race is decided in the parent

    def __init__(self, exp: Any, echo: Callable[[str], Any]) -> None:
        self.exp, self.echo = exp, echo
        self.closed = 0
        self.done = 0  # runs ended, those finished by an earlier attempt included
        self.before = 0  # the sweep's trials an earlier attempt asked

    def __reduce__(self) -> Any:  # a worker process gets a callback that shows nothing
        return (Callback, ())

    def on_experiment_start(self, ctx: Any) -> None:
        self.done = int(ctx.extras.get(FINISHED_BEFORE) or 0)  # skipped: they never end here
        sweep = self.exp._sweep_arms
        self.before = sweep.recorded if sweep is not None else 0  # asked by an earlier attempt

    def on_group_start(self, ctx: Any, group_name: str) -> None:
        sweep = self.exp._sweep_arms
        if sweep is None or group_name not in sweep.arms:
            return
        number = sweep.arms.index(group_name)
        shown = ", ".join(f"{k}={fmt(v)}" for k, v in sweep.trials[number].params.items())
        when = "asked before" if number < self.before else "asked"
        self.echo(
            f"{group_name} ({shown}) {when}: {len(sweep.trials)} of {sweep.total} arms asked, "
            f"{self.done} of {plural(int(ctx.extras.get(RUNS) or 0), 'run')} done"
        )

    def on_run_end(self, ctx: Any, run_result: Any, arm: Any) -> None:
        self.done += 1
        self._show()

    def on_experiment_end(self, ctx: Any, result: Any) -> None:
        self._show()

    def _show(self) -> None:
        race = self.exp.result.race if self.exp.result is not None else None
        while race is not None and self.closed < race.rounds:
            r, self.closed = self.closed, self.closed + 1
            out = [e for e in race.eliminations if e.round < self.closed]
            arms = len(race.survivors) + len(race.eliminations)
            line = f"round {r} closed: {arms - len(out)} of {arms} arms left"
            dropped = [f"{e.arm} {race.why()[e.arm]}" for e in out if e.round == r]
            if dropped:
                line += f"; dropped {', '.join(dropped)}"
            if race.over and self.closed == race.rounds:
                line += f"; the race is over, winner {race.winner}"
            self.echo(line)


def searched_text(store: Any, name: str) -> str:
    """The race table and the best sampled arms of experiment `name` in `store` (a reader
    with the store contract's reads, closed here), as ``lab show`` prints them; empty
    without either."""
    from lab._ranking import declaration
    from lab._show import race_text, trials_text
    from lab.sweeps.report import best_trials, sweep_tables

    try:
        record = store.get_experiment(name)
        race, trials = sweep_tables(store, record)
    finally:
        store.close()
    parts = [race_text(race)] if race is not None else []
    if trials:
        best = best_trials(trials, declaration(record["config"]).mode or "min")
        parts.append(f"best {trials_text(best)}" if best else trials_text(trials))
    return "".join(f"\n{part}" for part in parts)
