"""Whether the cost of a metric point grows with the length of the run.

One run, 10 keys per step, logged through `Store.log_metrics` one step at a time and then
`flush()`ed, at 10^4, 10^5 and 10^6 points (1,000, 10,000 and 100,000 steps), each size in
a fresh SQLite store. Right before or after each (the order alternating), the same points go
into a fresh file through the bare `sqlite3` module (`executemany` into an equivalent
table, WAL, synchronous=NORMAL, one transaction per 8,192 steps as lab's writer batches
them at most): machine drift moves both alike, so lab / raw is the steadier figure. The
sizes rotate their order over the rounds. Reported: microseconds per point at each size
(medians over rounds), lab / raw per size, and largest / smallest, which stays near 1 (or
below: the smallest size pays fixed costs) when no per-step cost grows with the run.

The cost of one write as the run grows, on the largest size:

    flush_every  a 10^6-point run that calls `flush()` every 1,000 steps (10,000 points),
                 public API only; after each flush the same 10,000 points go into a raw
                 twin table that grows alike. The median flush of the first ten and of the
                 last ten, and lab / raw of each, paired flush by flush
    batches      the store's own write batches in the plain 10^6 run, timed by wrapping its
                 batch write function (`Store._write_metrics`, private: skipped if renamed);
                 microseconds per point of the batches in the first and the last tenth

Prints one JSON line.

    python bench/scaling.py [--sizes 10000 100000 1000000] [--rounds 3] [--quick]
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

from _common import log, machine

from lab.store import Store

KEYS = 10
FLUSH_EVERY = 1000  # steps between flushes in the flush_every run
RAW_BATCH = 8192  # steps per raw transaction: lab's writer takes at most this many at once

RAW_TABLE = """
CREATE TABLE metrics (
    run_id INTEGER NOT NULL, "key" VARCHAR(255) NOT NULL, step BIGINT NOT NULL,
    value DOUBLE, wall_time DOUBLE NOT NULL,
    PRIMARY KEY (run_id, "key", step)
)"""
RAW_INSERT = 'INSERT INTO metrics (run_id, "key", step, value, wall_time) VALUES (?, ?, ?, ?, ?)'


class RawTwin:
    """The same points through bare sqlite3, into a fresh file with an equivalent table."""

    def __init__(self, path: Path) -> None:
        self.con = sqlite3.connect(path, isolation_level=None)
        self.con.execute("PRAGMA journal_mode=WAL")
        self.con.execute("PRAGMA synchronous=NORMAL")
        self.con.execute(RAW_TABLE)

    def write(self, first: int, last: int, data: list[dict[str, float]]) -> float:
        """Steps first..last (each with data[step % len]) in one transaction; seconds."""
        n = len(data)
        t0 = time.perf_counter()
        rows = [
            (1, key, step, value, now)
            for step in range(first, last + 1)
            for now in (time.time(),)
            for key, value in data[step % n].items()
        ]
        self.con.execute("BEGIN IMMEDIATE")
        self.con.executemany(RAW_INSERT, rows)
        self.con.execute("COMMIT")
        return time.perf_counter() - t0

    def close(self) -> int:
        count = self.con.execute("SELECT count(*) FROM metrics").fetchone()[0]
        self.con.close()
        return count


def raw_run(folder: Path, steps: int, data: list[dict[str, float]]) -> float:
    """All the steps through the raw twin, RAW_BATCH steps per transaction; seconds."""
    twin = RawTwin(folder / f"raw-{uuid.uuid4().hex}.db")
    seconds = sum(
        twin.write(first, min(first + RAW_BATCH - 1, steps), data)
        for first in range(1, steps + 1, RAW_BATCH)
    )
    assert twin.close() == steps * KEYS
    return seconds


def pool(n: int = 1000, seed: int = 0) -> list[dict[str, float]]:
    """Step dicts to cycle through: the store copies each, so reusing them changes nothing."""
    rng = random.Random(seed)
    names = [f"metric_{k}" for k in range(KEYS)]
    return [{name: rng.random() for name in names} for _ in range(n)]


class BatchTimer:
    """Wraps the store's batch write: (steps written before, points, seconds) per batch."""

    def __init__(self, write: Callable[[list[Any]], None]) -> None:
        self.write = write
        self.batches: list[tuple[int, int, float]] = []
        self.steps = 0

    def __call__(self, items: list[Any]) -> None:
        t0 = time.perf_counter()
        self.write(items)
        if items:
            points = sum(len(item[2]) for item in items)
            self.batches.append((self.steps, points, time.perf_counter() - t0))
            self.steps += len(items)


def one_run(
    folder: Path, steps: int, data: list[dict[str, float]], *, flush_every: int = 0
) -> dict[str, Any]:
    """Log `steps` steps into a fresh store and flush; with `flush_every`, flush that often
    and time each flush."""
    store = Store(f"sqlite:///{folder / f'{uuid.uuid4().hex}.db'}")
    timer = None
    if not flush_every and hasattr(store, "_write_metrics"):
        timer = BatchTimer(store._write_metrics)
        store._write_metrics = timer  # type: ignore[method-assign]  # before the writer starts
    try:
        exp = store.begin_experiment("scaling", config={}, seed=0, repeats=1)
        group = store.add_group(exp, "g")
        run_id = store.start_run(
            exp, group, run_key="r", arm_id=None, repeat=0, stage=0, seed=0, config={},
            output_dir=None,
        )  # fmt: skip
        twin = RawTwin(folder / f"twin-{uuid.uuid4().hex}.db") if flush_every else None
        flushes: list[tuple[float, float]] = []  # (lab flush, raw twin batch) seconds
        n = len(data)
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            store.log_metrics(run_id, step, data[step % n])
            if twin is not None and step % flush_every == 0:
                f0 = time.perf_counter()
                store.flush()
                lab_s = time.perf_counter() - f0
                flushes.append((lab_s, twin.write(step - flush_every + 1, step, data)))
        store.flush()
        seconds = time.perf_counter() - t0  # (with a twin, its writes are in here too)
        with store.engine.connect() as conn:
            count = conn.exec_driver_sql("SELECT count(*) FROM metrics").scalar_one()
        if twin is not None:
            assert twin.close() == steps * KEYS
    finally:
        store.close()
    assert count == steps * KEYS, f"{count} points written, expected {steps * KEYS}"
    return {"s": seconds, "flushes": flushes, "batches": timer.batches if timer else None}


def batch_growth(batches: list[tuple[int, int, float]], steps: int) -> dict[str, Any]:
    """Microseconds per point of the batches written in the first and the last tenth."""
    first = [(p, s) for start, p, s in batches if start < steps // 10]
    last = [(p, s) for start, p, s in batches if start >= steps - steps // 10]
    if not first or not last:
        return {"batches": len(batches)}
    us_first = sum(s for _p, s in first) / sum(p for p, _s in first) * 1e6
    us_last = sum(s for _p, s in last) / sum(p for p, _s in last) * 1e6
    return {
        "batches": len(batches),
        "points_per_batch_median": statistics.median(p for _s, p, _t in batches),
        "first_tenth_us_per_point": round(us_first, 3),
        "last_tenth_us_per_point": round(us_last, 3),
        "last_over_first": round(us_last / us_first, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="10^3, 10^4, 10^5 points, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.rounds = [1_000, 10_000, 100_000], 2
    sizes = sorted(args.sizes)
    data = pool()
    lab_s: dict[int, list[float]] = {size: [] for size in sizes}
    raw_s: dict[int, list[float]] = {size: [] for size in sizes}
    growth: list[dict[str, Any]] = []
    flushes: list[list[tuple[float, float]]] = []
    largest = sizes[-1]
    with tempfile.TemporaryDirectory(prefix="lab-bench-scaling-") as tmp:
        folder = Path(tmp)
        arms: list[int | str] = [*sizes, "flush_every"]
        for i in range(args.rounds):
            for arm in arms[i % len(arms) :] + arms[: i % len(arms)]:
                if arm == "flush_every":
                    result = one_run(folder, largest // KEYS, data, flush_every=FLUSH_EVERY)
                    flushes.append(result["flushes"])
                    first, last = result["flushes"][:10], result["flushes"][-10:]
                    log(
                        f"round {i + 1}/{args.rounds} flush every {FLUSH_EVERY} steps: first "
                        f"{statistics.median(f for f, _r in first) * 1e3:.2f} ms, last "
                        f"{statistics.median(f for f, _r in last) * 1e3:.2f} ms"
                    )
                    continue
                assert isinstance(arm, int)
                for which in ("lab", "raw") if i % 2 == 0 else ("raw", "lab"):
                    if which == "raw":
                        raw_s[arm].append(raw_run(folder, arm // KEYS, data))
                        continue
                    result = one_run(folder, arm // KEYS, data)
                    lab_s[arm].append(result["s"])
                    if arm == largest and result["batches"] is not None:
                        growth.append(batch_growth(result["batches"], arm // KEYS))
                log(
                    f"round {i + 1}/{args.rounds} {arm} points: lab "
                    f"{lab_s[arm][-1] / arm * 1e6:.3f} us/point, raw "
                    f"{raw_s[arm][-1] / arm * 1e6:.3f} us/point"
                )
    us = {size: statistics.median(lab_s[size]) / size * 1e6 for size in sizes}
    raw_us = {size: statistics.median(raw_s[size]) / size * 1e6 for size in sizes}
    over_raw = {
        size: statistics.median(a / b for a, b in zip(lab_s[size], raw_s[size], strict=True))
        for size in sizes
    }

    def flush_stats(part: slice) -> dict[str, float]:
        pairs = [pair for run in flushes for pair in run[part]]
        return {
            "lab_ms_median": round(statistics.median(f for f, _r in pairs) * 1e3, 3),
            "raw_ms_median": round(statistics.median(r for _f, r in pairs) * 1e3, 3),
            "lab_over_raw_median": round(statistics.median(f / r for f, r in pairs), 3),
        }

    first, last = flush_stats(slice(None, 10)), flush_stats(slice(-10, None))
    out = {
        "bench": "scaling",
        "keys_per_step": KEYS,
        "rounds": args.rounds,
        "us_per_point": {str(size): round(v, 3) for size, v in us.items()},
        "raw_us_per_point": {str(size): round(v, 3) for size, v in raw_us.items()},
        "lab_over_raw": {str(size): round(v, 3) for size, v in over_raw.items()},
        "us_per_point_all": {
            str(size): [round(s / size * 1e6, 3) for s in lab_s[size]] for size in sizes
        },
        "largest_over_smallest": round(us[largest] / us[sizes[0]], 3),
        "largest_over_middle": round(us[largest] / us[sizes[len(sizes) // 2]], 3),
        "lab_over_raw_largest_over_smallest": round(over_raw[largest] / over_raw[sizes[0]], 3),
        "flush_every": {
            "steps": FLUSH_EVERY,
            "points_per_flush": FLUSH_EVERY * KEYS,
            "flushes_per_run": largest // KEYS // FLUSH_EVERY,
            "first_ten": first,
            "last_ten": last,
            "last_over_first_lab": round(last["lab_ms_median"] / first["lab_ms_median"], 3),
            "last_over_first_lab_over_raw": round(
                last["lab_over_raw_median"] / first["lab_over_raw_median"], 3
            ),
        },
        "batches_largest": growth,
        "machine": machine(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
