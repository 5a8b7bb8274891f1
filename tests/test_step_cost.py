"""What one step costs the training thread: no Python per metric, and the last values kept.

A step's metrics go from `end_step` through `on_step_end` and `SqlLogger` into the store's
buffer; every check on that path is one pass in C over the step's dict, so the Python
bytecode a step runs is the same for 100 metrics as for 10 (bench/thread_cpu.py measures
the CPU time itself).
"""

from __future__ import annotations

import sqlite3
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

import lab
from lab import CheckpointConfig, RunHandle
from lab.store import Store


def _metrics(k: int, step: int) -> dict[str, float]:
    return {"loss": 1.0 / step, **{f"m{i}": float(i) for i in range(1, k)}}


def _bytecode_per_step(tmp_path: Path, k: int) -> Counter[str]:
    """The Python bytecode instructions that `end_step` runs at step 5 of a run with
    `SqlLogger` on SQLite, `k` float metrics a step, counted per function (`sys.settrace`
    with opcode events)."""
    store = Store(f"sqlite:///{tmp_path / f'ops{k}.db'}")
    ops: Counter[str] = Counter()

    def trace(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            ops[frame.f_code.co_qualname] += 1
        return trace

    try:
        run = lab.start_run(f"ops{k}", store=store, output_dir=tmp_path, quiet=True)
        with run as spec, RunHandle(spec, torch.nn.Linear(2, 1), num_steps=6) as loop:
            for step in loop.steps():
                metrics = _metrics(k, step)
                if step == 5:
                    sys.settrace(trace)
                    try:
                        loop.end_step(metrics)
                    finally:
                        sys.settrace(None)
                else:
                    loop.end_step(metrics)
    finally:
        store.close()
    with sqlite3.connect(tmp_path / f"ops{k}.db") as con:
        assert con.execute("SELECT count(*) FROM metrics").fetchone() == (6 * k,)
    return ops


def test_a_step_runs_the_same_bytecode_for_100_metrics_as_for_10(tmp_path: Path) -> None:
    ten, hundred = _bytecode_per_step(tmp_path, 10), _bytecode_per_step(tmp_path, 100)
    assert hundred == ten
    assert set(ten) >= {"RunHandle.end_step", "SqlLogger.on_step_end", "MetricWriter.put"}


def test_the_last_values_follow_steps_whose_keys_change(tmp_path: Path) -> None:
    """A step that leaves a key out keeps the value logged before, one that adds a key adds
    it, before and after a resume."""
    steps = [{"a": 1.0, "b": 2.0}, {"a": 3.0}, {"a": 4.0, "c": 5.0}, {"a": 6.0, "c": 7.0}]
    with RunHandle(
        None, torch.nn.Linear(2, 1), num_steps=4, run_dir=tmp_path,
        checkpoint=CheckpointConfig(every=2),
    ) as loop:  # fmt: skip
        for step in loop.steps():
            loop.end_step(steps[step - 1])
            if step == 2:
                assert loop.progress.last == {"a": 3.0, "b": 2.0}
            if step == 3:
                break
    assert loop.artifacts is not None
    assert loop.artifacts.metrics == {"a": 4.0, "b": 2.0, "c": 5.0}
    with RunHandle(
        None, torch.nn.Linear(2, 1), num_steps=4, run_dir=tmp_path,
        checkpoint=CheckpointConfig(every=2),
    ) as loop:  # fmt: skip
        assert loop.step == 3  # the save at the end of the first fit
        assert loop.progress.last == {"a": 4.0, "b": 2.0, "c": 5.0}
        for step in loop.steps():
            loop.end_step({"a": 10.0 * step})
    assert loop.artifacts is not None
    assert loop.artifacts.metrics == {"a": 40.0, "b": 2.0, "c": 5.0}
