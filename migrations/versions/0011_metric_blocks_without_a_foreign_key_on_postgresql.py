"""metric_blocks: no foreign key to runs on PostgreSQL; the trigger deletes a run's blocks

A metric batch's new blocks reach PostgreSQL by COPY (`lab.store.pg_copy`), and the foreign
key `fk_metric_blocks_run_id_runs` made the server look the run up, and lock it, for every
block: for a batch of 50,000 points (1,570 blocks) the blocks' COPY took 8.9 ms with the
key and 5.0 ms without it. The blocks are derived from `metrics`, like an index, and follow
its rows; this revision drops that key on PostgreSQL, as 0010 dropped the one of `metrics`:

- a batch for a run that is not there is still refused, whole: the transaction that writes
  it also writes its keys' `summaries`, whose foreign key to `runs` stays;
- a run deleted deletes its blocks in the same statement: the function of the trigger
  ``trg_runs_delete_metrics`` (``lab_delete_run_metrics``, revision 0010) now deletes the
  run's `metric_blocks` as well as its `metrics`. ``TRUNCATE runs CASCADE`` reaches neither.

SQLite keeps the key. The downgrade deletes the blocks of runs that are not there (none,
unless written around lab), gives the function back its 0010 body and adds the key back.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-29 07:00:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_FUNCTION = """
CREATE OR REPLACE FUNCTION lab_delete_run_metrics() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT AS $$
BEGIN
    DELETE FROM metrics WHERE run_id IN (SELECT run_id FROM gone);{blocks}
    RETURN NULL;
END
$$
"""
_BLOCKS = "\n    DELETE FROM metric_blocks WHERE run_id IN (SELECT run_id FROM gone);"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.drop_constraint(op.f("fk_metric_blocks_run_id_runs"), "metric_blocks", type_="foreignkey")
    op.execute(_FUNCTION.format(blocks=_BLOCKS))


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(_FUNCTION.format(blocks=""))
    op.execute(
        "DELETE FROM metric_blocks b "
        "WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.run_id = b.run_id)"
    )
    op.create_foreign_key(
        op.f("fk_metric_blocks_run_id_runs"), "metric_blocks", "runs", ["run_id"], ["run_id"],
        ondelete="CASCADE",
    )  # fmt: skip
