"""Alembic environment: batch mode on SQLite, and a shared connection when `lab` passes one."""

from __future__ import annotations

from alembic import context

from lab.store.engine import make_engine, resolve_url
from lab.store.schema import Base, compared_on

config = context.config
target_metadata = Base.metadata


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        include_object=compared_on(connection.dialect.name),
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    engine = make_engine(resolve_url(config.get_main_option("sqlalchemy.url")))
    with engine.connect() as conn:
        _run(conn)
        conn.commit()
