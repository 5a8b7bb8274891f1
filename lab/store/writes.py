"""Writes to the store: experiments, arms, groups, the claim and the end of a run, metrics
(through the buffered writer), evals with their predictions, checkpoint rows, tags.

Metrics are buffered (see `lab.store.writer`); every other write is one short transaction.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from lab._json import floats_back
from lab._metrics import as_number, check_key
from lab._names import MAX_KEY, MAX_NAME, check_name, check_tags, storable_text
from lab._reuse import busy_message
from lab.errors import ConfigError, NoExperiment, NoRun, RunBusy
from lab.store._values import _failures, _free_text, _now, _text
from lab.store.crashes import _DRIVING, hold, let_go
from lab.store.engine import dumps_json, transaction
from lab.store.liveness import this_owner
from lab.store.metric_rows import OWNER, Driving, MetricRows
from lab.store.schema import (
    SqlArm,
    SqlCheckpoint,
    SqlEval,
    SqlExperiment,
    SqlGroup,
    SqlHistogram,
    SqlImage,
    SqlMetric,
    SqlRun,
)
from lab.store.statements import update, upsert

if TYPE_CHECKING:
    from lab.records import EvalResult, ManifestRow

_PREDICTION_FIELDS = ("example_id", "input", "output", "target", "score")


#: Whether a run has any row that `truncate_run` would drop: a run that starts afresh
#: (most runs) has none, and is spared seven deletes and the summaries' recount.
_RUN_HAS_ROWS = " UNION ALL ".join(
    f"SELECT 1 FROM (SELECT 1 FROM {table} WHERE run_id = {{m}} LIMIT 1) AS {table}"
    for table in ("metrics", "summaries", "metric_blocks", "evals", "checkpoints",
                  "histograms", "images")
)  # fmt: skip


_PREDICTION_INSERT = (
    "INSERT INTO predictions (eval_id, idx, example_id, input, output, target, score, extras) "
    "VALUES ({m}, {m}, {m}, {m}, {m}, {m}, {m}, {m})"
)


class Writes:
    """The writing part of `lab.store.Store`."""

    url: str
    engine: Engine
    dialect: str
    _good_keys: set[str]
    _prediction_insert: str
    _run_has_rows: str
    metric_rows: MetricRows
    _driving: set[int]
    _driven_at: float
    heartbeat_s: float

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
            exp_id = self._upsert(conn, SqlExperiment, values, ["name"], "experiment_id")
            if add or notes is not None:
                where = SqlExperiment.experiment_id == exp_id
                self._annotate(conn, SqlExperiment, where, add=add, remove=[], notes=notes)
        if owner is None:
            self._driving.add(exp_id)
            _DRIVING.add((self.url, exp_id))
            _ = self.writer  # started now: it keeps the experiment's heartbeat
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
            return self._upsert(conn, SqlArm, values, ["experiment_id", "name"], "arm_id")

    def add_group(
        self, experiment_id: int, name: str, *, kind: str = "repeats", arm_id: int | None = None
    ) -> int:
        """Record a group of runs; returns its id."""
        check_name("group", name, MAX_NAME)
        values = {"experiment_id": experiment_id, "name": name, "kind": kind, "arm_id": arm_id}
        with transaction(self.engine) as conn:
            return self._upsert(conn, SqlGroup, values, ["experiment_id", "name"], "group_id")

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
        anyone while the row is `running` under a live process (see `_owner_gone`). A run
        claimed earlier with `claim_run` passes its id as `claimed`: this process (a worker,
        say) then takes the row over. What the run recorded earlier stays until its training
        starts: `truncate_run` then drops all of it for a fresh start, or what lies after
        the checkpoint for a resume. `owner` (host, pid, process_start, boot_id) names the
        process that trains the run when it is not this one (a `lab serve` client).
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
            run_id = claimed
        else:
            run_id, _finished = self._claim(values, ("completed", "failed", "stopped", "crashed"))
            assert run_id is not None
        self._active.add(run_id)
        hold(self.url, run_id)
        _ = self.writer  # started now: it keeps the heartbeat while the run is quiet
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
    ) -> tuple[int | None, dict[str, Any] | None]:
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
    ) -> tuple[int | None, dict[str, Any] | None]:
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
            row = dict(
                conn.execute(
                    sa.select(SqlRun.run_id, SqlRun.status, SqlRun.summary, SqlRun.host,
                              SqlRun.pid, SqlRun.process_start, SqlRun.boot_id,
                              SqlRun.started_at, SqlRun.heartbeat_at, SqlRun.config_hash,
                              SqlExperiment.name)
                    .join(SqlExperiment, SqlExperiment.experiment_id == SqlRun.experiment_id)
                    .where(SqlRun.experiment_id == values["experiment_id"],
                           SqlRun.run_key == values["run_key"])
                ).mappings().one()
            )  # fmt: skip
            where = f"run {values['run_key']} of experiment {row['name']!r}"
            if row["status"] == "running":
                owner = (row["run_id"], row["host"], row["pid"], row["process_start"],
                         row["boot_id"], row["heartbeat_at"])  # fmt: skip
                if self._owner_gone(*owner) is None:
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

    def log_metrics(self, run_id: int, step: int, metrics: dict[str, Any]) -> None:
        """Queue one step's metrics; waits only while the buffer is full.

        Values must be numbers: ints, floats, numpy scalars and one-element tensors are
        taken (NaN and inf included); anything else raises `MetricError` naming the key and
        the step, and nothing of that step is queued. A copy is queued, so changing the dict
        afterwards changes nothing written.
        """
        row = {}
        good = self._good_keys
        for key, value in metrics.items():
            if key not in good:
                self._check_key(key, step)
            row[key] = value if type(value) is float else as_number(key, step, value)
        self.writer.put(run_id, step, row, time.time())

    def _check_key(self, key: Any, step: int) -> None:
        check_key(key, step)
        self._good_keys.add(key)

    def write_metric_columns(
        self,
        run_ids: Sequence[int],
        steps: Sequence[int],
        keys: Sequence[str],
        values: Sequence[float],
        wall_times: Sequence[float],
    ) -> None:
        """Write metric rows given as columns, now, in one transaction (with their
        summaries): what `lab serve` does with a batch a client sent, whose keys and values
        it has checked. The buffered `log_metrics` is the way for a training loop."""
        self.metric_rows.write_columns(run_ids, steps, keys, values, wall_times)

    def _driving_due(self) -> Driving | None:
        """The experiments this process drives whose heartbeat is due (every half
        `heartbeat_s`), with this process as their driver; None when none is."""
        if not self._driving:
            return None
        now = time.monotonic()
        if now - self._driven_at < self.heartbeat_s / 2:
            return None
        self._driven_at = now
        return sorted(self._driving), this_owner()

    def write_eval(
        self, run_id: int, result: EvalResult, predictions: list[dict[str, Any]] | None = None
    ) -> int:
        """Record an eval and its predictions, replacing an earlier one at the same step.

        An eval is keyed by (run, name, step), step None meaning after training: writing one
        again (a re-run, a resumed run scoring the same step) deletes the earlier row and,
        by cascade, its predictions, in the same transaction, so readers never see both.
        The predictions go in as one batched insert, `idx` in list order. The name is checked
        like an `Evaluator`'s; NUL in the error text is stored as U+FFFD.
        """
        check_name("eval", result.name, MAX_KEY)
        same = sa.and_(
            SqlEval.run_id == run_id,
            SqlEval.name == result.name,
            SqlEval.step.is_(None) if result.step is None else SqlEval.step == result.step,
        )
        with transaction(self.engine) as conn:
            conn.execute(sa.delete(SqlEval).where(same))
            eval_id = conn.execute(
                sa.insert(SqlEval)
                .values(
                    run_id=run_id,
                    name=result.name,
                    step=result.step,
                    metrics=result.metrics,
                    breakdowns=result.breakdowns,
                    tags=result.tags,
                    seconds=result.seconds,
                    error=_free_text(result.error),
                    created_at=_now(),
                )
                .returning(SqlEval.eval_id)
            ).scalar_one()
            if predictions:  # plain tuples through the driver: no per-row dict to compile
                conn.exec_driver_sql(
                    self._prediction_insert,
                    [_prediction_row(eval_id, i, p) for i, p in enumerate(predictions)],
                )
        return eval_id

    def write_checkpoint(self, run_id: int, row: ManifestRow) -> None:
        """Record one manifest row (a save or a removal)."""
        with transaction(self.engine) as conn:
            conn.execute(
                sa.insert(SqlCheckpoint).values(
                    run_id=run_id,
                    step=row.step,
                    path=row.path,
                    event=row.event,
                    metrics=row.metrics,
                    reason=row.reason,
                    created_at=datetime.fromtimestamp(row.time, UTC).replace(tzinfo=None),
                )
            )

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
    ) -> None:
        """Record a run's final status, error and final metrics; `tags` join the run's
        tags and `notes`, when given, replace its notes (what `train(run)` set).

        The error and traceback are free text: NUL in them is stored as U+FFFD (PostgreSQL
        refuses NUL, and the run would stay `running` with its real error lost), and any
        credential they quote (a store URL's password, a token) as ``***``, as in the logs.
        """
        self._active.discard(run_id)
        let_go(self.url, run_id)
        add = check_tags(tags)
        with transaction(self.engine) as conn:
            values = {
                "status": status,
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
                self._annotate(conn, SqlRun, where, add=add, remove=[], notes=notes)

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
        self._driving.discard(experiment_id)
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

    def tag(
        self,
        experiment: str,
        run_key: str | None = None,
        *,
        add: Sequence[str] = (),
        remove: Sequence[str] = (),
        notes: str | None = None,
    ) -> dict[str, Any]:
        """Add and remove tags of an experiment (or of one of its runs), and set its notes
        (``""`` clears them); returns its tags and notes as they are now.

        Tags are plain strings, as in W&B: kept in the order they were added, each once.
        An unknown experiment or run is a `NoExperiment` / `NoRun` that lists the known ones.
        """
        add, remove = check_tags(add), check_tags(remove)
        with transaction(self.engine) as conn:
            exp_id = self.experiment_id(conn, experiment)
            if run_key is None:
                where = SqlExperiment.experiment_id == exp_id
                return self._annotate(conn, SqlExperiment, where, add, remove, notes)
            where = sa.and_(SqlRun.experiment_id == exp_id, SqlRun.run_key == run_key)
            if conn.execute(sa.select(SqlRun.run_id).where(where)).first() is None:
                keys = conn.execute(
                    sa.select(SqlRun.run_key).where(SqlRun.experiment_id == exp_id)
                ).scalars().all()  # fmt: skip
                raise NoRun(
                    f"experiment {experiment!r} has no run {run_key!r}; its runs: "
                    f"{', '.join(sorted(keys)) or 'none'}"
                )
            return self._annotate(conn, SqlRun, where, add, remove, notes)

    def _annotate(
        self,
        conn: Connection,
        model: Any,
        where: Any,
        add: list[str],
        remove: list[str],
        notes: str | None,
    ) -> dict[str, Any]:
        """Change one row's tags and notes inside the caller's write transaction."""
        read = sa.select(model.tags, model.notes).where(where)
        if self.dialect == "postgresql":
            read = read.with_for_update()  # SQLite: the transaction holds the write lock
        current, old_notes = conn.execute(read).one()
        tags = [t for t in current or [] if t not in remove]
        tags += [t for t in dict.fromkeys(add) if t not in tags]
        values: dict[str, Any] = {"tags": tags or None}
        if notes is not None:  # free text: NUL as U+FFFD, as in errors
            values["notes"] = storable_text(notes) or None
        conn.execute(sa.update(model).where(where).values(**values))
        return {"tags": tags, "notes": values.get("notes", old_notes)}

    def delete_experiment(self, name: str) -> dict[str, Any]:
        """Delete an experiment and, by cascade, its arms, groups, runs (superseded ones
        too), metrics, summaries, evals, predictions, checkpoint, histogram and image rows,
        in one transaction. Run folders are files, not rows: they stay, and are returned
        (``folders``, sorted) with the number of runs deleted (``runs``). Refused with
        `RunBusy` while a live process trains one of its runs."""
        with transaction(self.engine) as conn:
            exp_id = self.experiment_id(conn, name)
            for run in conn.execute(
                sa.select(SqlRun.run_id, SqlRun.run_key, SqlRun.host, SqlRun.pid,
                          SqlRun.process_start, SqlRun.boot_id, SqlRun.started_at,
                          SqlRun.heartbeat_at)
                .where(SqlRun.experiment_id == exp_id, SqlRun.status == "running")
            ).mappings():  # fmt: skip
                owner = (run["run_id"], run["host"], run["pid"], run["process_start"],
                         run["boot_id"], run["heartbeat_at"])  # fmt: skip
                if self._owner_gone(*owner) is None:
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
            exp_id = self.experiment_id(conn, old)
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


def _no_run(run_id: int) -> NoRun:
    return NoRun(f"no run with id {run_id} in the store; lab show EXPERIMENT lists its runs")


def _check_run(conn: Connection, run_id: int) -> None:
    """Raise `NoRun` unless the store holds run `run_id`: a write that changed no row
    because the run does not exist is refused, never acknowledged."""
    if conn.execute(sa.select(SqlRun.run_id).where(SqlRun.run_id == run_id)).first() is None:
        raise _no_run(run_id)


def _prediction_row(eval_id: int, idx: int, pred: dict[str, Any]) -> tuple[Any, ...]:
    """One prediction as the driver's parameters: the known fields, the rest as JSON.

    A NaN score is stored as NULL (no score) on both backends. SQLite cannot keep a NaN
    apart from NULL, and a score column that held NaN on PostgreSQL only would make the
    same eval average to NaN there and to a number on SQLite. ±inf is kept.
    """
    get = pred.get
    extras = {k: v for k, v in pred.items() if k not in _PREDICTION_FIELDS}
    example_id = get("example_id")
    score = get("score")
    if score is not None:
        score = float(score)
        if score != score:  # NaN
            score = None
    return (
        eval_id,
        idx,
        None if example_id is None else _text(str(example_id)),
        _text(get("input")),
        _text(get("output")),
        _text(get("target")),
        score,
        dumps_json(extras) if extras else None,
    )
