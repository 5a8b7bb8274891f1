"""The spool: batches kept on disk while the server is away, replayed in order later.

A batch the sender could not deliver within the retry window is written, exactly as it
would have been sent, to ``<run dir>/.lab-spool/<client>-<seq>.arrow`` (metric rows, an
Arrow IPC stream) or ``.json`` (the other writes). The name carries the client id and the
sequence number, so a replay (by the sender once the server answers again, or by
``lab sync RUN_DIR``) sends the same (client, seq) and the server stores nothing twice.
A file is written under a temporary name and renamed, so a half-written one is never
replayed; it is removed once the server acknowledged it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

SPOOL_DIR = ".lab-spool"
_NAME = re.compile(r"(?P<client>[A-Za-z0-9_.-]{1,64})-(?P<seq>\d{12})\.(?P<kind>arrow|json)")


@dataclass(frozen=True, order=True)
class Spooled:
    """One spooled batch: its client id, sequence number, kind and file."""

    client_id: str
    seq: int
    kind: str  # "arrow" (metric rows) or "json" (other writes)
    path: Path


def spool_folder(run_dir: str | Path | None) -> Path:
    """Where a run's batches are spooled: ``<run dir>/.lab-spool``, else ``./.lab-spool``."""
    return Path(run_dir if run_dir is not None else Path.cwd()) / SPOOL_DIR


def write(folder: Path, client_id: str, seq: int, kind: str, body: bytes) -> Spooled:
    """Write one batch's body durably (fsynced, then renamed into place)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{client_id}-{seq:012d}.{kind}"
    part = path.with_name(path.name + ".part")
    with part.open("wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    return Spooled(client_id, seq, kind, path)


def pending(run_dir: str | Path) -> list[Spooled]:
    """The batches spooled in a run folder (or in a spool folder itself), in (client, seq)
    order: the order they were sent in."""
    folder = Path(run_dir)
    if folder.name != SPOOL_DIR:
        folder = folder / SPOOL_DIR
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _NAME.fullmatch(path.name)
        if match is not None:
            found.append(Spooled(match["client"], int(match["seq"]), match["kind"], path))
    return sorted(found)
