"""Summaries on write, and exact values: through the store and back through DuckDB."""

from __future__ import annotations

import math
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_store import _new_run, _rows

import lab.inspect
from lab.store import Store


def _nan_eq(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or (math.isnan(a) and math.isnan(b))


def _summaries(store_url: str, run_id: int) -> dict[str, dict[str, Any]]:
    rows = _rows(
        store_url,
        'SELECT "key", "count", first_step, last_step, last_value, min_value, max_value '
        "FROM summaries WHERE run_id = :r",
        r=run_id,
    )
    nan_is_null = store_url.startswith("sqlite")
    for row in rows:  # SQLite stores a NaN as NULL; only last_value may hold one
        if nan_is_null and row["last_value"] is None:
            row["last_value"] = math.nan
    return {row.pop("key"): row for row in rows}


def _expected(points: dict[str, dict[int, float]]) -> dict[str, dict[str, Any]]:
    """What summaries must say, from the points as the store holds them (last write wins)."""
    out = {}
    for key, by_step in points.items():
        steps = sorted(by_step)
        kept = [v for v in by_step.values() if not math.isnan(v)]
        out[key] = {
            "count": len(steps),
            "first_step": steps[0],
            "last_step": steps[-1],
            "last_value": by_step[steps[-1]],
            "min_value": min(kept) if kept else None,
            "max_value": max(kept) if kept else None,
        }
    return out


def _assert_same(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]]) -> None:
    assert set(got) == set(want)
    for key in want:
        for field in want[key]:
            assert _nan_eq(got[key][field], want[key][field]), (key, field, got[key], want[key])


def test_summaries_follow_every_flush(store: Store, store_url: str) -> None:
    run_id = _new_run(store)
    points: dict[str, dict[int, float]] = {"loss": {}, "acc": {}, "gone": {}}
    values = {1: 3.0, 2: math.nan, 3: -math.inf, 4: 0.5, 5: math.inf, 6: 2.0}
    for step, value in values.items():
        store.log_metrics(run_id, step, {"loss": value, "acc": step / 10, "gone": math.nan})
        points["loss"][step] = value
        points["acc"][step] = step / 10
        points["gone"][step] = math.nan
        if step % 2 == 0:
            store.flush()  # several batches: each merged into the row the last one left
            _assert_same(_summaries(store_url, run_id), _expected(points))
    got = _summaries(store_url, run_id)
    assert got["loss"]["min_value"] == -math.inf and got["loss"]["max_value"] == math.inf
    assert got["gone"]["min_value"] is None and math.isnan(got["gone"]["last_value"])


def test_relogging_a_step_recomputes_its_summary(store: Store, store_url: str) -> None:
    run_id = _new_run(store)
    for step, value in ((1, 1.0), (2, -5.0), (3, 2.0)):
        store.log_metrics(run_id, step, {"loss": value})
    store.flush()
    store.log_metrics(run_id, 2, {"loss": 0.0})  # the min is replaced, not added to
    store.log_metrics(run_id, 3, {"loss": math.nan})  # the last value becomes NaN
    store.flush()
    _assert_same(_summaries(store_url, run_id), _expected({"loss": {1: 1.0, 2: 0.0, 3: math.nan}}))


def test_a_step_logged_twice_in_one_batch_is_counted_once(store: Store, store_url: str) -> None:
    """Within one batch a step logged again replaces its value (one row), so the summary
    counts it once and its first value leaves no trace in the min or max; steps out of
    order in a batch are summarized from the rows too. The blocks agree."""
    run_id = _new_run(store)
    store.log_metrics(run_id, 1, {"loss": 1.0, "b": 3.0})
    store.log_metrics(run_id, 2, {"loss": 5.0, "b": 1.0})
    store.log_metrics(run_id, 2, {"loss": 2.0})  # before any flush: the same batch
    store.log_metrics(run_id, 0, {"b": 2.0})  # out of order
    store.flush()
    want = {"loss": {1: 1.0, 2: 2.0}, "b": {0: 2.0, 1: 3.0, 2: 1.0}}
    _assert_same(_summaries(store_url, run_id), _expected(want))
    blocks = _rows(store_url, 'SELECT "key", points, step_min, step_max, value_min, value_max, '
                   "value_sum, value_count FROM metric_blocks WHERE run_id = :r "
                   'ORDER BY "key"', r=run_id)  # fmt: skip
    assert [tuple(b.values()) for b in blocks] == [
        ("b", 3, 0, 2, 1.0, 3.0, 6.0, 3),
        ("loss", 2, 1, 2, 1.0, 2.0, 3.0, 2),
    ]


def test_a_resume_truncates_the_summaries_too(store: Store, store_url: str) -> None:
    run_id = _new_run(store)
    for step in range(1, 11):
        store.log_metrics(run_id, step, {"loss": float(10 - step), "late": float(step)})
    store.flush()
    store.truncate_run(run_id, after_step=4)
    want = {"loss": {s: float(10 - s) for s in range(1, 5)}, "late": {s: s for s in range(1, 5)}}
    _assert_same(_summaries(store_url, run_id), _expected(want))
    for step in range(5, 8):  # the run goes on from its checkpoint
        store.log_metrics(run_id, step, {"loss": 100.0})
    store.flush()
    want["loss"].update({5: 100.0, 6: 100.0, 7: 100.0})
    _assert_same(_summaries(store_url, run_id), _expected(want))
    store.truncate_run(run_id)  # a fresh start
    assert _summaries(store_url, run_id) == {}


def test_final_metrics_reads_the_summaries(store: Store, store_url: str) -> None:
    run_id = _new_run(store, experiment="e")
    for step in range(1, 4):
        store.log_metrics(run_id, step, {"loss": float(step), "nan": math.nan})
    store.flush()
    store.close()
    con = lab.inspect.connect(store_url)
    rows = con.sql(
        "SELECT key, step, value, min_value, max_value, count FROM final_metrics ORDER BY key"
    ).fetchall()
    assert rows[0] == ("loss", 3, 3.0, 1.0, 3.0, 3)
    assert rows[1][:2] == ("nan", 3) and math.isnan(rows[1][2]) and rows[1][3:] == (None, None, 3)


# Keys the store takes: 1..255 characters of valid unicode, without NUL.
KEYS = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    min_size=1,
    max_size=255,
)
VALUES = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True)


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.dictionaries(KEYS, st.lists(VALUES, min_size=1, max_size=4), min_size=1, max_size=4))
def test_any_float_and_unicode_key_round_trips_through_the_store_and_duckdb(
    backend: str, data: dict[str, list[float]], request: pytest.FixtureRequest
) -> None:
    url = _fresh_url(backend, request)
    store = Store(url)
    try:
        run_id = _new_run(store)
        for key, values in data.items():
            for step, value in enumerate(values, start=1):
                store.log_metrics(run_id, step, {key: value})
        store.flush()
        back = {key: store.metric_values(run_id, key) for key in data}
    finally:
        store.close()
    for key, values in data.items():  # -0.0 == 0.0: SQLite keeps no sign on a zero
        assert [s for s, _ in back[key]] == list(range(1, len(values) + 1))
        assert all(_nan_eq(v, w) for (_, v), w in zip(back[key], values, strict=True)), key
    con = lab.inspect.connect(url)
    try:
        got: dict[str, list[float]] = {}
        for key, _step, value in con.sql(
            "SELECT key, step, value FROM metrics ORDER BY key, step"
        ).fetchall():
            got.setdefault(key, []).append(value)
        assert set(got) == set(data)
        for key, values in data.items():
            assert all(_nan_eq(v, w) for v, w in zip(got[key], values, strict=True)), key
        last = dict(con.sql("SELECT key, value FROM final_metrics").fetchall())
        assert all(_nan_eq(last[key], values[-1]) for key, values in data.items())
    finally:
        con.close()


_examples = {"n": 0}


def _fresh_url(backend: str, request: pytest.FixtureRequest) -> str:
    """A new, empty database for each Hypothesis example (fixtures run once per test)."""
    _examples["n"] += 1
    if backend == "sqlite":
        folder = request.getfixturevalue("tmp_path")
        return f"sqlite:///{folder / 'example{}.db'.format(_examples['n'])}"
    url = sa.engine.make_url(request.getfixturevalue("pg_url"))
    admin = sa.create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:  # the fixture's database, dropped and made anew
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{url.database}" WITH (FORCE)')
            conn.exec_driver_sql(f'CREATE DATABASE "{url.database}"')
    finally:
        admin.dispose()
    return url.render_as_string(hide_password=False)
