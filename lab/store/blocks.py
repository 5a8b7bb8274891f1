"""Metric blocks: per (run, key) and `BLOCK_STEPS` steps, the envelope of the points and
the points themselves packed, kept with the metrics, and the cuts of series into buckets
that read them.

`cut`: a bucket of steps ``[lo, hi)`` is read as three disjoint parts: the points from
``lo`` up to the first block boundary, the whole blocks inside, and the points from the
last block boundary up to ``hi``. Only the two edges touch `metrics`: a million points at
2,000 buckets read ~31,000 blocks and ~64,000 points instead of a million. It runs on
SQLite.

`packed_columns`: for buckets narrower than a few blocks, where nearly every point lies in
an edge, the points packed in the blocks (a byte of step offset and a float64 each) are
read, a row per 32 points, and cut in numpy, on either database.

The transaction that writes a batch keeps its blocks (`Blocks.block`): a batch that only
extends its keys is folded into them from the points in hand (`series_blocks`); a step
logged again, or a batch replayed out of order, has its blocks recomputed from `metrics`.
Either way they end as the rows say. A reader trusts a run's blocks only when their points
add up to its summary's count (`_trusted`); otherwise that run is cut from its points, the
same answer read slower. So a store written by anything that skipped the blocks is
never read wrong.
"""

from __future__ import annotations

import json
import math
import os
import sys
import weakref
from array import array
from bisect import bisect_left
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from lab.store.engine import connect
from lab.store.pg_copy import copy_blocks
from lab.store.schema import BLOCK_STEPS
from lab.store.sqlite_rows import inserter

B = BLOCK_STEPS
_COLUMNS = (
    'run_id, "key", block, points, step_min, step_max, value_min, value_max, value_sum, '
    "value_count, point_offsets, point_values"
)
_WIDTH = _COLUMNS.count(",") + 1
_BLOCK_PUT = f"INSERT INTO metric_blocks ({_COLUMNS}) VALUES {{values}}"
_INF = math.inf
_NAN = math.nan
_BIG_ENDIAN = sys.byteorder == "big"


def pack_values(values: Sequence[float | None]) -> bytes:
    """A block's values as its `point_values`: float64, little-endian, NaN kept (a NULL
    read from SQLite, which stores NaN so, packed as NaN)."""
    packed = array("d", [_NAN if v is None else v for v in values])
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def fold(rows: Any, skip: set[tuple[int, str]] | None = None) -> dict[tuple[int, str, int], list]:
    """Blocks of points ((run, key, step, value, ...) in step order per key): per (run, key,
    block), [points, first step, last step, min, max, sum, count of numbers, offsets of the
    steps in the block, values]. NaN (or None) counts as a point, not as a number."""
    folded: dict[tuple[int, str, int], list[Any]] = {}
    get = folded.get
    for run_id, key, step, value, *_ in rows:
        if skip and (run_id, key) in skip:
            continue
        block = step // B
        where = (run_id, key, block)
        f = get(where)
        if f is None:
            f = folded[where] = [0, step, step, _INF, -_INF, 0.0, 0, bytearray(), []]
        f[0] += 1
        f[2] = step
        f[7].append(step - block * B)
        f[8].append(value)
        if value is not None and value == value:  # a number, not NaN
            if value < f[3]:
                f[3] = value
            if value > f[4]:
                f[4] = value
            f[5] += value
            f[6] += 1
    return folded


def block_rows(folded: dict[tuple[int, str, int], list[Any]]) -> list[tuple[Any, ...]]:
    """`fold`'s blocks as rows of `metric_blocks` (`_COLUMNS` order)."""
    return [
        (*where, n, first, last, *((lo, hi, total) if count else (None,) * 3), count,
         bytes(offsets), pack_values(values))
        for where, (n, first, last, lo, hi, total, count, offsets, values) in folded.items()
    ]  # fmt: skip


def bounds(values: list[float]) -> tuple[float, float]:
    """The min and max of `values` with NaN left out; (+inf, -inf) when every one is NaN.
    A sum that is not NaN says there is no NaN (nor inf beside -inf), and then the
    built-ins answer in C."""
    total = sum(values)
    if total == total:
        return min(values, default=_INF), max(values, default=-_INF)
    numbers = [v for v in values if v == v]
    return min(numbers, default=_INF), max(numbers, default=-_INF)


def series_blocks(
    run_id: int, key: str, steps: list[int], values: list[float]
) -> list[tuple[Any, ...]]:
    """One key's points (steps increasing, NaN as NaN) as rows of `metric_blocks`
    (`_COLUMNS` order): `block_rows(fold(...))` of them, each block cut out of the lists
    and summed, bounded and packed by built-ins in C rather than point by point."""
    out = []
    i, n = 0, len(steps)
    while i < n:
        block = steps[i] // B
        j = bisect_left(steps, (block + 1) * B, i)
        at, vs = steps[i:j], values[i:j]
        lo: float | None
        hi: float | None
        total: float | None = sum(vs)
        if total == total:  # no NaN: every point is a number
            lo, hi, count = min(vs), max(vs), j - i
        else:
            numbers = [v for v in vs if v == v]
            count = len(numbers)
            lo, hi, total = (min(numbers), max(numbers), sum(numbers)) if count else (None,) * 3
        base = block * B
        if at[-1] - at[0] == j - i - 1:  # consecutive steps
            offsets = bytes(range(at[0] - base, at[-1] - base + 1))
        else:
            offsets = bytes([s - base for s in at])
        packed = array("d", vs)
        if _BIG_ENDIAN:
            packed.byteswap()
        out.append((run_id, key, block, j - i, at[0], at[-1], lo, hi, total, count, offsets,
                    packed.tobytes()))  # fmt: skip
        i = j
    return out


class Blocks:
    """The block upkeep of the metric rows (`lab.store.metric_rows.MetricRows`): its
    statements, built once for the store's dialect, and the folds that run them."""

    def __init__(self, dialect: str) -> None:
        self._block_merge = inserter(block_merge(dialect), _WIDTH, dialect)
        self._block_put = inserter(_BLOCK_PUT, _WIDTH, dialect)
        self._copy = dialect == "postgresql"  # new blocks by COPY (`lab.store.pg_copy`)

    def block(
        self,
        conn: Connection,
        series: dict[int, dict[str, tuple[list[int], list[float], list[float]]]],
        acc: dict[int, dict[str, list[Any]]],
        again: set[tuple[int, str]],
        cut: dict[tuple[int, str], list[tuple[Any, ...]]] | None = None,
    ) -> None:
        """Fold a batch's points (`series`: per run and key, steps, values and wall times
        in the order logged) into its blocks, in its transaction after its rows. A key
        whose batch only extends it (`acc` and `again` as `Summaries.summarize` saw them)
        is folded in from the points in hand, its points appended to its last block's (on
        PostgreSQL only its first block is merged so; the others are new, and copied); one
        that logged a step again has every block from its first to its last step in the
        batch rebuilt from `metrics`. `cut`: the batch's blocks as `cut` made them already
        (while the server took the rows, say), else they are made here."""
        if cut is None:
            cut = self.cut(series, acc)
        made = [rows for pair, rows in cut.items() if pair not in again]
        if self._copy:
            # Only a key's first block can be stored already: the batch comes after it.
            merge = [rows[0] for rows in made if rows]
            new = [row for rows in made for row in rows[1:]]
            if new and not copy_blocks(conn, new):
                merge += new
        else:
            merge = [row for rows in made for row in rows]
        if merge:
            self._block_merge(conn, merge)
        for run_id, key in sorted(again):
            first, last = acc[run_id][key][1], acc[run_id][key][2]
            self._rebuild(conn, run_id, key, first // B, last // B + 1)

    @staticmethod
    def cut(
        series: dict[int, dict[str, tuple[list[int], list[float], list[float]]]],
        acc: dict[int, dict[str, list[Any]]],
    ) -> dict[tuple[int, str], list[tuple[Any, ...]]]:
        """A batch's points cut into `metric_blocks` rows, per run and key, but for the
        keys whose steps do not increase in the batch (`acc`'s last item: `block` rebuilds
        them from `metrics`): pure work on the points in hand, which needs nothing of the
        store."""
        return {
            (run_id, key): series_blocks(run_id, key, steps, values)
            for run_id, per in series.items()
            for key, (steps, values, _) in per.items()
            if not acc[run_id][key][7]
        }

    def reblock_run(self, conn: Connection, run_id: int, from_step: int | None) -> None:
        """Rebuild a run's blocks from the rows: those from the block holding `from_step`
        on (after its metrics past a step went), or all of them (None)."""
        self._rebuild(conn, run_id, None, None if from_step is None else from_step // B, None)

    def _rebuild(
        self,
        conn: Connection,
        run_id: int,
        key: str | None,
        first_block: int | None,
        end_block: int | None,
    ) -> None:
        """Blocks `first_block` up to `end_block` (None: no bound) of a run's `key` (None:
        every key) deleted and made again from `metrics`."""
        blocks = sa.table("metric_blocks", sa.column("run_id"), sa.column("key"),
                          sa.column("block"))  # fmt: skip
        metrics = sa.table("metrics", sa.column("run_id"), sa.column("key"),
                           sa.column("step"), sa.column("value"))  # fmt: skip
        drop, read = [blocks.c.run_id == run_id], [metrics.c.run_id == run_id]
        if key is not None:
            drop.append(blocks.c.key == key)
            read.append(metrics.c.key == key)
        if first_block is not None:
            drop.append(blocks.c.block >= first_block)
            read.append(metrics.c.step >= first_block * B)
        if end_block is not None:
            drop.append(blocks.c.block < end_block)
            read.append(metrics.c.step < end_block * B)
        conn.execute(sa.delete(blocks).where(*drop))
        points = conn.execute(
            sa.select(metrics.c.run_id, metrics.c.key, metrics.c.step, metrics.c.value)
            .where(*read)
            .order_by(metrics.c.key, metrics.c.step)
        )
        made = block_rows(fold(points))
        if made:
            self._block_put(conn, made)


# Folds a batch's block into the stored one: the batch only extends its key, so points and
# counts add up, its points go after the stored ones, and min, max and sum combine (a NULL
# sum with numbers counted is NaN, and stays so).
_BLOCK_MERGE = """
INSERT INTO metric_blocks ({columns})
VALUES {values}
ON CONFLICT (run_id, "key", block) DO UPDATE SET
  points = metric_blocks.points + excluded.points,
  step_min = CASE WHEN excluded.step_min < metric_blocks.step_min
                  THEN excluded.step_min ELSE metric_blocks.step_min END,
  step_max = CASE WHEN excluded.step_max > metric_blocks.step_max
                  THEN excluded.step_max ELSE metric_blocks.step_max END,
  value_min = CASE WHEN metric_blocks.value_min IS NULL OR excluded.value_min <
                   metric_blocks.value_min THEN excluded.value_min ELSE metric_blocks.value_min END,
  value_max = CASE WHEN metric_blocks.value_max IS NULL OR excluded.value_max >
                   metric_blocks.value_max THEN excluded.value_max ELSE metric_blocks.value_max END,
  value_sum = CASE WHEN metric_blocks.value_count = 0 THEN excluded.value_sum
                   WHEN excluded.value_count = 0 THEN metric_blocks.value_sum
                   ELSE metric_blocks.value_sum + excluded.value_sum END,
  value_count = metric_blocks.value_count + excluded.value_count,
  point_offsets = {concat_offsets},
  point_values = {concat_values}
"""


def _concat(dialect: str, column: str) -> str:
    """The stored bytes of `column` with the batch's after them. SQLite's `||` gives text
    (its bytes kept, NULs included), cast back to a blob."""
    both = f"metric_blocks.{column} || excluded.{column}"
    return f"CAST({both} AS BLOB)" if dialect == "sqlite" else both


def block_merge(dialect: str) -> str:
    """The fold statement for the dialect, ``{values}`` where its VALUES list goes."""
    return _BLOCK_MERGE.format(
        columns=_COLUMNS,
        values="{values}",
        concat_offsets=_concat(dialect, "point_offsets"),
        concat_values=_concat(dialect, "point_values"),
    )


# -- the cut ------------------------------------------------------------------------------

#: A bucket's numbers: first step, last step, min, max, sum and count of its values (NaN
#: left out: min and max None, the sum 0.0, when none is left), and its last value (NaN
#: kept; None when not asked for).
Cell = tuple[int, int, float | None, float | None, float, int, float | None]

_HAS_BLOCKS: weakref.WeakKeyDictionary[sa.Engine, bool] = weakref.WeakKeyDictionary()

_SQLITE_BOUNDS_TABLE = (
    "CREATE TEMP TABLE IF NOT EXISTS lab_cut_bounds (i INTEGER PRIMARY KEY, "
    "lo INTEGER NOT NULL, hi INTEGER NOT NULL, blo INTEGER NOT NULL, bhi INTEGER NOT NULL, "
    "lcut INTEGER NOT NULL, rcut INTEGER NOT NULL)"
)
_SQLITE_CUT_TABLE = (
    "CREATE TEMP TABLE IF NOT EXISTS lab_cut (run_id INTEGER NOT NULL, i INTEGER NOT NULL, "
    "lo INTEGER NOT NULL, hi INTEGER NOT NULL, blo INTEGER NOT NULL, bhi INTEGER NOT NULL, "
    "lcut INTEGER NOT NULL, rcut INTEGER NOT NULL, PRIMARY KEY (run_id, i)) WITHOUT ROWID"
)
# Every run's buckets, in key order: a run whose blocks are trusted reads them, any other
# reads the whole bucket from its points ([lo, hi) as the left edge, no blocks, no right).
_SQLITE_FILL = """
INSERT INTO temp.lab_cut
SELECT r.value, b.i, b.lo, b.hi, b.blo, b.bhi, b.lcut, b.rcut
FROM json_each(:trusted) r CROSS JOIN temp.lab_cut_bounds b
UNION ALL
SELECT r.value, b.i, b.lo, b.hi, 0, 0, b.hi, b.hi
FROM json_each(:plain) r CROSS JOIN temp.lab_cut_bounds b
ORDER BY 1, 2
"""
_SQLITE_LAST_TABLE = (
    "CREATE TEMP TABLE IF NOT EXISTS lab_cut_last (run_id INTEGER NOT NULL, "
    "i INTEGER NOT NULL, step INTEGER NOT NULL, PRIMARY KEY (run_id, i)) WITHOUT ROWID"
)
# CROSS JOIN: SQLite then keeps the buckets as the outer loop, each bucket one range of an
# index (a plan from the other side scans every point of the table per bucket).
# A part of each bucket read from the points: [lo, lcut) or [rcut, hi).
_POINTS = """
SELECT c.run_id, c.i, min(m.step), max(m.step), min(m.value), max(m.value), sum(m.value),
       count(m.value), 0
FROM temp.lab_cut c CROSS JOIN metrics m
WHERE c.{a} < c.{b}
  AND m.run_id = c.run_id AND m."key" = :key AND m.step >= c.{a} AND m.step < c.{b}
GROUP BY c.run_id, c.i
"""
_LEFT = _POINTS.format(a="lo", b="lcut")
_RIGHT = _POINTS.format(a="rcut", b="hi")
# The whole blocks of each bucket: [blo, bhi). The last column counts the blocks whose sum
# is NaN (inf + -inf), which SQLite stores as NULL and `sum` would skip.
_BLOCKS = """
SELECT c.run_id, c.i, min(k.step_min), max(k.step_max), min(k.value_min), max(k.value_max),
       sum(k.value_sum), sum(k.value_count),
       sum(CASE WHEN k.value_sum IS NULL AND k.value_count > 0 THEN 1 ELSE 0 END)
FROM temp.lab_cut c CROSS JOIN metric_blocks k
WHERE c.blo < c.bhi
  AND k.run_id = c.run_id AND k."key" = :key AND k.block >= c.blo AND k.block < c.bhi
GROUP BY c.run_id, c.i
"""
_LAST = """
SELECT c.run_id, c.i, m.value
FROM temp.lab_cut_last c CROSS JOIN metrics m
WHERE m.run_id = c.run_id AND m."key" = :key AND m.step = c.step
"""


#: A cut of at least this many buckets on a SQLite file is shared out to several connections.
SPLIT_BUCKETS = 1000
#: How many connections share one such cut: one per core, at most 4 (SQLite runs a
#: statement on one core, and waits in C, without the GIL).
SPLIT_PARTS = max(1, min(4, os.cpu_count() or 1))
_splitters = ThreadPoolExecutor(max_workers=SPLIT_PARTS, thread_name_prefix="lab-cut")


def cut_on(
    engine: sa.Engine,
    key: str,
    run_ids: Sequence[int],
    bounds: Sequence[tuple[int, int, int]],
    *,
    last: bool,
    parts: int = SPLIT_PARTS,
) -> dict[tuple[int, int], Cell]:
    """`cut`, shared out to `parts` connections at once when the store is a SQLite file
    and the buckets are many: by runs when there are enough of them, else by contiguous
    shares of the buckets. Each bucket is read whole by one share, so the answer is
    `cut`'s; each share reads its own snapshot of a store being written, so a bucket is
    always consistent in itself. On one connection otherwise."""
    cells = len(run_ids) * len(bounds)
    parts = min(parts, cells)
    if parts <= 1 or cells < SPLIT_BUCKETS or not _splittable(engine):
        with connect(engine) as conn:
            return cut(conn, key, run_ids, bounds, last=last)
    if len(run_ids) >= parts:
        shares = [(run_ids[k::parts], bounds) for k in range(parts)]
    else:
        n = len(bounds)
        shares = [(run_ids, bounds[k * n // parts : (k + 1) * n // parts]) for k in range(parts)]

    def one(share: tuple[Sequence[int], Sequence[tuple[int, int, int]]]) -> dict[Any, Cell]:
        with connect(engine) as conn:
            return cut(conn, key, *share, last=last)

    out: dict[tuple[int, int], Cell] = {}
    for part in _splitters.map(one, [s for s in shares if s[0] and s[1]]):
        out.update(part)
    return out


def _splittable(engine: sa.Engine) -> bool:
    """Whether a cut may run on several connections: a SQLite file (one in memory lives in
    a single connection that threads must not share)."""
    return engine.dialect.name == "sqlite" and not isinstance(engine.pool, sa.pool.StaticPool)


def has_blocks(conn: Connection) -> bool:
    """Whether the store has `metric_blocks` (a store read at an older revision has not)."""
    engine = conn.engine
    found = _HAS_BLOCKS.get(engine)
    if found is None:
        found = _HAS_BLOCKS[engine] = sa.inspect(conn).has_table("metric_blocks")
    return found


def _trusted(
    conn: Connection, run_ids: Sequence[int], key: str, points: str = "k.points"
) -> set[int]:
    """The runs whose blocks of `key` hold exactly their summary's count of points, counted
    by `points` (per block: its `points`, or the length of its packed offsets)."""
    sql = sa.text(
        'SELECT s.run_id FROM summaries s WHERE s.run_id IN :ids AND s."key" = :key '
        f'AND s."count" = (SELECT coalesce(sum({points}), 0) FROM metric_blocks k '
        'WHERE k.run_id = s.run_id AND k."key" = s."key")'
    ).bindparams(sa.bindparam("ids", expanding=True))
    return set(conn.execute(sql, {"ids": list(run_ids), "key": key}).scalars())


def cut(
    conn: Connection,
    key: str,
    run_ids: Sequence[int],
    bounds: Sequence[tuple[int, int, int]],
    *,
    last: bool,
    from_points: bool = False,
) -> dict[tuple[int, int], Cell]:
    """On SQLite: per run of `run_ids` and bucket of `bounds` ((i, first step, step after
    the last), as `lab.server.read.bucket_bounds` gives them) that holds a point of `key`:
    its `Cell`, under (run_id, i). Empty buckets are left out.

    The same numbers as a pass over every point (the sum may differ in its last bits: it
    adds block sums), in grouped joins of the buckets to the indexes of `metrics` and
    `metric_blocks` and, with `last`, one lookup per bucket of its last step's value.
    `from_points` reads every point instead: the answer the blocks must give.
    """
    run_ids = list(dict.fromkeys(run_ids))
    if not run_ids or not bounds:
        return {}
    wide = any(hi - lo >= 2 * B for _, lo, hi in bounds)
    use = set()
    if wide and not from_points and has_blocks(conn):
        use = _trusted(conn, run_ids, key)
    rows = []
    for i, lo, hi in bounds:
        blo, bhi = -(-lo // B), hi // B
        if blo < bhi:
            rows.append((i, lo, hi, blo, bhi, blo * B, bhi * B))
        else:  # no whole block inside: all of it from the points
            rows.append((i, lo, hi, 0, 0, hi, hi))
    trusted = [r for r in run_ids if r in use]
    plain = [r for r in run_ids if r not in use]
    args = {"key": key}
    conn.exec_driver_sql(_SQLITE_BOUNDS_TABLE)
    conn.exec_driver_sql(_SQLITE_CUT_TABLE)
    conn.exec_driver_sql("DELETE FROM temp.lab_cut_bounds")
    conn.exec_driver_sql("DELETE FROM temp.lab_cut")
    conn.exec_driver_sql("INSERT INTO temp.lab_cut_bounds VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    fill = {"trusted": json.dumps(trusted), "plain": json.dumps(plain)}
    conn.execute(sa.text(_SQLITE_FILL), fill)
    out = _cells(conn.execute(sa.text(_LEFT), args).all())
    if trusted:  # whole blocks, then the right edges, after the left edges in step order
        _merge(out, conn.execute(sa.text(_BLOCKS), args).all())
        _merge(out, conn.execute(sa.text(_RIGHT), args).all())
    if last and out:
        _last_values(conn, key, out)
    return {k: tuple(cell) for k, cell in out.items()}


def _total(total: float | None, count: int, nan_sums: int) -> float:
    """A part's sum: 0.0 when it holds no number, NaN for a sum SQLite gave as NULL (inf +
    -inf, which it cannot store)."""
    if not count:
        return 0.0
    return math.nan if total is None or nan_sums else total


def _cells(rows: Sequence[Any]) -> dict[tuple[int, int], list[Any]]:
    """The cells of the first part read (a count is an int here on either database)."""
    nan = math.nan
    return {
        (run_id, i): [first, final, low, high,
                      (total if total is not None else nan) if count else 0.0, count, None]
        for run_id, i, first, final, low, high, total, count, _ in rows
    }  # fmt: skip


def _merge(out: dict[tuple[int, int], list[Any]], rows: Sequence[Any]) -> None:
    """Fold a later part of the buckets (higher steps) into their cells."""
    for run_id, i, first, final, low, high, total, count, nan in rows:
        count = int(count)
        cell = out.get((run_id, i))
        if cell is None:
            out[(run_id, i)] = [first, final, low, high, _total(total, count, nan), count, None]
            continue
        cell[1] = final
        if low is not None:
            cell[2] = low if cell[2] is None else min(cell[2], low)
            cell[3] = high if cell[3] is None else max(cell[3], high)
        cell[4] += _total(total, count, nan)
        cell[5] += count


def _last_values(conn: Connection, key: str, out: dict[tuple[int, int], list[Any]]) -> None:
    """Fill each cell's last value: the value at its last step (NaN kept)."""
    ends = sorted((run_id, i, cell[1]) for (run_id, i), cell in out.items())
    conn.exec_driver_sql(_SQLITE_LAST_TABLE)
    conn.exec_driver_sql("DELETE FROM temp.lab_cut_last")
    conn.exec_driver_sql("INSERT INTO temp.lab_cut_last VALUES (?, ?, ?)", ends)
    for run_id, i, value in conn.execute(sa.text(_LAST), {"key": key}).all():
        out[(run_id, i)][6] = math.nan if value is None else value


# -- the cut from the packed points -----------------------------------------------------

_HAS_PACKED: weakref.WeakKeyDictionary[sa.Engine, bool] = weakref.WeakKeyDictionary()


def has_packed(conn: Connection) -> bool:
    """Whether the store's blocks carry their points (revision 0007 on)."""
    engine = conn.engine
    found = _HAS_PACKED.get(engine)
    if found is None:
        found = has_blocks(conn) and "point_offsets" in {
            c["name"] for c in sa.inspect(conn).get_columns("metric_blocks")
        }
        _HAS_PACKED[engine] = found
    return found


@dataclass(frozen=True, slots=True)
class Columns:
    """Cells as columns (numpy arrays of one entry per run and non-empty bucket, in (run,
    bucket) order): `run_id`, bucket `i`, `first` and `final` step, `low`, `high` (NaN
    where `count` is 0), `total` and `count` of the numbers (NaN left out), `last` value
    (NaN kept)."""

    run_id: Any
    i: Any
    first: Any
    final: Any
    low: Any
    high: Any
    total: Any
    count: Any
    last: Any


def packed_columns(
    conn: Connection,
    key: str,
    run_ids: Sequence[int],
    bounds: Sequence[tuple[int, int, int]],
) -> tuple[Columns | None, list[int]]:
    """The cells of `key` for `run_ids` and `bounds` (in step order), as `Columns`
    computed from the points packed in the blocks: a row per 32 points read, the buckets
    cut in numpy (None when no point falls in them).

    Also returns the runs it could not read so (blocks that do not pack their summary's
    count of points, or a store before revision 0007), for the caller to cut another way.
    The whole range of each run is read: meant for buckets narrower than a few blocks,
    where every point lies in a bucket's edge anyway.
    """
    run_ids = list(dict.fromkeys(run_ids))
    if not run_ids or not bounds:
        return None, []
    if not has_packed(conn):
        return None, run_ids
    use = _trusted(conn, run_ids, key, "length(k.point_offsets)")
    rest = [r for r in run_ids if r not in use]
    lo, hi = bounds[0][1], bounds[-1][2]
    args = (key, lo // B, (hi - 1) // B + 1)
    rows: Sequence[Any] = []
    if use:
        marks = "?" if conn.dialect.name == "sqlite" else "%s"
        sql = _PACKED.format(ids=", ".join([marks] * len(use)), m=marks)
        rows = conn.exec_driver_sql(sql, (*sorted(use), *args)).fetchall()
    torn = {r[0] for r in rows if len(r[3]) != 8 * len(r[2])}
    if torn:  # a block whose two columns disagree: its run is cut another way
        rest += sorted(torn)
        rows = [r for r in rows if r[0] not in torn]
    if not rows:
        return None, rest
    return _columns(rows, bounds), rest


_PACKED = (
    "SELECT run_id, block, point_offsets, point_values FROM metric_blocks "
    'WHERE run_id IN ({ids}) AND "key" = {m} AND block >= {m} AND block < {m} '
    "ORDER BY run_id, block"
)


def _columns(rows: Sequence[Any], bounds: Sequence[tuple[int, int, int]]) -> Columns | None:
    """`packed_columns` from its blocks, read in (run, block) order."""
    import numpy as np  # the store's write path never needs it

    n = len(rows)
    offsets_of = [r[2] for r in rows]
    lengths = np.fromiter(map(len, offsets_of), np.int64, n)
    blocks = np.fromiter((r[1] for r in rows), np.int64, n)
    runs = np.repeat(np.fromiter((r[0] for r in rows), np.int64, n), lengths)
    steps = np.repeat(blocks * B, lengths)
    steps += np.frombuffer(b"".join(offsets_of), np.uint8)
    values = np.frombuffer(b"".join([r[3] for r in rows]), "<f8")
    starts = np.fromiter((lo for _, lo, _ in bounds), np.int64, len(bounds))
    ends = np.fromiter((hi for _, _, hi in bounds), np.int64, len(bounds))
    index = np.fromiter((i for i, _, _ in bounds), np.int64, len(bounds))
    at = np.searchsorted(starts, steps, side="right") - 1
    inside = (at >= 0) & (steps < ends[np.maximum(at, 0)])
    if not inside.all():
        runs, steps, values, at = runs[inside], steps[inside], values[inside], at[inside]
    if not len(steps):
        return None
    change = np.empty(len(steps), dtype=bool)
    change[0] = True
    np.not_equal(runs[1:], runs[:-1], out=change[1:])
    change[1:] |= at[1:] != at[:-1]
    first = np.flatnonzero(change)
    final = np.empty_like(first)
    final[:-1] = first[1:] - 1
    final[-1] = len(steps) - 1
    nan = np.isnan(values)
    with np.errstate(invalid="ignore"):  # inf + -inf is NaN, as in a pass over the points
        low = np.fmin.reduceat(values, first)
        high = np.fmax.reduceat(values, first)
        total = np.add.reduceat(np.where(nan, 0.0, values), first)
    return Columns(
        run_id=runs[first],
        i=index[at[first]],
        first=steps[first],
        final=steps[final],
        low=low,
        high=high,
        total=total,
        count=np.add.reduceat(~nan, first, dtype=np.int64),
        last=values[final],
    )
