"""A writer process with no lab in it: raw sqlite3 writing the points of a fit into a table
shaped as the store's `metrics` (its primary key, WAL, ``synchronous=NORMAL``), one
transaction per batch. bench/writer_ab.py's ``bare_raw`` and ``bare_after`` arms drive it
from a bare loop, to measure what writing the rows at all costs the fit on this machine,
whatever the design that hands them over; ``bare_raw_norowid`` does the same into the table
made ``WITHOUT ROWID`` (one B-tree instead of the table's and its key's).

The frames from the parent, 16 bytes each (``<qq``: an op and its argument):

    OPEN n      a fresh database at the path in the n bytes that follow; answered
    WRITE s     insert the points of every step up to s not yet written, and commit
    SYNC 0      answered once every WRITE before it is committed

Each answer is one byte. The process ends when its input closes.

    python bench/_raw_writer.py <metrics per step> [without_rowid]
"""

from __future__ import annotations

import sqlite3
import struct
import sys

FRAME = struct.Struct("<qq")
OPEN, WRITE, SYNC = 0, 1, 2
SCHEMA = (
    "CREATE TABLE metrics (run_id INTEGER NOT NULL, key VARCHAR(255) NOT NULL, "
    "step BIGINT NOT NULL, value DOUBLE, wall_time DOUBLE NOT NULL, "
    "PRIMARY KEY (run_id, key, step))"
)
NO_ROWID = " WITHOUT ROWID"
INSERT = "INSERT INTO metrics VALUES (?, ?, ?, ?, ?)"


def main() -> None:
    keys = [f"key_{i}" for i in range(int(sys.argv[1]))]
    schema = SCHEMA + (NO_ROWID if sys.argv[2:] == ["without_rowid"] else "")
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    conn: sqlite3.Connection | None = None
    written = 0
    while len(frame := source.read(FRAME.size)) == FRAME.size:
        op, arg = FRAME.unpack(frame)
        if op == OPEN:
            if conn is not None:
                conn.close()
            conn = sqlite3.connect(source.read(arg).decode(), isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(schema)
            written = 0
        elif op == WRITE:
            assert conn is not None
            rows = [
                (1, key, step, step * 1e-3 + i, 1.7e9 + step)
                for step in range(written + 1, arg + 1)
                for i, key in enumerate(keys)
            ]
            conn.execute("BEGIN")
            conn.executemany(INSERT, rows)
            conn.execute("COMMIT")
            written = max(written, arg)
            continue
        sink.write(b"k")
        sink.flush()
    if conn is not None:
        conn.close()


if __name__ == "__main__":
    main()
