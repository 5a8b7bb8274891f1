"""Evaluators: named evaluations that run inside the loop or after training."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from lab.errors import ConfigError


@dataclass
class EvalResult:
    """One scored evaluation: metrics, per-slice breakdowns, tags, and its predictions.

    `predictions` holds one dict per example (keys such as ``example_id``, ``input``,
    ``output``, ``target``, ``score``; any other key goes to the row's extras).
    """

    name: str
    metrics: dict[str, float]
    breakdowns: dict[str, dict[str, float]] = field(default_factory=dict)
    tags: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    seconds: float = 0.0
    predictions: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


EvalFn = Callable[[torch.nn.Module], "dict[str, float] | EvalResult"]


class Evaluator:
    """Runs `fn(model)` in eval mode under `torch.no_grad()` at chosen steps.

    `fn` returns a dict of metrics, or an `EvalResult` when it also has breakdowns or
    per-example predictions (a benchmark). Choose when with `every` (each N steps),
    `at_steps` (fixed steps), `at_start` (before the first step, as step 0) and `at_end`.

    >>> Evaluator("val", lambda model: {"loss": 0.5}, every=50).due(100, num_steps=200)
    True
    """

    def __init__(
        self,
        name: str,
        fn: EvalFn,
        *,
        every: int | None = None,
        at_steps: Iterable[int] = (),
        at_start: bool = False,
        at_end: bool = False,
    ) -> None:
        if not name or not isinstance(name, str):
            raise ConfigError("Evaluator needs a non-empty name, e.g. Evaluator('val', fn)")
        if every is not None and every < 1:
            raise ConfigError(f"Evaluator {name!r}: every={every} must be >= 1 or None")
        self.name = name
        self.fn = fn
        self.every = every
        self.at_steps = frozenset(int(s) for s in at_steps)
        self.at_start = at_start
        self.at_end = at_end

    def due(self, step: int, *, num_steps: int) -> bool:
        """Whether this evaluator runs after step `step`."""
        if self.every is not None and step % self.every == 0:
            return True
        return step in self.at_steps or (self.at_end and step == num_steps)

    def run(self, model: torch.nn.Module, step: int | None) -> EvalResult:
        """Score `model` now, restoring its train/eval mode afterwards."""
        was_training = model.training
        model.eval()
        start = time.perf_counter()
        try:
            with torch.no_grad():
                out = self.fn(model)
        finally:
            model.train(was_training)
        seconds = time.perf_counter() - start
        if isinstance(out, EvalResult):
            out.name = out.name or self.name
            out.step = step
            out.seconds = out.seconds or seconds
            return out
        if not isinstance(out, dict):
            raise TypeError(
                f"evaluator {self.name!r} returned {type(out).__name__}; "
                "return a dict of metrics or an EvalResult"
            )
        return EvalResult(self.name, _floats(out), step=step, seconds=seconds)


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            value = value.item()
        out[str(key)] = float(value) if value is not None else math.nan
    return out
