"""Metric rows and their blocks into PostgreSQL by binary COPY, in the batch's transaction.

An executemany of an upsert costs the server a statement per row; COPY streams the rows in
one. A batch that only adds rows (each (run, key, step) once, none stored: a training
loop's batch) is copied into `metrics` itself, in a savepoint. Otherwise (a step twice in
the batch, or one stored already, which the copy finds and the savepoint undoes) the rows
are copied into a temporary staging table of the connection and merged into `metrics` by
one ``INSERT ... SELECT ... ON CONFLICT DO UPDATE``, with the upsert's meaning: re-logging
a (run, key, step) replaces its value and wall time, NaN and +-inf are kept. One statement
cannot update a row twice, so a batch that holds a (run, key, step) more than once keeps
its last row before the copy (the order an executemany would have left).

A batch's new blocks (`lab.store.blocks`) are copied into `metric_blocks` the same way, in a
savepoint (`copy_blocks`): a batch that extends its keys only adds blocks after the first
of each key, which may be stored already and is merged by the caller.

The staging table is made once per connection, emptied by each merge (a transaction may
write several batches) and truncated at each commit (``ON COMMIT DELETE ROWS``, which gives
back the space of the rows deleted: a temporary table is never vacuumed). The connection's
pool record remembers that it was made, and forgets it on a rollback (to a savepoint too),
which takes a table made in that transaction away with it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from lab.store.statements import driver_error

STAGE = "lab_metric_stage"
_MADE = "lab_metric_stage_made"  # in the pool record's info: the staging table exists
_COLUMNS = 'run_id, "key", step, value, wall_time'
# the staging table has metrics' columns and types, without the key or the foreign key
_CREATE = f"CREATE TEMP TABLE IF NOT EXISTS {STAGE} (LIKE metrics) ON COMMIT DELETE ROWS"
_COPY_STAGE = f"COPY {STAGE} ({_COLUMNS}) FROM STDIN (FORMAT BINARY)"
_COPY_METRICS = f"COPY metrics ({_COLUMNS}) FROM STDIN (FORMAT BINARY)"
_TYPES = ("int4", "varchar", "int8", "float8", "float8")
_COPY_BLOCKS = (
    'COPY metric_blocks (run_id, "key", block, points, step_min, step_max, value_min, '
    "value_max, value_sum, value_count, point_offsets, point_values) FROM STDIN (FORMAT BINARY)"
)
_BLOCK_TYPES = ("int4", "varchar", "int8", "int8", "int8", "int8", "float8", "float8",
                "float8", "int8", "bytea", "bytea")  # fmt: skip
# The stage is emptied as it is read: a transaction may write several batches (`lab serve`
# writes a client's batch of ops in one), and each merges only its own rows.
_MERGE = (
    f"WITH staged AS (DELETE FROM {STAGE} RETURNING {_COLUMNS}) "
    f"INSERT INTO metrics ({_COLUMNS}) SELECT {_COLUMNS} FROM staged "
    'ON CONFLICT (run_id, "key", step) DO UPDATE '
    "SET value = excluded.value, wall_time = excluded.wall_time"
)


def watch(engine: Engine) -> None:
    """Have `engine` forget a connection's staging table when the connection rolls back,
    to a savepoint too (the table goes with a rollback of what made it). Once per engine."""
    for event in ("rollback", "rollback_savepoint"):
        if not sa.event.contains(engine, event, _forget):
            sa.event.listen(engine, event, _forget)


def _forget(conn: Connection, *_savepoint: Any) -> None:
    conn.connection.info.pop(_MADE, None)


def copy_metrics(
    conn: Connection,
    rows: Callable[[], Iterable[tuple[Any, ...]]],
    acc: dict[int, dict[str, list[Any]]],
    meanwhile: Callable[[], None] | None = None,
) -> None:
    """Write a batch's rows ((run, key, step, value, wall time) each, made anew by each
    call of `rows`, so that they are streamed to the server and never held as a list) into
    `metrics` in `conn`'s transaction, by COPY. `acc`: the batch's folds per run and key
    (`lab.store.metric_rows.MetricRows.write`); a key that came back to a step (its last
    item set) may hold a step twice, and then the last row of each step is kept.

    A batch with each step once is copied into `metrics` itself, in a savepoint: a training
    loop's batch only adds rows, and the merge would cost the server as much again. If a
    step is stored already (a run logging a step again), the savepoint is rolled back and
    the batch merged through the staging table.

    `meanwhile` is called once, after the last row is handed to the driver and before the
    server has said it took them: the server is still writing most of the rows then (the
    driver may hold the last of them, up to its buffer, until the copy ends), so this
    process's work (cutting the batch's blocks) overlaps the server's. An error it raises
    fails the copy."""
    staged: Iterable[tuple[Any, ...]]
    if any(s[7] for per in acc.values() for s in per.values()):
        staged = list({(r[0], r[1], r[2]): r for r in rows()}.values())
    elif _copied_new(conn, _COPY_METRICS, _TYPES, rows(), meanwhile):
        return
    else:
        staged, meanwhile = rows(), None  # it ran in the copy that found a stored step
    info = conn.connection.info
    if not info.get(_MADE):
        conn.exec_driver_sql(_CREATE)
        info[_MADE] = True
    _copy(conn, _COPY_STAGE, _TYPES, staged, meanwhile)
    conn.exec_driver_sql(_MERGE)


def copy_blocks(conn: Connection, rows: list[tuple[Any, ...]]) -> bool:
    """Copy new `metric_blocks` rows (`lab.store.blocks` column order) in `conn`'s
    transaction, in a savepoint. Returns False, with nothing written, when one of them is
    stored already (blocks that do not match the summaries, say): the caller merges them."""
    return _copied_new(conn, _COPY_BLOCKS, _BLOCK_TYPES, rows)


def _copied_new(
    conn: Connection,
    statement: str,
    types: tuple[str, ...],
    rows: Iterable[tuple[Any, ...]],
    meanwhile: Callable[[], None] | None = None,
) -> bool:
    """COPY `rows`, which should all be new, in a savepoint; False, with the savepoint
    rolled back, when one of them is stored already (a unique violation)."""
    from psycopg.errors import UniqueViolation

    try:
        with conn.begin_nested():
            _copy(conn, statement, types, rows, meanwhile)
        return True
    except sa.exc.IntegrityError as exc:
        if not isinstance(exc.orig, UniqueViolation):
            raise
    return False


def _copy(
    conn: Connection,
    statement: str,
    types: tuple[str, ...],
    rows: Iterable[tuple[Any, ...]],
    meanwhile: Callable[[], None] | None = None,
) -> None:
    """COPY `rows` on `conn`'s driver connection, calling `meanwhile` after the last row
    is handed to the driver and before the server's answer is awaited. A driver error is
    raised as SQLAlchemy raises the errors of the statements it runs (`driver_error`)."""
    raw = conn.connection.driver_connection
    cur = raw.cursor()  # type: ignore[union-attr]
    try:
        with cur.copy(statement) as copy:
            copy.set_types(types)
            write = copy.write_row
            for row in rows:
                write(row)
            if meanwhile is not None:
                meanwhile()
    except conn.dialect.loaded_dbapi.Error as exc:
        raise driver_error(conn, exc, raw, cur, statement) from exc
    finally:
        cur.close()


__all__ = ["STAGE", "copy_blocks", "copy_metrics", "watch"]
