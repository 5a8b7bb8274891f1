"""What every door shows of a sweep: the race table and the trials table, computed once from
the store's records, so that ``lab show``, ``lab sweep``, `lab.inspect` and the dashboard
print the same numbers.

`race_table` reads an experiment's record (`lab.store.records.ExperimentRecord`: its config,
arms and current runs) and the race's eliminations as the store recorded them
(`EliminationRecord`); `trials_table` reads the sampled arms (`TrialRecord`). Both are pure
functions of those records, with JSON-able results (None where a number is undefined), so a
server sends them as they are.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from lab._ranking import COUNTED_STATUSES, bounds_for, counted, declaration
from lab._stats import spread

if TYPE_CHECKING:
    from lab.records import RaceResult

#: Where an experiment's config records its race (``Experiment(race=...)``): the `Race`'s fields.
RACE_KEY = "race"
#: Where it records its sweep (``Experiment(sweep=...)``).
SWEEP_KEY = "sweep"
#: The run statuses that end a run: its round has its value (None unless counted).
_ENDED = ("completed", "stopped", "pruned", "failed", "crashed")


class RaceRow(TypedDict):
    """One arm after one closed round: the round's run (repeat `round`: its `status`, and
    its `value` when it counts, else None: a pruned or failed run, or a non-finite value),
    its counted runs so far (`n`), their mean and 95% interval (`lab._stats.spread`, as the
    summaries compute them: None with fewer than two runs), and whether the race dropped it
    after this round (`eliminated`)."""

    arm: str
    round: int
    status: str
    value: float | None
    n: int
    mean: float | None
    ci_low: float | None
    ci_high: float | None
    eliminated: bool


class RaceTable(TypedDict):
    """A race as every door shows it.

    `race`: the `Race`'s fields (metric, mode, alpha, min_repeats, max_repeats, test,
    budget); `arms`: the raced arms in order; `rounds`: the rounds closed (every arm in the
    round ended its run); `rows`: each arm after each closed round it raced in, by arm then
    round; `eliminations`: by round, then in the arms' order, each an `EliminationRecord`
    without its `created_at` (arm, round, test, statistic, Holm-corrected p_value, alpha,
    best);
    `survivors`: the arms never dropped;
    `over`: whether the race has ended; `winner`: the best survivor once it is over, else
    None (a race still running has no winner); `runs`: the runs that ended, and of them
    `pruned`.
    """

    experiment: str
    race: dict[str, Any]
    arms: list[str]
    rounds: int
    rows: list[RaceRow]
    eliminations: list[dict[str, Any]]
    survivors: list[str]
    over: bool
    winner: str | None
    runs: int
    pruned: int


class ArmLine(TypedDict):
    """An arm as the sweep page's parallel coordinates draw it: its trial number (None for
    an explicit arm), its parameters (a sampled arm's active ones as its sampler chose them,
    an explicit arm's overrides as dotted keys; a value that is no JSON scalar as its JSON
    text), its summary of the metric (`value`: the mean of its `n` counted runs, the figure
    `ExperimentResult.summary` and `lab.inspect.summary` give), its `state` (complete,
    running, pruned, failed) and the round after which a race dropped it."""

    arm: str
    number: int | None
    params: dict[str, Any]
    value: float | None
    n: int
    state: str
    eliminated: int | None


class TrialRow(TypedDict):
    """A sampled arm as the sweep table shows it: its ask order, arm, active parameters,
    value (None until told, or when it failed) and state (running, complete, pruned,
    failed)."""

    number: int
    arm: str
    params: dict[str, Any]
    value: float | None
    state: str


def _number(value: float) -> float | None:
    """`value`, or None where it is undefined (NaN): JSON has no NaN."""
    return None if math.isnan(value) else value


def sweep_tables(store: Any, record: Mapping[str, Any]) -> tuple[RaceTable | None, list[TrialRow]]:
    """The race table and the trials of the experiment `record` (`get_experiment`'s), read
    from `store` (anything with the store contract's `eliminations` and `trials`: a `Store`,
    an `HttpStore`, a `lab.store.reader.Reader`) only when the experiment ran a race or a
    sweep: what ``lab show`` prints and the dashboard draws."""
    config = record.get("config") or {}
    race = None
    if RACE_KEY in config:
        race = race_table(record, store.eliminations(record["name"]))
    trials = trials_table(store.trials(record["name"])) if SWEEP_KEY in config else []
    return race, trials


def race_table(
    record: Mapping[str, Any], eliminations: Sequence[Mapping[str, Any]]
) -> RaceTable | None:
    """The race of the experiment `record` describes (`get_experiment`'s record), with the
    eliminations the store holds for it (`eliminations(name)`); None when it ran no race.

    A round is closed when every arm racing in it has ended that round's run (repeat r); a
    round still open has no rows (its figures would move as its runs end, and the race
    tests closed rounds alone). An arm's row after round r summarizes its counted runs of
    repeats 0..r (completed and stopped runs with a finite value, as the race itself took
    them; a pruned or failed run counts toward no mean, as in the summaries). The
    winner and whether the race is over come from replaying the recorded runs through
    `lab.sweeps.racing.RaceState`, the rule the experiment itself followed.
    """
    from lab.sweeps.racing import Race, RaceState

    config = record.get("config") or {}
    fields = config.get(RACE_KEY) if isinstance(config, Mapping) else None
    if not isinstance(fields, Mapping):
        return None
    race = Race(**fields)
    arms = [a["name"] for a in record.get("arms", [])]
    runs = {(r["arm"], r["repeat"]): r for r in record.get("runs", []) if r["stage"] == 0}
    values: dict[str, list[float | None]] = {}
    for arm in arms:
        ended = values[arm] = []
        while (run := runs.get((arm, len(ended)))) is not None and run["status"] in _ENDED:
            ended.append(_value(run, race.metric))
    state = RaceState.replay(race, arms, values)
    dropped = {e["arm"]: e for e in eliminations}
    rounds = state.round
    bounds = bounds_for(race.metric, None, declaration(config))
    rows: list[RaceRow] = []
    for arm in arms:
        last = dropped[arm]["round"] if arm in dropped else rounds - 1
        for r in range(min(last, rounds - 1) + 1):
            counted = [v for v in values[arm][: r + 1] if v is not None]
            s = spread(counted, bounds=bounds, metric=race.metric)
            rows.append({
                "arm": arm, "round": r, "status": runs[(arm, r)]["status"],
                "value": values[arm][r], "n": s.n, "mean": _number(s.mean),
                "ci_low": _number(s.ci_low), "ci_high": _number(s.ci_high),
                "eliminated": arm in dropped and dropped[arm]["round"] == r,
            })  # fmt: skip
    ended_runs = [r for r in record.get("runs", []) if r["status"] in _ENDED]
    order = {arm: i for i, arm in enumerate(arms)}
    eliminations = sorted(eliminations, key=lambda e: (e["round"], order.get(e["arm"], len(arms))))
    return {
        "experiment": record["name"],
        "race": dict(fields),
        "arms": arms,
        "rounds": rounds,
        "rows": rows,
        "eliminations": [{k: v for k, v in e.items() if k != "created_at"} for e in eliminations],
        "survivors": [arm for arm in arms if arm not in dropped],
        "over": state.over(),
        "winner": state.winner() if state.over() else None,
        "runs": len(ended_runs),
        "pruned": sum(1 for r in ended_runs if r["status"] == "pruned"),
    }


def race_result(table: RaceTable) -> RaceResult:
    """The race of `table` as an experiment's result holds it (`ExperimentResult.race`), so
    that a summary read back from the store marks and skips the dropped arms as the
    experiment's own summary did."""
    from lab.records import RaceResult
    from lab.sweeps.racing import Elimination

    race = table["race"]
    return RaceResult(
        race["metric"], race["mode"], rounds=table["rounds"],
        eliminations=[Elimination(e["arm"], e["round"], e["test"], e["statistic"],
                                  e["p_value"], e["best"]) for e in table["eliminations"]],
        survivors=list(table["survivors"]), winner=table["winner"], over=table["over"],
    )  # fmt: skip


def arm_lines(
    record: Mapping[str, Any],
    trials: Sequence[TrialRow],
    race: RaceTable | None,
    metric: str | None,
    mode: Literal["min", "max"],
) -> list[ArmLine]:
    """One line per arm of the experiment `record` describes (`get_experiment`'s record), in
    arm order, with its `trials_table` rows and its `race_table`: what the sweep page draws
    through the space to the metric. An arm's value and n are its row of the experiment's
    summary by `metric` (`ExperimentResult.summary`: the completed and stopped runs of its
    last stage); its state is its trial's once told, else complete once a run counts,
    running while a run is unfinished, else pruned if a run was, else failed."""
    from lab.records import ExperimentResult

    result = ExperimentResult.from_record(record)
    counts = counted([(r.arm, r.stage, r.status) for r in result.runs])
    known = {k for r, ok in zip(result.runs, counts, strict=True) if ok for k in r.metrics}
    summary: dict[str, Any] = {}
    if metric is not None and metric in known:
        rows = result.summary(metric, mode, keys=[metric]).rows
        summary = {row.arm: row for row in rows}
    sampled = {t["arm"]: t for t in trials}
    dropped = {e["arm"]: e["round"] for e in race["eliminations"]} if race else {}
    lines: list[ArmLine] = []
    for arm in result.arms:
        trial, row = sampled.get(arm.name), summary.get(arm.name)
        n = row.n if row is not None else 0
        state = _state([r.status for r in arm.runs], n)
        if trial is not None and trial["state"] != "running":
            state = trial["state"]
        params = trial["params"] if trial is not None else _flat(arm.overrides)
        lines.append({
            "arm": arm.name, "number": trial["number"] if trial is not None else None,
            "params": {k: _scalar(v) for k, v in params.items()},
            "value": _number(row.mean) if row is not None and n else None, "n": n,
            "state": state,
            "eliminated": dropped.get(arm.name),
        })  # fmt: skip
    return lines


def _state(statuses: Sequence[str], n: int) -> str:
    """An arm's state from its runs' statuses and its number of counted values."""
    if n:
        return "complete"
    if not statuses or {"running", "pending"} & set(statuses):
        return "running"
    return "pruned" if "pruned" in statuses else "failed"


def _flat(overrides: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """An arm's overrides as dotted keys, as a space names them."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def _scalar(value: Any) -> Any:
    """A parameter's value as an axis places it: a JSON scalar as is, else its JSON text."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return json.dumps(value, sort_keys=True)


def _value(run: Mapping[str, Any], metric: str) -> float | None:
    """A run's value in its round: its final `metric` when it counts, else None."""
    value = (run.get("summary") or {}).get(metric) if run["status"] in COUNTED_STATUSES else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def trials_table(trials: Sequence[Mapping[str, Any]]) -> list[TrialRow]:
    """The sweep's sampled arms (`trials(name)`'s records), one row each in ask order."""
    return [
        {"number": t["number"], "arm": t["arm"], "params": dict(t["params"]),
         "value": t["value"], "state": t["state"]}
        for t in sorted(trials, key=lambda t: t["number"])
    ]  # fmt: skip


def best_trials(
    rows: Sequence[TrialRow], mode: Literal["min", "max"], n: int = 5
) -> list[TrialRow]:
    """The `n` complete trials with the best values by `mode` (ties in ask order): what a
    sweep's end shows first."""
    done = [t for t in rows if t["state"] == "complete" and t["value"] is not None]
    sign = 1.0 if mode == "min" else -1.0
    return sorted(done, key=lambda t: (sign * t["value"], t["number"]))[:n]  # type: ignore[operator]
