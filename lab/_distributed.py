"""Where this process sits among the ranks of a run, and the few collectives lab makes.

Inside a run, ranks share one run row: every rank trains and fires the loop's hooks, rank 0
alone writes (the callbacks that declare `Callback.rank_zero_only` are left out elsewhere),
and each step's metrics are reduced across ranks in one collective of one packed tensor
(`MetricReducer`). The ranks come from an initialised `torch.distributed` process group,
else from a launcher's environment (``torchrun`` sets ``RANK`` and ``WORLD_SIZE``).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import fnmatch
import math
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from lab.errors import ConfigError, LabError, MetricError

T = TypeVar("T")

#: The reductions a metric may name (``reduce={"tokens": "sum"}``); the default is the mean.
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "max", "min")
#: Seconds a collective waits for the other ranks before it fails (a hung rank, not a dead
#: one: a dead rank's closed connection fails the collective at once).
TIMEOUT_ENV = "LAB_DDP_TIMEOUT_S"


class RankLost(LabError):
    """A collective of the run failed: another rank died or stopped answering."""


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a whole number; unset it, or launch with torchrun, which "
            "sets RANK and WORLD_SIZE"
        ) from None
    if value < 0:
        raise ConfigError(f"{name}={raw!r} must be >= 0; unset it, or launch with torchrun")
    return value


def launcher_rank() -> tuple[int, int] | None:
    """``(rank, world_size)`` when a launcher started several processes (``WORLD_SIZE`` > 1),
    else None. A malformed ``RANK`` or ``WORLD_SIZE`` is a `ConfigError`."""
    world = _env_int("WORLD_SIZE")
    if world is None or world <= 1:
        return None
    rank = _env_int("RANK")
    if rank is None:
        raise ConfigError(
            f"WORLD_SIZE={world} but RANK is not set; launch with torchrun, which sets both"
        )
    if rank >= world:
        raise ConfigError(f"RANK={rank} must be below WORLD_SIZE={world}")
    return rank, world


def _dist() -> Any:
    """`torch.distributed` when it is initialised, else None. Not imported to find out: no
    process group exists before it is, and importing torch costs a command that stops at a
    bad store 1.5 s of CPU."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: from the process group when there is one,
    else from the launcher's environment, else ``(0, 1)``."""
    dist = _dist()
    if dist is not None:
        return dist.get_rank(), dist.get_world_size()
    return launcher_rank() or (0, 1)


def default_backend() -> str:
    """gloo on CPU; with CUDA, NCCL for CUDA tensors and gloo for CPU ones (lab's own
    collectives pack host values, so they never need a device sync)."""
    import torch

    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def timeout() -> datetime.timedelta:
    """How long a collective waits for the others: ``LAB_DDP_TIMEOUT_S``, else 600 s."""
    seconds = _env_int(TIMEOUT_ENV)
    return datetime.timedelta(seconds=seconds if seconds else 600)


def init_from_launcher() -> bool:
    """Initialise the default process group from a launcher's environment (``torchrun``,
    or `Experiment(processes_per_run=N)`'s own processes) unless one exists; True when this
    call made it. Why here: a `train(run)` that wraps its model in DDP finds the group ready,
    and lab's collectives (metrics, checkpoints) use the same one."""
    global _made, _hooked
    ranks = launcher_rank()
    if ranks is None:
        return False
    if not _hooked:
        _hooked = True
        atexit.register(_leave_at_exit)
    if _dist() is not None:
        return False
    import torch
    import torch.distributed as dist

    backend = default_backend()
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend=backend, timeout=timeout())
    _made = True
    return True


_made = False  # lab made the default process group here, and has not destroyed it
_hooked = False  # `_leave_at_exit` is registered (under a launcher, whoever made the group)


#: How long `leave_group` lets go of the GIL before it destroys the group (see there).
_SETTLE_S = 0.02


def leave_group() -> None:
    """Destroy the default process group, if there is one.

    First it sleeps `_SETTLE_S`, so the GIL is free for a moment. Why: a gloo worker
    thread may still be freeing the last collective's work (its tensors belong to Python
    objects, so it waits for the GIL to drop them). If the interpreter starts to finalize
    while that thread waits, CPython ends the thread in the middle of a C++ destructor, and
    the process aborts ("terminate called without an active exception", SIGABRT) after
    all its work is done.
    """
    global _made
    _made = False
    dist = _dist()
    if dist is not None:
        time.sleep(_SETTLE_S)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _leave_at_exit() -> None:
    """Why: a group lab made is destroyed while the interpreter is whole, since a gloo group
    left to the interpreter's own teardown can abort the process (SIGABRT) as it ends (see
    `leave_group`), and an NCCL one warns. A group the program made itself is its own
    business: lab only lets go of the GIL for a moment, for the same reason, before the
    program's own exit handlers (registered earlier, so run later) destroy it."""
    if _made:
        leave_group()
    elif _dist() is not None:
        time.sleep(_SETTLE_S)


def for_rank(callbacks: Iterable[T], rank: int | None = None) -> list[T]:
    """The callbacks that run on this rank: all on rank 0, elsewhere those that do not
    declare `rank_zero_only` (sinks that write rows, files or lines once per run)."""
    if rank is None:
        rank = rank_and_world()[0]
    if rank == 0:
        return list(callbacks)
    return [cb for cb in callbacks if not getattr(cb, "rank_zero_only", False)]


def broadcast(value: T) -> T:
    """Rank 0's `value` on every rank (one collective); `value` itself without a group."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, device=_object_device(dist))
    return box[0]


def gather_to_zero(value: T) -> list[T] | None:
    """Every rank's `value`, in rank order, on rank 0 (None elsewhere)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return [value]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, out, dst=0)
    return out


def barrier() -> None:
    """Wait until every rank gets here (nothing without a group)."""
    dist = _dist()
    if dist is not None and dist.get_world_size() > 1:
        dist.barrier()


def agreed(fn: Callable[[], T]) -> T:
    """Call `fn` on every rank, and make rank 0's failure everyone's: when `fn` raised on
    rank 0, every rank raises it (so no rank waits in a collective the others never reach).
    Rank 0's own error propagates as it is."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return fn()
    error: BaseException | None = None
    try:
        value = fn()
    except Exception as exc:
        error = exc
    mine = error if dist.get_rank() == 0 else None
    theirs = broadcast(portable(mine) if mine is not None else None)
    if error is not None and dist.get_rank() == 0:
        raise error
    if theirs is not None:
        raise theirs
    if error is not None:
        raise error
    return value


def portable(exc: BaseException) -> BaseException:
    """`exc`, or a RuntimeError with its text when it would not survive pickling (to send
    it to another rank or process)."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def _object_device(dist: Any) -> Any:
    """Where object collectives stage their bytes: CPU under gloo (or a mixed backend), the
    current CUDA device under NCCL alone."""
    import torch

    backend = str(dist.get_backend())
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_reductions(reduce: Mapping[str, str] | None) -> dict[str, str]:
    """`reduce` as a checked dict of metric name (or glob pattern) -> reduction."""
    if reduce is None:
        return {}
    if not isinstance(reduce, Mapping):
        raise ConfigError(
            f"reduce={reduce!r}: give a dict of metric -> 'mean', 'sum', 'max' or 'min'"
        )
    out = {}
    for key, how in reduce.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"reduce: metric names must be non-empty strings, got {key!r}")
        if how not in REDUCTIONS:
            raise ConfigError(
                f"reduce[{key!r}]={how!r}: use one of {', '.join(map(repr, REDUCTIONS))}"
            )
        out[key] = how
    return out


class MetricReducer:
    """Reduce a step's metrics across ranks in one collective of one packed float64 tensor.

    Why one: a collective per metric costs a round trip each (and a host sync each on a
    GPU); the step's values are packed in key order, with a fingerprint of the key names,
    and reduced together. Mean and sum (the usual case) go through one ``all_reduce``; a
    step with a max or min metric gathers the packed rows instead (``all_gather``), still
    once. The fingerprint catches ranks that logged different keys: every rank sees it, so
    every rank raises the same `MetricError` instead of reducing values that do not match.

    The layout of a key set is worked out once and reused while the keys stay the same,
    so a step costs the packing, the collective and the unpacking. With ``log_every > 1``
    the steps held since the last materialisation are packed together (`reduce_steps`):
    still one collective, now per materialisation rather than per step.
    """

    def __init__(self, reduce: Mapping[str, str] | None = None) -> None:
        import torch

        dist = _dist()
        if dist is None:
            raise ConfigError("MetricReducer needs an initialised torch.distributed group")
        self._dist = dist
        self.world = dist.get_world_size()
        self.rules = check_reductions(reduce)
        self.device = _object_device(dist)
        self._keys: tuple[str, ...] | None = None
        self._plan: tuple[list[str], bool, float] = ([], False, 0.0)
        self._torch = torch
        # the newer torch's name; the older ones in the supported range have only the other
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def _layout(self, keys: tuple[str, ...]) -> tuple[list[str], bool, float]:
        hows = [self._how(key) for key in keys]
        gather = any(how in ("max", "min") for how in hows)
        # small enough that its square, summed over ranks, stays exact in a float64
        print_ = float(zlib.crc32("\x00".join(keys).encode()) % (1 << 20))
        return hows, gather, print_

    def _how(self, key: str) -> str:
        rules = self.rules
        if key in rules:
            return rules[key]
        for pattern, how in rules.items():
            if fnmatch.fnmatchcase(key, pattern):
                return how
        return "mean"

    def reduce(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        """The step's metrics reduced over every rank (the same dict on each)."""
        return self.reduce_steps([metrics], [step])[0]

    def reduce_steps(
        self, rows: list[dict[str, float]], steps: list[int]
    ) -> list[dict[str, float]]:
        """Several steps' metrics (the steps a ``log_every`` window held) reduced in one
        collective: each step's values packed after the previous step's, each with its own
        fingerprint, so a window costs what one step did."""
        plans = []
        flat: list[float] = []
        for row in rows:
            keys = tuple(row)
            if keys != self._keys:
                self._keys, self._plan = keys, self._layout(keys)
            plans.append((keys, *self._plan))
            print_ = self._plan[2]
            flat += [*row.values(), print_, print_ * print_]
        torch, dist, world, size = self._torch, self._dist, self.world, len(flat)
        packed = torch.tensor(flat, dtype=torch.float64, device=self.device)
        out: list[dict[str, float]] = []
        at = 0  # where each step's values start in the packed row
        if any(gather for _, _, gather, _ in plans):
            gathered = torch.empty(world * size, dtype=torch.float64, device=self.device)
            try:
                self._gather(gathered, packed)
            except RuntimeError as exc:
                raise _lost(steps[-1], exc) from exc
            table = gathered.view(world, size).tolist()
            for (keys, hows, _, _), step in zip(plans, steps, strict=True):
                n = len(keys)
                if len({row[at + n] for row in table}) != 1:
                    raise self._mismatch(keys, step)
                pairs = enumerate(zip(keys, hows, strict=True))
                out.append({key: _reduce(how, [row[at + i] for row in table], world)
                            for i, (key, how) in pairs})  # fmt: skip
                at += n + 2
            return out
        try:
            dist.all_reduce(packed)
        except RuntimeError as exc:
            raise _lost(steps[-1], exc) from exc
        values = packed.tolist()
        for (keys, hows, _, _), step in zip(plans, steps, strict=True):
            n = len(keys)
            total, squares = values[at + n], values[at + n + 1]
            if total * total != world * squares:  # equal only when every rank's print is equal
                raise self._mismatch(keys, step)
            mine = zip(keys, hows, values[at : at + n], strict=True)
            out.append({key: value / world if how == "mean" else value
                        for key, how, value in mine})  # fmt: skip
            at += n + 2
        return out

    def _mismatch(self, keys: tuple[str, ...], step: int) -> MetricError:
        rank = self._dist.get_rank()
        return MetricError(
            f"step {step}: the ranks logged different metric keys (rank {rank}: "
            f"{', '.join(keys)}); log the same keys on every rank (a value every rank has, "
            "or NaN where a rank has none)"
        )


def _lost(step: int, exc: RuntimeError) -> RankLost:
    reason = " ".join(str(exc).split())
    reason = reason.split("] ", 1)[-1][:160]  # without gloo's source path
    return RankLost(
        f"step {step}: the metrics collective failed ({reason}); another rank of this run "
        "died or hung: its own log says why"
    )


def _reduce(how: str, values: list[float], world: int) -> float:
    if how == "sum":
        return math.fsum(values)
    if how == "max":
        return max(values)
    if how == "min":
        return min(values)
    return math.fsum(values) / world
