"""The torch training loop, its checkpoints and its evaluators."""

from lab.loop.checkpoints import CheckpointConfig, CheckpointManager, ManifestRow
from lab.loop.evals import EvalContext, EvalResult, Evaluator
from lab.loop.handle import RunHandle
from lab.loop.records import LoopArtifacts, TrainingBatch
from lab.loop.schedules import Schedule
from lab.loop.training import TrainingLoop

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
