"""`Prune`: stop a run early when its intermediate `metric` says it will not be among the best.

``Experiment(prune=Prune("val/loss", mode="min", rule="median"))`` gives every run a callback
(`PruneCallback`, built in the run's own process, a worker's too) that, each time the run logs
`metric` (a step's metric, or an in-loop eval's ``<eval>/<key>``), reads the points the
experiment's other runs have in the store (`metric_points`, through the store contract: SQL
or ``lab serve``) and asks an Optuna pruner whether to stop. Nothing is read at the steps that
do not log `metric`.

The pruner is rebuilt for each decision, in memory (`should_prune`): every current run of the
experiment is an Optuna trial, numbered in the order the runs were claimed (their run id), so
a run's trial number, and with it its Hyperband bracket, never changes. A finished run
(completed or stopped) is a COMPLETE trial, a pruned run PRUNED, a failed or crashed one FAIL,
a running one RUNNING; each holds its points as intermediate values. The successive-halving
rung records that a live Optuna study keeps in each trial (``completed_rung_<k>``: the value at
the first step reported at or past the rung's step) are computed from the points as Optuna
defines them, so the decision is the one a single live study would take at that moment.

A pruned run stops through `LoopState.request_stop(pruned=...)`, after the step that logged
the value, and is recorded `pruned` with ``{"step", "rule", "metric", "value"}``.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from lab._imports import require
from lab.errors import ConfigError
from lab.hooks import Callback, Phase

if TYPE_CHECKING:
    from lab.hooks import LoopState
    from lab.records import RunSpec, TrainingBatch

__all__ = ["RULES", "Prune", "PruneCallback", "RunPoints", "pruning", "should_prune"]

#: The pruning rules by name: Optuna's `MedianPruner`, `SuccessiveHalvingPruner` and
#: `HyperbandPruner`.
RULES: dict[str, str] = {
    "median": "MedianPruner",
    "halving": "SuccessiveHalvingPruner",
    "hyperband": "HyperbandPruner",
}

#: How a run's status reads as an Optuna trial state.
_STATES = {
    "completed": "COMPLETE",
    "stopped": "COMPLETE",
    "pruned": "PRUNED",
    "failed": "FAIL",
    "crashed": "FAIL",
    "running": "RUNNING",
}


class Prune:
    """Stop runs early on an intermediate `metric`, better when lower (``mode="min"``) or
    higher (``"max"``), by `rule`: ``"median"``, ``"halving"`` (successive halving),
    ``"hyperband"``, or an Optuna pruner instance. `options` go to the Optuna pruner as they
    are (``n_startup_trials``, ``n_warmup_steps``, ``min_resource``, ``reduction_factor``...).

    Why a rule object and not a callback: the experiment builds the callback per run, in the
    run's own process (`factory`), so it works under every executor.
    """

    def __init__(
        self,
        metric: str,
        mode: Literal["min", "max"] = "min",
        rule: Any = "median",
        **options: Any,
    ) -> None:
        if not isinstance(metric, str) or not metric:
            raise ConfigError(
                f"Prune(metric={metric!r}): name the metric runs are compared on, e.g. "
                "Prune('val/loss')"
            )
        if mode not in ("min", "max"):
            raise ConfigError(f"Prune(mode={mode!r}): use 'min' or 'max'")
        if isinstance(rule, str):
            if rule not in RULES:
                raise ConfigError(
                    f"Prune(rule={rule!r}): write one of {', '.join(RULES)}, or pass an Optuna "
                    "pruner"
                )
            require("optuna", "sweeps", f"Prune(rule={rule!r})")
        else:
            require("optuna", "sweeps", f"Prune(rule={type(rule).__name__})")
            import optuna

            if not isinstance(rule, optuna.pruners.BasePruner):
                raise ConfigError(
                    f"Prune(rule={rule!r}): pass 'median', 'halving', 'hyperband' or an Optuna "
                    "pruner such as optuna.pruners.MedianPruner()"
                )
            if options:
                raise ConfigError(
                    f"Prune(rule={type(rule).__name__}(...), {', '.join(options)}=...): give "
                    "the options to the Optuna pruner itself"
                )
        if rule == "hyperband" and "max_resource" not in options:
            raise ConfigError(
                "Prune(rule='hyperband') needs max_resource: the last step a run logs the "
                "metric at, e.g. Prune('val/loss', rule='hyperband', max_resource=100)"
            )
        if rule == "halving":  # rungs from the first step on, as a rebuilt study can know
            options = {"min_resource": 1, **options}
        self.metric, self.mode, self.rule, self.options = metric, mode, rule, dict(options)
        self.pruner()  # a bad option fails here, in one line, not in a run

    @property
    def rule_name(self) -> str:
        """The rule as a run's `pruned` record names it: the name given, or the Optuna
        pruner's class."""
        return self.rule if isinstance(self.rule, str) else type(self.rule).__name__

    def pruner(self) -> Any:
        """A fresh Optuna pruner for one decision (a pruner keeps state between calls, which
        a decision rebuilt from the store must not inherit)."""
        import optuna

        if not isinstance(self.rule, str):
            return copy.deepcopy(self.rule)
        cls = getattr(optuna.pruners, RULES[self.rule])
        try:
            return cls(**self.options)
        except (TypeError, ValueError) as exc:
            why = str(exc).replace(f"{cls.__name__}.__init__() ", "")
            raise ConfigError(
                f"Prune(rule={self.rule!r}, {_options(self.options)}): {why}"
            ) from None

    def factory(self, run: RunSpec) -> PruneCallback:
        """The run's pruning callback (an `Experiment`'s run-callback factory)."""
        return PruneCallback(self, run)

    def __repr__(self) -> str:
        rule = repr(self.rule) if isinstance(self.rule, str) else self.rule_name + "(...)"
        extra = f", {_options(self.options)}" if self.options else ""
        return f"Prune({self.metric!r}, mode={self.mode!r}, rule={rule}{extra})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Prune) and (
            (self.metric, self.mode, self.rule_name, self.options)
            == (other.metric, other.mode, other.rule_name, other.options)
        )

    __hash__ = None  # type: ignore[assignment]  # options may hold lists


def _options(options: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in options.items())


@dataclass(frozen=True)
class RunPoints:
    """One run as the pruner sees it: its key, its status, and its (step, value) points of
    the metric in step order."""

    key: str
    status: str
    points: Sequence[tuple[int, float]]


def should_prune(prune: Prune, study: str, runs: Sequence[RunPoints], current: str) -> bool:
    """Whether Optuna's pruner stops the run `current` at its last point, given every run of
    the experiment `study` in claim order (`current` among them, running).

    The decision of one live Optuna study in which each run reported each of its points and
    asked ``should_prune`` there: the other runs' trials as they stand now, the current
    one's rung records those of its earlier points.
    """
    import optuna
    from optuna.trial import TrialState, create_trial

    from lab.sweeps.samplers import _quiet

    pruner = prune.pruner()
    direction = (
        optuna.study.StudyDirection.MINIMIZE
        if prune.mode == "min"
        else optuna.study.StudyDirection.MAXIMIZE
    )
    trials = [
        create_trial(
            state=TrialState[_STATES.get(run.status, "FAIL")],
            value=_final(run.points) if _STATES.get(run.status) == "COMPLETE" else None,
            intermediate_values=dict(run.points),
        )
        for run in runs
    ]
    for number, trial in enumerate(trials):
        trial.number = number
    index = next(i for i, run in enumerate(runs) if run.key == current)
    rungs = _rungs_of(pruner, study, trials, index)
    with _quiet():
        storage = optuna.storages.InMemoryStorage()
        storage.create_new_study([direction], study)
        live = optuna.Study(
            study_name=study, storage=storage, pruner=pruner,
            sampler=optuna.samplers.RandomSampler(seed=0),
        )  # fmt: skip
        for trial, attrs in zip(trials, rungs, strict=True):
            trial.system_attrs = attrs
            live.add_trial(trial)
        return bool(pruner.prune(live, live.get_trials(deepcopy=False)[index]))


def _final(points: Sequence[tuple[int, float]]) -> float:
    """A complete trial's value: its last point when finite (no pruner here reads it)."""
    value = points[-1][1] if points else 0.0
    return value if math.isfinite(value) else 0.0


def _rungs_of(pruner: Any, study: str, trials: list[Any], current: int) -> list[dict[str, float]]:
    """Each trial's successive-halving rung records (``completed_rung_<k>``), as a live
    study would hold them now: for `current`, those of its points before the last."""
    import optuna

    halving = optuna.pruners.SuccessiveHalvingPruner
    if isinstance(pruner, halving):
        if pruner._min_resource is None:  # "auto": estimated from the complete trials
            from optuna.pruners._successive_halving import _estimate_min_resource

            pruner._min_resource = _estimate_min_resource(trials)
        brackets: list[Any] = [pruner] * len(trials)
    elif isinstance(pruner, optuna.pruners.HyperbandPruner):
        view: Any = _Trials(study, trials)  # the part of a Study that Hyperband reads
        pruner._try_initialization(view)
        brackets = [pruner._pruners[pruner._get_bracket_id(view, t)] if pruner._pruners
                    else None for t in trials]  # fmt: skip
    else:
        return [{} for _ in trials]
    out = []
    for i, (trial, bracket) in enumerate(zip(trials, brackets, strict=True)):
        points = sorted(trial.intermediate_values.items())
        if i == current:
            points = points[:-1]
        out.append(_rungs(bracket, points))
    return out


def _rungs(halving: Any, points: Iterable[tuple[int, float]]) -> dict[str, float]:
    """The rung records successive halving leaves in a trial that reported `points` and was
    promoted at each rung it passed: rung k holds the value at the first step at or past
    ``min_resource * reduction_factor ** (min_early_stopping_rate + k)``."""
    if halving is None or halving._min_resource is None:
        return {}
    base, eta = halving._min_resource, halving._reduction_factor
    rate = halving._min_early_stopping_rate
    records: dict[str, float] = {}
    rung = 0
    for step, value in points:
        while step >= base * eta ** (rate + rung):
            if math.isnan(value):
                return records  # Optuna prunes there, before recording
            records[f"completed_rung_{rung}"] = value
            rung += 1
    return records


class _Trials:
    """What Hyperband reads of a study to size its brackets and place a trial in one."""

    def __init__(self, name: str, trials: list[Any]) -> None:
        self.study_name, self._trials = name, trials

    def get_trials(self, deepcopy: bool = True, states: Any = None) -> list[Any]:
        return [t for t in self._trials if states is None or t.state in states]


def pruning(prune: Any, store: Any) -> list[Any]:
    """The run-callback factories of ``Experiment(prune=prune, store=store)``: none without
    `prune`, else its callback's, once `prune` is checked (a `Prune`, and a store to read the
    other runs from), in one line each. Why a factory: the callback is built per run, in the
    run's own process (a worker's too)."""
    if prune is None:
        return []
    if not isinstance(prune, Prune):
        raise ConfigError(
            f"prune={prune!r}: use prune=Prune('val/loss', mode='min', rule='median')"
        )
    if store is False:
        raise ConfigError(
            f"prune={prune!r} with store=False: a pruning rule compares each run with the "
            "others recorded in the store; give the experiment a store"
        )
    return [prune.factory]


class PruneCallback(Callback):
    """One run's pruning: at each step or in-loop eval that logs the rule's metric, the
    other runs' points are read from the store and the rule decides (`should_prune`); a
    pruned run stops after that step and ends `pruned`.

    Built per run by `Prune.factory`, in the run's process. It reads through the store the
    run records into (the experiment's store sink, opened there), so a SQL store and a
    ``lab serve`` URL alike. Under DDP, rank 0 decides and every rank follows.
    `checks` and `seconds` count the decisions taken and the time they took.
    """

    phase = Phase.ACT

    def __init__(self, prune: Prune, run: RunSpec) -> None:
        self.prune = prune
        self.experiment, self.run_key = run.experiment, run.run_key
        self.metrics_needed = {prune.metric: f"Prune({prune.metric!r})"}
        self._dispatcher = run.dispatcher
        self._own: dict[int, float] = {}  # this fit's points, ahead of what is durable
        self.checks, self.seconds = 0, 0.0

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        value = metrics.get(self.prune.metric)
        if value is not None:
            self._check(state, step_idx, value)

    def on_eval(
        self, state: LoopState, step_idx: int, eval_name: str, metrics: dict[str, float]
    ) -> None:
        metric = self.prune.metric
        if metric.startswith(eval_name + "/"):
            value = metrics.get(metric[len(eval_name) + 1 :])
            if value is not None:
                self._check(state, step_idx, value)

    def _check(self, state: LoopState, step: int, value: float) -> None:
        if state.pruned is not None:
            return  # decided: the steps held until the stop (log_every) are not judged
        self._own[step] = float(value)
        started = time.perf_counter()
        prune = False
        if state.rank == 0:
            prune = should_prune(self.prune, self.experiment, self._runs(), self.run_key)
        if state.world_size > 1:
            from lab._distributed import broadcast

            prune = broadcast(prune)
        self.checks += 1
        self.seconds += time.perf_counter() - started
        if prune:
            rule, metric = self.prune.rule_name, self.prune.metric
            state.request_stop(
                f"pruned by the {rule} rule on {metric} = {value:g} at step {step}",
                pruned={"step": step, "rule": rule, "metric": metric, "value": float(value)},
            )

    def _runs(self) -> list[RunPoints]:
        """Every current run of the experiment in claim order, with its points; this run's
        own points completed with those of this fit not yet durable."""
        store = self._store()
        points = store.metric_points(self.experiment, self.prune.metric)
        runs = []
        for row in store.current_runs(self.experiment):
            key = row["run_key"]
            mine = points.get(key, [])
            if key == self.run_key:
                mine = sorted({**dict(mine), **self._own}.items())
                runs.append(RunPoints(key, "running", mine))
            else:
                runs.append(RunPoints(key, row["status"], mine))
        if not any(run.key == self.run_key for run in runs):  # not recorded yet
            runs.append(RunPoints(self.run_key, "running", sorted(self._own.items())))
        return runs

    def _store(self) -> Any:
        """The store the run records into: its store sink's, opened in this process."""
        from lab.sinks import StoreSink

        for cb in self._dispatcher.callbacks:
            if isinstance(cb, StoreSink):
                return cb.open()
        raise ConfigError(
            f"Prune({self.prune.metric!r}) compares a run with the others in the store, and "
            f"run {self.run_key} records into none; give the experiment a store"
        )
