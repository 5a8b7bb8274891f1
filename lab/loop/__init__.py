"""The torch training loop, its checkpoints and its evaluators.

The names are imported on first use (PEP 562), as `lab`'s own: a module of the loop that
needs no torch (`lab.loop.metric_names`) is imported without the ones that do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lab._lazy import lazy_names

#: Where each name lives; ``lab.loop.<name>`` imports its module on first access.
_WHERE: dict[str, str] = {
    "CheckpointConfig": "lab.loop.checkpoints",
    "CheckpointManager": "lab.loop.checkpoints",
    "ManifestRow": "lab.loop.checkpoints",
    "EvalContext": "lab.loop.evals",
    "EvalResult": "lab.loop.evals",
    "Evaluator": "lab.loop.evals",
    "RunHandle": "lab.loop.handle",
    "LoopArtifacts": "lab.loop.records",
    "TrainingBatch": "lab.loop.records",
    "Schedule": "lab.loop.schedules",
    "TrainingLoop": "lab.loop.training",
}

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "EvalContext",
    "EvalResult",
    "Evaluator",
    "LoopArtifacts",
    "ManifestRow",
    "RunHandle",
    "Schedule",
    "TrainingBatch",
    "TrainingLoop",
]

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from lab.loop.checkpoints import CheckpointConfig, CheckpointManager, ManifestRow
    from lab.loop.evals import EvalContext, EvalResult, Evaluator
    from lab.loop.handle import RunHandle
    from lab.loop.records import LoopArtifacts, TrainingBatch
    from lab.loop.schedules import Schedule
    from lab.loop.training import TrainingLoop


__getattr__, __dir__ = lazy_names("lab.loop", _WHERE, globals(), __all__)
