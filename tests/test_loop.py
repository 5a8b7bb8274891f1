"""The training loop: step metrics, scheduling, clipping, data, loss errors, evals, checkpoints."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import lab
from lab import (
    Callback,
    CheckpointConfig,
    EvalResult,
    Evaluator,
    Experiment,
    LoopArtifacts,
    ManifestRow,
    TrainingLoop,
)
from lab.errors import ConfigError, LabError, LossError
from lab.loop.checkpoints import CheckpointManager
from tests.recorder import Recorder

# --------------------------------------------------------------------------------------------
# helpers


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _batches(n: int = 2, size: int = 4, dim: int = 2, scale: float = 1.0) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randn(size, dim, generator=g)
        out.append((x, scale * x.sum(1, keepdim=True)))
    return out


def _model(dim: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(dim, 1)


def _loop(num_steps: int = 3, *, data: Any = None, lr: float = 0.1, **kw: Any) -> TrainingLoop:
    model = kw.pop("model", None) or _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = kw.pop("loss_fn", _mse)
    return TrainingLoop(model, opt, _batches() if data is None else data, loss_fn, num_steps, **kw)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


class StepRows(Callback):
    """Keeps a copy of every step's metric row."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_step_end(
        self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch, metrics: dict
    ) -> None:
        assert metrics is state.metrics
        self.rows.append(dict(metrics))


# --------------------------------------------------------------------------------------------
# step metrics


def test_step_metrics_are_loss_lr_grad_norm_step_time_and_extras() -> None:
    data = _batches()
    model = _model()
    ref = copy.deepcopy(model)

    def loss_fn(m: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        x, y = batch
        pred = m(x)
        return torch.nn.functional.mse_loss(pred, y), {"mae": (pred - y).abs().mean(), "n": 4}

    rows = StepRows()
    loop = TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        loss_fn,
        3,
        callbacks=[rows],
    )
    artifacts = loop.fit()

    # step 1 by hand: the loss and gradient of the untouched model on the first batch
    x, y = data[0]
    pred = ref(x)
    loss = torch.nn.functional.mse_loss(pred, y)
    loss.backward()
    norm = math.sqrt(sum(p.grad.pow(2).sum().item() for p in ref.parameters()))

    assert len(rows.rows) == 3
    assert all(set(r) == {"loss", "lr", "grad_norm", "step_time", "mae", "n"} for r in rows.rows)
    first = rows.rows[0]
    assert first["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert first["mae"] == pytest.approx((pred - y).abs().mean().item(), rel=1e-6)
    assert first["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert first["lr"] == 0.1
    assert first["n"] == 4.0
    assert all(type(v) is float for r in rows.rows for v in r.values())
    assert all(math.isfinite(r["step_time"]) and r["step_time"] >= 0 for r in rows.rows)
    assert rows.rows[1]["loss"] != rows.rows[0]["loss"]
    assert artifacts.metrics == rows.rows[-1]
    assert artifacts.step == 3
    assert artifacts.stopped is False


def test_scheduler_is_stepped_and_lr_is_the_rate_each_step_used() -> None:
    def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))

    data = _batches()
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = schedule(opt)
    rows = StepRows()
    TrainingLoop(model, opt, data, _mse, 4, scheduler=sched, callbacks=[rows]).fit()

    assert [r["lr"] for r in rows.rows] == pytest.approx([0.1, 0.05, 0.1 / 3, 0.025])
    assert sched.last_epoch == 4
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02)

    # the same four steps by hand land on the same weights
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_sched = schedule(ref_opt)
    for step in range(4):
        ref_opt.zero_grad()
        _mse(ref, data[step % 2]).backward()
        ref_opt.step()
        ref_sched.step()
    assert torch.allclose(_flat(model), _flat(ref), atol=1e-7)


def test_grad_clip_reports_the_pre_clip_norm_and_bounds_the_update() -> None:
    data = _batches(dim=4, scale=100.0)  # big targets: big gradients
    lr, clip = 0.1, 0.5

    model = _model(4)
    ref = copy.deepcopy(model)
    _mse(ref, data[0]).backward()
    pre_clip = math.sqrt(sum(p.grad.pow(2).sum().item() for p in ref.parameters()))
    assert pre_clip > 20 * clip

    moves: list[float] = []

    class Moves(Callback):
        def pre_step(self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch) -> None:
            self.before = _flat(state.model)

        def on_step_end(
            self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch, metrics: dict
        ) -> None:
            moves.append((_flat(state.model) - self.before).norm().item())

    rows = StepRows()
    loop = TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        data,
        _mse,
        3,
        grad_clip=clip,
        callbacks=[rows, Moves()],
    )
    loop.fit()
    assert rows.rows[0]["grad_norm"] == pytest.approx(pre_clip, rel=1e-5)
    assert all(r["grad_norm"] > clip for r in rows.rows)
    assert len(moves) == 3
    for move in moves:  # SGD moves by lr * clipped gradient, whose norm is the clip
        assert move <= lr * clip * (1 + 1e-5)
        assert move == pytest.approx(lr * clip, rel=1e-4)

    # the control: without clipping the first step moves by lr * the full norm
    free = _model(4)
    moves.clear()
    TrainingLoop(
        free, torch.optim.SGD(free.parameters(), lr=lr), data, _mse, 1, callbacks=[Moves()]
    ).fit()
    assert moves[0] == pytest.approx(lr * pre_clip, rel=1e-4)


class Grads(Callback):
    """Keeps a copy of each step's gradients, as the optimizer used them."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []

    def on_step_end(
        self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch, metrics: dict
    ) -> None:
        self.steps.append([p.grad.clone() for p in state.model.parameters()])


def test_without_grad_clip_fp16_gradients_are_untouched_when_the_norm_overflows() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 128).half()
    ref = copy.deepcopy(model)
    x = torch.full((4, 4096), 100.0, dtype=torch.float16)

    def loss_fn(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return m(batch).sum()

    loss_fn(ref, x).backward()  # the plain gradients: finite, but their fp16 norm overflows
    assert all(torch.isfinite(p.grad).all() for p in ref.parameters())
    assert torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item() == math.inf

    grads, rows = Grads(), StepRows()
    TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-8),
        [x],
        loss_fn,
        1,
        callbacks=[grads, rows],
    ).fit()
    assert rows.rows[0]["grad_norm"] == math.inf  # the overflow is data, reported as is
    (used,) = grads.steps
    assert all(torch.equal(g, p.grad) for g, p in zip(used, ref.parameters(), strict=True))
    assert not any(torch.isnan(p).any() for p in model.parameters())


def test_without_grad_clip_gradients_are_bit_identical_to_plain_backward() -> None:
    data = _batches(dim=4, scale=100.0)
    model = _model(4)
    ref = copy.deepcopy(model)
    grads, rows = Grads(), StepRows()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    TrainingLoop(model, opt, data, _mse, 3, callbacks=[grads, rows]).fit()

    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    for step in range(3):
        ref_opt.zero_grad(set_to_none=True)
        _mse(ref, data[step % 2]).backward()
        assert all(
            torch.equal(g, p.grad) for g, p in zip(grads.steps[step], ref.parameters(), strict=True)
        )
        norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in ref.parameters()]))
        assert rows.rows[step]["grad_norm"] == pytest.approx(norm.item(), rel=1e-6)
        ref_opt.step()
    assert torch.equal(_flat(model), _flat(ref))


@pytest.mark.parametrize("grad_clip", [None, 1.0])
def test_grad_norm_is_nan_when_no_parameter_has_a_gradient(grad_clip: float | None) -> None:
    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return batch[0].clone().requires_grad_().sum()  # needs grad, reaches no parameter

    model = _model()
    before = _flat(model)
    rows = StepRows()
    _loop(2, model=model, loss_fn=loss_fn, grad_clip=grad_clip, callbacks=[rows]).fit()
    assert [math.isnan(r["grad_norm"]) for r in rows.rows] == [True, True]
    assert torch.equal(_flat(model), before)


# --------------------------------------------------------------------------------------------
# data


def test_data_is_iterated_again_each_epoch() -> None:
    data = [(torch.full((4, 2), float(i)), torch.zeros(4, 1)) for i in range(3)]
    seen: list[tuple] = []

    class Where(Callback):
        def pre_step(self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch) -> None:
            seen.append(
                (
                    step_idx,
                    batch.epoch,
                    batch.index,
                    state.epoch,
                    state.batch_in_epoch,
                    batch.data[0][0, 0].item(),
                    batch.size,
                )
            )

    loop = _loop(7, data=data, callbacks=[Where()])
    loop.fit()
    assert seen == [
        (1, 0, 0, 0, 1, 0.0, 4),
        (2, 0, 1, 0, 2, 1.0, 4),
        (3, 0, 2, 0, 3, 2.0, 4),
        (4, 1, 0, 1, 1, 0.0, 4),
        (5, 1, 1, 1, 2, 1.0, 4),
        (6, 1, 2, 1, 3, 2.0, 4),
        (7, 2, 0, 2, 1, 0.0, 4),
    ]


def test_empty_data_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="data yielded no batches; give the loop a non-empty"):
        _loop(2, data=[]).fit()


def test_one_shot_iterator_that_runs_out_says_so() -> None:
    with pytest.raises(ConfigError, match="one-shot iterator; pass a re-iterable"):
        _loop(3, data=iter(_batches())).fit()
    assert _loop(2, data=iter(_batches())).fit().step == 2  # one epoch's worth is fine


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def _structured_batch() -> dict[str, Any]:
    t = torch.ones(4, 2)
    return {"x": t, "pair": (t, t), "nt": Pair(t, t), "lst": [t], "tag": "train", "k": 3}


def _structured_loss(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    return model(batch["x"] + batch["nt"].a + batch["pair"][1] + batch["lst"][0]).pow(2).mean()


def _check_moved(batch: Any, device: torch.device) -> None:
    assert set(batch) == {"x", "pair", "nt", "lst", "tag", "k"}
    assert type(batch["pair"]) is tuple and type(batch["lst"]) is list
    assert type(batch["nt"]) is Pair
    assert (batch["tag"], batch["k"]) == ("train", 3)
    tensors = [batch["x"], *batch["pair"], *batch["nt"], *batch["lst"]]
    assert [t.device for t in tensors] == [device] * 6


def _run_on(device: str) -> list[Any]:
    seen: list[Any] = []

    class Peek(Callback):
        def pre_step(self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch) -> None:
            seen.append(batch.data)

    model = _model()
    TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        [_structured_batch()],
        _structured_loss,
        2,
        device=device,
        callbacks=[Peek()],
    ).fit()
    assert {p.device for p in model.parameters()} == {torch.device(device)}
    return seen


def test_device_cpu_moves_the_batch_keeping_its_structure() -> None:
    seen = _run_on("cpu")
    assert len(seen) == 2
    for batch in seen:
        _check_moved(batch, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_cuda_moves_model_and_batch() -> None:
    for batch in _run_on("cuda:0"):
        _check_moved(batch, torch.device("cuda:0"))


# --------------------------------------------------------------------------------------------
# loss errors and NaN


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (
            lambda loss: loss.expand(8),
            "loss_fn returned a tensor of shape (8,); "
            "reduce it to a scalar first, e.g. loss.mean()",
        ),
        (lambda loss: 0.5, "loss_fn returned float; return a scalar torch.Tensor loss"),
        (lambda loss: None, "loss_fn returned NoneType; return a scalar torch.Tensor loss"),
        (
            lambda loss: (loss, {}, 1),
            "loss_fn returned a tuple; return a scalar loss or (loss, dict_of_metrics)",
        ),
        (
            lambda loss: (loss, [1.0]),
            "loss_fn returned a tuple; return a scalar loss or (loss, dict_of_metrics)",
        ),
    ],
)
def test_bad_loss_raises_loss_error_with_one_clear_line(returned: Any, message: str) -> None:
    model = _model()
    before = _flat(model)
    loop = _loop(3, model=model, loss_fn=lambda m, b: returned(_mse(m, b)))
    with pytest.raises(LossError) as info:
        loop.fit()
    assert str(info.value) == message
    assert "\n" not in str(info.value)
    assert isinstance(info.value, LabError) and isinstance(info.value, TypeError)
    assert torch.equal(_flat(model), before)  # no step was taken


def test_a_one_element_loss_is_accepted() -> None:
    artifacts = _loop(2, loss_fn=lambda m, b: _mse(m, b).reshape(1, 1)).fit()
    assert artifacts.step == 2
    assert type(artifacts.metrics["loss"]) is float


def test_nan_loss_is_recorded_and_training_goes_on() -> None:
    calls = {"n": 0}

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls["n"] += 1
        loss = _mse(model, batch)
        return loss * float("nan") if calls["n"] == 2 else loss

    rows = StepRows()
    artifacts = _loop(4, loss_fn=loss_fn, callbacks=[rows]).fit()
    losses = [r["loss"] for r in rows.rows]
    assert len(losses) == 4
    assert math.isfinite(losses[0])
    assert math.isnan(losses[1])
    assert math.isnan(rows.rows[1]["grad_norm"])
    assert artifacts.step == 4
    assert calls["n"] == 4


# --------------------------------------------------------------------------------------------
# a bare loop's hooks


class LoopLog(
    Recorder,
    hooks=("on_train_start", "pre_step", "on_step_end", "on_eval", "on_benchmark_eval",
           "on_train_end", "close"),
):  # fmt: skip
    def note(self, hook: str, *args: Any, **kwargs: Any) -> tuple:
        if hook in ("pre_step", "on_step_end"):
            return (hook, args[1])
        if hook == "on_eval":
            return (hook, args[1], args[2], dict(args[3]))
        if hook == "on_benchmark_eval":
            return (hook, args[1].name, kwargs.get("step"), args[1].error)
        if hook == "on_train_end":
            return (hook, args[1].step)
        return (hook,)


def test_bare_loop_fires_its_hooks_and_close() -> None:
    log = LoopLog()
    artifacts = _loop(
        3,
        evaluators=[
            Evaluator("val", lambda m: {"loss": 2.0}, every=2),
            Evaluator("first", lambda m: {"acc": 0.0}, at_start=True, at_end=True),
        ],
        callbacks=[log],
    ).fit()
    assert log.calls == [
        ("on_train_start",),
        ("on_eval", 0, "first", {"acc": 0.0}),  # at_start: before any step
        ("pre_step", 1),
        ("on_step_end", 1),
        ("pre_step", 2),
        ("on_step_end", 2),
        ("on_eval", 2, "val", {"loss": 2.0}),
        ("pre_step", 3),
        ("on_step_end", 3),
        ("on_eval", 3, "first", {"acc": 0.0}),
        ("on_train_end", 3),
        ("close",),
    ]
    assert [(e.name, e.step) for e in artifacts.evals] == [("first", 0), ("val", 2), ("first", 3)]
    assert artifacts.metrics["val/loss"] == 2.0
    assert artifacts.metrics["first/acc"] == 0.0


# --------------------------------------------------------------------------------------------
# evaluators


def test_evaluator_runs_in_eval_mode_without_grad_then_training_resumes() -> None:
    in_eval: list[tuple[bool, bool]] = []
    in_train: list[tuple[bool, bool]] = []

    def fn(model: torch.nn.Module) -> dict[str, float]:
        in_eval.append((model.training, torch.is_grad_enabled()))
        return {"x": 1.0}

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        in_train.append((model.training, torch.is_grad_enabled()))
        return _mse(model, batch)

    model = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.Dropout(0.1))
    _loop(3, model=model, loss_fn=loss_fn, evaluators=[Evaluator("val", fn, every=1)]).fit()
    assert in_eval == [(False, False)] * 3
    assert in_train == [(True, True)] * 3
    assert model.training and model[1].training

    # a model already in eval mode stays so, and a raising fn still restores the mode
    model.eval()
    Evaluator("v", fn).run(model, None)
    assert not model.training
    model.train()
    with pytest.raises(RuntimeError):
        Evaluator("v", lambda m: (_ for _ in ()).throw(RuntimeError("x"))).run(model, 1)
    assert model.training


def test_a_failing_evaluator_does_not_stop_training() -> None:
    calls = {"n": 0}

    def flaky(model: torch.nn.Module) -> dict[str, float]:
        calls["n"] += 1
        if calls["n"] == 2:
            return {"acc": 1 / 0}
        return {"acc": 0.5}

    log = LoopLog()
    artifacts = _loop(
        3,
        evaluators=[Evaluator("val", flaky, every=1), Evaluator("bad", lambda m: [1], at_end=True)],
        callbacks=[log],
    ).fit()
    assert artifacts.step == 3
    assert [(e.name, e.step, e.metrics, e.error) for e in artifacts.evals] == [
        ("val", 1, {"acc": 0.5}, None),
        ("val", 2, {}, "ZeroDivisionError: division by zero"),
        ("val", 3, {"acc": 0.5}, None),
        (
            "bad",
            3,
            {},
            "TypeError: evaluator 'bad' returned list; return a dict of metrics or an EvalResult",
        ),
    ]
    evals = [c for c in log.calls if c[0] in {"on_eval", "on_benchmark_eval"}]
    assert evals == [
        ("on_eval", 1, "val", {"acc": 0.5}),
        ("on_benchmark_eval", "val", 2, "ZeroDivisionError: division by zero"),
        ("on_eval", 3, "val", {"acc": 0.5}),
        (
            "on_benchmark_eval",
            "bad",
            3,
            "TypeError: evaluator 'bad' returned list; return a dict of metrics or an EvalResult",
        ),
    ]


def test_a_failing_post_training_benchmark_keeps_the_run() -> None:
    log = LoopLog()

    def broken(model: torch.nn.Module) -> EvalResult:
        raise RuntimeError("no data")

    result = Experiment(
        "bench",
        lambda run: _loop(1).fit(run),
        benchmarks=[Evaluator("broken", broken), Evaluator("ok", lambda m: {"acc": 1.0})],
        callbacks=[log],
        store=False,
    ).run()
    (run,) = result.runs
    assert run.status == "completed"
    assert run.metrics["ok/acc"] == 1.0
    assert "broken/acc" not in run.metrics
    assert [c for c in log.calls if c[0] == "on_benchmark_eval"] == [
        ("on_benchmark_eval", "broken", None, "RuntimeError: no data"),
        ("on_benchmark_eval", "ok", None, None),
    ]


def test_evaluator_results_and_schedule() -> None:
    ev = Evaluator("v", lambda m: {"t": torch.tensor(0.25), "n": None, "i": 3})
    res = ev.run(_model(), 7)
    assert (res.name, res.step, res.error) == ("v", 7, None)
    assert res.metrics["t"] == 0.25 and res.metrics["i"] == 3.0 and math.isnan(res.metrics["n"])
    named = Evaluator("fallback", lambda m: EvalResult("", {"a": 1.0})).run(_model(), None)
    assert (named.name, named.step) == ("fallback", None)

    sched = Evaluator("s", lambda m: {}, every=3, at_steps=[5], at_end=True)
    assert [s for s in range(1, 11) if sched.due(s, num_steps=10)] == [3, 5, 6, 9, 10]
    assert not any(Evaluator("n", lambda m: {}).due(s, num_steps=4) for s in range(1, 5))


# --------------------------------------------------------------------------------------------
# checkpoints


class Stateful(Callback):
    def __init__(self) -> None:
        self.seen = 0

    def on_step_end(
        self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch, metrics: dict
    ) -> None:
        self.seen += 1

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def test_checkpoints_are_atomic_recorded_and_retained(tmp_path: Path) -> None:
    run_dir = tmp_path / "run1"
    root = run_dir / "checkpoints"
    root.mkdir(parents=True)
    (root / "tmp_step_000002").mkdir()  # debris of an interrupted save
    (root / "tmp_step_000002" / "junk").write_text("x")

    rows: list[ManifestRow] = []

    class Rows(Callback):
        def on_checkpoint(self, state: lab.LoopState, row: ManifestRow) -> None:
            assert row.to_json() in (root / "manifest.jsonl").read_text().splitlines()
            rows.append(row)

    counter = Stateful()
    artifacts = _loop(
        6,
        checkpoint=CheckpointConfig(every=2, keep_last=2),
        callbacks=[Rows(), counter],
    ).fit(run_dir=run_dir)

    assert [(r.event, r.step, r.path, r.reason, r.run_key) for r in rows] == [
        ("save", 2, "step_000002", None, "run1"),
        ("save", 4, "step_000004", None, "run1"),
        ("save", 6, "step_000006", None, "run1"),
        ("remove", 2, "step_000002", "keep_last=2", "run1"),
    ]
    assert all("loss" in r.metrics for r in rows if r.event == "save")
    assert rows[3].metrics == {}
    manifest = (root / "manifest.jsonl").read_text().splitlines()
    assert [ManifestRow.from_json(line) for line in manifest] == rows
    assert artifacts.checkpoints == rows
    assert artifacts.checkpoint_dir == root

    assert sorted(p.name for p in root.iterdir()) == [
        "latest",
        "manifest.jsonl",
        "step_000004",
        "step_000006",
    ]
    assert (root / "latest").read_text() == "step_000006"
    for name in ("step_000004", "step_000006"):
        assert sorted(p.name for p in (root / name).iterdir()) == [
            "COMPLETE",
            "state.pt",
            "training_info.json",
        ]
    info = json.loads((root / "step_000006" / "training_info.json").read_text())
    assert (info["step"], info["run_key"]) == (6, "run1")
    assert info["metrics"] == rows[2].metrics

    state = torch.load(root / "step_000006" / "state.pt", weights_only=False)
    assert set(state) == {
        "model", "optimizer", "scheduler", "scaler", "loop", "metrics", "last_metrics",
        "eval_metrics", "rng", "epoch_rng", "retention", "callbacks", "objects", "user",
    }  # fmt: skip
    assert state["loop"] == {
        "step": 6, "epoch": 2, "batch_in_epoch": 2, "epoch_open": False, "epochs_started": 0,
    }  # fmt: skip
    assert state["scheduler"] is None
    assert state["callbacks"] == {"Stateful": {"seen": 6}}
    final = artifacts.model.state_dict()
    assert all(torch.equal(state["model"][k], final[k]) for k in final)
    early = torch.load(root / "step_000004" / "state.pt", weights_only=False)
    assert early["callbacks"] == {"Stateful": {"seen": 4}}
    assert early["loop"]["step"] == 4

    # the manifest is the record: a new manager sees what is kept; incomplete saves are ignored
    (root / "step_000009").mkdir()
    manager = CheckpointManager(root, CheckpointConfig(keep_last=2), "run1")
    assert manager.saved == [4, 6]
    assert manager.latest_path() == root / "step_000006"


def test_checkpoints_under_an_experiment_go_in_the_run_folder() -> None:
    def train(run: lab.RunSpec) -> LoopArtifacts:
        return _loop(2, checkpoint=CheckpointConfig()).fit(run)

    result = Experiment("ck", train, arms=[lab.Arm("a b")], store=False).run()
    (run,) = result.runs
    assert run.artifacts is not None
    root = Path("runs") / "ck" / run.run_key / "checkpoints"
    assert run.artifacts.checkpoint_dir.resolve() == root.resolve()
    assert [(r.event, r.step, r.run_key) for r in run.artifacts.checkpoints] == [
        ("save", 2, run.run_key)
    ]
    assert (root / "step_000002" / "COMPLETE").exists()


def test_checkpoints_need_a_folder() -> None:
    with pytest.raises(ConfigError, match="checkpoints need a folder"):
        _loop(2, checkpoint=CheckpointConfig()).fit()


# --------------------------------------------------------------------------------------------
# settings


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_steps": 0}, "num_steps=0: give the number of steps"),
        ({"num_steps": 2.0}, "num_steps=2.0: give the number of steps"),
        ({"num_steps": True}, "num_steps=True: give the number of steps"),
        ({"grad_clip": 0.0}, "grad_clip=0.0: use a positive max norm"),
        ({"grad_clip": -1.0}, "grad_clip=-1.0: use a positive max norm"),
        (
            {"evaluators": [Evaluator("v", dict), Evaluator("v", dict)]},
            "evaluator names must be unique",
        ),
    ],
)
def test_loop_settings_are_validated(kwargs: dict[str, Any], message: str) -> None:
    kwargs = dict(kwargs)
    num_steps = kwargs.pop("num_steps", 2)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        _loop(num_steps, **kwargs)


def test_checkpoint_and_evaluator_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"CheckpointConfig\(every=0\)"):
        CheckpointConfig(every=0)
    with pytest.raises(ConfigError, match=r"CheckpointConfig\(keep_last=0\) would keep nothing"):
        CheckpointConfig(keep_last=0)
    with pytest.raises(ConfigError, match="Evaluator needs a non-empty name"):
        Evaluator("", dict)
    with pytest.raises(ConfigError, match="every=0 must be >= 1"):
        Evaluator("v", dict, every=0)


def test_a_loss_that_does_not_require_grad_is_a_loss_error() -> None:
    model = _model()
    before = _flat(model)
    loop = _loop(2, model=model, loss_fn=lambda m, b: _mse(m, b).detach())
    with pytest.raises(LossError, match="does not require grad"):
        loop.fit()
    assert torch.equal(_flat(model), before)


class OwnEnd(Callback):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_error(self, ctx: lab.LogContext, exc: BaseException) -> None:
        self.calls.append(f"on_error:{exc}")

    def close(self) -> None:
        self.calls.append("close")


@pytest.mark.parametrize("fails", [False, True])
def test_loop_callbacks_under_an_experiment_get_on_error_and_close(fails: bool) -> None:
    own, outer = OwnEnd(), OwnEnd()

    def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if fails:
            raise RuntimeError("boom")
        return _mse(model, batch)

    def train(run: lab.RunSpec) -> LoopArtifacts:
        return _loop(2, loss_fn=loss, callbacks=[own]).fit(run)

    result = lab.Experiment("own", train, repeats=2, callbacks=[outer], store=False).run()
    assert [r.status for r in result.runs] == (["failed"] * 2 if fails else ["completed"] * 2)
    per_run = ["on_error:boom", "close"] if fails else ["close"]
    assert own.calls == per_run * 2  # the loop closes its own callbacks after every fit
    # the experiment's callbacks: on_error per failed run, close once at the very end
    assert outer.calls == (["on_error:boom"] * 2 if fails else []) + ["close"]
