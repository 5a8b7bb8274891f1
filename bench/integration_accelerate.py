"""What recording an accelerate loop costs, with `lab`'s `LabTracker` and with accelerate's own
MLflow, W&B and TensorBoard trackers, against the same loop tracking nowhere.

The loop: an MLP 32->128->128->1 trained with AdamW on batches of 64 generated examples,
`--steps` steps on the CPU, 1 torch thread, ``Accelerator(cpu=True, log_with=...)``, and every
step ``accelerator.log({"loss", "grad_norm", "lr"}, step=step)``. Every arm trains the same
seeded model on the same batches:

    none         ``log_with=None``: no tracker, the baseline (``accelerator.log`` still called)
    lab          ``LabTracker(experiment=..., store="sqlite:///...")``: a run of its own in a
                 fresh SQLite store; ``end_training()`` commits its rows
    mlflow       ``log_with="mlflow"``: `MLflowTracker` into a ``file:`` tracking URI in a fresh
                 folder (``MLFLOW_ALLOW_FILE_STORE=true``)
    wandb        ``log_with="wandb"``: `WandBTracker` with ``WANDB_MODE=offline`` (its service
                 process writes the ``.wandb`` file)
    tensorboard  ``log_with="tensorboard"``: `TensorBoardTracker` (torch's `SummaryWriter`),
                 when the ``tensorboard`` package is installed

Each fit is timed in three parts: setup (from before the `Accelerator` is built to after
``init_trackers`` returned: the tracker's start and its config), steps (the loop, each step's
``accelerator.log`` in it) and end (``accelerator.end_training()``: each tracker's flush and
close). Each arm's first fit in the process (5 steps: its imports, W&B's service starting) is
timed apart, before the rounds, after one fit with no tracker. Each round runs every arm once,
starting at another arm each round (`_common.alternate`), so drift hits all alike.
"added_in_round" is the median over rounds of an arm's seconds less `none`'s in the same round.
After the rounds, what each tracker wrote in the last round is read back (lab's store with
SQLite, the others with `lab.importers`' readers, each through the format's own library):
every metric at every step.

Prints one JSON line.

    python bench/integration_accelerate.py [--steps 300] [--rounds 11] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import accelerate
import torch
from _common import alternate, log, machine

KEYS = ("grad_norm", "loss", "lr")
ARMS = ("none", "lab", "mlflow", "wandb") + (
    ("tensorboard",) if importlib.util.find_spec("tensorboard") else ()
)


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, 64, 32, generator=g)
    return [(x[i], x[i, :, :4].sum(1, keepdim=True)) for i in range(steps)]


def tracker_of(arm: str, folder: Path) -> tuple[Any, dict[str, Any], dict[str, str]]:
    """`log_with`, `init_trackers`' `init_kwargs` and the environment of `arm` in `folder`."""
    if arm == "lab":
        from lab.integrations.accelerate import LabTracker

        tracker = LabTracker(experiment="bench", store=f"sqlite:///{folder / 'lab.db'}",
                             output_dir=folder / "runs", quiet=True)  # fmt: skip
        return tracker, {}, {}
    if arm == "mlflow":
        uri = f"file:{folder / 'mlruns'}"
        return "mlflow", {}, {"MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": "true"}
    if arm == "wandb":
        env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(folder)}
        return "wandb", {"wandb": {"dir": str(folder)}}, env
    if arm == "tensorboard":
        return "tensorboard", {}, {}
    return None, {}, {}


def fit(arm: str, steps: int, data: list[Any], tmp: Path, i: int) -> dict[str, float]:
    """One fit of `arm` in a fresh folder, timed in its three parts."""
    folder = tmp / f"{arm}-{i}"
    folder.mkdir()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 1),
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    log_with, init_kwargs, env = tracker_of(arm, folder)
    os.environ.update(env)
    try:
        t0 = time.perf_counter()
        accelerator = accelerate.Accelerator(cpu=True, log_with=log_with, project_dir=folder)
        model, opt = accelerator.prepare(model, opt)
        accelerator.init_trackers("bench", config={"lr": 1e-3, "steps": steps, "batch": 64},
                                  init_kwargs=init_kwargs)  # fmt: skip
        t1 = time.perf_counter()
        for step in range(1, steps + 1):
            x, y = data[step - 1]
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            accelerator.log({"loss": loss.item(), "grad_norm": float(norm),
                             "lr": opt.param_groups[0]["lr"]}, step=step)  # fmt: skip
        t2 = time.perf_counter()
        accelerator.end_training()
        t3 = time.perf_counter()
    finally:
        for key in env:
            os.environ.pop(key)
    return {"s": t3 - t0, "setup_s": t1 - t0, "steps_s": t2 - t1, "end_s": t3 - t2}


def recorded(tmp: Path, rounds: int) -> dict[str, dict[str, int]]:
    """The steps at which each tracker holds each metric, in the last round's fits."""
    from lab.importers.mlflow import read_mlflow
    from lab.importers.tensorboard import read_tensorboard
    from lab.importers.wandb import read_wandb

    last = rounds - 1
    out: dict[str, dict[str, int]] = {}
    with sqlite3.connect(tmp / f"lab-{last}" / "lab.db") as con:
        rows = con.execute("SELECT key, count(DISTINCT step) FROM metrics GROUP BY key")
        out["lab"] = {k: n for k, n in rows if k in KEYS}
    readers: dict[str, Callable[[Path], Any]] = {
        "mlflow": lambda d: read_mlflow(f"file:{d / 'mlruns'}", "bench"),
        "wandb": lambda d: read_wandb([d / "wandb"]),
        "tensorboard": lambda d: read_tensorboard(d / "bench"),
    }
    for arm, read in readers.items():
        if arm in ARMS:
            (run,) = read(tmp / f"{arm}-{last}").runs
            out[arm] = {k: len({p[0] for p in run.metrics[k]}) for k in KEYS}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--quick", action="store_true", help="60 steps, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 60, 2
    torch.set_num_threads(1)
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    data = batches(args.steps)
    with tempfile.TemporaryDirectory(prefix="lab-bench-acc-") as name:
        tmp = Path(name)
        (tmp / "warm").mkdir()
        # each arm's first fit in the process (its imports, W&B's service starting): apart,
        # before any is timed
        fit("none", 5, data, tmp / "warm", 0)
        first = {arm: fit(arm, 5, data, tmp / "warm", 1) for arm in ARMS}
        for arm, times in first.items():
            log(f"first fit {arm}: {times['s']:.2f} s (setup {times['setup_s']:.2f} s)")
        arms: dict[str, Callable[[int], dict[str, float]]] = {
            arm: (lambda i, arm=arm: fit(arm, args.steps, data, tmp, i)) for arm in ARMS
        }
        results = alternate(args.rounds, arms)
        counts = recorded(tmp, args.rounds)
    missing = {arm: c for arm, c in counts.items() if set(c.values()) != {args.steps}}
    if missing:
        raise SystemExit(f"a tracker lost steps (want {args.steps} of each): {missing}")
    base = results["none"]
    summary = {}
    for arm, rounds in results.items():
        row: dict[str, Any] = {"s": [round(r["s"], 3) for r in rounds]}
        for part in ("s", "setup_s", "steps_s", "end_s"):
            row[f"{part}_median"] = round(statistics.median(r[part] for r in rounds), 4)
            row[f"added_in_round_{part}_median"] = round(
                statistics.median(r[part] - b[part] for r, b in zip(rounds, base, strict=True)), 4
            )
        row["added_in_round_ms_per_step_median"] = round(
            1000 * row["added_in_round_steps_s_median"] / args.steps, 3
        )
        row["added_in_round_pct_median"] = round(statistics.median(
            100 * (r["s"] - b["s"]) / b["s"] for r, b in zip(rounds, base, strict=True)
        ), 1)  # fmt: skip
        summary[arm] = row
    import importlib.metadata as md

    versions = {p: md.version(p) for p in ("accelerate", "mlflow-skinny", "wandb", "tensorboard")
                if importlib.util.find_spec(p.split("-")[0])}  # fmt: skip
    print(json.dumps({
        "bench": "integration_accelerate", "steps": args.steps, "rounds": args.rounds,
        "arms": summary,
        "first_fit_of_5_steps": {a: {k: round(v, 3) for k, v in t.items()}
                                 for a, t in first.items()},
        "recorded_steps": counts, "machine": machine(**versions),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
