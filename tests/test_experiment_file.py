"""Experiment files: real YAML and JSON files in a folder of their own, run by the real `lab`
console script into a real SQLite store, from another working directory; their mistakes, one
line each; the docs page's example; and the library functions from Python."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from lab.callbacks import kinds
from lab.callbacks.files import MetricSaver
from lab.errors import ConfigError
from lab.experiment_file import SummaryMetric, load_experiment, plan, read_experiment_file
from lab.loggers.console import ConsoleLogger
from lab.loggers.jsonl import JsonlLogger
from tests import warm

LAB = Path(sys.executable).parent / "lab"  # the installed console script
DOCS = Path(__file__).resolve().parent.parent / "docs" / "experiment-files.md"

TRAIN_LIB = """
import pydantic
import torch

from lab import Evaluator, TrainingLoop


class Config(pydantic.BaseModel):
    lr: float = 0.05
    steps: int = 4
    fail: bool = False


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def train(run):
    if run.config.fail:
        raise RuntimeError("boom")
    x = torch.randn(16, 2)
    y = x.sum(1, keepdim=True)
    model = torch.nn.Linear(2, 1)
    loop = TrainingLoop(
        model, torch.optim.SGD(model.parameters(), lr=run.config.lr), [(x, y)], mse,
        num_steps=run.config.steps,
        evaluators=[Evaluator("val", lambda m: {"loss": mse(m, (x, y)).item()}, every=2)],
    )
    return loop.fit(run)


def holdout(model):
    return {"acc": 1.0}
"""

#: 4 steps x 4 step metrics (loss, lr, grad_norm, step_time), and val/loss at steps 2 and 4
POINTS_PER_RUN = 4 * 4 + 2
KEYS = ["small-r0", "small-r1", "large-r0", "large-r1"]


def spec(**changes: Any) -> dict[str, Any]:
    """The file's content: 2 arms x 2 repeats with three callbacks, and `changes`."""
    return {
        "name": "lr-sweep",
        "train": "train_lib:train",
        "config": "train_lib:Config",
        "base_config": {"steps": 4},
        "arms": [{"name": "small", "lr": 0.01}, {"name": "large", "lr": 0.1}],
        "repeats": 2,
        "callbacks": [
            {"kind": "console_logger", "params": {"every": 2}},
            {"kind": "jsonl_logger"},
            {"kind": "metric_saver", "params": {"every": 2}},
        ],
        "summary": {"metric": "val/loss"},
        **changes,
    }


def write(
    folder: Path, name: str, content: dict[str, Any] | str, module: str = "train_lib"
) -> Path:
    """An experiment file `name` (its suffix picks YAML or JSON) beside the train module."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(TRAIN_LIB, encoding="utf-8")
    if not isinstance(content, str):
        dump = json.dumps if name.endswith(".json") else yaml.safe_dump
        content = dump(content)  # type: ignore[operator]
    path = folder / name
    path.write_text(content, encoding="utf-8")
    return path


def lab_run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`lab run ...` as a user types it, from `cwd` (not the file's folder)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LAB_STORE_URL", "PYTHONPATH")}
    env["PYTHONPATH"] = str(DOCS.parent.parent)  # the lab under test, not an installed one
    return warm.run(
        [str(LAB), "run", *map(str, args)],
        capture_output=True, text=True, timeout=300, cwd=cwd, env=env,
    )  # fmt: skip


def rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    con = sqlite3.connect(db)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


RUNS_BY_ARM = """
    select a.name, r.run_key, r.status from runs r join arms a on a.arm_id = r.arm_id
    order by r.run_key
"""


@pytest.fixture
def restore_imports(tmp_path: Path) -> Iterator[None]:
    """Loading a file in this process imports its module and puts its folder on sys.path:
    undo both, so the next test's module of the same name is its own. (Only the test's own
    modules go: torch's, imported lazily meanwhile, must stay.)"""
    path = list(sys.path)
    yield
    sys.path[:] = path
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and Path(file).is_relative_to(tmp_path):
            del sys.modules[name]


# -------------------------------------------------------------------------------------------
# lab run


@pytest.mark.parametrize("name", ["lr-sweep.yaml", "lr-sweep.json"])
def test_a_file_runs_2_arms_x_2_repeats_with_its_callbacks(tmp_path: Path, name: str) -> None:
    path = write(tmp_path / "exp", name, spec())
    db = tmp_path / "store" / "lab.db"
    out = lab_run(path, "--store", f"sqlite:///{db}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert "lr-sweep: 4 runs (4 completed)" in out.stdout
    assert re.search(r"^best arm by val/loss \(min\): (small|large) ", out.stdout, re.M)
    # once, ranked by the file's metric, though the file attaches a console logger too
    assert out.stdout.count("lr-sweep: 4 runs (4 completed)") == 1
    assert out.stdout.count("best arm") == 1
    assert "lr-sweep: completed in " in out.stdout  # the console logger's last line

    assert rows(db, "select name, status from experiments") == [("lr-sweep", "completed")]
    assert rows(db, RUNS_BY_ARM) == [
        ("large", "large-r0", "completed"), ("large", "large-r1", "completed"),
        ("small", "small-r0", "completed"), ("small", "small-r1", "completed"),
    ]  # fmt: skip
    assert rows(db, "select a.name, a.overrides from arms a order by name") == [
        ("large", '{"lr": 0.1}'), ("small", '{"lr": 0.01}'),
    ]  # fmt: skip
    assert rows(db, "select run_key, seed from runs order by run_key") == [
        ("large-r0", 0), ("large-r1", 1), ("small-r0", 0), ("small-r1", 1),
    ]  # fmt: skip
    assert rows(db, "select count(*) from metrics") == [(4 * POINTS_PER_RUN,)]
    # output_dir "runs" is relative to the working directory, not to the file
    experiment_dir = tmp_path / "runs" / "lr-sweep"
    assert sorted(p.name for p in experiment_dir.iterdir()) == sorted([*KEYS, "hooks.jsonl"])
    for key in KEYS:
        run_dir = experiment_dir / key
        assert sorted(p.name for p in run_dir.iterdir()) == ["hooks.jsonl", "metrics.json"]
        saved = json.loads((run_dir / "metrics.json").read_text())
        assert (saved["run_key"], saved["step"], saved["final"], saved["status"]) == (
            key, 4, True, "completed",
        )  # fmt: skip
        hooks = [json.loads(line)["hook"] for line in (run_dir / "hooks.jsonl").open()]
        assert hooks[0] == "on_run_start" and hooks[-1] == "on_run_end"
        assert hooks.count("on_step_end") == 4
    # the console logger's plain lines, one per 2 steps
    assert out.stdout.count("small-r0  step ") == 2
    assert not (tmp_path / "exp" / "runs").exists()


def test_executor_processes_imports_train_from_the_files_folder_in_workers(
    tmp_path: Path,
) -> None:
    path = write(tmp_path / "exp", "procs.yaml", spec(executor="processes", workers=2))
    db = tmp_path / "lab.db"
    out = lab_run(path, "--store", f"sqlite:///{db}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "lr-sweep: 4 runs (4 completed)" in out.stdout
    runs = rows(db, "select run_key, status, pid from runs order by run_key")
    assert [(key, status) for key, status, _ in runs] == [
        ("large-r0", "completed"), ("large-r1", "completed"),
        ("small-r0", "completed"), ("small-r1", "completed"),
    ]  # fmt: skip
    pids = {pid for _, _, pid in runs}
    assert len(pids) == 4  # each run in a fresh worker process, none in `lab` itself
    assert rows(db, "select count(*) from metrics") == [(4 * POINTS_PER_RUN,)]
    for key in KEYS:
        saved = json.loads((tmp_path / "runs" / "lr-sweep" / key / "metrics.json").read_text())
        assert (saved["final"], saved["status"]) == (True, "completed")


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path: Path) -> None:
    path = write(
        tmp_path / "exp", "lr-sweep.yaml", spec(benchmarks={"holdout": "train_lib:holdout"})
    )
    db = tmp_path / "lab.db"
    out = lab_run(path, "--dry-run", "--store", f"sqlite:///{db}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert out.stdout.splitlines() == [
        "lr-sweep: 2 arms x 2 repeats = 4 runs (serial)",
        "train: train_lib:train",
        'config: Config {"lr": 0.05, "steps": 4, "fail": false}',
        f"store: sqlite:///{db}",
        "run folders: runs/lr-sweep/<run>",
        "callbacks: ConsoleLogger, JsonlLogger, MetricSaver, SqlLogger",
        "metrics looked for at each run's first step or eval: val/loss",
        "benchmarks: holdout",
        "",
        "arm    overrides     runs",
        'small  {"lr": 0.01}  small-r0, small-r1',
        'large  {"lr": 0.1}   large-r0, large-r1',
        "",
        f"dry run: nothing ran; to run it: lab run {path} --store sqlite:///{db}",
    ]
    assert not db.exists()  # the store was not even opened
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # no run folders
    assert {p.name for p in (tmp_path / "exp").iterdir()} - {"__pycache__"} == {
        "lr-sweep.yaml", "train_lib.py",
    }  # fmt: skip


def test_failed_runs_print_the_summary_then_one_line_and_exit_1(tmp_path: Path) -> None:
    arms = [{"name": "good", "lr": 0.01}, {"name": "bad", "fail": True}]
    path = write(tmp_path / "exp", "fails.yaml", spec(name="fails", arms=arms, callbacks=[]))
    db = tmp_path / "lab.db"
    out = lab_run(path, "--store", f"sqlite:///{db}", cwd=tmp_path)
    assert out.returncode == 1
    assert "fails: 4 runs (2 completed, 2 failed)" in out.stdout
    assert "best arm by val/loss (min): good" in out.stdout
    assert out.stderr.splitlines()[-1] == (
        "error: 2 of 4 runs failed (bad-r0: RuntimeError: boom); "
        f"details: lab show fails --store sqlite:///{db}"
    )
    assert rows(db, "select run_key, status, error from runs order by run_key") == [
        ("bad-r0", "failed", "RuntimeError: boom"), ("bad-r1", "failed", "RuntimeError: boom"),
        ("good-r0", "completed", None), ("good-r1", "completed", None),
    ]  # fmt: skip
    assert rows(db, "select status from experiments") == [("failed",)]


def test_every_run_failing_still_prints_a_summary(tmp_path: Path) -> None:
    arms = [{"name": "bad", "fail": True}]
    path = write(tmp_path / "exp", "all.yaml", spec(name="all", arms=arms, callbacks=[], repeats=1))
    out = lab_run(path, "--store", f"sqlite:///{tmp_path / 'lab.db'}", cwd=tmp_path)
    assert out.returncode == 1
    assert out.stdout.splitlines()[0] == "all: 1 run (1 failed)"
    assert out.stderr.splitlines()[-1].startswith("error: 1 of 1 run failed (bad-r0: ")


def _known_kinds() -> str:
    return ", ".join(kinds())


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        pytest.param(
            spec(reapeats=3),
            "{file}: unknown field 'reapeats'; valid: name, train, config, base_config, arms, "
            "repeats, seed, store, output_dir, executor, workers, resources, ray_address, "
            "max_retries, strict, callbacks, benchmarks, summary, tags, notes, sweep, race, prune",
            id="unknown-field",
        ),
        pytest.param(
            spec(callbacks=[{"kind": "jsonl_loger"}]),
            "{file}: callbacks: unknown callback kind 'jsonl_loger'; known: {kinds}",
            id="unknown-callback-kind",
        ),
        pytest.param(
            spec(callbacks=[{"kind": "console_logger", "params": {"evry": 5}}]),
            "{file}: callbacks: console_logger: unknown params ['evry']; valid: {console}",
            id="unknown-callback-param",
        ),
        pytest.param(
            spec(train="train_lbi:train"),
            "{file}: train: no module named 'train_lbi' in {folder} (the file's folder) or on "
            "sys.path; put train_lbi.py next to the file, or install it",
            id="module-not-found",
        ),
        pytest.param(
            spec(train="train_lib:trian"),
            "{file}: train: module 'train_lib' ({folder}/train_lib.py) has no 'trian'; "
            "its functions: mse, train, holdout",
            id="no-such-function",
        ),
        pytest.param(
            "name: x\ntrain: train_lib:train\narms:\n  - {name: small, lr: 0.1\n",
            "{file}:5:1: not valid YAML: expected ',' or '}}', but got '<stream end>'; fix the "
            "file there",
            id="bad-yaml",
        ),
    ],
)
def test_a_mistake_in_the_file_is_one_line_and_runs_nothing(
    tmp_path: Path, content: dict[str, Any] | str, expected: str
) -> None:
    path = write(tmp_path / "exp", "lr-sweep.yaml", content)
    out = lab_run(path, "--store", f"sqlite:///{tmp_path / 'lab.db'}", cwd=tmp_path)
    assert out.returncode == 1
    assert out.stdout == ""
    message = expected.format(
        file=path, folder=path.parent, kinds=_known_kinds(),
        console=", ".join(sorted(ConsoleLogger.Config.model_fields)),
    )  # fmt: skip
    assert out.stderr == f"error: {message}\n"
    assert not (tmp_path / "lab.db").exists() and not (tmp_path / "runs").exists()


# -------------------------------------------------------------------------------------------
# the docs page's example


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOCS.read_text(encoding="utf-8"), re.S)


@pytest.mark.slow
@pytest.mark.usefixtures("restore_imports")
def test_the_docs_example_runs_as_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train_lib, python = _blocks("python")
    example, *_ = _blocks("yaml")
    (tmp_path / "train_lib.py").write_text(train_lib, encoding="utf-8")
    (tmp_path / "lr-sweep.yaml").write_text(example, encoding="utf-8")
    (tmp_path / "lr-sweep.json").write_text(_blocks("json")[0], encoding="utf-8")

    out = lab_run("lr-sweep.yaml", "--dry-run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    shown = _blocks("text")[0]  # the page shows --dry-run's exact output
    assert out.stdout == shown

    out = lab_run("lr-sweep.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "best arm by val/loss (min): large" in out.stdout
    out = lab_run("lr-sweep.json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "lr-sweep-json: 4 runs (4 completed)" in out.stdout
    assert rows(tmp_path / "lab.db", "select name, status from experiments order by name") == [
        ("lr-sweep", "completed"), ("lr-sweep-json", "completed"),
    ]  # fmt: skip

    # the page's first error line is what lab says
    typo = example.replace("repeats: 2 ", "reapeats: 2 ")
    (tmp_path / "lr-sweep.yaml").write_text(typo, encoding="utf-8")
    out = lab_run("lr-sweep.yaml", cwd=tmp_path)
    assert out.stderr == _blocks("text")[1].splitlines()[0] + "\n"
    (tmp_path / "lr-sweep.yaml").write_text(example, encoding="utf-8")

    # From Python: running it again continues it (every run completed: nothing runs)
    exec(compile(python, str(DOCS), "exec"), {"__name__": "docs"})
    printed = capsys.readouterr().out
    assert printed.startswith("lr-sweep: 2 arms x 2 repeats = 4 runs (serial)\n")
    assert "lr-sweep: 4 runs (4 completed)" in printed


# -------------------------------------------------------------------------------------------
# from Python


@pytest.mark.usefixtures("restore_imports")
def test_load_experiment_builds_the_experiment_and_runs_it(tmp_path: Path) -> None:
    path = write(tmp_path / "exp", "lr-sweep.yaml", spec(
        seed=10, output_dir=str(tmp_path / "out"), benchmarks={"holdout": "train_lib:holdout"},
    ))  # fmt: skip
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    exp = load_experiment(path, store=url)
    assert (exp.name, exp.repeats, exp.seed, exp.store) == ("lr-sweep", 2, 10, url)
    assert [(a.name, a.overrides) for a in exp.arms] == [("small", {"lr": 0.01}),
                                                          ("large", {"lr": 0.1})]  # fmt: skip
    assert exp.configs["large"].model_dump() == {"lr": 0.1, "steps": 4, "fail": False}
    assert [type(cb) for cb in exp.callbacks] == [ConsoleLogger, JsonlLogger, MetricSaver,
                                                  SummaryMetric]  # fmt: skip
    assert exp.callbacks[0].every == 2 and exp.callbacks[2].every == 2
    assert exp.train.__module__ == "train_lib" and exp.train.__name__ == "train"
    assert [b.name for b in exp.benchmarks] == ["holdout"]

    result = exp.run()
    assert result.status == "completed"
    assert [(r.run_key, r.seed, r.metrics["holdout/acc"]) for r in result.runs] == [
        ("small-r0", 10, 1.0), ("small-r1", 11, 1.0), ("large-r0", 10, 1.0),
        ("large-r1", 11, 1.0),
    ]  # fmt: skip
    assert (tmp_path / "out" / "lr-sweep" / "small-r0" / "metrics.json").exists()
    summary = read_experiment_file(path).summarize(result)
    assert summary.metric == "val/loss" and summary.runs == 4


@pytest.mark.usefixtures("restore_imports")
def test_the_store_comes_from_the_option_then_the_file_then_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAB_STORE_URL", "sqlite:///from-env.db")
    with_store = write(tmp_path, "a.yaml", spec(store="sqlite:///from-file.db"))
    without = write(tmp_path, "b.yaml", spec())
    no_store = write(tmp_path, "c.yaml", spec(store=False))
    assert load_experiment(with_store, store="sqlite:///opt.db").store == "sqlite:///opt.db"
    assert load_experiment(with_store).store == "sqlite:///from-file.db"
    assert load_experiment(without).store == "sqlite:///from-env.db"
    assert load_experiment(no_store).store is False
    assert "store: none (store: false)" in plan(load_experiment(no_store))
    assert "SqlLogger" not in plan(load_experiment(no_store))


@pytest.mark.usefixtures("restore_imports")
def test_arms_with_stages_and_processes_show_in_the_plan(tmp_path: Path) -> None:
    arms = [{"name": "cl", "carry": "full", "stages": [{"lr": 0.1}, {"lr": 0.01}]}]
    path = write(tmp_path, "cl.yaml", spec(arms=arms, executor="processes", workers=3))
    exp = load_experiment(path, store="sqlite:///x.db")
    assert exp.arms[0].stages == [{"lr": 0.1}, {"lr": 0.01}] and exp.arms[0].carry == "full"
    assert [c.lr for c in exp.stage_configs["cl"]] == [0.1, 0.01]
    lines = plan(exp).splitlines()
    assert lines[0] == "lr-sweep: 1 arm x 2 repeats = 4 runs (processes, 3 at a time)"
    assert lines[-1] == (
        'cl   {}, stages [{"lr": 0.1}, {"lr": 0.01}] (carry full)  '
        "cl-r0-s0, cl-r0-s1, cl-r1-s0, cl-r1-s1"
    )


@pytest.mark.usefixtures("restore_imports")
def test_a_file_runs_on_ray_with_resources_per_experiment_and_arm(tmp_path: Path) -> None:
    arms = [{"name": "small", "lr": 0.1}, {"name": "big", "lr": 0.01, "resources": {"num_gpus": 1}}]
    content = spec(arms=arms, executor="ray", resources={"num_cpus": 2}, max_retries=1,
                   ray_address="ray://head:10001")  # fmt: skip
    exp = load_experiment(write(tmp_path, "ray.yaml", content), store="sqlite:///x.db")
    assert (exp.executor, exp.resources, exp.max_retries) == ("ray", {"num_cpus": 2.0}, 1)
    assert exp.ray_address == "ray://head:10001"
    assert [(a.name, a.resources, a.overrides) for a in exp.arms] == [
        ("small", {}, {"lr": 0.1}),
        ("big", {"num_gpus": 1.0}, {"lr": 0.01}),
    ]
    assert plan(exp).splitlines()[0] == "lr-sweep: 2 arms x 2 repeats = 4 runs (ray)"


@pytest.mark.usefixtures("restore_imports")
@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("x.yaml", spec(config="train_lib:mse"),
         "{file}: config: train_lib:mse is a function, not a pydantic model class; name a class "
         "derived from pydantic.BaseModel (its pydantic models: Config)"),
        ("x.yaml", spec(config="train_lib:torch"),
         "{file}: config: train_lib:torch is a module, not a pydantic model class; name a class "
         "derived from pydantic.BaseModel (its pydantic models: Config)"),
        ("x.yaml", spec(train="train_lib:Config"),
         "{file}: train: train_lib:Config is a class, not a function; its functions: mse, "
         "train, holdout"),
        ("x.yaml", spec(train="train_lib.train"),
         "{file}: train: 'train_lib.train' is not module:name; write e.g. train_lib:train"),
        ("x.yaml", spec(base_config={"stpes": 3}),
         "{file}: base_config: unknown field 'stpes'; valid: lr, steps, fail"),
        ("x.yaml", spec(base_config={"steps": "ten"}),
         "{file}: base_config.steps: Input should be a valid integer, unable to parse string as "
         "an integer, got 'ten'"),
        ("x.yaml", spec(arms=[{"name": "small", "rl": 0.1}]),
         "{file}: arm 'small': 'rl' is not a field of Config; valid fields: lr, steps, fail"),
        ("x.yaml", spec(arms=[{"name": "a"}, {"name": "a"}]),
         "{file}: duplicate arm names ['a']; give every arm its own name"),
        ("x.yaml", spec(config=None, base_config=None),
         "{file}: arm 'small' overrides ['lr'] but the file names no config; add config: "
         "module:Class (the pydantic model of the base config)"),
        ("x.yaml", spec(callbacks=[{"kind": "metric_saver", "parms": {}}]),
         "{file}: callbacks: callback spec #0 has unknown fields ['parms']; use kind, params, "
         "critical"),
        ("x.yaml", spec(repeats=0),
         "{file}: repeats: Input should be greater than or equal to 1, got 0"),
        ("x.yaml", spec(executor="threads"),
         "{file}: executor: Input should be 'serial', 'processes' or 'ray', got 'threads'"),
        ("x.yaml", spec(store=5),
         "{file}: store: 5 is not a store; write a URL such as sqlite:///lab.db, or false to "
         "record nothing"),
        ("x.yaml", spec(summary={"metric": "loss", "order": "min"}),
         "{file}: summary: unknown field 'order'; valid: metric, mode, keys, bounds"),
        ("x.yaml", "name: x\ntrain: train_lib:train\nname: y\n",
         "{file}:3:1: key 'name' appears twice (also on line 1); keep one"),
        ("x.yaml", "- name: x\n",
         "{file}: the file holds a list, not fields; write name:, train:, ... at the top level"),
        ("x.yaml", "", "{file}: the file is empty; write at least name: and train:"),
        ("x.json", '{"name": "x",\n "train": }',
         "{file}:2:11: not valid JSON: Expecting value; fix the file there"),
        ("x.toml", "name = 'x'", "{file}: an experiment file ends in .yaml, .yml or .json"),
    ],
)  # fmt: skip
def test_each_mistake_names_its_fix(tmp_path: Path, name: str, content: Any, expected: str) -> None:
    path = write(tmp_path, name, content)
    with pytest.raises(ConfigError) as info:
        load_experiment(path, store="sqlite:///x.db")
    assert str(info.value) == expected.format(file=path)


@pytest.mark.usefixtures("restore_imports")
def test_a_module_of_the_same_name_imported_from_elsewhere_is_refused(tmp_path: Path) -> None:
    first = write(tmp_path / "one", "a.yaml", spec(), module="twin_lib")
    second = write(tmp_path / "two", "b.yaml", spec(), module="twin_lib")
    for path in (first, second):
        path.write_text(path.read_text().replace("train_lib:", "twin_lib:"))
    assert load_experiment(first, store=False).train.__module__ == "twin_lib"
    with pytest.raises(ConfigError) as info:
        load_experiment(second, store=False)
    assert str(info.value) == (
        f"{second}: train: module 'twin_lib' is {tmp_path / 'one' / 'twin_lib.py'}, not the one "
        f"in {tmp_path / 'two'}; a process holds one module per name, so rename 'twin_lib' "
        "beside the file"
    )


# -------------------------------------------------------------------------------------------
# overrides and grids


def _section(title: str) -> str:
    text = DOCS.read_text(encoding="utf-8")
    start = text.index(f"## {title}")
    return text[start : text.index("\n## ", start + 1)]


def test_overrides_and_a_grid_run_as_the_docs_show(tmp_path: Path) -> None:
    """The docs' grid file and command, through the real `lab` script: the printed plan and
    each error line are the page's."""
    section = _section("Overrides and grids")
    grid_file = re.findall(r"```yaml\n(.*?)```", section, re.S)[0]
    command = re.findall(r"```bash\n(.*?)```", section, re.S)[0]
    plan_text, errors = re.findall(r"```text\n(.*?)```", section, re.S)
    (tmp_path / "train_lib.py").write_text(_blocks("python")[0], encoding="utf-8")
    (tmp_path / "grid-sweep.yaml").write_text(grid_file, encoding="utf-8")
    args = command.split()[2:]  # after "lab run"
    out = lab_run(*args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == plan_text
    for line, override in zip(
        errors.splitlines(),
        ["reapeats=2", "repeats=many", "arms.nope.lr=1", "arms.1.grid.lr=0.1"],
        strict=True,
    ):
        out = lab_run("grid-sweep.yaml", override, "--dry-run", cwd=tmp_path)
        assert (out.returncode, out.stdout, out.stderr) == (1, "", line + "\n")
    # nothing but the files (and Python's bytecode cache of the module, where it writes one)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__")
    assert left == ["grid-sweep.yaml", "train_lib.py"]


def test_a_grid_runs_one_arm_per_combination_beside_the_arms_written_out(tmp_path: Path) -> None:
    content = spec(arms=[{"name": "base"}, {"grid": {"lr": [0.01, 0.1], "steps": [2, 4]}}],
                   repeats=1, callbacks=[], summary={"metric": "loss"})  # fmt: skip
    path = write(tmp_path / "exp", "grid.yaml", content)
    out = lab_run(path, "--store", f"sqlite:///{tmp_path / 'lab.db'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert rows(tmp_path / "lab.db", "select name, overrides from arms order by arm_id") == [
        ("base", "{}"),
        ("lr=0.01,steps=2", '{"lr": 0.01, "steps": 2}'),
        ("lr=0.01,steps=4", '{"lr": 0.01, "steps": 4}'),
        ("lr=0.1,steps=2", '{"lr": 0.1, "steps": 2}'),
        ("lr=0.1,steps=4", '{"lr": 0.1, "steps": 4}'),
    ]
    steps = """select count(*) from metrics m join runs r using (run_id) join arms a using (arm_id)
               where m.key = 'loss' group by a.arm_id order by a.arm_id"""
    assert [n for (n,) in rows(tmp_path / "lab.db", steps)] == [4, 2, 4, 2, 4]


@pytest.mark.usefixtures("restore_imports")
def test_overrides_from_python_change_the_values_before_they_are_checked(tmp_path: Path) -> None:
    path = write(tmp_path / "exp", "lr-sweep.yaml", spec())
    exp = load_experiment(path, store=False, overrides=[
        "repeats=3", "base_config.lr=0.2", "arms.small.lr=1e-3", "arms.1.steps=2",
        "name='007'", "callbacks=[]", "summary.mode=max",
    ])  # fmt: skip
    assert (exp.name, exp.repeats, exp.base_config.lr) == ("007", 3, 0.2)
    assert [type(cb).__name__ for cb in exp.callbacks] == ["SummaryMetric"]  # callbacks=[]
    assert [(a.name, a.overrides) for a in exp.arms] == [
        ("small", {"lr": 1e-3}),  # "1e-3" is a string to YAML 1.1; the float field reads it
        ("large", {"lr": 0.1, "steps": 2}),
    ]
    assert read_experiment_file(path, ["summary.mode=max"]).summary.mode == "max"
    assert read_experiment_file(path).repeats == 2  # the file itself is unchanged


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("repeats", "override 'repeats': write dotted.key=value, e.g. repeats=5"),
        ("=5", "override '=5': write dotted.key=value, e.g. repeats=5"),
        ("base_config..lr=1", "override 'base_config..lr=1': write dotted.key=value, e.g. "
                              "repeats=5"),
        ("seeed=1", "override 'seeed=1': unknown field 'seeed'; valid: name, train, config, "
                    "base_config, arms, repeats, seed, store, output_dir, executor, workers, "
                    "resources, ray_address, max_retries, strict, callbacks, benchmarks, "
                    "summary, tags, notes, sweep, race, prune"),
        ("summary.metrc=x", "override 'summary.metrc=x': summary: unknown field 'metrc'; "
                            "valid: metric, mode, keys, bounds"),
        ("arms.5.lr=1", "override 'arms.5.lr=1': arms has no item '5'; give an index 0..1 or "
                        "a name: small, large"),
        ("name.x=1", "override 'name.x=1': name is 'lr-sweep', not a mapping; override name "
                     "itself"),
        ("repeats=[1", "override 'repeats=[1': the value is not YAML (expected ',' or ']', but "
                       "got '<stream end>'); quote it: repeats='...'"),
        ("repeats=0", "repeats: Input should be greater than or equal to 1, got 0 (from the "
                      "override 'repeats=0')"),
        ("summary.mode=avg", "summary.mode: Input should be 'min' or 'max', got 'avg' (from "
                             "the override 'summary.mode=avg')"),
    ],
)  # fmt: skip
def test_a_bad_override_is_one_line_naming_it(tmp_path: Path, override: str, message: str) -> None:
    path = write(tmp_path / "exp", "lr-sweep.yaml", spec())
    with pytest.raises(ConfigError) as info:
        read_experiment_file(path, [override])
    assert str(info.value) == f"{path}: {message}"


@pytest.mark.usefixtures("restore_imports")
def test_a_bad_base_config_override_names_the_override(tmp_path: Path) -> None:
    path = write(tmp_path / "exp", "lr-sweep.yaml", spec())
    with pytest.raises(ConfigError) as info:
        load_experiment(path, overrides=["base_config.lrr=0.1"])
    assert str(info.value) == (
        f"{path}: base_config: unknown field 'lrr'; valid: lr, steps, fail "
        "(overrides: base_config.lrr=0.1)"
    )


@pytest.mark.parametrize(
    ("arms", "message"),
    [
        ({"grid": {"lr": 0.1}}, "arms: grid.lr of entry 0 is 0.1; give a non-empty list of "
                                "values, e.g. lr: [0.1]"),
        ([{"name": "a"}, {"grid": {"lr": []}}], "arms: grid.lr of entry 1 is empty; give at "
                                                "least one value"),
        ([{"grid": [1, 2]}], "arms: grid of entry 0 is [1, 2]; write a mapping of override: "
                             "[values], e.g. grid: {lr: [0.01, 0.1]}"),
        ([{"name": "g", "grid": {"lr": [1]}}], "arms: entry 0 has a grid and a name; a grid "
                                               "names its arms by their values (lr=0.01,wd=0): "
                                               "drop name"),
    ],
)  # fmt: skip
def test_a_bad_grid_is_one_line(tmp_path: Path, arms: Any, message: str) -> None:
    path = write(tmp_path / "exp", "g.yaml", spec(arms=arms))
    with pytest.raises(ConfigError) as info:
        read_experiment_file(path)
    assert str(info.value) == f"{path}: {message}"


def test_grid_arms_are_named_by_their_values_last_key_fastest() -> None:
    from lab._arm_grid import expand_arms

    grid = {"grid": {"opt": ["adam", "sgd"], "wd": [0, 0.1], "nesterov": [True]}, "steps": 9}
    assert expand_arms({"grid": {"lr": [1e-3]}}) == [{"name": "lr=0.001", "lr": 1e-3}]
    assert [a["name"] for a in expand_arms([{"name": "base"}, grid])] == [
        "base",
        "opt=adam,wd=0,nesterov=true",
        "opt=adam,wd=0.1,nesterov=true",
        "opt=sgd,wd=0,nesterov=true",
        "opt=sgd,wd=0.1,nesterov=true",
    ]
    assert expand_arms([grid])[3] == {
        "name": "opt=sgd,wd=0.1,nesterov=true", "steps": 9, "opt": "sgd", "wd": 0.1,
        "nesterov": True,
    }  # fmt: skip


# -------------------------------------------------------------------------------------------
# metric names


def test_a_misspelled_summary_metric_warns_at_the_first_eval_of_each_run(tmp_path: Path) -> None:
    content = spec(summary={"metric": "val/los"}, repeats=1, callbacks=[], store=False)
    path = write(tmp_path / "exp", "typo.yaml", content)
    out = lab_run(path, "--dry-run", cwd=tmp_path)
    assert "metrics looked for at each run's first step or eval: val/los" in out.stdout
    out = lab_run(path, cwd=tmp_path)
    warning = (
        f"{path}: summary.metric 'val/los': eval 'val' at step 2 logged no 'los' (it logged: "
        "loss); did you mean 'val/loss'?"
    )
    assert out.stderr.splitlines() == [
        warning,  # run small-r0, at its first eval; not again at step 4
        warning,  # run large-r0
    ]
    assert "best arm by val/loss (min)" in out.stdout  # lab run falls back to the default


def test_the_dry_run_warns_of_a_name_close_to_a_known_one(tmp_path: Path) -> None:
    content = spec(callbacks=[{"kind": "early_stopping", "params": {"metric": "los"}}])
    out = lab_run(write(tmp_path / "exp", "x.yaml", content), "--dry-run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[5:8] == [
        "callbacks: EarlyStopping, SqlLogger",
        "warning: EarlyStopping('los'): no known source logs 'los'; did you mean 'loss'?",
        "metrics looked for at each run's first step or eval: los, val/loss",
    ]


def test_a_file_whose_store_is_a_lab_serve_url_records_through_it(
    tmp_path: Path, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.served import serve

    server = serve(sqlite_url)
    try:
        path = write(tmp_path / "exp", "lr-sweep.yaml", spec(store=server.url))
        monkeypatch.setenv("LAB_TOKEN", server.write_token)  # the token never goes in a file
        out = lab_run(path, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert "lr-sweep: 4 runs (4 completed)" in out.stdout
        assert server.write_token not in out.stdout + out.stderr
    finally:
        server.stop()
    db = Path(sqlite_url.removeprefix("sqlite:///"))
    assert rows(db, "select name, status from experiments") == [("lr-sweep", "completed")]
    assert rows(db, RUNS_BY_ARM) == [
        ("large", "large-r0", "completed"), ("large", "large-r1", "completed"),
        ("small", "small-r0", "completed"), ("small", "small-r1", "completed"),
    ]  # fmt: skip
    assert rows(db, "select count(*) from metrics") == [(4 * POINTS_PER_RUN,)]
