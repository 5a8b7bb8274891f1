"""Learning-rate schedulers in the loop: when each one steps, and with which metric.

``TrainingLoop(scheduler=...)`` takes one scheduler, a list of them, or `Schedule` wrappers
that say when each steps:

- a plain scheduler (``StepLR``, ``OneCycleLR``, ``LambdaLR``...) steps after each optimizer
  step, as ``Schedule(sched, every="step")``; ``Schedule(sched, every="epoch")`` steps it
  after each epoch's last optimizer step instead, where a script's ``scheduler.step()`` at
  the end of its epoch loop would (the evals and the save due at that step come after, so a
  checkpoint holds the stepped scheduler);
- a scheduler whose ``step`` needs a value (``ReduceLROnPlateau``) names the metric that
  drives it: ``Schedule(sched, metric="val/loss")``. An eval's metric (``<eval>/<key>``)
  steps it right after each eval that measured it, so it never sees a stale value; a step
  metric (``loss``, a key the loss function returns) steps it after each step, or with
  ``every="epoch"`` with the value of the epoch's last step.

A scheduler steps after the optimizer step it follows, before ``on_step_end``, so ``lr`` in
a step's metrics is the rate that step used; one driven by an eval's metric steps in
``on_eval``, before the save due at that step. Every scheduler's state is saved in each
checkpoint and restored on resume (by the run handle, with the optimizers').
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lab._secrets import logger
from lab.errors import ConfigError
from lab.hooks import Callback, LoopState

log = logger("lab.loop")

__all__ = ["Schedule", "Schedules", "as_named", "as_schedules"]

_EVERY = ("step", "epoch")


@dataclass(frozen=True)
class Schedule:
    """One scheduler and when it steps: `every` ``"step"`` or ``"epoch"``, and `metric`, the
    name of the metric whose value it steps with (``ReduceLROnPlateau`` needs one).

    >>> import torch
    >>> opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    >>> sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    >>> Schedule(sched, metric="val/loss").metric
    'val/loss'
    """

    scheduler: Any
    every: Literal["step", "epoch"] = "step"
    metric: str | None = None

    def __post_init__(self) -> None:
        name = type(self.scheduler).__name__
        for method in ("step", "state_dict", "load_state_dict"):
            if not callable(getattr(self.scheduler, method, None)):
                raise ConfigError(
                    f"scheduler {name} has no {method}(): give a torch.optim.lr_scheduler "
                    "scheduler, or an object with step(), state_dict() and load_state_dict()"
                )
        if self.every not in _EVERY:
            raise ConfigError(
                f"Schedule({name}, every={self.every!r}): use every='step' or every='epoch'"
            )
        if self.metric is not None and (not isinstance(self.metric, str) or not self.metric):
            raise ConfigError(
                f"Schedule({name}, metric={self.metric!r}): name a logged metric, e.g. 'val/loss'"
            )
        needs = _steps_on_a_metric(self.scheduler)
        if needs and self.metric is None:
            raise ConfigError(
                f"{name} steps on a metric: pass Schedule(sched, metric='val/loss') "
                "(an eval's or a step's metric name) instead of the bare scheduler"
            )
        if not needs and self.metric is not None:
            raise ConfigError(
                f"Schedule({name}, metric={self.metric!r}): {name}.step() takes no metric; "
                "drop metric=, or use a scheduler that steps on one (ReduceLROnPlateau)"
            )

    @property
    def label(self) -> str:
        """How errors and the needed-names check name this schedule."""
        name = type(self.scheduler).__name__
        return f"Schedule({name}, metric={self.metric!r})" if self.metric else name


def _steps_on_a_metric(scheduler: Any) -> bool:
    """Whether `scheduler.step` needs a value: ``ReduceLROnPlateau``, or a ``step`` whose
    first parameter has no default."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return True
    try:
        params = list(inspect.signature(scheduler.step).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return bool(params) and params[0].kind in positional and params[0].default is params[0].empty


def as_schedules(given: Any) -> list[Schedule]:
    """The loop's `scheduler` argument as a list of `Schedule`: None, one scheduler or
    `Schedule`, a list or tuple of them, or a dict of named ones (in its order)."""
    if given is None:
        return []
    if isinstance(given, Mapping):
        items = list(given.values())
    else:
        items = list(given) if isinstance(given, (list, tuple)) else [given]
    return [item if isinstance(item, Schedule) else Schedule(item) for item in items]


def as_named(given: Any) -> Any:
    """The schedulers to save in checkpoints, in the form the loop was given (one, a list,
    or a dict of named ones), without their `Schedule` wrappers: the run handle names and
    saves them as it names optimizers."""

    def bare(item: Any) -> Any:
        return item.scheduler if isinstance(item, Schedule) else item

    if isinstance(given, Mapping):
        return {name: bare(item) for name, item in given.items()}
    if isinstance(given, (list, tuple)):
        return [bare(item) for item in given]
    return None if given is None else bare(given)


class Schedules(Callback):
    """The loop's schedulers, sorted once by when they step, so a step pays one short loop.

    `eval_names` are the loop's evaluators: a metric ``<eval>/<key>`` of one of them is an
    eval metric, stepped in `on_eval` right after that eval measured it (the loop attaches
    this object as a callback for that); any other name is a step metric. The metric names
    are declared in `metrics_needed`, so a typo fails before the first step. It is
    `critical`: a scheduler that raises fails the run, as it would in a script.
    """

    critical = True

    def __init__(self, items: Iterable[Schedule], eval_names: Iterable[str] = ()) -> None:
        self.items = list(items)
        evals = set(eval_names)
        self._per_step: list[Any] = []  # plain, every step
        self._per_epoch: list[Any] = []  # plain, every epoch
        self._step_metric: list[tuple[Any, str]] = []  # (scheduler, metric), every step
        self._epoch_metric: list[tuple[Any, str]] = []  # (scheduler, metric), every epoch
        self._eval_metric: dict[str, list[tuple[Any, str]]] = {}  # eval -> (scheduler, key)
        for item in self.items:
            sched, metric = item.scheduler, item.metric
            if metric is None:
                (self._per_step if item.every == "step" else self._per_epoch).append(sched)
                continue
            prefix, _, key = metric.partition("/")
            if key and prefix in evals:
                self._eval_metric.setdefault(prefix, []).append((sched, key))
            elif item.every == "step":
                self._step_metric.append((sched, metric))
            else:
                self._epoch_metric.append((sched, metric))
        self._warned: set[str] = set()
        #: {metric name: who needs it}, for the needed-names check before the first step.
        self.metrics_needed = {
            item.metric: item.label for item in self.items if item.metric is not None
        }

    def __bool__(self) -> bool:
        return bool(self.items)

    def step_metrics_read(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The step metrics the schedulers read after every step, and after an epoch's
        last step (those of every step too): the loop reads them on the host before
        `after_step`, which makes those steps wait for the device."""
        every = tuple(dict.fromkeys(metric for _, metric in self._step_metric))
        at_end = tuple(dict.fromkeys([*every, *(metric for _, metric in self._epoch_metric)]))
        return every, at_end

    def after_step(self, metrics: Mapping[str, Any]) -> None:
        """Step the per-step schedulers, after the optimizer step; the metrics a scheduler
        reads are numbers by now (the others may be tensors still on their device)."""
        for sched in self._per_step:
            sched.step()
        for sched, metric in self._step_metric:
            self._step_with(sched, metric, metrics)

    def on_eval(
        self, state: LoopState, step_idx: int, eval_name: str, metrics: Mapping[str, float]
    ) -> None:
        """Step the schedulers driven by a metric of eval `eval_name`, just measured."""
        for sched, key in self._eval_metric.get(eval_name, ()):
            self._step_with(sched, f"{eval_name}/{key}", metrics, key)

    def after_epoch(self, metrics: Mapping[str, Any]) -> None:
        """Step the per-epoch schedulers after an epoch's last optimizer step; `metrics` are
        that step's."""
        for sched in self._per_epoch:
            sched.step()
        for sched, metric in self._epoch_metric:
            self._step_with(sched, metric, metrics)

    def _step_with(
        self, sched: Any, metric: str, metrics: Mapping[str, Any], key: str | None = None
    ) -> None:
        value = metrics.get(metric if key is None else key)
        if value is None:  # not logged this time: the scheduler waits for a fresh value
            if metric not in self._warned:
                self._warned.add(metric)
                log.warning(
                    "%s was not stepped: no %r was logged (logged: %s)",
                    type(sched).__name__, metric, ", ".join(sorted(metrics)) or "nothing",
                )  # fmt: skip
            return
        sched.step(value)
