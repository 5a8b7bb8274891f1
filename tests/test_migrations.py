"""Alembic: one head, revisions that build exactly the models' schema, and the wheel ships them."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path
from pprint import pformat

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

import lab
from lab.store.engine import make_engine, resolve_url
from lab.store.migrations import (
    alembic_config,
    current_revision,
    head_revision,
    is_known,
    migrations_dir,
    upgrade,
)
from lab.store.schema import NAMING, TABLES, Base

REPO = Path(__file__).resolve().parent.parent


def _schema_diff(engine: sa.Engine) -> list:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        return compare_metadata(context, Base.metadata)


def _assert_matches_models(engine: sa.Engine) -> None:
    diff = _schema_diff(engine)
    assert diff == [], (
        f"the migrations do not build the schema of lab/store/schema.py on "
        f"{engine.dialect.name}; differences (database -> models):\n{pformat(diff)}\n"
        "Fix: never edit a shipped revision; from the repository root write a new one with\n"
        '    alembic revision --autogenerate -m "what changed"\n'
        "then review it, and rerun these tests."
    )


def test_there_is_exactly_one_head() -> None:
    script = ScriptDirectory.from_config(alembic_config())
    heads = script.get_heads()
    assert len(heads) == 1, f"several Alembic heads {heads}; merge them: alembic merge heads"
    assert heads == [head_revision()]
    revisions = list(script.walk_revisions())
    assert revisions[-1].down_revision is None  # one base, the chain reaches it
    assert revisions[0].revision == head_revision()


def test_migrations_dir_holds_env_and_revisions() -> None:
    folder = migrations_dir()
    assert (folder / "env.py").is_file()
    assert (folder / "versions" / "0001_initial_schema.py").is_file()
    # a source checkout: the top-level folder; an installed wheel: lab/_migrations
    assert folder in (REPO / "migrations", Path(lab.__file__).parent / "_migrations")


def test_upgrading_an_empty_database_builds_exactly_the_models(store_url: str) -> None:
    engine = make_engine(resolve_url(store_url))
    try:
        assert current_revision(engine) is None
        before, after = upgrade(engine)
        assert (before, after) == (None, head_revision())
        assert current_revision(engine) == head_revision()
        assert set(sa.inspect(engine).get_table_names()) == {*TABLES, "alembic_version"}
        _assert_matches_models(engine)
    finally:
        engine.dispose()


def test_is_known_takes_only_the_full_id_of_one_of_our_revisions() -> None:
    assert is_known("0001") and is_known(head_revision())
    # Alembic's lookup would resolve these (a prefix, symbols), or fail with other errors
    for revision in ("f00d_from_lab_9", "0", "000", "head", "heads", "base", "", "0001@x"):
        assert not is_known(revision), revision


def test_the_models_check_constraints_are_the_migrations_word_for_word(sqlite_url: str) -> None:
    """CHECKs are built from the status tuples; autogenerate does not compare CHECKs, so
    compare their SQL text with the one the migration wrote (SQLite keeps it as written)."""
    checks = {
        c.name: str(c.sqltext)
        for table in Base.metadata.sorted_tables
        for c in table.constraints
        if isinstance(c, sa.CheckConstraint)
    }
    assert checks == {
        "ck_experiments_status": "status IN ('running', 'completed', 'failed')",
        "ck_groups_kind": "kind IN ('repeats', 'chain')",
        "ck_runs_status": "status IN ('running', 'completed', 'failed', 'stopped', 'crashed')",
        "ck_checkpoints_event": "event IN ('save', 'remove')",
    }
    engine = make_engine(resolve_url(sqlite_url))
    try:
        upgrade(engine)
        insp = sa.inspect(engine)
        for table in Base.metadata.sorted_tables:
            models = {
                c.name: str(c.sqltext)
                for c in table.constraints
                if isinstance(c, sa.CheckConstraint)
            }
            built = {c["name"]: c["sqltext"] for c in insp.get_check_constraints(table.name)}
            assert built == models, table.name
    finally:
        engine.dispose()


def test_the_check_can_fail(sqlite_url: str) -> None:
    """The comparison above sees a missing column: it is not vacuous."""
    engine = make_engine(resolve_url(sqlite_url))
    try:
        upgrade(engine)
        with engine.begin() as conn:
            conn.exec_driver_sql("ALTER TABLE runs DROP COLUMN output_dir")
        diff = _schema_diff(engine)
        assert [(d[0], d[2], d[3].name) for d in diff] == [("add_column", "runs", "output_dir")]
    finally:
        engine.dispose()


def test_downgrade_to_base_then_upgrade_again(store_url: str) -> None:
    engine = make_engine(resolve_url(store_url))
    try:
        upgrade(engine)
        with engine.begin() as conn:
            command.downgrade(alembic_config(conn), "base")
        assert set(sa.inspect(engine).get_table_names()) <= {"alembic_version"}
        assert current_revision(engine) is None
        assert upgrade(engine) == (None, head_revision())
        _assert_matches_models(engine)
    finally:
        engine.dispose()


@pytest.mark.slow
def test_alembic_command_line_sees_no_pending_changes(sqlite_url: str) -> None:
    """The developer workflow the failure message above names: alembic.ini + env.py work."""
    engine = make_engine(resolve_url(sqlite_url))
    upgrade(engine)
    engine.dispose()
    out = subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(REPO / "alembic.ini"), "check"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "LAB_STORE_URL": sqlite_url},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "No new upgrade operations detected." in out.stdout + out.stderr


EXPECTED_CONSTRAINTS = {
    "experiments": {"uq": {"uq_experiments_name"}, "fk": set(), "ck": {"ck_experiments_status"}},
    "arms": {
        "uq": {"uq_arms_experiment_id_name"},
        "fk": {"fk_arms_experiment_id_experiments"},
        "ck": set(),
    },
    "groups": {
        "uq": {"uq_groups_experiment_id_name"},
        "fk": {"fk_groups_experiment_id_experiments", "fk_groups_arm_id_arms"},
        "ck": {"ck_groups_kind"},
    },
    "runs": {
        "uq": {"uq_runs_experiment_id_run_key"},
        "fk": {
            "fk_runs_experiment_id_experiments",
            "fk_runs_group_id_groups",
            "fk_runs_arm_id_arms",
            "fk_runs_parent_run_id_runs",
        },
        "ck": {"ck_runs_status"},
    },
    "metrics": {"uq": set(), "fk": {"fk_metrics_run_id_runs"}, "ck": set()},
    "evals": {"uq": set(), "fk": {"fk_evals_run_id_runs"}, "ck": set()},
    "predictions": {"uq": set(), "fk": {"fk_predictions_eval_id_evals"}, "ck": set()},
    "checkpoints": {
        "uq": set(),
        "fk": {"fk_checkpoints_run_id_runs"},
        "ck": {"ck_checkpoints_event"},
    },
}
EXPECTED_INDEXES = {
    "runs": {"ix_runs_experiment_id_status", "ix_runs_group_id"},
    "evals": {"ix_evals_run_id_name_step"},
    "checkpoints": {"ix_checkpoints_run_id_step"},
}


def test_every_constraint_has_its_conventional_name(store_url: str) -> None:
    assert set(EXPECTED_CONSTRAINTS) == set(TABLES)
    assert NAMING["fk"] == "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s"
    engine = make_engine(resolve_url(store_url))
    try:
        upgrade(engine)
        insp = sa.inspect(engine)
        for table, want in EXPECTED_CONSTRAINTS.items():
            assert insp.get_pk_constraint(table)["name"] == f"pk_{table}"
            assert {u["name"] for u in insp.get_unique_constraints(table)} == want["uq"], table
            assert {f["name"] for f in insp.get_foreign_keys(table)} == want["fk"], table
            assert {c["name"] for c in insp.get_check_constraints(table)} == want["ck"], table
            indexes = {i["name"] for i in insp.get_indexes(table)} - want["uq"]  # PG: uq index
            assert indexes == EXPECTED_INDEXES.get(table, set()), table
    finally:
        engine.dispose()


def test_the_models_declare_the_same_names() -> None:
    """The expected names above are the models' own, so the table tests the convention."""
    for table in Base.metadata.sorted_tables:
        names = {c.name for c in table.constraints}
        want = EXPECTED_CONSTRAINTS[table.name]
        assert names == {f"pk_{table.name}", *want["uq"], *want["fk"], *want["ck"]}
        assert {i.name for i in table.indexes} == EXPECTED_INDEXES.get(table.name, set())


def test_the_wheel_ships_the_migrations(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("lab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (
        "lab/_migrations/env.py",
        "lab/_migrations/script.py.mako",
        "lab/_migrations/versions/0001_initial_schema.py",
        "lab/store/migrations.py",
        "lab/store/schema.py",
    ):
        assert path in names, f"{path} missing from {wheel.name}"
    shipped = {n for n in names if n.startswith("lab/_migrations/versions/") and n.endswith(".py")}
    in_repo = {
        f"lab/_migrations/versions/{p.name}"
        for p in (REPO / "migrations" / "versions").glob("*.py")
    }
    assert shipped == in_repo
