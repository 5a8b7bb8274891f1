"""Callbacks built per run: `Experiment(callbacks=[factory])` calls the factory with each
run's `RunSpec`, and the callbacks it returns get that run's hooks alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

import lab
from lab import Arm, Callback, Experiment, TrainingLoop
from lab.errors import ConfigError


class Config(pydantic.BaseModel):
    log_every: int = 1


class Traced(Callback):
    """Records every hook it gets, with the run's key and its own setting."""

    def __init__(self, every: int, trace: list[tuple[Any, ...]]) -> None:
        self.every, self.trace = every, trace

    def on_experiment_start(self, ctx: Any) -> None:
        self.trace.append(("on_experiment_start", self.every))

    def on_group_start(self, ctx: Any, group_name: str) -> None:
        self.trace.append(("on_group_start", self.every))

    def on_run_start(self, ctx: Any) -> None:
        self.trace.append(("on_run_start", ctx.run_key, self.every))

    def on_train_start(self, state: Any) -> None:
        self.trace.append(("on_train_start", state.ctx.run_key))

    def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: Any) -> None:
        if step_idx % self.every == 0:
            self.trace.append(("on_step_end", state.ctx.run_key, step_idx))

    def on_train_end(self, state: Any, artifacts: Any) -> None:
        self.trace.append(("on_train_end", state.ctx.run_key))

    def on_run_end(self, ctx: Any, run_result: Any, arm: Any) -> None:
        self.trace.append(("on_run_end", run_result.run_key, run_result.status))

    def on_experiment_end(self, ctx: Any, result: Any) -> None:
        self.trace.append(("on_experiment_end", self.every))

    def close(self) -> None:
        self.trace.append(("close", self.every))


def _train(run: lab.RunSpec) -> lab.LoopArtifacts:
    model = torch.nn.Linear(2, 1)
    data = [torch.ones(4, 2)] * 4
    loop = TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        lambda m, b: m(b).pow(2).mean(),
        num_steps=4,
    )
    return loop.fit(run)


def test_a_factory_builds_each_runs_callbacks_from_its_config(tmp_path: Path) -> None:
    trace: list[tuple[Any, ...]] = []
    built: list[tuple[str, int]] = []

    def factory(run: lab.RunSpec) -> Traced:
        built.append((run.run_key, run.config.log_every))
        return Traced(run.config.log_every, trace)

    exp = Experiment(
        "per-run",
        _train,
        base_config=Config(),
        arms=[Arm("every1", log_every=1), Arm("every2", log_every=2)],
        callbacks=[factory],
        store=False,
        output_dir=tmp_path,
    )
    result = exp.run()
    assert [r.status for r in result.runs] == ["completed", "completed"]
    assert built == [("every1-r0", 1), ("every2-r0", 2)]
    # Run hooks only: no experiment or group hooks reach a callback built for one run.
    assert trace == [
        ("on_run_start", "every1-r0", 1),
        ("on_train_start", "every1-r0"),
        *[("on_step_end", "every1-r0", s) for s in (1, 2, 3, 4)],
        ("on_train_end", "every1-r0"),
        ("on_run_end", "every1-r0", "completed"),
        ("close", 1),
        ("on_run_start", "every2-r0", 2),
        ("on_train_start", "every2-r0"),
        *[("on_step_end", "every2-r0", s) for s in (2, 4)],
        ("on_train_end", "every2-r0"),
        ("on_run_end", "every2-r0", "completed"),
        ("close", 2),
    ]


def test_shared_callbacks_and_factories_mix_and_a_factory_may_return_a_list(
    tmp_path: Path,
) -> None:
    shared: list[tuple[Any, ...]] = []
    own: list[tuple[Any, ...]] = []
    exp = Experiment(
        "mixed",
        lambda run: {"loss": 1.0},
        repeats=2,
        callbacks=[Traced(0, shared), lambda run: [Traced(run.seed, own), Traced(-1, own)]],
        store=False,
        output_dir=tmp_path,
    )
    exp.run()
    assert [t[0] for t in shared] == [
        "on_experiment_start",
        "on_group_start",
        "on_run_start",
        "on_run_end",
        "on_run_start",
        "on_run_end",
        "on_experiment_end",
        "close",
    ]
    assert own == [
        ("on_run_start", "base-r0", 0),
        ("on_run_start", "base-r0", -1),
        ("on_run_end", "base-r0", "completed"),
        ("on_run_end", "base-r0", "completed"),
        ("close", 0),
        ("close", -1),
        ("on_run_start", "base-r1", 1),
        ("on_run_start", "base-r1", -1),
        ("on_run_end", "base-r1", "completed"),
        ("on_run_end", "base-r1", "completed"),
        ("close", 1),
        ("close", -1),
    ]


def _not_a_callback(run: lab.RunSpec) -> Any:
    return "console"


def test_a_factory_that_returns_no_callback_fails_its_run_with_one_line(tmp_path: Path) -> None:
    exp = Experiment(
        "bad-factory",
        lambda run: {"loss": 1.0},
        repeats=2,
        callbacks=[_not_a_callback],
        store=False,
        output_dir=tmp_path,
    )
    result = exp.run()
    assert [r.status for r in result.runs] == ["failed", "failed"]
    assert result.runs[0].error == (
        "ConfigError: callback factory _not_a_callback returned 'console' for run base-r0; "
        "a factory returns a lab.Callback or a list of them"
    )


def test_a_callback_class_is_refused_with_the_two_ways_to_pass_it() -> None:
    with pytest.raises(ConfigError) as info:
        Experiment("cls", lambda run: None, callbacks=[lab.ConsoleLogger])
    assert str(info.value) == (
        "callbacks: ConsoleLogger is a class; pass an instance, ConsoleLogger(), or a factory "
        "that builds one per run, lambda run: ConsoleLogger(...)"
    )


def test_a_lambda_factory_cannot_go_to_a_worker_process() -> None:
    exp = Experiment(
        "procs",
        _train,
        callbacks=[lambda run: Traced(1, [])],
        store=False,
        executor="processes",
    )
    with pytest.raises(ConfigError, match=r"cannot send callback factory '.*<lambda>'"):
        exp.run()


class Written(Callback):
    """Writes the hooks it gets into its run's folder (it may live in a worker process)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_run_start(self, ctx: Any) -> None:
        (self.folder / "hooks.txt").write_text(f"on_run_start {ctx.run_key}\n")

    def on_run_end(self, ctx: Any, run_result: Any, arm: Any) -> None:
        with (self.folder / "hooks.txt").open("a") as f:
            f.write(f"on_run_end {run_result.status}\n")


def written(run: lab.RunSpec) -> Written:
    return Written(run.dir)


def _losses(run: lab.RunSpec) -> dict[str, float]:
    return {"loss": 1.0}


def test_under_processes_a_factory_builds_the_callbacks_in_the_worker(tmp_path: Path) -> None:
    exp = Experiment(
        "procs-ok",
        _losses,
        repeats=2,
        callbacks=[written],
        store=False,
        executor="processes",
        workers=2,
        output_dir=tmp_path,
    )
    result = exp.run()
    assert [r.status for r in result.runs] == ["completed", "completed"]
    for key in ("base-r0", "base-r1"):
        text = (tmp_path / "procs-ok" / key / "hooks.txt").read_text()
        assert text == f"on_run_start {key}\non_run_end completed\n"
