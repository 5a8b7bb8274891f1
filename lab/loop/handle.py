"""The run handle: one run's loop lifecycle, whatever loop drives it.

`RunHandle`, with its parts, is what fires the loop's hooks (`post_checkpoint_loaded`,
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

The handle's parts: `LoopSettings` (`lab.loop.settings`), `StepEnds` (`lab.loop.step_end`:
a step's metrics read or held, and its `on_step_end`), `CheckpointSession`
(`lab.loop.checkpoint_session`), `RunEvals` (`lab.loop.run_evals`) and `Feed`
(`lab.loop.feed`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from lab._secrets import logger
from lab.dispatch import Dispatcher
from lab.errors import ConfigError, HookOrderError
from lab.hooks import Callback, Hook, LoopState
from lab.loop.bare import BareRun
from lab.loop.checkpoint_session import CheckpointSession, Progress, Writer
from lab.loop.checkpoints import CheckpointConfig, CheckpointManager
from lab.loop.evals import Evaluator
from lab.loop.feed import Feed
from lab.loop.run_evals import RunEvals
from lab.loop.settings import LoopSettings, Setting, named
from lab.loop.step_end import StepEnds
from lab.records import EvalResult, LoopArtifacts, ManifestRow, TrainingBatch

if TYPE_CHECKING:
    from lab.records import RunSpec

__all__ = ["RunHandle", "Writer"]

log = logger("lab.loop")
#: The hooks of every step, looked up once: a module global costs less than an enum member.
_PRE_STEP = Hook.PRE_STEP

_NEW, _RUNNING, _ENDED = "new", "running", "ended"


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

    Under DDP, and with `log_every`, see the module's docstring.

    Misuse is one `HookOrderError` line: a step that goes backwards, a step logged before
    the handle started or after it ended, a step begun twice, or a step never ended.
    """

    # the settings, as attributes of the handle (`lab.loop.settings`)
    num_steps = Setting()
    scaler = Setting()
    checkpoint = Setting()
    evaluators = Setting()
    callbacks = Setting()
    device = Setting()
    resume = Setting()
    run_dir = Setting()
    stateful = Setting()
    steps_per_epoch = Setting()
    #: How each step metric is reduced across ranks under DDP (default: the mean).
    reduce = Setting()
    #: Steps between two materialisations of the step metrics (see `end_step`).
    log_every = Setting()

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
        _check_num_steps(num_steps)
        settings = LoopSettings(
            num_steps=num_steps, scheduler=scheduler, scaler=scaler, checkpoint=checkpoint,
            evaluators=evaluators, callbacks=callbacks, device=device, resume=resume,
            run_dir=run_dir, metrics=metrics, more_metrics=more_metrics, stateful=stateful,
            steps_per_epoch=steps_per_epoch, reduce=reduce, log_every=log_every,
        )  # fmt: skip
        self._configure(run, model, optimizer, settings)

    @classmethod
    def from_settings(
        cls, run: RunSpec | None, model: torch.nn.Module, optimizer: Any, settings: LoopSettings
    ) -> RunHandle:
        """A handle with a loop's `LoopSettings` (a copy: the handle's own), as `TrainingLoop`
        and `OnPolicyLoop` make theirs; the same as passing each setting by keyword."""
        _check_num_steps(settings.num_steps)
        handle = cls.__new__(cls)
        handle._configure(run, model, optimizer, replace(settings))
        return handle

    def _configure(
        self, run: RunSpec | None, model: torch.nn.Module, optimizer: Any, settings: LoopSettings
    ) -> None:
        self.optimizers = settings.for_run(optimizer)
        self.run, self.model, self.loop_settings = run, model, settings
        self.schedulers = named("scheduler", settings.scheduler)
        #: The run's checkpoints: what each holds, how it is saved, committed and restored.
        self.checkpoint_session = CheckpointSession(
            settings.checkpoint, model, self.optimizers, self.schedulers, settings.scaler,
            settings.stateful,
        )  # fmt: skip
        self.progress: Progress = self.checkpoint_session.progress
        self._steps = StepEnds(settings, self.progress)  # read, held, announced
        self.state: LoopState
        self.resumed_from: Path | None = None
        self.artifacts: LoopArtifacts | None = None
        self._phase = _NEW
        self._bare: BareRun | None = None  # a run's own experiment, outside an Experiment
        self._own: Dispatcher | None = None  # under an Experiment: the handle's callbacks
        self._feed: Feed | None = None  # the passes `batches` draws from
        self._saved: list[ManifestRow] = []

    @property
    def declared(self) -> tuple[str, ...] | None:
        """The step metric names the loop declared (`metrics=`), or None."""
        return self.loop_settings.declared

    @property
    def checkpoints(self) -> CheckpointManager | None:
        """The run's `CheckpointManager` once the handle started (None without checkpoints)."""
        return self.checkpoint_session.manager

    @property
    def user_state(self) -> dict[str, Any]:
        """Plain values (numbers, strings, lists, dicts, tensors) kept in each checkpoint and
        given back on resume."""
        return self.checkpoint_session.user_state

    @property
    def loop_state(self) -> dict[str, Any]:
        """Extra payload entries a loop that drives the handle keeps in each checkpoint; on
        resume, each key set before `start` gets the value the checkpoint saved under it."""
        return self.checkpoint_session.loop_state

    @property
    def save_kind(self) -> Callable[[int, bool], Any] | None:
        """How a save at (step, final) is kept ("regular", "fixed", "ephemeral"), for a loop
        that counts `CheckpointConfig`'s steps in units of its own; None: the config's."""
        return self.checkpoint_session.save_kind

    @save_kind.setter
    def save_kind(self, kind: Callable[[int, bool], Any] | None) -> None:
        self.checkpoint_session.save_kind = kind

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
        bare = self._open_callbacks()
        hooks, session = self.hooks, self.checkpoint_session
        if bare is not None:
            bare.open()  # on_experiment_start, on_group_start, on_run_start
        state = self._open_state()
        path = session.open(self._folder, self.ctx.run_key or "", self.resume)
        self._steps.saving = self.loop_settings.checkpoint if session.manager is not None else None
        if session.manager is not None and path is not None:
            session.restore(path)
            self.resumed_from = path
            hooks.fire(Hook.POST_CHECKPOINT_LOADED, state, path)
        parent = (run.parent_checkpoint, run.carry) if run is not None else (None, "weights")
        if self.resumed_from is None and parent[0] is not None:  # a chain's stage k
            session.start_from(parent[0], parent[1] == "full")
            hooks.fire(Hook.POST_CHECKPOINT_LOADED, state, parent[0])
        self.model.train()
        hooks.fire(Hook.TRAIN_START, state)
        if state.step == 0:  # `at_start` evals score the untrained model, at step 0
            self._evals.run_at_start()
            if session.manager is not None and self.checkpoint.due(0, self.num_steps):
                self._save_now()

    def _open_callbacks(self) -> BareRun | None:
        """The run's context and callbacks (a bare fit's experiment of its own, returned to be
        opened), then the checks of the settings: what they get wrong fails here, before any
        hook (a bare fit records nothing)."""
        run, bare = self.run, None
        if run is None:  # outside an Experiment: an experiment of its own (lab.loop.bare)
            self._bare = bare = BareRun(self.callbacks, self.run_dir)
            self.ctx, self.hooks = bare.ctx, bare.hooks
            self._folder = self.run_dir
        else:
            self.ctx = run.ctx
            self._folder = run.dir
            self.hooks = run.dispatcher.extended(self.callbacks)
            self._own = run.dispatcher.sibling(self.callbacks)  # the Experiment owns the rest
        self._steps.open(self.hooks)
        self._evals = RunEvals(self.evaluators, self.device, self.progress.eval_metrics)
        self.checkpoint_session.check(self._folder, self.resume, self.hooks)
        return bare

    def _open_state(self) -> LoopState:
        """The run's `LoopState` (`LoopSettings.new_state`), given to the parts."""
        self.state = state = self.loop_settings.new_state(self.ctx, self.model, self.optimizers)
        self.checkpoint_session.attach(state, self.hooks)
        self._evals.attach(state, self.hooks, self._steps.watch)
        self._steps.attach(state)
        return state

    def finish(self) -> LoopArtifacts:
        """End the run cleanly: a final save if one is due, the wait for a save in flight,
        then `on_train_end`. Leaving the `with` block calls it."""
        self._check_running("finish")
        try:
            state, session = self.state, self.checkpoint_session
            self._steps.materialise()  # the steps held, before what ends the run
            if self.progress.epoch_open is True:
                self.end_epoch()
            if session.due_at_end(state.step):
                self._save_now(final=True)
            self._saves(session.commit_shards())  # an asynchronous sharded save commits
            # the final save is durable first (under DDP: rank 0's, its rows to all)
            self._saves(session.wait())
            self.artifacts = LoopArtifacts(
                model=self.model,
                metrics={**self.progress.last, **self.progress.eval_metrics},
                step=state.step,
                stopped=state.stop_requested,
                stop_reason=state.stop_reason,
                pruned=state.pruned if state.stop_requested else None,
                checkpoint_dir=session.manager.root if session.manager is not None else None,
                checkpoints=self._saved,
                evals=self._evals.results,
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
        self._steps.materialise_on_error()
        self.checkpoint_session.abandon()
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
        state, settings = self.state, self.loop_settings
        while not state.stop_requested and (
            settings.num_steps is None or state.step < settings.num_steps
        ):
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
        feed = self._feed = self.feed(data)
        while True:
            yield feed.take()[0]

    def feed(
        self, data: Iterable[Any], accumulate: int = 1, steps_per_epoch: int | None = None
    ) -> Feed:
        """`data`'s micro-batches, `accumulate` a step, with the data position kept in each
        checkpoint and restored on resume (`lab.loop.feed`): what `batches` and
        `TrainingLoop` draw from."""
        return Feed(data, accumulate, steps_per_epoch, self.state, self.checkpoint_session)

    def pre_step(self, batch: Any = None) -> TrainingBatch:
        """Announce the next step with its batch (on its device): fires `pre_step`.

        Returns the `TrainingBatch` the hooks saw (one object reused for every step).
        Optional: a loop with nothing to announce calls only `end_step`.
        """
        if self._phase != _RUNNING:
            _not_running(self, "pre_step")
        state, steps = self.state, self._steps
        step = steps.begin(state.step + 1)
        hb = steps.wrap(batch)
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
        step that reads them (`lab.loop.metric_buffer`): see `StepEnds.reads_at` for when a step
        materialises. Until then `state.step` counts the held step as ended, and
        `state.metrics` stays the last materialised step's.
        """
        if self._phase != _RUNNING:
            _not_running(self, "end_step")
        state, steps = self.state, self._steps
        step = steps.next_step(step)
        clean = steps.read(step, metrics, batch, save)  # held steps' on_step_end first
        if clean is None:  # held: nothing of it is read on the host yet
            return
        state.step, state.metrics = step, clean
        settings, checkpoints = self.loop_settings, self.checkpoint_session.manager
        config, num_steps = settings.checkpoint, settings.num_steps
        # Sinks see that a save follows this step and make what they hold durable before
        # the checkpoint commits (a kill in between must not lose the step's metrics).
        state.checkpoint_due = self.checkpoint_session.due(step, save, num_steps)
        steps.fire(step, clean, batch)  # on_step_end
        if settings.evaluators:  # no list is built: a step with nothing due allocates nothing
            self._evals.run_due(step, num_steps or 0, settings.steps_per_epoch)
        last = step == num_steps or state.stop_requested
        if checkpoints is not None and (
            state.checkpoint_due
            or (save is None and last and config is not None and config.save_at_end)
        ):
            self._save_now(final=last)
        if state.stop_requested and last:
            log.info("stopping after step %d: %s", step, state.stop_reason)

    # ------------------------------------------------------------------------------------
    # epochs
    def start_epoch(self, epoch: int | None = None) -> None:
        """Fire `on_epoch_start` for the next epoch, or for `epoch` when given.

        Epochs count from 0; each call after the first starts the next one, and with
        `batches` a fresh pass over the data. A run resumed from a save made inside an
        epoch may end that epoch (`end_epoch`) or start the next one.
        """
        self._check_running("start_epoch")
        self._steps.materialise()
        feed = self._feed
        self.progress.begin_epoch(self.state, epoch, None if feed is None else feed.next_epoch)
        self.hooks.fire(Hook.EPOCH_START, self.state, self.state.epoch)

    def end_epoch(self) -> None:
        """Fire `on_epoch_end` for the open epoch, after its last step, evals and saves."""
        self._check_running("end_epoch")
        self._steps.materialise()  # on_epoch_end after the epoch's steps' on_step_end
        self.progress.close_epoch()
        self.hooks.fire(Hook.EPOCH_END, self.state, self.state.epoch)

    # ------------------------------------------------------------------------------------
    # evals and non-scalar values
    def evaluate(self, evaluator: Evaluator) -> EvalResult:
        """Run `evaluator` now, at the current step, and fire its hooks."""
        self._check_running("evaluate")
        self._steps.materialise()
        return self._evals.run(evaluator, self.state.step)

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
        self._steps.materialise()
        return self._evals.log(name, metrics, predictions, self.state.step)

    def log_histogram(
        self, key: str, values: Any, *, bins: int = 64, range: tuple[float, float] | None = None
    ) -> None:
        """Log the distribution of `values` (a tensor, array or list) as a histogram row at
        the step in progress (announced by `pre_step`), else at the last ended step: fires
        `on_media`."""
        from lab.media import histogram

        self._check_running("log_histogram")
        self._steps.materialise()
        record = histogram(values, bins=bins, range=range)
        step = self._media_step()
        self.hooks.fire(Hook.MEDIA, self.state, step, {key: record})

    def log_image(self, key: str, image: Any) -> None:
        """Write `image` (a CHW/HWC tensor or array, or a matplotlib Figure) as a PNG in the
        run's folder and log a row that points to it, at the same step `log_histogram`
        would: fires `on_media`."""
        from lab.media import write_image

        self._check_running("log_image")
        self._steps.materialise()
        step = self._media_step()
        record = write_image(self.ctx.folder, key, step, image)
        self.hooks.fire(Hook.MEDIA, self.state, step, {key: record})

    def _media_step(self) -> int:
        """The step in progress when `pre_step` announced one, else the last ended step (a
        histogram of what a step left, logged after `end_step`)."""
        return self._steps.begun or self.state.step

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
        self.checkpoint_session.writers.append(writer)

    def save(self, *, final: bool = False) -> list[ManifestRow]:
        """Save a checkpoint now, at the current step, whatever the schedule says."""
        self._check_running("save")
        self._steps.materialise()
        if self.checkpoint_session.manager is None:
            raise ConfigError("save() needs checkpoints: pass checkpoint=CheckpointConfig(...)")
        return self._save_now(final=final)

    def _save_now(self, *, final: bool = False) -> list[ManifestRow]:
        """Save now (`CheckpointSession.save`) and fire `on_checkpoint` for its rows."""
        evals, steps, metric = self._evals, self._steps, self.checkpoint.metric
        fresh = evals.fresh()
        evals.check_ranked(metric, fresh, steps.seen, steps.may_log(metric))
        return self._saves(self.checkpoint_session.save(fresh, final=final))

    def _saves(self, rows: list[ManifestRow]) -> list[ManifestRow]:
        """Fire `on_checkpoint` for each row of a committed save, in save order."""
        for row in rows:
            self._saved.append(row)
            self.hooks.fire(Hook.CHECKPOINT, self.state, row)
        return rows

    def _check_running(self, what: str) -> None:
        if self._phase != _RUNNING:
            _not_running(self, what)


def _not_running(handle: RunHandle, what: str) -> NoReturn:
    """Refuse `what` on a handle that has not started yet, or has ended."""
    if handle._phase == _NEW:
        raise HookOrderError(
            f"{what}() before the run handle started: use `with RunHandle(...) as loop:` "
            "(or call loop.start() first)"
        )
    raise HookOrderError(
        f"{what}() after the run ended (at step {handle.state.step}); nothing more can be "
        "logged to it"
    )


def _check_num_steps(num_steps: Any) -> None:
    if num_steps is not None and (
        isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1
    ):
        raise ConfigError(
            f"num_steps={num_steps!r}: give the number of steps, an int >= 1 "
            "(or None when the loop decides when to stop)"
        )
