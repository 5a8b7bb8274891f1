"""Provenance: git commit, dirty flag and diff, packages, versions, command line and host,
read once per experiment and recorded with every run; credentials never recorded.

Real git repositories in the test's folder, real experiments on both backends, the real
`lab show` as a subprocess.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from test_store import WAIT_S

import lab.inspect
import lab.loggers.sql
import lab.provenance
from lab import Experiment, RunSpec
from lab.provenance import DIFF_FILE, collect, mask_argv
from lab.store import Store
from tests import warm


def _git(repo: Path, *args: str) -> str:
    out = warm.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git repository with one commit, as the working directory."""
    folder = tmp_path / "repo"
    folder.mkdir()
    _git(folder, "init", "-q", "-b", "main")
    (folder / "train.py").write_text("lr = 0.1\n")
    _git(folder, "add", "train.py")
    _git(folder, "commit", "-q", "-m", "first")
    os.chdir(folder)
    return folder


def test_a_clean_checkout(repo: Path) -> None:
    prov = collect()
    assert prov.record["git"] == {
        "commit": _git(repo, "rev-parse", "HEAD"),
        "branch": "main",
        "dirty": False,
        "remote": None,
        "untracked": 0,
        "diff_file": None,
        "diff_bytes": 0,
        "diff_truncated": False,
        "root": str(repo.resolve()),
        "note": None,
    }
    assert prov.diff == ""


def test_a_dirty_checkout_records_its_diff(repo: Path) -> None:
    (repo / "train.py").write_text("lr = 0.5\n")
    (repo / "scratch.py").write_text("x = 1\n")  # untracked: counted, not dirty, not diffed
    prov = collect()
    git = prov.record["git"]
    assert (git["dirty"], git["untracked"], git["diff_file"]) == (True, 1, DIFF_FILE)
    assert "-lr = 0.1\n+lr = 0.5\n" in prov.diff
    assert git["diff_bytes"] == len(prov.diff.encode()) and not git["diff_truncated"]


def test_a_large_diff_is_cut_with_a_marker(repo: Path) -> None:
    (repo / "train.py").write_text("".join(f"line {i}\n" for i in range(5000)))
    full = warm.run(["git", "diff", "HEAD"], capture_output=True, cwd=repo).stdout
    prov = collect(diff_limit=1000)
    assert prov.record["git"]["diff_truncated"] is True
    assert prov.record["git"]["diff_bytes"] == len(full)
    body, marker = prov.diff.rsplit("# lab:", 1)
    assert marker == f" diff truncated at 1000 of {len(full)} bytes\n"
    assert len(body.encode()) <= 1001 and full.decode().startswith(body.rstrip("\n"))


def test_outside_a_repository_the_commit_is_none_and_the_record_says_why(tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    git = collect(folder).record["git"]
    assert git["commit"] is None and git["dirty"] is None
    assert git["note"] == f"{folder} is not in a git repository"


def test_a_repository_without_a_commit_and_a_machine_without_git(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "new"
    folder.mkdir()
    _git(folder, "init", "-q")
    (folder / "a.py").write_text("x = 1\n")
    _git(folder, "add", "a.py")
    prov = collect(folder)
    git = prov.record["git"]
    assert (git["commit"], git["dirty"], git["note"]) == (
        None, True, "the repository has no commit yet"
    )  # fmt: skip
    assert "+x = 1" in prov.diff

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no git on the PATH
    git = collect(folder).record["git"]
    assert (git["commit"], git["note"]) == (None, "git is not installed")


def test_versions_packages_devices_command_and_host() -> None:
    record = collect().record
    assert record["python"] == ".".join(map(str, sys.version_info[:3]))
    assert record["torch"] == torch.__version__
    assert record["packages"]["torch"] == importlib.metadata.version("torch")
    assert record["packages"]["SQLAlchemy"] == importlib.metadata.version("sqlalchemy")
    assert record["devices"] == (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else []
    )
    assert record["host"] == socket.gethostname()
    assert record["command"] == mask_argv(sys.argv)
    json.dumps(record)  # it goes into a JSON column as it is


def test_the_package_list_reads_headers_and_follows_installs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The list is kept for the process, and read again once a folder on sys.path changes:
    an install in a notebook shows in its next experiment."""

    def install(version: str) -> None:
        for old in tmp_path.glob("fake_lab_pkg-*.dist-info"):
            (old / "METADATA").unlink()
            old.rmdir()
        info = tmp_path / f"fake_lab_pkg-{version}.dist-info"
        info.mkdir()
        # the body after the blank line is the long description: never read as fields
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: fake-lab-pkg\nVersion: {version}\n\n"
            "Name: not-a-field\nVersion: 0\n"
        )

    first = collect().record["packages"]
    assert "fake-lab-pkg" not in first
    install("1.0")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert collect().record["packages"]["fake-lab-pkg"] == "1.0"
    install("2.0")
    packages = collect().record["packages"]
    assert packages["fake-lab-pkg"] == "2.0"
    assert "not-a-field" not in packages
    assert {k: v for k, v in packages.items() if k != "fake-lab-pkg"} == first


@pytest.mark.parametrize(
    ("argv", "masked"),
    [
        (["t.py", "--store", "postgresql://me:hunter2@db:5432/lab"],
         ["t.py", "--store", "postgresql://me:***@db:5432/lab"]),
        (["t.py", "--token", "abc123", "--lr", "0.1"], ["t.py", "--token", "***", "--lr", "0.1"]),
        (["t.py", "--api-key=abc123", "WANDB_API_KEY=k"], ["t.py", "--api-key=***",
                                                          "WANDB_API_KEY=***"]),
        (["t.py", "--url", "https://x.io/h?token=abc&x=1"], ["t.py", "--url",
                                                            "https://x.io/h?token=***&x=1"]),
        (["t.py", "Authorization: Bearer eyJabc.def"], ["t.py", "Authorization: Bearer ***"]),
        (["t.py", "--hub", "hf_abcdefghijklmnop", "ghp_0123456789abcdef"],
         ["t.py", "--hub", "***", "***"]),
        (["t.py", "--webhook", "https://hooks.slack.com/services/T0/B0/XyZ"],
         ["t.py", "--webhook", "https://hooks.slack.com/services/***"]),
        (["t.py", "--lr", "0.1", "lr=0.5", "--store", "sqlite:///lab.db"],
         ["t.py", "--lr", "0.1", "lr=0.5", "--store", "sqlite:///lab.db"]),
    ],
)  # fmt: skip
def test_credentials_in_the_command_line_are_masked(argv: list[str], masked: list[str]) -> None:
    assert mask_argv(argv) == masked


# -- recorded with every run ---------------------------------------------------------------------
def _train(run: RunSpec) -> dict[str, float]:
    return {"loss": float(run.seed)}


def test_every_run_records_the_experiments_provenance_read_once(
    repo: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (repo / "train.py").write_text("lr = 0.5\n")  # dirty: each run folder gets the diff
    calls: list[Any] = []
    real = lab.loggers.sql.collect
    monkeypatch.setattr(lab.loggers.sql, "collect", lambda: calls.append(1) or real())
    monkeypatch.setattr(sys, "argv", ["train.py", "--store", "postgresql://u:s3cret@h/db"])
    result = Experiment("prov", _train, repeats=3, store=store_url).run()
    assert [r.status for r in result.runs] == ["completed"] * 3
    assert len(calls) == 1  # once per experiment, not per run

    con = lab.inspect.connect(store_url)
    rows = lab.inspect.provenance(con, "prov").fetchall()
    names = [d[0] for d in lab.inspect.provenance(con, "prov").description]
    got = [dict(zip(names, row, strict=True)) for row in rows]
    commit = _git(repo, "rev-parse", "HEAD")
    assert [(g["run_key"], g["commit"], g["dirty"], g["host"], g["torch"]) for g in got] == [
        (f"base-r{i}", commit, True, socket.gethostname(), torch.__version__) for i in range(3)
    ]
    assert got[0]["command"] == ["train.py", "--store", "postgresql://u:***@h/db"]
    assert json.loads(got[0]["packages"])["torch"] == importlib.metadata.version("torch")
    for i in range(3):  # the diff, in each run's folder
        diff = (repo / "runs" / "prov" / f"base-r{i}" / DIFF_FILE).read_text()
        assert "+lr = 0.5" in diff
    assert "s3cret" not in json.dumps(con.sql("select provenance from runs").fetchall())


def _slow_collect(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the provenance reading wait for the event returned (set it once the run is
    under way): a run's start that waited for git would then never start."""
    release = threading.Event()
    real = lab.loggers.sql.collect

    def slow() -> Any:
        assert release.wait(WAIT_S), "the run never started"
        return real()

    monkeypatch.setattr(lab.loggers.sql, "collect", slow)
    return release


def test_a_run_starts_before_git_is_read_and_records_its_provenance_once_it_is(
    repo: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first run's row is written while the experiment's provenance is still being read
    (its provenance NULL then); the reading thread fills it in, with the diff file, and
    every finished run has it."""
    (repo / "train.py").write_text("lr = 0.5\n")
    release = _slow_collect(monkeypatch)
    at_start: list[Any] = []

    def train(run: RunSpec) -> dict[str, float]:
        if not release.is_set():
            store = Store(store_url, readonly=True)
            try:
                (row,) = store.get_experiment("late")["runs"]
                at_start.append((row["status"], row["provenance"]))
            finally:
                store.close()
            release.set()
        return {"loss": float(run.seed)}

    result = Experiment("late", train, repeats=2, store=store_url).run()
    assert [r.status for r in result.runs] == ["completed"] * 2
    assert at_start == [("running", None)]
    store = Store(store_url, readonly=True)
    try:
        runs = store.get_experiment("late")["runs"]
    finally:
        store.close()
    commit = _git(repo, "rev-parse", "HEAD")
    assert [(r["run_key"], r["provenance"]["git"]["commit"]) for r in runs] == [
        ("base-r0", commit), ("base-r1", commit)
    ]  # fmt: skip
    assert {r["provenance"]["git"]["diff_file"] for r in runs} == {DIFF_FILE}
    for i in range(2):
        assert "+lr = 0.5" in (repo / "runs" / "late" / f"base-r{i}" / DIFF_FILE).read_text()


def test_a_script_run_that_fails_at_its_first_step_still_records_its_provenance(
    repo: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """git is read beside the run's start, not before it: a run that fails at once (before
    the reading thread is done) still ends with its provenance recorded."""
    release = _slow_collect(monkeypatch)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.raises(RuntimeError, match="diverged"),
        lab.start_run("fails", store=store_url, quiet=True, output_dir=repo / "runs") as run,
        lab.RunHandle(run, model, opt, num_steps=3) as loop,
    ):
        for _step in loop.steps():
            release.set()  # the first step runs while git is still being read
            raise RuntimeError("diverged")
    store = Store(store_url, readonly=True)
    try:
        (row,) = store.get_experiment("fails")["runs"]
    finally:
        store.close()
    assert row["status"] == "failed"
    assert row["provenance"]["git"]["commit"] == _git(repo, "rev-parse", "HEAD")


def test_a_clean_checkout_writes_no_diff_file(repo: Path, sqlite_url: str) -> None:
    Experiment("clean", _train, store=sqlite_url).run()
    assert not (repo / "runs" / "clean" / "base-r0" / DIFF_FILE).exists()
    store = Store(sqlite_url)
    try:
        (run,) = store.get_experiment("clean")["runs"]
    finally:
        store.close()
    assert run["provenance"]["git"]["diff_file"] is None
    assert run["provenance"]["git"]["dirty"] is False


def test_lab_show_prints_a_compact_provenance_section(repo: Path, sqlite_url: str) -> None:
    monkey_argv = ["train.py", "--lr", "0.1"]
    old, sys.argv = sys.argv, monkey_argv
    try:
        Experiment("shown", _train, repeats=2, store=sqlite_url).run()
    finally:
        sys.argv = old
    out = warm.run(
        [sys.executable, "-m", "lab.cli", "show", "shown", "--store", sqlite_url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    at = lines.index(
        "provenance (full record: lab.inspect.provenance; diff: <run folder>/git.diff)"
    )
    header, row = lines[at + 1].split(), lines[at + 2].split()
    assert header == ["commit", "dirty", "python", "torch", "host", "command", "runs"]
    commit = _git(repo, "rev-parse", "HEAD")[:12]
    python = ".".join(map(str, sys.version_info[:3]))
    assert row == [commit, "no", python, torch.__version__, socket.gethostname(), "train.py",
                   "--lr", "0.1", "all", "2"]  # fmt: skip


def test_runs_in_worker_processes_record_it_too(repo: Path, sqlite_url: str) -> None:
    (repo / "train.py").write_text("lr = 0.7\n")
    result = Experiment(
        "workers", _train, repeats=2, store=sqlite_url, executor="processes", workers=2
    ).run()
    assert [r.status for r in result.runs] == ["completed", "completed"]
    con = lab.inspect.connect(sqlite_url)
    rows = con.sql("select run_key, commit, dirty from provenance order by run_key").fetchall()
    commit = _git(repo, "rev-parse", "HEAD")
    assert rows == [("base-r0", commit, True), ("base-r1", commit, True)]
    for key in ("base-r0", "base-r1"):
        assert "+lr = 0.7" in (repo / "runs" / "workers" / key / DIFF_FILE).read_text()


def test_a_bare_loop_records_it_each_fit(repo: Path, sqlite_url: str) -> None:
    from lab import SqlLogger, TrainingLoop

    logger = SqlLogger(sqlite_url)
    for lr in ("0.2", "0.3"):  # the code changes between two fits of one notebook session
        (repo / "train.py").write_text(f"lr = {lr}\n")
        model = torch.nn.Linear(2, 1)
        TrainingLoop(
            model, torch.optim.SGD(model.parameters(), lr=0.1),
            [(torch.ones(1, 2), torch.ones(1, 1))] * 2,
            lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), 2,
            callbacks=[logger],
        ).fit(run_dir=repo / f"fit-{lr}")  # fmt: skip
        assert f"+lr = {lr}" in (repo / f"fit-{lr}" / DIFF_FILE).read_text()
    con = lab.inspect.connect(sqlite_url)
    commit = _git(repo, "rev-parse", "HEAD")
    assert con.sql("select commit, dirty from provenance").fetchall() == [(commit, True)] * 2
