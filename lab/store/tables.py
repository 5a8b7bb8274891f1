"""The names of the store's tables, by what they hold, and the values its columns allow
(statuses, kinds, scopes): what a reader or the server needs without loading the models
(`lab.store.schema`, which names these tables and checks these values)."""

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
    "sweep_trials",
    "eliminations",
)

#: The tables of `lab serve`'s own bookkeeping (token hashes, batches received): no
#: experiment's record, so never exported, never shown by `lab.inspect`, never served.
PRIVATE_TABLES = ("tokens", "ingest_batches")

#: Tables derived from others and rebuilt from them (`metric_blocks` from `metrics`): no
#: record of their own, so never exported nor shown by `lab.inspect`.
DERIVED_TABLES = ("metric_blocks",)

#: The statuses a run, an experiment may have; the kinds of a group; a token's scopes. A
#: `pruned` run was stopped early by a pruning rule (`runs.pruned` says at which step, by
#: which rule, on which value).
RUN_STATUSES = ("running", "completed", "failed", "stopped", "crashed", "pruned")
EXPERIMENT_STATUSES = ("running", "completed", "failed", "crashed")
GROUP_KINDS = ("repeats", "chain")
TOKEN_SCOPES = ("read", "write", "admin")
#: The states of a sampled arm as its sampler knows it (`sweep_trials.state`).
TRIAL_STATES = ("running", "complete", "pruned", "failed")
#: The longest name of a race's test (`eliminations.test`: "friedman", "t").
MAX_TEST = 16
