"""Per-step cost of the SQL logger on the training thread, against the same loop without it.

The loop: an MLP 32->64->1, batch 32, SGD, 2,000 steps, 10 metrics per step (the loop's 4
plus 6 from loss_fn). Both arms carry the same timing callback (it runs last, so the gap
between two of its calls is one whole step, hooks included); the treatment adds SqlLogger
into a SQLite file, and a second bare arm gives the A/A noise floor of the machine at that
moment. The arms rotate order over six rounds, and the median step of all rounds is
compared. Two stamp callbacks bracket SqlLogger's on_step_end to time the work it does on
the training thread itself. Prints one JSON line.

    python bench/overhead.py [--steps 2000] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lab import Callback, SqlLogger, TrainingLoop


class Stamp(Callback):
    """Records when its on_step_end runs; two of them bracket SqlLogger's (priority 100)."""

    def __init__(self, priority: int) -> None:
        self.priority = priority  # type: ignore[misc]
        self.times: list[float] = []

    def on_step_end(self, state, step_idx, batch, metrics) -> None:  # type: ignore[no-untyped-def]
        self.times.append(time.perf_counter())


class StepTimer(Callback):
    priority = -1000  # last: the gap between calls spans every other hook of the step

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_end(self, state, step_idx, batch, metrics) -> None:  # type: ignore[no-untyped-def]
        self.times.append(time.perf_counter())


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):  # type: ignore[no-untyped-def]
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    return loss, {f"extra_{i}": float(i) for i in range(6)}


def one_fit(
    steps: int, callbacks: list[Callback], hook_us: list[float] | None = None
) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    data = [(torch.randn(32, 32), torch.randn(32, 1)) for _ in range(16)]
    timer, before, after = StepTimer(), Stamp(101), Stamp(99)
    TrainingLoop(
        model, torch.optim.SGD(model.parameters(), lr=0.01), data, loss_fn, steps,
        callbacks=[*callbacks, timer, before, after],
    ).fit()  # fmt: skip
    if hook_us is not None:
        hook_us += [(b - a) * 1e6 for a, b in zip(before.times, after.times, strict=True)]
    gaps = [b - a for a, b in zip(timer.times, timer.times[1:], strict=False)]
    return gaps[len(gaps) // 10 :]  # drop warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    bare: list[float] = []
    again: list[float] = []  # a second bare arm: the A/A noise floor of this machine, now
    logged: list[float] = []
    hook_us: list[float] = []
    empty_us: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            url = f"sqlite:///{Path(tmp) / f'bench{i}.db'}"
            arms = [
                lambda: bare.extend(one_fit(args.steps, [], empty_us)),
                lambda url=url: logged.extend(one_fit(args.steps, [SqlLogger(url)], hook_us)),
                lambda: again.extend(one_fit(args.steps, [])),
            ]
            for k in range(3):  # rotate the order, so drift hits every arm alike
                arms[(i + k) % 3]()
    bare_ms = statistics.median(bare) * 1e3
    again_ms = statistics.median(again) * 1e3
    logged_ms = statistics.median(logged) * 1e3
    print(json.dumps({
        "bench": "overhead",
        "steps": args.steps,
        "rounds": args.rounds,
        "metrics_per_step": 10,
        "bare_step_ms_median": round(bare_ms, 4),
        "sql_step_ms_median": round(logged_ms, 4),
        "added_ms_median": round(logged_ms - bare_ms, 4),
        "added_fraction": round((logged_ms - bare_ms) / bare_ms, 4),
        "aa_noise_fraction": round((again_ms - bare_ms) / bare_ms, 4),
        # SqlLogger.on_step_end itself, on the training thread, less the empty bracket
        "sql_hook_us_median": round(statistics.median(hook_us) - statistics.median(empty_us), 2),
        "sql_hook_us_p99": round(statistics.quantiles(hook_us, n=100)[98], 2),
        "machine": f"{platform.machine()} {torch.get_num_threads()} torch thread(s)",
    }))  # fmt: skip


if __name__ == "__main__":
    main()
