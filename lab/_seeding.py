"""Seeding every random number generator a run touches, and capturing their states."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

try:  # numpy is optional: seed it when it is there
    import numpy as _np
except ImportError:  # pragma: no cover - numpy ships with the dev extra
    _np = None  # type: ignore[assignment]  # the module or None: checked before each use


def seed_everything(seed: int) -> None:
    """Seed `random`, numpy (when installed) and torch (CPU and every CUDA device), and set
    ``PL_GLOBAL_SEED``: the seed Lightning's ``seed_everything()`` and its dataloader
    workers take when given none, so a Lightning fit inside a run takes the run's seed."""
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    random.seed(seed)
    if _np is not None:
        _np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_state() -> dict[str, Any]:
    """The state of every generator, to store in a checkpoint.

    Only plain types and byte tensors, so a checkpoint holding it loads with
    `torch.load(..., weights_only=True)`: numpy's state is its dict form with the key as a
    list of ints, not an array (which only a full unpickle rebuilds).
    """
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if _np is not None:
        numpy = _np.random.get_state(legacy=False)
        numpy["state"] = {"key": numpy["state"]["key"].tolist(), "pos": numpy["state"]["pos"]}
        state["numpy"] = numpy
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore every generator from `rng_state()`, so a resumed run draws the same numbers.

    Also takes the states of older checkpoints (numpy's legacy tuple with an array).
    """
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if _np is not None and "numpy" in state:
        numpy = state["numpy"]
        if isinstance(numpy, dict):
            inner = numpy["state"]
            key = _np.asarray(inner["key"], dtype=_np.uint32)
            numpy = {**numpy, "state": {"key": key, "pos": int(inner["pos"])}}
        _np.random.set_state(numpy)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextmanager
def caller_rng_kept() -> Iterator[None]:
    """Put the caller's generators back after a block that seeds and draws from them.

    A run seeds `random`, numpy and torch with its own seed; without this, a caller that
    draws between runs (a random search: ``lr = 10 ** random.uniform(-3, -0.5)``) would draw
    the same numbers after every run. CUDA generators are saved only when CUDA is already
    initialized (saving them would initialize it, and cost a CUDA context to runs that stay
    on the CPU). When a run initializes CUDA itself, its generators are seeded afterwards
    with the caller's `torch.initial_seed()`: what `torch.manual_seed` had queued for them.
    """
    python = random.getstate()
    numpy = _np.random.get_state() if _np is not None else None
    cpu = torch.get_rng_state()
    initial_seed = torch.initial_seed()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(python)
        if numpy is not None:
            _np.random.set_state(numpy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        elif torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(initial_seed)
