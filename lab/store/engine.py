"""Store URLs, engines and the one helper that opens a transaction."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError

from lab._json import finite_json
from lab._secrets import mask
from lab.errors import StoreError, StoreUnreachable, UnknownScheme

DEFAULT_URL = "sqlite:///lab.db"
SQLITE_BUSY_TIMEOUT_MS = 60_000
_WRITE = "lab_write"  # execution option: this connection's transactions write


def resolve_url(url: str | None = None) -> str:
    """The store URL to use: the argument, else ``LAB_STORE_URL``, else ``sqlite:///lab.db``.

    ``postgresql://`` is read as psycopg 3, the driver `lab` ships with.
    """
    chosen = url or os.environ.get("LAB_STORE_URL") or DEFAULT_URL
    try:
        parsed = make_url(chosen)
        parsed.port  # noqa: B018  # a port that is not a number fails here, not at connect
    except (ArgumentError, ValueError):
        raise UnknownScheme(
            f"store URL {mask(chosen)!r} is not a URL; use sqlite:///path/to/lab.db "
            "or postgresql://user:password@host/dbname"
        ) from None
    backend = parsed.get_backend_name()
    if backend in ("postgresql", "postgres"):  # SQLAlchemy itself no longer reads postgres://
        if parsed.drivername in ("postgresql", "postgres"):
            parsed = parsed.set(drivername="postgresql+psycopg")
        elif parsed.drivername != "postgresql+psycopg":
            raise UnknownScheme(
                f"store URL driver {parsed.drivername!r} is not supported; "
                "use postgresql:// (psycopg 3)"
            )
    elif backend != "sqlite":
        raise UnknownScheme(
            f"store URL scheme {parsed.drivername!r} is not supported; "
            "use sqlite:///path/to/lab.db or postgresql://user:password@host/dbname"
        )
    return parsed.render_as_string(hide_password=False)


def dumps_json(value: Any) -> str:
    """JSON for the store: non-finite floats become strings, since JSON has no NaN."""
    return json.dumps(finite_json(value), ensure_ascii=False, default=str)


def make_engine(url: str) -> Engine:
    """An engine for `url`, with SQLite's WAL, busy timeout and foreign keys switched on."""
    parsed = make_url(url)
    try:
        if parsed.get_backend_name() == "sqlite":
            database = parsed.database
            connect_args: dict[str, Any] = {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}
            options: dict[str, Any] = {}
            if database and database != ":memory:":
                Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
            else:
                # Each connection to :memory: is a database of its own: share one, so the
                # metric writer's thread sees the tables the opening thread created.
                options["poolclass"] = sa.pool.StaticPool
                connect_args["check_same_thread"] = False
            engine = sa.create_engine(
                url, json_serializer=dumps_json, connect_args=connect_args, **options
            )
            sa.event.listen(engine, "connect", _sqlite_pragmas)
            # SQLAlchemy's pysqlite BEGIN handling: let us issue BEGIN ourselves.
            sa.event.listen(engine, "begin", _sqlite_begin)
        else:
            engine = sa.create_engine(
                url,
                json_serializer=dumps_json,
                pool_pre_ping=True,
                connect_args={"connect_timeout": 10},
            )
    except NoSuchModuleError:
        raise UnknownScheme(f"no SQLAlchemy driver for {parsed.drivername!r}") from None
    except ModuleNotFoundError as exc:
        raise UnknownScheme(
            f"the driver for {parsed.drivername!r} is not installed ({exc.name}); "
            "run: pip install 'lab[postgres]'"
        ) from None
    return engine


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # Autocommit at the driver level; transactions are opened by the "begin" listener.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    _set_wal(cur)
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def _set_wal(cur: Any) -> None:
    """Switch to WAL, retrying while another connection holds the lock that takes.

    Turning a new file to WAL needs an exclusive lock, and SQLite answers "database is
    locked" at once there rather than calling the busy handler: processes opening a new
    store together would fail. Retry for as long as the busy timeout would have waited.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    delay = 0.001
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 0.05)


def _sqlite_begin(conn: Connection) -> None:
    # A write transaction (see `transaction`) takes the write lock up front, so it waits out
    # busy_timeout rather than failing to upgrade a read lock. Anything else begins DEFERRED:
    # a reader takes no lock, and with WAL never blocks a writer, nor another reader.
    write = conn.get_execution_options().get(_WRITE, False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def check_reachable(engine: Engine) -> None:
    """Connect once, turning a dead server into a message that says what to check."""
    with connect(engine):
        pass


def connect(engine: Engine) -> Connection:
    """A connection, or `StoreUnreachable` with the server's reason and what to do.

    Every read and write of the store connects through here, so a server that went away
    in the middle of an experiment is one line that names it, not a driver traceback.
    """
    try:
        return engine.connect()
    except DBAPIError as exc:
        url = engine.url.render_as_string(hide_password=True)
        reason = mask(str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc))
        if isinstance(exc, OperationalError):
            raise StoreUnreachable(
                f"cannot reach the store at {url} ({reason}); start the server or fix "
                "LAB_STORE_URL / the store URL"
            ) from None
        raise StoreError(  # the driver refused the URL itself: an unknown option, say
            f"cannot connect to the store at {url} ({reason}); fix LAB_STORE_URL / the store URL"
        ) from None


@contextmanager
def transaction(engine: Engine) -> Iterator[Connection]:
    """One write transaction: committed when the block ends, rolled back if it raises.

    On SQLite it begins IMMEDIATE (takes the write lock at once); reads outside it don't.
    """
    with connect(engine) as conn:
        conn.execution_options(**{_WRITE: True})
        with conn.begin():
            yield conn
