"""How a run's loop runs: one settings record for `RunHandle`, `TrainingLoop` and `OnPolicyLoop`.

Each of the three takes the same keywords (`num_steps`, `checkpoint`, `evaluators`,
`callbacks`, `device`, `resume`, `log_every`...). They are checked once, here, into a
`LoopSettings`; a loop keeps its own and hands the run handle a copy with what only a fit
knows (the run folder, whether to resume, the metric names it logs)::

    handle = RunHandle.from_settings(run, model, optimizer, replace(settings, resume=False))

A loop keeps its settings as `loop_settings`, and its attributes of the same names read and
write them (`Setting`), so ``loop.checkpoint = None`` before `fit` still changes the fit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lab._distributed import check_reductions, init_from_launcher, rank_and_world
from lab.errors import ConfigError
from lab.hooks import Callback, LogContext, LoopState
from lab.loop.checkpoints import CheckpointConfig
from lab.loop.evals import Evaluator
from lab.loop.steps import check_no_epoch_settings, positive_int

__all__ = ["LoopSettings", "Setting", "named"]


@dataclass
class LoopSettings:
    """What a loop's run is given besides the model and its optimizers.

    `num_steps` is the number of optimizer steps (None: the loop decides when to stop);
    `scheduler`, `scaler` and `stateful` are saved in each checkpoint and restored on resume;
    `checkpoint` says when to save and what to keep; `evaluators` and `callbacks` run in the
    loop; `device` is where it trains (None: as the model is); `resume` is True (the newest
    checkpoint), False (a fresh start) or a checkpoint path or step; `run_dir` holds the
    checkpoints of a run outside an Experiment; `metrics` names the step metrics the loop logs
    (`more_metrics`: and others besides); `steps_per_epoch` is the length of every epoch when
    all have one; `reduce` says how a metric is reduced across ranks; `log_every` how many
    steps pass between two reads of the step metrics (see `lab.loop.metric_buffer`).
    Building one checks each value and says in one line what is wrong.
    """

    num_steps: int | None = None
    scheduler: Any = None
    scaler: torch.amp.GradScaler | None = None
    checkpoint: CheckpointConfig | None = None
    evaluators: Sequence[Evaluator] = ()
    callbacks: Sequence[Callback] = ()
    device: str | torch.device | None = None
    resume: bool | str | Path | int = True
    run_dir: str | Path | None = None
    metrics: Sequence[str] | None = None
    more_metrics: bool = False
    stateful: Mapping[str, Any] | None = None
    steps_per_epoch: int | None = None
    reduce: Mapping[str, str] | None = field(default=None)
    log_every: int = 1

    def __post_init__(self) -> None:
        if not positive_int(self.log_every):
            raise ConfigError(
                f"log_every={self.log_every!r}: give how many steps pass between two "
                "materialisations of the step metrics, an int >= 1 (1: every step)"
            )
        names = [ev.name for ev in self.evaluators]
        if len(set(names)) != len(names):
            raise ConfigError(f"evaluator names must be unique, got {names}")
        if isinstance(self.metrics, str):
            raise ConfigError(
                f"metrics={self.metrics!r}: give a list of keys, e.g. ['loss', 'acc']"
            )
        if self.steps_per_epoch is not None and not positive_int(self.steps_per_epoch):
            raise ConfigError(
                f"steps_per_epoch={self.steps_per_epoch!r}: give the steps per epoch, an int >= 1"
            )
        self.evaluators = list(self.evaluators)
        self.callbacks = list(self.callbacks)
        if self.device is not None:
            self.device = torch.device(self.device)
        self.reduce = check_reductions(self.reduce)
        self.stateful = dict(self.stateful or {})

    @property
    def declared(self) -> tuple[str, ...] | None:
        """The step metric names the loop declared, or None when it declared none."""
        return tuple(self.metrics) if self.metrics is not None else None

    @property
    def open(self) -> bool:
        """Whether the loop may log step metrics it did not declare."""
        return self.metrics is None or self.more_metrics

    def new_state(
        self, ctx: LogContext, model: torch.nn.Module, optimizers: dict[str, Any]
    ) -> LoopState:
        """A run's `LoopState`, once its model is on the settings' device and the process
        group of a bare fit under torchrun is made (an Experiment has made its own)."""
        if self.device is not None:
            model.to(self.device)
        first = next(iter(optimizers.values()), None)
        init_from_launcher()
        rank, world = rank_and_world()
        return LoopState(
            ctx=ctx, model=model, num_steps=self.num_steps or 0, rank=rank, world_size=world,
            optimizer=first,  # None for a handle given no optimizer (an RL loop may step its own)
        )  # fmt: skip

    def for_run(self, optimizer: Any) -> dict[str, Any]:
        """Check what a run handle is given (the settings may have changed since they were
        built: ``loop.checkpoint = ...``) and return its optimizers by name: each must be
        a torch optimizer, as each is saved and restored."""
        checkpoint = self.checkpoint
        if checkpoint is not None and not isinstance(checkpoint, CheckpointConfig):
            raise ConfigError(
                f"checkpoint={checkpoint!r}: pass a CheckpointConfig(...), or None for no saves"
            )
        optimizers = named("optimizer", optimizer)
        for name, opt in optimizers.items():
            if not (hasattr(opt, "param_groups") and callable(getattr(opt, "state_dict", None))):
                raise ConfigError(
                    f"optimizer {name!r} is a {type(opt).__name__}; pass a torch optimizer, a "
                    "list of them, or a dict of named ones"
                )
        for name, obj in (self.stateful or {}).items():
            if not (callable(getattr(obj, "state_dict", None)) and hasattr(obj, "load_state_dict")):
                raise ConfigError(
                    f"stateful[{name!r}] is a {type(obj).__name__} without state_dict() and "
                    "load_state_dict(); keep plain values in loop.user_state instead"
                )
        if self.steps_per_epoch is None:  # an every_epochs evaluator would never run
            check_no_epoch_settings((), self.evaluators)
        if self.run_dir is not None:
            self.run_dir = Path(self.run_dir)
        return optimizers


class Setting:
    """An attribute of a loop that reads and writes the field of the same name of its
    `loop_settings`: the loop's public attributes stay what they were, one record behind."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj.loop_settings, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.loop_settings, self.name, value)


def named(what: str, value: Any) -> dict[str, Any]:
    """One object, a list, or a name -> object mapping, as a name -> object dict."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        out = dict(value)
        for name in out:
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{what} names must be non-empty strings, got {name!r}")
        return out
    if isinstance(value, (list, tuple)):
        return {str(i): item for i, item in enumerate(value)}
    return {what: value}
