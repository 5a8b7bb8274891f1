"""Which runs count, which metric ranks the arms, and which arm is best: the one definition
that every door uses (`ExperimentResult.summary`, `lab.inspect.summary`, ``lab show`` and
the dashboard).

- A run's final value of a metric is the last value it logged of that key: the value at the
  key's last step, NaN kept as data. A run's handle keeps it in Python (a key its last step
  left out keeps the value it logged before); the store keeps it in `summaries.last_value`.
- The runs that count are the completed and stopped ones of each arm's last stage (the
  highest stage any run of the arm has, whatever its status); failed, crashed and running
  runs are left out.
- Arms rank by the mean of their counted runs' final values (`rank_arms`): lowest first
  (mode ``min``) or highest (``max``), ties in arm order, an arm with no value or a NaN mean
  unranked; when some counted run lacks the metric, no arm is ranked (`lacking_text` says
  which runs lack it), since a mean over the runs that happen to have it would compare
  different sets of repeats.
- The metric, its mode and the metrics' known ranges (`bounds`) are those the caller names,
  else those the experiment declares (``Experiment(metric=..., mode=..., bounds=...)``,
  recorded in its config under ``summary``), else the first of `RANKED_BY` its runs logged,
  lower being better (`choose`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

from lab._stats import Interval, Spread, check_bounds, spread
from lab._table import plural
from lab.errors import ConfigError

#: The statuses of the runs that count in a summary.
COUNTED_STATUSES: tuple[str, ...] = ("completed", "stopped")
#: The metrics the arms are ranked by when neither the caller nor the experiment names one,
#: in order of preference (lower is better): the validation loss, else the training loss.
RANKED_BY: tuple[str, ...] = ("val/loss", "loss")
#: The key of the experiment's config that holds what it declares (`declaration`).
SUMMARY_KEY = "summary"

Mode = Literal["min", "max"]
Bounds = dict[str, tuple[float, float]]
A = TypeVar("A", bound=Hashable)


def check_mode(mode: Any) -> Mode:
    """`mode` if it is ``"min"`` or ``"max"``, else a `ConfigError` that says so."""
    if mode not in ("min", "max"):
        raise ConfigError(f"mode={mode!r}: use 'min' or 'max'")
    return cast(Mode, mode)


def check_bounds_map(bounds: Any) -> Bounds:
    """A mapping of metric names to ``(low, high)`` as checked floats; None is empty."""
    if bounds is None:
        return {}
    if not isinstance(bounds, Mapping):
        raise ConfigError(
            f"bounds={bounds!r}: give a dict of metric ranges, e.g. "
            "bounds={'holdout/acc': (0, 1)}"
        )
    out: Bounds = {}
    for key, value in bounds.items():
        checked = check_bounds(value, str(key))
        if checked is not None:
            out[str(key)] = checked
    return out


@dataclass(frozen=True)
class Declaration:
    """What an experiment declares about its summary: the metric that ranks its arms, the
    mode, and metrics' known ranges. Recorded in the experiment's config (`entry`)."""

    metric: str | None = None
    mode: Mode | None = None
    bounds: Mapping[str, tuple[float, float]] | None = None

    def entry(self) -> dict[str, Any]:
        """The declaration as the experiment's config keeps it (JSON: ranges as lists)."""
        return {
            "metric": self.metric,
            "mode": self.mode,
            "bounds": {k: [lo, hi] for k, (lo, hi) in (self.bounds or {}).items()},
        }


def declaration(config: Any) -> Declaration:
    """The declaration an experiment's config records (nothing when it records none, or
    records something this version cannot read)."""
    entry = config.get(SUMMARY_KEY) if isinstance(config, Mapping) else None
    if not isinstance(entry, Mapping):
        return Declaration()
    metric = entry.get("metric") if isinstance(entry.get("metric"), str) else None
    mode = entry.get("mode") if entry.get("mode") in ("min", "max") else None
    bounds: Bounds = {}
    raw = entry.get("bounds")
    if isinstance(raw, Mapping):
        for key, value in raw.items():
            try:  # the store keeps an infinite end as the string "Infinity" (JSON has none)
                ends = [float(v) if isinstance(v, str) else v for v in value]
                checked = check_bounds(ends)
            except (ConfigError, TypeError, ValueError):
                continue
            if checked is not None:
                bounds[str(key)] = checked
    return Declaration(metric, mode, bounds)


def default_metric(keys: Iterable[str]) -> str | None:
    """The first of `RANKED_BY` among `keys`, or None."""
    known = set(keys)
    return next((k for k in RANKED_BY if k in known), None)


def choose(
    metric: str | None, mode: Mode | None, declared: Declaration, keys: Iterable[str]
) -> tuple[str | None, Mode]:
    """The metric and mode a summary ranks by: `metric` when named (its mode: `mode`, else
    the declared one when it is the declared metric, else ``min``); else the declared metric
    when the runs logged it; else `default_metric`."""
    if metric is None:
        known = set(keys)
        metric = declared.metric if declared.metric in known else default_metric(known)
    if mode is None:
        mode = declared.mode if metric is not None and metric == declared.metric else None
    return metric, check_mode(mode or "min")


def bounds_for(metric: str, given: Any, declared: Declaration) -> tuple[float, float] | None:
    """The range a metric's intervals are clipped to: `given` (checked) when not None, else
    the declared one, else None."""
    if given is not None:
        return check_bounds(given, metric)
    return (declared.bounds or {}).get(metric)


def counted(runs: Sequence[tuple[Hashable, int, str]]) -> list[bool]:
    """For each run, given as (arm, stage, status), whether it counts: completed or stopped,
    at its arm's last stage."""
    last: dict[Hashable, int] = {}
    for arm, stage, _status in runs:
        last[arm] = max(last.get(arm, stage), stage)
    return [status in COUNTED_STATUSES and stage == last[arm] for arm, stage, status in runs]


def lacking_text(metric: str, lacking: Sequence[str], total: int, experiment: str) -> str:
    """The reason a summary ranks no arm: `lacking` (run keys) of the `total` counted runs
    have no final `metric`."""
    listed = ", ".join(lacking[:20])
    if len(lacking) > 20:
        listed += f" and {len(lacking) - 20} more"
    return (
        f"metric {metric!r} is missing from {len(lacking)} of {plural(total, 'run')} of "
        f"experiment {experiment!r}: {listed}"
    )


@dataclass(frozen=True)
class Ranking:
    """Arms ranked by the mean of their final values: each arm's `Spread` (in the order
    given), its rank (1 is best; absent: unranked), and the best arm's margin over the next."""

    spreads: dict[Any, Spread]
    ranks: dict[Any, int]

    @property
    def order(self) -> list[Any]:
        """The ranked arms, best first."""
        return sorted(self.ranks, key=self.ranks.__getitem__)

    @property
    def best(self) -> Any:
        """The best arm, or None."""
        order = self.order
        return order[0] if order else None

    @property
    def runner_up(self) -> Any:
        """The second-best arm, or None."""
        order = self.order
        return order[1] if len(order) > 1 else None

    @property
    def margin(self) -> float | None:
        """How far the best arm's mean is ahead of the runner-up's (None with one arm)."""
        best, second = self.best, self.runner_up
        if second is None:
            return None
        return abs(self.spreads[best].mean - self.spreads[second].mean)


def rank_arms(
    values: Mapping[A, Sequence[float]],
    mode: Mode,
    *,
    interval: Interval = "t",
    bounds: tuple[float, float] | None = None,
    metric: str | None = None,
    ranked: Iterable[A] | None = None,
    lacking: bool = False,
) -> Ranking:
    """Each arm's spread of `values` (its counted runs' final values), and the ranks of the
    arms in `ranked` (default: all) with a number: by mean, lowest first for ``min``, ties in
    the order of `values`. `lacking` (some counted run has no value) ranks none."""
    check_mode(mode)
    spreads = {
        arm: spread(list(vals), interval=interval, bounds=bounds, metric=metric)
        for arm, vals in values.items()
    }
    pool = set(values if ranked is None else ranked)
    order = (
        []
        if lacking
        else sorted(  # stable: ties keep the arms' order
            (a for a in values if a in pool and spreads[a].n and not math.isnan(spreads[a].mean)),
            key=lambda a: spreads[a].mean,
            reverse=mode == "max",
        )
    )
    return Ranking(spreads, {arm: i + 1 for i, arm in enumerate(order)})
