"""What a `lab serve` client does when the server cannot take its writes: a server whose store
is down (503) is an outage like a dead server (spool, go on, ``lab sync`` later), a refused
token fails the run without dropping anything, a batch refused as bad data is the only one
ever dropped (with one line), and a spool on a full disk leaves no partial file. Real
servers, real stores on small real disks (tmpfs), real training runs."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_disk_full import _fill, _mounted
from test_serve_ingest import SLOW_STEPS, _count, _every_row_once, slow_train

from lab import Callback, Experiment
from lab.errors import StoreError
from lab.records import EvalResult
from lab.server.auth import create_token
from lab.store import Store
from lab.store.http import HttpStore
from lab.store.http.spool import SPOOL_DIR, describe
from tests import warm
from tests.served import Served, serve

ROOT = Path(__file__).resolve().parents[1]


def _sync(run_dir: Path, url: str, token: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LAB_TOKEN": token}
    return warm.run([sys.executable, "-m", "lab.cli", "sync", str(run_dir), "--store", url],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip


def _spool_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob(f"{SPOOL_DIR}/*"))


# -- 503: the server is up, its store is not ---------------------------------------------------
@pytest.fixture
def server_on_a_small_disk(tmp_path: Path) -> Iterator[tuple[Served, Path]]:
    """A real `lab serve` in front of a SQLite store on its own 8 MiB disk (a tmpfs)."""
    for disk in _mounted(tmp_path / "server-disk", "8m"):
        served = serve(f"sqlite:///{disk / 'lab.db'}")
        try:
            yield served, disk
        finally:
            served.stop()


class FillsTheServersDisk(Callback):
    """Fills the server's disk at one step (it then answers 503 to every write), and notes
    the spool as the run ends."""

    def __init__(self, disk: Path, at: int) -> None:
        self.disk, self.at = disk, at
        self.filler: Path | None = None

    def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: Any) -> None:
        time.sleep(0.01)  # a step that takes a while, so batches go out during the outage
        if step_idx == self.at:
            self.filler = _fill(self.disk)


def test_a_server_whose_store_fails_answers_503_and_the_run_spools_and_goes_on(
    server_on_a_small_disk: tuple[Served, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    served, disk = server_on_a_small_disk
    monkeypatch.setenv("LAB_TOKEN", served.write_token)
    monkeypatch.setenv("LAB_HTTP_RETRY_S", "0.5")
    full = FillsTheServersDisk(disk, at=20)
    with caplog.at_level(logging.WARNING, logger="lab.store.http"):
        result = Experiment("offline", train=slow_train, store=served.url,
                            output_dir=str(tmp_path / "runs"), callbacks=[full]).run()  # fmt: skip
    assert [r.status for r in result.runs] == ["completed"]  # it trained on, to the end
    files = _spool_files(tmp_path / "runs")
    held = [describe(f.suffix[1:], f.read_bytes()) for f in files]  # each a whole batch
    assert any("metric row" in h for h in held) and any("finish_run" in h for h in held)
    spooled = [r.getMessage() for r in caplog.records if "batches are spooled to" in r.getMessage()]
    assert len(spooled) == 1
    assert re.fullmatch(
        rf"lab: lab serve at {served.url} answered 503 for \d+\.\ds \(LAB_HTTP_RETRY_S\): the "
        r"store behind the server failed; try again later \(the server's log says why\); "
        r"batches are spooled to "
        rf"{tmp_path / 'runs'}/offline/base-r0/{SPOOL_DIR} from batch \d+ on, the run goes on, "
        r"and they are replayed when the server answers \(or: lab sync RUN_DIR\)",
        spooled[0],
    ), spooled
    run_dir = files[0].parent.parent
    left = [r.getMessage() for r in caplog.records if "stay spooled" in r.getMessage()]
    assert left == [
        f"lab: {len(files)} batches stay spooled (lab serve at {served.url} answered 503: the "
        "store behind the server failed; try again later (the server's log says why)); send "
        "them when it is back "
        f"with: lab sync {run_dir} --store {served.url}"
    ]
    assert full.filler is not None
    full.filler.unlink()  # the server's store can be written again
    done = _sync(run_dir, served.url, served.write_token)
    assert (done.returncode, done.stdout, done.stderr) == (
        0, f"sent {len(files)} spooled batches to {served.url}\n", "",
    )  # fmt: skip
    assert _spool_files(tmp_path / "runs") == []
    _every_row_once(served.store_url)  # every row of the run, each exactly once


# -- 401: the token is refused mid-run ---------------------------------------------------------
class RevokesTheToken(Callback):
    def __init__(self, store_url: str, at: int) -> None:
        self.store_url, self.at = store_url, at

    def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: Any) -> None:
        time.sleep(0.01)
        if step_idx == self.at:  # as an admin would, from elsewhere
            revoke = [sys.executable, "-m", "lab.cli", "token", "revoke", "tests-write",
                      "--store", self.store_url]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            warm.run(revoke, env=env, check=True, capture_output=True, timeout=120)


def test_a_token_refused_mid_run_fails_the_run_and_drops_nothing(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(served.store_url)
    try:  # the token the rows are sent with later: an operator grants it the experiment
        fresh = create_token(store.engine, "tests-write-2", "write", experiment="revoked")
    finally:
        store.close()
    monkeypatch.setenv("LAB_TOKEN", served.write_token)
    monkeypatch.setenv("LAB_HTTP_RETRY_S", "0.5")
    result = Experiment("revoked", train=slow_train, store=served.url,
                        output_dir=str(tmp_path / "runs"),
                        callbacks=[RevokesTheToken(served.store_url, at=20)]).run()  # fmt: skip
    [run] = result.runs
    assert run.status == "failed"
    run_dir = tmp_path / "runs" / "revoked" / "base-r0"
    assert run.error == (
        f"TokenRejected: lab serve at {served.url} refused the token in LAB_TOKEN: it is wrong "
        "or revoked; make one with lab token create NAME --scope write on the server's store; "
        f"the run stops, and its batches are kept in {run_dir / SPOOL_DIR}: send them with a "
        f"token the server takes: lab sync {run_dir} --store {served.url}"
    )
    # what reached the server before the refusal
    [(stopped,)] = _count(served.store_url, "select coalesce(max(step), 0) from metrics")
    assert stopped < SLOW_STEPS
    done = _sync(run_dir, served.url, fresh)
    assert done.returncode == 0 and done.stdout.startswith("sent "), done.stderr
    # the run's rows, each once, and the run's end as the run recorded it
    steps = _count(served.store_url, "select count(*), count(distinct step), min(step), "
                   "max(step) from metrics where key = 'loss'")  # fmt: skip
    last = steps[0][3]
    assert steps == [(last, last, 1, last)] and stopped <= last < SLOW_STEPS
    [(status, error)] = _count(served.store_url, "select status, error from runs")
    assert status == "failed"  # the run's end, as the run recorded it (the store masks a word)
    head, tail = run.error.split(" is wrong or revoked")  # type: ignore[union-attr]
    assert error.startswith(head.rsplit(" ", 1)[0]) and error.endswith(tail)


# -- 4xx: bad data is the one thing dropped, with one line --------------------------------------
def test_a_batch_refused_as_bad_data_is_dropped_with_one_line_and_the_run_goes_on(
    served: Served, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = HttpStore(served.url, token=served.write_token)
    try:
        exp = store.begin_experiment("bad", config={}, seed=0, repeats=1)
        group = store.add_group(exp, "g")
        run = store.start_run(exp, group, run_key="r0", arm_id=None, repeat=0, stage=0, seed=0,
                              config={}, output_dir=str(tmp_path / "r0"))  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="lab.store.http"):
            for step in (1, 2, 3):
                store.log_metrics(run, step, {"loss": float(step)})
            store.flush()
            store.write_eval(run, EvalResult("val\x00", {"loss": 0.5}, step=3))  # NUL: refused
            store.flush()
            for step in (4, 5):
                store.log_metrics(run, step, {"loss": float(step)})
            store.write_eval(run, EvalResult("val", {"loss": 0.25}, step=5))
            store.finish_run(run, status="completed")
            store.flush()
    finally:
        store.close()
    warned = [r.getMessage() for r in caplog.records if r.name == "lab.store.http"]
    assert len(warned) == 1, warned
    assert re.fullmatch(
        rf"lab: {served.url} refused batch \d+ \(1 write \(write_eval\) of run {run}\) as bad "
        r"data \(400: eval name 'val\\x00' holds a NUL character \(\\x00\), which the store "
        r"cannot hold: remove it\); it is dropped, the run goes on",
        warned[0],
    ), warned
    url = served.store_url
    assert _count(url, "select step, value from metrics order by step") == [
        (s, float(s)) for s in (1, 2, 3, 4, 5)
    ]
    assert _count(url, "select name, step from evals") == [("val", 5)]
    assert _count(url, "select status from runs") == [("completed",)]
    assert not (tmp_path / "r0" / SPOOL_DIR).exists()


# -- a spool on a full disk ---------------------------------------------------------------------
def test_a_spool_on_a_full_disk_leaves_no_partial_file_and_names_lab_http_retry_s(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for disk in _mounted(tmp_path / "run-disk", "1m"):
        run_dir = disk / "r0"
        store = HttpStore(served.url, token=served.write_token, retry_s=0.3)
        try:
            exp = store.begin_experiment("spool", config={}, seed=0, repeats=1)
            run = store.start_run(exp, store.add_group(exp, "g"), run_key="r0", arm_id=None,
                                  repeat=0, stage=0, seed=0, config={},
                                  output_dir=str(run_dir))  # fmt: skip
            store.log_metrics(run, 0, {"loss": 0.0})
            store.flush()
            served.kill()  # away: batches go to the spool, on a disk about to fill up
            filler = _fill(disk)
            filler.write_bytes(b"\0" * (filler.stat().st_size - 96 * 1024))  # 96 KiB free
            keys = [f"k{i:03d}" for i in range(100)]
            logged = 0
            with pytest.raises(StoreError) as info:
                for step in range(1, 2001):
                    store.log_metrics(run, step, dict.fromkeys(keys, float(step)))
                    logged = step
                    if step % 10 == 0:  # a batch of 1,000 rows (about 20 KB) each time
                        store.flush()
            assert re.fullmatch(
                r"\d+ metric rows are not written: the store has failed for \d+\.\ds \(a "
                r"batch of \d+ metric rows can be neither sent to "
                rf"{served.url} nor spooled to {run_dir / SPOOL_DIR}: No space left on "
                r"device\); they are kept and retried \(LAB_HTTP_RETRY_S sets how long to "
                r"wait, now 0\.3s\)",
                str(info.value),
            ), str(info.value)
            files = _spool_files(run_dir)
            assert files and not [f for f in files if f.name.endswith(".part")]
            for f in files:
                describe(f.suffix[1:], f.read_bytes())  # each whole, none empty
            filler.unlink()  # room again, and the server back: everything goes out
            served.start()
            store.finish_run(run, status="completed")
            deadline = time.monotonic() + 60
            while True:  # (a retry begun before the room was made may fail once more)
                try:
                    store.flush()
                    break
                except StoreError:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
        finally:
            store.close()
        assert _spool_files(run_dir) == []
    got = _count(served.store_url, "select count(*), count(distinct step), max(step) from "
                 "metrics where key = 'k000'")  # fmt: skip
    assert got == [(logged, logged, logged)]
    assert _count(served.store_url, "select count(*) from metrics where key != 'loss'") == [
        (logged * 100,)
    ]


def test_lab_sync_never_sends_a_partial_or_empty_spool_file_and_says_so(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAB_TOKEN", served.write_token)
    store = HttpStore(served.url, token=served.write_token, retry_s=0.3)
    run_dir = tmp_path / "r0"
    try:
        exp = store.begin_experiment("sync", config={}, seed=0, repeats=1)
        run = store.start_run(exp, store.add_group(exp, "g"), run_key="r0", arm_id=None,
                              repeat=0, stage=0, seed=0, config={},
                              output_dir=str(run_dir))  # fmt: skip
        store.flush()
        served.kill()
        for step in (1, 2, 3):
            store.log_metrics(run, step, {"loss": float(step)})
            store.flush()
    finally:
        store.close()
    spool = run_dir / SPOOL_DIR
    good = _spool_files(run_dir)
    assert len(good) >= 1
    client = good[0].name.split("-")[0]
    (spool / f"{client}-000000000900.arrow").write_bytes(b"")  # empty
    (spool / f"{client}-000000000901.arrow.part").write_bytes(good[0].read_bytes()[:20])
    cut = good[0].read_bytes()
    (spool / f"{client}-000000000902.arrow").write_bytes(cut[: len(cut) // 2])
    served.start()
    done = _sync(run_dir, served.url, served.write_token)
    assert done.returncode == 1
    assert done.stdout == f"sent {len(good)} spooled batch{'es' if len(good) > 1 else ''} " \
                          f"to {served.url}\n"  # fmt: skip
    lines = done.stderr.splitlines()
    assert lines[0] == (
        f"lab: not sent: {spool / f'{client}-000000000901.arrow.part'} (an unfinished write: "
        "part of a batch at most)"
    )
    assert lines[1] == (
        f"lab: not sent: {spool / f'{client}-000000000900.arrow'} (not a whole batch: it is empty)"
    )
    assert lines[2].startswith(
        f"lab: not sent: {spool / f'{client}-000000000902.arrow'} (not a whole batch: not a "
        "whole Arrow stream: "
    )
    assert len(lines) == 3
    assert _count(served.store_url, "select step, value from metrics order by step") == [
        (1, 1.0), (2, 2.0), (3, 3.0)
    ]  # fmt: skip
    assert sorted(p.name for p in spool.iterdir()) == [
        f"{client}-000000000900.arrow",
        f"{client}-000000000901.arrow.part",
        f"{client}-000000000902.arrow",
    ]  # the damaged files are left where they are


# -- 413: a batch over the server's body limit --------------------------------------------------
def test_a_batch_over_the_body_limit_is_sent_in_halves_and_one_step_over_it_is_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    served = serve(f"sqlite:///{tmp_path / 'lab.db'}", max_body=8192)
    try:
        store = HttpStore(served.url, token=served.write_token)
        try:
            exp = store.begin_experiment("big", config={}, seed=0, repeats=1)
            group = store.add_group(exp, "g")
            run = store.start_run(exp, group, run_key="r0", arm_id=None, repeat=0, stage=0,
                                  seed=0, config={}, output_dir=None)  # fmt: skip
            keys = [f"k{i:02d}" for i in range(20)]
            with caplog.at_level(logging.WARNING, logger="lab.store.http"):
                for step in range(1, 101):  # one batch of 2,000 rows, about 30 KB
                    store.log_metrics(run, step, dict.fromkeys(keys, float(step)))
                store.flush()
                assert caplog.records == []  # sent in parts, none refused
                store.log_metrics(run, 101, {f"x{i:04d}": 1.0 for i in range(1000)})
                store.flush()
        finally:
            store.close()
        warned = [r.getMessage() for r in caplog.records if r.name == "lab.store.http"]
        assert len(warned) == 1
        assert re.fullmatch(
            rf"lab: {served.url} refused batch \d+ \(1000 metric rows of run {run}\) as too "
            rf"large \(413: lab serve at {served.url} refused a body over its limit: the request "
            r"body is over the server's limit of 8192 bytes; .*\); it is dropped, the run goes on",
            warned[0],
        ), warned
        got = _count(served.store_url, "select count(*), count(distinct step) from metrics")
        assert got == [(2000, 100)]  # every row of the batch, once; the step over it dropped
    finally:
        served.stop()
