"""What one pruning decision costs: the store's two reads and the rebuilt Optuna pruner.

Records an experiment of `--runs` runs of `--points` steps each (a `RunHandle` logging one
``loss`` a step) into a SQLite store (or `--store`), then times, `--repeat` times, what
`lab.sweeps.pruning.PruneCallback` does at each step that logs its metric: read the current
runs (`current_runs`) and the metric's points (`metric_points`), and decide
(`should_prune`), for each rule. A run that does not log the metric at a step pays nothing.

Prints one JSON line: per rule, the median and 90th percentile of one decision in ms, and of
the reads alone.

    python bench/prune.py                       # 16 runs x 100 points, SQLite
    python bench/prune.py --runs 64 --points 1000
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pydantic
import torch

from lab import Arm, Experiment, RunHandle
from lab.store import open_store
from lab.sweeps import Prune
from lab.sweeps.pruning import RunPoints, should_prune


class Cfg(pydantic.BaseModel):
    level: float = 1.0
    points: int = 100


def train(run: Any) -> Any:
    model = torch.nn.Linear(1, 1)
    with RunHandle(run, model, None, num_steps=run.config.points) as loop:
        for step in loop.steps():
            loop.end_step({"loss": run.config.level / step})
    return loop.artifacts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=16)
    parser.add_argument("--points", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--store", default=None, help="a store URL (default: a SQLite file)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.store or f"sqlite:///{Path(tmp) / 'lab.db'}"
        arms = [Arm(f"a{i:03d}", level=1.0 + i / args.runs) for i in range(args.runs)]
        Experiment("prune-bench", train, arms=arms, base_config=Cfg(points=args.points),
                   store=url, output_dir=Path(tmp) / "runs", fresh=True).run()  # fmt: skip
        store = open_store(url)
        rules = {
            "median": Prune("loss", rule="median", n_startup_trials=1),
            "halving": Prune("loss", rule="halving", reduction_factor=3),
            "hyperband": Prune("loss", rule="hyperband", max_resource=args.points),
        }
        out: dict[str, Any] = {"runs": args.runs, "points": args.points, "store": url.split(":")[0]}
        try:
            current = "a000-r0"
            for name, rule in rules.items():
                reads, decisions = [], []
                for _ in range(args.repeat):
                    started = time.perf_counter()
                    points = store.metric_points("prune-bench", "loss")
                    rows = store.current_runs("prune-bench")
                    read = time.perf_counter()
                    runs = [
                        RunPoints(r["run_key"], "running" if r["run_key"] == current
                                  else r["status"], points.get(r["run_key"], []))
                        for r in rows
                    ]  # fmt: skip
                    should_prune(rule, "prune-bench", runs, current)
                    ended = time.perf_counter()
                    reads.append((read - started) * 1e3)
                    decisions.append((ended - started) * 1e3)
                out[name] = {
                    "decision_ms_p50": round(statistics.median(decisions), 2),
                    "decision_ms_p90": round(statistics.quantiles(decisions, n=10)[-1], 2),
                    "reads_ms_p50": round(statistics.median(reads), 2),
                }
        finally:
            store.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
