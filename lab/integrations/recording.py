"""`FrameworkRun`: one run trained by another framework's loop, recorded by `lab`.

Inside an `Experiment`'s ``train(run)`` it records into the run the experiment gave, so a
Lightning or Hugging Face fit gets arms x repeats, seeds and resume; standalone (no run
given) it starts one with `lab.start_run` when the framework first reports, as
``MLFlowLogger`` or ``WandbLogger`` start theirs. Either way the rows are those a loop written
on `RunHandle` records: metrics at the framework's step, evals with their predictions,
checkpoints by reference, and the run's end (completed, or failed with its traceback).

A framework may report several dicts at one step (train metrics, then validation metrics):
they are merged and recorded as one step when a later step, an eval, a checkpoint or the end
comes. A value reported for an older step than the newest pending one joins the newest; one
reported for a step already recorded goes to the step after it (steps only go up).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lab.dispatch import Dispatcher
from lab.errors import ConfigError
from lab.hooks import FRAMEWORK_CONFIG, Callback
from lab.lifecycle import evaluated_after
from lab.loop.framework import FrameworkHandle
from lab.records import EvalResult, Kind, ManifestRow, RunSpec


class FrameworkRun:
    """The recording of one framework-driven run; `open`, `start`, then `log`, `evaluate`
    and `checkpoint` as the framework reports, and `finish` once.

    `run`: the `RunSpec` an `Experiment` gave ``train(run)``. Without it, `experiment` names
    the experiment of a run started here with `lab.start_run` (with `arm`, `repeat`, `seed`,
    `store`, `output_dir`, `callbacks`, `tags`, `notes`, `fresh` and `quiet` as there).
    """

    def __init__(
        self,
        run: RunSpec | None = None,
        *,
        experiment: str | None = None,
        arm: str = "main",
        repeat: int = 0,
        seed: int = 0,
        store: Any = None,
        output_dir: str | Path = "runs",
        callbacks: Sequence[Callback] = (),
        tags: Sequence[str] = (),
        notes: str | None = None,
        fresh: bool = False,
        quiet: bool | None = None,
    ) -> None:
        """The arguments are the class's."""
        if run is None and not experiment:
            raise ConfigError(
                "give the run (inside an Experiment's train(run)) or experiment='name' "
                "(a run of its own)"
            )
        if run is not None and not isinstance(run, RunSpec):
            raise ConfigError(f"run={run!r}: pass the RunSpec that train(run) was given")
        self._run = run
        self.standalone = run is None  # a run of its own, started by `open`
        self._standalone = {
            "experiment": experiment, "arm": arm, "repeat": repeat, "seed": seed,
            "store": store, "output_dir": output_dir, "callbacks": callbacks, "tags": tags,
            "notes": notes, "fresh": fresh, "quiet": quiet,
        }  # fmt: skip
        self._stack = contextlib.ExitStack()
        self.handle: FrameworkHandle | None = None
        self._pending: dict[str, Any] = {}
        self._pending_step: int | None = None
        self.finished = False

    def open(self, config: Mapping[str, Any] | None = None) -> RunSpec:
        """The run: the Experiment's, or one started now with `config` (the framework's
        hyperparameters) as its config. Opening again returns the same run."""
        if self._run is not None:
            return self._run
        from lab.script import start_run

        options = dict(self._standalone)
        name = options.pop("experiment")
        self._run = self._stack.enter_context(start_run(name, config=config, **options))
        return self._run

    def framework_config(self, config: Mapping[str, Any]) -> None:
        """Inside an Experiment, record `config` (the framework's hyperparameters) beside the
        arm's config: in the run's provenance, as ``"framework_config"``, when the run ends.
        Standalone it is the run's config already (`open`)."""
        if not self.standalone:
            self.open().ctx.extras[FRAMEWORK_CONFIG] = dict(config)

    def start(
        self, model: torch.nn.Module | None = None, restored: tuple[int, str | Path] | None = None
    ) -> FrameworkHandle:
        """Start recording the fit (`on_train_start`); `restored` is ``(step, path)`` when the
        framework resumed from its own checkpoint. Starting again returns the same handle."""
        if self.handle is None:
            self.handle = FrameworkHandle(self.open(), model, restored=restored)
            self.handle.start()
        return self.handle

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record `metrics` at the framework's `step` (merged with others of the same step)."""
        if self.handle is not None and step <= self.handle.state.step:
            step = self.handle.state.step + 1  # a step already recorded: the next one
        if self._pending_step is not None and step > self._pending_step:
            self._flush()
        if self._pending_step is None or step > self._pending_step:
            self._pending_step = step
        self._pending.update(metrics)

    def evaluate(
        self,
        name: str,
        metrics: Mapping[str, Any],
        *,
        step: int | None = None,
        predictions: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Record an evaluation the framework ran, at `step` (default: the newest), with
        its per-example `predictions` when given."""
        handle = self._at(step)
        handle.log_eval(name, metrics, predictions=predictions)

    def evaluate_after(
        self,
        name: str,
        metrics: Mapping[str, Any],
        *,
        predictions: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Record an evaluation the framework ran after its fit ended (a test, a predict):
        a post-training eval (step NULL), as an Experiment's benchmarks are, while the run is
        still open (inside an Experiment's ``train(run)``)."""
        run = self.open()
        rows = [dict(p) for p in predictions or ()]
        result = EvalResult(name, dict(metrics), predictions=rows, step=None)
        hooks = run.dispatcher
        assert isinstance(hooks, Dispatcher)  # what an Experiment hands every run
        evaluated_after(hooks, run.ctx, result)

    def checkpoint(
        self,
        path: str | Path,
        *,
        step: int | None = None,
        metrics: Mapping[str, float] | None = None,
        kind: Kind = "regular",
        removed: str | None = None,
    ) -> ManifestRow:
        """Record a checkpoint the framework saved (or, with `removed`, deleted), by
        reference: the file stays where it is."""
        handle = self._at(step)
        return handle.record_checkpoint(path, step=step, metrics=metrics, kind=kind,
                                        removed=removed)  # fmt: skip

    def finish(self, error: BaseException | None = None) -> None:
        """End the run: completed, or failed with `error`'s traceback. Once; later calls do
        nothing."""
        if self.finished:
            return
        self.finished = True
        try:
            handle = self.handle
            if handle is not None:
                if error is None:
                    self._flush()
                    handle.finish()
                else:
                    with contextlib.suppress(Exception):
                        self._flush()
                    handle.fail(error)
        finally:
            self._close(error)

    # ----------------------------------------------------------------------------------------
    def _at(self, step: int | None) -> FrameworkHandle:
        """The started handle, its pending step recorded and its step moved up to `step`."""
        handle = self.start()
        self._flush()
        if step is not None and step > handle.state.step:
            handle.end_step({}, step=step)
        return handle

    def _flush(self) -> None:
        if self._pending_step is None:
            return
        handle = self.start()
        step, metrics = self._pending_step, self._pending
        self._pending, self._pending_step = {}, None
        handle.end_step(metrics, step=max(step, handle.state.step + 1))

    def _close(self, error: BaseException | None) -> None:
        """Leave the standalone run's `lab.start_run` block: it records the run as completed
        or failed (it re-raises the error it was given: that one is the caller's)."""
        if error is None:
            self._stack.close()
            return
        try:
            self._stack.__exit__(type(error), error, error.__traceback__)
        except BaseException as raised:
            if raised is not error:
                raise
