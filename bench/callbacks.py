"""What each built-in callback costs the training thread, per step, against the bare loop.

"The hot path is sacred": per-step work on the training thread must be O(1), with no I/O
wait and no allocation that can be avoided. Three measures, in one run:

hooks   Each callback alone in a `Dispatcher`, after a real `on_train_start` of a bare run,
        and ``Dispatcher.fire("on_step_end", state, step, batch, metrics)`` called in a
        tight loop with a fresh 10-metric dict each call (the loop makes one each step), the
        step counting up so every-N work happens at its own rate. Timed in chunks of
        `--chunk` calls; the figure is the median chunk's mean per call, less that of an
        empty dispatcher doing the same (the `baseline` row: the loop and the dict copy).
        `pre_step` is timed the same way for the callbacks that listen to it. Between
        chunks, outside the clock, a SqlLogger's store is flushed, so what is timed is the
        enqueue, never a wait for a full buffer (the writer thread shows in `fits`). Then,
        under tracemalloc, each call's transient peak (bytes allocated and freed inside the
        call) and what stays allocated per call over 1,000 calls; and the milliseconds of
        `on_train_start` and of `on_train_end` + `close` (set-up and teardown, once a fit).
        On a busy 2-core machine this is far steadier than step times.

blocks  Real fits of the `overhead` loop (an MLP 32->64->1, batch 32, SGD, 1 torch thread,
        10 metrics a step) in which the callback's step hooks are switched on and off in
        alternating blocks of `--block` steps, the callback seeing its own step count (1, 2,
        3, ... over the steps it runs), so every-N work keeps its rate. A step is timed from
        the first `pre_step` hook to the last `on_step_end` hook (forward, backward, the
        optimizer and every step hook); on-steps against off-steps of the same fit, seconds
        apart, so machine drift cancels. The hooks' own calls are also timed where they
        run (`hook_us_*`, less an empty call's): between torch's kernels, with cold caches,
        the same Python costs 2-4 times what the tight loop of `hooks` shows. `aa` switches
        an empty on_step_end: the noise floor. Work a callback leaves to another thread or
        process (the SqlLogger's writer, wandb's service) lands on whichever steps it
        overlaps, on or off, so the step difference understates it: `fits` has it.

fits    Whole fits with each callback attached alone, against `bare` (no callback) and
        `aa` (bare again: the A/A noise floor), the arms rotating each round: the median over
        rounds of (the arm's median step - bare's in the same round), the same for the mean
        step and for the training thread's CPU time, and the whole fit's difference in ms.
        Noisy here (other processes share the two cores, and a fit runs at ~300 or ~460 µs a
        step depending on what the neighbours do): read it with its A/A row.

Callbacks: SqlLogger (the reference), ConsoleLogger (plain lines into os.devnull),
JsonlLogger, ConfigSaver, MetricSaver(every=100), SpeedMonitor, StabilityMonitor (also with
window=1000: O(1), so the same cost), GradientMonitor(every=10), GarbageCollector,
EarlyStopping (never stopping), SystemMonitor(every_s=0.1), Notifier (a webhook never
called: it only fires at a run's or an experiment's end), WandbLogger offline
(WANDB_MODE=offline, WANDB_DIR in a temporary folder; skipped without wandb) and
ModelAverager(window=100, every=500) when `lab.callbacks.averaging` exists. Prints one JSON
line; ~2 minutes.

    python bench/callbacks.py [--steps 1000] [--rounds 6] [--block 20] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
import tracemalloc
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import StepClock, StepClockEnd, log, machine

from lab import Callback, LogContext, LoopArtifacts, LoopState, TrainingBatch, TrainingLoop
from lab.dispatch import Dispatcher

METRICS_PER_STEP = 10
#: The step metrics the loop hands each on_step_end (4 of its own, 6 from the loss).
TEMPLATE = {
    "loss": 0.5,
    "lr": 0.01,
    "grad_norm": 1.25,
    "step_time": 3e-4,
    **{f"extra_{i}": float(i) for i in range(METRICS_PER_STEP - 4)},
}

Factory = Callable[[Path], Callback]


# -- the callbacks -------------------------------------------------------------------------------
def factories(folder: Path) -> tuple[dict[str, Factory], dict[str, str]]:
    """name -> a function making a fresh instance (given its run folder); and the skipped."""
    from lab.callbacks.files import ConfigSaver, MetricSaver
    from lab.callbacks.monitors import (
        EarlyStopping,
        GarbageCollector,
        GradientMonitor,
        SpeedMonitor,
        StabilityMonitor,
    )
    from lab.callbacks.notify import Notifier
    from lab.callbacks.system import SystemMonitor
    from lab.loggers import ConsoleLogger, JsonlLogger, SqlLogger

    devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    made: dict[str, Factory] = {
        "SqlLogger": lambda d: SqlLogger(f"sqlite:///{d / 'store.db'}"),
        "ConsoleLogger": lambda d: ConsoleLogger(progress=False, stream=devnull),
        "JsonlLogger": lambda d: JsonlLogger(),
        "ConfigSaver": lambda d: ConfigSaver(),
        "MetricSaver(every=100)": lambda d: MetricSaver(every=100),
        "SpeedMonitor": lambda d: SpeedMonitor(),
        "StabilityMonitor": lambda d: StabilityMonitor(),
        "StabilityMonitor(window=1000)": lambda d: StabilityMonitor(window=1000),
        "GradientMonitor(every=10)": lambda d: GradientMonitor(every=10),
        "GarbageCollector": lambda d: GarbageCollector(),
        "EarlyStopping": lambda d: EarlyStopping("loss", patience=10**9),
        "Notifier": lambda d: Notifier("http://127.0.0.1:9/never-called"),
        # sampled 100 times as often as its default, so the thread's share shows in `fits`
        "SystemMonitor(every_s=0.1)": lambda d: SystemMonitor(every_s=0.1),
    }
    skipped: dict[str, str] = {}
    try:
        import wandb  # noqa: F401 - only to know whether the arm can run

        from lab.loggers.wandb import WandbLogger

        os.environ["WANDB_MODE"] = "offline"
        os.environ["WANDB_DIR"] = str(folder / "wandb")
        os.environ.setdefault("WANDB_SILENT", "true")
        (folder / "wandb").mkdir(exist_ok=True)
        made["WandbLogger(offline, log_every=1)"] = lambda d: WandbLogger(
            project="lab-bench", mode="offline", log_every=1
        )
        made["WandbLogger(offline)"] = lambda d: WandbLogger(project="lab-bench", mode="offline")
    except ImportError as exc:
        skipped["WandbLogger(offline)"] = f"wandb is not installed ({exc})"
        skipped["WandbLogger(offline, log_every=1)"] = skipped["WandbLogger(offline)"]
    try:
        from lab.callbacks.averaging import ModelAverager  # type: ignore[import-not-found]

        # a 100-step window before each merge, every 500 steps: a fifth of the steps add
        made["ModelAverager(window=100, every=500)"] = lambda d: ModelAverager(
            window=100, every=500
        )
    except ImportError as exc:  # not written yet
        skipped["ModelAverager"] = f"{type(exc).__name__}: {exc}"
    return made, skipped


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 2)


# -- hooks: one dispatcher call at a time --------------------------------------------------------
def _between(callbacks: list[Callback]) -> None:
    """Outside the clock: empty a SqlLogger's buffer, so no chunk waits on a full one."""
    for cb in callbacks:
        store = getattr(cb, "_store", None)
        if store is not None:
            store.flush()


def time_hook(
    name: str, make: Factory | None, folder: Path, chunks: int, chunk: int
) -> dict[str, Any]:
    """Median per-call seconds of `on_step_end` (and `pre_step`) over `chunks` chunks, the
    allocations per call, and the set-up and teardown of a bare run in milliseconds."""
    run_dir = folder / f"hooks-{_slug(name)}"
    run_dir.mkdir(parents=True)
    callbacks = [make(run_dir)] if make is not None else []
    model, opt = _model()
    x, y = torch.randn(32, 32), torch.randn(32, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()  # GradientMonitor reads .grad
    ctx = LogContext(experiment="", output_dir=run_dir.parent, run_key=run_dir.name)
    state = LoopState(ctx=ctx, model=model, optimizer=opt, num_steps=10**9)
    batch = TrainingBatch()
    batch.data = (x, y)
    hooks = Dispatcher(callbacks, strict=True)
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    hooks.fire("on_train_start", state)
    out["train_start_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    fire = hooks.fire
    step = 0
    try:
        for hook in ("on_step_end", "pre_step"):
            if callbacks and not hooks.listens(hook):
                continue
            per_call: list[float] = []
            planned = chunks + 1  # the first chunk warms up and is dropped
            while len(per_call) < planned:
                _between(callbacks)
                template = TEMPLATE
                t0 = time.perf_counter()
                if hook == "on_step_end":
                    for _ in range(chunk):
                        step += 1
                        fire("on_step_end", state, step, batch, dict(template))
                else:
                    for _ in range(chunk):
                        step += 1
                        fire("pre_step", state, step, batch)
                per_call.append((time.perf_counter() - t0) / chunk)
                if len(per_call) == 1:  # a slow hook gets fewer chunks: ~2 s of them
                    planned = 1 + max(3, min(chunks, int(2.0 / (per_call[0] * chunk))))
            per_call = per_call[1:]
            out[hook] = {
                "chunks": len(per_call),
                "us_median": round(statistics.median(per_call) * 1e6, 3),
                "us_min": round(min(per_call) * 1e6, 3),
                "us_max": round(max(per_call) * 1e6, 3),
            }
        if callbacks and hooks.listens("on_step_end"):
            out["alloc"] = _allocations(hooks, state, batch, callbacks, step)
        artifacts = LoopArtifacts(model=model, metrics=dict(TEMPLATE), step=step)
        t0 = time.perf_counter()
        hooks.fire("on_train_end", state, artifacts)
        hooks.fire("close")
        out["train_end_close_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    finally:
        hooks.fire("close")  # a second close is a no-op for every built-in callback
    return out


def _allocations(
    hooks: Dispatcher, state: LoopState, batch: Any, callbacks: list[Callback], step: int
) -> dict[str, float]:
    """Per on_step_end call, under tracemalloc: the median, mean and largest transient peak
    (bytes allocated and freed within the call), and what stays allocated per call over
    1,000 calls (a buffer or a history that grows). The dict handed in is made before each
    call and not counted; what a SqlLogger queues stays allocated until the next flush."""
    _between(callbacks)
    for _ in range(100):  # warm: lazy caches, first-time keys
        step += 1
        hooks.fire("on_step_end", state, step, batch, dict(TEMPLATE))
    _between(callbacks)
    n = 1000
    peaks = array("q", bytes(8 * n))  # filled in place: the measuring allocates nothing
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        for i in range(n):
            step += 1
            metrics = dict(TEMPLATE)
            before, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            hooks.fire("on_step_end", state, step, batch, metrics)
            _, peak = tracemalloc.get_traced_memory()
            peaks[i] = peak - before
            del metrics
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return {
        "transient_bytes_median": statistics.median(peaks),
        "transient_bytes_mean": round(statistics.mean(peaks), 1),
        "transient_bytes_max": max(peaks),
        "retained_bytes_per_call": round((end - start) / n, 1),
    }


# -- steps: real fits ----------------------------------------------------------------------------
class NoOp(Callback):
    """An on_step_end that does nothing: the `aa` arm of `blocks`, and its timed empty call."""

    def on_step_end(self, state, step_idx, batch, metrics) -> None:  # type: ignore[no-untyped-def]
        pass


class Blocks(Callback):
    """Passes `inner`'s step hooks through in every other block of `block` steps (off
    first), numbered by its own count of steps, so that every-N work keeps its rate and no
    block ends on the loop's last step; every other loop hook passes through as it is.
    Each on-step's hook calls are timed where they run, between torch's kernels (`hook_s`)."""

    def __init__(self, inner: Callback, block: int) -> None:
        self.priority = inner.priority  # type: ignore[misc]
        self.inner = inner
        self.block = block
        self.on = False
        self.count = 0
        self.hook_s: list[float] = []
        kind = type(inner)
        self._pre = inner.pre_step if kind.pre_step is not Callback.pre_step else None
        self._end = inner.on_step_end if kind.on_step_end is not Callback.on_step_end else None
        self._pre_s = 0.0

    def pre_step(self, state, step_idx, batch) -> None:  # type: ignore[no-untyped-def]
        self.on = (step_idx - 1) // self.block % 2 == 1
        self._pre_s = 0.0
        if self.on:
            self.count += 1
            if self._pre is not None:
                t0 = time.perf_counter()
                self._pre(state, self.count, batch)
                self._pre_s = time.perf_counter() - t0

    def on_step_end(self, state, step_idx, batch, metrics) -> None:  # type: ignore[no-untyped-def]
        if self.on and self._end is not None:
            t0 = time.perf_counter()
            self._end(state, self.count, batch, metrics)
            self.hook_s.append(self._pre_s + time.perf_counter() - t0)
        elif self.on:
            self.hook_s.append(self._pre_s)

    def on_train_start(self, state) -> None:  # type: ignore[no-untyped-def]
        self.inner.on_train_start(state)

    def on_train_end(self, state, artifacts) -> None:  # type: ignore[no-untyped-def]
        self.inner.on_train_end(state, artifacts)

    def on_error(self, ctx, exc) -> None:  # type: ignore[no-untyped-def]
        self.inner.on_error(ctx, exc)

    def close(self) -> None:
        self.inner.close()


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):  # type: ignore[no-untyped-def]
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    return loss, {f"extra_{i}": float(i) for i in range(METRICS_PER_STEP - 4)}


def one_fit(steps: int, extra: list[Callback], run_dir: Path) -> dict[str, Any]:
    """One fit of the seeded model in `run_dir`: per step (numbered from 1) its wall and CPU
    seconds, the first 10% dropped; and the whole fit's seconds."""
    model, opt = _model()
    data = [(torch.randn(32, 32), torch.randn(32, 1)) for _ in range(16)]
    clock = StepClock()
    loop = TrainingLoop(
        model, opt, data, loss_fn, steps, callbacks=[*extra, clock, StepClockEnd(clock)]
    )
    gc.collect()  # every fit starts from the same heap
    t0 = time.perf_counter()
    loop.fit(run_dir=run_dir)
    fit_s = time.perf_counter() - t0
    skip = steps // 10
    spans = list(zip(clock.starts, clock.ends, strict=True))
    return {
        "step": list(range(skip + 1, steps + 1)),
        "step_s": [b[0] - a[0] for a, b in spans][skip:],
        "step_cpu_s": [b[1] - a[1] for a, b in spans][skip:],
        "fit_s": fit_s,
    }


def on_off(result: dict[str, Any], block: int, hook_s: list[float]) -> dict[str, float]:
    """Within one blocks fit: on-steps less off-steps (median step, mean step, mean CPU),
    and the median and mean of the hooks' own time in the on-steps (the first tenth of
    the fit's steps dropped, as in the step times)."""
    on = [((s - 1) // block) % 2 == 1 for s in result["step"]]

    def split(field: str) -> tuple[list[float], list[float]]:
        values = result[field]
        return [v for v, o in zip(values, on, strict=True) if o], [
            v for v, o in zip(values, on, strict=True) if not o
        ]

    wall_on, wall_off = split("step_s")
    cpu_on, cpu_off = split("step_cpu_s")
    return {
        "median": statistics.median(wall_on) - statistics.median(wall_off),
        "mean": statistics.mean(wall_on) - statistics.mean(wall_off),
        "cpu": statistics.mean(cpu_on) - statistics.mean(cpu_off),
        "off_median": statistics.median(wall_off),
        "hook_median": statistics.median(hook_s[len(hook_s) // 10 :]),
        "hook_mean": statistics.mean(hook_s[len(hook_s) // 10 :]),
    }


def summarize_blocks(results: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Per arm, over rounds: the median of each fit's on-less-off differences."""
    out: dict[str, Any] = {}
    aa_hook = statistics.median(r["hook_median"] for r in results["aa"])
    aa_hook_mean = statistics.median(r["hook_mean"] for r in results["aa"])
    for arm, rounds in results.items():
        off = statistics.median(r["off_median"] for r in rounds)
        added = statistics.median(r["median"] for r in rounds)
        hook = statistics.median(r["hook_median"] for r in rounds)
        hook_mean = statistics.median(r["hook_mean"] for r in rounds)
        called = arm != "aa" and hook_mean > 0.0  # 0.0: no step hook, nothing was called
        out[arm] = {
            # the hooks' own time, in the loop, less aa's (an empty call, timed alike)
            "hook_us_median": _us(hook - aa_hook if called else hook),
            "hook_us_mean": _us(hook_mean - aa_hook_mean if called else hook_mean),
            "off_step_us_median": _us(off),
            "added_us_median_step": _us(added),
            "added_pct": round(100 * added / off, 1),
            "added_us_mean_step": _us(statistics.median(r["mean"] for r in rounds)),
            "added_cpu_us_mean_step": _us(statistics.median(r["cpu"] for r in rounds)),
            "added_us_per_round": [round(r["median"] * 1e6, 1) for r in rounds],
        }
    return out


def summarize_fits(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per arm: its median step, and the paired (same round) differences against bare."""
    median, mean = statistics.median, statistics.mean
    bare = results["bare"]
    bare_median = median(median(r["step_s"]) for r in bare)
    out: dict[str, Any] = {"bare": {"step_us_median": _us(bare_median)}}
    for arm, rounds in results.items():
        if arm == "bare":
            continue
        pairs = list(zip(rounds, bare, strict=True))
        median_diff = [median(a["step_s"]) - median(b["step_s"]) for a, b in pairs]
        out[arm] = {
            "step_us_median": _us(median(median(r["step_s"]) for r in rounds)),
            "added_us_median_step": _us(median(median_diff)),
            "added_pct_of_bare": round(100 * median(median_diff) / bare_median, 1),
            "added_us_mean_step": _us(
                median(mean(a["step_s"]) - mean(b["step_s"]) for a, b in pairs)
            ),
            "added_cpu_us_mean_step": _us(
                median(mean(a["step_cpu_s"]) - mean(b["step_cpu_s"]) for a, b in pairs)
            ),
            "added_us_per_round": [round(d * 1e6, 1) for d in median_diff],
            "fit_added_ms": round(median(a["fit_s"] - b["fit_s"] for a, b in pairs) * 1e3, 1),
        }
    return out


def _rotate(arms: list[str], i: int) -> list[str]:
    return arms[i % len(arms) :] + arms[: i % len(arms)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="steps per blocks fit")
    parser.add_argument("--fit-steps", type=int, default=500, help="steps per whole fit")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of fits (both kinds)")
    parser.add_argument("--block", type=int, default=20, help="steps per on or off block")
    parser.add_argument("--chunk", type=int, default=1000, help="hook calls per timed chunk")
    parser.add_argument("--chunks", type=int, default=15, help="timed chunks per callback")
    parser.add_argument("--quick", action="store_true", help="a smoke run of ~30 s")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.fit_steps, args.rounds, args.chunks, args.chunk = 400, 200, 2, 5, 500
    torch.set_num_threads(1)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lab-bench-callbacks-") as tmp:
        folder = Path(tmp)
        made, skipped = factories(folder)
        for name, why in skipped.items():
            log(f"skipping {name}: {why}")

        # -- hooks ---------------------------------------------------------------------------
        hooks: dict[str, Any] = {}
        for name, make in [("baseline", None), *made.items()]:
            hooks[name] = time_hook(name, make, folder, args.chunks, args.chunk)
            shown = hooks[name].get("on_step_end", {}).get("us_median", "-")
            log(f"hooks {name}: on_step_end {shown} us/call")
        base = hooks["baseline"]["on_step_end"]["us_median"]
        base_pre = hooks["baseline"]["pre_step"]["us_median"]
        for name, row in hooks.items():
            if name == "baseline":
                continue
            if "on_step_end" in row:
                row["on_step_end"]["us_net"] = round(row["on_step_end"]["us_median"] - base, 3)
            else:
                row["on_step_end"] = "not overridden: the dispatcher never calls it per step"
            if "pre_step" in row:
                row["pre_step"]["us_net"] = round(row["pre_step"]["us_median"] - base_pre, 3)

        one_fit(200, [], folder / "warm")  # warm torch up before any fit is timed

        # -- blocks --------------------------------------------------------------------------
        arms = ["aa", *made]
        blocks: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
        for i in range(args.rounds):
            for arm in _rotate(arms, i):
                run_dir = folder / f"blocks-{_slug(arm)}-r{i}"
                run_dir.mkdir()
                switch = Blocks(NoOp() if arm == "aa" else made[arm](run_dir), args.block)
                result = one_fit(args.steps, [switch], run_dir)
                blocks[arm].append(on_off(result, args.block, switch.hook_s))
            log(
                f"blocks round {i + 1}/{args.rounds}: on - off median step "
                + ", ".join(f"{a} {r[-1]['median'] * 1e6:.1f}" for a, r in blocks.items())
                + " us"
            )

        # -- fits ----------------------------------------------------------------------------
        arms = ["bare", "aa", *made]
        fits: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
        for i in range(args.rounds):
            for arm in _rotate(arms, i):
                run_dir = folder / f"fits-{_slug(arm)}-r{i}"
                run_dir.mkdir()
                extra = [] if arm in ("bare", "aa") else [made[arm](run_dir)]
                fits[arm].append(one_fit(args.fit_steps, extra, run_dir))
            log(
                f"fits round {i + 1}/{args.rounds}: median step "
                + ", ".join(
                    f"{a} {statistics.median(r[-1]['step_s']) * 1e6:.0f}" for a, r in fits.items()
                )
                + " us"
            )

    print(
        json.dumps(
            {
                "bench": "callbacks",
                "machine": machine(torch_threads=torch.get_num_threads()),
                "params": {
                    "steps": args.steps,
                    "fit_steps": args.fit_steps,
                    "rounds": args.rounds,
                    "block": args.block,
                    "chunk": args.chunk,
                    "chunks": args.chunks,
                    "metrics_per_step": METRICS_PER_STEP,
                },
                "hooks_us_per_call": hooks,
                "blocks": summarize_blocks(blocks),
                "fits": summarize_fits(fits),
                "skipped": skipped,
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
