"""Bringing a database to the schema this `lab` knows, with Alembic, safely.

Opening a store upgrades an empty or older database. A database migrated by a newer `lab`
is refused with the command to run.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy.engine import Connection, Engine

from lab.errors import NotALabStore, SchemaTooNew
from lab.store.engine import transaction
from lab.store.schema import TABLES


def migrations_dir() -> Path:
    """Where the Alembic scripts are: inside the wheel, or at the top of a source checkout."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "_migrations", package.parent / "migrations"):
        if (candidate / "env.py").exists():
            return candidate
    raise FileNotFoundError(f"lab's migrations are missing (looked in {package})")


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic config over `lab`'s scripts; with `connection`, migrations run on it."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """The newest revision this `lab` knows."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def is_known(revision: str) -> bool:
    """Whether `revision` is the exact id of one of this `lab`'s own (False for a newer lab's).

    Alembic's lookup also takes symbols ("head") and unique prefixes; a database's revision
    is a full id, so only a full id counts here.
    """
    if not revision:
        return False
    try:
        script = ScriptDirectory.from_config(alembic_config()).get_revision(revision)
    except CommandError:  # Alembic's resolution errors for an id it doesn't have
        return False
    return script is not None and script.revision == revision


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at, or None when it has never been migrated."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> tuple[str | None, str]:
    """Upgrade the database to `revision`; returns (before, after)."""
    with transaction(engine) as conn:
        before = _check(conn)
        command.upgrade(alembic_config(conn), revision)
        after = MigrationContext.configure(conn).get_current_revision()
    return before, after


def ensure_schema(engine: Engine) -> None:
    """Make the database usable by this `lab`: create or upgrade it, or refuse it."""
    with engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
    if current == head_revision():
        return
    upgrade(engine)


def _check(conn: Connection) -> str | None:
    """The current revision, after refusing a newer schema or a database that isn't ours."""
    current = MigrationContext.configure(conn).get_current_revision()
    url = conn.engine.url.render_as_string(hide_password=True)
    if current is None:
        ours = set(TABLES) & set(sa.inspect(conn).get_table_names())
        if ours:
            raise NotALabStore(
                f"{url} has tables named like lab's ({', '.join(sorted(ours))}) but no "
                "alembic_version; point LAB_STORE_URL at a new database"
            )
        return None
    if not is_known(current):
        raise SchemaTooNew(
            f"{url} is at schema revision {current}, newer than this lab knows "
            f"({head_revision()}); upgrade lab: pip install -U lab"
        )
    return current
