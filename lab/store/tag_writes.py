"""Writes to the store: the tags and notes of an experiment or a run. One part of
`lab.store.Store` (see `lab.store.writes`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from lab._names import check_tags, storable_text
from lab.errors import NoRun
from lab.store.engine import transaction
from lab.store.schema import (
    SqlExperiment,
    SqlRun,
)


class TagWrites:
    """The part of `lab.store.Store` that writes tags and notes."""

    engine: Engine
    dialect: str

    def tag(
        self,
        experiment: str,
        run_key: str | None = None,
        *,
        add: Sequence[str] = (),
        remove: Sequence[str] = (),
        notes: str | None = None,
    ) -> dict[str, Any]:
        """Add and remove tags of an experiment (or of one of its runs), and set its notes
        (``""`` clears them); returns its tags and notes as they are now.

        Tags are plain strings, as in W&B: kept in the order they were added, each once.
        An unknown experiment or run is a `NoExperiment` / `NoRun` that lists the known ones.
        """
        add, remove = check_tags(add), check_tags(remove)
        with transaction(self.engine) as conn:
            exp_id = self.experiment_id(conn, experiment)
            if run_key is None:
                where = SqlExperiment.experiment_id == exp_id
                return self._annotate(conn, SqlExperiment, where, add, remove, notes)
            where = sa.and_(SqlRun.experiment_id == exp_id, SqlRun.run_key == run_key)
            if conn.execute(sa.select(SqlRun.run_id).where(where)).first() is None:
                keys = conn.execute(
                    sa.select(SqlRun.run_key).where(SqlRun.experiment_id == exp_id)
                ).scalars().all()  # fmt: skip
                raise NoRun(
                    f"experiment {experiment!r} has no run {run_key!r}; its runs: "
                    f"{', '.join(sorted(keys)) or 'none'}"
                )
            return self._annotate(conn, SqlRun, where, add, remove, notes)

    def _annotate(
        self,
        conn: Connection,
        model: Any,
        where: Any,
        add: list[str],
        remove: list[str],
        notes: str | None,
    ) -> dict[str, Any]:
        """Change one row's tags and notes inside the caller's write transaction."""
        read = sa.select(model.tags, model.notes).where(where)
        if self.dialect == "postgresql":
            read = read.with_for_update()  # SQLite: the transaction holds the write lock
        current, old_notes = conn.execute(read).one()
        tags = [t for t in current or [] if t not in remove]
        tags += [t for t in dict.fromkeys(add) if t not in tags]
        values: dict[str, Any] = {"tags": tags or None}
        if notes is not None:  # free text: NUL as U+FFFD, as in errors
            values["notes"] = storable_text(notes) or None
        conn.execute(sa.update(model).where(where).values(**values))
        return {"tags": tags, "notes": values.get("notes", old_notes)}
