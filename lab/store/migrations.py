"""Bringing a database to the schema this `lab` knows, with Alembic, safely.

Opening a store upgrades an empty or older database. A database migrated by a newer `lab`
is refused with the command to run.

Many processes may open one store at the same moment (a sweep starting on a cluster, or
eight workers on one machine), so an upgrade runs under a lock held by the database
itself, never a lock file (which a network file system or a second machine would not
see): PostgreSQL's transaction-level advisory lock, SQLite's write lock (`BEGIN
IMMEDIATE`). The revision is read only once the lock is held, so a process that waited
finds the schema at head and does nothing. Before an upgrade changes a SQLite file that
holds data, the file is backed up next to itself.
"""

from __future__ import annotations

import functools
import logging
import re
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from lab._secrets import logger
from lab.errors import NotALabStore, SchemaTooNew, StoreError
from lab.store.engine import (
    _WRITE,
    SQLITE_BUSY_TIMEOUT_MS,
    connect,
    reader_connection,
    resolve_url,
    transaction,
)
from lab.store.sql import Sql
from lab.store.tables import TABLES

if TYPE_CHECKING:  # Alembic and SQLAlchemy are imported where a schema changes: reading needs none
    from alembic.config import Config
    from alembic.script import ScriptDirectory
    from sqlalchemy.engine import Connection, Engine

log = logger(__name__)
# The backup notice is printed to stderr by `upgrade` itself; without this, logging's
# last-resort handler would print it a second time when the application set up no logging.
log.addHandler(logging.NullHandler())

#: The key of the PostgreSQL advisory lock that upgrades take: ASCII "lab_migr" as a
#: signed 64-bit integer. Advisory locks are per database, so stores on one server don't
#: wait for each other.
PG_MIGRATION_LOCK_KEY = 0x6C61625F6D696772


class Upgraded(tuple[str | None, str | None]):
    """What `upgrade` did: ``(before, after)`` (so ``before, after = upgrade(e)`` works),
    and `backup`, the copy of the SQLite file made before changing it, if one was made."""

    backup: Path | None

    def __new__(cls, before: str | None, after: str | None, backup: Path | None = None) -> Upgraded:
        self = super().__new__(cls, (before, after))
        self.backup = backup
        return self

    @property
    def before(self) -> str | None:
        """The revision the database was at (None: empty)."""
        return self[0]

    @property
    def after(self) -> str | None:
        """The revision the database is at now."""
        return self[1]

    def __repr__(self) -> str:
        return f"Upgraded(before={self[0]!r}, after={self[1]!r}, backup={self.backup!r})"


def migrations_dir() -> Path:
    """Where the Alembic scripts are: inside the wheel, or at the top of a source checkout."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "_migrations", package.parent / "migrations"):
        if (candidate / "env.py").exists():
            return candidate
    raise FileNotFoundError(f"lab's migrations are missing (looked in {package})")


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic config over `lab`'s scripts; with `connection`, migrations run on it."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@functools.cache
def _scripts() -> ScriptDirectory:
    # Loading the revision files costs milliseconds, and every `Store()` asks for the head:
    # they don't change while a process runs, so load them once.
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config())


_REVISION = re.compile(r'^revision: str = "([^"]+)"$', re.M)
_DOWN_REVISION = re.compile(r'^down_revision: str \| None = (?:"([^"]+)"|None)$', re.M)


@functools.cache
def revisions() -> dict[str, str | None]:
    """Each of this `lab`'s revisions and the one it revises, read from the scripts' own
    headers without importing Alembic (about 70 ms that `lab ls` would otherwise pay).
    tests/test_migrations.py holds it equal to Alembic's view of the same scripts."""
    found: dict[str, str | None] = {}
    for script in sorted((migrations_dir() / "versions").glob("*.py")):
        text = script.read_text(encoding="utf-8")
        revision, down = _REVISION.search(text), _DOWN_REVISION.search(text)
        if revision is None or down is None:
            raise StoreError(f"{script} has no revision header; lab's migrations are damaged")
        found[revision.group(1)] = down.group(1)
    return found


def head_revision() -> str:
    """The newest revision this `lab` knows."""
    chain = revisions()
    heads = set(chain) - set(chain.values())
    if len(heads) != 1:
        raise StoreError(f"lab's migrations have {len(heads)} heads; reinstall lab")
    return heads.pop()


def is_known(revision: str) -> bool:
    """Whether `revision` is the exact id of one of this `lab`'s own (False for a newer lab's).

    Alembic's lookup also takes symbols ("head") and unique prefixes; a database's revision
    is a full id, so only a full id counts here.
    """
    return bool(revision) and revision in revisions()


_SQLITE_TABLES = "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
# the tables (plain and partitioned) of the schema that names without one resolve to
_PG_TABLES = (
    "SELECT c.relname FROM pg_catalog.pg_class c "
    "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
    "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p') ORDER BY c.relname"
)


def table_names(sql: Sql) -> list[str]:
    """The tables of the database, sorted (PostgreSQL: of its current schema, where lab's
    tables and Alembic's ``alembic_version`` are made)."""
    return [name for (name,) in sql.rows(_SQLITE_TABLES if sql.dialect == "sqlite" else _PG_TABLES)]


def revision_of(sql: Sql) -> str | None:
    """The revision recorded in the database (None: never migrated), as Alembic reads it:
    the one row of ``alembic_version``."""
    if "alembic_version" not in table_names(sql):
        return None
    rows = [version for (version,) in sql.rows("SELECT version_num FROM alembic_version")]
    if len(rows) > 1:
        raise NotALabStore(
            f"{sql.where} records {len(rows)} schema revisions ({', '.join(sorted(rows))}); "
            "lab's schema has one line of revisions, so this is not a lab store"
        )
    return rows[0] if rows else None


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at, or None when it has never been migrated."""
    with engine.connect() as conn:
        return revision_of(Sql(conn))


@contextmanager
def migration_transaction(engine: Engine) -> Iterator[Connection]:
    """The one transaction a migration runs in, upgrade or downgrade.

    On SQLite, a revision that changes a CHECK rebuilds the table (Alembic's batch mode:
    copy, drop, rename), and dropping a table that others reference with ON DELETE CASCADE
    deletes their rows while foreign keys are on. So foreign keys are off for the
    migration (a pragma SQLite honours only outside a transaction), checked with
    ``PRAGMA foreign_key_check`` before the commit, and on again after, as SQLite's own
    procedure for schema changes says.
    """
    if engine.dialect.name != "sqlite":
        with transaction(engine) as conn:
            yield conn
        return
    with connect(engine) as conn:
        raw = conn.connection.driver_connection  # outside SQLAlchemy's transaction: no BEGIN
        assert raw is not None  # (None only once the connection is closed)
        raw.execute("PRAGMA foreign_keys=OFF")
        try:
            conn.execution_options(**{_WRITE: True})
            with conn.begin():
                yield conn
                broken = conn.exec_driver_sql("PRAGMA foreign_key_check").first()
                if broken is not None:
                    raise StoreError(
                        f"the migration left a row of {broken[0]} that points at no row of "
                        f"{broken[2]}; nothing was changed"
                    )
        finally:
            raw.execute("PRAGMA foreign_keys=ON")


def upgrade(engine: Engine, revision: str = "head") -> Upgraded:
    """Upgrade the database to `revision` under the database's own lock; returns
    ``(before, after)`` with the backup made first, if any, as ``.backup``.

    Every step runs in one transaction that takes the lock first and only then reads the
    revision: of many processes upgrading one store at once, one migrates and the others,
    once it commits, find nothing to do. A SQLite file with data in it is backed up first,
    under the same lock, and the backup is announced on stderr and in the log.
    """
    with migration_transaction(engine) as conn:  # SQLite: BEGIN IMMEDIATE, the write lock
        if conn.dialect.name == "postgresql":
            import sqlalchemy as sa

            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(PG_MIGRATION_LOCK_KEY)))
        before = _check(conn)
        target = _resolve(revision)
        backup = None
        if before is None and target == head_revision() and conn.dialect.name == "sqlite":
            create_at_head(conn)
        elif _moves_up(before, target):
            backup = _backup_sqlite(conn, before, target)
            from alembic import command

            command.upgrade(alembic_config(conn), revision)
        after = revision_of(Sql(conn))
    return Upgraded(before, after, backup)


def readable_revision(sql: Sql, *, empty_ok: bool = False, newer_ok: bool = False) -> str | None:
    """The revision of a database that commands which only read may read, after refusing
    what they cannot: an empty database (unless `empty_ok`, returning None), someone
    else's tables, a newer schema (unless `newer_ok`). Nothing is created, migrated or
    locked.

    An older revision is returned as it is: reads go ahead, and one that needs what an
    upgrade would add is refused with the ``lab db upgrade`` line (see
    `lab.store.engine.mark_older`).
    """
    url = sql.where
    current = revision_of(sql)
    if current is not None and is_known(current):
        return current
    tables = [t for t in table_names(sql) if not t.startswith("sqlite_")]
    ours = sorted(set(TABLES) & set(tables))
    if current is not None:
        if ours and newer_ok:
            return current
        if ours:
            raise _too_new(url, current)
        raise NotALabStore(
            f"{url} is not a lab store: its alembic_version says {current} and it holds none "
            "of lab's tables; point --store / LAB_STORE_URL at a lab store"
        )
    if ours:
        raise NotALabStore(
            f"{url} has tables named like lab's ({', '.join(ours)}) but no alembic_version; "
            "point --store / LAB_STORE_URL at a lab store"
        )
    if tables:
        shown = ", ".join(tables[:5]) + (", ..." if len(tables) > 5 else "")
        raise NotALabStore(
            f"{url} is not a lab store: it holds other tables ({shown}) and none of lab's; "
            "point --store / LAB_STORE_URL at a lab store"
        )
    if empty_ok:
        return None
    raise NotALabStore(
        f"{url} holds no lab store yet (no tables); record an experiment into it "
        f"(lab run, lab quickstart) or create the schema: lab db upgrade --store {url}"
    )


def read_revision(url: str | None = None) -> str | None:
    """The revision of the store at `url` (None: an empty database), read without creating,
    migrating or writing anything; refuses a missing store, a file that is not one, and
    someone else's tables. What ``lab db current`` prints."""
    url = resolve_url(url)
    conn = reader_connection(url)
    try:
        return readable_revision(Sql(conn, where=url.shown), empty_ok=True, newer_ok=True)
    finally:
        conn.close()


def ensure_schema(engine: Engine) -> None:
    """Make the database usable by this `lab`: create or upgrade it, or refuse it.

    At head (every open but the first) this is one read that takes no lock, so opening a
    store never waits for another process's writes.
    """
    with engine.connect() as conn:
        current = revision_of(Sql(conn))
    if current == head_revision():
        return
    if current is not None and not is_known(current):  # refused at once, without the lock
        raise _too_new(engine.url.render_as_string(hide_password=True), current)
    # Anything else is judged under the lock: on PostgreSQL two reads outside it may see
    # two different moments (before and after another process's migration commits).
    upgrade(engine)


#: What Alembic's own ``alembic_version`` table is, word for word, so that a database made by
#: `create_at_head` is one Alembic recognises and upgrades (tests/test_migrations.py holds the
#: two equal).
_VERSION_TABLE = (
    "CREATE TABLE alembic_version (\n"
    "\tversion_num VARCHAR(32) NOT NULL, \n"
    "\tCONSTRAINT alembic_version_pkc PRIMARY KEY (version_num)\n"
    ")"
)


def create_at_head(conn: Connection) -> None:
    """Create the schema at head in an empty SQLite database, from the models, and stamp it
    with the head revision, inside `conn`'s transaction.

    Why: running every migration from the first, through Alembic, costs a new store about
    0.4 s (most of it importing Alembic), paid by the first run a script records. The
    models are the schema at head (tests/test_migrations.py holds a database made this way
    equal to one the migrations made: tables, columns, keys, indexes, WITHOUT ROWID), so
    the result is the same database, and every later revision upgrades it as usual.
    """
    from lab.store.schema import Base  # the models: SQLAlchemy, which a store imports anyway

    Base.metadata.create_all(conn)
    if "alembic_version" not in table_names(Sql(conn)):  # kept, empty, by a downgrade to base
        conn.exec_driver_sql(_VERSION_TABLE)
    conn.exec_driver_sql("INSERT INTO alembic_version (version_num) VALUES (?)", (head_revision(),))


def _resolve(revision: str) -> str | None:
    """The id `revision` names ("head" -> "0002"), or itself when it is relative ("+1")."""
    if revision == "head":  # without Alembic: a new store is made without it
        return head_revision()
    from alembic.util.exc import CommandError

    try:
        script = _scripts().get_revision(revision)
    except CommandError:
        return revision
    return None if script is None else script.revision


def _moves_up(before: str | None, target: str | None) -> bool:
    """Whether upgrading from `before` to `target` has anything to do (Alembic does nothing,
    silently, when asked to "upgrade" to an older revision)."""
    if before == target:
        return False
    if before is None:
        return True
    from alembic.util.exc import CommandError

    try:
        return any(s.revision == before for s in _scripts().iterate_revisions(target, "base"))
    except CommandError:  # a relative target ("+1"): let Alembic work it out
        return True


def _check(conn: Connection) -> str | None:
    """The current revision, after refusing a newer schema or a database that isn't ours."""
    sql = Sql(conn)
    current = revision_of(sql)
    url = sql.where
    if current is None:
        ours = set(TABLES) & set(table_names(sql))
        if ours:
            raise NotALabStore(
                f"{url} has tables named like lab's ({', '.join(sorted(ours))}) but no "
                "alembic_version; point --store / LAB_STORE_URL at a lab store or a new database"
            )
        return None
    if not is_known(current):
        raise _too_new(url, current)
    return current


def _too_new(url: str, current: str) -> SchemaTooNew:
    return SchemaTooNew(
        f"{url} is at schema revision {current}, newer than this lab knows "
        f"({head_revision()}); upgrade lab: pip install -U lab"
    )


def _sqlite_file(conn: Connection) -> Path | None:
    """The file behind a SQLite connection's main database; None when it is in memory."""
    for _seq, name, file in conn.exec_driver_sql("PRAGMA database_list"):
        if name == "main":
            return Path(file) if file else None
    return None


def _backup_sqlite(conn: Connection, before: str | None, target: str | None) -> Path | None:
    """Copy a SQLite store that holds data next to itself before `conn` upgrades it.

    `conn` holds the write lock, so nothing commits between this copy and the upgrade; a
    second connection reads the file meanwhile, which WAL allows. The online backup API
    copies what the WAL file holds too, which copying the main file would miss.
    """
    if conn.dialect.name != "sqlite" or before is None:
        return None
    path = _sqlite_file(conn)
    if path is None:
        return None
    has_data = conn.exec_driver_sql(
        "SELECT EXISTS (SELECT 1 FROM experiments) OR EXISTS (SELECT 1 FROM runs)"
    ).scalar()
    if not has_data:
        return None
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    backup = path.with_name(f"{path.name}.bak-{before}-{stamp}")
    n = 1
    while backup.exists():  # two upgrades within a second: never overwrite a backup
        n += 1
        backup = path.with_name(f"{path.name}.bak-{before}-{stamp}-{n}")
    try:
        source = sqlite3.connect(path, timeout=SQLITE_BUSY_TIMEOUT_MS / 1000)
        try:
            copy = sqlite3.connect(backup)
            try:
                source.backup(copy)
                # The copy inherits WAL from the header; make it one self-contained file.
                copy.execute("PRAGMA journal_mode=DELETE")
            finally:
                copy.close()
        finally:
            source.close()
    except (sqlite3.Error, OSError) as exc:
        backup.unlink(missing_ok=True)
        raise StoreError(
            f"could not back up {path} to {backup} before upgrading its schema "
            f"({exc}); nothing was changed: make room or fix permissions in {path.parent}, "
            "then open the store again"
        ) from exc
    message = f"backed up {path} to {backup} before upgrading its schema {before} -> {target}"
    log.warning(message)
    print(f"lab: {message}", file=sys.stderr, flush=True)
    return backup
