"""Alembic: one head, revisions that build exactly the models' schema, and the wheel ships them.

Upgrades keep every row (both ways), run under the database's own lock with the revision read
after it, and back a SQLite file with data up first.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import sqlite3
import struct
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from pprint import pformat

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

import lab
from lab.store import Store
from lab.store.engine import make_engine, resolve_url, transaction
from lab.store.migrations import (
    PG_MIGRATION_LOCK_KEY,
    alembic_config,
    current_revision,
    ensure_schema,
    head_revision,
    is_known,
    migration_transaction,
    migrations_dir,
    revisions,
    upgrade,
)
from lab.store.schema import DERIVED_TABLES, NAMING, PRIVATE_TABLES, TABLES, Base, compared_on

REPO = Path(__file__).resolve().parent.parent


def _schema_diff(engine: sa.Engine) -> list:
    with engine.connect() as conn:
        opts = {"compare_type": True, "include_object": compared_on(conn.dialect.name)}
        context = MigrationContext.configure(conn, opts=opts)
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


def _by_alembic(engine: sa.Engine) -> None:
    """Every revision from the first, through Alembic (`upgrade` makes a new SQLite store
    from the models instead)."""
    with migration_transaction(engine) as conn:
        command.upgrade(alembic_config(conn), "head")


def test_upgrading_an_empty_database_builds_exactly_the_models(store_url: str) -> None:
    engine = make_engine(resolve_url(store_url))
    try:
        assert current_revision(engine) is None
        _by_alembic(engine)
        assert current_revision(engine) == head_revision()
        assert set(sa.inspect(engine).get_table_names()) == {
            *TABLES,
            *PRIVATE_TABLES,
            *DERIVED_TABLES,
            "alembic_version",
        }
        _assert_matches_models(engine)
    finally:
        engine.dispose()


def _shape(path: Path) -> dict[str, object]:
    """Everything SQLite knows of a database's schema, as its PRAGMAs report it: each table's
    columns (type, NOT NULL, default, key), foreign keys, indexes with their columns, CHECKs,
    whether it is WITHOUT ROWID; and the revision it is stamped with. Not the CREATE text:
    its clauses may come in another order with the same meaning."""
    con = sqlite3.connect(path)
    try:
        shape: dict[str, object] = {}
        for name, wr, sql in con.execute(
            "SELECT t.name, t.wr, m.sql FROM pragma_table_list t JOIN sqlite_master m "
            "ON m.name = t.name WHERE t.schema = 'main' AND t.type = 'table' ORDER BY t.name"
        ):
            indexes = {}
            for _seq, idx, unique, origin, partial in con.execute(
                "SELECT * FROM pragma_index_list(?)", (name,)
            ):
                columns = con.execute(
                    'SELECT seqno, cid, name, "desc", coll, "key" FROM pragma_index_xinfo(?)',
                    (idx,),
                ).fetchall()
                # SQLite numbers the indexes of UNIQUE constraints in the order they come
                key = tuple(c[2] for c in columns) if idx.startswith("sqlite_autoindex") else idx
                indexes[key] = (unique, origin, partial, columns)
            shape[name] = {
                "without_rowid": wr,
                "columns": con.execute("SELECT * FROM pragma_table_xinfo(?)", (name,)).fetchall(),
                "foreign_keys": sorted(  # without their ids: the order they were declared in
                    con.execute(
                        'SELECT seq, "table", "from", "to", on_update, on_delete, match '
                        "FROM pragma_foreign_key_list(?)",
                        (name,),
                    ).fetchall()
                ),
                "indexes": indexes,
                "checks": sorted(re.findall(r"CONSTRAINT (\w+) CHECK \((.*)\)", sql)),
            }
        shape["revision"] = con.execute("SELECT version_num FROM alembic_version").fetchall()
        shape["version_table"] = con.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'alembic_version'"
        ).fetchall()
        return shape
    finally:
        con.close()


def test_a_new_sqlite_store_made_without_alembic_is_the_migrations_one(tmp_path: Path) -> None:
    """A new SQLite store is made from the models and stamped at head, without importing
    Alembic; it is the database every revision run from the first makes."""
    fast, migrated = tmp_path / "fast.db", tmp_path / "migrated.db"
    made = subprocess.run(
        [sys.executable, "-c",
         "import sys; from lab.store import Store; Store(sys.argv[1]).close(); "
         "print(sorted(m for m in ('alembic', 'numpy') if m in sys.modules))",
         f"sqlite:///{fast}"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert made.stdout == "[]\n"
    engine = make_engine(resolve_url(f"sqlite:///{migrated}"))
    try:
        _by_alembic(engine)
    finally:
        engine.dispose()
    assert _shape(fast) == _shape(migrated)
    assert _shape(fast)["revision"] == [(head_revision(),)]
    assert _shape(fast)["metric_blocks"]["without_rowid"] == 1  # type: ignore[index]


def test_a_store_made_without_alembic_downgrades_and_upgrades_through_alembic(
    tmp_path: Path,
) -> None:
    """Alembic takes a store made from the models as its own: every revision down and up."""
    engine = make_engine(resolve_url(f"sqlite:///{tmp_path / 'fast.db'}"))
    try:
        assert upgrade(engine) == (None, head_revision())
        with migration_transaction(engine) as conn:
            command.downgrade(alembic_config(conn), "base")
        assert current_revision(engine) is None
        _by_alembic(engine)
        assert current_revision(engine) == head_revision()
        _assert_matches_models(engine)
    finally:
        engine.dispose()


def test_the_revisions_read_without_alembic_are_alembics() -> None:
    scripts = ScriptDirectory.from_config(alembic_config())
    assert revisions() == {s.revision: s.down_revision for s in scripts.walk_revisions()}
    assert head_revision() == scripts.get_current_head()


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
        "ck_experiments_status": "status IN ('running', 'completed', 'failed', 'crashed')",
        "ck_groups_kind": "kind IN ('repeats', 'chain')",
        "ck_runs_status": (
            "status IN ('running', 'completed', 'failed', 'stopped', 'crashed', 'pruned')"
        ),
        "ck_checkpoints_event": "event IN ('save', 'remove')",
        "ck_tokens_scope": "scope IN ('read', 'write', 'admin')",
        "ck_sweep_trials_state": "state IN ('running', 'complete', 'pruned', 'failed')",
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
        with migration_transaction(engine) as conn:
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
    "summaries": {"uq": set(), "fk": {"fk_summaries_run_id_runs"}, "ck": set()},
    "evals": {"uq": set(), "fk": {"fk_evals_run_id_runs"}, "ck": set()},
    "predictions": {"uq": set(), "fk": {"fk_predictions_eval_id_evals"}, "ck": set()},
    "checkpoints": {
        "uq": set(),
        "fk": {"fk_checkpoints_run_id_runs"},
        "ck": {"ck_checkpoints_event"},
    },
    "histograms": {"uq": set(), "fk": {"fk_histograms_run_id_runs"}, "ck": set()},
    "images": {"uq": set(), "fk": {"fk_images_run_id_runs"}, "ck": set()},
    "tokens": {
        "uq": {"uq_tokens_name", "uq_tokens_token_hash"},
        "fk": set(),
        "ck": {"ck_tokens_scope"},
    },
    "ingest_batches": {"uq": set(), "fk": set(), "ck": set()},
    "metric_blocks": {"uq": set(), "fk": {"fk_metric_blocks_run_id_runs"}, "ck": set()},
    "sweep_trials": {
        "uq": set(),
        "fk": {"fk_sweep_trials_experiment_id_experiments", "fk_sweep_trials_arm_id_arms"},
        "ck": {"ck_sweep_trials_state"},
    },
    "eliminations": {
        "uq": set(),
        "fk": {"fk_eliminations_experiment_id_experiments", "fk_eliminations_arm_id_arms"},
        "ck": set(),
    },
}
EXPECTED_INDEXES = {
    "runs": {"ix_runs_experiment_id_status", "ix_runs_group_id"},
    "evals": {"ix_evals_run_id_name_step"},
    "checkpoints": {"ix_checkpoints_run_id_step"},
}


def test_every_constraint_has_its_conventional_name(store_url: str) -> None:
    assert set(EXPECTED_CONSTRAINTS) == {*TABLES, *PRIVATE_TABLES, *DERIVED_TABLES}
    assert NAMING["fk"] == "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s"
    engine = make_engine(resolve_url(store_url))
    try:
        upgrade(engine)
        insp = sa.inspect(engine)
        for table, want in EXPECTED_CONSTRAINTS.items():
            assert insp.get_pk_constraint(table)["name"] == f"pk_{table}"
            assert {u["name"] for u in insp.get_unique_constraints(table)} == want["uq"], table
            fks = want["fk"]
            if engine.dialect.name == "postgresql":  # metrics (0010), blocks (0011): none
                fks = fks - {"fk_metrics_run_id_runs", "fk_metric_blocks_run_id_runs"}
            assert {f["name"] for f in insp.get_foreign_keys(table)} == fks, table
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


# -- upgrading a store that holds data ------------------------------------------------------

NAN = float("nan")
# The metrics seeded at 0001: {(run_id, key): [(step, value)]}; None is a NaN point (seeded as
# NaN on PostgreSQL, as NULL on SQLite, where NULL is how a NaN is stored).
SEEDED = {
    (1, "loss"): [(0, 2.5), (1, 1.25), (2, -0.5), (5, 0.75), (9, 0.125)],
    (1, "acc"): [(0, 0.1), (3, None), (4, 0.9), (7, 0.4), (8, None)],  # last point: NaN
    (1, "lr"): [(2, 1e-3)],
    (2, "loss"): [(10, None), (11, None)],  # every point NaN: min and max are NULL
    (2, "grad_norm"): [(0, float("inf")), (1, 3.0), (2, float("-inf")), (3, 2.0)],
    (3, "loss"): [(i, 100.0 - i * 0.5) for i in range(0, 400, 7)],
}
ZERO_ONE_TABLES = ("experiments", "arms", "groups", "runs", "metrics", "evals", "predictions",
                   "checkpoints")  # fmt: skip
PK = {
    "experiments": "experiment_id",
    "arms": "arm_id",
    "groups": "group_id",
    "runs": "run_id",
    "metrics": 'run_id, "key", step',
    "evals": "eval_id",
    "predictions": "eval_id, idx",
    "checkpoints": "checkpoint_id",
}


def _seed_0001(conn: sa.Connection) -> None:
    """Rows in every table of revision 0001, written with raw SQL as 0001 knew them."""
    pg = conn.dialect.name == "postgresql"
    nan = NAN if pg else None
    ts = "2026-11-22 10:15:00"
    conn.execute(
        sa.text(
            "INSERT INTO experiments (experiment_id, name, status, config, seed, repeats, "
            "created_at, ended_at, callback_errors) VALUES "
            "(1, 'sweep', 'completed', :cfg, 7, 2, :ts, :ts, NULL), "
            "(2, 'other', 'running', '{}', 8, 1, :ts, NULL, :errs)"
        ),
        {"cfg": '{"lr": 0.001}', "ts": ts, "errs": '[{"callback": "x"}]'},
    )
    conn.execute(
        sa.text(
            "INSERT INTO arms (arm_id, experiment_id, name, overrides, config) VALUES "
            "(1, 1, 'base', '{}', '{\"lr\": 0.001}'), (2, 1, 'big', '{\"w\": 2}', '{}')"
        )
    )
    conn.execute(
        sa.text(
            'INSERT INTO "groups" (group_id, experiment_id, arm_id, name, kind) VALUES '
            "(1, 1, 1, 'base', 'repeats'), (2, 1, 2, 'big', 'chain'), "
            "(3, 2, NULL, 'solo', 'repeats')"
        )
    )
    conn.execute(
        sa.text(
            'INSERT INTO runs (run_id, experiment_id, group_id, arm_id, run_key, "repeat", '
            "stage, seed, config, status, error, traceback, summary, callback_errors, "
            "output_dir, parent_run_id, host, pid, started_at, ended_at) VALUES "
            "(1, 1, 1, 1, 'base/0', 0, 0, 11, '{}', 'completed', NULL, NULL, "
            "'{\"loss\": 0.125}', NULL, '/out/1', NULL, 'h', 101, :ts, :ts), "
            "(2, 1, 2, 2, 'big/0', 0, 0, 12, '{}', 'failed', 'boom', 'Traceback', NULL, "
            "NULL, NULL, NULL, 'h', 102, :ts, :ts), "
            "(3, 1, 2, 2, 'big/0/1', 0, 1, 13, '{}', 'crashed', NULL, NULL, NULL, NULL, "
            "'/out/3', 2, 'h', 103, :ts, NULL), "
            "(4, 2, 3, NULL, 'solo/0', 0, 0, 14, '{}', 'running', NULL, NULL, NULL, NULL, "
            "NULL, NULL, 'h', 104, :ts, NULL)"
        ),
        {"ts": ts},
    )
    rows = [
        {"r": run, "k": key, "s": step, "v": nan if value is None else value, "w": 1000.0 + step}
        for (run, key), points in SEEDED.items()
        for step, value in points
    ]
    conn.execute(
        sa.text('INSERT INTO metrics (run_id, "key", step, value, wall_time) '
                "VALUES (:r, :k, :s, :v, :w)"),
        rows,
    )  # fmt: skip
    conn.execute(
        sa.text(
            "INSERT INTO evals (eval_id, run_id, name, step, metrics, breakdowns, tags, seconds, "
            "error, created_at) VALUES (1, 1, 'val', 9, '{\"acc\": 0.5}', '{}', '{}', 0.5, NULL, "
            ":ts), (2, 3, 'val', NULL, '{}', '{}', '{}', 1.0, 'failed', :ts)"
        ),
        {"ts": ts},
    )
    conn.execute(
        sa.text(
            "INSERT INTO predictions (eval_id, idx, example_id, input, output, target, score, "
            "extras) VALUES (1, 0, 'a', 'in', 'out', 'tgt', 1.0, NULL), "
            "(1, 1, 'b', NULL, NULL, NULL, NULL, '{\"k\": 1}')"
        )
    )
    conn.execute(
        sa.text(
            "INSERT INTO checkpoints (checkpoint_id, run_id, step, path, event, metrics, reason, "
            "created_at) VALUES (1, 1, 5, '/ck/5', 'save', '{}', NULL, :ts), "
            "(2, 1, 5, '/ck/5', 'remove', '{}', 'kept 1', :ts)"
        ),
        {"ts": ts},
    )


def _nan_safe(value: object) -> object:
    return "NaN" if isinstance(value, float) and math.isnan(value) else value


def _dump(conn: sa.Connection, columns: dict[str, list[str]]) -> dict[str, list[tuple]]:
    """Every row of each table, in primary-key order, through the given columns only."""
    out = {}
    for table, names in columns.items():
        select = ", ".join(f'"{n}"' for n in names)
        rows = conn.exec_driver_sql(f'SELECT {select} FROM "{table}" ORDER BY {PK[table]}')
        out[table] = [tuple(_nan_safe(v) for v in row) for row in rows]
    return out


def _columns(engine: sa.Engine) -> dict[str, list[str]]:
    insp = sa.inspect(engine)
    return {t: [c["name"] for c in insp.get_columns(t)] for t in ZERO_ONE_TABLES}


def _expected_summaries(pg: bool) -> list[tuple]:
    """The summaries 0002's backfill must compute from SEEDED, in (run_id, key) order."""
    out = []
    for (run, key), points in sorted(SEEDED.items()):
        finite = [v for _s, v in points if v is not None]
        last_step, last_value = max(points)[0], sorted(points)[-1][1]
        stored_last = ("NaN" if pg else None) if last_value is None else last_value
        out.append((run, key, len(points), min(points)[0], last_step, stored_last,
                    min(finite, default=None), max(finite, default=None),
                    1000.0 + last_step))  # fmt: skip
    return out


def _summaries(conn: sa.Connection) -> list[tuple]:
    rows = conn.exec_driver_sql(
        'SELECT run_id, "key", "count", first_step, last_step, last_value, min_value, '
        'max_value, last_wall_time FROM summaries ORDER BY run_id, "key"'
    )
    return [tuple(_nan_safe(v) for v in row) for row in rows]


def _at_0001_with_data(
    engine: sa.Engine, then: Callable[[], object] = lambda: None
) -> tuple[dict[str, list[str]], dict[str, list]]:
    """Migrate an empty database to 0001, call `then`, and seed it; returns its columns and
    rows."""
    assert upgrade(engine, "0001") == (None, "0001")
    then()
    with transaction(engine) as conn:
        _seed_0001(conn)
    columns = _columns(engine)
    with engine.connect() as conn:
        before = _dump(conn, columns)
    assert len(before["metrics"]) == sum(map(len, SEEDED.values()))
    return columns, before


def test_upgrade_keeps_every_row_and_backfills_summaries_exactly(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """0001 with data -> head -> 0001 -> head: no row lost either way, and the summaries
    are exact (NaN counted, left out of min and max, kept as the last value)."""
    engine = make_engine(resolve_url(store_url))
    pg = engine.dialect.name == "postgresql"
    try:
        columns, seeded = _at_0001_with_data(engine)
        assert upgrade(engine) == ("0001", head_revision())
        _assert_matches_models(engine)
        with engine.connect() as conn:
            assert _dump(conn, columns) == seeded
            assert _summaries(conn) == _expected_summaries(pg)
            heartbeats = conn.exec_driver_sql("SELECT heartbeat_at FROM runs").scalars().all()
            assert heartbeats == [None] * 4

        with migration_transaction(
            engine
        ) as conn:  # down: drop the column in place, drop summaries
            command.downgrade(alembic_config(conn), "0001")
        assert current_revision(engine) == "0001"
        assert "summaries" not in sa.inspect(engine).get_table_names()
        assert _columns(engine) == columns
        with engine.connect() as conn:
            assert _dump(conn, columns) == seeded  # runs, and all that cascades from them

        assert upgrade(engine) == ("0001", head_revision())
        _assert_matches_models(engine)
        with engine.connect() as conn:
            assert _dump(conn, columns) == seeded
            assert _summaries(conn) == _expected_summaries(pg)
    finally:
        engine.dispose()
    capsys.readouterr()  # SQLite announced its backups; the backup tests check that


# -- the lock: taken first, the revision read after it ----------------------------------------


def _lock_statement(engine: sa.Engine) -> str:
    return "pg_advisory_xact_lock" if engine.dialect.name == "postgresql" else "BEGIN IMMEDIATE"


def _record_statements(engine: sa.Engine) -> list[str]:
    statements: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def _seen(_conn, _cursor, statement, parameters, _context, _many) -> None:
        statements.append(f"{statement} {parameters}")

    return statements


def test_upgrade_locks_before_it_reads_the_revision(store_url: str) -> None:
    engine = make_engine(resolve_url(store_url))
    try:
        statements = _record_statements(engine)
        upgrade(engine)
        lock = next(i for i, s in enumerate(statements) if _lock_statement(engine) in s)
        read = next(i for i, s in enumerate(statements) if "alembic_version" in s)
        assert lock == 0 and lock < read, statements[: read + 1]
    finally:
        engine.dispose()


def _hold_the_lock(conn: sa.Connection) -> None:
    """Take the migration lock on `conn` the way `upgrade` does (the transaction holds it)."""
    if conn.dialect.name == "postgresql":
        conn.execute(sa.select(sa.func.pg_advisory_xact_lock(PG_MIGRATION_LOCK_KEY)))


def _wait_until_blocked(engine: sa.Engine) -> None:
    """Return once another session waits for the advisory lock (on SQLite, give it a moment:
    it waits inside sqlite3's busy handler, which nothing can observe)."""
    if engine.dialect.name != "postgresql":
        time.sleep(0.5)
        return
    deadline = time.monotonic() + 20
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            waiting = conn.exec_driver_sql(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            ).scalar()
            conn.rollback()
            if waiting:
                return
            time.sleep(0.05)
    pytest.fail("the second upgrade never waited for the advisory lock")


def test_an_upgrade_that_waited_for_the_lock_finds_head_and_does_nothing(store_url: str) -> None:
    """While one session holds the lock and migrates, a second `upgrade` waits; once the
    first commits, the second reads head (not the empty database it saw before) and does
    nothing. Reading the revision before taking the lock would try to create every table
    a second time."""
    engine = make_engine(resolve_url(store_url))
    results: list[object] = []

    def second() -> None:
        try:
            results.append(upgrade(engine))
        except Exception as exc:  # reported by the assertion below
            results.append(exc)

    try:
        with transaction(engine) as holder:
            _hold_the_lock(holder)
            thread = threading.Thread(target=second)
            thread.start()
            _wait_until_blocked(engine)
            assert thread.is_alive() and not results
            command.upgrade(alembic_config(holder), "head")
        thread.join(30)
        assert not thread.is_alive()
        assert results == [(head_revision(), head_revision())]
        assert results[0].backup is None
        with engine.connect() as conn:
            versions = conn.exec_driver_sql("SELECT version_num FROM alembic_version").all()
        assert versions == [(head_revision(),)]
    finally:
        engine.dispose()


def test_ensure_schema_at_head_reads_once_and_takes_no_lock(store_url: str) -> None:
    """Opening a store at head must not wait for a writer (or a migration) elsewhere."""
    engine = make_engine(resolve_url(store_url))
    other = make_engine(resolve_url(store_url))
    try:
        upgrade(engine)
        statements = _record_statements(engine)
        done = threading.Event()
        with transaction(other) as holder:  # the write lock (SQLite), the advisory lock (PG)
            _hold_the_lock(holder)
            thread = threading.Thread(target=lambda: (ensure_schema(engine), done.set()))
            thread.start()
            thread.join(10)
            assert done.is_set(), "ensure_schema waited for the lock at head"
        assert not any(_lock_statement(engine) in s for s in statements), statements
        assert not any("CREATE" in s or "INSERT" in s for s in statements), statements
    finally:
        engine.dispose()
        other.dispose()


# -- backups of SQLite files before an upgrade ------------------------------------------------

BACKUP_NAME = re.compile(r"lab\.db\.bak-0001-\d{8}T\d{6}")


def _rows(path: Path, table: str) -> int:
    """How many rows `table` has in the SQLite file at `path` (-1: no such table)."""
    con = sqlite3.connect(path)
    try:
        return con.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]
    except sqlite3.OperationalError:
        return -1
    finally:
        con.close()


def test_a_sqlite_file_with_data_is_backed_up_before_it_is_upgraded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "lab.db"
    url = f"sqlite:///{db}"
    engine = make_engine(url)
    # A reader that stays open keeps the WAL from being checkpointed into the main file
    # when the engine's connections close: the seeded rows are in lab.db-wal only.
    keeper = sqlite3.connect(db)
    try:
        columns, seeded = _at_0001_with_data(
            engine, then=lambda: keeper.execute("SELECT count(*) FROM sqlite_master").fetchone()
        )
        engine.dispose()
        main_only = tmp_path / "main-only.db"
        shutil.copyfile(db, main_only)
        assert _rows(main_only, "metrics") < len(seeded["metrics"])  # a copy would lose them

        engine = make_engine(url)
        capsys.readouterr()
        with caplog.at_level(logging.WARNING, logger="lab.store.migrations"):
            result = upgrade(engine)
        assert result == ("0001", head_revision())
        backup = result.backup
        assert backup is not None and backup.parent == db.parent
        assert BACKUP_NAME.fullmatch(backup.name), backup.name
        line = (
            f"lab: backed up {db} to {backup} before upgrading its schema 0001 -> {head_revision()}"
        )
        assert capsys.readouterr().err.splitlines() == [line]
        assert [r.getMessage() for r in caplog.records] == [line.removeprefix("lab: ")]
        assert caplog.records[0].levelno == logging.WARNING

        con = sqlite3.connect(backup)
        try:
            assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            assert con.execute("PRAGMA journal_mode").fetchone() == ("delete",)  # one file
            assert con.execute("SELECT version_num FROM alembic_version").fetchall() == [("0001",)]
            assert "summaries" not in {
                r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
        finally:
            con.close()
        copy = make_engine(f"sqlite:///{backup}")
        try:
            with copy.connect() as conn:
                assert _dump(conn, columns) == seeded
        finally:
            copy.dispose()
        with engine.connect() as conn:  # and the upgraded store kept its rows
            assert _dump(conn, columns) == seeded

        assert upgrade(engine).backup is None  # at head: nothing to do, nothing to back up
        # "upgrading" to an older revision does nothing (as in Alembic), and backs up nothing
        assert upgrade(engine, "0001") == (head_revision(), head_revision())
        assert capsys.readouterr().err == ""
        assert len([p for p in tmp_path.iterdir() if ".bak-" in p.name]) == 1
    finally:
        keeper.close()
        engine.dispose()


def test_no_backup_of_an_empty_database_or_one_in_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    Store(f"sqlite:///{tmp_path / 'fresh.db'}").close()  # new: created at head
    engine = make_engine(f"sqlite:///{tmp_path / 'lab.db'}")
    try:  # at 0001 with no rows
        upgrade(engine, "0001")
        assert upgrade(engine) == ("0001", head_revision())
    finally:
        engine.dispose()
    memory = make_engine("sqlite:///:memory:")
    try:  # at 0001 with rows, but no file to copy
        _at_0001_with_data(memory)
        result = upgrade(memory)
        assert result == ("0001", head_revision()) and result.backup is None
    finally:
        memory.dispose()
    assert sorted(p.name for p in tmp_path.iterdir() if ".bak-" in p.name) == []
    assert "backed up" not in capsys.readouterr().err


def test_lab_db_upgrade_says_once_where_the_backup_is(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from lab.cli import app

    db = tmp_path / "lab.db"
    engine = make_engine(f"sqlite:///{db}")
    try:
        _at_0001_with_data(engine)
    finally:
        engine.dispose()
    capfd.readouterr()
    app(["db", "upgrade", "--store", f"sqlite:///{db}"], standalone_mode=False)
    out, err = capfd.readouterr()
    (backup,) = (p for p in tmp_path.iterdir() if ".bak-" in p.name)
    assert err.splitlines() == [
        f"lab: backed up {db} to {backup} before upgrading its schema 0001 -> {head_revision()}"
    ]
    assert out.strip() == f"upgraded sqlite:///{db} from 0001 to {head_revision()}"


# -- 0003: provenance, tags and notes, process identity --------------------------------------

NEW_IN_0003 = {
    "experiments": ["tags", "notes"],
    "runs": ["config_hash", "superseded_at", "provenance", "tags", "notes", "process_start",
             "boot_id"],
}  # fmt: skip


def test_0003_adds_its_columns_and_keeps_every_row_both_ways(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """0002 with data -> 0003 -> 0002 -> 0003: every row kept, the new columns appear (NULL
    on old rows), and disappear again with what was written into them."""
    engine = make_engine(resolve_url(store_url))
    try:
        _at_0001_with_data(engine)
        assert upgrade(engine, "0002") == ("0001", "0002")
        at_0002 = _columns(engine)
        with engine.connect() as conn:
            rows_0002 = _dump(conn, at_0002)
            summaries = _summaries(conn)
        assert len(rows_0002["runs"]) == 4 and len(rows_0002["experiments"]) == 2

        assert upgrade(engine, "0003") == ("0002", "0003")
        columns = _columns(engine)
        for table, names in NEW_IN_0003.items():
            assert columns[table] == at_0002[table] + names
        with engine.connect() as conn:
            assert _dump(conn, at_0002) == rows_0002
            assert _summaries(conn) == summaries
            nulls = _dump(conn, {"experiments": ["experiment_id", *NEW_IN_0003["experiments"]],
                                 "runs": ["run_id", *NEW_IN_0003["runs"]]})  # fmt: skip
        assert nulls["experiments"] == [(1, None, None), (2, None, None)]
        assert nulls["runs"] == [(i, *[None] * 7) for i in (1, 2, 3, 4)]

        with transaction(engine) as conn:  # the new columns hold data before going down
            conn.execute(
                sa.text(
                    "UPDATE runs SET provenance = :p, tags = :t, notes = 'n', "
                    "process_start = 1.5, boot_id = 'b', config_hash = 'h' WHERE run_id = 1"
                ),
                {"p": '{"git": {"commit": null}}', "t": '["best"]'},
            )
            conn.execute(sa.text("UPDATE experiments SET tags = '[\"x\"]', notes = 'why'"))
        with migration_transaction(engine) as conn:
            command.downgrade(alembic_config(conn), "0002")
        assert current_revision(engine) == "0002"
        assert _columns(engine) == at_0002
        with engine.connect() as conn:
            assert _dump(conn, at_0002) == rows_0002
            assert _summaries(conn) == summaries

        assert upgrade(engine, "0003") == ("0002", "0003")
        with engine.connect() as conn:
            assert _dump(conn, at_0002) == rows_0002
            again = _dump(conn, {"runs": ["run_id", *NEW_IN_0003["runs"]]})
        assert again["runs"] == [(i, *[None] * 7) for i in (1, 2, 3, 4)]
    finally:
        engine.dispose()
    capsys.readouterr()


# -- 0005: tokens and ingest batches (lab serve) -----------------------------------------------


def test_0005_adds_tokens_and_ingest_batches_and_keeps_every_row_both_ways(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """0004 with data -> 0005 -> 0004 -> 0005: every earlier row kept; the two new tables
    appear empty, take a token's hash and a batch's (client, seq), and go again with them."""
    from lab.server.auth import create_token, hash_token, token_scope

    engine = make_engine(resolve_url(store_url))
    try:
        _at_0001_with_data(engine)
        assert upgrade(engine, "0004") == ("0001", "0004")
        at_0004 = _columns(engine)
        with engine.connect() as conn:
            rows_0004 = _dump(conn, at_0004)
            summaries = _summaries(conn)
        tables_0004 = set(sa.inspect(engine).get_table_names())
        assert not {"tokens", "ingest_batches"} & tables_0004

        assert upgrade(engine, "0005") == ("0004", "0005")
        assert set(sa.inspect(engine).get_table_names()) == tables_0004 | {
            "tokens",
            "ingest_batches",
        }
        with engine.connect() as conn:
            assert _dump(conn, at_0004) == rows_0004
            assert _summaries(conn) == summaries
            assert conn.exec_driver_sql("SELECT count(*) FROM tokens").scalar() == 0
            assert conn.exec_driver_sql("SELECT count(*) FROM ingest_batches").scalar() == 0
        token = create_token(engine, "ci", "write")
        assert token_scope(engine, token) == "write"
        with transaction(engine) as conn:
            conn.execute(
                sa.text("INSERT INTO ingest_batches (client_id, seq, \"rows\", received_at) "
                        "VALUES ('c0ffee', 1, 400, :ts), ('c0ffee', 2, 7, :ts)"),
                {"ts": "2026-11-25 13:00:00"},
            )  # fmt: skip
        with engine.connect() as conn:
            stored = conn.exec_driver_sql("SELECT name, scope, token_hash FROM tokens").all()
            assert [tuple(r) for r in stored] == [("ci", "write", hash_token(token))]
        again = sa.text("INSERT INTO ingest_batches (client_id, seq, \"rows\", received_at) "
                        "VALUES ('c0ffee', 2, 7, '2026-11-25 13:00:01')")  # fmt: skip
        with pytest.raises(sa.exc.IntegrityError), transaction(engine) as conn:
            conn.execute(again)  # a batch is recorded once

        with migration_transaction(engine) as conn:
            command.downgrade(alembic_config(conn), "0004")
        assert current_revision(engine) == "0004"
        assert set(sa.inspect(engine).get_table_names()) == tables_0004
        with engine.connect() as conn:
            assert _dump(conn, at_0004) == rows_0004
            assert _summaries(conn) == summaries

        assert upgrade(engine, "0005") == ("0004", "0005")
        with engine.connect() as conn:
            assert _dump(conn, at_0004) == rows_0004
            assert conn.exec_driver_sql("SELECT count(*) FROM tokens").scalar() == 0
        assert token_scope(engine, token) is None  # the token went with its table
        upgrade(engine)  # on to head, whatever revisions come after 0005
        _assert_matches_models(engine)
    finally:
        engine.dispose()
    capsys.readouterr()


def _metric_blocks(conn: sa.Connection) -> list[tuple]:
    rows = conn.exec_driver_sql(
        'SELECT run_id, "key", block, points, step_min, step_max, value_min, value_max, '
        'value_sum, value_count FROM metric_blocks ORDER BY run_id, "key", block'
    ).all()
    # PostgreSQL keeps the NaN of inf + -inf, SQLite stores it as NULL
    nan = [r for r in rows if r[8] is not None and math.isnan(r[8])]
    return [(*r[:8], None, r[9]) if r in nan else tuple(r) for r in rows]


def _blocks_of_seeded() -> list[tuple]:
    """The blocks of `SEEDED` by their definition (32 steps each, NaN left out)."""
    out = []
    for (run_id, key), points in sorted(SEEDED.items()):
        per: dict[int, list[tuple[int, float | None]]] = {}
        for step, value in points:
            per.setdefault(step // 32, []).append((step, value))
        for block, inside in sorted(per.items()):
            finite = [v for _, v in inside if v is not None]
            total = sum(finite) if finite else None
            if finite and math.inf in finite and -math.inf in finite:
                total = None  # inf + -inf: NaN, which SQLite stores as NULL
            out.append((run_id, key, block, len(inside), inside[0][0], inside[-1][0],
                        min(finite) if finite else None, max(finite) if finite else None,
                        total, len(finite)))  # fmt: skip
    return out


def test_0006_fills_metric_blocks_from_the_metrics_and_keeps_every_row_both_ways(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """0005 with data -> 0006 -> 0005 -> 0006: every earlier row kept; `metric_blocks`
    appears holding exactly the blocks of the stored points, and goes with the downgrade."""
    engine = make_engine(resolve_url(store_url))
    try:
        _at_0001_with_data(engine)
        assert upgrade(engine, "0005") == ("0001", "0005")
        at_0005 = _columns(engine)
        with engine.connect() as conn:
            rows_0005 = _dump(conn, at_0005)
        tables_0005 = set(sa.inspect(engine).get_table_names())
        assert "metric_blocks" not in tables_0005

        assert upgrade(engine, "0006") == ("0005", "0006")
        assert set(sa.inspect(engine).get_table_names()) == tables_0005 | {"metric_blocks"}
        want = _blocks_of_seeded()
        with engine.connect() as conn:
            assert _dump(conn, at_0005) == rows_0005
            got = _metric_blocks(conn)
        assert got == want
        assert len(want) == 5 + 13  # one block per short series; run 3 fills blocks 0..12

        with migration_transaction(engine) as conn:
            command.downgrade(alembic_config(conn), "0005")
        assert current_revision(engine) == "0005"
        assert set(sa.inspect(engine).get_table_names()) == tables_0005
        with engine.connect() as conn:
            assert _dump(conn, at_0005) == rows_0005

        upgrade(engine)
        with engine.connect() as conn:
            assert _metric_blocks(conn) == want
        _assert_matches_models(engine)
    finally:
        engine.dispose()
    capsys.readouterr()


def _packed_points(conn: sa.Connection) -> dict[tuple, list[tuple[int, str]]]:
    """Each block's packed points as (step, repr of the value): NaN compared as text."""
    rows = conn.exec_driver_sql(
        'SELECT run_id, "key", block, point_offsets, point_values FROM metric_blocks'
    ).all()
    out = {}
    for run_id, key, block, offsets, values in rows:
        numbers = struct.unpack(f"<{len(offsets)}d", bytes(values))
        out[(run_id, key, block)] = [
            (block * 32 + o, repr(v)) for o, v in zip(bytes(offsets), numbers, strict=True)
        ]
    return out


def test_0007_packs_each_blocks_points_and_keeps_every_row_both_ways(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """0006 with data -> 0007 -> 0006 -> 0007: every earlier row kept; each block gets its
    points packed in step order (NaN kept, as SQLite's NULL or PostgreSQL's NaN), and the
    two columns go with the downgrade."""
    engine = make_engine(resolve_url(store_url))
    try:
        _at_0001_with_data(engine)
        assert upgrade(engine, "0006") == ("0001", "0006")
        at_0006 = _columns(engine)
        with engine.connect() as conn:
            rows_0006 = _dump(conn, at_0006)

        assert upgrade(engine, "0007") == ("0006", "0007")
        want = {}
        for (run_id, key), points in SEEDED.items():
            for step, value in points:
                where = (run_id, key, step // 32)
                want.setdefault(where, []).append((step, repr(math.nan if value is None
                                                                else value)))  # fmt: skip
        with engine.connect() as conn:
            assert _dump(conn, at_0006) == rows_0006
            assert _packed_points(conn) == want

        with migration_transaction(engine) as conn:
            command.downgrade(alembic_config(conn), "0006")
        assert current_revision(engine) == "0006"
        assert _columns(engine) == at_0006
        with engine.connect() as conn:
            assert _dump(conn, at_0006) == rows_0006

        upgrade(engine)
        with engine.connect() as conn:
            assert _packed_points(conn) == want
        _assert_matches_models(engine)
    finally:
        engine.dispose()
    capsys.readouterr()


def test_0008_adds_owners_and_image_bytes_and_keeps_every_row_both_ways(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """0007 with data -> 0008 -> 0007 -> 0008: every earlier row kept, the new columns NULL;
    the new status and scope are accepted at 0008, and a downgrade refuses while a row uses
    one (then goes through once none does)."""
    engine = make_engine(resolve_url(store_url))
    try:
        _at_0001_with_data(engine)
        assert upgrade(engine, "0007") == ("0001", "0007")
        at_0007 = _columns(engine)
        with engine.connect() as conn:
            rows_0007 = _dump(conn, at_0007)

        assert upgrade(engine, "0008") == ("0007", "0008")
        with engine.connect() as conn:
            assert _dump(conn, at_0007) == rows_0007
            owners = conn.execute(
                sa.text(
                    "SELECT host, pid, process_start, boot_id, heartbeat_at, created_by "
                    "FROM experiments"
                )
            ).all()
            assert owners and all(tuple(row) == (None,) * 6 for row in owners)
            was = conn.execute(
                sa.text("SELECT status FROM experiments WHERE experiment_id = 1")
            ).scalar_one()
        with transaction(engine) as conn:
            conn.execute(
                sa.text("UPDATE experiments SET status = 'crashed' WHERE experiment_id = 1")
            )
        refused = pytest.raises(RuntimeError, match="experiments has rows where status = 'crash")
        with refused, migration_transaction(engine) as conn:
            command.downgrade(alembic_config(conn), "0007")
        assert current_revision(engine) == "0008"
        with transaction(engine) as conn:
            conn.execute(
                sa.text("UPDATE experiments SET status = :was WHERE experiment_id = 1"),
                {"was": was},
            )

        with migration_transaction(engine) as conn:
            command.downgrade(alembic_config(conn), "0007")
        assert current_revision(engine) == "0007"
        assert _columns(engine) == at_0007
        with engine.connect() as conn:
            assert _dump(conn, at_0007) == rows_0007
        upgrade(engine)
        _assert_matches_models(engine)
    finally:
        engine.dispose()
    capsys.readouterr()


def _constraints_and_indexes(engine: sa.Engine, table: str) -> dict[str, object]:
    insp = sa.inspect(engine)
    return {
        "pk": insp.get_pk_constraint(table)["name"],
        "uq": sorted(u["name"] for u in insp.get_unique_constraints(table)),
        "fk": sorted(
            (
                f["name"],
                tuple(f["constrained_columns"]),
                f["referred_table"],
                f["options"].get("ondelete"),
            )
            for f in insp.get_foreign_keys(table)
        ),
        "ix": sorted(  # (PostgreSQL lists a unique constraint's index too)
            (i["name"], tuple(i["column_names"]))
            for i in insp.get_indexes(table)
            if not i["name"].startswith("uq_")
        ),
    }


def test_0009_rebuilds_runs_for_pruned_and_keeps_every_row_and_key_both_ways(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """0008 with runs and metrics -> 0009 -> 0008 -> 0009: every earlier row kept, and
    `runs` keeps its indexes, keys and their cascades through SQLite's rebuild; `pruned`
    and its JSON are accepted at 0009, the new tables take rows and go with their
    experiment; a downgrade refuses while a run is pruned."""
    engine = make_engine(resolve_url(store_url))
    try:
        _at_0001_with_data(engine)
        assert upgrade(engine, "0008") == ("0001", "0008")
        at_0008 = _columns(engine)
        with engine.connect() as conn:
            rows_0008 = _dump(conn, at_0008)
            summaries = _summaries(conn)
            blocks = _metric_blocks(conn)
        keys_0008 = {t: _constraints_and_indexes(engine, t) for t in ZERO_ONE_TABLES}
        assert keys_0008["runs"]["ix"] == [
            ("ix_runs_experiment_id_status", ("experiment_id", "status")),
            ("ix_runs_group_id", ("group_id",)),
        ]

        assert upgrade(engine, "0009") == ("0008", "0009")
        assert _columns(engine)["runs"] == at_0008["runs"] + ["pruned"]
        assert {t: _constraints_and_indexes(engine, t) for t in ZERO_ONE_TABLES} == keys_0008
        with engine.connect() as conn:
            assert _dump(conn, at_0008) == rows_0008
            assert _summaries(conn) == summaries
            assert _metric_blocks(conn) == blocks
            assert conn.exec_driver_sql("SELECT run_id, pruned FROM runs ORDER BY run_id").all() \
                == [(1, None), (2, None), (3, None), (4, None)]  # fmt: skip
        with transaction(engine) as conn:
            conn.execute(
                sa.text("UPDATE runs SET status = 'pruned', pruned = :p WHERE run_id = 2"),
                {"p": '{"step": 4, "rule": "median", "metric": "loss", "value": 1.5}'},
            )
            conn.execute(
                sa.text(
                    "INSERT INTO sweep_trials (experiment_id, number, arm_id, params, "
                    "asked_after, told, value, state) VALUES (1, 0, 2, '{\"w\": 2}', 0, 0, "
                    "0.5, 'complete')"
                )
            )
            conn.execute(
                sa.text(
                    "INSERT INTO eliminations (experiment_id, arm_id, round, test, statistic, "
                    "p_value, alpha, best_arm, created_at) VALUES (1, 2, 1, 'friedman', 3.5, "
                    "0.01, 0.05, 'base', '2026-12-02 10:00:00')"
                )
            )
        with pytest.raises(sa.exc.IntegrityError), transaction(engine) as conn:
            conn.execute(sa.text("UPDATE runs SET status = 'pruned_' WHERE run_id = 1"))
        with engine.connect() as conn:
            assert (
                conn.exec_driver_sql("SELECT status, pruned FROM runs WHERE run_id = 2").one()[0]
                == "pruned"
            )

        refused = pytest.raises(RuntimeError, match="runs has rows where status = 'pruned'")
        with refused, migration_transaction(engine) as conn:
            command.downgrade(alembic_config(conn), "0008")
        assert current_revision(engine) == "0009"
        with transaction(engine) as conn:
            conn.execute(sa.text("UPDATE runs SET status = 'failed', pruned = NULL "
                                 "WHERE run_id = 2"))  # fmt: skip
        with migration_transaction(engine) as conn:
            command.downgrade(alembic_config(conn), "0008")
        assert current_revision(engine) == "0008"
        assert _columns(engine) == at_0008
        assert not {"sweep_trials", "eliminations"} & set(sa.inspect(engine).get_table_names())
        assert {t: _constraints_and_indexes(engine, t) for t in ZERO_ONE_TABLES} == keys_0008
        with engine.connect() as conn:
            assert _dump(conn, at_0008) == rows_0008
            assert _metric_blocks(conn) == blocks

        upgrade(engine)
        _assert_matches_models(engine)
        with engine.connect() as conn:
            assert _dump(conn, at_0008) == rows_0008
        # the cascades survive the rebuild: an experiment's delete takes its runs' rows
        with transaction(engine) as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO sweep_trials (experiment_id, number, arm_id, params, "
                    "asked_after, state) VALUES (1, 0, 1, '{}', 0, 'running')"
                )
            )
            conn.execute(sa.text("DELETE FROM experiments WHERE experiment_id = 1"))
        with engine.connect() as conn:
            left = {t: conn.exec_driver_sql(f"SELECT count(*) FROM {t}").scalar()
                    for t in ("runs", "metrics", "summaries", "metric_blocks", "evals",
                              "predictions", "checkpoints", "sweep_trials")}  # fmt: skip
        assert left == {"runs": 1, "metrics": 0, "summaries": 0, "metric_blocks": 0,
                        "evals": 0, "predictions": 0, "checkpoints": 0,
                        "sweep_trials": 0}  # fmt: skip
    finally:
        engine.dispose()
    capsys.readouterr()


def test_0009_refuses_to_rebuild_runs_with_sqlite_foreign_keys_on(
    sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run outside `lab`'s migration transaction (foreign keys on), the rebuild would
    cascade into every table that refers to runs: it refuses, and nothing changes."""
    engine = make_engine(resolve_url(sqlite_url))
    try:
        _at_0001_with_data(engine)
        upgrade(engine, "0008")
        with engine.connect() as conn:
            rows = _dump(conn, _columns(engine))
        refused = pytest.raises(RuntimeError, match="revision 0009 rebuilds the runs table")
        with refused, transaction(engine) as conn:
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            command.upgrade(alembic_config(conn), "0009")
        assert current_revision(engine) == "0008"
        with engine.connect() as conn:
            assert _dump(conn, _columns(engine)) == rows
    finally:
        engine.dispose()
    capsys.readouterr()


def _run_triggers(engine: sa.Engine) -> list[str]:
    """The triggers on `runs` that lab made (PostgreSQL; none on SQLite)."""
    if engine.dialect.name != "postgresql":
        return []
    with engine.connect() as conn:
        sql = (
            "SELECT tgname FROM pg_trigger WHERE tgrelid = 'runs'::regclass "
            "AND NOT tgisinternal ORDER BY tgname"
        )
        return list(conn.exec_driver_sql(sql).scalars())


def test_0010_drops_the_metrics_foreign_key_on_postgresql_and_keeps_every_row_both_ways(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """0009 with data -> 0010 -> 0009 -> 0010: every row kept. On PostgreSQL 0010 drops the
    foreign key from `metrics` to `runs` and adds the trigger that deletes a run's metrics
    with it; the downgrade deletes the metrics of runs that are not there (written around
    lab) and puts the key back. SQLite keeps its key. Either way, a run deleted takes its
    metrics."""
    engine = make_engine(resolve_url(store_url))
    pg = engine.dialect.name == "postgresql"
    try:
        _at_0001_with_data(engine)
        assert upgrade(engine, "0009") == ("0001", "0009")
        columns = _columns(engine)
        with engine.connect() as conn:
            rows = _dump(conn, columns)
        keys_0009 = _constraints_and_indexes(engine, "metrics")["fk"]
        assert [fk[:3] for fk in keys_0009] == [("fk_metrics_run_id_runs", ("run_id",), "runs")]

        assert upgrade(engine, "0010") == ("0009", "0010")
        with engine.connect() as conn:
            assert _dump(conn, columns) == rows
        assert _constraints_and_indexes(engine, "metrics")["fk"] == ([] if pg else keys_0009)
        assert _run_triggers(engine) == (["trg_runs_delete_metrics"] if pg else [])
        if pg:
            with transaction(engine) as conn:  # a row of no run: what no key refuses now
                conn.exec_driver_sql(
                    'INSERT INTO metrics (run_id, "key", step, value, wall_time) '
                    "VALUES (999, 'x', 0, 1.0, 1.0)"
                )

        with migration_transaction(engine) as conn:
            command.downgrade(alembic_config(conn), "0009")
        assert current_revision(engine) == "0009"
        assert _constraints_and_indexes(engine, "metrics")["fk"] == keys_0009
        assert _run_triggers(engine) == []
        with engine.connect() as conn:
            assert _dump(conn, columns) == rows  # the orphan deleted, nothing else

        upgrade(engine)
        with transaction(engine) as conn:
            conn.exec_driver_sql("DELETE FROM runs WHERE run_id = 1")
        with engine.connect() as conn:
            runs = conn.exec_driver_sql("SELECT DISTINCT run_id FROM metrics ORDER BY 1")
            assert list(runs.scalars()) == [2, 3]
        _assert_matches_models(engine)
    finally:
        engine.dispose()
    capsys.readouterr()


def test_0011_drops_the_metric_blocks_foreign_key_on_postgresql_and_keeps_every_row_both_ways(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """0010 with data -> 0011 -> 0010 -> 0011: every row kept. On PostgreSQL 0011 drops the
    foreign key from `metric_blocks` to `runs`, and the trigger of 0010 deletes a run's
    blocks with its metrics; the downgrade deletes the blocks of runs that are not there and
    puts the key back. SQLite keeps its key. Either way, a run deleted takes its blocks."""
    engine = make_engine(resolve_url(store_url))
    pg = engine.dialect.name == "postgresql"
    try:
        _at_0001_with_data(engine)
        assert upgrade(engine, "0010") == ("0001", "0010")
        columns = _columns(engine)
        with engine.connect() as conn:
            rows, blocks = _dump(conn, columns), _blocks(conn)
        assert {b[0] for b in blocks} == {1, 2, 3}, "the data has blocks to keep"
        keys_0010 = _constraints_and_indexes(engine, "metric_blocks")["fk"]
        assert [fk[:3] for fk in keys_0010] == [
            ("fk_metric_blocks_run_id_runs", ("run_id",), "runs")
        ]

        assert upgrade(engine, "0011") == ("0010", "0011")
        with engine.connect() as conn:
            assert (_dump(conn, columns), _blocks(conn)) == (rows, blocks)
        assert _constraints_and_indexes(engine, "metric_blocks")["fk"] == ([] if pg else keys_0010)
        assert _run_triggers(engine) == (["trg_runs_delete_metrics"] if pg else [])
        if pg:
            with transaction(engine) as conn:  # a block of no run: what no key refuses now
                conn.exec_driver_sql(
                    'INSERT INTO metric_blocks (run_id, "key", block, points, step_min, '
                    "step_max, value_count) VALUES (999, 'x', 0, 1, 0, 0, 0)"
                )

        with migration_transaction(engine) as conn:
            command.downgrade(alembic_config(conn), "0010")
        assert current_revision(engine) == "0010"
        assert _constraints_and_indexes(engine, "metric_blocks")["fk"] == keys_0010
        with engine.connect() as conn:  # the orphan deleted, nothing else
            assert (_dump(conn, columns), _blocks(conn)) == (rows, blocks)
        with transaction(engine) as conn:  # 0010's trigger again: metrics, not blocks
            conn.exec_driver_sql("DELETE FROM runs WHERE run_id = 3")
        with engine.connect() as conn:
            left = conn.exec_driver_sql("SELECT DISTINCT run_id FROM metric_blocks ORDER BY 1")
            assert list(left.scalars()) == [1, 2]  # the key's cascade took run 3's

        upgrade(engine)
        with transaction(engine) as conn:
            conn.exec_driver_sql("DELETE FROM runs WHERE run_id = 1")
        with engine.connect() as conn:
            for table in ("metrics", "metric_blocks"):
                runs = conn.exec_driver_sql(f"SELECT DISTINCT run_id FROM {table} ORDER BY 1")
                assert list(runs.scalars()) == [2], table
        _assert_matches_models(engine)
    finally:
        engine.dispose()
    capsys.readouterr()


def _blocks(conn: sa.Connection) -> list[tuple]:
    """Every `metric_blocks` row, in key order."""
    rows = conn.exec_driver_sql(
        'SELECT run_id, "key", block, points, step_min, step_max, value_count, '
        'point_offsets, point_values FROM metric_blocks ORDER BY run_id, "key", block'
    )
    return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in row) for row in rows]
