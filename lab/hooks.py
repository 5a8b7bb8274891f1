"""Hooks: the `Callback` base class and the context objects it receives.

How a hook reaches the callbacks (order, failures, strict mode) is `lab.dispatch`.

The lifecycle, with every hook in the place it fires::

    Experiment.run():
        on_experiment_start(ctx)
        for each group (an arm's repeats):
            on_group_start(ctx, group_name)
            for each run of the group:
                on_run_start(ctx)                        # ctx.run_config is set
                train(run) -> TrainingLoop.fit(run), a RunHandle, a plug-in's loop:
                    [post_checkpoint_loaded(state, path)] # only when resuming a checkpoint
                    on_train_start(state)
                    [evals with at_start, at step_idx 0: the eval hooks below]
                    [on_epoch_start(state, epoch)]       # when the loop counts epochs
                                                         # (again for an epoch resumed
                                                         # mid-way)
                    <hooks registered after on_epoch_start>
                    each step:
                        pre_step(state, step_idx, batch) # once per optimizer step, before
                                                         # its first micro-batch
                        forward, backward, optimizer step # (accumulate=k: k forwards and
                                                          # backwards, then one step)
                        on_step_end(state, step_idx, batch, metrics)
                        [on_media(state, step_idx, media)] # histograms, images logged
                        in-loop evals:  on_eval(state, step_idx, eval_name, metrics)
                                        on_benchmark_eval(ctx, eval_result, predictions,
                                                          step=step_idx)
                        each save:      on_checkpoint(state, row)
                                        # (a save due only as an ephemeral one is
                                        # skipped while a callback blocks those)
                    <hooks registered after on_checkpoint>
                    [on_epoch_end(state, epoch)]         # after the epoch's last step,
                                                         # its evals and saves
                    on_train_end(state, artifacts)
                post-training benchmarks:
                    on_benchmark_eval(ctx, eval_result, predictions, step=None)
                [on_error(ctx, exc)]                     # only when the run raised
                on_run_end(ctx, run_result, arm)
        on_experiment_end(ctx, result)
        close()

A bare `TrainingLoop.fit()` or ``RunHandle(None, ...)`` (no Experiment) fires this whole
list too, for an experiment of its own (`lab.loop.bare`): ``ctx.experiment`` is
``loop-<UTC time>-<hex6>``, one group ``"loop"``, one run whose key is `run_dir`'s name (else
``"loop"``, with no folder of its own: ``ctx.run_dir`` is None, ``ctx.folder`` the working
directory), no arm, repeat 0, not seeded.

With ``Experiment(executor="processes")`` the experiment-level hooks
(`on_experiment_start`, `on_group_start`, `on_experiment_end`, `close`) fire in the parent
process, and everything from `on_run_start` to `on_run_end` fires in the run's worker
process, on pickled copies of the callbacks, which then get a `close()` of their own there.
A callback whose class sets `run_end_in_parent` also gets `on_run_end` in the parent, as
each run's result arrives there (a display that counts the runs done).

`HOOKS` below is the same list in order; a test keeps it equal to the methods of `Callback`.
A plug-in adds hooks of its own with `register_hooks`: they join `HOOKS` after the hook it
names, `Callback` gets their methods, and their part of the lifecycle above takes the place
of the marker ``<hooks registered after NAME>``. The on-policy RL loop registers its eight
(`lab.rl.hooks`) when `lab` is imported, so they are always in place.

Order, in every hook: by phase (`Phase`), produce -> record -> attach -> mirror -> act ->
report -> notify -> trace, and inside a phase in the order the callbacks were attached. A
callback names its phase (``phase = Phase.REPORT``); one that names none acts (`Phase.ACT`),
or produces when it declares the step metrics it adds (`Callback.metrics_logged`). The
produce phase runs first in `on_step_end` alone (elsewhere it acts): so a monitor that adds
``throughput/steps_per_s`` to the step's `metrics` reaches the SQL logger, the console and
early stopping, which all consume the step whole. A producer may add only numbers: a tensor
or another non-number it adds is refused (see `lab.dispatch.Dispatcher`). A callback that
still sets a `priority` number (higher first) is placed by it among the phases, whose numbers
`PHASE_PRIORITY` keeps (record 100, attach 50, mirror 10, act 0, report -10, notify -50,
trace -100), so code written for numbers keeps its order.

Inside a run trained on several ranks (DDP, under ``torchrun`` or
``Experiment(processes_per_run=N)``) every rank fires the hooks above, with `state.rank` and
`state.world_size` set and each step's metrics already reduced across ranks (the mean, or the
reduction a metric names); a callback whose class sets `rank_zero_only` gets them on rank 0
alone, so the experiment, group and run rows are written once.

With ``TrainingLoop(log_every=N)`` (or ``RunHandle(log_every=N)``) `pre_step` still fires
live, but a step whose metrics are held on the device gets its `on_step_end` at the next
materialisation: every N steps, at the last step, and before an eval, a save, an epoch's
end, a stop, the end of the fit or `on_error`. The held steps' `on_step_end` fire there in
step order, each with its own `step_idx`, `state.step` and metrics (`batch.data` is None
for them), then the materialising step's hooks as above. A callback that must see each
step live (the model, the gradients, the clock) sets `Callback.live_steps`.

`step_idx` is the number of the optimizer step: steps are numbered 1..num_steps, and
`state.step` counts the steps completed, so after `on_step_end(state, 7, ...)` the state
holds `step == 7`, and a metric logged there is stored at step 7.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import EnumType, IntEnum, StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from lab.records import (
        ArmResult,
        EvalResult,
        ExperimentResult,
        LogContext,
        LoopArtifacts,
        ManifestRow,
        Media,
        RunResult,
        TrainingBatch,
    )


class HookEnum(StrEnum):
    """The base of every enum of hooks: `Hook` (the core's), and each a plug-in registers
    (`register_hooks`). A member's value is the name of the `Callback` method it calls."""


class _Registered(EnumType):
    """`Hook`'s type: iterating `Hook` walks `HOOKS`, every hook in lifecycle order, the
    registered ones among the core's, so that code which walks the hooks sees them all."""

    def __iter__(cls) -> Iterator[Any]:
        registered = globals().get("HOOKS")  # None while `Hook` itself is being made
        return super().__iter__() if registered is None else iter(registered)

    def __reversed__(cls) -> Iterator[Any]:
        return reversed(tuple(iter(cls)))

    def __len__(cls) -> int:
        return len(tuple(iter(cls)))

    def __contains__(cls, member: object) -> bool:
        return member in tuple(iter(cls))


class Hook(HookEnum, metaclass=_Registered):
    """The core's hooks, in the order of the lifecycle above: a member's value is the name of
    the `Callback` method it calls (a test keeps the two equal). A dispatcher is told which
    hook to fire by a member (``hooks.fire(Hook.STEP_END, state, step_idx, batch, metrics)``).

    Iterating `Hook` gives every hook, those a plug-in registered included (`HOOKS`); the
    members of `Hook` itself are the core's alone.
    """

    EXPERIMENT_START = "on_experiment_start"
    GROUP_START = "on_group_start"
    RUN_START = "on_run_start"
    POST_CHECKPOINT_LOADED = "post_checkpoint_loaded"
    TRAIN_START = "on_train_start"
    EPOCH_START = "on_epoch_start"
    PRE_STEP = "pre_step"
    STEP_END = "on_step_end"
    MEDIA = "on_media"
    EVAL = "on_eval"
    BENCHMARK_EVAL = "on_benchmark_eval"
    CHECKPOINT = "on_checkpoint"
    EPOCH_END = "on_epoch_end"
    TRAIN_END = "on_train_end"
    ERROR = "on_error"
    RUN_END = "on_run_end"
    EXPERIMENT_END = "on_experiment_end"
    CLOSE = "close"


#: Every hook, in the order of the lifecycle above (equal to their names as strings): the
#: core's, and those a plug-in registered (`register_hooks`) after the hook it named.
HOOKS: tuple[HookEnum, ...] = tuple(Hook.__members__.values())

#: The hooks that end what a callback started: a callback disabled for failing too often
#: still gets these, so that it can release what it holds (a profiler it started, the
#: garbage collector it turned off, a wandb run it opened) and record how the run ended.
ENDING_HOOKS: frozenset[Hook] = frozenset(
    {Hook.TRAIN_END, Hook.ERROR, Hook.RUN_END, Hook.EXPERIMENT_END, Hook.CLOSE}
)

#: The hooks of the experiment around its runs, which fire outside any run.
EXPERIMENT_HOOKS: frozenset[Hook] = frozenset(
    {Hook.EXPERIMENT_START, Hook.GROUP_START, Hook.EXPERIMENT_END, Hook.CLOSE}
)

#: The hooks of one run, from `on_run_start` to `on_run_end`: every hook but the experiment's.
RUN_HOOKS: frozenset[HookEnum] = frozenset(HOOKS) - EXPERIMENT_HOOKS


def register_hooks(
    hooks: Sequence[HookEnum], *, after: HookEnum, methods: type, lifecycle: str
) -> None:
    """Add a plug-in's `hooks` to the lifecycle, in their order, right after the hook `after`.

    Why: the core fires and documents its own hooks, and knows no plug-in's; a plug-in (the
    on-policy RL loop, `lab.rl.hooks`) brings its hooks here so that dispatchers, the failure
    policy and `Callback` treat them as any other. `Callback` gets each hook's default method
    from the class `methods` (a method of the hook's name that does nothing), and `lifecycle`
    (the hooks in the place they fire, flush left) replaces the marker line
    ``<hooks registered after NAME>`` in this module's docstring, indented as it is.
    A dispatcher built afterwards listens to them; register before building any.
    """
    global HOOKS, RUN_HOOKS
    known = set(HOOKS)
    for hook in hooks:
        if hook in known:
            raise ValueError(f"{hook!r} is a hook already; give each hook one name of its own")
        if not callable(vars(methods).get(hook.value)):
            raise ValueError(f"{methods.__name__} has no method {hook.value}; define one")
    if after not in known:
        raise ValueError(f"{after!r} is not a hook; name the hook yours follow")
    _splice(f"<hooks registered after {after.value}>", lifecycle)
    at = HOOKS.index(after) + 1
    HOOKS = (*HOOKS[:at], *hooks, *HOOKS[at:])
    RUN_HOOKS = frozenset(HOOKS) - EXPERIMENT_HOOKS
    for hook in hooks:
        setattr(Callback, hook.value, vars(methods)[hook.value])


def _splice(marker: str, text: str) -> None:
    """Put `text` in place of the docstring line that holds `marker`, at its indentation."""
    doc = globals()["__doc__"]
    if doc is None:  # python -OO: no docstrings to keep in step
        return
    lines = doc.split("\n")
    at = next((i for i, line in enumerate(lines) if line.strip() == marker), None)
    if at is None:
        raise ValueError(f"lab.hooks' lifecycle has no line {marker}; add one where they fire")
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    lines[at : at + 1] = [indent + line if line else line for line in text.strip("\n").split("\n")]
    globals()["__doc__"] = "\n".join(lines)


class Phase(IntEnum):
    """Where a callback runs among the others, in every hook: the phases in this order, and
    inside a phase the order the callbacks were attached in (as Lightning keeps list order).

    A callback names its phase with ``phase = Phase.REPORT``; left None, it is `ACT`, or
    `PRODUCE` when it declares the step metrics it adds (`Callback.metrics_logged`).
    """

    #: Adds numbers to a step's metrics (a monitor): its `on_step_end` runs before every
    #: other phase's, so the store and every consumer see the step whole. In the other
    #: hooks it runs with `ACT`.
    PRODUCE = 0
    #: Writes the experiment's rows into the store (`lab.loggers.SqlLogger`): the ids and
    #: checkpoint rows the later phases read are there.
    RECORD = 1
    #: Adds files to what was recorded (`lab.callbacks.files.ConfigSaver` writes the config
    #: into each saved checkpoint folder).
    ATTACH = 2
    #: Copies what was recorded to another tracker (`lab.loggers.WandbLogger`).
    MIRROR = 3
    #: Reads what happened and acts on training: early stopping, schedules, a user's
    #: callback (the default).
    ACT = 4
    #: Shows progress to a person (`lab.loggers.ConsoleLogger`): the run-end line can name
    #: the ids that the earlier phases created.
    REPORT = 5
    #: Tells someone elsewhere (`lab.callbacks.notify.Notifier`'s webhooks).
    NOTIFY = 6
    #: Logs each hook as the others left it (`lab.loggers.JsonlLogger`).
    TRACE = 7


#: The `Callback.priority` each phase stands for: a callback that still sets a priority
#: number (higher first) is placed by it among the phases, as it was before phases.
PHASE_PRIORITY: Mapping[Phase, int] = MappingProxyType(
    {
        Phase.PRODUCE: 0,
        Phase.RECORD: 100,
        Phase.ATTACH: 50,
        Phase.MIRROR: 10,
        Phase.ACT: 0,
        Phase.REPORT: -10,
        Phase.NOTIFY: -50,
        Phase.TRACE: -100,
    }
)


def phase_of(callback: object) -> Phase:
    """The phase `callback` runs in: the one its class (or it) names, else `Phase.PRODUCE`
    for a producer of step metrics, else `Phase.ACT`."""
    phase = getattr(callback, "phase", None)
    if phase is not None:
        return Phase(phase)
    return Phase.PRODUCE if getattr(callback, "metrics_logged", ()) else Phase.ACT


def priority_of(callback: object) -> int:
    """The number `callback` is ordered by (higher first, ties in attachment order): the
    `priority` it sets, when it sets one, else its phase's (`PHASE_PRIORITY`)."""
    if "priority" in getattr(callback, "__dict__", {}):
        return int(callback.priority)  # type: ignore[attr-defined]  # in its __dict__
    for klass in type(callback).__mro__:
        if klass.__name__ == "Callback" and klass.__module__ == __name__:
            break
        if "priority" in vars(klass):
            return int(klass.priority)  # type: ignore[attr-defined]  # in vars(klass)
    return PHASE_PRIORITY[phase_of(callback)]


#: `LogContext.extras` an Experiment sets before `on_experiment_start`, for a display that
#: counts runs: how many runs it holds (stages included), how many an earlier attempt
#: finished (they are skipped now, with no hooks), and its executor ("serial" or
#: "processes", where `on_run_end` fires in the workers, not here).
RUNS, FINISHED_BEFORE, EXECUTOR = "lab:runs", "lab:finished_before", "lab:executor"
#: `LogContext.extras` holding the experiment's tags (a list) and notes (a str or None), as
#: ``Experiment(tags=..., notes=...)`` gave them; a sink records them with the experiment.
TAGS, NOTES = "lab:tags", "lab:notes"
#: `LogContext.extras` holding the config a framework reported for the current run (a
#: LightningModule's hparams) when the run's own config is an arm's: a sink records it with
#: the run's provenance, as ``"framework_config"``, when the run ends.
FRAMEWORK_CONFIG = "lab:framework_config"


@dataclass(eq=False)
class LoopState:
    """The training loop's progress, handed to every loop hook.

    `step` counts completed optimizer steps; `epoch` and `batch_in_epoch` are the data
    position. A callback ends training cleanly after the current step with `request_stop()`.

    A callback that holds something only a full run of steps makes whole (a model average
    over a window of steps: `lab.callbacks.averaging.ModelAverager`) calls
    `block_ephemeral_checkpoints(self)` while it does, and `unblock_ephemeral_checkpoints(self)`
    after, as OLMo-core's callbacks do. While any owner blocks, the loop skips the saves that
    are due only as ephemeral saves (`CheckpointConfig.is_ephemeral`); regular, fixed, start
    and end saves still happen, and `checkpoint_due` says False for a skipped one. Why: an
    ephemeral save inside the window would carry the partial window (a second copy of the
    weights) only to be deleted by the next save, and without one the run resumes from a save
    before the window, so the full window is always re-accumulated on resume. The loop reads
    the block when a step ends, before `on_step_end`: one set emptiness test per step. The
    blockers live only as long as this state (one fit); a callback re-blocks in
    `on_train_start` after a resume.
    """

    ctx: LogContext
    model: torch.nn.Module
    #: The run's first optimizer; None when the loop was given none (an RL loop may step
    #: its own) and in a replay (`lab.loggers.jsonl.replay`).
    optimizer: torch.optim.Optimizer | None
    num_steps: int
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    stop_requested: bool = False
    stop_reason: str | None = None
    #: Set when the stop is a pruning rule's (`lab.sweeps.Prune`): ``{"step", "rule",
    #: "metric", "value"}``; the run then ends `pruned` instead of `stopped`.
    pruned: dict[str, Any] | None = None
    # True from on_step_end of a step that a scheduled checkpoint follows: a sink that
    # buffers flushes there, so every metric up to a committed checkpoint is durable.
    checkpoint_due: bool = False
    # The in-loop eval being reported, while on_eval fires (its wall time, tags); else None.
    current_eval: EvalResult | None = None
    #: This process's rank among the run's ranks (0 without DDP), and how many there are:
    #: every rank fires the loop's hooks, with the step's metrics reduced across them.
    rank: int = 0
    world_size: int = 1
    # The owners that block ephemeral saves now (see the class docstring); empty: none.
    _ephemeral_blockers: set[object] = field(default_factory=set, init=False, repr=False)

    def request_stop(
        self, reason: str = "requested by a callback", *, pruned: dict[str, Any] | None = None
    ) -> None:
        """Stop after the current step: final checkpoint, `on_train_end`, run `stopped`.

        With `pruned` (a pruning rule's decision: ``{"step": int, "rule": str, "metric":
        str, "value": float}``) the run ends `pruned` and records where and why instead.
        """
        self.stop_requested = True
        self.stop_reason = reason
        if pruned is not None:
            self.pruned = dict(pruned)

    def block_ephemeral_checkpoints(self, owner: object) -> None:
        """Skip ephemeral saves until `owner` unblocks (any number of owners may block).

        Takes effect from the next step's save on: the loop reads it when a step ends,
        before `on_step_end`. `owner` is any hashable object, usually the callback itself;
        blocking twice with the same owner is one block.
        """
        self._ephemeral_blockers.add(owner)

    def unblock_ephemeral_checkpoints(self, owner: object) -> None:
        """Let ephemeral saves happen again once no other owner blocks them; a no-op for an
        owner that does not block."""
        self._ephemeral_blockers.discard(owner)

    @property
    def ephemeral_checkpoints_blocked(self) -> bool:
        """Whether some owner blocks ephemeral saves now."""
        return bool(self._ephemeral_blockers)

    def state_dict(self) -> dict[str, Any]:
        """The progress a checkpoint must keep to resume the same trajectory."""
        return {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the progress saved by `state_dict`."""
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])


class Callback:
    """Override any hook; the defaults do nothing and cost nothing.

    Hooks are positional and typed, one method per moment of the lifecycle (see the module
    docstring). Callbacks run by `phase`, and in the order they were attached inside a phase;
    in `on_step_end`, the producers of step metrics (`metrics_logged`) run before all the
    others (see the module docstring). A callback that raises is logged and counted, and
    the run goes on, unless strict mode is on, or the callback is `critical`: then its exception
    propagates as it is and fails the run, in `on_run_start` and `on_run_end` as in the loop's
    hooks, and the experiment's other runs go on (`SqlLogger` is critical: a run it cannot
    record must not look recorded). It propagates once the callbacks after it have had the same
    hook, so that a run end one sink could not record still ends the run for the others. A
    critical callback whose `on_run_start` raised has not started the run: it gets none of that
    run's other hooks. `on_error` stays isolated even then, so it never hides the error that
    fired it.

    A best-effort (not critical) callback that fails `max_failures` times in a row (no
    successful call of any of its hooks in between) is disabled for the rest of the run, so
    a broken sink stops costing a traceback per step. Disabled, it still gets the hooks that
    end what it started (`ENDING_HOOKS`: `on_train_end`, `on_error`, `on_run_end`,
    `on_experiment_end`, `close`), so a profiler is stopped, the garbage collector turned
    back on and a wandb run finished; a failure there is recorded like any other and never
    enables it again. It gets every hook again from the next run on. None never disables
    it. A callback with `state_dict()`/`load_state_dict()` is saved in each checkpoint and
    restored when the run resumes from it.
    """

    #: Where it runs among the others (see `Phase`); None: `Phase.ACT`, or `Phase.PRODUCE`
    #: when it declares `metrics_logged`.
    phase: ClassVar[Phase | None] = None
    #: The number it was ordered by before phases (higher first). Still honoured when a
    #: callback sets it (see `priority_of`); name a `phase` instead.
    priority: ClassVar[int] = 0
    critical: bool = False
    #: Consecutive failures before the callback is disabled for the run (None: never).
    #: Left at this default, ``LAB_CALLBACK_MAX_FAILURES`` or ``Dispatcher(max_failures=)``
    #: decide; a subclass that sets its own value keeps it.
    max_failures: ClassVar[int | None] = 5
    #: The name a checkpoint keeps this callback's `state_dict` under (None: its class
    #: name, then ``#2``, ``#3``... for more of one class). Set it to keep two callbacks of
    #: one class apart across a resume that reorders them.
    state_key: str | None = None
    #: With ``executor="processes"``, also get `on_run_end` in the experiment's own process
    #: as each run's result arrives from its worker (its copy in the worker gets it too).
    #: For a display that counts runs done; a sink that records runs must leave it False.
    run_end_in_parent: ClassVar[bool] = False
    #: Inside a run trained on several ranks (DDP), get hooks on rank 0 only. Sinks that
    #: write a run's rows, files or lines set it, so a run is recorded once; a callback
    #: that reads the (reduced) metrics to act on training (early stopping, a schedule)
    #: must run on every rank, so every rank acts alike.
    rank_zero_only: ClassVar[bool] = False
    #: The keys this callback adds to a step's metrics (exact, or glob patterns such as
    #: ``"throughput/*"``), so a name that something needs is known before the first step.
    #: Declaring any makes the callback a producer: its `on_step_end` runs before that of
    #: every callback that declares none, so they all see (and the store keeps) its keys.
    metrics_logged: tuple[str, ...] = ()
    #: The metric names this callback reads, as the store names them (``"val/loss"``), each
    #: with who needs it: checked when a fit starts (see `lab.loop.metric_names`).
    metrics_needed: Mapping[str, str] = MappingProxyType({})
    #: Its `on_step_end` must fire at the step it ends, because it reads what only that
    #: moment holds: the model's weights, the gradients, the clock, the profiler's step.
    #: With ``TrainingLoop(log_every=N)`` the other steps' `on_step_end` fire late, at the
    #: next materialisation of the step metrics; a callback that sets this makes every step
    #: materialise (one INFO line says so), which costs a host sync per step on a GPU.
    live_steps: ClassVar[bool] = False

    # -- experiment level ----------------------------------------------------------------
    def on_experiment_start(self, ctx: LogContext) -> None:
        """Once, before any group: create the experiment record."""

    def on_group_start(self, ctx: LogContext, group_name: str) -> None:
        """Once per group (an arm's repeats), before its first run."""

    def on_run_start(self, ctx: LogContext) -> None:
        """Once per run, before training; `ctx.run_config` and `ctx.run_key` are set."""

    def on_benchmark_eval(
        self,
        ctx: LogContext,
        eval_result: EvalResult,
        predictions: list[dict],
        *,
        step: int | None = None,
    ) -> None:
        """Per benchmark scored: in the loop (`step` = the train step) or after it (None)."""

    def on_error(self, ctx: LogContext, exc: BaseException) -> None:
        """When a run raises, before `on_run_end` records it as failed."""

    def on_run_end(self, ctx: LogContext, run_result: RunResult, arm: ArmResult) -> None:
        """Once per run, after training and benchmarks: record the final status."""

    def on_experiment_end(self, ctx: LogContext, result: ExperimentResult) -> None:
        """Once, after every run: final summary and flush."""

    def close(self) -> None:
        """Always, right before the experiment (a bare fit's own too) returns or raises."""

    # -- loop level ----------------------------------------------------------------------
    def post_checkpoint_loaded(self, state: LoopState, path: Path) -> None:
        """After a checkpoint was loaded to resume a run, before `on_train_start`.

        `state` already holds the restored step and data position; `path` is the folder.
        """

    def on_train_start(self, state: LoopState) -> None:
        """Once, before the first step of a fit."""

    def on_epoch_start(self, state: LoopState, epoch: int) -> None:
        """Before the first step of epoch `epoch` (0-based), in loops that count epochs."""

    def pre_step(self, state: LoopState, step_idx: int, batch: TrainingBatch) -> None:
        """Right before step `step_idx` runs, with its batch already on the device."""

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        """After every step, once its metric row was handed to the store."""

    def on_media(self, state: LoopState, step_idx: int, media: Mapping[str, Media]) -> None:
        """When a loop logs non-scalar values at step `step_idx`: histograms and images,
        by key (a `lab.media.Histogram` or `lab.media.Image`)."""

    def on_eval(
        self, state: LoopState, step_idx: int, eval_name: str, metrics: dict[str, float]
    ) -> None:
        """After each in-loop evaluation."""

    def on_checkpoint(self, state: LoopState, row: ManifestRow) -> None:
        """After each checkpoint save or removal was recorded in the manifest."""

    def on_epoch_end(self, state: LoopState, epoch: int) -> None:
        """After epoch `epoch`'s last step, and the evals and saves due at it."""

    def on_train_end(self, state: LoopState, artifacts: LoopArtifacts) -> None:
        """Once, after the last step and the final checkpoint."""


def __getattr__(name: str) -> Any:
    """`LogContext`, from `lab.records` when first asked for here. Why: `import lab` imports
    this module (the RL hooks register with it), and importing the records with it would add
    about 20 ms of CPU to every `lab` command; the hooks need them for annotations only."""
    if name == "LogContext":
        from lab.records import LogContext

        globals()["LogContext"] = LogContext
        return LogContext
    raise AttributeError(f"module 'lab.hooks' has no attribute {name!r}")
