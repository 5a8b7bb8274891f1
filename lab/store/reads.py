"""Reads of the store that recording needs: an experiment's runs, their keys, steps and
metrics, as plain dicts (no row object leaves this package). What ``lab ls`` and
``lab show`` read is `lab.store.listing`."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from lab._json import floats_back
from lab.errors import NoExperiment
from lab.store.engine import connect
from lab.store.schema import SqlExperiment, SqlMetric, SqlRun, SqlSummary

if TYPE_CHECKING:
    from lab.store.records import CurrentRun, PreviousRun


class Reads:
    """The reading part of `lab.store.Store`: the store behind `engine`; `flush` makes what
    the store has queued durable (a run's last step counts the metrics queued for it)."""

    def __init__(self, engine: Engine, flush: Callable[[], None]) -> None:
        self.engine = engine
        self.flush = flush

    def find_run(self, experiment_id: int, run_key: str) -> int | None:
        """The id of an experiment's run by its key, if it was recorded."""
        with connect(self.engine) as conn:
            return conn.execute(
                sa.select(SqlRun.run_id).where(
                    SqlRun.experiment_id == experiment_id, SqlRun.run_key == run_key
                )
            ).scalar_one_or_none()

    def previous_runs(self, experiment: str) -> dict[str, PreviousRun]:
        """An experiment's current (not superseded) runs by run key, if any: status, seed,
        stage, config, config hash, final metrics, owner, a pruned run's stop (``pruned``)
        and the experiment's recorded train function (``train``), so a later attempt can
        tell whether it may reuse them, and reuse them as they ended."""
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
                        SqlRun.pruned,
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
            row["pruned"] = floats_back(r["pruned"]) if r["pruned"] is not None else None
            row["train"] = (r["experiment_config"] or {}).get("train")
            out[r["run_key"]] = cast("PreviousRun", row)  # (the columns selected above)
        return out

    def current_runs(self, experiment: str) -> list[CurrentRun]:
        """An experiment's runs that are not superseded: id, key, status, folder, owner."""
        with connect(self.engine) as conn:
            return [
                cast("CurrentRun", dict(r))
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

    def last_step(self, run_id: int) -> int | None:
        """The newest step a run logged a metric at, or None; queued metrics count (they
        are flushed first)."""
        self.flush()
        with connect(self.engine) as conn:
            return conn.execute(
                sa.select(sa.func.max(SqlSummary.last_step)).where(SqlSummary.run_id == run_id)
            ).scalar_one()

    def metric_values(self, run_id: int, key: str) -> list[tuple[int, float]]:
        """One run's (step, value) pairs for `key`, in step order, NaN restored."""
        with connect(self.engine) as conn:
            rows = conn.execute(
                sa.select(SqlMetric.step, SqlMetric.value)
                .where(SqlMetric.run_id == run_id, SqlMetric.key == key)
                .order_by(SqlMetric.step)
            ).all()
        return [(step, math.nan if value is None else value) for step, value in rows]


def experiment_id(conn: Connection, name: str) -> int:
    """The id of the experiment named `name`, read in `conn`'s transaction;
    `NoExperiment` names the known ones."""
    found = conn.execute(
        sa.select(SqlExperiment.experiment_id).where(SqlExperiment.name == name)
    ).scalar_one_or_none()
    if found is None:
        known = conn.execute(sa.select(SqlExperiment.name)).scalars().all()
        hint = f"; known: {', '.join(sorted(known))}" if known else ""
        raise NoExperiment(f"no experiment named {name!r} in the store{hint}")
    return found
