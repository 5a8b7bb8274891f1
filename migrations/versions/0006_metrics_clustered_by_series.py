"""metrics clustered by series (SQLite)

On SQLite, `metrics` becomes a WITHOUT ROWID table: its rows live in the b-tree of its
primary key (run_id, key, step) instead of a rowid table plus a separate index on that key.
One series is then one contiguous range of that b-tree with its values in it, so reading a
series (a downsampled curve, a run's history) never looks each point up in a second tree,
and each written point updates one b-tree instead of two. Columns, constraints and rows are
unchanged; the table is rebuilt once (Alembic's batch mode copies it). PostgreSQL keeps its
heap and index: nothing changes there.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26 23:15:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _rebuild(*, with_rowid: bool) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    with op.batch_alter_table(
        "metrics", recreate="always", table_kwargs={"sqlite_with_rowid": with_rowid}
    ):
        pass


def upgrade() -> None:
    _rebuild(with_rowid=False)


def downgrade() -> None:
    _rebuild(with_rowid=True)
