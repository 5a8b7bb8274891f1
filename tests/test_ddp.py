"""DDP inside a run: real ranks (gloo, 2 processes), under torchrun and with
``Experiment(processes_per_run=2)``, a real SQLite store, a real SIGKILL of one rank, and real
Distributed Checkpoint folders."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from lab import Callback, CheckpointConfig, LoopState, TrainingLoop
from lab.errors import ConfigError
from tests import warm

SCRIPT = textwrap.dedent(
    """
    import atexit, json, os, signal, sys
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lab import Callback, CheckpointConfig, Experiment, TrainingLoop

    OUT = Path(os.environ["DDP_OUT"])
    STEPS = int(os.environ.get("DDP_STEPS", "6"))


    def rank():
        return dist.get_rank() if dist.is_initialized() else 0


    @atexit.register  # (registered first, so it runs after lab's own exit handlers)
    def _probe():
        if os.environ.get("DDP_EXIT_PROBE") == "1":  # is a process group still up?
            up = dist.is_initialized()
            (OUT / f"exit-{os.environ['RANK']}.json").write_text(json.dumps(up))
            if up:
                dist.destroy_process_group()  # the program's own group


    class Seen(Callback):
        '''On every rank: what the hooks saw, one JSON line per step.'''

        def on_train_start(self, state):
            name = f"seen-{state.ctx.experiment}-{state.ctx.run_key}-{state.rank}.jsonl"
            self.file = open(OUT / name, "a")

        def on_step_end(self, state, step, batch, metrics):
            line = {"rank": state.rank, "world": state.world_size, "step": step, **metrics}
            self.file.write(json.dumps(line) + "\\n")
            self.file.flush()

        def on_train_end(self, state, artifacts):
            weights = {k: v.tolist() for k, v in _plain(state.model).state_dict().items()}
            name = f"end-{state.ctx.experiment}-{state.ctx.run_key}-{state.rank}.json"
            (OUT / name).write_text(json.dumps({"step": state.step, "weights": weights}))


    class CrashAt(Callback):
        '''Fails the run on every rank after step N (a save sits before it).'''

        critical = True

        def __init__(self, at):
            self.at = at

        def on_step_end(self, state, step, batch, metrics):
            if step == self.at:
                raise RuntimeError(f"crash at step {step}")


    def _plain(model):
        return model.module if isinstance(model, DDP) else model


    def train(run):
        r = rank()
        torch.manual_seed(0)  # the same initial weights on every rank
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        device = None
        if os.environ.get("DDP_CUDA") == "1":  # NCCL: one GPU per rank
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            model = model.to(device)
        if dist.is_initialized():
            model = DDP(model, device_ids=[device.index] if device is not None else None)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(100 + r)  # each rank its own share of the data
        data = [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen))
                for _ in range(4)]
        locals_ = OUT / f"local-{run.experiment}-{run.run_key}-{r}.jsonl"
        kill_at = int(os.environ.get("DDP_KILL_AT", "0"))  # rank 1 of repeat 1, at that step

        def loss_fn(m, b):
            x, y = b
            x = x + 0.01 * torch.randn_like(x)  # draws from each rank's own RNG
            loss = torch.nn.functional.mse_loss(m(x), y)
            with open(locals_, "a") as fh:
                fh.write(json.dumps({"loss": loss.item()}) + "\\n")
            step = len(locals_.read_text().splitlines())
            if kill_at and r == 1 and run.repeat == 1 and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return loss, {"rank_id": float(r), "tokens": 8.0 * (r + 1), "peak": float(r)}

        callbacks = [Seen()]
        crash = int(os.environ.get("DDP_CRASH_AT", "0"))
        if crash:
            callbacks.append(CrashAt(crash))
        sharded = os.environ.get("DDP_SHARDED") == "1"
        background = os.environ.get("DDP_ASYNC") == "1"
        loop = TrainingLoop(model, opt, data, loss_fn, STEPS, callbacks=callbacks, device=device,
                            checkpoint=CheckpointConfig(every=3, sharded=sharded,
                                                        async_save=background),
                            reduce=json.loads(os.environ.get("DDP_REDUCE", "{}")))
        return loop.fit(run)


    def experiment(name):
        result = Experiment(
            name, train, repeats=int(os.environ.get("DDP_REPEATS", "1")), store=sys.argv[1],
            output_dir=str(OUT / "runs"),
            processes_per_run=int(os.environ.get("DDP_PROCESSES", "1")),
        ).run()
        report = {"experiment": name, "runs": [[r.run_key, r.status, r.error]
                                               for r in result.runs]}
        with open(OUT / f"report-{rank()}.jsonl", "a") as fh:  # (the ranks share stdout)
            fh.write(json.dumps(report) + "\\n")
        final = {r.run_key: {k: v for k, v in r.metrics.items() if k != "step_time"}
                 for r in result.runs}  # (step_time: each rank its own clock)
        with open(OUT / f"final-{rank()}.jsonl", "a") as fh:
            fh.write(json.dumps(final) + "\\n")


    if __name__ == "__main__":
        own = os.environ.get("DDP_OWN_GROUP")  # "1": gloo; else the backend named
        if own:
            dist.init_process_group("gloo" if own == "1" else own)
        if os.environ.get("DDP_RESUME") == "1":  # one never stopped; one crashed, then resumed
            experiment("whole")
            os.environ["DDP_CRASH_AT"] = "4"
            experiment("ddp")
            del os.environ["DDP_CRASH_AT"]
        experiment("ddp")
    """
)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "ddp_train.py"
    path.write_text(SCRIPT)
    (tmp_path / "out").mkdir()
    return path


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    launcher = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    clean = {k: v for k, v in os.environ.items() if k not in launcher}
    return {**clean, "DDP_OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1", **extra}


def _torchrun(script: Path, tmp_path: Path, nproc: int = 2, **env: str) -> Any:
    return warm.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         str(nproc), str(script), f"sqlite:///{tmp_path / 'lab.db'}"],
        capture_output=True, text=True, timeout=120, env=_env(tmp_path, **env),
    )  # fmt: skip


def _python(script: Path, tmp_path: Path, **env: str) -> Any:
    return warm.run(
        [sys.executable, str(script), f"sqlite:///{tmp_path / 'lab.db'}"],
        capture_output=True, text=True, timeout=120, env=_env(tmp_path, **env),
    )  # fmt: skip


def _rows(db: Path, sql: str) -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _reports(tmp_path: Path) -> dict[int, list]:
    """What each rank's experiments returned, by rank, in order."""
    return {
        int(path.stem.split("-")[1]): [report["runs"] for report in _lines(path)]
        for path in (tmp_path / "out").glob("report-*.jsonl")
    }


def test_under_torchrun_rows_are_written_once_and_values_are_the_mean_over_ranks(
    script: Path, tmp_path: Path
) -> None:
    out = _torchrun(script, tmp_path, DDP_REDUCE='{"tokens": "sum"}', DDP_EXIT_PROBE="1")
    assert out.returncode == 0, out.stderr[-3000:]
    for r in (0, 1):  # the group lab made is gone before the interpreter's teardown, where
        # a gloo group left behind can abort a rank as it exits
        assert json.loads((tmp_path / "out" / f"exit-{r}.json").read_text()) is False
    reports = _reports(tmp_path)
    assert reports[0] == reports[1] == [[["base-r0", "completed", None]]]
    final = [_lines(tmp_path / "out" / f"final-{r}.jsonl") for r in (0, 1)]
    assert final[0] == final[1] and final[0][0]["base-r0"]["loss"]  # every rank: one result
    db = tmp_path / "lab.db"
    assert _rows(db, "SELECT count(*) FROM experiments") == [(1,)]
    assert _rows(db, "SELECT count(*) FROM groups") == [(1,)]
    assert _rows(db, "SELECT run_key, status FROM runs") == [("base-r0", "completed")]
    stored = dict(
        ((key, step), value)
        for key, step, value in _rows(db, "SELECT key, step, value FROM metrics")
    )
    local = {r: _lines(tmp_path / "out" / f"local-ddp-base-r0-{r}.jsonl") for r in (0, 1)}
    seen = {r: _lines(tmp_path / "out" / f"seen-ddp-base-r0-{r}.jsonl") for r in (0, 1)}
    for step in range(1, 7):
        loss = (local[0][step - 1]["loss"] + local[1][step - 1]["loss"]) / 2
        assert stored[("loss", step)] == loss
        assert stored[("rank_id", step)] == 0.5  # the mean of 0 and 1
        assert stored[("tokens", step)] == 8.0 + 16.0  # named "sum"
        for r in (0, 1):  # every rank's hooks saw the reduced values, with its rank
            line = seen[r][step - 1]
            assert (line["rank"], line["world"], line["step"]) == (r, 2, step)
            assert (line["loss"], line["rank_id"], line["tokens"]) == (loss, 0.5, 24.0)
    assert local[0][0]["loss"] != local[1][0]["loss"]  # the ranks did see different data
    assert _rows(db, "SELECT count(*) FROM checkpoints WHERE event = 'save'") == [(2,)]


def test_processes_per_run_records_each_run_once_and_a_sigkilled_rank_fails_its_run(
    script: Path, tmp_path: Path
) -> None:
    out = _python(script, tmp_path, DDP_PROCESSES="2", DDP_REPEATS="2", DDP_STEPS="3",
                  DDP_REDUCE='{"peak": "max"}', DDP_KILL_AT="2")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    ((first, (key, status, error)),) = _reports(tmp_path)[0]
    assert first == ["base-r0", "completed", None]
    assert (key, status) == ("base-r1", "failed")  # its rank 1 was SIGKILLed at step 2
    assert re.search(r"Connection (reset|closed) by peer", error), error  # at once, no hang
    db = tmp_path / "lab.db"
    assert _rows(db, "SELECT run_key, status, error FROM runs ORDER BY run_key") == [
        ("base-r0", "completed", None), ("base-r1", "failed", error)]  # fmt: skip
    ids = dict(_rows(db, "SELECT run_key, run_id FROM runs"))
    peak = _rows(db, f"SELECT step, value FROM metrics WHERE run_id = {ids['base-r0']} "
                     "AND key = 'peak' ORDER BY step")  # fmt: skip
    assert peak == [(1, 1.0), (2, 1.0), (3, 1.0)]  # the max over ranks
    rank_id = _rows(db, f"SELECT value FROM metrics WHERE run_id = {ids['base-r0']} "
                        "AND key = 'rank_id'")  # fmt: skip
    assert rank_id == [(0.5,)] * 3
    for r in (0, 1):
        assert len(_lines(tmp_path / "out" / f"seen-ddp-base-r0-{r}.jsonl")) == 3
    # rank 0 of the killed run failed in the collective of step 2: step 1 alone is recorded
    killed = _rows(db, f"SELECT step FROM metrics WHERE run_id = {ids['base-r1']} "
                       "AND key = 'loss'")  # fmt: skip
    assert killed == [(1,)]


def test_a_process_group_the_program_made_is_left_to_it(script: Path, tmp_path: Path) -> None:
    out = _torchrun(script, tmp_path, DDP_STEPS="2", DDP_EXIT_PROBE="1", DDP_OWN_GROUP="1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert _reports(tmp_path)[1] == [[["base-r0", "completed", None]]]
    for r in (0, 1):  # still up after lab's exit handlers: the program destroys it
        assert json.loads((tmp_path / "out" / f"exit-{r}.json").read_text()) is True


@pytest.mark.parametrize("sharded", ["0", "1"])
def test_resume_under_ddp_equals_a_run_that_never_stopped(
    script: Path, tmp_path: Path, sharded: str
) -> None:
    out = _torchrun(script, tmp_path, DDP_SHARDED=sharded, DDP_RESUME="1")
    assert out.returncode == 0, out.stderr[-3000:]
    whole, crashed, resumed = _reports(tmp_path)[0]
    assert whole == resumed == [["base-r0", "completed", None]]
    assert crashed[0][:2] == ["base-r0", "failed"]
    folder = tmp_path / "out"
    for r in (0, 1):
        a = json.loads((folder / f"end-whole-base-r0-{r}.json").read_text())
        b = json.loads((folder / f"end-ddp-base-r0-{r}.json").read_text())
        assert a["step"] == b["step"] == 6
        for name in a["weights"]:
            torch.testing.assert_close(
                torch.tensor(b["weights"][name]), torch.tensor(a["weights"][name]),
                rtol=0, atol=0,
            )  # fmt: skip
        # after the resume each rank drew the same noise as the run that never stopped
        assert (
            _lines(folder / f"local-ddp-base-r0-{r}.jsonl")[-3:]
            == _lines(folder / f"local-whole-base-r0-{r}.jsonl")[-3:]
        )
    if sharded == "1":
        step3 = folder / "runs" / "ddp" / "base-r0" / "checkpoints" / "step_000003"
        assert sorted(p.name for p in (step3 / "dcp").iterdir()) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp"]  # fmt: skip


def test_a_dcp_checkpoint_saved_on_two_ranks_loads_on_one(script: Path, tmp_path: Path) -> None:
    # asynchronous sharded saves: each commits once every rank's shard is written
    saved = _torchrun(script, tmp_path, DDP_SHARDED="1", DDP_ASYNC="1", DDP_STEPS="3")
    assert saved.returncode == 0, saved.stderr[-3000:]
    end = json.loads((tmp_path / "out" / "end-ddp-base-r0-0.json").read_text())
    assert end["step"] == 3
    run_dir = tmp_path / "out" / "runs" / "ddp" / "base-r0"
    step3 = run_dir / "checkpoints" / "step_000003"
    assert sorted(p.name for p in (step3 / "dcp").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]  # fmt: skip
    assert (step3 / "COMPLETE").is_file()
    assert [json.loads(line)["path"] for line in
            (run_dir / "checkpoints" / "manifest.jsonl").read_text().splitlines()] == [
        "step_000003"]  # fmt: skip

    # here, in one process without DDP: the same model resumes from the 2-rank save
    torch.manual_seed(1)  # other initial weights: what it ends with comes from the save
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loaded: dict[str, Any] = {}

    class Loaded(Callback):
        def post_checkpoint_loaded(self, state: LoopState, path: Path) -> None:
            loaded.update(step=state.step, world=state.world_size, path=path.name,
                          weights={k: v.clone() for k, v in model.state_dict().items()},
                          momentum=[opt.state[p]["momentum_buffer"].clone()
                                    for p in model.parameters()])  # fmt: skip

    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
    loop = TrainingLoop(model, opt, data, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                        6, callbacks=[Loaded()],
                        checkpoint=CheckpointConfig(every=3, sharded=True,
                                                    async_save=True))  # fmt: skip
    artifacts = loop.fit(run_dir=run_dir)
    assert (loaded["step"], loaded["world"], loaded["path"]) == (3, 1, "step_000003")
    for name, value in end["weights"].items():
        torch.testing.assert_close(loaded["weights"][name], torch.tensor(value), rtol=0, atol=0)
    assert all(m.abs().sum() > 0 for m in loaded["momentum"])  # the optimizer state came too
    assert artifacts.step == 6
    assert [c.path for c in artifacts.checkpoints] == ["step_000006"]
    step6 = run_dir / "checkpoints" / "step_000006"
    assert sorted(p.name for p in (step6 / "dcp").iterdir()) == [".metadata", "__0_0.distcp"]


def test_an_unknown_reduction_is_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        TrainingLoop(torch.nn.Linear(1, 1), torch.optim.SGD(torch.nn.Linear(1, 1).parameters()),
                     [], lambda m, b: m(b), 1, reduce={"loss": "median"})  # fmt: skip
    assert str(err.value) == "reduce['loss']='median': use one of 'mean', 'sum', 'max', 'min'"


def test_the_docs_example_trains_each_repeat_on_two_ranks(tmp_path: Path) -> None:
    page = Path(__file__).resolve().parent.parent / "docs" / "ddp.md"
    (block,) = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    (tmp_path / "ddp_example.py").write_text(block)
    out = warm.run(
        [sys.executable, "ddp_example.py", "2"], cwd=tmp_path, capture_output=True, text=True,
        timeout=180, env=_env(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "[('sgd-r0', 'completed'), ('sgd-r1', 'completed')]"
    db = tmp_path / "lab.db"
    assert _rows(db, "SELECT count(*) FROM experiments") == [(1,)]
    assert _rows(db, "SELECT count(*), min(value), max(value) FROM metrics "
                     "WHERE key = 'samples'") == [(40, 32.0, 32.0)]  # fmt: skip
    saved = _rows(db, "SELECT count(*) FROM checkpoints WHERE event = 'save'")
    assert saved == [(4,)]  # steps 10 and 20 of each repeat, sharded


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_under_torchrun_with_nccl_the_values_are_the_mean_over_ranks(
    script: Path, tmp_path: Path
) -> None:
    out = _torchrun(script, tmp_path, DDP_CUDA="1", DDP_SHARDED="1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert _reports(tmp_path)[0] == [[["base-r0", "completed", None]]]
    stored = _rows(tmp_path / "lab.db", "SELECT value FROM metrics WHERE key = 'rank_id'")
    assert stored == [(0.5,)] * 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("own_group", ["", "nccl"])
def test_on_one_gpu_under_nccl_a_sharded_resume_equals_a_run_that_never_stopped(
    script: Path, tmp_path: Path, own_group: str
) -> None:
    """One rank on the one GPU: DDP's gradients and the Distributed Checkpoint's plans go
    through NCCL, in the group lab makes (gloo for CPU tensors, NCCL for CUDA ones) and in
    an NCCL-only group the program made itself."""
    out = _torchrun(script, tmp_path, nproc=1, DDP_CUDA="1", DDP_SHARDED="1", DDP_RESUME="1",
                    DDP_OWN_GROUP=own_group)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    whole, crashed, resumed = _reports(tmp_path)[0]
    assert whole == resumed == [["base-r0", "completed", None]]
    assert crashed[0][:2] == ["base-r0", "failed"]
    folder = tmp_path / "out"
    a = json.loads((folder / "end-whole-base-r0-0.json").read_text())
    b = json.loads((folder / "end-ddp-base-r0-0.json").read_text())
    assert a["step"] == b["step"] == 6
    for name in a["weights"]:
        torch.testing.assert_close(
            torch.tensor(b["weights"][name]), torch.tensor(a["weights"][name]), rtol=0, atol=0
        )
    stored = _rows(tmp_path / "lab.db", "SELECT DISTINCT value FROM metrics WHERE key = 'rank_id'")
    assert stored == [(0.0,)]
