"""`Store` and its metric writer on real SQLite files and the real PostgreSQL server.

Values are written through `Store` and read back both through its readers and with plain SQL
on an engine of the test's own, so a reader that hides a wrong row cannot pass.
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from lab import EvalResult
from lab.errors import (
    NoExperiment,
    NoRun,
    NotALabStore,
    SchemaTooNew,
    StoreError,
    StoreUnreachable,
    UnknownScheme,
)
from lab.loop.checkpoints import ManifestRow
from lab.store import DEFAULT_URL, Store, resolve_url
from lab.store.migrations import head_revision
from lab.store.schema import DERIVED_TABLES, PRIVATE_TABLES, TABLES
from lab.store.writer import MetricItem, MetricWriter

WAIT_S = 10  # generous bound on waits that end as soon as the awaited thing happens


def _engine(url: str) -> sa.Engine:
    return sa.create_engine(resolve_url(url))


def _scalar(url: str, sql: str, **params: Any) -> Any:
    engine = _engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text(sql), params).scalar_one()
    finally:
        engine.dispose()


def _rows(url: str, sql: str, **params: Any) -> list[dict[str, Any]]:
    engine = _engine(url)
    try:
        with engine.connect() as conn:
            return [dict(r) for r in conn.execute(sa.text(sql), params).mappings()]
    finally:
        engine.dispose()


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _new_run(store: Store, experiment: str = "exp", run_key: str = "r0") -> int:
    exp_id = store.begin_experiment(experiment, config={}, seed=0, repeats=1)
    group_id = store.add_group(exp_id, "g")
    return store.start_run(
        exp_id, group_id, run_key=run_key, arm_id=None, repeat=0, stage=0, seed=0,
        config={}, output_dir=None,
    )  # fmt: skip


def _same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """Equal step/value lists, with NaN equal to NaN (and nothing else)."""
    return len(a) == len(b) and all(
        sa_ == sb and (va == vb or (math.isnan(va) and math.isnan(vb)))
        for (sa_, va), (sb, vb) in zip(a, b, strict=True)
    )


# -- metrics ---------------------------------------------------------------------------------
def test_non_finite_metric_values_round_trip(store: Store, store_url: str) -> None:
    run_id = _new_run(store)
    values = [math.nan, math.inf, -math.inf, 1.5, 0.0, -2.25e-300]
    for step, value in enumerate(values, start=1):
        store.log_metrics(run_id, step, {"x": value})
    store.flush()
    got = store.metric_values(run_id, "x")
    assert _same(got, list(enumerate(values, start=1)))
    assert math.isnan(got[0][1]) and got[1][1] == math.inf and got[2][1] == -math.inf

    assert _scalar(store_url, "SELECT count(*) FROM metrics WHERE run_id = :r", r=run_id) == 6
    raw = dict(
        (r["step"], r["value"])
        for r in _rows(store_url, "SELECT step, value FROM metrics WHERE key = 'x'")
    )
    if store.dialect == "sqlite":
        assert raw[1] is None  # SQLite keeps NaN as NULL; metric_values maps it back
    else:
        assert math.isnan(raw[1])
    assert (raw[2], raw[3], raw[4]) == (math.inf, -math.inf, 1.5)


def test_relogging_a_step_replaces_its_value(store: Store, store_url: str) -> None:
    run_id = _new_run(store)
    other = _new_run(store, run_key="r1")
    store.log_metrics(run_id, 1, {"loss": 1.0, "acc": 0.1})
    store.log_metrics(other, 1, {"loss": 9.0})
    store.flush()
    store.log_metrics(run_id, 1, {"loss": 2.0})  # a later batch: upsert
    store.log_metrics(run_id, 2, {"loss": 3.0})
    store.log_metrics(run_id, 2, {"loss": 4.0})  # likely the same batch: last one wins
    store.flush()
    assert store.metric_values(run_id, "loss") == [(1, 2.0), (2, 4.0)]
    assert store.metric_values(run_id, "acc") == [(1, 0.1)]
    assert store.metric_values(other, "loss") == [(1, 9.0)]
    assert _scalar(store_url, "SELECT count(*) FROM metrics") == 4
    assert store.metric_values(run_id, "missing") == []


def test_flush_makes_metrics_visible_to_another_connection(store: Store, store_url: str) -> None:
    run_id = _new_run(store)
    for step in range(1, 101):
        store.log_metrics(run_id, step, {"a": step / 2, "b": -step})
    store.flush()
    assert _scalar(store_url, "SELECT count(*) FROM metrics WHERE run_id = :r", r=run_id) == 200
    assert _scalar(store_url, "SELECT value FROM metrics WHERE key = 'a' AND step = 77") == 38.5


def test_close_flushes_pending_metrics(store_url: str) -> None:
    store = Store(store_url)
    run_id = _new_run(store)
    store.log_metrics(run_id, 1, {"a": 1.0})
    store.log_metrics(run_id, 2, {"a": 2.0})
    store.close()  # no flush() first
    assert _rows(store_url, "SELECT step, value FROM metrics ORDER BY step") == [
        {"step": 1, "value": 1.0},
        {"step": 2, "value": 2.0},
    ]


def test_a_rejected_metric_write_surfaces_at_flush_and_is_kept(
    store: Store, store_url: str
) -> None:
    run_id = _new_run(store)
    # The store's own write path, with short backoffs so the test is quick.
    _swap_writer(store, backoff_s=0.001, max_backoff_s=0.002)
    store.log_metrics(run_id + 1, 1, {"loss": 1.0})  # no such run yet: foreign key violation
    store.log_metrics(run_id, 1, {"loss": 2.0})  # queued behind it
    # A rejection is not waited out (no retry fixes it): the flush raises at once.
    with pytest.raises(StoreError, match=r"^2 metric rows are not written: the store rejected"):
        store.flush()
    with pytest.raises(StoreError) as info:
        store.flush()  # still rejected: reported again, not dropped
    assert "they are kept and retried" in str(info.value)
    assert isinstance(info.value.__cause__, IntegrityError)
    assert _scalar(store_url, "SELECT count(*) FROM metrics") == 0  # nothing jumped the queue
    # Once the run exists, the kept rows are written, in the order they were logged.
    assert _new_run(store, run_key="r1") == run_id + 1
    store.flush()
    assert store.metric_values(run_id + 1, "loss") == [(1, 1.0)]
    assert store.metric_values(run_id, "loss") == [(1, 2.0)]


def test_log_metrics_queues_a_copy_of_the_dict(store: Store, store_url: str) -> None:
    run_id = _new_run(store)
    # A writer that only writes on flush, so the dict is changed while still queued.
    _swap_writer(store, interval_s=WAIT_S * 10)
    metrics = {"loss": 1.0, "acc": 0.5}
    store.log_metrics(run_id, 1, metrics)
    metrics["loss"] = 99.0  # a later callback changes a value ...
    metrics["derived"] = 7.0  # ... and adds a derived metric
    store.flush()
    assert _rows(store_url, 'SELECT "key", step, value FROM metrics ORDER BY "key"') == [
        {"key": "acc", "step": 1, "value": 0.5},
        {"key": "loss", "step": 1, "value": 1.0},
    ]


def test_in_memory_sqlite_store_writes_metrics() -> None:
    store = Store("sqlite:///:memory:")
    try:
        run_id = _new_run(store)
        store.log_metrics(run_id, 1, {"loss": 0.5})
        store.flush()  # the writer thread must see the same in-memory database
        assert store.metric_values(run_id, "loss") == [(1, 0.5)]
        assert [e["name"] for e in store.list_experiments()] == ["exp"]
    finally:
        store.close()


# -- evals and predictions -------------------------------------------------------------------
LONG_TEXT = "Grüße, мир, 世界, 🧪🚀 — “quotes” \\ 'single' \n\ttabs " * 400  # ~20k chars


def test_predictions_round_trip_unicode_none_and_extras(store: Store, store_url: str) -> None:
    run_id = _new_run(store)
    preds: list[dict[str, Any]] = [
        {
            "example_id": "ex-ü",
            "input": LONG_TEXT,
            "output": "🚀",
            "target": "",
            "score": 0.25,
            "note": "ok",
        },
        {"example_id": None, "input": None, "output": None, "target": None, "score": None},
        {},  # every field missing
        {"example_id": 7, "input": ["a", 1], "output": {"k": "ü"}, "score": 1, "nan": math.nan},
    ]
    eval_id = store.write_eval(
        run_id,
        EvalResult("bench", {"acc": 0.5, "bad": math.nan}, breakdowns={"ü": {"acc": 1.0}}),
        preds,
    )
    rows = _rows(store_url, "SELECT * FROM predictions WHERE eval_id = :e ORDER BY idx", e=eval_id)
    assert len(rows) == 4
    assert [r["idx"] for r in rows] == [0, 1, 2, 3]
    first, nones, empty, typed = rows
    assert (first["example_id"], first["input"], first["output"]) == ("ex-ü", LONG_TEXT, "🚀")
    assert (first["target"], first["score"], _json(first["extras"])) == ("", 0.25, {"note": "ok"})
    for row in (nones, empty):
        assert [row[k] for k in ("example_id", "input", "output", "target", "score")] == [None] * 5
        assert row["extras"] is None
    assert typed["example_id"] == "7"
    assert json.loads(typed["input"]) == ["a", 1]
    assert json.loads(typed["output"]) == {"k": "ü"}
    assert typed["target"] is None and typed["score"] == 1.0
    assert _json(typed["extras"]) == {"nan": "NaN"}  # JSON has no NaN

    (ev,) = _rows(store_url, "SELECT * FROM evals")
    assert (ev["eval_id"], ev["run_id"], ev["name"], ev["step"]) == (eval_id, run_id, "bench", None)
    assert _json(ev["metrics"]) == {"acc": 0.5, "bad": "NaN"}
    assert _json(ev["breakdowns"]) == {"ü": {"acc": 1.0}}
    assert _json(ev["tags"]) == {}


@pytest.mark.parametrize("step", [5, None], ids=["step5", "after-training"])
def test_rerunning_an_eval_replaces_it_and_its_predictions(
    store: Store, store_url: str, step: int | None
) -> None:
    run_id = _new_run(store)
    other_run = _new_run(store, run_key="r1")
    first = store.write_eval(
        run_id,
        EvalResult("bench", {"acc": 0.1}, step=step),
        [{"output": f"a{i}"} for i in range(3)],
    )
    kept = [
        store.write_eval(run_id, EvalResult("bench", {"acc": 0.7}, step=9), [{"output": "s9"}]),
        store.write_eval(run_id, EvalResult("other", {"acc": 0.8}, step=step), [{"output": "o"}]),
        store.write_eval(
            other_run, EvalResult("bench", {"acc": 0.9}, step=step), [{"output": "r"}]
        ),
    ]
    second = store.write_eval(
        run_id, EvalResult("bench", {"acc": 0.2}, step=step), [{"output": "b0"}]
    )
    assert second != first

    evals = _rows(store_url, "SELECT eval_id, run_id, name, step, metrics FROM evals")
    assert len(evals) == 4
    assert sorted(e["eval_id"] for e in evals) == sorted([*kept, second])
    (replaced,) = [e for e in evals if e["eval_id"] == second]
    assert (replaced["run_id"], replaced["name"], replaced["step"]) == (run_id, "bench", step)
    assert _json(replaced["metrics"]) == {"acc": 0.2}

    preds = _rows(store_url, "SELECT eval_id, idx, output FROM predictions ORDER BY eval_id, idx")
    assert len(preds) == 4
    assert [p for p in preds if p["eval_id"] == second] == [
        {"eval_id": second, "idx": 0, "output": "b0"}
    ]
    assert _scalar(store_url, "SELECT count(*) FROM predictions WHERE eval_id = :e", e=first) == 0


# -- restarting a run ------------------------------------------------------------------------
def test_a_restarted_run_replaces_its_earlier_record(store: Store, store_url: str) -> None:
    run_id = _new_run(store)
    other = _new_run(store, run_key="other")
    for run in (run_id, other):
        for step in range(1, 11):
            store.log_metrics(run, step, {"loss": 10.0 - step, "acc": step / 10})
    store.flush()
    for run in (run_id, other):
        store.write_eval(run, EvalResult("bench", {"acc": 0.9}, step=10), [{"output": "old"}])
        store.write_checkpoint(run, ManifestRow("r0", 10, "ckpt/step-10", "save", 1.0e9))
    store.finish_run(run_id, status="crashed", error="OSError: gone", summary={"loss": 0.0})

    assert _new_run(store) == run_id  # the same run_key: the same row, started again
    store.truncate_run(run_id)  # what SqlLogger does when training starts fresh
    for step in range(1, 4):
        store.log_metrics(run_id, step, {"loss": 100.0 + step})
    store.flush()

    assert _rows(
        store_url,
        'SELECT "key", step, value FROM metrics WHERE run_id = :r ORDER BY step',
        r=run_id,
    ) == [
        {"key": "loss", "step": 1, "value": 101.0},
        {"key": "loss", "step": 2, "value": 102.0},
        {"key": "loss", "step": 3, "value": 103.0},
    ]
    for table in ("evals", "checkpoints"):
        assert _scalar(store_url, f"SELECT count(*) FROM {table} WHERE run_id = :r", r=run_id) == 0
    (run,) = _rows(
        store_url,
        "SELECT status, error, summary, ended_at FROM runs WHERE run_id = :r",
        r=run_id,
    )
    assert run == {"status": "running", "error": None, "summary": None, "ended_at": None}
    # The other run keeps everything; the old eval's predictions went with it.
    assert _scalar(store_url, "SELECT count(*) FROM metrics WHERE run_id = :r", r=other) == 20
    assert _rows(store_url, "SELECT run_id FROM evals") == [{"run_id": other}]
    assert _rows(store_url, "SELECT run_id FROM checkpoints") == [{"run_id": other}]
    assert _rows(store_url, "SELECT output FROM predictions") == [{"output": "old"}]
    assert (
        _scalar(
            store_url,
            "SELECT count(*) FROM predictions p JOIN evals e ON e.eval_id = p.eval_id "
            "WHERE e.run_id = :r",
            r=other,
        )
        == 1
    )


# -- opening a store -------------------------------------------------------------------------
def test_an_empty_database_is_migrated_to_head_on_open(store_url: str) -> None:
    engine = _engine(store_url)
    assert sa.inspect(engine).get_table_names() == []
    engine.dispose()
    store = Store(store_url)
    try:
        tables = set(sa.inspect(store.engine).get_table_names())
        assert tables == {*TABLES, *PRIVATE_TABLES, *DERIVED_TABLES, "alembic_version"}
        assert store.list_experiments() == []
    finally:
        store.close()
    assert _rows(store_url, "SELECT version_num FROM alembic_version") == [
        {"version_num": head_revision()}
    ]
    Store(store_url).close()  # opening again at head changes nothing
    assert _scalar(store_url, "SELECT count(*) FROM alembic_version") == 1


def test_resolve_url_prefers_argument_then_env_then_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert DEFAULT_URL == "sqlite:///lab.db"
    assert resolve_url() == "sqlite:///lab.db"
    assert resolve_url(None) == "sqlite:///lab.db"
    monkeypatch.setenv("LAB_STORE_URL", "sqlite:///from_env.db")
    assert resolve_url() == "sqlite:///from_env.db"
    assert resolve_url("sqlite:///arg.db") == "sqlite:///arg.db"
    monkeypatch.setenv("LAB_STORE_URL", "postgresql://u:pw@db.example/x")
    assert resolve_url() == "postgresql+psycopg://u:pw@db.example/x"  # psycopg 3, password kept
    assert resolve_url("postgres://u@h/d") == "postgresql+psycopg://u@h/d"


def test_store_opens_the_env_url_else_lab_db_in_cwd(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    Store().close()
    assert (tmp_path / "lab.db").is_file()
    monkeypatch.setenv("LAB_STORE_URL", f"sqlite:///{tmp_path / 'sub' / 'env.db'}")
    store = Store()
    store.begin_experiment("from-env", config={}, seed=0, repeats=1)
    store.close()
    con = sqlite3.connect(tmp_path / "sub" / "env.db")
    assert con.execute("SELECT name FROM experiments").fetchall() == [("from-env",)]
    con.close()
    lab_db = sqlite3.connect(tmp_path / "lab.db")
    assert lab_db.execute("SELECT count(*) FROM experiments").fetchone() == (0,)
    lab_db.close()


@pytest.mark.parametrize("url", ["mysql://x/y", "foo", "oracle://u@h/d", "duckdb:///x.db"])
def test_unknown_scheme_is_refused_with_the_supported_ones(url: str) -> None:
    for attempt in (lambda: resolve_url(url), lambda: Store(url)):
        with pytest.raises(UnknownScheme) as info:
            attempt()
        message = str(info.value)
        assert "\n" not in message
        assert "sqlite:///" in message and "postgresql://" in message
    assert not Path("x.db").exists()


def test_unknown_scheme_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAB_STORE_URL", "mysql://x/y")
    with pytest.raises(UnknownScheme, match="mysql"):
        Store()


def test_an_unsupported_postgres_driver_names_psycopg() -> None:
    with pytest.raises(UnknownScheme, match=r"asyncpg.*postgresql://"):
        resolve_url("postgresql+asyncpg://u@h/d")


def test_unreachable_postgres_raises_a_one_line_store_unreachable() -> None:
    with pytest.raises(StoreUnreachable) as info:
        Store("postgresql://postgres:lab@127.0.0.1:1/x")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("cannot reach the store at postgresql+psycopg://postgres:***@")
    assert "127.0.0.1:1/x" in message
    assert ":lab@" not in message  # the password is hidden
    assert "LAB_STORE_URL" in message


def test_a_newer_schema_is_refused_and_left_untouched(store_url: str) -> None:
    store = Store(store_url)
    run_id = _new_run(store, experiment="precious")
    store.log_metrics(run_id, 1, {"loss": 0.5})
    store.close()
    engine = _engine(store_url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = 'f00d_from_lab_9'"))
    engine.dispose()

    with pytest.raises(SchemaTooNew) as info:
        Store(store_url)
    message = str(info.value)
    assert "\n" not in message
    assert "f00d_from_lab_9" in message and head_revision() in message
    assert "pip install -U lab" in message

    assert _scalar(store_url, "SELECT version_num FROM alembic_version") == "f00d_from_lab_9"
    assert _scalar(store_url, "SELECT name FROM experiments") == "precious"
    assert _scalar(store_url, "SELECT count(*) FROM runs") == 1
    assert _scalar(store_url, "SELECT value FROM metrics") == 0.5


def test_a_database_with_lab_tables_but_no_alembic_version_is_refused(store_url: str) -> None:
    engine = _engine(store_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE runs (id INTEGER PRIMARY KEY, note TEXT)"))
        conn.execute(sa.text("CREATE TABLE users (id INTEGER PRIMARY KEY)"))
        conn.execute(sa.text("INSERT INTO runs (id, note) VALUES (1, 'not lab')"))
    engine.dispose()

    with pytest.raises(NotALabStore) as info:
        Store(store_url)
    message = str(info.value)
    assert "\n" not in message
    assert "(runs)" in message and "alembic_version" in message and "LAB_STORE_URL" in message

    engine = _engine(store_url)
    assert sorted(sa.inspect(engine).get_table_names()) == ["runs", "users"]
    engine.dispose()
    assert _rows(store_url, "SELECT id, note FROM runs") == [{"id": 1, "note": "not lab"}]


def test_other_tables_do_not_stop_lab_from_creating_its_own(store_url: str) -> None:
    engine = _engine(store_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE users (id INTEGER PRIMARY KEY)"))
    engine.dispose()
    Store(store_url).close()
    engine = _engine(store_url)
    assert set(sa.inspect(engine).get_table_names()) == {
        *TABLES,
        *PRIVATE_TABLES,
        *DERIVED_TABLES,
        "alembic_version",
        "users",
    }
    engine.dispose()


def test_sqlite_connections_have_wal_foreign_keys_and_busy_timeout(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    try:
        with store.engine.connect() as first, store.engine.connect() as second:
            for conn in (first, second):  # every pooled connection, not just the first
                assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
                assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
                assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() > 0
        # foreign keys are enforced, not just switched on
        with pytest.raises(IntegrityError, match="FOREIGN KEY"), store.engine.begin() as conn:
            conn.execute(
                sa.text("INSERT INTO groups (experiment_id, name, kind) VALUES (42, 'g', :k)"),
                {"k": "repeats"},
            )
    finally:
        store.close()
    assert _scalar(sqlite_url, "SELECT count(*) FROM groups") == 0


def test_an_open_sqlite_reader_does_not_block_the_writer(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    reader = Store(sqlite_url)
    try:
        with reader.engine.connect() as conn:
            before = conn.execute(sa.text("SELECT count(*) FROM experiments")).scalar_one()
            written = threading.Event()

            def write() -> None:
                run_id = _new_run(store, experiment="while-reading")
                store.log_metrics(run_id, 1, {"loss": 1.0})
                store.flush()
                written.set()

            writer = threading.Thread(target=write, daemon=True)
            writer.start()
            writer.join(WAIT_S)
            assert written.is_set(), "a reader's open transaction blocked the writer"
            # the reader keeps its snapshot until its transaction ends (WAL)
            assert conn.execute(sa.text("SELECT count(*) FROM experiments")).scalar_one() == 0
        assert before == 0
        assert [e["name"] for e in reader.list_experiments()] == ["while-reading"]
    finally:
        store.close()
        reader.close()


# -- reading experiments ---------------------------------------------------------------------
# Logged loss of two runs: the failed one returned no final metrics, so its listing shows
# where it got to; b-r0's returned final loss (0.25) overrides its last logged one.
LOGGED = {"a-r1": [(1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0)], "b-r0": [(1, 0.9), (2, 0.8)]}
POINTS = 6


def _two_experiments(store: Store) -> None:
    alpha = store.begin_experiment("alpha", config={"lr": 0.1}, seed=3, repeats=2)
    arms = {
        name: store.add_arm(alpha, name, overrides={"lr": lr}, config={"lr": lr, "h": 4})
        for name, lr in (("a", 0.1), ("b", 0.2))
    }
    runs = [
        ("a", 0, "completed", None, {"loss": 0.5, "acc": math.nan, "best": math.inf}),
        ("a", 1, "failed", "ValueError: boom", {}),
        ("b", 0, "completed", None, {"loss": 0.25, "acc": 0.75, "best": -math.inf}),
        ("b", 1, "stopped", None, {"loss": 0.3}),
    ]
    groups = {name: store.add_group(alpha, name, arm_id=arm_id) for name, arm_id in arms.items()}
    for arm, repeat, status, error, summary in runs:
        run_id = store.start_run(
            alpha, groups[arm], run_key=f"{arm}-r{repeat}", arm_id=arms[arm], repeat=repeat,
            stage=0, seed=3 + repeat, config={"lr": 0.1}, output_dir=None,
        )  # fmt: skip
        for step, value in LOGGED.get(f"{arm}-r{repeat}", []):
            store.log_metrics(run_id, step, {"loss": value})
        store.flush()
        store.finish_run(run_id, status=status, error=error, summary=summary)
    store.finish_experiment(alpha, status="failed")
    store.begin_experiment("beta", config={}, seed=0, repeats=1)  # still running, no runs


def test_list_experiments_counts_runs_by_status(store: Store) -> None:
    assert store.list_experiments() == []
    _two_experiments(store)
    listed = store.list_experiments()
    assert [{k: v for k, v in e.items() if k != "created_at"} for e in listed] == [
        {"name": "beta", "status": "running", "arms": 0, "repeats": 1, "runs": 0,
         "runs_by_status": {}, "points": 0, "superseded": 0, "tags": [], "notes": None},
        {"name": "alpha", "status": "failed", "arms": 2, "repeats": 2, "runs": 4,
         "runs_by_status": {"completed": 2, "failed": 1, "stopped": 1},
         "points": POINTS, "superseded": 0, "tags": [], "notes": None},
    ]  # fmt: skip
    assert all(e["created_at"] is not None for e in listed)


def test_get_experiment_returns_arms_runs_and_final_metrics(store: Store) -> None:
    _two_experiments(store)
    exp = store.get_experiment("alpha")
    assert (exp["name"], exp["status"], exp["seed"], exp["repeats"]) == ("alpha", "failed", 3, 2)
    assert exp["config"] == {"lr": 0.1}
    assert exp["ended_at"] is not None
    assert exp["arms"] == [
        {"name": "a", "overrides": {"lr": 0.1}},
        {"name": "b", "overrides": {"lr": 0.2}},
    ]
    runs = exp["runs"]
    assert [(r["run_key"], r["arm"], r["repeat"], r["seed"], r["status"], r["error"])
            for r in runs] == [
        ("a-r0", "a", 0, 3, "completed", None),
        ("a-r1", "a", 1, 4, "failed", "ValueError: boom"),
        ("b-r0", "b", 0, 3, "completed", None),
        ("b-r1", "b", 1, 4, "stopped", None),
    ]  # fmt: skip
    first = runs[0]["summary"]
    assert first["loss"] == 0.5 and first["best"] == math.inf and math.isnan(first["acc"])
    assert runs[1]["summary"] == {"loss": 1.0}
    assert [r["step"] for r in runs] == [None, 4, 2, None]
    assert runs[2]["summary"] == {"loss": 0.25, "acc": 0.75, "best": -math.inf}
    assert runs[3]["summary"] == {"loss": 0.3}
    assert all(r["callback_errors"] is None for r in runs)
    assert exp["callback_errors"] is None

    beta = store.get_experiment("beta")
    assert (beta["status"], beta["arms"], beta["runs"], beta["ended_at"]) == (
        "running",
        [],
        [],
        None,
    )


def test_finish_experiment_records_experiment_callback_errors(store: Store, store_url: str) -> None:
    errors = [
        {"callback": "Notify", "hook": "on_experiment_end", "error": "OSError: no network",
         "traceback": "Traceback (most recent call last): ...", "score": math.nan},
        {"callback": "Report", "hook": "on_experiment_start", "error": "KeyError: 'ü'"},
    ]  # fmt: skip
    exp_id = store.begin_experiment("with-errors", config={}, seed=0, repeats=1)
    clean_id = store.begin_experiment("clean", config={}, seed=0, repeats=1)
    store.finish_experiment(exp_id, status="completed", callback_errors=errors)
    store.finish_experiment(clean_id, status="completed")

    got = store.get_experiment("with-errors")
    assert got["status"] == "completed"
    assert got["callback_errors"] == [{**errors[0], "score": "NaN"}, errors[1]]  # JSON: no NaN
    assert store.get_experiment("clean")["callback_errors"] is None
    raw = _rows(store_url, "SELECT name, callback_errors FROM experiments ORDER BY name")
    assert [r["name"] for r in raw] == ["clean", "with-errors"]
    assert raw[0]["callback_errors"] is None  # SQL NULL, not the JSON text 'null'
    assert _json(raw[1]["callback_errors"])[1] == errors[1]
    assert _scalar(store_url, "SELECT count(*) FROM experiments WHERE callback_errors IS NULL") == 1

    store.begin_experiment("with-errors", config={}, seed=0, repeats=1)  # reopened: a new start
    assert store.get_experiment("with-errors")["callback_errors"] is None
    store.finish_experiment(exp_id, status="failed", callback_errors=[])  # none: NULL
    assert store.get_experiment("with-errors")["callback_errors"] is None


def test_get_experiment_of_an_unknown_name_lists_the_known_ones(store: Store) -> None:
    with pytest.raises(NoExperiment) as empty:
        store.get_experiment("nope")
    assert str(empty.value) == "no experiment named 'nope' in the store"
    _two_experiments(store)
    with pytest.raises(NoExperiment) as info:
        store.get_experiment("gamma")
    assert str(info.value) == "no experiment named 'gamma' in the store; known: alpha, beta"
    assert isinstance(info.value, KeyError)


# -- the metric writer -----------------------------------------------------------------------
def _swap_writer(store: Store, **options: Any) -> MetricWriter:
    """Give `store` a writer with test settings, closing the one it started itself."""
    if store._writer is not None:
        store._writer.close()
    store._writer = MetricWriter(store._write_metrics, **options)
    return store._writer


def _item(i: int) -> MetricItem:
    return (1, i, {"v": float(i)}, 0.0)


class GatedSink:
    """A real write function that holds every batch until `gate` opens, then keeps it."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.batches: list[list[MetricItem]] = []

    def write(self, items: list[MetricItem]) -> None:
        self.entered.set()
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        self.batches.append(list(items))

    @property
    def written(self) -> list[MetricItem]:
        return [item for batch in self.batches for item in batch]


def test_writer_put_blocks_while_full_and_drops_nothing() -> None:
    sink = GatedSink()
    writer = MetricWriter(sink.write, max_pending=2, max_batch=3)
    writer.put(*_item(0))
    assert sink.entered.wait(WAIT_S)  # the writer holds item 0 in a write that waits
    writer.put(*_item(1))
    writer.put(*_item(2))  # the buffer (2) is now full

    done: list[int] = []

    def producer() -> None:
        for i in range(3, 20):
            writer.put(*_item(i))
            done.append(i)

    thread = threading.Thread(target=producer)
    thread.start()
    thread.join(0.3)
    assert thread.is_alive() and done == []  # put(3) waits for room: back-pressure
    assert sink.batches == []

    sink.gate.set()
    thread.join(WAIT_S)
    assert not thread.is_alive() and done == list(range(3, 20))
    writer.flush()
    assert sink.written == [_item(i) for i in range(20)]  # all of them, in order
    assert all(len(b) <= 3 for b in sink.batches)  # max_batch holds
    writer.close()


def test_writer_flush_returns_only_after_the_write_committed() -> None:
    sink = GatedSink()
    writer = MetricWriter(sink.write)
    for i in range(5):
        writer.put(*_item(i))
    flushed = threading.Event()
    flusher = threading.Thread(target=lambda: (writer.flush(), flushed.set()))
    flusher.start()
    assert sink.entered.wait(WAIT_S)
    flusher.join(0.3)
    assert not flushed.is_set() and sink.written == []  # the write is still in progress
    sink.gate.set()
    flusher.join(WAIT_S)
    assert flushed.is_set()
    assert sink.written == [_item(i) for i in range(5)]
    writer.close()


def test_writer_flush_with_nothing_put_does_not_wait_for_the_thread() -> None:
    """A flush with nothing buffered or being written returns at once, even while the
    writer thread is busy before its first batch (a writer process opening the store);
    once something is put, flush waits for its commit again."""
    sink = GatedSink()
    started, release = threading.Event(), threading.Event()
    writer = MetricWriter(sink.write, on_start=lambda: (started.set(), release.wait(3 * WAIT_S)))
    assert started.wait(WAIT_S)
    empty = threading.Thread(target=writer.flush)
    empty.start()
    empty.join(WAIT_S)
    assert not empty.is_alive()  # returned while the thread is still busy
    release.set()
    writer.put(*_item(0))
    flushed = threading.Event()
    flusher = threading.Thread(target=lambda: (writer.flush(), flushed.set()))
    flusher.start()
    flusher.join(0.3)
    assert not flushed.is_set() and sink.written == []
    sink.gate.set()
    flusher.join(WAIT_S)
    assert flushed.is_set() and sink.written == [_item(0)]
    writer.close()


def test_a_flush_that_looks_while_a_failed_batch_is_on_its_way_back_still_raises() -> None:
    """The flush looks at the buffer just as the writer thread's batch fails and goes back
    into it: the flush must not take the empty buffer it saw for "all committed"."""
    inside, release, armed = threading.Event(), threading.Event(), threading.Event()

    def write(items: list[MetricItem]) -> None:
        if items:
            inside.set()
            release.wait(WAIT_S)
            raise IntegrityError("INSERT", {}, Exception("rejected"))  # no retry fixes it

    class Racing(deque):
        """A buffer whose first look by the flush lets the failing write end first."""

        def __len__(self) -> int:
            seen = super().__len__()
            if armed.is_set() and not release.is_set():
                release.set()
                _wait_until(lambda: super(Racing, self).__len__() > 0)  # the batch is back
                time.sleep(0.05)  # and the writer thread has settled it
            return seen

        def __bool__(self) -> bool:
            return len(self) > 0

    writer = MetricWriter(write, interval_s=QUIET_S)
    writer._buffer = Racing()
    writer.put(*_item(1))
    writer._wake.set()
    assert inside.wait(WAIT_S)  # the writer thread holds the batch; the buffer is empty
    armed.set()
    threading.Timer(0.2, release.set).start()  # (when the flush does not look at it)
    with pytest.raises(StoreError, match="rejected"):
        writer.flush()
    assert writer.unwritten() == 1  # kept
    with pytest.raises(StoreError):
        writer.close()


# A writer that wakes only on flush, close or a full buffer: rounds happen when a test says.
QUIET_S = WAIT_S * 10


def _wait_until(condition: Callable[[], bool]) -> None:
    """Poll `condition` until it holds, for at most WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.001)


class FailingSink:
    """A real write function that fails its first `failures` calls, then keeps every batch."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[list[int]] = []  # the steps of each attempt, failed or not
        self.batches: list[list[MetricItem]] = []
        self.recovered = threading.Event()

    def write(self, items: list[MetricItem]) -> None:
        self.calls.append([item[1] for item in items])
        if len(self.calls) <= self.failures:
            raise OSError(f"disk full (attempt {len(self.calls)})")
        self.batches.append(list(items))
        self.recovered.set()

    @property
    def written(self) -> list[MetricItem]:
        return [item for batch in self.batches for item in batch]


def test_writer_that_keeps_failing_raises_after_the_window_and_drops_nothing() -> None:
    sink = FailingSink(failures=10**9)
    writer = MetricWriter(
        sink.write, backoff_s=0.001, max_backoff_s=0.002, give_up_s=0.05, interval_s=QUIET_S
    )
    writer.put(*_item(0))
    writer.put(*_item(1))
    started = time.monotonic()
    with pytest.raises(StoreError) as info:
        writer.flush()
    assert time.monotonic() - started >= 0.05  # the outage was waited out first
    assert re.fullmatch(
        r"2 metric rows are not written: the store has failed for 0\.\ds "
        r"\(disk full \(attempt \d+\)\); they are kept and retried "
        r"\(LAB_STORE_RETRY_S sets how long to wait, now 0\.05s\)",
        str(info.value),
    ), str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    assert len(sink.calls) >= 3 and set(map(tuple, sink.calls)) == {(0, 1)}  # retried, whole
    writer.put(*_item(2))
    with pytest.raises(StoreError, match=r"^3 metric rows are not written"):
        writer.flush()  # still failing, past the window: reported at once
    assert sink.calls[-1] == [0, 1, 2]  # the kept items first, in order, then the new one
    assert sink.written == []
    with pytest.raises(StoreError, match=r"the writer stopped with 3 metric rows unwritten$"):
        writer.close()
    assert not writer._thread.is_alive()


def test_a_flush_waits_out_an_outage_shorter_than_the_window() -> None:
    sink = FailingSink(failures=7)
    writer = MetricWriter(
        sink.write, backoff_s=0.001, max_backoff_s=0.002, give_up_s=WAIT_S, interval_s=QUIET_S
    )
    for i in range(5):
        writer.put(*_item(i))
    writer.flush()  # seven failures, then the store is back: the flush never raised
    assert sink.calls == [[0, 1, 2, 3, 4]] * 8
    assert sink.written == [_item(i) for i in range(5)]
    writer.close()


def test_writer_recovers_after_a_flush_gave_up() -> None:
    sink = FailingSink(failures=7)
    writer = MetricWriter(
        sink.write, backoff_s=0.001, max_backoff_s=0.002, give_up_s=0.0, interval_s=QUIET_S
    )
    for i in range(5):
        writer.put(*_item(i))
    with pytest.raises(StoreError, match=r"^5 metric rows are not written: .*disk full"):
        writer.flush()
    assert sink.recovered.wait(WAIT_S)  # the writer goes on retrying by itself, and succeeds
    for i in range(5, 10):
        writer.put(*_item(i))
    writer.flush()  # raised once; now everything put before it is committed
    assert sink.written == [_item(i) for i in range(10)]  # each exactly once, in order
    assert sink.calls == [[0, 1, 2, 3, 4]] * 8 + [[5, 6, 7, 8, 9]]
    writer.close()


def test_a_failed_attempt_keeps_later_flushes_behind_the_kept_items() -> None:
    """Items put before a flush are committed before that flush succeeds, even when they
    failed first and items and flushes were queued behind them meanwhile."""
    sink = GatedSink()
    failing = {"left": 1}

    def write(items: list[MetricItem]) -> None:
        sink.write(items)  # waits for the gate
        if failing["left"]:
            failing["left"] -= 1
            sink.batches.pop()
            raise OSError("locked")

    writer = MetricWriter(write, backoff_s=0.001, give_up_s=0.0, interval_s=QUIET_S)
    writer.put(*_item(0))
    errors: list[BaseException] = []

    def flush() -> None:
        try:
            writer.flush()
        except StoreError as exc:
            errors.append(exc)

    first = threading.Thread(target=flush)
    first.start()
    assert sink.entered.wait(WAIT_S)  # the attempt for item 0 has begun
    writer.put(*_item(1))
    second = threading.Thread(target=flush)
    second.start()
    _wait_until(lambda: len(writer._buffer) == 2)  # [item 1, the second flush's marker]
    sink.gate.set()  # the first attempt fails (and is given up at once), the next succeeds
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert not first.is_alive() and not second.is_alive()
    # both rows are buffered and unwritten when the first flush gives up
    assert [str(e).split(":")[0] for e in errors] == ["2 metric rows are not written"]
    # the first flush failed; the second one, queued behind the kept item 0, succeeded
    assert sink.written == [_item(0), _item(1)]
    writer.close()


def test_writer_error_surfaces_at_close_too() -> None:
    def broken(items: list[MetricItem]) -> None:
        raise OSError("read-only file system")

    writer = MetricWriter(broken, backoff_s=0.001, max_backoff_s=0.002, give_up_s=0.01)
    writer.put(*_item(0))
    raised: list[BaseException] = []

    def close() -> None:
        try:
            writer.close()
        except StoreError as exc:
            raised.append(exc)

    closer = threading.Thread(target=close)
    closer.start()
    closer.join(WAIT_S)
    assert not closer.is_alive(), "close() hung on a writer that keeps failing"
    assert len(raised) == 1
    assert re.fullmatch(
        r"metrics could not be written: the store has failed for 0\.\ds \(read-only file "
        r"system\); the writer stopped with 1 metric rows unwritten",
        str(raised[0]),
    ), str(raised[0])
    writer.close()  # closed already: reported once


def test_writer_close_after_recovery_raises_nothing() -> None:
    sink = FailingSink(failures=1)
    writer = MetricWriter(sink.write, backoff_s=0.001, give_up_s=0.0, interval_s=QUIET_S)
    writer.put(*_item(0))
    with pytest.raises(StoreError):
        writer.flush()  # one failed attempt, given up at once
    writer.close()  # the next attempt succeeds: the failure is over, close has nothing to report
    assert sink.calls == [[0], [0]]
    assert sink.written == [_item(0)]


def test_writer_retries_a_transient_failure_and_loses_nothing() -> None:
    written: list[MetricItem] = []
    calls = {"n": 0}

    def flaky(items: list[MetricItem]) -> None:
        calls["n"] += 1
        if calls["n"] <= 2:
            raise OSError("database is locked")
        written.extend(items)

    writer = MetricWriter(flaky, backoff_s=0.001)
    for i in range(10):
        writer.put(*_item(i))
    writer.flush()
    assert written == [_item(i) for i in range(10)]
    assert calls["n"] >= 3
    writer.close()


def test_a_resumed_run_keeps_its_rows_up_to_the_checkpoint(store: Store, store_url: str) -> None:
    run_id = _new_run(store)
    for step in range(1, 11):
        store.log_metrics(run_id, step, {"loss": float(step)})
    for step in (5, 10, None):
        store.write_eval(run_id, EvalResult("val", {"acc": 0.5}, step=step), [{"output": "x"}])
    for step in (5, 10):
        store.write_checkpoint(run_id, ManifestRow("r0", step, f"step_{step:06d}", "save", 1e9))
    store.truncate_run(run_id, after_step=5)
    steps = _rows(store_url, "SELECT step FROM metrics WHERE run_id = :r ORDER BY step", r=run_id)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    evals = _rows(store_url, "SELECT step FROM evals WHERE run_id = :r", r=run_id)
    assert evals == [{"step": 5}]  # the post-training eval (step NULL) runs again at the end
    assert _scalar(store_url, "SELECT count(*) FROM predictions") == 1
    ckpts = _rows(store_url, "SELECT step FROM checkpoints WHERE run_id = :r", r=run_id)
    assert ckpts == [{"step": 5}]


def test_a_resume_at_the_last_step_drops_the_post_training_metrics(
    store: Store, store_url: str
) -> None:
    """A post-training benchmark writes `<eval>/<key>` at the run's last step; a resume from
    that step runs the benchmark again, so its metrics go with its eval row."""
    run_id = _new_run(store)
    for step in range(1, 4):
        store.log_metrics(run_id, step, {"loss": float(step), "val/acc": 0.25 * step})
    store.log_metrics(run_id, 3, {"holdout/acc": 0.5})
    store.write_eval(run_id, EvalResult("holdout", {"acc": 0.5}, step=None))
    store.write_eval(run_id, EvalResult("val", {"acc": 0.75}, step=3))
    assert store.last_step(run_id) == 3
    store.truncate_run(run_id, after_step=3)
    keys = _rows(
        store_url, 'SELECT "key", step FROM metrics WHERE run_id = :r AND step = 3 ORDER BY 1',
        r=run_id,
    )  # fmt: skip
    assert keys == [{"key": "loss", "step": 3}, {"key": "val/acc", "step": 3}]
    sql = 'SELECT "key" FROM summaries WHERE run_id = :r ORDER BY 1'
    summaries = _rows(store_url, sql, r=run_id)
    assert [r["key"] for r in summaries] == ["loss", "val/acc"]
    assert store.last_step(_new_run(store, "other")) is None


def test_a_write_to_a_run_or_experiment_the_store_lacks_is_refused_not_acknowledged(
    store: Store,
) -> None:
    run_id = _new_run(store)
    missing = 987654321
    line = f"no run with id {missing} in the store; lab show EXPERIMENT lists its runs"
    for write in (
        lambda: store.truncate_run(missing),
        lambda: store.truncate_run(missing, after_step=3),
        lambda: store.release_run(missing, "gone"),
        lambda: store.supersede_run(missing, "r0~1", None),
        lambda: store.finish_run(missing, status="completed"),
        lambda: store.finish_run(missing, status="completed", tags=["x"], notes="n"),
        lambda: store.set_provenance(missing, {"git": None}),
        lambda: store.set_callback_errors(missing, []),
    ):
        with pytest.raises(NoRun) as refused:
            write()
        assert str(refused.value) == line
    with pytest.raises(NoExperiment) as refused:
        store.finish_experiment(missing, status="completed")
    assert str(refused.value) == f"no experiment with id {missing} in the store; lab ls lists them"
    # a run that exists and that another process holds is left as it is, without an error
    store.release_run(run_id, "not mine", owner={"host": "elsewhere", "pid": 1})
    assert _rows(store.url, "SELECT run_id, status, error FROM runs") == [
        {"run_id": run_id, "status": "running", "error": None}
    ]
    store.finish_run(run_id, status="completed", tags=["kept"])
    ((status, tags),) = [
        tuple(r.values()) for r in _rows(store.url, "SELECT status, tags FROM runs")
    ]
    assert (status, _json(tags)) == ("completed", ["kept"])
