"""HF accelerate's `examples/by_feature/gradient_accumulation.py`, recorded by `lab`.

The original fine-tunes BERT on GLUE MRPC (is sentence b a paraphrase of sentence a?) with
AdamW, a linear schedule with warmup, and `--gradient_accumulation_steps` micro-batches per
optimizer step, evaluating accuracy and F1 after each epoch. This keeps its
`get_dataloaders`, `training_function` and `main`, its flag and its config dict; what changes:

- the data and the model: BERT and MRPC need transformers, datasets and a download, so
  `pairs()` makes a small deterministic paraphrase task (b is a noisy copy of a, or not) and
  `PairClassifier` is a small MLP over the pair;
- the loop runs inside `training_function(run)` under a `lab.RunHandle`: a step is one
  optimizer step, whatever the number of micro-batches in it, so the step count, the
  scheduler, the logged `loss` (the mean over the step's micro-batches) and the checkpoints
  all count optimizer steps. A checkpoint is only ever taken between two optimizer steps,
  so no accumulated gradient is lost, and `loop.batches` saves the position in the epoch
  in micro-batches, so a resume continues mid-epoch where it stopped;
- arms: `large-batch` (one batch of `batch_size` times `--gradient_accumulation_steps` per
  step) against `accumulate` (that many micro-batches of `batch_size` per step): the same
  samples per step, so the two end alike, up to rounding; 2 repeats each.

    python examples/accumulate.py                 # into ./lab.db and ./runs
    python examples/accumulate.py --stop-at 13    # SIGKILLed at step 13 of the last run...
    python examples/accumulate.py                 # ...which this resumes; the rest are reused
"""

from __future__ import annotations

import argparse
import math

import pydantic
import torch
import torch.nn as nn
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, TensorDataset

from lab import Arm, CheckpointConfig, Evaluator, RunHandle

from _lab import parse_args, run_experiment

EVAL_BATCH_SIZE = 32


class Config(pydantic.BaseModel):
    lr: float = 1e-3
    num_epochs: int = 3
    batch_size: int = 16
    gradient_accumulation_steps: int = 1
    num_warmup_steps: int = 5
    n_train: int = 512
    n_eval: int = 128
    dim: int = 16
    save_every: int = 5
    cpu: bool = False


def pairs(n: int, dim: int, *, seed: int) -> TensorDataset:
    """`n` pairs (a, b) with label 1 when b is a noisy copy of a (a "paraphrase"), else 0."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, dim, generator=gen)
    label = torch.randint(0, 2, (n,), generator=gen)
    other = torch.randn(n, dim, generator=gen)
    b = torch.where(label[:, None] == 1, a, other) + 0.8 * torch.randn(n, dim, generator=gen)
    return TensorDataset(a, b, label)


class PairClassifier(nn.Module):
    """Two logits for a pair, from the pair's features (BERT's [CLS] head, in miniature)."""

    def __init__(self, dim: int, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4 * dim, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, a, b):
        return self.net(torch.cat([a, b, (a - b).abs(), a * b], dim=1))


def get_dataloaders(config, batch_size=16):
    train_dataloader = DataLoader(
        pairs(config.n_train, config.dim, seed=1), shuffle=True, batch_size=batch_size
    )
    eval_dataloader = DataLoader(
        pairs(config.n_eval, config.dim, seed=2), shuffle=False, batch_size=EVAL_BATCH_SIZE
    )
    return train_dataloader, eval_dataloader


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps):
    """transformers' schedule: linear warmup to the lr, then linear decay to 0."""

    def lr_lambda(current_step):
        if current_step < num_warmup_steps:
            return current_step / max(1, num_warmup_steps)
        left = num_training_steps - current_step
        return max(0.0, left / max(1, num_training_steps - num_warmup_steps))

    return LambdaLR(optimizer, lr_lambda)


def training_function(run):
    """One arm x repeat: the original `training_function(config, args)` on a RunHandle."""
    config = run.config
    device = torch.device("cpu")
    if not config.cpu and torch.accelerator.is_available():
        device = torch.accelerator.current_accelerator()
    lr = config.lr
    num_epochs = config.num_epochs
    batch_size = config.batch_size
    gradient_accumulation_steps = config.gradient_accumulation_steps

    train_dataloader, eval_dataloader = get_dataloaders(config, batch_size)
    # The model is built here, so that the run's seed also sets its initial weights
    model = PairClassifier(config.dim).to(device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    # One step per `gradient_accumulation_steps` micro-batches, and one at an epoch's end
    steps_per_epoch = math.ceil(len(train_dataloader) / gradient_accumulation_steps)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=config.num_warmup_steps,
        num_training_steps=steps_per_epoch * num_epochs,
    )
    criterion = nn.CrossEntropyLoss()

    def evaluate(model):
        """Accuracy and F1 on the eval set, as GLUE's MRPC metric reports them."""
        predictions, references = [], []
        for a, b, labels in eval_dataloader:
            outputs = model(a.to(device), b.to(device))
            predictions.append(outputs.argmax(dim=-1).cpu())
            references.append(labels)
        pred, ref = torch.cat(predictions), torch.cat(references)
        tp = ((pred == 1) & (ref == 1)).sum().item()
        fp = ((pred == 1) & (ref == 0)).sum().item()
        fn = ((pred == 0) & (ref == 1)).sum().item()
        eval_metric = {
            "accuracy": (pred == ref).float().mean().item(),
            "f1": 2 * tp / max(1, 2 * tp + fp + fn),
        }
        print(f"{run.run_key} epoch {loop.step // steps_per_epoch - 1}:", eval_metric)
        return eval_metric

    with RunHandle(
        run,
        model,
        optimizer,
        scheduler=lr_scheduler,
        num_steps=steps_per_epoch * num_epochs,
        # at the end of each epoch, before the save due at that step
        evaluators=[Evaluator("eval", evaluate, every=steps_per_epoch, metrics=["accuracy", "f1"])],
        # saves between two epochs' evals have no fresh eval/f1: unranked, kept by keep_last
        checkpoint=CheckpointConfig(
            every=config.save_every, keep_last=1, keep_top_k=1, metric="eval/f1", mode="max"
        ),
        metrics=["loss", "lr"],
        device=device,
    ) as loop:
        batches = loop.batches(train_dataloader)  # micro-batches; the position is saved
        for _ in loop.steps():
            model.train()
            losses = []  # each micro-batch's loss: the step logs their mean
            for _micro in range(gradient_accumulation_steps):
                a, b, labels = (t.to(device) for t in next(batches))
                output = model(a, b)
                loss = criterion(output, labels)
                (loss / gradient_accumulation_steps).backward()
                losses.append(loss.item())
                if loop.state.batch_in_epoch == len(train_dataloader):
                    break  # the end of the dataloader ends the step, as accelerate does
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            loss = sum(losses) / len(losses)
            loop.end_step({"loss": loss, "lr": lr_scheduler.get_last_lr()[0]})
    return loop.artifacts


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument(
        "--gradient_accumulation_steps",
        type=int,
        default=4,
        help="The number of minibatches to be ran before gradients are accumulated.",
    )
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--num_epochs", type=int, default=3, help="epochs (default: 3)")
    parser.add_argument("--n-train", type=int, default=512, help="training pairs (default: 512)")
    parser.add_argument(
        "--save-every",
        type=int,
        default=5,
        metavar="N",
        help="save a checkpoint every N optimizer steps (default: 5)",
    )
    parser.add_argument(
        "--seed", type=int, default=42, help="seed of the first repeat (default: 42)"
    )
    args = parse_args(parser)
    config = {"lr": 1e-3, "num_epochs": args.num_epochs, "seed": args.seed, "batch_size": 16}

    k = args.gradient_accumulation_steps
    base = Config(
        lr=config["lr"],
        num_epochs=config["num_epochs"],
        batch_size=config["batch_size"],
        n_train=args.n_train,
        save_every=args.save_every,
        cpu=args.cpu,
    )
    arms = [
        Arm("large-batch", batch_size=config["batch_size"] * k),
        Arm("accumulate", gradient_accumulation_steps=k),
    ]
    result = run_experiment(
        "accumulate", training_function, args, base_config=base, arms=arms, seed=config["seed"],
        metric="eval/f1", mode="max",  # every door ranks the arms by it
        bounds={"eval/accuracy": (0, 1), "eval/f1": (0, 1)},  # fractions
    )  # fmt: skip
    print(result.summary())


if __name__ == "__main__":
    main()
