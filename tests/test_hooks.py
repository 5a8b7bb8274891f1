"""The hook contract: which hooks exist, when each fires, in what order, and how errors travel."""

from __future__ import annotations

import inspect
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import lab
from lab import (
    Arm,
    Callback,
    CheckpointConfig,
    EvalResult,
    Evaluator,
    Experiment,
    LoopArtifacts,
    TrainingLoop,
)
from lab.dispatch import CallbackFailure, Dispatcher
from lab.errors import CallbackError, ConfigError
from lab.hooks import HOOKS

NUM_STEPS = 4

# --------------------------------------------------------------------------------------------
# helpers


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, generator=g)
    return [(x[:4], x[:4].sum(1, keepdim=True)), (x[4:], x[4:].sum(1, keepdim=True))]


def _loop(num_steps: int = NUM_STEPS, **kwargs: Any) -> TrainingLoop:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainingLoop(model, opt, _data(), _mse, num_steps, **kwargs)


class Recorder(Callback):
    """Overrides every hook and records (hook, key arguments)."""

    def __init__(self, calls: list[tuple] | None = None) -> None:
        self.calls: list[tuple] = [] if calls is None else calls

    def on_experiment_start(self, ctx: lab.LogContext) -> None:
        self.calls.append(("on_experiment_start", ctx.experiment, ctx.run_key))

    def on_group_start(self, ctx: lab.LogContext, group_name: str) -> None:
        self.calls.append(("on_group_start", group_name, ctx.group_name))

    def on_run_start(self, ctx: lab.LogContext) -> None:
        self.calls.append(("on_run_start", ctx.run_key, ctx.arm, ctx.repeat, ctx.seed))

    def post_checkpoint_loaded(self, state: lab.LoopState, path: Path) -> None:
        self.calls.append(("post_checkpoint_loaded", state.ctx.run_key, str(path)))

    def on_train_start(self, state: lab.LoopState) -> None:
        self.calls.append(("on_train_start", state.ctx.run_key, state.step))

    def on_epoch_start(self, state: lab.LoopState, epoch: int) -> None:
        self.calls.append(("on_epoch_start", state.ctx.run_key, epoch))

    def on_episode_start(self, state: lab.LoopState, episode: int) -> None:
        self.calls.append(("on_episode_start", state.ctx.run_key, episode))

    def on_make_experience_start(self, state: lab.LoopState, episode: int) -> None:
        self.calls.append(("on_make_experience_start", state.ctx.run_key, episode))

    def on_make_experience_end(self, state: lab.LoopState, episode: int, experience: Any) -> None:
        self.calls.append(("on_make_experience_end", state.ctx.run_key, episode, experience.size))

    def on_learn_epoch_start(self, state: lab.LoopState, epoch: int) -> None:
        self.calls.append(("on_learn_epoch_start", state.ctx.run_key, epoch))

    def on_learn_batch_start(self, state: lab.LoopState, step_idx: int, batch: Any) -> None:
        assert state.step == step_idx - 1
        self.calls.append(("on_learn_batch_start", state.ctx.run_key, step_idx, batch.size))

    def on_learn_batch_end(
        self, state: lab.LoopState, step_idx: int, batch: Any, metrics: dict
    ) -> None:
        assert state.step == step_idx
        self.calls.append(("on_learn_batch_end", state.ctx.run_key, step_idx, batch.size))

    def on_learn_epoch_end(self, state: lab.LoopState, epoch: int) -> None:
        self.calls.append(("on_learn_epoch_end", state.ctx.run_key, epoch))

    def on_episode_end(self, state: lab.LoopState, episode: int) -> None:
        self.calls.append(("on_episode_end", state.ctx.run_key, episode))

    def pre_step(self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch) -> None:
        # before step k runs, k - 1 steps are complete
        assert state.step == step_idx - 1
        self.calls.append(("pre_step", state.ctx.run_key, step_idx))

    def on_step_end(
        self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch, metrics: dict
    ) -> None:
        assert state.step == step_idx
        self.calls.append(("on_step_end", state.ctx.run_key, step_idx))

    def on_media(self, state: lab.LoopState, step_idx: int, media: Any) -> None:
        self.calls.append(("on_media", state.ctx.run_key, step_idx, sorted(media)))

    def on_eval(self, state: lab.LoopState, step_idx: int, eval_name: str, metrics: dict) -> None:
        self.calls.append(("on_eval", state.ctx.run_key, step_idx, eval_name))

    def on_benchmark_eval(
        self,
        ctx: lab.LogContext,
        eval_result: EvalResult,
        predictions: list[dict],
        *,
        step: int | None = None,
    ) -> None:
        self.calls.append(
            ("on_benchmark_eval", ctx.run_key, eval_result.name, step, len(predictions))
        )

    def on_checkpoint(self, state: lab.LoopState, row: lab.ManifestRow) -> None:
        self.calls.append(("on_checkpoint", state.ctx.run_key, row.event, row.step))

    def on_epoch_end(self, state: lab.LoopState, epoch: int) -> None:
        self.calls.append(("on_epoch_end", state.ctx.run_key, epoch))

    def on_train_end(self, state: lab.LoopState, artifacts: LoopArtifacts) -> None:
        self.calls.append(("on_train_end", state.ctx.run_key, artifacts.step, artifacts.stopped))

    def on_error(self, ctx: lab.LogContext, exc: BaseException) -> None:
        self.calls.append(("on_error", ctx.run_key, type(exc).__name__))

    def on_run_end(self, ctx: lab.LogContext, run_result: lab.RunResult, arm: Any) -> None:
        self.calls.append(("on_run_end", run_result.run_key, run_result.status, arm.name))

    def on_experiment_end(self, ctx: lab.LogContext, result: lab.ExperimentResult) -> None:
        self.calls.append(("on_experiment_end", ctx.run_key, len(result.runs)))

    def close(self) -> None:
        self.calls.append(("close",))


def _names(calls: list[tuple]) -> list[str]:
    return [c[0] for c in calls]


# --------------------------------------------------------------------------------------------
# the contract


def test_callback_methods_are_exactly_the_hooks() -> None:
    methods = {
        name
        for name, _ in inspect.getmembers(Callback, inspect.isfunction)
        if not name.startswith("_")
    } - {"state_dict", "load_state_dict"}
    assert methods == set(HOOKS)
    assert len(HOOKS) == len(set(HOOKS)) == 26


def test_lifecycle_docstring_names_every_hook_in_order() -> None:
    doc = lab.hooks.__doc__
    assert doc is not None
    positions = {}
    for hook in HOOKS:
        assert f"{hook}(" in doc, f"the lifecycle docstring does not mention {hook}"
        positions[hook] = doc.index(f"{hook}(")
    assert sorted(HOOKS, key=positions.__getitem__) == list(HOOKS)


_SEED_SIGNATURES = {
    # seed 003
    "on_train_start": ["state"],
    "on_train_end": ["state", "artifacts"],
    "on_step_end": ["state", "step_idx", "batch", "metrics"],
    "on_checkpoint": ["state", "row"],
    "on_eval": ["state", "step_idx", "eval_name", "metrics"],
    "on_experiment_start": ["ctx"],
    "on_group_start": ["ctx", "group_name"],
    "on_run_start": ["ctx"],
    "on_benchmark_eval": ["ctx", "eval_result", "predictions", "step"],
    "on_run_end": ["ctx", "run_result", "arm"],
    "on_experiment_end": ["ctx", "result"],
    # seed 000, adapted to take the loop state / context first
    "pre_step": ["state", "step_idx", "batch"],
    "post_checkpoint_loaded": ["state", "path"],
    # loops that count epochs, and non-scalar logging
    "on_epoch_start": ["state", "epoch"],
    "on_epoch_end": ["state", "epoch"],
    "on_media": ["state", "step_idx", "media"],
    "on_error": ["ctx", "exc"],
    "close": [],
    # seed 004 (ColossalChat's on-policy trainer), typed: the loop state first
    "on_episode_start": ["state", "episode"],
    "on_make_experience_start": ["state", "episode"],
    "on_make_experience_end": ["state", "episode", "experience"],
    "on_learn_epoch_start": ["state", "epoch"],
    "on_learn_batch_start": ["state", "step_idx", "batch"],
    "on_learn_batch_end": ["state", "step_idx", "batch", "metrics"],
    "on_learn_epoch_end": ["state", "epoch"],
    "on_episode_end": ["state", "episode"],
}


@pytest.mark.parametrize("hook", sorted(_SEED_SIGNATURES))
def test_hook_signatures_match_the_seed(hook: str) -> None:
    params = list(inspect.signature(getattr(Callback, hook)).parameters.values())
    assert params[0].name == "self"
    assert [p.name for p in params[1:]] == _SEED_SIGNATURES[hook]
    for p in params[1:]:
        if hook == "on_benchmark_eval" and p.name == "step":
            assert p.kind is inspect.Parameter.KEYWORD_ONLY
            assert p.default is None
        else:
            assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
            assert p.default is inspect.Parameter.empty


def test_seed_hooks_cover_every_hook() -> None:
    assert set(_SEED_SIGNATURES) == set(HOOKS)


# --------------------------------------------------------------------------------------------
# the full sequence


def _quiz(model: torch.nn.Module) -> EvalResult:
    preds = [{"example_id": f"q{i}", "output": "1", "target": "1", "score": 1.0} for i in range(2)]
    return EvalResult("quiz", {"acc": 1.0}, predictions=preds)


def _final_bench(model: torch.nn.Module) -> EvalResult:
    preds = [{"example_id": f"f{i}", "output": "1", "target": "0", "score": 0.0} for i in range(3)]
    return EvalResult("final", {"acc": 0.0}, predictions=preds)


def test_full_hook_sequence_two_arms_two_repeats() -> None:
    rec = Recorder()

    def train(run: lab.RunSpec) -> LoopArtifacts:
        loop = _loop(
            evaluators=[
                Evaluator("val", lambda m: {"loss": 0.5}, every=2),
                Evaluator("quiz", _quiz, every=2),
            ],
            checkpoint=CheckpointConfig(every=2),
        )
        return loop.fit(run)

    result = Experiment(
        "seq",
        train,
        arms=[Arm("a"), Arm("b")],
        repeats=2,
        seed=7,
        callbacks=[rec],
        store=False,
        benchmarks=[Evaluator("final", _final_bench)],
    ).run()

    expected: list[tuple] = [("on_experiment_start", "seq", None)]
    for arm in ("a", "b"):
        expected.append(("on_group_start", arm, arm))
        for repeat in (0, 1):
            key = f"{arm}-r{repeat}"
            expected.append(("on_run_start", key, arm, repeat, 7 + repeat))
            expected.append(("on_train_start", key, 0))
            for step in range(1, NUM_STEPS + 1):
                expected.append(("pre_step", key, step))
                expected.append(("on_step_end", key, step))
                if step % 2 == 0:
                    expected.append(("on_eval", key, step, "val"))
                    expected.append(("on_eval", key, step, "quiz"))
                    expected.append(("on_benchmark_eval", key, "quiz", step, 2))
                    expected.append(("on_checkpoint", key, "save", step))
            expected.append(("on_train_end", key, NUM_STEPS, False))
            expected.append(("on_benchmark_eval", key, "final", None, 3))
            expected.append(("on_run_end", key, "completed", arm))
    expected.append(("on_experiment_end", None, 4))
    expected.append(("close",))

    assert rec.calls == expected
    assert [r.status for r in result.runs] == ["completed"] * 4
    assert result.runs[0].metrics["final/acc"] == 0.0
    assert result.runs[0].metrics["quiz/acc"] == 1.0
    assert result.runs[0].metrics["val/loss"] == 0.5


def _bare_opening(calls: list[tuple], run_key: str) -> list[tuple]:
    """The hooks a bare fit fires before its loop's: an experiment of its own (its name
    checked here), group "loop", one run (no arm, repeat 0, not seeded)."""
    name = calls[0][1]
    assert re.fullmatch(r"loop-\d{8}-\d{6}-[0-9a-f]{6}", name), name
    return [
        ("on_experiment_start", name, None),
        ("on_group_start", "loop", "loop"),
        ("on_run_start", run_key, None, 0, None),
    ]


def _bare_closing(run_key: str, status: str) -> list[tuple]:
    """The hooks a bare fit fires after its loop's: the run's end, the experiment's, close."""
    return [("on_run_end", run_key, status, "loop"), ("on_experiment_end", None, 1), ("close",)]


def test_bare_loop_fires_the_whole_lifecycle_around_its_loop(tmp_path: Path) -> None:
    rec = Recorder()
    loop = _loop(
        num_steps=2,
        evaluators=[Evaluator("val", lambda m: {"loss": 1.0}, at_end=True)],
        checkpoint=CheckpointConfig(every=None),
        callbacks=[rec],
    )
    loop.fit(run_dir=tmp_path / "bare")
    assert rec.calls == [
        *_bare_opening(rec.calls, "bare"),
        ("on_train_start", "bare", 0),
        ("pre_step", "bare", 1),
        ("on_step_end", "bare", 1),
        ("pre_step", "bare", 2),
        ("on_step_end", "bare", 2),
        ("on_eval", "bare", 2, "val"),
        ("on_checkpoint", "bare", "save", 2),
        ("on_train_end", "bare", 2, False),
        *_bare_closing("bare", "completed"),
    ]


def test_bare_loop_error_fires_on_error_then_ends_the_run_failed() -> None:
    rec = Recorder()

    def bad_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return model(batch[0])  # shape (4, 1): not a scalar

    model = torch.nn.Linear(2, 1)
    loop = TrainingLoop(
        model, torch.optim.SGD(model.parameters(), lr=0.1), _data(), bad_loss, 3, callbacks=[rec]
    )
    with pytest.raises(lab.errors.LossError):
        loop.fit()
    assert rec.calls == [
        *_bare_opening(rec.calls, "loop"),
        ("on_train_start", "loop", 0),
        ("pre_step", "loop", 1),
        ("on_error", "loop", "LossError"),
        *_bare_closing("loop", "failed"),
    ]


# --------------------------------------------------------------------------------------------
# priority


def _prioritized(name: str, prio: int, log: list[str]) -> Callback:
    cls = type(
        name,
        (Callback,),
        {
            "priority": prio,
            "on_step_end": lambda self, state, step_idx, batch, metrics: log.append(name),
            "on_experiment_start": lambda self, ctx: log.append(name),
        },
    )
    return cls()


def test_priority_higher_first_ties_in_attachment_order() -> None:
    log: list[str] = []
    cbs = [
        _prioritized("A", 0, log),
        _prioritized("B", 5, log),
        _prioritized("C", 0, log),
        _prioritized("D", -1, log),
        _prioritized("E", 5, log),
    ]
    d = Dispatcher(cbs)
    assert [type(cb).__name__ for cb in d.callbacks] == ["B", "E", "A", "C", "D"]
    d.fire("on_experiment_start", None)
    assert log == ["B", "E", "A", "C", "D"]

    log.clear()
    _loop(num_steps=2, callbacks=cbs).fit()  # a bare fit's experiment start, and two steps
    assert log == ["B", "E", "A", "C", "D"] * 3


def test_priority_merges_experiment_and_loop_callbacks() -> None:
    log: list[str] = []
    exp_cbs = [_prioritized("ExpLow", 0, log), _prioritized("ExpHigh", 3, log)]
    loop_cbs = [_prioritized("LoopMid", 1, log), _prioritized("LoopLow", 0, log)]

    def train(run: lab.RunSpec) -> LoopArtifacts:
        return _loop(num_steps=1, callbacks=loop_cbs).fit(run)

    Experiment("prio", train, callbacks=exp_cbs, store=False).run()
    # on_experiment_start: only the experiment's callbacks; on_step_end: all four
    assert log == ["ExpHigh", "ExpLow", "ExpHigh", "LoopMid", "ExpLow", "LoopLow"]


# --------------------------------------------------------------------------------------------
# listeners


class OnlyStepEnd(Callback):
    def on_step_end(
        self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch, metrics: dict
    ) -> None:
        pass


class InheritsStepEnd(OnlyStepEnd):
    pass


def test_only_overridden_hooks_are_listened_to() -> None:
    only, inherits, full = OnlyStepEnd(), InheritsStepEnd(), Recorder()
    d = Dispatcher([only, inherits, full])
    assert [name for name, _, _ in d._listeners["on_step_end"]] == [
        "OnlyStepEnd",
        "InheritsStepEnd",
        "Recorder",
    ]
    bound = [m for _, m, _ in d._listeners["on_step_end"]]
    assert [m.__self__ for m in bound] == [only, inherits, full]
    for hook in HOOKS:
        if hook != "on_step_end":
            assert [name for name, _, _ in d._listeners[hook]] == ["Recorder"], hook
    assert set(d._listeners) == set(HOOKS)

    lonely = Dispatcher([only])
    assert lonely.listens("on_step_end")
    assert not lonely.listens("pre_step")
    assert not lonely.listens("close")
    assert not Dispatcher([]).listens("on_step_end")


def test_non_callback_is_rejected() -> None:
    with pytest.raises(ConfigError) as info:
        Dispatcher([42])  # type: ignore[list-item]
    assert str(info.value) == (
        "42 is not a lab.Callback; subclass lab.Callback (and override the hooks you need) "
        "to attach it"
    )
    assert isinstance(info.value, ValueError) and not isinstance(info.value, TypeError)


def test_debug_hooks_logs_every_dispatch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("LAB_DEBUG_HOOKS", "1")
    d = Dispatcher([OnlyStepEnd()])
    with caplog.at_level(logging.DEBUG, logger="lab.hooks"):
        d.fire("on_step_end", None, 1, None, {})
        d.fire("pre_step", None, 1, None)  # nobody listens: nothing to log
    assert [r.getMessage() for r in caplog.records] == ["hook on_step_end -> OnlyStepEnd"]


# --------------------------------------------------------------------------------------------
# error isolation and strict mode


class Boom(Callback):
    priority = 10

    def on_step_end(
        self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch, metrics: dict
    ) -> None:
        raise RuntimeError(f"boom {step_idx}")


class BoomAtRunEnd(Callback):
    def on_run_end(self, ctx: lab.LogContext, run_result: lab.RunResult, arm: Any) -> None:
        raise KeyError("late")


class StepLog(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(
        self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch, metrics: dict
    ) -> None:
        self.steps.append(step_idx)


def test_dispatcher_isolates_and_counts_failures() -> None:
    after = StepLog()
    d = Dispatcher([after, Boom()], strict=False)  # Boom has the higher priority: runs first
    d.fire("on_step_end", None, 1, None, {})
    d.fire("on_step_end", None, 2, None, {})
    d.run_key = "r1"
    d.fire("on_step_end", None, 3, None, {})
    assert d.failure_counts == {("Boom", "on_step_end"): 3}
    # one record per (run, callback, hook): the first error and traceback, then a count
    assert [(f.callback, f.hook, f.error, f.run_key, f.count) for f in d.failures] == [
        ("Boom", "on_step_end", "RuntimeError: boom 1", None, 2),
        ("Boom", "on_step_end", "RuntimeError: boom 3", "r1", 1),
    ]
    assert all(isinstance(f, CallbackFailure) for f in d.failures)
    assert "RuntimeError: boom 1" in d.failures[0].traceback
    assert d.failures[0].to_dict() == {
        "callback": "Boom",
        "hook": "on_step_end",
        "error": "RuntimeError: boom 1",
        "traceback": d.failures[0].traceback,
        "count": 2,
    }
    assert after.steps == [1, 2, 3]


def test_a_callback_failing_every_step_is_recorded_once_and_counted(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAB_CALLBACK_MAX_FAILURES", "0")  # never disabled: every failure counts
    dispatchers: list[Dispatcher] = []

    def train(run: lab.RunSpec) -> LoopArtifacts:
        dispatchers.append(run.dispatcher)
        return _loop(num_steps=30).fit(run)

    with caplog.at_level(logging.DEBUG, logger="lab.hooks"):
        result = Experiment("flood", train, callbacks=[Boom()], store=False, strict=False).run()
    (run,) = result.runs
    assert run.status == "completed"
    assert dispatchers[0].failure_counts == {("Boom", "on_step_end"): 30}
    assert [(f.run_key, f.count) for f in dispatchers[0].failures] == [("base-r0", 30)]
    rows = run.callback_errors
    assert [{k: v for k, v in e.items() if k != "traceback"} for e in rows] == [
        {"callback": "Boom", "hook": "on_step_end", "error": "RuntimeError: boom 1", "count": 30}
    ]
    assert "RuntimeError: boom 1" in rows[0]["traceback"]
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "lab.hooks"]
    assert len(records) == 2
    assert records[0][0] == logging.ERROR
    assert records[0][1].startswith("callback Boom.on_step_end raised; the run goes on")
    assert "RuntimeError: boom 1" in records[0][1]  # the traceback, once
    assert records[1] == (
        logging.WARNING,
        "callback Boom.on_step_end has now failed 10 times in run base-r0",
    )


def test_failure_warnings_come_at_each_power_of_ten(caplog: pytest.LogCaptureFixture) -> None:
    d = Dispatcher([Boom()], strict=False, max_failures=None)
    d.run_key = "k"
    with caplog.at_level(logging.WARNING, logger="lab.hooks"):
        for step in range(1, 1001):
            d.fire("on_step_end", None, step, None, {})
    assert d.failure_counts == {("Boom", "on_step_end"): 1000}
    assert [f.count for f in d.failures] == [1000]
    assert [r.levelno for r in caplog.records] == [logging.ERROR] + [logging.WARNING] * 3
    assert [r.getMessage() for r in caplog.records[1:]] == [
        f"callback Boom.on_step_end has now failed {n} times in run k" for n in (10, 100, 1000)
    ]


def test_strict_false_isolates_callback_errors_in_an_experiment() -> None:
    later = StepLog()
    dispatchers: list[Dispatcher] = []

    def train(run: lab.RunSpec) -> LoopArtifacts:
        dispatchers.append(run.dispatcher)
        return _loop(num_steps=3).fit(run)

    result = Experiment(
        "iso",
        train,
        repeats=2,
        callbacks=[later, Boom(), BoomAtRunEnd()],
        store=False,
        strict=False,
    ).run()

    assert [r.status for r in result.runs] == ["completed", "completed"]
    assert later.steps == [1, 2, 3, 1, 2, 3]  # the lower-priority callback still ran each time
    assert dispatchers[0] is dispatchers[1]
    assert dispatchers[0].failure_counts == {
        ("Boom", "on_step_end"): 6,
        ("BoomAtRunEnd", "on_run_end"): 2,
    }
    for run in result.runs:
        errors = run.callback_errors
        assert [(e["callback"], e["hook"], e["error"], e["count"]) for e in errors] == [
            ("Boom", "on_step_end", "RuntimeError: boom 1", 3),
            ("BoomAtRunEnd", "on_run_end", "KeyError: 'late'", 1),
        ]
        assert all("Traceback" in e["traceback"] for e in run.callback_errors)


def test_a_loop_callback_failing_in_close_is_kept_on_its_run() -> None:
    class CloseBoom(Callback):
        def close(self) -> None:
            raise RuntimeError("cannot close")

    holders: list[Dispatcher] = []

    def train(run: lab.RunSpec) -> LoopArtifacts:
        holders.append(run.dispatcher)
        return _loop(num_steps=1, callbacks=[CloseBoom()]).fit(run)

    result = Experiment("own", train, repeats=2, store=False, strict=False).run()
    assert holders[0].failure_counts == {("CloseBoom", "close"): 2}
    assert [(f.run_key, f.hook, f.count) for f in holders[0].failures] == [
        ("base-r0", "close", 1),
        ("base-r1", "close", 1),
    ]
    for run in result.runs:
        assert [(e["callback"], e["hook"], e["count"]) for e in run.callback_errors] == [
            ("CloseBoom", "close", 1)
        ]


def test_strict_false_callback_error_in_on_run_start_is_kept_on_the_run() -> None:
    class Broken(Callback):
        def on_run_start(self, ctx: lab.LogContext) -> None:
            raise RuntimeError("oops")

    result = Experiment(
        "iso2", lambda run: {"loss": 1.0}, callbacks=[Broken()], store=False, strict=False
    ).run()
    (run,) = result.runs
    assert run.status == "completed"
    assert run.metrics == {"loss": 1.0}
    assert [(e["callback"], e["hook"], e["error"], e["count"]) for e in run.callback_errors] == [
        ("Broken", "on_run_start", "RuntimeError: oops", 1)
    ]


def test_strict_mode_reraises_as_callback_error() -> None:
    rec = Recorder()
    trained: list[str] = []

    def train(run: lab.RunSpec) -> LoopArtifacts:
        trained.append(run.run_key)
        return _loop(num_steps=3).fit(run)

    exp = Experiment("strict", train, repeats=2, callbacks=[Boom(), rec], store=False)
    with pytest.raises(CallbackError) as info:
        exp.run()  # LAB_STRICT=1 from conftest
    assert str(info.value) == "Boom.on_step_end raised RuntimeError('boom 1')"
    assert isinstance(info.value.__cause__, RuntimeError)
    assert trained == ["base-r0"]  # a callback bug stops the experiment, not just the run
    assert rec.calls == [
        ("on_experiment_start", "strict", None),
        ("on_group_start", "base", "base"),
        ("on_run_start", "base-r0", "base", 0, 0),
        ("on_train_start", "base-r0", 0),
        ("pre_step", "base-r0", 1),
        ("close",),
    ]


def test_strict_argument_overrides_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAB_STRICT", "0")
    assert Dispatcher([Boom()]).strict is False
    with pytest.raises(CallbackError):
        Experiment(
            "s",
            lambda run: _loop(num_steps=1).fit(run),
            callbacks=[Boom()],
            store=False,
            strict=True,
        ).run()
    monkeypatch.setenv("LAB_STRICT", "1")
    result = Experiment(
        "s2", lambda run: _loop(num_steps=1).fit(run), callbacks=[Boom()], store=False, strict=False
    ).run()
    assert result.runs[0].status == "completed"
    assert len(result.runs[0].callback_errors) == 1


def test_bare_loop_follows_lab_strict_env(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CallbackError):
        _loop(num_steps=2, callbacks=[Boom()]).fit()
    monkeypatch.setenv("LAB_STRICT", "0")
    artifacts = _loop(num_steps=2, callbacks=[Boom()]).fit()
    assert artifacts.step == 2


# --------------------------------------------------------------------------------------------
# request_stop


class StopAt(Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(
        self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch, metrics: dict
    ) -> None:
        if step_idx == self.at:
            state.request_stop("enough")


def test_request_stop_ends_after_the_current_step() -> None:
    rec = Recorder()

    def train(run: lab.RunSpec) -> LoopArtifacts:
        loop = _loop(num_steps=10, checkpoint=CheckpointConfig(every=5, save_at_end=True))
        return loop.fit(run)

    result = Experiment("stop", train, callbacks=[StopAt(3), rec], store=False).run()
    loop_calls = [c for c in rec.calls if c[0] not in {"on_experiment_start", "on_group_start"}]
    assert loop_calls == [
        ("on_run_start", "base-r0", "base", 0, 0),
        ("on_train_start", "base-r0", 0),
        ("pre_step", "base-r0", 1),
        ("on_step_end", "base-r0", 1),
        ("pre_step", "base-r0", 2),
        ("on_step_end", "base-r0", 2),
        ("pre_step", "base-r0", 3),
        ("on_step_end", "base-r0", 3),
        ("on_checkpoint", "base-r0", "save", 3),  # the final save, though every=5
        ("on_train_end", "base-r0", 3, True),
        ("on_run_end", "base-r0", "stopped", "base"),
        ("on_experiment_end", None, 1),
        ("close",),
    ]
    (run,) = result.runs
    assert run.status == "stopped"
    assert run.artifacts is not None
    assert run.artifacts.stopped is True
    assert run.artifacts.stop_reason == "enough"
    assert run.artifacts.step == 3
    assert [r.step for r in run.artifacts.checkpoints] == [3]
    assert (run.artifacts.checkpoint_dir / "step_000003" / "COMPLETE").exists()
    assert "loss" in run.metrics
    assert result.status == "completed"  # stopped is not failed


def test_request_stop_without_save_at_end_saves_nothing_extra(tmp_path: Path) -> None:
    loop = _loop(
        num_steps=10,
        checkpoint=CheckpointConfig(every=2, save_at_end=False),
        callbacks=[StopAt(3)],
    )
    artifacts = loop.fit(run_dir=tmp_path / "r")
    assert artifacts.stopped is True
    assert artifacts.step == 3
    assert [(r.event, r.step) for r in artifacts.checkpoints] == [("save", 2)]


def test_request_stop_on_a_due_step_saves_once(tmp_path: Path) -> None:
    loop = _loop(num_steps=10, checkpoint=CheckpointConfig(every=2), callbacks=[StopAt(4)])
    artifacts = loop.fit(run_dir=tmp_path / "r")
    assert [(r.event, r.step) for r in artifacts.checkpoints] == [("save", 2), ("save", 4)]
    assert artifacts.step == 4


# --------------------------------------------------------------------------------------------
# the on-policy RL phases, inside the run


def test_rl_hook_sequence_inside_the_run() -> None:
    from lab.rl import Experience, OnPolicyLoop, Rollouts

    rec = Recorder()

    def train(run: lab.RunSpec) -> LoopArtifacts:
        torch.manual_seed(0)
        policy = torch.nn.Linear(2, 1)

        def make_experience(info: Any) -> Experience:
            obs = torch.randn(4, 2)
            return Experience(
                action_log_probs=policy(obs).squeeze(1), rewards=torch.ones(4), observations=obs
            )

        def learn(batch: Experience, info: Any) -> dict[str, Any]:
            return {"loss": policy(batch.observations).pow(2).mean()}

        loop = OnPolicyLoop(
            policy,
            torch.optim.SGD(policy.parameters(), lr=0.1),
            num_episodes=2,
            make_experience=make_experience,
            learn=learn,
            learn_epochs=2,
            batch_size=2,
            rollouts=Rollouts(size=2),
            checkpoint=CheckpointConfig(every=1),
        )
        return loop.fit(run)

    Experiment("rl-seq", train, callbacks=[rec], store=False, seed=1).run()
    key = "base-r0"
    expected: list[tuple] = [
        ("on_experiment_start", "rl-seq", None),
        ("on_group_start", "base", "base"),
        ("on_run_start", key, "base", 0, 1),
        ("on_train_start", key, 0),
    ]
    step = 0
    for episode in range(2):
        expected += [
            ("on_episode_start", key, episode),
            ("on_make_experience_start", key, episode),
            ("on_make_experience_end", key, episode, 4),
            ("on_eval", key, step, "rollouts"),  # at the step of the policy that acted
            ("on_benchmark_eval", key, "rollouts", step, 2),
        ]
        for epoch in range(2):
            expected.append(("on_learn_epoch_start", key, epoch))
            for batch in range(2):
                step += 1
                expected += [
                    ("on_learn_batch_start", key, step, 2),
                    ("pre_step", key, step),
                    ("on_step_end", key, step),
                ]
                if epoch == 1 and batch == 1:  # the episode's boundary: its save
                    expected.append(("on_checkpoint", key, "save", step))
                expected.append(("on_learn_batch_end", key, step, 2))
            expected.append(("on_learn_epoch_end", key, epoch))
        expected.append(("on_episode_end", key, episode))
    expected += [
        ("on_train_end", key, 8, False),
        ("on_run_end", key, "completed", "base"),
        ("on_experiment_end", None, 1),
        ("close",),
    ]
    assert rec.calls == expected
