"""Many rows a statement into SQLite (`lab.store.sqlite_rows`): the same rows, in the same
order, with the same upsert meaning as one statement per row, for every count of rows
around a statement's size; a driver's error raised as SQLAlchemy raises it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from lab.store.engine import make_engine, transaction
from lab.store.sqlite_rows import MAX_BINDS, ManyRows
from lab.store.writer import rejected

_TABLE = (
    "CREATE TABLE points (k TEXT NOT NULL, step INTEGER NOT NULL, value DOUBLE, "
    "PRIMARY KEY (k, step))"
)
_UPSERT = (
    "INSERT INTO points (k, step, value) VALUES {values} "
    "ON CONFLICT (k, step) DO UPDATE SET value = excluded.value"
)
PER = MAX_BINDS // 3  # rows a statement of three values


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[sa.Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'rows.db'}")
    with transaction(engine) as conn:
        conn.exec_driver_sql(_TABLE)
        conn.exec_driver_sql("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
        conn.exec_driver_sql(
            "CREATE TABLE child (id INTEGER NOT NULL REFERENCES parent (id), n INTEGER)"
        )
    try:
        yield engine
    finally:
        engine.dispose()


def _stored(engine: sa.Engine) -> dict[tuple[str, int], float]:
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT k, step, value FROM points").all()
    return {(k, step): math.nan if value is None else value for k, step, value in rows}


def _one_by_one(rows: list[tuple[str, int, float]]) -> dict[tuple[str, int], float]:
    """What one statement per row leaves: the last row of each (k, step)."""
    return {(k, step): value for k, step, value in rows}


@pytest.mark.parametrize("count", [0, 1, PER - 1, PER, PER + 1, 3 * PER + 7])
def test_every_row_lands_for_any_count(engine: sa.Engine, count: int) -> None:
    """Whole statements, the rows left over after them, and none at all."""
    rows = [("a" if i % 2 else "b", i, i / 7) for i in range(count)]
    with transaction(engine) as conn:
        ManyRows(_UPSERT, 3)(conn, iter(rows))  # an iterator, read once
    assert _stored(engine) == _one_by_one(rows)


def test_a_row_again_in_the_same_statement_or_the_next_keeps_the_last(engine: sa.Engine) -> None:
    """A (k, step) twice in one statement, once in a statement and again in the rows left
    over, and one stored before: each ends with its last value, as one statement per row
    leaves it. NaN and +-inf are values like any other."""
    with transaction(engine) as conn:
        ManyRows(_UPSERT, 3)(conn, [("a", 0, 1.0), ("a", 1, 1.0)])
    rows = [("a", i, float(i)) for i in range(PER + 10)]
    rows[5] = ("a", 0, math.inf)  # the stored step 0, in the first statement
    rows[9] = ("a", 3, -1.0)  # step 3 again, later in the same statement
    rows[PER + 2] = ("a", 7, math.nan)  # step 7 of the first statement, in the rows left
    with transaction(engine) as conn:
        ManyRows(_UPSERT, 3)(conn, rows)
    want = _one_by_one([("a", 0, 1.0), ("a", 1, 1.0), *rows])
    assert want[("a", 0)] == math.inf and want[("a", 3)] == -1.0 and math.isnan(want[("a", 7)])
    got = _stored(engine)
    assert got.keys() == want.keys()
    assert all(got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])) for k in want)


@pytest.mark.parametrize("count", [3, PER + 3])
def test_a_rejected_row_is_sqlalchemys_integrity_error(engine: sa.Engine, count: int) -> None:
    """A row that breaks a foreign key, in a whole statement or in the rows left over: the
    transaction rolls back and the writer sees a rejection, which no retry can fix."""
    with transaction(engine) as conn:
        conn.exec_driver_sql("INSERT INTO parent (id) VALUES (1)")
    rows = [(1, i) for i in range(count)]
    rows[-1] = (2, 0)  # no parent 2
    insert = ManyRows("INSERT INTO child (id, n) VALUES {values}", 2)
    with pytest.raises(sa.exc.IntegrityError) as caught, transaction(engine) as conn:
        insert(conn, rows)
    assert "FOREIGN KEY" in str(caught.value.orig)
    assert rejected(caught.value)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM child").scalar_one() == 0
