"""The records a loop hands its hooks: the batch of a step, and what a fit leaves behind."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from lab.loop.checkpoints import ManifestRow
    from lab.loop.evals import EvalResult


class TrainingBatch:
    """The batch of the current step, as hooks see it: the data and where it came from.

    The loop reuses one instance for every step, so a hook that wants to keep a batch
    must copy `data`.
    """

    __slots__ = ("data", "epoch", "index")

    def __init__(self) -> None:
        self.data: Any = None
        self.epoch = 0
        self.index = 0

    @property
    def size(self) -> int | None:
        """Samples in the batch: the first dimension of its first tensor that has one (a
        0-dim ``num_tokens`` tensor beside the inputs is not a batch), else None."""
        tensor = _first_tensor(self.data)
        return None if tensor is None else int(tensor.shape[0])


@dataclass
class LoopArtifacts:
    """What a fit leaves behind: the model, its final metrics and where it stopped."""

    model: torch.nn.Module
    metrics: dict[str, float]
    step: int
    stopped: bool = False
    stop_reason: str | None = None
    checkpoint_dir: Path | None = None
    checkpoints: list[ManifestRow] = field(default_factory=list)
    evals: list[EvalResult] = field(default_factory=list)


def _first_tensor(data: Any) -> torch.Tensor | None:
    """The first tensor in `data` (nested dicts, lists, tuples) that has a dimension."""
    if hasattr(data, "dim") and hasattr(data, "shape"):
        return data if data.dim() > 0 else None
    values = data.values() if isinstance(data, dict) else data
    if isinstance(values, (list, tuple)) or isinstance(data, dict):
        for v in values:
            found = _first_tensor(v)
            if found is not None:
                return found
    return None
