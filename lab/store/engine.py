"""Engines, the checks made before a store is opened, and the one helper that opens a
transaction.

SQLAlchemy is imported by the functions that make and use engines, not by this module:
commands that only read open a store through `reader_connection` (the DB-API driver itself,
with the same checks and the same one-line errors) and never import it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import struct
import threading
import time
import urllib.parse
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab._json import finite_json
from lab._secrets import mask
from lab.errors import (
    NoStore,
    NotADatabase,
    SchemaTooOld,
    StoreDamaged,
    StoreError,
    StoreReadOnly,
    StoreUnreachable,
    UnknownScheme,
)
from lab.store.tables import TABLES

# URLs are read by lab.store.urls, and named here too, where the engines are made from them
from lab.store.urls import DEFAULT_URL as DEFAULT_URL
from lab.store.urls import HTTP_SCHEMES as HTTP_SCHEMES
from lab.store.urls import StoreURL as StoreURL
from lab.store.urls import resolve_url as resolve_url
from lab.store.urls import shown as shown

if TYPE_CHECKING:  # SQLAlchemy is imported where an engine is made: reading a store needs none
    import sqlalchemy as sa
    from sqlalchemy.engine import Connection, Engine

SQLITE_BUSY_TIMEOUT_MS = 60_000
_WRITE = "lab_write"  # execution option: this connection's transactions write


def dumps_json(value: Any) -> str:
    """JSON for the store: non-finite floats become strings, since JSON has no NaN."""
    return json.dumps(finite_json(value), ensure_ascii=False, default=str)


def make_engine(url: str, *, readonly: bool = False, create: bool = True) -> Engine:
    """An engine for `url`, with SQLite's WAL, busy timeout and foreign keys switched on.

    `readonly` is for commands that only read: a SQLite file is opened with
    ``mode=ro`` (never created, never switched to WAL, never written), PostgreSQL sessions
    are read-only transactions, and the errors a damaged file or an older schema raises
    while reading become one-line `StoreError`s. Without it, a SQLite file that cannot be
    written, or is not a database, is refused before SQLite opens it, so a refusal leaves
    the file and its folder exactly as they were. `create=False` refuses a SQLite file that
    does not exist (`NoStore`) instead of creating it and its folder.
    """
    import sqlalchemy as sa
    from sqlalchemy.exc import NoSuchModuleError

    url = _sql_url(url)
    parsed = url.parsed
    try:
        if parsed.get_backend_name() == "sqlite":
            engine = _sqlite_engine(url, parsed.database, readonly=readonly, create=create)
        else:
            connect_args: dict[str, Any] = {"connect_timeout": 10}
            if readonly:
                connect_args["options"] = _PG_READ_ONLY
            engine = sa.create_engine(
                parsed, json_serializer=dumps_json, pool_pre_ping=True, connect_args=connect_args
            )
    except NoSuchModuleError:
        raise UnknownScheme(f"no SQLAlchemy driver for {parsed.drivername!r}") from None
    except ModuleNotFoundError as exc:
        raise UnknownScheme(
            f"the driver for {parsed.drivername!r} is not installed ({exc.name}); "
            "run: pip install 'lab[postgres]'"
        ) from None
    if readonly:
        sa.event.listen(engine, "handle_error", _reading_error)
    return engine


def _sql_url(url: str) -> StoreURL:
    """`url` resolved, refused when it names a `lab serve` server rather than a database."""
    url = resolve_url(url)
    if url.backend in HTTP_SCHEMES:
        raise UnknownScheme(
            f"{url.shown} is a lab serve server, not a SQL store; open it with "
            "lab.store.open_store(url) or lab.store.http.HttpStore(url)"
        )
    return url


def reader_connection(url: str) -> Any:
    """A DB-API connection to the store at `url` for commands that only read, made without
    SQLAlchemy: a SQLite file opened by `sqlite3` as `make_engine` opens it read-only
    (checked first, never created, ``mode=ro``), or a `psycopg` connection whose
    transactions are read-only. A store that cannot be opened is one line, as `connect`
    says it. `lab.store.reader.Reader` reads through it, with `lab.store.sql.Sql`."""
    url = _sql_url(url)
    if url.backend == "sqlite":
        database = url.database
        target, uri = ":memory:", False
        if database and database != ":memory:":
            path = Path(database).expanduser()
            _check_sqlite_file(path, url)
            target, uri = _readonly_uri(path), True
        try:
            conn = sqlite3.connect(
                target, uri=uri, timeout=SQLITE_BUSY_TIMEOUT_MS / 1000, check_same_thread=False
            )
            _sqlite_reader_pragmas(conn, None)
            _remember_file(conn, None)
        except sqlite3.Error as exc:
            operational = isinstance(exc, sqlite3.OperationalError)
            raise connect_error(exc, url.shown, "sqlite", operational=operational) from None
        return conn
    try:
        import psycopg
    except ModuleNotFoundError as exc:
        raise UnknownScheme(
            f"the driver for {url.parts.drivername!r} is not installed ({exc.name}); "
            "run: pip install 'lab[postgres]'"
        ) from None
    from psycopg.abc import ConnParam
    from psycopg.conninfo import make_conninfo

    parts = url.parts
    # the keywords SQLAlchemy's psycopg dialect gives, its connect_args last; a query value
    # is written as psycopg writes any value into the connection string, by str()
    params: dict[str, ConnParam] = {
        "host": parts.host, "port": parts.port, "user": parts.username,
        "password": parts.password, "dbname": parts.database,
        **{key: str(value) for key, value in parts.query.items()},
        "connect_timeout": 10, "options": _PG_READ_ONLY,
    }  # fmt: skip
    try:
        return psycopg.connect(make_conninfo("", **params), autocommit=True)
    except psycopg.Error as exc:
        operational = isinstance(exc, psycopg.OperationalError)
        raise connect_error(exc, url.shown, "postgresql", operational=operational) from None


#: A read-only PostgreSQL session: every transaction in it is read-only.
_PG_READ_ONLY = "-c default_transaction_read_only=on"


def _sqlite_engine(url: StoreURL, database: str | None, *, readonly: bool, create: bool) -> Engine:
    import sqlalchemy as sa

    connect_args: dict[str, Any] = {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}
    options: dict[str, Any] = {}
    if database and database != ":memory:":
        path = Path(database).expanduser()
        if readonly:
            _check_sqlite_file(path, url)
            uri = _readonly_uri(path)
            timeout = SQLITE_BUSY_TIMEOUT_MS / 1000
            options["creator"] = lambda: sqlite3.connect(
                uri, uri=True, timeout=timeout, check_same_thread=False
            )
        else:
            if not create and not path.exists():
                raise _no_store(path, url, "this command never creates one")
            _check_writable(path, url)
    else:
        # Each connection to :memory: is a database of its own: share one, so the
        # metric writer's thread sees the tables the opening thread created.
        options["poolclass"] = sa.pool.StaticPool
        connect_args["check_same_thread"] = False
    engine = sa.create_engine(
        url.parsed,
        json_serializer=dumps_json,
        connect_args=connect_args,
        **options,
    )
    sa.event.listen(engine, "connect", _sqlite_reader_pragmas if readonly else _sqlite_pragmas)
    sa.event.listen(engine, "connect", _remember_file)
    # SQLAlchemy's pysqlite BEGIN handling: let us issue BEGIN ourselves.
    sa.event.listen(engine, "begin", _sqlite_begin)
    return engine


_MAGIC = b"SQLite format 3\x00"


def _no_store(path: Path, url: str, why: str) -> NoStore:
    return NoStore(
        f"no store at {path} ({why}); record an experiment into it (lab run, lab quickstart) "
        f"or create an empty one: lab db upgrade --store {shown(url)}"
    )


#: The SQLite files, as (device, inode), that this process has checked or connected to.
#: Reading a file's header means opening and closing it, and closing any descriptor of a
#: file drops every POSIX lock this process holds on it: among them the SHARED lock that
#: each of its SQLite connections in WAL mode holds on the database. Without that lock,
#: another process that closes what it takes for the last connection checkpoints and
#: deletes the WAL and its -shm file under ours, and our connections then read a stale
#: snapshot forever and write into a deleted WAL: their writes are lost. So a file is read
#: by `_check_sqlite_file` at most once per process, before any connection to it.
_SEEN_FILES: set[tuple[int, int]] = set()
_SEEN_LOCK = threading.Lock()


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()  # a stat opens nothing: no lock is dropped
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _remember_file(dbapi_conn: Any, _record: Any) -> None:
    """On each new connection: remember its database file, so that no later check in this
    process opens (and so unlocks) it. See `_SEEN_FILES`."""
    cur = dbapi_conn.cursor()
    try:
        files = [row[2] for row in cur.execute("PRAGMA database_list") if row[2]]
    finally:
        cur.close()
    for name in files:
        seen = _file_id(Path(name))
        if seen is not None:
            with _SEEN_LOCK:
                _SEEN_FILES.add(seen)


def _check_sqlite_file(path: Path, url: str) -> None:
    """Refuse a path that holds no SQLite database, before SQLite opens (or creates) it.

    Reads the 100-byte header only, and only of a file this process has not checked or
    connected to yet (see `_SEEN_FILES`): checked once, a file stays checked. A lab store
    is in WAL mode; when no ``-wal`` file is beside it (so no connection has it open), the
    header's page count must fit in the file: a copy cut short is refused here, before a
    reader leaves ``-wal``/``-shm`` files next to a file that cannot be read anyway.
    """
    if not path.exists():
        raise _no_store(path, url, "commands that only read never create one")
    if path.is_dir():
        raise NotADatabase(
            f"{path} is a folder, not a store; point --store / LAB_STORE_URL at a "
            "SQLite file, e.g. sqlite:///lab.db"
        )
    seen = _file_id(path)
    with _SEEN_LOCK:
        if seen in _SEEN_FILES:
            return
    try:
        with path.open("rb") as f:
            header = f.read(100)
        size = path.stat().st_size
    except OSError as exc:
        raise StoreError(
            f"cannot read {path} ({exc.strerror or exc}); check its permissions"
        ) from None
    if not header:
        return  # an empty file is an empty database
    if seen is not None:  # (None: its stat failed, so it is checked again next time)
        with _SEEN_LOCK:
            _SEEN_FILES.add(seen)
    if header[: len(_MAGIC)] != _MAGIC[: len(header)]:
        raise NotADatabase(
            f"{path} is not a SQLite database (its first bytes are not the SQLite header); "
            "point --store / LAB_STORE_URL at a lab store"
        )
    if len(header) < 100:
        return  # (being written by another process's first commit): SQLite judges it
    wal_mode = header[18] == 2 and header[19] == 2
    change, pages, valid_for = (struct.unpack(">I", header[i : i + 4])[0] for i in (24, 28, 92))
    page_size = struct.unpack(">H", header[16:18])[0]
    page_size = 65536 if page_size == 1 else page_size
    wal = path.with_name(path.name + "-wal")
    if wal_mode and change == valid_for and pages and not wal.exists() and size < pages * page_size:
        raise StoreDamaged(
            f"{path} is damaged: it is {size} bytes but its header says "
            f"{pages * page_size} (a copy cut short?); restore it from a backup "
            f"({path.name}.bak-*) or copy it again"
        )


def _readonly_uri(path: Path) -> str:
    """A ``mode=ro`` URI for `path`, ``immutable`` where the folder cannot be written.

    A reader of a WAL database needs its ``-shm`` file, and creates it when it can. In a
    folder that cannot be written (a read-only mount, a shared archive) it cannot, and
    SQLite then opens the file only as immutable; nothing can write there either, so
    nothing changes under the reader.
    """
    quoted = urllib.parse.quote(str(path.resolve()))
    shm = path.with_name(path.name + "-shm")
    if not os.access(path.parent, os.W_OK) and not shm.exists():
        return f"file:{quoted}?mode=ro&immutable=1"
    return f"file:{quoted}?mode=ro"


def _check_writable(path: Path, url: str) -> None:
    """Refuse a store `lab` cannot write, before SQLite touches it; create its folder."""
    if path.exists():
        _check_sqlite_file(path, url)
        folder = path.parent
        if not os.access(path, os.W_OK) or not os.access(folder, os.W_OK):
            what = "file" if not os.access(path, os.W_OK) else f"folder {folder}"
            raise StoreReadOnly(
                f"{path} cannot be written (its {what} is read-only); recording needs a "
                "store lab can write: fix the permissions or use another --store; "
                "lab ls, show and export read it as it is"
            )
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreReadOnly(
            f"cannot create the folder of {path} ({exc.strerror or exc}); choose a "
            "--store / LAB_STORE_URL in a folder lab can write"
        ) from None
    if not os.access(path.parent, os.W_OK):
        raise StoreReadOnly(
            f"cannot create {path}: its folder {path.parent} is read-only; choose a "
            "--store / LAB_STORE_URL in a folder lab can write"
        )


def _sqlite_reader_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # As `_sqlite_pragmas`, without what writes: the journal mode is the file's business.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cur.close()


#: Engines whose database is at an older schema revision than this lab's: reads that miss
#: a column or table there are refused with the upgrade command, not a driver error.
_OLDER: weakref.WeakKeyDictionary[Engine, str] = weakref.WeakKeyDictionary()


def mark_older(engine: Engine, revision: str, head: str) -> None:
    """Note that `engine`'s database is at `revision`, older than `head`: a read that
    needs what the upgrade adds then says to run ``lab db upgrade``."""
    _OLDER[engine] = older(revision, head)


def older(revision: str, head: str) -> str:
    """How `reading_error` names a revision older than this lab's `head`."""
    return f"{revision}, older than this lab's {head},"


def sqlite_error(exc: BaseException, where: str) -> StoreError | None:
    """The one-line `StoreError` for a SQLite error that says the file itself is bad (not
    a database, damaged, read-only), or None for any other error."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    low = text.lower()
    if "file is not a database" in low:
        return NotADatabase(
            f"{where} is not a SQLite database ({text}); point --store / LAB_STORE_URL at "
            "a lab store"
        )
    if "malformed" in low or "corrupt" in low:
        return StoreDamaged(
            f"{where} is damaged ({text}); restore it from a backup (*.bak-*) or copy it again"
        )
    if "readonly database" in low:
        return StoreReadOnly(
            f"{where} cannot be written ({text}); recording needs a store lab can write: "
            "fix the permissions or use another --store; lab ls, show and export read it "
            "as it is"
        )
    return None


def _reading_error(ctx: sa.engine.ExceptionContext) -> None:
    """A read-only engine's errors as one line (`reading_error`)."""
    engine = ctx.engine
    where = engine.url.render_as_string(hide_password=True) if engine is not None else "the store"
    mapped = reading_error(ctx.original_exception, where, _OLDER.get(engine) if engine else None)
    if mapped is not None:
        raise mapped from None


def reading_error(orig: BaseException, where: str, older: str | None) -> StoreError | None:
    """What a read of a store opened read-only raised, as one line: a bad file, or a schema
    too old to read (`older`: its revision, from `older`, when it is older than this lab's);
    None for any other error. Every reader maps its driver's errors through here: a
    read-only engine, and `lab.store.sql.Sql` over a driver's own connection."""
    if isinstance(orig, sqlite3.DatabaseError):
        mapped = sqlite_error(orig, where)
        if mapped is not None:
            return mapped
    missing = type(orig).__name__ in ("UndefinedColumn", "UndefinedTable") or (
        isinstance(orig, sqlite3.OperationalError)
        and str(orig).startswith(("no such column", "no such table"))
    )
    if older and missing:
        reason = str(orig).strip().splitlines()[0]
        return SchemaTooOld(
            f"{where} is at schema revision {older} and cannot be read as it is "
            f"({reason}); upgrade it (a backup is made first): lab db upgrade --store {where}"
        )
    return None


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # Autocommit at the driver level; transactions are opened by the "begin" listener.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    _set_wal(cur)
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def _refused(cur: Any) -> bool:
    """Whether the database is one `lab` refuses to open for writing: tables named like
    lab's but no ``alembic_version`` (someone else's file, see `lab.store.migrations`).

    Switching a file to WAL rewrites its header and leaves ``-wal``/``-shm`` beside it, so
    a file that is about to be refused is left in its own journal mode: the refusal then
    leaves it byte for byte as it was. Reading the table names writes nothing; a file in
    WAL mode already, a new one and a lab store are switched (or kept) as before.
    """
    if cur.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
        return False
    names = {row[0] for row in cur.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    return "alembic_version" not in names and not names.isdisjoint(TABLES)


def _set_wal(cur: Any) -> None:
    """Switch to WAL (unless the file is to be refused: `_refused`), retrying while another
    connection holds the lock that takes.

    Turning a new file to WAL needs an exclusive lock, and SQLite answers "database is
    locked" at once there rather than calling the busy handler: processes opening a new
    store together would fail. Retry for as long as the busy timeout would have waited.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    delay = 0.001
    while True:
        try:
            if not _refused(cur):
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
    from sqlalchemy.exc import DBAPIError, OperationalError

    try:
        return engine.connect()
    except DBAPIError as exc:
        where = engine.url.render_as_string(hide_password=True)
        operational = isinstance(exc, OperationalError)
        raise connect_error(
            exc.orig or exc, where, engine.dialect.name, operational=operational
        ) from None


def connect_error(
    orig: BaseException, where: str, dialect: str, *, operational: bool
) -> StoreError:
    """Why a store could not be connected to, as one line that says what to do: a bad
    SQLite file, a path that cannot be opened, a server that does not answer
    (`operational`: the driver's OperationalError), or a URL the driver refused."""
    if isinstance(orig, sqlite3.DatabaseError):
        mapped = sqlite_error(orig, where)
        if mapped is not None:
            return mapped
    reason = mask(str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__)
    if operational and dialect == "sqlite":
        return StoreError(
            f"cannot open the store at {where} ({reason}); check the path and its "
            "permissions, or fix LAB_STORE_URL / the store URL"
        )
    if operational:
        return StoreUnreachable(
            f"cannot reach the store at {where} ({reason}); start the server or fix "
            "LAB_STORE_URL / the store URL"
        )
    return StoreError(  # the driver refused the URL itself: an unknown option, say
        f"cannot connect to the store at {where} ({reason}); fix LAB_STORE_URL / the store URL"
    )


@contextmanager
def transaction(engine: Engine) -> Iterator[Connection]:
    """One write transaction: committed when the block ends, rolled back if it raises.

    On SQLite it begins IMMEDIATE (takes the write lock at once); reads outside it don't.
    Inside `one_transaction` on the same engine and thread, it joins that transaction.
    """
    outer = getattr(_joined, "conn", None)
    if outer is not None and outer.engine is engine:
        yield outer
        return
    with connect(engine) as conn:
        conn.execution_options(**{_WRITE: True})
        with conn.begin():
            yield conn


_joined = threading.local()


@contextmanager
def one_transaction(engine: Engine) -> Iterator[Connection]:
    """A write transaction that every `transaction` opened inside it (same engine, same
    thread) joins, so several `Store` writes commit or roll back together: `lab serve`
    records a batch of writes and its (client, seq) in one transaction, so a batch sent
    twice is either wholly stored once or not at all."""
    with transaction(engine) as conn:
        _joined.conn = conn
        try:
            yield conn
        finally:
            _joined.conn = None
