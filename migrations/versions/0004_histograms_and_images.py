"""histograms and images

Two new tables for the non-scalar values a loop logs at a step (`lab.media`):
`histograms` (edges and counts as JSON, NaN and ±inf counted apart) and `images` (a PNG
file in the run folder, its path relative to the run's `output_dir`). Each is keyed by
(run, key, step) as `metrics` is, so logging a step again replaces its row, and each goes
with its run (ON DELETE CASCADE). Nothing existing is touched: no batch copy of `runs`.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25 10:40:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _keyed(table: str) -> list:
    """The (run, key, step) columns and constraints both tables share."""
    return [
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=255), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name=op.f(f"fk_{table}_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "key", "step", name=op.f(f"pk_{table}")),
    ]


def upgrade() -> None:
    op.create_table(
        "histograms",
        *_keyed("histograms"),
        sa.Column("edges", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("counts", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("nan", sa.BigInteger(), nullable=False),
        sa.Column("posinf", sa.BigInteger(), nullable=False),
        sa.Column("neginf", sa.BigInteger(), nullable=False),
        sa.Column("wall_time", sa.Double(), nullable=False),
    )
    op.create_table(
        "images",
        *_keyed("images"),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("width", sa.Integer(), nullable=False),
        sa.Column("height", sa.Integer(), nullable=False),
        sa.Column("wall_time", sa.Double(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("images")
    op.drop_table("histograms")
