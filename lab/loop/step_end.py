"""One run's step ends: the step's number, its metrics read or held, and its `on_step_end`.

A run handle's `end_step` hands each step here. The step number only goes up; the metrics
are read on the host as the step ends (``log_every=1``), or held on their device
(`lab.loop.metric_buffer`) until a step after which something reads them. `on_step_end`
fires here, for each step in order, with the step's floats; after it, the step's values
become the run's last ones and the checks of metric names that wait for a step look at
them (`lab.loop.metric_names`, the ranking metric of `CheckpointConfig`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lab._distributed import MetricReducer, broadcast
from lab._metrics import good_keys
from lab._secrets import logger
from lab.errors import HookOrderError
from lab.hooks import Hook
from lab.loop.metric_buffer import MetricBuffer, floats
from lab.loop.metric_names import watch_names
from lab.records import TrainingBatch

if TYPE_CHECKING:
    from lab.dispatch import Dispatcher
    from lab.hooks import LoopState
    from lab.loop.checkpoint_config import CheckpointConfig
    from lab.loop.checkpoint_session import Progress
    from lab.loop.metric_names import MetricWatch
    from lab.loop.settings import LoopSettings

__all__ = ["StepEnds"]

log = logger("lab.loop")
#: The hooks of every step, looked up once: a module global costs less than an enum member.
_STEP_END = Hook.STEP_END


class StepEnds:
    """Number, read (or hold) and announce the steps of one run.

    `open` gives it the run's callbacks and the names to look for at the first step; `attach`
    the run's state, and under DDP the reducer of the step metrics. `saving` says whether the
    run has checkpoints (a save due after a step reads its metrics).
    """

    def __init__(self, settings: LoopSettings, progress: Progress) -> None:
        self.settings = settings
        self.buffer = MetricBuffer(settings.log_every)  # the steps held (log_every)
        self.reducer: MetricReducer | None = None  # set under DDP, when the run starts
        self.batch = TrainingBatch()  # the batch the step hooks see: one object, reused
        self._past = TrainingBatch()  # the batch a held step's on_step_end sees: no data
        self.progress = progress  # its `last`: the last value of each step metric
        self.seen: set[str] = set()  # step metric names logged in this fit (ranking check)
        # `progress.last` as `_keep_last` left it, and its keys
        self._last: dict[str, float] | None = None
        self._known: set[str] = set()
        self._order: list[str] = []  # `_known` in the order of `_last`'s keys
        self._good: set[str] = set()  # keys that passed `check_key` (the store's test)
        self._checked = True  # every key of `_known` is in `_good`
        checkpoint = settings.checkpoint
        # The ranking metric while steps still add to `seen` (None once it was logged).
        self._ranking = checkpoint.metric if checkpoint is not None else None
        self.watch: MetricWatch | None = None
        self._watch_step: MetricWatch | None = None  # `watch`, until its step lookup is done
        #: The run's `CheckpointConfig` when it saves (its checkpoints are open), else None.
        self.saving: CheckpointConfig | None = None
        self.begun = 0  # the step pre_step announced and end_step has not ended yet
        self.state: LoopState
        self.hooks: Dispatcher

    def open(self, hooks: Dispatcher) -> None:
        """The run's callbacks, and the metric names they and the settings need
        (`lab.loop.metric_names`: those no source declared are looked for once, at the first
        step); how often the metrics are read follows from the callbacks."""
        self.hooks = hooks
        settings = self.settings
        self.watch = watch = watch_names(
            hooks.callbacks, settings.checkpoint, settings.declared, settings.open,
            settings.evaluators,
        )  # fmt: skip
        self._watch_step = watch if watch is not None and watch.at_step else None
        self.buffer.every = self.buffer.in_effect(hooks.callbacks)

    def attach(self, state: LoopState) -> None:
        """The run's state; under DDP, the reducer, and rank 0's `log_every` in effect."""
        self.state = state
        if state.world_size > 1:
            self.reducer = MetricReducer(self.settings.reduce)
            if self.settings.log_every > 1:
                # rank 0 has every callback (rank_zero_only ones too): its choice holds for
                # all, so every rank materialises, and reduces, at the same steps
                self.buffer.every = broadcast(self.buffer.every)

    def next_step(self, step: int | None) -> int:
        """The step `end_step` ends: the one after the last ended step, or `step` if that is
        larger and not past `num_steps`."""
        done = self.state.step
        if step is None:
            step = done + 1
        elif isinstance(step, bool) or not isinstance(step, int) or step <= done:
            raise HookOrderError(
                f"end_step(step={step!r}) after step {done}: step numbers only go up; "
                f"end step {done + 1} (or leave step out)"
            )
        num_steps = self.settings.num_steps
        if num_steps is not None and step > num_steps:
            raise HookOrderError(
                f"end_step(step={step}) past num_steps={num_steps}; stop at the last step"
            )
        return step

    def begin(self, step: int) -> int:
        """Announce `step` (`pre_step`): once, until it ends."""
        if self.begun == step:
            raise HookOrderError(
                f"pre_step for step {step} twice: end the step with loop.end_step(metrics) first"
            )
        self.begun = step
        return step

    def read(
        self, step: int, metrics: Mapping[str, Any], batch: Any, save: bool | None
    ) -> dict[str, float] | None:
        """`step`'s metrics as floats, reduced across ranks, once the held steps before it
        have had their `on_step_end`; None when the step is held instead (`reads_at`): then
        `state.step` counts it as ended, and nothing of it is read on the host yet."""
        self.begun = 0
        if self.buffer.every == 1:  # each step read as it ends (one collective under DDP)
            clean = floats(metrics, step)
            return clean if self.reducer is None else self.reducer.reduce(clean, step)
        if self.reads_at(step, save):
            return self.materialise(step, metrics)  # the held steps' on_step_end first
        source = self.batch if batch is None else batch
        if isinstance(source, TrainingBatch):
            epoch, index = source.epoch, source.index
        else:
            epoch, index = self.state.epoch, self.state.batch_in_epoch - 1
        self.buffer.hold(step, metrics, epoch, index)
        self.state.step = step
        return None

    def reads_at(self, step: int, save: bool | None) -> bool:
        """Whether ending `step` materialises the step metrics (with ``log_every > 1``): at a
        multiple of `log_every`, the last step, a stop asked for, and wherever something
        after `on_step_end` reads them on the host (a save, an eval, an epoch's end, the
        first step's lookup of needed names). Step numbers, not a count since the last
        materialisation, so a resumed run materialises where one that never stopped does.
        The handle's `finish`, `evaluate`, `log_eval`, `save`, `log_histogram`, `log_image`,
        `start_epoch` and `end_epoch` materialise first, and so does a failure (not under
        DDP: `materialise_on_error`)."""
        settings = self.settings
        num_steps, spe = settings.num_steps, settings.steps_per_epoch
        if (
            step % self.buffer.every == 0
            or step == num_steps
            or self.state.stop_requested
            or self._watch_step is not None
            or save
            or (spe is not None and step % spe == 0)
        ):
            return True
        if save is None and (saving := self.saving) is not None and saving.due(step, num_steps):
            return True
        if settings.evaluators:
            return any(ev.due(step, num_steps=num_steps or 0) for ev in settings.evaluators)
        return False

    def fire(self, step: int, clean: dict[str, float], batch: Any) -> None:
        """`on_step_end` for an ended step whose metrics are floats now, and the checks of
        metric names that read them.

        One pass in C over the step's keys serves the store and the last values: a step
        that logs the keys the last values hold (the common case: the same keys each step),
        each of which passed `check_key`, reaches the store as checked (it skips its own
        pass), and where no callback could change the metrics in the hook
        (`Dispatcher.keeps_step_metrics`) it simply is the last values."""
        progress, hooks = self.progress, self.hooks
        same = progress.last is self._last and (
            list(clean) == self._order  # the keys in the order of the step before: the common case
            or (len(clean) == len(self._known) and self._known.issuperset(clean))
        )
        if batch is None:  # no listener: `fire_step_end` walks an empty tuple
            hooks.fire_step_end(self.state, step, self.batch, clean, same and self._checked)
        elif hooks.listens(_STEP_END):
            hooks.fire_step_end(self.state, step, self.wrap(batch), clean, same and self._checked)
        if same and hooks.keeps_step_metrics:
            progress.last = self._last = clean
        else:  # after the hook: the keys its producers added count too
            self._keep_last(clean)
        ranking = self._ranking
        if ranking is not None:  # step metric names (producers' keys too), for the check
            self.seen.update(clean)  # at saves, until the ranking metric shows up
            if ranking in clean or len(self.seen) >= 64:
                self._ranking = None
        watch = self._watch_step
        if watch is not None:  # needed names no source declared: looked for once
            self._watch_step = None
            watch.after_step(step, clean)

    def _keep_last(self, clean: dict[str, float]) -> None:
        """Make `clean` the last value of each step metric (`Progress.last`). A step that
        logs every key logged before (the common case: the same keys each step) simply is
        the last values, so the check is one pass in C over its keys and nothing is copied;
        a step that adds keys or leaves some out is merged into a new dict."""
        progress, known = self.progress, self._known
        if progress.last is self._last and len(clean) == len(known) and known.issuperset(clean):
            progress.last = self._last = clean
            return
        progress.last = self._last = {**progress.last, **clean}  # (a restore set a new one)
        self._order = list(self._last)
        self._known = known = set(self._order)
        fresh = known.difference(self._good)  # new keys (or refused ones): `check_key`'s test
        passed = good_keys(fresh)
        self._good.update(passed)
        self._checked = len(passed) == len(fresh)

    def may_log(self, metric: str | None) -> bool:
        """Whether the steps may yet log the ranking `metric`: it is declared, or the loop
        may log undeclared names and nothing has been logged yet."""
        declared = self.settings.declared
        return (declared is not None and metric in declared) or (
            self.settings.open and not (self.seen or self.progress.eval_metrics)
        )

    def materialise(
        self, step: int | None = None, metrics: Mapping[str, Any] | None = None
    ) -> dict[str, float] | None:
        """Read the held steps' metrics, and `metrics` of `step` (the step being ended), on
        the host in one transfer per device, reduce them across ranks in one collective,
        and fire each held step's `on_step_end` in step order, with `state.step` and
        `state.metrics` set to that step's; returns `step`'s floats."""
        if not self.buffer.held and metrics is None:
            return None
        held, clean = self.buffer.read(step, metrics, self.reducer)
        state, past = self.state, self._past
        ended = state.step
        for (done, _, epoch, index), values in zip(held, clean, strict=False):
            state.step, state.metrics, state.checkpoint_due = done, values, False
            past.epoch, past.index = epoch, index
            self.fire(done, values, past)
        state.step = ended
        return clean[-1] if metrics is not None else None

    def materialise_on_error(self) -> None:
        """Record the steps held since the last materialisation, before `on_error`: they
        were trained. Not under DDP, where reading them takes a collective that a failing
        group may never complete: they are named in a WARNING instead."""
        buffer = self.buffer
        if not buffer.held:
            return
        steps = buffer.named()
        if self.reducer is not None:
            buffer.held = []
            log.warning(
                "%s: not recorded, their metrics were held (log_every) when the run failed, "
                "and reducing them across ranks needs every rank",
                steps,
            )
            return
        try:
            self.materialise()
        except Exception as error:
            log.error("%s: their held metrics could not be read: %s", steps, error)

    def wrap(self, batch: Any) -> TrainingBatch:
        """`batch` as the `TrainingBatch` the step hooks see, at the feed's position."""
        if isinstance(batch, TrainingBatch):
            return batch
        hb = self.batch
        hb.data = batch
        hb.epoch, hb.index = self.state.epoch, self.state.batch_in_epoch - 1
        return hb
