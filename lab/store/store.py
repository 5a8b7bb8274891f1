"""`Store`: every write and read of the SQL store goes through it.

It opens the store at a URL (migrating it to this version's schema), owns the background
metric writer, and holds the parts that do the work, each a plain object built with what it
needs, one module each: the writes by what they write (`lab.store.experiment_writes`,
`lab.store.run_writes`, `lab.store.record_writes`, `lab.store.tag_writes`: each write one
short transaction, but metrics, queued to the buffered `lab.store.writer`),
`lab.store.reads` (typed records, `lab.store.records`: no row object leaves this
package), `lab.store.listing` (what ``lab ls`` and ``lab show`` print, read alike by the
`lab.store.reader.Reader` that commands which only read open), `lab.store.crashes` (runs
whose process is gone), and `lab.store.metric_rows` (metric batches with their summaries,
blocks and heartbeats); histograms and images are queued by `lab.store.media`. Its public
methods are those of `lab.store.api.StoreAPI` and a few of its own, each handed to the part
that does it.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Connection, Engine

from lab._names import TAG_LIMIT, check_tags
from lab.errors import ConfigError
from lab.store._values import _now
from lab.store.crashes import (
    _DRIVING,
    HEARTBEAT_S,
    STALE_AFTER_S,
    Crashed,
    Crashes,
    CrashReads,
    let_go,
)
from lab.store.engine import (
    check_reachable,
    connect,
    make_engine,
    mark_older,
    resolve_url,
)
from lab.store.experiment_writes import ExperimentWrites
from lab.store.listing import Listing
from lab.store.media import MediaRows
from lab.store.metric_rows import Heartbeats, MetricRows
from lab.store.migrations import ensure_schema, head_revision, readable_revision
from lab.store.reads import Reads, experiment_id
from lab.store.record_writes import RecordWrites
from lab.store.run_writes import RunWrites
from lab.store.schema import SqlIngestBatch
from lab.store.sql import Sql
from lab.store.statements import dialect_insert
from lab.store.sweep_rows import SweepRows
from lab.store.tag_writes import TagWrites
from lab.store.writer import MetricWriter
from lab.store.writer_process import WriterProcess

if TYPE_CHECKING:
    from lab.records import EvalResult, ManifestRow
    from lab.store.records import (
        Annotations,
        CurrentRun,
        Deleted,
        ExperimentRecord,
        ExperimentSummary,
        FinishedRun,
        PreviousRun,
    )

#: The writer thread's pause between batches when it writes them itself, and when it hands
#: them to the writer process (see `Store._write_interval`).
INTERVAL_S = 0.25
PROCESS_INTERVAL_S = 0.05

__all__ = ["HEARTBEAT_S", "STALE_AFTER_S", "TAG_LIMIT", "WRITERS", "Store", "check_tags"]

#: Where metric batches are written: the thread, then the writer process (the default),
#: a thread of the store's own, or the writer process this process shares among its stores.
WRITERS = ("auto", "thread", "process")


def _handed(part: str, method: Callable[..., Any]) -> Any:
    """A `Store` method that hands each call to its part named `part`, with the signature
    and docstring of the part's own `method`."""

    @functools.wraps(method)
    def handed(self: Store, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(self, part), method.__name__)(*args, **kwargs)

    return handed


class Store:
    """A `lab` store at a URL: opened, migrated to this version's schema, ready to write.

    `give_up_s`: how long a flush waits out a failing store before it raises (default
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
        """Open the store at `url` (else ``LAB_STORE_URL``, else the default file); the
        arguments are the class's."""
        self.url = resolve_url(url)
        self.readonly = readonly
        #: The schema revision read when opened read-only (an older one is read as it is).
        self.revision: str | None = None
        self.engine: Engine = make_engine(self.url, readonly=readonly, create=create)
        migrate = self._open_schema(readonly=readonly, migrate=migrate)
        self.dialect = self.engine.dialect.name
        self.give_up_s = give_up_s
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self._writer: MetricWriter[dict[str, float]] | None = None
        self._writer_lock = threading.Lock()
        #: The runs and experiments this process keeps alive: their heartbeats.
        self._heartbeats = Heartbeats(heartbeat_s)
        #: Where metric batches are written, with their summaries, blocks and heartbeats.
        self.metric_rows = MetricRows(
            self.engine,
            active=self._heartbeats.runs,
            driving_due=self._heartbeats.driving_due,
        )
        self._replaced: Any = None  # a write function put in place of the metric rows'
        #: ``process``, ``thread`` or ``auto`` (the thread, then the process): where this
        #: store's metric batches are written.
        self.writer_mode = "thread"
        self._process: WriterProcess | None = None
        if not (readonly or not create):
            self._share_writer_process(_writer_choice(writer))
        #: Histogram and image rows (`lab.store.media`): queued like metrics, flushed with them.
        self.media = MediaRows(self.engine, give_up_s=give_up_s)
        self._build_parts()
        if migrate:
            self.mark_crashed()

    def _build_parts(self) -> None:
        """The parts that do the work, each given exactly what it uses."""
        engine, url, dialect = self.engine, self.url, self.dialect
        beats, writer = self._heartbeats, self._started_writer
        self._crash_reads = CrashReads(
            url, self._reading, readonly=self.readonly, stale_after_s=self.stale_after_s
        )
        self._crashes = Crashes(engine, self._crash_reads)
        self._listing = Listing(self._reading, self._crash_reads.crashed_now)
        self._reads = Reads(engine, self.flush)
        self._experiments = ExperimentWrites(
            engine, url, dialect, driving=beats.experiments, judge=self._crash_reads,
            writer=writer,
        )  # fmt: skip
        self._runs = RunWrites(
            engine, url, dialect, self.metric_rows, active=beats.runs, judge=self._crash_reads,
            writer=writer, flush=self.flush,
        )  # fmt: skip
        self._records = RecordWrites(engine, dialect, self.metric_rows, writer)
        self._tags = TagWrites(engine, dialect)
        self._sweeps = SweepRows(engine, dialect)

    def _open_schema(self, *, readonly: bool, migrate: bool) -> bool:
        """Check the store answers and its schema: read as it is when read-only (an older
        one marked so), else migrated to this version's. Returns whether it was migrated
        (a read-only file store never is); the engine is closed on any failure."""
        try:
            check_reachable(self.engine)
            if readonly and self.engine.url.database not in (None, "", ":memory:"):
                with self._reading() as sql:
                    self.revision = readable_revision(sql)
                if self.revision != head_revision():
                    mark_older(self.engine, str(self.revision), head_revision())
                return False
            if migrate:  # (an in-memory store is private to this process: given a schema)
                ensure_schema(self.engine)
            return migrate
        except BaseException:
            self.engine.dispose()
            raise

    def _share_writer_process(self, chosen: str) -> None:
        """Write metric batches through the writer process this process shares among its
        stores, where `chosen` is not ``thread`` and another process can open the store."""
        shared = None if chosen == "thread" else _reopenable(self.url)
        if shared is not None:
            runs = self._heartbeats.runs
            self.writer_mode = chosen
            self._process = WriterProcess(
                shared,
                lambda: tuple(runs),
                fallback=self.metric_rows.write,
                auto=chosen == "auto",
                driving=self._heartbeats.driving_due,
            )

    def __repr__(self) -> str:
        return f"Store({self.engine.url.render_as_string(hide_password=True)!r})"

    @contextmanager
    def _reading(self) -> Iterator[Sql]:
        """A connection to read through (`lab.store.listing`, the crash judgement)."""
        with connect(self.engine) as conn:
            yield Sql(conn)

    # -- an experiment and its parts: `lab.store.experiment_writes` ---------------------------
    def begin_experiment(
        self,
        name: str,
        *,
        config: dict[str, Any],
        seed: int,
        repeats: int,
        tags: Sequence[str] = (),
        notes: str | None = None,
        owner: dict[str, Any] | None = None,
        created_by: str | None = None,
    ) -> int:
        """Create the experiment, or reopen the one of that name, as running under its
        driver; its id (`ExperimentWrites.begin_experiment`)."""
        return self._experiments.begin_experiment(
            name, config=config, seed=seed, repeats=repeats, tags=tags, notes=notes,
            owner=owner, created_by=created_by,
        )  # fmt: skip

    def add_arm(
        self, experiment_id: int, name: str, *, overrides: dict[str, Any], config: dict[str, Any]
    ) -> int:
        """Record an arm of an experiment; its id."""
        return self._experiments.add_arm(experiment_id, name, overrides=overrides, config=config)

    def add_group(
        self, experiment_id: int, name: str, *, kind: str = "repeats", arm_id: int | None = None
    ) -> int:
        """Record a group of runs; its id."""
        return self._experiments.add_group(experiment_id, name, kind=kind, arm_id=arm_id)

    def finish_experiment(
        self,
        experiment_id: int,
        *,
        status: str,
        callback_errors: list[dict[str, Any]] | None = None,
    ) -> None:
        """Record an experiment's final status; this process drives it no more
        (`ExperimentWrites.finish_experiment`)."""
        self._experiments.finish_experiment(
            experiment_id, status=status, callback_errors=callback_errors
        )

    def delete_experiment(self, name: str) -> Deleted:
        """Delete an experiment and all its rows, refused while a live process trains one of
        its runs; the run folders it leaves (`ExperimentWrites.delete_experiment`)."""
        return self._experiments.delete_experiment(name)

    def rename_experiment(self, old: str, new: str) -> None:
        """Rename an experiment; refuses a name in use (`ExperimentWrites.rename_experiment`)."""
        self._experiments.rename_experiment(old, new)

    # -- a run: `lab.store.run_writes` -------------------------------------------------------
    def start_run(
        self,
        experiment_id: int,
        group_id: int,
        *,
        run_key: str,
        arm_id: int | None,
        repeat: int,
        stage: int,
        seed: int,
        config: dict[str, Any],
        output_dir: str | None,
        parent_run_id: int | None = None,
        provenance: dict[str, Any] | None = None,
        config_hash: str | None = None,
        claimed: int | None = None,
        owner: dict[str, Any] | None = None,
    ) -> int:
        """Claim a run and record it as `running`, atomically; its id
        (`RunWrites.start_run`)."""
        return self._runs.start_run(
            experiment_id, group_id, run_key=run_key, arm_id=arm_id, repeat=repeat,
            stage=stage, seed=seed, config=config, output_dir=output_dir,
            parent_run_id=parent_run_id, provenance=provenance, config_hash=config_hash,
            claimed=claimed, owner=owner,
        )  # fmt: skip

    def claim_run(
        self,
        experiment_id: int,
        group_id: int,
        *,
        run_key: str,
        arm_id: int | None,
        repeat: int,
        stage: int,
        seed: int,
        config: dict[str, Any],
        output_dir: str | None,
        parent_run_id: int | None = None,
        config_hash: str | None = None,
        owner: dict[str, Any] | None = None,
    ) -> tuple[int | None, FinishedRun | None]:
        """Claim a run before it starts: its id when won, else the record of the process
        that finished it (`RunWrites.claim_run`)."""
        return self._runs.claim_run(
            experiment_id, group_id, run_key=run_key, arm_id=arm_id, repeat=repeat,
            stage=stage, seed=seed, config=config, output_dir=output_dir,
            parent_run_id=parent_run_id, config_hash=config_hash, owner=owner,
        )  # fmt: skip

    def release_run(self, run_id: int, error: str, owner: dict[str, Any] | None = None) -> None:
        """Record a run claimed and never started as `failed` (`RunWrites.release_run`)."""
        self._runs.release_run(run_id, error, owner)

    def supersede_run(self, run_id: int, run_key: str, output_dir: str | None) -> None:
        """Set a run aside under a new key and folder (`RunWrites.supersede_run`)."""
        self._runs.supersede_run(run_id, run_key, output_dir)

    def truncate_run(self, run_id: int, after_step: int | None = None) -> None:
        """Drop a run's rows past `after_step`, all of them for None
        (`RunWrites.truncate_run`)."""
        self._runs.truncate_run(run_id, after_step)

    def finish_run(
        self,
        run_id: int,
        *,
        status: str,
        error: str | None = None,
        traceback: str | None = None,
        summary: dict[str, Any] | None = None,
        callback_errors: list[dict[str, Any]] | None = None,
        tags: Sequence[str] = (),
        notes: str | None = None,
        pruned: dict[str, Any] | None = None,
    ) -> None:
        """Record a run's final status, error, final metrics, tags and notes, and for a
        `pruned` run where it was pruned (`RunWrites.finish_run`)."""
        self._runs.finish_run(
            run_id, status=status, error=error, traceback=traceback, summary=summary,
            callback_errors=callback_errors, tags=tags, notes=notes, pruned=pruned,
        )  # fmt: skip

    def set_provenance(self, run_id: int, provenance: dict[str, Any]) -> None:
        """Record where a run's code and data came from, after its start."""
        self._runs.set_provenance(run_id, provenance)

    def set_callback_errors(self, run_id: int, callback_errors: list[dict[str, Any]]) -> None:
        """Replace the callback failures recorded on a run."""
        self._runs.set_callback_errors(run_id, callback_errors)

    def hand_over(self, run_id: int) -> None:
        """Leave run `run_id`, recorded here for another process (a client of ``lab serve``),
        to that process: this one neither holds it nor keeps its heartbeat, so a client
        that dies leaves a run that goes stale and is marked crashed, as a local one would."""
        self._heartbeats.runs.discard(run_id)
        let_go(self.url, run_id)

    # -- what a run logs: `lab.store.record_writes` -------------------------------------------
    def log_metrics(self, run_id: int, step: int, metrics: dict[str, Any], *,
                    floats: bool = False, keys: bool = False) -> None:  # fmt: skip
        """Queue one step's metrics (numbers only); waits only while the buffer is full
        (`RecordWrites.log_metrics`; `floats=True`: every value is exactly a float;
        `keys=True`: every key passed `check_key`)."""
        self._records.log_metrics(run_id, step, metrics, floats=floats, keys=keys)

    def write_metric_columns(
        self,
        run_ids: Sequence[int],
        steps: Sequence[int],
        keys: Sequence[str],
        values: Sequence[float],
        wall_times: Sequence[float],
    ) -> None:
        """Write checked metric rows given as columns, now, in one transaction (what
        ``lab serve`` does with a client's batch)."""
        self._records.write_metric_columns(run_ids, steps, keys, values, wall_times)

    def write_eval(
        self, run_id: int, result: EvalResult, predictions: list[dict[str, Any]] | None = None
    ) -> int:
        """Record an eval and its predictions, replacing an earlier one at the same step; its
        id (`RecordWrites.write_eval`)."""
        return self._records.write_eval(run_id, result, predictions)

    def write_checkpoint(self, run_id: int, row: ManifestRow) -> None:
        """Record one manifest row (a save or a removal)."""
        self._records.write_checkpoint(run_id, row)

    # -- a sweep: `lab.store.sweep_rows`, each method the part's own ------------------------
    add_trial = _handed("_sweeps", SweepRows.add_trial)
    tell_trial = _handed("_sweeps", SweepRows.tell_trial)
    supersede_trials = _handed("_sweeps", SweepRows.supersede_trials)
    add_elimination = _handed("_sweeps", SweepRows.add_elimination)
    trials = _handed("_listing", Listing.trials)
    eliminations = _handed("_listing", Listing.eliminations)
    metric_points = _handed("_sweeps", SweepRows.metric_points)

    def tag(
        self,
        experiment: str,
        run_key: str | None = None,
        *,
        add: Sequence[str] = (),
        remove: Sequence[str] = (),
        notes: str | None = None,
    ) -> Annotations:
        """Add and remove tags of an experiment or one of its runs, and set its notes; its
        tags and notes as they are now (`TagWrites.tag`)."""
        return self._tags.tag(experiment, run_key, add=add, remove=remove, notes=notes)

    def record_batch(self, conn: Connection, client_id: str, seq: int, rows: int) -> bool:
        """Record that batch `seq` of client `client_id` (`rows` rows) is written, in the
        transaction that writes it; False when it was recorded before (a batch sent again
        is written once)."""
        stmt = (
            dialect_insert(self.dialect, SqlIngestBatch)
            .values(client_id=client_id, seq=seq, rows=rows, received_at=_now())
            .on_conflict_do_nothing(index_elements=["client_id", "seq"])
            .returning(SqlIngestBatch.seq)
        )
        return conn.execute(stmt).first() is not None

    # -- reads: `lab.store.reads`, `lab.store.listing`, `lab.store.crashes` --------------------
    #: The id of an experiment by name, read in the caller's transaction (`NoExperiment`
    #: names the known ones).
    experiment_id = staticmethod(experiment_id)

    def find_run(self, experiment_id: int, run_key: str) -> int | None:
        """A run's id by its key, if it was recorded."""
        return self._reads.find_run(experiment_id, run_key)

    def previous_runs(self, experiment: str) -> dict[str, PreviousRun]:
        """An experiment's current runs by key, for a later attempt to judge
        (`Reads.previous_runs`)."""
        return self._reads.previous_runs(experiment)

    def current_runs(self, experiment: str) -> list[CurrentRun]:
        """An experiment's runs that are not superseded: id, key, status, folder, owner."""
        return self._reads.current_runs(experiment)

    def run_keys(self, experiment: str) -> list[str]:
        """Every run key of an experiment, superseded ones included."""
        return self._reads.run_keys(experiment)

    def last_step(self, run_id: int) -> int | None:
        """The newest step a run logged a metric at (queued ones flushed first), or None."""
        return self._reads.last_step(run_id)

    def metric_values(self, run_id: int, key: str) -> list[tuple[int, float]]:
        """One run's (step, value) pairs for `key`, in step order, NaN restored."""
        return self._reads.metric_values(run_id, key)

    def list_experiments(self) -> list[ExperimentSummary]:
        """Every experiment with its status and run counts, newest first
        (`Listing.list_experiments`)."""
        return self._listing.list_experiments()

    def get_experiment(self, name: str) -> ExperimentRecord:
        """An experiment with its arms and runs (`Listing.get_experiment`)."""
        return self._listing.get_experiment(name)

    def crashed_now(self) -> Crashed:
        """The runs and experiments a read-only store shows as crashed and never marks so;
        empty for a store that writes (`CrashReads.crashed_now`)."""
        return self._crash_reads.crashed_now()

    def mark_crashed(self) -> list[str]:
        """Mark `running` runs and experiments whose process is gone as `crashed`; the runs'
        keys (`Crashes.mark_crashed`)."""
        return self._crashes.mark_crashed()

    # -- the metric writer --------------------------------------------------------------------
    @property
    def writer(self) -> MetricWriter[dict[str, float]]:
        """The background metric writer, started on first use."""
        return self._started_writer()

    def _started_writer(self) -> MetricWriter[dict[str, float]]:
        """The background metric writer, started now unless it runs (what the parts that
        queue metrics or keep heartbeats are given)."""
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
        for exp_id in self._heartbeats.experiments:
            _DRIVING.discard((self.url, exp_id))
        try:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            self.media.close()
        finally:
            process, self._process = self._process, None
            try:
                # First: while the writer process holds the store open, closing here is not
                # closing a SQLite file's last connection, which would copy its WAL into the
                # file on the way out (10-30 ms at the end of a run); the writer process
                # does that after it answers, off the training process's path. Every row
                # was committed by the flush above: it is durable either way.
                self.engine.dispose()
            finally:
                if process is not None:
                    process.close()  # after the last flush: the writer process lets go of it


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
