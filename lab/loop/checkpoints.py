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

Retention, applied after each save commits, keeps the union of what each rule keeps:

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
disk, and `remove_stale_tmp()` deletes it later.

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

import contextlib
import copy
import errno
import json
import math
import os
import pickle
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, overload

import torch

from lab._secrets import logger
from lab.errors import CheckpointError, ConfigError
from lab.loop.payload import check_safe, json_info
from lab.records import Kind, ManifestRow

log = logger(__name__)

STATE_FILE = "state.pt"
INFO_FILE = "training_info.json"
COMPLETE_MARKER = "COMPLETE"
MANIFEST_FILE = "manifest.jsonl"
LATEST_FILE = "latest"
TMP_PREFIX = "tmp_"
TRUST_ENV = "LAB_TRUST_CHECKPOINTS"

_STEP_DIR = re.compile(r"step_(\d+)")


def step_dirname(step: int) -> str:
    """The folder name of the checkpoint taken after `step` steps."""
    return f"step_{step:06d}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _smaller(every: int) -> str:
    if every == 1:
        return "with every=1 each save is regular: drop ephemeral_every"
    return f"use ephemeral_every < every (e.g. ephemeral_every={every // 2}), or drop one"


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


@dataclass(frozen=True)
class CheckpointConfig:
    """When the loop saves, and which saves it keeps; every option combines with the others.

    Saving: `every` saves each N steps, `ephemeral_every` each N steps as an ephemeral save
    (gone when the next save commits, unless `keep_top_k` keeps it; useful against
    preemption), `fixed_steps` at those steps (kept forever), `save_at_start` at step 0
    before the first step, `save_at_end` after the last step. A save due to `every`, a fixed
    step, the start or the end is never ephemeral.

    Keeping (the union; the newest checkpoint is always kept): `keep_last` keeps the newest N
    non-ephemeral checkpoints (None: no limit), `keep_top_k` keeps the best K by `metric`,
    lower better for `mode="min"`, higher for `mode="max"`. A save whose metrics have no
    value for `metric` (no eval ran at its step) is unranked: kept or removed by the other
    rules only. `metric` and `mode` without `keep_top_k` rank without pruning, for
    `CheckpointManager.get_best_checkpoint_path(s)`. `ephemeral_every` must be smaller than
    `every` (else no save would be ephemeral). `async_save=True` makes the loop's saves
    asynchronous: the training thread waits only while the state is copied to CPU memory,
    and one background thread writes and commits it (see `CheckpointManager.save_async`).
    `sharded=True` writes the model and optimizer states through Distributed Checkpoint
    (``torch.distributed.checkpoint``): under DDP every rank writes its share into the folder
    being saved before it commits, and the checkpoint loads on any number of ranks (see
    `lab.loop.sharded`); the rest of the state stays in ``state.pt``. With `async_save` too,
    the shards are written in the background (DCP's `async_save`) and the save commits at
    the next save or at the end of the fit.
    """

    every: int | None = None
    keep_last: int | None = None
    keep_top_k: int | None = None
    metric: str | None = None
    mode: Literal["min", "max"] | None = None
    ephemeral_every: int | None = None
    fixed_steps: Sequence[int] = ()
    save_at_end: bool = True
    save_at_start: bool = False
    async_save: bool = False
    sharded: bool = False

    def __post_init__(self) -> None:
        for name in ("every", "ephemeral_every"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ConfigError(f"CheckpointConfig({name}={value!r}): use an int >= 1, or None")
        for name in ("keep_last", "keep_top_k"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ConfigError(f"CheckpointConfig({name}={value!r}): use an int >= 1, or None")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(
                f"CheckpointConfig(keep_last={self.keep_last}) would keep nothing; "
                "use a value >= 1, or None to keep every checkpoint"
            )
        if self.keep_top_k is not None and self.keep_top_k < 1:
            raise ConfigError(
                f"CheckpointConfig(keep_top_k={self.keep_top_k}) would keep nothing; "
                "use a value >= 1, or None to rank nothing"
            )
        for name in ("save_at_end", "save_at_start", "async_save", "sharded"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"CheckpointConfig({name}={getattr(self, name)!r}): use True or False"
                )
        given = self.fixed_steps
        listed = isinstance(given, Iterable) and not isinstance(given, (str, bytes))
        steps = tuple(given) if listed else ()
        if not listed or not all(_is_int(s) and s >= 0 for s in steps):
            raise ConfigError(
                f"CheckpointConfig(fixed_steps={given!r}): give a list of steps, ints >= 0"
            )
        object.__setattr__(self, "fixed_steps", tuple(sorted(set(steps))))
        self._check_ranking()
        every, ephemeral = self.every, self.ephemeral_every
        if every is not None and ephemeral is not None and ephemeral >= every:
            raise ConfigError(
                f"CheckpointConfig(every={every}, ephemeral_every={ephemeral}) makes no save "
                f"ephemeral: each one would also be due to every; {_smaller(every)}"
            )
        if not (self.every or self.ephemeral_every or self.fixed_steps) and not (
            self.save_at_end or self.save_at_start
        ):
            raise ConfigError(
                "CheckpointConfig never saves: set every=N, ephemeral_every=N, fixed_steps=[...], "
                "save_at_start=True or save_at_end=True, or pass checkpoint=None"
            )

    def _check_ranking(self) -> None:
        metric, mode, top_k = self.metric, self.mode, self.keep_top_k
        if metric is not None and (not isinstance(metric, str) or not metric):
            raise ConfigError(
                f"CheckpointConfig(metric={metric!r}): name a metric logged before each save, "
                "e.g. 'val/loss'"
            )
        if mode is not None and mode not in ("min", "max"):
            raise ConfigError(
                f"CheckpointConfig(mode={mode!r}): use 'min' (lower is better) "
                "or 'max' (higher is better)"
            )
        if top_k is not None and metric is None:
            raise ConfigError(
                f"CheckpointConfig(keep_top_k={top_k}) needs a metric to rank by: add "
                "metric='val/loss' (logged before each save) and mode='min' or mode='max'"
            )
        if metric is not None and mode is None:
            raise ConfigError(
                f"CheckpointConfig(metric={metric!r}) needs a direction: add mode='min' "
                "(lower is better) or mode='max' (higher is better)"
            )
        if mode is not None and metric is None:
            raise ConfigError(
                f"CheckpointConfig(mode={mode!r}) ranks nothing without a metric: add "
                "metric='val/loss' (a step or eval metric), or drop mode"
            )

    def due(self, step: int, num_steps: int) -> bool:
        """Whether to save after step `step` (step 0: before the first step) of `num_steps`.

        The loop asks after every step, so this is a few integer tests.
        """
        if step == 0:
            return self.save_at_start or 0 in self.fixed_steps
        return (
            (self.every is not None and step % self.every == 0)
            or (self.ephemeral_every is not None and step % self.ephemeral_every == 0)
            or step in self.fixed_steps
            or (self.save_at_end and step == num_steps)
        )

    def is_ephemeral(self, step: int, num_steps: int | None = None, *, final: bool = False) -> bool:
        """Whether a save at `step` is ephemeral, i.e. removed once the next save commits.

        Only a save due to `ephemeral_every` alone is: one also due to `every`, a fixed step,
        the start or the end (`step == num_steps`, or `final` for a run stopped early) is not,
        since those are the saves the config asked to keep.
        """
        if self.ephemeral_every is None or step < 1 or step % self.ephemeral_every:
            return False
        if (self.every is not None and step % self.every == 0) or step in self.fixed_steps:
            return False
        at_end = final or (num_steps is not None and step == num_steps)
        return not (self.save_at_end and at_end)

    def kind(self, step: int, num_steps: int | None = None, *, final: bool = False) -> Kind:
        """How a save at `step` is kept: "fixed" (forever), "ephemeral" or "regular"."""
        if step in self.fixed_steps:
            return "fixed"
        return "ephemeral" if self.is_ephemeral(step, num_steps, final=final) else "regular"


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


@dataclass
class _Entry:
    """The bookkeeping of one step: its latest save row, where that sits, and its removal."""

    save: ManifestRow
    order: int
    removal: ManifestRow | None = None


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


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


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


def _is_complete(path: Path) -> bool:
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
        self._rows: list[ManifestRow] = self._read_manifest()
        self._entries: dict[int, _Entry] = {}
        self._pending: _PendingSave | None = None
        self._rebuild()
        for entry in self._entries.values():
            self._inside(entry.save.path)
        self._warn_inconsistencies()

    # -- queries ---------------------------------------------------------------------------
    def history(self) -> list[ManifestRow]:
        """Every manifest row, oldest first: what was saved and removed, and why."""
        return list(self._rows)

    def checkpoints(self) -> list[int]:
        """The steps of the checkpoints that exist now, oldest commit first."""
        return [e.save.step for e in self._committed()]

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
        self.read_latest()
        committed = self._committed()
        return self.root / committed[-1].save.path if committed else None

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
        ranked = self._ranked(self._committed(), metric, mode)
        return [self.root / e.save.path for e in ranked[:k]]

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
        if _is_int(target):
            return self._resolve_step(int(target))
        if target == "latest":
            latest = self.get_latest_checkpoint_path()
            if latest is None:
                raise CheckpointError(f"no checkpoint in {self.root} yet; train first")
            return latest
        path = Path(target)
        if isinstance(target, str) and target.isdigit() and not path.exists():
            return self._resolve_step(int(target))
        if not path.exists() and not path.is_absolute() and (self.root / path).exists():
            path = self.root / path
        in_root = path.resolve().parent == self.root.resolve()
        entry = self._entry_named(path.name) if in_root else None
        if entry is not None and entry.removal is not None:
            raise CheckpointError(
                f"{path} was removed ({entry.removal.reason}); {self._available()}"
            )
        if not path.exists():
            raise CheckpointError(
                f"checkpoint {path} does not exist; pass a checkpoint folder or a step "
                f"({self._available()})"
            )
        if path.is_dir() and path.resolve() == self.root.resolve():
            raise CheckpointError(
                f"{path} is the checkpoint root, not a checkpoint; pass a step or one of its "
                f"step_* folders ({self._available()})"
            )
        if not in_root:
            raise CheckpointError(
                f"{path} is outside this run's checkpoint folder {self.root}; resume from a "
                f"step or one of its step_* folders ({self._available()}), or copy the "
                "checkpoint in first"
            )
        if not _is_complete(path):
            raise CheckpointError(
                f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker or no "
                f"{STATE_FILE}): an interrupted save or not a checkpoint folder "
                f"({self._available()})"
            )
        return path

    def read_latest(self) -> Path | None:
        """The checkpoint the `latest` file names (None without one), checked like a row.

        `latest` is a plain file anyone can edit, so what it names must be a committed
        checkpoint (a save row of the manifest, not removed since, whose folder inside the
        root is complete), or this raises CheckpointError naming the file and the fix.
        """
        path = self.root / LATEST_FILE
        fix = f"delete or fix that file ({self._available()})"
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
            raise CheckpointError(f"cannot read {path}: {_one_line(exc)}; {fix}") from exc
        folder = self._inside(name, source=LATEST_FILE)
        entry = self._entry_named(name)
        if entry is None:
            why = "no save row of manifest.jsonl records"
        elif entry.removal is not None:
            why = f"was removed ({entry.removal.reason})"
        elif not _is_complete(folder):
            why = "is missing or incomplete"
        else:
            return folder
        raise CheckpointError(f"{path} names {name!r}, a checkpoint that {why}; {fix}")

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
        for entry in sorted(self._entries.values(), key=lambda e: e.order):
            if entry.removal is None:
                continue
            folder = self._inside(entry.save.path)
            if folder.is_dir() and not folder.is_symlink():
                shutil.rmtree(folder)
                removed.append(folder)
        return removed

    # -- bookkeeping as checkpoint state --------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The retention bookkeeping (the manifest's rows), for a checkpoint to hold."""
        return {"version": 1, "manifest": [asdict(row) for row in self._rows]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore bookkeeping saved by `state_dict`; the manifest stays the source of truth.

        If the manifest already holds those rows (and maybe later ones), nothing changes; if
        it holds only their beginning (or nothing, e.g. a folder restored from a copy of one
        checkpoint), the missing rows are appended to it. Rows that disagree are an error.
        """
        try:
            rows = [ManifestRow(**row) for row in state["manifest"]]
        except (KeyError, TypeError) as exc:
            raise CheckpointError(
                f"load_state_dict got no checkpoint bookkeeping ({_one_line(exc)}); "
                "pass what CheckpointManager.state_dict() returned"
            ) from exc
        for row in rows:
            self._inside(row.path, source="the checkpoint's bookkeeping")
        others = sorted({r.run_key for r in rows} - {self.run_key})
        if others:
            raise CheckpointError(
                f"the bookkeeping belongs to run {others[0]!r}, not {self.run_key!r}; "
                "restore it into that run's checkpoint folder"
            )
        mine = [r.to_json() for r in self._rows]
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
            self._append(row)
            self._rows.append(row)
        self._rebuild()

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
        final_dir = self._inside(step_dirname(step))  # a link that leads out is refused
        info = {"step": step, "run_key": self.run_key, "time": time.time(), **info}
        info["metrics"] = metrics
        # with `_waits`, save_async or the caller's `begin` made the folder and filled it
        tmp = self.begin(step) if _waits is None else self.root / f"{TMP_PREFIX}{final_dir.name}"
        renamed = False
        writing = tmp / STATE_FILE  # the file being written, for a full disk's message
        out: _Recording | None = None
        try:
            with open(writing, "wb") as fh:
                out = _Recording(fh)
                torch.save(state, out)
                fh.flush()
                os.fsync(fh.fileno())
            waits = list(_waits) if _waits is not None else _run_writers(writers, tmp, step)
            for pending in waits:
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
            row = ManifestRow(
                self.run_key, step, final_dir.name, "save", info["time"], metrics, kind=kind
            )
            writing = self.root / MANIFEST_FILE
            self._append(row)
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
        self._rows.append(row)
        self._entries[step] = _Entry(row, len(self._rows) - 1)
        self._point_latest(final_dir.name)
        if final:
            self._warn_if_never_ranked(step)
        return [row, *self._apply_retention()]

    def begin(self, step: int) -> Path:
        """Make the empty folder that `save(step, ..., begun=True)` will commit, and return
        it: for files written by several processes (each rank's shard of a sharded save)
        before one of them commits the save. Debris of an interrupted save is removed first."""
        tmp = self.root / f"{TMP_PREFIX}{self._inside(step_dirname(step)).name}"
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
        if metric is None or any(metric in r.metrics for r in self._rows if r.event == "save"):
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
            tmp = self.root / f"{TMP_PREFIX}{self._inside(step_dirname(step)).name}"
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

    # -- retention -----------------------------------------------------------------------------
    def _keepers(self, committed: list[_Entry]) -> dict[int, list[str]]:
        """For each committed checkpoint, the rules that keep it (empty: remove it)."""
        cfg = self.config
        keep: dict[int, list[str]] = {e.save.step: [] for e in committed}
        lasting = [e for e in committed if e.save.kind != "ephemeral"]
        if cfg.keep_last is None and cfg.keep_top_k is None:
            for e in lasting:
                keep[e.save.step].append("no limit")
        if cfg.keep_last is not None:
            for e in lasting[-cfg.keep_last :]:
                keep[e.save.step].append(f"keep_last={cfg.keep_last}")
        if cfg.keep_top_k is not None and cfg.metric is not None and cfg.mode is not None:
            for e in self._ranked(committed, cfg.metric, cfg.mode)[: cfg.keep_top_k]:
                keep[e.save.step].append(f"keep_top_k={cfg.keep_top_k}")
        for e in committed:
            if e.save.kind == "fixed" or e.save.step in cfg.fixed_steps:
                keep[e.save.step].append("fixed_steps")
        if committed:
            keep[committed[-1].save.step].append("newest")
        return keep

    @staticmethod
    def _ranked(entries: list[_Entry], metric: str, mode: str) -> list[_Entry]:
        """The entries with a number for `metric`, best first; ties: the newer first."""
        sign = 1.0 if mode == "min" else -1.0
        scored = [
            (sign * value, -e.order, e)
            for e in entries
            if (value := e.save.metrics.get(metric)) is not None and not math.isnan(value)
        ]
        scored.sort(key=lambda t: (t[0], t[1]))
        return [e for _, _, e in scored]

    def _apply_retention(self) -> list[ManifestRow]:
        committed = self._committed()
        keep = self._keepers(committed)
        rows = []
        for entry in committed:
            if keep[entry.save.step]:
                continue
            folder = self._inside(entry.save.path)  # before anything is recorded or deleted
            row = ManifestRow(
                self.run_key,
                entry.save.step,
                entry.save.path,
                "remove",
                time.time(),
                reason=_reason(self.config, entry.save.kind),
                kind=entry.save.kind,
            )
            try:
                self._append(row)
            except OSError as exc:  # retried after the next save: retention is a query
                log.warning("cannot record the removal of %s: %s", entry.save.path, exc)
                break
            self._rows.append(row)
            entry.removal = row
            shutil.rmtree(folder, ignore_errors=True)
            if folder.exists():
                log.warning("%s is recorded as removed but could not be deleted", folder)
            rows.append(row)
        return rows

    # -- bookkeeping ----------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Index the rows: each step's latest save, and its removal if one came after it."""
        self._entries = {}
        for order, row in enumerate(self._rows):
            if row.event == "save":
                self._entries[row.step] = _Entry(row, order)
            elif row.step in self._entries:
                self._entries[row.step].removal = row

    def _committed(self) -> list[_Entry]:
        return sorted(
            (
                e
                for e in self._entries.values()
                if e.removal is None and _is_complete(self.root / e.save.path)
            ),
            key=lambda e: e.order,
        )

    def _inside(self, name: Any, *, source: str = MANIFEST_FILE) -> Path:
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

    def _entry_named(self, name: str) -> _Entry | None:
        return next((e for e in self._entries.values() if e.save.path == name), None)

    def _available(self) -> str:
        steps = self.checkpoints()
        return f"available steps: {steps}" if steps else f"no checkpoints in {self.root}"

    def _resolve_step(self, step: int) -> Path:
        entry = self._entries.get(step)
        folder = self.root / step_dirname(step)
        if entry is not None and entry.removal is not None:
            raise CheckpointError(
                f"the checkpoint of step {step} was removed ({entry.removal.reason}); "
                f"{self._available()}"
            )
        if entry is not None and _is_complete(self.root / entry.save.path):
            return self.root / entry.save.path
        if entry is not None:
            raise CheckpointError(
                f"the checkpoint of step {step} is recorded but {self.root / entry.save.path} "
                f"is missing or incomplete; {self._available()}"
            )
        if _is_complete(folder):
            raise CheckpointError(
                f"{folder} is not recorded in {MANIFEST_FILE} (its save never committed); pass "
                f"its path to load it anyway; {self._available()}"
            )
        raise CheckpointError(f"no checkpoint of step {step} in {self.root}; {self._available()}")

    def _read_manifest(self) -> list[ManifestRow]:
        path = self.root / MANIFEST_FILE
        if not path.exists():
            return []
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {_one_line(exc)}") from exc
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
                    f"{path} line {number} is not a manifest row ({_one_line(exc)}); "
                    "restore that line or remove it"
                ) from exc
        return rows

    def _warn_inconsistencies(self) -> None:
        known = set()
        for entry in self._entries.values():
            known.add(entry.save.path)
            if entry.removal is None and not _is_complete(self.root / entry.save.path):
                log.warning(
                    "%s records step %d, but %s is missing or incomplete: not a checkpoint",
                    MANIFEST_FILE,
                    entry.save.step,
                    self.root / entry.save.path,
                )
        for folder in sorted(self.root.glob("step_*")):
            named = _STEP_DIR.fullmatch(folder.name) and folder.name not in known
            if named and _is_complete(folder):
                log.warning(
                    "%s is a complete checkpoint that %s does not record (its save was "
                    "interrupted before it committed); it is ignored: not listed, not the "
                    "latest, never removed; load it by path",
                    folder,
                    MANIFEST_FILE,
                )

    def _append(self, row: ManifestRow) -> None:
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

    def _point_latest(self, name: str) -> None:
        """Point `latest` at `name`; the manifest stays authoritative if this fails, and the
        old `latest` is removed then, so that it cannot name a checkpoint retention removes
        (which `read_latest` would refuse)."""
        tmp = self.root / f"{TMP_PREFIX}{LATEST_FILE}"
        try:
            _write_durable(tmp, name.encode())
            os.replace(tmp, self.root / LATEST_FILE)
        except OSError as exc:
            log.warning("cannot update %s (%s); removed it", self.root / LATEST_FILE, exc)
            for path in (tmp, self.root / LATEST_FILE):
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
