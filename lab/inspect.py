"""Reading a store back with DuckDB, for notebooks and the command line.

`connect()` returns a DuckDB connection whose views are the store's tables (experiments,
arms, groups, runs, metrics, summaries, evals, predictions, checkpoints, histograms,
images), plus
`final_metrics`: the last value (and min, max and count) of every metric of every run, with
its experiment, arm and repeat; `provenance`: each run's git commit, dirty flag, versions,
host, command and packages as columns; `run_tags` and `experiment_tags`: one row per tag.
`final_metrics` reads `summaries`, which every flush keeps up to date, so it costs one row
per run and key however many points the runs hold. `histograms` and `images` carry each
row's experiment, arm, repeat and run key, and an image's `path` is absolute (the store
keeps it relative to the run folder); `histograms()` and `images()` read one run's.

The `runs` view leaves out superseded runs (those an ``Experiment(..., fresh=True)``
replaced), and so does everything that joins it (`final_metrics`, the analysis functions);
`all_runs` holds every run, superseded ones included (``superseded_at`` set, the key
``<run_key>~<n>``). The other tables keep the superseded runs' rows: join them to `runs`
to leave those out, to `all_runs` to keep them.

How the store is read: DuckDB's sqlite and postgres scanners ship as Python packages for
DuckDB 1.5.x (``duckdb-extension-sqlite-scanner``, ``duckdb-extension-postgres-scanner``),
so the store is ATTACHed read-only and queried in place, with no download. If a scanner
cannot be loaded, the tables are copied in through Arrow instead; the views are the same.
A folder written by ``lab export`` (one Parquet file per table) is read the same way: the
views are built over its files, so a notebook reads an export like the store it came from.
A ``lab serve`` server's URL (``http(s)://host:port``, its token from ``LAB_TOKEN``) is read
through its read API: each table comes over as Arrow into an in-memory DuckDB, and the
views are the same.

>>> import lab.inspect
>>> con = lab.inspect.connect("sqlite:///:memory:")          # doctest: +SKIP
>>> con.sql("select count(*) from runs").fetchone()           # doctest: +SKIP
(0,)
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import duckdb
import pyarrow as pa
import sqlalchemy as sa

from lab._secrets import logger, mask
from lab.errors import ConfigError, SchemaTooOld, StoreError
from lab.store.arrow import arrow_type as _arrow_type
from lab.store.columns import TABLES, Base, copied_columns
from lab.store.engine import connect as connect_store
from lab.store.engine import make_engine, resolve_url
from lab.store.migrations import head_revision
from lab.store.store import Store

if TYPE_CHECKING:
    from lab.store.crashes import Crashed

log = logger("lab.inspect")

# The store each connection of `connect()` reads, for what must go to the store itself.
_STORES: weakref.WeakKeyDictionary[duckdb.DuckDBPyConnection, str] = weakref.WeakKeyDictionary()

Mode = Literal["auto", "attach", "arrow"]

_SCANNERS = {
    "sqlite": ("duckdb_extension_sqlite_scanner", "sqlite_scanner"),
    "postgresql": ("duckdb_extension_postgres_scanner", "postgres_scanner"),
}


def connect(
    url: str | os.PathLike[str] | None = None, *, mode: Mode = "auto"
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with one view per store table, read from `url`.

    `url` resolves like every store URL (argument, ``LAB_STORE_URL``, ``sqlite:///lab.db``).
    The store is only read, never created or changed: a missing path, a file that is not a
    store and a newer schema are refused with one line. A store at an older revision is
    read as it is, the columns it lacks showing as NULL (``lab db upgrade`` adds them); one
    that lacks a whole table is refused with that command.
    `mode` forces ATTACH in place (``"attach"``) or a copy through Arrow (``"arrow"``);
    ``"auto"`` attaches when the scanner loads and falls back to Arrow otherwise.

    `url` may instead be a folder written by ``lab export`` (or `lab.export.export`): the
    views then read its Parquet files in place (`lab_source.mode` is ``'parquet'``), so an
    experiment shared as a folder is queried with the same SQL as the store itself.

    An ``http(s)://`` URL is a `lab serve` server (token: ``LAB_TOKEN``): its tables come
    over its read API as Arrow (`lab_source.mode` is ``'http'``), and the views, `summary`,
    `predictions` and `disagreements` work on them unchanged.
    """
    if mode not in ("auto", "attach", "arrow"):
        raise ConfigError(f"mode={mode!r}: use 'auto', 'attach' or 'arrow'")
    if _is_http(url):
        if mode == "attach":
            raise ConfigError(
                "mode='attach' reads a SQL store in place; a lab serve URL is copied in "
                "through Arrow: leave mode out"
            )
        return _connect_http(url)
    if url is not None and _is_folder(url):
        if mode != "auto":
            raise ConfigError(
                f"mode={mode!r} applies to a store URL; {os.fspath(url)} is an export folder, "
                "read in place: leave mode out"
            )
        return _connect_parquet(Path(url))
    return _connect_store(url, mode)


def _connect_store(url: str | os.PathLike[str] | None, mode: Mode) -> duckdb.DuckDBPyConnection:
    """`connect` for a SQL store: ATTACHed in place when `mode` allows and the scanner
    loads, else copied in through Arrow; the views are the same either way."""
    store = Store(resolve_url(os.fspath(url) if url is not None else None), readonly=True)
    try:
        missing = _missing_columns(store)
        # judged before DuckDB opens the file: its SQLite is another library in this process
        crashed = None if _lacks_owners(missing) else store.crashed_now()
        con = duckdb.connect()
        used = None
        if mode in ("auto", "attach"):
            try:
                _attach(con, store)
                used = "attach"
            except (duckdb.Error, OSError) as exc:
                # DuckDB's error repeats the connection string, password included
                reason = mask(" ".join(str(exc).split()))
                if mode == "attach":
                    raise StoreError(
                        f"DuckDB cannot attach the store at {_shown(store)} ({reason}); "
                        "fix what it says, or read it through Arrow with mode='arrow'"
                    ) from None
                log.info("DuckDB cannot attach the store (%s); copying it in through Arrow", reason)
        if used is None:
            _copy_through_arrow(con, store, missing)
            used = "arrow"
        _create_views(con, nan_is_null=store.dialect == "sqlite", missing=missing, crashed=crashed)
        con.execute("CREATE TABLE lab_source AS SELECT ? AS url, ? AS mode", [_shown(store), used])
        if used == "attach":
            _STORES[con] = store.url
        return con
    finally:
        store.close()


def _lacks_owners(missing: dict[str, set[str]]) -> bool:
    """Whether an older store lacks the columns that tell a live run or experiment from a
    crashed one (it is then read as it is)."""
    return bool(missing.get("experiments", set()) & {"pid", "heartbeat_at"})


def _shown(store: Store) -> str:
    """The store's URL as messages show it: without its password."""
    return store.engine.url.render_as_string(hide_password=True)


def _missing_columns(store: Store) -> dict[str, set[str]]:
    """The columns of each table that a store at an older revision lacks (nothing at head);
    refuses a store that lacks a whole table, which an upgrade must fill in first."""
    if store.revision is None or store.revision == head_revision():
        return {}
    found = sa.inspect(store.engine)
    tables = set(found.get_table_names())
    url = store.engine.url.render_as_string(hide_password=True)
    lacking = [name for name in TABLES if name not in tables and name not in _ADDED_LATER]
    if lacking:
        raise SchemaTooOld(
            f"{url} is at schema revision {store.revision}, older than this lab's "
            f"{head_revision()}, and lacks {', '.join(lacking)}; upgrade it (a backup is "
            f"made first): lab db upgrade --store {url}"
        )
    missing = {}
    for name in TABLES:  # a table added later and absent: every column is missing
        present = {c["name"] for c in found.get_columns(name)} if name in tables else set()
        missing[name] = {c.name for c in Base.metadata.tables[name].columns} - present
    return missing


def _is_http(url: str | os.PathLike[str] | None) -> bool:
    """Whether `url` (else ``LAB_STORE_URL``) names a `lab serve` server."""
    text = os.fspath(url) if url is not None else os.environ.get("LAB_STORE_URL", "")
    return text.strip().lower().startswith(("http://", "https://"))


def _connect_http(url: str | os.PathLike[str] | None) -> duckdb.DuckDBPyConnection:
    """The views of `connect`, over the tables a `lab serve` server hands out as Arrow.

    The server sends NaN as NaN and JSON as its text (as a PostgreSQL store reads), so the
    views are built as over one.
    """
    from lab.store.http import HttpStore

    store = HttpStore(os.fspath(url) if url is not None else None)
    try:
        con = duckdb.connect()
        con.execute("CREATE SCHEMA store")
        for name in TABLES:
            data = store.table(name)
            con.register("_lab_arrow", data)
            con.execute(f'CREATE TABLE store."{name}" AS SELECT * FROM _lab_arrow')
            con.unregister("_lab_arrow")
        _create_views(con, nan_is_null=False)
        shown = [store.url.shown, "http"]
        con.execute("CREATE TABLE lab_source AS SELECT ? AS url, ? AS mode", shown)
        return con
    finally:
        store.close()


def _is_folder(url: str | os.PathLike[str]) -> bool:
    """Whether `url` names a folder (an export) rather than a store URL."""
    text = os.fspath(url)
    return "://" not in text and Path(text).expanduser().is_dir()


def _connect_parquet(folder: Path) -> duckdb.DuckDBPyConnection:
    """The views of `connect`, over the Parquet files of an export folder.

    An export holds what the views showed (NaN already restored, JSON typed), so the views
    are built over the files as over a PostgreSQL store: with nothing to map back.
    """
    folder = folder.expanduser().resolve()
    files = {name: folder / f"{name}.parquet" for name in TABLES}
    missing = [n for n in TABLES if not files[n].is_file() and n not in _ADDED_LATER]
    if missing:
        lacking = ", ".join(f"{name}.parquet" for name in missing)
        raise StoreError(
            f"{folder} is not a lab export: it lacks {lacking}; "
            f"write one with: lab export NAME --to {folder}"
        )
    con = duckdb.connect()
    con.execute("CREATE SCHEMA store")
    absent: dict[str, set[str]] = {}  # an export from before a table was added
    for name in TABLES:
        if not files[name].is_file():
            absent[name] = {c.name for c in Base.metadata.tables[name].columns}
            continue
        path = _quote(str(files[name]))
        con.execute(f"CREATE VIEW store.\"{name}\" AS SELECT * FROM read_parquet('{path}')")
    _create_views(con, nan_is_null=False, missing=absent)
    con.execute("CREATE TABLE lab_source AS SELECT ? AS url, ? AS mode", [str(folder), "parquet"])
    return con


def _load_scanner(con: duckdb.DuckDBPyConnection, backend: str) -> None:
    package, extension = _SCANNERS[backend]
    try:
        module = __import__(package)
    except ImportError:
        con.execute(f"LOAD {extension}")  # installed by hand; never INSTALL from here
        return
    assert module.__file__ is not None  # a regular package (its __init__.py), never a namespace
    path = Path(module.__file__).parent / "extensions" / f"v{duckdb.__version__}"
    con.execute(f"LOAD '{path / (extension + '.duckdb_extension')}'")


def _attach(con: duckdb.DuckDBPyConnection, store: Store) -> None:
    backend = store.dialect
    _load_scanner(con, backend)
    url = resolve_url(store.url).parsed  # (the store's own StoreURL, as it is)
    if backend == "sqlite":
        database = url.database
        if not database or database == ":memory:":
            raise duckdb.IOException("an in-memory SQLite store cannot be attached")
        con.execute(f"ATTACH '{_quote(str(Path(database).resolve()))}' AS store "
                    "(TYPE sqlite, READ_ONLY)")  # fmt: skip
        try:  # the scanner opens the file on first use: one that cannot falls back to Arrow
            con.execute('SELECT * FROM store."experiments" LIMIT 0')
        except duckdb.Error:
            con.execute("DETACH store")
            raise
    else:
        parts = {
            "host": url.host,
            "port": url.port,
            "user": url.username,
            "password": url.password,
            "dbname": url.database,
        }
        dsn = " ".join(f"{k}={_libpq(v)}" for k, v in parts.items() if v is not None)
        con.execute(f"ATTACH '{_quote(dsn)}' AS store (TYPE postgres, READ_ONLY)")


def _quote(text: str) -> str:
    return text.replace("'", "''")


def _libpq(value: Any) -> str:
    text = str(value)
    if not text or any(c in text for c in " '\\"):
        return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return text


def _copy_through_arrow(
    con: duckdb.DuckDBPyConnection, store: Store, missing: dict[str, set[str]]
) -> None:
    con.execute("CREATE SCHEMA store")
    with store.engine.connect() as conn:
        for name in TABLES:
            copied = copied_columns(name)
            lacks = missing.get(name, set())
            columns = [
                sa.null().label(c.name)
                if c.name in lacks
                else sa.cast(c, sa.Text).label(c.name)
                if isinstance(c.type, sa.JSON)
                else c
                for c in copied
            ]
            rows = [] if _absent(name, missing) else conn.execute(sa.select(*columns)).all()
            schema = pa.schema([(c.name, _arrow_type(c)) for c in copied])
            data = pa.Table.from_pylist([dict(r._mapping) for r in rows], schema=schema)
            con.register("_lab_arrow", data)
            con.execute(f'CREATE TABLE store."{name}" AS SELECT * FROM _lab_arrow')
            con.unregister("_lab_arrow")


_NAN_AS_NULL = {("metrics", "value"), ("summaries", "last_value")}

#: Tables a later revision added: a store from before reads them as empty views.
_ADDED_LATER = {"histograms", "images", "sweep_trials", "eliminations"}


def _absent(name: str, missing: dict[str, set[str]]) -> bool:
    """Whether table `name` is absent from the store (an older revision lacks it)."""
    return name in _ADDED_LATER and missing.get(name) == {
        c.name for c in Base.metadata.tables[name].columns
    }


_RUN_COLUMNS = """e.name AS experiment, a.name AS arm, r.repeat, r.run_key"""
_RUN_JOINS = """JOIN runs r USING (run_id)
JOIN experiments e USING (experiment_id)
LEFT JOIN arms a ON a.arm_id = r.arm_id"""
# The media views, over the store's rows (`{select}`): each row with its run's experiment,
# arm, repeat and key; an image's path made absolute from the run's folder. A sweep's
# trials and a race's eliminations: each row with its experiment's and arm's names.
_ARM_JOINS = """JOIN experiments e USING (experiment_id)
JOIN arms a ON a.arm_id = x.arm_id"""
_JOINED = {
    "sweep_trials": f"""
        CREATE VIEW sweep_trials AS
        SELECT e.name AS experiment, a.name AS arm, x.experiment_id, x.number, x.arm_id,
               x.params, x.asked_after, x.told, x.value, x.state
        FROM ({{select}}) x
        {_ARM_JOINS}
        WHERE x.number >= 0
        """,
    "eliminations": f"""
        CREATE VIEW eliminations AS
        SELECT e.name AS experiment, a.name AS arm, x.experiment_id, x.arm_id, x.round,
               x.test, x.statistic, x.p_value, x.alpha, x.best_arm, x.created_at
        FROM ({{select}}) x
        {_ARM_JOINS}
        """,
    "histograms": f"""
        CREATE VIEW histograms AS
        SELECT {_RUN_COLUMNS}, h.run_id, h.key, h.step,
               from_json(h.edges, '["DOUBLE"]') AS edges,
               from_json(h.counts, '["BIGINT"]') AS counts,
               h.nan, h.posinf, h.neginf, h.wall_time
        FROM ({{select}}) h
        {_RUN_JOINS}
        """,
    "images": f"""
        CREATE VIEW images AS
        SELECT {_RUN_COLUMNS}, i.run_id, i.key, i.step,
               CASE WHEN r.output_dir IS NULL OR regexp_matches(i.path, '^([A-Za-z]:)?[/\\\\]')
                    THEN i.path ELSE r.output_dir || '/' || i.path END AS path,
               i.width, i.height, i.wall_time
        FROM ({{select}}) i
        {_RUN_JOINS}
        """,
}


_DUCK_TYPES = {"int64": "BIGINT", "double": "DOUBLE", "timestamp[us]": "TIMESTAMP"}

# The views over the views: a run's final values, its tags, an experiment's tags.
_FINAL_METRICS_VIEW = """
CREATE VIEW final_metrics AS
SELECT e.name AS experiment, a.name AS arm, r.repeat, r.run_key, r.status,
       s.run_id, s.key, s.last_step AS step, s.last_value AS value,
       s.min_value, s.max_value, s.count
FROM summaries s
JOIN runs r USING (run_id)
JOIN experiments e USING (experiment_id)
LEFT JOIN arms a ON a.arm_id = r.arm_id
"""
_RUN_TAGS_VIEW = """
CREATE VIEW run_tags AS
SELECT e.name AS experiment, r.run_key, r.run_id, unnest(from_json(r.tags, '["VARCHAR"]'))
       AS tag
FROM runs r JOIN experiments e USING (experiment_id)
WHERE r.tags IS NOT NULL
"""
_EXPERIMENT_TAGS_VIEW = """
CREATE VIEW experiment_tags AS
SELECT name AS experiment, experiment_id, unnest(from_json(tags, '["VARCHAR"]')) AS tag
FROM experiments WHERE tags IS NOT NULL
"""


def _create_views(
    con: duckdb.DuckDBPyConnection,
    *,
    nan_is_null: bool,
    missing: dict[str, set[str]] | None = None,
    crashed: Crashed | None = None,
) -> None:
    """The views over the store's tables (schema ``store``). `crashed`: the runs and
    experiments whose process is gone, which the `runs` and `experiments` views show as
    crashed while their row is the one judged (still `running`, the same heartbeat), as
    ``lab ls`` shows them; nothing is written."""
    _gone_table(con, crashed)
    for name in TABLES:
        exprs = _column_exprs(name, (missing or {}).get(name, set()), nan_is_null)
        source = f'store."{name}" s'
        if name in ("runs", "experiments"):  # a row whose process is gone reads as crashed
            source += (
                f" LEFT JOIN lab_gone g ON g.gone_table = '{name}' AND "
                f"g.gone_id = {exprs[name[:-1] + '_id']} AND {exprs['status']} = 'running' "
                f"AND g.gone_beat IS NOT DISTINCT FROM {exprs['heartbeat_at']}"
            )
            exprs["status"] = (
                f"CASE WHEN g.gone_id IS NULL THEN {exprs['status']} ELSE 'crashed' END"
            )
            if "error" in exprs:
                exprs["error"] = (
                    f"CASE WHEN g.gone_id IS NULL THEN {exprs['error']} ELSE g.gone_why END"
                )
        columns = ", ".join(f'{expr} AS "{column}"' for column, expr in exprs.items())
        select = f"SELECT {columns} FROM {source}"
        if _absent(name, missing or {}):  # an older store without this table: no rows
            select = f"SELECT {columns} WHERE false"
        if name in _JOINED:  # with the run's experiment, arm, repeat and key
            con.execute(_JOINED[name].format(select=select))
            continue
        if name == "runs":  # superseded runs (fresh=True) are kept, in all_runs only
            con.execute(f"CREATE VIEW all_runs AS {select}")
            select += f" WHERE {exprs['superseded_at']} IS NULL"
        con.execute(f'CREATE VIEW "{name}" AS {select}')
    for view in (_FINAL_METRICS_VIEW, _PROVENANCE_VIEW, _RUN_TAGS_VIEW, _EXPERIMENT_TAGS_VIEW):
        con.execute(view)


def _column_exprs(name: str, lacks: set[str], nan_is_null: bool) -> dict[str, str]:
    """Each column of table `name` as its view reads it from the store's row ``s``: JSON as
    JSON, a NaN that SQLite keeps as NULL as NaN again (`nan_is_null`), and a column an
    older store `lacks` as a typed NULL."""
    exprs = {}
    for column in copied_columns(name):
        quoted = f's."{column.name}"'
        if column.name in lacks:  # an older revision's store: NULL until it is upgraded
            kind = "JSON" if isinstance(column.type, sa.JSON) else None
            kind = kind or _DUCK_TYPES.get(str(_arrow_type(column)), "VARCHAR")
            exprs[column.name] = f"NULL::{kind}"
        elif isinstance(column.type, sa.JSON):
            exprs[column.name] = f"{quoted}::JSON"
        elif (name, column.name) in _NAN_AS_NULL and nan_is_null:
            exprs[column.name] = f"coalesce({quoted}, 'nan'::DOUBLE)"
        else:
            exprs[column.name] = quoted
    return exprs


def _gone_table(con: duckdb.DuckDBPyConnection, crashed: Crashed | None) -> None:
    """``lab_gone``: the rows the views show as crashed (table, id, heartbeat as judged,
    why), as judged when the connection was made."""
    con.execute(
        "CREATE TABLE lab_gone (gone_table VARCHAR, gone_id BIGINT, gone_beat TIMESTAMP, "
        "gone_why VARCHAR)"
    )
    if crashed is None:
        return
    rows = [
        (table, g.id, g.heartbeat_at, g.why)
        for table, found in (("runs", crashed.runs), ("experiments", crashed.experiments))
        for g in found.values()
    ]
    if rows:
        con.executemany("INSERT INTO lab_gone VALUES (?, ?, ?, ?)", rows)


# One row per run: the fields of `runs.provenance` a question usually needs, as columns.
_PROVENANCE_VIEW = """
CREATE VIEW provenance AS
SELECT e.name AS experiment, a.name AS arm, r.run_key, r.run_id, r.status,
       json_extract_string(r.provenance, '$.git.commit') AS "commit",
       CAST(json_extract(r.provenance, '$.git.dirty') AS BOOLEAN) AS dirty,
       json_extract_string(r.provenance, '$.git.branch') AS branch,
       json_extract_string(r.provenance, '$.python') AS python,
       json_extract_string(r.provenance, '$.torch') AS torch,
       json_extract_string(r.provenance, '$.cuda') AS cuda,
       from_json(json_extract(r.provenance, '$.devices'), '["VARCHAR"]') AS devices,
       json_extract_string(r.provenance, '$.host') AS host,
       from_json(json_extract(r.provenance, '$.command'), '["VARCHAR"]') AS command,
       json_extract(r.provenance, '$.packages') AS packages,
       r.provenance
FROM runs r
JOIN experiments e USING (experiment_id)
LEFT JOIN arms a ON a.arm_id = r.arm_id
"""


def provenance(
    con: duckdb.DuckDBPyConnection, experiment: str | None = None
) -> duckdb.DuckDBPyRelation:
    """Each run's provenance as columns (experiment, arm, run_key, status, commit, dirty,
    branch, python, torch, cuda, devices, host, command, packages, and the whole record),
    for one experiment or all. Why: "which code and which packages produced this number"
    is a join away from every result.

    >>> lab.inspect.provenance(con, "lr-sweep").df()                        # doctest: +SKIP
    >>> con.sql("select run_key, packages->>'$.torch' from provenance")     # doctest: +SKIP
    """
    if experiment is None:
        return con.sql("SELECT * FROM provenance ORDER BY experiment, run_id")
    return con.sql(
        "SELECT * FROM provenance WHERE experiment = $name ORDER BY run_id",
        params={"name": experiment},
    )


def history(
    con: duckdb.DuckDBPyConnection, run_key: str, key: str, *, experiment: str | None = None
) -> duckdb.DuckDBPyRelation:
    """One run's full series of one metric, as a relation of (step, value) in step order.

    DuckDB's scanners cannot push a filter down into the store, so ``select ... from metrics
    where run_id = ...`` reads every point of every run (seconds at 10 million points). This
    reads the one series through the store's own (run, key, step) index instead, in
    milliseconds however large the store is. `experiment` is needed only when several
    experiments have a run of that key.

    >>> con = lab.inspect.connect("sqlite:///lab.db")                 # doctest: +SKIP
    >>> lab.inspect.history(con, "sgd-lr0.1-r0", "loss").df()         # doctest: +SKIP
    """
    run_id = _run_id(con, run_key, experiment)
    sql = "SELECT key FROM summaries WHERE run_id = ? ORDER BY key"
    known = [k for (k,) in con.execute(sql, [run_id]).fetchall()]
    if key not in known:
        raise ConfigError(
            f"run {run_key!r} has no metric {key!r}; it has: {', '.join(known) or 'none'}"
        )
    url = _STORES.get(con)
    if url is None:  # copied in through Arrow: the copy is a DuckDB table, indexed or not
        return con.sql(
            f"SELECT step, value FROM metrics WHERE run_id = {int(run_id)} AND key = $key "
            "ORDER BY step",
            params={"key": key},
        )
    engine = make_engine(url, readonly=True)
    try:
        with connect_store(engine) as conn:
            rows = conn.execute(
                sa.text('SELECT step, value FROM metrics WHERE run_id = :r AND "key" = :k '
                        "ORDER BY step"), {"r": run_id, "k": key},
            ).all()  # fmt: skip
    finally:
        engine.dispose()
    table = pa.table(
        {
            "step": pa.array([r[0] for r in rows], pa.int64()),
            # SQLite stores NaN as NULL: a metric value is never missing, so NULL is NaN
            "value": pa.array([float("nan") if r[1] is None else r[1] for r in rows], pa.float64()),
        }
    )
    return con.from_arrow(table)


def histograms(
    con: duckdb.DuckDBPyConnection, run_key: str, key: str, *, experiment: str | None = None
) -> duckdb.DuckDBPyRelation:
    """One run's histograms of one key, in step order: (step, edges, counts, nan, posinf,
    neginf), edges and counts as lists. Why: a weight distribution over training is read
    as one series, like `history` reads a metric; an unknown key names the run's keys.

    >>> h = lab.inspect.histograms(con, "sgd-lr0.1-r0", "weights").fetchall()  # doctest: +SKIP
    >>> step, edges, counts, nan, posinf, neginf = h[-1]                       # doctest: +SKIP
    """
    run_id = _run_id(con, run_key, experiment)
    _check_media_key(con, "histograms", run_key, run_id, key)
    return con.sql(
        "SELECT step, edges, counts, nan, posinf, neginf FROM histograms "
        f"WHERE run_id = {int(run_id)} AND key = $key ORDER BY step",
        params={"key": key},
    )


def images(
    con: duckdb.DuckDBPyConnection,
    run_key: str,
    key: str | None = None,
    *,
    experiment: str | None = None,
) -> duckdb.DuckDBPyRelation:
    """One run's images (of one key, or all), in (key, step) order: (key, step, path,
    width, height), `path` absolute. Why: a notebook opens the files, a query picks them.

    >>> for key, step, path, w, h in lab.inspect.images(con, "gan-r0").fetchall():  # doctest: +SKIP
    ...     print(step, path)
    """
    run_id = _run_id(con, run_key, experiment)
    if key is not None:
        _check_media_key(con, "images", run_key, run_id, key)
    return con.sql(
        "SELECT key, step, path, width, height FROM images "
        f"WHERE run_id = {int(run_id)} AND ($key IS NULL OR key = $key) ORDER BY key, step",
        params={"key": key},
    )


_RACE_SCHEMA = pa.schema([
    ("arm", pa.string()), ("round", pa.int64()), ("status", pa.string()),
    ("value", pa.float64()), ("n", pa.int64()), ("mean", pa.float64()),
    ("ci_low", pa.float64()), ("ci_high", pa.float64()), ("eliminated", pa.bool_()),
    ("test", pa.string()), ("statistic", pa.float64()), ("p_value", pa.float64()),
    ("alpha", pa.float64()), ("best", pa.string()), ("winner", pa.bool_()),
])  # fmt: skip
_TRIAL_SCHEMA = pa.schema([
    ("number", pa.int64()), ("arm", pa.string()), ("params", pa.string()),
    ("value", pa.float64()), ("state", pa.string()),
])  # fmt: skip


def race(con: duckdb.DuckDBPyConnection, experiment: str) -> duckdb.DuckDBPyRelation:
    """An experiment's race (``Experiment(race=...)``): one row per arm and closed round it
    raced in, by arm then round. Why: which arms the race kept, how their intervals
    narrowed and why each one was dropped, as ``lab show`` prints it and the dashboard draws
    it (one computation: `lab.sweeps.report.race_table`).

    Columns: arm, round, status and value (the round's run: its status, and its final
    value of the race's metric when it counts, else NULL), n (its counted runs up to that
    round), mean, ci_low, ci_high (the summaries' 95% interval; NULL below two runs),
    eliminated (dropped after this round), and on that row the test, statistic, p_value
    (Holm-corrected), alpha and best (the arm it lost to); winner: the race is over and
    this arm won it.

    >>> lab.inspect.race(con, "lr-race").df()                               # doctest: +SKIP
    """
    from lab.sweeps.report import race_table

    config = _experiment_config(con, experiment)
    fields = config.get("race") if isinstance(config, dict) else None
    if not isinstance(fields, dict):
        raise ConfigError(
            f"experiment {experiment!r} ran no race; Experiment(race=Race(...)) runs one"
        )
    record = {"name": experiment, "config": config, "arms": _arm_names(con, experiment),
              "runs": _run_values(con, experiment, str(fields.get("metric")))}  # fmt: skip
    eliminations = [
        dict(zip(("arm", "round", "test", "statistic", "p_value", "alpha", "best"), row,
                 strict=True))
        for row in con.execute(
            "SELECT arm, round, test, statistic, p_value, alpha, best_arm FROM eliminations "
            "WHERE experiment = ? ORDER BY round, arm", [experiment],
        ).fetchall()
    ]  # fmt: skip
    table = race_table(record, eliminations)
    assert table is not None  # the config holds a race
    out = {e["arm"]: e for e in table["eliminations"]}
    rows = []
    for row in table["rows"]:
        e = out.get(row["arm"]) if row["eliminated"] else None
        rows.append({**row, **{k: e[k] if e else None
                               for k in ("test", "statistic", "p_value", "alpha", "best")},
                     "winner": row["arm"] == table["winner"]})  # fmt: skip
    return con.from_arrow(pa.Table.from_pylist(rows, schema=_RACE_SCHEMA))


def trials(con: duckdb.DuckDBPyConnection, experiment: str) -> duckdb.DuckDBPyRelation:
    """An experiment's sampled arms (``Experiment(sweep=...)``), in ask order: number, arm,
    params (JSON text: the active parameters), value (the arm's summary of the sweep
    metric; NULL until told, or when it failed) and state (running, complete, pruned,
    failed). Why: the sweep's table as ``lab show`` prints it
    (`lab.sweeps.report.trials_table`), ready to sort, plot or join to `final_metrics`.

    >>> lab.inspect.trials(con, "search").df().sort_values("value")        # doctest: +SKIP
    """
    import json

    from lab.sweeps.report import trials_table

    _experiment_config(con, experiment)
    records = [
        {"number": n, "arm": arm, "params": json.loads(p) if isinstance(p, str) else p,
         "value": value, "state": state}
        for n, arm, p, value, state in con.execute(
            "SELECT number, arm, params, value, state FROM sweep_trials WHERE experiment = ? "
            "ORDER BY number", [experiment],
        ).fetchall()
    ]  # fmt: skip
    rows = [{**t, "params": json.dumps(t["params"])} for t in trials_table(records)]
    return con.from_arrow(pa.Table.from_pylist(rows, schema=_TRIAL_SCHEMA))


def _experiment_config(con: duckdb.DuckDBPyConnection, experiment: str) -> Any:
    """The recorded config of `experiment`; an unknown name is one line naming the known."""
    import json

    found = con.execute("SELECT config FROM experiments WHERE name = ?", [experiment]).fetchone()
    if found is None:
        known = [n for (n,) in con.sql("SELECT name FROM experiments ORDER BY name").fetchall()]
        raise ConfigError(
            f"no experiment named {experiment!r} in the store; known: {', '.join(known) or 'none'}"
        )
    return json.loads(found[0]) if isinstance(found[0], str) else found[0]


def _arm_names(con: duckdb.DuckDBPyConnection, experiment: str) -> list[dict[str, Any]]:
    sql = ("SELECT a.name FROM arms a JOIN experiments e USING (experiment_id) "
           "WHERE e.name = ? ORDER BY a.arm_id")  # fmt: skip
    return [{"name": name} for (name,) in con.execute(sql, [experiment]).fetchall()]


def _run_values(
    con: duckdb.DuckDBPyConnection, experiment: str, metric: str
) -> list[dict[str, Any]]:
    """The experiment's current runs with their final value of `metric`, as the store's
    records give them (`get_experiment`'s runs, the keys a race table reads): the last value
    logged, overlaid with the value the run returned."""
    import json

    from lab._json import floats_back

    rows = con.execute(
        "SELECT a.name, r.repeat, r.stage, r.status, s.last_value, r.summary FROM runs r "
        "JOIN experiments e USING (experiment_id) LEFT JOIN arms a ON a.arm_id = r.arm_id "
        "LEFT JOIN summaries s ON s.run_id = r.run_id AND s.key = ? "
        "WHERE e.name = ? ORDER BY r.run_id", [metric, experiment],
    ).fetchall()  # fmt: skip
    out = []
    for arm, repeat, stage, status, value, returned in rows:
        summary = {} if value is None else {metric: value}
        returned = json.loads(returned) if isinstance(returned, str) else returned
        if isinstance(returned, dict) and metric in returned:
            summary[metric] = floats_back(returned)[metric]
        out.append({"arm": arm, "repeat": repeat, "stage": stage, "status": status,
                    "summary": summary})  # fmt: skip
    return out


def _check_media_key(
    con: duckdb.DuckDBPyConnection, view: str, run_key: str, run_id: int, key: str
) -> None:
    sql = f"SELECT DISTINCT key FROM {view} WHERE run_id = ? ORDER BY key"
    known = [k for (k,) in con.execute(sql, [run_id]).fetchall()]
    if key not in known:
        what = view[:-1]
        raise ConfigError(
            f"run {run_key!r} has no {what} {key!r}; it has: {', '.join(known) or 'none'}"
        )


def _run_id(con: duckdb.DuckDBPyConnection, run_key: str, experiment: str | None) -> int:
    rows = con.execute(
        "SELECT r.run_id, e.name FROM runs r JOIN experiments e USING (experiment_id) "
        "WHERE r.run_key = ? AND (? IS NULL OR e.name = ?)",
        [run_key, experiment, experiment],
    ).fetchall()
    if len(rows) == 1:
        return int(rows[0][0])
    if rows:
        names = ", ".join(sorted(name for _, name in rows))
        raise ConfigError(f"run {run_key!r} is in several experiments ({names}); pass experiment=")
    where = "" if experiment is None else f" of experiment {experiment!r}"
    known = [k for (k,) in con.execute(
        "SELECT DISTINCT r.run_key FROM runs r JOIN experiments e USING (experiment_id) "
        "WHERE ? IS NULL OR e.name = ? ORDER BY 1 LIMIT 20", [experiment, experiment],
    ).fetchall()]  # fmt: skip
    raise ConfigError(f"no run {run_key!r}{where}; runs: {', '.join(known) or 'none'}")


# The analysis functions live in lab.analysis (which does not import this module); they are
# re-exported here so that one import gives the connection and what to ask it.
from lab.analysis import breakdown as breakdown  # noqa: E402
from lab.analysis import compare as compare  # noqa: E402
from lab.analysis import curves as curves  # noqa: E402
from lab.analysis import disagreements as disagreements  # noqa: E402
from lab.analysis import plot_curves as plot_curves  # noqa: E402
from lab.analysis import plot_summary as plot_summary  # noqa: E402
from lab.analysis import predictions as predictions  # noqa: E402
from lab.analysis import summary as summary  # noqa: E402
