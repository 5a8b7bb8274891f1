"""SQL text run on any connection to a store, through one small adapter: `Sql`.

The reads that every door shares (`lab.store.listing`: what ``lab ls`` and ``lab show``
print, the crash judgement of `lab.store.crashes`, the schema revision of
`lab.store.migrations`) are written once, as text with ``:name`` parameters, and run
through `Sql` on whichever connection the reader holds: a SQLAlchemy `Connection` (a
`Store`), or a driver's own `sqlite3` or `psycopg` connection (`lab.store.reader.Reader`,
what commands that only read open, without importing SQLAlchemy). Either way the rows hold
the driver's own values; `Sql.time` and `Sql.json` convert the two kinds that SQLite keeps
as text (timestamps, JSON), exactly as SQLAlchemy's column types do.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from typing import Any

from lab.store.engine import reading_error

_BIND = re.compile(r":(\w+)")


@functools.cache
def _pyformat(statement: str) -> str:
    """`statement` with psycopg's ``%(name)s`` binds for its ``:name`` ones (a statement
    written for `Sql` holds no other colon, and no ``%``)."""
    return _BIND.sub(r"%(\1)s", statement)


class Sql:
    """One connection to a store, whatever its driver: `rows` runs a statement on it.

    `conn`: a SQLAlchemy `Connection` (its engine maps errors, `lab.store.engine`), or a
    `sqlite3`/`psycopg` connection, whose errors `rows` maps here as a read-only engine
    would (`lab.store.engine.reading_error`). `where` names the store in messages (by
    default the engine's URL, its password hidden), `older` its revision when it is older
    than this lab's.
    """

    def __init__(self, conn: Any, *, where: str | None = None, older: str | None = None) -> None:
        self.conn = conn
        self.older = older
        module = type(conn).__module__
        self._alchemy = module.startswith("sqlalchemy.")
        if self._alchemy:
            self.dialect: str = conn.dialect.name
            where = where or conn.engine.url.render_as_string(hide_password=True)
        else:
            self.dialect = "sqlite" if module.startswith("sqlite3") else "postgresql"
        self.where = where or "the store"

    def rows(self, statement: str, **params: Any) -> list[tuple[Any, ...]]:
        """The rows `statement` returns (``:name`` binds filled from `params`), as tuples of
        the driver's values."""
        text = statement if self.dialect == "sqlite" else _pyformat(statement)
        if self._alchemy:
            return [tuple(row) for row in self.conn.exec_driver_sql(text, params)]
        try:
            cursor = self.conn.execute(text, params)
            try:
                return [tuple(row) for row in cursor.fetchall()]
            finally:
                cursor.close()
        except Exception as exc:
            mapped = reading_error(exc, self.where, self.older)
            if mapped is None:
                raise
            raise mapped from None

    def time(self, value: Any) -> datetime | None:
        """A timestamp column's value as a naive UTC `datetime` (SQLite keeps ISO text)."""
        return datetime.fromisoformat(value) if isinstance(value, str) else value

    def json(self, value: Any) -> Any:
        """A JSON column's value as Python (SQLite keeps the text; psycopg reads it)."""
        if self.dialect == "sqlite" and isinstance(value, (str, bytes)):
            return json.loads(value)
        return value
