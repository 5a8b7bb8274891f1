"""The plan grows as runs end: `Scheduler` asks its plan for more chains after each run, and
an arm the plan adds at run time joins the result and the store through the same hooks.

`Growing` adds arm ``b`` once ``a-r0`` has ended, as a sweep adds a sampled arm. The train
function and the config are defined at module top level, for the worker processes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pydantic
import pytest

from lab import Arm, Experiment, LogContext, RunResult, RunSpec
from lab.hooks import RUNS
from lab.scheduler import Chain
from tests.recorder import Labels
from tests.store_rows import rows


class Cfg(pydantic.BaseModel):
    shift: float = 0.0


def train(run: RunSpec) -> dict[str, float]:
    if run.run_key == "a-r1":  # under a pool, a-r0 ends first, and b starts beside a-r1
        time.sleep(1.0)
    return {"loss": run.config.shift + run.seed}


class Growing(Experiment):
    """Adds arm ``b`` (shift 1) when ``a-r0`` ends."""

    def more(self, ctx: LogContext, run: RunResult) -> list[Chain]:
        if run.run_key == "a-r0":
            return self._add_arm(ctx, Arm("b", shift=1.0))
        return super().more(ctx, run)


class Planned(Labels, hooks=("on_experiment_start", "on_group_start", "on_run_start",
                             "on_run_end", "on_experiment_end")):  # fmt: skip
    """Labels each call, and notes the runs planned as each run ends."""

    run_end_in_parent = True  # under a pool, hears each run's end in the experiment's process

    def note(self, hook: str, *args: Any, **kwargs: Any) -> str:
        if hook == "on_group_start":
            return f"{hook}:{args[1]}"
        label = super().note(hook, *args, **kwargs)
        if hook == "on_run_end":
            return f"{label}:{args[0].extras[RUNS]}"
        return label


def _grow(tmp_path: Path, executor: str) -> tuple[Any, Planned, Path]:
    db = tmp_path / "lab.db"
    seen = Planned()
    exp = Growing("grow", train, base_config=Cfg(), arms=[Arm("a")], repeats=2,
                  callbacks=[seen], store=f"sqlite:///{db}", output_dir=tmp_path / "runs",
                  executor=executor, workers=2 if executor == "processes" else None)  # type: ignore[arg-type]  # fmt: skip
    return exp.run(), seen, db


def _check_rows(db: Path) -> None:
    """The added arm's row, its group and its runs, as the declared arm's."""
    assert rows(db, "SELECT name, overrides, config FROM arms ORDER BY arm_id") == [
        ("a", "{}", '{"shift": 0.0}'),
        ("b", '{"shift": 1.0}', '{"shift": 1.0}'),
    ]
    assert rows(db, "SELECT g.name, a.name FROM groups g JOIN arms a USING (arm_id) "
                    "ORDER BY g.group_id") == [("a", "a"), ("b", "b")]  # fmt: skip
    assert rows(db, "SELECT r.run_key, a.name, g.name, r.seed, r.status FROM runs r "
                    "JOIN arms a USING (arm_id) JOIN groups g USING (group_id) "
                    "ORDER BY r.run_key") == [
        ("a-r0", "a", "a", 0, "completed"), ("a-r1", "a", "a", 1, "completed"),
        ("b-r0", "b", "b", 0, "completed"), ("b-r1", "b", "b", 1, "completed"),
    ]  # fmt: skip


def _check_result(result: Any) -> None:
    assert [(a.name, a.overrides, a.planned) for a in result.arms] == [
        ("a", {}, 2),
        ("b", {"shift": 1.0}, 2),
    ]
    assert [(r.run_key, r.metrics) for r in result.runs] == [
        ("a-r0", {"loss": 0.0}), ("a-r1", {"loss": 1.0}),
        ("b-r0", {"loss": 1.0}), ("b-r1", {"loss": 2.0}),
    ]  # fmt: skip
    assert (result.planned, result.status) == (4, "completed")
    summary = result.summary("loss")
    assert (summary.best_arm, summary.planned, summary.runs) == ("a", 4, 4)


def test_an_arm_added_as_the_experiment_runs_is_run_and_recorded(tmp_path: Path) -> None:
    result, seen, db = _grow(tmp_path, "serial")
    assert seen.calls == [
        "on_experiment_start",
        "on_group_start:a",
        "on_run_start:a-r0",
        "on_run_end:a-r0:completed:2",  # planned as it ended; then b joins
        "on_run_start:a-r1",
        "on_run_end:a-r1:completed:4",
        "on_group_start:b",
        "on_run_start:b-r0",
        "on_run_end:b-r0:completed:4",
        "on_run_start:b-r1",
        "on_run_end:b-r1:completed:4",
        "on_experiment_end:completed",
    ]
    _check_result(result)
    _check_rows(db)


@pytest.mark.slow
def test_an_arm_added_under_a_pool_starts_as_soon_as_a_worker_is_free(tmp_path: Path) -> None:
    result, seen, db = _grow(tmp_path, "processes")
    # in this process: the experiment's and groups' hooks, and each run's end as it arrives;
    # b's group starts once a-r0 ended, while a-r1 may still run
    groups = [c for c in seen.calls if not c.startswith("on_run_end")]
    assert groups == ["on_experiment_start", "on_group_start:a", "on_group_start:b",
                      "on_experiment_end:completed"]  # fmt: skip
    ends = [c for c in seen.calls if c.startswith("on_run_end")]
    assert ends[0] == "on_run_end:a-r0:completed:4"  # b is planned before a-r0's end is shown
    assert sorted(ends) == [f"on_run_end:{k}:completed:4" for k in ("a-r0", "a-r1", "b-r0",
                                                                     "b-r1")]  # fmt: skip
    _check_result(result)
    _check_rows(db)
