"""tokens and ingest batches

Two new tables for `lab serve`: `tokens` (a name, a scope, the SHA-256 hash of the token and
when it was revoked; the token itself is never stored) and `ingest_batches` (each batch of
writes a client sent, keyed by the client's id and sequence number, so a batch sent twice
stores its rows once). Nothing existing is touched.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 13:45:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tokens",
        sa.Column("token_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=512), nullable=False),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("revoked_at", sa.DateTime(), nullable=True),
        sa.CheckConstraint("scope IN ('read', 'write')", name=op.f("ck_tokens_scope")),
        sa.PrimaryKeyConstraint("token_id", name=op.f("pk_tokens")),
        sa.UniqueConstraint("name", name=op.f("uq_tokens_name")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_tokens_token_hash")),
    )
    op.create_table(
        "ingest_batches",
        sa.Column("client_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("rows", sa.BigInteger(), nullable=False),
        sa.Column("received_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("client_id", "seq", name=op.f("pk_ingest_batches")),
    )


def downgrade() -> None:
    op.drop_table("ingest_batches")
    op.drop_table("tokens")
