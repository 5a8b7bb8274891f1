"""What lab costs the training thread per step, in that thread's own CPU time.

Wall time on a shared machine moves with the load: the same bare loop measured against
itself spreads by ±12%. The training thread's CPU clock (`time.thread_time_ns`) counts only
what that thread executed, so the writer thread, other processes and the scheduler's waits
are not in it. This bench reads it around the loop on the training thread, and reports for
context the whole process's CPU (`time.process_time_ns`) and the metric writer thread's
(its own CPU clock, `time.pthread_getcpuclockid`) over the same span. That last reads 0 when
the loop ends before the writer's first batch is due (a fast loop's steps are all written
after the clock stops), and never counts the writer process's work.

The arms, at k = 10, 30 and 100 metrics per step:

    bare@k  a plain `for` loop of `--steps` steps: the step's work, then a fresh dict of k
            floats built and dropped (what a loop that logs nothing does)
    aa@k    the same again: the A/A spread of the figure at that moment
    lab@k   `lab.start_run` on a fresh SQLite store (the default writer) and a `RunHandle`
            with the default `log_every=1`; each step does the same work and hands the same
            dict to `loop.end_step`

"added" is an arm's CPU per step less bare's at the same k, in the same round; the figures
are the medians over `--rounds` rounds, whose order rotates (`_common.alternate`), with the
A/A arm's own added figure beside them (its median and its range over the rounds). The
clocks cover the steps alone (`for step in loop.steps(): ... loop.end_step(m)`), not the
handle's start or end.

With more than one k, "passes" times alone (`timeit`-style, thread CPU) the passes over a
step's metrics that no design can leave out (the copy, the float check, the key check), and
"ratio_floor" adds their growth from the least k to the greatest to lab's figure at the
least k: the least "ratio" (lab at the greatest k over lab at the least) can be.

`--step-ms 10` gives every step a torch matmul sized (once, at the start) to take about
10 ms on one torch thread, and k = 10 only: then the wall time of the loop is the figure,
lab against bare, with the A/A spread beside it. `--load N` runs N processes that each spin
on a core meanwhile.

Prints one JSON line.

    python bench/thread_cpu.py [--steps 5000] [--rounds 7] [--step-ms 0] [--load 0]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sqlite3
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import alternate, busy, log, machine, stop

import lab
from lab.store import Store

KS = (10, 30, 100)
WRITER_THREAD = "lab-metric-writer"


def matmul_step(ms: float) -> Callable[[], None]:
    """A step of about `ms` milliseconds: a square matmul, its size found by timing."""
    if ms <= 0:
        return lambda: None
    torch.set_num_threads(1)
    n = 64
    while True:
        a = torch.randn(n, n)
        t0 = time.perf_counter()
        for _ in range(3):
            a @ a
        took = (time.perf_counter() - t0) / 3 * 1000
        if took >= ms:
            break
        n = int(n * max(1.1, min(2.0, (ms / max(took, 1e-3)) ** (1 / 3))))
    a = torch.randn(n, n)
    log(f"step: a {n}x{n} matmul, {took:.1f} ms")
    return lambda: a @ a  # type: ignore[return-value]  # the result is dropped


def writer_clock() -> Callable[[], int]:
    """The metric writer thread's CPU clock (ns), or a clock that reads 0 without one."""
    for thread in threading.enumerate():
        if thread.name == WRITER_THREAD and thread.ident is not None:
            clock = time.pthread_getcpuclockid(thread.ident)
            return lambda: time.clock_gettime_ns(clock)
    return lambda: 0


def clocks() -> tuple[int, int, int, int]:
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    return time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns(), faults


def spans(
    start: tuple[int, int, int, int], end: tuple[int, int, int, int], writer: int, steps: int
) -> dict[str, float]:
    """µs per step of each clock between `start` and `end`; "s" the wall seconds; the
    training thread's page faults per step (memory it touched for the first time)."""
    wall, thread, process, faults = (b - a for a, b in zip(start, end, strict=True))
    return {
        "faults": faults / steps,
        "s": wall / 1e9,
        "wall_us": wall / steps / 1e3,
        "thread_us": thread / steps / 1e3,
        "process_us": process / steps / 1e3,
        "writer_us": writer / steps / 1e3,
    }


def template(k: int) -> dict[str, float]:
    return {"loss": 0.0, **{f"m{i}": float(i) for i in range(1, k)}}


def fit_bare(steps: int, k: int, work: Callable[[], None]) -> dict[str, float]:
    base = template(k)
    start = clocks()
    for step in range(1, steps + 1):
        work()
        metrics = base.copy()
        metrics["loss"] = 1.0 / step
    return spans(start, clocks(), 0, steps)


def fit_lab(steps: int, k: int, work: Callable[[], None], folder: Path, i: int) -> dict[str, float]:
    base = template(k)
    model = torch.nn.Linear(2, 1)
    store = Store(f"sqlite:///{folder / f'lab-{k}-{i}.db'}")  # migrated before the clock
    try:
        run = lab.start_run(f"cpu-{k}-{i}", store=store, output_dir=folder, quiet=True)
        with run as spec, lab.RunHandle(spec, model, num_steps=steps) as loop:
            store.writer  # noqa: B018  # started now (else at the first step): its clock
            writer = writer_clock()
            w0, start = writer(), clocks()
            for step in loop.steps():
                work()
                metrics = base.copy()
                metrics["loss"] = 1.0 / step
                loop.end_step(metrics)
            end, w1 = clocks(), writer()
    finally:
        store.close()
    with sqlite3.connect(folder / f"lab-{k}-{i}.db") as con:  # every point is there
        rows = con.execute("SELECT count(*) FROM metrics").fetchone()[0]
    assert rows == steps * k, (rows, steps * k)
    return spans(start, end, w1 - w0, steps)


def floor(ks: tuple[int, ...], number: int = 100_000) -> dict[str, Any]:
    """What the passes over a step's k metrics that no design can leave out cost the
    training thread, timed alone (`timeit`, thread CPU): the copy that makes the step's
    dict its own (the caller may change theirs), the check that every value is a float (a
    tensor must be read now, a string refused now), and the check that the keys are those
    of the step before. Each is one pass in C; their growth from the least k to the
    greatest, added to lab's figure at the least k, is the least lab's figure at the
    greatest k can be, before any memory the queued steps take."""
    from lab._metrics import all_floats

    out: dict[str, Any] = {}
    for k in ks:
        metrics = template(k)
        order = list(metrics)
        passes = {
            "copy": lambda m=metrics: dict(m),
            "floats": lambda m=metrics: all_floats(m.values()),
            "keys": lambda m=metrics, o=order: list(m) == o,
            "nothing": lambda: None,
        }
        cost = {}
        for name, call in passes.items():
            start = time.thread_time_ns()
            for _ in range(number):
                call()
            cost[name] = (time.thread_time_ns() - start) / number / 1e3
        nothing = cost.pop("nothing")  # the call of the lambda itself
        out[str(k)] = {name: round(us - nothing, 3) for name, us in cost.items()}
        out[str(k)]["sum"] = round(sum(out[str(k)].values()), 3)
    return out


def summary(results: dict[str, list[dict[str, float]]], ks: tuple[int, ...]) -> dict[str, Any]:
    """Per k: each arm's median per step, and lab's and aa's added over bare, per round."""
    out: dict[str, Any] = {}
    for k in ks:
        bare, aa, with_lab = (results[f"{arm}@{k}"] for arm in ("bare", "aa", "lab"))
        row: dict[str, Any] = {}
        for clock in ("thread_us", "wall_us", "process_us"):
            added = [b[clock] - a[clock] for a, b in zip(bare, with_lab, strict=True)]
            noise = [b[clock] - a[clock] for a, b in zip(bare, aa, strict=True)]
            row[clock] = {
                "bare": round(statistics.median(r[clock] for r in bare), 3),
                "lab": round(statistics.median(r[clock] for r in with_lab), 3),
                "added": round(statistics.median(added), 3),
                "aa_added": round(statistics.median(noise), 3),
                "aa_range": [round(min(noise), 3), round(max(noise), 3)],
            }
        lab_ratio = [b["wall_us"] / a["wall_us"] for a, b in zip(bare, with_lab, strict=True)]
        aa_ratio = [b["wall_us"] / a["wall_us"] for a, b in zip(bare, aa, strict=True)]
        row["wall_ratio"] = {
            "lab": round(statistics.median(lab_ratio), 4),
            "aa": round(statistics.median(aa_ratio), 4),
            "aa_range": [round(min(aa_ratio), 4), round(max(aa_ratio), 4)],
        }
        row["writer_thread_us"] = round(statistics.median(r["writer_us"] for r in with_lab), 3)
        row["faults_per_step"] = {
            "lab": [round(r["faults"], 3) for r in with_lab],
            "bare": round(statistics.median(r["faults"] for r in bare), 3),
        }
        row["thread_us_per_round"] = [
            round(b["thread_us"] - a["thread_us"], 3) for a, b in zip(bare, with_lab, strict=True)
        ]
        out[str(k)] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--step-ms", type=float, default=0.0, help="a step of busy work (ms)")
    parser.add_argument("--load", type=int, default=0, metavar="N", help="N spinning processes")
    args = parser.parse_args()
    work = matmul_step(args.step_ms)
    ks = KS if args.step_ms <= 0 else (10,)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        arms: dict[str, Callable[[int], dict[str, float]]] = {}
        for k in ks:
            arms[f"bare@{k}"] = lambda i, k=k: fit_bare(args.steps, k, work)
            arms[f"aa@{k}"] = lambda i, k=k: fit_bare(args.steps, k, work)
            arms[f"lab@{k}"] = lambda i, k=k: fit_lab(args.steps, k, work, folder, i)
        for k in ks:  # warm: imports, the first store, the code's caches
            fit_lab(min(args.steps, 200), k, work, folder, -1)
        load = busy(args.load)
        try:
            results = alternate(args.rounds, arms)
            passes = floor(ks) if len(ks) > 1 else {}  # under the same load
        finally:
            stop(load)
    per_k = summary(results, ks)
    out: dict[str, Any] = {
        "bench": "thread_cpu",
        "steps": args.steps,
        "rounds": args.rounds,
        "step_ms": args.step_ms,
        "load": args.load,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "per_k": per_k,
    }
    if len(ks) > 1:
        least, most = str(ks[0]), str(ks[-1])
        at_least = per_k[least]["thread_us"]["added"]
        out["passes"] = passes
        out["ratio"] = round(per_k[most]["thread_us"]["added"] / at_least, 3)
        # lab at the least k, plus what the unavoidable passes grow by up to the greatest
        out["ratio_floor"] = round(
            (at_least + passes[most]["sum"] - passes[least]["sum"]) / at_least, 3
        )
    out["machine"] = machine()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
