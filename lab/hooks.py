"""Hooks: the `Callback` base class, the context objects it receives, and the one dispatcher.

The lifecycle, with every hook in the place it fires::

    Experiment.run():
        on_experiment_start(ctx)
        for each group (an arm's repeats):
            on_group_start(ctx, group_name)
            for each run of the group:
                on_run_start(ctx)                        # ctx.run_config is set
                train(run) -> TrainingLoop.fit(run):
                    [post_checkpoint_loaded(state, path)] # only when resuming a checkpoint
                    on_train_start(state)
                    [evals with at_start, at step_idx 0: the eval hooks below]
                    [on_epoch_start(state, epoch)]       # when the loop counts epochs
                    each step:
                        pre_step(state, step_idx, batch)
                        forward, backward, optimizer step
                        on_step_end(state, step_idx, batch, metrics)
                        [on_media(state, step_idx, media)] # histograms, images logged
                        in-loop evals:  on_eval(state, step_idx, eval_name, metrics)
                                        on_benchmark_eval(ctx, eval_result, predictions,
                                                          step=step_idx)
                        each save:      on_checkpoint(state, row)
                                        # (a save due only as an ephemeral one is
                                        # skipped while a callback blocks those)
                    [on_epoch_end(state, epoch)]         # after the epoch's last step,
                                                         # its evals and saves
                    on_train_end(state, artifacts)
                post-training benchmarks:
                    on_benchmark_eval(ctx, eval_result, predictions, step=None)
                [on_error(ctx, exc)]                     # only when the run raised
                on_run_end(ctx, run_result, arm)
        on_experiment_end(ctx, result)
        close()

A bare `TrainingLoop.fit()` (no Experiment) fires the loop's part of this list, then
`close()`. With ``Experiment(executor="processes")`` the experiment-level hooks
(`on_experiment_start`, `on_group_start`, `on_experiment_end`, `close`) fire in the parent
process, and everything from `on_run_start` to `on_run_end` fires in the run's worker
process, on pickled copies of the callbacks, which then get a `close()` of their own there.
A callback whose class sets `run_end_in_parent` also gets `on_run_end` in the parent, as
each run's result arrives there (a display that counts the runs done).

`HOOKS` below is the same list in order; a test keeps it equal to the methods of `Callback`.

`step_idx` is the number of the optimizer step: steps are numbered 1..num_steps, and
`state.step` counts the steps completed, so after `on_step_end(state, 7, ...)` the state
holds `step == 7`, and a metric logged there is stored at step 7.
"""

from __future__ import annotations

import os
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from lab._secrets import logger
from lab.errors import CallbackError, ConfigError

if TYPE_CHECKING:
    import torch

    from lab.experiment import ArmResult, ExperimentResult, RunResult
    from lab.loop.checkpoints import ManifestRow
    from lab.loop.evals import EvalResult
    from lab.loop.records import LoopArtifacts, TrainingBatch
    from lab.media import Media

log = logger("lab.hooks")

#: Every hook, in the order of the lifecycle above.
HOOKS: tuple[str, ...] = (
    "on_experiment_start",
    "on_group_start",
    "on_run_start",
    "post_checkpoint_loaded",
    "on_train_start",
    "on_epoch_start",
    "pre_step",
    "on_step_end",
    "on_media",
    "on_eval",
    "on_benchmark_eval",
    "on_checkpoint",
    "on_epoch_end",
    "on_train_end",
    "on_error",
    "on_run_end",
    "on_experiment_end",
    "close",
)

#: The hooks that end what a callback started: a callback disabled for failing too often
#: still gets these, so that it can release what it holds (a profiler it started, the
#: garbage collector it turned off, a wandb run it opened) and record how the run ended.
ENDING_HOOKS: frozenset[str] = frozenset(
    {"on_train_end", "on_error", "on_run_end", "on_experiment_end", "close"}
)

#: The hooks of one run, from `on_run_start` to `on_run_end`.
RUN_HOOKS: frozenset[str] = frozenset(
    HOOKS[HOOKS.index("on_run_start") : HOOKS.index("on_run_end") + 1]
)


#: `LogContext.extras` an Experiment sets before `on_experiment_start`, for a display that
#: counts runs: how many runs it holds (stages included), how many an earlier attempt
#: finished (they are skipped now, with no hooks), and its executor ("serial" or
#: "processes", where `on_run_end` fires in the workers, not here).
RUNS, FINISHED_BEFORE, EXECUTOR = "lab:runs", "lab:finished_before", "lab:executor"
#: `LogContext.extras` holding the experiment's tags (a list) and notes (a str or None), as
#: ``Experiment(tags=..., notes=...)`` gave them; a sink records them with the experiment.
TAGS, NOTES = "lab:tags", "lab:notes"


@dataclass
class LogContext:
    """What every hook of an experiment shares: where it writes, what runs, and sinks' ids.

    A sink stores the ids it creates in `ids` under names that start with its own prefix
    (the SQL logger uses ``sql:``), so two sinks never overwrite each other.
    """

    experiment: str
    output_dir: Path
    config: dict[str, Any] = field(default_factory=dict)
    run_key: str | None = None
    run_config: dict[str, Any] | None = None
    group_name: str | None = None
    arm: str | None = None
    repeat: int | None = None
    stage: int = 0
    seed: int | None = None
    group_kind: str = "repeats"  # "chain" for the stages of a continual arm
    parent_run_key: str | None = None  # the previous stage's run, in a chain
    config_hash: str | None = None  # what the run depends on, hashed (see lab._reuse)
    ids: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def run_dir(self) -> Path | None:
        """The current run's own folder, or None between runs."""
        return None if self.run_key is None else self.output_dir / self.run_key

    @property
    def folder(self) -> Path:
        """Where a callback writes the current run's files: its folder, or, for a bare
        `TrainingLoop.fit()` without `run_dir`, the working directory."""
        run_dir = self.run_dir
        return run_dir if run_dir is not None else Path.cwd()


@dataclass(eq=False)
class LoopState:
    """The training loop's progress, handed to every loop hook.

    `step` counts completed optimizer steps; `epoch` and `batch_in_epoch` are the data
    position. A callback ends training cleanly after the current step with `request_stop()`.

    A callback that holds something only a full run of steps makes whole (a model average
    over a window of steps: `lab.callbacks.averaging.ModelAverager`) calls
    `block_ephemeral_checkpoints(self)` while it does, and `unblock_ephemeral_checkpoints(self)`
    after, as OLMo-core's callbacks do. While any owner blocks, the loop skips the saves that
    are due only as ephemeral saves (`CheckpointConfig.is_ephemeral`); regular, fixed, start
    and end saves still happen, and `checkpoint_due` says False for a skipped one. Why: an
    ephemeral save inside the window would carry the partial window (a second copy of the
    weights) only to be deleted by the next save, and without one the run resumes from a save
    before the window, so the full window is always re-accumulated on resume. The loop reads
    the block when a step ends, before `on_step_end`: one set emptiness test per step. The
    blockers live only as long as this state (one fit); a callback re-blocks in
    `on_train_start` after a resume.
    """

    ctx: LogContext
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    num_steps: int
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    stop_requested: bool = False
    stop_reason: str | None = None
    # True from on_step_end of a step that a scheduled checkpoint follows: a sink that
    # buffers flushes there, so every metric up to a committed checkpoint is durable.
    checkpoint_due: bool = False
    # The in-loop eval being reported, while on_eval fires (its wall time, tags); else None.
    current_eval: EvalResult | None = None
    # The owners that block ephemeral saves now (see the class docstring); empty: none.
    _ephemeral_blockers: set[object] = field(default_factory=set, init=False, repr=False)

    def request_stop(self, reason: str = "requested by a callback") -> None:
        """Stop after the current step: final checkpoint, `on_train_end`, run `stopped`."""
        self.stop_requested = True
        self.stop_reason = reason

    def block_ephemeral_checkpoints(self, owner: object) -> None:
        """Skip ephemeral saves until `owner` unblocks (any number of owners may block).

        Takes effect from the next step's save on: the loop reads it when a step ends,
        before `on_step_end`. `owner` is any hashable object, usually the callback itself;
        blocking twice with the same owner is one block.
        """
        self._ephemeral_blockers.add(owner)

    def unblock_ephemeral_checkpoints(self, owner: object) -> None:
        """Let ephemeral saves happen again once no other owner blocks them; a no-op for an
        owner that does not block."""
        self._ephemeral_blockers.discard(owner)

    @property
    def ephemeral_checkpoints_blocked(self) -> bool:
        """Whether some owner blocks ephemeral saves now."""
        return bool(self._ephemeral_blockers)

    def state_dict(self) -> dict[str, Any]:
        """The progress a checkpoint must keep to resume the same trajectory."""
        return {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the progress saved by `state_dict`."""
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])


class Callback:
    """Override any hook; the defaults do nothing and cost nothing.

    Hooks are positional and typed, one method per moment of the lifecycle (see the module
    docstring). Callbacks run in `priority` order, higher first; ties keep the order they
    were attached in. A callback that raises is logged and counted, and the run goes on,
    unless strict mode is on, or the callback is `critical`: then its exception propagates
    as it is and fails the run, in `on_run_start` and `on_run_end` as in the loop's hooks,
    and the experiment's other runs go on (`SqlLogger` is critical: a run it cannot record
    must not look recorded). It propagates once the callbacks after it have had the same
    hook, so that a run end one sink could not record still ends the run for the others. A
    critical callback whose `on_run_start` raised has not started the run: it gets none of
    that run's other hooks. `on_error` stays isolated even then, so it never hides the error
    that fired it.

    A best-effort (not critical) callback that fails `max_failures` times in a row (no
    successful call of any of its hooks in between) is disabled for the rest of the run, so
    a broken sink stops costing a traceback per step. Disabled, it still gets the hooks that
    end what it started (`ENDING_HOOKS`: `on_train_end`, `on_error`, `on_run_end`,
    `on_experiment_end`, `close`), so a profiler is stopped, the garbage collector turned
    back on and a wandb run finished; a failure there is recorded like any other and never
    enables it again. It gets every hook again from the next run on. None never disables
    it. A callback with `state_dict()`/`load_state_dict()` is saved in each checkpoint and
    restored when the run resumes from it.
    """

    priority: ClassVar[int] = 0
    critical: bool = False
    #: Consecutive failures before the callback is disabled for the run (None: never).
    #: Left at this default, ``LAB_CALLBACK_MAX_FAILURES`` or ``Dispatcher(max_failures=)``
    #: decide; a subclass that sets its own value keeps it.
    max_failures: ClassVar[int | None] = 5
    #: The name a checkpoint keeps this callback's `state_dict` under (None: its class
    #: name, then ``#2``, ``#3``... for more of one class). Set it to keep two callbacks of
    #: one class apart across a resume that reorders them.
    state_key: str | None = None
    #: With ``executor="processes"``, also get `on_run_end` in the experiment's own process
    #: as each run's result arrives from its worker (its copy in the worker gets it too).
    #: For a display that counts runs done; a sink that records runs must leave it False.
    run_end_in_parent: ClassVar[bool] = False
    #: The keys this callback adds to a step's metrics (exact, or glob patterns such as
    #: ``"throughput/*"``), so a name that something needs is known before the first step.
    metrics_logged: tuple[str, ...] = ()
    #: The metric names this callback reads, as the store names them (``"val/loss"``), each
    #: with who needs it: checked when a fit starts (see `lab.loop.metric_names`).
    metrics_needed: Mapping[str, str] = MappingProxyType({})

    # -- experiment level ----------------------------------------------------------------
    def on_experiment_start(self, ctx: LogContext) -> None:
        """Once, before any group: create the experiment record."""

    def on_group_start(self, ctx: LogContext, group_name: str) -> None:
        """Once per group (an arm's repeats), before its first run."""

    def on_run_start(self, ctx: LogContext) -> None:
        """Once per run, before training; `ctx.run_config` and `ctx.run_key` are set."""

    def on_benchmark_eval(
        self,
        ctx: LogContext,
        eval_result: EvalResult,
        predictions: list[dict],
        *,
        step: int | None = None,
    ) -> None:
        """Per benchmark scored: in the loop (`step` = the train step) or after it (None)."""

    def on_error(self, ctx: LogContext, exc: BaseException) -> None:
        """When a run raises, before `on_run_end` records it as failed."""

    def on_run_end(self, ctx: LogContext, run_result: RunResult, arm: ArmResult) -> None:
        """Once per run, after training and benchmarks: record the final status."""

    def on_experiment_end(self, ctx: LogContext, result: ExperimentResult) -> None:
        """Once, after every run: final summary and flush."""

    def close(self) -> None:
        """Always, right before the experiment (or a bare loop's fit) returns or raises."""

    # -- loop level ----------------------------------------------------------------------
    def post_checkpoint_loaded(self, state: LoopState, path: Path) -> None:
        """After a checkpoint was loaded to resume a run, before `on_train_start`.

        `state` already holds the restored step and data position; `path` is the folder.
        """

    def on_train_start(self, state: LoopState) -> None:
        """Once, before the first step of a fit."""

    def on_epoch_start(self, state: LoopState, epoch: int) -> None:
        """Before the first step of epoch `epoch` (0-based), in loops that count epochs."""

    def pre_step(self, state: LoopState, step_idx: int, batch: TrainingBatch) -> None:
        """Right before step `step_idx` runs, with its batch already on the device."""

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        """After every step, once its metric row was handed to the store."""

    def on_media(self, state: LoopState, step_idx: int, media: Mapping[str, Media]) -> None:
        """When a loop logs non-scalar values at step `step_idx`: histograms and images,
        by key (a `lab.media.Histogram` or `lab.media.Image`)."""

    def on_eval(
        self, state: LoopState, step_idx: int, eval_name: str, metrics: dict[str, float]
    ) -> None:
        """After each in-loop evaluation."""

    def on_checkpoint(self, state: LoopState, row: ManifestRow) -> None:
        """After each checkpoint save or removal was recorded in the manifest."""

    def on_epoch_end(self, state: LoopState, epoch: int) -> None:
        """After epoch `epoch`'s last step, and the evals and saves due at it."""

    def on_train_end(self, state: LoopState, artifacts: LoopArtifacts) -> None:
        """Once, after the last step and the final checkpoint."""


def _overrides(callback: Callback, hook: str) -> bool:
    return getattr(type(callback), hook, None) is not getattr(Callback, hook)


def _is_strict_env() -> bool:
    return os.environ.get("LAB_STRICT", "").lower() in {"1", "true", "yes"}


@dataclass
class CallbackFailure:
    """A callback's failures in one hook of one run, kept so the run can show them later.

    `error` and `traceback` are those of the first failure; `count` is how many times that
    callback's hook has failed in the run so far (the dispatcher records each (run, callback,
    hook) once and then only counts). `disabled` is True on the record of the failure that
    made the dispatcher disable the callback for the rest of the run.
    """

    callback: str
    hook: str
    error: str
    traceback: str
    run_key: str | None = None
    count: int = 1
    disabled: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The JSON form the store keeps on the run (`disabled` only when it is True, so
        records of runs that disabled nothing keep their earlier shape)."""
        out: dict[str, Any] = {
            "callback": self.callback,
            "hook": self.hook,
            "error": self.error,
            "traceback": self.traceback,
            "count": self.count,
        }
        if self.disabled:
            out["disabled"] = True
        return out


def _is_power_of_ten(n: int) -> bool:
    while n % 10 == 0:
        n //= 10
    return n == 1


def _max_failures_env() -> int | None:
    """``LAB_CALLBACK_MAX_FAILURES``: an int >= 1, or 0/none/off to never disable; unset: 5."""
    raw = os.environ.get("LAB_CALLBACK_MAX_FAILURES", "").strip().lower()
    if not raw:
        return Callback.max_failures
    if raw in {"0", "none", "off", "never"}:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 1:
        raise ConfigError(
            f"LAB_CALLBACK_MAX_FAILURES={raw!r}: use an int >= 1, or 0 to never disable a "
            "failing callback"
        )
    return value


def _check_max_failures(value: Any, where: str) -> int | None:
    if value is None or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}={value!r}: use an int >= 1, or None to never disable")
    return value


class _FailurePolicy:
    """The consecutive-failure bookkeeping that a dispatcher and its siblings share.

    A run's dispatchers (the experiment's, and the loop's `extended` one) see the same
    callbacks, so a callback disabled by one must be gone from all of them: each member
    rebuilds its listener tuples when `disabled` or the set of callbacks on a streak
    changes. All of it belongs to one run (`run_key`), and is cleared when the dispatchers
    move on to another run.

    The success path of `Dispatcher.fire` does no bookkeeping for healthy callbacks: only a
    callback that has failed in this run has its hooks wrapped (`_Tracked`), so that a
    success ends its streak. It stays wrapped for the rest of the run, so a callback that
    fails every other call costs one rebuild, not one per failure.
    """

    __slots__ = ("disabled", "members", "run_key", "streaks", "tracked", "unstarted")

    def __init__(self) -> None:
        self.streaks: dict[int, int] = {}  # id(callback) -> failures in a row, only if > 0
        self.tracked: set[int] = set()  # id(callback) of those that failed in this run
        self.disabled: set[int] = set()  # id(callback): only ENDING_HOOKS reach them
        # id(callback) of critical callbacks whose on_run_start raised: no RUN_HOOKS reach them
        self.unstarted: set[int] = set()
        self.members: weakref.WeakSet[Dispatcher] = weakref.WeakSet()
        self.run_key: str | None = None

    def rebuild(self) -> None:
        """Re-resolve every member's listener tuples (only when a failure state changes)."""
        for member in list(self.members):
            member._build_listeners()

    def start_run(self, run_key: str | None) -> None:
        """Forget the previous run's streaks and re-enable what it disabled or left out."""
        self.run_key = run_key
        if self.tracked or self.disabled or self.unstarted:
            self.streaks.clear()
            self.tracked.clear()
            self.disabled.clear()
            self.unstarted.clear()
            self.rebuild()

    def receives(self, cb_id: int, hook: str) -> bool:
        """Whether `hook` reaches the callback now: a disabled one gets only `ENDING_HOOKS`
        (to release what it holds), an unstarted one none of `RUN_HOOKS`."""
        if cb_id in self.unstarted and hook in RUN_HOOKS:
            return False
        return cb_id not in self.disabled or hook in ENDING_HOOKS


class _Tracked:
    """A hook of a callback that has failed in this run: a success ends its failure streak.

    It keeps `__self__` like the bound method it wraps, so the dispatcher finds the callback
    the same way for both.
    """

    __slots__ = ("__self__", "cb_id", "method", "streaks")

    def __init__(
        self, method: Callable[..., Any], owner: Callback, streaks: dict[int, int]
    ) -> None:
        self.method = method
        self.__self__ = owner
        self.cb_id = id(owner)
        self.streaks = streaks

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.method(*args, **kwargs)
        if self.streaks:
            self.streaks.pop(self.cb_id, None)


class Dispatcher:
    """The one place a hook is called: priority, error isolation, strict mode and tracing.

    Which callbacks override which hook is resolved once, here; `fire` then only walks the
    bound methods of the callbacks that listen, so a hook nobody overrides costs one dict
    lookup. Set ``LAB_STRICT=1`` (or pass ``strict=True``) to re-raise callback errors, and
    ``LAB_DEBUG_HOOKS=1`` to log every dispatch.

    Otherwise a failure is recorded once per (run, callback, hook): the first with its
    traceback, logged at ERROR; repeats only add to that record's `count` (a one-line
    WARNING at 10, 100, 1000, ... failures), so a callback that fails every step costs one
    dict lookup per step and does not flood the log or the store.

    After `max_failures` consecutive failures of one callback (in any of its hooks, with no
    successful call of it in between) it is disabled: removed from the listener tuples of
    this dispatcher and its siblings for the rest of the run, with one WARNING, and its
    failure record says ``disabled``. It stays in those of `ENDING_HOOKS`, so it can still
    release what it started (a failure there is recorded, and changes nothing). It is
    enabled again when the dispatcher moves on to the next run (`run_key` changes, right
    before `on_run_start`). The limit is the callback's own `Callback.max_failures` if its
    class sets one, else `max_failures` here, else ``LAB_CALLBACK_MAX_FAILURES``, else 5;
    None or 0 never disables. Critical callbacks and strict mode raise instead, so they are
    never disabled. A successful call of a healthy callback costs nothing extra: only a
    callback that has failed in the run has its hooks wrapped, to see the successes that end
    a streak, and the tuples are built again only when such a state changes.

    A critical callback's exception propagates once the callbacks after it have had the
    hook (their failures then are recorded, or logged in strict mode, and never replace
    it). One raised in `on_run_start` also leaves that callback out of the run's other
    hooks (`RUN_HOOKS`) until the next run: it has not started this one.
    """

    def __init__(
        self,
        callbacks: Iterable[Callback] = (),
        *,
        strict: bool | None = None,
        failures: list[CallbackFailure] | None = None,
        max_failures: int | Literal["env"] | None = "env",
        _policy: _FailurePolicy | None = None,
    ) -> None:
        attached = list(callbacks)
        for cb in attached:
            if not isinstance(cb, Callback):
                raise ConfigError(
                    f"{cb!r} is not a lab.Callback; subclass lab.Callback (and override the "
                    "hooks you need) to attach it"
                )
        # sorted() is stable, so ties keep their attachment order.
        self.callbacks: list[Callback] = sorted(attached, key=lambda cb: -cb.priority)
        self.strict = _is_strict_env() if strict is None else strict
        self.trace = os.environ.get("LAB_DEBUG_HOOKS", "") not in {"", "0"}
        self.failures: list[CallbackFailure] = [] if failures is None else failures
        self.failure_counts: Counter[tuple[str, str]] = Counter()
        self._failure_index: dict[tuple[str | None, str, str], CallbackFailure] = {}
        self.max_failures = (
            _max_failures_env()
            if max_failures == "env"
            else _check_max_failures(max_failures, "Dispatcher(max_failures)")
        )
        self._limits: dict[int, int | None] = {id(cb): self._limit(cb) for cb in self.callbacks}
        self._policy = _FailurePolicy() if _policy is None else _policy
        self._policy.members.add(self)
        self._run_key: str | None = self._policy.run_key
        self._listeners: dict[str, tuple[tuple[str, Callable[..., Any], bool], ...]] = {}
        self._build_listeners()

    @property
    def run_key(self) -> str | None:
        """The run whose failures are being recorded (None outside runs).

        Moving to another run starts that run's failure policy afresh: callbacks the last
        run disabled get their hooks again.
        """
        return self._run_key

    @run_key.setter
    def run_key(self, value: str | None) -> None:
        self._run_key = value
        if value != self._policy.run_key:
            self._policy.start_run(value)

    def _limit(self, cb: Callback) -> int | None:
        """The callback's own `max_failures` where its class (or it) sets one, else ours."""
        for klass in type(cb).__mro__:
            if "max_failures" in vars(klass):
                if klass is Callback and "max_failures" not in vars(cb):
                    return self.max_failures
                break
        value = getattr(cb, "max_failures", None)
        return _check_max_failures(value, f"{type(cb).__name__}.max_failures")

    def _build_listeners(self) -> None:
        """Resolve which callbacks listen to each hook: once, and again only when a callback
        starts or ends a failure streak, is disabled, or fails to start a run. Disabled
        callbacks are left out of all but `ENDING_HOOKS`, unstarted ones out of `RUN_HOOKS`;
        those on a streak are wrapped so that a success ends it."""
        receives = self._policy.receives
        self._listeners = {
            hook: tuple(
                (type(cb).__name__, self._method(cb, hook), cb.critical and hook != "on_error")
                for cb in self.callbacks
                if _overrides(cb, hook) and receives(id(cb), hook)
            )
            for hook in HOOKS
        }

    def _method(self, cb: Callback, hook: str) -> Callable[..., Any]:
        method = getattr(cb, hook)
        policy = self._policy
        if id(cb) in policy.tracked and id(cb) not in policy.disabled:
            return _Tracked(method, cb, policy.streaks)
        return method  # a disabled callback has no streak left to end

    def extended(self, extra: Iterable[Callback]) -> Dispatcher:
        """A dispatcher over these callbacks plus `extra`, sharing the failure record."""
        extra = list(extra)
        if not extra:
            return self
        return self.sibling([*self.callbacks, *extra])

    def sibling(self, callbacks: Iterable[Callback]) -> Dispatcher:
        """A dispatcher over `callbacks` alone, sharing this one's failure record, run key
        and failure policy (a callback disabled by either is disabled in both)."""
        other = Dispatcher(
            callbacks,
            strict=self.strict,
            failures=self.failures,
            max_failures=self.max_failures,
            _policy=self._policy,
        )
        other.failure_counts = self.failure_counts
        other._failure_index = self._failure_index
        other.run_key = self.run_key
        return other

    def disabled(self) -> list[Callback]:
        """The callbacks disabled for the current run after failing too often in a row."""
        return [cb for cb in self.callbacks if id(cb) in self._policy.disabled]

    def listens(self, hook: str) -> bool:
        """Whether any callback overrides `hook`; the loop skips building arguments if not."""
        return bool(self._listeners[hook])

    def stateful(self) -> list[Callback]:
        """The callbacks whose state a checkpoint saves."""
        return [
            cb
            for cb in self.callbacks
            if callable(getattr(cb, "state_dict", None))
            and callable(getattr(cb, "load_state_dict", None))
        ]

    def fire(self, hook: str, *args: Any, **kwargs: Any) -> None:
        """Call `hook` on every callback that overrides it, highest priority first."""
        listeners = self._listeners[hook]
        for name, method, critical in listeners:
            if self.trace:
                log.debug("hook %s -> %s", hook, name)
            try:
                method(*args, **kwargs)
            except Exception as exc:
                if critical:
                    self._finish_after_critical(hook, listeners, method, args, kwargs)
                    raise
                if self.strict:
                    raise CallbackError(f"{name}.{hook} raised {exc!r}") from exc
                self._record(name, hook, exc, method)

    def _finish_after_critical(
        self,
        hook: str,
        listeners: tuple[tuple[str, Callable[..., Any], bool], ...],
        failed: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """A critical callback raised in `hook`; before its error propagates, the callbacks
        after it still get the hook, so that a run end (or start) one sink could not record
        still reaches the others. What they raise is recorded (or, critical or strict, only
        logged), never in place of that error. A callback whose `on_run_start` raised has
        not started the run, so no more of its hooks reach it."""
        if hook == "on_run_start":
            self._unstart(failed)
        at = next(i for i, entry in enumerate(listeners) if entry[1] is failed)
        for name, method, critical in listeners[at + 1 :]:
            if self.trace:
                log.debug("hook %s -> %s", hook, name)
            try:
                method(*args, **kwargs)
            except Exception as exc:
                if not (critical or self.strict):
                    self._record(name, hook, exc, method)
                    continue
                if critical and hook == "on_run_start":
                    self._unstart(method)
                log.exception(
                    "callback %s.%s raised too; the error of a critical callback before it "
                    "is the one that propagates",
                    name,
                    hook,
                )

    def _unstart(self, method: Callable[..., Any]) -> None:
        """Leave a critical callback whose `on_run_start` raised out of the run's other hooks."""
        owner = getattr(method, "__self__", None)
        if isinstance(owner, Callback) and id(owner) not in self._policy.unstarted:
            self._policy.unstarted.add(id(owner))
            self._policy.rebuild()

    def _record(
        self, name: str, hook: str, exc: Exception, method: Callable[..., Any] | None = None
    ) -> None:
        owner = getattr(method, "__self__", None)
        cb_id = id(owner) if isinstance(owner, Callback) else None
        self.failure_counts[(name, hook)] += 1
        key = (self.run_key, name, hook)
        seen = self._failure_index.get(key)
        disable = self._count_streak(cb_id)
        if seen is not None:  # a repeat: count it, warn at 10, 100, 1000, ...
            seen.count += 1
            if disable:
                self._disable(seen, cb_id)
            if seen.count % 10 == 0 and _is_power_of_ten(seen.count):
                log.warning(
                    "callback %s.%s has now failed %d times in run %s",
                    name,
                    hook,
                    seen.count,
                    self.run_key,
                )
            return
        tb = traceback.format_exc()
        failure = CallbackFailure(name, hook, f"{type(exc).__name__}: {exc}", tb, self.run_key)
        self._failure_index[key] = failure
        self.failures.append(failure)
        log.error(
            "callback %s.%s raised; the run goes on (repeats are only counted):\n%s",
            name,
            hook,
            tb,
        )
        if disable:
            self._disable(failure, cb_id)

    def _count_streak(self, cb_id: int | None) -> bool:
        """Add a failure to the callback's streak; True when it reaches the limit. A disabled
        callback (failing in an ending hook) has no streak: it stays disabled."""
        limit = self._limits.get(cb_id) if cb_id is not None else None
        if limit is None or cb_id in self._policy.disabled:
            return False
        streaks = self._policy.streaks
        streak = streaks.get(cb_id, 0) + 1
        streaks[cb_id] = streak
        if streak >= limit:
            return True
        if cb_id not in self._policy.tracked:  # its first failure: wrap its hooks to see
            self._policy.tracked.add(cb_id)  # the successes that end a streak
            self._policy.rebuild()
        return False

    def _disable(self, failure: CallbackFailure, cb_id: int | None) -> None:
        """Take the callback out of every listener tuple of this run, with one warning."""
        policy = self._policy
        policy.streaks.pop(cb_id, None)
        if cb_id is None or cb_id in policy.disabled:
            return
        policy.disabled.add(cb_id)
        failure.disabled = True
        policy.rebuild()
        log.warning(
            "callback %s failed %d times in a row (in %s: %s); disabled for the rest of run %s",
            failure.callback,
            self._limits[cb_id],
            failure.hook,
            failure.error,
            self.run_key,
        )
