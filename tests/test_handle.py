"""The run handle: a loop the user writes fires the same hooks, saves and resumes as ours."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import lab
import lab.inspect
from lab import (
    CheckpointConfig,
    Evaluator,
    Experiment,
    RunHandle,
    TrainingLoop,
)
from lab.errors import CheckpointError, ConfigError, HookOrderError
from tests import warm
from tests.recorder import EVERY_HOOK, Recorder

NUM_STEPS = 4


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 2, generator=g)
    y = x.sum(1, keepdim=True)
    return [(x[i : i + 4], y[i : i + 4]) for i in (0, 4, 8)]


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _val(model: torch.nn.Module) -> dict[str, float]:
    x, y = _data()[0]
    return {"loss": float(_mse(model, (x, y)))}


class Tracer(Recorder, hooks=EVERY_HOOK):
    """Records every hook as (hook, step, the payload's types), whatever fired it."""

    def note(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        state = args[0] if args else None
        step = getattr(state, "step", None)
        if name == "on_checkpoint":
            step = args[1].step
        elif name in ("pre_step", "on_step_end", "on_eval", "on_media"):
            step = args[1]
        elif name in ("on_epoch_start", "on_epoch_end"):
            step = args[1]  # the epoch
        elif name == "on_benchmark_eval":
            step = kwargs.get("step")
        types = tuple(type(a).__name__ for a in args)
        return (name, step, types)


def _model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _config() -> CheckpointConfig:
    return CheckpointConfig(every=2, keep_last=1)


def _evaluators() -> list[Evaluator]:
    return [Evaluator("val", _val, every=2, at_start=True)]


def _with_training_loop(run: lab.RunSpec) -> lab.LoopArtifacts:
    model, opt = _model_and_opt()
    loop = TrainingLoop(
        model, opt, _data(), _mse, NUM_STEPS, evaluators=_evaluators(), checkpoint=_config()
    )
    return loop.fit(run)


def _hand_written(run: lab.RunSpec) -> lab.LoopArtifacts:
    """The same training, as a user writes it: their own loop drives a RunHandle."""
    model, opt = _model_and_opt()
    with RunHandle(
        run, model, opt, num_steps=NUM_STEPS, evaluators=_evaluators(), checkpoint=_config()
    ) as loop:
        batches = loop.batches(_data())
        for _step in loop.steps():
            batch = loop.pre_step(next(batches))
            loss = _mse(model, batch.data)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loop.end_step({"loss": loss.item(), "lr": 0.05}, batch)
    assert loop.artifacts is not None
    return loop.artifacts


def _trace(train: Any, tmp_path: Path, name: str) -> tuple[list[tuple[Any, ...]], Any]:
    tracer = Tracer()
    result = Experiment(
        name, train, callbacks=[tracer], store=f"sqlite:///{tmp_path / 'lab.db'}",
        output_dir=tmp_path / "runs",
    ).run()  # fmt: skip
    assert result.status == "completed", result.runs[0].error
    return tracer.calls, result.runs[0].artifacts


def test_a_hand_written_loop_fires_exactly_the_hooks_of_training_loop(tmp_path: Path) -> None:
    ours, ours_out = _trace(_with_training_loop, tmp_path, "ours")
    theirs, theirs_out = _trace(_hand_written, tmp_path, "theirs")
    assert theirs == ours
    names = [c[0] for c in ours]
    assert names == [
        "on_experiment_start", "on_group_start", "on_run_start", "on_train_start",
        "on_eval",  # at_start, step 0
        "pre_step", "on_step_end",
        "pre_step", "on_step_end", "on_eval", "on_checkpoint",
        "pre_step", "on_step_end",
        "pre_step", "on_step_end", "on_eval", "on_checkpoint", "on_checkpoint",  # + a removal
        "on_train_end", "on_run_end", "on_experiment_end", "close",
    ]  # fmt: skip
    steps = [(c[0], c[1]) for c in ours if c[0] in ("pre_step", "on_step_end", "on_eval")]
    assert steps[:5] == [
        ("on_eval", 0), ("pre_step", 1), ("on_step_end", 1), ("pre_step", 2),
        ("on_step_end", 2),
    ]  # fmt: skip
    by_name = {c[0]: c[2] for c in ours}
    assert by_name["on_step_end"] == ("LoopState", "int", "TrainingBatch", "dict")
    assert by_name["on_checkpoint"] == ("LoopState", "ManifestRow")
    assert by_name["on_train_end"] == ("LoopState", "LoopArtifacts")
    # the same math: the same weights, bit for bit
    for a, b in zip(ours_out.model.parameters(), theirs_out.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert ours_out.step == theirs_out.step == NUM_STEPS
    assert [r.step for r in ours_out.checkpoints] == [r.step for r in theirs_out.checkpoints]


# --------------------------------------------------------------------------------------------
# misuse: one line each, nothing recorded is lost


def _handle(tmp_path: Path, **kwargs: Any) -> RunHandle:
    model, opt = _model_and_opt()
    kwargs.setdefault("num_steps", 5)
    return RunHandle(None, model, opt, run_dir=tmp_path / "run", **kwargs)


def test_a_step_that_goes_backwards_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(HookOrderError) as info, _handle(tmp_path) as loop:
        loop.end_step({"loss": 1.0}, step=3)
        loop.end_step({"loss": 1.0}, step=2)
    assert str(info.value) == (
        "end_step(step=2) after step 3: step numbers only go up; end step 4 (or leave step out)"
    )


def test_logging_after_the_run_ended_is_one_line(tmp_path: Path) -> None:
    with _handle(tmp_path) as loop:
        loop.end_step({"loss": 1.0})
    with pytest.raises(HookOrderError) as info:
        loop.end_step({"loss": 0.5})
    assert str(info.value) == (
        "end_step() after the run ended (at step 1); nothing more can be logged to it"
    )


def test_logging_before_the_handle_started_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(HookOrderError, match=r"^end_step\(\) before the run handle started"):
        _handle(tmp_path).end_step({"loss": 1.0})


def test_hooks_out_of_order_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(HookOrderError) as info, _handle(tmp_path) as loop:
        loop.pre_step()
        loop.pre_step()
    assert str(info.value) == (
        "pre_step for step 1 twice: end the step with loop.end_step(metrics) first"
    )
    with pytest.raises(HookOrderError) as info, _handle(tmp_path / "b") as loop:
        for _step in loop.steps():
            pass  # never ended
    assert str(info.value) == ("step 1 was never ended: call loop.end_step(metrics) once per step")
    no_epoch = pytest.raises(HookOrderError, match=r"^end_epoch\(\) with no epoch open")
    with no_epoch, _handle(tmp_path / "c") as loop:
        loop.end_epoch()


def test_a_save_ranked_by_a_metric_nothing_logged_is_one_line(tmp_path: Path) -> None:
    config = CheckpointConfig(every=1, keep_top_k=1, metric="val/acc", mode="max")
    with pytest.raises(CheckpointError) as info, _handle(tmp_path, checkpoint=config) as loop:
        loop.end_step({"loss": 1.0})
    assert str(info.value) == (
        "CheckpointConfig(metric='val/acc') ranks saves, but nothing logged 'val/acc' before "
        "the save at step 1 (logged: ['loss']); log it before the save (loop.end_step, "
        "loop.log_eval, or an Evaluator), or fix the name"
    )
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []  # nothing half-written


def test_a_declared_metric_may_come_later_and_earlier_saves_are_unranked(
    tmp_path: Path,
) -> None:
    config = CheckpointConfig(every=1, keep_top_k=1, metric="val/acc", mode="max")
    with _handle(tmp_path, checkpoint=config, metrics=["loss", "val/acc"]) as loop:
        loop.end_step({"loss": 1.0})  # unranked: kept only as the newest
        loop.end_step({"loss": 0.9})
        loop.log_eval("val", {"acc": 0.5})
        loop.save()  # step 2 again, now with its eval: ranked
        loop.end_step({"loss": 0.8})  # unranked: the newest
        loop.end_step({"loss": 0.7})
    manager = loop.checkpoints
    assert manager is not None
    assert manager.checkpoints() == [2, 4]
    assert manager.get_best_checkpoint_path() == tmp_path / "run" / "checkpoints" / "step_000002"


def test_a_non_number_metric_is_refused_before_any_hook_sees_it(tmp_path: Path) -> None:
    tracer = Tracer()
    refused = pytest.raises(lab.errors.MetricError, match="metric 'w' at step 1 is a tensor")
    with refused, _handle(tmp_path, callbacks=[tracer]) as loop:
        loop.end_step({"w": torch.ones(3)})
    assert "on_step_end" not in [c[0] for c in tracer.calls]


# --------------------------------------------------------------------------------------------
# checkpoints of a hand-written loop


def test_two_phase_save_commits_the_loops_own_files_with_the_checkpoint(tmp_path: Path) -> None:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    release = threading.Event()
    written: list[int] = []

    def shard_writer(folder: Path, step: int) -> concurrent.futures.Future[None]:
        assert folder.name == f"tmp_step_{step:06d}"  # the folder being saved, not committed

        def write() -> None:
            release.wait(10)
            (folder / "shard-0.bin").write_bytes(b"weights of step %d" % step)
            written.append(step)

        return pool.submit(write)

    config = CheckpointConfig(every=2)
    with _handle(tmp_path, checkpoint=config, num_steps=2) as loop:
        loop.on_save(shard_writer)
        loop.end_step({"loss": 1.0})
        threading.Timer(0.05, release.set).start()
        loop.end_step({"loss": 0.5})  # the commit waits for the shard
    root = tmp_path / "run" / "checkpoints"
    assert written == [2]
    assert (root / "step_000002" / "shard-0.bin").read_bytes() == b"weights of step 2"
    assert not list(root.glob("tmp_*"))


def test_a_failing_writer_leaves_no_checkpoint(tmp_path: Path) -> None:
    def broken(folder: Path, step: int) -> None:
        (folder / "half.bin").write_bytes(b"half")
        raise OSError("disk quota exceeded")

    config = CheckpointConfig(every=1)
    with pytest.raises(CheckpointError) as info, _handle(tmp_path, checkpoint=config) as loop:
        loop.on_save(broken)
        loop.end_step({"loss": 1.0})
    assert str(info.value) == (
        "cannot save step 1: the checkpoint writer "
        "test_a_failing_writer_leaves_no_checkpoint.<locals>.broken failed: OSError: disk quota "
        "exceeded"
    )
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == []


def test_several_optimizers_objects_and_user_state_come_back(tmp_path: Path) -> None:
    def build() -> tuple[Any, ...]:
        torch.manual_seed(1)
        g, d = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
        both = torch.nn.ModuleDict({"g": g, "d": d})
        opt_g = torch.optim.Adam(g.parameters(), lr=0.01)
        opt_d = torch.optim.SGD(d.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt_d, step_size=2, gamma=0.5)
        return both, opt_g, opt_d, sched

    def train(stop_at: int | None, folder: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
        both, opt_g, opt_d, sched = build()
        config = CheckpointConfig(every=1)
        with RunHandle(
            None, both, {"g": opt_g, "d": opt_d}, scheduler={"d": sched}, num_steps=6,
            checkpoint=config, run_dir=folder,
        ) as loop:  # fmt: skip
            loop.user_state.setdefault("seen", 0)
            for step in loop.steps():
                x = torch.randn(4, 2)
                fake = both["g"](x)
                d_loss = both["d"](fake.detach()).mean() - both["d"](x).mean()
                opt_d.zero_grad()
                d_loss.backward()
                opt_d.step()
                sched.step()
                g_loss = -both["d"](both["g"](x)).mean()
                opt_g.zero_grad()
                g_loss.backward()
                opt_g.step()
                loop.user_state["seen"] += 4
                loop.end_step({"d_loss": d_loss.item(), "g_loss": g_loss.item()})
                if step == stop_at:
                    break
        return both, dict(loop.user_state)

    straight, seen = train(None, tmp_path / "straight")
    train(3, tmp_path / "cut")  # a run that stopped after step 3 (its last save: step 3)
    resumed, seen_resumed = train(None, tmp_path / "cut")
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert seen == seen_resumed == {"seen": 24}


def test_a_loop_with_one_optimizer_cannot_resume_a_checkpoint_of_two(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    a = torch.optim.SGD(model.parameters(), lr=0.1)
    b = torch.optim.SGD(model.parameters(), lr=0.1)
    with RunHandle(
        None, model, [a, b], num_steps=1, checkpoint=CheckpointConfig(every=1),
        run_dir=tmp_path / "run",
    ) as loop:  # fmt: skip
        loop.end_step({"loss": 1.0})
    one = RunHandle(
        None, model, a, num_steps=2, checkpoint=CheckpointConfig(every=1),
        run_dir=tmp_path / "run",
    )  # fmt: skip
    with pytest.raises(CheckpointError, match=r"holds 2 optimizers \('0', '1'\) and the loop"):
        one.start()


def test_a_list_that_is_no_optimizer_is_a_config_error() -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigError) as info:
        RunHandle(None, model, [model], num_steps=1)
    assert str(info.value) == (
        "optimizer '0' is a Linear; pass a torch optimizer, a list of them, or a dict of named ones"
    )


_KILLED_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import lab
    from lab import CheckpointConfig, RunHandle

    kill_at = int(sys.argv[1])
    with lab.start_run("killed", config={"lr": 0.1}, store=sys.argv[2]) as run:
        model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Dropout(0.5),
                                    torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=run.config.lr)
        data = [torch.randn(4, 2) for _ in range(3)]
        loader = torch.utils.data.DataLoader(torch.arange(12), batch_size=4, shuffle=True)
        with RunHandle(run, model, opt, num_steps=8,
                       checkpoint=CheckpointConfig(every=2)) as loop:
            batches = loop.batches(loader)
            for step in loop.steps():
                idx = next(batches)
                x = torch.stack([data[i // 4][i % 4] for i in idx.tolist()])
                loss = model(x).pow(2).mean() + torch.rand(()) * 0  # draws from the RNG
                opt.zero_grad(); loss.backward(); opt.step()
                loop.end_step({"loss": loss.item()})
                if step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
        torch.save(model.state_dict(), run.dir / "final.pt")
    """
)


def test_a_hand_written_loop_killed_with_sigkill_resumes_bit_identically(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_KILLED_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(lab.__file__).parent.parent)}

    def run(where: Path, kill_at: int) -> subprocess.CompletedProcess[str]:
        where.mkdir(exist_ok=True)
        return warm.run(
            [sys.executable, str(script), str(kill_at), f"sqlite:///{where / 'lab.db'}"],
            cwd=where, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    straight = run(tmp_path / "straight", 0)
    assert straight.returncode == 0, straight.stderr
    killed = run(tmp_path / "killed", 5)
    assert killed.returncode == -signal.SIGKILL
    resumed = run(tmp_path / "killed", 0)
    assert resumed.returncode == 0, resumed.stderr
    final = "runs/killed/main-r0/final.pt"
    a = torch.load(tmp_path / "straight" / final, weights_only=True)
    b = torch.load(tmp_path / "killed" / final, weights_only=True)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    con = lab.inspect.connect(f"sqlite:///{tmp_path / 'killed' / 'lab.db'}")
    assert con.sql("select run_key, status from runs").fetchall() == [("main-r0", "completed")]
    assert con.sql("select count(*) from metrics where key = 'loss'").fetchone() == (8,)


# --------------------------------------------------------------------------------------------
# lab.start_run: a recorded run from a plain script


def test_start_run_records_a_script_as_experiment_group_and_run(tmp_path: Path) -> None:
    tracer = Tracer()
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    with lab.start_run("script", config={"lr": 0.05}, store=url, callbacks=[tracer]) as run:
        assert run.config.lr == 0.05
        model, opt = _model_and_opt()
        with RunHandle(run, model, opt, num_steps=2) as loop:
            for step in loop.steps():
                loop.end_step({"loss": 1.0 / step})
    assert [c[0] for c in tracer.calls] == [
        "on_experiment_start", "on_group_start", "on_run_start", "on_train_start",
        "on_step_end", "on_step_end", "on_train_end", "on_run_end", "on_experiment_end", "close",
    ]  # fmt: skip
    con = lab.inspect.connect(url)
    rows = con.sql(
        "select e.name, a.name, r.run_key, r.status, r.seed from runs r "
        "join experiments e using (experiment_id) join arms a using (arm_id)"
    ).fetchall()
    assert rows == [("script", "main", "main-r0", "completed", 0)]
    assert con.sql(
        "select step, value from metrics where key = 'loss' order by step"
    ).fetchall() == [(1, 1.0), (2, 0.5)]


def test_start_run_records_an_exception_as_a_failed_run_and_reraises(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    with pytest.raises(ValueError, match="bad batch"), lab.start_run("script", store=url) as run:
        model, opt = _model_and_opt()
        with RunHandle(run, model, opt, num_steps=5) as loop:
            loop.end_step({"loss": 1.0})
            raise ValueError("bad batch")
    con = lab.inspect.connect(url)
    assert con.sql("select status, error from runs").fetchall() == [
        ("failed", "ValueError: bad batch")
    ]
    assert con.sql("select status from experiments").fetchall() == [("failed",)]
    assert con.sql("select count(*) from metrics where key = 'loss'").fetchone() == (1,)


def test_start_run_refuses_a_finished_run_and_fresh_trains_it_again(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    with lab.start_run("again", store=url):
        pass
    with pytest.raises(ConfigError) as info, lab.start_run("again", store=url):
        raise AssertionError("the body must not run")
    assert str(info.value) == (
        "run 'main-r0' of experiment 'again' completed before; pass fresh=True to train it "
        "again (the old run is kept, superseded), or repeat=1 for another run"
    )
    with lab.start_run("again", store=url, fresh=True):
        pass
    with lab.start_run("again", store=url, repeat=1) as run:
        assert (run.run_key, run.seed) == ("main-r1", 1)
    con = lab.inspect.connect(url)
    assert con.sql("select run_key, status from all_runs order by run_key").fetchall() == [
        ("main-r0", "completed"), ("main-r0~1", "completed"), ("main-r1", "completed"),
    ]  # fmt: skip
    json.dumps(con.sql("select count(*) from runs").fetchone())


def test_start_run_says_where_it_records_and_how_to_look_unless_quiet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with lab.start_run("said", config={"lr": 0.1}):  # the default store, ./lab.db
        pass
    assert capsys.readouterr().err == (
        "lab: recording run main-r0 of said in sqlite:///lab.db; look at it: lab show said\n"
    )
    url = f"sqlite:///{tmp_path / 'my runs' / 'lab.db'}"
    (tmp_path / "my runs").mkdir()
    with lab.start_run("said", store=url, repeat=1):  # another store: the command names it
        pass
    line = capsys.readouterr().err
    assert line == (
        f"lab: recording run main-r1 of said in {url}; look at it: lab show said --store '{url}'\n"
    )
    shown = warm.run(  # the command as printed shows the run
        [sys.executable, "-m", "lab.cli", *shlex.split(line.split("look at it: lab ")[1])],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("said: completed, 1 run, seed 0\n")
    with lab.start_run("said", repeat=2, quiet=True):
        pass
    monkeypatch.setenv("LAB_QUIET", "1")
    with lab.start_run("said", repeat=3):
        pass
    with lab.start_run("said", repeat=4, quiet=False):  # the argument wins
        pass
    monkeypatch.delenv("LAB_QUIET")
    with lab.start_run("said", repeat=5, store=False):  # nothing recorded: nothing said
        pass
    assert capsys.readouterr().err == (
        "lab: recording run main-r4 of said in sqlite:///lab.db; look at it: lab show said\n"
    )


def test_media_logged_inside_a_step_belong_to_that_step(tmp_path: Path) -> None:
    tracer = Tracer()
    with _handle(tmp_path, callbacks=[tracer]) as loop:
        loop.end_step({"loss": 1.0})
        loop.log_histogram("after", [1.0, 2.0])  # what step 1 left: step 1
        loop.pre_step()
        loop.log_histogram("during", [1.0, 2.0])  # step 2 is in progress: step 2
        loop.end_step({"loss": 0.5})
    media = [(c[1]) for c in tracer.calls if c[0] == "on_media"]
    assert media == [1, 2]


def _epochs(folder: Path, stop_at: int | None = None) -> tuple[list[tuple[Any, ...]], list[Any]]:
    """A hand-written epoch loop over two batches a pass, four steps, a save every step."""
    tracer = Tracer()
    taken: list[Any] = []
    with RunHandle(
        None, torch.nn.Linear(1, 1), None, num_steps=4, checkpoint=CheckpointConfig(every=1),
        run_dir=folder, callbacks=[tracer],
    ) as loop:  # fmt: skip
        batches = loop.batches([1, 2])
        for step in loop.steps():
            if (step - 1) % 2 == 0:
                loop.start_epoch()
            taken.append((loop.state.epoch, next(batches)))
            loop.end_step({"loss": 1.0})
            if step % 2 == 0:
                loop.end_epoch()
            if step == stop_at:
                break
    return [(c[0], c[1]) for c in tracer.calls if "epoch" in c[0]], taken


def test_a_hand_written_loop_counts_epochs_with_batches_across_a_resume(tmp_path: Path) -> None:
    epochs, taken = _epochs(tmp_path / "straight")
    assert taken == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert epochs == [
        ("on_epoch_start", 0), ("on_epoch_end", 0), ("on_epoch_start", 1), ("on_epoch_end", 1),
    ]  # fmt: skip
    # stopped after step 2 (its save is inside epoch 0, before end_epoch): the resumed run
    # starts epoch 1 with a fresh pass
    _epochs(tmp_path / "cut", stop_at=2)
    epochs, resumed = _epochs(tmp_path / "cut")
    assert resumed == [(1, 1), (1, 2)]
    assert epochs == [("on_epoch_start", 1), ("on_epoch_end", 1)]
    # stopped after step 3 (inside epoch 1): the resumed run ends epoch 1 where it was
    _epochs(tmp_path / "mid", stop_at=3)
    epochs, resumed = _epochs(tmp_path / "mid")
    assert resumed == [(1, 2)]
    assert epochs == [("on_epoch_end", 1)]
