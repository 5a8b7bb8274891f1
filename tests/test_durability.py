"""Durability: heartbeats and crashed runs, bad metric input, a PostgreSQL server that goes
away and comes back (through a real TCP proxy on loopback), and the flush at process exit
and on SIGTERM / SIGINT in real subprocesses."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
import torch
from test_store import WAIT_S, _new_run, _rows, _scalar

from lab import Callback, Evaluator, Experiment, LoopArtifacts, RunSpec, TrainingLoop
from lab.errors import MetricError, StoreError, StoreUnreachable
from lab.store import Store
from lab.store._values import _now
from tests import warm


# -- heartbeats and crashed runs ----------------------------------------------------------------
def test_the_writer_keeps_a_quiet_runs_heartbeat(store_url: str) -> None:
    store = Store(store_url, heartbeat_s=0.05)
    try:
        run_id = _new_run(store)
        first = _scalar(store_url, "SELECT heartbeat_at FROM runs WHERE run_id = :r", r=run_id)
        deadline = time.monotonic() + WAIT_S
        while _scalar(store_url, "SELECT heartbeat_at FROM runs WHERE run_id = :r", r=run_id) == (
            first
        ):
            assert time.monotonic() < deadline, "the heartbeat never moved"
            time.sleep(0.05)
        store.finish_run(run_id, status="completed")
        time.sleep(0.3)  # a finished run is no longer beaten
        done = _scalar(store_url, "SELECT heartbeat_at FROM runs WHERE run_id = :r", r=run_id)
        time.sleep(0.3)
        assert _scalar(store_url, "SELECT heartbeat_at FROM runs WHERE run_id = :r", r=run_id) == (
            done
        )
    finally:
        store.close()


def _running_elsewhere(url: str, run_key: str, seen_ago_s: float) -> None:
    """Make a run look like one running on another machine, last seen `seen_ago_s` ago."""
    engine = sa.create_engine(sa.engine.make_url(Store(url, migrate=False).url))
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE runs SET status = 'running', host = 'gpu-node-7', pid = 4242, "
                    "heartbeat_at = :beat WHERE run_key = :key"
                ),
                {"beat": _now() - timedelta(seconds=seen_ago_s), "key": run_key},
            )
    finally:
        engine.dispose()


def test_a_stale_heartbeat_on_another_host_is_crashed_on_open(store_url: str) -> None:
    store = Store(store_url)
    stale, fresh = _new_run(store, run_key="stale"), _new_run(store, run_key="fresh")
    store.finish_run(stale, status="completed")
    store.finish_run(fresh, status="completed")
    store.close()
    _running_elsewhere(store_url, "stale", 301)
    _running_elsewhere(store_url, "fresh", 60)
    store = Store(store_url)  # opening judges them: 300 s without a heartbeat is a crash
    store.close()
    rows = _rows(store_url, "SELECT run_key, status, error FROM runs ORDER BY run_key")
    assert [(r["run_key"], r["status"]) for r in rows] == [
        ("fresh", "running"),
        ("stale", "crashed"),
    ]
    assert rows[1]["error"].startswith(
        "its process (pid 4242 on gpu-node-7) was last seen 30"
    ) and rows[1]["error"].endswith("s ago while the run was running")


def test_lab_ls_and_show_show_a_stale_run_as_crashed_and_write_nothing(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    run_id = _new_run(store, experiment="far")
    store.finish_run(run_id, status="completed")
    store.close()
    _running_elsewhere(sqlite_url, "r0", 3600)
    out = warm.run(
        [sys.executable, "-m", "lab.cli", "ls", "--store", sqlite_url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "1 crashed" in out.stdout and "1 running" not in out.stdout
    out = warm.run(
        [sys.executable, "-m", "lab.cli", "show", "far", "--store", sqlite_url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (row,) = out.stdout.splitlines()[-1:]
    assert row.split()[:5] == ["r0", "-", "0", "0", "crashed"], out.stdout
    assert "was last seen 36" in row and row.endswith("s ago while the run was running")
    # commands that only read show it; the next store opened for writing records it
    assert _scalar(sqlite_url, "SELECT status FROM runs") == "running"


# -- bad input -------------------------------------------------------------------------------------
def test_numbers_of_every_kind_are_taken(store: Store, store_url: str) -> None:
    run_id = _new_run(store)
    store.log_metrics(
        run_id,
        1,
        {"f": 0.5, "i": 3, "b": True, "t0": torch.tensor(2.5), "t1": torch.tensor([4.0]),
         "np": np.float32(0.25), "nan": float("nan"), "inf": float("-inf")},
    )  # fmt: skip
    store.flush()
    got = dict(
        (r["key"], r["value"])
        for r in _rows(store_url, 'SELECT "key", value FROM metrics WHERE "key" <> \'nan\'')
    )
    assert got == {"f": 0.5, "i": 3.0, "b": 1.0, "t0": 2.5, "t1": 4.0, "np": 0.25, "inf": -np.inf}


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ({"ok": 1.0, "acc": "high"}, "metric 'acc' at step 7 is a str ('high'); log a number"),
        (
            {"ok": 1.0, "w": torch.ones(2, 3)},
            "metric 'w' at step 7 is a tensor of shape (2, 3); log a number or a one-element",
        ),
        ({"ok": 1.0, "": 2.0}, "metric key '' at step 7 is not a non-empty string"),
        (
            {"ok": 1.0, "k" * 300: 2.0},
            "metric key 'kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk'... at step 7 is 300 "
            "characters long; keys hold at most 255",
        ),
        ({"ok": 1.0, "a\x00b": 2.0}, "metric key 'a\\x00b' at step 7 holds a NUL character"),
    ],
)
def test_bad_metrics_are_one_clear_error_and_queue_nothing(
    store: Store, store_url: str, metrics: dict, message: str
) -> None:
    run_id = _new_run(store)
    with pytest.raises(MetricError) as info:
        store.log_metrics(run_id, 7, metrics)
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)
    store.flush()
    assert _scalar(store_url, "SELECT count(*) FROM metrics") == 0  # not even "ok"


def test_a_bad_extra_metric_fails_the_run_naming_key_and_step(sqlite_url: str) -> None:
    import lab
    from lab.loop import TrainingLoop

    def train(run: lab.RunSpec) -> lab.LoopArtifacts:
        model = torch.nn.Linear(2, 1)

        def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, dict]:
            loss = model(batch).pow(2).mean()
            return loss, {"label": "cat" if run.repeat == 0 else 1.0}

        data = [torch.ones(4, 2)] * 3
        loop = TrainingLoop(model, torch.optim.SGD(model.parameters(), 0.1), data, loss_fn, 3)
        return loop.fit(run)

    result = lab.Experiment("bad", train, repeats=2, store=sqlite_url).run()
    assert [r.status for r in result.runs] == ["failed", "completed"]
    assert result.runs[0].error == (
        "MetricError: metric 'label' at step 1 is a str ('cat'); "
        "log a number (int, float or a one-element tensor)"
    )


# -- a PostgreSQL server that goes away --------------------------------------------------------
class Proxy:
    """A real TCP proxy on loopback in front of PostgreSQL, which a test can cut and restore."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.up = True
        self.pairs: list[socket.socket] = []
        self.lock = threading.Lock()  # a connection opened while `cut` runs dies with it
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if not self.up:
                client.close()  # the server is "down": every connection dies at once
                continue
            upstream = socket.create_connection(self.target)
            with self.lock:
                alive = self.up
                if alive:
                    self.pairs += [client, upstream]
            if not alive:  # cut while this one was being opened
                for s in (client, upstream):
                    s.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self.lock:
            self.up = False
            pairs, self.pairs = self.pairs, []
        for s in pairs:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def restore(self) -> None:
        self.up = True

    def close(self) -> None:
        self.cut()
        self.server.close()


@pytest.fixture
def proxied(pg_url: str) -> tuple[str, str, Proxy]:
    """(direct URL, URL through the proxy, the proxy)."""
    url = sa.engine.make_url(pg_url)
    proxy = Proxy(url.host or "127.0.0.1", url.port or 5432)
    through = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    yield pg_url, through, proxy
    proxy.close()


def test_rows_logged_while_postgres_is_away_are_written_when_it_returns(
    proxied: tuple[str, str, Proxy],
) -> None:
    direct, through, proxy = proxied
    store = Store(through, give_up_s=WAIT_S)
    run_id = _new_run(store)
    for step in range(1, 51):
        store.log_metrics(run_id, step, {"loss": float(step), "acc": 0.5})
    store.flush()
    proxy.cut()
    for step in range(51, 101):
        store.log_metrics(run_id, step, {"loss": float(step), "acc": 0.5})
    errors: list[BaseException] = []
    flusher = threading.Thread(target=lambda: _catch(store.flush, errors))
    flusher.start()
    flusher.join(1.0)
    assert flusher.is_alive()  # the flush waits out the outage ...
    assert _scalar(direct, "SELECT count(*) FROM metrics") == 100
    proxy.restore()
    flusher.join(WAIT_S)
    assert not flusher.is_alive() and errors == []  # ... and returns once the rows are in
    assert _scalar(direct, "SELECT count(*) FROM metrics") == 200
    summary = _rows(direct, 'SELECT "count", last_step FROM summaries WHERE "key" = \'loss\'')
    assert summary == [{"count": 100, "last_step": 100}]
    store.close()


def _catch(fn: object, errors: list[BaseException]) -> None:
    try:
        fn()  # type: ignore[operator]
    except BaseException as exc:
        errors.append(exc)


def test_an_outage_longer_than_the_window_fails_with_the_unwritten_count(
    proxied: tuple[str, str, Proxy],
) -> None:
    direct, through, proxy = proxied
    store = Store(through, give_up_s=0.5)
    run_id = _new_run(store)
    proxy.cut()
    for step in range(1, 31):
        store.log_metrics(run_id, step, {"loss": 1.0, "acc": 2.0, "lr": 3.0})
    with pytest.raises(StoreError) as info:
        store.flush()
    message = str(info.value)
    assert message.startswith("90 metric rows are not written: the store has failed for "), message
    assert "they are kept and retried (LAB_STORE_RETRY_S sets how long to wait, now 0.5s)" in (
        message
    )
    assert "\n" not in message
    proxy.restore()  # it comes back later: nothing was dropped
    store.flush()
    assert _scalar(direct, "SELECT count(*) FROM metrics") == 90
    store.close()


# -- the end of the process ---------------------------------------------------------------------
def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_metrics_still_buffered_at_exit_are_written(sqlite_url: str, tmp_path: Path) -> None:
    child = _script(
        tmp_path,
        f"""
        from lab.store import Store
        store = Store({sqlite_url!r})
        exp = store.begin_experiment("e", config={{}}, seed=0, repeats=1)
        run = store.start_run(exp, store.add_group(exp, "g"), run_key="r", arm_id=None,
                              repeat=0, stage=0, seed=0, config={{}}, output_dir=None)
        for step in range(1, 2001):
            store.log_metrics(run, step, {{"loss": step / 10, "acc": 1.0}})
        # no flush and no close: the interpreter's exit must write them
        """,
    )
    out = warm.run([sys.executable, str(child)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert _scalar(sqlite_url, "SELECT count(*) FROM metrics") == 4000
    assert _scalar(sqlite_url, "SELECT max(step) FROM metrics") == 2000


TRAIN_FOREVER = """
    import sys, time, torch, lab
    from lab.loop import TrainingLoop

    class Say(lab.Callback):
        def on_step_end(self, state, step_idx, batch, metrics):
            print(step_idx, flush=True)
            time.sleep(0.002)

    def train(run):
        model = torch.nn.Linear(4, 1)
        data = [torch.randn(8, 4) for _ in range(4)]
        loop = TrainingLoop(model, torch.optim.SGD(model.parameters(), 0.01), data,
                            lambda m, b: m(b).pow(2).mean(), 10**7, callbacks=[Say()])
        return loop.fit(run)

    lab.Experiment("forever", train, store={url!r}, output_dir={out!r}).run()
"""


@pytest.mark.serial
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, -signal.SIGINT)])
def test_a_signal_records_the_run_and_loses_no_logged_step(
    sqlite_url: str, tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    child = _script(tmp_path, TRAIN_FOREVER.format(url=sqlite_url, out=str(tmp_path / "runs")))
    proc = warm.popen(
        [sys.executable, str(child)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    printed = 0
    for line in proc.stdout:  # every printed step was handed to the store first
        printed = int(line)
        if printed >= 300:
            break
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    steps = [
        r["step"] for r in _rows(sqlite_url, "SELECT DISTINCT step FROM metrics ORDER BY step")
    ]
    assert steps[0] == 1 and steps == list(range(1, len(steps) + 1)) and len(steps) >= printed
    run = _rows(sqlite_url, "SELECT status, error FROM runs")
    name = "Terminated" if sig == signal.SIGTERM else "KeyboardInterrupt"
    assert run == [{"status": "failed", "error": f"interrupted ({name})"}]
    assert _scalar(sqlite_url, "SELECT status FROM experiments") == "failed"
    assert _scalar(sqlite_url, "SELECT last_step FROM summaries WHERE \"key\" = 'loss'") == len(
        steps
    )


class CutAt(Callback):
    """Cuts the proxy (the store's server goes away) after a given step."""

    def __init__(self, proxy: Proxy, step: int) -> None:
        self.proxy, self.step = proxy, step

    def on_step_end(self, state, step_idx, batch, metrics) -> None:
        if step_idx == self.step:
            self.proxy.cut()


def test_a_run_fails_when_postgres_stays_away_naming_the_unwritten_rows(
    proxied: tuple[str, str, Proxy],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    direct, through, proxy = proxied
    monkeypatch.setenv("LAB_STORE_RETRY_S", "0.5")

    def train(run: RunSpec) -> LoopArtifacts:
        model = torch.nn.Linear(2, 1)
        evaluator = Evaluator("val", lambda m: {"x": 1.0}, every=10)
        loop = TrainingLoop(
            model, torch.optim.SGD(model.parameters(), 0.1), [torch.ones(4, 2)] * 5,
            lambda m, b: m(b).pow(2).mean(), 30, evaluators=[evaluator],
            callbacks=[CutAt(proxy, 15)],
        )  # fmt: skip
        return loop.fit(run)

    experiment = Experiment("away", train, store=through, output_dir=tmp_path / "runs")
    with (
        caplog.at_level(logging.ERROR, logger="lab.experiment"),
        pytest.raises(StoreUnreachable) as info,
    ):
        experiment.run()
    # The flush at the step-20 eval waited 0.5 s for the server, then failed the run, with
    # the count of rows it could not write ...
    (failed,) = [r for r in caplog.records if r.getMessage().startswith("run base-r0 of away")]
    last = failed.getMessage().rstrip().splitlines()[-1]  # the traceback's last line
    assert re.fullmatch(
        r"lab\.errors\.StoreError: \d+ metric rows are not written: the store has failed for "
        r"[\d.]+s \(.+\); they are kept and retried \(LAB_STORE_RETRY_S sets how long to wait, "
        r"now 0\.5s\)",
        last,
    ), last
    # ... and the experiment, which could not record its own end either, stops with one line
    # that names the store and what to do, not a driver traceback.
    message = str(info.value)
    assert message.startswith("cannot reach the store at postgresql+psycopg://"), message
    assert message.endswith("; start the server or fix LAB_STORE_URL / the store URL")
    assert "\n" not in message
    # durable up to the last flush point before the cut: the eval at step 10
    assert _scalar(direct, "SELECT max(step) FROM metrics") >= 10
