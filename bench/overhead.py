"""What `SqlLogger` costs the training thread, per step and in all, against the bare loop.

The loop: an MLP 32->64->1, batch 32, SGD, 2,000 steps, 1 torch thread; `loss_fn` returns
6 extras, so with the loop's own 4 (loss, lr, grad_norm, step_time) every step has 10
metrics. Four arms, each a fresh `TrainingLoop.fit()` of the same seeded model and data:

    bare  the loop with only the measuring callbacks
    aa    the same again: the A/A noise floor of the machine at that moment
    noop  plus a callback whose on_step_end does nothing, at SqlLogger's priority: what
          any one callback costs through the dispatcher
    sql   plus a SqlLogger writing into a fresh SQLite file (opened before the clock starts)

Every arm carries the same measuring callbacks, so every arm pays the same measurement cost:
`StepClock` stamps `time.perf_counter()` in `pre_step` (it runs first) and in `on_step_end`
(it runs last), so a step's time spans forward, backward, optimizer step, the metric dict
and every on_step_end hook; two `Stamp`s bracket SqlLogger's on_step_end (priorities 101
and 99) to time that hook alone. The first 10% of each fit's steps are dropped (warm-up).
The whole fit is timed too: for `sql` that includes creating the run and the final flush
in `on_train_end`, so when `fit()` returns every metric is durable.

The arms rotate their order every round; the per-round differences against `bare` are
paired (same round, seconds apart) and their median is reported, for the median step, the
mean step (which also counts the rare slow steps) and the training thread's own CPU time.

Inside each `sql` fit, the store's batch writes (on its writer thread) are timed by
wrapping the store's batch write function (`Store._write_metrics`, private: skipped if it
is renamed), and the steps that overlap a write are told from those that don't: the mean
step less the mean clear step is what the writer thread costs the training thread, from
one fit's own seconds, so machine drift cancels. Prints one JSON line.

    python bench/overhead.py [--steps 2000] [--rounds 10] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import StepClock, StepClockEnd, machine

from lab import Callback, SqlLogger, TrainingLoop
from lab.store import Store

METRICS_PER_STEP = 10
ARMS = ("bare", "aa", "noop", "sql")


class Stamp(Callback):
    """Records when its on_step_end runs; two of them bracket SqlLogger's (priority 100)."""

    def __init__(self, priority: int) -> None:
        self.priority = priority  # type: ignore[misc]
        self.times: list[float] = []

    def on_step_end(self, state, step_idx, batch, metrics) -> None:  # type: ignore[no-untyped-def]
        self.times.append(time.perf_counter())


class NoOp(Callback):
    """A callback that listens to on_step_end and does nothing, at SqlLogger's priority."""

    priority = 100

    def on_step_end(self, state, step_idx, batch, metrics) -> None:  # type: ignore[no-untyped-def]
        pass


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):  # type: ignore[no-untyped-def]
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    return loss, {f"extra_{i}": float(i) for i in range(METRICS_PER_STEP - 4)}


def one_fit(steps: int, extra: list[Callback]) -> dict[str, Any]:
    """One fit of the seeded model; returns its step times, hook bracket and whole-fit time."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    data = [(torch.randn(32, 32), torch.randn(32, 1)) for _ in range(16)]
    clock, before, after = StepClock(), Stamp(101), Stamp(99)
    loop = TrainingLoop(
        model, torch.optim.SGD(model.parameters(), lr=0.01), data, loss_fn, steps,
        callbacks=[*extra, clock, StepClockEnd(clock), before, after],
    )  # fmt: skip
    cpu0, thread0 = time.process_time(), time.thread_time()
    t0 = time.perf_counter()
    artifacts = loop.fit()
    fit_s = time.perf_counter() - t0
    other_cpu = (time.process_time() - cpu0) - (time.thread_time() - thread0)
    assert len(artifacts.metrics) == METRICS_PER_STEP, artifacts.metrics
    skip = steps // 10
    spans = list(zip(clock.starts, clock.ends, strict=True))[skip:]
    return {
        "spans": [(a[0], b[0]) for a, b in spans],
        "step_s": [b[0] - a[0] for a, b in spans],
        "step_cpu_s": [b[1] - a[1] for a, b in spans],
        "hook_s": [b - a for a, b in zip(before.times, after.times, strict=True)][skip:],
        "fit_s": fit_s,
        "other_threads_cpu_s": other_cpu,
    }


class WriteTimer:
    """Wraps the store's batch write (on the writer thread): when each write ran, its
    points, and the writer thread's CPU time in it."""

    def __init__(self, write: Any) -> None:
        self.write = write
        self.writes: list[tuple[float, float, int, float]] = []

    def __call__(self, items: list[Any]) -> None:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        self.write(items)
        if items:
            points = sum(len(item[2]) for item in items)
            self.writes.append((t0, time.perf_counter(), points, time.thread_time() - cpu0))


def writer_share(result: dict[str, Any]) -> dict[str, float] | None:
    """Within one sql fit: the steps that overlap a batch write against those that don't.
    The mean of all steps less the mean of the clear ones is what the writer thread costs
    the training thread per step, measured in the same seconds (so drift cancels)."""
    writes = result.get("writes")
    if not writes:
        return None
    overlap, clear = [], []
    for (start, end), step in zip(result["spans"], result["step_s"], strict=True):
        hit = any(w0 < end and start < w1 for w0, w1, _p, _c in writes)
        (overlap if hit else clear).append(step)
    if not overlap or not clear:
        return None
    mean_all = statistics.mean(result["step_s"])
    return {
        "steps_overlapping_pct": 100 * len(overlap) / len(result["step_s"]),
        "overlap_step_s_median": statistics.median(overlap),
        "clear_step_s_median": statistics.median(clear),
        "writer_s_per_step": mean_all - statistics.mean(clear),
        "writer_cpu_s_per_point": sum(w[3] for w in writes) / sum(w[2] for w in writes),
        "writes": len(writes),
    }


def run_arm(arm: str, steps: int, folder: Path, i: int) -> dict[str, Any]:
    if arm != "sql":
        return one_fit(steps, [NoOp()] if arm == "noop" else [])
    url = f"sqlite:///{folder / f'overhead{i}.db'}"
    store = Store(url)  # opened (created, migrated) before the clock starts
    timer = None
    if hasattr(store, "_write_metrics"):  # private: the decomposition is skipped without it
        timer = WriteTimer(store._write_metrics)
        store._write_metrics = timer  # type: ignore[method-assign]  # before the writer starts
    try:
        result = one_fit(steps, [SqlLogger(store)])
        result["writes"] = timer.writes if timer is not None else None
        t0 = time.perf_counter()
        store.flush()  # already durable: SqlLogger flushes in on_train_end
        result["flush_after_fit_s"] = time.perf_counter() - t0
        with store.engine.connect() as conn:
            count = conn.exec_driver_sql("SELECT count(*) FROM metrics").scalar_one()
    finally:
        store.close()
    assert count == steps * METRICS_PER_STEP, f"{count} metric rows, expected {steps * 10}"
    return result


def us(seconds: float) -> float:
    return round(seconds * 1e6, 2)


def paired(results: dict[str, list[dict[str, Any]]], arm: str, field: str, stat: Any) -> float:
    """The median over rounds of (arm's `stat` of `field`) - (bare's), both of one round."""
    return statistics.median(
        stat(a[field]) - stat(b[field]) for a, b in zip(results[arm], results["bare"], strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="500 steps, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 500, 2
    torch.set_num_threads(1)
    one_fit(200, [])  # warm torch up before any arm is timed
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="lab-bench-overhead-") as tmp:
        for i in range(args.rounds):
            order = ARMS[i % len(ARMS) :] + ARMS[: i % len(ARMS)]
            for arm in order:
                results[arm].append(run_arm(arm, args.steps, Path(tmp), i))
            medians = {a: statistics.median(results[a][-1]["step_s"]) * 1e6 for a in ARMS}
            print(
                f"round {i + 1}/{args.rounds} ({', '.join(order)}): median step "
                + ", ".join(f"{a} {m:.1f} us" for a, m in medians.items()),
                file=sys.stderr,
                flush=True,
            )

    def median_of(arm: str, field: str) -> float:
        return statistics.median(statistics.median(r[field]) for r in results[arm])

    bare_us = median_of("bare", "step_s") * 1e6
    bare_fit = statistics.median(r["fit_s"] for r in results["bare"])

    def versus_bare(arm: str) -> dict[str, Any]:
        wall = paired(results, arm, "step_s", statistics.median) * 1e6
        return {
            "step_us_median": round(median_of(arm, "step_s") * 1e6, 2),
            # median over rounds of the round's median step less bare's in the same round
            "added_us_median": round(wall, 2),
            "added_pct_of_bare": round(100 * wall / bare_us, 2),
            "added_us_per_round": [
                round((statistics.median(a["step_s"]) - statistics.median(b["step_s"])) * 1e6, 1)
                for a, b in zip(results[arm], results["bare"], strict=True)
            ],
            # the mean step counts the rare slow ones too (the writer thread's bursts)
            "added_us_mean": round(paired(results, arm, "step_s", statistics.mean) * 1e6, 2),
            # the training thread's own CPU time per step: blind to other processes
            "added_cpu_us_median": round(
                paired(results, arm, "step_cpu_s", statistics.median) * 1e6, 2
            ),
            "added_cpu_us_mean": round(
                paired(results, arm, "step_cpu_s", statistics.mean) * 1e6, 2
            ),
            "fit_s_median": round(statistics.median(r["fit_s"] for r in results[arm]), 4),
            "added_fit_s_median": round(paired(results, arm, "fit_s", float), 4),
            "other_threads_cpu_s_median": round(
                statistics.median(r["other_threads_cpu_s"] for r in results[arm]), 4
            ),
        }

    sql = versus_bare("sql")
    hook_us = (median_of("sql", "hook_s") - median_of("bare", "hook_s")) * 1e6
    all_hooks = [x for r in results["sql"] for x in r["hook_s"]]
    sql.update(
        {
            "added_us_per_metric": round(sql["added_us_median"] / METRICS_PER_STEP, 3),
            "added_us_mean_per_metric": round(sql["added_us_mean"] / METRICS_PER_STEP, 3),
            # SqlLogger.on_step_end alone, on the training thread, less the empty bracket
            "hook_us_median": round(hook_us, 2),
            "hook_us_p99": round(statistics.quantiles(all_hooks, n=100)[98] * 1e6, 2),
            # the whole fit until every metric is durable (SqlLogger flushes in
            # on_train_end), less bare's in the same round
            "added_fit_pct": round(100 * sql["added_fit_s_median"] / bare_fit, 2),
            "flush_after_fit_us_median": round(
                statistics.median(r["flush_after_fit_s"] for r in results["sql"]) * 1e6, 1
            ),
        }
    )
    shares = [x for x in (writer_share(r) for r in results["sql"]) if x is not None]
    if shares:

        def mid(field: str, scale: float = 1e6) -> float:
            return round(statistics.median(x[field] for x in shares) * scale, 2)

        sql["writer_thread"] = {
            # per sql fit, steps overlapping one of the store's batch writes vs the rest
            "steps_overlapping_pct": mid("steps_overlapping_pct", 1),
            "overlap_step_us_median": mid("overlap_step_s_median"),
            "clear_step_us_median": mid("clear_step_s_median"),
            "added_us_per_step": mid("writer_s_per_step"),
            "writer_cpu_us_per_point": mid("writer_cpu_s_per_point"),
            "writes_per_fit": mid("writes", 1),
        }
    out = {
        "bench": "overhead",
        "steps": args.steps,
        "rounds": args.rounds,
        "metrics_per_step": METRICS_PER_STEP,
        "bare_step_us_median": round(bare_us, 2),
        "bare_step_cpu_us_median": round(median_of("bare", "step_cpu_s") * 1e6, 2),
        "bare_fit_s_median": round(bare_fit, 4),
        "aa": versus_bare("aa"),
        "noop": versus_bare("noop"),
        "sql": sql,
        "targets": {
            "added_pct_of_bare_max": 5.0,
            "added_us_per_metric_max": 10.0,
            "met_pct": sql["added_pct_of_bare"] <= 5.0,
            "met_per_metric": sql["added_us_per_metric"] <= 10.0,
        },
        "machine": machine(torch_threads=torch.get_num_threads()),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
