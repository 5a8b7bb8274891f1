"""`BackgroundCalls`: calls into a slow client, made in order on a thread of their own.

A logger that mirrors steps into a remote service (wandb, an HTTP server) would otherwise
make the training thread wait on that service's client at every logged step: wandb's
`run.log` costs about half a millisecond even offline, more than a small model's whole
step. The logger hands each call here instead. The training thread pays a deque append; a
daemon thread wakes on an interval (not per call: waking per call costs the training thread
a context switch each step) and makes the calls in the order they were queued.

Nothing is dropped: when `max_pending` calls wait, `call` blocks until the thread has
caught up (back-pressure). A call that raises is not retried; the first such error is
raised on the training thread by the next `call` or `flush`, so the caller's failure policy
sees it. `flush` waits until every queued call has been made, and `close` flushes and stops
the thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from lab._secrets import logger

log = logger("lab.background")


class BackgroundCalls:
    """An ordered queue of calls that one daemon thread makes, named `name`."""

    def __init__(self, name: str, *, interval_s: float = 0.2, max_pending: int = 10_000) -> None:
        self._calls: deque[tuple[Callable[..., Any], tuple[Any, ...]] | threading.Event] = deque()
        self._interval_s = interval_s
        self._max_pending = max_pending
        self._wake = threading.Event()
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)``; waits only when `max_pending` calls are already queued."""
        if self._stopping:
            raise RuntimeError("BackgroundCalls.call after close")
        self._raise_error()
        if len(self._calls) >= self._max_pending:
            self.flush()
        self._calls.append((fn, args))

    def flush(self) -> None:
        """Wait until every call queued so far has been made; raise the first that failed."""
        if self._thread.is_alive():
            done = threading.Event()
            self._calls.append(done)
            self._wake.set()
            done.wait()
        self._raise_error()

    def close(self) -> None:
        """Make what is queued, stop the thread, and raise the first call that failed."""
        self._stopping = True
        self._wake.set()
        self._thread.join()
        self._raise_error()

    @property
    def pending(self) -> int:
        """Calls queued and not yet made."""
        return len(self._calls)

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        calls = self._calls
        while True:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            while calls:
                item = calls.popleft()
                if isinstance(item, threading.Event):
                    item.set()
                    continue
                fn, args = item
                try:
                    fn(*args)
                except Exception as exc:
                    if self._error is None:
                        self._error = exc
                    else:
                        log.warning("a further background call failed: %r", exc)
            if self._stopping:
                return
