"""Asynchronous checkpoint saves: same checkpoints as synchronous ones, errors never lost."""

from __future__ import annotations

import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from lab import Callback, CheckpointConfig, LoopState, TrainingLoop
from lab.errors import CheckpointError
from lab.loop.checkpoints import (
    COMPLETE_MARKER,
    LATEST_FILE,
    STATE_FILE,
    CheckpointManager,
    ManifestRow,
    step_dirname,
)


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _loop(config: CheckpointConfig, num_steps: int, callbacks: list[Callback]) -> TrainingLoop:
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    data = [(x[i : i + 8], x[i : i + 8].sum(1, keepdim=True)) for i in range(0, 32, 8)]
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return TrainingLoop(model, opt, data, _loss, num_steps, checkpoint=config, callbacks=callbacks)


def _async(config: CheckpointConfig) -> CheckpointConfig:
    return CheckpointConfig(**{**asdict(config), "async_save": True})


def _timeless(rows: list[ManifestRow]) -> list[dict[str, Any]]:
    """The rows without what is timed: `time` and the `step_time` metric."""
    out = []
    for row in rows:
        fields = {k: v for k, v in asdict(row).items() if k != "time"}
        fields["metrics"] = {k: v for k, v in row.metrics.items() if k != "step_time"}
        out.append(fields)
    return out


class Recorder(Callback):
    """Records each on_checkpoint row, and what is on disk when on_train_end fires."""

    def __init__(self) -> None:
        self.rows: list[ManifestRow] = []
        self.threads: list[str] = []
        self.at_end: list[str] = []

    def on_checkpoint(self, state: LoopState, row: ManifestRow) -> None:
        self.rows.append(row)
        self.threads.append(threading.current_thread().name)

    def on_train_end(self, state: LoopState, artifacts: Any) -> None:
        root = artifacts.checkpoint_dir
        self.at_end = sorted(
            p.name for p in root.iterdir() if p.is_dir() and (p / COMPLETE_MARKER).is_file()
        )
        self.latest = (root / LATEST_FILE).read_text()


CONFIGS = [
    CheckpointConfig(every=3, ephemeral_every=1, keep_last=2, fixed_steps=[2], save_at_start=True),
    CheckpointConfig(every=2, keep_top_k=2, metric="loss", mode="min"),
]


@pytest.mark.parametrize("config", CONFIGS, ids=["last+ephemeral+fixed", "top_k"])
def test_async_saves_equal_sync_saves(tmp_path: Path, config: CheckpointConfig) -> None:
    runs = {}
    for name, cfg in (("sync", config), ("async", _async(config))):
        rec = Recorder()
        out = _loop(cfg, 11, [rec]).fit(run_dir=tmp_path / name / "run")
        manager = CheckpointManager(out.checkpoint_dir, cfg)
        runs[name] = (rec, out, manager)
    (srec, _, sman), (arec, aout, aman) = runs["sync"], runs["async"]
    assert _timeless(aman.history()) == _timeless(sman.history())
    assert aman.checkpoints() == sman.checkpoints()
    folders = {
        n: sorted(p.name for p in o.checkpoint_dir.iterdir()) for n, (_, o, _) in runs.items()
    }
    assert folders["async"] == folders["sync"]
    assert arec.latest == srec.latest == step_dirname(11)
    # every row fires on_checkpoint once, in manifest order, on the training thread
    assert _timeless(arec.rows) == _timeless(aman.history()) == _timeless(srec.rows)
    assert _timeless(aout.checkpoints) == _timeless(arec.rows)
    assert set(arec.threads) == {threading.current_thread().name}
    # the final checkpoint was committed before on_train_end fired
    assert step_dirname(11) in arec.at_end
    assert arec.at_end == srec.at_end
    for step in aman.checkpoints():
        a, s = aman.load(step), sman.load(step)
        for key in a["model"]:
            assert torch.equal(a["model"][key], s["model"][key])
        assert _timeless([ManifestRow(**r) for r in a["retention"]["manifest"]]) == _timeless(
            [ManifestRow(**r) for r in s["retention"]["manifest"]]
        )


class CopyAt(Callback):
    """Keeps a copy of the weights at `step`, just before the loop saves them."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.weights: dict[str, torch.Tensor] = {}

    def on_step_end(self, state: LoopState, step_idx: int, batch: Any, metrics: Any) -> None:
        if step_idx == self.step:
            self.weights = {k: v.clone() for k, v in state.model.state_dict().items()}


def test_saved_weights_are_those_of_the_step_although_training_went_on(tmp_path: Path) -> None:
    copy = CopyAt(4)
    config = CheckpointConfig(every=4, async_save=True)
    out = _loop(config, 12, [copy]).fit(run_dir=tmp_path)
    saved = CheckpointManager(out.checkpoint_dir, config).load(4)["model"]
    assert copy.weights and saved.keys() == copy.weights.keys()
    for key, value in copy.weights.items():
        assert torch.equal(saved[key], value)
    assert not torch.equal(out.model.state_dict()["0.weight"], copy.weights["0.weight"])


def test_tensors_changed_right_after_save_async_do_not_reach_the_file(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    weight = torch.ones(512, 512)
    state = {"model": {"w": weight, "tied": weight}, "nested": [weight]}
    assert manager.save_async(1, state, {}) == []
    weight.zero_()  # the training thread goes on while the background thread writes
    rows = manager.wait()
    assert [(r.step, r.event) for r in rows] == [(1, "save")]
    loaded = torch.load(tmp_path / step_dirname(1) / STATE_FILE)
    assert torch.equal(loaded["model"]["w"], torch.ones(512, 512))
    assert loaded["model"]["tied"] is loaded["model"]["w"]  # shared tensors stay shared
    assert manager.wait() == []


class Block(Callback):
    """Occupies `tmp_step_N` with a regular file before the save at step N, and notes steps."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.seen: list[int] = []
        self.ended = False

    def on_step_end(self, state: LoopState, step_idx: int, batch: Any, metrics: Any) -> None:
        self.seen.append(step_idx)
        if step_idx == self.step:
            root = state.ctx.output_dir / state.ctx.run_key / "checkpoints"
            (root / f"tmp_{step_dirname(step_idx)}").write_text("in the way")

    def on_train_end(self, state: LoopState, artifacts: Any) -> None:
        self.ended = True


def _started_since(before: set[threading.Thread]) -> list[threading.Thread]:
    """The threads alive now that were not before (other test files in this worker process
    may have left threads of their own: only the fit's count here)."""
    return [t for t in threading.enumerate() if t not in before]


def test_a_failed_background_write_raises_at_the_next_save(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    block = Block(4)
    loop = _loop(CheckpointConfig(every=2, async_save=True), 10, [block])
    with pytest.raises(CheckpointError, match="cannot save step 4"):
        loop.fit(run_dir=tmp_path / "run")
    assert block.seen[-1] == 6  # surfaced at the save of step 6, not later
    assert not block.ended
    manager = CheckpointManager(tmp_path / "run" / "checkpoints")
    assert manager.checkpoints() == [2]
    assert _started_since(before) == []


def test_a_failed_final_background_write_raises_at_run_end(tmp_path: Path) -> None:
    block = Block(10)
    loop = _loop(CheckpointConfig(every=5, async_save=True), 10, [block])
    with pytest.raises(CheckpointError, match="cannot save step 10"):
        loop.fit(run_dir=tmp_path / "run")
    assert block.seen[-1] == 10
    assert not block.ended  # on_train_end never reports a checkpoint that is not there
    assert CheckpointManager(tmp_path / "run" / "checkpoints").checkpoints() == [5]


class Boom(Callback):
    def on_step_end(self, state: LoopState, step_idx: int, batch: Any, metrics: Any) -> None:
        if step_idx == 3:
            raise RuntimeError("boom")


def test_a_failing_fit_finishes_the_save_in_flight(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    loop = _loop(CheckpointConfig(every=2, async_save=True), 10, [Boom()])
    with pytest.raises(Exception, match="boom"):
        loop.fit(run_dir=tmp_path / "run")
    assert _started_since(before) == []
    manager = CheckpointManager(tmp_path / "run" / "checkpoints")
    assert manager.checkpoints() == [2]
    assert (tmp_path / "run" / "checkpoints" / step_dirname(2) / COMPLETE_MARKER).is_file()
