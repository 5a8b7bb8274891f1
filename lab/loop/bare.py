"""A bare fit's experiment of its own: the lifecycle a `RunHandle` without a run fires.

Outside an Experiment (``TrainingLoop(...).fit()``, ``RunHandle(None, ...)``) the handle
opens a one-run experiment around the loop, as ``wandb.init`` does, so every callback sees
the lifecycle it sees under an Experiment and none has to tell the two cases apart::

    on_experiment_start(ctx)          # ctx.experiment = "loop-<UTC time>-<hex6>"
    on_group_start(ctx, "loop")
    on_run_start(ctx)                 # run key: run_dir's name, else "loop"
    [post_checkpoint_loaded] on_train_start ... on_train_end   (or on_error(ctx, exc))
    on_run_end(ctx, run_result, arm_result)
    on_experiment_end(ctx, experiment_result)
    close()

The run has no arm (``ctx.arm`` is None; its result names the arm ``"loop"``), repeat 0,
stage 0 and an empty run config, and nothing is seeded: a bare loop leaves the caller's
random generators as they are. Without `run_dir` the run has no folder of its own
(``ctx.run_dir`` is None, ``ctx.folder`` the working directory). The hooks fire, and the
failure policy is applied, in `lab.lifecycle`, as for an Experiment: a critical callback
that raises in `on_run_start` fails the fit, `on_error` stays isolated, a run end that a
critical callback could not record fails the run (and the fit raises it), and strict
mode's `CallbackError` propagates.
"""

from __future__ import annotations

import time
import traceback
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from lab._secrets import logger
from lab.dispatch import Dispatcher
from lab.errors import CallbackError
from lab.hooks import EXECUTOR, FINISHED_BEFORE, RUNS, Callback, LogContext
from lab.lifecycle import (
    _failures,
    close,
    close_quietly,
    end_experiment,
    end_run,
    fail_run,
    open_run,
    start_experiment,
    start_group,
)
from lab.records import ArmResult, ExperimentResult, RunResult, RunStatus

if TYPE_CHECKING:
    from lab.records import LoopArtifacts

log = logger("lab.loop")

#: The group of a bare fit's run, and its run key when it has no `run_dir`.
LOOP = "loop"


def experiment_name() -> str:
    """A new experiment name per bare fit: ``loop-<UTC %Y%m%d-%H%M%S>-<uuid hex6>``."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"{LOOP}-{stamp}-{uuid.uuid4().hex[:6]}"


class BareRun:
    """The experiment, group and run around one bare fit; `RunHandle` drives it.

    `open` fires the hooks up to `on_run_start`; then `trained` (the loop's artifacts) or
    nothing, and `end` (with the exception the fit raised, if any) fires `on_error`,
    `on_run_end`, `on_experiment_end` and `close`, as far as `open` got.
    """

    def __init__(self, callbacks: Sequence[Callback], run_dir: Path | None) -> None:
        self.hooks = Dispatcher(callbacks)
        self.run_key = run_dir.name if run_dir is not None else LOOP
        self.ctx = LogContext(
            experiment=experiment_name(),
            output_dir=run_dir.parent if run_dir is not None else Path.cwd(),
            own_folder=run_dir is not None,
        )
        self.ctx.extras.update({RUNS: 1, FINISHED_BEFORE: 0, EXECUTOR: "serial"})
        self.arm_result = ArmResult(LOOP, {}, planned=1)
        self.result = ExperimentResult(self.ctx.experiment, [self.arm_result], planned=1)
        self.status: RunStatus = "completed"
        self.metrics: dict[str, float] = {}
        self.error: str | None = None
        self.traceback: str | None = None
        self.artifacts: LoopArtifacts | None = None
        self._experiment_started = False
        self._run_open = False
        self._t0 = self._run_t0 = time.perf_counter()

    def open(self) -> None:
        """Fire `on_experiment_start`, `on_group_start` and `on_run_start`; `ctx` then
        points at the run. A critical callback that raises fails the fit (`end` follows)."""
        ctx, hooks = self.ctx, self.hooks
        self._t0 = time.perf_counter()
        start_experiment(hooks, ctx)
        self._experiment_started = True
        ctx.group_name, ctx.group_kind = LOOP, "repeats"
        start_group(hooks, ctx, LOOP)
        ctx.run_key, ctx.run_config, ctx.repeat, ctx.stage = self.run_key, {}, 0, 0
        self._run_open = True
        self._run_t0 = time.perf_counter()
        open_run(hooks, ctx, self.run_key)

    def trained(self, artifacts: LoopArtifacts) -> None:
        """The loop ended cleanly with `artifacts`: the run is `completed`, or `stopped` when
        a callback asked it to stop, or `pruned` when a pruning rule did."""
        self.artifacts = artifacts
        self.metrics = dict(artifacts.metrics)
        self.status = artifacts.status

    def end(self, exc: BaseException | None = None) -> None:
        """End what `open` started: `on_error` (when the fit raised `exc`), `on_run_end`,
        `on_experiment_end`, then always `close`. Raises what a critical callback raised in
        `on_run_end` or `on_experiment_end` of a fit that had not failed already (the fit's
        own exception is the caller's to re-raise), and strict mode's `CallbackError`."""
        hooks = self.hooks
        failed: BaseException | None = None
        try:
            if self._run_open:
                if exc is not None:
                    self._failed(exc)
                failed = self._end_run()
            elif exc is not None:  # the experiment failed before its run started
                self.result.error = f"{type(exc).__name__}: {exc}"
            if self._experiment_started:
                end_experiment(hooks, self.ctx, self.result, self._t0)
        except CallbackError:
            close_quietly(hooks)
            raise
        except BaseException as raised:
            close_quietly(hooks)
            if exc is None or not isinstance(raised, Exception):
                raise
            log.exception("while ending %s after the fit failed", self.ctx.experiment)
            return
        if exc is not None:
            close_quietly(hooks)
            return
        close(hooks)
        if failed is not None:
            raise failed

    def _failed(self, exc: BaseException) -> None:
        """Record the error the fit raised and fire `on_error`."""
        self.status = "failed"
        self.traceback = "".join(traceback.format_exception(exc))
        if isinstance(exc, Exception):
            self.error = f"{type(exc).__name__}: {exc}"
        else:  # Ctrl-C, SIGTERM: the run and the experiment were interrupted
            self.error = f"interrupted ({type(exc).__name__})"
            self.result.error = self.error
        fail_run(self.hooks, self.ctx, exc)

    def _end_run(self) -> Exception | None:
        """Fire `on_run_end` with the run's result. A critical callback that raises there
        fails the run (the other callbacks had the hook with the run as it ended training);
        its exception is returned, for the fit to raise once the experiment is ended."""
        ctx, hooks = self.ctx, self.hooks
        run_result = RunResult(
            run_key=self.run_key, arm=LOOP, repeat=0, stage=0, seed=0, status=self.status,
            metrics=self.metrics, seconds=time.perf_counter() - self._run_t0, error=self.error,
            traceback=self.traceback, callback_errors=_failures(hooks, self.run_key),
            artifacts=self.artifacts,
            pruned=self.artifacts.pruned if self.status == "pruned" and self.artifacts else None,
        )  # fmt: skip
        self.arm_result.runs.append(run_result)
        raised = end_run(hooks, ctx, run_result, self.arm_result)
        run_result.callback_errors = _failures(hooks, self.run_key)
        hooks.run_key = None  # what fails from here on belongs to the experiment
        ctx.run_key = ctx.run_config = ctx.repeat = ctx.group_name = None
        ctx.stage = 0
        return raised
