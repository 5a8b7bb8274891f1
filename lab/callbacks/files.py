"""Callbacks that leave plain files in each run's folder: the config and the metrics.

(The hook log, ``hooks.jsonl``, is a logger: `lab.loggers.jsonl.JsonlLogger`.)

- `ConfigSaver` writes ``config.json`` (the run's config and identity) into the run folder
  and into every checkpoint folder, so a checkpoint copied elsewhere still says what made it.
- `MetricSaver` keeps ``metrics.json`` with the latest metrics at chosen steps and the final
  ones at the end, for scripts that want a run's numbers without opening the store.

The files are written from the hooks, in the process that runs the run (a worker process
under ``executor="processes"``), so every callback here keeps no open file between pickling.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab._atomic import write_text_atomic
from lab._json import finite_json, floats_back
from lab._secrets import logger
from lab.callbacks.params import FileName, NonNegativeInt, PositiveInt
from lab.callbacks.registry import register
from lab.hooks import Callback, LogContext, LoopState, Phase
from lab.records import FAILED

if TYPE_CHECKING:
    from lab.records import ArmResult, LoopArtifacts, ManifestRow, RunResult, TrainingBatch

log = logger("lab.callbacks.files")

__all__ = ["ConfigSaver", "MetricSaver", "read_metrics"]

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.json"


# --------------------------------------------------------------------------------------------
# helpers


def _write_json_atomic(path: Path, data: Any) -> None:
    """Write `path` whole or not at all: a reader (or a kill) never sees half a file."""
    text = json.dumps(finite_json(data), indent=2, sort_keys=True, allow_nan=False)
    write_text_atomic(path, text + "\n")


def read_metrics(path: str | Path) -> dict[str, Any]:
    """A `MetricSaver` file (``metrics.json``), with its metrics as floats again.

    The file is strict JSON, so it holds NaN and inf as strings; a script that reads it
    with this gets the numbers the run logged.
    """
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    doc["metrics"] = floats_back(doc.get("metrics") or {})
    return doc


# --------------------------------------------------------------------------------------------
# ConfigSaver


@register("config_saver")
class ConfigSaver(Callback):
    """Writes `fname` (``config.json``) into the run folder and every checkpoint folder.

    It runs in `Phase.ATTACH`: after the SqlLogger (`Phase.RECORD`) has recorded a save, and
    before a `WandbLogger` (`Phase.MIRROR`) references the checkpoint folder, so the
    reference finds the file.

    The file holds ``{"experiment", "run_key", "arm", "repeat", "stage", "seed", "config"}``
    where ``config`` is the run's config (`ctx.run_config`; empty for a bare fit, so the
    `config` given here, or {}). It is written at `on_run_start`, and at each checkpoint
    save, so a checkpoint folder copied away from its run still says what made it. Each
    write is atomic.
    """

    phase = Phase.ATTACH

    def __init__(self, fname: FileName = CONFIG_FILE, config: dict[str, Any] | None = None) -> None:
        self.fname = fname
        self.config = config
        self._document: dict[str, Any] | None = None

    def document(self, ctx: LogContext) -> dict[str, Any]:
        """What the file holds for the run `ctx` points at."""
        config = ctx.run_config or self.config
        return {
            "experiment": ctx.experiment or None,
            "run_key": ctx.run_key,
            "arm": ctx.arm,
            "repeat": ctx.repeat,
            "stage": ctx.stage,
            "seed": ctx.seed,
            "config": config if config is not None else {},
        }

    def _save_run(self, ctx: LogContext) -> None:
        self._document = self.document(ctx)
        _write_json_atomic(ctx.folder / self.fname, self._document)

    def on_run_start(self, ctx: LogContext) -> None:
        self._save_run(ctx)

    def on_checkpoint(self, state: LoopState, row: ManifestRow) -> None:
        if row.event != "save":
            return
        folder = Path(row.path)
        if not folder.is_absolute():  # manifest paths are relative to the checkpoints folder
            folder = state.ctx.folder / "checkpoints" / folder
        if not folder.is_dir():  # retention removed it already (an ephemeral async save)
            log.debug("checkpoint folder %s is gone; no %s written there", folder, self.fname)
            return
        _write_json_atomic(folder / self.fname, self._document or self.document(state.ctx))

    def on_run_end(self, ctx: LogContext, run_result: RunResult, arm: ArmResult) -> None:
        self._document = None


# --------------------------------------------------------------------------------------------
# MetricSaver


@register("metric_saver")
class MetricSaver(Callback):
    """Keeps ``metrics.json`` in the run folder: the latest metrics, then the final ones.

    The file is ``{"run_key", "step", "final", "status", "metrics"}``. It is written at each
    step that is a multiple of `every` or listed in `at_steps` (the step's metrics plus the
    latest of each in-loop eval as ``"<eval>/<key>"``; an eval run at that same step
    rewrites it), at `on_train_end` with the loop's final metrics (``final: true``), and at
    `on_run_end` with the run's (post-training benchmarks included) and its status. A failed
    run keeps the latest metrics it had. `keys` keeps only the metrics matching any of its
    glob patterns. Every write is atomic (a temporary file, then `os.replace`).
    """

    def __init__(
        self,
        every: PositiveInt | None = None,
        at_steps: Sequence[NonNegativeInt] = (),
        fname: FileName = METRICS_FILE,
        keys: Sequence[str] | None = None,
    ) -> None:
        self.every = every
        self.at_steps = frozenset(int(s) for s in at_steps)
        self.fname = fname
        self.keys = list(keys) if keys is not None else None
        self._latest: dict[str, float] = {}
        self._step = 0
        self._written_step: int | None = None

    def _pick(self, metrics: dict[str, Any]) -> dict[str, Any]:
        if self.keys is None:
            return dict(metrics)
        return {
            k: v for k, v in metrics.items() if any(fnmatch.fnmatchcase(k, p) for p in self.keys)
        }

    def _write(
        self, ctx: LogContext, step: int, metrics: dict[str, Any], *, final: bool, status: str
    ) -> None:
        doc = {
            "run_key": ctx.run_key,
            "step": step,
            "final": final,
            "status": status,
            "metrics": self._pick(metrics),
        }
        _write_json_atomic(ctx.folder / self.fname, doc)

    def _reset(self) -> None:
        self._latest, self._step, self._written_step = {}, 0, None

    def on_run_start(self, ctx: LogContext) -> None:
        self._reset()

    def on_train_start(self, state: LoopState) -> None:
        self._reset()
        self._latest.update(state.metrics)  # a resumed run starts from its checkpoint's
        self._step = state.step

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        self._latest.update(metrics)
        self._step = step_idx
        if step_idx in self.at_steps or (self.every is not None and step_idx % self.every == 0):
            self._write(state.ctx, step_idx, self._latest, final=False, status="running")
            self._written_step = step_idx

    def on_eval(
        self, state: LoopState, step_idx: int, eval_name: str, metrics: dict[str, float]
    ) -> None:
        self._latest.update({f"{eval_name}/{k}": v for k, v in metrics.items()})
        if self._written_step == step_idx:  # the file of this step now has its eval too
            self._write(state.ctx, step_idx, self._latest, final=False, status="running")

    def on_train_end(self, state: LoopState, artifacts: LoopArtifacts) -> None:
        self._latest = dict(artifacts.metrics)
        self._step = artifacts.step
        self._write(state.ctx, artifacts.step, self._latest, final=True, status=artifacts.status)

    def on_run_end(self, ctx: LogContext, run_result: RunResult, arm: ArmResult) -> None:
        metrics = run_result.metrics if run_result.status not in FAILED else self._latest
        self._write(ctx, self._step, metrics, final=True, status=run_result.status)
        self._reset()
