"""Stores that are missing, foreign, damaged, old or read-only, met by real `lab` commands.

Commands that only read (`lab ls`, `show`, `export`, `db current`, `lab.inspect.connect`)
open SQLite read-only and never create, migrate or write a store. Every command answers a bad
store with one line, never a traceback, and leaves the bad file exactly as it was.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command

import lab.inspect
from lab.errors import NoStore, NotALabStore, SchemaTooNew, SchemaTooOld
from lab.store import Store
from lab.store.migrations import alembic_config, head_revision
from tests import warm

UNREACHABLE_PG = "postgresql://postgres:lab@127.0.0.1:1/lab"  # port 1: nothing listens
ROOT = os.geteuid() == 0


# -- building stores ---------------------------------------------------------------------------
def _record(url: str, experiment: str = "exp") -> None:
    """A small real store: one experiment, one run, three metric points."""
    store = Store(url)
    try:
        exp_id = store.begin_experiment(experiment, config={}, seed=0, repeats=1)
        group_id = store.add_group(exp_id, "g")
        run_id = store.start_run(
            exp_id, group_id, run_key="r0", arm_id=None, repeat=0, stage=0, seed=0,
            config={}, output_dir=None,
        )  # fmt: skip
        store.log_metrics(run_id, 1, {"loss": 1.0})
        store.log_metrics(run_id, 2, {"loss": 0.5})
        store.log_metrics(run_id, 3, {"loss": 0.25})
        store.flush()
        store.finish_run(run_id, status="completed")
        store.finish_experiment(exp_id, status="completed")
    finally:
        store.close()


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A lab store at head, in WAL mode, closed (no -wal file beside it)."""
    db = tmp_path_factory.mktemp("template") / "lab.db"
    _record(f"sqlite:///{db}")
    wal = db.with_name("lab.db-wal")
    deadline = time.monotonic() + 30  # the writer process closes the file last, after close()
    while wal.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not wal.exists()
    return db


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder under `folder`, with a hash of each file's bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else "dir"
        for p in sorted(folder.rglob("*"))
    }


@dataclass
class Case:
    """A bad input: the store argument, and how a command must be run against it."""

    store: str
    experiment: str = "exp"
    export_to: str | None = None
    wrap: list[str] = field(default_factory=list)  # a prefix: a read-only mount
    undo: Callable[[], None] | None = None


def _readonly(path: Path) -> tuple[list[str], Callable[[], None] | None]:
    """Make `path` (a file or a folder) read-only for the command to be run.

    An unprivileged user gets a chmod. Root ignores permissions, so there the command runs
    in a mount namespace of its own where `path` is a read-only bind mount: a read-only
    file system, as a shared archive or a read-only volume is.
    """
    if not ROOT:
        mode = path.stat().st_mode
        path.chmod(0o555 if path.is_dir() else 0o444)
        return [], lambda: path.chmod(mode)
    if shutil.which("unshare") is None:
        pytest.skip("read-only stores need unshare(1) when the tests run as root")
    probe = warm.run(["unshare", "-m", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace: {probe.stderr.decode().strip()}")
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    return ["unshare", "-m", "sh", "-c", script, str(path)], None


def _make(kind: str, folder: Path, template: Path) -> Case:
    db = folder / "lab.db"
    if kind == "missing":
        return Case(f"sqlite:///{folder / 'typo' / 'lab.db'}")
    if kind == "not a database":
        db.write_text("name,loss\nr0,0.5\n" * 50)
        return Case(f"sqlite:///{db}")
    if kind == "damaged":  # a copy cut short: the header promises pages that are not there
        data = template.read_bytes()
        db.write_bytes(data[: len(data) // 2])
        return Case(f"sqlite:///{db}")
    if kind in ("foreign", "foreign, named like lab's"):  # someone else's SQLite file
        table = "customers" if kind == "foreign" else "runs"  # runs: and no alembic_version
        con = sqlite3.connect(db)
        con.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, name TEXT)")
        con.execute(f"INSERT INTO {table} VALUES (1, 'ada')")
        con.commit()
        con.close()
        return Case(f"sqlite:///{db}")
    if kind == "empty":
        db.touch()
        return Case(f"sqlite:///{db}")
    if kind in ("read-only file", "read-only folder"):
        shutil.copy(template, db)
        wrap, undo = _readonly(db if kind == "read-only file" else folder)
        return Case(f"sqlite:///{db}", wrap=wrap, undo=undo)
    if kind == "unknown experiment":
        shutil.copy(template, db)
        return Case(f"sqlite:///{db}", experiment="nope")
    if kind == "export target is a file":
        shutil.copy(template, db)
        (folder / "shared").write_text("my notes\n")
        return Case(f"sqlite:///{db}", export_to=str(folder / "shared"))
    if kind == "bad scheme":
        return Case("mysql://user@localhost/lab")
    if kind == "unreachable postgres":
        return Case(UNREACHABLE_PG)
    raise AssertionError(kind)


_TRAIN = """\
def train(run):
    raise AssertionError("a bad store must stop the experiment before any run")
"""
_EXPERIMENT = """\
name: never
train: train_lib:train
arms: [{name: a}]
repeats: 1
"""


def _argv(command_name: str, case: Case, folder: Path, files: Path) -> list[str]:
    store = ["--store", case.store]
    if command_name == "ls":
        return ["ls", *store]
    if command_name == "show":
        return ["show", case.experiment, *store]
    if command_name == "export":
        return ["export", case.experiment, "--to", case.export_to or str(folder / "out"), *store]
    if command_name == "db current":
        return ["db", "current", *store]
    if command_name == "db upgrade":
        return ["db", "upgrade", *store]
    if command_name == "run":
        return ["run", str(files / "never.yaml"), *store]
    if command_name == "tag":
        return ["tag", case.experiment, "+kept", *store]
    if command_name == "quickstart":
        return ["quickstart", "--steps", "1", "--output-dir", str(folder / "runs"), *store]
    if command_name == "token create":
        return ["token", "create", "ci", "--scope", "write", *store]
    raise AssertionError(command_name)


_VALID = ("unknown experiment", "export target is a file")  # a good store, a bad argument
READS = ("ls", "show", "export", "db current")
WRITES = ("db upgrade", "run", "quickstart", "tag")
EVERYONE = ("missing", "not a database", "damaged", "bad scheme", "unreachable postgres")
MATRIX = [
    *((c, k) for c in READS for k in (*EVERYONE, "foreign")),
    *(("ls", "empty"), ("show", "empty"), ("export", "empty")),
    *(("show", "unknown experiment"), ("export", "unknown experiment")),
    ("export", "export target is a file"),
    *((c, k) for c in ("db upgrade", "run") for k in EVERYONE if k != "missing"),
    *((c, k) for c in ("db upgrade", "run") for k in ("read-only file", "read-only folder")),
    *(("quickstart", k) for k in ("not a database", "read-only folder", "bad scheme")),
    *(("tag", k) for k in (*EVERYONE, "read-only file", "read-only folder", "unknown experiment")),
    *((c, "foreign, named like lab's") for c in ("db upgrade", "quickstart", "token create")),
]


@pytest.mark.parametrize(("command_name", "kind"), MATRIX, ids=[f"{c}-{k}" for c, k in MATRIX])
def test_every_command_meets_a_bad_store_with_one_line(
    command_name: str, kind: str, tmp_path: Path, template: Path
) -> None:
    folder = tmp_path / "store"
    folder.mkdir()
    files = tmp_path / "files"  # the experiment file, outside the watched folder
    files.mkdir()
    (files / "train_lib.py").write_text(_TRAIN)
    (files / "never.yaml").write_text(_EXPERIMENT)
    case = _make(kind, folder, template)
    before = _snapshot(folder)
    try:
        out = warm.run(
            [*case.wrap, sys.executable, "-m", "lab.cli",
             *_argv(command_name, case, folder, files)],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
            env={**os.environ, "LAB_STORE_URL": ""},
        )  # fmt: skip
    finally:
        if case.undo is not None:
            case.undo()
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
    after = _snapshot(folder)
    if kind in _VALID:  # a reader of a WAL file leaves SQLite's own -wal and -shm beside it
        after = {k: v for k, v in after.items() if k not in ("lab.db-wal", "lab.db-shm")}
    assert after == before  # the bad file byte for byte, and nothing new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["files", "store"]


# -- what each refusal says --------------------------------------------------------------------
def _lab(
    *args: str, cwd: Path | None = None, wrap: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    return warm.run(
        [*(wrap or []), sys.executable, "-m", "lab.cli", *args],
        capture_output=True, text=True, timeout=300, cwd=cwd,
    )  # fmt: skip


def test_a_mistyped_path_names_itself_and_how_to_create_a_store(tmp_path: Path) -> None:
    db = tmp_path / "typo" / "lab.db"
    out = _lab("ls", "--store", f"sqlite:///{db}")
    assert out.stderr == (
        f"error: no store at {db} (commands that only read never create one); record an "
        "experiment into it (lab run, lab quickstart) or create an empty one: "
        f"lab db upgrade --store sqlite:///{db}\n"
    )
    assert not (tmp_path / "typo").exists()
    with pytest.raises(NoStore, match="no store at"):
        lab.inspect.connect(f"sqlite:///{db}")
    assert not (tmp_path / "typo").exists()
    out = _lab("tag", "exp", "+best", "--store", f"sqlite:///{db}")  # writes, never creates
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (
        f"error: no store at {db} (this command never creates one); record an experiment "
        f"into it (lab run, lab quickstart) or create an empty one: lab db upgrade --store "
        f"sqlite:///{db}\n"
    )
    assert not (tmp_path / "typo").exists()
    tmp_path.joinpath("typo").mkdir()  # the folder exists, the file does not
    assert _lab("tag", "exp", "+best", "--store", f"sqlite:///{db}").returncode == 1
    assert sorted(p.name for p in (tmp_path / "typo").iterdir()) == []


def test_refusals_say_what_is_wrong(tmp_path: Path, template: Path) -> None:
    notes = tmp_path / "notes.db"
    notes.write_text("hello\n" * 40)
    out = _lab("ls", "--store", f"sqlite:///{notes}")
    assert out.stderr == (
        f"error: {notes} is not a SQLite database (its first bytes are not the SQLite "
        "header); point --store / LAB_STORE_URL at a lab store\n"
    )
    cut = tmp_path / "cut.db"
    cut.write_bytes(template.read_bytes()[:8192])
    out = _lab("show", "exp", "--store", f"sqlite:///{cut}")
    size = template.stat().st_size
    assert out.stderr == (
        f"error: {cut} is damaged: it is 8192 bytes but its header says {size} (a copy cut "
        "short?); restore it from a backup (cut.db.bak-*) or copy it again\n"
    )
    foreign = tmp_path / "shop.db"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
    con.close()
    out = _lab("ls", "--store", f"sqlite:///{foreign}")
    assert out.stderr == (
        f"error: sqlite:///{foreign} is not a lab store: it holds other tables (orders) and "
        "none of lab's; point --store / LAB_STORE_URL at a lab store\n"
    )
    empty = tmp_path / "empty.db"
    empty.touch()
    out = _lab("ls", "--store", f"sqlite:///{empty}")
    assert out.stderr == (
        f"error: sqlite:///{empty} holds no lab store yet (no tables); record an experiment "
        f"into it (lab run, lab quickstart) or create the schema: lab db upgrade --store "
        f"sqlite:///{empty}\n"
    )
    assert empty.stat().st_size == 0


def _scalar(db: Path, sql: str) -> str:
    con = sqlite3.connect(db)
    try:
        return con.execute(sql).fetchone()[0]
    finally:
        con.close()


def _journal_mode(db: Path) -> str:
    return _scalar(db, "PRAGMA journal_mode")


def test_a_refused_file_named_like_lab_is_left_byte_for_byte(
    tmp_path: Path, template: Path
) -> None:
    _make("foreign, named like lab's", tmp_path, template)
    db = tmp_path / "lab.db"
    before = db.read_bytes()
    with pytest.raises(NotALabStore) as info:
        Store(f"sqlite:///{db}")
    assert str(info.value) == (
        f"sqlite:///{db} has tables named like lab's (runs) but no alembic_version; point "
        "--store / LAB_STORE_URL at a lab store or a new database"
    )
    assert db.read_bytes() == before  # the header still says "rollback journal"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab.db"]  # no -wal, no -shm
    assert _journal_mode(db) == "delete"
    # a new file and a lab store are still switched to WAL when they are first opened
    Store(f"sqlite:///{tmp_path / 'new.db'}").close()
    assert _journal_mode(tmp_path / "new.db") == "wal"
    con = sqlite3.connect(tmp_path / "old.db")  # a lab store left in rollback-journal mode
    con.execute("CREATE TABLE alembic_version (version_num TEXT)")
    con.execute("CREATE TABLE runs (run_id INTEGER)")
    con.execute("INSERT INTO alembic_version VALUES ('9999')")
    con.commit()
    con.close()
    with pytest.raises(SchemaTooNew):
        Store(f"sqlite:///{tmp_path / 'old.db'}")
    assert _journal_mode(tmp_path / "old.db") == "wal"


def test_export_onto_a_file_is_one_line_and_keeps_the_file(tmp_path: Path, template: Path) -> None:
    target = tmp_path / "report.txt"
    target.write_text("keep me\n")
    out = _lab("export", "exp", "--to", str(target), "--store", f"sqlite:///{template}")
    assert out.returncode == 1
    assert out.stderr == (
        f"error: cannot export to {target}: it is a file, and an export is a folder of "
        "Parquet files; give a folder's path (it is created if missing)\n"
    )
    assert target.read_text() == "keep me\n"


def test_a_garbled_store_is_one_line_from_every_read(tmp_path: Path, template: Path) -> None:
    """Damage inside a file of the right size shows only when SQLite reads the bad page."""
    db = tmp_path / "lab.db"
    data = bytearray(template.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[page:] = bytes([0x5A]) * (len(data) - page)  # every page but the first
    db.write_bytes(bytes(data))
    for args in (("ls",), ("show", "exp"), ("db", "current"),
                 ("export", "exp", "--to", str(tmp_path / "out"))):  # fmt: skip
        out = _lab(*args, "--store", f"sqlite:///{db}")
        assert out.returncode == 1, (args, out.stdout, out.stderr)
        assert out.stderr.startswith(f"error: sqlite:///{db} is damaged ("), out.stderr
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert db.read_bytes() == bytes(data)
    assert not (tmp_path / "out").exists()


# -- read-only stores are read ----------------------------------------------------------------
@pytest.mark.parametrize("what", ["file", "folder"])
def test_commands_that_only_read_read_a_read_only_store(
    what: str, tmp_path: Path, template: Path
) -> None:
    folder = tmp_path / "archive"
    folder.mkdir()
    db = folder / "lab.db"
    shutil.copy(template, db)
    data = db.read_bytes()
    wrap, undo = _readonly(db if what == "file" else folder)
    url = f"sqlite:///{db}"
    try:
        ls = _lab("ls", "--store", url, wrap=wrap)
        show = _lab("show", "exp", "--store", url, wrap=wrap)
        current = _lab("db", "current", "--store", url, wrap=wrap)
        export = _lab("export", "exp", "--to", str(tmp_path / "out"), "--store", url, wrap=wrap)
        upgrade = _lab("db", "upgrade", "--store", url, wrap=wrap)
    finally:
        if undo is not None:
            undo()
    assert ls.returncode == 0, ls.stderr
    assert ls.stdout.splitlines()[1].split()[:6] == ["exp", "completed", "0", "1", "1", "1"]
    assert show.returncode == 0, show.stderr
    assert show.stdout.startswith("exp: completed, 1 run, seed 0"), show.stdout
    assert current.stdout == f"{head_revision()} (head)\n", current.stderr
    assert export.returncode == 0, export.stderr
    assert (tmp_path / "out" / "metrics.parquet").is_file()
    assert upgrade.returncode == 1 and "cannot be written" in upgrade.stderr, upgrade.stderr
    assert upgrade.stderr.count("\n") == 1 and "start the server" not in upgrade.stderr
    assert db.read_bytes() == data
    if what == "folder":  # nothing could be written there, and nothing was
        assert sorted(p.name for p in folder.iterdir()) == ["lab.db"]


# -- older schemas are read as they are ----------------------------------------------------------
def _downgrade(url: str, revision: str) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            command.downgrade(alembic_config(conn), revision)
    finally:
        engine.dispose()


def _revision(db: Path) -> str:
    return _scalar(db, "SELECT version_num FROM alembic_version")


def test_a_store_one_revision_behind_is_read_without_upgrading(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    url = f"sqlite:///{db}"
    _record(url)
    _downgrade(url, "0002")
    data = db.read_bytes()
    head = head_revision()
    current = _lab("db", "current", "--store", url).stdout
    assert current == f"0002 (head is {head}; run: lab db upgrade)\n"
    for args in (("ls",), ("show", "exp")):  # they need 0003's tags and run owners
        out = _lab(*args, "--store", url)
        assert out.returncode == 1, out.stdout
        assert out.stderr.startswith(
            f"error: {url} is at schema revision 0002, older than this lab's {head}, and "
            "cannot be read as it is (no such column: "
        ), out.stderr
        assert out.stderr.endswith(f"lab db upgrade --store {url}\n")
        assert out.stderr.count("\n") == 1
    out = _lab("export", "exp", "--to", str(tmp_path / "out"), "--store", url)
    assert out.returncode == 0, out.stderr  # reads through the views: what 0002 lacks is NULL
    con = lab.inspect.connect(url)
    assert con.sql("select count(*), max(value) from metrics").fetchone() == (3, 1.0)
    assert con.sql("select tags, notes from experiments").fetchall() == [(None, None)]
    assert con.sql("select mode from lab_source").fetchone() == ("attach",)
    con.close()
    assert _revision(db) == "0002" and db.read_bytes() == data
    assert not list(tmp_path.glob("old.db.bak-*"))  # nothing was upgraded, so no backup


def test_a_store_too_old_to_read_names_the_upgrade(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    url = f"sqlite:///{db}"
    _record(url)
    _downgrade(url, "0001")  # no summaries table yet
    data = db.read_bytes()
    out = _lab("ls", "--store", url)
    assert out.returncode == 1
    head = head_revision()
    assert out.stderr.startswith(
        f"error: {url} is at schema revision 0001, older than this lab's {head}, and cannot "
        "be read as it is (no such "
    )
    assert out.stderr.endswith(
        f"; upgrade it (a backup is made first): lab db upgrade --store {url}\n"
    )
    assert out.stderr.count("\n") == 1
    with pytest.raises(SchemaTooOld, match="lacks summaries; upgrade it"):
        lab.inspect.connect(url)
    assert _revision(db) == "0001" and db.read_bytes() == data
    out = _lab("db", "upgrade", "--store", url)  # the way out works
    assert out.returncode == 0, out.stderr
    assert _lab("ls", "--store", url).returncode == 0


# -- PostgreSQL ------------------------------------------------------------------------------------
def _pg_tables(url: str) -> list[str]:
    engine = sa.create_engine(url)
    try:
        return sorted(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_reading_a_postgres_database_without_lab_schema_creates_nothing(pg_url: str) -> None:
    shown = sa.engine.make_url(pg_url).render_as_string(hide_password=True)
    for args in (("ls",), ("show", "exp"), ("export", "exp", "--to", "out")):
        out = _lab(*args, "--store", pg_url)
        assert out.returncode == 1
        assert out.stderr == (
            f"error: {shown} holds no lab store yet (no tables); record an experiment into it "
            f"(lab run, lab quickstart) or create the schema: lab db upgrade --store {shown}\n"
        )
    assert _lab("db", "current", "--store", pg_url).stdout.startswith("empty (no schema yet")
    with pytest.raises(NotALabStore):
        lab.inspect.connect(pg_url)
    assert _pg_tables(pg_url) == []


@pytest.mark.postgres
def test_a_read_only_store_never_writes_on_postgres(pg_url: str) -> None:
    _record(pg_url)
    store = Store(pg_url, readonly=True)
    try:
        assert [e["name"] for e in store.list_experiments()] == ["exp"]
        with pytest.raises(sa.exc.InternalError, match="read-only transaction"):
            store.begin_experiment("sneaky", config={}, seed=0, repeats=1)
    finally:
        store.close()


def test_export_into_a_folder_it_cannot_write_is_one_line(tmp_path: Path, template: Path) -> None:
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    wrap, undo = _readonly(shelf)
    try:
        url = f"sqlite:///{template}"
        out = _lab("export", "exp", "--to", str(shelf), "--store", url, wrap=wrap)
    finally:
        if undo is not None:
            undo()
    assert out.returncode == 1, out.stdout
    assert out.stderr.startswith(f"error: cannot write the export into {shelf} ("), out.stderr
    assert out.stderr.endswith("); choose a folder you can write\n") and out.stderr.count("\n") == 1
    assert list(shelf.iterdir()) == []
