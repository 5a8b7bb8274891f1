"""The store's two metric writers side by side: the default (``writer="auto"``: the writer
process, here already running and ready, as for every fit of a program after its first
2,000 points) against the writer thread (``writer="thread"``), on the fits of
bench/overhead.py at 8 metrics per step, with more rounds than overhead.py can afford, so
that a difference of a few percent shows through a loaded machine's noise.

Each round runs `bare`, `aa` (bare again: the A/A control), `handle` (the loop on
`RunHandle`, no callbacks), and overhead.py's `handle_sql` and `loop_sql` with each writer:
`_auto` and `_thread`, and `handle_sql_none`: `SqlLogger` on a store whose batch write does
nothing (the floor: what a writer that cost the training process nothing would leave, the
hook and the run's rows). Three arms run no lab at all, to show what writing the same
points costs on this machine whatever writes them: `bare_raw`, the bare loop while
bench/_raw_writer.py (raw sqlite3 in its own process) inserts its points every `RAW_BATCH`
steps, until the last is committed; `bare_raw_norowid`, the same into a `WITHOUT ROWID`
table; `bare_after`, all of them written after the loop. The order starts at another arm
each round and runs backwards every other round (`overhead.spread`). Per arm: the whole
fit until durable and the mean and median step, each less bare's in the same round, as a
percentage of bare's, the median over the rounds; the start (before the first step) and
the end (after the last) in ms; and how many rounds the default came out below the thread
on the same loop. `targets` holds the issue's two figures for the default writer.

After each fit the bench waits `--settle` seconds (0.5) after an `os.sync()`: a store's
close (its WAL checkpoint, the writer process letting go of it) and the kernel's writeback
of its file would otherwise run on the two cores during the next arm's fit, which is most
often bare or the A/A arm, and count against them (the A/A arm came out at -4.5% over 30
rounds without the pause, +0.3% over 20 with it).

Prints one JSON line.

    python bench/writer_ab.py [--steps 2000] [--rounds 12] [--settle 0.5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _raw_writer
import overhead
import torch
from _common import machine

ARMS = (
    "bare", "aa", "handle", "bare_raw", "bare_raw_norowid", "bare_after", "handle_sql_auto",
    "handle_sql_thread", "handle_sql_none", "loop_sql_auto", "loop_sql_thread",
)  # fmt: skip
K = 8
#: The raw writer's batch: the steps of about `PROCESS_INTERVAL_S` (50 ms) at a 300 µs step,
#: as the writer thread hands the writer process a batch every 50 ms.
RAW_BATCH = 160


class RawWriter:
    """bench/_raw_writer.py, started once: sqlite3 with no lab in it, in its own process."""

    def __init__(self, k: int, *flags: str) -> None:
        script = Path(__file__).with_name("_raw_writer.py")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(k), *flags],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.k = k

    def _send(self, op: int, arg: int, tail: bytes = b"") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(_raw_writer.FRAME.pack(op, arg) + tail)
        self.proc.stdin.flush()

    def _answer(self) -> None:
        assert self.proc.stdout is not None
        assert self.proc.stdout.read(1) == b"k", "the raw writer died"

    def open(self, path: Path) -> None:
        name = str(path).encode()
        self._send(_raw_writer.OPEN, len(name), name)
        self._answer()

    def write(self, steps: int) -> None:
        """Hand over the steps up to `steps` (the training thread does not wait)."""
        self._send(_raw_writer.WRITE, steps)

    def durable(self, steps: int) -> None:
        """The last steps, then wait until all of them are committed."""
        self.write(steps)
        self._send(_raw_writer.SYNC, 0)
        self._answer()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


def raw_fit(arm: str, raw: RawWriter, steps: int, folder: Path, i: int) -> dict[str, Any]:
    """`bare_raw`: the bare loop, its points written by the raw writer while it runs (a
    batch every `RAW_BATCH` steps), until the last is committed. `bare_after`: the bare
    loop, then every point written in one batch after it, until committed."""
    path = folder / f"{arm}-{i}.db"
    raw.open(path)
    during = arm.startswith("bare_raw")
    result = overhead.one_fit(
        "bare",
        raw.k,
        steps,
        None,
        tick=raw.write if during else None,
        every=RAW_BATCH if during else 0,
        durable=raw.durable,
    )
    with sqlite3.connect(path) as conn:
        (count,) = conn.execute("SELECT count(*) FROM metrics").fetchone()
    assert count == steps * raw.k, f"{arm}: {count} rows, expected {steps * raw.k}"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--settle", type=float, default=0.5, help="seconds between fits")
    parser.add_argument("--quick", action="store_true", help="300 steps, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 300, 2
    torch.set_num_threads(1)
    overhead.one_fit("bare", K, 200, None)  # warm torch up before any arm is timed
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lab-bench-writer-ab-") as tmp:
        # the first store of the process starts the writer process: once, before the clock
        overhead.start_writer_process(Path(tmp))
        raws = {"": RawWriter(K), "_norowid": RawWriter(K, "without_rowid")}
        for i in range(args.rounds):
            for arm in overhead.spread(ARMS, i, args.rounds):
                if arm.startswith("bare_"):
                    raw = raws["_norowid" if arm.endswith("_norowid") else ""]
                    results[arm].append(raw_fit(arm, raw, args.steps, Path(tmp), i))
                else:
                    results[arm].append(overhead.run_arm(arm, K, args.steps, Path(tmp), i))
                os.sync()  # the last fit's file on disk before the next fit's clock starts
                time.sleep(args.settle)
            print(f"round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for raw in raws.values():
            raw.close()

    def added_pct(arm: str, field: str, stat: Any) -> float:
        """Median over rounds of (arm - bare) / bare, in percent, both of the same round."""
        return round(
            statistics.median(
                100 * (stat(a[field]) - stat(b[field])) / stat(b[field])
                for a, b in zip(results[arm], results["bare"], strict=True)
            ),
            2,
        )

    def figures(arm: str) -> dict[str, Any]:
        return {
            "fit_s_median": round(statistics.median(r["fit_s"] for r in results[arm]), 4),
            "added_fit_pct": added_pct(arm, "fit_s", float),
            "added_mean_step_pct": added_pct(arm, "step_s", statistics.mean),
            "added_median_step_pct": added_pct(arm, "step_s", statistics.median),
            "added_start_ms_median": round(
                statistics.median(
                    (a["start_s"] - b["start_s"]) * 1e3
                    for a, b in zip(results[arm], results["bare"], strict=True)
                ),
                2,
            ),
            "added_end_ms_median": round(
                statistics.median(
                    (a["end_s"] - b["end_s"]) * 1e3
                    for a, b in zip(results[arm], results["bare"], strict=True)
                ),
                2,
            ),
            "other_threads_cpu_s_median": round(
                statistics.median(r["other_threads_cpu_s"] for r in results[arm]), 4
            ),
        }

    def wins(loop: str, field: str, stat: Any) -> int:
        """Rounds in which the default (the writer process) came out below the thread."""
        return sum(
            stat(p[field]) < stat(t[field])
            for p, t in zip(results[f"{loop}_auto"], results[f"{loop}_thread"], strict=True)
        )

    out = {
        "bench": "writer_ab",
        "steps": args.steps,
        "settle_s": args.settle,
        "rounds": args.rounds,
        "metrics_per_step": K,
        "seconds": round(time.perf_counter() - started, 1),
        "bare": {
            "fit_s_median": round(statistics.median(r["fit_s"] for r in results["bare"]), 4),
            "mean_step_us_median": round(
                statistics.median(statistics.mean(r["step_s"]) for r in results["bare"]) * 1e6,
                2,
            ),
        },
        "arms": {arm: figures(arm) for arm in ARMS if arm != "bare"},
        "auto_below_thread_rounds": {
            loop: {
                "fit": wins(loop, "fit_s", float),
                "mean_step": wins(loop, "step_s", statistics.mean),
            }
            for loop in ("handle_sql", "loop_sql")
        },
        "targets": {
            "fit_and_mean_step_pct_max": 5.0,
            **{
                f"{loop}_auto": [
                    added_pct(f"{loop}_auto", "fit_s", float),
                    added_pct(f"{loop}_auto", "step_s", statistics.mean),
                ]
                for loop in ("handle_sql", "loop_sql")
            },
            "aa": [added_pct("aa", "fit_s", float), added_pct("aa", "step_s", statistics.mean)],
        },
        "machine": machine(torch_threads=torch.get_num_threads()),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
