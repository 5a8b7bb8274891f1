"""An experiment whose driver dies reads as crashed in every door, as its runs do.

The driver (the process that runs `Experiment.run`, `lab.start_run` or a bare fit) is
recorded as the experiment's owner and keeps its heartbeat while it drives it. Real
processes throughout: a driver subprocess SIGKILLed while a run trains, then `lab ls` and
`lab show` as subprocesses, `lab.inspect`, and the dashboard and read APIs of a real
`lab serve`; the same through a `lab serve` server as the driver's store.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from test_liveness import _set

import lab.inspect
from lab.store import Store
from lab.store._values import _now
from lab.store.http import HttpStore
from tests import warm
from tests.served import Served

WAIT_S = 60.0
DRIVER = textwrap.dedent(
    """
    import pathlib, sys, time
    from lab import Experiment

    def train(run):
        if run.repeat == 1:  # the second run trains until the driver is killed
            pathlib.Path(sys.argv[2]).write_text("training")
            time.sleep(600)
        return {"loss": 1.0}

    if __name__ == "__main__":
        Experiment("driven", train, repeats=2, store=sys.argv[1], output_dir=sys.argv[3]).run()
    """
)
BEGIN = textwrap.dedent(
    """
    import sys, time
    from lab.store import Store

    store = Store(sys.argv[1], heartbeat_s=0.2)
    store.begin_experiment(sys.argv[2], config={}, seed=0, repeats=1)
    print("driving", flush=True)
    if sys.argv[3] == "stay":
        time.sleep(600)
    """
)


def _env(**more: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **more}


def _drive(tmp_path: Path, store: str, **env: str) -> subprocess.Popen[str]:
    """A driver subprocess, returned once its second run trains."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    marker = tmp_path / "training"
    proc = warm.popen(
        [sys.executable, str(script), store, str(marker), str(tmp_path / "runs")],
        env=_env(**env), text=True,
    )  # fmt: skip
    deadline = time.monotonic() + WAIT_S
    while not marker.exists():
        assert proc.poll() is None, "the driver ended before its second run"
        assert time.monotonic() < deadline, "the driver did not start its second run"
        time.sleep(0.05)
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _ls(store: str, **env: str) -> list[str]:
    """`lab ls` as a subprocess: the row of experiment `driven`, split on whitespace."""
    out = warm.run([sys.executable, "-m", "lab.cli", "ls", "--store", store],
                         capture_output=True, text=True, timeout=120, env=_env(**env))  # fmt: skip
    assert out.returncode == 0, out.stderr
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("driven ")]
    return row.split()


def _show(store: str, **env: str) -> str:
    out = warm.run([sys.executable, "-m", "lab.cli", "show", "driven", "--store", store],
                         capture_output=True, text=True, timeout=120, env=_env(**env))  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()[0]


INSPECT = textwrap.dedent(
    """
    import json, sys
    import lab.inspect

    con = lab.inspect.connect(sys.argv[1])
    print(json.dumps([
        con.sql("SELECT name, status FROM experiments").fetchall(),
        con.sql("SELECT run_key, status FROM runs ORDER BY run_key").fetchall(),
    ]))
    """
)


def _inspected(store: str, **env: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """What `lab.inspect` shows, read in a process of its own (DuckDB's SQLite and Python's
    must not share a file in one process)."""
    out = warm.run([sys.executable, "-c", INSPECT, store], capture_output=True,
                         text=True, timeout=120, env=_env(**env))  # fmt: skip
    assert out.returncode == 0, out.stderr
    experiments, runs = json.loads(out.stdout)
    return [tuple(e) for e in experiments], [tuple(r) for r in runs]


def _dashboard(served: Served) -> tuple[str, str, list[tuple[str, str]], str]:
    """The experiment's status in the dashboard's list, on its page (with its runs'), and in
    the read API's list."""
    with served.client(served.read_token) as http:
        (listed,) = http.get("/api/v1/dashboard/experiments").json()["rows"]
        page = http.get("/api/v1/dashboard/experiments/driven").json()
        (read,) = http.get("/api/v1/experiments").json()
    runs = [(r["run_key"], r["status"]) for r in page["runs"]]
    return listed["status"], page["status"], runs, read["status"]


def _rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    store = Store(url, migrate=False)
    try:
        with store.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(sql)).all()]
    finally:
        store.close()


LIVE_RUNS = [("base-r0", "completed"), ("base-r1", "running")]
DEAD_RUNS = [("base-r0", "completed"), ("base-r1", "crashed")]


def test_a_sigkilled_driver_leaves_its_experiment_crashed_in_every_door(
    served: Served, tmp_path: Path
) -> None:
    url = served.store_url
    driver = _drive(tmp_path, url)
    try:  # alive: running everywhere
        assert _ls(url)[:2] == ["driven", "running"]
        assert _show(url) == "driven: running, 2 runs, seed 0"
        assert _inspected(url) == ([("driven", "running")], LIVE_RUNS)
        assert _dashboard(served) == ("running", "running", LIVE_RUNS, "running")
    finally:
        _kill(driver)
    row = _ls(url)
    assert row[:2] == ["driven", "crashed"]
    assert " ".join(row).count("1 completed, 1 crashed") == 1
    assert _show(url) == "driven: crashed, 2 runs, seed 0"
    assert _inspected(url) == ([("driven", "crashed")], DEAD_RUNS)
    assert _dashboard(served) == ("crashed", "crashed", DEAD_RUNS, "crashed")
    # the readers wrote nothing; a store opened to write marks both
    assert _rows(url, "SELECT status FROM experiments") == [("running",)]
    Store(url).close()
    assert _rows(url, "SELECT status, ended_at IS NOT NULL FROM experiments") == [("crashed", True)]
    assert _rows(url, "SELECT run_key, status FROM runs ORDER BY run_key") == DEAD_RUNS
    assert _inspected(url) == ([("driven", "crashed")], DEAD_RUNS)
    # a later driver that reopens it sets it running again, under its own process
    store = Store(url)
    try:
        exp_id = store.begin_experiment("driven", config={}, seed=0, repeats=2)
        assert _rows(url, "SELECT status, ended_at, pid FROM experiments") == [
            ("running", None, os.getpid())
        ]
        assert _ls(url)[:2] == ["driven", "running"]
        store.finish_experiment(exp_id, status="completed")
    finally:
        store.close()


def test_a_driver_recording_through_lab_serve_is_judged_the_same(
    served: Served, tmp_path: Path
) -> None:
    token = {"LAB_TOKEN": served.write_token}
    driver = _drive(tmp_path, served.url, **token)
    try:
        assert _ls(served.url, **token)[:2] == ["driven", "running"]
        assert _dashboard(served) == ("running", "running", LIVE_RUNS, "running")
        (host, pid) = _rows(served.store_url, "SELECT host, pid FROM experiments")[0]
        assert (host, pid) == (socket.gethostname(), driver.pid)  # the client, not the server
    finally:
        _kill(driver)
    assert _ls(served.url, **token)[:2] == ["driven", "crashed"]
    assert _show(served.url, **token) == "driven: crashed, 2 runs, seed 0"
    assert _dashboard(served) == ("crashed", "crashed", DEAD_RUNS, "crashed")
    read = {"LAB_TOKEN": served.read_token}
    assert _inspected(served.url, **read) == ([("driven", "crashed")], DEAD_RUNS)
    assert _inspected(served.store_url) == ([("driven", "crashed")], DEAD_RUNS)


def test_the_driver_keeps_the_heartbeat_locally_and_through_lab_serve(served: Served) -> None:
    stores = [Store(served.store_url, heartbeat_s=0.2),
              HttpStore(served.url, token=served.write_token, heartbeat_s=0.2)]  # fmt: skip
    try:
        ids = [s.begin_experiment(f"beat-{i}", config={}, seed=0, repeats=1)
               for i, s in enumerate(stores)]  # fmt: skip
        sql = "SELECT heartbeat_at, pid FROM experiments ORDER BY experiment_id"
        first = _rows(served.store_url, sql)
        assert [pid for _beat, pid in first] == [os.getpid()] * 2
        deadline = time.monotonic() + WAIT_S
        while any(now[0] <= then[0] for now, then in zip(_rows(served.store_url, sql), first,
                                                          strict=True)):  # fmt: skip
            assert time.monotonic() < deadline, "the heartbeats did not move"
            time.sleep(0.1)
        for store, exp_id in zip(stores, ids, strict=True):
            store.finish_experiment(exp_id, status="completed")
            store.flush()
    finally:
        for store in stores:
            store.close()
    assert _rows(served.store_url, "SELECT status FROM experiments") == [("completed",)] * 2


def test_on_another_host_the_heartbeat_decides(store_url: str) -> None:
    store = Store(store_url, stale_after_s=60)
    try:
        exp_id = store.begin_experiment("driven", config={}, seed=0, repeats=1)
        store.finish_experiment(exp_id, status="completed")
    finally:
        store.close()
    reader = Store(store_url, readonly=True, stale_after_s=60)
    try:
        for age, shown in ((5, "running"), (600, "crashed")):
            _set(store_url, "UPDATE experiments SET status = 'running', ended_at = NULL, "
                 "host = 'elsewhere', pid = 1, heartbeat_at = :beat",
                 beat=_now() - timedelta(seconds=age))  # fmt: skip
            assert [e["status"] for e in reader.list_experiments()] == [shown]
            assert reader.get_experiment("driven")["status"] == shown
    finally:
        reader.close()


def _begin(url: str, name: str, stay: bool) -> subprocess.Popen[str]:
    proc = warm.popen([sys.executable, "-c", BEGIN, url, name, "stay" if stay else "end"],
                            stdout=subprocess.PIPE, text=True, env=_env())  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "driving\n"
    return proc


def test_a_live_run_keeps_its_experiment_running_after_the_driver_is_gone(
    store_url: str,
) -> None:
    _begin(store_url, "driven", stay=False).wait()  # its driver ended without finishing it
    store = Store(store_url)
    try:
        exp_id = _rows(store_url, "SELECT experiment_id FROM experiments")[0][0]
        assert _rows(store_url, "SELECT status FROM experiments") == [("crashed",)]
        # a run that trains under a live process keeps the experiment alive
        _set(store_url, "UPDATE experiments SET status = 'running', ended_at = NULL")
        group = store.add_group(exp_id, "g")
        run = store.start_run(exp_id, group, run_key="r0", arm_id=None, repeat=0, stage=0,
                              seed=0, config={}, output_dir=None)  # fmt: skip
        assert store.mark_crashed() == []
        assert _ls(store_url)[:2] == ["driven", "running"]
        store.finish_run(run, status="completed")
        assert store.mark_crashed() == []  # (no run was marked: the experiment was)
        assert _rows(store_url, "SELECT status FROM experiments") == [("crashed",)]
    finally:
        store.close()


def test_of_two_drivers_the_experiment_runs_while_one_lives(store_url: str) -> None:
    first = _begin(store_url, "driven", stay=True)
    try:
        second = _begin(store_url, "driven", stay=True)
        # the driver recorded is the one that began or beat last: either, while both live
        assert _rows(store_url, "SELECT pid FROM experiments") in ([(second.pid,)], [(first.pid,)])
        _kill(second)
        deadline = time.monotonic() + WAIT_S
        while _rows(store_url, "SELECT pid FROM experiments") != [(first.pid,)]:
            assert time.monotonic() < deadline, "the live driver did not take it over"
            time.sleep(0.05)
        assert _ls(store_url)[:2] == ["driven", "running"]
        # even marked crashed meanwhile, a live driver's next heartbeat sets it running
        _set(store_url, "UPDATE experiments SET status = 'crashed', ended_at = :t", t=_now())
        deadline = time.monotonic() + WAIT_S
        while _rows(store_url, "SELECT status, ended_at FROM experiments") != [("running", None)]:
            assert time.monotonic() < deadline, "the live driver did not set it running"
            time.sleep(0.05)
    finally:
        _kill(first)
    assert _ls(store_url)[:2] == ["driven", "crashed"]


def test_a_reader_opened_before_the_takeover_shows_the_new_driver_running(
    sqlite_url: str,
) -> None:
    """`lab.inspect` shows a row crashed only while it is the row judged: one a new driver
    took over after the connection was made reads as it is."""
    _begin(sqlite_url, "driven", stay=False).wait()
    con = lab.inspect.connect(sqlite_url)
    try:
        assert con.sql("SELECT status FROM experiments").fetchall() == [("crashed",)]
        driver = _begin(sqlite_url, "driven", stay=True)
        try:
            assert con.sql("SELECT status FROM experiments").fetchall() == [("running",)]
        finally:
            _kill(driver)
    finally:
        con.close()
