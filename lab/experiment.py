"""Experiments: arms x repeats of one `train(run)` function, and what they return.

`Experiment.run()` walks the lifecycle written out in `lab.hooks`: one group per arm (its
repeats), one run per repeat, every hook through one `Dispatcher`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pydantic

from lab._seeding import seed_everything
from lab._stats import Spread, spread
from lab._table import fmt, render
from lab.errors import CallbackError, CheckpointError, ConfigError
from lab.hooks import Callback, Dispatcher, LogContext
from lab.loggers.sql import SqlLogger
from lab.loop.evals import EvalResult, Evaluator
from lab.loop.training import LoopArtifacts
from lab.store.engine import resolve_url

log = logging.getLogger("lab.experiment")

RunStatus = Literal["completed", "failed", "stopped"]
_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def safe_name(name: str, *, limit: int = 64) -> str:
    """A folder name for `name`: safe on every filesystem, and distinct for distinct names.

    >>> safe_name("small")
    'small'
    >>> safe_name("../../x")
    'x-9bdbf20b'
    """
    slug = _SAFE.sub("-", name).strip("-.")[:limit] or "x"
    if slug == name:
        return slug
    return f"{slug}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


class Arm:
    """A named variant of the base config: its overrides, validated before any run starts.

    Keys name fields of the base config; a dotted key reaches into a nested model:
    ``Arm("wide", **{"model.width": 256})``.

    With `stages`, each repeat of the arm is a continual chain, a group of its own: stage k
    runs with the arm's overrides plus ``stages[k]``, and starts from stage k-1's final
    checkpoint, its weights only (``carry="weights"``) or its whole training state
    (``carry="full"``: optimizer, scheduler and callbacks too; the step starts at 0).
    """

    def __init__(
        self,
        name: str,
        /,
        *,
        stages: Sequence[dict[str, Any]] | None = None,
        carry: Literal["weights", "full"] = "weights",
        **overrides: Any,
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"an arm needs a non-empty name, got {name!r}")
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

    def stage_configs(self, base: pydantic.BaseModel | None) -> list[pydantic.BaseModel | None]:
        """One validated config per stage (one in all for an arm without stages)."""
        if self.stages is None:
            return [self.apply(base)]
        return [
            Arm(f"{self.name} stage {k}", **{**self.overrides, **stage}).apply(base)
            for k, stage in enumerate(self.stages)
        ]

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


@dataclass
class RunSpec:
    """What the Experiment hands `train(run)`: the run's config, seed, folder and hooks."""

    experiment: str
    arm: str
    repeat: int
    stage: int
    seed: int
    run_key: str
    config: Any
    dir: Path
    ctx: LogContext
    dispatcher: Dispatcher = field(repr=False)
    parent_checkpoint: Path | None = None  # stage k-1's final checkpoint, in a chain
    carry: Literal["weights", "full"] = "weights"


@dataclass
class RunResult:
    """How one run ended: its status, final metrics, and any error."""

    run_key: str
    arm: str
    repeat: int
    stage: int
    seed: int
    status: RunStatus
    metrics: dict[str, float]
    seconds: float
    error: str | None = None
    traceback: str | None = None
    callback_errors: list[dict[str, Any]] = field(default_factory=list)
    artifacts: LoopArtifacts | None = field(default=None, repr=False)
    parent_run_key: str | None = None


@dataclass
class ArmResult:
    """An arm's runs so far."""

    name: str
    overrides: dict[str, Any]
    runs: list[RunResult] = field(default_factory=list)

    def values(self, metric: str) -> list[float]:
        """The final `metric` of every run that finished (completed or stopped)."""
        return [
            r.metrics[metric] for r in self.runs if r.status != "failed" and metric in r.metrics
        ]


@dataclass(frozen=True)
class SummaryRow:
    """One arm's spread of one final metric across its repeats."""

    arm: str
    metric: str
    n: int
    mean: float
    std: float
    ci_low: float
    ci_high: float


@dataclass
class Summary:
    """Per arm and final metric: n, mean, std and 95% CI across repeats, and the best arm."""

    experiment: str
    rows: list[SummaryRow]
    metric: str | None
    mode: Literal["min", "max"]
    best_arm: str | None
    runner_up: str | None
    margin: float | None
    runs: int
    runs_by_status: dict[str, int]

    def row(self, arm: str, metric: str) -> SummaryRow:
        """The row of `arm` and `metric`."""
        for r in self.rows:
            if r.arm == arm and r.metric == metric:
                return r
        raise KeyError(f"no summary row for arm {arm!r}, metric {metric!r}")

    def to_dicts(self) -> list[dict[str, Any]]:
        """The rows as plain dicts (e.g. for `pandas.DataFrame`)."""
        return [r.__dict__.copy() for r in self.rows]

    def __str__(self) -> str:
        statuses = ", ".join(f"{n} {s}" for s, n in sorted(self.runs_by_status.items()))
        lines = [f"{self.experiment}: {self.runs} runs ({statuses})"]
        lines.append(
            render(
                ("arm", "metric", "n", "mean", "std", "95% CI"),
                [  # with one repeat there is no spread: std and CI show as "-"
                    (
                        r.arm,
                        r.metric,
                        r.n,
                        r.mean,
                        r.std if r.n > 1 else None,
                        f"[{fmt(r.ci_low)}, {fmt(r.ci_high)}]" if r.n > 1 else "-",
                    )
                    for r in self.rows
                ],
            )
        )
        if self.best_arm is not None:
            best = self.row(self.best_arm, self.metric)
            line = f"best arm by {self.metric} ({self.mode}): {self.best_arm} ({fmt(best.mean)})"
            if self.runner_up is not None:
                line += f", ahead of {self.runner_up} by {fmt(self.margin)}"
            lines.append(line)
        return "\n".join(lines)


@dataclass
class ExperimentResult:
    """Every run of an experiment, grouped by arm."""

    name: str
    arms: list[ArmResult]
    seconds: float = 0.0
    error: str | None = None
    callback_errors: list[dict[str, Any]] = field(default_factory=list)

    @property
    def runs(self) -> list[RunResult]:
        """All runs, in the order they ran."""
        return [r for arm in self.arms for r in arm.runs]

    @property
    def status(self) -> Literal["completed", "failed"]:
        """`failed` if it was interrupted or any run failed, else `completed`."""
        if self.error is not None or any(r.status == "failed" for r in self.runs):
            return "failed"
        return "completed"

    def summary(
        self,
        metric: str | None = None,
        mode: Literal["min", "max"] = "min",
        *,
        keys: Sequence[str] | None = None,
    ) -> Summary:
        """Per arm: mean, std, n and 95% CI of every final metric; the best arm by `metric`.

        `metric` defaults to ``loss``; `keys` limits the rows to some metrics. Failed runs
        are left out of the statistics.
        """
        if mode not in ("min", "max"):
            raise ConfigError(f"mode={mode!r}: use 'min' or 'max'")
        known = sorted({k for r in self.runs if r.status != "failed" for k in r.metrics})
        for name in ([metric] if metric is not None else []) + list(keys or []):
            if name not in known:
                raise ConfigError(
                    f"no run has a final metric {name!r}; known: {', '.join(known) or 'none'}"
                )
        chosen = metric or ("loss" if "loss" in known else None)
        shown = list(keys) if keys is not None else known
        rows = []
        spreads: dict[str, Spread] = {}
        for arm in self.arms:
            for key in shown:
                s = spread(arm.values(key))
                rows.append(SummaryRow(arm.name, key, s.n, s.mean, s.std, s.ci_low, s.ci_high))
            if chosen is not None:
                spreads[arm.name] = spread(arm.values(chosen))
        ranked = sorted(
            (name for name, s in spreads.items() if not math.isnan(s.mean)),
            key=lambda name: spreads[name].mean,
            reverse=mode == "max",
        )
        best = ranked[0] if ranked else None
        runner_up = ranked[1] if len(ranked) > 1 else None
        margin = (
            abs(spreads[best].mean - spreads[runner_up].mean) if runner_up is not None else None
        )
        by_status: dict[str, int] = {}
        for r in self.runs:
            by_status[r.status] = by_status.get(r.status, 0) + 1
        return Summary(
            self.name, rows, chosen, mode, best, runner_up, margin, len(self.runs), by_status
        )


TrainFn = Callable[[RunSpec], "LoopArtifacts | dict[str, float] | None"]


class Experiment:
    """A named study: `train(run)` for every arm x repeat, recorded by the attached callbacks.

    Running an experiment again under the same name and store continues it: runs that
    completed are skipped (their recorded results are part of the new result), and the
    others run again, resuming from their newest checkpoint when the loop has checkpoints.

    The store (argument, else ``LAB_STORE_URL``, else ``sqlite:///lab.db``) gets a
    `SqlLogger` unless one is attached already; ``store=False`` records nothing.
    Each repeat ``i`` is seeded with ``seed + i``.
    """

    def __init__(
        self,
        name: str,
        train: TrainFn,
        *,
        arms: Sequence[Arm] | None = None,
        repeats: int = 1,
        base_config: pydantic.BaseModel | None = None,
        callbacks: Sequence[Callback] = (),
        store: Any = None,
        output_dir: str | Path = "runs",
        seed: int = 0,
        benchmarks: Sequence[Evaluator] = (),
        strict: bool | None = None,
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"an experiment needs a non-empty name, got {name!r}")
        if not callable(train):
            raise ConfigError("train must be a function train(run) -> LoopArtifacts | dict")
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ConfigError(f"repeats={repeats!r}: use an int >= 1")
        if base_config is not None and not isinstance(base_config, pydantic.BaseModel):
            raise ConfigError(
                "base_config must be a pydantic model instance, e.g. base_config=Config()"
            )
        arms = list(arms) if arms else [Arm("base")]
        names = [a.name for a in arms]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"duplicate arm names {dupes}; give every arm its own name")
        folders: dict[str, str] = {}  # casefolded: some filesystems ignore case
        for arm_name in names:
            other = folders.setdefault(safe_name(arm_name).casefold(), arm_name)
            if other != arm_name:
                raise ConfigError(
                    f"arms {other!r} and {arm_name!r} would share the run folder "
                    f"{safe_name(arm_name)!r}; rename one of them"
                )
        self.name = name
        self.train = train
        self.arms = arms
        self.repeats = repeats
        self.base_config = base_config
        # validated now, before any run: one config per stage of each arm
        self.stage_configs = {arm.name: arm.stage_configs(base_config) for arm in arms}
        self.configs = {name: cfgs[0] for name, cfgs in self.stage_configs.items()}
        self.callbacks = list(callbacks)
        # An unknown scheme fails here, before any run; the store opens in run().
        self.store = resolve_url(store) if store is None or isinstance(store, str) else store
        self.output_dir = Path(output_dir)
        self.seed = seed
        self.benchmarks = list(benchmarks)
        self.strict = strict
        self._prior: dict[str, dict[str, Any]] = {}  # earlier runs of this name, by run key

    # ------------------------------------------------------------------------------------
    def run(self) -> ExperimentResult:
        """Run every arm x repeat and return their results; failed runs don't stop the rest.

        The store is opened before any hook fires, so an unreachable server or a schema
        from a newer `lab` stops the experiment at once, with one line that says what to do.
        An interrupt (Ctrl-C) records the run it hit as failed and the experiment as failed,
        then propagates.
        """
        callbacks = self._callbacks()
        self._prior = {}
        for cb in callbacks:
            if isinstance(cb, SqlLogger):  # opening marks runs whose process died `crashed`
                self._prior = cb.open().previous_runs(self.name)
        hooks = Dispatcher(callbacks, strict=self.strict)
        ctx = LogContext(
            experiment=self.name,
            output_dir=self.output_dir / safe_name(self.name),
            config=self._experiment_config(),
        )
        result = ExperimentResult(self.name, [ArmResult(a.name, a.overrides) for a in self.arms])
        started = time.perf_counter()
        try:
            hooks.fire("on_experiment_start", ctx)
            try:
                for arm, arm_result in zip(self.arms, result.arms, strict=True):
                    if arm.stages is None:  # one group: the arm's repeats
                        ctx.group_name, ctx.arm, ctx.group_kind = arm.name, arm.name, "repeats"
                        hooks.fire("on_group_start", ctx, arm.name)
                        for repeat in range(self.repeats):
                            self._run_one(hooks, ctx, arm, arm_result, repeat)
                        continue
                    for repeat in range(self.repeats):  # one group per chain
                        chain = f"{arm.name}-r{repeat}"
                        ctx.group_name, ctx.arm, ctx.group_kind = chain, arm.name, "chain"
                        hooks.fire("on_group_start", ctx, chain)
                        parent = None
                        for stage in range(len(arm.stages)):
                            run = self._run_one(hooks, ctx, arm, arm_result, repeat, stage, parent)
                            if run.status == "failed":
                                log.error("%s: %s failed; its chain stops", self.name, run.run_key)
                                break  # a failed stage stops its chain; other chains go on
                            parent = run
            except CallbackError:
                raise  # strict mode: a callback bug propagates as it is
            except BaseException as exc:  # an interrupt: close the record, then propagate
                result.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
                self._end(hooks, ctx, result, started)
                raise
            self._end(hooks, ctx, result, started)
        finally:
            hooks.fire("close")
        return result

    def _end(
        self, hooks: Dispatcher, ctx: LogContext, result: ExperimentResult, started: float
    ) -> None:
        _clear_run(ctx)
        result.seconds = time.perf_counter() - started
        result.callback_errors = _failures(hooks, None)
        hooks.fire("on_experiment_end", ctx, result)
        result.callback_errors = _failures(hooks, None)

    def _callbacks(self) -> list[Callback]:
        callbacks = list(self.callbacks)
        if self.store is not False and not any(isinstance(cb, SqlLogger) for cb in callbacks):
            callbacks.append(SqlLogger(self.store))
        return callbacks

    def _experiment_config(self) -> dict[str, Any]:
        base = self.base_config.model_dump(mode="json") if self.base_config is not None else {}
        return {
            "base_config": base,
            "arms": {a.name: _jsonable(a.overrides) for a in self.arms},
            "arm_configs": {
                name: cfg.model_dump(mode="json") if cfg is not None else {}
                for name, cfg in self.configs.items()
            },
            "repeats": self.repeats,
            "seed": self.seed,
        }

    def _run_one(
        self,
        hooks: Dispatcher,
        ctx: LogContext,
        arm: Arm,
        arm_result: ArmResult,
        repeat: int,
        stage: int = 0,
        parent: RunResult | None = None,
    ) -> RunResult:
        config = self.stage_configs[arm.name][stage]
        seed = self.seed + repeat
        run_key = f"{safe_name(arm.name)}-r{repeat}"
        if arm.stages is not None:
            run_key += f"-s{stage}"
        parent_key = parent.run_key if parent is not None else None
        ctx.run_key, ctx.repeat, ctx.stage, ctx.seed = run_key, repeat, stage, seed
        ctx.parent_run_key = parent_key
        ctx.run_config = config.model_dump(mode="json") if config is not None else {}
        run_dir = ctx.output_dir / run_key
        prior = self._prior.get(run_key)
        if prior is not None and prior["status"] == "completed":
            log.info("%s: run %s completed before; skipping it", self.name, run_key)
            skipped = RunResult(run_key=run_key, arm=arm.name, repeat=repeat, stage=stage,
                                seed=seed, status="completed", metrics=dict(prior["summary"]),
                                seconds=0.0, parent_run_key=parent_key)  # fmt: skip
            arm_result.runs.append(skipped)
            return skipped
        run_dir.mkdir(parents=True, exist_ok=True)
        hooks.run_key = run_key
        seed_everything(seed)
        spec = RunSpec(
            self.name, arm.name, repeat, stage, seed, run_key, config, run_dir, ctx, hooks,
            carry=arm.carry,
        )  # fmt: skip

        hooks.fire("on_run_start", ctx)
        started = time.perf_counter()
        status: RunStatus = "completed"
        metrics: dict[str, float] = {}
        error = tb = None
        artifacts = None
        interrupt: BaseException | None = None
        try:
            if parent_key is not None:  # inside the try: a missing one fails this stage
                spec.parent_checkpoint = _final_checkpoint(ctx.output_dir / parent_key)
            out = self.train(spec)
            artifacts = out if isinstance(out, LoopArtifacts) else None
            metrics = _final_metrics(out)
            if artifacts is not None and artifacts.stopped:
                status = "stopped"
            if artifacts is not None:
                metrics.update(self._benchmark(hooks, ctx, artifacts))
        except CallbackError:
            raise  # strict mode: a callback bug must not look like a training failure
        except BaseException as exc:
            status, error, tb = "failed", f"{type(exc).__name__}: {exc}", traceback.format_exc()
            if isinstance(exc, Exception):
                log.error("run %s of %s failed; the other runs go on:\n%s", run_key, self.name, tb)
            else:
                error, interrupt = f"interrupted ({type(exc).__name__})", exc
            hooks.fire("on_error", ctx, exc)
        run_result = RunResult(
            run_key=run_key,
            arm=arm.name,
            repeat=repeat,
            stage=stage,
            seed=seed,
            status=status,
            metrics=metrics,
            seconds=time.perf_counter() - started,
            error=error,
            traceback=tb,
            callback_errors=_failures(hooks, run_key),
            artifacts=artifacts,
            parent_run_key=parent_key,
        )
        arm_result.runs.append(run_result)
        hooks.fire("on_run_end", ctx, run_result, arm_result)
        # failures inside on_run_end itself still reach the run's record
        run_result.callback_errors = _failures(hooks, run_key)
        hooks.run_key = None  # what fails from here on belongs to the experiment
        if interrupt is not None:
            raise interrupt
        return run_result

    def _benchmark(
        self, hooks: Dispatcher, ctx: LogContext, artifacts: LoopArtifacts
    ) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for bench in self.benchmarks:
            try:
                res = bench.run(artifacts.model, None)
            except Exception as exc:
                log.exception("benchmark %r failed; the run goes on", bench.name)
                res = EvalResult(bench.name, {}, error=f"{type(exc).__name__}: {exc}")
            hooks.fire("on_benchmark_eval", ctx, res, res.predictions, step=None)
            metrics.update({f"{res.name}/{k}": v for k, v in res.metrics.items()})
        return metrics


def _final_checkpoint(run_dir: Path) -> Path:
    """The checkpoint a chain's next stage starts from: the parent run's newest one."""
    latest = run_dir / "checkpoints" / "latest"
    if not latest.exists():
        raise CheckpointError(
            f"the next stage starts from {run_dir.name}'s final checkpoint, but it saved none; "
            "give its TrainingLoop checkpoint=CheckpointConfig(save_at_end=True)"
        )
    return run_dir / "checkpoints" / latest.read_text().strip()


def _failures(hooks: Dispatcher, run_key: str | None) -> list[dict[str, Any]]:
    """The callback failures of one run (or, with None, of the experiment outside runs)."""
    return [f.to_dict() for f in hooks.failures if f.run_key == run_key]


def _clear_run(ctx: LogContext) -> None:
    ctx.run_key = ctx.run_config = ctx.repeat = ctx.seed = ctx.parent_run_key = None
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


def _jsonable(value: Any) -> Any:
    return pydantic.TypeAdapter(Any).dump_python(value, mode="json")
