"""The rows of a SQL query on a SQLite store file, for the tests that compare exact rows."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any


def rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    """`sql`'s rows from the SQLite file `db` (opened and closed here)."""
    con = sqlite3.connect(db)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()
