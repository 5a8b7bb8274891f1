"""A pydantic `ValidationError` as one line: where the first problem is, and what it is.

pydantic's own text spans several lines per error. `lab` reports a bad setting in one line
that says how to fix it, so the callback registry and experiment files condense their
validation errors here, the same way.
"""

from __future__ import annotations

import types
import typing
from collections import abc
from typing import Any

import pydantic


def where(loc: tuple[int | str, ...]) -> str:
    """A location as it is written in a file: ``arms[1].name``, ``callbacks[0].params``.

    >>> where(("arms", 1, "name"))
    'arms[1].name'
    """
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def describe(
    exc: pydantic.ValidationError,
    model: type[pydantic.BaseModel] | None = None,
    *,
    at: tuple[int | str, ...] = (),
) -> str:
    """The first problem of `exc` in one line, ``where: what``, so a message can name the fix.

    With the `model` that was validated, an unknown field lists the valid ones (pydantic only
    says extra inputs are not permitted). More problems are counted, not listed: fixing the
    first one and trying again shows the next. `at` is where the validated data sits in a
    larger document (``("base_config",)``), so the location reads as in the file.
    """
    errors = exc.errors()
    first = errors[0]
    loc = tuple(first["loc"])
    kind = first["type"]
    if kind == "extra_forbidden":
        text = f"unknown field {loc[-1]!r}"
        fields = _fields_at(model, loc[:-1]) if model is not None else None
        if fields is not None:
            text += f"; valid: {', '.join(fields)}"
        loc = loc[:-1]
    else:
        text = str(first["msg"]).removeprefix("Value error, ")
        value = first.get("input")
        if kind not in ("value_error", "missing") and isinstance(
            value, str | int | float | bool | None
        ):
            text += f", got {value!r}"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    loc = at + loc
    return f"{where(loc)}: {text}{more}" if loc else f"{text}{more}"


def unknown_field(
    model: type[pydantic.BaseModel], data: Any, *, at: tuple[int | str, ...] = ()
) -> str | None:
    """The first key of `data` that `model` has no field for, as one line naming the valid
    ones; None if every key is known.

    pydantic's default (``extra="ignore"``) drops an unknown key without a word, so a typo
    in a config written by hand (``lrr: 0.1``) would silently leave the default in place.
    Nested models are checked too; a model that allows extra fields accepts any key.
    """
    if not isinstance(data, dict) or model.model_config.get("extra") == "allow":
        return None
    fields = model.model_fields
    by_key = {**{f.alias: f for f in fields.values() if f.alias}, **fields}
    for key, value in data.items():
        field = by_key.get(key)
        if field is None:
            at_key = f"{where(at)}: " if at else ""
            return f"{at_key}unknown field {key!r}; valid: {', '.join(fields)}"
        sub = _model_in(field.annotation)
        if sub is None:
            continue
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            inner = (*at, key) if index is None else (*at, key, index)
            found = unknown_field(sub, item, at=inner)
            if found is not None:
                return found
    return None


def _fields_at(model: type[pydantic.BaseModel], loc: tuple[int | str, ...]) -> list[str] | None:
    """The field names of the model found at `loc` inside `model` (None if it has none)."""
    current: type[pydantic.BaseModel] | None = model
    for part in loc:
        if isinstance(part, int):  # an item of a list: the same model
            continue
        field = current.model_fields.get(part) if current is not None else None
        current = _model_in(field.annotation) if field is not None else None
    return list(current.model_fields) if current is not None else None


def _model_in(annotation: Any) -> type[pydantic.BaseModel] | None:
    """The pydantic model inside an annotation such as ``list[Entry] | None``."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def expected(annotation: Any, metadata: typing.Iterable[Any] = ()) -> str:
    """What a value of `annotation` must be, in words, for the ``use ...`` part of a message:
    ``an int >= 1, or None``, ``'min' or 'max'``, ``a list of strings``.

    `metadata` holds constraints found beside the type (pydantic's ``FieldInfo.metadata``:
    ``Ge(1)``, ``MinLen(1)``...), as ``Annotated`` holds them inside it.

    >>> from typing import Literal
    >>> expected(Literal["min", "max"])
    "'min' or 'max'"
    """
    return _words(annotation, list(metadata), plural=False)


def _words(annotation: Any, meta: list[Any], *, plural: bool) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _words(args[0], [*args[1:], *meta], plural=plural)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        text = " or ".join(_words(a, meta, plural=plural) for a in options)
        return f"{text}, or None" if len(options) < len(args) else text
    if origin is typing.Literal:
        shown = [repr(a) for a in args]
        return " or ".join([", ".join(shown[:-1]), shown[-1]]) if len(shown) > 1 else shown[0]
    bounds = _bounds(meta)
    if annotation is bool:
        return "True or False"
    if annotation is int:
        return ("ints" if plural else "an int") + bounds
    if annotation is float:
        return ("numbers" if plural else "a number") + bounds
    if annotation is str:
        sized = any(getattr(m, "min_length", 0) for m in _flat(meta))
        if sized:
            return "non-empty strings" if plural else "a non-empty string"
        return "strings" if plural else "a string"
    if origin in (list, tuple, set, frozenset) or origin in _SEQUENCES:
        item = args[0] if args else Any
        sized = any(getattr(m, "min_length", 0) for m in _flat(meta))
        what = (
            ("non-empty lists of " if plural else "a non-empty list of ")
            if sized
            else ("lists of " if plural else "a list of ")
        )
        return what + _words(item, [], plural=True)
    if origin is dict or annotation is dict:
        return "mappings" if plural else "a mapping"
    if isinstance(annotation, type) and annotation is not typing.Any:
        return f"{annotation.__name__} objects" if plural else f"a {annotation.__name__}"
    return "valid values" if plural else "a valid value"


_SEQUENCES = (abc.Sequence, abc.MutableSequence, abc.Iterable, abc.Collection, abc.Set)


def _flat(meta: list[Any]) -> list[Any]:
    """Constraints, with those inside a ``pydantic.Field(...)`` taken out of it."""
    out: list[Any] = []
    for m in meta:
        out.extend(m.metadata if isinstance(m, pydantic.fields.FieldInfo) else [m])
    return out


def _bounds(meta: list[Any]) -> str:
    """`` >= 1``, `` > 0 and <= 2``: the numeric bounds among the constraints."""
    parts = []
    for m in _flat(meta):
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(m, attr, None)
            if value is not None and type(m).__name__.lower() == attr:
                parts.append(f"{sign} {value}")
    return (" " + " and ".join(parts)) if parts else ""
