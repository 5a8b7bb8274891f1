"""A pydantic `ValidationError` as one line: where the first problem is, and what it is.

pydantic's own text spans several lines per error. `lab` reports a bad setting in one line
that says how to fix it, so the callback registry and experiment files condense their
validation errors here, the same way.
"""

from __future__ import annotations

import types
import typing
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
