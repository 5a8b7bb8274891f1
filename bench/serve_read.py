"""Reading one series of 1,000,000 points from `lab serve`, downsampled to 2,000 buckets.

The store: one run with one metric of 1,000,000 steps (a noisy curve, a few NaN), written
through the `Store` API for the experiment, arm, group and run, the points generated inside
the database (SQLite: INSERT ... SELECT from a recursive CTE; PostgreSQL: generate_series),
`summaries` and `metric_blocks` filled from them. Timed, medians over rounds:

    server      GET /api/v1/runs/{id}/series?key=y&buckets=2000 through the app in-process
                (Starlette's TestClient: the handler, its SQL and its JSON; no socket)
    loopback    the same GET to a real `lab serve` (uvicorn subprocess) on 127.0.0.1
    sql         the bucketing alone (`lab.server.read.downsample`): whole blocks of 32
                steps from `metric_blocks`, the points at each bucket's edges from `metrics`,
                the buckets shared out to one connection per core (at most 4)
    sql_points  SQLite: the same cut from every point, on one connection
                (`lab.store.blocks.cut(from_points=True)`): what a run whose blocks do not
                add up costs
    floor       for scale: the min and max of the whole series in one query, the least one
                exact pass over a million values costs on that database
    all_points  for scale: every point of the series, fetched by the same store (the
                plain read a client would do without downsampling)

Target (ISSUE 14): < 200 ms at the server on SQLite. Prints one JSON line per backend.

    python bench/serve_read.py                 # SQLite
    python bench/serve_read.py --postgres URL  # and PostgreSQL (default $LAB_BENCH_POSTGRES_URL)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from _common import add_postgres_option, log, machine, scratch_database, timed

from lab.server.auth import create_token
from lab.store import Store

POINTS = 1_000_000
BUCKETS = 2000

_SQLITE_FILL = """
INSERT INTO metrics (run_id, "key", step, value, wall_time)
WITH RECURSIVE s(step) AS (SELECT 0 UNION ALL SELECT step + 1 FROM s WHERE step < :n - 1)
SELECT :run_id, 'y', step,
       CASE WHEN step % 99991 = 7 THEN NULL
            ELSE 1.0 / (1 + step / 1000.0) + ((step * 7919) % 1000) / 10000.0 END,
       1.7e9 + step * 0.01
FROM s
"""
_PG_FILL = """
INSERT INTO metrics (run_id, "key", step, value, wall_time)
SELECT :run_id, 'y', step,
       CASE WHEN step % 99991 = 7 THEN 'NaN'::float8
            ELSE 1.0 / (1 + step / 1000.0) + ((step::bigint * 7919) % 1000) / 10000.0 END,
       1.7e9 + step * 0.01
FROM generate_series(0, :n - 1) AS step
"""
_SUMMARY = """
INSERT INTO summaries (run_id, "key", "count", first_step, last_step, last_value, min_value,
                       max_value, last_wall_time)
SELECT run_id, "key", count(*), min(step), max(step), NULL, min(value), max(value), 0
FROM metrics WHERE run_id = :run_id GROUP BY run_id, "key"
"""


# The least an exact envelope can cost: one pass over the series' values, two aggregates.
_FLOOR = "SELECT min(value), max(value) FROM metrics WHERE run_id = :run_id AND \"key\" = 'y'"


def build(url: str, points: int) -> int:
    """One run with `points` points of key ``y``; returns its run id."""
    store = Store(url)
    try:
        exp = store.begin_experiment("bench-read", config={}, seed=0, repeats=1)
        arm = store.add_arm(exp, "a", overrides={}, config={})
        group = store.add_group(exp, "a", arm_id=arm)
        run = store.start_run(exp, group, run_key="a-r0", arm_id=arm, repeat=0, stage=0,
                              seed=0, config={}, output_dir=None)  # fmt: skip
        fill = _SQLITE_FILL if store.dialect == "sqlite" else _PG_FILL
        with store.engine.begin() as conn:
            conn.execute(sa.text(fill), {"run_id": run, "n": points})
            conn.execute(sa.text(_SUMMARY), {"run_id": run})
            store.metric_rows.blocks.reblock_run(
                conn, run, None
            )  # what the writer keeps with every batch
        if store.dialect == "postgresql":
            with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.exec_driver_sql("VACUUM ANALYZE metrics")
        return run
    finally:
        store.close()


def measure(url: str, rounds: int, points: int) -> dict[str, Any]:
    from fastapi.testclient import TestClient

    from lab.server import create_app
    from lab.server.read import bucket_bounds, downsample
    from lab.store import blocks

    sys_path = str(Path(__file__).resolve().parents[1])
    import sys

    sys.path.insert(0, sys_path)
    from tests.served import Served

    t0 = time.perf_counter()
    run = build(url, points)
    log(f"built {points} points in {time.perf_counter() - t0:.1f} s")
    store = Store(url)
    token = create_token(store.engine, "bench-read", "read")
    params = {"key": "y", "buckets": BUCKETS}
    headers = {"Authorization": f"Bearer {token}"}
    path = f"/api/v1/runs/{run}/series"
    out: dict[str, Any] = {}
    with TestClient(create_app(store)) as client:
        out["server"], answer = timed(rounds, lambda: client.get(path, params=params,
                                                                 headers=headers))  # fmt: skip
    body = answer.json()
    assert answer.status_code == 200 and body["points"] == points, answer.text[:200]

    def query() -> list[Any]:
        return downsample(store.engine, run, "y", 0, points - 1, BUCKETS)

    def from_points() -> Any:
        bounds = bucket_bounds(0, points - 1, BUCKETS)
        with store.engine.connect() as conn:
            return blocks.cut(conn, "y", [run], bounds, last=True, from_points=True)

    def every() -> list[Any]:
        return store.metric_values(run, "y")

    def floor() -> Any:
        with store.engine.connect() as conn:
            return conn.execute(sa.text(_FLOOR), {"run_id": run}).all()

    out["sql"], rows = timed(rounds, query)
    if store.dialect == "sqlite":  # (PostgreSQL always cuts from the points)
        out["sql_points"], cells = timed(rounds, from_points)
        assert [(c[0], c[1], c[2], c[3]) for _, c in sorted(cells.items())] == [
            r[:4] for r in rows
        ]  # the same envelope either way
    out["floor"], _ = timed(rounds, floor)
    out["all_points"], _ = timed(max(1, rounds // 3), every)
    store.close()
    served = Served(url).start()
    try:
        import httpx

        with httpx.Client(base_url=served.url, headers=headers, timeout=60) as client:
            out["loopback"], _ = timed(rounds, lambda: client.get(path, params=params))
    finally:
        served.stop()
    return {
        "points": points,
        "buckets": len(rows),
        "answer_bytes": len(answer.content),
        "seconds_median": {k: round(v, 4) for k, v in out.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--points", type=int, default=POINTS)
    add_postgres_option(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'read.db'}"
        result = measure(url, args.rounds, args.points)
        print(json.dumps({"bench": "serve_read", "backend": "sqlite", **result,
                          "machine": machine()}))  # fmt: skip
    if args.postgres:
        with scratch_database(args.postgres, "read") as (url, _libpq):
            result = measure(url, args.rounds, args.points)
            print(json.dumps({"bench": "serve_read", "backend": "postgresql", **result,
                              "machine": machine()}))  # fmt: skip


if __name__ == "__main__":
    main()
