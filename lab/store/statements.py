"""SQL statements built once per process as text with typed binds.

A Core statement costs milliseconds to build and to compile, and SQLAlchemy's compiled
cache belongs to one engine: every newly opened store paid again for the statements of a
run's start and end. A `sa.text` statement is built once here and compiles in microseconds,
while its binds, typed by the table's columns, convert values (JSON, timestamps) exactly as
Core does. SQLite and PostgreSQL share the syntax used here.
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa


def driver_error(
    conn: sa.Connection, exc: Any, raw: Any, cur: Any, statement: str
) -> sa.exc.StatementError:
    """`exc`, raised by the driver for `statement` run on `conn`'s driver connection `raw`
    (cursor `cur`) around SQLAlchemy, as SQLAlchemy raises the errors of the statements it
    runs (an `IntegrityError` for a run that is not there, say), so that callers and the
    writer's retry rules meet one kind of error; a lost connection is invalidated first, as
    SQLAlchemy does. Raise it ``from exc``."""
    lost = conn.dialect.is_disconnect(exc, raw, cur)
    if lost:
        conn.invalidate(exc)
    return sa.exc.DBAPIError.instance(
        statement, None, exc, conn.dialect.loaded_dbapi.Error,
        connection_invalidated=lost, dialect=conn.dialect,
    )  # fmt: skip


def dialect_insert(dialect: str, table: Any) -> Any:
    """An ``INSERT`` into `table` that takes ``ON CONFLICT`` clauses, for `dialect`
    (``postgresql`` or ``sqlite``). The PostgreSQL dialect is imported only for a PostgreSQL
    store: a SQLite run's start skips its 8,000 objects and 30 ms of imports."""
    if dialect == "postgresql":
        from sqlalchemy.dialects import postgresql

        return postgresql.insert(table)
    from sqlalchemy.dialects import sqlite

    return sqlite.insert(table)


@functools.cache
def upsert(
    table: sa.Table, columns: tuple[str, ...], keys: tuple[str, ...], pk: str, where: str = ""
) -> Upsert:
    """``INSERT .. ON CONFLICT (keys) DO UPDATE .. [WHERE where] RETURNING pk``, built once
    per process for these columns (see `Upsert`).

    `where` (SQL, no binds) guards the update: a conflicting row it rejects is left as it
    is, and nothing is returned.
    """
    return Upsert(table, columns, keys, pk, where)


def upsert_row(
    conn: sa.Connection, table: sa.FromClause, values: dict[str, Any], keys: list[str], pk: str
) -> int:
    """Insert `values` into `table`, or update the row with the same `keys`; returns its
    primary key `pk` (an experiment's, an arm's, a group's: written again on each attempt)."""
    key = upsert(table, tuple(values), tuple(keys), pk)(conn, values)
    assert key is not None  # (no guard: the row is inserted or updated)
    return int(key)


class Upsert:
    """An upsert as text, its binds typed by the table's columns (JSON, timestamps: the
    same conversions as Core's), and the columns' Python defaults (``default=``) filled in
    on insert as Core fills them; the update sets only the given columns."""

    def __init__(
        self, table: sa.Table, columns: tuple[str, ...], keys: tuple[str, ...], pk: str, where: str
    ) -> None:
        self.defaults = [
            (c.name, c.default)
            for c in table.columns
            if isinstance(c.default, sa.ColumnDefault)
            and c.name not in columns
            and not c.primary_key
        ]
        inserted = (*columns, *(name for name, _ in self.defaults))
        quoted = {c: f'"{c}"' for c in (*inserted, *keys, pk)}
        names = ", ".join(quoted[c] for c in inserted)
        binds = ", ".join(f":{c}" for c in inserted)
        conflict = ", ".join(quoted[k] for k in keys)
        sets = ", ".join(f"{quoted[c]} = excluded.{quoted[c]}" for c in columns if c not in keys)
        guard = f" WHERE {where}" if where else ""
        sql = (
            f'INSERT INTO "{table.name}" ({names}) VALUES ({binds}) '
            f"ON CONFLICT ({conflict}) DO UPDATE SET {sets}{guard} RETURNING {quoted[pk]}"
        )
        typed = (sa.bindparam(c, type_=table.c[c].type) for c in inserted)
        self.statement = sa.text(sql).bindparams(*typed)

    def __call__(self, conn: sa.Connection, values: dict[str, Any]) -> Any:
        """Run it with `values` (every one of its columns); returns the primary key, or None
        when `where` kept the row that was there."""
        params = dict(values)
        for name, default in self.defaults:
            params[name] = default.arg(None) if default.is_callable else default.arg
        return conn.execute(self.statement, params).scalar_one_or_none()


@functools.cache
def update(table: sa.Table, columns: tuple[str, ...], pk: str) -> sa.TextClause:
    """``UPDATE table SET columns .. WHERE pk = :pk`` as text, its binds typed by the
    table's columns, built once per process: run it with every column's value and `pk`'s."""
    sets = ", ".join(f'"{c}" = :{c}' for c in columns)
    sql = f'UPDATE "{table.name}" SET {sets} WHERE "{pk}" = :{pk}'
    typed = (sa.bindparam(c, type_=table.c[c].type) for c in (*columns, pk))
    return sa.text(sql).bindparams(*typed)
