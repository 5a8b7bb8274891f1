"""The metric write path: a bounded buffer on the training thread, a writer thread behind it.

`put` is O(1) and never touches the disk: it appends one step's metric dict to a bounded
deque (an append is atomic, so the common case takes no lock). The writer thread wakes
every `interval_s` (or at once for a flush or a full buffer) and writes whatever piled up
in one transaction. When the buffer is full, `put` waits (back-pressure); nothing is ever
dropped. `flush`
returns once everything put before it is committed, and raises a writer error that
persisted through the retries.
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
    ) -> None:
        self._write = write
        self._interval_s = interval_s
        self._buffer: deque[Any] = deque()
        self._max_pending = max_pending
        self._room = threading.Condition()
        self._max_batch = max_batch
        self._retries = retries
        self._backoff_s = backoff_s
        self._error: BaseException | None = None
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
        """Return once every item put so far is committed; raise if the writer gave up."""
        if not self._thread.is_alive():
            self._raise_error()
            return
        done = threading.Event()
        self._buffer.append(done)
        self._wake.set()
        done.wait()
        self._raise_error()

    def close(self) -> None:
        """Flush, then stop the writer thread."""
        if self._thread.is_alive():
            self._buffer.append(_STOP)
            self._wake.set()
            self._thread.join()
        self._raise_error()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise StoreError(f"metrics could not be written: {error}") from error

    def _drain(self) -> None:
        """Wake every `interval_s`, or at once on a flush, a stop or a full buffer, and write
        what piled up in one transaction. `put` never wakes this thread by itself: a wake-up
        per step would hand the GIL back and forth with the training thread every step."""
        while True:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            items: list[MetricItem] = []
            waiters: list[threading.Event] = []
            stop = False
            while len(items) < self._max_batch:
                try:
                    item = self._buffer.popleft()
                except IndexError:
                    break
                if item is _STOP:
                    stop = True
                    break
                if isinstance(item, threading.Event):
                    waiters.append(item)
                    break  # everything put before this flush is in `items`
                items.append(item)
            with self._room:
                self._room.notify_all()
            if items:
                self._write_with_retries(items)
            for waiter in waiters:
                waiter.set()
            if stop:
                return
            if len(items) >= self._max_batch or self._buffer:
                self._wake.set()  # more is waiting: go round again without sleeping

    def _write_with_retries(self, items: list[MetricItem]) -> None:
        delay = self._backoff_s
        for attempt in range(self._retries + 1):
            try:
                self._write(items)
                return
            except Exception as exc:
                if attempt == self._retries:
                    log.error("giving up on %d metric rows: %s", len(items), exc)
                    self._error = exc
                    return
                log.warning("metric write failed (%s); retrying in %.2fs", exc, delay)
                time.sleep(delay)
                delay *= 2
