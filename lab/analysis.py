"""Which arm wins, by how much, and where: statistics over `lab.inspect.connect()`'s views.

Each function takes the DuckDB connection from `lab.inspect.connect()` and returns a DuckDB
relation (``.df()`` for pandas, ``.fetchall()`` for tuples, or more SQL on top of it),
computed by DuckDB over the views. They are re-exported from `lab.inspect`:

>>> import lab.inspect                                                    # doctest: +SKIP
>>> con = lab.inspect.connect("sqlite:///lab.db")                         # doctest: +SKIP
>>> lab.inspect.summary(con, "lr-sweep", "val/loss").df()                 # doctest: +SKIP

Which runs count, in every function:

- Only runs whose status is ``completed`` or ``stopped``. Failed, crashed and still-running
  runs are left out (the views keep them, for anything else you want to ask), and so are
  runs superseded by a fresh start (the `runs` view leaves them out; `all_runs` keeps them).
- In an arm with stages (a chain per repeat), only the runs of the arm's last stage, the end
  of each chain; ``stage=k`` picks stage k instead. An arm without stages has stage 0 only.
- A metric, or an eval, that some of those runs lack is an error that names them: a mean
  over the runs that happen to have it would compare different sets of repeats.

Final values come from the `summaries` table (one row per run and key, kept current by
every flush), so `summary` and `compare` cost the same at any store size. `curves` reads the
points themselves. Arms come in the experiment's order (the order they were added).
Confidence intervals are Student-t 95% intervals across repeats: mean ± t(0.975, n-1)·std/√n
with the sample std; with one repeat the std and both bounds are NULL (NaN in pandas).
`summary` (and `plot_summary`) also offer ``interval="bootstrap"``, a percentile bootstrap
over the repeats, and `summary`, `curves`, `breakdown` and the plots take ``bounds``, a
metric's known range, to clip intervals to it; the ranges an experiment declares
(``Experiment(bounds=...)``) apply without it, as its metric and mode are `summary`'s
defaults (see docs/analysis.md, and `lab._ranking` for the definitions every door shares).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

import duckdb

from lab._analysis_sql import CONFIDENCE as CONFIDENCE  # read by the dashboard
from lab._analysis_sql import (
    Scope,
    check_arms,
    check_eval,
    check_metric,
    ci_sql,
    clipped_sql,
    listing,
    lit,
    max_per_arm,
    open_scope,
    spread_sql,
    sql_value,
    t_quantile,
    tq_sql,
    values_relation,
)
from lab._ranking import bounds_for, check_mode, choose, rank_arms
from lab._stats import Interval, check_bounds, check_interval, outside_text
from lab.errors import ConfigError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


# -- final values -----------------------------------------------------------------------------


def summary(
    con: duckdb.DuckDBPyConnection,
    experiment: str,
    metric: str | None = None,
    mode: Literal["min", "max"] | None = None,
    *,
    stage: int | None = None,
    interval: Interval = "t",
    bounds: tuple[float, float] | None = None,
) -> duckdb.DuckDBPyRelation:
    """Per arm, the final `metric` across repeats, ranked, so you can say which arm wins.

    Columns: arm, n, mean, std (sample), ci_low, ci_high (95% interval), rank (1 is best
    by `mode`: ``"min"`` when lower is better), is_best, and margin: on the best arm's row,
    how far it is ahead of the runner-up (NULL on the other rows, and with one arm). Rows
    come in the experiment's arm order; an arm with no run that counts has n = 0 and no
    rank, and so does an arm whose mean is NaN. Ties rank in arm order. Only completed and
    stopped runs count. `metric` defaults to the one the experiment declares
    (``Experiment(metric=...)``), else ``val/loss`` or ``loss``; `mode` to the experiment's
    for its metric, else ``"min"``.

    `interval`: ``"t"`` (Student's t, the default) or ``"bootstrap"`` (percentile bootstrap
    over the repeats, which never leaves the values' range). `bounds`: the metric's known
    range, e.g. ``(0, 1)`` for an accuracy (default: the range the experiment declares for
    it); the interval is clipped to it, and a value outside it is an error. The same numbers
    as `ExperimentResult.summary`, ``lab show`` and the dashboard (one definition of the
    runs that count, a run's final value and the ranking: `lab._ranking`), read back from
    the store:

    >>> lab.inspect.summary(con, "lr-sweep", "val/loss").df()             # doctest: +SKIP
    >>> lab.inspect.summary(con, "bench", "test/acc", "max", bounds=(0, 1))  # doctest: +SKIP
    """
    if mode is not None:
        check_mode(mode)
    check_interval(interval)
    scope = open_scope(con, experiment, stage)
    metric, mode = _ranked_by(scope, metric, mode)
    bounds = bounds_for(metric, bounds, scope.declared)
    check_metric(scope, metric)
    per_arm = _final_values(scope, metric)
    ranking = rank_arms(
        {arm_id: values for arm_id, (_arm, values) in per_arm.items()}, mode,
        interval=interval, bounds=bounds, metric=metric,
    )  # fmt: skip
    rows = []
    for arm_id, (arm, _values) in per_arm.items():
        st, spread_known = ranking.spreads[arm_id], ranking.spreads[arm_id].n >= 2
        rank = ranking.ranks.get(arm_id)
        rows.append((
            arm, st.n, st.mean if st.n else None, st.std if spread_known else None,
            st.ci_low if spread_known else None, st.ci_high if spread_known else None,
            rank, rank == 1, ranking.margin if rank == 1 else None,
        ))  # fmt: skip
    return values_relation(con, _SUMMARY_COLUMNS, rows)


def _final_values(scope: Scope, metric: str) -> dict[int | None, tuple[str | None, list[float]]]:
    """Per arm id, in the experiment's arm order: its name and the final `metric` of its runs
    that count, by repeat (an arm with none is there, with no values)."""
    per_arm: dict[int | None, tuple[str | None, list[float]]] = {}
    for arm_id, arm, value, _repeat in scope.rows(
        f"""SELECT arm_id, name, NULL, NULL FROM arms WHERE experiment_id = {scope.experiment_id}
            UNION ALL
            SELECT c.arm_id, c.arm, s.last_value, c.repeat FROM counted c
            JOIN summaries s ON s.run_id = c.run_id AND s.key = {lit(metric)}
            ORDER BY 1 NULLS LAST, 4 NULLS FIRST"""
    ):  # each arm once with no value (so an arm with nothing counted is a row), then values
        values = per_arm.setdefault(arm_id, (arm, []))[1]
        if value is not None:
            values.append(value)
    return per_arm


def _ranked_by(
    scope: Scope, metric: str | None, mode: Literal["min", "max"] | None
) -> tuple[str, Literal["min", "max"]]:
    """The metric and mode a summary of `scope` ranks by (`lab._ranking.choose`)."""
    if metric is not None:
        return metric, choose(metric, mode, scope.declared, [metric])[1]
    keys = [k for (k,) in scope.rows(
        "SELECT DISTINCT s.key FROM summaries s JOIN counted c USING (run_id) ORDER BY 1"
    )]  # fmt: skip
    chosen, mode = choose(None, mode, scope.declared, keys)
    if chosen is None:
        raise ConfigError(
            f"experiment {scope.experiment!r} declares no metric and logged neither val/loss "
            f"nor loss; name one: lab.inspect.summary(con, {scope.experiment!r}, METRIC); "
            f"known: {listing(keys)}"
        )
    return chosen, mode


_SUMMARY_COLUMNS = (
    ("arm", "VARCHAR"), ("n", "BIGINT"), ("mean", "DOUBLE"), ("std", "DOUBLE"),
    ("ci_low", "DOUBLE"), ("ci_high", "DOUBLE"), ("rank", "BIGINT"), ("is_best", "BOOLEAN"),
    ("margin", "DOUBLE"),
)  # fmt: skip


def compare(
    con: duckdb.DuckDBPyConnection,
    experiment: str,
    arm_a: str,
    arm_b: str,
    metric: str,
    *,
    stage: int | None = None,
) -> duckdb.DuckDBPyRelation:
    """The difference a - b of two arms' final `metric`, with a 95% CI, to tell a real gap
    from seed noise.

    When both arms ran the same seeds (repeat i of every arm gets seed + i), the runs are
    paired by seed and the CI is the t interval of the per-seed differences: the seed's
    share of the noise cancels, so the interval is usually much narrower. Otherwise (a
    repeat missing from one arm, say) it is Welch's unpaired interval over all runs. One row:
    metric, arm_a, arm_b, n (pairs when paired, else n_a + n_b), n_a, n_b, mean_a, mean_b,
    diff (mean_a - mean_b), df (degrees of freedom), ci_low, ci_high, paired.

    >>> lab.inspect.compare(con, "lr-sweep", "large", "small", "val/loss").df()  # doctest: +SKIP
    """
    scope = open_scope(con, experiment, stage)
    check_arms(scope, arm_a, arm_b)
    if arm_a == arm_b:
        raise ConfigError(f"compare needs two different arms, got {arm_a!r} twice")
    check_metric(scope, metric, (arm_a, arm_b))
    values = f"""v AS MATERIALIZED (
        SELECT c.arm, c.seed, s.last_value AS value FROM counted c
        JOIN summaries s ON s.run_id = c.run_id AND s.key = {lit(metric)}
        WHERE c.arm IN ({lit(arm_a)}, {lit(arm_b)})
    )"""
    seeds = dict(
        scope.rows(
            f", {values} SELECT arm, list(seed ORDER BY seed) FROM v GROUP BY arm"
        )  # the CTE list continues after `counted`
    )
    a_seeds, b_seeds = seeds.get(arm_a, []), seeds.get(arm_b, [])
    paired = a_seeds == b_seeds and len(set(a_seeds)) == len(a_seeds)
    head = f"{lit(metric)} AS metric, {lit(arm_a)} AS arm_a, {lit(arm_b)} AS arm_b"
    if paired:
        return _paired(scope, values, head, arm_a, arm_b, len(a_seeds))
    return _welch(scope, values, head, arm_a, arm_b)


def _paired(
    scope: Scope, values: str, head: str, arm_a: str, arm_b: str, n: int
) -> duckdb.DuckDBPyRelation:
    """`compare`'s row for arms that ran the same `n` seeds: the t interval of the
    per-seed differences a - b (the CTE `v` in `values` holds each run's value)."""
    sql = f"""
        WITH {scope.counted}, {values}, {tq_sql(n - 1)},
        p AS MATERIALIZED (
            SELECT x.value AS va, y.value AS vb FROM v x JOIN v y ON x.seed = y.seed
            WHERE x.arm = {lit(arm_a)} AND y.arm = {lit(arm_b)}
        ),
        d AS MATERIALIZED (SELECT 1 AS one, va - vb AS value FROM p),
        agg AS MATERIALIZED ({spread_sql("d", "one")})
        SELECT {head}, agg.n, agg.n AS n_a, agg.n AS n_b,
               (SELECT avg(va) FROM p) AS mean_a, (SELECT avg(vb) FROM p) AS mean_b,
               agg.mean AS diff, CASE WHEN agg.n >= 2 THEN agg.n - 1 END::DOUBLE AS df,
               {ci_sql("agg.n", "agg.mean", "agg.std")}, TRUE AS paired
        FROM agg LEFT JOIN tq ON tq.df = agg.n - 1
    """
    return scope.con.sql(sql)


def _welch(scope: Scope, values: str, head: str, arm_a: str, arm_b: str) -> duckdb.DuckDBPyRelation:
    """`compare`'s row for arms that did not run the same seeds: Welch's unpaired interval
    over all their runs (the CTE `v` in `values` holds each run's value)."""
    stats = f"""per_arm AS MATERIALIZED ({spread_sql("v", "arm")}),
    agg AS MATERIALIZED (
        SELECT a.n AS n_a, b.n AS n_b, a.mean AS mean_a, b.mean AS mean_b,
               a.std ^ 2 / a.n AS se2_a, b.std ^ 2 / b.n AS se2_b
        FROM per_arm a, per_arm b WHERE a.arm = {lit(arm_a)} AND b.arm = {lit(arm_b)}
    ),
    welch AS MATERIALIZED (
        SELECT *, se2_a + se2_b AS se2,
               (se2_a + se2_b) ^ 2 / (se2_a ^ 2 / (n_a - 1) + se2_b ^ 2 / (n_b - 1)) AS df
        FROM agg
    )"""
    (df,) = scope.rows(f", {values}, {stats} SELECT df FROM welch")[0]
    # The quantile is the one number DuckDB cannot compute; with no spread at all (df is
    # NaN: 0/0) the interval is the point itself, whatever the quantile.
    q = t_quantile(df) if df is not None and math.isfinite(df) and df > 0 else 0.0
    sql = f"""
        WITH {scope.counted}, {values}, {stats}
        SELECT {head}, n_a + n_b AS n, n_a, n_b, mean_a, mean_b, mean_a - mean_b AS diff,
               df, mean_a - mean_b - {q!r} * sqrt(se2) AS ci_low,
               mean_a - mean_b + {q!r} * sqrt(se2) AS ci_high, FALSE AS paired
        FROM welch
    """
    return scope.con.sql(sql)


# -- curves -----------------------------------------------------------------------------------


def curves(
    con: duckdb.DuckDBPyConnection,
    experiment: str,
    key: str,
    *,
    every: int | None = None,
    stage: int | None = None,
    bounds: tuple[float, float] | None = None,
) -> duckdb.DuckDBPyRelation:
    """Per arm and step, the mean of `key` across repeats with its 95% CI: learning curves
    with their seed spread.

    Columns: arm, step, n, mean, std, ci_low, ci_high. A value is never invented for a step
    a run did not log:

    - Runs of different lengths: a run counts at the steps it logged, so past the end of a
      short run `n` drops and the interval widens (NULL at n = 1). Filter on `n` to keep
      the steps every repeat reached.
    - Repeats that log at different intervals: pass ``every=k`` to bucket the steps into
      (0], (0, k], (k, 2k], ..., each labelled by its last step (k, 2k, ...). Each run
      contributes one value per bucket, the mean of its points in it, so a run that logs
      every step and one that logs every k-th step count once each at step k, 2k, ...
      Without `every`, each logged step is its own bucket, and `n` at a step counts only
      the runs that logged exactly that step.

    The band is the t interval at each step; with `bounds` (the metric's known range, e.g.
    ``(0, 1)`` for an accuracy; default: the range the experiment declares for it) it is
    clipped to that range.

    This reads the metrics view, so it scans the store's points (see
    `lab.inspect.history` for one run's series through the store's index).

    >>> lab.inspect.curves(con, "lr-sweep", "loss", every=10).df()       # doctest: +SKIP
    """
    check_bounds(bounds, key)
    scope, points = _points(con, experiment, key, every, stage)
    bounds = bounds_for(key, bounds, scope.declared)
    clipped = "ci_low, ci_high"
    if bounds is not None:  # NULL and NaN stay as they are
        clipped = clipped_sql("ci_low", "ci_high", sql_value(bounds[0]), sql_value(bounds[1]))
    sql = f"""
        WITH {scope.counted}, {tq_sql(max_per_arm(scope) - 1)}, {points},
        agg AS MATERIALIZED ({spread_sql("points", "arm_id, arm, step")}),
        ci AS MATERIALIZED (
            SELECT arm_id, arm, step, n, mean, std, {ci_sql()}
            FROM agg LEFT JOIN tq ON tq.df = agg.n - 1
        )
        SELECT arm, step, n, mean, std, {clipped}
        FROM ci ORDER BY arm_id NULLS LAST, step
    """
    return con.sql(sql)


def _points(
    con: duckdb.DuckDBPyConnection,
    experiment: str,
    key: str,
    every: int | None,
    stage: int | None,
) -> tuple[Scope, str]:
    """The scope, and a CTE `points`: one value of `key` per counted run and step (or bucket
    of `every` steps: the mean of the run's points in it)."""
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ConfigError(f"every={every!r}: give a bucket width in steps, an int >= 1, or None")
    scope = open_scope(con, experiment, stage)
    check_metric(scope, key)
    bucket = "m.step" if every is None else f"CAST(ceil(m.step / {every}) AS BIGINT) * {every}"
    return (
        scope,
        f"""points AS MATERIALIZED (
            SELECT c.arm_id, c.arm, c.run_id, c.run_key, c.repeat, {bucket} AS step,
                   avg(m.value) AS value
            FROM metrics m JOIN counted c ON c.run_id = m.run_id
            WHERE m.key = {lit(key)}
            GROUP BY c.arm_id, c.arm, c.run_id, c.run_key, c.repeat, {bucket}
        )""",
    )


# -- evals and predictions --------------------------------------------------------------------


def _latest(scope: Scope, name: str) -> str:
    """A CTE `latest`: each counted run's latest successful eval named `name`."""
    return f"""latest AS MATERIALIZED (
        SELECT eval_id, run_id, step, breakdowns FROM (
            SELECT ev.eval_id, ev.run_id, ev.step, ev.breakdowns, row_number() OVER (
                PARTITION BY ev.run_id ORDER BY ev.step DESC NULLS FIRST, ev.eval_id DESC
            ) AS newest
            FROM evals ev JOIN counted c ON c.run_id = ev.run_id
            WHERE ev.name = {lit(name)} AND ev.error IS NULL
        ) WHERE newest = 1
    )"""


def predictions(
    con: duckdb.DuckDBPyConnection, experiment: str, eval: str, *, stage: int | None = None
) -> duckdb.DuckDBPyRelation:
    """Every prediction of eval `eval`, one row each, with the run it came from: the long
    form to read examples, slice them, or join them to your own data.

    Columns: experiment, arm, repeat, run_key, seed, eval, step (NULL: after training), idx,
    example_id, input, output, target, score, extras (JSON). Every eval of that name is
    included, at every step; ordered by arm, repeat, step (post-training last) and idx.

    >>> p = lab.inspect.predictions(con, "bench", "test")                  # doctest: +SKIP
    >>> p.filter("step IS NULL AND output != target").df()                 # doctest: +SKIP
    """
    scope = open_scope(con, experiment, stage)
    check_eval(scope, eval, every=False)
    sql = f"""
        WITH {scope.counted}
        SELECT {lit(experiment)} AS experiment, c.arm, c.repeat, c.run_key, c.seed,
               ev.name AS eval, ev.step, p.idx, p.example_id, p.input, p.output, p.target,
               p.score, p.extras
        FROM counted c
        JOIN evals ev ON ev.run_id = c.run_id AND ev.name = {lit(eval)}
        JOIN predictions p ON p.eval_id = ev.eval_id
        ORDER BY c.arm_id NULLS LAST, c.repeat, ev.step NULLS LAST, p.idx
    """
    return con.sql(sql)


def disagreements(
    con: duckdb.DuckDBPyConnection,
    experiment: str,
    eval: str,
    arm_a: str,
    arm_b: str,
    limit: int | None = 20,
    *,
    stage: int | None = None,
) -> duckdb.DuckDBPyRelation:
    """The examples on which two arms differ most, to see *what* one arm gets right that the
    other gets wrong, not just by how much.

    Uses each run's latest `eval` (the post-training one when there is one, else the one at
    the highest step). Examples are matched by example_id, else by idx, and only those both
    arms scored appear. Per arm, over its repeats: output_* is the most common output (ties:
    the smallest), score_* the mean score, correct_* the fraction of repeats whose output
    equals the target exactly: defined for a discrete target (a class, a string, an
    integer, a boolean, a list of them), NULL without a target and where the target or the
    output is a real number (a regression, where exact equality says nothing: its score
    says how close it came). diff is score_a - score_b, or correct_a - correct_b where there
    are no scores. Rows are ordered by |diff|, largest first, then
    examples whose most common outputs differ; at most `limit` rows (None: all).

    Columns: example_id, input, target, output_a, output_b, score_a, score_b, correct_a,
    correct_b, diff.

    >>> d = lab.inspect.disagreements(con, "bench", "test", "big", "small")  # doctest: +SKIP
    >>> d.df()                                                               # doctest: +SKIP
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"limit={limit!r}: give a number of rows, an int >= 1, or None")
    scope = open_scope(con, experiment, stage)
    check_arms(scope, arm_a, arm_b)
    if arm_a == arm_b:
        raise ConfigError(f"disagreements needs two different arms, got {arm_a!r} twice")
    check_eval(scope, eval, (arm_a, arm_b), every=True)
    sql = f"""
        WITH {scope.counted}, {_latest(scope, eval)}, {_per_example(arm_a, arm_b)}
        SELECT a.example_id, coalesce(a.input, b.input) AS input,
               coalesce(a.target, b.target) AS target, ta.output AS output_a,
               tb.output AS output_b, a.score AS score_a, b.score AS score_b,
               a.correct AS correct_a, b.correct AS correct_b,
               coalesce(a.score - b.score, a.correct - b.correct) AS diff
        FROM per a
        JOIN per b ON b.example_id = a.example_id AND b.arm = {lit(arm_b)}
        JOIN top ta ON ta.example_id = a.example_id AND ta.arm = a.arm
        JOIN top tb ON tb.example_id = b.example_id AND tb.arm = b.arm
        WHERE a.arm = {lit(arm_a)}
        ORDER BY abs(diff) DESC NULLS LAST, (ta.output IS DISTINCT FROM tb.output) DESC,
                 a.idx, a.example_id
        {"" if limit is None else f"LIMIT {limit}"}
    """
    return con.sql(sql)


def _per_example(arm_a: str, arm_b: str) -> str:
    """CTEs over the predictions of the `latest` evals of two arms: `p` (each one, by
    example), `top` (each arm's most common output per example, ties: the smallest) and
    `per` (per arm and example: the mean score and the fraction of repeats correct)."""
    return f"""
        p AS MATERIALIZED (
            SELECT c.arm, coalesce(p.example_id, CAST(p.idx AS VARCHAR)) AS example_id,
                   p.idx, p.input, p.output, p.target, p.score
            FROM latest l JOIN counted c ON c.run_id = l.run_id
            JOIN predictions p ON p.eval_id = l.eval_id
            WHERE c.arm IN ({lit(arm_a)}, {lit(arm_b)})
        ),
        top AS MATERIALIZED (
            SELECT arm, example_id, output FROM (
                SELECT arm, example_id, output, row_number() OVER (
                    PARTITION BY arm, example_id ORDER BY count(*) DESC, output NULLS LAST
                ) AS pick
                FROM p GROUP BY arm, example_id, output
            ) WHERE pick = 1
        ),
        per AS MATERIALIZED (
            SELECT arm, example_id, min(idx) AS idx, min(input) AS input,
                   min(target) AS target, avg(score) AS score,
                   avg(CASE WHEN target IS NULL OR {_real("target")} OR {_real("output")}
                            THEN NULL
                            WHEN output IS NOT DISTINCT FROM target THEN 1.0 ELSE 0.0 END)
                       AS correct
            FROM p GROUP BY arm, example_id
        )"""


def _real(column: str) -> str:
    """SQL: whether a prediction's text `column` holds a real number (one that reads as a
    number and is not an integer: ``-1.07``, ``1e5``, ``NaN``), where exact equality with
    a target says nothing."""
    return (
        f"(TRY_CAST({column} AS DOUBLE) IS NOT NULL "
        f"AND NOT regexp_full_match(trim({column}), '[-+]?[0-9]+'))"
    )


def breakdown(
    con: duckdb.DuckDBPyConnection,
    experiment: str,
    eval: str,
    *,
    stage: int | None = None,
    bounds: Mapping[str, tuple[float, float]] | tuple[float, float] | None = None,
) -> duckdb.DuckDBPyRelation:
    """Per arm, slice and metric of an eval's breakdowns, the mean across repeats with its
    95% CI: where an arm's overall gain comes from.

    Reads ``evals.breakdowns`` (``{slice: {metric: value}}``, from `EvalResult.breakdowns`)
    of each run's latest successful `eval`: the post-training one (step NULL) when there is
    one, else the one at the highest step. Columns: arm, slice, metric, n, mean, std,
    ci_low, ci_high; ordered by arm (the experiment's order), slice, metric. A slice or
    metric that some runs' breakdowns lack is an error naming those runs.

    `bounds` gives metrics' known ranges (``{"acc": (0, 1)}``, or one range for every
    metric): their intervals are clipped to them, and a value outside is an error. The
    ranges the experiment declares for the eval's metrics (``"<eval>/<metric>"``, e.g.
    ``Experiment(bounds={"holdout/acc": (0, 1)})``) apply without it.

    >>> lab.inspect.breakdown(con, "bench", "test").df()                   # doctest: +SKIP
    """
    scope = open_scope(con, experiment, stage)
    check_eval(scope, eval, every=True)
    ranges = _eval_ranges(scope, eval, bounds)
    values = f"""{_latest(scope, eval)},
        b AS MATERIALIZED (
            SELECT c.arm_id, c.arm, c.run_key, c.repeat, s.key AS slice, m.key AS metric,
                   CAST(m.value ->> '$' AS DOUBLE) AS value
            FROM latest l JOIN counted c ON c.run_id = l.run_id,
                 json_each(l.breakdowns) s, json_each(s.value) m
        )"""
    _check_breakdowns(scope, eval, values)
    values, ci, clipped = _bounded(scope, eval, values, ranges)
    sql = f"""
        WITH {scope.counted}, {tq_sql(max_per_arm(scope) - 1)}, {values},
        agg AS MATERIALIZED ({spread_sql("b", "arm_id, arm, slice, metric")}),
        ci AS MATERIALIZED (
            SELECT arm_id, arm, slice, metric, n, mean, std, {ci}
            FROM agg LEFT JOIN tq ON tq.df = agg.n - 1
        )
        SELECT arm, slice, metric, n, mean, std, {clipped}
        FROM ci ORDER BY arm_id NULLS LAST, slice, metric
    """
    return con.sql(sql)


def _check_breakdowns(scope: Scope, eval: str, values: str) -> None:
    """Every run that counts has every slice and metric its arm's breakdowns have (the CTE
    `b` in `values` holds them, one row per run, slice and metric)."""
    missing = scope.rows(
        f""", {values},
        cells AS MATERIALIZED (SELECT DISTINCT arm_id, slice, metric FROM b),
        expected AS MATERIALIZED (
            SELECT c.run_key, c.arm_id, c.repeat, cells.slice, cells.metric
            FROM counted c JOIN latest l ON l.run_id = c.run_id
            JOIN cells ON cells.arm_id IS NOT DISTINCT FROM c.arm_id
        )
        SELECT e.run_key || ' (' || e.slice || '/' || e.metric || ')' FROM expected e
        LEFT JOIN b ON b.run_key = e.run_key AND b.slice = e.slice AND b.metric = e.metric
        WHERE b.run_key IS NULL ORDER BY e.arm_id NULLS LAST, e.repeat, e.slice, e.metric"""
    )
    if missing:
        raise ConfigError(
            f"breakdowns of eval {eval!r} differ across the runs of experiment "
            f"{scope.experiment!r}; missing: {listing([m for (m,) in missing])}; query the evals "
            "view to choose the runs yourself"
        )


def _bounded(
    scope: Scope, eval: str, values: str, ranges: dict[str | None, tuple[float, float]]
) -> tuple[str, str, str]:
    """`values` with the CTE `bnd` of the metrics' `ranges` added, the interval columns and
    the interval clipped to them; a value outside its range is an error. Without ranges:
    the interval as it is."""
    ci = ci_sql()
    clipped = "ci_low, ci_high"
    if ranges:
        rows = ", ".join(
            f"({'NULL' if m is None else lit(m)}, {sql_value(lo)}, {sql_value(hi)})"
            for m, (lo, hi) in ranges.items()
        )
        values += f""",
        bnd AS MATERIALIZED (SELECT * FROM (VALUES {rows}) AS t(metric, lo, hi))"""
        range_of = "bnd.metric IS NULL OR bnd.metric = {0}.metric"
        outside = scope.rows(
            f""", {values} SELECT b.metric, b.value, bnd.lo, bnd.hi FROM b JOIN bnd
                ON {range_of.format("b")} WHERE b.value < bnd.lo OR b.value > bnd.hi
                ORDER BY b.arm_id NULLS LAST, b.repeat, b.slice, b.metric LIMIT 1"""
        )
        if outside:
            metric, value, lo, hi = outside[0]
            raise ConfigError(outside_text(f"{eval}/{metric}", value, (lo, hi)))
        ci = f"""{ci_sql()}, (SELECT min(lo) FROM bnd WHERE {range_of.format("agg")}) AS lo,
               (SELECT max(hi) FROM bnd WHERE {range_of.format("agg")}) AS hi"""
        clipped = clipped_sql("ci_low", "ci_high", "lo", "hi")
    return values, ci, clipped


def _eval_ranges(
    scope: Scope, eval: str, bounds: Mapping[str, tuple[float, float]] | tuple[float, float] | None
) -> dict[str | None, tuple[float, float]]:
    """The ranges of an eval's breakdown metrics, by metric name (None: every metric): the
    experiment's declared ``"<eval>/<metric>"`` ranges, then `bounds` over them."""
    prefix = f"{eval}/"
    ranges: dict[str | None, tuple[float, float]] = {
        key[len(prefix) :]: r
        for key, r in (scope.declared.bounds or {}).items()
        if key.startswith(prefix)
    }
    if bounds is None:
        return ranges
    if isinstance(bounds, Mapping):
        for metric, r in bounds.items():
            checked = check_bounds(r, str(metric))
            if checked is not None:
                ranges[str(metric)] = checked
        return ranges
    checked = check_bounds(bounds)
    return {None: checked} if checked is not None else ranges


# -- plots ------------------------------------------------------------------------------------


def _axes(ax: Axes | None) -> tuple[Figure, Axes]:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - matplotlib is a dependency
        raise ImportError("plots need matplotlib: pip install 'matplotlib>=3.8'") from exc
    if ax is None:
        fig = Figure()
        return fig, fig.add_subplot()
    return ax.get_figure(), ax  # type: ignore[return-value]  # an Axes always has a figure


def _label(arm: str | None) -> str:
    return "(no arm)" if arm is None else str(arm)


def ema(values: list[float], weight: float) -> list[float]:
    """Exponential moving average: s[0] = x[0], s[i] = weight·s[i-1] + (1-weight)·x[i].

    `weight` is how much the past counts (0: no smoothing; TensorBoard's and W&B's slider).
    A NaN point stays NaN in the output and is skipped by the average.
    """
    out: list[float] = []
    smoothed: float | None = None
    for x in values:
        if math.isnan(x):
            out.append(math.nan)
            continue
        smoothed = x if smoothed is None else weight * smoothed + (1.0 - weight) * x
        out.append(smoothed)
    return out


def plot_curves(
    con: duckdb.DuckDBPyConnection,
    experiment: str,
    key: str,
    ax: Axes | None = None,
    *,
    every: int | None = None,
    stage: int | None = None,
    log_y: bool = False,
    smooth: float | None = None,
    seeds: bool = False,
    bounds: tuple[float, float] | None = None,
) -> Figure:
    """`curves` drawn: one line per arm (the mean across repeats) in a shaded 95% CI band.

    ``log_y=True`` puts the y axis on a log scale. ``smooth=w`` (0 <= w < 1) draws the mean,
    the band and the seeds through an exponential moving average of weight `w` (see `ema`),
    with the raw mean faint behind. ``seeds=True`` adds each run's own curve, thin, in its
    arm's colour (its `gid` is the run key). `bounds` clips the band to the metric's range.

    Draws on `ax` when given, else on a new `matplotlib.figure.Figure` (no pyplot, so it
    works under any backend and in threads); returns the figure. Save it with
    ``fig.savefig("curves.png")``, or let a notebook show it.

    >>> lab.inspect.plot_curves(con, "lr-sweep", "loss").savefig("loss.png")  # doctest: +SKIP
    >>> lab.inspect.plot_curves(con, "lr-sweep", "loss", log_y=True, smooth=0.6, seeds=True)
    ... # doctest: +SKIP
    """
    if smooth is not None and (
        isinstance(smooth, bool) or not isinstance(smooth, int | float) or not 0 <= smooth < 1
    ):
        raise ConfigError(
            f"smooth={smooth!r}: give the moving average's weight, 0 <= smooth < 1 (e.g. 0.6), "
            "or None"
        )
    data = curves(con, experiment, key, every=every, stage=stage, bounds=bounds).fetchall()
    runs = _seed_curves(con, experiment, key, every, stage) if seeds else {}
    fig, ax = _axes(ax)
    by_arm: dict[str | None, list[tuple]] = {}
    for arm, step, _n, mean, _std, low, high in data:
        by_arm.setdefault(arm, []).append((step, mean, low, high))
    for arm, rows in by_arm.items():
        _draw_arm(ax, arm, rows, runs.get(arm, {}), smooth)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    what = "mean and 95% CI across repeats"
    if smooth is not None:
        what += f", EMA {smooth:g}"
    ax.set_title(f"{experiment}: {key} ({what})")
    ax.legend(title="arm")
    return fig


def _seed_curves(
    con: duckdb.DuckDBPyConnection, experiment: str, key: str, every: int | None, stage: int | None
) -> dict[str | None, dict[str, list[tuple[int, float]]]]:
    """Each counted run's own curve of `key` (bucketed as `curves` does), by arm and run key."""
    runs: dict[str | None, dict[str, list[tuple[int, float]]]] = {}
    scope, points = _points(con, experiment, key, every, stage)
    for arm, run_key, step, value in scope.rows(
        f""", {points} SELECT arm, run_key, step, value FROM points
            ORDER BY arm_id NULLS LAST, repeat, step"""
    ):
        runs.setdefault(arm, {}).setdefault(run_key, []).append((step, value))
    return runs


def _draw_arm(
    ax: Axes,
    arm: str | None,
    rows: list[tuple],
    runs: dict[str, list[tuple[int, float]]],
    smooth: float | None,
) -> None:
    """One arm of `plot_curves`: its mean line (smoothed, the raw one faint behind), its CI
    band, and its runs' own curves, thin, in the same colour (each with its run key as gid)."""
    nan = float("nan")

    def shown(ys: list[float]) -> list[float]:
        return ys if smooth is None else ema(ys, float(smooth))

    steps = [r[0] for r in rows]
    means = [nan if r[1] is None else r[1] for r in rows]
    (line,) = ax.plot(steps, shown(means), label=_label(arm))
    color = line.get_color()
    if smooth is not None:  # the raw mean, faint, behind the smoothed one
        ax.plot(steps, means, color=color, alpha=0.3, linewidth=0.8, label="_raw")
    lows = shown([nan if r[2] is None else r[2] for r in rows])
    highs = shown([nan if r[3] is None else r[3] for r in rows])
    ax.fill_between(steps, lows, highs, color=color, alpha=0.2, linewidth=0)
    for run_key, points in runs.items():
        (seed_line,) = ax.plot(
            [p[0] for p in points],
            shown([nan if p[1] is None else p[1] for p in points]),
            color=color, alpha=0.5, linewidth=0.7, label="_seed",
        )  # fmt: skip
        seed_line.set_gid(run_key)


def plot_summary(
    con: duckdb.DuckDBPyConnection,
    experiment: str,
    metric: str | None = None,
    mode: Literal["min", "max"] | None = None,
    ax: Axes | None = None,
    *,
    stage: int | None = None,
    interval: Interval = "t",
    bounds: tuple[float, float] | None = None,
) -> Figure:
    """`summary` drawn: each arm's mean final `metric` with its 95% CI as an error bar, the
    best arm named in the title. `interval` and `bounds` are `summary`'s.

    Draws on `ax` when given, else on a new `matplotlib.figure.Figure`; returns the figure.
    An arm with one repeat has a point and no bar.

    >>> lab.inspect.plot_summary(con, "lr-sweep", "val/loss").savefig("val.png")  # doctest: +SKIP
    """
    relation = summary(con, experiment, metric, mode, stage=stage, interval=interval,
                       bounds=bounds)  # fmt: skip
    rows = relation.fetchall()
    metric, mode = _ranked_by(open_scope(con, experiment, stage), metric, mode)
    fig, ax = _axes(ax)
    nan = float("nan")
    xs = list(range(len(rows)))
    means = [nan if r[2] is None else r[2] for r in rows]
    below = [nan if r[4] is None else r[2] - r[4] for r in rows]
    above = [nan if r[5] is None else r[5] - r[2] for r in rows]
    ax.errorbar(xs, means, yerr=[below, above], fmt="o", capsize=4)
    ax.set_xticks(xs, [_label(r[0]) for r in rows])
    ax.set_xlabel("arm")
    ax.set_ylabel(metric)
    best = [r for r in rows if r[7]]
    ci = "95% CI" if interval == "t" else f"95% {interval} CI"
    title = f"{experiment}: final {metric} (mean and {ci} across repeats)"
    if best:
        title += f"\nbest ({mode}): {_label(best[0][0])}"
    ax.set_title(title)
    return fig
