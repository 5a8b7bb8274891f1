"""`FrameworkRun` and `FrameworkHandle`: a run whose loop another framework drives, recorded
through the same hooks and rows as a `RunHandle` loop (real SQLite store, real hooks)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
import torch

import lab
from lab.errors import ConfigError
from lab.integrations import FrameworkRun
from tests.recorder import EVERY_HOOK, Labels, Recorder


class Every(Labels, hooks=EVERY_HOOK):
    """Every hook, as `Labels` notes it."""


class Loaded(Recorder, hooks=("post_checkpoint_loaded",)):
    def note(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        return (args[0].step, args[1])


def _rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    con = sqlite3.connect(db)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_a_standalone_run_records_steps_evals_and_checkpoints_by_reference(
    tmp_path: Path,
) -> None:
    db = tmp_path / "lab.db"
    rec = Every()
    run = FrameworkRun(experiment="fw", store=f"sqlite:///{db}", callbacks=[rec], quiet=True,
                       output_dir=tmp_path / "runs")  # fmt: skip
    run.open({"lr": 0.1})
    run.start(torch.nn.Linear(2, 1))
    run.log({"loss": 1.0}, 10)
    run.log({"acc": 0.5}, 10)  # the same step: one on_step_end
    run.log({"loss": 0.5}, 20)
    run.log({"late": 3.0}, 15)  # older than the pending step 20: joins it
    predictions = [{"example_id": "a", "output": 1, "target": 1, "score": 0.9}]
    run.evaluate("val", {"loss": 0.7}, step=20, predictions=predictions)
    ckpt = tmp_path / "elsewhere" / "epoch=0.ckpt"
    run.checkpoint(ckpt, metrics={"val/loss": 0.7})
    run.checkpoint(ckpt, removed="top-k: a better one replaced it")
    run.evaluate("val", {"loss": 0.6}, step=25)  # no step reported at 25: the step moves up
    run.log({"loss": 0.2}, 30)
    run.finish()
    run.finish()  # once
    assert _rows(db, "SELECT key, step, value FROM metrics ORDER BY step, key") == [
        ("acc", 10, 0.5), ("loss", 10, 1.0), ("late", 20, 3.0), ("loss", 20, 0.5),
        ("val/loss", 20, 0.7), ("val/loss", 25, 0.6), ("loss", 30, 0.2),
    ]  # fmt: skip
    assert _rows(db, "SELECT name, step FROM evals ORDER BY step") == [("val", 20), ("val", 25)]
    assert _rows(db, "SELECT example_id, score FROM predictions") == [("a", 0.9)]
    assert _rows(db, "SELECT step, path, event, metrics, reason FROM checkpoints") == [
        (20, str(ckpt), "save", '{"val/loss": 0.7}', None),
        (20, str(ckpt), "remove", "{}", "top-k: a better one replaced it"),
    ]
    assert _rows(db, "SELECT run_key, status, config FROM runs") == [
        ("main-r0", "completed", '{"lr": 0.1}')
    ]
    assert rec.calls == [
        "on_experiment_start", "on_group_start", "on_run_start:main-r0", "on_train_start",
        "on_step_end:10", "on_step_end:20", "on_eval", "on_benchmark_eval",
        "on_checkpoint", "on_checkpoint", "on_step_end:25", "on_eval",
        "on_step_end:30", "on_train_end", "on_run_end:main-r0:completed",
        "on_experiment_end:completed", "close",
    ]  # fmt: skip
    assert not ckpt.exists()  # by reference: nothing was written there


def test_a_standalone_run_that_fails_is_failed_with_its_traceback(tmp_path: Path) -> None:
    db = tmp_path / "lab.db"
    run = FrameworkRun(experiment="fw", store=f"sqlite:///{db}", quiet=True,
                       output_dir=tmp_path / "runs")  # fmt: skip
    run.start()
    run.log({"loss": 1.0}, 1)
    try:
        raise RuntimeError("the fit broke")
    except RuntimeError as exc:
        run.finish(exc)  # the caller's error is not raised again here
    ((status, error),) = _rows(db, "SELECT status, error FROM runs")
    assert status == "failed"
    assert error.startswith("RuntimeError: the fit broke")
    assert _rows(db, "SELECT key, step FROM metrics") == [("loss", 1)]


def test_a_framework_resumed_at_its_step_keeps_the_rows_up_to_it(tmp_path: Path) -> None:
    db = tmp_path / "lab.db"
    common = {"experiment": "fw", "store": f"sqlite:///{db}", "quiet": True,
              "output_dir": tmp_path / "runs"}  # fmt: skip
    first = FrameworkRun(**common)  # type: ignore[arg-type]
    first.start()
    for step in (1, 2, 3, 4):
        first.log({"loss": float(step)}, step)
    first.finish(KeyboardInterrupt())
    rec = Loaded()
    again = FrameworkRun(**common, callbacks=[rec])  # type: ignore[arg-type]
    again.start(restored=(2, tmp_path / "ckpt-2"))
    again.log({"loss": 30.0}, 3)
    again.finish()
    assert _rows(db, "SELECT step, value FROM metrics ORDER BY step") == [
        (1, 1.0), (2, 2.0), (3, 30.0)
    ]  # fmt: skip
    assert _rows(db, "SELECT status FROM runs") == [("completed",)]
    assert rec.calls == [(2, tmp_path / "ckpt-2")]


def test_inside_an_experiment_it_records_into_the_run_it_was_given(tmp_path: Path) -> None:
    def train(spec: lab.RunSpec) -> dict[str, float]:
        run = FrameworkRun(spec)
        run.start(torch.nn.Linear(2, 1))
        for step in (5, 10, 15):
            run.log({"loss": spec.seed + 1.0 / step}, step)
        run.finish()
        assert run.handle is not None
        return run.handle.reported()

    db = tmp_path / "lab.db"
    result = lab.Experiment("fw", train, repeats=2, seed=3, store=f"sqlite:///{db}",
                            output_dir=tmp_path / "runs").run()  # fmt: skip
    assert [(r.run_key, r.status, r.metrics) for r in result.runs] == [
        ("base-r0", "completed", {"loss": 3 + 1 / 15}),
        ("base-r1", "completed", {"loss": 4 + 1 / 15}),
    ]
    assert _rows(db, "SELECT count(*), min(step), max(step) FROM metrics") == [(6, 5, 15)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "give the run (inside an Experiment's train(run)) or experiment='name' (a run of "
             "its own)"),
        ({"run": "r"}, "run='r': pass the RunSpec that train(run) was given"),
    ],
)  # fmt: skip
def test_bad_arguments_are_one_clear_line(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        FrameworkRun(**kwargs)
    assert str(info.value) == message


def test_a_value_for_a_recorded_step_joins_the_next_without_moving_later_ones(
    tmp_path: Path,
) -> None:
    db = tmp_path / "lab.db"
    run = FrameworkRun(experiment="fw", store=f"sqlite:///{db}", quiet=True,
                       output_dir=tmp_path / "runs")  # fmt: skip
    run.log({"loss": 1.0}, 1)
    run.evaluate("val", {"loss": 0.9}, step=1)  # step 1 is recorded
    run.log({"epoch_mean": 1.5}, 1)  # reported late: joins step 2
    run.log({"loss": 2.0}, 2)
    run.log({"loss": 3.0}, 3)
    run.finish()
    assert _rows(db, "SELECT step, key FROM metrics ORDER BY step, key") == [
        (1, "loss"), (1, "val/loss"), (2, "epoch_mean"), (2, "loss"), (3, "loss"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("module", "package", "extra"),
    [
        ("lab.integrations.lightning", "lightning", "lightning"),
        ("lab.integrations.transformers", "transformers", "transformers"),
        ("lab.integrations.accelerate", "accelerate", "accelerate"),
    ],
)
def test_an_integration_without_its_framework_is_one_line_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, module: str, package: str, extra: str
) -> None:
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, package, None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ConfigError) as info:
        importlib.import_module(module)
    assert str(info.value).startswith(f"{module} needs the {package} package: ")
    assert str(info.value).endswith(f"[{extra}]'")
