"""Checkpoints never unpickle arbitrary objects: every state.pt loads with weights_only=True."""

from __future__ import annotations

import logging
import pathlib
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lab import Callback, CheckpointConfig, Evaluator, TrainingLoop
from lab.callbacks.monitors import EarlyStopping
from lab.errors import CheckpointError
from lab.loop.checkpoints import CheckpointManager

# --------------------------------------------------------------------------------------------
# helpers


class _Draws(Callback):
    """Draws from every RNG each step and keeps a count: a stateful callback of plain types."""

    def __init__(self) -> None:
        self.count = 0
        self.draws: list[float] = []

    def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: dict) -> None:
        self.count += 1
        self.draws.append(random.random() + float(np.random.rand()))

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "draws": list(self.draws)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.draws = state["count"], list(state["draws"])


def _loop(num_steps: int, callbacks: list[Callback], every: int = 3) -> TrainingLoop:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.2), torch.nn.Linear(4, 1))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 3, generator=g)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True
    )

    def mse(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])

    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return TrainingLoop(
        model,
        opt,
        data,
        mse,
        num_steps,
        scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        evaluators=[Evaluator("val", lambda m: {"loss": float(m(x).square().mean())}, every=1)],
        checkpoint=CheckpointConfig(every=every),
        callbacks=callbacks,
    )


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# --------------------------------------------------------------------------------------------
# what the loop saves loads safely


def test_every_checkpoint_the_loop_writes_loads_with_weights_only(tmp_path: Path) -> None:
    callbacks = [_Draws(), EarlyStopping("val/loss", patience=100)]
    _loop(6, callbacks).fit(run_dir=tmp_path / "run")
    files = sorted((tmp_path / "run" / "checkpoints").glob("step_*/state.pt"))
    assert [f.parent.name for f in files] == ["step_000003", "step_000006"]
    for file in files:
        payload = torch.load(file, map_location="cpu", weights_only=True)
        assert payload["loop"]["step"] == int(file.parent.name[5:])
        assert set(payload["callbacks"]) == {"_Draws", "EarlyStopping"}
        assert isinstance(payload["rng"]["numpy"]["state"]["key"], list)


def test_a_resume_from_safe_checkpoints_is_bit_identical(tmp_path: Path) -> None:
    whole = _loop(6, [_Draws()])
    whole.fit(run_dir=tmp_path / "whole")
    draws = _Draws()
    _loop(3, [_Draws()]).fit(run_dir=tmp_path / "cut")
    resumed = _loop(6, [draws])
    resumed.fit(run_dir=tmp_path / "cut")  # from step 3, loaded with weights_only=True
    for a, b in zip(_weights(whole.model), _weights(resumed.model), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert draws.count == 6 and draws.draws == whole.callbacks[0].draws  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------
# a planted checkpoint runs nothing


class _Planted:
    """Unpickling this writes a file: what a checkpoint from someone else could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.write_text, (self.marker, "code ran"))


def test_a_planted_checkpoint_writes_nothing_and_fails_in_one_line(tmp_path: Path) -> None:
    _loop(3, [_Draws()]).fit(run_dir=tmp_path / "run")
    state = tmp_path / "run" / "checkpoints" / "step_000003" / "state.pt"
    payload = torch.load(state, weights_only=True)
    marker = tmp_path / "marker"
    payload["callbacks"]["_Draws"] = {"count": 3, "draws": [_Planted(marker)]}
    torch.save(payload, state)
    with pytest.raises(CheckpointError) as info:
        _loop(6, [_Draws()]).fit(run_dir=tmp_path / "run")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{state} refers to getattr, which a safe load")
    assert message.endswith(
        "which a safe load (weights_only=True) refuses, since unpickling it could run code; if "
        "you made this checkpoint (an older lab saved numpy RNG states so), load it knowingly "
        "with CheckpointManager.load(path, trusted=True) or set LAB_TRUST_CHECKPOINTS=1 to "
        "resume from it; else start fresh"
    )
    assert not marker.exists()
    # the file was live: a plain unpickle runs it
    torch.load(state, weights_only=False)
    assert marker.read_text() == "code ran"


# --------------------------------------------------------------------------------------------
# checkpoints written before: refused by default, loaded knowingly


def _as_old_checkpoint(state: Path) -> None:
    """Rewrite a state.pt as the earlier code saved it: numpy's RNG state as a legacy tuple."""
    payload = torch.load(state, weights_only=True)
    for key in ("rng", "epoch_rng"):
        numpy = payload[key]["numpy"]
        payload[key]["numpy"] = (
            numpy["bit_generator"],
            np.asarray(numpy["state"]["key"], dtype=np.uint32),
            numpy["state"]["pos"],
            numpy["has_gauss"],
            numpy["gauss"],
        )
    torch.save(payload, state)


def test_an_old_checkpoint_is_refused_then_resumes_when_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    whole = _loop(6, [_Draws()])
    whole.fit(run_dir=tmp_path / "whole")
    _loop(3, [_Draws()]).fit(run_dir=tmp_path / "cut")
    state = tmp_path / "cut" / "checkpoints" / "step_000003" / "state.pt"
    _as_old_checkpoint(state)
    with pytest.raises(CheckpointError) as info:
        _loop(6, [_Draws()]).fit(run_dir=tmp_path / "cut")
    assert str(info.value).startswith(f"{state} refers to numpy.")
    assert "LAB_TRUST_CHECKPOINTS=1" in str(info.value)
    monkeypatch.setenv("LAB_TRUST_CHECKPOINTS", "1")
    resumed = _loop(6, [_Draws()])
    with caplog.at_level(logging.WARNING, logger="lab"):
        artifacts = resumed.fit(run_dir=tmp_path / "cut")
    assert artifacts.step == 6
    trusted = [r.getMessage() for r in caplog.records if "weights_only=False" in r.getMessage()]
    assert len(trusted) == 1
    assert trusted[0].startswith(f"loading {state} with weights_only=False (it refers to numpy.")
    assert trusted[0].endswith(
        "which a safe load refuses): trusted because LAB_TRUST_CHECKPOINTS is set; a "
        "checkpoint saved by this version loads safely"
    )
    for a, b in zip(_weights(whole.model), _weights(resumed.model), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the new checkpoint of step 6 is safe again
    torch.load(state.parent.parent / "step_000006" / "state.pt", weights_only=True)


def test_the_manager_loads_an_old_checkpoint_only_when_told(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _loop(3, [_Draws()]).fit(run_dir=tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"
    _as_old_checkpoint(root / "step_000003" / "state.pt")
    manager = CheckpointManager(root)
    with pytest.raises(CheckpointError, match="load it knowingly"):
        manager.load(3)
    with caplog.at_level(logging.WARNING, logger="lab"):
        payload = manager.load(3, trusted=True)
    assert isinstance(payload["rng"]["numpy"], tuple)
    assert [r.getMessage().endswith("trusted because trusted=True was passed; a checkpoint "
                                    "saved by this version loads safely")
            for r in caplog.records] == [True]  # fmt: skip
    with pytest.raises(CheckpointError, match="load it knowingly"):
        manager.load(3, trusted=False)


# --------------------------------------------------------------------------------------------
# a callback state a safe load would refuse fails at the save, not at the resume


class _NumpyState(Callback):
    def __init__(self) -> None:
        self.best = np.float64(0.5)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "seen": [1, 2]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state["best"]


def test_a_callback_state_a_safe_load_refuses_fails_at_the_save(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        _loop(3, [_NumpyState()]).fit(run_dir=tmp_path / "run")
    assert str(info.value) == (
        "_NumpyState (state key '_NumpyState') returns a state_dict() holding numpy.float64 at "
        "state['best'], which a checkpoint cannot load safely (weights_only=True); return plain "
        "types: tensors, dicts, lists, str, int, float, bool, None (e.g. float(x), x.tolist(), "
        "torch.as_tensor(x))"
    )
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == []


def test_built_in_states_are_plain_even_when_a_metric_was_a_numpy_scalar(tmp_path: Path) -> None:
    from lab.loop.payload import callback_states

    stopping = EarlyStopping("score", patience=3)
    stopping.best, stopping.best_step = np.float64(0.25), 4  # as a callback could have logged it
    states = callback_states({"EarlyStopping": stopping})
    assert states == {"EarlyStopping": {"best": 0.25, "best_step": 4, "bad_checks": 0}}
    assert type(states["EarlyStopping"]["best"]) is float
    torch.save(states, tmp_path / "s.pt")
    assert torch.load(tmp_path / "s.pt", weights_only=True) == states
