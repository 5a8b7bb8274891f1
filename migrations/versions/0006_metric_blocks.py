"""metric blocks

A `metric_blocks` row per (run, key) and block of 32 steps: the number of points, their
first and last step, and the min, max, sum and count of their values (NaN left out),
filled from the metrics already stored. Derived from `metrics` like an index; the metric
writer keeps it in the transaction that writes the rows, and a series is cut into buckets
from it. Nothing existing is touched.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-27 04:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# floor(step / 32), the same on SQLite and PostgreSQL (both truncate toward zero)
_BLOCK = "((step - ((step % 32) + 32) % 32) / 32)"


def upgrade() -> None:
    op.create_table(
        "metric_blocks",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=255), nullable=False),
        sa.Column("block", sa.BigInteger(), nullable=False),
        sa.Column("points", sa.BigInteger(), nullable=False),
        sa.Column("step_min", sa.BigInteger(), nullable=False),
        sa.Column("step_max", sa.BigInteger(), nullable=False),
        sa.Column("value_min", sa.Double(), nullable=True),
        sa.Column("value_max", sa.Double(), nullable=True),
        sa.Column("value_sum", sa.Double(), nullable=True),
        sa.Column("value_count", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.run_id"],
            name=op.f("fk_metric_blocks_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "key", "block", name=op.f("pk_metric_blocks")),
        sqlite_with_rowid=False,  # a range of blocks is one pass over the key's B-tree
    )

    # The metrics already stored get their blocks now. SQLite stores NaN as NULL, which
    # aggregates skip; PostgreSQL keeps NaN, left out here.
    bind = op.get_bind()
    v = "value" if bind.dialect.name == "sqlite" else "NULLIF(value, 'NaN'::double precision)"
    op.execute(
        sa.text(
            'INSERT INTO metric_blocks (run_id, "key", block, points, step_min, step_max, '
            "value_min, value_max, value_sum, value_count) "
            f'SELECT run_id, "key", {_BLOCK}, count(*), min(step), max(step), '
            f"min({v}), max({v}), sum({v}), count({v}) "
            f'FROM metrics GROUP BY run_id, "key", {_BLOCK}'
        )
    )


def downgrade() -> None:
    op.drop_table("metric_blocks")
