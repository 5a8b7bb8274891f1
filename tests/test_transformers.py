"""`lab.integrations.transformers`: a Hugging Face `Trainer` (a tiny BERT built from its
config, generated data, CPU) recorded by `LabCallback` into a real SQLite store: the rows a
`RunHandle` loop records for the same training, the hooks in their order, resume after a
SIGKILL, failure, and arms x repeats over `TrainingArguments` fields."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch
import transformers

import lab
from lab.errors import ConfigError
from lab.integrations.transformers import CONFIG_FILE, LabCallback, train, training_args
from tests import tiny_transformers as tiny
from tests import warm
from tests.recorder import EVERY_HOOK, Labels
from tests.store_rows import rows as _rows

ROOT = Path(__file__).resolve().parent.parent
TIMING = ("runtime", "samples_per_second", "steps_per_second")


class Every(Labels, hooks=EVERY_HOOK):
    """Every hook, as `Labels` notes it."""


class Reported(transformers.TrainerCallback):
    """What the Trainer reports to any callback: its logs and evaluations at their steps."""

    def __init__(self) -> None:
        self.logs: list[tuple[int, dict[str, float]]] = []
        self.evals: list[tuple[int, dict[str, float]]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        self.logs.append((state.global_step, dict(logs)))

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None,
                    **kw: Any) -> None:  # fmt: skip
        self.evals.append((state.global_step, dict(metrics)))


def _strip(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {k[len(prefix) + 1 :]: v for k, v in metrics.items() if k.startswith(prefix + "_")}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One standalone fit with predictions, read by the tests that only look at it."""
    tmp = tmp_path_factory.mktemp("fit")
    every, reported = Every(), Reported()
    callback = LabCallback(experiment="bert", store=f"sqlite:///{tmp / 'lab.db'}", quiet=True,
                           output_dir=tmp / "runs", callbacks=[every])  # fmt: skip
    trainer = tiny.trainer(tmp / "out", [callback, reported])
    output = train(trainer, predict={"test": tiny.examples(8, 3)})
    test = trainer.predict(tiny.examples(8, 3), metric_key_prefix="test")
    return {"tmp": tmp, "every": every, "reported": reported, "output": output, "test": test}


def test_the_rows_are_those_a_run_handle_loop_records_for_the_same_training(
    fitted: dict[str, Any],
) -> None:
    tmp, reported = fitted["tmp"], fitted["reported"]
    steps = {step: m for step, m in reported.logs
             if not any(k.endswith("_runtime") for k in m)}  # fmt: skip
    closing = next(m for _, m in reported.logs if "train_runtime" in m)
    evals = dict(reported.evals)
    test = fitted["test"]
    rows = [{"example_id": f"ex{i}", "output": int(test.predictions[i].argmax()),
             "target": int(test.label_ids[i]),
             "score": float(torch.softmax(torch.tensor(test.predictions[i]), 0).max())}
            for i in range(8)]  # fmt: skip
    by_hand = tmp / "by_hand.db"
    with lab.start_run("bert", store=f"sqlite:///{by_hand}", quiet=True,
                       output_dir=tmp / "by_hand") as run:  # fmt: skip
        model = torch.nn.Linear(1, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with lab.RunHandle(run, model, opt, num_steps=6) as loop:
            for step in loop.steps():
                loop.end_step(steps[step])
                if step in evals:
                    loop.log_eval("eval", _strip(evals[step], "eval"))
            loop.log_eval("train", {**_strip(closing, "train"),
                                    "total_flos": closing["total_flos"]})  # fmt: skip
            loop.log_eval("test", _strip(test.metrics, "test"), predictions=rows)
    db = tmp / "lab.db"
    for sql in (
        "SELECT step, key, value FROM metrics WHERE key NOT LIKE '%second' AND key NOT LIKE "
        "'%runtime' ORDER BY step, key",
        "SELECT name, step FROM evals ORDER BY eval_id",
        "SELECT example_id, output, target FROM predictions ORDER BY idx",
    ):
        assert _rows(db, sql) == _rows(by_hand, sql), sql
    (scores,) = zip(*_rows(db, "SELECT score FROM predictions ORDER BY idx"), strict=True)
    assert scores == pytest.approx([r["score"] for r in rows], rel=1e-6)
    loss = {step: m["eval_loss"] for step, m in reported.evals}
    out = tmp / "out"
    assert _rows(db, "SELECT step, path, event, metrics, reason FROM checkpoints") == [
        (2, f"{out}/checkpoint-2", "save", json.dumps({"eval/loss": loss[2]}), None),
        (4, f"{out}/checkpoint-4", "save", json.dumps({"eval/loss": loss[4]}), None),
        (6, f"{out}/checkpoint-4", "remove", "{}", "save_total_limit"),
        (6, f"{out}/checkpoint-6", "save", json.dumps({"eval/loss": loss[6]}), None),
        (6, f"{out}/checkpoint-6", "remove", "{}", "save_total_limit"),
    ]  # fmt: skip
    assert min(loss, key=loss.__getitem__) == 2  # the Trainer keeps the best one too
    ((status, config),) = _rows(db, "SELECT status, config FROM runs")
    config = json.loads(config)
    assert status == "completed"
    assert (config["max_steps"], config["seed"], config["model"]["hidden_size"]) == (6, 7, 32)
    assert "hub_token" not in config


def test_the_hooks_come_in_the_documented_order(fitted: dict[str, Any]) -> None:
    assert fitted["every"].calls == [
        "on_experiment_start", "on_group_start", "on_run_start:main-r0", "on_train_start",
        "on_step_end:1", "on_step_end:2", "on_eval", "on_checkpoint",
        "on_step_end:3", "on_step_end:4", "on_eval", "on_checkpoint",
        "on_step_end:5", "on_step_end:6", "on_eval",
        "on_checkpoint", "on_checkpoint",  # checkpoint-4 rotated away, checkpoint-6 saved
        "on_eval",  # the closing summary, as the eval "train"
        "on_checkpoint",  # checkpoint-6 removed at the end: checkpoint-2 is the best
        "on_eval", "on_benchmark_eval",  # predict: the eval "test" and its rows
        "on_train_end",
        "on_run_end:main-r0:completed", "on_experiment_end:completed", "close",
    ]  # fmt: skip


_KILLED = (
    "import sys; from pathlib import Path; from tests import tiny_transformers as tiny; "
    "tiny.recorded_fit(Path.cwd(), int(sys.argv[1]))"
)


def test_a_trainer_killed_with_sigkill_resumes_the_same_run_with_the_same_rows(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed_dir = tmp_path / "killed"
    killed_dir.mkdir()

    killed = warm.popen(
        [sys.executable, "-c", _KILLED, "5"], cwd=killed_dir, env=env, text=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    tiny.recorded_fit(tmp_path / "straight")  # meanwhile, the same fit uninterrupted, here
    _, err = killed.communicate(timeout=300)
    assert killed.returncode == -signal.SIGKILL, err[-3000:]
    saved = sorted(p.name for p in (killed_dir / "out").glob("checkpoint-*"))
    assert saved == ["checkpoint-2", "checkpoint-4"]  # killed after step 5
    every = Every()
    tiny.recorded_fit(killed_dir, callbacks=[every])  # run again: it resumes from checkpoint-4
    assert every.calls[:6] == [
        "on_experiment_start", "on_group_start", "on_run_start:main-r0",
        "post_checkpoint_loaded", "on_train_start", "on_step_end:5",
    ]  # fmt: skip
    sql = (
        "SELECT step, key, value FROM metrics WHERE key NOT LIKE '%second' AND key NOT LIKE "
        "'%runtime' AND key NOT LIKE 'train/%' ORDER BY step, key"
    )
    straight, again = tmp_path / "straight" / "lab.db", killed_dir / "lab.db"
    assert _rows(again, sql) == _rows(straight, sql)
    assert len(_rows(again, sql)) == 6 * 4 + 3  # loss, grad_norm, learning_rate, epoch
    for sql in (
        "SELECT name, step FROM evals ORDER BY step, name",
        "SELECT step, event FROM checkpoints ORDER BY step",
        "SELECT run_key, status FROM runs",
    ):
        assert _rows(again, sql) == _rows(straight, sql), sql
    assert _rows(again, "SELECT status FROM runs") == [("completed",)]


def test_a_trainer_that_raises_fails_the_run_with_its_traceback(tmp_path: Path) -> None:
    class Broken(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 3:
                raise RuntimeError("the fit broke")

    db = tmp_path / "lab.db"
    callback = LabCallback(experiment="bert", store=f"sqlite:///{db}", quiet=True,
                           output_dir=tmp_path / "runs")  # fmt: skip
    with pytest.raises(RuntimeError, match="the fit broke"):
        train(tiny.trainer(tmp_path / "out", [callback, Broken()]))
    ((status, error, trace),) = _rows(db, "SELECT status, error, traceback FROM runs")
    assert (status, error) == ("failed", "RuntimeError: the fit broke")
    assert 'raise RuntimeError("the fit broke")' in trace
    assert _rows(db, "SELECT DISTINCT step FROM metrics ORDER BY step") == [(1,), (2,)]


def test_an_experiment_ranges_arms_and_repeats_over_training_arguments(tmp_path: Path) -> None:
    class Settings(pydantic.BaseModel):
        learning_rate: float = 1e-4
        max_steps: int = 2

    def fit(run: lab.RunSpec) -> dict[str, Any]:
        args = training_args(run, use_cpu=True, per_device_train_batch_size=4,
                             logging_steps=1, save_steps=2, disable_tqdm=True)  # fmt: skip
        trainer = transformers.Trainer(model=tiny.model(run.seed), args=args,
                                       train_dataset=tiny.examples(16, run.seed),
                                       callbacks=[LabCallback(run)])  # fmt: skip
        train(trainer)
        return {}

    db = tmp_path / "lab.db"
    result = lab.Experiment(
        "bert-lr", fit, base_config=Settings(), repeats=2, seed=10, store=f"sqlite:///{db}",
        arms=[lab.Arm("slow"), lab.Arm("fast", learning_rate=1e-2)],
        output_dir=tmp_path / "runs",
    ).run()  # fmt: skip
    assert [(r.run_key, r.status) for r in result.runs] == [
        ("slow-r0", "completed"), ("slow-r1", "completed"),
        ("fast-r0", "completed"), ("fast-r1", "completed"),
    ]  # fmt: skip
    written = {}
    for key in ("slow-r0", "slow-r1", "fast-r0", "fast-r1"):
        config = json.loads((tmp_path / "runs" / "bert-lr" / key / CONFIG_FILE).read_text())
        written[key] = (config["learning_rate"], config["seed"], config["output_dir"])
    folder = tmp_path / "runs" / "bert-lr"
    assert written == {
        "slow-r0": (1e-4, 10, str(folder / "slow-r0" / "trainer")),
        "slow-r1": (1e-4, 11, str(folder / "slow-r1" / "trainer")),
        "fast-r0": (1e-2, 10, str(folder / "fast-r0" / "trainer")),
        "fast-r1": (1e-2, 11, str(folder / "fast-r1" / "trainer")),
    }
    assert _rows(db, "SELECT count(*) FROM metrics WHERE key = 'loss'") == [(8,)]
    assert _rows(db, "SELECT count(DISTINCT path) FROM checkpoints") == [(4,)]


def test_bad_input_is_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        train(tiny.trainer(tmp_path / "out", []))
    assert str(info.value) == (
        "the Trainer has no LabCallback: pass Trainer(..., callbacks=[LabCallback(...)])"
    )
    with pytest.raises(ConfigError) as info:
        training_args("run")  # type: ignore[arg-type]
    assert str(info.value) == "run='run': pass the RunSpec that train(run) was given"
    with pytest.raises(ConfigError) as info:
        LabCallback()
    assert str(info.value) == (
        "give the run (inside an Experiment's train(run)) or experiment='name' (a run of its own)"
    )
