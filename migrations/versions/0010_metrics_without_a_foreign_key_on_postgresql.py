"""metrics: no foreign key to runs on PostgreSQL; a trigger deletes a run's metrics

Metric batches reach PostgreSQL by COPY (`lab.store.pg_copy`), and the foreign key
`fk_metrics_run_id_runs` made the server look the run up, and lock it, for every row:
the bare COPY into `metrics` ran at about half the rate of the same COPY into a table
without it. This revision drops that key on PostgreSQL, and keeps what it gave:

- a batch for a run that is not there is still refused, whole: the transaction that
  writes it also writes its keys' `summaries` and `metric_blocks`, whose foreign keys to
  `runs` stay;
- a run deleted deletes its metrics in the same statement: the statement-level trigger
  ``trg_runs_delete_metrics`` (function ``lab_delete_run_metrics``) deletes the metrics
  of the runs a DELETE removed, cascades from an experiment, a group or an arm included.
  A TRUNCATE fires no DELETE trigger, and ``TRUNCATE runs CASCADE`` no longer reaches
  `metrics`: name it (``TRUNCATE runs, metrics CASCADE``). Lab itself never truncates.

SQLite keeps the key (its check costs little there, and dropping it would rebuild the
table). The downgrade deletes the metrics of runs that are not there (none, unless
written around lab), drops the triggers and adds the key back.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-29 10:00:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# SET search_path FROM CURRENT: the function finds the store's tables in the schema it was
# made in, whatever the session that deletes a run has set.
_FUNCTION = """
CREATE FUNCTION lab_delete_run_metrics() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT AS $$
BEGIN
    DELETE FROM metrics WHERE run_id IN (SELECT run_id FROM gone);
    RETURN NULL;
END
$$
"""
_TRIGGER = (
    "CREATE TRIGGER trg_runs_delete_metrics AFTER DELETE ON runs "
    "REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION lab_delete_run_metrics()"
)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.drop_constraint(op.f("fk_metrics_run_id_runs"), "metrics", type_="foreignkey")
    op.execute(_FUNCTION)
    op.execute(_TRIGGER)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER trg_runs_delete_metrics ON runs")
    op.execute("DROP FUNCTION lab_delete_run_metrics()")
    op.execute(
        "DELETE FROM metrics m WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.run_id = m.run_id)"
    )
    op.create_foreign_key(
        op.f("fk_metrics_run_id_runs"), "metrics", "runs", ["run_id"], ["run_id"],
        ondelete="CASCADE",
    )  # fmt: skip
