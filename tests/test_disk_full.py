"""A disk that fills up during a checkpoint: one line that says "No space left" and which
file, and nothing half-written left behind (the tmp -> rename protocol), on a real 1 MiB
tmpfs. Mounting needs root (CAP_SYS_ADMIN): where the mount is not permitted that test skips,
and the same path is still covered for real by a file-size limit (RLIMIT_FSIZE, which fails
a write with EFBIG rather than ENOSPC) in a subprocess, which needs no privilege."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import lab
from lab import CheckpointConfig
from lab.errors import CheckpointError
from lab.loop.checkpoints import CheckpointManager

ROOT = str(Path(lab.__file__).resolve().parents[1])  # this checkout, for the subprocess
HINT = "the earlier checkpoints are kept: free some space, or put the run folder on a larger disk"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB filesystem (tmpfs), unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the RLIMIT_FSIZE test covers this path")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        denied = "permission denied" in done.stderr.lower() or "not permitted" in done.stderr
        if denied or os.environ.get("CI", "").lower() != "true":
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
        pytest.fail(f"mount -t tmpfs failed: {done.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


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
from lab.errors import CheckpointError
from lab.loop.checkpoints import CheckpointManager

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
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_LIMITED), str(root)],
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
