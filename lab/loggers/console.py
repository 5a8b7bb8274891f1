"""`ConsoleLogger`: live progress while runs train, and a short summary when they end.

On a terminal it draws a `rich.progress` display: one bar per running run (step, rate, ETA
and the chosen metrics) under one for the experiment (runs done / total). Anywhere else (a
log file, CI, a notebook, a worker process) it prints plain lines at an interval of steps
and/or seconds, because redrawn bars there turn into thousands of lines of noise. Both end
each run with one summary line and the experiment with `ExperimentResult.summary`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
)
from rich.text import Text

from lab._secrets import mask
from lab._table import plural
from lab.callbacks.params import PositiveFloat, PositiveInt
from lab.callbacks.registry import register
from lab.errors import ConfigError
from lab.hooks import EXECUTOR, FINISHED_BEFORE, RUNS, Callback, LogContext, LoopState, Phase

if TYPE_CHECKING:
    from lab.records import ArmResult, ExperimentResult, RunResult, TrainingBatch


@dataclass
class _Live:
    """What the logger tracks of one running run."""

    num_steps: int
    started: float  # perf_counter at on_train_start
    first_step: int  # the step it started (or resumed) from, so the rate counts this fit only
    step: int = 0
    printed_at: float = 0.0
    # The newest step's metrics dict itself, not a copy: the loop makes a new one per step,
    # so a step costs the logger one assignment; only a printed line reads it.
    step_metrics: Mapping[str, float] = field(default_factory=dict)
    # "<eval>/<key>" -> (its newest value, the step that eval ran at)
    eval_metrics: dict[str, tuple[float, int]] = field(default_factory=dict)
    task: Any = None  # its rich TaskID

    def text(self, chosen: tuple[str, ...]) -> str:
        """The chosen metrics: a step metric as ``loss=0.31`` (it is this step's), an eval's
        as ``val/loss=0.29@40`` with the step it was measured at, never as if it were
        current (a step's line is printed before the evals due at that step run)."""
        parts = []
        for key in chosen:
            if key in self.step_metrics:
                parts.append(f"{key}={self.step_metrics[key]:.4g}")
            elif key in self.eval_metrics:
                value, at = self.eval_metrics[key]
                parts.append(f"{key}={value:.4g}@{at}")
        return "  ".join(parts)

    def rate(self, now: float) -> float | None:
        done = self.step - self.first_step
        elapsed = now - self.started
        return done / elapsed if done > 0 and elapsed > 0 else None


@register("console_logger", live=("stream", "console"))
class ConsoleLogger(Callback):
    """Shows each run's progress and ends each run and the experiment with a summary.

    `metrics` picks the step and eval metrics to show (an eval's as ``"<eval>/<key>"``).
    `progress` chooses the display: True draws rich bars, False prints plain lines, None
    (the default) draws bars only when the output is a terminal. Plain lines come every
    `every` steps, at the last step, and, with `every_s`, whenever that many seconds passed
    since the run's last line (so a slow run still shows signs of life). `stream` (default
    ``sys.stdout``) or a rich `console` say where it writes. The experiment ends with one
    summary (`ExperimentResult.summary`), ranked by `summary_metric` (`summary_mode` "min"
    or "max") when given, else by the experiment's own metric and mode
    (``Experiment(metric=..., mode=...)``, an experiment file's ``summary:``), else by
    ``val/loss`` or ``loss``; with ``summary=False`` it ends with its status line only, for a
    caller that prints the summary itself (``lab run`` and ``lab quickstart`` do).
    """

    phase = Phase.REPORT  # after the loggers that record: the run-end line shows their ids
    rank_zero_only = True  # under DDP: one display per run, on rank 0
    run_end_in_parent = True  # under a process pool, the parent counts the runs as they end

    def __init__(
        self,
        every: PositiveInt = 100,
        metrics: tuple[str, ...] = ("loss",),
        stream: TextIO | None = None,
        summary_metric: str | None = None,
        summary_mode: Literal["min", "max"] | None = None,
        *,
        every_s: PositiveFloat | None = None,
        progress: bool | None = None,
        console: Console | None = None,
        summary: bool = True,
    ) -> None:
        self.every = every
        self.every_s = every_s
        self.metrics = tuple(metrics)
        self.stream = stream
        self.summary_metric = summary_metric
        self.summary_mode: Literal["min", "max"] | None = summary_mode
        self.progress = progress
        self.console = console
        self.summary = summary
        self._bars: Progress | None = None
        self._experiment_task: TaskID | None = None
        self._live: dict[str | None, _Live] = {}  # by run key (LogContext types it optional)
        self._total = 0  # runs the experiment will run (as its plan says now)
        self._done = 0
        self._in_worker = False
        self._counting = True  # False while a process pool runs the runs elsewhere

    def __getstate__(self) -> dict[str, Any]:
        """Pickle for a worker process (``executor="processes"``): without the live display,
        and printing plain lines there, since several processes cannot share one display."""
        state = self.__dict__.copy()
        state.update(_bars=None, _experiment_task=None, _live={}, console=None, _in_worker=True)
        return state

    # -- experiment level ----------------------------------------------------------------
    def on_experiment_start(self, ctx: LogContext) -> None:
        arms = ctx.config.get("arms") or {}
        repeats = ctx.config.get("repeats", 1)
        self._total = int(ctx.extras.get(RUNS) or max(len(arms), 1) * int(repeats))
        self._done = int(ctx.extras.get(FINISHED_BEFORE) or 0)  # skipped: they never end here
        # Under a process pool the workers print their runs' step lines to the same output,
        # which a redrawn display here would garble: plain lines, one per run as it ends.
        self._counting = ctx.extras.get(EXECUTOR) != "processes"
        # a bare fit's experiment declares no arms: it is just its one run
        parts = [f"{plural(len(arms), 'arm')} x {plural(int(repeats), 'repeat')}"] if arms else []
        if self._done:
            parts.append(f"{self._done} finished before")
        if self._use_bars() and self._counting:
            bars = self._start_bars()
            self._experiment_task = bars.add_task(
                f"[bold]{ctx.experiment}", total=self._total, completed=self._done,
                kind="experiment",
            )  # fmt: skip
        else:
            shown = f" ({'; '.join(parts)})" if parts else ""
            self._print(f"{ctx.experiment}: {plural(self._total, 'run')}{shown}")

    def on_run_end(self, ctx: LogContext, run_result: RunResult, arm: ArmResult) -> None:
        live = self._live.pop(run_result.run_key, None)
        if self._in_worker:  # the parent prints the line, with the count of runs done
            return
        line = self.run_line(run_result, live)
        self._done += 1
        # the runs planned now: fewer once a race drops arms, more as a sweep adds them
        self._total = max(int(ctx.extras.get(RUNS) or self._total), self._done)
        line += f"  [{self._done}/{plural(self._total, 'run')}]"
        url = ctx.extras.get("wandb:url")
        if url:
            line += f"  {url}"
        if self._bars is not None:
            if live is not None and live.task is not None:
                self._bars.remove_task(live.task)
            if self._experiment_task is not None:
                self._bars.update(self._experiment_task, completed=self._done, total=self._total)
            self._bars.console.print(line, markup=False, highlight=False)
        else:
            self._print(line)

    def on_experiment_end(self, ctx: LogContext, result: ExperimentResult) -> None:
        self._stop_bars()
        text = f"{result.name}: {result.status} in {_duration(result.seconds)}"
        if self.summary:
            try:
                summary = result.summary(self.summary_metric, self.summary_mode)
            except ConfigError:  # e.g. every run failed, so the metric was never recorded
                summary = result.summary(mode=self.summary_mode)
            text = f"{summary}\n{text}"
        self._print(text)

    def close(self) -> None:
        self._stop_bars()  # never leave the display's refresh thread running

    # -- loop level ----------------------------------------------------------------------
    def on_train_start(self, state: LoopState) -> None:
        key = state.ctx.run_key
        now = time.perf_counter()
        live = _Live(state.num_steps, now, state.step, state.step, now)
        self._live[key] = live
        if self._use_bars():
            bars = self._start_bars()
            live.task = bars.add_task(
                str(key), total=state.num_steps, completed=state.step, kind="run", live=live
            )

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        live = self._live.get(state.ctx.run_key)
        if live is None:
            return
        live.step = step_idx
        live.step_metrics = metrics
        if live.task is not None and self._bars is not None:
            self._bars.update(live.task, completed=step_idx)  # drawn by rich's refresh thread
            return
        due = step_idx % self.every == 0 or step_idx == live.num_steps
        every_s = self.every_s
        if not due and every_s is None:
            return  # most steps: no clock read, no string
        now = time.perf_counter()
        if due or (every_s is not None and now - live.printed_at >= every_s):
            live.printed_at = now
            self._print(self.step_line(state.ctx.run_key, live, now))

    def on_eval(
        self, state: LoopState, step_idx: int, eval_name: str, metrics: dict[str, float]
    ) -> None:
        live = self._live.get(state.ctx.run_key)
        if live is not None:
            live.eval_metrics.update(
                {f"{eval_name}/{k}": (v, step_idx) for k, v in metrics.items()}
            )

    # -- text ----------------------------------------------------------------------------
    def step_line(self, key: str | None, live: _Live, now: float) -> str:
        """One plain progress line: run, step, chosen metrics, rate and ETA."""
        parts = [f"{key}  step {live.step}/{live.num_steps}"]
        shown = live.text(self.metrics)
        if shown:
            parts.append(shown)
        rate = live.rate(now)
        if rate is not None:
            eta = (live.num_steps - live.step) / rate
            parts.append(f"{_rate(rate)}  ETA {_duration(eta)}")
        return "  ".join(parts)

    def run_line(self, run_result: RunResult, live: _Live | None = None) -> str:
        """The line a run ends with: status, chosen final metrics, time, and any error. With
        what this logger saw of the run (`live`), a final eval value from an eval that ran
        before the run's last step shows that step (``val/loss=0.29@40``)."""
        parts = [run_result.run_key, run_result.status]
        last = live.step if live is not None else None
        shown = _metrics_text(run_result.metrics, self.metrics, live, last)
        if shown:
            parts.append(shown)
        parts.append(_duration(run_result.seconds))
        if run_result.error:
            parts.append(f"error: {mask(run_result.error)}")
        return "  ".join(parts)

    # ------------------------------------------------------------------------------------
    def _print(self, text: str) -> None:
        if self.console is not None and not self._in_worker:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=self.stream or sys.stdout, flush=True)

    def _use_bars(self) -> bool:
        if self._in_worker or self.progress is False:
            return False
        if self.progress is True:
            return True
        return self._console().is_terminal

    def _console(self) -> Console:
        if self.console is None:
            # Not cached: sys.stdout may be swapped (pytest, notebooks) after construction.
            return Console(file=self.stream or sys.stdout)
        return self.console

    def _start_bars(self) -> Progress:
        if self._bars is None:
            self._bars = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                _RateEtaColumn(),
                _MetricsColumn(self.metrics),
                console=self._console(),
                refresh_per_second=4,
            )
            self._bars.start()
        return self._bars

    def _stop_bars(self) -> None:
        bars, self._bars, self._experiment_task = self._bars, None, None
        if bars is not None:
            bars.stop()


def _metrics_text(
    values: Mapping[str, float],
    chosen: tuple[str, ...],
    live: _Live | None = None,
    last_step: int | None = None,
) -> str:
    """The chosen final metrics; one that is the value of an in-loop eval `live` saw run
    before `last_step` carries that eval's step."""
    parts = []
    for key in chosen:
        if key not in values:
            continue
        value = values[key]
        text = f"{key}={value:.4g}"
        seen = live.eval_metrics.get(key) if live is not None else None
        if seen is not None and seen[1] != last_step and _same(seen[0], value):
            text += f"@{seen[1]}"
        parts.append(text)
    return "  ".join(parts)


def _same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)  # NaN is data: the same NaN eval is the same value


def _rate(rate: float) -> str:
    return f"{rate:.1f} steps/s" if rate < 10 else f"{rate:.0f} steps/s"


def _duration(seconds: float) -> str:
    """``4.2s`` under a minute, else ``1:02:03`` / ``2:03``: readable at a glance."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class _RateEtaColumn(ProgressColumn):
    """A run's steps/s and time left; blank for the experiment's bar."""

    def render(self, task: Task) -> Text:
        if task.fields.get("kind") != "run" or not task.speed:
            return Text("")
        # Not task.time_remaining: rich rounds it up to whole seconds, so a run a second
        # from its end would always show "1.0s".
        left = (task.total - task.completed) / task.speed if task.total is not None else None
        eta = f"  ETA {_duration(left)}" if left is not None else ""
        return Text(f"{_rate(task.speed)}{eta}", style="progress.data.speed")


class _MetricsColumn(ProgressColumn):
    """A run's chosen metrics, read at each refresh (4 a second) from what the logger keeps
    of the run, so a step costs an assignment, not a formatted string."""

    def __init__(self, chosen: tuple[str, ...]) -> None:
        super().__init__()
        self.chosen = chosen

    def render(self, task: Task) -> Text:
        live = task.fields.get("live")
        return Text(live.text(self.chosen) if live is not None else "")
