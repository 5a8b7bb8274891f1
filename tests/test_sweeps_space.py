"""A sweep's space, in Python and in a file's YAML, and the `Sweep` that holds it: every bad
space is one line that says what to write instead."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import yaml

from lab.errors import ConfigError
from lab.sweeps import Choice, Float, Int, Sweep, check_space, parse_space
from lab.sweeps.space import active

SPACE = {
    "lr": Float(1e-4, 1e-1, log=True),
    "width": Int(16, 256, log=True),
    "opt": Choice(["adam", "sgd", "nesterov"]),
    "momentum": Float(0.0, 0.99, when={"opt": ["sgd", "nesterov"]}),
    "dampening": Choice([0.0, 0.1], when={"momentum": 0.5}),
}


def test_a_file_s_space_is_the_python_space() -> None:
    text = """
    lr: {float: [1e-4, 0.1], log: true}
    width: {int: [16, 256], log: true}
    opt: {choice: [adam, sgd, nesterov]}
    momentum: {float: [0, 0.99], when: {opt: [sgd, nesterov]}}
    dampening: {choice: [0.0, 0.1], when: {momentum: 0.5}}
    """
    assert parse_space(yaml.safe_load(text), "exp.yaml: sweep.space") == SPACE
    assert check_space(SPACE) == SPACE and list(check_space(SPACE)) == list(SPACE)
    assert Float(0, 1) == Float(0.0, 1.0) and Int(1.0, 3) == Int(1, 3)  # type: ignore[arg-type]
    assert SPACE["momentum"].when == {"opt": ("sgd", "nesterov")}


def test_active_is_the_parameters_whose_when_holds() -> None:
    assert list(active(SPACE, {"opt": "adam"})) == ["lr", "width", "opt"]
    assert list(active(SPACE, {"opt": "sgd", "momentum": 0.2})) == [
        "lr", "width", "opt", "momentum",
    ]  # fmt: skip
    assert list(active(SPACE, {"opt": "sgd", "momentum": 0.5})) == list(SPACE)
    assert list(active(SPACE, {"opt": "adam", "momentum": 0.5})) == ["lr", "width", "opt"]
    assert list(active(SPACE, {})) == ["lr", "width", "opt"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: Float(0.1, 0.01),
            "Float(0.1, 0.01): low must be below high; write Float(0.01, 0.1)",
        ),
        (
            lambda: Float(0.5, 0.5),
            "Float(0.5, 0.5): low equals high; a single value is no parameter: set it in the "
            "base config, or use Choice([...])",
        ),
        (
            lambda: Float(0.0, 1.0, log=True),
            "Float(0.0, 1.0, log=True): log=True needs low > 0; write e.g. "
            "Float(1e-4, 0.1, log=True)",
        ),
        (
            lambda: Int(0, 8, log=True),
            "Int(0, 8, log=True): log=True needs low > 0; write e.g. Int(16, 256, log=True)",
        ),
        (
            lambda: Int(1, 2.5),
            "Int(1, 2.5): high is 2.5; give a finite number, e.g. Int(1, 8)",
        ),
        (
            lambda: Float(0, float("inf")),
            "Float(0, inf): high is inf; give a finite number, e.g. Float(0.001, 0.1)",
        ),
        (
            lambda: Float("a", 1),
            "Float('a', 1): low is 'a'; give a finite number, e.g. Float(0.001, 0.1)",
        ),
        (lambda: Choice([]), "Choice([]): give a non-empty list of values, e.g. Choice(['adam'])"),
        (
            lambda: Choice(["a", ["b"]]),
            "Choice(['a', ['b']]): ['b'] is not a JSON scalar; choose among strings, finite "
            "numbers, booleans and None (name a structure by a string)",
        ),
        (
            lambda: Choice([1, True]),
            "Choice([1, True]): True appears twice (Python holds 1 == True); list each value once",
        ),
        (
            lambda: Float(0, 1, when="opt"),
            "Float(0.0, 1.0): when='opt'; write a mapping of earlier parameter to value(s), e.g. "
            "when={'opt': 'sgd'} or when={'opt': ['sgd', 'nesterov']}",
        ),
    ],
)
def test_a_bad_parameter_is_one_line(make: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        make()
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("space", "message"),
    [
        (
            {},
            "space={}; give a non-empty dict of override key to parameter, e.g. "
            "{'lr': Float(1e-4, 0.1, log=True)}",
        ),
        ({"": Float(0, 1)}, "space key '': write an override key such as 'lr' or 'optim.lr'"),
        (
            {"lr": [0.1, 0.01]},
            "space['lr'] is [0.1, 0.01]; write Float(low, high), Int(low, high) or Choice([...]) "
            "(from lab.sweeps)",
        ),
        (
            {"m": Float(0, 1, when={"opt": "sgd"}), "opt": Choice(["sgd"])},
            "space['m']: when names 'opt', which is no earlier parameter (it comes later: move "
            "it above); name one of none: put the parameter it depends on first",
        ),
        (
            {"opt": Choice(["sgd"]), "m": Float(0, 1, when={"optim": "sgd"})},
            "space['m']: when names 'optim', which is no earlier parameter; name one of ['opt']",
        ),
        (
            {"opt": Choice(["sgd"]), "m": Float(0, 1, when={"opt": ["sgd", "adamw"]})},
            "space['m']: when 'opt' is 'adamw', a value 'opt' never takes "
            "(Choice(values=('sgd',), when=None)); name values it can take",
        ),
        (
            {"n": Int(1, 4), "m": Float(0, 1, when={"n": 5})},
            "space['m']: when 'n' is 5, a value 'n' never takes "
            "(Int(low=1, high=4, log=False, when=None)); name values it can take",
        ),
    ],
)
def test_a_bad_space_is_one_line(space: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_space(space)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[lr]", "exp.yaml: sweep.space: ['lr']; write a mapping of override key to parameter, "
         "e.g. lr: {float: [1e-4, 0.1], log: true}"),
        ("lr: {float: [1e-4, 0.1], logg: true}",
         "exp.yaml: sweep.space.lr: {'float': ['1e-4', 0.1], 'logg': True}; write one of "
         "{float: [low, high]}, {int: [low, high]} or {choice: [a, b]}, with log: true and "
         "when: {param: value} where needed (unknown: logg)"),
        ("lr: {float: 0.1}", "exp.yaml: sweep.space.lr: float: 0.1; write float: [low, high]"),
        ("opt: {choice: [a, b], log: true}",
         "exp.yaml: sweep.space.opt: a choice has no log; drop log"),
        ("lr: {float: [0.1, 1e-4]}",
         "exp.yaml: sweep.space.lr: Float(0.1, 0.0001): low must be below high; "
         "write Float(0.0001, 0.1)"),
        ("m: {float: [0, 1], when: {opt: sgd}}",
         "exp.yaml: sweep.space: space['m']: when names 'opt', which is no earlier parameter; "
         "name one of none: put the parameter it depends on first"),
    ],
)  # fmt: skip
def test_a_bad_file_space_is_one_line_naming_where(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_space(yaml.safe_load(text), "exp.yaml: sweep.space")
    assert str(info.value) == message


def test_a_sweep_checks_its_arguments_and_names_its_arms() -> None:
    sweep = Sweep(SPACE, sampler="tpe", arms=16, seed=1, metric="val/loss", mode="min")
    assert sweep.space == SPACE and sweep.batch is None
    assert [sweep.arm_name(n, {}) for n in (0, 7, 15)] == ["s000", "s007", "s015"]
    assert Sweep(SPACE, arms=1001).arm_name(7, {}) == "s0007"
    assert Sweep(SPACE, arms=1000).arm_name(7, {}) == "s007"
    grid = Sweep({"lr": Choice([0.01, 0.1]), "wd": Int(0, 1)}, sampler="grid")
    assert grid.arm_name(1, {"lr": 0.01, "wd": 1}) == "lr=0.01,wd=1"
    assert grid.make_sampler().ask([], 5) == [
        {"lr": 0.01, "wd": 0}, {"lr": 0.01, "wd": 1}, {"lr": 0.1, "wd": 0}, {"lr": 0.1, "wd": 1},
    ]  # fmt: skip
    assert sweep.make_sampler().name == "tpe"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sampler": "bayes"}, "Sweep(sampler='bayes'): write one of grid, random, sobol, tpe, "
         "cmaes, or pass an Optuna sampler"),
        ({"arms": 0}, "arms=0; give an int >= 1, e.g. arms=16"),
        ({"arms": True}, "arms=True; give an int >= 1, e.g. arms=16"),
        ({"batch": 0}, "batch=0; give an int >= 1, e.g. batch=4"),
        ({"seed": "0"}, "Sweep(seed='0'): give an int, e.g. seed=0"),
        ({"metric": ""}, "Sweep(metric=''): name the metric the arms are judged by, "
         "e.g. metric='val/loss'"),
        ({"mode": "minimize"}, "Sweep(mode='minimize'): write mode='min' or mode='max'"),
        ({"sampler": "grid"}, "a grid cannot enumerate space['lr'] = Float(low=0.0001, "
         "high=0.1, log=True, when=None); write Choice([...]) of the values to try, or use "
         "sampler='random' or 'sobol'"),
    ],
)  # fmt: skip
def test_a_bad_sweep_is_one_line(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Sweep(SPACE, **kwargs)
    assert str(info.value) == message


def test_a_sweep_without_optuna_is_one_line_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "optuna", None)  # as if it were not installed
    assert Sweep(SPACE, sampler="random").make_sampler().name == "random"
    with pytest.raises(ConfigError) as info:
        Sweep(SPACE, sampler="tpe")
    assert str(info.value).startswith("Sweep(sampler='tpe') needs the optuna package: ")
    assert str(info.value).endswith("[sweeps]'")
