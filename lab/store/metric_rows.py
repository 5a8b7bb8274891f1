"""`MetricRows`: where a batch of metrics is written, with everything kept beside it in its
transaction: each (run, key)'s summary (`lab.store.summaries`), its blocks
(`lab.store.blocks`), and the heartbeats of the runs and experiments this process keeps
alive.

A `lab.store.Store` holds one and writes through it from its writer thread; the writer
process (`lab.store.writer_process`) opens one of its own on the same store and writes the
batches a training process hands it, with the same code. It needs nothing else of a store.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain, islice, repeat
from operator import lt
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from lab.store._values import _now
from lab.store.blocks import Blocks, bounds
from lab.store.engine import transaction
from lab.store.liveness import this_owner
from lab.store.pg_copy import copy_metrics, watch
from lab.store.schema import SqlExperiment, SqlRun
from lab.store.sqlite_rows import inserter
from lab.store.summaries import Summaries

if TYPE_CHECKING:
    from lab.store.writer import MetricItem

#: The experiments a process drives whose heartbeat is due, with their driver (host, pid,
#: process_start, boot_id): what a batch carries besides its rows.
Driving = tuple[list[int], dict[str, Any]]

#: The columns that name the process owning a run or driving an experiment.
OWNER = ("host", "pid", "process_start", "boot_id")

_METRIC_UPSERT = (
    'INSERT INTO metrics (run_id, "key", step, value, wall_time) VALUES {values} '
    'ON CONFLICT (run_id, "key", step) DO UPDATE '
    "SET value = excluded.value, wall_time = excluded.wall_time"
)


def _no_driving() -> Driving | None:
    return None


class Heartbeats:
    """What this process keeps alive in one store: `runs` it started and has not finished,
    `experiments` it began and has not finished (it drives them). Their heartbeats ride on
    the metric batches (`MetricRows.write`); an experiment's is due every half
    `heartbeat_s`."""

    def __init__(self, heartbeat_s: float) -> None:
        self.heartbeat_s = heartbeat_s
        self.runs: set[int] = set()
        self.experiments: set[int] = set()
        self._driven_at = -math.inf  # when their heartbeat was last handed to the writer

    def driving_due(self) -> Driving | None:
        """The experiments this process drives whose heartbeat is due, with this process
        as their driver; None when none is."""
        if not self.experiments:
            return None
        now = time.monotonic()
        if now - self._driven_at < self.heartbeat_s / 2:
            return None
        self._driven_at = now
        return sorted(self.experiments), this_owner()


class MetricRows:
    """The metric rows of the store behind `engine`, with their summaries, blocks and the
    heartbeats that ride on each batch.

    `active`: the runs started in this process and not finished (their heartbeat is
    refreshed with each batch; the store shares its set). `driving_due`: the experiments
    this process drives whose heartbeat is due, asked when a batch comes without them.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        active: set[int] | None = None,
        driving_due: Callable[[], Driving | None] = _no_driving,
    ) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self.active: set[int] = set() if active is None else active
        self.driving_due = driving_due
        self.summaries = Summaries(self.dialect)
        self.blocks = Blocks(self.dialect)
        # metrics by COPY on PostgreSQL (`lab.store.pg_copy`), else many rows a statement
        # (`lab.store.sqlite_rows`)
        self._copy = self.dialect == "postgresql"
        self._metric_upsert = inserter(_METRIC_UPSERT, 5, self.dialect)
        if self._copy:
            watch(engine)
        # Built once: the writer runs these with every batch, and building a statement
        # costs more than running it.
        ids: sa.BindParameter[list[int]] = sa.bindparam("ids", expanding=True)
        self._beat = (
            sa.update(SqlRun)
            .where(SqlRun.run_id.in_(ids), SqlRun.status == "running")
            .values(heartbeat_at=sa.bindparam("now"))
        )
        # a live driver's heartbeat: it drives the experiment (a crashed one runs again)
        self._drive = (
            sa.update(SqlExperiment)
            .where(SqlExperiment.experiment_id.in_(ids),
                   SqlExperiment.status.in_(("running", "crashed")))
            .values(status="running", ended_at=None, heartbeat_at=sa.bindparam("now"),
                    **{k: sa.bindparam(f"driver_{k}") for k in OWNER})
        )  # fmt: skip

    def write(self, items: list[MetricItem], driving: Driving | None = None) -> None:
        """Write one batch of queued metrics ((run, step, metrics, wall time) each) in one
        transaction, with their summaries, blocks and the heartbeats due."""
        series = _series(items)
        self._commit(_rows(series), series, driving)

    def write_columns(
        self,
        run_ids: Sequence[int],
        steps: Sequence[int],
        keys: Sequence[str],
        values: Sequence[float],
        wall_times: Sequence[float],
    ) -> None:
        """`Store.write_metric_columns`: a client's checked batch, as columns, now."""
        series: dict[int, dict[str, Series]] = {}
        for run_id, key, step, value, wall_time in zip(
            run_ids, keys, steps, values, wall_times, strict=True
        ):
            _add(series, run_id, key, step, value, wall_time)
        rows = list(zip(run_ids, keys, steps, values, wall_times, strict=True))
        self._commit(rows, series)

    def _commit(
        self,
        rows: Iterable[tuple[Any, ...]],
        series: dict[int, dict[str, Series]],
        driving: Driving | None = None,
    ) -> None:
        """Write a batch's rows (`series`: the same points per run and key), its summaries
        and blocks, and the heartbeats of the runs started here and of the experiments
        driven here (`driving`: handed over by the process that drives them, else this
        store's own, when due), in one transaction."""
        acc = _folds(series)
        beating = set(acc) | self.active
        if driving is None:
            driving = self.driving_due()
        points = any(series.values())
        if not points and not beating and driving is None:
            return
        with transaction(self.engine) as conn:
            if points:
                cut: dict[tuple[int, str], list[tuple[Any, ...]]] = {}
                if self._copy:  # the blocks cut while the server writes the rows
                    copy_metrics(conn, lambda: _rows(series), acc, lambda: cut.update(
                        self.blocks.cut(series, acc)))  # fmt: skip
                else:
                    self._metric_upsert(conn, rows)
                again = self.summaries.summarize(conn, acc)
                self.blocks.block(conn, series, acc, again, cut or None)
            if beating:
                self.beat(conn, beating)
            if driving is not None:
                self.drive(conn, *driving)

    def beat(self, conn: Connection, run_ids: Sequence[int] | set[int]) -> None:
        """Refresh the heartbeat of `run_ids` that are `running`, in `conn`'s transaction:
        their process is alive (a client of `lab serve` says so with each batch)."""
        conn.execute(self._beat, {"ids": sorted(run_ids), "now": _now()})

    def drive(self, conn: Connection, experiment_ids: Sequence[int], owner: dict[str, Any]) -> None:
        """Refresh the heartbeat of experiments that `owner` (host, pid, process_start,
        boot_id) drives, and record it as their driver: of two processes that drive one
        experiment, the one still alive holds it. A crashed one runs again (a live driver
        says so); a finished one stays finished."""
        if experiment_ids:
            params = {f"driver_{k}": owner.get(k) for k in OWNER}
            conn.execute(self._drive, {"ids": sorted(experiment_ids), "now": _now(), **params})

    def recount(self, conn: Connection, run_id: int, after_step: int | None) -> None:
        """Rebuild a run's summaries and its blocks from its rows, after its metrics past
        `after_step` (None: all of them) went."""
        self.summaries.resummarize(conn, run_id)
        self.blocks.reblock_run(conn, run_id, after_step)


#: One (run, key)'s points in a batch, in the order they were logged: steps, values and
#: wall times (lists that the keys of one run may share).
Series = tuple[list[int], list[float], list[float]]


def _rows(series: dict[int, dict[str, Series]]) -> Iterator[tuple[Any, ...]]:
    """A batch's rows (run, key, step, value, wall time), key after key: SQLite appends
    each key's rows to one place of its B-tree. Per key the rows keep the order they were
    logged in, so a step logged twice in a batch keeps its last value. SQLite stores a NaN
    value as NULL (see lab.store.schema). Made by `zip` in C as the statement reads them,
    never held as a list: `zip` hands over the same tuple again once the last one was let
    go of, so the rows of a batch allocate next to nothing."""
    return chain.from_iterable(
        zip(repeat(run_id), repeat(key), steps, values, wall_times)
        for run_id, per in series.items()
        for key, (steps, values, wall_times) in per.items()
    )


def _series(items: list[MetricItem]) -> dict[int, dict[str, Series]]:
    """A batch's points per run and key. The common batch logs the same keys at every step
    of a run: each key's values are then read off the steps in one comprehension, and its
    steps and wall times are the run's own lists; any other is taken point by point."""
    by_run: dict[int, tuple[list[int], list[dict[str, float]], list[float]]] = {}
    for run_id, step, metrics, wall_time in items:
        _push(by_run, run_id, step, metrics, wall_time)
    series: dict[int, dict[str, Series]] = {}
    for run_id, (steps, dicts, wall_times) in by_run.items():
        keys = dicts[0].keys()
        if all(m.keys() == keys for m in dicts):
            series[run_id] = {key: (steps, [m[key] for m in dicts], wall_times) for key in keys}
            continue
        for step, metrics, wall_time in zip(steps, dicts, wall_times, strict=True):
            for key, value in metrics.items():
                _add(series, run_id, key, step, value, wall_time)
    return series


def _add(
    series: dict[int, dict[str, Series]],
    run_id: int,
    key: str,
    step: int,
    value: float,
    wall_time: float,
) -> None:
    """One point appended to its series."""
    per = series.get(run_id)
    if per is None:
        per = series[run_id] = {}
    _push(per, key, step, value, wall_time)


def _push(lists: dict[Any, Any], at: Any, a: Any, b: Any, c: Any) -> None:
    """`a`, `b` and `c` appended to the three lists held under `at` (made empty first)."""
    held = lists.get(at)
    if held is None:
        held = lists[at] = ([], [], [])
    held[0].append(a)
    held[1].append(b)
    held[2].append(c)


def _folds(series: dict[int, dict[str, Series]]) -> dict[int, dict[str, list[Any]]]:
    """Per run and key: [count, first step, last step, last value, min, max, wall time,
    again], what `Summaries.summarize` merges. min and max leave NaN out (+inf and -inf,
    min > max, when every point was NaN). `again`: a step came at or before one logged
    before it in the batch (logged again, or out of order), so the folds in place (count,
    min, max, blocks) cannot be trusted: the key is recomputed from the rows; its first
    and last step are then the least and the greatest."""
    increasing: dict[int, bool] = {}  # per steps list (the keys of a run share one)
    acc: dict[int, dict[str, list[Any]]] = {}
    for run_id, per in series.items():
        out = acc[run_id] = {}
        for key, (steps, values, wall_times) in per.items():
            up = increasing.get(id(steps))
            if up is None:
                up = increasing[id(steps)] = all(map(lt, steps, islice(steps, 1, None)))
            lo, hi = bounds(values)
            if up:
                out[key] = [len(steps), steps[0], steps[-1], values[-1], lo, hi,
                            wall_times[-1], False]  # fmt: skip
            else:
                out[key] = [len(steps), min(steps), max(steps), values[-1], lo, hi,
                            wall_times[-1], True]  # fmt: skip
    return acc


__all__ = ["OWNER", "Driving", "MetricRows"]
