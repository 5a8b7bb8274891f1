"""The `lab quickstart` experiment: 2 arms x 3 repeats of a small torch regression.

Each run fits a two-layer MLP to a fixed random linear target with noise; the arms differ
in learning rate. It takes a few seconds on two CPU cores.
"""

from __future__ import annotations

from pathlib import Path

import pydantic
import torch

from lab.experiment import Arm, Experiment, ExperimentResult, RunSpec
from lab.hooks import Callback
from lab.loop import Evaluator, LoopArtifacts, TrainingLoop


class DemoConfig(pydantic.BaseModel):
    """The demo's settings; each arm overrides some of them."""

    lr: float = 0.01
    hidden: int = 32
    batch_size: int = 32
    steps: int = 300
    samples: int = 512


def _dataset(seed: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)  # the task is the same for every run
    weight = torch.randn(8, 1, generator=gen)
    gen = torch.Generator().manual_seed(seed)  # the sample differs per repeat
    x = torch.randn(samples, 8, generator=gen)
    y = x @ weight + 0.1 * torch.randn(samples, 1, generator=gen)
    return x, y


def mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error of the model on one batch."""
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def train(run: RunSpec) -> LoopArtifacts:
    """Train one run of the demo: the function an Experiment calls per arm x repeat."""
    cfg: DemoConfig = run.config
    x, y = _dataset(run.seed, cfg.samples)
    split = cfg.samples * 3 // 4
    train_x, train_y, val_x, val_y = x[:split], y[:split], x[split:], y[split:]
    batches = [
        (train_x[i : i + cfg.batch_size], train_y[i : i + cfg.batch_size])
        for i in range(0, split, cfg.batch_size)
    ]
    model = torch.nn.Sequential(
        torch.nn.Linear(8, cfg.hidden), torch.nn.ReLU(), torch.nn.Linear(cfg.hidden, 1)
    )
    loop = TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=cfg.lr),
        data=batches,
        loss_fn=mse,
        num_steps=cfg.steps,
        evaluators=[Evaluator("val", lambda m: {"loss": mse(m, (val_x, val_y)).item()}, every=50)],
    )
    return loop.fit(run)


def quickstart(
    store: str | None = None,
    *,
    output_dir: str | Path = "runs",
    callbacks: list[Callback] | None = None,
    steps: int = 300,
) -> ExperimentResult:
    """Run the demo experiment into `store` (default: as every store URL) and return it."""
    return Experiment(
        "quickstart",
        train,
        base_config=DemoConfig(steps=steps),
        arms=[Arm("sgd-lr0.01", lr=0.01), Arm("sgd-lr0.1", lr=0.1)],
        repeats=3,
        callbacks=callbacks or [],
        store=store,
        output_dir=output_dir,
    ).run()
