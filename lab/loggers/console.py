"""`ConsoleLogger`: plain progress lines and a short summary per run and per experiment."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, TextIO

from lab.errors import ConfigError
from lab.hooks import Callback, LogContext, LoopState

if TYPE_CHECKING:
    from lab.experiment import ArmResult, ExperimentResult, RunResult
    from lab.loop.training import TrainingBatch


class ConsoleLogger(Callback):
    """Prints a line every `every` steps and at each run's end, then the experiment summary.

    `metrics` picks which step metrics the progress line shows.
    """

    def __init__(
        self,
        every: int = 100,
        metrics: tuple[str, ...] = ("loss",),
        stream: TextIO | None = None,
        summary_metric: str | None = None,
        summary_mode: str = "min",
    ) -> None:
        if every < 1:
            raise ConfigError(f"ConsoleLogger(every={every}): use a value >= 1")
        self.every = every
        self.metrics = metrics
        self.stream = stream
        self.summary_metric = summary_metric
        self.summary_mode = summary_mode
        self._started = 0.0

    def _print(self, text: str) -> None:
        print(text, file=self.stream or sys.stdout, flush=True)

    def on_train_start(self, state: LoopState) -> None:
        self._started = time.perf_counter()

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        if step_idx % self.every and step_idx != state.num_steps:
            return
        rate = step_idx / max(time.perf_counter() - self._started, 1e-9)
        shown = "  ".join(f"{k}={metrics[k]:.4g}" for k in self.metrics if k in metrics)
        who = state.ctx.run_key or "loop"
        self._print(f"{who}  step {step_idx}/{state.num_steps}  {shown}  ({rate:.0f} steps/s)")

    def on_run_end(self, ctx: LogContext, run_result: RunResult, arm: ArmResult) -> None:
        shown = "  ".join(
            f"{k}={run_result.metrics[k]:.4g}" for k in self.metrics if k in run_result.metrics
        )
        line = f"{run_result.run_key}  {run_result.status}  {shown}  {run_result.seconds:.1f}s"
        if run_result.error:
            line += f"  error: {run_result.error}"
        self._print(line)

    def on_experiment_end(self, ctx: LogContext, result: ExperimentResult) -> None:
        self._print(str(result.summary(self.summary_metric, self.summary_mode)))  # type: ignore[arg-type]
