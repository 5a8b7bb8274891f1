"""A tiny LightningModule on CPU for the Lightning tests, the same training written on
`RunHandle`, and an Experiment's ``train(run)`` that a subprocess runs (``python -m
tests.lightning_tiny DB RUNS``; ``LAB_TEST_KILL_AT=N`` SIGKILLs it at global step N)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import lightning.pytorch as pl
import pydantic
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import lab
from lab.integrations.lightning import LabLogger

N, BATCH, EPOCHS = 32, 8, 3  # 4 steps an epoch


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """The same examples for every run."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(N, 4, generator=gen)
    return x, x.sum(1, keepdim=True) + 0.1 * torch.randn(N, 1, generator=gen)


def loader() -> DataLoader:
    """The examples in order, `BATCH` at a time."""
    return DataLoader(TensorDataset(*data()), batch_size=BATCH)


def rows(batch_idx: int, out: torch.Tensor, y: torch.Tensor) -> list[dict[str, Any]]:
    """One prediction row per example of a batch."""
    return [
        {"example_id": f"ex{batch_idx * BATCH + k}", "output": float(o), "target": float(t),
         "score": -abs(float(o) - float(t))}  # higher is better
        for k, (o, t) in enumerate(zip(out.squeeze(-1), y.squeeze(-1), strict=True))
    ]  # fmt: skip


class Tiny(pl.LightningModule):
    """A linear regression; `fail_at` raises in that global step's training_step."""

    def __init__(self, lr: float = 0.05, fail_at: int = 0, interrupt: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step + 1 == self.hparams.fail_at:
            raise (KeyboardInterrupt() if self.hparams.interrupt else RuntimeError("diverged"))
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def _evaluate(self, batch: Any, batch_idx: int, name: str) -> dict[str, Any]:
        x, y = batch
        out = self.net(x)
        self.log(f"{name}/loss", torch.nn.functional.mse_loss(out, y))
        return {"predictions": rows(batch_idx, out, y)}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return self._evaluate(batch, batch_idx, "val")

    def test_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return self._evaluate(batch, batch_idx, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).squeeze(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def trainer(logger: LabLogger, *callbacks: pl.Callback, epochs: int = EPOCHS) -> pl.Trainer:
    """A CPU trainer that keeps the best checkpoint by ``val/loss`` and the last one."""
    best = ModelCheckpoint(monitor="val/loss", save_top_k=1, save_last=True)
    return pl.Trainer(
        logger=logger, max_epochs=epochs, accelerator="cpu", enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=1, callbacks=[best, *callbacks],
    )  # fmt: skip


def handle_loop(run: lab.RunSpec, epochs: int = EPOCHS) -> None:
    """The same training written on `RunHandle`: the rows a Lightning fit must equal."""
    pl.seed_everything(0, verbose=False)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=model.hparams.lr)
    x, y = data()
    steps = epochs * N // BATCH
    with lab.RunHandle(run, model, opt, num_steps=steps, more_metrics=True) as loop:
        for epoch in range(epochs):
            for i in range(0, N, BATCH):
                loss = torch.nn.functional.mse_loss(model.net(x[i : i + BATCH]), y[i : i + BATCH])
                opt.zero_grad()
                loss.backward()
                opt.step()
                loop.end_step({"train/loss": loss.item(), "epoch": float(epoch)})
            total, preds = torch.tensor(0.0), []
            with torch.no_grad():
                for b, i in enumerate(range(0, N, BATCH)):
                    out = model.net(x[i : i + BATCH])
                    total += torch.nn.functional.mse_loss(out, y[i : i + BATCH]) * BATCH
                    preds += rows(b, out, y[i : i + BATCH])
            loop.log_eval("val", {"loss": (total / N).item()}, predictions=preds)


class Config(pydantic.BaseModel):
    """The arms' config."""

    lr: float = 0.05


class Kill(pl.Callback):
    """SIGKILLs the process at global step `at`, as a crash would."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def train(run: lab.RunSpec) -> dict[str, Any]:
    """An Experiment's ``train(run)``: Lightning's own idiom, nothing more (its final
    metrics are the run's result)."""
    pl.seed_everything()  # PL_GLOBAL_SEED: LabLogger(run) set it to the run's seed
    model = Tiny(lr=run.config.lr)
    kill = int(os.environ.get("LAB_TEST_KILL_AT", "0"))
    fit = trainer(LabLogger(run, predictions=True), *([Kill(kill)] if kill else []))
    fit.fit(model, loader(), loader(), ckpt_path="last")
    return dict(fit.callback_metrics)


def experiment(db: str, runs: str) -> lab.Experiment:
    """Two arms x two repeats of `train`."""
    arms = [lab.Arm("slow", lr=0.02), lab.Arm("fast", lr=0.05)]
    return lab.Experiment("lt", train, base_config=Config(), arms=arms, repeats=2, seed=7,
                          store=f"sqlite:///{db}", output_dir=runs)  # fmt: skip


if __name__ == "__main__":
    experiment(sys.argv[1], sys.argv[2]).run()
