"""executor="ray": each run a Ray task on a real local cluster, recorded as in series.

One ``ray.init(num_cpus=2)`` serves the whole module (a Ray start and the workers' first
torch import take seconds). Everything a worker runs is defined at the top of this module;
the workers find it through the driver's ``sys.path``, which `RayPool` sends with each run.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

from lab import (
    Arm,
    Callback,
    CheckpointConfig,
    Experiment,
    LogContext,
    LoopState,
    Sweep,
    TrainingLoop,
)
from lab._imports import pip_install
from lab.errors import ConfigError
from lab.executors import check_resources, check_shared_store
from lab.records import ManifestRow, RunSpec
from lab.sweeps import Race
from tests import warm

ray = pytest.importorskip("ray")

STEPS = 8


class Cfg(pydantic.BaseModel):
    lr: float = 0.1
    kill_at: int = 0  # SIGKILL the worker once, just after the checkpoint of this step


class KillOnce(Callback):
    """SIGKILLs its own process after the checkpoint of step `at` is committed, the first
    time only (a file in the run folder remembers it)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_checkpoint(self, state: LoopState, row: ManifestRow) -> None:
        mark = state.ctx.run_dir / "killed"
        if row.event == "save" and row.step == self.at and not mark.exists():
            mark.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


def mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def train(run: RunSpec) -> Any:
    """A tiny regression whose data, weights and dropout come from the seeded global RNG."""
    cfg = run.config
    if ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
        assigned = ray.get_runtime_context().get_assigned_resources()
        (run.dir / "resources.json").write_text(json.dumps(assigned))
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]
    loop = TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9),
        batches,
        mse,
        STEPS,
        checkpoint=CheckpointConfig(every=2, keep_last=2, save_at_end=True),
        callbacks=[KillOnce(cfg.kill_at)] if cfg.kill_at else [],
    )
    artifacts = loop.fit(run)
    torch.save(model.state_dict(), run.dir / "final.pt")
    return artifacts


class Seen(Callback):
    """Which hooks fired in this process (the driver), with the run and its status."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_experiment_start(self, ctx: LogContext) -> None:
        self.calls.append(f"on_experiment_start:{os.getpid()}")

    def on_run_start(self, ctx: LogContext) -> None:
        self.calls.append(f"on_run_start:{ctx.run_key}")

    def on_run_end(self, ctx: LogContext, run_result: Any, arm: Any) -> None:
        self.calls.append(f"on_run_end:{run_result.run_key}:{run_result.status}")

    def on_experiment_end(self, ctx: LogContext, result: Any) -> None:
        self.calls.append(f"on_experiment_end:{os.getpid()}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """One local Ray cluster of 2 CPUs for the module; yields its address."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    con = sqlite3.connect(db)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def _experiment(name: str, folder: Path, **kwargs: Any) -> Experiment:
    kwargs.setdefault("arms", [Arm("a"), Arm("b", lr=0.05, resources={"num_cpus": 0.5})])
    return Experiment(
        name, train, base_config=Cfg(), repeats=4, seed=3,
        store=f"sqlite:///{folder / 'lab.db'}", output_dir=folder / "runs", **kwargs,
    )  # fmt: skip


def _trained(metrics: dict[str, float]) -> dict[str, float]:
    """The final metrics that training decides (not the wall time of a step)."""
    return {k: v for k, v in metrics.items() if k != "step_time"}


def _weights(folder: Path, name: str, run_key: str) -> dict[str, torch.Tensor]:
    return torch.load(folder / "runs" / name / run_key / "final.pt")


def test_a_fan_out_of_8_runs_equals_the_serial_executor(cluster: str, tmp_path: Path) -> None:
    seen = Seen()
    fanned = _experiment("fan", tmp_path / "ray", executor="ray", callbacks=[seen],
                         resources={"num_cpus": 1}).run()  # fmt: skip
    serial = _experiment("fan", tmp_path / "serial").run()
    assert len(fanned.runs) == 8
    assert [(r.run_key, r.status, _trained(r.metrics)) for r in fanned.runs] == [
        (r.run_key, r.status, _trained(r.metrics)) for r in serial.runs
    ]
    for r in serial.runs:
        want, got = (
            _weights(tmp_path / "serial", "fan", r.run_key),
            _weights(tmp_path / "ray", "fan", r.run_key),
        )
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    losses = "SELECT r.run_key, m.step, m.value FROM metrics m JOIN runs r USING (run_id) " \
             "WHERE m.key = 'loss' ORDER BY 1, 2"  # fmt: skip
    assert _rows(tmp_path / "ray" / "lab.db", losses) == _rows(
        tmp_path / "serial" / "lab.db", losses
    )
    assert len(_rows(tmp_path / "ray" / "lab.db", losses)) == 8 * STEPS
    # the experiment hooks fired in the driver, the run hooks in the workers
    pid = os.getpid()
    assert seen.calls == [f"on_experiment_start:{pid}", f"on_experiment_end:{pid}"]
    # each run asked for its arm's CPUs, over the experiment's
    for r in fanned.runs:
        assigned = json.loads(
            (tmp_path / "ray" / "runs" / "fan" / r.run_key / "resources.json").read_text()
        )
        assert assigned["CPU"] == (1.0 if r.arm == "a" else 0.5), (r.run_key, assigned)


def test_a_killed_worker_crashes_its_run_then_the_retry_resumes_bit_identical(
    cluster: str, tmp_path: Path
) -> None:
    seen = Seen()
    killed = Experiment(
        "kill", train, base_config=Cfg(), arms=[Arm("k", kill_at=4)], seed=3,
        store=f"sqlite:///{tmp_path / 'ray' / 'lab.db'}", output_dir=tmp_path / "ray" / "runs",
        executor="ray", max_retries=1, callbacks=[seen],
    ).run()  # fmt: skip
    whole = Experiment(
        "kill", train, base_config=Cfg(), arms=[Arm("k")], seed=3,
        store=f"sqlite:///{tmp_path / 'serial' / 'lab.db'}",
        output_dir=tmp_path / "serial" / "runs",
    ).run()  # fmt: skip
    run_dir = tmp_path / "ray" / "runs" / "kill" / "k-r0"
    assert (run_dir / "killed").exists()  # the first attempt's worker was SIGKILLed
    # the driver recorded the crash, then the retry ended in its worker
    pid = os.getpid()
    assert seen.calls == [
        f"on_experiment_start:{pid}",
        "on_run_end:k-r0:crashed",
        f"on_experiment_end:{pid}",
    ]
    assert [(r.run_key, r.status) for r in killed.runs] == [("k-r0", "completed")]
    assert _trained(killed.runs[0].metrics) == _trained(whole.runs[0].metrics)
    want, got = (
        _weights(tmp_path / "serial", "kill", "k-r0"),
        _weights(tmp_path / "ray", "kill", "k-r0"),
    )
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    losses = "SELECT step, value FROM metrics WHERE key = 'loss' ORDER BY step"
    assert _rows(tmp_path / "ray" / "lab.db", losses) == _rows(
        tmp_path / "serial" / "lab.db", losses
    )
    assert [s for s, _ in _rows(tmp_path / "ray" / "lab.db", losses)] == list(range(1, STEPS + 1))
    assert _rows(tmp_path / "ray" / "lab.db", "SELECT status, error FROM runs") == [
        ("completed", None)
    ]


DRIVER = textwrap.dedent(
    """
    import sys, time
    import torch
    from lab import Callback, Experiment, TrainingLoop

    class Slow(Callback):
        def on_step_end(self, state, step_idx, batch, metrics):
            time.sleep(0.2)

    def train(run):
        (run.dir / "started").touch()
        model = torch.nn.Linear(2, 1)
        x = torch.randn(4, 2)
        loop = TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), [(x, x[:, :1])],
                            lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), 500,
                            callbacks=[Slow()])
        return loop.fit(run)

    Experiment("ctrl-c", train, repeats=4, executor="ray", store=sys.argv[1],
               output_dir=sys.argv[2]).run()
    """
)


def test_a_ctrl_c_in_the_driver_records_every_run_and_leaves_none_running(
    cluster: str, tmp_path: Path
) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    db, runs = tmp_path / "lab.db", tmp_path / "runs"
    driver = warm.popen(
        [sys.executable, str(script), f"sqlite:///{db}", str(runs)],
        env={**os.environ, "LAB_RAY_ADDRESS": cluster},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(runs.glob("ctrl-c/*/started"))) < 2:  # both CPUs busy, 2 runs queued
            assert driver.poll() is None, driver.communicate()
            assert time.monotonic() < deadline, "the runs did not start"
            time.sleep(0.1)
        time.sleep(0.5)
        driver.send_signal(signal.SIGINT)
        _out, err = driver.communicate(timeout=90)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode != 0
    assert "KeyboardInterrupt" in err
    rows = _rows(db, "SELECT run_key, status, error FROM runs ORDER BY run_key")
    assert [key for key, *_ in rows] == [f"base-r{i}" for i in range(4)]
    assert {status for _, status, _ in rows} == {"failed"}  # none left running
    started = {p.parent.name for p in runs.glob("ctrl-c/*/started")}
    for key, _, error in rows:
        want = (
            "interrupted (KeyboardInterrupt)" if key in started else "interrupted before it started"
        )
        assert error == want, (key, error, started)
    assert _rows(db, "SELECT status FROM experiments") == [("failed",)]


def test_a_race_under_ray_sends_each_round_out_together(cluster: str, tmp_path: Path) -> None:
    """`Experiment(race=...)` on Ray tasks, as under a pool: each round's runs overlap (all
    start before the first ends), a round starts once the one before ended, and the race
    ends as `tests/test_race_experiment.py` computes it (c dropped after round 1)."""
    from tests import test_race_experiment as raced

    race = Race("score", mode="min", alpha=0.05, min_repeats=2, max_repeats=3, test="t")
    # 8 s a run: a Ray worker process started for a round's third task can take over 4 s
    # on a loaded machine, and the round's runs must still overlap.
    exp = Experiment("ray-race", raced.train, base_config=raced.Cfg(sleep=8.0),
                     arms=raced._arms(), race=race, store=f"sqlite:///{tmp_path / 'lab.db'}",
                     output_dir=tmp_path, executor="ray", resources={"num_cpus": 0.5})  # fmt: skip
    result = exp.run()
    assert [(r.run_key, r.status) for r in result.runs] == [
        (key, "completed") for key in ("a-r0", "a-r1", "a-r2", "b-r0", "b-r1", "b-r2", "c-r0",
                                       "c-r1")
    ]  # fmt: skip
    assert (result.planned, result.race.winner) == (8, "b")
    raced.went_out_in_rounds(tmp_path / "ray-race", [3, 3, 2])
    assert _rows(
        tmp_path / "lab.db", "SELECT a.name, e.round FROM eliminations e JOIN arms a USING (arm_id)"
    ) == [("c", 1)]


def test_a_sweep_under_ray_asks_an_arm_as_each_task_ends(cluster: str, tmp_path: Path) -> None:
    """`Experiment(sweep=...)` on Ray with 2 workers: two arms asked at once, then one as
    each run ends, each after the tells so far; the values are the sampler's straight ones."""
    from tests import test_sweep_experiment as swept

    db = tmp_path / "lab.db"
    store = f"sqlite:///{db}"
    sweep = Sweep(swept.SPACE, sampler="random", arms=5, seed=0, metric="score")
    result = swept._experiment("ray-sweep", tmp_path, store, sweep=sweep, executor="ray",
                               workers=2, resources={"num_cpus": 1}).run()  # fmt: skip
    assert _rows(db, "SELECT number, asked_after FROM sweep_trials ORDER BY number") == [
        (0, 0), (1, 0), (2, 1), (3, 2), (4, 3)
    ]  # fmt: skip
    expected = {t[1]: (t[2], t[5]) for t in swept._straight("random", 5, 1, 1)}
    assert {t[1]: (t[2], t[5]) for t in swept._trials(store, "ray-sweep")} == expected
    assert [(r.run_key, r.status) for r in result.runs] == [
        (f"s00{i}-r0", "completed") for i in range(5)
    ]


def test_sqlite_is_refused_on_a_cluster_of_several_nodes(cluster: str, tmp_path: Path) -> None:
    """The check's function, given a node count: this machine runs a one-node cluster only.
    The local cluster itself (one node) takes SQLite, as the fan-out above shows."""
    with pytest.raises(ConfigError) as refused:
        check_shared_store("sqlite:////shared/lab.db", nodes=3)
    assert str(refused.value) == (
        "executor='ray' on a cluster of 3 nodes cannot record into the SQLite store "
        "sqlite:////shared/lab.db: each node would write a file of its own; use a PostgreSQL "
        "URL (postgresql://user:password@host/db) or a lab serve URL (http://host:port) as store"
    )
    check_shared_store("sqlite:////shared/lab.db", nodes=1)
    check_shared_store("postgresql+psycopg://u:p@db/lab", nodes=3)
    check_shared_store("http://lab-server:8000", nodes=3)


def test_resources_and_retries_are_checked_before_anything_runs() -> None:
    with pytest.raises(ConfigError, match=r"^arm 'x': resources has 'gpus'; use num_cpus, "):
        Arm("x", resources={"gpus": 1})
    with pytest.raises(ConfigError, match=r"resources\['num_gpus'\]=-1; use a number >= 0$"):
        Experiment("x", train, executor="ray", resources={"num_gpus": -1}, store=False)
    with pytest.raises(ConfigError, match=r"^max_retries needs executor='processes' or 'ray'"):
        Experiment("x", train, max_retries=1, store=False)
    assert check_resources({"num_cpus": 2, "num_gpus": 0.5}, "x") == {
        "num_cpus": 2.0,
        "num_gpus": 0.5,
    }


def test_without_ray_installed_the_error_names_the_pip_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError) as missing:
        Experiment("x", train, executor="ray", store=False)
    assert str(missing.value) == f"executor='ray' needs the ray package: {pip_install('ray')}"
