"""The records that hooks carry: plain dataclasses on the ground floor of `lab`.

`lab.hooks` imports its payload types from here alone, and every module that fires or
receives a hook builds on them; nothing here imports upward (only errors, leaf helpers and
`lab.media`; torch only for annotations). The experiment's records come first (the
`LogContext` every hook of an experiment shares, a run's spec and results, an experiment's
result and its summary), then the loop's (an eval's result, a checkpoint's manifest row, a
step's batch, what a fit leaves behind). The modules that make them re-export them:
`lab.hooks`, `lab.experiment`, `lab.loop.evals`, `lab.loop.checkpoints`, `lab.loop.records`.
The on-policy RL loop keeps its own records in `lab.rl.experience`.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from lab._names import check_tags
from lab._ranking import (
    COUNTED_STATUSES,
    Declaration,
    Ranking,
    bounds_for,
    check_bounds_map,
    check_mode,
    choose,
    counted,
    declaration,
    lacking_text,
    rank_arms,
)
from lab._stats import Interval, check_interval, spread
from lab._table import fmt, plural, render
from lab.errors import ConfigError
from lab.media import Histogram, Image, Media

if TYPE_CHECKING:
    import torch

__all__ = [
    "FAILED",
    "FINISHED",
    "ArmResult",
    "EvalResult",
    "ExperimentResult",
    "Histogram",
    "Image",
    "Kind",
    "LogContext",
    "LoopArtifacts",
    "ManifestRow",
    "Media",
    "RunResult",
    "RunSpec",
    "RunStatus",
    "Summary",
    "SummaryRow",
    "TrainFn",
    "TrainingBatch",
]

#: `crashed`: the process that trained the run died (``executor="processes"`` or ``"ray"``).
#: `pruned`: a pruning rule stopped it early (`RunResult.pruned` says where and why).
RunStatus = Literal["completed", "failed", "stopped", "crashed", "pruned"]


#: The statuses of a run that ended on its own terms: running the experiment again skips it
#: (a pruned run is not trained again: its rule decided, on the points it had).
FINISHED: tuple[RunStatus, ...] = ("completed", "stopped", "pruned")
#: The statuses of a run that did not finish: it raised, or its process died.
FAILED: tuple[RunStatus, ...] = ("failed", "crashed")


@dataclass
class LogContext:
    """What every hook of an experiment shares: where it writes, what runs, and sinks' ids.

    A sink stores the ids it creates in `ids` under names that start with its own prefix
    (the SQL logger uses ``sql:``), so two sinks never overwrite each other.
    """

    experiment: str
    output_dir: Path
    config: dict[str, Any] = field(default_factory=dict)
    run_key: str | None = None
    run_config: dict[str, Any] | None = None
    group_name: str | None = None
    arm: str | None = None
    repeat: int | None = None
    stage: int = 0
    seed: int | None = None
    group_kind: str = "repeats"  # "chain" for the stages of a continual arm
    parent_run_key: str | None = None  # the previous stage's run, in a chain
    config_hash: str | None = None  # what the run depends on, hashed (see lab._reuse)
    ids: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    #: False for a run without a folder of its own (a bare `TrainingLoop.fit()` without
    #: `run_dir`, whose run key is "loop"): its files go to the working directory.
    own_folder: bool = True

    @property
    def run_dir(self) -> Path | None:
        """The current run's own folder, or None between runs (and for a run without one)."""
        if self.run_key is None or not self.own_folder:
            return None
        return self.output_dir / self.run_key

    @property
    def folder(self) -> Path:
        """Where a callback writes the current run's files: its folder, or, for a run
        without one (a bare `TrainingLoop.fit()` without `run_dir`), the working directory."""
        run_dir = self.run_dir
        return run_dir if run_dir is not None else Path.cwd()


class RunHooks(Protocol):
    """What a run fires its hooks through (`lab.dispatch.Dispatcher` is the one): a loop
    extends it with its own callbacks, and sends the run's hooks to what `extended` returns.
    The hooks are members of `lab.hooks.HookEnum`, which these records do not import, so
    `fire` is the dispatcher's own."""

    #: The callbacks the hooks go to, in order.
    callbacks: list[Any]

    def extended(self, extra: Iterable[Any]) -> Any:
        """These callbacks plus `extra`, sharing the failure record."""

    def sibling(self, callbacks: Iterable[Any]) -> Any:
        """`callbacks` alone, sharing the failure record."""


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
    dispatcher: RunHooks = field(repr=False)
    parent_checkpoint: Path | None = None  # stage k-1's final checkpoint, in a chain
    carry: Literal["weights", "full"] = "weights"
    #: The run's own tags and notes, recorded when the run ends (with the tags it had).
    tags: list[str] = field(default_factory=list)
    notes: str | None = None
    #: What the run's last loop left behind (a `RunHandle` sets it when it finishes).
    artifacts: LoopArtifacts | None = field(default=None, repr=False)

    def tag(self, *tags: str) -> None:
        """Tag this run (W&B style: plain strings, each kept once), e.g. ``run.tag("diverged")``
        from `train(run)`; the store records them when the run ends, beside those added with
        ``lab tag``. Set ``run.notes = "..."`` the same way."""
        for tag in check_tags(list(tags)):
            if tag not in self.tags:
                self.tags.append(tag)


@dataclass
class RunResult:
    """How one run ended: its status, final metrics, and any error.

    `artifacts` (the trained model, the loop's outputs) is None for a run that executed in a
    worker process (``executor="processes"``): the model stays in the worker, so a run that
    needs its model later saves it in its run folder (or a checkpoint) from `train`.
    """

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
    tags: list[str] = field(default_factory=list)  # what train(run) tagged it with
    notes: str | None = None
    #: A `pruned` run's stop: ``{"step": int, "rule": str, "metric": str, "value": float}``.
    pruned: dict[str, Any] | None = None


@dataclass
class ArmResult:
    """An arm's runs so far."""

    name: str
    overrides: dict[str, Any]
    runs: list[RunResult] = field(default_factory=list)
    planned: int | None = None  # the runs the arm holds (repeats x stages)

    @property
    def finished(self) -> bool:
        """Whether every planned run of the arm finished (completed, stopped or pruned)."""
        done = sum(1 for r in self.runs if r.status in FINISHED)
        return done >= (self.planned if self.planned is not None else len(self.runs))

    def values(self, metric: str) -> list[float]:
        """The final `metric` of every run that counts (completed or stopped; a pruned
        run's last value was never meant to be final, so it is left out)."""
        return [
            r.metrics[metric]
            for r in self.runs
            if r.status in COUNTED_STATUSES and metric in r.metrics
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


#: Final metrics a printed summary leaves out unless asked for all of them: the loop's
#: bookkeeping and the monitors' internals say how a run went, not which arm wins.
ROUTINE_METRICS: tuple[str, ...] = ("lr", "step_time")


ROUTINE_PREFIXES: tuple[str, ...] = (
    "throughput/",
    "gpu_memory/",
    "stability/",
    "grad_norm/",
    "param_norm/",
)


def is_routine(metric: str) -> bool:
    """Whether a printed summary hides `metric` by default (see `ROUTINE_METRICS`)."""
    return metric in ROUTINE_METRICS or metric.startswith(ROUTINE_PREFIXES)


@dataclass
class Summary:
    """Per arm and final metric: n, mean, std and 95% CI across repeats, and the best arm.

    `rows` holds every metric; the text (``str(summary)``) leaves out the routine ones
    (``lr``, ``step_time``, the monitors' ``throughput/``, ``stability/``, ... keys) unless
    `all_metrics` is set, and says which it left out. After an interrupt (`interrupted`) the
    text counts the runs that finished out of those `planned`, and ranks only the arms whose
    runs all finished (`unfinished_arms` are named, never ranked).
    """

    experiment: str
    rows: list[SummaryRow]
    metric: str | None
    mode: Literal["min", "max"]
    best_arm: str | None
    runner_up: str | None
    margin: float | None
    runs: int
    runs_by_status: dict[str, int]
    planned: int | None = None
    interrupted: bool = False
    unfinished_arms: list[str] = field(default_factory=list)
    all_metrics: bool = False
    shown_metrics: list[str] | None = None  # named by the caller: shown even when routine
    interval: Interval = "t"
    unranked: str | None = None  # why no arm is ranked: runs that lack the metric
    #: The arms a race dropped, each with why: ``"after round 1 (t, p=0.0005 vs a)"``;
    #: they are marked in the table and never ranked.
    eliminated: dict[str, str] = field(default_factory=dict)

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
        return self.format()

    def format(self, all_metrics: bool | None = None) -> str:
        """The summary as text; `all_metrics` (default: the summary's own) shows every
        metric, the routine ones included."""
        show_all = self.all_metrics if all_metrics is None else all_metrics
        named = {self.metric, *(self.shown_metrics or [])}
        hidden = (
            []
            if show_all
            else sorted(
                {r.metric for r in self.rows if r.metric not in named and is_routine(r.metric)}
            )
        )
        statuses = ", ".join(f"{n} {s}" for s, n in sorted(self.runs_by_status.items()))
        if self.interrupted:
            finished = sum(n for s, n in self.runs_by_status.items() if s in FINISHED)
            planned = self.planned if self.planned is not None else self.runs
            head = (f"{self.experiment}: interrupted; {finished} of {plural(planned, 'run')} "
                    f"finished ({statuses or 'none started'})")  # fmt: skip
        else:
            head = f"{self.experiment}: {plural(self.runs, 'run')} ({statuses})"
        lines = [head]
        ci = "95% CI" if self.interval == "t" else f"95% CI ({self.interval})"
        lines.append(
            render(
                ("arm", "metric", "n", "mean", "std", ci),
                [  # with one repeat there is no spread: std and CI show as "-"
                    (
                        f"{r.arm} (eliminated)" if r.arm in self.eliminated else r.arm,
                        r.metric,
                        r.n,
                        r.mean if r.n > 0 else None,  # nothing finished: no value, not NaN
                        r.std if r.n > 1 else None,
                        f"[{fmt(r.ci_low)}, {fmt(r.ci_high)}]" if r.n > 1 else "-",
                    )
                    for r in self.rows
                    if r.metric not in hidden
                ],
            )
        )
        if hidden:
            lines.append(
                f"not shown: {', '.join(hidden)} (all_metrics=True, or --all-metrics, shows them)"
            )
        lines += [f"eliminated by the race: {arm} {why}" for arm, why in self.eliminated.items()]
        lines += self._verdict()
        return "\n".join(lines)

    def _verdict(self) -> list[str]:
        """The best-arm line: none for arms whose runs did not all finish."""
        unfinished = ", ".join(self.unfinished_arms)
        if self.unranked is not None:
            return [f"no best arm: {self.unranked}"]
        if self.best_arm is None or self.metric is None:
            if self.unfinished_arms and self.metric is not None:
                return [f"no best arm: not every arm finished its runs (unfinished: {unfinished})"]
            return []
        best = self.row(self.best_arm, self.metric)
        which = "best of the finished arms" if self.unfinished_arms else "best arm"
        line = f"{which} by {self.metric} ({self.mode}): {self.best_arm} ({fmt(best.mean)})"
        if self.runner_up is not None:
            line += f", ahead of {self.runner_up} by {fmt(self.margin)}"
        if self.unfinished_arms:
            line += f"; not ranked, unfinished: {unfinished}"
        return [line]


@dataclass
class RaceResult:
    """How an experiment's race (``Experiment(race=Race(...))``) went so far: the rounds
    closed, each arm dropped (a `lab.sweeps.Elimination`: its round, test, statistic,
    corrected p-value and the arm it lost to), the arms still in it, and its winner once it
    is over (the best mean among the survivors)."""

    metric: str
    mode: Literal["min", "max"]
    rounds: int = 0
    eliminations: list[Any] = field(default_factory=list)
    survivors: list[str] = field(default_factory=list)
    winner: str | None = None
    over: bool = False

    def eliminated(self) -> dict[str, Any]:
        """The arms dropped, each with its elimination."""
        return {e.arm: e for e in self.eliminations}

    def why(self) -> dict[str, str]:
        """The arms dropped, each with why, as a summary says it:
        ``"after round 1 (t, p=0.0005 vs a)"``."""
        return {
            e.arm: f"after round {e.round} ({e.test}, p={fmt(e.p_value)} vs {e.best})"
            for e in self.eliminations
        }


@dataclass
class ExperimentResult:
    """Every run of an experiment, grouped by arm."""

    name: str
    arms: list[ArmResult]
    seconds: float = 0.0
    error: str | None = None
    callback_errors: list[dict[str, Any]] = field(default_factory=list)
    planned: int | None = None  # the runs the experiment holds; more than `runs` if interrupted
    #: What the experiment declares about its summary: metric, mode, bounds (`Experiment`).
    declared: Declaration = field(default_factory=Declaration)
    #: The race over its arms, when it runs one (``Experiment(race=...)``).
    race: RaceResult | None = None

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ExperimentResult:
        """An experiment as the store records it (`Store.get_experiment`: its arms, its
        runs with their statuses and final metrics, its config), as a result: ``lab show``
        summarizes it with the code that summarizes an experiment run in Python. A run
        still running keeps that status, so it counts in no statistic."""
        arms = {a["name"]: ArmResult(a["name"], dict(a.get("overrides") or {}))
                for a in record.get("arms", [])}  # fmt: skip
        for r in record.get("runs", []):
            arm = arms.setdefault(r["arm"], ArmResult(r["arm"], {}))
            run = RunResult(
                r["run_key"], r["arm"], r["repeat"], r["stage"], r["seed"], r["status"],
                dict(r.get("summary") or {}), seconds=0.0, error=r.get("error"),
            )  # fmt: skip
            arm.runs.append(run)
        declared = declaration(record.get("config"))
        return cls(record["name"], list(arms.values()), declared=declared)

    @property
    def runs(self) -> list[RunResult]:
        """All runs, in the order they ran."""
        return [r for arm in self.arms for r in arm.runs]

    @property
    def status(self) -> Literal["completed", "failed"]:
        """`failed` if it was interrupted or any run failed, else `completed`."""
        if self.error is not None or any(r.status in FAILED for r in self.runs):
            return "failed"
        return "completed"

    def summary(
        self,
        metric: str | None = None,
        mode: Literal["min", "max"] | None = None,
        *,
        keys: Sequence[str] | None = None,
        all_metrics: bool = False,
        interval: Interval = "t",
        bounds: Mapping[str, tuple[float, float]] | None = None,
    ) -> Summary:
        """Per arm: mean, std, n and 95% CI of every final metric; the best arm by `metric`.

        `metric` defaults to the experiment's (``Experiment(metric=...)``), else the first of
        ``val/loss`` and ``loss`` the runs logged; `mode` to the experiment's for its metric,
        else ``"min"``. `keys` limits the rows to some metrics. The runs that count are the
        completed and stopped ones of each arm's last stage, and a run's final value of a
        metric is the last value it logged (`lab._ranking`): the same numbers as
        `lab.inspect.summary`, ``lab show`` and the dashboard. When some of those runs lack
        the metric, no arm is ranked and the text says which runs lack it. The text leaves
        out routine metrics (``lr``, ``step_time``, monitors' internals) unless
        `all_metrics`; `rows` holds them all. After an interrupt (`error` set), only the arms
        whose runs all finished are ranked. `interval` is ``"t"`` (Student's t) or
        ``"bootstrap"`` (percentile bootstrap over repeats: it stays inside the values'
        range). `bounds` declares metrics' known ranges, e.g. ``{"holdout/acc": (0, 1)}``
        (added to those the experiment declares): their intervals are clipped to them.
        The arms a race eliminated are marked, and the best arm is chosen among the others.
        """
        if mode is not None:
            check_mode(mode)
        check_interval(interval)
        given = check_bounds_map(bounds)
        arm_runs = self._counted()
        known = sorted({k for runs in arm_runs.values() for r in runs for k in r.metrics})
        named = ([metric] if metric is not None else []) + list(keys or []) + list(given)
        for name in named:
            if name not in known:
                raise ConfigError(
                    f"no run has a final metric {name!r}; known: {', '.join(known) or 'none'}"
                )
        chosen, mode = choose(metric, mode, self.declared, known)
        shown = list(keys) if keys is not None else known
        interrupted = self.error is not None
        unfinished = [arm.name for arm in self.arms if interrupted and not arm.finished]
        rows = [
            self._row(arm.name, arm_runs[arm.name], key, interval, given.get(key))
            for arm in self.arms
            for key in shown
        ]
        ranking, unranked = None, None
        if chosen is not None:
            ranking, unranked = self._ranking(arm_runs, chosen, mode, unfinished)
        by_status = dict(collections.Counter[str](r.status for r in self.runs))
        return Summary(
            self.name, rows, chosen, mode, ranking.best if ranking else None,
            ranking.runner_up if ranking else None, ranking.margin if ranking else None,
            len(self.runs), by_status, planned=self.planned, interrupted=interrupted,
            unfinished_arms=unfinished, all_metrics=all_metrics,
            shown_metrics=list(keys) if keys is not None else None, interval=interval,
            unranked=unranked, eliminated=self.race.why() if self.race is not None else {},
        )  # fmt: skip

    def _row(
        self,
        arm: str,
        runs: list[RunResult],
        key: str,
        interval: Interval,
        given: tuple[float, float] | None,
    ) -> SummaryRow:
        """One arm's spread of the final `key` over its counted `runs`."""
        s = spread(
            [r.metrics[key] for r in runs if key in r.metrics], interval=interval,
            bounds=bounds_for(key, given, self.declared), metric=key,
        )  # fmt: skip
        return SummaryRow(arm, key, s.n, s.mean, s.std, s.ci_low, s.ci_high)

    def _ranking(
        self,
        arm_runs: dict[str, list[RunResult]],
        chosen: str,
        mode: Literal["min", "max"],
        unfinished: list[str],
    ) -> tuple[Ranking, str | None]:
        """The arms ranked by `chosen` (only those whose runs all finished, after an
        interrupt), and the text that says which runs lack it, if any do."""
        values = {a: [r.metrics[chosen] for r in rs if chosen in r.metrics]
                  for a, rs in arm_runs.items()}  # fmt: skip
        lacking = [r.run_key for rs in arm_runs.values() for r in rs if chosen not in r.metrics]
        out = self.race.eliminated() if self.race is not None else {}  # lost: never ranked
        rankable = [a for a in arm_runs if a not in unfinished and a not in out]
        if unfinished and len(rankable) < 2:
            rankable = []  # one finished arm is no winner: there was nothing to beat
        ranking = rank_arms(values, mode, ranked=rankable, lacking=bool(lacking))
        unranked = None
        if lacking:
            total = sum(len(rs) for rs in arm_runs.values())
            unranked = lacking_text(chosen, lacking, total, self.name)
        return ranking, unranked

    def _counted(self) -> dict[str, list[RunResult]]:
        """Each arm's runs that count in a summary (`lab._ranking.counted`), in arm order."""
        runs = [(arm.name, r) for arm in self.arms for r in arm.runs]
        keep = counted([(name, r.stage, r.status) for name, r in runs])
        out: dict[str, list[RunResult]] = {arm.name: [] for arm in self.arms}
        for (name, run), ok in zip(runs, keep, strict=True):
            if ok:
                out[name].append(run)
        return out


TrainFn = Callable[[RunSpec], "LoopArtifacts | dict[str, float] | None"]


# -- the loop's records --------------------------------------------------------------------


@dataclass
class EvalResult:
    """One scored evaluation: metrics, per-slice breakdowns, tags, and its predictions.

    `breakdowns` holds metrics per slice of the data (``{"large": {"acc": 0.5}}``), so a
    reader sees where a model fails, not only how often. `predictions` holds one dict per
    example (keys ``example_id``, ``input``, ``output``, ``target``, ``score``; any other
    key goes to the row's extras). `step` is the optimizer step it scored (None: after
    training), `seconds` its wall time, and `error` the reason it failed, if it did.
    """

    name: str
    metrics: dict[str, float]
    breakdowns: dict[str, dict[str, float]] = field(default_factory=dict)
    tags: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    seconds: float = 0.0
    predictions: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    @property
    def benchmark(self) -> bool:
        """Whether it carries more than metrics (breakdowns, tags or predictions): the loop
        then fires `on_benchmark_eval` with it, after `on_eval`, so sinks get the payload."""
        return bool(self.predictions or self.breakdowns or self.tags)


Kind = Literal["regular", "ephemeral", "fixed"]


@dataclass(frozen=True)
class ManifestRow:
    """One line of `manifest.jsonl`: a save or a removal of one checkpoint.

    `kind` is how the checkpoint is kept ("regular", "ephemeral" or "fixed"); a removal row
    repeats the kind of the checkpoint it removed and names in `reason` the rules that no
    longer keep it.
    """

    run_key: str
    step: int
    path: str
    event: Literal["save", "remove"]
    time: float
    metrics: dict[str, float] = field(default_factory=dict)
    reason: str | None = None
    kind: Kind = "regular"

    def to_json(self) -> str:
        """The manifest line (NaN and inf written as JSON's NaN/Infinity)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> ManifestRow:
        """Parse one manifest line."""
        return cls(**json.loads(line))


class TrainingBatch:
    """The batch of the current step, as hooks see it: the data and where it came from.

    The loop reuses one instance for every step, so a hook that wants to keep a batch
    must copy `data`.
    """

    __slots__ = ("data", "epoch", "index")

    def __init__(self) -> None:
        self.data: Any = None
        self.epoch = 0
        self.index = 0

    @property
    def size(self) -> int | None:
        """Samples in the batch: the first dimension of its first tensor that has one (a
        0-dim ``num_tokens`` tensor beside the inputs is not a batch), else None."""
        tensor = _first_tensor(self.data)
        return None if tensor is None else int(tensor.shape[0])


@dataclass
class LoopArtifacts:
    """What a fit leaves behind: the model, its final metrics and where it stopped."""

    model: torch.nn.Module
    metrics: dict[str, float]
    step: int
    stopped: bool = False
    stop_reason: str | None = None
    checkpoint_dir: Path | None = None
    checkpoints: list[ManifestRow] = field(default_factory=list)
    evals: list[EvalResult] = field(default_factory=list)
    #: Where a pruning rule stopped the fit (`LoopState.request_stop(pruned=...)`), else None.
    pruned: dict[str, Any] | None = None

    @property
    def status(self) -> RunStatus:
        """How the fit ended, as its run is recorded: `pruned` when a pruning rule stopped
        it, `stopped` when a callback did, else `completed`."""
        if self.stopped and self.pruned is not None:
            return "pruned"
        return "stopped" if self.stopped else "completed"


def _first_tensor(data: Any) -> torch.Tensor | None:
    """The first tensor in `data` (nested dicts, lists, tuples) that has a dimension."""
    if hasattr(data, "dim") and hasattr(data, "shape"):
        return data if data.dim() > 0 else None
    values = data.values() if isinstance(data, dict) else data
    if isinstance(values, (list, tuple)) or isinstance(data, dict):
        for v in values:
            found = _first_tensor(v)
            if found is not None:
                return found
    return None
