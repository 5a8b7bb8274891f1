"""Samplers: which arm a sweep runs next, as a function of what it has asked and been told.

Every sampler keeps the **determinism contract**: ``ask(history, n)`` depends only on the
space, the seed, the mode and `history` (the `Trial` of every arm asked so far, told or not).
A sweep that is killed and run again rebuilds its sampler from the recorded trials and asks
exactly the points the uninterrupted sweep would have asked next.

- ``grid`` and ``random`` are functions of the trial's number alone (random draws point `k`
  from ``random.Random(f"{seed}:{k}")``);
- ``sobol`` is point `k` of one scrambled Sobol sequence seeded with `seed` (scipy);
- ``tpe``, ``cmaes`` and a user's own Optuna sampler replay the recorded asks and tells, in
  their order, into a fresh in-memory Optuna study whose sampler is seeded with `seed`: the
  sampler's state (CMA-ES keeps it in its trials' attributes) is rebuilt by Optuna's own
  code, never unpickled from the store. A live sampler keeps its study between asks and
  replays only what is new.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import random
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from lab._imports import require
from lab._secrets import logger
from lab.errors import ConfigError
from lab.sweeps.space import Choice, Float, Int, Param, Space, active

__all__ = ["SAMPLERS", "Sampler", "Trial", "TrialState", "grid_size", "make_sampler"]

TrialState = Literal["running", "complete", "pruned", "failed"]
SAMPLERS = ("grid", "random", "sobol", "tpe", "cmaes")

_log = logger(__name__)


@dataclass(frozen=True)
class Trial:
    """One sampled arm, as the sampler knows it: what was asked, when, and what it was told."""

    number: int  # ask order, 0-based (arm s{number:03d})
    params: dict[str, Any]  # the active parameters only
    asked_after: int  # how many tells had happened when it was asked
    told: int | None = None  # its tell's sequence number, 0-based; None: not told yet
    value: float | None = None  # the arm's value in the sweep's mode; None unless told
    state: TrialState = "running"
    intermediate: dict[int, float] = field(default_factory=dict)  # step -> value, if pruned


class Sampler(Protocol):
    """What a sweep asks for its next arms."""

    name: str

    def ask(self, history: Sequence[Trial], n: int) -> list[dict[str, Any]]:
        """The next `n` points, given every trial asked so far (told or not)."""
        ...


# -- grid --------------------------------------------------------------------------------
def _grid_values(key: str, param: Param) -> Sequence[Any]:
    if isinstance(param, Choice):
        return param.values
    if isinstance(param, Int):
        return range(param.low, param.high + 1)
    raise ConfigError(
        f"a grid cannot enumerate space[{key!r}] = {param!r}; write Choice([...]) of the "
        "values to try, or use sampler='random' or 'sobol'"
    )


def _grid(space: Space) -> Iterator[dict[str, Any]]:
    """Every point of the grid, the last parameter varying fastest; a conditional parameter
    is enumerated only where it is active (no point twice)."""
    keys = list(space)
    values = {key: _grid_values(key, param) for key, param in space.items()}

    def points(i: int, point: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if i == len(keys):
            yield dict(point)
            return
        key = keys[i]
        if key not in active(space, point):
            yield from points(i + 1, point)
            return
        for value in values[key]:
            point[key] = value
            yield from points(i + 1, point)
            del point[key]

    return points(0, {})


def grid_size(space: Space) -> int:
    """How many points the grid of `space` has (every Choice and Int combination, with a
    conditional parameter counted only where active); a Float is refused, one line."""
    return sum(1 for _ in _grid(space))


class _Grid:
    name = "grid"

    def __init__(self, space: Space) -> None:
        grid_size(space)  # refuses a Float now, not at the first ask
        self._space = space

    def ask(self, history: Sequence[Trial], n: int) -> list[dict[str, Any]]:
        """Points len(history) .. len(history) + n - 1 of the grid (fewer at its end)."""
        start = len(history)
        return list(itertools.islice(_grid(self._space), start, start + n))


# -- random and sobol: a point from numbers in [0, 1) -------------------------------------
def _from_unit(param: Param, u: float) -> Any:
    """The value of `param` at `u` in [0, 1): uniform, or uniform in the logarithm."""
    if isinstance(param, Choice):
        return param.values[min(int(u * len(param.values)), len(param.values) - 1)]
    if isinstance(param, Float):
        if param.log:
            low, high = math.log(param.low), math.log(param.high)
            return min(max(math.exp(low + u * (high - low)), param.low), param.high)
        return param.low + u * (param.high - param.low)
    if param.log:  # ints: each of low..high as likely in the logarithm of [low, high + 1)
        low, high = math.log(param.low), math.log(param.high + 1)
        return min(int(math.exp(low + u * (high - low))), param.high)
    return min(param.low + int(u * (param.high - param.low + 1)), param.high)


def _point(space: Space, units: Sequence[float]) -> dict[str, Any]:
    """The point whose parameter i sits at units[i]; inactive parameters are left out."""
    point: dict[str, Any] = {}
    for (key, param), u in zip(space.items(), units, strict=True):
        if key in active(space, point):
            point[key] = _from_unit(param, u)
    return point


class _Random:
    name = "random"

    def __init__(self, space: Space, seed: int) -> None:
        self._space, self._seed = space, seed

    def ask(self, history: Sequence[Trial], n: int) -> list[dict[str, Any]]:
        """Point k from its own generator, seeded with ``f"{seed}:{k}"``."""
        out = []
        for number in range(len(history), len(history) + n):
            rng = random.Random(f"{self._seed}:{number}")
            out.append(_point(self._space, [rng.random() for _ in self._space]))
        return out


class _Sobol:
    name = "sobol"

    def __init__(self, space: Space, seed: int) -> None:
        require("scipy", "sweeps", "sampler='sobol'")
        self._space, self._seed = space, seed

    def ask(self, history: Sequence[Trial], n: int) -> list[dict[str, Any]]:
        """Points len(history) .. of one scrambled Sobol sequence seeded with the seed."""
        from scipy.stats import qmc

        engine = qmc.Sobol(len(self._space), scramble=True, seed=self._seed)
        if history:  # scipy's fast_forward(0) on a fresh engine fails
            engine.fast_forward(len(history))
        with warnings.catch_warnings():  # balance needs 2^m points: a sweep asks what it needs
            warnings.simplefilter("ignore", UserWarning)
            units = engine.random(n).tolist() if n else []
        return [_point(self._space, row) for row in units]


# -- Optuna: replayed into an in-memory study ---------------------------------------------
Event = tuple[Any, ...]  # ("ask", number, params) or ("tell", number, state, value, steps)


def _events(history: Sequence[Trial]) -> list[Event]:
    """The asks and tells of `history` in the order they happened: the asks made after
    ``k`` tells (by number), then tell ``k``, for k = 0, 1, ..."""
    if [t.number for t in history] != list(range(len(history))):
        raise ConfigError("a sampler's history holds trials 0, 1, 2, ... in order; pass them so")
    told = sorted((t for t in history if t.told is not None), key=lambda t: t.told or 0)
    if [t.told for t in told] != list(range(len(told))):
        raise ConfigError(
            f"trial tells are numbered {[t.told for t in told]}; they run 0, 1, 2, ... in the "
            "order the trials were told"
        )
    late = [
        t
        for t in history
        if t.asked_after > len(told) or (t.told is not None and t.told < t.asked_after)
    ]
    asked = [t.asked_after for t in history]
    if late or asked != sorted(asked):
        raise ConfigError(
            "a trial was asked after tells that never happened, or told before it was asked; "
            "record each trial's asked_after as the tells seen when it was asked"
        )
    events: list[Event] = []
    by_after = {k: [t for t in history if t.asked_after == k] for k in set(asked)}
    for k in range(len(told) + 1):
        events += [("ask", t.number, t.params) for t in by_after.get(k, [])]
        if k < len(told):
            t = told[k]
            events.append(("tell", t.number, t.state, t.value, sorted(t.intermediate.items())))
    return events


class _Diverged(Exception):
    """A replayed ask drew other params than were recorded (another Optuna, say)."""


class _Optuna:
    """An Optuna sampler driven by ask-and-tell over an in-memory study rebuilt from trials."""

    def __init__(self, name: str, make: Any, space: Space, mode: str) -> None:
        self.name, self._make, self._space, self._mode = name, make, space, mode
        self._study: Any = None
        self._trials: dict[int, Any] = {}
        self._applied: list[Event] = []
        self._pinned = False  # replaying with the recorded params fixed (after _Diverged)

    def ask(self, history: Sequence[Trial], n: int) -> list[dict[str, Any]]:
        """Replay what `history` holds beyond what this study saw, then ask `n` points."""
        events = _events(history)
        with _quiet():
            if self._study is None or events[: len(self._applied)] != self._applied:
                self._reset(pinned=False)
            try:
                self._replay(events[len(self._applied) :])
            except _Diverged as exc:
                _log.warning(
                    "%s: replaying the recorded trials drew other points (%s); continuing "
                    "from the recorded points",
                    self.name,
                    exc,
                )
                self._reset(pinned=True)
                self._replay(events)
            out = []
            for _ in range(n):
                trial = self._study.ask()
                params = self._suggest(trial)
                self._trials[trial.number] = trial
                self._applied.append(("ask", trial.number, params))
                out.append(params)
            return out

    def _reset(self, *, pinned: bool) -> None:
        import optuna

        self._study = optuna.create_study(
            direction="minimize" if self._mode == "min" else "maximize", sampler=self._make()
        )
        self._trials, self._applied, self._pinned = {}, [], pinned

    def _replay(self, events: Sequence[Event]) -> None:
        import optuna

        for event in events:
            if event[0] == "ask":
                _, number, recorded = event
                if self._pinned:
                    self._study.enqueue_trial(recorded, skip_if_exists=False)
                trial = self._study.ask()
                params = self._suggest(trial)
                if trial.number != number or params != recorded:
                    raise _Diverged(f"trial {number}: {params} where {recorded} was recorded")
                self._trials[number] = trial
            else:
                _, number, state, value, steps = event
                trial = self._trials[number]
                if state == "complete":
                    self._study.tell(trial, value)
                elif state == "pruned":
                    for step, intermediate in steps:
                        trial.report(intermediate, step)
                    self._study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                else:
                    self._study.tell(trial, state=optuna.trial.TrialState.FAIL)
            self._applied.append(event)

    def _suggest(self, trial: Any) -> dict[str, Any]:
        """Draw the active parameters, in space order, through the trial's suggest calls."""
        params: dict[str, Any] = {}
        for key, param in self._space.items():
            if key not in active(self._space, params):
                continue
            if isinstance(param, Float):
                params[key] = trial.suggest_float(key, param.low, param.high, log=param.log)
            elif isinstance(param, Int):
                params[key] = trial.suggest_int(key, param.low, param.high, log=param.log)
            else:
                params[key] = trial.suggest_categorical(key, list(param.values))
        return params


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Optuna's per-trial INFO lines and experimental-feature warnings held back."""
    import optuna
    from optuna.exceptions import ExperimentalWarning

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(max(verbosity, optuna.logging.WARNING))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def _optuna_sampler(name: str, seed: int) -> Any:
    """A freshly seeded Optuna sampler: TPE with its constant liar (a batch of asks with
    trials still running spreads out), or CMA-ES (which samples categorical and conditional
    parameters with its independent sampler, seeded alike)."""
    import optuna

    with _quiet():
        if name == "tpe":
            return optuna.samplers.TPESampler(seed=seed, constant_liar=True)
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)


def make_sampler(
    sampler: str | Any, space: Space, *, seed: int, mode: Literal["min", "max"]
) -> Sampler:
    """The sampler a sweep asks: one of `SAMPLERS` by name, or an Optuna sampler instance
    (fresh and seeded: it is copied, untouched, for each rebuild, so give it a seed)."""
    if mode not in ("min", "max"):
        raise ConfigError(f"mode={mode!r}; write mode='min' or mode='max'")
    if sampler == "grid":
        return _Grid(space)
    if sampler == "random":
        return _Random(space, seed)
    if sampler == "sobol":
        return _Sobol(space, seed)
    if sampler in ("tpe", "cmaes"):
        require("optuna", "sweeps", f"sampler={sampler!r}")
        if sampler == "cmaes":
            require("cmaes", "sweeps", "sampler='cmaes'")
        return _Optuna(sampler, lambda: _optuna_sampler(sampler, seed), space, mode)
    if isinstance(sampler, str):
        raise ConfigError(
            f"sampler={sampler!r}; write one of {', '.join(SAMPLERS)}, or pass an Optuna sampler"
        )
    require("optuna", "sweeps", f"sampler={type(sampler).__name__}")
    import optuna

    if not isinstance(sampler, optuna.samplers.BaseSampler):
        raise ConfigError(
            f"sampler={sampler!r}; write one of {', '.join(SAMPLERS)}, or pass an Optuna "
            "sampler such as optuna.samplers.TPESampler(seed=0)"
        )
    template = copy.deepcopy(sampler)
    return _Optuna(type(sampler).__name__, lambda: copy.deepcopy(template), space, mode)
