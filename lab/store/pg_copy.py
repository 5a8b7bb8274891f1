"""Metric rows into PostgreSQL by binary COPY: the rows of a batch are copied into a
temporary staging table of the connection, then merged into `metrics` by one
``INSERT ... SELECT ... ON CONFLICT DO UPDATE``, in the batch's transaction.

An executemany of an upsert costs the server a statement per row; COPY streams the rows in
one, and the merge is one statement too, with the upsert's meaning: re-logging a (run, key,
step) replaces its value and wall time, NaN and +-inf are kept. One statement cannot update
a row twice, so a batch that holds a (run, key, step) more than once keeps its last row
before the copy (the order an executemany would have left).

The staging table is made once per connection, emptied by each merge (a transaction may
write several batches) and truncated at each commit (``ON COMMIT DELETE ROWS``, which gives
back the space of the rows deleted: a temporary table is never vacuumed). The connection's
pool record remembers that it was made, and forgets it on a rollback, which takes a table
made in that transaction away with it.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

STAGE = "lab_metric_stage"
_MADE = "lab_metric_stage_made"  # in the pool record's info: the staging table exists
_COLUMNS = 'run_id, "key", step, value, wall_time'
# the staging table has metrics' columns and types, without the key or the foreign key
_CREATE = f"CREATE TEMP TABLE IF NOT EXISTS {STAGE} (LIKE metrics) ON COMMIT DELETE ROWS"
_COPY = f"COPY {STAGE} ({_COLUMNS}) FROM STDIN (FORMAT BINARY)"
_TYPES = ("int4", "varchar", "int8", "float8", "float8")
# The stage is emptied as it is read: a transaction may write several batches (`lab serve`
# writes a client's batch of ops in one), and each merges only its own rows.
_MERGE = (
    f"WITH staged AS (DELETE FROM {STAGE} RETURNING {_COLUMNS}) "
    f"INSERT INTO metrics ({_COLUMNS}) SELECT {_COLUMNS} FROM staged "
    'ON CONFLICT (run_id, "key", step) DO UPDATE '
    "SET value = excluded.value, wall_time = excluded.wall_time"
)


def watch(engine: Engine) -> None:
    """Have `engine` forget a connection's staging table when the connection rolls back
    (the table goes with a rollback of the transaction that made it). Once per engine."""
    if not sa.event.contains(engine, "rollback", _forget):
        sa.event.listen(engine, "rollback", _forget)


def _forget(conn: Connection) -> None:
    conn.connection.info.pop(_MADE, None)


def copy_metrics(
    conn: Connection, rows: list[tuple[Any, ...]], acc: dict[int, dict[str, list[Any]]]
) -> None:
    """Write a batch's `rows` ((run, key, step, value, wall time) each) into `metrics` in
    `conn`'s transaction, by COPY and one merge. `acc`: the batch's folds per run and key
    (`lab.store.metric_rows.MetricRows.write`); a key that came back to a step (its last
    item set) may hold a step twice, and then the last row of each step is kept."""
    if any(s[7] for per in acc.values() for s in per.values()):
        rows = list({(r[0], r[1], r[2]): r for r in rows}.values())
    info = conn.connection.info
    if not info.get(_MADE):
        conn.exec_driver_sql(_CREATE)
        info[_MADE] = True
    raw = conn.connection.driver_connection
    with raw.cursor() as cur, cur.copy(_COPY) as copy:  # type: ignore[union-attr]
        copy.set_types(_TYPES)
        write = copy.write_row
        for row in rows:
            write(row)
    conn.exec_driver_sql(_MERGE)


__all__ = ["STAGE", "copy_metrics", "watch"]
