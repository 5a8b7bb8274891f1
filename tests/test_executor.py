"""executor="processes": each run in a fresh worker, recorded as if it ran in series.

Everything a worker must import (train, callbacks, config classes) is defined at the top of
this module: a worker finds it by name, as a spawned process would. Each worker is forked
from the fork server, which imported torch once, so the experiments here are small and few.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
import sqlalchemy as sa
import torch

from lab import (
    Arm,
    Callback,
    CheckpointConfig,
    Evaluator,
    Experiment,
    ExperimentResult,
    LogContext,
    LoopState,
    RunSpec,
    SqlLogger,
    Store,
    TrainingLoop,
)
from lab.errors import ConfigError
from lab.loggers.sql import EXPERIMENT_ID, RUN_ID, arm_key, group_key

STEPS = 4
STEP_KEYS = ("loss", "lr", "grad_norm", "step_time")  # what the loop logs at every step


class Cfg(pydantic.BaseModel):
    lr: float = 0.1
    shift: float = 0.0
    checkpoints: bool = False
    loop: bool = True  # False: return at once (a worker's first torch optimizer costs ~2 s)
    die: str = ""  # "exit", "kill" or "sleep": how a run's worker misbehaves


def mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def train(run: RunSpec) -> Any:
    """A tiny regression whose data and initial weights come from the seeded global RNG."""
    cfg = run.config
    if cfg.die == "exit":
        os._exit(3)
    if cfg.die == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if cfg.die == "sleep" and run.repeat == 1:
        (run.dir / "sleeping").touch()
        time.sleep(120)
    if not cfg.loop:
        return {"loss": float(run.seed)}
    x = torch.randn(16, 4)
    y = x.sum(1, keepdim=True) + cfg.shift
    model = torch.nn.Linear(4, 1)
    loop = TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=cfg.lr),
        [(x[:8], y[:8]), (x[8:], y[8:])],
        mse,
        STEPS,
        evaluators=[Evaluator("val", lambda m: {"loss": mse(m, (x, y)).item()}, at_end=True)],
        checkpoint=CheckpointConfig(save_at_end=True) if cfg.checkpoints else None,
    )
    artifacts = loop.fit(run)
    torch.save(model.state_dict(), run.dir / "final.pt")
    return artifacts


class Witness(Callback):
    """Records the hooks it sees; in a worker, also what the run's context held (as JSON)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.seen: dict[str, Any] = {}

    def on_experiment_start(self, ctx: LogContext) -> None:
        self.calls.append("on_experiment_start")

    def on_group_start(self, ctx: LogContext, group_name: str) -> None:
        self.calls.append(f"on_group_start:{group_name}")

    def on_run_start(self, ctx: LogContext) -> None:
        self.calls.append(f"on_run_start:{ctx.run_key}")
        self.seen = {
            "pid": os.getpid(),
            "ids": {k: v for k, v in ctx.ids.items()},
            "run_key": ctx.run_key,
            "run_dir": str(ctx.run_dir),
            "arm": ctx.arm,
            "group": ctx.group_name,
            "repeat": ctx.repeat,
            "seed": ctx.seed,
            "run_config": ctx.run_config,
            "repeats": ctx.config["repeats"],
        }

    def on_train_start(self, state: LoopState) -> None:
        self.calls.append("on_train_start")
        torch.save(state.model.state_dict(), state.ctx.run_dir / "start.pt")

    def on_train_end(self, state: LoopState, artifacts: Any) -> None:
        self.calls.append("on_train_end")

    def on_error(self, ctx: LogContext, exc: BaseException) -> None:
        self.calls.append(f"on_error:{ctx.run_key}:{type(exc).__name__}")

    def on_run_end(self, ctx: LogContext, run_result: Any, arm: Any) -> None:
        self.calls.append(f"on_run_end:{run_result.run_key}:{run_result.status}")
        self.seen["arm_runs"] = [r.run_key for r in arm.runs]

    def on_experiment_end(self, ctx: LogContext, result: ExperimentResult) -> None:
        self.calls.append(f"on_experiment_end:{result.status}")

    def close(self) -> None:
        self.calls.append("close")
        if "run_dir" in self.seen:  # a worker: leave what it saw in the run's folder
            path = Path(self.seen["run_dir"]) / "witness.json"
            path.write_text(json.dumps({**self.seen, "calls": self.calls}))


class InterruptAtGroup(Callback):
    """Ctrl-C in the parent at `on_group_start` of `group`, once `wait_for` exists."""

    def __init__(self, group: str, wait_for: Path) -> None:
        self.group = group
        self.wait_for = wait_for

    def on_group_start(self, ctx: LogContext, group_name: str) -> None:
        if group_name != self.group:
            return
        deadline = time.monotonic() + 60
        while not self.wait_for.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise KeyboardInterrupt


def _rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.exec_driver_sql(sql)]
    finally:
        engine.dispose()


def _final(result: ExperimentResult) -> dict[str, dict[str, float]]:
    """Final metrics per run, less the wall-clock ones."""
    return {
        r.run_key: {k: v for k, v in r.metrics.items() if k != "step_time"} for r in result.runs
    }


def _experiment(name: str, out: Path, store: Any, repeats: int = 2, **kwargs: Any) -> Experiment:
    kwargs.setdefault("arms", [Arm("a"), Arm("b", lr=0.05)])
    return Experiment(
        name, train, base_config=Cfg(), repeats=repeats, store=store, output_dir=out, seed=7,
        **kwargs,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# settings


def test_executor_and_workers_are_validated() -> None:
    with pytest.raises(
        ConfigError, match=r"^executor='threads': use 'serial', 'processes' or 'ray'$"
    ):
        Experiment("x", train, executor="threads", store=False)  # type: ignore[arg-type]
    for workers in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError) as info:
            Experiment("x", train, executor="processes", workers=workers, store=False)  # type: ignore[arg-type]
        assert str(info.value).startswith(f"workers={workers!r}: use an int >= 1")
        assert "\n" not in str(info.value)
    # default: one worker per CPU, at most one per run
    exp = Experiment("x", train, repeats=1, executor="processes", store=False)
    assert (exp.executor, exp.workers) == ("processes", 1)
    exp = Experiment("x", train, repeats=500, executor="processes", store=False)
    assert exp.workers == os.cpu_count()
    assert Experiment("x", train, store=False).executor == "serial"


def test_what_cannot_reach_a_worker_fails_before_anything_runs(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"

    def local_train(run: RunSpec) -> None:
        pass

    for bad in (lambda run: None, local_train):
        exp = Experiment("x", bad, executor="processes", store=url, output_dir=tmp_path)
        with pytest.raises(ConfigError) as info:
            exp.run()
        message = str(info.value)
        assert message.startswith("executor='processes' cannot send train to a worker process (")
        assert message.endswith(
            "define train at module top level (a lambda or local function cannot cross to a "
            "worker process)"
        )
        assert "\n" not in message

    class LocalCallback(Callback):
        pass

    with pytest.raises(ConfigError, match="cannot send callback LocalCallback to a worker"):
        Experiment("x", train, callbacks=[LocalCallback()], executor="processes",
                   store=url, output_dir=tmp_path).run()  # fmt: skip
    with pytest.raises(ConfigError, match="cannot send benchmark 'b' to a worker process"):
        Experiment("x", train, benchmarks=[Evaluator("b", lambda m: {})], executor="processes",
                   store=url, output_dir=tmp_path).run()  # fmt: skip
    assert not (tmp_path / "lab.db").exists()  # the store was never opened
    assert list(tmp_path.iterdir()) == []


def test_a_sql_logger_pickles_without_its_store(store_url: str) -> None:
    store = Store(store_url)
    for logger in (SqlLogger(store), SqlLogger(store_url)):
        logger.open()
        copy = pickle.loads(pickle.dumps(logger))
        assert copy._store is None and copy._owns_store
        assert copy._store_arg == store.url  # password and all
        assert copy.store.url == store.url and copy.store is not store
        assert copy.store.list_experiments() == []
        copy.close()
        logger.close()
    assert store.list_experiments() == []  # the Store the user passed is still open
    store.close()


# --------------------------------------------------------------------------------------------
# 2 arms x 2 repeats in 2 worker processes


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One experiment under executor="processes", shared by the tests that read it."""
    root = tmp_path_factory.mktemp("processes")
    url = f"sqlite:///{root / 'lab.db'}"
    witness = Witness()
    exp = _experiment("pool", root / "runs", url, callbacks=[witness],
                      executor="processes", workers=2)  # fmt: skip
    started = time.perf_counter()
    result = exp.run()
    yield {
        "result": result,
        "url": url,
        "runs": root / "runs" / "pool",
        "witness": witness,
        "seconds": time.perf_counter() - started,
    }


@pytest.mark.slow
def test_every_run_is_recorded_once_by_its_worker(processes: dict[str, Any]) -> None:
    result, url = processes["result"], processes["url"]
    keys = ["a-r0", "a-r1", "b-r0", "b-r1"]
    assert [(r.run_key, r.status, r.seed) for r in result.runs] == [
        ("a-r0", "completed", 7),
        ("a-r1", "completed", 8),
        ("b-r0", "completed", 7),
        ("b-r1", "completed", 8),
    ]
    assert all(r.artifacts is None and r.error is None for r in result.runs)
    assert result.status == "completed"
    assert _rows(url, "SELECT name, status FROM experiments") == [("pool", "completed")]
    assert _rows(url, "SELECT count(*) FROM arms") == [(2,)]
    assert _rows(url, "SELECT count(*) FROM groups") == [(2,)]
    runs = _rows(url, "SELECT run_key, status, host, pid FROM runs ORDER BY run_key")
    assert [(k, s) for k, s, _, _ in runs] == [(k, "completed") for k in keys]
    assert _rows(url, "SELECT count(*) FROM metrics") == [
        (len(keys) * (STEPS * len(STEP_KEYS) + 1),)  # + val/loss at the last step
    ]
    per_run = _rows(url, "SELECT r.run_key, count(*) FROM metrics m JOIN runs r "
                    "USING (run_id) GROUP BY r.run_key ORDER BY r.run_key")  # fmt: skip
    assert per_run == [(k, STEPS * len(STEP_KEYS) + 1) for k in keys]
    # each run was recorded by its own worker process, not by this one
    pids = {key: pid for key, _, _, pid in runs}
    assert all(host == socket.gethostname() for _, _, host, _ in runs)
    assert os.getpid() not in pids.values()
    assert len(set(pids.values())) == len(keys)  # a fresh process per run
    for key in keys:
        seen = json.loads((processes["runs"] / key / "witness.json").read_text())
        assert seen["pid"] == pids[key]


@pytest.mark.slow
def test_the_context_and_callbacks_reach_the_worker_intact(processes: dict[str, Any]) -> None:
    url = processes["url"]
    exp_id = _rows(url, "SELECT experiment_id FROM experiments")[0][0]
    arm_ids = dict(_rows(url, "SELECT name, arm_id FROM arms"))
    group_ids = dict(_rows(url, "SELECT name, group_id FROM groups"))
    run_ids = dict(_rows(url, "SELECT run_key, run_id FROM runs"))
    for key in ("a-r0", "a-r1", "b-r0", "b-r1"):
        arm, repeat = key[0], int(key[-1])
        seen = json.loads((processes["runs"] / key / "witness.json").read_text())
        assert seen["run_key"] == key
        assert Path(seen["run_dir"]) == processes["runs"] / key
        assert (seen["arm"], seen["group"], seen["repeat"], seen["seed"]) == (
            arm, arm, repeat, 7 + repeat,
        )  # fmt: skip
        assert seen["run_config"] == Cfg(lr=0.1 if arm == "a" else 0.05).model_dump()
        assert seen["repeats"] == 2  # the experiment's config came along
        # the ids the parent's SqlLogger created, then the run's own from the worker's copy
        ids = seen["ids"]
        assert ids[EXPERIMENT_ID] == exp_id
        assert (ids[arm_key("a")], ids[arm_key("b")]) == (arm_ids["a"], arm_ids["b"])
        assert ids[group_key(arm)] == group_ids[arm]
        assert ids[RUN_ID] == run_ids[key]
        # the run-level hooks fired on the worker's copy, then close
        assert seen["calls"][-5:] == [
            f"on_run_start:{key}",
            "on_train_start",
            "on_train_end",
            f"on_run_end:{key}:completed",
            "close",
        ]
        assert key in seen["arm_runs"]
    # the parent's callbacks saw the experiment-level hooks only
    assert processes["witness"].calls == [
        "on_experiment_start",
        "on_group_start:a",
        "on_group_start:b",
        "on_experiment_end:completed",
        "close",
    ]


@pytest.mark.slow
def test_serial_and_processes_give_the_same_metrics(
    processes: dict[str, Any], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    serial = _experiment("pool", tmp_path / "runs", url).run()
    assert [r.run_key for r in serial.runs] == [r.run_key for r in processes["result"].runs]
    assert _final(serial) == _final(processes["result"])
    assert all("val/loss" in m and "loss" in m for m in _final(serial).values())
    curve = (
        "SELECT r.run_key, m.key, m.step, m.value FROM metrics m JOIN runs r USING (run_id) "
        "WHERE m.key <> 'step_time' ORDER BY r.run_key, m.key, m.step"
    )
    assert _rows(url, curve) == _rows(processes["url"], curve)  # every step, bit for bit


@pytest.mark.slow
def test_running_it_again_skips_the_completed_runs(processes: dict[str, Any]) -> None:
    url = processes["url"]
    runs = "SELECT run_key, status, pid, started_at FROM runs ORDER BY run_key"
    before = _rows(url, runs)
    again = _experiment("pool", processes["runs"].parent, url, executor="processes").run()
    assert {r.run_key: r.metrics for r in again.runs} == {
        r.run_key: r.metrics for r in processes["result"].runs
    }
    assert [r.seconds for r in again.runs] == [0.0] * 4
    assert _rows(url, runs) == before  # no worker started, nothing recorded again


# --------------------------------------------------------------------------------------------
# chains, dead workers, interrupts, PostgreSQL


@pytest.mark.slow
def test_a_chain_stage_starts_once_its_parent_completed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    stages = [{"shift": 0.0}, {"shift": 1.0}]
    exp = _experiment("chain", tmp_path / "runs", url, executor="processes",
                      arms=[Arm("cl", stages=stages, checkpoints=True)],
                      callbacks=[Witness()], repeats=1)  # fmt: skip
    result = exp.run()
    assert [(r.run_key, r.parent_run_key, r.status) for r in result.runs] == [
        ("cl-r0-s0", None, "completed"),
        ("cl-r0-s1", "cl-r0-s0", "completed"),
    ]
    runs = tmp_path / "runs" / "chain"
    final = torch.load(runs / "cl-r0-s0" / "final.pt")  # stage 1 started from these weights
    start = torch.load(runs / "cl-r0-s1" / "start.pt")
    assert final.keys() == start.keys()
    for name, tensor in final.items():
        torch.testing.assert_close(start[name], tensor, rtol=0, atol=0)
    parents = _rows(url, "SELECT r.run_key, p.run_key, r.pid FROM runs r LEFT JOIN runs p "
                    "ON p.run_id = r.parent_run_id ORDER BY r.run_key")  # fmt: skip
    assert [(key, parent) for key, parent, _ in parents] == [
        ("cl-r0-s0", None),
        ("cl-r0-s1", "cl-r0-s0"),
    ]
    assert parents[0][2] != parents[1][2]  # each stage in a process of its own
    assert _rows(url, "SELECT name, kind FROM groups") == [("cl-r0", "chain")]


@pytest.mark.slow
def test_a_dead_worker_crashes_its_run_and_the_others_go_on(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    witness = Witness()
    arms = [Arm("ok", loop=False), Arm("exit", die="exit"), Arm("kill", die="kill")]
    exp = _experiment("dead", tmp_path / "runs", url, arms=arms, callbacks=[witness],
                      executor="processes", workers=3, repeats=1)  # fmt: skip
    result = exp.run()
    assert [(r.run_key, r.status) for r in result.runs] == [
        ("ok-r0", "completed"),
        ("exit-r0", "crashed"),
        ("kill-r0", "crashed"),
    ]
    errors = {r.run_key: r.error for r in result.runs}
    assert errors["exit-r0"].startswith("worker process died (exit code 3, pid ")
    assert errors["kill-r0"].startswith("worker process died (killed by SIGKILL, pid ")
    assert result.status == "failed"
    assert sorted(_rows(url, "SELECT run_key, status, error FROM runs")) == sorted(
        (r.run_key, r.status, r.error) for r in result.runs
    )
    assert _rows(url, "SELECT status FROM experiments") == [("failed",)]
    # the parent recorded the dead runs: on_error and on_run_end fired here for them
    for key in ("exit-r0", "kill-r0"):
        assert f"on_error:{key}:WorkerDied" in witness.calls
        assert f"on_run_end:{key}:crashed" in witness.calls
    assert "on_run_end:ok-r0:completed" not in witness.calls  # that one ended in its worker


@pytest.mark.slow
def test_a_run_whose_worker_keeps_dying_is_retried_then_left_crashed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    witness = Witness()
    exp = _experiment("retry", tmp_path / "runs", url, arms=[Arm("kill", die="kill")],
                      callbacks=[witness], executor="processes", repeats=1,
                      max_retries=2)  # fmt: skip
    result = exp.run()
    assert [(r.run_key, r.status) for r in result.runs] == [("kill-r0", "crashed")]
    assert result.runs[0].error.startswith("worker process died (killed by SIGKILL, pid ")
    # the first try and two retries, each recorded crashed here; one row in the store
    assert witness.calls.count("on_run_end:kill-r0:crashed") == 3
    assert _rows(url, "SELECT run_key, status FROM runs") == [("kill-r0", "crashed")]
    assert _rows(url, "SELECT status FROM experiments") == [("failed",)]


@pytest.mark.slow
def test_an_interrupt_in_the_parent_stops_the_workers_and_records_them(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    runs = tmp_path / "runs" / "ctrl-c"
    stop = InterruptAtGroup("b", wait_for=runs / "a-r1" / "sleeping")
    exp = _experiment("ctrl-c", tmp_path / "runs", url, callbacks=[stop],
                      arms=[Arm("a", die="sleep", loop=False), Arm("b")], executor="processes",
                      workers=2)  # fmt: skip
    started = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        exp.run()
    assert time.perf_counter() - started < 60  # a-r1 was interrupted, not waited for
    assert _rows(url, "SELECT status FROM experiments") == [("failed",)]
    assert _rows(url, "SELECT run_key, status, error FROM runs ORDER BY run_key") == [
        ("a-r0", "completed", None),
        ("a-r1", "failed", "interrupted (KeyboardInterrupt)"),
    ]  # b never started


@pytest.mark.slow
@pytest.mark.postgres
def test_processes_on_postgres(pg_url: str, tmp_path: Path) -> None:
    store = Store(pg_url)  # a Store object: the workers reopen it from its URL
    try:
        exp = _experiment("pg", tmp_path / "runs", store, arms=[Arm("a")],
                          executor="processes", repeats=1)  # fmt: skip
        result = exp.run()
        assert [(r.run_key, r.status) for r in result.runs] == [("a-r0", "completed")]
        (run,) = _rows(pg_url, "SELECT run_key, status, pid FROM runs")
        assert run[:2] == ("a-r0", "completed") and run[2] != os.getpid()
        assert _rows(pg_url, "SELECT count(*) FROM metrics") == [(STEPS * len(STEP_KEYS) + 1,)]
        assert store.list_experiments()[0]["status"] == "completed"
    finally:
        store.close()


def where(run: RunSpec) -> dict[str, Any]:
    """Where the run's process came from, and what it sees of its parent's state."""
    return {
        "parent": float(os.getppid()),
        "pid": float(os.getpid()),
        "knob": float(os.environ.get("LAB_TEST_KNOB", "-1")),
        "gone": float("LAB_TEST_GONE" in os.environ),
        "threads": float(torch.get_num_threads()),
    }


def test_workers_fork_from_one_server_with_the_environment_as_it_is_at_each_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork server starts with the first pool and keeps the environment of its start;
    each run still sees the experiment's environment as it is when the run starts, as a
    spawned process would, and its own pid, never the server's or the experiment's."""
    monkeypatch.setenv("LAB_TEST_GONE", "1")
    monkeypatch.setenv("LAB_TEST_KNOB", "1")
    first = Experiment("one", where, repeats=2, executor="processes", workers=2, store=False,
                       output_dir=tmp_path).run()  # fmt: skip
    monkeypatch.delenv("LAB_TEST_GONE")
    monkeypatch.setenv("LAB_TEST_KNOB", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    second = Experiment("two", where, repeats=2, executor="processes", workers=2, store=False,
                        output_dir=tmp_path).run()  # fmt: skip
    runs = first.runs + second.runs
    assert [r.status for r in runs] == ["completed"] * 4
    servers = {r.metrics["parent"] for r in runs}
    assert len(servers) == 1 and os.getpid() not in servers  # one server, forked from
    assert len({r.metrics["pid"] for r in runs} | servers | {os.getpid()}) == 6
    assert [(r.metrics["knob"], r.metrics["gone"]) for r in runs] == [
        (1, 1),
        (1, 1),
        (2, 0),
        (2, 0),
    ]
    assert [r.metrics["threads"] for r in second.runs] == [3.0, 3.0]  # OMP_NUM_THREADS wins
