"""Names and free text behave the same on SQLite and PostgreSQL: a name too long for its
column, or holding NUL, is one `ConfigError` before anything is written (SQLite would take
it, PostgreSQL would fail mid-run), a name at the limit round-trips on both, and NUL in an
error, a traceback or an eval's error is stored as U+FFFD instead of leaving a run `running`."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
import torch

from lab import Arm, CheckpointConfig, Evaluator, Experiment, RunSpec, TrainingLoop
from lab._names import MAX_KEY, MAX_NAME
from lab.errors import ConfigError, LabError
from lab.loop.evals import EvalResult
from lab.store import Store
from lab.store.schema import SqlArm, SqlEval, SqlExperiment, SqlGroup, SqlMetric, SqlRun

EVAL = "v" * (MAX_KEY - 2)  # its metric "x" is logged as EVAL + "/x": a key at the limit


def _train(run: RunSpec) -> Any:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = TrainingLoop(model, opt, [torch.ones(2, 2)], lambda m, b: m(b).pow(2).mean(), 2,
                        evaluators=[Evaluator(EVAL, lambda m: {"x": 1.0}, at_end=True)],
                        checkpoint=None)  # fmt: skip
    return loop.fit(run)


def _rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(sql))]
    finally:
        engine.dispose()


def test_the_limits_are_the_schema_widths() -> None:
    widths = {
        "experiment": SqlExperiment.__table__.c.name.type.length,
        "arm": SqlArm.__table__.c.name.type.length,
        "group": SqlGroup.__table__.c.name.type.length,
        "run key": SqlRun.__table__.c.run_key.type.length,
        "eval": SqlEval.__table__.c.name.type.length,
        "metric key": SqlMetric.__table__.c.key.type.length,
    }
    assert widths == {"experiment": MAX_NAME, "arm": MAX_NAME, "group": MAX_NAME,
                      "run key": MAX_KEY, "eval": MAX_KEY, "metric key": MAX_KEY}  # fmt: skip
    assert (MAX_NAME, MAX_KEY) == (512, 255)


LONG, NUL = "n" * 600, "bad\x00name"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Experiment(LONG, _train),
         "experiment name 'nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn'... is 600 characters long; "
         "experiment names hold at most 512: shorten it"),
        (lambda: Experiment(NUL, _train),
         "experiment name 'bad\\x00name' holds a NUL character (\\x00), which the store cannot "
         "hold: remove it"),
        (lambda: Arm("a" * 513),
         "arm name 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'... is 513 characters long; arm "
         "names hold at most 512: shorten it"),
        (lambda: Arm(NUL),
         "arm name 'bad\\x00name' holds a NUL character (\\x00), which the store cannot hold: "
         "remove it"),
        (lambda: Arm("\ud800x"),
         "arm name '\\ud800x' is not valid unicode (a lone surrogate): fix its encoding"),
        (lambda: Experiment("x", _train, arms=[Arm("c" * 510, stages=[{}, {}])], repeats=10),
         "group name 'cccccccccccccccccccccccccccccccccccccccc'... is 513 characters long; group "
         "names hold at most 512: shorten it"),
        (lambda: Evaluator("e" * 256, lambda m: {}),
         "eval name 'eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee'... is 256 characters long; eval "
         "names hold at most 255: shorten it"),
        (lambda: Evaluator(NUL, lambda m: {}),
         "eval name 'bad\\x00name' holds a NUL character (\\x00), which the store cannot hold: "
         "remove it"),
    ],
    ids=["experiment-long", "experiment-nul", "arm-long", "arm-nul", "arm-surrogate",
         "chain-group-long", "eval-long", "eval-nul"],
)  # fmt: skip
def test_a_name_the_store_cannot_hold_fails_at_construction(make: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        make()
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda s, e, g: s.begin_experiment(LONG, config={}, seed=0, repeats=1),
         "experiment name 'nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn'... is 600 characters long; "
         "experiment names hold at most 512: shorten it"),
        (lambda s, e, g: s.add_arm(e, NUL, overrides={}, config={}),
         "arm name 'bad\\x00name' holds a NUL character (\\x00), which the store cannot hold: "
         "remove it"),
        (lambda s, e, g: s.add_group(e, LONG),
         "group name 'nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn'... is 600 characters long; group "
         "names hold at most 512: shorten it"),
        (lambda s, e, g: s.start_run(e, g, run_key="k" * 256, arm_id=None, repeat=0, stage=0,
                                     seed=0, config={}, output_dir=None),
         "run key 'kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk'... is 256 characters long; run "
         "keys hold at most 255: shorten it"),
        (lambda s, e, g: s.log_metrics(1, 1, {"k" * 256: 1.0}),
         "metric key 'kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk'... at step 1 is 256 characters "
         "long; keys hold at most 255"),
        (lambda s, e, g: s.log_metrics(1, 1, {NUL: 1.0}),
         "metric key 'bad\\x00name' at step 1 holds a NUL character"),
    ],
    ids=["experiment-long", "arm-nul", "group-long", "run-key-long", "metric-key-long",
         "metric-key-nul"],
)  # fmt: skip
def test_the_store_refuses_the_same_names_on_both_backends(
    store_url: str, write: Any, message: str
) -> None:
    store = Store(store_url)
    try:
        exp = store.begin_experiment("ok", config={}, seed=0, repeats=1)
        group = store.add_group(exp, "g")
        with pytest.raises(LabError) as info:
            write(store, exp, group)
        assert str(info.value) == message
        store.flush()
    finally:
        store.close()
    assert _rows(store_url, "select name from experiments") == [("ok",)]
    assert _rows(store_url, "select name from groups") == [("g",)]
    assert _rows(store_url, "select count(*) from arms") == [(0,)]
    assert _rows(store_url, "select count(*) from runs") == [(0,)]


def test_an_arm_with_stages_at_the_limit_is_accepted() -> None:
    arm = Arm("c" * (MAX_NAME - 3), stages=[{}, {}])  # its groups: "<name>-r0" ... "-r9"
    assert Experiment("x", _train, arms=[arm], repeats=10, store=False).n_runs == 20


def test_names_at_the_limit_round_trip(store_url: str) -> None:
    name, arm = "x" * MAX_NAME, "a" * MAX_NAME
    result = Experiment(name, _train, arms=[Arm(arm)], store=store_url).run()
    assert [r.status for r in result.runs] == ["completed"]
    assert _rows(store_url, "select name from experiments") == [(name,)]
    assert _rows(store_url, "select name from arms") == [(arm,)]
    assert _rows(store_url, "select name, step from evals") == [(EVAL, 2)]
    keys = _rows(store_url, f"select key from summaries where key like '{EVAL}%'")
    assert keys == [(EVAL + "/x",)]


def _fails_with_nul(run: RunSpec) -> Any:
    model = torch.nn.Linear(2, 1)

    def broken_eval(m: torch.nn.Module) -> dict[str, float]:
        raise ValueError("eval\x00broke")

    def loss(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        if run.config is None:  # always: the train step raises with NUL in the message
            raise RuntimeError("bad\x00byte from C")
        return m(b).sum()

    loop = TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        [torch.ones(2, 2)], loss, 3,
                        evaluators=[Evaluator("val", broken_eval, at_start=True)],
                        checkpoint=CheckpointConfig(every=1))  # fmt: skip
    return loop.fit(run)


def test_nul_in_an_error_is_stored_visibly_and_the_run_ends_failed(store_url: str) -> None:
    result = Experiment("nul", _fails_with_nul, store=store_url).run()
    assert [(r.status, r.error) for r in result.runs] == [
        ("failed", "RuntimeError: bad\x00byte from C")  # the result keeps the real text
    ]
    [(status, error, traceback)] = _rows(store_url, "select status, error, traceback from runs")
    assert (status, error) == ("failed", "RuntimeError: bad\ufffdbyte from C")
    assert traceback.endswith("RuntimeError: bad\ufffdbyte from C\n")
    assert "\x00" not in traceback
    assert _rows(store_url, "select name, step, error from evals") == [
        ("val", 0, "ValueError: eval\ufffdbroke")
    ]
    assert result.status == "failed"
    assert _rows(store_url, "select status from experiments") == [("failed",)]


def test_an_eval_result_named_too_long_fails_on_both_backends_alike(store_url: str) -> None:
    store = Store(store_url)
    try:
        exp = store.begin_experiment("e", config={}, seed=0, repeats=1)
        run = store.start_run(exp, store.add_group(exp, "g"), run_key="r", arm_id=None,
                              repeat=0, stage=0, seed=0, config={}, output_dir=None)  # fmt: skip
        with pytest.raises(ConfigError) as info:
            store.write_eval(run, EvalResult("b" * 300, {"acc": 1.0}))
        assert str(info.value).startswith("eval name 'bbbbbbbbbb")
        assert str(info.value).endswith("is 300 characters long; eval names hold at most 255: "
                                        "shorten it")  # fmt: skip
        store.write_eval(run, EvalResult("ok", {"acc": 1.0}, error="x\x00y"), [
            {"input": "in\x00put", "output": None, "example_id": "id\x00"}
        ])  # fmt: skip
    finally:
        store.close()
    assert _rows(store_url, "select name, error from evals") == [("ok", "x\ufffdy")]
    assert _rows(store_url, "select example_id, input from predictions") == [
        ("id\ufffd", "in\ufffdput")
    ]


def test_notes_with_nul_are_stored_visibly_on_both_backends(store_url: str) -> None:
    store = Store(store_url)
    try:
        exp = store.begin_experiment("noted", config={}, seed=0, repeats=1, notes="a\x00b")
        run = store.start_run(exp, store.add_group(exp, "g"), run_key="r", arm_id=None,
                              repeat=0, stage=0, seed=0, config={}, output_dir=None)  # fmt: skip
        store.finish_run(run, status="completed", notes="run\x00note")
        assert store.tag("noted", notes="x\x00y")["notes"] == "x\ufffdy"
    finally:
        store.close()
    assert _rows(store_url, "select notes from experiments") == [("x\ufffdy",)]
    assert _rows(store_url, "select notes from runs") == [("run\ufffdnote",)]
