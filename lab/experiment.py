"""Experiments: what a user declares (`Experiment`, `Arm`) and how its runs are planned.

`Experiment.run()` walks the lifecycle written out in `lab.hooks`: one group per arm (its
repeats), one run per repeat, every hook through one `Dispatcher`, the runs started by
`lab.scheduler.Scheduler` (the experiment is its `Plan`). Every run, in this process
or in a worker (``executor="processes"``, see `lab.executors`), goes through
`lab.lifecycle.execute_run`; what runs return (`RunResult`, `ArmResult`, `ExperimentResult` and
its `Summary`) are records of `lab.records`, importable from here too.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pydantic

import lab._sweep_arms as sweep_arms
from lab._distributed import agreed, broadcast, for_rank, init_from_launcher, launcher_rank
from lab._imports import require
from lab._names import MAX_NAME, check_name, check_tags, safe_name
from lab._race_rounds import RaceRounds, race_args
from lab._rank_processes import run_on_ranks
from lab._ranking import SUMMARY_KEY, Declaration, check_bounds_map, check_mode
from lab._reuse import (
    Fingerprint,
    busy_message,
    differences,
    refusal,
    supersede_runs,
    train_name,
)
from lab._secrets import logger
from lab._sweep_arms import record_trials, start_sweep, sweep_args, sweep_more, unasked
from lab.dispatch import Dispatcher
from lab.errors import ConfigError, RunBusy
from lab.executors import (
    Pool,
    ProcessPool,
    RayPool,
    check_resources,
    check_shared_store,
)
from lab.hooks import (
    EXECUTOR,
    FINISHED_BEFORE,
    NOTES,
    RUNS,
    TAGS,
    Callback,
    LogContext,
)
from lab.lifecycle import (
    CallbackFactory,
    RunJob,
    RunScope,
    _clear_run,
    _move_orphan,
    execute_run,
    experiment_scope,
    run_in_worker,
)
from lab.loggers import store_sink
from lab.records import (
    FINISHED,
    ROUTINE_METRICS,
    ROUTINE_PREFIXES,
    ArmResult,
    ExperimentResult,
    RunResult,
    RunSpec,
    RunStatus,
    Summary,
    SummaryRow,
    TrainFn,
    is_routine,
)
from lab.scheduler import Chain, InProcess, InWorkers, Runner, Scheduler, check_sendable
from lab.sinks import RaceSink, StoreSink
from lab.store.urls import resolve_url
from lab.sweeps.pruning import Prune, pruning

if TYPE_CHECKING:  # the loop brings torch: a run imports it, declaring an experiment does not
    from lab.loop.evals import Evaluator
    from lab.sweeps.racing import Race
    from lab.sweeps.sweep import Sweep

__all__ = [  # the results are defined in lab.records, runs execute in lab.lifecycle
    "EXECUTORS",
    "FINISHED",
    "ROUTINE_METRICS",
    "ROUTINE_PREFIXES",
    "Arm",
    "ArmResult",
    "CallbackFactory",
    "Executor",
    "Experiment",
    "ExperimentResult",
    "RunJob",
    "RunResult",
    "RunScope",
    "RunSpec",
    "RunStatus",
    "Summary",
    "SummaryRow",
    "TrainFn",
    "execute_run",
    "is_routine",
    "run_in_worker",
    "safe_name",
]

log = logger("lab.experiment")


Executor = Literal["serial", "processes", "ray"]
EXECUTORS: tuple[str, ...] = ("serial", "processes", "ray")


class Arm:
    """A named variant of the base config: its overrides, validated before any run starts.

    Keys name fields of the base config; a dotted key reaches into a nested model:
    ``Arm("wide", **{"model.width": 256})``.

    `resources` (``num_cpus``, ``num_gpus``, ``memory``) is what each of its runs asks of
    Ray under ``executor="ray"``, over the experiment's `resources`, key by key:
    ``Arm("big", resources={"num_gpus": 1}, width=1024)``. The other executors ignore it.

    With `stages`, each repeat of the arm is a continual chain, a group of its own: stage k
    runs with the arm's overrides plus ``stages[k]``, and starts from stage k-1's final
    checkpoint, its weights only (``carry="weights"``) or its whole training state
    (``carry="full"``: optimizer, scheduler and grad scaler too; the step starts at 0, and
    callbacks start fresh, since a stage is a new run).

    Its runs' folders are named after it with `safe_name`:

    >>> Arm("wide", **{"model.width": 256}).overrides
    {'model.width': 256}
    >>> safe_name("lr=0.1")
    'lr-0.1-e14a64e4'
    """

    def __init__(
        self,
        name: str,
        /,
        *,
        stages: Sequence[dict[str, Any]] | None = None,
        carry: Literal["weights", "full"] = "weights",
        resources: dict[str, float] | None = None,
        **overrides: Any,
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"an arm needs a non-empty name, got {name!r}")
        check_name("arm", name, MAX_NAME)
        if stages is not None and (
            isinstance(stages, dict) or not stages or not all(isinstance(s, dict) for s in stages)
        ):
            raise ConfigError(
                f"arm {name!r}: stages must be a non-empty list of override dicts, one per "
                "stage, e.g. stages=[{'task': 'a'}, {'task': 'b'}]"
            )
        if carry not in ("weights", "full"):
            raise ConfigError(f"arm {name!r}: carry={carry!r}; use 'weights' or 'full'")
        self.name = name
        self.overrides = overrides
        self.stages = list(stages) if stages is not None else None
        self.carry = carry
        self.resources = check_resources(resources, f"arm {name!r}")

    def stage_configs(self, base: pydantic.BaseModel | None) -> list[pydantic.BaseModel | None]:
        """One validated config per stage (one in all for an arm without stages)."""
        if self.stages is None:
            return [self.apply(base)]
        return [self._stage(k, stage).apply(base) for k, stage in enumerate(self.stages)]

    def _stage(self, k: int, overrides: dict[str, Any]) -> Arm:
        """Stage k as an arm of its own, named for messages only (never stored, so its name
        may run past the limit of a stored one)."""
        stage = copy.copy(self)
        stage.name = f"{self.name} stage {k}"
        stage.overrides = {**self.overrides, **overrides}
        stage.stages = None
        return stage

    def __repr__(self) -> str:
        args = "".join(f", {k}={v!r}" for k, v in self.overrides.items())
        return f"Arm({self.name!r}{args})"

    def apply(self, base: pydantic.BaseModel | None) -> pydantic.BaseModel | None:
        """The base config with this arm's overrides, validated by the config's own model."""
        if base is None:
            if self.overrides:
                raise ConfigError(
                    f"arm {self.name!r} overrides {sorted(self.overrides)} but the experiment "
                    "has no base_config; pass base_config=YourConfig()"
                )
            return None
        data = base.model_dump()
        for key, value in self.overrides.items():
            _set_path(data, type(base), key, value, self.name)
        try:
            return type(base).model_validate(data)
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ConfigError(
                f"arm {self.name!r}: {where}={err.get('input')!r} is invalid: {err['msg']}; "
                "fix the override"
            ) from None


def _set_path(
    data: dict[str, Any], model: type[pydantic.BaseModel], key: str, value: Any, arm: str
) -> None:
    """Set the dotted `key` in `data`, checking each part against the config's models."""
    parts = key.split(".")
    for depth, part in enumerate(parts):
        fields = model.model_fields
        if part not in fields:
            where = f"{key!r}" if depth == 0 else f"{key!r}: {part!r}"
            raise ConfigError(
                f"arm {arm!r}: {where} is not a field of {model.__name__}; "
                f"valid fields: {', '.join(fields)}"
            )
        if depth == len(parts) - 1:
            data[part] = value
            return
        sub = fields[part].annotation
        if not (isinstance(sub, type) and issubclass(sub, pydantic.BaseModel)):
            raise ConfigError(
                f"arm {arm!r}: {part!r} of {model.__name__} is not a nested config, "
                f"so {key!r} cannot be set"
            )
        data, model = data[part], sub


class Experiment:
    """A named study: `train(run)` for every arm x repeat, recorded by the attached callbacks.

    Running an experiment again under the same name and store continues it: runs that
    finished (`completed`, `stopped` by a callback's ``request_stop``, or `pruned`) are skipped
    (their recorded results are part of the new result), and the others run again, resuming
    from their newest checkpoint when the loop has checkpoints.

    A recorded run stands for a planned one only when it would train the same thing: the
    same config, seed, stage and train function (see `lab._reuse`). When any differs, `run`
    refuses before anything trains, with a `ConfigError` that names the differences. Then
    use a new name, or ``fresh=True``: the experiment's current runs are superseded (kept
    under the key ``<run_key>~<n>``, their folders moved to ``<folder>.superseded-<n>``, left
    out of every reader) and every run trains afresh. Each run is claimed in the store
    before it starts, so two processes running the same experiment never train one run:
    the second raises `RunBusy` on a run the first is training.

    The store (argument, else ``LAB_STORE_URL``, else ``sqlite:///lab.db``) gets its
    logger (`lab.loggers.store_sink`: a `SqlLogger`) unless a callback that records into a
    store (a `lab.sinks.StoreSink`) is attached already; ``store=False`` records nothing.
    Each repeat ``i`` is seeded with ``seed + i``.

    ``executor="serial"`` (the default) runs one run after another in this process;
    ``executor="processes"`` runs up to `workers` of them at once (default: the CPU count,
    at most one per run), each in a fresh worker process that gets pickled copies of the
    callbacks and the context, so `train`, the callbacks and the configs' classes must be
    importable (defined at module top level). See `lab.executors` for what fires
    where; a run's `RunResult.artifacts` is None there.

    ``executor="ray"`` runs each run as a Ray task (``pip install 'lab[ray]'``): on the
    cluster this process joined already, else at `ray_address`, else at
    ``LAB_RAY_ADDRESS``, else on a local cluster that ``ray.init()`` starts. Each run asks
    for `resources` (default ``{"num_cpus": 1}``), overridden key by key by its arm's; Ray
    queues the runs until a node has room, or at most `workers` at once when it is given.
    The hooks fire where they do with ``executor="processes"``; a SQLite store is refused
    on a cluster of several nodes (use PostgreSQL or a ``lab serve`` URL). See docs/ray.md.

    With ``max_retries=N`` (``executor="processes"`` or ``"ray"``), a run whose worker
    process died (a SIGKILL, an OOM kill, a lost node) is recorded `crashed` and started
    again, up to N times, in a new worker; its loop resumes from its newest checkpoint, so
    it ends as an uninterrupted run would. A run that raised is not retried: it would raise
    again.

    `callbacks` holds callbacks that every run shares (they get every hook), and factories:
    callables that receive a run's `RunSpec` and return a callback or a list of them, built
    for that run alone and given its run hooks only (``on_run_start`` to ``on_run_end``,
    then ``close``), e.g. ``lambda run: ConsoleLogger(every=run.config.log_every)``; under
    ``executor="processes"`` a factory is called in the worker.

    With ``processes_per_run=N`` each run trains on N local processes, the ranks of one DDP
    group (gloo on CPU, NCCL on GPUs), started by the experiment itself: every rank runs
    `train(run)`, rank 0 records the run (see docs/ddp.md). The runs still go one at a time
    (``executor="serial"``) or `workers` at a time (``executor="processes"``). Under
    ``torchrun`` instead, every rank runs the experiment, and each run trains on all ranks.

    `metric` and `mode` name the metric that ranks the arms and whether lower (``"min"``)
    or higher (``"max"``) is better; `bounds` declares metrics' known ranges, e.g.
    ``{"holdout/acc": (0, 1)}``, to which their intervals are clipped. The store records
    them, so ``result.summary()``, the `ConsoleLogger`'s summary, `lab.inspect.summary`,
    ``lab show`` and the dashboard all rank by that metric and clip to those ranges (see
    docs/analysis.md); without `metric` they rank by ``val/loss``, else ``loss``.

    `tags` (plain strings, W&B style) and `notes` describe the experiment in the store: the
    tags join those it has (``lab tag`` adds more), the notes replace its notes. A run tags
    itself from `train` with ``run.tag(...)`` and ``run.notes = ...``. Every run records its
    provenance (git commit and diff, packages, versions, devices, command line; see
    `lab.provenance`).
    """

    #: The latest `run()`'s result; after an interrupt, what had finished by then.
    result: ExperimentResult | None = None
    _pool: Pool | None = None  # where the runs execute, when not in this process
    _sink: StoreSink | None = None  # the callback that claims each run in the store
    _only_repeat: int | None = None  # `lab.start_run`: the one repeat it records
    _rounds: RaceRounds | None = None  # the race's rounds, while one runs
    _recorded: set[str]  # arms whose elimination the store holds already (with a race)
    race: Race | None  # the race over the arms' repeats, if any
    sweep: Sweep | None  # where the arms are sampled from, if they are
    _sweep_arms: sweep_arms.SweepArms | None = None  # the sweep's trials, while it runs
    executor: Executor

    def __init__(
        self,
        name: str,
        train: TrainFn,
        *,
        arms: Sequence[Arm] | None = None,
        repeats: int | None = None,
        base_config: pydantic.BaseModel | None = None,
        callbacks: Sequence[Callback | CallbackFactory] = (),
        store: Any = None,
        output_dir: str | Path = "runs",
        seed: int = 0,
        benchmarks: Sequence[Evaluator] = (),
        strict: bool | None = None,
        executor: Executor = "serial",
        workers: int | None = None,
        tags: Sequence[str] = (),
        notes: str | None = None,
        fresh: bool = False,
        processes_per_run: int = 1,
        resources: dict[str, float] | None = None,
        ray_address: str | None = None,
        max_retries: int = 0,
        metric: str | None = None,
        mode: Literal["min", "max"] | None = None,
        bounds: dict[str, tuple[float, float]] | None = None,
        race: Race | None = None,
        prune: Prune | None = None,
        sweep: Sweep | None = None,
    ) -> None:
        repeats, metric, mode = race_args(race, arms, repeats, metric, mode)
        metric, mode = sweep_args(sweep, arms, metric, mode)
        _check_args(name, train, repeats, executor, max_retries, workers, base_config)
        arms = _checked_arms(arms, repeats) if sweep is None else []  # sampled as it runs
        self.name, self.train, self.arms, self.repeats = name, train, arms, repeats
        # the search (docs/sweeps.md); then one config per stage of each arm, validated now
        self.base_config, self.race, self.prune, self.sweep = base_config, race, prune, sweep
        self.stage_configs = {arm.name: arm.stage_configs(base_config) for arm in arms}
        self.configs = {name: cfgs[0] for name, cfgs in self.stage_configs.items()}
        #: Callbacks every run shares, and factories of each run's own (a `Prune`'s among them).
        self.callbacks, self.run_callbacks = _split_callbacks([*callbacks, *pruning(prune, store)])
        # An unknown scheme fails here, before any run; the store opens in run().
        self.store = resolve_url(store) if store is None or isinstance(store, str) else store
        self.output_dir, self.seed, self.strict = Path(output_dir), seed, strict
        self.benchmarks, self.executor = list(benchmarks), executor
        self.n_runs = repeats * sum(_stage_count(a) for a in arms)  # all runs (a race: fewer)
        at_once = _at_once(self.n_runs, len(arms), repeats, race, sweep)
        self.workers = _workers(executor, workers, at_once)
        #: What each run asks of Ray (``executor="ray"``), before its arm's own `resources`.
        self.resources = check_resources(resources, "Experiment")
        self.ray_address, self.max_retries = ray_address, max_retries
        self.tags = check_tags(tags)  # added to the experiment's tags in the store
        _check_later(notes, processes_per_run, metric)
        self.notes, self.fresh = notes, bool(fresh)
        self.processes_per_run = processes_per_run  # DDP ranks per run (1: its own process)
        #: What every door ranks by and clips to (recorded in its config, see `lab._ranking`).
        self.declared = Declaration(metric, check_mode(mode) if mode is not None else None,
                                    check_bounds_map(bounds))  # fmt: skip
        self._prior: dict[str, dict[str, Any]] = {}  # earlier runs of this name, by run key

    # ------------------------------------------------------------------------------------
    def run(self) -> ExperimentResult:
        """Run every arm x repeat and return their results; failed runs don't stop the rest.

        The store is opened before any hook fires, so an unreachable server or a schema
        from a newer `lab` stops the experiment at once, with one line that says what to do.
        An interrupt (Ctrl-C) records the run it hit as failed and the experiment as failed,
        then propagates. With ``executor="processes"``, what cannot be sent to a worker
        process fails here first, as a `ConfigError`, before anything runs.

        Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank runs the experiment, and each run
        trains on every rank (DDP: the process group is made here, unless `train` finds one
        already): the hooks fire on each rank, and rank 0 alone records (callbacks that
        declare `rank_zero_only`, the store's among them, are left out elsewhere), so the
        experiment, group and run rows are written once. Rank 0 decides which runs to skip
        (finished before), and its failure to open the store or claim a run is every rank's.
        """
        ranks = launcher_rank()
        if ranks is not None:
            if self.executor != "serial" or self.processes_per_run > 1:
                raise ConfigError(
                    f"executor={self.executor!r}, processes_per_run={self.processes_per_run} "
                    "under torchrun: the ranks torchrun started are each run's processes; "
                    "use executor='serial' and processes_per_run=1, or drop torchrun"
                )
            _check_launcher_env()
            init_from_launcher()
        hooks, ctx, result = agreed(self._open)
        if self._pool is None:
            runner: Runner = InProcess(hooks)
        else:
            runner = InWorkers(self._pool, self._worker(), list(hooks.callbacks), self.strict,
                               self.executor)  # fmt: skip
        with experiment_scope(hooks, ctx, result):
            try:
                Scheduler(self, runner, hooks, ctx, result).run()
            finally:
                _clear_run(ctx)
        return result

    def _open(self) -> tuple[Dispatcher, LogContext, ExperimentResult]:
        """Everything before the first hook: the callbacks, the store opened (runs whose
        process died marked `crashed`), earlier runs superseded with `fresh`, the reuse
        check, and the dispatcher, context and result the hooks share."""
        callbacks = self._callbacks()
        self._pool = None
        if self.executor != "serial" or self.processes_per_run > 1:
            check_sendable(self.executor, self.train, callbacks, self.run_callbacks,
                           self.benchmarks, self.stage_configs)  # fmt: skip
        if self.executor == "ray":  # joined now: a bad address fails before any hook
            self._pool = RayPool(self.workers, self.ray_address)
        elif self.executor == "processes":
            self._pool = ProcessPool(self.workers or 1)
        elif self.processes_per_run > 1:  # each run's ranks start in a worker, one at a time
            self._pool = ProcessPool(1)
        self._prior, self._sink = {}, None
        folder = self.output_dir / safe_name(self.name)
        for cb in callbacks:
            if isinstance(cb, StoreSink):  # opening marks runs whose process died `crashed`
                self._sink = cb
                store = cb.open()
                if isinstance(self._pool, RayPool):
                    check_shared_store(getattr(store, "url", None), self._pool.nodes)
                store.mark_crashed()  # the store may have been open a while
                if self.fresh:
                    supersede_runs(store, self.name, folder, [key for key, *_ in self._plan()])
                self._prior = store.previous_runs(self.name)
                break
        if self._sink is None and self.fresh and _rank_zero():  # only the folders move aside
            supersede_runs(None, self.name, folder, [key for key, *_ in self._plan()])
        self._sweep_arms = start_sweep(self, Arm)  # the arms a sweep asked before, and asks first
        self._check_reuse()
        hooks = Dispatcher(callbacks, strict=self.strict)
        ctx = LogContext(experiment=self.name, output_dir=folder,
                         config=self._experiment_config())  # fmt: skip
        return hooks, ctx, self._start_result(ctx)

    def _start_result(self, ctx: LogContext) -> ExperimentResult:
        """The result the runs will fill (the race's too, with a race), and what a progress
        display needs in `ctx` to count runs, including those it never sees end: runs
        finished by an earlier attempt are skipped without hooks, and under
        executor="processes" on_run_end fires in the workers."""
        self._rounds, self._recorded = None, set()
        if self.race is not None:
            self._rounds = RaceRounds(self.race, [arm.name for arm in self.arms])
            if self._prior and isinstance(self._sink, RaceSink):  # (no runs: none dropped)
                self._recorded = self._sink.eliminated(self.name)
        planned = {key for key, *_ in self._plan()}
        finished = sum(
            1 for key, r in self._prior.items() if r["status"] in FINISHED and key in planned
        )
        ctx.extras.update({FINISHED_BEFORE: finished, EXECUTOR: self.executor,
                           TAGS: list(self.tags), NOTES: self.notes})  # fmt: skip
        result = ExperimentResult(
            self.name,
            [ArmResult(a.name, a.overrides) for a in self.arms],
            declared=self.declared,
            race=self._rounds.result if self._rounds is not None else None,
        )
        self.result = result  # the caller can read it even when run() raises (an interrupt)
        self._replan(ctx)
        ctx.extras[FINISHED_BEFORE] = min(finished, self.n_runs)
        return result

    def _replan(self, ctx: LogContext) -> None:
        """Count the runs planned now, in the result (each arm's and in all) and for the
        progress displays (``ctx.extras[RUNS]``): a race plans fewer as it drops arms."""
        assert self.result is not None
        for arm, arm_result in zip(self.arms, self.result.arms, strict=True):
            arm_result.planned = self._planned(arm)
        if self._rounds is not None:
            self.n_runs = self._rounds.total([arm.name for arm in self.arms])
        elif self._only_repeat is None:  # (a script's run plans its one run)
            self.n_runs = sum(self._planned(arm) for arm in self.arms) + unasked(self._sweep_arms)
        self.result.planned = ctx.extras[RUNS] = self.n_runs

    def chains(self) -> list[Chain]:
        """Every chain of runs, in the lifecycle's order: each repeat of each arm (its stages,
        for an arm with stages); with a race, its first round."""
        if self._rounds is not None:
            return self._round_chains()
        return [
            Chain(index, repeat, _stages(arm))
            for index, arm in enumerate(self.arms)
            for repeat in self._repeats()
        ]

    def group(self, ctx: LogContext, chain: Chain) -> str:
        """Point `ctx` at the group of the chain's runs: its arm's repeats, or the chain
        itself; return its name."""
        arm = self.arms[chain.index]
        if arm.stages is None:
            ctx.group_name, ctx.group_kind = arm.name, "repeats"
        else:
            ctx.group_name, ctx.group_kind = f"{arm.name}-r{chain.repeat}", "chain"
        ctx.arm = arm.name
        record_trials(self._sweep_arms, ctx, self._sink)  # those asked before the first group
        return ctx.group_name

    def job(self, ctx: LogContext, chain: Chain) -> RunJob | RunResult:
        """The chain's next run (`_job`), decided by rank 0 under torchrun: a run it skips
        (finished before) is skipped on every rank."""
        arm = self.arms[chain.index]
        job = agreed(lambda: self._job(ctx, arm, chain.repeat, chain.stage, chain.parent))
        if launcher_rank() is not None:  # rank 0 claimed the run: skip it everywhere, or none
            skipped = broadcast(job if isinstance(job, RunResult) else None)
            job = skipped if skipped is not None else job
        return job

    def more(self, ctx: LogContext, run: RunResult) -> list[Chain]:
        """What runs now that `run` ended: with a race, once `run` closed its round, the
        arms it drops are recorded and the survivors' next round is due; with a sweep, the
        trials of the arms done are told and the next arms asked; else nothing."""
        chains = self._race_more(ctx, run)
        for name, params in sweep_more(self._sweep_arms, ctx, run, self._sink, self._rounds):
            chains += self._add_arm(ctx, Arm(name, **params))
        record_trials(self._sweep_arms, ctx, self._sink)
        return chains

    def _race_more(self, ctx: LogContext, run: RunResult) -> list[Chain]:
        """With a race, once `run` closed its round: the arms it drops, recorded, and the
        survivors' next round."""
        if self._rounds is None:
            return []
        dropped = self._rounds.ended(run)
        if dropped is None:
            return []
        for elimination in dropped:
            log.info("%s: arm %s eliminated after round %d (%s, p=%.3g vs %s)", self.name,
                     elimination.arm, elimination.round, elimination.test,
                     elimination.p_value, elimination.best)  # fmt: skip
            if isinstance(self._sink, RaceSink) and elimination.arm not in self._recorded:
                assert self.race is not None
                self._sink.record_elimination(ctx, elimination, self.race.alpha)
                self._recorded.add(elimination.arm)
        self._replan(ctx)
        return self._round_chains()

    def _round_chains(self) -> list[Chain]:
        """The race's round due now: one chain per arm in it."""
        assert self._rounds is not None
        index = {arm.name: i for i, arm in enumerate(self.arms)}
        return [Chain(index[name], self._rounds.round, None) for name in self._rounds.arms]

    def _add_arm(self, ctx: LogContext | None, arm: Arm) -> list[Chain]:
        """Add `arm` while the experiment runs (a sampled arm), checked as the declared arms
        are: it joins the result and the experiment's config (the store's logger records it
        as its first group starts), and its runs are planned. Returns its chains, which
        `more` hands the scheduler. With `ctx` None (a sweep run again, before the experiment
        starts), it only joins the arms: the experiment's config and result will hold it."""
        self.arms = _checked_arms([*self.arms, arm], self.repeats)
        configs = self.stage_configs[arm.name] = arm.stage_configs(self.base_config)
        self.configs[arm.name] = configs[0]
        if ctx is None:
            return []
        assert self.result is not None
        ctx.config["arms"][arm.name] = _jsonable(arm.overrides)
        ctx.config["arm_configs"][arm.name] = _dumped(configs[0])
        self.result.arms.append(ArmResult(arm.name, arm.overrides))
        self._replan(ctx)
        index = len(self.arms) - 1
        return [Chain(index, repeat, _stages(arm)) for repeat in self._repeats()]

    def retry(self, run_key: str) -> None:
        """The run's worker died: it is claimed again as a run recorded `crashed` (its folder
        stays, to resume from)."""
        self._prior[run_key] = {"status": "crashed", "summary": {}}

    def _worker(self) -> Any:
        """What executes a run in a worker process: `run_in_worker`, or with
        `processes_per_run` > 1, `run_on_ranks` (the worker is rank 0 and starts the others)."""
        if self.processes_per_run == 1:
            return run_in_worker
        return functools.partial(run_on_ranks, processes=self.processes_per_run)

    def _callbacks(self) -> list[Callback]:
        callbacks = list(self.callbacks)
        if self.store is not False and not any(isinstance(cb, StoreSink) for cb in callbacks):
            callbacks.append(store_sink(self.store))
        return for_rank(callbacks)  # under torchrun, rank 0 alone records

    def _experiment_config(self) -> dict[str, Any]:
        base = self.base_config.model_dump(mode="json") if self.base_config is not None else {}
        declared = self.declared
        if declared.metric is None and declared.mode is None and not declared.bounds:
            summary = {}
        else:  # what every door ranks by and clips to (lab._ranking.declaration reads it)
            summary = {SUMMARY_KEY: declared.entry()}
        return {
            "base_config": base,
            "arms": {a.name: _jsonable(a.overrides) for a in self.arms},
            "arm_configs": {name: _dumped(cfg) for name, cfg in self.configs.items()},
            "repeats": self.repeats,
            "seed": self.seed,
            "train": train_name(self.train),
            **summary,
            **({"race": dict(vars(self.race))} if self.race is not None else {}),
            **({"sweep": sweep_arms.sweep_config(self.sweep)} if self.sweep else {}),
        }

    def _plan(self) -> list[tuple[str, Arm, int, int]]:
        """Every run of the experiment: (run key, arm, repeat, stage), in lifecycle order."""
        return [
            (_run_key(arm, repeat, stage), arm, repeat, stage)
            for arm in self.arms
            for repeat in self._repeats()
            for stage in range(_stage_count(arm))
        ]

    def _repeats(self) -> range:
        """The repeats this experiment runs: all of them, or the one a script's run is."""
        if self._only_repeat is not None:
            return range(self._only_repeat, self._only_repeat + 1)
        return range(self.repeats)

    def _planned(self, arm: Arm) -> int:
        if self._rounds is not None:
            return self._rounds.planned(arm.name)
        return len(self._repeats()) * _stage_count(arm)

    def _fingerprint(self, arm: Arm, repeat: int, stage: int) -> Fingerprint:
        """What the run of (arm, repeat, stage) depends on: a recorded run stands for it only
        when this is the same."""
        config = self.stage_configs[arm.name][stage]
        return Fingerprint(
            config=config.model_dump(mode="json") if config is not None else {},
            seed=self.seed + repeat,
            stage=stage,
            train=train_name(self.train),
            carry=arm.carry if arm.stages is not None and stage > 0 else None,
        )

    def _check_reuse(self) -> None:
        """Refuse, before anything runs, to reuse a recorded run that trained something else
        than its planned run would, or to start a run that a live process is training."""
        changed: dict[str, list[str]] = {}
        for run_key, arm, repeat, stage in self._plan():
            prior = self._prior.get(run_key)
            if prior is None:
                continue
            if prior["status"] == "running":
                raise RunBusy(busy_message(self.name, run_key, prior))
            new = self._fingerprint(arm, repeat, stage)
            if prior["config_hash"] is not None and prior["config_hash"] == new.digest():
                continue
            recorded_train = prior["train"] if prior["config_hash"] is not None else None
            old = Fingerprint(prior["config"] or {}, prior["seed"], prior["stage"],
                              recorded_train, prior.get("carry"))  # fmt: skip
            diffs = differences(old, new)
            if prior["config_hash"] is not None and not diffs:  # the one input not recorded
                diffs = [f"carry: (not recorded) -> {json.dumps(new.carry)}"]
            if diffs:
                changed[run_key] = diffs
        if changed:
            raise ConfigError(refusal(self.name, changed, len(self._prior)))

    def release(self, run_key: str, error: str | None) -> None:
        """Close the claim on a run whose record never started (the store failed in
        `on_run_start`, or the run never reached a worker): its row is `failed` with `error`,
        not left `running`. A run that a worker took over, or that ended, is not touched."""
        if self._sink is not None:
            self._sink.release(run_key, error or "the run never started")

    def _job(
        self, ctx: LogContext, arm: Arm, repeat: int, stage: int, parent: RunResult | None
    ) -> RunJob | RunResult:
        """Point `ctx` at a run and describe it as a `RunJob`; or, for a run that finished
        before (`FINISHED`: completed, or stopped early on purpose), its recorded result
        (nothing runs again)."""
        config = self.stage_configs[arm.name][stage]
        seed = self.seed + repeat
        run_key = _run_key(arm, repeat, stage)
        parent_key = parent.run_key if parent is not None else None
        ctx.run_key, ctx.repeat, ctx.stage, ctx.seed = run_key, repeat, stage, seed
        ctx.parent_run_key = parent_key
        ctx.run_config = config.model_dump(mode="json") if config is not None else {}
        ctx.config_hash = self._fingerprint(arm, repeat, stage).digest()
        prior = self._prior.get(run_key)
        if self._sink is not None and (prior is None or prior["status"] not in FINISHED):
            # Claimed in the store before any run hook: of two processes that start the same
            # run, one trains it; the other finds it finished (and reuses it) or busy (raises).
            unknown = prior is None
            prior = self._sink.claim(ctx)
            if prior is None and unknown:
                _move_orphan(ctx.output_dir / run_key)
        if prior is not None and prior["status"] in FINISHED:
            log.info("%s: run %s %s before; skipping it", self.name, run_key, prior["status"])
            return RunResult(run_key=run_key, arm=arm.name, repeat=repeat, stage=stage,
                             seed=seed, status=prior["status"], metrics=dict(prior["summary"]),
                             seconds=0.0, parent_run_key=parent_key,
                             pruned=prior.get("pruned"))  # fmt: skip
        return RunJob(
            train=self.train, experiment=self.name, arm=arm.name, repeat=repeat, stage=stage,
            seed=seed, run_key=run_key, config=config, ctx=ctx, carry=arm.carry,
            parent_run_key=parent_key, benchmarks=list(self.benchmarks),
            run_callbacks=self.run_callbacks, resources={**self.resources, **arm.resources},
        )  # fmt: skip


def _check_args(
    name: Any,
    train: Any,
    repeats: Any,
    executor: Any,
    max_retries: Any,
    workers: Any,
    base_config: Any,
) -> None:
    """`Experiment`'s arguments, each refused in one line that says what to pass instead."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"an experiment needs a non-empty name, got {name!r}")
    check_name("experiment", name, MAX_NAME)
    if not callable(train):
        raise ConfigError("train must be a function train(run) -> LoopArtifacts | dict")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats={repeats!r}: use an int >= 1")
    if not isinstance(executor, str) or executor not in EXECUTORS:
        raise ConfigError(f"executor={executor!r}: use 'serial', 'processes' or 'ray'")
    if executor == "ray":  # the pip line now, not an ImportError when it runs
        require("ray", "ray", "executor='ray'")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ConfigError(f"max_retries={max_retries!r}: use an int >= 0")
    if max_retries and executor == "serial":
        raise ConfigError(
            "max_retries needs executor='processes' or 'ray': a run that dies in this "
            "process takes the experiment with it"
        )
    if workers is not None and (
        isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
    ):
        raise ConfigError(
            f"workers={workers!r}: use an int >= 1, or None for one per CPU (at most one per run)"
        )
    if base_config is not None and not isinstance(base_config, pydantic.BaseModel):
        raise ConfigError(
            "base_config must be a pydantic model instance, e.g. base_config=Config()"
        )


def _at_once(n_runs: int, arms: int, repeats: int, race: Any, sweep: Any) -> int:
    """The most runs the experiment could have going at once: a race's round (one run per
    arm), else every run (a sweep's: its arms' repeats)."""
    if sweep is not None:
        arms, n_runs = sweep_arms.sweep_size(sweep), repeats * sweep_arms.sweep_size(sweep)
    return arms if race is not None else n_runs


def _workers(executor: str, workers: int | None, n_runs: int) -> int | None:
    """How many runs go at once: `workers`, else one per CPU, at most one per run; under
    Ray, which places the runs, `workers` caps them only when given."""
    if executor == "ray":
        return min(workers, n_runs) if workers is not None else None
    return min(workers or os.cpu_count() or 1, n_runs)


def _checked_arms(given: Sequence[Arm] | None, repeats: int) -> list[Arm]:
    """The experiment's arms (one named ``base`` when none is given): unique names, names
    that fit as groups, and no two sharing a run folder."""
    arms = list(given) if given else [Arm("base")]
    names = [a.name for a in arms]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"duplicate arm names {dupes}; give every arm its own name")
    for arm in arms:  # a chain's group is named after its arm and repeat
        if arm.stages is not None:
            check_name("group", f"{arm.name}-r{repeats - 1}", MAX_NAME)
    folders: dict[str, str] = {}  # casefolded: some filesystems ignore case
    for arm_name in names:
        other = folders.setdefault(safe_name(arm_name).casefold(), arm_name)
        if other != arm_name:
            raise ConfigError(
                f"arms {other!r} and {arm_name!r} would share the run folder "
                f"{safe_name(arm_name)!r}; rename one of them"
            )
    return arms


def _check_later(notes: Any, processes_per_run: Any, metric: Any) -> None:
    """The rest of `Experiment`'s arguments, checked after its tags."""
    if notes is not None and not isinstance(notes, str):
        raise ConfigError(f"notes={notes!r}: use a string")
    if (
        isinstance(processes_per_run, bool)
        or not isinstance(processes_per_run, int)
        or processes_per_run < 1
    ):
        raise ConfigError(
            f"processes_per_run={processes_per_run!r}: use an int >= 1 (the ranks of each "
            "run's DDP group)"
        )
    if metric is not None and (not isinstance(metric, str) or not metric):
        raise ConfigError(f"metric={metric!r}: name the metric that ranks the arms, e.g. "
                          "metric='val/loss'")  # fmt: skip


def _split_callbacks(
    given: Sequence[Callback | CallbackFactory],
) -> tuple[list[Callback], list[CallbackFactory]]:
    """`Experiment(callbacks=...)`: the callbacks every run shares, and the factories that
    build a run's own. A class is refused: it is callable, but meant as an instance."""
    shared: list[Callback] = []
    factories: list[CallbackFactory] = []
    for item in given:
        if isinstance(item, type):
            raise ConfigError(
                f"callbacks: {item.__name__} is a class; pass an instance, {item.__name__}(), "
                f"or a factory that builds one per run, lambda run: {item.__name__}(...)"
            )
        if callable(item) and not isinstance(item, Callback):
            factories.append(item)
        else:
            shared.append(item)  # (may not be a Callback: Dispatcher says so)
    return shared, factories


def _rank_zero() -> bool:
    ranks = launcher_rank()
    return ranks is None or ranks[0] == 0


def _check_launcher_env() -> None:
    """Under a launcher's RANK and WORLD_SIZE, the address of rank 0 must be set too."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ConfigError(
            f"RANK and WORLD_SIZE are set but {' and '.join(missing)} not; launch with "
            "torchrun (which sets all four), or init the process group before Experiment.run()"
        )


def _run_key(arm: Arm, repeat: int, stage: int) -> str:
    """A run's key, which is also its folder's name: ``small-r0``, ``chain-r0-s1``."""
    key = f"{safe_name(arm.name)}-r{repeat}"
    return key + f"-s{stage}" if arm.stages is not None else key


def _stages(arm: Arm) -> int | None:
    """A chain's stages: None for an arm without stages (a chain of one run)."""
    return len(arm.stages) if arm.stages is not None else None


def _dumped(config: pydantic.BaseModel | None) -> dict[str, Any]:
    """A config as the store records it (an experiment without a base config: {})."""
    return config.model_dump(mode="json") if config is not None else {}


def _stage_count(arm: Arm) -> int:
    """How many runs one repeat of `arm` is: one per stage, or one without stages."""
    return len(arm.stages) if arm.stages else 1


def _jsonable(value: Any) -> Any:
    return pydantic.TypeAdapter(Any).dump_python(value, mode="json")
