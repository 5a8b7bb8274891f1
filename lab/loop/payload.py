"""What goes into a checkpoint: only values that a safe load (weights_only=True) accepts.

Any loop that saves through `CheckpointManager` (the run handle, and so TrainingLoop, or a
user's own loop) builds its save with these helpers:

- `callback_states` collects each stateful callback's `state_dict()`, refusing at save time
  (naming the callback) a state that `torch.load(..., weights_only=True)` would refuse at
  resume.
- `check_safe` and `json_info` are the checks `CheckpointManager.save` runs on the state and
  on `training_info.json`.

And what comes back out on resume: `load_model`, `load_states` (optimizers, schedulers) and
`load_callback_states`, each failing in one line that names the checkpoint and the fix.
"""

from __future__ import annotations

import re
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from lab._secrets import logger
from lab.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from lab.dispatch import Dispatcher
    from lab.hooks import Callback

log = logger("lab.loop")

# Callback states in checkpoints written before they were keyed by class: "{index}:{Class}",
# the index counting the stateful callbacks in dispatch order. New keys never hold a ":".
_INDEX_KEY = re.compile(r"(\d+):(\w+)")

# What `torch.load(..., weights_only=True)` rebuilds without an allow-list.
_LEAVES = frozenset(
    {str, bytes, bytearray, int, float, complex, bool, type(None)}
    | {torch.Tensor, torch.nn.Parameter, torch.Size, torch.device, torch.dtype}
)
_CONTAINERS = frozenset((dict, OrderedDict, Counter, list, tuple, set))


class Stateful(Protocol):
    """What a checkpoint saves and restores: a callback that `Dispatcher.stateful` picked
    (it has both methods), a `stateful` object, an optimizer, a scheduler."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


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


def states(kind: str, named: dict[str, Any]) -> dict[str, Any]:
    """The payload entries of the optimizers or schedulers: one under its own key (as
    checkpoints always had it), several under the plural, by name."""
    if not named:
        return {kind: None}
    if list(named) == [kind]:
        return {kind: named[kind].state_dict()}
    return {f"{kind}s": {name: obj.state_dict() for name, obj in named.items()}}


def load_states(
    kind: str, named: Mapping[str, Any], payload: Mapping[str, Any], path: Path
) -> None:
    if not named:
        return
    if list(named) == [kind]:
        saved = payload.get(kind)
        if saved is None and f"{kind}s" in payload:
            raise CheckpointError(
                f"checkpoint {path} holds {len(payload[f'{kind}s'])} {kind}s "
                f"({', '.join(map(repr, payload[f'{kind}s']))}) and the loop has one; resume "
                f"with the same {kind}s, or start fresh with resume=False"
            )
        if saved is not None:
            named[kind].load_state_dict(saved)
        return
    saved_all = payload.get(f"{kind}s") or {}
    missing = [name for name in named if name not in saved_all]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} has no state for {kind} {', '.join(map(repr, missing))} "
            f"(it holds: {', '.join(map(repr, saved_all)) or 'none'}); resume with the same "
            f"{kind}s, or start fresh with resume=False"
        )
    for name, obj in named.items():
        obj.load_state_dict(saved_all[name])


def state_keys(stateful: Sequence[Callback], *, own: bool = True) -> dict[str, Callback]:
    """The key each stateful callback's state is saved under in a checkpoint.

    A callback's own `state_key` attribute if it sets one, else its class name, with
    ``#2``, ``#3``... for the later callbacks of one class (in dispatch order). Why: a key
    that depends only on the callback (not on its position among all of them, as the old
    ``"{index}:{Class}"`` keys did) still finds its state when other callbacks are added,
    removed or reordered for the resume. With `own` False, `state_key` is ignored (checkpoints
    with the old keys know only classes).
    """
    keys: dict[str, Callback] = {}
    seen: Counter[str] = Counter()
    for cb in stateful:
        name = type(cb).__name__
        key = getattr(cb, "state_key", None) if own else None
        if key is not None:
            if not isinstance(key, str) or not key or ":" in key:
                raise ConfigError(f"{name}.state_key={key!r}: use a non-empty string without ':'")
        else:
            seen[name] += 1
            key = name if seen[name] == 1 else f"{name}#{seen[name]}"
        if key in keys:
            raise ConfigError(
                f"two stateful callbacks save their state under {key!r} "
                f"({type(keys[key]).__name__} and {name}); give one of them another state_key"
            )
        keys[key] = cb
    return keys


def _from_index_keys(saved: dict[str, Any]) -> dict[str, Any] | None:
    """The states of a checkpoint with the old ``"{index}:{Class}"`` keys, under the keys
    `state_keys` gives without `state_key` (the k-th saved state of a class goes to the
    k-th attached callback of it); None when the checkpoint has the current keys."""
    indexed: list[tuple[int, str, Any]] = []
    for key, value in saved.items():
        match = _INDEX_KEY.fullmatch(key)
        if match is None:
            return None
        indexed.append((int(match.group(1)), match.group(2), value))
    seen: Counter[str] = Counter()
    states: dict[str, Any] = {}
    for _, name, value in sorted(indexed, key=lambda entry: entry[0]):
        seen[name] += 1
        states[name if seen[name] == 1 else f"{name}#{seen[name]}"] = value
    return states if states else None


def load_callback_states(saved: dict[str, Any], path: Path, hooks: Dispatcher) -> None:
    """Give each stateful callback the state saved under its key, on resume.

    One WARNING names the callbacks that find no saved state (they start fresh, so the
    resumed run may differ from one that never stopped) and the saved states that no
    attached callback takes (they are ignored); nothing is said when all match.
    """
    by_index = _from_index_keys(saved)
    if by_index is not None:
        saved = by_index
    keys = state_keys(hooks.stateful(), own=by_index is None)
    for key, cb in keys.items():
        if key in saved:
            cast(Stateful, cb).load_state_dict(saved[key])
    fresh = [key for key in keys if key not in saved]
    unclaimed = [key for key in saved if key not in keys]
    parts = []
    if fresh:
        they = "it starts" if len(fresh) == 1 else "they start"
        parts.append(f"no saved state for {', '.join(fresh)} ({they} fresh)")
    if unclaimed:
        it = "it is" if len(unclaimed) == 1 else "they are"
        parts.append(
            f"no attached callback takes the saved state of {', '.join(unclaimed)} ({it} ignored)"
        )
    if parts:
        log.warning("resuming from %s: %s", path, "; ".join(parts))


def load_model(model: torch.nn.Module, payload: Mapping[str, Any], path: Path) -> None:
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as exc:
        reason = " ".join(str(exc).split())
        raise CheckpointError(
            f"checkpoint {path} does not fit this model ({reason[:300]}); load a checkpoint "
            "of the same model, or start fresh with resume=False"
        ) from None
