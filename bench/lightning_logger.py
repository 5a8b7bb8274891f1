"""What `LabLogger` costs a Lightning fit, against the same fit with no logger, with
Lightning's own `CSVLogger`, with `MLFlowLogger` and with `WandbLogger` (offline), side by
side in one process.

The fit: an MLP 32->64->1 on 2,048 generated examples, batch 32 (64 steps an epoch), SGD,
one torch thread, CPU; every step logs its loss (``log_every_n_steps=1``), each epoch
validates on 256 examples and `ModelCheckpoint` keeps the best by ``val/loss`` and the last.
Every arm does that same work on the same seeded model and data:

    none        ``Trainer(logger=False)``: the baseline (its checkpoints go to the trainer's
                default folder)
    csv         ``CSVLogger``: Lightning's own files
    lab         ``LabLogger(experiment=..., store="sqlite:///...")``: a fresh SQLite store per
                fit; the run's rows are committed when the fit returns
    mlflow      ``MLFlowLogger`` on a file store (``MLFLOW_ALLOW_FILE_STORE=true``)
    wandb       ``WandbLogger(offline=True)``, its run finished (``wandb.finish()``) inside
                the timed span, so its files are written

A fit is timed from before the `Trainer` is built to after `fit` returned (and, for wandb,
its run finished). One warm-up fit of each arm first (imports, wandb's service process);
then `--rounds` rounds, each arm once per round, in an order that rotates each round. "Added"
is an arm's median seconds less `none`'s, per step; on a loaded machine the fastest of each
arm's fits (`min_s`) is the steadier figure.

Prints one JSON line.

    python bench/lightning_logger.py [--epochs 5] [--rounds 3] [--no-mlflow] [--no-wandb]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import alternate, log, machine

N_TRAIN, N_VAL, BATCH = 2048, 256, 32


def _module() -> Any:
    import lightning.pytorch as pl

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train/loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val/loss", torch.nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return MLP


def _loaders() -> tuple[Any, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN + N_VAL, 32, generator=gen)
    y = x[:, :4].sum(1, keepdim=True)
    train = TensorDataset(x[:N_TRAIN], y[:N_TRAIN])
    val = TensorDataset(x[N_TRAIN:], y[N_TRAIN:])
    return DataLoader(train, batch_size=BATCH), DataLoader(val, batch_size=BATCH)


def _loggers() -> dict[str, Callable[[Path], tuple[Any, Callable[[], None]]]]:
    """Each arm: a function of a fresh folder that gives the trainer's logger and what ends
    it."""
    from lightning.pytorch.loggers import CSVLogger

    from lab.integrations.lightning import LabLogger

    def lab_logger(d: Path) -> tuple[Any, Callable[[], None]]:
        return LabLogger(experiment="bench", store=f"sqlite:///{d / 'lab.db'}",
                         save_dir=d / "runs", quiet=True), lambda: None  # fmt: skip

    arms: dict[str, Callable[[Path], tuple[Any, Callable[[], None]]]] = {
        "none": lambda d: (False, lambda: None),
        "csv": lambda d: (CSVLogger(d), lambda: None),
        "lab": lab_logger,
    }
    if os.environ.get("BENCH_MLFLOW", "1") == "1":
        from lightning.pytorch.loggers import MLFlowLogger

        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        arms["mlflow"] = lambda d: (
            MLFlowLogger("bench", tracking_uri=f"file:{d / 'mlruns'}"),
            lambda: None,
        )
    if os.environ.get("BENCH_WANDB", "1") == "1":
        import wandb
        from lightning.pytorch.loggers import WandbLogger

        os.environ["WANDB_SILENT"] = "true"
        arms["wandb"] = lambda d: (
            WandbLogger(project="bench", save_dir=str(d), offline=True),
            wandb.finish,
        )
    return arms


def _fit(arm: Callable[[Path], tuple[Any, Callable[[], None]]], epochs: int) -> float:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        pl.seed_everything(0, verbose=False)
        model, (train, val) = _module()(), _loaders()
        start = time.perf_counter()
        logger, end = arm(folder)
        trainer = pl.Trainer(
            logger=logger, max_epochs=epochs, accelerator="cpu", log_every_n_steps=1,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=folder,
            callbacks=[ModelCheckpoint(monitor="val/loss", save_last=True)],
        )  # fmt: skip
        trainer.fit(model, train, val)
        end()
        return time.perf_counter() - start


def main() -> None:
    """Run the arms and print the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-mlflow", action="store_true")
    parser.add_argument("--no-wandb", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.no_mlflow:
        os.environ["BENCH_MLFLOW"] = "0"
    if args.no_wandb:
        os.environ["BENCH_WANDB"] = "0"
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    loggers = _loggers()
    for name, arm in loggers.items():
        log(f"warm-up {name}: {_fit(arm, 1):.2f} s")
    steps = args.epochs * N_TRAIN // BATCH
    epochs = args.epochs
    arms = {name: (lambda _i, a=arm: {"s": _fit(a, epochs)}) for name, arm in loggers.items()}
    results = alternate(args.rounds, arms)
    median = {name: statistics.median(r["s"] for r in runs) for name, runs in results.items()}
    import importlib.metadata as md

    versions = {p: md.version(p) for p in ("lightning", "mlflow-skinny", "wandb")
                if _installed(p)}  # fmt: skip
    print(json.dumps({
        "bench": "lightning_logger", "machine": machine(**versions), "epochs": args.epochs,
        "steps": steps, "rounds": args.rounds,
        "median_s": {k: round(v, 3) for k, v in median.items()},
        "min_s": {k: round(min(r["s"] for r in v), 3) for k, v in results.items()},
        "added_ms_per_step": {k: round(1000 * (v - median["none"]) / steps, 3)
                              for k, v in median.items() if k != "none"},
        "all_s": {k: [round(r["s"], 3) for r in v] for k, v in results.items()},
    }))  # fmt: skip


def _installed(package: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(package)
    except md.PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    main()
