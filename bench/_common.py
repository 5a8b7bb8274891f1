"""What the benchmark scripts share: machine facts, stderr logging, arm rotation, and a
scratch PostgreSQL database. Each script runs as ``python bench/<name>.py``, which puts this
folder on ``sys.path``."""

from __future__ import annotations

import argparse
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lab import Callback


def machine(**extra: Any) -> dict[str, Any]:
    """Where the figures come from: numbers from another machine are not comparable."""
    import torch

    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu_count": os.cpu_count(),
        "cpu": cpu,
        "arch": platform.machine(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "torch": torch.__version__,
        **extra,
    }


def busy(n: int) -> list[subprocess.Popen[bytes]]:
    """`n` processes that spin on a core each until killed: a loaded machine (`--load N`)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """Kill and reap what `busy` started."""
    for process in processes:
        process.kill()
        process.wait()


def log(message: str) -> None:
    """Progress goes to stderr: stdout carries the one JSON line."""
    print(message, file=sys.stderr, flush=True)


def alternate(
    rounds: int, arms: dict[str, Callable[[int], dict[str, float]]]
) -> dict[str, list[dict[str, float]]]:
    """Run every arm once per round, rotating the order each round so drift hits all alike.
    Each arm returns a dict with at least "s" (its timed seconds)."""
    results: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
    names = list(arms)
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            result = arms[name](i)
            results[name].append(result)
            log(f"round {i + 1}/{rounds} {name}: {result['s']:.3f} s")
    return results


@contextmanager
def scratch_database(admin_url: str, prefix: str) -> Iterator[tuple[str, str]]:
    """A fresh database on the server of `admin_url`, dropped afterwards.

    Yields (the lab store URL, the libpq URL for psycopg)."""
    import sqlalchemy as sa

    from lab.store.engine import resolve_url

    base = sa.engine.make_url(resolve_url(admin_url))
    name = f"lab_bench_{prefix}_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = base.set(database=name)
    try:
        libpq = url.set(drivername="postgresql").render_as_string(hide_password=False)
        yield url.render_as_string(hide_password=False), libpq
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def pg_reset(libpq: str, *raw_tables: str) -> None:
    """Empty lab's tables and drop the raw ones, so every round starts alike."""
    import psycopg

    with psycopg.connect(libpq, autocommit=True) as con:
        for table in raw_tables:
            con.execute(f"DROP TABLE IF EXISTS {table}")
        if con.execute("SELECT to_regclass('experiments')").fetchone()[0] is not None:  # type: ignore[index]
            # metrics has no foreign key to runs on PostgreSQL: named, not reached
            con.execute("TRUNCATE experiments, metrics CASCADE")
        con.execute("VACUUM ANALYZE")


def pg_server_version(libpq: str) -> str:
    import psycopg

    with psycopg.connect(libpq) as con:
        return str(con.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]


def add_postgres_option(parser: argparse.ArgumentParser) -> None:
    """--postgres ADMIN_URL (default $LAB_BENCH_POSTGRES_URL): where the PostgreSQL arm runs."""
    parser.add_argument(
        "--postgres",
        default=os.environ.get("LAB_BENCH_POSTGRES_URL"),
        help="admin URL of a PostgreSQL server: a scratch database is made there and dropped",
    )


class StepClock(Callback):
    """Times each step from the first pre_step hook to the last on_step_end hook: the wall
    clock, and the training thread's own CPU clock (which other processes don't inflate)."""

    priority = 10**9  # first: its pre_step runs before any other

    def __init__(self) -> None:
        self.starts: list[tuple[float, float]] = []
        self.ends: list[tuple[float, float]] = []

    def pre_step(self, state, step_idx, batch) -> None:  # type: ignore[no-untyped-def]
        self.starts.append((time.perf_counter(), time.thread_time()))


class StepClockEnd(Callback):
    """The closing half of `StepClock`: its on_step_end runs after every other."""

    priority = -(10**9)

    def __init__(self, clock: StepClock) -> None:
        self.ends = clock.ends

    def on_step_end(self, state, step_idx, batch, metrics) -> None:  # type: ignore[no-untyped-def]
        self.ends.append((time.perf_counter(), time.thread_time()))


def timed(rounds: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    """The median seconds of `fn` over `rounds` (after one warm-up call), and its answer."""
    answer = fn()
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), answer
