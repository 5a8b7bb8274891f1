"""Model averaging: the mean of the weights over the last steps before a merge step, saved.

`ModelAverager` is modelled on OLMo-core's ``ModelMergeCallback``: the average of the
weights over a window of steps right before a merge step is often a better model than the
weights of any one step (it smooths the noise of the last updates, much like a cheap EMA or
the end of a learning-rate decay), and computing it in the run costs only one running sum
per open window instead of keeping a checkpoint per step.

Where files go::

    <run folder>/merged/         (ctx.folder: the working directory for a bare fit
                                 without run_dir)
      step_000500/               state.pt ({"model": averaged state dict}) +
                                 training_info.json + COMPLETE
      manifest.jsonl             one row per merged save
      latest                     names the newest merged folder

The folder is written by a `CheckpointManager` of its own, so a merged save is as atomic as
a regular checkpoint (``tmp_`` folder, fsync, rename, COMPLETE marker, manifest row) and is
read back with the same loader: ``CheckpointManager(run_dir / "merged").load(500)["model"]``.
It lives outside ``checkpoints/``, so the loop's retention never removes it.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Annotated, Any

import torch
from annotated_types import MinLen

from lab._secrets import logger
from lab.callbacks.params import PositiveInt
from lab.callbacks.registry import register
from lab.errors import CheckpointError, ConfigError
from lab.hooks import Callback, LogContext, LoopState
from lab.loop.checkpoints import CheckpointConfig, CheckpointManager, step_dirname

if TYPE_CHECKING:
    from lab.records import LoopArtifacts, TrainingBatch

log = logger("lab.callbacks.averaging")

__all__ = ["EXTRAS_KEY", "ModelAverager"]

#: Where the newest merged folder of the run is published in `LogContext.extras`.
EXTRAS_KEY = "model_averager:path"

_STATE_VERSION = 1


def _sum_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float32, or the tensor's own dtype where that is wider (float64 sums stay float64)."""
    return tensor.dtype if tensor.dtype.itemsize > 4 else torch.float32


class _Window:
    """The running sum of one merge step's window: which steps it holds, and the sums.

    `sums[i]` is the float sum of the state-dict entry `keys[i]` over steps
    `first_step..first_step + count - 1`, in float32 (float64 for float64 entries), on the
    entry's own device.
    """

    __slots__ = ("count", "first_step", "keys", "merge_step", "sums")

    def __init__(
        self,
        merge_step: int,
        first_step: int,
        keys: list[str],
        sums: list[torch.Tensor],
        count: int,
    ) -> None:
        self.merge_step = merge_step
        self.first_step = first_step
        self.keys = keys
        self.sums = sums
        self.count = count

    def state_dict(self) -> dict[str, Any]:
        """Plain containers of tensors, so an async save's CPU snapshot copies the sums."""
        return {
            "merge_step": self.merge_step,
            "first_step": self.first_step,
            "count": self.count,
            "keys": list(self.keys),
            "sums": list(self.sums),
        }


@register("model_averager")
class ModelAverager(Callback):
    """Averages the weights over the `window` steps ending at each merge step, and saves it.

    Merge steps: `at_steps` (a list) or `every` (each M steps, up to the run's last step);
    give exactly one. The average at merge step s is over the weights after steps
    ``max(1, s - window + 1) .. s``: every floating-point entry of ``model.state_dict()``
    (parameters and float buffers such as BatchNorm's running statistics) is summed in float32
    (float64 entries in float64) on its own device, one fused ``torch._foreach_add_`` per
    open window and step, and divided at s; the result is cast back to the entry's dtype and
    saved on the CPU. Entries that are not floating point (BatchNorm's
    ``num_batches_tracked``) take their value at s. Merge steps past the run's `num_steps`
    never happen and are skipped (with one INFO line).

    Windows may overlap (``every < window``, or close `at_steps`): each open merge step keeps
    its own running sum, i.e. one float32 copy of the model's float state per open window,
    at most ``ceil(window / every)`` at once. Outside every window a step costs one integer
    comparison.

    Each merge is saved atomically to ``<run dir>/<folder>/step_NNNNNN/`` as
    ``{"model": averaged_state_dict}`` with a ``training_info.json`` that adds
    ``merge_step``, ``first_step``, ``last_step``, ``count`` and ``window`` to the usual
    step, run key, time and the step's metrics (see the module docstring). The folders this
    instance wrote are in `merged`, in order (across runs, when one instance serves an
    Experiment); the newest of the current run is also in ``ctx.extras["model_averager:path"]``.

    Ephemeral checkpoints: while a window holds a partial sum (after steps
    ``s - window + 1 .. s - 1``) the callback blocks ephemeral saves through
    `LoopState.block_ephemeral_checkpoints`, as OLMo-core does, so no short-lived
    checkpoint has to carry the partial sum; regular, fixed and final saves still happen.

    Resume: the open windows (their sums, counts and first steps) and the completed merge
    steps are in `state_dict`, so a run resumed from a checkpoint taken inside a window ends
    with the same merged weights as one that never stopped. A state saved at another step
    than the one training starts from (``fit(resume=<another run's checkpoint>)``) is
    dropped: that run averages from scratch. (A continual chain's stage gets no callback
    state from the previous stage at all.)
    """

    live_steps = True  # the weights after each step

    def __init__(
        self,
        *,
        window: PositiveInt,
        at_steps: Annotated[Sequence[PositiveInt], MinLen(1)] | None = None,
        every: PositiveInt | None = None,
        folder: str = "merged",
    ) -> None:
        if (at_steps is None) == (every is None):
            raise ConfigError(
                "ModelAverager needs exactly one of at_steps=[...] (the merge steps) or "
                f"every=M (merge each M steps); got at_steps={at_steps!r}, every={every!r}"
            )
        steps = sorted(set(at_steps)) if at_steps is not None else []
        path = PurePath(folder) if isinstance(folder, str) and folder.strip() else None
        if (
            path is None
            or path.is_absolute()
            or ".." in path.parts
            or path.parts[0] in {".", "checkpoints"}
        ):
            raise ConfigError(
                f"ModelAverager(folder={folder!r}): name a folder inside the run folder, "
                "other than checkpoints, e.g. 'merged'"
            )
        self.at_steps: list[int] | None = steps if at_steps is not None else None
        self.every = every
        self.window = window
        self.folder = folder
        #: The merged folders this instance wrote, oldest first.
        self.merged: list[Path] = []
        self._reset()
        self._restored = False  # load_state_dict ran since the last on_train_start

    # -- the schedule ----------------------------------------------------------------------
    def _reset(self) -> None:
        self._windows: dict[int, _Window] = {}  # merge step -> its open window
        self._completed: list[int] = []
        self._num_steps = 0
        self._wake = 0  # on_step_end does nothing for steps below this
        self._manager: CheckpointManager | None = None

    def _first_step(self, merge_step: int) -> int:
        return max(1, merge_step - self.window + 1)

    def _next_merge(self, after: int) -> int | None:
        """The first merge step > `after` within the run, or None."""
        step: int | None
        if self.every is not None:
            step = (after // self.every + 1) * self.every
        else:
            assert self.at_steps is not None
            i = bisect.bisect_right(self.at_steps, after)
            step = self.at_steps[i] if i < len(self.at_steps) else None
        return step if step is not None and step <= self._num_steps else None

    def _merges_touching(self, step: int) -> list[int]:
        """The merge steps (within the run) whose window holds `step`, oldest first."""
        out = []
        merge = self._next_merge(step - 1)
        while merge is not None and self._first_step(merge) <= step:
            out.append(merge)
            merge = self._next_merge(merge)
        return out

    def _plan(self, state: LoopState, done: int) -> None:
        """After step `done`: block ephemeral saves if the next step leaves a partial window,
        and set the next step on_step_end must look at."""
        nxt = done + 1
        partial = any(m > nxt for m in self._merges_touching(nxt))
        if partial:
            state.block_ephemeral_checkpoints(self)
        else:
            state.unblock_ephemeral_checkpoints(self)
        if self._windows:
            self._wake = nxt
            return
        # Wake one step before the next window opens, to block the save after its first step.
        merge = self._next_merge(done)
        self._wake = self._num_steps + 1 if merge is None else max(nxt, self._first_step(merge) - 1)

    # -- hooks -----------------------------------------------------------------------------
    def on_train_start(self, state: LoopState) -> None:
        """Start afresh, or keep what a resume restored, and block a window left open."""
        if not self._restored:  # a fresh fit, maybe of another run with this same instance
            self._reset()
        self._num_steps = state.num_steps
        if self._restored:
            self._keep_restored(state.step)
        self._restored = False
        self._manager = None
        if self._completed:  # merged before the resume: publish the newest again
            state.ctx.extras[EXTRAS_KEY] = self._merged_root(state.ctx) / step_dirname(
                self._completed[-1]
            )
        else:  # a previous run's path must not show as this run's
            state.ctx.extras.pop(EXTRAS_KEY, None)
        if self.at_steps is not None:
            late = [s for s in self.at_steps if s > state.num_steps]
            if late:
                log.info(
                    "model_averager: merge steps %s are past the run's %d steps; they never happen",
                    late,
                    state.num_steps,
                )
        if self._windows:
            self._to_model_devices(state.model)
        self._plan(state, state.step)

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        """Add the step's weights to each open window; merge and save at a merge step."""
        if step_idx < self._wake:  # outside every window: one comparison
            return
        merges = self._merges_touching(step_idx)
        if merges:
            entries = state.model.state_dict()
            for merge in merges:
                window = self._windows.get(merge)
                if window is None:
                    window = self._open(merge, step_idx, entries)
                else:
                    torch._foreach_add_(window.sums, self._floats(window, entries))
                    window.count += 1
            if merges[0] == step_idx:
                self._merge(state, self._windows.pop(step_idx), entries)
        self._plan(state, step_idx)

    def on_train_end(self, state: LoopState, artifacts: LoopArtifacts) -> None:
        """Lift the block: a window still open at the end never merges in this fit."""
        state.unblock_ephemeral_checkpoints(self)
        self._manager = None

    def close(self) -> None:
        """Forget the merged folder's manager; the next fit (maybe another run) makes its own."""
        self._manager = None

    # -- averaging -------------------------------------------------------------------------
    def _open(self, merge: int, step: int, entries: dict[str, torch.Tensor]) -> _Window:
        first = self._first_step(merge)
        if step != first:  # the callback joined late, or its state was not in the checkpoint
            log.warning(
                "model_averager: the window of merge step %d starts at step %d, but no sum "
                "was kept for it; averaging steps %d-%d only",
                merge,
                first,
                step,
                merge,
            )
        keys = [k for k, v in entries.items() if v.is_floating_point()]
        sums = [entries[k].detach().to(dtype=_sum_dtype(entries[k]), copy=True) for k in keys]
        window = _Window(merge, step, keys, sums, 1)
        self._windows[merge] = window
        return window

    @staticmethod
    def _floats(window: _Window, entries: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        try:
            return [entries[k] for k in window.keys]
        except KeyError as exc:
            raise ConfigError(
                f"model_averager: the model's state dict lost the entry {exc.args[0]!r} inside "
                f"the window of merge step {window.merge_step}; keep the model's structure "
                "fixed while averaging"
            ) from None

    def _merge(self, state: LoopState, window: _Window, entries: dict[str, torch.Tensor]) -> None:
        """Divide the sums, put them in a CPU copy of the state dict, and save it."""
        torch._foreach_div_(window.sums, float(window.count))
        means = dict(zip(window.keys, window.sums, strict=True))
        averaged: OrderedDict[str, torch.Tensor] = OrderedDict()
        for key, value in entries.items():  # the step's own value where nothing was summed
            source = means.get(key, value)
            averaged[key] = source.detach().to(device="cpu", dtype=value.dtype, copy=True)
        metadata = getattr(entries, "_metadata", None)
        if metadata is not None:  # module versions, as load_state_dict expects them
            averaged._metadata = metadata  # type: ignore[attr-defined]  # torch's own attribute
        info = {
            "metrics": dict(state.metrics),
            "merge_step": window.merge_step,
            "first_step": window.first_step,
            "last_step": window.merge_step,
            "count": window.count,
            "window": self.window,
        }
        manager = self._merged_manager(state.ctx)
        manager.save(window.merge_step, {"model": averaged}, info)
        path = manager.root / step_dirname(window.merge_step)
        self._completed.append(window.merge_step)
        self.merged.append(path)
        state.ctx.extras[EXTRAS_KEY] = path
        log.info(
            "model_averager: merged the weights of steps %d-%d (%d steps) into %s",
            window.first_step,
            window.merge_step,
            window.count,
            path,
        )

    def _merged_manager(self, ctx: LogContext) -> CheckpointManager:
        """The manager of this run's merged folder, made at the first merge of a fit."""
        if self._manager is None:
            manager = CheckpointManager(
                self._merged_root(ctx), CheckpointConfig(), ctx.run_key or ""
            )
            manager.remove_stale_tmp()  # a merge killed mid-write left its tmp_ folder
            self._manager = manager
        return self._manager

    def _merged_root(self, ctx: LogContext) -> Path:
        """The run's merged folder, in `ctx.folder` (the working directory for a run without
        a folder of its own)."""
        return ctx.folder / self.folder

    def _keep_restored(self, step: int) -> None:
        """Keep the restored windows that hold exactly the steps up to `step` and end at a
        merge step of this run, and the merges done by then; drop the rest with one INFO line
        (a fit resumed from another run's checkpoint holds windows that are not its own)."""
        kept = {
            m: w
            for m, w in self._windows.items()
            if w.first_step + w.count - 1 == step and m > step and self._next_merge(m - 1) == m
        }
        dropped = sorted(set(self._windows) - set(kept))
        if dropped:
            log.info(
                "model_averager: the restored sums of merge steps %s do not end at step %d, "
                "where training starts (a checkpoint of another run?); they are dropped",
                dropped,
                step,
            )
        self._windows = kept
        self._completed = [s for s in self._completed if s <= step]

    def _to_model_devices(self, model: torch.nn.Module) -> None:
        """Move restored sums (loaded on the CPU) to the devices of the entries they sum."""
        entries = model.state_dict()
        for window in self._windows.values():
            floats = self._floats(window, entries)
            if len(floats) != len(window.sums) or any(
                s.shape != t.shape for s, t in zip(window.sums, floats, strict=True)
            ):
                raise CheckpointError(
                    f"model_averager: the checkpoint's sums for merge step {window.merge_step} "
                    "do not fit this model; resume with the same model, or start fresh with "
                    "resume=False"
                )
            window.sums = [
                s.to(device=t.device, dtype=_sum_dtype(t))
                for s, t in zip(window.sums, floats, strict=True)
            ]

    # -- state -----------------------------------------------------------------------------
    @property
    def completed(self) -> list[int]:
        """The merge steps done in the current run (including before a resume)."""
        return list(self._completed)

    def state_dict(self) -> dict[str, Any]:
        """The open windows (with their sums) and the completed merges.

        The sums are the live tensors: a synchronous save writes them at once, and an
        asynchronous one copies them to the CPU before training goes on.
        """
        return {
            "version": _STATE_VERSION,
            "completed": list(self._completed),
            "windows": [w.state_dict() for w in self._windows.values()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved; `on_train_start` keeps the windows that end at
        the step training resumes from."""
        try:
            if state.get("version") != _STATE_VERSION:
                raise KeyError("version")
            for w in state["windows"]:
                if len(w["keys"]) != len(w["sums"]) or not all(
                    isinstance(t, torch.Tensor) for t in w["sums"]
                ):
                    raise ValueError("keys and sums differ")
            windows = {
                int(w["merge_step"]): _Window(
                    int(w["merge_step"]),
                    int(w["first_step"]),
                    [str(k) for k in w["keys"]],
                    list(w["sums"]),
                    int(w["count"]),
                )
                for w in state["windows"]
            }
            completed = [int(s) for s in state["completed"]]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(
                f"model_averager: the checkpoint's averaging state is not one it wrote "
                f"({type(exc).__name__}: {exc}); resume with the same lab version, or start "
                "fresh with resume=False"
            ) from None
        self._reset()
        self._windows = windows
        self._completed = completed
        self._restored = True

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the open manager (a process pool pickles callbacks)."""
        out = dict(self.__dict__)
        out["_manager"] = None
        return out
