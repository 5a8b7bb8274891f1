"""An experiment's sampled arms (``Experiment(sweep=Sweep(...))``), asked and told.

The sweep's sampler is asked for arms in batches: `Sweep.batch` at a time, else as many as
there are free workers (one in a serial experiment, so a model-based sampler learns from
every arm before it asks the next), whenever a worker would otherwise wait, until the sweep
has its arms (a grid: all of its points). Each asked arm is recorded as its trial before it
runs; once all of an arm's runs have ended, its trial is told the arm's value: the mean of
the sweep's metric over its counted runs (`complete`), the last value of a pruned run
(`pruned`), or none (`failed`). With a race, every arm is asked up front, and the trials are
told the arms' means when the race ends.

A sweep run again continues from its recorded trials: the sampler is rebuilt from them (see
`lab.sweeps.samplers` for why that asks what the uninterrupted sweep would have), the arms
asked before come back under their names and parameters (their finished runs are reused,
the others train), and only the arms still missing are asked. A recorded sweep whose space,
sampler or seed differ from the one given is refused (`changed`).

The experiment (`lab.experiment.Experiment`) adds the arms, turns them into the scheduler's
chains and records the trials through its store sink (`lab.sinks.SweepSink`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from lab._ranking import COUNTED_STATUSES
from lab._secrets import logger
from lab.errors import ConfigError
from lab.sinks import SweepSink

if TYPE_CHECKING:
    from lab._race_rounds import RaceRounds
    from lab.hooks import LogContext
    from lab.records import RunResult
    from lab.sweeps.samplers import Trial
    from lab.sweeps.sweep import Sweep

log = logger("lab.experiment")  # the sweep's messages are its experiment's

#: What a sweep's recorded config must keep for its trials to stand (`changed`).
KEPT = ("space", "sampler", "seed")


def sweep_args(sweep: Any, arms: Any, metric: str | None, mode: Any) -> tuple[Any, Any]:
    """The experiment's `metric` and `mode` with a sweep (the sweep's, where the experiment
    names none); a sweep that is not a `Sweep`, one beside written-out arms, or one whose
    metric nothing names is refused in one line."""
    if sweep is None:
        return metric, mode
    from lab.sweeps.sweep import Sweep

    if not isinstance(sweep, Sweep):
        raise ConfigError(f"sweep={sweep!r}: use sweep=Sweep(space, sampler='random', arms=16)")
    if arms:
        raise ConfigError(
            "arms and sweep given: a sweep's arms are sampled from its space; drop arms, or "
            "make each a Choice of the space"
        )
    if sweep.metric is None and metric is None:
        raise ConfigError(
            "a sweep needs the metric its arms are judged by: Sweep(..., metric='val/loss'), "
            "or Experiment(metric=...)"
        )
    if metric is None:
        metric, mode = sweep.metric, mode if mode is not None else sweep.mode
    return metric, mode


def sweep_config(sweep: Sweep) -> dict[str, Any]:
    """The sweep as the experiment's config records it (what the doors show, and what a
    rerun compares with): its space in the file form, its sampler's name, arms, seed,
    batch, metric and mode."""
    sampler = sweep.sampler if isinstance(sweep.sampler, str) else type(sweep.sampler).__name__
    return {
        "space": {key: _param_data(param) for key, param in sweep.space.items()},
        "sampler": sampler,
        "arms": sweep.arms,
        "seed": sweep.seed,
        "batch": sweep.batch,
        "metric": sweep.metric,
        "mode": sweep.mode,
    }


def _param_data(param: Any) -> dict[str, Any]:
    """A parameter in the file form (``{float: [1e-4, 0.1], log: true}``)."""
    from lab.sweeps.space import Choice

    if isinstance(param, Choice):
        data: dict[str, Any] = {"choice": list(param.values)}
    else:
        data = {type(param).__name__.lower(): [param.low, param.high]}
        if param.log:
            data["log"] = True
    if param.when:
        data["when"] = {key: list(values) for key, values in param.when.items()}
    return data


def changed(experiment: str, recorded: Mapping[str, Any] | None, now: Mapping[str, Any]) -> None:
    """Refuse, in one line, to continue a recorded sweep whose space, sampler or seed differ
    from `now` (its trials were asked by another sampler): they would not be its trials."""
    if recorded is None:
        return
    diffs = [
        f"{key}: {json.dumps(recorded.get(key))} -> {json.dumps(now[key])}"
        for key in KEPT
        if recorded.get(key) != now[key]
    ]
    if diffs:
        raise ConfigError(
            f"experiment {experiment!r} recorded a sweep with another {', '.join(KEPT[:2])} or "
            f"seed ({'; '.join(diffs)}); its trials were asked by that sweep: use a new "
            "experiment name, or start afresh with fresh=True (--fresh on the command line)"
        )


def trial(record: Mapping[str, Any]) -> Trial:
    """A recorded trial (a `lab.store.records.TrialRecord`) as its sampler knows it."""
    from lab.sweeps.samplers import Trial

    return Trial(
        record["number"], dict(record["params"]), record["asked_after"], record["told"],
        record["value"], record["state"],
        {int(step): value for step, value in record["intermediate"].items()},
    )  # fmt: skip


class SweepArms:
    """The sweep's trials (`trials`: those recorded before, then those asked here), what to
    ask next (`ask`), and each trial's tell once its arm's runs have ended (`ended`)."""

    def __init__(
        self,
        sweep: Sweep,
        mode: Literal["min", "max"] | None,
        metric: str,
        workers: int,
        recorded: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        self.sweep, self.metric = sweep, metric
        self.sampler = sweep.make_sampler(mode)
        self.trials: list[Trial] = [trial(record) for record in recorded]
        self.arms = [sweep.arm_name(t.number, t.params) for t in self.trials]
        self.total = sweep_size(sweep)
        self.workers = workers  # how many runs go at once
        self.repeats = 1  # each arm's runs (the experiment's repeats): set by the experiment
        self.runs: dict[str, list[RunResult]] = {}  # each arm's runs that ended, here
        self.recorded = len(self.trials)  # the trials the store holds (the first ones)
        self.tells = sum(1 for t in self.trials if t.told is not None)

    def outstanding(self) -> int:
        """The runs of asked arms that have not ended yet (their trials untold)."""
        return sum(
            max(self.repeats - len(self.runs.get(arm, ())), 0)
            for arm, t in zip(self.arms, self.trials, strict=True)
            if t.told is None
        )

    def ask(self, everything: bool = False) -> list[Trial]:
        """The trials to ask now: `Sweep.batch` of them, else one per free worker, when a
        worker would be free (`everything`: all still missing, for a race), never past the
        sweep's arms. Each is asked after the tells so far."""
        from lab.sweeps.samplers import Trial

        left = self.total - len(self.trials)
        free = self.workers - self.outstanding()
        if left <= 0 or (not everything and free <= 0):
            return []
        n = left if everything else min(left, self.sweep.batch or free)
        asked = [
            Trial(len(self.trials) + i, params, asked_after=self.tells)
            for i, params in enumerate(self.sampler.ask(self.trials, n))
        ]
        self.trials += asked
        self.arms += [self.sweep.arm_name(t.number, t.params) for t in asked]
        return asked

    def arm(self, number: int) -> str:
        """Trial `number`'s arm."""
        return self.arms[number]

    def ended(self, run: RunResult, tell: bool = True) -> list[Trial]:
        """Note a run of a sampled arm that ended; with `tell`, once it was the arm's last,
        tell its trial (returned, told; [] otherwise)."""
        if run.arm not in self.arms:
            return []
        self.runs.setdefault(run.arm, []).append(run)
        number = self.arms.index(run.arm)
        if not tell or len(self.runs[run.arm]) < self.repeats:
            return []
        return self.tell([number])

    def tell(self, numbers: Sequence[int]) -> list[Trial]:
        """Tell the untold trials among `numbers`, in that order: each its arm's value."""
        told = []
        for number in numbers:
            t = self.trials[number]
            if t.told is not None:
                continue  # told before (by an earlier attempt): a trial is told once
            value, state, intermediate = self.value(self.runs.get(self.arms[number], []))
            t = replace(t, told=self.tells, value=value, state=state, intermediate=intermediate)
            self.trials[number] = t
            self.tells += 1
            told.append(t)
        return told

    def value(self, runs: Sequence[RunResult]) -> tuple[float | None, Any, dict[int, float]]:
        """An arm's value, state and intermediate values: the mean of the metric over its
        counted runs; else a pruned run's last value; else none (failed)."""
        counted = [
            float(r.metrics[self.metric])
            for r in runs
            if r.status in COUNTED_STATUSES
            and isinstance(r.metrics.get(self.metric), int | float)
            and math.isfinite(r.metrics[self.metric])
        ]
        if counted:
            return sum(counted) / len(counted), "complete", {}
        stops = [r.pruned for r in runs if r.status == "pruned" and r.pruned]
        if stops and stops[-1].get("value") is not None:
            step, last = int(stops[-1].get("step", 0)), float(stops[-1]["value"])
            return last, "pruned", {step: last}
        return None, "failed", {}


def sweep_size(sweep: Sweep) -> int:
    """How many arms the sweep asks in all: its `arms`, or for a grid, the grid's points."""
    from lab.sweeps.samplers import grid_size

    return grid_size(dict(sweep.space)) if sweep.sampler == "grid" else sweep.arms


def start_sweep(exp: Any, arm: Callable[..., Any]) -> SweepArms | None:
    """An experiment's sweep as its run starts (None without one): the sampler rebuilt from
    the trials its store sink recorded before (a recorded sweep with another space, sampler
    or seed is refused, unless `fresh`), their arms back as the experiment's arms, and the
    first arms asked (with a race: all of them), each made by `arm` (`lab.Arm`). Called
    once the store is open, before the reuse check, so the sampled arms' recorded runs are
    checked as declared ones are."""
    if exp.sweep is None:
        return None
    sink = exp._sink if isinstance(exp._sink, SweepSink) else None
    if sink is not None and not exp.fresh:
        changed(exp.name, sink.recorded_sweep(exp.name), sweep_config(exp.sweep))
    recorded = sink.trials(exp.name) if sink is not None else []
    # one worker in this process; under Ray without `workers`, this machine's CPUs a batch
    workers = 1 if exp.executor == "serial" else exp.workers or os.cpu_count() or 1
    metric = exp.sweep.metric or exp.declared.metric
    sweep = SweepArms(exp.sweep, exp.declared.mode, metric, workers, recorded)
    sweep.repeats = exp.repeats
    sweep.ask(everything=exp.race is not None)
    exp.arms = []
    for t in sweep.trials:
        exp._add_arm(None, arm(sweep.arm(t.number), **t.params))
    return sweep


def record_trials(sweep: SweepArms | None, ctx: LogContext, sink: Any) -> None:
    """Record the sweep's trials asked since the last call through the store `sink` (a
    `SweepSink`), before their arms run: a sweep run again reruns them as they were."""
    if sweep is None or not isinstance(sink, SweepSink):
        return
    for t in sweep.trials[sweep.recorded :]:
        sink.record_trial(ctx, t, sweep.arm(t.number))
    sweep.recorded = len(sweep.trials)


def sweep_more(
    sweep: SweepArms | None, ctx: LogContext, run: RunResult, sink: Any, rounds: RaceRounds | None
) -> list[tuple[str, dict[str, Any]]]:
    """What a sweep does once `run` ended: tell the trials whose arms are done through the
    store `sink` (with a race: every trial, once the race is over), then ask the arms a free
    worker can take now (with a race: none, it asked them all). Returns the new arms, by
    name and parameters, for the experiment to add (and `record_trials` to record)."""
    if sweep is None:
        return []
    told = sweep.ended(run, tell=rounds is None)
    if rounds is not None and rounds.result.over:
        told = sweep.tell(range(len(sweep.trials)))
    for t in told:
        log.info("arm %s told %s (%s)", sweep.arm(t.number), t.value, t.state)
        if isinstance(sink, SweepSink):
            sink.tell_trial(ctx, t)
    if rounds is not None:
        return []
    return [(sweep.arm(t.number), dict(t.params)) for t in sweep.ask()]


def unasked(sweep: SweepArms | None) -> int:
    """The runs of the arms a sweep has still to ask (0 without a sweep)."""
    return 0 if sweep is None else (sweep.total - len(sweep.trials)) * sweep.repeats
