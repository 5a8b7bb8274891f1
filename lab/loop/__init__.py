"""The torch training loop, its checkpoints and its evaluators."""

from lab.loop.checkpoints import CheckpointConfig, CheckpointManager, ManifestRow
from lab.loop.evals import EvalResult, Evaluator
from lab.loop.training import LoopArtifacts, TrainingBatch, TrainingLoop

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "EvalResult",
    "Evaluator",
    "LoopArtifacts",
    "ManifestRow",
    "TrainingBatch",
    "TrainingLoop",
]
