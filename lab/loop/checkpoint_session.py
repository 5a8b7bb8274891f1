"""One run's checkpoints as its run handle makes them: open, save, commit, shards, restore.

`CheckpointManager` (`lab.loop.checkpoints`) writes one folder atomically and keeps the
manifest; this is what a run adds around it. Opening picks the checkpoint to resume from
(rank 0 alone under DDP, its answer sent to every rank). A save builds the payload (model,
optimizers, schedulers, scaler, the loop's progress, every RNG, the retention bookkeeping,
the callbacks' and the loop's own states) and commits it by one of four paths:

- synchronous, one process: `CheckpointManager.save`;
- asynchronous (``async_save``): `CheckpointManager.save_async`, whose rows come with the
  next save or the final wait;
- sharded (``sharded``, and any save under DDP): every rank writes its shard into the folder
  rank 0 began, then rank 0 commits, with every rank's RNG states;
- sharded and asynchronous: the shards are written in the background and the save commits
  at the next save or at the end (`commit_shards`).

Restoring loads a checkpoint back into the same objects; the RNG state comes back where the
data position is restored (`lab.loop.feed`), through `restored` and `epoch_rng`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lab._distributed import agreed, broadcast, gather_to_zero
from lab._secrets import logger
from lab._seeding import rng_state, set_rng_state
from lab.errors import CheckpointError, ConfigError, HookOrderError
from lab.loop.checkpoints import CheckpointConfig, CheckpointManager, snapshot_to_cpu
from lab.loop.payload import (
    callback_states,
    load_callback_states,
    load_model,
    load_states,
    state_keys,
    states,
)
from lab.loop.sharded import SHARDED_MARK, load_shards, save_shards, save_shards_async
from lab.records import ManifestRow

if TYPE_CHECKING:
    from lab.dispatch import Dispatcher
    from lab.hooks import LoopState

__all__ = ["RESTORED", "CheckpointSession", "Progress", "Writer"]

log = logger("lab.loop")

#: A function that writes the loop's own files into a checkpoint folder being saved; what
#: it returns (a Future, a Thread, anything with `result()`, `join()` or `wait()`) is waited
#: for before the checkpoint commits.
Writer = Callable[[Path, int], Any]

#: `Progress.epoch_open` after a resume from a save made inside an epoch (it may be ended,
#: or the next one started).
RESTORED = "restored"


@dataclass
class Progress:
    """What a run handle keeps in each checkpoint beside `LoopState`: whether an epoch is
    open (True, False or `RESTORED`), how many `start_epoch` calls the run made, the last
    value of each step metric and of each eval metric."""

    epoch_open: bool | str = False
    epochs_started: int = 0
    last: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)

    def begin_epoch(
        self, state: LoopState, epoch: int | None, next_pass: Callable[[], None] | None
    ) -> None:
        """Open the next epoch, or `epoch` when given: the first `start_epoch` keeps the
        state's epoch, each later one moves to the next (`next_pass` starts a fresh pass
        over the data, which counts the epoch itself when the pass had begun)."""
        if self.epoch_open is True:
            raise HookOrderError(
                f"start_epoch({'' if epoch is None else epoch}) while epoch "
                f"{state.epoch} is open; call loop.end_epoch() first"
            )
        if epoch is not None:
            if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
                raise ConfigError(f"start_epoch({epoch!r}): give the epoch as an int >= 0")
            state.epoch = epoch
        elif self.epochs_started:  # the next epoch: with `batches`, a fresh pass
            before = state.epoch
            if next_pass is not None:
                next_pass()  # a no-op when the pass has not begun
            if state.epoch == before:
                state.epoch += 1
                state.batch_in_epoch = 0
        self.epochs_started += 1
        self.epoch_open = True

    def close_epoch(self) -> None:
        """Close the open epoch."""
        if not self.epoch_open:
            raise HookOrderError("end_epoch() with no epoch open; call loop.start_epoch() first")
        self.epoch_open = False


class CheckpointSession:
    """Save and restore one run's training state through its `CheckpointManager`.

    `model`, `optimizers`, `schedulers` (by name), `scaler` and `stateful` are what each
    checkpoint holds, with `progress`, `user_state` and `loop_state` (a driving loop's own
    entries). `attach` gives it the run's state and callbacks once the handle starts;
    `manager` is None until `open`, and stays None without a `CheckpointConfig`.
    """

    def __init__(
        self,
        config: CheckpointConfig | None,
        model: torch.nn.Module,
        optimizers: dict[str, Any],
        schedulers: dict[str, Any],
        scaler: Any,
        stateful: Mapping[str, Any] | None,
    ) -> None:
        self.config = config
        self.model = model
        self.optimizers = optimizers
        self.schedulers = schedulers
        self.scaler = scaler
        self.stateful: Mapping[str, Any] = {} if stateful is None else stateful
        self.progress = Progress()
        self.user_state: dict[str, Any] = {}
        self.loop_state: dict[str, Any] = {}
        self.save_kind: Callable[[int, bool], Any] | None = None
        self.writers: list[Writer] = []
        self.manager: CheckpointManager | None = None
        self.last_saved = -1
        #: The payload resumed from, until `lab.loop.feed` restores its RNG states.
        self.restored: dict[str, Any] | None = None
        self.epoch_rng: dict[str, Any] | None = None  # RNG at the current epoch's start
        # an asynchronous sharded save whose shards are being written: (future, step, rank
        # 0's payload, its metrics, final, kind); committed by the next save or `finish`
        self.pending_shards: tuple[Any, ...] | None = None
        self.shard_group: Any = None  # the process group asynchronous shards are saved on
        self.across_ranks = False

    def attach(self, state: LoopState, hooks: Dispatcher) -> None:
        """The run's state and its callbacks (whose states each checkpoint holds)."""
        self.state = state
        self.hooks = hooks
        self.across_ranks = state.world_size > 1

    def check(self, folder: Path | None, resume: Any, hooks: Dispatcher) -> None:
        """Fail before any hook, and before a step is spent, on what keeps a save from being
        made: no folder to save in, a `resume` without checkpoints, two callbacks whose
        states share a key."""
        if self.config is not None:
            if folder is None:
                raise ConfigError(
                    "checkpoints need a folder: run under an Experiment (or lab.start_run), "
                    "or pass run_dir=..."
                )
            state_keys(hooks.stateful())
        elif resume not in (True, False):
            raise ConfigError(
                f"resume={resume!r} needs checkpoints: pass checkpoint=CheckpointConfig(...)"
            )

    def due(self, step: int, save: bool | None, num_steps: int | None) -> bool:
        """Whether a save follows `step`: what the loop says (`save`), else the config's
        schedule; a save due only as an ephemeral one is skipped while a callback blocks
        those."""
        config = self.config
        if self.manager is None or config is None:
            return False
        if save is not None:
            return save
        return config.due(step, num_steps) and not (
            self.state.ephemeral_checkpoints_blocked and config.is_ephemeral(step, num_steps)
        )

    def due_at_end(self, step: int) -> bool:
        """Whether the run's end saves: the config asks for it and the last step is unsaved."""
        config = self.config
        return (
            self.manager is not None
            and config is not None
            and config.save_at_end
            and step > 0
            and self.last_saved != step
        )

    # ------------------------------------------------------------------------------------
    # open: the manager, and the checkpoint to resume from
    def open(
        self, folder: Path | None, run_key: str, resume: bool | str | Path | int
    ) -> Path | None:
        """Open the run's checkpoint folder; return the checkpoint to resume from, if any.

        Under DDP rank 0 moves earlier saves aside, clears debris and picks the checkpoint;
        its failure fails every rank, and the others open the folder once it is done."""
        if self.config is None:
            return None
        if not self.across_ranks:
            self.manager, path = self._open(folder, run_key, resume)
            return path
        if self.config.sharded and self.config.async_save:
            import torch.distributed as dist

            # the background writes' collectives on a group of their own, never mixed with
            # the training thread's
            self.shard_group = dist.new_group(backend="gloo")
        self.manager, path = agreed(lambda: self._open(folder, run_key, resume))
        path = broadcast(path)
        if self.state.rank != 0:
            self.manager = self._manager(folder, run_key, fresh=False)
        return path

    def _open(
        self, folder: Path | None, run_key: str, resume: bool | str | Path | int
    ) -> tuple[CheckpointManager | None, Path | None]:
        """The manager (earlier saves moved aside for a fresh start, the debris of
        interrupted saves removed) and the checkpoint to resume from; rank 0's alone."""
        if self.state.rank != 0:
            return None, None
        manager = self._manager(folder, run_key, fresh=resume is False)
        manager.remove_stale_tmp()
        if resume is False:
            return manager, None
        if resume is True:
            return manager, manager.get_latest_checkpoint_path()
        return manager, manager.resolve(resume)

    def _manager(self, folder: Path | None, run_key: str, *, fresh: bool) -> CheckpointManager:
        assert folder is not None and self.config is not None  # checked before any hook
        root = Path(folder) / "checkpoints"
        if fresh and root.exists() and any(root.iterdir()):
            stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S-%f")
            aside = root.with_name(f"checkpoints.replaced-{stamp}")
            root.rename(aside)  # a fresh start never deletes what an earlier run saved
            log.warning("starting fresh: earlier checkpoints moved to %s", aside)
        return CheckpointManager(root, self.config, run_key)

    # ------------------------------------------------------------------------------------
    # save: the payload, and the four ways to commit it
    def save(self, fresh: dict[str, float], *, final: bool = False) -> list[ManifestRow]:
        """Save the training state; returns the manifest rows to fire `on_checkpoint` for.

        Synchronous: this save's rows. With `async_save`: the rows of the previous save,
        which is waited for first (so the payload's retention bookkeeping includes it); this
        save's rows come from the next save or from the wait in `finish`, so `on_checkpoint`
        fires for every row, in save order, on the training thread.
        """
        manager = self.manager
        assert manager is not None
        if self.across_ranks or manager.config.sharded:  # one process: one shard
            return self._save_across_ranks(manager, fresh, final)
        rows = manager.wait() if manager.in_flight else []
        payload = self.payload(manager)
        return rows + self._commit(manager, payload, fresh, final)

    def payload(self, manager: CheckpointManager) -> dict[str, Any]:
        """What a checkpoint holds: each value one a safe load (weights_only) accepts."""
        state, progress = self.state, self.progress
        return {
            "model": self.model.state_dict(),
            **states("optimizer", self.optimizers),
            **states("scheduler", self.schedulers),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "loop": {
                **state.state_dict(),
                "epoch_open": bool(progress.epoch_open),
                "epochs_started": progress.epochs_started,
            },
            "metrics": dict(state.metrics),
            "last_metrics": dict(progress.last),
            "eval_metrics": dict(progress.eval_metrics),
            "rng": rng_state(),
            "epoch_rng": self.epoch_rng,
            "retention": manager.state_dict(),
            "callbacks": callback_states(state_keys(self.hooks.stateful())),
            "objects": {name: obj.state_dict() for name, obj in self.stateful.items()},
            "user": dict(self.user_state),
            **self.loop_state,
        }

    def _kind(self, step: int, final: bool) -> Any:
        return self.save_kind(step, final) if self.save_kind is not None else None

    def _commit(
        self,
        manager: CheckpointManager,
        payload: dict[str, Any],
        fresh: dict[str, float],
        final: bool,
        *,
        begun: bool = False,
    ) -> list[ManifestRow]:
        step = self.state.step
        info = {"metrics": fresh}
        self.last_saved = step
        writers = tuple(self.writers)
        kind = self._kind(step, final)
        if not manager.config.async_save:
            return manager.save(
                step, payload, info, final=final, writers=writers, kind=kind, begun=begun
            )
        return manager.save_async(step, payload, info, final=final, writers=writers, kind=kind)

    def _save_across_ranks(
        self, manager: CheckpointManager, fresh: dict[str, float], final: bool
    ) -> list[ManifestRow]:
        """A save under DDP. Rank 0 writes ``state.pt`` with every rank's RNG states (each
        rank resumes its own draws); with ``sharded=True`` every rank first writes its shard
        of the model and optimizers into the folder rank 0 made (DCP's closing collective
        is the barrier: all shards are on disk before rank 0 commits). Rank 0's manifest
        rows, or its failure, reach every rank, so `on_checkpoint` fires everywhere."""
        state = self.state
        zero = state.rank == 0
        self.last_saved = state.step
        ranks = gather_to_zero((rng_state(), self.epoch_rng))
        sharded = manager.config.sharded
        background = sharded and manager.config.async_save
        before = self.commit_shards() if background else []
        future = None
        if sharded:
            folder = self.from_zero(lambda: manager.begin(state.step))
            optimizers = list(self.optimizers.values())
            if background:
                future = save_shards_async(folder, self.model, optimizers, self.shard_group)
            else:
                save_shards(folder, self.model, optimizers)

        def commit() -> list[ManifestRow]:
            if not zero:
                return []
            rows = manager.wait() if manager.in_flight else []
            if background:  # committed once the shards are written: by the next save
                return rows
            payload = self._zero_payload(manager, ranks, sharded)
            return rows + self._commit(manager, payload, fresh, final, begun=sharded)

        if background:
            kind = self._kind(state.step, final)
            # rank 0's state as it is now, whatever training changes after
            payload = snapshot_to_cpu(self._zero_payload(manager, ranks, sharded)) if zero else None
            self.pending_shards = (future, state.step, payload, dict(fresh), final, kind)
        return before + self.from_zero(commit)

    def _zero_payload(
        self, manager: CheckpointManager, ranks: Any, sharded: bool
    ) -> dict[str, Any]:
        """Rank 0's payload: every rank's RNG states; the shards' mark for sharded saves."""
        payload = self.payload(manager)
        assert ranks is not None
        payload["ranks"] = {
            "world_size": self.state.world_size,
            "rng": [rng for rng, _ in ranks],
            "epoch_rng": [epoch_rng for _, epoch_rng in ranks],
        }
        if sharded:
            payload["model"] = SHARDED_MARK
            payload.update(states("optimizer", {}))
            payload.pop("optimizers", None)
        return payload

    def commit_shards(self) -> list[ManifestRow]:
        """Wait for the asynchronous sharded save in flight (every rank its shard; DCP's
        closing collective tells each rank when all are written), then commit it on rank 0
        through the usual protocol; its rows, or its failure, on every rank."""
        pending, self.pending_shards = self.pending_shards, None
        if pending is None:
            return []
        future, step, payload, fresh, final, kind = pending
        error: BaseException | None = None
        try:
            future.result()
        except Exception as exc:
            error = exc
        manager = self.manager
        assert manager is not None

        def commit() -> list[ManifestRow]:
            if self.state.rank != 0:
                return []
            if error is not None:
                raise CheckpointError(
                    f"background sharded save of step {step} failed: {error}"
                ) from error
            return manager.save(
                step, payload, {"metrics": fresh}, final=final, kind=kind, begun=True
            )

        return self.from_zero(commit)

    def wait(self) -> list[ManifestRow]:
        """The rows of the save in flight, once it is durable; under DDP rank 0's, on every
        rank (a collective: every rank calls it)."""
        manager = self.manager
        if manager is None or not (manager.in_flight or self.across_ranks):
            return []
        return self.from_zero(manager.wait)

    def abandon(self) -> None:
        """After a failure: wait for what is in flight (never torn, never left running),
        logging a failure of its own; sharded shards never commit (a tmp_ folder)."""
        pending, self.pending_shards = self.pending_shards, None
        if pending is not None:
            try:
                pending[0].result()
            except Exception as error:
                log.error("the sharded checkpoint save in flight also failed: %s", error)
        manager = self.manager
        if manager is not None and manager.in_flight:
            try:
                manager.wait()
            except CheckpointError as error:
                log.error("the checkpoint save in flight also failed: %s", error)

    def from_zero(self, fn: Callable[[], Any]) -> Any:
        """Rank 0's `fn()` on every rank (each rank calls `fn`; rank 0's error raises on
        all); `fn()` itself without DDP."""
        if not self.across_ranks:
            return fn()
        zero = self.state.rank == 0
        return broadcast(agreed(fn if zero else lambda: None))

    # ------------------------------------------------------------------------------------
    # restore
    def restore(self, path: Path) -> None:
        """Load `path` into the model, optimizers, schedulers, objects, loop state and
        callbacks; the RNG comes back in `batches` (or here, when the loop never asks)."""
        manager = self.manager
        assert manager is not None
        payload = self._for_this_rank(manager.load(path))
        state, progress = self.state, self.progress
        self._load_training_state(payload, path)
        load_callback_states(payload.get("callbacks") or {}, path, self.hooks)
        for name, obj in self.stateful.items():
            saved = (payload.get("objects") or {}).get(name)
            if saved is None:
                log.warning("resuming from %s: no saved state for stateful[%r]", path, name)
            else:
                obj.load_state_dict(saved)
        self.user_state.update(payload.get("user") or {})
        for key in self.loop_state:  # the driving loop's own entries, as they were saved
            if key in payload:
                self.loop_state[key] = payload[key]
        state.load_state_dict(payload["loop"])
        saved_loop = payload["loop"]
        progress.epochs_started = int(saved_loop.get("epochs_started", 0))
        progress.epoch_open = RESTORED if saved_loop.get("epoch_open") else False
        state.metrics = dict(payload.get("metrics", {}))
        progress.last = dict(payload.get("last_metrics", state.metrics))
        progress.eval_metrics.update(payload.get("eval_metrics", {}))
        self.last_saved = state.step
        self.restored = payload
        set_rng_state(payload["rng"])  # `batches` re-draws an epoch's order first, if used

    def _for_this_rank(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The payload with this rank's own RNG states, when it was saved on as many ranks
        as run now (else rank 0's, which every rank then draws from alike)."""
        ranks = payload.get("ranks")
        state = self.state
        if not ranks or ranks.get("world_size") != state.world_size:
            return payload
        rank = state.rank
        return {**payload, "rng": ranks["rng"][rank], "epoch_rng": ranks["epoch_rng"][rank]}

    def start_from(self, path: Path, full: bool) -> None:
        """Start at step 0 from another run's checkpoint: its weights, or its whole state.

        Even with `full` (``carry="full"``) the callbacks' states stay behind: a stage is a
        new run, and what a callback counted in the run before (EarlyStopping's best value
        and bad checks, StabilityMonitor's histories) is not this run's, so each starts
        fresh. Carrying them would let a stage be stopped at its first step for the previous
        stage's lack of progress. Model, optimizers, schedulers and grad scaler do carry:
        they are the training state a stage continues from.
        """
        payload = CheckpointManager(path.parent).load(path)
        if full:
            self._load_training_state(payload, path)
        elif payload.get("model") == SHARDED_MARK:
            load_shards(path, self.model, [])
        else:
            load_model(self.model, payload, path)

    def _load_training_state(self, payload: Mapping[str, Any], path: Path) -> None:
        """Load the model, optimizers, schedulers and grad scaler; callbacks are the caller's."""
        if payload.get("model") == SHARDED_MARK:  # resharded onto the ranks that run now
            load_shards(path, self.model, list(self.optimizers.values()))
        else:
            load_model(self.model, payload, path)
            load_states("optimizer", self.optimizers, payload, path)
        load_states("scheduler", self.schedulers, payload, path)
        if self.scaler is not None and payload.get("scaler") is not None:
            self.scaler.load_state_dict(payload["scaler"])
