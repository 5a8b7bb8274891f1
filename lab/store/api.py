"""`StoreAPI`: what every `lab` store does, whether it is a SQL database (`lab.store.Store`)
or a ``lab serve`` server reached over HTTP (`lab.store.http.HttpStore`).

The loggers, the experiment and the commands that record or read a store name this
Protocol, not a class: `lab.store.open_store` picks the one that serves a URL. Both classes
implement every method here with the same meaning (the tests hold them to it); each adds a
few of its own (`Store.tag`, `HttpStore.series`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from lab.records import EvalResult, ManifestRow
    from lab.store.records import (
        CurrentRun,
        EliminationRecord,
        ExperimentRecord,
        ExperimentSummary,
        FinishedRun,
        PreviousRun,
        TrialRecord,
    )
    from lab.store.writer import MetricWriter


@runtime_checkable
class StoreAPI(Protocol):
    """The contract of a store: record an experiment's arms, groups, runs, metrics, evals
    and checkpoints, and read back what a later attempt or a command needs."""

    # -- an experiment and its parts ---------------------------------------------------------
    def begin_experiment(
        self,
        name: str,
        *,
        config: dict[str, Any],
        seed: int,
        repeats: int,
        tags: Sequence[str] = (),
        notes: str | None = None,
    ) -> int:
        """Record an experiment as running (or run it again); its id."""
        ...

    def add_arm(
        self, experiment_id: int, name: str, *, overrides: dict[str, Any], config: dict[str, Any]
    ) -> int:
        """Record an arm of an experiment; its id."""
        ...

    def add_group(
        self, experiment_id: int, name: str, *, kind: str = "repeats", arm_id: int | None = None
    ) -> int:
        """Record a group of runs; its id."""
        ...

    def finish_experiment(
        self,
        experiment_id: int,
        *,
        status: str,
        callback_errors: list[dict[str, Any]] | None = None,
    ) -> None:
        """Record an experiment's final status."""
        ...

    # -- a run --------------------------------------------------------------------------------
    def claim_run(
        self, experiment_id: int, group_id: int, **fields: Any
    ) -> tuple[int | None, FinishedRun | None]:
        """Claim a run before it starts: its id when won, else the record of the process
        that finished it."""
        ...

    def start_run(self, experiment_id: int, group_id: int, **fields: Any) -> int:
        """Record a run as running under this process; its id."""
        ...

    def release_run(self, run_id: int, error: str) -> None:
        """Give a claimed run up, with why."""
        ...

    def supersede_run(self, run_id: int, run_key: str, output_dir: str | None) -> None:
        """Set a run aside under a new key and folder, for a fresh attempt."""
        ...

    def truncate_run(self, run_id: int, after_step: int | None = None) -> None:
        """Drop a run's rows past `after_step` (all of them: None), for a resume."""
        ...

    def finish_run(self, run_id: int, *, tags: Sequence[str] = (), **fields: Any) -> None:
        """Record a run's final status, error, summary and notes; a `pruned` run's
        ``pruned`` record (step, rule, metric, value)."""
        ...

    def set_provenance(self, run_id: int, provenance: dict[str, Any]) -> None:
        """Record where a run's code and data came from."""
        ...

    def set_callback_errors(self, run_id: int, callback_errors: list[dict[str, Any]]) -> None:
        """Record the failures of a run's callbacks."""
        ...

    # -- what a run logs ----------------------------------------------------------------------
    @property
    def writer(self) -> MetricWriter:
        """The background writer that metrics are queued to."""
        ...

    def log_metrics(
        self,
        run_id: int,
        step: int,
        metrics: dict[str, Any],
        *,
        floats: bool = False,
        keys: bool = False,
    ) -> None:
        """Queue one step's metrics; waits only while the buffer is full. `floats=True`:
        the caller checked that every value is exactly a float; `keys=True`: that every
        key passes `lab._metrics.check_key`."""
        ...

    def write_eval(
        self,
        run_id: int,
        result: EvalResult,
        predictions: list[dict[str, Any]] | None = None,
    ) -> int | None:
        """Record an eval with its per-example predictions."""
        ...

    def write_checkpoint(self, run_id: int, row: ManifestRow) -> None:
        """Record a checkpoint's manifest row."""
        ...

    def flush(self) -> None:
        """Make everything logged so far durable."""
        ...

    def close(self) -> None:
        """Flush, stop the writer and let the store go."""
        ...

    # -- a sweep ------------------------------------------------------------------------------
    def add_trial(
        self,
        experiment_id: int,
        number: int,
        arm_id: int,
        params: dict[str, Any],
        asked_after: int,
    ) -> None:
        """Record a sampled arm as asked (the same again does nothing)."""
        ...

    def tell_trial(
        self, experiment_id: int, number: int, *, told: int, value: float | None, state: str
    ) -> None:
        """Record how a sampled arm ended: its tell's sequence number, value and state."""
        ...

    def trials(self, experiment: str) -> list[TrialRecord]:
        """An experiment's sampled arms by number, for its sampler to be rebuilt from."""
        ...

    def supersede_trials(self, experiment: str) -> int:
        """Set an experiment's trials aside (``fresh=True``): kept, left out of `trials`
        and every reader; its race's eliminations are dropped (the new race records its
        own). Returns how many trials."""
        ...

    def add_elimination(
        self,
        experiment_id: int,
        arm_id: int,
        *,
        round: int,
        test: str,
        statistic: float,
        p_value: float,
        alpha: float,
        best: str,
    ) -> None:
        """Record that a race dropped an arm (once)."""
        ...

    def eliminations(self, experiment: str) -> list[EliminationRecord]:
        """The arms an experiment's race dropped, by round."""
        ...

    def metric_points(self, experiment: str, metric: str) -> dict[str, list[tuple[int, float]]]:
        """Each current run's (step, value) points of `metric` by run key: a pruner's read."""
        ...

    # -- reads --------------------------------------------------------------------------------
    def mark_crashed(self) -> list[str]:
        """Mark the running runs whose process is gone as crashed; their keys."""
        ...

    def find_run(self, experiment_id: int, run_key: str) -> int | None:
        """A run's id by its key, if it was recorded."""
        ...

    def previous_runs(self, experiment: str) -> dict[str, PreviousRun]:
        """An experiment's current runs by key, for a later attempt to reuse."""
        ...

    def current_runs(self, experiment: str) -> list[CurrentRun]:
        """An experiment's runs that are not superseded."""
        ...

    def run_keys(self, experiment: str) -> list[str]:
        """Every run key of an experiment, superseded ones included."""
        ...

    def last_step(self, run_id: int) -> int | None:
        """The newest step a run logged a metric at, or None."""
        ...

    def metric_values(self, run_id: int, key: str) -> list[tuple[int, float]]:
        """One run's (step, value) pairs for `key`, in step order."""
        ...

    def list_experiments(self) -> list[ExperimentSummary]:
        """Every experiment with its status and run counts, newest first."""
        ...

    def get_experiment(self, name: str) -> ExperimentRecord:
        """An experiment with its arms and runs."""
        ...
