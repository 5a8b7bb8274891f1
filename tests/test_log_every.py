"""`TrainingLoop(log_every=N)`: the step metrics stay on the device between materialisations.

What must not change with N: every step's row reaches the store with the value log_every=1
gives, the hooks fire in the documented order with each step's own number and metrics, a
resume across a checkpoint between two materialisations is exact, and a scheduler still
reads the step metric it steps on. What must change: a step that does not materialise reads
nothing of its metrics on the host (a `TorchFunctionMode` on CPU, CUDA's sync debug mode on
a GPU).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch
from torch.overrides import TorchFunctionMode

from lab import Arm, Callback, CheckpointConfig, Evaluator, Experiment, RunHandle, TrainingLoop
from lab.callbacks.monitors import SpeedMonitor
from lab.errors import ConfigError, MetricError
from lab.loop.schedules import Schedule
from lab.store import Store
from tests.recorder import Recorder

# --------------------------------------------------------------------------------------------
# helpers


def _data(n: int = 5, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randn(8, 4, generator=g)
        out.append((x.to(device), x.sum(1, keepdim=True).to(device)))
    return out


def _loss(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    x, y = batch
    out = model(x)
    # tensor metrics of two dtypes (kept on the device like the loss) and a plain one
    extra = {"out_mean": out.mean(), "positive": (out > 0).sum(), "rows": len(x)}
    return torch.nn.functional.mse_loss(out, y), extra


def _loop(steps: int | None, log_every: int, **kw: Any) -> TrainingLoop:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to(kw.pop("device", "cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = kw.pop("data", None) or _data()
    if kw.pop("step_lr", False):  # halves the rate every 2 steps
        kw["scheduler"] = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return TrainingLoop(model, opt, data, _loss, steps, log_every=log_every, **kw)


class Record(
    Recorder,
    hooks=("on_train_start", "on_epoch_start", "pre_step", "on_step_end", "on_eval",
           "on_checkpoint", "on_epoch_end", "on_train_end"),
):  # fmt: skip
    """Every loop hook in order, with what each step's hooks see."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[int, dict[str, float]] = {}

    def note(self, hook: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        if hook == "on_step_end":
            state, step_idx, batch, metrics = args
            assert state.step == step_idx and state.metrics is metrics
            assert all(type(v) is float for v in metrics.values()), metrics
            self.steps[step_idx] = dict(metrics)
            return (hook, step_idx, batch.index, batch.data is None)
        if hook == "on_checkpoint":
            return (hook, args[1].step)
        if hook in ("on_train_start", "on_train_end"):
            return (hook,)
        return (hook, args[1])  # the epoch, or the step


def _no_time(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k != "step_time"}


# --------------------------------------------------------------------------------------------
# the store's rows


class Config(pydantic.BaseModel):
    log_every: int = 1


def _train(run: Any) -> Any:
    loop = _loop(
        11,  # a multiple of neither 3 nor 7
        run.config.log_every,
        step_lr=True,
        evaluators=[Evaluator("val", lambda m: {"w": float(m.weight.sum())}, every=4)],
        checkpoint=CheckpointConfig(every=5),
    )
    return loop.fit(run)


def test_every_row_reaches_the_store_with_the_value_log_every_1_gives(sqlite_url: str) -> None:
    arms = [Arm(f"every-{n}", log_every=n) for n in (1, 3, 7)]
    result = Experiment("rows", _train, base_config=Config(), arms=arms, store=sqlite_url).run()
    assert [r.status for r in result.runs] == ["completed"] * 3
    store = Store(sqlite_url)
    try:
        keys = ("loss", "grad_norm", "lr", "out_mean", "positive", "rows", "val/w")
        got = {run_id: {key: store.metric_values(run_id, key) for key in keys}
               for run_id in (1, 2, 3)}  # fmt: skip
    finally:
        store.close()
    assert [step for step, _ in got[1]["loss"]] == list(range(1, 12))
    assert len({v for _, v in got[1]["lr"]}) == 6  # StepLR halved it every 2 steps
    assert got[1] == got[2] == got[3]  # every step, every key, bit for bit


# --------------------------------------------------------------------------------------------
# the order of the hooks


def test_held_steps_end_in_order_at_each_materialisation() -> None:
    record = Record()
    loop = _loop(None, 3, num_epochs=2, callbacks=[record],
                 evaluators=[Evaluator("val", lambda m: {"one": 1.0}, every=4)])  # fmt: skip
    loop.fit()

    def ended(step: int, held: bool) -> tuple[Any, ...]:
        return ("on_step_end", step, (step - 1) % 5, held)  # a held step's data is not kept

    assert record.calls == [
        ("on_train_start",),
        ("on_epoch_start", 0),
        ("pre_step", 1), ("pre_step", 2), ("pre_step", 3),  # 3: a multiple of log_every
        ended(1, True), ended(2, True), ended(3, False),
        ("pre_step", 4), ended(4, False), ("on_eval", 4),  # an eval reads the metrics
        ("pre_step", 5), ended(5, False), ("on_epoch_end", 0),  # so does an epoch's end
        ("on_epoch_start", 1),
        ("pre_step", 6), ended(6, False),
        ("pre_step", 7), ("pre_step", 8), ended(7, True), ended(8, False), ("on_eval", 8),
        ("pre_step", 9), ended(9, False),
        ("pre_step", 10), ended(10, False), ("on_epoch_end", 1),  # the last step
        ("on_train_end",),
    ]  # fmt: skip


def test_each_step_sees_the_metrics_log_every_1_gives() -> None:
    seen = {}
    for n in (1, 3, 7):
        record = Record()
        _loop(10, n, callbacks=[record]).fit()
        seen[n] = {step: _no_time(m) for step, m in record.steps.items()}
    assert list(seen[1]) == list(range(1, 11))
    assert seen[1] == seen[3] == seen[7]


def test_a_callback_that_must_see_each_step_live_makes_every_step_materialise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    record = Record()
    with caplog.at_level(logging.INFO, logger="lab.loop"):
        _loop(4, 3, callbacks=[record, SpeedMonitor(every=2)]).fit()
    steps = [call for call in record.calls if call[0] in ("pre_step", "on_step_end")]
    assert steps == [c for s in range(1, 5)
                     for c in (("pre_step", s), ("on_step_end", s, s - 1, False))]  # fmt: skip
    assert [r.getMessage() for r in caplog.records if "live_steps" in r.getMessage()] == [
        "log_every=3: every step materialises its metrics, as SpeedMonitor must see each "
        "step live (live_steps)"
    ]


def test_log_every_must_be_a_positive_int() -> None:
    with pytest.raises(ConfigError) as err:
        _loop(3, 0)
    assert str(err.value) == (
        "log_every=0: give how many steps pass between two materialisations of the step "
        "metrics, an int >= 1 (1: every step)"
    )


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: dict) -> None:
        if step_idx == self.step:
            state.request_stop("enough")


def test_a_stop_asked_by_a_held_step_takes_effect_after_the_materialising_step(
    tmp_path: Path,
) -> None:
    record = Record()
    loop = _loop(10, 4, callbacks=[StopAt(2), record], checkpoint=CheckpointConfig(every=100))
    artifacts = loop.fit(run_dir=tmp_path)
    assert (artifacts.step, artifacts.stopped) == (4, True)  # 2's hook fired at step 4
    assert [c for c in record.calls if c[0] != "pre_step"][-3:] == [
        ("on_step_end", 4, 3, False), ("on_checkpoint", 4), ("on_train_end",)]  # fmt: skip


def test_a_loop_of_ones_own_holds_tensors_until_something_reads_them() -> None:
    record = Record()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with RunHandle(None, model, opt, num_steps=8, log_every=4, callbacks=[record]) as loop:
        for step in loop.steps():
            loss = model(torch.ones(2, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step in (6, 8):  # 6 would be held, 8 materialises: refused at once either way
                with pytest.raises(MetricError, match=f"'bad' at step {step} is a tensor of"):
                    loop.end_step({"bad": torch.ones(2)})  # and the held steps stay held
            loop.end_step({"loss": loss.detach()})
            if step == 6:  # an eval of its own: the held steps 5 and 6 end first
                loop.log_eval("probe", {"x": 1.0})
    ends = [c[:2] for c in record.calls if c[0] in ("on_step_end", "on_eval")]
    assert ends == [("on_step_end", s) for s in range(1, 5)] + [
        ("on_step_end", 5), ("on_step_end", 6), ("on_eval", 6),
        ("on_step_end", 7), ("on_step_end", 8)]  # fmt: skip


# --------------------------------------------------------------------------------------------
# resume and failure


class CrashAt(Callback):
    critical = True

    def __init__(self, step: int) -> None:
        self.step = step

    def pre_step(self, state: Any, step_idx: int, batch: Any) -> None:
        if step_idx == self.step:
            raise RuntimeError(f"killed before step {step_idx}")


def test_a_resume_across_a_checkpoint_between_materialisations_is_exact(tmp_path: Path) -> None:
    def fit(folder: Path, *callbacks: Callback) -> tuple[TrainingLoop, Record]:
        record = Record()
        loop = _loop(10, 4, callbacks=[record, *callbacks],
                     checkpoint=CheckpointConfig(every=3))  # fmt: skip
        loop.fit(run_dir=folder)
        return loop, record

    whole, straight = fit(tmp_path / "whole")
    with pytest.raises(RuntimeError, match="killed before step 8"):
        fit(tmp_path / "crashed", CrashAt(8))
    resumed, after = fit(tmp_path / "crashed")
    assert resumed.handle is None and after.calls[0] == ("on_train_start",)
    # the save at step 6 is not on a log boundary (4, 8); 7 was held when step 8 failed
    assert [c[1] for c in after.calls if c[0] == "pre_step"] == [7, 8, 9, 10]
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert {s: _no_time(m) for s, m in after.steps.items()} == {
        s: _no_time(m) for s, m in straight.steps.items() if s > 6
    }


def test_the_steps_held_when_a_run_fails_still_end_before_it_fails(tmp_path: Path) -> None:
    record = Record()
    with pytest.raises(RuntimeError, match="killed before step 7"):
        _loop(10, 4, callbacks=[record, CrashAt(7)]).fit()
    # 5 and 6 were held (the next materialisation was due at 8): they still reach the hooks
    assert [c[1] for c in record.calls if c[0] == "on_step_end"] == [1, 2, 3, 4, 5, 6]


def test_a_scheduler_on_a_step_metric_still_reads_it_every_step() -> None:
    lrs = {}
    for n in (1, 4):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        record = Record()
        TrainingLoop(model, opt, _data(), _loss, 9, log_every=n, callbacks=[record],
                     scheduler=Schedule(plateau, metric="loss")).fit()  # fmt: skip
        lrs[n] = [m["lr"] for _, m in sorted(record.steps.items())]
    assert lrs[1] == lrs[4]
    assert len(set(lrs[1])) > 1  # it did step on the loss


# --------------------------------------------------------------------------------------------
# no host sync on the steps that do not materialise

_READS = {"item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy"}


class HostReads(TorchFunctionMode):
    """Notes each call that reads a tensor's value on the host (or copies it towards the
    host), at the step in progress."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.at: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _READS and args and isinstance(args[0], torch.Tensor):
            self.at.add(self.step)
        return func(*args, **(kwargs or {}))


class Steps(Callback):
    def __init__(self, reads: HostReads) -> None:
        self.reads = reads

    def pre_step(self, state: Any, step_idx: int, batch: Any) -> None:
        self.reads.step = step_idx


def test_a_step_that_does_not_materialise_reads_nothing_on_the_host() -> None:
    reads = HostReads()
    with reads:
        _loop(11, 4, callbacks=[Steps(reads)]).fit()
    assert reads.at == {4, 8, 11}  # the materialisations, and only they

    reads = HostReads()
    with reads:
        _loop(3, 1, callbacks=[Steps(reads)]).fit()
    assert reads.at == {1, 2, 3}  # the check sees reads where they happen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_step_that_does_not_materialise_never_syncs() -> None:
    class SyncCheck(Callback):
        """CUDA's sync debug mode set to "error" for each step that does not materialise."""

        def pre_step(self, state: Any, step_idx: int, batch: Any) -> None:
            logs = step_idx % 5 == 0 or step_idx == state.num_steps
            torch.cuda.set_sync_debug_mode(0 if logs else "error")

    record = Record()
    try:
        _loop(12, 5, device="cuda", data=_data(device="cuda"),
              callbacks=[SyncCheck(), record]).fit()  # fmt: skip
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert sorted(record.steps) == list(range(1, 13))
    cpu = Record()
    _loop(12, 1, callbacks=[cpu]).fit()
    for step, metrics in record.steps.items():
        for key in ("loss", "grad_norm", "out_mean"):
            expected = cpu.steps[step][key]
            assert math.isclose(metrics[key], expected, rel_tol=1e-5, abs_tol=1e-6), (step, key)


# --------------------------------------------------------------------------------------------
# under DDP: one collective per materialisation


def _fit_on_a_rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    real = dist.all_reduce
    calls: list[int] = []

    def all_reduce(*args: Any, **kwargs: Any) -> Any:  # counted, then torch's own
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        seen = {}
        for n in (1, 3):
            calls.clear()
            record = Record()
            data = [(x + rank, y) for x, y in _data()]  # each rank its own values
            _loop(10, n, data=data, callbacks=[record]).fit()
            seen[n] = ({s: _no_time(m) for s, m in record.steps.items()}, len(calls))
        torch.save(seen, Path(out) / f"rank{rank}.pt")
    finally:
        dist.all_reduce = real
        dist.destroy_process_group()


def test_under_ddp_the_held_steps_are_reduced_in_one_collective(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(_fit_on_a_rank, args=(2, init, str(tmp_path)), nprocs=2,
                       start_method="fork")  # fmt: skip
    for rank in (0, 1):
        seen = torch.load(tmp_path / f"rank{rank}.pt")
        (every_step, per_step), (held, per_window) = seen[1], seen[3]
        assert every_step == held  # the same means over the ranks, bit for bit
        assert per_step - per_window == 10 - 4  # 10 steps: materialised at 3, 6, 9, 10
    zero = torch.load(tmp_path / "rank0.pt")[3][0]
    assert zero == torch.load(tmp_path / "rank1.pt")[3][0]


def _fail_on_a_rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lab.loop").addHandler(handler)
    record = Record()
    try:
        _loop(10, 4, callbacks=[record, CrashAt(3)]).fit()
    except RuntimeError as exc:
        said.append(str(exc))
    finally:
        dist.destroy_process_group()
    ended = [c[1] for c in record.calls if c[0] == "on_step_end"]
    torch.save((ended, said), Path(out) / f"rank{rank}.pt")


def test_under_ddp_a_failure_names_the_held_steps_instead_of_reducing_them(
    tmp_path: Path,
) -> None:
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(_fail_on_a_rank, args=(2, init, str(tmp_path)), nprocs=2,
                       start_method="fork")  # fmt: skip
    for rank in (0, 1):
        ended, said = torch.load(tmp_path / f"rank{rank}.pt")
        assert ended == []  # steps 1 and 2 were held, and a collective could hang now
        assert said == [
            "steps 1-2: not recorded, their metrics were held (log_every) when the run failed, "
            "and reducing them across ranks needs every rank",
            "killed before step 3",
        ]
