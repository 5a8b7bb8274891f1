"""Per-step time of `TrainingLoop` with `log_every=1` against `log_every=50`, and against a
plain torch loop with no lab (`bare`).

Why: `log_every=N` keeps each step's loss and gradient norm on the device and reads the
held steps in one transfer every N steps, instead of two host syncs a step. On a GPU that
sync drains the launch queue; on a CPU there is nothing to wait for, so what this measures
there is what holding the metrics costs (or saves) the training thread.

The step is bench/overhead.py's: an MLP 32->64->1, batch 32, SGD, 1 torch thread, and a
loss function that returns 4 extra metrics. Each arm is one `fit()` of `--steps` steps, no
callbacks, or with `SqlLogger` on a fresh SQLite store (``_sql``); the arms alternate over
`--rounds` rounds (the order rotated each round), and the figures are the medians over the
rounds of each fit's wall time per step and of the training thread's CPU time per step
(the steadier one on a loaded machine: other processes' time is not in it). `--device cuda`
runs the same on a GPU, where the wall time is the figure.

Prints one JSON line.

    python bench/log_every.py [--steps 2000] [--rounds 5] [--device cpu] [--hidden 64]
                             [--batch 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import alternate, machine

from lab import SqlLogger, TrainingLoop
from lab.store import Store

EVERY = (1, 50)


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    return loss, {f"extra_{i}": float(i) for i in range(4)}


def bare_fit(model: Any, opt: Any, data: list[Any], steps: int) -> None:
    """The same steps in a plain torch loop that reads nothing on the host: no lab."""
    for step in range(steps):
        loss, _ = loss_fn(model, data[step % len(data)])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def one_fit(
    every: int, steps: int, device: str, store_url: str | None, hidden: int = 64, batch: int = 32
) -> dict[str, float]:
    """One fit's seconds per step (model and data made before the clock starts); `every`
    0 is the plain torch loop (`bare_fit`)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
    )
    model.to(device)
    data = [(torch.randn(batch, 32, device=device), torch.randn(batch, 1, device=device))
            for _ in range(16)]  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    store = Store(store_url) if store_url is not None else None
    callbacks = [SqlLogger(store)] if store is not None else []
    try:
        started, cpu = time.perf_counter(), time.thread_time()
        if every == 0:
            bare_fit(model, opt, data, steps)
        else:
            loop = TrainingLoop(model, opt, data, loss_fn, steps, log_every=every,
                                callbacks=callbacks)  # fmt: skip
            loop.fit()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds, cpu = time.perf_counter() - started, time.thread_time() - cpu
    finally:
        if store is not None:
            store.close()
    return {"s": seconds, "step_us": seconds / steps * 1e6, "cpu_us": cpu / steps * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=64, help="the MLP's hidden width")
    parser.add_argument("--batch", type=int, default=32, help="rows per batch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)

        def arm(every: int, sql: bool) -> Any:
            def run(i: int) -> dict[str, float]:
                url = f"sqlite:///{folder / f'{every}-{i}.db'}" if sql else None
                return one_fit(every, args.steps, args.device, url, args.hidden, args.batch)

            return run

        arms = {
            f"every_{n}{'_sql' if sql else ''}": arm(n, sql) for sql in (False, True) for n in EVERY
        }
        arms["bare"] = arm(0, False)
        one_fit(1, 100, args.device, None, args.hidden, args.batch)  # warm-up: allocator
        results = alternate(args.rounds, arms)
    step_us = {
        name: statistics.median(r["step_us"] for r in runs) for name, runs in results.items()
    }
    cpu_us = {name: statistics.median(r["cpu_us"] for r in runs) for name, runs in results.items()}
    print(
        json.dumps(
            {
                "bench": "log_every",
                "steps": args.steps,
                "rounds": args.rounds,
                "device": args.device,
                "hidden": args.hidden,
                "batch": args.batch,
                "step_us_median": {name: round(us, 1) for name, us in step_us.items()},
                "every_50_over_every_1": round(step_us["every_50"] / step_us["every_1"], 3),
                "every_50_over_every_1_sql": round(
                    step_us["every_50_sql"] / step_us["every_1_sql"], 3
                ),
                # the whole fit with lab (log_every=50, SqlLogger) against no lab at all
                "every_50_sql_over_bare": round(step_us["every_50_sql"] / step_us["bare"], 4),
                "cpu_us_median": {name: round(us, 1) for name, us in cpu_us.items()},
                "cpu_every_50_over_every_1": round(cpu_us["every_50"] / cpu_us["every_1"], 3),
                "machine": machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
