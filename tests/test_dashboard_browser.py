"""The dashboard in a real browser: headless Chromium (the distribution's ``chromium`` and
``chromium-driver``) driven by Selenium, against a real `lab serve` over a store that a real
experiment filled: 2 arms x 2 repeats of a small torch regression, one run failed, an
evaluator that stores predictions, breakdowns and tags, and ``<script>`` in the
experiment's name, a config value and a prediction's input.

The tests click through as a person does (experiment -> arm table -> curve -> run ->
predictions) and check what a person checks: the numbers equal `lab.inspect`'s, the curve
has one series per arm, a failed run shows its error, stored markup is text, bad URLs give
the 404 page. Each page is saved as a PNG (under the tests' own folder, and under
``$LAB_SCREENSHOTS`` when it is set), must fit 1000 px without a horizontal scroll bar, and
must log no console error. Under ``CI=true`` a missing browser fails instead of skipping.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pydantic
import pytest
import torch

import lab.inspect
from lab import Arm, Evaluator, Experiment, LoopArtifacts, RunHandle
from lab.loop import CheckpointConfig
from lab.records import EvalResult, RunSpec
from lab.server.app import LOCAL_ONLY
from lab.store import Store
from tests import warm
from tests.served import Served, free_port, serve

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WIDTH = 1000
#: Markup in every place a person can type text: shown as text, never run.
SCRIPT = '<script>alert("lab")</script><img src=x onerror=alert(2)>'
NAME = f"dash {SCRIPT}"
ARMS = ("slow", "fast")
FAILED = "fast-r1"
ERROR = "diverged: <b>loss</b> went to inf"
EXAMPLES = 12

if shutil.which(CHROMIUM) is None or shutil.which(CHROMEDRIVER) is None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {CHROMIUM} or {CHROMEDRIVER} is missing; .ci/run installs "
                    "chromium and chromium-driver", pytrace=False)  # fmt: skip
    pytest.skip("Chromium and its driver are not installed", allow_module_level=True)

if os.environ.get("CI", "").lower() == "true":
    from selenium import webdriver  # under CI a missing selenium fails, never skips
else:
    webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import (  # noqa: E402
    NoAlertPresentException,
    StaleElementReferenceException,
)
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402


class Config(pydantic.BaseModel):
    lr: float = 0.05
    steps: int = 40
    note: str = SCRIPT


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.linspace(-1, 1, 4).unsqueeze(1)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 4, generator=gen)
    return x, x @ weight + 0.05 * torch.randn(64, 1, generator=gen)


def _mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def holdout(model: torch.nn.Module) -> EvalResult:
    """The same examples for every run, one prediction each (the first one's input is
    markup), with a breakdown by the sign of the target and two tags."""
    x, y = _data(seed=999)
    x, y = x[:EXAMPLES], y[:EXAMPLES]
    with torch.no_grad():
        out = model(x)
    hit = ((out - y).abs() < 0.3).float().squeeze(1)
    positive = (y > 0).squeeze(1)
    rows = [
        {
            "example_id": f"e{i:02d}",
            "input": SCRIPT if i == 0 else f"x{i}",
            "output": round(out[i, 0].item(), 3),
            "target": round(y[i, 0].item(), 3),
            "score": hit[i].item(),
        }
        for i in range(EXAMPLES)
    ]
    return EvalResult(
        "holdout",
        {"acc": hit.mean().item()},
        breakdowns={
            "positive": {"acc": hit[positive].mean().item()},
            "negative": {"acc": hit[~positive].mean().item()},
        },
        tags={"examples": EXAMPLES},
        predictions=rows,
    )


def train(run: RunSpec) -> LoopArtifacts:
    """Forty SGD steps with a val eval every ten, a checkpoint every ten (the newest kept),
    and a histogram and an image of the weights at steps 20 and 40."""
    if run.run_key == FAILED:
        raise FloatingPointError(ERROR)
    cfg: Config = run.config
    x, y = _data(run.seed)
    torch.manual_seed(run.seed)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    val = Evaluator("val", lambda m: {"loss": _mse(m, (x, y)).item()}, every=10)
    with RunHandle(
        run, model, opt, num_steps=cfg.steps, evaluators=[val],
        checkpoint=CheckpointConfig(every=10, keep_last=1),
    ) as loop:  # fmt: skip
        for step in loop.steps():
            i = (step - 1) % 4 * 16
            loss = _mse(model, (x[i : i + 16], y[i : i + 16]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            loop.end_step({"loss": loss.item(), "lr": cfg.lr})  # a metric named like a field
            if step % 20 == 0:
                loop.log_histogram("weights", model.weight, bins=8, range=(-2, 2))
                loop.log_image("weights/image", (model.weight.detach().clamp(-1, 1) + 1) / 2)
    return loop.artifacts


_CRASH = """
import os, signal, sys
from lab.store import Store
store = Store(sys.argv[1])
exp = store.begin_experiment("crashy", config={}, seed=0, repeats=1)
arm = store.add_arm(exp, "a", overrides={}, config={})
group = store.add_group(exp, "a", arm_id=arm)
run = store.start_run(exp, group, run_key="a-r0", arm_id=arm, repeat=0, stage=0, seed=0,
                      config={}, output_dir=None)
store.log_metrics(run, 1, {"y": 1.0})
store.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The experiment recorded into a SQLite store, a chain of two stages, a run whose
    process was killed (SIGKILL) while it ran, and a real `lab serve` in front of them."""
    folder = tmp_path_factory.mktemp("dashboard")
    url = f"sqlite:///{folder / 'lab.db'}"
    Experiment(
        NAME,
        train,
        base_config=Config(),
        arms=[Arm(ARMS[0], lr=0.05), Arm(ARMS[1], lr=0.2)],
        repeats=2,
        store=url,
        output_dir=folder / "runs",
        benchmarks=[Evaluator("holdout", holdout)],
        strict=False,
    ).run()
    Experiment(
        "chain",
        train,
        base_config=Config(steps=10),
        arms=[Arm("staged", stages=[{"lr": 0.05}, {"lr": 0.1}])],
        store=url,
        output_dir=folder / "runs",
    ).run()
    done = warm.run([sys.executable, "-c", _CRASH, url], timeout=120)
    assert done.returncode == -signal.SIGKILL
    server = serve(url)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Where each page's screenshot goes: the tests' folder, and $LAB_SCREENSHOTS if set."""
    folders = [tmp_path_factory.mktemp("screenshots")]
    if os.environ.get("LAB_SCREENSHOTS"):
        folders.append(Path(os.environ["LAB_SCREENSHOTS"]))
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
    return folders


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium at 1000 px wide that keeps the console's messages."""
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={WIDTH},900", "--lang=en-US"):  # fmt: skip
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


# -- helpers ----------------------------------------------------------------------------------


def wait_for(driver: Any, css: str, timeout: float = 20.0) -> Any:
    """The first element matching `css`, once it is there and shown."""
    WebDriverWait(driver, timeout, ignored_exceptions=[StaleElementReferenceException]).until(
        lambda d: any(e.is_displayed() for e in d.find_elements(By.CSS_SELECTOR, css))
    )
    return next(e for e in driver.find_elements(By.CSS_SELECTOR, css) if e.is_displayed())


def console_errors(driver: Any) -> list[str]:
    """The console's errors since the last call (reading the log empties it)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def retype(box: Any, text: str) -> None:
    """Replace what an input holds, as typing does (its input event fires)."""
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.DELETE)
    if text:
        box.send_keys(text)


def signed_in(driver: Any, site: Served) -> None:
    """Give the prompt the read token once per browser session."""
    if driver.get_cookie("lab_token") is not None:
        return
    driver.get(site.url + "/")
    wait_for(driver, "#token-input").send_keys(site.read_token)
    driver.find_element(By.CSS_SELECTOR, "#token-form button").click()
    wait_for(driver, "#experiments-table")
    console_errors(driver)


def check_page(driver: Any, name: str, shots: list[Path], *, shell: bool = True) -> None:
    """What every page must be: no script of the store's text ran (the shell's own two are
    the only scripts), it fits 1000 px, the console is clean; and its screenshot, the whole
    page, is saved."""
    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text  # noqa: B018
    scripts = driver.execute_script(
        "return Array.from(document.scripts).map(s => s.getAttribute('src'))"
    )
    own = ["/static/vendor/uPlot.iife.min.js", "/static/app.js"] if shell else []
    assert scripts == own, name
    width = driver.execute_script(
        "return [document.documentElement.scrollWidth, document.documentElement.clientWidth]"
    )
    assert width[0] <= width[1], f"{name}: {width[0]} px of content in a {width[1]} px window"
    assert console_errors(driver) == [], name
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(WIDTH, min(max(900, height + 140), 6000))
    try:
        for folder in shots:
            driver.save_screenshot(str(folder / f"{name}.png"))
    finally:
        driver.set_window_size(WIDTH, 900)


def values(row: Any) -> list[Any]:
    """The exact values a table row carries (each cell's data-value, JSON)."""
    return [
        json.loads(v) if v is not None else None
        for v in (c.get_attribute("data-value") for c in row.find_elements(By.TAG_NAME, "td"))
    ]


def same(got: Any, want: Any) -> bool:
    if isinstance(want, float) and math.isnan(want):
        return got == "NaN"
    return got == want


def experiment_url(site: Served) -> str:
    return f"{site.url}/experiments/{quote(NAME, safe='')}"


# -- the tests --------------------------------------------------------------------------------


def test_the_token_prompt_keeps_the_token_out_of_the_page(
    browser: Any, site: Served, shots: list[Path]
) -> None:
    browser.delete_all_cookies()
    browser.get(site.url + "/")
    prompt = wait_for(browser, "#token-prompt")
    assert "read token" in prompt.text
    check_page(browser, "token-prompt", shots)
    box = browser.find_element(By.ID, "token-input")
    box.send_keys("lab_" + "x" * 43)
    browser.find_element(By.CSS_SELECTOR, "#token-form button").click()
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "token-error").text)
    assert browser.find_element(By.ID, "token-error").text == "the token is wrong or revoked"
    console_errors(browser)  # the refused token's 401
    assert browser.get_cookie("lab_token") is None
    box.send_keys(site.read_token)
    browser.find_element(By.CSS_SELECTOR, "#token-form button").click()
    table = wait_for(browser, "#experiments-table")
    assert NAME in table.text
    cookie = browser.get_cookie("lab_token")
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict" and cookie["path"] == "/"
    assert browser.execute_script("return document.cookie") == ""  # scripts cannot read it
    assert site.read_token not in browser.page_source
    assert site.read_token not in browser.execute_script(
        "return document.documentElement.outerHTML + JSON.stringify(localStorage) "
        "+ JSON.stringify(sessionStorage) + location.href"
    )
    check_page(browser, "experiments", shots)
    search = browser.find_element(By.ID, "search")
    search.send_keys("no such experiment")
    WebDriverWait(browser, 10).until(lambda d: not d.find_elements(By.ID, "experiments-table"))
    retype(search, "DASH")  # case-insensitive
    assert NAME in wait_for(browser, "#experiments-table").text


def test_experiment_page_arm_table_equals_the_summary_and_draws_one_curve_per_arm(
    browser: Any, site: Served, shots: list[Path]
) -> None:
    signed_in(browser, site)
    browser.get(site.url + "/")
    wait_for(browser, "#experiments-table").find_element(By.LINK_TEXT, NAME).click()
    assert wait_for(browser, "#exp-name").text == NAME  # the name is text: no script ran
    con = lab.inspect.connect(site.store_url)
    for metric in ("val/loss", "holdout/acc"):
        Select(browser.find_element(By.ID, "metric")).select_by_value(metric)
        WebDriverWait(browser, 20).until(
            lambda d, m=metric: (
                m in d.find_element(By.CSS_SELECTOR, "#summary h2").text
                and d.find_elements(By.CSS_SELECTOR, "#arm-table tbody tr")
            )
        )
        mode = Select(browser.find_element(By.ID, "mode")).first_selected_option
        want = lab.inspect.summary(con, NAME, metric, mode.get_attribute("value")).fetchall()
        rows = browser.find_elements(By.CSS_SELECTOR, "#arm-table tbody tr")
        got = []
        for row in rows:
            _arm, n, mean, std, _ci, rank, margin = values(row)
            ci = row.find_element(By.CSS_SELECTOR, "td.ci")
            low, high = (json.loads(ci.get_attribute(f"data-{k}")) for k in ("low", "high"))
            best = "best" in (row.get_attribute("class") or "").split()
            assert ("★ best" in row.text) == best
            got.append((row.get_attribute("data-arm"), n, mean, std, low, high, rank, best,
                        margin))  # fmt: skip
        assert len(got) == len(want) == 2
        for g, w in zip(got, want, strict=True):
            assert all(same(a, b) for a, b in zip(g, w, strict=True)), (g, w)
        assert [g[0] for g in got] == list(ARMS)
        assert (
            browser.find_element(By.CSS_SELECTOR, "#arm-table tbody tr").get_attribute("data-arm")
            == ARMS[0]
        )
    chart = wait_for(browser, "#curve-chart[data-draw-ms]")
    print(f"\ncurves requested -> drawn in the browser: {chart.get_attribute('data-draw-ms')} ms")
    labels = browser.execute_script(
        "return document.getElementById('curve-chart').uplot.series"
        ".filter(s => s.role === 'mean').map(s => s.label)"
    )
    assert labels == list(ARMS)  # one series per arm, in the arms' order
    assert chart.get_attribute("data-metric") == "holdout/acc"
    Select(browser.find_element(By.ID, "metric")).select_by_value("val/loss")
    WebDriverWait(browser, 20).until(
        lambda d: d.find_element(By.ID, "curve-chart").get_attribute("data-metric") == "val/loss"
    )
    over = browser.find_element(By.CSS_SELECTOR, "#curve-chart .u-over")
    ActionChains(browser).move_to_element_with_offset(over, 0, 0).perform()  # hover: values
    WebDriverWait(browser, 10).until(
        lambda d: d.find_element(By.CSS_SELECTOR, "#curve-legend .legend-step").text
    )
    readouts = [
        e.text for e in browser.find_elements(By.CSS_SELECTOR, "#curve-legend .legend-value")
    ]
    assert len(readouts) == 2 and all(readouts), readouts
    zoom = (
        "const u = document.getElementById('curve-chart').uplot; "
        "return [u.scales.x.min, u.scales.x.max]"
    )
    before = browser.execute_script(zoom)
    ActionChains(browser).move_to_element_with_offset(
        over, -200, 0
    ).click_and_hold().move_by_offset(150, 0).release().perform()  # drag: zoom in on the steps
    after = browser.execute_script(zoom)
    assert before[0] <= after[0] < after[1] <= before[1] and after != before
    browser.find_element(By.ID, "log-scale").click()  # a redraw keeps the zoom
    assert browser.execute_script(zoom) == after
    browser.find_element(By.ID, "log-scale").click()
    browser.find_element(By.ID, "reset-zoom").click()
    assert browser.execute_script(zoom) == before
    # the arm table picks an arm: the chart shows it alone, and a second click shows both
    browser.find_element(By.CSS_SELECTOR, "#arm-table .arm-pick").click()
    WebDriverWait(browser, 10).until(
        lambda d: d.find_element(By.ID, "curve-chart").get_attribute("data-arms") == "1"
    )
    browser.find_element(By.CSS_SELECTOR, "#arm-table .arm-pick").click()
    WebDriverWait(browser, 10).until(
        lambda d: d.find_element(By.ID, "curve-chart").get_attribute("data-arms") == "2"
    )
    Select(browser.find_element(By.ID, "metric")).select_by_value("loss")
    WebDriverWait(browser, 20).until(
        lambda d: d.find_element(By.ID, "curve-chart").get_attribute("data-metric") == "loss"
    )
    browser.find_element(By.ID, "show-runs").click()  # each run as its own line
    WebDriverWait(browser, 20).until(
        lambda d: (
            d.execute_script(
                "return document.getElementById('curve-chart').uplot.series"
                ".filter(s => s.role === 'run').length"
            )
            == 3
        )  # the failed run recorded no loss
    )
    browser.find_element(By.ID, "log-scale").click()
    browser.execute_script(
        "const s = document.getElementById('smoothing'); s.value = '0.6';"
        "s.dispatchEvent(new Event('input'))"
    )
    wait_for(browser, "#curve-chart[data-arms='2']")
    config = browser.find_element(By.ID, "exp-config").get_attribute("textContent")
    assert json.dumps(SCRIPT) in config  # the config's markup, as text
    check_page(browser, "experiment", shots)


def test_runs_table_sorts_filters_and_a_failed_run_shows_its_error(
    browser: Any, site: Served, shots: list[Path]
) -> None:
    signed_in(browser, site)
    browser.get(experiment_url(site))
    wait_for(browser, "#runs-table tbody tr")

    def keys() -> list[str]:
        return [
            r.find_element(By.CSS_SELECTOR, "td.name a").text
            for r in browser.find_elements(By.CSS_SELECTOR, "#runs-table tbody tr")
        ]

    assert sorted(keys()) == ["fast-r0", "fast-r1", "slow-r0", "slow-r1"]
    heads = {
        b.get_attribute("data-key"): b.text
        for b in browser.find_elements(By.CSS_SELECTOR, "#runs-table thead button")
    }
    assert (heads["config.lr"], heads["final.lr"]) == ("lr", "lr (final)")  # the field, the metric
    browser.find_element(By.CSS_SELECTOR, "#runs-table button[data-key='seed']").click()
    assert [k[-1] for k in keys()] == ["0", "0", "1", "1"]
    browser.find_element(By.CSS_SELECTOR, "#runs-table button[data-key='run_key']").click()
    browser.find_element(By.CSS_SELECTOR, "#runs-table button[data-key='run_key']").click()
    assert keys() == ["slow-r1", "slow-r0", "fast-r1", "fast-r0"]  # descending
    box = browser.find_element(By.ID, "run-filter")
    retype(box, "lr=0.2")  # a config field
    assert sorted(keys()) == ["fast-r0", "fast-r1"]
    retype(box, "loss<100 seed=0")  # a final metric and a field
    assert sorted(keys()) == ["fast-r0", "slow-r0"]
    retype(box, "")
    Select(browser.find_element(By.ID, "run-status")).select_by_value("failed")
    assert keys() == [FAILED]
    failed_row = browser.find_element(By.CSS_SELECTOR, "#runs-table tbody tr")
    assert ERROR in failed_row.text
    check_page(browser, "runs-filtered", shots)
    failed_row.find_element(By.LINK_TEXT, FAILED).click()
    error = wait_for(browser, "#run-error")
    assert "This run failed" in error.text
    assert browser.find_element(By.CSS_SELECTOR, "#run-error .error-text").text == (
        f"FloatingPointError: {ERROR}"
    )
    assert "Traceback" in browser.find_element(
        By.CSS_SELECTOR, "#run-error .traceback"
    ).get_attribute("textContent")
    check_page(browser, "run-failed", shots)


def test_run_page_shows_config_metrics_evals_and_links_to_predictions(
    browser: Any, site: Served, shots: list[Path]
) -> None:
    signed_in(browser, site)
    browser.get(experiment_url(site))
    wait_for(browser, "#runs-table").find_element(By.LINK_TEXT, "slow-r0").click()
    assert wait_for(browser, "#run-key").text == "slow-r0"
    config = json.loads(browser.find_element(By.ID, "config-text").get_attribute("textContent"))
    assert config == {"lr": 0.05, "steps": 40, "note": SCRIPT}
    keys = [r.find_element(By.TAG_NAME, "td").text
            for r in browser.find_elements(By.CSS_SELECTOR, "#metrics-table tbody tr")]  # fmt: skip
    assert {"loss", "val/loss", "holdout/acc"} <= set(keys)
    WebDriverWait(browser, 20).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, ".small-chart .uplot")) == len(keys)
    )
    evals = browser.find_elements(By.CSS_SELECTOR, "#evals-table tbody tr")
    assert [e.find_element(By.TAG_NAME, "td").text for e in evals] == ["val"] * 4 + ["holdout"]
    assert "positive: acc=" in evals[-1].text and "examples=12" in evals[-1].text
    saves = browser.find_elements(By.CSS_SELECTOR, "#checkpoints-table tbody tr")
    events = [r.find_elements(By.TAG_NAME, "td")[1].text for r in saves]
    assert events == ["save", "save", "remove", "save", "remove", "save", "remove"]
    removed = next(r for r in saves if "remove" in r.get_attribute("class"))
    assert removed.find_elements(By.TAG_NAME, "td")[4].text  # its reason
    hist = browser.find_element(By.CSS_SELECTOR, "#histograms figure[data-key='weights']")
    assert "step 40" in hist.text
    image = wait_for(browser, "#images img")
    WebDriverWait(browser, 10).until(
        lambda d: (
            d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image)
            == 4
        )
    )
    check_page(browser, "run", shots)
    evals[-1].find_element(By.LINK_TEXT, "holdout").click()
    wait_for(browser, "#disagreements-table")
    assert "/predictions?eval=holdout" in browser.current_url


def _x_spans(browser: Any, keys: int) -> dict[str, list[float]]:
    """Each small chart of the run page shown: its metric, and the span of its x axis."""
    WebDriverWait(browser, 20).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, ".small-chart .uplot")) == keys
    )
    return dict(
        browser.execute_script(
            "return Array.from(document.querySelectorAll('.small-chart')).map("
            "b => [b.dataset.key, [b.uplot.scales.x.min, b.uplot.scales.x.max]])"
        )
    )


def test_run_page_draws_every_metric_over_the_runs_steps(browser: Any, site: Served) -> None:
    """A metric of one point (the holdout benchmark, after training) sits at its step on the
    run's axis, 1 to 40, as the curves do, not on an axis of its own around it; a run of one
    step gets one step of room each side."""
    signed_in(browser, site)
    browser.get(experiment_url(site))
    wait_for(browser, "#runs-table").find_element(By.LINK_TEXT, "slow-r0").click()
    assert wait_for(browser, "#run-key").text == "slow-r0"
    rows = browser.find_elements(By.CSS_SELECTOR, "#metrics-table tbody tr")
    metrics = {values(r)[0]: values(r)[1:4] for r in rows}  # key: points, first, last step
    assert metrics["holdout/acc"] == [1, 40, 40] and metrics["loss"] == [40, 1, 40]
    assert _x_spans(browser, len(metrics)) == {key: [1, 40] for key in metrics}
    browser.get(f"{site.url}/experiments/crashy")
    wait_for(browser, "#runs-table").find_element(By.LINK_TEXT, "a-r0").click()
    assert wait_for(browser, "#run-key").text == "a-r0"
    assert _x_spans(browser, 1) == {"y": [0, 2]}  # its one point, at step 1


def test_predictions_page_disagreements_equal_lab_inspect(
    browser: Any, site: Served, shots: list[Path]
) -> None:
    signed_in(browser, site)
    browser.get(experiment_url(site))
    wait_for(browser, "#to-predictions").click()
    wait_for(browser, "#disagreements-table")
    con = lab.inspect.connect(site.store_url)
    for a, b in (ARMS, ARMS[::-1]):
        Select(browser.find_element(By.ID, "arm-a")).select_by_value(a)
        Select(browser.find_element(By.ID, "arm-b")).select_by_value(b)
        WebDriverWait(browser, 20).until(
            lambda d, a=a: (
                f"A = {a}," in d.find_element(By.ID, "disagreements").text
                and d.find_elements(By.CSS_SELECTOR, "#disagreements-table tbody tr")
            )
        )
        rel = lab.inspect.disagreements(con, NAME, "holdout", a, b, 20)
        want = [dict(zip(rel.columns, r, strict=True)) for r in rel.fetchall()]
        heads = [h.text for h in browser.find_elements(By.CSS_SELECTOR,
                                                       "#disagreements-table th")]  # fmt: skip
        # a regression (real-valued outputs): "correct" is undefined, NULL, and left out
        assert all(w["correct_a"] is None and w["correct_b"] is None for w in want)
        assert heads == [c for c in rel.columns if not c.startswith("correct_")]
        rows = browser.find_elements(By.CSS_SELECTOR, "#disagreements-table tbody tr")
        got = [dict(zip(heads, values(r), strict=True)) for r in rows]
        assert len(got) == len(want) == EXAMPLES
        for g, w in zip(got, want, strict=True):
            assert g["example_id"] == w["example_id"]
            assert all(same(g[k], w[k]) for k in ("score_a", "score_b", "diff")), (g, w)
    first = browser.find_element(By.CSS_SELECTOR, "#disagreements-table")
    assert SCRIPT in first.text  # the prediction's markup is text in the table
    rel = lab.inspect.breakdown(con, NAME, "holdout")
    rows = browser.find_elements(By.CSS_SELECTOR, "#breakdown-table tbody tr")
    assert [r.text.split()[:3] for r in rows] == [list(map(str, w[:3])) for w in rel.fetchall()]
    rows = wait_for(browser, "#rows-table").find_elements(By.CSS_SELECTOR, "tbody tr")
    assert len(rows) == EXAMPLES
    assert SCRIPT in rows[0].text
    check_page(browser, "predictions", shots)


def test_unknown_experiment_run_or_metric_gives_the_404_page(
    browser: Any, site: Served, shots: list[Path]
) -> None:
    signed_in(browser, site)
    session = {"lab_token": browser.get_cookie("lab_token")["value"]}
    bad = {
        "/experiments/no-such-experiment": "no experiment named 'no-such-experiment'",
        "/experiments/no-such-experiment/predictions": "no experiment named",
        "/runs/999999": "no run with id 999999",
        "/runs/abc": "no run with id 'abc'",
        f"/experiments/{quote(NAME, safe='')}?metric=no/such": "has no metric 'no/such'",
    }
    with (
        httpx.Client(base_url=site.url, timeout=30, cookies=session) as client,
        httpx.Client(base_url=site.url, timeout=30) as stranger,
    ):
        for path, detail in bad.items():
            answer = client.get(path)
            assert answer.status_code == 404, path
            assert answer.headers["content-type"].startswith("text/html")
            assert 'href="/"' in answer.text and "Traceback" not in answer.text
            assert detail.replace("'", "&#x27;") in answer.text, path
            # without a session the shell answers, and asks for the token first
            assert stranger.get(path).status_code == 200
    for i, (path, detail) in enumerate(bad.items()):
        browser.get(site.url + path)
        assert detail in wait_for(browser, "#notfound-detail").text
        console_errors(browser)  # the page's own 404 status
        if i == 0:
            check_page(browser, "not-found", shots, shell=False)
    browser.find_element(By.ID, "back").click()
    wait_for(browser, "#experiments-table")


def test_pages_open_without_a_token_the_api_does_not_and_the_cookie_only_reads(
    site: Served,
) -> None:
    with httpx.Client(base_url=site.url, timeout=30) as client:
        page = client.get("/")
        assert page.status_code == 200 and 'data-signed-in="0"' in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert client.get("/static/app.js").status_code == 200
        assert client.get("/api/v1/dashboard/experiments").status_code == 401
        refused = client.post("/ui/token", json={"token": site.read_token[:-1] + "x"})
        assert refused.status_code == 401
        assert refused.json() == {"detail": "the token is wrong or revoked", "field": "token"}
        assert client.post("/ui/token", content=b"token").status_code == 415
        for token in (site.read_token, site.write_token):
            taken = client.post("/ui/token", json={"token": token})
            assert taken.status_code == 200 and taken.json()["scope"] == "read"
            assert token not in taken.text
            set_cookie = taken.headers["set-cookie"]
            assert "HttpOnly" in set_cookie and "SameSite=strict" in set_cookie
            with httpx.Client(base_url=site.url, timeout=30, cookies={"lab_token": token}) as c:
                listed = c.get("/api/v1/dashboard/experiments")
                assert listed.status_code == 200
                assert NAME in [r["name"] for r in listed.json()["rows"]]
                assert 'data-signed-in="1"' in c.get("/").text
                assert c.get("/api/v1/token").json()["scope"] == "read"
                # a write never takes the cookie, even a write token's
                assert c.post("/api/v1/experiments", json={}).status_code == 401
        out = client.post("/ui/logout")
        assert out.status_code == 204 and 'lab_token=""' in out.headers["set-cookie"]


def test_lab_ui_serves_the_dashboard_read_only_on_loopback_without_tokens(
    site: Served, tmp_path: Path
) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = warm.popen(
        [sys.executable, "-c", "from lab.cli import main; main()", "ui", "--store",
         site.store_url, "--port", str(port), "--no-open"],
        env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                page = httpx.get(url + "/", timeout=1.0)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        assert 'data-auth="0"' in page.text and 'data-signed-in="1"' in page.text
        listed = httpx.get(url + "/api/v1/dashboard/experiments", timeout=30)
        assert listed.status_code == 200 and NAME in [r["name"] for r in listed.json()["rows"]]
        assert httpx.get(url + "/runs/999999", timeout=30).status_code == 404
        write = httpx.post(url + "/api/v1/experiments", json={}, timeout=30)
        assert write.status_code in (404, 405)  # no write API at all
        assert httpx.post(url + "/ui/token", json={"token": "x"}, timeout=30).status_code in (
            404,
            405,
        )
        for host in ("attacker.example", "attacker.example:80", "127.0.0.1.attacker.example"):
            rebound = httpx.get(url + "/api/v1/dashboard/experiments", timeout=30,
                                headers={"Host": host})  # fmt: skip
            assert rebound.status_code == 421  # a page that rebinds its name to loopback
            assert rebound.json() == {"detail": LOCAL_ONLY, "field": "header.host"}
        assert httpx.get(url + "/", headers={"Host": f"localhost:{port}"}).status_code == 200
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert f"at http://127.0.0.1:{port}/ (read-only, this machine only)" in err


def test_a_live_experiment_updates_without_a_reload_and_a_dead_run_shows_crashed(
    browser: Any, site: Served, shots: list[Path]
) -> None:
    signed_in(browser, site)
    store = Store(site.store_url)
    try:
        exp = store.begin_experiment("live", config={}, seed=0, repeats=1)
        arm = store.add_arm(exp, "a", overrides={}, config={})
        group = store.add_group(exp, "a", arm_id=arm)
        run = store.start_run(exp, group, run_key="a-r0", arm_id=arm, repeat=0, stage=0,
                              seed=0, config={}, output_dir=None)  # fmt: skip
        store.log_metrics(run, 1, {"y": 1.0})
        store.flush()
        browser.get(f"{site.url}/experiments/live")
        wait_for(browser, "#exp-header .live")
        row = wait_for(browser, "#runs-table tbody tr")
        assert row.get_attribute("data-status") == "running"
        browser.execute_script("window.__same_page = true")
        for step in range(2, 6):
            store.log_metrics(run, step, {"y": 1.0 / step})
        store.flush()
        WebDriverWait(browser, 30).until(  # the next poll draws them
            lambda d: (
                d.execute_script(
                    "return document.getElementById('curve-chart').uplot.data[0].length"
                )
                == 5
            )
        )
        failure = {"callback": "Boom", "hook": "on_step_end", "error": "ValueError: <i>x</i>",
                   "traceback": "Traceback (most recent call last):\nValueError: <i>x</i>",
                   "count": 3}  # fmt: skip
        store.finish_run(run, status="completed", callback_errors=[failure])
        store.finish_experiment(exp, status="completed")
        WebDriverWait(browser, 30).until(
            lambda d: (
                d.find_element(By.CSS_SELECTOR, "#runs-table tbody tr").get_attribute("data-status")
                == "completed"
            )
        )
        assert browser.execute_script("return window.__same_page") is True  # no reload
        assert not browser.find_elements(By.CSS_SELECTOR, "#exp-header .live")
    finally:
        store.close()
    browser.find_element(By.LINK_TEXT, "a-r0").click()
    box = wait_for(browser, "#callback-errors")
    assert "Boom.on_step_end: ValueError: <i>x</i> (3 times)" in box.text
    trace = box.find_element(By.CSS_SELECTOR, ".traceback").get_attribute("textContent")
    assert trace == failure["traceback"]
    browser.get(f"{site.url}/experiments/crashy")
    row = wait_for(browser, "#runs-table tbody tr")
    assert row.get_attribute("data-status") == "crashed"
    assert row.find_element(By.CSS_SELECTOR, ".status").text == "crashed"
    assert not browser.find_elements(By.CSS_SELECTOR, "#exp-header .live")
    check_page(browser, "crashed", shots)
    row.find_element(By.LINK_TEXT, "a-r0").click()
    assert "This run crashed" in wait_for(browser, "#run-error").text


def test_a_chain_shows_its_stages_in_order(browser: Any, site: Served, shots: list[Path]) -> None:
    signed_in(browser, site)
    browser.get(f"{site.url}/experiments/chain")
    chain = wait_for(browser, "#chain-list li")
    assert chain.text.startswith("staged-r0 (staged): stage 0")
    assert chain.text == "staged-r0 (staged): stage 0 completed → stage 1 completed"
    first, second = chain.find_elements(By.TAG_NAME, "a")
    ids = [r.get_attribute("data-run-id")
           for r in browser.find_elements(By.CSS_SELECTOR, "#runs-table tbody tr")]  # fmt: skip
    assert [first.get_attribute("href"), second.get_attribute("href")] == [
        f"{site.url}/runs/{i}" for i in ids
    ]
    check_page(browser, "chain", shots)
    second.click()
    assert wait_for(browser, "#run-key").text == "staged-r0-s1"
    parent = browser.find_element(By.CSS_SELECTOR, "#run-header .meta a[href^='/runs/']")
    assert parent.get_attribute("href") == f"{site.url}/runs/{ids[0]}"
