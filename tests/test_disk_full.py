"""A disk that fills up during a checkpoint: one line that says "No space left" and which
file, and nothing half-written left behind (the tmp -> rename protocol), on a real 1 MiB
tmpfs. Mounting needs root (CAP_SYS_ADMIN): where the mount is not permitted that test skips,
and the same path is still covered for real by a file-size limit (RLIMIT_FSIZE, which fails
a write with EFBIG rather than ENOSPC) in a subprocess, which needs no privilege."""

from __future__ import annotations

import errno
import json
import os
import re
import sqlite3
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import lab
from lab import CheckpointConfig
from lab.errors import CheckpointError, StoreError
from lab.loop.checkpoints import CheckpointManager
from lab.store import Store
from lab.store.writer import MetricWriter
from tests import warm

ROOT = str(Path(lab.__file__).resolve().parents[1])  # this checkout, for the subprocess
HINT = "the earlier checkpoints are kept: free some space, or put the run folder on a larger disk"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB filesystem (tmpfs), unmounted after the test."""
    yield from _mounted(tmp_path / "disk", "1m")


@pytest.fixture
def store_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB filesystem (tmpfs) for a store, unmounted after the test."""
    yield from _mounted(tmp_path / "store-disk", "2m")


def _mounted(disk: Path, size: str) -> Iterator[Path]:
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the RLIMIT_FSIZE test covers this path")
    done = warm.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        denied = "permission denied" in done.stderr.lower() or "not permitted" in done.stderr
        if denied or os.environ.get("CI", "").lower() != "true":
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
        pytest.fail(f"mount -t tmpfs failed: {done.stderr.strip()}")
    try:
        yield disk
    finally:
        warm.run(["umount", str(disk)], check=True)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_full_disk_fails_the_save_in_one_line_and_leaves_no_partial_checkpoint(
    small_disk: Path,
) -> None:
    root = small_disk / "run" / "checkpoints"
    m = CheckpointManager(root, CheckpointConfig(every=1, keep_last=2), "r")
    m.save(1, {"w": torch.full((1000,), 1.0)}, {"metrics": {}})
    before = _files(root)
    with pytest.raises(CheckpointError) as info:
        m.save(2, {"w": torch.zeros(400_000)}, {"metrics": {}})  # 1.6 MB on a 1 MiB disk
    message = str(info.value)
    assert message.startswith(
        f"cannot save step 2: No space left on device writing {root / 'tmp_step_000002'}/state.pt ("
    )
    assert message.endswith(f" KiB free after cleanup); {HINT}") and "\n" not in message
    assert _files(root) == before  # no tmp folder, no step_000002, manifest and latest as were
    again = CheckpointManager(root, CheckpointConfig(every=1, keep_last=2), "r")
    assert again.checkpoints() == [1]
    assert torch.equal(again.load(1)["w"], torch.full((1000,), 1.0))

    # the same failure in the background surfaces at the next wait, as one line
    m.save_async(3, {"w": torch.zeros(400_000)}, {"metrics": {}})
    with pytest.raises(CheckpointError) as info:
        m.wait()
    assert str(info.value).startswith(
        f"background save failed: cannot save step 3: No space left on device writing "
        f"{root / 'tmp_step_000003'}/state.pt ("
    )
    assert _files(root) == before
    m.save(4, {"w": torch.full((1000,), 4.0)}, {"metrics": {}})  # room enough: it goes on
    assert m.checkpoints() == [1, 4]


_LIMITED = """
import json, resource, signal, sys, torch
from pathlib import Path
from lab import CheckpointConfig
from lab.errors import CheckpointError, StoreError
from lab.loop.checkpoints import CheckpointManager
from lab.store import Store
from lab.store.writer import MetricWriter

root = Path(sys.argv[1])
m = CheckpointManager(root, CheckpointConfig(every=1), "r")
m.save(1, {"w": torch.zeros(100)}, {"metrics": {}})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
try:
    m.save(2, {"w": torch.zeros(100_000)}, {"metrics": {}})
except CheckpointError as exc:
    message = str(exc)
print(json.dumps({"message": message, "names": sorted(p.name for p in root.iterdir()),
                  "checkpoints": m.checkpoints()}))
"""


def test_a_file_size_limit_fails_the_save_the_same_way(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    done = warm.run([sys.executable, "-c", textwrap.dedent(_LIMITED), str(root)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["message"].startswith(
        f"cannot save step 2: {os.strerror(errno.EFBIG)} writing "
        f"{root / 'tmp_step_000002' / 'state.pt'} ("
    )
    assert out["message"].endswith(HINT)
    assert out["names"] == ["latest", "manifest.jsonl", "step_000001"]
    assert out["checkpoints"] == [1]


# -- a store on a full disk: the run fails within a bound, nothing committed is lost ------------
def _fill(disk: Path) -> Path:
    """Fill `disk` to the last byte with one file; returns it (delete it to make room)."""
    filler = disk / "filler"
    # unbuffered: a buffered file keeps the bytes that did not fit, and fails again closing
    with filler.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def test_a_flush_behind_more_rows_than_one_batch_fails_on_a_full_disk_instead_of_hanging(
    store_disk: Path,
) -> None:
    store = Store(f"sqlite:///{store_disk / 'lab.db'}", writer="thread")
    # batches of 10 steps, so the flush marker sits 20 batches behind the first failing one
    writer = MetricWriter(store._write_metrics, max_batch=10, max_pending=1000, give_up_s=0.5)
    try:
        exp = store.begin_experiment("full", config={}, seed=0, repeats=1)
        run = store.start_run(exp, store.add_group(exp, "g"), run_key="r0", arm_id=None,
                              repeat=0, stage=0, seed=0, config={}, output_dir=None)  # fmt: skip
        filler = _fill(store_disk)
        keys = [f"k{i:02d}" for i in range(20)]
        for step in range(200):
            writer.put(run, step, dict.fromkeys(keys, float(step)), 0.0)
        outcome: list[BaseException | None] = []
        waiting = threading.Thread(target=lambda: outcome.append(_flushed(writer)))
        started = time.monotonic()
        waiting.start()
        waiting.join(30)
        assert not waiting.is_alive(), "flush still waits 30 s after the store gave up"
        assert time.monotonic() - started < 10
        assert re.fullmatch(
            r"\d+ metric rows are not written: the store has failed for \d+\.\ds \(database "
            r"or disk is full\); they are kept and retried \(LAB_STORE_RETRY_S sets how long "
            r"to wait, now 0\.5s\)",
            str(outcome[0]),
        ), outcome
        filler.unlink()  # room again: the kept rows are written, every one of them
        deadline = time.monotonic() + 30
        while _flushed(writer) is not None and time.monotonic() < deadline:
            time.sleep(0.1)  # (a retry begun before the room was made may fail once more)
        writer.close()
        with store.engine.connect() as conn:
            got = conn.exec_driver_sql(
                "select count(*), count(distinct step), sum(value) from metrics"
            ).one()
        assert tuple(got) == (4000, 200, 20 * sum(range(200)))
    finally:
        writer.close()
        store.close()


def _flushed(writer: MetricWriter) -> BaseException | None:
    try:
        writer.flush()
    except StoreError as exc:
        return exc
    return None


_FULL_STORE = """
import sys, torch
from lab import CheckpointConfig, Experiment, TrainingLoop

def train(run):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x = torch.randn(8, 4)
    return TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.01),
                        [(x, x.sum(1, keepdim=True))],
                        lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), 100_000,
                        checkpoint=CheckpointConfig(fixed_steps=(500,), save_at_end=False)
                        ).fit(run)

Experiment("full", train, store=sys.argv[1], output_dir=sys.argv[2]).run()
"""


def test_a_fit_into_a_store_on_a_full_disk_exits_with_the_failure_and_keeps_what_was_committed(
    store_disk: Path, tmp_path: Path
) -> None:
    db = store_disk / "lab.db"
    started = time.monotonic()
    done = warm.run(
        [sys.executable, "-c", _FULL_STORE, f"sqlite:///{db}", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": ROOT, "LAB_STORE_RETRY_S": "2"},
    )  # fmt: skip
    seconds = time.monotonic() - started
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"lab\.errors\.StoreError: metrics could not be written: the store has failed for "
        r"\d+\.\ds \(database or disk is full\); the writer stopped with \d+ metric rows "
        r"unwritten",
        last,
    ), done.stderr[-3000:]
    assert seconds < 180, seconds  # the 2 s window, not for ever
    # every step up to the checkpoint at 500 was committed before it was saved: all there
    con = sqlite3.connect(db)
    try:
        rows = con.execute("select count(distinct step), min(step), max(step) from metrics "
                           "where key = 'loss' and step <= 500").fetchone()  # fmt: skip
        saved = con.execute("select step from checkpoints where event = 'save'").fetchall()
    finally:
        con.close()
    assert rows == (500, 1, 500) and saved == [(500,)]


_FULL_LOG = """
import sys
from lab.errors import StoreError
from lab.store import Store

store = Store(sys.argv[1])
exp = store.begin_experiment("full", config={}, seed=0, repeats=1)
run = store.start_run(exp, store.add_group(exp, "g"), run_key="r0", arm_id=None, repeat=0,
                      stage=0, seed=0, config={}, output_dir=None)
keys = [f"k{i:02d}" for i in range(64)]
refused = 0
for step in range(100_000):
    try:  # a training loop logs each step and goes on when one cannot be buffered
        store.log_metrics(run, step, dict.fromkeys(keys, float(step)))
    except StoreError:
        refused += 1
    if step == 500:
        store.flush()  # committed: these must survive whatever comes after
print("steps refused:", refused > 0, flush=True)
store.flush()
"""


def test_a_long_run_on_a_full_disk_ends_with_the_failure_instead_of_waiting_for_ever(
    store_disk: Path,
) -> None:
    """The buffer outgrows one batch while the store fails (a step goes on being buffered
    while a failed batch is out for its retry): the last flush's marker then sat further
    back than the writer ever took, and the process waited in it for ever."""
    db = store_disk / "lab.db"
    started = time.monotonic()
    done = warm.run(
        [sys.executable, "-c", _FULL_LOG, f"sqlite:///{db}"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": ROOT, "LAB_STORE_RETRY_S": "2"},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stdout == "steps refused: True\n"
    lines = done.stderr.strip().splitlines()
    assert re.fullmatch(
        r"lab\.errors\.StoreError: \d+ metric rows are not written: the store has failed for "
        r"\d+\.\ds \(database or disk is full\); they are kept and retried \(LAB_STORE_RETRY_S "
        r"sets how long to wait, now 2s\)",
        lines[-2],
    ), done.stderr[-3000:]
    assert lines[-1].startswith("lab: metrics could not be written: the store has failed for ")
    assert time.monotonic() - started < 120
    con = sqlite3.connect(db)
    try:
        got = con.execute("select count(*), count(distinct step), max(step) from metrics "
                          "where step <= 500").fetchone()  # fmt: skip
    finally:
        con.close()
    assert got == (501 * 64, 501, 500)  # all that was committed is there
