"""The dashboard's read API: the JSON the web UI (`lab.server.ui`) draws, under
``/api/v1/dashboard``, behind a read token like the rest of the read API.

Each endpoint answers one page of the UI in one request, so a page costs one round trip:
the experiments list (paged in SQL), an experiment (its arm summary, runs and chains), its
learning curves (cut into buckets from the metric blocks: min, max, mean and last value
per run and bucket, then the mean and 95% t interval across repeats per arm), one run (metrics,
evals, checkpoints, media), one of its images, and the paired disagreements and per-slice
breakdowns of an eval.

The analysis numbers are `lab.inspect`'s own: the summary, the disagreements and the
breakdown are computed by `lab.inspect.summary`, `lab.inspect.disagreements` and
`lab.inspect.breakdown` on a DuckDB connection that attaches the store read-only, opened
once per app (each request reads through its own cursor of it). JSON is the read API's
(`LabJSON`): NaN and ±inf as strings, timestamps as ISO 8601 (naive UTC); a rejection is
``{"detail": "<one line>", "field": ...}``.
"""

from __future__ import annotations

import functools
import json
import math
import threading
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import fastapi
import numpy as np
import sqlalchemy as sa
from fastapi.responses import Response
from pydantic import BaseModel

from lab._ranking import COUNTED_STATUSES, Mode, choose, counted, declaration, rank_arms
from lab._stats import t_ppf
from lab.analysis import CONFIDENCE
from lab.errors import NoRun
from lab.server.openapi import (
    EXACT,
    NamePath,
    Number,
    RunPath,
    Timestamp,
    one_of,
    problems,
    ranged,
)
from lab.server.owners import access
from lab.server.read import (
    ArmRow,
    CheckpointEntry,
    Envelope,
    EvalEntry,
    LabJSON,
    RunFacts,
    StoreDep,
    Text,
    bucket_bounds,
)
from lab.server.rejected import Rejected
from lab.store import Store, blocks
from lab.store.engine import connect
from lab.store.schema import (
    BLOCK_STEPS,
    SqlArm,
    SqlCheckpoint,
    SqlEval,
    SqlExperiment,
    SqlGroup,
    SqlHistogram,
    SqlImage,
    SqlPrediction,
    SqlRun,
    SqlSummary,
)

router = fastapi.APIRouter(tags=["dashboard"])

#: The most experiments one page of the list holds.
MAX_EXPERIMENTS = 500
#: The most buckets a metric's curves are cut into (per run: the answer grows with both).
MAX_CURVE_BUCKETS = 10_000
#: The most disagreement rows one answer holds.
MAX_DISAGREEMENTS = 10_000
#: The statuses of the runs an arm's curves are drawn from: those `lab.inspect` counts, and
#: the running ones, so a live experiment's curves grow as it runs.
CURVE_STATUSES = (*COUNTED_STATUSES, "running")


# -- answers ----------------------------------------------------------------------------------
class ExperimentLine(BaseModel):
    """An experiment in the list: status, runs done and planned, the best arm by the
    ranking metric, start, end and duration."""

    name: str
    status: str
    runs_done: int
    runs_total: int
    best_arm: str | None
    metric: str | None
    mode: Mode
    started_at: Timestamp
    ended_at: Timestamp | None
    duration_s: Number | None


class ExperimentsPage(BaseModel):
    """One page of the experiments list, and how many experiments match in all."""

    total: int
    offset: int
    limit: int
    rows: list[ExperimentLine]


class RunLine(RunFacts):
    """A run in an experiment's runs table: with its config, final metrics and duration."""

    config: dict[str, Any]
    final: dict[str, Any]
    duration_s: Number | None


class RunsTable(BaseModel):
    """An experiment's runs table."""

    runs: list[RunLine]


class ArmCurve(BaseModel):
    """An arm's curve: per bucket its runs reached, the last step logged there, how many
    runs had a value, their mean and its interval, and the lowest and highest point."""

    arm: str | None
    step: list[int]
    n: list[int]
    mean: list[Number | None]
    ci_low: list[Number | None]
    ci_high: list[Number | None]
    min: list[Number | None]
    max: list[Number | None]


class RunCurve(Envelope):
    """A run's own curve: per bucket its last step there, min, max and last value."""

    run_id: int
    run_key: str
    arm: str | None
    step: list[int]


class Curves(BaseModel):
    """The learning curves of one metric: per arm, and per run when asked."""

    metric: str
    buckets: int
    arms: list[ArmCurve]
    runs: list[RunCurve]


class Rows(BaseModel):
    """Rows of one of `lab.inspect`'s analyses, with its columns as they are."""

    rows: list[dict[str, Any]]


class Chain(BaseModel):
    """A continual chain: its group, its arm and its runs, stage by stage."""

    group: str
    arm: str | None
    runs: list[int]


class ExperimentPage(BaseModel):
    """An experiment page's data: config, tags, notes and times, arms, metric keys and eval
    names, the arm summary of one metric, the runs table and the chains."""

    name: str
    status: str
    config: dict[str, Any]
    tags: list[str]
    notes: str | None
    started_at: Timestamp
    ended_at: Timestamp | None
    duration_s: Number | None
    repeats: int
    live: bool
    arms: list[ArmRow]
    metrics: list[str]
    metric: str | None
    mode: Mode
    evals: list[str]
    summary: list[dict[str, Any]]
    summary_error: str | None
    runs: list[RunLine]
    chains: list[Chain]


class MetricLine(BaseModel):
    """A summary of one of a run's metric series."""

    key: str
    count: int
    first_step: int
    last_step: int
    last: Number
    min: Number | None
    max: Number | None


class HistogramLine(BaseModel):
    """The newest histogram of one key: bin edges and counts, and the NaN and ±inf counts."""

    key: str
    step: int
    edges: list[Any]
    counts: list[Any]
    nan: int
    posinf: int
    neginf: int


class ImageLine(BaseModel):
    """An image of a run, and the URL of its PNG."""

    key: str
    step: int
    width: int
    height: int
    url: str


class RunPage(RunFacts):
    """A run page's data: the run, its metrics, evals, checkpoints, histograms and images."""

    experiment: str
    config: dict[str, Any]
    traceback: str | None
    callback_errors: list[Any]
    duration_s: Number | None
    parent_run_id: int | None
    live: bool
    metrics: list[MetricLine]
    evals: list[EvalEntry]
    checkpoints: list[CheckpointEntry]
    histograms: list[HistogramLine]
    images: list[ImageLine]


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return (end - start).total_seconds() if start is not None and end is not None else None


def _nan(value: float | None) -> float:
    """A metric value as read back: SQLite keeps NaN as NULL, and a metric is never
    missing."""
    return math.nan if value is None else value


def _ranking(config: Any, keys: set[str] | list[str]) -> tuple[str | None, Mode]:
    """The metric and mode an experiment's arms are ranked by when the request names none:
    the one it declares, else ``val/loss`` or ``loss`` (`lab._ranking.choose`)."""
    return choose(None, None, declaration(config), keys)


def _check_mode(mode: str | None) -> None:
    if mode is not None and mode not in ("min", "max"):
        raise Rejected(400, f"mode={mode!r}: use min (lower is better) or max", "mode")


def _gone(store: Store) -> dict[int, str]:
    """Runs whose process is gone, with why: the read-only store shows them as crashed, as
    ``lab show`` does (and never writes it)."""
    return {run_id: gone.why for run_id, gone in store.crashed_now().runs.items()}


# -- the experiments list ---------------------------------------------------------------------


@router.get(
    "/experiments",
    response_class=LabJSON,
    response_model=ExperimentsPage,
    responses=problems(400),
)
def experiments(
    request: fastapi.Request,
    q: Text = "",
    offset: int = ranged(0, 0, EXACT),
    limit: int = ranged(50, 1, MAX_EXPERIMENTS),
    store: Store = StoreDep,
) -> Any:
    """One page of experiments, newest first, those whose name holds `q` (any case) if
    asked (for a token limited to an experiment, that one): status, runs done and planned,
    the best arm by the ranking metric, start, end and duration. Paged in SQL, so a store
    of thousands of experiments answers as fast as one of ten."""
    if not 0 <= offset <= EXACT:
        raise Rejected(400, f"offset={offset}: give 0 to {EXACT}", "offset")
    if not 1 <= limit <= MAX_EXPERIMENTS:
        raise Rejected(400, f"limit={limit}: a page holds 1 to {MAX_EXPERIMENTS} rows", "limit")
    where = sa.true()
    if q:
        where = sa.func.lower(SqlExperiment.name).contains(q.lower(), autoescape=True)
    only = access(request).only
    if only is not None:
        where = sa.and_(where, SqlExperiment.name == only)
    current = SqlRun.superseded_at.is_(None)
    with connect(store.engine) as conn:
        total = conn.execute(sa.select(sa.func.count()).where(where)
                             .select_from(SqlExperiment)).scalar_one()  # fmt: skip
        page = conn.execute(
            sa.select(SqlExperiment.experiment_id, SqlExperiment.name, SqlExperiment.status,
                      SqlExperiment.repeats, SqlExperiment.config, SqlExperiment.created_at,
                      SqlExperiment.ended_at)
            .where(where).order_by(SqlExperiment.experiment_id.desc())
            .offset(offset).limit(limit)
        ).mappings().all()  # fmt: skip
        ids = [e["experiment_id"] for e in page]
        in_page = SqlRun.experiment_id.in_(ids)
        runs = conn.execute(
            sa.select(SqlRun.run_id, SqlRun.experiment_id, SqlRun.arm_id, SqlRun.stage,
                      SqlRun.status).where(in_page, current)
        ).all()  # fmt: skip
        arms = dict(conn.execute(
            sa.select(SqlArm.experiment_id, sa.func.count())
            .where(SqlArm.experiment_id.in_(ids)).group_by(SqlArm.experiment_id)
        ).all())  # fmt: skip
        keys: dict[int, set[str]] = {}
        for exp_id, key in conn.execute(
            sa.select(SqlRun.experiment_id, SqlSummary.key).distinct()
            .join(SqlSummary, SqlSummary.run_id == SqlRun.run_id).where(in_page, current)
        ):  # fmt: skip
            keys.setdefault(exp_id, set()).add(key)
        ranking = {e["experiment_id"]: _ranking(e["config"], keys.get(e["experiment_id"], set()))
                   for e in page}  # fmt: skip
        wanted = {metric for metric, _mode in ranking.values() if metric is not None}
        finals = {
            (run_id, key): _nan(value)
            for run_id, key, value in conn.execute(
                sa.select(SqlSummary.run_id, SqlSummary.key, SqlSummary.last_value)
                .join(SqlRun, SqlRun.run_id == SqlSummary.run_id)
                .where(in_page, current, SqlSummary.key.in_(wanted),
                       SqlRun.status.in_(COUNTED_STATUSES))
            )
        }  # fmt: skip
        arm_order = {arm_id: (exp_id, name) for arm_id, exp_id, name in conn.execute(
            sa.select(SqlArm.arm_id, SqlArm.experiment_id, SqlArm.name)
            .where(SqlArm.experiment_id.in_(ids)).order_by(SqlArm.arm_id)
        )}  # fmt: skip
    crashed = store.crashed_now()  # runs and experiments whose process is gone
    gone = crashed.runs
    per_exp: dict[int, list[Any]] = {}
    for run in runs:
        per_exp.setdefault(run.experiment_id, []).append(run)
    rows = []
    for e in page:
        exp_id = e["experiment_id"]
        mine = per_exp.get(exp_id, [])
        metric, mode = ranking[exp_id]
        best = _best_arm(mine, metric, mode, finals, arm_order) if metric else None
        done = sum(1 for r in mine if r.status != "running" or r.run_id in gone)
        rows.append({
            "name": e["name"], "runs_done": done,
            "status": "crashed" if exp_id in crashed.experiments else e["status"],
            "runs_total": max(len(mine), arms.get(exp_id, 0) * e["repeats"]),
            "best_arm": best, "metric": metric, "mode": mode,
            "started_at": e["created_at"], "ended_at": e["ended_at"],
            "duration_s": _seconds(e["created_at"], e["ended_at"]),
        })  # fmt: skip
    return LabJSON({"total": total, "offset": offset, "limit": limit, "rows": rows})


def _best_arm(
    runs: list[Any],
    metric: str,
    mode: Mode,
    finals: dict[tuple[int, str], float],
    arm_order: dict[int, tuple[int, str]],
) -> str | None:
    """The arm `lab.inspect.summary` marks best by `metric` (`lab._ranking`: the counted
    runs, their final values, the ranking); none when some counted run lacks the metric
    (the summary refuses to rank then) or no arm has a number."""
    keep = counted([(r.arm_id, r.stage, r.status) for r in runs])
    mine = [r for r, ok in zip(runs, keep, strict=True) if ok]
    if not mine:
        return None
    values: dict[int | None, list[float]] = {}
    for r in sorted(mine, key=lambda r: (r.arm_id is None, r.arm_id or 0)):  # arm order
        got = values.setdefault(r.arm_id, [])
        if (r.run_id, metric) in finals:
            got.append(finals[(r.run_id, metric)])
    lacking = any((r.run_id, metric) not in finals for r in mine)
    best = rank_arms(values, mode, lacking=lacking).best
    return arm_order[best][1] if best in arm_order else None


# -- one experiment ---------------------------------------------------------------------------


def _run_rows(store: Store, name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """An experiment (`Store.get_experiment`: crashed runs shown as crashed) and its current
    runs as the runs table shows them, with their configs."""
    exp = store.get_experiment(name)
    with connect(store.engine) as conn:
        configs = dict(conn.execute(
            sa.select(SqlRun.run_id, SqlRun.config)
            .join(SqlExperiment, SqlExperiment.experiment_id == SqlRun.experiment_id)
            .where(SqlExperiment.name == name, SqlRun.superseded_at.is_(None))
        ).all())  # fmt: skip
    runs = [
        {
            "run_id": r["run_id"], "run_key": r["run_key"], "arm": r["arm"],
            "repeat": r["repeat"], "stage": r["stage"], "seed": r["seed"],
            "status": r["status"], "config": configs.get(r["run_id"]) or {},
            "final": r["summary"], "started_at": r["started_at"], "ended_at": r["ended_at"],
            "duration_s": _seconds(r["started_at"], r["ended_at"]), "error": r["error"],
        }
        for r in exp["runs"]
    ]  # fmt: skip
    return exp, runs


@router.get(
    "/experiments/{name:text}/runs",
    response_class=LabJSON,
    response_model=RunsTable,
    responses=problems(403, 404),
)
def experiment_runs(name: NamePath, store: Store = StoreDep) -> Any:
    """An experiment's runs table: each current run's arm, repeat, stage, seed, status
    (crashed when its process is gone), config, final metrics, times and error. The UI
    polls it while the experiment is live."""
    return LabJSON({"runs": _run_rows(store, name)[1]})


_DUCK_LOCK = threading.Lock()


def analysis(request: fastapi.Request) -> Any:
    """A DuckDB cursor on the app's `lab.inspect` connection, for `lab.inspect`'s analysis
    functions. The connection attaches the store read-only and is opened once per app (its
    views cost tens of milliseconds to build); each request reads through a cursor of its
    own, since one DuckDB connection must not be used by two threads at once."""
    import lab.inspect

    state = request.app.state
    con = getattr(state, "inspect", None)
    if con is None:
        with _DUCK_LOCK:
            con = getattr(state, "inspect", None)
            if con is None:
                served: Store = state.store
                con = lab.inspect.connect(served.url, mode="attach")
                state.inspect = con
    return con.cursor()


AnalysisDep = fastapi.Depends(analysis)


def _relation_rows(relation: Any) -> list[dict[str, Any]]:
    return [dict(zip(relation.columns, row, strict=True)) for row in relation.fetchall()]


@router.get(
    "/experiments/{name:text}/curves",
    response_class=LabJSON,
    response_model=Curves,
    responses=problems(400, 403, 404),
)
def curves(
    name: NamePath,
    metric: Text,
    buckets: int = ranged(600, 1, MAX_CURVE_BUCKETS),
    runs: bool = False,
    store: Store = StoreDep,
) -> Any:
    """Learning curves of `metric`: the experiment's steps of it cut into `buckets` equal
    ranges (`bucket_bounds`), and per arm and bucket the mean across its runs of each run's
    mean there, with the 95% t interval across repeats (`n` runs had a value), and the
    lowest and highest point of any of its runs (NaN left out). With `runs`, each run's
    own min, max and last value per bucket too, every run of the experiment included.

    An arm's curves are drawn from the runs `lab.inspect` counts (completed and stopped, at
    the arm's last stage) and its running ones. Every run's buckets are cut on the server
    (`_cut`) from the metric blocks: wide ones from their envelopes and the points at
    their edges, narrow ones from the points packed in them, then the arms' numbers are
    taken over the cells in numpy. The answer is a few thousand numbers, never every
    point.
    """
    if not 1 <= buckets <= MAX_CURVE_BUCKETS:
        raise Rejected(400, f"buckets={buckets}: give 1 to {MAX_CURVE_BUCKETS} buckets", "buckets")
    gone = _gone(store)
    with connect(store.engine) as conn:
        experiment_id = store.experiment_id(conn, name)
        config = conn.execute(
            sa.select(SqlExperiment.config).where(SqlExperiment.experiment_id == experiment_id)
        ).scalar_one()
        members = conn.execute(
            sa.select(SqlRun.run_id, SqlRun.run_key, SqlRun.arm_id, SqlArm.name, SqlRun.repeat,
                      SqlRun.stage, SqlRun.status)
            .join(SqlArm, SqlArm.arm_id == SqlRun.arm_id, isouter=True)
            .where(SqlRun.experiment_id == experiment_id, SqlRun.superseded_at.is_(None))
            .order_by(SqlRun.arm_id, SqlRun.repeat, SqlRun.stage, SqlRun.run_id)
        ).all()  # fmt: skip
        ids = [r.run_id for r in members]
        lo, hi = conn.execute(
            sa.select(sa.func.min(SqlSummary.first_step), sa.func.max(SqlSummary.last_step))
            .where(SqlSummary.run_id.in_(ids), SqlSummary.key == metric)
        ).one()  # fmt: skip
        if lo is None:
            known = conn.execute(
                sa.select(SqlSummary.key).distinct().where(SqlSummary.run_id.in_(ids))
                .order_by(SqlSummary.key)
            ).scalars().all()  # fmt: skip
            raise Rejected(
                404,
                f"experiment {name!r} has no metric {metric!r}; it has: "
                f"{', '.join(known) or 'none'}",
                "metric",
            )
        bounds = bucket_bounds(lo, hi, buckets)
    cut = _cut(store.engine, ids, metric, bounds, last=runs)
    last_stage: dict[int | None, int] = {}
    for r in members:
        last_stage[r.arm_id] = max(last_stage.get(r.arm_id, r.stage), r.stage)
    arms: dict[int | None, tuple[str | None, list[int]]] = {}
    for r in members:
        status = "crashed" if r.run_id in gone else r.status
        if status in CURVE_STATUSES and r.stage == last_stage[r.arm_id]:
            arms.setdefault(r.arm_id, (r.name, []))[1].append(r.run_id)
    declared = declaration(config).bounds or {}
    answer_arms = [
        _arm_curve(arm, cut, run_ids, declared.get(metric)) for arm, run_ids in arms.values()
    ]
    answer_runs = []
    if runs:
        starts = np.searchsorted(cut.run_id, [r.run_id for r in members], side="left")
        stops = np.searchsorted(cut.run_id, [r.run_id for r in members], side="right")
        for r, a, b in zip(members, starts.tolist(), stops.tolist(), strict=True):
            counted = cut.counted[a:b]
            answer_runs.append({
                "run_id": r.run_id, "run_key": r.run_key, "arm": r.name,
                "step": cut.step[a:b].tolist(),
                "min": _listed(cut.low[a:b], counted), "max": _listed(cut.high[a:b], counted),
                "last": cut.last[a:b].tolist(),
            })  # fmt: skip
    return LabJSON({"metric": metric, "buckets": buckets, "arms": answer_arms,
                    "runs": answer_runs})  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _t(df: int) -> float:
    return t_ppf(0.5 + CONFIDENCE / 2.0, df)


def _arm_curve(
    arm: str | None, cut: _Cells, run_ids: list[int], bounds: tuple[float, float] | None
) -> dict[str, Any]:
    """One arm's curve from its runs' cells: per bucket that any of its runs reached, the
    last step any of them logged there, the mean of the runs' means with
    `lab._stats.spread`'s t interval (sample std, the t quantile looked up once per df;
    clipped to the metric's declared `bounds`), and the envelope of their points;
    vectorized over the cells (an arm of 10 runs at 1,000 buckets is 10,000 of them), each
    bucket's sums taken in run order."""
    mine = np.isin(cut.run_id, run_ids)
    b = cut.i[mine]
    reached = np.unique(b)
    size = int(reached[-1]) + 1 if len(reached) else 0
    has = cut.counted[mine]
    means = np.where(has, cut.mean[mine], 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):  # inf - inf is NaN, as in spread
        n = np.bincount(b, weights=has, minlength=size)
        mean = np.bincount(b, weights=means, minlength=size) / n
        spread = np.where(has, means - mean[b], 0.0)
        std = np.sqrt(np.bincount(b, weights=spread * spread, minlength=size) / (n - 1))
    lows, highs = np.full(size, np.inf), np.full(size, -np.inf)
    np.minimum.at(lows, b[has], cut.low[mine][has])
    np.maximum.at(highs, b[has], cut.high[mine][has])
    points = np.zeros(size, dtype=bool)
    points[b[has]] = True
    steps = np.full(size, -1, dtype=np.int64)
    np.maximum.at(steps, b, cut.step[mine])
    n, mean, std, lows, highs, points, steps = (
        x[reached] for x in (n, mean, std, lows, highs, points, steps)
    )
    n = n.astype(np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        quantile = np.array([_t(int(k) - 1) if k >= 2 else math.nan for k in n])
        half = quantile * std / np.sqrt(n)
    low, high = mean - half, mean + half
    if bounds is not None:  # NaN stays NaN, as in `lab._stats.clip`
        low = np.where(np.isnan(low), low, np.clip(low, *bounds))
        high = np.where(np.isnan(high), high, np.clip(high, *bounds))
    return {
        "arm": arm,
        "step": steps.tolist(),
        "n": n.tolist(),
        "mean": _listed(mean, n >= 1),
        "ci_low": _listed(low, n >= 2),
        "ci_high": _listed(high, n >= 2),
        "min": _listed(lows, points),
        "max": _listed(highs, points),
    }


def _listed(values: Any, known: Any) -> list[float | None]:
    """An array as a list of floats, None where it is not `known`."""
    return [v if k else None for v, k in zip(values.tolist(), known.tolist(), strict=True)]


class _Cells:
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
    def of(cls, columns: blocks.Columns | None, rest: list[tuple[Any, ...]], last: bool) -> _Cells:
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


def _cut(
    engine: sa.Engine,
    run_ids: list[int],
    key: str,
    bounds: list[tuple[int, int, int]],
    *,
    last: bool,
) -> _Cells:
    """Per run and non-empty bucket of `key` (`bounds`, from `bucket_bounds`): min, max
    and mean without NaN, the last value as logged (with `last`), as `_Cells`.

    Buckets narrower than two metric blocks, and every bucket on PostgreSQL (whose other
    cut reads each point), are cut from the points packed in the blocks
    (`lab.store.blocks.packed_columns`: a row per 32 points, cut in numpy). Wider ones on
    SQLite are cut from the blocks' envelopes and the points at their edges
    (`lab.store.blocks.cut_on`). A run whose blocks do not add up to its summary is cut
    from its points (`_cut_by_points`): the same answer, read slower."""
    if not run_ids:
        return _Cells([])
    sqlite = engine.dialect.name == "sqlite"
    if sqlite and any(hi - lo >= 2 * BLOCK_STEPS for _, lo, hi in bounds):
        cells = blocks.cut_on(engine, key, run_ids, bounds, last=last)
        return _Cells([
            (run_id, i, c[2], c[3], c[4] / c[5] if c[5] else None, c[1], c[6])
            for (run_id, i), c in cells.items()
        ])  # fmt: skip
    with connect(engine) as conn:
        columns, rest = blocks.packed_columns(conn, key, run_ids, bounds)
    slow = []
    if rest:
        per_run = _cut_by_points(engine, rest, key, bounds, last=last)
        slow = [(run_id, i, *c) for run_id, per in per_run.items() for i, c in per.items()]
    return _Cells.of(columns, slow, last)


def _cut_by_points(
    engine: sa.Engine,
    run_ids: list[int],
    key: str,
    bounds: list[tuple[int, int, int]],
    *,
    last: bool,
) -> dict[int, dict[int, tuple[Any, ...]]]:
    """`_cut` from every point of the runs: one grouped pass (`_cut_points`), shared out
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


# -- predictions: disagreements and breakdowns ------------------------------------------------


def _check_eval(conn: sa.Connection, experiment_id: int, name: str, eval: str) -> None:
    known = conn.execute(
        sa.select(SqlEval.name).distinct().join(SqlRun, SqlRun.run_id == SqlEval.run_id)
        .where(SqlRun.experiment_id == experiment_id, SqlRun.superseded_at.is_(None))
        .order_by(SqlEval.name)
    ).scalars().all()  # fmt: skip
    if eval not in known:
        raise Rejected(
            404, f"experiment {name!r} has no eval {eval!r}; it has: {', '.join(known) or 'none'}",
            "eval",
        )  # fmt: skip


@router.get(
    "/experiments/{name:text}/disagreements",
    response_class=LabJSON,
    response_model=Rows,
    responses=problems(400, 403, 404),
)
def disagreements(
    name: NamePath,
    eval: Text,
    arm_a: Text,
    arm_b: Text,
    limit: int = ranged(20, 1, MAX_DISAGREEMENTS),
    store: Store = StoreDep,
    duck: Any = AnalysisDep,
) -> Any:
    """The examples of eval `eval` on which arms `arm_a` and `arm_b` differ most:
    `lab.inspect.disagreements`, its columns and rows as they are."""
    import lab.inspect

    if not 1 <= limit <= MAX_DISAGREEMENTS:
        raise Rejected(400, f"limit={limit}: give 1 to {MAX_DISAGREEMENTS} rows", "limit")
    with connect(store.engine) as conn:
        experiment_id = store.experiment_id(conn, name)
        arms = conn.execute(
            sa.select(SqlArm.name).where(SqlArm.experiment_id == experiment_id)
            .order_by(SqlArm.arm_id)
        ).scalars().all()  # fmt: skip
        for field, arm in (("arm_a", arm_a), ("arm_b", arm_b)):
            if arm not in arms:
                raise Rejected(404, f"experiment {name!r} has no arm {arm!r}; arms: "
                                    f"{', '.join(arms) or 'none'}", field)  # fmt: skip
        _check_eval(conn, experiment_id, name, eval)
    rows = _relation_rows(lab.inspect.disagreements(duck, name, eval, arm_a, arm_b, limit))
    return LabJSON({"rows": rows})


@router.get(
    "/experiments/{name:text}/breakdown",
    response_class=LabJSON,
    response_model=Rows,
    responses=problems(403, 404),
)
def breakdown(name: NamePath, eval: Text, store: Store = StoreDep, duck: Any = AnalysisDep) -> Any:
    """Per arm, slice and metric of eval `eval`'s breakdowns, the mean across repeats and
    its 95% interval: `lab.inspect.breakdown`, its columns and rows as they are."""
    import lab.inspect

    with connect(store.engine) as conn:
        _check_eval(conn, store.experiment_id(conn, name), name, eval)
    return LabJSON({"rows": _relation_rows(lab.inspect.breakdown(duck, name, eval))})


@router.get(
    "/experiments/{name:text}",
    response_class=LabJSON,
    response_model=ExperimentPage,
    responses=problems(400, 403, 404),
)
def experiment(
    name: NamePath,
    metric: Text | None = None,
    mode: str | None = one_of(None, "min", "max"),
    store: Store = StoreDep,
    duck: Any = AnalysisDep,
) -> Any:
    """An experiment page's data in one answer: its config, tags, notes and times, arms,
    metric keys and eval names, the arm summary of `metric` (`lab.inspect.summary`'s
    numbers; the ranking metric by default), the runs table and the chains. Registered
    last: a name may hold ``/`` (sent as ``%2F``), so the routes under an experiment are
    tried first."""
    import lab.inspect

    _check_mode(mode)
    exp, runs = _run_rows(store, name)
    ids = [r["run_id"] for r in runs]
    with connect(store.engine) as conn:
        keys = conn.execute(
            sa.select(SqlSummary.key).distinct().where(SqlSummary.run_id.in_(ids))
            .order_by(SqlSummary.key)
        ).scalars().all()  # fmt: skip
        evals = conn.execute(
            sa.select(SqlEval.name).distinct().where(SqlEval.run_id.in_(ids))
            .order_by(SqlEval.name)
        ).scalars().all()  # fmt: skip
        chained = conn.execute(
            sa.select(SqlGroup.name, SqlArm.name, SqlRun.run_id)
            .join(SqlRun, SqlRun.group_id == SqlGroup.group_id)
            .join(SqlArm, SqlArm.arm_id == SqlGroup.arm_id, isouter=True)
            .where(SqlGroup.kind == "chain", SqlRun.run_id.in_(ids))
            .order_by(SqlGroup.group_id, SqlRun.stage, SqlRun.run_id)
        ).all()  # fmt: skip
    if metric is not None and metric not in keys:
        raise Rejected(
            404, f"experiment {name!r} has no metric {metric!r}; it has: "
                 f"{', '.join(keys) or 'none'}", "metric",
        )  # fmt: skip
    wanted: Mode | None = mode  # type: ignore[assignment]  # checked above
    chosen, chosen_mode = choose(metric, wanted, declaration(exp["config"]), keys)
    chosen = chosen or (keys[0] if keys else None)
    summary: list[dict[str, Any]] = []
    why = None
    if chosen is not None:
        from lab.errors import ConfigError

        try:
            summary = _relation_rows(lab.inspect.summary(duck, name, chosen, chosen_mode))
        except ConfigError as exc:  # nothing finished yet, or runs lack the metric
            why = str(exc)
    chains: list[dict[str, Any]] = []
    for group, arm, run_id in chained:
        if not chains or chains[-1]["group"] != group:
            chains.append({"group": group, "arm": arm, "runs": []})
        chains[-1]["runs"].append(run_id)
    last_end = exp["ended_at"]
    return LabJSON({
        "name": exp["name"], "status": exp["status"], "config": exp["config"],
        "tags": exp["tags"], "notes": exp["notes"], "started_at": exp["created_at"],
        "ended_at": last_end, "duration_s": _seconds(exp["created_at"], last_end),
        "repeats": exp["repeats"], "live": any(r["status"] == "running" for r in runs),
        "arms": [{"name": a["name"], "overrides": a["overrides"]} for a in exp["arms"]],
        "metrics": keys, "metric": chosen, "mode": chosen_mode, "evals": evals,
        "summary": summary, "summary_error": why, "runs": runs, "chains": chains,
    })  # fmt: skip


# -- one run ----------------------------------------------------------------------------------


def _run(conn: sa.Connection, run_id: int) -> Any:
    found = conn.execute(
        sa.select(*SqlRun.__table__.columns, SqlExperiment.name.label("experiment"),
                  SqlArm.name.label("arm"))
        .join(SqlExperiment, SqlExperiment.experiment_id == SqlRun.experiment_id)
        .join(SqlArm, SqlArm.arm_id == SqlRun.arm_id, isouter=True)
        .where(SqlRun.run_id == run_id)
    ).mappings().first()  # fmt: skip
    if found is None:
        raise NoRun(f"no run with id {run_id} in the store; list them: GET "
                    "/api/v1/dashboard/experiments/NAME/runs")  # fmt: skip
    return found


@router.get(
    "/runs/{run_id}", response_class=LabJSON, response_model=RunPage, responses=problems(403, 404)
)
def run(run_id: RunPath, store: Store = StoreDep) -> Any:
    """A run page's data in one answer: the run (config, status, error and traceback,
    callback errors, times, its chain's parent), a summary of each metric series, its
    evals with their prediction counts, its checkpoint manifest (saves and removals, with
    the reasons), the newest histogram of each key, and its images with the URL of each
    (`image`). A run whose process is gone shows as crashed."""
    with connect(store.engine) as conn:
        r = _run(conn, run_id)
        metrics = conn.execute(
            sa.select(SqlSummary.key, SqlSummary.count, SqlSummary.first_step,
                      SqlSummary.last_step, SqlSummary.last_value.label("last"),
                      SqlSummary.min_value.label("min"), SqlSummary.max_value.label("max"))
            .where(SqlSummary.run_id == run_id).order_by(SqlSummary.key)
        ).mappings().all()  # fmt: skip
        counts = (
            sa.select(SqlPrediction.eval_id, sa.func.count().label("n"))
            .join(SqlEval, SqlEval.eval_id == SqlPrediction.eval_id)
            .where(SqlEval.run_id == run_id).group_by(SqlPrediction.eval_id).subquery()
        )  # fmt: skip
        evals = conn.execute(
            sa.select(SqlEval.eval_id, SqlEval.name, SqlEval.step, SqlEval.metrics,
                      SqlEval.breakdowns, SqlEval.tags, SqlEval.seconds, SqlEval.error,
                      sa.func.coalesce(counts.c.n, 0).label("predictions"))
            .join(counts, counts.c.eval_id == SqlEval.eval_id, isouter=True)
            .where(SqlEval.run_id == run_id).order_by(SqlEval.eval_id)
        ).mappings().all()  # fmt: skip
        checkpoints = conn.execute(
            sa.select(SqlCheckpoint.step, SqlCheckpoint.path, SqlCheckpoint.event,
                      SqlCheckpoint.metrics, SqlCheckpoint.reason, SqlCheckpoint.created_at)
            .where(SqlCheckpoint.run_id == run_id).order_by(SqlCheckpoint.checkpoint_id)
        ).mappings().all()  # fmt: skip
        newest = (
            sa.select(SqlHistogram.key, sa.func.max(SqlHistogram.step).label("step"))
            .where(SqlHistogram.run_id == run_id)
            .group_by(SqlHistogram.key)
            .subquery()
        )
        histograms = conn.execute(
            sa.select(SqlHistogram.key, SqlHistogram.step, SqlHistogram.edges,
                      SqlHistogram.counts, SqlHistogram.nan, SqlHistogram.posinf,
                      SqlHistogram.neginf)
            .join(newest, sa.and_(newest.c.key == SqlHistogram.key,
                                  newest.c.step == SqlHistogram.step))
            .where(SqlHistogram.run_id == run_id).order_by(SqlHistogram.key)
        ).mappings().all()  # fmt: skip
        images = conn.execute(
            sa.select(SqlImage.key, SqlImage.step, SqlImage.width, SqlImage.height)
            .where(SqlImage.run_id == run_id).order_by(SqlImage.key, SqlImage.step)
        ).mappings().all()  # fmt: skip
    status, error = r["status"], r["error"]
    why = _gone(store).get(run_id) if status == "running" else None
    if why is not None:
        status, error = "crashed", why
    from urllib.parse import urlencode

    base = f"/api/v1/dashboard/runs/{run_id}/image?"
    return LabJSON({
        "run_id": r["run_id"], "experiment": r["experiment"], "run_key": r["run_key"],
        "arm": r["arm"], "repeat": r["repeat"], "stage": r["stage"], "seed": r["seed"],
        "status": status, "config": r["config"] or {}, "error": error, "traceback": r["traceback"],
        "callback_errors": r["callback_errors"] or [], "started_at": r["started_at"],
        "ended_at": r["ended_at"], "duration_s": _seconds(r["started_at"], r["ended_at"]),
        "parent_run_id": r["parent_run_id"], "live": status == "running",
        "metrics": [{**m, "last": _nan(m["last"])} for m in metrics],
        "evals": [dict(e) for e in evals],
        "checkpoints": [dict(c) for c in checkpoints],
        "histograms": [dict(h) for h in histograms],
        "images": [{**i, "url": base + urlencode({"key": i["key"], "step": i["step"]})}
                   for i in images],
    })  # fmt: skip


#: What `lab serve` answers for an image row that has no bytes, only a path.
NO_BYTES = (
    "run {run_id}'s image {key!r} at step {step} was recorded before the store kept image "
    "bytes, and lab serve opens no file; lab ui on the machine that holds the run's folder "
    "shows it"
)


@router.get(
    "/runs/{run_id}/image",
    response_class=Response,
    responses={
        200: {
            "description": "The image's PNG",
            "content": {"image/png": {"schema": {"type": "string", "format": "binary"}}},
        },
        **problems(403, 404),
    },
)
def image(
    run_id: RunPath,
    key: Text,
    step: Annotated[int, fastapi.Query(ge=-EXACT, le=EXACT)],
    request: fastapi.Request,
    store: Store = StoreDep,
) -> Any:
    """The PNG of one image row of a run: the bytes the store keeps. A server never opens a
    file to answer it, since a row's path is whatever its writer sent.

    A row recorded before the store kept image bytes has only its path: `lab serve` answers
    404 for it; `lab ui` (this machine's own store, on loopback) reads it from the run's
    folder, and only from inside it (a path that leads anywhere else, by ``..``, an
    absolute path or a link, is answered 404 like a missing file)."""
    with connect(store.engine) as conn:
        found = _run(conn, run_id)
        row = conn.execute(
            sa.select(SqlImage.path, SqlImage.data).where(
                SqlImage.run_id == run_id, SqlImage.key == key, SqlImage.step == step
            )
        ).first()
    if row is None:
        raise Rejected(404, f"run {run_id} has no image {key!r} at step {step}", "key")
    if row.data is not None:
        return Response(bytes(row.data), media_type="image/png")
    if not getattr(request.app.state, "run_folders", False):
        raise Rejected(404, NO_BYTES.format(run_id=run_id, key=key, step=step), "key")
    return Response(_from_folder(found["output_dir"], row.path, run_id, key, step),
                    media_type="image/png")  # fmt: skip


def _from_folder(folder: str | None, path: str, run_id: int, key: str, step: int) -> bytes:
    """An image's bytes read from inside its run's folder (`lab ui` only), else 404."""
    missing = Rejected(404, f"run {run_id} has no image {key!r} at step {step} in its folder",
                       "key")  # fmt: skip
    if folder is None:
        raise missing
    root = Path(folder).resolve()
    try:
        file = (root / path).resolve()
    except (OSError, ValueError):
        raise missing from None
    if not file.is_relative_to(root) or not file.is_file():
        raise missing
    return file.read_bytes()
