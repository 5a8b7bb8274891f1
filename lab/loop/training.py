"""The torch training loop. `TrainingLoop.fit` reads top to bottom: set up, loop, end.

Every hook fires in the run handle (`lab.loop.handle.RunHandle`) the loop drives; this module
holds only what a default step does: forward, backward, clipping, the optimizer step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lab._metrics import as_number
from lab.errors import ConfigError, LossError
from lab.hooks import Callback
from lab.loop.checkpoints import CheckpointConfig
from lab.loop.evals import Evaluator
from lab.loop.handle import RunHandle
from lab.loop.metric_names import LOOP_METRICS
from lab.loop.records import LoopArtifacts, TrainingBatch

if TYPE_CHECKING:
    from lab.experiment import RunSpec

__all__ = ["LoopArtifacts", "TrainingBatch", "TrainingLoop"]

LossFn = Callable[[torch.nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, dict[str, Any]]"]


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
        handle = RunHandle(
            run,
            self.model,
            self.optimizer,
            num_steps=self.num_steps,
            scheduler=self.scheduler,
            scaler=self.scaler,
            checkpoint=self.checkpoint,
            evaluators=self.evaluators,
            callbacks=self.callbacks,
            device=self.device,
            resume=resume,
            run_dir=run_dir,
            metrics=[*LOOP_METRICS, *(self.loss_metrics or ())],
            more_metrics=self.loss_metrics is None,
        )
        with handle:
            self._train(handle)
        assert handle.artifacts is not None
        return handle.artifacts

    def _train(self, loop: RunHandle) -> None:
        # -- set up ------------------------------------------------------------------------
        model, optimizer, scheduler, scaler = (
            self.model,
            self.optimizer,
            self.scheduler,
            self.scaler,
        )
        params = [p for p in model.parameters() if p.requires_grad]
        grad_clip, device = self.grad_clip, self.device
        batches = loop.batches(self.data)
        batch = TrainingBatch()
        state = loop.state
        for step_idx in loop.steps():
            # -- one step ----------------------------------------------------------------
            batch.data = next(batches)
            batch.epoch, batch.index = state.epoch, state.batch_in_epoch - 1
            if device is not None:
                batch.data = _to_device(batch.data, device)
            loop.pre_step(batch)
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
            if scheduler is not None:
                scheduler.step()
            metrics = {
                "loss": loss.item(),
                "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
                "step_time": time.perf_counter() - started,
            }
            if extra:
                metrics.update(_metric_floats(extra, step_idx))
            # -- on_step_end, the evals and the save due after it ------------------------
            loop.end_step(metrics, batch)


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
