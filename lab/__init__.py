"""lab: run torch training experiments as arms x repeats, and record everything they do.

>>> from lab import Experiment, Arm, TrainingLoop   # the whole public surface is __all__
"""

from lab.errors import LabError
from lab.experiment import (
    Arm,
    ArmResult,
    Experiment,
    ExperimentResult,
    RunResult,
    RunSpec,
    Summary,
)
from lab.hooks import Callback, LogContext, LoopState
from lab.loggers import ConsoleLogger, SqlLogger
from lab.loop import (
    CheckpointConfig,
    EvalResult,
    Evaluator,
    LoopArtifacts,
    ManifestRow,
    TrainingBatch,
    TrainingLoop,
)
from lab.store import Store

__version__ = "0.1.0"

__all__ = [
    "Arm",
    "ArmResult",
    "Callback",
    "CheckpointConfig",
    "ConsoleLogger",
    "EvalResult",
    "Evaluator",
    "Experiment",
    "ExperimentResult",
    "LabError",
    "LogContext",
    "LoopArtifacts",
    "LoopState",
    "ManifestRow",
    "RunResult",
    "RunSpec",
    "SqlLogger",
    "Store",
    "Summary",
    "TrainingBatch",
    "TrainingLoop",
]
