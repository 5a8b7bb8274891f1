"""`Store`: every write and read of the SQL store goes through it.

It opens the store at a URL (migrating it to this version's schema) and composes the parts
that do the work, one module each: `lab.store.writes` (every write: metrics through the
buffered `lab.store.writer`, every other write one short transaction), `lab.store.reads`
(plain dicts: the ORM rows never leave this package), `lab.store.listing` (what ``lab ls``
and ``lab show`` print, read alike by the `lab.store.reader.Reader` that commands which
only read open), `lab.store.crashes` (runs whose process is gone), `lab.store.summaries`
(per-key summaries kept with the metrics) and `lab.store.blocks` (per-block envelopes kept
with the metrics, for cutting series); histograms and images are queued by
`lab.store.media`.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from lab._names import TAG_LIMIT, check_tags
from lab.errors import ConfigError
from lab.store._values import _now
from lab.store.crashes import _DRIVING, HEARTBEAT_S, STALE_AFTER_S, Crashes, let_go
from lab.store.engine import (
    check_reachable,
    connect,
    make_engine,
    mark_older,
    resolve_url,
)
from lab.store.listing import Listing
from lab.store.media import MediaRows
from lab.store.metric_rows import MetricRows
from lab.store.migrations import ensure_schema, head_revision, readable_revision
from lab.store.reads import Reads
from lab.store.schema import SqlIngestBatch
from lab.store.sql import Sql
from lab.store.statements import upsert
from lab.store.writer import MetricWriter
from lab.store.writer_process import WriterProcess
from lab.store.writes import _PREDICTION_INSERT, _RUN_HAS_ROWS, Writes

#: The writer thread's pause between batches when it writes them itself, and when it hands
#: them to the writer process (see `Store._write_interval`).
INTERVAL_S = 0.25
PROCESS_INTERVAL_S = 0.05

__all__ = ["HEARTBEAT_S", "STALE_AFTER_S", "TAG_LIMIT", "WRITERS", "Store", "check_tags"]

#: Where metric batches are written: the thread, then the writer process (the default),
#: a thread of the store's own, or the writer process this process shares among its stores.
WRITERS = ("auto", "thread", "process")


class Store(Writes, Reads, Listing, Crashes):
    """A `lab` store at a URL: opened, migrated to this version's schema, ready to write.

    >>> store = Store("sqlite:///:memory:")
    >>> store.list_experiments()
    []
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        migrate: bool = True,
        readonly: bool = False,
        create: bool = True,
        give_up_s: float | None = None,
        heartbeat_s: float = HEARTBEAT_S,
        stale_after_s: float = STALE_AFTER_S,
        writer: str | None = None,
    ) -> None:
        """`give_up_s`: how long a flush waits out a failing store before it raises (default
        ``LAB_STORE_RETRY_S``, else 120 s). `heartbeat_s` and `stale_after_s`: how often a
        running run says it is alive, and after how long without a word it counts as crashed.

        `readonly` opens the store as commands that only read do (`lab ls`, `lab show`,
        `lab.inspect`): a missing store is refused rather than created, an empty or
        foreign database is refused rather than given lab's tables, an older schema is
        read as it is (or refused with the upgrade command) rather than migrated, and
        nothing is ever written: runs whose process is gone are shown as crashed by the
        reads, not marked so in the store.

        `create=False` is for commands that change a store without recording into it
        (`lab tag`): a SQLite file that does not exist is refused (`NoStore`) rather than
        created, so a mistyped ``--store`` leaves nothing behind.

        `writer` (else ``LAB_STORE_WRITER``, else ``auto``): where metric batches are
        encoded and written. ``process``: by the writer process this process shares among
        its stores (`lab.store.writer_process`, started with the first of them), so the
        training thread never shares its interpreter's lock with the writes. ``thread``:
        by a writer thread in this process. ``auto``: by the thread until the writer
        process is ready, which the store starts once it has written
        `lab.store.writer_process.AUTO_AFTER_POINTS` points itself, so short runs never
        pay for starting one. A store no other process can open (SQLite in memory) and a
        read-only one use the thread; `writer_mode` says which was taken.
        """
        self.url = resolve_url(url)
        self.readonly = readonly
        #: The schema revision read when opened read-only (an older one is read as it is).
        self.revision: str | None = None
        self.engine: Engine = make_engine(self.url, readonly=readonly, create=create)
        try:
            check_reachable(self.engine)
            if readonly and self.engine.url.database not in (None, "", ":memory:"):
                migrate = False
                with self._reading() as sql:
                    self.revision = readable_revision(sql)
                if self.revision != head_revision():
                    mark_older(self.engine, str(self.revision), head_revision())
            elif migrate:  # (an in-memory store is private to this process: given a schema)
                ensure_schema(self.engine)
        except BaseException:
            self.engine.dispose()
            raise
        self.dialect = self.engine.dialect.name
        self.give_up_s = give_up_s
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self._writer: MetricWriter | None = None
        self._writer_lock = threading.Lock()
        self._active: set[int] = set()  # runs started here and not finished: heartbeats
        self._driving: set[int] = set()  # experiments begun here and not finished: heartbeats
        self._driven_at = -math.inf  # when their heartbeat was last handed to the writer
        self._good_keys: set[str] = set()  # metric keys checked already
        #: Where metric batches are written, with their summaries, blocks and heartbeats.
        self.metric_rows = MetricRows(
            self.engine, active=self._active, driving_due=self._driving_due
        )
        self._replaced: Any = None  # a write function put in place of the metric rows'
        #: ``process``, ``thread`` or ``auto`` (the thread, then the process): where this
        #: store's metric batches are written.
        self.writer_mode = "thread"
        self._process: WriterProcess | None = None
        chosen = _writer_choice(writer)
        shared = None if chosen == "thread" or readonly or not create else _reopenable(self.url)
        if shared is not None:
            self.writer_mode = chosen
            self._process = WriterProcess(
                shared,
                lambda: tuple(self._active),
                fallback=self.metric_rows.write,
                auto=chosen == "auto",
                driving=self._driving_due,
            )
        #: Histogram and image rows (`lab.store.media`): queued like metrics, flushed with them.
        self.media = MediaRows(self.engine, give_up_s=give_up_s)
        mark = "%s" if self.dialect == "postgresql" else "?"
        self._prediction_insert = _PREDICTION_INSERT.format(m=mark)
        self._run_has_rows = _RUN_HAS_ROWS.format(m=mark)
        if migrate:
            self.mark_crashed()

    def __repr__(self) -> str:
        return f"Store({self.engine.url.render_as_string(hide_password=True)!r})"

    @contextmanager
    def _reading(self) -> Iterator[Sql]:
        """A connection to read through (`lab.store.listing`, the crash judgement)."""
        with connect(self.engine) as conn:
            yield Sql(conn)

    def _insert(self, table: Any) -> Any:
        module = postgresql if self.dialect == "postgresql" else sqlite
        return module.insert(table)

    def _upsert(self, conn: Connection, model: type, values: dict, keys: list[str], pk: str) -> int:
        """Insert `values`, or update the row with the same `keys`; returns its primary key."""
        key = upsert(model.__table__, tuple(values), tuple(keys), pk)(conn, values)  # type: ignore[attr-defined]
        assert key is not None  # (no guard: the row is inserted or updated)
        return int(key)

    def hand_over(self, run_id: int) -> None:
        """Leave run `run_id`, recorded here for another process (a client of ``lab serve``),
        to that process: this one neither holds it nor keeps its heartbeat, so a client
        that dies leaves a run that goes stale and is marked crashed, as a local one would."""
        self._active.discard(run_id)
        let_go(self.url, run_id)

    def record_batch(self, conn: Connection, client_id: str, seq: int, rows: int) -> bool:
        """Record that batch `seq` of client `client_id` (`rows` rows) is written, in the
        transaction that writes it; False when it was recorded before (a batch sent again
        is written once)."""
        stmt = (
            self._insert(SqlIngestBatch)
            .values(client_id=client_id, seq=seq, rows=rows, received_at=_now())
            .on_conflict_do_nothing(index_elements=["client_id", "seq"])
            .returning(SqlIngestBatch.seq)
        )
        return conn.execute(stmt).first() is not None

    @property
    def writer(self) -> MetricWriter:
        """The background metric writer, started on first use."""
        if self._writer is None:
            with self._writer_lock:
                if self._writer is None:
                    write = self._batch_write()
                    self._writer = MetricWriter(
                        write,
                        interval_s=self._write_interval,
                        on_start=write.warm if isinstance(write, WriterProcess) else None,
                        give_up_s=self.give_up_s,
                        idle_s=self.heartbeat_s,
                    )
        return self._writer

    def _write_interval(self) -> float:
        """The writer thread's pause between batches: short while the writer process takes
        them (the thread only hands them over, so the batch left to write when a fit ends
        is small), longer while the thread writes them itself (each batch costs it a
        transaction under the GIL)."""
        process = self._process
        return PROCESS_INTERVAL_S if process is not None and process.joined else INTERVAL_S

    @property
    def _write_metrics(self) -> Any:
        """The function the writer thread writes a batch with: the metric rows' `write`, or
        what a bench or a test put in its place (before the writer starts) to wrap it."""
        return self.metric_rows.write if self._replaced is None else self._replaced

    @_write_metrics.setter
    def _write_metrics(self, write: Any) -> None:
        # The writer process could not run a replacement: this store's writer thread does.
        self._replaced = write
        self._close_process()

    def _batch_write(self) -> Any:
        """The writer process when this store has one, else its writer thread's write."""
        if self._process is not None:
            return self._process
        return self._write_metrics

    def _close_process(self) -> None:
        process, self._process = self._process, None
        self.writer_mode = "thread"
        if process is not None:
            process.close()

    def flush(self) -> None:
        """Make every metric logged so far durable; raises `StoreError` when they could not
        be written yet (they are kept, and retried in the background)."""
        if self._writer is not None:
            self._writer.flush()
        self.media.flush()

    def close(self) -> None:
        """Flush and stop the writer, and release the connections. An experiment begun here
        and not finished is no longer driven by this process: its heartbeat stops, and
        `mark_crashed` judges it by its runs and its driver from now on."""
        for exp_id in self._driving:
            _DRIVING.discard((self.url, exp_id))
        try:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            self.media.close()
        finally:
            try:
                process, self._process = self._process, None
                if process is not None:
                    process.close()  # after the last flush: the writer process lets go of it
            finally:
                self.engine.dispose()


def _writer_choice(writer: str | None) -> str:
    chosen = writer or os.environ.get("LAB_STORE_WRITER") or "auto"
    if chosen not in WRITERS:
        raise ConfigError(
            f"unknown metric writer {chosen!r}; use one of {', '.join(WRITERS)} "
            "(the writer argument or LAB_STORE_WRITER)"
        )
    return chosen


def _reopenable(url: Any) -> str | None:
    """The URL by which another process opens the same store (a SQLite file by absolute
    path, so the writer process finds it whatever its working folder), or None when no
    other process can (SQLite in memory)."""
    parsed = url.parsed
    if url.backend != "sqlite":
        return str(url)
    database = parsed.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    if parsed.query.get("mode") == "memory":
        return None
    path = str(Path(database).expanduser().resolve())
    return parsed.set(database=path).render_as_string(hide_password=False)
