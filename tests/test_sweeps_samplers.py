"""Samplers keep the determinism contract: a sampler rebuilt from the recorded trials asks
exactly what the uninterrupted sweep asked next, for every sampler, with tells and asks
interleaved irregularly, pruned and failed trials among them."""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable
from typing import Any

import optuna
import pytest

from lab.errors import ConfigError
from lab.sweeps import Choice, Float, Int, Trial, grid_size, make_sampler
from lab.sweeps.space import Space

SPACE: Space = {
    "x": Float(-3.0, 3.0),
    "lr": Float(1e-4, 1e-1, log=True),
    "width": Int(16, 256, log=True),
    "opt": Choice(["adam", "sgd"]),
    "momentum": Float(0.0, 0.99, when={"opt": "sgd"}),
}
GRID: Space = {
    "opt": Choice(["adam", "sgd", "nesterov"]),
    "momentum": Choice([0.0, 0.9], when={"opt": ["sgd", "nesterov"]}),
    "layers": Int(1, 4),
}


def _value(params: dict[str, Any]) -> float:
    """A known function of a point (its minimum near x=1, lr=1e-2, width=64, sgd, m=0.9)."""
    value = (params.get("x", 0.0) - 1) ** 2 + (math.log10(params.get("lr", 1e-2)) + 2) ** 2
    value += (math.log2(params.get("width", 64)) - 6) ** 2 / 4 + params.get("layers", 0) / 10
    if params.get("opt") != "adam":
        value += (params.get("momentum", 0.9) - 0.9) ** 2
    return value


#: (batch asked, how many pending trials are told before the next ask): asks and tells in
#: an irregular interleaving, batches of 1 to 4 with trials left running across asks
SCHEDULE = [(4, 1), (2, 3), (1, 0), (3, 2), (4, 4), (1, 1), (2, 0), (3, 5), (2, 2), (4, 3)]


def _tell(history: list[Trial], told: int, turn: int) -> Trial:
    """Tell the pending trial picked by `turn` (not always the oldest): complete, or pruned
    (after its intermediate values) or failed now and then."""
    pending = [t for t in history if t.told is None]
    trial = pending[(turn * 7) % len(pending)]
    value = _value(trial.params)
    if trial.number % 5 == 3:
        told_as = Trial(trial.number, trial.params, trial.asked_after, told, value + 1.0,
                        "pruned", {1: value + 3.0, 2: value + 1.0})  # fmt: skip
    elif trial.number % 7 == 5:
        told_as = Trial(trial.number, trial.params, trial.asked_after, told, None, "failed")
    else:
        told_as = Trial(trial.number, trial.params, trial.asked_after, told, value, "complete")
    history[trial.number] = told_as
    return told_as


def _straight(make: Callable[[], Any]) -> list[tuple[list[Trial], int, list[dict[str, Any]]]]:
    """One sampler through SCHEDULE: each ask as (the history it saw, n, what it asked)."""
    sampler, history, told, turn = make(), [], 0, 0
    asks = []
    for batch, tells in SCHEDULE:
        points = sampler.ask(list(history), batch)
        asks.append((list(history), batch, points))
        history += [Trial(len(history) + i, p, told) for i, p in enumerate(points)]
        for _ in range(min(tells, sum(t.told is None for t in history))):
            _tell(history, told, turn)
            told, turn = told + 1, turn + 1
    return asks


def _makers() -> dict[str, Callable[[], Any]]:
    return {
        "grid": lambda: make_sampler("grid", GRID, seed=3, mode="min"),
        "random": lambda: make_sampler("random", SPACE, seed=3, mode="min"),
        "sobol": lambda: make_sampler("sobol", SPACE, seed=3, mode="min"),
        "tpe": lambda: make_sampler("tpe", SPACE, seed=3, mode="min"),
        "cmaes": lambda: make_sampler("cmaes", SPACE, seed=3, mode="min"),
        "optuna-instance": lambda: make_sampler(
            optuna.samplers.TPESampler(seed=5, n_startup_trials=4, multivariate=True),
            SPACE,
            seed=0,
            mode="max",
        ),
    }


@pytest.mark.parametrize("name", list(_makers()))
def test_a_sampler_rebuilt_from_its_trials_asks_what_the_straight_sweep_asked(name: str) -> None:
    make = _makers()[name]
    asks = _straight(make)
    assert sum(len(points) for _, _, points in asks) == (20 if name == "grid" else 26)
    for cut in (1, 3, 5, 8):  # killed before ask `cut`: a new sampler from the trials alone
        rebuilt = make()
        for history, n, points in asks[cut:]:
            assert rebuilt.ask(history, n) == points, (name, cut, len(history))
    again = _straight(make)  # and the straight sweep itself is a function of its seed
    assert [points for _, _, points in again] == [points for _, _, points in asks]


def test_the_grid_enumerates_active_combinations_by_number_alone() -> None:
    assert grid_size(GRID) == 4 + 8 + 8  # adam: 4 layers; sgd, nesterov: 2 momenta x 4
    sampler = make_sampler("grid", GRID, seed=0, mode="min")
    points = sampler.ask([], 30)
    assert len(points) == 20 and points[:5] == [
        {"opt": "adam", "layers": 1},
        {"opt": "adam", "layers": 2},
        {"opt": "adam", "layers": 3},
        {"opt": "adam", "layers": 4},
        {"opt": "sgd", "momentum": 0.0, "layers": 1},
    ]
    history = [Trial(i, p, 0) for i, p in enumerate(points[:18])]
    assert sampler.ask(history, 5) == points[18:]
    with pytest.raises(ConfigError) as info:
        make_sampler("grid", SPACE, seed=0, mode="min")
    assert str(info.value) == (
        "a grid cannot enumerate space['x'] = Float(low=-3.0, high=3.0, log=False, when=None); "
        "write Choice([...]) of the values to try, or use sampler='random' or 'sobol'"
    )


def test_random_and_sobol_points_are_functions_of_their_number() -> None:
    for name in ("random", "sobol"):
        sampler = make_sampler(name, SPACE, seed=11, mode="min")
        points = sampler.ask([], 8)
        history = [Trial(i, {"x": float(i)}, 0, i, 1.0, "complete") for i in range(5)]
        assert sampler.ask(history, 3) == points[5:]
        assert make_sampler(name, SPACE, seed=12, mode="min").ask([], 8) != points
        assert all(("momentum" in p) == (p["opt"] == "sgd") for p in points)
        assert all(16 <= p["width"] <= 256 and 1e-4 <= p["lr"] <= 0.1 for p in points)
    first = make_sampler("random", {"x": Float(0.0, 1.0)}, seed=0, mode="min").ask([], 1)
    import random

    assert first == [{"x": random.Random("0:0").random()}]


def _best(sampler: Any, f: Callable[[dict[str, Any]], float], n: int) -> float:
    """The best value of `f` a sequential sweep of `n` asks finds (minimising)."""
    history: list[Trial] = []
    for number in range(n):
        (params,) = sampler.ask(history, 1)
        history.append(Trial(number, params, number, number, f(params), "complete"))
    return min(t.value for t in history if t.value is not None)


QUADRATIC: Space = {"a": Float(-5.0, 5.0), "b": Float(-5.0, 5.0)}


def _quadratic(params: dict[str, Any]) -> float:
    return (params["a"] - 1.5) ** 2 + (params["b"] + 0.5) ** 2


def test_tpe_and_cmaes_find_a_quadratic_s_minimum_closer_than_random() -> None:
    found = {
        name: round(_best(make_sampler(name, QUADRATIC, seed=0, mode="min"), _quadratic, 60), 6)
        for name in ("random", "sobol", "tpe", "cmaes")
    }
    assert found == {"random": 0.167252, "sobol": 0.11569, "tpe": 0.015809, "cmaes": 0.002279}
    assert found["tpe"] < found["random"] / 10 and found["cmaes"] < found["random"] / 10


def test_max_mode_is_optuna_s_maximize() -> None:
    """TPE maximising -f asks exactly what it asks minimising f."""
    low = make_sampler("tpe", QUADRATIC, seed=4, mode="min")
    high = make_sampler("tpe", QUADRATIC, seed=4, mode="max")
    history_low: list[Trial] = []
    history_high: list[Trial] = []
    for number in range(25):
        (a,) = low.ask(history_low, 1)
        (b,) = high.ask(history_high, 1)
        assert a == b
        history_low.append(Trial(number, a, number, number, _quadratic(a), "complete"))
        history_high.append(Trial(number, b, number, number, -_quadratic(b), "complete"))


def test_cmaes_rebuilt_from_trials_is_in_the_same_generation_and_prunes_count() -> None:
    """CMA-ES keeps its optimizer in its trials' attributes: replaying the asks and tells
    rebuilds them, generation and all; pruned trials are PRUNED at their last reported value,
    failed ones FAIL; the conditional and categorical parameters come from its independent
    sampler (they are no part of the CMA-ES search space)."""
    asks = _straight(_makers()["cmaes"])
    history, n, points = asks[-1]
    rebuilt = make_sampler("cmaes", SPACE, seed=3, mode="min")
    assert rebuilt.ask(history, n) == points
    trials = rebuilt._study.trials  # type: ignore[attr-defined]
    generations = [t.system_attrs.get("cma:generation") for t in trials]
    assert generations[-n:] == [1] * n  # one generation told, as in the straight sweep
    states = [t.state.name for t in trials[: len(history)]]
    assert states[3] == "PRUNED" and trials[3].value == trials[3].intermediate_values[2]
    assert states.count("FAIL") == sum(t.state == "failed" for t in history) > 0
    space = rebuilt._make().infer_relative_search_space(rebuilt._study, trials[-1])  # type: ignore[attr-defined]
    assert sorted(space) == ["lr", "width", "x"]


def test_a_history_the_sampler_would_not_draw_is_replayed_as_recorded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    history = [
        Trial(0, {"a": 0.5, "b": 0.25}, 0, 0, 1.0, "complete"),
        Trial(1, {"a": -1.0, "b": 2.0}, 1, None),
    ]
    with caplog.at_level(logging.WARNING, logger="lab.sweeps.samplers"):
        first = make_sampler("tpe", QUADRATIC, seed=0, mode="min").ask(history, 3)
    assert "continuing from the recorded points" in caplog.text
    assert make_sampler("tpe", QUADRATIC, seed=0, mode="min").ask(history, 3) == first


@pytest.mark.parametrize(
    ("history", "message"),
    [
        ([Trial(1, {}, 0)], "a sampler's history holds trials 0, 1, 2, ... in order; pass them so"),
        (
            [Trial(0, {}, 0, 1, 1.0, "complete")],
            "trial tells are numbered [1]; they run 0, 1, 2, ... in the order the trials were told",
        ),
        (
            [Trial(0, {}, 1)],
            "a trial was asked after tells that never happened, or told before it was asked; "
            "record each trial's asked_after as the tells seen when it was asked",
        ),
    ],
)
def test_a_history_out_of_order_is_one_line(history: list[Trial], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_sampler("tpe", QUADRATIC, seed=0, mode="min").ask(history, 1)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("sampler", "package"),
    [("tpe", "optuna"), ("cmaes", "optuna"), ("cmaes", "cmaes"), ("sobol", "scipy")],
)
def test_a_sampler_without_its_package_is_one_line_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, sampler: str, package: str
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # as if it were not installed
    with pytest.raises(ConfigError) as info:
        make_sampler(sampler, QUADRATIC, seed=0, mode="min")
    assert str(info.value).startswith(f"sampler={sampler!r} needs the {package} package: ")
    assert str(info.value).endswith("[sweeps]'")


def test_an_unknown_sampler_or_mode_is_one_line() -> None:
    with pytest.raises(ConfigError) as info:
        make_sampler("bayes", QUADRATIC, seed=0, mode="min")
    assert str(info.value) == (
        "sampler='bayes'; write one of grid, random, sobol, tpe, cmaes, or pass an Optuna sampler"
    )
    with pytest.raises(ConfigError) as info:
        make_sampler(object(), QUADRATIC, seed=0, mode="min")
    assert str(info.value).endswith(
        "write one of grid, random, sobol, tpe, cmaes, or pass an Optuna sampler such as "
        "optuna.samplers.TPESampler(seed=0)"
    )
    with pytest.raises(ConfigError) as info:
        make_sampler("random", QUADRATIC, seed=0, mode="minimize")  # type: ignore[arg-type]
    assert str(info.value) == "mode='minimize'; write mode='min' or mode='max'"
