"""Checkpoints: when to save, how a save is made atomic, and the manifest that records it.

Layout of a run's checkpoint folder::

    checkpoints/
      step_000100/         state.pt + training_info.json + COMPLETE
      tmp_step_000200/     being written; renamed when complete, never read
      manifest.jsonl       one ManifestRow per save and per removal
      latest               names the newest complete checkpoint
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from lab.errors import ConfigError

STATE_FILE = "state.pt"
INFO_FILE = "training_info.json"
COMPLETE_MARKER = "COMPLETE"
MANIFEST_FILE = "manifest.jsonl"
LATEST_FILE = "latest"
TMP_PREFIX = "tmp_"


def step_dirname(step: int) -> str:
    """The folder name of the checkpoint taken after `step` steps."""
    return f"step_{step:06d}"


@dataclass(frozen=True)
class CheckpointConfig:
    """When the loop saves, and which saves it keeps.

    `every` saves each N steps, `save_at_end` saves after the last step, and `keep_last`
    keeps only the newest N saves (None keeps all). The newest save is never removed.
    """

    every: int | None = None
    keep_last: int | None = None
    save_at_end: bool = True

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise ConfigError(f"CheckpointConfig(every={self.every}): use a value >= 1, or None")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(
                f"CheckpointConfig(keep_last={self.keep_last}) would keep nothing; "
                "use a value >= 1, or None to keep every checkpoint"
            )

    def due(self, step: int, *, num_steps: int) -> bool:
        """Whether to save after step `step`."""
        if self.every is not None and step % self.every == 0:
            return True
        return self.save_at_end and step == num_steps


@dataclass(frozen=True)
class ManifestRow:
    """One line of `manifest.jsonl`: a save or a removal of one checkpoint."""

    run_key: str
    step: int
    path: str
    event: Literal["save", "remove"]
    time: float
    metrics: dict[str, float] = field(default_factory=dict)
    reason: str | None = None

    def to_json(self) -> str:
        """The manifest line (NaN and inf written as JSON's NaN/Infinity)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> ManifestRow:
        """Parse one manifest line."""
        return cls(**json.loads(line))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


class CheckpointManager:
    """Saves checkpoints atomically into one run's folder and applies retention."""

    def __init__(self, root: Path, config: CheckpointConfig, run_key: str) -> None:
        self.root = Path(root)
        self.config = config
        self.run_key = run_key
        self.root.mkdir(parents=True, exist_ok=True)
        self.saved: list[int] = [row.step for row in self.history() if row.event == "save"]
        removed = {row.step for row in self.history() if row.event == "remove"}
        self.saved = [s for s in self.saved if s not in removed]

    def history(self) -> list[ManifestRow]:
        """Every manifest row, oldest first."""
        manifest = self.root / MANIFEST_FILE
        if not manifest.exists():
            return []
        lines = manifest.read_text(encoding="utf-8").splitlines()
        return [ManifestRow.from_json(line) for line in lines if line.strip()]

    def latest_path(self) -> Path | None:
        """The newest complete checkpoint folder, ignoring any incomplete one."""
        complete = [
            p for p in self.root.glob("step_*") if p.is_dir() and (p / COMPLETE_MARKER).exists()
        ]
        return max(complete, key=lambda p: p.name) if complete else None

    def save(self, step: int, state: dict[str, Any], info: dict[str, Any]) -> list[ManifestRow]:
        """Write `state` for `step`, commit it, then drop what retention no longer keeps."""
        final = self.root / step_dirname(step)
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        with open(tmp / STATE_FILE, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        info = {"step": step, "run_key": self.run_key, "time": time.time(), **info}
        _write_durable(tmp / INFO_FILE, json.dumps(info, sort_keys=True).encode())
        _write_durable(tmp / COMPLETE_MARKER, b"")
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step (e.g. a restarted run): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        row = ManifestRow(
            self.run_key, step, final.name, "save", info["time"], dict(info.get("metrics", {}))
        )
        self._append(row)
        self._point_latest(final.name)
        if step not in self.saved:
            self.saved.append(step)
        return [row, *self._apply_retention()]

    def _apply_retention(self) -> list[ManifestRow]:
        keep_last = self.config.keep_last
        if keep_last is None or len(self.saved) <= keep_last:
            return []
        doomed, self.saved = self.saved[:-keep_last], self.saved[-keep_last:]
        rows = []
        for step in doomed:
            shutil.rmtree(self.root / step_dirname(step), ignore_errors=True)
            row = ManifestRow(
                self.run_key,
                step,
                step_dirname(step),
                "remove",
                time.time(),
                reason=f"keep_last={keep_last}",
            )
            self._append(row)
            rows.append(row)
        return rows

    def _append(self, row: ManifestRow) -> None:
        with open(self.root / MANIFEST_FILE, "a", encoding="utf-8") as fh:
            fh.write(row.to_json() + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _point_latest(self, name: str) -> None:
        tmp = self.root / f"{TMP_PREFIX}{LATEST_FILE}"
        _write_durable(tmp, name.encode())
        os.replace(tmp, self.root / LATEST_FILE)
