"""Is a `running` run's process alive: a pid, its start time, the boot id, the heartbeat.

Real processes throughout: a run started by a subprocess that is then SIGKILLed, a pid that
belongs to a live process of another start time, a row from another boot.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import psutil
import pytest
from test_store import WAIT_S, _new_run, _rows, _scalar

from lab.store import Store
from lab.store._values import _now
from lab.store.liveness import boot_id, owner_alive, owner_gone, process_start

HOST = socket.gethostname()

OWNER = textwrap.dedent(
    """
    import sys, time
    from lab.store import Store

    store = Store(sys.argv[1])
    exp_id = store.begin_experiment("exp", config={}, seed=0, repeats=1)
    group_id = store.add_group(exp_id, "g")
    store.start_run(exp_id, group_id, run_key="r0", arm_id=None, repeat=0, stage=0, seed=0,
                    config={}, output_dir=None)
    print("started", flush=True)
    time.sleep(600)
    """
)


def _set(url: str, sql: str, **params: object) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(Store(url, migrate=False).url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(sql), params)
    finally:
        engine.dispose()


def _start_owner(url: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, url], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline() == "started\n"
    return proc


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_run_records_its_process_start_and_boot_id(store: Store, store_url: str) -> None:
    _new_run(store)
    row = _rows(store_url, "SELECT host, pid, process_start, boot_id FROM runs")[0]
    assert row == {
        "host": HOST,
        "pid": os.getpid(),
        "process_start": psutil.Process().create_time(),
        "boot_id": boot_id(),
    }
    with open("/proc/sys/kernel/random/boot_id") as f:  # Linux: boot id, then PID namespace
        assert row["boot_id"] == f"{f.read().strip()}/{os.readlink('/proc/self/ns/pid')}"


def test_a_sigkilled_runs_process_is_crashed(store_url: str) -> None:
    proc = _start_owner(store_url)
    pid = proc.pid
    try:
        store = Store(store_url)  # its owner is alive: opening leaves the run running
        store.close()
        assert _scalar(store_url, "SELECT status FROM runs") == "running"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL
    finally:
        proc.kill()
    store = Store(store_url)
    store.close()
    row = _rows(store_url, "SELECT status, error, ended_at FROM runs")[0]
    assert row["status"] == "crashed"
    assert row["error"] == f"the process (pid {pid} on {HOST}) died while the run was running"
    assert row["ended_at"] is not None


def test_a_sigkilled_process_not_yet_reaped_is_crashed(store_url: str) -> None:
    """A zombie still has its pid (os.kill(pid, 0) succeeds), but it runs nothing."""
    proc = _start_owner(store_url)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + WAIT_S
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the killed process never became a zombie"
            time.sleep(0.02)
        store = Store(store_url)
        assert store.mark_crashed() == []  # opening the store did it already
        store.close()
        assert _scalar(store_url, "SELECT status FROM runs") == "crashed"
    finally:
        proc.kill()
        proc.wait()


def test_a_pid_that_now_belongs_to_another_process_is_crashed(store: Store, store_url: str) -> None:
    """The row's pid is a live process (this one), but one that started at another time:
    the run's own process died and its pid was reused."""
    _new_run(store)
    _set(store_url, "UPDATE runs SET process_start = process_start - 3600")
    assert store.mark_crashed() == ["r0"]
    pid = os.getpid()
    assert _rows(store_url, "SELECT status, error FROM runs")[0] == {
        "status": "crashed",
        "error": f"the process (pid {pid} on {HOST}) died; pid {pid} now belongs to another "
        "process while the run was running",
    }


def test_a_live_run_of_this_process_stays_running(store: Store, store_url: str) -> None:
    _new_run(store)
    # even with a quiet heartbeat: its own process, the same one that started it, is alive
    _set(store_url, "UPDATE runs SET heartbeat_at = :beat", beat=_now() - timedelta(hours=2))
    assert store.mark_crashed() == []
    assert _scalar(store_url, "SELECT status FROM runs") == "running"


def test_another_boot_is_left_to_the_heartbeat(store: Store, store_url: str) -> None:
    """Same host name, a pid that does not exist here, but another boot id (or another PID
    namespace: a container sharing the host's name): the pid means nothing here."""
    _new_run(store)
    pid = _dead_pid()
    _set(
        store_url,
        "UPDATE runs SET pid = :pid, boot_id = 'another-boot/pid:[1]', heartbeat_at = :beat",
        pid=pid, beat=_now() - timedelta(seconds=60),
    )  # fmt: skip
    assert store.mark_crashed() == []
    assert _scalar(store_url, "SELECT status FROM runs") == "running"

    _set(store_url, "UPDATE runs SET heartbeat_at = :beat", beat=_now() - timedelta(seconds=400))
    assert store.mark_crashed() == ["r0"]
    error = _scalar(store_url, "SELECT error FROM runs")
    assert error.startswith(f"its process (pid {pid} on {HOST}) was last seen 40")
    assert error.endswith("s ago while the run was running")


def test_a_row_from_before_process_identities_is_judged_by_its_pid(
    store: Store, store_url: str
) -> None:
    _new_run(store, run_key="dead")
    _new_run(store, run_key="alive")
    _set(store_url, "UPDATE runs SET process_start = NULL, boot_id = NULL, heartbeat_at = NULL")
    _set(store_url, "UPDATE runs SET pid = :pid WHERE run_key = 'dead'", pid=_dead_pid())
    assert store.mark_crashed() == ["dead"]
    assert _scalar(store_url, "SELECT status FROM runs WHERE run_key = 'alive'") == "running"


@pytest.mark.parametrize(
    ("row", "alive"),
    [
        ({"host": HOST, "boot_id": "same", "start": 0.0}, True),
        ({"host": HOST, "boot_id": "same", "start": 0.5}, True),  # within the tolerance
        ({"host": HOST, "boot_id": "same", "start": 5.0}, False),  # reused pid
        ({"host": HOST, "boot_id": "other", "start": 5.0}, True),  # fresh heartbeat decides
        ({"host": "elsewhere", "boot_id": "same", "start": 5.0}, True),
    ],
)
def test_owner_alive_is_the_one_rule(row: dict, alive: bool) -> None:
    started = process_start()
    assert started is not None
    args = {
        "host": row["host"],
        "pid": os.getpid(),
        "process_start": started + row["start"],
        "boot_id": boot_id() if row["boot_id"] == "same" else "other",
        "heartbeat_at": _now(),
        "stale_after_s": 300.0,
    }
    assert owner_alive(**args) is alive
    assert (owner_gone(**args) is None) is alive
