"""What the scripts in examples/ share: their lab flags, the crash they can stage, and the
run of their Experiment. Each script keeps what makes it a conversion of its original (its
model, its own flags, its train and test functions) and imports the rest from here, as
`from _lab import ...` (a script run as `python examples/X.py` has this folder on sys.path).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import pydantic
import torch

from lab import Arm, Callback, Experiment, ExperimentResult
from lab.errors import LabError


def parse_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The script's own flags and lab's (--repeats, --store, --output-dir, --fresh,
    --stop-at), parsed; and one CPU thread unless OMP_NUM_THREADS says otherwise, since
    models this small run fastest on one thread (more only wait on each other)."""
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        metavar="N",
        help="repeats (seeds) of each arm (default: %(default)s)",
    )
    parser.add_argument(
        "--store",
        default="sqlite:///lab.db",
        metavar="URL",
        help="the lab store (default: %(default)s)",
    )
    parser.add_argument(
        "--output-dir",
        default="runs",
        metavar="DIR",
        help="where run folders and checkpoints go (default: %(default)s)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="train every run again (the recorded runs are kept, superseded)",
    )
    parser.add_argument(
        "--stop-at",
        type=int,
        default=None,
        metavar="STEP",
        help="SIGKILL this process after step STEP of the last run, to try "
        "the resume: run the same command again without it",
    )
    args = parser.parse_args()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    return args


class StopAt(Callback):
    """SIGKILLs this process after step `step` of the experiment's last run: a crash, to try
    the resume (running the same command again continues from the last checkpoint)."""

    def __init__(self, step: int, arm: str, repeat: int) -> None:
        self.step, self.arm, self.repeat = step, arm, repeat

    def on_step_end(self, state, step_idx, batch, metrics):
        if step_idx == self.step and (state.ctx.arm, state.ctx.repeat) == (self.arm, self.repeat):
            os.kill(os.getpid(), signal.SIGKILL)


class Resumed(Callback):
    """Says when a run resumes from a checkpoint."""

    def post_checkpoint_loaded(self, state, path: Path) -> None:
        print(f"{state.ctx.run_key}: resumed from {path.name}")


def run_experiment(
    name: str,
    train_run: Callable[[Any], Any],
    args: argparse.Namespace,
    *,
    base_config: pydantic.BaseModel,
    arms: Sequence[Arm],
    seed: int,
    metric: str,
    mode: Literal["min", "max"],
    bounds: dict[str, tuple[float, float]] | None = None,
) -> ExperimentResult:
    """Run the arms x `args.repeats` of `train_run` into `args.store` and `args.output_dir`,
    saying which runs resume, with the crash `args.stop_at` asks for staged in the last run.
    `metric` and `mode` rank the arms and `bounds` gives metrics' known ranges, in every
    door (`Experiment`). A LabError (a bad store URL, flags other than the first time) ends
    the script with one line, no traceback."""
    callbacks: list[Callback] = [Resumed()]
    if args.stop_at is not None:
        callbacks.append(StopAt(args.stop_at, arms[-1].name, args.repeats - 1))
    experiment = Experiment(
        name,
        train_run,
        base_config=base_config,
        arms=arms,
        repeats=args.repeats,
        seed=seed,
        callbacks=callbacks,
        store=args.store,
        output_dir=args.output_dir,
        fresh=args.fresh,
        metric=metric,
        mode=mode,
        bounds=bounds,
    )
    try:
        return experiment.run()
    except LabError as exc:
        sys.exit(f"error: {exc}")
