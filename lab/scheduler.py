"""The scheduler: which run starts next, for every executor of an experiment.

An experiment's runs form chains: each repeat of an arm is a chain of one run, each repeat
of an arm with stages a chain of its stages (a stage starts from the checkpoint of the stage
before it, so only once that one completed). `Scheduler` starts the chains' runs in the
lifecycle's order, as many at once as its `Runner` has room for, and records each as it
ends. Two runners: `InProcess` (``executor="serial"``: one run at a time, in this process,
on the experiment's own callbacks) and `InWorkers` (``executor="processes"`` or ``"ray"``:
each run in a worker of a `lab.executors.Pool`, on copies of the callbacks). With one run at
a time, the first chain first, the order is the lifecycle's: an arm's repeats one after
another, a chain's stages one after another.

The plan grows as runs end: after each run is recorded the scheduler asks the plan for more
chains (`Plan.more`: a race's next round, the next sampled arms) and starts them as soon as
the runner has room, so a pool keeps its workers busy and the serial runner runs them next.

The hooks fire in `lab.lifecycle` (`start_group`, `execute_run`, `record_lost`,
`run_ended_elsewhere`); what a run is, and whether it finished before, the `Plan` says (an
`Experiment`).
"""

from __future__ import annotations

import dataclasses
import heapq
import os
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lab._secrets import logger
from lab._signals import unwind_on_sigterm
from lab.dispatch import Dispatcher
from lab.errors import CallbackError, ConfigError
from lab.executors import Outcome, Pool
from lab.hooks import RUNS, Callback, LogContext
from lab.lifecycle import RunJob, execute_run, record_lost, run_ended_elsewhere, start_group
from lab.records import FAILED, ArmResult, ExperimentResult, RunResult

log = logger("lab.experiment")  # the scheduler's messages are its experiment's

#: A run's place in the experiment's result: (arm index, repeat, stage).
Key = tuple[int, int, int]


@dataclass
class Chain:
    """The runs of one repeat of an arm, one stage after another: `stages` is None for an arm
    without stages (a chain of one run). `stage` is the next run's, `parent` the run it
    starts from."""

    index: int  # the arm's place in the experiment
    repeat: int
    stages: int | None
    stage: int = 0
    parent: RunResult | None = None

    def key(self) -> Key:
        """The next run's place in the result."""
        return (self.index, self.repeat, self.stage)


class Plan(Protocol):
    """What the scheduler asks of an experiment about its runs."""

    name: str
    max_retries: int

    def chains(self) -> list[Chain]:
        """Every chain of the experiment, in the lifecycle's order."""

    def group(self, ctx: LogContext, chain: Chain) -> str:
        """Point `ctx` at the chain's group and return its name."""

    def job(self, ctx: LogContext, chain: Chain) -> RunJob | RunResult:
        """Point `ctx` at the chain's next run and describe it; or its recorded result, when
        it finished before."""

    def more(self, ctx: LogContext, run: RunResult) -> list[Chain]:
        """The chains to run now that `run` ended and is recorded (reused from an earlier
        attempt, too), after every chain given so far; [] when none. Not asked for a run
        that an interrupt ended, which decides nothing."""

    def release(self, run_key: str, error: str | None) -> None:
        """Close the claim on a run whose record never started."""

    def retry(self, run_key: str) -> None:
        """The run's worker died and it is started again: claim it anew."""


class Runner(Protocol):
    """Where the scheduler's runs execute: `InProcess` or `InWorkers`."""

    #: Whether a run's own hooks fire elsewhere (a worker), so this process hears of its end
    #: only from its result.
    elsewhere: bool

    @property
    def free(self) -> int:
        """How many more runs can start now."""

    @property
    def running(self) -> int:
        """How many runs have started and not yet been collected."""

    def start(self, key: Key, job: RunJob, arm: ArmResult) -> None:
        """Start `job`; its `Outcome` carries `key`."""

    def wait(self) -> list[Outcome]:
        """The outcomes of the runs that ended (blocking until one did)."""

    def stop(self) -> list[Outcome]:
        """Interrupt every running run and return their outcomes."""


class InProcess:
    """Runs in this process, one at a time, on the experiment's own dispatcher: the run's
    result is its `Outcome`, and an interrupt that ended it its `interrupt`."""

    elsewhere = False

    def __init__(self, hooks: Dispatcher) -> None:
        self.hooks = hooks
        self._ended: list[Outcome] = []

    @property
    def free(self) -> int:
        """One, when the last run was collected."""
        return 0 if self._ended else 1

    @property
    def running(self) -> int:
        """The run that ended and was not collected yet."""
        return len(self._ended)

    def start(self, key: Key, job: RunJob, arm: ArmResult) -> None:
        """Execute the run now; strict mode's `CallbackError` propagates from here."""
        run_result, interrupt = execute_run(job, self.hooks, arm)
        self._ended.append(Outcome(key, os.getpid(), run_result, interrupt=interrupt))

    def wait(self) -> list[Outcome]:
        """The run that ended in `start`."""
        ended, self._ended = self._ended, []
        return ended

    def stop(self) -> list[Outcome]:
        """Nothing runs once `start` returned: what ended and was not collected."""
        return self.wait()


class InWorkers:
    """Runs in the workers of `pool` (a `ProcessPool` or a `RayPool`), each on pickled
    copies of `callbacks` and of the run's context, through `worker` (`run_in_worker`)."""

    elsewhere = True

    def __init__(
        self,
        pool: Pool,
        worker: Callable[..., RunResult],
        callbacks: list[Callback],
        strict: bool | None,
        executor: str,
    ) -> None:
        self.pool, self.worker, self.callbacks = pool, worker, callbacks
        self.strict, self.executor = strict, executor

    @property
    def free(self) -> int:
        """How many more runs the pool can start now."""
        return self.pool.free

    @property
    def running(self) -> int:
        """How many runs the pool is running."""
        return self.pool.running

    def start(self, key: Key, job: RunJob, arm: ArmResult) -> None:
        """Submit the run; what cannot be sent to a worker is a `ConfigError`."""
        # a copy: this process's ctx moves on to the next run before this one ends
        job.ctx = dataclasses.replace(job.ctx, ids=dict(job.ctx.ids), extras=dict(job.ctx.extras))
        try:
            self.pool.submit(key, self.worker, job, self.callbacks, self.strict, arm,
                             resources=job.resources)  # fmt: skip
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            fix = "keep ctx.ids and ctx.extras to plain values"
            raise unsendable(self.executor, f"run {job.run_key}", exc, fix) from None

    def wait(self) -> list[Outcome]:
        """What the pool's workers answered."""
        return self.pool.wait()

    def stop(self) -> list[Outcome]:
        """Interrupt the workers; what they answered."""
        return self.pool.stop()


def unsendable(executor: str, what: str, exc: BaseException, fix: str) -> ConfigError:
    """The one line that says `what` cannot be sent to a worker process, why, and `fix`."""
    reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return ConfigError(
        f"executor={executor!r} cannot send {what} to a worker process ({reason}); {fix}"
    )


class Scheduler:
    """Every run of `plan`'s chains through `runner`, recorded into `result`.

    A group's `on_group_start` fires as its first run is about to start. Runs start in the
    lifecycle's order, and `result` lists them in it too, whatever order they end in. A
    failed stage stops its chain; the other chains go on. If this process is interrupted
    (Ctrl-C, SIGTERM, an exception), nothing more starts, the running runs are interrupted
    and recorded, and it propagates. A run whose worker died is recorded `crashed`; with
    `max_retries` left it is claimed again and started again (it resumes from its newest
    checkpoint). Strict mode's `CallbackError` propagates once the runs that ended with it
    are recorded.
    """

    def __init__(
        self,
        plan: Plan,
        runner: Runner,
        hooks: Dispatcher,
        ctx: LogContext,
        result: ExperimentResult,
    ) -> None:
        self.plan, self.runner, self.hooks, self.ctx, self.result = plan, runner, hooks, ctx, result
        self.chains = plan.chains()
        self.ready = list(range(len(self.chains)))  # a heap of chain numbers: the first first
        self.groups: set[str] = set()
        self.jobs: dict[Key, tuple[int, RunJob]] = {}  # started, not yet collected
        self.done: dict[Key, RunResult] = {}
        self.retries: dict[str, int] = {}  # run key -> times it was started again
        # what shows progress in this process hears of each run as its result arrives
        self.watchers = hooks.sibling(cb for cb in hooks.callbacks if cb.run_end_in_parent)

    def run(self) -> None:
        """Start runs while the runner has room, collect them as they end, until none is
        left; `result` gets every run that ended, even when this raises."""
        runner = self.runner
        unwind_on_sigterm()  # SIGTERM stops the workers as Ctrl-C does
        try:
            while self.ready or runner.running:
                while self.ready and runner.free:
                    self._start(heapq.heappop(self.ready))
                ended = runner.wait()
                for outcome in ended:
                    if not isinstance(outcome.error, CallbackError):
                        self._collect(outcome)
                for outcome in ended:  # strict mode, in a worker: propagates from here
                    if isinstance(outcome.error, CallbackError):
                        raise outcome.error
                    if outcome.interrupt is not None:  # recorded: now it propagates
                        raise outcome.interrupt
        except BaseException:
            for outcome in runner.stop():
                if not isinstance(outcome.error, CallbackError):
                    self._collect(outcome, interrupted=True)
            raise
        finally:
            for key in sorted(self.done):
                self.result.arms[key[0]].runs.append(self.done[key])

    def _arm(self, index: int) -> ArmResult:
        """The arm's runs that have ended, for `on_run_end`'s `arm`."""
        arm = self.result.arms[index]
        runs = [self.done[key] for key in sorted(self.done) if key[0] == index]
        return dataclasses.replace(arm, runs=runs)

    def _start(self, number: int) -> None:
        """Start the chain's next run (or record it as it was: it finished before)."""
        chain = self.chains[number]
        group = self.plan.group(self.ctx, chain)
        if group not in self.groups:  # fired as the group's first run is about to start
            self.groups.add(group)
            start_group(self.hooks, self.ctx, group)
        job = self.plan.job(self.ctx, chain)
        if isinstance(job, RunResult):
            self._finished(number, job)
            return
        self.jobs[chain.key()] = (number, job)
        self.runner.start(chain.key(), job, self._arm(chain.index))

    def _finished(self, number: int, run: RunResult, grow: bool = True) -> None:
        """Record the chain's run; queue its next stage, unless it failed; then, with `grow`,
        the chains the plan adds now."""
        chain = self.chains[number]
        self.done[(chain.index, chain.repeat, run.stage)] = run
        if chain.stages is not None:
            if run.status in FAILED:
                log.error("%s: %s failed; its chain stops", self.plan.name, run.run_key)
            elif run.stage + 1 < chain.stages:
                chain.stage, chain.parent = run.stage + 1, run
                heapq.heappush(self.ready, number)
        if grow:
            for added in self.plan.more(self.ctx, run):
                self.chains.append(added)
                heapq.heappush(self.ready, len(self.chains) - 1)

    def _collect(self, outcome: Outcome, interrupted: bool = False) -> None:
        """Record how a started run ended: its result, or, for a run whose worker sent none,
        what `record_lost` makes of it (or a retry)."""
        number, job = self.jobs.pop(outcome.key)
        index = self.chains[number].index
        if outcome.died is not None and not interrupted and self._retried(number, outcome, job):
            return
        grow = not interrupted and outcome.interrupt is None  # an interrupt decides nothing
        if outcome.ok:
            self._finished(number, outcome.value, grow)
            if self.runner.elsewhere:
                # the display counts against the runs planned now, which the plan may change
                job.ctx.extras[RUNS] = self.ctx.extras.get(RUNS)
                run_ended_elsewhere(self.watchers, job, outcome.value, lambda: self._arm(index))
        elif not (interrupted and outcome.progress is None):  # else: it never started
            lost = record_lost(self.hooks, outcome, job, self._arm(index), interrupted)
            self._finished(number, lost, grow)
        error = outcome.value.error if outcome.ok else "interrupted before it started"
        self.plan.release(job.run_key, error)

    def _retried(self, number: int, outcome: Outcome, job: RunJob) -> bool:
        """Start a run whose worker died again, when retries are left: recorded `crashed`,
        then claimed again."""
        tries = self.retries.get(job.run_key, 0)
        if tries >= self.plan.max_retries:
            return False
        record_lost(self.hooks, outcome, job, self._arm(self.chains[number].index))
        self.retries[job.run_key] = tries + 1
        log.warning("%s: run %s crashed; starting it again (retry %d of %d)",
                    self.plan.name, job.run_key, tries + 1, self.plan.max_retries)  # fmt: skip
        self.plan.retry(job.run_key)
        heapq.heappush(self.ready, number)
        return True


def check_sendable(
    executor: str,
    train: Callable[..., Any],
    callbacks: Sequence[Callback],
    factories: Sequence[Callable[..., Any]],
    benchmarks: Sequence[Any],
    configs: Mapping[str, Sequence[Any]],
) -> None:
    """Fail now, in one line, if a worker process could not get what a run needs: `train`,
    the shared `callbacks`, the callback `factories`, the `benchmarks` and each arm's
    `configs` (pickled as `executor` sends them)."""
    lambdas = "(a lambda or local function cannot cross to a worker process)"
    items: list[tuple[str, Any, str]] = [
        ("train", train, f"define train at module top level {lambdas}"),
        *[
            (f"callback {type(cb).__name__}", cb, "define its class at module top level and "
             "keep no open file, lock or connection in it")
            for cb in callbacks
        ],
        *[
            (f"callback factory {getattr(f, '__qualname__', f)!r}", f,
             f"define the factory at module top level {lambdas}")
            for f in factories
        ],
        *[
            (f"benchmark {b.name!r}", b, f"give it a function defined at module top level "
             f"{lambdas}")
            for b in benchmarks
        ],
        *[
            (f"the config of arm {name!r}", cfgs[0], "define its class at module top level")
            for name, cfgs in configs.items()
        ],
    ]  # fmt: skip
    dumps: Callable[[Any], Any] = pickle.dumps
    # a notebook, a REPL; Ray's cloudpickle sends what they define by value
    interactive = not hasattr(sys.modules["__main__"], "__file__")
    if executor == "ray":
        from ray import cloudpickle

        dumps, interactive = cloudpickle.dumps, False
    for what, obj, fix in items:
        try:
            dumps(obj)
            if interactive and getattr(obj, "__module__", None) == "__main__":
                raise TypeError("it is defined in an interactive session, which a worker "
                                "process cannot import")  # fmt: skip
        except Exception as exc:
            raise unsendable(executor, what, exc, fix) from None
