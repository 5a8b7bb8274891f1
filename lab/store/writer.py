"""The metric write path: a bounded buffer on the training thread, a writer thread behind it.

`put` is O(1) and never touches the disk: it appends one step's metric dict to a bounded
queue. The writer thread drains whatever has piled up and writes it in one transaction.
When the queue is full, `put` waits (back-pressure); nothing is ever dropped. `flush`
returns once everything put before it is committed, and raises a writer error that
persisted through the retries.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
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
        max_batch: int = 4096,
        retries: int = 5,
        backoff_s: float = 0.05,
    ) -> None:
        self._write = write
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending)
        self._max_batch = max_batch
        self._retries = retries
        self._backoff_s = backoff_s
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="lab-metric-writer", daemon=True)
        self._thread.start()

    def put(self, run_id: int, step: int, metrics: dict[str, float], wall_time: float) -> None:
        """Queue one step's metrics; waits only while the buffer is full."""
        self._queue.put((run_id, step, metrics, wall_time))

    def flush(self) -> None:
        """Return once every item put so far is committed; raise if the writer gave up."""
        if not self._thread.is_alive():
            self._raise_error()
            return
        done = threading.Event()
        self._queue.put(done)
        done.wait()
        self._raise_error()

    def close(self) -> None:
        """Flush, then stop the writer thread."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self._raise_error()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise StoreError(f"metrics could not be written: {error}") from error

    def _drain(self) -> None:
        while True:
            first = self._queue.get()
            items: list[MetricItem] = []
            waiters: list[threading.Event] = []
            stop = False
            pending = [first]
            while True:
                for item in pending:
                    if item is _STOP:
                        stop = True
                    elif isinstance(item, threading.Event):
                        waiters.append(item)
                    else:
                        items.append(item)
                if stop or waiters or len(items) >= self._max_batch:
                    break
                try:
                    pending = [self._queue.get_nowait()]
                except queue.Empty:
                    break
            if items:
                self._write_with_retries(items)
            for waiter in waiters:
                waiter.set()
            if stop:
                return

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
