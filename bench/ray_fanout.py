"""Ray fan-out against the process pool: the wall time of 32 tiny runs on one machine.

The same experiment (32 runs: 4 arms x 8 repeats, a 4 -> 16 -> 1 MLP, 20 steps each, one
SQLite store) runs with ``executor="processes"`` (a fresh ``spawn`` process per run, as many
at once as there are cores) and with ``executor="ray"`` on a local cluster started with
``ray.init(num_cpus=<cores>)``, one CPU per run. Each round runs both, the order
alternating, each into a fresh store and folder. Reported (medians over rounds):

    processes_s   the process pool's wall time for the whole experiment
    ray_s         Ray's, on the cluster warmed by the rounds before (Ray keeps its
                  worker processes, with torch imported, from one run to the next)
    ray_cold_s    Ray's first experiment on the fresh cluster (its workers start and import
                  torch), after `ray.init`
    ray_init_s    how long ``ray.init`` took to start the local cluster

Prints one JSON line.

    python bench/ray_fanout.py [--rounds 3] [--runs 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pydantic
import torch
from _common import log, machine

from lab import Arm, Experiment, TrainingLoop

STEPS = 20
ARMS = 4


class Cfg(pydantic.BaseModel):
    lr: float = 0.05


def mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def train(run: Any) -> Any:
    """A tiny regression: the run's cost is lab's and the executor's, not the model's."""
    x = torch.randn(64, 4)
    y = x.sum(1, keepdim=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    opt = torch.optim.SGD(model.parameters(), lr=run.config.lr)
    return TrainingLoop(model, opt, batches, mse, STEPS).fit(run)


def fan_out(executor: str, runs: int, folder: Path) -> float:
    """Seconds for the whole experiment, `runs` runs, with `executor`."""
    arms = [Arm(f"lr{i}", lr=0.01 * (i + 1)) for i in range(ARMS)]
    exp = Experiment(
        "fanout", train, base_config=Cfg(), arms=arms, repeats=runs // ARMS,
        store=f"sqlite:///{folder / 'lab.db'}", output_dir=folder / "runs", executor=executor,  # type: ignore[arg-type]
    )  # fmt: skip
    started = time.perf_counter()
    result = exp.run()
    seconds = time.perf_counter() - started
    assert [r.status for r in result.runs] == ["completed"] * runs, result.runs
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=32)
    args = parser.parse_args()
    import ray

    cores = os.cpu_count() or 1
    started = time.perf_counter()
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
    ray_init_s = time.perf_counter() - started
    log(f"ray.init: {ray_init_s:.2f} s")
    times: dict[str, list[float]] = {"processes": [], "ray": []}
    with tempfile.TemporaryDirectory() as tmp:
        cold = fan_out("ray", args.runs, Path(tmp) / "cold")
        log(f"ray, cold cluster: {cold:.2f} s")
        for i in range(args.rounds):
            order = ["processes", "ray"] if i % 2 == 0 else ["ray", "processes"]
            for executor in order:
                seconds = fan_out(executor, args.runs, Path(tmp) / f"{executor}-{i}")
                times[executor].append(seconds)
                log(f"round {i + 1}/{args.rounds} {executor}: {seconds:.2f} s")
    ray.shutdown()
    processes_s, ray_s = statistics.median(times["processes"]), statistics.median(times["ray"])
    print(
        json.dumps(
            {
                "bench": "ray_fanout",
                "runs": args.runs,
                "steps_per_run": STEPS,
                "rounds": args.rounds,
                "processes_s": round(processes_s, 2),
                "ray_s": round(ray_s, 2),
                "ray_over_processes": round(ray_s / processes_s, 3),
                "ray_cold_s": round(cold, 2),
                "ray_init_s": round(ray_init_s, 2),
                "processes_all_s": [round(t, 2) for t in times["processes"]],
                "ray_all_s": [round(t, 2) for t in times["ray"]],
                "machine": machine(ray=ray.__version__),
            }
        )
    )


if __name__ == "__main__":
    main()
