"""`lab.inspect`: DuckDB views over the store equal what Python computes from the same runs."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pydantic
import pytest

import lab.inspect
from lab import Arm, Callback, Experiment, RunSpec
from lab.errors import ConfigError, NoStore, UnknownScheme
from lab.store import Store

ARMS = ("a", "b")
REPEATS = 3
STEPS = 5


class Cfg(pydantic.BaseModel):
    scale: float = 1.0


def train(run: RunSpec) -> dict[str, float]:
    """Logs a deterministic curve through the real hooks, including NaN and inf at the end."""
    from lab.hooks import LoopState

    state = LoopState(ctx=run.ctx, model=None, optimizer=None, num_steps=STEPS)  # type: ignore[arg-type]
    for step in range(1, STEPS + 1):
        value = run.config.scale * (run.repeat + 1) / step
        metrics = {"loss": value, "odd": math.nan if step == STEPS else math.inf}
        state.step = step
        run.dispatcher.fire("on_step_end", state, step, None, metrics)
    return {"loss": run.config.scale * (run.repeat + 1) / STEPS}


class Recorder(Callback):
    def __init__(self) -> None:
        self.points: list[tuple[str, int, int, str, float]] = []

    def on_step_end(self, state, step_idx, batch, metrics) -> None:  # type: ignore[no-untyped-def]
        ctx = state.ctx
        for key, value in metrics.items():
            self.points.append((ctx.arm, ctx.repeat, step_idx, key, value))


@pytest.fixture(scope="module")
def recorded(
    module_store_url: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Recorder]:
    """Experiment ``inspect-me`` recorded once per backend; the tests that take it only read."""
    store_url, tmp_path = module_store_url, tmp_path_factory.mktemp("inspect")
    recorder = Recorder()
    Experiment(
        "inspect-me",
        train,
        base_config=Cfg(),
        arms=[Arm("a", scale=1.0), Arm("b", scale=2.0)],
        repeats=REPEATS,
        callbacks=[recorder],
        store=store_url,
        output_dir=tmp_path / "runs",
    ).run()
    return store_url, recorder


@pytest.mark.parametrize("mode", ["attach", "arrow"])
def test_views_match_python_aggregates(recorded: tuple[str, Recorder], mode: str) -> None:
    url, recorder = recorded
    con = lab.inspect.connect(url, mode=mode)
    assert con.sql("select mode from lab_source").fetchone() == (mode,)
    for table, n in [("experiments", 1), ("arms", 2), ("groups", 2), ("runs", 6)]:
        assert con.sql(f"select count(*) from {table}").fetchone() == (n,)
    assert con.sql("select count(*) from metrics").fetchone() == (len(recorder.points),)

    # Per arm: the final loss across repeats.
    got = con.sql(
        """select arm, count(*), avg(value), stddev_samp(value) from final_metrics
           where experiment = 'inspect-me' and key = 'loss' group by arm order by arm"""
    ).fetchall()
    for (arm, n, mean, std), name in zip(got, ARMS, strict=True):
        finals = [
            v for a, _, s, k, v in recorder.points if a == name and k == "loss" and s == STEPS
        ]
        assert (arm, n) == (name, REPEATS)
        assert mean == pytest.approx(statistics.fmean(finals), rel=1e-12)
        assert std == pytest.approx(statistics.stdev(finals), rel=1e-12)

    # A learning curve: mean over repeats per arm and step.
    curve = con.sql(
        """select a.name, m.step, avg(m.value) from metrics m
           join runs r using (run_id) join arms a on a.arm_id = r.arm_id
           where m.key = 'loss' group by all order by 1, 2"""
    ).fetchall()
    expected = [
        (name, step, statistics.fmean(
            v for a, _, s, k, v in recorder.points if a == name and s == step and k == "loss"
        ))
        for name in ARMS for step in range(1, STEPS + 1)
    ]  # fmt: skip
    assert [(a, s) for a, s, _ in curve] == [(a, s) for a, s, _ in expected]
    for (_, _, got_mean), (_, _, want) in zip(curve, expected, strict=True):
        assert got_mean == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("mode", ["attach", "arrow"])
def test_nan_and_inf_read_back_as_nan_and_inf(recorded: tuple[str, Recorder], mode: str) -> None:
    url, _ = recorded
    con = lab.inspect.connect(url, mode=mode)
    values = con.sql("select step, value from metrics where key = 'odd' order by run_id, step")
    rows = values.fetchall()
    assert len(rows) == 2 * REPEATS * STEPS
    for step, value in rows:
        if step == STEPS:
            assert math.isnan(value)
        else:
            assert value == math.inf


def test_json_columns_are_json(recorded: tuple[str, Recorder]) -> None:
    url, _ = recorded
    con = lab.inspect.connect(url)
    rows = con.sql(
        "select a.name, r.config->>'scale' from runs r join arms a using (arm_id) "
        "where r.repeat = 0 order by 1"
    ).fetchall()
    assert rows == [("a", "1.0"), ("b", "2.0")]
    assert con.sql("select typeof(config) from runs limit 1").fetchone() == ("JSON",)


def test_connect_resolves_lab_store_url(
    recorded: tuple[str, Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = recorded
    monkeypatch.setenv("LAB_STORE_URL", url)
    assert lab.inspect.connect().sql("select name from experiments").fetchall() == [("inspect-me",)]


def test_connect_reads_an_empty_store_and_never_creates_one(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new.db'}"
    with pytest.raises(NoStore, match="no store at"):
        lab.inspect.connect(url)
    assert list(tmp_path.iterdir()) == []
    Store(url).close()
    con = lab.inspect.connect(url)
    assert con.sql("select count(*) from runs").fetchone() == (0,)


def test_auto_falls_back_to_arrow_for_an_in_memory_store() -> None:
    con = lab.inspect.connect("sqlite:///:memory:")
    assert con.sql("select mode from lab_source").fetchone() == ("arrow",)
    assert con.sql("select count(*) from metrics").fetchone() == (0,)


def test_connect_bad_inputs() -> None:
    with pytest.raises(UnknownScheme):
        lab.inspect.connect("mysql://x/y")
    with pytest.raises(ConfigError, match="mode='fast'"):
        lab.inspect.connect("sqlite:///:memory:", mode="fast")  # type: ignore[arg-type]


def test_store_reads_restore_nan(recorded: tuple[str, Recorder]) -> None:
    url, _ = recorded
    store = Store(url)
    try:
        run_id = store.get_experiment("inspect-me")["runs"][0]["run_id"]
        values = store.metric_values(run_id, "odd")
    finally:
        store.close()
    assert [s for s, _ in values] == list(range(1, STEPS + 1))
    assert math.isnan(values[-1][1]) and all(v == math.inf for _, v in values[:-1])


@pytest.mark.parametrize("mode", ["attach", "arrow"])
def test_history_reads_one_series_through_the_store(
    recorded: tuple[str, Recorder], mode: str
) -> None:
    url, recorder = recorded
    con = lab.inspect.connect(url, mode=mode)
    got = lab.inspect.history(con, "b-r1", "loss").fetchall()
    want = sorted((step, value) for arm, repeat, step, key, value in recorder.points
                  if (arm, repeat, key) == ("b", 1, "loss"))  # fmt: skip
    assert got == want and len(got) > 1
    assert list(lab.inspect.history(con, "b-r1", "loss", experiment="inspect-me").df()) == [
        "step",
        "value",
    ]
    with pytest.raises(ConfigError, match=r"^no run 'z-r0'; runs: a-r0, a-r1, a-r2, b-r0"):
        lab.inspect.history(con, "z-r0", "loss")
    with pytest.raises(ConfigError, match=r"^run 'a-r0' has no metric 'acc'; it has: .*loss"):
        lab.inspect.history(con, "a-r0", "acc")
