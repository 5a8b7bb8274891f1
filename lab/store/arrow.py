"""Store tables as Arrow: the type each column travels as (`arrow_type`, shared by the
server's table reads and `lab.inspect`'s copy of a store), and whole tables or one
experiment's rows read into an Arrow table (`read_table`), JSON as its text, NaN as NaN
on every backend, a run whose process is gone shown as crashed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import sqlalchemy as sa

from lab.store.engine import connect
from lab.store.schema import Base, SqlEval, SqlRun, copied_columns

if TYPE_CHECKING:
    from lab.store.store import Store

#: Columns whose NaN SQLite keeps as NULL: read back as NaN.
NAN_AS_NULL = {("metrics", "value"), ("summaries", "last_value")}


def arrow_type(column: sa.Column) -> pa.DataType:
    """The Arrow type a store column travels as (JSON as its text)."""
    kind = column.type
    if isinstance(kind, sa.Integer):
        return pa.int64()
    if isinstance(kind, (sa.Double, sa.Float)):
        return pa.float64()
    if isinstance(kind, sa.DateTime):
        return pa.timestamp("us")
    return pa.string()


def table_schema(table: str) -> pa.Schema:
    """The Arrow schema of store table `table` on the wire."""
    return pa.schema([(c.name, arrow_type(c)) for c in copied_columns(table)])


def read_table(
    store: Store, table: str, experiment: str | None = None, *, current: bool = False
) -> pa.Table:
    """Store table `table` as Arrow: every row, or those of `experiment` (its runs' rows;
    `current`: superseded runs left out, as ``lab export`` does), in primary-key order."""
    model = Base.metadata.tables[table]
    copied = copied_columns(table)  # never an image's bytes
    columns = [sa.cast(c, sa.Text).label(c.name) if isinstance(c.type, sa.JSON) else c
               for c in copied]  # fmt: skip
    query = sa.select(*columns).order_by(*model.primary_key.columns)
    with connect(store.engine) as conn:
        if experiment is not None:
            experiment_id = store.experiment_id(conn, experiment)
            query = query.where(_belongs(model, experiment_id, current=current))
        rows = conn.execute(query).all()
    if table in ("runs", "experiments"):
        rows = _judged(store, model, rows)
    schema = table_schema(table)
    arrays = []
    for i, (column, field) in enumerate(zip(copied, schema, strict=True)):
        values = [r[i] for r in rows]
        if (table, column.name) in NAN_AS_NULL:
            values = [math.nan if v is None else v for v in values]
        arrays.append(pa.array(values, field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _judged(store: Store, model: sa.Table, rows: Sequence[Any]) -> Sequence[Any]:
    """The rows of `runs` or `experiments` with those whose process is gone shown as
    crashed (`Store.crashed_now`), as ``lab ls`` and ``lab.inspect`` over the store itself
    show them: a notebook reading through the server sees what one on the store sees."""
    crashed = store.crashed_now()
    gone = crashed.runs if model.name == "runs" else crashed.experiments
    if not gone:
        return rows
    names = [c.name for c in model.columns]
    key, status = names.index(model.name[:-1] + "_id"), names.index("status")
    error = names.index("error") if "error" in names else None
    out = []
    for row in rows:
        found = gone.get(row[key])
        if found is not None and row[status] == "running":
            row = list(row)
            row[status] = "crashed"
            if error is not None:
                row[error] = found.why
        out.append(row)
    return out


def _belongs(model: sa.Table, experiment_id: int, *, current: bool) -> Any:
    """Which rows of `model` belong to an experiment: its own, its runs', its evals'."""
    runs = sa.select(SqlRun.run_id).where(SqlRun.experiment_id == experiment_id)
    if current:
        runs = runs.where(SqlRun.superseded_at.is_(None))
    if model.name == "runs" and current:
        return sa.and_(model.c.experiment_id == experiment_id, model.c.superseded_at.is_(None))
    if "experiment_id" in model.c:
        return model.c.experiment_id == experiment_id
    if "run_id" in model.c:
        return model.c.run_id.in_(runs)
    evals = sa.select(SqlEval.eval_id).where(SqlEval.run_id.in_(runs))
    return model.c.eval_id.in_(evals)
