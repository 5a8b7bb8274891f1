"""`SystemMonitor`: CPU, memory and GPU figures of the machine a run trains on, sampled off the
training thread and logged as metrics of the run at the current step.

A daemon thread reads them every `every_s` seconds (10 by default) through psutil (CPU %,
RSS, system memory) and NVML (``nvidia-ml-py``: GPU utilisation, memory, power,
temperature), and leaves the newest sample in one slot. The training thread's only cost is
one attribute read per step: at the end of the first step after a sample, the monitor moves
that sample into the step's `metrics` (it declares ``system/*`` in `metrics_logged`, so it
runs before `SqlLogger` and every other consumer of the step), so the store and every other
logger record it at that step, like the loop's own figures.

What it cannot read (psutil or nvidia-ml-py missing, no NVIDIA driver, no GPU) it says once,
in one log line, and reads the rest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from lab._secrets import logger
from lab.callbacks.params import PositiveFloat
from lab.callbacks.registry import register
from lab.hooks import Callback, LogContext, LoopState

if TYPE_CHECKING:
    from lab.records import LoopArtifacts, TrainingBatch

log = logger("lab.callbacks.system")

_MIB = 1024.0 * 1024.0
INSTALL = "pip install 'lab[system]'"


@register("system_monitor")
class SystemMonitor(Callback):
    """CPU %, RSS and GPU utilisation, memory, power and temperature, every `every_s` seconds.

    Why: a run that is slow because the data loader starves the GPU, or that creeps towards
    the memory limit, shows it here, beside the loss, at the step it happened. Keys
    (``system/`` prefix): ``cpu_percent`` (this process, all its threads: may pass 100),
    ``host_cpu_percent``, ``rss_mib`` (this process), ``host_memory_percent``; per GPU
    ``i`` (those `CUDA_VISIBLE_DEVICES` names, else all): ``gpu{i}/utilization_percent``,
    ``gpu{i}/memory_used_mib``, ``gpu{i}/memory_percent``, ``gpu{i}/power_w``,
    ``gpu{i}/temperature_c``. ``gpus=False`` reads no GPU.
    """

    metrics_logged = ("system/*",)  # the GPU keys depend on the machine

    def __init__(self, every_s: PositiveFloat = 10.0, gpus: bool = True) -> None:
        self.every_s = float(every_s)
        self.gpus = gpus
        #: Samples the thread has taken in this instance's lifetime.
        self.samples = 0
        self._latest: dict[str, float] | None = None
        self._said_missing = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._readers: _Readers | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the thread (a worker process starts its own)."""
        state = self.__dict__.copy()
        state.update(_thread=None, _stop=None, _latest=None, _readers=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled copy with a fresh stop event."""
        self.__dict__.update(state)
        self._stop = threading.Event()

    # -- hooks ---------------------------------------------------------------------------
    def on_train_start(self, state: LoopState) -> None:
        self._start()

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        sample = self._latest
        if sample is not None:
            self._latest = None
            metrics.update(sample)

    def on_train_end(self, state: LoopState, artifacts: LoopArtifacts) -> None:
        self._halt()

    def on_error(self, ctx: LogContext, exc: BaseException) -> None:
        self._halt()

    def close(self) -> None:
        self._halt()

    # -- reading -------------------------------------------------------------------------
    def sample(self) -> dict[str, float]:
        """Read every figure it can now (what the thread does each `every_s`)."""
        if self._readers is None:
            self._readers = _Readers(self.gpus)
            self._say_missing()
        return self._readers.read()

    def _start(self) -> None:
        self._halt()
        self._stop.clear()
        self._latest = None
        self.sample()  # opens the readers (and says once what it cannot read); primes CPU %
        if self._readers is None or not self._readers.any:
            return
        self._thread = threading.Thread(target=self._run, name="lab-system-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self._latest = self.sample()
            except Exception as exc:  # a reader that broke mid-run: say so, stop sampling
                log.warning("SystemMonitor stopped sampling: %r", exc)
                return
            self.samples += 1

    def _halt(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()
        if self._readers is not None:
            self._readers.close()
            self._readers = None

    def _say_missing(self) -> None:
        readers = self._readers
        if self._said_missing or readers is None or not readers.missing:
            return
        self._said_missing = True
        level = logging.WARNING if readers.install else logging.INFO
        hint = f"; {INSTALL}" if readers.install else ""
        log.log(level, "SystemMonitor cannot read %s%s", "; ".join(readers.missing), hint)


class _Readers:
    """psutil and NVML, opened once per fit; `missing` says what could not be opened."""

    def __init__(self, gpus: bool) -> None:
        self.missing: list[str] = []
        self.install = False  # a package is missing: the message names the pip line
        self._proc: Any = None
        self._psutil: Any = None
        self._nvml: Any = None
        self._handles: list[tuple[int, Any]] = []
        try:
            import psutil

            self._psutil = psutil
            self._proc = psutil.Process()
            self._proc.cpu_percent(None)  # primes: the next call covers the time since
            psutil.cpu_percent(None)
        except ImportError:
            self.missing.append("CPU and memory (psutil is not installed)")
            self.install = True
        if gpus:
            self._open_nvml()

    @property
    def any(self) -> bool:
        return self._proc is not None or bool(self._handles)

    def _open_nvml(self) -> None:
        try:
            import pynvml
        except ImportError:
            self.missing.append("GPUs (nvidia-ml-py is not installed)")
            self.install = True
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self.missing.append(f"GPUs (NVML: {exc}; no NVIDIA driver or GPU here)")
            return
        self._nvml = pynvml
        try:
            for index, handle in _visible_gpus(pynvml):
                self._handles.append((index, handle))
        except pynvml.NVMLError as exc:
            self.missing.append(f"GPUs (NVML: {exc})")
        if not self._handles and not any(m.startswith("GPUs") for m in self.missing):
            self.missing.append("GPUs (NVML sees none)")

    def read(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self._proc is not None:
            psutil = self._psutil
            out["system/cpu_percent"] = float(self._proc.cpu_percent(None))
            out["system/host_cpu_percent"] = float(psutil.cpu_percent(None))
            out["system/rss_mib"] = self._proc.memory_info().rss / _MIB
            out["system/host_memory_percent"] = float(psutil.virtual_memory().percent)
        nvml = self._nvml
        for index, handle in self._handles:
            key = f"system/gpu{index}"
            util = _nvml_value(nvml, nvml.nvmlDeviceGetUtilizationRates, handle)
            if util is not None:
                out[f"{key}/utilization_percent"] = float(util.gpu)
            memory = _nvml_value(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
            if memory is not None:
                out[f"{key}/memory_used_mib"] = memory.used / _MIB
                out[f"{key}/memory_percent"] = 100.0 * memory.used / memory.total
            power = _nvml_value(nvml, nvml.nvmlDeviceGetPowerUsage, handle)
            if power is not None:
                out[f"{key}/power_w"] = power / 1000.0
            temp = _nvml_value(nvml, nvml.nvmlDeviceGetTemperature, handle,
                               nvml.NVML_TEMPERATURE_GPU)  # fmt: skip
            if temp is not None:
                out[f"{key}/temperature_c"] = float(temp)
        return out

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()
            self._nvml = None


def _nvml_value(nvml: Any, fn: Any, *args: Any) -> Any:
    """One NVML reading, or None where the device does not support it (power on some
    boards, utilisation under MIG)."""
    try:
        return fn(*args)
    except nvml.NVMLError_NotSupported:
        return None


def _visible_gpus(pynvml: Any) -> list[tuple[int, Any]]:
    """(index as the run sees it, NVML handle) of each GPU `CUDA_VISIBLE_DEVICES` names
    (indices or ``GPU-`` UUIDs), else of every GPU NVML sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        count = pynvml.nvmlDeviceGetCount()
        return [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
    out = []
    for i, name in enumerate(v.strip() for v in visible.split(",") if v.strip()):
        if name.isdigit():
            out.append((i, pynvml.nvmlDeviceGetHandleByIndex(int(name))))
        elif name.startswith(("GPU-", "MIG-")):
            out.append((i, pynvml.nvmlDeviceGetHandleByUUID(name)))
        else:  # "-1" or anything else hides the rest, as CUDA reads it
            break
    return out
