"""Continual stages: each repeat of an arm with stages is a chain, stage k starts from k-1."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

from lab import Arm, Callback, CheckpointConfig, Experiment, LoopState, RunSpec, TrainingLoop
from lab.callbacks.monitors import EarlyStopping
from lab.errors import ConfigError


class Cfg(pydantic.BaseModel):
    task: str = "a"
    steps: int = 4
    fail_on: str = ""
    checkpoints: bool = True


class Starts(Callback):
    """What each run's model and optimizer looked like when training started."""

    def __init__(self) -> None:
        self.weights: dict[str, dict[str, torch.Tensor]] = {}
        self.momentum: dict[str, bool] = {}

    def on_train_start(self, state: LoopState) -> None:
        key = state.ctx.run_key
        self.weights[key] = {k: v.clone() for k, v in state.model.state_dict().items()}
        self.momentum[key] = bool(state.optimizer.state)


def train(run: RunSpec) -> Any:
    cfg = run.config
    if cfg.task == cfg.fail_on:
        raise RuntimeError(f"task {cfg.task} broke")
    shift = {"a": 0.0, "b": 1.0, "c": 2.0}[cfg.task]
    gen = torch.Generator().manual_seed(run.seed)
    x = torch.randn(16, 3, generator=gen)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def loss_fn(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(b), b.sum(1, keepdim=True) + shift)

    checkpoint = CheckpointConfig(every=2) if cfg.checkpoints else None
    loop = TrainingLoop(model, opt, [x], loss_fn, cfg.steps, checkpoint=checkpoint)
    artifacts = loop.fit(run)
    torch.save(model.state_dict(), run.dir / "final.pt")
    return artifacts


def _run(tmp_path: Path, arms: list[Arm], starts: Starts, repeats: int = 2) -> Any:
    return Experiment("chains", train, base_config=Cfg(), arms=arms, repeats=repeats,
                      callbacks=[starts], store=f"sqlite:///{tmp_path / 'lab.db'}",
                      output_dir=tmp_path / "runs").run()  # fmt: skip


def test_chains_are_groups_and_each_stage_starts_from_the_last(tmp_path: Path) -> None:
    starts = Starts()
    stages = [{"task": "a"}, {"task": "b"}, {"task": "c"}]
    result = _run(tmp_path, [Arm("cl", stages=stages), Arm("plain")], starts)
    assert [(r.run_key, r.stage, r.parent_run_key, r.status) for r in result.runs] == [
        ("cl-r0-s0", 0, None, "completed"),
        ("cl-r0-s1", 1, "cl-r0-s0", "completed"),
        ("cl-r0-s2", 2, "cl-r0-s1", "completed"),
        ("cl-r1-s0", 0, None, "completed"),
        ("cl-r1-s1", 1, "cl-r1-s0", "completed"),
        ("cl-r1-s2", 2, "cl-r1-s1", "completed"),
        ("plain-r0", 0, None, "completed"),
        ("plain-r1", 0, None, "completed"),
    ]
    runs = tmp_path / "runs" / "chains"
    for repeat in (0, 1):
        for stage in (1, 2):
            parent = torch.load(runs / f"cl-r{repeat}-s{stage - 1}" / "final.pt")
            started = starts.weights[f"cl-r{repeat}-s{stage}"]
            for name in parent:
                torch.testing.assert_close(started[name], parent[name], rtol=0, atol=0)
            assert starts.momentum[f"cl-r{repeat}-s{stage}"] is False  # weights only
    con = sqlite3.connect(tmp_path / "lab.db")
    groups = con.execute("SELECT name, kind FROM groups ORDER BY group_id").fetchall()
    assert groups == [("cl-r0", "chain"), ("cl-r1", "chain"), ("plain", "repeats")]
    rows = con.execute(
        "SELECT r.run_key, r.stage, p.run_key, g.name FROM runs r "
        "LEFT JOIN runs p ON p.run_id = r.parent_run_id JOIN groups g USING (group_id) "
        "WHERE r.run_key LIKE 'cl-r1%' ORDER BY r.run_key"
    ).fetchall()
    assert rows == [
        ("cl-r1-s0", 0, None, "cl-r1"),
        ("cl-r1-s1", 1, "cl-r1-s0", "cl-r1"),
        ("cl-r1-s2", 2, "cl-r1-s1", "cl-r1"),
    ]
    con.close()


def test_full_carry_brings_the_optimizer_state(tmp_path: Path) -> None:
    starts = Starts()
    _run(tmp_path, [Arm("cl", stages=[{"task": "a"}, {"task": "b"}], carry="full")], starts, 1)
    assert starts.momentum == {"cl-r0-s0": False, "cl-r0-s1": True}


def test_a_failed_stage_stops_its_chain_and_others_go_on(tmp_path: Path) -> None:
    starts = Starts()
    arms = [
        Arm("broken", stages=[{"task": "a"}, {"task": "b"}, {"task": "c"}], fail_on="b"),
        Arm("fine", stages=[{"task": "a"}, {"task": "b"}]),
    ]
    result = _run(tmp_path, arms, starts, 1)
    assert [(r.run_key, r.status) for r in result.runs] == [
        ("broken-r0-s0", "completed"),
        ("broken-r0-s1", "failed"),
        ("fine-r0-s0", "completed"),
        ("fine-r0-s1", "completed"),
    ]
    assert result.runs[1].error == "RuntimeError: task b broke"


def test_a_stage_without_a_final_checkpoint_fails_with_the_fix(tmp_path: Path) -> None:
    result = _run(tmp_path, [Arm("cl", stages=[{"task": "a"}, {"task": "b"}],
                                 checkpoints=False)], Starts(), 1)  # fmt: skip
    assert [r.status for r in result.runs] == ["completed", "failed"]
    assert "CheckpointConfig(save_at_end=True)" in result.runs[1].error


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stages": []}, "stages must be a non-empty list"),
        ({"stages": {"task": "a"}}, "stages must be a non-empty list"),
        ({"stages": [{"task": "a"}], "carry": "all"}, "carry='all'"),
    ],
)
def test_bad_stage_settings(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Arm("cl", **kwargs)


def test_a_bad_stage_override_fails_before_any_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'nope' is not a field of Cfg"):
        Experiment("x", train, base_config=Cfg(), arms=[Arm("cl", stages=[{"nope": 1}])],
                   store=False)  # fmt: skip


# -- callback state does not cross stages --------------------------------------------------


class Score(Callback):
    """Adds a `score` to each step's metrics: flat on task "a", better every step on "b"."""

    priority = 10  # before EarlyStopping (0) reads the step's metrics

    def __init__(self, task: str) -> None:
        self.task = task

    def on_step_end(self, state, step_idx, batch, metrics):  # type: ignore[no-untyped-def]
        metrics["score"] = 1.0 if self.task == "a" else 10.0 - step_idx


class EarlyStoppingAtStart(Callback):
    """What the run's EarlyStopping held when training started, before it could reset, and
    whether the optimizer had state."""

    priority = 1  # before EarlyStopping's own on_train_start

    def __init__(self, early: EarlyStopping, seen: dict[str, Any]) -> None:
        self.early, self.seen = early, seen

    def on_train_start(self, state: LoopState) -> None:
        es = self.early
        momentum = bool(state.optimizer.state)  # carry="full" still brings the optimizer
        self.seen[state.ctx.run_key] = (es.best, es.best_step, es.bad_checks, momentum)


def test_a_full_carry_stage_starts_its_callbacks_fresh(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    def train_scored(run: RunSpec) -> Any:
        torch.manual_seed(run.seed)
        model = torch.nn.Linear(3, 1)
        x = torch.randn(16, 3)
        early = EarlyStopping("score", patience=2)
        loop = TrainingLoop(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            [x],
            lambda m, b: torch.nn.functional.mse_loss(m(b), b.sum(1, keepdim=True)),
            run.config.steps,
            checkpoint=CheckpointConfig(every=2),
            callbacks=[Score(run.config.task), early, EarlyStoppingAtStart(early, seen)],
        )
        return loop.fit(run)

    stages = [{"task": "a"}, {"task": "b"}]
    result = Experiment("chains", train_scored, base_config=Cfg(steps=6),
                        arms=[Arm("cl", stages=stages, carry="full")],
                        store=f"sqlite:///{tmp_path / 'lab.db'}",
                        output_dir=tmp_path / "runs").run()  # fmt: skip
    first, second = result.runs
    assert (first.run_key, first.status, first.artifacts.step) == ("cl-r0-s0", "stopped", 3)
    assert first.artifacts.stop_reason == (
        "early stopping: score has not improved for 2 checks (best 1.0 at step 1)"
    )
    # stage 1's best (1.0) and count (2) would stop stage 2 at its first step
    assert (second.run_key, second.status, second.artifacts.step) == ("cl-r0-s1", "completed", 6)
    assert second.artifacts.stop_reason is None
    assert seen == {
        "cl-r0-s0": (None, None, 0, False),
        "cl-r0-s1": (None, None, 0, True),
    }
