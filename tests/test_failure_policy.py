"""The failure policy of callbacks: critical ones fail the run, best-effort ones are recorded,
and one that keeps failing is disabled for the rest of its run (and only that run)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import lab
from lab import Arm, Callback, Experiment, LoopArtifacts, TrainingLoop
from lab.errors import ConfigError
from lab.hooks import Dispatcher
from lab.store import Store


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _loop(num_steps: int, callbacks: tuple[Callback, ...] = ()) -> TrainingLoop:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, generator=g)
    data = [(x[:4], x[:4].sum(1, keepdim=True)), (x[4:], x[4:].sum(1, keepdim=True))]
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainingLoop(model, opt, data, _mse, num_steps, callbacks=callbacks)


class FailsAt(Callback):
    """Fails `on_step_end` at the given steps; counts every call it gets."""

    def __init__(self, failing: set[int] | None = None, every: bool = False) -> None:
        self.failing = failing or set()
        self.every = every
        self.calls: list[tuple[str | None, int]] = []
        self.run_starts = 0

    def on_run_start(self, ctx: lab.LogContext) -> None:
        self.run_starts += 1

    def on_step_end(
        self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch, metrics: dict
    ) -> None:
        self.calls.append((state.ctx.run_key, step_idx))
        if self.every or step_idx in self.failing:
            raise RuntimeError(f"sink down at {step_idx}")


class CriticalSink(Callback):
    critical = True

    def on_step_end(
        self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch, metrics: dict
    ) -> None:
        if step_idx == 2:
            raise OSError("store unreachable")


def _stored_runs(url: str, name: str) -> list[dict[str, Any]]:
    store = Store(url)
    try:
        return store.get_experiment(name)["runs"]
    finally:
        store.close()


def _records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lab.hooks" and r.levelno == level]


# --------------------------------------------------------------------------------------------
# critical vs best-effort


def test_a_critical_callback_fails_the_run_with_its_exception(sqlite_url: str) -> None:
    result = Experiment(
        "crit", lambda run: _loop(4).fit(run), callbacks=[CriticalSink()], store=sqlite_url,
        strict=False,
    ).run()  # fmt: skip
    (run,) = result.runs
    assert run.status == "failed"
    assert run.error == "OSError: store unreachable"
    assert run.callback_errors == []  # not a callback error: the run's own error
    (stored,) = _stored_runs(sqlite_url, "crit")
    assert stored["status"] == "failed" and "store unreachable" in stored["error"]


def test_a_best_effort_callback_failure_is_recorded_and_the_run_completes(
    sqlite_url: str,
) -> None:
    flaky = FailsAt({2})
    result = Experiment(
        "best", lambda run: _loop(4).fit(run), callbacks=[flaky], store=sqlite_url, strict=False
    ).run()
    (run,) = result.runs
    assert run.status == "completed" and run.error is None
    assert [(e["callback"], e["hook"], e["error"], e["count"]) for e in run.callback_errors] == [
        ("FailsAt", "on_step_end", "RuntimeError: sink down at 2", 1)
    ]
    assert "disabled" not in run.callback_errors[0]
    (stored,) = _stored_runs(sqlite_url, "best")
    assert stored["status"] == "completed"
    assert stored["callback_errors"] == run.callback_errors


# --------------------------------------------------------------------------------------------
# disabling after N consecutive failures


def test_a_callback_failing_n_times_in_a_row_is_disabled_for_the_run(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    broken = FailsAt(every=True)
    with caplog.at_level(logging.WARNING, logger="lab.hooks"):
        result = Experiment(
            "dis", lambda run: _loop(20).fit(run), callbacks=[broken], store=sqlite_url,
            strict=False,
        ).run()  # fmt: skip
    (run,) = result.runs
    assert run.status == "completed"
    # exactly max_failures (5) calls, then no more hooks for this run
    assert broken.calls == [("base-r0", s) for s in range(1, 6)]
    assert [(e["count"], e.get("disabled")) for e in run.callback_errors] == [(5, True)]
    assert _records(caplog, logging.WARNING) == [
        "callback FailsAt failed 5 times in a row (in on_step_end: RuntimeError: sink down at "
        "1); disabled for the rest of run base-r0"
    ]
    (stored,) = _stored_runs(sqlite_url, "dis")
    assert stored["callback_errors"][0]["disabled"] is True


def test_a_disabled_callback_is_enabled_again_at_the_next_run() -> None:
    broken = FailsAt(every=True)
    result = Experiment(
        "again", lambda run: _loop(8).fit(run), arms=[Arm("a"), Arm("b")], repeats=2,
        callbacks=[broken], store=False, strict=False,
    ).run()  # fmt: skip
    keys = [r.run_key for r in result.runs]
    assert keys == ["a-r0", "a-r1", "b-r0", "b-r1"]
    assert broken.run_starts == 4  # each run starts with the callback enabled
    assert broken.calls == [(k, s) for k in keys for s in range(1, 6)]
    for run in result.runs:
        assert [(e["count"], e.get("disabled")) for e in run.callback_errors] == [(5, True)]


def test_an_intermittently_failing_callback_is_never_disabled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 4 failures in a row (one short of 5), a success, again and again: never disabled
    failing = {s for s in range(1, 41) if s % 5 != 0}
    flaky = FailsAt(failing)
    with caplog.at_level(logging.WARNING, logger="lab.hooks"):
        result = Experiment(
            "flaky", lambda run: _loop(40).fit(run), callbacks=[flaky], store=False, strict=False
        ).run()
    (run,) = result.runs
    assert [s for _, s in flaky.calls] == list(range(1, 41))
    assert [(e["count"], e.get("disabled")) for e in run.callback_errors] == [(32, None)]
    assert not any("disabled" in m for m in _records(caplog, logging.WARNING))


def test_a_success_in_another_hook_of_the_callback_resets_its_streak() -> None:
    class StepFailsEvalWorks(Callback):
        max_failures = 3

        def __init__(self) -> None:
            self.evals = 0

        def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: dict) -> None:
            raise RuntimeError("no")

        def on_eval(self, state: Any, step_idx: int, eval_name: str, metrics: dict) -> None:
            self.evals += 1

    cb = StepFailsEvalWorks()
    d = Dispatcher([cb], strict=False)
    for step in range(10):  # two failures, one success, ...
        d.fire("on_step_end", None, step, None, {})
        d.fire("on_step_end", None, step, None, {})
        d.fire("on_eval", None, step, "val", {})
    assert d.disabled() == [] and cb.evals == 10
    d.fire("on_step_end", None, 1, None, {})
    d.fire("on_step_end", None, 1, None, {})
    d.fire("on_step_end", None, 1, None, {})
    assert d.disabled() == [cb]
    d.fire("on_eval", None, 1, "val", {})  # gone from every hook
    assert cb.evals == 10


def test_disabling_covers_the_loop_and_experiment_dispatchers_of_a_run() -> None:
    class RunEndToo(FailsAt):
        def on_run_end(self, ctx: Any, run_result: Any, arm: Any) -> None:
            self.calls.append((ctx.run_key, -1))

    broken = RunEndToo(every=True)
    Experiment(
        "both", lambda run: _loop(8).fit(run), callbacks=[broken], store=False, strict=False
    ).run()
    assert broken.calls == [("base-r0", s) for s in range(1, 6)]  # no on_run_end either


def test_a_bare_loop_disables_its_own_callback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAB_STRICT", "0")
    broken = FailsAt(every=True)
    _loop(12, callbacks=(broken,)).fit()
    assert [s for _, s in broken.calls] == [1, 2, 3, 4, 5]


# --------------------------------------------------------------------------------------------
# where the limit comes from


def _fail_n(d: Dispatcher, n: int) -> None:
    for step in range(n):
        d.fire("on_step_end", None, step, None, {})


class Bad(Callback):
    def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: dict) -> None:
        raise RuntimeError("bad")


def test_the_limit_from_env_argument_and_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAB_CALLBACK_MAX_FAILURES", "2")
    d = Dispatcher([Bad()], strict=False)
    _fail_n(d, 2)
    assert [f.count for f in d.failures] == [2] and d.disabled()

    d = Dispatcher([Bad()], strict=False, max_failures=3)  # the argument beats the env
    _fail_n(d, 2)
    assert not d.disabled()
    _fail_n(d, 1)
    assert d.disabled()

    class Patient(Bad):
        max_failures = None  # its own choice beats both

    d = Dispatcher([Patient()], strict=False, max_failures=1)
    _fail_n(d, 50)
    assert not d.disabled() and d.failures[0].count == 50

    monkeypatch.setenv("LAB_CALLBACK_MAX_FAILURES", "0")  # 0: never
    d = Dispatcher([Bad()], strict=False)
    _fail_n(d, 50)
    assert not d.disabled()


def test_a_bad_limit_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="max_failures"):
        Dispatcher([Bad()], max_failures=-1)

    class Odd(Bad):
        max_failures = "3"  # type: ignore[assignment]

    with pytest.raises(ConfigError, match=r"Odd\.max_failures='3'"):
        Dispatcher([Odd()])
    monkeypatch.setenv("LAB_CALLBACK_MAX_FAILURES", "lots")
    with pytest.raises(ConfigError, match="LAB_CALLBACK_MAX_FAILURES='lots'"):
        Dispatcher([Bad()])


def test_strict_mode_and_critical_callbacks_are_never_disabled() -> None:
    d = Dispatcher([Bad()], strict=True)
    for _ in range(10):
        with pytest.raises(lab.errors.CallbackError):
            d.fire("on_step_end", None, 1, None, {})
    assert not d.disabled()


def test_train_fn_is_not_affected_by_a_disabled_callback() -> None:
    """The loop's own metrics are whole even when a callback was disabled mid-run."""

    def train(run: lab.RunSpec) -> LoopArtifacts:
        return _loop(10).fit(run)

    result = Experiment(
        "whole", train, callbacks=[FailsAt(every=True)], store=False, strict=False
    ).run()
    assert result.runs[0].status == "completed"
    assert set(result.runs[0].metrics) >= {"loss", "lr"}
