"""What goes into a checkpoint: only values that a safe load (weights_only=True) accepts.

Any loop that saves through `CheckpointManager` (the run handle, and so TrainingLoop, or a
user's own loop) builds its save with these helpers:

- `callback_states` collects each stateful callback's `state_dict()`, refusing at save time
  (naming the callback) a state that `torch.load(..., weights_only=True)` would refuse at
  resume.
- `check_safe` and `json_info` are the checks `CheckpointManager.save` runs on the state and
  on `training_info.json`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from lab.errors import CheckpointError

# What `torch.load(..., weights_only=True)` rebuilds without an allow-list.
_LEAVES = frozenset(
    {str, bytes, bytearray, int, float, complex, bool, type(None)}
    | {torch.Tensor, torch.nn.Parameter, torch.Size, torch.device, torch.dtype}
)
_CONTAINERS = frozenset((dict, OrderedDict, Counter, list, tuple, set))


def callback_states(keyed: Mapping[str, Any]) -> dict[str, Any]:
    """Each callback's `state_dict()` under its key, checked to load with weights_only=True.

    Why: a state that a safe load refuses would only fail at resume, when the run is already
    lost; here it fails at the save, in one line naming the callback and the value's type.
    """
    states = {}
    for key, callback in keyed.items():
        state = callback.state_dict()
        bad = _unsafe(state, "")
        if bad is not None:
            where, kind = bad
            raise CheckpointError(
                f"{type(callback).__name__} (state key {key!r}) returns a state_dict() holding "
                f"{kind} at state{where}, which a checkpoint cannot load safely "
                "(weights_only=True); return plain types: tensors, dicts, lists, str, int, "
                "float, bool, None (e.g. float(x), x.tolist(), torch.as_tensor(x))"
            )
        states[key] = state
    return states


def check_safe(step: int, state: Any) -> None:
    """Raise CheckpointError when `state` holds something weights_only=True would refuse."""
    bad = _unsafe(state, "")
    if bad is not None:
        where, kind = bad
        raise CheckpointError(
            f"cannot save step {step}: the state holds {kind} at state{where}, which a "
            "checkpoint cannot load safely (weights_only=True); save plain types: tensors, "
            "dicts, lists, str, int, float, bool, None"
        )


def _unsafe(obj: Any, where: str) -> tuple[str, str] | None:
    """Where `obj` first holds a type a safe load refuses, and that type's name; or None.

    The path is kept as (parent, key) links and spelled out only for the offending value, so a
    save's walk over a model's state costs a few microseconds per tensor.
    """
    todo: list[tuple[Any, Any]] = [(obj, None)]
    seen: set[int] = set()
    while todo:
        value, at = todo.pop()
        kind = type(value)
        if kind in _LEAVES:
            continue
        if kind not in _CONTAINERS:
            return where + _spell(at), f"{kind.__module__}.{kind.__qualname__}"
        if id(value) in seen:  # shared or cyclic: pickled once
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            for k, v in value.items():
                todo.append((k, (at, k, True)))
                todo.append((v, (at, k, False)))
        elif not all(type(v) in _LEAVES for v in value):  # e.g. an RNG state: 625 ints
            todo.extend((v, (at, i, False)) for i, v in enumerate(value))
    return None


def _spell(at: Any) -> str:
    parts = []
    while at is not None:
        at, key, is_key = at
        parts.append(f"[{key!r}] (a key)" if is_key else f"[{key!r}]")
    return "".join(reversed(parts))


def json_info(step: int, info: Mapping[str, Any]) -> dict[str, Any]:
    """`info` with numpy scalars and 0-d tensors or arrays made Python numbers, for JSON.

    Anything else that JSON cannot hold (a tensor or array with dimensions, an object) is one
    CheckpointError line naming its key. `info["metrics"]` is checked by the manager itself.
    """
    return {
        str(k): v if k == "metrics" else _json_value(step, v, f"info[{k!r}]")
        for k, v in info.items()
    }


def _json_value(step: int, value: Any, where: str) -> Any:
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, Mapping):
        return {
            _json_key(step, k, where): _json_value(step, v, f"{where}[{k!r}]")
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_json_value(step, v, f"{where}[{i}]") for i, v in enumerate(value)]
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "item"):  # a tensor, a numpy array or scalar
        if len(shape) == 0:
            return value.item()
        raise CheckpointError(
            f"save(step={step}): {where} is a {type(value).__name__} of shape "
            f"{tuple(shape)}; training_info.json holds JSON values: convert it with .tolist()"
        )
    raise CheckpointError(
        f"save(step={step}): {where} is a {type(value).__module__}.{type(value).__name__}, "
        "which training_info.json cannot hold; give str, int, float, bool, None, or lists "
        "and dicts of them"
    )


def _json_key(step: int, key: Any, where: str) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    raise CheckpointError(
        f"save(step={step}): {where} has the key {key!r} ({type(key).__name__}); "
        "training_info.json keys are strings"
    )
