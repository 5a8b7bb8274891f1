"""The torch training loop. `TrainingLoop.fit` reads top to bottom: set up, loop, save, end."""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lab._metrics import as_number
from lab._secrets import logger
from lab._seeding import rng_state, set_rng_state
from lab.errors import CheckpointError, ConfigError, LossError
from lab.hooks import Callback, Dispatcher, LogContext, LoopState
from lab.loop.checkpoints import CheckpointConfig, CheckpointManager, ManifestRow
from lab.loop.evals import EvalResult, Evaluator
from lab.loop.metric_names import (
    LOOP_METRICS,
    MetricWatch,
    check_metric_names,
    logged_by,
    needed_by,
)

if TYPE_CHECKING:
    from lab.experiment import RunSpec

log = logger("lab.loop")

_END = object()

# Callback states in checkpoints written before they were keyed by class: "{index}:{Class}",
# the index counting the stateful callbacks in dispatch order. New keys never hold a ":".
_INDEX_KEY = re.compile(r"(\d+):(\w+)")

LossFn = Callable[[torch.nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, dict[str, Any]]"]


class TrainingBatch:
    """The batch of the current step, as hooks see it: the data and where it came from.

    The loop reuses one instance for every step, so a hook that wants to keep a batch
    must copy `data`.
    """

    __slots__ = ("data", "epoch", "index")

    def __init__(self) -> None:
        self.data: Any = None
        self.epoch = 0
        self.index = 0

    @property
    def size(self) -> int | None:
        """Samples in the batch: the first dimension of its first tensor that has one (a
        0-dim ``num_tokens`` tensor beside the inputs is not a batch), else None."""
        tensor = _first_tensor(self.data)
        return None if tensor is None else int(tensor.shape[0])


@dataclass
class LoopArtifacts:
    """What a fit leaves behind: the model, its final metrics and where it stopped."""

    model: torch.nn.Module
    metrics: dict[str, float]
    step: int
    stopped: bool = False
    stop_reason: str | None = None
    checkpoint_dir: Path | None = None
    checkpoints: list[ManifestRow] = field(default_factory=list)
    evals: list[EvalResult] = field(default_factory=list)


class TrainingLoop:
    """Trains `model` for `num_steps` optimizer steps and fires every loop hook in place.

    `loss_fn(model, batch)` returns a scalar loss tensor, or `(loss, metrics)` to log more;
    `loss_metrics` names the keys of those metrics, when they are known. With them, and
    `Evaluator(metrics=...)`, a metric name that a callback or the checkpoint config needs
    but nothing logs is an error before the first step (see `lab.loop.metric_names`).
    `data` is any iterable of batches and is iterated again at each epoch's end.

    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> data = [(torch.ones(4, 2), torch.zeros(4, 1))]
    >>> loop = TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
    ...                     lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), 3)
    >>> loop.fit().step
    3
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data: Iterable[Any],
        loss_fn: LossFn,
        num_steps: int,
        *,
        scheduler: Any | None = None,
        scaler: torch.amp.GradScaler | None = None,
        grad_clip: float | None = None,
        device: str | torch.device | None = None,
        evaluators: Sequence[Evaluator] = (),
        checkpoint: CheckpointConfig | None = None,
        callbacks: Sequence[Callback] = (),
        loss_metrics: Sequence[str] | None = None,
    ) -> None:
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ConfigError(f"num_steps={num_steps!r}: give the number of steps, an int >= 1")
        if grad_clip is not None and not grad_clip > 0:
            raise ConfigError(f"grad_clip={grad_clip!r}: use a positive max norm, or None")
        names = [ev.name for ev in evaluators]
        if len(set(names)) != len(names):
            raise ConfigError(f"evaluator names must be unique, got {names}")
        self.model = model
        self.optimizer = optimizer
        self.data = data
        self.loss_fn = loss_fn
        self.num_steps = num_steps
        self.scheduler = scheduler
        self.scaler = scaler
        self.grad_clip = grad_clip
        self.device = torch.device(device) if device is not None else None
        self.evaluators = list(evaluators)
        self.checkpoint = checkpoint
        self.callbacks = list(callbacks)
        if isinstance(loss_metrics, str):
            raise ConfigError(f"loss_metrics={loss_metrics!r}: give a list of keys, e.g. ['acc']")
        self.loss_metrics = tuple(loss_metrics) if loss_metrics is not None else None
        self._epoch_rng: dict[str, Any] | None = None  # RNG at the current epoch's start
        self._async_manager: CheckpointManager | None = None  # has a save in flight
        self._watch: MetricWatch | None = None  # needed metric names to look for, this fit

    # ------------------------------------------------------------------------------------
    def fit(
        self,
        run: RunSpec | None = None,
        *,
        run_dir: str | Path | None = None,
        resume: bool | str | Path | int = True,
    ) -> LoopArtifacts:
        """Train, firing the loop's hooks; under an Experiment pass the `run` it handed you.

        With checkpoints on, `fit` resumes from the run's newest committed checkpoint
        (``resume=True``), from a given checkpoint folder or step (``resume=path`` or
        ``resume=57``), or starts fresh (``resume=False``: earlier checkpoints are moved
        aside to ``checkpoints.replaced-<time>``, never deleted). A resumed run continues the
        same trajectory: model, optimizer, scheduler, step, data position, every RNG and each
        stateful callback come back as they were (a callback's state is found by its
        `state_key`, else its class name, so other callbacks attached since do not matter;
        one WARNING names what finds no match).

        Without a run (a bare loop) the loop's own callbacks are dispatched, `close()` is
        called at the end, and checkpoints go under `run_dir`.
        """
        bare = run is None
        if bare:
            folder = Path(run_dir) if run_dir is not None else None
            ctx = LogContext(
                experiment="",
                output_dir=folder.parent if folder is not None else Path.cwd(),
                run_key=folder.name if folder is not None else None,
            )
            dispatcher = Dispatcher(self.callbacks)
        else:
            ctx = run.ctx
            dispatcher = run.dispatcher.extended(self.callbacks)
            folder = run.dir
        # The loop owns its own callbacks' on_error and close; an Experiment owns the rest.
        own = dispatcher if bare else dispatcher.sibling(self.callbacks)
        try:
            parent = (run.parent_checkpoint, run.carry) if run is not None else (None, "weights")
            return self._fit(ctx, dispatcher, folder, resume, parent)
        except BaseException as exc:
            self._join_async_save()  # never leave a checkpoint thread running past fit
            own.fire("on_error", ctx, exc)
            raise
        finally:
            own.fire("close")

    def _fit(
        self,
        ctx: LogContext,
        hooks: Dispatcher,
        folder: Path | None,
        resume: bool | str | Path | int,
        parent: tuple[Path | None, str] = (None, "weights"),
    ) -> LoopArtifacts:
        # -- set up ------------------------------------------------------------------------
        watch = self._check_metric_names(hooks)  # a metric nothing logs: fail before a step
        model, optimizer = self.model, self.optimizer
        if self.device is not None:
            model.to(self.device)
        state = LoopState(ctx=ctx, model=model, optimizer=optimizer, num_steps=self.num_steps)
        checkpoints = self._checkpoint_manager(folder, ctx, fresh=resume is False)
        if checkpoints is not None:
            _state_keys(hooks.stateful())  # a clash fails here, before any step is spent
        eval_metrics: dict[str, float] = {}
        restored = None
        if checkpoints is not None:
            checkpoints.remove_stale_tmp()
            path = self._resume_path(checkpoints, resume)
            if path is not None:
                restored = self._restore(checkpoints, path, state, hooks)
                eval_metrics.update(restored.get("eval_metrics", {}))
                hooks.fire("post_checkpoint_loaded", state, path)
        elif resume not in (True, False):
            raise ConfigError(
                f"resume={resume!r} needs checkpoints: pass checkpoint=CheckpointConfig(...)"
            )
        if restored is None and parent[0] is not None:  # a chain's stage k: start from k-1
            self._start_from(parent[0], parent[1] == "full", state)
            hooks.fire("post_checkpoint_loaded", state, parent[0])
        saved: list[ManifestRow] = []
        evals: list[EvalResult] = []
        params = [p for p in model.parameters() if p.requires_grad]
        grad_clip = self.grad_clip
        scaler = self.scaler
        evaluators = self.evaluators
        batch = TrainingBatch()
        batches = self._batches(state, restored)
        fire = hooks.fire
        wants_pre_step = hooks.listens("pre_step")
        wants_step_end = hooks.listens("on_step_end")
        watch_step = watch is not None and bool(watch.at_step)  # the first step only
        self._watch = watch
        model.train()

        fire("on_train_start", state)
        if state.step == 0:  # `at_start` evals score the untrained model, at step 0
            for evaluator in evaluators:
                if evaluator.at_start:
                    self._run_eval(evaluator, state, hooks, 0, evals, eval_metrics)
            if checkpoints is not None and self.checkpoint.due(0, num_steps=self.num_steps):
                for row in self._save(checkpoints, state, hooks, eval_metrics):
                    saved.append(row)
                    fire("on_checkpoint", state, row)
        for step_idx in range(state.step + 1, self.num_steps + 1):
            # -- one step ----------------------------------------------------------------
            batch.data = next(batches)
            batch.epoch, batch.index = state.epoch, state.batch_in_epoch - 1
            if self.device is not None:
                batch.data = _to_device(batch.data, self.device)
            if wants_pre_step:
                fire("pre_step", state, step_idx, batch)
            started = time.perf_counter()
            loss, extra = _unpack_loss(self.loss_fn(model, batch.data))
            optimizer.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()
                grad_norm = _grad_norm(params, grad_clip) if params else None
                lr = float(optimizer.param_groups[0]["lr"])  # the rate this step used
                optimizer.step()
            else:  # AMP: the norm and the clipping see the unscaled gradients
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                grad_norm = _grad_norm(params, grad_clip) if params else None
                lr = float(optimizer.param_groups[0]["lr"])
                scaler.step(optimizer)  # skipped when the gradients overflowed
                scaler.update()
            if self.scheduler is not None:
                self.scheduler.step()
            metrics = {
                "loss": loss.item(),
                "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
                "step_time": time.perf_counter() - started,
            }
            if extra:
                metrics.update(_metric_floats(extra, step_idx))
            state.step, state.metrics = step_idx, metrics
            # Sinks see that a save follows this step and make what they hold durable before
            # the checkpoint commits (a kill in between must not lose the step's metrics).
            # A save due only as an ephemeral one is skipped while a callback blocks those.
            state.checkpoint_due = (
                checkpoints is not None
                and self.checkpoint.due(step_idx, num_steps=self.num_steps)
                and not (
                    state.ephemeral_checkpoints_blocked
                    and self.checkpoint.is_ephemeral(step_idx, self.num_steps)
                )
            )
            if wants_step_end:
                fire("on_step_end", state, step_idx, batch, metrics)
            if watch_step:  # needed names no source declared: looked for once
                watch_step = False
                watch.after_step(step_idx, metrics)  # type: ignore[union-attr]

            # -- in-loop evals -----------------------------------------------------------
            if evaluators:  # no list is built: a step with nothing due allocates nothing
                for evaluator in evaluators:
                    if evaluator.due(step_idx, num_steps=self.num_steps):
                        self._run_eval(evaluator, state, hooks, step_idx, evals, eval_metrics)

            # -- checkpoint --------------------------------------------------------------
            last = step_idx == self.num_steps or state.stop_requested
            if checkpoints is not None and (
                state.checkpoint_due or (last and self.checkpoint.save_at_end)
            ):
                for row in self._save(checkpoints, state, hooks, eval_metrics, final=last):
                    saved.append(row)
                    fire("on_checkpoint", state, row)
            if state.stop_requested:
                log.info("stopping after step %d: %s", step_idx, state.stop_reason)
                break

        # -- end ---------------------------------------------------------------------------
        if checkpoints is not None and checkpoints.in_flight:  # the final save is durable
            self._async_manager = None
            for row in checkpoints.wait():  # before on_train_end; failures raise here
                saved.append(row)
                fire("on_checkpoint", state, row)
        artifacts = LoopArtifacts(
            model=model,
            metrics={**state.metrics, **eval_metrics},
            step=state.step,
            stopped=state.stop_requested,
            stop_reason=state.stop_reason,
            checkpoint_dir=checkpoints.root if checkpoints is not None else None,
            checkpoints=saved,
            evals=evals,
        )
        fire("on_train_end", state, artifacts)
        return artifacts

    # ------------------------------------------------------------------------------------
    def _batches(self, state: LoopState, restored: dict[str, Any] | None) -> Iterator[Any]:
        """Yield batches forever, advancing the epoch each time `data` runs out.

        The RNG state at the start of each epoch is kept (`self._epoch_rng`): the order of a
        shuffled epoch is drawn when its iterator is created, so a resume re-creates the
        epoch's iterator from that state, skips the batches already taken, and only then
        restores the RNG of the checkpoint.
        """
        first_pass = True
        while True:
            if restored is not None and restored.get("epoch_rng") is None:
                set_rng_state(restored["rng"])  # saved before the first epoch began
                restored = None
            if restored is not None:
                set_rng_state(restored["epoch_rng"])
                self._epoch_rng = restored["epoch_rng"]
                items = iter(self.data)
                for taken in range(state.batch_in_epoch):
                    if next(items, _END) is _END:
                        raise CheckpointError(
                            f"the data has {taken} batches in epoch {state.epoch}, but the "
                            f"checkpoint was taken after {state.batch_in_epoch}; resume with "
                            "the same data, or start fresh with resume=False"
                        )
                set_rng_state(restored["rng"])
                restored, empty = None, state.batch_in_epoch == 0
            else:
                self._epoch_rng = rng_state()
                items, empty = iter(self.data), True
            for item in items:
                empty = False
                state.batch_in_epoch += 1
                yield item
            if empty and first_pass:
                raise ConfigError("data yielded no batches; give TrainingLoop a non-empty iterable")
            if empty:
                raise ConfigError(
                    "data yielded no batches in its second epoch: it is a one-shot iterator; "
                    "pass a re-iterable such as a list or a DataLoader"
                )
            first_pass = False
            state.epoch += 1
            state.batch_in_epoch = 0

    def _run_eval(
        self,
        evaluator: Evaluator,
        state: LoopState,
        hooks: Dispatcher,
        step_idx: int,
        evals: list[EvalResult],
        eval_metrics: dict[str, float],
    ) -> None:
        result = self._evaluate(evaluator, state, hooks, step_idx)
        evals.append(result)
        if self._watch is not None and result.error is None:
            self._watch.after_eval(result.name, step_idx, result.metrics, state.metrics)
        eval_metrics.update({f"{result.name}/{k}": v for k, v in result.metrics.items()})

    def _evaluate(
        self, evaluator: Evaluator, state: LoopState, hooks: Dispatcher, step_idx: int
    ) -> EvalResult:
        """Run one evaluator and fire its hooks; one that raises becomes a failed eval (its
        error and how long it ran), reported through `on_benchmark_eval`, and training goes
        on. While `on_eval` fires, `state.current_eval` is the whole result, so a sink can
        record its wall time and tags."""
        started = time.perf_counter()
        try:
            result = evaluator.run(state.model, step_idx)
        except Exception as exc:
            log.exception(
                "evaluator %r failed at step %d; training goes on", evaluator.name, step_idx
            )
            result = EvalResult(
                evaluator.name,
                {},
                step=step_idx,
                seconds=time.perf_counter() - started,
                error=f"{type(exc).__name__}: {exc}",
            )
            hooks.fire("on_benchmark_eval", state.ctx, result, [], step=step_idx)
            return result
        state.current_eval = result
        try:
            hooks.fire("on_eval", state, step_idx, result.name, result.metrics)
        finally:
            state.current_eval = None
        if result.benchmark:
            hooks.fire("on_benchmark_eval", state.ctx, result, result.predictions, step=step_idx)
        return result

    def _check_metric_names(self, hooks: Dispatcher) -> MetricWatch | None:
        """Look up every metric name the callbacks and the checkpoint config need in what
        the loop, the loss function, the evaluators and the callbacks declare."""
        needed = needed_by(hooks.callbacks)
        if self.checkpoint is not None and self.checkpoint.metric is not None:
            metric = self.checkpoint.metric
            needed.setdefault(metric, f"CheckpointConfig(metric={metric!r})")
        if not needed:
            return None
        return check_metric_names(
            needed,
            step_metrics=[*LOOP_METRICS, *(self.loss_metrics or ()), *logged_by(hooks.callbacks)],
            step_open=self.loss_metrics is None,
            evals={ev.name: ev.metrics for ev in self.evaluators},
        )

    def _checkpoint_manager(
        self, folder: Path | None, ctx: LogContext, *, fresh: bool
    ) -> CheckpointManager | None:
        if self.checkpoint is None:
            return None
        if folder is None:
            raise ConfigError(
                "checkpoints need a folder: call fit(run) under an Experiment, or fit(run_dir=...)"
            )
        root = Path(folder) / "checkpoints"
        if fresh and root.exists() and any(root.iterdir()):
            stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S-%f")
            aside = root.with_name(f"checkpoints.replaced-{stamp}")
            root.rename(aside)  # a fresh start never deletes what an earlier run saved
            log.warning("starting fresh: earlier checkpoints moved to %s", aside)
        return CheckpointManager(root, self.checkpoint, ctx.run_key or "")

    @staticmethod
    def _resume_path(manager: CheckpointManager, resume: bool | str | Path | int) -> Path | None:
        if resume is False:
            return None
        if resume is True:
            return manager.get_latest_checkpoint_path()
        return manager.resolve(resume)

    def _restore(
        self, manager: CheckpointManager, path: Path, state: LoopState, hooks: Dispatcher
    ) -> dict[str, Any]:
        """Load `path` into the model, optimizer, scheduler, loop state and callbacks."""
        payload = manager.load(path)
        self._load_training_state(payload, path, state)
        _load_callback_states(payload.get("callbacks") or {}, path, hooks)
        state.load_state_dict(payload["loop"])
        state.metrics = dict(payload.get("metrics", {}))
        return payload

    def _start_from(self, path: Path, full: bool, state: LoopState) -> None:
        """Start at step 0 from another run's checkpoint: its weights, or its whole state.

        Even with `full` (``carry="full"``) the callbacks' states stay behind: a stage is a
        new run, and what a callback counted in the run before (EarlyStopping's best value
        and bad checks, StabilityMonitor's histories) is not this run's, so each starts
        fresh. Carrying them would let a stage be stopped at its first step for the previous
        stage's lack of progress. Model, optimizer, scheduler and grad scaler do carry: they
        are the training state a stage continues from.
        """
        payload = CheckpointManager(path.parent).load(path)
        if full:
            self._load_training_state(payload, path, state)
        else:
            _load_model(state.model, payload, path)

    def _load_training_state(self, payload: dict[str, Any], path: Path, state: LoopState) -> None:
        """Load the model, optimizer, scheduler and grad scaler; callbacks are the caller's."""
        _load_model(state.model, payload, path)
        state.optimizer.load_state_dict(payload["optimizer"])
        if self.scheduler is not None and payload.get("scheduler") is not None:
            self.scheduler.load_state_dict(payload["scheduler"])
        if self.scaler is not None and payload.get("scaler") is not None:
            self.scaler.load_state_dict(payload["scaler"])

    def _save(
        self,
        manager: CheckpointManager,
        state: LoopState,
        hooks: Dispatcher,
        eval_metrics: dict[str, float],
        *,
        final: bool = False,
    ) -> list[ManifestRow]:
        """Save the training state; returns the manifest rows to fire `on_checkpoint` for.

        Synchronous: this save's rows. With `async_save`: the rows of the previous save,
        which is waited for first (so the payload's retention bookkeeping includes it); this
        save's rows come from the next `_save` or from the wait at the end of `_fit`, so
        `on_checkpoint` fires for every row, in save order, on the training thread.
        """
        rows = manager.wait() if manager.in_flight else []
        payload = {
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "loop": state.state_dict(),
            "metrics": dict(state.metrics),
            "eval_metrics": dict(eval_metrics),
            "rng": rng_state(),
            "epoch_rng": self._epoch_rng,
            "retention": manager.state_dict(),
            "callbacks": {
                key: cb.state_dict() for key, cb in _state_keys(hooks.stateful()).items()
            },
        }
        info = {"metrics": {**state.metrics, **eval_metrics}}
        if not manager.config.async_save:
            return manager.save(state.step, payload, info, final=final)
        self._async_manager = manager
        return rows + manager.save_async(state.step, payload, info, final=final)

    def _join_async_save(self) -> None:
        """On a failing fit, wait for the checkpoint save in flight; its own error is logged.

        The thread is joined so none outlives `fit`, and a save that was started is
        finished, not torn; the fit's exception stays the one that propagates.
        """
        manager, self._async_manager = self._async_manager, None
        if manager is None or not manager.in_flight:
            return
        try:
            manager.wait()
        except CheckpointError as exc:
            log.error("the checkpoint save in flight also failed: %s", exc)


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


def _grad_norm(params: list[torch.Tensor], grad_clip: float | None) -> torch.Tensor | None:
    """The total 2-norm of the gradients before clipping; None when no parameter has one.

    Without `grad_clip` the gradients are only measured, never rescaled: `clip_grad_norm_`
    with an infinite max norm would multiply them by inf / norm, which turns float16
    gradients into NaN once their total norm overflows to inf.
    """
    if grad_clip is not None:
        if all(p.grad is None for p in params):
            return None
        return torch.nn.utils.clip_grad_norm_(params, grad_clip)
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else None


def _unpack_loss(out: Any) -> tuple[torch.Tensor, dict[str, Any] | None]:
    extra = None
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], dict):
            raise LossError(
                "loss_fn returned a tuple; return a scalar loss or (loss, dict_of_metrics)"
            )
        out, extra = out
    if not isinstance(out, torch.Tensor):
        raise LossError(f"loss_fn returned {type(out).__name__}; return a scalar torch.Tensor loss")
    if out.numel() != 1:
        raise LossError(
            f"loss_fn returned a tensor of shape {tuple(out.shape)}; "
            "reduce it to a scalar first, e.g. loss.mean()"
        )
    if not out.requires_grad:
        raise LossError(
            "loss_fn returned a loss that does not require grad; compute it from the model's "
            "outputs, outside torch.no_grad(), with some parameters trainable"
        )
    return out, extra


def _metric_floats(extra: dict[str, Any], step: int) -> dict[str, float]:
    return {str(k): as_number(str(k), step, v) for k, v in extra.items()}


def _to_device(data: Any, device: torch.device) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=True)
    if isinstance(data, dict):
        return {k: _to_device(v, device) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        moved = [_to_device(v, device) for v in data]
        return type(data)(moved) if not hasattr(data, "_fields") else type(data)(*moved)
    return data


def _first_tensor(data: Any) -> torch.Tensor | None:
    """The first tensor in `data` (nested dicts, lists, tuples) that has a dimension."""
    if isinstance(data, torch.Tensor):
        return data if data.dim() > 0 else None
    values = data.values() if isinstance(data, dict) else data
    if isinstance(values, (list, tuple)) or isinstance(data, dict):
        for v in values:
            found = _first_tensor(v)
            if found is not None:
                return found
    return None
