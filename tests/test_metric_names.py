"""Metric names that something needs are checked against what the sources declare: a name
nothing could log is an error before the first step, one only a run can settle is a single
WARNING at the first step or eval that lacks it, with the close matches."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from lab import Callback, CheckpointConfig, Evaluator, TrainingLoop
from lab.callbacks.monitors import EarlyStopping, SpeedMonitor, StabilityMonitor
from lab.errors import ConfigError
from lab.loop.metric_names import close_matches


class Steps(Callback):
    """Counts the steps that ran."""

    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: Any) -> None:
        self.steps += 1


def _loop(callbacks: list[Callback], evaluators: list[Evaluator] = (), **kw: Any) -> TrainingLoop:  # type: ignore[assignment]
    model = torch.nn.Linear(2, 1)
    return TrainingLoop(
        model, torch.optim.SGD(model.parameters(), lr=0.1), [torch.ones(4, 2)],
        lambda m, b: m(b).pow(2).mean(), 6, evaluators=evaluators, callbacks=callbacks, **kw,
    )  # fmt: skip


def _val(metrics: list[str] | None = None) -> Evaluator:
    return Evaluator("val", lambda m: {"loss": 1.0, "acc": 0.5}, every=2, metrics=metrics)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_an_undeclared_eval_metric_warns_once_at_its_first_eval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="lab.loop")
    _loop([EarlyStopping("val/los")], [_val()]).fit()  # evals at steps 2, 4, 6
    assert _warnings(caplog) == [
        "EarlyStopping('val/los'): eval 'val' at step 2 logged no 'los' (it logged: acc, loss); "
        "did you mean 'val/loss'?"
    ]


def test_an_undeclared_step_metric_warns_once_at_the_first_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="lab.loop")
    _loop([EarlyStopping("los", eval_name=None)]).fit()
    assert _warnings(caplog) == [
        "EarlyStopping('los'): step 1 logged no metric 'los' (it logged: grad_norm, loss, lr, "
        "step_time); did you mean 'loss'?"
    ]


def test_a_name_of_a_declared_evaluator_is_an_error_before_the_first_step() -> None:
    steps = Steps()
    with pytest.raises(ConfigError) as info:
        _loop([EarlyStopping("val/los"), steps], [_val(["loss", "acc"])]).fit()
    assert str(info.value) == (
        "EarlyStopping('val/los'): no evaluator, loss function or callback logs metric "
        "'val/los'; did you mean 'val/loss'? (declared: grad_norm, loss, lr, step_time, "
        "val/acc, val/loss)"
    )
    assert steps.steps == 0


def test_the_checkpoint_metric_is_checked_too(tmp_path: Path) -> None:
    config = CheckpointConfig(every=2, keep_top_k=1, metric="val/acc_", mode="max")
    with pytest.raises(ConfigError) as info:
        _loop([], [_val(["loss", "acc"])], checkpoint=config).fit(run_dir=tmp_path / "r")
    assert str(info.value).startswith(
        "CheckpointConfig(metric='val/acc_'): no evaluator, loss function or callback logs "
        "metric 'val/acc_'; did you mean 'val/acc'?"
    )
    assert not (tmp_path / "r" / "checkpoints").exists() or not any(
        (tmp_path / "r" / "checkpoints").glob("step_*")
    )


def test_declared_loss_metrics_close_the_step_names() -> None:
    with pytest.raises(ConfigError) as info:
        _loop([EarlyStopping("accuracy")], loss_metrics=["acc"]).fit()
    assert str(info.value) == (
        "EarlyStopping('accuracy'): no evaluator, loss function or callback logs metric "
        "'accuracy'; fix the name, or declare its source (declared: acc, grad_norm, loss, lr, "
        "step_time)"
    )
    with pytest.raises(ConfigError, match=r"did you mean 'throughput/steps_per_s'"):
        _loop([SpeedMonitor(), EarlyStopping("throughput/steps_per_se")], loss_metrics=[]).fit()


def test_names_that_sources_declare_pass_without_a_word(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="lab.loop")
    callbacks = [
        SpeedMonitor(),
        StabilityMonitor(window=4, min_history=2),
        EarlyStopping("throughput/steps_per_s", patience=50),
        EarlyStopping("stability/loss_spike_score_total", patience=50),
        EarlyStopping("loss", eval_name="val", patience=50),
    ]
    _loop(callbacks, [_val(["loss", "acc"])], loss_metrics=[]).fit()
    assert _warnings(caplog) == []
    _loop(
        [EarlyStopping("val/loss", patience=50), EarlyStopping("lr", patience=50)], [_val()]
    ).fit()
    assert _warnings(caplog) == []


def test_close_matches_are_difflibs_best_first() -> None:
    assert close_matches("val/los", ["val/loss", "val/acc", "loss"]) == ["val/loss"]
    assert close_matches("zzz", ["loss"]) == []
