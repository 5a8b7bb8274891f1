"""summaries and heartbeats

A `summaries` row per (run, key), filled from the metrics already stored, and a
`runs.heartbeat_at` column that the metric writer keeps fresh while a run is running.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 09:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "summaries",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=255), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("last_value", sa.Double(), nullable=True),
        sa.Column("min_value", sa.Double(), nullable=True),
        sa.Column("max_value", sa.Double(), nullable=True),
        sa.Column("last_wall_time", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name=op.f("fk_summaries_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "key", name=op.f("pk_summaries")),
    )
    op.add_column("runs", sa.Column("heartbeat_at", sa.DateTime(), nullable=True))

    # The metrics already stored get their summaries now.
    bind = op.get_bind()
    finite = "" if bind.dialect.name == "sqlite" else " FILTER (WHERE value <> 'NaN')"
    op.execute(
        f"""
        INSERT INTO summaries (run_id, "key", "count", first_step, last_step, last_value,
                               min_value, max_value, last_wall_time)
        SELECT m.run_id, m."key", count(*), min(m.step), max(m.step),
               (SELECT l.value FROM metrics l WHERE l.run_id = m.run_id AND l."key" = m."key"
                ORDER BY l.step DESC LIMIT 1),
               min(m.value){finite}, max(m.value){finite},
               (SELECT l.wall_time FROM metrics l WHERE l.run_id = m.run_id AND l."key" = m."key"
                ORDER BY l.step DESC LIMIT 1)
        FROM metrics m
        GROUP BY m.run_id, m."key"
        """
    )


def downgrade() -> None:
    # Never batch mode here: on SQLite it would copy `runs` and drop the original, and with
    # foreign keys on, that drop cascades into every table that refers to runs. SQLite
    # drops a column in place since 3.35.
    op.drop_column("runs", "heartbeat_at")
    op.drop_table("summaries")
