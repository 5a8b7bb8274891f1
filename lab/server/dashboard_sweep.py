"""The dashboard's sweep page API: what the UI draws for an experiment that sampled its arms
(`lab.sweeps.Sweep`) or raced them (`lab.sweeps.Race`), under ``/api/v1/dashboard``.

``/experiments/NAME/sweep`` answers the page in one request: one line per arm through the
space's parameters to the metric (a sampled arm's parameters as its sampler chose them, an
explicit arm's overrides), each axis described (a float or int on a linear or log scale, or
a choice), the trials as the sampler knows them, and the race: per arm and closed round its
run's status and value, and its n, mean and 95% interval over the repeats so far, each
elimination (round, test, statistic, corrected p-value) and the winner once it is over.
``/experiments/NAME/importance`` answers each parameter's importance for the metric, by
Optuna's PED-ANOVA over the arms with a value; it imports Optuna in that request alone, and
without it answers the line that says what to install.

The race, the trials and the arms' lines are `lab.sweeps.report`'s (`sweep_tables`,
`arm_lines`), the functions ``lab show``, ``lab sweep`` and `lab.inspect` use, so every door
shows the same figures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import fastapi
from pydantic import BaseModel

from lab._ranking import Mode, choose, declaration
from lab.errors import ConfigError
from lab.server.openapi import NamePath, Number, problems
from lab.server.read import Dropped, LabJSON, StoreDep
from lab.store import Store
from lab.sweeps.report import arm_lines, sweep_tables

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
    """One arm through the axes (`lab.sweeps.report.ArmLine`): its parameters (an inactive
    one left out), its value of the metric (its summary's mean of its `n` counted runs), its
    state, its trial number if it was sampled, and the round after which a race dropped it."""

    arm: str
    number: int | None
    params: dict[str, Any]
    value: Number | None
    n: int
    state: Literal["complete", "running", "pruned", "failed"]
    eliminated: int | None


class RaceRow(BaseModel):
    """An arm after one closed round of the race (`lab.sweeps.report.RaceRow`): the round's
    run (its status, and its value when it counts), and over its repeats so far the n
    counted, their mean and 95% t interval, and whether the round dropped it."""

    arm: str
    round: int
    status: str
    value: Number | None
    n: int
    mean: Number | None
    ci_low: Number | None
    ci_high: Number | None
    eliminated: bool


class RaceView(BaseModel):
    """The race (`lab.sweeps.report.RaceTable`, as ``lab show`` prints it and
    `lab.inspect.race` gives it): the `Race`'s fields, the arms raced, the rounds closed and
    each arm's row per closed round, the eliminations, who survives, whether it is over and
    its winner once it is, and the runs that ended (of them `pruned`)."""

    experiment: str
    race: dict[str, Any]
    arms: list[str]
    rounds: int
    rows: list[RaceRow]
    eliminations: list[Dropped]
    survivors: list[str]
    over: bool
    winner: str | None
    runs: int
    pruned: int


class SweepTrial(BaseModel):
    """A sampled arm as the sweep's table shows it (`lab.sweeps.report.TrialRow`): its ask
    order, arm, active parameters, value (null until told, and for a failed one) and state."""

    number: int
    arm: str
    params: dict[str, Any]
    value: Number | None
    state: str


class SweepPage(BaseModel):
    """The sweep page's data: the metric and mode, the axes and a line per arm, the trials
    (none for explicit arms) and the race (null when the experiment ran none)."""

    name: str
    metric: str | None
    mode: Mode
    axes: list[Axis]
    lines: list[Line]
    trials: list[SweepTrial]
    race: RaceView | None


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


# -- the page ---------------------------------------------------------------------------------


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


def _axes(lines: Sequence[Mapping[str, Any]], space: Mapping[str, Any]) -> list[dict[str, Any]]:
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
            for v in seen:  # a line's params are JSON scalars (`arm_lines`)
                if v not in choices:
                    choices.append(v)
            axes.append({"name": name, "kind": "choice", "log": False, "low": None,
                         "high": None, "choices": choices})  # fmt: skip
            continue
        axes.append({"name": name, "kind": kind, "log": bool(log), "low": low, "high": high,
                     "choices": None})  # fmt: skip
    return axes


def sweep_page(store: Store, name: str) -> dict[str, Any]:
    """The sweep page of experiment `name` (`SweepPage`), read from `store`: the race, the
    trials and the arms' lines as `lab.sweeps.report` computes them for every door, and
    the axes they are drawn on. The metric is the one the experiment's summary ranks by
    (its declared one: a race's or a sweep's, else ``val/loss`` or ``loss``)."""
    exp = store.get_experiment(name)
    race, trials = sweep_tables(store, exp)
    keys = sorted({k for r in exp["runs"] for k in (r.get("summary") or {})})
    metric, mode = choose(None, None, declaration(exp["config"]), keys)
    metric = metric or (keys[0] if keys else None)
    lines = arm_lines(exp, trials, race, metric, mode)
    return {
        "name": exp["name"], "metric": metric, "mode": mode,
        "axes": _axes(lines, _recorded_space(exp["config"])), "lines": lines,
        "trials": trials, "race": race,
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
