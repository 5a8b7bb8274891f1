"""`lab import tensorboard`: event files written by torch's `SummaryWriter` (scalars and
``add_hparams``), read back from the lab store against TensorBoard's own reader."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import lab.inspect
from lab.importers import SourceError, import_tensorboard
from lab.importers.core import run_key
from tests.importing import imported, lab_import, nan_safe

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

#: run folder -> (lr, seed); "c" gets its hparams in a sub-folder (torch's default run_name)
RUNS = {"a": (0.1, 0), "b": (0.1, 1), "c": (0.2, 0)}


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A log folder with RUNS in it, read only."""
    root = tmp_path_factory.mktemp("tb") / "sweep"
    for name, (lr, seed) in RUNS.items():
        writer = SummaryWriter(log_dir=str(root / name))
        for step in range(3):
            writer.add_scalar("train/loss", lr + seed / 10 + (2 - step), step * 10)
            writer.add_scalar("odd", math.nan if step == 1 else step, step * 10)
        writer.add_hparams({"lr": lr, "seed": seed, "opt": "sgd"}, {"hp/acc": 0.5},
                           run_name="." if name != "c" else None)  # fmt: skip
        writer.close()
    return root


def test_each_run_comes_over_with_its_scalars_and_hparams(logdir: Path, sqlite_url: str) -> None:
    result = import_tensorboard(logdir, store=sqlite_url)
    assert result.line() == (
        "imported 3 new runs (21 points) from tensorboard into experiment 'sweep'"
    )
    runs = imported(sqlite_url, "sweep")
    assert sorted(runs) == [run_key("tensorboard", n) for n in RUNS]
    for name, (lr, seed) in RUNS.items():
        run = runs[run_key("tensorboard", name)]
        assert run["config"] == {"lr": lr, "opt": "sgd", "seed": float(seed)}
        assert (run["arm"], run["status"], run["seed"]) == (name, "completed", seed)
        acc = EventAccumulator(str(logdir / name))
        acc.Reload()
        for tag in ("train/loss", "odd"):
            assert run["points"][tag] == [
                (e.step, nan_safe(e.value), e.wall_time) for e in acc.Scalars(tag)
            ]
        assert [(s, v) for s, v, _w in run["points"]["hp/acc"]] == [(0, 0.5)]


def test_importing_again_adds_nothing_and_arm_by_gives_the_means(
    logdir: Path, tmp_path: Path
) -> None:
    store = f"sqlite:///{tmp_path / 'cli.db'}"
    args = ("tensorboard", str(logdir), "--name", "hp", "--arm-by", "lr", "--store", store)
    first, again = lab_import(*args), lab_import(*args)
    assert (first.returncode, first.stdout) == (
        0,
        "imported 3 new runs (21 points) from tensorboard into experiment 'hp'\n",
    )
    assert (
        again.stdout == "nothing new: the 3 runs from tensorboard are in experiment 'hp' already\n"
    )
    con = lab.inspect.connect(store)
    rows = lab.inspect.summary(con, "hp", "train/loss").fetchall()
    con.close()
    assert [(r[0], r[1], round(r[2], 6)) for r in rows] == [("lr=0.1", 2, 0.15), ("lr=0.2", 1, 0.2)]


def test_a_folder_without_events_is_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'never.db'}"
    with pytest.raises(SourceError) as missing:
        import_tensorboard(tmp_path / "nope", store=url)
    assert str(missing.value) == f"no such folder: {tmp_path / 'nope'}"
    done = lab_import("tensorboard", str(tmp_path), "--store", url)
    assert (done.returncode, done.stderr) == (
        1,
        f"error: {tmp_path} holds no TensorBoard event files (events.out.tfevents.*): give the "
        "folder SummaryWriter wrote to\n",
    )
    assert not (tmp_path / "never.db").exists()
