"""Evaluators and benchmarks, from the loop's hooks to the rows DuckDB reads back.

The loop's side: when evaluators run, in what mode, which hooks fire with what, and that a
failing one is recorded and training goes on. The store's side: eval and prediction rows on
SQLite and PostgreSQL, written through the real hooks or through `Store.write_eval`, and read
back through `lab.inspect.connect`, the way a notebook reads them.
"""

from __future__ import annotations

import ast
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import torch

import lab.inspect
from lab import (
    Callback,
    EvalResult,
    Evaluator,
    Experiment,
    LogContext,
    LoopArtifacts,
    LoopState,
    RunSpec,
    SqlLogger,
    Store,
    TrainingLoop,
)
from lab.errors import ConfigError

NAP_S = 0.02  # what a timed eval sleeps: its recorded seconds must cover it


# --------------------------------------------------------------------------------------------
# helpers


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, generator=g)
    return [(x[:4], x[:4].sum(1, keepdim=True)), (x[4:], x[4:].sum(1, keepdim=True))]


def _loop(num_steps: int, evaluators: list[Evaluator], **kw: Any) -> TrainingLoop:
    torch.manual_seed(0)
    model = kw.pop("model", None) or torch.nn.Linear(2, 1)
    loss_fn = kw.pop("loss_fn", _mse)
    return TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        _data(),
        loss_fn,
        num_steps,
        evaluators=evaluators,
        **kw,
    )


class EvalLog(Callback):
    """Keeps every eval hook call, with what each received."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.results: list[tuple[EvalResult, list[dict], int | None]] = []

    def on_step_end(self, state: LoopState, step_idx: int, batch: Any, metrics: dict) -> None:
        self.calls.append(("step", step_idx))

    def on_eval(self, state: LoopState, step_idx: int, eval_name: str, metrics: dict) -> None:
        self.calls.append(("on_eval", step_idx, eval_name, dict(metrics)))

    def on_benchmark_eval(
        self,
        ctx: LogContext,
        eval_result: EvalResult,
        predictions: list[dict],
        *,
        step: int | None = None,
    ) -> None:
        self.calls.append(("on_benchmark_eval", eval_result.name, step, eval_result.error))
        self.results.append((eval_result, predictions, step))


def _bench(name: str = "bench", *, nap: float = 0.0) -> Any:
    """A benchmark fn: two scored examples, a breakdown by slice, tags."""

    def fn(model: torch.nn.Module) -> EvalResult:
        time.sleep(nap)
        out = model(torch.ones(2, 2)).squeeze(1)
        preds = [
            {"example_id": f"e{i}", "input": [1.0, 1.0], "output": out[i].item(), "target": 2.0,
             "score": float(i), "slice": "small" if i == 0 else "large"}
            for i in range(2)
        ]  # fmt: skip
        return EvalResult(
            name,
            {"acc": 0.5, "n": torch.tensor(2)},
            breakdowns={"small": {"acc": 0.0}, "large": {"acc": torch.tensor(1.0)}},
            tags={"suite": "unit", "version": 2},
            predictions=preds,
        )

    return fn


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


# --------------------------------------------------------------------------------------------
# when evaluators run, and in which mode


def test_evaluators_run_every_n_at_fixed_steps_at_start_and_at_end() -> None:
    log = EvalLog()
    _loop(
        5,
        [
            Evaluator("every2", lambda m: {"a": 1.0}, every=2),
            Evaluator("fixed", lambda m: {"b": 2.0}, at_steps=[0, 3]),
            Evaluator("edges", lambda m: {"c": 3.0}, at_start=True, at_end=True),
        ],
        callbacks=[log],
    ).fit()
    assert log.calls == [
        ("on_eval", 0, "fixed", {"b": 2.0}),  # at_steps=[0]: before the first step, as step 0
        ("on_eval", 0, "edges", {"c": 3.0}),
        ("step", 1),
        ("step", 2),
        ("on_eval", 2, "every2", {"a": 1.0}),
        ("step", 3),
        ("on_eval", 3, "fixed", {"b": 2.0}),
        ("step", 4),
        ("on_eval", 4, "every2", {"a": 1.0}),
        ("step", 5),
        ("on_eval", 5, "edges", {"c": 3.0}),
    ]


def test_an_eval_runs_in_eval_mode_without_grad_and_training_resumes_in_train_mode() -> None:
    seen: list[str] = []

    def check(model: torch.nn.Module) -> dict[str, float]:
        assert not model.training  # an AssertionError here would be a failed eval, checked below
        assert not torch.is_grad_enabled()
        assert not any(m.training for m in model.modules())
        seen.append("eval")
        return {"ok": 1.0}

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        assert model.training and torch.is_grad_enabled()
        seen.append("train")
        return _mse(model, batch)

    class AfterEval(Callback):
        def on_eval(self, state: LoopState, step_idx: int, eval_name: str, metrics: dict) -> None:
            assert state.model.training  # back in train mode before any hook sees it
            assert torch.is_grad_enabled()

    model = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.Dropout(0.5))
    artifacts = _loop(
        4,
        [Evaluator("val", check, every=1, at_start=True)],
        model=model,
        loss_fn=loss_fn,
        callbacks=[AfterEval()],
    ).fit()
    assert [e.error for e in artifacts.evals] == [None] * 5
    assert seen == ["eval", "train", "eval", "train", "eval", "train", "eval", "train", "eval"]
    assert model.training and model[1].training
    assert torch.is_grad_enabled()


def test_evaluator_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="every=0 must be >= 1"):
        Evaluator("v", lambda m: {}, every=0)
    with pytest.raises(ConfigError, match="non-empty name"):
        Evaluator("", lambda m: {})
    with pytest.raises(ConfigError, match="fn must be a function"):
        Evaluator("v", {"acc": 1.0})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="at_steps must be steps >= 0"):
        Evaluator("v", lambda m: {}, at_steps=[-1])


# --------------------------------------------------------------------------------------------
# benchmark evaluators: the EvalResult and its hooks


def test_an_in_loop_benchmark_fires_on_eval_then_on_benchmark_eval_with_everything() -> None:
    log = EvalLog()
    _loop(2, [Evaluator("bench", _bench(nap=NAP_S), at_end=True)], callbacks=[log]).fit()
    assert log.calls[-2:] == [
        ("on_eval", 2, "bench", {"acc": 0.5, "n": 2.0}),
        ("on_benchmark_eval", "bench", 2, None),
    ]
    ((result, predictions, step),) = log.results
    assert step == 2
    assert (result.name, result.step, result.error) == ("bench", 2, None)
    assert result.metrics == {"acc": 0.5, "n": 2.0}  # tensors became floats
    assert result.breakdowns == {"small": {"acc": 0.0}, "large": {"acc": 1.0}}
    assert result.tags == {"suite": "unit", "version": 2}
    assert result.seconds >= NAP_S
    assert predictions is result.predictions and len(predictions) == 2
    assert predictions[1]["example_id"] == "e1" and predictions[1]["slice"] == "large"


def test_a_post_training_benchmark_fires_on_benchmark_eval_with_step_none(tmp_path: Path) -> None:
    log = EvalLog()
    result = Experiment(
        "bench-after",
        lambda run: _loop(2, []).fit(run),
        benchmarks=[Evaluator("bench", _bench(nap=NAP_S))],
        callbacks=[log],
        store=False,
        output_dir=tmp_path,
    ).run()
    ((bench, predictions, step),) = log.results
    assert step is None and bench.step is None
    assert bench.breakdowns == {"small": {"acc": 0.0}, "large": {"acc": 1.0}}
    assert bench.seconds >= NAP_S and len(predictions) == 2
    assert result.runs[0].metrics["bench/acc"] == 0.5


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"predictions": [{"score": "high"}]}, "prediction 0 has score 'high' (str)"),
        ({"predictions": ["not a dict"]}, "prediction 0 is a str"),
        ({"breakdowns": {"small": 0.5}}, "breakdowns['small'] is a float"),
        ({"metrics": {"acc": "x"}}, "metrics['acc'] is 'x' (str); give a number"),
    ],
)
def test_a_result_the_store_cannot_hold_fails_the_eval_not_the_run(
    bad: dict[str, Any], message: str
) -> None:
    def fn(model: torch.nn.Module) -> EvalResult:
        return EvalResult("b", **{"metrics": {"acc": 1.0}, **bad})

    artifacts = _loop(1, [Evaluator("b", fn, at_end=True)]).fit()
    (failed,) = artifacts.evals
    assert failed.error is not None and message in failed.error
    assert artifacts.step == 1


# --------------------------------------------------------------------------------------------
# the rows: through the real hooks, on both backends


def _flaky(model: torch.nn.Module) -> dict[str, float]:
    raise ValueError("val set missing")


def _timed(model: torch.nn.Module) -> dict[str, float]:
    time.sleep(NAP_S)
    return {"loss": 0.25}


def _train(run: RunSpec) -> LoopArtifacts:
    return _loop(
        4,
        [
            Evaluator("val", _timed, every=2),
            Evaluator("broken", _flaky, at_steps=[3]),
            Evaluator("bench", _bench("bench", nap=NAP_S), at_end=True),
        ],
    ).fit(run)


def _post_broken(model: torch.nn.Module) -> EvalResult:
    time.sleep(NAP_S)
    raise RuntimeError("no such benchmark")


@pytest.fixture
def recorded(store_url: str, tmp_path: Path) -> tuple[str, Any]:
    result = Experiment(
        "evals",
        _train,
        benchmarks=[Evaluator("bench", _bench("bench")), Evaluator("post", _post_broken)],
        store=store_url,
        output_dir=tmp_path / "runs",
    ).run()
    return store_url, result


def test_eval_rows_carry_run_name_step_metrics_breakdowns_tags_seconds_and_errors(
    recorded: tuple[str, Any],
) -> None:
    url, result = recorded
    (run,) = result.runs
    assert run.status == "completed"  # a failing eval, in the loop or after, is not fatal
    con = lab.inspect.connect(url)
    (run_id,) = con.sql("select run_id from runs").fetchone()
    rows = con.sql(
        "select run_id, name, step, metrics, breakdowns, tags, seconds, error from evals "
        "order by step nulls last, name"
    ).fetchall()
    got = {(name, step): rest for _, name, step, *rest in rows}
    assert {r[0] for r in rows} == {run_id}
    assert list(got) == [
        ("val", 2), ("broken", 3), ("bench", 4), ("val", 4), ("bench", None), ("post", None)
    ]  # fmt: skip
    for key in [("val", 2), ("val", 4)]:
        metrics, breakdowns, tags, seconds, error = got[key]
        assert (_json(metrics), _json(breakdowns), _json(tags), error) == (
            {"loss": 0.25},
            {},
            {},
            None,
        )
        assert seconds >= NAP_S  # the eval's own wall time, not 0
    metrics, breakdowns, tags, seconds, error = got[("broken", 3)]
    assert (_json(metrics), error) == ({}, "ValueError: val set missing")
    metrics, breakdowns, tags, seconds, error = got[("bench", 4)]
    assert _json(metrics) == {"acc": 0.5, "n": 2.0}
    assert _json(breakdowns) == {"small": {"acc": 0.0}, "large": {"acc": 1.0}}
    assert _json(tags) == {"suite": "unit", "version": 2}
    assert seconds >= NAP_S and error is None
    _, _, _, seconds, error = got[("post", None)]
    assert error == "RuntimeError: no such benchmark"
    assert seconds >= NAP_S  # how long it ran before it raised
    # the step metrics went on after the failure, and in-loop evals joined them as val/<key>
    steps = con.sql("select step from metrics where key = 'loss' order by step").fetchall()
    assert steps == [(1,), (2,), (3,), (4,)]
    vals = con.sql("select step, value from metrics where key = 'val/loss' order by step")
    assert vals.fetchall() == [(2, 0.25), (4, 0.25)]


def test_prediction_rows_carry_eval_idx_example_input_output_target_score_extras(
    recorded: tuple[str, Any],
) -> None:
    url, _ = recorded
    con = lab.inspect.connect(url)
    rows = con.sql(
        "select e.step, p.idx, p.example_id, p.input, p.output, p.target, p.score, p.extras "
        "from predictions p join evals e using (eval_id) order by e.step nulls last, p.idx"
    ).fetchall()
    assert [(step, idx, ex) for step, idx, ex, *_ in rows] == [
        (4, 0, "e0"), (4, 1, "e1"), (None, 0, "e0"), (None, 1, "e1")
    ]  # fmt: skip
    for _, idx, _, inp, out, target, score, extras in rows:
        assert json.loads(inp) == [1.0, 1.0]
        assert isinstance(float(out), float) and target == "2.0"
        assert score == float(idx)
        assert _json(extras) == {"slice": "small" if idx == 0 else "large"}


def _logger_run(url: str) -> tuple[SqlLogger, LogContext]:
    logger = SqlLogger(url)
    ctx = LogContext(experiment="direct", output_dir=Path("."))
    logger.on_experiment_start(ctx)
    ctx.group_name, ctx.run_key, ctx.repeat, ctx.seed = "g", "r0", 0, 0
    logger.on_group_start(ctx, "g")
    logger.on_run_start(ctx)
    return logger, ctx


@pytest.mark.parametrize("step", [7, None], ids=["in-loop", "after-training"])
def test_rerunning_an_eval_replaces_its_row_and_predictions(
    store_url: str, step: int | None
) -> None:
    logger, ctx = _logger_run(store_url)
    first = EvalResult("bench", {"acc": 0.1}, seconds=1.0)
    logger.on_benchmark_eval(ctx, first, [{"output": f"old{i}"} for i in range(3)], step=step)
    other = EvalResult("other", {"acc": 0.9})
    logger.on_benchmark_eval(ctx, other, [{"output": "keep"}], step=step)
    again = EvalResult("bench", {"acc": 0.2}, breakdowns={"s": {"acc": 0.2}}, seconds=2.0)
    logger.on_benchmark_eval(ctx, again, [{"output": "new"}], step=step)
    logger.close()

    con = lab.inspect.connect(store_url)
    evals = con.sql("select name, step, metrics, seconds from evals order by name").fetchall()
    assert [(n, s, _json(m), sec) for n, s, m, sec in evals] == [
        ("bench", step, {"acc": 0.2}, 2.0),
        ("other", step, {"acc": 0.9}, 0.0),
    ]
    preds = con.sql(
        "select e.name, p.idx, p.output from predictions p join evals e using (eval_id) "
        "order by e.name, p.idx"
    ).fetchall()
    assert preds == [("bench", 0, "new"), ("other", 0, "keep")]


def test_an_eval_fired_by_hand_gets_a_row_without_timing(sqlite_url: str) -> None:
    logger, ctx = _logger_run(sqlite_url)
    state = LoopState(ctx=ctx, model=torch.nn.Linear(1, 1), optimizer=None, num_steps=3)  # type: ignore[arg-type]
    logger.on_eval(state, 3, "manual", {"acc": 1.0})
    logger.close()
    con = lab.inspect.connect(sqlite_url)
    assert con.sql("select name, step, seconds from evals").fetchall() == [("manual", 3, 0.0)]


# --------------------------------------------------------------------------------------------
# the rows: through Store.write_eval, read back by DuckDB

# 10,000 characters: emoji (astral plane), CJK, combining marks, quotes, backslashes, NUL-free
LONG = ('🧪🚀 世界 漢字 テスト Grüße e\u0301 \u2018q\u2019 "dq" \\ \t\n' * 400)[:10_000]


def _run_id(store: Store) -> int:
    exp_id = store.begin_experiment("rows", config={}, seed=0, repeats=1)
    group_id = store.add_group(exp_id, "g")
    return store.start_run(
        exp_id,
        group_id,
        run_key="r0",
        arm_id=None,
        repeat=0,
        stage=0,
        seed=0,
        config={},
        output_dir=None,
    )


def test_long_unicode_and_none_round_trip_through_duckdb(store: Store, store_url: str) -> None:
    assert len(LONG) == 10_000
    run_id = _run_id(store)
    preds: list[dict[str, Any]] = [
        {"example_id": LONG, "input": LONG, "output": LONG, "target": LONG, "score": 0.5,
         "why": LONG},
        {"example_id": None, "input": None, "output": None, "target": None, "score": None},
        {},
        {"example_id": "太郎", "input": {"q": "字"}, "output": ["🚀", 1], "score": -math.inf},
        {"example_id": "nul\x00", "output": "a\x00b", "nul": "c\x00d"},  # PostgreSQL: no NUL
    ]  # fmt: skip
    store.write_eval(
        run_id,
        EvalResult("u", {"acc": 1.0}, breakdowns={"漢字": {"acc": 0.5}}, tags={"🧪": LONG},
                   seconds=0.125),
        preds,
    )  # fmt: skip
    con = lab.inspect.connect(store_url)
    ((name, step, breakdowns, tags, seconds, error),) = con.sql(
        "select name, step, breakdowns, tags, seconds, error from evals"
    ).fetchall()
    assert (name, step, seconds, error) == ("u", None, 0.125, None)
    assert _json(breakdowns) == {"漢字": {"acc": 0.5}} and _json(tags) == {"🧪": LONG}
    rows = con.sql(
        "select idx, example_id, input, output, target, score, extras from predictions order by idx"
    ).fetchall()
    assert rows[0] == (0, LONG, LONG, LONG, LONG, 0.5, rows[0][6])
    assert _json(rows[0][6]) == {"why": LONG}
    assert rows[1] == (1, None, None, None, None, None, None)
    assert rows[2] == (2, None, None, None, None, None, None)
    idx, example, inp, out, target, score, extras = rows[3]
    assert (idx, example, target, score, extras) == (3, "太郎", None, -math.inf, None)
    assert json.loads(inp) == {"q": "字"} and json.loads(out) == ["🚀", 1]
    # NUL, which PostgreSQL text cannot hold, is U+FFFD on both backends (JSON escapes it)
    assert rows[4][1:4] == ("nul\ufffd", None, "a\ufffdb") and _json(rows[4][6]) == {
        "nul": "c\x00d"
    }
    # the store's own readers agree, text for text
    engine = sa.create_engine(store.url)
    with engine.connect() as conn:
        stored = conn.execute(sa.text("select input from predictions where idx = 0")).scalar_one()
    engine.dispose()
    assert stored == LONG


def test_a_nan_score_is_null_on_both_backends(store: Store, store_url: str) -> None:
    run_id = _run_id(store)
    store.write_eval(
        run_id,
        EvalResult("n", {"acc": math.nan}),
        [{"score": math.nan}, {"score": math.inf}, {"score": None}, {"score": 1.0}],
    )
    con = lab.inspect.connect(store_url)
    scores = [s for (s,) in con.sql("select score from predictions order by idx").fetchall()]
    assert scores == [None, math.inf, None, 1.0]
    # so an average is over the scored examples on either backend
    assert con.sql("select avg(score) from predictions where score < 'inf'").fetchone() == (1.0,)
    # a NaN eval metric is JSON's "NaN", which DuckDB reads back as a NaN double
    (acc,) = con.sql("select (metrics->>'acc')::DOUBLE from evals").fetchone()
    assert math.isnan(acc)


def test_predictions_go_in_as_one_batched_insert(store: Store) -> None:
    run_id = _run_id(store)
    inserts: list[tuple[bool, int]] = []

    def count(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if statement.lstrip().upper().startswith("INSERT INTO PREDICTIONS"):
            inserts.append((executemany, len(parameters)))

    sa.event.listen(store.engine, "before_cursor_execute", count)
    try:
        store.write_eval(run_id, EvalResult("b", {}), [{"output": str(i)} for i in range(500)])
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", count)
    assert inserts == [(True, 500)]


# --------------------------------------------------------------------------------------------
# the user docs


def test_the_evals_page_examples_run_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    page = Path(__file__).resolve().parent.parent / "docs" / "evals.md"
    namespace: dict[str, object] = {"__name__": "docs"}
    for block in re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
        exec(compile(block, str(page), "exec"), namespace)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "['probe/acc', 'val/loss']"
    assert [step for _, step, *_ in ast.literal_eval(out[1])] == [20, 40, None]
    assert out[-3:] == ["192", "('parquet',)", "(3,)"]
