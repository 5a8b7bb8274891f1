"""The file callbacks, each through a whole 2 arms x 2 repeats experiment: the exact lines of
`JsonlLogger` and what `replay` rebuilds, `ConfigSaver`'s config.json in the run folder and in
every checkpoint folder, `MetricSaver`'s metrics.json at the right steps; and `build`."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

import lab
import lab.callbacks
from lab import Arm, Callback, CheckpointConfig, Evaluator, Experiment, TrainingLoop
from lab.callbacks.files import ConfigSaver, MetricSaver, read_metrics
from lab.errors import ConfigError
from lab.loggers.jsonl import JsonlLogger, ReplayedError, read_hooks, replay

NUM_STEPS = 6
KEYS = ["a-r0", "a-r1", "b-r0", "b-r1"]


class Config(pydantic.BaseModel):
    lr: float = 0.1
    width: int = 2


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _loop(cfg: Config, callbacks: tuple[Callback, ...] = ()) -> TrainingLoop:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, cfg.width, generator=g)
    data = [(x[:4], x[:4].sum(1, keepdim=True)), (x[4:], x[4:].sum(1, keepdim=True))]
    model = torch.nn.Linear(cfg.width, 1)
    return TrainingLoop(
        model, torch.optim.SGD(model.parameters(), lr=cfg.lr), data, _mse, NUM_STEPS,
        evaluators=[Evaluator("val", lambda m: {"loss": 0.25}, every=3)],
        checkpoint=CheckpointConfig(every=2, keep_last=2), callbacks=callbacks,
    )  # fmt: skip


def _train(run: lab.RunSpec) -> lab.LoopArtifacts:
    return _loop(run.config).fit(run)


def _experiment(name: str, callbacks: list[Callback], **kwargs: Any) -> lab.ExperimentResult:
    return Experiment(
        name, _train, arms=[Arm("a", lr=0.05), Arm("b", lr=0.1)], repeats=2,
        base_config=Config(), callbacks=callbacks, output_dir="runs", **kwargs,
    ).run()  # fmt: skip


class StepMetrics(Callback):
    def __init__(self) -> None:
        self.steps: list[tuple[int, dict[str, float]]] = []
        self.evals: list[tuple[int, str, dict[str, float]]] = []
        self.rows: list[lab.ManifestRow] = []
        self.end: lab.LoopArtifacts | None = None
        self.config: dict[str, Any] | None = None

    def on_run_start(self, ctx: lab.LogContext) -> None:
        self.config = ctx.run_config

    def on_step_end(
        self, state: lab.LoopState, step_idx: int, batch: Any, metrics: dict[str, float]
    ) -> None:
        assert state.step == step_idx
        self.steps.append((step_idx, dict(metrics)))

    def on_eval(
        self, state: lab.LoopState, step_idx: int, eval_name: str, metrics: dict[str, float]
    ) -> None:
        self.evals.append((step_idx, eval_name, dict(metrics)))

    def on_checkpoint(self, state: lab.LoopState, row: lab.ManifestRow) -> None:
        self.rows.append(row)

    def on_train_end(self, state: lab.LoopState, artifacts: lab.LoopArtifacts) -> None:
        self.end = artifacts


def _hooks(path: str | Path) -> list[str]:
    return [json.loads(line)["hook"] for line in Path(path).read_text().splitlines()]


def _same_metrics(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k] for k in a
    )


# --------------------------------------------------------------------------------------------
# JsonlLogger


def test_jsonl_logger_writes_one_line_per_hook_per_run(sqlite_url: str) -> None:
    live = StepMetrics()
    result = _experiment("jsonl", [JsonlLogger(), live], store=sqlite_url)
    assert [r.run_key for r in result.runs] == KEYS
    assert all(r.status == "completed" for r in result.runs)
    runs = Path("runs/jsonl")
    for key in KEYS:
        lines = (runs / key / "hooks.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert {r["run_key"] for r in records} == {key}
        counts = Counter(r["hook"] for r in records)
        # saves at 2, 4, 6; keep_last=2 removes step 2 when step 6 commits: 4 rows
        assert counts == {
            "on_run_start": 1, "on_train_start": 1, "pre_step": NUM_STEPS,
            "on_step_end": NUM_STEPS, "on_eval": 2, "on_checkpoint": 4, "on_train_end": 1,
            "on_run_end": 1,
        }  # fmt: skip
        assert records[0]["hook"] == "on_run_start" and records[-1]["hook"] == "on_run_end"
        assert records[-1]["status"] == "completed"
        assert records[0]["run_config"] == {"lr": 0.05 if key.startswith("a") else 0.1,
                                            "width": 2}  # fmt: skip
        steps = [r for r in records if r["hook"] == "on_step_end"]
        assert [r["step_idx"] for r in steps] == list(range(1, NUM_STEPS + 1))
        assert set(steps[0]["metrics"]) == {"loss", "lr", "grad_norm", "step_time"}
        pre = next(r for r in records if r["hook"] == "pre_step")
        assert pre["batch"] == [
            {"tensor": [4, 2], "dtype": "float32"},
            {"tensor": [4, 1], "dtype": "float32"},
        ]  # shapes, never the data
        ckpt = [r["row"] for r in records if r["hook"] == "on_checkpoint"]
        assert [(c["event"], c["step"], c["path"]) for c in ckpt] == [
            ("save", 2, "step_000002"), ("save", 4, "step_000004"),
            ("save", 6, "step_000006"), ("remove", 2, "step_000002"),
        ]  # fmt: skip
        assert all(isinstance(r["time"], float) for r in records)
    exp_lines = _hooks(runs / "hooks.jsonl")
    assert exp_lines == [
        "on_experiment_start", "on_group_start", "on_group_start", "on_experiment_end", "close",
    ]  # fmt: skip


def test_replay_reproduces_what_a_live_callback_saw() -> None:
    live = StepMetrics()
    _experiment("replay", [JsonlLogger(), live], store=False)
    per_run = len(live.steps) // 4
    for i, key in enumerate(KEYS):
        again = StepMetrics()
        fired = replay(Path("runs/replay") / key / "hooks.jsonl", again)
        assert Counter(fired) == {
            "on_run_start": 1, "on_train_start": 1, "on_step_end": NUM_STEPS, "on_eval": 2,
            "on_checkpoint": 4, "on_train_end": 1,
        }  # fmt: skip
        expected = live.steps[i * per_run : (i + 1) * per_run]
        assert [s for s, _ in again.steps] == [s for s, _ in expected]
        assert all(
            _same_metrics(a, b) for (_, a), (_, b) in zip(again.steps, expected, strict=True)
        )
        assert again.evals == live.evals[i * 2 : (i + 1) * 2]
        assert again.rows == live.rows[i * 4 : (i + 1) * 4]  # ManifestRow rebuilt as recorded
        assert again.config is not None and again.config["width"] == 2
        assert again.end is not None and again.end.step == NUM_STEPS
        assert again.end.model is None  # not rebuilt: the log holds no weights


def test_replay_of_a_subset_and_of_an_error() -> None:
    class Errors(Callback):
        def __init__(self) -> None:
            self.errors: list[BaseException] = []

        def on_error(self, ctx: lab.LogContext, exc: BaseException) -> None:
            self.errors.append(exc)

    calls = []

    def diverges(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise FloatingPointError("diverged")
        return _mse(model, batch)

    loop = _loop(Config(), callbacks=(JsonlLogger(),))
    loop.loss_fn = diverges
    with pytest.raises(FloatingPointError, match="diverged"):
        loop.fit(run_dir="bare")
    hooks = _hooks("bare/hooks.jsonl")
    assert hooks == [
        "on_run_start", "on_train_start", "pre_step", "on_step_end", "pre_step", "on_error",
        "on_run_end",
    ]  # fmt: skip
    # the experiment a bare fit opens is logged beside its run folder
    assert _hooks("hooks.jsonl") == [
        "on_experiment_start", "on_group_start", "on_experiment_end", "close",
    ]  # fmt: skip
    errors = Errors()
    assert replay("bare/hooks.jsonl", errors, hooks=["on_error"]) == ["on_error"]
    assert [type(e) for e in errors.errors] == [ReplayedError]
    assert str(errors.errors[0]) == "FloatingPointError: diverged"
    with pytest.raises(ConfigError, match="cannot rebuild"):
        replay("bare/hooks.jsonl", errors, hooks=["pre_step"])


def test_jsonl_logger_on_a_bare_loop_writes_into_run_dir_or_cwd(tmp_path: Path) -> None:
    _loop(Config(), callbacks=(JsonlLogger(),)).fit(run_dir=tmp_path / "solo")
    hooks = _hooks(tmp_path / "solo/hooks.jsonl")
    assert hooks[:2] == ["on_run_start", "on_train_start"]
    assert hooks[-2:] == ["on_train_end", "on_run_end"]
    model = torch.nn.Linear(2, 1)
    TrainingLoop(
        model, torch.optim.SGD(model.parameters(), lr=0.1),
        [(torch.ones(2, 2), torch.ones(2, 1))], _mse, 2, callbacks=[JsonlLogger("log.jsonl")],
    ).fit()  # fmt: skip
    assert _hooks("log.jsonl") == [  # in the working directory
        "on_run_start", "on_train_start", "pre_step", "on_step_end", "pre_step", "on_step_end",
        "on_train_end", "on_run_end",
    ]  # fmt: skip
    # the experiment log of each fit: beside the run folder (the first), and here (the second)
    assert _hooks("hooks.jsonl") == [
        "on_experiment_start", "on_group_start", "on_experiment_end", "close",
    ] * 2  # fmt: skip
    assert not Path("loop").exists()  # the run has no folder of its own


# --------------------------------------------------------------------------------------------
# ConfigSaver


def test_config_saver_writes_the_run_config_into_the_run_and_each_checkpoint(
    sqlite_url: str,
) -> None:
    result = _experiment("cfg", [ConfigSaver()], store=sqlite_url, seed=7)
    for run in result.runs:
        folder = Path("runs/cfg") / run.run_key
        expected = {
            "experiment": "cfg", "run_key": run.run_key, "arm": run.arm,
            "repeat": run.repeat, "stage": 0, "seed": 7 + run.repeat,
            "config": {"lr": 0.05 if run.arm == "a" else 0.1, "width": 2},
        }  # fmt: skip
        assert json.loads((folder / "config.json").read_text()) == expected
        kept = sorted(p.name for p in (folder / "checkpoints").glob("step_*"))
        assert kept == ["step_000004", "step_000006"]
        for name in kept:
            assert json.loads((folder / "checkpoints" / name / "config.json").read_text()) == (
                expected
            )
        assert not list(folder.rglob("*.tmp-*"))  # atomic writes leave nothing behind


def test_config_saver_on_a_bare_loop(tmp_path: Path) -> None:
    _loop(Config(), callbacks=(ConfigSaver(config={"note": "bare"}),)).fit(run_dir=tmp_path / "x")
    doc = json.loads((tmp_path / "x/config.json").read_text())
    assert doc["config"] == {"note": "bare"} and doc["run_key"] == "x"
    assert json.loads((tmp_path / "x/checkpoints/step_000006/config.json").read_text()) == doc


# --------------------------------------------------------------------------------------------
# MetricSaver


class Snapshots(Callback):
    """Reads metrics.json right after MetricSaver wrote it (MetricSaver has priority 0)."""

    priority = -1

    def __init__(self) -> None:
        self.seen: dict[tuple[str, int], dict[str, Any]] = {}

    def on_step_end(self, state: lab.LoopState, step_idx: int, batch: Any, metrics: dict) -> None:
        path = state.ctx.run_dir / "metrics.json"
        if path.exists():
            self.seen[(state.ctx.run_key, step_idx)] = json.loads(path.read_text())


def test_metric_saver_writes_at_the_interval_fixed_steps_and_the_end(sqlite_url: str) -> None:
    live, snaps = StepMetrics(), Snapshots()
    result = _experiment(
        "metrics", [MetricSaver(every=4, at_steps=[1]), live, snaps], store=sqlite_url
    )
    for i, run in enumerate(result.runs):
        steps = dict(live.steps[i * NUM_STEPS : (i + 1) * NUM_STEPS])
        key = run.run_key
        # step 1 (fixed): its metrics; 2, 3 unchanged; step 4 (every): step 4's plus val/
        first = snaps.seen[(key, 1)]
        assert first["step"] == 1 and first["final"] is False and first["status"] == "running"
        assert _same_metrics(first["metrics"], steps[1])
        assert snaps.seen[(key, 2)] == snaps.seen[(key, 3)] == first
        fourth = snaps.seen[(key, 4)]
        assert fourth["step"] == 4
        assert _same_metrics(fourth["metrics"], {**steps[4], "val/loss": 0.25})
        assert snaps.seen[(key, 6)] == fourth  # 5 and 6 are not due
        final = json.loads((Path("runs/metrics") / key / "metrics.json").read_text())
        assert final == {
            "run_key": key, "step": NUM_STEPS, "final": True, "status": "completed",
            "metrics": json.loads(json.dumps(run.metrics)),
        }  # fmt: skip
        assert final["metrics"]["val/loss"] == 0.25


def test_metric_saver_filters_keys_and_records_a_failed_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def train(run: lab.RunSpec) -> lab.LoopArtifacts:
        if run.repeat == 1:
            raise RuntimeError("out of memory")
        return _loop(run.config).fit(run)

    Experiment(
        "mf", train, repeats=2, base_config=Config(), store=False,
        callbacks=[MetricSaver(every=1, keys=["loss", "val/*"])],
    ).run()  # fmt: skip
    ok = json.loads(Path("runs/mf/base-r0/metrics.json").read_text())
    assert set(ok["metrics"]) == {"loss", "val/loss"} and ok["status"] == "completed"
    failed = json.loads(Path("runs/mf/base-r1/metrics.json").read_text())
    assert failed == {"run_key": "base-r1", "step": 0, "final": True, "status": "failed",
                      "metrics": {}}  # fmt: skip


# --------------------------------------------------------------------------------------------
# the registry


def test_build_makes_the_file_callbacks_and_lists_valid_params() -> None:
    saver, logger, cfg = lab.callbacks.build(
        [
            {"kind": "metric_saver", "params": {"every": 5}},
            {"kind": "jsonl_logger"},
            {"kind": "config_saver", "params": {"fname": "cfg.json"}},
        ]
    )
    assert isinstance(saver, MetricSaver) and saver.every == 5 and saver.at_steps == frozenset()
    assert isinstance(logger, JsonlLogger) and logger.path is None
    assert isinstance(cfg, ConfigSaver) and cfg.fname == "cfg.json"
    with pytest.raises(ConfigError) as err:
        lab.callbacks.build([{"kind": "metric_saver", "params": {"interval": 5}}])
    assert str(err.value) == (
        "metric_saver: unknown params ['interval']; valid: at_steps, every, fname, keys"
    )
    with pytest.raises(ConfigError, match="every"):
        lab.callbacks.build([{"kind": "metric_saver", "params": {"every": 0}}])


def test_file_callbacks_reject_bad_params() -> None:
    with pytest.raises(ConfigError, match="every"):
        MetricSaver(every=0)
    with pytest.raises(ConfigError, match="file name"):
        ConfigSaver(fname="a/b.json")


def test_the_file_callbacks_pickle_for_worker_processes(tmp_path: Path) -> None:
    import pickle

    logger = JsonlLogger()
    ctx = lab.LogContext("e", tmp_path, run_key="r")
    logger.on_run_start(ctx)  # holds an open file now
    copy = pickle.loads(pickle.dumps(logger))
    assert copy._run is None and logger._run is not None  # the copy opens its own
    copy.on_error(ctx, RuntimeError("x"))
    copy.close()
    logger.close()
    assert _hooks(tmp_path / "r/hooks.jsonl") == ["on_run_start", "on_error", "close", "close"]
    for cb in (ConfigSaver(), MetricSaver(every=2)):
        assert type(pickle.loads(pickle.dumps(cb))) is type(cb)


def _strict_json(text: str) -> Any:
    """Parse as a strict JSON reader (jq, JavaScript) would: no NaN/Infinity tokens."""

    def refuse(token: str) -> None:
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def test_nan_and_inf_are_written_as_strict_json_and_read_back_as_floats(tmp_path: Path) -> None:
    odd = {1: math.nan, 2: math.inf, 3: -math.inf}

    def loss_fn(m: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        loss_fn.step += 1  # type: ignore[attr-defined]
        return _mse(m, batch), {"odd": odd.get(loss_fn.step, 0.5)}  # type: ignore[attr-defined]

    loss_fn.step = 0  # type: ignore[attr-defined]
    x = torch.ones(4, 2)
    model = torch.nn.Linear(2, 1)
    TrainingLoop(
        model, torch.optim.SGD(model.parameters(), lr=0.1), [(x, x.sum(1, keepdim=True))],
        loss_fn, 3, callbacks=[JsonlLogger(), MetricSaver(at_steps=[1])],
        evaluators=[Evaluator("val", lambda m: {"loss": math.nan}, every=2)],
    ).fit(run_dir=tmp_path / "run")  # fmt: skip
    lines = (tmp_path / "run" / "hooks.jsonl").read_text().splitlines()
    raw = [_strict_json(line) for line in lines]  # every line is strict JSON
    steps = [r["metrics"]["odd"] for r in raw if r["hook"] == "on_step_end"]
    assert steps == ["NaN", "Infinity", "-Infinity"]
    assert [r["metrics"] for r in raw if r["hook"] == "on_eval"] == [{"loss": "NaN"}]
    read = [r for r in read_hooks(tmp_path / "run" / "hooks.jsonl") if r["hook"] == "on_step_end"]
    values = [r["metrics"]["odd"] for r in read]
    assert math.isnan(values[0]) and values[1:] == [math.inf, -math.inf]
    seen = StepMetrics()
    replay(tmp_path / "run" / "hooks.jsonl", seen, hooks=["on_step_end", "on_eval"])
    assert math.isnan(seen.steps[0][1]["odd"]) and seen.steps[2][1]["odd"] == -math.inf
    assert math.isnan(seen.evals[0][2]["loss"])
    final = _strict_json((tmp_path / "run" / "metrics.json").read_text())
    assert final["final"] is True and final["metrics"]["odd"] == "-Infinity"
    assert final["metrics"]["val/loss"] == "NaN"
    again = read_metrics(tmp_path / "run" / "metrics.json")
    assert again["metrics"]["odd"] == -math.inf and math.isnan(again["metrics"]["val/loss"])
