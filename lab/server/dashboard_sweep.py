"""The dashboard's sweep page API: what the UI draws for an experiment that sampled its arms
(`lab.sweeps.Sweep`) or raced them (`lab.sweeps.Race`), under ``/api/v1/dashboard``.

``/experiments/NAME/sweep`` answers the page in one request: one line per arm through the
space's parameters to the metric (a sampled arm's parameters as its sampler chose them, an
explicit arm's overrides), each axis described (a float or int on a linear or log scale, or
a choice), the trials as the sampler knows them, and the race: per arm and round its n,
mean and 95% interval over the repeats so far, each elimination (round, test, statistic,
corrected p-value) and the winner. ``/experiments/NAME/importance`` answers each parameter's
importance for the metric, by Optuna's PED-ANOVA over the arms with a value; it imports
Optuna in that request alone, and without it answers the line that says what to install.

The race table and the trials table are `race_table` and `trials_table`, pure functions of
the store's records, so every door that prints them prints the same figures.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import fastapi
from pydantic import BaseModel

from lab._ranking import COUNTED_STATUSES, Mode, choose, declaration
from lab._stats import spread
from lab.errors import ConfigError
from lab.server.openapi import NamePath, Number, problems
from lab.server.read import EliminationRow, LabJSON, StoreDep, TrialRow
from lab.store import Store

router = fastapi.APIRouter(tags=["dashboard"])

#: What the page says when the server lacks Optuna, which the importance needs.
NO_OPTUNA = "per-parameter importance needs Optuna on the server: pip install 'lab[sweeps]'"
#: The fewest arms with a value that the importance is computed over.
MIN_IMPORTANCE_ARMS = 3
#: A positive numeric parameter whose values span at least this ratio is drawn on a log
#: axis when the experiment records no space that says how it was sampled.
LOG_SPAN = 100.0


# -- answers ----------------------------------------------------------------------------------
class Axis(BaseModel):
    """One axis of the parallel coordinates: a parameter (``float``, ``int`` or ``choice``)
    with its range and scale, or its choices in order."""

    name: str
    kind: Literal["float", "int", "choice"]
    log: bool
    low: Number | None
    high: Number | None
    choices: list[Any] | None


class Line(BaseModel):
    """One arm through the axes: its parameters (an inactive one left out), its value of the
    metric (the mean of its counted runs), its state, its trial number if it was sampled, and
    the round after which a race dropped it."""

    arm: str
    number: int | None
    params: dict[str, Any]
    value: Number | None
    n: int
    state: Literal["complete", "running", "pruned", "failed"]
    eliminated: int | None


class RaceRow(BaseModel):
    """An arm after one round of the race: its run of the round (value, status), and over
    its repeats so far the n counted, their mean and 95% t interval; if the round dropped
    it, the test, the statistic against the best arm and the corrected p-value."""

    arm: str
    round: int
    status: str
    value: Number | None
    n: int
    mean: Number | None
    ci_low: Number | None
    ci_high: Number | None
    eliminated: bool
    test: str | None
    statistic: Number | None
    p_value: Number | None
    best: str | None


class RaceView(BaseModel):
    """The race: its rounds per arm, the eliminations, who survives and the winner (the
    survivor with the best mean over the rounds every survivor ran)."""

    rounds: int
    alpha: Number | None
    table: list[RaceRow]
    eliminations: list[EliminationRow]
    survivors: list[str]
    winner: str | None


class TrialLine(TrialRow):
    """A sampled arm as its sampler knows it, with its arm's counted runs and their mean."""

    n: int
    mean: Number | None


class SweepPage(BaseModel):
    """The sweep page's data: the metric and mode, the axes and a line per arm, the trials
    (none for explicit arms) and the race."""

    name: str
    metric: str | None
    mode: Mode
    axes: list[Axis]
    lines: list[Line]
    trials: list[TrialLine]
    race: RaceView


class ParamImportance(BaseModel):
    """A parameter's share of the metric's variation (the shares sum to 1)."""

    param: str
    importance: Number


class Importance(BaseModel):
    """Each parameter's importance for the metric, by the method named, over `arms` arms;
    or, in `unavailable`, the one line that says why there is none."""

    metric: str | None
    mode: Mode
    method: str
    arms: int
    importance: list[ParamImportance]
    unavailable: str | None


# -- the tables -------------------------------------------------------------------------------


def _final(run: Mapping[str, Any], metric: str) -> float | None:
    """A counted run's final value of `metric` (NaN kept as data), else None."""
    if run["status"] not in COUNTED_STATUSES:
        return None
    value = (run.get("summary") or {}).get(metric)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        return float(value)  # the JSON strings "NaN" and "Infinity" too
    except ValueError:
        return None


def _spread(values: list[float], bounds: tuple[float, float] | None) -> Any:
    try:
        return spread(values, bounds=bounds)
    except ConfigError:  # a value outside the declared bounds: the interval unclipped
        return spread(values)


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value


def race_table(
    runs: Sequence[Mapping[str, Any]],
    eliminations: Sequence[Mapping[str, Any]],
    metric: str,
    arms: Sequence[str],
    bounds: tuple[float, float] | None = None,
) -> list[dict[str, Any]]:
    """Per arm (in `arms` order) and round it ran (round r is repeat r): its run's status
    and value, and over its repeats up to r the counted values' n, mean and 95% t interval
    (`lab._stats.spread`, clipped to `bounds`), with the elimination of that round if any.
    At an arm's last round the figures are its summary's (`lab.inspect.summary`)."""
    dropped = {e["arm"]: e for e in eliminations}
    by_arm: dict[str, dict[int, Mapping[str, Any]]] = {}
    for run in runs:
        if run["arm"] is not None and run["status"] != "running":
            by_arm.setdefault(run["arm"], {})[run["repeat"]] = run
    rows: list[dict[str, Any]] = []
    for arm in arms:
        mine = by_arm.get(arm, {})
        values: list[float] = []
        for repeat in sorted(mine):
            run = mine[repeat]
            value = _final(run, metric)
            if value is not None:
                values.append(value)
            s = _spread(values, bounds)
            gone = dropped.get(arm)
            here = gone is not None and gone["round"] == repeat
            rows.append({
                "arm": arm, "round": repeat, "status": run["status"], "value": value,
                "n": s.n, "mean": _number(s.mean) if s.n else None,
                "ci_low": _number(s.ci_low), "ci_high": _number(s.ci_high),
                "eliminated": here, "test": gone["test"] if here else None,
                "statistic": gone["statistic"] if here else None,
                "p_value": gone["p_value"] if here else None,
                "best": gone["best"] if here else None,
            })  # fmt: skip
    return rows


def trials_table(
    trials: Sequence[Mapping[str, Any]], runs: Sequence[Mapping[str, Any]], metric: str | None
) -> list[dict[str, Any]]:
    """Each trial (`Store.trials`) with its arm's counted runs of `metric`: n and mean."""
    values: dict[str, list[float]] = {}
    for run in runs:
        value = _final(run, metric) if metric is not None else None
        if run["arm"] is not None and value is not None:
            values.setdefault(run["arm"], []).append(value)
    rows = []
    for t in trials:
        mine = values.get(t["arm"], [])
        mean = math.fsum(mine) / len(mine) if mine else None
        rows.append({**t, "intermediate": {str(k): v for k, v in t["intermediate"].items()},
                     "n": len(mine), "mean": mean})  # fmt: skip
    return rows


# -- the page ---------------------------------------------------------------------------------


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


def _state(runs: list[Mapping[str, Any]], metric: str | None) -> str:
    """An explicit arm's state from its runs: complete once a counted run has the metric."""
    if metric is not None and any(_final(r, metric) is not None for r in runs):
        return "complete"
    statuses = {r["status"] for r in runs}
    if not runs or "running" in statuses or "pending" in statuses:
        return "running"
    return "pruned" if "pruned" in statuses else "failed"


def _recorded_space(config: Any) -> dict[str, Any]:
    """The space the experiment's config records (``sweep: {space: ...}``, a file's form),
    as `lab.sweeps.space` parses it; empty when it records none it can read."""
    entry = config.get("sweep") if isinstance(config, Mapping) else None
    space = entry.get("space") if isinstance(entry, Mapping) else None
    if not isinstance(space, Mapping):
        return {}
    from lab.sweeps.space import parse_space

    try:
        return dict(parse_space(space, "the experiment's recorded sweep"))
    except ConfigError:
        return {}


def _axes(lines: list[dict[str, Any]], space: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An axis per parameter, in the order the lines first name them: as the recorded space
    declares it, else from the values (all numbers: int or float, log when positive and
    spanning `LOG_SPAN`; anything else: a choice, in order of appearance)."""
    names: list[str] = list(space)
    for line in lines:
        names += [k for k in line["params"] if k not in names]
    axes = []
    for name in names:
        seen = [line["params"][name] for line in lines if name in line["params"]]
        param = space.get(name)
        kind = type(param).__name__.lower() if param is not None else None
        numbers = [v for v in seen if isinstance(v, int | float) and not isinstance(v, bool)]
        if kind in ("float", "int"):
            low, high, log = param.low, param.high, param.log  # type: ignore[union-attr]
        elif seen and len(numbers) == len(seen) and all(math.isfinite(v) for v in numbers):
            kind = "int" if all(isinstance(v, int) for v in numbers) else "float"
            low, high = min(numbers), max(numbers)
            log = low > 0 and high / low >= LOG_SPAN
        else:
            choices = list(param.values) if kind == "choice" else []  # type: ignore[union-attr]
            for v in seen:
                if _scalar(v) not in choices:
                    choices.append(_scalar(v))
            axes.append({"name": name, "kind": "choice", "log": False, "low": None,
                         "high": None, "choices": choices})  # fmt: skip
            continue
        axes.append({"name": name, "kind": kind, "log": bool(log), "low": low, "high": high,
                     "choices": None})  # fmt: skip
    return axes


def _winner(
    arms: Sequence[str], table: list[dict[str, Any]], survivors: list[str], mode: Mode
) -> str | None:
    """The survivor `lab.sweeps.racing.RaceState.winner` names over the recorded rounds."""
    if not survivors:
        return None
    from lab.sweeps.racing import Race, RaceState

    state = RaceState(Race("metric", mode=mode), arms)
    state.survivors = list(survivors)
    for row in table:
        state.values[row["arm"]].append(row["value"])
    return state.winner()


def sweep_page(store: Store, name: str) -> dict[str, Any]:
    """The sweep page of experiment `name` (`SweepPage`), read from `store`."""
    exp = store.get_experiment(name)
    trials = store.trials(name)
    runs = exp["runs"]
    arms = [a["name"] for a in exp["arms"]]
    order = {arm: i for i, arm in enumerate(arms)}  # a round's eliminations in arm order
    eliminations = sorted(store.eliminations(name),
                          key=lambda e: (e["round"], order.get(e["arm"], len(order))))  # fmt: skip
    keys = sorted({k for r in runs for k in (r.get("summary") or {})})
    declared = declaration(exp["config"])
    metric, mode = choose(None, None, declared, keys)
    metric = metric or (keys[0] if keys else None)
    overrides = {a["name"]: a["overrides"] for a in exp["arms"]}
    sampled = {t["arm"]: t for t in trials}
    dropped = {e["arm"]: e for e in eliminations}
    per_arm: dict[str, list[Mapping[str, Any]]] = {arm: [] for arm in arms}
    for run in runs:
        if run["arm"] in per_arm:
            per_arm[run["arm"]].append(run)
    lines = []
    for arm in arms:
        trial = sampled.get(arm)
        values = [v for r in per_arm[arm] if (v := _final(r, metric or "")) is not None]
        state = _state(per_arm[arm], metric)
        if trial is not None and trial["state"] != "running":
            state = trial["state"]
        params = trial["params"] if trial is not None else _flat(overrides[arm] or {})
        lines.append({
            "arm": arm, "number": trial["number"] if trial is not None else None,
            "params": {k: _scalar(v) for k, v in params.items()},
            "value": math.fsum(values) / len(values) if values else None, "n": len(values),
            "state": state,
            "eliminated": dropped[arm]["round"] if arm in dropped else None,
        })  # fmt: skip
    bounds = (declared.bounds or {}).get(metric) if metric else None
    table = race_table(runs, eliminations, metric, arms, bounds) if metric else []
    survivors = [arm for arm in arms if arm not in dropped]
    race = {
        "rounds": max((row["round"] + 1 for row in table), default=0),
        "alpha": eliminations[0]["alpha"] if eliminations else None,
        "table": table,
        "eliminations": eliminations,
        "survivors": survivors,
        "winner": _winner(arms, table, survivors, mode) if table else None,
    }
    return {
        "name": exp["name"], "metric": metric, "mode": mode,
        "axes": _axes(lines, _recorded_space(exp["config"])), "lines": lines,
        "trials": trials_table(trials, runs, metric), "race": race,
    }  # fmt: skip


def importance(store: Store, name: str) -> dict[str, Any]:
    """Each parameter's importance for the sweep page's metric (`Importance`): Optuna's
    PED-ANOVA over the arms with a finite value, each a trial of an in-memory study in the
    metric's direction, the parameters as the axes describe them (those every such arm
    has). Optuna is imported here alone: without it, the line that says what to install."""
    page = sweep_page(store, name)
    answer: dict[str, Any] = {"metric": page["metric"], "mode": page["mode"],
                              "method": "ped-anova", "arms": 0, "importance": [],
                              "unavailable": None}  # fmt: skip
    done = [
        line for line in page["lines"]
        if line["state"] == "complete" and line["value"] is not None
        and math.isfinite(line["value"])
    ]  # fmt: skip
    answer["arms"] = len(done)
    axes = [a for a in page["axes"] if all(a["name"] in line["params"] for line in done)]
    if len(done) < MIN_IMPORTANCE_ARMS or not axes:
        answer["unavailable"] = (
            f"importance needs {MIN_IMPORTANCE_ARMS} arms with a value of "
            f"{page['metric']} and a parameter they all have; this experiment has "
            f"{len(done)} and {len(axes)}"
        )
        return answer
    try:
        import optuna
    except ImportError:
        answer["unavailable"] = NO_OPTUNA
        return answer
    answer["importance"] = _ped_anova(optuna, page["mode"], axes, done)
    return answer


def _ped_anova(
    optuna: Any, mode: Mode, axes: list[dict[str, Any]], done: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """PED-ANOVA's normalized importances, highest first (Optuna's own order)."""
    import warnings

    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances

    dists: dict[str, Any] = {}
    for a in axes:
        if a["kind"] == "choice":
            dists[a["name"]] = CategoricalDistribution(a["choices"])
        elif a["kind"] == "int":
            dists[a["name"]] = IntDistribution(int(a["low"]), int(a["high"]), log=a["log"])
        else:
            dists[a["name"]] = FloatDistribution(a["low"], a["high"], log=a["log"])
    direction = "minimize" if mode == "min" else "maximize"
    logger = optuna.logging
    verbosity = logger.get_verbosity()
    logger.set_verbosity(logger.WARNING)  # no line per request in the server's log
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            study = optuna.create_study(direction=direction)
            for line in done:
                params = {k: line["params"][k] for k in dists}
                study.add_trial(optuna.trial.create_trial(
                    params=params, distributions=dists, value=line["value"]))  # fmt: skip
            found = get_param_importances(study, evaluator=PedAnovaImportanceEvaluator())
    finally:
        logger.set_verbosity(verbosity)
    return [{"param": k, "importance": v} for k, v in found.items()]


@router.get(
    "/experiments/{name:text}/sweep",
    response_class=LabJSON,
    response_model=SweepPage,
    responses=problems(403, 404),
)
def sweep(name: NamePath, store: Store = StoreDep) -> Any:
    """The sweep page's data in one answer: the axes of the parameters and a line per arm
    to its value of the experiment's metric (its declared one, as the race's), the trials
    as the sampler knows them, and the race by round with its eliminations and winner."""
    return LabJSON(sweep_page(store, name))


@router.get(
    "/experiments/{name:text}/importance",
    response_class=LabJSON,
    response_model=Importance,
    responses=problems(403, 404),
)
def param_importance(name: NamePath, store: Store = StoreDep) -> Any:
    """Each parameter's importance for the experiment's metric: Optuna's PED-ANOVA over the
    arms with a value (needs ``lab[sweeps]`` on the server; without it, `unavailable` says
    so in one line)."""
    return LabJSON(importance(store, name))
