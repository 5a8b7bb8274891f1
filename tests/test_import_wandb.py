"""`lab import wandb`: offline runs written by wandb itself, read back from the lab store
against the records wandb's own reader (``wandb leet inspect``) prints."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from lab.importers import SourceError, import_wandb
from lab.importers.core import run_key
from tests import warm
from tests.importing import imported, lab_import, nan_safe

wandb = pytest.importorskip("wandb")

#: (lr, seed, exit code): each an offline run of project "proj"
RUNS = [(0.1, 1, 0), (0.1, 0, 0), (0.2, 0, 1)]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """The wandb folder with RUNS in it, and the runs' ids, read only."""
    os.environ["WANDB_SILENT"] = "true"
    folder = tmp_path_factory.mktemp("wandb")
    ids = []
    for lr, seed, code in RUNS:
        run = wandb.init(
            mode="offline", dir=folder, project="proj", tags=["t1", "has space"],
            config={"lr": lr, "seed": seed, "net": {"width": 8}},
        )  # fmt: skip
        for step in range(3):
            run.log(
                {"loss": lr + seed / 10 + (2 - step), "odd": math.nan if step else 1}, step=step
            )
        ids.append(run.id)
        run.finish(exit_code=code)
    return folder / "wandb", ids


def _history(folder: Path) -> list[dict[str, Any]]:
    """The history records of a run folder, as wandb's reader prints them."""
    from wandb.util import get_core_path

    log = next(folder.glob("run-*.wandb"))
    out = warm.run(
        [get_core_path(), "leet", "inspect", "--no-observability", "--json",
         "--run-file", str(log), str(folder.parent)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    records = [json.loads(line) for line in out.splitlines()]
    return [r["history"] for r in records if r["type"] == "history"]


def test_each_run_comes_over_with_its_config_history_tags_and_state(
    written: Any, sqlite_url: str
) -> None:
    folder, ids = written
    result = import_wandb([folder], store=sqlite_url)
    assert result.line() == "imported 3 new runs (18 points) from wandb into experiment 'proj'"
    runs = imported(sqlite_url, "proj")
    assert sorted(runs) == sorted(run_key("wandb", i) for i in ids)
    for (lr, seed, code), rid in zip(RUNS, ids, strict=True):
        run = runs[run_key("wandb", rid)]
        assert run["config"] == {"lr": lr, "seed": seed, "net": {"width": 8}}
        assert (run["status"], run["error"]) == (
            ("completed", None) if code == 0 else ("failed", "exit code 1")
        )
        assert run["tags"] == ["t1"]
        assert run["provenance"]["imported_from"]["tags"] == ["t1", "has space"]
        history = _history(next(folder.glob(f"*run-*-{rid}")))
        for key in ("loss", "odd"):
            assert run["points"][key] == [
                (h["step"].get("num", 0), nan_safe(float(h["item"][key])),
                 h["item"]["_timestamp"])
                for h in history
            ]  # fmt: skip


def test_importing_again_adds_nothing(written: Any, sqlite_url: str) -> None:
    folder, _ids = written
    import_wandb([folder], store=sqlite_url)
    before = imported(sqlite_url, "proj")
    again = import_wandb(sorted(folder.glob("offline-run-*")), store=sqlite_url)
    assert again.line() == "nothing new: the 3 runs from wandb are in experiment 'proj' already"
    assert imported(sqlite_url, "proj") == before


def test_arm_by_and_the_command_end_to_end(written: Any, tmp_path: Path) -> None:
    folder, ids = written
    store = f"sqlite:///{tmp_path / 'cli.db'}"
    done = lab_import("wandb", str(folder), "--arm-by", "net.width,lr", "--store", store)
    assert (done.returncode, done.stdout) == (
        0,
        "imported 3 new runs (18 points) from wandb into experiment 'proj'\n",
    )
    runs = imported(store, "proj")
    assert [(runs[run_key("wandb", i)]["arm"], runs[run_key("wandb", i)]["repeat"])
            for i in ids] == [("net.width=8,lr=0.1", 1), ("net.width=8,lr=0.1", 0),
                              ("net.width=8,lr=0.2", 0)]  # fmt: skip


def test_bad_folders_are_one_line_and_write_nothing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'never.db'}"
    with pytest.raises(SourceError) as missing:
        import_wandb([tmp_path / "nope"], store=url)
    assert str(missing.value) == f"no such folder: {tmp_path / 'nope'}"
    (tmp_path / "empty").mkdir()
    done = lab_import("wandb", str(tmp_path / "empty"), "--store", url)
    assert (done.returncode, done.stderr) == (
        1,
        f"error: {tmp_path / 'empty'} is not a wandb run folder (it holds no run-*.wandb "
        "file): give wandb/run-* or wandb/offline-run-* folders, or the wandb folder\n",
    )
    bad = tmp_path / "wandb" / "offline-run-x"
    bad.mkdir(parents=True)
    (bad / "run-x.wandb").write_bytes(b"garbage")
    with pytest.raises(SourceError) as unreadable:
        import_wandb([bad], store=url)
    assert str(unreadable.value).startswith(f"wandb cannot read {bad / 'run-x.wandb'}: ")
    assert not (tmp_path / "never.db").exists()
