"""Running an experiment again: a recorded run is reused only when it would train the same
thing; `fresh=True` supersedes runs (kept, moved aside); two processes never train one run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
import sqlalchemy as sa
import torch
from hypothesis import given
from hypothesis import strategies as st

import lab
import lab.inspect
from lab import Arm, Callback, Experiment
from lab._reuse import Fingerprint, differences
from lab.errors import ConfigError, NoExperiment, RunBusy
from lab.store import Store
from tests import warm


class Config(pydantic.BaseModel):
    lr: float = 0.1
    steps: int = 4


class Started(Callback):
    """Records the runs that started training."""

    def __init__(self) -> None:
        self.trained: list[str] = []

    def on_train_start(self, state: lab.LoopState) -> None:
        self.trained.append(f"{state.ctx.run_key}@{state.step}")


def train(run: lab.RunSpec) -> lab.LoopArtifacts:
    g = torch.Generator().manual_seed(run.seed)
    x = torch.randn(8, 2, generator=g)
    model = torch.nn.Linear(2, 1)
    loop = lab.TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=run.config.lr),
        [(x, x.sum(1, keepdim=True))],
        lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        run.config.steps,
        checkpoint=lab.CheckpointConfig(every=2, save_at_end=True),
    )
    return loop.fit(run)


def train_other(run: lab.RunSpec) -> lab.LoopArtifacts:
    return train(run)


def sweep(url: str, out: Path, seen: Started | None = None, **kw: Any) -> Experiment:
    options: dict[str, Any] = {"arms": [Arm("small", lr=0.01), Arm("large", lr=0.1)],
                               "repeats": 2, "base_config": Config()}  # fmt: skip
    options.update(kw)
    fn = options.pop("train", train)
    return Experiment("sweep", fn, callbacks=[seen] if seen else [], store=url,
                      output_dir=out, **options)  # fmt: skip


def rows(url: str, sql: str) -> list[tuple]:
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(sql))]
    finally:
        engine.dispose()


RUNS = "SELECT run_key, status, superseded_at IS NOT NULL FROM runs ORDER BY run_id"


# -- reuse only what would train the same thing ------------------------------------------------


def test_a_changed_arm_override_is_refused_before_any_run_trains(
    store_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    sweep(store_url, out).run()
    before = rows(store_url, "SELECT run_key, status, config, config_hash FROM runs ORDER BY 1")
    arms = rows(store_url, "SELECT name, overrides FROM arms ORDER BY 1")
    seen = Started()
    changed = sweep(store_url, out, seen, arms=[Arm("small", lr=0.05), Arm("large", lr=0.1)])
    with pytest.raises(ConfigError) as err:
        changed.run()
    assert str(err.value) == (
        "experiment 'sweep' has 2 recorded runs that trained something else than they would "
        "now: lr: 0.01 -> 0.05 (small-r0, small-r1); use a new experiment name, or start "
        "afresh with fresh=True (--fresh on the command line), which keeps the old runs as "
        "superseded"
    )
    assert seen.trained == []
    assert rows(store_url, "SELECT run_key, status, config, config_hash FROM runs ORDER BY 1") == (
        before
    )
    assert rows(store_url, "SELECT name, overrides FROM arms ORDER BY 1") == arms  # unchanged
    assert all(h is not None and len(h) == 64 for *_, h in before)


def test_the_same_experiment_again_reuses_every_run(store_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = sweep(store_url, out).run()
    seen = Started()
    again = sweep(store_url, out, seen, repeats=3).run()  # more repeats: only new runs train
    assert seen.trained == ["small-r2@0", "large-r2@0"]
    assert [r.metrics for r in again.runs if r.repeat < 2] == [r.metrics for r in first.runs]


@pytest.mark.parametrize(
    ("change", "difference"),
    [
        ({"base_config": Config(steps=2)}, "steps: 4 -> 2 (all 4 runs)"),
        ({"seed": 10}, "seed: 0 -> 10 (small-r0, large-r0); seed: 1 -> 11 (small-r1, large-r1)"),
        ({"train": train_other}, f"train function: {__name__}:train -> "
                                 f"{__name__}:train_other (all 4 runs)"),
    ],
)  # fmt: skip
def test_each_field_a_run_depends_on_is_named(
    sqlite_url: str, tmp_path: Path, change: dict[str, Any], difference: str
) -> None:
    sweep(sqlite_url, tmp_path / "out").run()
    with pytest.raises(ConfigError, match=r"^experiment 'sweep' has 4 recorded runs") as err:
        sweep(sqlite_url, tmp_path / "out", **change).run()
    assert f"would now: {difference}; use a new experiment name" in str(err.value)


def test_a_chain_is_reused_only_with_the_same_carry(sqlite_url: str, tmp_path: Path) -> None:
    def chain(carry: str, seen: Started | None = None) -> Experiment:
        arm = Arm("chain", stages=[{"lr": 0.1}, {"lr": 0.05}], carry=carry)  # type: ignore[arg-type]
        return Experiment("chain", train, base_config=Config(), arms=[arm], store=sqlite_url,
                          output_dir=tmp_path / "out",
                          callbacks=[seen] if seen else [])  # fmt: skip

    chain("weights").run()
    seen = Started()
    chain("weights", seen).run()
    assert seen.trained == []
    with pytest.raises(ConfigError) as err:
        chain("full").run()
    assert 'now: carry: (not recorded) -> "full" (chain-r0-s1); use' in str(err.value)


def test_runs_recorded_before_the_hash_are_compared_by_their_config(
    sqlite_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    sweep(sqlite_url, out, repeats=1).run()
    rows_ = rows(sqlite_url, "SELECT count(*) FROM runs")
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:  # as revision 0002 left them
        conn.execute(sa.text("UPDATE runs SET config_hash = NULL"))
        conn.execute(sa.text("UPDATE experiments SET config = '{}'"))
    engine.dispose()
    seen = Started()
    sweep(sqlite_url, out, seen, repeats=1).run()  # the same config: reused
    assert seen.trained == []
    with pytest.raises(ConfigError, match=r"now: lr: 0\.1 -> 0\.2 \(large-r0\); use"):
        sweep(sqlite_url, out, arms=[Arm("small", lr=0.01), Arm("large", lr=0.2)],
              repeats=1).run()  # fmt: skip
    assert rows(sqlite_url, "SELECT count(*) FROM runs") == rows_


# -- fresh: the old runs superseded, kept, moved aside -----------------------------------------


def test_fresh_supersedes_the_old_runs_and_keeps_them(store_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    sweep(store_url, out, repeats=1).run()
    old_points = rows(store_url, "SELECT count(*) FROM metrics")[0][0]
    old_ckpt = (out / "sweep" / "small-r0" / "checkpoints" / "latest").read_text()
    seen = Started()
    result = sweep(store_url, out, seen, arms=[Arm("small", lr=0.05), Arm("large", lr=0.1)],
                   repeats=1, fresh=True).run()  # fmt: skip
    assert seen.trained == ["small-r0@0", "large-r0@0"]  # from step 0: no old checkpoint
    assert result.status == "completed"
    assert rows(store_url, RUNS) == [
        ("small-r0~1", "completed", True),
        ("large-r0~1", "completed", True),
        ("small-r0", "completed", False),
        ("large-r0", "completed", False),
    ]
    assert rows(store_url, "SELECT count(*) FROM metrics")[0][0] == 2 * old_points
    moved = out / "sweep" / "small-r0.superseded-1"
    assert (moved / "checkpoints" / "latest").read_text() == old_ckpt
    recorded = rows(store_url, "SELECT output_dir FROM runs WHERE run_key = 'small-r0~1'")
    assert recorded == [(str(moved.resolve()),)]
    assert sorted(p.name for p in (out / "sweep").iterdir()) == [
        "large-r0", "large-r0.superseded-1", "small-r0", "small-r0.superseded-1",
    ]  # fmt: skip

    # a second fresh start: number 2, nothing overwritten
    sweep(store_url, out, repeats=1, fresh=True).run()
    assert [k for k, _s, sup in rows(store_url, RUNS) if sup] == [
        "small-r0~1", "large-r0~1", "small-r0~2", "large-r0~2",
    ]  # fmt: skip
    assert (out / "sweep" / "small-r0.superseded-2").is_dir()

    # every reader leaves superseded runs out
    store = Store(store_url)
    try:
        assert sorted(store.previous_runs("sweep")) == ["large-r0", "small-r0"]
        listed = store.list_experiments()[0]
        assert (listed["runs"], listed["runs_by_status"], listed["superseded"]) == (
            2, {"completed": 2}, 4,
        )  # fmt: skip
        shown = store.get_experiment("sweep")
        assert [r["run_key"] for r in shown["runs"]] == ["small-r0", "large-r0"]
        assert shown["superseded"] == 4
    finally:
        store.close()
    con = lab.inspect.connect(store_url)
    assert con.sql("select count(*) from runs").fetchone() == (2,)
    assert con.sql("select count(*) from all_runs").fetchone() == (6,)
    assert con.sql("select count(distinct run_id) from final_metrics").fetchone() == (2,)
    summary = lab.inspect.summary(con, "sweep", "loss").fetchall()
    assert [(row[0], row[1]) for row in summary] == [("small", 1), ("large", 1)]


def test_fresh_without_a_store_moves_the_run_folders_aside(tmp_path: Path) -> None:
    out = tmp_path / "out"
    Experiment("plain", train, base_config=Config(), store=False, output_dir=out).run()
    seen = Started()
    Experiment("plain", train, base_config=Config(steps=2), store=False, output_dir=out,
               callbacks=[seen], fresh=True).run()  # fmt: skip
    assert seen.trained == ["base-r0@0"]
    assert sorted(p.name for p in (out / "plain").iterdir()) == ["base-r0", "base-r0.superseded-1"]


# -- rm and mv ---------------------------------------------------------------------------------


def test_delete_and_rename_experiments(store_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    sweep(store_url, out, repeats=1).run()
    store = Store(store_url)
    try:
        with pytest.raises(ConfigError, match=r"^an experiment named 'sweep' exists already"):
            store.rename_experiment("sweep", "sweep")
        store.rename_experiment("sweep", "sweep-2")
        assert [e["name"] for e in store.list_experiments()] == ["sweep-2"]
        with pytest.raises(NoExperiment, match="no experiment named 'sweep' in the store"):
            store.delete_experiment("sweep")
        gone = store.delete_experiment("sweep-2")
        assert gone["runs"] == 2
        assert gone["folders"] == sorted(
            str((out / "sweep" / k).resolve()) for k in ("large-r0", "small-r0")
        )
        assert store.list_experiments() == []
    finally:
        store.close()
    for table in ("runs", "metrics", "arms", "groups", "summaries", "checkpoints", "evals"):
        assert rows(store_url, f"SELECT count(*) FROM {table}") == [(0,)], table
    assert (out / "sweep" / "small-r0" / "checkpoints" / "latest").exists()  # files stay


# -- the atomic claim --------------------------------------------------------------------------


def test_a_running_run_of_a_live_process_is_not_claimed(store_url: str) -> None:
    store = Store(store_url)
    other = Store(store_url)
    try:
        exp = store.begin_experiment("busy", config={}, seed=0, repeats=1)
        group = store.add_group(exp, "g")
        fields = {"run_key": "r0", "arm_id": None, "repeat": 0, "stage": 0, "seed": 0,
                  "config": {}, "output_dir": None}  # fmt: skip
        run_id = store.start_run(exp, group, **fields)
        with pytest.raises(RunBusy, match=r"^run r0 of experiment 'busy' is being trained by pid"):
            other.start_run(exp, group, **fields)
        with pytest.raises(RunBusy):
            other.claim_run(exp, group, **fields)
        with pytest.raises(RunBusy, match=r"^run r0 of experiment 'busy' is being trained"):
            other.delete_experiment("busy")
        store.finish_run(run_id, status="completed", summary={"loss": 0.5})
        finished = {"status": "completed", "summary": {"loss": 0.5}}
        assert other.claim_run(exp, group, **fields) == (None, finished)
        assert other.start_run(exp, group, **fields) == run_id  # a plain start resets it
    finally:
        store.close()
        other.close()


WORKER = """
import json, sys, time
sys.path.insert(0, {tests!r})
from pathlib import Path
import test_reuse as t
from lab.errors import RunBusy
go = Path({go!r})
while not go.exists():
    time.sleep(0.01)
seen = t.Started()
try:
    t.sweep({url!r}, Path({out!r}), seen, repeats=2, base_config=t.Config(steps=40)).run()
    print("RAN", json.dumps(seen.trained, separators=(",", ":")))
except RunBusy as exc:
    print("BUSY", json.dumps(seen.trained, separators=(",", ":")), exc)
"""


def test_two_processes_starting_the_same_experiment_never_train_one_run_twice(
    store_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    Store(store_url).close()  # the schema exists before they race
    go = tmp_path / "go"
    code = WORKER.format(tests=str(Path(__file__).parent), go=str(go), url=store_url,
                         out=str(out))  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        warm.popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _o, e in outs]
    said = sorted(o.split()[0] for o, _e in outs)
    assert said in (["BUSY", "RAN"], ["RAN", "RAN"]), outs
    trained = [run for o, _e in outs for run in json.loads(o.split(" ", 2)[1])]
    assert sorted(trained) == ["large-r0@0", "large-r1@0", "small-r0@0", "small-r1@0"], outs
    assert rows(store_url, "SELECT run_key, status FROM runs ORDER BY run_key") == [
        ("large-r0", "completed"), ("large-r1", "completed"),
        ("small-r0", "completed"), ("small-r1", "completed"),
    ]  # fmt: skip
    # each run trained once: 40 steps of loss, lr, grad_norm, step_time... once per step
    per_run = rows(store_url, "SELECT run_id, key, count(*) FROM metrics WHERE key = 'loss' "
                              "GROUP BY run_id, key")  # fmt: skip
    assert [n for *_k, n in per_run] == [40] * 4
    saves = rows(store_url, "SELECT run_id, step, count(*) FROM checkpoints WHERE event = 'save' "
                            "GROUP BY run_id, step HAVING count(*) > 1")  # fmt: skip
    assert saves == []
    for run in ("small-r0", "small-r1", "large-r0", "large-r1"):
        manifest = (out / "sweep" / run / "checkpoints" / "manifest.jsonl").read_text()
        steps = [json.loads(line)["step"] for line in manifest.splitlines()
                 if json.loads(line)["event"] == "save"]  # fmt: skip
        assert steps == sorted(set(steps)), run  # no step saved twice: one trainer


# -- the command line --------------------------------------------------------------------------


def lab_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return warm.run([sys.executable, "-m", "lab.cli", *args], capture_output=True,
                          text=True, timeout=300, input=stdin)  # fmt: skip


def test_quickstart_with_other_steps_is_refused_then_fresh_trains_anew(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    where = ["--store", url, "--output-dir", str(tmp_path / "runs")]
    first = lab_cli("quickstart", *where, "--steps", "60")
    assert first.returncode == 0, first.stderr
    refused = lab_cli("quickstart", *where, "--steps", "50")
    assert refused.returncode == 1
    assert refused.stderr == (
        "error: experiment 'quickstart' has 6 recorded runs that trained something else than "
        "they would now: steps: 60 -> 50 (all 6 runs); use a new experiment name, or start "
        "afresh with fresh=True (--fresh on the command line), which keeps the old runs as "
        "superseded\n"
    )
    assert rows(url, "SELECT DISTINCT json_extract(config, '$.steps') FROM runs") == [(60,)]
    fresh = lab_cli("quickstart", *where, "--steps", "50", "--fresh")
    assert fresh.returncode == 0, fresh.stderr
    assert rows(url, "SELECT json_extract(config, '$.steps'), count(*) FROM runs "
                     "WHERE superseded_at IS NULL GROUP BY 1") == [(50, 6)]  # fmt: skip
    assert rows(url, "SELECT count(*) FROM runs WHERE run_key LIKE '%~1'") == [(6,)]
    shown = lab_cli("show", "quickstart", "--store", url)
    assert shown.stdout.startswith("quickstart: completed, 6 runs, seed 0\n")
    assert "6 superseded runs are kept (fresh starts); lab.inspect's all_runs view lists them" in (
        shown.stdout
    )
    assert "~1" not in shown.stdout
    listed = lab_cli("ls", "--store", url).stdout
    assert "6 completed, 6 superseded" in listed


def test_rm_asks_first_and_mv_refuses_a_name_in_use(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    out = tmp_path / "out"
    for name in ("one", "two"):
        Experiment(name, train, base_config=Config(), store=url, output_dir=out).run()
    taken = lab_cli("mv", "one", "two", "--store", url)
    assert (taken.returncode, taken.stderr) == (1, "error: an experiment named 'two' exists "
                                                   "already; pick another name, or delete it "
                                                   "first: lab rm two\n")  # fmt: skip
    moved = lab_cli("mv", "one", "three", "--store", url)
    assert (moved.returncode, moved.stdout) == (0, (
        "renamed experiment 'one' to 'three'\nits run folders keep their old names, where its "
        f"rows point: {(out / 'one').resolve()}; runs of 'three' trained from now on get new "
        "folders (<output_dir>/three), without the checkpoints of the old ones\n"
    ))  # fmt: skip
    assert (out / "one" / "base-r0" / "checkpoints" / "latest").exists()
    assert not (out / "three").exists()
    kept = lab_cli("rm", "two", "--store", url, stdin="n\n")
    assert kept.returncode == 1
    assert "delete experiment 'two' and its 1 run from the store? [y/N]" in kept.stdout
    assert rows(url, "SELECT name FROM experiments ORDER BY name") == [("three",), ("two",)]
    gone = lab_cli("rm", "two", "--store", url, "--yes")
    assert gone.returncode == 0, gone.stderr
    assert gone.stdout == (
        "deleted experiment 'two' (1 run)\nits run folders are kept; remove them yourself if "
        f"you wish: {(out / 'two').resolve()}\n"
    )
    assert rows(url, "SELECT name FROM experiments") == [("three",)]
    assert rows(url, "SELECT count(*) FROM runs") == [(1,)]
    assert (out / "two" / "base-r0" / "checkpoints" / "latest").exists()
    unknown = lab_cli("rm", "nope", "--store", url, "--yes")
    assert (unknown.returncode, unknown.stderr) == (
        1, "error: no experiment named 'nope' in the store; known: three\n",
    )  # fmt: skip


def test_a_folder_the_store_does_not_know_is_moved_aside_not_resumed(
    sqlite_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    Experiment("again", train, base_config=Config(), store=sqlite_url, output_dir=out).run()
    store = Store(sqlite_url)
    store.delete_experiment("again")
    store.close()
    seen = Started()
    Experiment("again", train, base_config=Config(steps=2), store=sqlite_url, output_dir=out,
               callbacks=[seen]).run()  # fmt: skip
    assert seen.trained == ["base-r0@0"]  # not resumed from the deleted run's step 4
    assert sorted(p.name for p in (out / "again").iterdir()) == ["base-r0", "base-r0.superseded-1"]


TRAIN_LIB = """
import pydantic, torch
import lab


class Config(pydantic.BaseModel):
    lr: float = 0.1
    steps: int = 4


def train(run):
    x = torch.randn(8, 2, generator=torch.Generator().manual_seed(run.seed))
    model = torch.nn.Linear(2, 1)
    loop = lab.TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=run.config.lr),
                            [(x, x.sum(1, keepdim=True))],
                            lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                            run.config.steps)
    return loop.fit(run)
"""


def test_lab_run_fresh_supersedes_what_a_changed_file_would_not_reuse(tmp_path: Path) -> None:
    (tmp_path / "train_lib.py").write_text(TRAIN_LIB)
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    spec = tmp_path / "exp.yaml"
    body = ("name: filed\ntrain: train_lib:train\nconfig: train_lib:Config\n"
            f"output_dir: {tmp_path / 'runs'}\nbase_config: {{steps: STEPS}}\n")  # fmt: skip
    spec.write_text(body.replace("STEPS", "4"))
    assert lab_cli("run", str(spec), "--store", url).returncode == 0
    spec.write_text(body.replace("STEPS", "3"))
    refused = lab_cli("run", str(spec), "--store", url)
    assert (refused.returncode, refused.stderr) == (1, (
        "error: experiment 'filed' has 1 recorded run that trained something else than it "
        "would now: steps: 4 -> 3 (base-r0); use a new experiment name, or start afresh with "
        "fresh=True (--fresh on the command line), which keeps the old runs as superseded\n"
    ))  # fmt: skip
    fresh = lab_cli("run", str(spec), "--store", url, "--fresh")
    assert fresh.returncode == 0, fresh.stderr
    assert rows(url, RUNS) == [("base-r0~1", "completed", True), ("base-r0", "completed", False)]


def test_a_run_this_process_left_running_is_claimed_again(sqlite_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    Experiment("left", train, base_config=Config(), store=sqlite_url, output_dir=out).run()
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:  # as if its end could not be recorded: our own pid, running
        conn.execute(sa.text("UPDATE runs SET status = 'running', pid = :pid"),
                     {"pid": os.getpid()})  # fmt: skip
    engine.dispose()
    seen = Started()
    Experiment("left", train, base_config=Config(), store=sqlite_url, output_dir=out,
               callbacks=[seen]).run()  # fmt: skip
    assert seen.trained == ["base-r0@4"]  # crashed, then resumed from its last checkpoint
    assert rows(sqlite_url, "SELECT status FROM runs") == [("completed",)]


_leaf = st.one_of(st.integers(), st.floats(allow_nan=True), st.text(max_size=5), st.booleans(),
                  st.none())  # fmt: skip
_configs = st.recursive(
    st.dictionaries(st.text(min_size=1, max_size=4), _leaf, max_size=4),
    lambda inner: st.dictionaries(st.text(min_size=1, max_size=4), inner, max_size=3),
    max_leaves=10,
)


@given(config=_configs, seed=st.integers(0, 2**31), stage=st.integers(0, 5))
def test_the_config_hash_is_canonical(config: dict[str, Any], seed: int, stage: int) -> None:
    reordered = dict(reversed(list(config.items())))
    a = Fingerprint(config, seed, stage, "m:train")
    b = Fingerprint(json.loads(json.dumps(reordered)), seed, stage, "m:train")
    assert a.digest() == b.digest()  # key order and a JSON round trip change nothing
    assert len(a.digest()) == 64
    assert differences(a, Fingerprint(config, seed + 1, stage, "m:train")) == [
        f"seed: {seed} -> {seed + 1}"
    ]
    assert differences(a, a) == []
