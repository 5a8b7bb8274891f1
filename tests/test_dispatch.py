"""The dispatcher's order of a step's metrics and its check of what callbacks put there.

Producers of step metrics (a non-empty `metrics_logged`) run their `on_step_end` before every
other callback, whatever the priority numbers; what any callback adds to the step's metrics
must be a number, or it is refused with an error that names the callback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa
import torch

from lab import Callback, Experiment, LoopArtifacts, RunSpec, TrainingLoop
from lab.dispatch import Dispatcher
from lab.errors import CallbackError, MetricError, RefusedMetric
from lab.store.engine import resolve_url

STEPS = 4


def _train(run: RunSpec) -> LoopArtifacts:
    gen = torch.Generator().manual_seed(run.seed)
    x = torch.randn(8, 3, generator=gen)
    model = torch.nn.Linear(3, 1)
    return TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        [(x, x.sum(1, keepdim=True))],
        lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        STEPS,
    ).fit(run)


def _rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    engine = sa.create_engine(resolve_url(url))
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(sql))]
    finally:
        engine.dispose()


class Doubler(Callback):
    """A producer that declares its key and, by its priority, would run last of all."""

    priority = -1000
    metrics_logged = ("extra/double_loss",)

    def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: dict) -> None:
        metrics["extra/double_loss"] = 2 * metrics["loss"]


class Seen(Callback):
    """A consumer of a high priority: keeps a copy of each step's metrics as it sees them."""

    def __init__(self, priority: int = 1000) -> None:
        self.priority = priority  # type: ignore[misc]
        self.steps: dict[int, dict[str, Any]] = {}

    def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: dict) -> None:
        self.steps[step_idx] = dict(metrics)


def test_a_producer_of_the_lowest_priority_still_runs_before_the_store_and_consumers(
    store_url: str, tmp_path: Path
) -> None:
    seen = Seen(priority=1000)
    result = Experiment("order", _train, callbacks=[Doubler(), seen], store=store_url,
                        output_dir=tmp_path).run()  # fmt: skip
    assert result.runs[0].status == "completed"
    stored = _rows(
        store_url,
        "SELECT m.step, m.value, l.value FROM metrics m JOIN metrics l "
        "ON l.run_id = m.run_id AND l.step = m.step AND l.key = 'loss' "
        "WHERE m.key = 'extra/double_loss' ORDER BY m.step",
    )
    assert [step for step, _, _ in stored] == [1, 2, 3, 4]
    assert all(double == 2 * loss for _, double, loss in stored)
    assert sorted(seen.steps) == [1, 2, 3, 4]
    assert [seen.steps[s]["extra/double_loss"] for s in range(1, 5)] == [
        double for _, double, _ in stored
    ]


def _tracer(name: str, priority: int, produces: bool, calls: list[str]) -> Callback:
    class Traced(Callback):
        def on_train_start(self, state: Any) -> None:
            calls.append(name)

        def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: dict) -> None:
            calls.append(name)

    cb = Traced()
    cb.priority = priority  # type: ignore[misc]
    if produces:
        cb.metrics_logged = (f"{name}/*",)
    return cb


def test_producers_first_then_consumers_each_group_by_priority_in_on_step_end_only() -> None:
    calls: list[str] = []
    d = Dispatcher(
        [
            _tracer("c_low", -100, False, calls),
            _tracer("p_low", -5, True, calls),
            _tracer("c_high", 100, False, calls),
            _tracer("p_high", 3, True, calls),
            _tracer("p_tie", 3, True, calls),
        ]
    )
    d.fire("on_step_end", None, 1, None, {})
    assert calls == ["p_high", "p_tie", "p_low", "c_high", "c_low"]
    calls.clear()
    d.fire("on_train_start", None)  # other hooks keep the plain priority order
    assert calls == ["c_high", "p_high", "p_tie", "p_low", "c_low"]


class GradNorms(Callback):
    """Puts a vector into the step's metrics at `bad_step`, and good values at every step."""

    metrics_logged = ("grad/*",)

    def __init__(self, bad_step: int | None = None) -> None:
        self.bad_step = bad_step

    def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: dict) -> None:
        metrics["grad/total"] = torch.tensor(0.5 * step_idx)  # 0-d: becomes a float
        if self.bad_step is None or step_idx == self.bad_step:
            metrics["grad/w"] = torch.ones(3)
        metrics["grad/np"] = np.float32(0.25)  # a numpy scalar: becomes a float


MESSAGE = (
    "GradNorms put metrics['grad/w'] = Tensor(shape=(3,)) into the step's scalar metrics at "
    "step {step}; log a float (tensor.item()), or a histogram with loop.log_histogram"
)


def test_a_tensor_a_callback_puts_into_the_metrics_is_refused_with_its_name(
    store_url: str, tmp_path: Path
) -> None:
    seen = Seen(priority=-1)
    result = Experiment("refused", _train, callbacks=[GradNorms(bad_step=3), seen],
                        store=store_url, output_dir=tmp_path, strict=False).run()  # fmt: skip
    (run,) = result.runs
    assert run.status == "completed"  # refused like a raising callback: the run goes on
    assert [(f["callback"], f["hook"], f["error"], f["count"]) for f in run.callback_errors] == [
        ("GradNorms", "on_step_end", "RefusedMetric: " + MESSAGE.format(step=3), 1)
    ]
    # the good values of that same step are kept, as floats; the vector reached nobody
    assert all("grad/w" not in m for m in seen.steps.values())
    assert [seen.steps[s]["grad/total"] for s in range(1, 5)] == [0.5, 1.0, 1.5, 2.0]
    assert {type(m["grad/total"]) for m in seen.steps.values()} == {float}
    assert {m["grad/np"] for m in seen.steps.values()} == {0.25}
    stored = _rows(store_url, "SELECT key, step, value FROM metrics WHERE key LIKE 'grad/%' "
                   "ORDER BY key, step")  # fmt: skip
    assert stored == [("grad/np", s, 0.25) for s in range(1, 5)] + [
        ("grad/total", s, 0.5 * s) for s in range(1, 5)
    ]


def test_strict_mode_raises_the_refusal_itself() -> None:
    d = Dispatcher([GradNorms()], strict=True)
    metrics: dict[str, Any] = {"loss": 1.0}
    with pytest.raises(RefusedMetric) as info:
        d.fire("on_step_end", None, 7, None, metrics)
    assert str(info.value) == MESSAGE.format(step=7)
    assert isinstance(info.value, MetricError) and not isinstance(info.value, CallbackError)
    assert metrics == {"loss": 1.0, "grad/total": 3.5, "grad/np": 0.25}


def test_a_refusal_counts_toward_disabling_the_callback() -> None:
    d = Dispatcher([GradNorms()], strict=False, max_failures=2)
    for step in (1, 2):
        d.fire("on_step_end", None, step, None, {"loss": 1.0})
    assert [type(cb).__name__ for cb in d.disabled()] == ["GradNorms"]
    assert [(f.count, f.disabled) for f in d.failures] == [(2, True)]


class Noter(Callback):
    """A consumer (nothing declared) that adds a string and a few values to the metrics."""

    def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: dict) -> None:
        metrics["note"] = "fine"
        metrics["bad"] = [1, 2]
        metrics["ok"] = 1


def test_a_consumer_that_adds_non_numbers_is_refused_too() -> None:
    metrics: dict[str, Any] = {"loss": 1.0}
    with pytest.raises(RefusedMetric, match=r"^Noter put metrics\['note'\] = str 'fine' into "
                       r"the step's scalar metrics at step 2 \(and 1 more\);"):  # fmt: skip
        Dispatcher([Noter()], strict=True).fire("on_step_end", None, 2, None, metrics)
    assert metrics == {"loss": 1.0, "ok": 1.0} and type(metrics["ok"]) is float


def test_a_critical_callback_fails_the_run_with_the_refusal() -> None:
    critical = GradNorms()
    critical.critical = True
    with pytest.raises(RefusedMetric, match=r"^GradNorms put metrics"):
        Dispatcher([critical], strict=False).fire("on_step_end", None, 1, None, {})


def _lab_imports(module: str) -> set[str]:
    import ast

    import lab

    path = Path(lab.__file__).parent / f"{module.removeprefix('lab.').replace('.', '/')}.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return {name for name in names if name.split(".")[0] == "lab"}


def test_the_hook_vocabulary_does_not_import_the_dispatcher() -> None:
    assert "lab.dispatch" not in _lab_imports("lab.hooks")  # no circle: dispatch builds on hooks
    assert "lab.hooks" in _lab_imports("lab.dispatch")
