"""Metric batches into PostgreSQL by binary COPY (`lab.store.pg_copy`): no per-row upsert
reaches the server, and the rows, summaries and blocks a batch leaves are exactly those the
SQLite store keeps for the same batch: a step logged twice in one batch, NaN and +-inf, a
unicode key, a step logged again over a stored one, a huge batch."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa

from lab.store import Store
from lab.store.engine import one_transaction
from lab.store.metric_rows import MetricRows
from lab.store.pg_copy import STAGE
from lab.store.writer import rejected

pytestmark = pytest.mark.postgres

INF = math.inf
NAN = math.nan


@contextmanager
def _opened(url: str) -> Iterator[Store]:
    s = Store(url, writer="thread")
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def pg(pg_url: str) -> Iterator[Store]:
    with _opened(pg_url) as s:
        yield s


@pytest.fixture
def lite(sqlite_url: str) -> Iterator[Store]:
    with _opened(sqlite_url) as s:
        yield s


def _run(store: Store, key: str = "r0") -> int:
    exp = store.begin_experiment(f"copy-{key}", config={}, seed=0, repeats=1)
    group = store.add_group(exp, "g")
    return store.start_run(
        exp, group, run_key=key, arm_id=None, repeat=0, stage=0, seed=0, config={},
        output_dir=None,
    )  # fmt: skip


def _statements(engine: sa.engine.Engine) -> list[str]:
    """Every statement SQLAlchemy sends through `engine` from now on."""
    seen: list[str] = []

    def log(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        seen.append(" ".join(statement.split()))

    sa.event.listen(engine, "before_cursor_execute", log)
    return seen


def _nan(v: Any) -> Any:
    """A value as both stores give it back: SQLite keeps NaN as NULL."""
    return "nan" if v is None or (isinstance(v, float) and math.isnan(v)) else v


def _table(store: Store, sql: str) -> list[tuple[Any, ...]]:
    with store.engine.connect() as conn:
        return [tuple(_nan(v) for v in row) for row in conn.exec_driver_sql(sql)]


METRICS = 'SELECT "key", step, value, wall_time FROM metrics ORDER BY "key", step'
SUMMARIES = (
    'SELECT "key", "count", first_step, last_step, last_value, min_value, max_value, '
    'last_wall_time FROM summaries ORDER BY "key"'
)
BLOCKS = (
    'SELECT "key", block, points, step_min, step_max, value_min, value_max, value_sum, '
    'value_count, point_offsets, point_values FROM metric_blocks ORDER BY "key", block'
)


def _everything(store: Store) -> tuple[list[Any], list[Any], list[Any]]:
    blocks = [(*row[:-2], bytes(row[-2]), bytes(row[-1])) for row in _table(store, BLOCKS)]
    return _table(store, METRICS), _table(store, SUMMARIES), blocks


# Batches of (step, metrics, wall time), written one after another.
BATCHES: dict[str, list[list[tuple[int, dict[str, float], float]]]] = {
    "step twice in one batch": [
        [(1, {"loss": 1.0}, 10.0), (2, {"loss": 2.0}, 11.0), (1, {"loss": 3.0}, 12.0),
         (2, {"loss": 4.0}, 13.0), (2, {"loss": 5.0}, 14.0)],
    ],
    "nan and inf": [
        [(1, {"a": NAN, "b": INF}, 1.0), (2, {"a": -INF, "b": NAN}, 2.0),
         (3, {"a": 0.5, "b": -0.0}, 3.0)],
        [(4, {"a": NAN, "b": INF}, 4.0)],
    ],
    "unicode key": [
        [(0, {"désordre/λ 損失 🙂": 1.5}, 1.0), (1, {"désordre/λ 損失 🙂": 2.5}, 2.0)],
    ],
    "logged again over stored steps": [
        [(s, {"x": float(s)}, float(s)) for s in range(1, 11)],
        [(5, {"x": -5.0}, 50.0), (11, {"x": 11.0}, 51.0), (5, {"x": -50.0}, 52.0)],
        [(3, {"x": NAN}, 60.0)],
    ],
    "out of order across blocks": [
        [(700, {"y": 7.0}, 1.0), (3, {"y": 0.3}, 2.0), (300, {"y": 3.0}, 3.0)],
    ],
}  # fmt: skip


@pytest.mark.parametrize("case", BATCHES)
def test_a_batch_leaves_what_sqlite_keeps(case: str, pg: Store, lite: Store) -> None:
    for store in (pg, lite):
        run = _run(store)
        for batch in BATCHES[case]:
            store.metric_rows.write([(run, step, m, wall) for step, m, wall in batch])
    assert _everything(pg) == _everything(lite)


def test_the_last_value_logged_for_a_step_wins(pg: Store) -> None:
    run = _run(pg)
    pg.metric_rows.write(
        [
            (run, 1, {"loss": 1.0}, 10.0),
            (run, 1, {"loss": NAN}, 11.0),
            (run, 1, {"loss": INF}, 12.0),
        ]
    )
    assert _table(pg, METRICS) == [("loss", 1, INF, 12.0)]
    assert _table(pg, SUMMARIES) == [("loss", 1, 1, 1, INF, INF, INF, 12.0)]


MERGE = (
    f'WITH staged AS (DELETE FROM {STAGE} RETURNING run_id, "key", step, value, wall_time) '
    'INSERT INTO metrics (run_id, "key", step, value, wall_time) SELECT run_id, "key", '
    'step, value, wall_time FROM staged ON CONFLICT (run_id, "key", step) DO UPDATE '
    "SET value = excluded.value, wall_time = excluded.wall_time"
)


def test_metrics_go_by_copy_not_by_a_row_upsert(pg: Store) -> None:
    """New steps are copied into `metrics` in a savepoint; a batch with a step twice, or
    with a step stored already, is merged from the staging table. No row-by-row INSERT."""
    run = _run(pg)
    seen = _statements(pg.engine)
    pg.metric_rows.write([(run, step, {"a": step / 2, "b": -step}, 1.0) for step in range(5)])
    pg.write_metric_columns([run, run], [5, 5], ["a", "a"], [9.0, 10.0], [2.0, 3.0])
    pg.write_metric_columns([run, run], [0, 6], ["b", "b"], [7.0, 8.0], [4.0, 5.0])
    copying = [s for s in seen if s.startswith(("SAVEPOINT", "RELEASE", "ROLLBACK", "CREATE TEMP",
                                                "WITH staged", "INSERT INTO metrics"))]  # fmt: skip
    assert copying == [
        "SAVEPOINT sa_savepoint_1",
        "RELEASE SAVEPOINT sa_savepoint_1",
        f"CREATE TEMP TABLE IF NOT EXISTS {STAGE} (LIKE metrics) ON COMMIT DELETE ROWS",
        MERGE,
        "SAVEPOINT sa_savepoint_1",
        "ROLLBACK TO SAVEPOINT sa_savepoint_1",  # step 0 of b is stored
        f"CREATE TEMP TABLE IF NOT EXISTS {STAGE} (LIKE metrics) ON COMMIT DELETE ROWS",
        MERGE,
    ]
    assert _table(pg, 'SELECT "key", step, value FROM metrics ORDER BY "key", step') == [
        ("a", 0, 0.0), ("a", 1, 0.5), ("a", 2, 1.0), ("a", 3, 1.5), ("a", 4, 2.0), ("a", 5, 10.0),
        ("b", 0, 7.0), ("b", 1, -1.0), ("b", 2, -2.0), ("b", 3, -3.0), ("b", 4, -4.0),
        ("b", 6, 8.0),
    ]  # fmt: skip
    # one staging table for the connection, and nothing left in it
    assert _table(pg, f"SELECT count(*) FROM pg_class WHERE relname = '{STAGE}'") == [(1,)]


def test_a_run_that_is_not_there_is_refused_as_sqlalchemy_refuses_it(pg: Store) -> None:
    """The errors are SQLAlchemy's, as an INSERT's were: the writer drops a batch the store
    refuses (`rejected`), and `lab serve` answers 404, rather than retrying it. `metrics`
    has no foreign key on PostgreSQL: the batch's summaries refuse the run, and the rows
    copied before them go with the transaction."""
    run = _run(pg)
    with pytest.raises(sa.exc.IntegrityError, match="fk_summaries_run_id_runs") as caught:
        pg.metric_rows.write([(run + 1000, step, {"a": 1.0}, 1.0) for step in range(100)])
    assert rejected(caught.value)
    assert _table(pg, "SELECT count(*) FROM metrics") == [(0,)]
    pg.metric_rows.write([(run, 1, {"a": 1.0}, 1.0)])  # the connection goes on
    assert _table(pg, METRICS) == [("a", 1, 1.0, 1.0)]


def test_metrics_and_blocks_have_no_foreign_key_and_go_with_their_run(pg: Store) -> None:
    """Revisions 0010 and 0011: no foreign key from `metrics` nor `metric_blocks` to
    `runs`; a run deleted (by `delete_experiment`'s cascade, or by a DELETE) takes both."""
    inspector = sa.inspect(pg.engine)
    assert inspector.get_foreign_keys("metrics") == []
    assert inspector.get_foreign_keys("metric_blocks") == []
    runs = [_run(pg, f"r{i}") for i in range(3)]
    for run in runs:
        pg.metric_rows.write([(run, step, {"a": 1.0, "b": 2.0}, 1.0) for step in range(40)])
    per_run = "SELECT run_id, count(*) FROM metrics GROUP BY run_id ORDER BY run_id"
    blocks = "SELECT run_id, count(*) FROM metric_blocks GROUP BY run_id ORDER BY run_id"
    assert _table(pg, per_run) == [(run, 80) for run in runs]
    assert _table(pg, blocks) == [(run, 4) for run in runs]  # 2 keys x 2 blocks
    pg.finish_run(runs[0], status="completed")
    assert pg.delete_experiment("copy-r0")["runs"] == 1
    assert _table(pg, per_run) == [(run, 80) for run in runs[1:]]
    assert _table(pg, blocks) == [(run, 4) for run in runs[1:]]
    with pg.engine.begin() as conn:
        conn.exec_driver_sql(f"DELETE FROM runs WHERE run_id = {runs[1]}")
    assert _table(pg, per_run) == [(runs[2], 80)]
    assert _table(pg, blocks) == [(runs[2], 4)]
    with pg.engine.begin() as conn:  # the trigger does not stand in the way of naming them
        conn.exec_driver_sql("TRUNCATE runs, metrics, metric_blocks CASCADE")
    assert _table(pg, "SELECT count(*) FROM metrics") == [(0,)]


def test_the_blocks_are_cut_while_the_server_takes_the_rows(
    pg: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's blocks are cut once, after its rows are sent and before the server has
    answered the COPY (the connection is still in it), so that this process's work and the
    server's overlap; on the staging path too (a step stored already), where the cut of
    the refused first copy serves. A cut that fails fails the batch, and nothing of it is
    kept."""
    from psycopg.pq import TransactionStatus

    from lab.store.blocks import Blocks

    cut = Blocks.cut
    states: list[Any] = []
    active: list[Any] = []

    def remember(conn: Any, *_: Any) -> None:  # the driver connection of the batch
        active[:] = [conn.connection.driver_connection]

    def watched(series: Any, acc: Any) -> Any:
        states.append(active[0].info.transaction_status)
        return cut(series, acc)

    sa.event.listen(pg.engine, "begin", remember)
    monkeypatch.setattr(Blocks, "cut", staticmethod(watched))
    run = _run(pg)
    pg.metric_rows.write([(run, step, {"a": float(step)}, 1.0) for step in range(100)])
    assert states == [TransactionStatus.ACTIVE]  # a command (the COPY) in progress
    pg.metric_rows.write([(run, step, {"a": -1.0}, 2.0) for step in range(90, 110)])
    assert states == [TransactionStatus.ACTIVE] * 2  # once, in the copy refused
    assert _table(pg, "SELECT count(*), sum(value) FROM metrics") == [(110, sum(range(90)) - 20.0)]
    points = _table(pg, "SELECT block, points, value_sum FROM metric_blocks ORDER BY block")
    assert points == [(0, 32, float(sum(range(32)))), (1, 32, float(sum(range(32, 64)))),
                      (2, 26 + 6, float(sum(range(64, 90))) - 6.0),
                      (3, 14, -14.0)]  # fmt: skip

    def broken(series: Any, acc: Any) -> Any:
        raise RuntimeError("cut failed")

    monkeypatch.setattr(Blocks, "cut", staticmethod(broken))
    with pytest.raises(RuntimeError, match="cut failed"):
        pg.metric_rows.write([(run, step, {"a": 1.0}, 3.0) for step in range(110, 120)])
    assert _table(pg, "SELECT count(*) FROM metrics") == [(110,)]


def test_new_blocks_go_by_copy(pg: Store) -> None:
    """A batch's blocks after each key's first are copied, in a savepoint; the first is
    merged, since it may be stored already. The blocks are those SQLite keeps."""
    run = _run(pg)
    seen = _statements(pg.engine)
    pg.metric_rows.write([(run, step, {"a": float(step)}, 1.0) for step in range(40)])
    pg.metric_rows.write([(run, step, {"a": float(step)}, 1.0) for step in range(40, 100)])
    merged = [s for s in seen if s.startswith("INSERT INTO metric_blocks")]
    assert len(merged) == 2  # one row each: the first block of each batch
    points = _table(pg, "SELECT block, points FROM metric_blocks ORDER BY block")
    assert points == [(0, 32), (1, 32), (2, 32), (3, 4)]


def test_a_block_stored_already_is_merged_not_refused(pg: Store) -> None:
    """A store whose blocks run past its summaries (rows deleted around lab): the COPY of
    the batch's blocks finds one stored, rolls back its savepoint, and merges them."""
    run = _run(pg)
    pg.metric_rows.write([(run, step, {"a": 1.0}, 1.0) for step in range(100)])
    with pg.engine.begin() as conn:
        conn.exec_driver_sql("DELETE FROM metrics WHERE step >= 32")
        conn.exec_driver_sql('UPDATE summaries SET last_step = 31, "count" = 32')
    pg.metric_rows.write([(run, step, {"a": 2.0}, 2.0) for step in range(32, 100)])
    assert _table(pg, "SELECT count(*), sum(value) FROM metrics") == [(100, 32 + 2 * 68)]
    points = _table(pg, "SELECT block, points FROM metric_blocks ORDER BY block")
    assert points == [(0, 32), (1, 64), (2, 64), (3, 8)]  # stored and merged, as told


def test_a_huge_batch(pg: Store) -> None:
    run = _run(pg)
    keys = [f"k{i:02d}" for i in range(20)]
    items = [(run, step, {k: step + i / 100 for i, k in enumerate(keys)}, float(step))
             for step in range(10_000)]  # fmt: skip
    pg.metric_rows.write(items)
    assert _table(pg, "SELECT count(*), sum(step), min(value), max(value) FROM metrics") == [
        (200_000, 20 * 49_995_000, 0.0, 9999.19)
    ]
    summaries = _table(pg, SUMMARIES)
    assert summaries[0] == ("k00", 10_000, 0, 9999, 9999.0, 0.0, 9999.0, 9999.0)
    assert summaries[19] == ("k19", 10_000, 0, 9999, 9999.19, 0.19, 9999.19, 9999.0)


def test_a_rolled_back_batch_leaves_the_next_one_its_staging_table(pg: Store) -> None:
    """A batch whose merge fails (a run that is not there; a step twice, so it goes through
    the staging table) rolls back the transaction that made the connection's staging table;
    the next batch on that connection makes it again."""
    run = _run(pg)
    one = sa.create_engine(pg.engine.url, pool_size=1, max_overflow=0)  # one connection
    try:
        rows = MetricRows(one)
        with pytest.raises(sa.exc.IntegrityError, match="violates foreign key constraint"):
            rows.write([(run + 1000, 1, {"a": 1.0}, 1.0), (run + 1000, 1, {"a": 1.5}, 1.5)])
        rows.write([(run, 1, {"a": 2.0}, 2.0), (run, 1, {"a": 3.0}, 3.0)])
    finally:
        one.dispose()
    assert _table(pg, METRICS) == [("a", 1, 3.0, 3.0)]


def test_the_writer_process_copies_too(pg_url: str) -> None:
    store = Store(pg_url, writer="process")
    try:
        assert store.writer_mode == "process"
        run = _run(store)
        for step in range(300):
            store.log_metrics(run, step, {"loss": 1 / (step + 1), "nan": NAN})
        store.log_metrics(run, 299, {"loss": -1.0, "nan": NAN})  # logged again: a merge
        store.flush()
        # the writer process's session made the staging table to merge the step logged
        # again (a session's temp tables are listed in pg_class for every session)
        made = _table(store, f"SELECT count(*) FROM pg_class WHERE relname = '{STAGE}'")
        assert made == [(1,)]
        assert [row[:7] for row in _table(store, SUMMARIES)] == [
            ("loss", 300, 0, 299, -1.0, -1.0, 1.0),
            ("nan", 300, 0, 299, "nan", "nan", "nan"),
        ]
    finally:
        store.close()


def test_many_stores_copy_into_one_server_at_once(pg_url: str) -> None:
    """Stores on one server at once (each with its own staging table per connection) lose
    nothing and mix nothing up."""
    stores = [Store(pg_url, writer="thread") for _ in range(4)]
    try:
        runs = [_run(s, f"r{i}") for i, s in enumerate(stores)]
        for step in range(2_000):
            for i, (s, run) in enumerate(zip(stores, runs, strict=True)):
                s.log_metrics(run, step, {"i": float(i), "step": float(step)})
        for s in stores:
            s.flush()
        got = _table(stores[0], 'SELECT run_id, "key", count(*), sum(value) FROM metrics '
                                'GROUP BY run_id, "key" ORDER BY run_id, "key"')  # fmt: skip
        assert got == [
            row for i, run in enumerate(runs)
            for row in ((run, "i", 2_000, 2_000.0 * i), (run, "step", 2_000, 1_999_000.0))
        ]  # fmt: skip
    finally:
        for s in stores:
            s.close()


def test_two_batches_in_one_transaction(pg: Store) -> None:
    """`lab serve` writes a client's batch of ops in one transaction, and it may hold two
    metric batches that log the same step: the second's value wins, the first's rows are
    not copied twice."""
    run = _run(pg)
    with one_transaction(pg.engine):
        pg.write_metric_columns([run, run], [1, 2], ["a", "a"], [1.0, 2.0], [1.0, 2.0])
        pg.write_metric_columns([run], [2], ["a"], [-2.0], [3.0])
    assert _table(pg, METRICS) == [("a", 1, 1.0, 1.0), ("a", 2, -2.0, 3.0)]
    assert _table(pg, SUMMARIES) == [("a", 2, 1, 2, -2.0, -2.0, 1.0, 3.0)]


def test_a_savepoint_rolled_back_around_a_batch_leaves_the_next_one_its_staging_table(
    pg: Store,
) -> None:
    """A caller's savepoint that made the staging table and was rolled back took the table
    with it: the next batch in the transaction makes it again."""
    run = _run(pg)
    twice = [(run, 1, {"a": 1.0}, 1.0), (run, 1, {"a": 2.0}, 2.0)]
    with one_transaction(pg.engine) as conn:
        saved = conn.begin_nested()
        pg.metric_rows.write(twice)
        saved.rollback()
        pg.metric_rows.write([twice[0], (run, 1, {"a": 3.0}, 3.0)])
    assert _table(pg, METRICS) == [("a", 1, 3.0, 3.0)]
