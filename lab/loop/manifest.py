"""The manifest of a run's checkpoint folder: its rows, read, appended and indexed by step.

`manifest.jsonl` holds one `ManifestRow` per save and per removal, appended durably; it is
the source of truth of what a checkpoint folder holds. `Manifest` keeps its rows in memory
and indexes them: each step's latest save, and its removal if one came after it. A
checkpoint is a `save` row, not followed by a `remove` row for its step, whose folder holds
COMPLETE and state.pt. The folder names and the `latest` file are here too, with the checks
that keep every name a row or `latest` gives inside the checkpoint folder.
`lab.loop.checkpoints` re-exports the public names.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lab._secrets import logger
from lab.errors import CheckpointError
from lab.records import ManifestRow

#: the checkpoint's logger, one name for every part of it (the manager, its manifest and
#: its retention), so that one logging setting reaches them all
log = logger("lab.loop.checkpoints")

STATE_FILE = "state.pt"
INFO_FILE = "training_info.json"
COMPLETE_MARKER = "COMPLETE"
MANIFEST_FILE = "manifest.jsonl"
LATEST_FILE = "latest"
TMP_PREFIX = "tmp_"

_STEP_DIR = re.compile(r"step_(\d+)")


def step_dirname(step: int) -> str:
    """The folder name of the checkpoint taken after `step` steps."""
    return f"step_{step:06d}"


def one_line(exc: BaseException) -> str:
    """`exc` as one line, its type first: how a CheckpointError quotes the error behind it."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def is_complete(path: Path) -> bool:
    """Whether the folder `path` holds a whole save: its COMPLETE marker and its state file."""
    return (path / COMPLETE_MARKER).is_file() and (path / STATE_FILE).is_file()


def _plain_name(name: Any) -> bool:
    """Whether `name` is one folder name: no separator, not absolute, not "." or "..", no NUL.

    A manifest names its checkpoints this way; anything else could lead outside the folder.
    """
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
    )


def write_durable(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it: a file a commit relies on is on the disk first."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


@dataclass
class Entry:
    """The bookkeeping of one step: its latest save row, where that sits, and its removal."""

    save: ManifestRow
    order: int
    removal: ManifestRow | None = None


class Manifest:
    """The rows of one checkpoint folder's `manifest.jsonl`, in memory, indexed by step.

    Why: which checkpoints exist, which is the newest, and which were removed and why, are
    queries over these rows; they are read from the file, cross-checked against the folders,
    when a manager is made, so nothing else needs a state file of its own.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.rows: list[ManifestRow] = self._read()
        self.entries: dict[int, Entry] = {}
        self._rebuild()
        for entry in self.entries.values():
            self.inside(entry.save.path)
        self._warn_inconsistencies()

    def _rebuild(self) -> None:
        """Index the rows: each step's latest save, and its removal if one came after it."""
        self.entries = {}
        for order, row in enumerate(self.rows):
            self._index(row, order)

    def _index(self, row: ManifestRow, order: int) -> None:
        if row.event == "save":
            self.entries[row.step] = Entry(row, order)
        elif row.step in self.entries:
            self.entries[row.step].removal = row

    def add(self, row: ManifestRow) -> None:
        """Take `row`, appended to the file already, into the rows and the index."""
        self.rows.append(row)
        self._index(row, len(self.rows) - 1)

    def append(self, row: ManifestRow) -> None:
        """Append one row durably; a failed append is cut back off, so no torn row remains."""
        path = self.root / MANIFEST_FILE
        size = path.stat().st_size if path.is_file() else 0
        try:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(row.to_json() + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        except BaseException:
            if path.is_file():
                with contextlib.suppress(OSError):
                    os.truncate(path, size)
            raise

    def committed(self) -> list[Entry]:
        """The checkpoints that exist now (saved, not removed, folder complete), oldest commit
        first."""
        return sorted(
            (
                e
                for e in self.entries.values()
                if e.removal is None and is_complete(self.root / e.save.path)
            ),
            key=lambda e: e.order,
        )

    def available(self) -> str:
        """The steps there are, for an error message that names what to pass instead."""
        steps = [e.save.step for e in self.committed()]
        return f"available steps: {steps}" if steps else f"no checkpoints in {self.root}"

    def entry_named(self, name: str) -> Entry | None:
        """The step whose latest save row names the folder `name`, if any."""
        return next((e for e in self.entries.values() if e.save.path == name), None)

    def inside(self, name: Any, *, source: str = MANIFEST_FILE) -> Path:
        """The folder a manifest row names, or CheckpointError if it lies outside the root.

        Retention and `remove_stale_tmp` delete what the rows name, so a row is trusted only
        with a plain folder name, and a folder that is a link must lead back into the root: a
        manifest written by hand (an absolute path, "..", a link to elsewhere) touches nothing.
        """
        if not _plain_name(name):
            fix = "fix or delete that file" if source == LATEST_FILE else "fix or remove that row"
            raise CheckpointError(
                f"{source} in {self.root} names {name!r}, which is not a folder inside it; "
                f"a checkpoint is named by its step_* folder: {fix}"
            )
        folder = self.root / name
        target = folder.resolve()
        if folder.is_symlink() and target.parent != self.root.resolve():
            raise CheckpointError(
                f"{folder} is a link to {target}, outside the checkpoint folder {self.root}; "
                "nothing there is loaded or removed: replace the link by the folder itself"
            )
        return folder

    def _read(self) -> list[ManifestRow]:
        path = self.root / MANIFEST_FILE
        if not path.exists():
            return []
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {one_line(exc)}") from exc
        if data and not data.endswith(b"\n"):  # a torn append: that row never committed
            cut = data.rfind(b"\n") + 1
            log.warning("%s ends with a partial row (an interrupted write); dropping it", path)
            data = data[:cut]
            try:
                os.truncate(path, cut)
            except OSError as exc:
                log.warning("cannot drop the partial row of %s: %s", path, exc)
        rows = []
        for number, line in enumerate(data.decode("utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(ManifestRow.from_json(line))
            except (ValueError, TypeError) as exc:
                raise CheckpointError(
                    f"{path} line {number} is not a manifest row ({one_line(exc)}); "
                    "restore that line or remove it"
                ) from exc
        return rows

    def _warn_inconsistencies(self) -> None:
        known = set()
        for entry in self.entries.values():
            known.add(entry.save.path)
            if entry.removal is None and not is_complete(self.root / entry.save.path):
                log.warning(
                    "%s records step %d, but %s is missing or incomplete: not a checkpoint",
                    MANIFEST_FILE,
                    entry.save.step,
                    self.root / entry.save.path,
                )
        for folder in sorted(self.root.glob("step_*")):
            named = _STEP_DIR.fullmatch(folder.name) and folder.name not in known
            if named and is_complete(folder):
                log.warning(
                    "%s is a complete checkpoint that %s does not record (its save was "
                    "interrupted before it committed); it is ignored: not listed, not the "
                    "latest, never removed; load it by path",
                    folder,
                    MANIFEST_FILE,
                )

    def resolve_step(self, step: int) -> Path:
        """The folder of step `step`'s checkpoint, or a CheckpointError that says why there
        is none (removed, incomplete, never committed, never saved) and which steps there are."""
        entry = self.entries.get(step)
        folder = self.root / step_dirname(step)
        if entry is not None and entry.removal is not None:
            raise CheckpointError(
                f"the checkpoint of step {step} was removed ({entry.removal.reason}); "
                f"{self.available()}"
            )
        if entry is not None and is_complete(self.root / entry.save.path):
            return self.root / entry.save.path
        if entry is not None:
            raise CheckpointError(
                f"the checkpoint of step {step} is recorded but {self.root / entry.save.path} "
                f"is missing or incomplete; {self.available()}"
            )
        if is_complete(folder):
            raise CheckpointError(
                f"{folder} is not recorded in {MANIFEST_FILE} (its save never committed); pass "
                f"its path to load it anyway; {self.available()}"
            )
        raise CheckpointError(f"no checkpoint of step {step} in {self.root}; {self.available()}")

    # -- latest ---------------------------------------------------------------------------------
    def point_latest(self, name: str) -> None:
        """Point `latest` at `name`; the manifest stays authoritative if this fails, and the
        old `latest` is removed then, so that it cannot name a checkpoint retention removes
        (which `read_latest` would refuse)."""
        tmp = self.root / f"{TMP_PREFIX}{LATEST_FILE}"
        try:
            write_durable(tmp, name.encode())
            os.replace(tmp, self.root / LATEST_FILE)
        except OSError as exc:
            log.warning("cannot update %s (%s); removed it", self.root / LATEST_FILE, exc)
            for path in (tmp, self.root / LATEST_FILE):
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)

    def read_latest(self) -> Path | None:
        """The checkpoint the `latest` file names (None without one), checked like a row: a
        committed checkpoint, or a CheckpointError naming the file and the fix."""
        path = self.root / LATEST_FILE
        fix = f"delete or fix that file ({self.available()})"
        if path.is_symlink():
            raise CheckpointError(
                f"{path} is a link to {os.readlink(path)}; nothing outside {self.root} is "
                f"read: {fix}"
            )
        try:
            name = path.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {path}: {one_line(exc)}; {fix}") from exc
        folder = self.inside(name, source=LATEST_FILE)
        entry = self.entry_named(name)
        if entry is None:
            why = "no save row of manifest.jsonl records"
        elif entry.removal is not None:
            why = f"was removed ({entry.removal.reason})"
        elif not is_complete(folder):
            why = "is missing or incomplete"
        else:
            return folder
        raise CheckpointError(f"{path} names {name!r}, a checkpoint that {why}; {fix}")

    # -- the rows as checkpoint state -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The rows, for a checkpoint to hold."""
        return {"version": 1, "manifest": [asdict(row) for row in self.rows]}

    def load_state_dict(self, state: dict[str, Any], run_key: str) -> None:
        """Append the rows `state` holds past ours (run `run_key`'s); rows that disagree with
        ours, or belong to another run, are a CheckpointError."""
        try:
            rows = [ManifestRow(**row) for row in state["manifest"]]
        except (KeyError, TypeError) as exc:
            raise CheckpointError(
                f"load_state_dict got no checkpoint bookkeeping ({one_line(exc)}); "
                "pass what CheckpointManager.state_dict() returned"
            ) from exc
        for row in rows:
            self.inside(row.path, source="the checkpoint's bookkeeping")
        others = sorted({r.run_key for r in rows} - {run_key})
        if others:
            raise CheckpointError(
                f"the bookkeeping belongs to run {others[0]!r}, not {run_key!r}; "
                "restore it into that run's checkpoint folder"
            )
        mine = [r.to_json() for r in self.rows]
        theirs = [r.to_json() for r in rows]
        if mine[: len(theirs)] == theirs:
            return
        if theirs[: len(mine)] != mine:
            shared = next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b)
            raise CheckpointError(
                f"the bookkeeping disagrees with {self.root / MANIFEST_FILE} from row "
                f"{shared + 1} on; it comes from another attempt at this run: use a fresh folder"
            )
        for row in rows[len(mine) :]:
            self.append(row)
            self.rows.append(row)
        self._rebuild()
