"""One run's evals inside its loop: run each evaluator when due, fire its hooks, keep its values.

The run handle asks `RunEvals` to run the evaluators due after a step (or one the loop runs
itself). Each eval fires `on_eval`, and `on_benchmark_eval` when it carries more than metrics;
one that raises becomes a failed eval reported through `on_benchmark_eval`, and training goes
on. The last value of each eval metric (``"val/loss"``) is kept for the run's final metrics,
and the values measured at the current step for the save that follows it: a save never
carries an older eval's value as if it were its own.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lab._secrets import logger
from lab.errors import CheckpointError
from lab.hooks import Hook
from lab.loop.evals import Evaluator
from lab.loop.metric_names import MetricWatch
from lab.records import EvalResult

if TYPE_CHECKING:
    from lab.dispatch import Dispatcher
    from lab.hooks import LoopState

__all__ = ["RunEvals"]

log = logger("lab.loop")


class RunEvals:
    """The evaluators of one run, their results (`results`) and the last value of each eval
    metric (`metrics`, by ``"name/key"``). `attach` gives it the run's state and callbacks
    once the handle starts, and the watch of needed metric names, if any."""

    def __init__(
        self, evaluators: Sequence[Evaluator], device: Any, metrics: dict[str, float]
    ) -> None:
        self.evaluators = evaluators
        self.device = device
        self.results: list[EvalResult] = []
        self.metrics = metrics
        self._fresh: dict[str, float] = {}  # eval metrics measured at `_fresh_step`
        self._fresh_step = -1
        self.watch: MetricWatch | None = None

    def attach(self, state: LoopState, hooks: Dispatcher, watch: MetricWatch | None) -> None:
        """The run's state and callbacks, and the lookup of needed names to feed."""
        self.state, self.hooks, self.watch = state, hooks, watch

    def run_due(self, step: int, num_steps: int, steps_per_epoch: int | None) -> None:
        """Run the evaluators due after `step` (an epoch's end counts for `every_epochs`)."""
        spe = steps_per_epoch
        epoch_end = step // spe if spe is not None and step % spe == 0 else None
        for evaluator in self.evaluators:
            if evaluator.due(step, num_steps=num_steps, epoch_end=epoch_end):
                self.run(evaluator, step)

    def run_at_start(self) -> None:
        """Run the `at_start` evaluators, which score the untrained model, at step 0."""
        for evaluator in self.evaluators:
            if evaluator.at_start:
                self.run(evaluator, 0)

    def run(self, evaluator: Evaluator, step: int) -> EvalResult:
        """Run `evaluator` at `step`, fire its hooks, keep its result and its values."""
        result = self._evaluate(evaluator, step)
        self.results.append(result)
        if result.error is None:
            if self.watch is not None:
                self.watch.after_eval(result.name, step, result.metrics, self.state.metrics)
            named = {f"{result.name}/{k}": v for k, v in result.metrics.items()}
            self.metrics.update(named)
            if self._fresh_step != step:
                self._fresh, self._fresh_step = {}, step
            self._fresh.update(named)
        return result

    def log(
        self,
        name: str,
        metrics: Mapping[str, Any],
        predictions: Sequence[Mapping[str, Any]] | None,
        step: int,
    ) -> EvalResult:
        """Record an evaluation the loop ran itself, at `step`, as one that ran here."""
        preds = [dict(p) for p in predictions] if predictions is not None else []
        result = EvalResult(
            name, {str(k): v for k, v in metrics.items()}, predictions=preds, step=step
        )
        return self.run(Evaluator(name, lambda _model: result), step)

    def _evaluate(self, evaluator: Evaluator, step: int) -> EvalResult:
        """Run one evaluator and fire its hooks; one that raises becomes a failed eval (its
        error and how long it ran), reported through `on_benchmark_eval`, and training goes
        on. While `on_eval` fires, `state.current_eval` is the whole result, so a sink can
        record its wall time and tags."""
        state, hooks = self.state, self.hooks
        started = time.perf_counter()
        try:
            result = evaluator.run(state.model, step, state=state, device=self.device)
        except Exception as exc:
            log.exception("evaluator %r failed at step %d; training goes on", evaluator.name, step)
            result = EvalResult(
                evaluator.name,
                {},
                step=step,
                seconds=time.perf_counter() - started,
                error=f"{type(exc).__name__}: {exc}",
            )
            hooks.fire(Hook.BENCHMARK_EVAL, state.ctx, result, [], step=step)
            return result
        state.current_eval = result
        try:
            hooks.fire(Hook.EVAL, state, step, result.name, result.metrics)
        finally:
            state.current_eval = None
        if result.benchmark:
            hooks.fire(Hook.BENCHMARK_EVAL, state.ctx, result, result.predictions, step=step)
        return result

    def fresh(self) -> dict[str, float]:
        """The values measured at the current step: its step metrics and the evals that ran
        at it."""
        state = self.state
        fresh = dict(state.metrics) if state.step > 0 else {}
        if self._fresh_step == state.step:
            fresh.update(self._fresh)
        return fresh

    def check_ranked(
        self, metric: str | None, fresh: dict[str, float], seen: set[str], may_log_steps: bool
    ) -> None:
        """A save without a fresh value of the ranking metric is unranked, which is normal
        between evals; but a metric that nothing has logged, and nothing that already ran
        can log, is a misnamed one: fail before anything is written. `seen` holds the step
        metric names logged so far; `may_log_steps` says whether the step metrics may still
        bring it."""
        if metric is None or metric in fresh or metric in seen:
            return
        if metric in self.metrics or self._may_log(metric, may_log_steps):
            return
        logged = sorted({*fresh, *seen, *self.metrics})
        raise CheckpointError(
            f"CheckpointConfig(metric={metric!r}) ranks saves, but nothing logged {metric!r} "
            f"before the save at step {self.state.step} (logged: {logged}); log it before "
            "the save (loop.end_step, loop.log_eval, or an Evaluator), or fix the name"
        )

    def _may_log(self, metric: str, may_log_steps: bool) -> bool:
        """Whether something may still log `metric`: an evaluator of that name that has not
        run yet (or declares it), or the step metrics."""
        head, _, tail = metric.partition("/")
        for ev in self.evaluators:
            if ev.name != head:
                continue
            if ev.metrics is not None:
                return tail in ev.metrics
            ran = any(r.name == head and r.error is None for r in self.results)
            return not ran  # an evaluator that ran and logged no such key never will
        return may_log_steps
