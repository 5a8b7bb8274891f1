"""Histogram and image rows: queued on the training thread, written by a writer of their own.

`MediaRows.put` turns one step's `lab.media` records into rows and appends them to a
`MetricWriter` of their own (started on first use), so logging a histogram or an image
costs the training thread no store I/O, exactly as a metric does: the rows are written in
batches, one transaction each, by that writer's thread, with the same back-pressure,
retries and flush semantics. `Store.flush` flushes them with the metrics, so every row up
to a saved checkpoint is durable.

Rows are keyed by (run, key, step): logging the same key at the same step again replaces
the row (a resumed run never duplicates one). An image's row keeps the PNG's bytes (`data`,
read from its file on the writer thread), which is what a server serves, and its file's
path relative to the run folder (absolute when the file lies outside it, or the run has no
folder), as a record of where the file was written.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from lab._metrics import check_key
from lab.errors import MetricError
from lab.media import Histogram, Image, image_bytes, stored_path
from lab.store.engine import connect, transaction
from lab.store.schema import Base, SqlHistogram, SqlImage
from lab.store.statements import dialect_insert
from lab.store.writer import Item, MetricWriter

#: The models' tables (the same objects as their ``__table__``, typed as tables).
_HISTOGRAMS = Base.metadata.tables[SqlHistogram.__tablename__]
_IMAGES = Base.metadata.tables[SqlImage.__tablename__]

#: One step's media as queued: {key: (record, run folder)}.
Media = dict[str, tuple[Histogram | Image, Path | None]]


class MediaRows:
    """The `histograms` and `images` rows of one store: writes queued, reads direct."""

    def __init__(self, engine: Engine, *, give_up_s: float | None = None) -> None:
        self.engine = engine
        self._give_up_s = give_up_s
        self._writer: MetricWriter[Media] | None = None
        self._good_keys: set[str] = set()  # keys checked already
        self._upserts = {}
        for table in (_HISTOGRAMS, _IMAGES):
            stmt = dialect_insert(engine.dialect.name, table)
            keys = ("run_id", "key", "step")
            updates = {c.name: stmt.excluded[c.name] for c in table.columns if c.name not in keys}
            self._upserts[table.name] = stmt.on_conflict_do_update(
                index_elements=list(keys), set_=updates
            )

    # -- the training thread's side ------------------------------------------------------
    def put(
        self,
        run_id: int,
        step: int,
        media: Mapping[str, Histogram | Image],
        folder: Path | None = None,
    ) -> None:
        """Queue one step's histograms and images; waits only while the queue is full.

        `folder` is the run folder: an image's path is stored relative to it (worked out on
        the writer thread, as the rows are). A key the store cannot hold, or a value that is
        not a `Histogram` or an `Image`, is one `MetricError` line naming the key and the
        step, and nothing of that step is queued. The records are frozen: they are queued as
        they are, not copied.
        """
        rows: Media = {}
        good = self._good_keys
        for key, record in media.items():
            if key not in good:
                check_key(key, step)
                good.add(key)
            if isinstance(record, Histogram | Image):
                rows[key] = (record, folder)
            else:
                raise MetricError(
                    f"media {key!r} at step {step} is a {type(record).__name__}; log a "
                    "lab.media.Histogram or lab.media.Image (lab.media.histogram, "
                    "lab.media.write_image make them)"
                )
        if rows:
            self._queue().put(run_id, step, rows, time.time())

    def _queue(self) -> MetricWriter[Media]:
        if self._writer is None:
            self._writer = MetricWriter(self._write, give_up_s=self._give_up_s, what="media")
        return self._writer

    def flush(self) -> None:
        """Make every histogram and image row queued so far durable (see `Store.flush`)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and stop the writer (a later `put` starts a new one)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    # -- the writer thread ---------------------------------------------------------------
    def _write(self, items: list[Item[Media]]) -> None:
        # One row per (run, key, step), the last logged wins: PostgreSQL refuses an upsert
        # that touches one row twice in a statement.
        latest: dict[str, dict[tuple[int, str, int], dict[str, Any]]] = {
            "histograms": {},
            "images": {},
        }
        for run_id, step, rows, wall_time in items:
            for key, (record, folder) in rows.items():
                if isinstance(record, Histogram):
                    table, values = "histograms", _histogram_row(record)
                else:
                    table, values = "images", _image_row(record, folder)
                ids = {"run_id": run_id, "key": key, "step": step}
                latest[table][(run_id, key, step)] = {**ids, **values, "wall_time": wall_time}
        if not any(latest.values()):
            return
        with transaction(self.engine) as conn:
            for table, by_key in latest.items():
                if by_key:
                    conn.execute(self._upserts[table], list(by_key.values()))

    # -- reads ---------------------------------------------------------------------------
    def histograms(self, run_id: int, key: str | None = None) -> list[dict[str, Any]]:
        """A run's histograms (of one key, or all), in (key, step) order, as plain dicts:
        key, step, edges, counts, nan, posinf, neginf, wall_time."""
        return self._read(_HISTOGRAMS, run_id, key)

    def images(self, run_id: int, key: str | None = None) -> list[dict[str, Any]]:
        """A run's image rows (of one key, or all), in (key, step) order, as plain dicts:
        key, step, path (as stored: relative to the run folder), width, height, wall_time.
        The PNG's bytes stay in the store (`image_data` reads one image's)."""
        return self._read(_IMAGES, run_id, key)

    def image_data(self, run_id: int, key: str, step: int) -> bytes | None:
        """The PNG bytes the store keeps for one image, or None (no such row, or a row
        recorded before the store kept image bytes)."""
        self.flush()
        query = sa.select(_IMAGES.c.data).where(
            _IMAGES.c.run_id == run_id, _IMAGES.c.key == key, _IMAGES.c.step == step
        )
        with connect(self.engine) as conn:
            data = conn.execute(query).scalar_one_or_none()
        return None if data is None else bytes(data)

    def _read(self, table: sa.Table, run_id: int, key: str | None) -> list[dict[str, Any]]:
        self.flush()
        where = [table.c.run_id == run_id]
        if key is not None:
            where.append(table.c.key == key)
        columns = [c for c in table.columns if c.name not in ("run_id", "data")]
        query = sa.select(*columns).where(*where).order_by(table.c.key, table.c.step)
        with connect(self.engine) as conn:
            return [dict(row) for row in conn.execute(query).mappings()]


def _histogram_row(h: Histogram) -> dict[str, Any]:
    return {
        "edges": list(h.edges),
        "counts": list(h.counts),
        "nan": h.nan,
        "posinf": h.posinf,
        "neginf": h.neginf,
    }


def _image_row(image: Image, folder: Path | None) -> dict[str, Any]:
    path = stored_path(image.path, folder)
    return {"path": path, "width": int(image.width), "height": int(image.height),
            "data": image_bytes(image)}  # fmt: skip
