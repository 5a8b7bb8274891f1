"""The tests' one recorder callback: it listens to the hooks a test names, and keeps one
note per call, in the order the hooks fired.

A test names its hooks and says what it notes of each call::

    class Steps(Recorder, hooks=("on_train_start", "on_step_end")):
        def note(self, hook: str, *args: Any, **kwargs: Any) -> Any:
            return (hook, args[1]) if hook == "on_step_end" else hook

    steps = Steps()
    TrainingLoop(..., callbacks=[steps]).fit(...)
    assert steps.calls == ["on_train_start", ("on_step_end", 1), ("on_step_end", 2)]

Only the named hooks are overridden, so the dispatcher calls the recorder for those alone,
as it would a callback that defined each of them by hand; and as such a method would, a
call that the hook's signature (`lab.Callback`'s) does not take raises `TypeError`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from lab import Callback
from lab.hooks import HOOKS

#: Every hook a callback can listen to, ``close`` included.
EVERY_HOOK: tuple[str, ...] = HOOKS


def _listener(hook: str) -> Callable[..., None]:
    hook = str(hook)  # the name, also for a `lab.hooks.Hook`
    signature = inspect.signature(getattr(Callback, hook))

    def listen(self: Recorder, *args: Any, **kwargs: Any) -> None:
        signature.bind(self, *args, **kwargs)
        self.calls.append(self.note(hook, *args, **kwargs))

    listen.__name__ = listen.__qualname__ = hook
    return listen


class Recorder(Callback):
    """Appends ``self.note(hook, *args, **kwargs)`` to `calls` for each hook it listens to.

    `calls` may be a list the test already holds (several recorders then share one trace).
    A subclass that defines a hook itself keeps its own method for it.
    """

    def __init_subclass__(cls, hooks: Iterable[str] = (), **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for hook in hooks:
            if hook not in HOOKS:
                raise TypeError(f"{cls.__name__}: {hook!r} is no hook of lab.hooks.HOOKS")
            if str(hook) not in cls.__dict__:
                setattr(cls, str(hook), _listener(hook))

    def __init__(self, calls: list[Any] | None = None) -> None:
        self.calls: list[Any] = [] if calls is None else calls

    def note(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        """What to keep of one call: the hook's name unless a subclass says otherwise."""
        return hook


class Labels(Recorder):
    """Notes each call as one string: the hook's name, then what tells its calls apart (the
    run key of ``on_run_start``, the step of ``on_step_end``, the run key and exception
    class of ``on_error``, the run key and status of ``on_run_end``, the experiment's status
    of ``on_experiment_end``), e.g. ``"on_run_end:base-r0:completed"``."""

    def note(self, hook: str, *args: Any, **kwargs: Any) -> str:
        if hook == "on_run_start":
            return f"{hook}:{args[0].run_key}"
        if hook == "on_step_end":
            return f"{hook}:{args[1]}"
        if hook == "on_error":
            return f"{hook}:{args[0].run_key}:{type(args[1]).__name__}"
        if hook == "on_run_end":
            return f"{hook}:{args[1].run_key}:{args[1].status}"
        if hook == "on_experiment_end":
            return f"{hook}:{args[1].status}"
        return hook
