"""`SqlLogger` end to end: real experiments with a real torch loop, read back with plain SQL.

Every test runs the library as a user would (Experiment -> TrainingLoop -> SqlLogger -> Store)
and then reads the rows with an engine of its own, so nothing is checked through the code
that wrote it. A `Recorder` callback keeps what the loop reported, to compare values with.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pydantic
import pytest
import sqlalchemy as sa
import torch

from lab import (
    Arm,
    Callback,
    CheckpointConfig,
    EvalResult,
    Evaluator,
    Experiment,
    LoopArtifacts,
    ManifestRow,
    RunSpec,
    SqlLogger,
    Store,
    TrainingLoop,
)
from lab.hooks import LogContext, LoopState
from lab.loggers.sql import EXPERIMENT_ID, RUN_ID, arm_key, group_key
from lab.store.engine import resolve_url

STEPS = 6
STEP_KEYS = ("loss", "lr", "grad_norm", "step_time")  # what TrainingLoop logs per step
SEED = 7


class Cfg(pydantic.BaseModel):
    lr: float = 0.1
    hidden: int = 4
    fail_at: int | None = None  # the step whose loss raises, to make a run fail


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 3, generator=gen)
    return x, x.sum(1, keepdim=True)


def train(run: RunSpec) -> LoopArtifacts:
    cfg: Cfg = run.config
    x, y = _data(run.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, cfg.hidden), torch.nn.Tanh(), torch.nn.Linear(cfg.hidden, 1)
    )
    calls = {"n": 0}

    def loss_fn(m: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls["n"] += 1
        if cfg.fail_at is not None and calls["n"] == cfg.fail_at:
            raise RuntimeError(f"diverged at step {calls['n']} of {run.run_key}")
        return _loss(m, batch)

    loop = TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=cfg.lr),
        [(x[:8], y[:8]), (x[8:], y[8:])],
        loss_fn,
        STEPS,
        evaluators=[Evaluator("val", lambda m: {"loss": _loss(m, (x, y)).item()}, every=3)],
        checkpoint=CheckpointConfig(every=3),
    )
    return loop.fit(run)


LONG = "ünïcødé ✓ 日本語 🚀 " * 50


def bench(model: torch.nn.Module) -> EvalResult:
    """A post-training benchmark with breakdowns, tags and one prediction per example."""
    x, y = _data(99)
    out = model(x[:3]).squeeze(1)
    preds: list[dict[str, Any]] = [
        {
            "example_id": 10 + i,  # an int: stored as text
            "input": f"x{i}",
            "output": {"y_hat": round(float(out[i]), 6)},  # not a str: stored as JSON text
            "target": None if i == 2 else f"{float(y[i, 0]):.4f}",
            "score": float(out[i]),
            "difficulty": "hard" if i else "easy",  # any other key goes to extras
        }
        for i in range(3)
    ]
    preds[1]["input"] = LONG
    return EvalResult(
        "bench",
        {"mae": float((out - y[:3, 0]).abs().mean())},
        breakdowns={"easy": {"mae": 0.25}, "hard": {"mae": 0.75}},
        tags={"suite": "tiny", "version": 2},
        predictions=preds,
    )


class Recorder(Callback):
    """Keeps everything the loop and the experiment report, keyed by run."""

    def __init__(self) -> None:
        self.steps: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
        self.evals: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
        self.benchmarks: dict[str, list[tuple[int | None, EvalResult, list[dict]]]] = defaultdict(
            list
        )
        self.checkpoints: dict[str, list[ManifestRow]] = defaultdict(list)
        self.ids: dict[str, dict[str, Any]] = {}

    def on_step_end(self, state: LoopState, step_idx: int, batch: Any, metrics: dict) -> None:
        self.steps[state.ctx.run_key][step_idx] = dict(metrics)

    def on_eval(self, state: LoopState, step_idx: int, eval_name: str, metrics: dict) -> None:
        assert eval_name == "val"
        self.evals[state.ctx.run_key][step_idx] = dict(metrics)

    def on_benchmark_eval(
        self,
        ctx: LogContext,
        eval_result: EvalResult,
        predictions: list[dict],
        *,
        step: int | None = None,
    ) -> None:
        self.benchmarks[ctx.run_key].append((step, eval_result, list(predictions)))

    def on_checkpoint(self, state: LoopState, row: ManifestRow) -> None:
        self.checkpoints[state.ctx.run_key].append(row)

    def on_run_end(self, ctx: LogContext, run_result: Any, arm: Any) -> None:
        self.ids[ctx.run_key] = dict(ctx.ids)


def _engine(url: str) -> sa.Engine:
    return sa.create_engine(resolve_url(url))


def _json(value: Any) -> Any:
    """JSON columns come back as text from SQLite and parsed from PostgreSQL."""
    return json.loads(value) if isinstance(value, str) else value


def _ts(value: Any) -> datetime:
    """Timestamps come back as ISO text from SQLite and as datetime from PostgreSQL."""
    return datetime.fromisoformat(value) if isinstance(value, str) else value


def _rows(engine: sa.Engine, sql: str, **params: Any) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.text(sql), params).mappings()]


# ---------------------------------------------------------------------------------------------
def test_experiment_rows_match_what_the_loop_reported(store_url: str) -> None:
    rec = Recorder()
    result = Experiment(
        "sql-e2e",
        train,
        arms=[Arm("a", lr=0.1), Arm("b", lr=0.05, hidden=5)],
        repeats=2,
        base_config=Cfg(),
        callbacks=[rec],
        store=store_url,
        seed=SEED,
        benchmarks=[Evaluator("bench", bench)],
    ).run()
    assert [r.status for r in result.runs] == ["completed"] * 4
    engine = _engine(store_url)

    # -- experiment ----------------------------------------------------------------------
    (exp,) = _rows(engine, "SELECT * FROM experiments")
    assert exp["name"] == "sql-e2e"
    assert exp["status"] == "completed"
    assert (exp["seed"], exp["repeats"]) == (SEED, 2)
    assert exp["ended_at"] is not None and _ts(exp["ended_at"]) >= _ts(exp["created_at"])
    assert _json(exp["config"]) == {
        "train": f"{__name__}:train",
        "base_config": {"lr": 0.1, "hidden": 4, "fail_at": None},
        "arms": {"a": {"lr": 0.1}, "b": {"lr": 0.05, "hidden": 5}},
        "arm_configs": {
            "a": {"lr": 0.1, "hidden": 4, "fail_at": None},
            "b": {"lr": 0.05, "hidden": 5, "fail_at": None},
        },
        "repeats": 2,
        "seed": SEED,
    }
    exp_id = exp["experiment_id"]

    # -- arms and groups -----------------------------------------------------------------
    arms = _rows(engine, "SELECT * FROM arms ORDER BY arm_id")
    assert [(a["experiment_id"], a["name"]) for a in arms] == [(exp_id, "a"), (exp_id, "b")]
    assert [_json(a["overrides"]) for a in arms] == [{"lr": 0.1}, {"lr": 0.05, "hidden": 5}]
    assert [_json(a["config"]) for a in arms] == [
        {"lr": 0.1, "hidden": 4, "fail_at": None},
        {"lr": 0.05, "hidden": 5, "fail_at": None},
    ]
    arm_ids = {a["name"]: a["arm_id"] for a in arms}
    groups = _rows(engine, "SELECT * FROM groups ORDER BY group_id")
    assert [(g["experiment_id"], g["name"], g["kind"], g["arm_id"]) for g in groups] == [
        (exp_id, "a", "repeats", arm_ids["a"]),
        (exp_id, "b", "repeats", arm_ids["b"]),
    ]
    group_ids = {g["name"]: g["group_id"] for g in groups}

    # -- runs ----------------------------------------------------------------------------
    runs = _rows(engine, "SELECT * FROM runs ORDER BY run_id")
    assert len(runs) == 4
    by_key = {r.run_key: r for r in result.runs}
    assert [r["run_key"] for r in runs] == ["a-r0", "a-r1", "b-r0", "b-r1"]
    for row in runs:
        rr = by_key[row["run_key"]]
        assert row["experiment_id"] == exp_id
        assert row["arm_id"] == arm_ids[rr.arm] and row["group_id"] == group_ids[rr.arm]
        assert (row["repeat"], row["stage"], row["seed"]) == (rr.repeat, 0, SEED + rr.repeat)
        assert row["status"] == "completed"
        assert row["error"] is None and row["traceback"] is None
        assert row["callback_errors"] is None
        assert _json(row["config"]) == _json(arms[list(arm_ids).index(rr.arm)]["config"])
        assert row["output_dir"] == str((Path("runs") / "sql-e2e" / rr.run_key).resolve())
        assert row["ended_at"] is not None and _ts(row["ended_at"]) >= _ts(row["started_at"])
        summary = _json(row["summary"])
        assert summary == rr.metrics  # final step metrics + val/loss + bench/mae
        assert set(summary) == {*STEP_KEYS, "val/loss", "bench/mae"}
        assert summary["loss"] == rec.steps[rr.run_key][STEPS]["loss"]
        assert summary["val/loss"] == rec.evals[rr.run_key][STEPS]["loss"]
    run_ids = {r["run_key"]: r["run_id"] for r in runs}
    # No callback failed: SQL NULL, not the JSON text 'null' (which IS NOT NULL).
    (no_errors,) = _rows(engine, "SELECT count(*) AS n FROM runs WHERE callback_errors IS NULL")
    assert no_errors["n"] == 4

    # -- ctx.ids: the logger's ids, under sql: names ---------------------------------------
    for run_key, ids in rec.ids.items():
        arm = run_key[0]
        assert ids == {
            EXPERIMENT_ID: exp_id,
            arm_key("a"): arm_ids["a"],
            arm_key("b"): arm_ids["b"],
            group_key("a"): group_ids["a"],
            **({group_key("b"): group_ids["b"]} if arm == "b" else {}),
            RUN_ID: run_ids[run_key],
        }
        assert all(k.startswith("sql:") for k in ids)

    # -- metrics: every step x every key, val/<key> at the eval steps, and the post-training
    # benchmark's bench/<key> at the last step (a final metric like the others)
    (n_metrics,) = _rows(engine, "SELECT count(*) AS n FROM metrics")
    assert n_metrics["n"] == 4 * STEPS * len(STEP_KEYS) + 4 * 2 + 4
    for run_key, run_id in run_ids.items():
        got = {
            (m["key"], m["step"]): m["value"]
            for m in _rows(engine, "SELECT * FROM metrics WHERE run_id = :r", r=run_id)
        }
        expected = {
            (key, step): value
            for step, metrics in rec.steps[run_key].items()
            for key, value in metrics.items()
        }
        expected |= {
            (f"val/{key}", step): value
            for step, metrics in rec.evals[run_key].items()
            for key, value in metrics.items()
        }
        expected[("bench/mae", STEPS)] = by_key[run_key].metrics["bench/mae"]
        assert len(expected) == STEPS * len(STEP_KEYS) + 2 + 1
        assert got == expected  # exact floats

    # -- evals: val at steps 3 and 6 in the loop, bench after training (step NULL) -----------
    evals = _rows(engine, "SELECT * FROM evals ORDER BY run_id, eval_id")
    assert len(evals) == 4 * 3
    for run_key, run_id in run_ids.items():
        mine = [e for e in evals if e["run_id"] == run_id]
        assert [(e["name"], e["step"]) for e in mine] == [
            ("val", 3),
            ("val", 6),
            ("bench", None),
        ]
        for e in mine[:2]:
            assert _json(e["metrics"]) == rec.evals[run_key][e["step"]]
            assert (_json(e["breakdowns"]), _json(e["tags"]), e["error"]) == ({}, {}, None)
        bench_row = mine[2]
        ((step, reported, preds),) = rec.benchmarks[run_key]
        assert step is None
        assert _json(bench_row["metrics"]) == reported.metrics
        assert _json(bench_row["metrics"])["mae"] == by_key[run_key].metrics["bench/mae"]
        assert _json(bench_row["breakdowns"]) == {"easy": {"mae": 0.25}, "hard": {"mae": 0.75}}
        assert _json(bench_row["tags"]) == {"suite": "tiny", "version": 2}
        assert bench_row["error"] is None
        assert bench_row["seconds"] == reported.seconds and bench_row["seconds"] > 0

        # -- predictions of the benchmark ------------------------------------------------
        rows = _rows(
            engine,
            "SELECT * FROM predictions WHERE eval_id = :e ORDER BY idx",
            e=bench_row["eval_id"],
        )
        assert [p["idx"] for p in rows] == [0, 1, 2]
        for p, want in zip(rows, preds, strict=True):
            assert p["example_id"] == str(want["example_id"])
            assert p["input"] == want["input"]
            assert json.loads(p["output"]) == want["output"]
            assert p["target"] == want["target"]
            assert p["score"] == want["score"]
            assert _json(p["extras"]) == {"difficulty": want["difficulty"]}
        assert rows[1]["input"] == LONG and rows[2]["target"] is None
    (n_preds,) = _rows(engine, "SELECT count(*) AS n FROM predictions")
    assert n_preds["n"] == 4 * 3

    # -- checkpoints: a save at steps 3 and 6 of every run ----------------------------------
    ckpts = _rows(engine, "SELECT * FROM checkpoints ORDER BY checkpoint_id")
    assert len(ckpts) == 4 * 2
    for run_key, run_id in run_ids.items():
        mine = [c for c in ckpts if c["run_id"] == run_id]
        manifest = rec.checkpoints[run_key]
        assert [(c["step"], c["path"], c["event"], c["reason"]) for c in mine] == [
            (3, "step_000003", "save", None),
            (6, "step_000006", "save", None),
        ]
        for c, row in zip(mine, manifest, strict=True):
            # a save carries the step's metrics and the latest eval metrics, as "<eval>/<key>"
            at_save = {
                **rec.steps[run_key][c["step"]],
                **{f"val/{k}": v for k, v in rec.evals[run_key][c["step"]].items()},
            }
            assert _json(c["metrics"]) == at_save == row.metrics
            saved_at = datetime.fromtimestamp(row.time, UTC).replace(tzinfo=None)
            assert _ts(c["created_at"]) == saved_at
    engine.dispose()


# ---------------------------------------------------------------------------------------------
class Flaky(Callback):
    """A buggy user callback: breaks at step 2 and again when the run ends (runs after SQL)."""

    priority = 0  # lower than SqlLogger's 100, so its on_run_end runs after the logger's

    def on_step_end(self, state: LoopState, step_idx: int, batch: Any, metrics: dict) -> None:
        if step_idx == 2:
            raise ValueError(f"step hook broke in {state.ctx.run_key}")

    def on_run_end(self, ctx: LogContext, run_result: Any, arm: Any) -> None:
        raise KeyError(f"end hook broke in {ctx.run_key}")


def test_failed_run_and_callback_failures_are_recorded(store_url: str) -> None:
    result = Experiment(
        "failures",
        train,
        arms=[Arm("ok"), Arm("bad", fail_at=4)],
        base_config=Cfg(),
        callbacks=[Flaky()],
        store=store_url,
        strict=False,
    ).run()
    assert [r.status for r in result.runs] == ["completed", "failed"]
    engine = _engine(store_url)
    (exp,) = _rows(engine, "SELECT status FROM experiments")
    assert exp["status"] == "failed"

    runs = _rows(engine, "SELECT * FROM runs ORDER BY run_id")
    assert [(r["run_key"], r["status"]) for r in runs] == [
        ("ok-r0", "completed"),
        ("bad-r0", "failed"),
    ]
    ok, bad = runs
    assert ok["error"] is None and ok["traceback"] is None
    assert bad["error"] == "RuntimeError: diverged at step 4 of bad-r0"
    assert bad["traceback"].startswith("Traceback (most recent call last):")
    assert bad["traceback"].rstrip().endswith("RuntimeError: diverged at step 4 of bad-r0")
    assert bad["traceback"] == result.runs[1].traceback
    assert _json(bad["summary"]) == {}
    assert bad["ended_at"] is not None

    for row, rr in zip(runs, result.runs, strict=True):
        errors = _json(row["callback_errors"])
        assert errors == rr.callback_errors
        assert [(e["callback"], e["hook"], e["error"]) for e in errors] == [
            ("Flaky", "on_step_end", f"ValueError: step hook broke in {rr.run_key}"),
            ("Flaky", "on_run_end", f"KeyError: 'end hook broke in {rr.run_key}'"),
        ]
        assert all("Traceback (most recent call last):" in e["traceback"] for e in errors)

    # What the failed run did before it failed is kept: steps 1-3, val@3, the save at 3.
    metric_counts = _rows(
        engine, "SELECT run_id, count(*) AS n FROM metrics GROUP BY run_id ORDER BY run_id"
    )
    assert [m["n"] for m in metric_counts] == [STEPS * 4 + 2, 3 * 4 + 1]
    bad_ckpts = _rows(
        engine, "SELECT step, event FROM checkpoints WHERE run_id = :r", r=bad["run_id"]
    )
    assert bad_ckpts == [{"step": 3, "event": "save"}]
    bad_evals = _rows(engine, "SELECT name, step FROM evals WHERE run_id = :r", r=bad["run_id"])
    assert bad_evals == [{"name": "val", "step": 3}]
    engine.dispose()


# ---------------------------------------------------------------------------------------------
def _bare_loop(fail_at: int | None, tmp_path: Path, url: str) -> TrainingLoop:
    x, y = _data(0)
    model = torch.nn.Linear(3, 1)
    calls = {"n": 0}

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise FloatingPointError("loss went NaN")
        return _loss(m, batch)

    return TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        [(x, y)],
        loss_fn,
        4,
        callbacks=[SqlLogger(url)],
    )


def test_bare_loop_gets_an_experiment_and_run_of_its_own(tmp_path: Path, sqlite_url: str) -> None:
    artifacts = _bare_loop(None, tmp_path, sqlite_url).fit(run_dir=tmp_path / "bare")
    engine = _engine(sqlite_url)
    (exp,) = _rows(engine, "SELECT name, status FROM experiments")
    assert exp["name"].startswith("loop-") and exp["status"] == "completed"
    (run,) = _rows(engine, "SELECT * FROM runs")
    assert (run["run_key"], run["status"], run["arm_id"]) == ("bare", "completed", None)
    assert _json(run["summary"]) == artifacts.metrics
    (n,) = _rows(engine, "SELECT count(*) AS n FROM metrics")
    assert n["n"] == 4 * len(STEP_KEYS)
    engine.dispose()


def test_bare_loop_failure_is_recorded_as_failed(tmp_path: Path, sqlite_url: str) -> None:
    with pytest.raises(FloatingPointError, match="loss went NaN"):
        _bare_loop(3, tmp_path, sqlite_url).fit(run_dir=tmp_path / "bare")
    engine = _engine(sqlite_url)
    (exp,) = _rows(engine, "SELECT status FROM experiments")
    assert exp["status"] == "failed"
    (run,) = _rows(engine, "SELECT status, error FROM runs")
    assert run == {"status": "failed", "error": "FloatingPointError: loss went NaN"}
    steps = _rows(engine, "SELECT DISTINCT step FROM metrics ORDER BY step")
    assert [s["step"] for s in steps] == [1, 2]
    engine.dispose()


def test_nan_loss_and_summary_round_trip(sqlite_url: str) -> None:
    """A NaN final metric is kept as NaN in the summary (JSON has no NaN) and in metrics."""

    def nan_train(run: RunSpec) -> dict[str, float]:
        return {"loss": math.nan, "best": math.inf, "worst": -math.inf, "acc": 0.5}

    Experiment("nan", nan_train, store=sqlite_url).run()
    engine = _engine(sqlite_url)
    (run,) = _rows(engine, "SELECT summary FROM runs")
    assert _json(run["summary"]) == {
        "loss": "NaN",
        "best": "Infinity",
        "worst": "-Infinity",
        "acc": 0.5,
    }
    engine.dispose()


def test_nan_loss_from_the_loop_reaches_the_metrics_table(store_url: str, tmp_path: Path) -> None:
    """A NaN loss is data: the loop goes on, and the store keeps NaN at exactly that step."""

    def nan_at_3(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        loss = _loss(model, batch)
        return loss * math.nan if nan_at_3.calls == 2 else loss  # type: ignore[attr-defined]

    def counted(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        out = nan_at_3(model, batch)
        nan_at_3.calls += 1  # type: ignore[attr-defined]
        return out

    nan_at_3.calls = 0  # type: ignore[attr-defined]

    def train_nan(run: RunSpec) -> LoopArtifacts:
        x, y = _data(run.seed)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return TrainingLoop(model, opt, [(x, y)], counted, 5).fit(run)

    result = Experiment("nan-loss", train_nan, store=store_url, output_dir=tmp_path).run()
    assert result.runs[0].status == "completed"
    store = Store(store_url)
    try:
        values = store.metric_values(store.get_experiment("nan-loss")["runs"][0]["run_id"], "loss")
    finally:
        store.close()
    assert [s for s, _ in values] == [1, 2, 3, 4, 5]
    assert math.isnan(values[2][1])
    assert all(not math.isnan(v) for s, v in values if s < 3)


class Derive(Callback):
    """A lower-priority callback that adds a derived metric to the step's dict."""

    def on_step_end(self, state, step_idx, batch, metrics):  # type: ignore[no-untyped-def]
        metrics["derived"] = 2 * metrics["loss"]
        metrics["loss"] = -1.0


def test_store_keeps_the_step_row_as_it_was_handed_over(sqlite_url: str, tmp_path: Path) -> None:
    Experiment("derive", train, base_config=Cfg(), callbacks=[Derive()], store=sqlite_url,
               output_dir=tmp_path).run()  # fmt: skip
    engine = _engine(sqlite_url)
    keys = _rows(engine, "SELECT DISTINCT key FROM metrics WHERE key NOT LIKE 'val/%' ORDER BY key")
    assert [k["key"] for k in keys] == sorted(STEP_KEYS)
    (low,) = _rows(engine, "SELECT min(value) AS v FROM metrics WHERE key = 'loss'")
    assert low["v"] >= 0  # the later callback's -1.0 never reached the store
    engine.dispose()


def test_running_an_experiment_again_replaces_each_runs_rows(
    store_url: str, tmp_path: Path
) -> None:
    attempts: list[int] = []

    def steps_train(run: RunSpec) -> LoopArtifacts:
        x, y = _data(run.seed)
        model = torch.nn.Linear(3, 1)
        steps = 3 if attempts else 8  # the same config: a run that failed may run again
        attempts.append(steps)
        artifacts = TrainingLoop(
            model, torch.optim.SGD(model.parameters(), lr=0.1), [(x, y)], _loss,
            steps, checkpoint=CheckpointConfig(every=2),
        ).fit(run)  # fmt: skip
        if steps == 8:  # the first attempt fails after training, so it runs again
            raise RuntimeError("lost the node")
        return artifacts

    for folder in ("first", "second"):  # the second cannot resume: it starts from nothing
        result = Experiment("again", steps_train, store=store_url,
                            output_dir=tmp_path / folder).run()  # fmt: skip
    assert attempts == [8, 3]
    engine = _engine(store_url)
    (run,) = _rows(engine, "SELECT run_id, status, summary FROM runs")
    assert run["status"] == "completed"
    assert _json(run["summary"])["loss"] == result.runs[0].metrics["loss"]
    steps = _rows(engine, "SELECT DISTINCT step FROM metrics ORDER BY step")
    assert [s["step"] for s in steps] == [1, 2, 3]
    saves = _rows(engine, "SELECT step FROM checkpoints WHERE event = 'save' ORDER BY step")
    assert [s["step"] for s in saves] == [2, 3]
    (last,) = _rows(engine, "SELECT value FROM metrics WHERE key = 'loss' AND step = 3")
    assert last["value"] == result.runs[0].metrics["loss"]
    engine.dispose()


def test_a_sql_logger_attached_to_a_loop_inside_an_experiment_fails_the_run_saying_where(
    sqlite_url: str,
) -> None:
    def train(run: RunSpec) -> Any:
        return _bare_loop(None, Path("."), sqlite_url).fit(run)  # its own SqlLogger: no run

    result = Experiment("misplaced", train, store=False).run()
    assert result.runs[0].status == "failed"
    assert result.runs[0].error == (
        "ConfigError: SqlLogger got a run's hook before its on_run_start: attach it to the "
        "Experiment (or lab.start_run), not to a TrainingLoop or RunHandle inside train(run)"
    )


def test_two_bare_fits_get_two_experiments(tmp_path: Path, sqlite_url: str) -> None:
    _bare_loop(None, tmp_path, sqlite_url).fit(run_dir=tmp_path / "bare")
    _bare_loop(None, tmp_path, sqlite_url).fit(run_dir=tmp_path / "bare")
    engine = _engine(sqlite_url)
    names = [e["name"] for e in _rows(engine, "SELECT name FROM experiments")]
    assert len(names) == 2 and len(set(names)) == 2
    per_run = _rows(engine, "SELECT run_id, count(*) AS n FROM metrics GROUP BY run_id")
    assert [r["n"] for r in per_run] == [4 * len(STEP_KEYS)] * 2
    engine.dispose()


def test_benchmark_hook_does_not_change_the_callers_result(sqlite_url: str) -> None:
    logger = SqlLogger(sqlite_url)
    ctx = LogContext(experiment="x", output_dir=Path("."))
    logger.on_experiment_start(ctx)
    ctx.group_name, ctx.run_key, ctx.repeat, ctx.seed = "g", "r", 0, 0
    logger.on_group_start(ctx, "g")
    logger.on_run_start(ctx)
    result = EvalResult("b", {"acc": 1.0}, step=None)
    logger.on_benchmark_eval(ctx, result, [], step=5)
    assert result.step is None
    engine = _engine(sqlite_url)
    assert _rows(engine, "SELECT name, step FROM evals") == [{"name": "b", "step": 5}]
    engine.dispose()
    logger.close()


def test_experiment_level_callback_failures_are_recorded(store_url: str, tmp_path: Path) -> None:
    class GroupBreaks(Callback):
        def on_group_start(self, ctx: LogContext, group_name: str) -> None:
            raise ValueError(f"no sink for {group_name}")

    result = Experiment(
        "grp", lambda run: {"loss": 1.0}, arms=[Arm("a"), Arm("b")], callbacks=[GroupBreaks()],
        store=store_url, strict=False, output_dir=tmp_path,
    ).run()  # fmt: skip
    # one record per (callback, hook) outside runs: the first error, and how often it failed
    assert [(f["hook"], f["error"], f["count"]) for f in result.callback_errors] == [
        ("on_group_start", "ValueError: no sink for a", 2)
    ]
    assert all(r.callback_errors == [] for r in result.runs)
    engine = _engine(store_url)
    (exp,) = _rows(engine, "SELECT status, callback_errors FROM experiments")
    assert exp["status"] == "completed"
    stored = _json(exp["callback_errors"])
    assert [(f["callback"], f["hook"]) for f in stored] == [
        (f["callback"], f["hook"]) for f in result.callback_errors
    ]
    engine.dispose()
