"""The real PostgreSQL server for the tests: its admin URL, and brand-new databases on it.

``LAB_TEST_POSTGRES_URL`` names it (`.ci/run` exports it). Without it a PostgreSQL test
skips, except under ``CI=true``, where a missing server is a failure. Each database is new
and named for the pytest-xdist worker that made it, so parallel workers never share one.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa


def admin_url() -> str:
    """`LAB_TEST_POSTGRES_URL`; skips the test without it, or fails it under ``CI=true``."""
    url = os.environ.get("LAB_TEST_POSTGRES_URL")
    if url:
        return url
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail("CI=true but LAB_TEST_POSTGRES_URL is not set; .ci/run must export it")
    pytest.skip("LAB_TEST_POSTGRES_URL is not set")


@contextmanager
def new_database() -> Iterator[str]:
    """A URL to a brand-new, empty PostgreSQL database, dropped (connections and all) after."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    name = f"lab_test_{worker}_{uuid.uuid4().hex[:12]}"
    base = sa.engine.make_url(admin_url()).set(drivername="postgresql+psycopg")
    engine = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        with engine.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        engine.dispose()
