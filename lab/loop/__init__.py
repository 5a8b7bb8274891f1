"""The torch training loop, its checkpoints and its evaluators."""

from lab.loop.checkpoints import CheckpointConfig, CheckpointManager, ManifestRow
from lab.loop.evals import EvalResult, Evaluator
from lab.loop.handle import RunHandle
from lab.loop.records import LoopArtifacts, TrainingBatch
from lab.loop.training import TrainingLoop

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "EvalResult",
    "Evaluator",
    "LoopArtifacts",
    "ManifestRow",
    "RunHandle",
    "TrainingBatch",
    "TrainingLoop",
]
