"""One experiment out of the store, as Parquet files: to share, archive or analyse elsewhere.

`export(name, to)` writes every store table, cut down to that experiment's rows, to
``to/<table>.parquet`` (experiments, arms, groups, runs, metrics, summaries, evals,
predictions, checkpoints, histograms, images, and a sweep's trials and eliminations),
superseded runs and their rows left out. The files hold what
`lab.inspect.connect` shows: NaN restored
where SQLite stored NULL, JSON columns typed as JSON. ``lab.inspect.connect(to)`` reads the
folder back with the same views, so a notebook written against the store runs on an export
unchanged, without the store, its server or its other experiments.

>>> import lab.export                                                 # doctest: +SKIP
>>> lab.export.export("quickstart", "quickstart-export")              # doctest: +SKIP
{'experiments': 1, 'arms': 2, 'groups': 2, 'runs': 6, ...}
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import duckdb

import lab.inspect
from lab.errors import ExportError, LabError, NoExperiment
from lab.store.columns import TABLES, Base
from lab.store.engine import sqlite_error

_RUNS = "run_id IN (SELECT run_id FROM runs WHERE experiment_id = {id})"
# Which rows of each table belong to the experiment.
_ROWS = {
    "experiments": "experiment_id = {id}",
    "arms": "experiment_id = {id}",
    "groups": "experiment_id = {id}",
    "runs": "experiment_id = {id}",
    "metrics": _RUNS,
    "summaries": _RUNS,
    "evals": _RUNS,
    "predictions": f"eval_id IN (SELECT eval_id FROM evals WHERE {_RUNS})",
    "checkpoints": _RUNS,
    "histograms": _RUNS,
    "images": _RUNS,
    "sweep_trials": "experiment_id = {id} AND number >= 0",  # those set aside left out
    "eliminations": "experiment_id = {id}",
}


def export(
    name: str, to: str | os.PathLike[str], *, store: str | os.PathLike[str] | None = None
) -> dict[str, int]:
    """Write experiment `name`'s rows of every table to ``to/<table>.parquet``.

    `store` is a store URL (default: as every store URL) or an earlier export's folder.
    Returns the number of rows written per table. Each file is written under a temporary
    name and renamed once all are written, so a failed export leaves the folder's earlier
    files as they were. Rows are in primary-key order, so two exports of the same rows are
    the same files' contents. Raises `NoExperiment`, naming the known experiments.
    """
    folder = Path(to).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ExportError(
            f"cannot export to {folder}: it is a file, and an export is a folder of Parquet "
            "files; give a folder's path (it is created if missing)"
        )
    con = lab.inspect.connect(store)
    try:
        row = con.execute("SELECT experiment_id FROM experiments WHERE name = ?", [name]).fetchone()
        if row is None:
            names = con.execute("SELECT name FROM experiments ORDER BY name").fetchall()
            known = [n for (n,) in names]
            hint = f"; known: {', '.join(known)}" if known else ""
            raise NoExperiment(f"no experiment named {name!r} in the store{hint}")
        experiment_id = int(row[0])
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ExportError(
                f"cannot create the export folder {folder} ({exc.strerror or exc}); "
                "choose a folder you can write"
            ) from None
        return _write_tables(con, folder, experiment_id)
    finally:
        con.close()


def _write_tables(
    con: duckdb.DuckDBPyConnection, folder: Path, experiment_id: int
) -> dict[str, int]:
    """Each table's rows of the experiment, in primary-key order, to ``folder/<table>.parquet``:
    all written under temporary names first, then renamed; on an error the temporary files are
    removed and the earlier files are left as they were."""
    counts: dict[str, int] = {}
    written: list[tuple[Path, Path]] = []
    try:
        for table in TABLES:
            final = folder / f"{table}.parquet"
            tmp = folder / f".{table}.parquet.tmp"
            order = ", ".join(
                f'"{c.name}"' for c in Base.metadata.tables[table].primary_key.columns
            )
            where = _ROWS[table].format(id=experiment_id)
            path = str(tmp).replace("'", "''")
            written.append((tmp, final))
            (n,) = con.execute(
                f'COPY (SELECT * FROM "{table}" WHERE {where} ORDER BY {order}) '
                f"TO '{path}' (FORMAT parquet)"
            ).fetchone()  # type: ignore[misc]  # a COPY answers one row, its count
            counts[table] = int(n)
    except BaseException as exc:
        for tmp, _ in written:
            with contextlib.suppress(OSError):  # a folder that cannot be written
                tmp.unlink(missing_ok=True)
        mapped = _export_error(exc, folder, con) if isinstance(exc, duckdb.Error) else None
        if mapped is not None:
            raise mapped from None
        raise
    for tmp, final in written:
        os.replace(tmp, final)
    return counts


def _export_error(
    exc: duckdb.Error, folder: Path, con: duckdb.DuckDBPyConnection
) -> LabError | None:
    """One line for a failed export: a store that cannot be read, or a folder that cannot
    be written (the files written so far are removed); None for anything else."""
    (source,) = con.execute("SELECT url FROM lab_source").fetchone()  # type: ignore[misc]  # one row
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    mapped = sqlite_error(exc, source)
    if mapped is not None:
        return mapped
    if isinstance(exc, duckdb.IOException):
        return ExportError(
            f"cannot write the export into {folder} ({text}); choose a folder you can write"
        )
    return None
