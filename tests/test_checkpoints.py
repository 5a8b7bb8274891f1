"""Checkpoints: when to save, retention rules and their union, queries, restarts, failures."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lab import CheckpointConfig, Evaluator, ManifestRow, TrainingLoop
from lab.errors import CheckpointError, ConfigError
from lab.loop.checkpoints import COMPLETE_MARKER, CheckpointManager

# --------------------------------------------------------------------------------------------
# helpers

TOP1 = "keep_top_k=1 by val/loss (min)"


def _manager(root: Path, **config: Any) -> CheckpointManager:
    return CheckpointManager(root, CheckpointConfig(**config), "r")


def _save(m: CheckpointManager, step: int, **metrics: float) -> list[tuple]:
    """Save a tiny real state for `step`; return the rows as (event, step, reason)."""
    rows = m.save(step, {"w": torch.full((2,), float(step))}, {"metrics": metrics})
    return [(r.event, r.step, r.reason) for r in rows]


def _loss(m: CheckpointManager, step: int, value: float) -> list[tuple]:
    return _save(m, step, **{"val/loss": value})


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _manifest_lines(root: Path) -> list[str]:
    return (root / "manifest.jsonl").read_text().splitlines()


# --------------------------------------------------------------------------------------------
# the config: when to save, and contradictions


def test_due_combines_every_ephemeral_fixed_start_and_end() -> None:
    cfg = CheckpointConfig(every=4, ephemeral_every=3, fixed_steps=[7, 2, 2], save_at_start=True)
    assert cfg.fixed_steps == (2, 7)
    assert [s for s in range(11) if cfg.due(s, num_steps=10)] == [0, 2, 3, 4, 6, 7, 8, 9, 10]
    assert [s for s in range(11) if cfg.is_ephemeral(s, num_steps=10)] == [3, 6, 9]
    assert [cfg.kind(s, 10) for s in (0, 2, 3, 4, 7, 10)] == [
        "regular",
        "fixed",
        "ephemeral",
        "regular",
        "fixed",
        "regular",
    ]
    # the end is never ephemeral: at num_steps, or at a run's last step when it stops early
    ends = CheckpointConfig(ephemeral_every=3)
    assert (ends.is_ephemeral(9), ends.is_ephemeral(9, 9), ends.is_ephemeral(6, final=True)) == (
        True,
        False,
        False,
    )
    no_end = CheckpointConfig(ephemeral_every=3, save_at_end=False)
    assert no_end.is_ephemeral(9, 9) and not no_end.due(10, num_steps=10)
    # the defaults: one save, after the last step; step 0 only when asked
    default = CheckpointConfig()
    assert [s for s in range(6) if default.due(s, 5)] == [5]
    assert CheckpointConfig(fixed_steps=[0], save_at_end=False).due(0, 5)
    assert CheckpointConfig(async_save=True).async_save is True


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every": 0}, "CheckpointConfig(every=0): use an int >= 1, or None"),
        ({"every": 2.0}, "CheckpointConfig(every=2.0): use an int >= 1, or None"),
        ({"ephemeral_every": 0}, "CheckpointConfig(ephemeral_every=0): use an int >= 1, or None"),
        (
            {"keep_last": 0},
            "CheckpointConfig(keep_last=0) would keep nothing; "
            "use a value >= 1, or None to keep every checkpoint",
        ),
        (
            {"keep_last": -2},
            "CheckpointConfig(keep_last=-2) would keep nothing; "
            "use a value >= 1, or None to keep every checkpoint",
        ),
        ({"keep_last": True}, "CheckpointConfig(keep_last=True): use an int >= 1, or None"),
        (
            {"keep_top_k": 0, "metric": "m", "mode": "min"},
            "CheckpointConfig(keep_top_k=0) would keep nothing; use a value >= 1, or None to "
            "rank nothing",
        ),
        (
            {"keep_top_k": 2},
            "CheckpointConfig(keep_top_k=2) needs a metric to rank by: add metric='val/loss' "
            "(logged before each save) and mode='min' or mode='max'",
        ),
        (
            {"every": 10, "ephemeral_every": 20},
            "CheckpointConfig(every=10, ephemeral_every=20) makes no save ephemeral: each one "
            "would also be due to every; use ephemeral_every < every (e.g. ephemeral_every=5), "
            "or drop one",
        ),
        (
            {"every": 10, "ephemeral_every": 10},
            "CheckpointConfig(every=10, ephemeral_every=10) makes no save ephemeral: each one "
            "would also be due to every; use ephemeral_every < every (e.g. ephemeral_every=5), "
            "or drop one",
        ),
        (
            {"every": 1, "ephemeral_every": 1},
            "CheckpointConfig(every=1, ephemeral_every=1) makes no save ephemeral: each one "
            "would also be due to every; with every=1 each save is regular: drop ephemeral_every",
        ),
        (
            {"keep_top_k": 1, "metric": "val/loss"},
            "CheckpointConfig(metric='val/loss') needs a direction: add mode='min' "
            "(lower is better) or mode='max' (higher is better)",
        ),
        (
            {"mode": "max"},
            "CheckpointConfig(mode='max') ranks nothing without a metric: add "
            "metric='val/loss' (a step or eval metric), or drop mode",
        ),
        (
            {"keep_top_k": 1, "metric": "val/loss", "mode": "avg"},
            "CheckpointConfig(mode='avg'): use 'min' (lower is better) or 'max' (higher is better)",
        ),
        (
            {"keep_top_k": 1, "metric": "", "mode": "min"},
            "CheckpointConfig(metric=''): name a metric logged before each save, e.g. 'val/loss'",
        ),
        (
            {"fixed_steps": [-1, 3]},
            "CheckpointConfig(fixed_steps=[-1, 3]): give a list of steps, ints >= 0",
        ),
        ({"fixed_steps": 5}, "CheckpointConfig(fixed_steps=5): give a list of steps, ints >= 0"),
        (
            {"fixed_steps": "10"},
            "CheckpointConfig(fixed_steps='10'): give a list of steps, ints >= 0",
        ),
        ({"async_save": "yes"}, "CheckpointConfig(async_save='yes'): use True or False"),
        ({"save_at_end": None}, "CheckpointConfig(save_at_end=None): use True or False"),
        (
            {"save_at_end": False, "keep_last": 2},
            "CheckpointConfig never saves: set every=N, ephemeral_every=N, fixed_steps=[...], "
            "save_at_start=True or save_at_end=True, or pass checkpoint=None",
        ),
    ],
)
def test_config_contradictions_are_config_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        CheckpointConfig(**kwargs)
    assert str(info.value) == message


# --------------------------------------------------------------------------------------------
# each retention rule alone


def test_keep_last_keeps_the_newest_n(tmp_path: Path) -> None:
    m = _manager(tmp_path, every=1, keep_last=2)
    rows = [row for step in range(1, 6) for row in _save(m, step)]
    assert rows == [
        ("save", 1, None),
        ("save", 2, None),
        ("save", 3, None),
        ("remove", 1, "keep_last=2"),
        ("save", 4, None),
        ("remove", 2, "keep_last=2"),
        ("save", 5, None),
        ("remove", 3, "keep_last=2"),
    ]
    assert m.checkpoints() == [4, 5]
    assert _names(tmp_path) == ["latest", "manifest.jsonl", "step_000004", "step_000005"]
    assert (tmp_path / "latest").read_text() == "step_000005"
    assert m.get_latest_checkpoint_path() == m.latest_path() == tmp_path / "step_000005"


def test_without_a_retention_rule_every_checkpoint_is_kept(tmp_path: Path) -> None:
    m = _manager(tmp_path, every=1)
    rows = [row for step in range(1, 5) for row in _save(m, step)]
    assert [r[0] for r in rows] == ["save"] * 4
    assert m.checkpoints() == [1, 2, 3, 4]


def test_keep_top_k_keeps_the_best_k_and_the_newest(tmp_path: Path) -> None:
    m = _manager(tmp_path, keep_top_k=2, metric="val/loss", mode="min")
    topk = "keep_top_k=2 by val/loss (min)"
    assert _loss(m, 1, 3.0) == [("save", 1, None)]
    assert _loss(m, 2, 1.0) == [("save", 2, None)]
    assert _loss(m, 3, 2.0) == [("save", 3, None), ("remove", 1, topk)]
    assert _loss(m, 4, 4.0) == [("save", 4, None)]  # worst, but the newest
    assert _loss(m, 5, 0.5) == [("save", 5, None), ("remove", 3, topk), ("remove", 4, topk)]
    assert m.checkpoints() == [2, 5]
    assert m.get_best_checkpoint_path() == tmp_path / "step_000005"
    assert m.get_best_checkpoint_path("val/loss", "max") == tmp_path / "step_000002"
    assert _names(tmp_path) == ["latest", "manifest.jsonl", "step_000002", "step_000005"]


def test_keep_top_k_by_max(tmp_path: Path) -> None:
    m = _manager(tmp_path, keep_top_k=1, metric="acc", mode="max")
    for step, acc in [(1, 0.2), (2, 0.9), (3, 0.5), (4, 0.6)]:
        _save(m, step, acc=acc)
    assert m.checkpoints() == [2, 4]
    assert m.get_best_checkpoint_path() == tmp_path / "step_000002"
    assert [r.reason for r in m.history() if r.event == "remove"] == [
        "keep_top_k=1 by acc (max)",
        "keep_top_k=1 by acc (max)",
    ]


def test_ties_go_to_the_newer_checkpoint(tmp_path: Path) -> None:
    m = _manager(tmp_path, keep_top_k=1, metric="val/loss", mode="min")
    assert _loss(m, 1, 1.0) == [("save", 1, None)]
    assert _loss(m, 2, 1.0) == [("save", 2, None), ("remove", 1, TOP1)]
    assert _loss(m, 3, 9.0) == [("save", 3, None)]
    assert m.checkpoints() == [2, 3]
    assert m.get_best_checkpoint_path() == tmp_path / "step_000002"
    assert _loss(m, 4, 1.0) == [("save", 4, None), ("remove", 2, TOP1), ("remove", 3, TOP1)]
    assert m.checkpoints() == [4]


def test_ephemeral_saves_go_when_the_next_save_commits(tmp_path: Path) -> None:
    m = _manager(tmp_path, every=4, ephemeral_every=1)
    eph = "ephemeral_every=1"
    assert _save(m, 1) == [("save", 1, None)]
    assert _save(m, 2) == [("save", 2, None), ("remove", 1, eph)]
    assert _save(m, 3) == [("save", 3, None), ("remove", 2, eph)]
    assert _save(m, 4) == [("save", 4, None), ("remove", 3, eph)]  # regular: kept
    assert _save(m, 5) == [("save", 5, None)]
    assert _save(m, 6) == [("save", 6, None), ("remove", 5, eph)]
    assert m.checkpoints() == [4, 6]
    assert [(r.event, r.step, r.kind) for r in m.history()][-3:] == [
        ("save", 5, "ephemeral"),
        ("save", 6, "ephemeral"),
        ("remove", 5, "ephemeral"),
    ]
    assert [r.kind for r in m.history() if r.event == "save"] == [
        "ephemeral",
        "ephemeral",
        "ephemeral",
        "regular",
        "ephemeral",
        "ephemeral",
    ]


def test_keep_last_does_not_count_ephemeral_saves(tmp_path: Path) -> None:
    m = _manager(tmp_path, every=2, ephemeral_every=1, keep_last=1)
    rows = [row for step in range(1, 6) for row in _save(m, step)]
    assert rows == [
        ("save", 1, None),
        ("save", 2, None),
        ("remove", 1, "ephemeral_every=1"),
        ("save", 3, None),  # ephemeral: step 2 stays, the newest non-ephemeral one
        ("save", 4, None),
        ("remove", 2, "keep_last=1"),
        ("remove", 3, "ephemeral_every=1"),
        ("save", 5, None),
    ]
    assert m.checkpoints() == [4, 5]


def test_an_ephemeral_save_among_the_best_is_kept(tmp_path: Path) -> None:
    m = _manager(tmp_path, every=3, ephemeral_every=1, keep_top_k=1, metric="val/loss", mode="min")
    assert _loss(m, 1, 0.1) == [("save", 1, None)]
    assert _loss(m, 2, 0.5) == [("save", 2, None)]  # 1 is the best: kept past the next save
    assert _loss(m, 3, 0.6) == [("save", 3, None), ("remove", 2, f"ephemeral_every=1; {TOP1}")]
    assert _loss(m, 4, 0.7) == [("save", 4, None), ("remove", 3, TOP1)]
    assert m.checkpoints() == [1, 4]
    assert [r.kind for r in m.history() if r.event == "remove"] == ["ephemeral", "regular"]


def test_fixed_steps_are_never_removed(tmp_path: Path) -> None:
    cfg = {"every": 1, "fixed_steps": [2], "keep_last": 1}
    m = _manager(tmp_path, **cfg, keep_top_k=1, metric="val/loss", mode="min")
    assert m.config.kind(2) == "fixed"
    assert CheckpointConfig(every=4, ephemeral_every=1, fixed_steps=[2]).kind(2) == "fixed"
    assert _loss(m, 1, 0.1) == [("save", 1, None)]
    assert _loss(m, 2, 9.0) == [("save", 2, None)]  # worst, and not the last kept later
    assert _loss(m, 3, 0.5) == [("save", 3, None)]
    assert _loss(m, 4, 0.6) == [("save", 4, None), ("remove", 3, f"keep_last=1; {TOP1}")]
    assert m.checkpoints() == [1, 2, 4]


def test_the_newest_is_never_removed_even_ranked_worst_or_nan(tmp_path: Path) -> None:
    m = _manager(tmp_path, keep_top_k=1, metric="acc", mode="max")
    _save(m, 1, acc=0.9)
    assert _save(m, 2, acc=0.1) == [("save", 2, None)]
    assert _save(m, 3, acc=math.nan) == [
        ("save", 3, None),
        ("remove", 2, "keep_top_k=1 by acc (max)"),
    ]
    assert m.checkpoints() == [1, 3]
    assert _save(m, 4, acc=0.2) == [("save", 4, None), ("remove", 3, "keep_top_k=1 by acc (max)")]
    assert m.get_best_checkpoint_path() == tmp_path / "step_000001"


def test_nan_never_ranks_best_but_another_rule_keeps_it(tmp_path: Path) -> None:
    m = _manager(tmp_path, keep_last=2, keep_top_k=1, metric="val/loss", mode="min")
    assert _loss(m, 1, math.nan) == [("save", 1, None)]
    assert m.get_best_checkpoint_path() is None  # nothing has a number yet
    assert _loss(m, 2, math.nan) == [("save", 2, None)]
    assert _loss(m, 3, 0.5) == [("save", 3, None), ("remove", 1, f"keep_last=2; {TOP1}")]
    assert m.checkpoints() == [2, 3]
    assert m.get_best_checkpoint_path() == tmp_path / "step_000003"
    again = CheckpointManager(tmp_path, m.config, "r")  # NaN survives the manifest
    assert math.isnan(again.history()[1].metrics["val/loss"])
    assert again.get_best_checkpoint_path() == tmp_path / "step_000003"


# --------------------------------------------------------------------------------------------
# rules combined


def test_rotation_never_deletes_the_best(tmp_path: Path) -> None:
    m = _manager(tmp_path, every=1, keep_last=2, keep_top_k=1, metric="val/loss", mode="min")
    both = f"keep_last=2; {TOP1}"
    assert _loss(m, 1, 0.1) == [("save", 1, None)]
    assert _loss(m, 2, 0.5) == [("save", 2, None)]
    assert _loss(m, 3, 0.4) == [("save", 3, None)]
    assert _loss(m, 4, 0.3) == [("save", 4, None), ("remove", 2, both)]
    assert _loss(m, 5, 0.2) == [("save", 5, None), ("remove", 3, both)]
    assert m.checkpoints() == [1, 4, 5]
    assert m.get_best_checkpoint_path() == tmp_path / "step_000001"
    assert _names(tmp_path) == [
        "latest",
        "manifest.jsonl",
        "step_000001",
        "step_000004",
        "step_000005",
    ]
    # a removal row carries no metrics, and names the kind of what it removed
    removal = m.history()[4]
    assert (removal.event, removal.metrics, removal.kind, removal.run_key) == (
        "remove",
        {},
        "regular",
        "r",
    )


def test_a_save_without_the_ranking_metric_is_unranked_and_never_best(tmp_path: Path) -> None:
    m = _manager(tmp_path, keep_top_k=1, metric="val/loss", mode="min")
    _loss(m, 1, 0.3)
    _save(m, 2, loss=1.0, lr=0.1)  # no val/loss measured at step 2: unranked
    assert m.checkpoints() == [1, 2]  # 1 is the best, 2 the newest
    assert m.get_best_checkpoint_path() == tmp_path / "step_000001"
    _save(m, 3, loss=0.9, lr=0.1)  # 2 is neither best nor newest any more: removed
    assert m.checkpoints() == [1, 3]
    assert m.get_best_checkpoint_path() == tmp_path / "step_000001"


def test_a_save_without_the_ranking_metric_is_unranked(tmp_path: Path) -> None:
    m = _manager(tmp_path, keep_top_k=1, metric="val/loss", mode="min")
    assert _save(m, 1, loss=1.0) == [("save", 1, None)]  # unranked, kept as the newest
    assert m.get_best_checkpoint_path() is None and m.get_best_checkpoint_paths() == []
    assert _loss(m, 2, 0.3) == [("save", 2, None), ("remove", 1, TOP1)]
    # unranked saves never displace the ranked best; the rules that do not rank keep them
    assert _save(m, 3, loss=0.9) == [("save", 3, None)]
    assert _save(m, 4, loss=0.8) == [("save", 4, None), ("remove", 3, TOP1)]
    assert m.checkpoints() == [2, 4]
    assert m.get_best_checkpoint_path() == tmp_path / "step_000002"
    assert m.history()[-2].metrics == {"loss": 0.8}  # the row shows it: no val/loss
    last = _manager(tmp_path / "last", keep_last=2, keep_top_k=1, metric="val/loss", mode="min")
    _loss(last, 1, 0.1)
    for step in (2, 3, 4):
        _save(last, step, loss=1.0)
    assert last.checkpoints() == [1, 3, 4]  # keep_last keeps unranked ones, top-k the best


def test_a_manifest_written_before_unranked_saves_still_loads(tmp_path: Path) -> None:
    # rows as the earlier code wrote them: every save carried the last eval value
    for step in (4, 5):
        folder = tmp_path / f"step_00000{step}"
        folder.mkdir()
        torch.save({"w": torch.zeros(1)}, folder / "state.pt")
        (folder / "COMPLETE").write_text("")
    (tmp_path / "manifest.jsonl").write_text(
        '{"event": "save", "kind": "regular", "metrics": {"loss": 0.5, "val/loss": 0.3}, '
        '"path": "step_000004", "reason": null, "run_key": "r", "step": 4, "time": 1.0}\n'
        '{"event": "save", "kind": "regular", "metrics": {"loss": 0.4, "val/loss": 0.3}, '
        '"path": "step_000005", "reason": null, "run_key": "r", "step": 5, "time": 2.0}\n'
    )
    m = _manager(tmp_path, every=1, metric="val/loss", mode="min")
    assert m.checkpoints() == [4, 5]
    assert m.get_best_checkpoint_paths() == [tmp_path / "step_000005", tmp_path / "step_000004"]


# --------------------------------------------------------------------------------------------
# restarts: the manifest is the bookkeeping


def test_bookkeeping_survives_a_restart_and_retention_carries_on(tmp_path: Path) -> None:
    config = {"every": 1, "keep_last": 2, "keep_top_k": 1, "metric": "val/loss", "mode": "min"}
    losses = [0.1, 0.5, 0.4, 0.3, 0.2, 0.05, 0.6]

    straight = _manager(tmp_path / "straight", **config)
    expected = [row for step, v in enumerate(losses, 1) for row in _loss(straight, step, v)]

    first = _manager(tmp_path / "restarted", **config)
    rows = [row for step, v in enumerate(losses[:4], 1) for row in _loss(first, step, v)]
    second = _manager(tmp_path / "restarted", **config)
    assert second.history() == first.history()
    assert second.state_dict() == first.state_dict()
    assert second.checkpoints() == first.checkpoints() == [1, 3, 4]
    assert second.get_latest_checkpoint_path() == first.get_latest_checkpoint_path()
    assert second.get_best_checkpoint_path() == first.get_best_checkpoint_path()
    rows += [row for step, v in enumerate(losses[4:], 5) for row in _loss(second, step, v)]

    assert rows == expected
    assert second.checkpoints() == straight.checkpoints() == [6, 7]
    third = _manager(tmp_path / "restarted", **config)
    assert [r.to_json() for r in third.history()] == _manifest_lines(tmp_path / "restarted")
    assert third.checkpoints() == [6, 7]


def test_a_re_saved_step_is_the_newest(tmp_path: Path) -> None:
    """A run restarted from scratch saves step 2 again, after 4 and 6: commit order rules."""
    m = _manager(tmp_path, every=2, keep_last=2)
    for step in (2, 4, 6):
        _save(m, step)
    assert _save(m, 2) == [("save", 2, None), ("remove", 4, "keep_last=2")]
    assert m.checkpoints() == [6, 2]
    assert m.get_latest_checkpoint_path() == tmp_path / "step_000002"
    assert (tmp_path / "latest").read_text() == "step_000002"
    assert _manager(tmp_path, every=2, keep_last=2).checkpoints() == [6, 2]


def test_removed_folders_left_by_a_kill_count_as_removed_and_get_cleaned(
    tmp_path: Path,
) -> None:
    m = _manager(tmp_path, every=1, keep_last=1)
    _save(m, 1)
    _save(m, 2)
    # a kill between the removal row and the delete leaves the folder behind
    shutil.copytree(tmp_path / "step_000002", tmp_path / "step_000001")
    (tmp_path / "tmp_step_000003").mkdir()
    (tmp_path / "tmp_step_000003" / "state.pt").write_bytes(b"partial")
    (tmp_path / "tmp_latest").write_text("step_000003")
    (tmp_path / "tmp_notes").write_text("a file of someone else's")

    again = _manager(tmp_path, every=1, keep_last=1)
    assert again.checkpoints() == [2]
    with pytest.raises(CheckpointError) as info:
        again.resolve(tmp_path / "step_000001")
    assert (
        str(info.value)
        == f"{tmp_path / 'step_000001'} was removed (keep_last=1); available steps: [2]"
    )
    assert again.remove_stale_tmp() == [
        tmp_path / "tmp_latest",
        tmp_path / "tmp_step_000003",
        tmp_path / "step_000001",
    ]
    assert _names(tmp_path) == ["latest", "manifest.jsonl", "step_000002", "tmp_notes"]
    assert again.remove_stale_tmp() == []


def test_a_removal_killed_halfway_leaves_debris_never_a_step_folder_without_its_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A removal renames the folder out of the ``step_*`` names before deleting it: a kill
    after the delete's first file (here COMPLETE) leaves a ``tmp_*`` folder, which the next
    start deletes, and every ``step_*`` folder stays whole."""
    m = _manager(tmp_path, every=1, keep_last=1)
    _save(m, 1)

    def killed_halfway(path: Any, ignore_errors: bool = False) -> None:
        Path(path, COMPLETE_MARKER).unlink()  # what rmtree deletes first, here
        raise SystemExit("killed")

    monkeypatch.setattr(shutil, "rmtree", killed_halfway)
    with pytest.raises(SystemExit):
        _save(m, 2)
    monkeypatch.undo()
    assert _names(tmp_path) == [
        "latest", "manifest.jsonl", "step_000002", "tmp_removed_step_000001"
    ]  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "tmp_removed_step_000001").iterdir()) == [
        "state.pt", "training_info.json"
    ]  # fmt: skip
    again = _manager(tmp_path, every=1, keep_last=1)
    assert again.checkpoints() == [2]
    assert again.remove_stale_tmp() == [tmp_path / "tmp_removed_step_000001"]
    assert _names(tmp_path) == ["latest", "manifest.jsonl", "step_000002"]


def test_orphans_and_missing_folders_are_not_checkpoints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    m = _manager(tmp_path, every=1)
    for step in (1, 2, 3):
        _save(m, step)
    # a save killed after its rename, before its manifest row: complete, but never committed
    shutil.copytree(tmp_path / "step_000003", tmp_path / "step_000009")
    shutil.rmtree(tmp_path / "step_000003")  # a recorded checkpoint whose folder is gone
    (tmp_path / "step_000007").mkdir()  # an incomplete folder: silently not a checkpoint

    with caplog.at_level(logging.WARNING, logger="lab.loop.checkpoints"):
        again = _manager(tmp_path, every=1)
    assert [r.getMessage() for r in caplog.records] == [
        f"manifest.jsonl records step 3, but {tmp_path / 'step_000003'} is missing or "
        "incomplete: not a checkpoint",
        f"{tmp_path / 'step_000009'} is a complete checkpoint that manifest.jsonl does not "
        "record (its save was interrupted before it committed); it is ignored: not listed, not "
        "the latest, never removed; load it by path",
    ]
    assert again.checkpoints() == [1, 2]
    with pytest.raises(CheckpointError) as info:  # `latest` still names the lost step 3
        again.get_latest_checkpoint_path()
    assert str(info.value) == (
        f"{tmp_path / 'latest'} names 'step_000003', a checkpoint that is missing or "
        "incomplete; delete or fix that file (available steps: [1, 2])"
    )
    (tmp_path / "latest").unlink()  # as it says: the manifest then names the newest
    assert again.get_latest_checkpoint_path() == tmp_path / "step_000002"
    with pytest.raises(CheckpointError) as info:
        again.resolve(3)
    assert str(info.value) == (
        f"the checkpoint of step 3 is recorded but {tmp_path / 'step_000003'} is missing or "
        "incomplete; available steps: [1, 2]"
    )
    with pytest.raises(CheckpointError) as info:
        again.resolve(9)
    assert str(info.value) == (
        f"{tmp_path / 'step_000009'} is not recorded in manifest.jsonl (its save never "
        "committed); pass its path to load it anyway; available steps: [1, 2]"
    )
    assert again.resolve(tmp_path / "step_000009") == tmp_path / "step_000009"
    assert torch.equal(again.load(tmp_path / "step_000009")["w"], torch.full((2,), 3.0))
    # retention leaves the orphan alone; a new save of its step replaces it and commits it
    _save(again, 9)
    assert again.checkpoints() == [1, 2, 9]


def test_a_torn_manifest_row_is_dropped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    m = _manager(tmp_path, every=1)
    _save(m, 1)
    lines = _manifest_lines(tmp_path)
    with open(tmp_path / "manifest.jsonl", "a") as fh:
        fh.write('{"run_key": "r", "st')  # a kill mid-append
    with caplog.at_level(logging.WARNING, logger="lab.loop.checkpoints"):
        again = _manager(tmp_path, every=1)
    assert caplog.records[0].getMessage() == (
        f"{tmp_path / 'manifest.jsonl'} ends with a partial row (an interrupted write); dropping it"
    )
    assert _manifest_lines(tmp_path) == lines
    _save(again, 2)
    assert _manager(tmp_path, every=1).checkpoints() == [1, 2]


def test_a_damaged_manifest_line_is_an_error(tmp_path: Path) -> None:
    _save(_manager(tmp_path, every=1), 1)
    with open(tmp_path / "manifest.jsonl", "a") as fh:
        fh.write("not json\n")
    with pytest.raises(CheckpointError, match=r"manifest.jsonl line 2 is not a manifest row \("):
        _manager(tmp_path, every=1)


def test_state_dict_holds_the_bookkeeping_and_restores_a_copied_folder(tmp_path: Path) -> None:
    m = _manager(tmp_path / "a", every=1, keep_last=2)
    for step in (1, 2, 3):
        _save(m, step)
    state = m.state_dict()
    assert state == {"version": 1, "manifest": [json.loads(x) for x in _manifest_lines(m.root)]}

    # a folder restored from copies of the checkpoints alone gets its manifest back
    copy = tmp_path / "b"
    copy.mkdir()
    for name in ("step_000002", "step_000003"):
        shutil.copytree(m.root / name, copy / name)
    restored = _manager(copy, every=1, keep_last=2)
    assert restored.checkpoints() == []
    restored.load_state_dict(state)
    assert restored.checkpoints() == [2, 3]
    assert _manifest_lines(copy) == _manifest_lines(m.root)

    # an older snapshot of the same manifest changes nothing
    _save(m, 4)
    m.load_state_dict(state)
    assert m.checkpoints() == [3, 4]
    assert len(m.history()) == 6

    other = _manager(tmp_path / "c", every=1)
    _save(other, 1)
    with pytest.raises(CheckpointError) as info:
        other.load_state_dict(state)
    assert str(info.value) == (
        f"the bookkeeping disagrees with {tmp_path / 'c' / 'manifest.jsonl'} from row 1 on; "
        "it comes from another attempt at this run: use a fresh folder"
    )
    stranger = CheckpointManager(tmp_path / "d", CheckpointConfig(), "someone")
    with pytest.raises(CheckpointError) as info:
        stranger.load_state_dict(state)
    assert str(info.value) == (
        "the bookkeeping belongs to run 'r', not 'someone'; restore it into that run's "
        "checkpoint folder"
    )
    with pytest.raises(CheckpointError, match=r"^load_state_dict got no checkpoint bookkeeping"):
        stranger.load_state_dict({"model": {}})


# --------------------------------------------------------------------------------------------
# resolving and loading


def test_resolve_load_and_training_info(tmp_path: Path) -> None:
    tmp_path = tmp_path / "ck"  # not the working folder, so "step_000002" is relative to it
    m = _manager(tmp_path, every=1, keep_last=2)
    for step in (1, 2, 3):
        _save(m, step, loss=step / 10)
    step2 = tmp_path / "step_000002"
    assert m.resolve(2) == m.resolve(step2) == m.resolve(str(step2)) == step2
    assert m.resolve("step_000002") == step2  # relative to the checkpoint root
    assert m.resolve("3") == m.resolve("latest") == tmp_path / "step_000003"
    loaded = m.load(2)
    assert set(loaded) == {"w"} and torch.equal(loaded["w"], torch.full((2,), 2.0))
    assert loaded["w"].device.type == "cpu"
    info = m.load_training_info(step2)
    assert {k: info[k] for k in ("step", "run_key", "metrics")} == {
        "step": 2,
        "run_key": "r",
        "metrics": {"loss": 0.2},
    }
    assert info["time"] == m.history()[1].time


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (1, "the checkpoint of step 1 was removed (keep_last=2); available steps: [2, 3]"),
        (7, "no checkpoint of step 7 in {root}; available steps: [2, 3]"),
        (-1, "no checkpoint of step -1 in {root}; available steps: [2, 3]"),
        (
            "{root}/step_000001",
            "{root}/step_000001 was removed (keep_last=2); available steps: [2, 3]",
        ),
        (
            "{root}/nowhere",
            "checkpoint {root}/nowhere does not exist; pass a checkpoint folder or a step "
            "(available steps: [2, 3])",
        ),
        (
            "{root}/step_000005",
            "{root}/step_000005 is not a complete checkpoint (no COMPLETE marker or no "
            "state.pt): an interrupted save or not a checkpoint folder (available steps: [2, 3])",
        ),
        (
            "{root}/notes.txt",
            "{root}/notes.txt is not a complete checkpoint (no COMPLETE marker or no "
            "state.pt): an interrupted save or not a checkpoint folder (available steps: [2, 3])",
        ),
        (
            "{root}",
            "{root} is the checkpoint root, not a checkpoint; pass a step or one of its step_* "
            "folders (available steps: [2, 3])",
        ),
        (True, "resolve(True): pass a step number or a checkpoint path"),
    ],
)
def test_resolve_says_why_there_is_no_checkpoint(tmp_path: Path, target: Any, message: str) -> None:
    m = _manager(tmp_path, every=1, keep_last=2)
    for step in (1, 2, 3):
        _save(m, step)
    (tmp_path / "step_000005").mkdir()  # an interrupted save: state but no COMPLETE marker
    (tmp_path / "step_000005" / "state.pt").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("x")
    if isinstance(target, str):
        target = target.format(root=tmp_path)
    with pytest.raises(CheckpointError) as info:
        m.resolve(target)
    assert str(info.value) == message.format(root=tmp_path)
    with pytest.raises(CheckpointError):
        m.load(target)


def test_resolve_latest_without_checkpoints_and_a_damaged_state(tmp_path: Path) -> None:
    m = _manager(tmp_path, every=1)
    with pytest.raises(CheckpointError) as info:
        m.resolve("latest")
    assert str(info.value) == f"no checkpoint in {tmp_path} yet; train first"
    assert m.get_latest_checkpoint_path() is None
    _save(m, 1)
    (tmp_path / "step_000001" / "state.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError) as info:
        m.load(1)
    assert str(info.value).startswith(f"cannot load {tmp_path / 'step_000001' / 'state.pt'}: ")
    assert str(info.value).endswith("; the file is damaged, pick another checkpoint")


def test_best_checkpoint_needs_a_metric(tmp_path: Path) -> None:
    m = _manager(tmp_path, every=1)
    _save(m, 1, acc=0.5)
    _save(m, 2, acc=0.7)
    with pytest.raises(ConfigError) as info:
        m.get_best_checkpoint_path()
    assert str(info.value) == (
        "get_best_checkpoint_path() needs a metric: pass metric= and mode=, or set "
        "CheckpointConfig(metric=..., mode=...)"
    )
    with pytest.raises(ConfigError, match=r"^get_best_checkpoint_path\(mode=None\): use 'min'"):
        m.get_best_checkpoint_path("acc")
    assert m.get_best_checkpoint_path("acc", "max") == tmp_path / "step_000002"
    assert m.get_best_checkpoint_path("missing", "max") is None


# --------------------------------------------------------------------------------------------
# failed saves leave everything as it was


def _snapshot(root: Path) -> tuple:
    return (_names(root), _manifest_lines(root), (root / "latest").read_text())


def test_a_save_that_cannot_create_its_folder_changes_nothing(tmp_path: Path) -> None:
    m = _manager(tmp_path, every=1)
    _save(m, 1)
    tmp = tmp_path / "tmp_step_000002"
    tmp.write_text("someone else's file")  # mkdir of the tmp folder fails for real
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointError) as info:
        _save(m, 2)
    assert str(info.value) == (
        f"cannot save step 2: cannot create {tmp}: FileExistsError: [Errno 17] File exists: '{tmp}'"
    )
    assert _snapshot(tmp_path) == before
    assert tmp.read_text() == "someone else's file"
    assert m.checkpoints() == [1]


def test_a_state_a_safe_load_refuses_fails_before_anything_is_written(tmp_path: Path) -> None:
    m = _manager(tmp_path, every=1)
    _save(m, 1)
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointError) as info:
        m.save(2, {"w": torch.ones(1), "fn": [len]}, {"metrics": {}})
    assert str(info.value) == (
        "cannot save step 2: the state holds builtins.builtin_function_or_method at "
        "state['fn'][0], which a checkpoint cannot load safely (weights_only=True); save plain "
        "types: tensors, dicts, lists, str, int, float, bool, None"
    )
    assert _snapshot(tmp_path) == before
    assert m.checkpoints() == [1]
    assert torch.equal(m.load(1)["w"], torch.full((2,), 1.0))


def test_a_save_failing_at_the_rename_removes_its_tmp_folder(tmp_path: Path) -> None:
    m = _manager(tmp_path, every=1)
    _save(m, 1)
    (tmp_path / "step_000002").write_text("a file where the folder goes")
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointError) as info:
        _save(m, 2)
    tmp, final = tmp_path / "tmp_step_000002", tmp_path / "step_000002"
    assert str(info.value) == (
        f"cannot save step 2 in {tmp}: NotADirectoryError: [Errno 20] Not a directory: "
        f"'{tmp}' -> '{final}'"
    )
    assert _snapshot(tmp_path) == before


def test_a_save_whose_manifest_row_fails_is_rolled_back(tmp_path: Path) -> None:
    m = _manager(tmp_path, every=1)
    (tmp_path / "manifest.jsonl").mkdir()  # appending to it fails after the rename
    with pytest.raises(CheckpointError) as info:
        _save(m, 1)
    manifest = tmp_path / "manifest.jsonl"
    assert str(info.value) == (
        f"cannot save step 1 in {tmp_path / 'step_000001'}: IsADirectoryError: [Errno 21] Is "
        f"a directory: '{manifest}'"
    )
    assert _names(tmp_path) == ["manifest.jsonl"]  # no checkpoint, no tmp folder, no latest
    assert m.checkpoints() == []


def test_a_root_that_cannot_be_created_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    root = tmp_path / "file" / "checkpoints"
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(root, CheckpointConfig(), "r")
    assert str(info.value) == (
        f"cannot create the checkpoint folder {root}: NotADirectoryError: [Errno 20] Not a "
        f"directory: '{root}'; pass a writable folder"
    )


def test_bad_save_arguments_are_checkpoint_errors(tmp_path: Path) -> None:
    m = _manager(tmp_path, every=1)
    with pytest.raises(CheckpointError, match=r"^save\(step=-1\): give the step as an int >= 0$"):
        m.save(-1, {}, {})
    with pytest.raises(CheckpointError, match=r"^save\(step=1\): info\['metrics'\] must map"):
        m.save(1, {}, {"metrics": {"loss": "low"}})
    assert _names(tmp_path) == []


# --------------------------------------------------------------------------------------------
# through the training loop


def _loop(num_steps: int, checkpoint: CheckpointConfig, evaluators: list[Evaluator]) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, generator=g)
    data = [(x, x.sum(1, keepdim=True))]

    def mse(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainingLoop(
        model, opt, data, mse, num_steps, checkpoint=checkpoint, evaluators=evaluators
    )


def test_the_loop_keeps_the_best_by_an_eval_metric(tmp_path: Path) -> None:
    scores = iter([1.0, 5.0, 2.0, 3.0, 0.0])
    val = Evaluator("val", lambda m: {"score": next(scores)}, every=1)
    config = CheckpointConfig(every=1, keep_last=1, keep_top_k=1, metric="val/score", mode="max")
    artifacts = _loop(5, config, [val]).fit(run_dir=tmp_path / "run")
    both = "keep_last=1; keep_top_k=1 by val/score (max)"
    assert [(r.event, r.step, r.reason) for r in artifacts.checkpoints] == [
        ("save", 1, None),
        ("save", 2, None),
        ("remove", 1, both),
        ("save", 3, None),
        ("save", 4, None),
        ("remove", 3, both),
        ("save", 5, None),
        ("remove", 4, both),
    ]
    root = tmp_path / "run" / "checkpoints"
    m = CheckpointManager(root, config, "run")
    assert m.checkpoints() == [2, 5]
    assert m.get_best_checkpoint_path() == root / "step_000002"
    assert m.load_training_info(2)["metrics"]["val/score"] == 5.0
    assert [ManifestRow.from_json(x) for x in _manifest_lines(root)] == artifacts.checkpoints


def test_the_loop_fails_cleanly_when_the_ranked_metric_is_not_logged(tmp_path: Path) -> None:
    val = Evaluator("val", lambda m: {"loss": 1.0}, every=2)
    config = CheckpointConfig(every=2, keep_top_k=1, metric="val/acc", mode="max")
    with pytest.raises(CheckpointError) as info:
        _loop(4, config, [val]).fit(run_dir=tmp_path / "run")
    message = str(info.value)
    assert message.startswith(
        "CheckpointConfig(metric='val/acc') ranks saves, but nothing logged 'val/acc' before "
        "the save at step 2 (logged: ["
    )
    assert "'loss'" in message and "'val/loss'" in message  # what was logged instead
    assert message.endswith(
        "]); log it before the save (loop.end_step, loop.log_eval, or an Evaluator), or fix "
        "the name"
    )
    assert _names(tmp_path / "run" / "checkpoints") == []  # nothing written, nothing left over


def test_the_loop_warns_once_at_the_end_when_no_save_was_ranked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    val = Evaluator("val", lambda m: {"acc": 1.0}, every=3)  # evals at 3, saves at 2 and 4
    config = CheckpointConfig(every=2, keep_top_k=1, metric="val/acc", mode="max")
    with caplog.at_level(logging.WARNING, logger="lab"):
        artifacts = _loop(4, config, [val]).fit(run_dir=tmp_path / "run")
    assert [(r.event, r.step) for r in artifacts.checkpoints] == [
        ("save", 2),
        ("save", 4),
        ("remove", 2),
    ]
    warned = [r.getMessage() for r in caplog.records if "ranked no checkpoint" in r.getMessage()]
    assert warned == [
        "CheckpointConfig(metric='val/acc') ranked no checkpoint up to step 4: no save had a "
        "value measured at its own step; run the evaluator at the save steps (e.g. the same "
        "every=), or fix the name"
    ]


# --------------------------------------------------------------------------------------------
# a save records only values measured at its own step


def _val(values: list[float], every: int, at_start: bool = False) -> Evaluator:
    """An eval that gives these val/loss values, one per run, in order."""
    given = iter(values)
    return Evaluator("val", lambda m: {"loss": next(given)}, every=every, at_start=at_start)


def _saves(artifacts: Any) -> list[tuple[str, int, bool]]:
    """(event, step, whether the row has a val/loss) for each manifest row of a fit."""
    return [(r.event, r.step, "val/loss" in r.metrics) for r in artifacts.checkpoints]


def test_a_save_between_evals_never_outranks_the_evaluated_one(tmp_path: Path) -> None:
    val = _val([0.9, 0.5, 0.3, 0.4], every=2, at_start=True)  # steps 0, 2, 4, 6
    config = CheckpointConfig(every=1, keep_top_k=1, metric="val/loss", mode="min")
    artifacts = _loop(6, config, [val]).fit(run_dir=tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"
    m = CheckpointManager(root, config, "run")
    assert m.checkpoints() == [4, 6]
    assert m.get_best_checkpoint_path() == root / "step_000004"
    assert m.get_best_checkpoint_paths() == [root / "step_000004", root / "step_000006"]
    assert m.load_training_info(4)["metrics"]["val/loss"] == 0.3
    assert m.load_training_info(6)["metrics"]["val/loss"] == 0.4
    five = next(r for r in artifacts.checkpoints if r.step == 5)
    assert sorted(five.metrics) == ["grad_norm", "loss", "lr", "step_time"]  # unranked
    assert artifacts.metrics["val/loss"] == 0.4  # the loop's own last values are unchanged


@pytest.mark.parametrize("at_start", [True, False])
def test_ephemeral_saves_between_evals_are_unranked(tmp_path: Path, at_start: bool) -> None:
    values = [1.0, 0.2, 0.5] if at_start else [0.2, 0.5]
    config = CheckpointConfig(
        every=20, ephemeral_every=5, keep_top_k=1, metric="val/loss", mode="min"
    )
    artifacts = _loop(40, config, [_val(values, every=20, at_start=at_start)]).fit(
        run_dir=tmp_path / "run"
    )
    root = tmp_path / "run" / "checkpoints"
    m = CheckpointManager(root, config, "run")
    assert m.checkpoints() == [20, 40]
    assert m.get_best_checkpoint_path() == root / "step_000020"
    ranked = {step for event, step, has in _saves(artifacts) if event == "save" and has}
    assert ranked == {20, 40}
    removed = [step for event, step, _ in _saves(artifacts) if event == "remove"]
    assert removed == [5, 10, 15, 25, 30, 35]


# --------------------------------------------------------------------------------------------
# ranking without pruning, the K best, "no checkpoint yet", and JSON-native info


def test_a_metric_without_keep_top_k_ranks_without_pruning(tmp_path: Path) -> None:
    m = _manager(tmp_path, every=1, metric="val/loss", mode="min")
    for step, value in [(1, 0.5), (2, 0.2), (3, math.nan), (4, 0.2), (5, 0.9)]:
        _loss(m, step, value)
    _save(m, 6, loss=0.1)  # unranked
    assert m.checkpoints() == [1, 2, 3, 4, 5, 6]  # nothing removed
    best = [p.name for p in m.get_best_checkpoint_paths()]
    assert best == ["step_000004", "step_000002", "step_000001", "step_000005"]
    assert [p.name for p in m.get_best_checkpoint_paths(2)] == ["step_000004", "step_000002"]
    assert m.get_best_checkpoint_path() == tmp_path / "step_000004"
    assert [p.name for p in m.get_best_checkpoint_paths(1, "val/loss", "max")] == ["step_000005"]
    with pytest.raises(ConfigError) as info:
        m.get_best_checkpoint_paths(0)
    assert str(info.value) == (
        "get_best_checkpoint_paths(k=0): use an int >= 1, or None for every ranked one"
    )


def test_none_means_no_checkpoint_yet(tmp_path: Path) -> None:
    m = _manager(tmp_path, every=1)
    assert m.load_training_info(m.get_latest_checkpoint_path()) is None
    assert m.resolve(None) is None
    with pytest.raises(CheckpointError) as info:
        m.load(None)  # type: ignore[arg-type]
    assert str(info.value) == (
        "load(None): there is no checkpoint to load (get_latest_checkpoint_path() is None "
        "before the first save); check for None first"
    )
    _save(m, 1)
    assert m.load_training_info(m.get_latest_checkpoint_path())["step"] == 1


def test_info_values_are_made_json_native(tmp_path: Path) -> None:
    import numpy as np

    m = _manager(tmp_path, every=1)
    info = {
        "metrics": {"loss": np.float32(0.5)},
        "count": np.int64(3),
        "lr": torch.tensor(0.25),
        "flags": [np.bool_(True), {"k": torch.tensor(2)}],
        "nan": math.nan,
    }
    m.save(1, {"w": torch.zeros(1)}, info)
    saved = m.load_training_info(1)
    assert {k: saved[k] for k in ("count", "lr", "flags", "metrics")} == {
        "count": 3,
        "lr": 0.25,
        "flags": [True, {"k": 2}],
        "metrics": {"loss": 0.5},
    }
    assert math.isnan(saved["nan"])
    assert type(saved["count"]) is int and type(saved["flags"][0]) is bool


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            torch.zeros(2),
            "save(step=2): info['extra']['w'] is a Tensor of shape (2,); training_info.json "
            "holds JSON values: convert it with .tolist()",
        ),
        (
            "numpy",
            "save(step=2): info['extra']['w'] is a ndarray of shape (2, 1); training_info.json "
            "holds JSON values: convert it with .tolist()",
        ),
        (
            object(),
            "save(step=2): info['extra']['w'] is a builtins.object, which training_info.json "
            "cannot hold; give str, int, float, bool, None, or lists and dicts of them",
        ),
    ],
)
def test_info_values_json_cannot_hold_fail_before_anything_is_written(
    tmp_path: Path, value: Any, message: str
) -> None:
    import numpy as np

    if isinstance(value, str):
        value = np.zeros((2, 1))
    m = _manager(tmp_path, every=1)
    _save(m, 1)
    before = _snapshot(tmp_path)
    for save in (m.save, m.save_async):
        with pytest.raises(CheckpointError) as info:
            save(2, {"w": torch.zeros(1)}, {"metrics": {}, "extra": {"w": value}})
        assert str(info.value) == message
    assert _snapshot(tmp_path) == before


# --------------------------------------------------------------------------------------------
# a property: unranked saves never displace ranked ones


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    values=st.lists(st.one_of(st.none(), st.sampled_from([0.1, 0.2, 0.3, math.nan])), max_size=8),
    top_k=st.integers(1, 3),
    keep_last=st.one_of(st.none(), st.integers(1, 2)),
)
def test_retention_keeps_the_best_ranked_and_the_rules_keep_the_rest(
    tmp_path_factory: pytest.TempPathFactory,
    values: list[float | None],
    top_k: int,
    keep_last: int | None,
) -> None:
    root = tmp_path_factory.mktemp("prop")
    m = _manager(root, keep_top_k=top_k, keep_last=keep_last, metric="val/loss", mode="min")
    for step, value in enumerate(values, start=1):
        _save(m, step, loss=1.0, **({} if value is None else {"val/loss": value}))
    ranked = [(v, -s) for s, v in enumerate(values, start=1) if v is not None and v == v]
    best = [-s for _, s in sorted(ranked)[:top_k]]
    newest = [len(values)] if values else []
    last = list(range(1, len(values) + 1))[-keep_last:] if keep_last else []
    kept = sorted(set(best) | set(newest) | set(last))
    assert m.checkpoints() == kept
    by_rank = [-s for _, s in sorted(ranked) if -s in kept]  # unranked and NaN left out
    assert [int(p.name[5:]) for p in m.get_best_checkpoint_paths()] == by_rank
    assert by_rank[:top_k] == best
