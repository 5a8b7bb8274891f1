"""`FrameworkHandle`: the run handle of a loop that another framework drives (Lightning's
`Trainer`, the Hugging Face `Trainer`, accelerate).

The framework keeps its own loop, its own optimizer, its own checkpoints and its own resume.
The handle records what the framework reports through the hooks every loop fires: metrics at
the framework's own step (``end_step(metrics, step=N)``; steps only go up), evaluations with
their predictions (``log_eval``), and the checkpoints the framework wrote, by reference
(``record_checkpoint``: the files stay where the framework put them, so nothing is copied).
A framework that resumed from its own checkpoint names the step it restored (``restored=``):
the run keeps the rows up to that step and drops those past it, as a `RunHandle` resumed from
a checkpoint of its own does.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lab.errors import ConfigError
from lab.hooks import Callback, Hook, LoopState
from lab.loop.handle import RunHandle
from lab.records import Kind, ManifestRow, RunSpec


class FrameworkHandle(RunHandle):
    """A `RunHandle` with no optimizer, schedule or checkpoints of lab's own: the framework
    steps, saves and resumes; the handle fires the hooks for what it reports.

    `restored` is ``(step, path)`` when the framework resumed from its checkpoint at `path`
    (its step `step`): `post_checkpoint_loaded` fires with `path`, and the steps go on after
    `step`.
    """

    def __init__(
        self,
        run: RunSpec | None,
        model: torch.nn.Module | None = None,
        *,
        restored: tuple[int, str | Path] | None = None,
        callbacks: Sequence[Callback] = (),
        run_dir: str | Path | None = None,
    ) -> None:
        """The arguments are the class's; `model` may be None (a framework that hands the
        tracker no model: accelerate's trackers)."""
        if restored is not None:
            step, _ = restored
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ConfigError(f"restored=({step!r}, ...): give the restored step, an int >= 0")
        super().__init__(
            run,
            model if model is not None else torch.nn.Module(),
            None,
            num_steps=None,
            callbacks=callbacks,
            resume=False,
            run_dir=run_dir,
            more_metrics=True,
        )
        self._restored = restored

    def _open_state(self) -> LoopState:
        state = super()._open_state()
        if self._restored is not None:
            step, path = self._restored
            state.step = step
            self.resumed_from = Path(path)
            self.hooks.fire(Hook.POST_CHECKPOINT_LOADED, state, self.resumed_from)
        return state

    def record_checkpoint(
        self,
        path: str | Path,
        *,
        step: int | None = None,
        metrics: Mapping[str, float] | None = None,
        kind: Kind = "regular",
        removed: str | None = None,
    ) -> ManifestRow:
        """Record a checkpoint the framework saved at `path` (at `step`, default the current
        one), with the metrics it was ranked by; or, with `removed` (the reason), that the
        framework deleted it. Fires `on_checkpoint`; the file is not touched."""
        self._check_running("record_checkpoint")
        self._steps.materialise()
        row = ManifestRow(
            run_key=self.ctx.run_key or "",
            step=self.state.step if step is None else step,
            path=str(path),
            event="save" if removed is None else "remove",
            time=time.time(),
            metrics={k: float(v) for k, v in (metrics or {}).items()},
            reason=removed,
            kind=kind,
        )
        self._saves([row])
        return row

    def reported(self) -> dict[str, Any]:
        """The last value of every step and eval metric the framework reported: what the
        run's result carries."""
        return {**self.progress.last, **self.progress.eval_metrics}
