"""The records a store's reads return, named once for `lab.store.api.StoreAPI` and both of
its implementations (`lab.store.Store`, `lab.store.http.HttpStore`).

They are `TypedDict`s: plain dicts at run time, the very shapes ``lab ls --json``,
``lab show`` and ``lab serve``'s JSON answers have always shown, now with their keys and
value types written down where a type checker and a reader find them. Times are naive UTC
`datetime`s (an `HttpStore` turns the server's ISO text back into them).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypedDict


class PreviousRun(TypedDict):
    """A current run of an experiment as a later attempt judges it (`previous_runs`):
    whether it may be reused, and what it returned."""

    run_key: str
    status: str
    seed: int
    stage: int
    config: dict[str, Any]
    config_hash: str | None
    summary: dict[str, Any]
    host: str | None
    pid: int | None
    started_at: datetime | None
    #: the experiment's recorded train function, as `lab.experiment` names it
    train: Any
    #: a `pruned` run's stop (``{"step", "rule", "metric", "value"}``), else None
    pruned: dict[str, Any] | None


class CurrentRun(TypedDict):
    """A run that is not superseded, with its folder and owner (`current_runs`)."""

    run_id: int
    run_key: str
    status: str
    output_dir: str | None
    host: str | None
    pid: int | None
    started_at: datetime | None


class FinishedRun(TypedDict):
    """What `claim_run` gives back of a run another process finished meanwhile: its status
    and final metrics, to be reused."""

    status: str
    summary: dict[str, Any]


class ExperimentSummary(TypedDict):
    """One line of ``lab ls`` (`list_experiments`): an experiment with its run counts."""

    name: str
    status: str
    arms: int
    repeats: int
    runs: int
    runs_by_status: dict[str, int]
    points: int
    superseded: int
    created_at: datetime | None
    tags: list[str]
    notes: str | None


class ArmRecord(TypedDict):
    """An arm of an experiment: its name and the overrides of the base config."""

    name: str
    overrides: dict[str, Any] | None


class RunRecord(TypedDict):
    """A run as ``lab show`` prints it: status, newest step, error, final metrics (the last
    value of each key, overlaid with what the run returned), tags, notes, provenance."""

    run_id: int
    run_key: str
    arm: str | None
    repeat: int
    stage: int
    seed: int
    status: str
    error: str | None
    summary: dict[str, Any]
    callback_errors: list[dict[str, Any]] | None
    tags: list[str]
    notes: str | None
    provenance: dict[str, Any] | None
    traceback: str | None
    host: str | None
    pid: int | None
    started_at: datetime | None
    ended_at: datetime | None
    step: int | None


class ExperimentRecord(TypedDict):
    """An experiment with its arms and current runs (`get_experiment`, ``lab show``)."""

    name: str
    status: str
    seed: int
    repeats: int
    config: dict[str, Any]
    created_at: datetime | None
    ended_at: datetime | None
    callback_errors: list[dict[str, Any]] | None
    tags: list[str]
    notes: str | None
    arms: list[ArmRecord]
    runs: list[RunRecord]
    superseded: int


class Annotations(TypedDict):
    """An experiment's or a run's tags and notes as they are after `Store.tag`."""

    tags: list[str]
    notes: str | None


class Deleted(TypedDict):
    """What `Store.delete_experiment` removed: the number of runs, and the run folders it
    left on disk (files, not rows), sorted."""

    runs: int
    folders: list[str]


class TrialRecord(TypedDict):
    """A sampled arm as its sampler knows it (`trials`): its ask order, arm, active
    parameters, how many tells had happened when it was asked, its own tell's sequence
    number and value (None until told; None for a failed trial), its state, and for a
    trial whose runs were pruned, each pruned run's step and value (`intermediate`)."""

    number: int
    arm: str
    params: dict[str, Any]
    asked_after: int
    told: int | None
    value: float | None
    state: str
    intermediate: dict[int, float]


class EliminationRecord(TypedDict):
    """An arm a race dropped (`eliminations`): after which round, by which test, with the
    post-hoc statistic against the best arm, the corrected p-value and alpha."""

    arm: str
    round: int
    test: str
    statistic: float
    p_value: float
    alpha: float
    best: str
    created_at: datetime
