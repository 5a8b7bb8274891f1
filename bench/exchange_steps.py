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

Per round: the mean step of bare, of the `handle_sql` steps that overlap an exchange and
of those that don't, and the exchanges' count and mean duration; the medians over the
rounds are printed as one JSON line, with `overlap_added_ms_per_fit`: how many ms per fit
the overlapping steps lose against the others.

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
    """Times every batch write of the `MetricWriter`s made while it is installed."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self._attempt = MetricWriter._attempt

    def __enter__(self) -> _Exchanges:
        attempt, spans = self._attempt, self.spans

        def timed(writer: MetricWriter, items: list[Any]) -> BaseException | None:
            started = time.perf_counter()
            try:
                return attempt(writer, items)
            finally:
                if items:
                    spans.append((started, time.perf_counter()))

        MetricWriter._attempt = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        MetricWriter._attempt = self._attempt  # type: ignore[method-assign]


def split(result: dict[str, Any], spans: list[tuple[float, float]]) -> dict[str, float]:
    """The fit's steps that overlap an exchange against the others: count and mean (µs)."""
    over, clear = [], []
    for (start, end), step in zip(result["spans"], result["step_s"], strict=True):
        hit = any(s0 < end and start < s1 for s0, s1 in spans)
        (over if hit else clear).append(step)
    return {
        "overlapping_steps": len(over),
        "overlapping_step_us_mean": 1e6 * statistics.mean(over) if over else 0.0,
        "other_step_us_mean": 1e6 * statistics.mean(clear),
        "exchanges": len(spans),
        "exchange_ms_mean": 1e3 * statistics.mean(b - a for a, b in spans) if spans else 0.0,
        "overlap_added_ms_per_fit": 1e3 * sum(step - statistics.mean(clear) for step in over),
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
                    row["bare_step_us_mean"] = 1e6 * statistics.mean(bare["step_s"])
                else:
                    store = Store(f"sqlite:///{Path(tmp) / f'fit-{i}.db'}")
                    try:
                        with _Exchanges() as exchanges:
                            result = overhead.one_fit(arm, K, args.steps, store)
                    finally:
                        store.close()
                    row.update(split(result, exchanges.spans))
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
