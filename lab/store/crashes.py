"""Crash detection: which `running` runs and experiments have lost their process, and
marking them `crashed`.

A running run's row names its host, pid, process start time and boot id, and its heartbeat
is refreshed with each batch of metrics; `lab.store.liveness.owner_gone` judges them. The
claim (`lab.store.run_writes`) and ``lab rm`` ask `CrashReads.owner_gone` before they take
over a run.

An experiment's row names its driver the same way: the process that began it
(`Store.begin_experiment`: `Experiment.run`, `lab.start_run`, a bare fit), the latest one
when several drive it, whose writer keeps the experiment's heartbeat while it drives it
(and records itself as the driver again with each beat, so that of two drivers the one
still alive holds it). A `running` experiment is crashed when its driver is gone and none
of its runs is `running` under a live process: a run that trains keeps its experiment alive.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple

from lab.store._values import _now
from lab.store.liveness import START_TOLERANCE_S, boot_id, owner_gone, process_start

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from lab.store.sql import Sql
    from lab.store.urls import StoreURL

HEARTBEAT_S = 30.0  # how often a running run's heartbeat is refreshed, at the least
STALE_AFTER_S = 300.0  # a `running` run not seen for this long is `crashed`
# (store URL, run id) of every run this process claimed and has not finished: a `running`
# row of this very pid that is not here was left behind (an earlier attempt in this process
# that could not record its end), not trained now.
_HELD: set[tuple[str, int]] = set()
# (store URL, experiment id) of every experiment this process began and has not finished:
# as `_HELD`, for the experiments this process drives.
_DRIVING: set[tuple[str, int]] = set()


def hold(url: str, run_id: int) -> None:
    """Say that this process trains run `run_id` of the store at `url` (it claimed it)."""
    _HELD.add((url, run_id))


def let_go(url: str, run_id: int) -> None:
    """Say that this process no longer trains run `run_id` (it finished it, released it, or
    recorded it for another process)."""
    _HELD.discard((url, run_id))


class Gone(NamedTuple):
    """A `running` row whose owner is gone: its id, its name (run key or experiment name),
    why, the owner as judged (pid, process start, heartbeat: `mark_crashed` marks the row
    only while it still shows them, so a row another process took over, or whose owner
    beat again meanwhile, stays as it is), and its experiment's id."""

    id: int
    name: str
    why: str
    pid: int | None
    process_start: float | None
    heartbeat_at: datetime | None
    experiment_id: int


class Crashed(NamedTuple):
    """What a read-only reader shows as crashed without writing it, by run id and by
    experiment id."""

    runs: dict[int, Gone]
    experiments: dict[int, Gone]


# the running runs with their owners, and the running experiments with their drivers
_RUNNING_RUNS = (
    "SELECT run_id, run_key, experiment_id, host, pid, process_start, boot_id, heartbeat_at "
    "FROM runs WHERE status = 'running'"
)
_RUNNING_EXPERIMENTS = (
    "SELECT experiment_id, name, host, pid, process_start, boot_id, heartbeat_at "
    "FROM experiments WHERE status = 'running'"
)


class CrashReads:
    """The crash judgement, as every reader makes it (`lab.store.Store`, and the reader
    commands open, `lab.store.reader.Reader`): which `running` rows have lost their owner.

    `reading` opens a `Sql` over one of the reader's connections; `url` names the store in
    this process's own claims (`hold`); `readonly`: whether the reader only shows the rows
    it judges (`crashed_now`) rather than marking them; `stale_after_s` as in `Store`.
    """

    def __init__(
        self,
        url: StoreURL,
        reading: Callable[[], AbstractContextManager[Sql]],
        *,
        readonly: bool,
        stale_after_s: float,
    ) -> None:
        self.url = url
        self.reading = reading
        self.readonly = readonly
        self.stale_after_s = stale_after_s

    def crashed_now(self) -> Crashed:
        """The runs and experiments a read-only store shows as crashed (and never marks so):
        those `mark_crashed` would mark now. Empty for a store that writes, which marks
        them when it opens."""
        if not self.readonly:
            return Crashed({}, {})
        runs, experiments = self.judge()
        return Crashed({g.id: g for g in runs}, {g.id: g for g in experiments})

    def judge(self, now: datetime | None = None) -> tuple[list[Gone], list[Gone]]:
        """The `running` runs whose owner is gone, and the `running` experiments whose
        driver is gone and none of whose running runs has a live owner: one read of each
        table, one judgement per running row."""
        now = now or _now()
        with self.reading() as sql:
            running = sql.rows(_RUNNING_RUNS)
            driven = sql.rows(_RUNNING_EXPERIMENTS)
            when = sql.time
        runs: list[Gone] = []
        alive: set[int] = set()  # experiments with a run whose owner lives
        for run_id, key, exp_id, host, pid, started, boot, beat in running:
            beat = when(beat)
            why = self.owner_gone(run_id, host, pid, started, boot, beat, now)
            if why is None:
                alive.add(exp_id)
                continue
            runs.append(Gone(run_id, key, f"{why} while the run was running", pid, started,
                             beat, exp_id))  # fmt: skip
        experiments: list[Gone] = []
        for exp_id, name, host, pid, started, boot, beat in driven:
            if exp_id in alive:
                continue  # one of its runs trains under a live process
            beat = when(beat)
            why = self.owner_gone(exp_id, host, pid, started, boot, beat, now, held=_DRIVING)
            if why is None:
                continue
            experiments.append(Gone(exp_id, name, f"{why} while it ran", pid, started, beat,
                                    exp_id))  # fmt: skip
        return runs, experiments

    def owner_gone(
        self,
        row_id: int,
        host: str | None,
        pid: int | None,
        started: float | None,
        boot: str | None,
        beat: datetime | None,
        now: datetime | None = None,
        *,
        held: set[tuple[str, int]] = _HELD,
    ) -> str | None:
        """Why the process that owns a `running` run (or, with `held` `_DRIVING`, drives a
        `running` experiment) is gone, or None while it may be alive
        (`lab.store.liveness.owner_gone`, with this store's `stale_after_s`).

        The one liveness check of the store: `mark_crashed`, the run claim and
        `delete_experiment` all ask it.
        """
        if host == socket.gethostname() and pid == os.getpid():
            ours = started is None and boot is None  # recorded before process identities
            mine = process_start()
            if started is not None and mine is not None:
                ours = abs(started - mine) < START_TOLERANCE_S and boot == boot_id()
            if ours and (self.url, row_id) not in held:
                work = "drives" if held is _DRIVING else "trains"
                return f"this process (pid {pid}) left it running and no longer {work} it"
        return owner_gone(
            host=host, pid=pid, process_start=started, boot_id=boot, heartbeat_at=beat,
            stale_after_s=self.stale_after_s, now=now,
        )  # fmt: skip


class Crashes:
    """The crash detection part of `lab.store.Store`: marking what `judge` (its
    `CrashReads`) finds in the store behind `engine`."""

    def __init__(self, engine: Engine, judge: CrashReads) -> None:
        self.engine = engine
        self.judge = judge

    def mark_crashed(self) -> list[str]:
        """Mark `running` runs whose owner is gone as `crashed`, then `running` experiments
        whose driver is gone and that have no live running run; returns the runs' keys.

        `lab.store.liveness.owner_gone` decides: on this host and boot, an owner is gone
        when its process no longer exists or its pid now belongs to another process (a
        SIGKILL or an OOM kill leaves the row `running`); elsewhere, when its heartbeat is
        older than `stale_after_s` (the metric writer of a live run or driver refreshes it
        every `heartbeat_s` at the least). Rows recorded before heartbeats existed (NULL)
        are judged by pid only; an experiment recorded before drivers were (no driver at
        all) is never judged.
        """
        now = _now()
        runs, experiments = self.judge.judge(now)
        if not runs and not experiments:
            return []
        import sqlalchemy as sa

        from lab.store.engine import transaction
        from lab.store.schema import SqlExperiment, SqlRun

        marked = []
        with transaction(self.engine) as conn:
            for gone in runs:
                done = conn.execute(
                    sa.update(SqlRun)
                    .where(_unchanged(SqlRun, SqlRun.run_id == gone.id, gone))
                    .values(status="crashed", error=gone.why, ended_at=now)
                )
                if done.rowcount:
                    marked.append(gone.name)
            live = sa.exists().where(
                SqlRun.experiment_id == SqlExperiment.experiment_id, SqlRun.status == "running"
            )
            for gone in experiments:  # after its runs: a run still running is a live one
                same = _unchanged(SqlExperiment, SqlExperiment.experiment_id == gone.id, gone)
                conn.execute(
                    sa.update(SqlExperiment)
                    .where(same, ~live)
                    .values(status="crashed", ended_at=now)
                )
        return marked


def _unchanged(model: Any, which: Any, gone: Gone) -> Any:
    """The condition that row `which` of `model` (runs or experiments) is still `running`
    under the owner judged: a row another process took over, or whose owner beat again
    meanwhile, is left as it is."""
    import sqlalchemy as sa

    return sa.and_(
        which, model.status == "running", model.pid.is_not_distinct_from(gone.pid),
        model.process_start.is_not_distinct_from(gone.process_start),
        model.heartbeat_at.is_not_distinct_from(gone.heartbeat_at),
    )  # fmt: skip
