"""Monitors: throughput, GPU memory, stability, gradients, profiling, GC and early stopping.

Each is a `Callback` registered under a snake-case kind (``build([{"kind":
"speed_monitor"}])``), modelled on OLMo-core's callbacks of the same purpose.

Where the figures go: the loop hands one `metrics` dict to every `on_step_end`, and the
`SqlLogger` (priority 100) stores it when its own `on_step_end` runs. A monitor that adds
figures to a step therefore runs *before* it, at `MONITOR_PRIORITY` (200), and writes its
keys into that dict; they are then stored at the step like the loop's own metrics, and every
lower-priority callback (a console logger, `EarlyStopping`) sees them too.

Gradients: the loop clears gradients (``zero_grad(set_to_none=True)``) right before each
backward, not after the optimizer step, so in `on_step_end` every ``param.grad`` still holds
the gradient of the step just taken (after clipping when ``grad_clip`` is set; unscaled under
AMP). There is no hook between backward and the optimizer step; `GradientMonitor` reads the
gradients in `on_step_end`, where the parameters are already updated.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pydantic
import torch

from lab.callbacks.registry import register
from lab.errors import ConfigError
from lab.hooks import Callback, LogContext, LoopState

if TYPE_CHECKING:
    from lab.loop.training import LoopArtifacts, TrainingBatch

log = logging.getLogger("lab.callbacks.monitors")

#: Above `SqlLogger` (100): a monitor's keys are in the step's metrics before it stores them.
MONITOR_PRIORITY = 200


def _check_every(name: str, every: int) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"{name}(every={every!r}): use an int >= 1")
    return every


# ---------------------------------------------------------------------------------------------
class SpeedMonitorConfig(pydantic.BaseModel):
    """Params of `SpeedMonitor`."""

    model_config = pydantic.ConfigDict(extra="forbid")
    every: pydantic.PositiveInt = 1
    flops_per_token: pydantic.PositiveFloat | None = None
    peak_flops: pydantic.PositiveFloat | None = None


@register("speed_monitor", SpeedMonitorConfig)
class SpeedMonitor(Callback):
    """Throughput: steps/s, samples/s, tokens/s and MFU, averaged over each `every` steps.

    Why: the loop's ``step_time`` covers only forward, backward and the optimizer step;
    throughput as the wall clock sees it also pays for data loading, hooks, evals and
    checkpoints, which is what decides how long a run takes. The clock starts right before
    the first step of a fit (so `at_start` evals and setup do not count) and each report
    covers the wall time since the previous one.

    Keys: ``throughput/steps_per_s``, ``throughput/samples_per_s`` (batch size: the first
    dimension of the batch's first tensor, else ``len(batch)``), ``throughput/tokens_per_s``
    when the batch declares its tokens (a dict batch with ``"num_tokens"``, a batch object
    with a ``num_tokens`` attribute, or a ``num_tokens`` metric returned by the loss
    function), and ``throughput/mfu`` (tokens/s x `flops_per_token` / `peak_flops`, a
    fraction) when both are given.
    """

    priority = MONITOR_PRIORITY

    def __init__(
        self,
        every: int = 1,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
    ) -> None:
        self.every = _check_every("SpeedMonitor", every)
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._last: float | None = None
        self._steps = 0
        self._samples = 0
        self._tokens = 0
        self._has_samples = True
        self._has_tokens = True

    def on_train_start(self, state: LoopState) -> None:
        self._last = None
        self._reset_window()

    def pre_step(self, state: LoopState, step_idx: int, batch: TrainingBatch) -> None:
        if self._last is None:
            self._last = time.perf_counter()

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        now = time.perf_counter()
        if self._last is None:  # pre_step did not run (hooks fed directly)
            self._last = now
            return
        self._steps += 1
        samples = _batch_size(batch)
        if samples is None:
            self._has_samples = False
        else:
            self._samples += samples
        tokens = _batch_tokens(batch, metrics)
        if tokens is None:
            self._has_tokens = False
        else:
            self._tokens += tokens
        if step_idx % self.every and step_idx != state.num_steps:
            return
        elapsed = now - self._last
        if elapsed > 0:
            metrics["throughput/steps_per_s"] = self._steps / elapsed
            if self._has_samples:
                metrics["throughput/samples_per_s"] = self._samples / elapsed
            if self._has_tokens:
                tps = self._tokens / elapsed
                metrics["throughput/tokens_per_s"] = tps
                if self.flops_per_token is not None and self.peak_flops is not None:
                    metrics["throughput/mfu"] = tps * self.flops_per_token / self.peak_flops
        self._last = now
        self._reset_window()

    def _reset_window(self) -> None:
        self._steps = self._samples = self._tokens = 0
        self._has_samples = self._has_tokens = True


def _batch_size(batch: TrainingBatch) -> int | None:
    size = batch.size
    if size is not None:
        return size
    try:
        return len(batch.data)
    except TypeError:
        return None


def _batch_tokens(batch: TrainingBatch, metrics: dict[str, float]) -> int | None:
    data = batch.data
    value: Any = None
    if isinstance(data, dict) and "num_tokens" in data:
        value = data["num_tokens"]
    elif hasattr(data, "num_tokens"):
        value = data.num_tokens
    elif "num_tokens" in metrics:
        value = metrics["num_tokens"]
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.item()
    return int(value)


# ---------------------------------------------------------------------------------------------
class GPUMemoryMonitorConfig(pydantic.BaseModel):
    """Params of `GPUMemoryMonitor`."""

    model_config = pydantic.ConfigDict(extra="forbid")
    every: pydantic.PositiveInt = 1


@register("gpu_memory_monitor", GPUMemoryMonitorConfig)
class GPUMemoryMonitor(Callback):
    """CUDA memory of the model's device, in MB, each `every` steps.

    Why: memory creeping up over a run (a leak, fragmentation, allocator retries) shows long
    before an out-of-memory error ends it. Keys: ``gpu_memory/allocated_mb``,
    ``gpu_memory/reserved_mb``, ``gpu_memory/max_allocated_mb`` (the peak since the process
    started or the last ``torch.cuda.reset_peak_memory_stats``; this monitor never resets
    it, so other code's use of the peak is undisturbed) and ``gpu_memory/alloc_retries``
    (the allocator's cudaMalloc retries, a sign of fragmentation).

    When CUDA is unavailable or the model's parameters are not on a CUDA device it does
    nothing, and says so once (per instance) in the log at INFO.
    """

    priority = MONITOR_PRIORITY

    def __init__(self, every: int = 1) -> None:
        self.every = _check_every("GPUMemoryMonitor", every)
        self._device: torch.device | None = None
        self._said_inactive = False

    def on_train_start(self, state: LoopState) -> None:
        self._device = _cuda_device(state.model)
        if self._device is None and not self._said_inactive:
            self._said_inactive = True
            log.info("GPUMemoryMonitor is inactive: the model is not on a CUDA device")

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        if self._device is None or (step_idx % self.every and step_idx != state.num_steps):
            return
        mb = 1024.0 * 1024.0
        stats = torch.cuda.memory_stats(self._device)
        metrics["gpu_memory/allocated_mb"] = stats.get("allocated_bytes.all.current", 0) / mb
        metrics["gpu_memory/reserved_mb"] = stats.get("reserved_bytes.all.current", 0) / mb
        metrics["gpu_memory/max_allocated_mb"] = stats.get("allocated_bytes.all.peak", 0) / mb
        metrics["gpu_memory/alloc_retries"] = float(stats.get("num_alloc_retries", 0))


def _cuda_device(model: torch.nn.Module) -> torch.device | None:
    if not torch.cuda.is_available():
        return None
    for p in model.parameters():
        if p.device.type == "cuda":
            return p.device
    return None


# ---------------------------------------------------------------------------------------------
class StabilityMonitorConfig(pydantic.BaseModel):
    """Params of `StabilityMonitor`."""

    model_config = pydantic.ConfigDict(extra="forbid")
    window: pydantic.PositiveInt = 100
    threshold: pydantic.PositiveFloat = 3.0
    keys: tuple[str, ...] = ("loss", "grad_norm")
    min_history: int = pydantic.Field(default=10, ge=2)


@register("stability_monitor", StabilityMonitorConfig)
class StabilityMonitor(Callback):
    """Flags loss and gradient-norm spikes, and a rolling spike score, at every step.

    Why: a spike that recovers leaves no trace in a smoothed curve but often precedes a
    divergence; counting them makes instability a number that runs can be compared by.

    As OLMo-core's `StabilityMonitorCallback`: a value is a spike when it exceeds the mean of
    the previous `window` values of its key by more than `threshold` standard deviations
    (population std). Detection starts once `min_history` values are held. A non-finite
    value (NaN, inf) is always a spike and never enters the history, except a NaN
    ``grad_norm``, which the loop logs for a step without gradients and is skipped (a NaN
    loss still shows). Every finite value, spike or not, enters the history.

    For each watched key present in a step's metrics it adds ``stability/<key>_spike``
    (1.0 or 0.0) and ``stability/<key>_spike_score``: the fraction of the last `window`
    steps that were spikes (of the steps seen so far, until `window` steps have passed).
    Its state is saved in checkpoints, so a resumed run flags the same steps as one that
    never stopped; a fit that does not resume starts with empty histories (one instance
    attached to an Experiment serves each run afresh).
    """

    priority = MONITOR_PRIORITY

    def __init__(
        self,
        window: int = 100,
        threshold: float = 3.0,
        keys: Sequence[str] = ("loss", "grad_norm"),
        min_history: int = 10,
    ) -> None:
        if window < 2:
            raise ConfigError(f"StabilityMonitor(window={window!r}): use an int >= 2")
        if not threshold > 0:
            raise ConfigError(f"StabilityMonitor(threshold={threshold!r}): use a number > 0")
        if not 2 <= min_history <= window:
            raise ConfigError(
                f"StabilityMonitor(min_history={min_history!r}): use 2 <= min_history <= window"
            )
        if isinstance(keys, str):
            keys = (keys,)
        self.window = window
        self.threshold = float(threshold)
        self.keys = tuple(keys)
        self.min_history = int(min_history)
        self._history: dict[str, deque[float]] = {}
        self._spikes: dict[str, deque[int]] = {}
        self._reset()
        self._restored = False

    def _reset(self) -> None:
        self._history = {k: deque(maxlen=self.window) for k in self.keys}
        self._spikes = {k: deque(maxlen=self.window) for k in self.keys}

    def on_train_start(self, state: LoopState) -> None:
        if not self._restored:  # a new run starts clean; a resumed one keeps its history
            self._reset()
        self._restored = False

    def is_spike(self, key: str, value: float) -> bool:
        """Whether `value` is a spike against the history of `key` (history unchanged)."""
        if not math.isfinite(value):
            return True
        history = self._history[key]
        if len(history) < self.min_history:
            return False
        n = len(history)
        mean = sum(history) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in history) / n)
        return value > mean + self.threshold * std

    def observe(self, key: str, value: float) -> tuple[bool, float]:
        """Take one value of `key`: whether it is a spike, and the rolling spike score."""
        spike = self.is_spike(key, value)
        if math.isfinite(value):
            self._history[key].append(value)
        spikes = self._spikes[key]
        spikes.append(int(spike))
        return spike, sum(spikes) / len(spikes)

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        for key in self.keys:
            value = metrics.get(key)
            if value is None or (key == "grad_norm" and math.isnan(value)):
                continue  # not logged this step (a NaN grad_norm means "no gradients")
            spike, score = self.observe(key, float(value))
            metrics[f"stability/{key}_spike"] = float(spike)
            metrics[f"stability/{key}_spike_score"] = score

    def state_dict(self) -> dict[str, Any]:
        """The histories, so a resumed run detects exactly as an uninterrupted one."""
        return {
            "history": {k: list(v) for k, v in self._history.items()},
            "spikes": {k: list(v) for k, v in self._spikes.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved (keys no longer watched are dropped)."""
        for key in self.keys:
            self._history[key] = deque(state["history"].get(key, ()), maxlen=self.window)
            self._spikes[key] = deque(state["spikes"].get(key, ()), maxlen=self.window)
        self._restored = True


# ---------------------------------------------------------------------------------------------
class GradientMonitorConfig(pydantic.BaseModel):
    """Params of `GradientMonitor`."""

    model_config = pydantic.ConfigDict(extra="forbid")
    every: pydantic.PositiveInt = 10


@register("gradient_monitor", GradientMonitorConfig)
class GradientMonitor(Callback):
    """Per-parameter gradient and parameter 2-norms, each `every` steps.

    Why: the loop's ``grad_norm`` is one number for the whole model; a layer whose gradients
    vanish or explode hides in it. Keys: ``grad_norm/<param name>`` and
    ``param_norm/<param name>`` for each trainable named parameter.

    It runs in `on_step_end`: the loop zeroes gradients right before the next backward, so
    ``param.grad`` there is this step's gradient (after clipping when ``grad_clip`` is set,
    unscaled under AMP), and the parameter norm is that of the updated parameters. A
    parameter without a gradient this step gets no ``grad_norm`` key. All norms are
    computed on the device and copied to the host in one transfer.
    """

    priority = MONITOR_PRIORITY

    def __init__(self, every: int = 10) -> None:
        self.every = _check_every("GradientMonitor", every)

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        if step_idx % self.every and step_idx != state.num_steps:
            return
        keys: list[str] = []
        norms: list[torch.Tensor] = []
        with torch.no_grad():
            for name, p in state.model.named_parameters():
                if not p.requires_grad:
                    continue
                if p.grad is not None:
                    keys.append(f"grad_norm/{name}")
                    norms.append(torch.linalg.vector_norm(p.grad.detach().float()))
                keys.append(f"param_norm/{name}")
                norms.append(torch.linalg.vector_norm(p.detach().float()))
            if not norms:
                return
            by_device: dict[torch.device, list[int]] = {}
            for i, t in enumerate(norms):
                by_device.setdefault(t.device, []).append(i)
            values: list[float] = [0.0] * len(norms)
            for idx in by_device.values():
                host = torch.stack([norms[i] for i in idx]).cpu().tolist()
                for i, v in zip(idx, host, strict=True):
                    values[i] = float(v)
        metrics.update(zip(keys, values, strict=True))


# ---------------------------------------------------------------------------------------------
class ProfilerCallbackConfig(pydantic.BaseModel):
    """Params of `ProfilerCallback`."""

    model_config = pydantic.ConfigDict(extra="forbid")
    wait: int = pydantic.Field(default=1, ge=0)
    warmup: int = pydantic.Field(default=1, ge=0)
    active: pydantic.PositiveInt = 3
    repeat: int = pydantic.Field(default=1, ge=0)
    skip_first: int = pydantic.Field(default=0, ge=0)
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False


@register("profiler", ProfilerCallbackConfig)
class ProfilerCallback(Callback):
    """Profiles a few training steps with `torch.profiler` and writes the traces to disk.

    Why: where a step's time goes (kernels, data copies, the optimizer, Python overhead) is
    the first question when throughput is low, and a trace of a few steady-state steps
    answers it. The schedule is torch's: skip `skip_first` steps, then `repeat` cycles of
    `wait` idle, `warmup` traced-but-discarded and `active` recorded steps (``repeat=0``
    repeats until training ends). Each cycle's trace is written by
    ``torch.profiler.tensorboard_trace_handler`` as ``<host>_<pid>.<time>.pt.trace.json``
    under ``<run folder>/profiler`` (a bare loop without a run folder: ``./profiler``),
    readable by TensorBoard, chrome://tracing and Perfetto. CUDA activity is traced when
    CUDA is available. The profiler stops at `on_train_end`, and on error or close.
    """

    priority = MONITOR_PRIORITY

    def __init__(
        self,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        skip_first: int = 0,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
    ) -> None:
        if active < 1 or min(wait, warmup, repeat, skip_first) < 0:
            raise ConfigError(
                f"ProfilerCallback(wait={wait}, warmup={warmup}, active={active}, "
                f"repeat={repeat}, skip_first={skip_first}): active >= 1, the others >= 0"
            )
        self.wait, self.warmup, self.active = wait, warmup, active
        self.repeat, self.skip_first = repeat, skip_first
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.trace_dir: Path | None = None
        self._profiler: torch.profiler.profile | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without a running profiler (process executors copy callbacks)."""
        state = self.__dict__.copy()
        state["_profiler"] = None
        return state

    def on_train_start(self, state: LoopState) -> None:
        self._stop()
        ctx = state.ctx
        base = ctx.run_dir if ctx.run_dir is not None else ctx.output_dir
        self.trace_dir = Path(base) / "profiler"
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=self.wait,
                warmup=self.warmup,
                active=self.active,
                repeat=self.repeat,
                skip_first=self.skip_first,
            ),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.trace_dir)),
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        self._profiler.start()

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        if self._profiler is not None:
            self._profiler.step()

    def on_train_end(self, state: LoopState, artifacts: LoopArtifacts) -> None:
        self._stop()

    def on_error(self, ctx: LogContext, exc: BaseException) -> None:
        self._stop()

    def close(self) -> None:
        self._stop()

    def _stop(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()


# ---------------------------------------------------------------------------------------------
class GarbageCollectorConfig(pydantic.BaseModel):
    """Params of `GarbageCollector`."""

    model_config = pydantic.ConfigDict(extra="forbid")
    every: pydantic.PositiveInt = 100
    generation: int = pydantic.Field(default=1, ge=0, le=2)


@register("garbage_collector", GarbageCollectorConfig)
class GarbageCollector(Callback):
    """Turns automatic garbage collection off during training and collects on a schedule.

    Why: Python's collector starts whenever allocations cross a threshold, at a random
    point in a step, and a full pass over a large heap stalls the step (and, in distributed
    training, every rank waiting for it). As OLMo-core's `GarbageCollectorCallback`, it
    disables automatic collection at `on_train_start` and runs ``gc.collect(generation)``
    (generation 1 by default) every `every` steps; the collector's prior state (on or off)
    comes back at `on_train_end`, `on_error` or `close`, whichever comes first.
    """

    def __init__(self, every: int = 100, generation: int = 1) -> None:
        self.every = _check_every("GarbageCollector", every)
        if generation not in (0, 1, 2):
            raise ConfigError(f"GarbageCollector(generation={generation!r}): use 0, 1 or 2")
        self.generation = generation
        self._was_enabled: bool | None = None

    def on_train_start(self, state: LoopState) -> None:
        if self._was_enabled is None:
            self._was_enabled = gc.isenabled()
        gc.disable()

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        if step_idx % self.every == 0:
            gc.collect(self.generation)

    def on_train_end(self, state: LoopState, artifacts: LoopArtifacts) -> None:
        self._restore()

    def on_error(self, ctx: LogContext, exc: BaseException) -> None:
        self._restore()

    def close(self) -> None:
        self._restore()

    def _restore(self) -> None:
        was, self._was_enabled = self._was_enabled, None
        if was:
            gc.enable()


# ---------------------------------------------------------------------------------------------
class EarlyStoppingConfig(pydantic.BaseModel):
    """Params of `EarlyStopping`."""

    model_config = pydantic.ConfigDict(extra="forbid")
    metric: str
    eval_name: str | None = None
    patience: pydantic.PositiveInt = 3
    mode: Literal["min", "max"] = "min"
    min_delta: float = pydantic.Field(default=0.0, ge=0.0)


@register("early_stopping", EarlyStoppingConfig)
class EarlyStopping(Callback):
    """Stops training when `metric` has not improved for `patience` checks in a row.

    Why: training past the point where the validation metric stops improving costs compute
    and overfits. With `eval_name` it watches that in-loop evaluator's `metric` (each
    `on_eval` of it is one check); without, the step metric `metric` (each step is one
    check; a monitor's key such as ``stability/loss_spike_score`` works too), or an eval's
    metric as the store names it, ``"<eval>/<metric>"`` (e.g. ``"val/loss"``). A value
    improves when it beats the best so far by more than `min_delta` (lower for
    ``mode="min"``, higher for ``"max"``); NaN never improves. After `patience` checks
    without improvement it calls ``state.request_stop(reason)``: the loop finishes the
    step, saves its final checkpoint and ends the run as stopped. The best value and the
    count are saved in checkpoints, so a resumed run stops at the same step as one that
    never stopped; a fit that does not resume starts counting afresh (one instance attached
    to an Experiment serves each run on its own).
    """

    def __init__(
        self,
        metric: str,
        eval_name: str | None = None,
        patience: int = 3,
        mode: Literal["min", "max"] = "min",
        min_delta: float = 0.0,
    ) -> None:
        if not metric:
            raise ConfigError("EarlyStopping needs the metric to watch, e.g. metric='loss'")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ConfigError(f"EarlyStopping(patience={patience!r}): use an int >= 1")
        if mode not in ("min", "max"):
            raise ConfigError(f"EarlyStopping(mode={mode!r}): use 'min' or 'max'")
        if min_delta < 0:
            raise ConfigError(f"EarlyStopping(min_delta={min_delta!r}): use a number >= 0")
        self.metric = metric
        self.eval_name = eval_name
        self.patience = patience
        self.mode = mode
        self.min_delta = float(min_delta)
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad_checks = 0
        self._restored = False

    def on_train_start(self, state: LoopState) -> None:
        if not self._restored:  # a new run starts clean; a resumed one keeps its count
            self.best, self.best_step, self.bad_checks = None, None, 0
        self._restored = False

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        if self.eval_name is None and self.metric in metrics:
            self.check(state, step_idx, metrics[self.metric])

    def on_eval(
        self, state: LoopState, step_idx: int, eval_name: str, metrics: dict[str, float]
    ) -> None:
        if self.eval_name is None:  # "val/loss" names the eval and its metric in one
            prefix = f"{eval_name}/"
            if self.metric.startswith(prefix) and self.metric[len(prefix) :] in metrics:
                self.check(state, step_idx, metrics[self.metric[len(prefix) :]])
        elif eval_name == self.eval_name and self.metric in metrics:
            self.check(state, step_idx, metrics[self.metric])

    def check(self, state: LoopState, step_idx: int, value: float) -> None:
        """Count one check of `value` at `step_idx`; request the stop when patience runs out."""
        value = float(value)
        if self._improves(value):
            self.best, self.best_step, self.bad_checks = value, step_idx, 0
            return
        self.bad_checks += 1
        if self.bad_checks >= self.patience:
            where = f"{self.eval_name}/{self.metric}" if self.eval_name else self.metric
            state.request_stop(
                f"early stopping: {where} has not improved for {self.bad_checks} checks "
                f"(best {self.best} at step {self.best_step})"
            )

    def _improves(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def state_dict(self) -> dict[str, Any]:
        """The best value, where it was, and the checks since: all a resume needs."""
        return {"best": self.best, "best_step": self.best_step, "bad_checks": self.bad_checks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved."""
        self.best = state["best"]
        self.best_step = state["best_step"]
        self.bad_checks = int(state["bad_checks"])
        self._restored = True


__all__ = [
    "MONITOR_PRIORITY",
    "EarlyStopping",
    "GPUMemoryMonitor",
    "GarbageCollector",
    "GradientMonitor",
    "ProfilerCallback",
    "SpeedMonitor",
    "StabilityMonitor",
]
