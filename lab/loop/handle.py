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

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lab._distributed import MetricReducer, broadcast, init_from_launcher, rank_and_world
from lab._secrets import logger
from lab.dispatch import Dispatcher
from lab.errors import ConfigError, HookOrderError
from lab.hooks import Callback, LoopState
from lab.loop.bare import BareRun
from lab.loop.checkpoint_session import CheckpointSession, Progress, Writer
from lab.loop.checkpoints import CheckpointConfig, CheckpointManager
from lab.loop.evals import Evaluator
from lab.loop.feed import Feed
from lab.loop.metric_buffer import MetricBuffer, floats
from lab.loop.metric_names import MetricWatch, watch_names
from lab.loop.payload import state_keys
from lab.loop.run_evals import RunEvals
from lab.loop.settings import LoopSettings, Setting, named
from lab.loop.steps import check_no_epoch_settings
from lab.records import EvalResult, LoopArtifacts, ManifestRow, TrainingBatch

if TYPE_CHECKING:
    from lab.records import RunSpec

__all__ = ["RunHandle", "Writer"]

log = logger("lab.loop")

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
        checkpoint = settings.checkpoint
        if checkpoint is not None and not isinstance(checkpoint, CheckpointConfig):
            raise ConfigError(
                f"checkpoint={checkpoint!r}: pass a CheckpointConfig(...), or None for no saves"
            )
        self.optimizers = _checked_optimizers(optimizer)
        _check_stateful(settings.stateful)
        if settings.steps_per_epoch is None:  # an every_epochs evaluator would never run
            check_no_epoch_settings((), settings.evaluators)
        if settings.run_dir is not None:
            settings.run_dir = Path(settings.run_dir)
        self.run, self.model, self.loop_settings = run, model, settings
        self.schedulers = named("scheduler", settings.scheduler)
        #: The run's checkpoints: what each holds, how it is saved, committed and restored.
        self.checkpoint_session = CheckpointSession(
            settings.checkpoint, model, self.optimizers, self.schedulers, settings.scaler,
            settings.stateful,
        )  # fmt: skip
        self.progress: Progress = self.checkpoint_session.progress
        self._buffer = MetricBuffer(settings.log_every)  # the steps held (log_every)
        self._reducer: MetricReducer | None = None  # set under DDP, when the handle starts
        self._past = TrainingBatch()  # the batch a held step's on_step_end sees: no data
        self._open = settings.open
        self.state: LoopState
        self._manager: CheckpointManager | None = None  # the session's, once it is open
        self.resumed_from: Path | None = None
        self.artifacts: LoopArtifacts | None = None
        self._phase = _NEW
        self._bare: BareRun | None = None  # a run's own experiment, outside an Experiment
        self._own: Dispatcher | None = None  # under an Experiment: the handle's callbacks
        self._batch = TrainingBatch()
        self._begun = 0  # the step pre_step announced and end_step has not ended yet
        self._feed: Feed | None = None  # the passes `batches` draws from
        self._saved: list[ManifestRow] = []
        self._eval_metrics = self.progress.eval_metrics  # the last value of each eval metric
        # the last value logged of each step metric: a run's final values (lab._ranking)
        self._last = self.progress.last
        self._seen: set[str] = set()  # step metric names logged in this fit (ranking check)
        # Whether steps still add to `_seen`: only with a ranking metric not yet logged.
        self._ranking_open = checkpoint is not None and checkpoint.metric is not None
        self._watch: MetricWatch | None = None
        self._watch_step = False

    @property
    def declared(self) -> tuple[str, ...] | None:
        """The step metric names the loop declared (`metrics=`), or None."""
        return self.loop_settings.declared

    @property
    def checkpoints(self) -> CheckpointManager | None:
        """The run's `CheckpointManager` once the handle started (None without checkpoints)."""
        return self._manager

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
        self._manager = session.manager
        if self._manager is not None and path is not None:
            session.restore(path)
            self.resumed_from = path
            hooks.fire("post_checkpoint_loaded", state, path)
        parent = (run.parent_checkpoint, run.carry) if run is not None else (None, "weights")
        if self.resumed_from is None and parent[0] is not None:  # a chain's stage k
            session.start_from(parent[0], parent[1] == "full")
            hooks.fire("post_checkpoint_loaded", state, parent[0])
        self.model.train()
        hooks.fire("on_train_start", state)
        if state.step == 0:  # `at_start` evals score the untrained model, at step 0
            for evaluator in self.evaluators:
                if evaluator.at_start:
                    self._evals.run(evaluator, 0)
            if self._manager is not None and self.checkpoint.due(0, self.num_steps):
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
        settings = self.loop_settings
        self._watch = watch = watch_names(
            self.hooks.callbacks, settings.checkpoint, settings.declared, self._open,
            settings.evaluators,
        )  # fmt: skip
        self._watch_step = watch is not None and bool(watch.at_step)
        self._evals = RunEvals(settings.evaluators, settings.device, self._eval_metrics)
        self._buffer.every = self._buffer.in_effect(self.hooks.callbacks)
        if self.checkpoint is not None:
            if self._folder is None:
                raise ConfigError(
                    "checkpoints need a folder: run under an Experiment (or lab.start_run), "
                    "or pass run_dir=..."
                )
            state_keys(self.hooks.stateful())  # a clash fails here, before any step is spent
        elif self.resume not in (True, False):
            raise ConfigError(
                f"resume={self.resume!r} needs checkpoints: pass checkpoint=CheckpointConfig(...)"
            )
        return bare

    def _open_state(self) -> LoopState:
        """The model on its device, the process group of a bare fit under torchrun, and the
        run's `LoopState`; under DDP, the metric reducer."""
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
        self.checkpoint_session.attach(state, self.hooks)
        self._evals.attach(state, self.hooks, self._watch)
        if world > 1:
            self._reducer = MetricReducer(self.reduce)
            if self.log_every > 1:
                # rank 0 has every callback (rank_zero_only ones too): its choice holds for
                # all, so every rank materialises, and reduces, at the same steps
                self._buffer.every = broadcast(self._buffer.every)
        return state

    def finish(self) -> LoopArtifacts:
        """End the run cleanly: a final save if one is due, the wait for a save in flight,
        then `on_train_end`. Leaving the `with` block calls it."""
        self._check_running("finish")
        try:
            state, session = self.state, self.checkpoint_session
            self._materialise()  # the steps held since the last one, before what ends the run
            if self.progress.epoch_open is True:
                self.end_epoch()
            config = self.checkpoint
            if (
                self._manager is not None
                and config.save_at_end
                and state.step > 0
                and session.last_saved != state.step
            ):
                self._save_now(final=True)
            for row in session.commit_shards():  # an asynchronous sharded save commits
                self._saved.append(row)
                self.hooks.fire("on_checkpoint", state, row)
            # the final save is durable first (under DDP: rank 0's, its rows to all)
            for row in session.wait():
                self._saved.append(row)
                self.hooks.fire("on_checkpoint", state, row)
            self.artifacts = LoopArtifacts(
                model=self.model,
                metrics={**self._last, **self._eval_metrics},
                step=state.step,
                stopped=state.stop_requested,
                stop_reason=state.stop_reason,
                checkpoint_dir=self._manager.root if self._manager is not None else None,
                checkpoints=self._saved,
                evals=self._evals.results,
            )
            self.hooks.fire("on_train_end", state, self.artifacts)
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
            self._own.fire("close")
        return self.artifacts

    def fail(self, exc: BaseException) -> None:
        """Record that the loop raised `exc`: wait for a save in flight (never torn, never
        left running), fire `on_error` and `close`. Leaving the `with` block by an exception
        calls it; the exception goes on."""
        if self._phase == _ENDED:
            return
        self._phase = _ENDED
        self._materialise_on_error()
        self.checkpoint_session.abandon()
        if self._bare is not None:  # on_error, on_run_end, on_experiment_end, close
            self._bare.end(exc)
            return
        own = self._own
        if own is None:  # failed before the callbacks were known
            return
        try:
            own.fire("on_error", self.ctx, exc)
        finally:
            own.fire("close")

    def _materialise_on_error(self) -> None:
        """Record the steps held since the last materialisation, before `on_error`: they
        were trained. Not under DDP, where reading them takes a collective that a failing
        group may never complete: they are named in a WARNING instead."""
        buffer = self._buffer
        if not buffer.held:
            return
        steps = buffer.named()
        if self._reducer is not None:
            buffer.held = []
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
            self._check_running("pre_step")
        state = self.state
        step = state.step + 1
        if self._begun == step:
            raise HookOrderError(
                f"pre_step for step {step} twice: end the step with loop.end_step(metrics) first"
            )
        self._begun = step
        hb = self._wrap(batch)
        if self.hooks.listens("pre_step"):
            self.hooks.fire("pre_step", state, step, hb)
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
        step that reads them (`lab.loop.metric_buffer`): see `_logs_at` for when a step
        materialises. Until then `state.step` counts the held step as ended, and
        `state.metrics` stays the last materialised step's.
        """
        state = self.state if self._phase == _RUNNING else None
        if state is None:
            self._check_running("end_step")
        step = self._next_step(step)
        if self._buffer.every == 1:  # each step read as it ends (one collective under DDP)
            clean = floats(metrics, step)
            if self._reducer is not None:
                clean = self._reducer.reduce(clean, step)
        elif self._logs_at(step, save):
            clean = self._materialise(step, metrics)  # the held steps' on_step_end first
        else:
            self._hold(step, metrics, batch)  # nothing of it is read on the host yet
            return
        self._begun = 0
        state.step, state.metrics = step, clean
        settings, checkpoints = self.loop_settings, self._manager
        config, num_steps = settings.checkpoint, settings.num_steps
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
        if settings.evaluators:  # no list is built: a step with nothing due allocates nothing
            self._evals.run_due(step, num_steps or 0, settings.steps_per_epoch)
        last = step == num_steps or state.stop_requested
        if checkpoints is not None and (
            state.checkpoint_due or (save is None and last and config.save_at_end)
        ):
            self._save_now(final=last)
        if state.stop_requested and last:
            log.info("stopping after step %d: %s", step, state.stop_reason)

    def _next_step(self, step: int | None) -> int:
        """The step `end_step` ends: the one after the last ended step, or `step` if that is
        larger and not past `num_steps`."""
        done = self.state.step
        if step is None:
            step = done + 1
        elif isinstance(step, bool) or not isinstance(step, int) or step <= done:
            raise HookOrderError(
                f"end_step(step={step!r}) after step {done}: step numbers only go up; "
                f"end step {done + 1} (or leave step out)"
            )
        num_steps = self.loop_settings.num_steps
        if num_steps is not None and step > num_steps:
            raise HookOrderError(
                f"end_step(step={step}) past num_steps={num_steps}; stop at the last step"
            )
        return step

    def _fire_step_end(self, step: int, clean: dict[str, float], batch: Any) -> None:
        """`on_step_end` for an ended step whose metrics are floats now, and the checks of
        metric names that read them."""
        hooks = self.hooks
        if hooks.listens("on_step_end"):
            hb = self._batch if batch is None else self._wrap(batch)
            hooks.fire("on_step_end", self.state, step, hb, clean)
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
        materialisation, so a resumed run materialises where one that never stopped does.
        `finish`, `evaluate`, `log_eval`, `save`, `log_histogram`, `log_image`,
        `start_epoch` and `end_epoch` materialise first, and so does a failure (not under
        DDP)."""
        settings = self.loop_settings
        num_steps, spe = settings.num_steps, settings.steps_per_epoch
        if (
            step % self._buffer.every == 0
            or step == num_steps
            or self.state.stop_requested
            or self._watch_step
            or save
            or (spe is not None and step % spe == 0)
        ):
            return True
        if save is None and self._manager is not None and settings.checkpoint.due(step, num_steps):  # type: ignore[union-attr]
            return True
        if settings.evaluators:
            return any(ev.due(step, num_steps=num_steps or 0) for ev in settings.evaluators)
        return False

    def _hold(self, step: int, metrics: Mapping[str, Any], batch: Any) -> None:
        """End `step` without reading its metrics (`MetricBuffer.hold`)."""
        source = self._batch if batch is None else batch
        if isinstance(source, TrainingBatch):
            epoch, index = source.epoch, source.index
        else:
            epoch, index = self.state.epoch, self.state.batch_in_epoch - 1
        self._buffer.hold(step, metrics, epoch, index)
        self._begun = 0
        self.state.step = step

    def _materialise(
        self, step: int | None = None, metrics: Mapping[str, Any] | None = None
    ) -> dict[str, float] | None:
        """Read the held steps' metrics, and `metrics` of `step` (the step being ended), on
        the host in one transfer per device, reduce them across ranks in one collective,
        and fire each held step's `on_step_end` in step order, with `state.step` and
        `state.metrics` set to that step's; returns `step`'s floats."""
        if not self._buffer.held and metrics is None:
            return None
        held, clean = self._buffer.read(step, metrics, self._reducer)
        state, past = self.state, self._past
        ended = state.step
        for (done, _, epoch, index), values in zip(held, clean, strict=False):
            state.step, state.metrics, state.checkpoint_due = done, values, False
            past.epoch, past.index = epoch, index
            self._fire_step_end(done, values, past)
        state.step = ended
        return clean[-1] if metrics is not None else None

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
        if self.progress.epoch_open is True:
            raise HookOrderError(
                f"start_epoch({'' if epoch is None else epoch}) while epoch "
                f"{self.state.epoch} is open; call loop.end_epoch() first"
            )
        state = self.state
        if epoch is not None:
            if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
                raise ConfigError(f"start_epoch({epoch!r}): give the epoch as an int >= 0")
            state.epoch = epoch
        elif self.progress.epochs_started:  # the next epoch: with `batches`, a fresh pass
            before = state.epoch
            if self._feed is not None:
                self._feed.next_epoch()  # a no-op when the pass has not begun
            if state.epoch == before:
                state.epoch += 1
                state.batch_in_epoch = 0
        self.progress.epochs_started += 1
        self.progress.epoch_open = True
        self.hooks.fire("on_epoch_start", state, state.epoch)

    def end_epoch(self) -> None:
        """Fire `on_epoch_end` for the open epoch, after its last step, evals and saves."""
        self._check_running("end_epoch")
        self._materialise()  # on_epoch_end after the epoch's steps' on_step_end
        if not self.progress.epoch_open:
            raise HookOrderError("end_epoch() with no epoch open; call loop.start_epoch() first")
        self.progress.epoch_open = False
        self.hooks.fire("on_epoch_end", self.state, self.state.epoch)

    # ------------------------------------------------------------------------------------
    # evals and non-scalar values
    def evaluate(self, evaluator: Evaluator) -> EvalResult:
        """Run `evaluator` now, at the current step, and fire its hooks."""
        self._check_running("evaluate")
        self._materialise()
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
        self._materialise()
        preds = [dict(p) for p in predictions] if predictions is not None else []
        result = EvalResult(
            name, {str(k): v for k, v in metrics.items()}, predictions=preds, step=self.step
        )
        return self._evals.run(Evaluator(name, lambda _model: result), self.state.step)

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
        self.hooks.fire("on_media", self.state, step, {key: record})

    def log_image(self, key: str, image: Any) -> None:
        """Write `image` (a CHW/HWC tensor or array, or a matplotlib Figure) as a PNG in the
        run's folder and log a row that points to it, at the same step `log_histogram`
        would: fires `on_media`."""
        from lab.media import write_image

        self._check_running("log_image")
        self._materialise()
        step = self._media_step()
        record = write_image(self.ctx.folder, key, step, image)
        self.hooks.fire("on_media", self.state, step, {key: record})

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
        self.checkpoint_session.writers.append(writer)

    def save(self, *, final: bool = False) -> list[ManifestRow]:
        """Save a checkpoint now, at the current step, whatever the schedule says."""
        self._check_running("save")
        self._materialise()
        if self._manager is None:
            raise ConfigError("save() needs checkpoints: pass checkpoint=CheckpointConfig(...)")
        return self._save_now(final=final)

    def _save_now(self, *, final: bool = False) -> list[ManifestRow]:
        """Save now (`CheckpointSession.save`) and fire `on_checkpoint` for its rows."""
        evals, declared = self._evals, self.declared
        fresh = evals.fresh()
        steps_may = (declared is not None and self.checkpoint.metric in declared) or (
            self._open and not (self._seen or self._eval_metrics)  # nothing logged yet
        )
        evals.check_ranked(self.checkpoint.metric, fresh, self._seen, steps_may)
        rows = self.checkpoint_session.save(fresh, final=final)
        for row in rows:
            self._saved.append(row)
            self.hooks.fire("on_checkpoint", self.state, row)
        return rows

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


def _check_num_steps(num_steps: Any) -> None:
    if num_steps is not None and (
        isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1
    ):
        raise ConfigError(
            f"num_steps={num_steps!r}: give the number of steps, an int >= 1 "
            "(or None when the loop decides when to stop)"
        )


def _checked_optimizers(optimizer: Any) -> dict[str, Any]:
    """The optimizers by name; each must be a torch optimizer (it is saved and restored)."""
    optimizers = named("optimizer", optimizer)
    for name, opt in optimizers.items():
        if not (hasattr(opt, "param_groups") and callable(getattr(opt, "state_dict", None))):
            raise ConfigError(
                f"optimizer {name!r} is a {type(opt).__name__}; pass a torch optimizer, a "
                "list of them, or a dict of named ones"
            )
    return optimizers


def _check_stateful(stateful: Mapping[str, Any]) -> None:
    for name, obj in stateful.items():
        if not (callable(getattr(obj, "state_dict", None)) and hasattr(obj, "load_state_dict")):
            raise ConfigError(
                f"stateful[{name!r}] is a {type(obj).__name__} without state_dict() and "
                "load_state_dict(); keep plain values in loop.user_state instead"
            )
