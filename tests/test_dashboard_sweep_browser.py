"""The dashboard's sweep page in headless Chromium, against a real `lab serve` over a real
race and a sampled sweep (`tests.sweep_site`): the lines drawn through the parameters carry
`lab.inspect.summary`'s means, the race's intervals and eliminations are the recorded ones,
pruned and failed arms are drawn apart, and a pruned run's curve is grey on the experiment's
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
from lab._stats import spread
from lab.store import Store
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
    # the race table: per arm and round, the spread of its repeats so far
    store = Store(site.store_url, readonly=True)
    try:
        finals: dict[str, list[float]] = {}
        for run in store.get_experiment(RACE_NAME)["runs"]:
            finals.setdefault(run["arm"], []).append(run["summary"]["val/loss"])
        eliminations = store.eliminations(RACE_NAME)
    finally:
        store.close()
    browser.find_element(By.CSS_SELECTOR, "#race details summary").click()
    rows = _rows(browser, "#race-table")
    assert len(rows) == 12
    for row in rows:
        arm, rnd = row.get_attribute("data-arm"), int(row.get_attribute("data-round"))
        got = values(row)
        s = spread(finals[arm][: rnd + 1])
        assert got[0:2] == [arm, rnd] and got[3:6] == [finals[arm][rnd], s.n, s.mean]
        assert got[6:8] == ([None, None] if s.n < 2 else [s.ci_low, s.ci_high])
        if rnd == 3:  # an arm's last round: lab.inspect.summary's figures
            assert got[5:8] == [summary[arm][2], summary[arm][4], summary[arm][5]]
        circle = browser.find_element(
            By.CSS_SELECTOR, f"#race-chart .race-arm[data-arm='{arm}'] circle[data-round='{rnd}']"
        )  # fmt: skip
        assert json.loads(circle.get_attribute("data-mean")) == s.mean
    # each elimination marked on the chart at its round, with its p-value, and listed
    marks = browser.find_elements(By.CSS_SELECTOR, "#race-chart .race-out")
    by_arm = {e["arm"]: e for e in eliminations}
    assert len(marks) == len(eliminations) == 2
    for mark in marks:
        arm = mark.find_element(By.XPATH, "..").get_attribute("data-arm")
        assert int(mark.get_attribute("data-round")) == by_arm[arm]["round"] == 3
        assert json.loads(mark.get_attribute("data-p")) == by_arm[arm]["p_value"]
    assert [values(r) for r in _rows(browser, "#eliminations-table")] == [
        [e["arm"], e["round"], e["test"], e["statistic"], e["p_value"], e["best"]]
        for e in sorted(eliminations, key=lambda e: list(RACE_ARMS).index(e["arm"]))
    ]
    assert browser.find_element(By.ID, "race-winner").text.startswith("Winner: fast · 4 rounds")
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
    assert [t.get_attribute("data-state") for t in _rows(browser, "#trials-table")] == [
        "complete", "complete", "pruned", "complete", "failed", "complete"
    ]  # fmt: skip
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
