"""A loop on HF accelerate, recorded by `lab` through its tracker API (lab[accelerate]).

The loop is written as accelerate's `examples/nlp_example.py` and its checkpointing example
write theirs: `Accelerator(log_with=...)`, `accelerator.prepare`, `accelerator.backward`,
`accelerator.log(values, step=)` every step, `accelerator.save_state(folder)` every
`--save-every` steps and `accelerator.load_state(folder)` to resume. What changes:

- the model and data: a small MLP regressing a fixed linear map on batches made from the
  step's number, so a resumed run draws the very batches an uninterrupted one does;
- the tracker is `LabTracker(run)`: the run records what `accelerator.log` logs at its step;
  `tracker.checkpoint(folder, step=)` records each `save_state` folder by reference, and
  `tracker.resumed(step, folder)` (before `init_trackers`) says the loop continues from the
  state `load_state` loaded, so a rerun after a crash continues the same run;
- arms: two learning rates, 2 repeats each.

    python examples/accelerate_tracker.py               # into ./lab.db and ./runs
    python examples/accelerate_tracker.py --stop-at 15  # SIGKILLed at step 15 of the last run...
    python examples/accelerate_tracker.py               # ...which this resumes from checkpoint-10
"""

from __future__ import annotations

import argparse

import pydantic
import torch
import torch.nn as nn
from accelerate import Accelerator

from lab import Arm
from lab.integrations.accelerate import LabTracker

from _lab import parse_args, run_experiment


class Config(pydantic.BaseModel):
    lr: float = 1e-3
    steps: int = 40
    save_every: int = 10
    batch_size: int = 32
    dim: int = 8


def batch(step: int, config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of step `step`: made from the step's number, the same on a rerun."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(config.batch_size, config.dim, generator=g)
    weights = torch.linspace(-1, 1, config.dim)
    noise = 0.1 * torch.randn(config.batch_size, generator=g)
    return x, (x @ weights + noise)[:, None]


def newest_state(folder):
    """The newest `checkpoint-N` folder `save_state` wrote in `folder`, and its N."""
    saved = [(int(p.name.split("-")[1]), p) for p in folder.glob("checkpoint-*")]
    return max(saved) if saved else (0, None)


def training_function(run):
    """One arm x repeat: the accelerate loop, resumed from its newest saved state."""
    config = run.config
    tracker = LabTracker(run)
    accelerator = Accelerator(cpu=True, log_with=tracker)
    model = nn.Sequential(nn.Linear(config.dim, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    model, optimizer = accelerator.prepare(model, optimizer)

    folder = run.dir / "accelerate"
    start, state = newest_state(folder)
    if state is not None:
        accelerator.load_state(str(state))  # the model, the optimizer and the RNGs
        tracker.resumed(start, state)
    accelerator.init_trackers("accelerate_tracker", config=config.model_dump())
    for step in range(start + 1, config.steps + 1):
        x, y = batch(step, config)
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.item()}, step=step)
        if step % config.save_every == 0:
            path = folder / f"checkpoint-{step}"
            accelerator.save_state(str(path))
            tracker.checkpoint(path, step=step)
    accelerator.end_training()
    return run.artifacts  # its final loss ranks the arms


def main():
    parser = argparse.ArgumentParser(description="A loop on accelerate, recorded by lab.")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default: 40)")
    parser.add_argument(
        "--save-every",
        type=int,
        default=10,
        metavar="N",
        help="save_state every N steps (default: 10)",
    )
    parser.add_argument(
        "--seed", type=int, default=42, help="seed of the first repeat (default: 42)"
    )
    args = parse_args(parser)
    base = Config(steps=args.steps, save_every=args.save_every)
    arms = [Arm("lr-1e-3"), Arm("lr-1e-2", lr=1e-2)]
    result = run_experiment(
        "accelerate_tracker", training_function, args, base_config=base, arms=arms,
        seed=args.seed, metric="loss", mode="min",
    )  # fmt: skip
    print(result.summary())


if __name__ == "__main__":
    main()
