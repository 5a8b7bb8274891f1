"""What real training scripts need from the loop: evaluators that get the device and the
loop state, schedulers per step, per epoch and driven by a metric (ReduceLROnPlateau),
several optimizers (a GAN), closure optimizers (LBFGS), gradient accumulation and epochs.

Real torch throughout: real optimizers and schedulers, real checkpoints in a temporary
folder, and resumes compared bit for bit with runs that never stopped.
"""

from __future__ import annotations

import copy
import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lab import Callback, CheckpointConfig, Experiment, RunHandle, TrainingLoop
from lab.errors import ConfigError, LossError
from lab.hooks import LogContext, LoopState
from lab.loop.evals import EvalContext, Evaluator
from lab.loop.optimizers import as_optimizers, needs_closure
from lab.loop.schedules import Schedule, Schedules, as_schedules
from tests.recorder import EVERY_HOOK, Recorder


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
    assert schedules.metrics_needed == {
        "val/loss": "Schedule(ReduceLROnPlateau, metric='val/loss')",
        "loss": "Schedule(ReduceLROnPlateau, metric='loss')",
    }
    for opt in (per_step, per_epoch, on_eval, on_loss):
        opt.step()  # as in the loop: the optimizer steps first (no gradients: a no-op)
    for _ in range(3):
        schedules.after_step({"loss": 1.0})  # the same loss: no improvement after the first
    schedules.after_epoch({"loss": 1.0})
    state: Any = None  # on_eval reads only the eval's name and metrics
    schedules.on_eval(state, 3, "val", {"loss": 2.0})
    schedules.on_eval(state, 3, "val", {"loss": 3.0})  # worse: halved
    schedules.on_eval(state, 3, "other", {"loss": 9.0})  # another eval's loss is not val/loss
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


# --------------------------------------------------------------------------------------------
# the loop: helpers


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _tensors(n: int = 24, dim: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    return x, x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)


def _batches(n: int = 4, size: int = 4, dim: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _tensors(n * size, dim)
    return [(x[i * size : (i + 1) * size], y[i * size : (i + 1) * size]) for i in range(n)]


def _shuffled(n: int = 24, batch_size: int = 4) -> DataLoader:
    """A shuffled loader: its order is drawn from the global RNG at each epoch's start."""
    return DataLoader(TensorDataset(*_tensors(n)), batch_size=batch_size, shuffle=True)


def _net() -> torch.nn.Module:
    """A model with dropout, so a resume must restore the RNG to land on the same weights."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Dropout(0.25), torch.nn.Linear(8, 1)
    )


def _flat(*models: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for m in models for p in m.parameters()]).clone()


class Trace(
    Recorder,
    hooks=("on_train_start", "on_epoch_start", "pre_step", "on_step_end", "on_eval",
           "on_checkpoint", "on_epoch_end", "on_train_end"),
):  # fmt: skip
    """Every loop hook, in order, with its step or epoch, and each step's metrics."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []
        self.positions: list[tuple[int, int, int]] = []

    def note(self, hook: str, *args: Any, **kwargs: Any) -> tuple[str, Any]:
        if hook == "on_step_end":
            state, step_idx, _, metrics = args
            self.rows.append(dict(metrics))
            self.positions.append((step_idx, state.epoch, state.batch_in_epoch))
        if hook == "on_checkpoint":
            return (hook, args[1].step)
        if hook in ("on_train_start", "on_train_end"):
            return (hook, args[0].step)
        return (hook, args[1])  # the epoch, or the step


class Crash(Callback):
    """Fails the fit at the end of step `at`, before that step's save: a resume starts from
    the save before."""

    priority = -100

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, state: LoopState, step_idx: int, batch: Any, metrics: dict) -> None:
        if step_idx == self.at:
            raise RuntimeError(f"crash at step {step_idx}")


def _interrupted_then_resumed(make: Any, folder: Path, crash_at: int) -> Any:
    """Fit `make()` until it crashes at `crash_at`, then fit a fresh `make()` to the end."""
    with pytest.raises(Exception, match=f"crash at step {crash_at}"):
        make([Crash(crash_at)]).fit(run_dir=folder)
    return make([])


# --------------------------------------------------------------------------------------------
# schedulers in the loop


def test_reduce_lr_on_plateau_steps_with_the_fresh_eval_value() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    trace = Trace()
    TrainingLoop(
        model, opt, _batches(), _mse, 6,
        scheduler=Schedule(plateau, metric="val/loss"),
        evaluators=[Evaluator("val", lambda m: {"loss": 1.0}, every=2)],  # never improves
        callbacks=[trace],
    ).fit()  # fmt: skip
    # evals at 2, 4, 6: the first sets the best, each later one halves the rate
    assert [r["lr"] for r in trace.rows] == [0.1, 0.1, 0.1, 0.1, 0.05, 0.05]
    assert opt.param_groups[0]["lr"] == 0.025


def test_a_bare_reduce_lr_on_plateau_is_refused_when_the_loop_is_built() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"^ReduceLROnPlateau steps on a metric: pass Schedule"):
        TrainingLoop(model, opt, _batches(), _mse, 2,
                     scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))  # fmt: skip


def test_a_schedule_metric_that_nothing_logs_fails_before_the_first_step() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    trace = Trace()
    loop = TrainingLoop(
        model, opt, _batches(), _mse, 2,
        scheduler=Schedule(plateau, metric="val/los"),
        evaluators=[Evaluator("val", lambda m: {"loss": 1.0}, every=1, metrics=["loss"])],
        callbacks=[trace],
    )  # fmt: skip
    with pytest.raises(ConfigError) as err:
        loop.fit()
    assert str(err.value).startswith(
        "Schedule(ReduceLROnPlateau, metric='val/los'): no evaluator, loss function or callback "
        "logs metric 'val/los'; did you mean 'val/loss'?"
    )
    assert trace.calls == []


def test_a_per_epoch_scheduler_steps_after_each_epoch() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trace = Trace()
    TrainingLoop(model, opt, _batches(2), _mse, num_epochs=3,
                 scheduler=Schedule(step_lr, every="epoch"), callbacks=[trace]).fit()  # fmt: skip
    assert [r["lr"] for r in trace.rows] == [0.1, 0.1, 0.05, 0.05, 0.025, 0.025]


def test_a_per_epoch_scheduler_without_epochs_is_refused() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with pytest.raises(ConfigError) as err:
        TrainingLoop(model, opt, _batches(2), _mse, 4, scheduler=Schedule(step_lr, every="epoch"))
    assert str(err.value) == (
        "Schedule(StepLR, every='epoch') needs the loop to count epochs: pass num_epochs=N "
        "or steps_per_epoch=N"
    )


# --------------------------------------------------------------------------------------------
# several optimizers, a custom train step


def test_a_list_of_optimizers_without_a_train_step_is_one_line() -> None:
    g, d = torch.nn.Linear(3, 1), torch.nn.Linear(1, 1)
    opts = [torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)]
    with pytest.raises(ConfigError) as err:
        TrainingLoop(g, opts, _batches(), _mse, 2)
    assert str(err.value) == (
        "2 optimizers (0, 1): the default step cannot know which loss steps which; pass "
        "train_step=fn, where fn(loop, batch) does its own backward and optimizer steps"
    )


class Gan(torch.nn.Module):
    """A generator and a discriminator in one module, so the loop saves both."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        self.d = torch.nn.Sequential(
            torch.nn.Linear(3, 8), torch.nn.LeakyReLU(0.2), torch.nn.Dropout(0.2),
            torch.nn.Linear(8, 1),
        )  # fmt: skip


def gan_step(loop: TrainingLoop, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """One DCGAN-style step: the discriminator on real and fake, then the generator."""
    real, _ = batch
    model, opt_g, opt_d = loop.model, loop.optimizers["G"], loop.optimizers["D"]
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    noise = torch.randn(real.shape[0], 2)
    fake = model.g(noise)
    opt_d.zero_grad()
    ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
    loss_d = bce(model.d(real), ones) + bce(model.d(fake.detach()), zeros)
    loss_d.backward()
    opt_d.step()
    opt_g.zero_grad()
    loss_g = bce(model.d(fake), ones)
    loss_g.backward()
    opt_g.step()
    return loss_g, {"loss_d": loss_d.item()}


def _gan_loop(callbacks: list[Callback], named: bool = False) -> TrainingLoop:
    model = Gan()
    opt_g = torch.optim.Adam(model.g.parameters(), lr=0.01)
    opt_d = torch.optim.Adam(model.d.parameters(), lr=0.02)
    g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=3, gamma=0.5)
    d = Schedule(torch.optim.lr_scheduler.StepLR(opt_d, step_size=4, gamma=0.5))
    scheds: Any = {"G": g, "D": d} if named else [g, d]
    return TrainingLoop(
        model, {"G": opt_g, "D": opt_d}, _shuffled(), None, 10,
        train_step=gan_step, scheduler=scheds, loss_metrics=["loss_d"],
        checkpoint=CheckpointConfig(every=2), callbacks=callbacks,
    )  # fmt: skip


def test_a_gan_with_two_optimizers_trains_and_logs_both_losses(tmp_path: Path) -> None:
    trace = Trace()
    loop = _gan_loop([trace])
    artifacts = loop.fit(run_dir=tmp_path)
    assert artifacts.step == 10
    assert [sorted(r) for r in trace.rows[:1]] == [
        ["grad_norm", "loss", "loss_d", "lr", "step_time"]
    ]
    assert all(math.isnan(r["grad_norm"]) for r in trace.rows)  # the step is the user's: unmeasured
    assert [r["lr"] for r in trace.rows] == [0.01] * 3 + [0.005] * 3 + [0.0025] * 3 + [0.00125]
    assert loop.optimizers["D"].param_groups[0]["lr"] == 0.02 / 4  # stepped 10 times, size 4


def test_a_gan_resumed_after_a_crash_lands_on_the_same_weights(tmp_path: Path) -> None:
    straight = _gan_loop([], named=True)
    straight.fit(run_dir=tmp_path / "straight")
    resumed = _interrupted_then_resumed(
        lambda cbs: _gan_loop(cbs, named=True), tmp_path / "resumed", crash_at=7
    )
    trace = Trace()
    resumed.callbacks.append(trace)
    resumed.fit(run_dir=tmp_path / "resumed")
    assert trace.calls[0] == ("on_train_start", 6)  # from the save at step 6
    assert torch.equal(_flat(resumed.model), _flat(straight.model))
    assert [o.param_groups[0]["lr"] for o in resumed.optimizers.values()] == [0.00125, 0.005]
    for name in ("G", "D"):
        a, b = resumed.optimizers[name].state_dict(), straight.optimizers[name].state_dict()
        assert a["param_groups"] == b["param_groups"]
        for key in a["state"]:
            assert torch.equal(a["state"][key]["exp_avg"], b["state"][key]["exp_avg"])


def test_a_subclass_overrides_train_step() -> None:
    class Halved(TrainingLoop):
        def train_step(self, batch: Any) -> float:
            self.optimizer.zero_grad()
            loss = _mse(self.model, batch) / 2
            loss.backward()
            self.optimizer.step()
            return loss.item()  # a float is a loss too

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    ref = copy.deepcopy(model)
    trace = Trace()
    data = _batches()
    Halved(model, torch.optim.SGD(model.parameters(), lr=0.1), data, None, 3,
           callbacks=[trace]).fit()  # fmt: skip
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    expected = []
    for step in range(3):
        ref_opt.zero_grad()
        loss = _mse(ref, data[step]) / 2
        loss.backward()
        ref_opt.step()
        expected.append(loss.item())
    assert [r["loss"] for r in trace.rows] == expected
    assert torch.equal(_flat(model), _flat(ref))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"grad_clip": 1.0}, "grad_clip=1.0 with a custom train_step: clip inside your step"),
        ({"accumulate": 2}, "accumulate=2 with a custom train_step: accumulate inside your step"),
    ],
)
def test_what_a_custom_step_does_itself_is_refused(kw: dict[str, Any], message: str) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError) as err:
        TrainingLoop(model, opt, _batches(), None, 2, train_step=lambda loop, b: 0.0, **kw)
    assert str(err.value).startswith(message)


def test_no_loss_fn_and_no_train_step_is_one_line() -> None:
    model = _net()
    with pytest.raises(ConfigError) as err:
        TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(), None, 2)
    assert str(err.value) == (
        "no loss_fn: pass loss_fn(model, batch) -> loss, or train_step=fn for a step of your own"
    )


# --------------------------------------------------------------------------------------------
# LBFGS: a closure optimizer with the default step


def _lbfgs_loop(callbacks: list[Callback]) -> TrainingLoop:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=5)
    return TrainingLoop(model, opt, _shuffled(), _mse, 8,
                        checkpoint=CheckpointConfig(every=2), callbacks=callbacks)  # fmt: skip


def test_lbfgs_trains_with_the_default_step(tmp_path: Path) -> None:
    trace = Trace()
    _lbfgs_loop([trace]).fit(run_dir=tmp_path)
    losses = [r["loss"] for r in trace.rows]
    assert len(losses) == 8 and losses[-1] < losses[0] / 10
    assert all(r["grad_norm"] > 0 for r in trace.rows)


def test_lbfgs_resumes_on_the_same_weights(tmp_path: Path) -> None:
    straight = _lbfgs_loop([])
    straight.fit(run_dir=tmp_path / "straight")
    resumed = _interrupted_then_resumed(_lbfgs_loop, tmp_path / "resumed", crash_at=5)
    resumed.fit(run_dir=tmp_path / "resumed")
    assert torch.equal(_flat(resumed.model), _flat(straight.model))


# --------------------------------------------------------------------------------------------
# gradient accumulation


def test_accumulation_steps_once_per_k_micro_batches_with_averaged_metrics() -> None:
    data = _batches(4)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)  # no dropout: the hand-made steps below match bit for bit
    ref = copy.deepcopy(model)
    trace = Trace()

    losses: list[torch.Tensor] = []

    def loss_fn(m: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        loss = _mse(m, batch)
        losses.append(loss.detach().clone())
        return loss, {"n": float(batch[0].shape[0] * len(losses))}

    loop = TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn, 2,
                        accumulate=2, callbacks=[trace])  # fmt: skip
    loop.fit()
    assert [c for c in trace.calls if c[0] in ("pre_step", "on_step_end")] == [
        ("pre_step", 1), ("on_step_end", 1), ("pre_step", 2), ("on_step_end", 2)
    ]  # fmt: skip
    # the mean of the micro-batches' losses, taken on the device (one .item() per step)
    assert [r["loss"] for r in trace.rows] == [
        ((losses[0] + losses[1]) / 2).item(), ((losses[2] + losses[3]) / 2).item()
    ]  # fmt: skip
    assert [r["n"] for r in trace.rows] == [(4 + 8) / 2, (12 + 16) / 2]
    assert trace.positions == [(1, 0, 2), (2, 0, 4)]  # the data position counts micro-batches
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        ref_opt.zero_grad()
        for micro in range(2):
            (_mse(ref, data[2 * step + micro]) / 2).backward()
        ref_opt.step()
    assert torch.equal(_flat(model), _flat(ref))


def _accumulating(callbacks: list[Callback]) -> TrainingLoop:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    # 6 batches a pass, 4 per step: each epoch is 1 step and leaves 2 batches unused
    return TrainingLoop(model, opt, _shuffled(24, 4), _mse, 5, accumulate=4, scheduler=sched,
                        checkpoint=CheckpointConfig(every=2), callbacks=callbacks)  # fmt: skip


def test_accumulation_leaves_a_pass_s_incomplete_group_unused() -> None:
    trace = Trace()
    loop = _accumulating([trace])
    loop.checkpoint = None
    loop.fit()
    assert trace.positions == [(s, s - 1, 4) for s in range(1, 6)]


def test_accumulation_resumes_on_the_same_weights(tmp_path: Path) -> None:
    straight = _accumulating([])
    straight.fit(run_dir=tmp_path / "straight")
    resumed = _interrupted_then_resumed(_accumulating, tmp_path / "resumed", crash_at=3)
    resumed.fit(run_dir=tmp_path / "resumed")
    assert torch.equal(_flat(resumed.model), _flat(straight.model))


@pytest.mark.parametrize("bad", [0, 1.5, True])
def test_accumulate_must_be_a_positive_int(bad: Any) -> None:
    model = _net()
    with pytest.raises(ConfigError) as err:
        TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(), _mse, 2,
                     accumulate=bad)  # fmt: skip
    assert str(err.value) == f"accumulate={bad!r}: give the micro-batches per step, an int >= 1"


# --------------------------------------------------------------------------------------------
# epochs


def test_epochs_fire_their_hooks_around_their_steps_evals_and_saves(tmp_path: Path) -> None:
    trace = Trace()
    model = _net()
    TrainingLoop(
        model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(2), _mse,
        num_epochs=2,
        evaluators=[Evaluator("val", lambda m: {"loss": 1.0}, every_epochs=1)],
        checkpoint=CheckpointConfig(every=2, save_at_end=False),
        callbacks=[trace],
    ).fit(run_dir=tmp_path)  # fmt: skip
    assert trace.calls == [
        ("on_train_start", 0),
        ("on_epoch_start", 0),
        ("pre_step", 1), ("on_step_end", 1),
        ("pre_step", 2), ("on_step_end", 2), ("on_eval", 2), ("on_checkpoint", 2),
        ("on_epoch_end", 0),
        ("on_epoch_start", 1),
        ("pre_step", 3), ("on_step_end", 3),
        ("pre_step", 4), ("on_step_end", 4), ("on_eval", 4), ("on_checkpoint", 4),
        ("on_epoch_end", 1),
        ("on_train_end", 4),
    ]  # fmt: skip


def test_an_epoch_with_accumulation_is_len_data_floor_k_steps() -> None:
    trace = Trace()
    model = _net()
    loop = TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(5), _mse,
                        num_epochs=2, accumulate=2, callbacks=[trace])  # fmt: skip
    assert loop.num_steps == 4 and loop.steps_per_epoch == 2
    loop.fit()
    assert [c for c in trace.calls if "epoch" in c[0]] == [
        ("on_epoch_start", 0), ("on_epoch_end", 0), ("on_epoch_start", 1), ("on_epoch_end", 1)
    ]  # fmt: skip
    assert trace.positions == [(1, 0, 2), (2, 0, 4), (3, 1, 2), (4, 1, 4)]


def test_steps_per_epoch_gives_epochs_to_data_without_a_length() -> None:
    def stream() -> Any:
        yield from _batches(4)

    class Restartable:
        def __iter__(self) -> Any:
            return stream()

    trace = Trace()
    model = _net()
    loop = TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), Restartable(), _mse,
                        num_epochs=3, steps_per_epoch=2, callbacks=[trace])  # fmt: skip
    loop.fit()
    assert trace.positions == [(1, 0, 1), (2, 0, 2), (3, 1, 1), (4, 1, 2), (5, 2, 1), (6, 2, 2)]


def _epochs(callbacks: list[Callback]) -> TrainingLoop:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    return TrainingLoop(model, opt, _shuffled(20, 4), _mse, num_epochs=3,
                        scheduler=Schedule(sched, every="epoch"),
                        checkpoint=CheckpointConfig(every=3), callbacks=callbacks)  # fmt: skip


def test_epochs_resume_mid_epoch_on_the_same_weights(tmp_path: Path) -> None:
    straight = _epochs([])
    straight.fit(run_dir=tmp_path / "straight")
    resumed = _interrupted_then_resumed(_epochs, tmp_path / "resumed", crash_at=8)
    trace = Trace()
    resumed.callbacks.append(trace)
    resumed.fit(run_dir=tmp_path / "resumed")
    assert trace.calls[:4] == [  # epochs of 5 steps: step 6 is in epoch 1, which reopens
        ("on_train_start", 6), ("on_epoch_start", 1), ("pre_step", 7), ("on_step_end", 7)
    ]  # fmt: skip
    assert torch.equal(_flat(resumed.model), _flat(straight.model))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"num_steps": 4, "num_epochs": 2},
            "num_steps=4, num_epochs=2: give num_steps=N or num_epochs=N, not both",
        ),
        ({}, "give num_steps=N or num_epochs=N"),
        ({"num_epochs": 0}, "num_epochs=0: give the number of epochs, an int >= 1"),
        ({"num_epochs": 1, "data": iter(())}, "num_epochs needs the epoch's length: data has no"),
        ({"num_epochs": 1, "accumulate": 5}, "an epoch of 4 batches holds no step of 5"),
    ],
)
def test_epoch_settings_are_checked(kw: dict[str, Any], message: str) -> None:
    model = _net()
    data = kw.pop("data", _batches(4))
    with pytest.raises(ConfigError) as err:
        TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, _mse, **kw)
    assert str(err.value).startswith(message)


# --------------------------------------------------------------------------------------------
# the page


def test_the_loop_page_examples_run_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    page = Path(__file__).resolve().parent.parent / "docs" / "loop.md"
    namespace: dict[str, object] = {"__name__": "docs"}
    for block in re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
        exec(compile(block, str(page), "exec"), namespace)
    assert capsys.readouterr().out.splitlines() == [
        "['grad_norm', 'loss', 'lr', 'step_time', 'val/epoch', 'val/loss']",
        "36 2.0 0.00625",
        "[12, 24, 36]",
        "0.0125",
        "ReduceLROnPlateau steps on a metric: pass Schedule(sched, metric='val/loss') (an eval's "
        "or a step's metric name) instead of the bare scheduler",
        "['grad_norm', 'loss', 'loss_d', 'lr', 'step_time']",
        "2 optimizers (0, 1): the default step cannot know which loss steps which; pass "
        "train_step=fn, where fn(loop, batch) does its own backward and optimizer steps",
        "True",
        "2 4",
        "pre1 pre2 end1 end2 pre3 pre4 end3 end4 pre5 end5",
    ]


# --------------------------------------------------------------------------------------------
# a loop of one's own: the run handle's epochs


def test_a_handle_with_steps_per_epoch_runs_every_epochs_evaluators() -> None:
    model = torch.nn.Linear(1, 1)
    seen: list[tuple[int | None, int]] = []

    def val(m: torch.nn.Module, ctx: EvalContext) -> dict[str, float]:
        seen.append((ctx.step, ctx.state.epoch))  # type: ignore[union-attr]
        return {"loss": 0.0}

    ev = Evaluator("val", val, every_epochs=1)
    with RunHandle(None, model, _opt(), num_steps=6, evaluators=[ev], steps_per_epoch=3) as loop:
        for step in loop.steps():
            loop.state.epoch = (step - 1) // 3
            loop.end_step({"loss": 1.0})
    assert seen == [(3, 0), (6, 1)]


def test_a_handle_without_steps_per_epoch_refuses_every_epochs_evaluators() -> None:
    ev = Evaluator("val", lambda m: {}, every_epochs=1)
    with pytest.raises(ConfigError) as err:
        RunHandle(None, torch.nn.Linear(1, 1), _opt(), num_steps=2, evaluators=[ev])
    assert str(err.value) == (
        "Evaluator 'val' (every_epochs=1) needs the loop to count epochs: pass num_epochs=N "
        "or steps_per_epoch=N"
    )


class Tracer(Recorder, hooks=EVERY_HOOK):
    """Every hook as (hook, step or epoch, the payload's types), whatever fired it."""

    def note(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        where = getattr(args[0], "step", None) if args else None
        if name in ("pre_step", "on_step_end", "on_eval", "on_epoch_start", "on_epoch_end"):
            where = args[1]
        elif name == "on_checkpoint":
            where = args[1].step
        return (name, where, tuple(type(a).__name__ for a in args))


def _epoch_setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, list[Any], dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    kw = {
        "evaluators": [Evaluator("val", lambda m: {"loss": 1.0}, every_epochs=1)],
        "checkpoint": CheckpointConfig(every=3),
    }
    return model, opt, _batches(3), kw


def _epochs_by_training_loop(run: Any) -> Any:
    model, opt, data, kw = _epoch_setup()
    return TrainingLoop(model, opt, data, _mse, num_epochs=2, **kw).fit(run)


def _epochs_by_hand(run: Any) -> Any:
    model, opt, data, kw = _epoch_setup()
    with RunHandle(run, model, opt, num_steps=6, steps_per_epoch=3, **kw) as loop:
        for epoch in range(2):
            loop.start_epoch(epoch)
            for batch in data:
                hb = loop.pre_step(batch)
                loss = _mse(model, batch)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                loop.end_step({"loss": loss.item()}, hb)
            loop.end_epoch()
    return loop.artifacts


def test_epochs_fire_the_same_hooks_from_a_hand_written_loop_and_training_loop(
    tmp_path: Path,
) -> None:
    traces = []
    for name, train in (("ours", _epochs_by_training_loop), ("theirs", _epochs_by_hand)):
        tracer = Tracer()
        result = Experiment(name, train, callbacks=[tracer], output_dir=tmp_path / name,
                            store=f"sqlite:///{tmp_path / 'lab.db'}").run()  # fmt: skip
        assert result.status == "completed", result.runs[0].error
        traces.append([c for c in tracer.calls if c[0] not in ("on_run_end", "on_experiment_end")])
    assert traces[0] == traces[1]
    epochs = [(c[0], c[1]) for c in traces[0] if c[0] not in ("pre_step",)]
    assert epochs[3:] == [
        ("on_train_start", 0),
        ("on_epoch_start", 0), ("on_step_end", 1), ("on_step_end", 2), ("on_step_end", 3),
        ("on_eval", 3), ("on_checkpoint", 3), ("on_epoch_end", 0),
        ("on_epoch_start", 1), ("on_step_end", 4), ("on_step_end", 5), ("on_step_end", 6),
        ("on_eval", 6), ("on_checkpoint", 6), ("on_epoch_end", 1),
        ("on_train_end", 6), ("close", None),
    ]  # fmt: skip
    by_name = {c[0]: c[2] for c in traces[0]}
    assert by_name["on_epoch_start"] == by_name["on_epoch_end"] == ("LoopState", "int")


# --------------------------------------------------------------------------------------------
# more of what a step and an eval get


def test_an_evaluator_in_the_loop_gets_the_loop_device_and_state() -> None:
    seen: list[tuple[Any, ...]] = []

    def val(model: torch.nn.Module, ctx: EvalContext) -> dict[str, float]:
        state = ctx.state
        assert state is not None
        seen.append((ctx.device, ctx.step, state.step, state.metrics.get("loss") is not None))
        return {"loss": 0.5}

    model = _net()
    ev = Evaluator("val", val, every=2, at_start=True)
    TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(), _mse, 4,
                 device="cpu", evaluators=[ev]).fit()  # fmt: skip
    cpu = torch.device("cpu")
    assert seen == [(cpu, 0, 0, False), (cpu, 2, 2, True), (cpu, 4, 4, True)]


def test_accumulated_metrics_average_over_the_micro_batches_that_logged_them() -> None:
    calls: list[int] = []

    def loss_fn(m: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        calls.append(1)
        extra = {"every": 2.0}
        if len(calls) % 2:  # the first micro-batch of each step alone logs "odd"
            extra["odd"] = float(len(calls))
        return _mse(m, batch), extra

    model = _net()
    trace = Trace()
    TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(4), loss_fn, 2,
                 accumulate=2, callbacks=[trace]).fit()  # fmt: skip
    assert [(r["every"], r["odd"]) for r in trace.rows] == [(2.0, 1.0), (2.0, 3.0)]


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ((1.0, 2.0), "train_step returned a tuple; return the loss or (loss, dict_of_metrics)"),
        (torch.ones(2), "train_step returned a tensor of shape (2,); return a scalar loss"),
        ("low", "train_step returned str; return the loss (a tensor or a float) or (loss, "),
    ],
)
def test_a_custom_step_that_returns_no_loss_is_one_line(returned: Any, message: str) -> None:
    model = _net()
    loop = TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(), None, 2,
                        train_step=lambda loop, batch: returned)  # fmt: skip
    with pytest.raises(LossError) as err:
        loop.fit()
    assert str(err.value).startswith(message)


def test_accumulation_with_a_grad_scaler_unscales_once_per_step() -> None:
    """Scaling by a power of two and unscaling is exact in float32: with a scaler, the
    accumulated steps land on the weights of the same steps without one."""
    weights = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**10)):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(4), _mse, 4,
                     accumulate=2, scaler=scaler).fit()  # fmt: skip
        weights.append(_flat(model))
    assert torch.equal(weights[0], weights[1])


def _plateau_loop(callbacks: list[Callback]) -> TrainingLoop:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1, factor=0.5)
    losses = [1.0, 0.9, 0.95, 0.97, 0.99, 0.5, 0.6, 0.7]  # by step: 2 bad, 2 bad, 1 good...
    return TrainingLoop(
        model, opt, _shuffled(), _mse, 8,
        scheduler=Schedule(plateau, metric="val/loss"),
        evaluators=[Evaluator("val", lambda m, ctx: {"loss": losses[ctx.step - 1]}, every=1)],
        checkpoint=CheckpointConfig(every=2), callbacks=callbacks,
    )  # fmt: skip


def test_a_plateau_scheduler_resumes_with_its_best_value_and_patience(tmp_path: Path) -> None:
    straight = _plateau_loop([])
    straight.fit(run_dir=tmp_path / "straight")
    resumed = _interrupted_then_resumed(_plateau_loop, tmp_path / "resumed", crash_at=5)
    resumed.schedules[0].scheduler.step(0.0)  # a fresh loop's own values, overwritten on resume
    resumed.fit(run_dir=tmp_path / "resumed")
    want = straight.schedules[0].scheduler.state_dict()
    assert resumed.schedules[0].scheduler.state_dict() == want
    assert resumed.optimizer.param_groups[0]["lr"] == straight.optimizer.param_groups[0]["lr"]
    assert torch.equal(_flat(resumed.model), _flat(straight.model))
