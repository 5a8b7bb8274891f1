"""The one dispatcher: every hook call goes through `Dispatcher.fire`.

`lab.hooks` holds the vocabulary (the hooks, `Callback`, `LogContext`, `LoopState`); this module
decides how a hook reaches the callbacks: in which order, what a raising callback does to the
run (the failure policy: isolation, strict mode, critical callbacks, disabling a callback that
keeps failing), and what a callback may put into a step's metrics.

Order: by `lab.hooks.Phase`, and in attachment order inside a phase (`lab.hooks.priority_of`,
which also honours a `priority` number a callback still sets). In `on_step_end` the produce
phase (the callbacks that declare `Callback.metrics_logged`) runs before every other, so that
every consumer (the SQL logger that stores the step, a console, early stopping) sees the
step's metrics whole. This is resolved once, when the listener tuples are built, never per
step.

Under DDP a dispatcher on a rank other than 0 leaves out the callbacks whose class sets
`Callback.rank_zero_only` (`lab._distributed.for_rank`), once, when it is built.

Environment knobs: ``LAB_STRICT=1`` re-raises callback errors, ``LAB_DEBUG_HOOKS=1`` logs every
dispatch, ``LAB_CALLBACK_MAX_FAILURES`` sets how many failures in a row disable a callback.
"""

from __future__ import annotations

import itertools
import os
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from lab._distributed import for_rank
from lab._metrics import as_number, check_key
from lab._secrets import logger
from lab.errors import CallbackError, ConfigError, MetricError, RefusedMetric
from lab.hooks import (
    ENDING_HOOKS,
    EXPERIMENT_HOOKS,
    Callback,
    Hook,
    HookEnum,
    Phase,
    phase_of,
    priority_of,
)

#: The log of dispatching (kept under the name users filter on: the hooks' own).
log = logger("lab.hooks")


def _overrides(callback: Callback, hook: str) -> bool:
    return getattr(type(callback), hook, None) is not getattr(Callback, hook)


def _target(callback: Callback, hook: str) -> Callable[..., Any] | None:
    """What receives `hook` for `callback`, or None when it does not listen: its bound
    method, or, for a callback whose class adapts another library's signatures (it has a
    ``lab_hook_adapter(callback, hook)``, e.g. `lab.rl.coati.Callback`), what the adapter
    gives. Resolved when the listener tuples are built, never per call, so an ordinary
    callback pays one attribute lookup per hook once."""
    adapter = getattr(type(callback), "lab_hook_adapter", None)
    if adapter is not None:
        return adapter(callback, hook)
    return getattr(callback, hook) if _overrides(callback, hook) else None


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
        if cb_id in self.unstarted and hook not in EXPERIMENT_HOOKS:
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


def produces_metrics(callback: Callback) -> bool:
    """Whether `callback` is in the produce phase (it declares the step metrics it adds,
    `Callback.metrics_logged`): its `on_step_end` runs before every consumer's."""
    return phase_of(callback) is Phase.PRODUCE or bool(getattr(callback, "metrics_logged", ()))


class _StepMetrics:
    """A callback's `on_step_end`, with the keys it adds to the step's `metrics` checked.

    What it costs a step when nothing is wrong: two `len` calls. Only when the dict grew are
    the new keys (the last ones: a dict keeps insertion order) looked at; each must be a
    valid key holding a number. A float passes as it is; an int, a bool, a numpy scalar or a
    one-element tensor becomes a float in place (as Lightning's ``self.log`` does with a 0-d
    tensor, so consumers and the store see one type); anything else is taken out of the step's
    metrics, so no consumer sees it and the store never gets it, and a `RefusedMetric` naming
    the callback is raised, which the dispatcher records against that callback like any other
    failure. A value the callback replaced, rather than added, is checked by the store as
    every value it gets is.
    """

    __slots__ = ("__self__", "method", "name")

    def __init__(self, method: Callable[..., Any], owner: Callback) -> None:
        self.method = method
        self.__self__ = owner
        self.name = type(owner).__name__

    def __call__(self, state: Any, step_idx: int, batch: Any, metrics: dict[str, Any]) -> None:
        before = len(metrics)
        self.method(state, step_idx, batch, metrics)
        added = len(metrics) - before
        if added > 0:
            newest = reversed(metrics)  # the added keys are the last ones
            for _ in range(added):
                key = next(newest)
                if type(metrics[key]) is not float or type(key) is not str:
                    self._check(metrics, added, step_idx)
                    return

    def _check(self, metrics: dict[str, Any], added: int, step: int) -> None:
        """Turn the added values into floats, or refuse them (the slow path: a value that is
        not a float was added). A float key-checked only by type here: the store checks the
        key's length and characters, as it does for every key."""
        refused: list[tuple[Any, Any]] = []
        for key in list(itertools.islice(reversed(metrics), added)):
            value = metrics[key]
            if type(value) is float and type(key) is str:
                continue
            try:
                check_key(key, step)
                metrics[key] = as_number(key, step, value)
            except MetricError:
                refused.append((key, value))
        if not refused:
            return
        for key, _ in refused:
            del metrics[key]
        key, value = refused[-1]  # the first of them the callback added
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise RefusedMetric(
            f"{self.name} put metrics[{key!r}] = {_describe(value)} into the step's scalar "
            f"metrics at step {step}{more}; log a float (tensor.item()), or a histogram with "
            "loop.log_histogram"
        )


def _describe(value: Any) -> str:
    """A short form of a value that is not a metric: a tensor or array by its shape."""
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, (str, bytes)):
        return f"{type(value).__name__}(shape={tuple(shape)})"
    return f"{type(value).__name__} {value!r:.40}"


class Dispatcher:
    """The one place a hook is called: phase order, error isolation, strict mode and tracing.

    Which callbacks override which hook is resolved once, here; `fire` then only walks the
    bound methods of the callbacks that listen, so a hook nobody overrides costs one dict
    lookup. Set ``LAB_STRICT=1`` (or pass ``strict=True``) to re-raise callback errors, and
    ``LAB_DEBUG_HOOKS=1`` to log every dispatch.

    In `on_step_end` the callbacks that produce step metrics (`produces_metrics`) run first,
    then the others, each group in phase order (resolved here, once). What a callback
    adds to the step's metrics is checked after its call (`_StepMetrics`): a value that is
    not a number is refused with a `RefusedMetric` (a `MetricError`) that names the
    callback, the key and the step. It counts as that callback's failure: recorded, counted
    toward `max_failures`, re-raised as it is in strict mode, and failing the run if the
    callback is critical.

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
        # under DDP, the callbacks that declare rank_zero_only fire on rank 0 alone
        attached = for_rank(callbacks)
        for cb in attached:
            if not isinstance(cb, Callback):
                raise ConfigError(
                    f"{cb!r} is not a lab.Callback; subclass lab.Callback (and override the "
                    "hooks you need) to attach it"
                )
        # by phase (or the priority number a callback sets); sorted() is stable, so a phase
        # keeps its attachment order
        self.callbacks: list[Callback] = sorted(attached, key=lambda cb: -priority_of(cb))
        # on_step_end: the producers of step metrics first, then the consumers (stable, so
        # priority still orders each group)
        self._step_end_order = sorted(self.callbacks, key=lambda cb: not produces_metrics(cb))
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
                (
                    type(cb).__name__,
                    self._method(cb, hook, target),
                    cb.critical and hook != Hook.ERROR,
                )
                for cb in (self._step_end_order if hook == Hook.STEP_END else self.callbacks)
                if receives(id(cb), hook) and (target := _target(cb, hook)) is not None
            )
            for hook in Hook  # every hook registered by now, a plug-in's too (lab.hooks.HOOKS)
        }
        floats = checked = self._listeners[Hook.STEP_END]
        first = next(
            (cb for cb in self._step_end_order if receives(id(cb), Hook.STEP_END)
             and _target(cb, Hook.STEP_END) is not None),
            None,
        )  # fmt: skip
        # True when no callback can change a step's metrics in on_step_end: none listens, or
        # the only one is a receiver of exact floats, which leaves them as they are
        self.keeps_step_metrics = not floats
        if first is not None and hasattr(type(first), "on_step_end_floats"):
            (name, _, critical), *rest = floats

            def entry(method: Callable[..., Any]) -> tuple[Any, ...]:
                return ((name, self._method(first, Hook.STEP_END, method), critical), *rest)

            floats = checked = entry(first.on_step_end_floats)  # type: ignore[attr-defined]  # checked
            if hasattr(type(first), "on_step_end_checked"):
                checked = entry(first.on_step_end_checked)  # type: ignore[attr-defined]  # checked
            self.keeps_step_metrics = not rest
        self._step_end_floats, self._step_end_checked = floats, checked

    def _method(self, cb: Callback, hook: str, method: Callable[..., Any]) -> Callable[..., Any]:
        if hook == Hook.STEP_END:
            method = _StepMetrics(method, cb)
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

    def listens(self, hook: HookEnum) -> bool:
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

    def fire(self, hook: HookEnum, *args: Any, **kwargs: Any) -> None:
        """Call `hook` on every callback that overrides it, in phase order (a `Hook`, or a
        member of a plug-in's enum such as `lab.rl.hooks.RLHook`; its name as a str is the
        same key)."""
        self._fire(hook, self._listeners[hook], args, kwargs)

    def fire_step_end(
        self, state: Any, step: int, batch: Any, metrics: dict[str, float], checked: bool
    ) -> None:
        """`on_step_end` for a step whose metrics the loop made exact floats. The first
        callback to get them has nothing before it that could have replaced a value, so
        where its class has an ``on_step_end_floats`` (`lab.loggers.SqlLogger`: its store
        then skips its pass over the types), that receives the hook instead; with `checked`
        (the loop checked every key too) its ``on_step_end_checked`` where it has one (the
        store skips its pass over the keys as well). Resolved with the listener tuples,
        never per step. A class with either method must leave the metrics unchanged
        (`keeps_step_metrics`)."""
        listeners = self._step_end_checked if checked else self._step_end_floats
        self._fire(Hook.STEP_END, listeners, (state, step, batch, metrics), {})

    def _fire(
        self,
        hook: HookEnum,
        listeners: tuple[tuple[str, Callable[..., Any], bool], ...],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
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
                    if isinstance(exc, RefusedMetric):
                        raise  # its message names the callback already
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
        if hook == Hook.RUN_START:
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
                if critical and hook == Hook.RUN_START:
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
        if cb_id is None:
            return False
        limit = self._limits.get(cb_id)
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
        if cb_id is None:
            return
        policy.streaks.pop(cb_id, None)
        if cb_id in policy.disabled:
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
