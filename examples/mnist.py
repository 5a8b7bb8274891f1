"""pytorch/examples `mnist/main.py`, recorded by `lab`: 2 arms x 2 repeats, checkpoints, resume.

The original trains a small conv net on MNIST with Adadelta and a StepLR that decays the
learning rate once per epoch, testing after each epoch. This keeps its `Net`, `train`, `test`
and `main` and its flags; what changes:

- the data: MNIST needs torchvision and a download, so `digits()` makes a small deterministic
  stand-in (8x8 images drawn from 10 class templates plus noise), and `Net.fc1` is sized for
  8x8 inputs (the original's 9216 = 64 * 12 * 12 is for 28x28);
- the epoch loop is a `lab.TrainingLoop(num_epochs=...)` inside `train_run(run)`: `train`
  is its `train_step` (one batch of the original's `train()`), `test` its evaluator after
  each epoch (given the device), and the StepLR a `Schedule(..., every="epoch")`. It fires
  the hooks, records each step's loss and each epoch's test metrics in the store, and saves
  a checkpoint at each epoch's end, after the test and the scheduler's step, so a resume
  continues the same learning-rate schedule;
- arms: the original `Net` (`dropout`) and one without its dropout layers (`no-dropout`),
  each repeated twice with its own seed.

    python examples/mnist.py                      # into ./lab.db and ./runs
    python examples/mnist.py --stop-at 20         # SIGKILLed at step 20 of the last run...
    python examples/mnist.py                      # ...which this resumes; the rest are reused
"""

from __future__ import annotations

import argparse
import functools

import pydantic
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

from lab import Arm, CheckpointConfig, Evaluator, TrainingLoop
from lab.loop import Schedule

from _lab import parse_args, run_experiment


class Config(pydantic.BaseModel):
    batch_size: int = 64
    test_batch_size: int = 1000
    epochs: int = 3
    lr: float = 1.0
    gamma: float = 0.7
    log_interval: int = 10
    dropout: bool = True
    n_train: int = 1024
    n_test: int = 256
    noise: float = 1.0
    no_accel: bool = False


class Net(nn.Module):
    def __init__(self, dropout: bool = True):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25) if dropout else nn.Identity()
        self.dropout2 = nn.Dropout(0.5) if dropout else nn.Identity()
        self.fc1 = nn.Linear(256, 128)  # 64 channels x 2 x 2 after an 8x8 input
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def digits(n: int, *, noise: float, seed: int) -> TensorDataset:
    """`n` 8x8 "digits": one of 10 fixed random templates each, plus Gaussian noise,
    normalized as the original normalizes MNIST. The templates are the same for every seed
    (the task), the draws differ (the train and test splits)."""
    templates = (torch.rand(10, 1, 8, 8, generator=torch.Generator().manual_seed(0)) > 0.5).float()
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 10, (n,), generator=gen)
    data = templates[target] + noise * torch.randn(n, 1, 8, 8, generator=gen)
    return TensorDataset((data - 0.5) / (0.5**2 + noise**2) ** 0.5, target)


def train(args, model, optimizer, train_loader, loop, batch):
    """One batch of the original `train()`: TrainingLoop runs the epochs, this the steps."""
    data, target = batch  # on the loop's device already
    optimizer.zero_grad()
    output = model(data)
    loss = F.nll_loss(output, target)
    loss.backward()
    optimizer.step()
    batch_idx = loop.state.batch_in_epoch - 1
    if batch_idx % args.log_interval == 0:
        print(
            f"Train Epoch: {loop.state.epoch + 1} [{batch_idx * len(data)}/"
            f"{len(train_loader.dataset)} ({100.0 * batch_idx / len(train_loader):.0f}%)]"
            f"\tLoss: {loss.item():.6f}"
        )
    return loss


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()  # sum up batch loss
            pred = output.argmax(dim=1, keepdim=True)  # index of the max log-probability
            correct += pred.eq(target.view_as(pred)).sum().item()

    test_loss /= len(test_loader.dataset)

    n = len(test_loader.dataset)
    print(
        f"\nTest set: Average loss: {test_loss:.4f}, "
        f"Accuracy: {correct}/{n} ({100.0 * correct / n:.0f}%)\n"
    )
    return test_loss, correct / len(test_loader.dataset)


def train_run(run):
    """One arm x repeat: the original `main()` body, its epoch loop a TrainingLoop."""
    args = run.config
    use_accel = not args.no_accel and torch.accelerator.is_available()
    device = torch.accelerator.current_accelerator() if use_accel else torch.device("cpu")

    train_kwargs = {"batch_size": args.batch_size, "shuffle": True}
    test_kwargs = {"batch_size": args.test_batch_size}
    dataset1 = digits(args.n_train, noise=args.noise, seed=1)
    dataset2 = digits(args.n_test, noise=args.noise, seed=2)
    train_loader = DataLoader(dataset1, **train_kwargs)
    test_loader = DataLoader(dataset2, **test_kwargs)

    model = Net(args.dropout).to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)

    def test_eval(model, ctx):
        test_loss, accuracy = test(model, ctx.device, test_loader)
        return {"loss": test_loss, "acc": accuracy}

    loop = TrainingLoop(
        model,
        optimizer,
        train_loader,
        num_epochs=args.epochs,
        train_step=functools.partial(train, args, model, optimizer, train_loader),
        # the original steps its StepLR after each epoch's test
        scheduler=Schedule(scheduler, every="epoch"),
        evaluators=[Evaluator("test", test_eval, every_epochs=1, metrics=["loss", "acc"])],
        # a checkpoint per epoch, after its test and its scheduler step; the newest and the
        # best by test loss are kept
        checkpoint=CheckpointConfig(
            every=len(train_loader), keep_last=1, keep_top_k=1, metric="test/loss", mode="min"
        ),
        device=device,
    )
    return loop.fit(run)  # resumes from the run's newest checkpoint, if it has one


def main():
    # Training settings
    defaults = Config()
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example, recorded by lab")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=defaults.batch_size,
        metavar="N",
        help="input batch size for training (default: %(default)s)",
    )
    parser.add_argument(
        "--test-batch-size",
        type=int,
        default=defaults.test_batch_size,
        metavar="N",
        help="input batch size for testing (default: %(default)s)",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=defaults.epochs,
        metavar="N",
        help="number of epochs to train (default: %(default)s)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=defaults.lr,
        metavar="LR",
        help="learning rate (default: %(default)s)",
    )
    parser.add_argument(
        "--gamma",
        type=float,
        default=defaults.gamma,
        metavar="M",
        help="learning rate step gamma (default: %(default)s)",
    )
    parser.add_argument("--no-accel", action="store_true", help="disables accelerator")
    parser.add_argument(
        "--seed",
        type=int,
        default=1,
        metavar="S",
        help="random seed of the first repeat (default: %(default)s)",
    )
    parser.add_argument(
        "--log-interval",
        type=int,
        default=defaults.log_interval,
        metavar="N",
        help="how many batches to wait before printing the training status",
    )
    parser.add_argument(
        "--n-train",
        type=int,
        default=defaults.n_train,
        metavar="N",
        help="training images (default: %(default)s)",
    )
    parser.add_argument(
        "--n-test",
        type=int,
        default=defaults.n_test,
        metavar="N",
        help="test images (default: %(default)s)",
    )
    args = parse_args(parser)

    config = Config(
        batch_size=args.batch_size,
        test_batch_size=args.test_batch_size,
        epochs=args.epochs,
        lr=args.lr,
        gamma=args.gamma,
        log_interval=args.log_interval,
        n_train=args.n_train,
        n_test=args.n_test,
        no_accel=args.no_accel,
    )
    arms = [Arm("dropout"), Arm("no-dropout", dropout=False)]
    result = run_experiment(
        "mnist", train_run, args, base_config=config, arms=arms, seed=args.seed,
        metric="test/acc", mode="max", bounds={"test/acc": (0, 1)},  # every door ranks by it
    )  # fmt: skip
    keys = ["loss", "test/loss", "test/acc"]  # a custom train_step leaves grad_norm NaN
    print(result.summary(keys=keys))


if __name__ == "__main__":
    main()
