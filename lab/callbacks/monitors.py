"""Monitors: throughput, GPU memory, stability, gradients, profiling, GC and early stopping.

Each is a `Callback` registered under a snake-case kind (``build([{"kind":
"speed_monitor"}])``), modelled on OLMo-core's callbacks of the same purpose.

Where the figures go: the loop hands one `metrics` dict to every `on_step_end`. A monitor
that adds figures to a step declares them in `metrics_logged`, which makes it a producer: the
dispatcher runs its `on_step_end` before every callback that declares none (the `SqlLogger`
that stores the step, a console logger, `EarlyStopping`), whatever the priority numbers, so
its keys are stored at the step like the loop's own metrics and every consumer sees them.

Gradients: the loop clears gradients (``zero_grad(set_to_none=True)``) right before each
backward, not after the optimizer step, so in `on_step_end` every ``param.grad`` still holds
the gradient of the step just taken (after clipping when ``grad_clip`` is set; unscaled under
AMP). There is no hook between backward and the optimizer step; `GradientMonitor` reads the
gradients in `on_step_end`, where the parameters are already updated.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import pydantic
import torch
from annotated_types import Ge

from lab._secrets import logger
from lab.callbacks.params import (
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
)
from lab.callbacks.registry import register
from lab.errors import ConfigError
from lab.hooks import Callback, LogContext, LoopState

if TYPE_CHECKING:
    from lab.records import LoopArtifacts, TrainingBatch

log = logger("lab.callbacks.monitors")


# ---------------------------------------------------------------------------------------------
@register("speed_monitor")
class SpeedMonitor(Callback):
    """Throughput: steps/s, samples/s, tokens/s and MFU, averaged over each `every` steps.

    Why: the loop's ``step_time`` covers only forward, backward and the optimizer step;
    throughput as the wall clock sees it also pays for data loading, hooks, evals and
    checkpoints, which is what decides how long a run takes. The clock starts right before
    the first step of a fit (so `at_start` evals and setup do not count) and each report
    covers the wall time since the previous one.

    Keys: ``throughput/steps_per_s``, ``throughput/samples_per_s`` (batch size: the first
    dimension of the batch's first tensor that has one, else ``len(batch)`` of a list or
    tuple), ``throughput/tokens_per_s``
    when the batch declares its tokens (a dict batch with ``"num_tokens"``, a batch object
    with a ``num_tokens`` attribute, or a ``num_tokens`` metric returned by the loss
    function), and ``throughput/mfu`` (tokens/s x `flops_per_token` / `peak_flops`, a
    fraction) when both are given.
    """

    live_steps = True  # the clock at each step's end

    metrics_logged = (
        "throughput/steps_per_s",
        "throughput/samples_per_s",
        "throughput/tokens_per_s",
        "throughput/mfu",
    )

    def __init__(
        self,
        every: PositiveInt = 1,
        flops_per_token: PositiveFloat | None = None,
        peak_flops: PositiveFloat | None = None,
    ) -> None:
        self.every = every
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
    """Samples in the batch: `TrainingBatch.size`, else the length of a list or tuple of
    examples; None when neither says (a dict of scalars is not a count)."""
    size = batch.size
    if size is not None:
        return size
    data = batch.data
    return len(data) if isinstance(data, (list, tuple)) else None


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
@register("gpu_memory_monitor")
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

    live_steps = True  # the device's memory at the step

    metrics_logged = (
        "gpu_memory/allocated_mb",
        "gpu_memory/reserved_mb",
        "gpu_memory/max_allocated_mb",
        "gpu_memory/alloc_retries",
    )

    def __init__(self, every: PositiveInt = 1) -> None:
        self.every = every
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
_isfinite, _sqrt = math.isfinite, math.sqrt  # module globals: one lookup less per use


class _Series:
    """One watched key: its detection history and its spike counts, each kept in O(1) a value.

    The history is a ring of the last `window` finite values (a list allocated once) with
    their mean and sum of squared deviations (`m2`), kept by Welford's update: adding a
    value while the ring has room, replacing the oldest once it is full. Welford works on
    deviations from the mean, so a loss of 1e6 with noise of 1e-3 keeps its variance where
    running sums of x and x**2 lose it to cancellation. The values enter it less `shift` (the
    first value, later the mean at the last recompute), so the mean it tracks is near 0 and
    its rounding is that of the noise, not of the loss's magnitude. Rounding still adds up,
    so every `window` values the statistics are recomputed from the ring with `math.fsum`:
    O(window) once per `window` steps, O(1) amortised. The spike flags are a ring of bytes
    as long as the rolling window, with the count of spikes in it, and the run's totals.
    """

    __slots__ = (
        "count",
        "flags",
        "key",
        "m2",
        "mean",
        "pos",
        "recent",
        "rolling_window",
        "score_key",
        "shift",
        "since_refresh",
        "skip_nan",
        "spike_key",
        "spikes",
        "steps",
        "total_key",
        "values",
        "window",
    )

    def __init__(self, key: str, window: int, rolling_window: int) -> None:
        self.key = key
        # Built once: a step writes its figures under these names without formatting any.
        self.spike_key = f"stability/{key}_spike"
        self.score_key = f"stability/{key}_spike_score"
        self.total_key = f"stability/{key}_spike_score_total"
        self.skip_nan = key == "grad_norm"  # the loop logs NaN for a step without gradients
        self.window, self.rolling_window = window, rolling_window
        self.values = [0.0] * window
        self.flags = bytearray(rolling_window)
        self.reset()

    def reset(self) -> None:
        self.count = self.pos = self.since_refresh = 0
        self.shift = self.mean = self.m2 = 0.0  # mean: of the values less shift
        self.flags[:] = bytes(len(self.flags))
        self.recent = self.spikes = self.steps = 0

    def std(self) -> float:
        var = self.m2 / self.count if self.count else 0.0
        return math.sqrt(var) if var > 0.0 else 0.0  # m2 may round to a hair below 0

    def is_spike(self, value: float, threshold: float, min_history: int) -> bool:
        if not _isfinite(value):
            return True
        if self.count < min_history:
            return False
        return value - self.shift > self.mean + threshold * self.std()

    def observe(self, value: float, threshold: float, min_history: int) -> bool:
        """Judge `value` against the history, then count it, and keep it if it is finite:
        the one way a value is taken, by a step and by `StabilityMonitor.observe` alike."""
        count = self.count
        if not _isfinite(value):
            self.flag(True)
            return True
        if count < min_history:
            spike = False
        else:
            m2 = self.m2
            std = _sqrt(m2 / count) if m2 > 0.0 else 0.0  # m2 may round to a hair below 0
            spike = value - self.shift > self.mean + threshold * std
        # Welford, on the values less `shift`: add while there is room, else replace the oldest
        values = self.values
        pos = self.pos
        if count == 0:
            self.shift = value
        x = value - self.shift
        mean = self.mean
        if count < self.window:
            count += 1
            self.count = count
            delta = x - mean
            mean += delta / count
            self.m2 += delta * (x - mean)
        else:
            old = values[pos] - self.shift
            delta = x - old
            new_mean = mean + delta / count
            self.m2 += delta * ((x - new_mean) + (old - mean))
            mean = new_mean
        self.mean = mean
        values[pos] = value
        pos += 1
        self.pos = pos if pos < self.window else 0
        self.since_refresh += 1
        if self.since_refresh >= self.window:
            self.refresh()
        self.flag(spike)
        return spike

    def refresh(self) -> None:
        """Recompute the mean and m2 from the ring, dropping what rounding accumulated."""
        self.since_refresh = 0
        n = self.count
        if n == 0:
            self.shift = self.mean = self.m2 = 0.0
            return
        held = self.values if n == len(self.values) else self.values[:n]
        shift = math.fsum(held) / n
        deviations = [v - shift for v in held]
        self.shift = shift
        self.mean = math.fsum(deviations) / n  # what rounding left of the mean: ~0
        self.m2 = math.fsum([(d - self.mean) * (d - self.mean) for d in deviations])

    def flag(self, spike: bool) -> None:
        """Count one observation in the rolling window and the totals."""
        flags = self.flags
        steps = self.steps
        i = steps % self.rolling_window
        self.recent += spike - flags[i]  # the slot held the flag rolling_window steps ago
        flags[i] = spike
        self.steps = steps + 1
        self.spikes += spike

    def history(self) -> list[float]:
        """The held values, oldest first."""
        return self.values[self.pos : self.count] + self.values[: self.pos]

    def recent_flags(self) -> list[int]:
        """The flags of the rolling window, oldest first."""
        size = len(self.flags)
        held = min(self.steps, size)
        return [self.flags[(self.steps - held + j) % size] for j in range(held)]

    def state_dict(self) -> dict[str, Any]:
        """Plain floats and ints (a value a callback logged as a numpy scalar included), so
        the checkpoint loads with weights_only=True."""
        return {
            "values": [float(v) for v in self.history()],
            "shift": float(self.shift),
            "mean": float(self.mean),
            "m2": float(self.m2),
            "since_refresh": int(self.since_refresh),
            "flags": [int(f) for f in self.recent_flags()],
            "spikes": int(self.spikes),
            "steps": int(self.steps),
        }

    def load_state_dict(self, saved: dict[str, Any], exact: bool) -> None:
        """Restore a saved series; `exact` (same windows) keeps its running mean and m2 as
        they were, so the next flags are bit for bit those of an uninterrupted run."""
        self.reset()
        window, size = len(self.values), len(self.flags)
        values = [float(v) for v in saved["values"]][-window:]
        self.values[: len(values)] = values
        self.count, self.pos = len(values), len(values) % window
        if exact:
            self.shift, self.mean = float(saved["shift"]), float(saved["mean"])
            self.m2 = float(saved["m2"])
            self.since_refresh = int(saved["since_refresh"])
        else:
            self.refresh()
        self.steps, self.spikes = int(saved["steps"]), int(saved["spikes"])
        flags = [int(f) for f in saved["flags"]][-size:]
        start = self.steps - len(flags)
        for j, f in enumerate(flags):
            self.flags[(start + j) % size] = f
        self.recent = sum(flags)


@register("stability_monitor")
class StabilityMonitor(Callback):
    """Flags loss and gradient-norm spikes at every step, and scores how often they happen.

    Why: a spike that recovers leaves no trace in a smoothed curve but often precedes a
    divergence; counting them makes instability a number that runs can be compared by.

    As OLMo-core's `StabilityMonitorCallback`: a value is a spike when it exceeds the mean of
    the previous `window` values of its key by more than `threshold` standard deviations
    (population std). Detection starts once `min_history` values are held. A non-finite
    value (NaN, inf) is always a spike and never enters the history, except a NaN
    ``grad_norm``, which the loop logs for a step without gradients and is skipped (a NaN
    loss still shows). Every finite value, spike or not, enters the history, so a second
    spike right after a big one may hide in the variance the first one added.

    For each watched key present in a step's metrics it adds ``stability/<key>_spike`` (1.0
    or 0.0), ``stability/<key>_spike_score_total`` (spikes / observations since the run
    started) and, once `rolling_window` observations have been made,
    ``stability/<key>_spike_score`` (the fraction of the last `rolling_window` that were
    spikes). The rolling score is left out until its window is full, as OLMo-core does: until
    then it would be the total score under another name, and a rate over a handful of steps
    (one spike in the first three: 0.33) reads as alarming when it is only small numbers.
    Each step costs O(1) per key (a ring buffer with Welford's running mean and variance,
    recomputed exactly every `window` values), so a long `window` is as cheap as a short one.

    Its state is saved in checkpoints, so a resumed run flags the same steps and reports the
    same scores as one that never stopped; a fit that does not resume starts with empty
    histories (one instance attached to an Experiment serves each run afresh).
    """

    def __init__(
        self,
        window: Annotated[int, pydantic.Strict(), Ge(2)] = 100,
        threshold: PositiveFloat = 3.0,
        keys: Sequence[str] | str = ("loss", "grad_norm"),
        min_history: Annotated[int, pydantic.Strict(), Ge(2)] = 10,
        rolling_window: PositiveInt = 1000,
    ) -> None:
        if min_history > window:
            raise ConfigError(
                f"StabilityMonitor(min_history={min_history!r}): use 2 <= min_history <= "
                f"window ({window})"
            )
        if isinstance(keys, str):
            keys = (keys,)
        self.window = window
        self.threshold = float(threshold)
        self.keys = tuple(keys)
        self.metrics_logged = tuple(
            f"stability/{k}_{suffix}"
            for k in self.keys
            for suffix in ("spike", "spike_score", "spike_score_total")
        )
        self.metrics_needed = {k: f"StabilityMonitor(keys={self.keys!r})" for k in self.keys}
        self.min_history = int(min_history)
        self.rolling_window = rolling_window
        self._series = {k: _Series(k, window, rolling_window) for k in self.keys}
        self._watched = tuple(self._series.values())  # what on_step_end walks
        self._restored = False

    def on_train_start(self, state: LoopState) -> None:
        if not self._restored:  # a new run starts clean; a resumed one keeps its history
            for series in self._watched:
                series.reset()
        self._restored = False

    def is_spike(self, key: str, value: float) -> bool:
        """Whether `value` would be a spike of `key` now; the history is left as it is."""
        return self._series[key].is_spike(float(value), self.threshold, self.min_history)

    def observe(self, key: str, value: float) -> bool:
        """Take one value of `key` as a step would: whether it is a spike (then counted)."""
        return self._series[key].observe(float(value), self.threshold, self.min_history)

    def baseline(self, key: str) -> tuple[int, float, float]:
        """The values held for `key`, their mean and population std: what the next value of
        `key` is judged against, for checking a flag by hand."""
        series = self._series[key]
        return series.count, series.shift + series.mean, series.std()

    def scores(self, key: str) -> tuple[float | None, float | None]:
        """`key`'s rolling spike score (None until its window is full) and total score
        (None before any observation): the figures the last step reported."""
        series = self._series[key]
        rolling = (
            series.recent / self.rolling_window if series.steps >= self.rolling_window else None
        )
        return rolling, (series.spikes / series.steps if series.steps else None)

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        threshold, min_history, rolling = self.threshold, self.min_history, self.rolling_window
        for series in self._watched:
            value = metrics.get(series.key)
            if value is None:
                continue  # not logged this step
            value = float(value)
            if series.skip_nan and value != value:
                continue  # a NaN grad_norm means "no gradients this step"
            spike = series.observe(value, threshold, min_history)
            metrics[series.spike_key] = 1.0 if spike else 0.0
            metrics[series.total_key] = series.spikes / series.steps
            if series.steps >= rolling:
                metrics[series.score_key] = series.recent / rolling

    def state_dict(self) -> dict[str, Any]:
        """The histories, running statistics and flags, so a resumed run detects and scores
        exactly as an uninterrupted one."""
        return {
            "window": self.window,
            "rolling_window": self.rolling_window,
            "series": {s.key: s.state_dict() for s in self._watched},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved: keys no longer watched are dropped, new ones
        start empty; saved with other windows, the newest values that fit are kept and the
        statistics recomputed from them."""
        saved = state.get("series")
        exact = state.get("window") == self.window
        if saved is None:  # written before the rolling window: the histories and flags only
            history, spikes = state.get("history", {}), state.get("spikes", {})
            saved = {}
            for key, values in history.items():
                flags = spikes.get(key, [])
                saved[key] = {
                    "values": values,
                    "flags": flags,
                    "spikes": sum(flags),
                    "steps": len(flags),
                }
            exact = False
        for series in self._watched:
            if series.key in saved:
                series.load_state_dict(saved[series.key], exact)
            else:
                series.reset()
        self._restored = True


# ---------------------------------------------------------------------------------------------
@register("gradient_monitor")
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

    live_steps = True  # the step's gradients, zeroed by the next

    metrics_logged = ("grad_norm/*", "param_norm/*")

    def __init__(self, every: PositiveInt = 10) -> None:
        self.every = every
        self._params: list[tuple[str, str, torch.Tensor]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the model's parameters (a process pool pickles callbacks)."""
        state = self.__dict__.copy()
        state["_params"] = None
        return state

    def on_train_start(self, state: LoopState) -> None:
        """Name the trainable parameters once per fit: a report then builds no strings."""
        self._params = [
            (f"grad_norm/{name}", f"param_norm/{name}", p)
            for name, p in state.model.named_parameters()
            if p.requires_grad
        ]

    def on_train_end(self, state: LoopState, artifacts: LoopArtifacts) -> None:
        self._params = None  # do not keep the model alive past its fit

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        if step_idx % self.every and step_idx != state.num_steps:
            return
        if self._params is None:  # hooks fed without on_train_start
            self.on_train_start(state)
        assert self._params is not None
        keys = [g for g, _, p in self._params if p.grad is not None]
        tensors = [p.grad for _, _, p in self._params if p.grad is not None]
        keys += [k for _, k, _ in self._params]
        tensors += [p for _, _, p in self._params]
        if not tensors:
            return
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(i)
        values = [0.0] * len(tensors)
        with torch.no_grad():
            for idx in by_device.values():  # one fused norm and one host copy per device
                group = [tensors[i].detach() for i in idx]
                group = [t if t.dtype == torch.float32 else t.float() for t in group]
                host = torch.stack(torch._foreach_norm(group)).cpu().tolist()
                for i, v in zip(idx, host, strict=True):
                    values[i] = v
        metrics.update(zip(keys, values, strict=True))


# ---------------------------------------------------------------------------------------------
@register("profiler")
class ProfilerCallback(Callback):
    """Profiles a few training steps with `torch.profiler` and writes the traces to disk.

    Why: where a step's time goes (kernels, data copies, the optimizer, Python overhead) is
    the first question when throughput is low, and a trace of a few steady-state steps
    answers it. The schedule is torch's: skip `skip_first` steps, then `repeat` cycles of
    `wait` idle, `warmup` traced-but-discarded and `active` recorded steps (``repeat=0``
    repeats until training ends). Each cycle's trace is written by
    ``torch.profiler.tensorboard_trace_handler`` as ``<host>_<pid>.<time>.pt.trace.json``
    under ``<run folder>/profiler`` (`ctx.folder`: the working directory for a bare fit
    without `run_dir`),
    readable by TensorBoard, chrome://tracing and Perfetto. CUDA activity is traced when
    CUDA is available. The profiler stops at `on_train_end`, and on error or close.
    """

    live_steps = True  # the profiler's schedule counts live steps

    def __init__(
        self,
        wait: NonNegativeInt = 1,
        warmup: NonNegativeInt = 1,
        active: PositiveInt = 3,
        repeat: NonNegativeInt = 1,
        skip_first: NonNegativeInt = 0,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
    ) -> None:
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
        base = ctx.folder
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
@register("garbage_collector")
class GarbageCollector(Callback):
    """Turns automatic garbage collection off during training and collects on a schedule.

    Why: Python's collector starts whenever allocations cross a threshold, at a random
    point in a step, and a full pass over a large heap stalls the step (and, in distributed
    training, every rank waiting for it). As OLMo-core's `GarbageCollectorCallback`, it
    disables automatic collection at `on_train_start` and runs ``gc.collect(generation)``
    (generation 1 by default) every `every` steps; the collector's prior state (on or off)
    comes back at `on_train_end`, `on_error` or `close`, whichever comes first.
    """

    def __init__(self, every: PositiveInt = 100, generation: Literal[0, 1, 2] = 1) -> None:
        self.every = every
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
@register("early_stopping")
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
        metric: NonEmptyStr,
        eval_name: NonEmptyStr | None = None,
        patience: PositiveInt = 3,
        mode: Literal["min", "max"] = "min",
        min_delta: NonNegativeFloat = 0.0,
    ) -> None:
        self.metric = metric
        self.eval_name = eval_name
        watched = f"{eval_name}/{metric}" if eval_name else metric
        args = f"{metric!r}, eval_name={eval_name!r}" if eval_name else f"{metric!r}"
        self.metrics_needed = {watched: f"EarlyStopping({args})"}
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
        """The best value, where it was, and the checks since: all a resume needs, as plain
        numbers (a metric a callback logged as a numpy scalar or a tensor included), so the
        checkpoint loads with weights_only=True."""
        best, step = self.best, self.best_step
        return {
            "best": float(best) if best is not None else None,
            "best_step": int(step) if step is not None else None,
            "bad_checks": int(self.bad_checks),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved."""
        self.best = state["best"]
        self.best_step = state["best_step"]
        self.bad_checks = int(state["bad_checks"])
        self._restored = True


__all__ = [
    "EarlyStopping",
    "GPUMemoryMonitor",
    "GarbageCollector",
    "GradientMonitor",
    "ProfilerCallback",
    "SpeedMonitor",
    "StabilityMonitor",
]
