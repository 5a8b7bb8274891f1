"""`JsonlLogger`: one JSON line per hook call, in a file of each run's folder (``hooks.jsonl``).

What happened, when, with which values, readable with ``grep`` and ``jq`` (the lines are strict
JSON: NaN and inf are the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``), and replayable
into another callback with `replay`, so a callback can be debugged against a real run without
training again. `read_hooks` reads a file back.

The file is written from the hooks, in the process that runs the run (a worker process under
``executor="processes"``), so the logger keeps no open file across pickling.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from lab._json import NON_FINITE, finite_json, floats_back
from lab._secrets import logger
from lab.callbacks.registry import register
from lab.errors import ConfigError
from lab.hooks import Callback, LogContext, LoopState, Phase

if TYPE_CHECKING:
    from lab.media import Media
    from lab.records import (
        ArmResult,
        EvalResult,
        ExperimentResult,
        LoopArtifacts,
        ManifestRow,
        RunResult,
        TrainingBatch,
    )

log = logger("lab.loggers.jsonl")

__all__ = ["HOOKS_FILE", "REPLAYED", "JsonlLogger", "ReplayedError", "read_hooks", "replay"]

HOOKS_FILE = "hooks.jsonl"


def _summarize(value: Any) -> Any:
    """A JSON-able form of `value`: tensors become their shape and dtype (never their data,
    which could be huge and is not what a hook log is for); anything unknown its repr."""
    import torch  # a dependency, imported here so that the module stays light

    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _summarize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_summarize(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, BaseException):
        return f"{type(value).__name__}: {value}"
    return repr(value)


def _json_default(value: Any) -> Any:
    """What `json` cannot write itself (a tensor, a path, an object), in JSON's own terms."""
    return finite_json(_summarize(value))


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@register("jsonl_logger")
class JsonlLogger(Callback):
    """One JSON line per hook call: ``{"hook", "time", "run_key", ...payload}``.

    Each run gets its own file, `path` (default ``hooks.jsonl``) inside the run's folder; a
    relative `path` is taken inside the run folder (`ctx.folder`: for a bare fit its
    `run_dir`, or the working directory), an absolute one may name the run with
    ``{run_key}``. Experiment-level hooks (`on_experiment_start`, `on_group_start`,
    `on_experiment_end`, `close`) go to `experiment_path` (default ``hooks.jsonl`` in the
    experiment's output folder; a bare fit's is `run_dir`'s parent, else the working
    directory, where its run file is then too: both append to it). Files are appended to,
    so a resumed run keeps the lines of its earlier attempts (a `post_checkpoint_loaded`
    line shows where it picked up).

    The payload is typed per hook (``step_idx``, ``metrics``, ``eval_name``, the checkpoint's
    manifest ``row``, the run's ``status``...); tensors are written as their shape and dtype,
    exceptions as ``"Type: message"``. Lines are flushed as they are written: the log is
    for finding what happened before a crash.
    """

    phase = Phase.TRACE  # after the others: a line records what they already saw
    rank_zero_only = True  # under DDP: one file per run, written by rank 0

    def __init__(self, path: str | None = None, experiment_path: str | None = None) -> None:
        self.path = path
        self.experiment_path = experiment_path
        self._run: IO[str] | None = None
        self._experiment: IO[str] | None = None
        self.run_files: list[Path] = []  # every run file written, in order (this process)

    def __getstate__(self) -> dict[str, Any]:
        """Open files stay behind: a worker process opens its own."""
        state = self.__dict__.copy()
        state["_run"] = state["_experiment"] = None
        return state

    # -- writing ---------------------------------------------------------------------------
    def _run_path(self, ctx: LogContext) -> Path:
        name = (self.path or HOOKS_FILE).format(run_key=ctx.run_key or "run")
        path = Path(name)
        return path if path.is_absolute() else ctx.folder / path

    def _open_run(self, ctx: LogContext) -> IO[str]:
        if self._run is None:
            path = self._run_path(ctx)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._run = path.open("a", encoding="utf-8")
            self.run_files.append(path)
        return self._run

    def _close_run(self) -> None:
        if self._run is not None:
            self._run.close()
            self._run = None

    def _line(self, out: IO[str], hook: str, ctx: LogContext, payload: dict[str, Any]) -> None:
        record = {"hook": hook, "time": time.time(), "run_key": ctx.run_key, **payload}
        out.write(json.dumps(finite_json(record), default=_json_default) + "\n")
        out.flush()

    def _run_line(self, hook: str, ctx: LogContext, **payload: Any) -> None:
        self._line(self._open_run(ctx), hook, ctx, payload)

    def _experiment_line(self, hook: str, ctx: LogContext | None, **payload: Any) -> None:
        if self._experiment is None:
            if ctx is None:
                return
            name = self.experiment_path or HOOKS_FILE
            path = Path(name) if Path(name).is_absolute() else ctx.output_dir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            self._experiment = path.open("a", encoding="utf-8")
        self._line(self._experiment, hook, ctx or LogContext("", Path()), payload)

    # -- experiment level ----------------------------------------------------------------
    def on_experiment_start(self, ctx: LogContext) -> None:
        self._experiment_line("on_experiment_start", ctx, experiment=ctx.experiment)

    def on_group_start(self, ctx: LogContext, group_name: str) -> None:
        self._experiment_line("on_group_start", ctx, group_name=group_name)

    def on_run_start(self, ctx: LogContext) -> None:
        self._close_run()  # one file per run, even if the last run's end was never seen
        self._run_line(
            "on_run_start", ctx, experiment=ctx.experiment, arm=ctx.arm, repeat=ctx.repeat,
            stage=ctx.stage, seed=ctx.seed, run_config=ctx.run_config,
        )  # fmt: skip

    def on_benchmark_eval(
        self,
        ctx: LogContext,
        eval_result: EvalResult,
        predictions: list[dict],
        *,
        step: int | None = None,
    ) -> None:
        self._run_line(
            "on_benchmark_eval", ctx, step=step, eval_name=eval_result.name,
            metrics=eval_result.metrics, error=eval_result.error, seconds=eval_result.seconds,
            predictions=len(predictions),
        )  # fmt: skip

    def on_error(self, ctx: LogContext, exc: BaseException) -> None:
        self._run_line("on_error", ctx, error=_error(exc))

    def on_run_end(self, ctx: LogContext, run_result: RunResult, arm: ArmResult) -> None:
        self._run_line(
            "on_run_end", ctx, status=run_result.status, metrics=run_result.metrics,
            error=run_result.error, seconds=run_result.seconds,
            callback_errors=len(run_result.callback_errors),
            **({"pruned": run_result.pruned} if run_result.pruned is not None else {}),
        )  # fmt: skip
        self._close_run()

    def on_experiment_end(self, ctx: LogContext, result: ExperimentResult) -> None:
        self._experiment_line(
            "on_experiment_end", ctx, status=result.status, runs=len(result.runs),
            error=result.error, seconds=result.seconds,
        )  # fmt: skip

    def close(self) -> None:
        if self._run is not None:  # a run whose on_run_end never came: its file ends here
            self._line(self._run, "close", LogContext("", Path()), {})
        self._close_run()
        if self._experiment is not None:
            self._line(self._experiment, "close", LogContext("", Path()), {})
            self._experiment.close()
            self._experiment = None

    # -- loop level ----------------------------------------------------------------------
    def post_checkpoint_loaded(self, state: LoopState, path: Path) -> None:
        self._run_line("post_checkpoint_loaded", state.ctx, step=state.step, path=str(path))

    def on_train_start(self, state: LoopState) -> None:
        self._run_line("on_train_start", state.ctx, step=state.step, num_steps=state.num_steps)

    def on_epoch_start(self, state: LoopState, epoch: int) -> None:
        self._run_line("on_epoch_start", state.ctx, step=state.step, epoch=epoch)

    def pre_step(self, state: LoopState, step_idx: int, batch: TrainingBatch) -> None:
        self._run_line(
            "pre_step", state.ctx, step_idx=step_idx, epoch=batch.epoch, index=batch.index,
            batch=_summarize(batch.data),
        )  # fmt: skip

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        self._run_line("on_step_end", state.ctx, step_idx=step_idx, metrics=metrics)

    def on_eval(
        self, state: LoopState, step_idx: int, eval_name: str, metrics: dict[str, float]
    ) -> None:
        self._run_line(
            "on_eval", state.ctx, step_idx=step_idx, eval_name=eval_name, metrics=metrics
        )

    def on_media(self, state: LoopState, step_idx: int, media: Mapping[str, Media]) -> None:
        self._run_line(
            "on_media", state.ctx, step_idx=step_idx,
            media={str(key): _media_record(record) for key, record in media.items()},
        )  # fmt: skip

    def on_checkpoint(self, state: LoopState, row: ManifestRow) -> None:
        self._run_line("on_checkpoint", state.ctx, row=dataclasses.asdict(row))

    def on_epoch_end(self, state: LoopState, epoch: int) -> None:
        self._run_line("on_epoch_end", state.ctx, step=state.step, epoch=epoch)

    def on_train_end(self, state: LoopState, artifacts: LoopArtifacts) -> None:
        self._run_line(
            "on_train_end", state.ctx, step=artifacts.step, metrics=artifacts.metrics,
            stopped=artifacts.stopped, stop_reason=artifacts.stop_reason,
            checkpoints=len(artifacts.checkpoints),
        )  # fmt: skip


def _media_record(record: Any) -> dict[str, Any]:
    """A media record as a line holds it: its ``type`` (the record's class name), for a
    histogram the ``total`` of its counts, and the record's own fields (a histogram's edges
    and counts, an image's path in the run folder and size), so `replay` rebuilds it whole."""
    out: dict[str, Any] = {"type": type(record).__name__}
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    else:  # not a lab.media record: what it is, never its data
        return {**out, "value": _summarize(record)}
    counts = fields.get("counts")
    if out["type"] == "Histogram" and isinstance(counts, (list, tuple)):
        out["total"] = sum(counts)
    out.update({k: str(v) if isinstance(v, Path) else _summarize(v) for k, v in fields.items()})
    return out


def _media_back(recorded: Mapping[str, Any]) -> Any:
    """The `lab.media` record a line's media entry describes (lists become tuples again, a
    path a `Path`); an entry of another type comes back as the recorded dict."""
    import lab.media

    kind = getattr(lab.media, str(recorded.get("type")), None)
    if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
        return dict(recorded)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(kind):
        if f.name not in recorded:
            continue
        value = recorded[f.name]
        if isinstance(value, list):
            value = tuple(NON_FINITE.get(v, v) if isinstance(v, str) else v for v in value)
        elif f.name == "path" and isinstance(value, str):
            value = Path(value)
        values[f.name] = value
    return kind(**values)


def read_hooks(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of a `JsonlLogger` file, in order (a torn last line is skipped).

    Metrics come back as floats: the file holds NaN and inf as the strings ``"NaN"``,
    ``"Infinity"`` and ``"-Infinity"`` (strict JSON, which jq reads), and this turns those
    of each record's ``metrics`` (and its checkpoint ``row``'s) back into numbers.
    """
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                log.warning("skipping a torn line in %s", path)
                continue
            if isinstance(record.get("metrics"), dict):
                record["metrics"] = floats_back(record["metrics"])
            row = record.get("row")
            if isinstance(row, dict) and isinstance(row.get("metrics"), dict):
                row["metrics"] = floats_back(row["metrics"])
            yield record


class ReplayedError(Exception):
    """An exception rebuilt by `replay` from its recorded ``"Type: message"`` string."""


#: The hooks `replay` re-fires; the others are skipped (see `replay`).
REPLAYED: tuple[str, ...] = (
    "on_run_start",
    "post_checkpoint_loaded",
    "on_train_start",
    "on_epoch_start",
    "on_step_end",
    "on_media",
    "on_eval",
    "on_checkpoint",
    "on_epoch_end",
    "on_error",
    "on_train_end",
)


def replay(
    path: str | Path, callback: Callback, *, hooks: Iterable[str] | None = None
) -> list[str]:
    """Fire the hooks recorded in a `JsonlLogger` run file into `callback`, in order.

    What comes back is rebuilt from the log, so it is the recorded values, not live objects:

    - `on_run_start(ctx)`: a `LogContext` with the experiment, run key, arm, repeat, stage,
      seed and run config; its `output_dir` is the log file's grandparent folder;
    - `post_checkpoint_loaded`, `on_train_start`: a `LoopState` whose `model` and
      `optimizer` are None; `step`, `num_steps` and `metrics` follow the log;
    - `on_epoch_start(state, epoch)`, `on_epoch_end(state, epoch)`: the epoch, with
      `state.epoch` and `state.step` as recorded;
    - `on_step_end(state, step_idx, batch, metrics)`: the recorded metrics, exactly; `batch`
      is an empty `TrainingBatch` (the data was never logged, only its shape);
    - `on_media(state, step_idx, media)`: the `lab.media` records as logged (a histogram's
      edges and counts, an image's path and size; the image file itself is not read);
    - `on_eval`: the step, eval name and metrics; `state.current_eval` is None;
    - `on_checkpoint(state, row)`: the `ManifestRow` as recorded (the folder may be gone);
    - `on_error(ctx, exc)`: a `ReplayedError` whose message is the recorded error;
    - `on_train_end(state, artifacts)`: `LoopArtifacts` with the final metrics, step and stop
      flags, `model=None`, no checkpoint rows, no evals.

    Not replayed: `pre_step` (no batch data), `on_benchmark_eval` (no predictions),
    `on_run_end` (a `RunResult`/`ArmResult` would be half-made), the experiment-level hooks
    and `close`. `hooks` picks a subset of `REPLAYED`. Returns the hooks fired, in order; an
    exception of the callback propagates (a replay is for debugging it).
    """
    from lab.records import TrainingBatch

    wanted = set(REPLAYED if hooks is None else hooks)
    unknown = sorted(wanted - set(REPLAYED))
    if unknown:
        raise ConfigError(f"replay cannot rebuild {unknown}; it replays {', '.join(REPLAYED)}")
    path = Path(path)
    ctx = LogContext(experiment="", output_dir=path.parent.parent)
    # a replay has neither model nor optimizer: callbacks that read them do not replay
    state = LoopState(ctx=ctx, model=None, optimizer=None, num_steps=0)  # type: ignore[arg-type]  # no model
    batch = TrainingBatch()
    fired: list[str] = []
    for rec in read_hooks(path):
        hook = rec.get("hook")
        _follow(rec, ctx, state)
        if hook in wanted and _fire(callback, hook, rec, ctx, state, batch):
            fired.append(hook)
    return fired


def _follow(rec: dict[str, Any], ctx: LogContext, state: LoopState) -> None:
    """Bring `ctx` and `state` to where the run was when it logged `rec`."""
    hook = rec.get("hook")
    if rec.get("run_key") is not None:
        ctx.run_key = rec["run_key"]
    if hook == "on_run_start":
        ctx.experiment = rec.get("experiment") or ""
        ctx.arm, ctx.repeat, ctx.seed = rec.get("arm"), rec.get("repeat"), rec.get("seed")
        ctx.stage, ctx.run_config = rec.get("stage") or 0, rec.get("run_config")
    elif hook in ("post_checkpoint_loaded", "on_train_start"):
        state.step = rec.get("step", state.step)
        state.num_steps = rec.get("num_steps", state.num_steps)
    elif hook == "on_step_end":
        state.step, state.metrics = rec["step_idx"], rec["metrics"]
    elif hook in ("on_epoch_start", "on_epoch_end"):
        state.step, state.epoch = rec.get("step", state.step), rec["epoch"]


def _fire(
    callback: Callback,
    hook: str,
    rec: dict[str, Any],
    ctx: LogContext,
    state: LoopState,
    batch: TrainingBatch,
) -> bool:
    """Fire the recorded `hook` into `callback` with what `rec` rebuilds; False for a hook
    replay does not rebuild."""
    from lab.records import LoopArtifacts, ManifestRow

    if hook == "on_run_start":
        callback.on_run_start(ctx)
    elif hook == "post_checkpoint_loaded":
        callback.post_checkpoint_loaded(state, Path(rec["path"]))
    elif hook == "on_train_start":
        callback.on_train_start(state)
    elif hook == "on_step_end":
        callback.on_step_end(state, rec["step_idx"], batch, rec["metrics"])
    elif hook == "on_epoch_start":
        callback.on_epoch_start(state, rec["epoch"])
    elif hook == "on_media":
        media = {k: _media_back(v) for k, v in rec["media"].items()}
        callback.on_media(state, rec["step_idx"], media)
    elif hook == "on_epoch_end":
        callback.on_epoch_end(state, rec["epoch"])
    elif hook == "on_eval":
        callback.on_eval(state, rec["step_idx"], rec["eval_name"], rec["metrics"])
    elif hook == "on_checkpoint":
        callback.on_checkpoint(state, ManifestRow(**rec["row"]))
    elif hook == "on_error":
        callback.on_error(ctx, ReplayedError(rec["error"]))
    elif hook == "on_train_end":
        artifacts = LoopArtifacts(
            model=None,  # type: ignore[arg-type]  # a replay has no model (see `replay`)
            metrics=rec["metrics"],
            step=rec["step"],
            stopped=rec.get("stopped", False),
            stop_reason=rec.get("stop_reason"),
        )
        callback.on_train_end(state, artifacts)
    else:
        return False
    return True
