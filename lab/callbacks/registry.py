"""Every built-in callback under a registered name, with a pydantic `Config` for its params.

`build([{"kind": "speed_monitor", "params": {"every": 10}}, ...])` makes callbacks from
YAML or JSON. An unknown kind, or a param its `Config` does not declare, is a `ConfigError`
that lists the valid ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import pydantic

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
    """Callbacks from ``[{"kind": ..., "params": {...}}, ...]`` (params may be left out)."""
    _load_builtins()
    out = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, Mapping) or "kind" not in spec:
            raise ConfigError(f"callback spec #{i} is {spec!r}; write {{kind: ..., params: {{}}}}")
        extra = sorted(set(spec) - {"kind", "params"})
        if extra:
            raise ConfigError(f"callback spec #{i} has unknown fields {extra}; use kind, params")
        kind = spec["kind"]
        if kind not in REGISTRY:
            raise ConfigError(
                f"unknown callback kind {kind!r}; known: {', '.join(sorted(REGISTRY))}"
            )
        cls, config = REGISTRY[kind]
        params = dict(spec.get("params") or {})
        unknown = sorted(set(params) - set(config.model_fields))
        if unknown:
            valid = ", ".join(sorted(config.model_fields)) or "none"
            raise ConfigError(f"{kind}: unknown params {unknown}; valid: {valid}")
        try:
            values = config(**params)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"{kind}: {where}: {first['msg']}") from None
        out.append(cls(**values.model_dump()))
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
    "lab.callbacks.files",
    "lab.callbacks.monitors",
    "lab.callbacks.notify",
    "lab.loggers.console",
    "lab.loggers.wandb",
)
