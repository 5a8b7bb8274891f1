"""The lookups behind `lab serve`'s ownership checks (`lab.server.owners`, which holds the
rules): which experiment a run belongs to, who created an experiment, and whether the
parts a request names belong to its experiment. Plain tuples and sets."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from lab.store.schema import SqlArm, SqlExperiment, SqlGroup, SqlRun

# Text, built once: a Core select costs more to compile than to run, and these run with
# every batch a client sends.
_RUNS = sa.text(
    "SELECT r.run_id, r.experiment_id, e.name, e.created_by FROM runs r "
    "JOIN experiments e ON e.experiment_id = r.experiment_id WHERE r.run_id IN :ids"
).bindparams(sa.bindparam("ids", expanding=True))
_EXPERIMENTS = sa.text(
    "SELECT experiment_id, name, created_by FROM experiments WHERE experiment_id IN :ids"
).bindparams(sa.bindparam("ids", expanding=True))
#: Each kind of part: its id column and its experiment's.
_PARTS = {
    "group": (SqlGroup.group_id, SqlGroup.experiment_id),
    "arm": (SqlArm.arm_id, SqlArm.experiment_id),
    "run": (SqlRun.run_id, SqlRun.experiment_id),
}


def run_owners(conn: sa.Connection, run_ids: list[int]) -> list[tuple[int, int, str, Any]]:
    """(run_id, experiment_id, experiment name, created_by) of each of `run_ids` the
    store holds."""
    return [(r[0], r[1], r[2], r[3]) for r in conn.execute(_RUNS, {"ids": run_ids})]


def experiment_owners(conn: sa.Connection, experiment_ids: list[int]) -> list[tuple[int, str, Any]]:
    """(experiment_id, name, created_by) of each of `experiment_ids` the store holds."""
    return [(r[0], r[1], r[2]) for r in conn.execute(_EXPERIMENTS, {"ids": experiment_ids})]


def experiment_named(conn: sa.Connection, name: str) -> tuple[int, str | None] | None:
    """(experiment_id, created_by) of the experiment named `name`, or None."""
    row = conn.execute(
        sa.select(SqlExperiment.experiment_id, SqlExperiment.created_by).where(
            SqlExperiment.name == name
        )
    ).first()
    return None if row is None else (row[0], row[1])


def parts_found(conn: sa.Connection, experiment_id: int, wanted: list[tuple[str, int]]) -> set[int]:
    """The indexes into `wanted` ((kind, id), kind ``group``, ``arm`` or ``run``) of the
    parts that belong to experiment `experiment_id`, in one query."""
    parts = [
        sa.select(sa.literal(i).label("i"), column.label("id")).where(
            column == value, owner == experiment_id
        )
        for i, (kind, value) in enumerate(wanted)
        for column, owner in [_PARTS[kind]]
    ]
    return {row.i for row in conn.execute(sa.union_all(*parts))}
