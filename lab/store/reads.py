"""Reads of the store: experiments, their runs and metrics, as plain dicts (the ORM rows
never leave this package)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from lab._json import floats_back
from lab.errors import NoExperiment
from lab.store.engine import connect
from lab.store.schema import SqlArm, SqlExperiment, SqlMetric, SqlRun, SqlSummary

if TYPE_CHECKING:
    from lab.store.crashes import Crashed


class Reads:
    """The reading part of `lab.store.Store`."""

    engine: Engine
    readonly: bool
    if TYPE_CHECKING:

        def crashed_now(self) -> Crashed: ...

    def find_run(self, experiment_id: int, run_key: str) -> int | None:
        """The id of an experiment's run by its key, if it was recorded."""
        with connect(self.engine) as conn:
            return conn.execute(
                sa.select(SqlRun.run_id).where(
                    SqlRun.experiment_id == experiment_id, SqlRun.run_key == run_key
                )
            ).scalar_one_or_none()

    def previous_runs(self, experiment: str) -> dict[str, dict[str, Any]]:
        """An experiment's current (not superseded) runs by run key, if any: status, seed,
        stage, config, config hash, final metrics, owner, and the experiment's recorded
        train function (``train``), so a later attempt can tell whether it may reuse them."""
        with connect(self.engine) as conn:
            rows = (
                conn.execute(
                    sa.select(
                        SqlRun.run_key,
                        SqlRun.status,
                        SqlRun.seed,
                        SqlRun.stage,
                        SqlRun.config,
                        SqlRun.config_hash,
                        SqlRun.summary,
                        SqlRun.host,
                        SqlRun.pid,
                        SqlRun.started_at,
                        SqlExperiment.config.label("experiment_config"),
                    )
                    .join(SqlExperiment, SqlExperiment.experiment_id == SqlRun.experiment_id)
                    .where(SqlExperiment.name == experiment, SqlRun.superseded_at.is_(None))
                )
                .mappings()
                .all()
            )
        out = {}
        for r in rows:
            row = {k: v for k, v in r.items() if k != "experiment_config"}
            row["summary"] = floats_back(r["summary"] or {})
            row["train"] = (r["experiment_config"] or {}).get("train")
            out[r["run_key"]] = row
        return out

    def current_runs(self, experiment: str) -> list[dict[str, Any]]:
        """An experiment's runs that are not superseded: id, key, status, folder, owner."""
        with connect(self.engine) as conn:
            return [
                dict(r)
                for r in conn.execute(
                    sa.select(SqlRun.run_id, SqlRun.run_key, SqlRun.status, SqlRun.output_dir,
                              SqlRun.host, SqlRun.pid, SqlRun.started_at)
                    .join(SqlExperiment, SqlExperiment.experiment_id == SqlRun.experiment_id)
                    .where(SqlExperiment.name == experiment, SqlRun.superseded_at.is_(None))
                    .order_by(SqlRun.run_id)
                ).mappings()
            ]  # fmt: skip

    def run_keys(self, experiment: str) -> list[str]:
        """Every run key of an experiment, superseded ones included."""
        with connect(self.engine) as conn:
            return list(
                conn.execute(
                    sa.select(SqlRun.run_key)
                    .join(SqlExperiment, SqlExperiment.experiment_id == SqlRun.experiment_id)
                    .where(SqlExperiment.name == experiment)
                ).scalars()
            )

    def last_step(self, run_id: int) -> int | None:
        """The newest step a run logged a metric at, or None; queued metrics count (they
        are flushed first)."""
        self.flush()
        with connect(self.engine) as conn:
            return conn.execute(
                sa.select(sa.func.max(SqlSummary.last_step)).where(SqlSummary.run_id == run_id)
            ).scalar_one()

    def list_experiments(self) -> list[dict[str, Any]]:
        """Every experiment with its status and its run counts by status, newest first.

        Superseded runs (see `Experiment(fresh=True)`) are left out of the counts and
        points; `superseded` counts them. Read-only, the runs and experiments whose process
        is gone show as crashed (`crashed_now`), as `mark_crashed` would mark them.
        """
        crashed = self.crashed_now()
        current = SqlRun.superseded_at.is_(None)
        counts = (
            sa.select(SqlRun.experiment_id, SqlRun.status, sa.func.count().label("n"))
            .where(current)
            .group_by(SqlRun.experiment_id, SqlRun.status)
            .subquery()
        )
        with connect(self.engine) as conn:
            experiments = (
                conn.execute(sa.select(SqlExperiment).order_by(SqlExperiment.experiment_id.desc()))
                .mappings()
                .all()
            )
            by_status: dict[int, dict[str, int]] = {}
            for exp_id, status, n in conn.execute(sa.select(counts)):
                by_status.setdefault(exp_id, {})[status] = n
            if crashed.runs:  # show runs whose process is gone as crashed; never write it
                for exp_id in conn.execute(
                    sa.select(SqlRun.experiment_id).where(SqlRun.run_id.in_(list(crashed.runs)))
                ).scalars():
                    per = by_status[exp_id]
                    per["running"] -= 1
                    per["crashed"] = per.get("crashed", 0) + 1
                    if not per["running"]:
                        del per["running"]
            arm_counts = dict(
                conn.execute(
                    sa.select(SqlArm.experiment_id, sa.func.count()).group_by(SqlArm.experiment_id)
                ).all()
            )
            points = dict(  # from summaries: one row per run and key, however long the runs
                conn.execute(
                    sa.select(SqlRun.experiment_id, sa.func.sum(SqlSummary.count))
                    .join(SqlSummary, SqlSummary.run_id == SqlRun.run_id)
                    .where(current)
                    .group_by(SqlRun.experiment_id)
                ).all()
            )
            superseded = dict(
                conn.execute(
                    sa.select(SqlRun.experiment_id, sa.func.count())
                    .where(SqlRun.superseded_at.is_not(None))
                    .group_by(SqlRun.experiment_id)
                ).all()
            )
        return [
            {
                "name": e["name"],
                "status": "crashed" if e["experiment_id"] in crashed.experiments else e["status"],
                "arms": arm_counts.get(e["experiment_id"], 0),
                "repeats": e["repeats"],
                "runs": sum(by_status.get(e["experiment_id"], {}).values()),
                "runs_by_status": by_status.get(e["experiment_id"], {}),
                "points": int(points.get(e["experiment_id"]) or 0),
                "superseded": superseded.get(e["experiment_id"], 0),
                "created_at": e["created_at"],
                "tags": e["tags"] or [],
                "notes": e["notes"],
            }
            for e in experiments
        ]

    def get_experiment(self, name: str) -> dict[str, Any]:
        """An experiment with its tags and notes, its arms and runs (status, newest step,
        error, final metrics, tags, notes, provenance), and the failures of its
        experiment-level callbacks.

        A run's metrics are the last value of each key from `summaries` (so a running or
        crashed run shows where it got to), overlaid with the final metrics it returned.
        Superseded runs are left out; `superseded` counts them.
        """
        with connect(self.engine) as conn:
            exp = (
                conn.execute(sa.select(SqlExperiment).where(SqlExperiment.name == name))
                .mappings()
                .first()
            )
            if exp is None:
                known = conn.execute(sa.select(SqlExperiment.name)).scalars().all()
                hint = f"; known: {', '.join(sorted(known))}" if known else ""
                raise NoExperiment(f"no experiment named {name!r} in the store{hint}")
            arms = (
                conn.execute(
                    sa.select(SqlArm.name, SqlArm.overrides)
                    .where(SqlArm.experiment_id == exp["experiment_id"])
                    .order_by(SqlArm.arm_id)
                )
                .mappings()
                .all()
            )
            runs = (
                conn.execute(
                    sa.select(
                        SqlRun.run_id,
                        SqlRun.run_key,
                        SqlArm.name.label("arm"),
                        SqlRun.repeat,
                        SqlRun.stage,
                        SqlRun.seed,
                        SqlRun.status,
                        SqlRun.error,
                        SqlRun.summary,
                        SqlRun.callback_errors,
                        SqlRun.tags,
                        SqlRun.notes,
                        SqlRun.provenance,
                        SqlRun.traceback,
                        SqlRun.host,
                        SqlRun.pid,
                        SqlRun.started_at,
                        SqlRun.ended_at,
                        SqlRun.superseded_at,
                    )
                    .join(SqlArm, SqlArm.arm_id == SqlRun.arm_id, isouter=True)
                    .where(SqlRun.experiment_id == exp["experiment_id"])
                    .order_by(SqlRun.run_id)
                )
                .mappings()
                .all()
            )
            superseded = sum(1 for r in runs if r["superseded_at"] is not None)
            runs = [r for r in runs if r["superseded_at"] is None]
            latest: dict[int, dict[str, Any]] = {}
            for run_id, key, step, value in conn.execute(
                sa.select(SqlSummary.run_id, SqlSummary.key, SqlSummary.last_step,
                          SqlSummary.last_value)
                .join(SqlRun, SqlRun.run_id == SqlSummary.run_id)
                .where(SqlRun.experiment_id == exp["experiment_id"])
            ):  # fmt: skip
                per = latest.setdefault(run_id, {"step": 0, "values": {}})
                per["step"] = max(per["step"], step)
                per["values"][key] = math.nan if value is None else value
        # Read-only: a run or an experiment whose process is gone is shown as crashed, never
        # marked so.
        crashed = self.crashed_now()
        gone = {run_id: g.why for run_id, g in crashed.runs.items()}
        return {
            "name": exp["name"],
            "status": "crashed" if exp["experiment_id"] in crashed.experiments else exp["status"],
            "seed": exp["seed"],
            "repeats": exp["repeats"],
            "config": exp["config"],
            "created_at": exp["created_at"],
            "ended_at": exp["ended_at"],
            "callback_errors": exp["callback_errors"],
            "tags": exp["tags"] or [],
            "notes": exp["notes"],
            "arms": [dict(a) for a in arms],
            "runs": [_with_latest(r, latest.get(r["run_id"]), gone.get(r["run_id"])) for r in runs],
            "superseded": superseded,
        }

    def metric_values(self, run_id: int, key: str) -> list[tuple[int, float]]:
        """One run's (step, value) pairs for `key`, in step order, NaN restored."""
        with connect(self.engine) as conn:
            rows = conn.execute(
                sa.select(SqlMetric.step, SqlMetric.value)
                .where(SqlMetric.run_id == run_id, SqlMetric.key == key)
                .order_by(SqlMetric.step)
            ).all()
        return [(step, math.nan if value is None else value) for step, value in rows]

    @staticmethod
    def _experiment_id(conn: Connection, name: str) -> int:
        found = conn.execute(
            sa.select(SqlExperiment.experiment_id).where(SqlExperiment.name == name)
        ).scalar_one_or_none()
        if found is None:
            known = conn.execute(sa.select(SqlExperiment.name)).scalars().all()
            hint = f"; known: {', '.join(sorted(known))}" if known else ""
            raise NoExperiment(f"no experiment named {name!r} in the store{hint}")
        return found


def _with_latest(run: Any, latest: dict[str, Any] | None, gone: str | None) -> dict[str, Any]:
    """A run's record with its newest step and its metrics' last values from `summaries`,
    then the final metrics the run returned (which add post-training evals) over them;
    `gone`: why a `running` run is crashed, when a read-only store shows it so."""
    values = dict(latest["values"]) if latest else {}
    values.update(floats_back(run["summary"] or {}))
    fields = {k: v for k, v in run.items() if k != "superseded_at"}
    shown = {
        **fields,
        "step": latest["step"] if latest else None,
        "summary": values,
        "tags": run["tags"] or [],
    }
    if gone is not None:
        shown.update(status="crashed", error=gone)
    return shown
