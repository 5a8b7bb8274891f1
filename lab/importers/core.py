"""What every importer shares: a source's runs as plain records, and how they become a
`lab` experiment in a store.

A reader (`lab.importers.mlflow`, `.wandb`, `.tensorboard`) reads everything it imports
into a `Source` first, with the source's own library; only then does `write_source` write,
so a source that cannot be read leaves the store as it was. Each source run becomes one
run whose key comes from the source's run id (``mlflow-<run id>``, ``wandb-<run id>``,
``tensorboard-<folder>``): importing the same runs again finds them and adds nothing, and a
run that logged more points since gets those points (and its new status) added.

Arms: without ``arm_by`` each run is its own arm (named as the source names the run),
since the runs of a tracker are usually distinct settings, which averaged together as
repeats would mean nothing. With ``arm_by=["lr", "opt"]`` the runs whose config agrees on
those fields are one arm (``lr=0.1,opt=sgd``), its repeats ordered by their ``seed`` config
field when every run of the arm has one, else by start time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from lab._metrics import check_key
from lab._names import MAX_KEY, MAX_NAME, TAG, check_name, safe_name
from lab.errors import ConfigError, LabError


class SourceError(LabError):
    """A source to import cannot be read: a missing folder, an unknown experiment, a URI
    its library cannot open."""


#: The statuses of a source run, as `lab` records them. A run the source still shows as
#: running has no end: it is recorded as crashed (it counts in no summary) until it is
#: imported again once it ended. A run a person killed is `stopped`: its points up to
#: there stand, as those of a run stopped early in `lab`.
STATUSES = {
    "finished": "completed",
    "completed": "completed",
    "failed": "failed",
    "killed": "stopped",
    "stopped": "stopped",
    "crashed": "crashed",
    "running": "crashed",
    "scheduled": "crashed",
}


def status_of(raw: str, kind: str) -> tuple[str, str | None]:
    """A source's status as `lab`'s, with the error that says why a run that never ended in
    the source is recorded as crashed."""
    status = STATUSES.get(raw.lower(), "crashed")
    if raw.lower() in ("finished", "completed", "failed", "killed", "stopped"):
        return status, None
    return (
        status,
        f"the run was {raw.lower()} in {kind} when it was imported; import it again once it ends",
    )


@dataclass
class SourceRun:
    """One run of a source, read whole: what its importer writes as one `lab` run."""

    source_id: str
    name: str
    config: dict[str, Any]
    #: key -> [(step, value, wall_time in seconds since the epoch)], in step order
    metrics: dict[str, list[tuple[int, float, float]]]
    status: str
    tags: list[str] = field(default_factory=list)
    started_at: float | None = None
    ended_at: float | None = None
    error: str | None = None
    #: what the source knows of the run beyond the above (its tags with their values, say)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Source:
    """A source's runs, read: `kind` (``mlflow``, ``wandb``, ``tensorboard``), the
    experiment name it suggests, and where it was read from."""

    kind: str
    name: str
    location: str
    runs: list[SourceRun]


@dataclass
class ImportResult:
    """What one import wrote: the experiment, the runs it added, the runs that had grown
    (run key -> points added) and the runs that were there already, unchanged."""

    experiment: str
    kind: str
    added: list[str]
    grown: dict[str, int]
    unchanged: list[str]
    points: int

    def line(self) -> str:
        """One line that says what the import did."""
        if not self.added and not self.grown:
            return (
                f"nothing new: the {_n(len(self.unchanged), 'run')} from {self.kind} are in "
                f"experiment {self.experiment!r} already"
            )
        parts = [f"{_n(len(self.added), 'new run')}"]
        if self.grown:
            parts.append(f"{_n(len(self.grown), 'run')} with new points")
        if self.unchanged:
            parts.append(f"{len(self.unchanged)} unchanged")
        return (
            f"imported {', '.join(parts)} ({_n(self.points, 'point')}) from {self.kind} into "
            f"experiment {self.experiment!r}"
        )


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def config_value(text: str) -> Any:
    """A value the source keeps as text (an MLflow param), as data: JSON where it parses
    (``"0.1"`` -> 0.1, ``"true"`` -> True, ``"[1, 2]"`` -> [1, 2]), else the text. Never
    evaluated as code."""
    try:
        return json.loads(text)
    except (ValueError, TypeError):
        return text


def number(value: Any) -> float | None:
    """A metric value as a float, or None when it is not a number (media, a table). JSON
    writes NaN and infinities as the strings ``NaN``, ``Infinity``, ``-Infinity``: they stay
    data."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if value in ("NaN", "Infinity", "-Infinity"):
        return float(value)
    return None


def iso(seconds: float | None) -> str | None:
    """A time in seconds since the epoch as an ISO 8601 UTC string."""
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat()


def valid_tags(tags: Sequence[str]) -> list[str]:
    """The tags `lab` can hold, in order, each once (the others stay in the run's
    provenance, with the rest of what the source knew)."""
    return list(dict.fromkeys(t for t in tags if isinstance(t, str) and TAG.fullmatch(t)))


def run_key(kind: str, source_id: str) -> str:
    """The key of the run imported from `source_id`: the same at every import."""
    return safe_name(f"{kind}-{source_id}", limit=MAX_KEY - 9)


def lookup(config: dict[str, Any], name: str) -> Any:
    """A config field by name, or by a dotted path into nested dicts (``optimizer.lr``);
    None when absent."""
    if name in config:
        return config[name]
    value: Any = config
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def check_source(source: Source) -> None:
    """Refuse, before anything is written, what the store could not hold: a metric key, a
    run name."""
    for run in source.runs:
        for key, points in run.metrics.items():
            check_key(key, points[0][0] if points else 0)
        check_name("arm", run.name, MAX_NAME)


@dataclass
class Plan:
    """Where each source run goes: its arm (name, overrides), repeat and seed."""

    arm: dict[str, str] = field(default_factory=dict)
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    repeat: dict[str, int] = field(default_factory=dict)
    seed: dict[str, int] = field(default_factory=dict)


def _seed_of(config: dict[str, Any]) -> int | None:
    seed = config.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int | float) or not math.isfinite(seed):
        return None
    return int(seed) if float(seed).is_integer() else None


def plan(runs: Sequence[SourceRun], arm_by: Sequence[str]) -> Plan:
    """Arms, repeats and seeds for `runs` (see the module's docstring)."""
    out = Plan()
    index = {id(r): i for i, r in enumerate(runs)}  # the source's order breaks ties
    ordered = sorted(runs, key=lambda r: (r.started_at or 0.0, index[id(r)]))
    if not arm_by:
        names = [r.name for r in ordered]
        for r in ordered:
            unique = names.count(r.name) == 1
            out.arm[r.source_id] = r.name if unique else f"{r.name}-{r.source_id}"[:MAX_NAME]
            out.overrides[r.source_id] = {}
            out.repeat[r.source_id] = 0
            out.seed[r.source_id] = _seed_of(r.config) or 0
        return out
    arms: dict[str, list[SourceRun]] = {}
    for r in ordered:
        values = {f: lookup(r.config, f) for f in arm_by}
        name = ",".join(f"{f}={_shown(v)}" for f, v in values.items())
        check_name("arm", name, MAX_NAME)
        arms.setdefault(name, []).append(r)
        out.arm[r.source_id], out.overrides[r.source_id] = name, values
    for members in arms.values():
        seeds = [_seed_of(r.config) for r in members]
        if all(s is not None for s in seeds):
            members = sorted(members, key=lambda r: (_seed_of(r.config), r.started_at or 0.0))
        for i, r in enumerate(members):
            out.repeat[r.source_id] = i
            seed = _seed_of(r.config)
            out.seed[r.source_id] = seed if seed is not None else i
    return out


def _shown(value: Any) -> str:
    """A config value in an arm's name: text as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def parse_arm_by(arm_by: str | Sequence[str] | None) -> list[str]:
    """``"lr,opt"`` or ``["lr", "opt"]`` as a list of field names; an empty name is an
    error."""
    if arm_by is None:
        return []
    fields = arm_by.split(",") if isinstance(arm_by, str) else list(arm_by)
    if not fields or any(not f.strip() for f in fields):
        raise ConfigError(f"arm_by {arm_by!r}: give config field names, e.g. 'lr,opt'")
    return [f.strip() for f in fields]
