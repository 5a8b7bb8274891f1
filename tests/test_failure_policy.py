"""The failure policy of callbacks: critical ones fail the run, best-effort ones are recorded,
and one that keeps failing is disabled for the rest of its run (and only that run), though
it still gets the hooks that end what it started.

What a worker process imports (`train_quick`, `HookFile`, `SqlDownAt`) is defined at module
top level: a spawned process finds it by name.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import torch

import lab
from lab import Arm, Callback, Experiment, LoopArtifacts, SqlLogger, TrainingLoop
from lab.callbacks.monitors import GarbageCollector
from lab.dispatch import Dispatcher
from lab.errors import ConfigError
from lab.hooks import ENDING_HOOKS, RUN_HOOKS
from lab.store import Store
from tests.recorder import Labels


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


class Recorder(
    Labels,
    hooks=("on_experiment_start", "on_run_start", "on_train_start", "on_step_end",
           "on_train_end", "on_error", "on_run_end", "on_experiment_end", "close"),
):  # fmt: skip
    """Records every hook it gets, by name, with the run key or status where it matters."""


class BrokenRecorder(Recorder):
    """A `Recorder` whose `on_step_end` raises every time, after recording the call."""

    def on_step_end(
        self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch, metrics: dict
    ) -> None:
        super().on_step_end(state, step_idx, batch, metrics)
        raise RuntimeError(f"sink down at {step_idx}")


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
        def on_benchmark_eval(
            self, ctx: Any, eval_result: Any, predictions: list, *, step: int | None = None
        ) -> None:
            self.calls.append((ctx.run_key, -2))

        def on_run_end(self, ctx: Any, run_result: Any, arm: Any) -> None:
            self.calls.append((ctx.run_key, -1))

    broken = RunEndToo(every=True)
    Experiment(
        "both", lambda run: _loop(8).fit(run), callbacks=[broken], store=False, strict=False,
        benchmarks=[lab.Evaluator("bench", lambda model: {"x": 1.0})],
    ).run()  # fmt: skip
    # disabled in the loop's dispatcher (on_step_end) is disabled in the experiment's: no
    # post-training on_benchmark_eval (-2); on_run_end (-1) still ends the run
    assert broken.calls == [("base-r0", s) for s in range(1, 6)] + [("base-r0", -1)]


def test_a_bare_loop_disables_its_own_callback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAB_STRICT", "0")
    broken = FailsAt(every=True)
    _loop(12, callbacks=(broken,)).fit()
    assert [s for _, s in broken.calls] == [1, 2, 3, 4, 5]


# --------------------------------------------------------------------------------------------
# a disabled callback still gets the hooks that end what it started


def test_the_ending_hooks() -> None:
    order = lab.hooks.HOOKS.index
    assert sorted(ENDING_HOOKS, key=order) == [
        "on_train_end", "on_error", "on_run_end", "on_experiment_end", "close",
    ]  # fmt: skip
    assert sorted(RUN_HOOKS, key=order) == [
        "on_run_start", "post_checkpoint_loaded", "on_train_start", "on_epoch_start",
        "on_episode_start", "on_make_experience_start", "on_make_experience_end",
        "on_learn_epoch_start", "on_learn_batch_start", "pre_step", "on_step_end", "on_media",
        "on_eval", "on_benchmark_eval", "on_checkpoint", "on_learn_batch_end",
        "on_learn_epoch_end", "on_episode_end", "on_epoch_end", "on_train_end", "on_error",
        "on_run_end",
    ]  # fmt: skip


class LoopBrokenRecorder(BrokenRecorder):
    """The same, under its own name (failures are recorded per callback name)."""


def test_a_disabled_callback_still_ends_its_runs_and_the_experiment() -> None:
    broken = BrokenRecorder()  # an experiment callback
    in_loop: list[BrokenRecorder] = []  # a loop's own callback, one per fit

    def train(run: lab.RunSpec) -> LoopArtifacts:
        in_loop.append(LoopBrokenRecorder())
        return _loop(8, callbacks=(in_loop[-1],)).fit(run)

    result = Experiment(
        "ends", train, repeats=2, callbacks=[broken], store=False, strict=False
    ).run()
    assert [r.status for r in result.runs] == ["completed", "completed"]
    steps = [f"on_step_end:{s}" for s in range(1, 6)]  # then disabled: no steps 6..8
    assert broken.calls == [
        "on_experiment_start",
        "on_run_start:base-r0", "on_train_start", *steps, "on_train_end",
        "on_run_end:base-r0:completed",
        "on_run_start:base-r1", "on_train_start", *steps, "on_train_end",
        "on_run_end:base-r1:completed",
        "on_experiment_end:completed",
        "close",
    ]  # fmt: skip
    for loop_cb in in_loop:  # the loop closes its own callbacks
        assert loop_cb.calls == ["on_train_start", *steps, "on_train_end", "close"]
    for run in result.runs:
        assert [(e["callback"], e["count"], e.get("disabled")) for e in run.callback_errors] == [
            ("BrokenRecorder", 5, True),
            ("LoopBrokenRecorder", 5, True),
        ]


class BrokenGC(GarbageCollector):
    """Turns gc off at `on_train_start`, then fails every step: disabled after 5."""

    def on_step_end(
        self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch, metrics: dict
    ) -> None:
        raise RuntimeError("gc stats unavailable")


@pytest.mark.parametrize("ending", ["on_train_end", "on_error"])
def test_a_disabled_garbage_collector_turns_gc_back_on(
    ending: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAB_STRICT", "0")  # a bare loop's dispatcher reads it
    gc.enable()
    collector = BrokenGC(every=1)
    loop = _loop(12, callbacks=(collector,))
    if ending == "on_error":  # the loss of step 9 raises, after the collector was disabled
        loss_fn, steps = loop.loss_fn, iter(range(1, 13))

        def failing(model: torch.nn.Module, batch: Any) -> torch.Tensor:
            if next(steps) == 9:
                raise ValueError("loss blew up")
            return loss_fn(model, batch)

        loop.loss_fn = failing
    try:
        if ending == "on_error":
            with pytest.raises(ValueError, match="loss blew up"):
                loop.fit()
        else:
            loop.fit()
        assert gc.isenabled()  # restored by the hook that ended the fit
    finally:
        gc.enable()


def test_a_failure_in_an_ending_hook_is_recorded_and_never_enables_it_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Leaky(Callback):
        max_failures = 3

        def __init__(self) -> None:
            self.calls: list[str] = []

        def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: dict) -> None:
            self.calls.append(f"on_step_end:{step_idx}")
            raise RuntimeError("step")

        def on_train_end(self, state: Any, artifacts: Any) -> None:
            self.calls.append("on_train_end")

        def on_run_end(self, ctx: Any, run_result: Any, arm: Any) -> None:
            self.calls.append("on_run_end")
            raise RuntimeError("cannot finish")

    cb = Leaky()
    d = Dispatcher([cb], strict=False)
    d.run_key = "r"
    with caplog.at_level(logging.WARNING, logger="lab.hooks"):
        for step in range(1, 5):
            d.fire("on_step_end", None, step, None, {})
        d.fire("on_train_end", None, None)  # a success: ends no streak, enables nothing
        d.fire("on_step_end", None, 5, None, {})
        d.fire("on_run_end", None, None, None)  # a failure: recorded, counts no streak
        d.fire("on_run_end", None, None, None)
        d.fire("on_step_end", None, 6, None, {})
    assert cb.calls == [
        "on_step_end:1", "on_step_end:2", "on_step_end:3", "on_train_end", "on_run_end",
        "on_run_end",
    ]  # fmt: skip
    assert d.disabled() == [cb]
    assert [(f.hook, f.error, f.count, f.disabled) for f in d.failures] == [
        ("on_step_end", "RuntimeError: step", 3, True),
        ("on_run_end", "RuntimeError: cannot finish", 2, False),
    ]
    assert [m for m in _records(caplog, logging.WARNING) if "disabled" in m] == [
        "callback Leaky failed 3 times in a row (in on_step_end: RuntimeError: step); "
        "disabled for the rest of run r"
    ]
    d.run_key = "r2"  # the next run: enabled again
    d.fire("on_step_end", None, 1, None, {})
    assert cb.calls[-1] == "on_step_end:1" and d.disabled() == []


# --------------------------------------------------------------------------------------------
# a critical callback at a run's start and end fails that run, not the experiment


class SqlDownAt(SqlLogger):
    """A `SqlLogger` whose store fails in one hook of one run, as a locked database would."""

    def __init__(self, store: str, hook: str, run_key: str) -> None:
        super().__init__(store)
        self.hook = hook
        self.run_key = run_key
        self.calls: list[str] = []

    def _fail(self, hook: str, run_key: str | None) -> None:
        self.calls.append(f"{hook}:{run_key}")
        if (hook, run_key) == (self.hook, self.run_key):
            raise OSError("database is locked")

    def on_run_start(self, ctx: lab.LogContext) -> None:
        self._fail("on_run_start", ctx.run_key)
        super().on_run_start(ctx)

    def on_error(self, ctx: lab.LogContext, exc: BaseException) -> None:
        self._fail("on_error", ctx.run_key)
        super().on_error(ctx, exc)

    def on_run_end(self, ctx: lab.LogContext, run_result: lab.RunResult, arm: Any) -> None:
        self._fail("on_run_end", ctx.run_key)
        super().on_run_end(ctx, run_result, arm)


def _run_rows(url: str) -> list[tuple[Any, ...]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            sql = "SELECT run_key, status, error FROM runs ORDER BY run_id"
            return [tuple(r) for r in conn.exec_driver_sql(sql)]
    finally:
        engine.dispose()


def test_a_critical_callback_raising_in_on_run_start_fails_only_that_run(
    sqlite_url: str,
) -> None:
    # strict mode on (conftest): it re-raises best-effort failures, and changes nothing here
    sql = SqlDownAt(sqlite_url, "on_run_start", "base-r1")
    seen = Recorder()
    result = Experiment(
        "start", lambda run: _loop(2).fit(run), repeats=3, callbacks=[sql, seen]
    ).run()
    assert [(r.run_key, r.status, r.error) for r in result.runs] == [
        ("base-r0", "completed", None),
        ("base-r1", "failed", "OSError: database is locked"),
        ("base-r2", "completed", None),
    ]
    failed = result.runs[1]
    assert failed.traceback is not None
    assert failed.traceback.rstrip().endswith("OSError: database is locked")
    assert failed.metrics == {} and failed.callback_errors == []
    assert result.status == "failed"
    steps = ["on_train_start", "on_step_end:1", "on_step_end:2", "on_train_end"]
    # the others still start the run (after the logger that raised), then see it fail
    assert seen.calls == [
        "on_experiment_start",
        "on_run_start:base-r0", *steps, "on_run_end:base-r0:completed",
        "on_run_start:base-r1", "on_error:base-r1:OSError", "on_run_end:base-r1:failed",
        "on_run_start:base-r2", *steps, "on_run_end:base-r2:completed",
        "on_experiment_end:failed",
        "close",
    ]  # fmt: skip
    # the logger that could not start base-r1 gets none of its other hooks (its on_run_end
    # would close base-r0's record: the run id in ctx.ids is still that run's)
    assert sql.calls == [
        "on_run_start:base-r0", "on_run_end:base-r0",
        "on_run_start:base-r1",
        "on_run_start:base-r2", "on_run_end:base-r2",
    ]  # fmt: skip
    # base-r1 was claimed before its hooks fired: its row is closed as failed, not running
    assert _run_rows(sqlite_url) == [
        ("base-r0", "completed", None),
        ("base-r1", "failed", "OSError: database is locked"),
        ("base-r2", "completed", None),
    ]


def test_a_critical_callback_raising_in_on_run_end_fails_that_run_and_the_others_go_on(
    sqlite_url: str,
) -> None:
    sql = SqlDownAt(sqlite_url, "on_run_end", "base-r0")
    seen = Recorder()
    result = Experiment(
        "end", lambda run: _loop(2).fit(run), repeats=2, callbacks=[sql, seen]
    ).run()
    assert [(r.run_key, r.status, r.error) for r in result.runs] == [
        ("base-r0", "failed", "OSError: database is locked"),
        ("base-r1", "completed", None),
    ]
    failed = result.runs[0]
    assert failed.traceback is not None
    assert failed.traceback.rstrip().endswith("OSError: database is locked")
    assert set(failed.metrics) >= {"loss", "lr"}  # it trained; only its end was not recorded
    assert result.status == "failed"
    summary = result.summary()
    assert summary.runs_by_status == {"completed": 1, "failed": 1}
    assert summary.row("base", "loss").n == 1  # the failed run is out of the statistics
    steps = ["on_train_start", "on_step_end:1", "on_step_end:2", "on_train_end"]
    # the callbacks after it still get on_run_end, with the run as it ended training
    assert seen.calls == [
        "on_experiment_start",
        "on_run_start:base-r0", *steps, "on_run_end:base-r0:completed",
        "on_run_start:base-r1", *steps, "on_run_end:base-r1:completed",
        "on_experiment_end:failed",
        "close",
    ]  # fmt: skip
    # the store could not record base-r0's end; the experiment's record says failed
    assert _run_rows(sqlite_url) == [("base-r0", "running", None), ("base-r1", "completed", None)]
    assert _stored_experiment_status(sqlite_url) == "failed"


def _stored_experiment_status(url: str) -> str:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.exec_driver_sql("SELECT status FROM experiments").scalar_one()
    finally:
        engine.dispose()


def test_a_failing_run_whose_end_a_critical_callback_cannot_record_keeps_its_own_error(
    sqlite_url: str,
) -> None:
    def train(run: lab.RunSpec) -> None:
        raise ValueError("diverged")

    sql = SqlDownAt(sqlite_url, "on_run_end", "base-r0")
    (run,) = Experiment("both-fail", train, callbacks=[sql]).run().runs
    assert (run.status, run.error) == ("failed", "ValueError: diverged")
    assert run.traceback is not None and "diverged" in run.traceback


def test_strict_mode_still_raises_a_best_effort_callbacks_run_start_error() -> None:
    class StartBoom(Callback):
        def on_run_start(self, ctx: lab.LogContext) -> None:
            raise RuntimeError("boom")

    with pytest.raises(lab.errors.CallbackError, match=r"StartBoom.on_run_start raised"):
        Experiment("strict", lambda run: None, callbacks=[StartBoom()], store=False).run()


class HookFile(Callback):
    """Appends each run hook it gets to a file: what a worker process saw, read back here."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _write(self, line: str) -> None:
        with self.path.open("a") as f:
            f.write(line + "\n")

    def on_run_start(self, ctx: lab.LogContext) -> None:
        self._write(f"on_run_start:{ctx.run_key}")

    def on_error(self, ctx: lab.LogContext, exc: BaseException) -> None:
        self._write(f"on_error:{ctx.run_key}:{type(exc).__name__}")

    def on_run_end(self, ctx: lab.LogContext, run_result: lab.RunResult, arm: Any) -> None:
        self._write(f"on_run_end:{run_result.run_key}:{run_result.status}")


def train_quick(run: lab.RunSpec) -> dict[str, float]:
    """No torch optimizer: a worker's first one costs seconds."""
    return {"loss": float(run.seed)}


def test_critical_run_start_and_end_failures_in_worker_processes(
    sqlite_url: str, tmp_path: Path
) -> None:
    hooks_file = tmp_path / "hooks.txt"
    result = Experiment(
        "procs", train_quick, repeats=3, executor="processes", workers=1, output_dir=tmp_path,
        callbacks=[SqlDownAt(sqlite_url, "on_run_start", "base-r1"), HookFile(hooks_file)],
        store=sqlite_url,
    ).run()  # fmt: skip
    assert [(r.run_key, r.status, r.error) for r in result.runs] == [
        ("base-r0", "completed", None),
        ("base-r1", "failed", "OSError: database is locked"),
        ("base-r2", "completed", None),
    ]
    assert hooks_file.read_text().splitlines() == [
        "on_run_start:base-r0", "on_run_end:base-r0:completed",
        "on_run_start:base-r1", "on_error:base-r1:OSError", "on_run_end:base-r1:failed",
        "on_run_start:base-r2", "on_run_end:base-r2:completed",
    ]  # fmt: skip
    # base-r1 was claimed before its hooks fired: its row is closed as failed, not running
    assert _run_rows(sqlite_url) == [
        ("base-r0", "completed", None),
        ("base-r1", "failed", "OSError: database is locked"),
        ("base-r2", "completed", None),
    ]

    hooks_file.unlink()
    result = Experiment(
        "procs-end", train_quick, repeats=2, executor="processes", workers=1,
        output_dir=tmp_path, callbacks=[SqlDownAt(sqlite_url, "on_run_end", "base-r0"),
                                        HookFile(hooks_file)],
        store=sqlite_url,
    ).run()  # fmt: skip
    assert [(r.run_key, r.status, r.error) for r in result.runs] == [
        ("base-r0", "failed", "OSError: database is locked"),
        ("base-r1", "completed", None),
    ]
    assert hooks_file.read_text().splitlines() == [
        "on_run_start:base-r0", "on_run_end:base-r0:completed",
        "on_run_start:base-r1", "on_run_end:base-r1:completed",
    ]  # fmt: skip


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


class CriticalBad(Bad):
    critical = True


def test_strict_mode_and_critical_callbacks_are_never_disabled() -> None:
    d = Dispatcher([Bad()], strict=True)
    for _ in range(10):
        with pytest.raises(lab.errors.CallbackError):
            d.fire("on_step_end", None, 1, None, {})
    assert not d.disabled()

    d = Dispatcher([CriticalBad()], strict=False, max_failures=1)
    for _ in range(10):
        with pytest.raises(RuntimeError, match=r"^bad$"):  # its own exception, every time
            d.fire("on_step_end", None, 1, None, {})
    assert not d.disabled() and d.failures == []

    class CriticalEveryStep(FailsAt):
        critical = True

    critical = CriticalEveryStep(every=True)
    seen = Recorder()
    result = Experiment(
        "crit-every", lambda run: _loop(20).fit(run), repeats=2, callbacks=[critical, seen],
        store=False, strict=False,
    ).run()  # fmt: skip
    # each run fails at the critical callback's first failure: never 5 in a row, never disabled
    assert [(r.status, r.error, r.callback_errors) for r in result.runs] == [
        ("failed", "RuntimeError: sink down at 1", []),
        ("failed", "RuntimeError: sink down at 1", []),
    ]
    assert critical.calls == [("base-r0", 1), ("base-r1", 1)]
    assert seen.calls[:6] == [
        "on_experiment_start", "on_run_start:base-r0", "on_train_start",
        "on_step_end:1",  # the callbacks after it still get the step it failed in
        "on_error:base-r0:RuntimeError", "on_run_end:base-r0:failed",
    ]  # fmt: skip


def test_train_fn_is_not_affected_by_a_disabled_callback() -> None:
    """The loop's own metrics are whole even when a callback was disabled mid-run."""

    def train(run: lab.RunSpec) -> LoopArtifacts:
        return _loop(10).fit(run)

    result = Experiment(
        "whole", train, callbacks=[FailsAt(every=True)], store=False, strict=False
    ).run()
    assert result.runs[0].status == "completed"
    assert set(result.runs[0].metrics) >= {"loss", "lr"}
