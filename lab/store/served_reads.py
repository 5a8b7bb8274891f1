"""The queries behind `lab serve`'s reads of one experiment's summaries and one run's rows
(`lab.server.read`): each takes an open connection and answers plain values and dicts, so
no row object leaves the store and the server holds no SQL of its own."""

from __future__ import annotations

from typing import Any, Literal

import sqlalchemy as sa

from lab.store.schema import (
    SqlArm,
    SqlCheckpoint,
    SqlEval,
    SqlExperiment,
    SqlPrediction,
    SqlRun,
    SqlSummary,
)


def summary_rows(conn: sa.Connection, experiment_id: int, key: str | None) -> list[dict[str, Any]]:
    """One dict per current run of the experiment and metric key (of `key` alone when
    given), in (run_id, key) order: the run's id, key, arm, repeat, stage and status, and
    the metric's count, first and last step, last value, min and max."""
    query = (
        sa.select(
            SqlRun.run_id, SqlRun.run_key, SqlArm.name.label("arm"), SqlRun.repeat,
            SqlRun.stage, SqlRun.status, SqlSummary.key, SqlSummary.count,
            SqlSummary.first_step, SqlSummary.last_step, SqlSummary.last_value,
            SqlSummary.min_value, SqlSummary.max_value,
        )
        .join(SqlRun, SqlRun.run_id == SqlSummary.run_id)
        .join(SqlArm, SqlArm.arm_id == SqlRun.arm_id, isouter=True)
        .where(SqlRun.experiment_id == experiment_id, SqlRun.superseded_at.is_(None))
        .order_by(SqlRun.run_id, SqlSummary.key)
    )  # fmt: skip
    if key is not None:
        query = query.where(SqlSummary.key == key)
    return [dict(r) for r in conn.execute(query).mappings()]


def has_run(conn: sa.Connection, run_id: int) -> bool:
    """Whether the store holds run `run_id` (current or superseded)."""
    found = conn.execute(sa.select(SqlRun.run_id).where(SqlRun.run_id == run_id)).first()
    return found is not None


def has_experiment(conn: sa.Connection, name: str) -> bool:
    """Whether the store holds an experiment named `name`."""
    query = sa.select(SqlExperiment.experiment_id).where(SqlExperiment.name == name)
    return conn.execute(query.limit(1)).first() is not None


def has_metric(conn: sa.Connection, name: str, key: str) -> bool:
    """Whether a run of the experiment named `name` (current or superseded) holds metric
    `key`."""
    query = (
        sa.select(SqlSummary.run_id)
        .join(SqlRun, SqlRun.run_id == SqlSummary.run_id)
        .join(SqlExperiment, SqlExperiment.experiment_id == SqlRun.experiment_id)
        .where(SqlExperiment.name == name, SqlSummary.key == key)
    )
    return conn.execute(query.limit(1)).first() is not None


def series_span(conn: sa.Connection, run_id: int, key: str) -> tuple[int, int, int] | None:
    """The first step, last step and number of points of run `run_id`'s series `key`, or
    None when the run has no such metric."""
    span = conn.execute(
        sa.select(SqlSummary.first_step, SqlSummary.last_step, SqlSummary.count).where(
            SqlSummary.run_id == run_id, SqlSummary.key == key
        )
    ).first()
    return None if span is None else (span[0], span[1], span[2])


def metric_keys(conn: sa.Connection, run_id: int) -> list[str]:
    """The metric keys run `run_id` holds, sorted."""
    return list(
        conn.execute(
            sa.select(SqlSummary.key).where(SqlSummary.run_id == run_id).order_by(SqlSummary.key)
        ).scalars()
    )


def prediction_rows(
    conn: sa.Connection,
    run_id: int,
    *,
    eval: str | None,
    step: int | Literal["final"] | None,
    after: tuple[int, int] | None,
    limit: int,
) -> list[dict[str, Any]]:
    """Up to `limit` prediction rows of run `run_id` in (eval_id, idx) order, each naming
    its eval, step and idx: of eval `eval` and `step` when given (``"final"``: the eval
    after training), those after the (eval_id, idx) cursor `after` when given."""
    query = (
        sa.select(
            SqlPrediction.eval_id, SqlEval.name.label("eval"), SqlEval.step, SqlPrediction.idx,
            SqlPrediction.example_id, SqlPrediction.input, SqlPrediction.output,
            SqlPrediction.target, SqlPrediction.score, SqlPrediction.extras,
        )
        .join(SqlEval, SqlEval.eval_id == SqlPrediction.eval_id)
        .where(SqlEval.run_id == run_id)
        .order_by(SqlPrediction.eval_id, SqlPrediction.idx)
        .limit(limit)
    )  # fmt: skip
    if eval is not None:
        query = query.where(SqlEval.name == eval)
    if step == "final":
        query = query.where(SqlEval.step.is_(None))
    elif step is not None:
        query = query.where(SqlEval.step == step)
    if after is not None:
        query = query.where(sa.tuple_(SqlPrediction.eval_id, SqlPrediction.idx) > sa.tuple_(*after))
    return [dict(r) for r in conn.execute(query).mappings()]


def eval_rows(conn: sa.Connection, run_id: int) -> list[dict[str, Any]]:
    """Run `run_id`'s evaluations in the order they ran: id, name, step, metrics,
    breakdowns, tags, seconds, error, created_at and the number of prediction rows."""
    counts = (
        sa.select(SqlPrediction.eval_id, sa.func.count().label("n"))
        .group_by(SqlPrediction.eval_id)
        .subquery()
    )
    rows = conn.execute(
        sa.select(
            SqlEval.eval_id, SqlEval.name, SqlEval.step, SqlEval.metrics,
            SqlEval.breakdowns, SqlEval.tags, SqlEval.seconds, SqlEval.error,
            SqlEval.created_at, sa.func.coalesce(counts.c.n, 0).label("predictions"),
        )
        .join(counts, counts.c.eval_id == SqlEval.eval_id, isouter=True)
        .where(SqlEval.run_id == run_id)
        .order_by(SqlEval.eval_id)
    ).mappings()  # fmt: skip
    return [dict(r) for r in rows]


def checkpoint_rows(conn: sa.Connection, run_id: int) -> list[dict[str, Any]]:
    """Run `run_id`'s checkpoint manifest rows in the order they were written: id, step,
    path, event, metrics, reason and created_at."""
    rows = conn.execute(
        sa.select(
            SqlCheckpoint.checkpoint_id, SqlCheckpoint.step, SqlCheckpoint.path,
            SqlCheckpoint.event, SqlCheckpoint.metrics, SqlCheckpoint.reason,
            SqlCheckpoint.created_at,
        )
        .where(SqlCheckpoint.run_id == run_id)
        .order_by(SqlCheckpoint.checkpoint_id)
    ).mappings()  # fmt: skip
    return [dict(r) for r in rows]
