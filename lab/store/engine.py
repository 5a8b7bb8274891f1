"""Store URLs, engines and the one helper that opens a transaction."""

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
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError

from lab._json import finite_json
from lab._secrets import mask
from lab.errors import (
    ConfigError,
    NoStore,
    NotADatabase,
    SchemaTooOld,
    StoreDamaged,
    StoreError,
    StoreReadOnly,
    StoreUnreachable,
    UnknownScheme,
)

DEFAULT_URL = "sqlite:///lab.db"
#: The schemes of a `lab serve` server's URL.
HTTP_SCHEMES = ("http", "https")
SQLITE_BUSY_TIMEOUT_MS = 60_000
_WRITE = "lab_write"  # execution option: this connection's transactions write


class StoreURL(str):
    """A store URL resolved once: the text (password included) and its parsed form.

    `resolve_url` returns one, and gives one it is handed back as it is, so an
    `Experiment`, its `SqlLogger`, the `Store` and its engine share one parse of the URL.
    It pickles as its text, resolved again on arrival (a worker process).
    """

    parsed: URL

    def __new__(cls, text: str, parsed: URL) -> StoreURL:
        self = super().__new__(cls, text)
        self.parsed = parsed
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (resolve_url, (str(self),))

    def __copy__(self) -> StoreURL:
        return self  # immutable, as a str is

    def __deepcopy__(self, memo: dict[int, Any]) -> StoreURL:
        return self

    @property
    def shown(self) -> str:
        """The URL as it may be printed: its password hidden."""
        return self.parsed.render_as_string(hide_password=True)

    @property
    def backend(self) -> str:
        """``sqlite``, ``postgresql``, or ``http``/``https`` (a `lab serve` server)."""
        return self.parsed.get_backend_name()


def resolve_url(url: str | None = None) -> StoreURL:
    """The store URL to use: the argument, else ``LAB_STORE_URL``, else ``sqlite:///lab.db``.

    The one place a store URL is read: everything that opens a store (`Store`, the CLI,
    `lab.inspect`, `SqlLogger`, `Experiment`) passes its argument through here, and a
    `StoreURL` passes through unchanged. ``postgresql://`` is read as psycopg 3, the driver
    `lab` ships with. ``http(s)://host:port`` names a `lab serve` server; its token comes
    from ``LAB_TOKEN``, never from the URL, so a URL with a user or password is refused.
    """
    if isinstance(url, StoreURL):
        return url
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
    if backend in HTTP_SCHEMES:  # a `lab serve` server: lab.store.http.HttpStore
        if parsed.username is not None or parsed.password is not None:
            raise ConfigError(
                f"store URL {mask(chosen)!r} carries a user or password; give the server's "
                "URL without them and the token in LAB_TOKEN"
            )
        text = chosen.rstrip("/")
        return StoreURL(text, make_url(text))
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
            "use sqlite:///path/to/lab.db, postgresql://user:password@host/dbname or "
            "http(s)://host:port (a lab serve server)"
        )
    return StoreURL(parsed.render_as_string(hide_password=False), parsed)


def shown(url: str) -> str:
    """A store URL as it may be printed: its password hidden."""
    return resolve_url(url).shown


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
    url = resolve_url(url)
    parsed = url.parsed
    if url.backend in HTTP_SCHEMES:
        raise UnknownScheme(
            f"{url.shown} is a lab serve server, not a SQL store; open it with "
            "lab.store.open_store(url) or lab.store.http.HttpStore(url)"
        )
    try:
        if parsed.get_backend_name() == "sqlite":
            engine = _sqlite_engine(url, parsed.database, readonly=readonly, create=create)
        else:
            connect_args: dict[str, Any] = {"connect_timeout": 10}
            if readonly:
                connect_args["options"] = "-c default_transaction_read_only=on"
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


def _sqlite_engine(url: StoreURL, database: str | None, *, readonly: bool, create: bool) -> Engine:
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


def _shown(url: str) -> str:
    return resolve_url(url).shown


_MAGIC = b"SQLite format 3\x00"


def _no_store(path: Path, url: str, why: str) -> NoStore:
    return NoStore(
        f"no store at {path} ({why}); record an experiment into it (lab run, lab quickstart) "
        f"or create an empty one: lab db upgrade --store {_shown(url)}"
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
    _OLDER[engine] = f"{revision}, older than this lab's {head},"


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
    """A read-only engine's errors as one line: a bad file, or a schema too old to read."""
    orig = ctx.original_exception
    engine = ctx.engine
    where = engine.url.render_as_string(hide_password=True) if engine is not None else "the store"
    if isinstance(orig, sqlite3.DatabaseError):
        mapped = sqlite_error(orig, where)
        if mapped is not None:
            raise mapped from None
    older = _OLDER.get(engine) if engine is not None else None
    missing = type(orig).__name__ in ("UndefinedColumn", "UndefinedTable") or (
        isinstance(orig, sqlite3.OperationalError)
        and str(orig).startswith(("no such column", "no such table"))
    )
    if older and missing:
        reason = str(orig).strip().splitlines()[0]
        raise SchemaTooOld(
            f"{where} is at schema revision {older} and cannot be read as it is "
            f"({reason}); upgrade it (a backup is made first): lab db upgrade --store {where}"
        ) from None


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
    from lab.store.schema import TABLES  # the models: only where a store is written

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
    try:
        return engine.connect()
    except DBAPIError as exc:
        url = engine.url.render_as_string(hide_password=True)
        if isinstance(exc.orig, sqlite3.DatabaseError):
            mapped = sqlite_error(exc.orig, url)
            if mapped is not None:
                raise mapped from None
        reason = mask(str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc))
        if isinstance(exc, OperationalError) and engine.dialect.name == "sqlite":
            raise StoreError(
                f"cannot open the store at {url} ({reason}); check the path and its "
                "permissions, or fix LAB_STORE_URL / the store URL"
            ) from None
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
