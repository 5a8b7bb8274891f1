"""Where the loop's batches come from: passes over `data`, `accumulate` micro-batches a step.

`LoopState.epoch` counts the passes over `data` and `LoopState.batch_in_epoch` the
micro-batches taken from the current pass: the data position a checkpoint keeps. A step takes
`accumulate` consecutive micro-batches of one pass, never two: the ``len(data) % accumulate``
batches left at a pass's end are not used (as ``DataLoader(drop_last=True)`` does with
samples), so every pass gives the same number of steps.

A loop that counts epochs (``num_epochs`` or ``steps_per_epoch``) makes each epoch exactly
``steps_per_epoch`` steps: a fresh pass over `data` starts at each epoch, and what that pass
has beyond the epoch is not used; data that runs out sooner is an error. A loop that does not
count epochs starts the next pass whenever one runs out.

Exact resume: the order of a shuffled pass is drawn from the global RNG when its iterator is
created, so the RNG state at the start of each pass is kept (`epoch_rng`, saved in each
checkpoint); a resume re-creates the pass from it, skips the batches already taken, and only
then restores the checkpoint's RNG.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from lab._seeding import rng_state, set_rng_state
from lab.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from lab.hooks import LoopState
    from lab.loop.checkpoint_session import CheckpointSession

__all__ = ["Feed"]

_END = object()


class Feed:
    """The micro-batches of each step of a run, and the data position.

    The position lives in `state` (the run's `LoopState`); the RNG state at the current
    pass's start goes to the run's checkpoint `session`, which saves it with each
    checkpoint, and the checkpoint a run resumed from is read back here (its ``rng`` and
    ``epoch_rng``). The pass is opened at the first `take`,
    so nothing the loop does before its first step (hooks, evals at start) can shift it.
    This is `RunHandle.batches` for a loop that takes several micro-batches a step or has
    epochs of a fixed length.
    """

    def __init__(
        self,
        data: Iterable[Any],
        accumulate: int,
        steps_per_epoch: int | None,
        state: LoopState,
        session: CheckpointSession,
    ) -> None:
        self.data = data
        self.accumulate = accumulate
        self.steps_per_epoch = steps_per_epoch
        self.per_pass = steps_per_epoch * accumulate if steps_per_epoch is not None else None
        self.session = session
        self.state = state
        self._items: Iterator[Any] | None = None
        self._group: list[Any] = [None] * accumulate  # reused: a step allocates no list
        self._first_pass = True

    def take(self) -> list[Any]:
        """The next step's micro-batches (one list, reused: copy what you keep)."""
        group, k = self._group, self.accumulate
        i = 0
        while i < k:
            items = self._items
            if items is None:
                items = self._open()
            item = next(items, _END)
            if item is _END:
                self._pass_ended(i)  # the partial group is dropped; a new pass follows
                i = 0
                continue
            group[i] = item
            i += 1
        self.state.batch_in_epoch += k
        return group

    def next_epoch(self) -> None:
        """Begin the next epoch (a loop that counts epochs calls it before each epoch's first
        step and its `on_epoch_start`); a no-op at a pass's start."""
        state = self.state
        if state.batch_in_epoch == 0:
            return
        restored, self.session.restored = self.session.restored, None
        if restored is not None:  # resumed at an epoch's end: nothing left to replay
            set_rng_state(restored["rng"])
        state.epoch += 1
        state.batch_in_epoch = 0
        self._items = None

    def _open(self) -> Iterator[Any]:
        """Begin a pass over the data (at the position and RNG states a resume restored)."""
        session = self.session
        restored, session.restored = session.restored, None
        if restored is not None and restored.get("epoch_rng") is None:
            set_rng_state(restored["rng"])  # saved before the first pass began
            restored = None
        if restored is None:
            # saved with each checkpoint of this pass: a run that saves none skips the
            # capture (~60 µs, numpy's state the most of it, at every pass)
            session.epoch_rng = rng_state() if session.manager is not None else None
            self._items = items = iter(self.data)
            return items
        set_rng_state(restored["epoch_rng"])
        session.epoch_rng = restored["epoch_rng"]
        items = iter(self.data)
        state = self.state
        for taken in range(state.batch_in_epoch):
            if next(items, _END) is _END:
                raise CheckpointError(
                    f"the data has {taken} batches in epoch {state.epoch}, but the "
                    f"checkpoint was taken after {state.batch_in_epoch}; resume with "
                    "the same data, or start fresh with resume=False"
                )
        set_rng_state(restored["rng"])
        self._items = items
        return items

    def _pass_ended(self, partial: int) -> None:
        state, k = self.state, self.accumulate
        drawn = state.batch_in_epoch + partial
        if drawn == 0 and self._first_pass:
            raise ConfigError("data yielded no batches; give the loop a non-empty iterable")
        if drawn == 0:
            raise ConfigError(
                "data yielded no batches in its second epoch: it is a one-shot iterator; "
                "pass a re-iterable such as a list or a DataLoader"
            )
        if self.per_pass is not None:
            raise ConfigError(
                f"data ran out after {drawn} batches in epoch {state.epoch}, but an epoch is "
                f"steps_per_epoch={self.steps_per_epoch} steps of {k} batches; lower "
                "steps_per_epoch, or give more data"
            )
        if state.batch_in_epoch == 0:
            raise ConfigError(
                f"a pass over data gave {partial} batches, fewer than accumulate={k}: lower "
                "accumulate, or give more data"
            )
        self._first_pass = False
        state.epoch += 1
        state.batch_in_epoch = 0
        self._items = None
