"""What a metric may be: a key the store can hold and a value that is a number.

Shared by the loop (which turns `loss_fn`'s extra metrics into floats) and the store (which
checks every logged step), so both refuse bad input with the same line, naming the key and
the step. NaN and inf are numbers here: they are data, never errors.
"""

from __future__ import annotations

from collections.abc import Collection
from operator import countOf
from typing import Any

from lab._names import MAX_KEY  # characters a metric key may hold: the `key` columns' width
from lab.errors import MetricError


def check_key(key: Any, step: int) -> None:
    """Refuse a key the store cannot hold, before anything of its step is queued."""
    if not isinstance(key, str) or not key:
        raise MetricError(f"metric key {key!r} at step {step} is not a non-empty string")
    if len(key) > MAX_KEY:
        raise MetricError(
            f"metric key {key[:40]!r}... at step {step} is {len(key)} characters long; "
            f"keys hold at most {MAX_KEY}"
        )
    if "\x00" in key:
        raise MetricError(f"metric key {key!r} at step {step} holds a NUL character")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise MetricError(
            f"metric key {key!r} at step {step} is not valid unicode (a lone surrogate)"
        ) from None


def good_keys(keys: Collection[Any]) -> list[Any]:
    """The keys among `keys` that `check_key` takes (at any step: its test does not depend
    on the step)."""
    good = []
    for key in keys:
        try:
            check_key(key, 0)
        except MetricError:
            continue
        good.append(key)
    return good


def all_floats(values: Collection[Any]) -> bool:
    """Whether every value is exactly a float: one pass in C (`map`, `countOf`), so a step
    of 100 metrics costs its training thread about as little as one of 10. The checks that
    convert or refuse the others (`as_number`) run only when this says no."""
    return countOf(map(type, values), float) == len(values)


def as_number(key: str, step: int, value: Any) -> float:
    """A metric value as a float: ints, bools, numpy scalars and one-element tensors are
    numbers; anything else is a `MetricError` naming the key and the step."""
    if isinstance(value, (int, float)):  # bool too: True is 1.0
        return float(value)
    numel = getattr(value, "numel", None)  # a torch tensor
    if callable(numel):
        if numel() == 1:
            return float(value.item())
        raise MetricError(
            f"metric {key!r} at step {step} is a tensor of shape {tuple(value.shape)}; log a "
            "number or a one-element tensor (e.g. t.mean())"
        )
    if getattr(value, "shape", None) == () and hasattr(value, "dtype"):  # a numpy scalar
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise MetricError(
        f"metric {key!r} at step {step} is a {type(value).__name__} ({value!r:.60}); "
        "log a number (int, float or a one-element tensor)"
    )
