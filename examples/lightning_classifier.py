"""Lightning's `examples/pytorch/basics/backbone_image_classifier.py`, recorded by `lab`.

The original trains `LitClassifier` (a two-layer `Backbone`) on MNIST with Adam, logging
``train_loss`` (each step and each epoch) and ``valid_loss``, then tests and predicts with the
best checkpoint. This keeps its `Backbone`, `LitClassifier` and `MyDataModule` and the fit,
test and predict calls; what changes:

- the data: MNIST needs a download, so `MyDataModule` makes a small deterministic
  MNIST-shaped task (each class a fixed 28x28 pattern, each image that pattern plus noise);
- the trainer's logger is ``LabLogger(run, predictions=True)``: the run's metrics at the
  trainer's global step, ``valid_loss`` as the ``val`` eval, the test and the predictions
  after the fit as post-training evals (``predict_step``'s logits as prediction rows), and
  every ``ModelCheckpoint`` save by reference. ``ckpt_path="last"`` resumes a crashed run
  from its ``last.ckpt`` (in the run's folder);
- arms: Adam's learning rate 1e-3 and 1e-2, 2 repeats each (the repeat's seed reaches
  Lightning through ``seed_everything()``).

    python examples/lightning_classifier.py                # into ./lab.db and ./runs
    python examples/lightning_classifier.py --stop-at 12   # SIGKILLed at step 12 of the last run...
    python examples/lightning_classifier.py                # ...which this resumes
"""

from __future__ import annotations

import argparse

import pydantic
import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split

from lab import Arm
from lab.integrations.lightning import LabLogger

from _lab import parse_args, run_experiment


class Backbone(torch.nn.Module):
    def __init__(self, hidden_dim=128):
        super().__init__()
        self.l1 = torch.nn.Linear(28 * 28, hidden_dim)
        self.l2 = torch.nn.Linear(hidden_dim, 10)

    def forward(self, x):
        x = x.view(x.size(0), -1)
        x = torch.relu(self.l1(x))
        return torch.relu(self.l2(x))


class LitClassifier(LightningModule):
    def __init__(self, backbone: Backbone | None = None, learning_rate: float = 0.0001):
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        if backbone is None:
            backbone = Backbone()
        self.backbone = backbone

    def forward(self, x):
        # use forward for inference/predictions
        return self.backbone(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("valid_loss", loss)

    def test_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("test_loss", loss)

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        x, _ = batch
        return self(x)

    def configure_optimizers(self):
        # self.hparams available because we called self.save_hyperparameters()
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


def mnist_like(n, gen):
    """`n` MNIST-shaped examples: class c's fixed pattern plus noise (the same task in every
    run: the patterns come from a fixed seed)."""
    patterns = torch.rand(10, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 10, (n,), generator=gen)
    images = patterns[labels] + 0.5 * torch.randn(n, 1, 28, 28, generator=gen)
    return TensorDataset(images, labels)


class MyDataModule(LightningDataModule):
    def __init__(self, batch_size: int = 32, n_train: int = 1100):
        super().__init__()
        gen = torch.Generator().manual_seed(42)
        dataset = mnist_like(n_train, gen)
        self.mnist_test = mnist_like(n_train // 10, gen)
        n_val = n_train // 11
        self.mnist_train, self.mnist_val = random_split(
            dataset, [n_train - n_val, n_val], generator=torch.Generator().manual_seed(42)
        )
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.mnist_train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.mnist_val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)


class Config(pydantic.BaseModel):
    learning_rate: float = 1e-3
    max_epochs: int = 3
    batch_size: int = 32
    n_train: int = 1100


def cli_main(run):
    """One run: the original's fit, test and predict, with `lab`'s logger."""
    config = run.config
    seed_everything()  # the repeat's seed (PL_GLOBAL_SEED)
    model = LitClassifier(learning_rate=config.learning_rate)
    datamodule = MyDataModule(config.batch_size, config.n_train)
    trainer = Trainer(
        logger=LabLogger(run, predictions=True),
        callbacks=[ModelCheckpoint(monitor="valid_loss", save_last=True)],
        max_epochs=config.max_epochs,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(model, datamodule=datamodule, ckpt_path="last")
    metrics = dict(trainer.callback_metrics)  # the fit's final metrics: the run's result
    trainer.test(ckpt_path="best", datamodule=datamodule)
    predictions = trainer.predict(ckpt_path="best", datamodule=datamodule)
    print(f"{run.run_key}: predictions {tuple(predictions[0].shape)}")
    return metrics


def main():
    parser = argparse.ArgumentParser(description="Lightning's backbone image classifier")
    parser.add_argument("--max_epochs", type=int, default=3, help="epochs (default: 3)")
    parser.add_argument("--batch_size", type=int, default=32, help="batch size (default: 32)")
    parser.add_argument("--n-train", type=int, default=1100, help="examples (default: 1100)")
    args = parse_args(parser)
    base = Config(max_epochs=args.max_epochs, batch_size=args.batch_size, n_train=args.n_train)
    arms = [Arm("lr-0.001", learning_rate=1e-3), Arm("lr-0.01", learning_rate=1e-2)]
    result = run_experiment(
        "lightning_classifier", cli_main, args, base_config=base, arms=arms, seed=1234,
        metric="valid_loss", mode="min",
    )  # fmt: skip
    print(result.summary())


if __name__ == "__main__":
    main()
