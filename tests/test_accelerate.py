"""`lab.integrations.accelerate`: an `Accelerator(log_with=LabTracker(...))` loop on CPU,
recorded into a real SQLite store as a `RunHandle` loop records the same training;
standalone, failed, and inside an `Experiment`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator

import lab
from lab.errors import ConfigError
from lab.integrations.accelerate import CONFIG_FILE, LabTracker
from tests.recorder import EVERY_HOOK, Labels
from tests.store_rows import rows


class Every(Labels, hooks=EVERY_HOOK):
    """Every hook, as `Labels` notes it."""


def _fit(tracker: LabTracker, steps: int = 4, fail_at: int = 0) -> list[float]:
    """A linear model trained by accelerate on CPU for `steps` steps, logged every step."""
    accelerator = Accelerator(cpu=True, log_with=tracker)
    accelerator.init_trackers("tiny", config={"lr": 0.1, "steps": steps})
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    losses = []
    for step in range(1, steps + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        accelerator.log({"loss": loss.item(), "note": "text is not a metric"}, step=step)
        if step == fail_at:
            raise RuntimeError("the loop broke")
    accelerator.end_training()
    return losses


def test_the_rows_are_those_a_run_handle_loop_records(tmp_path: Path) -> None:
    every = Every()
    db, by_hand = tmp_path / "lab.db", tmp_path / "by_hand.db"
    tracker = LabTracker(experiment="acc", store=f"sqlite:///{db}", quiet=True,
                         output_dir=tmp_path / "runs", callbacks=[every])  # fmt: skip
    losses = _fit(tracker)
    with lab.start_run("acc", config={"lr": 0.1, "steps": 4}, store=f"sqlite:///{by_hand}",
                       quiet=True, output_dir=tmp_path / "by_hand") as run:  # fmt: skip
        model = torch.nn.Linear(1, 1)
        with lab.RunHandle(run, model, torch.optim.SGD(model.parameters()), num_steps=4) as loop:
            for step in loop.steps():
                loop.end_step({"loss": losses[step - 1]})
    sql = "SELECT step, key, value FROM metrics ORDER BY step, key"
    assert rows(db, sql) == rows(by_hand, sql)
    assert len(rows(db, sql)) == 4
    assert rows(db, "SELECT status, config FROM runs") == rows(
        by_hand, "SELECT status, config FROM runs"
    )
    assert every.calls == [
        "on_experiment_start", "on_group_start", "on_run_start:main-r0", "on_train_start",
        "on_step_end:1", "on_step_end:2", "on_step_end:3", "on_step_end:4", "on_train_end",
        "on_run_end:main-r0:completed", "on_experiment_end:completed", "close",
    ]  # fmt: skip
    assert tracker.tracker is tracker.recording


def test_a_loop_that_raises_fails_the_run_through_finish(tmp_path: Path) -> None:
    db = tmp_path / "lab.db"
    tracker = LabTracker(experiment="acc", store=f"sqlite:///{db}", quiet=True,
                         output_dir=tmp_path / "runs")  # fmt: skip
    try:
        _fit(tracker, fail_at=2)
    except RuntimeError as exc:
        tracker.finish(exc)
    ((status, error, trace),) = rows(db, "SELECT status, error, traceback FROM runs")
    assert (status, error) == ("failed", "RuntimeError: the loop broke")
    assert 'raise RuntimeError("the loop broke")' in trace
    assert rows(db, "SELECT step FROM metrics") == [(1,), (2,)]


def test_inside_an_experiment_it_records_into_the_run_it_was_given(tmp_path: Path) -> None:
    def train(run: lab.RunSpec) -> dict[str, Any]:
        _fit(LabTracker(run), steps=2 + run.repeat)
        return {}

    db = tmp_path / "lab.db"
    result = lab.Experiment("acc", train, repeats=2, store=f"sqlite:///{db}",
                            output_dir=tmp_path / "runs").run()  # fmt: skip
    assert [(r.run_key, r.status) for r in result.runs] == [
        ("base-r0", "completed"), ("base-r1", "completed"),
    ]  # fmt: skip
    assert rows(db, "SELECT run_id, max(step) FROM metrics GROUP BY run_id") == [(1, 2), (2, 3)]
    written = json.loads((tmp_path / "runs" / "acc" / "base-r1" / CONFIG_FILE).read_text())
    assert written == {"lr": 0.1, "steps": 3}


def test_bad_input_is_one_clear_line() -> None:
    with pytest.raises(ConfigError) as info:
        LabTracker(run="r")  # type: ignore[arg-type]
    assert str(info.value) == "run='r': pass the RunSpec that train(run) was given"


def test_a_loop_resumed_from_its_saved_state_continues_the_run(tmp_path: Path) -> None:
    every = Every()
    db = tmp_path / "lab.db"
    saved = tmp_path / "checkpoint-2"

    def train(run: lab.RunSpec) -> Any:
        tracker = LabTracker(run)
        if saved.exists():  # accelerator.load_state(saved) restored step 2
            tracker.resumed(2, saved)
        accelerator = Accelerator(cpu=True, log_with=tracker)
        accelerator.init_trackers("tiny", config={"lr": 0.1})
        if saved.exists():
            accelerator.log({"loss": 0.3})  # no step given: the one after the restored step
            accelerator.end_training()
            return run.artifacts
        for step in (1, 2, 3):
            accelerator.log({"loss": 1.0 / step}, step=step)
            if step == 2:
                saved.mkdir()  # accelerator.save_state(saved)
                tracker.checkpoint(saved, metrics={"loss": 0.5})
        raise RuntimeError("the loop broke after step 3")

    experiment = {"store": f"sqlite:///{db}", "output_dir": tmp_path / "runs",
                  "callbacks": [every]}  # fmt: skip
    first = lab.Experiment("acc", train, **experiment).run()
    assert [r.status for r in first.runs] == ["failed"]
    every.calls.clear()
    again = lab.Experiment("acc", train, **experiment).run()
    assert [r.status for r in again.runs] == ["completed"]
    assert rows(db, "SELECT step, value FROM metrics ORDER BY step") == [(1, 1.0), (2, 0.5),
                                                                         (3, 0.3)]  # fmt: skip
    assert rows(db, "SELECT step, path, event, metrics FROM checkpoints") == [
        (2, str(saved), "save", '{"loss": 0.5}'),
    ]
    assert every.calls[:6] == [
        "on_experiment_start", "on_group_start", "on_run_start:base-r0",
        "post_checkpoint_loaded", "on_train_start", "on_step_end:3",
    ]  # fmt: skip


def test_resumed_after_the_run_started_is_one_clear_line(tmp_path: Path) -> None:
    tracker = LabTracker(experiment="acc", store=f"sqlite:///{tmp_path / 'lab.db'}",
                         output_dir=tmp_path / "runs", quiet=True)  # fmt: skip
    Accelerator(cpu=True, log_with=tracker).init_trackers("tiny", config={})
    with pytest.raises(ConfigError) as info:
        tracker.resumed(2, tmp_path / "checkpoint-2")
    assert str(info.value) == (
        "tracker.resumed(...) came after accelerator.init_trackers(...): call it first"
    )
    tracker.finish()
