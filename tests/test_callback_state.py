"""Callback state in checkpoints: keyed by callback, not by position, and said when unmatched.

A resume must give each stateful callback its own saved state however many other callbacks
are attached, and in whatever order; one that finds none, or a saved state nobody takes,
is one WARNING line.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from lab import Callback, CheckpointConfig, LoopState, TrainingBatch, TrainingLoop
from lab.callbacks.monitors import EarlyStopping, StabilityMonitor
from lab.errors import ConfigError
from lab.loop import CheckpointManager

STOP = "early stopping: score has not improved for 3 checks (best 3.0 at step 3)"


class Score(Callback):
    """Adds `score` to each step's metrics: better up to step 3 (3.0), then worse and worse.

    EarlyStopping(patience=3) run straight through stops after step 6; one that forgot the
    checks before a resume at step 4 would take 3.6 (step 5) as its best and stop at step 8.
    """

    priority = 10  # before EarlyStopping (priority 0) reads the step's metrics

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        metrics["score"] = 6.0 - step_idx if step_idx <= 3 else 3.5 + 0.1 * (step_idx - 4)


class Crash(RuntimeError):
    """The interruption: raised before a step, after the checkpoint of the step before."""


class CrashAt(Callback):
    critical = True  # its exception propagates as it is and fails the fit

    def __init__(self, step: int) -> None:
        self.step = step

    def pre_step(self, state: LoopState, step_idx: int, batch: TrainingBatch) -> None:
        if step_idx == self.step:
            raise Crash(f"interrupted before step {step_idx}")


class Tally(Callback):
    """A stateful callback that counts steps; `state_key` may be set per instance."""

    def __init__(self, state_key: str | None = None) -> None:
        self.seen = 0
        if state_key is not None:
            self.state_key = state_key

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        self.seen += 1

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _loop(callbacks: list[Callback], steps: int = 12) -> TrainingLoop:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    return TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, _mse, steps,
                        checkpoint=CheckpointConfig(every=2), callbacks=callbacks)  # fmt: skip


def _state(early: EarlyStopping) -> tuple[float | None, int | None, int]:
    return early.best, early.best_step, early.bad_checks


def _interrupted_at_5(folder: Path, callbacks: list[Callback]) -> None:
    """Fit until the crash before step 5: the newest checkpoint is step 4's."""
    with pytest.raises(Crash):
        _loop([*callbacks, CrashAt(5)]).fit(run_dir=folder)
    assert (folder / "checkpoints" / "latest").read_text() == "step_000004"


def _saved_callbacks(folder: Path, step: int) -> dict[str, Any]:
    return CheckpointManager(folder / "checkpoints").load(step)["callbacks"]


def test_a_resume_with_one_more_stateful_callback_stops_where_a_straight_run_does(
    tmp_path: Path,
) -> None:
    straight = EarlyStopping("score", patience=3)
    done = _loop([Score(), straight]).fit(run_dir=tmp_path / "straight")
    assert (done.step, done.stopped, done.stop_reason) == (6, True, STOP)

    _interrupted_at_5(tmp_path / "resumed", [Score(), EarlyStopping("score", patience=3)])
    # StabilityMonitor, attached last, is now among the stateful callbacks
    early = EarlyStopping("score", patience=3)
    monitor = StabilityMonitor(window=4, min_history=2)
    resumed = _loop([Score(), early, monitor]).fit(run_dir=tmp_path / "resumed")
    assert (resumed.step, resumed.stopped, resumed.stop_reason) == (6, True, STOP)
    assert _state(early) == _state(straight) == (3.0, 3, 3)
    assert set(_saved_callbacks(tmp_path / "resumed", 6)) == {"EarlyStopping", "StabilityMonitor"}


def test_states_are_keyed_by_class_and_occurrence_or_state_key(tmp_path: Path) -> None:
    _loop([Tally(), Tally(), Tally("extra")], steps=4).fit(run_dir=tmp_path)
    assert _saved_callbacks(tmp_path, 4) == {
        "Tally": {"seen": 4},
        "Tally#2": {"seen": 4},
        "extra": {"seen": 4},
    }
    # another order and one more callback: each state still goes to its own callback
    first, second, extra = Tally(), Tally(), Tally("extra")
    first.seen = second.seen = extra.seen = -100  # overwritten by the restore
    _loop([extra, StabilityMonitor(), first, second], steps=6).fit(run_dir=tmp_path)
    assert (first.seen, second.seen, extra.seen) == (6, 6, 6)


CLASH = (
    "two stateful callbacks save their state under {!r} (Tally and Tally); "
    "give one of them another state_key"
)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (["same", "same"], CLASH.format("same")),
        (["Tally", None], CLASH.format("Tally")),  # a state_key may not take a default's key
        (["0:Tally"], "Tally.state_key='0:Tally': use a non-empty string without ':'"),
        ([""], "Tally.state_key='': use a non-empty string without ':'"),
    ],
)
def test_a_clashing_or_bad_state_key_is_one_clear_line(
    tmp_path: Path, keys: list[str | None], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _loop([Tally(key) for key in keys], steps=2).fit(run_dir=tmp_path)
    assert str(info.value) == message


def test_checkpoints_with_the_old_index_keys_still_resume(tmp_path: Path) -> None:
    folder = tmp_path / "old"
    _interrupted_at_5(folder, [Score(), StabilityMonitor(), EarlyStopping("score", patience=3)])
    # rewrite step 4's states under the keys of the old format, "{index}:{Class}", where the
    # index counted the stateful callbacks in dispatch order
    state_file = folder / "checkpoints" / "step_000004" / "state.pt"
    payload = torch.load(state_file, weights_only=True)
    states = payload["callbacks"]
    assert set(states) == {"StabilityMonitor", "EarlyStopping"}
    payload["callbacks"] = {
        "0:StabilityMonitor": states["StabilityMonitor"],
        "1:EarlyStopping": states["EarlyStopping"],
    }
    torch.save(payload, state_file)

    # resumed without the monitor: in the old scheme EarlyStopping would now look for index 0
    early = EarlyStopping("score", patience=3)
    resumed = _loop([Score(), early]).fit(run_dir=folder)
    assert (resumed.step, resumed.stop_reason) == (6, STOP)
    assert _state(early) == (3.0, 3, 3)


def test_old_index_keys_of_one_class_go_to_its_callbacks_in_order(tmp_path: Path) -> None:
    _loop([Tally(), Tally()], steps=2).fit(run_dir=tmp_path)
    state_file = tmp_path / "checkpoints" / "step_000002" / "state.pt"
    payload = torch.load(state_file, weights_only=True)
    payload["callbacks"] = {"1:Tally": {"seen": 20}, "0:Tally": {"seen": 10}}
    torch.save(payload, state_file)
    first, second = Tally("first"), Tally()  # a state_key set since: the class still matches
    _loop([first, second], steps=3).fit(run_dir=tmp_path)
    assert (first.seen, second.seen) == (11, 21)
    assert _saved_callbacks(tmp_path, 3) == {"first": {"seen": 11}, "Tally": {"seen": 21}}


def test_unmatched_states_are_one_warning_on_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _loop([Tally(), Tally("gone")], steps=4).fit(run_dir=tmp_path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lab.loop"):
        _loop(
            [Tally(), StabilityMonitor(), Tally(), EarlyStopping("loss", patience=99)], steps=6
        ).fit(run_dir=tmp_path)
    path = tmp_path / "checkpoints" / "step_000004"
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "lab.loop",
            "WARNING",
            f"resuming from {path}: no saved state for StabilityMonitor, Tally#2, "
            "EarlyStopping (they start fresh); no attached callback takes the saved state of "
            "gone (it is ignored)",
        )
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lab.loop"):  # all matched: nothing to say
        _loop(
            [Tally(), StabilityMonitor(), Tally(), EarlyStopping("loss", patience=99)], steps=8
        ).fit(run_dir=tmp_path)
    assert caplog.records == []


def test_a_continual_stage_start_is_no_resume_and_warns_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from lab import Arm, Experiment, RunSpec

    tallies: list[Tally] = []

    def train(run: RunSpec) -> Any:
        tally = Tally()
        tallies.append(tally)
        loop = _loop([tally], steps=4)
        return loop.fit(run)

    with caplog.at_level(logging.WARNING, logger="lab.loop"):
        result = Experiment("chain", train, arms=[Arm("cl", stages=[{}, {}], carry="full")],
                            store=False, output_dir=tmp_path).run()  # fmt: skip
    assert [r.status for r in result.runs] == ["completed", "completed"]
    assert [t.seen for t in tallies] == [4, 4]  # stage 2 did not take stage 1's count
    assert caplog.records == []
