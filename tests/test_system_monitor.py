"""`SystemMonitor`: real psutil figures sampled on a thread of their own, logged at the step;
what it cannot read (here: no NVIDIA driver) said once."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
import torch

from lab import Experiment, RunSpec, TrainingLoop
from lab.callbacks import build
from lab.callbacks.system import SystemMonitor
from lab.errors import ConfigError
from lab.store import Store

CPU_KEYS = {
    "system/cpu_percent",
    "system/host_cpu_percent",
    "system/rss_mib",
    "system/host_memory_percent",
}
NO_DRIVER = (
    "SystemMonitor cannot read GPUs (NVML: NVML Shared Library Not Found; no NVIDIA driver or "
    "GPU here)"
)
WAIT_S = 10  # a bound on waiting for the thread; the waits end as soon as it has sampled


def _has_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def _wait_for_sample(monitor: SystemMonitor, count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while monitor.samples < count:
        assert time.monotonic() < deadline, "the monitor's thread never sampled"
        time.sleep(0.005)


def _batches(monitor: SystemMonitor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches that wait, before steps 2 and 4, until the monitor has taken a sample since
    the step before ended: that sample is still waiting when the step ends."""
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 6):
        if step in (2, 4):
            _wait_for_sample(monitor, monitor.samples + 1)
        yield torch.randn(4, 3, generator=gen), torch.randn(4, 1, generator=gen)


def _fit(run: RunSpec) -> object:
    (monitor,) = [cb for cb in run.dispatcher.callbacks if isinstance(cb, SystemMonitor)]
    model = torch.nn.Linear(3, 1)
    loop = TrainingLoop(
        model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(monitor),
        lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), 5,
    )  # fmt: skip
    return loop.fit(run)


@pytest.mark.skipif(_has_gpu(), reason="checks the machine without a GPU")
def test_psutil_figures_now() -> None:
    monitor = SystemMonitor(gpus=True)
    try:
        sample = monitor.sample()
    finally:
        monitor.close()
    assert set(sample) == CPU_KEYS
    rss = psutil.Process().memory_info().rss / 2**20
    assert 0.5 * rss < sample["system/rss_mib"] < 2 * rss
    assert 0 <= sample["system/host_memory_percent"] <= 100
    assert sample["system/cpu_percent"] >= 0 and 0 <= sample["system/host_cpu_percent"] <= 100


@pytest.mark.skipif(_has_gpu(), reason="checks the machine without a GPU")
def test_samples_are_logged_at_the_step_and_the_missing_gpu_said_once(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    monitor = SystemMonitor(every_s=0.01)
    with caplog.at_level(logging.INFO, logger="lab.callbacks.system"):
        result = Experiment(
            "sys", _fit, repeats=2, callbacks=[monitor], store=sqlite_url
        ).run()  # fmt: skip
    assert [r.status for r in result.runs] == ["completed", "completed"]
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("lab.")]
    assert said == [("INFO", NO_DRIVER)]  # once, for both runs
    store = Store(sqlite_url)
    try:
        for run_id in (1, 2):
            steps = [step for step, _ in store.metric_values(run_id, "system/rss_mib")]
            # a sample was waiting when steps 2 and 4 ended; maybe more in between
            assert {2, 4} <= set(steps) <= {1, 2, 3, 4, 5}
            for key in CPU_KEYS:
                assert [s for s, _ in store.metric_values(run_id, key)] == steps
    finally:
        store.close()
    assert not [t for t in threading.enumerate() if t.name == "lab-system-monitor"]


def test_missing_packages_give_the_pip_line_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as if nvidia-ml-py were not installed
    monkeypatch.setitem(sys.modules, "psutil", None)
    monitor = SystemMonitor()
    with caplog.at_level(logging.INFO, logger="lab.callbacks.system"):
        assert monitor.sample() == {}
        monitor.close()
        assert monitor.sample() == {}
        monitor.close()
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            "SystemMonitor cannot read CPU and memory (psutil is not installed); GPUs "
            "(nvidia-ml-py is not installed); pip install 'lab[system]'",
        )
    ]


def test_gpus_false_reads_no_gpu(caplog: pytest.LogCaptureFixture) -> None:
    monitor = SystemMonitor(gpus=False)
    with caplog.at_level(logging.INFO, logger="lab.callbacks.system"):
        assert set(monitor.sample()) == CPU_KEYS
        monitor.close()
    assert caplog.records == []


def test_built_by_kind_and_checked() -> None:
    (monitor,) = build([{"kind": "system_monitor", "params": {"every_s": 30}}])
    assert isinstance(monitor, SystemMonitor) and (monitor.every_s, monitor.gpus) == (30.0, True)
    for door in (lambda: build([{"kind": "system_monitor", "params": {"every_s": -1}}]),
                 lambda: SystemMonitor(every_s=-1)):  # fmt: skip
        with pytest.raises(ConfigError) as info:
            door()
        assert str(info.value) == "SystemMonitor(every_s=-1): use a number > 0"


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU and driver")
def test_gpu_figures_on_a_gpu() -> None:
    monitor = SystemMonitor()
    try:
        sample = monitor.sample()
    finally:
        monitor.close()
    assert set(sample) >= CPU_KEYS
    assert 0 <= sample["system/gpu0/memory_percent"] <= 100
    assert sample["system/gpu0/memory_used_mib"] > 0
    assert 0 <= sample["system/gpu0/utilization_percent"] <= 100
    assert 0 < sample["system/gpu0/temperature_c"] < 120
