"""Metric blocks: per (run, key) and `BLOCK_STEPS` steps, the envelope of the points, kept
with the metrics, and the cut of series into buckets that reads them.

A bucket of steps ``[lo, hi)`` is read as three disjoint parts: the points from ``lo`` up
to the first block boundary, the whole blocks inside, and the points from the last block
boundary up to ``hi``. Only the two edges touch `metrics`: a million points at 2,000
buckets read ~31,000 blocks and ~64,000 points instead of a million. The cut runs on
SQLite; PostgreSQL keeps the blocks too, but its readers scan each bucket's points (a
LATERAL subquery per part of a bucket measured slower there than the rows it saves).

The transaction that writes a batch keeps its blocks (`Blocks._block`): a batch that only
extends its keys is folded into them from the rows in hand; a step logged again, or a batch
replayed out of order, has its blocks recomputed from `metrics`. Either way they end as
the rows say. A reader trusts a run's blocks only when their points add up to
its summary's count (`_trusted`); otherwise that run is cut from its points, the same
answer read slower. So a store written by anything that skipped the blocks is never read
wrong.
"""

from __future__ import annotations

import json
import math
import os
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from lab.store.engine import connect
from lab.store.schema import BLOCK_STEPS

B = BLOCK_STEPS
_INF = math.inf
# floor(step / B) on SQLite and PostgreSQL alike (both truncate integer division toward zero).
_BLOCK_OF = f"((step - ((step % {B}) + {B}) % {B}) / {B})"

_BLOCK_UPSERT = f"""
INSERT INTO metric_blocks (run_id, "key", block, points, step_min, step_max,
                           value_min, value_max, value_sum, value_count)
SELECT run_id, "key", {_BLOCK_OF}, count(*), min(step), max(step),
       min({{v}}), max({{v}}), sum({{v}}), count({{v}})
FROM metrics
WHERE run_id = {{m}} AND "key" = {{m}} AND step >= {{m}} AND step < {{m}}
GROUP BY run_id, "key", {_BLOCK_OF}
ON CONFLICT (run_id, "key", block) DO UPDATE SET
  points = excluded.points, step_min = excluded.step_min, step_max = excluded.step_max,
  value_min = excluded.value_min, value_max = excluded.value_max,
  value_sum = excluded.value_sum, value_count = excluded.value_count
"""

_REBLOCK_RUN = f"""
INSERT INTO metric_blocks (run_id, "key", block, points, step_min, step_max,
                           value_min, value_max, value_sum, value_count)
SELECT run_id, "key", {_BLOCK_OF}, count(*), min(step), max(step),
       min({{v}}), max({{v}}), sum({{v}}), count({{v}})
FROM metrics
WHERE run_id = :run_id{{since}}
GROUP BY run_id, "key", {_BLOCK_OF}
"""


_SINCE = " AND step >= :first"


def value_expression(dialect: str) -> str:
    """A metric value as min, max, sum and count must see it: NaN left out. SQLite stores
    NaN as NULL, which aggregates skip; PostgreSQL keeps NaN and orders it above inf."""
    return "value" if dialect == "sqlite" else "NULLIF(value, 'NaN'::double precision)"


class Blocks:
    """The block upkeep part of `lab.store.Store`."""

    dialect: str
    _block_upsert: str
    _block_merge: str

    def _block(
        self,
        conn: Connection,
        rows: list[tuple[Any, ...]],
        acc: dict[int, dict[str, list[Any]]],
        again: set[tuple[int, str]],
    ) -> None:
        """Fold a batch's rows ((run, key, step, value, wall time), as written) into its
        blocks, in its transaction after them. A key whose batch only extends it (`acc`
        and `again` as `_summarize` saw them) is folded in from the rows in hand; one that
        logged a step again has every block from its first to its last step in the batch
        recomputed from `metrics`."""
        spans = [
            (run_id, key, (acc[run_id][key][1] // B) * B, (acc[run_id][key][2] // B + 1) * B)
            for run_id, key in again
        ]
        folded: dict[tuple[int, str, int], list[Any]] = {}
        get = folded.get
        for run_id, key, step, value, _ in rows:
            if again and (run_id, key) in again:
                continue
            where = (run_id, key, step // B)
            f = get(where)
            if f is None:  # points, first and last step, min, max, sum and count of numbers
                f = folded[where] = [0, step, step, _INF, -_INF, 0.0, 0]
            f[0] += 1
            f[2] = step
            if value == value:  # not NaN
                if value < f[3]:
                    f[3] = value
                if value > f[4]:
                    f[4] = value
                f[5] += value
                f[6] += 1
        if folded:
            conn.exec_driver_sql(
                self._block_merge,
                [
                    (*where, n, first, last, *((lo, hi, total) if count else (None,) * 3), count)
                    for where, (n, first, last, lo, hi, total, count) in folded.items()
                ],
            )
        if spans:
            conn.exec_driver_sql(self._block_upsert, spans)

    def _reblock_run(self, conn: Connection, run_id: int, from_step: int | None) -> None:
        """Rebuild a run's blocks from the rows: those from the block holding `from_step`
        on (after its metrics past a step went), or all of them (None)."""
        table = sa.table("metric_blocks", sa.column("run_id"), sa.column("block"))
        where = [table.c.run_id == run_id]
        first = None if from_step is None else (from_step // B) * B
        if first is not None:
            where.append(table.c.block >= first // B)
        conn.execute(sa.delete(table).where(*where))
        sql = _REBLOCK_RUN.format(
            v=value_expression(self.dialect), since=_SINCE if first is not None else ""
        )
        conn.execute(sa.text(sql), {"run_id": run_id, "first": first})


# Folds a batch's block into the stored one: the batch only extends its key, so points and
# counts add up, and min, max and sum combine (a NULL sum with numbers counted is NaN, and
# stays so).
_BLOCK_MERGE = """
INSERT INTO metric_blocks (run_id, "key", block, points, step_min, step_max,
                           value_min, value_max, value_sum, value_count)
VALUES ({m}, {m}, {m}, {m}, {m}, {m}, {m}, {m}, {m}, {m})
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
  value_count = metric_blocks.value_count + excluded.value_count
"""


def block_merge(mark: str) -> str:
    """The fold statement with the driver's parameter mark."""
    return _BLOCK_MERGE.format(m=mark)


def block_upsert(dialect: str, mark: str) -> str:
    """The upkeep statement with the driver's parameter mark (run through the driver as it
    is: a literal % doubled for psycopg)."""
    sql = _BLOCK_UPSERT if dialect == "sqlite" else _BLOCK_UPSERT.replace("%", "%%")
    return sql.format(v=value_expression(dialect), m=mark)


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


def _trusted(conn: Connection, run_ids: Sequence[int], key: str) -> set[int]:
    """The runs whose blocks of `key` hold exactly their summary's count of points."""
    sql = sa.text(
        'SELECT s.run_id FROM summaries s WHERE s.run_id IN :ids AND s."key" = :key '
        'AND s."count" = (SELECT coalesce(sum(k.points), 0) FROM metric_blocks k '
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
    return {k: tuple(cell) for k, cell in out.items()}  # type: ignore[misc]


def _total(total: float | None, count: int, nan_sums: int) -> float:
    """A part's sum: 0.0 when it holds no number, NaN for a sum SQLite gave as NULL (inf +
    -inf, which it cannot store)."""
    if not count:
        return 0.0
    return math.nan if total is None or nan_sums else total


def _cells(rows: list[Any]) -> dict[tuple[int, int], list[Any]]:
    """The cells of the first part read (a count is an int here on either database)."""
    nan = math.nan
    return {
        (run_id, i): [first, final, low, high,
                      (total if total is not None else nan) if count else 0.0, count, None]
        for run_id, i, first, final, low, high, total, count, _ in rows
    }  # fmt: skip


def _merge(out: dict[tuple[int, int], list[Any]], rows: list[Any]) -> None:
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
