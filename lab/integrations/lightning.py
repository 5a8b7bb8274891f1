"""Lightning: ``Trainer(logger=LabLogger(...))`` records the fit as a `lab` run.

`LabLogger` is a Lightning ``Logger``; the events a logger is not told of (the trainer's
step, a resume, validation and test results, predictions, an exception) reach it through
`LabCallback`, which the logger adds to the trainer itself the first time Lightning hands it
the model (``log_graph``, right after ``log_hyperparams`` at the start of every
``fit``/``validate``/``test``/``predict``). A user writes only the logger.

What it records, through `lab.integrations.FrameworkRun` (so the rows are those of a loop
written on `RunHandle`):

- the config: the LightningModule's and the datamodule's hparams (and `LightningCLI`'s
  parsed config, under ``"lightning_cli"``). Standalone they are the run's config; inside an
  `Experiment` the run's config is the arm's, and the hparams are recorded beside it, in the
  run's provenance as ``"framework_config"`` (``lab.inspect.provenance``);
- each ``log_metrics`` call at ``trainer.global_step`` (the number of optimizer steps done,
  as a `RunHandle` counts steps), ``epoch`` included as Lightning adds it;
- validation (``val``) and test (``test``) results as eval rows at that step, with
  per-example prediction rows when ``predictions=True`` and the step returns
  ``{"predictions": [row, ...]}``; ``predict_step`` outputs as the eval ``predict``'s rows;
- each ``ModelCheckpoint`` save (top-k with its monitor value, ``last`` as ``ephemeral``) and
  each top-k file it deleted, by reference: the files stay where Lightning wrote them;
- a fit that raised (or was interrupted) as a failed run with its traceback.

The run ends with the fit; ``validate``/``test``/``predict`` after it (inside an
`Experiment`'s ``train(run)``) are recorded as post-training evals (step NULL).
"""

from __future__ import annotations

from lab._imports import require

require("lightning", "lightning", "lab.integrations.lightning")

# ruff: noqa: E402 (the framework is imported once the line above found it)
import contextlib
import os
import re
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback as LightningCallback
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.trainer.states import TrainerFn

from lab._secrets import HIDDEN, SECRET_NAME, mask
from lab._secrets import logger as _logger
from lab.errors import ConfigError
from lab.integrations.recording import FrameworkRun
from lab.records import RunSpec

__all__ = ["LabCallback", "LabLogger"]

log = _logger("lab.integrations.lightning")
_SECRET = re.compile(SECRET_NAME, re.IGNORECASE)


class LabLogger(Logger):
    """A Lightning logger that records the trainer's run into `lab`.

    Inside an `Experiment`'s ``train(run)``: ``LabLogger(run)``. The logger's
    ``save_dir/name/version`` is the run's folder, so ``ModelCheckpoint`` writes into
    ``<run folder>/checkpoints`` and ``trainer.fit(model, ckpt_path="last")`` resumes the run
    after a crash. ``PL_GLOBAL_SEED`` is the run's seed (the Experiment sets it as the run
    starts; a standalone logger as it is made), so Lightning's ``seed_everything()`` and its
    dataloader workers take the repeat's seed.

    Standalone, as ``MLFlowLogger``: ``LabLogger(experiment="name", store=..., save_dir=...)``
    starts run ``<arm>-r<repeat>`` of that experiment (`lab.start_run`'s arguments) when the
    fit starts; `name` is the experiment, `version` the run's key.

    ``predictions=True`` records per-example prediction rows (see the module's docstring).
    """

    def __init__(
        self,
        run: RunSpec | None = None,
        *,
        experiment: str | None = None,
        save_dir: str | Path = "runs",
        predictions: bool = False,
        **options: Any,
    ) -> None:
        """The arguments are the class's; `options` are `lab.start_run`'s (``arm``,
        ``repeat``, ``seed``, ``store``, ``callbacks``, ``tags``, ``notes``, ``fresh``,
        ``quiet``) for a standalone run."""
        super().__init__()
        if not isinstance(predictions, bool):
            raise ConfigError(f"predictions={predictions!r}: use True or False")
        self.recording = FrameworkRun(run, experiment=experiment, output_dir=save_dir, **options)
        if run is not None:
            folder = Path(run.dir)
            self.seed = run.seed
        else:
            arm, repeat = options.get("arm", "main"), options.get("repeat", 0)
            folder = Path(save_dir) / str(experiment) / f"{arm}-r{repeat}"
            self.seed = options.get("seed", 0) + repeat
        os.environ["PL_GLOBAL_SEED"] = str(self.seed)
        self._folder = folder
        self.predictions = predictions
        self.callback = LabCallback(self)
        self.hparams: dict[str, Any] = {}
        self.trainer: Trainer | None = None

    # -- where Lightning puts the run's files ---------------------------------------------------
    @property
    def name(self) -> str:
        """The experiment's name (the run folder's parent)."""
        return self._folder.parent.name

    @property
    def version(self) -> str:
        """The run's key (the run folder's name)."""
        return self._folder.name

    @property
    def save_dir(self) -> str:
        """The output folder: ``save_dir/name/version`` is the run's folder."""
        return str(self._folder.parent.parent)

    @property
    def log_dir(self) -> str:
        """The run's folder."""
        return str(self._folder)

    @property
    def experiment(self) -> FrameworkRun:
        """The recording (as ``MLFlowLogger.experiment`` is its client)."""
        return self.recording

    # -- what Lightning reports ------------------------------------------------------------------
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Keep the module's and datamodule's hparams: the run's config (standalone) or its
        Lightning record (in an Experiment), recorded when the fit starts."""
        if not isinstance(params, Mapping):
            params = vars(params)  # an argparse Namespace
        # keys with a leading "_" are Lightning's own (LightningCLI's `_instantiator`)
        config = _plain(dict(params), hide=True)
        self.hparams.update({k: v for k, v in config.items() if k[:1] != "_"})

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """Lightning's first call with the model: add `LabCallback` to its trainer."""
        trainer = getattr(model, "_trainer", None)
        if trainer is None:
            return
        self.trainer = trainer
        if not any(cb is self.callback for cb in trainer.callbacks):
            # first: an eval is recorded before the checkpoint ModelCheckpoint saves after it
            trainer.callbacks.insert(0, self.callback)
        cli = _cli_config(trainer)
        if cli is not None:
            self.hparams["lightning_cli"] = cli

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Record `metrics` at the trainer's global step (evaluation loops' at their eval)."""
        self.callback.metrics(metrics, step)

    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        """Record the checkpoints `checkpoint_callback` saved and deleted since the last call."""
        self.callback.checkpoints(checkpoint_callback)

    def finalize(self, status: str) -> None:
        """End the run when its fit ends (``status`` "success", or "failed" after
        `LabCallback.on_exception`)."""
        self.callback.finalize(status)


class LabCallback(LightningCallback):
    """What a Lightning logger is not told of: the step, a resume, evaluation results,
    predictions and exceptions. `LabLogger` adds it to the trainer itself."""

    def __init__(self, logger: LabLogger) -> None:
        """`logger` is the `LabLogger` it reports to."""
        self.logger = logger
        self.error: BaseException | None = None
        self._eval: dict[str, Any] | None = None  # an evaluation loop's metrics, while it runs
        self._rows: list[dict[str, Any]] = []
        self._saved: dict[str, float | None] = {}  # top-k path -> its score, as recorded
        self._last: dict[str, int] = {}  # last checkpoint path -> its mtime, as recorded
        self._fit_ended = False
        self._held: list[Callable[[], Any]] = []  # the current step's evals and checkpoints
        self._held_step = 0

    @property
    def _run(self) -> FrameworkRun:
        return self.logger.recording

    # -- the fit ---------------------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Start the run's recording, at the step Lightning restored when it resumed."""
        self._run.open(self.logger.hparams)
        restored = None
        if trainer.ckpt_path:
            restored = (int(trainer.global_step), str(trainer.ckpt_path))
        for cb in trainer.checkpoint_callbacks:  # what a restored ModelCheckpoint holds
            if isinstance(cb, ModelCheckpoint):
                self._saved.update({p: _score(s) for p, s in cb.best_k_models.items()})
                if cb.last_model_path and os.path.exists(cb.last_model_path):
                    self._last[cb.last_model_path] = os.stat(cb.last_model_path).st_mtime_ns
        self._run.start(pl_module, restored=restored)
        if self.logger.hparams:
            self._run.framework_config(self.logger.hparams)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        """Keep the exception: `finalize` fails the run with it."""
        self.error = exception

    def finalize(self, status: str) -> None:
        """At the end of a fit: the run ends (failed with the exception seen, if any)."""
        trainer = self.logger.trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if self.error is not None or status == "failed":
            error = self.error or RuntimeError(f"the Lightning fit ended {status}")
            self.error = None
            self._fit_ended = True
            with contextlib.suppress(Exception):  # what the step held, before the failure
                self._release()
            self._run.finish(error)
            return
        if fitting and not self._fit_ended:
            self._fit_ended = True
            self._release()
            self._run.finish()

    # -- metrics ---------------------------------------------------------------------------------
    def metrics(self, metrics: Mapping[str, float], step: int | None) -> None:
        """One ``log_metrics`` call: an evaluation's metrics while one runs, else a step's."""
        values = {k: float(v) for k, v in metrics.items()}
        if self._eval is not None:
            epoch = values.pop("epoch", None)
            self._eval.update(values)
            if epoch is not None and self._recording():
                self._run.log({"epoch": epoch}, self._step())
            return
        if self._recording():
            step = self._step()
            if self._held and step > self._held_step:
                self._release()
            self._run.log(values, step)

    def _hold(self, record: Callable[[], Any]) -> None:
        """Record an eval or a checkpoint of the current step once the step is complete:
        Lightning logs an epoch's end-of-epoch metrics at its last step after that step's
        validation and save, and they belong to that step."""
        self._held.append(record)
        self._held_step = self._step()

    def _release(self) -> None:
        """The held step is complete: record it, then its evals and checkpoints."""
        held, self._held = self._held, []
        for record in held:
            record()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._release()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._release()

    def _step(self) -> int:
        trainer = self.logger.trainer
        return int(trainer.global_step) if trainer is not None else 0

    def _recording(self) -> bool:
        return self._run.handle is not None and not self._run.finished

    # -- evaluations -----------------------------------------------------------------------------
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._begin(trainer)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._begin(trainer)

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._begin(trainer)

    def on_validation_batch_end(
        self, trainer: Trainer, module: Any, outputs: Any, *args: Any
    ) -> None:
        self._collect(outputs, evaluation=True)

    def on_test_batch_end(self, trainer: Trainer, module: Any, outputs: Any, *args: Any) -> None:
        self._collect(outputs, evaluation=True)

    def on_predict_batch_end(self, trainer: Trainer, module: Any, outputs: Any, *args: Any) -> None:
        self._collect(outputs, evaluation=False)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end(trainer, "val")

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end(trainer, "test")

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end(trainer, "predict")

    def _begin(self, trainer: Trainer) -> None:
        self._eval = None if trainer.sanity_checking else {}
        self._rows = []

    def _collect(self, outputs: Any, *, evaluation: bool) -> None:
        if self._eval is None or not self.logger.predictions:
            return
        if evaluation:
            if not isinstance(outputs, Mapping) or "predictions" not in outputs:
                return
            outputs = outputs["predictions"]
        self._rows.extend(_prediction_rows(outputs, len(self._rows)))

    def _end(self, trainer: Trainer, name: str) -> None:
        metrics, rows = self._eval, self._rows
        self._eval, self._rows = None, []
        if metrics is None:  # the sanity check: Lightning logs nothing of it either
            return
        metrics = {_strip(name, k): v for k, v in metrics.items()}
        predictions = rows if self.logger.predictions else None
        if self._recording():  # during the fit: an eval at the trainer's step
            step = self._step()
            self._hold(lambda: self._run.evaluate(name, metrics, step=step,
                                                  predictions=predictions))  # fmt: skip
            return
        if self._run.standalone:
            log.warning(
                "LabLogger: the %s results after the fit are not recorded: a standalone run "
                "ends with its fit (record them inside an Experiment's train(run))",
                name,
            )
            return
        self._run.evaluate_after(name, metrics, predictions=rows)

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoints(self, cb: ModelCheckpoint) -> None:
        """Record `cb`'s new top-k saves (with the monitor's value), its deletions, and a new
        ``last`` save, by reference."""
        if not self._recording():
            return
        step, monitor = self._step(), cb.monitor or "score"
        current: dict[str, Any] = dict(cb.best_k_models)
        if not current and cb.best_model_path:  # no monitor: the newest save is the one kept
            current = {cb.best_model_path: None}
        for path, score in current.items():
            if path not in self._saved:
                self._saved[path] = value = _score(score)
                metrics = {monitor: value} if value is not None else None
                self._hold(partial(self._run.checkpoint, path, step=step, metrics=metrics))
        for path in [p for p in self._saved if p not in current]:
            self._saved.pop(path)
            reason = "top-k: a better one replaced it"
            self._hold(partial(self._run.checkpoint, path, step=step, removed=reason))
        last = cb.last_model_path
        if last and os.path.exists(last):
            mtime = os.stat(last).st_mtime_ns
            if self._last.get(last) != mtime:
                self._last[last] = mtime
                value = _score(cb.current_score) if cb.monitor else None
                metrics = {monitor: value} if value is not None else None
                self._hold(partial(self._run.checkpoint, last, step=step, metrics=metrics,
                                   kind="ephemeral"))  # fmt: skip


def _strip(name: str, key: str) -> str:
    """``val/loss`` in the eval ``val`` is its ``loss`` (the metric row is ``val/loss`` again)."""
    return key[len(name) + 1 :] if key.startswith(f"{name}/") else key


def _score(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _prediction_rows(outputs: Any, start: int) -> Iterator[dict[str, Any]]:
    """Prediction rows from a step's outputs: a list of row dicts, a dict of columns (one
    value per example), or a tensor (one output per example); a row without an
    ``example_id`` gets its running index."""
    if isinstance(outputs, torch.Tensor):
        outputs = {"output": outputs}
    if isinstance(outputs, Mapping):
        columns = {k: _plain(v) for k, v in outputs.items()}
        n = max((len(v) for v in columns.values() if isinstance(v, list)), default=0)
        outputs = [{k: v[i] if isinstance(v, list) else v for k, v in columns.items()}
                   for i in range(n)]  # fmt: skip
    for i, row in enumerate(outputs):
        if not isinstance(row, Mapping):
            raise ConfigError(
                f"prediction {row!r}: return rows as dicts (example_id, input, output, target, "
                "score), a dict of columns, or a tensor"
            )
        yield {"example_id": str(start + i), **_plain(dict(row))}


def _plain(value: Any, *, hide: bool = False) -> Any:
    """JSON-ready: tensors as lists or numbers, mappings and sequences walked, paths and other
    objects as their string. `hide` (a config) masks credentials, as every record lab keeps
    does: the value of a key that says secret, a URL's password."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Mapping):
        return {
            str(k): HIDDEN if hide and _SECRET.search(str(k)) else _plain(v, hide=hide)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_plain(v, hide=hide) for v in value]
    if value is None or isinstance(value, bool | int | float):
        return value
    text = value if isinstance(value, str) else str(value)
    return mask(text) if hide else text


def _cli_config(trainer: Any) -> dict[str, Any] | None:
    """`LightningCLI`'s parsed config, from its ``SaveConfigCallback``, when the trainer has
    one."""
    for cb in trainer.callbacks:
        config = getattr(cb, "config", None)
        if type(cb).__name__ == "SaveConfigCallback" and config is not None:
            as_dict = getattr(config, "as_dict", None)
            return _plain(as_dict() if callable(as_dict) else dict(vars(config)), hide=True)
    return None
