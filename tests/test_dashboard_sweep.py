"""The dashboard's sweep page API (`lab.server.dashboard_sweep`), on SQLite and PostgreSQL,
through the real app with a real read token, over a real race, a sampled sweep and a race
with a round open (`tests.sweep_site`): each line's value is `lab.inspect.summary`'s mean;
the race and the trials are the same figures at every door (the experiment's own result and
summary, `lab.inspect.race`/`trials`, ``lab show`` and the page's JSON); the importance is
Optuna's PED-ANOVA over the same trials."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient

import lab.inspect
from lab._show import race_text, trials_text
from lab._stats import spread
from lab._table import fmt
from lab.server import create_app
from lab.server.auth import create_token
from lab.server.dashboard_sweep import NO_OPTUNA
from lab.store import Store
from tests.postgres import new_database
from tests.sweep_site import (
    OPEN,
    OPEN_NAME,
    RACE_ARMS,
    RACE_NAME,
    SWEEP_NAME,
    TRIALS,
    record,
)

API = "/api/v1/dashboard"


@dataclass
class Site:
    url: str
    client: TestClient
    token: str
    store: Store
    result: Any  # the race's ExperimentResult, as its run returned it

    def get(self, experiment: str, what: str, **params: Any) -> Any:
        answer = self.client.get(f"{API}/experiments/{quote(experiment, safe='')}/{what}",
                                 params=params)  # fmt: skip
        assert answer.status_code == 200, answer.text
        return answer.json()


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def site(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Site]:
    folder = tmp_path_factory.mktemp("sweep-page")
    with new_database() if request.param == "postgres" else _sqlite(folder) as url:
        result = record(url, folder / "runs")
        writer = Store(url)
        try:
            token = create_token(writer.engine, "sweep-read", "read")
        finally:
            writer.close()
        store = Store(url, readonly=True)
        try:
            with TestClient(create_app(url), headers={"Authorization": f"Bearer {token}"}) as c:
                yield Site(url, c, token, store, result)
        finally:
            store.close()


class _sqlite:
    def __init__(self, folder: Path) -> None:
        self.url = f"sqlite:///{folder / 'lab.db'}"

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc: object) -> None:
        return None


def _summary(url: str, experiment: str) -> dict[str, dict[str, Any]]:
    con = lab.inspect.connect(url)
    relation = lab.inspect.summary(con, experiment, "val/loss", "min")
    return {row[0]: dict(zip(relation.columns, row, strict=True)) for row in relation.fetchall()}


def test_each_line_is_an_arm_through_its_params_to_the_summary_mean(site: Site) -> None:
    page = site.get(RACE_NAME, "sweep")
    assert (page["name"], page["metric"], page["mode"]) == (RACE_NAME, "val/loss", "min")
    # explicit arms: the axes from the overrides' values (lr spans two decades: log)
    assert page["axes"] == [
        {"name": "lr", "kind": "float", "log": True, "low": 0.001, "high": 0.2, "choices": None}
    ]
    summary = _summary(site.url, RACE_NAME)
    assert [line["arm"] for line in page["lines"]] == list(RACE_ARMS)
    for line in page["lines"]:
        want = summary[line["arm"]]
        assert (line["value"], line["n"]) == (want["mean"], want["n"])
        assert line["params"] == {"lr": RACE_ARMS[line["arm"]]}
        assert (line["number"], line["state"]) == (None, "complete")
    assert [line["eliminated"] for line in page["lines"]] == [3, 3, None]
    assert page["trials"] == []

    sweep = site.get(SWEEP_NAME, "sweep")
    assert sweep["axes"] == [  # as the recorded space declares them
        {"name": "lr", "kind": "float", "log": True, "low": 0.0001, "high": 0.1, "choices": None},
        {"name": "width", "kind": "int", "log": False, "low": 16, "high": 256, "choices": None},
        {"name": "opt", "kind": "choice", "log": False, "low": None, "high": None,
         "choices": ["adam", "sgd"]},
        {"name": "momentum", "kind": "float", "log": False, "low": 0.0, "high": 0.99,
         "choices": None},
    ]  # fmt: skip
    states = {"completed": "complete", "pruned": "pruned", "failed": "failed"}
    assert sweep["lines"] == [
        {"arm": f"s{i:03d}", "number": i, "params": params,
         "value": curve[-1] if status == "completed" else None,
         "n": 1 if status == "completed" else 0, "state": states[status], "eliminated": None}
        for i, (params, status, curve) in enumerate(TRIALS)
    ]  # fmt: skip
    assert sweep["trials"] == [  # as the sampler was told: a pruned arm its last value
        {"number": i, "arm": f"s{i:03d}", "params": params, "state": states[status],
         "value": None if status == "failed" else curve[-1]}
        for i, (params, status, curve) in enumerate(TRIALS)
    ]  # fmt: skip
    assert sweep["race"] is None  # it ran no race


def _lab(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "lab.cli", *args], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_door_shows_the_same_race(site: Site) -> None:
    page = site.get(RACE_NAME, "sweep")
    race = page["race"]
    result = site.result  # what the experiment's run returned
    finals = {arm.name: [r.metrics["val/loss"] for r in arm.runs] for arm in result.arms}
    assert {arm: len(v) for arm, v in finals.items()} == {"slow": 4, "<i>mid</i>": 4, "fast": 4}
    # ExperimentResult.race: the rounds, each elimination, who survived and won
    dropped = [(e.arm, e.round, e.test, e.statistic, e.p_value, 0.05, e.best)
               for e in result.race.eliminations]  # fmt: skip
    assert [tuple(e.values()) for e in race["eliminations"]] == dropped
    assert [e[:3] + e[-2:] for e in dropped] == [
        ("slow", 3, "t", 0.05, "fast"), ("<i>mid</i>", 3, "t", 0.05, "fast")
    ]  # fmt: skip
    assert (race["rounds"], race["survivors"], race["winner"], race["over"]) == (
        result.race.rounds, result.race.survivors, result.race.winner, result.race.over
    ) == (4, ["fast"], "fast", True)  # fmt: skip
    assert (race["race"]["alpha"], race["race"]["test"], race["runs"], race["pruned"]) == (
        0.05, "t", 12, 0
    )  # fmt: skip
    # each arm per round: its run, and the spread of its repeats so far
    assert [(r["arm"], r["round"]) for r in race["rows"]] == [
        (arm, r) for arm in RACE_ARMS for r in range(4)
    ]
    for row in race["rows"]:
        s = spread(finals[row["arm"]][: row["round"] + 1])
        assert row == {
            "arm": row["arm"], "round": row["round"], "status": "completed",
            "value": finals[row["arm"]][row["round"]], "n": s.n, "mean": s.mean,
            "ci_low": None if s.n < 2 else s.ci_low, "ci_high": None if s.n < 2 else s.ci_high,
            "eliminated": row["arm"] != "fast" and row["round"] == 3,
        }  # fmt: skip
    # ExperimentResult.summary(): each arm's last round, and its line on the page
    summary = {r.arm: r for r in result.summary("val/loss", "min").rows if r.metric == "val/loss"}
    last = {row["arm"]: row for row in race["rows"] if row["round"] == 3}
    for line in page["lines"]:
        want = summary[line["arm"]]
        got = last[line["arm"]]
        assert (got["n"], got["mean"], got["ci_low"], got["ci_high"]) == (
            want.n, want.mean, want.ci_low, want.ci_high
        )  # fmt: skip
        assert (line["value"], line["n"]) == (want.mean, want.n)
    # lab.inspect.race: the same rows, each dropped one with its elimination
    con = lab.inspect.connect(site.url)
    relation = lab.inspect.race(con, RACE_NAME)
    out = {e["arm"]: e for e in race["eliminations"]}
    assert [dict(zip(relation.columns, r, strict=True)) for r in relation.fetchall()] == [
        {**row, **{k: out[row["arm"]][k] if row["eliminated"] else None
                   for k in ("test", "statistic", "p_value", "alpha", "best")},
         "winner": row["arm"] == "fast"}
        for row in race["rows"]
    ]  # fmt: skip
    # lab show: the race table as it prints it, its cells the figures above
    shown = _lab("show", RACE_NAME, "--store", site.url)
    assert race_text(race) in shown
    lines = shown[shown.index("race by val/loss") :].splitlines()
    assert lines[0] == (
        "race by val/loss (min), t test at alpha 0.05: 4 of 5 rounds closed, 1 of 3 arms left, "
        "over, winner fast"
    )
    for arm, text in zip(RACE_ARMS, lines[2:5], strict=True):
        cells = [c.strip() for c in text.split("  ") if c.strip()]
        want = []
        for r in range(4):
            s = spread(finals[arm][: r + 1])
            cell = fmt(s.mean) + (f" [{fmt(s.ci_low)}, {fmt(s.ci_high)}]" if s.n > 1 else "")
            want.append(cell + (" x" if arm != "fast" and r == 3 else ""))
        status = "winner" if arm == "fast" else "out after round 3"
        assert cells == [arm, status, *want]
    assert [line.split()[:3] for line in lines[8:10]] == [
        ["slow", "3", "t"], ["<i>mid</i>", "3", "t"]
    ]  # fmt: skip


def test_every_door_shows_the_same_trials(site: Site) -> None:
    trials = site.get(SWEEP_NAME, "sweep")["trials"]
    con = lab.inspect.connect(site.url)
    assert lab.inspect.trials(con, SWEEP_NAME).fetchall() == [
        (t["number"], t["arm"], json.dumps(t["params"]), t["value"], t["state"]) for t in trials
    ]
    assert [(t["value"], t["state"]) for t in trials] == [
        (0.55, "complete"), (0.25, "complete"), (2.85, "pruned"), (0.4, "complete"),
        (None, "failed"), (0.45, "complete"),
    ]  # fmt: skip
    shown = _lab("show", SWEEP_NAME, "--store", site.url)
    assert trials_text(trials) in shown
    assert '2      s002  {"lr": 0.0002, "width": 16, "opt": "adam"}' in shown


def test_a_round_still_open_shows_nothing_and_there_is_no_winner_yet(site: Site) -> None:
    page = site.get(OPEN_NAME, "sweep")
    race = page["race"]
    assert race["rows"] == [  # round 1 is open: b's run of it still runs
        {"arm": arm, "round": 0, "status": "completed", "value": OPEN[arm][0], "n": 1,
         "mean": OPEN[arm][0], "ci_low": None, "ci_high": None, "eliminated": False}
        for arm in OPEN
    ]  # fmt: skip
    assert (race["rounds"], race["over"], race["winner"], race["survivors"], race["runs"]) == (
        1, False, None, ["a", "b"], 3
    )  # fmt: skip
    # the lines are the summaries of every counted run so far
    assert [(line["arm"], line["n"], line["value"], line["state"]) for line in page["lines"]] == [
        ("a", 2, spread(OPEN["a"]).mean, "complete"), ("b", 1, 0.9, "complete")
    ]  # fmt: skip
    shown = _lab("show", OPEN_NAME, "--store", site.url)
    assert race_text(race) in shown
    assert "1 of 5 rounds closed, 2 of 2 arms left, running" in shown


def _ped_anova(mode: str, rows: list[tuple[dict[str, Any], float]], dists: dict) -> list:
    import optuna
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances

    study = optuna.create_study(direction="minimize" if mode == "min" else "maximize")
    for params, value in rows:
        study.add_trial(optuna.trial.create_trial(
            params={k: params[k] for k in dists}, distributions=dists, value=value))  # fmt: skip
    found = get_param_importances(study, evaluator=PedAnovaImportanceEvaluator())
    return [{"param": k, "importance": v} for k, v in found.items()]


def test_the_importance_is_optunas_ped_anova_over_the_complete_arms(site: Site) -> None:
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    got = site.get(SWEEP_NAME, "importance")
    done = [(p, curve[-1]) for p, status, curve in TRIALS if status == "completed"]
    dists = {"lr": FloatDistribution(1e-4, 0.1, log=True), "width": IntDistribution(16, 256),
             "opt": CategoricalDistribution(["adam", "sgd"])}  # momentum: sgd's alone  # fmt: skip
    assert got == {"metric": "val/loss", "mode": "min", "method": "ped-anova", "arms": 4,
                   "importance": _ped_anova("min", done, dists), "unavailable": None}  # fmt: skip
    assert math.isclose(sum(p["importance"] for p in got["importance"]), 1.0)
    race = site.get(RACE_NAME, "importance")
    assert (race["arms"], race["importance"]) == (3, [{"param": "lr", "importance": 1.0}])


def test_pruned_runs_curves_carry_their_status_and_stay_out_of_the_arms(site: Site) -> None:
    curves = site.get(SWEEP_NAME, "curves", metric="val/loss", buckets=1000, runs=True)
    assert [(r["run_key"], r["status"]) for r in curves["runs"]] == [
        ("s000-r0", "completed"), ("s001-r0", "completed"), ("s002-r0", "pruned"),
        ("s003-r0", "completed"), ("s004-r0", "failed"), ("s005-r0", "completed"),
    ]  # fmt: skip
    pruned = curves["runs"][2]
    assert (pruned["step"], pruned["last"]) == ([1, 2, 3], TRIALS[2][2])
    assert [a["arm"] for a in curves["arms"]] == ["s000", "s001", "s003", "s005"]


def test_unknown_experiments_are_refused_and_markup_is_text(site: Site) -> None:
    answer = site.client.get(f"{API}/experiments/nope/sweep")
    assert answer.status_code == 404
    assert answer.json()["detail"].startswith("no experiment named 'nope' in the store; known:")
    assert site.client.get(f"{API}/experiments/nope/importance").status_code == 404
    raw = site.client.get(f"{API}/experiments/{quote(RACE_NAME, safe='')}/sweep").text
    assert '"<i>mid</i>"' in raw and '"race <b>"' in raw  # JSON text, as stored
    assert site.client.get(f"{API}/experiments/{quote(SWEEP_NAME)}/sweep",
                           headers={"Authorization": ""}).status_code == 401  # fmt: skip


_NO_OPTUNA = """
import json, sys
sys.modules["optuna"] = None  # the server was installed without lab[sweeps]
from fastapi.testclient import TestClient
from lab.server import create_app
with TestClient(create_app(sys.argv[1]), headers={"Authorization": "Bearer " + sys.argv[2]}) as c:
    got = [c.get("/api/v1/dashboard/experiments/search/" + w) for w in ("importance", "sweep")]
print(json.dumps([[a.status_code, a.json()] for a in got]))
"""


def test_without_optuna_the_importance_says_what_to_install_and_the_page_works(
    site: Site,
) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", _NO_OPTUNA, site.url, site.token], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    (code, importance), (page_code, page) = json.loads(done.stdout)
    assert (code, importance["importance"], importance["unavailable"]) == (200, [], NO_OPTUNA)
    assert NO_OPTUNA == (
        "per-parameter importance needs Optuna on the server: pip install 'lab[sweeps]'"
    )
    assert (page_code, page) == (200, site.get(SWEEP_NAME, "sweep"))
