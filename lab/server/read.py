"""The read API: experiments, runs, summaries, series, predictions, evals, checkpoints and
exports, read from the server's `Store` with bound parameters only.

Every answer is JSON in which NaN and ±inf are the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"`` (as lab writes every JSON document, `lab._json`), timestamps are ISO 8601
(naive UTC), and a table is an Arrow IPC stream (``/tables``, ``/export``) in which NaN is a
float again. An unknown experiment or run answers 404, a bad parameter 400, each with
``{"detail": "<one line>", "field": "<the parameter>" | null}``.
"""

from __future__ import annotations

import io
import json
import math
import re
import threading
from datetime import datetime
from typing import Annotated, Any, Literal, cast

import fastapi
import pyarrow as pa
import pydantic
import sqlalchemy as sa
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.convertors import PathConvertor, register_url_convertor

from lab._json import finite_json
from lab.errors import NoExperiment, NoRun
from lab.server.openapi import (
    NAME_IN_PATH,
    NO_NUL,
    NamePath,
    Number,
    RunPath,
    Timestamp,
    one_of,
    problems,
    ranged,
)
from lab.server.owners import access
from lab.server.rejected import Rejected
from lab.store import Store, arrow, blocks, dashboard_reads, served_reads
from lab.store.engine import connect
from lab.store.tables import TABLES

router = fastapi.APIRouter(tags=["read"])


class AnyText(PathConvertor):
    """The ``{name:text}`` of a route: any text, ``/`` and line breaks included, as an
    experiment's name may hold them (starlette's ``path`` stops at a line break)."""

    regex = "[\\s\\S]*"


register_url_convertor("text", AnyText())

#: Tables ``/tables`` serves: what `lab.inspect.connect` builds its views over (never the
#: server's own `PRIVATE_TABLES`: token hashes, ingest bookkeeping).
SERVED_TABLES = TABLES
#: Columns SQLite keeps NaN in as NULL (a metric value is never missing): NaN again on the wire.
#: The most predictions one page holds, and the most buckets one series is cut into.
MAX_PAGE = 10_000
MAX_BUCKETS = 100_000
#: A ``step`` of the predictions: a step number, or ``final`` (the eval after training).
STEP = re.compile(r"^(?:final|-?[0-9]{1,18})$")
#: A page cursor of the predictions, as ``next`` gives it: the eval's id and the row's idx.
CURSOR = re.compile(r"^([0-9]{1,18})\.([0-9]{1,18})$")
ARROW_STREAM = "application/vnd.apache.arrow.stream"
PARQUET = "application/vnd.apache.parquet"


class LabJSON(JSONResponse):
    """JSON as lab writes it: non-finite floats as strings, datetimes as ISO 8601."""

    def render(self, content: Any) -> bytes:
        return json.dumps(
            finite_json(content), ensure_ascii=False, allow_nan=False, default=_iso
        ).encode("utf-8")


def _iso(value: Any) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON")


_OPENING = threading.Lock()


def store_of(request: fastapi.Request) -> Store:
    """The store the reads go to: the app's store opened a second time, read-only, as
    ``lab ls`` and ``lab show`` open it, so a run whose process is gone shows as crashed
    over HTTP exactly as it does there (and reads never write). Opened on first use."""
    state = request.app.state
    reader = getattr(state, "reader", None)
    if reader is None:
        with _OPENING:
            reader = getattr(state, "reader", None)
            if reader is None:
                served: Store = state.store
                private = served.engine.url.database in (None, "", ":memory:")
                reader = served if private else Store(served.url, readonly=True)
                state.reader = reader
    return reader


StoreDep = fastapi.Depends(store_of)


# -- answers ----------------------------------------------------------------------------------
class ExperimentRow(BaseModel):
    """An experiment in the list: its status, and its runs counted by status."""

    name: str
    status: str
    arms: int
    repeats: int
    runs: int
    runs_by_status: dict[str, int]
    points: int
    superseded: int
    created_at: Timestamp
    tags: list[str]
    notes: str | None


class RunFacts(BaseModel):
    """What every answer about a run says of it: its arm, repeat, stage and seed, its
    status (crashed when its process is gone) and error, when it started and ended."""

    run_id: int
    run_key: str
    arm: str | None
    repeat: int
    stage: int
    seed: int
    status: str
    error: str | None
    started_at: Timestamp
    ended_at: Timestamp | None


class RunRow(RunFacts):
    """A current run of an experiment, with its traceback, its newest step and the last
    value of each metric (``summary``)."""

    summary: dict[str, Any]
    callback_errors: list[Any] | None
    tags: list[str]
    notes: str | None
    provenance: dict[str, Any] | None
    traceback: str | None
    host: str | None
    pid: int | None
    step: int | None


class ConfiguredRun(RunRow):
    """A current run with its config."""

    config: dict[str, Any]


class ArmRow(BaseModel):
    """An arm of an experiment: its name and its overrides of the base config."""

    name: str
    overrides: dict[str, Any]


class ExperimentRecord(BaseModel):
    """An experiment with its arms and current runs: what ``lab show`` prints."""

    name: str
    status: str
    seed: int
    repeats: int
    config: dict[str, Any]
    created_at: Timestamp
    ended_at: Timestamp | None
    callback_errors: list[Any] | None
    tags: list[str]
    notes: str | None
    arms: list[ArmRow]
    runs: list[RunRow]
    superseded: int


class SummaryRow(BaseModel):
    """One current run and metric key: the metric's count, first and last step, last value,
    min and max (NaN left out of those two; null when every value was NaN)."""

    run_id: int
    run_key: str
    arm: str | None
    repeat: int
    stage: int
    status: str
    key: str
    count: int
    first_step: int
    last_step: int
    last_value: Number
    min_value: Number | None
    max_value: Number | None


class Envelope(BaseModel):
    """A series cut into buckets: per bucket the min and max of its values (NaN left out;
    null when every value was NaN) and its last value."""

    min: list[Number | None]
    max: list[Number | None]
    last: list[Number]


class Series(Envelope):
    """A run's series of one key, cut into buckets, with each bucket's first and last step."""

    run_id: int
    key: str
    points: int
    buckets: int
    step_min: list[int]
    step_max: list[int]


class Prediction(BaseModel):
    """One prediction row, with the name and step of its eval (step null: after training)."""

    eval_id: int
    eval: str
    step: int | None
    idx: int
    example_id: str | None
    input: str | None
    output: str | None
    target: str | None
    score: Number | None
    extras: dict[str, Any] | None


class PredictionPage(BaseModel):
    """One page of prediction rows, and the cursor of the next page (null on the last)."""

    predictions: list[Prediction]
    next: str | None


class EvalEntry(BaseModel):
    """An evaluation of a run: its name, step (null after training), metrics, breakdowns,
    tags, seconds, error and number of prediction rows."""

    eval_id: int
    name: str
    step: int | None
    metrics: dict[str, Any]
    breakdowns: dict[str, Any]
    tags: dict[str, Any]
    seconds: Number
    error: str | None
    predictions: int


class EvalRow(EvalEntry):
    """An evaluation of a run, with when it was recorded."""

    created_at: Timestamp


class CheckpointEntry(BaseModel):
    """A checkpoint manifest row: a save or a removal, with its step, path and metrics."""

    step: int
    path: str
    event: str
    metrics: dict[str, Any]
    reason: str | None
    created_at: Timestamp


class CheckpointRow(CheckpointEntry):
    """A checkpoint manifest row, with its id."""

    checkpoint_id: int


#: The answer of an Arrow IPC stream, as the document declares it.
ARROW_ANSWER = {
    "description": "An Arrow IPC stream",
    "content": {ARROW_STREAM: {"schema": {"type": "string", "format": "binary"}}},
}
#: Query parameters that are text looked up in the store.
Text = Annotated[str, fastapi.Query(pattern=NO_NUL)]


# -- experiments and runs ---------------------------------------------------------------------


@router.get("/experiments", response_class=LabJSON, response_model=list[ExperimentRow])
def list_experiments(
    request: fastapi.Request,
    status: str | None = None,
    tag: str | None = None,
    store: Store = StoreDep,
) -> Any:
    """Every experiment with its status and run counts, newest first (`Store.list_experiments`),
    those of one `status` or carrying one `tag` if asked; for a token limited to an
    experiment, that one."""
    readable = access(request).readable
    rows = [r for r in store.list_experiments() if readable(r["name"])]
    if status is not None:
        rows = [r for r in rows if r["status"] == status]
    if tag is not None:
        rows = [r for r in rows if tag in r["tags"]]
    return LabJSON(rows)


@router.get(
    "/experiments/{experiment:text}/runs",
    response_class=LabJSON,
    response_model=list[ConfiguredRun],
    responses=problems(400, 403, 404),
)
def list_runs(
    request: fastapi.Request,
    name: Annotated[
        str, fastapi.Path(alias="experiment", pattern=NO_NUL, description=NAME_IN_PATH)
    ],
    status: str | None = None,
    store: Store = StoreDep,
) -> Any:
    """An experiment's current runs with their config and last metric values, filtered by
    ``status=`` and by config fields: ``config.lr=0.01``, ``config.model.width=64`` (dotted
    into nested configs; the value is read as JSON when it parses, else as a string); any
    other parameter is refused (400)."""
    wanted: list[tuple[list[str], Any]] = []
    status = None
    for field, text in request.query_params.multi_items():
        if field == "status":
            status = text
        elif field.startswith("config.") and len(field) > len("config."):
            wanted.append((field[len("config.") :].split("."), _json_or_text(text)))
        else:
            raise Rejected(
                400,
                f"unknown filter {field!r}: filter by status= or by config.<field>=<value>",
                field,
            )
    exp = store.get_experiment(name)
    with connect(store.engine) as conn:
        configs = dashboard_reads.run_configs(conn, name)
    runs = []
    for run in exp["runs"]:
        config = configs.get(run["run_id"]) or {}
        if status is not None and run["status"] != status:
            continue
        if all(_config_field(config, path) == value for path, value in wanted):
            runs.append({**run, "config": config})
    return LabJSON(runs)


_MISSING = object()


def _config_field(config: Any, path: list[str]) -> Any:
    for part in path:
        if not isinstance(config, dict) or part not in config:
            return _MISSING
        config = config[part]
    return config


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


@router.get(
    "/experiments/{name:text}/summaries",
    response_class=LabJSON,
    response_model=list[SummaryRow],
    responses=problems(403, 404),
)
def summaries(name: NamePath, key: Text | None = None, store: Store = StoreDep) -> Any:
    """One row per current run and metric key (of one `key` if asked): the run's experiment,
    arm, repeat, key and status, and the metric's count, first and last step, last value,
    min and max; what ``lab.inspect``'s ``final_metrics`` view holds, without a scan of
    the metrics."""
    with connect(store.engine) as conn:
        experiment_id = store.experiment_id(conn, name)
        rows = served_reads.summary_rows(conn, experiment_id, key)
    gone = store.crashed_now().runs  # a run whose process is gone reads as crashed
    for row in rows:
        if row["last_value"] is None:  # SQLite keeps NaN as NULL
            row["last_value"] = math.nan
        if row["run_id"] in gone and row["status"] == "running":
            row["status"] = "crashed"
    return LabJSON(rows)


# -- one run's rows ---------------------------------------------------------------------------


def _check_run(conn: sa.Connection, run_id: int) -> None:
    if not served_reads.has_run(conn, run_id):
        raise NoRun(f"no run with id {run_id} in the store; list them: GET /experiments/NAME/runs")


@router.get(
    "/runs/{run_id}/series",
    response_class=LabJSON,
    response_model=Series,
    responses=problems(400, 403, 404),
)
def series(
    run_id: RunPath,
    key: Text,
    buckets: int | None = ranged(None, 1, MAX_BUCKETS),
    store: Store = StoreDep,
) -> Any:
    """One run's series of `key`, cut into at most `buckets` equal ranges of steps, each
    with its first and last step, the min and max of its values (NaN left out, null if
    every value was NaN) and its last value; every point as its own bucket when there are
    no more points than buckets (or `buckets` is left out). Empty ranges are left out.

    Computed in the database from the series' blocks of 32 steps and the points at each
    bucket's edges (`lab.store.blocks`), so a series of a million points answers in a few
    tens of milliseconds with what a plot needs: its envelope.
    """
    if buckets is not None and not 1 <= buckets <= MAX_BUCKETS:
        raise Rejected(400, f"buckets={buckets}: give 1 to {MAX_BUCKETS} buckets", "buckets")
    with connect(store.engine) as conn:
        _check_run(conn, run_id)
        span = served_reads.series_span(conn, run_id, key)
        if span is None:
            known = served_reads.metric_keys(conn, run_id)
            raise Rejected(
                404,
                f"run {run_id} has no metric {key!r}; it has: {', '.join(known) or 'none'}",
                "key",
            )
    lo, hi, count = span
    if buckets is not None and count > buckets:
        cut = downsample(store.engine, run_id, key, lo, hi, buckets)
    else:
        points = store.metric_values(run_id, key)
        finite = [None if math.isnan(v) else v for _, v in points]
        cut = [(s, s, f, f, v) for (s, v), f in zip(points, finite, strict=True)]
    return LabJSON(
        {
            "run_id": run_id,
            "key": key,
            "points": count,
            "buckets": len(cut),
            "step_min": [r[0] for r in cut],
            "step_max": [r[1] for r in cut],
            "min": [r[2] for r in cut],
            "max": [r[3] for r in cut],
            "last": [r[4] for r in cut],
        }
    )


def bucket_bounds(lo: int, hi: int, n: int) -> list[tuple[int, int, int]]:
    """The `n` buckets of steps `lo`..`hi`: (i, first step, step after the last). Bucket i
    holds the steps s with ``(s - lo) * n // (hi - lo + 1) == i``: equal ranges of steps."""
    width = hi - lo + 1
    return [(i, lo + -(-i * width // n), lo + -(-(i + 1) * width // n)) for i in range(n)]


def downsample(
    engine: sa.Engine, run_id: int, key: str, lo: int, hi: int, n: int
) -> list[tuple[int, int, float | None, float | None, float]]:
    """Per non-empty bucket of a series: (first step, last step, min, max, last value),
    min and max without NaN (None when every value was NaN).

    SQLite: from the metric blocks and the points at the buckets' edges
    (`lab.store.blocks.cut_on`). PostgreSQL scans each bucket's range of the index in a
    LATERAL subquery (its blocks, read the same way, measured slower: each LATERAL
    subquery costs more there than the rows it saves).
    """
    if engine.dialect.name != "sqlite":
        args = {"run_id": run_id, "key": key, "lo": lo, "width": hi - lo + 1, "n": n}
        with connect(engine) as conn:
            rows = conn.execute(sa.text(_PG_BUCKETS), args).all()
        return [(a, b, c, d, e) for a, b, c, d, e in rows]
    bounds = bucket_bounds(lo, hi, n)
    cells = blocks.cut_on(engine, key, [run_id], bounds, last=True)
    return [
        (c[0], c[1], c[2], c[3], cast(float, c[6]))  # the last value: asked for (last=True)
        for c in (cells.get((run_id, i)) for i, _, _ in bounds)
        if c is not None
    ]


# PostgreSQL: each bucket is one index range scan (a LATERAL subquery per bucket number),
# so no hash or sort of the points; NaN, which it orders above every number, is filtered
# out of min and max. The last value is looked up by the bucket's last step.
_PG_BUCKETS = """
WITH b AS (
  SELECT b.i, s.step_min, s.step_max, s.lo_value, s.hi_value
  FROM generate_series(0, :n - 1) AS b(i), LATERAL (
    SELECT min(m.step) AS step_min, max(m.step) AS step_max,
           min(m.value) FILTER (WHERE m.value <> 'NaN') AS lo_value,
           max(m.value) FILTER (WHERE m.value <> 'NaN') AS hi_value
    FROM metrics m
    WHERE m.run_id = :run_id AND m."key" = :key
      AND m.step >= :lo + (b.i * :width + :n - 1) / :n
      AND m.step < :lo + ((b.i + 1) * :width + :n - 1) / :n
  ) s
  WHERE s.step_min IS NOT NULL
)
SELECT b.step_min, b.step_max, b.lo_value, b.hi_value, m.value
FROM b JOIN metrics m ON m.run_id = :run_id AND m."key" = :key AND m.step = b.step_max
ORDER BY b.i
"""


@router.get(
    "/runs/{run_id}/predictions",
    response_class=LabJSON,
    response_model=PredictionPage,
    responses=problems(400, 403, 404),
)
def predictions(
    run_id: RunPath,
    eval: Text | None = None,  # the query parameter's name
    step: str | None = fastapi.Query(None, json_schema_extra={"pattern": STEP.pattern}),
    limit: int = ranged(1000, 1, MAX_PAGE),
    after: str | None = fastapi.Query(None, json_schema_extra={"pattern": CURSOR.pattern}),
    store: Store = StoreDep,
) -> Any:
    """One page of a run's prediction rows, in (eval, idx) order, of one eval name and step
    if asked (``step=final``: the evaluation after training). Each row names its eval,
    step and idx; ``next`` is the cursor of the next page (pass it as `after`), null on
    the last page, so paging reads every row exactly once, however the run grows."""
    if not 1 <= limit <= MAX_PAGE:
        raise Rejected(400, f"limit={limit}: a page holds 1 to {MAX_PAGE} rows", "limit")
    cursor = _cursor(after)
    with connect(store.engine) as conn:
        _check_run(conn, run_id)
        rows = served_reads.prediction_rows(
            conn, run_id, eval=eval, step=_step(step), after=cursor, limit=limit + 1
        )
    more = len(rows) > limit
    rows = rows[:limit]
    last = rows[-1] if rows else None
    following = f"{last['eval_id']}.{last['idx']}" if more and last else None
    return LabJSON({"predictions": rows, "next": following})


def _cursor(after: str | None) -> tuple[int, int] | None:
    if after is None:
        return None
    found = CURSOR.fullmatch(after)
    if found is None:
        raise Rejected(
            400,
            f"after={after!r} is not a page cursor; pass the 'next' of the page before",
            "after",
        )
    return int(found[1]), int(found[2])


def _step(step: str | None) -> int | Literal["final"] | None:
    if step is None:
        return None
    if step == "final":
        return "final"
    if STEP.fullmatch(step) is None:
        raise Rejected(
            400,
            f"step={step!r}: give a step number, or 'final' for the eval after training",
            "step",
        )
    return int(step)


@router.get(
    "/runs/{run_id}/evals",
    response_class=LabJSON,
    response_model=list[EvalRow],
    responses=problems(403, 404),
)
def evals(run_id: RunPath, store: Store = StoreDep) -> Any:
    """A run's evaluations in the order they ran: name, step (null after training),
    metrics, breakdowns, tags, seconds, error and the number of prediction rows."""
    with connect(store.engine) as conn:
        _check_run(conn, run_id)
        return LabJSON(served_reads.eval_rows(conn, run_id))


@router.get(
    "/runs/{run_id}/checkpoints",
    response_class=LabJSON,
    response_model=list[CheckpointRow],
    responses=problems(403, 404),
)
def checkpoints(run_id: RunPath, store: Store = StoreDep) -> Any:
    """A run's checkpoint manifest rows in the order they were written: saves and removals,
    with step, path, metrics and reason."""
    with connect(store.engine) as conn:
        _check_run(conn, run_id)
        return LabJSON(served_reads.checkpoint_rows(conn, run_id))


# -- whole tables -----------------------------------------------------------------------------


@router.get(
    "/tables/{table}",
    response_class=Response,
    responses={200: ARROW_ANSWER, **problems(403, 404)},
)
def table(
    request: fastapi.Request,
    table: str = fastapi.Path(json_schema_extra={"enum": list(SERVED_TABLES)}),
    experiment: Text | None = None,
    store: Store = StoreDep,
) -> Any:
    """Every row of one store table (of one `experiment` if asked, and always of the one
    a limited token reads) as an Arrow IPC stream: what ``lab.inspect.connect("http://...")``
    loads to build its views. JSON columns are their text, NaN is NaN on every backend;
    token hashes are never served."""
    only = access(request).only
    if only is not None and experiment is None:
        try:
            data = read_table(store, table, only)
        except NoExperiment:  # not recorded yet: nothing of it to read
            data = arrow.table_schema(table).empty_table()
    else:
        data = read_table(store, table, experiment)
    return Response(to_ipc(data), media_type=ARROW_STREAM)


@router.get(
    "/experiments/{name:text}/export",
    response_class=Response,
    responses={
        200: {
            "description": "The table as an Arrow IPC stream, or as a Parquet file",
            "content": {
                ARROW_STREAM: {"schema": {"type": "string", "format": "binary"}},
                PARQUET: {"schema": {"type": "string", "format": "binary"}},
            },
        },
        **problems(400, 403, 404),
    },
)
def export(
    name: NamePath,
    format: str = one_of("arrow", "arrow", "parquet"),
    table: str = one_of("metrics", *SERVED_TABLES),
    store: Store = StoreDep,
) -> Any:
    """One table of an experiment's rows (the tables ``lab export`` writes; `table`
    defaults to ``metrics``) as an Arrow IPC stream (``format=arrow``) or a Parquet file
    (``format=parquet``), superseded runs left out, NaN kept."""
    if format not in ("arrow", "parquet"):
        raise Rejected(400, f"format={format!r}: use arrow or parquet", "format")
    data = read_table(store, table, name, current=True)
    if format == "arrow":
        return Response(to_ipc(data), media_type=ARROW_STREAM)
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(data, sink)
    headers = {"Content-Disposition": f'attachment; filename="{table}.parquet"'}
    return Response(sink.getvalue(), media_type=PARQUET, headers=headers)


def to_ipc(data: pa.Table) -> bytes:
    """`data` as the bytes of one Arrow IPC stream."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, data.schema) as writer:
        writer.write_table(data)
    return sink.getvalue().to_pybytes()


def read_table(
    store: Store, table: str, experiment: str | None = None, *, current: bool = False
) -> pa.Table:
    """Store table `table` as Arrow (`lab.store.arrow.read_table`); a table the server
    does not serve is answered 404."""
    if table not in SERVED_TABLES:
        raise Rejected(
            404, f"no table {table!r} to read; the tables: {', '.join(SERVED_TABLES)}", "table"
        )
    return arrow.read_table(store, table, experiment, current=current)


class TrialRow(BaseModel):
    """A sampled arm as its sampler knows it: its ask order, arm, parameters, when it was
    asked and told, its value (null until told, and for a failed one) and state, and for
    one whose runs were pruned, the step and value each was pruned at."""

    number: int
    arm: str
    params: dict[str, Any]
    asked_after: int
    told: int | None
    value: Number | None
    state: str
    intermediate: dict[str, Number]


class Dropped(BaseModel):
    """An arm a race dropped: after which round, by which test, with the post-hoc statistic
    against the best arm, the corrected p-value and alpha."""

    arm: str
    round: int
    test: str
    statistic: Number
    p_value: Number
    alpha: Number
    best: str


class EliminationRow(Dropped):
    """An arm a race dropped (`Dropped`), with when the store recorded it."""

    created_at: Timestamp


@router.get(
    "/experiments/{name:text}/trials",
    response_class=LabJSON,
    response_model=list[TrialRow],
    responses=problems(403, 404),
)
def trials(name: NamePath, store: Store = StoreDep) -> Any:
    """An experiment's sampled arms by number (`Store.trials`): what rebuilds its sampler."""
    return LabJSON(store.trials(name))


@router.get(
    "/experiments/{name:text}/eliminations",
    response_class=LabJSON,
    response_model=list[EliminationRow],
    responses=problems(403, 404),
)
def eliminations(name: NamePath, store: Store = StoreDep) -> Any:
    """The arms an experiment's race dropped, by round (`Store.eliminations`)."""
    return LabJSON(store.eliminations(name))


#: One point of a metric as JSON: ``[step, value]`` (a pair as an array: OpenAPI 3.1 has no
#: tuple the schema checkers read alike, so a two-item array of numbers).
Point = Annotated[list[Number], pydantic.Field(min_length=2, max_length=2)]


@router.get(
    "/experiments/{name:text}/metric_points",
    response_class=LabJSON,
    response_model=dict[str, list[Point]],
    responses=problems(403, 404),
)
def metric_points(name: NamePath, metric: Text, store: Store = StoreDep) -> Any:
    """Each current run's ``[step, value]`` points of one `metric`, in step order, by run
    key (`Store.metric_points`): what a pruning rule compares a run with."""
    return LabJSON(store.metric_points(name, metric))


@router.get(
    "/experiments/{name:text}",
    response_class=LabJSON,
    response_model=ExperimentRecord,
    responses=problems(403, 404),
)
def get_experiment(name: NamePath, store: Store = StoreDep) -> Any:
    """One experiment, its arms and runs with their last metric values: what ``lab show``
    prints (`Store.get_experiment`). Registered last: a name may hold ``/`` (sent as
    ``%2F``), so the routes under an experiment must be tried first."""
    return LabJSON(store.get_experiment(name))
