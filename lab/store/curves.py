"""A metric's learning curves cut into buckets on the store's side: per run and non-empty
bucket the min, max and mean of its points without NaN, the last step and the last value
as logged, read from the metric blocks where they are wide enough and from the points where
not (`cut`). The dashboard's curves (`lab.server.dashboard.curves`) are taken over these
cells in numpy; the answer is a few thousand numbers, never every point."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import sqlalchemy as sa

from lab.store import blocks
from lab.store.engine import connect
from lab.store.schema import BLOCK_STEPS


def _nan(value: float | None) -> float:
    """A metric value as read back: SQLite keeps NaN as NULL, and a metric is never
    missing."""
    return math.nan if value is None else value


class Cells:
    """A metric's cut, one entry per run and non-empty bucket, sorted by run then bucket,
    as numpy columns: `run_id`, bucket `i`, `low`, `high` and `mean` of the numbers
    (NaN where `counted` is False: the bucket held NaN only), the `step` of the run's
    last point in the bucket, and the `last` value as logged there (NaN kept; NaN
    throughout when it was not asked for)."""

    __slots__ = ("counted", "high", "i", "last", "low", "mean", "run_id", "step")

    def __init__(self, cells: list[tuple[int, int, Any, Any, Any, int, Any]]) -> None:
        cells.sort(key=lambda c: (c[0], c[1]))
        nan = math.nan
        self.run_id = np.array([c[0] for c in cells], dtype=np.int64)
        self.i = np.array([c[1] for c in cells], dtype=np.int64)
        self.low = np.array([nan if c[2] is None else c[2] for c in cells], dtype=float)
        self.high = np.array([nan if c[3] is None else c[3] for c in cells], dtype=float)
        self.mean = np.array([nan if c[4] is None else c[4] for c in cells], dtype=float)
        self.counted = np.array([c[4] is not None for c in cells], dtype=bool)
        self.step = np.array([c[5] for c in cells], dtype=np.int64)
        self.last = np.array([nan if c[6] is None else c[6] for c in cells], dtype=float)

    @classmethod
    def of(cls, columns: blocks.Columns | None, rest: list[tuple[Any, ...]], last: bool) -> Cells:
        """The cells of a packed cut (`columns`), with `rest`'s (cut another way) added."""
        cells = cls(rest)
        if columns is None:
            return cells
        counted = columns.count > 0
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(counted, columns.total / columns.count, np.nan)
        parts = {
            "run_id": columns.run_id, "i": columns.i, "low": columns.low,
            "high": columns.high, "mean": mean, "counted": counted, "step": columns.final,
            "last": columns.last if last else np.full(len(counted), np.nan),
        }  # fmt: skip
        order = None
        if rest:
            order = np.lexsort((np.r_[cells.i, columns.i], np.r_[cells.run_id, columns.run_id]))
        for name, column in parts.items():
            joined = np.concatenate([getattr(cells, name), column])
            setattr(cells, name, joined if order is None else joined[order])
        return cells


def cut(
    engine: sa.Engine,
    run_ids: list[int],
    key: str,
    bounds: list[tuple[int, int, int]],
    *,
    last: bool,
) -> Cells:
    """Per run and non-empty bucket of `key` (`bounds`, from `bucket_bounds`): min, max
    and mean without NaN, the last value as logged (with `last`), as `Cells`.

    Buckets narrower than two metric blocks, and every bucket on PostgreSQL (whose other
    cut reads each point), are cut from the points packed in the blocks
    (`lab.store.blocks.packed_columns`: a row per 32 points, cut in numpy). Wider ones on
    SQLite are cut from the blocks' envelopes and the points at their edges
    (`lab.store.blocks.cut_on`). A run whose blocks do not add up to its summary is cut
    from its points (`_cut_by_points`): the same answer, read slower."""
    if not run_ids:
        return Cells([])
    sqlite = engine.dialect.name == "sqlite"
    if sqlite and any(hi - lo >= 2 * BLOCK_STEPS for _, lo, hi in bounds):
        cells = blocks.cut_on(engine, key, run_ids, bounds, last=last)
        return Cells([
            (run_id, i, c[2], c[3], c[4] / c[5] if c[5] else None, c[1], c[6])
            for (run_id, i), c in cells.items()
        ])  # fmt: skip
    with connect(engine) as conn:
        columns, rest = blocks.packed_columns(conn, key, run_ids, bounds)
    slow = []
    if rest:
        per_run = _cut_by_points(engine, rest, key, bounds, last=last)
        slow = [(run_id, i, *c) for run_id, per in per_run.items() for i, c in per.items()]
    return Cells.of(columns, slow, last)


def _cut_by_points(
    engine: sa.Engine,
    run_ids: list[int],
    key: str,
    bounds: list[tuple[int, int, int]],
    *,
    last: bool,
) -> dict[int, dict[int, tuple[Any, ...]]]:
    """`cut` from every point of the runs: one grouped pass (`_cut_points`), shared out
    to one connection per core on a SQLite file when the buckets are many."""
    parts = blocks.SPLIT_PARTS
    many = len(run_ids) * len(bounds) >= blocks.SPLIT_BUCKETS
    if engine.dialect.name == "sqlite" and many and parts > 1 and blocks._splittable(engine):
        return _cut_points_split(engine, run_ids, key, bounds, last=last, parts=parts)
    with connect(engine) as conn:
        return _cut_points(conn, engine.dialect.name, run_ids, key, bounds, last=last)


def _cut_points(
    conn: sa.Connection,
    dialect: str,
    run_ids: list[int],
    key: str,
    bounds: list[tuple[int, int, int]],
    *,
    last: bool,
) -> dict[int, dict[int, tuple[Any, ...]]]:
    """Per run and non-empty bucket of `key` (`bounds`, from `bucket_bounds`): (min, max,
    mean, last step, last value), min, max and mean without NaN (None when the bucket held
    NaN only), the last value as logged (with `last`; else None), in one grouped query over the
    metrics' (run_id, key, step) key.

    SQLite: the runs' buckets go into a temporary table in (run, bucket) order, joined to
    each bucket's range of the key, so the grouping follows the key and never sorts the
    points. PostgreSQL: one hash aggregate over the runs' range of the key, bucket i
    holding the steps s with ``(s - lo) * n // (hi - lo + 1) == i``, the last value taken
    in the same pass. On SQLite the last value is a key lookup per bucket at its last
    step."""
    if not run_ids:
        return {}
    args: dict[str, Any] = {"key": key}
    if dialect == "sqlite":
        conn.exec_driver_sql(_SQLITE_CURVE_BOUNDS)
        conn.exec_driver_sql(_SQLITE_CURVE_BUCKETS)
        conn.exec_driver_sql("DELETE FROM temp.lab_curve_bounds")
        conn.exec_driver_sql("DELETE FROM temp.lab_curve_buckets")
        conn.exec_driver_sql("INSERT INTO temp.lab_curve_bounds VALUES (?, ?, ?)", bounds)
        conn.exec_driver_sql(
            "INSERT INTO temp.lab_curve_buckets SELECT r.value, b.i, b.lo, b.hi "
            "FROM json_each(?) r, temp.lab_curve_bounds b ORDER BY 1, 2",
            (json.dumps(run_ids),),
        )
        lookup = (
            '(SELECT l.value FROM metrics l WHERE l.run_id = g.run_id AND l."key" = :key '
            "AND l.step = g.last_step)"
        )
        sql = sa.text(f"SELECT g.*, {lookup if last else 'NULL'} FROM ({_SQLITE_CURVE_CUT}) g")
    else:
        lo, hi = bounds[0][1], bounds[-1][2] - 1
        args.update(run_ids=run_ids, lo=lo, n=len(bounds), width=hi - lo + 1)
        # The groups' hash table in memory (a few MB per 100,000 buckets), not spilled to
        # disk as the default work_mem would; no JIT, which costs more than it saves here.
        conn.exec_driver_sql("SET LOCAL work_mem = '64MB'")
        conn.exec_driver_sql("SET LOCAL jit = off")
        grouped = _PG_CURVE_CUT.format(last=_PG_LAST if last else "NULL")
        sql = sa.text(grouped).bindparams(sa.bindparam("run_ids", expanding=True))
    out: dict[int, dict[int, tuple[Any, ...]]] = {}
    for run_id, i, low, high, mean, step, value in conn.execute(sql, args):
        out.setdefault(run_id, {})[int(i)] = (low, high, mean, step, _nan(value) if last else None)
    return out


def _cut_points_split(
    engine: sa.Engine,
    run_ids: list[int],
    key: str,
    bounds: list[tuple[int, int, int]],
    *,
    last: bool,
    parts: int,
) -> dict[int, dict[int, tuple[Any, ...]]]:
    """`_cut_points` on SQLite, its runs shared out to `parts` connections at once (SQLite runs a
    statement on one core): the same answer, each run read whole on one connection."""
    shares = [run_ids[k::parts] for k in range(parts) if run_ids[k::parts]]

    def cut(share: list[int]) -> dict[int, dict[int, tuple[Any, ...]]]:
        with connect(engine) as conn:
            return _cut_points(conn, "sqlite", share, key, bounds, last=last)

    out: dict[int, dict[int, tuple[Any, ...]]] = {}
    for part in blocks._splitters.map(cut, shares):
        out.update(part)
    return out


_PG_LAST = "(max(ARRAY[m.step::double precision, m.value]))[2]"
_SQLITE_CURVE_BOUNDS = (
    "CREATE TEMP TABLE IF NOT EXISTS lab_curve_bounds "
    "(i INTEGER PRIMARY KEY, lo INTEGER NOT NULL, hi INTEGER NOT NULL)"
)
_SQLITE_CURVE_BUCKETS = (
    "CREATE TEMP TABLE IF NOT EXISTS lab_curve_buckets (run_id INTEGER NOT NULL, "
    "i INTEGER NOT NULL, lo INTEGER NOT NULL, hi INTEGER NOT NULL, PRIMARY KEY (run_id, i)) "
    "WITHOUT ROWID"
)
# SQLite keeps NaN as NULL, which min, max and avg skip.
_SQLITE_CURVE_CUT = """
SELECT b.run_id, b.i, min(m.value) AS lo_value, max(m.value) AS hi_value,
       avg(m.value) AS mean, max(m.step) AS last_step
FROM temp.lab_curve_buckets b
JOIN metrics m ON m.run_id = b.run_id AND m."key" = :key AND m.step >= b.lo AND m.step < b.hi
GROUP BY b.run_id, b.i
"""
# PostgreSQL keeps NaN, which it orders above every number: left out of min, max and avg.
# The last value is taken in the same pass: the greatest (step, value) pair's value.
_PG_CURVE_CUT = """
SELECT m.run_id, (m.step - :lo) * :n / :width AS i,
       min(NULLIF(m.value, 'NaN'::double precision)) AS lo_value,
       max(NULLIF(m.value, 'NaN'::double precision)) AS hi_value,
       avg(NULLIF(m.value, 'NaN'::double precision)) AS mean, max(m.step) AS last_step,
       {last} AS last_value
FROM metrics m
WHERE m.run_id IN :run_ids AND m."key" = :key
GROUP BY 1, 2
"""
