"""`WandbLogger`: mirrors each lab run into one Weights & Biases run.

| hook              | what it sends                                               |
|-------------------|-------------------------------------------------------------|
| on_run_start      | ``wandb.init``: group = the run's group, job_type = its arm, |
|                   | name = its run key, config = its config, a stable id         |
| on_step_end       | the step's metrics, every `log_every` steps                  |
| on_eval           | the eval's metrics as ``<eval>/<key>``                       |
| on_media          | ``wandb.Histogram`` / ``wandb.Image`` per key, at the step;  |
|                   | a histogram's NaN/inf counts as ``<key>/nan`` etc. if any    |
| on_benchmark_eval | its metrics and breakdowns, and its predictions as a Table   |
| on_checkpoint     | the manifest row as a summary entry, or an artifact ref      |
| on_run_end        | final metrics and status into the summary; ``finish``       |

Every row is logged against ``trainer/step`` (``define_metric("*", step_metric=...)``), not
wandb's own ``_step``: a resumed run logs again from its checkpoint's step, which is lower
than the last step wandb saw, and wandb drops rows whose ``_step`` goes backwards.

The wandb run id is kept in the run's folder (`run_id_for`) and the run is opened with
``resume="allow"``: running the experiment again (lab's resume, from that folder's
checkpoints) continues the same wandb run instead of starting a stray one. `wandb` is imported
inside the hooks, so `lab` imports without it (``pip install 'lab[wandb]'``).
"""

from __future__ import annotations

import functools
import json
import math
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import pydantic

from lab._atomic import write_text_atomic
from lab._background import BackgroundCalls
from lab._imports import require
from lab.callbacks.params import PositiveInt
from lab.callbacks.registry import register
from lab.hooks import NOTES, TAGS, Callback, LogContext, LoopState, Phase
from lab.media import Histogram
from lab.records import FAILED

if TYPE_CHECKING:
    from lab.media import Media
    from lab.records import (
        ArmResult,
        EvalResult,
        ExperimentResult,
        ManifestRow,
        RunResult,
        TrainingBatch,
    )

RUN_ID = "wandb:run_id"
URL = "wandb:url"
DIR = "wandb:dir"
STEP = "trainer/step"  # the x axis of every chart
ID_FILE = "wandb-run-id"  # in the run folder: the wandb run that folder's attempts continue
CheckpointMode = Literal["summary", "artifact"]
#: The prediction columns lab knows, in the order a table shows them; others follow.
PREDICTION_COLUMNS = ("example_id", "input", "output", "target", "score")


def run_id_for(run_dir: Path | None) -> str:
    """The wandb id of the lab run whose folder is `run_dir`: kept in the folder, so it is
    the same for every attempt that resumes from that folder's checkpoints, and new for
    anything else.

    The id is made at random the first time and written to ``<run_dir>/wandb-run-id``; a
    later attempt (lab's resume, which reads the same folder) reads it back and continues
    the same wandb run. An id derived from names alone would join unrelated runs that share
    them: every bare fit, or an experiment of the same name recorded in a fresh store. A
    bare fit without a run folder gets a fresh id each time, as it cannot resume either.
    """
    fresh = f"lab-{secrets.token_hex(8)}"
    if run_dir is None:
        return fresh
    path = Path(run_dir) / ID_FILE
    try:
        kept = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        kept = ""
    if kept:
        return kept
    write_text_atomic(path, fresh + "\n")  # a kill never leaves half an id
    return fresh


@register("wandb_logger")
class WandbLogger(Callback):
    """One wandb run per lab run, grouped by arm, continued when the lab run resumes.

    `mode` is wandb's (``"online"``, ``"offline"``, ``"disabled"``; None: ``WANDB_MODE`` or
    wandb's default). Step metrics are sent every `log_every` steps (default 10; and at the
    last step, and before each checkpoint); the store keeps every step.

    The training thread never calls wandb after ``wandb.init``: each row, summary update and
    artifact is queued to a sender thread of the run's own (`lab._background`), which makes
    the calls in order. ``run.log`` costs about 0.4 ms even offline, more than a small
    model's step; queued, a logged step costs the training thread a dict and an append. The
    queue is flushed before ``finish``, so the run's last rows are never lost.
    `predictions_table` logs benchmark predictions as a ``wandb.Table``. `checkpoints` puts
    each checkpoint manifest row into the run summary (``"summary"``: small, always works),
    logs it as a reference artifact (``"artifact"``: wandb records the path and the files'
    sizes, not their bytes), or skips it (None).

    It sets ``ctx.ids["wandb:run_id"]`` and ``ctx.extras["wandb:url"]`` (None offline) and
    ``ctx.extras["wandb:dir"]`` when a run starts. It is not critical: when wandb is down
    the run goes on and the failure is counted on the run (strict mode raises it).
    """

    phase = Phase.MIRROR  # after the SqlLogger records: what wandb shows is in the store
    rank_zero_only = True  # under DDP: one wandb run per lab run, opened by rank 0

    def __init__(
        self,
        project: Annotated[str, pydantic.StringConstraints(strip_whitespace=True, min_length=1)],
        entity: str | None = None,
        mode: Literal["online", "offline", "disabled"] | None = None,
        log_every: PositiveInt = 10,
        predictions_table: bool = True,
        checkpoints: CheckpointMode | None = "summary",
    ) -> None:
        require("wandb", "wandb", "WandbLogger")
        self.project = project
        self.entity = entity
        self.mode = mode
        self.log_every = log_every
        self.predictions_table = predictions_table
        self.checkpoints = checkpoints
        self._run: Any = None  # the open wandb run, between on_run_start and on_run_end
        self._calls: BackgroundCalls | None = None  # its sender thread
        self._last_step = 0  # post-training benchmarks are logged at the run's last step

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the open wandb run (``executor="processes"``): a worker's copy
        opens its own, in its own process, at its run's `on_run_start`."""
        state = self.__dict__.copy()
        state["_run"] = None
        state["_calls"] = None
        return state

    # -- run level -----------------------------------------------------------------------
    def on_run_start(self, ctx: LogContext) -> None:
        assert ctx.run_key is not None
        self._open(ctx, ctx.run_key)

    def on_benchmark_eval(
        self,
        ctx: LogContext,
        eval_result: EvalResult,
        predictions: list[dict],
        *,
        step: int | None = None,
    ) -> None:
        run = self._run
        if run is None:
            return
        name = eval_result.name
        row: dict[str, Any] = {}
        if step is None:  # after training: in-loop benchmarks sent their metrics at on_eval
            row.update({f"{name}/{k}": v for k, v in eval_result.metrics.items()})
        for part, values in eval_result.breakdowns.items():
            row.update({f"{name}/{part}/{k}": v for k, v in values.items()})
        if eval_result.error:
            self._send(run.summary.__setitem__, f"{name}/error", eval_result.error)
        if self.predictions_table and predictions:
            row[f"{name}/predictions"] = _table(predictions)
        if not row:
            return
        if step is None:
            # Post-training results describe the final model: they go to the summary too, so
            # the runs table can sort by them.
            summary = {k: v for k, v in row.items() if not k.endswith("/predictions")}
            self._send(run.summary.update, summary)
            step = self._last_step
        self._send(run.log, {**row, STEP: step})

    def on_run_end(self, ctx: LogContext, run_result: RunResult, arm: ArmResult) -> None:
        run = self._run
        if run is None:
            return
        summary: dict[str, Any] = {
            **_finite(run_result.metrics),
            "lab/status": run_result.status,
            "lab/seconds": run_result.seconds,
        }
        if run_result.error:
            summary["lab/error"] = run_result.error
        self._send(run.summary.update, summary)
        self._finish(failed=run_result.status in FAILED)

    def on_experiment_end(self, ctx: LogContext, result: ExperimentResult) -> None:
        self._finish(failed=True)  # only if a run was left open (an interrupt)

    def close(self) -> None:
        self._finish(failed=True)  # same: never leave a wandb process running

    # -- loop level ----------------------------------------------------------------------
    def on_train_start(self, state: LoopState) -> None:
        self._last_step = state.step

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        self._last_step = step_idx
        due = step_idx % self.log_every == 0 or step_idx == state.num_steps or state.checkpoint_due
        if self._run is None or not due:
            return
        self._send(self._run.log, {**metrics, STEP: step_idx})

    def on_eval(
        self, state: LoopState, step_idx: int, eval_name: str, metrics: dict[str, float]
    ) -> None:
        if self._run is not None:
            row = {f"{eval_name}/{k}": v for k, v in metrics.items()}
            self._send(self._run.log, {**row, STEP: step_idx})

    def on_media(self, state: LoopState, step_idx: int, media: Mapping[str, Media]) -> None:
        if self._run is not None:  # wandb's objects are built on the sender thread: an
            # Image reads its file, which the training thread must not wait for
            self._send(_log_media, self._run, dict(media), step_idx)

    def on_checkpoint(self, state: LoopState, row: ManifestRow) -> None:
        run = self._run
        if run is None or self.checkpoints is None:
            return
        path = _checkpoint_path(state.ctx, row)
        if self.checkpoints == "summary":
            entry = {
                "path": str(path),
                "event": row.event,
                "kind": row.kind,
                "metrics": _finite(row.metrics),
            }
            if row.reason:
                entry["reason"] = row.reason
            update: dict[str, Any] = {f"checkpoints/step_{row.step}": entry}
            if row.event == "save":
                update["checkpoints/latest"] = {"step": row.step, "path": str(path)}
            self._send(run.summary.update, update)
            return
        if row.event != "save":
            return  # an artifact version stays; wandb keeps the record of what was saved
        import wandb

        artifact = wandb.Artifact(
            f"{run.id}-checkpoint",
            type="checkpoint",
            metadata={"step": row.step, "kind": row.kind, "metrics": _finite(row.metrics)},
        )
        artifact.add_reference(path.as_uri(), checksum=False)
        aliases = [f"step-{row.step}", "latest"]
        self._send(functools.partial(run.log_artifact, artifact, aliases=aliases))

    # ------------------------------------------------------------------------------------
    def _open(self, ctx: LogContext, run_key: str) -> None:
        import wandb  # lazily: lab imports without wandb

        self._finish(failed=True)  # a run left open by an interrupt must not swallow this one
        run = wandb.init(
            project=self.project,
            entity=self.entity,
            mode=self.mode,
            id=run_id_for(ctx.run_dir),
            resume="allow",
            name=run_key,
            group=ctx.group_name,
            job_type=ctx.arm,
            config=dict(ctx.run_config or {}),
            tags=list(ctx.extras.get(TAGS) or []) or None,  # the experiment's, as lab's store
            notes=ctx.extras.get(NOTES),
        )
        run.define_metric(STEP)
        run.define_metric("*", step_metric=STEP)
        self._run = run
        self._calls = BackgroundCalls(f"lab-wandb-{run.id}")
        self._last_step = 0
        ctx.ids[RUN_ID] = run.id
        ctx.extras[URL] = run.url
        ctx.extras[DIR] = run.dir

    def _send(self, fn: Any, *args: Any) -> None:
        """Hand a call into wandb to the run's sender thread (see `BackgroundCalls`)."""
        assert self._calls is not None
        self._calls.call(fn, *args)

    def _finish(self, *, failed: bool) -> None:
        """Send what is queued, then finish the wandb run; a queued call that failed is
        raised after the run is finished, so wandb is never left running."""
        run, self._run = self._run, None
        calls, self._calls = self._calls, None
        if run is None:
            return
        try:
            if calls is not None:
                calls.close()
        finally:
            run.finish(exit_code=1 if failed else 0)


def _checkpoint_path(ctx: LogContext, row: ManifestRow) -> Path:
    """The checkpoint's folder as an absolute path (the manifest keeps it relative to the
    run's ``checkpoints/`` folder), so the entry still points at it from anywhere."""
    path = Path(row.path)
    if not path.is_absolute() and ctx.run_dir is not None:
        path = ctx.run_dir / "checkpoints" / path
    return path.resolve()


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    """Metrics for a summary or artifact metadata, which wandb stores as strict JSON (a NaN
    there becomes null). History rows keep NaN and inf: they are data, and wandb charts
    them as such."""
    return {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}


def _log_media(run: Any, media: dict[str, Media], step: int) -> None:
    """Log one step's media as one wandb row: a `Histogram` as ``wandb.Histogram`` (its
    bins and counts as they are; NaN, +inf and -inf counts, which wandb's histogram has no
    place for, as ``<key>/nan``, ``<key>/posinf``, ``<key>/neginf`` when not 0), an `Image`
    as ``wandb.Image`` of its file. Runs on the sender thread."""
    import numpy as np
    import wandb

    row: dict[str, Any] = {}
    for key, record in media.items():
        if isinstance(record, Histogram):  # (counts, edges) as numpy.histogram gives them
            counts, edges = np.asarray(record.counts), np.asarray(record.edges)
            row[key] = wandb.Histogram(np_histogram=(counts, edges))
            for name in ("nan", "posinf", "neginf"):
                if getattr(record, name):
                    row[f"{key}/{name}"] = getattr(record, name)
        else:
            row[key] = wandb.Image(str(Path(record.path).resolve()))
    run.log({**row, STEP: step})


def _table(predictions: list[dict[str, Any]]) -> Any:
    """Benchmark predictions as a wandb Table: lab's columns first, then every other key."""
    import wandb

    columns = [c for c in PREDICTION_COLUMNS if any(c in p for p in predictions)]
    columns += sorted({k for p in predictions for k in p} - set(columns))
    data = [[_cell(p.get(c)) for c in columns] for p in predictions]
    # wandb types its column names as list[str | int]; the list is only read
    return wandb.Table(columns=cast("list[str | int]", columns), data=data)


def _cell(value: Any) -> Any:
    """A table cell: numbers, strings and bools as they are, anything else as JSON text."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return str(value)
