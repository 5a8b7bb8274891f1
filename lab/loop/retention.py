"""Retention: which checkpoints a run keeps after each save, and where the others are removed.

`apply_retention` runs after each save commits (`CheckpointManager.save`), as a query over
the manifest, and keeps the union of what each rule keeps:

- `keep_last=N` keeps the N newest non-ephemeral checkpoints (fixed ones count among them);
- `keep_top_k=K` keeps the K best by `metric` (`mode` "min" or "max"); ties go to the newer;
  a checkpoint whose value is NaN or missing is never among the best;
- a save carries only values measured at its own step (the loop's step metrics, and an eval's
  only when that eval ran at that step); a save without a value for `metric` is *unranked*:
  `keep_top_k` never keeps it, so it is kept or removed by the other rules, and it never
  displaces a ranked checkpoint nor counts as the best;
- fixed steps (`fixed_steps`) are kept forever;
- with neither `keep_last` nor `keep_top_k`, every non-ephemeral checkpoint is kept;
- an ephemeral checkpoint is kept by no rule above but `keep_top_k`: it goes when the next
  save commits, unless it is among the best;
- the newest committed checkpoint is never removed.

"Newest" is commit order (the order of the save rows); in a run that only moves forward that
is the highest step. A removal appends a `remove` row whose `reason` names the rules that no
longer keep the checkpoint (e.g. "keep_last=2; keep_top_k=1 by val/loss (min)"), then deletes
the folder; a folder whose removal was recorded counts as removed even if a kill left it on
disk, and `CheckpointManager.remove_stale_tmp()` deletes it later.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

from lab._secrets import logger
from lab.loop.checkpoint_config import CheckpointConfig
from lab.manifest import TMP_PREFIX, Entry, Manifest
from lab.records import ManifestRow

__all__ = ["apply_retention", "keepers", "ranked"]

log = logger("lab.loop.checkpoints")  # one name for every part of the checkpoints


def _reason(config: CheckpointConfig, kind: str) -> str:
    """The rules that no longer keep a checkpoint of this kind, as its removal row names them."""
    names = []
    if kind == "ephemeral":
        every = config.ephemeral_every
        names.append(f"ephemeral_every={every}" if every is not None else "ephemeral")
    elif config.keep_last is not None:
        names.append(f"keep_last={config.keep_last}")
    if config.keep_top_k is not None:
        names.append(f"keep_top_k={config.keep_top_k} by {config.metric} ({config.mode})")
    return "; ".join(names)


def ranked(entries: list[Entry], metric: str, mode: str) -> list[Entry]:
    """The entries with a number for `metric`, best first; ties: the newer first.

    Why: `keep_top_k` and the manager's best-checkpoint queries rank alike, so the checkpoint
    a query calls best is the one retention keeps.
    """
    sign = 1.0 if mode == "min" else -1.0
    scored = [
        (sign * value, -e.order, e)
        for e in entries
        if (value := e.save.metrics.get(metric)) is not None and not math.isnan(value)
    ]
    scored.sort(key=lambda t: (t[0], t[1]))
    return [e for _, _, e in scored]


def keepers(committed: list[Entry], config: CheckpointConfig) -> dict[int, list[str]]:
    """For each committed checkpoint (oldest commit first), the rules that keep it; an empty
    list: no rule keeps it any more, so it is removed."""
    keep: dict[int, list[str]] = {e.save.step: [] for e in committed}
    lasting = [e for e in committed if e.save.kind != "ephemeral"]
    if config.keep_last is None and config.keep_top_k is None:
        for e in lasting:
            keep[e.save.step].append("no limit")
    if config.keep_last is not None:
        for e in lasting[-config.keep_last :]:
            keep[e.save.step].append(f"keep_last={config.keep_last}")
    if config.keep_top_k is not None and config.metric is not None and config.mode is not None:
        for e in ranked(committed, config.metric, config.mode)[: config.keep_top_k]:
            keep[e.save.step].append(f"keep_top_k={config.keep_top_k}")
    for e in committed:
        if e.save.kind == "fixed" or e.save.step in config.fixed_steps:
            keep[e.save.step].append("fixed_steps")
    if committed:
        keep[committed[-1].save.step].append("newest")
    return keep


def apply_retention(
    manifest: Manifest, config: CheckpointConfig, run_key: str
) -> list[ManifestRow]:
    """Remove each checkpoint no rule of `config` keeps: the one place a checkpoint is removed.

    Each removal is recorded first (a `remove` row of run `run_key`), then its folder is
    deleted, so a kill in between leaves a folder the manifest already counts as removed. A
    removal that cannot be recorded stops here; the next save retries it. Returns the rows.
    """
    committed = manifest.committed()
    keep = keepers(committed, config)
    rows = []
    for entry in committed:
        if keep[entry.save.step]:
            continue
        folder = manifest.inside(entry.save.path)  # before anything is recorded or deleted
        row = ManifestRow(
            run_key,
            entry.save.step,
            entry.save.path,
            "remove",
            time.time(),
            reason=_reason(config, entry.save.kind),
            kind=entry.save.kind,
        )
        try:
            manifest.append(row)
        except OSError as exc:  # retried after the next save: retention is a query
            log.warning("cannot record the removal of %s: %s", entry.save.path, exc)
            break
        manifest.add(row)
        _delete(folder)
        rows.append(row)
    return rows


def _delete(folder: Path) -> None:
    """Delete a checkpoint's folder whose removal is recorded: renamed out of the
    ``step_*`` names first (one atomic step), so that a kill halfway through the delete
    leaves a ``tmp_*`` folder, which the next start deletes as debris
    (`CheckpointManager.remove_stale_tmp`), and never a ``step_*`` folder whose COMPLETE
    marker is gone while its state is still there."""
    doomed = folder.with_name(f"{TMP_PREFIX}removed_{folder.name}")
    try:
        folder.rename(doomed)
    except OSError:  # e.g. the debris of an earlier removal holds that name: delete in place
        doomed = folder
    shutil.rmtree(doomed, ignore_errors=True)
    if folder.exists() or doomed.exists():
        log.warning("%s is recorded as removed but could not be deleted", folder)
