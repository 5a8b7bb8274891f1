"""Summary upkeep: one row per (run, metric key) with its count, last, min and max, kept
current in the transaction that writes the metrics, so readers never scan the metrics."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from lab.store.schema import SqlSummary

# Merges a batch that extends a series: NULL (all NaN) never replaces a stored min or max.
_SUMMARY_UPSERT = (
    'INSERT INTO summaries (run_id, "key", "count", first_step, last_step, last_value, '
    "min_value, max_value, last_wall_time) "
    "VALUES ({m}, {m}, {m}, {m}, {m}, {m}, {m}, {m}, {m}) "
    'ON CONFLICT (run_id, "key") DO UPDATE SET '
    '"count" = summaries."count" + excluded."count", '
    "last_step = excluded.last_step, last_value = excluded.last_value, "
    "last_wall_time = excluded.last_wall_time, "
    "min_value = CASE WHEN summaries.min_value IS NULL OR excluded.min_value < "
    "summaries.min_value THEN excluded.min_value ELSE summaries.min_value END, "
    "max_value = CASE WHEN summaries.max_value IS NULL OR excluded.max_value > "
    "summaries.max_value THEN excluded.max_value ELSE summaries.max_value END"
)


# Rebuilds summaries from metrics. PostgreSQL keeps NaN and orders it above inf, so its
# min and max filter NaN out; SQLite stores NaN as NULL, which min and max skip anyway.
_RESUMMARIZE = """
INSERT INTO summaries (run_id, "key", "count", first_step, last_step, last_value,
                       min_value, max_value, last_wall_time)
SELECT m.run_id, m."key", count(*), min(m.step), max(m.step),
       (SELECT l.value FROM metrics l WHERE l.run_id = m.run_id AND l."key" = m."key"
        ORDER BY l.step DESC LIMIT 1),
       min(m.value){finite}, max(m.value){finite},
       (SELECT l.wall_time FROM metrics l WHERE l.run_id = m.run_id AND l."key" = m."key"
        ORDER BY l.step DESC LIMIT 1)
FROM metrics m
WHERE m.run_id = :run_id{only}
GROUP BY m.run_id, m."key"
"""


class Summaries:
    """The summary upkeep of the metric rows (`lab.store.metric_rows.MetricRows`): its
    statements, built once for the store's dialect, and the folds that run them."""

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect
        mark = "%s" if dialect == "postgresql" else "?"
        self._summary_upsert = _SUMMARY_UPSERT.format(m=mark)
        ids: sa.BindParameter[list[int]] = sa.bindparam("ids", expanding=True)
        self._last_steps = sa.select(SqlSummary.run_id, SqlSummary.key, SqlSummary.last_step).where(
            SqlSummary.run_id.in_(ids)
        )

    def summarize(
        self, conn: Connection, acc: dict[int, dict[str, list[Any]]]
    ) -> set[tuple[int, str]]:
        """Fold a batch into `summaries`. A batch that only extends a series (its first step
        after the stored last step, its steps increasing) is merged in place; one that logs
        a step again (stored, or twice in the batch), which may replace a min, a max or the
        last value, is recomputed from `metrics`. Returns the (run, key) recomputed (their
        blocks are rebuilt too: `lab.store.blocks.Blocks.block`)."""
        known = {
            (run_id, key): last
            for run_id, key, last in conn.execute(self._last_steps, {"ids": list(acc)})
        }
        merge = []
        again: dict[int, list[str]] = {}
        for run_id, per in acc.items():
            for key, (n, first, last, value, lo, hi, wall, twice) in per.items():
                stored = known.get((run_id, key))
                if twice or (stored is not None and first <= stored):
                    again.setdefault(run_id, []).append(key)
                    continue
                if lo > hi:  # every point was NaN
                    lo = hi = None
                merge.append((run_id, key, n, first, last, value, lo, hi, wall))
        if merge:
            conn.exec_driver_sql(self._summary_upsert, merge)
        for run_id, keys in again.items():
            self.resummarize(conn, run_id, keys)
        return {(run_id, key) for run_id, keys in again.items() for key in keys}

    def resummarize(self, conn: Connection, run_id: int, keys: list[str] | None = None) -> None:
        """Rebuild a run's summaries (or some keys' of them) from its metrics."""
        where = [SqlSummary.run_id == run_id]
        if keys is not None:
            where.append(SqlSummary.key.in_(keys))
        conn.execute(sa.delete(SqlSummary).where(*where))
        finite = "" if self.dialect == "sqlite" else " FILTER (WHERE m.value <> 'NaN')"
        only = ' AND m."key" IN :keys' if keys is not None else ""
        sql = sa.text(_RESUMMARIZE.format(finite=finite, only=only))
        if keys is not None:
            sql = sql.bindparams(sa.bindparam("keys", expanding=True))
        conn.execute(sql, {"run_id": run_id, **({"keys": keys} if keys is not None else {})})
