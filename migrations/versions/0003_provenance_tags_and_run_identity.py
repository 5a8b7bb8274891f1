"""provenance, tags and notes, and what makes a run reusable

- `runs.config_hash`: a hash of what a run's result depends on (its config, seed, stage and
  train function), so a run is reused only when it would train the same thing again;
- `runs.superseded_at`: set on the runs that ``fresh=True`` replaced (kept, never deleted);
- `runs.provenance`: git commit, dirty flag, packages, versions, devices, command line, host;
- `tags` and `notes` on experiments and runs;
- `runs.process_start` and `runs.boot_id`: which process, on which boot, owns a `running`
  run, so a reused pid or another PID namespace never keeps a dead run `running` or marks a
  live one `crashed`.

Every change adds a nullable column, done in place on SQLite (no batch copy of `runs`).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25 08:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

EXPERIMENT_COLUMNS = (
    ("tags", lambda: sa.JSON(none_as_null=True)),
    ("notes", sa.Text),
)
RUN_COLUMNS = (
    ("config_hash", lambda: sa.String(length=64)),
    ("superseded_at", sa.DateTime),
    ("provenance", lambda: sa.JSON(none_as_null=True)),
    ("tags", lambda: sa.JSON(none_as_null=True)),
    ("notes", sa.Text),
    ("process_start", sa.Double),
    ("boot_id", lambda: sa.String(length=64)),
)


def upgrade() -> None:
    for name, kind in EXPERIMENT_COLUMNS:
        op.add_column("experiments", sa.Column(name, kind(), nullable=True))
    for name, kind in RUN_COLUMNS:
        op.add_column("runs", sa.Column(name, kind(), nullable=True))


def downgrade() -> None:
    # Never batch mode (see 0002): SQLite drops a column in place since 3.35.
    for name, _kind in reversed(RUN_COLUMNS):
        op.drop_column("runs", name)
    for name, _kind in reversed(EXPERIMENT_COLUMNS):
        op.drop_column("experiments", name)
