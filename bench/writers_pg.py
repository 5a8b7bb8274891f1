"""Many training processes writing metrics to one PostgreSQL store at once, against one.

A sweep or a cluster runs many processes against one shared store, and each brings its own
`Store`, writer thread and connections. What matters then is the total rate the server
takes, and whether every point still arrives: this bench measures points/s in total for
16 writer processes (`--processes`) against 1, and checks the exact row count afterwards.

Each writer is a spawned process that opens `Store(url)` and records its own run the way
`SqlLogger` does: `start_run` for the run's row, then `log_metrics` once per step (R steps
x K metrics), then `flush()`. Every process gets ready (store open, run started, its step
dicts built), then all start together on one event; the clock runs from that event until
the last process's `flush()` returns, that is until every point is committed. The `raw`
arms run the same number of processes with the bare driver (psycopg 3, one `executemany`
of the same rows and one commit) into a plain table with the same columns and primary
key: the server's own rate with this many clients, on this machine. The `copy` arms do the
same with the driver's binary COPY, the fastest way the server takes rows (lab's own way on
PostgreSQL: `lab.store.pg_copy`); the `copy_lab_schema` arms COPY into lab's own `metrics`
(its runs made first), foreign key to `runs` included, which costs the server a lookup of
the run per row: the floor for lab's schema. `--before PATH` adds `before` arms: the lab of another
checkout (a worktree of an earlier commit, say), run the same way in the same rounds, in a
scratch database of its own that its own lab migrated (its schema, as its users had it).

Every arm starts from an emptied scratch database; the arms rotate their order every round
and medians are compared. A process count above the CPU count cannot scale linearly: the
server's backends and the writers share the same cores. So each arm also reports the CPU
seconds the whole machine spent while it ran (from /proc/stat): per point, and as cores kept
busy, which says whether the arm was bound by the CPU; and the writers' own share of it.

Prints one JSON line (progress goes to stderr).

    python bench/writers_pg.py --postgres postgresql://postgres:lab@127.0.0.1:5432/lab_test
    python bench/writers_pg.py --before ../main   # and an earlier lab, in the same rounds
    python bench/writers_pg.py --load 2        # with 2 processes spinning meanwhile
    python bench/writers_pg.py --quick         # a smoke run (LAB_BENCH_POSTGRES_URL, or
                                               # --postgres, names the server)
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from multiprocessing.synchronize import Barrier, Event
from typing import Any

from _common import (
    add_postgres_option,
    alternate,
    busy,
    log,
    machine,
    pg_reset,
    pg_server_version,
    scratch_database,
    stop,
)
from ingest import PG_TABLE, make_steps, rows_of

RAW_TABLE = "raw_metrics"  # ingest's PG_TABLE: lab's columns and primary key, no foreign key
READY_TIMEOUT_S = 300.0  # spawning 16 interpreters on two busy cores takes a while
DONE_TIMEOUT_S = 900.0
RAW_INSERT = (
    f'INSERT INTO {RAW_TABLE} (run_id, "key", step, value, wall_time) VALUES (%s, %s, %s, %s, %s)'
)
RAW_COPY = f'COPY {RAW_TABLE} (run_id, "key", step, value, wall_time) FROM STDIN (FORMAT BINARY)'
LAB_COPY = 'COPY metrics (run_id, "key", step, value, wall_time) FROM STDIN (FORMAT BINARY)'
COPY_TYPES = ("int4", "varchar", "int8", "float8", "float8")


class CountWarnings(logging.Handler):
    """Counts what the store logs at WARNING or above: a failed write retried, say."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


# -- the writer processes ------------------------------------------------------------------
def on_go(sync: tuple[Barrier, Event], work: Callable[[], None]) -> dict[str, float]:
    """Wait until every writer is ready and the start is given, then time `work`: the
    monotonic clock (shared by the processes of one machine) and this process's CPU."""
    ready, go = sync
    ready.wait(READY_TIMEOUT_S)
    go.wait()
    start, cpu0 = time.monotonic(), time.process_time()
    work()
    return {"start": start, "end": time.monotonic(), "cpu_s": time.process_time() - cpu0}


def lab_writer(
    url: str,
    ids: tuple[int, int],
    index: int,
    size: tuple[int, int],
    writer: str | None,
    before: str | None,
    sync: tuple[Barrier, Event],
    results: Any,
) -> None:
    """One training process: its own store and run, then every step's metrics and a flush.
    `before`: the folder of another checkout of lab, whose code this process runs instead."""
    try:
        if before:
            use_checkout(before)
        from lab.store import Store

        warnings = CountWarnings()
        logging.getLogger("lab").addHandler(warnings)
        (steps,) = make_steps(1, *size, seed=index)
        store = Store(url, writer=writer)
        try:
            run_id = store.start_run(
                ids[0], ids[1], run_key=f"w{index}", arm_id=None, repeat=index, stage=0,
                seed=index, config={}, output_dir=None,
            )  # fmt: skip

            def work() -> None:
                for step, metrics in enumerate(steps, 1):
                    store.log_metrics(run_id, step, metrics)
                store.flush()  # durable: every point committed

            report: dict[str, Any] = on_go(sync, work)
            report["writer"] = store.writer_mode
            report["lab_from"] = os.path.dirname(os.path.dirname(sys.modules["lab"].__file__ or ""))
        finally:
            store.close()
        results.put({**report, "warnings": warnings.count})
    except BaseException as exc:
        sync[0].abort()  # the parent stops waiting for this one
        results.put({"error": f"process {index}: {exc!r}"})
        raise


def use_checkout(folder: str) -> None:
    """Import lab from `folder` from now on (this module's imports loaded this one's)."""
    for name in [m for m in sys.modules if m == "lab" or m.startswith("lab.")]:
        del sys.modules[name]
    sys.path.insert(0, folder)


def raw_writer(
    libpq: str,
    index: int,
    size: tuple[int, int],
    how: str,
    run_id: int,
    sync: tuple[Barrier, Event],
    results: Any,
) -> None:
    """The same rows through the bare driver, and one commit: one `executemany` of an
    INSERT (`how` "raw"), or the driver's binary COPY ("copy"), into the plain table; or
    the COPY into lab's own `metrics`, foreign key to `runs` included ("copy_lab_schema",
    `run_id` a run of lab's)."""
    try:
        import psycopg

        data = make_steps(1, *size, seed=index)
        with psycopg.connect(libpq) as con:

            def work() -> None:
                # each step's rows stamped as they are read, as lab stamps a step
                rows = rows_of(data, [run_id])
                with con.cursor() as cur:
                    if how == "raw":
                        cur.executemany(RAW_INSERT, rows)
                    else:
                        into = LAB_COPY if how == "copy_lab_schema" else RAW_COPY
                        with cur.copy(into) as copy:
                            copy.set_types(COPY_TYPES)
                            for row in rows:
                                copy.write_row(row)
                con.commit()

            report: dict[str, Any] = on_go(sync, work)
        results.put({**report, "warnings": 0, "writer": how})
    except BaseException as exc:
        sync[0].abort()
        results.put({"error": f"process {index}: {exc!r}"})
        raise


# -- one arm: N processes started together -------------------------------------------------
def busy_cpu_s() -> float:
    """CPU seconds the machine has spent on any work since boot (every core, steal aside)."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq = stat.readline().split()[1:8]
    busy = sum(int(t) for t in (user, nice, system, irq, softirq))
    return busy / os.sysconf("SC_CLK_TCK")


def run_processes(
    processes: int, target: Callable[..., None], args: Callable[[int], tuple[Any, ...]]
) -> tuple[float, float, list[dict[str, Any]]]:
    """Spawn the writers, start them on one event once all are ready, and return the
    seconds from that event until the last is durable, the machine's CPU seconds in that
    time, and each writer's report."""
    ctx = mp.get_context("spawn")
    ready, go, results = ctx.Barrier(processes + 1), ctx.Event(), ctx.Queue()
    # not daemons: a store with writer="process" starts a process of its own
    workers = [
        ctx.Process(target=target, args=(*args(i), (ready, go), results)) for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        try:
            ready.wait(READY_TIMEOUT_S)
        except Exception as exc:
            first = results.get(timeout=10)
            raise RuntimeError(f"a writer failed before the start: {first}") from exc
        cpu0, t0 = busy_cpu_s(), time.monotonic()
        go.set()
        reports = [results.get(timeout=DONE_TIMEOUT_S) for _ in workers]
        cpu = busy_cpu_s() - cpu0
    finally:
        go.set()
        for worker in workers:
            worker.join(60)
            if worker.is_alive():
                worker.terminate()
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        raise RuntimeError("; ".join(errors))
    return max(r["end"] for r in reports) - t0, cpu, reports


def count_rows(libpq: str, table: str) -> list[int]:
    """Rows per run, in run order."""
    import psycopg

    with psycopg.connect(libpq) as con:
        rows = con.execute(f"SELECT run_id, count(*) FROM {table} GROUP BY run_id ORDER BY 1")
        return [int(n) for _, n in rows.fetchall()]


def arm_result(
    timing: tuple[float, float, list[dict[str, Any]]], per_run: list[int], expected: int
) -> dict[str, Any]:
    """The arm's figures, once every process's rows are checked to be there, exactly."""
    seconds, machine_cpu, reports = timing
    processes = len(reports)
    assert per_run == [expected] * processes, (
        f"{processes} writers: rows per run {per_run}, expected {expected} each"
    )
    return {
        "s": seconds,
        "process_s": statistics.median(r["end"] - r["start"] for r in reports),
        "cpu_s": statistics.median(r["cpu_s"] for r in reports),
        "warnings": sum(r["warnings"] for r in reports),
        "writer": reports[0]["writer"],
        "lab_from": reports[0].get("lab_from"),
        "machine_cpu_s": machine_cpu,
        "writers_cpu_s": sum(r["cpu_s"] for r in reports),
    }


def lab_arm(
    url: str,
    libpq: str,
    processes: int,
    size: tuple[int, int],
    writer: str | None,
    before: str | None = None,
) -> dict[str, Any]:
    pg_reset(libpq, RAW_TABLE)
    exp, group = in_checkout(before, new_experiment, url, processes)
    timing = run_processes(
        processes, lab_writer, lambda i: (url, (exp, group), i, size, writer, before)
    )
    return arm_result(timing, count_rows(libpq, "metrics"), size[0] * size[1])


def in_checkout(before: str | None, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` with this lab, or in a spawned process with the lab of `before` (a
    store opened by this one would migrate that lab's database to this one's schema)."""
    if before is None:
        return fn(*args)
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(_in_checkout, (before, fn, *args))


def _in_checkout(before: str, fn: Callable[..., Any], *args: Any) -> Any:
    use_checkout(before)
    return fn(*args)


def new_experiment(url: str, processes: int) -> tuple[int, int]:
    """An experiment with one group for the writers' runs (the store migrated first)."""
    from lab.store import Store

    store = Store(url)
    try:
        exp = store.begin_experiment(
            f"writers-{uuid.uuid4().hex[:8]}", config={}, seed=0, repeats=processes
        )
        return exp, store.add_group(exp, "g")
    finally:
        store.close()


def raw_arm(
    url: str, libpq: str, processes: int, size: tuple[int, int], how: str
) -> dict[str, Any]:
    import psycopg

    pg_reset(libpq, RAW_TABLE)
    with psycopg.connect(libpq, autocommit=True) as con:
        con.execute(PG_TABLE)
    if how == "copy_lab_schema":  # into lab's own tables: runs of lab's to write
        runs, table = lab_runs(url, processes), "metrics"
    else:
        runs, table = list(range(1, processes + 1)), RAW_TABLE
    timing = run_processes(processes, raw_writer, lambda i: (libpq, i, size, how, runs[i]))
    return arm_result(timing, count_rows(libpq, table), size[0] * size[1])


def lab_runs(url: str, processes: int) -> list[int]:
    """An experiment of lab's with one run per process; their ids."""
    from lab.store import Store

    store = Store(url)
    try:
        exp = store.begin_experiment(
            f"copy-{uuid.uuid4().hex[:8]}", config={}, seed=0, repeats=processes
        )
        group = store.add_group(exp, "g")
        return [
            store.start_run(exp, group, run_key=f"w{i}", arm_id=None, repeat=i, stage=0,
                            seed=i, config={}, output_dir=None)
            for i in range(processes)
        ]  # fmt: skip
    finally:
        store.close()


# -- the figures ---------------------------------------------------------------------------
def summarize(
    results: dict[str, list[dict[str, Any]]], counts: list[int], per_process: int
) -> dict[str, Any]:
    def rate(name: str) -> float:
        processes = int(name.rsplit("_", 1)[1])
        return per_process * processes / statistics.median(r["s"] for r in results[name])

    out: dict[str, Any] = {}
    for name, rounds in results.items():
        points = per_process * int(name.rsplit("_", 1)[1])
        out[name] = {
            "points": points,
            "points_per_s": round(rate(name)),
            "points_per_s_per_round": [round(points / r["s"]) for r in rounds],
            "s": [round(r["s"], 3) for r in rounds],
            # one process's own seconds from the start to its durable flush
            "process_s_median": round(statistics.median(r["process_s"] for r in rounds), 3),
            "process_cpu_s_median": round(statistics.median(r["cpu_s"] for r in rounds), 3),
            "store_warnings": sum(r["warnings"] for r in rounds),
            "writer": rounds[0]["writer"],
            "lab_from": rounds[0]["lab_from"],  # the checkout whose lab ran (lab arms)
            # the whole machine's CPU (writers, PostgreSQL, anything else) while the arm ran
            "machine_cpu_us_per_point": round(
                statistics.median(r["machine_cpu_s"] for r in rounds) / points * 1e6, 1
            ),
            "busy_cores": [round(r["machine_cpu_s"] / r["s"], 2) for r in rounds],
            "writers_share_of_cpu": round(
                statistics.median(r["writers_cpu_s"] / r["machine_cpu_s"] for r in rounds), 3
            ),
        }
    one, many = min(counts), max(counts)
    for kind in ("lab", "raw"):
        if f"{kind}_{one}" in results and one != many:
            out[f"{kind}_{many}_vs_{one}"] = round(
                rate(f"{kind}_{many}") / rate(f"{kind}_{one}"), 3
            )
            out[f"{kind}_{many}_vs_{one}_per_round"] = [
                round((many * a["s"]) / (one * b["s"]), 3)
                for a, b in zip(results[f"{kind}_{one}"], results[f"{kind}_{many}"], strict=True)
            ]
    for base in ("raw", "copy", "copy_lab_schema", "before"):
        if f"{base}_{one}" in results:
            for n in counts:
                out[f"lab_vs_{base}_{n}"] = round(rate(f"lab_{n}") / rate(f"{base}_{n}"), 3)
                out[f"lab_vs_{base}_{n}_per_round"] = [
                    round(b["s"] / a["s"], 3)
                    for a, b in zip(results[f"lab_{n}"], results[f"{base}_{n}"], strict=True)
                ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default="1,16", help="writer counts, comma-separated")
    parser.add_argument("--steps", type=int, default=5000, help="steps per process's run")
    parser.add_argument("--keys", type=int, default=10, help="metrics per step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-raw", action="store_true", help="leave out the bare driver")
    parser.add_argument(
        "--before", metavar="PATH", default=None,
        help="also run the lab of another checkout (the folder that holds its lab/), "
        "the same way, as the arms before_N: e.g. a worktree of main",
    )  # fmt: skip
    parser.add_argument(
        "--writer", default=None,
        help="the store's metric writer, as Store(writer=...) takes it (default: "
        "LAB_STORE_WRITER, else the store's own default)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="200 steps, 1 round")
    parser.add_argument("--load", type=int, default=0, metavar="N",
                        help="N processes that spin on a core each while the arms run")  # fmt: skip
    add_postgres_option(parser)
    args = parser.parse_args()
    if not args.postgres:
        parser.error("needs a PostgreSQL server: --postgres URL or LAB_BENCH_POSTGRES_URL")
    if args.quick:
        args.steps, args.rounds = 200, 1
    counts = sorted({int(n) for n in args.processes.split(",")})
    size = (args.steps, args.keys)
    out: dict[str, Any] = {
        "bench": "writers_pg",
        "processes": counts,
        "steps": args.steps,
        "keys": args.keys,
        "points_per_process": args.steps * args.keys,
        "rounds": args.rounds,
        "load": args.load,
        "load_before": [round(x, 2) for x in os.getloadavg()],
    }
    with ExitStack() as stack:
        url, libpq = stack.enter_context(scratch_database(args.postgres, "writers"))
        if args.before:  # its own database, which its own lab migrates
            old_url, old_libpq = stack.enter_context(
                scratch_database(args.postgres, "writers_before")
            )
        from lab.store import Store

        Store(url).close()  # migrate once, before any writer opens it
        arms: dict[str, Callable[[int], dict[str, Any]]] = {}
        for n in counts:
            arms[f"lab_{n}"] = lambda _i, n=n: lab_arm(url, libpq, n, size, args.writer)
            if args.before:
                arms[f"before_{n}"] = lambda _i, n=n: lab_arm(
                    old_url, old_libpq, n, size, args.writer, args.before
                )
            if not args.no_raw:
                for how in ("raw", "copy", "copy_lab_schema"):
                    arms[f"{how}_{n}"] = lambda _i, n=n, how=how: raw_arm(url, libpq, n, size, how)
        load = busy(args.load)
        try:
            results = alternate(args.rounds, arms)
        finally:
            stop(load)
        out["postgres"] = summarize(results, counts, args.steps * args.keys)
        out["postgres"]["server"] = pg_server_version(libpq)
    out["load_after"] = [round(x, 2) for x in os.getloadavg()]
    out["machine"] = machine()
    rates = (f"{n}: {out['postgres'][f'lab_{n}']['points_per_s']} points/s" for n in counts)
    log("lab, processes " + ", ".join(rates))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
