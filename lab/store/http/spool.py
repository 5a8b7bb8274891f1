"""The spool: batches kept on disk while the server is away, replayed in order later.

A batch the sender could not deliver within the retry window is written, exactly as it
would have been sent, to ``<run dir>/.lab-spool/<client>-<seq>.arrow`` (metric rows, an
Arrow IPC stream) or ``.json`` (the other writes, with the few metric rows sent among
them). The name carries the client id and the
sequence number, so a replay (by the sender once the server answers again, or by
``lab sync RUN_DIR``) sends the same (client, seq) and the server stores nothing twice.

A file is written under a temporary name (``.part``), fsynced and renamed, so a batch file
is whole or absent. A write that fails (a full disk) removes its ``.part``, and the sender
keeps the batch in memory. A ``.part`` that a killed process left, or a batch file that is
not a whole batch of its kind (`describe` says why), is never sent: ``lab sync`` names it
and leaves it where it is. A batch the server refused as bad data is renamed
``.rejected``, so that it is not sent again and is still there to look at.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from lab._table import plural

SPOOL_DIR = ".lab-spool"
PART = ".part"
REJECTED = ".rejected"
_NAME = re.compile(r"(?P<client>[A-Za-z0-9_.-]{1,64})-(?P<seq>\d{12})\.(?P<kind>arrow|json)")
#: The columns of a metric batch (what the server's /batches/metrics reads).
METRIC_COLUMNS = ("run_id", "step", "key", "value", "wall_time")


@dataclass(frozen=True, order=True)
class Spooled:
    """One spooled batch: its client id, sequence number, kind and file."""

    client_id: str
    seq: int
    kind: str  # "arrow" (metric rows) or "json" (other writes, a few metric rows among them)
    path: Path


def spool_folder(run_dir: str | Path | None) -> Path:
    """Where a run's batches are spooled: ``<run dir>/.lab-spool``, else ``./.lab-spool``."""
    return Path(run_dir if run_dir is not None else Path.cwd()) / SPOOL_DIR


def write(folder: Path, client_id: str, seq: int, kind: str, body: bytes) -> Spooled:
    """Write one batch's body durably: to a ``.part`` file, fsynced, then renamed into place
    (and the folder fsynced). Raises `OSError` when it cannot (a full disk), after removing
    the ``.part``: no file is left that holds part of a batch."""
    path = folder / f"{client_id}-{seq:012d}.{kind}"
    part = path.with_name(path.name + PART)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with part.open("wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except OSError:
        with contextlib.suppress(OSError):
            part.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # the rename itself, durable (where the OS allows)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return Spooled(client_id, seq, kind, path)


def _folder(run_dir: str | Path) -> Path:
    folder = Path(run_dir)
    return folder if folder.name == SPOOL_DIR else folder / SPOOL_DIR


def pending(run_dir: str | Path) -> list[Spooled]:
    """The batches spooled in a run folder (or in a spool folder itself), in (client, seq)
    order: the order they were sent in."""
    folder = _folder(run_dir)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _NAME.fullmatch(path.name)
        if match is not None:
            found.append(Spooled(match["client"], int(match["seq"]), match["kind"], path))
    return sorted(found)


def unfinished(run_dir: str | Path) -> list[Path]:
    """The ``.part`` files of a spool folder: writes a killed process never finished, which
    hold part of a batch at most and are never sent."""
    folder = _folder(run_dir)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.endswith(PART))


def describe(kind: str, body: bytes) -> str:
    """What a batch body holds, in words: ``"120 metric rows of run 3"``, ``"2 writes
    (finish_run, write_eval) of run 3"``, ``"30 metric rows and 1 write (write_eval) of
    run 3"``. Raises `ValueError`, saying why, when the body is
    not a whole batch of its kind (an empty file, one cut short, another format)."""
    if not body:
        raise ValueError("it is empty")
    if kind == "arrow":
        import pyarrow as pa

        try:
            table = pa.ipc.open_stream(body).read_all()
        except (pa.ArrowInvalid, OSError) as exc:
            raise ValueError(f"not a whole Arrow stream: {exc}") from None
        if tuple(table.column_names) != METRIC_COLUMNS:
            raise ValueError(f"its columns are {table.column_names}, not {list(METRIC_COLUMNS)}")
        runs = set(table.column("run_id").to_pylist())
        return f"{plural(table.num_rows, 'metric row')} {_of(runs)}"
    try:
        batch = json.loads(body)
        ops = batch["ops"]
        names = Counter(str(op["op"]) for op in ops if op["op"] != "metrics")
        steps = [one for op in ops if op["op"] == "metrics" for one in op["args"]["steps"]]
        runs = {op["args"].get("run_id") for op in ops if op["op"] != "metrics"} - {None}
        runs.update(one["run_id"] for one in steps)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a whole batch of writes: {type(exc).__name__}: {exc}") from None
    if not ops:
        raise ValueError("it holds no writes")
    held = [plural(sum(len(one["values"]) for one in steps), "metric row")] if steps else []
    if names:
        held.append(f"{plural(names.total(), 'write')} ({', '.join(sorted(names))})")
    return f"{' and '.join(held)} {_of(runs)}"


def _of(runs: set[object]) -> str:
    if not runs:
        return "of no run"
    shown = ", ".join(str(r) for r in sorted(runs, key=str))
    return f"of run {shown}" if len(runs) == 1 else f"of runs {shown}"


def set_aside(item: Spooled) -> Path:
    """Rename a spooled batch the server refused to ``<name>.rejected``: never sent again,
    still there to read. Returns the new path."""
    aside = item.path.with_name(item.path.name + REJECTED)
    os.replace(item.path, aside)
    return aside
