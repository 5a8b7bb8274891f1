"""accelerate, recorded by `lab`: ``Accelerator(log_with=LabTracker(...))``.

`LabTracker` is an accelerate `GeneralTracker` over `FrameworkRun`, on the main process only:
``accelerator.init_trackers(name, config=...)`` records the config (the run's config
standalone; inside an `Experiment`'s ``train(run)`` the arm's config stays the run's and
this one is written to ``<run dir>/accelerate_config.json``), ``accelerator.log(values,
step=)`` records the values at that step (the step after the last one when none is given),
and ``accelerator.end_training()`` completes the run. accelerate has no hook for a failure:
``tracker.finish(error)`` records one (a failed run, with its traceback); nor does a tracker
see ``accelerator.save_state``/``load_state``: ``tracker.checkpoint(path, step=)`` records a
saved folder by reference, and ``tracker.resumed(step, path)`` (before ``init_trackers``)
says the loop continues from the state it loaded, so the run keeps its rows up to `step`.
"""

from __future__ import annotations

from lab._imports import require

require("accelerate", "accelerate", "lab.integrations.accelerate")

# ruff: noqa: E402 (the framework is imported once the line above found it)
import json
from pathlib import Path
from typing import Any

from accelerate.tracking import GeneralTracker, on_main_process

from lab.errors import ConfigError
from lab.integrations.recording import FrameworkRun
from lab.records import RunSpec

#: The file, in an `Experiment` run's folder, that keeps the config given `init_trackers`.
CONFIG_FILE = "accelerate_config.json"


class LabTracker(GeneralTracker):
    """Records what an `Accelerator` logs as a `lab` run (main process only).

    `run`: the `RunSpec` an `Experiment` gave ``train(run)``; without it the other arguments
    start a run of its own, as `FrameworkRun` says (`experiment`, `store`, ...).
    """

    name = "lab"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run: RunSpec | None = None, **standalone: Any) -> None:
        """The arguments are the class's."""
        super().__init__()
        self.recording = FrameworkRun(run, **standalone)
        self._step = 0
        self._restored: tuple[int, Path] | None = None

    @property
    def tracker(self) -> FrameworkRun:
        """The recording itself (``accelerator.get_tracker("lab").tracker``)."""
        return self.recording

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record `values` as the run's configuration and start the run."""
        config = json.loads(json.dumps(values, default=str))
        if self.recording.standalone:
            self.recording.open(config)
        else:
            spec = self.recording.open()
            spec.dir.mkdir(parents=True, exist_ok=True)
            (spec.dir / CONFIG_FILE).write_text(json.dumps(config, indent=1))
        self.recording.start(restored=self._restored)

    @on_main_process
    def resumed(self, step: int, path: str | Path) -> None:
        """The loop continues from the state ``accelerator.load_state(path)`` loaded, saved at
        `step`: the run keeps its rows up to `step` and drops those past it. Call it before
        ``accelerator.init_trackers`` (the run starts there)."""
        if self.recording.handle is not None:
            raise ConfigError(
                "tracker.resumed(...) came after accelerator.init_trackers(...): call it first"
            )
        self._restored = (int(step), Path(path))
        self._step = int(step)

    @on_main_process
    def checkpoint(
        self, path: str | Path, step: int | None = None, metrics: dict[str, float] | None = None
    ) -> None:
        """Record the folder ``accelerator.save_state(path)`` wrote, by reference (nothing is
        copied), at `step` (default: the last logged step), with `metrics` to rank it by."""
        self.recording.checkpoint(path, step=self._step if step is None else int(step),
                                  metrics=metrics)  # fmt: skip

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record the numeric `values` at `step` (default: the step after the last)."""
        self._step = self._step + 1 if step is None else int(step)
        metrics = {k: float(v) for k, v in values.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}  # fmt: skip
        if metrics:
            self.recording.log(metrics, self._step)

    @on_main_process
    def finish(self, error: BaseException | None = None) -> None:
        """Complete the run (``accelerator.end_training()``), or fail it with `error`."""
        self.recording.finish(error)


__all__ = ["CONFIG_FILE", "LabTracker"]
