"""owners and stored images

What `lab serve` needs to tell who may write what, whether an experiment's driver is still
alive, and to serve an image without opening a path a client chose:

- `experiments`: the driver process that owns it (`host`, `pid`, `process_start`, `boot_id`,
  `heartbeat_at`, as `runs` has them), so a SIGKILLed driver's experiment can be judged
  `crashed` (a new status); and `created_by`, the name of the server token that created it
  (NULL for an experiment a local process created).
- `tokens`: `experiment`, the one experiment a token is limited to (NULL: not limited), and
  a new scope, `admin`.
- `images`: `data`, the PNG's bytes, kept in the store.

Every new column is nullable and starts NULL; the downgrade drops them, and refuses while a
row uses a status or scope the older schema does not allow.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28 09:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD_EXPERIMENT = "status IN ('running', 'completed', 'failed')"
_NEW_EXPERIMENT = "status IN ('running', 'completed', 'failed', 'crashed')"
_OLD_SCOPE = "scope IN ('read', 'write')"
_NEW_SCOPE = "scope IN ('read', 'write', 'admin')"


def upgrade() -> None:
    with op.batch_alter_table("experiments") as batch:
        batch.add_column(sa.Column("host", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("pid", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("process_start", sa.Double(), nullable=True))
        batch.add_column(sa.Column("boot_id", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("heartbeat_at", sa.DateTime(), nullable=True))
        batch.add_column(sa.Column("created_by", sa.String(length=512), nullable=True))
        batch.drop_constraint(op.f("ck_experiments_status"), type_="check")
        batch.create_check_constraint(op.f("ck_experiments_status"), _NEW_EXPERIMENT)
    with op.batch_alter_table("tokens") as batch:
        batch.add_column(sa.Column("experiment", sa.String(length=512), nullable=True))
        batch.drop_constraint(op.f("ck_tokens_scope"), type_="check")
        batch.create_check_constraint(op.f("ck_tokens_scope"), _NEW_SCOPE)
    with op.batch_alter_table("images") as batch:
        batch.add_column(sa.Column("data", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    bind = op.get_bind()
    for table, where in (("experiments", "status = 'crashed'"), ("tokens", "scope = 'admin'")):
        if bind.execute(sa.text(f"SELECT 1 FROM {table} WHERE {where} LIMIT 1")).first():
            raise RuntimeError(
                f"downgrade below 0008: {table} has rows where {where}, which the older "
                "schema cannot hold; change or delete them first"
            )
    with op.batch_alter_table("images") as batch:
        batch.drop_column("data")
    with op.batch_alter_table("tokens") as batch:
        batch.drop_constraint(op.f("ck_tokens_scope"), type_="check")
        batch.create_check_constraint(op.f("ck_tokens_scope"), _OLD_SCOPE)
        batch.drop_column("experiment")
    with op.batch_alter_table("experiments") as batch:
        batch.drop_constraint(op.f("ck_experiments_status"), type_="check")
        batch.create_check_constraint(op.f("ck_experiments_status"), _OLD_EXPERIMENT)
        for column in ("created_by", "heartbeat_at", "boot_id", "process_start", "pid", "host"):
            batch.drop_column(column)
