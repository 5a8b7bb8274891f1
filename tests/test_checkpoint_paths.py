"""Checkpoint folders never reach outside their root: a manifest row, a `latest` file or a
resume path that names somewhere else (an absolute path, "..", a link that leads out) is one
`CheckpointError`, and the folder it names survives byte for byte."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lab import Arm, CheckpointConfig, Experiment, RunSpec, TrainingLoop
from lab.errors import CheckpointError
from lab.loop.checkpoints import CheckpointManager


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _outside(tmp_path: Path) -> Path:
    """A folder beside the run that looks like a checkpoint, and holds someone's data."""
    other = tmp_path / "precious"
    other.mkdir()
    torch.save({"w": torch.full((2,), 99.0)}, other / "state.pt")
    (other / "COMPLETE").write_bytes(b"")
    (other / "thesis.txt").write_text("years of work")
    return other


def _saved(root: Path) -> CheckpointManager:
    m = CheckpointManager(root, CheckpointConfig(every=1, keep_last=2), "r")
    for step in (1, 2):
        m.save(step, {"w": torch.full((2,), float(step))}, {"metrics": {}})
    return m


def _rewrite_path(root: Path, step: int, path: str, *, removed: bool = False) -> None:
    """Point the manifest's rows for `step` at `path`; `removed` adds a removal row."""
    lines = (root / "manifest.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    for row in rows:
        if row["step"] == step:
            row["path"] = path
    if removed:
        rows.append({**rows[0], "event": "remove", "path": path, "reason": "keep_last=2"})
    (root / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("how", ["absolute", "dotdot", "nested dotdot"])
@pytest.mark.parametrize("removed", [False, True], ids=["saved", "removed"])
def test_a_manifest_path_outside_the_folder_is_refused_and_touches_nothing(
    tmp_path: Path, how: str, removed: bool
) -> None:
    root = tmp_path / "run" / "checkpoints"
    _saved(root)
    outside = _outside(tmp_path)
    before = _snapshot(outside)
    path = {
        "absolute": str(outside),
        "dotdot": "../../precious",
        "nested dotdot": "step_000001/../../../precious",
    }[how]
    _rewrite_path(root, 1, path, removed=removed)
    with pytest.raises(CheckpointError) as info:
        m = CheckpointManager(root, CheckpointConfig(every=1, keep_last=2), "r")
        m.remove_stale_tmp()  # deletes what the manifest records as removed
        m.save(3, {"w": torch.zeros(2)}, {"metrics": {}})  # retention drops step 1
    assert str(info.value) == (
        f"manifest.jsonl in {root} names {path!r}, which is not a folder inside it; "
        "a checkpoint is named by its step_* folder: fix or remove that row"
    )
    assert _snapshot(outside) == before


def test_a_link_that_leads_out_is_neither_loaded_nor_removed(tmp_path: Path) -> None:
    root = tmp_path / "run" / "checkpoints"
    _saved(root)
    outside = _outside(tmp_path)
    before = _snapshot(outside)
    shutil.rmtree(root / "step_000001")
    (root / "step_000001").symlink_to(outside, target_is_directory=True)
    message = (
        f"{root / 'step_000001'} is a link to {outside}, outside the checkpoint folder {root}; "
        "nothing there is loaded or removed: replace the link by the folder itself"
    )
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(root, CheckpointConfig(every=1, keep_last=2), "r")
    assert str(info.value) == message
    # a link made after the manager opened is refused where it would be removed
    m = CheckpointManager(tmp_path / "fresh", CheckpointConfig(every=1, keep_last=1), "r")
    m.save(1, {"w": torch.zeros(2)}, {"metrics": {}})
    fresh = m.root / "step_000001"
    shutil.rmtree(fresh)
    fresh.symlink_to(outside, target_is_directory=True)
    with pytest.raises(CheckpointError) as info:
        m.save(2, {"w": torch.zeros(2)}, {"metrics": {}})
    assert str(info.value) == message.replace(str(root), str(m.root))
    assert m.checkpoints() == [1, 2]  # step 2 committed; step 1 is kept, not followed
    assert _snapshot(outside) == before


def test_resume_by_a_path_outside_the_run_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "run" / "checkpoints"
    m = _saved(root)
    outside = _outside(tmp_path)
    before = _snapshot(outside)
    (root / "step_000009").symlink_to(outside, target_is_directory=True)
    for target in (outside, root / "step_000009", root / ".." / ".." / "precious"):
        with pytest.raises(CheckpointError) as info:
            m.load(target)
        assert str(info.value) == (
            f"{target} is outside this run's checkpoint folder {root}; resume from a step or "
            "one of its step_* folders (available steps: [1, 2]), or copy the checkpoint in "
            "first"
        )
    assert _snapshot(outside) == before


def test_a_latest_file_pointing_outside_fails_the_next_stage(tmp_path: Path) -> None:
    outside = _outside(tmp_path)
    before = _snapshot(outside)
    started: list[float] = []

    def train(run: RunSpec) -> Any:
        torch.manual_seed(run.seed)
        model = torch.nn.Linear(2, 1, bias=False)
        model.weight.data.zero_()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        loop = TrainingLoop(model, opt, [torch.ones(1, 2)], lambda m, b: m(b).sum(), 1,
                            checkpoint=CheckpointConfig(every=1))  # fmt: skip
        if run.parent_checkpoint is not None:
            started.append(float(run.parent_checkpoint.name == "precious"))
        artifacts = loop.fit(run)
        (run.dir / "checkpoints" / "latest").write_text(str(outside))  # tampered with
        return artifacts

    result = Experiment("chain", train, arms=[Arm("cl", stages=[{}, {}])], store=False,
                        output_dir=tmp_path / "runs").run()  # fmt: skip
    assert [r.status for r in result.runs] == ["completed", "failed"]
    latest = tmp_path / "runs" / "chain" / "cl-r0-s0" / "checkpoints" / "latest"
    assert result.runs[1].error == (
        f"CheckpointError: latest in {latest.parent} names {str(outside)!r}, which is not a "
        "folder inside it; a checkpoint is named by its step_* folder: fix or delete that file"
    )
    assert started == []  # the tampered stage never started from the outside folder
    assert _snapshot(outside) == before


def test_bookkeeping_restored_from_a_checkpoint_is_checked_like_the_manifest(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run" / "checkpoints"
    m = _saved(root)
    outside = _outside(tmp_path)
    before = _snapshot(outside)
    state = m.state_dict()
    state["manifest"].append({**state["manifest"][0], "step": 3, "path": str(outside)})
    manifest = (root / "manifest.jsonl").read_bytes()
    with pytest.raises(CheckpointError) as info:
        m.load_state_dict(state)
    assert str(info.value) == (
        f"the checkpoint's bookkeeping in {root} names {str(outside)!r}, which is not a folder "
        "inside it; a checkpoint is named by its step_* folder: fix or remove that row"
    )
    assert (root / "manifest.jsonl").read_bytes() == manifest  # nothing appended
    assert m.checkpoints() == [1, 2]
    assert _snapshot(outside) == before


def _counting_fit(run_dir: Path, steps: int, losses: list[int]) -> Any:
    """A bare fit of `steps` steps, saving every 2, that counts the steps it trains."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)

    def loss(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        losses.append(1)
        return m(batch).sum()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainingLoop(model, opt, [torch.ones(1, 2)], loss, steps,
                        checkpoint=CheckpointConfig(every=2)).fit(run_dir=run_dir)  # fmt: skip


@pytest.mark.parametrize(
    "bad",
    ["absolute", "dotdot", "a link to a file outside", "names a link that leads out",
     "missing folder", "incomplete folder", "removed", "unrecorded", "garbage", "empty"],
)  # fmt: skip
def test_a_bad_latest_file_stops_the_resume_before_any_step(tmp_path: Path, bad: str) -> None:
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    trained: list[int] = []
    _counting_fit(run_dir, 4, trained)
    assert len(trained) == 4 and CheckpointManager(root).checkpoints() == [2, 4]
    outside = _outside(tmp_path)
    before = _snapshot(outside)
    latest = root / "latest"
    available = "delete or fix that file (available steps: [2, 4])"
    not_inside = f"latest in {root} names {{}}, which is not a folder inside it; a checkpoint "
    not_inside += "is named by its step_* folder: fix or delete that file"
    if bad == "absolute":
        latest.write_text(str(outside))
        message = not_inside.format(repr(str(outside)))
    elif bad == "dotdot":
        latest.write_text("../../precious")
        message = not_inside.format("'../../precious'")
    elif bad == "a link to a file outside":
        (tmp_path / "name").write_text("step_000002")
        latest.unlink()
        latest.symlink_to(tmp_path / "name")
        message = f"{latest} is a link to {tmp_path / 'name'}; nothing outside {root} is read: "
        message += available
    elif bad == "names a link that leads out":
        (root / "step_000009").symlink_to(outside, target_is_directory=True)
        latest.write_text("step_000009")
        message = (f"{root / 'step_000009'} is a link to {outside}, outside the checkpoint "
                   f"folder {root}; nothing there is loaded or removed: replace the link by the "
                   "folder itself")  # fmt: skip
    elif bad == "missing folder":
        shutil.rmtree(root / "step_000004")
        latest.write_text("step_000004\n")
        message = f"{latest} names 'step_000004', a checkpoint that is missing or incomplete; "
        message += "delete or fix that file (available steps: [2])"
    elif bad == "incomplete folder":
        (root / "step_000004" / "COMPLETE").unlink()
        message = f"{latest} names 'step_000004', a checkpoint that is missing or incomplete; "
        message += "delete or fix that file (available steps: [2])"
    elif bad == "removed":
        row = json.loads((root / "manifest.jsonl").read_text().splitlines()[0])
        removal = {**row, "event": "remove", "reason": "by hand"}
        with (root / "manifest.jsonl").open("a") as f:
            f.write(json.dumps(removal) + "\n")
        latest.write_text("step_000002")
        message = f"{latest} names 'step_000002', a checkpoint that was removed (by hand); "
        message += "delete or fix that file (available steps: [4])"
    elif bad == "unrecorded":  # a complete folder that no save row records
        shutil.copytree(root / "step_000002", root / "step_000003")
        latest.write_text("step_000003")
        message = f"{latest} names 'step_000003', a checkpoint that no save row of "
        message += f"manifest.jsonl records; {available}"
    elif bad == "garbage":
        latest.write_bytes(b"\xff\xfe\x00garbage")
        message = f"cannot read {latest}: UnicodeDecodeError: "
    else:
        latest.write_text("")
        message = not_inside.format("''")
    trained.clear()
    with pytest.raises(CheckpointError) as info:
        _counting_fit(run_dir, 8, trained)
    if bad == "garbage":
        assert str(info.value).startswith(message)
        assert str(info.value).endswith(f"; {available}") and "\n" not in str(info.value)
    else:
        assert str(info.value) == message
    assert trained == []  # not one step trained from another checkpoint
    assert _snapshot(outside) == before
    with pytest.raises(CheckpointError):  # the manager's own lookup says the same
        CheckpointManager(root).get_latest_checkpoint_path()


def test_a_latest_that_cannot_be_updated_is_removed_not_left_naming_a_removed_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "checkpoints"
    m = CheckpointManager(root, CheckpointConfig(every=1, keep_last=1), "r")
    m.save(1, {"w": torch.zeros(2)}, {"metrics": {}})
    (root / "tmp_latest").mkdir()  # writing the new `latest` fails for real
    m.save(2, {"w": torch.ones(2)}, {"metrics": {}})  # retention removes step 1
    assert [r.getMessage() for r in caplog.records if "latest" in r.getMessage()] == [
        f"cannot update {root / 'latest'} ([Errno 21] Is a directory: "
        f"'{root / 'tmp_latest'}'); removed it"
    ]
    assert not (root / "latest").exists() and m.checkpoints() == [2]
    assert CheckpointManager(root).get_latest_checkpoint_path() == root / "step_000002"
