"""The queries behind the dashboard's pages (`lab.server.dashboard`): each takes an open
connection and answers plain values, tuples and dicts, so no row object leaves the store and
the server holds no SQL of its own. Only current runs (not superseded) are read."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from lab.store.curves import _nan
from lab.store.schema import (
    SqlArm,
    SqlCheckpoint,
    SqlEval,
    SqlExperiment,
    SqlGroup,
    SqlHistogram,
    SqlImage,
    SqlPrediction,
    SqlRun,
    SqlSummary,
)

_CURRENT = SqlRun.superseded_at.is_(None)


def experiments_page(
    conn: sa.Connection, q: str, only: str | None, offset: int, limit: int
) -> dict[str, Any]:
    """One page of experiments, newest first, whose name holds `q` (any case; all when
    empty) and is `only` when given: ``total`` matching, the ``page`` (dicts), the page's
    current ``runs`` (run_id, experiment_id, arm_id, stage, status), its ``arms`` counted
    per experiment, the summary ``keys`` of each experiment's runs, and the ``arm_order``
    (arm_id to (experiment_id, name)), so the list costs a fixed number of queries."""
    where: sa.ColumnElement[bool] = sa.true()
    if q:
        where = sa.func.lower(SqlExperiment.name).contains(q.lower(), autoescape=True)
    if only is not None:
        where = sa.and_(where, SqlExperiment.name == only)
    total = conn.execute(sa.select(sa.func.count()).where(where)
                         .select_from(SqlExperiment)).scalar_one()  # fmt: skip
    page = conn.execute(
        sa.select(SqlExperiment.experiment_id, SqlExperiment.name, SqlExperiment.status,
                  SqlExperiment.repeats, SqlExperiment.config, SqlExperiment.created_at,
                  SqlExperiment.ended_at)
        .where(where).order_by(SqlExperiment.experiment_id.desc())
        .offset(offset).limit(limit)
    ).mappings().all()  # fmt: skip
    ids = [e["experiment_id"] for e in page]
    in_page = SqlRun.experiment_id.in_(ids)
    runs = conn.execute(
        sa.select(SqlRun.run_id, SqlRun.experiment_id, SqlRun.arm_id, SqlRun.stage,
                  SqlRun.status).where(in_page, _CURRENT)
    ).all()  # fmt: skip
    arms = dict(conn.execute(
        sa.select(SqlArm.experiment_id, sa.func.count())
        .where(SqlArm.experiment_id.in_(ids)).group_by(SqlArm.experiment_id)
    ).all())  # fmt: skip
    keys: dict[int, set[str]] = {}
    for exp_id, key in conn.execute(
        sa.select(SqlRun.experiment_id, SqlSummary.key).distinct()
        .join(SqlSummary, SqlSummary.run_id == SqlRun.run_id).where(in_page, _CURRENT)
    ):  # fmt: skip
        keys.setdefault(exp_id, set()).add(key)
    arm_order = {arm_id: (exp_id, name) for arm_id, exp_id, name in conn.execute(
        sa.select(SqlArm.arm_id, SqlArm.experiment_id, SqlArm.name)
        .where(SqlArm.experiment_id.in_(ids)).order_by(SqlArm.arm_id)
    )}  # fmt: skip
    return {"total": total, "page": [dict(e) for e in page], "runs": list(runs),
            "arms": arms, "keys": keys, "arm_order": arm_order}  # fmt: skip


def finals(
    conn: sa.Connection, experiment_ids: list[int], keys: set[str], statuses: tuple[str, ...]
) -> dict[tuple[int, str], float]:
    """The final value of each of `keys` per current run (of `statuses`) of the
    experiments: (run_id, key) to its last value (NaN kept)."""
    return {
        (run_id, key): _nan(value)
        for run_id, key, value in conn.execute(
            sa.select(SqlSummary.run_id, SqlSummary.key, SqlSummary.last_value)
            .join(SqlRun, SqlRun.run_id == SqlSummary.run_id)
            .where(SqlRun.experiment_id.in_(experiment_ids), _CURRENT,
                   SqlSummary.key.in_(keys), SqlRun.status.in_(statuses))
        )
    }  # fmt: skip


def run_configs(conn: sa.Connection, name: str) -> dict[int, Any]:
    """The config of each current run of experiment `name`, by run id."""
    return dict(conn.execute(
        sa.select(SqlRun.run_id, SqlRun.config)
        .join(SqlExperiment, SqlExperiment.experiment_id == SqlRun.experiment_id)
        .where(SqlExperiment.name == name, _CURRENT)
    ).all())  # fmt: skip


def curve_members(conn: sa.Connection, experiment_id: int) -> tuple[Any, list[Any]]:
    """An experiment's config and its current runs in arm, repeat, stage order, each a
    tuple of run_id, run_key, arm_id, name (the arm's), repeat, stage and status."""
    config = conn.execute(
        sa.select(SqlExperiment.config).where(SqlExperiment.experiment_id == experiment_id)
    ).scalar_one()
    members = conn.execute(
        sa.select(SqlRun.run_id, SqlRun.run_key, SqlRun.arm_id, SqlArm.name, SqlRun.repeat,
                  SqlRun.stage, SqlRun.status)
        .join(SqlArm, SqlArm.arm_id == SqlRun.arm_id, isouter=True)
        .where(SqlRun.experiment_id == experiment_id, _CURRENT)
        .order_by(SqlRun.arm_id, SqlRun.repeat, SqlRun.stage, SqlRun.run_id)
    ).all()  # fmt: skip
    return config, list(members)


def metric_span(conn: sa.Connection, run_ids: list[int], key: str) -> tuple[Any, Any]:
    """The first and last step of `key` over the runs: (None, None) when none logged it."""
    lo, hi = conn.execute(
        sa.select(sa.func.min(SqlSummary.first_step), sa.func.max(SqlSummary.last_step))
        .where(SqlSummary.run_id.in_(run_ids), SqlSummary.key == key)
    ).one()  # fmt: skip
    return lo, hi


def metric_keys(conn: sa.Connection, run_ids: list[int]) -> list[str]:
    """The metric keys the runs logged, sorted."""
    return list(conn.execute(
        sa.select(SqlSummary.key).distinct().where(SqlSummary.run_id.in_(run_ids))
        .order_by(SqlSummary.key)
    ).scalars().all())  # fmt: skip


def eval_names(conn: sa.Connection, run_ids: list[int]) -> list[str]:
    """The names of the evals the runs recorded, sorted."""
    return list(conn.execute(
        sa.select(SqlEval.name).distinct().where(SqlEval.run_id.in_(run_ids))
        .order_by(SqlEval.name)
    ).scalars().all())  # fmt: skip


def experiment_eval_names(conn: sa.Connection, experiment_id: int) -> list[str]:
    """The names of the evals the experiment's current runs recorded, sorted."""
    return list(conn.execute(
        sa.select(SqlEval.name).distinct().join(SqlRun, SqlRun.run_id == SqlEval.run_id)
        .where(SqlRun.experiment_id == experiment_id, _CURRENT)
        .order_by(SqlEval.name)
    ).scalars().all())  # fmt: skip


def arm_names(conn: sa.Connection, experiment_id: int) -> list[str]:
    """The experiment's arms by name, in the order they were added."""
    return list(conn.execute(
        sa.select(SqlArm.name).where(SqlArm.experiment_id == experiment_id)
        .order_by(SqlArm.arm_id)
    ).scalars().all())  # fmt: skip


def chain_runs(conn: sa.Connection, run_ids: list[int]) -> list[tuple[str, str | None, int]]:
    """(group, arm, run_id) of the runs that belong to a continual chain, by group, stage."""
    return [(group, arm, run_id) for group, arm, run_id in conn.execute(
        sa.select(SqlGroup.name, SqlArm.name, SqlRun.run_id)
        .join(SqlRun, SqlRun.group_id == SqlGroup.group_id)
        .join(SqlArm, SqlArm.arm_id == SqlGroup.arm_id, isouter=True)
        .where(SqlGroup.kind == "chain", SqlRun.run_id.in_(run_ids))
        .order_by(SqlGroup.group_id, SqlRun.stage, SqlRun.run_id)
    )]  # fmt: skip


def run_named(conn: sa.Connection, run_id: int) -> dict[str, Any] | None:
    """A run's row with its experiment's name (``experiment``) and its arm's (``arm``);
    None when the store has no such run."""
    found = conn.execute(
        sa.select(*SqlRun.__table__.columns, SqlExperiment.name.label("experiment"),
                  SqlArm.name.label("arm"))
        .join(SqlExperiment, SqlExperiment.experiment_id == SqlRun.experiment_id)
        .join(SqlArm, SqlArm.arm_id == SqlRun.arm_id, isouter=True)
        .where(SqlRun.run_id == run_id)
    ).mappings().first()  # fmt: skip
    return None if found is None else dict(found)


def run_records(conn: sa.Connection, run_id: int) -> dict[str, list[dict[str, Any]]]:
    """What a run page lists of a run: a summary of each metric series (``metrics``), its
    evals with their prediction counts, its checkpoint manifest, the newest histogram of
    each key, and its images (key, step, size), each a list of dicts in a fixed order."""
    metrics = conn.execute(
        sa.select(SqlSummary.key, SqlSummary.count, SqlSummary.first_step,
                  SqlSummary.last_step, SqlSummary.last_value.label("last"),
                  SqlSummary.min_value.label("min"), SqlSummary.max_value.label("max"))
        .where(SqlSummary.run_id == run_id).order_by(SqlSummary.key)
    ).mappings().all()  # fmt: skip
    counts = (
        sa.select(SqlPrediction.eval_id, sa.func.count().label("n"))
        .join(SqlEval, SqlEval.eval_id == SqlPrediction.eval_id)
        .where(SqlEval.run_id == run_id).group_by(SqlPrediction.eval_id).subquery()
    )  # fmt: skip
    evals = conn.execute(
        sa.select(SqlEval.eval_id, SqlEval.name, SqlEval.step, SqlEval.metrics,
                  SqlEval.breakdowns, SqlEval.tags, SqlEval.seconds, SqlEval.error,
                  sa.func.coalesce(counts.c.n, 0).label("predictions"))
        .join(counts, counts.c.eval_id == SqlEval.eval_id, isouter=True)
        .where(SqlEval.run_id == run_id).order_by(SqlEval.eval_id)
    ).mappings().all()  # fmt: skip
    checkpoints = conn.execute(
        sa.select(SqlCheckpoint.step, SqlCheckpoint.path, SqlCheckpoint.event,
                  SqlCheckpoint.metrics, SqlCheckpoint.reason, SqlCheckpoint.created_at)
        .where(SqlCheckpoint.run_id == run_id).order_by(SqlCheckpoint.checkpoint_id)
    ).mappings().all()  # fmt: skip
    return {
        "metrics": [{**m, "last": _nan(m["last"])} for m in metrics],
        "evals": [dict(e) for e in evals],
        "checkpoints": [dict(c) for c in checkpoints],
        **_run_media(conn, run_id),
    }


def _run_media(conn: sa.Connection, run_id: int) -> dict[str, list[dict[str, Any]]]:
    newest = (
        sa.select(SqlHistogram.key, sa.func.max(SqlHistogram.step).label("step"))
        .where(SqlHistogram.run_id == run_id)
        .group_by(SqlHistogram.key)
        .subquery()
    )
    histograms = conn.execute(
        sa.select(SqlHistogram.key, SqlHistogram.step, SqlHistogram.edges,
                  SqlHistogram.counts, SqlHistogram.nan, SqlHistogram.posinf,
                  SqlHistogram.neginf)
        .join(newest, sa.and_(newest.c.key == SqlHistogram.key,
                              newest.c.step == SqlHistogram.step))
        .where(SqlHistogram.run_id == run_id).order_by(SqlHistogram.key)
    ).mappings().all()  # fmt: skip
    images = conn.execute(
        sa.select(SqlImage.key, SqlImage.step, SqlImage.width, SqlImage.height)
        .where(SqlImage.run_id == run_id).order_by(SqlImage.key, SqlImage.step)
    ).mappings().all()  # fmt: skip
    return {"histograms": [dict(h) for h in histograms], "images": [dict(i) for i in images]}


def image_row(conn: sa.Connection, run_id: int, key: str, step: int) -> tuple[str, Any] | None:
    """(path, bytes) of a run's image `key` at `step`; None when there is none."""
    row = conn.execute(
        sa.select(SqlImage.path, SqlImage.data).where(
            SqlImage.run_id == run_id, SqlImage.key == key, SqlImage.step == step
        )
    ).first()
    return None if row is None else (row.path, row.data)
