"""What an `Experiment` asks of the callback that records its runs in a store.

Before any hook fires, an experiment opens its store (a bad URL or a dead server stops it
at once), learns which runs an earlier attempt recorded (to reuse or refuse them), and
claims each run before it starts (two processes never train one run); with a race, it
records the arms the race drops (`RaceSink`); with a sweep, its trials (`SweepSink`). It
asks these of whichever attached callback is a `StoreSink`, never of a class by name, so a sink for
another backend (a ``lab serve`` server over HTTP, say) plugs in without editing
`Experiment`. `lab.loggers.store_sink` builds the sink for a store URL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from lab.hooks import LogContext


@runtime_checkable
class RunRecords(Protocol):
    """The records of an experiment's runs, as a sink's open store gives them."""

    def mark_crashed(self) -> list[str]:
        """Mark the runs whose process is gone `crashed`; returns their keys."""
        ...

    def previous_runs(self, experiment: str) -> dict[str, dict[str, Any]]:
        """The current (not superseded) runs of `experiment`, by run key."""
        ...

    def current_runs(self, experiment: str) -> list[dict[str, Any]]:
        """The current runs of `experiment`, as rows."""
        ...

    def run_keys(self, experiment: str) -> list[str]:
        """Every run key `experiment` has recorded, superseded ones included."""
        ...

    def supersede_run(self, run_id: int, run_key: str, output_dir: str | None) -> None:
        """Set a run aside under a new key (``fresh=True``)."""
        ...

    def supersede_trials(self, experiment: str) -> int:
        """Set a sweep's recorded trials aside and drop a race's eliminations (``fresh=True``);
        returns how many trials."""
        ...


@runtime_checkable
class StoreSink(Protocol):
    """A callback that records runs in a store and claims each run before it starts."""

    def open(self) -> RunRecords:
        """Open the store now, before any hook: a bad URL or a dead server raises here."""
        ...

    def claim(self, ctx: LogContext) -> dict[str, Any] | None:
        """Claim the run `ctx` points at: None when this process won it, the run's record
        when another process finished it; raises `RunBusy` while a live process trains it."""
        ...

    def release(self, run_key: str, error: str) -> None:
        """Record a claimed run that never started as failed with `error`."""
        ...


@runtime_checkable
class RaceSink(Protocol):
    """A `StoreSink` that also records what a race decides (``Experiment(race=...)``):
    the arms it drops, as each round closes, and which it had dropped before, so that a race
    run again records no elimination twice. A sink that is not one leaves them unrecorded."""

    def eliminated(self, experiment: str) -> set[str]:
        """The arms of `experiment` whose elimination the store holds."""
        ...

    def record_elimination(self, ctx: LogContext, elimination: Any, alpha: float) -> None:
        """Record that the race dropped an arm of the experiment `ctx` points at
        (a `lab.sweeps.Elimination`, decided at level `alpha`)."""
        ...


@runtime_checkable
class SweepSink(Protocol):
    """A `StoreSink` that also records a sweep's trials (``Experiment(sweep=...)``): each
    sampled arm as it is asked and as it is told, and those recorded before, from which a
    sweep run again rebuilds its sampler. A sink that is not one leaves them unrecorded."""

    def trials(self, experiment: str) -> list[dict[str, Any]]:
        """The trials `experiment` recorded, by number ([] for an unknown experiment)."""
        ...

    def recorded_sweep(self, experiment: str) -> dict[str, Any] | None:
        """The sweep `experiment` recorded in its config (None: none, or no experiment)."""
        ...

    def record_trial(self, ctx: LogContext, trial: Any, arm: str) -> None:
        """Record sampled arm `arm` (a `lab.sweeps.Trial`, asked) of the experiment `ctx`
        points at, with the arm's row when the store has none yet."""
        ...

    def tell_trial(self, ctx: LogContext, trial: Any) -> None:
        """Record how a trial (told) of the experiment `ctx` points at ended."""
        ...
