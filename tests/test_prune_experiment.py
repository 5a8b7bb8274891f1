"""Pruning in experiments: ``Experiment(prune=Prune(...))`` stops the runs a rule judges
worse than the others at a step, records them `pruned`, leaves them out of every mean, and
never trains them again.

Each run fits ``w * 1 -> 0`` with one weight that starts at 1 under SGD, so its loss at step
k is ``(1 - 2 lr) ** (2 (k - 1))`` whatever its seed: arm ``a`` (lr 0.1) falls fastest, ``b``
(lr 0.05) slower, ``c`` (lr 0) not at all. With the median rule (one finished run to start,
a warm-up of 3 steps), ``a``'s runs complete (equal to the median, never above it), and every
run of ``b`` and ``c`` is pruned at step 3, where its loss (0.9 ** 4, 1.0) is above ``a``'s
(0.8 ** 4), whatever order the runs went in.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest

from tests import warm

torch = pytest.importorskip("torch")
pytest.importorskip("optuna")

from lab import Arm, Experiment, RunSpec, TrainingLoop  # noqa: E402
from lab.errors import ConfigError  # noqa: E402
from lab.store import Store  # noqa: E402
from lab.sweeps import Prune  # noqa: E402

RULE = Prune("loss", mode="min", rule="median", n_startup_trials=1, n_warmup_steps=3)
STEPS = 8
ARMS = [Arm("a", lr=0.1), Arm("b", lr=0.05), Arm("c", lr=0.0)]
#: Where each pruned run was pruned: b's and c's loss at step 3 (to 6 digits: float32).
PRUNED = {
    f"{arm}-r{r}": {"step": 3, "rule": "median", "metric": "loss", "value": value}
    for arm, value in (("b", 0.6561), ("c", 1.0))
    for r in (0, 1)
}


def _pruned(records: dict[str, dict[str, Any] | None]) -> dict[str, dict[str, Any]]:
    """The pruned records given, their values to 6 digits."""
    return {k: {**p, "value": round(p["value"], 6)} for k, p in records.items() if p}


class Cfg(pydantic.BaseModel):
    lr: float = 0.1
    log_every: int = 1


def train(run: RunSpec) -> Any:
    """One weight from 1 towards 0 at the arm's rate; the loop's `loss` at each step."""
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.constant_(model.weight, 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=run.config.lr)
    data = [(torch.ones(1, 1), torch.zeros(1, 1))]
    loop = TrainingLoop(model, opt, data, _loss, STEPS, log_every=run.config.log_every)
    return loop.fit(run)


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The squared output: the loss of ``w * 1 -> 0``."""
    return model(batch[0]).pow(2).mean()


def _experiment(url: str, tmp_path: Path, **kwargs: Any) -> Experiment:
    return Experiment(
        "pruned", train, arms=ARMS, repeats=2, base_config=Cfg(), store=url,
        output_dir=tmp_path / "runs", prune=RULE, **kwargs,
    )  # fmt: skip


def _check(result: Any, url: str) -> None:
    runs = {r.run_key: r for arm in result.arms for r in arm.runs}
    assert {k: r.status for k, r in sorted(runs.items())} == {
        "a-r0": "completed", "a-r1": "completed", "b-r0": "pruned", "b-r1": "pruned",
        "c-r0": "pruned", "c-r1": "pruned",
    }  # fmt: skip
    assert _pruned({k: r.pruned for k, r in runs.items()}) == PRUNED
    store = Store(url)
    try:
        points = store.metric_points("pruned", "loss")
        rows = {r["run_key"]: r["status"] for r in store.current_runs("pruned")}
    finally:
        store.close()
    # each pruned run stopped after the step it was pruned at; the others trained on
    assert {k: [s for s, _ in p] for k, p in points.items()} == {
        k: list(range(1, (STEPS if k.startswith("a") else 3) + 1)) for k in runs
    }
    assert rows == {k: r.status for k, r in runs.items()}
    summary = result.summary()
    assert summary.runs_by_status == {"completed": 2, "pruned": 4}
    assert [(r.arm, r.n) for r in summary.rows if r.metric == "loss"] == [
        ("a", 2), ("b", 0), ("c", 0),
    ]  # fmt: skip
    assert summary.best_arm == "a"
    print(summary)


@pytest.mark.parametrize("log_every", [1, 2])
def test_runs_a_rule_judges_worse_are_pruned_at_their_step(
    store_url: str, tmp_path: Path, log_every: int
) -> None:
    """On SQLite and PostgreSQL, serially; with ``log_every=2`` step 3's metrics are held
    and judged at step 4, where the loop stops: the record still names step 3."""
    arms = [Arm(a.name, **a.overrides, log_every=log_every) for a in ARMS]
    exp = Experiment(
        "pruned", train, arms=arms, repeats=2, base_config=Cfg(), store=store_url,
        output_dir=tmp_path / "runs", prune=RULE,
    )  # fmt: skip
    result = exp.run()
    if log_every == 1:
        _check(result, store_url)
        return
    runs = {r.run_key: r for arm in result.arms for r in arm.runs}
    assert _pruned({k: r.pruned for k, r in runs.items()}) == PRUNED
    store = Store(store_url)
    try:
        steps = {k: len(p) for k, p in store.metric_points("pruned", "loss").items()}
    finally:
        store.close()
    assert steps == {"a-r0": 8, "a-r1": 8, "b-r0": 4, "b-r1": 4, "c-r0": 4, "c-r1": 4}


def test_pruned_runs_are_recorded_and_never_trained_again(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    result = _experiment(url, tmp_path).run()
    _check(result, url)
    db = tmp_path / "lab.db"
    con = sqlite3.connect(db)
    try:
        recorded = con.execute(
            "SELECT run_key, status, pruned FROM runs ORDER BY run_key"
        ).fetchall()
    finally:
        con.close()
    assert [(k, s) for k, s, _ in recorded] == [
        ("a-r0", "completed"), ("a-r1", "completed"), ("b-r0", "pruned"), ("b-r1", "pruned"),
        ("c-r0", "pruned"), ("c-r1", "pruned"),
    ]  # fmt: skip
    assert _pruned({k: json.loads(p) if p else None for k, _, p in recorded}) == PRUNED
    again = _experiment(url, tmp_path).run()  # nothing left to train
    assert [r.status for arm in again.arms for r in arm.runs] == [
        "completed", "completed", "pruned", "pruned", "pruned", "pruned",
    ]  # fmt: skip
    reused = {r.run_key: r for arm in again.arms for r in arm.runs}
    assert _pruned({k: r.pruned for k, r in reused.items()}) == PRUNED  # as they ended
    store = Store(url)
    try:
        assert len(store.metric_points("pruned", "loss")["b-r0"]) == 3  # not trained again
    finally:
        store.close()
    _check_doors(url)


def _check_doors(url: str) -> None:
    """Every door that lists runs shows the pruned ones as `pruned`: `lab.inspect`, ``lab
    ls``, ``lab show`` and the dashboard's runs table."""
    from fastapi.testclient import TestClient

    import lab.inspect
    from lab.server import create_app

    con = lab.inspect.connect(url)
    assert con.execute(
        "SELECT run_key, status, json_extract(pruned, '$.step')::INT FROM runs "
        "ORDER BY run_key"
    ).fetchall() == [
        ("a-r0", "completed", None), ("a-r1", "completed", None), ("b-r0", "pruned", 3),
        ("b-r1", "pruned", 3), ("c-r0", "pruned", 3), ("c-r1", "pruned", 3),
    ]  # fmt: skip
    con.close()
    listed = _lab("ls", "--store", url)
    assert "2 completed, 4 pruned" in listed, listed
    shown = _lab("show", "pruned", "--store", url)
    assert sum(line.split()[:1] in (["b-r0"], ["b-r1"], ["c-r0"], ["c-r1"])
               and "pruned" in line.split() for line in shown.splitlines()) == 4, shown  # fmt: skip
    ui = TestClient(create_app(Store(url, readonly=True), auth=False, writes=False),
                    base_url="http://127.0.0.1")  # fmt: skip
    with ui:
        table = ui.get("/api/v1/dashboard/experiments/pruned/runs").json()["runs"]
    assert sorted((r["run_key"], r["status"]) for r in table) == [
        ("a-r0", "completed"), ("a-r1", "completed"), ("b-r0", "pruned"), ("b-r1", "pruned"),
        ("c-r0", "pruned"), ("c-r1", "pruned"),
    ]  # fmt: skip


def _lab(*args: str) -> str:
    """What the `lab` command prints (it must succeed)."""
    out = warm.run([sys.executable, "-m", "lab.cli", *args], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_pruning_works_in_worker_processes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    result = _experiment(url, tmp_path, executor="processes", workers=2).run()
    _check(result, url)


def test_prune_needs_a_prune_and_a_store(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        Experiment("x", train, prune="median")  # type: ignore[arg-type]
    assert str(err.value) == (
        "prune='median': use prune=Prune('val/loss', mode='min', rule='median')"
    )
    with pytest.raises(ConfigError) as err:
        Experiment("x", train, prune=RULE, store=False)
    assert str(err.value) == (
        "prune=Prune('loss', mode='min', rule='median', n_startup_trials=1, n_warmup_steps=3) "
        "with store=False: a pruning rule compares each run with the others recorded in the "
        "store; give the experiment a store"
    )


def test_a_pruned_run_has_no_value_in_its_race_round() -> None:
    """Under a race, a pruned run's final metric is not its value: it has none (ranked worst
    in its round), as a failed run."""
    from lab._race_rounds import RaceRounds
    from lab.records import RunResult
    from lab.sweeps import Race

    rounds = RaceRounds(Race("loss", min_repeats=2, max_repeats=3), ["a", "b"])
    for arm, status, value in (("a", "completed", 0.5), ("b", "pruned", 0.1)):
        rounds.ended(RunResult(f"{arm}-r0", arm, 0, 0, 0, status, {"loss": value}, 1.0))
    assert rounds.state.values == {"a": [0.5], "b": [None]}


def test_a_sampled_arm_told_after_a_rerun_is_told_its_reused_pruned_run(tmp_path: Path) -> None:
    """A sweep whose process died after a run was pruned but before its arm was told: run
    again, the pruned run is reused as it ended, and its arm is told `pruned` with the value
    it was pruned at, as the uninterrupted sweep would have told it."""
    from lab import Sweep
    from lab.sweeps import Choice

    url = f"sqlite:///{tmp_path / 'lab.db'}"

    def sweep() -> Experiment:
        space = {"lr": Choice([0.1, 0.05, 0.0])}
        return Experiment("sampled", train, base_config=Cfg(), store=url, prune=RULE,
                          output_dir=tmp_path / "runs",
                          sweep=Sweep(space, sampler="grid", metric="loss"))  # fmt: skip

    sweep().run()
    db = tmp_path / "lab.db"
    told = "SELECT number, told, round(value, 6), state FROM sweep_trials ORDER BY number"
    con = sqlite3.connect(db)
    try:
        assert con.execute(told).fetchall() == [
            (0, 0, 0.043980, "complete"), (1, 1, 0.6561, "pruned"), (2, 2, 1.0, "pruned"),
        ]  # fmt: skip
        with con:  # as if the process died before the last two arms were told
            con.execute("UPDATE sweep_trials SET told = NULL, value = NULL, state = 'running' "
                        "WHERE number > 0")  # fmt: skip
    finally:
        con.close()
    again = sweep().run()
    assert [(r.run_key, r.seconds, r.pruned is not None) for r in again.runs] == [
        ("lr-0.1-e14a64e4-r0", 0.0, False), ("lr-0.05-9da5d2f5-r0", 0.0, True),
        ("lr-0.0-f5d35a90-r0", 0.0, True),
    ]  # fmt: skip
    con = sqlite3.connect(db)
    try:
        assert con.execute(told).fetchall() == [
            (0, 0, 0.043980, "complete"), (1, 1, 0.6561, "pruned"), (2, 2, 1.0, "pruned"),
        ]  # fmt: skip
    finally:
        con.close()
