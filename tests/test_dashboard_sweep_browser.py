"""The dashboard's sweep page in headless Chromium, against a real `lab serve` over a real
race and a sampled sweep (`tests.sweep_site`): the lines drawn through the parameters carry
`lab.inspect.summary`'s means, the race's rows, intervals, eliminations and winner drawn are
`lab.inspect.race`'s, the trials `lab.inspect.trials`'s, pruned and failed arms are drawn
apart, and a pruned run's curve is grey on the experiment's
curves. Helpers, the browser and the screenshots come from `tests.test_dashboard_browser`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

import lab.inspect
import tests.test_dashboard_browser as chromium
from tests.served import Served, serve
from tests.sweep_site import RACE_ARMS, RACE_NAME, SWEEP_NAME, TRIALS, record
from tests.test_dashboard_browser import (  # selenium's names: after that module's skip
    By,
    WebDriverWait,
    check_page,
    signed_in,
    values,
    wait_for,
)

browser = chromium.browser  # its fixtures: headless Chromium at 1000 px, the screenshots
shots = chromium.shots


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("sweep-browser")
    url = f"sqlite:///{folder / 'lab.db'}"
    record(url, folder / "runs")
    server = serve(url)
    try:
        yield server
    finally:
        server.stop()


def _url(site: Served, name: str, page: str = "") -> str:
    return f"{site.url}/experiments/{quote(name, safe='')}{page}"


def _summary(site: Served, name: str) -> dict[str, tuple]:
    con = lab.inspect.connect(site.store_url)
    rows = lab.inspect.summary(con, name, "val/loss", "min").fetchall()
    return {row[0]: row for row in rows}  # arm, n, mean, std, ci_low, ci_high, ...


def _rows(driver: Any, css: str) -> list[Any]:
    return driver.find_elements(By.CSS_SELECTOR, f"{css} tbody tr")


def test_the_race_page_draws_the_summary_the_rounds_and_the_eliminations(
    browser: Any, site: Served, shots: list[Path]
) -> None:
    signed_in(browser, site)
    browser.get(_url(site, RACE_NAME))
    wait_for(browser, "#to-sweep").click()
    wait_for(browser, "#race-chart")
    assert browser.find_element(By.ID, "sweep-name").text == f"Sweep of {RACE_NAME}"
    summary = _summary(site, RACE_NAME)
    # one line per arm through lr to its mean: lab.inspect's
    lines = browser.find_elements(By.CSS_SELECTOR, "#parcoords-chart path.pc-line")
    drawn = {p.get_attribute("data-arm"): json.loads(p.get_attribute("data-values")) for p in lines}
    assert drawn == {arm: [lr, summary[arm][2]] for arm, lr in RACE_ARMS.items()}
    axes = browser.find_elements(By.CSS_SELECTOR, "#parcoords-chart .pc-axis")
    assert [(a.get_attribute("data-axis"), a.get_attribute("data-scale")) for a in axes] == [
        ("lr", "log"), ("val/loss", "metric")
    ]  # fmt: skip
    # the race as lab.inspect.race gives it: per arm and round, its run and the spread of
    # its repeats so far, each elimination on its row
    con = lab.inspect.connect(site.store_url)
    relation = lab.inspect.race(con, RACE_NAME)
    race = [dict(zip(relation.columns, r, strict=True)) for r in relation.fetchall()]
    assert len(race) == 12 and sum(r["eliminated"] for r in race) == 2
    browser.find_element(By.CSS_SELECTOR, "#race details summary").click()
    rows = _rows(browser, "#race-table")
    assert [(r.get_attribute("data-arm"), int(r.get_attribute("data-round"))) for r in rows] == [
        (r["arm"], r["round"]) for r in race
    ]  # fmt: skip
    for row, want in zip(rows, race, strict=True):
        assert values(row) == [
            want["arm"], want["round"], None, want["value"], want["n"], want["mean"],
            want["ci_low"], want["ci_high"], want["p_value"],
        ]  # fmt: skip
        assert row.find_element(By.CSS_SELECTOR, ".status").text == want["status"]
        if want["round"] == 3:  # an arm's last round: lab.inspect.summary's figures
            got = [want["n"], want["mean"], want["ci_low"], want["ci_high"]]
            assert got == [summary[want["arm"]][i] for i in (1, 2, 4, 5)]
        at = f"#race-chart .race-arm[data-arm='{want['arm']}'] [data-round='{want['round']}']"
        circle = browser.find_element(By.CSS_SELECTOR, f"{at}.race-mean")
        assert json.loads(circle.get_attribute("data-mean")) == want["mean"]
        assert int(circle.get_attribute("data-n")) == want["n"]
        ci = browser.find_elements(By.CSS_SELECTOR, f"{at}.race-ci")
        drawn = [[json.loads(c.get_attribute(f"data-{end}")) for end in ("low", "high")]
                 for c in ci]  # fmt: skip
        assert drawn == ([] if want["n"] < 2 else [[want["ci_low"], want["ci_high"]]])
    # each elimination marked on the chart at its round, with its p-value, and listed
    out = [r for r in race if r["eliminated"]]
    marks = browser.find_elements(By.CSS_SELECTOR, "#race-chart .race-out")
    assert [(m.find_element(By.XPATH, "..").get_attribute("data-arm"),
             int(m.get_attribute("data-round")), json.loads(m.get_attribute("data-p")))
            for m in marks] == [(r["arm"], r["round"], r["p_value"]) for r in out]  # fmt: skip
    assert [values(r) for r in _rows(browser, "#eliminations-table")] == [
        [r["arm"], r["round"], r["test"], r["statistic"], r["p_value"], r["best"]] for r in out
    ]
    assert [r["arm"] for r in out] == ["slow", "<i>mid</i>"]
    (winner,) = {r["arm"] for r in race if r["winner"]}
    assert browser.find_element(By.ID, "race-winner").text == (
        f"Winner: {winner} · 4 of 5 rounds closed · 2 arms eliminated by the t test at alpha "
        "0.05 · 12 runs"
    )
    WebDriverWait(browser, 20).until(lambda d: _rows(d, "#importance-table"))
    assert [values(r)[:2] for r in _rows(browser, "#importance-table")] == [["lr", 1.0]]
    check_page(browser, "sweep-race", shots)


def test_the_sweep_page_draws_pruned_and_failed_arms_apart_and_their_importance(
    browser: Any, site: Served, shots: list[Path]
) -> None:
    signed_in(browser, site)
    browser.get(_url(site, SWEEP_NAME, "/sweep"))
    wait_for(browser, "#trials-table")
    lines = browser.find_elements(By.CSS_SELECTOR, "#parcoords-chart path.pc-line")
    states = {"completed": "complete", "pruned": "pruned", "failed": "failed"}
    assert [(p.get_attribute("data-arm"), p.get_attribute("data-state")) for p in lines] == [
        (f"s{i:03d}", states[status]) for i, (_p, status, _c) in enumerate(TRIALS)
    ]
    style = "const s = getComputedStyle(arguments[0]); return [s.stroke, s.strokeDasharray]"
    drawn = {p.get_attribute("data-state"): browser.execute_script(style, p) for p in lines}
    assert drawn["pruned"] == ["rgb(154, 160, 166)", "5px, 4px"]
    assert drawn["failed"] == ["rgb(180, 35, 24)", "1px, 4px"]
    assert drawn["complete"][1] == "none"
    axes = browser.find_elements(By.CSS_SELECTOR, "#parcoords-chart .pc-axis")
    assert [(a.get_attribute("data-axis"), a.get_attribute("data-scale")) for a in axes] == [
        ("lr", "log"), ("width", "linear"), ("opt", "choice"), ("momentum", "linear"),
        ("val/loss", "metric"),
    ]  # fmt: skip
    answer = httpx.get(
        f"{site.url}/api/v1/dashboard/experiments/{SWEEP_NAME}/importance",
        headers={"Authorization": f"Bearer {site.read_token}"},
    ).json()
    WebDriverWait(browser, 20).until(lambda d: _rows(d, "#importance-table"))
    shown = [values(r)[:2] for r in _rows(browser, "#importance-table")]
    assert shown == [[p["param"], p["importance"]] for p in answer["importance"]]
    assert [r["param"] for r in answer["importance"]] == ["lr", "width", "opt"]
    con = lab.inspect.connect(site.store_url)
    trials = lab.inspect.trials(con, SWEEP_NAME).fetchall()
    rows = _rows(browser, "#trials-table")
    assert [(r.get_attribute("data-arm"), r.get_attribute("data-state")) for r in rows] == [
        (arm, state) for _n, arm, _p, _v, state in trials
    ]
    keys = ["lr", "width", "opt", "momentum"]
    assert [values(r) for r in rows] == [
        [number, arm, None, *(json.loads(params).get(k) for k in keys), value]
        for number, arm, params, value, _state in trials
    ]
    assert [t[3:] for t in trials] == [
        (0.55, "complete"), (0.25, "complete"), (2.85, "pruned"), (0.4, "complete"),
        (None, "failed"), (0.45, "complete"),
    ]  # fmt: skip
    assert browser.find_element(By.ID, "race-none").text == (
        "This experiment ran no race: Experiment(race=Race(...)) runs one."
    )
    check_page(browser, "sweep-sampled", shots)
    # the experiment's curves: the pruned run's own line, grey and dashed
    browser.get(_url(site, SWEEP_NAME))
    chart = wait_for(browser, "#curve-chart[data-pruned='1']")
    pruned = browser.execute_script(
        "return document.getElementById('curve-chart').uplot.series"
        ".filter(s => s.role === 'pruned').map(s => s.label)"
    )
    assert pruned == ["s002-r0"]
    assert chart.get_attribute("data-arms") == "4"  # the pruned and failed arms have no mean
    assert "pruned runs" in browser.find_element(By.ID, "curve-legend").text
    check_page(browser, "sweep-curves", shots)
