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

import pytest
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
    assert set(ten) >= {"RunHandle.end_step", "SqlLogger.on_step_end_checked", "MetricWriter.put"}


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


def _store_type_passes(tmp_path: Path, monkeypatch: Any, name: str, callbacks: list[Any]) -> int:
    """How many passes over a step's types the store made in a 4-step run of 3 metrics a
    step (`all_floats`, called through), and the run's rows checked exactly."""
    import lab.store.record_writes as record_writes

    calls = []

    def counted(values: Any) -> bool:
        calls.append(len(values))
        return all_floats(values)

    all_floats = record_writes.all_floats
    monkeypatch.setattr(record_writes, "all_floats", counted)
    store = Store(f"sqlite:///{tmp_path / f'{name}.db'}")
    try:
        run = lab.start_run(name, store=store, output_dir=tmp_path, quiet=True)
        with (
            run as spec,
            RunHandle(spec, torch.nn.Linear(2, 1), num_steps=4, callbacks=callbacks) as loop,
        ):
            for step in loop.steps():
                loop.end_step({"loss": 1.0 / step, "a": 2.0, "b": float(step)})
    finally:
        store.close()
    with sqlite3.connect(tmp_path / f"{name}.db") as con:
        rows = con.execute("SELECT step, key, value FROM metrics ORDER BY step, key").fetchall()
    loss = 7 if callbacks else None  # the producer's replaced value, stored as a float
    assert rows == [
        row
        for step in range(1, 5)
        for row in ((step, "a", 2.0), (step, "b", float(step)), (step, "loss", loss or 1 / step))
    ]
    return len(calls)


class _Replaces(lab.Callback):
    """A producer that replaces the loss with an int: it runs before `SqlLogger`."""

    metrics_logged = ("loss",)

    def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: Any) -> None:
        metrics["loss"] = 7


def test_the_store_skips_its_type_pass_when_no_callback_runs_before_it(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The loop made the step's values floats and nothing ran before `SqlLogger`: the store
    trusts them. A callback before it could have replaced one, so then it checks each step
    (and the int the producer put in is stored as a float)."""
    assert _store_type_passes(tmp_path, monkeypatch, "alone", []) == 0
    # steps 2 to 4: the first step's new keys send it through the store's check per key
    assert _store_type_passes(tmp_path, monkeypatch, "producer", [_Replaces()]) == 3


Stored = tuple[list[bool], list[tuple[int, str, float]], dict[str, float]]


def _stored(
    tmp_path: Path, name: str, steps: list[dict[str, Any]], callbacks: list[Any], monkeypatch: Any
) -> Stored:
    """Run `steps` through a `RunHandle` with `SqlLogger` on SQLite: the store's `keys` flag
    at each step (True: the loop checked the keys, the store skips its pass over them),
    the rows stored, and the last values."""
    import lab.store.record_writes as record_writes

    flags: list[bool] = []
    log_metrics = record_writes.RecordWrites.log_metrics

    def spied(self: Any, run_id: int, step: int, metrics: Any, **kw: Any) -> None:
        flags.append(kw.get("keys", False))
        log_metrics(self, run_id, step, metrics, **kw)

    monkeypatch.setattr(record_writes.RecordWrites, "log_metrics", spied)
    store = Store(f"sqlite:///{tmp_path / f'{name}.db'}")
    try:
        run = lab.start_run(name, store=store, output_dir=tmp_path, quiet=True)
        with (
            run as spec,
            RunHandle(spec, torch.nn.Linear(2, 1), num_steps=len(steps), callbacks=callbacks)
            as loop,
        ):  # fmt: skip
            for step in loop.steps():
                metrics = steps[step - 1]
                loop.end_step(metrics)
                metrics["a"] = -1.0  # the caller's dict, changed after end_step
            last = dict(loop.progress.last)
    finally:
        store.close()
    with sqlite3.connect(tmp_path / f"{name}.db") as con:
        rows = con.execute("SELECT step, key, value FROM metrics ORDER BY step, key").fetchall()
    return flags, rows, last


def test_the_store_skips_its_key_pass_for_the_keys_the_loop_checked(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """One pass over a step's keys serves the loop's last values and the store: a step that
    logs the keys of the steps before it reaches the store as checked; one that adds or
    leaves out a key is checked by the store. What the caller changes in its dict after
    `end_step` is not stored, and the last values follow every step."""
    steps = [
        {"a": 1.0, "b": 2.0},
        {"b": 3.0, "a": 4.0},
        {"a": 5.0, "b": 6.0, "c": 7.0},
        {"a": 8.0, "b": 9.0, "c": 10.0},
        {"a": 11.0},
        {"a": 12.0, "b": 13.0, "c": 14.0},
    ]
    flags, rows, last = _stored(tmp_path, "keys", [dict(s) for s in steps], [], monkeypatch)
    # first step: nothing known yet; 2: the same keys in another order; 3: c is new;
    # 5: b and c left out (the last values keep theirs); 6: the keys of the last values again
    assert flags == [False, True, False, True, False, True]
    assert rows == [(i, k, v) for i, s in enumerate(steps, 1) for k, v in sorted(s.items())]
    assert last == {"a": 12.0, "b": 13.0, "c": 14.0}


class _Adds(lab.Callback):
    """A consumer (no `metrics_logged`) that adds a key after `SqlLogger` has the step."""

    def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: Any) -> None:
        metrics["after"] = float(step_idx)


def test_a_key_added_after_the_store_has_the_step_is_in_the_last_values(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A callback after `SqlLogger` could change the step's dict, so the last values are
    merged after the hook: its key is in them (and not in the store, which had the step
    before it)."""
    steps = [{"a": float(i)} for i in range(1, 4)]
    flags, rows, last = _stored(tmp_path, "adds", steps, [_Adds()], monkeypatch)
    assert rows == [(1, "a", 1.0), (2, "a", 2.0), (3, "a", 3.0)]
    assert last == {"a": 3.0, "after": 3.0}
    assert flags == [False, False, False]  # the last values hold `after`: never the same keys


class _AddsLong(lab.Callback):
    """A consumer that adds, at step 1, a key too long for the store (after `SqlLogger`)."""

    def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: Any) -> None:
        if step_idx == 1:
            metrics["k" * 300] = 1.0


def test_the_loop_vouches_only_for_keys_that_passed_check_key(tmp_path: Path) -> None:
    """A key the store would refuse can reach the last values without the store (a callback
    after it added it); a step that then logs exactly the last values' keys is not handed
    over as checked: the store refuses it, and nothing of it is stored."""
    from lab.errors import MetricError

    bad = "k" * 300
    store = Store(f"sqlite:///{tmp_path / 'bad.db'}")
    try:
        run = lab.start_run("bad", store=store, output_dir=tmp_path, quiet=True)
        with (
            run as spec,
            RunHandle(spec, torch.nn.Linear(2, 1), num_steps=2, callbacks=[_AddsLong()])
            as loop,
        ):  # fmt: skip
            loop.end_step({"a": 1.0})
            assert set(loop.progress.last) == {"a", bad}
            with pytest.raises(MetricError, match="300 characters"):
                loop.end_step({"a": 2.0, bad: 2.0})
    except MetricError:
        pass
    finally:
        store.close()
    with sqlite3.connect(tmp_path / "bad.db") as con:
        assert con.execute("SELECT step, key FROM metrics").fetchall() == [(1, "a")]
