"""Crash detection: which `running` runs have lost their process, and marking them `crashed`.

A running run's row names its host, pid, process start time and boot id, and its heartbeat
is refreshed with each batch of metrics; `lab.store.liveness.owner_gone` judges them. The
claim (`lab.store.writes`) and ``lab rm`` ask `_owner_gone` before they take over a run.
"""

from __future__ import annotations

import os
import socket
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from lab.store._values import _now
from lab.store.engine import connect, transaction
from lab.store.liveness import START_TOLERANCE_S, boot_id, owner_gone, process_start
from lab.store.schema import SqlRun

HEARTBEAT_S = 30.0  # how often a running run's heartbeat is refreshed, at the least
STALE_AFTER_S = 300.0  # a `running` run not seen for this long is `crashed`
# (store URL, run id) of every run this process claimed and has not finished: a `running`
# row of this very pid that is not here was left behind (an earlier attempt in this process
# that could not record its end), not trained now.
_HELD: set[tuple[str, int]] = set()


class Crashes:
    """The crash detection part of `lab.store.Store`."""

    url: str
    engine: Engine
    stale_after_s: float

    def mark_crashed(self) -> list[str]:
        """Mark `running` runs whose owner is gone as `crashed`; returns their run keys.

        `lab.store.liveness.owner_gone` decides: on this host and boot, a run is gone when
        its process no longer exists or its pid now belongs to another process (a SIGKILL
        or an OOM kill leaves it `running`); elsewhere, when its heartbeat is older than
        `stale_after_s` (the metric writer of a live run refreshes it every `heartbeat_s`
        at the least). Runs recorded before heartbeats existed (NULL) are judged by pid only.
        """
        now = _now()
        gone = self._gone_runs(now)
        if not gone:
            return []
        marked = []
        with transaction(self.engine) as conn:
            for _run_id, key, why, same in gone:
                done = conn.execute(
                    sa.update(SqlRun).where(same).values(status="crashed", error=why, ended_at=now)
                )
                if done.rowcount:
                    marked.append(key)
        return marked

    def _gone_runs(self, now: datetime | None = None) -> list[tuple[int, str, str, Any]]:
        """The `running` runs whose owner is gone (see `mark_crashed`): (run id, run key,
        error, the condition that the row still shows the owner judged here)."""
        now = now or _now()
        with connect(self.engine) as conn:
            running = conn.execute(
                sa.select(
                    SqlRun.run_id, SqlRun.run_key, SqlRun.host, SqlRun.pid, SqlRun.process_start,
                    SqlRun.boot_id, SqlRun.heartbeat_at,
                ).where(SqlRun.status == "running")
            ).all()  # fmt: skip
        gone: list[tuple[int, str, str, Any]] = []
        for run_id, key, host, pid, started, boot, beat in running:
            why = self._owner_gone(run_id, host, pid, started, boot, beat, now)
            if why is not None:
                # only if the row still shows the owner judged here: a run that another
                # process took over, or whose owner beat again meanwhile, stays as it is
                same = sa.and_(
                    SqlRun.run_id == run_id, SqlRun.status == "running",
                    SqlRun.pid.is_not_distinct_from(pid),
                    SqlRun.process_start.is_not_distinct_from(started),
                    SqlRun.heartbeat_at.is_not_distinct_from(beat),
                )  # fmt: skip
                gone.append((run_id, key, f"{why} while the run was running", same))
        return gone

    def _owner_gone(
        self,
        run_id: int,
        host: str | None,
        pid: int | None,
        started: float | None,
        boot: str | None,
        beat: datetime | None,
        now: datetime | None = None,
    ) -> str | None:
        """Why the process that owns a `running` run is gone, or None while it may be alive
        (`lab.store.liveness.owner_gone`, with this store's `stale_after_s`).

        The one liveness check of the store: `mark_crashed`, the run claim and
        `delete_experiment` all ask it.
        """
        if host == socket.gethostname() and pid == os.getpid():
            ours = started is None and boot is None  # recorded before process identities
            mine = process_start()
            if started is not None and mine is not None:
                ours = abs(started - mine) < START_TOLERANCE_S and boot == boot_id()
            if ours and (self.url, run_id) not in _HELD:
                return f"this process (pid {pid}) left it running and no longer trains it"
        return owner_gone(
            host=host, pid=pid, process_start=started, boot_id=boot, heartbeat_at=beat,
            stale_after_s=self.stale_after_s, now=now,
        )  # fmt: skip
