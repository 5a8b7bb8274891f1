"""Metric ingest through `Store.log_metrics`, against raw driver `executemany` of the same rows.

The workload: 4 runs x 5,000 steps x 20 metrics (400,000 points), one step's dict per
`log_metrics` call, run after run, then `flush()`: the clock stops when every point is
committed. The baseline gets the same step dicts and writes the same rows with the bare
driver (`sqlite3`, or psycopg for PostgreSQL) in one `executemany` and one commit, into an
equivalent table: the same columns and primary key (run_id, key, step), and on SQLite the
engine settings `lab` uses (WAL, synchronous=NORMAL).

A third arm, `raw_lab_schema`, runs the bare driver with lab's own statement (the upsert
`Store` runs, here one row to a statement, as `raw`; lab's writer sends many rows to one,
`lab.store.sqlite_rows`) into lab's own tables, foreign key to `runs` included: it against
`raw` is the cost of lab's schema.

A fourth arm, `wandb` (when wandb is installed; `--no-wandb` leaves it out), logs the same
step dicts with wandb offline: per run, `wandb.init(mode="offline")` outside the clock (as
lab's runs are made outside it), then `run.log` of every step and `run.finish()`, the
clock stopped when `finish` returns (its files written). Its rows are not counted: wandb
has no reader for its offline files.

Each round writes into fresh databases (on PostgreSQL, a scratch database emptied before
every arm); the arms rotate their order every round and medians are compared. Every arm's
row count is checked after its clock stops. CPU seconds of this process are reported too
(they leave out PostgreSQL's server processes), and lab's writer process's, read from /proc:
`total_cpu_ratio` (raw's CPU against lab's two processes') is the figure that other
processes on the machine move least.

Prints one JSON line (everything else goes to stderr).

    python bench/ingest.py                     # SQLite, 5 rounds
    python bench/ingest.py --quick             # a smoke run
    python bench/ingest.py --postgres postgresql://user:pw@host/admin_db  # or set
                                               # LAB_BENCH_POSTGRES_URL; adds PostgreSQL
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import (
    add_postgres_option,
    alternate,
    machine,
    pg_reset,
    pg_server_version,
    scratch_database,
)

from lab.store import Store, writer_process

Steps = list[dict[str, float]]  # one dict of metrics per step


def make_steps(runs: int, steps: int, keys: int, seed: int = 0) -> list[Steps]:
    """Per run, one metric dict per step: what a training loop would hand `log_metrics`."""
    rng = random.Random(seed)
    names = [f"metric_{k:02d}" for k in range(keys)]
    return [[{n: rng.random() for n in names} for _ in range(steps)] for _ in range(runs)]


# -- lab -----------------------------------------------------------------------------------
def make_runs(store: Store, runs: int) -> list[int]:
    """An experiment with `runs` runs, through the public API; returns the run ids."""
    exp = store.begin_experiment(f"ingest-{uuid.uuid4().hex[:8]}", config={}, seed=0, repeats=1)
    group = store.add_group(exp, "g")
    return [
        store.start_run(exp, group, run_key=f"r{i}", arm_id=None, repeat=i, stage=0, seed=i,
                        config={}, output_dir=None)
        for i in range(runs)
    ]  # fmt: skip


def process_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) process `pid` has used so far; 0.0 for none or a gone one."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lab_round(url: str, data: list[Steps]) -> dict[str, float]:
    """Open a store, create the runs, then time log_metrics for every step and the flush.
    The CPU of the writer process (shared by the rounds; started in the first, once its
    store has written 2,000 points) is read from /proc around the clock."""
    store = Store(url)
    try:
        run_ids = make_runs(store, len(data))
        writer = writer_process._shared()
        pid = writer.pid
        cpu0, t0, writer0 = time.process_time(), time.perf_counter(), process_cpu(pid)
        for run_id, steps in zip(run_ids, data, strict=True):
            for step, metrics in enumerate(steps, 1):
                store.log_metrics(run_id, step, metrics)
        logged = time.perf_counter()
        store.flush()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if writer.pid != pid:  # started in this round: all of its CPU is this round's
            pid, writer0 = writer.pid, 0.0
        writer_cpu = process_cpu(pid) - writer0
        with store.engine.connect() as conn:
            count = conn.exec_driver_sql("SELECT count(*) FROM metrics").scalar_one()
    finally:
        store.close()
    expected = sum(len(s) * len(s[0]) for s in data)
    assert count == expected, f"lab wrote {count} rows, expected {expected}"
    return {"s": seconds, "cpu_s": cpu, "log_calls_s": logged - t0, "writer_cpu_s": writer_cpu}


# -- raw sqlite3 ---------------------------------------------------------------------------
SQLITE_TABLE = """
CREATE TABLE metrics (
    run_id INTEGER NOT NULL, "key" VARCHAR(255) NOT NULL, step BIGINT NOT NULL,
    value DOUBLE, wall_time DOUBLE NOT NULL,
    PRIMARY KEY (run_id, "key", step)
)"""


def rows_of(
    data: list[Steps], run_ids: list[int] | None = None
) -> Iterator[tuple[int, str, int, float, float]]:
    """The rows of every step, stamped with the time they are read, as lab stamps a step."""
    for run_id, steps in zip(run_ids or range(1, len(data) + 1), data, strict=True):
        for step, metrics in enumerate(steps, 1):
            now = time.time()
            for key, value in metrics.items():
                yield run_id, key, step, value, now


def raw_sqlite_round(path: Path, data: list[Steps]) -> dict[str, float]:
    con = sqlite3.connect(path, isolation_level=None)
    try:
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=NORMAL")
        con.execute(SQLITE_TABLE)
        cpu0, t0 = time.process_time(), time.perf_counter()
        con.execute("BEGIN IMMEDIATE")
        con.executemany(
            'INSERT INTO metrics (run_id, "key", step, value, wall_time) VALUES (?, ?, ?, ?, ?)',
            rows_of(data),
        )
        con.execute("COMMIT")
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        count = con.execute("SELECT count(*) FROM metrics").fetchone()[0]
    finally:
        con.close()
    expected = sum(len(s) * len(s[0]) for s in data)
    assert count == expected, f"raw sqlite3 wrote {count} rows, expected {expected}"
    return {"s": seconds, "cpu_s": cpu}


# The statement lab's writer runs (`lab.store.metric_rows`), one row to a statement, for the
# third arm: the bare driver writing into lab's own tables (foreign key to runs included),
# which tells the cost of lab's schema and statement apart from the cost of lab's code.
UPSERT = (
    'INSERT INTO metrics (run_id, "key", step, value, wall_time) VALUES ({0}, {0}, {0}, {0}, {0}) '
    'ON CONFLICT (run_id, "key", step) DO UPDATE '
    "SET value = excluded.value, wall_time = excluded.wall_time"
)


def lab_schema_runs(url: str, runs: int) -> list[int]:
    store = Store(url)
    try:
        return make_runs(store, runs)
    finally:
        store.close()


def raw_sqlite_lab_schema_round(path: Path, data: list[Steps]) -> dict[str, float]:
    run_ids = lab_schema_runs(f"sqlite:///{path}", len(data))
    con = sqlite3.connect(path, isolation_level=None)
    try:
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON"):
            con.execute(f"PRAGMA {pragma}")  # as lab.store.engine sets them
        cpu0, t0 = time.process_time(), time.perf_counter()
        con.execute("BEGIN IMMEDIATE")
        con.executemany(UPSERT.format("?"), rows_of(data, run_ids))
        con.execute("COMMIT")
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        count = con.execute("SELECT count(*) FROM metrics").fetchone()[0]
    finally:
        con.close()
    expected = sum(len(s) * len(s[0]) for s in data)
    assert count == expected, f"raw sqlite3 wrote {count} rows, expected {expected}"
    return {"s": seconds, "cpu_s": cpu}


# -- wandb offline -------------------------------------------------------------------------
def wandb_round(folder: Path, data: list[Steps]) -> dict[str, float]:
    """Each run through wandb offline: init untimed, then every step's `log` and `finish`."""
    import wandb

    seconds = cpu = init_s = 0.0
    for i, steps in enumerate(data):
        t_init = time.perf_counter()
        run = wandb.init(
            mode="offline", dir=folder, project="ingest", name=f"r{i}", reinit="create_new",
            settings=wandb.Settings(
                silent=True, console="off", x_disable_stats=True, disable_git=True
            ),
        )  # fmt: skip
        init_s += time.perf_counter() - t_init
        cpu0, t0 = time.process_time(), time.perf_counter()
        for step, metrics in enumerate(steps, 1):
            run.log(metrics, step=step)
        run.finish()
        seconds += time.perf_counter() - t0
        cpu += time.process_time() - cpu0
    return {"s": seconds, "cpu_s": cpu, "init_s": init_s}


def has_wandb() -> bool:
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return True


# -- PostgreSQL ----------------------------------------------------------------------------
PG_TABLE = """
CREATE TABLE raw_metrics (
    run_id INTEGER NOT NULL, "key" VARCHAR(255) NOT NULL, step BIGINT NOT NULL,
    value DOUBLE PRECISION, wall_time DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (run_id, "key", step)
)"""


def raw_pg_round(libpq: str, data: list[Steps]) -> dict[str, float]:
    import psycopg

    with psycopg.connect(libpq) as con:
        con.execute(PG_TABLE)
        con.commit()
        cpu0, t0 = time.process_time(), time.perf_counter()
        with con.cursor() as cur:
            cur.executemany(
                'INSERT INTO raw_metrics (run_id, "key", step, value, wall_time) '
                "VALUES (%s, %s, %s, %s, %s)",
                rows_of(data),
            )
        con.commit()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        count = con.execute("SELECT count(*) FROM raw_metrics").fetchone()[0]  # type: ignore[index]
    expected = sum(len(s) * len(s[0]) for s in data)
    assert count == expected, f"raw psycopg wrote {count} rows, expected {expected}"
    return {"s": seconds, "cpu_s": cpu}


def raw_pg_lab_schema_round(url: str, libpq: str, data: list[Steps]) -> dict[str, float]:
    import psycopg

    run_ids = lab_schema_runs(url, len(data))
    with psycopg.connect(libpq) as con:
        cpu0, t0 = time.process_time(), time.perf_counter()
        with con.cursor() as cur:
            cur.executemany(UPSERT.format("%s"), rows_of(data, run_ids))
        con.commit()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        count = con.execute("SELECT count(*) FROM metrics").fetchone()[0]  # type: ignore[index]
    expected = sum(len(s) * len(s[0]) for s in data)
    assert count == expected, f"raw psycopg wrote {count} rows, expected {expected}"
    return {"s": seconds, "cpu_s": cpu}


def wandb_summary(
    points: int, results: dict[str, list[dict[str, float]]], lab_s: float, raw_s: float
) -> dict[str, Any]:
    """wandb offline's rate against raw's and lab's, medians of the same rounds."""
    wandb_s = statistics.median(r["s"] for r in results["wandb"])
    return {
        "wandb_points_per_s": round(points / wandb_s),
        "wandb_ratio": round(raw_s / wandb_s, 3),  # wandb's rate as a fraction of raw's
        "lab_vs_wandb": round(wandb_s / lab_s, 3),  # > 1: lab ahead
        "wandb_s": [round(r["s"], 3) for r in results["wandb"]],
        "wandb_init_s_median": round(statistics.median(r["init_s"] for r in results["wandb"]), 3),
        "wandb_cpu_s_median": round(statistics.median(r["cpu_s"] for r in results["wandb"]), 3),
    }


def summarize(points: int, results: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    lab_s = statistics.median(r["s"] for r in results["lab"])
    raw_s = statistics.median(r["s"] for r in results["raw"])
    same_s = statistics.median(r["s"] for r in results["raw_lab_schema"])
    lab_cpu = statistics.median(r["cpu_s"] for r in results["lab"])
    raw_cpu = statistics.median(r["cpu_s"] for r in results["raw"])
    same_cpu = statistics.median(r["cpu_s"] for r in results["raw_lab_schema"])
    writer_cpu = statistics.median(r["writer_cpu_s"] for r in results["lab"])
    total_cpu = statistics.median(r["cpu_s"] + r["writer_cpu_s"] for r in results["lab"])
    paired = [raw["s"] / lab["s"] for lab, raw in zip(results["lab"], results["raw"], strict=True)]
    return {
        "lab_points_per_s": round(points / lab_s),
        "raw_points_per_s": round(points / raw_s),
        "ratio": round(raw_s / lab_s, 3),  # lab's rate as a fraction of raw's
        "ratio_per_round": [round(r, 3) for r in paired],
        "lab_s": [round(r["s"], 3) for r in results["lab"]],
        "raw_s": [round(r["s"], 3) for r in results["raw"]],
        # this process's CPU seconds (both threads): less sensitive to other processes
        "lab_cpu_s_median": round(lab_cpu, 3),
        "raw_cpu_s_median": round(raw_cpu, 3),
        "cpu_ratio": round(raw_cpu / lab_cpu, 3),
        # the writer process's CPU seconds too: lab's whole CPU against raw's, which the
        # load of other processes moves far less than wall time
        "lab_writer_cpu_s_median": round(writer_cpu, 3),
        "total_cpu_ratio": round(raw_cpu / total_cpu, 3),
        "lab_log_calls_s_median": round(
            statistics.median(r["log_calls_s"] for r in results["lab"]), 3
        ),
        # the bare driver running lab's own statement into lab's own tables (foreign key
        # included): lab's rate against it is the cost of lab's code alone
        "raw_lab_schema_points_per_s": round(points / same_s),
        "ratio_vs_raw_lab_schema": round(same_s / lab_s, 3),
        "raw_lab_schema_s": [round(r["s"], 3) for r in results["raw_lab_schema"]],
        "raw_lab_schema_cpu_s_median": round(same_cpu, 3),
        "total_cpu_ratio_vs_raw_lab_schema": round(same_cpu / total_cpu, 3),
        "target_ratio": 0.9,
        "meets_target": raw_s / lab_s >= 0.9,
        **(wandb_summary(points, results, lab_s, raw_s) if "wandb" in results else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--keys", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="4 x 500 x 20, 3 rounds")
    parser.add_argument("--no-wandb", action="store_true", help="leave the wandb arm out")
    add_postgres_option(parser)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 500, 3
    data = make_steps(args.runs, args.steps, args.keys)
    points = args.runs * args.steps * args.keys
    out: dict[str, Any] = {
        "bench": "ingest",
        "runs": args.runs,
        "steps": args.steps,
        "keys": args.keys,
        "points": points,
        "rounds": args.rounds,
    }
    with tempfile.TemporaryDirectory(prefix="lab-bench-ingest-") as tmp:
        folder = Path(tmp)
        arms: dict[str, Any] = {
            "lab": lambda i: lab_round(f"sqlite:///{folder / f'lab{i}.db'}", data),
            "raw": lambda i: raw_sqlite_round(folder / f"raw{i}.db", data),
            "raw_lab_schema": lambda i: raw_sqlite_lab_schema_round(folder / f"same{i}.db", data),
        }
        if args.no_wandb:
            out["wandb"] = "left out (--no-wandb)"
        elif not has_wandb():
            out["wandb"] = "left out: wandb is not installed (pip install wandb)"
        else:
            arms["wandb"] = lambda i: wandb_round(folder / f"wandb{i}", data)
        out["sqlite"] = summarize(points, alternate(args.rounds, arms))
    if args.postgres:
        with scratch_database(args.postgres, "ingest") as (url, libpq):

            def lab_pg(_i: int) -> dict[str, float]:
                pg_reset(libpq, "raw_metrics")
                return lab_round(url, data)

            def raw_pg(_i: int) -> dict[str, float]:
                pg_reset(libpq, "raw_metrics")
                return raw_pg_round(libpq, data)

            def raw_pg_lab_schema(_i: int) -> dict[str, float]:
                pg_reset(libpq, "raw_metrics")
                return raw_pg_lab_schema_round(url, libpq, data)

            Store(url).close()  # migrate once, outside the rounds
            arms = {"lab": lab_pg, "raw": raw_pg, "raw_lab_schema": raw_pg_lab_schema}
            out["postgres"] = summarize(points, alternate(args.rounds, arms))
            out["postgres"]["server"] = pg_server_version(libpq)
    out["machine"] = machine()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
