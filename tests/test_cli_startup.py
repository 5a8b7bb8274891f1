"""What the `lab` commands that only read import: none of SQLAlchemy, Alembic, numpy, torch,
pandas, DuckDB or pyarrow, each of which costs a command more CPU than its whole work
(bench/cli_startup.py times them). Each command runs as a real subprocess on a real store
(SQLite and PostgreSQL, and through a real `lab serve`), and says at exit what it imported.
And what they read without SQLAlchemy (`Reader`) is what a read-only `Store` reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa

from lab.server.auth import create_token
from lab.store import Store
from lab.store.migrations import head_revision
from lab.store.reader import Reader
from tests.served import serve

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("sqlalchemy", "alembic", "numpy", "torch", "pandas", "duckdb", "pyarrow")

# runs the command as the console script does, then names the heavy modules it imported
_COMMAND = """
import json, sys
heavy = json.loads(sys.argv[1])
sys.argv = ["lab", *sys.argv[2:]]
from lab.cli import main
try:
    main()
finally:
    print("imported:", json.dumps(sorted(m for m in heavy if m in sys.modules)), file=sys.stderr)
"""


def _imports(
    *args: str, env: dict[str, str] | None = None, status: int = 0
) -> tuple[str, list[str]]:
    """Run ``lab ARGS``, which exits with `status`; its stdout (its stderr when `status` is
    not 0) and the heavy modules it imported."""
    out = subprocess.run(
        [sys.executable, "-c", _COMMAND, json.dumps(HEAVY), *args],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )  # fmt: skip
    assert out.returncode == status, out.stderr
    *said, last = out.stderr.splitlines()
    assert last.startswith("imported: "), out.stderr
    return out.stdout if status == 0 else "\n".join(said), json.loads(
        last.removeprefix("imported: ")
    )


def _dead_pid() -> int:
    """The pid of a process that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _record(url: str) -> None:
    """One experiment whose driver died: a completed run, a run whose process died while it
    was `running` (so the readers judge owners, as `lab ls` does), a superseded run (left
    out by every reader), and a token."""
    store = Store(url)
    try:
        exp_id = store.begin_experiment("exp", config={}, seed=0, repeats=2)
        group_id = store.add_group(exp_id, "g")
        ids = {}
        for key, repeat in (("old", 0), ("r0", 0), ("r1", 1)):
            ids[key] = store.start_run(
                exp_id, group_id, run_key=key, arm_id=None, repeat=repeat, stage=0,
                seed=repeat, config={}, output_dir=None,
            )  # fmt: skip
            store.log_metrics(ids[key], 1, {"loss": 1.0})
            store.flush()
            if key != "r1":
                store.finish_run(ids[key], status="completed")
        store.supersede_run(ids["old"], "old-superseded", None)
        dead = {"pid": _dead_pid()}
        with store.engine.begin() as conn:  # as a SIGKILL leaves them, by a pid now gone
            for table in ("runs", "experiments"):
                conn.execute(
                    sa.text(f"UPDATE {table} SET pid = :pid, process_start = NULL, "
                            "boot_id = NULL WHERE status = 'running'"), dead,
                )  # fmt: skip
        create_token(store.engine, "ci", "read")
    finally:
        store.close()


def test_commands_that_only_read_import_no_heavy_library(store_url: str) -> None:
    _record(store_url)
    env = {"LAB_STORE_URL": store_url}
    expected = {
        ("--help",): "Run torch experiments as arms x repeats",
        ("show", "--help"): "Show an experiment's arms",
        ("db", "--help"): "Inspect and migrate the store's schema.",
        ("ls",): "1 completed, 1 crashed",
        ("show", "exp"): "exp: crashed, 2 runs, seed 0",
        ("show", "exp", "--run", "r1"): "exp / r1: crashed",
        ("db", "current"): f"{head_revision()} (head)",
        ("token", "list"): "ci    read",
    }
    for args, line in expected.items():
        stdout, imported = _imports(*args, env=env)
        assert line in stdout, (args, stdout)
        assert imported == [], args


def test_a_reader_reads_what_a_read_only_store_reads(store_url: str) -> None:
    """The same statements through the driver alone and through SQLAlchemy: the same dicts,
    crashed runs and experiments judged alike, superseded runs left out alike."""
    _record(store_url)
    store = Store(store_url, readonly=True)
    reader = Reader(store_url)
    try:
        listed = reader.list_experiments()
        assert listed == store.list_experiments()
        assert [(e["name"], e["status"], e["runs_by_status"], e["superseded"]) for e in listed] == [
            ("exp", "crashed", {"completed": 1, "crashed": 1}, 1)
        ]
        shown = reader.get_experiment("exp")
        assert shown == store.get_experiment("exp")
        assert [(r["run_key"], r["status"], r["step"]) for r in shown["runs"]] == [
            ("r0", "completed", 1), ("r1", "crashed", 1)
        ]  # fmt: skip
        assert shown["superseded"] == 1
        assert reader.revision == store.revision == head_revision()
    finally:
        reader.close()
        store.close()


def test_reading_through_lab_serve_imports_no_heavy_library(sqlite_url: str) -> None:
    _record(sqlite_url)
    served = serve(sqlite_url)
    try:
        env = {"LAB_TOKEN": served.read_token}
        for args, line in {
            ("ls",): "1 completed, 1 crashed",
            ("show", "exp"): "exp: crashed, 2 runs, seed 0",
        }.items():
            stdout, imported = _imports(*args, "--store", served.url, env=env)
            assert line in stdout, (args, stdout)
            assert imported == [], args
    finally:
        served.stop()


_TRAIN_LIB = """\
import pydantic


class Config(pydantic.BaseModel):
    lr: float = 0.05
    steps: int = 30


def train(run):
    import torch  # where it trains: checking the file needs none

    return {"loss": float(torch.tensor(run.config.lr))}
"""
_SWEEP = """\
name: sweep
train: train_lib:train
config: train_lib:Config
arms: [{name: small, lr: 0.01}, {name: large, lr: 0.1}]
repeats: 2
callbacks:
  - {kind: console_logger, params: {every: 10}}
  - {kind: jsonl_logger}
  - {kind: metric_saver, params: {every: 10}}
summary: {metric: loss, mode: min}
"""


def test_checking_an_experiment_file_imports_what_its_module_imports(tmp_path: Path) -> None:
    """``lab run FILE --dry-run`` imports the file's module, builds its callbacks and its
    Experiment: lab itself adds no torch to what the module imports (nor SQLAlchemy for
    the SqlLogger it would record with)."""
    (tmp_path / "train_lib.py").write_text(_TRAIN_LIB)
    (tmp_path / "sweep.yaml").write_text(_SWEEP)
    stdout, imported = _imports("run", str(tmp_path / "sweep.yaml"), "--dry-run")
    assert stdout.startswith("sweep: 2 arms x 2 repeats = 4 runs (serial)\n"), stdout
    assert "callbacks: ConsoleLogger, JsonlLogger, MetricSaver, SqlLogger\n" in stdout
    assert imported == []
    assert not (tmp_path / "lab.db").exists()


def test_a_bad_store_is_refused_before_torch_is_imported(tmp_path: Path) -> None:
    """`lab run` and `lab quickstart` meet the store before anything imports torch, so a
    bad one is refused at once, as the commands that only read refuse it."""
    (tmp_path / "train_lib.py").write_text("def train(run):\n    raise AssertionError\n")
    (tmp_path / "never.yaml").write_text("name: never\ntrain: train_lib:train\narms: [{name: a}]\n")
    bad = tmp_path / "notes.db"
    bad.write_text("name,loss\nr0,0.5\n")
    store = ["--store", f"sqlite:///{bad}"]
    for args in (["run", str(tmp_path / "never.yaml"), *store], ["quickstart", *store]):
        said, imported = _imports(*args, status=1)
        assert said == (
            f"error: {bad} is not a SQLite database (its first bytes are not the SQLite "
            "header); point --store / LAB_STORE_URL at a lab store"
        ), args
        assert "torch" not in imported, args
