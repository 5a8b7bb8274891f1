"""The metric write path: a bounded buffer on the training thread, a writer thread behind it.

`put` is O(1) and never touches the disk: it appends one step's metric dict to a bounded
deque (an append is atomic, so the common case takes no lock). The writer thread wakes
every `interval_s` (or at once for a flush or a full buffer) and writes whatever piled up
in one transaction.

Nothing is ever dropped. When the buffer is full, `put` waits (back-pressure). A write that
fails is retried with a growing backoff (capped at `max_backoff_s`); when a round of
`retries` retries fails too, the batch goes back to the front of the buffer, in order, and
later rounds keep retrying it. `flush` returns once everything put before it is committed,
and raises `StoreError` when the round that should have written it failed: the rows are
kept and retried, so a later `flush` succeeds once the store takes them. `close` makes one
last round of attempts and raises if that fails too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from lab.errors import StoreError

log = logging.getLogger("lab.store")

#: One step of one run: (run_id, step, {key: value}, wall_time).
MetricItem = tuple[int, int, dict[str, float], float]

_STOP = object()


class _Flush:
    """A flush marker in the buffer: set once every item before it is committed, or once
    the round that should have written them failed (then `error` says why)."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None


def _kept_error(error: BaseException) -> StoreError:
    return StoreError(f"metrics could not be written: {error}; they are kept and retried")


class MetricWriter:
    """Buffers metric items and writes them in batches from a background thread."""

    def __init__(
        self,
        write: Callable[[list[MetricItem]], None],
        *,
        max_pending: int = 8192,
        max_batch: int = 50_000,
        interval_s: float = 0.25,
        retries: int = 5,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
    ) -> None:
        self._write = write
        self._interval_s = interval_s
        self._buffer: deque[Any] = deque()
        self._max_pending = max_pending
        self._room = threading.Condition()
        self._max_batch = max_batch
        self._retries = retries
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._delay = backoff_s  # the next backoff; grows across failed rounds, reset on success
        self._failing = False  # the last attempt failed (read and written by the writer only)
        self._error: BaseException | None = None  # the failure of the last round, if it failed
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="lab-metric-writer", daemon=True)
        self._thread.start()

    def put(self, run_id: int, step: int, metrics: dict[str, float], wall_time: float) -> None:
        """Buffer one step's metrics; waits only while the buffer is full."""
        if len(self._buffer) >= self._max_pending:
            self._wait_for_room()
        self._buffer.append((run_id, step, metrics, wall_time))

    def _wait_for_room(self) -> None:
        with self._room:
            while len(self._buffer) >= self._max_pending:
                if not self._thread.is_alive():
                    self._raise_error()
                    raise StoreError("the metric writer has stopped; this store is closed")
                self._wake.set()
                self._room.wait(0.05)

    def flush(self) -> None:
        """Return once every item put so far is committed; raise `StoreError` if the round
        of attempts that should have written them failed (they are kept and retried)."""
        if not self._thread.is_alive():
            self._raise_error()
            return
        marker = _Flush()
        self._buffer.append(marker)
        self._wake.set()
        marker.done.wait()
        if marker.error is not None:
            raise _kept_error(marker.error) from marker.error

    def close(self) -> None:
        """Flush, then stop the writer thread; raise `StoreError` if that last round of
        attempts failed (the rows it could not write stay unwritten)."""
        if self._thread.is_alive():
            self._buffer.append(_STOP)
            self._wake.set()
            self._thread.join()
        self._raise_error()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            unwritten = sum(1 for item in self._buffer if isinstance(item, tuple))
            raise StoreError(
                f"metrics could not be written: {error}; the writer stopped with "
                f"{unwritten} steps unwritten"
            ) from error

    def _drain(self) -> None:
        """Wake every `interval_s`, or at once on a flush, a stop or a full buffer, and write
        what piled up in one transaction. `put` never wakes this thread by itself: a wake-up
        per step would hand the GIL back and forth with the training thread every step."""
        while True:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            items: list[MetricItem] = []
            markers: list[_Flush] = []
            stop = False
            while len(items) < self._max_batch:
                try:
                    item = self._buffer.popleft()
                except IndexError:
                    break
                if item is _STOP:
                    stop = True
                    break
                if isinstance(item, _Flush):
                    markers.append(item)
                    break  # everything put before this flush is in `items`
                items.append(item)
            error = self._write_with_retries(items) if items else None
            if error is not None:
                # Keep the batch: back at the front, in order, ahead of anything put since.
                # A popped flush marker is released with the error (its flush raises), so
                # no flush succeeds before the items put ahead of it are committed.
                self._buffer.extendleft(reversed(items))
                for marker in markers:
                    marker.error = error
            self._error = error
            with self._room:
                self._room.notify_all()
            for marker in markers:
                marker.done.set()
            if stop:
                return
            if len(items) >= self._max_batch or self._buffer:
                self._wake.set()  # more is waiting: go round again without sleeping

    def _write_with_retries(self, items: list[MetricItem]) -> BaseException | None:
        """One round: a try and up to `retries` retries; returns the last error, or None
        once the items are committed. A round that follows a failure backs off first."""
        error: BaseException | None = None
        for attempt in range(self._retries + 1):
            if attempt or self._failing:
                time.sleep(self._delay)
                self._delay = min(self._delay * 2, self._max_backoff_s)
            try:
                self._write(items)
            except Exception as exc:
                error = exc
                self._failing = True
                log.warning("metric write failed (%s); retrying in %.2fs", exc, self._delay)
                continue
            self._failing = False
            self._delay = self._backoff_s
            return None
        log.error("could not write %d metric steps (%s); keeping them to retry", len(items), error)
        return error
