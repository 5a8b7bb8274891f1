"""A bare fit (no Experiment) fires the whole lifecycle around its loop: an experiment of its
own, group "loop", one run; with an Experiment's failure policy, and the same records."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import torch

import lab
from lab import Callback, RunHandle, TrainingLoop
from lab.errors import CallbackError
from lab.hooks import EXECUTOR, FINISHED_BEFORE, RUNS
from lab.loggers import SqlLogger
from lab.store import Store
from lab.store.engine import resolve_url

NAME = r"loop-\d{8}-\d{6}-[0-9a-f]{6}"


class Recorder(Callback):
    """Records every hook of the lifecycle with what a bare fit sets in `ctx` and results."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.ctx: lab.LogContext | None = None

    def on_experiment_start(self, ctx: lab.LogContext) -> None:
        self.ctx = ctx
        self.calls.append(("on_experiment_start", ctx.run_key, ctx.group_name))

    def on_group_start(self, ctx: lab.LogContext, group_name: str) -> None:
        self.calls.append(("on_group_start", group_name, ctx.group_name, ctx.group_kind))

    def on_run_start(self, ctx: lab.LogContext) -> None:
        self.calls.append(
            ("on_run_start", ctx.run_key, ctx.arm, ctx.repeat, ctx.stage, ctx.seed, ctx.run_config)
        )

    def on_train_start(self, state: lab.LoopState) -> None:
        self.calls.append(("on_train_start", state.ctx.run_key, state.step))

    def on_step_end(self, state: lab.LoopState, step_idx: int, batch: Any, metrics: dict) -> None:
        self.calls.append(("on_step_end", step_idx))

    def on_train_end(self, state: lab.LoopState, artifacts: lab.LoopArtifacts) -> None:
        self.calls.append(("on_train_end", artifacts.step, artifacts.stopped))

    def on_error(self, ctx: lab.LogContext, exc: BaseException) -> None:
        self.calls.append(("on_error", ctx.run_key, type(exc).__name__))

    def on_run_end(self, ctx: lab.LogContext, run_result: lab.RunResult, arm: Any) -> None:
        self.run_result = run_result
        self.calls.append(
            ("on_run_end", run_result.run_key, run_result.status, run_result.error,
             run_result.metrics.get("loss"), arm.name, [r.run_key for r in arm.runs])
        )  # fmt: skip

    def on_experiment_end(self, ctx: lab.LogContext, result: lab.ExperimentResult) -> None:
        self.result = result
        self.calls.append(
            ("on_experiment_end", ctx.run_key, result.name == ctx.experiment, result.status,
             result.error, len(result.runs))
        )  # fmt: skip

    def close(self) -> None:
        self.calls.append(("close",))


class StopAt(Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, state: lab.LoopState, step_idx: int, batch: Any, metrics: dict) -> None:
        if step_idx == self.at:
            state.request_stop("enough")


def _model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


DATA = [(torch.ones(4, 2), torch.ones(4, 1))]


def _fit(
    driver: str,
    callbacks: list[Callback],
    *,
    raise_at: int | None = None,
    exc: type[BaseException] = ValueError,
    run_dir: Path | None = None,
) -> lab.LoopArtifacts:
    """Three steps through a hand-written loop on `RunHandle(None)`, or `TrainingLoop.fit`;
    step `raise_at` raises `exc("boom")`."""
    model, opt = _model_and_opt()
    if driver == "handle":
        with RunHandle(None, model, opt, num_steps=3, callbacks=callbacks, run_dir=run_dir) as h:
            for step in h.steps():
                if step == raise_at:
                    raise exc("boom")
                h.end_step({"loss": 1.0 / step})
        assert h.artifacts is not None
        return h.artifacts

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        loss_fn.calls += 1  # type: ignore[attr-defined]
        if loss_fn.calls == raise_at:  # type: ignore[attr-defined]
            raise exc("boom")
        return _mse(m, batch)

    loss_fn.calls = 0  # type: ignore[attr-defined]
    return TrainingLoop(model, opt, DATA, loss_fn, 3, callbacks=callbacks).fit(run_dir=run_dir)


OPENING = [
    ("on_experiment_start", None, None),
    ("on_group_start", "loop", "loop", "repeats"),
    ("on_run_start", "loop", None, 0, 0, None, {}),
    ("on_train_start", "loop", 0),
]


@pytest.mark.parametrize("driver", ["handle", "loop"])
def test_a_completed_bare_fit_fires_the_whole_lifecycle(driver: str) -> None:
    rec = Recorder()
    artifacts = _fit(driver, [rec])
    loss = artifacts.metrics["loss"]
    assert rec.calls == [
        *OPENING,
        ("on_step_end", 1), ("on_step_end", 2), ("on_step_end", 3),
        ("on_train_end", 3, False),
        ("on_run_end", "loop", "completed", None, loss, "loop", ["loop"]),
        ("on_experiment_end", None, True, "completed", None, 1),
        ("close",),
    ]  # fmt: skip
    assert rec.ctx is not None and re.fullmatch(NAME, rec.ctx.experiment)
    assert rec.ctx.extras == {RUNS: 1, FINISHED_BEFORE: 0, EXECUTOR: "serial"}
    assert rec.run_result.metrics == artifacts.metrics
    assert (rec.run_result.arm, rec.run_result.repeat, rec.run_result.seed) == ("loop", 0, 0)
    assert rec.run_result.artifacts is artifacts and rec.run_result.callback_errors == []


@pytest.mark.parametrize("driver", ["handle", "loop"])
def test_a_stopped_bare_fit_ends_its_run_stopped(driver: str) -> None:
    rec = Recorder()
    _fit(driver, [StopAt(2), rec])
    assert rec.calls[len(OPENING) :] == [
        ("on_step_end", 1), ("on_step_end", 2),
        ("on_train_end", 2, True),
        ("on_run_end", "loop", "stopped", None, rec.run_result.metrics["loss"], "loop", ["loop"]),
        ("on_experiment_end", None, True, "completed", None, 1),
        ("close",),
    ]  # fmt: skip


@pytest.mark.parametrize("driver", ["handle", "loop"])
def test_a_failed_bare_fit_raises_and_ends_its_run_failed(driver: str) -> None:
    rec = Recorder()
    with pytest.raises(ValueError, match=r"^boom$"):
        _fit(driver, [rec], raise_at=2)
    assert rec.calls == [
        *OPENING,
        ("on_step_end", 1),
        ("on_error", "loop", "ValueError"),
        ("on_run_end", "loop", "failed", "ValueError: boom", None, "loop", ["loop"]),
        ("on_experiment_end", None, True, "failed", None, 1),
        ("close",),
    ]
    tb = rec.run_result.traceback
    assert tb is not None and tb.startswith("Traceback") and tb.endswith("ValueError: boom\n")


@pytest.mark.parametrize("driver", ["handle", "loop"])
def test_an_interrupted_bare_fit_ends_its_run_and_experiment_interrupted(driver: str) -> None:
    rec = Recorder()
    with pytest.raises(KeyboardInterrupt):
        _fit(driver, [rec], raise_at=2, exc=KeyboardInterrupt)
    error = "interrupted (KeyboardInterrupt)"
    assert rec.calls == [
        *OPENING,
        ("on_step_end", 1),
        ("on_error", "loop", "KeyboardInterrupt"),
        ("on_run_end", "loop", "failed", error, None, "loop", ["loop"]),
        ("on_experiment_end", None, True, "failed", error, 1),
        ("close",),
    ]


def test_without_run_dir_the_run_has_no_folder_and_writes_into_the_working_dir(
    tmp_path: Path,
) -> None:
    seen: list[tuple] = []

    class Where(Callback):
        def on_run_start(self, ctx: lab.LogContext) -> None:
            seen.append((ctx.run_key, ctx.run_dir, ctx.folder, ctx.output_dir))

    _fit("loop", [Where()])
    assert seen == [("loop", None, tmp_path, tmp_path)]  # the working directory (conftest)
    assert os.listdir(tmp_path) == []  # no ./loop, nothing else either


def test_with_run_dir_the_run_is_that_folder(tmp_path: Path) -> None:
    seen: list[tuple] = []

    class Where(Callback):
        def on_run_start(self, ctx: lab.LogContext) -> None:
            seen.append((ctx.run_key, ctx.run_dir, ctx.folder, ctx.output_dir))

    _fit("handle", [Where()], run_dir=tmp_path / "runs" / "mine")
    runs = tmp_path / "runs"
    assert seen == [("mine", runs / "mine", runs / "mine", runs)]


def test_a_bare_fit_leaves_the_callers_rng_alone() -> None:
    model, opt = _model_and_opt()
    torch.manual_seed(1234)
    random.seed(1234)
    before = torch.get_rng_state(), random.getstate()
    with RunHandle(None, model, opt, num_steps=2, callbacks=[Recorder()]) as loop:
        for step in loop.steps():  # a hand-written loop that draws nothing: nor does the fit
            loop.end_step({"loss": 1.0 / step})
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]


# --------------------------------------------------------------------------------------------
# failure policy, as in an Experiment


class CriticalAt(Callback):
    """A critical callback (as SqlLogger is) that raises in one hook and records the others."""

    critical = True

    def __init__(self, hook: str) -> None:
        self.hook = hook
        self.calls: list[str] = []

    def _call(self, hook: str) -> None:
        self.calls.append(hook)
        if hook == self.hook:
            raise RuntimeError(f"store down in {hook}")

    def on_experiment_start(self, ctx: lab.LogContext) -> None:
        self._call("on_experiment_start")

    def on_run_start(self, ctx: lab.LogContext) -> None:
        self._call("on_run_start")

    def on_train_start(self, state: lab.LoopState) -> None:
        self._call("on_train_start")

    def on_error(self, ctx: lab.LogContext, exc: BaseException) -> None:
        self._call("on_error")

    def on_run_end(self, ctx: lab.LogContext, run_result: lab.RunResult, arm: Any) -> None:
        self._call("on_run_end")

    def on_experiment_end(self, ctx: lab.LogContext, result: lab.ExperimentResult) -> None:
        self._call("on_experiment_end")

    def close(self) -> None:
        self._call("close")


@pytest.mark.parametrize("driver", ["handle", "loop"])
def test_a_critical_callback_raising_in_on_run_start_fails_the_fit(driver: str) -> None:
    critical, rec = CriticalAt("on_run_start"), Recorder()
    with pytest.raises(RuntimeError, match=r"^store down in on_run_start$"):
        _fit(driver, [critical, rec])
    # it has not started the run: none of the run's other hooks reach it
    assert critical.calls == ["on_experiment_start", "on_run_start", "on_experiment_end", "close"]
    assert rec.calls == [
        *OPENING[:3],
        ("on_error", "loop", "RuntimeError"),
        ("on_run_end", "loop", "failed", "RuntimeError: store down in on_run_start", None,
         "loop", ["loop"]),
        ("on_experiment_end", None, True, "failed", None, 1),
        ("close",),
    ]  # fmt: skip


def test_settings_a_fit_cannot_run_with_fail_it_before_any_hook_but_close(
    store: Store, store_url: str
) -> None:
    rec = Recorder()
    model, opt = _model_and_opt()
    loop = TrainingLoop(
        model, opt, DATA, _mse, 3, checkpoint=lab.CheckpointConfig(every=1),
        callbacks=[rec, SqlLogger(store_url)],
    )  # fmt: skip
    with pytest.raises(lab.errors.ConfigError, match=r"^checkpoints need a folder"):
        loop.fit()
    assert rec.calls == [("close",)]
    # `store` migrated the database, so the empty table can be counted: nothing recorded
    assert _rows(store_url, "SELECT count(*) AS n FROM experiments") == [{"n": 0}]


def test_a_critical_callback_raising_in_on_group_start_fails_the_experiment() -> None:
    class NoGroup(Callback):
        critical = True

        def on_group_start(self, ctx: lab.LogContext, group_name: str) -> None:
            raise RuntimeError("no group")

    rec = Recorder()
    with pytest.raises(RuntimeError, match=r"^no group$"):
        _fit("handle", [NoGroup(), rec])
    assert rec.calls == [
        *OPENING[:2],
        ("on_experiment_end", None, True, "failed", "RuntimeError: no group", 0),
        ("close",),
    ]


def test_on_error_stays_isolated_from_a_critical_callback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LAB_STRICT", "0")
    critical, rec = CriticalAt("on_error"), Recorder()
    with pytest.raises(ValueError, match=r"^boom$"):  # the fit's error, not the callback's
        _fit("handle", [critical, rec], raise_at=2)
    assert critical.calls == [
        "on_experiment_start", "on_run_start", "on_train_start", "on_error", "on_run_end",
        "on_experiment_end", "close",
    ]  # fmt: skip
    assert [(e["callback"], e["hook"]) for e in rec.run_result.callback_errors] == [
        ("CriticalAt", "on_error")
    ]
    assert rec.run_result.error == "ValueError: boom"


def test_a_run_end_a_critical_callback_cannot_record_fails_the_fit_after_it_ended() -> None:
    critical, rec = CriticalAt("on_run_end"), Recorder()
    with pytest.raises(RuntimeError, match=r"^store down in on_run_end$"):
        _fit("handle", [critical, rec])
    # the others got on_run_end with the run as it ended training, then the experiment ended
    assert rec.calls[-3:] == [
        ("on_run_end", "loop", "completed", None, 1 / 3, "loop", ["loop"]),
        ("on_experiment_end", None, True, "failed", None, 1),
        ("close",),
    ]
    assert rec.result.runs[0].error == "RuntimeError: store down in on_run_end"
    assert critical.calls[-3:] == ["on_run_end", "on_experiment_end", "close"]


def test_strict_mode_callback_error_propagates_and_close_still_fires() -> None:
    class Bad(Callback):
        def on_run_end(self, ctx: lab.LogContext, run_result: lab.RunResult, arm: Any) -> None:
            raise KeyError("oops")

    rec = Recorder()
    with pytest.raises(CallbackError, match=r"^Bad.on_run_end raised KeyError\('oops'\)$"):
        _fit("handle", [Bad(), rec])  # conftest sets LAB_STRICT=1
    assert rec.calls[-2:] == [("on_train_end", 3, False), ("close",)]


def test_a_disabled_callback_still_gets_the_ending_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAB_STRICT", "0")

    class Broken(Recorder):
        max_failures = 2

        def on_step_end(self, state: lab.LoopState, step_idx: int, batch: Any, m: dict) -> None:
            self.calls.append(("on_step_end", step_idx))
            raise RuntimeError("broken")

    broken = Broken()
    _fit("handle", [broken])
    assert [c[0] for c in broken.calls] == [
        "on_experiment_start", "on_group_start", "on_run_start", "on_train_start",
        "on_step_end", "on_step_end",  # then disabled for the run
        "on_train_end", "on_run_end", "on_experiment_end", "close",
    ]  # fmt: skip
    (failure,) = broken.run_result.callback_errors
    assert (failure["hook"], failure["count"], failure["disabled"]) == ("on_step_end", 2, True)


# --------------------------------------------------------------------------------------------
# the store's records of a bare fit


def _rows(url: str, sql: str) -> list[dict[str, Any]]:
    engine = sa.create_engine(resolve_url(url))
    try:
        with engine.connect() as conn:
            return [dict(r) for r in conn.execute(sa.text(sql)).mappings()]
    finally:
        engine.dispose()


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


@pytest.mark.parametrize("driver", ["handle", "loop"])
def test_a_bare_fit_records_its_experiment_group_and_run(
    driver: str, store_url: str, tmp_path: Path
) -> None:
    artifacts = _fit(driver, [SqlLogger(store_url)], run_dir=tmp_path / "fit")
    (exp,) = _rows(store_url, "SELECT experiment_id, name, status, seed, repeats FROM experiments")
    assert re.fullmatch(NAME, exp["name"])
    assert (exp["status"], exp["seed"], exp["repeats"]) == ("completed", 0, 1)
    assert _rows(store_url, "SELECT count(*) AS n FROM arms") == [{"n": 0}]
    (group,) = _rows(store_url, "SELECT group_id, name, kind, arm_id FROM groups")
    assert (group["name"], group["kind"], group["arm_id"]) == ("loop", "repeats", None)
    (run,) = _rows(
        store_url,
        "SELECT experiment_id, group_id, run_key, arm_id, repeat, stage, seed, config, status,"
        " error, summary, callback_errors, output_dir, provenance FROM runs",
    )
    assert (run["experiment_id"], run["group_id"]) == (exp["experiment_id"], group["group_id"])
    assert (run["run_key"], run["arm_id"], run["repeat"], run["stage"], run["seed"]) == (
        "fit", None, 0, 0, 0,
    )  # fmt: skip
    assert (_json(run["config"]), run["status"], run["error"]) == ({}, "completed", None)
    assert _json(run["summary"]) == artifacts.metrics
    assert run["callback_errors"] is None  # none failed
    assert run["output_dir"] == str((tmp_path / "fit").resolve())
    assert "git" in _json(run["provenance"])


def test_a_failed_bare_fit_records_its_run_failed(store_url: str) -> None:
    with pytest.raises(ValueError, match=r"^boom$"):
        _fit("loop", [SqlLogger(store_url)], raise_at=3)
    (exp,) = _rows(store_url, "SELECT status FROM experiments")
    assert exp == {"status": "failed"}
    (run,) = _rows(store_url, "SELECT run_key, status, error, traceback, output_dir FROM runs")
    assert (run["run_key"], run["status"], run["error"]) == ("loop", "failed", "ValueError: boom")
    assert run["traceback"].endswith("ValueError: boom\n")
    assert run["output_dir"] is None  # no folder of its own
    steps = _rows(store_url, "SELECT DISTINCT step FROM metrics ORDER BY step")
    assert [s["step"] for s in steps] == [1, 2]
