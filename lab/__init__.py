"""lab: run torch training experiments as arms x repeats, and record everything they do.

>>> from lab import Experiment, Arm, TrainingLoop   # the whole public surface is __all__

The public names are imported on first use (PEP 562), so ``import lab`` and the ``lab``
command stay fast: torch is imported by the names that need it, not by the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lab._lazy import lazy_names

__version__ = "0.1.0"

# The on-policy RL hooks join the lifecycle before anything reads it (light: no torch).
from lab.rl import hooks as _rl_hooks  # noqa: F401

#: Where each public name lives; ``lab.<name>`` imports its module on first access.
_WHERE: dict[str, str] = {
    "Arm": "lab.experiment",
    "ArmResult": "lab.experiment",
    "Callback": "lab.hooks",
    "CheckpointConfig": "lab.loop",
    "ConsoleLogger": "lab.loggers",
    "EvalResult": "lab.loop",
    "Evaluator": "lab.loop",
    "Experiment": "lab.experiment",
    "ExperimentResult": "lab.experiment",
    "LabError": "lab.errors",
    "LogContext": "lab.hooks",
    "LoopArtifacts": "lab.loop",
    "LoopState": "lab.hooks",
    "ManifestRow": "lab.loop",
    "Prune": "lab.sweeps",
    "Race": "lab.sweeps",
    "RunResult": "lab.experiment",
    "RunSpec": "lab.experiment",
    "SqlLogger": "lab.loggers",
    "Store": "lab.store",
    "Summary": "lab.experiment",
    "Sweep": "lab.sweeps",
    "TrainingBatch": "lab.loop",
    "TrainingLoop": "lab.loop",
    "RunHandle": "lab.loop",
    "start_run": "lab.script",
}

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
    "Prune",
    "Race",
    "RunHandle",
    "RunResult",
    "RunSpec",
    "SqlLogger",
    "Store",
    "Summary",
    "Sweep",
    "TrainingBatch",
    "TrainingLoop",
    "start_run",
]

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from lab.errors import LabError
    from lab.experiment import Arm, Experiment
    from lab.hooks import Callback, LogContext, LoopState
    from lab.loggers import ConsoleLogger, SqlLogger
    from lab.loop import (
        CheckpointConfig,
        EvalResult,
        Evaluator,
        LoopArtifacts,
        ManifestRow,
        RunHandle,
        TrainingBatch,
        TrainingLoop,
    )
    from lab.records import ArmResult, ExperimentResult, RunResult, RunSpec, Summary
    from lab.script import start_run
    from lab.store import Store
    from lab.sweeps import Prune, Race, Sweep


__getattr__, __dir__ = lazy_names("lab", _WHERE, globals(), __all__)
