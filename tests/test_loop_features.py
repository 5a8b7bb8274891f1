"""What real training scripts need from the loop: evaluators that get the device and the
loop state, schedulers per step, per epoch and driven by a metric (ReduceLROnPlateau),
several optimizers (a GAN), closure optimizers (LBFGS), gradient accumulation and epochs.

Real torch throughout: real optimizers and schedulers, real checkpoints in a temporary
folder, and resumes compared bit for bit with runs that never stopped.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from lab.errors import CheckpointError, ConfigError
from lab.hooks import LogContext, LoopState
from lab.loop.evals import EvalContext, Evaluator
from lab.loop.optimizers import as_optimizers, needs_closure
from lab.loop.schedules import Schedule, Schedules, as_schedules


def _opt(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=lr)


# --------------------------------------------------------------------------------------------
# evaluators: fn(model) or fn(model, ctx)


def test_an_eval_fn_with_a_second_parameter_gets_the_device_state_and_step() -> None:
    seen: list[EvalContext] = []

    def val(model: torch.nn.Module, ctx: EvalContext) -> dict[str, float]:
        seen.append(ctx)
        return {"loss": 1.5}

    model = torch.nn.Linear(1, 1)
    ctx = LogContext(experiment="e", output_dir=Path("."))
    state = LoopState(ctx=ctx, model=model, optimizer=_opt(), num_steps=4)
    result = Evaluator("val", val).run(model, 3, state=state, device=torch.device("cpu"))
    assert result.metrics == {"loss": 1.5} and result.step == 3
    assert seen == [EvalContext(model, torch.device("cpu"), state, 3)]


def test_one_parameter_and_a_defaulted_second_keep_getting_the_model_alone() -> None:
    data = torch.ones(2, 1)

    def closed_over(model: torch.nn.Module, batch: torch.Tensor = data) -> dict[str, float]:
        return {"n": float(batch.shape[0])}

    model = torch.nn.Linear(1, 1)
    assert Evaluator("a", lambda m: {"x": 2.0}).run(model, 1).metrics == {"x": 2.0}
    assert Evaluator("b", closed_over).run(model, 1, state=None).metrics == {"n": 2.0}


def test_a_benchmark_after_training_gets_no_state() -> None:
    got: list[EvalContext] = []
    Evaluator("probe", lambda m, ctx: got.append(ctx) or {}).run(torch.nn.Linear(1, 1), None)
    assert got[0].state is None and got[0].step is None and got[0].device is None


def test_every_epochs_counts_epoch_ends_only() -> None:
    ev = Evaluator("val", lambda m: {}, every_epochs=2)
    ends = {s: s // 3 for s in (3, 6, 9, 12)}  # epochs of 3 steps
    due = [s for s in range(1, 13) if ev.due(s, num_steps=12, epoch_end=ends.get(s))]
    assert due == [6, 12]  # epochs of 3 steps: the 2nd and 4th epoch ends


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"every_epochs": 0}, "Evaluator 'val': every_epochs=0 must be >= 1 or None"),
        ({"every_epochs": 1.5}, "Evaluator 'val': every_epochs=1.5 must be an int >= 1 or None"),
        ({"every": True}, "Evaluator 'val': every=True must be an int >= 1 or None"),
    ],
)
def test_evaluator_epoch_settings_are_checked(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        Evaluator("val", lambda m: {}, **kw)
    assert str(err.value) == message


# --------------------------------------------------------------------------------------------
# schedules


def test_reduce_lr_on_plateau_without_a_metric_is_one_line_naming_the_fix() -> None:
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(_opt())
    with pytest.raises(ConfigError) as err:
        as_schedules(sched)
    assert str(err.value) == (
        "ReduceLROnPlateau steps on a metric: pass Schedule(sched, metric='val/loss') "
        "(an eval's or a step's metric name) instead of the bare scheduler"
    )


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"every": "batch"}, "Schedule(StepLR, every='batch'): use every='step' or every='epoch'"),
        (
            {"metric": "val/loss"},
            "Schedule(StepLR, metric='val/loss'): StepLR.step() takes no metric; drop metric=, "
            "or use a scheduler that steps on one (ReduceLROnPlateau)",
        ),
    ],
)
def test_schedule_settings_are_checked(kw: dict[str, Any], message: str) -> None:
    sched = torch.optim.lr_scheduler.StepLR(_opt(), step_size=1)
    with pytest.raises(ConfigError) as err:
        Schedule(sched, **kw)
    assert str(err.value) == message


def test_something_that_is_no_scheduler_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^scheduler str has no step\(\): give a torch"):
        as_schedules(["cosine"])


def test_schedules_step_per_step_per_epoch_and_after_the_eval_that_measures_them() -> None:
    per_step, per_epoch, on_eval, on_loss = _opt(), _opt(), _opt(), _opt()
    lr_sched = torch.optim.lr_scheduler.StepLR
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    schedules = Schedules(
        as_schedules(
            [
                lr_sched(per_step, step_size=1, gamma=0.5),
                Schedule(lr_sched(per_epoch, step_size=1, gamma=0.5), every="epoch"),
                Schedule(plateau(on_eval, patience=0, factor=0.5), metric="val/loss"),
                Schedule(plateau(on_loss, patience=0, factor=0.5), metric="loss"),
            ]
        ),
        eval_names=["val"],
    )
    assert schedules.needed() == {
        "val/loss": "Schedule(ReduceLROnPlateau, metric='val/loss')",
        "loss": "Schedule(ReduceLROnPlateau, metric='loss')",
    }
    for _ in range(3):
        schedules.after_step({"loss": 1.0})  # the same loss: no improvement after the first
    schedules.after_epoch({"loss": 1.0})
    schedules.after_eval("val", {"loss": 2.0})
    schedules.after_eval("val", {"loss": 3.0})  # worse: halved
    schedules.after_eval("other", {"loss": 9.0})  # another eval's loss is not val/loss
    lrs = [o.param_groups[0]["lr"] for o in (per_step, per_epoch, on_eval, on_loss)]
    assert lrs == [0.1 / 8, 0.1 / 2, 0.1 / 2, 0.1 / 4]


def test_a_metric_schedule_waits_for_a_fresh_value_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    opt = _opt()
    schedules = Schedules(
        [Schedule(torch.optim.lr_scheduler.ReduceLROnPlateau(opt), metric="acc")], []
    )
    with caplog.at_level(logging.WARNING, logger="lab.loop"):
        schedules.after_step({"loss": 1.0})
        schedules.after_step({"loss": 1.0})
    assert [r.getMessage() for r in caplog.records] == [
        "ReduceLROnPlateau was not stepped: no 'acc' was logged (logged: loss)"
    ]


def test_schedule_states_round_trip_and_a_different_count_is_refused() -> None:
    opt = _opt()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    schedules = Schedules(as_schedules(sched))
    for _ in range(3):
        opt.step()
        schedules.after_step({})
    saved = schedules.state_dict()
    other = torch.optim.lr_scheduler.StepLR(_opt(), step_size=2, gamma=0.1)
    Schedules(as_schedules([other])).load_state_dict(saved)
    assert other.state_dict() == sched.state_dict()
    with pytest.raises(CheckpointError, match="holds 1 scheduler states but the loop has 0"):
        Schedules([]).load_state_dict(saved)


# --------------------------------------------------------------------------------------------
# optimizers


def test_optimizers_are_named_from_one_a_list_or_a_dict() -> None:
    g, d = _opt(), _opt()
    assert as_optimizers(g) == {"optimizer": g}
    assert as_optimizers([g, d]) == {"0": g, "1": d}
    assert as_optimizers({"G": g, "D": d}) == {"G": g, "D": d}


def test_something_that_is_no_optimizer_is_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        as_optimizers({"G": _opt(), "D": torch.nn.Linear(1, 1)})
    assert str(err.value) == (
        "optimizer['D'] is a Linear, not an optimizer (no step()); give a torch.optim "
        "optimizer, or a list or dict of them"
    )
    with pytest.raises(ConfigError, match=r"^optimizer: give a torch optimizer"):
        as_optimizers([])


def test_lbfgs_needs_a_closure_and_sgd_does_not() -> None:
    params = list(torch.nn.Linear(1, 1).parameters())
    assert needs_closure(torch.optim.LBFGS(params))
    assert not needs_closure(torch.optim.SGD(params, lr=0.1))
    assert not needs_closure(torch.optim.Adam(params))
