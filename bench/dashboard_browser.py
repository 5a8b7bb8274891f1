"""The dashboard's curves in a real browser, on the 10-million-point store of bench/query.py.

The store: 100 runs (10 arms x 10 repeats) x 10,000 steps x 10 keys (bench/query.py's cached
SQLite file, built once). It is served as `lab ui` serves it (the app without tokens, read-only,
uvicorn on loopback) and opened in headless Chromium at 1000 px wide, the distribution's
build driven by Selenium. Per round, a fresh load of the experiment page with ``metric=loss``:

    draw_ms     the page's own measure (``data-draw-ms`` of the chart): from sending the
                curves request (10 arms, about one bucket per pixel, mean and 95% CI per
                bucket cut at the server) to uPlot having drawn them     target < 1 s
    request_ms  that request alone, as the browser's resource timing saw it (server, JSON,
                transfer)
    page_ms     from navigation start to the chart drawn: HTML, scripts, the experiment's
                JSON, then the curves

Medians over rounds after one warm-up load. Prints one JSON line.

    python bench/dashboard_browser.py             # the 10-million-point store
    python bench/dashboard_browser.py --quick     # 10 runs x 1,000 steps x 10 keys
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import log, machine
from query import CACHE, cached_store

NAME = "query-bench"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
SERVE = (
    "import sys, uvicorn; from lab.server import create_app; "
    "uvicorn.run(create_app(sys.argv[1], auth=False, writes=False), host='127.0.0.1', "
    "port=int(sys.argv[2]), log_level='warning')"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/api/v1/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start on {url}")
        time.sleep(0.1)


def one_load(driver: object, url: str) -> dict[str, float]:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{url}/experiments/{NAME}?metric=loss")
    WebDriverWait(driver, 120).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "#curve-chart[data-draw-ms]")
    )
    return driver.execute_script(
        """
        const chart = document.getElementById('curve-chart');
        const curves = performance.getEntriesByType('resource')
          .filter((e) => e.name.includes('/curves?'));
        return {draw_ms: +chart.dataset.drawMs,
                request_ms: curves.length ? curves[curves.length - 1].duration : null,
                page_ms: performance.now(),
                arms: chart.uplot.series.filter((s) => s.role === 'mean').length,
                points: chart.uplot.data[0].length};
        """
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="10 runs x 1,000 steps x 10 keys")
    args = parser.parse_args()
    shape = (2, 5, 1000, 10) if args.quick else (10, 10, 10_000, 10)
    path = cached_store(CACHE, *shape, rebuild=False)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    server = subprocess.Popen([sys.executable, "-c", SERVE, f"sqlite:///{path}", str(port)],
                              env=env)  # fmt: skip
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1000,900"):  # fmt: skip
        options.add_argument(arg)
    driver = None
    try:
        wait_up(url, server)
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        log("warm-up load")
        one_load(driver, url)
        rounds = []
        for i in range(args.rounds):
            rounds.append(one_load(driver, url))
            log(f"round {i + 1}: {rounds[-1]}")
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(timeout=30)
    out = {
        "bench": "dashboard_browser",
        "store": f"{shape[0] * shape[1]} runs x {shape[2]} steps x {shape[3]} keys (SQLite)",
        "arms_drawn": rounds[0]["arms"],
        "steps_drawn": rounds[0]["points"],
        "rounds": args.rounds,
        **{
            f"{k}_median": round(statistics.median(r[k] for r in rounds), 1)
            for k in ("draw_ms", "request_ms", "page_ms")
        },
        "draw_ms_max": round(max(r["draw_ms"] for r in rounds), 1),
        "target_draw_ms": 1000,
        "machine": machine(browser=CHROMIUM),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
