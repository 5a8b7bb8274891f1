"""Callbacks that leave plain files in each run's folder: a hook log, the config, the metrics.

- `JsonlLogger` writes one JSON line per hook call (``hooks.jsonl``): what happened, when, with
  which values, readable with ``grep`` and ``jq`` and replayable into another callback with
  `replay`, so a callback can be debugged against a real run without training again.
- `ConfigSaver` writes ``config.json`` (the run's config and identity) into the run folder
  and into every checkpoint folder, so a checkpoint copied elsewhere still says what made it.
- `MetricSaver` keeps ``metrics.json`` with the latest metrics at chosen steps and the final
  ones at the end, for scripts that want a run's numbers without opening the store.

The files are written from the hooks, in the process that runs the run (a worker process
under ``executor="processes"``), so every callback here keeps no open file between pickling.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from lab._atomic import write_text_atomic
from lab._json import finite_json, floats_back
from lab._secrets import logger
from lab.callbacks.params import FileName, NonNegativeInt, PositiveInt
from lab.callbacks.registry import register
from lab.errors import ConfigError
from lab.hooks import Callback, LogContext, LoopState

if TYPE_CHECKING:
    from lab.experiment import ArmResult, ExperimentResult, RunResult
    from lab.loop.checkpoints import ManifestRow
    from lab.loop.evals import EvalResult
    from lab.loop.training import LoopArtifacts, TrainingBatch

log = logger("lab.callbacks.files")

__all__ = [
    "ConfigSaver",
    "JsonlLogger",
    "MetricSaver",
    "ReplayedError",
    "read_hooks",
    "read_metrics",
    "replay",
]

HOOKS_FILE = "hooks.jsonl"
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.json"


# --------------------------------------------------------------------------------------------
# helpers


def _summarize(value: Any) -> Any:
    """A JSON-able form of `value`: tensors become their shape and dtype (never their data,
    which could be huge and is not what a hook log is for); anything unknown its repr."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None  # type: ignore[assignment]
    if torch is not None and isinstance(value, torch.Tensor):
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


def _write_json_atomic(path: Path, data: Any) -> None:
    """Write `path` whole or not at all: a reader (or a kill) never sees half a file."""
    text = json.dumps(finite_json(data), indent=2, sort_keys=True, allow_nan=False)
    write_text_atomic(path, text + "\n")


def _json_default(value: Any) -> Any:
    """What `json` cannot write itself (a tensor, a path, an object), in JSON's own terms."""
    return finite_json(_summarize(value))


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------------------------
# JsonlLogger


@register("jsonl_logger")
class JsonlLogger(Callback):
    """One JSON line per hook call: ``{"hook", "time", "run_key", ...payload}``.

    Each run gets its own file, `path` (default ``hooks.jsonl``) inside the run's folder; a
    relative `path` is taken inside the run folder (a bare loop's `run_dir`, or the working
    directory), an absolute one may name the run with ``{run_key}``. Experiment-level hooks
    (`on_experiment_start`, `on_group_start`, `on_experiment_end`, `close`) go to
    `experiment_path` (default ``hooks.jsonl`` in the experiment's output folder). Files are
    appended to, so a resumed run keeps the lines of its earlier attempts (a
    `post_checkpoint_loaded` line shows where it picked up).

    The payload is typed per hook (``step_idx``, ``metrics``, ``eval_name``, the checkpoint's
    manifest ``row``, the run's ``status``...); tensors are written as their shape and dtype,
    exceptions as ``"Type: message"``. Lines are flushed as they are written: the log is
    for finding what happened before a crash.
    """

    priority = -100  # after the others: a line records what they already saw

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
        )  # fmt: skip
        self._close_run()

    def on_experiment_end(self, ctx: LogContext, result: ExperimentResult) -> None:
        self._experiment_line(
            "on_experiment_end", ctx, status=result.status, runs=len(result.runs),
            error=result.error, seconds=result.seconds,
        )  # fmt: skip

    def close(self) -> None:
        if self._run is not None:  # a bare loop: its run file ends with close
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

    def on_checkpoint(self, state: LoopState, row: ManifestRow) -> None:
        self._run_line("on_checkpoint", state.ctx, row=dataclasses.asdict(row))

    def on_train_end(self, state: LoopState, artifacts: LoopArtifacts) -> None:
        self._run_line(
            "on_train_end", state.ctx, step=artifacts.step, metrics=artifacts.metrics,
            stopped=artifacts.stopped, stop_reason=artifacts.stop_reason,
            checkpoints=len(artifacts.checkpoints),
        )  # fmt: skip


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


def read_metrics(path: str | Path) -> dict[str, Any]:
    """A `MetricSaver` file (``metrics.json``), with its metrics as floats again.

    The file is strict JSON, so it holds NaN and inf as strings; a script that reads it
    with this gets the numbers the run logged.
    """
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    doc["metrics"] = floats_back(doc.get("metrics") or {})
    return doc


class ReplayedError(Exception):
    """An exception rebuilt by `replay` from its recorded ``"Type: message"`` string."""


#: The hooks `replay` re-fires; the others are skipped (see `replay`).
REPLAYED: tuple[str, ...] = (
    "on_run_start",
    "post_checkpoint_loaded",
    "on_train_start",
    "on_step_end",
    "on_eval",
    "on_checkpoint",
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
    - `on_step_end(state, step_idx, batch, metrics)`: the recorded metrics, exactly; `batch`
      is an empty `TrainingBatch` (the data was never logged, only its shape);
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
    from lab.loop.checkpoints import ManifestRow
    from lab.loop.training import LoopArtifacts, TrainingBatch

    wanted = set(REPLAYED if hooks is None else hooks)
    unknown = sorted(wanted - set(REPLAYED))
    if unknown:
        raise ConfigError(f"replay cannot rebuild {unknown}; it replays {', '.join(REPLAYED)}")
    path = Path(path)
    ctx = LogContext(experiment="", output_dir=path.parent.parent)
    state = LoopState(ctx=ctx, model=None, optimizer=None, num_steps=0)  # type: ignore[arg-type]
    batch = TrainingBatch()
    fired: list[str] = []
    for rec in read_hooks(path):
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
        if hook not in wanted:
            continue
        if hook == "on_run_start":
            callback.on_run_start(ctx)
        elif hook == "post_checkpoint_loaded":
            callback.post_checkpoint_loaded(state, Path(rec["path"]))
        elif hook == "on_train_start":
            callback.on_train_start(state)
        elif hook == "on_step_end":
            callback.on_step_end(state, rec["step_idx"], batch, rec["metrics"])
        elif hook == "on_eval":
            callback.on_eval(state, rec["step_idx"], rec["eval_name"], rec["metrics"])
        elif hook == "on_checkpoint":
            callback.on_checkpoint(state, ManifestRow(**rec["row"]))
        elif hook == "on_error":
            callback.on_error(ctx, ReplayedError(rec["error"]))
        elif hook == "on_train_end":
            artifacts = LoopArtifacts(
                model=None,  # type: ignore[arg-type]
                metrics=rec["metrics"],
                step=rec["step"],
                stopped=rec.get("stopped", False),
                stop_reason=rec.get("stop_reason"),
            )
            callback.on_train_end(state, artifacts)
        else:
            continue
        fired.append(hook)
    return fired


# --------------------------------------------------------------------------------------------
# ConfigSaver


@register("config_saver")
class ConfigSaver(Callback):
    """Writes `fname` (``config.json``) into the run folder and every checkpoint folder.

    It runs at priority 50: after the SqlLogger (100) has recorded a save, and before a
    `WandbLogger` (10) references the checkpoint folder, so the reference finds the file.

    The file holds ``{"experiment", "run_key", "arm", "repeat", "stage", "seed", "config"}``
    where ``config`` is the run's config (`ctx.run_config`; a bare loop has none, so the
    `config` given here, or {}). It is written at `on_run_start` (a bare loop: at
    `on_train_start`), and at each checkpoint save, so a checkpoint folder copied away from
    its run still says what made it. Each write is atomic.
    """

    priority = 50

    def __init__(self, fname: FileName = CONFIG_FILE, config: dict[str, Any] | None = None) -> None:
        self.fname = fname
        self.config = config
        self._saved_run: str | None = None
        self._document: dict[str, Any] | None = None

    def document(self, ctx: LogContext) -> dict[str, Any]:
        """What the file holds for the run `ctx` points at."""
        config = ctx.run_config if ctx.run_config is not None else self.config
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
        self._saved_run = ctx.run_key or ""

    def on_run_start(self, ctx: LogContext) -> None:
        self._save_run(ctx)

    def on_train_start(self, state: LoopState) -> None:
        if self._saved_run != (state.ctx.run_key or "") or self._document is None:
            self._save_run(state.ctx)  # a bare loop, which has no on_run_start

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
        self._saved_run = self._document = None


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
        status = "stopped" if artifacts.stopped else "completed"
        self._write(state.ctx, artifacts.step, self._latest, final=True, status=status)

    def on_run_end(self, ctx: LogContext, run_result: RunResult, arm: ArmResult) -> None:
        metrics = run_result.metrics if run_result.status != "failed" else self._latest
        self._write(ctx, self._step, metrics, final=True, status=run_result.status)
        self._reset()
