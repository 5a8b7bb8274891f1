"""The space a sweep samples: floats (linear or log), ints, choices, and conditionals.

A space is a dict of arm override keys (dotted keys reach nested configs, as `Arm` does) to
parameters, in the order they are sampled::

    space = {
        "lr": Float(1e-4, 1e-1, log=True),
        "opt": Choice(["adam", "sgd"]),
        "momentum": Float(0.0, 0.99, when={"opt": "sgd"}),  # only when opt == "sgd"
    }

A parameter with ``when`` exists only when the earlier parameters it names took one of the
values given; an inactive parameter is left out of the arm's overrides, so the base config's
value holds. An experiment file writes the same space as data (`parse_space`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from lab.errors import ConfigError

__all__ = ["Choice", "Float", "Int", "Param", "Space", "active", "check_space", "parse_space"]


def _when(when: Mapping[str, Any] | None, owner: str) -> dict[str, tuple[Any, ...]]:
    """`when` as {parameter: (values it may take)}: one value or a list of them each."""
    if when is None:
        return {}
    if not isinstance(when, Mapping) or not when:
        raise ConfigError(
            f"{owner}: when={when!r}; write a mapping of earlier parameter to value(s), "
            "e.g. when={'opt': 'sgd'} or when={'opt': ['sgd', 'nesterov']}"
        )
    out = {}
    for key, values in when.items():
        values = tuple(values) if isinstance(values, list | tuple) else (values,)
        if not isinstance(key, str) or not values:
            raise ConfigError(
                f"{owner}: when={when!r}; each key names an earlier parameter and each value "
                "is one value or a non-empty list, e.g. when={'opt': ['sgd', 'nesterov']}"
            )
        out[key] = values
    return out


def _number(value: Any, kind: type, owner: str, what: str) -> Any:
    """`value` as a finite number of `kind` (YAML reads ``1e-4`` as text: it is read back)."""
    if kind is float and isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok or not math.isfinite(value):
        example = "Int(1, 8)" if kind is int else "Float(0.001, 0.1)"
        raise ConfigError(f"{owner}: {what} is {value!r}; give a finite number, e.g. {example}")
    return kind(value)


def _check_range(param: Float | Int, kind: type, example: str) -> None:
    """Set `param`'s bounds as numbers of `kind` and its `when` as a mapping, or raise the
    one line that says what to write (low above high, log of a non-positive low...)."""
    name = type(param).__name__
    log = ", log=True" if param.log else ""
    owner = f"{name}({param.low!r}, {param.high!r}{log})"
    low = _number(param.low, kind, owner, "low")
    high = _number(param.high, kind, owner, "high")
    owner = f"{name}({low!r}, {high!r}{log})"
    if not isinstance(param.log, bool):
        raise ConfigError(f"{owner}: log={param.log!r}; write log=True or log=False")
    if not low < high:
        raise ConfigError(
            f"{owner}: low must be below high; write {name}({high!r}, {low!r})"
            if low > high
            else f"{owner}: low equals high; a single value is no parameter: set it in the "
            "base config, or use Choice([...])"
        )
    if param.log and low <= 0:
        raise ConfigError(f"{owner}: log=True needs low > 0; write e.g. {example}")
    object.__setattr__(param, "low", low)
    object.__setattr__(param, "high", high)
    object.__setattr__(param, "when", _when(param.when, owner) or None)


@dataclass(frozen=True)
class Float:
    """A float between `low` and `high`, uniform, or uniform in its logarithm (``log=True``,
    for learning rates and other scales that span decades)."""

    low: float
    high: float
    log: bool = False
    when: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        _check_range(self, float, "Float(1e-4, 0.1, log=True)")


@dataclass(frozen=True)
class Int:
    """An int from `low` to `high`, both included; ``log=True`` samples its logarithm
    uniformly (widths 16..256: as many draws below 64 as above)."""

    low: int
    high: int
    log: bool = False
    when: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        _check_range(self, int, "Int(16, 256, log=True)")


def _scalar(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, str | int | bool)


@dataclass(frozen=True)
class Choice:
    """One of `values` (JSON scalars: strings, numbers, booleans, null), each as likely."""

    values: tuple[Any, ...]
    when: Mapping[str, Any] | None = None

    def __init__(self, values: Any, when: Mapping[str, Any] | None = None) -> None:
        owner = f"Choice({values!r})"
        if isinstance(values, str | bytes) or not isinstance(values, list | tuple) or not values:
            raise ConfigError(f"{owner}: give a non-empty list of values, e.g. Choice(['adam'])")
        bad = [v for v in values if not _scalar(v)]
        if bad:
            raise ConfigError(
                f"{owner}: {bad[0]!r} is not a JSON scalar; choose among strings, finite "
                "numbers, booleans and None (name a structure by a string)"
            )
        for i, value in enumerate(values):
            same = [v for v in values[:i] if v == value]
            if same:
                raise ConfigError(
                    f"{owner}: {value!r} appears twice (Python holds {same[0]!r} == "
                    f"{value!r}); list each value once"
                )
        object.__setattr__(self, "values", tuple(values))
        object.__setattr__(self, "when", _when(when, owner) or None)


Param: TypeAlias = Float | Int | Choice
Space: TypeAlias = dict[str, Param]


def _can_take(param: Param, value: Any) -> bool:
    """Whether `param` can take `value` (what a `when` of a later parameter names)."""
    if isinstance(param, Choice):
        return any(v == value and type(v) is type(value) for v in param.values)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(param, Int) and not float(value).is_integer():
        return False
    return param.low <= value <= param.high


def check_space(space: Mapping[str, Any]) -> Space:
    """`space` as a `Space`, or a ConfigError that names the bad key and what to write: the
    check runs when a sweep is declared, so a typo in a `when` fails before any run."""
    if not isinstance(space, Mapping) or not space:
        raise ConfigError(
            f"space={space!r}; give a non-empty dict of override key to parameter, "
            "e.g. {'lr': Float(1e-4, 0.1, log=True)}"
        )
    out: Space = {}
    for key, param in space.items():
        if not isinstance(key, str) or not key or key != key.strip() or ".." in key:
            raise ConfigError(
                f"space key {key!r}: write an override key such as 'lr' or 'optim.lr'"
            )
        if not isinstance(param, Float | Int | Choice):
            raise ConfigError(
                f"space[{key!r}] is {param!r}; write Float(low, high), Int(low, high) or "
                "Choice([...]) (from lab.sweeps)"
            )
        for name, values in (param.when or {}).items():
            if name not in out:
                later = " (it comes later: move it above)" if name in space else ""
                known = sorted(out) or "none: put the parameter it depends on first"
                raise ConfigError(
                    f"space[{key!r}]: when names {name!r}, which is no earlier parameter"
                    f"{later}; name one of {known}"
                )
            never = [v for v in values if not _can_take(out[name], v)]
            if never:
                raise ConfigError(
                    f"space[{key!r}]: when {name!r} is {never[0]!r}, a value {name!r} never "
                    f"takes ({out[name]!r}); name values it can take"
                )
        out[key] = param
    return out


def active(space: Space, params: Mapping[str, Any]) -> Space:
    """The parameters of `space` that exist for `params` (those whose `when` holds, and
    whose `when` names parameters that exist themselves): what a sampler draws, and what
    becomes an arm's overrides. `params` may be partial, as while a point is drawn."""
    out: Space = {}
    for key, param in space.items():
        if all(
            name in out and name in params and any(params[name] == v for v in values)
            for name, values in (param.when or {}).items()
        ):
            out[key] = param
    return out


_KINDS = {"float": Float, "int": Int, "choice": Choice}


def parse_space(data: Any, where: str) -> Space:
    """A file's ``space:`` section as a `Space`: ``lr: {float: [1e-4, 0.1], log: true}``,
    ``width: {int: [16, 256]}``, ``opt: {choice: [adam, sgd]}``, ``momentum: {float: [0,
    0.99], when: {opt: sgd}}``. `where` names the section in the one-line error
    (``exp.yaml: sweep.space``)."""
    if not isinstance(data, Mapping) or not data:
        raise ConfigError(
            f"{where}: {data!r}; write a mapping of override key to parameter, "
            "e.g. lr: {float: [1e-4, 0.1], log: true}"
        )
    built: dict[Any, Any] = {}
    for key, entry in data.items():
        at = f"{where}.{key}"
        kinds = [k for k in _KINDS if isinstance(entry, Mapping) and k in entry]
        extra = sorted(set(entry) - {*_KINDS, "log", "when"}) if isinstance(entry, Mapping) else []
        if len(kinds) != 1 or extra:
            raise ConfigError(
                f"{at}: {entry!r}; write one of {{float: [low, high]}}, {{int: [low, high]}} "
                "or {choice: [a, b]}, with log: true and when: {param: value} where needed"
                + (f" (unknown: {', '.join(map(str, extra))})" if extra else "")
            )
        kind, args = kinds[0], entry[kinds[0]]
        if kind != "choice" and (not isinstance(args, list) or len(args) != 2):
            raise ConfigError(f"{at}: {kind}: {args!r}; write {kind}: [low, high]")
        if kind == "choice" and "log" in entry:
            raise ConfigError(f"{at}: a choice has no log; drop log")
        try:
            if kind == "choice":
                built[key] = Choice(args, when=entry.get("when"))
            else:
                built[key] = _KINDS[kind](
                    *args, log=entry.get("log", False), when=entry.get("when")
                )
        except ConfigError as exc:
            raise ConfigError(f"{at}: {exc}") from None
    try:
        return check_space(built)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
