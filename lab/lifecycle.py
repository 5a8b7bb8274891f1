"""The lifecycle engine: the one module that fires the experiment, group and run hooks and
applies the failure policy around them.

Every door into a run comes through here: `Experiment.run` (serial, a process pool, Ray),
`lab.start_run`, a bare `TrainingLoop.fit()` (`lab.loop.bare.BareRun`), a worker process
(`run_in_worker`) and the other ranks of a run (`lab._rank_processes`). Where each hook fires:

    experiment_scope       on_experiment_start ... on_experiment_end (end_experiment), close
    start_group            on_group_start
    RunScope.open          on_run_start            (open_run)
    RunScope.trained       on_benchmark_eval(step=None), the post-training benchmarks
    evaluated_after        on_benchmark_eval(step=None), a framework's eval after its fit
    RunScope.failed        on_error                (fail_run)
    RunScope.close         on_run_end              (end_run), then the run's own close
    record_lost            the hooks of a run whose worker ended without a result

The failure policy, applied here once: a run that raises is `failed` and the others go on; a
critical callback that raises in `on_run_start` or `on_run_end` fails that run, not the
experiment; strict mode's `CallbackError` propagates at once; an interrupt ends the
experiment's record and propagates; `close` always fires, and what it raises while another
error propagates is logged, never in place of that error. Which callbacks get a hook, in
which order, and how many failures disable one is `lab.dispatch`.

Which run an experiment starts next, in this process or in a worker, is `lab.scheduler`, which
calls `start_group`, `execute_run`, `record_lost` and `run_ended_elsewhere` here.

The step-level hooks fire in the run handle (`lab.loop.handle`), the on-policy RL ones in
`lab.rl.loop`.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from lab._reuse import (
    next_superseded_number,
    superseded_folder,
)
from lab._secrets import logger
from lab._signals import unwind_on_sigterm
from lab.dispatch import Dispatcher
from lab.errors import CallbackError, CheckpointError, ConfigError
from lab.executors import Outcome, WorkerDied
from lab.hooks import (
    Callback,
    Hook,
    LogContext,
)
from lab.records import (
    ArmResult,
    EvalResult,
    ExperimentResult,
    LoopArtifacts,
    RunResult,
    RunSpec,
    RunStatus,
    TrainFn,
)


class Benchmark(Protocol):
    """A post-training benchmark of a run (`lab.loop.evals.Evaluator` is one): scored on
    the trained model once training returned."""

    name: str

    def run(self, model: Any, step: int | None) -> EvalResult:
        """Score `model`; `step` is None after training."""


log = logger("lab.experiment")  # a run's messages are its experiment's


#: A callable that builds callbacks for one run from its `RunSpec` (its config, arm, seed):
#: ``lambda run: ConsoleLogger(every=run.config.log_every)``.
CallbackFactory = Callable[[RunSpec], "Callback | Sequence[Callback]"]


@dataclass
class RunJob:
    """One run, ready to execute: everything `execute_run` needs, all of it picklable.

    `ctx` already points at the run (run key, arm, repeat, stage, seed, run config) and holds
    the ids the experiment-level hooks created.
    """

    train: TrainFn
    experiment: str
    arm: str
    repeat: int
    stage: int
    seed: int
    run_key: str
    config: Any
    ctx: LogContext
    carry: Literal["weights", "full"] = "weights"
    parent_run_key: str | None = None
    benchmarks: list[Benchmark] = field(default_factory=list)
    #: Factories of callbacks built for this run alone (see `run_callbacks`).
    run_callbacks: list[CallbackFactory] = field(default_factory=list)
    #: What the run asks of Ray (``executor="ray"``): the experiment's, then its arm's.
    resources: dict[str, float] = field(default_factory=dict)

    def result(self, hooks: Dispatcher, **fields: Any) -> RunResult:
        """This run's result, with its identity and the callback failures recorded so far."""
        return RunResult(
            run_key=self.run_key, arm=self.arm, repeat=self.repeat, stage=self.stage,
            seed=self.seed, parent_run_key=self.parent_run_key,
            callback_errors=_failures(hooks, self.run_key), **fields,
        )  # fmt: skip


def execute_run(
    job: RunJob,
    hooks: Dispatcher,
    arm_result: ArmResult,
    *,
    started: Callable[[LogContext], None] | None = None,
) -> tuple[RunResult, BaseException | None]:
    """Execute one run, from `on_run_start` to `on_run_end`: the one code path of every run,
    in the experiment's process and in a worker process alike.

    Seeds every generator with the run's seed and puts the caller's generator states back when
    the run ends (a random search that draws between runs gets fresh draws), calls `train`, runs
    the post-training benchmarks, and records the outcome: a run that raises is `failed` (its
    error and traceback kept) and the others go on. So is a run whose critical callback raised
    in `on_run_start` (the run does not train; `on_error` and `on_run_end` still fire for the
    other callbacks) or in `on_run_end` (see `_end_run`). The result is appended to `arm_result`
    before `on_run_end` sees it. `started(ctx)` is called once `on_run_start` has fired (a
    worker reports the run's ids with it). Returns the result and, when the run was interrupted
    (Ctrl-C, SIGTERM), the interrupt, which the caller re-raises or reports; strict mode's
    `CallbackError` propagates at once.
    """
    from lab._seeding import caller_rng_kept  # torch: imported where a run runs

    with caller_rng_kept():
        return _execute_seeded_run(job, hooks, arm_result, started)


def _execute_seeded_run(
    job: RunJob,
    hooks: Dispatcher,
    arm_result: ArmResult,
    started: Callable[[LogContext], None] | None,
) -> tuple[RunResult, BaseException | None]:
    scope = RunScope(job, hooks, arm_result)
    try:
        # inside the try: a critical callback that cannot start the run fails it, not the
        # experiment
        spec = scope.open(started)
        scope.trained(job.train(spec))
    except CallbackError:
        raise  # strict mode: a callback bug must not look like a training failure
    except BaseException as exc:
        scope.failed(exc)
    return scope.close(), scope.interrupt


class RunScope:
    """One run from `on_run_start` to `on_run_end`, around whatever trains it: `train(run)`
    under an Experiment, or the body of a ``with lab.start_run(...)`` block.

    `open` fires `on_run_start` and hands back the `RunSpec`; then either `trained` (with
    what training returned: benchmarks run, the status is `completed`, `stopped` or
    `pruned`, as `LoopArtifacts.status` says; a dict or None: `completed`) or
    `failed` (the error recorded, `on_error` fired); `close` fires `on_run_end` and returns
    the result, already appended to the arm's.
    """

    def __init__(self, job: RunJob, hooks: Dispatcher, arm_result: ArmResult) -> None:
        self.job, self.hooks, self.arm_result = job, hooks, arm_result
        ctx = job.ctx
        run_dir = ctx.output_dir / job.run_key
        run_dir.mkdir(parents=True, exist_ok=True)
        hooks.run_key = job.run_key
        from lab._seeding import seed_everything

        seed_everything(job.seed)
        self.spec = RunSpec(
            job.experiment, job.arm, job.repeat, job.stage, job.seed, job.run_key, job.config,
            run_dir, ctx, hooks, carry=job.carry,
        )  # fmt: skip
        self.t0 = time.perf_counter()
        self.status: RunStatus = "completed"
        self.pruned: dict[str, Any] | None = None  # a `pruned` run's record
        self.metrics: dict[str, float] = {}
        self.error: str | None = None
        self.traceback: str | None = None
        self.artifacts: LoopArtifacts | None = None
        self.interrupt: BaseException | None = None
        self.own: list[Callback] = []  # the callbacks built for this run alone

    def open(self, started: Callable[[LogContext], None] | None = None) -> RunSpec:
        """Build the run's own callbacks (`run_callbacks`), fire `on_run_start` (then
        `started(ctx)`) and find a chain's parent checkpoint."""
        job, ctx = self.job, self.job.ctx
        if job.run_callbacks:  # a factory that raises fails this run, not the experiment
            self.own = run_callbacks(job.run_callbacks, self.spec)
            self.hooks = self.spec.dispatcher = self.hooks.extended(self.own)
        self.hooks.fire(Hook.RUN_START, ctx)
        if started is not None:
            started(ctx)
        if job.parent_run_key is not None:  # a missing one fails this stage
            self.spec.parent_checkpoint = _final_checkpoint(ctx.output_dir / job.parent_run_key)
        return self.spec

    def trained(self, out: Any) -> None:
        """Training returned `out` (LoopArtifacts, a dict of final metrics, or None)."""
        artifacts = out if isinstance(out, LoopArtifacts) else None
        self.metrics = _final_metrics(out)
        self.artifacts = artifacts
        if artifacts is not None:  # stopped, or pruned (with where and why), or completed
            self.status, self.pruned = artifacts.status, artifacts.pruned
            job = self.job
            self.metrics.update(_benchmark(job.benchmarks, self.hooks, job.ctx, artifacts))

    def failed(self, exc: BaseException) -> None:
        """The run raised `exc`: record it and fire `on_error`; an interrupt is kept in
        `interrupt` for the caller to re-raise."""
        job = self.job
        self.status = "failed"
        self.error, self.traceback = f"{type(exc).__name__}: {exc}", traceback.format_exc()
        if isinstance(exc, Exception):
            log.error(
                "run %s of %s failed; the other runs go on:\n%s",
                job.run_key,
                job.experiment,
                self.traceback,
            )
        else:
            self.error, self.interrupt = f"interrupted ({type(exc).__name__})", exc
        self.hooks.fire(Hook.ERROR, job.ctx, exc)

    def close(self) -> RunResult:
        """Fire `on_run_end` and return the run's result."""
        job, hooks, spec = self.job, self.hooks, self.spec
        run_result = job.result(
            hooks, status=self.status, metrics=self.metrics,
            seconds=time.perf_counter() - self.t0, error=self.error, traceback=self.traceback,
            artifacts=self.artifacts, tags=list(spec.tags), notes=spec.notes,
            pruned=self.pruned if self.status == "pruned" else None,
        )  # fmt: skip
        self.arm_result.runs.append(run_result)
        _end_run(hooks, job.ctx, run_result, self.arm_result)
        # failures inside on_run_end itself still reach the run's record
        run_result.callback_errors = _failures(hooks, job.run_key)
        if self.own:  # the run's own callbacks end with it
            hooks.sibling(self.own).fire(Hook.CLOSE)
        hooks.run_key = None  # what fails from here on belongs to the experiment
        return run_result


def end_run(
    hooks: Dispatcher, ctx: LogContext, run_result: RunResult, arm_result: ArmResult
) -> Exception | None:
    """Fire `on_run_end`. A critical callback that raises there (a store that cannot record
    the run's end) fails the run, as it would have during training, and not the experiment:
    the result says `failed` with that error (a run that had failed keeps its own error), and
    the exception is returned for the caller to log or raise. The callbacks after it got
    `on_run_end` with the run as it ended training. Strict mode's `CallbackError`
    propagates."""
    try:
        hooks.fire(Hook.RUN_END, ctx, run_result, arm_result)
    except CallbackError:
        raise
    except Exception as exc:
        if run_result.status != "failed":
            run_result.status, run_result.error = "failed", f"{type(exc).__name__}: {exc}"
            run_result.traceback = "".join(traceback.format_exception(exc))
        return exc
    return None


def _end_run(
    hooks: Dispatcher, ctx: LogContext, run_result: RunResult, arm_result: ArmResult
) -> None:
    """`end_run` in an experiment: what a critical callback raised is logged, and the
    other runs go on."""
    exc = end_run(hooks, ctx, run_result, arm_result)
    if exc is not None:
        log.error(
            "run %s: a critical callback raised in on_run_end (%s); the run is failed and the "
            "other runs go on",
            run_result.run_key,
            f"{type(exc).__name__}: {exc}",
        )


def run_in_worker(
    job: RunJob,
    callbacks: list[Callback],
    strict: bool | None,
    arm_result: ArmResult,
    *,
    progress: Callable[[Any], None],
) -> RunResult:
    """A run inside a worker process, on the worker's own copies of the callbacks.

    The run-level hooks fire here, then `close`, so every store the copies opened is flushed
    before the result goes back. `progress` sends `ctx.ids` to the parent once the run has
    started, so the parent can still record the run if this process dies. The model stays
    here: the result's `artifacts` is None. An interrupt is recorded in the result (the
    parent, which decides whether the experiment goes on, gets it as a failed run).
    """

    def started(ctx: LogContext) -> None:
        try:
            progress(dict(ctx.ids))
        except Exception:  # an id that won't pickle: send the plain ones
            plain = (str, int, float, bool, type(None))
            progress({k: v for k, v in ctx.ids.items() if isinstance(v, plain)})

    hooks = Dispatcher(callbacks, strict=strict)
    try:
        run_result, _interrupt = execute_run(job, hooks, arm_result, started=started)
    finally:
        hooks.run_key = None
        hooks.fire(Hook.CLOSE)
    run_result.artifacts = None
    return run_result


def _benchmark(
    benchmarks: Sequence[Benchmark], hooks: Dispatcher, ctx: LogContext, artifacts: LoopArtifacts
) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for bench in benchmarks:
        started = time.perf_counter()
        try:
            res = bench.run(artifacts.model, None)
        except Exception as exc:
            log.exception("benchmark %r failed; the run goes on", bench.name)
            res = EvalResult(
                bench.name,
                {},
                error=f"{type(exc).__name__}: {exc}",
                seconds=time.perf_counter() - started,
            )  # how long until it raised
        evaluated_after(hooks, ctx, res)
        metrics.update({f"{res.name}/{k}": v for k, v in res.metrics.items()})
    return metrics


def evaluated_after(hooks: Dispatcher, ctx: LogContext, result: EvalResult) -> None:
    """Fire `on_benchmark_eval` for an evaluation after training (step None): a benchmark's,
    or one a framework ran after its fit (`lab.integrations.FrameworkRun.evaluate_after`)."""
    hooks.fire(Hook.BENCHMARK_EVAL, ctx, result, result.predictions, step=None)


def _final_checkpoint(run_dir: Path) -> Path:
    """The checkpoint a chain's next stage starts from: the parent run's newest one."""
    from lab.manifest import Manifest  # (the checkpoints' rows; the loop is above this module)

    root = run_dir / "checkpoints"
    latest = Manifest(root).newest() if root.is_dir() else None
    if latest is None:
        raise CheckpointError(
            f"the next stage starts from {run_dir.name}'s final checkpoint, but it saved none; "
            "give its TrainingLoop checkpoint=CheckpointConfig(save_at_end=True)"
        )
    return latest


def _failures(hooks: Dispatcher, run_key: str | None) -> list[dict[str, Any]]:
    """The callback failures of one run (or, with None, of the experiment outside runs)."""
    return [f.to_dict() for f in hooks.failures if f.run_key == run_key]


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    """Call `fn` while another error propagates: a critical callback that fails here (a
    store that is down, say) is logged, and must not replace the error that got us here."""
    try:
        fn(*args)
    except Exception:
        log.exception("while recording the end of an interrupted experiment")


def _move_orphan(folder: Path) -> None:
    """Move aside the folder of a run the store does not know (deleted with ``lab rm``,
    renamed away with ``lab mv``, or recorded in another store), so the run now claimed
    cannot resume from checkpoints of something else."""
    if not folder.exists():
        return
    target = superseded_folder(folder, next_superseded_number(folder.name, [], [folder]))
    folder.rename(target)
    log.warning(
        "run folder %s is not recorded in this store; moved it to %s so the run starts afresh",
        folder,
        target.name,
    )


def _clear_run(ctx: LogContext) -> None:
    ctx.run_key = ctx.run_config = ctx.repeat = ctx.seed = ctx.parent_run_key = None
    ctx.config_hash = None
    ctx.group_name = ctx.arm = None
    ctx.stage = 0


def _final_metrics(out: Any) -> dict[str, float]:
    if out is None:
        return {}
    if isinstance(out, LoopArtifacts):
        return dict(out.metrics)
    if isinstance(out, dict):
        return {str(k): float(v) for k, v in out.items()}
    raise TypeError(
        f"train returned {type(out).__name__}; return loop.fit(run), a dict of final metrics, "
        "or None"
    )


def run_callbacks(factories: Sequence[CallbackFactory], run: RunSpec) -> list[Callback]:
    """The callbacks `factories` build for `run`, in order: each factory returns one
    `Callback` or a list of them. Anything else is a `ConfigError` that names the factory."""
    built: list[Callback] = []
    for factory in factories:
        out = factory(run)
        items = list(out) if isinstance(out, (list, tuple)) else [out]
        for cb in items:
            if not isinstance(cb, Callback):
                name = getattr(factory, "__qualname__", None) or repr(factory)
                raise ConfigError(
                    f"callback factory {name} returned {cb!r} for run {run.run_key}; a factory "
                    "returns a lab.Callback or a list of them"
                )
            built.append(cb)
    return built


# -- the experiment and its groups ------------------------------------------------------------
@contextlib.contextmanager
def experiment_scope(
    hooks: Dispatcher,
    ctx: LogContext,
    result: ExperimentResult,
    *,
    interrupted: Callable[[BaseException], str | None] = lambda exc: (
        f"{type(exc).__name__}: {exc}".rstrip(": ")
    ),
) -> Iterator[None]:
    """The experiment from `on_experiment_start` to `on_experiment_end` and `close`, around
    its runs (the body of the `with`).

    Strict mode's `CallbackError` propagates as it is. Anything else the body raises (an
    interrupt) ends the experiment's record first, with ``result.error`` set to what
    `interrupted` makes of it (None leaves it as it is), then propagates. `close` always
    fires; what it raises while another error propagates is logged, never in its place.
    """
    started = time.perf_counter()
    unwind_on_sigterm()  # a SIGTERM is recorded like a Ctrl-C, not a silent death
    try:
        hooks.fire(Hook.EXPERIMENT_START, ctx)
        try:
            yield
        except CallbackError:
            raise  # strict mode: a callback bug propagates as it is
        except BaseException as exc:  # an interrupt: close the record, then propagate
            error = interrupted(exc)
            if error is not None:
                result.error = error
            _quietly(end_experiment, hooks, ctx, result, started)
            raise
        end_experiment(hooks, ctx, result, started)
    except BaseException:
        close_quietly(hooks)  # the error in flight is the one to report
        raise
    close(hooks)


def start_group(hooks: Dispatcher, ctx: LogContext, group_name: str) -> None:
    """Fire `on_group_start` for the group `ctx` points at, before its first run."""
    hooks.fire(Hook.GROUP_START, ctx, group_name)


def start_experiment(hooks: Dispatcher, ctx: LogContext) -> None:
    """Fire `on_experiment_start`, once, before any group."""
    hooks.fire(Hook.EXPERIMENT_START, ctx)


def end_experiment(
    hooks: Dispatcher, ctx: LogContext, result: ExperimentResult, started: float
) -> None:
    """Fire `on_experiment_end` with the result, its time and the callback failures outside
    runs (read again after the hook, which may add some)."""
    result.seconds = time.perf_counter() - started
    result.callback_errors = _failures(hooks, None)
    hooks.fire(Hook.EXPERIMENT_END, ctx, result)
    result.callback_errors = _failures(hooks, None)


def open_run(hooks: Dispatcher, ctx: LogContext, run_key: str) -> None:
    """Fire `on_run_start` for the run `ctx` points at; its failures are the run's."""
    hooks.run_key = run_key
    hooks.fire(Hook.RUN_START, ctx)


def fail_run(hooks: Dispatcher, ctx: LogContext, exc: BaseException) -> None:
    """Fire `on_error` for the run that raised `exc` (isolated even for critical callbacks,
    so it never hides that error)."""
    hooks.fire(Hook.ERROR, ctx, exc)


def close(hooks: Dispatcher) -> None:
    """Fire `close`: the callbacks release what they hold."""
    hooks.fire(Hook.CLOSE)


def close_quietly(hooks: Dispatcher) -> None:
    """Fire `close` while another error propagates: what a callback raises there is logged,
    never in place of that error."""
    try:
        hooks.fire(Hook.CLOSE)
    except Exception:
        log.exception("a callback raised in close while another error propagates")


def record_lost(
    hooks: Dispatcher,
    outcome: Outcome,
    job: RunJob,
    arm_result: ArmResult,
    interrupted: bool = False,
) -> RunResult:
    """Record, in this process, a run whose worker ended without a result.

    The worker sent `ctx.ids` once `on_run_start` had fired there (the run's record
    exists then); without them, `on_run_start` fires here first. Then `on_error` and
    `on_run_end` fire here, so the run is recorded with how its worker ended: `crashed`
    when the worker process died, `failed` otherwise.
    """
    ctx = job.ctx
    status, error, exc = _lost(outcome, interrupted)
    hooks.run_key = job.run_key
    try:
        if outcome.progress is None:
            try:
                hooks.fire(Hook.RUN_START, ctx)
            except CallbackError:
                raise
            except Exception:  # a critical callback: the run is failed already
                log.exception("run %s: on_run_start raised while recording it", job.run_key)
        else:
            ctx.ids.update(outcome.progress)
        hooks.fire(Hook.ERROR, ctx, exc)
        run_result = job.result(
            hooks, status=status, metrics={}, seconds=outcome.seconds, error=error,
            traceback=outcome.traceback,
        )  # fmt: skip
        log.error("run %s of %s %s; the other runs go on: %s", job.run_key, job.experiment,
                  status, error)  # fmt: skip
        arm_result.runs.append(run_result)
        _end_run(hooks, ctx, run_result, arm_result)
        run_result.callback_errors = _failures(hooks, job.run_key)
    finally:
        hooks.run_key = None
    return run_result


def run_ended_elsewhere(
    watchers: Dispatcher, job: RunJob, run_result: RunResult, arm: Callable[[], ArmResult]
) -> None:
    """Fire `on_run_end` in the experiment's process for a run that ended in a worker, on
    the callbacks that ask for it (`Callback.run_end_in_parent`: a display that counts the
    runs done); `arm()` makes the arm's result only when one listens."""
    if watchers.listens(Hook.RUN_END):
        watchers.run_key = job.run_key
        watchers.fire(Hook.RUN_END, job.ctx, run_result, arm())
        watchers.run_key = None


def _lost(outcome: Outcome, interrupted: bool) -> tuple[RunStatus, str, BaseException]:
    """How a run whose worker sent no result ended: its status, error text and exception."""
    status: RunStatus = "failed"
    if outcome.died is not None:
        status = "crashed"
        error = f"worker process died ({outcome.died}, pid {outcome.pid}) before the run ended"
        exc: BaseException = WorkerDied(error)
    elif outcome.unloadable is not None:
        error = (
            f"the worker process could not load the run ({outcome.unloadable}); define "
            "train, callbacks and config classes in an importable module"
        )
        exc = WorkerDied(error)
    else:
        exc = outcome.error or WorkerDied("the worker process failed")
        error = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, Exception):  # interrupted before its training started
            error = f"interrupted ({type(exc).__name__})"
    if interrupted and not error.startswith("interrupted"):
        error = f"interrupted; {error}"
    return status, error, exc
