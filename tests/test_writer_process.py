"""The metric writer process: real SQLite files, real processes killed with SIGKILL, the
replayed batch, the flush at a checkpoint and at exit, and the stores that keep the thread."""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_durability import _catch, _script
from test_store import WAIT_S, _new_run, _rows, _scalar

from lab import Callback, CheckpointConfig, SqlLogger, TrainingLoop
from lab.errors import ConfigError, StoreError
from lab.store import Store, writer_process
from lab.store.store import INTERVAL_S, PROCESS_INTERVAL_S
from lab.store.writer_process import WriterProcess
from tests import warm


def _gone(pid: int) -> bool:
    """True once `pid` has ended (a zombie not yet reaped counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while not _gone(pid):
        assert time.monotonic() < deadline, f"process {pid} is still there"
        time.sleep(0.02)


def _kill(store: Store) -> int:
    """SIGKILL the store's writer process and wait until it is gone; returns its pid."""
    assert store._process is not None
    pid = store._process.pid
    proc = writer_process._shared()._proc
    assert pid is not None and proc is not None and proc.pid == pid
    os.kill(pid, signal.SIGKILL)
    proc.wait(WAIT_S)
    return pid


def test_a_file_store_writes_in_a_process_of_its_own(sqlite_url: str) -> None:
    store = Store(sqlite_url, writer="process")
    assert store._process is not None
    pid = store._process.pid
    try:
        assert store.writer_mode == "process" and pid not in (None, os.getpid())
        run_id = _new_run(store)
        for step in range(1, 101):
            store.log_metrics(run_id, step, {"loss": step / 4})
        store.flush()  # returns once committed: another connection sees every row now
        with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
            assert conn.execute("SELECT count(*), sum(value) FROM metrics").fetchone() == (
                100,
                sum(step / 4 for step in range(1, 101)),
            )
    finally:
        store.close()
    assert store._process is None
    assert pid is not None and not _gone(pid)  # shared by this process's stores: it stays
    again = Store(sqlite_url, writer="process")
    assert again._process is not None and again._process.pid == pid
    again.close()


def _holds(pid: int, path: str) -> bool:
    """Whether process `pid` has the file at `path` open (its /proc fd links)."""
    target = os.path.realpath(path)
    folder = f"/proc/{pid}/fd"
    return any(os.path.realpath(os.path.join(folder, fd)) == target for fd in os.listdir(folder))


def test_the_writer_process_closes_a_sqlite_store_last_and_copies_its_wal_back(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing a SQLite file's last connection copies its WAL into the file (10-30 ms at the
    end of a run): the training process lets go first, so the writer process does it, after
    it answered, off the training process's path; every row is in the file once it has."""
    db = sqlite_url.removeprefix("sqlite:///")
    store = Store(sqlite_url, writer="process")
    assert store._process is not None and store._process.pid is not None
    pid = store._process.pid
    run_id = _new_run(store)
    for step in range(1, 2001):
        store.log_metrics(run_id, step, {f"m{i}": float(step * 10 + i) for i in range(10)})
    store.flush()
    held = []
    dispose = store.engine.dispose
    monkeypatch.setattr(store.engine, "dispose", lambda: (held.append(_holds(pid, db)), dispose()))
    store.close()
    assert held == [True]  # the writer process still had the file open as this one closed
    deadline = time.monotonic() + WAIT_S
    while _holds(pid, db) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _holds(pid, db) and not _gone(pid)  # it let go of this store, and stays
    assert not Path(db + "-wal").exists()  # the last close copied the WAL in and removed it
    con = sqlite3.connect(db)
    try:
        assert con.execute("SELECT count(*), sum(value) FROM metrics").fetchone() == (
            20_000,
            sum(range(10, 20_010)),
        )
    finally:
        con.close()


def test_sigkill_of_the_writer_process_loses_no_row(sqlite_url: str) -> None:
    store = Store(sqlite_url, writer="process")
    try:
        run_id = _new_run(store)
        for step in range(1, 501):
            store.log_metrics(run_id, step, {"loss": step / 10, "acc": 1.0, "lr": 0.5})
        store.flush()
        first = _kill(store)
        for step in range(501, 1001):  # buffered while no writer process is alive
            store.log_metrics(run_id, step, {"loss": step / 10, "acc": 1.0, "lr": 0.5})
        restarts = writer_process._shared().restarts
        store.flush()  # a new process is started, and the batch written by it
        assert store._process is not None and store._process.restarts == restarts + 1
        assert store._process.pid != first
        assert _scalar(sqlite_url, "SELECT count(*) FROM metrics") == 3000
        steps = _rows(
            sqlite_url, "SELECT step, value FROM metrics WHERE key = 'loss' ORDER BY step"
        )
        assert [r["step"] for r in steps] == list(range(1, 1001))
        assert [r["value"] for r in steps] == [step / 10 for step in range(1, 1001)]
        summary = _rows(
            sqlite_url,
            'SELECT "count", first_step, last_step, last_value, min_value, max_value '
            "FROM summaries WHERE key = 'loss'",
        )
        assert summary == [
            {"count": 1000, "first_step": 1, "last_step": 1000, "last_value": 100.0,
             "min_value": 0.1, "max_value": 100.0}
        ]  # fmt: skip
    finally:
        store.close()


def test_the_batch_in_flight_when_the_process_is_killed_is_written_again(
    sqlite_url: str,
) -> None:
    """A batch the process was writing (held up by another connection's lock) when it was
    killed is sent again, whole, to the process started after it."""
    store = Store(sqlite_url, writer="process")
    try:
        run_id = _new_run(store)
        store.log_metrics(run_id, 0, {"loss": 0.0})
        store.flush()  # the process is up and has written once
        blocker = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")  # the next write waits on SQLite's busy timeout
        for step in range(1, 301):
            store.log_metrics(run_id, step, {"loss": float(step), "acc": -float(step)})
        errors: list[BaseException] = []
        flusher = threading.Thread(target=lambda: _catch(store.flush, errors))
        flusher.start()
        time.sleep(0.5)  # the batch is in the process, waiting for the lock
        assert flusher.is_alive()
        restarts = writer_process._shared().restarts
        _kill(store)
        time.sleep(0.3)  # the next process has the same batch, and waits for the lock too
        blocker.execute("ROLLBACK")
        blocker.close()
        flusher.join(WAIT_S)
        assert not flusher.is_alive() and errors == []
        assert store._process is not None and store._process.restarts == restarts + 1
        assert _scalar(sqlite_url, "SELECT count(*) FROM metrics") == 601
        assert _scalar(sqlite_url, "SELECT sum(value) FROM metrics WHERE key = 'acc'") == -sum(
            range(1, 301)
        )
        assert _rows(sqlite_url, 'SELECT key, "count", last_step FROM summaries ORDER BY key') == [
            {"key": "acc", "count": 300, "last_step": 300},
            {"key": "loss", "count": 301, "last_step": 300},
        ]
    finally:
        store.close()


def test_a_batch_written_twice_is_the_same_rows_and_summaries(sqlite_url: str) -> None:
    """What a replay does when the killed process had committed before it answered."""
    store = Store(sqlite_url, writer="thread")
    run_id = _new_run(store)
    write = WriterProcess(sqlite_url, lambda: ())
    try:
        batch = [(run_id, step, {"loss": 10.0 - step, "acc": step / 2}, 0.0) for step in range(10)]
        write(batch)
        write(batch)
        assert _scalar(sqlite_url, "SELECT count(*) FROM metrics") == 20
        assert _rows(
            sqlite_url,
            'SELECT key, "count", first_step, last_step, last_value, min_value, max_value '
            "FROM summaries ORDER BY key",
        ) == [
            {"key": "acc", "count": 10, "first_step": 0, "last_step": 9, "last_value": 4.5,
             "min_value": 0.0, "max_value": 4.5},
            {"key": "loss", "count": 10, "first_step": 0, "last_step": 9, "last_value": 1.0,
             "min_value": 1.0, "max_value": 10.0},
        ]  # fmt: skip
    finally:
        write.close()
        store.close()


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_rows_the_store_rejects_raise_the_same_error_from_both_writers(
    sqlite_url: str, writer: str
) -> None:
    store = Store(sqlite_url, writer=writer, give_up_s=5)
    try:
        assert store.writer_mode == writer
        store.log_metrics(9999, 1, {"loss": 1.0, "acc": 2.0})  # no such run
        with pytest.raises(StoreError) as info:
            store.flush()
        assert str(info.value) == (
            "2 metric rows are not written: the store rejected them (FOREIGN KEY constraint "
            "failed); they are kept and retried (LAB_STORE_RETRY_S sets how long to wait, "
            "now 5s)"
        )
    finally:
        store._writer._buffer.clear()  # type: ignore[union-attr]  # rows no store can take
        store.close()


def test_every_metric_up_to_a_checkpoint_is_committed_when_it_is_recorded(
    sqlite_url: str, tmp_path: Path
) -> None:
    seen: dict[int, int] = {}

    class Count(Callback):
        priority = -10  # after SqlLogger, which flushes and records the checkpoint

        def on_checkpoint(self, state, row) -> None:  # type: ignore[no-untyped-def]
            if row.event == "save":
                seen[row.step] = _scalar(sqlite_url, "SELECT count(DISTINCT step) FROM metrics")

    store = Store(sqlite_url, writer="process")
    model = torch.nn.Linear(2, 1)
    loop = TrainingLoop(
        model, torch.optim.SGD(model.parameters(), 0.1), [torch.ones(4, 2)] * 3,
        lambda m, b: m(b).pow(2).mean(), 60,
        checkpoint=CheckpointConfig(every=20, save_at_end=False),
        callbacks=[SqlLogger(store), Count()],
    )  # fmt: skip
    try:
        assert store.writer_mode == "process"
        loop.fit(run_dir=tmp_path / "run")
    finally:
        store.close()
    assert seen == {20: 20, 40: 40, 60: 60}


EXIT_SCRIPT = """
    import os, sys
    from lab.store import Store
    store = Store({url!r}, writer="process")
    print(store._process.pid, flush=True)
    exp = store.begin_experiment("e", config={{}}, seed=0, repeats=1)
    run = store.start_run(exp, store.add_group(exp, "g"), run_key="r", arm_id=None,
                          repeat=0, stage=0, seed=0, config={{}}, output_dir=None)
    for step in range(1, 3001):
        store.log_metrics(run, step, {{"loss": step / 10, "acc": 1.0}})
    {end}
"""


def test_nothing_is_lost_at_exit_and_the_process_ends_with_the_program(
    sqlite_url: str, tmp_path: Path
) -> None:
    child = _script(tmp_path, EXIT_SCRIPT.format(url=sqlite_url, end="# no flush, no close"))
    out = warm.run([sys.executable, str(child)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    _wait_gone(int(out.stdout.split()[0]))
    assert _scalar(sqlite_url, "SELECT count(*) FROM metrics") == 6000
    assert _scalar(sqlite_url, "SELECT sum(value) FROM metrics WHERE key = 'loss'") == (
        pytest.approx(sum(step / 10 for step in range(1, 3001)))
    )


def test_a_program_that_ends_before_its_writer_process_is_ready_prints_nothing(
    sqlite_url: str, tmp_path: Path
) -> None:
    """The process's "ready" frame then meets a closed pipe: it ends in silence, not with a
    BrokenPipeError on the program's stderr (which it shares)."""
    script = "from lab.store import Store\nprint(Store({url!r}, writer='process')._process.pid)"
    child = _script(tmp_path, script.format(url=sqlite_url))
    out = warm.run([sys.executable, str(child)], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stderr) == (0, "")
    _wait_gone(int(out.stdout))


def test_ctrl_c_to_the_group_leaves_the_writer_to_finish_the_flush(
    sqlite_url: str, tmp_path: Path
) -> None:
    """SIGINT to the whole process group (a terminal's Ctrl-C) interrupts the program, whose
    exit flushes through the writer process: that process ignores it."""
    end = "print('logged', flush=True); import time; time.sleep(60)"
    child = _script(tmp_path, EXIT_SCRIPT.format(url=sqlite_url, end=end))
    proc = warm.popen(
        [sys.executable, str(child)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    writer = int(proc.stdout.readline())
    assert proc.stdout.readline() == "logged\n"
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in err, err
    _wait_gone(writer)
    assert _scalar(sqlite_url, "SELECT count(*) FROM metrics") == 6000


def test_the_writer_process_ends_when_the_program_is_killed(
    sqlite_url: str, tmp_path: Path
) -> None:
    end = "print('logged', flush=True); import time; time.sleep(60)"
    child = _script(tmp_path, EXIT_SCRIPT.format(url=sqlite_url, end=end))
    proc = warm.popen([sys.executable, str(child)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    writer = int(proc.stdout.readline())
    assert proc.stdout.readline() == "logged\n"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(WAIT_S)
    _wait_gone(writer)  # its input closed with the program: it does not linger


def test_the_writer_is_chosen_and_stores_no_other_process_can_open_keep_the_thread(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LAB_STORE_WRITER", raising=False)
    default = Store(sqlite_url)
    assert default.writer_mode == "auto" and default._process is not None
    joined = default._process.joined  # (whether the shared process was ready already)
    assert default._write_interval() == (PROCESS_INTERVAL_S if joined else INTERVAL_S)
    default.close()
    monkeypatch.setenv("LAB_STORE_WRITER", "thread")
    thread = Store(sqlite_url)
    assert thread.writer_mode == "thread" and thread._process is None
    assert thread._write_interval() == INTERVAL_S == 0.25  # it writes: fewer transactions
    thread.close()
    monkeypatch.setenv("LAB_STORE_WRITER", "process")
    chosen = Store(sqlite_url)
    assert chosen.writer_mode == "process" and chosen._process is not None
    assert chosen._write_interval() == PROCESS_INTERVAL_S == 0.05  # it hands over: often
    chosen.close()
    memory = Store("sqlite:///:memory:")
    assert memory.writer_mode == "thread" and memory._process is None
    memory.close()
    reader = Store(sqlite_url, readonly=True)
    assert reader.writer_mode == "thread" and reader._process is None
    reader.close()
    monkeypatch.setenv("LAB_STORE_WRITER", "fork")
    with pytest.raises(
        ConfigError, match=r"unknown metric writer 'fork'; use one of auto, thread, pro"
    ):
        Store(sqlite_url)


def test_the_writer_process_opens_a_store_before_its_first_batch(
    sqlite_url: str, tmp_path: Path
) -> None:
    """As a store's writer thread starts, the process opens the store (an empty batch): the
    first real batch, perhaps the one a short fit's end waits for, finds it open."""
    store = Store(sqlite_url, writer="process")
    try:
        pid = store._process.pid  # type: ignore[union-attr]
        db = str(tmp_path / "lab.db")

        def opened() -> bool:
            fds = Path(f"/proc/{pid}/fd")
            return any(os.path.realpath(fd) == db for fd in fds.iterdir())

        assert not opened()
        run = _new_run(store)  # starts the writer thread
        deadline = time.monotonic() + WAIT_S
        while not opened():
            assert time.monotonic() < deadline, "the writer process never opened the store"
            time.sleep(0.01)
        assert _scalar(sqlite_url, "SELECT count(*) FROM metrics") == 0
        store.log_metrics(run, 1, {"loss": 1.0})
        store.flush()
        assert _rows(sqlite_url, "SELECT step, value FROM metrics") == [{"step": 1, "value": 1.0}]
    finally:
        store.close()


def test_a_replaced_write_function_is_run_by_the_thread(sqlite_url: str) -> None:
    store = Store(sqlite_url, writer="process")
    calls: list[int] = []
    write = store._write_metrics

    def counted(items: list) -> None:  # type: ignore[type-arg]
        calls.append(len(items))
        write(items)

    store._write_metrics = counted  # type: ignore[method-assign]
    try:
        run_id = _new_run(store)
        store.log_metrics(run_id, 1, {"loss": 1.0})
        store.flush()
        assert store.writer_mode == "thread" and store._process is None
        assert calls and sum(calls) == 1
    finally:
        store.close()


def test_where_no_writer_process_can_start_the_rows_are_written_here(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_process, "_CHILD", "import sys; sys.exit(3)")
    writer_process._forget_after_fork()  # a fresh writer process for this test: it fails
    store = Store(sqlite_url, writer="process", give_up_s=WAIT_S)
    try:
        assert store.writer_mode == "process"
        run_id = _new_run(store)
        for step in range(1, 51):
            store.log_metrics(run_id, step, {"loss": float(step)})
        store.flush()
        assert _scalar(sqlite_url, "SELECT count(*) FROM metrics") == 50
        assert _scalar(sqlite_url, "SELECT sum(value) FROM metrics") == sum(range(1, 51))
    finally:
        store.close()
        monkeypatch.undo()
        writer_process._forget_after_fork()  # the next test starts a working one
        writer_process._forget_after_fork()  # the next store starts a working one


AUTO_SCRIPT = """
    import json, time
    from lab.store import Store, writer_process as wp

    def new_run(store, name):
        exp = store.begin_experiment(name, config={{}}, seed=0, repeats=1)
        return store.start_run(exp, store.add_group(exp, "g"), run_key="r", arm_id=None,
                               repeat=0, stage=0, seed=0, config={{}}, output_dir=None)

    def log(store, run, step):
        store.log_metrics(run, step, {{f"k{{i}}": step + i / 10 for i in range(10)}})

    store = Store({url!r})  # the default: auto
    run = new_run(store, "e")
    shared = wp._shared()
    out = {{"mode": store.writer_mode}}
    for step in range(1, 151):  # 1,500 points: written by the thread
        log(store, run, step)
        if step % 10 == 0:
            store.flush()
    out["below"] = [shared.pid, store._process.joined, store._write_interval()]
    deadline = time.monotonic() + 60
    while not store._process.joined:  # never waits: the thread writes meanwhile
        assert time.monotonic() < deadline, "the writer process never became ready"
        step += 1
        log(store, run, step)
        store.flush()
        time.sleep(0.01)
    out["joined_at"] = step
    out["interval"] = store._write_interval()
    answered = shared.answered
    step += 1
    log(store, run, step)
    store.flush()
    out["answered"] = shared.answered - answered
    other = Store({url!r})  # opened while the process is ready: it joins at its first batch
    other_run = new_run(other, "e2")
    other.log_metrics(other_run, 1, {{"x": 1.0}})
    other.flush()
    out.update(other=[other._process.joined, shared.answered - answered],
               steps=step, pid=shared.pid)
    store.close()
    other.close()
    print(json.dumps(out))
"""


def test_auto_writes_in_the_thread_until_the_process_is_ready_then_hands_it_over(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default in a fresh program: a short run never starts a writer process; a longer
    one starts it after AUTO_AFTER_POINTS points, keeps writing in its thread until the
    process is ready, and then sends it every batch, as does a store opened after that.
    No row is lost or written twice across the hand-over."""
    monkeypatch.delenv("LAB_STORE_WRITER", raising=False)
    assert writer_process.AUTO_AFTER_POINTS == 2_000
    child = _script(tmp_path, AUTO_SCRIPT.format(url=sqlite_url))
    out = warm.run([sys.executable, str(child)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["mode"] == "auto"
    assert seen["below"] == [None, False, 0.25]  # 1,500 points: no process started
    assert seen["interval"] == 0.05  # the thread hands batches over more often
    assert seen["joined_at"] > 200  # started at the batch after 2,000 points, joined later
    assert seen["answered"] >= 1 and seen["other"][0] is True and seen["other"][1] >= 2
    assert seen["pid"] not in (None, os.getpid())
    steps = seen["steps"]
    assert _scalar(sqlite_url, "SELECT count(*) FROM metrics") == steps * 10 + 1
    assert _scalar(sqlite_url, "SELECT count(DISTINCT step) FROM metrics WHERE key = 'k3'") == (
        steps
    )
    assert _scalar(sqlite_url, "SELECT sum(value) FROM metrics WHERE key = 'k3'") == (
        pytest.approx(sum(step + 0.3 for step in range(1, steps + 1)))
    )
    _wait_gone(seen["pid"])  # it ended with the program


def test_auto_starts_the_process_again_when_it_died_after_it_had_been_ready(
    sqlite_url: str, tmp_path: Path
) -> None:
    writer_process._forget_after_fork()  # this test's own writer process
    first = Store(sqlite_url, writer="process")
    try:
        run_id = _new_run(first)
        first.log_metrics(run_id, 1, {"loss": 1.0})
        first.flush()  # the process answered: it was ready
    finally:
        first.close()
    shared = writer_process._shared()
    restarts = shared.restarts
    assert shared.pid is not None
    os.kill(shared.pid, signal.SIGKILL)
    _wait_gone(shared.pid)
    store = Store(f"sqlite:///{tmp_path / 'auto.db'}", writer="auto")
    assert store._process is not None
    try:
        run_id = _new_run(store)
        step = 0
        deadline = time.monotonic() + WAIT_S
        while not store._process.joined:
            assert time.monotonic() < deadline, "the writer process was not started again"
            step += 1
            store.log_metrics(run_id, step, {f"k{i}": float(step) for i in range(20)})
            store.flush()
        assert step > writer_process.AUTO_AFTER_POINTS // 20  # the thread wrote until then
        assert shared.restarts == restarts + 1 and shared.pid is not None
        step += 1
        store.log_metrics(run_id, step, {f"k{i}": float(step) for i in range(20)})
        store.flush()
        with sqlite3.connect(tmp_path / "auto.db") as conn:
            assert conn.execute("SELECT count(*), sum(value) FROM metrics").fetchone() == (
                20 * step,
                20 * sum(range(1, step + 1)),
            )
    finally:
        store.close()


#: lab's own writer process, as a later version of lab would start it.
OTHER_PROTOCOL = "import lab.store.writer_process as w; w.PROTOCOL = w.PROTOCOL + 1; w.main()"


def test_a_writer_process_of_another_protocol_is_ended_and_the_rows_are_written_here(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer process whose first frame names another protocol is ended at once, never
    started again, and the store writes every row in its own thread, with one line that
    says why."""
    monkeypatch.setattr(writer_process, "_CHILD", OTHER_PROTOCOL)
    writer_process._forget_after_fork()  # a fresh writer process for this test
    store = Store(sqlite_url, writer="process", give_up_s=WAIT_S)
    try:
        run_id = _new_run(store)
        with caplog.at_level(logging.WARNING, logger="lab.store"):
            for step in range(1, 51):
                store.log_metrics(run_id, step, {"loss": float(step)})
            store.flush()
        shared = writer_process._shared()
        assert _scalar(sqlite_url, "SELECT count(*) FROM metrics") == 50
        assert _scalar(sqlite_url, "SELECT sum(value) FROM metrics") == sum(range(1, 51))
        said = [r.getMessage() for r in caplog.records if "another protocol" in r.getMessage()]
        assert len(said) == 1 and f"this program speaks {writer_process.PROTOCOL}" in said[0]
        assert shared.refused == said[0]
        assert shared.pid is None and shared.restarts == 0  # ended, and not started again
        assert store._process is not None and not store._process.joined
    finally:
        store.close()
        monkeypatch.undo()
        writer_process._forget_after_fork()  # the next store starts a working one


def test_a_writer_process_replaced_by_another_protocol_mid_run_loses_no_row(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lab upgraded on disk while a program runs: its writer process is killed, the one
    started again speaks another protocol. The batch in flight and every later one are
    written by the store's thread, each row once."""
    writer_process._forget_after_fork()
    store = Store(sqlite_url, writer="process", give_up_s=WAIT_S)
    try:
        run_id = _new_run(store)
        for step in range(1, 21):
            store.log_metrics(run_id, step, {"loss": float(step)})
        store.flush()
        assert writer_process._shared().answered > 0  # the first process wrote them
        monkeypatch.setattr(writer_process, "_CHILD", OTHER_PROTOCOL)
        _kill(store)
        for step in range(21, 61):
            store.log_metrics(run_id, step, {"loss": float(step)})
        store.flush()
        assert _scalar(sqlite_url, "SELECT count(*) FROM metrics") == 60
        assert _scalar(sqlite_url, "SELECT sum(value) FROM metrics") == sum(range(1, 61))
        assert writer_process._shared().refused is not None
        assert store._process is not None and not store._process.joined
    finally:
        store.close()
        monkeypatch.undo()
        writer_process._forget_after_fork()


FORKS = {
    # a DataLoader worker: Python's fork, whose hook points the child's pipes at /dev/null;
    # the pipes are held (as the writer thread holds them while it sends a batch), so that
    # they do not just get closed with the parent's writer process object in the child
    "os.fork": "from lab.store import writer_process; held = writer_process._shared()._proc; "
    "pid = os.fork()",
    # a C library's fork(2), past Python's hooks: the child keeps the pipes open
    "fork(2)": "import ctypes; pid = ctypes.PyDLL(None).fork()",
}


@pytest.mark.parametrize("fork", FORKS)
def test_a_child_forked_after_the_writer_started_does_not_keep_it_alive(
    sqlite_url: str, tmp_path: Path, fork: str
) -> None:
    end = f"""store.flush()
    {FORKS[fork]}
    if pid == 0:  # the child: lives on, as a worker does, until it is told to end
        import time; time.sleep(120); os._exit(0)
    print('forked', pid, flush=True); import time; time.sleep(120)"""
    child = _script(tmp_path, EXIT_SCRIPT.format(url=sqlite_url, end=end))
    proc = warm.popen([sys.executable, str(child)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    writer = int(proc.stdout.readline())
    forked = int(proc.stdout.readline().split()[1])
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(WAIT_S)
        _wait_gone(writer)  # within WAIT_S, while the child lives on
        assert not _gone(forked)
    finally:
        os.kill(forked, signal.SIGKILL)
    assert _scalar(sqlite_url, "SELECT count(*) FROM metrics") == 6000  # the flushed rows
