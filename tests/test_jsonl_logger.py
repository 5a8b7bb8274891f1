"""`JsonlLogger`'s lines for the epoch and media hooks, and `replay` firing them again.

The hooks are fired through a real `Dispatcher` into a real file, and the file is read back
with a strict JSON parser, as `jq` would.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from lab import Callback
from lab.dispatch import Dispatcher
from lab.errors import ConfigError
from lab.hooks import LogContext, LoopState
from lab.loggers.jsonl import REPLAYED, JsonlLogger, replay
from lab.loop.training import LoopArtifacts, TrainingBatch
from lab.media import Histogram, Image

HIST = Histogram(edges=(0.0, 0.5, 1.0), counts=(3, 4))
IMAGE = Image(Path("media/x/step_000001.png"), 8, 6)


def _strict(text: str) -> Any:
    def refuse(token: str) -> None:
        raise ValueError(f"not strict JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def _fire_a_run(folder: Path) -> Path:
    ctx = LogContext(experiment="e", output_dir=folder, run_key="r0", arm="a", repeat=0)
    model = torch.nn.Linear(2, 1)
    state = LoopState(ctx, model, torch.optim.SGD(model.parameters(), lr=0.1), num_steps=2)
    hooks = Dispatcher([JsonlLogger()], strict=True)
    hooks.fire("on_run_start", ctx)
    hooks.fire("on_train_start", state)
    for epoch, step in ((0, 1), (1, 2)):
        hooks.fire("on_epoch_start", state, epoch)
        state.step = step
        hooks.fire("on_step_end", state, step, TrainingBatch(), {"loss": math.nan})
        if step == 1:
            hooks.fire("on_media", state, step, {"w": HIST, "x": IMAGE})
        hooks.fire("on_epoch_end", state, epoch)
    hooks.fire("on_train_end", state, LoopArtifacts(model, {"loss": 0.5}, 2))
    return folder / "r0" / "hooks.jsonl"


def test_epoch_and_media_lines_are_strict_json_with_their_payload(tmp_path: Path) -> None:
    lines = [_strict(line) for line in _fire_a_run(tmp_path).read_text().splitlines()]
    for line in lines:
        line.pop("time")
        line.pop("run_key")
    assert [line["hook"] for line in lines] == [
        "on_run_start", "on_train_start",
        "on_epoch_start", "on_step_end", "on_media", "on_epoch_end",
        "on_epoch_start", "on_step_end", "on_epoch_end",
        "on_train_end",
    ]  # fmt: skip
    assert lines[2] == {"hook": "on_epoch_start", "step": 0, "epoch": 0}
    assert lines[3] == {"hook": "on_step_end", "step_idx": 1, "metrics": {"loss": "NaN"}}
    assert lines[4] == {
        "hook": "on_media",
        "step_idx": 1,
        "media": {
            "w": {
                "type": "Histogram",
                "total": 7,
                "edges": [0.0, 0.5, 1.0],
                "counts": [3, 4],
                "nan": 0,
                "posinf": 0,
                "neginf": 0,
            },
            "x": {"type": "Image", "path": "media/x/step_000001.png", "width": 8, "height": 6},
        },
    }
    assert lines[5] == {"hook": "on_epoch_end", "step": 1, "epoch": 0}
    assert lines[8] == {"hook": "on_epoch_end", "step": 2, "epoch": 1}


class Seen(Callback):
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_epoch_start(self, state: LoopState, epoch: int) -> None:
        self.calls.append(("on_epoch_start", epoch, state.epoch, state.step))

    def on_media(self, state: LoopState, step_idx: int, media: Any) -> None:
        self.calls.append(("on_media", step_idx, dict(media)))

    def on_epoch_end(self, state: LoopState, epoch: int) -> None:
        self.calls.append(("on_epoch_end", epoch, state.epoch, state.step))


def test_replay_fires_the_epoch_and_media_hooks_with_the_records_rebuilt(tmp_path: Path) -> None:
    path = _fire_a_run(tmp_path)
    seen = Seen()
    fired = replay(path, seen, hooks=["on_epoch_start", "on_media", "on_epoch_end"])
    assert fired == [
        "on_epoch_start", "on_media", "on_epoch_end", "on_epoch_start", "on_epoch_end"
    ]  # fmt: skip
    assert seen.calls == [
        ("on_epoch_start", 0, 0, 0),
        ("on_media", 1, {"w": HIST, "x": IMAGE}),  # equal records: tuples and a Path again
        ("on_epoch_end", 0, 0, 1),
        ("on_epoch_start", 1, 1, 1),
        ("on_epoch_end", 1, 1, 2),
    ]
    assert "on_media" in REPLAYED and "on_epoch_start" in REPLAYED


def test_replay_names_the_epoch_and_media_hooks_among_those_it_replays(tmp_path: Path) -> None:
    path = _fire_a_run(tmp_path)
    with pytest.raises(ConfigError) as info:
        replay(path, Seen(), hooks=["pre_step"])
    assert str(info.value) == (
        "replay cannot rebuild ['pre_step']; it replays on_run_start, post_checkpoint_loaded, "
        "on_train_start, on_epoch_start, on_step_end, on_media, on_eval, on_checkpoint, "
        "on_epoch_end, on_error, on_train_end"
    )
