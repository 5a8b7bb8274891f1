"""ModelAverager: window averages, merged folders, ephemeral blocking, exact resume, config."""

from __future__ import annotations

import json
import pickle
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

from lab import Arm, Callback, CheckpointConfig, Experiment, LogContext, LoopState, TrainingLoop
from lab.callbacks import build
from lab.callbacks.averaging import EXTRAS_KEY, ModelAverager
from lab.errors import ConfigError
from lab.loop.checkpoints import COMPLETE_MARKER, INFO_FILE, STATE_FILE, CheckpointManager

DOCS = Path(__file__).resolve().parent.parent / "docs" / "model-averager.md"

# --------------------------------------------------------------------------------------------
# helpers


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randn(8, 3, generator=g)
        out.append((x, x.sum(1, keepdim=True)))
    return out


def _model() -> torch.nn.Module:
    """Float parameters, float BatchNorm buffers and an int one (num_batches_tracked)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 6),
        torch.nn.BatchNorm1d(6),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),  # draws from the RNG, so an exact resume must restore it
        torch.nn.Linear(6, 1),
    )


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _loop(
    num_steps: int, callbacks: list[Callback], model: torch.nn.Module | None = None, **kw: Any
) -> TrainingLoop:
    model = model if model is not None else _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = kw.pop("loss_fn", _mse)
    return TrainingLoop(model, opt, _batches(), loss_fn, num_steps, callbacks=callbacks, **kw)


class Recorder(Callback):
    """Keeps a copy of the model's state dict after every step."""

    def __init__(self) -> None:
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.metrics: dict[int, dict[str, float]] = {}
        self.due: dict[int, bool] = {}

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: Any, metrics: dict[str, float]
    ) -> None:
        self.after[step_idx] = {k: v.clone() for k, v in state.model.state_dict().items()}
        self.metrics[step_idx] = dict(metrics)
        self.due[step_idx] = state.checkpoint_due


class StopAt(Callback):
    """Ends training cleanly after step `step`, as a preempted run would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: Any, metrics: dict[str, float]
    ) -> None:
        if step_idx == self.step:
            state.request_stop("test")


class Crash(Exception):
    """The failure that interrupts the first attempt."""


def _crashing_mse(at: int) -> Any:
    calls = {"n": 0}

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == at:
            raise Crash(f"crash in step {at}")
        return _mse(model, batch)

    return loss_fn


def _mean(recorded: dict[int, dict[str, torch.Tensor]], steps: range) -> dict[str, torch.Tensor]:
    """The average written out by hand: float entries summed in float32 over `steps` and
    divided; the others at the last step."""
    last = recorded[steps[-1]]
    out = {}
    for key, value in last.items():
        if value.is_floating_point():
            total = sum(recorded[s][key].to(torch.float32) for s in steps)
            out[key] = (total / len(steps)).to(value.dtype)
        else:
            out[key] = value.clone()
    return out


def _merged(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return CheckpointManager(run_dir / "merged").load(step)["model"]


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# --------------------------------------------------------------------------------------------
# the average


@pytest.mark.parametrize(
    ("params", "num_steps", "windows"),
    [
        ({"at_steps": [9, 4], "window": 3}, 10, {4: range(2, 5), 9: range(7, 10)}),
        ({"every": 4, "window": 3}, 10, {4: range(2, 5), 8: range(6, 9)}),
        ({"at_steps": [2], "window": 5}, 4, {2: range(1, 3)}),  # clipped at step 1
        ({"every": 2, "window": 3}, 6, {2: range(1, 3), 4: range(2, 5), 6: range(4, 7)}),
        ({"at_steps": [5], "window": 1}, 6, {5: range(5, 6)}),
    ],
    ids=["at_steps", "every", "clipped", "overlapping", "window-1"],
)
def test_merged_weights_are_the_mean_of_the_window(
    tmp_path: Path, params: dict[str, Any], num_steps: int, windows: dict[int, range]
) -> None:
    recorder, averager = Recorder(), ModelAverager(**params)
    _loop(num_steps, [recorder, averager]).fit(run_dir=tmp_path / "run")

    assert averager.merged == [tmp_path / "run" / "merged" / f"step_{m:06d}" for m in windows]
    assert averager.completed == list(windows)
    for merge, steps in windows.items():
        merged = _merged(tmp_path / "run", merge)
        expected = _mean(recorder.after, steps)
        assert list(merged) == list(expected)  # every entry, in the model's order
        torch.testing.assert_close(merged, expected)
        # num_batches_tracked is not averaged: it is the merge step's (one batch per step)
        assert merged["1.num_batches_tracked"].item() == merge
        assert merged["1.num_batches_tracked"].dtype == torch.int64
        info = json.loads(
            (tmp_path / "run" / "merged" / f"step_{merge:06d}" / INFO_FILE).read_text()
        )
        assert (info["first_step"], info["last_step"], info["count"]) == (
            steps[0],
            steps[-1],
            len(steps),
        )


def test_float_buffers_are_averaged_not_taken_at_the_merge_step(tmp_path: Path) -> None:
    recorder, averager = Recorder(), ModelAverager(at_steps=[5], window=4)
    _loop(5, [recorder, averager]).fit(run_dir=tmp_path)
    merged = _merged(tmp_path, 5)
    mean = torch.stack([recorder.after[s]["1.running_mean"] for s in range(2, 6)]).mean(0)
    torch.testing.assert_close(merged["1.running_mean"], mean)
    assert not torch.equal(merged["1.running_mean"], recorder.after[5]["1.running_mean"])
    assert not torch.equal(merged["0.weight"], recorder.after[5]["0.weight"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_sum_is_at_least_float32_and_the_result_keeps_the_dtype(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(dtype)
    data = [(torch.ones(4, 3, dtype=dtype), torch.zeros(4, 2, dtype=dtype))]
    recorder, averager = Recorder(), ModelAverager(at_steps=[4], window=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    TrainingLoop(model, opt, data, _mse, 4, callbacks=[recorder, averager]).fit(run_dir=tmp_path)

    merged = _merged(tmp_path, 4)
    assert merged["weight"].dtype == dtype
    if dtype == torch.float64:  # summed in float64, like the hand-made sum
        total = sum(recorder.after[s]["weight"] for s in range(1, 5))
        torch.testing.assert_close(merged["weight"], total / 4, rtol=0, atol=0)
    else:  # bfloat16 weights summed in float32, then cast back once
        torch.testing.assert_close(merged, _mean(recorder.after, range(1, 5)), rtol=0, atol=0)


def test_merge_steps_past_the_run_never_happen(tmp_path: Path) -> None:
    averager = ModelAverager(at_steps=[3, 50], window=2)
    _loop(6, [averager]).fit(run_dir=tmp_path)
    assert averager.completed == [3]
    assert CheckpointManager(tmp_path / "merged").checkpoints() == [3]


class CountingModel(torch.nn.Sequential):
    """Counts its state_dict() calls: the averager's only per-step cost inside a window."""

    calls = 0

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        CountingModel.calls += 1
        return super().state_dict(*args, **kwargs)


def test_outside_a_window_a_step_reads_no_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = CountingModel(torch.nn.Linear(3, 1))
    CountingModel.calls = 0
    averager = ModelAverager(at_steps=[20], window=3)
    _loop(20, [averager], model=model).fit(run_dir=tmp_path)
    assert CountingModel.calls == 3  # once at each of steps 18, 19 and 20
    assert averager.completed == [20]


# --------------------------------------------------------------------------------------------
# the merged folder


def test_the_merged_folder_is_complete_and_loads_into_a_fresh_model(tmp_path: Path) -> None:
    recorder, averager = Recorder(), ModelAverager(at_steps=[4, 8], window=2)
    artifacts = _loop(9, [recorder, averager]).fit(run_dir=tmp_path / "run")
    root = tmp_path / "run" / "merged"

    assert _tree(root) == [
        "latest",
        "manifest.jsonl",
        "step_000004",
        f"step_000004/{COMPLETE_MARKER}",
        f"step_000004/{STATE_FILE}",
        f"step_000004/{INFO_FILE}",
        "step_000008",
        f"step_000008/{COMPLETE_MARKER}",
        f"step_000008/{STATE_FILE}",
        f"step_000008/{INFO_FILE}",
    ]
    assert not list(tmp_path.rglob("tmp_*"))
    assert (root / "latest").read_text() == "step_000008"
    info = json.loads((root / "step_000008" / INFO_FILE).read_text())
    assert isinstance(info.pop("time"), float)
    assert info == {
        "step": 8,
        "run_key": "run",
        "merge_step": 8,
        "first_step": 7,
        "last_step": 8,
        "count": 2,
        "window": 2,
        "metrics": recorder.metrics[8],
    }
    manager = CheckpointManager(root)
    assert manager.checkpoints() == [4, 8]
    assert [(r.event, r.step, r.kind) for r in manager.history()] == [
        ("save", 4, "regular"),
        ("save", 8, "regular"),
    ]
    assert set(torch.load(root / "step_000008" / STATE_FILE, weights_only=True)) == {"model"}

    fresh = _model()
    fresh.load_state_dict(manager.load("latest")["model"])
    torch.testing.assert_close(fresh.state_dict(), _mean(recorder.after, range(7, 9)))
    assert artifacts.step == 9
    assert artifacts.checkpoints == []  # merges are not the loop's checkpoints


def test_the_newest_merge_is_published_in_the_context(tmp_path: Path) -> None:
    seen: list[Any] = []

    class Reader(Callback):
        priority = -10  # after the averager

        def on_step_end(
            self, state: LoopState, step_idx: int, batch: Any, metrics: dict[str, float]
        ) -> None:
            seen.append(state.ctx.extras.get(EXTRAS_KEY))

    averager = ModelAverager(at_steps=[2, 4], window=1)
    _loop(4, [averager, Reader()]).fit(run_dir=tmp_path / "run")
    root = tmp_path / "run" / "merged"
    assert seen == [None, root / "step_000002", root / "step_000002", root / "step_000004"]


def test_a_bare_loop_without_a_run_dir_merges_into_the_working_directory(
    tmp_path: Path,
) -> None:
    averager = ModelAverager(at_steps=[2], window=2, folder="avg/weights")
    _loop(2, [averager]).fit()
    assert averager.merged == [Path.cwd() / "avg" / "weights" / "step_000002"]
    assert (tmp_path / "avg" / "weights" / "step_000002" / COMPLETE_MARKER).is_file()


def test_the_debris_of_a_merge_killed_mid_write_is_removed(tmp_path: Path) -> None:
    debris = tmp_path / "merged" / "tmp_step_000002"
    debris.mkdir(parents=True)
    (debris / STATE_FILE).write_bytes(b"half a file")
    averager = ModelAverager(at_steps=[2], window=2)
    _loop(2, [averager]).fit(run_dir=tmp_path)
    assert _tree(tmp_path / "merged") == [
        "latest",
        "manifest.jsonl",
        "step_000002",
        f"step_000002/{COMPLETE_MARKER}",
        f"step_000002/{STATE_FILE}",
        f"step_000002/{INFO_FILE}",
    ]


# --------------------------------------------------------------------------------------------
# ephemeral checkpoints


def test_loop_state_blocks_ephemeral_saves_while_any_owner_does() -> None:
    state = LoopState(LogContext("x", Path(".")), torch.nn.Linear(1, 1), None, 1)  # type: ignore[arg-type]
    a, b = object(), object()
    assert not state.ephemeral_checkpoints_blocked
    state.block_ephemeral_checkpoints(a)
    state.block_ephemeral_checkpoints(a)
    state.block_ephemeral_checkpoints(b)
    state.unblock_ephemeral_checkpoints(a)
    assert state.ephemeral_checkpoints_blocked
    state.unblock_ephemeral_checkpoints(b)
    state.unblock_ephemeral_checkpoints(b)  # unblocking twice is fine
    assert not state.ephemeral_checkpoints_blocked


@pytest.mark.parametrize(
    ("params", "saved"),
    [
        (None, list(range(1, 11))),
        # windows 2-4 and 6-8: no ephemeral save after 2, 3, 6, 7; the merge steps save
        ({"at_steps": [4, 8], "window": 3}, [1, 4, 5, 8, 9, 10]),
        # a regular save (every=5) inside the window 3-6 still happens
        ({"at_steps": [6], "window": 4}, [1, 2, 5, 6, 7, 8, 9, 10]),
        # overlapping windows 1-2, 2-4, 4-6, 6-8, 8-10: some window is partial after each step
        ({"every": 2, "window": 3}, [5, 10]),
    ],
    ids=["no-averager", "at_steps", "regular-inside", "overlapping"],
)
def test_ephemeral_saves_are_skipped_inside_a_window(
    tmp_path: Path, params: dict[str, Any] | None, saved: list[int]
) -> None:
    recorder = Recorder()
    callbacks: list[Callback] = (
        [recorder] if params is None else [recorder, ModelAverager(**params)]
    )
    loop = _loop(10, callbacks, checkpoint=CheckpointConfig(ephemeral_every=1, every=5))
    artifacts = loop.fit(run_dir=tmp_path)

    assert [r.step for r in artifacts.checkpoints if r.event == "save"] == saved
    manifest = CheckpointManager(tmp_path / "checkpoints").history()
    assert [r.step for r in manifest if r.event == "save"] == saved
    assert [s for s, due in recorder.due.items() if due] == saved  # checkpoint_due agrees
    assert CheckpointManager(tmp_path / "checkpoints").checkpoints() == [5, 10]


def test_a_resume_inside_a_window_blocks_ephemeral_saves_again(tmp_path: Path) -> None:
    config = CheckpointConfig(ephemeral_every=1, every=5)
    crashing = _loop(10, [ModelAverager(at_steps=[8], window=4)], checkpoint=config)
    crashing.loss_fn = _crashing_mse(7)
    with pytest.raises(Crash):  # in step 7, inside the window 5-8
        crashing.fit(run_dir=tmp_path)
    history = CheckpointManager(tmp_path / "checkpoints").history()
    assert [r.step for r in history if r.event == "save"] == [1, 2, 3, 4, 5]

    loop = _loop(10, [ModelAverager(at_steps=[8], window=4)], checkpoint=config)
    artifacts = loop.fit(run_dir=tmp_path)  # resumes from step 5: 6 and 7 stay blocked
    assert [r.step for r in artifacts.checkpoints if r.event == "save"] == [8, 9, 10]


# --------------------------------------------------------------------------------------------
# resume


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_run_resumed_inside_a_window_merges_the_same_weights(
    tmp_path: Path, async_save: bool
) -> None:
    config = CheckpointConfig(every=3, async_save=async_save)

    def averager() -> ModelAverager:
        return ModelAverager(at_steps=[6, 11], window=4)  # windows 3-6 and 8-11

    straight = averager()
    _loop(12, [straight], checkpoint=config).fit(run_dir=tmp_path / "straight")

    first = averager()
    with pytest.raises(Crash):  # after the save of step 9, inside the window 8-11
        _loop(12, [first], checkpoint=config, loss_fn=_crashing_mse(10)).fit(
            run_dir=tmp_path / "resumed"
        )
    assert first.completed == [6]
    assert CheckpointManager(tmp_path / "resumed" / "checkpoints").checkpoints() == [3, 6, 9]
    saved = CheckpointManager(tmp_path / "resumed" / "checkpoints").load(9)["callbacks"]
    (window,) = saved["ModelAverager"]["windows"]
    assert (window["merge_step"], window["first_step"], window["count"]) == (11, 8, 2)
    assert not (tmp_path / "resumed" / "merged" / "step_000011").exists()

    second = averager()  # a new process: everything comes from the checkpoint
    _loop(12, [second], checkpoint=config).fit(run_dir=tmp_path / "resumed")
    assert second.completed == [6, 11]
    assert second.merged == [tmp_path / "resumed" / "merged" / "step_000011"]
    for step in (6, 11):
        torch.testing.assert_close(
            _merged(tmp_path / "resumed", step),
            _merged(tmp_path / "straight", step),
            rtol=0,
            atol=0,
        )
    info = json.loads((second.merged[0] / INFO_FILE).read_text())
    assert (info["first_step"], info["count"]) == (8, 4)


class SumsOn(Callback):
    """Notes the device of the averager's sums after each step."""

    def __init__(self, averager: ModelAverager) -> None:
        self.averager = averager
        self.devices: set[str] = set()

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: Any, metrics: dict[str, float]
    ) -> None:
        for window in self.averager.state_dict()["windows"]:
            self.devices.update(t.device.type for t in window["sums"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_sums_stay_on_the_device_and_the_merge_is_saved_on_the_cpu(
    tmp_path: Path,
) -> None:
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(3, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 1)
        )

    config = CheckpointConfig(every=3)
    straight = ModelAverager(at_steps=[6], window=4)
    _loop(6, [straight], model=model(), device="cuda:0", checkpoint=config).fit(
        run_dir=tmp_path / "straight"
    )
    with pytest.raises(Crash):  # after the save of step 3, inside the window 3-6
        _loop(
            6,
            [ModelAverager(at_steps=[6], window=4)],
            model=model(),
            device="cuda:0",
            checkpoint=config,
            loss_fn=_crashing_mse(5),
        ).fit(run_dir=tmp_path / "resumed")
    resumed = ModelAverager(at_steps=[6], window=4)
    probe = SumsOn(resumed)
    _loop(6, [resumed, probe], model=model(), device="cuda:0", checkpoint=config).fit(
        run_dir=tmp_path / "resumed"
    )
    assert probe.devices == {"cuda"}  # restored from the CPU onto the model's device
    for run in ("straight", "resumed"):
        saved = torch.load(
            tmp_path / run / "merged" / "step_000006" / STATE_FILE, weights_only=True
        )
        assert {t.device.type for t in saved["model"].values()} == {"cpu"}
    torch.testing.assert_close(_merged(tmp_path / "resumed", 6), _merged(tmp_path / "straight", 6))


def test_the_same_instance_resumes_and_then_serves_a_fresh_run(tmp_path: Path) -> None:
    averager = ModelAverager(at_steps=[5], window=3)
    config = CheckpointConfig(every=4)
    with pytest.raises(Crash):
        _loop(6, [averager], checkpoint=config, loss_fn=_crashing_mse(5)).fit(
            run_dir=tmp_path / "a"
        )
    _loop(6, [averager], checkpoint=config).fit(run_dir=tmp_path / "a")
    _loop(6, [averager]).fit(run_dir=tmp_path / "b")  # fresh: nothing carried over from "a"
    assert averager.merged == [
        tmp_path / "a" / "merged" / "step_000005",
        tmp_path / "b" / "merged" / "step_000005",
    ]
    torch.testing.assert_close(
        _merged(tmp_path / "a", 5), _merged(tmp_path / "b", 5), rtol=0, atol=0
    )


def test_a_state_from_another_step_is_dropped(tmp_path: Path) -> None:
    """A chain's next stage starts at step 0 from the last stage's state: not its windows."""
    donor = ModelAverager(at_steps=[6], window=4)
    _loop(6, [donor, StopAt(4)]).fit(run_dir=tmp_path / "donor")  # stops inside the window 3-6
    state = donor.state_dict()
    assert [w["count"] for w in state["windows"]] == [2]

    recorder, averager = Recorder(), ModelAverager(at_steps=[6], window=4)
    averager.load_state_dict(pickle.loads(pickle.dumps(state)))
    _loop(6, [recorder, averager]).fit(run_dir=tmp_path / "next")
    torch.testing.assert_close(_merged(tmp_path / "next", 6), _mean(recorder.after, range(3, 7)))


# --------------------------------------------------------------------------------------------
# config, registry, pickling


def test_build_makes_a_model_averager() -> None:
    (averager,) = build([{"kind": "model_averager", "params": {"every": 50, "window": 10}}])
    assert isinstance(averager, ModelAverager)
    assert (averager.every, averager.at_steps, averager.window, averager.folder) == (
        50,
        None,
        10,
        "merged",
    )
    (listed,) = build([{"kind": "model_averager", "params": {"at_steps": [9, 3, 9], "window": 2}}])
    assert listed.at_steps == [3, 9]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (
            {"window": 2},
            "ModelAverager needs exactly one of at_steps=[...] (the merge steps) or every=M "
            "(merge each M steps); got at_steps=None, every=None",
        ),
        (
            {"window": 2, "every": 5, "at_steps": [5]},
            "ModelAverager needs exactly one of at_steps=[...] (the merge steps) or every=M "
            "(merge each M steps); got at_steps=[5], every=5",
        ),
        ({"window": 2, "every": 0}, "ModelAverager(every=0): use an int >= 1, or None"),
        (
            {"window": 2, "at_steps": []},
            "ModelAverager(at_steps=[]): use a non-empty list of ints >= 1, or None",
        ),
        (
            {"window": 2, "at_steps": [0, 4]},
            "ModelAverager(at_steps=[0, 4]): use a non-empty list of ints >= 1, or None",
        ),
        (
            {"window": 0, "every": 5},
            "ModelAverager(window=0): use an int >= 1",
        ),
        (
            {"window": 2, "every": 5, "folder": "checkpoints"},
            "ModelAverager(folder='checkpoints'): name a folder inside the run folder, other "
            "than checkpoints, e.g. 'merged'",
        ),
        (
            {"window": 2, "every": 5, "folder": "/tmp/merged"},
            "ModelAverager(folder='/tmp/merged'): name a folder inside the run folder, other "
            "than checkpoints, e.g. 'merged'",
        ),
        (
            {"window": 2, "every": 5, "folder": "../up"},
            "ModelAverager(folder='../up'): name a folder inside the run folder, other than "
            "checkpoints, e.g. 'merged'",
        ),
    ],
)
def test_bad_params_say_what_to_do(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as direct:
        ModelAverager(**params)
    assert str(direct.value) == message
    with pytest.raises(ConfigError) as built:
        build([{"kind": "model_averager", "params": params}])
    assert str(built.value) == message


@pytest.mark.parametrize(
    ("params", "named"),
    [({"every": 5}, "window"), ({"every": 5, "window": 2, "merge_step": 3}, "merge_step")],
)
def test_build_rejects_what_the_config_does_not_declare(params: dict[str, Any], named: str) -> None:
    """The registry words these messages; they name the kind and the param."""
    with pytest.raises(ConfigError, match=f"^model_averager: .*{named}"):
        build([{"kind": "model_averager", "params": params}])


def test_the_config_forbids_extra_fields() -> None:
    with pytest.raises(pydantic.ValidationError):
        ModelAverager.Config(every=5, window=2, merge_last_n_steps=3)  # type: ignore[attr-defined]


def test_the_callback_pickles_with_its_open_windows(tmp_path: Path) -> None:
    averager = ModelAverager(at_steps=[6], window=4)
    _loop(6, [averager, StopAt(4)]).fit(run_dir=tmp_path / "a")  # stops in the window 3-6
    copy = pickle.loads(pickle.dumps(averager))
    assert (copy.at_steps, copy.window, copy.merged) == ([6], 4, [])
    mine, theirs = averager.state_dict(), copy.state_dict()
    assert [w["count"] for w in theirs["windows"]] == [2]
    torch.testing.assert_close(theirs["windows"][0]["sums"], mine["windows"][0]["sums"])
    assert pickle.loads(
        pickle.dumps(build([{"kind": "model_averager", "params": {"every": 2, "window": 2}}]))
    )


# --------------------------------------------------------------------------------------------
# experiments and docs


class Settings(pydantic.BaseModel):
    lr: float = 0.05


def _train(run: Any) -> Any:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=run.config.lr)
    loop = TrainingLoop(model, opt, _batches(), _mse, 6, checkpoint=CheckpointConfig(every=3))
    return loop.fit(run)


def test_each_run_of_an_experiment_gets_its_own_merged_folder(tmp_path: Path) -> None:
    averager = ModelAverager(at_steps=[4, 6], window=2)
    result = Experiment(
        "averaged",
        _train,
        base_config=Settings(),
        arms=[Arm("slow", lr=0.01), Arm("fast", lr=0.1)],
        repeats=2,
        callbacks=[averager],
        store=False,
        output_dir=tmp_path / "runs",
    ).run()

    keys = [r.run_key for r in result.runs]
    runs = tmp_path / "runs" / "averaged"
    assert keys == ["slow-r0", "slow-r1", "fast-r0", "fast-r1"]
    assert averager.merged == [
        runs / key / "merged" / f"step_{m:06d}" for key in keys for m in (4, 6)
    ]
    for key in keys:
        assert CheckpointManager(runs / key / "merged").checkpoints() == [4, 6]
        info = json.loads((runs / key / "merged" / "step_000006" / INFO_FILE).read_text())
        assert (info["run_key"], info["first_step"], info["count"]) == (key, 5, 2)
    slow, fast = (_merged(runs / k, 6)["0.weight"] for k in ("slow-r0", "fast-r0"))
    assert not torch.equal(slow, fast)


def test_the_docs_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(encoding="utf-8"), re.S)
    assert blocks
    namespace: dict[str, object] = {"__name__": "docs"}
    for block in blocks:
        exec(compile(block, str(DOCS), "exec"), namespace)
    out = capsys.readouterr().out
    assert "merged: ['step_000015', 'step_000020']" in out
    assert "checkpoints: [10, 20]" in out
    assert "averaged steps 16 to 20 count 5" in out


def test_merged_state_dict_keeps_module_metadata(tmp_path: Path) -> None:
    averager = ModelAverager(at_steps=[2], window=2)
    _loop(2, [averager]).fit(run_dir=tmp_path)
    merged = _merged(tmp_path, 2)
    assert isinstance(merged, OrderedDict)
    assert merged._metadata["1"]["version"] == 2  # type: ignore[attr-defined]  # BatchNorm's
