"""`Reader`: a store opened only to read it, without SQLAlchemy: what ``lab ls``, ``lab show``
and ``lab token list`` open.

It opens the database with its driver alone (`lab.store.engine.reader_connection`: a SQLite
file read-only, or a PostgreSQL session whose transactions are read-only), refuses what a
read-only `Store` refuses (no store, someone else's tables, a newer schema:
`lab.store.migrations.readable_revision`), and reads what a `Store` reads with the very same
code: `lab.store.listing` for the experiments and `lab.store.crashes` for the runs and
experiments whose process is gone, shown as crashed and never written. Importing SQLAlchemy
costs about 0.2 s of CPU, more than such a command takes without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lab.store.crashes import STALE_AFTER_S, Crashed, CrashReads
from lab.store.engine import older, reader_connection
from lab.store.listing import Listing
from lab.store.migrations import head_revision, readable_revision
from lab.store.records import EliminationRecord, ExperimentRecord, ExperimentSummary, TrialRecord
from lab.store.sql import Sql
from lab.store.urls import resolve_url

_TOKENS = "SELECT name, scope, experiment, created_at, revoked_at FROM tokens ORDER BY token_id"


class Reader:
    """The store at `url` (else ``LAB_STORE_URL``, else ``sqlite:///lab.db``), opened to read.

    >>> reader = Reader("sqlite:///lab.db")  # doctest: +SKIP
    >>> reader.list_experiments()            # as Store(url, readonly=True) lists them
    >>> reader.close()

    `empty_ok`: a database without lab's schema yet is read as empty (``lab token list``)
    rather than refused. `stale_after_s`: after how long without a heartbeat a running row
    of another host counts as crashed, as for `Store`.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        empty_ok: bool = False,
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        self.url = resolve_url(url)
        self._conn = reader_connection(self.url)
        self._older: str | None = None
        self._crash_reads = CrashReads(
            self.url, self._reading, readonly=True, stale_after_s=stale_after_s
        )
        self._listing = Listing(self._reading, self._crash_reads.crashed_now)
        try:
            with self._reading() as sql:
                #: The schema revision (None: an empty database, with `empty_ok`).
                self.revision = readable_revision(sql, empty_ok=empty_ok)
            head = head_revision()
            if self.revision is not None and self.revision != head:
                self._older = older(self.revision, head)
        except BaseException:
            self._conn.close()
            raise

    def __repr__(self) -> str:
        return f"Reader({self.url.shown!r})"

    @contextmanager
    def _reading(self) -> Iterator[Sql]:
        yield Sql(self._conn, where=self.url.shown, older=self._older)

    def list_experiments(self) -> list[ExperimentSummary]:
        """Every experiment with its run counts, newest first (`Listing.list_experiments`)."""
        return self._listing.list_experiments()

    def get_experiment(self, name: str) -> ExperimentRecord:
        """An experiment with its arms and runs (`Listing.get_experiment`)."""
        return self._listing.get_experiment(name)

    def trials(self, experiment: str) -> list[TrialRecord]:
        """A sweep's sampled arms by number (`Listing.trials`)."""
        return self._listing.trials(experiment)

    def eliminations(self, experiment: str) -> list[EliminationRecord]:
        """The arms a race dropped, by round (`Listing.eliminations`)."""
        return self._listing.eliminations(experiment)

    def crashed_now(self) -> Crashed:
        """The runs and experiments shown as crashed, never marked so
        (`CrashReads.crashed_now`)."""
        return self._crash_reads.crashed_now()

    def list_tokens(self) -> list[dict[str, Any]]:
        """Every `lab serve` token's name, scope, the experiment it is limited to (None:
        all), and when it was made and revoked (None: live), oldest first; none in a
        database without lab's schema yet. Never the hash: what an operator needs to
        decide what to revoke, nothing that helps a guess."""
        if self.revision is None:
            return []
        with self._reading() as sql:
            rows = sql.rows(_TOKENS)
            when = sql.time
        return [
            {"name": name, "scope": scope, "experiment": experiment,
             "created_at": when(created), "revoked_at": when(revoked)}
            for name, scope, experiment, created, revoked in rows
        ]  # fmt: skip

    def close(self) -> None:
        """Close the connection."""
        self._conn.close()
