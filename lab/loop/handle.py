"""The run handle: one run's loop lifecycle, whatever loop drives it.

`RunHandle` is the one object that fires the loop's hooks (`post_checkpoint_loaded`,
`on_train_start`, `on_epoch_start`, `pre_step`, `on_step_end`, `on_media`, `on_eval`,
`on_benchmark_eval`, `on_checkpoint`, `on_epoch_end`, `on_train_end`, `on_error`) and owns the
run's `CheckpointManager`. `TrainingLoop` drives it, and so can a loop a user writes (an RL
loop, a GAN, a loop from another library)::

    with RunHandle(run, model, optimizer, num_steps=1000,
                   checkpoint=CheckpointConfig(every=100)) as loop:
        batches = loop.batches(data)           # resumes at the saved data position
        for step in loop.steps():              # from the step after the restored one
            batch = next(batches)
            loop.pre_step(batch)
            loss = ...; optimizer.zero_grad(); loss.backward(); optimizer.step()
            loop.end_step({"loss": loss.item()})   # on_step_end, then due evals and saves
    return loop.artifacts

Entering the handle restores the newest checkpoint of the run (model, optimizers,
schedulers, grad scaler, the objects in `stateful`, callbacks, every RNG, the data
position and `user_state`), so a resumed run continues the trajectory of one that never
stopped. `loop.resumed_from` says whether that happened.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lab._distributed import (
    MetricReducer,
    agreed,
    broadcast,
    check_reductions,
    gather_to_zero,
    init_from_launcher,
    rank_and_world,
)
from lab._metrics import as_number
from lab._secrets import logger
from lab._seeding import rng_state, set_rng_state
from lab.dispatch import Dispatcher
from lab.errors import CheckpointError, ConfigError, HookOrderError
from lab.hooks import Callback, Hook, LoopState
from lab.loop.bare import BareRun
from lab.loop.checkpoints import CheckpointConfig, CheckpointManager, snapshot_to_cpu
from lab.loop.evals import Evaluator
from lab.loop.feed import Feed
from lab.loop.metric_names import MetricWatch, check_metric_names, logged_by, needed_by
from lab.loop.payload import callback_states
from lab.loop.sharded import SHARDED_MARK, load_shards, save_shards, save_shards_async
from lab.loop.steps import check_no_epoch_settings, positive_int
from lab.records import EvalResult, LoopArtifacts, ManifestRow, TrainingBatch

if TYPE_CHECKING:
    from lab.records import RunSpec

log = logger("lab.loop")

_END = object()
#: The hooks of every step, looked up once: a module global costs less than an enum member.
_PRE_STEP, _STEP_END = Hook.PRE_STEP, Hook.STEP_END

# Callback states in checkpoints written before they were keyed by class: "{index}:{Class}",
# the index counting the stateful callbacks in dispatch order. New keys never hold a ":".
_INDEX_KEY = re.compile(r"(\d+):(\w+)")

#: A function that writes the loop's own files into a checkpoint folder being saved; what
#: it returns (a Future, a Thread, anything with `result()`, `join()` or `wait()`) is waited
#: for before the checkpoint commits.
Writer = Callable[[Path, int], Any]

_NEW, _RUNNING, _ENDED = "new", "running", "ended"
_RESTORED = "restored"


def _named(what: str, value: Any) -> dict[str, Any]:
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


class RunHandle:
    """Drive one run's hooks and checkpoints from any training loop.

    `run` is the `RunSpec` an Experiment hands `train(run)`, or None outside one: then the
    handle's own `callbacks` are all that fire, around an experiment of the fit's own (one
    group "loop", one run: see `lab.loop.bare`), and checkpoints go under `run_dir`. See
    `lab.start_run` for a named, seeded run outside an Experiment.

    `optimizer` and `scheduler` take one object, a list, or a dict of named ones (a GAN's
    generator and discriminator); all are saved in each checkpoint and restored on resume.
    `stateful` names more objects with `state_dict()`/`load_state_dict()` to keep (a
    sampler, an EMA model), and `user_state` is a dict of plain values the loop keeps in
    each checkpoint. `num_steps` is the number of optimizer steps, or None for a loop that
    decides when to stop (it leaves `steps()` with `state.request_stop`, or by `break`).
    `metrics` names the keys `end_step` will log, when they are known: then a name that a
    callback or the checkpoint config needs but nothing logs is an error before the first
    step (see `lab.loop.metric_names`); `more_metrics=True` says the loop may log others too
    (they are then looked for at the first step instead).

    Under DDP (``torchrun``, or ``Experiment(processes_per_run=N)``) every rank drives its
    own handle: the hooks fire on every rank (`state.rank`, `state.world_size`), each step's
    metrics are reduced across ranks in one collective before `on_step_end` (the mean, or
    what `reduce` names per metric or glob pattern: ``{"tokens": "sum", "mem/*": "max"}``),
    and checkpoints are saved by rank 0, or by every rank with ``CheckpointConfig(sharded=True)``.

    `log_every=N` lets `end_step` hold a step's metrics, tensors on their device, instead of
    reading them: they are read (materialised) for all the steps held in one transfer per
    device, and one collective under DDP, at each multiple of N, and at any step after
    which something reads them (see `end_step`); the held steps' `on_step_end` fire then,
    in order, before the materialising step's. N is 1 in effect while a callback that sets
    `Callback.live_steps` is attached.

    Misuse is one `HookOrderError` line: a step that goes backwards, a step logged before
    the handle started or after it ended, a step begun twice, or a step never ended.
    """

    def __init__(
        self,
        run: RunSpec | None,
        model: torch.nn.Module,
        optimizer: Any = None,
        *,
        num_steps: int | None,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        checkpoint: CheckpointConfig | None = None,
        evaluators: Sequence[Evaluator] = (),
        callbacks: Sequence[Callback] = (),
        device: str | torch.device | None = None,
        resume: bool | str | Path | int = True,
        run_dir: str | Path | None = None,
        metrics: Sequence[str] | None = None,
        more_metrics: bool = False,
        stateful: Mapping[str, Any] | None = None,
        steps_per_epoch: int | None = None,
        reduce: Mapping[str, str] | None = None,
        log_every: int = 1,
    ) -> None:
        if num_steps is not None and (
            isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1
        ):
            raise ConfigError(
                f"num_steps={num_steps!r}: give the number of steps, an int >= 1 "
                "(or None when the loop decides when to stop)"
            )
        names = [ev.name for ev in evaluators]
        if len(set(names)) != len(names):
            raise ConfigError(f"evaluator names must be unique, got {names}")
        if isinstance(metrics, str):
            raise ConfigError(f"metrics={metrics!r}: give a list of keys, e.g. ['loss', 'acc']")
        if not positive_int(log_every):
            raise ConfigError(
                f"log_every={log_every!r}: give how many steps pass between two "
                "materialisations of the step metrics, an int >= 1 (1: every step)"
            )
        if checkpoint is not None and not isinstance(checkpoint, CheckpointConfig):
            raise ConfigError(
                f"checkpoint={checkpoint!r}: pass a CheckpointConfig(...), or None for no saves"
            )
        self.run = run
        self.model = model
        self.optimizers = _named("optimizer", optimizer)
        self.schedulers = _named("scheduler", scheduler)
        for name, opt in self.optimizers.items():
            if not (hasattr(opt, "param_groups") and callable(getattr(opt, "state_dict", None))):
                raise ConfigError(
                    f"optimizer {name!r} is a {type(opt).__name__}; pass a torch optimizer, a "
                    "list of them, or a dict of named ones"
                )
        self.stateful = dict(stateful or {})
        for name, obj in self.stateful.items():
            if not (callable(getattr(obj, "state_dict", None)) and hasattr(obj, "load_state_dict")):
                raise ConfigError(
                    f"stateful[{name!r}] is a {type(obj).__name__} without state_dict() and "
                    "load_state_dict(); keep plain values in loop.user_state instead"
                )
        self.scaler = scaler
        self.num_steps = num_steps
        #: Steps per epoch, when every epoch has as many: `Evaluator(every_epochs=N)` then
        #: runs at the end of every N-th epoch (each step that is a multiple of it).
        if steps_per_epoch is not None and not positive_int(steps_per_epoch):
            raise ConfigError(
                f"steps_per_epoch={steps_per_epoch!r}: give the steps per epoch, an int >= 1"
            )
        if steps_per_epoch is None:  # an every_epochs evaluator would never run
            check_no_epoch_settings((), evaluators)
        self.steps_per_epoch = steps_per_epoch
        self.checkpoint = checkpoint
        self.evaluators = list(evaluators)
        self.callbacks = list(callbacks)
        self.device = torch.device(device) if device is not None else None
        self.resume = resume
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.declared = tuple(metrics) if metrics is not None else None
        #: How each step metric is reduced across ranks under DDP (default: the mean).
        self.reduce = check_reductions(reduce)
        self._reducer: MetricReducer | None = None  # set under DDP, when the handle starts
        #: Steps between two materialisations of the step metrics (see `end_step`).
        self.log_every = log_every
        self._every = log_every  # in effect: 1 while a `live_steps` callback is attached
        # the steps ended since the last materialisation: (step, metrics with their tensors
        # still on the device, the batch's epoch, its index)
        self._held: list[tuple[int, dict[str, Any], int, int]] = []
        self._past = TrainingBatch()  # the batch a held step's on_step_end sees: no data
        self._open = metrics is None or more_metrics
        #: Plain values (numbers, strings, lists, dicts, tensors) kept in each checkpoint and
        #: given back on resume.
        self.user_state: dict[str, Any] = {}
        #: Extra payload entries a loop that drives the handle keeps in each checkpoint; on
        #: resume, each key set before `start` gets the value the checkpoint saved under it.
        self.loop_state: dict[str, Any] = {}
        #: How a save at (step, final) is kept ("regular", "fixed", "ephemeral"), for a loop
        #: that counts `CheckpointConfig`'s steps in units of its own; None: the config's.
        self.save_kind: Callable[[int, bool], Any] | None = None
        self.state: LoopState
        self.checkpoints: CheckpointManager | None = None
        self.resumed_from: Path | None = None
        self.artifacts: LoopArtifacts | None = None
        self._phase = _NEW
        self._bare: BareRun | None = None  # a run's own experiment, outside an Experiment
        self._own: Dispatcher | None = None  # under an Experiment: the handle's callbacks
        self._writers: list[Writer] = []
        self._batch = TrainingBatch()
        self._begun = 0  # the step pre_step announced and end_step has not ended yet
        # True: an epoch is open; _RESTORED: the save resumed from was made inside one
        # (it may be ended, or the next one started); False: none.
        self._epoch_open: bool | str = False
        self._epochs_started = 0  # start_epoch calls in this run, across resumes
        self._feed: Feed | None = None  # the passes `batches` draws from
        self._epoch_rng: dict[str, Any] | None = None  # RNG at the current epoch's start
        self._restored: dict[str, Any] | None = None
        self._saved: list[ManifestRow] = []
        self._evals: list[EvalResult] = []
        self._eval_metrics: dict[str, float] = {}  # the last value of each eval metric
        # the last value logged of each step metric: a run's final values (lab._ranking)
        self._last: dict[str, float] = {}
        self._fresh: dict[str, float] = {}  # eval metrics measured at the current step
        self._fresh_step = -1
        self._seen: set[str] = set()  # step metric names logged in this fit (ranking check)
        # Whether steps still add to `_seen`: only with a ranking metric not yet logged.
        self._ranking_open = checkpoint is not None and checkpoint.metric is not None
        self._last_saved = -1
        self._watch: MetricWatch | None = None
        # an asynchronous sharded save whose shards are being written: (future, step, rank
        # 0's payload, its metrics, final, kind); committed by the next save or `finish`
        self._pending_shards: tuple[Any, ...] | None = None
        self._shard_group: Any = None  # the process group asynchronous shards are saved on
        self._watch_step = False

    # ------------------------------------------------------------------------------------
    # the context: start and end
    def __enter__(self) -> RunHandle:
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.finish()
        else:
            self.fail(exc)

    def start(self) -> RunHandle:
        """Restore the run's checkpoint if there is one, then fire `on_train_start`, the
        `at_start` evals and a save due at step 0. `with RunHandle(...)` calls it."""
        if self._phase != _NEW:
            raise HookOrderError("this RunHandle has already started; make a new one per run")
        self._phase = _RUNNING
        try:
            self._start()
        except BaseException as exc:
            self.fail(exc)
            raise
        return self

    def _start(self) -> None:
        run = self.run
        bare = None
        if run is None:  # outside an Experiment: an experiment of its own (lab.loop.bare)
            self._bare = bare = BareRun(self.callbacks, self.run_dir)
            self.ctx, self.hooks = bare.ctx, bare.hooks
            folder = self.run_dir
        else:
            self.ctx = run.ctx
            folder = run.dir
            self.hooks = run.dispatcher.extended(self.callbacks)
            self._own = run.dispatcher.sibling(self.callbacks)  # the Experiment owns the rest
        self._folder = folder
        hooks = self.hooks
        # what the settings get wrong fails here, before any hook (a bare fit records nothing)
        self._watch = self._check_metric_names()
        self._watch_step = self._watch is not None and bool(self._watch.at_step)
        self._every = self._every_in_effect()
        if self.checkpoint is not None:
            if folder is None:
                raise ConfigError(
                    "checkpoints need a folder: run under an Experiment (or lab.start_run), "
                    "or pass run_dir=..."
                )
            _state_keys(hooks.stateful())  # a clash fails here, before any step is spent
        elif self.resume not in (True, False):
            raise ConfigError(
                f"resume={self.resume!r} needs checkpoints: pass checkpoint=CheckpointConfig(...)"
            )
        if bare is not None:
            bare.open()  # on_experiment_start, on_group_start, on_run_start
        if self.device is not None:
            self.model.to(self.device)
        first = next(iter(self.optimizers.values()), None)
        init_from_launcher()  # a bare fit under torchrun; an Experiment has made the group
        rank, world = rank_and_world()
        self.state = state = LoopState(
            ctx=self.ctx,
            model=self.model,
            optimizer=first,
            num_steps=self.num_steps or 0,
            rank=rank,
            world_size=world,
        )
        if world > 1:
            self._reducer = MetricReducer(self.reduce)
            if self.log_every > 1:
                # rank 0 has every callback (rank_zero_only ones too): its choice holds for
                # all, so every rank materialises, and reduces, at the same steps
                self._every = broadcast(self._every)
            config = self.checkpoint
            if config is not None and config.sharded and config.async_save:
                import torch.distributed as dist

                # the background writes' collectives on a group of their own, never mixed
                # with the training thread's
                self._shard_group = dist.new_group(backend="gloo")
            # rank 0 moves earlier saves aside, clears debris and picks the checkpoint; its
            # failure fails every rank, and the others open the folder once it is done
            self.checkpoints, path = agreed(self._open_checkpoints)
            path = broadcast(path)
            if rank != 0:
                self.checkpoints = self._checkpoint_manager(folder, fresh=False)
        else:
            self.checkpoints, path = self._open_checkpoints()
        if self.checkpoints is not None and path is not None:
            self._restore(self.checkpoints, path)
            self.resumed_from = path
            hooks.fire(Hook.POST_CHECKPOINT_LOADED, state, path)
        parent = (run.parent_checkpoint, run.carry) if run is not None else (None, "weights")
        if self.resumed_from is None and parent[0] is not None:  # a chain's stage k
            self._start_from(parent[0], parent[1] == "full")
            hooks.fire(Hook.POST_CHECKPOINT_LOADED, state, parent[0])
        self.model.train()
        hooks.fire(Hook.TRAIN_START, state)
        if state.step == 0:  # `at_start` evals score the untrained model, at step 0
            for evaluator in self.evaluators:
                if evaluator.at_start:
                    self._run_eval(evaluator, 0)
            if self.checkpoints is not None and self.checkpoint.due(0, self.num_steps):
                self._save_now()

    def _open_checkpoints(self) -> tuple[CheckpointManager | None, Path | None]:
        """The run's checkpoint manager (earlier saves moved aside for a fresh start, the
        debris of interrupted saves removed) and the checkpoint to resume from; under DDP,
        rank 0's alone (the others get None)."""
        if self.state.rank != 0:
            return None, None
        manager = self._checkpoint_manager(self._folder, fresh=self.resume is False)
        if manager is None:
            return None, None
        manager.remove_stale_tmp()
        return manager, self._resume_path(manager, self.resume)

    def finish(self) -> LoopArtifacts:
        """End the run cleanly: a final save if one is due, the wait for a save in flight,
        then `on_train_end`. Leaving the `with` block calls it."""
        self._check_running("finish")
        try:
            state = self.state
            self._materialise()  # the steps held since the last one, before what ends the run
            if self._epoch_open is True:
                self.end_epoch()
            config = self.checkpoint
            if (
                self.checkpoints is not None
                and config.save_at_end
                and state.step > 0
                and self._last_saved != state.step
            ):
                self._save_now(final=True)
            manager = self.checkpoints
            if self._pending_shards is not None:  # an asynchronous sharded save commits
                for row in self._commit_shards():
                    self._saved.append(row)
                    self.hooks.fire(Hook.CHECKPOINT, state, row)
            if manager is not None and (manager.in_flight or self._reducer is not None):
                # the final save is durable first (under DDP: rank 0's, its rows to all)
                for row in self._from_zero(manager.wait):
                    self._saved.append(row)
                    self.hooks.fire(Hook.CHECKPOINT, state, row)
            self.artifacts = LoopArtifacts(
                model=self.model,
                metrics={**self._last, **self._eval_metrics},
                step=state.step,
                stopped=state.stop_requested,
                stop_reason=state.stop_reason,
                checkpoint_dir=self.checkpoints.root if self.checkpoints is not None else None,
                checkpoints=self._saved,
                evals=self._evals,
            )
            self.hooks.fire(Hook.TRAIN_END, state, self.artifacts)
            if self.run is not None:
                self.run.artifacts = self.artifacts
        except BaseException as exc:
            self.fail(exc)
            raise
        self._phase = _ENDED
        if self._bare is not None:  # on_run_end, on_experiment_end, close
            self._bare.trained(self.artifacts)
            self._bare.end()
        elif self._own is not None:  # the Experiment ends the run: its callbacks close here
            self._own.fire(Hook.CLOSE)
        return self.artifacts

    def fail(self, exc: BaseException) -> None:
        """Record that the loop raised `exc`: wait for a save in flight (never torn, never
        left running), fire `on_error` and `close`. Leaving the `with` block by an exception
        calls it; the exception goes on."""
        if self._phase == _ENDED:
            return
        self._phase = _ENDED
        self._materialise_on_error()
        pending, self._pending_shards = self._pending_shards, None
        if pending is not None:  # its shards are finished, never committed: a tmp_ folder
            try:
                pending[0].result()
            except Exception as error:
                log.error("the sharded checkpoint save in flight also failed: %s", error)
        manager = self.checkpoints
        if manager is not None and manager.in_flight:
            try:
                manager.wait()
            except CheckpointError as error:
                log.error("the checkpoint save in flight also failed: %s", error)
        if self._bare is not None:  # on_error, on_run_end, on_experiment_end, close
            self._bare.end(exc)
            return
        own = self._own
        if own is None:  # failed before the callbacks were known
            return
        try:
            own.fire(Hook.ERROR, self.ctx, exc)
        finally:
            own.fire(Hook.CLOSE)

    def _materialise_on_error(self) -> None:
        """Record the steps held since the last materialisation, before `on_error`: they
        were trained. Not under DDP, where reading them takes a collective that a failing
        group may never complete: they are named in a WARNING instead."""
        held = self._held
        if not held:
            return
        steps = f"steps {held[0][0]}-{held[-1][0]}" if len(held) > 1 else f"step {held[0][0]}"
        if self._reducer is not None:
            self._held = []
            log.warning(
                "%s: not recorded, their metrics were held (log_every) when the run failed, "
                "and reducing them across ranks needs every rank",
                steps,
            )
            return
        try:
            self._materialise()
        except Exception as error:
            log.error("%s: their held metrics could not be read: %s", steps, error)

    # ------------------------------------------------------------------------------------
    # steps
    @property
    def step(self) -> int:
        """The number of optimizer steps completed (the restored one after a resume)."""
        return self.state.step

    def steps(self) -> Iterator[int]:
        """Yield the step numbers still to run: from the one after the restored step to
        `num_steps`, ending early once a callback asks the loop to stop."""
        self._check_running("steps")
        state = self.state
        while not state.stop_requested and (self.num_steps is None or state.step < self.num_steps):
            step = state.step + 1
            yield step
            if self._phase == _RUNNING and state.step < step:
                raise HookOrderError(
                    f"step {step} was never ended: call loop.end_step(metrics) once per step"
                )

    def batches(self, data: Iterable[Any]) -> Iterator[Any]:
        """Yield `data`'s batches forever, counting passes over it and the position in each.

        The position is saved in each checkpoint; on resume this re-creates the pass under
        the RNG it started with (a shuffled pass draws its order when its iterator is
        created), skips the batches already taken, and then restores the checkpoint's RNG, so
        the batches continue as if the run had never stopped. A pass that runs out starts
        the next one; `start_epoch()` starts a fresh pass for each epoch after the first.
        """
        self._check_running("batches")
        feed = self._feed = Feed(data, 1, None, self)
        while True:
            yield feed.take()[0]

    def pre_step(self, batch: Any = None) -> TrainingBatch:
        """Announce the next step with its batch (on its device): fires `pre_step`.

        Returns the `TrainingBatch` the hooks saw (one object reused for every step).
        Optional: a loop with nothing to announce calls only `end_step`.
        """
        if self._phase != _RUNNING:
            self._check_running("pre_step")
        state = self.state
        step = state.step + 1
        if self._begun == step:
            raise HookOrderError(
                f"pre_step for step {step} twice: end the step with loop.end_step(metrics) first"
            )
        self._begun = step
        hb = self._wrap(batch)
        if self.hooks.listens(_PRE_STEP):
            self.hooks.fire(_PRE_STEP, state, step, hb)
        return hb

    def end_step(
        self,
        metrics: Mapping[str, Any],
        batch: Any = None,
        *,
        step: int | None = None,
        save: bool | None = None,
    ) -> None:
        """End an optimizer step with its metrics: fires `on_step_end`, then the evals and
        the save due after it. `step` defaults to the one after the last ended step; a given
        one must be larger (steps only go up).

        `save` overrides the checkpoint schedule for this step, for a loop whose saves
        fall only at boundaries of its own (an RL loop's episodes): True saves after it
        (`state.checkpoint_due` is set for the sinks), False does not save (not even at
        `num_steps`: `finish` makes the final save); None lets `CheckpointConfig` decide.

        `metrics` may hold one-element tensors: read on the host here with ``log_every=1``
        (one transfer for all of them), else held on their device while nothing follows the
        step that reads them. A step materialises (reads the held steps and this one, fires
        their `on_step_end` in order, then this step's) when it is a multiple of
        `log_every`, the last step, a stop was asked for, or an eval, a save or an epoch's
        end follows it; `finish`, `evaluate`, `log_eval`, `save`, `log_histogram`,
        `log_image`, `start_epoch` and `end_epoch` materialise first, and so does a failure
        (not under DDP). Until then `state.step` counts the held step as ended, and
        `state.metrics` stays the last materialised step's.
        """
        state = self.state if self._phase == _RUNNING else None
        if state is None:
            self._check_running("end_step")
        done = state.step
        if step is None:
            step = done + 1
        elif isinstance(step, bool) or not isinstance(step, int) or step <= done:
            raise HookOrderError(
                f"end_step(step={step!r}) after step {done}: step numbers only go up; "
                f"end step {done + 1} (or leave step out)"
            )
        if self.num_steps is not None and step > self.num_steps:
            raise HookOrderError(
                f"end_step(step={step}) past num_steps={self.num_steps}; stop at the last step"
            )
        if self._every == 1:  # each step read as it ends (one collective under DDP)
            clean = _floats(metrics, step)
            if self._reducer is not None:
                clean = self._reducer.reduce(clean, step)
        elif self._logs_at(step, save):
            clean = self._materialise(step, metrics)  # the held steps' on_step_end first
        else:
            self._hold(step, metrics, batch)  # nothing of it is read on the host yet
            return
        self._begun = 0
        state.step, state.metrics = step, clean
        config, checkpoints = self.checkpoint, self.checkpoints
        num_steps = self.num_steps
        # Sinks see that a save follows this step and make what they hold durable before
        # the checkpoint commits (a kill in between must not lose the step's metrics).
        # A save due only as an ephemeral one is skipped while a callback blocks those.
        if save is None:
            state.checkpoint_due = (
                checkpoints is not None
                and config.due(step, num_steps)
                and not (
                    state.ephemeral_checkpoints_blocked and config.is_ephemeral(step, num_steps)
                )
            )
        else:
            state.checkpoint_due = save and checkpoints is not None
        self._fire_step_end(step, clean, batch)
        if self.evaluators:  # no list is built: a step with nothing due allocates nothing
            spe = self.steps_per_epoch
            epoch_end = step // spe if spe is not None and step % spe == 0 else None
            for evaluator in self.evaluators:
                if evaluator.due(step, num_steps=num_steps or 0, epoch_end=epoch_end):
                    self._run_eval(evaluator, step)
        last = step == num_steps or state.stop_requested
        if checkpoints is not None and (
            state.checkpoint_due or (save is None and last and config.save_at_end)
        ):
            self._save_now(final=last)
        if state.stop_requested and last:
            log.info("stopping after step %d: %s", step, state.stop_reason)

    def _fire_step_end(self, step: int, clean: dict[str, float], batch: Any) -> None:
        """`on_step_end` for an ended step whose metrics are floats now, and the checks of
        metric names that read them."""
        hooks = self.hooks
        if hooks.listens(_STEP_END):
            hb = self._batch if batch is None else self._wrap(batch)
            hooks.fire(_STEP_END, self.state, step, hb, clean)
        self._last.update(clean)  # after the hook: the keys its producers added count too
        if self._ranking_open:  # step metric names (producers' keys too), for the check
            self._seen.update(clean)  # at saves, until the ranking metric shows up
            self._ranking_open = (
                self.checkpoint.metric not in clean and len(self._seen) < 64  # type: ignore[union-attr]
            )
        if self._watch_step:  # needed names no source declared: looked for once
            self._watch_step = False
            self._watch.after_step(step, clean)  # type: ignore[union-attr]

    def _logs_at(self, step: int, save: bool | None) -> bool:
        """Whether ending `step` materialises the step metrics (with ``log_every > 1``): at a
        multiple of `log_every`, the last step, a stop asked for, and wherever something
        after `on_step_end` reads them on the host (a save, an eval, an epoch's end, the
        first step's lookup of needed names). Step numbers, not a count since the last
        materialisation, so a resumed run materialises where one that never stopped does."""
        num_steps, spe = self.num_steps, self.steps_per_epoch
        if (
            step % self._every == 0
            or step == num_steps
            or self.state.stop_requested
            or self._watch_step
            or save
            or (spe is not None and step % spe == 0)
        ):
            return True
        if save is None and self.checkpoints is not None and self.checkpoint.due(step, num_steps):  # type: ignore[union-attr]
            return True
        if self.evaluators:
            return any(ev.due(step, num_steps=num_steps or 0) for ev in self.evaluators)
        return False

    def _hold(self, step: int, metrics: Mapping[str, Any], batch: Any) -> None:
        """End `step` without reading its metrics: its tensors stay on their device until
        the next materialisation, so the host never waits for the device here. Only the
        batch's epoch and index are kept: its data is not held alive (`log_every` batches
        on a GPU could fill it)."""
        held = dict(metrics)
        for key, value in held.items():
            if type(value) is float:
                continue
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:  # the same error as at a materialised step, now
                    as_number(str(key), step, value)
                held[key] = value.detach()
            else:
                held[key] = as_number(str(key), step, value)
        source = self._batch if batch is None else batch
        if isinstance(source, TrainingBatch):
            epoch, index = source.epoch, source.index
        else:
            epoch, index = self.state.epoch, self.state.batch_in_epoch - 1
        self._held.append((step, held, epoch, index))
        self._begun = 0
        self.state.step = step

    def _materialise(
        self, step: int | None = None, metrics: Mapping[str, Any] | None = None
    ) -> dict[str, float] | None:
        """Read the held steps' metrics, and `metrics` of `step` (the step being ended), on
        the host in one transfer per device, reduce them across ranks in one collective,
        and fire each held step's `on_step_end` in step order, with `state.step` and
        `state.metrics` set to that step's; returns `step`'s floats."""
        held = self._held
        if not held and metrics is None:
            return None
        steps = [entry[0] for entry in held]
        rows = [entry[1] for entry in held]
        if metrics is not None:
            assert step is not None
            steps.append(step)
            rows.append(dict(metrics))
        # one row (log_every=1, or a step right after a materialisation): the fast path
        clean = _to_host(rows, steps) if held else [_floats(rows[0], step)]  # type: ignore[arg-type]
        # read: a value that is no number (a MetricError) has left the held steps held
        self._held = []
        if self._reducer is not None:  # one collective for all of them
            clean = self._reducer.reduce_steps(clean, steps)
        state, past = self.state, self._past
        ended = state.step
        for (done, _, epoch, index), values in zip(held, clean, strict=False):
            state.step, state.metrics, state.checkpoint_due = done, values, False
            past.epoch, past.index = epoch, index
            self._fire_step_end(done, values, past)
        state.step = ended
        return clean[-1] if metrics is not None else None

    def _every_in_effect(self) -> int:
        """`log_every`, or 1 while a callback whose `on_step_end` must see its own step live
        (`Callback.live_steps`: the model, the gradients, the clock) is attached."""
        if self.log_every == 1:
            return 1
        live = sorted({type(cb).__name__ for cb in self.hooks.callbacks if cb.live_steps})
        if not live:
            return self.log_every
        log.info(
            "log_every=%d: every step materialises its metrics, as %s must see each step "
            "live (live_steps)", self.log_every, ", ".join(live),
        )  # fmt: skip
        return 1

    def _wrap(self, batch: Any) -> TrainingBatch:
        if isinstance(batch, TrainingBatch):
            return batch
        hb = self._batch
        hb.data = batch
        hb.epoch, hb.index = self.state.epoch, self.state.batch_in_epoch - 1
        return hb

    # ------------------------------------------------------------------------------------
    # epochs
    def start_epoch(self, epoch: int | None = None) -> None:
        """Fire `on_epoch_start` for the next epoch, or for `epoch` when given.

        Epochs count from 0; each call after the first starts the next one, and with
        `batches` a fresh pass over the data. A run resumed from a save made inside an
        epoch may end that epoch (`end_epoch`) or start the next one.
        """
        self._check_running("start_epoch")
        self._materialise()
        if self._epoch_open is True:
            raise HookOrderError(
                f"start_epoch({'' if epoch is None else epoch}) while epoch "
                f"{self.state.epoch} is open; call loop.end_epoch() first"
            )
        state = self.state
        if epoch is not None:
            if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
                raise ConfigError(f"start_epoch({epoch!r}): give the epoch as an int >= 0")
            state.epoch = epoch
        elif self._epochs_started:  # the next epoch: with `batches`, a fresh pass
            before = state.epoch
            if self._feed is not None:
                self._feed.next_epoch()  # a no-op when the pass has not begun
            if state.epoch == before:
                state.epoch += 1
                state.batch_in_epoch = 0
        self._epochs_started += 1
        self._epoch_open = True
        self.hooks.fire(Hook.EPOCH_START, state, state.epoch)

    def end_epoch(self) -> None:
        """Fire `on_epoch_end` for the open epoch, after its last step, evals and saves."""
        self._check_running("end_epoch")
        self._materialise()  # on_epoch_end after the epoch's steps' on_step_end
        if not self._epoch_open:
            raise HookOrderError("end_epoch() with no epoch open; call loop.start_epoch() first")
        self._epoch_open = False
        self.hooks.fire(Hook.EPOCH_END, self.state, self.state.epoch)

    # ------------------------------------------------------------------------------------
    # evals and non-scalar values
    def evaluate(self, evaluator: Evaluator) -> EvalResult:
        """Run `evaluator` now, at the current step, and fire its hooks."""
        self._check_running("evaluate")
        self._materialise()
        return self._run_eval(evaluator, self.state.step)

    def log_eval(
        self,
        name: str,
        metrics: Mapping[str, Any],
        *,
        predictions: Sequence[Mapping[str, Any]] | None = None,
    ) -> EvalResult:
        """Record an evaluation the loop ran itself, at the current step: fires `on_eval`,
        and `on_benchmark_eval` when it has per-example `predictions`."""
        self._check_running("log_eval")
        self._materialise()
        preds = [dict(p) for p in predictions] if predictions is not None else []
        result = EvalResult(
            name, {str(k): v for k, v in metrics.items()}, predictions=preds, step=self.step
        )
        return self._run_eval(Evaluator(name, lambda _model: result), self.state.step)

    def log_histogram(
        self, key: str, values: Any, *, bins: int = 64, range: tuple[float, float] | None = None
    ) -> None:
        """Log the distribution of `values` (a tensor, array or list) as a histogram row at
        the step in progress (announced by `pre_step`), else at the last ended step: fires
        `on_media`."""
        from lab.media import histogram

        self._check_running("log_histogram")
        self._materialise()
        record = histogram(values, bins=bins, range=range)
        step = self._media_step()
        self.hooks.fire(Hook.MEDIA, self.state, step, {key: record})

    def log_image(self, key: str, image: Any) -> None:
        """Write `image` (a CHW/HWC tensor or array, or a matplotlib Figure) as a PNG in the
        run's folder and log a row that points to it, at the same step `log_histogram`
        would: fires `on_media`."""
        from lab.media import write_image

        self._check_running("log_image")
        self._materialise()
        step = self._media_step()
        record = write_image(self.ctx.folder, key, step, image)
        self.hooks.fire(Hook.MEDIA, self.state, step, {key: record})

    def _media_step(self) -> int:
        """The step in progress when `pre_step` announced one, else the last ended step (a
        histogram of what a step left, logged after `end_step`)."""
        return self._begun or self.state.step

    # ------------------------------------------------------------------------------------
    # checkpoints
    def on_save(self, writer: Writer) -> None:
        """Also write the loop's own files into each checkpoint: `writer(folder, step)` is
        called with the folder being saved, before it commits (two-phase, as in NeMo RL).

        The files commit atomically with the checkpoint: a save that fails or is killed
        leaves none of them. A writer may start its own asynchronous work and return what
        to wait for (a Future, a Thread, anything with `result()`, `join()` or `wait()`): the
        commit waits for it, and its failure fails the save.
        """
        if not callable(writer):
            raise ConfigError(f"on_save({writer!r}): pass a function writer(folder, step)")
        self._writers.append(writer)

    def save(self, *, final: bool = False) -> list[ManifestRow]:
        """Save a checkpoint now, at the current step, whatever the schedule says."""
        self._check_running("save")
        self._materialise()
        if self.checkpoints is None:
            raise ConfigError("save() needs checkpoints: pass checkpoint=CheckpointConfig(...)")
        return self._save_now(final=final)

    def _save_now(self, *, final: bool = False) -> list[ManifestRow]:
        rows = self._save(final=final)
        for row in rows:
            self._saved.append(row)
            self.hooks.fire(Hook.CHECKPOINT, self.state, row)
        return rows

    def _fresh_metrics(self) -> dict[str, float]:
        """The values measured at the current step: its step metrics and the evals that ran
        at it (a save never carries an older eval's value as if it were its own)."""
        state = self.state
        fresh = dict(state.metrics) if state.step > 0 else {}
        if self._fresh_step == state.step:
            fresh.update(self._fresh)
        return fresh

    def _check_ranked(self, fresh: dict[str, float]) -> None:
        """A save without a fresh value of the ranking metric is unranked, which is normal
        between evals; but a metric that nothing has logged, and nothing that already ran
        can log, is a misnamed one: fail before anything is written."""
        metric = self.checkpoint.metric
        if metric is None or metric in fresh or metric in self._seen:
            return
        if metric in self._eval_metrics or self._may_log(metric):
            return
        logged = sorted({*fresh, *self._seen, *self._eval_metrics})
        raise CheckpointError(
            f"CheckpointConfig(metric={metric!r}) ranks saves, but nothing logged {metric!r} "
            f"before the save at step {self.state.step} (logged: {logged}); log it before "
            "the save (loop.end_step, loop.log_eval, or an Evaluator), or fix the name"
        )

    def _may_log(self, metric: str) -> bool:
        """Whether something may still log `metric`: an evaluator of that name that has not
        run yet (or declares it), or step metrics nobody declared."""
        head, _, tail = metric.partition("/")
        for ev in self.evaluators:
            if ev.name != head:
                continue
            if ev.metrics is not None:
                return tail in ev.metrics
            ran = any(r.name == head and r.error is None for r in self._evals)
            return not ran  # an evaluator that ran and logged no such key never will
        if self.declared is not None and metric in self.declared:
            return True
        return self._open and not (self._seen or self._eval_metrics)  # nothing logged yet

    def _save(self, *, final: bool = False) -> list[ManifestRow]:
        """Save the training state; returns the manifest rows to fire `on_checkpoint` for.

        Synchronous: this save's rows. With `async_save`: the rows of the previous save,
        which is waited for first (so the payload's retention bookkeeping includes it); this
        save's rows come from the next save or from the wait in `finish`, so `on_checkpoint`
        fires for every row, in save order, on the training thread.
        """
        manager = self.checkpoints
        assert manager is not None
        fresh = self._fresh_metrics()
        self._check_ranked(fresh)
        if self._reducer is not None or manager.config.sharded:  # one process: one shard
            return self._save_across_ranks(manager, fresh, final)
        rows = manager.wait() if manager.in_flight else []
        payload = self._payload(manager)
        return rows + self._commit(manager, payload, fresh, final)

    def _payload(self, manager: CheckpointManager) -> dict[str, Any]:
        state = self.state
        return {
            "model": self.model.state_dict(),
            **_states("optimizer", self.optimizers),
            **_states("scheduler", self.schedulers),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "loop": {
                **state.state_dict(),
                "epoch_open": bool(self._epoch_open),
                "epochs_started": self._epochs_started,
            },
            "metrics": dict(state.metrics),
            "last_metrics": dict(self._last),
            "eval_metrics": dict(self._eval_metrics),
            "rng": rng_state(),
            "epoch_rng": self._epoch_rng,
            "retention": manager.state_dict(),
            "callbacks": callback_states(_state_keys(self.hooks.stateful())),
            "objects": {name: obj.state_dict() for name, obj in self.stateful.items()},
            "user": dict(self.user_state),
            **self.loop_state,
        }

    def _commit(
        self,
        manager: CheckpointManager,
        payload: dict[str, Any],
        fresh: dict[str, float],
        final: bool,
        *,
        begun: bool = False,
    ) -> list[ManifestRow]:
        state = self.state
        info = {"metrics": fresh}
        self._last_saved = state.step
        writers = tuple(self._writers)
        kind = self.save_kind(state.step, final) if self.save_kind is not None else None
        if not manager.config.async_save:
            return manager.save(
                state.step, payload, info, final=final, writers=writers, kind=kind, begun=begun
            )
        return manager.save_async(
            state.step, payload, info, final=final, writers=writers, kind=kind
        )

    def _save_across_ranks(
        self, manager: CheckpointManager, fresh: dict[str, float], final: bool
    ) -> list[ManifestRow]:
        """A save under DDP. Rank 0 writes ``state.pt`` with every rank's RNG states (each
        rank resumes its own draws); with ``sharded=True`` every rank first writes its shard
        of the model and optimizers into the folder rank 0 made (DCP's closing collective
        is the barrier: all shards are on disk before rank 0 commits). Rank 0's manifest
        rows, or its failure, reach every rank, so `on_checkpoint` fires everywhere."""
        state = self.state
        zero = state.rank == 0
        self._last_saved = state.step
        ranks = gather_to_zero((rng_state(), self._epoch_rng))
        sharded = manager.config.sharded
        background = sharded and manager.config.async_save
        before = self._commit_shards() if background else []
        future = None
        if sharded:
            folder = self._from_zero(lambda: manager.begin(state.step))
            optimizers = list(self.optimizers.values())
            if background:
                future = save_shards_async(folder, self.model, optimizers, self._shard_group)
            else:
                save_shards(folder, self.model, optimizers)

        def zero_payload() -> dict[str, Any]:
            """Rank 0's payload: every rank's RNG states; the shards' mark for sharded saves."""
            payload = self._payload(manager)
            assert ranks is not None
            payload["ranks"] = {
                "world_size": state.world_size,
                "rng": [rng for rng, _ in ranks],
                "epoch_rng": [epoch_rng for _, epoch_rng in ranks],
            }
            if sharded:
                payload["model"] = SHARDED_MARK
                payload.update(_states("optimizer", {}))
                payload.pop("optimizers", None)
            return payload

        def commit() -> list[ManifestRow]:
            if not zero:
                return []
            rows = manager.wait() if manager.in_flight else []
            if background:  # committed once the shards are written: by the next save
                return rows
            return rows + self._commit(manager, zero_payload(), fresh, final, begun=sharded)

        if background:
            kind = self.save_kind(state.step, final) if self.save_kind is not None else None
            # rank 0's state as it is now, whatever training changes after
            payload = snapshot_to_cpu(zero_payload()) if zero else None
            self._pending_shards = (future, state.step, payload, dict(fresh), final, kind)
        return before + self._from_zero(commit)

    def _commit_shards(self) -> list[ManifestRow]:
        """Wait for the asynchronous sharded save in flight (every rank its shard; DCP's
        closing collective tells each rank when all are written), then commit it on rank 0
        through the usual protocol; its rows, or its failure, on every rank."""
        pending, self._pending_shards = self._pending_shards, None
        if pending is None:
            return []
        future, step, payload, fresh, final, kind = pending
        error: BaseException | None = None
        try:
            future.result()
        except Exception as exc:
            error = exc
        manager = self.checkpoints
        assert manager is not None

        def commit() -> list[ManifestRow]:
            if self.state.rank != 0:
                return []
            if error is not None:
                raise CheckpointError(
                    f"background sharded save of step {step} failed: {error}"
                ) from error
            return manager.save(
                step, payload, {"metrics": fresh}, final=final, kind=kind, begun=True
            )

        return self._from_zero(commit)

    def _from_zero(self, fn: Callable[[], Any]) -> Any:
        """Rank 0's `fn()` on every rank (each rank calls `fn`; rank 0's error raises on
        all); `fn()` itself without DDP."""
        if self._reducer is None:
            return fn()
        zero = self.state.rank == 0
        return broadcast(agreed(fn if zero else lambda: None))

    def _restore(self, manager: CheckpointManager, path: Path) -> None:
        """Load `path` into the model, optimizers, schedulers, objects, loop state and
        callbacks; the RNG comes back in `batches` (or here, when the loop never asks)."""
        payload = self._for_this_rank(manager.load(path))
        state = self.state
        self._load_training_state(payload, path)
        _load_callback_states(payload.get("callbacks") or {}, path, self.hooks)
        for name, obj in self.stateful.items():
            saved = (payload.get("objects") or {}).get(name)
            if saved is None:
                log.warning("resuming from %s: no saved state for stateful[%r]", path, name)
            else:
                obj.load_state_dict(saved)
        self.user_state.update(payload.get("user") or {})
        for key in self.loop_state:  # the driving loop's own entries, as they were saved
            if key in payload:
                self.loop_state[key] = payload[key]
        state.load_state_dict(payload["loop"])
        saved_loop = payload["loop"]
        self._epochs_started = int(saved_loop.get("epochs_started", 0))
        self._epoch_open = _RESTORED if saved_loop.get("epoch_open") else False
        state.metrics = dict(payload.get("metrics", {}))
        self._last = dict(payload.get("last_metrics", state.metrics))
        self._eval_metrics.update(payload.get("eval_metrics", {}))
        self._last_saved = state.step
        self._restored = payload
        set_rng_state(payload["rng"])  # `batches` re-draws an epoch's order first, if used

    def _for_this_rank(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The payload with this rank's own RNG states, when it was saved on as many ranks
        as run now (else rank 0's, which every rank then draws from alike)."""
        ranks = payload.get("ranks")
        state = self.state
        if not ranks or ranks.get("world_size") != state.world_size:
            return payload
        rank = state.rank
        return {**payload, "rng": ranks["rng"][rank], "epoch_rng": ranks["epoch_rng"][rank]}

    def _start_from(self, path: Path, full: bool) -> None:
        """Start at step 0 from another run's checkpoint: its weights, or its whole state.

        Even with `full` (``carry="full"``) the callbacks' states stay behind: a stage is a
        new run, and what a callback counted in the run before (EarlyStopping's best value
        and bad checks, StabilityMonitor's histories) is not this run's, so each starts
        fresh. Carrying them would let a stage be stopped at its first step for the previous
        stage's lack of progress. Model, optimizers, schedulers and grad scaler do carry:
        they are the training state a stage continues from.
        """
        payload = CheckpointManager(path.parent).load(path)
        if full:
            self._load_training_state(payload, path)
        elif payload.get("model") == SHARDED_MARK:
            load_shards(path, self.model, [])
        else:
            _load_model(self.model, payload, path)

    def _load_training_state(self, payload: dict[str, Any], path: Path) -> None:
        """Load the model, optimizers, schedulers and grad scaler; callbacks are the caller's."""
        if payload.get("model") == SHARDED_MARK:  # resharded onto the ranks that run now
            load_shards(path, self.model, list(self.optimizers.values()))
        else:
            _load_model(self.model, payload, path)
            _load_states("optimizer", self.optimizers, payload, path)
        _load_states("scheduler", self.schedulers, payload, path)
        if self.scaler is not None and payload.get("scaler") is not None:
            self.scaler.load_state_dict(payload["scaler"])

    def _checkpoint_manager(self, folder: Path | None, *, fresh: bool) -> CheckpointManager | None:
        if self.checkpoint is None:
            return None
        assert folder is not None  # checked in _start, before any hook
        root = Path(folder) / "checkpoints"
        if fresh and root.exists() and any(root.iterdir()):
            stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S-%f")
            aside = root.with_name(f"checkpoints.replaced-{stamp}")
            root.rename(aside)  # a fresh start never deletes what an earlier run saved
            log.warning("starting fresh: earlier checkpoints moved to %s", aside)
        return CheckpointManager(root, self.checkpoint, self.ctx.run_key or "")

    @staticmethod
    def _resume_path(manager: CheckpointManager, resume: bool | str | Path | int) -> Path | None:
        if resume is False:
            return None
        if resume is True:
            return manager.get_latest_checkpoint_path()
        return manager.resolve(resume)

    # ------------------------------------------------------------------------------------
    # evals
    def _run_eval(self, evaluator: Evaluator, step: int) -> EvalResult:
        result = self._evaluate(evaluator, step)
        self._evals.append(result)
        if result.error is None:
            if self._watch is not None:
                self._watch.after_eval(result.name, step, result.metrics, self.state.metrics)
            named = {f"{result.name}/{k}": v for k, v in result.metrics.items()}
            self._eval_metrics.update(named)
            if self._fresh_step != step:
                self._fresh, self._fresh_step = {}, step
            self._fresh.update(named)
        return result

    def _evaluate(self, evaluator: Evaluator, step: int) -> EvalResult:
        """Run one evaluator and fire its hooks; one that raises becomes a failed eval (its
        error and how long it ran), reported through `on_benchmark_eval`, and training goes
        on. While `on_eval` fires, `state.current_eval` is the whole result, so a sink can
        record its wall time and tags."""
        state, hooks = self.state, self.hooks
        started = time.perf_counter()
        try:
            result = evaluator.run(state.model, step, state=state, device=self.device)
        except Exception as exc:
            log.exception("evaluator %r failed at step %d; training goes on", evaluator.name, step)
            result = EvalResult(
                evaluator.name,
                {},
                step=step,
                seconds=time.perf_counter() - started,
                error=f"{type(exc).__name__}: {exc}",
            )
            hooks.fire(Hook.BENCHMARK_EVAL, state.ctx, result, [], step=step)
            return result
        state.current_eval = result
        try:
            hooks.fire(Hook.EVAL, state, step, result.name, result.metrics)
        finally:
            state.current_eval = None
        if result.benchmark:
            hooks.fire(Hook.BENCHMARK_EVAL, state.ctx, result, result.predictions, step=step)
        return result

    def _check_metric_names(self) -> MetricWatch | None:
        """Look up every metric name the callbacks and the checkpoint config need in what
        the loop, the evaluators and the callbacks declare."""
        needed = needed_by(self.hooks.callbacks)
        if self.checkpoint is not None and self.checkpoint.metric is not None:
            metric = self.checkpoint.metric
            needed.setdefault(metric, f"CheckpointConfig(metric={metric!r})")
        if not needed:
            return None
        return check_metric_names(
            needed,
            step_metrics=[*(self.declared or ()), *logged_by(self.hooks.callbacks)],
            step_open=self._open,
            evals={ev.name: ev.metrics for ev in self.evaluators},
        )

    def _check_running(self, what: str) -> None:
        if self._phase == _NEW:
            raise HookOrderError(
                f"{what}() before the run handle started: use `with RunHandle(...) as loop:` "
                "(or call loop.start() first)"
            )
        if self._phase == _ENDED:
            raise HookOrderError(
                f"{what}() after the run ended (at step {self.state.step}); nothing more can "
                "be logged to it"
            )


def _to_host(rows: list[dict[str, Any]], steps: list[int]) -> list[dict[str, float]]:
    """Each step's metrics as floats. The tensors are read in one transfer per device
    (stacked by dtype, then as float64: exactly the values `.item()` gives), whose one sync
    is the only wait for the device; on a CPU the same stack costs less than an `.item()`
    per value. A float passes as it is; other numbers convert through `as_number`."""
    out: list[dict[str, Any]] = []
    found: dict[torch.device, list[tuple[int, str, torch.Tensor]]] = {}
    for i, (row, step) in enumerate(zip(rows, steps, strict=True)):
        for key, value in row.items():
            if type(value) is float:  # most of them: a host value, one type test
                continue
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:  # the error that names the key and the step
                    as_number(str(key), step, value)
                found.setdefault(value.device, []).append((i, key, value))
            else:
                row[key] = as_number(str(key), step, value)
        out.append(row)
    for entries in found.values():
        by_dtype: dict[torch.dtype, list[int]] = {}
        for j, (_, _, tensor) in enumerate(entries):
            by_dtype.setdefault(tensor.dtype, []).append(j)
        parts = [torch.stack([entries[j][2].reshape(()) for j in js]) for js in by_dtype.values()]
        stacked = torch.cat([part.double() for part in parts])
        order = [j for js in by_dtype.values() for j in js]
        for j, value in zip(order, stacked.tolist(), strict=True):  # the one transfer
            i, key, _ = entries[j]
            out[i][key] = value
    return out


def _floats(metrics: Mapping[str, Any], step: int) -> dict[str, float]:
    """One step's metrics as floats: a float passes as it is (the common case costs one type
    test per metric); other numbers and CPU tensors are converted; a tensor on an
    accelerator sends the step through `_to_host`, for one transfer instead of one each."""
    out = dict(metrics)
    for key, value in out.items():
        if type(value) is not float:
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                return _to_host([out], [step])[0]
            out[key] = as_number(str(key), step, value)
    return out


def _states(kind: str, named: dict[str, Any]) -> dict[str, Any]:
    """The payload entries of the optimizers or schedulers: one under its own key (as
    checkpoints always had it), several under the plural, by name."""
    if not named:
        return {kind: None}
    if list(named) == [kind]:
        return {kind: named[kind].state_dict()}
    return {f"{kind}s": {name: obj.state_dict() for name, obj in named.items()}}


def _load_states(kind: str, named: dict[str, Any], payload: dict[str, Any], path: Path) -> None:
    if not named:
        return
    if list(named) == [kind]:
        saved = payload.get(kind)
        if saved is None and f"{kind}s" in payload:
            raise CheckpointError(
                f"checkpoint {path} holds {len(payload[f'{kind}s'])} {kind}s "
                f"({', '.join(map(repr, payload[f'{kind}s']))}) and the loop has one; resume "
                f"with the same {kind}s, or start fresh with resume=False"
            )
        if saved is not None:
            named[kind].load_state_dict(saved)
        return
    saved_all = payload.get(f"{kind}s") or {}
    missing = [name for name in named if name not in saved_all]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} has no state for {kind} {', '.join(map(repr, missing))} "
            f"(it holds: {', '.join(map(repr, saved_all)) or 'none'}); resume with the same "
            f"{kind}s, or start fresh with resume=False"
        )
    for name, obj in named.items():
        obj.load_state_dict(saved_all[name])


def _state_keys(stateful: Sequence[Callback], *, own: bool = True) -> dict[str, Callback]:
    """The key each stateful callback's state is saved under in a checkpoint.

    A callback's own `state_key` attribute if it sets one, else its class name, with
    ``#2``, ``#3``... for the later callbacks of one class (in dispatch order). Why: a key
    that depends only on the callback (not on its position among all of them, as the old
    ``"{index}:{Class}"`` keys did) still finds its state when other callbacks are added,
    removed or reordered for the resume. With `own` False, `state_key` is ignored (checkpoints
    with the old keys know only classes).
    """
    keys: dict[str, Callback] = {}
    seen: Counter[str] = Counter()
    for cb in stateful:
        name = type(cb).__name__
        key = getattr(cb, "state_key", None) if own else None
        if key is not None:
            if not isinstance(key, str) or not key or ":" in key:
                raise ConfigError(f"{name}.state_key={key!r}: use a non-empty string without ':'")
        else:
            seen[name] += 1
            key = name if seen[name] == 1 else f"{name}#{seen[name]}"
        if key in keys:
            raise ConfigError(
                f"two stateful callbacks save their state under {key!r} "
                f"({type(keys[key]).__name__} and {name}); give one of them another state_key"
            )
        keys[key] = cb
    return keys


def _from_index_keys(saved: dict[str, Any]) -> dict[str, Any] | None:
    """The states of a checkpoint with the old ``"{index}:{Class}"`` keys, under the keys
    `_state_keys` gives without `state_key` (the k-th saved state of a class goes to the
    k-th attached callback of it); None when the checkpoint has the current keys."""
    indexed: list[tuple[int, str, Any]] = []
    for key, value in saved.items():
        match = _INDEX_KEY.fullmatch(key)
        if match is None:
            return None
        indexed.append((int(match.group(1)), match.group(2), value))
    seen: Counter[str] = Counter()
    states: dict[str, Any] = {}
    for _, name, value in sorted(indexed, key=lambda entry: entry[0]):
        seen[name] += 1
        states[name if seen[name] == 1 else f"{name}#{seen[name]}"] = value
    return states if states else None


def _load_callback_states(saved: dict[str, Any], path: Path, hooks: Dispatcher) -> None:
    """Give each stateful callback the state saved under its key, on resume.

    One WARNING names the callbacks that find no saved state (they start fresh, so the
    resumed run may differ from one that never stopped) and the saved states that no
    attached callback takes (they are ignored); nothing is said when all match.
    """
    by_index = _from_index_keys(saved)
    if by_index is not None:
        saved = by_index
    keys = _state_keys(hooks.stateful(), own=by_index is None)
    for key, cb in keys.items():
        if key in saved:
            cb.load_state_dict(saved[key])
    fresh = [key for key in keys if key not in saved]
    unclaimed = [key for key in saved if key not in keys]
    parts = []
    if fresh:
        they = "it starts" if len(fresh) == 1 else "they start"
        parts.append(f"no saved state for {', '.join(fresh)} ({they} fresh)")
    if unclaimed:
        it = "it is" if len(unclaimed) == 1 else "they are"
        parts.append(
            f"no attached callback takes the saved state of {', '.join(unclaimed)} ({it} ignored)"
        )
    if parts:
        log.warning("resuming from %s: %s", path, "; ".join(parts))


def _load_model(model: torch.nn.Module, payload: dict[str, Any], path: Path) -> None:
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as exc:
        reason = " ".join(str(exc).split())
        raise CheckpointError(
            f"checkpoint {path} does not fit this model ({reason[:300]}); load a checkpoint "
            "of the same model, or start fresh with resume=False"
        ) from None
