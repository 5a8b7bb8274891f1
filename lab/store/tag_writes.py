"""Writes to the store: the tags and notes of an experiment or a run. One part of
`lab.store.Store` (see `lab.store.store`); `annotate` is also how an experiment's and a run's
writes (`lab.store.experiment_writes`, `lab.store.run_writes`) change them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from lab._names import check_tags, storable_text
from lab.errors import NoRun
from lab.store.engine import transaction
from lab.store.reads import experiment_id
from lab.store.schema import (
    SqlExperiment,
    SqlRun,
)

if TYPE_CHECKING:
    from lab.store.records import Annotations


class TagWrites:
    """The part of `lab.store.Store` that writes tags and notes, in the store behind
    `engine` (of `dialect`: ``sqlite`` or ``postgresql``)."""

    def __init__(self, engine: Engine, dialect: str) -> None:
        self.engine = engine
        self.dialect = dialect

    def tag(
        self,
        experiment: str,
        run_key: str | None = None,
        *,
        add: Sequence[str] = (),
        remove: Sequence[str] = (),
        notes: str | None = None,
    ) -> Annotations:
        """Add and remove tags of an experiment (or of one of its runs), and set its notes
        (``""`` clears them); returns its tags and notes as they are now.

        Tags are plain strings, as in W&B: kept in the order they were added, each once.
        An unknown experiment or run is a `NoExperiment` / `NoRun` that lists the known ones.
        """
        add, remove = check_tags(add), check_tags(remove)
        with transaction(self.engine) as conn:
            exp_id = experiment_id(conn, experiment)
            if run_key is None:
                where = SqlExperiment.experiment_id == exp_id
                return annotate(conn, self.dialect, SqlExperiment, where, add, remove, notes)
            where = sa.and_(SqlRun.experiment_id == exp_id, SqlRun.run_key == run_key)
            if conn.execute(sa.select(SqlRun.run_id).where(where)).first() is None:
                keys = conn.execute(
                    sa.select(SqlRun.run_key).where(SqlRun.experiment_id == exp_id)
                ).scalars().all()  # fmt: skip
                raise NoRun(
                    f"experiment {experiment!r} has no run {run_key!r}; its runs: "
                    f"{', '.join(sorted(keys)) or 'none'}"
                )
            return annotate(conn, self.dialect, SqlRun, where, add, remove, notes)


def annotate(
    conn: Connection,
    dialect: str,
    model: Any,
    where: Any,
    add: list[str],
    remove: list[str],
    notes: str | None,
) -> Annotations:
    """Change one row's tags and notes inside the caller's write transaction (on PostgreSQL
    the row is locked first, so two writers never lose each other's tags)."""
    read = sa.select(model.tags, model.notes).where(where)
    if dialect == "postgresql":
        read = read.with_for_update()  # SQLite: the transaction holds the write lock
    current, old_notes = conn.execute(read).one()
    tags = [t for t in current or [] if t not in remove]
    tags += [t for t in dict.fromkeys(add) if t not in tags]
    values: dict[str, Any] = {"tags": tags or None}
    if notes is not None:  # free text: NUL as U+FFFD, as in errors
        values["notes"] = storable_text(notes) or None
    conn.execute(sa.update(model).where(where).values(**values))
    return {"tags": tags, "notes": values.get("notes", old_notes)}
