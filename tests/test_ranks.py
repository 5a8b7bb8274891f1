"""Under torchrun only rank 0 runs an experiment: real processes with RANK and WORLD_SIZE set,
and a real `python -m torch.distributed.run`."""

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

SCRIPT = """
import json, os, sys
from lab import Experiment

def train(run):
    return {"loss": float(run.repeat)}

result = Experiment("ranks", train, repeats=2, store=sys.argv[1], output_dir=sys.argv[2]).run()
print(json.dumps({"rank": os.environ.get("RANK"), "runs": len(result.runs), "pid": os.getpid()}))
"""

SKIP_LINE = (
    "ranks: rank 1 of 2 skips the experiment; under torchrun only rank 0 runs it (runs do "
    "not train across ranks yet)"
)


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
    return subprocess.run(
        [sys.executable, str(script), f"sqlite:///{tmp_path / 'lab.db'}", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=300, env={**clean, **env},
    )  # fmt: skip


def test_a_rank_other_than_0_runs_and_records_nothing(script: Path, tmp_path: Path) -> None:
    out = _run(script, tmp_path, RANK="1", WORLD_SIZE="2")
    assert out.returncode == 0, out.stderr
    (report,) = _reports(out.stdout).values()
    assert (report["rank"], report["runs"]) == ("1", 0)
    assert out.stderr.strip() == SKIP_LINE
    assert not (tmp_path / "lab.db").exists()  # the store was never opened
    assert not (tmp_path / "runs").exists()

    zero = _run(script, tmp_path, RANK="0", WORLD_SIZE="2")
    assert zero.returncode == 0, zero.stderr
    assert _reports(zero.stdout)["0"]["runs"] == 2
    pid = _reports(zero.stdout)["0"]["pid"]
    assert _runs(tmp_path / "lab.db") == [("base-r0", "completed", pid),
                                          ("base-r1", "completed", pid)]  # fmt: skip


@pytest.mark.slow
def test_under_torchrun_rank_0_alone_records_the_runs(script: Path, tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(script), f"sqlite:///{tmp_path / 'lab.db'}", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=300, env=clean,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    reports = _reports(out.stdout)
    assert sorted(reports) == ["0", "1"]
    assert (reports["0"]["runs"], reports["1"]["runs"]) == (2, 0)
    assert SKIP_LINE in out.stderr.splitlines()
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
    ],
)  # fmt: skip
def test_malformed_rank_variables_are_one_line(
    env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        Experiment("bad-rank", lambda run: {}, store=False).run()
    assert str(err.value) == message


def test_world_size_1_runs_as_usual(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert len(Experiment("one-rank", lambda run: {}, repeats=2, store=False).run().runs) == 2
