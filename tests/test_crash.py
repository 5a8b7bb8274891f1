"""Crash safety: SIGKILL at random moments, during saves and removals, then an exact resume.

A reference run trains 60 steps straight. Each trial starts the same run, SIGKILLs it at a
random moment (a wall-clock delay spread over the whole run, or just after a checkpoint was
reported), checks what the kill left on disk, then resumes and compares with the reference.

Starting Python and importing torch takes seconds, so a "zygote" process imports everything
once and forks one child per run; the test SIGKILLs the child by its pid.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lab import CheckpointConfig
from lab.loop.checkpoints import COMPLETE_MARKER, STATE_FILE, CheckpointManager
from tests import warm

CONFIG = CheckpointConfig(
    every=5, keep_last=2, keep_top_k=1, metric="loss", mode="min", ephemeral_every=3
)
STEPS = 60
TRIALS_TIMED = 12  # killed after a random wall-clock delay
TRIALS_MARKED = 10  # killed just after the child reported a checkpoint

ZYGOTE = textwrap.dedent(
    """
    import os, sys, traceback
    from pathlib import Path

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lab import Callback, CheckpointConfig, Experiment, TrainingLoop

    torch.set_num_threads(1)
    CONFIG = CheckpointConfig(
        every=5, keep_last=2, keep_top_k=1, metric="loss", mode="min", ephemeral_every=3
    )


    class Marks(Callback):
        '''Reports each manifest row (after it was written) as an empty file.'''

        priority = 100

        def __init__(self, folder):
            self.folder = folder

        def on_checkpoint(self, state, row):
            (self.folder / f"{row.event}-{row.step:06d}").write_text("")


    def loss_fn(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)


    def child(folder):
        marks = folder / "marks"
        marks.mkdir(exist_ok=True)

        def train(run):
            gen = torch.Generator().manual_seed(run.seed)
            x = torch.randn(60, 4, generator=gen)
            y = x.sum(1, keepdim=True) + 0.1 * torch.randn(60, 1, generator=gen)
            data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
            model = torch.nn.Sequential(
                torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                torch.nn.Linear(8, 1),
            )
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
            loop = TrainingLoop(model, opt, data, loss_fn, 60, scheduler=sched,
                                checkpoint=CONFIG, callbacks=[Marks(marks)])
            artifacts = loop.fit(run)
            torch.save(model.state_dict(), folder / "weights.pt")
            return artifacts

        Experiment("crash", train, store=f"sqlite:///{folder / 'lab.db'}",
                   output_dir=folder / "runs", seed=5).run()


    # One run in the zygote itself warms lazy imports and caches, so that every forked run
    # takes the same time; it must leave no thread behind, since fork copies only this one.
    warm = Path(sys.argv[1])
    warm.mkdir()
    child(warm)
    import threading
    assert threading.active_count() == 1, threading.enumerate()
    print("ready", flush=True)

    for line in sys.stdin:
        command, arg = line.split(maxsplit=1)
        if command == "run":
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    child(Path(arg.strip()))
                except BaseException:
                    traceback.print_exc()
                    code = 1
                finally:
                    sys.stderr.flush()
                    os._exit(code)
            print(pid, flush=True)
        elif command == "wait":
            _, status = os.waitpid(int(arg), 0)
            print(os.waitstatus_to_exitcode(status), flush=True)
    """
)


class Zygote:
    """A Python process with torch and lab imported that forks one training run on request."""

    def __init__(self, folder: Path) -> None:
        script = folder / "zygote.py"
        script.write_text(ZYGOTE)
        self.proc = warm.popen(
            [sys.executable, str(script), str(folder / "warm")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "LAB_STRICT": "1"},
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == "ready\n", "the zygote did not start"

    def _ask(self, line: str) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, "the zygote died"
        return int(answer)

    def start(self, folder: Path) -> int:
        folder.mkdir(exist_ok=True)
        return self._ask(f"run {folder}")

    def wait(self, pid: int) -> int:
        return self._ask(f"wait {pid}")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _checkpoints(folder: Path) -> Path:
    return folder / "runs" / "crash" / "base-r0" / "checkpoints"


def _losses(folder: Path) -> list[tuple[int, float]]:
    con = sqlite3.connect(folder / "lab.db")
    try:
        return con.execute(
            "SELECT step, value FROM metrics WHERE key = 'loss' ORDER BY step"
        ).fetchall()
    finally:
        con.close()


def _state(folder: Path) -> str:
    """What the kill left, for failure messages: the checkpoint folder and the manifest."""
    root = _checkpoints(folder)
    if not root.exists():
        return "no checkpoint folder"
    entries = {p.name: sorted(c.name for c in p.iterdir()) if p.is_dir() else "file"
               for p in sorted(root.iterdir())}  # fmt: skip
    manifest = root / "manifest.jsonl"
    tail = manifest.read_bytes()[-600:] if manifest.exists() else b"<none>"
    return f"{entries}; manifest tail: {tail!r}"


def _check_after_kill(folder: Path, what: str) -> str:
    """Checks (1)-(3) on what the kill left; returns where the kill landed, roughly."""
    con = sqlite3.connect(folder / "lab.db")
    try:
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)], what
    finally:
        con.close()
    root = _checkpoints(folder)
    if not root.exists():
        return "before the first save"
    for step_dir in root.glob("step_*"):
        assert (step_dir / COMPLETE_MARKER).is_file(), (
            f"{what}: {step_dir.name} has no {COMPLETE_MARKER}; {_state(folder)}"
        )
    manifest = root / "manifest.jsonl"
    data = manifest.read_bytes() if manifest.exists() else b""
    lines = data.split(b"\n")
    torn = lines.pop()  # b"" when the file ends with a newline
    rows = [json.loads(line) for line in lines]  # every complete line parses
    manager = CheckpointManager(root, CONFIG, "base-r0")  # drops a torn last line
    latest = manager.get_latest_checkpoint_path()
    assert latest is None or (
        (latest / COMPLETE_MARKER).is_file() and (latest / STATE_FILE).is_file()
    ), f"{what}: latest {latest} is incomplete; {_state(folder)}"
    if torn:
        return "torn manifest row"
    if any(p.is_dir() for p in root.glob("tmp_*")):
        return "mid-save (tmp folder)"
    removed = {r["path"] for r in rows if r["event"] == "remove"}
    if any((root / name).exists() for name in removed):
        return "mid-removal (removed folder on disk)"
    return "between saves"


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_equals_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    zygote = Zygote(tmp_path)
    try:
        reference = tmp_path / "reference"
        started = time.monotonic()
        pid = zygote.start(reference)
        assert zygote.wait(pid) == 0
        duration = time.monotonic() - started
        want_losses = _losses(reference)
        assert [s for s, _ in want_losses] == list(range(1, STEPS + 1))
        want = torch.load(reference / "weights.pt")

        landed: list[str] = []
        for trial in range(TRIALS_TIMED + TRIALS_MARKED):
            rng = random.Random(trial)
            folder = tmp_path / f"trial-{trial:02d}"
            pid = zygote.start(folder)
            begun = time.monotonic()
            if trial < TRIALS_TIMED:
                delay = rng.uniform(0.2, 0.9) * duration
                moment = f"{delay:.3f}s after the fork ({delay / duration:.2f} of the reference)"
                time.sleep(max(0.0, begun + delay - time.monotonic()))
            else:
                step = rng.choice(range(3, 46))  # a step that saves: every 3 or every 5
                step = step - step % 3 if step % 5 else step
                mark = folder / "marks" / f"save-{step:06d}"
                extra = rng.uniform(0.0, 0.01)
                moment = f"{extra * 1000:.1f} ms after the save of step {step} was reported"
                while not mark.exists():
                    assert time.monotonic() - begun < 120, f"trial {trial}: no {mark.name}"
                    time.sleep(0.0005)
                time.sleep(extra)
            os.kill(pid, signal.SIGKILL)
            code = zygote.wait(pid)
            what = f"trial {trial}, killed {moment}"
            if code == 0:  # it finished first: no kill to check (allowed for timed kills only)
                assert trial < TRIALS_TIMED, f"{what}: the child finished before the kill"
                landed.append("finished first")
                # the reference ran slower than the trials do (the machine was busier
                # then): aim the next kills within the run as fast as it runs now
                duration = min(duration, time.monotonic() - begun)
                continue
            assert code == -signal.SIGKILL, f"{what}: exit code {code}"
            landed.append(_check_after_kill(folder, what))

            pid = zygote.start(folder)  # resume
            assert zygote.wait(pid) == 0, f"{what}: the resumed run failed; {_state(folder)}"
            got = torch.load(folder / "weights.pt")
            assert want.keys() == got.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=what)
            assert _losses(folder) == want_losses, what  # every step once, each loss identical
            con = sqlite3.connect(folder / "lab.db")
            try:
                assert con.execute("SELECT status FROM runs").fetchall() == [("completed",)], what
            finally:
                con.close()
        print(f"reference run {duration:.2f}s; kills landed: {landed}")
        assert landed.count("finished first") <= TRIALS_TIMED // 3, landed
    finally:
        zygote.close()
