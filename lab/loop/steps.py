"""How the loop is told to step: epochs or steps, a custom step, and what each may not do.

These are the checks `TrainingLoop` makes when it is built, so that a setting it cannot honour
is one line before anything trains, and the reading of a custom step's result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lab.errors import ConfigError, LossError
from lab.loop.evals import Evaluator

__all__ = [
    "check_custom_step",
    "check_no_epoch_settings",
    "epoch_length",
    "positive_int",
    "unpack_step",
]  # fmt: skip


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def epoch_length(
    data: Any, given: int | None, num_epochs: int | None, accumulate: int
) -> int | None:
    """Optimizer steps per epoch: `given`, else ``len(data) // accumulate`` when the loop
    counts epochs (`num_epochs`), else None (the loop does not count epochs)."""
    if given is not None:
        if not positive_int(given):
            raise ConfigError(f"steps_per_epoch={given!r}: give the steps per epoch, an int >= 1")
        return given
    if num_epochs is None:
        return None
    try:
        batches = len(data)
    except TypeError:
        raise ConfigError(
            f"num_epochs needs the epoch's length: data has no len() ({type(data).__name__}); "
            "pass steps_per_epoch=N"
        ) from None
    if batches < accumulate:
        raise ConfigError(
            f"an epoch of {batches} batches holds no step of {accumulate} micro-batches: "
            "lower accumulate, or give more data"
        )
    return batches // accumulate


def check_no_epoch_settings(schedules: Sequence[Any], evaluators: Sequence[Evaluator]) -> None:
    """Per-epoch schedules and evals need a loop that counts epochs."""
    fix = "needs the loop to count epochs: pass num_epochs=N or steps_per_epoch=N"
    for item in schedules:
        if item.every == "epoch":
            raise ConfigError(f"Schedule({type(item.scheduler).__name__}, every='epoch') {fix}")
    for ev in evaluators:
        if ev.every_epochs is not None:
            raise ConfigError(f"Evaluator {ev.name!r} (every_epochs={ev.every_epochs}) {fix}")


def check_custom_step(grad_clip: float | None, accumulate: int) -> None:
    """What a custom step does itself is not the loop's to do."""
    if grad_clip is not None:
        raise ConfigError(
            f"grad_clip={grad_clip!r} with a custom train_step: clip inside your step "
            "(torch.nn.utils.clip_grad_norm_), or drop train_step"
        )
    if accumulate != 1:
        raise ConfigError(
            f"accumulate={accumulate!r} with a custom train_step: accumulate inside your step, "
            "or drop train_step"
        )


def unpack_step(out: Any) -> tuple[Any, dict[str, Any] | None]:
    """A custom step's result: a loss (a tensor or a number) or ``(loss, metrics)``."""
    extra = None
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], dict):
            raise LossError(
                "train_step returned a tuple; return the loss or (loss, dict_of_metrics)"
            )
        out, extra = out
    if isinstance(out, torch.Tensor):
        if out.numel() != 1:
            raise LossError(
                f"train_step returned a tensor of shape {tuple(out.shape)}; return a scalar loss"
            )
        return out.detach(), extra
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        return float(out), extra
    raise LossError(
        f"train_step returned {type(out).__name__}; return the loss (a tensor or a float) "
        "or (loss, dict_of_metrics)"
    )
