"""Under torchrun every rank runs the experiment and rank 0 alone records it: a real
`python -m torch.distributed.run`; malformed launcher variables are one line."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from lab import Experiment
from lab.errors import ConfigError
from tests import warm

SCRIPT = """
import json, os, sys
from lab import Experiment

def train(run):
    return {"loss": float(run.repeat)}

result = Experiment("ranks", train, repeats=2, store=sys.argv[1], output_dir=sys.argv[2]).run()
report = {"rank": os.environ.get("RANK"), "runs": len(result.runs), "pid": os.getpid()}
# One write, line and newline together: the ranks share the pipe, and under
# PYTHONUNBUFFERED a print writes its newline apart, so two ranks' lines could run together.
os.write(1, (json.dumps(report) + "\\n").encode())
"""


def _reports(stdout: str) -> dict[str, dict]:
    found = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {r["rank"]: r for r in found}


def _runs(db: Path) -> list[tuple[str, str, int]]:
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT run_key, status, pid FROM runs ORDER BY run_key").fetchall()
    finally:
        con.close()


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "ranks.py"
    path.write_text(SCRIPT)
    return path


def _run(script: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return warm.run(
        [sys.executable, str(script), f"sqlite:///{tmp_path / 'lab.db'}", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=300, env={**clean, **env},
    )  # fmt: skip


@pytest.mark.slow
def test_under_torchrun_every_rank_runs_and_rank_0_alone_records(
    script: Path, tmp_path: Path
) -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = warm.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(script), f"sqlite:///{tmp_path / 'lab.db'}", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=300, env=clean,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    reports = _reports(out.stdout)
    assert sorted(reports) == ["0", "1"]
    assert (reports["0"]["runs"], reports["1"]["runs"]) == (2, 2)
    pid = reports["0"]["pid"]
    assert _runs(tmp_path / "lab.db") == [("base-r0", "completed", pid),
                                          ("base-r1", "completed", pid)]  # fmt: skip


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK is not set; launch with torchrun, which "
                              "sets both"),
        ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE='two' is not a whole number; unset it, "
                                             "or launch with torchrun, which sets RANK and "
                                             "WORLD_SIZE"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 must be below WORLD_SIZE=2"),
        ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK='-1' must be >= 0; unset it, or launch with "
                                            "torchrun"),
        ({"WORLD_SIZE": "2", "RANK": "1"}, "RANK and WORLD_SIZE are set but MASTER_ADDR and "
                                           "MASTER_PORT not; launch with torchrun (which sets "
                                           "all four), or init the process group before "
                                           "Experiment.run()"),
    ],
)  # fmt: skip
def test_malformed_rank_variables_are_one_line(
    env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        Experiment("bad-rank", lambda run: {}, store=False).run()
    assert str(err.value) == message


def test_torchrun_with_an_executor_of_its_own_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29999"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        Experiment("two-ways", lambda run: {}, store=False, processes_per_run=2).run()
    assert str(err.value) == (
        "executor='serial', processes_per_run=2 under torchrun: the ranks torchrun started are "
        "each run's processes; use executor='serial' and processes_per_run=1, or drop torchrun"
    )


def test_world_size_1_runs_as_usual(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert len(Experiment("one-rank", lambda run: {}, repeats=2, store=False).run().runs) == 2
