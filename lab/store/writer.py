"""The metric write path: a bounded buffer on the training thread, a writer thread behind it.

`put` is O(1) and never touches the disk: it appends one step's metric dict to a bounded
deque (an append is atomic, so the common case takes no lock). The writer thread wakes
every `interval_s` (or at once for a flush or a full buffer) and writes whatever piled up
in one transaction.

Nothing is ever dropped. When the buffer is full, `put` waits (back-pressure); a failed
batch on its way back counts as buffered, so a failing store never makes the buffer grow
past its bound. A write that fails stays at the front of the buffer, in order, and is tried
again with a growing backoff (capped at `max_backoff_s`) for as long as the writer runs.
`flush` returns once everything put before it is committed. It raises `StoreError`, with the
number of rows still unwritten, when the store has been failing for `give_up_s` (a lost
server that does not come back, a full disk), at once when the store rejects the rows
outright (a constraint or a bad value, which no retry can fix), and when one write has not
returned for `give_up_s` past SQLite's busy timeout. The rows stay buffered either way, so a
later `flush` succeeds once the store takes them. `close` gives the store one last window of
`give_up_s` and raises if that fails. Every wait here is bounded that way, wherever its
flush marker sits in the buffer (a writer that gives up answers every flush still waiting),
and polls, so a SIGTERM to the waiting thread takes effect at once.

Every live writer is flushed and closed when the interpreter exits (`atexit`), and a SIGTERM
to the main thread is turned into `Terminated`, an exception that unwinds the training code
(so runs are recorded as interrupted) and then exits through that same flush.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from lab._env import seconds_from_env
from lab._secrets import logger, mask
from lab._signals import unwind_on_sigterm
from lab.errors import StoreError
from lab.store.engine import SQLITE_BUSY_TIMEOUT_MS

log = logger("lab.store")

#: What a writer is given for one step of one run: {key: value} for metrics.
P = TypeVar("P")
#: One step of one run: (run_id, step, what was logged, wall_time).
Item = tuple[int, int, P, float]
#: One step of one run's metrics: (run_id, step, {key: value}, wall_time).
MetricItem = Item[dict[str, float]]

DEFAULT_GIVE_UP_S = 120.0


def rejected(error: BaseException) -> bool:
    """Whether no retry can fix `error`: the store refused the rows themselves (a
    constraint, a value, the statement), not an outage. SQLAlchemy's errors are looked up
    where one is met: a writer that sends to a `lab serve` server never imports it."""
    import sqlalchemy.exc as sa_exc

    refusals = (sa_exc.IntegrityError, sa_exc.DataError, sa_exc.ProgrammingError)
    return isinstance(error, (*refusals, TypeError, ValueError))


_STOP = object()
#: How often a thread waiting on the writer (`flush`, `close`, a full buffer) looks up.
_POLL_S = 0.05
#: The longest one healthy write may take: SQLite's busy timeout, behind another writer.
_LONGEST_WRITE_S = SQLITE_BUSY_TIMEOUT_MS / 1000


class PartlyWritten(Exception):
    """Raised by a write function that wrote the first `done` items of its batch, in order,
    and not the others (why: `cause`). The writer keeps only the others, at the front of the
    buffer; a write function that sends batches elsewhere (`lab.store.http.sender`) thus
    never has the ones it delivered sent again."""

    def __init__(self, done: int, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.done, self.cause = done, cause


class _Flush:
    """A flush marker in the buffer: set once every item before it is committed, or once
    the writer gave up on them for now (then `error` says why)."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: StoreError | None = None


def give_up_after() -> float:
    """How long a flush waits out a failing store: ``LAB_STORE_RETRY_S``, else 120 s."""
    return seconds_from_env("LAB_STORE_RETRY_S", DEFAULT_GIVE_UP_S, StoreError)


class MetricWriter(Generic[P]):
    """Buffers metric items (or other items of one step, `P`: a step's media) and writes
    them in batches from a background thread.

    `interval_s`: how long the writer thread sleeps between batches (a function is asked
    before each sleep, for a write function whose best pace changes). `idle_s`: when
    nothing was written for that long, `write([])` is called anyway, so the
    store can refresh the heartbeats of its running runs. `what` names the rows in messages
    and in the thread's name ("metric", "media"). `on_start` runs first in the writer
    thread (a writer process opens the store there, before the first batch). `window_env`
    names the setting of `give_up_s` in messages (``LAB_HTTP_RETRY_S`` for a server).
    """

    def __init__(
        self,
        write: Callable[[list[Item[P]]], None],
        *,
        max_pending: int = 8192,
        max_batch: int = 50_000,
        interval_s: float | Callable[[], float] = 0.25,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        give_up_s: float | None = None,
        idle_s: float | None = None,
        what: str = "metric",
        on_start: Callable[[], None] | None = None,
        window_env: str = "LAB_STORE_RETRY_S",
    ) -> None:
        self._write = write
        self._on_start = on_start
        self._window_env = window_env
        self._what = what
        self._interval_s = interval_s
        self._buffer: deque[Any] = deque()
        self._max_pending = max_pending
        # What `put` lets the buffer hold: `max_pending`, less a failed batch that is out of
        # the buffer for its retry (it comes back), so a failing store caps the buffer.
        self._room_for = max_pending
        self._taken_at = time.monotonic()  # when the batch now out was taken (odd cycle)
        self._room = threading.Condition()
        self._max_batch = max_batch
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._give_up_s = give_up_after() if give_up_s is None else give_up_s
        self._idle_s = idle_s
        self._delay = backoff_s  # the next backoff; grows while failing, reset on success
        self._failing_since: float | None = None  # monotonic time of the first failure
        self._last_error: BaseException | None = None
        self._final: StoreError | None = None  # why the writer stopped with rows unwritten
        self._last_write = time.monotonic()
        self._wake = threading.Event()
        # Counted up by the writer thread as it takes items (odd) and as they are settled,
        # committed or back in the buffer (even): `flush` reads it around its look at the
        # buffer, so it never sees an empty buffer while a failed batch is on its way back.
        self._cycle = 0
        self._asked: deque[None] = deque()  # one entry per flush or stop not yet taken
        self._thread = threading.Thread(target=self._drain, name=f"lab-{what}-writer", daemon=True)
        self._thread.start()
        _live.add(self)
        _install_exit_handlers()

    # -- the training thread's side ------------------------------------------------------
    def put(self, run_id: int, step: int, metrics: P, wall_time: float) -> None:
        """Buffer one step's metrics; waits only while the buffer is full."""
        if len(self._buffer) >= self._room_for:
            self._wait_for_room()
        self._buffer.append((run_id, step, metrics, wall_time))

    def _wait_for_room(self) -> None:
        with self._room:
            while len(self._buffer) >= self._room_for:
                self._raise_if_waited_out()
                if self._given_up():
                    raise self._not_written()
                self._wake.set()
                self._room.wait(_POLL_S)

    def flush(self) -> None:
        """Return once every item put so far is committed; raise `StoreError` when the store
        has failed for longer than `give_up_s`, or rejected the rows (they are kept)."""
        if not self._thread.is_alive():
            self._raise_final()
            return
        cycle = self._cycle
        if cycle % 2 == 0 and not self._buffer and self._cycle == cycle:
            return  # nothing put is waiting or being written: all of it is committed
        marker = _Flush()
        self._asked.append(None)
        self._buffer.append(marker)
        self._wake.set()
        while not marker.done.wait(_POLL_S):
            self._raise_if_waited_out()
        if marker.error is not None:
            raise marker.error from marker.error.__cause__

    def close(self) -> None:
        """Flush, then stop the writer thread; raise `StoreError` if the store still failed
        after one last `give_up_s`, or one write hung that long (the rows it could not write
        are lost with the process)."""
        _live.discard(self)
        if self._thread.is_alive():
            self._asked.append(None)
            self._buffer.append(_STOP)
            self._wake.set()
            while self._thread.is_alive():
                self._thread.join(_POLL_S)
                hung = self._hung()
                if hung is not None:
                    self._final = hung
                    break
        self._raise_final()

    def unwritten(self) -> int:
        """How many metric rows (points) are buffered and not yet committed."""
        items = list(self._buffer)  # one C call under the GIL: a consistent snapshot
        return sum(len(item[2]) for item in items if type(item) is tuple)

    # -- errors ----------------------------------------------------------------------------
    def _raise_if_waited_out(self) -> None:
        """Raise why a thread waiting on the writer should stop waiting: the writer thread
        ended, or one write has not returned for `_hung` to call it hung. (A store that has
        failed for `give_up_s` answers every flush waiting itself.)"""
        if not self._thread.is_alive():
            self._raise_final()
            raise StoreError(
                f"the {self._what} writer has stopped with {self.unwritten()} rows unwritten; "
                "this store is closed"
            )
        hung = self._hung()
        if hung is not None:
            raise hung

    def _hung(self) -> StoreError | None:
        """The error for a write that has not returned for `give_up_s` past the longest a
        healthy write may wait (SQLite's busy timeout, behind another process's write), or
        None while it has not."""
        seconds = time.monotonic() - self._taken_at
        if self._cycle % 2 == 0 or seconds < self._give_up_s + _LONGEST_WRITE_S:
            return None
        return StoreError(
            f"{self._what} rows are not written: one write to the store has not returned for "
            f"{seconds:.1f}s; they are kept and retried ({self._window_env} sets how long to "
            f"wait, now {self._give_up_s:g}s)"
        )

    def _given_up(self) -> bool:
        since = self._failing_since
        error = self._last_error
        if since is None or error is None:
            return False
        return rejected(error) or time.monotonic() - since >= self._give_up_s

    def _not_written(self, *, stopping: bool = False) -> StoreError:
        error = self._last_error
        since = self._failing_since
        seconds = 0.0 if since is None else time.monotonic() - since
        n = self.unwritten()
        if error is not None and rejected(error):
            why = f"the store rejected them ({_reason(error)})"
        else:
            why = f"the store has failed for {seconds:.1f}s ({_reason(error)})"
        if stopping:
            tail = f"the writer stopped with {n} {self._what} rows unwritten"
            rows = "metrics" if self._what == "metric" else f"{self._what} rows"
            return _chained(StoreError(f"{rows} could not be written: {why}; {tail}"), error)
        return _chained(
            StoreError(
                f"{n} {self._what} rows are not written: {why}; they are kept and retried "
                f"({self._window_env} sets how long to wait, now {self._give_up_s:g}s)"
            ),
            error,
        )

    def _raise_final(self) -> None:
        final, self._final = self._final, None
        if final is not None:
            raise final from final.__cause__

    # -- the writer thread -----------------------------------------------------------------
    def _take(self) -> tuple[list[Item[P]], _Flush | None, bool]:
        """Pop what is buffered up to the first flush marker or stop (or `max_batch`)."""
        items: list[Item[P]] = []
        while len(items) < self._max_batch:
            try:
                item = self._buffer.popleft()
            except IndexError:
                break
            if item is _STOP:
                self._asked.popleft()
                return items, None, True
            if type(item) is _Flush:
                self._asked.popleft()
                return items, item, False  # everything put before this flush is in `items`
            items.append(item)
        return items, None, False

    def _drain(self) -> None:
        """Wake every `interval_s`, or at once on a flush, a stop or a full buffer, and write
        what piled up in one transaction. `put` never wakes this thread by itself: a wake-up
        per step would hand the GIL back and forth with the training thread every step."""
        if self._on_start is not None:
            try:
                self._on_start()
            except Exception as exc:  # a head start only: the writes themselves still run
                log.debug("%s writer: %r before the first batch", self._what, exc)
        while True:
            if self._failing_since is None:
                interval = self._interval_s
                self._wake.wait(interval() if callable(interval) else interval)
            else:
                time.sleep(self._delay)  # back off; flushes wait for the retry
                self._delay = min(self._delay * 2, self._max_backoff_s)
            self._wake.clear()
            self._taken_at = time.monotonic()
            self._cycle += 1  # odd: before anything leaves the buffer (see `flush`)
            items, marker, stop = self._take()
            if self._failing_since is not None:  # a retry: the batch counts as buffered
                self._room_for = max(self._max_pending - len(items), 0)
            idle = (
                not items
                and self._idle_s is not None
                and time.monotonic() - self._last_write >= self._idle_s
            )
            error = self._attempt(items) if items or idle else None
            if error is None:
                if marker is not None:
                    marker.done.set()
            else:
                if isinstance(error, PartlyWritten):  # the first ones are written: done
                    items = items[error.done :]
                ended, stop = self._put_back(items, marker, stop)
                if ended:
                    return
            self._room_for = self._max_pending
            self._cycle += 1  # even: what was taken is committed, or back in the buffer
            self._notify_room()
            if stop:
                return
            if self._failing_since is None and (
                self._asked
                or len(items) >= self._max_batch
                or len(self._buffer) >= self._max_pending // 2
            ):
                # Much more is waiting: go round again at once. A few steps that came in
                # during the write wait for the next wake-up instead, so the writer does not
                # chase the training thread with tiny transactions.
                self._wake.set()

    def _put_back(self, items: list[Any], marker: _Flush | None, stop: bool) -> tuple[bool, bool]:
        """After a failed write: the batch back at the front of the buffer, in order, and
        the flush or stop that came with it either failed (the retries are given up, or a
        stop's window is over) or waiting behind it for the retry. Returns whether the
        thread ends now and whether it still stops after this round."""
        self._buffer.extendleft(reversed(items))  # back at the front, in order
        beyond = self._out_of_reach()
        stopping = stop or any(entry is _STOP for entry in beyond)
        if self._given_up() or (stopping and self._window_over()):
            failed = self._not_written()
            for entry in (marker, *beyond):
                if type(entry) is _Flush and not entry.done.is_set():
                    entry.error = failed
                    entry.done.set()
            if stopping:
                self._final = self._not_written(stopping=True)
                self._room_for = self._max_pending
                self._notify_room()
                return True, stop
            return False, stop
        # the flush or the stop waits for the retry, behind the kept items
        tail = [m for m in (marker,) if m is not None] + ([_STOP] if stop else [])
        for entry in reversed(tail):
            self._buffer.insert(len(items), entry)
            self._asked.append(None)  # waiting again, to be taken again
        return False, False

    def _out_of_reach(self) -> list[Any]:
        """The flush markers and the stop that a retry cannot reach while the items in front
        keep failing: those behind `max_batch` items or more (each retry takes the same
        front batch, which fails again). A writer that gives up answers them too, so no flush
        waits for ever behind a store that fails."""
        found = []
        ahead = 0
        for entry in list(self._buffer):  # one C call: a snapshot
            if type(entry) is _Flush or entry is _STOP:
                if ahead >= self._max_batch:
                    found.append(entry)
            else:
                ahead += 1
        return found

    def _window_over(self) -> bool:
        since = self._failing_since
        return since is not None and time.monotonic() - since >= self._give_up_s

    def _attempt(self, items: list[Item[P]]) -> BaseException | None:
        try:
            self._write(items)
        except Exception as exc:
            cause = exc.cause if isinstance(exc, PartlyWritten) else exc
            if self._failing_since is None:
                log.warning("%s write failed (%s); retrying with backoff", self._what, cause)
            if self._failing_since is None or (isinstance(exc, PartlyWritten) and exc.done):
                self._failing_since = time.monotonic()  # (some were written: it moves)
            self._last_error = cause
            return exc if items else None  # a failed heartbeat alone is not an error
        self._failing_since = None
        self._last_error = None
        self._delay = self._backoff_s
        self._last_write = time.monotonic()
        return None

    def _notify_room(self) -> None:
        with self._room:
            self._room.notify_all()


def _reason(error: BaseException | None) -> str:
    """The first line of what went wrong, without SQLAlchemy's statement and parameters."""
    orig = getattr(error, "orig", None)
    text = str(orig if orig is not None else error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _chained(error: StoreError, cause: BaseException | None) -> StoreError:
    error.__cause__ = cause
    return error


# -- the end of the process -------------------------------------------------------------------
_live: weakref.WeakSet[MetricWriter[Any]] = weakref.WeakSet()
_installed = False


def _install_exit_handlers() -> None:
    """Once per process: flush every writer at exit, and make SIGTERM unwind like Ctrl-C."""
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(close_all)
    unwind_on_sigterm()


def close_all() -> None:
    """Flush and close every live writer; at exit, so no buffered metric is left behind."""
    for writer in list(_live):
        try:
            writer.close()
        except StoreError as exc:
            print(f"lab: {mask(str(exc))}", file=sys.stderr)
