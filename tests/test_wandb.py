"""`WandbLogger` with the real wandb in offline mode: what lands in each offline run's
``run-<id>.wandb`` log, read back record by record, and a resumed run that continues the
same wandb run id."""

from __future__ import annotations

import json
import math
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

import lab
from lab import Arm, CheckpointConfig, Evaluator, Experiment, TrainingLoop
from lab.callbacks import build
from lab.errors import ConfigError
from lab.loggers.wandb import ID_FILE, WandbLogger, run_id_for
from lab.loop.evals import EvalResult
from lab.media import histogram, write_image

pytest.importorskip("wandb")

STEPS = 6
CRASH: set[str] = set()  # run keys whose training raises in step 4


# --------------------------------------------------------------------------------------------
# reading an offline run back


def _records(path: Path) -> list[Any]:
    """Every record of a ``.wandb`` file: wandb's LevelDB-style log of protobuf `Record`s
    (a 7-byte file header, 32 KiB blocks, each chunk a 7-byte header: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 2):  # full, first
            buf = chunk
        elif kind in (3, 4):  # middle, last
            buf += chunk
        else:
            continue
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
    return out


def _items(items: Any) -> dict[str, Any]:
    """A history row or summary update as a (nested) dict, values decoded from JSON."""
    row: dict[str, Any] = {}
    for item in items:
        keys = [item.key] if item.key else list(item.nested_key)
        at = row
        for k in keys[:-1]:
            at = at.setdefault(k, {})
        at[keys[-1]] = json.loads(item.value_json)
    return row


class OfflineRun:
    """One offline run folder, parsed: its run record, history rows, summary, exit code."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        (log,) = folder.glob("run-*.wandb")
        self.history: list[dict[str, Any]] = []
        self.summary: dict[str, Any] = {}
        self.exit_code: int | None = None
        self.metrics: list[tuple[str, str]] = []  # (name or glob, its step metric)
        for rec in _records(log):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                self.run = rec.run
                self.config = {i.key: json.loads(i.value_json) for i in rec.run.config.update}
            elif kind == "history":
                self.history.append(_items(rec.history.item))
            elif kind == "summary":
                self.summary.update(_items(rec.summary.update))
            elif kind == "exit":
                self.exit_code = rec.exit.exit_code
            elif kind == "metric":  # define_metric
                m = rec.metric
                self.metrics.append((m.name or m.glob_name, m.step_metric))

    def steps(self, key: str) -> list[int]:
        return [row["trainer/step"] for row in self.history if key in row]


def _offline_runs(root: Path) -> list[OfflineRun]:
    """The offline runs under `root`, read once wandb has written them out: `finish` returns
    before wandb's service has flushed its log to disk; `teardown` waits for it."""
    import wandb

    wandb.teardown()
    return [OfflineRun(f) for f in sorted((root / "wandb").glob("offline-run-*"))]


# --------------------------------------------------------------------------------------------
# a tiny experiment


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _bench(model: torch.nn.Module) -> EvalResult:
    preds = [
        {"example_id": f"e{i}", "input": [i, 1], "output": 0.5, "target": 1.0, "score": 1.0}
        for i in range(3)
    ]
    return EvalResult("bench", {"acc": 1.0}, breakdowns={"easy": {"acc": 1.0}}, predictions=preds)


def _train(run: lab.RunSpec) -> lab.LoopArtifacts:
    x = torch.randn(16, 2)
    batches = [(x[i : i + 4], x[i : i + 4].sum(1, keepdim=True)) for i in range(0, 16, 4)]
    model = torch.nn.Linear(2, 1)

    calls = [0]  # loss_fn runs once per step (the evaluator calls _mse itself)

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls[0] += 1
        if run.run_key in CRASH and calls[0] == 4:  # after the checkpoint at step 3
            raise RuntimeError("node lost")
        return _mse(m, batch)

    loop = TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=run.config.lr),
        batches,
        loss_fn,
        STEPS,
        evaluators=[Evaluator("val", lambda m: {"loss": _mse(m, batches[0]).item()}, every=3)],
        checkpoint=CheckpointConfig(every=3),
    )
    return loop.fit(run)


class Config(pydantic.BaseModel):
    lr: float = 0.05


def _experiment(name: str = "wb-sweep", **logger: Any) -> lab.ExperimentResult:
    return Experiment(
        name,
        _train,
        base_config=Config(),
        arms=[Arm("slow", lr=0.01), Arm("fast", lr=0.1)],
        repeats=2,
        callbacks=[WandbLogger("lab-test", log_every=2, **logger)],
        benchmarks=[Evaluator("bench", _bench)],
        store="sqlite:///lab.db",
        strict=True,
    ).run()


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Real wandb, offline, writing under the test's folder; torn down after the test, since
    wandb reads its environment once per process setup and would keep the old folder."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    wandb.teardown()
    yield tmp_path
    wandb.teardown()


# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_arms_two_repeats_then_a_resumed_run_continues_its_wandb_run(offline: Path) -> None:
    CRASH.add("fast-r1")
    try:
        first = _experiment()
    finally:
        CRASH.clear()
    assert [r.status for r in first.runs] == ["completed", "completed", "completed", "failed"]

    runs = {r.run.display_name: r for r in _offline_runs(offline)}
    assert sorted(runs) == ["fast-r0", "fast-r1", "slow-r0", "slow-r1"]
    for key, run in runs.items():
        arm = key.split("-")[0]
        kept = Path("runs/wb-sweep", key, ID_FILE).read_text().strip()  # in the run folder
        assert run.run.run_id == kept and kept.startswith("lab-")
        assert (run.run.run_group, run.run.job_type, run.run.project) == (arm, arm, "lab-test")
        assert run.config["lr"] == {"slow": 0.01, "fast": 0.1}[arm]

    done = runs["slow-r0"]
    assert done.exit_code == 0
    # every chart's x axis is the training step, not wandb's own _step
    assert done.metrics == [("trainer/step", ""), ("*", "trainer/step")]
    assert done.steps("loss") == [2, 3, 4, 6]  # every 2nd step, and before each checkpoint
    assert done.steps("val/loss") == [3, 6]
    assert done.steps("bench/predictions") == [6]  # after training, at the last step
    summary = done.summary
    assert summary["lab/status"] == "completed"
    assert summary["bench/acc"] == 1.0 and summary["bench/easy/acc"] == 1.0
    assert summary["loss"] == pytest.approx(first.runs[0].metrics["loss"])
    assert summary["checkpoints/latest"]["step"] == STEPS
    step3 = summary["checkpoints/step_3"]
    assert step3["event"] == "save" and Path(step3["path"]).is_dir()
    table = summary["bench/predictions"]
    assert table["_type"] == "table-file" and table["nrows"] == 3
    saved = json.loads((done.folder / "files" / table["path"]).read_text())
    assert saved["columns"] == ["example_id", "input", "output", "target", "score"]
    assert saved["data"][1] == ["e1", "[1, 1]", 0.5, 1.0, 1.0]

    crashed = runs["fast-r1"]
    assert crashed.exit_code == 1
    assert crashed.summary["lab/status"] == "failed"
    assert crashed.summary["lab/error"] == "RuntimeError: node lost"
    assert crashed.steps("loss") == [2, 3]

    # Run the experiment again: only fast-r1 runs, from its step-3 checkpoint, and it
    # continues the same wandb run id.
    second = _experiment()
    assert [r.status for r in second.runs] == ["completed"] * 4
    again = [r for r in _offline_runs(offline) if r.folder.name not in {
        v.folder.name for v in runs.values()
    }]  # fmt: skip
    (resumed,) = again
    assert resumed.run.run_id == crashed.run.run_id == run_id_for(Path("runs/wb-sweep/fast-r1"))
    assert resumed.exit_code == 0
    assert resumed.steps("loss") == [4, 6]  # picks up after the checkpoint at step 3
    assert resumed.summary["lab/status"] == "completed"


@pytest.mark.slow
def test_a_bare_loop_gets_one_run_and_ids_land_in_the_context(offline: Path) -> None:
    seen: dict[str, Any] = {}

    class Peek(lab.Callback):
        def on_step_end(self, state: lab.LoopState, step_idx: int, batch: Any, m: Any) -> None:
            threads = [t.name for t in threading.enumerate()]
            seen["sender"] = [name for name in threads if name.startswith("lab-wandb-")]

        def on_train_end(self, state: lab.LoopState, artifacts: lab.LoopArtifacts) -> None:
            seen.update(state.ctx.ids, **state.ctx.extras)

    model = torch.nn.Linear(2, 1)
    data = [(torch.ones(4, 2), torch.zeros(4, 1))]
    TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        _mse,
        3,
        callbacks=[WandbLogger("lab-test", checkpoints=None, log_every=1), Peek()],
    ).fit(run_dir=offline / "bare")
    (run,) = _offline_runs(offline)
    assert seen["wandb:run_id"] == run.run.run_id == run_id_for(offline / "bare")
    assert seen["wandb:url"] is None  # offline
    assert run.steps("loss") == [1, 2, 3] and run.exit_code == 0
    # The rows were sent by the run's own sender thread, which is gone after the fit.
    assert seen["sender"] == [f"lab-wandb-{run.run.run_id}"]
    assert not [t for t in threading.enumerate() if t.name.startswith("lab-wandb-")]


def test_a_bare_fit_is_one_wandb_run_of_group_loop_ended_with_its_status(offline: Path) -> None:
    def fit(run_dir: Path, fail_at: int | None) -> None:
        model = torch.nn.Linear(2, 1)
        steps = iter(range(1, 4))

        def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
            if next(steps) == fail_at:
                raise FloatingPointError("loss went NaN")
            return _mse(m, batch)

        TrainingLoop(
            model, torch.optim.SGD(model.parameters(), lr=0.1),
            [(torch.ones(4, 2), torch.zeros(4, 1))], loss_fn, 3,
            callbacks=[WandbLogger("lab-test", checkpoints=None, log_every=1)],
        ).fit(run_dir=run_dir)  # fmt: skip

    fit(offline / "good", None)
    with pytest.raises(FloatingPointError, match="loss went NaN"):
        fit(offline / "bad", 2)
    runs = {r.run.display_name: r for r in _offline_runs(offline)}
    assert sorted(runs) == ["bad", "good"]
    for key, run in runs.items():
        assert run.run.run_id == run_id_for(offline / key)  # kept in its run folder
        assert (run.run.run_group, run.run.job_type) == ("loop", "")  # no arm
    good, bad = runs["good"], runs["bad"]
    assert (good.exit_code, good.summary["lab/status"]) == (0, "completed")
    assert good.steps("loss") == [1, 2, 3] and "loss" in good.summary
    assert (bad.exit_code, bad.summary["lab/status"]) == (1, "failed")
    assert bad.summary["lab/error"] == "FloatingPointError: loss went NaN"
    assert bad.steps("loss") == [1]


def test_config_and_registry_need_no_wandb_run() -> None:
    (built,) = build([{"kind": "wandb_logger", "params": {"project": "p", "log_every": 5}}])
    assert isinstance(built, WandbLogger) and built.log_every == 5
    assert built.checkpoints == "summary" and built.predictions_table
    with pytest.raises(ConfigError, match="log_every"):
        WandbLogger("p", log_every=0)
    with pytest.raises(ConfigError, match="checkpoints"):
        WandbLogger("p", checkpoints="s3")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="checkpoints"):
        build([{"kind": "wandb_logger", "params": {"project": "p", "checkpoints": "x"}}])
    assert run_id_for(None) != run_id_for(None)  # no folder: nothing to continue


@pytest.mark.slow
def test_checkpoints_as_reference_artifacts(offline: Path) -> None:
    model = torch.nn.Linear(2, 1)
    data = [(torch.ones(4, 2), torch.zeros(4, 1))]
    TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        _mse,
        4,
        checkpoint=CheckpointConfig(every=2, keep_last=1),
        callbacks=[WandbLogger("lab-test", checkpoints="artifact")],
    ).fit(run_dir=offline / "bare")
    (run,) = _offline_runs(offline)
    log = next(run.folder.glob("run-*.wandb"))
    arts = [r.artifact for r in _records(log) if r.WhichOneof("record_type") == "artifact"]
    assert [(a.type, sorted(a.aliases)) for a in arts] == [
        ("checkpoint", ["latest", "step-2"]),
        ("checkpoint", ["latest", "step-4"]),
    ]
    assert all(a.name == f"{run.run.run_id}-checkpoint" for a in arts)
    refs = sorted(c.ref for c in arts[1].manifest.contents)  # references, not uploaded bytes
    assert (offline / "bare" / "checkpoints" / "step_000004" / "state.pt").as_uri() in refs


@pytest.mark.slow
def test_nan_and_inf_are_logged_as_data(offline: Path) -> None:
    model = torch.nn.Linear(2, 1)
    data = [(torch.ones(4, 2), torch.zeros(4, 1))]
    odd = {1: math.nan, 2: math.inf, 3: -math.inf}

    def loss_fn(m: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        loss_fn.step += 1  # type: ignore[attr-defined]
        return _mse(m, batch), {"odd": odd.get(loss_fn.step, 1.0)}  # type: ignore[attr-defined]

    loss_fn.step = 0  # type: ignore[attr-defined]
    TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        loss_fn,
        4,
        evaluators=[Evaluator("val", lambda m: {"loss": math.nan}, every=2)],
        callbacks=[WandbLogger("lab-test", checkpoints=None, log_every=1)],
    ).fit(run_dir=offline / "bare")
    (run,) = _offline_runs(offline)
    values = [row["odd"] for row in run.history if "odd" in row]
    assert math.isnan(values[0]) and values[1:] == [math.inf, -math.inf, 1.0]
    val = [row["val/loss"] for row in run.history if "val/loss" in row]
    assert len(val) == 2 and all(math.isnan(v) for v in val)


def test_the_wandb_id_follows_the_run_folder(tmp_path: Path) -> None:
    first = run_id_for(tmp_path / "sweep" / "a-r0")
    assert (tmp_path / "sweep" / "a-r0" / ID_FILE).read_text() == first + "\n"
    assert run_id_for(tmp_path / "sweep" / "a-r0") == first  # a resume of that folder
    # the same names elsewhere (a fresh store and output folder) are another wandb run
    assert run_id_for(tmp_path / "elsewhere" / "sweep" / "a-r0") != first
    assert [p.name for p in (tmp_path / "sweep" / "a-r0").iterdir()] == [ID_FILE]  # no tmp left


def test_the_experiments_tags_and_notes_go_to_each_wandb_run(offline: Path) -> None:
    def train(run: lab.RunSpec) -> dict[str, float]:
        return {"loss": 1.0}

    Experiment(
        "wb-tags", train, repeats=2, tags=["baseline", "v1"], notes="why",
        callbacks=[WandbLogger("lab-test")], store=False,
    ).run()  # fmt: skip
    runs = _offline_runs(offline)
    assert [(list(r.run.tags), r.run.notes) for r in runs] == [(["baseline", "v1"], "why")] * 2


class _LogMedia(lab.Callback):
    """At step 2: a histogram with NaN and inf in it and an image, through `on_media`."""

    def __init__(self, run: lab.RunSpec) -> None:
        self.run = run

    def on_step_end(self, state: lab.LoopState, step_idx: int, batch: Any, m: Any) -> None:
        if step_idx != 2:
            return
        values = [0.0, 0.25, 1.0, math.nan, math.inf, -math.inf, -math.inf]
        pixels = torch.zeros(3, 4, 5)
        media = {
            "weights": histogram(values, bins=2),
            "samples": write_image(state.ctx.folder, "samples", step_idx, pixels),
        }
        self.run.dispatcher.fire("on_media", state, step_idx, media)


def _train_with_media(run: lab.RunSpec) -> lab.LoopArtifacts:
    model = torch.nn.Linear(2, 1)
    data = [(torch.ones(4, 2), torch.zeros(4, 1))]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    callbacks = [_LogMedia(run)]
    return TrainingLoop(model, optimizer, data, _mse, 3, callbacks=callbacks).fit(run)


@pytest.mark.slow
def test_histograms_and_images_go_to_wandb_as_its_own_types(offline: Path) -> None:
    Experiment(
        "wb-media",
        _train_with_media,
        base_config=Config(),
        callbacks=[WandbLogger("lab-test", log_every=1, checkpoints=None)],
        store="sqlite:///lab.db",
        strict=True,
    ).run()
    (run,) = _offline_runs(offline)
    (row,) = [r for r in run.history if "weights" in r]
    assert row["trainer/step"] == 2
    assert row["weights"] == {"_type": "histogram", "values": [2, 1], "bins": [0.0, 0.5, 1.0]}
    assert (row["weights/nan"], row["weights/posinf"], row["weights/neginf"]) == (1, 1, 2)
    image = row["samples"]
    assert (image["_type"], image["width"], image["height"]) == ("image-file", 5, 4)
    assert (run.folder / "files" / image["path"]).is_file()  # wandb's own copy of the PNG
