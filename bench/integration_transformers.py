"""What recording a Hugging Face `Trainer` fit costs, with `lab`'s `LabCallback` and with the
Trainer's own MLflow and W&B reporting, against the same fit reporting nowhere.

The fit: a 2-layer BERT (hidden size 32) built from its config, `--steps` optimizer steps of
8 generated sequences of 16 tokens on the CPU, 1 torch thread, logged every step (`loss`,
`grad_norm`, `learning_rate`, `epoch`: the most a Trainer logs), no evaluation and no
checkpoint. Every arm trains the same seeded model on the same data:

    none     ``report_to=[]``: no logger at all, the baseline
    lab      `LabCallback` (a run of its own in a fresh SQLite store), through
             `lab.integrations.transformers.train`, which ends the run with its rows committed
    mlflow   ``report_to="mlflow"``: `MLflowCallback` into a ``file:`` tracking URI in a
             fresh folder; `mlflow.end_run()` inside the timed span
    wandb    ``report_to="wandb"`` with ``WANDB_MODE=offline`` into the temporary folder (its
             service process writes the ``.wandb`` file); `wandb.finish()` inside the span

Each arm's first fit in the process (5 steps: its imports, W&B's service starting) is timed
apart, before the rounds, after one fit with no logger (the Trainer's own imports). The
timed span: from before the `Trainer` is built to after the run is closed (each logger's
setup, its per-step logging and its flush at the end). Wall seconds, and the CPU seconds of
this process (a logger's own processes, as W&B's service, are not counted there: the wall
clock shows what they cost the fit). Each round runs every arm once, starting at another arm
each round (`_common.alternate`), so drift hits all alike. "added" is an arm's median less
`none`'s; "added_in_round" the median over rounds of an arm's seconds less `none`'s in the
same round (steadier while the load drifts).

Prints one JSON line.

    python bench/integration_transformers.py [--steps 150] [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import torch
import transformers
from _common import alternate, machine

ARMS = ("none", "lab", "mlflow", "wandb")


def examples(n: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (n, 16), generator=g)
    return [
        {"input_ids": ids[i], "attention_mask": torch.ones(16, dtype=torch.long),
         "labels": int(ids[i, 0] % 2)}
        for i in range(n)
    ]  # fmt: skip


def trainer(folder: Path, steps: int, report_to: Any, callbacks: list[Any]) -> Any:
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
        vocab_size=100, num_labels=2,
    )  # fmt: skip
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(folder / "out"), use_cpu=True, report_to=report_to, max_steps=steps,
        per_device_train_batch_size=8, logging_steps=1, save_strategy="no", seed=7,
        disable_tqdm=True, log_level="error", run_name="bench",
    )  # fmt: skip
    return transformers.Trainer(
        model=transformers.BertForSequenceClassification(config), args=args,
        train_dataset=examples(8 * steps), callbacks=callbacks,
    )  # fmt: skip


def fit(arm: str, steps: int, tmp: Path, i: int) -> dict[str, float]:
    """One timed fit of `arm` in a fresh folder."""
    folder = tmp / f"{arm}-{i}"
    folder.mkdir()
    env = {}
    if arm == "mlflow":
        env = {"MLFLOW_TRACKING_URI": f"file:{folder / 'mlruns'}",
               "MLFLOW_EXPERIMENT_NAME": "bench", "MLFLOW_ALLOW_FILE_STORE": "true"}  # fmt: skip
    if arm == "wandb":
        env = {"WANDB_MODE": "offline", "WANDB_DIR": str(folder), "WANDB_PROJECT": "bench",
               "WANDB_SILENT": "true"}  # fmt: skip
    os.environ.update(env)
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        if arm == "lab":
            from lab.integrations.transformers import LabCallback, train

            callback = LabCallback(experiment="bench", store=f"sqlite:///{folder / 'lab.db'}",
                                   output_dir=folder / "runs", quiet=True)  # fmt: skip
            train(trainer(folder, steps, [], [callback]), resume=False)
        else:
            trainer(folder, steps, [] if arm == "none" else [arm], []).train()
            close(arm)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        for key in env:
            os.environ.pop(key)
    return {"s": wall, "cpu_s": cpu}


def close(arm: str) -> None:
    """End the logger's run, as a script's end would (its last rows written)."""
    if arm == "mlflow":
        import mlflow

        if mlflow.active_run() is not None:
            mlflow.end_run()
    if arm == "wandb":
        import wandb

        if wandb.run is not None:
            wandb.finish()


def check(tmp: Path) -> dict[str, int]:
    """What each logger wrote: lab's and MLflow's loss values in the last round (one a step),
    W&B's runs (the warm-up's and one a round) and the size of its last ``.wandb`` file."""
    import sqlite3

    counts = {}
    (db,) = sorted(tmp.glob("lab-*/lab.db"))[-1:]
    with sqlite3.connect(db) as con:
        counts["lab"] = con.execute("SELECT count(*) FROM metrics WHERE key='loss'").fetchone()[0]
    (loss,) = sorted(tmp.glob("mlflow-*/mlruns/*/*/metrics/loss"))[-1:]
    counts["mlflow"] = len(loss.read_text().splitlines())
    # W&B keeps the folder of its first run in the process (the warm-up's) for the later ones
    runs = sorted(tmp.glob("**/offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)
    counts["wandb_runs"] = len(runs)
    counts["wandb_last_run_bytes"] = runs[-1].stat().st_size
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="40 steps, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 40, 2
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    # the Trainer prints its logs to stdout: they go to stderr, stdout carries the JSON line
    with tempfile.TemporaryDirectory(prefix="lab-bench-hf-") as name, redirect_stdout(sys.stderr):
        tmp = Path(name)
        (tmp / "warm").mkdir()
        # each arm's first fit in the process (its imports, W&B's service starting): apart,
        # before any is timed
        fit("none", 5, tmp / "warm", 0)  # the Trainer's own imports, first
        first = {arm: round(fit(arm, 5, tmp / "warm", 1)["s"], 3) for arm in ARMS}
        arms: dict[str, Callable[[int], dict[str, float]]] = {
            arm: (lambda i, arm=arm: fit(arm, args.steps, tmp, i)) for arm in ARMS
        }
        results = alternate(args.rounds, arms)
        recorded = check(tmp)
    base = statistics.median(r["s"] for r in results["none"])
    base_cpu = statistics.median(r["cpu_s"] for r in results["none"])
    summary = {}
    for arm, rounds in results.items():
        wall = statistics.median(r["s"] for r in rounds)
        cpu = statistics.median(r["cpu_s"] for r in rounds)
        paired = statistics.median(
            r["s"] - b["s"] for r, b in zip(rounds, results["none"], strict=True)
        )
        paired_pct = statistics.median(
            100 * (r["s"] - b["s"]) / b["s"] for r, b in zip(rounds, results["none"], strict=True)
        )
        summary[arm] = {
            "s": [round(r["s"], 3) for r in rounds],
            "s_median": round(wall, 3),
            "cpu_s_median": round(cpu, 3),
            "added_s": round(wall - base, 3),
            "added_pct": round(100 * (wall - base) / base, 1),
            "added_cpu_s": round(cpu - base_cpu, 3),
            "added_ms_per_step": round(1000 * (wall - base) / args.steps, 2),
            # the same taken within each round (arm less `none` of that round), then the median
            "added_in_round_s_median": round(paired, 3),
            "added_in_round_pct_median": round(paired_pct, 1),
        }
    out = {
        "bench": "integration_transformers",
        "steps": args.steps,
        "rounds": args.rounds,
        "arms": summary,
        "first_fit_of_5_steps_s": first,
        "recorded": recorded,
        "machine": machine(
            torch_threads=torch.get_num_threads(), transformers=transformers.__version__
        ),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
