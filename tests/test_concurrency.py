"""Many processes on one store: opening a fresh database at the same moment, and writing.

Real processes (multiprocessing's spawn context, as on macOS and Windows), started together
behind a barrier. Each worker sends its stderr to a file, so a traceback or a logged retry
("database is locked") is seen by the test, not lost in pytest's capture.

The workers import `lab.store` without running `lab/__init__.py`, which imports torch:
that import costs ~2.5 s of CPU per process, and 16 of them on a 2-core machine would be
most of this file's time. Nothing here touches torch. This module imports nothing from
`lab` at the top for the same reason: each spawned worker imports it.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa

from tests import warm

START_TIMEOUT_S = 60  # a worker that can't reach the barrier in this long has hung
RUN_TIMEOUT_S = 120


# -- in the workers ----------------------------------------------------------------------------


def _worker_setup(err_path: str) -> Any:
    """Send this process's stderr to `err_path`, then import `lab.store` without torch;
    returns the `lab.store` module."""
    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    if "lab" not in sys.modules:  # the package object, its __init__ not run
        spec = importlib.util.find_spec("lab")
        assert spec is not None
        sys.modules["lab"] = importlib.util.module_from_spec(spec)
    import lab.store

    return lab.store


def open_at_once(url: str, out_path: str, barrier: Any, err_path: str) -> None:
    """Open the store the moment every worker is ready; record what `upgrade` returned
    each time `ensure_schema` called it (never, when the schema was at head already)."""
    store_module = _worker_setup(err_path)
    import lab.store.migrations as migrations

    upgrades: list[list[Any]] = []
    real_upgrade = migrations.upgrade

    def recording_upgrade(engine: sa.Engine, revision: str = "head") -> Any:
        result = real_upgrade(engine, revision)
        upgrades.append([result.before, result.after, result.backup and str(result.backup)])
        return result

    migrations.upgrade = recording_upgrade
    barrier.wait(START_TIMEOUT_S)
    store = store_module.Store(url)
    store.close()
    Path(out_path).write_text(json.dumps({"pid": os.getpid(), "upgrades": upgrades}))


def write_one_run(url: str, index: int, steps: int, keys: int, barrier: Any, err_path: str) -> None:
    """One training process's writes: its own experiment and run, `steps` steps of `keys`
    metrics, a flush and an eval every 100 steps, then the run and experiment finished."""
    store_module = _worker_setup(err_path)
    barrier.wait(START_TIMEOUT_S)
    store = store_module.Store(url)
    experiment = store.begin_experiment(
        f"writer-{index}", config={"index": index}, seed=index, repeats=1
    )
    group = store.add_group(experiment, "g")
    run = store.start_run(
        experiment, group, run_key=f"w{index}", arm_id=None, repeat=0, stage=0, seed=index,
        config={}, output_dir=None,
    )  # fmt: skip
    for step in range(steps):
        store.log_metrics(run, step, {f"m{k}": step + k / 10 for k in range(keys)})
        if step % 100 == 99:
            store.flush()
            result = SimpleNamespace(
                name="val", step=step, metrics={"acc": step / steps}, breakdowns={}, tags={},
                seconds=0.01, error=None,
            )  # fmt: skip
            store.write_eval(run, result, [{"example_id": i, "score": 1.0} for i in range(3)])
    store.finish_run(run, status="completed", summary={"m0": steps - 1.0})
    store.finish_experiment(experiment, status="completed")
    store.close()


# -- in the test -------------------------------------------------------------------------------


def _run_together(target: Any, args: list[tuple], tmp_path: Path) -> list[tuple[int, str]]:
    """Start one spawned process per argument tuple (each gets a barrier for all of them and
    its own stderr file appended), wait for all; returns (exit code, stderr) per process."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(args))
    errs = [tmp_path / f"worker-{i}.err" for i in range(len(args))]
    procs = [
        ctx.Process(target=target, args=(*a, barrier, str(err)), daemon=True)
        for a, err in zip(args, errs, strict=True)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"workers {hung} still ran after {RUN_TIMEOUT_S} s"
    return [
        (p.exitcode, e.read_text() if e.exists() else "") for p, e in zip(procs, errs, strict=True)
    ]


def _assert_all_clean(results: list[tuple[int, str]]) -> None:
    for i, (code, err) in enumerate(results):
        assert code == 0, f"worker {i} exited {code}:\n{err}"
        assert "database is locked" not in err.lower(), f"worker {i}:\n{err}"
        assert "Traceback" not in err and "retrying" not in err, f"worker {i}:\n{err}"


def test_processes_opening_a_fresh_store_at_once_create_the_schema_once(
    store_url: str, tmp_path: Path
) -> None:
    """A sweep's processes all start on a new store: one creates the schema, the others
    wait for its lock and find it done; none fails, and alembic_version has one row."""
    from lab.store.engine import make_engine, resolve_url
    from lab.store.migrations import head_revision
    from lab.store.schema import DERIVED_TABLES, PRIVATE_TABLES, TABLES

    n = 4
    outs = [tmp_path / f"worker-{i}.json" for i in range(n)]
    results = _run_together(open_at_once, [(store_url, str(out)) for out in outs], tmp_path)
    _assert_all_clean(results)

    head = head_revision()
    upgrades = [tuple(u) for out in outs for u in json.loads(out.read_text())["upgrades"]]
    # One process created the schema; any other that got to `upgrade` found it at head
    # once it had the lock, and did nothing.
    assert upgrades.count((None, head, None)) == 1, upgrades
    assert all(u == (head, head, None) for u in upgrades if u != (None, head, None)), upgrades
    engine = make_engine(resolve_url(store_url))
    try:
        with engine.connect() as conn:
            versions = conn.exec_driver_sql("SELECT version_num FROM alembic_version").all()
        assert versions == [(head,)]
        assert set(sa.inspect(engine).get_table_names()) == {
            *TABLES,
            *PRIVATE_TABLES,
            *DERIVED_TABLES,
            "alembic_version",
        }
    finally:
        engine.dispose()
    assert not [p.name for p in tmp_path.iterdir() if ".bak-" in p.name]


def _assert_every_row_written(url: str, writers: int, steps: int, keys: int) -> None:
    from lab.store.engine import make_engine, resolve_url

    engine = make_engine(resolve_url(url))
    try:
        with engine.connect() as conn:
            per_run = conn.exec_driver_sql(
                "SELECT e.name, r.status, "
                "(SELECT count(*) FROM metrics m WHERE m.run_id = r.run_id), "
                "(SELECT count(DISTINCT m.step) FROM metrics m WHERE m.run_id = r.run_id), "
                "(SELECT count(*) FROM evals v WHERE v.run_id = r.run_id), "
                "(SELECT count(*) FROM predictions p JOIN evals v ON v.eval_id = p.eval_id "
                " WHERE v.run_id = r.run_id), "
                "(SELECT count(*) FROM summaries s WHERE s.run_id = r.run_id "
                f' AND s."count" = {steps} AND s.last_step = {steps - 1}) '
                "FROM runs r JOIN experiments e ON e.experiment_id = r.experiment_id "
                "ORDER BY e.name"
            ).all()
            experiments = conn.exec_driver_sql(
                "SELECT count(*) FROM experiments WHERE status = 'completed'"
            ).scalar()
    finally:
        engine.dispose()
    evals = steps // 100
    want = [
        (f"writer-{i}", "completed", steps * keys, steps, evals, 3 * evals, keys)
        for i in sorted(range(writers), key=lambda i: f"writer-{i}")
    ]
    assert [tuple(row) for row in per_run] == want
    assert experiments == writers


@pytest.mark.slow
def test_eight_processes_write_one_sqlite_file_and_lose_nothing(
    sqlite_url: str, tmp_path: Path
) -> None:
    """SQLite's one writer at a time, with eight processes flushing metrics and writing
    evals at once: every write waits its turn (BEGIN IMMEDIATE, busy timeout), none fails
    with "database is locked", and no row is lost."""
    from lab.store import Store

    Store(sqlite_url).close()  # opening a fresh store at once is the test above's business
    writers, steps, keys = 8, 500, 10
    args = [(sqlite_url, i, steps, keys) for i in range(writers)]
    _assert_all_clean(_run_together(write_one_run, args, tmp_path))
    _assert_every_row_written(sqlite_url, writers, steps, keys)


@pytest.mark.slow
@pytest.mark.postgres
def test_sixteen_processes_write_one_postgres_store_and_lose_nothing(
    pg_url: str, tmp_path: Path
) -> None:
    """Sixteen processes writing one PostgreSQL store at once: no row lost, none failed."""
    from lab.store import Store

    Store(pg_url).close()
    writers, steps, keys = 16, 300, 10
    args = [(pg_url, i, steps, keys) for i in range(writers)]
    _assert_all_clean(_run_together(write_one_run, args, tmp_path))
    _assert_every_row_written(pg_url, writers, steps, keys)


# -- a second store in one process ------------------------------------------------------------

_WRITE_AND_CLOSE = """
import sys
from lab.store import Store
store = Store(sys.argv[1])
store.begin_experiment(sys.argv[2], config={}, seed=0, repeats=1)
store.close()
"""


def _names(store: Any) -> list[str]:
    return sorted(e["name"] for e in store.list_experiments())


def test_a_second_store_on_the_file_keeps_the_first_ones_reads_fresh_and_writes_kept(
    tmp_path: Path,
) -> None:
    """A process with a store open opens the same file again (read-only, as `lab serve`'s
    reads do, and read-write); then another process writes and closes its store, the last
    connection it can see. Reading a file's header had dropped this process's SQLite locks,
    so that closing process deleted the WAL under ours: the first store then read an old
    snapshot forever and its next write was lost. Both stores see every experiment, and a
    fresh process finds the first store's later write."""

    from lab.store import Store

    url = f"sqlite:///{tmp_path / 'lab.db'}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def elsewhere(code: str, *args: str) -> str:
        done = warm.run([sys.executable, "-c", code, url, *args], env=env,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    first = Store(url)
    reader = None
    try:
        first.begin_experiment("one", config={}, seed=0, repeats=1)
        reader = Store(url, readonly=True)
        Store(url).close()
        assert _names(reader) == ["one"]
        elsewhere(_WRITE_AND_CLOSE, "two")
        assert _names(first) == _names(reader) == ["one", "two"]
        first.begin_experiment("three", config={}, seed=0, repeats=1)
    finally:
        first.close()
        if reader is not None:
            reader.close()
    shown = elsewhere(
        "import sys; from lab.store import Store; "
        "print(sorted(e['name'] for e in Store(sys.argv[1], readonly=True).list_experiments()))"
    )
    assert shown.strip() == "['one', 'three', 'two']"
