"""Every built-in callback under a registered name, with a pydantic `Config` for its params.

`build([{"kind": "speed_monitor", "params": {"every": 10}}, ...])` makes callbacks from
YAML or JSON. An unknown kind, or a param its `Config` does not declare, is a `ConfigError`
that lists the valid ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import pydantic

from lab._validation import describe
from lab.errors import ConfigError
from lab.hooks import Callback

C = TypeVar("C", bound=type[Callback])

#: kind -> (callback class, its Config). Filled by `register` as the modules are imported.
REGISTRY: dict[str, tuple[type[Callback], type[pydantic.BaseModel]]] = {}


def register(kind: str, config: type[pydantic.BaseModel]) -> Callable[[C], C]:
    """Register a callback class under `kind`; it is built as ``cls(**config(**params))``."""

    def decorate(cls: C) -> C:
        if kind in REGISTRY and REGISTRY[kind][0] is not cls:
            raise ConfigError(f"callback kind {kind!r} is registered twice")
        REGISTRY[kind] = (cls, config)
        cls.Config = config  # type: ignore[attr-defined]
        return cls

    return decorate


def build(specs: Iterable[Mapping[str, Any]]) -> list[Callback]:
    """Callbacks from ``[{"kind": ..., "params": {...}}, ...]``, as a YAML or JSON file holds
    them, so an experiment's sinks and monitors can change without changing code.

    `params` may be left out (the Config's defaults). ``critical: true`` marks that one
    callback critical: its failure fails the run instead of being recorded and counted.
    """
    _load_builtins()
    if isinstance(specs, (Mapping, str, bytes)) or not isinstance(specs, Iterable):
        raise ConfigError(
            f"callbacks must be a list of {{kind, params}} specs, got {type(specs).__name__}; "
            "write [{kind: ..., params: {...}}, ...]"
        )
    out = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, Mapping) or "kind" not in spec:
            raise ConfigError(f"callback spec #{i} is {spec!r}; write {{kind: ..., params: {{}}}}")
        extra = sorted(set(spec) - {"kind", "params", "critical"})
        if extra:
            raise ConfigError(
                f"callback spec #{i} has unknown fields {extra}; use kind, params, critical"
            )
        critical = spec.get("critical", False)
        if not isinstance(critical, bool):
            raise ConfigError(f"callback spec #{i}: critical={critical!r}; use true or false")
        kind = spec["kind"]
        if not isinstance(kind, str) or kind not in REGISTRY:
            raise ConfigError(
                f"unknown callback kind {kind!r}; known: {', '.join(sorted(REGISTRY))}"
            )
        cls, config = REGISTRY[kind]
        params = spec.get("params") or {}
        if not isinstance(params, Mapping):
            raise ConfigError(
                f"{kind}: params must be a mapping of name: value, got "
                f"{type(params).__name__} {params!r}; write params: {{name: value}}"
            )
        params = dict(params)
        unknown = sorted(set(params) - set(config.model_fields))
        if unknown:
            valid = ", ".join(sorted(config.model_fields)) or "none"
            raise ConfigError(f"{kind}: unknown params {unknown}; valid: {valid}")
        try:
            values = config(**params)
        except pydantic.ValidationError as exc:
            raise ConfigError(f"{kind}: {describe(exc, config)}") from None
        callback = cls(**values.model_dump())
        if critical:
            callback.critical = True  # its failure fails the run (see the failure policy)
        out.append(callback)
    return out


def _load_builtins() -> None:
    """Import the modules whose classes register themselves."""
    import importlib

    for module in _BUILTIN_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # a module that exists but lacks a dependency: say so
                raise


_BUILTIN_MODULES = (
    "lab.callbacks.averaging",
    "lab.callbacks.files",
    "lab.callbacks.monitors",
    "lab.callbacks.notify",
    "lab.callbacks.system",
    "lab.loggers.console",
    "lab.loggers.sql",
    "lab.loggers.wandb",
)
