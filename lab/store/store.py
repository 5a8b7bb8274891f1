"""`Store`: every write and read of the SQL store goes through here.

Writes of metrics are buffered (see `lab.store.writer`); every other write is one short
transaction. Reads return plain dicts: the ORM rows never leave this package.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from lab._json import floats_back
from lab._metrics import as_number, check_key
from lab._names import MAX_KEY, MAX_NAME, check_name, storable_text
from lab._reuse import busy_message
from lab._secrets import mask
from lab.errors import ConfigError, NoExperiment, NoRun, RunBusy
from lab.store.engine import (
    check_reachable,
    connect,
    dumps_json,
    make_engine,
    mark_older,
    resolve_url,
    transaction,
)
from lab.store.liveness import START_TOLERANCE_S, boot_id, owner_gone, process_start
from lab.store.media import MediaRows
from lab.store.migrations import ensure_schema, head_revision, readable_revision
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
    SqlSummary,
)
from lab.store.writer import MetricItem, MetricWriter

if TYPE_CHECKING:
    from lab.loop.checkpoints import ManifestRow
    from lab.loop.evals import EvalResult

_PREDICTION_FIELDS = ("example_id", "input", "output", "target", "score")
HEARTBEAT_S = 30.0  # how often a running run's heartbeat is refreshed, at the least
STALE_AFTER_S = 300.0  # a `running` run not seen for this long is `crashed`
_INF = math.inf
# (store URL, run id) of every run this process claimed and has not finished: a `running`
# row of this very pid that is not here was left behind (an earlier attempt in this process
# that could not record its end), not trained now.
_HELD: set[tuple[str, int]] = set()


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def _text(value: Any) -> str | None:
    """A prediction's text field: a string as it is, anything else as its JSON text.

    PostgreSQL text cannot hold NUL, and an insert that holds one fails the whole eval (and,
    through the SQL logger, the run); so NUL becomes U+FFFD, on both backends alike.
    """
    if value is None:
        return None
    return storable_text(value if isinstance(value, str) else dumps_json(value))


class Store:
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
                self.revision = readable_revision(self.engine)
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
        #: Histogram and image rows (`lab.store.media`): queued like metrics, flushed with them.
        self.media = MediaRows(self.engine, give_up_s=give_up_s)
        self._active: set[int] = set()  # runs started here and not finished: heartbeats
        self._good_keys: set[str] = set()  # metric keys checked already
        mark = "%s" if self.dialect == "postgresql" else "?"
        self._metric_upsert = _METRIC_UPSERT.format(m=mark)
        self._summary_upsert = _SUMMARY_UPSERT.format(m=mark)
        self._prediction_insert = _PREDICTION_INSERT.format(m=mark)
        # Built once: the writer runs these with every batch, and building a statement
        # costs more than running it.
        ids = sa.bindparam("ids", expanding=True)
        self._beat = (
            sa.update(SqlRun)
            .where(SqlRun.run_id.in_(ids), SqlRun.status == "running")
            .values(heartbeat_at=sa.bindparam("now"))
        )
        self._last_steps = sa.select(SqlSummary.run_id, SqlSummary.key, SqlSummary.last_step).where(
            SqlSummary.run_id.in_(ids)
        )
        if migrate:
            self.mark_crashed()

    def __repr__(self) -> str:
        return f"Store({self.engine.url.render_as_string(hide_password=True)!r})"

    # -- plumbing ----------------------------------------------------------------------------
    def _insert(self, table: Any) -> Any:
        module = postgresql if self.dialect == "postgresql" else sqlite
        return module.insert(table)

    def _upsert(self, conn: Connection, model: type, values: dict, keys: list[str], pk: str) -> int:
        """Insert `values`, or update the row with the same `keys`; returns its primary key."""
        stmt = self._insert(model)
        updates = {k: stmt.excluded[k] for k in values if k not in keys}
        stmt = stmt.values(**values).on_conflict_do_update(index_elements=keys, set_=updates)
        return conn.execute(stmt.returning(getattr(model, pk))).scalar_one()

    @property
    def writer(self) -> MetricWriter:
        """The background metric writer, started on first use."""
        if self._writer is None:
            with self._writer_lock:
                if self._writer is None:
                    self._writer = MetricWriter(
                        self._write_metrics, give_up_s=self.give_up_s, idle_s=self.heartbeat_s
                    )
        return self._writer

    def flush(self) -> None:
        """Make every metric logged so far durable; raises `StoreError` when they could not
        be written yet (they are kept, and retried in the background)."""
        if self._writer is not None:
            self._writer.flush()
        self.media.flush()

    def close(self) -> None:
        """Flush and stop the writer, and release the connections."""
        try:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            self.media.close()
        finally:
            self.engine.dispose()

    # -- writes ------------------------------------------------------------------------------
    def begin_experiment(
        self,
        name: str,
        *,
        config: dict[str, Any],
        seed: int,
        repeats: int,
        tags: Sequence[str] = (),
        notes: str | None = None,
    ) -> int:
        """Create the experiment, or reopen the one of that name; returns its id.

        `tags` join the experiment's tags (those added earlier, by ``lab tag`` too, stay);
        `notes`, when given, replace its notes.
        """
        check_name("experiment", name, MAX_NAME)
        values = {
            "name": name,
            "status": "running",
            "config": config,
            "seed": seed,
            "repeats": repeats,
            "callback_errors": None,
            "ended_at": None,
        }
        add = check_tags(tags)
        with transaction(self.engine) as conn:
            exp_id = self._upsert(conn, SqlExperiment, values, ["name"], "experiment_id")
            if add or notes is not None:
                where = SqlExperiment.experiment_id == exp_id
                self._annotate(conn, SqlExperiment, where, add=add, remove=[], notes=notes)
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
        the checkpoint for a resume.
        """
        values = self._run_values(
            experiment_id, group_id, run_key=run_key, arm_id=arm_id, repeat=repeat,
            stage=stage, seed=seed, config=config, output_dir=output_dir,
            parent_run_id=parent_run_id, config_hash=config_hash, provenance=provenance,
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
        _HELD.add((self.url, run_id))
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
    ) -> tuple[int | None, dict[str, Any] | None]:
        """Claim a run that an experiment is about to train, atomically; ``(run_id, None)``
        when this process won it.

        Only a new run, a `failed` or `crashed` one, or a `running` one whose process is
        gone can be claimed. A run that another process finished meanwhile comes back as
        ``(None, its record)`` (status and final metrics) to be reused; one that a live
        process holds raises `RunBusy`; one recorded meanwhile with another `config_hash`
        raises `ConfigError`.
        """
        values = self._run_values(
            experiment_id, group_id, run_key=run_key, arm_id=arm_id, repeat=repeat,
            stage=stage, seed=seed, config=config, output_dir=output_dir,
            parent_run_id=parent_run_id, config_hash=config_hash, provenance=None,
        )  # fmt: skip
        return self._claim(values, ("failed", "crashed"))

    def _run_values(
        self, experiment_id: int, group_id: int, *, run_key: str, arm_id: int | None,
        repeat: int, stage: int, seed: int, config: dict[str, Any], output_dir: str | None,
        parent_run_id: int | None, config_hash: str | None, provenance: dict[str, Any] | None,
    ) -> dict[str, Any]:  # fmt: skip
        check_name("run key", run_key, MAX_KEY)
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
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process_start": process_start(),
            "boot_id": boot_id(),
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
        stmt = self._insert(SqlRun).values(**values)
        updates = {k: stmt.excluded[k] for k in values if k not in keys}
        cond = SqlRun.status.in_(reclaim)
        if values["config_hash"] is not None:
            same = sa.or_(SqlRun.config_hash.is_(None), SqlRun.config_hash == values["config_hash"])
            cond = sa.and_(cond, same)
        stmt = stmt.on_conflict_do_update(index_elements=keys, set_=updates, where=cond)
        with transaction(self.engine) as conn:
            run_id = conn.execute(stmt.returning(SqlRun.run_id)).scalar_one_or_none()
            if run_id is not None:
                _HELD.add((self.url, run_id))
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
                    _HELD.add((self.url, row["run_id"]))
                    return row["run_id"], None
                raise RunBusy(f"{where} was just claimed by another process; run again")
            if (
                values["config_hash"] is not None
                and row["config_hash"] is not None
                and row["config_hash"] != values["config_hash"]
            ):
                raise ConfigError(
                    f"{where} was just recorded with other settings by another process; use a "
                    "new experiment name, or start afresh with fresh=True (--fresh on the "
                    "command line)"
                )
        return None, {"status": row["status"], "summary": floats_back(row["summary"] or {})}

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

    def release_run(self, run_id: int, error: str) -> None:
        """Record a run this process claimed and never started as `failed` with `error`;
        nothing changes once another process (a worker) took it over, or it ended."""
        _HELD.discard((self.url, run_id))
        with transaction(self.engine) as conn:
            conn.execute(
                sa.update(SqlRun)
                .where(
                    SqlRun.run_id == run_id,
                    SqlRun.status == "running",
                    SqlRun.pid == os.getpid(),
                    SqlRun.host == socket.gethostname(),
                )
                .values(status="failed", error=_free_text(error), ended_at=_now())
            )

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

    def find_run(self, experiment_id: int, run_key: str) -> int | None:
        """The id of an experiment's run by its key, if it was recorded."""
        with connect(self.engine) as conn:
            return conn.execute(
                sa.select(SqlRun.run_id).where(
                    SqlRun.experiment_id == experiment_id, SqlRun.run_key == run_key
                )
            ).scalar_one_or_none()

    def previous_runs(self, experiment: str) -> dict[str, dict[str, Any]]:
        """An experiment's current (not superseded) runs by run key, if any: status, seed,
        stage, config, config hash, final metrics, owner, and the experiment's recorded
        train function (``train``), so a later attempt can tell whether it may reuse them."""
        with connect(self.engine) as conn:
            rows = (
                conn.execute(
                    sa.select(
                        SqlRun.run_key,
                        SqlRun.status,
                        SqlRun.seed,
                        SqlRun.stage,
                        SqlRun.config,
                        SqlRun.config_hash,
                        SqlRun.summary,
                        SqlRun.host,
                        SqlRun.pid,
                        SqlRun.started_at,
                        SqlExperiment.config.label("experiment_config"),
                    )
                    .join(SqlExperiment, SqlExperiment.experiment_id == SqlRun.experiment_id)
                    .where(SqlExperiment.name == experiment, SqlRun.superseded_at.is_(None))
                )
                .mappings()
                .all()
            )
        out = {}
        for r in rows:
            row = {k: v for k, v in r.items() if k != "experiment_config"}
            row["summary"] = floats_back(r["summary"] or {})
            row["train"] = (r["experiment_config"] or {}).get("train")
            out[r["run_key"]] = row
        return out

    def current_runs(self, experiment: str) -> list[dict[str, Any]]:
        """An experiment's runs that are not superseded: id, key, status, folder, owner."""
        with connect(self.engine) as conn:
            return [
                dict(r)
                for r in conn.execute(
                    sa.select(SqlRun.run_id, SqlRun.run_key, SqlRun.status, SqlRun.output_dir,
                              SqlRun.host, SqlRun.pid, SqlRun.started_at)
                    .join(SqlExperiment, SqlExperiment.experiment_id == SqlRun.experiment_id)
                    .where(SqlExperiment.name == experiment, SqlRun.superseded_at.is_(None))
                    .order_by(SqlRun.run_id)
                ).mappings()
            ]  # fmt: skip

    def run_keys(self, experiment: str) -> list[str]:
        """Every run key of an experiment, superseded ones included."""
        with connect(self.engine) as conn:
            return list(
                conn.execute(
                    sa.select(SqlRun.run_key)
                    .join(SqlExperiment, SqlExperiment.experiment_id == SqlRun.experiment_id)
                    .where(SqlExperiment.name == experiment)
                ).scalars()
            )

    def supersede_run(self, run_id: int, run_key: str, output_dir: str | None) -> None:
        """Mark a run superseded (kept, left out of every reader) under a new key and
        folder; a run that is running, or superseded already, raises `RunBusy`."""
        with transaction(self.engine) as conn:
            done = conn.execute(
                sa.update(SqlRun)
                .where(SqlRun.run_id == run_id, SqlRun.superseded_at.is_(None),
                       SqlRun.status != "running")
                .values(superseded_at=_now(), run_key=run_key, output_dir=output_dir)
            ).rowcount  # fmt: skip
        if done != 1:
            raise RunBusy(f"run {run_key} started or was superseded meanwhile; run again")

    def last_step(self, run_id: int) -> int | None:
        """The newest step a run logged a metric at, or None; queued metrics count (they
        are flushed first)."""
        self.flush()
        with connect(self.engine) as conn:
            return conn.execute(
                sa.select(sa.func.max(SqlSummary.last_step)).where(SqlSummary.run_id == run_id)
            ).scalar_one()

    def truncate_run(self, run_id: int, after_step: int | None = None) -> None:
        """Drop a run's metrics, evals (with predictions), checkpoint, histogram and image
        rows after a step (image files stay: a step trained again writes its file anew).

        ``after_step=None`` drops all of them: a run that starts again from nothing replaces
        its earlier record. A run resumed from the checkpoint at step N keeps what it logged
        up to N, and the steps it trains again are written anew, never twice. Post-training
        evals (step NULL) always go: they run again at the end. So do the metrics they wrote
        (``<eval>/<key>`` at the run's last step), even when that step is N.
        """
        self.flush()
        with transaction(self.engine) as conn:
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
            self._resummarize(conn, run_id)

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

    def _write_metrics(self, items: list[MetricItem]) -> None:
        # Plain tuples through the driver's executemany: the writer thread holds the GIL
        # as briefly as it can. SQLite stores a NaN value as NULL (see lab.store.schema).
        rows: list[tuple[Any, ...]] = []
        append = rows.append
        # Per run and key: [count, first step, last step, last value, min, max, wall time].
        # min and max start at +inf and -inf; NaN never compares, so it never enters them,
        # and min > max at the end means every point was NaN.
        acc: dict[int, dict[str, list[Any]]] = {}
        for run_id, step, metrics, wall_time in items:
            per = acc.get(run_id)
            if per is None:
                per = acc[run_id] = {}
            for key, value in metrics.items():
                append((run_id, key, step, value, wall_time))
                s = per.get(key)
                if s is None:
                    s = per[key] = [0, step, step, value, _INF, -_INF, wall_time]
                s[0] += 1
                if step >= s[2]:
                    s[2], s[3], s[6] = step, value, wall_time
                elif step < s[1]:
                    s[1] = step
                if value < s[4]:
                    s[4] = value
                if value > s[5]:
                    s[5] = value
        beating = set(acc) | self._active
        if not rows and not beating:
            return
        with transaction(self.engine) as conn:
            if rows:
                conn.exec_driver_sql(self._metric_upsert, rows)
                self._summarize(conn, acc)
            if beating:
                conn.execute(self._beat, {"ids": sorted(beating), "now": _now()})

    def _summarize(self, conn: Connection, acc: dict[int, dict[str, list[Any]]]) -> None:
        """Fold a batch into `summaries`. A batch that only extends a series (its first step
        after the stored last step) is merged in place; one that logs a step again, which
        may replace a min, a max or the last value, is recomputed from `metrics`."""
        known = {
            (run_id, key): last
            for run_id, key, last in conn.execute(self._last_steps, {"ids": list(acc)})
        }
        merge = []
        again: dict[int, list[str]] = {}
        for run_id, per in acc.items():
            for key, (n, first, last, value, lo, hi, wall) in per.items():
                stored = known.get((run_id, key))
                if stored is not None and first <= stored:
                    again.setdefault(run_id, []).append(key)
                    continue
                if lo > hi:  # every point was NaN
                    lo = hi = None
                merge.append((run_id, key, n, first, last, value, lo, hi, wall))
        if merge:
            conn.exec_driver_sql(self._summary_upsert, merge)
        for run_id, keys in again.items():
            self._resummarize(conn, run_id, keys)

    def _resummarize(self, conn: Connection, run_id: int, keys: list[str] | None = None) -> None:
        """Rebuild a run's summaries (or some keys' of them) from its metrics."""
        where = [SqlSummary.run_id == run_id]
        if keys is not None:
            where.append(SqlSummary.key.in_(keys))
        conn.execute(sa.delete(SqlSummary).where(*where))
        finite = "" if self.dialect == "sqlite" else " FILTER (WHERE m.value <> 'NaN')"
        only = ' AND m."key" IN :keys' if keys is not None else ""
        sql = sa.text(_RESUMMARIZE.format(finite=finite, only=only))
        if keys is not None:
            sql = sql.bindparams(sa.bindparam("keys", expanding=True))
        conn.execute(sql, {"run_id": run_id, **({"keys": keys} if keys is not None else {})})

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
        _HELD.discard((self.url, run_id))
        add = check_tags(tags)
        with transaction(self.engine) as conn:
            if add or notes is not None:
                where = SqlRun.run_id == run_id
                self._annotate(conn, SqlRun, where, add=add, remove=[], notes=notes)
            conn.execute(
                sa.update(SqlRun)
                .where(SqlRun.run_id == run_id)
                .values(
                    status=status,
                    error=_free_text(error),
                    traceback=_free_text(traceback),
                    summary=summary,
                    callback_errors=_failures(callback_errors),
                    ended_at=_now(),
                )
            )

    def set_callback_errors(self, run_id: int, callback_errors: list[dict[str, Any]]) -> None:
        """Replace the callback failures recorded on a run."""
        with transaction(self.engine) as conn:
            conn.execute(
                sa.update(SqlRun)
                .where(SqlRun.run_id == run_id)
                .values(callback_errors=_failures(callback_errors))
            )

    def finish_experiment(
        self,
        experiment_id: int,
        *,
        status: str,
        callback_errors: list[dict[str, Any]] | None = None,
    ) -> None:
        """Record an experiment's final status and the failures of its experiment-level
        callbacks (NULL when there were none)."""
        with transaction(self.engine) as conn:
            conn.execute(
                sa.update(SqlExperiment)
                .where(SqlExperiment.experiment_id == experiment_id)
                .values(status=status, callback_errors=callback_errors or None, ended_at=_now())
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
            exp_id = conn.execute(
                sa.select(SqlExperiment.experiment_id).where(SqlExperiment.name == experiment)
            ).scalar_one_or_none()
            if exp_id is None:
                known = conn.execute(sa.select(SqlExperiment.name)).scalars().all()
                hint = f"; known: {', '.join(sorted(known))}" if known else ""
                raise NoExperiment(f"no experiment named {experiment!r} in the store{hint}")
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
            exp_id = self._experiment_id(conn, name)
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
            exp_id = self._experiment_id(conn, old)
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

    @staticmethod
    def _experiment_id(conn: Connection, name: str) -> int:
        found = conn.execute(
            sa.select(SqlExperiment.experiment_id).where(SqlExperiment.name == name)
        ).scalar_one_or_none()
        if found is None:
            known = conn.execute(sa.select(SqlExperiment.name)).scalars().all()
            hint = f"; known: {', '.join(sorted(known))}" if known else ""
            raise NoExperiment(f"no experiment named {name!r} in the store{hint}")
        return found

    # -- reads -------------------------------------------------------------------------------
    def list_experiments(self) -> list[dict[str, Any]]:
        """Every experiment with its status and its run counts by status, newest first.

        Superseded runs (see `Experiment(fresh=True)`) are left out of the counts and
        points; `superseded` counts them.
        """
        current = SqlRun.superseded_at.is_(None)
        counts = (
            sa.select(SqlRun.experiment_id, SqlRun.status, sa.func.count().label("n"))
            .where(current)
            .group_by(SqlRun.experiment_id, SqlRun.status)
            .subquery()
        )
        with connect(self.engine) as conn:
            experiments = (
                conn.execute(sa.select(SqlExperiment).order_by(SqlExperiment.experiment_id.desc()))
                .mappings()
                .all()
            )
            by_status: dict[int, dict[str, int]] = {}
            for exp_id, status, n in conn.execute(sa.select(counts)):
                by_status.setdefault(exp_id, {})[status] = n
            if self.readonly:  # show runs whose process is gone as crashed; never write it
                for exp_id in conn.execute(
                    sa.select(SqlRun.experiment_id).where(
                        SqlRun.run_id.in_([run_id for run_id, *_ in self._gone_runs()])
                    )
                ).scalars():
                    per = by_status[exp_id]
                    per["running"] -= 1
                    per["crashed"] = per.get("crashed", 0) + 1
                    if not per["running"]:
                        del per["running"]
            arm_counts = dict(
                conn.execute(
                    sa.select(SqlArm.experiment_id, sa.func.count()).group_by(SqlArm.experiment_id)
                ).all()
            )
            points = dict(  # from summaries: one row per run and key, however long the runs
                conn.execute(
                    sa.select(SqlRun.experiment_id, sa.func.sum(SqlSummary.count))
                    .join(SqlSummary, SqlSummary.run_id == SqlRun.run_id)
                    .where(current)
                    .group_by(SqlRun.experiment_id)
                ).all()
            )
            superseded = dict(
                conn.execute(
                    sa.select(SqlRun.experiment_id, sa.func.count())
                    .where(SqlRun.superseded_at.is_not(None))
                    .group_by(SqlRun.experiment_id)
                ).all()
            )
        return [
            {
                "name": e["name"],
                "status": e["status"],
                "arms": arm_counts.get(e["experiment_id"], 0),
                "repeats": e["repeats"],
                "runs": sum(by_status.get(e["experiment_id"], {}).values()),
                "runs_by_status": by_status.get(e["experiment_id"], {}),
                "points": int(points.get(e["experiment_id"]) or 0),
                "superseded": superseded.get(e["experiment_id"], 0),
                "created_at": e["created_at"],
                "tags": e["tags"] or [],
                "notes": e["notes"],
            }
            for e in experiments
        ]

    def get_experiment(self, name: str) -> dict[str, Any]:
        """An experiment with its tags and notes, its arms and runs (status, newest step,
        error, final metrics, tags, notes, provenance), and the failures of its
        experiment-level callbacks.

        A run's metrics are the last value of each key from `summaries` (so a running or
        crashed run shows where it got to), overlaid with the final metrics it returned.
        Superseded runs are left out; `superseded` counts them.
        """
        with connect(self.engine) as conn:
            exp = (
                conn.execute(sa.select(SqlExperiment).where(SqlExperiment.name == name))
                .mappings()
                .first()
            )
            if exp is None:
                known = conn.execute(sa.select(SqlExperiment.name)).scalars().all()
                hint = f"; known: {', '.join(sorted(known))}" if known else ""
                raise NoExperiment(f"no experiment named {name!r} in the store{hint}")
            arms = (
                conn.execute(
                    sa.select(SqlArm.name, SqlArm.overrides)
                    .where(SqlArm.experiment_id == exp["experiment_id"])
                    .order_by(SqlArm.arm_id)
                )
                .mappings()
                .all()
            )
            runs = (
                conn.execute(
                    sa.select(
                        SqlRun.run_id,
                        SqlRun.run_key,
                        SqlArm.name.label("arm"),
                        SqlRun.repeat,
                        SqlRun.stage,
                        SqlRun.seed,
                        SqlRun.status,
                        SqlRun.error,
                        SqlRun.summary,
                        SqlRun.callback_errors,
                        SqlRun.tags,
                        SqlRun.notes,
                        SqlRun.provenance,
                        SqlRun.traceback,
                        SqlRun.host,
                        SqlRun.pid,
                        SqlRun.started_at,
                        SqlRun.ended_at,
                        SqlRun.superseded_at,
                    )
                    .join(SqlArm, SqlArm.arm_id == SqlRun.arm_id, isouter=True)
                    .where(SqlRun.experiment_id == exp["experiment_id"])
                    .order_by(SqlRun.run_id)
                )
                .mappings()
                .all()
            )
            superseded = sum(1 for r in runs if r["superseded_at"] is not None)
            runs = [r for r in runs if r["superseded_at"] is None]
            latest: dict[int, dict[str, Any]] = {}
            for run_id, key, step, value in conn.execute(
                sa.select(SqlSummary.run_id, SqlSummary.key, SqlSummary.last_step,
                          SqlSummary.last_value)
                .join(SqlRun, SqlRun.run_id == SqlSummary.run_id)
                .where(SqlRun.experiment_id == exp["experiment_id"])
            ):  # fmt: skip
                per = latest.setdefault(run_id, {"step": 0, "values": {}})
                per["step"] = max(per["step"], step)
                per["values"][key] = math.nan if value is None else value
        # Read-only: a run whose process is gone is shown as crashed, never marked so.
        gone = {run_id: why for run_id, _, why, _ in self._gone_runs()} if self.readonly else {}
        return {
            "name": exp["name"],
            "status": exp["status"],
            "seed": exp["seed"],
            "repeats": exp["repeats"],
            "config": exp["config"],
            "created_at": exp["created_at"],
            "ended_at": exp["ended_at"],
            "callback_errors": exp["callback_errors"],
            "tags": exp["tags"] or [],
            "notes": exp["notes"],
            "arms": [dict(a) for a in arms],
            "runs": [_with_latest(r, latest.get(r["run_id"]), gone.get(r["run_id"])) for r in runs],
            "superseded": superseded,
        }

    def metric_values(self, run_id: int, key: str) -> list[tuple[int, float]]:
        """One run's (step, value) pairs for `key`, in step order, NaN restored."""
        with connect(self.engine) as conn:
            rows = conn.execute(
                sa.select(SqlMetric.step, SqlMetric.value)
                .where(SqlMetric.run_id == run_id, SqlMetric.key == key)
                .order_by(SqlMetric.step)
            ).all()
        return [(step, math.nan if value is None else value) for step, value in rows]


_METRIC_UPSERT = (
    'INSERT INTO metrics (run_id, "key", step, value, wall_time) '
    "VALUES ({m}, {m}, {m}, {m}, {m}) "
    'ON CONFLICT (run_id, "key", step) DO UPDATE '
    "SET value = excluded.value, wall_time = excluded.wall_time"
)
# Merges a batch that extends a series: NULL (all NaN) never replaces a stored min or max.
_SUMMARY_UPSERT = (
    'INSERT INTO summaries (run_id, "key", "count", first_step, last_step, last_value, '
    "min_value, max_value, last_wall_time) "
    "VALUES ({m}, {m}, {m}, {m}, {m}, {m}, {m}, {m}, {m}) "
    'ON CONFLICT (run_id, "key") DO UPDATE SET '
    '"count" = summaries."count" + excluded."count", '
    "last_step = excluded.last_step, last_value = excluded.last_value, "
    "last_wall_time = excluded.last_wall_time, "
    "min_value = CASE WHEN summaries.min_value IS NULL OR excluded.min_value < "
    "summaries.min_value THEN excluded.min_value ELSE summaries.min_value END, "
    "max_value = CASE WHEN summaries.max_value IS NULL OR excluded.max_value > "
    "summaries.max_value THEN excluded.max_value ELSE summaries.max_value END"
)


# Rebuilds summaries from metrics. PostgreSQL keeps NaN and orders it above inf, so its
# min and max filter NaN out; SQLite stores NaN as NULL, which min and max skip anyway.
_RESUMMARIZE = """
INSERT INTO summaries (run_id, "key", "count", first_step, last_step, last_value,
                       min_value, max_value, last_wall_time)
SELECT m.run_id, m."key", count(*), min(m.step), max(m.step),
       (SELECT l.value FROM metrics l WHERE l.run_id = m.run_id AND l."key" = m."key"
        ORDER BY l.step DESC LIMIT 1),
       min(m.value){finite}, max(m.value){finite},
       (SELECT l.wall_time FROM metrics l WHERE l.run_id = m.run_id AND l."key" = m."key"
        ORDER BY l.step DESC LIMIT 1)
FROM metrics m
WHERE m.run_id = :run_id{only}
GROUP BY m.run_id, m."key"
"""


_PREDICTION_INSERT = (
    "INSERT INTO predictions (eval_id, idx, example_id, input, output, target, score, extras) "
    "VALUES ({m}, {m}, {m}, {m}, {m}, {m}, {m}, {m})"
)


def _free_text(text: str | None) -> str | None:
    """An error or a traceback as the store keeps it: credentials masked, NUL as U+FFFD."""
    return storable_text(mask(text)) if text else text


def _failures(failures: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Callback failures as the store keeps them: their error and traceback masked."""
    if not failures:
        return None
    return [
        {k: mask(v) if k in ("error", "traceback") and isinstance(v, str) else v
         for k, v in f.items()}
        for f in failures
    ]  # fmt: skip


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


TAG_LIMIT = 64  # characters in one tag, as W&B


def check_tags(tags: Sequence[str] | str) -> list[str]:
    """Tags as a list, each checked: a non-empty string of at most `TAG_LIMIT` characters,
    with no whitespace, and not starting with ``+`` or ``-`` (``lab tag`` reads those as
    add and remove). A `ConfigError` names the bad one."""
    if isinstance(tags, str):
        raise ConfigError(f"tags={tags!r}: give a list of tags, e.g. [{tags!r}]")
    out = []
    for tag in tags:
        if (
            not isinstance(tag, str)
            or not tag
            or len(tag) > TAG_LIMIT
            or tag[0] in "+-"
            or any(c.isspace() or not c.isprintable() for c in tag)
        ):
            raise ConfigError(
                f"tag {tag!r}: use 1 to {TAG_LIMIT} printable characters, no spaces, not "
                "starting with + or -"
            )
        out.append(tag)
    return out


def _with_latest(run: Any, latest: dict[str, Any] | None, gone: str | None) -> dict[str, Any]:
    """A run's record with its newest step and its metrics' last values from `summaries`,
    then the final metrics the run returned (which add post-training evals) over them;
    `gone`: why a `running` run is crashed, when a read-only store shows it so."""
    values = dict(latest["values"]) if latest else {}
    values.update(floats_back(run["summary"] or {}))
    fields = {k: v for k, v in run.items() if k != "superseded_at"}
    shown = {
        **fields,
        "step": latest["step"] if latest else None,
        "summary": values,
        "tags": run["tags"] or [],
    }
    if gone is not None:
        shown.update(status="crashed", error=gone)
    return shown
