"""packed block points

Two columns on `metric_blocks`: each block's points packed in step order, the steps as
one-byte offsets in the block (`point_offsets`) and the values as little-endian float64s
with NaN kept (`point_values`), filled from the metrics already stored. A cut of buckets
narrower than a block reads them instead of one `metrics` row per point. Nothing else is
touched; the downgrade drops the two columns.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27 08:00:00.000000
"""

import math
import sys
from array import array
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_STEPS = 32  # the block size of revision 0006
_CHUNK = 4096  # blocks updated per statement


def upgrade() -> None:
    with op.batch_alter_table("metric_blocks") as batch:
        batch.add_column(sa.Column("point_offsets", sa.LargeBinary(), nullable=True))
        batch.add_column(sa.Column("point_values", sa.LargeBinary(), nullable=True))

    # Every block's points, read once in key order and packed per block.
    bind = op.get_bind()
    update = sa.text(
        "UPDATE metric_blocks SET point_offsets = :offsets, point_values = :values "
        'WHERE run_id = :run_id AND "key" = :key AND block = :block'
    )
    points = bind.execute(
        sa.text(
            'SELECT run_id, "key", step, value FROM metrics ORDER BY run_id, "key", step'
        ).execution_options(yield_per=65536)
    )
    pending: list[dict] = []
    where, offsets, values = None, bytearray(), array("d")

    def done() -> None:
        if where is not None:
            if sys.byteorder == "big":
                values.byteswap()
            run_id, key, block = where
            pending.append({"run_id": run_id, "key": key, "block": block,
                            "offsets": bytes(offsets), "values": values.tobytes()})  # fmt: skip
        if len(pending) >= _CHUNK:
            bind.execute(update, pending)
            pending.clear()

    for run_id, key, step, value in points:
        block = step // _STEPS
        if (run_id, key, block) != where:
            done()
            where, offsets, values = (run_id, key, block), bytearray(), array("d")
        offsets.append(step - block * _STEPS)
        values.append(math.nan if value is None else value)
    done()
    if pending:
        bind.execute(update, pending)


def downgrade() -> None:
    with op.batch_alter_table("metric_blocks") as batch:
        batch.drop_column("point_values")
        batch.drop_column("point_offsets")
