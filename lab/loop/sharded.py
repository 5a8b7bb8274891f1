"""Sharded checkpoints: the model and optimizer states through Distributed Checkpoint (DCP).

With ``CheckpointConfig(sharded=True)`` a save writes, besides ``state.pt`` (the loop's
progress, RNG, callbacks: small, written by rank 0), a ``dcp/`` folder where every rank
writes its share of the model and optimizer states with ``torch.distributed.checkpoint``.
The save commits through the same protocol as any other (`CheckpointManager`): rank 0 makes
``tmp_step_N/``, every rank writes its shard into it, DCP's closing collective waits for all
of them (the barrier), and only then does rank 0 write ``state.pt``, the COMPLETE marker,
rename the folder and append the manifest row. A kill at any point before the rename leaves
a ``tmp_`` folder that is never read.

The states are taken with ``torch.distributed.checkpoint.state_dict.get_state_dict``, which
names parameters by their plain names (no DDP ``module.`` prefix), so a checkpoint saved on N
ranks loads on M ranks, or in one process without DDP, and DCP reshards on load.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lab.errors import CheckpointError

#: The folder inside a checkpoint where the ranks' shards are.
SHARDS = "dcp"
#: What ``state.pt`` holds under "model" for a sharded checkpoint.
SHARDED_MARK = "sharded:dcp"


def _no_dist() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: that is the
    intent here (a sharded checkpoint loaded or saved without DDP), so say nothing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _states(model: torch.nn.Module, optimizers: list[Any]) -> tuple[Any, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, optimizers)


def save_shards(folder: Path, model: torch.nn.Module, optimizers: list[Any]) -> None:
    """Write this rank's share of the model and optimizer states under `folder`/dcp.

    A collective: every rank calls it with the same folder, and it returns once every
    rank's shard and the metadata are written."""
    import torch.distributed.checkpoint as dcp

    model_state, optim_state = _states(model, optimizers)
    state = {"model": model_state, "optim": optim_state} if optimizers else {"model": model_state}
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=folder / SHARDS, no_dist=_no_dist())


def save_shards_async(
    folder: Path, model: torch.nn.Module, optimizers: list[Any], group: Any
) -> Any:
    """Start writing this rank's share in the background (DCP's `async_save`: the states are
    copied to CPU memory first, so training may go on); returns the Future to wait for
    before the save commits. A collective, like `save_shards`, on `group`."""
    import torch.distributed.checkpoint as dcp

    model_state, optim_state = _states(model, optimizers)
    state = {"model": model_state, "optim": optim_state} if optimizers else {"model": model_state}
    with _quiet_single_process():
        return dcp.async_save(
            state, checkpoint_id=folder / SHARDS, process_group=group, no_dist=_no_dist()
        )


def load_shards(folder: Path, model: torch.nn.Module, optimizers: list[Any]) -> None:
    """Load `folder`/dcp into the model and optimizers, on however many ranks run now."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if not (folder / SHARDS).is_dir():
        raise CheckpointError(
            f"checkpoint {folder} is marked sharded but has no {SHARDS}/ folder; pick another "
            "checkpoint, or start fresh with resume=False"
        )
    model_state, optim_state = _states(model, optimizers)
    state = {"model": model_state, "optim": optim_state} if optimizers else {"model": model_state}
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=folder / SHARDS, no_dist=_no_dist())
    except Exception as exc:
        reason = " ".join(str(exc).split())[:300]
        raise CheckpointError(
            f"checkpoint {folder} does not fit this model and optimizer ({reason}); load a "
            "checkpoint of the same model, or start fresh with resume=False"
        ) from None
    if optimizers:
        set_state_dict(
            model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    else:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
