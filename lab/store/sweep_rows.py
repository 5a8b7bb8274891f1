"""Writes of what a sweep records (`lab.sweeps`): its sampled arms as their sampler knows
them (`sweep_trials`) and the arms a race dropped (`eliminations`), and the points of one
metric over an experiment's runs, which a pruning rule compares a run with. One part of
`lab.store.Store` (see `lab.store.store`); the trials and eliminations are read back by
`lab.store.listing`, as ``lab show`` reads them without SQLAlchemy."""

from __future__ import annotations

import math
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from lab._names import MAX_NAME, check_name
from lab.errors import ConfigError, NoExperiment
from lab.store._values import _now
from lab.store.engine import connect, transaction
from lab.store.reads import experiment_id
from lab.store.schema import (
    TRIAL_STATES,
    SqlArm,
    SqlElimination,
    SqlMetric,
    SqlRun,
    SqlSweepTrial,
)
from lab.store.statements import dialect_insert
from lab.store.tables import MAX_TEST


class SweepRows:
    """The part of `lab.store.Store` that records sweeps, in the store behind `engine` (of
    `dialect`: ``sqlite`` or ``postgresql``)."""

    def __init__(self, engine: Engine, dialect: str) -> None:
        self.engine = engine
        self.dialect = dialect

    def _insert(self, model: Any) -> Any:
        return dialect_insert(self.dialect, model)

    def add_trial(
        self,
        experiment_id: int,
        number: int,
        arm_id: int,
        params: dict[str, Any],
        asked_after: int,
    ) -> None:
        """Record sampled arm `number` of an experiment as asked (state ``running``).
        Recording it again with the same arm, params and `asked_after` does nothing; with
        others it is refused (`ConfigError`): a sweep run again must ask what it asked."""
        _whole("number", number)
        _whole("asked_after", asked_after)
        row = {"experiment_id": experiment_id, "number": number, "arm_id": arm_id,
               "params": params, "asked_after": asked_after}  # fmt: skip
        with transaction(self.engine) as conn:
            arm = conn.execute(
                sa.select(SqlArm.experiment_id).where(SqlArm.arm_id == arm_id)
            ).scalar_one_or_none()
            if arm != experiment_id:
                raise ConfigError(
                    f"arm {arm_id} is not an arm of experiment {experiment_id}; record the "
                    "sampled arm with add_arm first and give its id"
                )
            stmt = self._insert(SqlSweepTrial).values(**row, state="running")
            conn.execute(stmt.on_conflict_do_nothing(index_elements=["experiment_id", "number"]))
            kept = conn.execute(
                sa.select(SqlSweepTrial.arm_id, SqlSweepTrial.params, SqlSweepTrial.asked_after)
                .where(SqlSweepTrial.experiment_id == experiment_id,
                       SqlSweepTrial.number == number)
            ).one()  # fmt: skip
        if tuple(kept) != (arm_id, params, asked_after):
            raise ConfigError(
                f"trial {number} of experiment {experiment_id} is recorded with arm {kept[0]}, "
                f"params {kept[1]} asked after {kept[2]} tells, not arm {arm_id}, params "
                f"{params} after {asked_after}; a sweep run again asks the same points: "
                "keep its space, sampler and seed, or record it under a new experiment name"
            )

    def tell_trial(
        self, experiment_id: int, number: int, *, told: int, value: float | None, state: str
    ) -> None:
        """Record how trial `number` ended: its tell's sequence number `told`, the arm's
        `value` (None for a failed trial) and its `state`."""
        _whole("told", told)
        if state not in TRIAL_STATES:
            raise ConfigError(
                f"state={state!r}: a trial's state is one of {', '.join(TRIAL_STATES)}"
            )
        if value is not None and (isinstance(value, bool) or math.isnan(value)):
            raise ConfigError(
                f"trial {number}'s value is {value!r}; tell a number, or value=None with "
                "state='failed' for a trial with no value"
            )
        with transaction(self.engine) as conn:
            done = conn.execute(
                sa.update(SqlSweepTrial)
                .where(SqlSweepTrial.experiment_id == experiment_id,
                       SqlSweepTrial.number == number)
                .values(told=told, value=None if value is None else float(value), state=state)
            ).rowcount  # fmt: skip
        if not done:
            raise NoExperiment(
                f"experiment {experiment_id} has no trial {number}; record it with add_trial "
                "before telling it"
            )

    def supersede_trials(self, experiment: str) -> int:
        """Set aside the trials of `experiment` (``fresh=True``), keeping them, as its runs
        are superseded: the live trials, in their order, are renumbered ``lowest - 1``,
        ``lowest - 2``, ... below every number the experiment holds (so below zero, and below
        the trials set aside before), where no reader looks and no new trial is numbered.
        Returns how many moved (0 for an unknown experiment). Numbered by their place, not
        their number, the trials set aside stay within the column's range however often a
        sweep starts afresh; below every existing number, no row collides while they move.

        A race's eliminations go too: they were decided by the runs now superseded (which
        keep every value they were decided from), and the new race records its own; left,
        every reader would show the old race's drops as the new one's."""
        with transaction(self.engine) as conn:
            try:
                exp_id = experiment_id(conn, experiment)
            except NoExperiment:
                return 0
            conn.execute(sa.delete(SqlElimination).where(SqlElimination.experiment_id == exp_id))
            mine = SqlSweepTrial.experiment_id == exp_id
            lowest = conn.execute(sa.select(sa.func.min(SqlSweepTrial.number)).where(mine))
            below = min(lowest.scalar() or 0, 0) - 1
            live = conn.execute(
                sa.select(SqlSweepTrial.number)
                .where(mine, SqlSweepTrial.number >= 0)
                .order_by(SqlSweepTrial.number)
            ).scalars()
            moved = 0
            for place, number in enumerate(list(live)):
                conn.execute(
                    sa.update(SqlSweepTrial)
                    .where(mine, SqlSweepTrial.number == number)
                    .values(number=below - place)
                )
                moved += 1
            return moved

    def add_elimination(
        self,
        experiment_id: int,
        arm_id: int,
        *,
        round: int,
        test: str,
        statistic: float,
        p_value: float,
        alpha: float,
        best: str,
    ) -> None:
        """Record that a race dropped arm `arm_id` after `round`, by `test` against arm
        `best` (by name). An arm is dropped once: recording it again keeps the first."""
        _whole("round", round)
        check_name("test", test, MAX_TEST)
        check_name("best arm", best, MAX_NAME)
        for name, number in (("statistic", statistic), ("p_value", p_value), ("alpha", alpha)):
            if (
                isinstance(number, bool)
                or not isinstance(number, int | float)
                or math.isnan(number)
            ):
                raise ConfigError(f"an elimination's {name} must be a number, not {number!r}")
        row = {"experiment_id": experiment_id, "arm_id": arm_id, "round": round, "test": test,
               "statistic": float(statistic), "p_value": float(p_value), "alpha": float(alpha),
               "best_arm": best, "created_at": _now()}  # fmt: skip
        with transaction(self.engine) as conn:
            arm = conn.execute(
                sa.select(SqlArm.experiment_id).where(SqlArm.arm_id == arm_id)
            ).scalar_one_or_none()
            if arm != experiment_id:
                raise ConfigError(f"arm {arm_id} is not an arm of experiment {experiment_id}")
            stmt = self._insert(SqlElimination).values(**row)
            conn.execute(stmt.on_conflict_do_nothing(index_elements=["experiment_id", "arm_id"]))

    def metric_points(self, experiment: str, metric: str) -> dict[str, list[tuple[int, float]]]:
        """Each current run's (step, value) points of `metric`, in step order, by run key
        (runs without a point left out; NaN restored): what a pruning rule compares a
        run's value at a step with. What is durable in the store is read; nothing is
        flushed, so a run asking this from its step loop never waits on its own writes."""
        with connect(self.engine) as conn:
            exp_id = experiment_id(conn, experiment)
            rows = conn.execute(
                sa.select(SqlRun.run_key, SqlMetric.step, SqlMetric.value)
                .join(SqlRun, SqlRun.run_id == SqlMetric.run_id)
                .where(SqlRun.experiment_id == exp_id, SqlRun.superseded_at.is_(None),
                       SqlMetric.key == metric)
                .order_by(SqlRun.run_key, SqlMetric.step)
            ).all()  # fmt: skip
        out: dict[str, list[tuple[int, float]]] = {}
        for run_key, step, value in rows:
            out.setdefault(run_key, []).append((step, math.nan if value is None else value))
        return out


def _whole(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be a whole number >= 0, not {value!r}")
