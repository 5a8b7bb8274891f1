"""When the loop saves a checkpoint and which saves it keeps: `CheckpointConfig` and its checks.

The config is plain data, checked once when it is made; `lab.loop.retention` applies its
keeping rules to a run's manifest, and the loop asks `due`, `kind` and `is_ephemeral` at
each step. `lab.loop.checkpoints` re-exports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lab.errors import ConfigError
from lab.records import Kind

__all__ = ["CheckpointConfig", "is_int"]


def is_int(value: Any) -> bool:
    """Whether `value` is an int and not a bool: True is an int to Python, never a step or a
    count here."""
    return isinstance(value, int) and not isinstance(value, bool)


def _smaller(every: int) -> str:
    if every == 1:
        return "with every=1 each save is regular: drop ephemeral_every"
    return f"use ephemeral_every < every (e.g. ephemeral_every={every // 2}), or drop one"


@dataclass(frozen=True)
class CheckpointConfig:
    """When the loop saves, and which saves it keeps; every option combines with the others.

    Saving: `every` saves each N steps, `ephemeral_every` each N steps as an ephemeral save
    (gone when the next save commits, unless `keep_top_k` keeps it; useful against
    preemption), `fixed_steps` at those steps (kept forever), `save_at_start` at step 0
    before the first step, `save_at_end` after the last step. A save due to `every`, a fixed
    step, the start or the end is never ephemeral.

    Keeping (the union; the newest checkpoint is always kept): `keep_last` keeps the newest N
    non-ephemeral checkpoints (None: no limit), `keep_top_k` keeps the best K by `metric`,
    lower better for `mode="min"`, higher for `mode="max"`. A save whose metrics have no
    value for `metric` (no eval ran at its step) is unranked: kept or removed by the other
    rules only. `metric` and `mode` without `keep_top_k` rank without pruning, for
    `CheckpointManager.get_best_checkpoint_path(s)`. `ephemeral_every` must be smaller than
    `every` (else no save would be ephemeral). `async_save=True` makes the loop's saves
    asynchronous: the training thread waits only while the state is copied to CPU memory,
    and one background thread writes and commits it (see `CheckpointManager.save_async`).
    `sharded=True` writes the model and optimizer states through Distributed Checkpoint
    (``torch.distributed.checkpoint``): under DDP every rank writes its share into the folder
    being saved before it commits, and the checkpoint loads on any number of ranks (see
    `lab.loop.sharded`); the rest of the state stays in ``state.pt``. With `async_save` too,
    the shards are written in the background (DCP's `async_save`) and the save commits at
    the next save or at the end of the fit.
    """

    every: int | None = None
    keep_last: int | None = None
    keep_top_k: int | None = None
    metric: str | None = None
    mode: Literal["min", "max"] | None = None
    ephemeral_every: int | None = None
    fixed_steps: Sequence[int] = ()
    save_at_end: bool = True
    save_at_start: bool = False
    async_save: bool = False
    sharded: bool = False

    def __post_init__(self) -> None:
        for name in ("every", "ephemeral_every"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ConfigError(f"CheckpointConfig({name}={value!r}): use an int >= 1, or None")
        for name in ("keep_last", "keep_top_k"):
            value = getattr(self, name)
            if value is not None and not is_int(value):
                raise ConfigError(f"CheckpointConfig({name}={value!r}): use an int >= 1, or None")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(
                f"CheckpointConfig(keep_last={self.keep_last}) would keep nothing; "
                "use a value >= 1, or None to keep every checkpoint"
            )
        if self.keep_top_k is not None and self.keep_top_k < 1:
            raise ConfigError(
                f"CheckpointConfig(keep_top_k={self.keep_top_k}) would keep nothing; "
                "use a value >= 1, or None to rank nothing"
            )
        for name in ("save_at_end", "save_at_start", "async_save", "sharded"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"CheckpointConfig({name}={getattr(self, name)!r}): use True or False"
                )
        given = self.fixed_steps
        listed = isinstance(given, Iterable) and not isinstance(given, (str, bytes))
        steps = tuple(given) if listed else ()
        if not listed or not all(is_int(s) and s >= 0 for s in steps):
            raise ConfigError(
                f"CheckpointConfig(fixed_steps={given!r}): give a list of steps, ints >= 0"
            )
        object.__setattr__(self, "fixed_steps", tuple(sorted(set(steps))))
        self._check_ranking()
        every, ephemeral = self.every, self.ephemeral_every
        if every is not None and ephemeral is not None and ephemeral >= every:
            raise ConfigError(
                f"CheckpointConfig(every={every}, ephemeral_every={ephemeral}) makes no save "
                f"ephemeral: each one would also be due to every; {_smaller(every)}"
            )
        if not (self.every or self.ephemeral_every or self.fixed_steps) and not (
            self.save_at_end or self.save_at_start
        ):
            raise ConfigError(
                "CheckpointConfig never saves: set every=N, ephemeral_every=N, fixed_steps=[...], "
                "save_at_start=True or save_at_end=True, or pass checkpoint=None"
            )

    def _check_ranking(self) -> None:
        metric, mode, top_k = self.metric, self.mode, self.keep_top_k
        if metric is not None and (not isinstance(metric, str) or not metric):
            raise ConfigError(
                f"CheckpointConfig(metric={metric!r}): name a metric logged before each save, "
                "e.g. 'val/loss'"
            )
        if mode is not None and mode not in ("min", "max"):
            raise ConfigError(
                f"CheckpointConfig(mode={mode!r}): use 'min' (lower is better) "
                "or 'max' (higher is better)"
            )
        if top_k is not None and metric is None:
            raise ConfigError(
                f"CheckpointConfig(keep_top_k={top_k}) needs a metric to rank by: add "
                "metric='val/loss' (logged before each save) and mode='min' or mode='max'"
            )
        if metric is not None and mode is None:
            raise ConfigError(
                f"CheckpointConfig(metric={metric!r}) needs a direction: add mode='min' "
                "(lower is better) or mode='max' (higher is better)"
            )
        if mode is not None and metric is None:
            raise ConfigError(
                f"CheckpointConfig(mode={mode!r}) ranks nothing without a metric: add "
                "metric='val/loss' (a step or eval metric), or drop mode"
            )

    def due(self, step: int, num_steps: int | None) -> bool:
        """Whether to save after step `step` (step 0: before the first step) of `num_steps`
        (None: a loop that decides itself when to stop, so no step is the end).

        The loop asks after every step, so this is a few integer tests.
        """
        if step == 0:
            return self.save_at_start or 0 in self.fixed_steps
        return (
            (self.every is not None and step % self.every == 0)
            or (self.ephemeral_every is not None and step % self.ephemeral_every == 0)
            or step in self.fixed_steps
            or (self.save_at_end and step == num_steps)
        )

    def is_ephemeral(self, step: int, num_steps: int | None = None, *, final: bool = False) -> bool:
        """Whether a save at `step` is ephemeral, i.e. removed once the next save commits.

        Only a save due to `ephemeral_every` alone is: one also due to `every`, a fixed step,
        the start or the end (`step == num_steps`, or `final` for a run stopped early) is not,
        since those are the saves the config asked to keep.
        """
        if self.ephemeral_every is None or step < 1 or step % self.ephemeral_every:
            return False
        if (self.every is not None and step % self.every == 0) or step in self.fixed_steps:
            return False
        at_end = final or (num_steps is not None and step == num_steps)
        return not (self.save_at_end and at_end)

    def kind(self, step: int, num_steps: int | None = None, *, final: bool = False) -> Kind:
        """How a save at `step` is kept: "fixed" (forever), "ephemeral" or "regular"."""
        if step in self.fixed_steps:
            return "fixed"
        return "ephemeral" if self.is_ephemeral(step, num_steps, final=final) else "regular"
