"""Exact resume: a run SIGKILLed mid-training and resumed equals one that never stopped."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lab import Callback, CheckpointConfig, LoopState, TrainingLoop
from lab.errors import CheckpointError, ConfigError
from tests import warm

CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lab import Callback, CheckpointConfig, Experiment, TrainingLoop

    store, out, weights = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    hold_at = int(sys.argv[4])


    class HoldAt(Callback):
        '''Parks the process after step `hold_at`, so the test can SIGKILL it there.'''

        priority = -100

        def on_step_end(self, state, step_idx, batch, metrics):
            if step_idx == hold_at:
                (weights.parent / "holding").write_text(str(step_idx))
                time.sleep(600)


    def loss_fn(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)


    def train(run):
        gen = torch.Generator().manual_seed(run.seed)
        x = torch.randn(60, 4, generator=gen)
        y = x.sum(1, keepdim=True) + 0.1 * torch.randn(60, 1, generator=gen)
        data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)  # 8 per epoch
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.5)
        loop = TrainingLoop(
            model, opt, data, loss_fn, 100, scheduler=sched,
            checkpoint=CheckpointConfig(every=10),
            callbacks=[HoldAt()] if hold_at else [],
        )
        artifacts = loop.fit(run)
        torch.save(model.state_dict(), weights)
        return artifacts


    Experiment("resume", train, store=store, output_dir=out, seed=11).run()
    """
)


def _child(folder: Path, hold_at: int) -> subprocess.Popen[bytes]:
    folder.mkdir(exist_ok=True)
    script = folder / "child.py"
    script.write_text(CHILD)
    return warm.popen(
        [sys.executable, str(script), f"sqlite:///{folder / 'lab.db'}", str(folder / "runs"),
         str(folder / "weights.pt"), str(hold_at)],
        env={**os.environ, "LAB_STRICT": "1"},
    )  # fmt: skip


def _losses(folder: Path) -> list[tuple[int, float]]:
    con = sqlite3.connect(folder / "lab.db")
    try:
        return con.execute(
            "SELECT step, value FROM metrics WHERE key = 'loss' ORDER BY step"
        ).fetchall()
    finally:
        con.close()


@pytest.mark.slow
def test_sigkill_at_step_57_then_resume_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    straight = _child(tmp_path / "straight", 0)
    assert straight.wait(timeout=300) == 0

    killed = _child(tmp_path / "killed", 57)
    marker = tmp_path / "killed" / "holding"
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert killed.poll() is None, "the child ended before reaching step 57"
        assert time.monotonic() < deadline, "the child never reached step 57"
        time.sleep(0.05)
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.wait(timeout=60) == -signal.SIGKILL

    from lab.store import Store

    url = f"sqlite:///{tmp_path / 'killed' / 'lab.db'}"
    con = sqlite3.connect(tmp_path / "killed" / "lab.db")
    assert con.execute("SELECT status FROM runs").fetchall() == [("running",)]
    store = Store(url)  # opening the store notices that the run's process is gone
    store.close()
    (status, error) = con.execute("SELECT status, error FROM runs").fetchone()
    con.close()
    assert status == "crashed" and f"pid {killed.pid}" in error

    checkpoints = tmp_path / "killed" / "runs" / "resume" / "base-r0" / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step_000050"
    resumed = _child(tmp_path / "killed", 0)
    assert resumed.wait(timeout=300) == 0

    reference, after = _losses(tmp_path / "straight"), _losses(tmp_path / "killed")
    assert [s for s, _ in reference] == list(range(1, 101))
    assert after == reference  # every step once, and each loss identical
    want = torch.load(tmp_path / "straight" / "weights.pt")
    got = torch.load(tmp_path / "killed" / "weights.pt")
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    con = sqlite3.connect(tmp_path / "killed" / "lab.db")
    assert con.execute("SELECT status FROM runs").fetchall() == [("completed",)]
    saves = con.execute("SELECT step FROM checkpoints WHERE event = 'save' ORDER BY step")
    assert [s for (s,) in saves] == list(range(10, 101, 10))
    con.close()


# -- resume options and bad input, in-process ------------------------------------------------


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


class Counter(Callback):
    """A stateful callback, and a record of what the resume hooks saw."""

    def __init__(self) -> None:
        self.seen = 0
        self.loaded: list[tuple[int, str]] = []

    def on_step_end(self, state, step_idx, batch, metrics):  # type: ignore[no-untyped-def]
        self.seen += 1

    def post_checkpoint_loaded(self, state: LoopState, path: Path) -> None:
        self.loaded.append((state.step, path.name))

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def _loop(steps: int, callbacks: list[Callback], width: int = 3, **ckpt: Any) -> TrainingLoop:
    torch.manual_seed(0)
    model = torch.nn.Linear(width, 1)
    data = [(torch.randn(4, width), torch.randn(4, 1)) for _ in range(3)]
    config = CheckpointConfig(**({"every": 2} | ckpt))
    return TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, _mse, steps,
                        checkpoint=config, callbacks=callbacks)  # fmt: skip


def test_resume_restores_callbacks_and_fires_post_checkpoint_loaded(tmp_path: Path) -> None:
    _loop(4, [Counter()]).fit(run_dir=tmp_path)
    again = Counter()
    artifacts = _loop(6, [again]).fit(run_dir=tmp_path)
    assert again.loaded == [(4, "step_000004")]
    assert again.seen == 6  # 4 restored from the checkpoint, 2 new steps
    assert artifacts.step == 6


def test_resume_from_a_chosen_step_and_fresh_start(tmp_path: Path) -> None:
    _loop(6, [Counter()]).fit(run_dir=tmp_path)
    chosen = Counter()
    _loop(6, [chosen]).fit(run_dir=tmp_path, resume=2)
    assert chosen.loaded == [(2, "step_000002")] and chosen.seen == 6
    fresh = Counter()
    _loop(2, [fresh]).fit(run_dir=tmp_path, resume=False)
    assert fresh.loaded == [] and fresh.seen == 2
    (aside,) = tmp_path.glob("checkpoints.replaced-*")
    assert (aside / "step_000006" / "COMPLETE").exists()  # nothing was deleted


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("kwargs", "resume", "message"),
    [
        ({}, "nowhere/step_000002", "does not exist"),
        ({}, 3, "no checkpoint of step 3"),
        ({"width": 5}, True, "does not fit this model"),
    ],
)
def test_bad_resume_is_one_clear_line_and_deletes_nothing(
    tmp_path: Path, kwargs: dict[str, Any], resume: Any, message: str
) -> None:
    _loop(4, [], keep_last=1).fit(run_dir=tmp_path)
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointError) as info:
        _loop(6, [], **kwargs).fit(run_dir=tmp_path, resume=resume)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert _snapshot(tmp_path) == before


def test_a_removed_step_says_it_was_removed(tmp_path: Path) -> None:
    _loop(6, [], keep_last=1).fit(run_dir=tmp_path)
    with pytest.raises(CheckpointError, match="removed"):
        _loop(6, []).fit(run_dir=tmp_path, resume=2)


def test_resume_without_checkpoints_is_a_config_error(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    loop = TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        [(torch.randn(4, 3), torch.randn(4, 1))], _mse, 2)  # fmt: skip
    with pytest.raises(ConfigError, match="needs checkpoints"):
        loop.fit(run_dir=tmp_path, resume=2)


def test_running_an_experiment_again_skips_completed_runs(tmp_path: Path) -> None:
    from lab import Experiment

    calls: list[int] = []
    flag = tmp_path / "fail-r1"
    flag.write_text("")

    def train(run: Any) -> dict[str, float]:
        calls.append(run.repeat)
        if run.repeat == 1 and flag.exists():
            raise RuntimeError("pre-empted")
        return {"loss": float(run.repeat)}

    url = f"sqlite:///{tmp_path / 'lab.db'}"
    first = Experiment("again", train, repeats=3, store=url, output_dir=tmp_path).run()
    assert [r.status for r in first.runs] == ["completed", "failed", "completed"]
    flag.unlink()
    calls.clear()
    second = Experiment("again", train, repeats=3, store=url, output_dir=tmp_path).run()
    assert calls == [1]  # only the run that failed ran again
    assert [(r.run_key, r.status, r.metrics) for r in second.runs] == [
        ("base-r0", "completed", {"loss": 0.0}),
        ("base-r1", "completed", {"loss": 1.0}),
        ("base-r2", "completed", {"loss": 2.0}),
    ]
    assert second.summary().row("base", "loss").n == 3
    con = sqlite3.connect(tmp_path / "lab.db")
    assert con.execute("SELECT status FROM experiments").fetchall() == [("completed",)]
    assert (
        con.execute("SELECT status FROM runs ORDER BY run_key").fetchall() == [("completed",)] * 3
    )
    con.close()


def test_opening_a_store_marks_runs_of_dead_processes_crashed(tmp_path: Path) -> None:
    import socket

    from lab.store import Store

    gone = warm.popen([sys.executable, "-c", "pass"])
    gone.wait()
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    store = Store(url)
    exp = store.begin_experiment("e", config={}, seed=0, repeats=1)
    group = store.add_group(exp, "g")
    ids = {
        key: store.start_run(
            exp,
            group,
            run_key=key,
            arm_id=None,
            repeat=0,
            stage=0,
            seed=0,
            config={},
            output_dir=None,
        )
        for key in ("dead", "alive", "elsewhere")
    }
    store.close()
    con = sqlite3.connect(tmp_path / "lab.db")
    con.execute("UPDATE runs SET pid = ? WHERE run_key = 'dead'", (gone.pid,))
    con.execute("UPDATE runs SET host = 'another-host', pid = ? WHERE run_key = 'elsewhere'",
                (gone.pid,))  # fmt: skip
    con.commit()
    store = Store(url)
    store.close()
    rows = dict(con.execute("SELECT run_key, status FROM runs").fetchall())
    assert rows == {"dead": "crashed", "alive": "running", "elsewhere": "running"}
    (error,) = con.execute("SELECT error FROM runs WHERE run_key = 'dead'").fetchone()
    assert (
        error
        == f"the process (pid {gone.pid} on {socket.gethostname()}) died while the run was running"
    )
    assert len(ids) == 3
    con.close()


def _amp_loop(steps: int) -> TrainingLoop:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    return TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, _mse, steps,
                        scaler=scaler, checkpoint=CheckpointConfig(every=3))  # fmt: skip


def test_the_grad_scaler_is_saved_and_restored(tmp_path: Path) -> None:
    straight = _amp_loop(6)
    straight.fit(run_dir=tmp_path / "straight")
    first = _amp_loop(3)
    first.fit(run_dir=tmp_path / "resumed")
    saved = torch.load(tmp_path / "resumed" / "checkpoints" / "step_000003" / "state.pt",
                       weights_only=False)  # fmt: skip
    assert saved["scaler"] == first.scaler.state_dict()
    assert saved["scaler"]["scale"] == 2.0**11  # grew once: after steps 2 (growth_interval=2)
    resumed = _amp_loop(6)
    resumed.fit(run_dir=tmp_path / "resumed")
    assert resumed.scaler.state_dict() == straight.scaler.state_dict()
    for got, want in zip(resumed.model.parameters(), straight.model.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
