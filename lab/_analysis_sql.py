"""The SQL that `lab.analysis` builds on: which runs of an experiment count (a `Scope`,
checked for the arms, metrics and evals asked about), the t quantiles and intervals, and
literals and small relations DuckDB reads back exactly."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import duckdb

from lab._ranking import COUNTED_STATUSES, Declaration, declaration, lacking_text
from lab._stats import t_ppf
from lab._table import plural
from lab.errors import ConfigError

CONFIDENCE = 0.95
_LISTED = 20  # names shown in an error message before "and N more"


# -- scope: the experiment, the runs that count, and checks ---------------------------------


@dataclass(frozen=True)
class Scope:
    """An experiment and the SQL (a CTE named `counted`) of the runs that count in it."""

    con: duckdb.DuckDBPyConnection
    experiment: str
    experiment_id: int
    counted: str  # "counted AS (...)": run_id, run_key, repeat, seed, stage, arm_id, arm
    #: What the experiment declares: its ranking metric, mode and metrics' ranges.
    declared: Declaration = field(default_factory=Declaration)

    def rows(self, sql: str) -> list[tuple]:
        """The rows of `sql`, which may read `counted` (or continue its CTE list after a comma)."""
        return self.con.sql(f"WITH {self.counted} {sql}").fetchall()


# Every CTE here is MATERIALIZED. DuckDB 1.5 inlines a CTE that is read more than once by
# copying its plan, and the sqlite scanner's scan cannot be copied: printing such a relation
# (its repr, as a notebook shows it) fails with "INTERNAL Error: Attempted to access index 0
# within vector of size 0". A materialized CTE is computed once and never copied.


def lit(value: str | None) -> str:
    """A SQL string literal."""
    return "NULL" if value is None else "'" + value.replace("'", "''") + "'"


def listing(names: list[str]) -> str:
    """Names for an error message: the first few, then how many more."""
    if not names:
        return "none"
    shown = ", ".join(names[:_LISTED])
    return shown if len(names) <= _LISTED else f"{shown} and {len(names) - _LISTED} more"


def open_scope(con: duckdb.DuckDBPyConnection, experiment: str, stage: int | None) -> Scope:
    """The runs of `experiment` that count (at `stage`, else each arm's last stage); an
    unknown experiment, a bad stage or no run that counts is one line that says so."""
    found = con.execute(
        "SELECT experiment_id, config FROM experiments WHERE name = ?", [experiment]
    ).fetchone()
    if found is None:
        known = [n for (n,) in con.sql("SELECT name FROM experiments ORDER BY name").fetchall()]
        raise ConfigError(
            f"no experiment named {experiment!r} in the store; known: {listing(known)}"
        )
    if stage is not None and (isinstance(stage, bool) or not isinstance(stage, int)):
        raise ConfigError(f"stage={stage!r}: give a stage number (0 is the first) or None")
    eid = int(found[0])
    statuses = ", ".join(lit(s) for s in COUNTED_STATUSES)
    last_stage = (
        str(stage)
        if stage is not None
        else f"(SELECT max(r2.stage) FROM runs r2 WHERE r2.experiment_id = {eid} "
        "AND r2.arm_id IS NOT DISTINCT FROM r.arm_id)"
    )
    counted = f"""counted AS MATERIALIZED (
        SELECT r.run_id, r.run_key, r.repeat, r.seed, r.stage, r.arm_id, a.name AS arm
        FROM runs r LEFT JOIN arms a ON a.arm_id = r.arm_id
        WHERE r.experiment_id = {eid} AND r.status IN ({statuses}) AND r.stage = {last_stage}
    )"""
    config = json.loads(found[1]) if isinstance(found[1], str) else found[1]
    scope = Scope(con, experiment, eid, counted, declaration(config))
    if not scope.rows("SELECT 1 FROM counted LIMIT 1"):
        which = "" if stage is None else f" at stage {stage}"
        raise ConfigError(
            f"experiment {experiment!r} has no completed or stopped runs{which} to analyse; "
            f"`lab show {experiment}` lists its runs and their statuses"
        )
    return scope


def check_arms(scope: Scope, *arms: str) -> None:
    """Each of `arms` is an arm of the experiment with runs that count."""
    known = [n for (n,) in scope.con.execute(
        "SELECT name FROM arms WHERE experiment_id = ? ORDER BY arm_id", [scope.experiment_id]
    ).fetchall()]  # fmt: skip
    for arm in arms:
        if arm not in known:
            raise ConfigError(
                f"experiment {scope.experiment!r} has no arm {arm!r}; arms: {listing(known)}"
            )
    present = {a for (a,) in scope.rows("SELECT DISTINCT arm FROM counted")}
    for arm in arms:
        if arm not in present:
            raise ConfigError(
                f"arm {arm!r} of experiment {scope.experiment!r} has no completed or stopped "
                f"runs to compare; `lab show {scope.experiment}` lists its runs"
            )


def _arm_filter(arms: tuple[str, ...]) -> str:
    return "TRUE" if not arms else f"c.arm IN ({', '.join(lit(a) for a in arms)})"


def check_metric(scope: Scope, key: str, arms: tuple[str, ...] = ()) -> None:
    """`key` is a metric of every counted run (of `arms`, when given)."""
    rows = scope.rows(
        f"""SELECT c.run_key, s.run_id IS NOT NULL FROM counted c
            LEFT JOIN summaries s ON s.run_id = c.run_id AND s.key = {lit(key)}
            WHERE {_arm_filter(arms)} ORDER BY c.arm_id NULLS LAST, c.repeat"""
    )
    lacking = [run_key for run_key, has in rows if not has]
    if len(lacking) == len(rows):
        known = [k for (k,) in scope.rows(
            "SELECT DISTINCT s.key FROM summaries s JOIN counted c USING (run_id) ORDER BY 1"
        )]  # fmt: skip
        raise ConfigError(
            f"experiment {scope.experiment!r} has no metric {key!r}; known: {listing(known)}"
        )
    if lacking:
        raise ConfigError(
            f"{lacking_text(key, lacking, len(rows), scope.experiment)}; analyse a metric every "
            "run logged, or choose the runs yourself in SQL over the final_metrics view"
        )


def check_eval(scope: Scope, name: str, arms: tuple[str, ...] = (), *, every: bool) -> None:
    """`name` is an eval of the counted runs (with `every`: a successful one in each)."""
    rows = scope.rows(
        f"""SELECT c.run_key, count(ev.eval_id) FILTER (WHERE ev.error IS NULL) > 0,
                   count(ev.eval_id) > 0
            FROM counted c LEFT JOIN evals ev ON ev.run_id = c.run_id AND ev.name = {lit(name)}
            WHERE {_arm_filter(arms)} GROUP BY c.run_key, c.arm_id, c.repeat
            ORDER BY c.arm_id NULLS LAST, c.repeat"""
    )
    if not any(has_any for _, _, has_any in rows):
        known = [n for (n,) in scope.rows(
            "SELECT DISTINCT ev.name FROM evals ev JOIN counted c USING (run_id) ORDER BY 1"
        )]  # fmt: skip
        raise ConfigError(
            f"experiment {scope.experiment!r} has no eval {name!r}; known: {listing(known)}"
        )
    lacking = [run_key for run_key, ok, _ in rows if not ok]
    if every and lacking:
        raise ConfigError(
            f"eval {name!r} is missing (or failed) in {len(lacking)} of "
            f"{plural(len(rows), 'run')} of experiment {scope.experiment!r}: {listing(lacking)}; "
            "query the evals and predictions views to choose the runs yourself"
        )


# -- t quantiles ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def t_quantile(df: float) -> float:
    """The t quantile of the 95% interval at `df` degrees of freedom (DuckDB has none)."""
    return t_ppf(0.5 + CONFIDENCE / 2.0, df)


def tq_sql(max_df: int) -> str:
    """A CTE `tq(df, q)`: the t quantile of the CI for each df from 1 to `max_df`.

    DuckDB has no t distribution, so the quantiles are computed here once per df and
    joined in (the data never leaves DuckDB)."""
    dfs = list(range(1, max(max_df, 0) + 1))
    qs = ", ".join(f"{t_quantile(df)!r}::DOUBLE" for df in dfs)
    return (
        f"tq AS MATERIALIZED (SELECT unnest(range(1, {len(dfs) + 1})) AS df, "
        f"unnest([{qs}]::DOUBLE[]) AS q)"
    )


def ci_sql(n: str = "n", mean: str = "mean", std: str = "std") -> str:
    """ci_low and ci_high from n, mean, std and the joined quantile `tq.q`."""
    half = f"CASE WHEN {n} >= 2 THEN tq.q * {std} / sqrt({n}) END"
    return f"{mean} - {half} AS ci_low, {mean} + {half} AS ci_high"


def spread_sql(source: str, groups: str) -> str:
    """``SELECT groups, n, mean, std FROM source GROUP BY groups`` over its `value` column.

    The std is computed in two passes (the mean by a window first) rather than by
    ``stddev_samp``, which raises "out of range" on a NaN or an infinity: here a NaN or an
    infinite value makes the std NaN, as a diverged run should. n counts non-NULL values;
    with fewer than two the std is NULL."""
    return f"""SELECT {groups}, count(value) AS n, avg(value) AS mean,
               CASE WHEN count(value) >= 2
                    THEN sqrt(sum((value - center) ^ 2) / (count(value) - 1)) END AS std
        FROM (SELECT *, avg(value) OVER (PARTITION BY {groups}) AS center FROM {source})
        GROUP BY {groups}"""


def max_per_arm(scope: Scope) -> int:
    """The most runs that count in one arm: the largest n an interval needs a quantile for."""
    sql = "SELECT max(k) FROM (SELECT count(*) AS k FROM counted GROUP BY arm_id)"
    (most,) = scope.rows(sql)[0]
    return int(most or 0)


def sql_value(value: object) -> str:
    """A SQL literal of a Python value: floats go through text, so NaN, inf and every bit
    of a double survive."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, float):
        return f"'{value!r}'::DOUBLE"
    if isinstance(value, int):
        return str(value)
    return lit(str(value))


def values_relation(
    con: duckdb.DuckDBPyConnection, columns: tuple[tuple[str, str], ...], rows: list[tuple]
) -> duckdb.DuckDBPyRelation:
    """A relation of a few computed rows, typed, so it composes like the others."""
    names = ", ".join(name for name, _ in columns)
    typed = ", ".join(f"CAST({name} AS {kind}) AS {name}" for name, kind in columns)
    values = ", ".join(
        f"({i}, " + ", ".join(sql_value(v) for v in row) + ")" for i, row in enumerate(rows)
    )
    return con.sql(f"SELECT {typed} FROM (VALUES {values}) AS t(_row, {names}) ORDER BY _row")


def clipped_sql(low: str, high: str, lo: str, hi: str) -> str:
    """ci_low and ci_high clipped to the range (`lo`, `hi`) where it is not NULL; NULL and
    NaN stay as they are."""
    return (
        f"CASE WHEN {lo} IS NULL OR isnan({low}) THEN {low} ELSE greatest({low}, {lo}) END "
        f"AS ci_low, CASE WHEN {hi} IS NULL OR isnan({high}) THEN {high} "
        f"ELSE least({high}, {hi}) END AS ci_high"
    )
