"""Writes to the store: experiments, arms, groups, the claim and the end of a run, metrics
(through the buffered writer), evals with their predictions, checkpoint rows, tags.

Metrics are buffered (see `lab.store.writer`); every other write is one short transaction.
`Writes` gathers the parts, each in a module of its own by what it writes:
`lab.store.experiment_writes` (experiments, arms, groups), `lab.store.run_writes` (a run
from its claim to its end), `lab.store.record_writes` (metrics, evals, checkpoint rows) and
`lab.store.tag_writes` (tags and notes).
"""

from __future__ import annotations

from lab.store.experiment_writes import ExperimentWrites
from lab.store.record_writes import _PREDICTION_INSERT, RecordWrites
from lab.store.run_writes import _RUN_HAS_ROWS, RunWrites
from lab.store.tag_writes import TagWrites

__all__ = ["_PREDICTION_INSERT", "_RUN_HAS_ROWS", "Writes"]


class Writes(ExperimentWrites, RunWrites, RecordWrites, TagWrites):
    """The writing part of `lab.store.Store`: its parts by what they write."""
