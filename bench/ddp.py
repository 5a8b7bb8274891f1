"""What lab adds to a DDP step: 2 gloo processes on CPU, lab's loop against the same DDP loop
with no lab at all.

The step, on each rank: an MLP 32->64->1 wrapped in DistributedDataParallel, a batch of 32
(each rank its own data), SGD; forward, backward (DDP's gradient all-reduce), the optimizer
step, the loss read back (``loss.item()``). Arms, every one on the same two processes, in
one process group:

    bare        a plain `for` loop over that step, no lab: the baseline
    aa          the same again: the A/A noise floor of the machine at that moment
    bare_reduce the bare loop plus one all_reduce of 6 float64 values per step, with no lab:
                the floor of any per-step metric reduction across ranks on this machine
    loop        `TrainingLoop.fit()` on the DDP model, no callbacks: its 4 metrics (loss, lr,
                grad_norm, step_time) reduced across ranks in one collective per step
    loop_sql    the same with `SqlLogger` on a fresh SQLite store (it runs on rank 0 alone)

How a step is timed (on rank 0): each batch drawn stamps `time.perf_counter()`, and a step is
the time from one draw to the next, so it spans all the loop does per step. The first 10% of
each fit's steps are dropped. An arm's figure is the median step of a fit; "added" is that
less `bare`'s in the same round, then the median over the rounds. Rounds start at another arm
each time, so drift hits all alike.

Prints one JSON line.

    python bench/ddp.py [--steps 400] [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ARMS = ("bare", "aa", "bare_reduce", "loop", "loop_sql")


class _Stamped:
    """A list of batches that stamps the time each batch is drawn, on the drawing rank."""

    def __init__(self, batches: list[Any], stamps: list[float]) -> None:
        self.batches, self.stamps = batches, stamps

    def __iter__(self) -> Any:
        for batch in self.batches:
            self.stamps.append(time.perf_counter())
            yield batch

    def __len__(self) -> int:
        return len(self.batches)


def _model() -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    return DDP(net)


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _fit(arm: str, steps: int, batches: list[Any], folder: Path) -> list[float]:
    from lab import TrainingLoop
    from lab.loggers import SqlLogger

    stamps: list[float] = []
    data = _Stamped(batches, stamps)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if arm in ("bare", "aa", "bare_reduce"):
        import torch.distributed as dist

        reduce = arm == "bare_reduce"
        for batch in data:  # `steps` batches
            loss = _loss(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            value = loss.item()
            if reduce:
                dist.all_reduce(
                    torch.tensor([value, 0.01, 1.0, 0.001, 1.0, 1.0], dtype=torch.float64)
                )
        stamps.append(time.perf_counter())
    else:
        callbacks = [SqlLogger(f"sqlite:///{folder / f'{arm}.db'}")] if arm == "loop_sql" else []
        loop = TrainingLoop(model, opt, data, _loss, steps, callbacks=callbacks)
        loop.fit(run_dir=folder / arm)
        stamps.append(time.perf_counter())
    deltas = [b - a for a, b in itertools.pairwise(stamps)]
    return deltas[len(deltas) // 10 :]


def _rank(rank: int, world: int, port: int, steps: int, rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))  # fmt: skip
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(32, 32, generator=gen), torch.randn(32, 1, generator=gen))
               for _ in range(steps)]  # fmt: skip
    medians: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]
            for arm in order:
                folder = Path(tmp) / f"round{r}"
                folder.mkdir(exist_ok=True)
                dist.barrier()
                medians[arm].append(statistics.median(_fit(arm, steps, batches, folder)))
    if rank == 0:
        Path(out).write_text(json.dumps(medians))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 60, 1
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "medians.json")
        mp.spawn(_rank, args=(2, port, args.steps, args.rounds, out), nprocs=2, join=True)
        medians = json.loads(Path(out).read_text())
    us = {arm: statistics.median(values) * 1e6 for arm, values in medians.items()}
    added = {
        arm: statistics.median(m - b for m, b in zip(medians[arm], medians["bare"], strict=True))
        * 1e6
        for arm in ARMS
        if arm != "bare"
    }
    print(
        json.dumps(
            {
                "bench": "ddp",
                "processes": 2,
                "backend": "gloo",
                "steps": args.steps,
                "rounds": args.rounds,
                "step_us": {arm: round(value, 1) for arm, value in us.items()},
                "added_us": {arm: round(value, 1) for arm, value in added.items()},
                "added_pct": {arm: round(100 * added[arm] / us["bare"], 1) for arm in added},
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                f"Python {sys.version.split()[0]}, torch {torch.__version__}",
                "load_average": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )


if __name__ == "__main__":
    main()
