"""The dashboard's sweep page API (`lab.server.dashboard_sweep`), on SQLite and PostgreSQL,
through the real app with a real read token, over a real race and a sampled sweep
(`tests.sweep_site`): each line's value is `lab.inspect.summary`'s mean, each round of the
race the interval of the repeats so far (its last round the summary's), the eliminations and
the winner the race's own, the importance Optuna's PED-ANOVA over the same trials."""

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
from lab._stats import spread
from lab.server import create_app
from lab.server.auth import create_token
from lab.server.dashboard_sweep import NO_OPTUNA
from lab.store import Store
from tests.postgres import new_database
from tests.sweep_site import (
    PRUNED,
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
    race: Any  # the race's ExperimentResult.race

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
        race = record(url, folder / "runs")
        writer = Store(url)
        try:
            token = create_token(writer.engine, "sweep-read", "read")
        finally:
            writer.close()
        store = Store(url, readonly=True)
        try:
            with TestClient(create_app(url), headers={"Authorization": f"Bearer {token}"}) as c:
                yield Site(url, c, token, store, race)
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
    trials = site.store.trials(SWEEP_NAME)
    assert [{k: t[k] for k in trials[0]} for t in sweep["trials"]] == [
        {**t, "intermediate": {str(k): v for k, v in t["intermediate"].items()}} for t in trials
    ]
    assert sweep["trials"][2]["intermediate"] == {"3": PRUNED["value"]}
    assert [(t["n"], t["mean"]) for t in sweep["trials"]] == [
        (1, 0.55), (1, 0.25), (0, None), (1, 0.4), (0, None), (1, 0.45)
    ]  # fmt: skip


def test_the_race_by_round_is_the_spread_of_the_repeats_so_far(site: Site) -> None:
    race = site.get(RACE_NAME, "sweep")["race"]
    finals: dict[str, list[float]] = {}
    for run in site.store.get_experiment(RACE_NAME)["runs"]:
        finals.setdefault(run["arm"], []).append(run["summary"]["val/loss"])
    assert {arm: len(v) for arm, v in finals.items()} == {"slow": 4, "<i>mid</i>": 4, "fast": 4}
    assert race["rounds"] == 4 and race["alpha"] == 0.05
    assert [(r["arm"], r["round"]) for r in race["table"]] == [
        (arm, r) for arm in RACE_ARMS for r in range(4)
    ]
    dropped = {e.arm: e for e in site.race.eliminations}
    for row in race["table"]:
        values = finals[row["arm"]][: row["round"] + 1]
        s = spread(values)
        assert (row["status"], row["value"]) == ("completed", values[-1])
        assert (row["n"], row["mean"]) == (s.n, s.mean)
        want = (None, None) if s.n < 2 else (s.ci_low, s.ci_high)
        assert (row["ci_low"], row["ci_high"]) == want
        gone = dropped.get(row["arm"])
        here = gone is not None and gone.round == row["round"]
        assert row["eliminated"] is here
        if here:
            assert (row["test"], row["statistic"], row["p_value"], row["best"]) == (
                gone.test, gone.statistic, gone.p_value, gone.best
            )  # fmt: skip
    summary = _summary(site.url, RACE_NAME)  # the last round of each arm: lab.inspect's
    for row in race["table"]:
        if row["round"] == 3:
            want = summary[row["arm"]]
            assert (row["n"], row["mean"], row["ci_low"], row["ci_high"]) == (
                want["n"], want["mean"], want["ci_low"], want["ci_high"]
            )  # fmt: skip
    assert [(e["arm"], e["round"], e["test"], e["statistic"], e["p_value"], e["alpha"],
             e["best"]) for e in race["eliminations"]] == [
        (e.arm, e.round, e.test, e.statistic, e.p_value, 0.05, e.best)
        for e in site.race.eliminations
    ]  # fmt: skip
    assert [e["arm"] for e in race["eliminations"]] == ["slow", "<i>mid</i>"]
    assert (race["survivors"], race["winner"]) == (site.race.survivors, site.race.winner)
    assert race["winner"] == "fast"


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
