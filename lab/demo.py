"""The `lab quickstart` experiment: 2 arms x 3 repeats of a small torch regression.

Each run fits a two-layer MLP to a fixed random linear target with noise; the arms differ
in learning rate. In the loop a `val` evaluator scores every 50 steps; after training the
`holdout` benchmark scores 64 fixed examples, the same for every run, and records one
prediction per example (hit or miss within a tolerance) and a breakdown by input size
("small" and "large" inputs), so the predictions and breakdowns tables have rows to
compare arms on. It takes a few seconds on two CPU cores.
"""

from __future__ import annotations

from pathlib import Path

import pydantic
import torch

from lab.experiment import Arm, Experiment, ExperimentResult, RunSpec
from lab.hooks import Callback
from lab.loop import EvalResult, Evaluator, LoopArtifacts, TrainingLoop

HOLDOUT_SIZE = 64
TOLERANCE = 0.2  # a holdout prediction is a hit when it is this close to its target


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


def holdout(model: torch.nn.Module) -> EvalResult:
    """The post-training benchmark: the same 64 examples for every run, each one scored.

    A prediction within `TOLERANCE` of its target scores 1 (a hit), else 0. The examples
    whose input norm is above the median are the "large" slice, the rest "small": the
    breakdown shows where a model misses, the predictions on which examples arms disagree.
    """
    x, y = _dataset(seed=10_000, samples=HOLDOUT_SIZE)  # no repeat draws this seed
    out = model(x)
    error = (out - y).abs().squeeze(1)
    large = x.norm(dim=1) > x.norm(dim=1).median()
    hits = (error < TOLERANCE).float()
    sq = (out - y).pow(2).squeeze(1)
    slices = {"small": ~large, "large": large}
    predictions = [
        {
            "example_id": f"h{i:02d}",
            "input": [round(v, 3) for v in x[i].tolist()],
            "output": round(out[i, 0].item(), 4),
            "target": round(y[i, 0].item(), 4),
            "score": hits[i].item(),
            "slice": "large" if large[i] else "small",
            "abs_error": round(error[i].item(), 4),
        }
        for i in range(HOLDOUT_SIZE)
    ]
    return EvalResult(
        "holdout",
        {"acc": hits.mean().item(), "mse": sq.mean().item()},
        breakdowns={
            name: {"acc": hits[mask].mean().item(), "mse": sq[mask].mean().item()}
            for name, mask in slices.items()
        },
        tags={"examples": HOLDOUT_SIZE, "tolerance": TOLERANCE},
        predictions=predictions,
    )


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
    """Run the demo experiment into `store` (default: as every store URL) and return it:
    its val curves, and the holdout benchmark's metrics, breakdowns and predictions."""
    return Experiment(
        "quickstart",
        train,
        base_config=DemoConfig(steps=steps),
        arms=[Arm("sgd-lr0.01", lr=0.01), Arm("sgd-lr0.1", lr=0.1)],
        repeats=3,
        callbacks=callbacks or [],
        store=store,
        output_dir=output_dir,
        benchmarks=[Evaluator("holdout", holdout)],
    ).run()
