"""Checkpoints: when to save, how a save is made atomic, which saves are kept, and the manifest.

Layout of a run's checkpoint folder::

    checkpoints/
      step_000100/         state.pt + training_info.json + COMPLETE
      tmp_step_000200/     being written; renamed when complete, never read
      manifest.jsonl       one ManifestRow per save and per removal: the source of truth
      latest               names the newest committed checkpoint (a convenience for people)

A save commits in this order: write `tmp_step_N/` (state, info, then the COMPLETE marker, each
fsynced), rename it to `step_N/`, append its `save` row to the manifest (the commit point),
point `latest` at it, then apply retention. A checkpoint is a `save` row, not followed by a
`remove` row for its step, whose folder holds COMPLETE and state.pt. Everything the manager
knows is rebuilt from the manifest, cross-checked against the folders, when it is created.

Retention, applied after each save commits, is `lab.loop.retention`: it keeps the union of
what each rule of `CheckpointConfig` (`lab.loop.checkpoint_config`) keeps, and is the one
place a checkpoint is removed. The manifest's rows, its reading and `latest` are
`lab.manifest`. This module re-exports their public names.

Nothing outside the root is ever read or deleted on the manager's own account: a manifest row,
a `latest` file or a restored bookkeeping that names anything but a plain folder name (an
absolute path, "..", a link that leads out) is a `CheckpointError`, and `resolve` refuses a
path outside the root.

Every `state.pt` holds only what `torch.load(..., weights_only=True)` accepts (tensors, dicts,
lists, tuples, str, numbers, bools, None): a state holding anything else is refused at save
time, and a load never unpickles an arbitrary object. A file that a safe load refuses (a
checkpoint written by an older `lab`, whose numpy RNG state was an array, or one planted by
someone) is a `CheckpointError` unless it is trusted knowingly: `load(path, trusted=True)`, or
the environment variable `LAB_TRUST_CHECKPOINTS=1` for a resume; a trusted load logs one
WARNING.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import pickle
import re
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, overload

import torch

from lab._secrets import logger
from lab.errors import CheckpointError, ConfigError
from lab.loop.checkpoint_config import CheckpointConfig
from lab.loop.checkpoint_config import is_int as _is_int
from lab.loop.payload import check_safe, json_info
from lab.loop.retention import apply_retention, ranked
from lab.manifest import (
    COMPLETE_MARKER,
    INFO_FILE,
    LATEST_FILE,
    MANIFEST_FILE,
    STATE_FILE,
    TMP_PREFIX,
    Manifest,
    step_dirname,
)
from lab.manifest import is_complete as _is_complete
from lab.manifest import one_line as _one_line
from lab.manifest import write_durable as _write_durable
from lab.records import Kind, ManifestRow

__all__ = [
    "COMPLETE_MARKER",
    "INFO_FILE",
    "LATEST_FILE",
    "MANIFEST_FILE",
    "STATE_FILE",
    "TMP_PREFIX",
    "TRUST_ENV",
    "CheckpointConfig",
    "CheckpointManager",
    "Kind",
    "ManifestRow",
    "load_state",
    "snapshot_to_cpu",
    "step_dirname",
    "wait_for",
]

log = logger(__name__)

TRUST_ENV = "LAB_TRUST_CHECKPOINTS"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Recording:
    """A file whose write errors are kept: `torch.save` turns an OSError raised by `write`
    into a RuntimeError that no longer says what failed (for a full disk, "unexpected pos
    704 vs 598"), so the save reports the OSError itself."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fh, name)


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _disk_full(step: int, exc: BaseException, path: Path, root: Path) -> CheckpointError | None:
    """The one line for a save that ran out of space writing `path`; None for other errors.

    It is built once the partial save is removed, so the space it names is what is left.
    """
    if not isinstance(exc, OSError) or exc.errno not in _FULL:
        return None
    try:
        free = f"{shutil.disk_usage(root).free // 1024} KiB free after cleanup"
    except OSError:
        free = "free space unknown"
    return CheckpointError(
        f"cannot save step {step}: {os.strerror(exc.errno)} writing {path} ({free}); the "
        "earlier checkpoints are kept: free some space, or put the run folder on a larger disk"
    )


def snapshot_to_cpu(state: Any) -> Any:
    """A deep copy of `state` whose tensors are detached copies in CPU memory.

    Tensors are copied first and handed to `copy.deepcopy` through its memo, so containers
    keep their types and attributes (a state dict's `_metadata`) and a tensor reachable
    twice (tied weights) stays one tensor in the copy.
    """
    memo: dict[int, Any] = {}
    todo = [state]
    while todo:
        obj = todo.pop()
        if isinstance(obj, torch.Tensor):
            if id(obj) not in memo:
                memo[id(obj)] = obj.detach().to("cpu", copy=True)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
    return copy.deepcopy(state, memo)


class _PendingSave:
    """One asynchronous save: its thread, and the rows or the error it ended with."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.thread: threading.Thread
        self.rows: list[ManifestRow] = []
        self.error: BaseException | None = None

    def run(self, save: Any) -> None:
        try:
            self.rows = save()
        except BaseException as exc:  # kept for `wait`, which raises it on the caller's side
            self.error = exc


def _run_writers(
    writers: Sequence[Callable[[Path, int], Any]], folder: Path, step: int
) -> list[Any]:
    """Call each writer with the folder being saved; returns what they ask to wait for."""
    waits = []
    for writer in writers:
        try:
            pending = writer(folder, step)
        except Exception as exc:
            name = getattr(writer, "__qualname__", type(writer).__name__)
            raise CheckpointError(
                f"cannot save step {step}: the checkpoint writer {name} failed: {_one_line(exc)}"
            ) from exc
        if pending is not None:
            waits.append(pending)
    return waits


def wait_for(pending: Any) -> None:
    """Wait for a writer's asynchronous work: a Future (`result()`), a Thread (`join()`),
    an Event or process (`wait()`), or a function to call; its failure is a CheckpointError."""
    try:
        for method in ("result", "join", "wait"):
            wait = getattr(pending, method, None)
            if callable(wait):
                wait()
                break
        else:
            if not callable(pending):
                raise TypeError(
                    f"a checkpoint writer returned {type(pending).__name__}; return a Future, "
                    "a Thread, or None"
                )
            pending()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"a checkpoint writer's background work failed: {_one_line(exc)}"
        ) from exc


_REFUSED = re.compile(r"GLOBAL (\S+) was not an allowed global")


def _trusted(trusted: bool | None) -> bool:
    if trusted is not None:
        return trusted
    return os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes")


def load_state(file: Path, *, trusted: bool | None = None) -> dict[str, Any]:
    """Load a checkpoint's `state.pt` on the CPU with `weights_only=True`.

    Why: a checkpoint folder can come from anyone, and a plain unpickle runs whatever code the
    file names. A file a safe load refuses is one CheckpointError line naming what it holds
    and how to load it knowingly (`trusted=True`, default from LAB_TRUST_CHECKPOINTS), which
    then loads it with `weights_only=False` after one WARNING.
    """
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = _REFUSED.search(str(exc))
        if refused is None:
            raise _damaged(file, exc) from exc
        what = refused.group(1)
    except Exception as exc:
        raise _damaged(file, exc) from exc
    if not _trusted(trusted):
        raise CheckpointError(
            f"{file} refers to {what}, which a safe load (weights_only=True) refuses, since "
            "unpickling it could run code; if you made this checkpoint (an older lab saved "
            "numpy RNG states so), load it knowingly with CheckpointManager.load(path, "
            f"trusted=True) or set {TRUST_ENV}=1 to resume from it; else start fresh"
        ) from None
    log.warning(
        "loading %s with weights_only=False (it refers to %s, which a safe load refuses): "
        "trusted because %s; a checkpoint saved by this version loads safely",
        file,
        what,
        "trusted=True was passed" if trusted else f"{TRUST_ENV} is set",
    )
    try:
        return torch.load(file, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise _damaged(file, exc) from exc


def _damaged(file: Path, exc: BaseException) -> CheckpointError:
    return CheckpointError(
        f"cannot load {file}: {_one_line(exc)[:300]}; the file is damaged, pick another checkpoint"
    )


class CheckpointManager:
    """Saves checkpoints atomically into one run's folder, applies retention, answers queries.

    A new manager over an existing folder rebuilds its bookkeeping from `manifest.jsonl`, so
    queries and retention carry on across restarts with no state file of their own. A save
    row whose folder is missing or incomplete is not a checkpoint, and a complete `step_*`
    folder that no row records (its save was killed before it committed) is logged as a
    warning and ignored: not listed, not the latest, never removed; load it by path.
    """

    def __init__(
        self, root: str | Path, config: CheckpointConfig | None = None, run_key: str = ""
    ) -> None:
        self.root = Path(root)
        self.config = config if config is not None else CheckpointConfig()
        self.run_key = run_key
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"cannot create the checkpoint folder {self.root}: {_one_line(exc)}; "
                "pass a writable folder"
            ) from exc
        self._manifest = Manifest(self.root)
        self._pending: _PendingSave | None = None

    # -- queries ---------------------------------------------------------------------------
    def history(self) -> list[ManifestRow]:
        """Every manifest row, oldest first: what was saved and removed, and why."""
        return list(self._manifest.rows)

    def checkpoints(self) -> list[int]:
        """The steps of the checkpoints that exist now, oldest commit first."""
        return [e.save.step for e in self._manifest.committed()]

    @property
    def saved(self) -> list[int]:
        """Alias of `checkpoints()`."""
        return self.checkpoints()

    def get_latest_checkpoint_path(self) -> Path | None:
        """The newest committed checkpoint folder (the one to resume from), or None.

        The manifest decides which one that is. A `latest` file, where there is one, must
        name a committed checkpoint (it names the one before the newest after a kill between
        the manifest row and its own update); one that names anything else (a folder
        outside, a missing or incomplete one, garbage) is a CheckpointError, so a resume
        never starts from another step than the one the folder says without a word.
        """
        return self._manifest.newest()

    def latest_path(self) -> Path | None:
        """Alias of `get_latest_checkpoint_path()`, which the loop uses."""
        return self.get_latest_checkpoint_path()

    def get_best_checkpoint_path(
        self, metric: str | None = None, mode: Literal["min", "max"] | None = None
    ) -> Path | None:
        """The checkpoint with the best `metric` (ties: the newer), or None if none has one.

        The metric and mode default to the config's ranking (`metric` and `mode`, with or
        without `keep_top_k`); the value is the one passed to that checkpoint's save, so an
        unranked checkpoint (no value measured at its step) and NaN never rank as best.
        """
        ranked = self._best(1, metric, mode, "get_best_checkpoint_path")
        return ranked[0] if ranked else None

    def get_best_checkpoint_paths(
        self,
        k: int | None = None,
        metric: str | None = None,
        mode: Literal["min", "max"] | None = None,
    ) -> list[Path]:
        """The K best checkpoints that exist now, best first (ties: the newer first).

        Why: to evaluate, export or average the best few without re-ranking by hand. `k=None`
        lists every ranked checkpoint; unranked ones (no value for the metric, or NaN) are
        left out. Metric and mode default to the config's, as in `get_best_checkpoint_path`.
        """
        return self._best(k, metric, mode, "get_best_checkpoint_paths")

    def _best(self, k: int | None, metric: str | None, mode: str | None, _name: str) -> list[Path]:
        if k is not None and (not _is_int(k) or k < 1):
            raise ConfigError(f"{_name}(k={k!r}): use an int >= 1, or None for every ranked one")
        metric = metric if metric is not None else self.config.metric
        mode = mode if mode is not None else self.config.mode
        if metric is None:
            raise ConfigError(
                f"{_name}() needs a metric: pass metric= and mode=, or set "
                "CheckpointConfig(metric=..., mode=...)"
            )
        if mode not in ("min", "max"):
            raise ConfigError(
                f"{_name}(mode={mode!r}): use 'min' (lower is better) or 'max' (higher is better)"
            )
        best = ranked(self._manifest.committed(), metric, mode)
        return [self.root / e.save.path for e in best[:k]]

    @overload
    def load_training_info(self, target: None) -> None: ...

    @overload
    def load_training_info(self, target: str | Path | int) -> dict[str, Any]: ...

    def load_training_info(self, target: str | Path | int | None) -> dict[str, Any] | None:
        """The `training_info.json` of a checkpoint (a folder or a step): step, time, metrics.

        None gives None, so `load_training_info(get_latest_checkpoint_path())` reads "no
        checkpoint yet" on a fresh run instead of failing.
        """
        if target is None:
            return None
        path = self.resolve(target)
        try:
            return json.loads((path / INFO_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(
                f"cannot read {path / INFO_FILE}: {_one_line(exc)}; the checkpoint lacks its "
                "training info"
            ) from exc

    # -- loading and resuming -----------------------------------------------------------------
    @overload
    def resolve(self, target: None) -> None: ...

    @overload
    def resolve(self, target: str | Path | int) -> Path: ...

    def resolve(self, target: str | Path | int | None) -> Path | None:
        """The folder of a checkpoint named by a step, a path, or "latest"; or why there is none.

        A relative path that does not exist is also looked up under the checkpoint root, so
        `resolve("step_000100")` works; a path outside the root (a link that leads out
        included) is refused. The error says what to pass instead. None (what
        `get_latest_checkpoint_path()` gives before the first save) resolves to None.
        """
        if target is None:
            return None
        if isinstance(target, bool):
            raise CheckpointError(f"resolve({target!r}): pass a step number or a checkpoint path")
        if isinstance(target, int):  # not a bool (refused above)
            return self._manifest.resolve_step(int(target))
        if target == "latest":
            latest = self.get_latest_checkpoint_path()
            if latest is None:
                raise CheckpointError(f"no checkpoint in {self.root} yet; train first")
            return latest
        path = Path(target)
        if isinstance(target, str) and target.isdigit() and not path.exists():
            return self._manifest.resolve_step(int(target))
        if not path.exists() and not path.is_absolute() and (self.root / path).exists():
            path = self.root / path
        in_root = path.resolve().parent == self.root.resolve()
        entry = self._manifest.entry_named(path.name) if in_root else None
        if entry is not None and entry.removal is not None:
            raise CheckpointError(
                f"{path} was removed ({entry.removal.reason}); {self._manifest.available()}"
            )
        if not path.exists():
            raise CheckpointError(
                f"checkpoint {path} does not exist; pass a checkpoint folder or a step "
                f"({self._manifest.available()})"
            )
        if path.is_dir() and path.resolve() == self.root.resolve():
            raise CheckpointError(
                f"{path} is the checkpoint root, not a checkpoint; pass a step or one of its "
                f"step_* folders ({self._manifest.available()})"
            )
        if not in_root:
            raise CheckpointError(
                f"{path} is outside this run's checkpoint folder {self.root}; resume from a "
                f"step or one of its step_* folders ({self._manifest.available()}), or copy the "
                "checkpoint in first"
            )
        if not _is_complete(path):
            raise CheckpointError(
                f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker or no "
                f"{STATE_FILE}): an interrupted save or not a checkpoint folder "
                f"({self._manifest.available()})"
            )
        return path

    def read_latest(self) -> Path | None:
        """The checkpoint the `latest` file names (None without one), checked like a row.

        `latest` is a plain file anyone can edit, so what it names must be a committed
        checkpoint (a save row of the manifest, not removed since, whose folder inside the
        root is complete), or this raises CheckpointError naming the file and the fix.
        """
        return self._manifest.read_latest()

    def load(self, target: str | Path | int, *, trusted: bool | None = None) -> dict[str, Any]:
        """The saved state of a checkpoint (a folder, a step, or "latest"), on the CPU.

        Loaded with `weights_only=True`, so a checkpoint never runs code it holds. A file a
        safe load refuses (written by an older `lab`, or planted) is a CheckpointError, unless
        `trusted=True` (default: the environment variable LAB_TRUST_CHECKPOINTS=1) loads it
        with `weights_only=False` after one WARNING: do that only for files you made.
        """
        if target is None:
            raise CheckpointError(
                "load(None): there is no checkpoint to load (get_latest_checkpoint_path() is "
                "None before the first save); check for None first"
            )
        return load_state(self.resolve(target) / STATE_FILE, trusted=trusted)

    def remove_stale_tmp(self) -> list[Path]:
        """Delete the debris of interrupted saves and removals; return what was deleted.

        That is every `tmp_*` folder, a stale `tmp_latest` file, and any folder whose removal
        the manifest records (a kill between the removal row and the delete). Call it before
        training starts, when no save is in flight.
        """
        removed = []
        for path in sorted(self.root.glob(f"{TMP_PREFIX}*")):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
                removed.append(path)
            elif path.name == f"{TMP_PREFIX}{LATEST_FILE}":
                path.unlink()
                removed.append(path)
        for entry in sorted(self._manifest.entries.values(), key=lambda e: e.order):
            if entry.removal is None:
                continue
            folder = self._manifest.inside(entry.save.path)
            if folder.is_dir() and not folder.is_symlink():
                shutil.rmtree(folder)
                removed.append(folder)
        return removed

    # -- bookkeeping as checkpoint state --------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The retention bookkeeping (the manifest's rows), for a checkpoint to hold."""
        return self._manifest.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore bookkeeping saved by `state_dict`; the manifest stays the source of truth.

        If the manifest already holds those rows (and maybe later ones), nothing changes; if
        it holds only their beginning (or nothing, e.g. a folder restored from a copy of one
        checkpoint), the missing rows are appended to it. Rows that disagree are an error.
        """
        self._manifest.load_state_dict(state, self.run_key)

    # -- saving --------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: dict[str, Any],
        info: dict[str, Any],
        *,
        final: bool = False,
        writers: Sequence[Callable[[Path, int], Any]] = (),
        kind: Kind | None = None,
        begun: bool = False,
        _waits: Sequence[Any] | None = None,
    ) -> list[ManifestRow]:
        """Write `state` for `step`, commit it, then drop what retention no longer keeps.

        `info["metrics"]` is recorded in the save row and ranks the checkpoint (give only
        values measured at `step`: a save without the ranking metric is unranked); the other
        values of `info` go to `training_info.json` and must be JSON-native (numpy scalars and
        0-d tensors are converted). `state` must hold only what a safe load accepts
        (tensors, dicts, lists, tuples, str, numbers, bools, None). `final` marks the last
        save of a run stopped early (never ephemeral). `kind` says how the save is kept when
        the caller counts the config's steps in units of its own (an RL loop's episodes);
        None: `CheckpointConfig.kind` of `step`. Each of `writers` is called as
        ``writer(folder, step)`` with the folder being written, to add the loop's own files
        (sharded weights, an export); what it returns is waited for (`wait_for`) before the
        folder commits, so those files commit with it. Returns the save row, then one row per
        removal. A failed save raises CheckpointError and leaves the earlier checkpoints, the
        manifest and `latest` as they were. `begun=True` commits the folder `begin(step)` made,
        with what other processes wrote into it (a sharded save's shards) kept.
        """
        if begun and _waits is None:
            _waits = ()
        if not _is_int(step) or step < 0:
            raise CheckpointError(f"save(step={step!r}): give the step as an int >= 0")
        metrics = self._metrics(step, info)
        info = json_info(step, info)
        check_safe(step, state)
        if kind is None:
            kind = self.config.kind(step, final=final)
        final_dir = self._manifest.inside(step_dirname(step))  # a link that leads out is refused
        info = {"step": step, "run_key": self.run_key, "time": time.time(), **info}
        info["metrics"] = metrics
        # with `_waits`, save_async or the caller's `begin` made the folder and filled it
        tmp = self.begin(step) if _waits is None else self.root / f"{TMP_PREFIX}{final_dir.name}"
        row = ManifestRow(
            self.run_key, step, final_dir.name, "save", info["time"], metrics, kind=kind
        )
        self._commit(tmp, row, state, info, writers, _waits)
        self._manifest.add(row)
        self._manifest.point_latest(final_dir.name)
        if final:
            self._warn_if_never_ranked(step)
        return [row, *apply_retention(self._manifest, self.config, self.run_key)]

    def _commit(
        self,
        tmp: Path,
        row: ManifestRow,
        state: dict[str, Any],
        info: dict[str, Any],
        writers: Sequence[Callable[[Path, int], Any]],
        waits: Sequence[Any] | None,
    ) -> None:
        """Write `state` and `info` into `tmp` with the loop's own files (`writers`, or what
        `waits` names, written already), rename it into place and append `row`: the commit.
        A failure removes what was written and raises one CheckpointError line."""
        step, final_dir = row.step, self.root / row.path
        renamed = False
        writing = tmp / STATE_FILE  # the file being written, for a full disk's message
        out: _Recording | None = None
        try:
            with open(writing, "wb") as fh:
                out = _Recording(fh)
                torch.save(state, out)
                fh.flush()
                os.fsync(fh.fileno())
            for pending in list(waits) if waits is not None else _run_writers(writers, tmp, step):
                wait_for(pending)
            for extra in tmp.rglob("*"):  # the loop's own files are as durable as the state
                if extra.is_file() and extra.name != STATE_FILE:
                    with open(extra, "rb") as fh:
                        os.fsync(fh.fileno())
            writing = tmp / INFO_FILE
            _write_durable(writing, json.dumps(info, sort_keys=True).encode())
            writing = tmp / COMPLETE_MARKER
            _write_durable(writing, b"")
            _fsync_dir(tmp)
            if final_dir.is_dir():  # re-saving a step (e.g. a restarted run): replace it whole
                shutil.rmtree(final_dir)
            os.replace(tmp, final_dir)
            renamed = True
            _fsync_dir(self.root)
            writing = self.root / MANIFEST_FILE
            self._manifest.append(row)
        except BaseException as exc:
            shutil.rmtree(final_dir if renamed else tmp, ignore_errors=True)
            if not isinstance(exc, Exception) or isinstance(exc, CheckpointError):
                raise  # an interrupt, or a writer's failure already said in one line
            cause = out.error if out is not None and out.error is not None else exc
            full = _disk_full(step, cause, writing, self.root)
            if full is not None:
                raise full from exc
            raise CheckpointError(
                f"cannot save step {step} in {final_dir if renamed else tmp}: {_one_line(exc)}"
            ) from exc

    def begin(self, step: int) -> Path:
        """Make the empty folder that `save(step, ..., begun=True)` will commit, and return
        it: for files written by several processes (each rank's shard of a sharded save)
        before one of them commits the save. Debris of an interrupted save is removed first."""
        tmp = self.root / f"{TMP_PREFIX}{self._manifest.inside(step_dirname(step)).name}"
        try:
            if tmp.is_dir() and not tmp.is_symlink():  # debris of an interrupted save
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as exc:
            full = _disk_full(step, exc, tmp, self.root)
            if full is not None:
                raise full from exc
            raise CheckpointError(
                f"cannot save step {step}: cannot create {tmp}: {_one_line(exc)}"
            ) from exc
        return tmp

    def _warn_if_never_ranked(self, step: int) -> None:
        """At a run's last save, say so when no save had a value for the ranking metric."""
        metric = self.config.metric
        rows = self._manifest.rows
        if metric is None or any(metric in r.metrics for r in rows if r.event == "save"):
            return
        log.warning(
            "CheckpointConfig(metric=%r) ranked no checkpoint up to step %d: no save had a "
            "value measured at its own step; run the evaluator at the save steps (e.g. the same "
            "every=), or fix the name",
            metric,
            step,
        )

    def save_async(
        self,
        step: int,
        state: dict[str, Any],
        info: dict[str, Any],
        *,
        final: bool = False,
        writers: Sequence[Callable[[Path, int], Any]] = (),
        kind: Kind | None = None,
    ) -> list[ManifestRow]:
        """Copy `state` to CPU memory now, then `save` it in a background thread.

        The caller is blocked only for the copy, so training goes on while the file is
        written, and tensors it changes afterwards do not reach the checkpoint. One save is
        in flight at a time: this first waits for the previous one and returns its rows (as
        `wait` does, raising its CheckpointError if it failed). The rows of this save come
        from the next `save_async` or `wait`; until then it is not a checkpoint: the manifest
        row, `latest` and retention happen in the background, only after the folder commits.
        """
        rows = self.wait()
        if not _is_int(step) or step < 0:
            raise CheckpointError(f"save(step={step!r}): give the step as an int >= 0")
        # a bad metric, info value or state fails here, on the caller's thread; the copies
        # made here are what the background thread writes
        info = {**json_info(step, info), "metrics": self._metrics(step, info)}
        check_safe(step, state)
        snapshot = snapshot_to_cpu(state)
        waits: list[Any] | None = None
        if writers:  # the loop's files are written (or started) now, on its own thread
            tmp = self.root / f"{TMP_PREFIX}{self._manifest.inside(step_dirname(step)).name}"
            try:
                if tmp.is_dir() and not tmp.is_symlink():
                    shutil.rmtree(tmp)
                tmp.mkdir()
                waits = _run_writers(writers, tmp, step)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        pending = _PendingSave(step)
        pending.thread = threading.Thread(
            target=pending.run,
            args=(lambda: self.save(step, snapshot, info, final=final, kind=kind, _waits=waits),),
            name=f"lab-checkpoint-step-{step}",
        )
        self._pending = pending
        pending.thread.start()
        return rows

    def wait(self) -> list[ManifestRow]:
        """Wait for the save in flight, if any, and return its rows (none if there is none).

        This is where an asynchronous save's failure surfaces: a write that failed in the
        background raises CheckpointError here, never silently.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        pending.thread.join()
        if pending.error is not None:
            error = pending.error
            if isinstance(error, CheckpointError):
                raise CheckpointError(f"background save failed: {error}") from error
            raise CheckpointError(
                f"background save of step {pending.step} failed: {_one_line(error)}"
            ) from error
        return pending.rows

    @property
    def in_flight(self) -> bool:
        """Whether an asynchronous save has been started and not yet waited for."""
        return self._pending is not None

    def _metrics(self, step: int, info: dict[str, Any]) -> dict[str, float]:
        """The save's metrics as floats; checked before anything is written."""
        raw = info.get("metrics") or {}
        try:
            metrics = {str(k): float(v) for k, v in raw.items()}
        except (TypeError, ValueError, AttributeError, RuntimeError) as exc:
            raise CheckpointError(
                f"save(step={step}): info['metrics'] must map names to numbers ({_one_line(exc)})"
            ) from exc
        # A save without a value of the ranking metric measured at its step is unranked:
        # kept or removed by the other rules, never counted among the best.
        return metrics
