"""The Hugging Face `Trainer`, recorded by `lab`: ``Trainer(..., callbacks=[LabCallback(...)])``.

`LabCallback` is a `transformers.TrainerCallback` over `FrameworkRun`. ``on_train_begin``
starts the run (standalone, its config is the `TrainingArguments` and, under ``model``, the
model's config; inside an `Experiment`, those go to ``<run dir>/transformers_config.json``
beside the arm's config); a Trainer resumed from its ``checkpoint-N`` continues the run at
step N. ``on_log`` records the logged metrics at ``state.global_step``; ``on_evaluate`` and
``on_predict`` an eval row named by the metric prefix (``eval``), with prediction rows when
`predict` ran it; ``on_save`` the ``checkpoint-N`` folder by reference with its
``metric_for_best_model``, and the folders ``save_total_limit`` rotated away as removals;
``on_train_end`` the closing summary (``train_runtime``, ``train_loss``...) as the eval
``train``, and the run completes. docs/transformers.md has the table.

The Trainer has no hook for a failure: `train` runs ``trainer.train`` and records a raised
error as the run's failure, with its traceback. `training_args` builds the `TrainingArguments`
of an `Experiment`'s run (its arm's fields, its seed, a folder in the run's folder), so arms x
repeats range over `TrainingArguments` fields.
"""

from __future__ import annotations

from lab._imports import require

require("transformers", "transformers", "lab.integrations.transformers")

# ruff: noqa: E402 (the framework is imported once the line above found it)
import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import transformers
from transformers.trainer_utils import get_last_checkpoint

from lab._secrets import logger
from lab.errors import ConfigError
from lab.integrations.recording import FrameworkRun
from lab.records import RunSpec

log = logger(__name__)

#: The file, in an `Experiment` run's folder, that keeps the `TrainingArguments` and the model's
#: config (the run's own config is its arm's).
CONFIG_FILE = "transformers_config.json"
#: The closing summary the Trainer logs once training ends becomes an eval of this name.
SUMMARY = "train"


def arguments_config(args: Any, model: Any = None) -> dict[str, Any]:
    """The `TrainingArguments` (hub tokens and other secrets left out) and, under ``model``,
    the model's config: what a run trained by the Trainer was configured with."""
    config = {
        key: value
        for key, value in args.to_dict().items()
        if not (key.endswith("_token") or key == "resume_from_checkpoint")
    }
    model_config = getattr(model, "config", None)
    if model_config is not None and hasattr(model_config, "to_dict"):
        config["model"] = json.loads(json.dumps(model_config.to_dict(), default=str))
    return config


def _summary_prefixes(logs: Mapping[str, Any]) -> list[str]:
    """The prefixes of the speed summaries in `logs` (``eval`` of ``eval_runtime``): an
    evaluation's or the training's closing metrics, not a step's."""
    return [key[: -len("_runtime")] for key in logs if key.endswith("_runtime")]


def _unprefixed(metrics: Mapping[str, Any], prefix: str) -> dict[str, float]:
    start = f"{prefix}_"
    return {k[len(start) :]: float(v) for k, v in metrics.items()
            if k.startswith(start) and _number(v)}  # fmt: skip


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class LabCallback(transformers.TrainerCallback):
    """Records a `Trainer`'s fit as a `lab` run (main process only).

    `run`: the `RunSpec` an `Experiment` gave ``train(run)``; without it the other arguments
    start a run of its own, as `FrameworkRun` says (`experiment`, `store`, ...).
    """

    def __init__(self, run: RunSpec | None = None, **standalone: Any) -> None:
        """The arguments are the class's."""
        self.recording = FrameworkRun(run, **standalone)
        self.held = False  # `train` ends the run itself, after its predictions
        self._predicting: str | None = None  # the name `predict` records its eval under
        self._predicted: dict[str, float] = {}
        self._evals: dict[str, dict[str, float]] = {}  # the last metrics of each eval
        self._saved: list[str] = []  # checkpoint folders recorded, not yet removed
        self._model: Any = None

    # -- the Trainer's hooks -------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Start the run with the Trainer's configuration; a Trainer that resumed from its
        ``checkpoint-N`` continues the run at step N."""
        if not state.is_world_process_zero:
            return
        model = kwargs.get("model")
        config = arguments_config(args, model)
        recording = self.recording
        if recording.standalone:
            recording.open(config)
        else:
            spec = recording.open()
            spec.dir.mkdir(parents=True, exist_ok=True)
            (spec.dir / CONFIG_FILE).write_text(json.dumps(config, indent=1, default=str))
        step = int(state.global_step)
        restored = (step, Path(args.output_dir) / f"checkpoint-{step}") if step > 0 else None
        recording.start(model if hasattr(model, "parameters") else None, restored=restored)
        self._saved = [str(p) for p in sorted(Path(args.output_dir).glob("checkpoint-*"))]

    def on_log(
        self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        """Record the logged metrics at ``state.global_step``; an evaluation's are left to
        `on_evaluate`, the training's closing summary becomes the eval ``train``."""
        if not state.is_world_process_zero or not logs or not self._open():
            return
        prefixes = _summary_prefixes(logs)
        if SUMMARY in prefixes:
            summary = _unprefixed(logs, SUMMARY)
            if _number(logs.get("total_flos")):
                summary["total_flos"] = float(logs["total_flos"])
            self.recording.evaluate(SUMMARY, summary, step=int(state.global_step))
            return
        if prefixes:
            return  # an evaluation's metrics: on_evaluate or on_predict records them
        metrics = {k: float(v) for k, v in logs.items() if _number(v)}
        if metrics:
            self.recording.log(metrics, int(state.global_step))

    def on_evaluate(
        self, args: Any, state: Any, control: Any, metrics: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        """Record the evaluation as an eval row named by its metric prefix."""
        if not state.is_world_process_zero or not metrics or not self._open():
            return
        for prefix in _summary_prefixes(metrics):
            values = _unprefixed(metrics, prefix)
            self._evals[prefix] = values
            self.recording.evaluate(prefix, values, step=int(state.global_step))

    def on_predict(
        self, args: Any, state: Any, control: Any, metrics: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        """Record a prediction's metrics as an eval row (`predict` adds the rows of its
        examples)."""
        if not state.is_world_process_zero or not metrics:
            return
        prefixes = _summary_prefixes(metrics)
        if self._predicting is not None:
            self._predicted = _unprefixed(metrics, prefixes[0]) if prefixes else {}
            return
        if self._open():
            for prefix in prefixes:
                self.recording.evaluate(prefix, _unprefixed(metrics, prefix),
                                        step=int(state.global_step))  # fmt: skip

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Record the ``checkpoint-N`` folder just saved, by reference, with the metric the
        Trainer ranks checkpoints by; and the folders it rotated away."""
        if not state.is_world_process_zero or not self._open():
            return
        step = int(state.global_step)
        path = str(Path(args.output_dir) / f"checkpoint-{step}")
        self._removed(step)
        metrics = self._ranked_by(args)
        self.recording.checkpoint(path, step=step, metrics=metrics)
        if path not in self._saved:
            self._saved.append(path)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Complete the run (unless `train` runs it: then after its predictions)."""
        if not state.is_world_process_zero or not self._open():
            return
        self._removed(int(state.global_step))
        if not self.held:
            self.recording.finish()

    # ------------------------------------------------------------------------------------------
    def _open(self) -> bool:
        if self.recording.finished:
            log.warning("lab: the run already ended; this report of the Trainer is not recorded")
            return False
        return True

    def _ranked_by(self, args: Any) -> dict[str, float]:
        """``metric_for_best_model``'s last value, as `lab` names it (``eval/loss``)."""
        name = args.metric_for_best_model
        if not name:
            return {}
        for prefix, values in self._evals.items():
            key = name[len(prefix) + 1 :] if name.startswith(f"{prefix}_") else name
            if key in values:
                return {f"{prefix}/{key}": values[key]}
        return {}

    def _removed(self, step: int) -> None:
        """Record the removal of each recorded checkpoint folder that is gone (the Trainer's
        ``save_total_limit`` rotated it away)."""
        for path in [p for p in self._saved if not Path(p).exists()]:
            self._saved.remove(path)
            self.recording.checkpoint(path, step=step, removed="save_total_limit")


def _callback(trainer: Any) -> LabCallback:
    found = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, LabCallback)]
    if not found:
        raise ConfigError(
            "the Trainer has no LabCallback: pass Trainer(..., callbacks=[LabCallback(...)])"
        )
    return found[0]


def train(
    trainer: Any,
    *,
    resume: bool = True,
    predict: Mapping[str, Any] | None = None,
    **train_kwargs: Any,
) -> Any:
    """Run ``trainer.train(**train_kwargs)`` as one recorded run, failed with its traceback
    when training raises (the Trainer has no hook for that); with `resume`, from the newest
    ``checkpoint-N`` in ``args.output_dir`` when there is one (so a killed run continues).
    `predict` names datasets (``{"test": dataset}``) whose predictions are recorded as
    prediction rows before the run ends. Returns what ``trainer.train`` returned."""
    callback = _callback(trainer)
    if resume and "resume_from_checkpoint" not in train_kwargs:
        folder = Path(trainer.args.output_dir)
        train_kwargs["resume_from_checkpoint"] = (
            get_last_checkpoint(str(folder)) if folder.is_dir() else None
        )
    callback.held = True
    try:
        output = trainer.train(**train_kwargs)
        for name, dataset in (predict or {}).items():
            _predict(trainer, callback, dataset, name)
    except BaseException as error:
        callback.recording.finish(error)
        raise
    finally:
        callback.held = False
    callback.recording.finish()
    return output


def predict(trainer: Any, dataset: Any, name: str = "test") -> Any:
    """Run ``trainer.predict(dataset)`` and record its metrics and one prediction row per
    example (its ``example_id`` or ``id`` column when the dataset has one, else its index):
    rows that `lab.inspect.disagreements` compares across arms. Returns the Trainer's output."""
    return _predict(trainer, _callback(trainer), dataset, name)


def _predict(trainer: Any, callback: LabCallback, dataset: Any, name: str) -> Any:
    callback._predicting = name
    try:
        output = trainer.predict(dataset, metric_key_prefix=name)
    finally:
        callback._predicting = None
    if trainer.state.is_world_process_zero and callback._open():
        rows = prediction_rows(dataset, output.predictions, output.label_ids)
        callback.recording.evaluate(name, callback._predicted, step=int(trainer.state.global_step),
                                    predictions=rows)  # fmt: skip
    return output


def _example_ids(dataset: Any, n: int) -> list[Any]:
    """The dataset's ``example_id`` or ``id`` column, else the index of each example."""
    columns = getattr(dataset, "column_names", None)
    for key in ("example_id", "id"):
        if columns is not None and key in columns:
            return list(dataset[key])
        if columns is None and n and isinstance(dataset[0], Mapping) and key in dataset[0]:
            return [_plain(dataset[i][key]) for i in range(n)]
    return list(range(n))


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def prediction_rows(dataset: Any, predictions: Any, labels: Any) -> list[dict[str, Any]]:
    """One prediction row per example of a Trainer's ``predict``: the class and its softmax
    probability for logits of shape (examples, classes), else the outputs as they are."""
    if isinstance(predictions, tuple):
        predictions = predictions[0]
    predictions = np.asarray(predictions)
    n = len(predictions)
    ids = _example_ids(dataset, n)
    targets = np.asarray(labels).tolist() if labels is not None else [None] * n
    rows: list[dict[str, Any]] = []
    if predictions.ndim == 2:
        shifted = np.exp(predictions - predictions.max(axis=1, keepdims=True))
        probs = shifted / shifted.sum(axis=1, keepdims=True)
        for i in range(n):
            k = int(predictions[i].argmax())
            rows.append({"example_id": ids[i], "output": k, "target": targets[i],
                         "score": float(probs[i, k])})  # fmt: skip
    else:
        for i in range(n):
            rows.append({"example_id": ids[i], "output": predictions[i].tolist(),
                         "target": targets[i]})  # fmt: skip
    return rows


def training_args(run: RunSpec, **fields: Any) -> transformers.TrainingArguments:
    """The `TrainingArguments` of an `Experiment`'s run: the run's config fields that name
    `TrainingArguments` fields (its arm's overrides), then `fields`, with the run's seed and
    ``output_dir`` in the run's folder (so a rerun resumes from its checkpoints)."""
    if not isinstance(run, RunSpec):
        raise ConfigError(f"run={run!r}: pass the RunSpec that train(run) was given")
    known = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    config = (
        run.config.model_dump() if hasattr(run.config, "model_dump") else dict(run.config or {})
    )
    chosen = {k: v for k, v in config.items() if k in known}
    chosen.update(fields)
    chosen.setdefault("output_dir", str(run.dir / "trainer"))
    chosen.setdefault("seed", run.seed)
    chosen.setdefault("report_to", [])
    return transformers.TrainingArguments(**chosen)


__all__ = ["CONFIG_FILE", "LabCallback", "predict", "train", "training_args"]
