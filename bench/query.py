"""Reading a big store back through `lab.inspect.connect` (DuckDB on the SQLite file).

The store: 100 runs (10 arms x 10 repeats) x 10,000 steps x 10 keys = 10 million metric
points. The experiment, arms, groups and runs are made through the `Store` API; the metric
rows are then generated inside SQLite (INSERT ... SELECT from a recursive CTE, in primary
key order), `summaries` is filled from them with one grouped INSERT ... SELECT (when the
schema has that table), and the runs are finished through the API with their final values.
The file is cached in ~/.cache/lab-bench/ (or $XDG_CACHE_HOME/lab-bench, $LAB_BENCH_CACHE,
--cache-dir), outside the source tree, so later invocations reuse it; a build goes to a
temporary name and is renamed when complete.

Timed, each over several rounds, medians reported:

    connect         lab.inspect.connect(url): open the store, load the scanner, ATTACH, views
    final_metrics   each arm's mean final loss across repeats, through the final_metrics view
    summaries       the same figure through the summaries view (one row per run and key)
    final_from_metrics  the same, computed from every point with a window (as final_metrics
                    did before `summaries`): what a store without summaries costs
    history_lab     one run's full history of one key through lab.inspect.history(), which
                    reads it through the store's (run, key, step) index
    history         the same through the `metrics` view, as fetchall() and as .df() (DuckDB's
                    scanner cannot push the filter down, so it reads every point); and the
                    same query handed whole to SQLite with DuckDB's sqlite_query()

Each DuckDB query alternates with its baseline: the same question asked of the same file
with the bare `sqlite3` module (final value by the primary key index, history by an index
range scan). Arrow mode (`mode="arrow"`) copies every table into DuckDB through Python rows;
it is timed on a small store of its own and extrapolated, since at 10 million rows it takes
minutes and many GB (`--arrow-full` times it on the big store anyway). Prints one JSON line.

    python bench/query.py                    # builds the 10M-point store once (minutes)
    python bench/query.py --quick            # 10 runs x 1,000 steps x 10 keys
    python bench/query.py --rebuild          # throw the cached store away first
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
from _common import log, machine

import lab.inspect
from lab.store import Store

# Outside the source tree: hatch reads only the top .gitignore, so a cache under bench/
# would go into every sdist (bench/ is in it). --cache-dir or LAB_BENCH_CACHE moves it.
CACHE = Path(
    os.environ.get("LAB_BENCH_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lab-bench"
)
KEYS = ("loss", "acc", "lr", "grad_norm", "step_time", "val_loss", "val_acc", "m7", "m8", "m9")


# -- building the store --------------------------------------------------------------------
def build(path: Path, arms: int, repeats: int, steps: int, keys: int) -> None:
    """Make the store at `path` (through a temporary file, renamed once complete)."""
    tmp = path.with_name(path.name + ".building")
    for leftover in path.parent.glob(tmp.name + "*"):
        leftover.unlink()
    t0 = time.perf_counter()
    store = Store(f"sqlite:///{tmp}")
    try:
        exp = store.begin_experiment(
            "query-bench", config={"arms": arms, "repeats": repeats}, seed=0, repeats=repeats
        )
        runs: list[tuple[int, int]] = []  # (run_id, arm index)
        for a in range(arms):
            name = f"arm{a:02d}"
            arm_id = store.add_arm(exp, name, overrides={"lr": 0.1 * (a + 1)}, config={})
            group = store.add_group(exp, name, arm_id=arm_id)
            for r in range(repeats):
                run_id = store.start_run(
                    exp, group, run_key=f"{name}-r{r}", arm_id=arm_id, repeat=r, stage=0,
                    seed=r, config={"lr": 0.1 * (a + 1)}, output_dir=None,
                )  # fmt: skip
                runs.append((run_id, a))
        fill_metrics(tmp, runs, steps, KEYS[:keys])
        log(f"metrics filled: {time.perf_counter() - t0:.1f} s")
        filled = fill_summaries(tmp)
        log(f"summaries filled ({filled}): {time.perf_counter() - t0:.1f} s")
        with store.engine.begin() as conn:  # what the writer keeps with every batch
            for run_id, _a in runs:
                store.metric_rows.blocks.reblock_run(conn, run_id, None)
        log(f"metric blocks filled: {time.perf_counter() - t0:.1f} s")
        for run_id, _a in runs:
            store.finish_run(run_id, status="completed", summary=final_values(tmp, run_id))
    finally:
        store.close()
    os.replace(tmp, path)
    log(f"built {path} in {time.perf_counter() - t0:.1f} s ({path.stat().st_size / 1e6:.0f} MB)")


def fill_metrics(
    path: Path, runs: list[tuple[int, int]], steps: int, keys: tuple[str, ...]
) -> None:
    """Every run's points, generated by SQLite itself, in primary key order, one
    transaction per run. A loss-like curve per arm plus noise; NaN-free."""
    con = sqlite3.connect(path, isolation_level=None)
    try:
        con.execute("PRAGMA synchronous=OFF")  # a build, not a store in use
        con.execute("CREATE TEMP TABLE k (i INTEGER, name TEXT)")
        con.executemany("INSERT INTO k VALUES (?, ?)", list(enumerate(keys)))
        for n, (run_id, arm) in enumerate(runs, 1):
            con.execute("BEGIN")
            con.execute(
                """
                INSERT INTO metrics (run_id, "key", step, value, wall_time)
                WITH RECURSIVE s(step) AS (SELECT 1 UNION ALL SELECT step + 1 FROM s
                                           WHERE step < :steps)
                SELECT :run_id, k.name, s.step,
                       (1.0 + k.i) / (1.0 + s.step * 0.001 * (1.0 + 0.1 * :arm))
                       + (abs(random()) % 1000) / 100000.0,
                       1.7e9 + :run_id * 1000.0 + s.step * 0.01
                FROM k, s ORDER BY k.name, s.step
                """,
                {"steps": steps, "run_id": run_id, "arm": arm},
            )
            con.execute("COMMIT")
            if n % 10 == 0:
                log(f"  {n}/{len(runs)} runs")
    finally:
        con.close()


def fill_summaries(path: Path) -> str:
    """`summaries` from `metrics` with one grouped INSERT ... SELECT, if the schema has it."""
    con = sqlite3.connect(path, isolation_level=None)
    try:
        columns = [row[1] for row in con.execute("PRAGMA table_info(summaries)")]
        if not columns:
            return "no summaries table in this schema"
        con.execute("PRAGMA synchronous=OFF")
        con.execute("BEGIN")
        con.execute("DELETE FROM summaries")  # the writer may have left empty-run rows
        con.execute(
            """
            INSERT INTO summaries (run_id, "key", "count", first_step, last_step, last_value,
                                   min_value, max_value, last_wall_time)
            SELECT m.run_id, m."key", count(*), min(m.step), max(m.step),
                   (SELECT l.value FROM metrics l WHERE l.run_id = m.run_id
                    AND l."key" = m."key" ORDER BY l.step DESC LIMIT 1),
                   min(m.value), max(m.value),
                   (SELECT l.wall_time FROM metrics l WHERE l.run_id = m.run_id
                    AND l."key" = m."key" ORDER BY l.step DESC LIMIT 1)
            FROM metrics m GROUP BY m.run_id, m."key"
            """
        )
        con.execute("COMMIT")
        return f"{con.execute('SELECT count(*) FROM summaries').fetchone()[0]} rows"
    finally:
        con.close()


def final_values(path: Path, run_id: int) -> dict[str, float]:
    con = sqlite3.connect(path)
    try:
        return dict(
            con.execute(
                'SELECT m."key", m.value FROM metrics m WHERE m.run_id = ? AND m.step = '
                '(SELECT max(step) FROM metrics l WHERE l.run_id = m.run_id AND l."key" = m."key")',
                (run_id,),
            ).fetchall()
        )
    finally:
        con.close()


def cached_store(
    cache: Path, arms: int, repeats: int, steps: int, keys: int, *, rebuild: bool
) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"query-{arms}x{repeats}x{steps}x{keys}.db"
    if rebuild and path.exists():
        path.unlink()
    if not path.exists():
        log(f"building {path} ({arms * repeats} runs x {steps} steps x {keys} keys)")
        build(path, arms, repeats, steps, keys)
    else:
        log(f"reusing {path}")
    return path


# -- the queries ---------------------------------------------------------------------------
FINAL_DUCK = """
SELECT arm, avg(value) AS mean_final_loss, count(*) AS runs
FROM final_metrics WHERE key = 'loss' GROUP BY arm ORDER BY arm
"""
SUMMARY_DUCK = """
SELECT a.name AS arm, avg(s.last_value) AS mean_final_loss, count(*) AS runs
FROM summaries s JOIN runs r USING (run_id) LEFT JOIN arms a ON a.arm_id = r.arm_id
WHERE s.key = 'loss' GROUP BY a.name ORDER BY a.name
"""
# What final_metrics computed before `summaries` existed: a window over every point.
FINAL_FROM_METRICS = """
SELECT a.name AS arm, avg(m.value) AS mean_final_loss, count(*) AS runs
FROM (SELECT run_id, value,
             row_number() OVER (PARTITION BY run_id, key ORDER BY step DESC) AS k
      FROM metrics WHERE key = 'loss') m
JOIN runs r USING (run_id) LEFT JOIN arms a ON a.arm_id = r.arm_id
WHERE m.k = 1 GROUP BY a.name ORDER BY a.name
"""
# The baseline: per run, the last point by the primary key index.
FINAL_SQLITE = """
SELECT a.name, avg((SELECT m.value FROM metrics m WHERE m.run_id = r.run_id
                    AND m."key" = 'loss' ORDER BY m.step DESC LIMIT 1)), count(*)
FROM runs r JOIN arms a ON a.arm_id = r.arm_id GROUP BY a.name ORDER BY a.name
"""
HISTORY = 'SELECT step, value FROM metrics WHERE run_id = ? AND "key" = ? ORDER BY step'
# The same query handed whole to SQLite with DuckDB's sqlite_query(), so SQLite uses its
# index. sqlite_query() returns text (15 significant digits), so the value goes through
# printf('%!.17g') and back to DOUBLE to come out exact.
HISTORY_PASSTHROUGH = (
    "SELECT step::BIGINT AS step, value::DOUBLE AS value FROM sqlite_query('store', "
    "'SELECT step, printf(''%!.17g'', value) AS value FROM metrics "
    "WHERE run_id = {run_id:d} AND \"key\" = ''loss'' ORDER BY step')"
)


def queries(
    con: duckdb.DuckDBPyConnection, raw: sqlite3.Connection, run_id: int
) -> list[tuple[str, Callable[[], Any]]]:
    """Each question, through DuckDB and then its bare-sqlite3 baseline."""
    run_key = raw.execute("SELECT run_key FROM runs WHERE run_id = ?", (run_id,)).fetchone()[0]
    return [
        ("history_lab", lambda: lab.inspect.history(con, run_key, "loss").fetchall()),
        ("history_lab_df", lambda: lab.inspect.history(con, run_key, "loss").df()),
        ("final_metrics", lambda: con.execute(FINAL_DUCK).fetchall()),
        ("final_sqlite", lambda: raw.execute(FINAL_SQLITE).fetchall()),
        ("summaries", lambda: con.execute(SUMMARY_DUCK).fetchall()),
        ("final_from_metrics", lambda: con.execute(FINAL_FROM_METRICS).fetchall()),
        ("history_fetchall", lambda: con.execute(HISTORY, [run_id, "loss"]).fetchall()),
        ("history_df", lambda: con.execute(HISTORY, [run_id, "loss"]).df()),
        ("history_sqlite", lambda: raw.execute(HISTORY, (run_id, "loss")).fetchall()),
        (
            "history_sqlite_query",
            lambda: con.execute(HISTORY_PASSTHROUGH.format(run_id=run_id)).fetchall(),
        ),
    ]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def same_answer(a: list[tuple], b: list[tuple]) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and abs(x[1] - y[1]) < 1e-9 and x[2] == y[2] for x, y in zip(a, b, strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--keys", type=int, default=10, choices=range(1, len(KEYS) + 1))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="10 runs x 1,000 steps x 10 keys")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the cached store")
    parser.add_argument("--cache-dir", type=Path, default=CACHE, help=f"default: {CACHE}")
    parser.add_argument("--arrow-full", action="store_true", help="time arrow mode at full size")
    args = parser.parse_args()
    if args.quick:
        args.arms, args.repeats, args.steps, args.rounds = 2, 5, 1000, 3
    points = args.arms * args.repeats * args.steps * args.keys
    shape = (args.arms, args.repeats, args.steps, args.keys)
    path = cached_store(args.cache_dir, *shape, rebuild=args.rebuild)
    url = f"sqlite:///{path}"
    Store(url).close()  # upgrade an old cached store now, not inside the first timed connect

    times: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    raw = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    run_id = raw.execute("SELECT max(run_id) FROM runs").fetchone()[0]
    modes = set()
    for i in range(args.rounds):
        seconds, con = timed(lambda: lab.inspect.connect(url, mode="attach"))
        record("connect", seconds)
        modes.add(con.execute("SELECT mode FROM lab_source").fetchone()[0])
        pairs = queries(con, raw, run_id)
        if i % 2:
            pairs.reverse()  # alternate which of a pair goes first
        answers = {}
        for name, fn in pairs:
            seconds, answers[name] = timed(fn)
            record(name, seconds)
        con.close()
        assert same_answer(answers["final_metrics"], answers["final_sqlite"])
        assert same_answer(answers["summaries"], answers["final_sqlite"])
        assert same_answer(answers["final_from_metrics"], answers["final_sqlite"])
        assert len(answers["history_fetchall"]) == args.steps == len(answers["history_df"])
        assert answers["history_fetchall"] == answers["history_sqlite"]
        assert answers["history_sqlite_query"] == answers["history_sqlite"]
        assert answers["history_lab"] == answers["history_sqlite"]
        log(
            f"round {i + 1}/{args.rounds}: "
            + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in times.items())
        )
    raw.close()

    arrow = arrow_mode(args, url, points)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "bench": "query",
        "runs": args.arms * args.repeats,
        "arms": args.arms,
        "steps": args.steps,
        "keys": args.keys,
        "points": points,
        "rounds": args.rounds,
        "store_mb": round(path.stat().st_size / 1e6),
        "mode": sorted(modes),
        "seconds_median": {k: round(v, 4) for k, v in med.items()},
        "seconds_first": {k: round(v[0], 4) for k, v in times.items()},
        "seconds_max": {k: round(max(v), 4) for k, v in times.items()},
        "vs_sqlite": {
            "final_metrics": round(med["final_metrics"] / med["final_sqlite"], 1),
            "summaries": round(med["summaries"] / med["final_sqlite"], 1),
            "final_from_metrics": round(med["final_from_metrics"] / med["final_sqlite"], 1),
            "history_fetchall": round(med["history_fetchall"] / med["history_sqlite"], 1),
            "history_lab": round(med["history_lab"] / med["history_sqlite"], 1),
            "history_sqlite_query": round(med["history_sqlite_query"] / med["history_sqlite"], 1),
        },
        "target_s": 1.0,
        "meets_target": {
            k: max(times[k]) < 1.0
            for k in (
                "final_metrics",
                "summaries",
                "history_lab",
                "history_lab_df",
                "history_fetchall",
                "history_df",
            )
        },
        "arrow": arrow,
        "machine": machine(duckdb=duckdb.__version__),
    }
    print(json.dumps(out))


def arrow_mode(args: argparse.Namespace, url: str, points: int) -> dict[str, Any]:
    """Arrow mode's connect time: on a 1-run store of the same shape, or the full store."""
    if args.arrow_full:
        target, size = url, points
    else:
        small = cached_store(args.cache_dir, 1, 1, args.steps, args.keys, rebuild=False)
        target, size = f"sqlite:///{small}", args.steps * args.keys
        Store(target).close()
    seconds = []
    for _ in range(1 if args.arrow_full else 3):
        s, con = timed(lambda: lab.inspect.connect(target, mode="arrow"))
        con.close()
        seconds.append(s)
    s = statistics.median(seconds)
    return {
        "points": size,
        "connect_s": round(s, 3),
        "us_per_point": round(s / size * 1e6, 3),
        "extrapolated_connect_s_at_full": round(s / size * points, 1),
    }


if __name__ == "__main__":
    main()
