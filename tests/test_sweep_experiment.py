"""Sampled arms in experiments: ``Experiment(sweep=Sweep(...))`` asks its arms from the
sweep's sampler in batches, records each as a trial before it runs, tells each trial its
arm's mean once the arm's runs have ended, and, run again after a SIGKILL of its process,
asks what the uninterrupted sweep would have asked and trains no run twice.

A run's score is a function of its arm's parameters and its seed, so every value is known;
the reference for a killed sweep is the same sweep run straight through.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest

from lab import Experiment, RunSpec, Sweep
from lab.errors import ConfigError
from lab.store import open_store
from lab.sweeps import Choice, Float, Race, Trial, make_sampler
from tests import warm
from tests.served import serve
from tests.store_rows import rows

SPACE = {"lr": Float(1e-3, 0.1, log=True), "opt": Choice(["adam", "sgd"])}
NOISE = [0.004, -0.006, 0.002, -0.003]  # each seed's luck


class Cfg(pydantic.BaseModel):
    lr: float = 0.01
    opt: str = "adam"
    kill_at: str = ""  # a run key: its process is SIGKILLed there, once


def score(params: dict[str, Any], seed: int) -> float:
    """A run's score: the arm's distance from lr=0.01 with adam, plus its seed's noise."""
    base = (math.log10(params["lr"]) + 2) ** 2 + (0.5 if params["opt"] == "sgd" else 0.0)
    return base + NOISE[seed % len(NOISE)] * (1 + params["lr"])


def train(run: RunSpec) -> dict[str, float]:
    """The run's score; notes each run trained in ``trained.jsonl``; the run named by
    `kill_at` SIGKILLs its process, once (a marker file remembers)."""
    cfg = run.config
    marker = run.dir.parent / "killed"
    if run.run_key == cfg.kill_at and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    with open(run.dir.parent / "trained.jsonl", "a") as f:
        f.write(json.dumps(run.run_key) + "\n")
    return {"score": score({"lr": cfg.lr, "opt": cfg.opt}, run.seed)}


def _experiment(name: str, folder: Path, store: str, **kwargs: Any) -> Experiment:
    kill_at = kwargs.pop("kill_at", "")
    sweep = kwargs.pop("sweep", None) or Sweep(SPACE, sampler="random", arms=4, seed=0,
                                               metric="score")  # fmt: skip
    return Experiment(name, train, base_config=Cfg(kill_at=kill_at), store=store,
                      output_dir=folder, sweep=sweep, **kwargs)  # fmt: skip


def drive(name: str, folder: str, store: str, sweep: str, kill_at: str) -> None:
    """Run a sweep in this process (the driver a test SIGKILLs), as `_kill_and_rerun` says."""
    kwargs = json.loads(sweep)
    race = kwargs.pop("race", None)
    _experiment(name, Path(folder), store, kill_at=kill_at,
                sweep=Sweep(SPACE, metric="score", **kwargs),
                race=Race(**race) if race else None).run()  # fmt: skip


def _trained(folder: Path) -> list[str]:
    path = folder / "trained.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _trials(store: str, name: str) -> list[tuple[Any, ...]]:
    opened = open_store(store)
    try:
        return [
            (t["number"], t["arm"], t["params"], t["asked_after"], t["told"], t["value"],
             t["state"])
            for t in opened.trials(name)
        ]  # fmt: skip
    finally:
        opened.close()


def _straight(sampler: str, n: int, batch: int, repeats: int) -> list[tuple[Any, ...]]:
    """The trials of a sweep asked `batch` at a time, each told as soon as its runs end
    (one at a time), as a serial experiment does: the reference, computed without lab's
    engine."""
    history: list[Trial] = []
    told = 0
    asker = make_sampler(sampler, dict(SPACE), seed=0, mode="min")
    while len(history) < n:
        asked = asker.ask(history, min(batch, n - len(history)))
        history += [Trial(len(history) + i, p, asked_after=told) for i, p in enumerate(asked)]
        for t in history[-len(asked) :]:
            value = sum(score(t.params, seed) for seed in range(repeats)) / repeats
            history[t.number] = Trial(t.number, t.params, t.asked_after, told, value, "complete")
            told += 1
    return [(t.number, f"s{t.number:03d}", t.params, t.asked_after, t.told, t.value, t.state)
            for t in history]  # fmt: skip


@pytest.mark.parametrize("door", ["store", "http"])
def test_a_serial_sweep_asks_runs_and_tells_each_arm(
    tmp_path: Path,
    store_url: str,
    door: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target = store_url
    if door == "http":  # through a real lab serve in front of the store
        served = request.getfixturevalue("served")
        monkeypatch.setenv("LAB_TOKEN", served.write_token)
        target = served.url
    sweep = Sweep(SPACE, sampler="tpe", arms=4, seed=0, metric="score")
    result = _experiment("sw", tmp_path, target, sweep=sweep, repeats=2).run()
    expected = _straight("tpe", 4, 1, 2)
    assert _trials(store_url, "sw") == expected
    assert [(a.name, a.overrides, [r.run_key for r in a.runs]) for a in result.arms] == [
        (t[1], t[2], [f"{t[1]}-r0", f"{t[1]}-r1"]) for t in expected
    ]
    assert _trained(tmp_path / "sw") == [f"s00{i}-r{r}" for i in range(4) for r in range(2)]
    opened = open_store(store_url)
    try:
        record = opened.get_experiment("sw")
    finally:
        opened.close()
    assert [(a["name"], a["overrides"]) for a in record["arms"]] == [(t[1], t[2]) for t in expected]
    assert sorted((r["run_key"], r["status"]) for r in record["runs"]) == [
        (f"s00{i}-r{r}", "completed") for i in range(4) for r in range(2)
    ]
    assert record["config"]["sweep"] == {
        "space": {"lr": {"float": [0.001, 0.1], "log": True}, "opt": {"choice": ["adam", "sgd"]}},
        "sampler": "tpe", "arms": 4, "seed": 0, "batch": None, "metric": "score", "mode": None,
    }  # fmt: skip
    assert (result.planned, result.summary().metric) == (8, "score")


def test_a_batch_is_asked_when_the_workers_run_out_of_arms(tmp_path: Path) -> None:
    db = tmp_path / "lab.db"
    store = f"sqlite:///{db}"
    sweep = Sweep(SPACE, sampler="random", arms=5, seed=0, metric="score", batch=3)
    _experiment("batch", tmp_path, store, sweep=sweep).run()
    # 3 asked up front; 2 more once the three were told (a serial experiment: one worker)
    assert rows(db, "SELECT number, asked_after, told, state FROM sweep_trials") == [
        (0, 0, 0, "complete"), (1, 0, 1, "complete"), (2, 0, 2, "complete"),
        (3, 3, 3, "complete"), (4, 3, 4, "complete"),
    ]  # fmt: skip
    assert _trials(store, "batch") == _straight("random", 5, 3, 1)


def test_under_a_pool_an_arm_is_asked_as_each_worker_frees(tmp_path: Path) -> None:
    db = tmp_path / "lab.db"
    store = f"sqlite:///{db}"
    sweep = Sweep(SPACE, sampler="random", arms=5, seed=0, metric="score")
    result = _experiment("pool", tmp_path, store, sweep=sweep, executor="processes",
                         workers=2).run()  # fmt: skip
    # two at once, then one as each run ends, each asked after the tells so far
    assert rows(db, "SELECT number, asked_after FROM sweep_trials") == [
        (0, 0), (1, 0), (2, 1), (3, 2), (4, 3)
    ]  # fmt: skip
    assert sorted(r[0] for r in rows(db, "SELECT told FROM sweep_trials")) == [0, 1, 2, 3, 4]
    expected = {t[1]: (t[2], t[5]) for t in _straight("random", 5, 1, 1)}
    assert {t[1]: (t[2], t[5]) for t in _trials(store, "pool")} == expected
    assert sorted(_trained(tmp_path / "pool")) == [f"s00{i}-r0" for i in range(5)]
    assert [a.name for a in result.arms] == ["s000", "s001", "s002", "s003", "s004"]
    assert rows(db, "SELECT run_key, status FROM runs ORDER BY run_key") == [
        (f"s00{i}-r0", "completed") for i in range(5)
    ]


def _kill_and_rerun(tmp_path: Path, sweep: dict[str, Any], kill_at: str) -> tuple[Path, str]:
    """Run the sweep in a subprocess that SIGKILLs itself at run `kill_at`, then run it
    again here; returns the store file and URL."""
    db = tmp_path / "lab.db"
    store = f"sqlite:///{db}"
    # imported as pytest imported this module, so the train function keeps its name
    code = f"import sys; from {train.__module__} import drive; drive(*sys.argv[1:])"
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here)])}
    done = warm.run(
        [sys.executable, "-c", code, "kill", str(tmp_path), store, json.dumps(sweep), kill_at],
        env=env, timeout=300, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert (tmp_path / "kill" / "killed").exists()
    drive("kill", str(tmp_path), store, json.dumps(sweep), kill_at)
    return db, store


def test_a_killed_tpe_sweep_run_again_asks_what_the_straight_sweep_asked(
    tmp_path: Path,
) -> None:
    # TPE's first 10 arms are its random start-up: killed at the 13th, the rebuilt model asks
    sweep = {"sampler": "tpe", "arms": 14, "seed": 0}
    db, store = _kill_and_rerun(tmp_path, sweep, kill_at="s012-r0")
    assert _trials(store, "kill") == _straight("tpe", 14, 1, 1)
    trained = _trained(tmp_path / "kill")
    assert trained == [f"s{i:03d}-r0" for i in range(14)]  # each once: s012 after the kill
    assert rows(
        db, "SELECT run_key, status FROM runs WHERE superseded_at IS NULL ORDER BY run_key"
    ) == [(f"s{i:03d}-r0", "completed") for i in range(14)]
    assert rows(db, "SELECT COUNT(*) FROM sweep_trials") == [(14,)]


def test_a_killed_raced_sweep_run_again_ends_as_the_straight_one(tmp_path: Path) -> None:
    race = {"metric": "score", "mode": "min", "alpha": 0.05, "min_repeats": 2,
            "max_repeats": 4, "test": "t"}  # fmt: skip
    sweep = {"sampler": "random", "arms": 4, "seed": 0, "race": race}
    straight_folder = tmp_path / "straight"
    drive("kill", str(straight_folder), f"sqlite:///{tmp_path / 'straight.db'}",
          json.dumps(sweep), "")  # fmt: skip
    expected_runs = rows(tmp_path / "straight.db", "SELECT run_key, status FROM runs ORDER BY "
                                                   "run_key")  # fmt: skip
    expected_trials = _trials(f"sqlite:///{tmp_path / 'straight.db'}", "kill")
    expected_drops = rows(tmp_path / "straight.db", "SELECT arm_id, round, test FROM eliminations")
    assert expected_drops  # the race drops an arm: it ran fewer than 4 x 4 runs
    assert len(expected_runs) < 16
    db, store = _kill_and_rerun(tmp_path / "killed", sweep, kill_at="s002-r1")  # mid-round 1
    assert _trials(store, "kill") == expected_trials
    assert rows(db, "SELECT run_key, status FROM runs ORDER BY run_key") == expected_runs
    assert rows(db, "SELECT arm_id, round, test FROM eliminations") == expected_drops
    trained = _trained(tmp_path / "killed" / "kill")
    assert sorted(trained) == sorted(key for key, _ in expected_runs)  # none twice
    # every trial is told its arm's race mean, asked all up front (after no tell)
    means = {}
    for key, _ in expected_runs:
        arm, repeat = key.split("-r")
        means.setdefault(arm, []).append(score(_params(expected_trials, arm), int(repeat)))
    assert [(t[1], t[3], t[5], t[6]) for t in expected_trials] == [
        (arm, 0, pytest.approx(sum(v) / len(v), rel=1e-12), "complete")
        for arm, v in sorted(means.items())
    ]


def _params(trials: list[tuple[Any, ...]], arm: str) -> dict[str, Any]:
    return next(t[2] for t in trials if t[1] == arm)


def test_a_sweep_run_again_with_another_sampler_or_seed_is_refused(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'lab.db'}"
    _experiment("sw", tmp_path, store).run()
    before = _trained(tmp_path / "sw")
    other = Sweep(SPACE, sampler="sobol", arms=4, seed=1, metric="score")
    again = _experiment("sw", tmp_path, store, sweep=other)
    with pytest.raises(ConfigError) as err:
        again.run()
    assert str(err.value) == (
        "experiment 'sw' recorded a sweep with another space, sampler or seed (sampler: "
        '"random" -> "sobol"; seed: 0 -> 1); its trials were asked by that sweep: use a new '
        "experiment name, or start afresh with fresh=True (--fresh on the command line)"
    )
    assert _trained(tmp_path / "sw") == before  # nothing ran
    # run again as it was: every arm finished, nothing is asked or trained
    result = _experiment("sw", tmp_path, store).run()
    assert _trained(tmp_path / "sw") == before
    assert [a.name for a in result.arms] == ["s000", "s001", "s002", "s003"]
    assert len(_trials(store, "sw")) == 4


@pytest.mark.parametrize("door", ["store", "http"])
def test_a_sweep_run_again_fresh_with_another_seed_asks_and_records_the_new_sweep(
    tmp_path: Path, door: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fresh=True`` sets the recorded trials aside as it supersedes the runs: kept in the
    database (numbered below zero), left out of `trials()`; the new sweep asks from trial 0."""
    db = tmp_path / "lab.db"
    served = serve(f"sqlite:///{db}") if door == "http" else None
    url = served.url if served is not None else f"sqlite:///{db}"
    if served is not None:  # through a real lab serve in front of the store
        monkeypatch.setenv("LAB_TOKEN", served.write_token)
    try:
        _experiment("sw", tmp_path, url).run()
        old = _trials(url, "sw")
        other = Sweep(SPACE, sampler="random", arms=3, seed=1, metric="score")
        result = _experiment("sw", tmp_path, url, sweep=other, fresh=True).run()
        new = _trials(url, "sw")
    finally:
        if served is not None:
            served.stop()
    assert new == _straight_seeded(1, 3)
    assert [r.status for r in result.runs] == ["completed"] * 3
    assert [r.seconds > 0 for r in result.runs] == [True] * 3  # trained afresh, none reused
    kept = rows(db, "SELECT number, asked_after, told, value, state FROM sweep_trials "
                    "WHERE number < 0 ORDER BY number DESC")  # fmt: skip
    assert kept == [(-1 - t[0], t[3], t[4], t[5], t[6]) for t in old]  # every old trial kept
    assert rows(db, "SELECT count(*) FROM runs WHERE superseded_at IS NOT NULL") == [(4,)]


def _straight_seeded(seed: int, n: int) -> list[tuple[Any, ...]]:
    """The trials of a serial random sweep of `n` arms and `seed` (one repeat each)."""
    asker = make_sampler("random", dict(SPACE), seed=seed, mode="min")
    trials: list[Trial] = []
    for number in range(n):
        (params,) = asker.ask(trials, 1)
        trials.append(Trial(number, params, number, number, score(params, 0), "complete"))
    return [(t.number, f"s{t.number:03d}", t.params, t.asked_after, t.told, t.value, t.state)
            for t in trials]  # fmt: skip


def test_a_sweep_refuses_written_out_arms_and_a_missing_metric() -> None:
    from lab import Arm

    with pytest.raises(ConfigError, match=r"^arms and sweep given: a sweep's arms are sampled"):
        Experiment("x", train, arms=[Arm("a")], sweep=Sweep(SPACE, metric="score"))
    with pytest.raises(ConfigError) as err:
        Experiment("x", train, sweep=Sweep(SPACE))
    assert str(err.value) == (
        "a sweep needs the metric its arms are judged by: Sweep(..., metric='val/loss'), or "
        "Experiment(metric=...)"
    )
