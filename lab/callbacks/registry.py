"""Every built-in callback under a registered name; its parameters are stated once, in
``__init__``'s signature.

`register` builds the callback's pydantic `Config` from that signature (the annotations,
with constraints such as `PositiveInt` from `lab.callbacks.params`, and the defaults) and
wraps ``__init__`` so that every call is checked against it. `build([{"kind":
"speed_monitor", "params": {"every": 10}}, ...])` makes callbacks from YAML or JSON by
calling the class, so Python and a file go through the same check and get the same one-line
`ConfigError`, ``SpeedMonitor(every=0): use an int >= 1``. An unknown kind, or a param the
signature does not have, lists the valid ones.
"""

from __future__ import annotations

import functools
import inspect
import reprlib
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import pydantic

from lab._validation import expected
from lab.errors import ConfigError
from lab.hooks import Callback

C = TypeVar("C", bound=type[Callback])

#: kind -> (callback class, its Config). Filled by `register` as the modules are imported.
REGISTRY: dict[str, tuple[type[Callback], type[pydantic.BaseModel]]] = {}

_CHECKED = "__lab_checked__"  # set on an __init__ that `register` wrapped
_repr = reprlib.Repr()
_repr.maxstring, _repr.maxother, _repr.maxlist = 60, 60, 8


def register(
    kind: str, config: type[pydantic.BaseModel] | None = None, *, live: Sequence[str] = ()
) -> Callable[[C], C]:
    """Register a callback class under `kind`, so a file can name it, and check its params.

    The class's `Config` is built from ``__init__``'s signature (or given as `config`, a
    pydantic model whose fields match the signature), and ``__init__`` is wrapped to
    validate every argument against it: a callback states its parameters once and Python
    and YAML check them the same way. `live` names constructor arguments that are live
    objects (a stream, a console), which a file cannot hold: they are not checked.
    """

    def decorate(cls: C) -> C:
        if kind in REGISTRY and REGISTRY[kind][0] is not cls:
            raise ConfigError(f"callback kind {kind!r} is registered twice")
        model = config if config is not None else config_from_signature(cls, live=live)
        REGISTRY[kind] = (cls, model)
        cls.Config = model  # type: ignore[attr-defined]  # made here, for each registered class
        if not getattr(cls.__init__, _CHECKED, False):  # its own, or an inherited unchecked one
            cls.__init__ = _checked_init(cls, model)  # type: ignore[method-assign]  # the point
        return cls

    return decorate


def config_from_signature(
    cls: type[Any], *, live: Sequence[str] = (), name: str | None = None
) -> type[pydantic.BaseModel]:
    """A pydantic model with one field per parameter of ``cls.__init__`` (less `live`):
    the annotation is the field's type, the default its default, and unknown fields are
    rejected. It is ``cls.Config`` (pickled by reference, as ``<module>.<Class>.Config``).
    """
    init = cls.__init__
    params = inspect.signature(init).parameters
    unknown = sorted(set(live) - set(params))
    if unknown:
        raise ConfigError(f"{cls.__name__}: live={unknown} are not parameters of __init__")
    raw = inspect.get_annotations(inspect.unwrap(init))
    namespace = getattr(inspect.unwrap(init), "__globals__", {})
    fields: dict[str, Any] = {}
    for pname, p in list(params.items())[1:]:  # [0] is self
        if pname in live or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        try:
            annotation = _resolve(raw.get(pname, Any), namespace)
        except NameError as exc:
            raise ConfigError(
                f"{cls.__name__}({pname}: {raw[pname]}): {exc}; import it at the top of "
                f"{cls.__module__}, where the annotation is looked up"
            ) from None
        fields[pname] = (annotation, ... if p.default is p.empty else p.default)
    model = pydantic.create_model(
        name or f"{cls.__name__}Config",
        __config__=pydantic.ConfigDict(extra="forbid", arbitrary_types_allowed=True),
        __module__=cls.__module__,
        __doc__=f"The params of `{cls.__name__}`, built from its signature.",
        **fields,
    )
    model.__qualname__ = f"{cls.__qualname__}.Config"
    return model


def _resolve(annotation: Any, namespace: dict[str, Any]) -> Any:
    """A string annotation (``from __future__ import annotations``) as the type it names,
    looked up in the callback's module; constraints inside ``Annotated`` are kept."""
    if not isinstance(annotation, str):
        return annotation

    def holder() -> None: ...

    holder.__annotations__ = {"x": annotation}
    return typing.get_type_hints(holder, globalns=namespace, include_extras=True)["x"]


def _checked_init(cls: type[Any], model: type[pydantic.BaseModel]) -> Callable[..., None]:
    """``cls.__init__``, checking each given argument against `model` first and passing on
    what it validated (a list for a tuple becomes a tuple, an int for a float a float).

    Arguments left out keep their defaults unchecked; a wrong call (a missing or unknown
    argument) is Python's TypeError, as for any function.
    """
    init = cls.__init__
    signature = inspect.signature(init)
    fields = model.model_fields

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        given = {k: v for k, v in bound.arguments.items() if k in fields}
        try:
            checked = model.model_validate(given)
        except pydantic.ValidationError as exc:
            raise ConfigError(param_error(cls.__name__, model, exc, given)) from None
        for key in given:
            value = getattr(checked, key)
            if not (isinstance(given[key], str) and given[key] == value):  # a str subclass
                bound.arguments[key] = value  # (such as a resolved StoreURL) stays itself
        init(*bound.args, **bound.kwargs)

    setattr(__init__, _CHECKED, True)
    return __init__


def param_error(
    owner: str, model: type[pydantic.BaseModel], exc: pydantic.ValidationError, given: Any
) -> str:
    """The first problem of `exc` as one line, ``Owner(param=value): use ...``: the owner,
    the parameter, the value it got and what to give instead."""
    errors = exc.errors()
    first = errors[0]
    param = str(first["loc"][0]) if first["loc"] else ""
    value = given.get(param, first.get("input")) if isinstance(given, Mapping) else None
    if first["type"] == "value_error":  # a validator's own words
        fix = str(first["msg"]).removeprefix("Value error, ")
    elif param in model.model_fields:
        field = model.model_fields[param]
        fix = f"use {expected(field.annotation, field.metadata)}"
    else:
        fix = str(first["msg"])
    others = {e["loc"][0] for e in errors if e["loc"]} - {param}  # one per param, not per branch
    more = f" (and {len(others)} more)" if others else ""
    return f"{owner}({param}={_repr.repr(value)}): {fix}{more}"


def build(specs: Iterable[Mapping[str, Any]]) -> list[Callback]:
    """Callbacks from ``[{"kind": ..., "params": {...}}, ...]``, as a YAML or JSON file holds
    them, so an experiment's sinks and monitors can change without changing code.

    `params` may be left out (the Config's defaults). ``critical: true`` marks that one
    callback critical: its failure fails the run instead of being recorded and counted.
    """
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
        if isinstance(kind, str) and kind not in REGISTRY and kind in _BUILTIN_KINDS:
            _load(_BUILTIN_KINDS[kind])
        if not isinstance(kind, str) or kind not in REGISTRY:
            _load_builtins()  # to name every kind there is
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
        fields = config.model_fields
        unknown = sorted(set(params) - set(fields))
        if unknown:
            valid = ", ".join(sorted(fields)) or "none"
            raise ConfigError(f"{kind}: unknown params {unknown}; valid: {valid}")
        missing = [n for n, f in fields.items() if f.is_required() and n not in params]
        if missing:
            raise ConfigError(
                f"{kind}: missing params {missing}; write params: {{{missing[0]}: ...}}"
            )
        callback = cls(**params)  # checked by the class itself, as from Python
        if critical:
            callback.critical = True  # its failure fails the run (see the failure policy)
        out.append(callback)
    return out


def kinds() -> list[str]:
    """Every callback kind a spec may name, built in or registered: what `REGISTRY` alone
    does not say, since a built-in kind registers only once its module is imported."""
    return sorted(set(REGISTRY) | set(_BUILTIN_KINDS))


def _load_builtins() -> None:
    """Import the modules whose classes register themselves."""
    for module in sorted(set(_BUILTIN_KINDS.values())):
        _load(module)


def _load(module: str) -> None:
    import importlib

    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:  # a module that exists but lacks a dependency: say so
            raise


#: Where each built-in kind registers itself: `build` imports only the modules of the kinds
#: it is given (some bring torch; a file that names none of them is checked without it).
#: tests/test_registry.py holds it equal to what importing the modules registers.
_BUILTIN_KINDS = {
    "model_averager": "lab.callbacks.averaging",
    "config_saver": "lab.callbacks.files",
    "metric_saver": "lab.callbacks.files",
    "speed_monitor": "lab.callbacks.monitors",
    "gpu_memory_monitor": "lab.callbacks.monitors",
    "stability_monitor": "lab.callbacks.monitors",
    "gradient_monitor": "lab.callbacks.monitors",
    "profiler": "lab.callbacks.monitors",
    "garbage_collector": "lab.callbacks.monitors",
    "early_stopping": "lab.callbacks.monitors",
    "notifier": "lab.callbacks.notify",
    "system_monitor": "lab.callbacks.system",
    "console_logger": "lab.loggers.console",
    "jsonl_logger": "lab.loggers.jsonl",
    "sql_logger": "lab.loggers.sql",
    "wandb_logger": "lab.loggers.wandb",
}
