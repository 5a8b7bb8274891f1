"""Writes to the store: a run's claim, start, release, supersession, truncation and end,
and what it records at its end. One part of `lab.store.Store` (see `lab.store.store`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from lab._json import floats_back
from lab._names import MAX_KEY, check_name, check_tags
from lab._reuse import busy_message
from lab.errors import ConfigError, NoRun, RunBusy
from lab.store._values import _failures, _free_text, _now
from lab.store.crashes import CrashReads, hold, let_go
from lab.store.engine import transaction
from lab.store.liveness import this_owner
from lab.store.metric_rows import MetricRows
from lab.store.schema import (
    SqlCheckpoint,
    SqlEval,
    SqlExperiment,
    SqlHistogram,
    SqlImage,
    SqlMetric,
    SqlRun,
)
from lab.store.statements import update, upsert
from lab.store.tables import RUN_STATUSES
from lab.store.tag_writes import annotate

if TYPE_CHECKING:
    from lab.store.records import FinishedRun
    from lab.store.urls import StoreURL
    from lab.store.writer import MetricWriter

#: Whether a run has any row that `truncate_run` would drop: a run that starts afresh
#: (most runs) has none, and is spared seven deletes and the summaries' recount.
_RUN_HAS_ROWS = " UNION ALL ".join(
    f"SELECT 1 FROM (SELECT 1 FROM {table} WHERE run_id = {{m}} LIMIT 1) AS {table}"
    for table in ("metrics", "summaries", "metric_blocks", "evals", "checkpoints",
                  "histograms", "images")
)  # fmt: skip


#: The statuses of a run that ended: a start claims such a run again, afresh.
ENDED = tuple(s for s in RUN_STATUSES if s != "running")
#: The keys of a pruned run's record (`runs.pruned`) and the types of their values.
PRUNED_KEYS = {"step": int, "rule": str, "metric": str, "value": float}


def check_pruned(status: str, pruned: dict[str, Any] | None) -> None:
    """Refuse, with one line, a `pruned` record that is not ``{"step": int, "rule": str,
    "metric": str, "value": float}``, or one given with a status other than `pruned`."""
    if pruned is None:
        return
    if status != "pruned":
        raise ConfigError(
            f"a run ended {status!r} carries no pruned record; end it with status='pruned'"
        )
    fine = isinstance(pruned, dict) and set(pruned) == set(PRUNED_KEYS)
    for key, kind in PRUNED_KEYS.items():
        value = pruned.get(key) if fine else None
        fine = (
            fine
            and not isinstance(value, bool)
            and (isinstance(value, kind) or (kind is float and isinstance(value, int)))
        )
    if not fine:
        raise ConfigError(
            f"pruned={pruned!r}: a pruned run's record is {{'step': int, 'rule': str, "
            "'metric': str, 'value': float}"
        )


class RunWrites:
    """The part of `lab.store.Store` that writes runs, from their claim to their end, into
    the store at `url` behind `engine` (of `dialect`).

    `active`: the runs this process trains (the store's `Heartbeats.runs`, whose heartbeat
    rides on the metric batches of `metric_rows`); `judge` tells a live owner of a claimed
    row from a gone one; `writer` starts the background metric writer (it keeps a quiet
    run's heartbeat); `flush` makes what the store has queued durable.
    """

    def __init__(
        self,
        engine: Engine,
        url: StoreURL,
        dialect: str,
        metric_rows: MetricRows,
        *,
        active: set[int],
        judge: CrashReads,
        writer: Callable[[], MetricWriter],
        flush: Callable[[], None],
    ) -> None:
        self.engine = engine
        self.url = url
        self.dialect = dialect
        self.metric_rows = metric_rows
        self.active = active
        self.judge = judge
        self.writer = writer
        self.flush = flush
        mark = "%s" if dialect == "postgresql" else "?"
        self._run_has_rows = _RUN_HAS_ROWS.format(m=mark)

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
        """Claim a run and record it as `running` (its row reset, if it ran before); returns
        its id.

        `provenance` is what `lab.provenance.collect` found (git, packages, versions,
        devices, command line). The owner's identity (host, pid, process start time, boot
        id) is recorded too, for `mark_crashed`. Tags and notes stay as they were.

        The claim is atomic, on SQLite and PostgreSQL alike: of two processes that start
        the same run key at once, one gets the row and the other raises `RunBusy`, as does
        anyone while the row is `running` under a live process (see
        `CrashReads.owner_gone`). A run claimed earlier with `claim_run` passes its id as
        `claimed`: this process (a worker, say) then takes the row over. What the run
        recorded earlier stays until its training starts: `truncate_run` then drops all of
        it for a fresh start, or what lies after the checkpoint for a resume. `owner` (host,
        pid, process_start, boot_id) names the process that trains the run when it is not
        this one (a `lab serve` client).
        """
        values = self._run_values(
            experiment_id, group_id, run_key=run_key, arm_id=arm_id, repeat=repeat,
            stage=stage, seed=seed, config=config, output_dir=output_dir,
            parent_run_id=parent_run_id, config_hash=config_hash, provenance=provenance,
            owner=owner,
        )  # fmt: skip
        if claimed is not None:
            with transaction(self.engine) as conn:
                keep = {k: v for k, v in values.items() if k not in ("experiment_id", "run_key")}
                taken = conn.execute(
                    sa.update(SqlRun)
                    .where(SqlRun.run_id == claimed, SqlRun.status == "running")
                    .values(**keep)
                ).rowcount
            if taken != 1:
                raise RunBusy(f"run {run_key} was claimed by this experiment, but its row is no "
                              "longer running; run the experiment again")  # fmt: skip
            run_id: int | None = claimed
        else:
            run_id, _finished = self._claim(values, ENDED)
        assert run_id is not None  # (a finished run is claimed again: started afresh)
        self.active.add(run_id)
        hold(self.url, run_id)
        self.writer()  # started now: it keeps the heartbeat while the run is quiet
        return run_id

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
        """Claim a run that an experiment is about to train, atomically; ``(run_id, None)``
        when this process won it.

        Only a new run, a `failed` or `crashed` one, or a `running` one whose process is
        gone can be claimed. A run that another process finished meanwhile comes back as
        ``(None, its record)`` (status and final metrics) to be reused; one that a live
        process holds raises `RunBusy`, and so does one recorded meanwhile with another
        `config_hash` (a conflict with what the store holds, answered 409 over HTTP as a
        busy run is). `owner`: as in `start_run`.
        """
        values = self._run_values(
            experiment_id, group_id, run_key=run_key, arm_id=arm_id, repeat=repeat,
            stage=stage, seed=seed, config=config, output_dir=output_dir,
            parent_run_id=parent_run_id, config_hash=config_hash, provenance=None,
            owner=owner,
        )  # fmt: skip
        return self._claim(values, ("failed", "crashed"))

    def _run_values(
        self, experiment_id: int, group_id: int, *, run_key: str, arm_id: int | None,
        repeat: int, stage: int, seed: int, config: dict[str, Any], output_dir: str | None,
        parent_run_id: int | None, config_hash: str | None, provenance: dict[str, Any] | None,
        owner: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        check_name("run key", run_key, MAX_KEY)
        who = this_owner() if owner is None else owner
        return {
            "experiment_id": experiment_id,
            "group_id": group_id,
            "arm_id": arm_id,
            "run_key": run_key,
            "repeat": repeat,
            "stage": stage,
            "seed": seed,
            "config": config,
            "status": "running",
            "error": None,
            "traceback": None,
            "summary": None,
            "callback_errors": None,
            "pruned": None,
            "output_dir": output_dir,
            "parent_run_id": parent_run_id,
            "provenance": provenance,
            "host": who.get("host"),
            "pid": who.get("pid"),
            "process_start": who.get("process_start"),
            "boot_id": who.get("boot_id"),
            "started_at": _now(),
            "ended_at": None,
            "heartbeat_at": _now(),
            "config_hash": config_hash,
        }

    def _claim(
        self, values: dict[str, Any], reclaim: tuple[str, ...]
    ) -> tuple[int | None, FinishedRun | None]:
        """Insert the run's row, or take over its row when its status is one of `reclaim`
        (and its hash is the same, when both have one), in one transaction whose outcome
        says who won; else judge the row that is there (see `claim_run`)."""
        keys = ["experiment_id", "run_key"]
        # taken over only from one of `reclaim`, and with the same hash when both have one
        statuses = ", ".join(f"'{status}'" for status in reclaim)
        cond = (
            f'"runs"."status" IN ({statuses}) AND (excluded."config_hash" IS NULL OR '
            '"runs"."config_hash" IS NULL OR "runs"."config_hash" = excluded."config_hash")'
        )
        claim = upsert(SqlRun.__table__, tuple(values), tuple(keys), "run_id", cond)
        with transaction(self.engine) as conn:
            run_id = claim(conn, values)
            if run_id is not None:
                hold(self.url, run_id)
                return run_id, None
            row = _claimed_row(conn, values["experiment_id"], values["run_key"])
            where = f"run {values['run_key']} of experiment {row['name']!r}"
            if row["status"] == "running":
                owner = (row["run_id"], row["host"], row["pid"], row["process_start"],
                         row["boot_id"], row["heartbeat_at"])  # fmt: skip
                if self.judge.owner_gone(*owner) is None:
                    raise RunBusy(busy_message(row["name"], values["run_key"], row))
                took = conn.execute(  # compare-and-swap: only if nobody took it meanwhile
                    sa.update(SqlRun)
                    .where(
                        SqlRun.run_id == row["run_id"],
                        SqlRun.status == "running",
                        SqlRun.started_at == row["started_at"],
                        SqlRun.pid.is_not_distinct_from(row["pid"]),
                        SqlRun.host.is_not_distinct_from(row["host"]),
                    )
                    .values(**{k: v for k, v in values.items() if k not in keys})
                ).rowcount
                if took == 1:
                    hold(self.url, row["run_id"])
                    return row["run_id"], None
                raise RunBusy(f"{where} was just claimed by another process; run again")
            if (
                values["config_hash"] is not None
                and row["config_hash"] is not None
                and row["config_hash"] != values["config_hash"]
            ):
                raise RunBusy(
                    f"{where} was just recorded with other settings by another process; use a "
                    "new experiment name, or start afresh with fresh=True (--fresh on the "
                    "command line)"
                )
        return None, {"status": row["status"], "summary": floats_back(row["summary"] or {})}

    def release_run(self, run_id: int, error: str, owner: dict[str, Any] | None = None) -> None:
        """Record a run this process (or `owner`, as in `start_run`) claimed and never
        started as `failed` with `error`; nothing changes once another process (a worker)
        took it over, or it ended."""
        let_go(self.url, run_id)
        who = this_owner() if owner is None else owner
        with transaction(self.engine) as conn:
            done = conn.execute(
                sa.update(SqlRun)
                .where(
                    SqlRun.run_id == run_id,
                    SqlRun.status == "running",
                    SqlRun.pid == who.get("pid"),
                    SqlRun.host == who.get("host"),
                )
                .values(status="failed", error=_free_text(error), ended_at=_now())
            ).rowcount
            if not done:
                _check_run(conn, run_id)

    def supersede_run(self, run_id: int, run_key: str, output_dir: str | None) -> None:
        """Mark a run superseded (kept, left out of every reader) under a new key and
        folder; a run that is running, or superseded already, raises `RunBusy`, one the
        store does not hold `NoRun`."""
        with transaction(self.engine) as conn:
            done = conn.execute(
                sa.update(SqlRun)
                .where(SqlRun.run_id == run_id, SqlRun.superseded_at.is_(None),
                       SqlRun.status != "running")
                .values(superseded_at=_now(), run_key=run_key, output_dir=output_dir)
            ).rowcount  # fmt: skip
            if done != 1:
                _check_run(conn, run_id)
        if done != 1:
            raise RunBusy(f"run {run_key} started or was superseded meanwhile; run again")

    def truncate_run(self, run_id: int, after_step: int | None = None) -> None:
        """Drop a run's metrics, evals (with predictions), checkpoint, histogram and image
        rows after a step (image files stay: a step trained again writes its file anew).

        ``after_step=None`` drops all of them: a run that starts again from nothing replaces
        its earlier record. A run resumed from the checkpoint at step N keeps what it logged
        up to N, and the steps it trains again are written anew, never twice. Post-training
        evals (step NULL) always go: they run again at the end. So do the metrics they wrote
        (``<eval>/<key>`` at the run's last step), even when that step is N. A run the store
        does not hold raises `NoRun`.
        """
        self.flush()
        with transaction(self.engine) as conn:
            _check_run(conn, run_id)
            if (
                after_step is None
                and not conn.exec_driver_sql(self._run_has_rows, (run_id,) * 7).first()
            ):
                return
            if after_step is not None:
                post = conn.execute(
                    sa.select(SqlEval.name, SqlEval.metrics).where(
                        SqlEval.run_id == run_id, SqlEval.step.is_(None)
                    )
                ).all()
                keys = [f"{name}/{k}" for name, metrics in post for k in (metrics or {})]
                if keys:
                    conn.execute(
                        sa.delete(SqlMetric).where(
                            SqlMetric.run_id == run_id,
                            SqlMetric.key.in_(keys),
                            SqlMetric.step >= after_step,
                        )
                    )
            # predictions: ON DELETE CASCADE
            for model in (SqlMetric, SqlEval, SqlCheckpoint, SqlHistogram, SqlImage):
                where = model.run_id == run_id
                if after_step is not None:
                    later = model.step > after_step
                    where = sa.and_(
                        where, sa.or_(later, model.step.is_(None)) if model is SqlEval else later
                    )
                conn.execute(sa.delete(model).where(where))
            self.metric_rows.recount(conn, run_id, after_step)

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
        """Record a run's final status, error and final metrics; `tags` join the run's
        tags and `notes`, when given, replace its notes (what `train(run)` set). A run
        ended `pruned` records `pruned`, where a pruning rule stopped it (``step``,
        ``rule``, ``metric``, ``value``); no other status may carry one.

        The error and traceback are free text: NUL in them is stored as U+FFFD (PostgreSQL
        refuses NUL, and the run would stay `running` with its real error lost), and any
        credential they quote (a store URL's password, a token) as ``***``, as in the logs.
        """
        check_pruned(status, pruned)
        self.active.discard(run_id)
        let_go(self.url, run_id)
        add = check_tags(tags)
        with transaction(self.engine) as conn:
            values = {
                "status": status,
                "pruned": pruned,
                "error": _free_text(error),
                "traceback": _free_text(traceback),
                "summary": summary,
                "callback_errors": _failures(callback_errors),
                "ended_at": _now(),
            }
            done = conn.execute(
                update(SqlRun.__table__, tuple(values), "run_id"), {**values, "run_id": run_id}
            ).rowcount
            if not done:
                raise _no_run(run_id)
            if add or notes is not None:
                where = SqlRun.run_id == run_id
                annotate(conn, self.dialect, SqlRun, where, add=add, remove=[], notes=notes)

    def set_provenance(self, run_id: int, provenance: dict[str, Any]) -> None:
        """Record a run's provenance after its start: `SqlLogger` starts a run while git is
        still being read, so the run's first steps never wait for git's processes."""
        with transaction(self.engine) as conn:
            stmt = update(SqlRun.__table__, ("provenance",), "run_id")
            if not conn.execute(stmt, {"provenance": provenance, "run_id": run_id}).rowcount:
                raise _no_run(run_id)

    def set_callback_errors(self, run_id: int, callback_errors: list[dict[str, Any]]) -> None:
        """Replace the callback failures recorded on a run."""
        with transaction(self.engine) as conn:
            done = conn.execute(
                sa.update(SqlRun)
                .where(SqlRun.run_id == run_id)
                .values(callback_errors=_failures(callback_errors))
            ).rowcount
        if not done:
            raise _no_run(run_id)


def _claimed_row(conn: Connection, experiment_id: int, run_key: str) -> dict[str, Any]:
    """The row of run `run_key` of an experiment that another process claimed first: what
    `RunWrites._claim` judges (its status, owner, times, hash, and the experiment's name)."""
    return dict(
        conn.execute(
            sa.select(SqlRun.run_id, SqlRun.status, SqlRun.summary, SqlRun.host,
                      SqlRun.pid, SqlRun.process_start, SqlRun.boot_id,
                      SqlRun.started_at, SqlRun.heartbeat_at, SqlRun.config_hash,
                      SqlExperiment.name)
            .join(SqlExperiment, SqlExperiment.experiment_id == SqlRun.experiment_id)
            .where(SqlRun.experiment_id == experiment_id, SqlRun.run_key == run_key)
        ).mappings().one()
    )  # fmt: skip


def _no_run(run_id: int) -> NoRun:
    return NoRun(f"no run with id {run_id} in the store; lab show EXPERIMENT lists its runs")


def _check_run(conn: Connection, run_id: int) -> None:
    """Raise `NoRun` unless the store holds run `run_id`: a write that changed no row
    because the run does not exist is refused, never acknowledged."""
    if conn.execute(sa.select(SqlRun.run_id).where(SqlRun.run_id == run_id)).first() is None:
        raise _no_run(run_id)
