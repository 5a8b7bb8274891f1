"""sweeps: pruned runs, sampled arms and races

What sampling arms, pruning runs and racing arms over their repeats record (`lab.sweeps`):

- `runs.status` may be `pruned` (a pruning rule stopped the run early), and `runs.pruned`
  (JSON, NULL) says where and why: ``{"step", "rule", "metric", "value"}``.
- `sweep_trials`: each sampled arm as its sampler knows it (its ask order `number`, its
  arm, its parameters, when it was asked and told, its value and state), so a sweep run
  again rebuilds its sampler from them and asks only what is missing.
- `eliminations`: each arm a race dropped, with the round, the test, the statistic, the
  corrected p-value, alpha and the arm it lost to.

Changing the CHECK of `runs.status` rebuilds `runs` on SQLite (Alembic's batch mode: copy,
drop, rename), with every index, key and constraint it had; `lab.store.migrations` runs it
with foreign keys off, so dropping the old table deletes no row that refers to it, and
this revision refuses to rebuild a `runs` that holds rows with them on. Every existing
row is kept. The downgrade drops the two tables and the column, and refuses while a run
is `pruned`.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD_RUN = "status IN ('running', 'completed', 'failed', 'stopped', 'crashed')"
_NEW_RUN = "status IN ('running', 'completed', 'failed', 'stopped', 'crashed', 'pruned')"
_TRIAL_STATE = "state IN ('running', 'complete', 'pruned', 'failed')"


def _foreign_keys_off() -> None:
    """Refuse to rebuild a `runs` that holds rows on SQLite while foreign keys are on:
    dropping the old table would delete every row that refers to it (ON DELETE CASCADE)."""
    bind = op.get_bind()
    if bind.dialect.name != "sqlite" or not bind.exec_driver_sql("PRAGMA foreign_keys").scalar():
        return
    if bind.exec_driver_sql("SELECT 1 FROM runs LIMIT 1").first() is not None:
        raise RuntimeError(
            "revision 0009 rebuilds the runs table, which with SQLite's foreign keys on "
            "would delete the rows that refer to it; upgrade with: lab db upgrade"
        )


def upgrade() -> None:
    _foreign_keys_off()
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("pruned", sa.JSON(none_as_null=True), nullable=True))
        batch.drop_constraint(op.f("ck_runs_status"), type_="check")
        batch.create_check_constraint(op.f("ck_runs_status"), _NEW_RUN)
    op.create_table(
        "sweep_trials",
        sa.Column("experiment_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("arm_id", sa.Integer(), nullable=False),
        sa.Column("params", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("asked_after", sa.Integer(), nullable=False),
        sa.Column("told", sa.Integer(), nullable=True),
        sa.Column("value", sa.Double(), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.CheckConstraint(_TRIAL_STATE, name=op.f("ck_sweep_trials_state")),
        sa.ForeignKeyConstraint(
            ["arm_id"],
            ["arms.arm_id"],
            name=op.f("fk_sweep_trials_arm_id_arms"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["experiment_id"],
            ["experiments.experiment_id"],
            name=op.f("fk_sweep_trials_experiment_id_experiments"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("experiment_id", "number", name=op.f("pk_sweep_trials")),
    )
    op.create_table(
        "eliminations",
        sa.Column("experiment_id", sa.Integer(), nullable=False),
        sa.Column("arm_id", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("test", sa.String(length=16), nullable=False),
        sa.Column("statistic", sa.Double(), nullable=False),
        sa.Column("p_value", sa.Double(), nullable=False),
        sa.Column("alpha", sa.Double(), nullable=False),
        sa.Column("best_arm", sa.String(length=512), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["arm_id"],
            ["arms.arm_id"],
            name=op.f("fk_eliminations_arm_id_arms"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["experiment_id"],
            ["experiments.experiment_id"],
            name=op.f("fk_eliminations_experiment_id_experiments"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("experiment_id", "arm_id", name=op.f("pk_eliminations")),
    )


def downgrade() -> None:
    bind = op.get_bind()
    if bind.execute(sa.text("SELECT 1 FROM runs WHERE status = 'pruned' LIMIT 1")).first():
        raise RuntimeError(
            "downgrade below 0009: runs has rows where status = 'pruned', which the older "
            "schema cannot hold; change or delete them first"
        )
    _foreign_keys_off()
    op.drop_table("eliminations")
    op.drop_table("sweep_trials")
    with op.batch_alter_table("runs") as batch:
        batch.drop_constraint(op.f("ck_runs_status"), type_="check")
        batch.create_check_constraint(op.f("ck_runs_status"), _OLD_RUN)
        batch.drop_column("pruned")
