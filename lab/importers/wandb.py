"""wandb run folders (``wandb/offline-run-*``, ``wandb/run-*``), read from their ``.wandb``
transaction log by wandb's own reader: the ``wandb-core`` program that ships in the wandb
package (``wandb leet inspect``), which prints the log's protobuf records as JSON. Its
summary gives the run (id, name, project, config, tags, state, start time); its records
give every history row with its step and ``_timestamp``. wandb 0.31 has no Python reader of
these files; nothing here parses the log itself."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime
from pathlib import Path
from typing import Any

from lab.importers.core import Source, SourceError, SourceRun, number, status_of, valid_tags


def run_folders(paths: list[str | Path]) -> list[Path]:
    """The run folders `paths` name: each a run folder, or a ``wandb`` folder whose run
    folders are taken in name order. A path that is neither is refused."""
    out = []
    for given in paths:
        path = Path(given)
        if not path.is_dir():
            raise SourceError(f"no such folder: {given}")
        if _log_of(path) is not None:
            out.append(path)
            continue
        inner = sorted(p for p in path.glob("*run-*") if p.is_dir() and _log_of(p) is not None)
        if not inner:
            raise SourceError(
                f"{given} is not a wandb run folder (it holds no run-*.wandb file): give "
                "wandb/run-* or wandb/offline-run-* folders, or the wandb folder"
            )
        out += inner
    return out


def _log_of(folder: Path) -> Path | None:
    logs = sorted(folder.glob("run-*.wandb"))
    return logs[0] if logs else None


def read_wandb(paths: list[str | Path]) -> Source:
    """Every run in the wandb run folders `paths` (see `run_folders`)."""
    from lab._imports import require

    require("wandb", "import", "lab import wandb")
    folders = run_folders(paths)
    runs = {}
    for folder in folders:
        run = _run(folder)
        runs[run.source_id] = run  # a folder given twice is one run
    projects = sorted({r.extra["project"] for r in runs.values() if r.extra.get("project")})
    name = projects[0] if len(projects) == 1 else Path(folders[0]).resolve().parent.parent.name
    return Source("wandb", name, ", ".join(str(f) for f in folders), list(runs.values()))


def _inspect(log: Path, *flags: str) -> str:
    """What wandb's reader prints for the log at `log`."""
    from wandb.util import get_core_path

    args = [get_core_path(), "leet", "inspect", "--no-observability", "--json", *flags]
    done = subprocess.run(
        [*args, "--run-file", str(log.resolve()), str(log.resolve().parent.parent)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["unreadable"])[-1]
        raise SourceError(f"wandb cannot read {log}: {why.removeprefix('Error: ')}")
    return done.stdout


def _run(folder: Path) -> SourceRun:
    log = _log_of(folder)
    assert log is not None
    about = json.loads(_inspect(log, "--summary"))
    metrics: dict[str, dict[int, tuple[int, float, float]]] = {}
    for line in _inspect(log).splitlines():
        record = json.loads(line)
        if record.get("type") != "history":
            continue
        item = record["history"].get("item", {})
        step = int(record["history"].get("step", {}).get("num", item.get("_step", 0)))
        wall = float(item.get("_timestamp", 0.0))
        for key, raw in item.items():
            value = number(raw)
            if not key.startswith("_") and value is not None:
                metrics.setdefault(key, {})[step] = (step, value, wall)
    status, error = status_of(about.get("state") or "running", "wandb")
    return SourceRun(
        source_id=about["run_id"],
        name=about.get("name") or about["run_id"],
        config=dict(about.get("config") or {}),
        metrics={k: [v[s] for s in sorted(v)] for k, v in sorted(metrics.items())},
        status=status,
        tags=valid_tags(about.get("tags") or []),
        started_at=_seconds(about.get("start_time")),
        ended_at=_seconds(about.get("last_write")),
        error=error if status != "failed" else f"exit code {about.get('exit_code')}",
        extra=_extra(about, folder),
    )


def _extra(about: dict[str, Any], folder: Path) -> dict[str, Any]:
    keep = ("project", "entity", "notes", "tags", "exit_code", "state")
    return {"folder": str(folder.resolve()), **{k: about.get(k) for k in keep}}


def _seconds(text: str | None) -> float | None:
    """An RFC 3339 time as seconds since the epoch (nanoseconds cut to microseconds)."""
    if not text:
        return None
    head, _, frac = text.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(frac or '0')[:6]}+00:00").timestamp()
