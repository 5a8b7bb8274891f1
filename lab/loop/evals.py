"""Evaluators: named evaluations that run inside the loop or after training.

An evaluator scores the model and returns a dict of metrics, or an `EvalResult` that also
carries per-slice breakdowns, tags and per-example predictions (a benchmark). Inside the
loop `on_eval` fires for every eval that succeeded, and `on_benchmark_eval` too when the
result carries more than metrics; after training (``Experiment(benchmarks=[...])``) only
`on_benchmark_eval` fires, with ``step=None``. An evaluator that raises becomes an
`EvalResult` whose `error` says why, reported through `on_benchmark_eval`; training goes on.

An eval function takes the model, ``fn(model)``, or the model and an `EvalContext`,
``fn(model, ctx)``: the device the loop trains on, the loop's state (its step, epoch and
metrics; None after training) and the step, so a function need not read the device from the
parameters or close over the loop.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lab._names import MAX_KEY, check_name
from lab.errors import ConfigError
from lab.records import EvalResult

if TYPE_CHECKING:
    from lab.hooks import LoopState


@dataclass(frozen=True)
class EvalContext:
    """What an eval function ``fn(model, ctx)`` gets beside the model.

    `device` is the device the loop trains on (None: the loop does not move anything, so
    read it from the model if you need it), `state` the loop's `LoopState` (None for a
    benchmark after training), and `step` the optimizer step being scored (0: before the
    first step; None: after training).
    """

    model: torch.nn.Module
    device: torch.device | None
    state: LoopState | None
    step: int | None


EvalFn = Callable[..., "dict[str, float] | EvalResult"]


def _takes_context(fn: Callable[..., Any]) -> bool:
    """Whether `fn` has a second positional parameter without a default (or ``*args``).

    A second parameter that has a default is left alone: ``def val(model, data=val_data)``
    is the closure idiom, and must keep getting its own default.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.kind in positional and p.default is p.empty]
    return len(required) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


class Evaluator:
    """Runs `fn(model)` or `fn(model, ctx)` in eval mode under `torch.no_grad()` at chosen steps.

    `fn` returns a dict of metrics, or an `EvalResult` when it also has breakdowns or
    per-example predictions (a benchmark). A function with a second parameter (without a
    default) gets an `EvalContext`: the device, the loop state and the step. Choose when with
    `every` (each N steps), `every_epochs` (after each N-th epoch's last step, in a loop that
    knows its epoch length: ``TrainingLoop(num_epochs=...)``, or data with a ``len``),
    `at_steps` (fixed steps), `at_start` (before the first step, as step 0; so does
    ``0 in at_steps``) and `at_end`. Passed to ``Experiment(benchmarks=[...])`` it runs once
    per run, after training, and the `when` arguments are not used. `metrics` names the keys
    `fn` returns, when they are known: a name needed from it (``"val/loss"`` for
    `EarlyStopping` or a checkpoint's metric) is then checked before the first step, and a
    typo is an error rather than a metric that never shows up.

    >>> Evaluator("val", lambda model: {"loss": 0.5}, every=50).due(100, num_steps=200)
    True
    """

    def __init__(
        self,
        name: str,
        fn: EvalFn,
        *,
        every: int | None = None,
        every_epochs: int | None = None,
        at_steps: Iterable[int] = (),
        at_start: bool = False,
        at_end: bool = False,
        metrics: Iterable[str] | None = None,
    ) -> None:
        if not name or not isinstance(name, str):
            raise ConfigError("Evaluator needs a non-empty name, e.g. Evaluator('val', fn)")
        check_name("eval", name, MAX_KEY)
        if not callable(fn):
            raise ConfigError(f"Evaluator {name!r}: fn must be a function fn(model) -> dict")
        for what, value in (("every", every), ("every_epochs", every_epochs)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ConfigError(
                    f"Evaluator {name!r}: {what}={value!r} must be an int >= 1 or None"
                )
            if value is not None and value < 1:
                raise ConfigError(f"Evaluator {name!r}: {what}={value} must be >= 1 or None")
        self.name = name
        self.fn = fn
        self.every = every
        self.every_epochs = every_epochs
        self.takes_context = _takes_context(fn)
        self.at_steps = frozenset(int(s) for s in at_steps)
        if any(s < 0 for s in self.at_steps):
            raise ConfigError(f"Evaluator {name!r}: at_steps must be steps >= 0")
        self.at_start = at_start or 0 in self.at_steps
        self.at_end = at_end
        if isinstance(metrics, str):
            raise ConfigError(
                f"Evaluator {name!r}: metrics={metrics!r}; give a list of keys, e.g. ['loss']"
            )
        self.metrics: tuple[str, ...] | None = tuple(metrics) if metrics is not None else None

    def due(self, step: int, *, num_steps: int, epoch_end: int | None = None) -> bool:
        """Whether this evaluator runs after step `step` (1..num_steps; step 0 is
        `at_start`, which the loop checks before the first step).

        `epoch_end` is the number of epochs completed when `step` is an epoch's last step
        (1 after the first epoch), else None: `every_epochs` counts those.
        """
        if self.every is not None and step % self.every == 0:
            return True
        every_epochs = self.every_epochs
        if every_epochs is not None and epoch_end is not None and epoch_end % every_epochs == 0:
            return True
        return step in self.at_steps or (self.at_end and step == num_steps)

    def run(
        self,
        model: torch.nn.Module,
        step: int | None,
        *,
        state: LoopState | None = None,
        device: torch.device | None = None,
    ) -> EvalResult:
        """Score `model` now, restoring its train/eval mode afterwards.

        A function that takes a context gets ``EvalContext(model, device, state, step)``;
        post-training benchmarks pass no state. Returns the result with `step` and `seconds`
        (the wall time of `fn`) filled in, its metrics as floats; raises what `fn` raised, or
        a `TypeError` for a result that the store could not hold, so the caller records a
        failed eval instead of a bad row.
        """
        was_training = model.training
        model.eval()
        start = time.perf_counter()
        try:
            with torch.no_grad():
                if self.takes_context:
                    out = self.fn(model, EvalContext(model, device, state, step))
                else:
                    out = self.fn(model)
        finally:
            model.train(was_training)
        seconds = time.perf_counter() - start
        if isinstance(out, EvalResult):
            out.name = out.name or self.name
            out.step = step
            out.seconds = out.seconds or seconds
            out.metrics = _floats(out.metrics, self.name, "metrics")
            out.breakdowns = _breakdowns(out.breakdowns, self.name)
            out.predictions = _predictions(out.predictions, self.name)
            return out
        if not isinstance(out, dict):
            raise TypeError(
                f"evaluator {self.name!r} returned {type(out).__name__}; "
                "return a dict of metrics or an EvalResult"
            )
        return EvalResult(self.name, _floats(out, self.name, "metrics"), step=step, seconds=seconds)


def _floats(metrics: Any, name: str, what: str) -> dict[str, float]:
    """Metrics as `{str: float}`; tensors become numbers, None becomes NaN."""
    if not isinstance(metrics, dict):
        raise TypeError(
            f"evaluator {name!r}: {what} is a {type(metrics).__name__}; give a dict of numbers"
        )
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            value = value.item()
        try:
            out[str(key)] = float(value) if value is not None else math.nan
        except (TypeError, ValueError):
            raise TypeError(
                f"evaluator {name!r}: {what}[{key!r}] is {value!r} "
                f"({type(value).__name__}); give a number"
            ) from None
    return out


def _breakdowns(breakdowns: Any, name: str) -> dict[str, dict[str, float]]:
    """Breakdowns as `{slice: {metric: float}}`."""
    if not isinstance(breakdowns, dict):
        raise TypeError(
            f"evaluator {name!r}: breakdowns is a {type(breakdowns).__name__}; "
            "give {slice: {metric: value}}"
        )
    return {str(s): _floats(m, name, f"breakdowns[{s!r}]") for s, m in breakdowns.items()}


def _predictions(predictions: Any, name: str) -> list[dict[str, Any]]:
    """Predictions checked before they reach a sink: dicts whose score is a number or None.

    A score that is not a number would fail the store's insert, and with it the run; here
    it fails the eval alone. Tensor scores become floats.
    """
    if not isinstance(predictions, list):
        predictions = list(predictions)
    for i, pred in enumerate(predictions):
        if not isinstance(pred, dict):
            raise TypeError(
                f"evaluator {name!r}: prediction {i} is a {type(pred).__name__}; give a dict "
                "with example_id, input, output, target, score (others go to extras)"
            )
        score = pred.get("score")
        if score is None or isinstance(score, float):
            continue
        if isinstance(score, torch.Tensor) and score.numel() == 1:
            pred["score"] = score.item()
        elif isinstance(score, (int, bool)) or hasattr(score, "__float__"):
            pred["score"] = float(score)
        else:
            raise TypeError(
                f"evaluator {name!r}: prediction {i} has score {score!r} "
                f"({type(score).__name__}); give a number or None"
            )
    return predictions
