"""What ``lab ls`` and ``lab show`` read: every experiment with its run counts, and one
experiment with its arms and runs, as plain dicts.

Written once, as SQL text run through `lab.store.sql.Sql`, and read alike by a `Store`
(over its SQLAlchemy connection) and by the `lab.store.reader.Reader` that commands which
only read open (over the driver's own connection, without SQLAlchemy); `lab serve` answers
with the same dicts. A read-only reader shows runs and experiments whose process is gone as
crashed (`lab.store.crashes`), without writing it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

from lab._json import floats_back
from lab.errors import NoExperiment

if TYPE_CHECKING:
    from lab.store.crashes import Crashed
    from lab.store.records import (
        EliminationRecord,
        ExperimentRecord,
        ExperimentSummary,
        RunRecord,
        TrialRecord,
    )
    from lab.store.sql import Sql

_EXPERIMENTS = (
    "SELECT experiment_id, name, status, repeats, created_at, tags, notes "
    "FROM experiments ORDER BY experiment_id DESC"
)
# current runs (not superseded) by experiment and status
_RUN_COUNTS = (
    "SELECT experiment_id, status, count(*) FROM runs WHERE superseded_at IS NULL "
    "GROUP BY experiment_id, status"
)
_ARM_COUNTS = "SELECT experiment_id, count(*) FROM arms GROUP BY experiment_id"
# points from summaries: one row per run and key, however long the runs
_POINTS = (
    'SELECT r.experiment_id, sum(s."count") FROM runs r '
    "JOIN summaries s ON s.run_id = r.run_id WHERE r.superseded_at IS NULL "
    "GROUP BY r.experiment_id"
)
_SUPERSEDED = (
    "SELECT experiment_id, count(*) FROM runs WHERE superseded_at IS NOT NULL "
    "GROUP BY experiment_id"
)
_EXPERIMENT = (
    "SELECT experiment_id, name, status, seed, repeats, config, created_at, ended_at, "
    "callback_errors, tags, notes FROM experiments WHERE name = :name"
)
_NAMES = "SELECT name FROM experiments"
_ARMS = "SELECT name, overrides FROM arms WHERE experiment_id = :id ORDER BY arm_id"
_RUN_FIELDS = (
    "run_id", "run_key", "arm", "repeat", "stage", "seed", "status", "error", "summary",
    "callback_errors", "tags", "notes", "provenance", "traceback", "host", "pid",
    "started_at", "ended_at",
)  # fmt: skip
_RUNS = (
    'SELECT r.run_id, r.run_key, a.name, r."repeat", r.stage, r.seed, r.status, r.error, '
    "r.summary, r.callback_errors, r.tags, r.notes, r.provenance, r.traceback, r.host, "
    "r.pid, r.started_at, r.ended_at, r.superseded_at "
    "FROM runs r LEFT OUTER JOIN arms a ON a.arm_id = r.arm_id "
    "WHERE r.experiment_id = :id ORDER BY r.run_id"
)
_JSON_FIELDS = ("summary", "callback_errors", "tags", "provenance")
_TIME_FIELDS = ("started_at", "ended_at")
# each run's metrics: the last value of each key, and its newest step
_LATEST = (
    'SELECT s.run_id, s."key", s.last_step, s.last_value FROM summaries s '
    "JOIN runs r ON r.run_id = s.run_id WHERE r.experiment_id = :id"
)
# a sweep's sampled arms, and the arms its race dropped
_TRIALS = (
    "SELECT t.number, a.name, t.params, t.asked_after, t.told, t.value, t.state, t.arm_id "
    "FROM sweep_trials t JOIN arms a ON a.arm_id = t.arm_id "
    "WHERE t.experiment_id = :id AND t.number >= 0 ORDER BY t.number"  # (< 0: set aside)
)
_PRUNED = (
    "SELECT arm_id, pruned FROM runs WHERE experiment_id = :id AND status = 'pruned' "
    "AND superseded_at IS NULL ORDER BY run_id"
)
_ELIMINATIONS = (
    "SELECT a.name, e.round, e.test, e.statistic, e.p_value, e.alpha, e.best_arm, e.created_at "
    "FROM eliminations e JOIN arms a ON a.arm_id = e.arm_id "
    "WHERE e.experiment_id = :id ORDER BY e.round, a.name"
)
_ELIMINATION_FIELDS = ("arm", "round", "test", "statistic", "p_value", "alpha", "best")


class Listing:
    """The listing part of every SQL reader (`lab.store.Store`, `lab.store.reader.Reader`):
    each gives `reading` (a `Sql` over one of its connections) and `crashed_now` (what it
    shows as crashed without writing it: `lab.store.crashes.CrashReads.crashed_now`)."""

    def __init__(
        self,
        reading: Callable[[], AbstractContextManager[Sql]],
        crashed_now: Callable[[], Crashed],
    ) -> None:
        self.reading = reading
        self.crashed_now = crashed_now

    def list_experiments(self) -> list[ExperimentSummary]:
        """Every experiment with its status and its run counts by status, newest first.

        Superseded runs (see `Experiment(fresh=True)`) are left out of the counts and
        points; `superseded` counts them. Read-only, the runs and experiments whose process
        is gone show as crashed (`crashed_now`), as `mark_crashed` would mark them.
        """
        crashed = self.crashed_now()
        with self.reading() as sql:
            experiments = sql.rows(_EXPERIMENTS)
            by_status: dict[int, dict[str, int]] = {}
            for exp_id, status, n in sql.rows(_RUN_COUNTS):
                by_status.setdefault(exp_id, {})[status] = n
            arm_counts = dict(sql.rows(_ARM_COUNTS))
            points = dict(sql.rows(_POINTS))
            superseded = dict(sql.rows(_SUPERSEDED))
            when, loaded = sql.time, sql.json
        for gone in crashed.runs.values():  # shown as crashed; never written so
            per = by_status[gone.experiment_id]
            per["running"] -= 1
            per["crashed"] = per.get("crashed", 0) + 1
            if not per["running"]:
                del per["running"]
        return [
            {
                "name": name,
                "status": "crashed" if exp_id in crashed.experiments else status,
                "arms": arm_counts.get(exp_id, 0),
                "repeats": repeats,
                "runs": sum(by_status.get(exp_id, {}).values()),
                "runs_by_status": by_status.get(exp_id, {}),
                "points": int(points.get(exp_id) or 0),
                "superseded": superseded.get(exp_id, 0),
                "created_at": when(created_at),
                "tags": loaded(tags) or [],
                "notes": notes,
            }
            for exp_id, name, status, repeats, created_at, tags, notes in experiments
        ]

    def get_experiment(self, name: str) -> ExperimentRecord:
        """An experiment with its tags and notes, its arms and runs (status, newest step,
        error, final metrics, tags, notes, provenance), and the failures of its
        experiment-level callbacks.

        A run's metrics are the last value of each key from `summaries` (so a running or
        crashed run shows where it got to), overlaid with the final metrics it returned.
        Superseded runs are left out; `superseded` counts them.
        """
        with self.reading() as sql:
            found = sql.rows(_EXPERIMENT, name=name)
            if not found:
                raise _unknown(sql, name)
            (exp_id, name, status, seed, repeats, config, created_at, ended_at, failures, tags,
             notes) = found[0]  # fmt: skip
            arms = sql.rows(_ARMS, id=exp_id)
            runs = sql.rows(_RUNS, id=exp_id)
            latest: dict[int, dict[str, Any]] = {}
            for run_id, key, step, value in sql.rows(_LATEST, id=exp_id):
                per = latest.setdefault(run_id, {"step": 0, "values": {}})
                per["step"] = max(per["step"], step)
                per["values"][key] = math.nan if value is None else value
            when, loaded = sql.time, sql.json
        # Read-only: a run or an experiment whose process is gone is shown as crashed, never
        # marked so.
        crashed = self.crashed_now()
        gone = {run_id: g.why for run_id, g in crashed.runs.items()}
        current = []
        for *fields, superseded_at in runs:
            if superseded_at is None:
                run = dict(zip(_RUN_FIELDS, fields, strict=True))
                run.update({k: loaded(run[k]) for k in _JSON_FIELDS})
                run.update({k: when(run[k]) for k in _TIME_FIELDS})
                current.append(
                    _with_latest(run, latest.get(run["run_id"]), gone.get(run["run_id"]))
                )
        return {
            "name": name,
            "status": "crashed" if exp_id in crashed.experiments else status,
            "seed": seed,
            "repeats": repeats,
            "config": loaded(config),
            "created_at": when(created_at),
            "ended_at": when(ended_at),
            "callback_errors": loaded(failures),
            "tags": loaded(tags) or [],
            "notes": notes,
            "arms": [{"name": arm, "overrides": loaded(overrides)} for arm, overrides in arms],
            "runs": current,
            "superseded": len(runs) - len(current),
        }

    def trials(self, experiment: str) -> list[TrialRecord]:
        """An experiment's trials by number, with each one's arm by name and, for a trial
        whose runs were pruned, the step and value each was pruned at (`intermediate`)."""
        with self.reading() as sql:
            exp_id = _experiment_id(sql, experiment)
            rows = sql.rows(_TRIALS, id=exp_id)
            pruned = [(arm_id, sql.json(stop)) for arm_id, stop in sql.rows(_PRUNED, id=exp_id)]
            loaded = sql.json
        intermediate: dict[int, dict[int, float]] = {}
        for arm_id, stop in pruned:
            stop = floats_back(stop or {})
            if isinstance(stop.get("step"), int) and stop.get("value") is not None:
                intermediate.setdefault(arm_id, {})[stop["step"]] = float(stop["value"])
        return [
            {"number": number, "arm": arm, "params": loaded(params), "asked_after": asked_after,
             "told": told, "value": value, "state": state,
             "intermediate": intermediate.get(arm_id, {})}
            for number, arm, params, asked_after, told, value, state, arm_id in rows
        ]  # fmt: skip

    def eliminations(self, experiment: str) -> list[EliminationRecord]:
        """The arms an experiment's race dropped, by round, then arm name."""
        with self.reading() as sql:
            rows = sql.rows(_ELIMINATIONS, id=_experiment_id(sql, experiment))
            when = sql.time
        return [
            cast("EliminationRecord", {**dict(zip(_ELIMINATION_FIELDS, row[:-1], strict=True)),
                                       "created_at": when(row[-1])})
            for row in rows
        ]  # fmt: skip


def _experiment_id(sql: Sql, name: str) -> int:
    """The id of the experiment `name`; `NoExperiment` names the known ones."""
    found = sql.rows("SELECT experiment_id FROM experiments WHERE name = :name", name=name)
    if not found:
        raise _unknown(sql, name)
    return int(found[0][0])


def _unknown(sql: Sql, name: str) -> NoExperiment:
    """The error for an experiment `name` the store lacks, naming those it has."""
    known = sorted(n for (n,) in sql.rows(_NAMES))
    hint = f"; known: {', '.join(known)}" if known else ""
    return NoExperiment(f"no experiment named {name!r} in the store{hint}")


def _with_latest(run: dict[str, Any], latest: dict[str, Any] | None, gone: str | None) -> RunRecord:
    """A run's record with its newest step and its metrics' last values from `summaries`,
    then the final metrics the run returned (which add post-training evals) over them;
    `gone`: why a `running` run is crashed, when a read-only store shows it so."""
    values = dict(latest["values"]) if latest else {}
    values.update(floats_back(run["summary"] or {}))
    shown = {
        **run,
        "step": latest["step"] if latest else None,
        "summary": values,
        "tags": run["tags"] or [],
    }
    if gone is not None:
        shown.update(status="crashed", error=gone)
    return cast("RunRecord", shown)  # (`_RUN_FIELDS` and the step: the record's keys)
