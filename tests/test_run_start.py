"""What a script's run imports before its first step: only what writing needs. Reading
(DuckDB, pyarrow, pandas), migrating (Alembic: a new SQLite store is made from the models),
drawing (rich, matplotlib) and serving (httpx) wait until they are used; SQLAlchemy's ORM
(the tables are plain Core tables) and its PostgreSQL dialect (a SQLite store) are never
imported. Each case is a
real subprocess recording a real run into a real SQLite file, new and existing."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
READERS_ONLY = ("alembic", "duckdb", "pyarrow", "pandas", "matplotlib", "rich", "httpx")
NOT_FOR_SQLITE_WRITES = ("sqlalchemy.orm", "sqlalchemy.dialects.postgresql")

# one run of a script, up to its first step; then the modules it imported, of those in argv[4]
_RUN = """
import json, sys
import torch
import lab
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with lab.start_run(sys.argv[2], store=sys.argv[1], quiet=True, output_dir=sys.argv[3]) as run:
    with lab.RunHandle(run, model, opt, num_steps=2) as loop:
        for step in loop.steps():
            if step == 1:
                print(json.dumps(sorted(m for m in json.loads(sys.argv[4]) if m in sys.modules)))
            loop.end_step({"loss": 1.0 / step})
"""


def _imported(url: str, experiment: str, folder: Path) -> list[str]:
    watched = json.dumps(READERS_ONLY + NOT_FOR_SQLITE_WRITES)
    out = subprocess.run(
        [sys.executable, "-c", _RUN, url, experiment, str(folder), watched],
        capture_output=True, text=True, timeout=180, cwd=folder,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("existing", [False, True], ids=["new store", "existing store"])
def test_a_run_starts_without_importing_what_only_readers_need(
    tmp_path: Path, existing: bool
) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    if existing:
        assert _imported(url, "before", tmp_path) == []
    assert _imported(url, "script", tmp_path) == []
    con = sqlite3.connect(tmp_path / "lab.db")
    try:
        rows = con.execute(
            "SELECT e.name, m.step, m.value FROM metrics m JOIN runs USING (run_id) "
            "JOIN experiments e USING (experiment_id) ORDER BY e.name, m.step"
        ).fetchall()
    finally:
        con.close()
    assert rows == [*([("before", 1, 1.0), ("before", 2, 0.5)] if existing else []),
                    ("script", 1, 1.0), ("script", 2, 0.5)]  # fmt: skip
