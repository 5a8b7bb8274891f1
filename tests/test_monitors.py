"""The monitors of lab.callbacks.monitors, each on a real TrainingLoop or real hook calls."""

from __future__ import annotations

import gc
import json
import logging
import math
import pickle
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lab import (
    Callback,
    CheckpointConfig,
    Evaluator,
    LogContext,
    LoopState,
    SqlLogger,
    Store,
    TrainingBatch,
    TrainingLoop,
)
from lab.callbacks import REGISTRY, build
from lab.callbacks.monitors import (
    EarlyStopping,
    GarbageCollector,
    GPUMemoryMonitor,
    GradientMonitor,
    ProfilerCallback,
    SpeedMonitor,
    StabilityMonitor,
)
from lab.errors import ConfigError


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch[0], batch[1]
    return torch.nn.functional.mse_loss(model(x), y)


def _loop(
    steps: int,
    callbacks: list[Callback],
    *,
    loss_fn: Any = _mse,
    data: Any = None,
    **kwargs: Any,
) -> TrainingLoop:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    if data is None:
        data = [(torch.randn(5, 3), torch.randn(5, 1)) for _ in range(4)]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return TrainingLoop(model, opt, data, loss_fn, steps, callbacks=callbacks, **kwargs)


class Recorder(Callback):
    """Keeps a copy of each step's metrics as a consumer of the lowest priority sees them."""

    priority = -1000

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}

    def on_step_end(self, state, step_idx, batch, metrics):  # type: ignore[no-untyped-def]
        self.rows[step_idx] = dict(metrics)


def _state() -> LoopState:
    model = torch.nn.Linear(2, 1)
    return LoopState(
        ctx=LogContext(experiment="t", output_dir=Path(".")),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        num_steps=1000,
    )


# -- registry ---------------------------------------------------------------------------------
def test_every_monitor_is_registered_and_built_from_params() -> None:
    built = build(
        [
            {"kind": "speed_monitor", "params": {"every": 5}},
            {"kind": "gpu_memory_monitor"},
            {"kind": "stability_monitor", "params": {"window": 20, "keys": ["loss"]}},
            {"kind": "gradient_monitor", "params": {"every": 3}},
            {"kind": "profiler", "params": {"active": 2}},
            {"kind": "garbage_collector", "params": {"every": 7}},
            {"kind": "early_stopping", "params": {"metric": "loss", "patience": 2}},
        ]
    )
    types = [type(cb) for cb in built]
    assert types == [
        SpeedMonitor,
        GPUMemoryMonitor,
        StabilityMonitor,
        GradientMonitor,
        ProfilerCallback,
        GarbageCollector,
        EarlyStopping,
    ]
    assert built[0].every == 5 and built[2].keys == ("loss",) and built[6].patience == 2
    for kind in ("speed_monitor", "early_stopping", "profiler"):
        assert kind in REGISTRY
    copies = pickle.loads(pickle.dumps(built))  # executor="processes" pickles callbacks
    assert [type(cb) for cb in copies] == types
    with pytest.raises(ConfigError, match="every"):
        build([{"kind": "gradient_monitor", "params": {"every": 0}}])
    with pytest.raises(ConfigError, match="mode"):
        build([{"kind": "early_stopping", "params": {"metric": "x", "mode": "up"}}])


# -- SqlLogger stores what the monitors add ---------------------------------------------------
def test_monitor_metrics_reach_the_sql_logger(tmp_path: Path, sqlite_url: str) -> None:
    loop = _loop(
        6,
        [
            SqlLogger(sqlite_url),
            SpeedMonitor(every=2),
            StabilityMonitor(window=4, min_history=2),
            GradientMonitor(every=3),
        ],
    )
    loop.fit(run_dir=tmp_path / "run")
    store = Store(sqlite_url)
    try:
        (run_id,) = [r["run_id"] for e in store.list_experiments() for r in _runs(store, e)]
        steps = store.metric_values(run_id, "throughput/steps_per_s")
        assert [s for s, _ in steps] == [2, 4, 6] and all(v > 0 for _, v in steps)
        assert [s for s, _ in store.metric_values(run_id, "stability/loss_spike")] == list(
            range(1, 7)
        )
        assert [s for s, _ in store.metric_values(run_id, "grad_norm/0.weight")] == [3, 6]
        assert [s for s, _ in store.metric_values(run_id, "param_norm/2.bias")] == [3, 6]
    finally:
        store.close()


def _runs(store: Store, exp: dict[str, Any]) -> list[dict[str, Any]]:
    return store.get_experiment(exp["name"])["runs"]


# -- SpeedMonitor -----------------------------------------------------------------------------
def test_speed_monitor_matches_the_wall_clock() -> None:
    nap = 0.02
    rec = Recorder()
    speed = SpeedMonitor(every=1)
    data = [{"x": torch.randn(5, 3), "num_tokens": 40} for _ in range(3)]

    def loss(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        time.sleep(nap)
        return model(batch["x"]).pow(2).mean()

    loop = _loop(10, [speed, rec], loss_fn=loss, data=data)
    started = time.perf_counter()
    loop.fit()
    wall = time.perf_counter() - started
    rates = [rec.rows[s]["throughput/steps_per_s"] for s in range(1, 11)]
    assert all(0.1 / nap < r < 1 / nap for r in rates)  # no step can beat its own sleep
    mean_rate = len(rates) / sum(1 / r for r in rates)
    assert 10 / wall <= mean_rate * 1.05  # the steps are a part of the whole fit
    assert mean_rate == pytest.approx(10 / wall, rel=0.5)
    for s in range(1, 11):
        row = rec.rows[s]
        assert row["throughput/samples_per_s"] == pytest.approx(5 * row["throughput/steps_per_s"])
        assert row["throughput/tokens_per_s"] == pytest.approx(40 * row["throughput/steps_per_s"])
    assert "throughput/mfu" not in rec.rows[1]


def test_speed_monitor_averages_over_its_interval_and_reports_mfu() -> None:
    rec = Recorder()
    speed = SpeedMonitor(every=4, flops_per_token=6.0, peak_flops=1e6)

    def loss(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        time.sleep(0.01)
        return _mse(model, batch), {"num_tokens": 100}

    _loop(10, [speed, rec], loss_fn=loss).fit()
    reported = [s for s, row in rec.rows.items() if "throughput/steps_per_s" in row]
    assert reported == [4, 8, 10]  # each `every` steps, and the last
    row = rec.rows[8]
    tps = row["throughput/tokens_per_s"]
    assert tps == pytest.approx(100 * row["throughput/steps_per_s"])
    assert row["throughput/mfu"] == pytest.approx(tps * 6.0 / 1e6)
    assert row["throughput/steps_per_s"] < 100


@pytest.mark.parametrize(
    ("data", "size"),
    [
        ({"num_tokens": torch.tensor(96), "x": torch.ones(4, 24)}, 4),  # 0-dim first: skipped
        ((torch.ones(6, 2), torch.ones(6, 1)), 6),
        ([{"ids": torch.ones(3, 8)}], 3),
        (["a cat", "a dog", "a bird"], 3),  # a list of examples
        ({"lr": 0.1, "name": "x"}, None),  # a dict of scalars is not a count
        (torch.tensor(1.0), None),
    ],
)
def test_speed_monitor_counts_samples_by_the_first_batch_dimension(data: Any, size: Any) -> None:
    from lab.callbacks.monitors import _batch_size
    from lab.loop.training import TrainingBatch

    batch = TrainingBatch()
    batch.data = data
    assert _batch_size(batch) == size


# -- GPUMemoryMonitor -------------------------------------------------------------------------
def test_gpu_memory_monitor_on_cpu_says_inactive_exactly_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec = Recorder()
    monitor = GPUMemoryMonitor(every=1)
    with caplog.at_level(logging.INFO, logger="lab.callbacks.monitors"):
        _loop(20, [monitor, rec]).fit()
        _loop(5, [monitor]).fit()  # a second fit with the same instance says nothing new
    said = [r for r in caplog.records if "GPUMemoryMonitor is inactive" in r.getMessage()]
    assert len(said) == 1
    assert not any(k.startswith("gpu_memory/") for row in rec.rows.values() for k in row)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_memory_monitor_reports_on_cuda() -> None:
    rec = Recorder()
    _loop(4, [GPUMemoryMonitor(every=2), rec], device="cuda").fit()
    row = rec.rows[2]
    assert row["gpu_memory/allocated_mb"] > 0
    assert row["gpu_memory/reserved_mb"] >= row["gpu_memory/allocated_mb"]
    assert row["gpu_memory/max_allocated_mb"] >= row["gpu_memory/allocated_mb"]
    assert "gpu_memory/allocated_mb" not in rec.rows[1]


# -- StabilityMonitor -------------------------------------------------------------------------
def _synthetic_losses(n: int, spikes: dict[int, float]) -> list[float]:
    gen = torch.Generator().manual_seed(3)
    noise = (torch.rand(n + 1, generator=gen) - 0.5) * 0.1  # uniform +-0.05
    return [2.0 - 0.001 * s + float(noise[s]) + spikes.get(s, 0.0) for s in range(n + 1)]


def _window_count(flagged: list[int], step: int, size: int) -> int:
    return sum(1 for f in flagged if step - size < f <= step)


def test_stability_monitor_flags_exactly_the_planted_spikes() -> None:
    # 41 rides on the variance that 40 added to the history: planted, but hidden (as OLMo's)
    losses = _synthetic_losses(120, {25: 1.0, 40: 1.0, 41: 0.5, 90: 2.0})
    losses[100] = math.nan  # a non-finite loss is always a spike
    monitor = StabilityMonitor(window=20, threshold=3.0, keys=("loss",), rolling_window=30)
    state = _state()
    batch = TrainingBatch()
    flagged: list[int] = []
    rows: dict[int, dict[str, float]] = {}
    for step in range(1, 121):
        before = monitor.baseline("loss")
        metrics = {"loss": losses[step], "grad_norm": 1.0}
        monitor.on_step_end(state, step, batch, metrics)
        rows[step] = metrics
        if metrics["stability/loss_spike"]:
            flagged.append(step)
        assert "stability/grad_norm_spike" not in metrics  # only the watched keys
        if step == 100:
            assert monitor.baseline("loss") == before  # NaN never enters the history
    assert flagged == [25, 40, 90, 100]
    # the rolling score appears once 30 steps are seen; the total from the first step
    assert "stability/loss_spike_score" not in rows[29]
    assert rows[1]["stability/loss_spike_score_total"] == 0.0
    expected_rolling = {30: 1, 40: 2, 54: 2, 55: 1, 69: 1, 70: 0, 90: 1, 100: 2, 120: 1}
    for step, spikes in expected_rolling.items():
        assert rows[step]["stability/loss_spike_score"] == spikes / 30, step
    assert rows[40]["stability/loss_spike_score_total"] == 2 / 40
    assert rows[120]["stability/loss_spike_score_total"] == 4 / 120
    for step, row in rows.items():  # and at every step, by the definitions
        assert row["stability/loss_spike_score_total"] == _window_count(flagged, step, step) / step
        if step >= 30:
            assert row["stability/loss_spike_score"] == _window_count(flagged, step, 30) / 30
    assert monitor.scores("loss") == (1 / 30, 4 / 120)
    monitor.on_train_start(state)  # a new run that does not resume starts clean
    fresh = {"loss": 100.0}
    monitor.on_step_end(state, 1, batch, fresh)
    assert fresh["stability/loss_spike"] == 0.0
    assert fresh["stability/loss_spike_score_total"] == 0.0
    assert "stability/loss_spike_score" not in fresh
    assert monitor.baseline("loss") == (1, 100.0, 0.0)


def _direct_run(
    values: list[float], key: str, window: int, threshold: float, min_history: int, rolling: int
) -> list[dict[str, Any]]:
    """The monitor's definitions computed from scratch at every step, with numpy."""
    history: list[float] = []
    flags: list[int] = []
    out: list[dict[str, Any]] = []
    for value in values:
        if key == "grad_norm" and math.isnan(value):
            out.append({})
            continue
        held = np.array(history[-window:])
        mean = float(held.mean()) if len(held) else 0.0
        std = float(held.std()) if len(held) else 0.0
        if not math.isfinite(value):
            spike = True
        else:
            spike = len(held) >= min_history and value > mean + threshold * std
            history.append(value)
        flags.append(int(spike))
        row = {"n": len(held), "mean": mean, "std": std, "spike": float(spike)}
        row["total"] = sum(flags) / len(flags)
        row["rolling"] = sum(flags[-rolling:]) / rolling if len(flags) >= rolling else None
        out.append(row)
    return out


def _heavy_tailed(n: int, seed: int, base: np.ndarray, scale: float) -> list[float]:
    rng = np.random.default_rng(seed)
    noise = rng.standard_t(df=2, size=n) * scale  # heavy tails: some values are spikes
    values = [float(v) for v in base + noise]
    for i in rng.choice(n, size=n // 100, replace=False):
        values[i] = [math.nan, math.inf, -math.inf][i % 3]
    return values


@pytest.mark.parametrize(
    "case",
    ["loss near 2", "loss 1e6 + noise 1e-3", "decaying loss", "grad_norm with NaN steps"],
)
def test_stability_monitor_agrees_with_a_direct_computation_at_every_step(case: str) -> None:
    n, window, rolling = 3000, 64, 100
    steps = np.arange(n)
    key = "loss"
    if case == "loss near 2":
        values = _heavy_tailed(n, 1, np.full(n, 2.0), 0.03)
    elif case == "loss 1e6 + noise 1e-3":  # sums of x and x**2 cancel to nothing here
        values = _heavy_tailed(n, 2, np.full(n, 1e6), 1e-3)
    elif case == "decaying loss":
        values = _heavy_tailed(n, 3, 10.0 * np.exp(-steps / 400.0), 1e-3)
    else:
        key = "grad_norm"
        values = _heavy_tailed(n, 4, 1.0 + steps / n, 0.05)
    expected = _direct_run(values, key, window, 3.0, 8, rolling)
    monitor = StabilityMonitor(
        window=window, threshold=3.0, keys=(key,), min_history=8, rolling_window=rolling
    )
    state, batch = _state(), TrainingBatch()
    flagged = 0
    for step, (value, want) in enumerate(zip(values, expected, strict=True), start=1):
        count, mean, std = monitor.baseline(key)
        metrics = {key: value}
        monitor.on_step_end(state, step, batch, metrics)
        if not want:  # a NaN grad_norm: no figures at all
            assert metrics == {key: value}
            continue
        assert count == want["n"]
        assert mean == pytest.approx(want["mean"], rel=1e-14, abs=1e-300)
        assert std == pytest.approx(want["std"], rel=1e-9, abs=1e-300), step
        assert metrics[f"stability/{key}_spike"] == want["spike"], step
        assert metrics[f"stability/{key}_spike_score_total"] == want["total"]
        assert metrics.get(f"stability/{key}_spike_score") == want["rolling"]
        flagged += int(want["spike"])
    assert 30 < flagged < 300  # the data has spikes, but not everywhere
    if case == "loss 1e6 + noise 1e-3":  # the naive running sums really would fail here
        held = np.array([v for v in values if math.isfinite(v)][-window:])
        naive_var = float((held * held).sum()) / window - (float(held.sum()) / window) ** 2
        assert abs(naive_var - float(held.var())) > 0.5 * float(held.var())  # here: 0.0


def test_stability_monitor_checks_its_params() -> None:
    with pytest.raises(ConfigError, match="rolling_window"):
        StabilityMonitor(rolling_window=0)
    with pytest.raises(ConfigError, match="min_history"):
        StabilityMonitor(window=5, min_history=6)
    with pytest.raises(ConfigError, match="window"):
        StabilityMonitor(window=1)
    with pytest.raises(ConfigError, match="rolling_window"):
        build([{"kind": "stability_monitor", "params": {"rolling_window": 0}}])


def test_stability_monitor_loads_a_state_saved_before_the_rolling_window() -> None:
    old = {"history": {"loss": [1.0, 2.0, 3.0, 2.0]}, "spikes": {"loss": [0, 0, 1, 0]}}
    monitor = StabilityMonitor(window=3, min_history=2, keys=("loss", "grad_norm"))
    monitor.load_state_dict(old)
    monitor.on_train_start(_state())  # a resume keeps what was loaded
    count, mean, std = monitor.baseline("loss")
    assert (count, mean) == (3, pytest.approx(7 / 3))  # the newest 3 that fit the window
    assert std == pytest.approx(float(np.std([2.0, 3.0, 2.0])))
    assert monitor.scores("loss") == (None, 1 / 4)
    assert monitor.baseline("grad_norm") == (0, 0.0, 0.0)  # not in the old state: empty


def test_stability_monitor_in_a_loop_and_across_a_resume(tmp_path: Path) -> None:
    losses = _synthetic_losses(40, {15: 1.5, 33: 1.5})
    data = [(torch.randn(2, 3), torch.tensor(float(i))) for i in range(1, 41)]

    def loss(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        x, i = batch
        return model(x).pow(2).mean() * 0, {"planted": losses[int(i)]}

    def run(steps: int, folder: Path) -> tuple[Recorder, StabilityMonitor]:
        rec = Recorder()
        monitor = StabilityMonitor(window=10, keys=("planted",), min_history=10,
                                   rolling_window=12)  # fmt: skip
        _loop(steps, [monitor, rec], loss_fn=loss, data=data,
              checkpoint=CheckpointConfig(every=5)).fit(run_dir=folder)  # fmt: skip
        return rec, monitor

    straight, whole = run(40, tmp_path / "a")
    assert [s for s, r in straight.rows.items() if r["stability/planted_spike"]] == [15, 33]
    assert straight.rows[40]["stability/planted_spike_score"] == 1 / 12
    assert straight.rows[40]["stability/planted_spike_score_total"] == 2 / 40
    run(23, tmp_path / "b")  # checkpoints at 5, ..., 20 and the end, 23
    resumed, again = run(40, tmp_path / "b")
    assert sorted(resumed.rows) == list(range(24, 41))
    names = [f"stability/planted_{k}" for k in ("spike", "spike_score", "spike_score_total")]
    for s in range(24, 41):
        assert [resumed.rows[s][n] for n in names] == [straight.rows[s][n] for n in names]
    assert again.state_dict() == whole.state_dict()  # bit for bit, running sums included


# -- GradientMonitor --------------------------------------------------------------------------
def test_gradient_monitor_reports_each_steps_own_gradients() -> None:
    rec = Recorder()
    loop = _loop(6, [GradientMonitor(every=3), rec])
    reference = _loop(6, [])  # same seed: the same model, data and first step
    model = reference.model
    x, y = reference.data[0]
    _mse(model, (x, y)).backward()
    expected = {n: float(p.grad.norm()) for n, p in model.named_parameters()}
    loop.fit()
    logged = [s for s, r in rec.rows.items() if any(k.startswith("grad_norm/") for k in r)]
    assert logged == [3, 6]
    for step in (3, 6):
        row = rec.rows[step]
        per = [row[f"grad_norm/{n}"] for n, _ in model.named_parameters()]
        assert math.sqrt(sum(v * v for v in per)) == pytest.approx(row["grad_norm"], rel=1e-5)
    final = {n: float(p.detach().norm()) for n, p in loop.model.named_parameters()}
    for name, value in final.items():
        assert rec.rows[6][f"param_norm/{name}"] == pytest.approx(value, rel=1e-6)
    # the per-parameter norms at step 1, seen directly, equal an independent backward pass
    rec1 = Recorder()
    _loop(1, [GradientMonitor(every=1), rec1]).fit()
    for name, value in expected.items():
        assert rec1.rows[1][f"grad_norm/{name}"] == pytest.approx(value, rel=1e-6)


# -- ProfilerCallback -------------------------------------------------------------------------
def test_profiler_writes_a_trace_to_the_run_folder(tmp_path: Path) -> None:
    profiler = ProfilerCallback(wait=1, warmup=1, active=2, repeat=1)
    _loop(6, [profiler]).fit(run_dir=tmp_path / "run")
    traces = list((tmp_path / "run" / "profiler").glob("*.pt.trace.json"))
    assert len(traces) == 1
    trace = json.loads(traces[0].read_text())
    assert trace["traceEvents"]
    assert profiler._profiler is None  # stopped at on_train_end

    def boom(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        raise RuntimeError("boom")

    failing = ProfilerCallback()
    with pytest.raises(RuntimeError, match="boom"):
        _loop(6, [failing], loss_fn=boom).fit(run_dir=tmp_path / "failed")
    assert failing._profiler is None  # stopped on the error, not left running


# -- GarbageCollector -------------------------------------------------------------------------
def test_garbage_collector_disables_collects_on_schedule_and_restores() -> None:
    seen: list[bool] = []
    collections: list[int] = []

    class Probe(Callback):
        def on_step_end(self, state, step_idx, batch, metrics):  # type: ignore[no-untyped-def]
            seen.append(gc.isenabled())

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    assert gc.isenabled()
    gc.callbacks.append(on_gc)
    try:
        _loop(10, [GarbageCollector(every=3), Probe()]).fit()
    finally:
        gc.callbacks.remove(on_gc)
    assert seen == [False] * 10
    assert collections.count(1) == 3  # steps 3, 6, 9; automatic collection was off
    assert gc.isenabled()


def test_garbage_collector_restores_after_an_error_and_keeps_a_disabled_gc_off() -> None:
    def boom(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _loop(3, [GarbageCollector(every=1)], loss_fn=boom).fit()
    assert gc.isenabled()
    gc.disable()
    try:
        _loop(3, [GarbageCollector(every=1)]).fit()
        assert not gc.isenabled()
    finally:
        gc.enable()


# -- EarlyStopping ----------------------------------------------------------------------------
#: A step metric that improves until step 6, then stalls (7 ties, 8-9 worse, 10 a bit better).
SCORES = [9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 3.0, 3.5, 3.2, 2.99, 3.1, 3.3, 3.4, 3.5, 3.6]


def _indexed_data(n: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(2, 3), torch.tensor(i)) for i in range(n)]


def _score_loss(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    x, i = batch
    return model(x).pow(2).mean(), {"score": SCORES[int(i)]}


def test_early_stopping_on_a_step_metric_stops_at_the_right_step() -> None:
    stopper = EarlyStopping("score", patience=3)
    artifacts = _loop(16, [stopper], loss_fn=_score_loss, data=_indexed_data()).fit()
    # best 3.0 at step 7; steps 8, 9, 10 do not improve (3.0 ties) -> stop after step 10
    assert artifacts.stopped and artifacts.step == 10
    assert "score has not improved for 3 checks" in (artifacts.stop_reason or "")
    assert stopper.best == 3.0 and stopper.best_step == 7
    # min_delta: 2.99 is no improvement on 3.0 by more than 0.05; mode max stops early
    loose = EarlyStopping("score", patience=5, min_delta=0.05)
    assert _loop(16, [loose], loss_fn=_score_loss, data=_indexed_data()).fit().step == 12
    up = EarlyStopping("score", patience=2, mode="max")
    assert _loop(16, [up], loss_fn=_score_loss, data=_indexed_data()).fit().step == 3
    # the same instance in a second run (as under an Experiment) starts counting afresh
    assert _loop(16, [stopper], loss_fn=_score_loss, data=_indexed_data()).fit().step == 10


def test_early_stopping_on_an_eval_metric() -> None:
    steps: list[int] = []

    class StepProbe(Callback):
        def on_step_end(self, state, step_idx, batch, metrics):  # type: ignore[no-untyped-def]
            steps.append(step_idx)

    val = Evaluator("val", lambda model: {"loss": SCORES[steps[-1] - 1]}, every=2)
    stopper = EarlyStopping("loss", eval_name="val", patience=2)
    other = EarlyStopping("loss", eval_name="other", patience=1)
    artifacts = _loop(
        16, [StepProbe(), stopper, other], loss_fn=_score_loss, data=_indexed_data(),
        evaluators=[val],
    ).fit()  # fmt: skip
    # evals at steps 2,4,...: 8.0 6.0 4.0 3.0 3.2 3.1 -> best 3.0 at 8, bad at 10 and 12
    assert artifacts.stopped and artifacts.step == 12
    assert other.bad_checks == 0 and other.best is None  # never saw its eval
    # the store's name for the eval metric, "val/loss", works without eval_name
    steps.clear()
    named = EarlyStopping("val/loss", patience=2)
    again = _loop(
        16, [StepProbe(), named], loss_fn=_score_loss, data=_indexed_data(), evaluators=[val]
    ).fit()
    assert again.stopped and again.step == 12 and named.best == 3.0


def test_early_stopping_across_a_resume_stops_where_an_uninterrupted_run_does(
    tmp_path: Path,
) -> None:
    def loop(steps: int, stopper: EarlyStopping) -> TrainingLoop:
        return _loop(steps, [stopper], loss_fn=_score_loss, data=_indexed_data(),
                     checkpoint=CheckpointConfig(every=2))  # fmt: skip

    # best 3.0 at 7; 8-10 do not improve; 2.99 at 11 does; 12-15 do not -> stop after 15
    straight = loop(16, EarlyStopping("score", patience=4)).fit(run_dir=tmp_path / "a")
    assert straight.stopped and straight.step == 15
    # interrupted after step 12 (one check without improvement so far), then resumed
    first = loop(12, EarlyStopping("score", patience=4)).fit(run_dir=tmp_path / "b")
    assert not first.stopped and first.step == 12
    again = EarlyStopping("score", patience=4)
    resumed = loop(16, again).fit(run_dir=tmp_path / "b")
    assert resumed.stopped and resumed.step == straight.step == 15
    assert (again.best, again.best_step) == (2.99, 11)
    # a stopper that forgot its state would start afresh at step 13 and not stop by 16
    forgetful = EarlyStopping("score", patience=4)
    forgot = loop(16, forgetful)
    forgot.callbacks = [forgetful]
    forgetful.load_state_dict = lambda state: None  # type: ignore[method-assign]
    artifacts = forgot.fit(run_dir=tmp_path / "b", resume=12)
    assert not artifacts.stopped and artifacts.step == 16


# -- docs -------------------------------------------------------------------------------------
def test_the_docs_page_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    page = Path(__file__).resolve().parent.parent / "docs" / "callbacks-monitors.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    assert blocks
    namespace: dict[str, object] = {"__name__": "docs"}
    for block in blocks:
        exec(compile(block, str(page), "exec"), namespace)
    out = capsys.readouterr().out
    assert "grad_norm/bias" in out and "param_norm/bias" in out
