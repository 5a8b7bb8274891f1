"""Where the default writer's cost lands: the training steps that run while a batch is
being written in the writer process, against the steps that don't, in the same fits.

Each round runs a bare fit and a `handle_sql` fit with the default writer (the process,
started and ready before the clock, as in bench/writer_ab.py), 8 metrics per step, with
`--settle` seconds after each (see writer_ab.py). In the `handle_sql` fit, each batch
exchange (the writer thread's call of `WriterProcess`: send the batch, wait for the
process to commit it, read the answer) is timed; a step "overlaps" an exchange when their
spans meet. While it waits, the writer thread holds no GIL and does no work, so what the
overlapping steps lose is what the writer process's own work costs the training thread on
the machine's other core.

Per round, through `overhead.writer_share`: the median step of bare, of the `handle_sql`
steps that overlap an exchange and of those that don't, the share of steps that overlap,
the exchanges' count and mean duration, the writer thread's CPU per point, and
`overlap_added_ms_per_fit`: the fit's mean step less the mean of the steps that overlap
nothing, times the steps. The medians over the rounds are printed as one JSON line.

    python bench/exchange_steps.py [--steps 2000] [--rounds 8] [--settle 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import overhead
import torch
from _common import machine

from lab.store import Store
from lab.store.writer import MetricWriter

K = 8


class _Exchanges:
    """Times every batch write of the `MetricWriter`s made while it is installed, as
    `overhead.WriteTimer` records them (start, end, points, the writer thread's CPU), so
    `overhead.writer_share` reads them. The writer's own method is wrapped, not its write
    function: reaching that would start the writer thread before the fit's clock."""

    def __init__(self) -> None:
        self.writes: list[tuple[float, float, int, float]] = []
        self._attempt = MetricWriter._attempt

    def __enter__(self) -> _Exchanges:
        attempt, writes = self._attempt, self.writes

        def timed(writer: MetricWriter, items: list[Any]) -> BaseException | None:
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                return attempt(writer, items)
            finally:
                if items:
                    points = sum(len(item[2]) for item in items)
                    writes.append((started, time.perf_counter(), points, time.thread_time() - cpu))

        MetricWriter._attempt = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        MetricWriter._attempt = self._attempt  # type: ignore[method-assign]


def split(
    result: dict[str, Any], writes: list[tuple[float, float, int, float]]
) -> dict[str, float]:
    """`overhead.writer_share` of the fit, in µs and ms: the steps that overlap an exchange
    against the others, and what the overlapping ones add to the fit."""
    share = overhead.writer_share({**result, "writes": writes})
    assert share is not None, "no step overlapped an exchange, or every step did"
    steps = len(result["step_s"])
    return {
        "overlapping_steps_pct": share["steps_overlapping_pct"],
        "overlapping_step_us_median": 1e6 * share["overlap_step_s_median"],
        "other_step_us_median": 1e6 * share["clear_step_s_median"],
        "exchanges": share["writes"],
        "exchange_ms_mean": 1e3 * statistics.mean(b - a for a, b, _p, _c in writes),
        "overlap_added_ms_per_fit": 1e3 * share["writer_s_per_step"] * steps,
        "writer_thread_cpu_us_per_point": 1e6 * share["writer_cpu_s_per_point"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--settle", type=float, default=0.5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    overhead.one_fit("bare", K, 200, None)  # warm torch up before any fit is timed
    rows: list[dict[str, float]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lab-bench-exchange-") as tmp:
        overhead.start_writer_process(Path(tmp))
        for i in range(args.rounds):
            row: dict[str, float] = {}
            for arm in ("bare", "handle_sql") if i % 2 == 0 else ("handle_sql", "bare"):
                if arm == "bare":
                    bare = overhead.one_fit("bare", K, args.steps, None)
                    row["bare_step_us_median"] = 1e6 * statistics.median(bare["step_s"])
                else:
                    store = Store(f"sqlite:///{Path(tmp) / f'fit-{i}.db'}")
                    try:
                        with _Exchanges() as exchanges:
                            result = overhead.one_fit(arm, K, args.steps, store)
                    finally:
                        store.close()
                    row.update(split(result, exchanges.writes))
                os.sync()
                time.sleep(args.settle)
            rows.append(row)
            print(f"round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
    out = {
        "bench": "exchange_steps",
        "steps": args.steps,
        "rounds": args.rounds,
        "settle_s": args.settle,
        "seconds": round(time.perf_counter() - started, 1),
        **{key: round(statistics.median(r[key] for r in rows), 2) for key in rows[0]},
        "machine": machine(torch_threads=torch.get_num_threads()),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
