"""How long one checkpoint save blocks the training thread: synchronous vs `async_save`.

Saves the state of a `torch.nn.Linear(5000, 5000)` (100 MB fp32 weights) plus its SGD
momentum (another 100 MB) through `CheckpointManager`, the way the loop does. The blocked
time is what the caller waits for: all of `save` (write, fsync, rename, manifest) when
synchronous; the copy to CPU memory and the thread start with `save_async`. The background
write is waited for outside the timed part before the next save, so every timed save starts
with none in flight. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lab.loop.checkpoints import CheckpointConfig, CheckpointManager


def _machine(device: torch.device) -> str:
    """Where it ran: numbers from another machine are not comparable."""
    where = (
        f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    )
    if device.type == "cuda":
        where += f", {torch.cuda.get_device_name(device)}"
    return where


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def main() -> None:
    """Time `rounds` sync saves and `rounds` async saves of the same state, in one run."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=5000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    model = torch.nn.Linear(args.size, args.size).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.randn(8, args.size, device=device)).sum().backward()
    opt.step()  # the momentum buffers exist, as in a real run
    state_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e6
    times: dict[str, list[float]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as folder:
        for mode in ("sync", "async") * args.rounds:
            manager = CheckpointManager(Path(folder) / mode, CheckpointConfig(keep_last=1))
            step = len(times[mode]) + 1
            started = time.perf_counter()
            if mode == "sync":
                manager.save(step, _state(model, opt), {})
            else:
                manager.save_async(step, _state(model, opt), {})
            times[mode].append(time.perf_counter() - started)
            manager.wait()
    sync, asyn = (statistics.median(times[m]) for m in ("sync", "async"))
    print(
        json.dumps(
            {
                "bench": "checkpoint_save",
                "machine": _machine(device),
                "device": str(device),
                "model_mb": round(state_mb, 1),
                "state_mb": round(2 * state_mb, 1),
                "rounds": args.rounds,
                "sync_blocked_s": round(sync, 4),
                "async_blocked_s": round(asyn, 4),
                "speedup": round(sync / asyn, 1),
                "sync_all_s": [round(t, 4) for t in times["sync"]],
                "async_all_s": [round(t, 4) for t in times["async"]],
            }
        )
    )


if __name__ == "__main__":
    main()
