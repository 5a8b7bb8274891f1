"""Lightning: ``Trainer(logger=LabLogger(...))`` records the rows a `RunHandle` loop records
for the same training, its checkpoints by reference, its failures, and inside an Experiment
arms x repeats with their seeds and a resume after SIGKILL (real Lightning on CPU, real
SQLite stores, a real subprocess)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import warm

pytest.importorskip("lightning")

import lab
import lab.inspect
from lab.errors import ConfigError
from lab.integrations.lightning import LabLogger
from tests.lightning_tiny import EPOCHS, Tiny, experiment, handle_loop, loader, trainer
from tests.recorder import Labels
from tests.test_framework_run import _rows

ROOT = Path(__file__).resolve().parent.parent
STEPS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]


class Trace(Labels, hooks=("on_experiment_start", "on_group_start", "on_run_start",
                           "on_train_start", "post_checkpoint_loaded", "on_step_end", "on_eval",
                           "on_benchmark_eval", "on_checkpoint", "on_error", "on_train_end",
                           "on_run_end", "on_experiment_end", "close")):  # fmt: skip
    """The hooks a run's sinks see, as `Labels` notes them."""


METRICS = "SELECT step, key, value FROM metrics ORDER BY step, key"
EVALS = "SELECT name, step, metrics FROM evals ORDER BY step, name"
PREDICTIONS = (
    "SELECT e.step, p.example_id, p.output, p.target FROM predictions p "
    "JOIN evals e USING (eval_id) ORDER BY e.step, p.example_id"
)
CHECKPOINTS = "SELECT step, path, event, metrics, reason FROM checkpoints ORDER BY checkpoint_id"


def _fit(tmp_path: Path, **logger: Any) -> tuple[Path, LabLogger, Any]:
    import lightning.pytorch as pl

    db = tmp_path / "lab.db"
    runs = tmp_path / "runs"
    log = LabLogger(experiment="lt", store=f"sqlite:///{db}", save_dir=runs, quiet=True,
                    predictions=True, **logger)  # fmt: skip
    pl.seed_everything(0, verbose=False)
    model = Tiny()
    fit = trainer(log)
    fit.fit(model, loader(), loader())
    return db, log, fit


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    """One standalone Lightning fit (with a hook trace) and its `RunHandle` twin."""
    tmp = tmp_path_factory.mktemp("lightning")
    trace = Trace()
    db, _, _ = _fit(tmp, callbacks=[trace])
    twin = tmp / "twin.db"
    with lab.start_run("lt", config={"lr": 0.05}, store=f"sqlite:///{twin}", quiet=True,
                       output_dir=tmp / "twin") as run:  # fmt: skip
        handle_loop(run)
    return db, twin, trace.calls


def test_the_rows_equal_those_of_the_same_training_on_a_run_handle(fitted: Any) -> None:
    db, twin, _ = fitted
    metrics = _rows(db, METRICS)
    assert metrics == _rows(twin, METRICS)
    assert sorted({step for step, _, _ in metrics}) == STEPS  # the trainer's global steps
    assert _rows(db, EVALS) == _rows(twin, EVALS)
    assert [(n, s) for n, s, _ in _rows(db, EVALS)] == [("val", 4), ("val", 8), ("val", 12)]
    assert _rows(db, PREDICTIONS) == _rows(twin, PREDICTIONS)
    assert len(_rows(db, PREDICTIONS)) == 3 * 32
    assert _rows(db, "SELECT run_key, status, config FROM runs") == [
        ("main-r0", "completed", '{"lr": 0.05, "fail_at": 0, "interrupt": false}')
    ]


def test_checkpoints_are_rows_with_their_monitor_value_by_reference(fitted: Any) -> None:
    db, _, _ = fitted
    folder = db.parent / "runs" / "lt" / "main-r0" / "checkpoints"
    val = {step: json.loads(m)["loss"] for _, step, m in _rows(db, EVALS)}
    rows = _rows(db, CHECKPOINTS)
    best = [f"{folder}/epoch={e}-step={s}.ckpt" for e, s in ((0, 4), (1, 8), (2, 12))]
    last = f"{folder}/last.ckpt"
    expected: list[tuple[Any, ...]] = []
    kept: str | None = None
    for path, step in zip(best, (4, 8, 12), strict=True):
        score = json.dumps({"val/loss": val[step]})
        if kept is None or val[step] < val[int(kept.split("step=")[1][:-5])]:
            expected.append((step, path, "save", score, None))
            if kept is not None:
                expected.append((step, kept, "remove", "{}", "top-k: a better one replaced it"))
            kept = path
        expected.append((step, last, "save", score, None))
    assert rows == expected
    assert sorted(p.name for p in folder.iterdir()) == sorted([Path(kept).name, "last.ckpt"])  # type: ignore[arg-type]
    assert not list(folder.glob("step_*"))  # nothing copied


def test_the_hooks_fire_in_the_documented_order(fitted: Any) -> None:
    _, _, calls = fitted
    epoch = lambda first, saves: [  # noqa: E731
        *(f"on_step_end:{s}" for s in range(first, first + 4)),
        "on_eval", "on_benchmark_eval", *["on_checkpoint"] * saves,
    ]  # fmt: skip
    assert calls[:4] == ["on_experiment_start", "on_group_start", "on_run_start:main-r0",
                         "on_train_start"]  # fmt: skip
    assert calls[-4:] == ["on_train_end", "on_run_end:main-r0:completed",
                          "on_experiment_end:completed", "close"]  # fmt: skip
    middle = calls[4:-4]
    assert middle[:8] == epoch(1, 2)  # the first best save and last
    assert [c for c in middle if c != "on_checkpoint"] == [
        c for first in (1, 5, 9) for c in epoch(first, 0)
    ]


def test_a_fit_that_raises_is_a_failed_run_with_its_traceback(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    db = tmp_path / "lab.db"
    log = LabLogger(experiment="lt", store=f"sqlite:///{db}", save_dir=tmp_path, quiet=True)
    with pytest.raises(RuntimeError, match="diverged"):
        trainer(log).fit(Tiny(fail_at=3), loader(), loader())
    ((status, error, tb),) = _rows(db, "SELECT status, error, traceback FROM runs")
    assert (status, error) == ("failed", "RuntimeError: diverged")
    assert "training_step" in tb
    assert _rows(db, "SELECT DISTINCT step FROM metrics ORDER BY step") == [(1,), (2,)]
    pl.seed_everything(0, verbose=False)


def test_an_interrupted_fit_is_recorded_interrupted_not_completed(tmp_path: Path) -> None:
    db = tmp_path / "lab.db"
    log = LabLogger(experiment="lt", store=f"sqlite:///{db}", save_dir=tmp_path, quiet=True)
    with pytest.raises(SystemExit):  # Lightning turns Ctrl-C into exit status 1
        trainer(log).fit(Tiny(fail_at=6, interrupt=True), loader(), loader())
    assert _rows(db, "SELECT status, error FROM runs") == [
        ("failed", "interrupted (KeyboardInterrupt)")
    ]
    assert _rows(db, "SELECT max(step) FROM metrics") == [(5,)]


def _experiment_rows(db: Path) -> dict[str, Any]:
    return {
        "runs": _rows(db, "SELECT run_key, seed, status, config FROM runs ORDER BY run_key"),
        "metrics": _rows(db, "SELECT r.run_key, m.step, m.key, m.value FROM metrics m JOIN runs "
                             "r USING (run_id) ORDER BY r.run_key, m.step, m.key"),
        "evals": _rows(db, "SELECT r.run_key, e.name, e.step, e.metrics FROM evals e JOIN runs "
                           "r USING (run_id) ORDER BY r.run_key, e.step"),
        "predictions": _rows(db, "SELECT count(*) FROM predictions"),
        "checkpoints": _rows(db, "SELECT r.run_key, c.step, c.path, c.event, c.metrics FROM "
                                 "checkpoints c JOIN runs r USING (run_id) "
                                 "ORDER BY r.run_key, c.checkpoint_id"),
    }  # fmt: skip


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, lab.ExperimentResult]:
    """The Experiment of `tests.lightning_tiny` run once, uninterrupted, in this process."""
    tmp = tmp_path_factory.mktemp("swept")
    result = experiment(str(tmp / "lab.db"), str(tmp / "runs")).run()
    return tmp / "lab.db", result


def test_inside_an_experiment_arms_times_repeats_with_a_seed_each(swept: Any) -> None:
    db, result = swept
    rows = _experiment_rows(db)
    assert [r[:3] for r in rows["runs"]] == [
        ("fast-r0", 7, "completed"), ("fast-r1", 8, "completed"),
        ("slow-r0", 7, "completed"), ("slow-r1", 8, "completed"),
    ]  # fmt: skip
    first = {key: [v for k, s, n, v in rows["metrics"] if k == key and s == 1] for key in
             ("fast-r0", "fast-r1", "slow-r0")}  # fmt: skip
    assert first["fast-r0"] != first["fast-r1"]  # another seed, another initial model
    assert first["fast-r0"] == first["slow-r0"]  # the same seed: the same first step
    assert {r.run_key: r.metrics["val/loss"] for r in result.runs} == {
        k: json.loads(m)["loss"] for k, _, s, m in rows["evals"] if s == 4 * EPOCHS
    }  # train(run) returned the trainer's callback_metrics: the runs' results
    ((provenance,),) = _rows(db, "SELECT provenance FROM runs WHERE run_key = 'fast-r1'")
    assert json.loads(provenance)["framework_config"] == {
        "lr": 0.05, "fail_at": 0, "interrupt": False
    }  # fmt: skip
    assert json.loads(rows["runs"][0][3]) == {"lr": 0.05}  # the arm's config
    con = lab.inspect.connect(f"sqlite:///{db}")
    try:  # the last validation's predictions, compared across the arms' repeats
        worst = lab.inspect.disagreements(con, "lt", "val", "slow", "fast", limit=3).fetchall()
    finally:
        con.close()
    assert len({row[0] for row in worst}) == 3  # three examples, each scored by both arms
    assert all(row[-1] is not None for row in worst)  # diff: score_a - score_b
    assert abs(worst[0][-1]) >= abs(worst[1][-1]) >= abs(worst[2][-1])  # largest diff first


def test_sigkill_mid_fit_and_a_rerun_resume_the_same_run(swept: Any, tmp_path: Path) -> None:
    db, _ = swept
    killed = tmp_path / "lab.db"
    command = [sys.executable, "-m", "tests.lightning_tiny", str(killed), str(tmp_path / "runs")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LAB_TEST_KILL_AT": "10", "LAB_QUIET": "1"}
    first = warm.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert first.returncode == -9, first.stderr[-2000:]
    assert _rows(killed, "SELECT run_key, status FROM runs") == [("slow-r0", "running")]
    env.pop("LAB_TEST_KILL_AT")
    again = warm.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    rows, expected = _experiment_rows(killed), _experiment_rows(db)
    assert rows["metrics"] == expected["metrics"]
    assert rows["evals"] == expected["evals"]
    assert rows["predictions"] == expected["predictions"]
    assert [r[:3] for r in rows["runs"]] == [r[:3] for r in expected["runs"]]
    strip = [(k, s, Path(p).name, e, m) for k, s, p, e, m in rows["checkpoints"]]
    assert strip == [(k, s, Path(p).name, e, m) for k, s, p, e, m in expected["checkpoints"]]


def test_a_standalone_logger_is_named_like_mlflows(tmp_path: Path) -> None:
    log = LabLogger(experiment="lt", save_dir=tmp_path / "runs", arm="wide", repeat=2, seed=5)
    assert (log.name, log.version, log.save_dir, log.log_dir) == (
        "lt", "wide-r2", str(tmp_path / "runs"), str(tmp_path / "runs" / "lt" / "wide-r2")
    )  # fmt: skip
    assert (log.seed, os.environ["PL_GLOBAL_SEED"]) == (7, "7")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "give the run (inside an Experiment's train(run)) or experiment='name' (a run of "
             "its own)"),
        ({"experiment": "lt", "predictions": "yes"}, "predictions='yes': use True or False"),
    ],
)  # fmt: skip
def test_bad_arguments_are_one_clear_line(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        LabLogger(**kwargs)
    assert str(info.value) == message


def test_test_and_predict_after_the_fit_are_post_training_evals(tmp_path: Path) -> None:
    def train(run: lab.RunSpec) -> None:
        model = Tiny()
        fit = trainer(LabLogger(run, predictions=True), epochs=1)
        fit.fit(model, loader(), loader())
        fit.test(model, loader())
        fit.predict(model, loader())

    db = tmp_path / "lab.db"
    lab.Experiment("lt", train, store=f"sqlite:///{db}", output_dir=tmp_path / "runs").run()
    evals = _rows(db, "SELECT name, step, metrics FROM evals ORDER BY eval_id")
    assert [(name, step) for name, step, _ in evals] == [("val", 4), ("test", None),
                                                         ("predict", None)]  # fmt: skip
    assert evals[1][2] == evals[0][2]  # the same model on the same examples
    counts = "SELECT e.name, count(*) FROM predictions p JOIN evals e USING (eval_id) GROUP BY 1"
    assert sorted(_rows(db, counts)) == [("predict", 32), ("test", 32), ("val", 32)]
    predicted = _rows(
        db,
        "SELECT example_id, output FROM predictions JOIN evals USING "
        "(eval_id) WHERE name = 'predict' ORDER BY CAST(example_id AS INT)",
    )
    tested = _rows(db, "SELECT output FROM predictions JOIN evals USING (eval_id) WHERE "
                       "name = 'test' ORDER BY CAST(substr(example_id, 3) AS INT)")  # fmt: skip
    assert predicted == [(str(i), o) for i, (o,) in enumerate(tested)]  # predict_step's tensor
    assert _rows(db, "SELECT key, step FROM metrics WHERE key LIKE 'test/%'") == [
        ("test/loss", 4)
    ]  # a post-training eval's metrics join the run's last step
    assert _rows(db, "SELECT status FROM runs") == [("completed",)]


def test_lightning_clis_parsed_config_is_recorded_with_the_run(tmp_path: Path) -> None:
    pytest.importorskip("jsonargparse")
    from jsonargparse import lazy_instance
    from lightning.pytorch.cli import LightningCLI

    db = tmp_path / "lab.db"
    log = lazy_instance(LabLogger, experiment="cli", store=f"sqlite:///{db}", quiet=True,
                        save_dir=str(tmp_path / "runs"))  # fmt: skip
    args = ["--model.lr=0.02", "--trainer.max_epochs=1", "--trainer.accelerator=cpu",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false"]  # fmt: skip
    cli = LightningCLI(Tiny, run=False, args=args, trainer_defaults={"logger": log},
                       save_config_kwargs={"overwrite": True})  # fmt: skip
    cli.trainer.fit(cli.model, loader(), loader())
    ((config,),) = _rows(db, "SELECT config FROM runs")
    config = json.loads(config)
    assert {k: v for k, v in config.items() if k != "lightning_cli"} == {
        "lr": 0.02, "fail_at": 0, "interrupt": False
    }  # fmt: skip
    assert config["lightning_cli"]["model"] == {"lr": 0.02, "fail_at": 0, "interrupt": False}
    assert config["lightning_cli"]["trainer"]["max_epochs"] == 1
    logger = config["lightning_cli"]["trainer"]["logger"]
    assert logger["class_path"] == "lab.integrations.lightning.LabLogger"


def test_credentials_in_the_hparams_are_masked(tmp_path: Path) -> None:
    log = LabLogger(experiment="lt", save_dir=tmp_path)
    log.log_hyperparams({"api_token": "abc123", "db": "postgresql://u:hunter22@h/db", "n": 2})
    assert log.hparams == {"api_token": "***", "db": "postgresql://u:***@h/db", "n": 2}


class EpochMean(Tiny):
    """Also logs the epoch's mean loss, which Lightning reports after the epoch's last step's
    validation and save."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.log("train/mean", loss, on_step=False, on_epoch=True)
        return loss


def test_end_of_epoch_metrics_join_the_epochs_last_step(tmp_path: Path) -> None:
    db = tmp_path / "lab.db"
    log = LabLogger(experiment="lt", store=f"sqlite:///{db}", save_dir=tmp_path, quiet=True)
    trainer(log).fit(EpochMean(), loader(), loader())
    assert _rows(db, "SELECT step, value FROM metrics WHERE key = 'epoch' ORDER BY step") == [
        (step, float((step - 1) // 4)) for step in STEPS
    ]  # no step moved
    means = _rows(db, "SELECT step FROM metrics WHERE key = 'train/mean' ORDER BY step")
    assert means == [(4,), (8,), (12,)]
    assert _rows(db, "SELECT DISTINCT step FROM checkpoints ORDER BY step") == means


def test_an_interrupt_inside_an_experiment_is_not_a_completed_run(tmp_path: Path) -> None:
    def train(run: lab.RunSpec) -> None:
        trainer(LabLogger(run)).fit(Tiny(fail_at=3, interrupt=True), loader(), loader())

    db = tmp_path / "lab.db"
    with pytest.raises((SystemExit, KeyboardInterrupt)):
        lab.Experiment("lt", train, store=f"sqlite:///{db}", output_dir=tmp_path / "runs").run()
    ((status, error),) = _rows(db, "SELECT status, error FROM runs")
    assert status != "completed"
    assert (status, error) == ("failed", "interrupted (SystemExit)")
