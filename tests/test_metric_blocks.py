"""The metric blocks (`lab.store.blocks`): kept equal to what the metric rows say through
every write, rewrite and delete, and the cut of a series from them equal to the cut of its
points, on SQLite and PostgreSQL."""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from lab.server.read import bucket_bounds
from lab.store import Store, blocks
from lab.store.schema import BLOCK_STEPS

B = BLOCK_STEPS


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = Store(store_url)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def sqlite_store(sqlite_url: str) -> Iterator[Store]:
    """The cut reads the blocks on SQLite only (PostgreSQL's readers scan the points)."""
    s = Store(sqlite_url)
    try:
        yield s
    finally:
        s.close()


def _run(store: Store, name: str = "blocks") -> int:
    exp = store.begin_experiment(name, config={}, seed=0, repeats=1)
    arm = store.add_arm(exp, "a", overrides={}, config={})
    group = store.add_group(exp, "a", arm_id=arm)
    return store.start_run(
        exp, group, run_key="a-r0", arm_id=arm, repeat=0, stage=0, seed=0, config={},
        output_dir=None,
    )  # fmt: skip


def _points(store: Store, run: int, key: str) -> list[tuple[int, float]]:
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.text('SELECT step, value FROM metrics WHERE run_id = :r AND "key" = :k '
                    "ORDER BY step"), {"r": run, "k": key},
        ).all()  # fmt: skip
    return [(s, math.nan if v is None else v) for s, v in rows]


def _blocks(store: Store, run: int) -> dict[tuple[str, int], tuple[Any, ...]]:
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.text('SELECT "key", block, points, step_min, step_max, value_min, value_max, '
                    "value_sum, value_count, point_offsets, point_values FROM metric_blocks "
                    "WHERE run_id = :r"), {"r": run},
        ).all()  # fmt: skip
    return {(r[0], r[1]): (*r[2:9], _unpacked(r[1], r[9], r[10])) for r in rows}


def _unpacked(block: int, offsets: bytes, values: bytes) -> list[tuple[int, float]]:
    """A block's packed points as (step, value), NaN compared as a string."""
    assert len(values) == 8 * len(offsets)
    numbers = struct.unpack(f"<{len(offsets)}d", values)
    return [(block * B + o, repr(v)) for o, v in zip(bytes(offsets), numbers, strict=True)]


def _want_blocks(store: Store, run: int, keys: list[str]) -> dict[tuple[str, int], tuple]:
    """The blocks by their definition, from the points as stored."""
    out: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for key in keys:
        for step, value in _points(store, run, key):
            out.setdefault((key, step // B), []).append((step, value))
    want = {}
    for where, points in out.items():
        finite = [v for _, v in points if not math.isnan(v)]
        want[where] = (
            len(points), points[0][0], points[-1][0], min(finite) if finite else None,
            max(finite) if finite else None, _total(finite) if finite else None, len(finite),
            [(step, repr(v)) for step, v in points],
        )  # fmt: skip
    return want


def _assert_blocks_are_the_points(store: Store, run: int, keys: list[str]) -> None:
    got, want = _blocks(store, run), _want_blocks(store, run, keys)
    assert sorted(got) == sorted(want)
    for where, row in want.items():
        assert got[where][:5] == row[:5], where
        assert got[where][6:] == row[6:], where  # the count, and the points packed in order
        if row[5] is None or math.isinf(row[5]) or math.isnan(row[5]):
            continue  # inf + -inf: compared through min and max
        assert got[where][5] == pytest.approx(row[5], rel=1e-12, abs=1e-12), where


def test_blocks_follow_every_write_rewrite_truncation_and_delete(store: Store) -> None:
    """Batches out of order, a step logged again, NaN, ±inf and negative steps: after each,
    every block equals its definition from the stored points; a truncation rebuilds the
    blocks it cut into, and deleting the experiment takes them all."""
    run = _run(store)
    rng = random.Random(7)
    steps = list(range(-70, 1000))
    rng.shuffle(steps)
    for k, step in enumerate(steps):
        value = math.sin(step) * 100
        if k % 97 == 0:
            value = math.nan
        elif k % 211 == 0:
            value = math.inf if k % 2 else -math.inf
        store.log_metrics(run, step, {"y": value, "z": float(step)})
        if k % 150 == 0:
            store.flush()  # batches of scattered steps
    store.flush()
    for step in range(40, 50):  # logged again: the blocks take the new values
        store.log_metrics(run, step, {"y": 1e6 + step})
    store.log_metrics(run, 0, {"y": math.nan})  # a block whose points ...
    store.flush()
    _assert_blocks_are_the_points(store, run, ["y", "z"])
    assert _blocks(store, run)[("y", 1)][4] == 1e6 + 49  # 40..49 live in block 1
    assert _blocks(store, run)[("y", -3)][:3] == (6, -70, -65)  # floor(-70 / 32) = -3

    with store.engine.connect() as conn:
        total = conn.execute(sa.text("SELECT sum(points) FROM metric_blocks")).scalar()
    assert total == 2 * 1070

    store.truncate_run(run, after_step=500)  # in the middle of block 15 (480..511)
    assert [s for s, _ in _points(store, run, "z")] == list(range(-70, 501))
    _assert_blocks_are_the_points(store, run, ["y", "z"])
    assert _blocks(store, run)[("z", 15)][:3] == (21, 480, 500)
    assert max(b for _, b in _blocks(store, run)) == 15

    store.truncate_run(run)
    assert _blocks(store, run) == {}
    store.log_metrics(run, 3, {"y": 2.0})
    store.flush()
    assert _blocks(store, run) == {("y", 0): (1, 3, 3, 2.0, 2.0, 2.0, 1, [(3, "2.0")])}

    store.finish_run(run, status="completed")
    store.delete_experiment("blocks")
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM metric_blocks")).scalar() == 0


def test_batches_that_extend_a_series_are_folded_into_its_blocks(store: Store) -> None:
    """Batches in step order, flushed mid-block, with NaN, inf + -inf in one block and a
    key that starts late: each is folded into the stored blocks from the rows in hand, and
    every block equals its definition."""
    run = _run(store)
    for step in range(-40, 300):
        value = math.nan if step % 13 == 0 else math.cos(step)
        if step in (100, 101):
            value = math.inf if step == 100 else -math.inf
        row = {"y": value}
        if step >= 150:
            row["late"] = float(step)
        store.log_metrics(run, step, row)
        if step % 45 == 0:
            store.flush()  # batches end inside blocks
            _assert_blocks_are_the_points(store, run, ["y", "late"])
    store.flush()
    _assert_blocks_are_the_points(store, run, ["y", "late"])
    got = _blocks(store, run)
    total = got[("y", 3)][5]  # steps 96..127 hold inf and -inf: their sum is NaN
    assert got[("y", 3)][0] == 32 and (total is None or math.isnan(total))
    assert got[("late", 4)][:3] == (10, 150, 159)


def test_one_batch_of_many_statements_replaces_what_it_logs_again(store: Store) -> None:
    """One batch far larger than a statement of rows (SQLite writes many rows a statement,
    `lab.store.sqlite_rows`) that only adds steps, then one that logs stored steps again,
    a step twice and NaN and +-inf among them: every (run, key, step) holds its last value,
    once, and the blocks and the summaries are those of the rows."""
    run = _run(store)
    t = 1.0
    store.metric_rows.write([(run, s, {"y": s / 3, "z": -s / 3}, t) for s in range(1500)])
    want = {key: {s: sign * s / 3 for s in range(1500)} for key, sign in (("y", 1), ("z", -1))}
    again = []
    for s in range(1000, 1900):  # 1000..1499 stored: logged again
        value = math.nan if s % 17 == 0 else s * 2.0
        again.append((run, s, {"y": value, "z": value}, t))
        want["y"][s] = want["z"][s] = value
    again[450] = (run, 1450, {"y": math.inf, "z": -math.inf}, t)
    again.append((run, 1450, {"y": -math.inf}, t))  # twice in the batch: the last one wins
    want["y"][1450], want["z"][1450] = -math.inf, -math.inf
    store.metric_rows.write(again)
    for key in ("y", "z"):
        got = dict(_points(store, run, key))
        assert sorted(got) == sorted(want[key])  # each step once
        assert all(_same(got[s], v) for s, v in want[key].items()), key
    _assert_blocks_are_the_points(store, run, ["y", "z"])
    with store.engine.connect() as conn:
        summaries = conn.execute(
            sa.text('SELECT "key", "count", first_step, last_step, min_value, max_value, '
                    "last_value FROM summaries WHERE run_id = :r"), {"r": run},
        ).all()  # fmt: skip
    for key, count, first, last, lo, hi, value in summaries:
        numbers = [v for v in want[key].values() if not math.isnan(v)]
        assert (count, first, last, lo, hi) == (1900, 0, 1899, min(numbers), max(numbers))
        assert _same(math.nan if value is None else value, want[key][1899])


def test_columns_written_by_the_server_path_keep_blocks_too(store: Store) -> None:
    """`write_metric_columns` (what `lab serve` calls with a client's batch) keeps them."""
    run = _run(store)
    steps = list(range(0, 300))
    store.write_metric_columns([run] * 300, steps, ["q"] * 300, [s * 0.5 for s in steps],
                               [1.0] * 300)  # fmt: skip
    _assert_blocks_are_the_points(store, run, ["q"])
    assert len(_blocks(store, run)) == math.ceil(300 / B)


def _series(store: Store) -> tuple[int, list[int], list[float]]:
    run = _run(store, "cut")
    rng = random.Random(3)
    steps = sorted(rng.sample(range(-500, 40_000), 12_000))  # gaps of every size
    values = [math.sin(s / 300) * 10 + rng.random() for s in steps]
    values[5] = math.nan
    values[6000], values[6001] = math.inf, -math.inf
    for i in range(11_800, 12_000):
        values[i] = math.nan  # the last buckets hold NaN only
    for step, value in zip(steps, values, strict=True):
        store.log_metrics(run, step, {"y": value})
    store.flush()
    return run, steps, values


def _by_definition(steps: list[int], values: list[float], n: int) -> dict[int, tuple]:
    lo, hi = steps[0], steps[-1]
    out: dict[int, list[tuple[int, float]]] = {}
    for step, value in zip(steps, values, strict=True):
        out.setdefault((step - lo) * n // (hi - lo + 1), []).append((step, value))
    cells = {}
    for i, points in out.items():
        finite = [v for _, v in points if not math.isnan(v)]
        cells[i] = (
            points[0][0], points[-1][0], min(finite) if finite else None,
            max(finite) if finite else None, _total(finite), len(finite), points[-1][1],
        )  # fmt: skip
    return cells


def _total(finite: list[float]) -> float:
    try:
        return math.fsum(finite)
    except ValueError:  # inf + -inf
        return math.nan


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        if not math.isinf(a) and not math.isinf(b):
            return a == pytest.approx(b, rel=1e-9, abs=1e-9)
    return a == b


def _cut(store: Store, run: int, lo: int, hi: int, n: int, **kw: Any) -> dict[int, tuple]:
    bounds = bucket_bounds(lo, hi, n)
    with store.engine.connect() as conn:
        return {i: c for (_, i), c in blocks.cut(conn, "y", [run], bounds, last=True, **kw).items()}


def test_the_cut_from_blocks_is_the_cut_of_the_points(sqlite_store: Store) -> None:
    """Bucket widths below, at and far above a block, edges off the block boundaries: the
    cut from the blocks and the edge points equals the definition (the sum to rounding)."""
    run, steps, values = _series(sqlite_store)
    lo, hi = steps[0], steps[-1]
    for n in (1, 2, 7, 100, 333, 1000, 5000, 40_000):
        want = _by_definition(steps, values, n)
        for kw in ({}, {"from_points": True}):
            got = _cut(sqlite_store, run, lo, hi, n, **kw)
            assert sorted(got) == sorted(want), (n, kw)
            for i, cell in want.items():
                assert all(_same(a, b) for a, b in zip(got[i], cell, strict=True)), (n, i, kw)


def test_blocks_that_do_not_add_up_are_not_trusted(sqlite_store: Store) -> None:
    """A block whose points are gone from `metric_blocks` (a store written by something
    that skipped them): the run's cut is read from its points, still right. The check is
    on the count: a block that is changed but still counts its points is read as it is,
    which shows that a trusted cut reads the blocks at all."""
    run, steps, values = _series(sqlite_store)
    lo, hi = steps[0], steps[-1]
    want = _cut(sqlite_store, run, lo, hi, 10, from_points=True)
    low = min(v for v in values if not math.isnan(v) and not math.isinf(v))
    where = steps[values.index(low)] // B
    with sqlite_store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE metric_blocks SET value_max = 1e300 WHERE block = :b"),
                     {"b": where})  # fmt: skip
    doctored = _cut(sqlite_store, run, lo, hi, 10)
    assert 1e300 in [c[3] for c in doctored.values()]  # the blocks are what it reads
    with sqlite_store.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM metric_blocks WHERE block = :b"), {"b": where})
    got = _cut(sqlite_store, run, lo, hi, 10)  # read from the points: nothing lost
    assert sorted(got) == sorted(want)
    assert all(_same(a, b) for i in want for a, b in zip(got[i], want[i], strict=True))


def test_a_cut_shared_out_to_several_connections_is_the_same_cut(sqlite_store: Store) -> None:
    """`cut_on` shares a big cut out to several connections on a SQLite file: the same
    cells as one `cut`, for any number of shares, more than there are buckets included."""
    run, steps, _ = _series(sqlite_store)
    lo, hi = steps[0], steps[-1]
    for n in (1, 3, 1000, 2500):
        bounds = bucket_bounds(lo, hi, n)
        with sqlite_store.engine.connect() as conn:
            one = blocks.cut(conn, "y", [run], bounds, last=True)
        for parts in (2, 3, 4, 5000):
            split = blocks.cut_on(sqlite_store.engine, "y", [run], bounds, last=True, parts=parts)
            assert sorted(split) == sorted(one)
            assert all(_same(a, b) for k in one for a, b in zip(split[k], one[k], strict=True))


def _packed(store: Store, run: int, lo: int, hi: int, n: int) -> tuple[dict[int, tuple], list]:
    """The cells of `blocks.packed_columns` as `blocks.cut` gives them, bucket -> cell."""
    with store.engine.connect() as conn:
        c, rest = blocks.packed_columns(conn, "y", [run], bucket_bounds(lo, hi, n))
    if c is None:
        return {}, rest
    cells = {}
    for i, s0, s1, lo_, hi_, t, count, v in zip(
        c.i.tolist(), c.first.tolist(), c.final.tolist(), c.low.tolist(), c.high.tolist(),
        c.total.tolist(), c.count.tolist(), c.last.tolist(), strict=True,
    ):  # fmt: skip
        cells[i] = (s0, s1, lo_ if count else None, hi_ if count else None, t, count, v)
    return cells, rest


def test_the_cut_from_packed_points_is_the_cut_of_the_points(store: Store) -> None:
    """The points packed in the blocks, cut in numpy (`packed_columns`), on SQLite and
    PostgreSQL: the definition at every bucket width, NaN-only buckets, inf + -inf, gaps
    and negative steps included; a range narrower than the run takes its part only."""
    run, steps, values = _series(store)
    lo, hi = steps[0], steps[-1]
    for n in (1, 7, 333, 1000, 5000, 40_000):
        want = _by_definition(steps, values, n)
        got, rest = _packed(store, run, lo, hi, n)
        assert rest == [] and sorted(got) == sorted(want), n
        for i, cell in want.items():
            assert all(_same(a, b) for a, b in zip(got[i], cell, strict=True)), (n, i)
    inner = [(s, v) for s, v in zip(steps, values, strict=True) if 1000 <= s <= 2000]
    got, _ = _packed(store, run, inner[0][0], inner[-1][0], 10)
    want = _by_definition([s for s, _ in inner], [v for _, v in inner], 10)
    assert sorted(got) == sorted(want)
    assert all(_same(a, b) for i in want for a, b in zip(got[i], want[i], strict=True))


def test_packed_points_that_do_not_add_up_are_not_trusted(store: Store) -> None:
    """A block without its packed points, or whose two columns disagree, puts its run in
    the runs left to cut another way; a value changed in place is read as it is, which
    shows that a trusted cut reads the packed points."""
    run, steps, _ = _series(store)
    lo, hi = steps[0], steps[-1]
    block = steps[100] // B
    with store.engine.begin() as conn:
        packed = conn.execute(
            sa.text("SELECT point_values FROM metric_blocks WHERE block = :b"), {"b": block}
        ).scalar_one()
        doctored = struct.pack("<d", 1e300) + bytes(packed)[8:]
        conn.execute(sa.text("UPDATE metric_blocks SET point_values = :v WHERE block = :b"),
                     {"v": doctored, "b": block})  # fmt: skip
    got, rest = _packed(store, run, lo, hi, 10)
    assert rest == [] and 1e300 in [c[3] for c in got.values()]
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE metric_blocks SET point_values = :v WHERE block = :b"),
                     {"v": bytes(packed)[8:], "b": block})  # fmt: skip
    assert _packed(store, run, lo, hi, 10) == ({}, [run])  # torn
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE metric_blocks SET point_offsets = NULL WHERE block = :b"),
                     {"b": block})  # fmt: skip
    assert _packed(store, run, lo, hi, 10) == ({}, [run])  # the count does not add up


def test_series_blocks_are_the_fold_of_the_points_exactly() -> None:
    """The writer's blocks of a batch (`series_blocks`, cut by built-ins) are the point by
    point fold's, row for row and bit for bit: gaps, negative steps, NaN, ±inf and inf
    beside -inf in one block, a block of NaN only."""
    rng = random.Random(11)
    steps = sorted(rng.sample(range(-100, 400), 300)) + list(range(400, 464))
    values = [rng.uniform(-5, 5) for _ in steps]
    for i in range(0, len(steps), 37):
        values[i] = math.nan
    values[50], values[51] = math.inf, -math.inf
    values[-16:] = [math.nan] * 16  # block 14 (448..463): every point NaN
    got = blocks.series_blocks(3, "y", steps, values)
    want = blocks.block_rows(
        blocks.fold((3, "y", s, v) for s, v in zip(steps, values, strict=True))
    )
    assert [r[:8] for r in got] == [r[:8] for r in want]
    assert [repr(r[8]) for r in got] == [repr(r[8]) for r in want]  # NaN sums compared so
    assert [r[9:] for r in got] == [r[9:] for r in want]
    assert got[-1][2:10] == (14, 16, 448, 463, None, None, None, 0)
    assert any(r[8] is not None and math.isnan(r[8]) for r in got)  # inf + -inf
