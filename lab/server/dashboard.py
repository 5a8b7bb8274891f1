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
import math
import threading
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, cast

import fastapi
import numpy as np
import sqlalchemy as sa
from fastapi.responses import Response
from pydantic import BaseModel

from lab._ranking import COUNTED_STATUSES, Mode, choose, counted, declaration, rank_arms
from lab._stats import t_ppf
from lab.analysis import CONFIDENCE
from lab.errors import NoRun
from lab.server.dashboard_sweep import router as sweep_api
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
from lab.store import Store
from lab.store import dashboard_reads as reads
from lab.store.curves import Cells, cut
from lab.store.engine import connect
from lab.store.records import ExperimentRecord

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
    """A run's own curve: per bucket its last step there, min, max and last value; its
    status, so a pruned run's curve is drawn apart from the arms'."""

    run_id: int
    run_key: str
    arm: str | None
    status: str
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


def _ranking(config: Any, keys: set[str] | list[str]) -> tuple[str | None, Mode]:
    """The metric and mode an experiment's arms are ranked by when the request names none:
    the one it declares, else ``val/loss`` or ``loss`` (`lab._ranking.choose`)."""
    return choose(None, None, declaration(config), keys)


def _check_mode(mode: str | None) -> Mode | None:
    """`mode` as the ranking takes it: None, ``min`` or ``max``; anything else a 400."""
    if mode is not None and mode not in ("min", "max"):
        raise Rejected(400, f"mode={mode!r}: use min (lower is better) or max", "mode")
    return cast(Mode | None, mode)


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
    with connect(store.engine) as conn:
        found = reads.experiments_page(conn, q, access(request).only, offset, limit)
        page, keys = found["page"], found["keys"]
        ranking = {e["experiment_id"]: _ranking(e["config"], keys.get(e["experiment_id"], set()))
                   for e in page}  # fmt: skip
        wanted = {metric for metric, _mode in ranking.values() if metric is not None}
        ids = [e["experiment_id"] for e in page]
        finals = reads.finals(conn, ids, wanted, COUNTED_STATUSES)
    runs, arms, arm_order, total = found["runs"], found["arms"], found["arm_order"], found["total"]
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


def _run_rows(store: Store, name: str) -> tuple[ExperimentRecord, list[dict[str, Any]]]:
    """An experiment (`Store.get_experiment`: crashed runs shown as crashed) and its current
    runs as the runs table shows them, with their configs."""
    exp = store.get_experiment(name)
    with connect(store.engine) as conn:
        configs = reads.run_configs(conn, name)
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
    own min, max and last value per bucket too, every run of the experiment included, with
    its status (a pruned run is in no arm's curve: the UI draws it grey on its own).

    An arm's curves are drawn from the runs `lab.inspect` counts (completed and stopped, at
    the arm's last stage) and its running ones. Every run's buckets are cut on the server
    (`lab.store.curves.cut`) from the metric blocks: wide ones from their envelopes and the
    points at their edges, narrow ones from the points packed in them, then the arms'
    numbers are taken over the cells in numpy. The answer is a few thousand numbers, never every
    point.
    """
    if not 1 <= buckets <= MAX_CURVE_BUCKETS:
        raise Rejected(400, f"buckets={buckets}: give 1 to {MAX_CURVE_BUCKETS} buckets", "buckets")
    gone = _gone(store)
    with connect(store.engine) as conn:
        experiment_id = store.experiment_id(conn, name)
        config, members = reads.curve_members(conn, experiment_id)
        ids = [r.run_id for r in members]
        lo, hi = reads.metric_span(conn, ids, metric)
        if lo is None:
            known = reads.metric_keys(conn, ids)
            raise Rejected(
                404,
                f"experiment {name!r} has no metric {metric!r}; it has: "
                f"{', '.join(known) or 'none'}",
                "metric",
            )
        bounds = bucket_bounds(lo, hi, buckets)
    cells = cut(store.engine, ids, metric, bounds, last=runs)
    declared = (declaration(config).bounds or {}).get(metric)
    answer_arms = [
        _arm_curve(arm, cells, run_ids, declared) for arm, run_ids in _arms(members, gone)
    ]
    answer_runs = _run_curves(members, cells, gone) if runs else []
    return LabJSON({"metric": metric, "buckets": buckets, "arms": answer_arms,
                    "runs": answer_runs})  # fmt: skip


def _arms(members: list[Any], gone: dict[int, str]) -> list[tuple[str | None, list[int]]]:
    """Each arm's name and the runs its curve is drawn from: at the arm's last stage, of
    `CURVE_STATUSES` (a run whose process is gone counted as crashed)."""
    last_stage: dict[int | None, int] = {}
    for r in members:
        last_stage[r.arm_id] = max(last_stage.get(r.arm_id, r.stage), r.stage)
    arms: dict[int | None, tuple[str | None, list[int]]] = {}
    for r in members:
        status = "crashed" if r.run_id in gone else r.status
        if status in CURVE_STATUSES and r.stage == last_stage[r.arm_id]:
            arms.setdefault(r.arm_id, (r.name, []))[1].append(r.run_id)
    return list(arms.values())


def _run_curves(members: list[Any], cells: Cells, gone: dict[int, str]) -> list[dict[str, Any]]:
    """Each run's own curve: per bucket its last step, min, max and last value, and its
    status (crashed when its process is gone)."""
    answer_runs = []
    starts = np.searchsorted(cells.run_id, [r.run_id for r in members], side="left")
    stops = np.searchsorted(cells.run_id, [r.run_id for r in members], side="right")
    for r, a, b in zip(members, starts.tolist(), stops.tolist(), strict=True):
        counted = cells.counted[a:b]
        answer_runs.append({
            "run_id": r.run_id, "run_key": r.run_key, "arm": r.name,
            "status": "crashed" if r.run_id in gone else r.status,
            "step": cells.step[a:b].tolist(),
            "min": _listed(cells.low[a:b], counted), "max": _listed(cells.high[a:b], counted),
            "last": cells.last[a:b].tolist(),
        })  # fmt: skip
    return answer_runs


@functools.lru_cache(maxsize=1024)
def _t(df: int) -> float:
    return t_ppf(0.5 + CONFIDENCE / 2.0, df)


def _arm_curve(
    arm: str | None, cut: Cells, run_ids: list[int], bounds: tuple[float, float] | None
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
    n, mean, std = n[reached], mean[reached], std[reached]
    lows, highs, points, steps = lows[reached], highs[reached], points[reached], steps[reached]
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


# -- predictions: disagreements and breakdowns ------------------------------------------------


def _check_eval(conn: sa.Connection, experiment_id: int, name: str, eval: str) -> None:
    known = reads.experiment_eval_names(conn, experiment_id)
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
        arms = reads.arm_names(conn, experiment_id)
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


router.include_router(sweep_api)  # under an experiment: tried before the experiment's route


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

    wanted = _check_mode(mode)
    exp, runs = _run_rows(store, name)
    ids = [r["run_id"] for r in runs]
    with connect(store.engine) as conn:
        keys = reads.metric_keys(conn, ids)
        evals = reads.eval_names(conn, ids)
        chained = reads.chain_runs(conn, ids)
    if metric is not None and metric not in keys:
        raise Rejected(
            404, f"experiment {name!r} has no metric {metric!r}; it has: "
                 f"{', '.join(keys) or 'none'}", "metric",
        )  # fmt: skip
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
    found = reads.run_named(conn, run_id)
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
        parts = reads.run_records(conn, run_id)
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
        "metrics": parts["metrics"], "evals": parts["evals"],
        "checkpoints": parts["checkpoints"], "histograms": parts["histograms"],
        "images": [{**i, "url": base + urlencode({"key": i["key"], "step": i["step"]})}
                   for i in parts["images"]],
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
        row = reads.image_row(conn, run_id, key, step)
    if row is None:
        raise Rejected(404, f"run {run_id} has no image {key!r} at step {step}", "key")
    path, data = row
    if data is not None:
        return Response(bytes(data), media_type="image/png")
    if not getattr(request.app.state, "run_folders", False):
        raise Rejected(404, NO_BYTES.format(run_id=run_id, key=key, step=step), "key")
    return Response(_from_folder(found["output_dir"], path, run_id, key, step),
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
