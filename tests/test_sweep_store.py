"""What a sweep records, through every door of the store contract: `Store` on SQLite and
PostgreSQL, and `HttpStore` through a real `lab serve` in front of each. Sampled arms
(`sweep_trials`), a race's eliminations, pruned runs and the points a pruner reads, with
exact rows back from the store, from `lab.inspect` and from an export."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from served import serve

import lab.export
import lab.inspect
from lab.errors import ConfigError, NoExperiment, TokenRejected
from lab.server.auth import create_token
from lab.store import Store
from lab.store.api import StoreAPI
from lab.store.http import HttpStore

PRUNED = {"step": 3, "rule": "median", "metric": "val/loss", "value": 1.5}


@pytest.fixture(params=["sql", "http"])
def door(request: pytest.FixtureRequest, store_url: str) -> Iterator[StoreAPI]:
    """The store itself, or a `lab serve` in front of it, on SQLite and PostgreSQL."""
    if request.param == "sql":
        store: StoreAPI = Store(store_url)
        yield store
        store.close()
        return
    server = serve(store_url)
    store = HttpStore(server.url, token=server.write_token, heartbeat_s=3600.0)
    store.server = server  # type: ignore[attr-defined]  # for the ownership test
    try:
        yield store
    finally:
        store.close()
        server.stop()


def _run(store: StoreAPI, exp: int, arm: int, key: str, repeat: int) -> int:
    group = store.add_group(exp, key.split("/")[0], arm_id=arm)
    return store.start_run(exp, group, run_key=key, arm_id=arm, repeat=repeat, stage=0,
                           seed=repeat, config={}, output_dir=None)  # fmt: skip


def _record_sweep(store: StoreAPI) -> tuple[int, dict[str, int]]:
    """Two sampled arms: s000's repeat 0 completes, s001's is pruned at step 3; a third
    run of s000 is superseded. Trials asked, told, one told again; s001 eliminated."""
    exp = store.begin_experiment("search", config={}, seed=0, repeats=2)
    arms = {
        name: store.add_arm(exp, name, overrides=params, config={})
        for name, params in (("s000", {"lr": 0.01}), ("s001", {"lr": 0.1, "opt": "sgd"}))
    }
    done = _run(store, exp, arms["s000"], "s000/0", 0)
    for step, value in ((1, 2.0), (2, 1.0), (3, 0.5), (4, 0.25)):
        store.log_metrics(done, step, {"val/loss": value, "loss": value * 2})
    store.finish_run(done, status="completed", summary={"val/loss": 0.25})
    pruned = _run(store, exp, arms["s001"], "s001/0", 0)
    for step, value in ((1, 3.0), (2, math.nan), (3, 1.5)):
        store.log_metrics(pruned, step, {"val/loss": value})
    store.finish_run(pruned, status="pruned", summary={"val/loss": 1.5}, pruned=PRUNED)
    old = _run(store, exp, arms["s000"], "s000/1", 1)
    store.log_metrics(old, 1, {"val/loss": 9.0})
    store.finish_run(old, status="failed", error="boom")
    store.flush()
    store.supersede_run(old, "s000/1~old", None)

    store.add_trial(exp, 0, arms["s000"], {"lr": 0.01}, 0)
    store.add_trial(exp, 1, arms["s001"], {"lr": 0.1, "opt": "sgd"}, 0)
    store.add_trial(exp, 0, arms["s000"], {"lr": 0.01}, 0)  # again: nothing new
    store.tell_trial(exp, 1, told=0, value=1.5, state="pruned")
    store.tell_trial(exp, 0, told=1, value=0.25, state="complete")
    store.add_elimination(exp, arms["s001"], round=1, test="friedman", statistic=4.5,
                          p_value=0.0125, alpha=0.05, best="s000")  # fmt: skip
    store.add_elimination(exp, arms["s001"], round=2, test="t", statistic=1.0,
                          p_value=0.5, alpha=0.05, best="s000")  # fmt: skip  # kept: the first
    store.flush()
    return exp, arms


TRIALS = [
    {"number": 0, "arm": "s000", "params": {"lr": 0.01}, "asked_after": 0, "told": 1,
     "value": 0.25, "state": "complete", "intermediate": {}},
    {"number": 1, "arm": "s001", "params": {"lr": 0.1, "opt": "sgd"}, "asked_after": 0,
     "told": 0, "value": 1.5, "state": "pruned", "intermediate": {3: 1.5}},
]  # fmt: skip


def test_a_sweeps_trials_eliminations_and_pruned_runs_read_back_exactly(
    door: StoreAPI, store_url: str, tmp_path: Path
) -> None:
    _record_sweep(door)

    assert door.trials("search") == TRIALS
    (dropped,) = door.eliminations("search")
    assert isinstance(dropped.pop("created_at"), datetime)
    assert dropped == {"arm": "s001", "round": 1, "test": "friedman", "statistic": 4.5,
                       "p_value": 0.0125, "alpha": 0.05, "best": "s000"}  # fmt: skip
    points = door.metric_points("search", "val/loss")
    assert list(points) == ["s000/0", "s001/0"]  # the superseded run left out
    assert points["s000/0"] == [(1, 2.0), (2, 1.0), (3, 0.5), (4, 0.25)]
    assert points["s001/0"][0] == (1, 3.0) and points["s001/0"][2] == (3, 1.5)
    assert points["s001/0"][1][0] == 2 and math.isnan(points["s001/0"][1][1])
    assert door.metric_points("search", "nothing") == {}

    (listed,) = door.list_experiments()
    assert listed["runs_by_status"] == {"completed": 1, "pruned": 1}
    shown = door.get_experiment("search")
    assert {r["run_key"]: r["status"] for r in shown["runs"]} == {
        "s000/0": "completed",
        "s001/0": "pruned",
    }
    previous = door.previous_runs("search")
    assert {k: (r["status"], r["pruned"]) for k, r in previous.items()} == {
        "s000/0": ("completed", None),
        "s001/0": ("pruned", PRUNED),  # reused as it ended, its stop with it
    }

    con = lab.inspect.connect(store_url)
    try:
        rows = con.sql("SELECT run_key, status, pruned::VARCHAR FROM runs ORDER BY run_key")
        assert [(k, st, p if p is None else json.loads(p)) for k, st, p in rows.fetchall()] == [
            ("s000/0", "completed", None),
            ("s001/0", "pruned", PRUNED),
        ]
        trials = con.sql(
            "SELECT experiment, arm, number, params::VARCHAR, asked_after, told, value, state "
            "FROM sweep_trials ORDER BY number"
        ).fetchall()
        assert [(*t[:3], json.loads(t[3]), *t[4:]) for t in trials] == [
            ("search", "s000", 0, {"lr": 0.01}, 0, 1, 0.25, "complete"),
            ("search", "s001", 1, {"lr": 0.1, "opt": "sgd"}, 0, 0, 1.5, "pruned"),
        ]
        eliminated = con.sql(
            "SELECT experiment, arm, round, test, statistic, p_value, alpha, best_arm "
            "FROM eliminations"
        ).fetchall()
        assert eliminated == [("search", "s001", 1, "friedman", 4.5, 0.0125, 0.05, "s000")]
    finally:
        con.close()

    counts = lab.export.export("search", tmp_path / "out", store=store_url)
    assert (counts["sweep_trials"], counts["eliminations"]) == (2, 1)
    back = lab.inspect.connect(tmp_path / "out")
    try:
        assert back.sql("SELECT arm, number, state FROM sweep_trials ORDER BY number").fetchall() \
            == [("s000", 0, "complete"), ("s001", 1, "pruned")]  # fmt: skip
        assert back.sql("SELECT arm, best_arm FROM eliminations").fetchall() == [("s001", "s000")]
    finally:
        back.close()


def test_a_trial_asked_again_differently_or_told_unasked_is_refused(door: StoreAPI) -> None:
    exp, arms = _record_sweep(door)
    with pytest.raises(ConfigError, match=r"trial 0 of experiment \d+ is recorded with arm"):
        door.add_trial(exp, 0, arms["s001"], {"lr": 0.5}, 0)
    with pytest.raises(NoExperiment, match=r"has no trial 7; record it with add_trial"):
        door.tell_trial(exp, 7, told=2, value=1.0, state="complete")
    with pytest.raises(ConfigError, match="tell a number, or value=None with state='failed'"):
        door.tell_trial(exp, 0, told=2, value=math.nan, state="complete")
    assert door.trials("search") == TRIALS  # nothing changed


def test_trials_set_aside_are_kept_out_of_every_reader_and_free_their_numbers(
    door: StoreAPI, store_url: str, tmp_path: Path
) -> None:
    exp, arms = _record_sweep(door)
    assert door.supersede_trials("search") == 2
    assert door.trials("search") == []
    door.add_trial(exp, 0, arms["s001"], {"lr": 0.5}, 0)  # trial 0 anew, other params
    door.tell_trial(exp, 0, told=0, value=2.0, state="complete")
    new = {"number": 0, "arm": "s001", "params": {"lr": 0.5}, "asked_after": 0, "told": 0,
           "value": 2.0, "state": "complete", "intermediate": {3: 1.5}}  # fmt: skip
    assert door.trials("search") == [new]
    assert door.supersede_trials("search") == 1  # again: below the ones set aside before
    assert door.supersede_trials("search") == 0
    assert door.supersede_trials("nothing") == 0  # no such experiment: nothing to set aside
    door.flush()
    con = lab.inspect.connect(store_url)
    try:
        assert con.sql("SELECT count(*) FROM sweep_trials").fetchall() == [(0,)]
        kept = con.sql(
            "SELECT number, params::VARCHAR, told, value, state FROM store.sweep_trials "
            "ORDER BY number"
        ).fetchall()
        assert [(n, json.loads(p), *rest) for n, p, *rest in kept] == [
            (-3, {"lr": 0.5}, 0, 2.0, "complete"),
            (-2, {"lr": 0.1, "opt": "sgd"}, 0, 1.5, "pruned"),
            (-1, {"lr": 0.01}, 1, 0.25, "complete"),
        ]  # every trial kept
    finally:
        con.close()
    counts = lab.export.export("search", tmp_path / "out", store=store_url)
    assert counts["sweep_trials"] == 0


def test_a_pruned_record_must_be_whole_and_only_on_a_pruned_run(store_url: str) -> None:
    store = Store(store_url)
    try:
        exp = store.begin_experiment("e", config={}, seed=0, repeats=1)
        arm = store.add_arm(exp, "a", overrides={}, config={})
        run = _run(store, exp, arm, "a/0", 0)
        with pytest.raises(ConfigError, match="a run ended 'completed' carries no pruned record"):
            store.finish_run(run, status="completed", pruned=PRUNED)
        with pytest.raises(ConfigError, match="a pruned run's record is"):
            bad = {"step": "3", "rule": "median", "metric": "m", "value": 1.0}
            store.finish_run(run, status="pruned", pruned=bad)
        assert store.current_runs("e")[0]["status"] == "running"
        store.finish_run(run, status="pruned", pruned=PRUNED)
        # started again (a fresh attempt): the run is running with no pruned record
        group = store.add_group(exp, "a", arm_id=arm)
        again = store.start_run(exp, group, run_key="a/0", arm_id=arm, repeat=0, stage=0,
                                seed=0, config={}, output_dir=None)  # fmt: skip
        assert again == run
        with store.engine.connect() as conn:
            row = conn.exec_driver_sql("SELECT status, pruned FROM runs").one()
        assert tuple(row) == ("running", None)
    finally:
        store.close()


def test_only_the_token_that_owns_an_experiment_records_its_sweep(store_url: str) -> None:
    """The sweep's writes follow the owner rules of every write (`lab.server.owners`): a
    write token that did not create the experiment is refused (403), nothing stored."""
    server = serve(store_url)
    local = Store(store_url)
    try:
        other_token = create_token(local.engine, "other", "write")
        owner = HttpStore(server.url, token=server.write_token, heartbeat_s=3600.0)
        other = HttpStore(server.url, token=other_token, heartbeat_s=3600.0)
        try:
            exp = owner.begin_experiment("mine", config={}, seed=0, repeats=1)
            arm = owner.add_arm(exp, "s000", overrides={}, config={})
            refused = "experiment 'mine' belongs to token 'tests-write'"
            with pytest.raises(TokenRejected, match=refused):
                other.add_trial(exp, 0, arm, {}, 0)
            with pytest.raises(TokenRejected, match=refused):
                other.add_elimination(exp, arm, round=0, test="t", statistic=1.0,
                                      p_value=0.01, alpha=0.05, best="s001")  # fmt: skip
            owner.add_trial(exp, 0, arm, {}, 0)
            with pytest.raises(TokenRejected, match=refused):
                other.tell_trial(exp, 0, told=0, value=1.0, state="complete")
            assert local.trials("mine") == [
                {"number": 0, "arm": "s000", "params": {}, "asked_after": 0, "told": None,
                 "value": None, "state": "running", "intermediate": {}}
            ]  # fmt: skip
            assert local.eliminations("mine") == []
        finally:
            owner.close()
            other.close()
    finally:
        local.close()
        server.stop()


def test_a_pruned_run_is_finished_but_left_out_of_its_arms_values() -> None:
    """A rerun does not train a pruned run again (`FINISHED`), and an arm's values (what
    its summary is made of) leave its last value out, as `COUNTED_STATUSES` does."""
    from lab._ranking import COUNTED_STATUSES
    from lab.records import FINISHED, ArmResult, RunResult

    def run(repeat: int, status: str, loss: float) -> RunResult:
        return RunResult(f"a/{repeat}", "a", repeat, 0, repeat, status, {"loss": loss}, 1.0,
                         pruned=PRUNED if status == "pruned" else None)  # type: ignore[arg-type]  # fmt: skip

    arm = ArmResult("a", {}, [run(0, "completed", 0.5), run(1, "pruned", 9.0),
                              run(2, "stopped", 0.75)], planned=3)  # fmt: skip
    assert FINISHED == ("completed", "stopped", "pruned")
    assert COUNTED_STATUSES == ("completed", "stopped")
    assert arm.finished
    assert arm.values("loss") == [0.5, 0.75]
    assert arm.runs[1].pruned == PRUNED


def test_trials_set_aside_again_and_again_stay_within_the_column(door: StoreAPI) -> None:
    """The largest trial number a request may carry, set aside three times: its new
    number is its place, so it never leaves the column's 32-bit range."""
    exp = door.begin_experiment("wide", config={}, seed=0, repeats=1)
    arm = door.add_arm(exp, "s000", overrides={}, config={})
    for _ in range(3):
        door.add_trial(exp, 2**31 - 1, arm, {}, 0)
        assert door.supersede_trials("wide") == 1
    door.add_trial(exp, 2**31 - 1, arm, {}, 0)
    assert [t["number"] for t in door.trials("wide")] == [2**31 - 1]
