"""Writes to the store: experiments (begun, finished, renamed, deleted), their arms and
groups. One part of `lab.store.Store` (see `lab.store.store`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from lab._names import MAX_NAME, check_name, check_tags
from lab._reuse import busy_message
from lab.errors import ConfigError, NoExperiment, RunBusy
from lab.store._values import _now
from lab.store.crashes import _DRIVING, CrashReads
from lab.store.engine import transaction
from lab.store.liveness import this_owner
from lab.store.metric_rows import OWNER
from lab.store.reads import experiment_id
from lab.store.schema import (
    SqlArm,
    SqlExperiment,
    SqlGroup,
    SqlRun,
)
from lab.store.statements import update, upsert_row
from lab.store.tag_writes import annotate

if TYPE_CHECKING:
    from lab.store.records import Deleted
    from lab.store.urls import StoreURL


class ExperimentWrites:
    """The part of `lab.store.Store` that writes experiments, their arms and groups, into
    the store at `url` behind `engine` (of `dialect`).

    `driving`: the experiments this process drives (the store's `Heartbeats.experiments`);
    `judge` tells a live owner of a running run from a gone one; `writer` starts the
    background metric writer (it keeps a driven experiment's heartbeat).
    """

    def __init__(
        self,
        engine: Engine,
        url: StoreURL,
        dialect: str,
        *,
        driving: set[int],
        judge: CrashReads,
        writer: Callable[[], object],
    ) -> None:
        self.engine = engine
        self.url = url
        self.dialect = dialect
        self.driving = driving
        self.judge = judge
        self.writer = writer

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
        """Create the experiment, or reopen the one of that name; returns its id.

        `tags` join the experiment's tags (those added earlier, by ``lab tag`` too, stay);
        `notes`, when given, replace its notes. The experiment is `running` under its
        driver: this process, whose metric writer keeps the experiment's heartbeat until
        `finish_experiment` (see `lab.store.crashes`), or `owner` (host, pid, process_start,
        boot_id, as in `start_run`) when another process drives it (a `lab serve` client).
        A later driver takes it over, a crashed experiment included. `created_by` (the
        `lab serve` token that creates it) is recorded only when the experiment is new.
        """
        check_name("experiment", name, MAX_NAME)
        who = this_owner() if owner is None else owner
        values = {
            "name": name,
            "status": "running",
            "config": config,
            "seed": seed,
            "repeats": repeats,
            "callback_errors": None,
            "ended_at": None,
            **{k: who.get(k) for k in OWNER},
            "heartbeat_at": _now(),
        }
        add = check_tags(tags)
        with transaction(self.engine) as conn:
            if created_by is not None:
                known = sa.select(SqlExperiment.experiment_id).where(SqlExperiment.name == name)
                if conn.execute(known).first() is None:
                    values["created_by"] = created_by
            table = SqlExperiment.__table__
            exp_id = upsert_row(conn, table, values, ["name"], "experiment_id")
            if add or notes is not None:
                where = SqlExperiment.experiment_id == exp_id
                annotate(conn, self.dialect, SqlExperiment, where, add=add, remove=[], notes=notes)
        if owner is None:
            self.driving.add(exp_id)
            _DRIVING.add((self.url, exp_id))
            self.writer()  # started now: it keeps the experiment's heartbeat
        return exp_id

    def add_arm(
        self, experiment_id: int, name: str, *, overrides: dict[str, Any], config: dict[str, Any]
    ) -> int:
        """Record an arm of an experiment; returns its id."""
        check_name("arm", name, MAX_NAME)
        values = {
            "experiment_id": experiment_id,
            "name": name,
            "overrides": overrides,
            "config": config,
        }
        with transaction(self.engine) as conn:
            return upsert_row(conn, SqlArm.__table__, values, ["experiment_id", "name"], "arm_id")

    def add_group(
        self, experiment_id: int, name: str, *, kind: str = "repeats", arm_id: int | None = None
    ) -> int:
        """Record a group of runs; returns its id."""
        check_name("group", name, MAX_NAME)
        values = {"experiment_id": experiment_id, "name": name, "kind": kind, "arm_id": arm_id}
        with transaction(self.engine) as conn:
            keys = ["experiment_id", "name"]
            return upsert_row(conn, SqlGroup.__table__, values, keys, "group_id")

    def finish_experiment(
        self,
        experiment_id: int,
        *,
        status: str,
        callback_errors: list[dict[str, Any]] | None = None,
    ) -> None:
        """Record an experiment's final status and the failures of its experiment-level
        callbacks (NULL when there were none); this process drives it no more (its
        heartbeat stops). An experiment the store does not hold raises `NoExperiment`."""
        self.driving.discard(experiment_id)
        _DRIVING.discard((self.url, experiment_id))
        with transaction(self.engine) as conn:
            stmt = update(
                SqlExperiment.__table__, ("status", "callback_errors", "ended_at"), "experiment_id"
            )
            values = {"status": status, "callback_errors": callback_errors or None}
            done = conn.execute(
                stmt, {**values, "ended_at": _now(), "experiment_id": experiment_id}
            ).rowcount
        if not done:
            raise NoExperiment(
                f"no experiment with id {experiment_id} in the store; lab ls lists them"
            )

    def delete_experiment(self, name: str) -> Deleted:
        """Delete an experiment and, by cascade, its arms, groups, runs (superseded ones
        too), metrics and their blocks (on PostgreSQL by the trigger of revisions 0010 and
        0011), summaries, evals, predictions, checkpoint, histogram and image rows,
        in one transaction. Run folders are files, not rows: they stay, and are returned
        (``folders``, sorted) with the number of runs deleted (``runs``). Refused with
        `RunBusy` while a live process trains one of its runs."""
        with transaction(self.engine) as conn:
            exp_id = experiment_id(conn, name)
            for run in conn.execute(
                sa.select(SqlRun.run_id, SqlRun.run_key, SqlRun.host, SqlRun.pid,
                          SqlRun.process_start, SqlRun.boot_id, SqlRun.started_at,
                          SqlRun.heartbeat_at)
                .where(SqlRun.experiment_id == exp_id, SqlRun.status == "running")
            ).mappings():  # fmt: skip
                owner = (run["run_id"], run["host"], run["pid"], run["process_start"],
                         run["boot_id"], run["heartbeat_at"])  # fmt: skip
                if self.judge.owner_gone(*owner) is None:
                    raise RunBusy(busy_message(name, run["run_key"], dict(run)))
            folders = conn.execute(
                sa.select(SqlRun.output_dir).where(SqlRun.experiment_id == exp_id)
            ).scalars().all()  # fmt: skip
            conn.execute(sa.delete(SqlExperiment).where(SqlExperiment.experiment_id == exp_id))
        return {"runs": len(folders), "folders": sorted(f for f in folders if f)}

    def rename_experiment(self, old: str, new: str) -> None:
        """Rename an experiment in the store; its rows and run folders stay as they are
        (each run keeps its recorded `output_dir`). Refuses a name in use."""
        if not isinstance(new, str) or not new.strip():
            raise ConfigError(f"an experiment needs a non-empty name, got {new!r}")
        with transaction(self.engine) as conn:
            exp_id = experiment_id(conn, old)
            taken = conn.execute(
                sa.select(SqlExperiment.experiment_id).where(SqlExperiment.name == new)
            ).first()
            if taken is not None:
                raise ConfigError(
                    f"an experiment named {new!r} exists already; pick another name, or "
                    f"delete it first: lab rm {new}"
                )
            conn.execute(
                sa.update(SqlExperiment)
                .where(SqlExperiment.experiment_id == exp_id)
                .values(name=new)
            )
