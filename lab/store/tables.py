"""The names of the store's tables, by what they hold: what a reader needs to recognise a
lab store without loading the models (`lab.store.schema`, which names these tables)."""

from __future__ import annotations

#: The tables of an experiment's record.
TABLES = (
    "experiments",
    "arms",
    "groups",
    "runs",
    "metrics",
    "summaries",
    "evals",
    "predictions",
    "checkpoints",
    "histograms",
    "images",
)

#: The tables of `lab serve`'s own bookkeeping (token hashes, batches received): no
#: experiment's record, so never exported, never shown by `lab.inspect`, never served.
PRIVATE_TABLES = ("tokens", "ingest_batches")

#: Tables derived from others and rebuilt from them (`metric_blocks` from `metrics`): no
#: record of their own, so never exported nor shown by `lab.inspect`.
DERIVED_TABLES = ("metric_blocks",)
