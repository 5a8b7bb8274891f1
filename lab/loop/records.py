"""The records a loop hands its hooks: the batch of a step, and what a fit leaves behind.

They live on the ground floor, in `lab.records`, beside the other records hooks carry.
"""

from lab.records import LoopArtifacts, TrainingBatch

__all__ = ["LoopArtifacts", "TrainingBatch"]
