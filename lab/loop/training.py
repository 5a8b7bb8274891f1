"""The torch training loop. `TrainingLoop.fit` reads top to bottom: set up, loop, end.

Every hook fires in the run handle (`lab.loop.handle.RunHandle`) the loop drives; this module
holds only what a default step does: forward, backward, clipping, the optimizer step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from lab._metrics import as_number
from lab.errors import ConfigError, LossError
from lab.hooks import Callback, LoopState
from lab.loop.checkpoints import CheckpointConfig
from lab.loop.evals import Evaluator
from lab.loop.handle import RunHandle
from lab.loop.metric_names import LOOP_METRICS
from lab.loop.optimizers import as_optimizers, needs_closure
from lab.loop.schedules import Schedules, as_named, as_schedules
from lab.loop.settings import LoopSettings, Setting
from lab.loop.steps import (
    check_custom_step,
    check_no_epoch_settings,
    epoch_length,
    positive_int,
    unpack_step,
)
from lab.records import LoopArtifacts, TrainingBatch

if TYPE_CHECKING:
    from lab.records import RunSpec

__all__ = ["LoopArtifacts", "TrainingBatch", "TrainingLoop"]

LossFn = Callable[[torch.nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, dict[str, Any]]"]
StepFn = Callable[["TrainingLoop", Any], Any]


class TrainingLoop:
    """Trains `model` for `num_steps` optimizer steps (or `num_epochs` passes over `data`)
    and fires every loop hook in place.

    `loss_fn(model, batch)` returns a scalar loss tensor, or `(loss, metrics)` to log more;
    `loss_metrics` names the keys of those metrics, when they are known. With them, and
    `Evaluator(metrics=...)`, a metric name that a callback or the checkpoint config needs
    but nothing logs is an error before the first step (see `lab.loop.metric_names`).
    `data` is any iterable of batches and is iterated again at each epoch's end.

    What real scripts need beside (docs/loop.md has an example of each): `optimizer` is one
    optimizer, a list, or a dict of named ones; with more than one, `train_step=fn`
    (``fn(loop, batch)``, or a subclass that overrides `train_step`) does the step itself.
    A closure optimizer (LBFGS) works with the default step. `accumulate=k` takes k
    micro-batches per optimizer step (`lab.loop.feed` says which batches an epoch uses).
    `scheduler` is one scheduler, a list, or `Schedule` wrappers (per step, per epoch, or
    driven by a metric: `lab.loop.schedules`).

    Under DDP (``torchrun``, or ``Experiment(processes_per_run=N)``; wrap `model` in
    ``DistributedDataParallel`` and give each rank its share of `data`) every rank fits, the
    hooks fire on each, and each step's metrics are the mean over ranks, or what `reduce`
    names for a metric (``{"tokens": "sum"}``; see `lab.loop.handle.RunHandle`).

    `log_every=N` (default 1: every step read as it ends, its hooks at once) keeps each
    step's tensor metrics (the loss, the gradient norm, the loss function's one-element
    tensors) on their device, and reads the held steps in one transfer every N steps, at
    the last step, and before an eval, a save, an epoch's end, a stop, the end of the fit or
    an error: the other steps never make the host wait for the device. Every step still
    gets its own `on_step_end` with its own metrics (so its own row), but a held step's
    fires at that materialisation, in step order; a scheduler on a step metric reads it
    every step. docs/loop.md says what a hook sees then, and `Callback.live_steps` who
    needs each step live.

    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> data = [(torch.ones(4, 2), torch.zeros(4, 1))]
    >>> loop = TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
    ...                     lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), 3)
    >>> loop.fit().step
    3
    """

    # the settings the fit's run handle gets, as attributes of the loop (`lab.loop.settings`)
    num_steps = Setting()
    scheduler = Setting()
    scaler = Setting()
    checkpoint = Setting()
    evaluators = Setting()
    callbacks = Setting()
    device = Setting()
    steps_per_epoch = Setting()
    reduce = Setting()
    log_every = Setting()

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        data: Iterable[Any],
        loss_fn: LossFn | None = None,
        num_steps: int | None = None,
        *,
        num_epochs: int | None = None,
        steps_per_epoch: int | None = None,
        accumulate: int = 1,
        train_step: StepFn | None = None,
        scheduler: Any | None = None,
        scaler: torch.amp.GradScaler | None = None,
        grad_clip: float | None = None,
        device: str | torch.device | None = None,
        evaluators: Sequence[Evaluator] = (),
        checkpoint: CheckpointConfig | None = None,
        callbacks: Sequence[Callback] = (),
        loss_metrics: Sequence[str] | None = None,
        reduce: Mapping[str, str] | None = None,
        log_every: int = 1,
    ) -> None:
        _check_length(num_steps, num_epochs, accumulate)
        if grad_clip is not None and not grad_clip > 0:
            raise ConfigError(f"grad_clip={grad_clip!r}: use a positive max norm, or None")
        self.loop_settings = LoopSettings(
            num_steps=num_steps, scheduler=scheduler, scaler=scaler, checkpoint=checkpoint,
            evaluators=evaluators, callbacks=callbacks, device=device, reduce=reduce,
            log_every=log_every,
        )  # fmt: skip
        self.model = model
        self._check_step(train_step, loss_fn, optimizer, scaler, accumulate, grad_clip)
        self.data = data
        self.loss_fn = loss_fn
        self.accumulate = accumulate
        self._train_step = train_step
        self._optimizer_arg = optimizer  # as given: the handle names them the same way
        self.steps_per_epoch = epoch_length(data, steps_per_epoch, num_epochs, accumulate)
        self.num_epochs = num_epochs
        if num_steps is None:
            self.num_steps = num_epochs * self.steps_per_epoch
        self.schedules = as_schedules(scheduler)
        if self.steps_per_epoch is None:
            check_no_epoch_settings(self.schedules, evaluators)
        self.grad_clip = grad_clip
        if isinstance(loss_metrics, str):
            raise ConfigError(f"loss_metrics={loss_metrics!r}: give a list of keys, e.g. ['acc']")
        self.loss_metrics = tuple(loss_metrics) if loss_metrics is not None else None
        self.handle: RunHandle | None = None  # the run handle of the fit under way
        self.state: LoopState | None = None  # its state, for a custom train_step

    def _check_step(
        self,
        train_step: StepFn | None,
        loss_fn: LossFn | None,
        optimizer: Any,
        scaler: torch.amp.GradScaler | None,
        accumulate: int,
        grad_clip: float | None,
    ) -> None:
        """Which step runs (the default one, a closure optimizer's, or the user's own), and
        whether the rest of the settings fit it."""
        self.optimizers = as_optimizers(optimizer)
        custom = train_step is not None or type(self).train_step is not TrainingLoop.train_step
        if train_step is not None and not callable(train_step):
            raise ConfigError(f"train_step={train_step!r}: give a function fn(loop, batch)")
        if custom:
            check_custom_step(grad_clip, accumulate)
        elif loss_fn is None:
            raise ConfigError(
                "no loss_fn: pass loss_fn(model, batch) -> loss, or train_step=fn for a step "
                "of your own"
            )
        elif len(self.optimizers) > 1:
            raise ConfigError(
                f"{len(self.optimizers)} optimizers ({', '.join(self.optimizers)}): the default "
                "step cannot know which loss steps which; pass train_step=fn, where "
                "fn(loop, batch) does its own backward and optimizer steps"
            )
        self.optimizer: torch.optim.Optimizer = next(iter(self.optimizers.values()))
        self.closure = not custom and needs_closure(self.optimizer)
        if self.closure and (scaler is not None or accumulate > 1):
            what = "scaler" if scaler is not None else f"accumulate={accumulate}"
            raise ConfigError(
                f"{type(self.optimizer).__name__} steps with a closure, which takes no {what}: "
                "drop it, or use an optimizer that steps without one"
            )
        self._custom = custom

    def train_step(self, batch: Any) -> Any:
        """One optimizer step of your own: forward, backward and the optimizer steps.

        Override it in a subclass, or pass ``TrainingLoop(train_step=fn)`` with
        ``fn(loop, batch)``; either way it returns the loss (a tensor or a float) or
        ``(loss, {metric: value})``. The loop then neither zeroes, clips nor steps anything
        (``grad_norm`` is NaN; ``lr`` is the first optimizer's): `self.optimizers` (by
        name), `self.model`, `self.scaler`, `self.device`, `self.state` and `self.handle`
        (to log histograms or images) are there for the step to use. Schedulers still step
        after it, and every optimizer is saved in checkpoints as with the default step.
        """
        if self._train_step is None:
            raise NotImplementedError("TrainingLoop.train_step runs only when overridden")
        return self._train_step(self, batch)

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

        Without a run (a bare fit) the loop's own callbacks get the whole lifecycle, around
        an experiment of the fit's own (see `lab.loop.bare`), and checkpoints go under
        `run_dir`.
        """
        scheduled = Schedules(self.schedules, (ev.name for ev in self.evaluators))
        # schedulers driven by a metric step on eval metrics in on_eval, and declare the names
        # they need; plain ones step in _train alone
        callbacks = self.callbacks
        settings = replace(
            self.loop_settings,
            scheduler=as_named(self.scheduler),
            callbacks=[*callbacks, scheduled] if scheduled.metrics_needed else callbacks,
            resume=resume,
            run_dir=run_dir,
            metrics=[*LOOP_METRICS, *(self.loss_metrics or ())],
            more_metrics=self.loss_metrics is None,
        )
        handle = RunHandle.from_settings(run, self.model, self._optimizer_arg, settings)
        self.handle = handle
        try:
            with handle:
                self.state = handle.state
                self._train(handle, scheduled)
        finally:
            self.handle = self.state = None
        assert handle.artifacts is not None
        return handle.artifacts

    def _train(self, loop: RunHandle, scheduled: Schedules) -> None:
        # -- set up ------------------------------------------------------------------------
        device, accumulate = self.device, self.accumulate
        params = [p for p in self.model.parameters() if p.requires_grad]
        spe = self.steps_per_epoch  # None: the loop does not count epochs
        stepped = bool(scheduled)
        # the step metrics a scheduler reads after each step and at an epoch's end: a host
        # value each, so those steps wait for the device whatever `log_every` says
        reads_step, reads_epoch = scheduled.step_metrics_read()
        feed = loop.feed(self.data, accumulate, spe)
        batch = TrainingBatch()
        state = loop.state
        # Resumed in the middle of an epoch: on_epoch_start fires for it again in this
        # process, so each on_epoch_end has its start where it fires.
        reopen = spe is not None and state.step % spe != 0
        for step_idx in loop.steps():
            # -- one step ----------------------------------------------------------------
            if spe is not None:
                if (step_idx - 1) % spe == 0:
                    feed.next_epoch()  # a fresh pass (a no-op at the very start)
                    loop.start_epoch(state.epoch)
                elif reopen:
                    loop.start_epoch(state.epoch)
                reopen = False
            group = feed.take()  # `accumulate` micro-batches; the position counts each
            batch.data = group[0]
            batch.epoch, batch.index = state.epoch, state.batch_in_epoch - accumulate
            if device is not None:
                batch.data = _to_device(batch.data, device)
            loop.pre_step(batch)  # once per optimizer step, before its first micro-batch
            started = time.perf_counter()
            loss, extra, grad_norm, lr = self._step(group, batch.data, step_idx, params)
            # loss and grad_norm stay tensors on their device: the handle reads them on the
            # host at the next materialisation, every `log_every` steps
            metrics = {
                "loss": loss.detach() if isinstance(loss, torch.Tensor) else loss,
                "lr": lr,
                "grad_norm": grad_norm.detach() if grad_norm is not None else math.nan,
                "step_time": time.perf_counter() - started,
            }
            if extra:  # tensors kept as they are; other values numbers now (or one error)
                for key, value in extra.items():
                    name = str(key)
                    keep = isinstance(value, torch.Tensor) and value.numel() == 1
                    metrics[name] = value.detach() if keep else as_number(name, step_idx, value)
            epoch_end = spe is not None and step_idx % spe == 0
            if stepped:
                for key in reads_epoch if epoch_end else reads_step:
                    if isinstance(metrics.get(key), torch.Tensor):  # read now, for the scheduler
                        metrics[key] = as_number(key, step_idx, metrics[key])
                scheduled.after_step(metrics)
                if epoch_end:  # where a script steps its per-epoch schedulers
                    scheduled.after_epoch(metrics)
            # -- on_step_end, the evals and the save due after it ------------------------
            loop.end_step(metrics, batch)
            if epoch_end:
                loop.end_epoch()

    def _step(
        self, group: list[Any], data: Any, step_idx: int, params: Sequence[torch.Tensor]
    ) -> tuple[Any, dict[str, Any] | None, torch.Tensor | None, float]:
        """One optimizer step on `group` (`data`: its first micro-batch, on its device): the
        loss, the extra metrics, the gradient norm and the learning rate the step used."""
        if self._custom:
            lr = float(self.optimizer.param_groups[0]["lr"])
            loss, extra = unpack_step(self.train_step(data))
            return loss, extra, None, lr
        if self.closure:
            return self._closure_step(data, params)
        optimizer, scaler, grad_clip = self.optimizer, self.scaler, self.grad_clip
        if self.accumulate == 1:
            loss, extra = _unpack_loss(self.loss_fn(self.model, data))  # type: ignore[misc]  # not None (_check_step)
            optimizer.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()
            else:
                scaler.scale(loss).backward()
        else:
            loss, extra = self._accumulate(group, data, step_idx)
        if scaler is None:
            grad_norm = _grad_norm(params, grad_clip) if params else None
            lr = float(optimizer.param_groups[0]["lr"])  # the rate this step used
            optimizer.step()
        else:  # AMP: the norm and the clipping see the unscaled gradients
            scaler.unscale_(optimizer)
            grad_norm = _grad_norm(params, grad_clip) if params else None
            lr = float(optimizer.param_groups[0]["lr"])
            scaler.step(optimizer)  # skipped when the gradients overflowed
            scaler.update()
        return loss, extra, grad_norm, lr

    def _accumulate(
        self, group: list[Any], first: Any, step_idx: int
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Forward and backward each micro-batch with its loss scaled by 1/k, so the summed
        gradients are those of the mean loss; returns the mean loss and the mean of each
        metric over the micro-batches that logged it (the loss is averaged on its device:
        one ``.item()`` per step, not per micro-batch)."""
        k, model, scaler, device = self.accumulate, self.model, self.scaler, self.device
        self.optimizer.zero_grad(set_to_none=True)
        total: torch.Tensor | None = None
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for i, micro in enumerate(group):
            if i > 0 and device is not None:
                micro = _to_device(micro, device)
            out = self.loss_fn(model, first if i == 0 else micro)  # type: ignore[misc]  # not None (_check_step)
            loss, extra = _unpack_loss(out)
            scaled = loss / k
            if scaler is None:
                scaled.backward()
            else:
                scaler.scale(scaled).backward()
            total = loss.detach() if total is None else total + loss.detach()
            for key, value in (extra or {}).items():
                name = str(key)
                sums[name] = sums.get(name, 0.0) + as_number(name, step_idx, value)
                counts[name] = counts.get(name, 0) + 1
        means = {name: value / counts[name] for name, value in sums.items()}
        assert total is not None  # the group holds `accumulate` (>= 2) micro-batches
        return total / k, means

    def _closure_step(
        self, data: Any, params: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, Any] | None, torch.Tensor | None, float]:
        """Step an optimizer that re-evaluates the loss (LBFGS): the loss function runs in
        the closure; the metrics and the gradient norm are those of its first evaluation."""
        model, loss_fn, optimizer = self.model, self.loss_fn, self.optimizer
        grad_clip = self.grad_clip
        first: list[Any] = []

        def closure() -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss, extra = _unpack_loss(loss_fn(model, data))  # type: ignore[misc]  # not None (_check_step)
            loss.backward()
            if not first:
                first.append((loss, extra, _grad_norm(params, grad_clip) if params else None))
            elif grad_clip is not None:
                _grad_norm(params, grad_clip)
            return loss

        lr = float(optimizer.param_groups[0]["lr"])
        # torch types a closure as returning a float; LBFGS takes the loss tensor (its docs)
        optimizer.step(cast("Callable[[], float]", closure))
        loss, extra, grad_norm = first[0]
        return loss, extra, grad_norm, lr


def _check_length(num_steps: int | None, num_epochs: int | None, accumulate: int) -> None:
    """How long the fit is: num_steps or num_epochs (one of them), `accumulate` a step."""
    if num_steps is not None and num_epochs is not None:
        raise ConfigError(
            f"num_steps={num_steps!r}, num_epochs={num_epochs!r}: give num_steps=N or "
            "num_epochs=N, not both"
        )
    if num_steps is None and num_epochs is None:
        raise ConfigError("give num_steps=N or num_epochs=N (optimizer steps, or passes over data)")
    if num_steps is not None and not positive_int(num_steps):
        raise ConfigError(f"num_steps={num_steps!r}: give the number of steps, an int >= 1")
    if num_epochs is not None and not positive_int(num_epochs):
        raise ConfigError(f"num_epochs={num_epochs!r}: give the number of epochs, an int >= 1")
    if not positive_int(accumulate):
        raise ConfigError(
            f"accumulate={accumulate!r}: give the micro-batches per step, an int >= 1"
        )


def _grad_norm(params: Sequence[torch.Tensor], grad_clip: float | None) -> torch.Tensor | None:
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


def _to_device(data: Any, device: torch.device) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=True)
    if isinstance(data, dict):
        return {k: _to_device(v, device) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        moved = [_to_device(v, device) for v in data]
        return type(data)(moved) if not hasattr(data, "_fields") else type(data)(*moved)
    return data
