"""Writing one eval's predictions through `Store.write_eval`, against raw `executemany`.

The workload: one eval with 100,000 predictions, each a dict with an example id, an input
of about 200 characters, an output, a target and a score (what a benchmark evaluator
returns), written with `Store.write_eval(run_id, EvalResult(...), predictions=[...])`. The
call returns once the eval and its predictions are committed, so it is timed whole.

Two baselines get the same list of dicts and turn them into rows themselves:

    raw             the bare driver into an equivalent table: the same columns and primary
                    key (eval_id, idx), one executemany and one commit (on SQLite with WAL
                    and synchronous=NORMAL, as lab's engine sets them)
    raw_lab_schema  the bare driver into lab's own `predictions` table (its foreign key to
                    evals on), after an evals row made the same way: what lab's schema
                    costs, apart from lab's code

Each round writes into fresh databases, the arms rotating their order; medians reported.
Row counts are checked after each clock stops. Prints one JSON line.

    python bench/predictions.py [--rows 100000] [--rounds 5] [--quick]
    python bench/predictions.py --postgres postgresql://user:pw@host/admin_db  # or set
                                               # LAB_BENCH_POSTGRES_URL; adds PostgreSQL
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
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

from lab.loop.evals import EvalResult
from lab.store import Store

Row = tuple[int, int, str | None, str | None, str | None, str | None, float | None, None]

WORDS = (
    "the", "a", "model", "loss", "step", "token", "batch", "layer", "query", "answer",
    "river", "mountain", "seven", "blue", "quick", "brown", "fox", "jumps", "over", "lazy",
    "dog", "paper", "table", "chair", "window", "light", "sound", "green", "number",
)  # fmt: skip


def make_predictions(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` predictions: about 200 characters of input, short output and target, a score."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < 200:
            words.append(rng.choice(WORDS))
        text = " ".join(words)[:200]
        answer = " ".join(rng.choices(WORDS, k=3))
        out.append(
            {
                "example_id": f"ex-{i:06d}",
                "input": text,
                "output": answer,
                "target": answer if rng.random() < 0.7 else " ".join(rng.choices(WORDS, k=3)),
                "score": rng.random(),
            }
        )
    return out


def rows_of(eval_id: int, predictions: list[dict[str, Any]]) -> list[Row]:
    """The rows a baseline writes: what lab stores for these dicts (strings, float score)."""
    return [
        (
            eval_id, i, str(p["example_id"]), p["input"], p["output"], p["target"],
            float(p["score"]), None,
        )
        for i, p in enumerate(predictions)
    ]  # fmt: skip


def make_run(store: Store) -> int:
    exp = store.begin_experiment(f"preds-{uuid.uuid4().hex[:8]}", config={}, seed=0, repeats=1)
    group = store.add_group(exp, "g")
    return store.start_run(
        exp, group, run_key="r", arm_id=None, repeat=0, stage=0, seed=0, config={},
        output_dir=None,
    )  # fmt: skip


def lab_round(url: str, predictions: list[dict[str, Any]]) -> dict[str, float]:
    store = Store(url)
    try:
        run_id = make_run(store)
        result = EvalResult("bench", {"acc": 0.7}, step=None, seconds=1.0)
        cpu0, t0 = time.process_time(), time.perf_counter()
        eval_id = store.write_eval(run_id, result, predictions)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        with store.engine.connect() as conn:
            count = conn.exec_driver_sql(
                f"SELECT count(*) FROM predictions WHERE eval_id = {int(eval_id)}"
            ).scalar_one()
    finally:
        store.close()
    assert count == len(predictions), f"lab wrote {count} predictions"
    return {"s": seconds, "cpu_s": cpu}


# -- SQLite ------------------------------------------------------------------------------
TABLE = """
CREATE TABLE {name} (
    eval_id INTEGER NOT NULL, idx INTEGER NOT NULL, example_id TEXT, input TEXT,
    output TEXT, target TEXT, score {double}, extras {json},
    PRIMARY KEY (eval_id, idx)
)"""
INSERT = (
    "INSERT INTO {name} (eval_id, idx, example_id, input, output, target, score, extras) "
    "VALUES ({m}, {m}, {m}, {m}, {m}, {m}, {m}, {m})"
)
EVAL_ROW = (
    "INSERT INTO evals (run_id, name, step, metrics, breakdowns, tags, seconds, error, "
    "created_at) VALUES ({m}, 'bench', NULL, '{{\"acc\": 0.7}}', '{{}}', '{{}}', 1.0, NULL, "
    "CURRENT_TIMESTAMP) RETURNING eval_id"
)


def raw_sqlite_round(path: Path, predictions: list[dict[str, Any]]) -> dict[str, float]:
    con = sqlite3.connect(path, isolation_level=None)
    try:
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=NORMAL")
        con.execute(TABLE.format(name="raw_predictions", double="DOUBLE", json="JSON"))
        cpu0, t0 = time.process_time(), time.perf_counter()
        con.execute("BEGIN IMMEDIATE")
        con.executemany(INSERT.format(name="raw_predictions", m="?"), rows_of(1, predictions))
        con.execute("COMMIT")
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        count = con.execute("SELECT count(*) FROM raw_predictions").fetchone()[0]
    finally:
        con.close()
    assert count == len(predictions), f"raw sqlite3 wrote {count} predictions"
    return {"s": seconds, "cpu_s": cpu}


def raw_sqlite_lab_schema_round(path: Path, predictions: list[dict[str, Any]]) -> dict[str, float]:
    store = Store(f"sqlite:///{path}")
    try:
        run_id = make_run(store)
    finally:
        store.close()
    con = sqlite3.connect(path, isolation_level=None)
    try:
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON"):
            con.execute(f"PRAGMA {pragma}")  # as lab.store.engine sets them
        cpu0, t0 = time.process_time(), time.perf_counter()
        con.execute("BEGIN IMMEDIATE")
        eval_id = con.execute(EVAL_ROW.format(m="?"), (run_id,)).fetchone()[0]
        con.executemany(INSERT.format(name="predictions", m="?"), rows_of(eval_id, predictions))
        con.execute("COMMIT")
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        count = con.execute("SELECT count(*) FROM predictions").fetchone()[0]
    finally:
        con.close()
    assert count == len(predictions), f"raw sqlite3 wrote {count} predictions"
    return {"s": seconds, "cpu_s": cpu}


# -- PostgreSQL --------------------------------------------------------------------------
def raw_pg_round(libpq: str, predictions: list[dict[str, Any]]) -> dict[str, float]:
    import psycopg

    with psycopg.connect(libpq) as con:
        con.execute(TABLE.format(name="raw_predictions", double="DOUBLE PRECISION", json="JSON"))
        con.commit()
        cpu0, t0 = time.process_time(), time.perf_counter()
        with con.cursor() as cur:
            cur.executemany(INSERT.format(name="raw_predictions", m="%s"), rows_of(1, predictions))
        con.commit()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        count = con.execute("SELECT count(*) FROM raw_predictions").fetchone()[0]  # type: ignore[index]
    assert count == len(predictions), f"raw psycopg wrote {count} predictions"
    return {"s": seconds, "cpu_s": cpu}


def raw_pg_lab_schema_round(
    url: str, libpq: str, predictions: list[dict[str, Any]]
) -> dict[str, float]:
    import psycopg

    store = Store(url)
    try:
        run_id = make_run(store)
    finally:
        store.close()
    with psycopg.connect(libpq) as con:
        cpu0, t0 = time.process_time(), time.perf_counter()
        eval_id = con.execute(EVAL_ROW.format(m="%s"), (run_id,)).fetchone()[0]  # type: ignore[index]
        with con.cursor() as cur:
            rows = rows_of(eval_id, predictions)
            cur.executemany(INSERT.format(name="predictions", m="%s"), rows)
        con.commit()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        count = con.execute("SELECT count(*) FROM predictions").fetchone()[0]  # type: ignore[index]
    assert count == len(predictions), f"raw psycopg wrote {count} predictions"
    return {"s": seconds, "cpu_s": cpu}


# ----------------------------------------------------------------------------------------
def summarize(rows: int, results: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    med = {arm: statistics.median(r["s"] for r in runs) for arm, runs in results.items()}
    cpu = {arm: statistics.median(r["cpu_s"] for r in runs) for arm, runs in results.items()}
    return {
        "lab_rows_per_s": round(rows / med["lab"]),
        "raw_rows_per_s": round(rows / med["raw"]),
        "ratio": round(med["raw"] / med["lab"], 3),  # lab's rate as a fraction of raw's
        "ratio_per_round": [
            round(raw["s"] / lab["s"], 3)
            for lab, raw in zip(results["lab"], results["raw"], strict=True)
        ],
        "lab_s": [round(r["s"], 3) for r in results["lab"]],
        "raw_s": [round(r["s"], 3) for r in results["raw"]],
        "raw_lab_schema_rows_per_s": round(rows / med["raw_lab_schema"]),
        "ratio_vs_raw_lab_schema": round(med["raw_lab_schema"] / med["lab"], 3),
        "raw_lab_schema_s": [round(r["s"], 3) for r in results["raw_lab_schema"]],
        "lab_cpu_s_median": round(cpu["lab"], 3),
        "raw_cpu_s_median": round(cpu["raw"], 3),
        "cpu_ratio": round(cpu["raw"] / cpu["lab"], 3),
        "target_ratio": 0.5,
        "meets_target": med["raw"] / med["lab"] >= 0.5,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="10,000 rows, 3 rounds")
    add_postgres_option(parser)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.rounds = 10_000, 3
    predictions = make_predictions(args.rows)
    out: dict[str, Any] = {
        "bench": "predictions",
        "rows": args.rows,
        "input_chars_mean": round(statistics.mean(len(p["input"]) for p in predictions), 1),
        "rounds": args.rounds,
    }
    with tempfile.TemporaryDirectory(prefix="lab-bench-predictions-") as tmp:
        folder = Path(tmp)
        arms: dict[str, Callable[[int], dict[str, float]]] = {
            "lab": lambda i: lab_round(f"sqlite:///{folder / f'lab{i}.db'}", predictions),
            "raw": lambda i: raw_sqlite_round(folder / f"raw{i}.db", predictions),
            "raw_lab_schema": lambda i: raw_sqlite_lab_schema_round(
                folder / f"same{i}.db", predictions
            ),
        }
        out["sqlite"] = summarize(args.rows, alternate(args.rounds, arms))
    if args.postgres:
        with scratch_database(args.postgres, "predictions") as (url, libpq):

            def reset_then(fn: Callable[[], dict[str, float]]) -> dict[str, float]:
                pg_reset(libpq, "raw_predictions")
                return fn()

            Store(url).close()  # migrate once, outside the rounds
            pg_arms: dict[str, Callable[[int], dict[str, float]]] = {
                "lab": lambda _i: reset_then(lambda: lab_round(url, predictions)),
                "raw": lambda _i: reset_then(lambda: raw_pg_round(libpq, predictions)),
                "raw_lab_schema": lambda _i: reset_then(
                    lambda: raw_pg_lab_schema_round(url, libpq, predictions)
                ),
            }
            out["postgres"] = summarize(args.rows, alternate(args.rounds, pg_arms))
            out["postgres"]["server"] = pg_server_version(libpq)
    out["machine"] = machine()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
