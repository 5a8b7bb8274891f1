"""When a recorded run may stand for a planned one: its fingerprint, and what differs.

A run is reused by a later attempt of its experiment (skipped as finished, or resumed from
its checkpoint) only when it would train the same thing: the same config, seed, stage and
train function (and, for a stage of a chain, the same carry). These are its fingerprint,
hashed as canonical JSON with sha256 into ``runs.config_hash``. Runs recorded before the
hash existed (NULL) are compared by their stored config, seed and stage.

A run that is started afresh (``fresh=True``) is superseded: its row keeps its data under
the key ``<run_key>~<n>`` and its folder moves to ``<folder>.superseded-<n>``, n counting
from 1, so the new run can neither take its key nor resume from its checkpoints.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab._json import finite_json
from lab.errors import RunBusy

if TYPE_CHECKING:
    from lab.sinks import RunRecords

#: Separates a superseded run's key from its number: ``small-r0~1``. Safe in paths.
SUPERSEDED_KEY = "~"
#: Suffix of a superseded run's folder: ``small-r0.superseded-1``.
SUPERSEDED_FOLDER = ".superseded-"
_SHOWN = 3  # differences named in a refusal before "and N more"


def train_name(train: Callable[..., Any]) -> str:
    """The qualified name of a train function, as ``module:qualname``."""
    target = getattr(train, "func", train)  # functools.partial: the function it wraps
    module = getattr(target, "__module__", None) or type(target).__module__
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}:{name}"


@dataclass(frozen=True)
class Fingerprint:
    """What a run's result depends on; equal fingerprints train the same thing."""

    config: dict[str, Any]
    seed: int
    stage: int
    train: str | None  # None: not known (a run recorded before the hash existed)
    carry: str | None = None  # a chain's stages: what each takes from the stage before

    def digest(self) -> str:
        """sha256 of the canonical JSON (sorted keys, no spaces) of the fingerprint."""
        doc = {"config": self.config, "seed": self.seed, "stage": self.stage,
               "train": self.train, "carry": self.carry}  # fmt: skip
        text = json.dumps(finite_json(doc), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def differences(old: Fingerprint, new: Fingerprint) -> list[str]:
    """What differs between a recorded run and the planned one, as ``field: old -> new``.

    Config fields are named by their dotted path (``model.width``). The train function of
    a recorded run is compared only when it was recorded.
    """
    out = [f"{k}: {_show(a)} -> {_show(b)}" for k, a, b in _walk(old.config, new.config, "")]
    if old.seed != new.seed:
        out.append(f"seed: {old.seed} -> {new.seed}")
    if old.stage != new.stage:
        out.append(f"stage: {old.stage} -> {new.stage}")
    if old.train is not None and old.train != new.train:
        out.append(f"train function: {old.train} -> {new.train}")
    if old.carry is not None and old.carry != new.carry:
        out.append(f"carry: {old.carry} -> {new.carry}")
    return out


def _walk(old: Any, new: Any, at: str) -> Iterable[tuple[str, Any, Any]]:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in list(old) + [k for k in new if k not in old]:
            missing = object()
            yield from _walk(old.get(key, missing), new.get(key, missing), f"{at}{key}.")
    elif finite_json(old) != finite_json(new):
        yield at.rstrip("."), old, new


def _show(value: Any) -> str:
    if not isinstance(value, (str, int, float, bool, list, dict, type(None))):
        return "(none)"  # the `missing` marker: a field one side lacks
    return json.dumps(finite_json(value))


def refusal(experiment: str, changed: dict[str, list[str]], recorded: int) -> str:
    """The one line that refuses to reuse runs that would train something else now.

    `changed` maps each differing run key to its differences; the line names each distinct
    difference once, with the runs it concerns, and the two ways out.
    """
    by_diff: dict[str, list[str]] = {}
    for key, diffs in changed.items():
        for diff in diffs:
            by_diff.setdefault(diff, []).append(key)
    parts = []
    for diff, keys in by_diff.items():
        if len(keys) == recorded and recorded > 1:
            parts.append(f"{diff} (all {recorded} runs)")
        elif len(keys) > 2:
            parts.append(f"{diff} ({keys[0]} and {len(keys) - 1} more)")
        else:
            parts.append(f"{diff} ({', '.join(keys)})")
    shown = "; ".join(parts[:_SHOWN])
    if len(parts) > _SHOWN:
        shown += f"; and {len(parts) - _SHOWN} more differences"
    runs = (
        "runs that trained something else than they"
        if len(changed) > 1
        else ("run that trained something else than it")
    )
    return (
        f"experiment {experiment!r} has {len(changed)} recorded {runs} would now: {shown}; "
        "use a new experiment name, or start afresh with fresh=True (--fresh on the command "
        "line), which keeps the old runs as superseded"
    )


def superseded_key(run_key: str, n: int) -> str:
    """The key a superseded run keeps its row under."""
    return f"{run_key}{SUPERSEDED_KEY}{n}"


def superseded_folder(folder: Path, n: int) -> Path:
    """Where a superseded run's folder moves to."""
    return folder.with_name(f"{folder.name}{SUPERSEDED_FOLDER}{n}")


def next_superseded_number(run_key: str, taken_keys: Iterable[str], folders: Iterable[Path]) -> int:
    """The smallest n >= 1 above every superseded key and folder of `run_key` already used."""
    used = [0]
    prefix = run_key + SUPERSEDED_KEY
    for key in taken_keys:
        if key.startswith(prefix) and key[len(prefix) :].isdigit():
            used.append(int(key[len(prefix) :]))
    for folder in folders:
        n = 1
        while superseded_folder(folder, n).exists():
            n += 1
        used.append(n - 1)
    return max(used) + 1


def busy_message(experiment: str, run_key: str, row: dict[str, Any]) -> str:
    """The one line that says a run is being trained by a live process, and what to do."""
    since = row.get("started_at")
    when = f" since {since:%Y-%m-%d %H:%M:%S} UTC" if since is not None else ""
    return (
        f"run {run_key} of experiment {experiment!r} is being trained by pid {row.get('pid')} "
        f"on {row.get('host')}{when}; wait for it to end and run again (finished runs are "
        "reused), or use another experiment name"
    )


def supersede_runs(
    store: RunRecords | None, experiment: str, folder: Path, planned: Iterable[str]
) -> list[str]:
    """Start an experiment afresh, losing nothing: supersede its current runs.

    Each current run of `experiment` in `store` gets `superseded_at`, the key
    ``<run_key>~<n>`` and its folder moved to ``<folder>.superseded-<n>`` (its
    `output_dir` follows; a folder that is gone already keeps its recorded path). A planned
    run's folder under `folder` that no row records (a run without a store) moves aside
    too, so no fresh run resumes from old checkpoints. A sweep's recorded trials are set
    aside as well (`supersede_trials`), so a new sweep asks its own. Call it after
    `mark_crashed`: it refuses, before changing anything, while a run is `running`. Returns
    the new keys of the superseded rows.
    """
    moved: list[str] = []
    if store is not None:
        rows = store.current_runs(experiment)
        for row in rows:
            if row["status"] == "running":
                raise RunBusy(busy_message(experiment, row["run_key"], row))
        store.supersede_trials(experiment)  # a sweep's trials too: the new sweep asks afresh
        taken = store.run_keys(experiment)
        for row in rows:
            recorded = Path(row["output_dir"]) if row["output_dir"] else None
            n = next_superseded_number(row["run_key"], taken, [recorded] if recorded else [])
            new_key = superseded_key(row["run_key"], n)
            target = None
            if recorded is not None and recorded.exists():
                target = superseded_folder(recorded, n)
                recorded.rename(target)
            try:
                store.supersede_run(row["run_id"], new_key, str(target or recorded or "") or None)
            except BaseException:
                if target is not None and recorded is not None and not recorded.exists():
                    target.rename(recorded)  # the row still points here
                raise
            taken.append(new_key)
            moved.append(new_key)
    for run_key in planned:
        stale = folder / run_key
        if stale.exists():
            stale.rename(superseded_folder(stale, next_superseded_number(run_key, [], [stale])))
    return moved
